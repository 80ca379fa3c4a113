/* The row-lanes kernels of ggml_matmul.c, included once per x86 ISA (as ggml_matmul_tile.h) with
 * SP_ISA, SP_ATTR and these defined:
 *   SP_LV               the lanes' vector: 8 activation rows, SP_LB values of each (build_lanes
 *                       lays them out so: AVX2 256 bits of [8 rows][4 values], AVX-512 512 bits of
 *                       [8 rows][8 values], a row's 8 values in its two adjacent int32 lanes)
 *   SP_LLD(p), SP_LZERO, SP_LADD(a, b), SP_LSCALE(a, s)  load, zero, add, times the int32 s
 *   SP_LDP(acc, w, x)   acc + in each int32 lane, that lane's 4 unsigned weight bytes (SP_LB bytes
 *                       at w, broadcast) times its 4 int8 activations
 *   SP_LDPS(acc, w, x)  the same for signed weight bytes (Q8_0)
 *   SP_LSUM(v)          the 8 rows' sums (__m256i): v itself, or each row's two lanes added
 *   SP_Q8_SHIFT         what SP_LDPS leaves to subtract: (block sum << SP_Q8_SHIFT); 0: nothing
 *   SP_DP2W(acc, p, w)  acc + in each lane, the two int16 of p times the two int16 of w
 * All exact integers, so every ISA's lanes give the tile path's integers and bits. The header
 * undefines all of these (and SP_K) at its end. */
#define SP_CAT2(a, b) a##b
#define SP_CAT(a, b) SP_CAT2(a, b)
#define SP_K(name) SP_CAT(name, SP_CAT(_, SP_ISA))

/* sumi[r] = sum over the sub-blocks of sc[r][j] * (row r's values . the 8 lanes' values), for
 * the SP_NR unpacked rows of wt and one chunk of lanes; sub = 32 (Q4_K, Q5_K) or 16 (Q6_K), a
 * constant where inlined. */
SP_INLINE SP_ATTR void SP_K(lanes_dot)(const wtile *wt, const int8_t *xq, const int sub, __m256i *sumi) {
  SP_LV acc[SP_NR];
  for (int r = 0; r < SP_NR; r++) acc[r] = SP_LZERO;
  for (int j = 0; j < 256 / sub; j++) {
    SP_LV xv[8];
#pragma GCC unroll 8
    for (int i = 0; i < sub / SP_LB; i++) xv[i] = SP_LLD(xq + 8 * SP_LB * (sub / SP_LB * j + i));
    /* a weight row's values (unsigned) broadcast to the lanes times each lane's activations,
     * unrolled over the rows so that their dependency chains interleave (integers: exact in any
     * order) */
#pragma GCC unroll 8
    for (int r = 0; r < SP_NR; r++) {
      const uint8_t *wq = wt->q[r] + sub * j;
      SP_LV s = SP_LZERO;
#pragma GCC unroll 8
      for (int i = 0; i < sub / SP_LB; i++) s = SP_LDP(s, wq + SP_LB * i, xv[i]);
      acc[r] = SP_LADD(acc[r], SP_LSCALE(s, wt->sc32[r][j]));
    }
  }
  for (int r = 0; r < SP_NR; r++) sumi[r] = SP_LSUM(acc[r]);
}

/* The offsets, as fold_k4 / fold_q6_k need them, for the 8 lanes: sum_j mn_j * xsum32_j (Q4_K,
 * Q5_K) or sc_j * xsum16_j (Q6_K), two blocks per vpdpwssd. */
SP_INLINE SP_ATTR __m256i SP_K(lanes_offsets)(const wtile *wt, int r, const int32_t *pr, const int q6) {
  __m256i off = _mm256_setzero_si256();
  for (int j = 0; j < (q6 ? 8 : 4); j++)
    off = SP_DP2W(off, LD(pr + 8 * j), wt->pairs[r][j]);
  return off;
}

