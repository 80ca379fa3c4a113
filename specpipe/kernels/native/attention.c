/* Attention whose every output row depends only on the keys that row sees, in their order.
 *
 * out[i, h] = sum_j softmax_j(scale * q[i, h] . k[j, g]) v[j, g] over the read slots j that
 * mask[i, j] allows (all when mask is NULL), g = h / (hq / hkv) the KV head of query head h.
 *
 * Why not torch: a matmul (and torch.softmax) groups its additions by the shapes of the call,
 * so a row's result changes with the number of read slots C and with where the masked ones sit
 * (measured in tests/kernels/test_batch_invariance.py).  A tree node's row and the same token's
 * row computed by plain decoding must agree bitwise for speculation to be lossless.  Here every
 * sum has one order, fixed by the row alone:
 *   - q . k over D: sixteen lane accumulators over consecutive chunks of sixteen values (a
 *     tail goes to lanes 0..), lane i + 8 added to lane i, then the eight folded as
 *     ((0+1)+(2+3))+((4+5)+(6+7));
 *   - the maximum (exact in any order), exp(s - max) by exp8 (vec.h): an element-wise
 *     polynomial, so a slot's weight depends on its score alone (8 slots a vector);
 *   - each output value: one running float sum over the visible slots in read order (a masked
 *     slot is skipped, not added as zero, so nothing depends on C), the denominator the same in
 *     double; their quotient rounded to float once at the end.
 * The query heads that share a KV head are computed together, so each key and value is read
 * once per row and KV head (the arithmetic of a head is the same alone).
 * The vector type is lane-wise only (no horizontal operations before the fixed fold) and the
 * build has -ffp-contract=off, so every ISA the compiler picks gives the same bits.
 *
 * Layouts (row-major, contiguous): q (t, hq, d), k and v (c, hkv, d) (sp_attention_slots: a
 * pool whose rows slots[0 .. c) are read, in that order), mask (t, c) bytes
 * (nonzero = may attend), out (t, hq, d).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "ggml_matmul.h"
#include "vec.h"

typedef float v16f __attribute__((vector_size(64)));

SP_INLINE v16f ld16f(const float *p) {
  v16f v;
  memcpy(&v, p, sizeof v);
  return v;
}

SP_INLINE float dot(const float *a, const float *b, int d) {
  v16f acc = {0};
  int i = 0;
  for (; i + 16 <= d; i += 16) acc += ld16f(a + i) * ld16f(b + i);
  for (int r = 0; i < d; i++, r++) acc[r] += a[i] * b[i];
  v8f lo, hi; /* the two halves (memcpy: any GCC or Clang with vector extensions) */
  memcpy(&lo, &acc, sizeof lo);
  memcpy(&hi, (const char *)&acc + sizeof lo, sizeof hi);
  const v8f h = lo + hi;
  return ((h[0] + h[1]) + (h[2] + h[3])) + ((h[4] + h[5]) + (h[6] + h[7]));
}

/* One row and KV head g: the `group` query heads q[0 .. group) that read it.  s: scratch for
 * group x c8 weights (c8 = c rounded up to 8), acc: group x d floats. */
SP_INLINE void attend_group(const float *q, const float *k, const float *v, const int64_t *slots,
                            const uint8_t *mask, int64_t c, int hkv, int g, int group, int d,
                            float scale, float *s, float *acc, float *out) {
  const int64_t stride = (int64_t)hkv * d, c8 = (c + 7) / 8 * 8;
  float m[64];
  double sum[64];
  for (int h = 0; h < group; h++) m[h] = -INFINITY;
  for (int64_t j = 0; j < c; j++) {
    if (mask && !mask[j]) continue;
    const float *kj = k + (slots ? slots[j] : j) * stride + (int64_t)g * d;
    for (int h = 0; h < group; h++) {
      const float x = dot(q + h * d, kj, d) * scale;
      s[h * c8 + j] = x;
      if (x > m[h]) m[h] = x;
    }
  }
  for (int h = 0; h < group; h++) { /* weights of every slot (masked ones are never read) */
    float *sh = s + h * c8;
    for (int64_t j = c; j < c8; j++) sh[j] = m[h];
    for (int64_t j = 0; j < c8; j += 8) {
      const v8f e = exp8(ld8f(sh + j) - m[h]);
      memcpy(sh + j, &e, sizeof e);
    }
    for (int i = 0; i < d; i++) acc[h * d + i] = 0.f;
  }
  for (int h = 0; h < group; h++) { /* one head at a time: its sums stay in registers */
    const float *sh = s + h * c8;
    float *a = acc + h * d;
    double sh_sum = 0.0;
    for (int64_t j = 0; j < c; j++) {
      if (mask && !mask[j]) continue;
      const float *vj = v + (slots ? slots[j] : j) * stride + (int64_t)g * d;
      const float e = sh[j];
      sh_sum += e;
      int i = 0;
      for (; i + 16 <= d; i += 16) { /* lane i: its own running sum over j */
        v16f ai;
        memcpy(&ai, a + i, sizeof ai);
        ai += e * ld16f(vj + i);
        memcpy(a + i, &ai, sizeof ai);
      }
      for (; i < d; i++) a[i] += e * vj[i];
    }
    sum[h] = sh_sum;
  }
  for (int h = 0; h < group; h++)
    for (int i = 0; i < d; i++) out[h * d + i] = (float)(acc[h * d + i] / sum[h]);
}

