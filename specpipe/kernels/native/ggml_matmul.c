/*
 * y (T, N) float32 = x (T, K) float32 @ W(N, K)^T, W given as packed GGUF rows of one type.
 *
 * Method (as llama.cpp): each activation row is quantized once per call to int8 blocks with one
 * float scale per block (per 32 values for the 32-value types, per 256 for the K-quants) and
 * integer block sums; each weight block is unpacked to small unsigned integers; the products are
 * integer dot products (exact, so their order does not matter and SIMD may sum them any way); then
 * one float expression per block folds in the scales, and the blocks are added to the output in a
 * fixed ascending order by code that is shared by every SIMD path (written on 8-lane vector
 * extensions across 8 weight rows: element-wise, so each element gets the scalar bits).
 * Work is tiled as 8 weight rows x up to 64 activation rows: each 256-value group of the 8 rows is
 * unpacked once (ggml_matmul_tile.h) and used for every activation row; threads split N only.
 * Hence:
 *   - y[t, n] depends only on x[t, :] and W[n, :]: the same bits whatever T, the other rows, the
 *     thread count or the tile an element falls in (batch invariance);
 *   - every SIMD path gives the same bits as the portable C path (the library is built with
 *     -ffp-contract=off so that no path fuses a multiply-add the others do not).
 *
 * Block layouts: ggml_blocks.h (a struct per type, with each type's value order and formula).
 *
 * Files: the interface ggml_matmul.h; the block structs ggml_blocks.h; the shared vectors vec.h;
 * and the templates this file includes where their helpers are defined, each saying at its top
 * what it needs: ggml_matmul_tile.h (the tile loops, once per ISA), ggml_matmul_lanes.h (the row
 * lanes, once per x86 ISA), ggml_matmul_wlanes.h (the weight lanes, AVX-512 VNNI) and
 * ggml_matmul_amx.h (their AMX tile multiplies).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SP_X86 1
#endif
#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SP_HAVE_AMX 1 /* the compiler knows AMX's intrinsics; amx_usable() tells whether the CPU can */
#endif
#define SP_AMX_ROWS 16 /* activation rows per tile multiply (ggml_matmul_amx.h) */
#define SP_AMX_PAD (SP_AMX_ROWS * 256)
#define SP_AMX_FROM 8 /* the fewest activation rows the weight lanes take AMX for */
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "ggml_blocks.h"
#include "ggml_matmul.h"
#include "vec.h"

/* ------------------------------------------------------------------------------------------- */
/* Scalar helpers shared by all paths                                                            */

/* Exact f16 -> f32 by bit manipulation (no F16C needed, same on every CPU); used to fill the
 * table below, which the unpacking reads (one load instead of ~20 instructions). */
