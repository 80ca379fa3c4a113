/* Cross-ISA check of the native GGUF matmul, in C so that it also runs under an emulator (the
 * NEON path, via qemu-aarch64; see tests/kernels/test_native.py): every path this CPU supports
 * gives the portable path's bits, for 1 and 3 threads and for rows computed alone; the portable
 * result's FNV-1a hash per type is printed so that two architectures can be compared.
 * Build: cc -O2 -I specpipe/kernels/native native_isacheck.c libspecpipe_native.so */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include "ggml_matmul.h"
static uint32_t s = 12345;
static uint32_t rnd(void) { s = s * 1664525u + 1013904223u; return s >> 8; }
int main(void) {
  /* the older types, then the low-bit ones (Q2_K .. MXFP4); dof: the f16 scale fields' offsets */
  const int types[] = {2, 3, 6, 7, 8, 12, 13, 14, 10, 11, 16, 17, 22, 18, 21, 19, 29, 20, 23, 39, 34, 35};
  const int bsz[] = {32, 32, 32, 32, 32, 256, 256, 256, 256, 256, 256, 256, 256, 256, 256, 256, 256, 32, 256, 32, 256, 256};
  const int bb[] = {18, 20, 22, 24, 34, 144, 176, 210, 84, 110, 66, 74, 82, 98, 110, 50, 56, 18, 136, 17, 54, 66};
  const int dof[][2] = {{0, -1}, {0, 2}, {0, -1}, {0, 2}, {0, -1}, {0, 2}, {0, 2}, {208, -1}, {80, 82}, {108, -1},
                        {0, -1}, {0, -1}, {0, -1}, {0, -1}, {0, -1}, {0, -1}, {-1, -1}, {0, -1}, {0, -1}, {-1, -1},
                        {52, -1}, {64, -1}};
  const int ntypes = (int)(sizeof types / sizeof types[0]);
  int fails = 0, checks = 0;
  for (int ti = 0; ti < ntypes; ti++) {
    const long T = 19, N = 13, K = 768, rb = K / bsz[ti] * bb[ti];
    uint8_t *w = malloc(N * rb);
    float *x = malloc(T * K * 4), *y0 = malloc(T * N * 4), *y1 = malloc(T * N * 4);
    for (long i = 0; i < N * rb; i++) w[i] = rnd();
    for (long n = 0; n < N; n++)
      for (long b = 0; b < K / bsz[ti]; b++) {
        uint8_t *p = w + n * rb + b * bb[ti];
        for (int f = 0; f < 2; f++)
          if (dof[ti][f] >= 0) p[dof[ti][f] + 1] = 0x18 | (rnd() & 0x83); /* f16 exponent small, random sign */
        if (types[ti] == 29) p[55] = (p[55] & 0x3f) | 0x20; /* IQ1_M: d's top bits in the scales */
        if (types[ti] == 39) p[0] = 115 + rnd() % 10;       /* MXFP4: E8M0 exponent near 2^-8 */
      }
    for (long i = 0; i < T * K; i++) x[i] = ((int)(rnd() % 2001) - 1000) / 300.0f;
    sp_matmul(types[ti], x, T, K, w, N, rb, y0, 1, 0);
    { uint64_t h = 1469598103934665603ull; const uint8_t *b = (const uint8_t *)y0;
      for (long i = 0; i < T * N * 4; i++) h = (h ^ b[i]) * 1099511628211ull;
      printf("type %d portable fnv %016llx\n", types[ti], (unsigned long long)h); }
    for (int isa = 1; isa < 5; isa++) {
      if (!sp_isa_supported(isa)) continue;
      for (int th = 1; th <= 3; th += 2) {
        sp_matmul(types[ti], x, T, K, w, N, rb, y1, th, isa);
        checks++;
        if (memcmp(y0, y1, T * N * 4)) { fails++; printf("type %d isa %d threads %d: DIFFERENT\n", types[ti], isa, th); }
      }
      for (long t = 0; t < T; t += 6) { /* one row alone */
        sp_matmul(types[ti], x + t * K, 1, K, w, N, rb, y1, 1, isa);
        checks++;
        if (memcmp(y0 + t * N, y1, N * 4)) { fails++; printf("type %d isa %d row %ld alone: DIFFERENT\n", types[ti], isa, t); }
      }
    }
    free(w); free(x); free(y0); free(y1);
  }
  printf("best isa %d; %d checks, %d failures\n", sp_best_isa(), checks, fails);
  return fails != 0;
}
