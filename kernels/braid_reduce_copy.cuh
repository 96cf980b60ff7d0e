// The reduce-copy kernel family: N sources reduced, left to right, into M destinations in one pass.
//
// One template covers every step braid's executor hands an engine (see `Kernel` in
// crates/braid-exec/src/engine.rs): a source or destination is either in the stored type T or in the
// accumulator type A (f32 for f16/bf16, T otherwise), chosen per operand by a bit mask. A destination in A
// receives the raw partial (to be forwarded); one in T receives the finished value (avg divided once,
// rounded once). The fused ring step "received partial + local input -> reduce -> next peer's slot and
// local output" is the `finalize2` shape: sources (A partial, T input), destinations (T, T).
//
// Memory access: when one head length h makes every operand 16-byte aligned, the first h elements are
// done by scalar code, the body by 16-byte vector loads and stores (UNROLL packs per thread in flight),
// and the tail by scalar code. Operands that share no such h are done element by element (typed loads
// when element-aligned, byte loads otherwise), so any alignment is accepted.
//
// The body is `__host__ __device__` and takes the thread's index and the thread count, so the host tests
// run exactly this code, thread by thread.
#ifndef BRAID_REDUCE_COPY_CUH
#define BRAID_REDUCE_COPY_CUH

#include "braid_reduce.cuh"

namespace braid {

enum { RC_MAX_SRCS = 8, RC_MAX_DSTS = 2, RC_UNROLL = 4 };

// Kernel arguments, passed by value.
struct RcArgs {
  const void* src[RC_MAX_SRCS];
  void* dst[RC_MAX_DSTS];
  unsigned long long count;  // elements
  unsigned int nranks;       // the divisor of avg
};

BRAID_HD void ld16(const unsigned char* p, unsigned int (&w)[4]) {
#ifdef __CUDA_ARCH__
  asm("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
#else
  memcpy(w, p, 16);
#endif
}

BRAID_HD void st16(unsigned char* p, const unsigned int (&w)[4]) {
#ifdef __CUDA_ARCH__
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
               : "memory");
#else
  memcpy(p, w, 16);
#endif
}

// One element at `p`: typed when aligned for X, else byte by byte (little-endian, like every CUDA GPU).
template <class X, bool ALIGNED>
BRAID_HD X ld_elem(const unsigned char* p) {
  union {
    unsigned long long u;
    X x;
  } v;
  if (ALIGNED || sizeof(X) == 1) {
#ifdef __CUDA_ARCH__
    v.x = *(const X*)p;
#else
    memcpy(&v.x, p, sizeof(X));
#endif
  } else {
    v.u = 0;
#pragma unroll
    for (int b = 0; b < (int)sizeof(X); b++) v.u |= (unsigned long long)p[b] << (8 * b);
  }
  return v.x;
}

template <class X, bool ALIGNED>
BRAID_HD void st_elem(unsigned char* p, X x) {
  union {
    unsigned long long u;
    X x;
  } v;
  v.u = 0;
  v.x = x;
  if (ALIGNED || sizeof(X) == 1) {
#ifdef __CUDA_ARCH__
    *(X*)p = v.x;
#else
    memcpy(p, &v.x, sizeof(X));
#endif
  } else {
#pragma unroll
    for (int b = 0; b < (int)sizeof(X); b++) p[b] = (unsigned char)(v.u >> (8 * b));
  }
}

// A pack: G elements of X, loaded and stored as G*sizeof(X)/16 16-byte words.
template <class X, int G>
struct Pack {
  enum { WORDS = G * (int)sizeof(X) / 4, VECS = G * (int)sizeof(X) / 16 };
  union {
    unsigned int w[WORDS];
    X e[G];
  };
  BRAID_HD void load(const unsigned char* p) {
#pragma unroll
    for (int q = 0; q < VECS; q++) ld16(p + 16 * q, *(unsigned int(*)[4]) & w[4 * q]);
  }
  BRAID_HD void store(unsigned char* p) const {
#pragma unroll
    for (int q = 0; q < VECS; q++) st16(p + 16 * q, *(const unsigned int(*)[4]) & w[4 * q]);
  }
};

template <class T, int OP, int NS, unsigned SACC, int ND, unsigned DACC>
struct ReduceCopy {
  typedef typename Elem<T>::A A;
  enum {
    G = 16 / (int)sizeof(T),  // elements per pack of T
    // Packs per thread in flight on the main path, bounded by the registers the partials take: one-byte
    // types hold 16 partials a pack; an avg of 8-byte values calls a division routine per element, and
    // keeping 4 packs live across those calls spills. (ptxas 13.5 also spills the two-destination u8
    // max/min kernels for sm_80 at 2 packs, with 40 registers in use: one-byte, two-destination kernels
    // keep one pack.)
    U = sizeof(T) == 1 ? (ND > 1 ? 1 : 2) : (OP == OP_AVG && sizeof(A) == 8 ? 1 : RC_UNROLL)
  };

