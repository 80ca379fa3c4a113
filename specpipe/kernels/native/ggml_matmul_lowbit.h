/* The low-bit types' unpacking for the tile loops (included by ggml_matmul.c after wtile,
 * f16_to_f32 and the 32-value types' group helpers).  Layouts: ggml_blocks.h's structs, the value
 * order and formulas in kernels/ggml_lowbit.py (the reference every path here is tested against);
 * grids and sign tables: ggml_grids.h.
 *
 * Every type is brought to a form an existing integer kernel multiplies exactly:
 *
 *   "biased" 256-value types (Q3_K, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0,
 *   TQ2_0): each weight is an integer v times an integer sub-block scale sc (one per 16 values;
 *   a 32-value sub-block's scale is written twice) times one float per block, w = dfac * sc * v,
 *   with |v| <= 64.  q = v + SP_LB_BIAS (0..128, unsigned: maddubs' operand, |pair sum| <=
 *   2 * 128 * 127 < 2^15) goes through Q6_K's kernels (dot_sc / offsets over 16-blocks), and the
 *   bias comes off through the activations' 16-block sums: sumi - SP_LB_BIAS * off (fold_off).
 *     Q3_K:    v = q3 (-4..3),           sc = scale - 32,  dfac = d
 *     IQ2_*:   v = +-grid (8, 25, 43),   sc = 2 ls + 1,    dfac = d / 8    (d (0.5 + ls) / 4)
 *     IQ3_XXS: v = +-grid (4..62),       sc = 2 ls + 1,    dfac = d / 4    (d (0.5 + ls) / 2)
 *     IQ3_S:   v = +-grid (1..15),       sc = 2 ls + 1,    dfac = d
 *     IQ1_*:   v = 8 grid +- 1 (+-9),    sc = 2 ls + 1,    dfac = d / 8    (grid +- 1/8)
 *     TQ*:     v = -1, 0, 1,             sc = 1,           dfac = d
 *   Q2_K (2-bit q, a 4-bit scale and a 4-bit min per 16 values): Q4_K's fold with 16-value
 *   sub-blocks, the mins through the 16-block sums (offsets_mn16).
 *   IQ4_NL, MXFP4 (32-value blocks) and IQ4_XS (a float scale d * (ls - 32) per 32 values): the
 *   int8 lookup values go through Q8_0's kernels and fold, one float per 32-block.
 *
 * The integers are exact, so every ISA's kernels give the same ones; the float folding is the
 * shared fold_* code: the same bits on every path.
 */

#include "ggml_grids.h"

#define SP_LB_BIAS 64
/* The tile loops' compile-time kinds for the low-bit types other than Q2_K (ggml_matmul_tile.h) */
#define SP_KIND_LOWBIT 1000    /* the biased types */
#define SP_KIND_LOWBIT_S8 1001 /* IQ4_NL, MXFP4, IQ4_XS */

/* The biased types (fold_off with SP_LB_BIAS) */
static inline int lowbit_biased(int type) {
  switch (type) {
  case SP_Q3_K: case SP_IQ2_XXS: case SP_IQ2_XS: case SP_IQ2_S: case SP_IQ3_XXS: case SP_IQ3_S:
  case SP_IQ1_S: case SP_IQ1_M: case SP_TQ1_0: case SP_TQ2_0: return 1;
  default: return 0;
  }
}
/* The 32-value-block kernels' low-bit types (int8 values, a float per 32-block) */
static inline int lowbit_s8_32(int type) { return type == SP_IQ4_NL || type == SP_MXFP4 || type == SP_IQ4_XS; }

/* 8 weights of a group: byte i of the result is SP_LB_BIAS + grid byte i, negated where bit i of
 * signs is set (grid bytes <= 64: no byte borrows from its neighbour). */
SP_INLINE uint64_t signed_bytes8(uint64_t grid, uint32_t signs) {
  const uint64_t bias = 0x4040404040404040ull;
  const uint64_t bits = ((uint64_t)(signs & 0xffu) * 0x0101010101010101ull) & 0x8040201008040201ull;
  const uint64_t neg = (((bits + 0x7f7f7f7f7f7f7f7full) & 0x8080808080808080ull) >> 7) * 0xffu;
  return ((bias + grid) & ~neg) | ((bias - grid) & neg);
}
/* The signed IQ2/IQ3 types are unpacked by the portable path in two steps: unpack_lowbit writes
 * each group's grid bytes (magnitudes) to q and its sign byte to signs[group]; apply_signs_portable
 * then makes q = SP_LB_BIAS +- magnitude, 8 bytes a step.  (The x86 paths do it in registers:
 * unpack_grid_avx2 below; the same bytes.) */
SP_INLINE void apply_signs_portable(uint8_t *q, const uint8_t *signs) {
  for (int g = 0; g < 32; g++) {
    uint64_t v;
    memcpy(&v, q + 8 * g, 8);
    v = signed_bytes8(v, signs[g]);
    memcpy(q + 8 * g, &v, 8);
  }
}
/* IQ1: grid bytes are int8 -1, 0, 1; v = 8 g + delta (delta = +-1): with t = g + 1 (0, 1, 2,
 * added byte by byte without carries), q = SP_LB_BIAS - 8 + delta + 8 t in every byte. */
SP_INLINE void put8_iq1(uint8_t *q, uint64_t grid, int delta) {
  const uint64_t lo7 = 0x7f7f7f7f7f7f7f7full, ones = 0x0101010101010101ull;
  const uint64_t t = ((grid & lo7) + ones) ^ (grid & ~lo7);
  const uint64_t v = ones * (uint8_t)(SP_LB_BIAS - 8 + delta) + (t << 3);
  memcpy(q, &v, 8);
}

/* 32 bytes of 2-bit values ("crumbs", value l + 32 k at bits 2k of byte l) -> 128 bytes q, on
 * 32-byte vectors (the compiler leaves the byte loop nearly scalar).  Without hm: q = the crumb
 * + add (Q2_K: add 0, TQ2_0: SP_LB_BIAS - 1).  With hm (Q3_K, add 0): q = SP_LB_BIAS - 4 +
 * crumb + 4 * (bit hbit0 + k of hm[l]). */
typedef uint8_t v32u8 __attribute__((vector_size(32)));
typedef uint8_t v4u8 __attribute__((vector_size(4)));
/* IQ1_M keeps its f16 block scale in the top 4 bits of its four 16-bit scale words: the block's
 * factor (the scale / 8), and the words in u for the sub-block scales. */
