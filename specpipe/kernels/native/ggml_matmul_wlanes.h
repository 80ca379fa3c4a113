/* The weight lanes of ggml_matmul.c (AVX-512 VNNI; Q4_K and Q6_K): the 16 int32 lanes of a
 * 512-bit vector are 16 weight rows, each lane holding 4 consecutive values of its row, so one
 * activation row's 4 values are broadcast from memory as part of vpdpbusd ({1to16}) and every
 * lane adds its own row's dot: no horizontal sums, no broadcast of weights, and the unpacking of
 * a group (16 rows' 256 values) is two 16 x 16 dword transposes of the packed bytes plus a few
 * vector operations for all 16 rows' scales at once, shared by every activation row of the call.
 * Per element the integers are the tile path's (exact) and the folding is fold_k4's / fold_q6_k's
 * expression, so the bits are the portable path's whatever the row count (tests/kernels).
 * Included once by ggml_matmul.c, inside its SP_X86 section. */

#define SP_WR 16 /* weight rows per tile: one int32 lane each */

/* One group of a tile's 16 weight rows, unpacked. */
typedef struct {
  __m512i q[64];    /* [dword k of the group] lane r: row r's values 4k .. 4k + 3 (unsigned) */
  __m512i sc[16];   /* sub-block scales as int32 (8 for Q4_K, 16 for Q6_K) */
  __m512i pairs[8]; /* the offsets' int16 pairs: Q4_K's mins (4 pairs), Q6_K's scales (8) */
  __m512 d, dmin;   /* Q4_K: d, dmin; Q6_K: d */
} wgroup;

/* out[i] lane r = dword i of the 64 bytes at p + idx[r] (i, r < 16). */
SP_INLINE SP_VNNI void wl_transpose16(const uint8_t *p, const int64_t *idx, __m512i *out) {
  __m512i a[16], b[16];
  for (int r = 0; r < 16; r++) a[r] = _mm512_loadu_si512((const void *)(p + idx[r]));
  /* b[2j] = (r0 d0, r1 d0, r0 d1, r1 d1) per 128-bit lane L, of dwords 4L .. 4L + 3 */
  for (int j = 0; j < 8; j++) {
    b[2 * j] = _mm512_unpacklo_epi32(a[2 * j], a[2 * j + 1]);
    b[2 * j + 1] = _mm512_unpackhi_epi32(a[2 * j], a[2 * j + 1]);
  }
  /* a[4j + m] lane L: rows 4j .. 4j + 3 of dword 4L + m */
  for (int j = 0; j < 4; j++) {
    a[4 * j] = _mm512_unpacklo_epi64(b[4 * j], b[4 * j + 2]);
    a[4 * j + 1] = _mm512_unpackhi_epi64(b[4 * j], b[4 * j + 2]);
    a[4 * j + 2] = _mm512_unpacklo_epi64(b[4 * j + 1], b[4 * j + 3]);
    a[4 * j + 3] = _mm512_unpackhi_epi64(b[4 * j + 1], b[4 * j + 3]);
  }
  /* the 128-bit lanes L of a[m], a[4 + m], a[8 + m], a[12 + m] -> out[4L + m] */
  for (int m = 0; m < 4; m++) {
    const __m512i v0 = _mm512_shuffle_i32x4(a[m], a[4 + m], 0x44), v1 = _mm512_shuffle_i32x4(a[m], a[4 + m], 0xee);
    const __m512i v2 = _mm512_shuffle_i32x4(a[8 + m], a[12 + m], 0x44),
                  v3 = _mm512_shuffle_i32x4(a[8 + m], a[12 + m], 0xee);
    out[m] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    out[4 + m] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    out[8 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    out[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

/* out[i] lane r = dword i of the 16 bytes at p + idx[r] (i < 4, r < 16): four rows to a vector
 * (row 4L + e in 128-bit lane L of z[e]), then a 4 x 4 transpose inside each 128-bit lane. */
SP_INLINE SP_VNNI void wl_transpose4(const uint8_t *p, const int64_t *idx, __m512i *out) {
  __m512i z[4];
  for (int e = 0; e < 4; e++) {
    z[e] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + idx[e])));
    for (int l = 1; l < 4; l++)
      z[e] = _mm512_inserti32x4(z[e], _mm_loadu_si128((const __m128i *)(p + idx[4 * l + e])), l);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2), out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3), out[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* byte b of each dword, as int32: unsigned, or (Q6_K's scales) signed */
SP_INLINE SP_VNNI __m512i wl_byte_u(__m512i v, int b) {
  return _mm512_and_si512(_mm512_srli_epi32(v, 8 * b), _mm512_set1_epi32(0xff));
}
SP_INLINE SP_VNNI __m512i wl_byte_s(__m512i v, int b) { return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * b), 24); }
/* bytes 2e and 2e + 1 of each dword as an int16 pair: unsigned, or signed */
SP_INLINE SP_VNNI __m512i wl_pair_u(__m512i v, int e) {
  const __m512i h = _mm512_srli_epi32(v, 16 * e);
  return _mm512_or_si512(_mm512_and_si512(h, _mm512_set1_epi32(0xff)),
                         _mm512_and_si512(_mm512_slli_epi32(h, 8), _mm512_set1_epi32(0xff0000)));
}
SP_INLINE SP_VNNI __m512i wl_pair_s(__m512i v, int e) {
  const __m512i h = _mm512_srli_epi32(v, 16 * e);
  return _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(h, 8), 8), _mm512_set1_epi32(0xffff)),
                         _mm512_slli_epi32(_mm512_srai_epi16(h, 8), 16));
}

