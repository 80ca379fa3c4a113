/* The weight lanes on AMX (Intel AMX-INT8), for Q4_K and Q6_K from SP_AMX_FROM activation rows:
 * the group unpacked as in ggml_matmul_wlanes.h, whose vectors of 16 weight rows x 4 values are,
 * as they lie in memory, the B operand of a tile multiply (16 dword rows = 64 values of 16 weight
 * rows); the activations' int8 values, 64 at a time for up to 16 rows, are its A operand, read in
 * place (rows 256 bytes apart in xq's layout).  One tile multiply does what the vector path does
 * with 16 vpdpbusd and as many broadcasts per activation row.  The sub-block scales, which the
 * vector path multiplies into each sub-block's dot, are multiplied into the weights first (see
 * amx_group), so that two tile sums over the whole group give sum_j sc_j * dot_j: no tile store
 * per sub-block (which made an earlier Q6_K attempt slower than the vector path at every row
 * count).  The sums are exact int32 whichever unit adds them, folded by the vector path's own
 * code (wl_fold), so the bits are the portable path's.
 * Included once by ggml_matmul.c, after ggml_matmul_wlanes.h. */

#define SP_AMX __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,amx-tile,amx-int8")))

/* The tile configuration (palette 1): every tile 16 rows x 64 bytes.  tmm0-1 the sums (16
 * activation rows x 16 weight rows, int32), tmm2-3 activations (16 rows x 64 values), tmm4-7
 * weights (16 dword rows: 64 values of the 16 weight rows). */
typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_config;

/* The group's weights times their sub-block's scale, as two byte planes whose sums S0 (unsigned
 * bytes) and S1 give sum_j sc_j * dot_j = S0 + S1 << shift.
 *   Q4_K (q <= 15, sc 6 bits): sc = 8 * hi + lo, 3 bits each: the planes q * lo and q * hi
 *     (<= 105, no carry between bytes, so one 16-bit multiply per byte pair), shift 3.
 *   Q6_K (q <= 63, sc signed 8 bits): the product p = q * sc (|p| <= 8064, exact in int16: two
 *     vpmaddubsw per vector, one for the even bytes, one for the odd) split into its low byte
 *     (unsigned) and p >> 8 (signed, -32 .. 31) by one byte permute each, shift 8.
 * |S0 + S1 << shift| <= 256 * 63 * 128 * 127 < 2^31: exact. */
SP_INLINE SP_AMX void amx_scaled(const wgroup *w, const int q6, __m512i wq[2][64]) {
  if (!q6) {
    for (int j = 0; j < 8; j++) {
      const __m512i lo = _mm512_and_si512(w->sc[j], _mm512_set1_epi32(7)), hi = _mm512_srli_epi32(w->sc[j], 3);
      const __m512i lo2 = _mm512_or_si512(lo, _mm512_slli_epi32(lo, 16)), hi2 = _mm512_or_si512(hi, _mm512_slli_epi32(hi, 16));
      for (int i = 8 * j; i < 8 * j + 8; i++) {
        wq[0][i] = _mm512_mullo_epi16(w->q[i], lo2);
        wq[1][i] = _mm512_mullo_epi16(w->q[i], hi2);
      }
    }
    return;
  }
  /* pick[plane] byte 4D + m: byte 4D + (m & 2) + plane of pe (m even) or po (m odd) */
  const __m512i pick0 = _mm512_set1_epi32(0x42024000), pick1 = _mm512_set1_epi32(0x43034101);
  const __m512i dwb = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(0x04040404)); /* 4D in dword D's bytes */
  const __m512i idx0 = _mm512_add_epi8(pick0, dwb), idx1 = _mm512_add_epi8(pick1, dwb);
  for (int j = 0; j < 16; j++) {
    const __m512i b = _mm512_and_si512(w->sc[j], _mm512_set1_epi32(0xff));
    const __m512i sce = _mm512_or_si512(b, _mm512_slli_epi32(b, 16)), sco = _mm512_slli_epi32(sce, 8);
    for (int i = 4 * j; i < 4 * j + 4; i++) { /* q (unsigned) times sc (signed), int16 exact */
      const __m512i pe = _mm512_maddubs_epi16(w->q[i], sce); /* bytes 0, 2 */
      const __m512i po = _mm512_maddubs_epi16(w->q[i], sco); /* bytes 1, 3 */
      wq[0][i] = _mm512_permutex2var_epi8(pe, idx0, po);
      wq[1][i] = _mm512_permutex2var_epi8(pe, idx1, po);
    }
  }
}