SP_INLINE float iq1_m_scale(const uint8_t *s, uint16_t u[4]) {
  memcpy(u, s, 8);
  return f16_table[(uint16_t)((u[0] >> 12) | ((u[1] >> 8) & 0xf0) | ((u[2] >> 4) & 0xf00) | (u[3] & 0xf000))] * 0.125f;
}

SP_INLINE void unpack_crumbs32(const uint8_t *qs, uint8_t *q, const uint8_t *hm, int hbit0, uint8_t add) {
  v32u8 v, m = {0};
  memcpy(&v, qs, 32);
  if (hm) memcpy(&m, hm, 32);
  for (int k = 0; k < 4; k++) {
    v32u8 o = (v >> (2 * k)) & 3;
    if (hm) o += (((m >> (hbit0 + k)) & 1) << 2) + (uint8_t)(SP_LB_BIAS - 4);
    o += add;
    memcpy(q + 32 * k, &o, 32);
  }
}

/* Q3_K's 16 six-bit scales minus 32, SWAR on 64-bit words: the low 4 bits of scale j are the low
 * (j < 8) or high nibble of s[j % 8], its high 2 bits bits 2 (j / 4) of s[8 + j % 4].  Each byte
 * x (0..63) becomes x - 32 as ((x | 0x80) - 0x20) ^ 0x80: no borrow crosses a byte. */
SP_INLINE void q3_k_scales(const uint8_t *s, int8_t *sc) {
  const uint64_t nib = 0x0f0f0f0f0f0f0f0full, h80 = 0x8080808080808080ull, h20 = 0x2020202020202020ull;
  const uint64_t lo = load_u64(s);
  const uint32_t hw = load_u32(s + 8), two = 0x03030303u;
  const uint64_t hi0 = (hw & two) | (uint64_t)((hw >> 2) & two) << 32;
  const uint64_t hi1 = ((hw >> 4) & two) | (uint64_t)((hw >> 6) & two) << 32;
  const uint64_t x[2] = {(lo & nib) | hi0 << 4, ((lo >> 4) & nib) | hi1 << 4};
  for (int i = 0; i < 2; i++) {
    const uint64_t v = ((x[i] | h80) - h20) ^ h80;
    memcpy(sc + 8 * i, &v, 8);
  }
}

/* 256-value low-bit block b into row r of the tile; returns 1 when q holds magnitudes whose
 * signs (one byte per 8 values) are in sg[32], for apply_signs_portable (the IQ2 / IQ3 types;
 * the x86 paths take those in unpack_grid_avx2 and this only for the others, sg unused). */
