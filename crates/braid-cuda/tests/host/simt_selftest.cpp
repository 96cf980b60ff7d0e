// The SIMT runner's own tests (run by ../simt.rs under ThreadSanitizer). `simt_selftest check` runs
// kernels that use every feature of simt.hpp and prints "ok <name>" for each whose result is right;
// the other modes run a kernel that is wrong on purpose, so the test can see that the runner (or
// ThreadSanitizer) says so: `race` (unsynchronised writes), `divergent-barrier` (a `__syncthreads` some
// threads never reach), `partial-mask` (a shuffle without every live lane).
#include "simt.hpp"

#include <stdio.h>
#include <string.h>

#include <vector>

enum { THREADS = 96 };  // three warps per block

// A block's sum through shared memory: the classic halving tree, a barrier between levels.
__global__ void block_sum(const int* in, int* out, int n) {
  __shared__ int part[128];
  const unsigned int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
  part[t] = i < (unsigned int)n ? in[i] : 0;
  if (t < 128 - blockDim.x) part[blockDim.x + t] = 0;
  __syncthreads();
  for (unsigned int s = 64; s > 0; s >>= 1) {
    if (t < s) part[t] += part[t + s];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = part[0];
}

// Shuffles: a butterfly sum, a down-sweep sum, an inclusive scan by shfl_up, a broadcast, groups of 8.
__global__ void shuffles(int* out) {
  const unsigned int t = threadIdx.x, lane = t % warpSize;
  int v = (int)t + 1;
  int x = v;
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  int d = v;
  for (unsigned int o = 16; o > 0; o >>= 1) d += __shfl_down_sync(0xffffffffu, d, o);
  int s = v;
  for (unsigned int o = 1; o < 32; o <<= 1) {
    int up = __shfl_up_sync(0xffffffffu, s, o);
    if (lane >= o) s += up;
  }
  const int b = __shfl_sync(0xffffffffu, v * 10, 3);
  const int g = __shfl_sync(0xffffffffu, v, 5, 8);           // lane 5 of each group of 8
  const double f = __shfl_xor_sync(0xffffffffu, v * 0.5, 1);  // 8-byte values move whole
  out[6 * t + 0] = x;
  out[6 * t + 1] = d;
  out[6 * t + 2] = s;
  out[6 * t + 3] = b;
  out[6 * t + 4] = g;
  out[6 * t + 5] = (int)(f * 2);
}

__global__ void votes(unsigned int* out) {
  const unsigned int t = threadIdx.x, lane = t % warpSize;
  out[4 * t + 0] = __ballot_sync(0xffffffffu, lane % 3 == 0);
  out[4 * t + 1] = __any_sync(0xffffffffu, t == 40);
  out[4 * t + 2] = __all_sync(0xffffffffu, lane < 31);
  out[4 * t + 3] = __all_sync(0xffffffffu, 1);
}

// Threads past `n` return at once; the rest meet at barriers and shuffle in a partly empty warp.
__global__ void early_exit(int* out, int n) {
  const unsigned int t = threadIdx.x;
  if (t >= (unsigned int)n) return;
  __syncthreads();
  const unsigned int live = __activemask();
  const int sum = __shfl_xor_sync(live, 1, 1) + __shfl_down_sync(live, (int)t, 1);
  __syncthreads();
  out[t] = sum;
}

__global__ void atomics(unsigned long long* count, int* hi, float* fsum) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(count, 1ull);
  atomicMax(hi, (int)i);
  atomicAdd(fsum, 0.5f);
  __threadfence();
}

__global__ void indices(unsigned int* out) {
  const unsigned int flat = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  out[b * blockDim.x * blockDim.y * blockDim.z + flat] = b * 1000 + flat;
}

__global__ void race(int* out) { out[0] = (int)threadIdx.x; }

__global__ void divergent_barrier(int* out) {
  if (threadIdx.x == 0) __syncthreads();
  out[threadIdx.x] = 1;
  __syncwarp();
}

__global__ void partial_mask(int* out) { out[threadIdx.x] = __shfl_sync(0x0000ffffu, (int)threadIdx.x, 0); }

static int failures = 0;
static void expect(bool ok, const char* name) {
  printf("%s %s\n", ok ? "ok" : "FAILED", name);
  if (!ok) failures++;
}

