/* Our native matmul (sp_matmul) against ggml's own CPU mul_mat on the same packed bytes, the same
 * activations and the same thread counts, interleaved in one process.  Compiled and run by
 * benchmarks/lowbit_vs_ggml.py (which finds ggml's headers and libraries, those of a
 * pip-installed llama-cpp-python, and our library); by hand:
 *
 *   cc -O2 -fopenmp -I GGML_INCLUDE -o /tmp/lvg benchmarks/lowbit_vs_ggml.c \
 *      -L GGML_LIB -lggml -lggml-base -lggml-cpu -Wl,-rpath,GGML_LIB -ldl -lm
 *   /tmp/lvg OUR_LIB TYPE N K ROWS,.. THREADS,.. REPS FLUSH_MB SEED [PAUSE_US [ISA [ISA2]]]
 *
 * For one ggml type and one weight shape (N output rows of K values):
 *   1. W (N, K): Gaussian floats quantized by ggml's own quantizer (ggml_quantize_chunk), with a
 *      random positive importance matrix for the types ggml requires one for (IQ2_XXS, IQ2_XS,
 *      IQ1_S) and IQ1_M (whose quantizer asserts on one missing).
 *   2. The float reference: ggml's dequantization of W (its to_float) times the float
 *      activations, summed in double.
 *   3. Per rows T and thread count: ggml's CPU backend computes a graph of one ggml_mul_mat(W, x),
 *      x f32 (K, T), with W in a CPU buffer wrapped around our copy of the bytes ("ggml"), and,
 *      where ggml's CPU_REPACK extra buffer type takes the tensor on this CPU (llama.cpp puts
 *      weights there by default; Q4_0, Q4_K, IQ4_NL, MXFP4 with AVX2, Q2_K with AVX-512), with W
 *      in that buffer too ("ggml_repack"); and sp_matmul(type, x, T, K, W, N, ...) on the same
 *      bytes at the library's best ISA (or ISA: 0 portable, 1 avx2, 2 avx512vnni), and, given
 *      ISA2 >= 0, sp_matmul at that path as well ("ours_isa2").  One warm-up each, then REPS
 *      rounds, each calling every path once, the order rotating from round to round; before
 *      every timed call a FLUSH_MB buffer is read so that W comes from memory as it does in
 *      decode (0: no flush), then the driver sleeps PAUSE_US microseconds (default 0), so that
 *      on a machine other processes load the call tends to start on a fresh time slice rather
 *      than be cut by the scheduler (the same for every path).
 *   4. One JSON line per (T, threads): the times (ms) of every round, and each path's max abs
 *      error against the float reference over max |reference| (and ours against ggml's).
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

typedef int (*sp_matmul_t)(int, const float *, int64_t, int64_t, const uint8_t *, int64_t, int64_t,
                           float *, int, int);
typedef int (*sp_int_t)(void);
typedef int (*sp_row_bytes_t)(int, int64_t, int64_t *);
typedef int (*sp_type_supported_t)(int);

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double uniform(void) { /* xorshift64*, in (0, 1) */
  rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
  return ((rng * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0) + 1e-17;
}
static float gauss(void) { return (float)(sqrt(-2 * log(uniform())) * cos(6.283185307179586 * uniform())); }

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static volatile uint64_t sink;
static uint64_t *flush_buf;
static size_t flush_words;
static void flush(void) {
  uint64_t s = 0;
  for (size_t i = 0; i < flush_words; i += 8) s += flush_buf[i]; /* one word per 64-byte line */
  sink += s;
}

static double max_err(const float *a, const float *b, const double *ref, size_t m) {
  double e = 0, r = 0;
  for (size_t i = 0; i < m; i++) {
    const double d = fabs((double)a[i] - (b ? (double)b[i] : ref[i]));
    e = d > e ? d : e;
    const double v = fabs(b ? (double)b[i] : ref[i]);
    r = v > r ? v : r;
  }
  return r > 0 ? e / r : e;
}

static int parse_list(const char *s, int *out, int cap) {
  int n = 0;
  while (*s && n < cap) {
    out[n++] = atoi(s);
    while (*s && *s != ',') s++;
    if (*s == ',') s++;
  }
  return n;
}

