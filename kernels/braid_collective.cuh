// Device-resident all-reduce: one launch runs a whole collective, with no host thread on the data path.
//
// Every rank owns a *window* of device memory that every other rank of the host maps (CUDA IPC); the
// kernel receives every rank's window as mapped in its own process. A window holds (offsets in
// `braid::Window`):
// - flags: one 32-bit word per (block, peer), each on its own 128-byte line, written by that peer with
//   release semantics at system scope and polled by the owner with acquire semantics;
// - descriptors: what each block of the owner's current collective is (count, dtype and op, mode,
//   buffers), two per block by iteration parity, read by peers after the first barrier so that ranks
//   that called different collectives fail with an error instead of reducing garbage;
// - state: per block, the barrier epoch and the iteration counter, advanced by the kernel itself (the
//   host passes no per-call counter, so a collective captured in a CUDA graph replays correctly), and
//   a failure word;
// - staging: two halves of `stage_bytes`, alternating by iteration;
// - heap: buffers allocated symmetrically on every rank (same offset everywhere), which peers read and
//   write directly.
//
// Blocks are channels: block b of every rank works on the same part of every slice and synchronises
// only with block b of the peers, so blocks proceed independently. A barrier is: every thread of the
// block done (`__syncthreads`), a system-scope fence and one release store per peer into the peer's
// flag for this rank, then one thread per peer polls this rank's flag for that peer with acquire loads
// until it reaches the epoch (compared modulo 2^32, so counters wrap), then `__syncthreads`.
//
// Modes (all ranks of a collective use the same one; the host picks it from the size):
// - STAGED_ONE_SHOT: copy this rank's input into its staging half, barrier, reduce every rank's staging
//   (in rank order) into the output. One barrier per iteration.
// - STAGED_TWO_SHOT: copy in, barrier, reduce slice `rank` of every staging into this rank's staging
//   (reduce-scatter), barrier, copy every rank's reduced slice into the output (all-gather).
// - SYMMETRIC: input and output in the heap at the same offsets on every rank: barrier, reduce slice
//   `rank` of every rank's input into this rank's output, barrier, copy every rank's reduced slice from
//   its output into this rank's output, barrier. No staging copy, no chunking.
// Staging halves alternate, and every iteration begins with a barrier after its copy-in, so a half is
// rewritten only after every peer has finished reading it two iterations earlier.
//
// Every element is reduced by exactly one rank, or by every rank in the same order (one-shot), in rank
// order with the arithmetic of braid_reduce.cuh: results are bit-identical on every rank.
//
// Waits end on the abort word (host memory mapped for the device, set by the host), on another block's
// failure, and on a deadline read from the global timer; the failure (code, peer, block) goes to the
// status words (host memory mapped for the device) and the kernel returns. Nothing traps.
//
// The body compiles under nvcc and NVRTC and, for the host tests, under a C++ compiler with
// crates/braid-cuda/tests/host/simt.hpp, where the atomics are the compiler's (ThreadSanitizer sees them).
#ifndef BRAID_COLLECTIVE_CUH
#define BRAID_COLLECTIVE_CUH

#include "braid_reduce_copy.cuh"

#if !defined(__CUDACC_RTC__)
#include <sched.h>
#include <time.h>
#endif

// Device code only (it calls __syncthreads and atomics); for the host tests, plain inline functions.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define BRAID_D __device__ __forceinline__
#else
#define BRAID_D inline
#endif

