// The int8 compression kernel: one fused pass of error feedback and int8 quantisation with a scale per
// block of any size, `braid_int8_ef`. One thread block per quantisation block (striding over them); its
// threads compute the residual (kept in the error buffer, as the CPU does), reduce the block's largest
// magnitude through shared memory, and quantise. Blocks of up to 256 threads, any count.
#include "braid_int8.cuh"

#define BRAID_INT8_THREADS 256

extern "C" __global__ void __launch_bounds__(BRAID_INT8_THREADS) braid_int8_ef(braid::int8::EfArgs a) {
  using namespace braid::int8;
  __shared__ unsigned int red[BRAID_INT8_THREADS];
  const unsigned long long block = a.block;
  const unsigned long long nblocks = (a.n + block - 1) / block;
  const unsigned int t = threadIdx.x, threads = blockDim.x;
  for (unsigned long long b = blockIdx.x; b < nblocks; b += gridDim.x) {
    const unsigned long long first = b * block;
    const unsigned long long end = first + block < a.n ? first + block : a.n;
    unsigned int key = 0;
    for (unsigned long long i = first + t; i < end; i += threads) {
      float g = a.grad[i];
      if (a.clip_scale != 1.0f) g = mul_rn(g, a.clip_scale);
      const float r = a.decay == 0.0f ? g : add_rn(g, mul_rn(a.decay, a.error[i]));
      a.error[i] = r;
      const unsigned int k = braid::f32_to_bits(r) & 0x7fffffffu;
      key = k > key ? k : key;
    }
    red[t] = key;
    __syncthreads();
    // Halving with the odd one carried, so any thread count up to BRAID_INT8_THREADS works.
    for (unsigned int live = threads; live > 1;) {
      const unsigned int s = (live + 1) / 2;
      if (t + s < live && red[t + s] > red[t]) red[t] = red[t + s];
      __syncthreads();
      live = s;
    }
    const float scale = div_rn(braid::bits_to_f32(red[0]), 127.0f);
    if (t == 0) a.scales[b] = scale;
    for (unsigned long long i = first + t; i < end; i += threads) {
      const float r = a.error[i];
      int q = 0;
      if (scale != 0.0f) {
        const float v = div_rn(r, scale);
        if (a.stochastic) {
          const float fl = floor_small(v);
          const bool up = unit_at(a.rng_base, i) < sub_rn(v, fl);
          q = clamp_i8(add_rn(fl, up ? 1.0f : 0.0f));
        } else {
          q = round_half_away(v);
        }
      }
      a.quants[i] = (signed char)q;
      a.error[i] = sub_rn(r, mul_rn((float)q, scale));
    }
    // Every thread has read red[0] before the next block's reduction writes it.
    __syncthreads();
  }
}