static float f16_bits_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 31u, man = h & 0x3ffu, bits;
  if (exp != 0 && exp != 31) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else { /* zero or subnormal: man * 2^-24 is exact in float */
    float f = (float)man * 5.9604644775390625e-08f;
    return sign ? -f : f;
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static float f16_table[65536];

__attribute__((constructor)) static void f16_table_init(void) {
  for (uint32_t h = 0; h < 65536; h++) f16_table[h] = f16_bits_to_f32((uint16_t)h);
}

SP_INLINE float f16_to_f32(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return f16_table[h];
}

SP_INLINE uint32_t load_u32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

/* ------------------------------------------------------------------------------------------- */
/* Activations: each row quantized once per call, padded with zeros to a multiple of 256 so that  */
/* every kernel works on whole groups of 256 values.                                            */

/* Group-major ([group][row]) so that the rows' values of one group, which a weight tile reads
 * one after another, are contiguous (row-major made every row a new page: TLB and cache misses
 * that doubled the per-row cost at 64 rows). */
typedef struct {
  int64_t kp;    /* padded row length (multiple of 256) */
  int64_t t;     /* rows */
  int8_t *q;     /* [kp/256][t][256] */
  float *d;      /* [kp/256][t][8]: scale of each 32-block (32-value types) or 256-block repeated */
  float *dsum;   /* [kp/256][t][8]: d * sum(q) of each 32-block (the Q4_1/Q5_1 min term) */
  int32_t *s32;  /* [kp/256][t][8]: integer sum of each 32-block */
  int32_t *s16;  /* [kp/256][t][16]: integer sum of each 16-block (Q6_K) */
} xquant;

/* 8-lane vectors of GCC/Clang's vector extensions, for the activation quantization and the
 * folding (which works on the SP_NR = 8 rows of a tile at once): element-wise IEEE operations,
 * so each element gets exactly the scalar expression's bits on every target (x86-64 baseline
 * splits them into SSE halves). */
/* (v8f, v8i, ld8f, ld8i: vec.h) */
SP_INLINE v8f to8f(v8i v) { return __builtin_convertvector(v, v8f); }

/* 4-lane (SSE2 / NEON width) vectors (v4f, v4i, ld4f: vec.h) for the activation quantization,
 * which is compiled once for the baseline ISA: 128-bit vectors are what that baseline has. */
/* select(m, a, b): a where the comparison mask m is set, else b */
SP_INLINE v4f select4f(v4i m, v4f a, v4f b) { return (v4f)((m & (v4i)a) | (~m & (v4i)b)); }

/* One group of 256 values of one row, of which the first `valid` are real (the rest is padding,
 * in whole blocks); qb = 32 or 256 values per scale.  Compiled once, for the baseline ISA: one
 * code path for all.  Rounding: adding and subtracting 1.5 * 2^23 rounds |v| < 2^22 to the
 * nearest integer, ties to even (as lrintf), in plain float arithmetic. */
static void quantize_group(const float *x, int64_t valid, int qb, int8_t *q, float *d,
                           float *dsum, int32_t *s32, int32_t *s16) {
  const v4f magic = (v4f){0} + 12582912.f, hi = (v4f){0} + 127.f, lo = (v4f){0} - 127.f;
  const v4i abs_mask = (v4i){0} + 0x7fffffff;
  for (int b0 = 0; b0 < 256; b0 += qb) {
    if (b0 >= valid) {
      memset(q + b0, 0, (size_t)qb);
      for (int j = b0 / 32; j < (b0 + qb) / 32; j++) d[j] = 0.f;
      continue;
    }
    v4f m = {0};
    for (int i = 0; i < qb; i += 4) {
      const v4f a = (v4f)((v4i)ld4f(x + b0 + i) & abs_mask);
      m = select4f(a > m, a, m);
    }
    float amax = 0.f; /* the max is exact: any order gives the same */
    for (int l = 0; l < 4; l++) amax = m[l] > amax ? m[l] : amax;
    const float dd = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    int32_t qi[256];
    for (int i = 0; i < qb; i += 4) {
      v4f v = (ld4f(x + b0 + i) * id + magic) - magic; /* |v| <= 127 up to rounding: clamp */
      v = select4f(v > hi, hi, v);
      v = select4f(v < lo, lo, v);
      /* v + magic has v's integer in its low mantissa bits: no float->int conversion needed */
      const v4i vi = (v4i)(v + magic) - 0x4b400000;
      memcpy(qi + i, &vi, sizeof vi);
    }
    for (int i = 0; i < qb; i++) q[b0 + i] = (int8_t)qi[i]; /* a narrowing the compiler packs */
    for (int j = b0 / 32; j < (b0 + qb) / 32; j++) d[j] = dd;
  }
  for (int j = 0; j < 16; j++) {
    int32_t s = 0;
    for (int i = 0; i < 16; i++) s += q[16 * j + i];
    s16[j] = s;
  }
  for (int j = 0; j < 8; j++) {
    s32[j] = s16[2 * j] + s16[2 * j + 1];
    dsum[j] = d[j] * (float)s32[j];
  }
}

/* ------------------------------------------------------------------------------------------- */
/* Weights: SP_NR rows are processed together.  One group of 256 values of each row (8 blocks of */
/* a 32-value type, or 1 K-quant block) is unpacked to unsigned integers q in value order, with  */
/* its scales laid out [block][row] so that the folding below vectorises across rows.           */

#define SP_NR 8  /* weight rows per tile: each activation group is loaded once for 8 rows (the
                    folding's vectors below assume 8) */
#define SP_TB 64 /* activation rows per pass over a weight tile (accumulators on the stack) */
#ifndef SP_PF_BYTES
/* one-row paths: software prefetch distance along the weights (benchmarks/kernel_variants.py,
 * Xeon Sapphire Rapids, one thread, rows read as one run: Qwen2.5-Coder 1.5B's layers' matmuls
 * 74.0 ms at 4 KB, 69.4 ms at 2.5 KB; in a later run 65.2 at 1.5 KB, 63.1 at 2.5 KB, 67.9 at 8 KB) */
#define SP_PF_BYTES 2560
#endif

typedef struct {
  uint8_t q[SP_NR][256] __attribute__((aligned(64))); /* Q8_0: the int8 values as bytes */
  /* K-quants, x86 kernels: the scale of each byte pair (one int16 lane of maddubs' output) */
  int16_t scv[SP_NR][128] __attribute__((aligned(64)));
  int8_t sc[SP_NR][16];  /* K-quants: sub-block scales (8 for Q4_K/Q5_K, 16 for Q6_K) */
  uint8_t mn[SP_NR][8];  /* Q4_K/Q5_K: sub-block mins */
  uint8_t mn16[SP_NR][16]; /* Q2_K: sub-block mins */
  float d[8][SP_NR];     /* 32-value types: per-block d; K-quants: d[0] = d, d[1] = dmin */
  float m[8][SP_NR];     /* Q4_1/Q5_1: per-block m */
  int nb;                /* 32-value types: blocks in this group (a row's last may be short) */
  /* K-quants, the row-lanes kernel (lanes_prep): sub-block scales as int32, the offsets' int16
   * pairs */
  int32_t sc32[SP_NR][16], pairs[SP_NR][8];
} wtile;

SP_INLINE uint64_t load_u64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

/* 16 packed bytes -> 32 values: low nibbles then high nibbles, on a 16-byte vector (the
 * compiler leaves the plain byte loop scalar; byte shifts become a word shift and a mask). */
typedef uint8_t v16u8 __attribute__((vector_size(16)));
SP_INLINE void unpack_nibbles16(const uint8_t *qs, uint8_t *q) {
  v16u8 v;
  memcpy(&v, qs, 16);
  const v16u8 lo = v & 15, hi = v >> 4;
  memcpy(q, &lo, 16);
  memcpy(q + 16, &hi, 16);
}

/* Bit i of b (i < 8) -> 16 in byte i of the result: replicate b to every byte, keep bit i in
 * byte i, then adding 0x7f carries into bit 7 exactly where the kept bit is set. */
SP_INLINE uint64_t spread_bits_to_16(uint32_t b) {
  const uint64_t x = ((uint64_t)(b & 0xffu) * 0x0101010101010101ULL) & 0x8040201008040201ULL;
  return ((x + 0x7f7f7f7f7f7f7f7fULL) & 0x8080808080808080ULL) >> 3;
}

/* Q5_0/Q5_1: bit 4 of value i is bit i of qh. */
SP_INLINE void add_high_bits32(uint32_t qh, uint8_t *q) {
  for (int h = 0; h < 4; h++) {
    const uint64_t v = load_u64(q + 8 * h) | spread_bits_to_16(qh >> (8 * h));
    memcpy(q + 8 * h, &v, 8);
  }
}

/* 32-value types: the blocks of group g of row r (nblk blocks per row), read by every ISA's
 * unpacking: sets w->nb and zeroes the values past it, then for block j sets its scales (d, and m
 * for Q4_1/Q5_1) and returns where its values start: 16 bytes of nibbles (Q5_0/Q5_1: *qh gets the
 * fifth bits) or, for Q8_0, 32 int8 values. */
SP_INLINE int group32_blocks(const uint8_t *row, int64_t g, int64_t nblk, wtile *w, int r) {
  const int nb = (int)(nblk - 8 * g < 8 ? nblk - 8 * g : 8);
  w->nb = nb;
  if (nb < 8) memset(w->q[r] + 32 * nb, 0, 32 * (8 - nb)); /* the padded activations are 0 too */
  return nb;
}
SP_INLINE const uint8_t *block32(int type, const uint8_t *row, int64_t g, int j, wtile *w, int r,
                                 uint32_t *qh) {
  static const int bytes[] = {[SP_Q4_0] = sizeof(sp_block_q4_0), [SP_Q4_1] = sizeof(sp_block_q4_1),
                              [SP_Q5_0] = sizeof(sp_block_q5_0), [SP_Q5_1] = sizeof(sp_block_q5_1),
                              [SP_Q8_0] = sizeof(sp_block_q8_0)};
  const uint8_t *b = row + (8 * g + j) * bytes[type];
  w->d[j][r] = f16_to_f32(b); /* d leads every 32-value block */
  switch (type) {
  case SP_Q4_1: w->m[j][r] = f16_to_f32(SP_FIELD(b, sp_block_q4_1, m)); return SP_FIELD(b, sp_block_q4_1, qs);
  case SP_Q5_0: *qh = load_u32(SP_FIELD(b, sp_block_q5_0, qh)); return SP_FIELD(b, sp_block_q5_0, qs);
  case SP_Q5_1:
    w->m[j][r] = f16_to_f32(SP_FIELD(b, sp_block_q5_1, m));
    *qh = load_u32(SP_FIELD(b, sp_block_q5_1, qh));
    return SP_FIELD(b, sp_block_q5_1, qs);
  case SP_Q8_0: return SP_FIELD(b, sp_block_q8_0, qs);
  default: return SP_FIELD(b, sp_block_q4_0, qs);
  }
}

SP_INLINE void unpack_group32(int type, const uint8_t *row, int64_t g, int64_t nblk, wtile *w,
                              int r) {
  const int nb = group32_blocks(row, g, nblk, w, r);
  for (int j = 0; j < nb; j++) {
    uint32_t qh = 0;
    const uint8_t *qs = block32(type, row, g, j, w, r, &qh);
    uint8_t *q = w->q[r] + 32 * j;
    if (type == SP_Q8_0) {
      memcpy(q, qs, 32);
      continue;
    }
    unpack_nibbles16(qs, q);
    if (type == SP_Q5_0 || type == SP_Q5_1) add_high_bits32(qh, q);
  }
}

/* the portable and NEON tiles' unpacking (the x86 tiles': unpack_group32_avx2) */
#define unpack_group32_portable unpack_group32
#define unpack_group32_neon unpack_group32

/* The 8 (scale, min) pairs of Q4_K/Q5_K, 6 bits each, four bytes at a time in 32-bit words:
 * sc[0..3] = s[0..3] & 63, mn[0..3] = s[4..7] & 63, sc[4..7] = s[8..11] & 15 | (s[0..3] >> 6) << 4,
 * mn[4..7] = s[8..11] >> 4 | (s[4..7] >> 6) << 4. */
SP_INLINE void k4_scale_words(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
  const uint32_t u0 = load_u32(s), u1 = load_u32(s + 4), u2 = load_u32(s + 8);
  const uint32_t lo6 = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, lo2 = 0x03030303u;
  *sc = (uint64_t)(u0 & lo6) | (uint64_t)((u2 & lo4) | (((u0 >> 6) & lo2) << 4)) << 32;
  *mn = (uint64_t)(u1 & lo6) | (uint64_t)(((u2 >> 4) & lo4) | (((u1 >> 6) & lo2) << 4)) << 32;
}

SP_INLINE void k4_scales(const uint8_t *s, wtile *w, int r) {
  uint64_t sc, mn;
  k4_scale_words(s, &sc, &mn);
  memcpy(w->sc[r], &sc, 8);
  memcpy(w->mn[r], &mn, 8);
}

SP_INLINE void unpack_q4_k(const uint8_t *b, wtile *w, int r) {
  w->d[0][r] = f16_to_f32(SP_FIELD(b, sp_block_q4_k, d));
  w->d[1][r] = f16_to_f32(SP_FIELD(b, sp_block_q4_k, dmin));
  k4_scales(SP_FIELD(b, sp_block_q4_k, scales), w, r);
  const uint8_t *restrict qs = SP_FIELD(b, sp_block_q4_k, qs);
  uint8_t *restrict q = w->q[r];
  for (int c = 0; c < 4; c++)
    for (int l = 0; l < 32; l++) {
      q[64 * c + l] = qs[32 * c + l] & 15;
      q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
}

SP_INLINE void unpack_q5_k(const uint8_t *b, wtile *w, int r) {
  w->d[0][r] = f16_to_f32(SP_FIELD(b, sp_block_q5_k, d));
  w->d[1][r] = f16_to_f32(SP_FIELD(b, sp_block_q5_k, dmin));
  k4_scales(SP_FIELD(b, sp_block_q5_k, scales), w, r);
  const uint8_t *restrict qh = SP_FIELD(b, sp_block_q5_k, qh), *restrict qs = SP_FIELD(b, sp_block_q5_k, qs);
  uint8_t *restrict q = w->q[r];
  for (int c = 0; c < 4; c++)
    for (int l = 0; l < 32; l++) {
      q[64 * c + l] = (qs[32 * c + l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4);
      q[64 * c + 32 + l] = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
    }
}

SP_INLINE void unpack_q6_k(const uint8_t *b, wtile *w, int r) {
  const uint8_t *restrict ql = SP_FIELD(b, sp_block_q6_k, ql), *restrict qh = SP_FIELD(b, sp_block_q6_k, qh);
  memcpy(w->sc[r], SP_FIELD(b, sp_block_q6_k, scales), 16);
  w->d[0][r] = f16_to_f32(SP_FIELD(b, sp_block_q6_k, d));
  for (int h = 0; h < 2; h++)
    for (int l = 0; l < 32; l++) {
      const uint8_t lo0 = ql[64 * h + l], lo1 = ql[64 * h + l + 32], hi = qh[32 * h + l];
      uint8_t *restrict q = w->q[r] + 128 * h + l;
      q[0] = (lo0 & 15) | ((hi & 3) << 4);
      q[32] = (lo1 & 15) | (((hi >> 2) & 3) << 4);
      q[64] = (lo0 >> 4) | (((hi >> 4) & 3) << 4);
      q[96] = (lo1 >> 4) | (((hi >> 6) & 3) << 4);
    }
}

#include "ggml_matmul_lowbit.h" /* the low-bit types' unpacking */

/* ------------------------------------------------------------------------------------------- */
/* Per-group float folding: the only float arithmetic on the product path.  For each output      */
/* element the blocks are added in ascending order with the same expression, one rounding per    */
/* operation, whichever ISA computed the integers (the loops over rows r only vectorise          */
/* independent elements, which does not change any element's bits).                              */

typedef struct {
  const int8_t *q;  /* 256 activation values of the group */
  const float *d, *dsum;
  const int32_t *s32, *s16;
} xgroup;

/* (v8f, v8i and their helpers are defined with the activation quantization above.) */

/* 32-value types: dots[j][r] = sum q*x over block j of row r (q unsigned, or int8 for Q8_0). */
SP_INLINE void fold_group32(int type, const wtile *w, const xgroup *x, const int32_t (*dots)[SP_NR],
                            float *acc) {
  v8f a = ld8f(acc);
  for (int j = 0; j < w->nb; j++) {
    const v8f dd = ld8f(w->d[j]) * x->d[j];
    const v8i dot = ld8i(dots[j]);
    if (type == SP_Q4_0)
      a += dd * to8f(dot - 8 * x->s32[j]);
    else if (type == SP_Q5_0)
      a += dd * to8f(dot - 16 * x->s32[j]);
    else if (type == SP_Q4_1 || type == SP_Q5_1)
      a += dd * to8f(dot) + ld8f(w->m[j]) * x->dsum[j];
    else
      a += dd * to8f(dot);
  }
  memcpy(acc, &a, sizeof a);
}

/* Q4_K/Q5_K: sumi[r] = sum_j sc_j * dot_j, summ[r] = sum_j mn_j * xsum32_j (the ISA kernels'
 * exact integers). */
SP_INLINE void fold_k4(const wtile *w, const xgroup *x, const int32_t *sumi, const int32_t *summ,
                       float *acc) {
  const float dx = x->d[0];
  const v8f a = ld8f(acc) + ((ld8f(w->d[0]) * dx) * to8f(ld8i(sumi)) -
                             (ld8f(w->d[1]) * dx) * to8f(ld8i(summ)));
  memcpy(acc, &a, sizeof a);
}

/* Q6_K (bias 32) and the biased low-bit types (SP_LB_BIAS): sumi[r] = sum_j sc_j * dot_j over
 * 16-blocks of the stored q = v + bias; the bias comes off via the 16-block sums,
 * off[r] = sum_j sc_j * xsum16_j. */
SP_INLINE void fold_off(const wtile *w, const xgroup *x, const int32_t *sumi, const int32_t *off,
                        const int bias, float *acc) {
  const v8f a = ld8f(acc) + (ld8f(w->d[0]) * x->d[0]) * to8f(ld8i(sumi) - bias * ld8i(off));
  memcpy(acc, &a, sizeof a);
}
#define fold_q6_k(w, x, sumi, off, acc) fold_off(w, x, sumi, off, 32, acc)

/* ------------------------------------------------------------------------------------------- */
/* The integer kernels, one set per ISA; each takes one activation group (256 int8 values) and   */
/* the SP_NR unpacked weight rows of a tile:                                                      */
/*   dots32_u8 : out[j][r] = sum_{i<32} q[r][32j+i] * x[32j+i], j < nb   (q unsigned <= 31)      */
/*   dots32_s8 : the same with int8 weights                               (Q8_0)                 */
/*   dot_sc    : out[r] = sum_j sc[r][j] * sum_{i<sub} q[r][sub*j+i] * x[sub*j+i]                 */
/*               (K-quants; sub = 32 for Q4_K/Q5_K, 16 for Q6_K; q <= 63)                         */
/*   offsets   : out[r] = sum_j mn[r][j] * xsum32[j] (sub 32) or sc[r][j] * xsum16[j] (sub 16)    */
/* All are exact in int32, so any summation order gives the same integer.                        */

static void dots32_u8_portable(const wtile *w, const int8_t *x, int nb, int32_t (*out)[SP_NR]) {
  for (int r = 0; r < SP_NR; r++)
    for (int j = 0; j < nb; j++) {
      int32_t s = 0;
      for (int i = 0; i < 32; i++) s += w->q[r][32 * j + i] * x[32 * j + i];
      out[j][r] = s;
    }
}
static void dots32_s8_portable(const wtile *w, const int8_t *x, int nb, int32_t (*out)[SP_NR]) {
  for (int r = 0; r < SP_NR; r++)
    for (int j = 0; j < nb; j++) {
      int32_t s = 0;
      for (int i = 0; i < 32; i++) s += (int8_t)w->q[r][32 * j + i] * x[32 * j + i];
      out[j][r] = s;
    }
}
/* prep_scales: what dot_sc needs besides sc (the x86 kernels: scv, one scale per byte pair). */
SP_INLINE void prep_scales_portable(wtile *w, int r, int sub) { (void)w, (void)r, (void)sub; }

static void offsets_portable(const wtile *w, const xgroup *x, int sub, int32_t *out) {
  for (int r = 0; r < SP_NR; r++) {
    int32_t s = 0;
    if (sub == 32)
      for (int j = 0; j < 8; j++) s += w->mn[r][j] * x->s32[j];
    else
      for (int j = 0; j < 16; j++) s += w->sc[r][j] * x->s16[j];
    out[r] = s;
  }
}

static void dot_sc_portable(const wtile *w, const int8_t *x, int sub, int32_t *out) {
  for (int r = 0; r < SP_NR; r++) {
    int32_t s = 0;
    for (int j = 0; j < 256 / sub; j++) {
      int32_t d = 0;
      for (int i = 0; i < sub; i++) d += w->q[r][sub * j + i] * x[sub * j + i];
      s += w->sc[r][j] * d;
    }
    out[r] = s;
  }
}

#ifdef SP_X86
#define SP_AVX2 __attribute__((target("avx2,fma")))
#define SP_VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))

/* Eight vectors of 8 int32 -> one vector of their eight horizontal sums. */
SP_INLINE SP_AVX2 __m256i hsum8x8_avx2(const __m256i *p) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  /* a = [p0..p3 low-half sums | p0..p3 high-half sums], b likewise for p4..p7 */
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

#define LD(p) _mm256_loadu_si256((const __m256i *)(p))
#define ST(p, v) _mm256_storeu_si256((__m256i *)(p), v)

/* maddubs: u8 x s8 -> adjacent pairs summed to int16, exact here (q <= 63, or |w| <= 128 with
 * the sign trick: |pair| <= 2*128*127 < 2^15); madd with 1 widens to int32. */
static SP_AVX2 void dots32_u8_avx2(const wtile *w, const int8_t *x, int nb, int32_t (*out)[SP_NR]) {
  const __m256i one = _mm256_set1_epi16(1);
  for (int j = 0; j < nb; j++) {
    const __m256i v = LD(x + 32 * j);
    __m256i p[SP_NR];
    for (int r = 0; r < SP_NR; r++)
      p[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(LD(w->q[r] + 32 * j), v), one);
    ST(out[j], hsum8x8_avx2(p));
  }
}
static SP_AVX2 void dots32_s8_avx2(const wtile *w, const int8_t *x, int nb, int32_t (*out)[SP_NR]) {
  const __m256i one = _mm256_set1_epi16(1);
  for (int j = 0; j < nb; j++) {
    const __m256i v = LD(x + 32 * j);
    __m256i p[SP_NR];
    for (int r = 0; r < SP_NR; r++) {
      const __m256i q = LD(w->q[r] + 32 * j);
      /* |w| (as u8) times x with w's sign: the same products in u8 x s8 form */
      p[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(v, q)),
                               one);
    }
    ST(out[j], hsum8x8_avx2(p));
  }
}
/* scv[r]: the scale of each byte pair, i.e. of each int16 lane of maddubs' output. */
/* Each 256-bit vector j of scv covers 32 bytes: sub-block j (sub 32: 16 copies of sc[j]) or
 * sub-blocks 2j, 2j+1 (sub 16: 8 copies each); built by a byte shuffle of the 16 int8 scales and
 * a sign extension to int16. */
SP_INLINE SP_AVX2 void prep_scales_avx2(wtile *w, int r, int sub) {
  /* sub 32 uses 8 scales: an 8-byte load, which store forwarding serves from k4_scales' 8-byte
   * store (a 16-byte load over it stalls until the store retires) */
  const __m128i s8 = sub == 32 ? _mm_loadl_epi64((const __m128i *)w->sc[r])
                               : _mm_loadu_si128((const __m128i *)w->sc[r]);
  const __m128i base = sub == 32 ? _mm_setzero_si128()
                                 : _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const int step = sub == 32 ? 1 : 2;
  for (int j = 0; j < 8; j++) {
    const __m128i idx = _mm_add_epi8(base, _mm_set1_epi8((char)(step * j)));
    ST(w->scv[r] + 16 * j, _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, idx)));
  }
}
#define prep_scales_vnni prep_scales_avx2

