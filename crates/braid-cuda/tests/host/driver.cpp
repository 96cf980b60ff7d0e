// Runs the reduce-copy kernels on the host for the tests in ../host_semantics.rs, in one of two ways:
// - by default, the `__host__ __device__` body the kernels share, called thread by thread (built with
//   AddressSanitizer and UBSan): braid_reduce.cuh needs no CUDA header;
// - with -DBRAID_SIMT, the real `__global__` entry points of reduce_copy.cu, launched on the SIMT runner
//   (simt.hpp: one CPU thread per CUDA thread), built with ThreadSanitizer.
//
// Requests on stdin, replies on stdout, little-endian, until end of input:
//   request: u32 name length, name, u32 blocks, u32 threads per block, u64 count, u32 nranks, u32 sources, u32 destinations,
//            u32 aliased source (the source that is destination 0, or 0xffffffff),
//            per source: u32 misalignment, u64 length, bytes; per destination: u32 misalignment, u64 length
//   reply:   u32 status (0 ok, 1 unknown kernel, 2 wrong operand count, 3 no threads), per destination: u64 length, bytes
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#ifdef BRAID_SIMT
#include "simt.hpp"
// The kernels exactly as NVRTC compiles them.
#include "reduce_copy.cu"

typedef void (*Kernel)(braid::RcArgs);
struct Entry {
  const char* name;
  int ns, nd;
  Kernel kernel;
};

static void run(const Entry& e, const braid::RcArgs& a, unsigned int blocks, unsigned int threads) {
  simt::launch(dim3(blocks), dim3(threads), e.kernel, a);
}

#define E_OP(shape, dt, T, on, OP, NS, SACC, ND, DACC) \
  {"braid_rc_" #shape "_" #dt "_" #on, NS, ND, &braid_rc_##shape##_##dt##_##on},
#define E_FREE(shape, dt, T, NS, SACC, ND, DACC) {"braid_rc_" #shape "_" #dt, NS, ND, &braid_rc_##shape##_##dt},
#else
#include "braid_reduce_copy.cuh"

typedef void (*Body)(const braid::RcArgs&, unsigned long long, unsigned long long);
struct Entry {
  const char* name;
  int ns, nd;
  Body body;
};

// The grid's threads one after another, each as the kernel wrapper calls the body.
static void run(const Entry& e, const braid::RcArgs& a, unsigned int blocks, unsigned int threads) {
  const unsigned long long n = (unsigned long long)blocks * threads;
  for (unsigned long long t = 0; t < n; t++) e.body(a, t, n);
}

#define E_OP(shape, dt, T, on, OP, NS, SACC, ND, DACC) \
  {"braid_rc_" #shape "_" #dt "_" #on, NS, ND, &braid::ReduceCopy<T, OP, NS, SACC, ND, DACC>::run},
#define E_FREE(shape, dt, T, NS, SACC, ND, DACC) \
  {"braid_rc_" #shape "_" #dt, NS, ND, &braid::ReduceCopy<T, 0, NS, SACC, ND, DACC>::run},
#endif
#define E_PER_OP(dt, T, on, OP) BRAID_RC_FOR_SHAPES(E_OP, dt, T, on, OP)
#define E_PER_DTYPE(dt, T) BRAID_RC_FOR_OPS(E_PER_OP, dt, T) BRAID_RC_FOR_OP_FREE(E_FREE, dt, T)

static const Entry ENTRIES[] = {BRAID_RC_FOR_DTYPES(E_PER_DTYPE)};

static bool rd(void* p, size_t n) { return fread(p, 1, n, stdin) == n; }
static unsigned int u32() {
  unsigned int v = 0;
  if (!rd(&v, 4)) exit(0);
  return v;
}
static unsigned long long u64() {
  unsigned long long v = 0;
  if (!rd(&v, 8)) exit(3);
  return v;
}
static void w(const void* p, size_t n) {
  if (fwrite(p, 1, n, stdout) != n) exit(4);
}

int main() {
  for (;;) {
    unsigned int len = u32();
    std::string name(len, '\0');
    if (!rd(&name[0], len)) return 3;
    unsigned int blocks = u32(), threads = u32();
    unsigned long long count = u64();
    unsigned int nranks = u32(), ns = u32(), nd = u32(), alias = u32();
    // Each operand is its own allocation of exactly misalignment + length bytes, so a sanitizer sees
    // any access past either end; malloc's 16-byte alignment makes the misalignment the address's.
    std::vector<unsigned char*> srcs(ns), dsts(nd), owned;
    std::vector<unsigned long long> dlen(nd);
    braid::RcArgs a;
    memset(&a, 0, sizeof a);
    for (unsigned int i = 0; i < ns; i++) {
      unsigned int mis = u32();
      unsigned long long n = u64();
      srcs[i] = (unsigned char*)malloc(mis + n + 1);
      if (!rd(srcs[i] + mis, n)) return 3;
      if (i < braid::RC_MAX_SRCS) a.src[i] = srcs[i] + mis;
    }
    for (unsigned int j = 0; j < nd; j++) {
      unsigned int mis = u32();
      dlen[j] = u64();
      if (j == 0 && alias < ns) {
        dsts[j] = (unsigned char*)a.src[alias];
      } else {
        owned.push_back((unsigned char*)malloc(mis + dlen[j] + 1));
        dsts[j] = owned.back() + mis;
        memset(dsts[j], 0xa5, dlen[j]);
      }
      if (j < braid::RC_MAX_DSTS) a.dst[j] = dsts[j];
    }
    a.count = count;
    a.nranks = nranks;
    const Entry* e = 0;
    for (size_t k = 0; k < sizeof ENTRIES / sizeof ENTRIES[0]; k++)
      if (name == ENTRIES[k].name) e = &ENTRIES[k];
    unsigned int status = !e ? 1u : (e->ns != (int)ns || e->nd != (int)nd) ? 2u : blocks * threads == 0 ? 3u : 0u;
    if (status == 0) run(*e, a, blocks, threads);
    w(&status, 4);
    if (status == 0)
      for (unsigned int j = 0; j < nd; j++) {
        w(&dlen[j], 8);
        w(dsts[j], dlen[j]);
      }
    fflush(stdout);
    for (unsigned int i = 0; i < ns; i++) free(srcs[i]);
    for (size_t k = 0; k < owned.size(); k++) free(owned[k]);
  }
}