/* A graph of ggml_mul_mat(w, x) with x (k, t) f32, its tensors in a CPU buffer. */
typedef struct {
  struct ggml_context *ctx;
  struct ggml_cgraph *gf;
  struct ggml_tensor *x, *y;
  ggml_backend_buffer_t buf;
} mm_graph;
static int mm_graph_init(mm_graph *g, ggml_backend_t be, struct ggml_tensor *w, int64_t t) {
  struct ggml_init_params p = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true};
  g->ctx = ggml_init(p);
  g->x = ggml_new_tensor_2d(g->ctx, GGML_TYPE_F32, w->ne[0], t);
  g->y = ggml_mul_mat(g->ctx, w, g->x);
  g->gf = ggml_new_graph(g->ctx);
  ggml_build_forward_expand(g->gf, g->y);
  g->buf = ggml_backend_alloc_ctx_tensors(g->ctx, be);
  return g->buf != NULL;
}
static void mm_graph_free(mm_graph *g) {
  ggml_backend_buffer_free(g->buf);
  ggml_free(g->ctx);
}

int main(int argc, char **argv) {
  if (argc < 10) {
    fprintf(stderr, "usage: %s OUR_LIB TYPE N K ROWS,.. THREADS,.. REPS FLUSH_MB SEED [PAUSE_US [ISA [ISA2]]]\n",
            argv[0]);
    return 2;
  }
  const enum ggml_type type = (enum ggml_type)atoi(argv[2]);
  const int64_t n = atoll(argv[3]), k = atoll(argv[4]);
  int rows[16], threads[16];
  const int nrows = parse_list(argv[5], rows, 16), nthreads = parse_list(argv[6], threads, 16);
  const int reps = atoi(argv[7]);
  const long flush_mb = atol(argv[8]);
  const long pause_us = argc > 10 ? atol(argv[10]) : 0;
  rng ^= (uint64_t)atoll(argv[9]) * 0x100000001b3ull;

  void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
    return 1;
  }
  sp_matmul_t sp_matmul = (sp_matmul_t)dlsym(lib, "sp_matmul");
  sp_int_t sp_best_isa = (sp_int_t)dlsym(lib, "sp_best_isa");
  sp_int_t sp_has_openmp = (sp_int_t)dlsym(lib, "sp_has_openmp");
  sp_row_bytes_t sp_row_bytes = (sp_row_bytes_t)dlsym(lib, "sp_row_bytes");
  sp_type_supported_t sp_type_supported = (sp_type_supported_t)dlsym(lib, "sp_type_supported");
  if (!sp_matmul || !sp_best_isa || !sp_row_bytes || !sp_type_supported || !sp_has_openmp) {
    fprintf(stderr, "%s lacks the sp_ functions\n", argv[1]);
    return 1;
  }
  const int isa = argc > 11 && atoi(argv[11]) >= 0 ? atoi(argv[11]) : sp_best_isa();
  const int isa2 = argc > 12 ? atoi(argv[12]) : -1;
  const size_t rb = ggml_row_size(type, k);
  int64_t our_rb = -1;
  if (!sp_type_supported(type) || sp_row_bytes(type, k, &our_rb) || (size_t)our_rb != rb) {
    fprintf(stderr, "type %d: ours unsupported or row bytes %lld != ggml's %zu\n", type,
            (long long)our_rb, rb);
    return 1;
  }

  ggml_cpu_init();
  /* 1. the weights, quantized by ggml */
  float *wf = malloc(sizeof(float) * n * k), *imat = NULL;
  for (int64_t i = 0; i < n * k; i++) wf[i] = gauss();
  const int use_imat = ggml_quantize_requires_imatrix(type) || type == GGML_TYPE_IQ1_M;
  if (use_imat) {
    imat = malloc(sizeof(float) * k);
    for (int64_t i = 0; i < k; i++) imat[i] = (float)(0.25 + 1.75 * uniform());
  }
  uint8_t *wq = aligned_alloc(64, (n * rb + 63) / 64 * 64);
  ggml_quantize_init(type);
  const double tq = now_ms();
  const int64_t chunk = 64;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t nr = n - r0 < chunk ? n - r0 : chunk;
    ggml_quantize_chunk(type, wf, wq, r0 * k, nr, k, imat);
  }
  const double quant_ms = now_ms() - tq;

  /* 2. the float reference: ggml's dequantized W times x, in double */
  int tmax = 0;
  for (int i = 0; i < nrows; i++) tmax = rows[i] > tmax ? rows[i] : tmax;
  float *x = malloc(sizeof(float) * tmax * k);
  for (int64_t i = 0; i < tmax * k; i++) x[i] = gauss();
  const struct ggml_type_traits *tr = ggml_get_type_traits(type);
  for (int64_t r = 0; r < n; r++) tr->to_float(wq + r * rb, wf + r * k, k); /* wf: dequantized */
  double *ref = malloc(sizeof(double) * tmax * n);
