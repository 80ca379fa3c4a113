/* Public interface of the native GGUF matmul (see ggml_matmul.c). */
#ifndef SPECPIPE_GGML_MATMUL_H
#define SPECPIPE_GGML_MATMUL_H
#include <stdint.h>

/* ggml type ids (the values of gguf.GGMLQuantizationType) */
enum { SP_Q4_0 = 2, SP_Q4_1 = 3, SP_Q5_0 = 6, SP_Q5_1 = 7, SP_Q8_0 = 8,
       SP_Q4_K = 12, SP_Q5_K = 13, SP_Q6_K = 14,
       /* the low-bit types (ggml_matmul_lowbit.h) */
       SP_Q2_K = 10, SP_Q3_K = 11, SP_IQ2_XXS = 16, SP_IQ2_XS = 17, SP_IQ3_XXS = 18, SP_IQ1_S = 19,
       SP_IQ4_NL = 20, SP_IQ3_S = 21, SP_IQ2_S = 22, SP_IQ4_XS = 23, SP_IQ1_M = 29, SP_TQ1_0 = 34,
       SP_TQ2_0 = 35, SP_MXFP4 = 39 };

/* instruction-set paths */
enum { SP_ISA_PORTABLE = 0, SP_ISA_AVX2 = 1, SP_ISA_AVX512VNNI = 2, SP_ISA_NEON = 3, SP_ISA_AMX = 4 };
/* The vector code a path runs: AMX's is AVX-512 VNNI's (it adds tile multiplies to the matmul). */
static inline int sp_vector_isa(int isa) { return isa == SP_ISA_AMX ? SP_ISA_AVX512VNNI : isa; }

enum { SP_OK = 0, SP_ERR_TYPE = 1, SP_ERR_SHAPE = 2, SP_ERR_ISA = 3, SP_ERR_MEMORY = 4 };

/* The version of this interface (the functions, their arguments and the structs below);
 * kernels/native/__init__.py refuses a library whose sp_abi_version() differs from its own
 * ABI_VERSION (a library built from older sources), and falls back to the portable path.
 * Change both together whenever the interface changes. */
#ifndef SP_ABI_VERSION
#define SP_ABI_VERSION 4
#endif
int sp_abi_version(void);

/* Range checks that cannot wrap: *out = a * b for a, b >= 0, false when it overflows int64 (or
 * a, b < 0); every size computed from a caller's numbers goes through it. */
static inline int sp_mul_ok(int64_t a, int64_t b, int64_t *out) {
  return a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, out);
}
/* [first, first + c) lies within [0, n) (no first + c that could wrap). */
static inline int sp_range_ok(int64_t first, int64_t c, int64_t n) {
  return first >= 0 && c >= 0 && n >= 0 && first <= n && c <= n - first;
}

/* y (t, n) = x (t, k) @ W^T, W = n packed rows of row_bytes bytes of `type`.  All arrays
 * row-major and contiguous.  threads: OpenMP threads for this call (1 = the calling thread). */
int sp_matmul(int type, const float *x, int64_t t, int64_t k, const uint8_t *w, int64_t n,
              int64_t row_bytes, float *y, int threads, int isa);
/* Calls of fewer weight bytes x activation rows than `bytes` run on one thread (default 2 MiB;
 * 0: every call takes the threads it is given, as the thread-invariance tests need). */
void sp_set_parallel_min_bytes(int64_t bytes);
/* The most query heads per KV head the attention takes (a thread's scratch holds a block of rows'
 * scores for all of them). */
#define SP_MAX_GROUP 64
/* Attention, each row's sums in an order fixed by that row alone (see attention.c):
 * q (t, hq, d), k and v (c, hkv, d), mask (t, c) bytes or NULL, out (t, hq, d), all float32. */
int sp_attention(const float *q, int64_t t, int hq, int hkv, int d, const float *k, const float *v,
                 int64_t c, const uint8_t *mask, float scale, float *out, int threads, int isa);
/* The same over rows slots[0 .. c) of a (num_slots, hkv, d) pool (slots NULL: rows 0 .. c-1). */
int sp_attention_slots(const float *q, int64_t t, int hq, int hkv, int d, const float *k,
                       const float *v, const int64_t *slots, int64_t c, const uint8_t *mask,
                       float scale, float *out, int threads, int isa);
/* sp_attention with a sink logit per query head (gpt-oss): sinks (hq) floats. */
int sp_attention_sinks(const float *q, int64_t t, int hq, int hkv, int d, const float *k,
                       const float *v, int64_t c, const uint8_t *mask, float scale,
                       const float *sinks, float *out, int threads, int isa);
/* RMSNorm and rotary embeddings per row (see norm_rope.c). */
int sp_rmsnorm(const float *x, int64_t t, int64_t n, const float *w, float eps, float *y);
int sp_rope(const float *x, int64_t t, int64_t heads, int64_t d, int64_t rot, const float *cos_,
            const float *sin_, float *y);
void sp_rope_row(const float *x, int64_t heads, int64_t d, int64_t rot, const float *c,
                 const float *s, float *y); /* one token's heads (heads, d) */

/* A decoder layer in one call (see layer.c).  A projection: n packed rows of a GGUF type, an
 * optional float bias; a group of them (q|k|v, gate|up) writes its outputs side by side. */
typedef struct {
  int32_t type;
  const uint8_t *w;
  int64_t n, row_bytes;
  const float *bias;
} sp_proj;
typedef struct {
  int64_t hidden, inter;
  int32_t hq, hkv, d, n_qkv, n_gu;
  float eps, scale;
  const float *in_norm, *post_norm;
  sp_proj qkv[3], gu[2], o, down;
} sp_layer;
typedef struct {
  int64_t start, end, c;  /* rows [start, end) read c cache rows */
  const int64_t *slots;   /* (c,) those rows, or NULL: first .. first + c - 1 */
  int64_t first;
  const uint8_t *mask;    /* (end - start, c) bytes, nonzero = may attend; NULL = all */
} sp_segment;
int sp_decoder_layer(const sp_layer *L, const float *x, int64_t t, const float *cos_,
                     const float *sin_, int64_t rot, float *kc, float *vc, int64_t num_slots,
                     const int64_t *write_slots, int32_t nseg, const sp_segment *segs, float *out,
                     int threads, int isa);
int sp_silu_mul(const float *g, const float *u, int64_t t, int64_t n, int64_t gstride,
                int64_t ustride, float *y, int isa);
/* A row of k values of `type`: its bytes into *row_bytes (SP_ERR_TYPE, or SP_ERR_SHAPE when k is
 * not a whole number of blocks or the size overflows). */
int sp_row_bytes(int type, int64_t k, int64_t *row_bytes);
/* ggml_blocks.h's struct of `type` as text, "values bytes name:offset:size ..." (see there). */
int sp_block_layout(int type, char *buf, int64_t cap);
int sp_isa_supported(int isa);
int sp_best_isa(void);
int sp_type_supported(int type);
int sp_has_openmp(void);
#endif