/* What lanes_dot and lanes_offsets need of unpacked row r, once per group (not per lane chunk):
 * the scales as int32, and the offsets' weights as int16 pairs (mins, or Q6_K's scales). */
SP_INLINE SP_ATTR void SP_K(lanes_prep)(wtile *wt, int r, const int q6) {
  const int nsub = q6 ? 16 : 8;
  for (int j = 0; j < nsub; j++) wt->sc32[r][j] = wt->sc[r][j];
  for (int j = 0; j < nsub / 2; j++) {
    const int32_t a = q6 ? wt->sc[r][2 * j] : wt->mn[r][2 * j];
    const int32_t b = q6 ? wt->sc[r][2 * j + 1] : wt->mn[r][2 * j + 1];
    wt->pairs[r][j] = (int32_t)(((uint32_t)(uint16_t)a) | ((uint32_t)(uint16_t)b << 16));
  }
}

/* One group of the K-quants for one chunk of lanes: acc[r] += the group's term of weight row r,
 * fold_k4's / fold_q6_k's expression per element. */
SP_INLINE SP_ATTR void SP_K(lanes_group_k)(const wtile *wt, const xlanes *xl, int64_t at, int nr, const int q6,
                                           __m256 *acc) {
  const __m256 dx = _mm256_loadu_ps(xl->d + at * 8);
  __m256i sumi[SP_NR];
  SP_K(lanes_dot)(wt, xl->q + at * 2048, q6 ? 16 : 32, sumi);
  for (int r = 0; r < nr; r++) {
    const __m256i off = SP_K(lanes_offsets)(wt, r, xl->pairs + at * 64, q6);
    const __m256 d0 = _mm256_mul_ps(_mm256_set1_ps(wt->d[0][r]), dx);
    __m256 term;
    if (q6) /* fold_q6_k */
      term = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi[r], _mm256_slli_epi32(off, 5))));
    else /* fold_k4 */
      term = _mm256_sub_ps(_mm256_mul_ps(d0, _mm256_cvtepi32_ps(sumi[r])),
                           _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(wt->d[1][r]), dx), _mm256_cvtepi32_ps(off)));
    acc[r] = _mm256_add_ps(acc[r], term);
  }
}

/* One group of a 32-value type for one chunk of lanes: per 32-block j of weight row r, the 8
 * lanes' dots (SP_LDP), folded per block as fold_group32 does (blocks in ascending order, the same
 * expression per element). Q8_0's signed weights go through SP_LDPS; Q4_0's offset 8 and Q5_0's
 * 16 (and on VNNI Q8_0's 128, see SP_LDPS) come off as that multiple of the lane's block sum (all
 * exact integers).  With 512-bit lanes two weight rows are folded in one vector: acc holds the
 * pairs (r, r + 1) interleaved, lane 2l row r's and 2l + 1 row r + 1's term for activation row l
 * (tiles_lanes stores them back in order); the activations' per-block values are stored twice. */
/* The lanes' dots of one 32-block of a weight row (its 32 values at wq) with xv. */
SP_INLINE SP_ATTR SP_LV SP_K(lanes_dot32)(const uint8_t *wq, const SP_LV *xv, const int type) {
  SP_LV s = SP_LZERO;
#pragma GCC unroll 8
  for (int i = 0; i < 32 / SP_LB; i++)
    s = type == SP_Q8_0 ? SP_LDPS(s, wq + SP_LB * i, xv[i]) : SP_LDP(s, wq + SP_LB * i, xv[i]);
  return s;
}