/* Q4_K: group g of the 16 rows at p + idx[r] (p: the group's first byte in row 0's place).  Not
 * inlined (nor Q6_K's): inlined into the tile loop, the transposes spilled, and a 2- or 8-row call
 * took 1.2-1.3x as long. */
static SP_VNNI __attribute__((noinline)) void wl_unpack_q4_k(const uint8_t *p, const int64_t *idx, wgroup *w) {
  const __m512i lo6 = _mm512_set1_epi32(0x3f3f3f3f), lo4 = _mm512_set1_epi32(0x0f0f0f0f),
                lo2 = _mm512_set1_epi32(0x03030303);
  __m512i h[4]; /* d | dmin, then the 12 bytes of scales */
  wl_transpose4(p, idx, h);
  const __m512i hd = h[0], u0 = h[1], u1 = h[2], u2 = h[3];
  w->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hd));
  w->dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hd, 16)));
  /* k4_scale_words, on the 16 rows at once */
  const __m512i sca = _mm512_and_si512(u0, lo6), mna = _mm512_and_si512(u1, lo6);
  const __m512i scb = _mm512_or_si512(_mm512_and_si512(u2, lo4),
                                      _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), lo2), 4));
  const __m512i mnb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), lo4),
                                      _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), lo2), 4));
  for (int j = 0; j < 4; j++) {
    w->sc[j] = wl_byte_u(sca, j);
    w->sc[4 + j] = wl_byte_u(scb, j);
  }
  w->pairs[0] = wl_pair_u(mna, 0), w->pairs[1] = wl_pair_u(mna, 1);
  w->pairs[2] = wl_pair_u(mnb, 0), w->pairs[3] = wl_pair_u(mnb, 1);
  /* qs dword 8c + i holds values 64c + 4i .. (low nibbles, sub-block 2c) and 64c + 32 + 4i ..
   * (high nibbles, sub-block 2c + 1) */
  __m512i qs[32];
  wl_transpose16(p + 16, idx, qs);
  wl_transpose16(p + 80, idx, qs + 16);
  for (int c = 0; c < 4; c++)
    for (int i = 0; i < 8; i++) {
      w->q[16 * c + i] = _mm512_and_si512(qs[8 * c + i], lo4);
      w->q[16 * c + 8 + i] = _mm512_and_si512(_mm512_srli_epi32(qs[8 * c + i], 4), lo4);
    }
}

/* Q6_K: as wl_unpack_q4_k. */
static SP_VNNI __attribute__((noinline)) void wl_unpack_q6_k(const uint8_t *p, const int64_t *idx, wgroup *w) {
  const __m512i lo4 = _mm512_set1_epi32(0x0f0f0f0f), hi2 = _mm512_set1_epi32(0x30303030);
  __m512i s[4], e[4]; /* the 16 scales; the block's last 16 bytes, d in the top half of e[3] */
  wl_transpose4(p + 192, idx, s);
  wl_transpose4(p + 194, idx, e);
  w->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(e[3], 16)));
  for (int j = 0; j < 16; j++) w->sc[j] = wl_byte_s(s[j / 4], j % 4);
  for (int j = 0; j < 8; j++) w->pairs[j] = wl_pair_s(s[j / 2], j % 2);
  __m512i ql[32], qh[16];
  wl_transpose16(p, idx, ql);
  wl_transpose16(p + 64, idx, ql + 16);
  wl_transpose16(p + 128, idx, qh);
  /* value 128h + 32k + 4i + m: low bits of ql dword 16h + 8(k & 1) + i (low nibbles for k < 2),
   * high bits (qh dword 8h + i) >> 2k & 3 */
  for (int h = 0; h < 2; h++)
    for (int i = 0; i < 8; i++) {
      const __m512i a = ql[16 * h + i], b = ql[16 * h + 8 + i], hb = qh[8 * h + i];
      __m512i *q = w->q + 32 * h + i;
      q[0] = _mm512_or_si512(_mm512_and_si512(a, lo4), _mm512_and_si512(_mm512_slli_epi32(hb, 4), hi2));
      q[8] = _mm512_or_si512(_mm512_and_si512(b, lo4), _mm512_and_si512(_mm512_slli_epi32(hb, 2), hi2));
      q[16] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a, 4), lo4), _mm512_and_si512(hb, hi2));
      q[24] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(b, 4), lo4),
                              _mm512_and_si512(_mm512_srli_epi32(hb, 2), hi2));
    }
}

