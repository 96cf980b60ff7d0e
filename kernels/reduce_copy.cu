// The reduce-copy kernels as `extern "C"` entry points, one per (shape, dtype, op) of the catalogue in
// braid_reduce_copy.cuh. Grid-stride: any grid covers any count; blocks of 512 threads are what braid
// launches (`__launch_bounds__` keeps the register budget honest for that).
#include "braid_reduce_copy.cuh"

#define BRAID_RC_THREADS 512

#define BRAID_RC_KERNEL(shape, dt, T, on, OP, NS, SACC, ND, DACC)                                      \
  extern "C" __global__ void __launch_bounds__(BRAID_RC_THREADS) braid_rc_##shape##_##dt##_##on(      \
      braid::RcArgs a) {                                                                              \
    braid::ReduceCopy<T, OP, NS, SACC, ND, DACC>::run(a, (unsigned long long)blockIdx.x * blockDim.x + \
                                                             threadIdx.x,                             \
                                                         (unsigned long long)gridDim.x * blockDim.x); \
  }

#define BRAID_RC_KERNEL_OP_FREE(shape, dt, T, NS, SACC, ND, DACC)                                      \
  extern "C" __global__ void __launch_bounds__(BRAID_RC_THREADS) braid_rc_##shape##_##dt(              \
      braid::RcArgs a) {                                                                              \
    braid::ReduceCopy<T, 0, NS, SACC, ND, DACC>::run(a, (unsigned long long)blockIdx.x * blockDim.x +  \
                                                            threadIdx.x,                              \
                                                        (unsigned long long)gridDim.x * blockDim.x);  \
  }

#define BRAID_RC_PER_OP(dt, T, on, OP) BRAID_RC_FOR_SHAPES(BRAID_RC_KERNEL, dt, T, on, OP)
#define BRAID_RC_PER_DTYPE(dt, T)               \
  BRAID_RC_FOR_OPS(BRAID_RC_PER_OP, dt, T)      \
  BRAID_RC_FOR_OP_FREE(BRAID_RC_KERNEL_OP_FREE, dt, T)

BRAID_RC_FOR_DTYPES(BRAID_RC_PER_DTYPE)
