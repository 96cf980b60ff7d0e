// Runs the MX kernels of mx.cu, the real `__global__` entry points, on the SIMT runner (one CPU thread
// per CUDA thread, built with ThreadSanitizer), for the tests in ../mx.rs.
//
// Requests on stdin, replies on stdout, little-endian, until end of input:
//   request: u32 format (0 E4M3, 1 E5M2, 2 E2M1), u32 kind (0 error-feedback step, 1 accumulate),
//            u32 blocks, u32 threads per block, u64 n, then
//            kind 0: f32 clip_scale, f32 decay, n × f32 gradient, n × f32 error;
//            kind 1: ceil(n/32) scale bytes, the code bytes, n × f32 out
//   reply:   u32 status (0 ok, 1 bad request), then
//            kind 0: the scale bytes, the code bytes, n × f32 error;
//            kind 1: n × f32 out
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "simt.hpp"
// The kernels exactly as NVRTC compiles them.
#include "mx.cu"

typedef void (*Ef)(braid::mx::EfArgs);
typedef void (*Acc)(braid::mx::AccArgs);
static const Ef EF[3] = {&braid_mx_ef_e4m3, &braid_mx_ef_e5m2, &braid_mx_ef_e2m1};
static const Acc ACC[3] = {&braid_mx_acc_e4m3, &braid_mx_acc_e5m2, &braid_mx_acc_e2m1};

static bool rd(void* p, size_t n) { return n == 0 || fread(p, 1, n, stdin) == n; }
static unsigned int u32() {
  unsigned int v = 0;
  if (!rd(&v, 4)) exit(0);
  return v;
}
static void w(const void* p, size_t n) {
  if (n && fwrite(p, 1, n, stdout) != n) exit(4);
}

int main() {
  for (;;) {
    const unsigned int format = u32(), kind = u32(), blocks = u32(), threads = u32();
    unsigned long long n = 0;
    if (!rd(&n, 8)) return 3;
    const unsigned long long nscales = (n + 31) / 32, ncodes = format == 2 ? (n + 1) / 2 : n;
    // Each buffer its own allocation of exactly its size, so a sanitizer sees any access past the end.
    std::vector<float> a(n), b(n);
    std::vector<unsigned char> scales(nscales), codes(ncodes);
    unsigned int status = format > 2 || kind > 1 || blocks * threads == 0 || threads % 32 != 0 ? 1u : 0u;
    if (kind == 0) {
      float clip = 0, decay = 0;
      if (!rd(&clip, 4) || !rd(&decay, 4) || !rd(a.data(), 4 * n) || !rd(b.data(), 4 * n)) return 3;
      memset(scales.data(), 0xa5, nscales);
      memset(codes.data(), 0xa5, ncodes);
      if (status == 0) {
        braid::mx::EfArgs args = {a.data(), b.data(), scales.data(), codes.data(), n, clip, decay};
        simt::launch(dim3(blocks), dim3(threads), EF[format], args);
      }
      w(&status, 4);
      if (status == 0) {
        w(scales.data(), nscales);
        w(codes.data(), ncodes);
        w(b.data(), 4 * n);
      }
    } else {
      if (!rd(scales.data(), nscales) || !rd(codes.data(), ncodes) || !rd(a.data(), 4 * n)) return 3;
      if (status == 0) {
        braid::mx::AccArgs args = {scales.data(), codes.data(), a.data(), n};
        simt::launch(dim3(blocks), dim3(threads), ACC[format], args);
      }
      w(&status, 4);
      if (status == 0) w(a.data(), 4 * n);
    }
    fflush(stdout);
  }
}