/* acc[l] += the group's term for activation row l < nx and the 16 weight rows, given sumi[l] =
 * sum_j sc_j * (the dots over sub-block j): the offsets from xp[l] (the row's block sums as
 * int16 pairs), then fold_k4's / fold_q6_k's expression per element. */
SP_INLINE SP_VNNI void wl_fold(const wgroup *w, const __m512i *sumi, const int32_t *const *xp,
                               const float *xd, const int nx, const int q6, __m512 *acc) {
  for (int l = 0; l < nx; l++) {
    __m512i off = _mm512_setzero_si512();
    for (int p = 0; p < (q6 ? 8 : 4); p++) off = _mm512_dpwssd_epi32(off, w->pairs[p], _mm512_set1_epi32(xp[l][p]));
    const __m512 dx = _mm512_set1_ps(xd[l]), d0 = _mm512_mul_ps(w->d, dx);
    __m512 term;
    if (q6) /* fold_q6_k */
      term = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_sub_epi32(sumi[l], _mm512_slli_epi32(off, 5))));
    else /* fold_k4 */
      term = _mm512_sub_ps(_mm512_mul_ps(d0, _mm512_cvtepi32_ps(sumi[l])),
                           _mm512_mul_ps(_mm512_mul_ps(w->dmin, dx), _mm512_cvtepi32_ps(off)));
    acc[l] = _mm512_add_ps(acc[l], term);
  }
}

/* acc[l] += the group's term for activation row x[l] (l < nx, a constant where inlined) and the
 * 16 weight rows: the dots over each sub-block j by vpdpbusd, sumi = sum_j sc_j * dot_j, then
 * wl_fold. */
SP_INLINE SP_VNNI void wl_rows(const wgroup *w, const int8_t *const *x, const int32_t *const *xp,
                               const float *xd, const int nx, const int q6, __m512 *acc) {
  const int sub = q6 ? 16 : 32, nsub = 256 / sub;
  __m512i sumi[8];
  for (int l = 0; l < nx; l++) sumi[l] = _mm512_setzero_si512();
  for (int j = 0; j < nsub; j++) {
    __m512i s[8];
    for (int l = 0; l < nx; l++) s[l] = _mm512_setzero_si512();
    for (int i = 0; i < sub / 4; i++) {
      const __m512i q = w->q[sub / 4 * j + i];
      for (int l = 0; l < nx; l++) /* (a separate broadcast: as an embedded {1to16} operand
                                      vpdpbusd ran at half the rate on Zen 5) */
        s[l] = _mm512_dpbusd_epi32(s[l], q, _mm512_set1_epi32((int)load_u32((const uint8_t *)x[l] + sub * j + 4 * i)));
    }
    for (int l = 0; l < nx; l++) sumi[l] = _mm512_add_epi32(sumi[l], _mm512_mullo_epi32(s[l], w->sc[j]));
  }
  wl_fold(w, sumi, xp, xd, nx, q6, acc);
}

/* Activation rows [r0, r0 + nx) of group g (xq's layout; xpairs: [g][t][npairs]). */
SP_INLINE SP_VNNI void wl_chunk(const job *jb, const int32_t *xpairs, const wgroup *w, int64_t g, int64_t r0,
                                const int nx, const int q6, __m512 *acc) {
  const int np = q6 ? 8 : 4;
  const int8_t *x[8];
  const int32_t *xp[8];
  float xd[8];
  for (int l = 0; l < nx; l++) {
    const int64_t at = g * jb->t + r0 + l;
    x[l] = jb->xq.q + 256 * at;
    xp[l] = xpairs + np * at;
    xd[l] = jb->xq.d[8 * at];
  }
  wl_rows(w, x, xp, xd, nx, q6, acc);
}

#define SP_WL_TB 64 /* activation rows per pass over a tile (accumulators on the stack) */

/* Weight rows [n0, n1) against every activation row, one K-quant type, 16 rows a tile (32 with
 * each activation broadcast serving two weight vectors was as fast with the weights in cache
 * and 1.1-2.2x slower streaming them from memory: the tile and the next one, which is
 * prefetched, no longer fit in L1). */
