/* Attention whose every output row depends only on the keys that row sees, in their order.
 *
 * out[i, h] = sum_j softmax_j(scale * q[i, h] . k[j, g]) v[j, g] over the read slots j that
 * mask[i, j] allows (all when mask is NULL), g = h / (hq / hkv) the KV head of query head h.
 * With sinks (gpt-oss, sp_attention_sinks): sinks[h] joins head h's softmax as one more score
 * that has no value -- the maximum is taken over it too, and exp(sinks[h] - max) starts the
 * denominator's sum, before the slots' weights in read order.
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
 * The query heads that share a KV head, and up to eight rows, are computed together, so each
 * key and value is read once per block of rows and KV head (from L1 for all but the first of
 * them); the scores eight slots at a time (their last folds done on transposed lanes), the
 * value sums for a block of heads at once over 32 slots held in L1, row after row.
 * Only the interleaving changes with the shapes, never a sum's order: a head's arithmetic is
 * the same alone (and is the same as in the one-slot, one-head loops this replaced: 0.53-0.84x
 * their time, docs/native_kernels.md).
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

/* (v8f, v16f, ld8f, ld16f: vec.h) */

/* The eight lanes of a, then of b, summed in pairs: {a0+a1, a2+a3, a4+a5, a6+a7, b0+b1, ...}. */
SP_INLINE v8f pair_sums(v8f a, v8f b) {
#ifdef __clang__
  const v8f even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
  const v8f odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#else
  const v8f even = __builtin_shuffle(a, b, (v8i){0, 2, 4, 6, 8, 10, 12, 14});
  const v8f odd = __builtin_shuffle(a, b, (v8i){1, 3, 5, 7, 9, 11, 13, 15});
#endif
  return even + odd;
}

/* q . k[r] for the eight keys k[0 .. 8), each summed as described at the top: sixteen lane sums,
 * the halves added, the eight folded ((0+1)+(2+3))+((4+5)+(6+7)) -- the fold done for the eight
 * keys at once, on their sums transposed by pair_sums (the same additions in the same order). */
SP_INLINE v8f dot8(const float *q, const float *const k[8], int d) {
  v16f acc[8];
  for (int r = 0; r < 8; r++) acc[r] = (v16f){0};
  int i = 0;
  for (; i + 16 <= d; i += 16) {
    const v16f qi = ld16f(q + i);
    for (int r = 0; r < 8; r++) acc[r] += qi * ld16f(k[r] + i);
  }
  for (int l = 0; i < d; i++, l++)
    for (int r = 0; r < 8; r++) acc[r][l] += q[i] * k[r][i];
  v8f h[8];
  for (int r = 0; r < 8; r++) {
    v8f lo, hi; /* the two halves (memcpy: any GCC or Clang with vector extensions) */
    memcpy(&lo, &acc[r], sizeof lo);
    memcpy(&hi, (const char *)&acc[r] + sizeof lo, sizeof hi);
    h[r] = lo + hi;
  }
  const v8f p01 = pair_sums(h[0], h[1]), p23 = pair_sums(h[2], h[3]);
  const v8f p45 = pair_sums(h[4], h[5]), p67 = pair_sums(h[6], h[7]);
  return pair_sums(pair_sums(p01, p23), pair_sums(p45, p67));
}

/* Up to how many bytes of a KV head's keys and values attend_rows fetches at its start, before
 * the scores read them 8 slots at a time: a decode step's cache has left L2 while the layer's
 * weights streamed by, and one burst of fetches is paced by the memory, not by its latency
 * (benchmarks/stage_costs.py attention, 128 slots of Qwen2.5-1.5B's shape: 65 -> 45-48 us a layer,
 * Xeon Sapphire Rapids, one thread).
 * Larger ones (long contexts) are read as they come: fetched at once they would not fit L2. */
#ifndef SP_ATT_PREFETCH
#define SP_ATT_PREFETCH (256 << 10)
#endif

/* The most query heads whose value sums are kept in registers at once. */
#define SP_ATT_HEADS 8

