// Int8 with one f32 scale per block of `block` elements, on the device, exactly as braid-compress's
// `Int8` codec (nearest or stochastic rounding) and `ErrorFeedback` define it (the CPU implementation
// is the reference; the host tests compare the two bit for bit):
// - m is the block's largest magnitude, compared by the bit pattern with the sign cleared (so a NaN
//   makes it NaN), and scale = m / 127 (IEEE division);
// - scale 0: every value is 0; otherwise v = x / scale (IEEE division, not a reciprocal multiply) and
//   q = round half away from zero (nearest) or floor(v) + (u < v − floor(v)) with u the element's draw
//   of the stream (seed, tag 3, step) in [0, 1) (stochastic); then clamped to −127..127, a NaN to 0;
// - decoding is q · scale.
#ifndef BRAID_INT8_CUH
#define BRAID_INT8_CUH

#include "braid_mx.cuh"

namespace braid {
namespace int8 {

using mx::add_rn;
using mx::mul_rn;
using mx::sub_rn;

BRAID_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// SplitMix64's output function (braid-compress's `rng::mix`).
BRAID_HD unsigned long long mix(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

enum : unsigned long long { GAMMA = 0x9E3779B97F4A7C15ull };

// Draw `i` of the stream whose base is `base`, as a uniform float in [0, 1): the top 24 bits · 2^-24.
BRAID_HD float unit_at(unsigned long long base, unsigned long long i) {
  return (float)(mix(base + (i + 1) * GAMMA) >> 40) * (1.0f / 16777216.0f);
}

// round(v) half away from zero, clamped to −127..127, a NaN to 0 (braid-compress's `round_half_away`).
BRAID_HD int round_half_away(float v) {
  double d = (double)v;
  if (d != d) return 0;
  if (d < -127.0) d = -127.0;
  if (d > 127.0) d = 127.0;
  return (int)(d + (d < 0.0 ? -0.5 : 0.5));
}

// floor(v) for |v| <= 128 or NaN (braid-compress's `floor`).
BRAID_HD float floor_small(float v) {
  if (v != v) return v;
  float c = v < -256.0f ? -256.0f : v > 256.0f ? 256.0f : v;
  const float t = (float)(int)c;
  return t > v ? sub_rn(t, 1.0f) : t;
}

// Clamped to −127..127 and converted, a NaN to 0.
BRAID_HD int clamp_i8(float v) {
  if (v != v) return 0;
  return v < -127.0f ? -127 : v > 127.0f ? 127 : (int)v;
}

// The fused step's arguments: residual r = grad·clip_scale + decay·error (as the MX step), one scale per
// block into `scales`, one int8 per element into `quants`, the new error r − q·scale into `error`.
// `rng_base` is the stream's base, mix(mix(seed + 3·GAMMA) ^ step), when `stochastic` is 1.
struct EfArgs {
  const float* grad;
  float* error;
  float* scales;
  signed char* quants;
  unsigned long long n;
  unsigned long long rng_base;
  unsigned int block;
  unsigned int stochastic;
  float clip_scale;
  float decay;
};

}  // namespace int8
}  // namespace braid

#endif  // BRAID_INT8_CUH