SP_INLINE int unpack_lowbit(int type, const uint8_t *b, wtile *w, int r, uint8_t *restrict sg) {
  uint8_t *restrict q = w->q[r];
  int8_t *restrict sc = w->sc[r];
  switch (type) {
  case SP_Q2_K: {
    const uint8_t *s = SP_FIELD(b, sp_block_q2_k, scales), *qs = SP_FIELD(b, sp_block_q2_k, qs);
    w->d[0][r] = f16_to_f32(SP_FIELD(b, sp_block_q2_k, d));
    w->d[1][r] = f16_to_f32(SP_FIELD(b, sp_block_q2_k, dmin));
    v16u8 sv;
    memcpy(&sv, s, 16);
    const v16u8 lo = sv & 15, hi = sv >> 4;
    memcpy(sc, &lo, 16);
    memcpy(w->mn16[r], &hi, 16);
    for (int h = 0; h < 2; h++) unpack_crumbs32(qs + 32 * h, q + 128 * h, 0, 0, 0);
    return 0;
  }
  case SP_Q3_K: {
    const uint8_t *s = SP_FIELD(b, sp_block_q3_k, scales), *qs = SP_FIELD(b, sp_block_q3_k, qs);
    const uint8_t *hm = SP_FIELD(b, sp_block_q3_k, hmask);
    w->d[0][r] = f16_to_f32(SP_FIELD(b, sp_block_q3_k, d));
    q3_k_scales(s, sc);
    /* q3 = low 2 bits - 4 where the hmask bit is clear: q = SP_LB_BIAS - 4 + crumb + 4 hbit */
    for (int h = 0; h < 2; h++) unpack_crumbs32(qs + 32 * h, q + 128 * h, hm, 4 * h, 0);
    return 0;
  }
  case SP_IQ2_XXS: case SP_IQ3_XXS: {
    const int iq2 = type == SP_IQ2_XXS;
    const float d = f16_to_f32(b); /* d leads both */
    const uint8_t *qs = iq2 ? SP_FIELD(b, sp_block_iq2_xxs, qs) : SP_FIELD(b, sp_block_iq3_xxs, qs);
    w->d[0][r] = d * (iq2 ? 0.125f : 0.25f);
    for (int ib = 0; ib < 8; ib++) {
      const uint8_t *idx = qs + 8 * ib; /* IQ2: 4 index bytes then a1; IQ3: 8 index bytes */
      const uint32_t a1 = iq2 ? load_u32(qs + 8 * ib + 4) : load_u32(SP_FIELD(b, sp_block_iq3_xxs, scales_signs) + 4 * ib);
      sc[2 * ib] = sc[2 * ib + 1] = (int8_t)(2 * (a1 >> 28) + 1);
      for (int k = 0; k < 4; k++) {
        sg[4 * ib + k] = sp_ksigns_iq2xs[(a1 >> (7 * k)) & 127];
        if (iq2)
          memcpy(q + 32 * ib + 8 * k, &sp_iq2xxs_grid[idx[k]], 8);
        else {
          memcpy(q + 32 * ib + 8 * k, &sp_iq3xxs_grid[idx[2 * k]], 4);
          memcpy(q + 32 * ib + 8 * k + 4, &sp_iq3xxs_grid[idx[2 * k + 1]], 4);
        }
      }
    }
    return 1;
  }
  case SP_IQ2_XS: case SP_IQ2_S: {
    const uint8_t *s = type == SP_IQ2_XS ? SP_FIELD(b, sp_block_iq2_xs, scales) : SP_FIELD(b, sp_block_iq2_s, scales);
    w->d[0][r] = f16_to_f32(b) * 0.125f;
    for (int j = 0; j < 16; j++) sc[j] = (int8_t)(2 * ((s[j / 2] >> (4 * (j & 1))) & 15) + 1);
    if (type == SP_IQ2_XS) {
      const uint8_t *qs = SP_FIELD(b, sp_block_iq2_xs, qs);
      for (int g = 0; g < 32; g++) {
        const uint32_t v = qs[2 * g] | (uint32_t)qs[2 * g + 1] << 8;
        memcpy(q + 8 * g, &sp_iq2xs_grid[v & 511], 8);
        sg[g] = sp_ksigns_iq2xs[v >> 9];
      }
    } else {
      const uint8_t *qs = SP_FIELD(b, sp_block_iq2_s, qs), *qh = SP_FIELD(b, sp_block_iq2_s, qh);
      memcpy(sg, SP_FIELD(b, sp_block_iq2_s, signs), 32);
      for (int g4 = 0; g4 < 8; g4++) { /* qh[g4]: two high index bits for each of 4 groups */
        const uint32_t h = qh[g4];
        uint64_t v[4];
        for (int i = 0; i < 4; i++) v[i] = sp_iq2s_grid[qs[4 * g4 + i] | ((h << (8 - 2 * i)) & 768)];
        memcpy(q + 32 * g4, v, 32);
      }
    }
    return 1;
  }
  case SP_IQ3_S: {
    const uint8_t *qs = SP_FIELD(b, sp_block_iq3_s, qs), *qh = SP_FIELD(b, sp_block_iq3_s, qh);
    const uint8_t *s = SP_FIELD(b, sp_block_iq3_s, scales);
    w->d[0][r] = f16_to_f32(b);
    for (int j = 0; j < 16; j++) sc[j] = (int8_t)(2 * ((s[j / 4] >> (4 * ((j / 2) & 1))) & 15) + 1);
    memcpy(sg, SP_FIELD(b, sp_block_iq3_s, signs), 32);
    for (int g = 0; g < 8; g++) { /* qh[g]: the ninth index bit of the group's 8 grid entries */
      const uint32_t h = qh[g];
      uint32_t v[8];
      for (int i = 0; i < 8; i++) v[i] = sp_iq3s_grid[qs[8 * g + i] | ((h << (8 - i)) & 256)];
      memcpy(q + 32 * g, v, 32);
    }
    return 1;
  }
  case SP_IQ1_S: {
    const uint8_t *qs = SP_FIELD(b, sp_block_iq1_s, qs), *qh = SP_FIELD(b, sp_block_iq1_s, qh);
    w->d[0][r] = f16_to_f32(b) * 0.125f;
    for (int ib = 0; ib < 8; ib++) {
      const uint32_t h = qh[2 * ib] | (uint32_t)qh[2 * ib + 1] << 8;
      sc[2 * ib] = sc[2 * ib + 1] = (int8_t)(2 * ((h >> 12) & 7) + 1);
      const int delta = h & 0x8000 ? -1 : 1;
      for (int k = 0; k < 4; k++)
        put8_iq1(q + 32 * ib + 8 * k, sp_iq1s_grid[qs[4 * ib + k] | ((h >> (3 * k)) & 7) << 8], delta);
    }
    return 0;
  }
  case SP_IQ1_M: {
    const uint8_t *qs = SP_FIELD(b, sp_block_iq1_m, qs), *qh = SP_FIELD(b, sp_block_iq1_m, qh);
    const uint8_t *s = SP_FIELD(b, sp_block_iq1_m, scales);
    uint16_t u[4];
    w->d[0][r] = iq1_m_scale(s, u);
    for (int j = 0; j < 16; j++) sc[j] = (int8_t)(2 * ((u[j / 4] >> (3 * (j % 4))) & 7) + 1);
    for (int g = 0; g < 32; g++) {
      const int nib = (qh[g / 2] >> (4 * (g & 1))) & 15;
      put8_iq1(q + 8 * g, sp_iq1s_grid[qs[g] | (nib & 7) << 8], nib & 8 ? -1 : 1);
    }
    return 0;
  }
  case SP_TQ2_0: {
    const uint8_t *qs = SP_FIELD(b, sp_block_tq2_0, qs);
    w->d[0][r] = f16_to_f32(SP_FIELD(b, sp_block_tq2_0, d));
    memset(sc, 1, 16);
    for (int h = 0; h < 2; h++) unpack_crumbs32(qs + 32 * h, q + 128 * h, 0, 0, SP_LB_BIAS - 1);
    return 0;
  }
  case SP_TQ1_0: {
    const uint8_t *qs = SP_FIELD(b, sp_block_tq1_0, qs), *qh = SP_FIELD(b, sp_block_tq1_0, qh);
    w->d[0][r] = f16_to_f32(SP_FIELD(b, sp_block_tq1_0, d));
    memset(sc, 1, 16);
    /* Digit p of byte c is ((uint8_t)(c * 3^p) * 3) >> 8, that is (t > 85) + (t > 170) for
     * t = c * 3^p mod 256: t goes from digit to digit as t + t + t, in byte lanes. */
    v32u8 t32;
    v16u8 t16;
    v4u8 t4;
    memcpy(&t32, qs, 32);
    memcpy(&t16, qs + 32, 16);
    memcpy(&t4, qh, 4);
#define SP_TRITS(vt, t, dst)                                                                   \
    do {                                                                                       \
      const vt o = (uint8_t)(SP_LB_BIAS - 1) - (vt)(t > 85) - (vt)(t > 170); /* true: -1 */ \
      memcpy(dst, &o, sizeof o);                                                               \
      t = t + t + t;                                                                           \
    } while (0)
    for (int p = 0; p < 5; p++) SP_TRITS(v32u8, t32, q + 32 * p);
    for (int p = 0; p < 5; p++) SP_TRITS(v16u8, t16, q + 160 + 16 * p);
    for (int p = 0; p < 4; p++) SP_TRITS(v4u8, t4, q + 240 + 4 * p);
#undef SP_TRITS
    return 0;
  }
  default: return 0;
  }
}