/* Heads [0, hb) of a block, over the visible slots n in [n0, n1), in order: sum[h] += e[h][n]
 * (double) and acc[h * d + i] += e[h][n] v[n][i], each a running sum of its own.  The slots go
 * in the inner loop, the sixteen-value chunks in the outer, so the block's sums of one chunk
 * stay in registers while the slots' values are read from L1. */
SP_INLINE void values_block(const float *const *vp, const float *e, int64_t c8, int64_t n0,
                            int64_t n1, int hb, int d, double *sum, float *acc) {
  double w[SP_ATT_HEADS];
  for (int h = 0; h < hb; h++) w[h] = sum[h];
  for (int64_t n = n0; n < n1; n++)
    for (int h = 0; h < hb; h++) w[h] += e[h * c8 + n];
  for (int h = 0; h < hb; h++) sum[h] = w[h];
  int i = 0;
  for (; i + 16 <= d; i += 16) {
    v16f a[SP_ATT_HEADS];
    for (int h = 0; h < hb; h++) a[h] = ld16f(acc + h * d + i);
    for (int64_t n = n0; n < n1; n++) {
      const v16f vn = ld16f(vp[n] + i);
      for (int h = 0; h < hb; h++) a[h] += e[h * c8 + n] * vn;
    }
    for (int h = 0; h < hb; h++) memcpy(acc + h * d + i, &a[h], sizeof a[h]);
  }
  for (; i < d; i++)
    for (int h = 0; h < hb; h++) {
      float a = acc[h * d + i];
      for (int64_t n = n0; n < n1; n++) a += e[h * c8 + n] * vp[n][i];
      acc[h * d + i] = a;
    }
}

/* The slots of a head block's value sums that stay in L1 while its chunks are summed. */
#define SP_ATT_SLOTS 32
/* The most rows whose scores are computed over one read of a block of keys. */
#define SP_ATT_ROWS 8

/* Scratch of one thread for rows x group heads over c slots. */
typedef struct {
  float *s;         /* rows x group x c8 scores, then weights (row-major) */
  v8f *mv;          /* rows x group: lane r the largest visible score among slots r mod 8 */
  double *sum;      /* rows x group denominators */
  float *acc;       /* rows x group x d value sums */
  const float **vp; /* c: the values of the KV head, in read order */
  const float **vl; /* SP_ATT_SLOTS: a block's visible values (a row with masked slots in it) */
  float *el;        /* group x SP_ATT_SLOTS: their weights */
} att_scratch;

/* The value sums of one row over the visible slots [n0, n1) of vp and e (weights of head h at
 * e[h * stride + n]), `heads` at a time. */
SP_INLINE void values_row(const float *const *vp, const float *e, int64_t stride, int64_t n0,
                          int64_t n1, int group, int d, int heads, double *sum, float *acc) {
  for (int h0 = 0; h0 < group; h0 += heads) {
    const int hb = group - h0 < heads ? group - h0 : heads;
    const float *eh = e + h0 * stride;
    double *w = sum + h0;
    float *a = acc + h0 * d;
    switch (hb) { /* the block's size as a constant: its sums in registers */
    case 1: values_block(vp, eh, stride, n0, n1, 1, d, w, a); break;
    case 2: values_block(vp, eh, stride, n0, n1, 2, d, w, a); break;
    case 3: values_block(vp, eh, stride, n0, n1, 3, d, w, a); break;
    case 4: values_block(vp, eh, stride, n0, n1, 4, d, w, a); break;
    case 5: values_block(vp, eh, stride, n0, n1, 5, d, w, a); break;
    case 6: values_block(vp, eh, stride, n0, n1, 6, d, w, a); break;
    case 7: values_block(vp, eh, stride, n0, n1, 7, d, w, a); break;
    default: values_block(vp, eh, stride, n0, n1, SP_ATT_HEADS, d, w, a);
    }
  }
}