  static BRAID_HD bool src_acc(int i) { return (SACC >> i) & 1u; }
  static BRAID_HD bool dst_acc(int j) { return (DACC >> j) & 1u; }
  static BRAID_HD unsigned int src_size(int i) { return src_acc(i) ? sizeof(A) : sizeof(T); }
  static BRAID_HD unsigned int dst_size(int j) { return dst_acc(j) ? sizeof(A) : sizeof(T); }

  // Element e of every operand: read all sources, then write every destination (so in place is safe).
  template <bool ALIGNED>
  static BRAID_HD void element(const RcArgs& a, unsigned long long e) {
    A acc = A();
#pragma unroll
    for (int i = 0; i < NS; i++) {
      const unsigned char* s = (const unsigned char*)a.src[i] + e * src_size(i);
      A x = src_acc(i) ? ld_elem<A, ALIGNED>(s) : Elem<T>::load(ld_elem<T, ALIGNED>(s));
      acc = i == 0 ? x : combine<OP>(acc, x);
    }
#pragma unroll
    for (int j = 0; j < ND; j++) {
      unsigned char* d = (unsigned char*)a.dst[j] + e * dst_size(j);
      if (dst_acc(j))
        st_elem<A, ALIGNED>(d, acc);
      else
        st_elem<T, ALIGNED>(d, finish<T, OP>(acc, a.nranks));
    }
  }

  // U packs at pack indices g, g+stride, ... (relative to the element offset `base`).
  template <int U>
  static BRAID_HD void packs(const RcArgs& a, unsigned long long base, unsigned long long g,
                             unsigned long long stride) {
    A acc[U][G];
#pragma unroll
    for (int i = 0; i < NS; i++) {
      const unsigned char* s = (const unsigned char*)a.src[i];
      if (src_acc(i)) {
        Pack<A, G> p[U];
#pragma unroll
        for (int u = 0; u < U; u++) p[u].load(s + (base + (g + u * stride) * G) * sizeof(A));
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
          for (int k = 0; k < G; k++) acc[u][k] = i == 0 ? p[u].e[k] : combine<OP>(acc[u][k], p[u].e[k]);
      } else {
        Pack<T, G> p[U];
#pragma unroll
        for (int u = 0; u < U; u++) p[u].load(s + (base + (g + u * stride) * G) * sizeof(T));
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
          for (int k = 0; k < G; k++) {
            A x = Elem<T>::load(p[u].e[k]);
            acc[u][k] = i == 0 ? x : combine<OP>(acc[u][k], x);
          }
      }
    }
#pragma unroll
    for (int j = 0; j < ND; j++) {
      unsigned char* d = (unsigned char*)a.dst[j];
#pragma unroll
      for (int u = 0; u < U; u++) {
        unsigned long long off = base + (g + u * stride) * G;
        if (dst_acc(j)) {
          Pack<A, G> p;
#pragma unroll
          for (int k = 0; k < G; k++) p.e[k] = acc[u][k];
          p.store(d + off * sizeof(A));
        } else {
          Pack<T, G> p;
#pragma unroll
          for (int k = 0; k < G; k++) p.e[k] = finish<T, OP>(acc[u][k], a.nranks);
          p.store(d + off * sizeof(T));
        }
      }
    }
  }

