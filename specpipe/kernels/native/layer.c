/* One decoder layer of the Llama family (Llama, SmolLM2, Qwen2, Mistral) in one call.
 *
 *   h = rmsnorm(x)                     q|k|v = h @ Wqkv^T (+ bias)    q, k rotated (rope)
 *   k, v stored in their cache slots   a = attention per segment      x1 = x + a @ Wo^T
 *   h = rmsnorm(x1)                    g|u = h @ Wgu^T                out = x1 + (silu(g) * u) @ Wd^T
 *
 * Why: a layer written in torch is ~25 small calls per step (norms, projections, splits, rope,
 * cache writes, attention, adds, the activation), each a few microseconds of dispatch; on the
 * narrow models SpecPipe drafts with (SmolLM2, Qwen2.5-0.5B) that was about a quarter of a
 * decode step.  Here it is one call, and every part is the library's own per-row code
 * (sp_rmsnorm, sp_matmul, sp_rope_row, sp_attention_slots) or a single IEEE operation per element
 * (bias and residual adds, silu_mul below), so:
 *   - each output row depends only on its own input row and the cache slots it reads: the same
 *     bits whatever the other rows, the thread count or the ISA (batch invariance);
 *   - the result equals, bitwise, the torch-written layer of model/llama.py when that runs on the
 *     same native parts (tests/kernels/test_fused_layer.py).
 *
 * Layouts (row-major, contiguous, float32): x and out (t, hidden); cos, sin (t, rot); the layer's
 * cache kc, vc (num_slots, hkv, d); write_slots (t,); a segment's rows [start, end) read the cache
 * rows slots[0 .. c) (or first .. first + c - 1) under mask (end - start, c) bytes, nonzero = may
 * attend.  Every row's K/V is written before any segment attends (a segment may read another's).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_matmul.h"
#include "vec.h"

/* Below this many multiply-adds a segment's attention runs on the calling thread (waking the
 * thread team costs more); kernels/native/__init__.py uses the same bound. */
#define ATTENTION_THREADED_WORK (1 << 17)

/* silu(g) * u, element-wise: silu(g) = g * sigmoid(g) with sigmoid from e = exp(-|g|) (exp8's
 * domain, never overflowing): 1 / (1 + e) for g >= 0, e / (1 + e) below. */
SP_INLINE v8f silu_mul8(v8f g, v8f u) {
  const v8f one = {1, 1, 1, 1, 1, 1, 1, 1};
  const v8i neg = g < 0, sign = (v8i){0} + INT32_MIN;
  const v8f e = exp8((v8f)((v8i)g | sign)); /* exp(-|g|) */
  const v8f num = (v8f)(((v8i)e & neg) | ((v8i)one & ~neg));
  return g * (num / (one + e)) * u;
}

/* One row of silu_mul8 (a tail through a padded vector: the same lane arithmetic), compiled per
 * ISA below: element-wise IEEE operations, so every ISA gives the same bits. */
SP_INLINE void silu_mul_row(const float *g, const float *u, int64_t n, float *y) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8f r = silu_mul8(ld8f(g + j), ld8f(u + j));
    memcpy(y + j, &r, sizeof r);
  }
  if (j < n) {
    float a[8] = {0}, b[8] = {0};
    memcpy(a, g + j, (size_t)(n - j) * sizeof(float));
    memcpy(b, u + j, (size_t)(n - j) * sizeof(float));
    const v8f r = silu_mul8(ld8f(a), ld8f(b));
    memcpy(y + j, &r, (size_t)(n - j) * sizeof(float));
  }
}
typedef void (*silu_fn)(const float *, const float *, int64_t, float *);
static void silu_mul_row_portable(const float *g, const float *u, int64_t n, float *y) { silu_mul_row(g, u, n, y); }
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2"))) static void silu_mul_row_avx2(const float *g, const float *u, int64_t n, float *y) {
  silu_mul_row(g, u, n, y);
}
#endif

int sp_silu_mul(const float *g, const float *u, int64_t t, int64_t n, int64_t gstride,
                int64_t ustride, float *y, int isa) {
  int64_t size;
  if (t < 0 || n < 0 || !sp_mul_ok(t, n, &size)) return SP_ERR_SHAPE;
  silu_fn fn = silu_mul_row_portable;
#if defined(__x86_64__) || defined(__i386__)
  if (isa == SP_ISA_AVX2 || sp_vector_isa(isa) == SP_ISA_AVX512VNNI) fn = silu_mul_row_avx2; /* 8 lanes: one ymm */
#endif
  (void)isa;
  for (int64_t i = 0; i < t; i++) fn(g + i * gstride, u + i * ustride, n, y + i * n);
  return SP_OK;
}

