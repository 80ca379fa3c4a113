/* The GGUF block layouts, described once: one struct per block type, as llama.cpp's
 * ggml-common.h (little-endian; f16 = IEEE half stored as its 16 bits).  "q" is the stored
 * unsigned integer of a value; the unpacking in ggml_matmul.c reads fields at these structs'
 * offsets (offsetof / sizeof, never through a struct pointer: rows of 18- or 22-byte blocks
 * start at any address).  sp_block_layout() exports every field's offset and size, and
 * kernels/ggml_types.py LAYOUTS, the Python reader's table, is checked against it when the
 * library loads (and in tests/kernels/test_native_boundary.py).
 *
 *   Q4_0  32 values: value l = qs[l] & 15, value l+16 = qs[l] >> 4 (l < 16).  w = d * (q - 8)
 *   Q4_1  32 values: qs as Q4_0.  w = d*q + m
 *   Q5_0  32 values: low 4 bits as Q4_0, bit 4 of value i = (qh >> i) & 1.  w = d * (q - 16)
 *   Q5_1  32 values: as Q5_0.  w = d*q + m
 *   Q8_0  32 values: int8.  w = d * qs
 *   Q4_K  256 values: scales[12] = eight 6-bit (scale, min) pairs, j < 4: sc = s[j] & 63,
 *         mn = s[j+4] & 63; j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4,
 *         mn = (s[j+4] >> 4) | (s[j] >> 6) << 4; for chunk c < 4, value 64c+l = qs[32c+l] & 15
 *         (sub-block 2c), value 64c+32+l = qs[32c+l] >> 4 (sub-block 2c+1), l < 32.
 *         w = d*sc[i/32]*q - dmin*mn[i/32]
 *   Q5_K  256 values: scales and qs as Q4_K; bit 4 of value 64c+l is qh[l] >> 2c & 1, of
 *         value 64c+32+l is qh[l] >> (2c+1) & 1.  w as Q4_K
 *   Q6_K  256 values: for half h < 2, l < 32, k < 4: value 128h+32k+l has low 4 bits
 *         ql[64h + l + 32(k&1)] (& 15 for k < 2, >> 4 for k >= 2) and high 2 bits
 *         qh[32h+l] >> 2k & 3.  w = d * scales[i/16] * (q - 32)
 *
 * The low-bit types (Q2_K, Q3_K, the IQ types, MXFP4, TQ1_0, TQ2_0): the structs below, with
 * each field's byte offset; their value order and formula are described once, in
 * kernels/ggml_lowbit.py's docstring (which the unpacking in ggml_matmul_lowbit.h follows), and
 * their grids and sign tables are in ggml_grids.h.
 */
#ifndef SPECPIPE_GGML_BLOCKS_H
#define SPECPIPE_GGML_BLOCKS_H
#include <stddef.h>
#include <stdint.h>

typedef struct { uint16_t d; uint8_t qs[16]; } sp_block_q4_0;                               /* 18 */
typedef struct { uint16_t d, m; uint8_t qs[16]; } sp_block_q4_1;                            /* 20 */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } sp_block_q5_0;                /* 22 */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } sp_block_q5_1;             /* 24 */
typedef struct { uint16_t d; int8_t qs[32]; } sp_block_q8_0;                                /* 34 */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } sp_block_q4_k;    /* 144 */
typedef struct {
  uint16_t d, dmin;
  uint8_t scales[12], qh[32], qs[128];
} sp_block_q5_k;                                                                            /* 176 */
typedef struct { uint8_t ql[128], qh[64]; int8_t scales[16]; uint16_t d; } sp_block_q6_k;   /* 210 */

/* low-bit types; [offset] of each field */
typedef struct { uint8_t scales[16], qs[64]; uint16_t d, dmin; } sp_block_q2_k;          /* [0] [16] [80] [82]: 84 */
typedef struct { uint8_t hmask[32], qs[64], scales[12]; uint16_t d; } sp_block_q3_k;     /* [0] [32] [96] [108]: 110 */
typedef struct { uint16_t d; uint8_t qs[64]; } sp_block_iq2_xxs;                         /* [0] [2]: 66 */
typedef struct { uint16_t d; uint8_t qs[64], scales[8]; } sp_block_iq2_xs;               /* [0] [2] [66]: 74 */
typedef struct {
  uint16_t d;
  uint8_t qs[32], signs[32], qh[8], scales[8];
} sp_block_iq2_s;                                                                        /* [0] [2] [34] [66] [74]: 82 */
typedef struct { uint16_t d; uint8_t qs[64], scales_signs[32]; } sp_block_iq3_xxs;       /* [0] [2] [66]: 98 */
typedef struct {
  uint16_t d;
  uint8_t qs[64], qh[8], signs[32], scales[4];
} sp_block_iq3_s;                                                                        /* [0] [2] [66] [74] [106]: 110 */
typedef struct { uint16_t d; uint8_t qs[32], qh[16]; } sp_block_iq1_s;                   /* [0] [2] [34]: 50 */
typedef struct { uint8_t qs[32], qh[16], scales[8]; } sp_block_iq1_m;                    /* [0] [32] [48]: 56 */
typedef struct { uint16_t d; uint8_t qs[16]; } sp_block_iq4_nl;                          /* [0] [2]: 18 */
typedef struct { uint16_t d, scales_h; uint8_t scales_l[4], qs[128]; } sp_block_iq4_xs;  /* [0] [2] [4] [8]: 136 */
typedef struct { uint8_t e, qs[16]; } sp_block_mxfp4;                                    /* [0] [1]: 17 */
typedef struct { uint8_t qs[48], qh[4]; uint16_t d; } sp_block_tq1_0;                    /* [0] [48] [52]: 54 */
typedef struct { uint8_t qs[64]; uint16_t d; } sp_block_tq2_0;                           /* [0] [64]: 66 */

_Static_assert(sizeof(sp_block_q2_k) == 84 && sizeof(sp_block_q3_k) == 110 && sizeof(sp_block_iq2_xxs) == 66 &&
               sizeof(sp_block_iq2_xs) == 74 && sizeof(sp_block_iq2_s) == 82 && sizeof(sp_block_iq3_xxs) == 98 &&
               sizeof(sp_block_iq3_s) == 110 && sizeof(sp_block_iq1_s) == 50 && sizeof(sp_block_iq1_m) == 56 &&
               sizeof(sp_block_iq4_nl) == 18 && sizeof(sp_block_iq4_xs) == 136 && sizeof(sp_block_mxfp4) == 17 &&
               sizeof(sp_block_tq1_0) == 54 && sizeof(sp_block_tq2_0) == 66,
               "a low-bit block struct is padded: its size is not GGUF's");

_Static_assert(sizeof(sp_block_q4_0) == 18 && sizeof(sp_block_q4_1) == 20 &&
               sizeof(sp_block_q5_0) == 22 && sizeof(sp_block_q5_1) == 24 &&
               sizeof(sp_block_q8_0) == 34 && sizeof(sp_block_q4_k) == 144 &&
               sizeof(sp_block_q5_k) == 176 && sizeof(sp_block_q6_k) == 210,
               "a block struct is padded: its size is not GGUF's");

/* The field of a block at p (a byte pointer), by name. */
#define SP_FIELD(p, block, field) ((const uint8_t *)(p) + offsetof(block, field))

#endif