#ifdef SP_HAVE_AMX
static void amx_group(const job *jb, const int32_t *xpairs, const wgroup *w, int64_t g, int64_t t0, int64_t nx,
                      int q6, __m512 *acc); /* ggml_matmul_amx.h */
#endif

SP_INLINE SP_VNNI void wl_tiles(const job *jb, const int32_t *xpairs, int64_t n0, int64_t n1, const int q6,
                                const int amx) {
  const int64_t ng = jb->xq.kp / 256, rb = jb->row_bytes, gbytes = q6 ? sizeof(sp_block_q6_k) : sizeof(sp_block_q4_k);
  const int64_t tile_bytes = SP_WR * rb, share = (tile_bytes + ng - 1) / ng;
  const uint8_t *end = jb->w + jb->n * rb;
  wgroup w;
  __m512 acc[SP_WL_TB];
  prefetch_lines(jb->w + n0 * rb, jb->w + n0 * rb + tile_bytes, jb->w + n1 * rb);
  for (int64_t n = n0; n < n1; n += SP_WR) {
    const int nr = (int)(n1 - n < SP_WR ? n1 - n : SP_WR);
    int64_t idx[SP_WR];
    for (int r = 0; r < SP_WR; r++) idx[r] = (r < nr ? r : nr - 1) * rb; /* a short tile repeats
                                                                         its last row (never stored) */
    const uint8_t *tile = jb->w + n * rb;
    for (int64_t t0 = 0; t0 < jb->t; t0 += SP_WL_TB) {
      const int64_t tb = jb->t - t0 < SP_WL_TB ? jb->t - t0 : SP_WL_TB;
      for (int64_t l = 0; l < tb; l++) acc[l] = _mm512_setzero_ps();
      for (int64_t g = 0; g < ng; g++) {
        if (t0 == 0) { /* this group's share of the next tile */
          const uint8_t *pf = tile + tile_bytes + g * share;
          prefetch_lines(pf, pf + share, end);
        }
        if (q6) wl_unpack_q6_k(tile + g * gbytes, idx, &w);
        else wl_unpack_q4_k(tile + g * gbytes, idx, &w);
#ifdef SP_HAVE_AMX
        if (amx) { /* the sums by tile multiplies */
          amx_group(jb, xpairs, &w, g, t0, tb, q6, acc);
          continue;
        }
#endif
        (void)amx;
        int64_t l = 0;
        for (; l + 8 <= tb; l += 8) wl_chunk(jb, xpairs, &w, g, t0 + l, 8, q6, acc + l);
        switch (tb - l) { /* the row count a constant in each */
        case 1: wl_chunk(jb, xpairs, &w, g, t0 + l, 1, q6, acc + l); break;
        case 2: wl_chunk(jb, xpairs, &w, g, t0 + l, 2, q6, acc + l); break;
        case 3: wl_chunk(jb, xpairs, &w, g, t0 + l, 3, q6, acc + l); break;
        case 4: wl_chunk(jb, xpairs, &w, g, t0 + l, 4, q6, acc + l); break;
        case 5: wl_chunk(jb, xpairs, &w, g, t0 + l, 5, q6, acc + l); break;
        case 6: wl_chunk(jb, xpairs, &w, g, t0 + l, 6, q6, acc + l); break;
        case 7: wl_chunk(jb, xpairs, &w, g, t0 + l, 7, q6, acc + l); break;
        default: break;
        }
      }
      const __mmask16 keep = (__mmask16)((1u << nr) - 1);
      for (int64_t l = 0; l < tb; l++) _mm512_mask_storeu_ps(jb->y + (t0 + l) * jb->n + n, keep, acc[l]);
    }
  }
}

static SP_VNNI void wlanes_vnni(const job *jb, const void *xpairs, int64_t n0, int64_t n1) {
  if (jb->type == SP_Q6_K) wl_tiles(jb, xpairs, n0, n1, 1, 0);
  else wl_tiles(jb, xpairs, n0, n1, 0, 0);
}

/* The activations' block sums as int16 pairs, [g][t][npairs] (|sum| <= 32 * 127: an int16):
 * Q4_K's 32-blocks (4 pairs), Q6_K's 16-blocks (8). */
static int32_t *wl_pairs(const xquant *xq, int q6) {
  const int64_t n = xq->kp / 256 * xq->t, np = q6 ? 8 : 4;
  int32_t *p = malloc((size_t)(n * np) * sizeof(int32_t));
  if (!p) return NULL;
  for (int64_t at = 0; at < n; at++) {
    const int32_t *bs = q6 ? xq->s16 + 16 * at : xq->s32 + 8 * at;
    for (int64_t j = 0; j < np; j++)
      p[np * at + j] = (int32_t)(((uint32_t)(uint16_t)bs[2 * j]) | ((uint32_t)(uint16_t)bs[2 * j + 1] << 16));
  }
  return p;
}