static SP_AVX2 void offsets_avx2(const wtile *w, const xgroup *x, int sub, int32_t *out) {
  __m256i p[SP_NR];
  if (sub == 32) {
    const __m256i s = LD(x->s32);
    for (int r = 0; r < SP_NR; r++)
      p[r] = _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)w->mn[r])), s);
  } else {
    /* |xsum16| <= 16 * 127 fits int16: madd takes a row's 16 products sc * xsum16 at once (each
     * pair's sum, |2 * 128 * 2032|, exact in int32); packs interleaves the halves, the permute
     * puts them back in order */
    const __m256i s = _mm256_permute4x64_epi64(_mm256_packs_epi32(LD(x->s16), LD(x->s16 + 8)), 0xd8);
    for (int r = 0; r < SP_NR; r++)
      p[r] = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w->sc[r])), s);
  }
  ST(out, hsum8x8_avx2(p));
}
#define offsets_vnni offsets_avx2

/* K-quants: madd of maddubs' pairs with the per-pair scales scv gives sc * (pair sum) in int32
 * (|.| <= 2 * 16002 * 128 per lane per chunk: exact). */
static SP_AVX2 void dot_sc_avx2(const wtile *w, const int8_t *x, int sub, int32_t *out) {
  (void)sub; /* scv already spreads the scales over the byte pairs */
  __m256i acc[SP_NR];
  for (int r = 0; r < SP_NR; r++) acc[r] = _mm256_setzero_si256();
  for (int c = 0; c < 8; c++) {
    const __m256i v = LD(x + 32 * c);
    for (int r = 0; r < SP_NR; r++)
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(LD(w->q[r] + 32 * c), v),
                                                          LD(w->scv[r] + 16 * c)));
  }
  ST(out, hsum8x8_avx2(acc));
}

/* The 32-value types' unpacking on 256-bit vectors: the bytes of unpack_group32 (tested
 * bitwise), a block in a few instructions instead of a byte loop: nibbles by a shift and a mask,
 * Q5_0/Q5_1's fifth bits spread to bytes by a shuffle (byte i gets byte i / 8 of qh), a mask of
 * each byte's own bit and a compare. */
SP_INLINE SP_AVX2 __m256i nibbles32_avx2(const uint8_t *qs) {
  const __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}
SP_INLINE SP_AVX2 __m256i high_bits32_avx2(uint32_t qh) { /* byte i: 16 where bit i is set */
  const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), which); /* per 128-bit lane */
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit), _mm256_set1_epi8(16));
}
SP_INLINE SP_AVX2 void unpack_group32_avx2(int type, const uint8_t *row, int64_t g, int64_t nblk,
                                           wtile *w, int r) {
  const int nb = group32_blocks(row, g, nblk, w, r);
  for (int j = 0; j < nb; j++) {
    uint32_t qh = 0;
    const uint8_t *qs = block32(type, row, g, j, w, r, &qh);
    __m256i v = type == SP_Q8_0 ? LD(qs) : nibbles32_avx2(qs);
    if (type == SP_Q5_0 || type == SP_Q5_1) v = _mm256_or_si256(v, high_bits32_avx2(qh));
    ST(w->q[r] + 32 * j, v);
  }
}
#define unpack_group32_vnni unpack_group32_avx2