SP_INLINE SP_ATTR void SP_K(lanes_group32)(const wtile *wt, const xlanes *xl, int64_t at, const int type,
                                           __m256 *acc) {
  const int shift = type == SP_Q4_0 ? 3 : type == SP_Q5_0 ? 4 : type == SP_Q8_0 ? SP_Q8_SHIFT : 0;
  const int has_m = type == SP_Q4_1 || type == SP_Q5_1;
  const int8_t *xq = xl->q + at * 2048;
  for (int j = 0; j < wt->nb; j++) {
    SP_LV xv[8];
#pragma GCC unroll 8
    for (int i = 0; i < 32 / SP_LB; i++) xv[i] = SP_LLD(xq + 8 * SP_LB * (32 / SP_LB * j + i));
    const int64_t bj = at * 128 + 2 * SP_LB * j;
#if SP_LB == 8
    const __m512 dx = _mm512_loadu_ps(xl->bd + bj);
    const __m512i off = shift ? _mm512_sll_epi32(LDZ(xl->bsum + bj), _mm_cvtsi32_si128(shift)) : _mm512_setzero_si512();
    const __m512 dsum = has_m ? _mm512_loadu_ps(xl->bdsum + bj) : _mm512_setzero_ps();
    __m512 *acc2 = (__m512 *)acc;
#pragma GCC unroll 4
    for (int r = 0; r < SP_NR; r += 2) {
      const SP_LV s[2] = {SP_K(lanes_dot32)(wt->q[r] + 32 * j, xv, type),
                          SP_K(lanes_dot32)(wt->q[r + 1] + 32 * j, xv, type)};
      /* row r's lane sums in the even int32 lanes, row r + 1's in the odd ones */
      const __m512i dot = _mm512_sub_epi32(
          _mm512_mask_blend_epi32(0xaaaa, _mm512_add_epi32(s[0], _mm512_srli_epi64(s[0], 32)),
                                  _mm512_add_epi32(s[1], _mm512_slli_epi64(s[1], 32))), off);
      double dpair, mpair; /* (d of row r, d of row r + 1), adjacent in wt->d[j] */
      memcpy(&dpair, &wt->d[j][r], 8);
      const __m512 dd = _mm512_mul_ps(_mm512_castpd_ps(_mm512_set1_pd(dpair)), dx);
      __m512 term = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(dot));
      if (has_m) {
        memcpy(&mpair, &wt->m[j][r], 8);
        term = _mm512_add_ps(term, _mm512_mul_ps(_mm512_castpd_ps(_mm512_set1_pd(mpair)), dsum));
      }
      acc2[r / 2] = _mm512_add_ps(acc2[r / 2], term);
    }
#else
    const __m256 dx = _mm256_loadu_ps(xl->bd + bj);
    const __m256i off = shift ? _mm256_sll_epi32(LD(xl->bsum + bj), _mm_cvtsi32_si128(shift))
                              : _mm256_setzero_si256(); /* Q4_1/Q5_1: no offset */
    const __m256 dsum = has_m ? _mm256_loadu_ps(xl->bdsum + bj) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < SP_NR; r++) {
      const __m256i dot = _mm256_sub_epi32(SP_K(lanes_dot32)(wt->q[r] + 32 * j, xv, type), off);
      const __m256 dd = _mm256_mul_ps(_mm256_set1_ps(wt->d[j][r]), dx);
      __m256 term = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(dot));
      if (has_m) term = _mm256_add_ps(term, _mm256_mul_ps(_mm256_set1_ps(wt->m[j][r]), dsum));
      acc[r] = _mm256_add_ps(acc[r], term);
    }
#endif
  }
}

