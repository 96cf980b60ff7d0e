// braid's per-element reduce arithmetic, shared by the device kernels and by the host tests.
//
// Everything here is `__host__ __device__` and needs no CUDA header (not even cuda_fp16.h), so the same
// text compiles under nvcc, under NVRTC with no include path, and under a plain C++ compiler (which is
// how CI checks it against braid-core's CPU reference without a GPU).
//
// The semantics are braid-core's (crates/braid-core/src/reduce.rs), bit for bit:
// - integers wrap on sum and prod (computed in the unsigned type: no signed overflow);
// - min/max are `b < a ? b : a` and `b > a ? b : a` with `a` the running partial: on a NaN or on
//   +0/-0 the partial wins unless the new value compares strictly smaller/greater;
// - f16 and bf16 accumulate in f32 and are rounded once (round to nearest even);
// - avg sums, then divides once by the number of contributions in the accumulator type
//   (truncating integer division, IEEE division for floats).
// NaNs come out as braid-core's do, bit for bit. A NaN that arithmetic makes (sum, prod, avg) and a
// NaN widened from f16 or bf16 to f32 is the canonical NaN: 0x7fffffff in f32 (0x7fff once narrowed
// to f16 or bf16) and 0x7fffffffffffffff in f64, which is what a GPU's add, mul and conversions return
// (keeping payloads there would cost registers the kernels do not have). Max and min keep an f32 or
// f64 NaN's sign and payload.
#ifndef BRAID_REDUCE_CUH
#define BRAID_REDUCE_CUH

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define BRAID_HD __host__ __device__ __forceinline__
#else
#define BRAID_HD inline
#include <string.h>
#endif