#define LDZ(p) _mm512_loadu_si512((const void *)(p))

/* Four int32 halves of 512-bit vectors -> the 8 row sums (two 256-bit halves added first). */
SP_INLINE SP_VNNI __m256i hsum8x16_vnni(const __m512i *z) {
  __m256i p[SP_NR];
  for (int r = 0; r < SP_NR; r++)
    p[r] = _mm256_add_epi32(_mm512_castsi512_si256(z[r]), _mm512_extracti64x4_epi64(z[r], 1));
  return hsum8x8_avx2(p);
}

/* vpdpbusd: u8 x s8, four products summed into each int32 lane, exact. 64 bytes = the 32-blocks
 * 2c (lanes 0-7) and 2c+1 (lanes 8-15). */
static SP_VNNI void dots32_u8_vnni(const wtile *w, const int8_t *x, int nb, int32_t (*out)[SP_NR]) {
  for (int c = 0; c < (nb + 1) / 2; c++) { /* 2 blocks a step: one past nb is zeros, unused */
    const __m512i v = LDZ(x + 64 * c);
    __m256i lo[SP_NR], hi[SP_NR];
    for (int r = 0; r < SP_NR; r++) {
      const __m512i z = _mm512_dpbusd_epi32(_mm512_setzero_si512(), LDZ(w->q[r] + 64 * c), v);
      lo[r] = _mm512_castsi512_si256(z);
      hi[r] = _mm512_extracti64x4_epi64(z, 1);
    }
    ST(out[2 * c], hsum8x8_avx2(lo));
    ST(out[2 * c + 1], hsum8x8_avx2(hi));
  }
}
static SP_VNNI void dots32_s8_vnni(const wtile *w, const int8_t *x, int nb, int32_t (*out)[SP_NR]) {
  for (int c = 0; c < (nb + 1) / 2; c++) { /* 2 blocks a step: one past nb is zeros, unused */
    const __m512i v = LDZ(x + 64 * c);
    __m256i lo[SP_NR], hi[SP_NR];
    for (int r = 0; r < SP_NR; r++) {
      const __m512i q = LDZ(w->q[r] + 64 * c);
      /* negate x where w < 0 so that |w| (u8) times it gives the signed products */
      const __m512i vs = _mm512_mask_sub_epi8(v, _mm512_movepi8_mask(q), _mm512_setzero_si512(), v);
      const __m512i z = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(q), vs);
      lo[r] = _mm512_castsi512_si256(z);
      hi[r] = _mm512_extracti64x4_epi64(z, 1);
    }
    ST(out[2 * c], hsum8x8_avx2(lo));
    ST(out[2 * c + 1], hsum8x8_avx2(hi));
  }
}
/* K-quants: maddubs' int16 pair sums times the per-pair scales, accumulated by vpdpwssd. */
static SP_VNNI void dot_sc_vnni(const wtile *w, const int8_t *x, int sub, int32_t *out) {
  (void)sub;
  __m512i acc[SP_NR];
  for (int r = 0; r < SP_NR; r++) acc[r] = _mm512_setzero_si512();
  for (int c = 0; c < 4; c++) {
    const __m512i v = LDZ(x + 64 * c);
    for (int r = 0; r < SP_NR; r++)
      acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_maddubs_epi16(LDZ(w->q[r] + 64 * c), v),
                                   LDZ(w->scv[r] + 32 * c));
  }
  ST(out, hsum8x16_vnni(acc));
}

/* ------------------------------------------------------------------------------------------- */
/* One activation row (decode) against Q4_K / Q6_K rows, AVX-512 VNNI: each weight block is      */
/* unpacked in registers and multiplied at once, no tile in memory (the tile path's unpacking    */
/* into memory and its per-row scale tables cost more than the product itself for one row).     */
/* The integers are the tile path's (exact), and each output is folded with the same expression  */
/* per group in ascending order, on scalars: the same bits.                                      */

/* The activation group in the order of Q4_K's nibbles in two 64-byte loads of qs: low nibbles of
 * qs[0:64] are values [0,32) and [64,96), high nibbles [32,64) and [96,128); likewise +128. */
static void permute_k4(const int8_t *q, int64_t kp, int8_t *out) {
  static const int from[8] = {0, 64, 32, 96, 128, 192, 160, 224};
  for (int64_t g = 0; g < kp / 256; g++)
    for (int j = 0; j < 8; j++) memcpy(out + 256 * g + 32 * j, q + 256 * g + from[j], 32);
}

SP_INLINE SP_VNNI __m512i bcast_lanes_epi16(__m512i v, int a, int b, int c, int d) {
  /* 128-bit lane i of the result: int16 element (a, b, c, d)[i] of v, 8 times */
  const __m512i idx = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)a)),
                                                     _mm_set1_epi16((short)b), 1)),
      _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)c)), _mm_set1_epi16((short)d), 1),
      1);
  return _mm512_permutexvar_epi16(idx, v);
}

/* The few-rows paths: nt <= SP_FEW activation rows (group-major, as xquant: row r of group g at
 * [g * nt + r]) against one weight row, each block unpacked once in registers and multiplied with
 * every activation row; out[r] gets row r's element, each the tile path's integers and fold. */
#define SP_FEW 2

SP_INLINE SP_VNNI void rows_q4_k(const uint8_t *row, int64_t ngroups, const int8_t *xk, const float *xd,
                                 const int32_t *xs32, const int nt, float *out) {
  const __m512i m4 = _mm512_set1_epi8(15);
  float acc[SP_FEW] = {0};
  for (int64_t g = 0; g < ngroups; g++) {
    const uint8_t *b = row + sizeof(sp_block_q4_k) * g, *qs = SP_FIELD(b, sp_block_q4_k, qs);
    for (int off = 0; off < 192; off += 64) __builtin_prefetch(b + SP_PF_BYTES + off);
    uint64_t sc, mn;
    k4_scale_words(SP_FIELD(b, sp_block_q4_k, scales), &sc, &mn);
    const __m512i z0 = LDZ(qs), z1 = LDZ(qs + 64);
    const __m512i w[4] = {_mm512_and_si512(z0, m4), _mm512_and_si512(_mm512_srli_epi16(z0, 4), m4),
                          _mm512_and_si512(z1, m4), _mm512_and_si512(_mm512_srli_epi16(z1, 4), m4)};
    const __m512i s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
    const __m512i sw[4] = {bcast_lanes_epi16(s16, 0, 0, 2, 2), bcast_lanes_epi16(s16, 1, 1, 3, 3),
                           bcast_lanes_epi16(s16, 4, 4, 6, 6), bcast_lanes_epi16(s16, 5, 5, 7, 7)};
    const __m256i mn32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn));
    const float d = f16_to_f32(SP_FIELD(b, sp_block_q4_k, d)), dmin = f16_to_f32(SP_FIELD(b, sp_block_q4_k, dmin));
    for (int r = 0; r < nt; r++) {
      const int64_t at = g * nt + r;
      const int8_t *x = xk + 256 * at;
      __m512i a = _mm512_setzero_si512();
      for (int i = 0; i < 4; i++) a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(w[i], LDZ(x + 64 * i)), sw[i]);
      const int32_t sumi = _mm512_reduce_add_epi32(a);
      const __m256i mins = _mm256_mullo_epi32(mn32, LD(xs32 + 8 * at));
      const __m128i m2 = _mm_add_epi32(_mm256_castsi256_si128(mins), _mm256_extracti128_si256(mins, 1));
      const __m128i m1 = _mm_add_epi32(m2, _mm_unpackhi_epi64(m2, m2));
      const int32_t summ = _mm_cvtsi128_si32(_mm_add_epi32(m1, _mm_shuffle_epi32(m1, 1)));
      const float dx = xd[8 * at];
      acc[r] = acc[r] + ((d * dx) * (float)sumi - (dmin * dx) * (float)summ);
    }
  }
  for (int r = 0; r < nt; r++) out[r] = acc[r];
}

SP_INLINE SP_VNNI void rows_q6_k(const uint8_t *row, int64_t ngroups, const int8_t *xq, const float *xd,
                                 const int32_t *xs16, const int nt, float *out) {
  const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3);
  /* high-bit shifts: (0 | 2) for the low nibbles' 64 values, (4 | 6) for the high nibbles' */
  const __m512i sh_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i sh_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
  float acc[SP_FEW] = {0};
  for (int64_t g = 0; g < ngroups; g++) {
    const uint8_t *b = row + sizeof(sp_block_q6_k) * g;
    const uint8_t *ql = SP_FIELD(b, sp_block_q6_k, ql), *qh6 = SP_FIELD(b, sp_block_q6_k, qh);
    for (int off = 0; off < 256; off += 64) __builtin_prefetch(b + SP_PF_BYTES + off);
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)SP_FIELD(b, sp_block_q6_k, scales));
    const __m512i s16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
    const __m512i sc32 = _mm512_cvtepi8_epi32(sc8);
    __m512i v[4], sw[4];
    for (int h = 0; h < 2; h++) {
      const __m512i l = LDZ(ql + 64 * h);
      const __m256i qh = LD(qh6 + 32 * h);
      const __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
      v[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4),
          _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hz, sh_lo), m2), 4));
      v[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
          _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hz, sh_hi), m2), 4));
      const int j = 8 * h; /* 16-value sub-blocks of this half: j .. j + 7 */
      sw[2 * h] = bcast_lanes_epi16(s16, j, j + 1, j + 2, j + 3);
      sw[2 * h + 1] = bcast_lanes_epi16(s16, j + 4, j + 5, j + 6, j + 7);
    }
    const float d = f16_to_f32(SP_FIELD(b, sp_block_q6_k, d));
    for (int r = 0; r < nt; r++) {
      const int64_t at = g * nt + r;
      const int8_t *x = xq + 256 * at;
      __m512i a = _mm512_setzero_si512();
      for (int h = 0; h < 2; h++) {
        a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(v[2 * h], LDZ(x + 128 * h)), sw[2 * h]);
        a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(v[2 * h + 1], LDZ(x + 128 * h + 64)), sw[2 * h + 1]);
      }
      const int32_t sumi = _mm512_reduce_add_epi32(a);
      const int32_t off = _mm512_reduce_add_epi32(_mm512_mullo_epi32(sc32, LDZ(xs16 + 16 * at)));
      acc[r] = acc[r] + (d * xd[8 * at]) * (float)(sumi - 32 * off);
    }
  }
  for (int r = 0; r < nt; r++) out[r] = acc[r];
}