/* Rows [0, nrows) and KV head g: each row's `group` query heads that read it (q of row r at
 * q + r * qstride, its mask at mask + r * c).  Every block of keys and values is read once for
 * all the rows, each row's sums taking the slots it sees in read order as described at the
 * top, so a row's result is the same in any set of rows. */
SP_INLINE void attend_rows(const float *q, int64_t qstride, const float *k, const float *v,
                           const int64_t *slots, const uint8_t *mask, int64_t c, int nrows,
                           int hkv, int g, int group, int d, float scale, const float *sinks,
                           int heads, const att_scratch *W, float *out) {
  const int64_t stride = (int64_t)hkv * d, c8 = (c + 7) / 8 * 8;
  const int rh = nrows * group;
  const v8f none = (v8f){0} - INFINITY;
  if (c * d * 2 * (int64_t)sizeof(float) <= SP_ATT_PREFETCH) /* the KV head's keys and values at once */
    for (int64_t j = 0; j < c; j++) {
      const int64_t at = (slots ? slots[j] : j) * stride + (int64_t)g * d;
      for (int b = 0; b < d; b += 16) {
        __builtin_prefetch(k + at + b);
        __builtin_prefetch(v + at + b);
      }
    }
  for (int x = 0; x < rh; x++) W->mv[x] = none, W->sum[x] = 0.0;
  for (int64_t j0 = 0; j0 < c; j0 += 8) { /* the scores, eight slots at a time */
    const float *kr[8];
    for (int r = 0; r < 8; r++) {
      const int64_t j = j0 + r < c ? j0 + r : c - 1; /* past the end: a copy, never used */
      kr[r] = k + (slots ? slots[j] : j) * stride + (int64_t)g * d;
    }
    for (int i = 0; i < nrows; i++) {
      const uint8_t *mi = mask ? mask + i * c : NULL;
      v8i seen; /* lane r: -1 where slot j0 + r exists and row i sees it */
      int any = 0;
      for (int r = 0; r < 8; r++) {
        seen[r] = j0 + r < c && (!mi || mi[j0 + r]) ? -1 : 0;
        any |= seen[r];
      }
      if (!any) continue; /* (masked scores are computed, never read) */
      for (int h = 0; h < group; h++) {
        const int x = i * group + h;
        const v8f sc = dot8(q + i * qstride + h * d, kr, d) * scale;
        memcpy(W->s + x * c8 + j0, &sc, sizeof sc);
        const v8i up = seen & (sc > W->mv[x]);
        W->mv[x] = (v8f)(((v8i)sc & up) | ((v8i)W->mv[x] & ~up));
      }
    }
  }
  for (int x = 0; x < rh; x++) { /* the weights: exp(score - maximum), the maximum exact */
    float m = -INFINITY;
    for (int r = 0; r < 8; r++)
      if (W->mv[x][r] > m) m = W->mv[x][r];
    if (sinks) { /* the head's sink: in the maximum, and the first term of the denominator */
      const float sink = sinks[x % group];
      if (sink > m) m = sink;
      const v8f es = exp8((v8f){0} + (sink - m));
      W->sum[x] = es[0];
    }
    float *sx = W->s + x * c8;
    for (int64_t j = c; j < c8; j++) sx[j] = m;
    for (int64_t j = 0; j < c8; j += 8) {
      const v8f e = exp8(ld8f(sx + j) - m);
      memcpy(sx + j, &e, sizeof e);
    }
  }
  for (int64_t j = 0; j < c; j++) W->vp[j] = v + (slots ? slots[j] : j) * stride + (int64_t)g * d;
  memset(W->acc, 0, (size_t)rh * d * sizeof *W->acc);
  for (int64_t j0 = 0; j0 < c; j0 += SP_ATT_SLOTS) { /* the value sums, 32 slots in L1 */
    const int64_t j1 = c - j0 < SP_ATT_SLOTS ? c : j0 + SP_ATT_SLOTS;
    for (int i = 0; i < nrows; i++) {
      const float *e = W->s + (int64_t)i * group * c8;
      double *sum = W->sum + i * group;
      float *acc = W->acc + (int64_t)i * group * d;
      const uint8_t *mi = mask ? mask + i * c : NULL;
      if (!mi || !memchr(mi + j0, 0, (size_t)(j1 - j0))) { /* the row sees the whole block */
        values_row(W->vp, e, c8, j0, j1, group, d, heads, sum, acc);
        continue;
      }
      int64_t nv = 0;
      for (int64_t j = j0; j < j1; j++) /* its visible slots moved to the front */
        if (mi[j]) {
          W->vl[nv] = W->vp[j];
          for (int h = 0; h < group; h++) W->el[h * SP_ATT_SLOTS + nv] = e[h * c8 + j];
          nv++;
        }
      if (nv) values_row(W->vl, W->el, SP_ATT_SLOTS, 0, nv, group, d, heads, sum, acc);
    }
  }
  for (int i = 0; i < nrows; i++)
    for (int h = 0; h < group; h++) {
      const int x = i * group + h;
      for (int e = 0; e < d; e++)
        out[i * qstride + h * d + e] = (float)(W->acc[(int64_t)x * d + e] / W->sum[x]);
    }
}

