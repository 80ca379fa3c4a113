/* The vector helpers the native sources share (GCC/Clang vector extensions): element-wise IEEE
 * operations only, so each lane gets the scalar expression's bits on every target. */
#ifndef SPECPIPE_VEC_H
#define SPECPIPE_VEC_H
#include <stdint.h>
#include <string.h>

#define SP_INLINE static inline __attribute__((always_inline))

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
/* 4-lane (SSE2 / NEON width) vectors, for code compiled once for the baseline ISA */
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

/* Unaligned loads: name(p) reads a vector of vtype from p (memcpy: no alignment assumed, one
 * vector load once compiled). */
#define SP_LOAD(name, vtype, etype)  \
  SP_INLINE vtype name(const etype *p) { \
    vtype v;                         \
    memcpy(&v, p, sizeof v);         \
    return v;                        \
  }
SP_LOAD(ld4f, v4f, float)
SP_LOAD(ld8f, v8f, float)
SP_LOAD(ld8i, v8i, int32_t)
SP_LOAD(ld16f, v16f, float)
#undef SP_LOAD

/* exp(x) for x <= 0, element-wise (x = score - max): x = n ln2 + r with |r| <= ln2 / 2 (ln2 in
 * two parts, Cody-Waite), e^r by its degree-7 Taylor polynomial (Horner: error below 2 ulp),
 * times 2^n built in the exponent bits.  Below -87 the result is 0 (e^-87 is below float's
 * normal range; it would add nothing to a sum that holds e^0 = 1). */
typedef int32_t v8i32 __attribute__((vector_size(32)));
SP_INLINE v8f exp8(v8f x) {
  const v8f zero = {0}, magic = zero + 12582912.f; /* 1.5 * 2^23: adding rounds to an integer */
  const v8i32 small = x < -87.f;
  x = (v8f)((v8i32)x & ~small); /* 0 there; masked to 0 at the end */
  const v8f fn = (x * 1.44269504088896341f + magic) - magic; /* round(x / ln2) */
  const v8f r = (x - fn * 0.693359375f) - fn * -2.12194440e-4f;
  v8f p = zero + 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const v8i32 n = __builtin_convertvector(fn, v8i32);
  const v8f scale = (v8f)((n + 127) << 23);
  return (v8f)((v8i32)(p * scale) & ~small);
}

#endif