#endif /* SP_X86 */

#if defined(__aarch64__)
/* NEON: every weight value here is < 128 (or int8 for Q8_0), so a signed x signed product works
 * for all types.  vmull_s8 gives exact int16 products (|p| <= 128*127); vpadalq widens to int32. */
SP_INLINE int32x4_t dot16_neon(int32x4_t acc, const uint8_t *q, const int8_t *x) {
  const int8x16_t a = vreinterpretq_s8_u8(vld1q_u8(q)), b = vld1q_s8(x);
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
  return vpadalq_s16(acc, vmull_s8(vget_high_s8(a), vget_high_s8(b)));
#endif
}
static void dots32_u8_neon(const wtile *w, const int8_t *x, int nb, int32_t (*out)[SP_NR]) {
  for (int r = 0; r < SP_NR; r++)
    for (int j = 0; j < nb; j++) {
      const int32x4_t acc = dot16_neon(vdupq_n_s32(0), w->q[r] + 32 * j, x + 32 * j);
      out[j][r] = vaddvq_s32(dot16_neon(acc, w->q[r] + 32 * j + 16, x + 32 * j + 16));
    }
}
static void dots32_s8_neon(const wtile *w, const int8_t *x, int nb, int32_t (*out)[SP_NR]) {
  dots32_u8_neon(w, x, nb, out); /* the same signed arithmetic */
}
SP_INLINE void prep_scales_neon(wtile *w, int r, int sub) { (void)w, (void)r, (void)sub; }
#define offsets_neon offsets_portable
static void dot_sc_neon(const wtile *w, const int8_t *x, int sub, int32_t *out) {
  for (int r = 0; r < SP_NR; r++) {
    int32x4_t acc = vdupq_n_s32(0);
    for (int j = 0; j < 256 / sub; j++) {
      int32x4_t d = vdupq_n_s32(0);
      for (int i = 0; i < sub; i += 16) d = dot16_neon(d, w->q[r] + sub * j + i, x + sub * j + i);
      acc = vmlaq_n_s32(acc, d, w->sc[r][j]);
    }
    out[r] = vaddvq_s32(acc);
  }
}
#endif /* __aarch64__ */

/* ------------------------------------------------------------------------------------------- */
/* The tile loops, instantiated once per ISA from ggml_matmul_tile.h.                            */

typedef struct {
  int type;
  int64_t t, k, n, row_bytes, nblk32; /* nblk32: 32-blocks per row (32-value types) */
  const uint8_t *w;
  xquant xq;
  float *y;
} job;

typedef void (*tile_fn)(const job *, int64_t, int64_t);

/* Software prefetch of the tile loops: a tile's weights are one contiguous range (SP_NR whole
 * rows) read in row-interleaved order, which the hardware prefetcher does not follow; each
 * unpacking step (one group of one row) fetches its share of the NEXT tile's range, so that tile
 * is in cache when it starts.  A thread's first tile is fetched in one burst. */
typedef struct {
  const uint8_t *end; /* the weights' end: nothing past it is fetched */
  int64_t share;      /* bytes per step */
} tile_prefetch;

SP_INLINE void prefetch_lines(const uint8_t *p, const uint8_t *e, const uint8_t *end) {
  for (e = e < end ? e : end; p < e; p += 64) __builtin_prefetch(p);
}

SP_INLINE tile_prefetch tile_prefetch_start(const job *jb, int64_t n0, int64_t n1) {
  const int64_t tile_bytes = SP_NR * jb->row_bytes, steps = jb->xq.kp / 256 * SP_NR;
  const uint8_t *first = jb->w + n0 * jb->row_bytes;
  prefetch_lines(first, first + tile_bytes, jb->w + n1 * jb->row_bytes);
  return (tile_prefetch){jb->w + jb->n * jb->row_bytes, (tile_bytes + steps - 1) / steps};
}

/* Step s (= group * SP_NR + row) of the tile that starts at weight row n. */
SP_INLINE void tile_prefetch_step(const tile_prefetch *pf, const job *jb, int64_t n, int64_t s) {
  const uint8_t *p = jb->w + (n + SP_NR) * jb->row_bytes + s * pf->share;
  prefetch_lines(p, p + pf->share, pf->end);
}


#define SP_ISA portable
#define SP_ATTR
#include "ggml_matmul_tile.h"
#undef SP_ISA
#undef SP_ATTR

#ifdef SP_X86
#define SP_ISA avx2
#define SP_ATTR SP_AVX2
#include "ggml_matmul_tile.h"
#undef SP_ISA
#undef SP_ATTR
#define SP_ISA vnni
#define SP_ATTR SP_VNNI
#include "ggml_matmul_tile.h"
#undef SP_ISA
#undef SP_ATTR
#endif

#if defined(__aarch64__)
#define SP_ISA neon
#define SP_ATTR
#include "ggml_matmul_tile.h"
#undef SP_ISA
#undef SP_ATTR
#endif

#ifdef SP_X86
/* ------------------------------------------------------------------------------------------- */
/* Several activation rows, "row lanes" (AVX-512 VNNI and AVX2): the vector lanes are 8          */
/* activation rows, so no horizontal sums are needed.  The activations are laid out once per     */
/* call as xl[g][chunk][256 / lb][lane][lb] (lb = 4 values of each row per 256-bit vector on     */
/* AVX2, 8 per 512-bit vector on AVX-512); a weight row's lb unpacked values are broadcast to all */
/* lanes and vpdpbusd (AVX2: vpmaddubsw + vpmaddwd) adds their products with the rows' values to  */
/* each int32 lane.  Each lane's integers are the tile path's (exact), and the folding is         */
/* fold_k4's / fold_q6_k's / fold_group32's expression per element, in ascending block order      */
/* (ggml_matmul_lanes.h).                                                                         */

typedef struct {
  int64_t chunks;  /* ceil(T / 8) */
  int8_t *q;       /* [g][chunk][256 / lb][8 lanes][lb] */
  /* K-quants */
  int32_t *pairs;  /* [g][chunk][8 pairs][8 lanes]: int16 pairs of block sums (for the offsets) */
  float *d;        /* [g][chunk][8 lanes]: the activation scale of the group */
  /* 32-value types, per 32-block: [g][chunk][8 blocks][8 lanes] */
  int32_t *bsum;   /* integer sum */
  float *bd, *bdsum; /* scale, and scale * sum (Q4_1/Q5_1) */
} xlanes;

/* per group and chunk: pairs/bsum, d/bd, bdsum (128 four-byte values each: the 32-value types'
 * per-block values are stored twice on AVX-512, see build_lanes), then q */
#define SP_LANES_BYTES (3 * 128 * 4 + 2048)

/* The types the row lanes take (the low-bit types take the tile path) */
static int lanes_type(int type) { return type <= SP_Q8_0 || (type >= SP_Q4_K && type <= SP_Q6_K); }

static int is_kquant(int type) { return type == SP_Q4_K || type == SP_Q5_K || type == SP_Q6_K; }

/* xl's arrays in one allocation of SP_LANES_BYTES per group and chunk, freed through xl->pairs. */
static int alloc_lanes(int64_t ng, xlanes *xl) {
  const int64_t n = ng * xl->chunks;
  int32_t *mem = malloc((size_t)(n * SP_LANES_BYTES));
  if (!mem) return 0;
  xl->pairs = xl->bsum = mem;
  xl->d = xl->bd = (float *)(mem + n * 128);
  xl->bdsum = xl->bd + n * 128;
  xl->q = (int8_t *)(xl->bdsum + n * 128);
  return 1;
}

static void build_lanes(const xquant *xq, int type, int lb, xlanes *xl) {
  const int64_t t = xq->t, ng = xq->kp / 256, ch = xl->chunks;
  const int kq = is_kquant(type), npairs = type == SP_Q6_K ? 8 : 4;
  for (int64_t g = 0; g < ng; g++)
    for (int64_t c = 0; c < ch; c++) {
      const int64_t gc = g * ch + c;
      int8_t *q = xl->q + gc * 2048;
      for (int l = 0; l < 8; l++) {
        const int64_t row = 8 * c + l, at = g * t + row;
        const int real = row < t; /* padding lanes: zeros, never stored */
        for (int i = 0; i < 256 / lb; i++) {
          if (real) memcpy(q + 8 * lb * i + lb * l, xq->q + 256 * at + lb * i, (size_t)lb);
          else memset(q + 8 * lb * i + lb * l, 0, (size_t)lb);
        }
        if (kq) {
          const int32_t *bs = type == SP_Q6_K ? xq->s16 + 16 * at : xq->s32 + 8 * at;
          for (int j = 0; j < npairs; j++) /* |block sum| <= 32 * 127: an int16 */
            xl->pairs[gc * 64 + 8 * j + l] = real ? (int32_t)(((uint32_t)(uint16_t)bs[2 * j]) |
                                                              ((uint32_t)(uint16_t)bs[2 * j + 1] << 16)) : 0;
          xl->d[gc * 8 + l] = real ? xq->d[8 * at] : 0.f;
        } else
          for (int j = 0; j < 8; j++) /* lb = 8: each lane's value twice, as the interleaved
                                          weight-row pairs of lanes_group32 read it */
            for (int h = 0; h < lb / 4; h++) {
              const int64_t i = gc * 128 + 2 * lb * j + lb / 4 * l + h;
              xl->bsum[i] = real ? xq->s32[8 * at + j] : 0;
              xl->bd[i] = real ? xq->d[8 * at + j] : 0.f;
              xl->bdsum[i] = real ? xq->dsum[8 * at + j] : 0.f;
            }
      }
    }
}