/* ------------------------------------------------------------------------------------------- */
/* The grid types' unpacking on AVX2 (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M), a    */
/* 32-value sub-block per step: its 4 (IQ3: 8) grid entries loaded into one vector, its signs made */
/* as 32 multipliers +1 / -1 from the sign bits or bytes in registers (ksigns4_avx2,                */
/* signs4_bytes_avx2, no table) and applied by vpsignb, q = SP_LB_BIAS +- magnitude stored 32      */
/* bytes at a time; indices that take several bit fields (IQ2_XS, IQ2_S, IQ3_S, IQ1_S, IQ1_M) and */
/* the sub-block scales are computed for the whole block on vectors first.  The grid               */
/* entries are not gathered (vpgatherdq / vpgatherdd): on the development EPYC the gathers took    */
/* fewer instructions but more time than the scalar loads (docs/benchmarks.md section 15).  The    */
/* same bytes as the portable unpack_lowbit + apply_signs_portable.  unpack_grid_avx2 takes the    */
/* sign-free types (Q2_K, Q3_K, TQ1_0, TQ2_0) too, with unpack_lowbit's code: one switch a block. */

#ifdef SP_X86
#define SP_LB_AVX2 __attribute__((target("avx2,fma")))
/* Sign multipliers (+1 / -1 per byte, for vpsignb) of 4 groups of 8 from the bits of src (the
 * same 16 bytes in both halves): byte j < 7 of group k is -1 where bit bit[] of byte idx[] of src
 * is set, byte 7 where the group's 7 bits have odd parity (ksigns_iq2xs: a sign byte's bit 7
 * makes its parity even).  Byte 7's idx[] is 0x80 (vpshufb gives 0), so it is never "set", and
 * vpsadbw's sum of each group's 8 "set" bytes (255 each) is odd iff the 7 bits' parity is. */
SP_INLINE SP_LB_AVX2 __m256i ksigns4_avx2(__m256i src, __m256i idx, __m256i bit) {
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(src, idx), bit), bit);
  const __m256i par = _mm256_slli_epi64(_mm256_sad_epu8(set, _mm256_setzero_si256()), 63); /* 0x80 in byte 7 where odd */
  return _mm256_or_si256(set, _mm256_or_si256(par, _mm256_set1_epi8(1)));
}
/* ksigns4_avx2's idx and bit for 4 seven-bit fields at bits 0, 7, 14, 21 of a uint32 (IQ2_XXS,
 * IQ3_XXS): bit 7 k + j is bit (7 k + j) % 8 of byte (7 k + j) / 8 */
#define SP_A1B(k, j) ((j) == 7 ? (char)0x80 : ((7 * (k) + (j)) >> 3) & 3)
#define SP_A1M(k, j) ((j) == 7 ? 1 : (char)(1 << ((7 * (k) + (j)) & 7)))
#define SP_A1_8(f, k) f(k, 0), f(k, 1), f(k, 2), f(k, 3), f(k, 4), f(k, 5), f(k, 6), f(k, 7)
#define SP_A1_32(f) SP_A1_8(f, 0), SP_A1_8(f, 1), SP_A1_8(f, 2), SP_A1_8(f, 3)

/* 4 eight-byte grid entries (one sub-block) */
#define SP_GRID4(grid, ix) \
  _mm256_setr_epi64x((long long)(grid)[(ix)[0]], (long long)(grid)[(ix)[1]], (long long)(grid)[(ix)[2]], (long long)(grid)[(ix)[3]])

/* Sign multipliers (+1 / -1 per byte) of 4 groups of 8 from their 4 sign bytes (IQ2_S, IQ3_S):
 * byte j of group k is -1 where bit j of byte k of s4 is set */
SP_INLINE SP_LB_AVX2 __m256i signs4_bytes_avx2(uint32_t s4) {
  const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)s4), which), bit), bit);
  return _mm256_or_si256(set, _mm256_set1_epi8(1));
}
/* IQ2_XS / IQ2_S: sc[j] = 2 * nibble j of s[0..7] + 1, the low nibble of s[j / 2] first */
SP_INLINE SP_LB_AVX2 void scales_nib16_avx2(const uint8_t *s, int8_t *sc) {
  const __m128i s8 = _mm_loadl_epi64((const __m128i *)s), m4 = _mm_set1_epi8(15);
  const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(s8, m4), _mm_and_si128(_mm_srli_epi16(s8, 4), m4));
  _mm_storeu_si128((__m128i *)sc, _mm_add_epi8(_mm_add_epi8(nib, nib), _mm_set1_epi8(1)));
}
/* 32 group indices lo[g] | hi[g] << 8 (32 bytes each) as uint16 */
SP_INLINE SP_LB_AVX2 void index32_avx2(__m256i lo, __m256i hi, uint16_t *ix) {
  /* bytes interleaved (lo[g], hi[g]) = uint16 lo[g] | hi[g] << 8; the halves put in order */
  const __m256i a = _mm256_unpacklo_epi8(lo, hi), c = _mm256_unpackhi_epi8(lo, hi);
  _mm256_storeu_si256((__m256i *)ix, _mm256_permute2x128_si256(a, c, 0x20));
  _mm256_storeu_si256((__m256i *)(ix + 16), _mm256_permute2x128_si256(a, c, 0x31));
}
#define iq1_index32(qs, hi3, ix) index32_avx2(_mm256_loadu_si256((const __m256i *)(qs)), hi3, ix)
/* 8 four-byte grid entries (one sub-block) */
#define SP_GRID8(grid, ix)                                                                                    \
  _mm256_setr_epi32((int)(grid)[(ix)[0]], (int)(grid)[(ix)[1]], (int)(grid)[(ix)[2]], (int)(grid)[(ix)[3]], \
                    (int)(grid)[(ix)[4]], (int)(grid)[(ix)[5]], (int)(grid)[(ix)[6]], (int)(grid)[(ix)[7]])

/* IQ3_S: 8 grid entries of 4 bytes per sub-block, 9-bit indices (qh: the ninth bits, a byte per
 * sub-block), the signs as bytes, sc[j] = 2 * nibble j / 2 of the 4 scale bytes + 1 */
