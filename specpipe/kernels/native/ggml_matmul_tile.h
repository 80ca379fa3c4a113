/* The tile loops of ggml_matmul.c, included once per ISA with SP_ISA (a name suffix) and SP_ATTR
 * (its target attribute) defined, so that the unpacking loops are compiled (and auto-vectorised)
 * for that ISA too.  Integer work only changes with the ISA; the float folding is the shared
 * scalar code of fold_*(), applied per output element in ascending group order. */
#define SP_CAT2(a, b) a##b
#define SP_CAT(a, b) SP_CAT2(a, b)
#define SP_K(name) SP_CAT(name, SP_CAT(_, SP_ISA))

/* Weight rows [n0, n1) against all activation rows, for one compile-time type, or for the
 * low-bit types one compile-time kind (SP_KIND_*: the type itself is jb->type). */
SP_INLINE SP_ATTR void SP_K(tiles)(const job *jb, int64_t n0, int64_t n1, const int type) {
  const int biased = type == SP_KIND_LOWBIT, s8 = type == SP_Q8_0 || type == SP_KIND_LOWBIT_S8;
  const int is_k = type == SP_Q4_K || type == SP_Q5_K || type == SP_Q6_K || type == SP_Q2_K || biased;
  const int sub16 = type == SP_Q6_K || type == SP_Q2_K || biased; /* 16-value sub-blocks */
  const int64_t kp = jb->xq.kp, ngroups = kp / 256;
  /* bytes of one 256-value group of a row (256-value blocks: one block) */
  const int64_t gbytes = jb->row_bytes / ngroups;
  wtile wt;
  float acc[SP_TB][SP_NR];
  int32_t dots[8][SP_NR] __attribute__((aligned(32)));
  int32_t sumi[SP_NR] __attribute__((aligned(32))), offs[SP_NR] __attribute__((aligned(32)));
  memset(&wt, 0, sizeof wt); /* rows past a short tile's end stay zero (computed, never stored) */

  const tile_prefetch pf = tile_prefetch_start(jb, n0, n1);
  for (int64_t n = n0; n < n1; n += SP_NR) {
    const int nr = (int)(n1 - n < SP_NR ? n1 - n : SP_NR);
    for (int64_t t0 = 0; t0 < jb->t; t0 += SP_TB) {
      const int tb = (int)(jb->t - t0 < SP_TB ? jb->t - t0 : SP_TB);
      memset(acc, 0, sizeof acc[0] * tb);
      for (int64_t g = 0; g < ngroups; g++) {
        /* unpack group g of each weight row once, use it for every activation row */
        for (int r = 0; r < nr; r++) {
          const uint8_t *row = jb->w + (n + r) * jb->row_bytes;
          if (t0 == 0) tile_prefetch_step(&pf, jb, n, g * SP_NR + r);
          if (type == SP_Q4_K) unpack_q4_k(row + g * sizeof(sp_block_q4_k), &wt, r);
          else if (type == SP_Q5_K) unpack_q5_k(row + g * sizeof(sp_block_q5_k), &wt, r);
          else if (type == SP_Q6_K) unpack_q6_k(row + g * sizeof(sp_block_q6_k), &wt, r);
          else if (type == SP_Q2_K || biased) {
            SP_K(unpack_lowbit)(jb->type, row + g * gbytes, &wt, r);
          }
          else if (type == SP_KIND_LOWBIT_S8 && jb->type == SP_IQ4_XS) SP_K(unpack_iq4_xs)(row + g * gbytes, &wt, r);
          /* (the type a constant in each call: its unpacking specialised) */
          else if (type == SP_KIND_LOWBIT_S8 && jb->type == SP_MXFP4) SP_K(unpack_group32_lowbit)(SP_MXFP4, row, g, jb->nblk32, &wt, r);
          else if (type == SP_KIND_LOWBIT_S8) SP_K(unpack_group32_lowbit)(SP_IQ4_NL, row, g, jb->nblk32, &wt, r);
          else SP_K(unpack_group32)(type, row, g, jb->nblk32, &wt, r);
          if (is_k) SP_K(prep_scales)(&wt, r, sub16 ? 16 : 32);
        }
        for (int i = 0; i < tb; i++) {
          const int64_t t = t0 + i;
          const int64_t at = g * jb->t + t; /* group-major: see xquant */
          const xgroup xg = {jb->xq.q + 256 * at, jb->xq.d + 8 * at, jb->xq.dsum + 8 * at,
                             jb->xq.s32 + 8 * at, jb->xq.s16 + 16 * at};
          if (type == SP_Q6_K || biased) {
            SP_K(dot_sc)(&wt, xg.q, 16, sumi);
            SP_K(offsets)(&wt, &xg, 16, offs);
            fold_off(&wt, &xg, sumi, offs, biased ? SP_LB_BIAS : 32, acc[i]);
          } else if (type == SP_Q2_K) {
            SP_K(dot_sc)(&wt, xg.q, 16, sumi);
            SP_K(offsets_mn16)(&wt, xg.s16, offs);
            fold_k4(&wt, &xg, sumi, offs, acc[i]);
          } else if (is_k) {
            SP_K(dot_sc)(&wt, xg.q, 32, sumi);
            SP_K(offsets)(&wt, &xg, 32, offs);
            fold_k4(&wt, &xg, sumi, offs, acc[i]);
          } else {
            if (s8) SP_K(dots32_s8)(&wt, xg.q, wt.nb, dots);
            else SP_K(dots32_u8)(&wt, xg.q, wt.nb, dots);
            fold_group32(type, &wt, &xg, (const int32_t(*)[SP_NR])dots, acc[i]);
          }
        }
      }
      for (int i = 0; i < tb; i++)
        for (int r = 0; r < nr; r++) jb->y[(t0 + i) * jb->n + n + r] = acc[i][r];
    }
  }
}

#define SP_TILE_TYPE(lname, T)                                                                   \
  static SP_ATTR void SP_K(SP_CAT(tiles_, lname))(const job *jb, int64_t n0, int64_t n1) {       \
    SP_K(tiles)(jb, n0, n1, T);                                                                  \
  }
SP_TILE_TYPE(q4_0, SP_Q4_0)
SP_TILE_TYPE(q4_1, SP_Q4_1)
SP_TILE_TYPE(q5_0, SP_Q5_0)
SP_TILE_TYPE(q5_1, SP_Q5_1)
SP_TILE_TYPE(q8_0, SP_Q8_0)
SP_TILE_TYPE(q4_k, SP_Q4_K)
SP_TILE_TYPE(q5_k, SP_Q5_K)
SP_TILE_TYPE(q6_k, SP_Q6_K)
SP_TILE_TYPE(q2_k, SP_Q2_K)
SP_TILE_TYPE(lowbit, SP_KIND_LOWBIT)
SP_TILE_TYPE(lowbit_s8, SP_KIND_LOWBIT_S8)
#undef SP_TILE_TYPE
#undef SP_K
