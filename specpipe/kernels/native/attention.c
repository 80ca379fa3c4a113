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
 *   - q . k over D: eight lane accumulators over consecutive chunks of eight values (a tail
 *     goes to lanes 0..), then the lanes folded as ((0+1)+(2+3))+((4+5)+(6+7));
 *   - the maximum (exact in any order), exp(s - max) with the C library's expf;
 *   - the denominator and each output value: one running sum in double over the visible slots
 *     in read order (a masked slot is skipped, not added as zero, so nothing depends on C),
 *     rounded to float once at the end.
 * The vector type is lane-wise only (no horizontal operations before the fixed fold) and the
 * build has -ffp-contract=off, so every ISA the compiler picks gives the same bits.
 *
 * Layouts (row-major, contiguous): q (t, hq, d), k and v (c, hkv, d), mask (t, c) bytes
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

SP_INLINE float dot(const float *a, const float *b, int d) {
  v8f acc = {0};
  int i = 0;
  for (; i + 8 <= d; i += 8) acc += ld8f(a + i) * ld8f(b + i);
  for (int r = 0; i < d; i++, r++) acc[r] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* one (row, query head): s is scratch for c scores */
SP_INLINE void attend_one(const float *q, const float *k, const float *v, const uint8_t *mask,
                              int64_t c, int hkv, int g, int d, float scale, float *s, double *acc,
                              float *out) {
  const int64_t stride = (int64_t)hkv * d;
  float m = -INFINITY;
  for (int64_t j = 0; j < c; j++) {
    if (mask && !mask[j]) continue;
    s[j] = dot(q, k + j * stride + (int64_t)g * d, d) * scale;
    if (s[j] > m) m = s[j];
  }
  double sum = 0.0;
  for (int i = 0; i < d; i++) acc[i] = 0.0;
  for (int64_t j = 0; j < c; j++) {
    if (mask && !mask[j]) continue;
    const double e = expf(s[j] - m);
    const float *vj = v + j * stride + (int64_t)g * d;
    sum += e;
    for (int i = 0; i < d; i++) acc[i] += e * vj[i]; /* lane i: its own running sum over j */
  }
  for (int i = 0; i < d; i++) out[i] = (float)(acc[i] / sum);
}

SP_INLINE int attention_body(const float *q, int64_t t, int hq, int hkv, int d, const float *k,
                                 const float *v, int64_t c, const uint8_t *mask, float scale,
                                 float *out, int threads) {
  const int64_t pairs = t * hq;
  const int group = hq / hkv;
  int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
  {
    float *s = malloc((size_t)c * sizeof(float));
    double *acc = malloc((size_t)d * sizeof(double));
    if (!s || !acc) failed = 1;
    /* every thread reaches the loop (and its barrier), with or without its scratch */
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
      if (!s || !acc) continue;
      attend_one(q + p * d, k, v, mask ? mask + (p / hq) * c : NULL, c, hkv, (int)(p % hq) / group,
                 d, scale, s, acc, out + p * d);
    }
    free(s);
    free(acc);
  }
  return failed ? SP_ERR_MEMORY : SP_OK;
}

static int attention_portable(const float *q, int64_t t, int hq, int hkv, int d, const float *k,
                              const float *v, int64_t c, const uint8_t *mask, float scale,
                              float *out, int threads) {
  return attention_body(q, t, hq, hkv, d, k, v, c, mask, scale, out, threads);
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2"))) static int attention_avx2(const float *q, int64_t t, int hq,
                                                          int hkv, int d, const float *k,
                                                          const float *v, int64_t c,
                                                          const uint8_t *mask, float scale,
                                                          float *out, int threads) {
  return attention_body(q, t, hq, hkv, d, k, v, c, mask, scale, out, threads);
}
#endif

int sp_attention(const float *q, int64_t t, int hq, int hkv, int d, const float *k, const float *v,
                 int64_t c, const uint8_t *mask, float scale, float *out, int threads, int isa) {
  if (t < 0 || c < 1 || hq < 1 || hkv < 1 || d < 1 || hq % hkv) return SP_ERR_SHAPE;
  if (threads < 1) threads = 1;
#if defined(__x86_64__) || defined(__i386__)
  if (isa == SP_ISA_AVX2 || isa == SP_ISA_AVX512VNNI)
    return attention_avx2(q, t, hq, hkv, d, k, v, c, mask, scale, out, threads);
#endif
  (void)isa;
  return attention_portable(q, t, hq, hkv, d, k, v, c, mask, scale, out, threads);
}