namespace braid {

// Storage types for the 16-bit floats: bits only, so no CUDA header is needed.
struct half_t {
  unsigned short bits;
};
struct bfloat16_t {
  unsigned short bits;
};

// The NaN float arithmetic returns (see above).
enum : unsigned int { CANONICAL_NAN_F32 = 0x7fffffffu };
BRAID_HD double canonical_nan_f64();

// Op codes: braid-core's `ReduceOp` discriminants.
enum { OP_SUM = 0, OP_PROD = 1, OP_MAX = 2, OP_MIN = 3, OP_AVG = 4 };

BRAID_HD float bits_to_f32(unsigned int u) {
#ifdef __CUDA_ARCH__
  return __int_as_float((int)u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

BRAID_HD unsigned int f32_to_bits(float f) {
#ifdef __CUDA_ARCH__
  return (unsigned int)__float_as_int(f);
#else
  unsigned int u;
  memcpy(&u, &f, 4);
  return u;
#endif
}

BRAID_HD double canonical_nan_f64() {
#ifdef __CUDA_ARCH__
  return __longlong_as_double(0x7fffffffffffffffll);
#else
  const unsigned long long u = 0x7fffffffffffffffull;
  double d;
  memcpy(&d, &u, 8);
  return d;
#endif
}

// f16 -> f32 (exact); a NaN becomes the canonical NaN (what the GPU's conversion instruction returns).
BRAID_HD float f16_to_f32(half_t h) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
  return f;
#else
  unsigned int sign = ((unsigned int)h.bits & 0x8000u) << 16;
  unsigned int exp = ((unsigned int)h.bits >> 10) & 0x1fu;
  unsigned int man = (unsigned int)h.bits & 0x3ffu;
  if (exp == 0x1fu) {
    return bits_to_f32(man == 0 ? (sign | 0x7f800000u) : CANONICAL_NAN_F32);
  }
  if (exp == 0) {
    // Zero or subnormal: man * 2^-24, exact in f32.
    float f = (float)man * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

// f32 -> f16, round to nearest even; overflow to infinity; a NaN becomes the canonical 0x7fff.
BRAID_HD half_t f32_to_f16(float f) {
  half_t h;
#ifdef __CUDA_ARCH__
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
#else
  unsigned int x = f32_to_bits(f);
  unsigned int sign = (x >> 16) & 0x8000u;
  unsigned int exp = (x >> 23) & 0xffu;
  unsigned int man = x & 0x7fffffu;
  if (exp == 0xffu) {
    h.bits = (unsigned short)(man ? 0x7fffu : (sign | 0x7c00u));
    return h;
  }
  int e = (int)exp - 127 + 15;
  if (e >= 0x1f) {
    h.bits = (unsigned short)(sign | 0x7c00u);
    return h;
  }
  if (e <= 0) {
    if (e < -10) {
      h.bits = (unsigned short)sign;
      return h;
    }
    unsigned int m = man | 0x800000u;
    unsigned int shift = (unsigned int)(14 - e);
    unsigned int r = m >> shift;
    unsigned int round = 1u << (shift - 1);
    if ((m & round) && (m & (3u * round - 1u))) r += 1;
    h.bits = (unsigned short)(sign | r);
    return h;
  }
  unsigned int r = sign | ((unsigned int)e << 10) | (man >> 13);
  if ((man & 0x1000u) && (man & 0x2fffu)) r += 1;
  h.bits = (unsigned short)r;
#endif
  return h;
}

// bf16 -> f32 (exact); a NaN becomes the canonical NaN. The same integer code on host and device.
BRAID_HD float bf16_to_f32(bfloat16_t b) {
  unsigned int u = (unsigned int)b.bits;
  return bits_to_f32((u & 0x7fffu) > 0x7f80u ? CANONICAL_NAN_F32 : u << 16);
}

// f32 -> bf16, round to nearest even; a NaN becomes the canonical 0x7fff.
BRAID_HD bfloat16_t f32_to_bf16(float f) {
  bfloat16_t b;
#ifdef __CUDA_ARCH__
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(f));
#else
  unsigned int x = f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    b.bits = 0x7fffu;
    return b;
  }
  unsigned int r = x >> 16;
  if ((x & 0x8000u) && (x & 0x17fffu)) r += 1;
  b.bits = (unsigned short)r;
#endif
  return b;
}

// Wrapping integer arithmetic, computed in the unsigned type.
BRAID_HD signed char add(signed char a, signed char b) { return (signed char)(unsigned char)((unsigned char)a + (unsigned char)b); }
BRAID_HD unsigned char add(unsigned char a, unsigned char b) { return (unsigned char)(a + b); }
BRAID_HD int add(int a, int b) { return (int)((unsigned int)a + (unsigned int)b); }
BRAID_HD unsigned int add(unsigned int a, unsigned int b) { return a + b; }
BRAID_HD long long add(long long a, long long b) { return (long long)((unsigned long long)a + (unsigned long long)b); }
BRAID_HD unsigned long long add(unsigned long long a, unsigned long long b) { return a + b; }
// The canonical NaN for a NaN result of + and *: a GPU returns it itself; a CPU returns an operand's NaN
// or one of its own, so the host code (the tests' reference path) replaces it.
BRAID_HD float canon(float r) {
#ifdef __CUDA_ARCH__
  return r;
#else
  return r == r ? r : bits_to_f32(CANONICAL_NAN_F32);
#endif
}
BRAID_HD double canon(double r) {
#ifdef __CUDA_ARCH__
  return r;
#else
  return r == r ? r : canonical_nan_f64();
#endif
}
BRAID_HD float add(float a, float b) { return canon(a + b); }
BRAID_HD double add(double a, double b) { return canon(a + b); }

BRAID_HD signed char mul(signed char a, signed char b) { return (signed char)(unsigned char)((unsigned int)(unsigned char)a * (unsigned int)(unsigned char)b); }
BRAID_HD unsigned char mul(unsigned char a, unsigned char b) { return (unsigned char)((unsigned int)a * (unsigned int)b); }
BRAID_HD int mul(int a, int b) { return (int)((unsigned int)a * (unsigned int)b); }
BRAID_HD unsigned int mul(unsigned int a, unsigned int b) { return a * b; }
BRAID_HD long long mul(long long a, long long b) { return (long long)((unsigned long long)a * (unsigned long long)b); }
BRAID_HD unsigned long long mul(unsigned long long a, unsigned long long b) { return a * b; }
BRAID_HD float mul(float a, float b) { return canon(a * b); }
BRAID_HD double mul(double a, double b) { return canon(a * b); }

// Division by the number of contributions (n >= 1), truncating for integers. Types of up to 32 bits
// divide magnitudes in 32 bits (inline on a GPU; 64-bit division is a called routine there).
BRAID_HD int sdiv32(int a, unsigned int n) {
  unsigned int m = a < 0 ? 0u - (unsigned int)a : (unsigned int)a;
  unsigned int q = m / n;
  return a < 0 ? (int)(0u - q) : (int)q;
}
BRAID_HD signed char div_n(signed char a, unsigned int n) { return (signed char)sdiv32(a, n); }
BRAID_HD unsigned char div_n(unsigned char a, unsigned int n) { return (unsigned char)((unsigned int)a / n); }
BRAID_HD int div_n(int a, unsigned int n) { return sdiv32(a, n); }
BRAID_HD unsigned int div_n(unsigned int a, unsigned int n) { return a / n; }
BRAID_HD long long div_n(long long a, unsigned int n) { return a / (long long)n; }
BRAID_HD unsigned long long div_n(unsigned long long a, unsigned int n) { return a / (unsigned long long)n; }
// A NaN quotient is the canonical NaN, as a GPU's add and mul make it (its division is a routine
// whose NaN results are not promised to be canonical).
BRAID_HD float div_n(float a, unsigned int n) {
  float q = a / (float)n;
  return q == q ? q : bits_to_f32(CANONICAL_NAN_F32);
}
BRAID_HD double div_n(double a, unsigned int n) {
  double q = a / (double)n;
  return q == q ? q : canonical_nan_f64();
}

// `a op b`, with `a` the running partial (avg combines as sum).
template <int OP, class A>
BRAID_HD A combine(A a, A b) {
  if (OP == OP_SUM || OP == OP_AVG) return add(a, b);
  if (OP == OP_PROD) return mul(a, b);
  if (OP == OP_MAX) return b > a ? b : a;
  return b < a ? b : a;
}

// A stored element type: its accumulator type and the conversions to and from it.
template <class T>
struct Elem {
  typedef T A;
  static BRAID_HD A load(T x) { return x; }
  static BRAID_HD T store(A a) { return a; }
};
template <>
struct Elem<half_t> {
  typedef float A;
  static BRAID_HD float load(half_t x) { return f16_to_f32(x); }
  static BRAID_HD half_t store(float a) { return f32_to_f16(a); }
};
template <>
struct Elem<bfloat16_t> {
  typedef float A;
  static BRAID_HD float load(bfloat16_t x) { return bf16_to_f32(x); }
  static BRAID_HD bfloat16_t store(float a) { return f32_to_bf16(a); }
};

// The finished value of a partial: divided by `n` for avg, rounded to T.
template <class T, int OP>
BRAID_HD T finish(typename Elem<T>::A a, unsigned int n) {
  return Elem<T>::store(OP == OP_AVG ? div_n(a, n) : a);
}

}  // namespace braid

#endif  // BRAID_REDUCE_CUH
