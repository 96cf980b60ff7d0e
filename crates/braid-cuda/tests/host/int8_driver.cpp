// Runs the int8 kernel of int8.cu, the real `__global__` entry point, on the SIMT runner (one CPU
// thread per CUDA thread, built with ThreadSanitizer), for the tests in ../int8.rs.
//
// Requests on stdin, replies on stdout, little-endian, until end of input:
//   request: u32 blocks, u32 threads per block, u64 n, u32 block, u32 stochastic, u64 rng_base,
//            f32 clip_scale, f32 decay, n × f32 gradient, n × f32 error
//   reply:   u32 status (0 ok, 1 bad request), then ceil(n/block) × f32 scales, n × i8 quants,
//            n × f32 error
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "simt.hpp"
// The kernel exactly as NVRTC compiles it.
#include "int8.cu"

static bool rd(void* p, size_t n) { return n == 0 || fread(p, 1, n, stdin) == n; }
static void w(const void* p, size_t n) {
  if (n && fwrite(p, 1, n, stdout) != n) exit(4);
}

int main() {
  for (;;) {
    unsigned int blocks = 0, threads = 0, block = 0, stochastic = 0;
    unsigned long long n = 0, base = 0;
    float clip = 0, decay = 0;
    if (!rd(&blocks, 4)) return 0;
    if (!rd(&threads, 4) || !rd(&n, 8) || !rd(&block, 4) || !rd(&stochastic, 4) || !rd(&base, 8) ||
        !rd(&clip, 4) || !rd(&decay, 4))
      return 3;
    std::vector<float> grad(n), error(n);
    if (!rd(grad.data(), 4 * n) || !rd(error.data(), 4 * n)) return 3;
    const unsigned long long nscales = block ? (n + block - 1) / block : 0;
    std::vector<float> scales(nscales);
    std::vector<signed char> quants(n);
    memset(scales.data(), 0xa5, 4 * nscales);
    memset(quants.data(), 0x5a, n);
    const unsigned int status = blocks == 0 || threads == 0 || threads > BRAID_INT8_THREADS || block == 0 ? 1u : 0u;
    if (status == 0) {
      braid::int8::EfArgs args = {grad.data(), error.data(), scales.data(), quants.data(), n, base,
                                  block,       stochastic,   clip,          decay};
      // The kernel has a `__shared__` array, which the runner keeps once per program: blocks in turn.
      simt::launch(simt::Blocks::InTurn, dim3(blocks), dim3(threads), &braid_int8_ef, args);
    }
    w(&status, 4);
    if (status == 0) {
      w(scales.data(), 4 * nscales);
      w(quants.data(), n);
      w(error.data(), 4 * n);
    }
    fflush(stdout);
  }
}