  // The head length that makes every operand 16-byte aligned, or false when there is none.
  static BRAID_HD bool vector_head(const RcArgs& a, unsigned long long* head) {
    // The reference is an operand of the smallest element size: its head is unique modulo the largest
    // modulus, so if any head aligns every operand, it does.
    unsigned long long ref = (unsigned long long)a.src[0];
    unsigned int rsize = src_size(0);
#pragma unroll
    for (int i = 1; i < NS; i++)
      if (src_size(i) < rsize) {
        ref = (unsigned long long)a.src[i];
        rsize = src_size(i);
      }
#pragma unroll
    for (int j = 0; j < ND; j++)
      if (dst_size(j) < rsize) {
        ref = (unsigned long long)a.dst[j];
        rsize = dst_size(j);
      }
    if (ref % rsize) return false;
    unsigned long long h = ((16u - ref % 16u) % 16u) / rsize;
    bool ok = true;
#pragma unroll
    for (int i = 0; i < NS; i++) ok = ok && ((unsigned long long)a.src[i] + h * src_size(i)) % 16u == 0;
#pragma unroll
    for (int j = 0; j < ND; j++) ok = ok && ((unsigned long long)a.dst[j] + h * dst_size(j)) % 16u == 0;
    *head = h;
    return ok;
  }

  static BRAID_HD bool element_aligned(const RcArgs& a) {
    bool ok = true;
#pragma unroll
    for (int i = 0; i < NS; i++) ok = ok && (unsigned long long)a.src[i] % src_size(i) == 0;
#pragma unroll
    for (int j = 0; j < ND; j++) ok = ok && (unsigned long long)a.dst[j] % dst_size(j) == 0;
    return ok;
  }

  // What thread `t` of `nthreads` does.
  static BRAID_HD void run(const RcArgs& a, unsigned long long t, unsigned long long nthreads) {
    const unsigned long long n = a.count;
    unsigned long long h = 0;
    if (vector_head(a, &h) && h <= n) {
      for (unsigned long long e = t; e < h; e += nthreads) element<true>(a, e);
      const unsigned long long npacks = (n - h) / G;
      unsigned long long g = t;
      if (U > 1)
        for (; g + (U - 1) * nthreads < npacks; g += U * nthreads) packs<U>(a, h, g, nthreads);
      for (; g < npacks; g += nthreads) packs<1>(a, h, g, nthreads);
      for (unsigned long long e = h + npacks * G + t; e < n; e += nthreads) element<true>(a, e);
    } else if (element_aligned(a)) {
      for (unsigned long long e = t; e < n; e += nthreads) element<true>(a, e);
    } else {
      for (unsigned long long e = t; e < n; e += nthreads) element<false>(a, e);
    }
  }
};

}  // namespace braid

// The catalogue: every (shape, dtype, op) kernel, named braid_rc_<shape>_<dtype>_<op>. A shape is
// (sources, source accumulator mask, destinations, destination accumulator mask); bit i of a mask set
// means operand i is in the accumulator type. crates/braid-cuda/src/lib.rs names the same kernels.
#define BRAID_RC_FOR_SHAPES(K, dt, T, on, OP) \
  K(combine, dt, T, on, OP, 2, 0x1u, 1, 0x1u) \
  K(combine_acc, dt, T, on, OP, 2, 0x3u, 1, 0x1u) \
  K(finish_acc, dt, T, on, OP, 1, 0x1u, 1, 0x0u) \
  K(finalize, dt, T, on, OP, 2, 0x1u, 1, 0x0u) \
  K(finalize2, dt, T, on, OP, 2, 0x1u, 2, 0x0u) \
  K(ordered2, dt, T, on, OP, 2, 0x0u, 1, 0x0u) \
  K(ordered3, dt, T, on, OP, 3, 0x0u, 1, 0x0u) \
  K(ordered4, dt, T, on, OP, 4, 0x0u, 1, 0x0u) \
  K(ordered8, dt, T, on, OP, 8, 0x0u, 1, 0x0u)

#define BRAID_RC_FOR_OPS(K, dt, T) \
  K(dt, T, sum, 0)                 \
  K(dt, T, prod, 1)                \
  K(dt, T, max, 2)                 \
  K(dt, T, min, 3)                 \
  K(dt, T, avg, 4)

#define BRAID_RC_FOR_DTYPES(K)      \
  K(i8, signed char)                \
  K(u8, unsigned char)              \
  K(i32, int)                       \
  K(i64, long long)                 \
  K(u32, unsigned int)              \
  K(u64, unsigned long long)        \
  K(f16, braid::half_t)             \
  K(f32, float)                     \
  K(f64, double)                    \
  K(bf16, braid::bfloat16_t)

// The op-independent shape, named braid_rc_to_acc_<dtype>: the first contribution of a chain (T -> A).
#define BRAID_RC_FOR_OP_FREE(K, dt, T) K(to_acc, dt, T, 1, 0x0u, 1, 0x1u)

#endif  // BRAID_REDUCE_COPY_CUH
