// The MX kernels as `extern "C"` entry points, one per element format: the fused error-feedback
// compression step (`braid_mx_ef_*`) and the receiving side's decode-and-accumulate
// (`braid_mx_acc_*`). Blocks of 256 threads (8 warps, a block of 32 elements each per pass); any grid
// covers any count.
#include "braid_mx.cuh"

#define BRAID_MX_THREADS 256

namespace braid {
namespace mx {

// One warp per block of 32 elements, lane = element, warps striding over the blocks: every lane of a
// warp takes part in every shuffle (lanes past the end hold zero and write nothing).
template <int F>
__device__ __forceinline__ void ef_step(const EfArgs& a, unsigned long long warp, unsigned long long warps,
                                        unsigned int lane) {
  const unsigned long long blocks = (a.n + BLOCK - 1) / BLOCK;
  for (unsigned long long b = warp; b < blocks; b += warps) {
    const unsigned long long i = b * BLOCK + lane;
    const bool live = i < a.n;
    float r = 0.0f;
    if (live) {
      float g = a.grad[i];
      if (a.clip_scale != 1.0f) g = mul_rn(g, a.clip_scale);
      r = a.decay == 0.0f ? g : add_rn(g, mul_rn(a.decay, a.error[i]));
    }
    float key = live ? amax_key(r) : 0.0f;
    for (int off = 16; off > 0; off >>= 1) key = amax_join(key, __shfl_xor_sync(0xffffffffu, key, off));
    const unsigned int scale = scale_code<F>(key);
    const unsigned int code =
        scale == SCALE_NAN ? 0u : encode<F>(mul_rn(r, pow2((int)SCALE_BIAS - (int)scale)));
    const unsigned int next = __shfl_down_sync(0xffffffffu, code, 1);
    if (live) a.error[i] = sub_rn(r, mul_rn(decode<F>(code), scale_value(scale)));
    if (lane == 0) a.scales[b] = (unsigned char)scale;
    if (Format<F>::BITS == 8) {
      if (live) a.codes[i] = (unsigned char)code;
    } else if (live && (lane & 1) == 0) {
      a.codes[i / 2] = (unsigned char)(code | ((i + 1 < a.n ? next : 0u) << 4));
    }
  }
}

template <int F>
__device__ __forceinline__ void accumulate(const AccArgs& a, unsigned long long t, unsigned long long threads) {
  for (unsigned long long i = t; i < a.n; i += threads) {
    a.out[i] = add_rn(a.out[i], mul_rn(decode<F>(code_at<F>(a.codes, i)), scale_value(a.scales[i / BLOCK])));
  }
}

}  // namespace mx
}  // namespace braid

#define BRAID_MX_KERNELS(name, F)                                                                            \
  extern "C" __global__ void __launch_bounds__(BRAID_MX_THREADS) braid_mx_ef_##name(braid::mx::EfArgs a) {   \
    const unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;                  \
    braid::mx::ef_step<F>(a, t / 32, (unsigned long long)gridDim.x * blockDim.x / 32, threadIdx.x % 32);     \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(BRAID_MX_THREADS) braid_mx_acc_##name(braid::mx::AccArgs a) { \
    braid::mx::accumulate<F>(a, (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x,                   \
                             (unsigned long long)gridDim.x * blockDim.x);                                    \
  }

BRAID_MX_KERNELS(e4m3, braid::mx::E4M3)
BRAID_MX_KERNELS(e5m2, braid::mx::E5M2)
BRAID_MX_KERNELS(e2m1, braid::mx::E2M1)