/* y[:, col .. col + n) (row stride ystride) = x @ W^T (+ bias) for each projection of a group,
 * the group's outputs side by side; tmp holds one projection's (t, n) when it cannot be written
 * in place.  The shapes were checked (group_ok) before anything was written. */
static int project(const sp_proj *p, int32_t count, const float *x, int64_t t, int64_t k, float *y,
                   int64_t ystride, float *tmp, int threads, int isa) {
  int64_t col = 0;
  for (int32_t g = 0; g < count; g++, p++) {
    const int direct = count == 1 && p->n == ystride;
    float *dst = direct ? y : tmp;
    int rc = sp_matmul(p->type, x, t, k, p->w, p->n, p->row_bytes, dst, threads, isa);
    if (rc != SP_OK) return rc;
    for (int64_t i = 0; i < t; i++) {
      float *yi = y + i * ystride + col;
      const float *si = dst + i * p->n;
      if (p->bias)
        for (int64_t j = 0; j < p->n; j++) yi[j] = si[j] + p->bias[j];
      else if (!direct)
        memcpy(yi, si, (size_t)p->n * sizeof(float));
    }
    col += p->n;
  }
  return SP_OK;
}

/* A group of `count` projections of k inputs whose outputs, side by side, are n wide: each a
 * known type with rows of k values (row_bytes agreeing), at least one row, the sum exactly n. */
static int group_ok(const sp_proj *p, int32_t count, int64_t k, int64_t n) {
  int64_t total = 0, rb;
  for (int32_t g = 0; g < count; g++, p++) {
    if (!p->w || p->n < 1 || p->n > n - total) return 0;
    if (sp_row_bytes(p->type, k, &rb) != SP_OK || rb != p->row_bytes) return 0;
    total += p->n;
  }
  return total == n;
}

static int64_t widest(const sp_proj *p, int32_t count) {
  int64_t n = 0;
  for (int32_t g = 0; g < count; g++) n = p[g].n > n ? p[g].n : n;
  return n;
}

/* Every write slot and read slot within the cache, the segments covering rows [0, t) in order
 * (range checks that cannot wrap: a first near INT64_MAX is refused, not wrapped negative). */
static int slots_ok(int64_t t, int64_t num_slots, const int64_t *write_slots,
                    int32_t nseg, const sp_segment *segs) {
  if (nseg < 0 || (nseg > 0 && !segs) || !write_slots) return 0;
  for (int64_t i = 0; i < t; i++)
    if (!sp_range_ok(write_slots[i], 1, num_slots)) return 0;
  int64_t row = 0;
  for (int32_t s = 0; s < nseg; s++) {
    const sp_segment *sg = segs + s;
    if (sg->start != row || sg->end < sg->start || sg->end > t || sg->c < 1) return 0;
    row = sg->end;
    if (sg->slots) {
      for (int64_t j = 0; j < sg->c; j++)
        if (!sp_range_ok(sg->slots[j], 1, num_slots)) return 0;
    } else if (!sp_range_ok(sg->first, sg->c, num_slots)) {
      return 0;
    }
  }
  return row == t;
}

/* rows * hq * c * d >= ATTENTION_THREADED_WORK, a product that may not fit. */
static int threaded_work(int64_t rows, int64_t hq, int64_t c, int64_t d) {
  int64_t w;
  return !(sp_mul_ok(rows, hq, &w) && sp_mul_ok(w, c, &w) && sp_mul_ok(w, d, &w)) ||
         w >= ATTENTION_THREADED_WORK;
}