/* Weight rows [n0, n1) against every activation row, for one compile-time type. */
SP_INLINE SP_ATTR void SP_K(tiles_lanes)(const job *jb, const xlanes *xl, int64_t n0, int64_t n1,
                                         const int type) {
  const int is_k = is_kquant(type), q6 = type == SP_Q6_K;
  const int64_t ng = jb->xq.kp / 256, ch = xl->chunks;
  const int64_t gbytes = type == SP_Q4_K ? (int64_t)sizeof(sp_block_q4_k)
                        : type == SP_Q5_K ? (int64_t)sizeof(sp_block_q5_k) : (int64_t)sizeof(sp_block_q6_k); /* K-quants */
  const tile_prefetch pf = tile_prefetch_start(jb, n0, n1);
  wtile wt;
  __m256 acc[8][SP_NR]; /* [chunk][weight row]: 8 activation rows each */
  memset(&wt, 0, sizeof wt);
  for (int64_t n = n0; n < n1; n += SP_NR) {
    const int nr = (int)(n1 - n < SP_NR ? n1 - n : SP_NR);
    for (int64_t c0 = 0; c0 < ch; c0 += 8) { /* up to 64 activation rows per pass */
      const int cb = (int)(ch - c0 < 8 ? ch - c0 : 8);
      for (int c = 0; c < cb; c++)
        for (int r = 0; r < SP_NR; r++) acc[c][r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < ng; g++) {
        for (int r = 0; r < nr; r++) {
          const uint8_t *row = jb->w + (n + r) * jb->row_bytes;
          if (c0 == 0) tile_prefetch_step(&pf, jb, n, g * SP_NR + r);
          if (!is_k) {
            SP_K(unpack_group32)(type, row, g, jb->nblk32, &wt, r);
            continue;
          }
          if (type == SP_Q4_K) unpack_q4_k(row + g * gbytes, &wt, r);
          else if (type == SP_Q5_K) unpack_q5_k(row + g * gbytes, &wt, r);
          else unpack_q6_k(row + g * gbytes, &wt, r);
          SP_K(lanes_prep)(&wt, r, q6);
        }
        for (int c = 0; c < cb; c++) {
          if (is_k) SP_K(lanes_group_k)(&wt, xl, g * ch + c0 + c, nr, q6, acc[c]);
          else SP_K(lanes_group32)(&wt, xl, g * ch + c0 + c, type, acc[c]);
        }
      }
      /* lanes_group32 on 512-bit lanes leaves the weight rows' pairs interleaved */
      const int pairs = SP_LB == 8 && !is_k;
      for (int c = 0; c < cb; c++)
        for (int r = 0; r < nr; r++) {
          float v[16];
          if (pairs) memcpy(v, &acc[c][r & ~1], sizeof v);
          else _mm256_storeu_ps(v, acc[c][r]);
          for (int l = 0; l < 8 && 8 * (c0 + c) + l < jb->t; l++)
            jb->y[(8 * (c0 + c) + l) * jb->n + n + r] = pairs ? v[2 * l + (r & 1)] : v[l];
        }
    }
  }
}

static SP_ATTR void SP_K(tiles_lanes_any)(const job *jb, const void *ctx, int64_t n0, int64_t n1) {
  const xlanes *xl = ctx;
  switch (jb->type) {
  case SP_Q4_K: SP_K(tiles_lanes)(jb, xl, n0, n1, SP_Q4_K); break;
  case SP_Q5_K: SP_K(tiles_lanes)(jb, xl, n0, n1, SP_Q5_K); break;
  case SP_Q6_K: SP_K(tiles_lanes)(jb, xl, n0, n1, SP_Q6_K); break;
  case SP_Q4_0: SP_K(tiles_lanes)(jb, xl, n0, n1, SP_Q4_0); break;
  case SP_Q4_1: SP_K(tiles_lanes)(jb, xl, n0, n1, SP_Q4_1); break;
  case SP_Q5_0: SP_K(tiles_lanes)(jb, xl, n0, n1, SP_Q5_0); break;
  case SP_Q5_1: SP_K(tiles_lanes)(jb, xl, n0, n1, SP_Q5_1); break;
  default: SP_K(tiles_lanes)(jb, xl, n0, n1, SP_Q8_0); break;
  }
}
#undef SP_K
#undef SP_ISA
#undef SP_ATTR
#undef SP_LV
#undef SP_LB
#undef SP_LLD
#undef SP_LZERO
#undef SP_LADD
#undef SP_LSCALE
#undef SP_LDP
#undef SP_LDPS
#undef SP_LSUM
#undef SP_Q8_SHIFT
#undef SP_DP2W