static void check() {
  {
    const int n = 1000, blocks = (n + THREADS - 1) / THREADS;
    std::vector<int> in(n), out(blocks, -1);
    for (int i = 0; i < n; i++) in[i] = i * 7 - 3000;
    simt::launch(simt::Blocks::InTurn, dim3(blocks), dim3(THREADS), block_sum, in.data(), out.data(), n);
    bool ok = true;
    for (int b = 0; b < blocks; b++) {
      int want = 0;
      for (int i = b * THREADS; i < n && i < (b + 1) * THREADS; i++) want += in[i];
      ok = ok && out[b] == want;
    }
    expect(ok, "shared-memory block sum with __syncthreads");
  }
  {
    std::vector<int> out(6 * THREADS, -1);
    simt::launch(dim3(1), dim3(THREADS), shuffles, out.data());
    bool xor_ok = true, down_ok = true, scan_ok = true, bcast_ok = true, group_ok = true, wide_ok = true;
    for (int t = 0; t < THREADS; t++) {
      const int w = t / 32, lane = t % 32, first = 32 * w + 1;
      const int warp_sum = 32 * first + 31 * 32 / 2;
      xor_ok = xor_ok && out[6 * t] == warp_sum;
      if (lane == 0) down_ok = down_ok && out[6 * t + 1] == warp_sum;
      scan_ok = scan_ok && out[6 * t + 2] == (lane + 1) * first + lane * (lane + 1) / 2;
      bcast_ok = bcast_ok && out[6 * t + 3] == (first + 3) * 10;
      group_ok = group_ok && out[6 * t + 4] == (t & ~7) + 5 + 1;
      wide_ok = wide_ok && out[6 * t + 5] == (t ^ 1) + 1;
    }
    expect(xor_ok, "__shfl_xor_sync butterfly sum");
    expect(down_ok, "__shfl_down_sync sum into lane 0");
    expect(scan_ok, "__shfl_up_sync inclusive scan");
    expect(bcast_ok, "__shfl_sync broadcast from lane 3");
    expect(group_ok, "__shfl_sync with width 8");
    expect(wide_ok, "__shfl_xor_sync of a double");
  }
  {
    std::vector<unsigned int> out(4 * THREADS, 7);
    simt::launch(dim3(1), dim3(THREADS), votes, out.data());
    bool ok = true;
    for (int t = 0; t < THREADS; t++) {
      ok = ok && out[4 * t] == 0x49249249u;  // lanes 0, 3, 6, ..., 30
      ok = ok && out[4 * t + 1] == (t / 32 == 1 ? 1u : 0u);
      ok = ok && out[4 * t + 2] == 0u && out[4 * t + 3] == 1u;
    }
    expect(ok, "__ballot_sync, __any_sync, __all_sync");
  }
  {
    const int n = 45;  // the second warp keeps 13 lanes
    std::vector<int> out(THREADS, -1);
    simt::launch(dim3(1), dim3(THREADS), early_exit, out.data(), n);
    bool ok = true;
    for (int t = 0; t < THREADS; t++) {
      const int lanes = t < 32 ? 32 : n - 32, lane = t % 32;
      const int below = lane + 1 < lanes ? t + 1 : t;
      ok = ok && out[t] == (t < n ? 1 + below : -1);
    }
    expect(ok, "returned threads count as arrived at barriers and leave their warp");
  }
  {
    unsigned long long count = 0;
    int hi = -1;
    float fsum = 0;
    simt::launch(dim3(5), dim3(THREADS), atomics, &count, &hi, &fsum);
    expect(count == 5 * THREADS && hi == 5 * THREADS - 1 && fsum == 0.5f * 5 * THREADS,
           "atomicAdd, atomicMax, float atomicAdd across blocks");
  }
  {
    const dim3 grid(2, 3, 2), block(4, 3, 5);
    const unsigned int total = 12 * 60;
    std::vector<unsigned int> out(total, ~0u);
    simt::launch(grid, block, indices, out.data());
    bool ok = true;
    for (unsigned int i = 0; i < total; i++) ok = ok && out[i] == (i / 60) * 1000 + i % 60;
    expect(ok, "threadIdx, blockIdx, blockDim, gridDim in three dimensions");
  }
  {
    // Far more threads than the concurrency budget: the blocks run in waves.
    std::vector<unsigned int> out(40 * 64, ~0u);
    simt::launch(dim3(40), dim3(64), indices, out.data());
    bool ok = true;
    for (unsigned int i = 0; i < out.size(); i++) ok = ok && out[i] == (i / 64) * 1000 + i % 64;
    expect(ok, "a grid larger than the thread budget");
  }
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "check";
  std::vector<int> out(THREADS, 0);
  if (!strcmp(mode, "check")) {
    check();
    return failures ? 1 : 0;
  } else if (!strcmp(mode, "race")) {
    simt::launch(dim3(1), dim3(THREADS), race, out.data());
  } else if (!strcmp(mode, "divergent-barrier")) {
    simt::launch(dim3(1), dim3(THREADS), divergent_barrier, out.data());
  } else if (!strcmp(mode, "partial-mask")) {
    simt::launch(dim3(1), dim3(THREADS), partial_mask, out.data());
  } else {
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
  }
  return 0;
}