/* attend_rows compiled per ISA (the parallel region below is outlined by the compiler into a
 * function of its own, which would not inherit a target attribute: it calls these instead). */
typedef void (*rows_fn)(const float *, int64_t, const float *, const float *, const int64_t *,
                        const uint8_t *, int64_t, int, int, int, int, int, float, const float *,
                        const att_scratch *, float *);
/* heads: the value sums' head block, as many as the ISA's registers hold (a v16f is one
 * AVX-512 register, two AVX2 ones, four SSE ones) */
#define SP_ROWS_FN(name, attr, heads)                                                            \
  attr static void name(const float *q, int64_t qs, const float *k, const float *v,             \
                        const int64_t *slots, const uint8_t *mask, int64_t c, int nrows, int hkv, \
                        int g, int group, int d, float scale, const float *sk,                \
                        const att_scratch *W, float *out) {                                     \
    if (d == 64) /* the common head sizes as constants: loops unrolled */                       \
      attend_rows(q, qs, k, v, slots, mask, c, nrows, hkv, g, group, 64, scale, sk, heads, W, out); \
    else if (d == 128)                                                                           \
      attend_rows(q, qs, k, v, slots, mask, c, nrows, hkv, g, group, 128, scale, sk, heads, W, out); \
    else                                                                                         \
      attend_rows(q, qs, k, v, slots, mask, c, nrows, hkv, g, group, d, scale, sk, heads, W, out); \
  }
SP_ROWS_FN(attend_rows_portable, , 2)
#if defined(__x86_64__) || defined(__i386__)
SP_ROWS_FN(attend_rows_avx2, __attribute__((target("avx2"))), 4)
SP_ROWS_FN(attend_rows_avx512, __attribute__((target("avx512f"))), SP_ATT_HEADS)
#endif
#undef SP_ROWS_FN