#pragma omp parallel for
  for (int64_t r = 0; r < n; r++)
    for (int t = 0; t < tmax; t++) {
      double s = 0;
      for (int64_t i = 0; i < k; i++) s += (double)wf[r * k + i] * x[t * k + i];
      ref[t * n + r] = s;
    }
  free(wf);

  flush_words = (size_t)flush_mb * (1 << 20) / 8;
  flush_buf = flush_words ? malloc(flush_words * 8) : NULL;
  for (size_t i = 0; i < flush_words; i++) flush_buf[i] = i;

  /* 3. ggml: W over our bytes, and W in the repack buffer where ggml takes it */
  ggml_backend_t be = ggml_backend_cpu_init();
  ggml_backend_dev_t dev = ggml_backend_get_device(be);
  struct ggml_init_params wp = {ggml_tensor_overhead() * 4, NULL, true};
  struct ggml_context *wctx = ggml_init(wp), *rctx = NULL;
  struct ggml_tensor *w = ggml_new_tensor_2d(wctx, type, k, n);
  ggml_backend_buffer_t wbuf = ggml_backend_cpu_buffer_from_ptr(wq, n * rb);
  ggml_backend_tensor_alloc(wbuf, w, wq);

  struct ggml_tensor *wr = NULL;
  ggml_backend_buffer_t rbuf = NULL;
  const char *repack_name = "";
  ggml_backend_dev_get_extra_bufts_t get_extra = (ggml_backend_dev_get_extra_bufts_t)
      ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
  for (ggml_backend_buffer_type_t *b = get_extra ? get_extra(dev) : NULL; b && *b && !wr; b++) {
    /* llama.cpp's test (llama-model.cpp, buft_supported): the op on a tensor in that buffer type */
    if (rctx) ggml_free(rctx);
    rctx = ggml_init(wp); /* a fresh one per candidate: it allocates all of its tensors */
    struct ggml_tensor *cand = ggml_new_tensor_2d(rctx, type, k, n);
    ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(*b, 0);
    cand->buffer = dummy;
    struct ggml_init_params op_p = {ggml_tensor_overhead() * 4, NULL, true};
    struct ggml_context *octx = ggml_init(op_p);
    struct ggml_tensor *op = ggml_mul_mat(octx, cand, ggml_new_tensor_2d(octx, GGML_TYPE_F32, k, 8));
    const int ok = ggml_backend_dev_supports_op(dev, op);
    ggml_free(octx);
    cand->buffer = NULL;
    ggml_backend_buffer_free(dummy);
    if (!ok) continue;
    rbuf = ggml_backend_alloc_ctx_tensors_from_buft(rctx, *b);
    if (!rbuf) continue;
    wr = cand;
    repack_name = ggml_backend_buft_name(*b);
    ggml_backend_tensor_set(wr, wq, 0, n * rb); /* repacks */
  }

  float *yo2 = malloc(sizeof(float) * tmax * n);
  float *yo = malloc(sizeof(float) * tmax * n), *yg = malloc(sizeof(float) * tmax * n),
        *yr = malloc(sizeof(float) * tmax * n);
  /* the paths timed: 0 ours, 1 ggml, 2 ggml_repack (where taken), 3 ours at ISA2 (if given) */
  int active[4], npath = 0;
  active[npath++] = 0, active[npath++] = 1;
  if (wr) active[npath++] = 2;
  if (isa2 >= 0) active[npath++] = 3;
  double *times = malloc(sizeof(double) * reps * 4);
  for (int ri = 0; ri < nrows; ri++)
    for (int ti = 0; ti < nthreads; ti++) {
      const int t = rows[ri], nth = threads[ti];
      mm_graph g, gr;
      if (!mm_graph_init(&g, be, w, t) || (wr && !mm_graph_init(&gr, be, wr, t))) {
        fprintf(stderr, "ggml graph allocation failed\n");
        return 1;
      }
      ggml_backend_tensor_set(g.x, x, 0, sizeof(float) * t * k);
      if (wr) ggml_backend_tensor_set(gr.x, x, 0, sizeof(float) * t * k);
      ggml_backend_cpu_set_n_threads(be, nth);
      for (int rep = -1; rep < reps; rep++)
        for (int j = 0; j < npath; j++) {
          const int path = active[(j + (rep < 0 ? 0 : rep)) % npath]; /* rotate the order */
          if (rep >= 0) flush();
          if (rep >= 0 && pause_us) { /* start the call on a fresh time slice (see the top) */
            struct timespec ts = {0, pause_us * 1000L};
            nanosleep(&ts, NULL);
          }
          const double t0 = now_ms();
          int rc = 0;
          if (path == 0 || path == 3)
            rc = sp_matmul(type, x, t, k, wq, n, rb, path ? yo2 : yo, nth, path ? isa2 : isa);
          else
            rc = ggml_backend_graph_compute(be, path == 1 ? g.gf : gr.gf) != GGML_STATUS_SUCCESS;
          const double dt = now_ms() - t0;
          if (rc) {
            fprintf(stderr, "path %d failed: %d\n", path, rc);
            return 1;
          }
          if (rep >= 0) times[rep * 4 + path] = dt;
        }
      ggml_backend_tensor_get(g.y, yg, 0, sizeof(float) * t * n);
      if (wr) ggml_backend_tensor_get(gr.y, yr, 0, sizeof(float) * t * n);
      const size_t m = (size_t)t * n;
      printf("{\"type\": %d, \"type_name\": \"%s\", \"n\": %lld, \"k\": %lld, \"rows\": %d, "
             "\"threads\": %d, \"isa\": %d, \"our_openmp\": %d, \"imatrix\": %d, \"quant_ms\": %.1f, "
             "\"repack\": \"%s\", \"flush_mb\": %ld, \"pause_us\": %ld, ",
             type, ggml_type_name(type), (long long)n, (long long)k, t, nth, isa, sp_has_openmp(),
             use_imat, quant_ms, repack_name, flush_mb, pause_us);
      printf("\"err_ours_ref\": %.3e, \"err_ggml_ref\": %.3e, \"err_ours_ggml\": %.3e, ",
             max_err(yo, NULL, ref, m), max_err(yg, NULL, ref, m), max_err(yo, yg, NULL, m));
      if (wr)
        printf("\"err_repack_ref\": %.3e, \"err_ours_repack\": %.3e, ", max_err(yr, NULL, ref, m),
               max_err(yo, yr, NULL, m));
      if (isa2 >= 0)
        printf("\"isa2\": %d, \"err_ours2_ref\": %.3e, \"err_ours_ours2\": %.3e, ", isa2,
               max_err(yo2, NULL, ref, m), max_err(yo, yo2, NULL, m));
      const char *names[4] = {"ours", "ggml", "ggml_repack", "ours_isa2"};
      for (int j = 0; j < npath; j++) {
        const int p = active[j];
        printf("%s\"ms_%s\": [", j ? ", " : "", names[p]);
        for (int rep = 0; rep < reps; rep++) printf("%s%.4f", rep ? ", " : "", times[rep * 4 + p]);
        printf("]");
      }
      printf("}\n");
      fflush(stdout);
      mm_graph_free(&g);
      if (wr) mm_graph_free(&gr);
    }
  return 0;
}
