/* The two per-row operations of a decoder layer that are many small torch calls each: RMSNorm
 * (six ops) and rotary embeddings (six ops per tensor), one C call each.
 *
 * RMSNorm: y = w * (x * r), r = 1 / sqrt(mean(x^2) + eps), per row of n values; the sum of
 * squares in double, in one fixed order (so a row's result depends on that row alone).
 * Rope (Hugging Face's rotate-half, on the first `rot` of each head's d values, the rest passed
 * through): y[i] = x[i] * cos[i] + (-x[i + rot/2]) * sin[i] for i < rot/2 and
 * y[i] = x[i] * cos[i] + x[i - rot/2] * sin[i] for rot/2 <= i < rot: each element the same two
 * roundings of products and one of their sum as torch's written-out form, hence its bits (the
 * library is built with -ffp-contract=off).
 * Layouts: row-major, contiguous, float32; cos and sin (t, rot), one row per token. */
#include <math.h>
#include <stdint.h>

#include "ggml_matmul.h"

int sp_rmsnorm(const float *x, int64_t t, int64_t n, const float *w, float eps, float *y) {
  int64_t size;
  if (t < 0 || n < 1 || !sp_mul_ok(t, n, &size)) return SP_ERR_SHAPE;
  for (int64_t i = 0; i < t; i++) {
    const float *xi = x + i * n;
    float *yi = y + i * n;
    double ss = 0.0;
    for (int64_t j = 0; j < n; j++) ss += (double)xi[j] * xi[j];
    const float r = 1.f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t j = 0; j < n; j++) yi[j] = w[j] * (xi[j] * r);
  }
  return SP_OK;
}

void sp_rope_row(const float *x, int64_t heads, int64_t d, int64_t rot, const float *c,
                 const float *s, float *y) {
  const int64_t h = rot / 2;
  for (int64_t hd = 0; hd < heads; hd++) {
    const float *xi = x + hd * d;
    float *yi = y + hd * d;
    for (int64_t j = 0; j < h; j++) yi[j] = xi[j] * c[j] + (-xi[j + h]) * s[j];
    for (int64_t j = h; j < rot; j++) yi[j] = xi[j] * c[j] + xi[j - h] * s[j];
    for (int64_t j = rot; j < d; j++) yi[j] = xi[j];
  }
}

int sp_rope(const float *x, int64_t t, int64_t heads, int64_t d, int64_t rot, const float *cos_,
            const float *sin_, float *y) {
  int64_t size;
  if (t < 0 || heads < 1 || d < 1 || rot < 2 || rot > d || rot % 2 || !sp_mul_ok(heads, d, &size) ||
      !sp_mul_ok(t, size, &size) || !sp_mul_ok(t, rot, &size))
    return SP_ERR_SHAPE;
  for (int64_t i = 0; i < t; i++)
    sp_rope_row(x + i * heads * d, heads, d, rot, cos_ + i * rot, sin_ + i * rot, y + i * heads * d);
  return SP_OK;
}