static int attention_body(rows_fn fn, const float *q, int64_t t, int hq, int hkv, int d,
                          const float *k, const float *v, const int64_t *slots, int64_t c,
                          const uint8_t *mask, float scale, const float *sinks, float *out,
                          int threads) {
  const int64_t c8 = (c + 7) / 8 * 8, qs = (int64_t)hq * d;
  const int group = hq / hkv;
  /* rows per block: up to SP_ATT_ROWS, fewer where the blocks would not feed every thread
   * (a row's result is the same in any block) */
  int64_t rb = t * hkv / threads;
  rb = rb < 1 ? 1 : rb > SP_ATT_ROWS ? SP_ATT_ROWS : rb;
  const int64_t blocks = (t + rb - 1) / rb, items = blocks * hkv;
  const size_t rh = (size_t)(rb * group);
  int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed) if (threads > 1)
  {
    att_scratch W = {
        .s = malloc(rh * c8 * sizeof(float)),
        .mv = aligned_alloc(64, (rh * sizeof(v8f) + 63) / 64 * 64),
        .sum = malloc(rh * sizeof(double)),
        .acc = malloc(rh * d * sizeof(float)),
        .vp = malloc((size_t)c * sizeof(float *)),
        .vl = malloc(SP_ATT_SLOTS * sizeof(float *)),
        .el = malloc((size_t)group * SP_ATT_SLOTS * sizeof(float)),
    };
    const int ok = W.s && W.mv && W.sum && W.acc && W.vp && W.vl && W.el;
    if (!ok) failed = 1;
    /* every thread reaches the loop (and its barrier), with or without its scratch */
#pragma omp for schedule(static)
    for (int64_t p = 0; p < items; p++) { /* p = (row block, KV head) */
      if (!ok) continue;
      const int64_t row = p / hkv * rb, n = t - row < rb ? t - row : rb;
      const int g = (int)(p % hkv);
      const int64_t off = row * qs + (int64_t)g * group * d;
      fn(q + off, qs, k, v, slots, mask ? mask + row * c : NULL, c, (int)n, hkv, g, group, d,
         scale, sinks ? sinks + (int64_t)g * group : NULL, &W, out + off);
    }
    free(W.s);
    free(W.mv);
    free(W.sum);
    free(W.acc);
    free((void *)W.vp);
    free((void *)W.vl);
    free(W.el);
  }
  return failed ? SP_ERR_MEMORY : SP_OK;
}

static int attention_checked(const float *q, int64_t t, int hq, int hkv, int d, const float *k,
                             const float *v, const int64_t *slots, int64_t c, const uint8_t *mask,
                             float scale, const float *sinks, float *out, int threads, int isa) {
  int64_t size;
  if (t < 0 || c < 1 || hq < 1 || hkv < 1 || d < 1 || hq % hkv || hq / hkv > SP_MAX_GROUP)
    return SP_ERR_SHAPE;
  /* no size below wraps: q and out (t, hq, d), k and v (c, hkv, d), a thread's scores
   * (SP_ATT_ROWS * group rows of c rounded up to 8 floats) */
  if (!sp_mul_ok(t, (int64_t)hq * d, &size) || !sp_mul_ok(c, (int64_t)hkv * d, &size) ||
      c > (INT64_MAX - 7) / ((int64_t)SP_ATT_ROWS * SP_MAX_GROUP * (int64_t)sizeof(float)))
    return SP_ERR_SHAPE;
  if (threads < 1) threads = 1;
  rows_fn fn = attend_rows_portable;
#if defined(__x86_64__) || defined(__i386__)
  if (sp_vector_isa(isa) == SP_ISA_AVX512VNNI) fn = attend_rows_avx512;
  else if (isa == SP_ISA_AVX2) fn = attend_rows_avx2;
#endif
  (void)isa;
  return attention_body(fn, q, t, hq, hkv, d, k, v, slots, c, mask, scale, sinks, out, threads);
}

int sp_attention_slots(const float *q, int64_t t, int hq, int hkv, int d, const float *k,
                       const float *v, const int64_t *slots, int64_t c, const uint8_t *mask,
                       float scale, float *out, int threads, int isa) {
  return attention_checked(q, t, hq, hkv, d, k, v, slots, c, mask, scale, NULL, out, threads, isa);
}

/* sp_attention with a sink logit per query head: sinks (hq) floats. */
int sp_attention_sinks(const float *q, int64_t t, int hq, int hkv, int d, const float *k,
                       const float *v, int64_t c, const uint8_t *mask, float scale,
                       const float *sinks, float *out, int threads, int isa) {
  return attention_checked(q, t, hq, hkv, d, k, v, NULL, c, mask, scale, sinks, out, threads, isa);
}

int sp_attention(const float *q, int64_t t, int hq, int hkv, int d, const float *k, const float *v,
                 int64_t c, const uint8_t *mask, float scale, float *out, int threads, int isa) {
  return sp_attention_slots(q, t, hq, hkv, d, k, v, NULL, c, mask, scale, out, threads, isa);
}
