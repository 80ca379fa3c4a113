/* The rate at which one core retires independent 512-bit float FMAs (x86 with AVX-512), the
 * bound the native attention is measured against in docs/native_kernels.md ("Attention").
 * Twelve accumulators, registers only, so neither memory nor the FMA latency limits it.
 *
 *   cc -O2 -mavx512f -o /tmp/bench_fma_rate benchmarks/bench_fma_rate.c && /tmp/bench_fma_rate
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

int main(void) {
  __m512 a[12];
  for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(i * 0.001f);
  const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(0.0001f);
  const long n = 200000000;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long k = 0; k < n; k++)
    for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  const double s = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
  float r = 0;
  for (int i = 0; i < 12; i++) r += _mm512_reduce_add_ps(a[i]);
  printf("%.2f G 512-bit FMAs per second on one core (checksum %g)\n", (double)n * 12 / s / 1e9, r);
  return 0;
}