SP_INLINE SP_LB_AVX2 void unpack_iq3_s_avx2(const uint8_t *b, wtile *w, int r) {
  uint8_t *restrict q = w->q[r];
  const uint8_t *qs = SP_FIELD(b, sp_block_iq3_s, qs), *qh = SP_FIELD(b, sp_block_iq3_s, qh);
  const uint8_t *sgn = SP_FIELD(b, sp_block_iq3_s, signs), *s = SP_FIELD(b, sp_block_iq3_s, scales);
  w->d[0][r] = f16_to_f32(b);
  const __m128i s4 = _mm_cvtsi32_si128((int)load_u32(s)), m4 = _mm_set1_epi8(15);
  const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(s4, m4), _mm_and_si128(_mm_srli_epi16(s4, 4), m4));
  const __m128i nib2 = _mm_unpacklo_epi8(nib, nib); /* each nibble twice */
  _mm_storeu_si128((__m128i *)w->sc[r], _mm_add_epi8(_mm_add_epi8(nib2, nib2), _mm_set1_epi8(1)));
  /* index 8 g + i's ninth bit: bit i of qh[g] */
  const __m256i hq = _mm256_set1_epi64x((long long)load_u64(qh)), one = _mm256_set1_epi8(1);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  uint16_t ix[64] __attribute__((aligned(32)));
  for (int h = 0; h < 2; h++) {
    const __m256i hb = _mm256_shuffle_epi8(hq, _mm256_add_epi8(sel, _mm256_set1_epi8((char)(4 * h))));
    const __m256i hi = _mm256_min_epu8(_mm256_and_si256(hb, bit), one);
    index32_avx2(_mm256_loadu_si256((const __m256i *)(qs + 32 * h)), hi, ix + 32 * h);
  }
  const __m256i bias = _mm256_set1_epi8(SP_LB_BIAS);
  for (int ib = 0; ib < 8; ib++) {
    const __m256i g = SP_GRID8(sp_iq3s_grid, ix + 8 * ib);
    _mm256_storeu_si256((__m256i *)(q + 32 * ib), _mm256_add_epi8(bias, _mm256_sign_epi8(g, signs4_bytes_avx2(load_u32(sgn + 4 * ib)))));
  }
}
/* IQ2_S: 4 grid entries of 8 bytes per sub-block, 10-bit indices (qh[g4]: 2 high bits for each
 * of sub-block g4's 4 entries), the signs as bytes, scales as IQ2_XS */
SP_INLINE SP_LB_AVX2 void unpack_iq2_s_avx2(const uint8_t *b, wtile *w, int r) {
  uint8_t *restrict q = w->q[r];
  const uint8_t *qs = SP_FIELD(b, sp_block_iq2_s, qs), *qh = SP_FIELD(b, sp_block_iq2_s, qh);
  const uint8_t *sgn = SP_FIELD(b, sp_block_iq2_s, signs);
  w->d[0][r] = f16_to_f32(b) * 0.125f;
  scales_nib16_avx2(SP_FIELD(b, sp_block_iq2_s, scales), w->sc[r]);
  /* uint16 lane e = 4 g4 + i: qh[g4] << (8 - 2 i) (a multiply), & 768, | qs[e] */
  const __m256i hq = _mm256_set1_epi64x((long long)load_u64(qh));
  const __m256i mul = _mm256_setr_epi16(256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4);
  const __m256i sel = _mm256_setr_epi8(0, -1, 0, -1, 0, -1, 0, -1, 1, -1, 1, -1, 1, -1, 1, -1,
                                       2, -1, 2, -1, 2, -1, 2, -1, 3, -1, 3, -1, 3, -1, 3, -1);
  uint16_t ix[32] __attribute__((aligned(32)));
  for (int h = 0; h < 2; h++) {
    const __m256i x = _mm256_shuffle_epi8(hq, _mm256_add_epi8(sel, _mm256_set1_epi16(4 * h)));
    const __m256i hi = _mm256_and_si256(_mm256_mullo_epi16(x, mul), _mm256_set1_epi16(768));
    const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16 * h)));
    _mm256_store_si256((__m256i *)(ix + 16 * h), _mm256_or_si256(hi, lo));
  }
  const __m256i bias = _mm256_set1_epi8(SP_LB_BIAS);
  for (int ib = 0; ib < 8; ib++) {
    const __m256i g = SP_GRID4(sp_iq2s_grid, ix + 4 * ib);
    _mm256_storeu_si256((__m256i *)(q + 32 * ib), _mm256_add_epi8(bias, _mm256_sign_epi8(g, signs4_bytes_avx2(load_u32(sgn + 4 * ib)))));
  }
}

/* IQ2_XXS (iq2 = 1) or IQ3_XXS (0), a compile-time constant where inlined */
SP_INLINE SP_LB_AVX2 void unpack_xxs_avx2(const uint8_t *b, wtile *w, int r, const int iq2) {
  uint8_t *restrict q = w->q[r];
  int8_t *restrict sc = w->sc[r];
  const __m256i bias = _mm256_set1_epi8(SP_LB_BIAS);
  const __m256i a1idx = _mm256_setr_epi8(SP_A1_32(SP_A1B)), a1bit = _mm256_setr_epi8(SP_A1_32(SP_A1M));
  const uint8_t *qs = iq2 ? SP_FIELD(b, sp_block_iq2_xxs, qs) : SP_FIELD(b, sp_block_iq3_xxs, qs);
  w->d[0][r] = f16_to_f32(b) * (iq2 ? 0.125f : 0.25f);
  /* sc[2 ib] = sc[2 ib + 1] = 2 (a1_ib >> 28) + 1 = (a1_ib >> 27) | 1, the low byte of each a1's
   * int32 lane spread by a shuffle (IQ2: the a1 are every other uint32 of qs, IQ3: 8 in a row) */
  if (iq2) {
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i v0 = _mm256_or_si256(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)qs), 27), one);
    const __m256i v1 = _mm256_or_si256(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(qs + 32)), 27), one);
    const __m256i p0 = _mm256_setr_epi8(4, 4, 12, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        4, 4, 12, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i p1 = _mm256_setr_epi8(-1, -1, -1, -1, 4, 4, 12, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                        -1, -1, -1, -1, 4, 4, 12, 12, -1, -1, -1, -1, -1, -1, -1, -1);
    /* int32 lanes: sc 0-3, sc 8-11, -, - | sc 4-7, sc 12-15, -, - */
    const __m256i u = _mm256_or_si256(_mm256_shuffle_epi8(v0, p0), _mm256_shuffle_epi8(v1, p1));
    _mm_storeu_si128((__m128i *)sc, _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(u, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0))));
  } else {
    const __m256i v = _mm256_or_si256(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)SP_FIELD(b, sp_block_iq3_xxs, scales_signs)), 27),
                                      _mm256_set1_epi32(1));
    const __m256i u = _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 0, 4, 4, 8, 8, 12, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                              0, 0, 4, 4, 8, 8, 12, 12, -1, -1, -1, -1, -1, -1, -1, -1));
    _mm_storeu_si128((__m128i *)sc, _mm256_castsi256_si128(_mm256_permute4x64_epi64(u, 0x08)));
  }
  for (int ib = 0; ib < 8; ib++) {
    /* IQ2: 4 index bytes, then a1 (4 sign indices of 7 bits, the scale); IQ3: 8 index bytes */
    const uint8_t *ix = qs + 8 * ib;
    const uint32_t a1 = iq2 ? load_u32(qs + 8 * ib + 4) : load_u32(SP_FIELD(b, sp_block_iq3_xxs, scales_signs) + 4 * ib);
    const __m256i g = iq2 ? SP_GRID4(sp_iq2xxs_grid, ix)
                          : _mm256_setr_epi32((int)sp_iq3xxs_grid[ix[0]], (int)sp_iq3xxs_grid[ix[1]], (int)sp_iq3xxs_grid[ix[2]],
                                              (int)sp_iq3xxs_grid[ix[3]], (int)sp_iq3xxs_grid[ix[4]], (int)sp_iq3xxs_grid[ix[5]],
                                              (int)sp_iq3xxs_grid[ix[6]], (int)sp_iq3xxs_grid[ix[7]]);
    const __m256i sg = ksigns4_avx2(_mm256_set1_epi32((int)a1), a1idx, a1bit);
    _mm256_storeu_si256((__m256i *)(q + 32 * ib), _mm256_add_epi8(bias, _mm256_sign_epi8(g, sg)));
  }
}