/* acc[l] += group g's term for activation rows t0 + l (l < nx) and the group's 16 weight rows:
 * the two planes of amx_scaled by tile multiplies, the activation tiles signed (and Q6_K's high
 * plane).  The activation tiles always read 16 rows: past the call's last row they read the
 * padding sp_matmul leaves after xq.q, and those rows' sums are never used.  Not inlined: the
 * tile loop it is called from is shared with the vector path, compiled without AMX. */
static SP_AMX __attribute__((noinline)) void amx_group(const job *jb, const int32_t *xpairs, const wgroup *w,
                                                       int64_t g, int64_t t0, int64_t nx, const int q6,
                                                       __m512 *acc) {
  __m512i wq[2][64]; /* [plane][dword k] */
  amx_scaled(w, q6, wq);
  const int shift = q6 ? 8 : 3;
  int32_t sums[2][SP_AMX_ROWS][16] __attribute__((aligned(64)));
  for (int64_t r0 = 0; r0 < nx; r0 += SP_AMX_ROWS) {
    const int8_t *x = jb->xq.q + 256 * (g * jb->t + t0 + r0);
    _tile_zero(0);
    _tile_zero(1);
    for (int s = 0; s < 4; s += 2) { /* 64 values a step, two steps in flight */
      _tile_loadd(2, x + 64 * s, 256);
      _tile_loadd(3, x + 64 * (s + 1), 256);
      _tile_loadd(4, &wq[0][16 * s], 64);
      _tile_loadd(5, &wq[1][16 * s], 64);
      _tile_loadd(6, &wq[0][16 * (s + 1)], 64);
      _tile_loadd(7, &wq[1][16 * (s + 1)], 64);
      _tile_dpbsud(0, 2, 4);
      _tile_dpbsud(0, 3, 6);
      if (q6) {
        _tile_dpbssd(1, 2, 5);
        _tile_dpbssd(1, 3, 7);
      } else {
        _tile_dpbsud(1, 2, 5);
        _tile_dpbsud(1, 3, 7);
      }
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    const int n = (int)(nx - r0 < SP_AMX_ROWS ? nx - r0 : SP_AMX_ROWS);
    __m512i sumi[SP_AMX_ROWS];
    const int32_t *xp[SP_AMX_ROWS];
    float xd[SP_AMX_ROWS];
    for (int l = 0; l < n; l++) {
      sumi[l] = _mm512_add_epi32(_mm512_load_si512(sums[0][l]), _mm512_slli_epi32(_mm512_load_si512(sums[1][l]), shift));
      const int64_t at = g * jb->t + t0 + r0 + l;
      xp[l] = xpairs + (q6 ? 8 : 4) * at;
      xd[l] = jb->xq.d[8 * at];
    }
    wl_fold(w, sumi, xp, xd, n, q6, acc + r0);
  }
}

static SP_AMX void wlanes_amx(const job *jb, const void *xpairs, int64_t n0, int64_t n1) {
  amx_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int i = 0; i < 8; i++) { /* sums and activations: as many rows as the call has, up to 16 */
    cfg.rows[i] = (uint8_t)(i < 4 && jb->t < SP_AMX_ROWS ? jb->t : 16);
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg); /* per thread: each OpenMP thread calls this for its own rows */
  if (jb->type == SP_Q6_K) wl_tiles(jb, xpairs, n0, n1, 1, 1);
  else wl_tiles(jb, xpairs, n0, n1, 0, 1);
  _tile_release();
}

/* Whether this CPU has AMX-INT8 and Linux lets this process use the tile state (asked for once:
 * arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), Linux 5.16 and later). */
static int amx_usable(void) {
  static int state = -1; /* (a race would only repeat the same answer) */
  if (state < 0) {
    unsigned a, b, c, d;
    int ok = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi") && __get_cpuid_count(7, 0, &a, &b, &c, &d) &&
             (d >> 24 & 1) && (d >> 25 & 1); /* AMX-TILE, AMX-INT8 */
#ifdef __linux__
    ok = ok && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    ok = 0;
#endif
    state = ok;
  }
  return state;
}