#define SP_ISA avx2
#define SP_ATTR SP_AVX2
#define SP_LV __m256i
#define SP_LB 4
#define SP_LLD(p) LD(p)
#define SP_LZERO _mm256_setzero_si256()
#define SP_LADD(a, b) _mm256_add_epi32(a, b)
#define SP_LSCALE(a, s) _mm256_mullo_epi32(a, _mm256_set1_epi32(s))
#define SP_LSUM(v) (v)
/* maddubs sums pairs to int16 (exact: unsigned weights <= 63; Q8_0 as |w| times x with w's sign,
 * |pair| <= 2 * 128 * 127), madd with 1 widens to int32 */
#define SP_LDP(acc, w, x)                                                                          \
  _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32((int)load_u32(w)), x), \
                                          _mm256_set1_epi16(1)))
#define SP_LDPS(acc, w, x) sp_dp4s_avx2(acc, _mm256_set1_epi32((int)load_u32(w)), x)
#define SP_Q8_SHIFT 0
#define SP_DP2W(acc, p, w) _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi32((int)(w))))
SP_INLINE SP_AVX2 __m256i sp_dp4s_avx2(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)),
                                                 _mm256_set1_epi16(1)));
}
#include "ggml_matmul_lanes.h" /* (it undefines these) */
/* AVX-512: 512-bit lanes, each row's 8 values in two adjacent int32 lanes (half the vpdpbusd of
 * 256-bit lanes); the 8 weight bytes broadcast as one int64 */
#define SP_ISA vnni
#define SP_ATTR SP_VNNI
#define SP_LV __m512i
#define SP_LB 8
#define SP_LLD(p) LDZ(p)
#define SP_LZERO _mm512_setzero_si512()
#define SP_LADD(a, b) _mm512_add_epi32(a, b)
#define SP_LSCALE(a, s) _mm512_mullo_epi32(a, _mm512_set1_epi32(s))
/* lane 2l + lane 2l+1 into the low half of each int64, then those halves packed to 8 int32 */
#define SP_LSUM(v) _mm512_cvtepi64_epi32(_mm512_add_epi32(v, _mm512_srli_epi64(v, 32)))
#define SP_LDP(acc, w, x) _mm512_dpbusd_epi32(acc, _mm512_set1_epi64((long long)load_u64(w)), x)
/* the signed weights as w + 128 (unsigned): 128 x the block sum comes off again */
#define SP_LDPS(acc, w, x) \
  _mm512_dpbusd_epi32(acc, _mm512_set1_epi64((long long)(load_u64(w) ^ 0x8080808080808080ull)), x)
#define SP_Q8_SHIFT 7
#define SP_DP2W(acc, p, w) _mm256_dpwssd_epi32(acc, p, _mm256_set1_epi32((int)(w)))
#include "ggml_matmul_lanes.h" /* (it undefines these) */
#include "ggml_matmul_wlanes.h"
#ifdef SP_HAVE_AMX
#include "ggml_matmul_amx.h"
#endif
#endif

/* ------------------------------------------------------------------------------------------- */
/* Dispatch and entry points                                                                     */

int sp_isa_supported(int isa) {
  switch (isa) {
  case SP_ISA_PORTABLE: return 1;
#ifdef SP_X86
  case SP_ISA_AVX2:
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  case SP_ISA_AVX512VNNI:
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
#ifdef SP_HAVE_AMX
  case SP_ISA_AMX: return sp_isa_supported(SP_ISA_AVX512VNNI) && amx_usable();
#endif
#if defined(__aarch64__)
  case SP_ISA_NEON: return 1;
#endif
  default: return 0;
  }
}

int sp_best_isa(void) {
  const int order[] = {SP_ISA_AMX, SP_ISA_AVX512VNNI, SP_ISA_AVX2, SP_ISA_NEON};
  for (int i = 0; i < 4; i++)
    if (sp_isa_supported(order[i])) return order[i];
  return SP_ISA_PORTABLE;
}

int sp_type_supported(int type) {
  switch (type) {
  case SP_Q4_0: case SP_Q4_1: case SP_Q5_0: case SP_Q5_1: case SP_Q8_0:
  case SP_Q4_K: case SP_Q5_K: case SP_Q6_K: return 1;
  case SP_Q2_K: case SP_Q3_K: case SP_IQ2_XXS: case SP_IQ2_XS: case SP_IQ2_S: case SP_IQ3_XXS:
  case SP_IQ3_S: case SP_IQ1_S: case SP_IQ1_M: case SP_IQ4_NL: case SP_IQ4_XS: case SP_MXFP4:
  case SP_TQ1_0: case SP_TQ2_0: return 1;
  default: return 0;
  }
}

static int block_of(int type, int64_t *bytes) {
  switch (type) {
  case SP_Q4_0: *bytes = sizeof(sp_block_q4_0); return 32;
  case SP_Q4_1: *bytes = sizeof(sp_block_q4_1); return 32;
  case SP_Q5_0: *bytes = sizeof(sp_block_q5_0); return 32;
  case SP_Q5_1: *bytes = sizeof(sp_block_q5_1); return 32;
  case SP_Q8_0: *bytes = sizeof(sp_block_q8_0); return 32;
  case SP_Q4_K: *bytes = sizeof(sp_block_q4_k); return 256;
  case SP_Q5_K: *bytes = sizeof(sp_block_q5_k); return 256;
  case SP_Q6_K: *bytes = sizeof(sp_block_q6_k); return 256;
  case SP_Q2_K: *bytes = sizeof(sp_block_q2_k); return 256;
  case SP_Q3_K: *bytes = sizeof(sp_block_q3_k); return 256;
  case SP_IQ2_XXS: *bytes = sizeof(sp_block_iq2_xxs); return 256;
  case SP_IQ2_XS: *bytes = sizeof(sp_block_iq2_xs); return 256;
  case SP_IQ2_S: *bytes = sizeof(sp_block_iq2_s); return 256;
  case SP_IQ3_XXS: *bytes = sizeof(sp_block_iq3_xxs); return 256;
  case SP_IQ3_S: *bytes = sizeof(sp_block_iq3_s); return 256;
  case SP_IQ1_S: *bytes = sizeof(sp_block_iq1_s); return 256;
  case SP_IQ1_M: *bytes = sizeof(sp_block_iq1_m); return 256;
  case SP_IQ4_NL: *bytes = sizeof(sp_block_iq4_nl); return 32;
  case SP_IQ4_XS: *bytes = sizeof(sp_block_iq4_xs); return 256;
  case SP_MXFP4: *bytes = sizeof(sp_block_mxfp4); return 32;
  case SP_TQ1_0: *bytes = sizeof(sp_block_tq1_0); return 256;
  case SP_TQ2_0: *bytes = sizeof(sp_block_tq2_0); return 256;
  default: return 0;
  }
}

int sp_row_bytes(int type, int64_t k, int64_t *row_bytes) {
  int64_t bbytes;
  const int bs = block_of(type, &bbytes);
  if (!bs) return SP_ERR_TYPE;
  if (k < 0 || k % bs || !sp_mul_ok(k / bs, bbytes, row_bytes)) return SP_ERR_SHAPE;
  return SP_OK;
}

/* Each block struct's fields as "values bytes name:offset:size ...", for kernels/ggml_types.py's
 * check of its own table (LAYOUTS) at load; 0, or SP_ERR_TYPE / SP_ERR_SHAPE (cap too small). */