/* Block b of type Q2_K or a biased type into row r of the tile (one switch); returns 0 for any
 * other type. */
SP_INLINE SP_LB_AVX2 int unpack_grid_avx2(int type, const uint8_t *b, wtile *w, int r) {
  uint8_t *restrict q = w->q[r];
  int8_t *restrict sc = w->sc[r];
  const __m256i bias = _mm256_set1_epi8(SP_LB_BIAS);
  switch (type) {
  case SP_IQ2_XXS: unpack_xxs_avx2(b, w, r, 1); return 1;
  case SP_IQ3_XXS: unpack_xxs_avx2(b, w, r, 0); return 1;
  case SP_IQ3_S: unpack_iq3_s_avx2(b, w, r); return 1;
  case SP_IQ2_S: unpack_iq2_s_avx2(b, w, r); return 1;
  /* the types without signs: unpack_lowbit's code (a constant type: its switch folds away) */
  case SP_Q2_K: (void)unpack_lowbit(SP_Q2_K, b, w, r, 0); return 1;
  case SP_Q3_K: (void)unpack_lowbit(SP_Q3_K, b, w, r, 0); return 1;
  case SP_TQ1_0: (void)unpack_lowbit(SP_TQ1_0, b, w, r, 0); return 1;
  case SP_TQ2_0: (void)unpack_lowbit(SP_TQ2_0, b, w, r, 0); return 1;
  case SP_IQ2_XS: {
    const uint8_t *qs = SP_FIELD(b, sp_block_iq2_xs, qs), *s = SP_FIELD(b, sp_block_iq2_xs, scales);
    w->d[0][r] = f16_to_f32(b) * 0.125f;
    scales_nib16_avx2(s, sc);
    /* 32 uint16: a 9-bit grid index, a 7-bit sign index (bits 1-7 of the high byte) */
    uint16_t ix[32] __attribute__((aligned(32)));
    const __m256i m9 = _mm256_set1_epi16(511);
    _mm256_store_si256((__m256i *)ix, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)qs), m9));
    _mm256_store_si256((__m256i *)(ix + 16), _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(qs + 32)), m9));
    const __m256i xsidx = _mm256_setr_epi8(1, 1, 1, 1, 1, 1, 1, -128, 3, 3, 3, 3, 3, 3, 3, -128,
                                           5, 5, 5, 5, 5, 5, 5, -128, 7, 7, 7, 7, 7, 7, 7, -128);
    const __m256i xsbit = _mm256_set1_epi64x(0x0180402010080402ll);
    for (int ib = 0; ib < 8; ib++) {
      const __m256i g = SP_GRID4(sp_iq2xs_grid, ix + 4 * ib);
      const __m256i sg = ksigns4_avx2(_mm256_set1_epi64x((long long)load_u64(qs + 8 * ib)), xsidx, xsbit);
      _mm256_storeu_si256((__m256i *)(q + 32 * ib), _mm256_add_epi8(bias, _mm256_sign_epi8(g, sg)));
    }
    return 1;
  }
  case SP_IQ1_S: {
    const uint8_t *qs = SP_FIELD(b, sp_block_iq1_s, qs), *qh = SP_FIELD(b, sp_block_iq1_s, qh);
    w->d[0][r] = f16_to_f32(b) * 0.125f;
    /* qh: a uint16 h per sub-block: 3 high index bits per group (bits 3 k), the scale (bits
     * 12-14), the delta's sign (bit 15).  Group 4 ib + k's 3 bits: h_ib in int16 lane 4 ib + k,
     * multiplied to bring bits 3 k .. 3 k + 2 to 13-15, shifted down */
    const __m256i hv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qh));
    const __m256i mul = _mm256_setr_epi16(1 << 13, 1 << 10, 1 << 7, 1 << 4, 1 << 13, 1 << 10, 1 << 7, 1 << 4,
                                          1 << 13, 1 << 10, 1 << 7, 1 << 4, 1 << 13, 1 << 10, 1 << 7, 1 << 4);
    /* int16 lanes: h_0 x4, h_1 x4 | h_2 x4, h_3 x4 (sel0); h_4 .. h_7 likewise (sel1) */
    const __m256i sel0 = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3,
                                          4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7);
    const __m256i sel1 = _mm256_add_epi8(sel0, _mm256_set1_epi8(8));
    const __m256i f0 = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(hv, sel0), mul), 13);
    const __m256i f1 = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(hv, sel1), mul), 13);
    /* f0: groups 0-7 | 8-15, f1: 16-23 | 24-31 as int16 -> 32 bytes in group order */
    const __m256i hi3 = _mm256_permute4x64_epi64(_mm256_packus_epi16(f0, f1), 0xd8);
    uint16_t ix[32] __attribute__((aligned(32)));
    iq1_index32(qs, hi3, ix);
    /* int16 lane ib: sc pair 2 ((h >> 12) & 7) + 1 = ((h >> 11) & 14) | 1 in the low byte,
     * SP_LB_BIAS + delta = SP_LB_BIAS + 1 - 2 (h >> 15) in the high byte */
    const __m128i h8 = _mm256_castsi256_si128(hv);
    const __m128i scl = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(h8, 11), _mm_set1_epi16(14)), _mm_set1_epi16(1));
    const __m128i bs = _mm_sub_epi16(_mm_set1_epi16((SP_LB_BIAS + 1) << 8), _mm_slli_epi16(_mm_srli_epi16(h8, 15), 9));
    _mm_storeu_si128((__m128i *)sc, _mm_shuffle_epi8(scl, _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14)));
    uint8_t base8[16] __attribute__((aligned(16)));
    _mm_store_si128((__m128i *)base8, bs); /* base8[2 ib + 1] */
    const __m256i eight = _mm256_set1_epi8(8);
    for (int ib = 0; ib < 8; ib++) {
      /* grid bytes -1, 0, 1: 8 g = vpsignb(8, g); q = SP_LB_BIAS + delta + 8 g */
      const __m256i g = SP_GRID4(sp_iq1s_grid, ix + 4 * ib);
      const __m256i base = _mm256_set1_epi8((char)base8[2 * ib + 1]);
      _mm256_storeu_si256((__m256i *)(q + 32 * ib), _mm256_add_epi8(base, _mm256_sign_epi8(eight, g)));
    }
    return 1;
  }
  case SP_IQ1_M: {
    const uint8_t *qs = SP_FIELD(b, sp_block_iq1_m, qs), *qh = SP_FIELD(b, sp_block_iq1_m, qh);
    const uint8_t *s = SP_FIELD(b, sp_block_iq1_m, scales);
    uint16_t u[4];
    w->d[0][r] = iq1_m_scale(s, u);
    /* sc[j] = 2 * (3-bit field j % 4 of u[j / 4]) + 1: u[j / 4] in int16 lane j, its field
     * brought to bits 13-15 by a multiply, then down */
    const __m128i sv = _mm_loadl_epi64((const __m128i *)s);
    const __m128i mul = _mm_setr_epi16(1 << 13, 1 << 10, 1 << 7, 1 << 4, 1 << 13, 1 << 10, 1 << 7, 1 << 4);
    const __m128i u01 = _mm_shuffle_epi8(sv, _mm_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3));
    const __m128i u23 = _mm_shuffle_epi8(sv, _mm_setr_epi8(4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7));
    const __m128i f = _mm_packus_epi16(_mm_srli_epi16(_mm_mullo_epi16(u01, mul), 13), _mm_srli_epi16(_mm_mullo_epi16(u23, mul), 13));
    _mm_storeu_si128((__m128i *)sc, _mm_add_epi8(_mm_add_epi8(f, f), _mm_set1_epi8(1)));
    /* group g's nibble (qh[g / 2], low first): 3 high index bits, the delta's sign in bit 3 */
    const __m128i hb = _mm_loadu_si128((const __m128i *)qh), m4 = _mm_set1_epi8(15);
    const __m128i nlo = _mm_and_si128(hb, m4), nhi = _mm_and_si128(_mm_srli_epi16(hb, 4), m4);
    const __m256i nib = _mm256_set_m128i(_mm_unpackhi_epi8(nlo, nhi), _mm_unpacklo_epi8(nlo, nhi));
    uint16_t ix[32] __attribute__((aligned(32)));
    iq1_index32(qs, _mm256_and_si256(nib, _mm256_set1_epi8(7)), ix);
    /* SP_LB_BIAS + delta per group = SP_LB_BIAS + 1 - 2 (bit 3) */
    uint8_t base32[32] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)base32, _mm256_sub_epi8(_mm256_set1_epi8(SP_LB_BIAS + 1),
                                                          _mm256_and_si256(_mm256_srli_epi16(nib, 2), _mm256_set1_epi8(2))));
    const __m256i eight = _mm256_set1_epi8(8);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    for (int ib = 0; ib < 8; ib++) {
      const __m256i g = SP_GRID4(sp_iq1s_grid, ix + 4 * ib);
      const __m256i base = _mm256_shuffle_epi8(_mm256_set1_epi32((int)load_u32(base32 + 4 * ib)), spread);
      _mm256_storeu_si256((__m256i *)(q + 32 * ib), _mm256_add_epi8(base, _mm256_sign_epi8(eight, g)));
    }
    return 1;
  }
  default: return 0;
  }
}
#undef SP_GRID4
#undef SP_GRID8
#undef iq1_index32
#undef SP_A1_32
#undef SP_A1_8
#undef SP_A1M
#undef SP_A1B
#endif

