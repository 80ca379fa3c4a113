/* The vector helpers the native sources share (GCC/Clang vector extensions): element-wise IEEE
 * operations only, so each lane gets the scalar expression's bits on every target. */
#ifndef SPECPIPE_VEC_H
#define SPECPIPE_VEC_H
#include <stdint.h>
#include <string.h>

#define SP_INLINE static inline __attribute__((always_inline))

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* unaligned loads */
SP_INLINE v8f ld8f(const float *p) {
  v8f v;
  memcpy(&v, p, sizeof v);
  return v;
}
SP_INLINE v8i ld8i(const int32_t *p) {
  v8i v;
  memcpy(&v, p, sizeof v);
  return v;
}
#endif
