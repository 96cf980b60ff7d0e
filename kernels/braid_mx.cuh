// Block-scaled floats (OCP Microscaling v1.0) on the device: the element formats E4M3, E5M2 (MXFP8)
// and E2M1 (MXFP4) with one E8M0 scale per 32 elements, exactly as braid-compress's `mx` module and
// `Mx` codec define them (the CPU implementation is the reference, and the host tests compare the two
// bit for bit):
// - a block's scale is 2^(floor(log2 amax) - emax), clamped to 2^-127..2^127 (an all-zero block takes
//   2^-127); a block holding a NaN or an infinity takes the NaN scale (code 255) and all-zero codes;
// - an element is x / scale rounded to the nearest element value, ties to even, saturating at the
//   largest one; the division is a multiplication by a power of two, exact where it matters;
// - decoding is an element value times the scale, both exact.
// Every float operation here is a single IEEE single-precision operation, rounded to nearest (the
// `_rn` intrinsics on the device, which the compiler never fuses into an FMA, and plain operations on
// the host, built with -ffp-contract=off), so device, host and braid-compress agree to the bit, NaN payloads
// aside (a GPU's arithmetic returns the canonical NaN where the CPU keeps the operand's payload).
//
// Launch shape: blocks of a multiple of 32 threads (whole warps: every lane takes part in the shuffles),
// at most 256.
#ifndef BRAID_MX_CUH
#define BRAID_MX_CUH

#include "braid_reduce.cuh"

#if !defined(__CUDACC__) && !defined(__CUDACC_RTC__)
#include <math.h>
#endif