/* unpack_lowbit_<isa>: block b (Q2_K or a biased type) into row r of the tile, signs applied */
SP_INLINE void unpack_lowbit_portable(int type, const uint8_t *b, wtile *w, int r) {
  uint8_t sg[32];
  if (unpack_lowbit(type, b, w, r, sg)) apply_signs_portable(w->q[r], sg);
}
#define unpack_lowbit_neon unpack_lowbit_portable
#ifdef SP_X86
SP_INLINE SP_LB_AVX2 void unpack_lowbit_avx2(int type, const uint8_t *b, wtile *w, int r) {
  (void)unpack_grid_avx2(type, b, w, r);
}
#define unpack_lowbit_vnni unpack_lowbit_avx2
#endif

/* Q2_K's mins: out[r] = sum_j mn16[r][j] * xsum16[j] (exact: the same integers on every path).
 * AVX2: |xsum16| <= 16 * 128 fits int16, so madd takes 16 products a row at once, and three
 * rounds of hadd sum each row's 8 lanes with the other rows' beside them. */
SP_INLINE void offsets_mn16_portable(const wtile *w, const int32_t *s16, int32_t *out) {
  for (int r = 0; r < SP_NR; r++) {
    int32_t s = 0;
    for (int j = 0; j < 16; j++) s += w->mn16[r][j] * s16[j];
    out[r] = s;
  }
}
#define offsets_mn16_neon offsets_mn16_portable
#ifdef SP_X86
SP_INLINE __attribute__((target("avx2,fma"))) void offsets_mn16_avx2(const wtile *w, const int32_t *s16, int32_t *out) {
  const __m256i packed = _mm256_packs_epi32(_mm256_loadu_si256((const __m256i *)s16),
                                            _mm256_loadu_si256((const __m256i *)(s16 + 8)));
  const __m256i x = _mm256_permute4x64_epi64(packed, 0xd8); /* packs interleaves the halves */
  __m256i p[SP_NR];
  for (int r = 0; r < SP_NR; r++)
    p[r] = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)w->mn16[r])), x);
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
  _mm256_storeu_si256((__m256i *)out, sum);
}
#define offsets_mn16_vnni offsets_mn16_avx2
#endif

