/* Helpers shared by the C tests of braid.h: checked calls and typed element access. */
#ifndef BRAID_TEST_CHECK_H
#define BRAID_TEST_CHECK_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "braid.h"

static int g_rank = -1;

#define FAIL(...)                                                             \
  do {                                                                        \
    fprintf(stderr, "rank %d: %s:%d: ", g_rank, __FILE__, __LINE__);          \
    fprintf(stderr, __VA_ARGS__);                                             \
    fprintf(stderr, "\n");                                                    \
    exit(1);                                                                  \
  } while (0)

/* Calls a braid function and fails the test (with braid's message) unless it succeeds. */
#define CHECK(call)                                                           \
  do {                                                                        \
    braid_result check_rc_ = (call);                                          \
    if (check_rc_ != BRAID_SUCCESS)                                           \
      FAIL("%s returned %d (%s): %s", #call, (int)check_rc_,                  \
           braid_get_error_string(check_rc_), braid_get_last_error_message()); \
  } while (0)

#define EXPECT(cond, ...)                                                     \
  do {                                                                        \
    if (!(cond)) FAIL(__VA_ARGS__);                                           \
  } while (0)

static inline size_t dtype_size(braid_dtype t) {
  switch (t) {
    case BRAID_INT8: case BRAID_UINT8: return 1;
    case BRAID_FLOAT16: case BRAID_BFLOAT16: return 2;
    case BRAID_INT32: case BRAID_UINT32: case BRAID_FLOAT32: return 4;
    default: return 8;
  }
}

static inline const char *dtype_name(braid_dtype t) {
  static const char *names[] = {"int8", "uint8", "int32", "uint32", "int64",
                                "uint64", "float16", "float32", "float64", "bfloat16"};
  return names[t];
}

static inline const char *op_name(braid_redop o) {
  static const char *names[] = {"sum", "prod", "max", "min", "avg", "band", "bor", "bxor"};
  return names[o];
}

static inline int is_signed(braid_dtype t) {
  return t != BRAID_UINT8 && t != BRAID_UINT32 && t != BRAID_UINT64;
}

/* IEEE half from a float that is exactly representable (small integers and quarters here). */
static inline uint16_t to_half(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  uint16_t sign = (uint16_t)((b >> 16) & 0x8000u);
  if ((b & 0x7fffffffu) == 0) return sign;
  int exp = (int)((b >> 23) & 0xff) - 127 + 15;
  uint16_t mant = (uint16_t)((b >> 13) & 0x3ffu);
  return (uint16_t)(sign | (uint16_t)(exp << 10) | mant);
}

static inline float from_half(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  uint32_t b;
  if (exp == 0 && mant == 0) {
    b = sign;
  } else {
    b = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  memcpy(&f, &b, 4);
  return f;
}

static inline uint16_t to_bf16(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return (uint16_t)(b >> 16);
}

static inline float from_bf16(uint16_t h) {
  uint32_t b = (uint32_t)h << 16;
  float f;
  memcpy(&f, &b, 4);
  return f;
}

/* Element i of a buffer of type t, as a double (memcpy: buffers may be unaligned). */
static inline double get(braid_dtype t, const void *buf, size_t i) {
  const char *p = (const char *)buf + i * dtype_size(t);
  switch (t) {
    case BRAID_INT8: { int8_t v; memcpy(&v, p, 1); return v; }
    case BRAID_UINT8: { uint8_t v; memcpy(&v, p, 1); return v; }
    case BRAID_INT32: { int32_t v; memcpy(&v, p, 4); return v; }
    case BRAID_UINT32: { uint32_t v; memcpy(&v, p, 4); return v; }
    case BRAID_INT64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
    case BRAID_UINT64: { uint64_t v; memcpy(&v, p, 8); return (double)v; }
    case BRAID_FLOAT16: { uint16_t v; memcpy(&v, p, 2); return from_half(v); }
    case BRAID_FLOAT32: { float v; memcpy(&v, p, 4); return v; }
    case BRAID_FLOAT64: { double v; memcpy(&v, p, 8); return v; }
    case BRAID_BFLOAT16: { uint16_t v; memcpy(&v, p, 2); return from_bf16(v); }
  }
  FAIL("bad dtype %d", t);
}

static inline void put(braid_dtype t, void *buf, size_t i, double x) {
  char *p = (char *)buf + i * dtype_size(t);
  switch (t) {
    case BRAID_INT8: { int8_t v = (int8_t)x; memcpy(p, &v, 1); return; }
    case BRAID_UINT8: { uint8_t v = (uint8_t)x; memcpy(p, &v, 1); return; }
    case BRAID_INT32: { int32_t v = (int32_t)x; memcpy(p, &v, 4); return; }
    case BRAID_UINT32: { uint32_t v = (uint32_t)x; memcpy(p, &v, 4); return; }
    case BRAID_INT64: { int64_t v = (int64_t)x; memcpy(p, &v, 8); return; }
    case BRAID_UINT64: { uint64_t v = (uint64_t)x; memcpy(p, &v, 8); return; }
    case BRAID_FLOAT16: { uint16_t v = to_half((float)x); memcpy(p, &v, 2); return; }
    case BRAID_FLOAT32: { float v = (float)x; memcpy(p, &v, 4); return; }
    case BRAID_FLOAT64: { memcpy(p, &x, 8); return; }
    case BRAID_BFLOAT16: { uint16_t v = to_bf16((float)x); memcpy(p, &v, 2); return; }
  }
  FAIL("bad dtype %d", t);
}

#endif