namespace braid {

// The window's layout; crates/braid-cuda/src/resident.rs has the same numbers (checked by its tests).
enum {
  AR_MAX_RANKS = 8,
  AR_MAX_BLOCKS = 64,
  AR_LINE = 128,
  AR_FLAGS_OFF = 0,                                                // flags[block][peer], a line each
  AR_DESC_OFF = AR_FLAGS_OFF + AR_MAX_BLOCKS * AR_MAX_RANKS * AR_LINE,  // desc[block][parity], 64 B each
  AR_DESC_BYTES = 64,
  AR_STATE_OFF = AR_DESC_OFF + AR_MAX_BLOCKS * 2 * AR_DESC_BYTES,    // state[block], a line each
  AR_STAGE_OFF = AR_STATE_OFF + AR_MAX_BLOCKS * AR_LINE,              // then two staging halves, then the heap
};

enum { AR_STAGED_ONE_SHOT = 0, AR_STAGED_TWO_SHOT = 1, AR_SYMMETRIC = 2 };

// Failure codes in the status words.
enum { AR_OK = 0, AR_TIMEOUT = 1, AR_ABORTED = 2, AR_MISMATCH = 3, AR_PEER_FAILED = 4, AR_BAD_LAUNCH = 5 };

// The kernel's argument, passed by value; crates/braid-cuda/src/resident.rs lays out `ArArgs` the same.
struct ArArgs {
  unsigned long long window[AR_MAX_RANKS];  // every rank's window, as mapped in this process
  unsigned long long send;                  // staged: device address; symmetric: heap offset
  unsigned long long recv;                  // likewise
  unsigned long long count;                 // elements
  unsigned long long stage_bytes;           // bytes of one staging half (a multiple of 16)
  unsigned long long heap_off;              // where the heap starts in a window
  unsigned long long timeout_ns;            // how long a wait may last
  unsigned long long abort_word;            // device address of the abort word (0: none)
  unsigned long long status;                // device address of 4 status words: code, peer, block, epoch
  unsigned int rank;
  unsigned int world;
  unsigned int mode;
  unsigned int tag;                         // dtype and op, as the host encodes them (descriptor check)
};

// A block's state in its own window (one line).
struct ArState {
  unsigned int epoch;  // the last barrier epoch this block completed
  unsigned int iter;   // iterations completed (staging parity)
  unsigned int fail;   // nonzero once a wait of this block failed in the current launch, or the launch
                       // found a failure already recorded
  unsigned int pad;
};

// What a block's collective is, published for the peers.
struct ArDesc {
  unsigned long long count, send, recv;
  unsigned int tag, mode, world, epoch;
  unsigned long long pad[2];
};

BRAID_D unsigned int ld_acquire_sys(const unsigned int* p) {
#ifdef __CUDA_ARCH__
  unsigned int v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

BRAID_D unsigned int ld_relaxed_sys(const unsigned int* p) {
#ifdef __CUDA_ARCH__
  unsigned int v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

BRAID_D void st_release_sys(unsigned int* p, unsigned int v) {
#ifdef __CUDA_ARCH__
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

BRAID_D void st_relaxed_sys(unsigned int* p, unsigned int v) {
#ifdef __CUDA_ARCH__
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
#endif
}

BRAID_D void fence_sys() {
#ifdef __CUDA_ARCH__
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#else
  __threadfence();  // the SIMT runner's fence, which ThreadSanitizer understands
#endif
}

// Nanoseconds of a clock every block of the device shares.
BRAID_D unsigned long long now_ns() {
#ifdef __CUDA_ARCH__
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
#endif
}

BRAID_D void pause_briefly() {
#ifdef __CUDA_ARCH__
  __nanosleep(64);
#else
  sched_yield();
#endif
}

// Whether `value` has reached `target`, modulo 2^32.
BRAID_D bool reached(unsigned int value, unsigned int target) { return (int)(value - target) >= 0; }

BRAID_D unsigned int* ar_flag(unsigned long long window, unsigned int block, unsigned int peer) {
  return (unsigned int*)(window + AR_FLAGS_OFF + ((unsigned long long)block * AR_MAX_RANKS + peer) * AR_LINE);
}

BRAID_D ArDesc* ar_desc(unsigned long long window, unsigned int block, unsigned int parity) {
  return (ArDesc*)(window + AR_DESC_OFF + ((unsigned long long)block * 2 + parity) * AR_DESC_BYTES);
}

BRAID_D ArState* ar_state(unsigned long long window, unsigned int block) {
  return (ArState*)(window + AR_STATE_OFF + (unsigned long long)block * AR_LINE);
}

// Records the first failure of the launch in the status words, and this block's in its state.
BRAID_D void ar_fail(const ArArgs& a, ArState* st, unsigned int code, unsigned int peer, unsigned int epoch) {
  unsigned int* status = (unsigned int*)a.status;
  if (status && atomicCAS(status, 0u, code) == 0u) {
    status[1] = peer;
    status[2] = blockIdx.x;
    status[3] = epoch;
    fence_sys();
  }
  atomicExch(&st->fail, 1u);
}

// [lo, hi) of part i of n equal parts of len elements, each part a multiple of `align` elements.
BRAID_D void ar_split(unsigned long long len, unsigned int n, unsigned int i, unsigned long long align,
                       unsigned long long* lo, unsigned long long* hi) {
  unsigned long long per = (len + n - 1) / n;
  per = (per + align - 1) / align * align;
  unsigned long long l = per * i;
  *lo = l < len ? l : len;
  *hi = l + per < len ? l + per : len;
}

// [lo, hi) of part b (of nb) of slice q (of n) of a chunk of `len` elements, with the parts laid out
// over `span` elements (span >= len) and clipped to len. Within one launch every chunk of a staged
// collective but the last is full and the last is laid out like the full ones, so a block touches the
// same staging bytes in every iteration: blocks advance independently, and a block's staging writes must
// never land where another block of a slower peer may still be reading two iterations back.
BRAID_D void ar_part(unsigned long long len, unsigned long long span, unsigned int n, unsigned int q,
                      unsigned int nb, unsigned int b, unsigned long long align, unsigned long long* lo,
                      unsigned long long* hi) {
  unsigned long long slo, shi, plo, phi;
  ar_split(span, n, q, align, &slo, &shi);
  ar_split(shi - slo, nb, b, align, &plo, &phi);
  *lo = slo + plo < len ? slo + plo : len;
  *hi = slo + phi < len ? slo + phi : len;
}

// Copies n bytes; thread t of nt. 16-byte vectors where source and destination share an alignment.
BRAID_D void ar_copy(unsigned char* dst, const unsigned char* src, unsigned long long n, unsigned long long t,
                      unsigned long long nt) {
  if (((unsigned long long)dst ^ (unsigned long long)src) % 16u) {
    for (unsigned long long i = t; i < n; i += nt) dst[i] = src[i];
    return;
  }
  unsigned long long head = (16u - (unsigned long long)src % 16u) % 16u;
  if (head > n) head = n;
  for (unsigned long long i = t; i < head; i += nt) dst[i] = src[i];
  const unsigned long long vecs = (n - head) / 16;
  const unsigned char* s = src + head;
  unsigned char* d = dst + head;
  unsigned long long v = t;
  for (; v + 3 * nt < vecs; v += 4 * nt) {
    unsigned int w[4][4];
#pragma unroll
    for (int u = 0; u < 4; u++) ld16(s + 16 * (v + u * nt), w[u]);
#pragma unroll
    for (int u = 0; u < 4; u++) st16(d + 16 * (v + u * nt), w[u]);
  }
  for (; v < vecs; v += nt) {
    unsigned int w[4];
    ld16(s + 16 * v, w);
    st16(d + 16 * v, w);
  }
  for (unsigned long long i = head + vecs * 16 + t; i < n; i += nt) dst[i] = src[i];
}

template <class T, int OP, int W>
struct AllReduce {
  enum { ALIGN = 16 / (int)sizeof(T) };  // elements per 16 bytes: slices start 16-byte aligned

  // dst[0, n) = reduce over the W ranks (in rank order) of src[r][0, n); every thread of the block calls.
  static BRAID_D void reduce(const unsigned char* const (&src)[W], unsigned char* dst,
                             unsigned long long n) {
    if (n == 0) return;
    RcArgs rc;
#pragma unroll
    for (int i = 0; i < RC_MAX_SRCS; i++) rc.src[i] = i < W ? src[i < W ? i : 0] : 0;
    rc.dst[0] = dst;
    rc.dst[1] = 0;
    rc.count = n;
    rc.nranks = W;
    ReduceCopy<T, OP, W, 0u, 1, 0u>::run(rc, threadIdx.x, blockDim.x);
  }

  // One barrier with block `blockIdx.x` of every peer at `epoch`; false (in every thread) on failure.
  static BRAID_D bool barrier(const ArArgs& a, ArState* st, unsigned int epoch, unsigned long long deadline) {
    const unsigned int b = blockIdx.x, t = threadIdx.x;
    __syncthreads();
    if (t < (unsigned int)W && t != a.rank) {
      fence_sys();
      st_release_sys(ar_flag(a.window[t], b, a.rank), epoch);
      const unsigned int* mine = ar_flag(a.window[a.rank], b, t);
      const unsigned int* abort_word = (const unsigned int*)a.abort_word;
      const unsigned int* status = (const unsigned int*)a.status;
      unsigned int spins = 0;
      while (!reached(ld_acquire_sys(mine), epoch)) {
        if (++spins % 64u) continue;
        if (abort_word && ld_relaxed_sys(abort_word)) {
          ar_fail(a, st, AR_ABORTED, t, epoch);
          break;
        }
        if (ld_relaxed_sys(&st->fail) || (status && ld_relaxed_sys(status))) {
          ar_fail(a, st, AR_PEER_FAILED, t, epoch);
          break;
        }
        if (now_ns() > deadline) {
          ar_fail(a, st, AR_TIMEOUT, t, epoch);
          break;
        }
        if (spins > 4096u) pause_briefly();
      }
    }
    __syncthreads();
    return ld_relaxed_sys(&st->fail) == 0;
  }

  // Block b's descriptor for this collective, published before its first barrier.
  static BRAID_D void publish(const ArArgs& a, unsigned int parity, unsigned int epoch) {
    if (threadIdx.x != 0) return;
    ArDesc* d = ar_desc(a.window[a.rank], blockIdx.x, parity);
    d->count = a.count;
    d->send = a.mode == AR_SYMMETRIC ? a.send : 0;
    d->recv = a.mode == AR_SYMMETRIC ? a.recv : 0;
    d->tag = a.tag;
    d->mode = a.mode;
    d->world = a.world;
    d->epoch = epoch;
  }

  // After the first barrier: every peer's descriptor matches this rank's; false (in every thread) if not.
  static BRAID_D bool check(const ArArgs& a, ArState* st, unsigned int parity, unsigned int epoch) {
    __syncthreads();  // every thread has read the barrier's outcome before a mismatch changes it
    if (threadIdx.x < (unsigned int)W && threadIdx.x != a.rank) {
      const ArDesc* mine = ar_desc(a.window[a.rank], blockIdx.x, parity);
      const ArDesc* theirs = ar_desc(a.window[threadIdx.x], blockIdx.x, parity);
      if (theirs->count != mine->count || theirs->send != mine->send || theirs->recv != mine->recv ||
          theirs->tag != mine->tag || theirs->mode != mine->mode || theirs->world != mine->world ||
          theirs->epoch != mine->epoch)
        ar_fail(a, st, AR_MISMATCH, threadIdx.x, epoch);
    }
    __syncthreads();
    return ld_relaxed_sys(&st->fail) == 0;
  }

  static BRAID_D void run(const ArArgs& a) {
    const unsigned int b = blockIdx.x, nb = gridDim.x;
    const unsigned long long t = threadIdx.x, nt = blockDim.x;
    const unsigned int R = a.rank;
    // A launch the barriers cannot serve (fewer threads than ranks, another world size) or a staging
    // half smaller than an element fails loudly rather than computing nothing.
    if (blockDim.x < (unsigned int)W || a.world != (unsigned int)W || R >= (unsigned int)W ||
        (a.mode != AR_SYMMETRIC && a.stage_bytes < 16)) {
      unsigned int* status = (unsigned int*)a.status;
      if (t == 0 && status && atomicCAS(status, 0u, (unsigned int)AR_BAD_LAUNCH) == 0u) {
        status[1] = R;
        status[2] = b;
      }
      return;
    }
    ArState* st = ar_state(a.window[R], b);
    // Every thread reads the state before thread 0 may change it below.
    unsigned int epoch = st->epoch, iter = st->iter;
    // After a failure the ranks' epochs disagree: a later launch returns at once, signalling nothing
    // (a barrier whose flag happens to be reached would not notice the failure otherwise). Thread 0
    // alone reads the status and every thread acts on what it read: the status may be set by another
    // block while this one starts, and threads deciding apart would leave a barrier with some of its
    // waiters gone (passing it without a peer).
    if (t == 0) st_relaxed_sys(&st->fail, a.status && ld_relaxed_sys((const unsigned int*)a.status) ? 1u : 0u);
    __syncthreads();
    if (ld_relaxed_sys(&st->fail)) return;
    const unsigned long long deadline = now_ns() + a.timeout_ns;
    const unsigned long long sz = sizeof(T);

    if (a.mode == AR_SYMMETRIC) {
      const unsigned int parity = iter & 1u;
      publish(a, parity, epoch + 1);
      if (!barrier(a, st, ++epoch, deadline) || !check(a, st, parity, epoch)) return;
      const unsigned char* in[W];
#pragma unroll
      for (int r = 0; r < W; r++) in[r] = (const unsigned char*)(a.window[r] + a.heap_off + a.send);
      unsigned char* out_r = (unsigned char*)(a.window[R] + a.heap_off + a.recv);
      // Reduce-scatter: this rank's slice, this block's part, from every rank's input.
      unsigned long long lo, hi;
      ar_part(a.count, a.count, W, R, nb, b, ALIGN, &lo, &hi);
      {
        const unsigned char* src[W];
#pragma unroll
        for (int r = 0; r < W; r++) src[r] = in[r] + lo * sz;
        reduce(src, out_r + lo * sz, hi - lo);
      }
      if (!barrier(a, st, ++epoch, deadline)) return;
      // All-gather: every other rank's reduced slice, this block's part, from its output.
#pragma unroll
      for (int q = 0; q < W; q++) {
        if (q == (int)R) continue;
        ar_part(a.count, a.count, W, q, nb, b, ALIGN, &lo, &hi);
        const unsigned char* out_q = (const unsigned char*)(a.window[q] + a.heap_off + a.recv);
        ar_copy(out_r + lo * sz, out_q + lo * sz, (hi - lo) * sz, t, nt);
      }
      if (!barrier(a, st, ++epoch, deadline)) return;
      iter++;
    } else {
      const unsigned long long chunk = a.stage_bytes / sz;
      bool first = true;
      for (unsigned long long base = 0; base < a.count || first; base += chunk) {
        const unsigned long long len = a.count - base < chunk ? a.count - base : chunk;
        const unsigned long long span = a.count > chunk ? chunk : len;
        const unsigned int parity = iter & 1u;
        unsigned char* stage[W];
#pragma unroll
        for (int r = 0; r < W; r++)
          stage[r] = (unsigned char*)(a.window[r] + AR_STAGE_OFF + parity * a.stage_bytes);
        const unsigned char* in = (const unsigned char*)a.send + base * sz;
        unsigned char* out = (unsigned char*)a.recv + base * sz;
        if (first) publish(a, parity, epoch + 1);
        unsigned long long lo, hi;
        if (a.mode == AR_STAGED_ONE_SHOT) {
          ar_part(len, span, 1, 0, nb, b, ALIGN, &lo, &hi);
          ar_copy(stage[R] + lo * sz, in + lo * sz, (hi - lo) * sz, t, nt);
          if (!barrier(a, st, ++epoch, deadline)) return;
          if (first && !check(a, st, parity, epoch)) return;
          const unsigned char* src[W];
#pragma unroll
          for (int r = 0; r < W; r++) src[r] = stage[r] + lo * sz;
          reduce(src, out + lo * sz, hi - lo);
        } else {
#pragma unroll
          for (int q = 0; q < W; q++) {
            ar_part(len, span, W, q, nb, b, ALIGN, &lo, &hi);
            ar_copy(stage[R] + lo * sz, in + lo * sz, (hi - lo) * sz, t, nt);
          }
          if (!barrier(a, st, ++epoch, deadline)) return;
          if (first && !check(a, st, parity, epoch)) return;
          ar_part(len, span, W, R, nb, b, ALIGN, &lo, &hi);
          const unsigned char* src[W];
#pragma unroll
          for (int r = 0; r < W; r++) src[r] = stage[r] + lo * sz;
          reduce(src, stage[R] + lo * sz, hi - lo);
          if (!barrier(a, st, ++epoch, deadline)) return;
#pragma unroll
          for (int q = 0; q < W; q++) {
            ar_part(len, span, W, q, nb, b, ALIGN, &lo, &hi);
            ar_copy(out + lo * sz, stage[q] + lo * sz, (hi - lo) * sz, t, nt);
          }
        }
        iter++;
        first = false;
        if (len == 0) break;
      }
    }
    __syncthreads();
    if (t == 0) {
      st->epoch = epoch;
      st->iter = iter;
    }
  }
};

}  // namespace braid

// The all-reduce entry points, named braid_ar_<dtype>_<op>_w<world>: BRAID_AR_KERNEL(dt, T, on, OP, W)
// defines one. The world size is a template argument so that every per-rank array is unrolled into
// registers (a run-time index would put them in local memory); a communicator compiles the one it needs.
#define BRAID_AR_THREADS 512
#define BRAID_AR_KERNEL(dt, T, on, OP, W)                                                       \
  extern "C" __global__ void __launch_bounds__(BRAID_AR_THREADS)                                \
      braid_ar_##dt##_##on##_w##W(braid::ArArgs a) {                                            \
    braid::AllReduce<T, OP, W>::run(a);                                                         \
  }

#endif  // BRAID_COLLECTIVE_CUH