namespace braid {
namespace mx {

enum : unsigned int { BLOCK = 32, SCALE_NAN = 255, SCALE_BIAS = 127 };

// Element formats: braid-compress's wire codes.
enum : int { E4M3 = 0, E5M2 = 1, E2M1 = 2 };

BRAID_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

BRAID_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

BRAID_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// Rounds to an integer, ties to even (the default rounding mode on both sides).
BRAID_HD float round_even(float v) {
#ifdef __CUDA_ARCH__
  return rintf(v);
#else
  return nearbyintf(v);
#endif
}

// 2^k for k in -149..127, exactly.
BRAID_HD float pow2(int k) {
  return k >= -126 ? bits_to_f32((unsigned int)(k + 127) << 23) : bits_to_f32(1u << (k + 149));
}

// floor(log2 a) of a positive finite float (subnormals included).
BRAID_HD int floor_log2(float a) {
  const unsigned int bits = f32_to_bits(a) & 0x7fffffffu;
  const int e = (int)(bits >> 23);
  if (e > 0) return e - 127;
  unsigned int m = bits & 0x7fffffu;
  int lz = 0;
  while (!(m & 0x80000000u)) {
    m <<= 1;
    lz++;
  }
  return -118 - lz;
}

template <int F>
struct Format;
template <>
struct Format<E4M3> {
  enum { BITS = 8, EBITS = 4, MBITS = 3, BIAS = 7, EMAX = 8, MAX_CODE = 0x7e };
  static BRAID_HD float max() { return 448.0f; }
};
template <>
struct Format<E5M2> {
  enum { BITS = 8, EBITS = 5, MBITS = 2, BIAS = 15, EMAX = 15, MAX_CODE = 0x7b };
  static BRAID_HD float max() { return 57344.0f; }
};
template <>
struct Format<E2M1> {
  enum { BITS = 4, EBITS = 2, MBITS = 1, BIAS = 1, EMAX = 2, MAX_CODE = 0x7 };
  static BRAID_HD float max() { return 6.0f; }
};

// The value of element code `code` of format F.
template <int F>
BRAID_HD float decode(unsigned int code) {
  typedef Format<F> T;
  code &= (1u << T::BITS) - 1;
  const bool negative = (code >> (T::BITS - 1)) != 0;
  const unsigned int e = (code >> T::MBITS) & ((1u << T::EBITS) - 1);
  const unsigned int m = code & ((1u << T::MBITS) - 1);
  const unsigned int top = (1u << T::EBITS) - 1;
  float magnitude;
  if (F == E4M3 && e == top && m == (1u << T::MBITS) - 1) {
    magnitude = bits_to_f32(0x7fc00000u);
  } else if (F == E5M2 && e == top) {
    magnitude = bits_to_f32(m == 0 ? 0x7f800000u : 0x7fc00000u);
  } else if (e == 0) {
    magnitude = mul_rn((float)m, pow2(1 - T::BIAS - T::MBITS));
  } else {
    magnitude = mul_rn((float)((1u << T::MBITS) + m), pow2((int)e - T::BIAS - T::MBITS));
  }
  return negative ? -magnitude : magnitude;
}

// The code of the finite `v` (a scaled element): nearest, ties to even, saturating.
template <int F>
BRAID_HD unsigned int encode(float v) {
  typedef Format<F> T;
  const unsigned int sign = (f32_to_bits(v) >> 31) << (T::BITS - 1);
  const float a = bits_to_f32(f32_to_bits(v) & 0x7fffffffu);
  if (a >= T::max()) return sign | T::MAX_CODE;
  if (a == 0.0f) return sign;
  int quantum = floor_log2(a);
  if (quantum < 1 - T::BIAS) quantum = 1 - T::BIAS;
  quantum -= T::MBITS;
  const unsigned int n = (unsigned int)round_even(mul_rn(a, pow2(-quantum)));
  if (n == 0) return sign;
  unsigned int code = (((unsigned int)(quantum + T::MBITS + T::BIAS)) << T::MBITS) + n - (1u << T::MBITS);
  if (code > T::MAX_CODE) code = T::MAX_CODE;
  return sign | code;
}

// The E8M0 scale code of a block whose largest magnitude is `amax` (NaN when it is not finite).
template <int F>
BRAID_HD unsigned int scale_code(float amax) {
  if (!(amax - amax == 0.0f)) return SCALE_NAN;  // NaN or infinite
  int shared = -(int)SCALE_BIAS;
  if (amax != 0.0f) {
    shared = floor_log2(amax) - Format<F>::EMAX;
    if (shared < -(int)SCALE_BIAS) shared = -(int)SCALE_BIAS;
    if (shared > (int)SCALE_BIAS) shared = (int)SCALE_BIAS;
  }
  return (unsigned int)(shared + (int)SCALE_BIAS);
}

// The value of scale code `code`.
BRAID_HD float scale_value(unsigned int code) {
  return code == SCALE_NAN ? bits_to_f32(0x7fc00000u) : pow2((int)code - (int)SCALE_BIAS);
}

// The magnitude a block's largest-magnitude search keeps: |x|, or NaN for a non-finite x (which then
// wins, as in braid-compress: a block with a NaN or an infinity is a NaN block).
BRAID_HD float amax_key(float x) {
  const float a = bits_to_f32(f32_to_bits(x) & 0x7fffffffu);
  return a - a == 0.0f ? a : bits_to_f32(0x7fc00000u);
}

// The larger of two keys, NaN winning.
BRAID_HD float amax_join(float a, float b) {
  if (a != a || b != b) return bits_to_f32(0x7fc00000u);
  return a > b ? a : b;
}

// One compression step with error feedback, fused: per element the residual
// r = g·clip_scale + decay·error (g alone when decay is 0; no multiplication when clip_scale is 1),
// per block of 32 its scale and codes, and the new error r − decode(code)·scale; as
// braid-compress's `ErrorFeedback::step` with the `Mx` codec (clip_scale is what it computes from the
// gradient's norm). Codes of E2M1 go two a byte, the first in the low nibble.
struct EfArgs {
  const float* grad;
  float* error;
  unsigned char* scales;
  unsigned char* codes;
  unsigned long long n;
  float clip_scale;
  float decay;
};

// The receiving side: out += decode(code)·scale for every element.
struct AccArgs {
  const unsigned char* scales;
  const unsigned char* codes;
  float* out;
  unsigned long long n;
};

// The code of element `i` among `codes`.
template <int F>
BRAID_HD unsigned int code_at(const unsigned char* codes, unsigned long long i) {
  if (Format<F>::BITS == 8) return codes[i];
  return (codes[i / 2] >> (4 * (unsigned int)(i & 1))) & 0xfu;
}

}  // namespace mx
}  // namespace braid

#endif  // BRAID_MX_CUH