#define SP_F(block, f) {#f, offsetof(block, f), sizeof(((block *)0)->f)}
int sp_block_layout(int type, char *buf, int64_t cap) {
  static const struct {
    int type, values;
    size_t size;
    struct { const char *name; size_t off, size; } f[5];
  } L[] = {
      {SP_Q4_0, 32, sizeof(sp_block_q4_0), {SP_F(sp_block_q4_0, d), SP_F(sp_block_q4_0, qs)}},
      {SP_Q4_1, 32, sizeof(sp_block_q4_1), {SP_F(sp_block_q4_1, d), SP_F(sp_block_q4_1, m), SP_F(sp_block_q4_1, qs)}},
      {SP_Q5_0, 32, sizeof(sp_block_q5_0), {SP_F(sp_block_q5_0, d), SP_F(sp_block_q5_0, qh), SP_F(sp_block_q5_0, qs)}},
      {SP_Q5_1, 32, sizeof(sp_block_q5_1),
       {SP_F(sp_block_q5_1, d), SP_F(sp_block_q5_1, m), SP_F(sp_block_q5_1, qh), SP_F(sp_block_q5_1, qs)}},
      {SP_Q8_0, 32, sizeof(sp_block_q8_0), {SP_F(sp_block_q8_0, d), SP_F(sp_block_q8_0, qs)}},
      {SP_Q4_K, 256, sizeof(sp_block_q4_k),
       {SP_F(sp_block_q4_k, d), SP_F(sp_block_q4_k, dmin), SP_F(sp_block_q4_k, scales), SP_F(sp_block_q4_k, qs)}},
      {SP_Q5_K, 256, sizeof(sp_block_q5_k),
       {SP_F(sp_block_q5_k, d), SP_F(sp_block_q5_k, dmin), SP_F(sp_block_q5_k, scales), SP_F(sp_block_q5_k, qh),
        SP_F(sp_block_q5_k, qs)}},
      {SP_Q6_K, 256, sizeof(sp_block_q6_k),
       {SP_F(sp_block_q6_k, ql), SP_F(sp_block_q6_k, qh), SP_F(sp_block_q6_k, scales), SP_F(sp_block_q6_k, d)}},
      {SP_Q2_K, 256, sizeof(sp_block_q2_k),
       {SP_F(sp_block_q2_k, scales), SP_F(sp_block_q2_k, qs), SP_F(sp_block_q2_k, d), SP_F(sp_block_q2_k, dmin)}},
      {SP_Q3_K, 256, sizeof(sp_block_q3_k),
       {SP_F(sp_block_q3_k, hmask), SP_F(sp_block_q3_k, qs), SP_F(sp_block_q3_k, scales), SP_F(sp_block_q3_k, d)}},
      {SP_IQ2_XXS, 256, sizeof(sp_block_iq2_xxs), {SP_F(sp_block_iq2_xxs, d), SP_F(sp_block_iq2_xxs, qs)}},
      {SP_IQ2_XS, 256, sizeof(sp_block_iq2_xs),
       {SP_F(sp_block_iq2_xs, d), SP_F(sp_block_iq2_xs, qs), SP_F(sp_block_iq2_xs, scales)}},
      {SP_IQ2_S, 256, sizeof(sp_block_iq2_s),
       {SP_F(sp_block_iq2_s, d), SP_F(sp_block_iq2_s, qs), SP_F(sp_block_iq2_s, signs), SP_F(sp_block_iq2_s, qh),
        SP_F(sp_block_iq2_s, scales)}},
      {SP_IQ3_XXS, 256, sizeof(sp_block_iq3_xxs),
       {SP_F(sp_block_iq3_xxs, d), SP_F(sp_block_iq3_xxs, qs), SP_F(sp_block_iq3_xxs, scales_signs)}},
      {SP_IQ3_S, 256, sizeof(sp_block_iq3_s),
       {SP_F(sp_block_iq3_s, d), SP_F(sp_block_iq3_s, qs), SP_F(sp_block_iq3_s, qh), SP_F(sp_block_iq3_s, signs),
        SP_F(sp_block_iq3_s, scales)}},
      {SP_IQ1_S, 256, sizeof(sp_block_iq1_s),
       {SP_F(sp_block_iq1_s, d), SP_F(sp_block_iq1_s, qs), SP_F(sp_block_iq1_s, qh)}},
      {SP_IQ1_M, 256, sizeof(sp_block_iq1_m),
       {SP_F(sp_block_iq1_m, qs), SP_F(sp_block_iq1_m, qh), SP_F(sp_block_iq1_m, scales)}},
      {SP_IQ4_NL, 32, sizeof(sp_block_iq4_nl), {SP_F(sp_block_iq4_nl, d), SP_F(sp_block_iq4_nl, qs)}},
      {SP_IQ4_XS, 256, sizeof(sp_block_iq4_xs),
       {SP_F(sp_block_iq4_xs, d), SP_F(sp_block_iq4_xs, scales_h), SP_F(sp_block_iq4_xs, scales_l),
        SP_F(sp_block_iq4_xs, qs)}},
      {SP_MXFP4, 32, sizeof(sp_block_mxfp4), {SP_F(sp_block_mxfp4, e), SP_F(sp_block_mxfp4, qs)}},
      {SP_TQ1_0, 256, sizeof(sp_block_tq1_0),
       {SP_F(sp_block_tq1_0, qs), SP_F(sp_block_tq1_0, qh), SP_F(sp_block_tq1_0, d)}},
      {SP_TQ2_0, 256, sizeof(sp_block_tq2_0), {SP_F(sp_block_tq2_0, qs), SP_F(sp_block_tq2_0, d)}},
  };
  for (size_t i = 0; i < sizeof L / sizeof L[0]; i++) {
    if (L[i].type != type) continue;
    int64_t n = snprintf(buf, cap > 0 ? (size_t)cap : 0, "%d %zu", L[i].values, L[i].size);
    for (int j = 0; j < 5 && L[i].f[j].name && n >= 0 && n < cap; j++)
      n += snprintf(buf + n, (size_t)(cap - n), " %s:%zu:%zu", L[i].f[j].name, L[i].f[j].off, L[i].f[j].size);
    return n >= 0 && n < cap ? SP_OK : SP_ERR_SHAPE;
  }
  return SP_ERR_TYPE;
}
#undef SP_F

int sp_abi_version(void) { return SP_ABI_VERSION; }

#define TILE_TABLE(isa)                                                                          \
  static tile_fn tile_of_##isa(int type) {                                                       \
    switch (type) {                                                                              \
    case SP_Q4_0: return tiles_q4_0_##isa;                                                       \
    case SP_Q4_1: return tiles_q4_1_##isa;                                                       \
    case SP_Q5_0: return tiles_q5_0_##isa;                                                       \
    case SP_Q5_1: return tiles_q5_1_##isa;                                                       \
    case SP_Q8_0: return tiles_q8_0_##isa;                                                       \
    case SP_Q4_K: return tiles_q4_k_##isa;                                                       \
    case SP_Q5_K: return tiles_q5_k_##isa;                                                       \
    case SP_Q6_K: return tiles_q6_k_##isa;                                                       \
    case SP_Q2_K: return tiles_q2_k_##isa;                                                       \
    case SP_IQ4_NL: case SP_MXFP4: case SP_IQ4_XS: return tiles_lowbit_s8_##isa;                 \
    case SP_Q3_K: case SP_IQ2_XXS: case SP_IQ2_XS: case SP_IQ2_S: case SP_IQ3_XXS: case SP_IQ3_S: \
    case SP_IQ1_S: case SP_IQ1_M: case SP_TQ1_0: case SP_TQ2_0: return tiles_lowbit_##isa;       \
    default: return 0;                                                                           \
    }                                                                                            \
  }
TILE_TABLE(portable)
#ifdef SP_X86
TILE_TABLE(avx2)
TILE_TABLE(vnni)
#endif
#if defined(__aarch64__)
TILE_TABLE(neon)
#endif

static tile_fn pick(int isa, int type) {
  switch (isa) {
#ifdef SP_X86
  case SP_ISA_AVX2: return tile_of_avx2(type);
  case SP_ISA_AVX512VNNI: return tile_of_vnni(type);
#endif
#if defined(__aarch64__)
  case SP_ISA_NEON: return tile_of_neon(type);
#endif
  default: return tile_of_portable(type);
  }
}

#ifdef _OPENMP
/* Split [0, count) into `parts` contiguous ranges; the arithmetic of an element never depends
 * on which range it falls in. */
static void part_range(int64_t count, int parts, int id, int64_t *a, int64_t *b) {
  *a = count * id / parts;
  *b = count * (id + 1) / parts;
}
#endif

static void quantize_rows(const xquant *xq, const float *x, int64_t k, int bs, int64_t a,
                          int64_t b) {
  for (int64_t i = a; i < b; i++)
    for (int64_t g = 0; g < xq->kp / 256; g++) {
      const int64_t at = g * xq->t + i; /* group-major position */
      quantize_group(x + i * k + 256 * g, k - 256 * g, bs, xq->q + at * 256, xq->d + at * 8,
                     xq->dsum + at * 8, xq->s32 + at * 8, xq->s16 + at * 16);
    }
}

static void run_parallel_quantize(const xquant *xq, const float *x, int64_t k, int bs, int64_t t,
                                  int threads) {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  {
    int64_t a, b;
    part_range(t, omp_get_num_threads(), omp_get_thread_num(), &a, &b);
    quantize_rows(xq, x, k, bs, a, b);
  }
#else
  (void)threads;
  quantize_rows(xq, x, k, bs, 0, t);
#endif
}

/* Threads take contiguous ranges of SP_NR-row tiles (only N is split). */
static void run_parallel_tiles(tile_fn fn, const job *jb, int64_t ntiles, int threads) {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  {
    int64_t a, b;
    part_range(ntiles, omp_get_num_threads(), omp_get_thread_num(), &a, &b);
    a *= SP_NR;
    b = b * SP_NR < jb->n ? b * SP_NR : jb->n;
    if (a < b) fn(jb, a, b);
  }
#else
  (void)ntiles, (void)threads;
  fn(jb, 0, jb->n);
#endif
}

#ifdef SP_X86
/* Rows [n0, n1) of y (one activation row): rows are contiguous in memory; the range is read as
 * SP_STREAMS runs of rows side by side, a row of each in turn, each block fetching the lines
 * SP_PF_BYTES ahead of it (past the end of the weights is harmless: a prefetch never faults), each
 * run's first lines fetched at the start (SP_PRIME).  A core busy unpacking blocks keeps fewer
 * lines in flight on one stream than a plain read; several runs keep its hardware prefetchers on
 * several at once (benchmarks/kernel_variants.py, Xeon Sapphire Rapids, one thread, Qwen2.5-Coder
 * 1.5B: layers' matmuls 69.4 ms with one run, 64.7 with four, 62.8 primed; in a later run 60.0
 * with four against 58.1 / 62.2 / 60.9 with 3 / 6 / 8).  Each row is computed as alone: the same
 * bits.
 * xk: the activations in Q4_K's nibble order (permute_k4). */
#ifndef SP_STREAMS
#define SP_STREAMS 4
#endif
#ifndef SP_PRIME
#define SP_PRIME 1
#endif
/* Weight row i against nt = T <= SP_FEW activation rows, nt a constant where inlined. */
SP_INLINE SP_VNNI void row_vnni(const job *jb, const int8_t *xk, int64_t i, const int nt) {
  const xquant *xq = &jb->xq;
  const int64_t ng = xq->kp / 256, rb = jb->row_bytes;
  float v[SP_FEW];
  if (jb->type == SP_Q4_K) rows_q4_k(jb->w + i * rb, ng, xk, xq->d, xq->s32, nt, v);
  else rows_q6_k(jb->w + i * rb, ng, xq->q, xq->d, xq->s16, nt, v);
  for (int r = 0; r < nt; r++) jb->y[r * jb->n + i] = v[r];
}

SP_INLINE SP_VNNI void rows_vnni_t(const job *jb, const int8_t *xk, int64_t n0, int64_t n1, const int nt) {
  const int64_t run = (n1 - n0) / SP_STREAMS;
#if SP_PRIME
  for (int s = 0; s < SP_STREAMS; s++) /* each run's first lines, which no block before it fetches */
    for (int64_t off = 0; off < SP_PF_BYTES; off += 64) __builtin_prefetch(jb->w + (n0 + s * run) * jb->row_bytes + off);
#endif
  for (int64_t a = 0; a < run; a++)
    for (int s = 0; s < SP_STREAMS; s++) row_vnni(jb, xk, n0 + s * run + a, nt);
  for (int64_t i = n0 + SP_STREAMS * run; i < n1; i++) row_vnni(jb, xk, i, nt); /* the rows left over */
}