/* E8M0 halved (MXFP4's values are doubled): 2^(e - 128); e < 2 is a subnormal.  The unpacking
 * reads it from a table (one load instead of a compare and a shift), filled from this at load. */
SP_INLINE float e8m0_half_of(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
static float e8m0_half_table[256];
__attribute__((constructor)) static void e8m0_half_table_init(void) {
  for (int e = 0; e < 256; e++) e8m0_half_table[e] = e8m0_half_of((uint8_t)e);
}
#define e8m0_half(e) e8m0_half_table[(uint8_t)(e)]

/* 16 bytes of nibbles -> 32 int8 lookup values (low nibbles first, as Q4_0); the x86 tiles'
 * version looks the 32 up in one byte shuffle (the same bytes). */
SP_INLINE void lookup_nibbles16_portable(const uint8_t *qs, const int8_t *kv, uint8_t *q) {
  for (int l = 0; l < 16; l++) {
    q[l] = (uint8_t)kv[qs[l] & 15];
    q[16 + l] = (uint8_t)kv[qs[l] >> 4];
  }
}
#define lookup_nibbles16_neon lookup_nibbles16_portable
#ifdef SP_X86
SP_INLINE __attribute__((target("avx2,fma"))) void lookup_nibbles16_avx2(const uint8_t *qs, const int8_t *kv, uint8_t *q) {
  const __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
  const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
  const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kv));
  _mm256_storeu_si256((__m256i *)q, _mm256_shuffle_epi8(tab, idx));
}
#define lookup_nibbles16_vnni lookup_nibbles16_avx2
#endif

/* The s8 kinds' unpacking, once per ISA (isa: the suffix of its lookup_nibbles16, attr: its
 * target attribute):
 *   unpack_group32_lowbit_<isa>: IQ4_NL / MXFP4 group g of row r (nblk 32-blocks a row), as
 *     unpack_group32;
 *   unpack_iq4_xs_<isa> (SP_IQ4_XS_UNPACK; AVX2: below): one IQ4_XS block = one group of 8
 *     32-blocks, each with its float scale d * (ls - 32). */
#define SP_LOWBIT_S8_UNPACK(isa, attr)                                                                   \
  SP_INLINE attr void unpack_group32_lowbit_##isa(int type, const uint8_t *row, int64_t g, int64_t nblk, \
                                                  wtile *w, int r) {                                     \
    const int nb = group32_blocks(row, g, nblk, w, r);                                                   \
    const int mx = type == SP_MXFP4;                                                                     \
    const int64_t bytes = mx ? (int64_t)sizeof(sp_block_mxfp4) : (int64_t)sizeof(sp_block_iq4_nl);      \
    for (int j = 0; j < nb; j++) {                                                                       \
      const uint8_t *b = row + (8 * g + j) * bytes;                                                      \
      w->d[j][r] = mx ? e8m0_half(b[0]) : f16_to_f32(b);                                                 \
      lookup_nibbles16_##isa(mx ? SP_FIELD(b, sp_block_mxfp4, qs) : SP_FIELD(b, sp_block_iq4_nl, qs),    \
                             mx ? sp_kvalues_mxfp4 : sp_kvalues_iq4nl, w->q[r] + 32 * j);                \
    }                                                                                                    \
  }
#define SP_IQ4_XS_UNPACK(isa, attr)                                                                      \
  SP_INLINE attr void unpack_iq4_xs_##isa(const uint8_t *b, wtile *w, int r) {                          \
    const float d = f16_to_f32(b);                                                                       \
    const uint8_t *h = SP_FIELD(b, sp_block_iq4_xs, scales_h);                                          \
    const uint32_t sh = h[0] | (uint32_t)h[1] << 8;                                                      \
    const uint8_t *sl = SP_FIELD(b, sp_block_iq4_xs, scales_l), *qs = SP_FIELD(b, sp_block_iq4_xs, qs); \
    w->nb = 8;                                                                                           \
    for (int j = 0; j < 8; j++) {                                                                        \
      const int ls = ((sl[j / 2] >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4);                 \
      w->d[j][r] = d * (float)(ls - 32);                                                                 \
      lookup_nibbles16_##isa(qs + 16 * j, sp_kvalues_iq4nl, w->q[r] + 32 * j);                           \
    }                                                                                                    \
  }
SP_LOWBIT_S8_UNPACK(portable, )
SP_IQ4_XS_UNPACK(portable, )
#define unpack_group32_lowbit_neon unpack_group32_lowbit_portable
#define unpack_iq4_xs_neon unpack_iq4_xs_portable
#ifdef SP_X86
SP_LOWBIT_S8_UNPACK(avx2, __attribute__((target("avx2,fma"))))
/* IQ4_XS on AVX2: the 8 six-bit scales and their floats d * (ls - 32) on one vector (the same
 * products as the scalar code: one IEEE multiply each), then the lookups */
SP_INLINE SP_LB_AVX2 void unpack_iq4_xs_avx2(const uint8_t *b, wtile *w, int r) {
  const float d = f16_to_f32(b);
  const uint8_t *h = SP_FIELD(b, sp_block_iq4_xs, scales_h);
  const uint32_t sh = h[0] | (uint32_t)h[1] << 8;
  const uint8_t *sl = SP_FIELD(b, sp_block_iq4_xs, scales_l), *qs = SP_FIELD(b, sp_block_iq4_xs, qs);
  w->nb = 8;
  /* int32 lane j: nibble j of sl (byte j / 2, low first) | bits 2 j, 2 j + 1 of sh << 4 */
  const __m256i slv = _mm256_set1_epi32((int)load_u32(sl));
  const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(slv, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), _mm256_set1_epi32(15));
  const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)sh), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                      _mm256_set1_epi32(3));
  const __m256i ls = _mm256_or_si256(nib, _mm256_slli_epi32(hi, 4));
  float dj[8] __attribute__((aligned(32)));
  _mm256_store_ps(dj, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32)))));
  for (int j = 0; j < 8; j++) {
    w->d[j][r] = dj[j];
    lookup_nibbles16_avx2(qs + 16 * j, sp_kvalues_iq4nl, w->q[r] + 32 * j);
  }
}
#define unpack_group32_lowbit_vnni unpack_group32_lowbit_avx2
#define unpack_iq4_xs_vnni unpack_iq4_xs_avx2
#endif
