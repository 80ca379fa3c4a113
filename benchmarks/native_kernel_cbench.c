/* C driver for the native GGUF matmul, for load-independent instruction counts under callgrind
 * (the shared machines' timings are noisy; valgrind has no AVX-512, so it runs the avx2 (1) and
 * portable (0) paths):
 *
 *   cc -O2 -I specpipe/kernels/native -o /tmp/native_cbench benchmarks/native_kernel_cbench.c \
 *      -L specpipe/kernels/native -lspecpipe_native -Wl,-rpath,$PWD/specpipe/kernels/native
 *   /tmp/native_cbench TYPE T N K [ISA [REPS [THREADS]]]          # prints min ms over REPS
 *   valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.out /tmp/native_cbench 12 8 1536 8960 1 1
 *   callgrind_annotate --inclusive=yes /tmp/cg.out | grep sp_matmul
 *
 * TYPE is the ggml type id (2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 10 Q2_K, 11 Q3_K, 12 Q4_K, 13 Q5_K,
 * 14 Q6_K, 16 IQ2_XXS, 17 IQ2_XS, 18 IQ3_XXS, 19 IQ1_S, 20 IQ4_NL, 21 IQ3_S, 22 IQ2_S, 23 IQ4_XS,
 * 29 IQ1_M, 34 TQ1_0, 35 TQ2_0, 39 MXFP4);
 * ISA 0 portable, 1 avx2, 2 avx512vnni, 3 neon (default: the best).  Weights are random bytes
 * with small finite f16 scales. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ggml_matmul.h"

static uint32_t seed = 1;
static uint32_t rnd(void) {
  seed = seed * 1664525u + 1013904223u;
  return seed >> 8;
}
static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

int main(int argc, char **argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s TYPE T N K [ISA [REPS [THREADS]]]\n", argv[0]);
    return 2;
  }
  const int type = atoi(argv[1]);
  const long t = atol(argv[2]), n = atol(argv[3]), k = atol(argv[4]);
  const int isa = argc > 5 ? atoi(argv[5]) : sp_best_isa(), reps = argc > 6 ? atoi(argv[6]) : 20;
  const int threads = argc > 7 ? atoi(argv[7]) : 1;
  long bs, bb;
  switch (type) {
  case 2: bs = 32, bb = 18; break;
  case 3: bs = 32, bb = 20; break;
  case 6: bs = 32, bb = 22; break;
  case 7: bs = 32, bb = 24; break;
  case 8: bs = 32, bb = 34; break;
  case 10: bs = 256, bb = 84; break;
  case 11: bs = 256, bb = 110; break;
  case 12: bs = 256, bb = 144; break;
  case 13: bs = 256, bb = 176; break;
  case 14: bs = 256, bb = 210; break;
  case 16: bs = 256, bb = 66; break;  /* IQ2_XXS */
  case 17: bs = 256, bb = 74; break;  /* IQ2_XS */
  case 18: bs = 256, bb = 98; break;  /* IQ3_XXS */
  case 19: bs = 256, bb = 50; break;  /* IQ1_S */
  case 20: bs = 32, bb = 18; break;   /* IQ4_NL */
  case 21: bs = 256, bb = 110; break; /* IQ3_S */
  case 22: bs = 256, bb = 82; break;  /* IQ2_S */
  case 23: bs = 256, bb = 136; break; /* IQ4_XS */
  case 29: bs = 256, bb = 56; break;  /* IQ1_M: its scale is spread over the scales' high bits */
  case 34: bs = 256, bb = 54; break;  /* TQ1_0 */
  case 35: bs = 256, bb = 66; break;  /* TQ2_0 */
  case 39: bs = 32, bb = 17; break;   /* MXFP4: an E8M0 byte first */
  default: fprintf(stderr, "unsupported type %d\n", type); return 2;
  }
  const long rb = k / bs * bb;
  uint8_t *w = malloc(n * rb);
  float *x = malloc(t * k * sizeof(float)), *y = malloc(t * n * sizeof(float));
  for (long i = 0; i < n * rb; i++) w[i] = (uint8_t)rnd();
  for (long r = 0; r < n; r++) /* f16 scales (and mins) with a small exponent */
    for (long b = 0; b < k / bs; b++) {
      /* the block's f16 d (and dmin) come last in Q2_K, Q3_K and Q6_K */
      uint8_t *p = w + r * rb + b * bb + (type == 14 ? 208 : type == 10 ? 80 : type == 11 ? 108 :
                                          type == 34 ? 52 : type == 35 ? 64 : 0);
      if (type == 39) {
        p[0] = 120; /* 2^-8 */
        continue;
      }
      p[1] = 0x1c;
      if (type == 3 || type == 7 || type == 10 || type == 12 || type == 13) p[3] = 0x1c;
    }
  for (long i = 0; i < t * k; i++) x[i] = (float)((int)(rnd() % 2001) - 1000) / 1000.f;
  double best = 1e30;
  for (int i = 0; i < reps; i++) {
    const double t0 = now_ms();
    const int rc = sp_matmul(type, x, t, k, w, n, rb, y, threads, isa);
    const double dt = now_ms() - t0;
    if (rc) {
      fprintf(stderr, "sp_matmul failed: %d\n", rc);
      return 1;
    }
    best = dt < best ? dt : best;
  }
  printf("type %d T %ld N %ld K %ld isa %d threads %d: min %.3f ms over %d\n", type, t, n, k, isa,
         threads, best, reps);
  free(w), free(x), free(y);
  return 0;
}