/* attend_group compiled per ISA (the parallel region below is outlined by the compiler into a
 * function of its own, which would not inherit a target attribute: it calls these instead). */
typedef void (*group_fn)(const float *, const float *, const float *, const int64_t *,
                         const uint8_t *, int64_t, int, int, int, int, float, float *, float *,
                         float *);
#define SP_GROUP_FN(name, attr)                                                                  \
  attr static void name(const float *q, const float *k, const float *v, const int64_t *slots,   \
                        const uint8_t *mask, int64_t c, int hkv, int g, int group, int d,        \
                        float scale, float *s, float *acc, float *out) {                         \
    if (d == 64) /* the common head sizes as constants: loops unrolled, sums in registers */    \
      attend_group(q, k, v, slots, mask, c, hkv, g, group, 64, scale, s, acc, out);              \
    else if (d == 128)                                                                           \
      attend_group(q, k, v, slots, mask, c, hkv, g, group, 128, scale, s, acc, out);             \
    else                                                                                         \
      attend_group(q, k, v, slots, mask, c, hkv, g, group, d, scale, s, acc, out);               \
  }
SP_GROUP_FN(attend_group_portable, )
#if defined(__x86_64__) || defined(__i386__)
SP_GROUP_FN(attend_group_avx2, __attribute__((target("avx2"))))
SP_GROUP_FN(attend_group_avx512, __attribute__((target("avx512f"))))
#endif
#undef SP_GROUP_FN

static int attention_body(group_fn fn, const float *q, int64_t t, int hq, int hkv, int d,
                          const float *k, const float *v, const int64_t *slots, int64_t c,
                          const uint8_t *mask, float scale, float *out, int threads) {
  const int64_t pairs = t * hkv, c8 = (c + 7) / 8 * 8;
  const int group = hq / hkv;
  int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed) if (threads > 1)
  {
    float *s = malloc((size_t)(group * c8) * sizeof(float));
    float *acc = malloc((size_t)(group * d) * sizeof(float));
    if (!s || !acc) failed = 1;
    /* every thread reaches the loop (and its barrier), with or without its scratch */
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++) { /* p = (row, KV head) */
      if (!s || !acc) continue;
      const int64_t row = p / hkv;
      const int g = (int)(p % hkv);
      fn(q + (row * hq + (int64_t)g * group) * d, k, v, slots, mask ? mask + row * c : NULL, c, hkv,
         g, group, d, scale, s, acc, out + (row * hq + (int64_t)g * group) * d);
    }
    free(s);
    free(acc);
  }
  return failed ? SP_ERR_MEMORY : SP_OK;
}

int sp_attention_slots(const float *q, int64_t t, int hq, int hkv, int d, const float *k,
                       const float *v, const int64_t *slots, int64_t c, const uint8_t *mask,
                       float scale, float *out, int threads, int isa) {
  if (t < 0 || c < 1 || hq < 1 || hkv < 1 || d < 1 || hq % hkv || hq / hkv > 64) return SP_ERR_SHAPE;
  if (threads < 1) threads = 1;
  group_fn fn = attend_group_portable;
#if defined(__x86_64__) || defined(__i386__)
  if (isa == SP_ISA_AVX512VNNI) fn = attend_group_avx512;
  else if (isa == SP_ISA_AVX2) fn = attend_group_avx2;
#endif
  (void)isa;
  return attention_body(fn, q, t, hq, hkv, d, k, v, slots, c, mask, scale, out, threads);
}

int sp_attention(const float *q, int64_t t, int hq, int hkv, int d, const float *k, const float *v,
                 int64_t c, const uint8_t *mask, float scale, float *out, int threads, int isa) {
  return sp_attention_slots(q, t, hq, hkv, d, k, v, NULL, c, mask, scale, out, threads, isa);
}