int sp_decoder_layer(const sp_layer *L, const float *x, int64_t t, const float *cos_,
                     const float *sin_, int64_t rot, float *kc, float *vc, int64_t num_slots,
                     const int64_t *write_slots, int32_t nseg, const sp_segment *segs, float *out,
                     int threads, int isa) {
  /* Every shape is checked here, before anything is written (the scratch, the caches, out). */
  if (!L || !x || !cos_ || !sin_ || !kc || !vc || !out) return SP_ERR_SHAPE;
  const int64_t hd = L->hidden, inter = L->inter, d = L->d, hq = L->hq, hkv = L->hkv;
  if (t < 1 || hd < 1 || inter < 1 || d < 1 || hq < 1 || hkv < 1 || hq % hkv ||
      hq / hkv > SP_MAX_GROUP || rot < 2 || rot > d || rot % 2 || L->n_qkv < 1 || L->n_qkv > 3 ||
      L->n_gu < 1 || L->n_gu > 2 || !L->in_norm || !L->post_norm)
    return SP_ERR_SHAPE;
  /* hq, hkv, d are int32, so nq and nkv fit; hd and inter are bounded so that no sum wraps */
  const int64_t nq = hq * d, nkv = hkv * d, nqkv = nq + 2 * nkv, big = INT64_MAX / 16;
  int64_t cache, scratch;
  if (hd > big || inter > big || !sp_mul_ok(num_slots, nkv, &cache)) return SP_ERR_SHAPE;
  if (!group_ok(L->qkv, L->n_qkv, hd, nqkv) || !group_ok(&L->o, 1, nq, hd) ||
      !group_ok(L->gu, L->n_gu, hd, 2 * inter) || !group_ok(&L->down, 1, inter, hd))
    return SP_ERR_SHAPE;
  if (!slots_ok(t, num_slots, write_slots, nseg, segs)) return SP_ERR_SHAPE;
  if (threads < 1) threads = 1;
  /* tmp: the widest projection that is not written in place (o and down are: n == hd) */
  int64_t wide = widest(L->qkv, L->n_qkv);
  const int64_t wgu = widest(L->gu, L->n_gu);
  wide = wgu > wide ? wgu : wide;
  /* scratch: h (hd) | qkv (nqkv) | q (nq) | a (nq) | o (hd) | gu (2 inter) | act (inter) | tmp */
  const int64_t per_row = hd + nqkv + 2 * nq + hd + 3 * inter + wide;
  if (!sp_mul_ok(t, per_row, &scratch) || scratch > big) return SP_ERR_SHAPE;
  float *buf = malloc((size_t)scratch * sizeof(float));
  if (!buf) return SP_ERR_MEMORY;
  float *h = buf, *qkv = h + t * hd, *q = qkv + t * nqkv, *a = q + t * nq, *o = a + t * nq,
        *gu = o + t * hd, *act = gu + t * 2 * inter, *tmp = act + t * inter;
  int rc;

  /* attention block */
  if ((rc = sp_rmsnorm(x, t, hd, L->in_norm, L->eps, h)) != SP_OK) goto done;
  if ((rc = project(L->qkv, L->n_qkv, h, t, hd, qkv, nqkv, tmp, threads, isa)) != SP_OK) goto done;
  for (int64_t i = 0; i < t; i++) {
    const float *row = qkv + i * nqkv, *c = cos_ + i * rot, *s = sin_ + i * rot;
    const int64_t slot = write_slots[i] * nkv;
    sp_rope_row(row, hq, d, rot, c, s, q + i * nq);
    sp_rope_row(row + nq, hkv, d, rot, c, s, kc + slot);
    memcpy(vc + slot, row + nq + nkv, (size_t)nkv * sizeof(float));
  }
  for (int32_t sg = 0; sg < nseg; sg++) {
    const sp_segment *S = segs + sg;
    const int64_t rows = S->end - S->start;
    if (rows == 0) continue;
    const int64_t off = S->slots ? 0 : S->first * nkv;
    const int th = threaded_work(rows, hq, S->c, d) ? threads : 1;
    rc = sp_attention_slots(q + S->start * nq, rows, (int)hq, (int)hkv, (int)d, kc + off, vc + off,
                            S->slots, S->c, S->mask, L->scale, a + S->start * nq, th, isa);
    if (rc != SP_OK) goto done;
  }
  if ((rc = project(&L->o, 1, a, t, nq, o, hd, tmp, threads, isa)) != SP_OK) goto done;
  for (int64_t i = 0; i < t * hd; i++) out[i] = x[i] + o[i];

  /* MLP block */
  if ((rc = sp_rmsnorm(out, t, hd, L->post_norm, L->eps, h)) != SP_OK) goto done;
  if ((rc = project(L->gu, L->n_gu, h, t, hd, gu, 2 * inter, tmp, threads, isa)) != SP_OK) goto done;
  if ((rc = sp_silu_mul(gu, gu + inter, t, inter, 2 * inter, 2 * inter, act, isa)) != SP_OK) goto done;
  if ((rc = project(&L->down, 1, act, t, inter, o, hd, tmp, threads, isa)) != SP_OK) goto done;
  for (int64_t i = 0; i < t * hd; i++) out[i] = out[i] + o[i];
done:
  free(buf);
  return rc;
}