static SP_VNNI void rows_vnni(const job *jb, const int8_t *xk, int64_t n0, int64_t n1) {
  switch (jb->t) {
  case 1: rows_vnni_t(jb, xk, n0, n1, 1); break;
  default: rows_vnni_t(jb, xk, n0, n1, 2); break;
  }
}

/* Up to how many activation rows rows_vnni takes a type: 0 = never (for the 32-value types the
 * tile path, folding 8 rows at once, is faster than a row at a time with its sequential
 * per-block folding: tried, 1.3-2x slower).  Beyond, the weight lanes are faster (AMD EPYC Zen 5,
 * 8960 x 1536, 1 thread, rows vs weight lanes, ms: Q4_K 1 row 0.278 / 0.285, 2 rows 0.410 /
 * 0.329; Q6_K 1 row 0.296 / 0.450, 2 rows 0.441 / 0.483, 3 rows 0.606 / 0.537). */
static int rows_vnni_max(int type) { return type == SP_Q4_K ? 1 : type == SP_Q6_K ? SP_FEW : 0; }

/* The types the weight lanes take on AVX-512 VNNI past rows_vnni_max (Q5_K: the row lanes). */
static int wlanes_type(int type) { return type == SP_Q4_K || type == SP_Q6_K; }

/* The few-rows paths: threads take contiguous ranges of weight rows. */
static void run_parallel_rows(const job *jb, const int8_t *xk, int threads) {
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    {
      int64_t a, b;
      part_range(jb->n, omp_get_num_threads(), omp_get_thread_num(), &a, &b);
      rows_vnni(jb, xk, a, b);
    }
    return;
  }
#endif
  (void)threads;
  rows_vnni(jb, xk, 0, jb->n);
}
#endif

#ifdef SP_X86
/* The lanes kernels: weight rows [n0, n1) against every activation row, given what the call
 * prepared for them (ctx: the row lanes' xlanes, the weight lanes' activation pairs). */
typedef void (*lanes_fn)(const job *, const void *, int64_t, int64_t);

static void run_parallel_lanes(lanes_fn fn, const job *jb, const void *xl, int64_t ntiles, int threads) {
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    {
      int64_t a, b;
      part_range(ntiles, omp_get_num_threads(), omp_get_thread_num(), &a, &b);
      a *= SP_NR;
      b = b * SP_NR < jb->n ? b * SP_NR : jb->n;
      if (a < b) fn(jb, xl, a, b);
    }
    return;
  }
#endif
  (void)ntiles, (void)threads;
  fn(jb, xl, 0, jb->n);
}
#endif

/* A call whose weight bytes times activation rows are fewer than this runs on one thread: a
 * parallel region wakes the other threads (asleep under OMP_WAIT_POLICY=passive, specpipe/cpus.py)
 * on every call, which costs more than splitting a small matrix saves (AMD EPYC, 2 threads, idle,
 * one-row decode: SmolLM2-135M 11.2 -> 6.9 ms a token with 2 MiB, 1 thread 7.5; Qwen2.5-Coder-1.5B
 * 35.7 -> 34.0; docs/benchmarks.md section 16).  Which thread computes a row never changes its
 * bits, so this moves time only. */
#ifndef SP_PAR_MIN_BYTES
#define SP_PAR_MIN_BYTES (2 << 20)
#endif
static int64_t par_min_bytes = SP_PAR_MIN_BYTES;

void sp_set_parallel_min_bytes(int64_t bytes) { par_min_bytes = bytes < 0 ? 0 : bytes; }

int sp_matmul(int type, const float *x, int64_t t, int64_t k, const uint8_t *w, int64_t n,
              int64_t row_bytes, float *y, int threads, int isa) {
  int64_t bbytes, rb, tk, tn;
  /* values per activation scale: 32 for the kernels that fold per 32-block (IQ4_XS too) */
  const int bs = lowbit_s8_32(type) ? 32 : block_of(type, &bbytes);
  const int rc = sp_row_bytes(type, k, &rb);
  if (rc != SP_OK) return rc;
  /* the scratch below is under 2 * t * kp bytes: sizes checked so that nothing wraps */
  if (t < 0 || n < 0 || row_bytes != rb || k > INT64_MAX / 4 ||
      !sp_mul_ok(t, (k + 255) / 256 * 256, &tk) || tk > INT64_MAX / 4 - SP_AMX_PAD ||
      !sp_mul_ok(t, n, &tn))
    return SP_ERR_SHAPE;
  if (!sp_isa_supported(isa)) return SP_ERR_ISA;
  const int amx = isa == SP_ISA_AMX; /* otherwise the AVX-512 VNNI path */
  isa = sp_vector_isa(isa);
  (void)amx;
  if (t == 0 || n == 0) return SP_OK;
  if (k == 0) { /* an empty sum */
    memset(y, 0, (size_t)(t * n) * sizeof(float));
    return SP_OK;
  }
  if (threads < 1) threads = 1;
  if (tn * row_bytes < par_min_bytes) threads = 1; /* tn = t * n, checked above */

  const int64_t kp = (k + 255) / 256 * 256;
  job jb = {type, t, k, n, row_bytes, k / 32, w, {kp, t, 0, 0, 0, 0, 0}, y};
  /* (+ SP_AMX_PAD: the AMX path's activation tiles read 16 rows, past the last one) */
  void *mem = malloc((size_t)(t * kp + t * (kp / 32) * 12 + t * (kp / 16) * 4 + 64 + SP_AMX_PAD));
  if (!mem) return SP_ERR_MEMORY;
  /* float and int32 arrays first (4-byte aligned), the int8 values last */
  jb.xq.d = (float *)mem;
  jb.xq.dsum = jb.xq.d + t * (kp / 32);
  jb.xq.s32 = (int32_t *)(jb.xq.dsum + t * (kp / 32));
  jb.xq.s16 = jb.xq.s32 + t * (kp / 32);
  jb.xq.q = (int8_t *)(jb.xq.s16 + t * (kp / 16));

  const int64_t ntiles = (n + SP_NR - 1) / SP_NR;
  const int qthreads = (int)(threads < t ? threads : t);
  const int mthreads = (int)(threads < ntiles ? threads : ntiles);
  const tile_fn fn = pick(isa, type);
  const xquant *xq = &jb.xq;

  if (qthreads <= 1) /* no parallel region at all for one thread: it costs a microsecond */
    quantize_rows(xq, x, k, bs, 0, t);
  else
    run_parallel_quantize(xq, x, k, bs, t, qthreads);
#ifdef SP_X86
  if (isa == SP_ISA_AVX512VNNI && t <= rows_vnni_max(type)) {
    int8_t *xk = NULL;
    if (type == SP_Q4_K) { /* the activations in the nibbles' order, once per call */
      xk = malloc((size_t)(t * kp));
      if (!xk) {
        free(mem);
        return SP_ERR_MEMORY;
      }
      permute_k4(xq->q, t * kp, xk); /* each 256-value group on its own */
    }
    run_parallel_rows(&jb, xk, mthreads);
    free(xk);
    free(mem);
    return SP_OK;
  }
  /* The weight lanes (ggml_matmul_wlanes.h): Q4_K and Q6_K past the few-rows path; against the
   * row lanes (below), 1 thread, 8960 x 1536, AMD EPYC Zen 5, ms: Q4_K 4 rows 0.72 -> 0.37, 8
   * rows 0.71 -> 0.51, 64 rows 3.69 -> 2.81; Q6_K 8 rows 0.88 -> 0.72 */
  if (isa == SP_ISA_AVX512VNNI && wlanes_type(type)) {
    int32_t *pairs = wl_pairs(xq, type == SP_Q6_K);
    if (!pairs) {
      free(mem);
      return SP_ERR_MEMORY;
    }
    lanes_fn lanes = wlanes_vnni;
#ifdef SP_HAVE_AMX
    if (amx && t >= SP_AMX_FROM) lanes = wlanes_amx;
#endif
    run_parallel_lanes(lanes, &jb, pairs, ntiles, mthreads);
    free(pairs);
    free(mem);
    return SP_OK;
  }
  /* The row-lanes kernel, AVX-512 VNNI from 4 rows (Q5_K) or 3 (32-value types), AVX2 from 8; below that most of its 8 lanes would idle and the tile is as
   * fast or faster (1 thread, 8960 x 1536, tile vs 256-bit lanes, Intel: Q5_0 2
   * rows 1.08 vs 1.32 ms, 3 rows 1.43 vs 1.34 ms; AVX2 Q4_K 5 rows 1.54 vs 1.81, 8 rows 2.19 vs
   * 1.77; Q5_0 5 rows 1.79 vs 2.00, 8 rows 2.53 vs 2.03) */
  const int64_t lanes_from = isa == SP_ISA_AVX2 ? 8 : is_kquant(type) ? 4 : 3;
  if ((isa == SP_ISA_AVX512VNNI || isa == SP_ISA_AVX2) && t >= lanes_from && lanes_type(type)) {
    xlanes xl = {(t + 7) / 8};
    if (!alloc_lanes(kp / 256, &xl)) {
      free(mem);
      return SP_ERR_MEMORY;
    }
    build_lanes(xq, type, isa == SP_ISA_AVX2 ? 4 : 8, &xl);
    run_parallel_lanes(isa == SP_ISA_AVX2 ? tiles_lanes_any_avx2 : tiles_lanes_any_vnni, &jb, &xl, ntiles, mthreads);
    free(xl.pairs);
    free(mem);
    return SP_OK;
  }
#endif
  if (mthreads <= 1)
    fn(&jb, 0, n);
  else
    run_parallel_tiles(fn, &jb, ntiles, mthreads);
  free(mem);
  return SP_OK;
}

int sp_has_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}
