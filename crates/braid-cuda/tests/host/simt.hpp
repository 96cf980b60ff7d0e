// braid's SIMT runner: CUDA C `__global__` kernels run on CPU threads, one OS thread per CUDA thread,
// so that ThreadSanitizer sees the kernel's threads as what they are on a GPU: concurrent.
//
// Include this header, then the `.cu` file, in a host C++17 translation unit, and launch with
// `simt::launch(grid, block, kernel, args...)`. The kernel's text is compiled unchanged: `__global__`,
// `__device__`, `__host__`, `__forceinline__`, `__launch_bounds__` and `__restrict__` are defined away;
// `threadIdx`, `blockIdx`, `blockDim`, `gridDim` and `warpSize` are per-thread variables the runner sets.
//
// What a kernel may use, with the semantics of sm_70 and later:
// - `__syncthreads()`: a barrier of the block. A thread that has returned counts as arrived.
// - `__shared__` variables. They are `static` here, so the blocks of a kernel that declares any must
//   run one after another: launch it with `simt::Blocks::InTurn` (concurrent blocks sharing them are
//   reported by ThreadSanitizer as the races they would be). Dynamic (`extern`) shared memory is not
//   provided.
// - Warps of 32 lanes (`threadIdx` linearised, x fastest): `__syncwarp`, `__activemask`, `__shfl_sync`,
//   `__shfl_up_sync`, `__shfl_down_sync`, `__shfl_xor_sync` (with `width`), `__ballot_sync`,
//   `__any_sync`, `__all_sync`. The mask must hold every lane of the warp that has not returned: the
//   runner synchronises whole warps and stops with a message on a partial mask.
// - `atomicAdd`, `atomicSub`, `atomicMax`, `atomicMin`, `atomicExch`, `atomicCAS` (relaxed, as on the
//   device) and `__threadfence` (a sequentially consistent read-modify-write of a word all fences
//   share, which ThreadSanitizer understands; it does not model fences).
//
// What this does not show: code under `#ifdef __CUDA_ARCH__` (inline PTX, device intrinsics) is not
// compiled here, so its host branch runs instead; the memory model is the CPU's (stronger than the
// GPU's), so a missing fence between threads that ThreadSanitizer cannot see may pass here and fail on a
// GPU; and warps do not run in lockstep (neither do they on sm_70+, so code relying on it is wrong
// anyway).
//
// Every wait has a deadline (`BRAID_SIMT_TIMEOUT_MS`, default 20000): a barrier that some thread never
// reaches stops the process with a message naming the barrier, block and thread, instead of hanging.
#ifndef BRAID_SIMT_HPP
#define BRAID_SIMT_HPP

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#error "simt.hpp is for a host C++ compiler; nvcc and NVRTC compile the kernels for a GPU"
#endif

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
inline constexpr int warpSize = 32;

namespace simt {

[[noreturn]] inline void fail(const char* what) {
  fprintf(stderr, "braid simt: %s\n", what);
  fflush(stderr);
  abort();
}

inline std::chrono::milliseconds timeout() {
  static const long ms = [] {
    const char* v = getenv("BRAID_SIMT_TIMEOUT_MS");
    long n = v ? atol(v) : 0;
    return n > 0 ? n : 20000L;
  }();
  return std::chrono::milliseconds(ms);
}

// A barrier whose party shrinks as threads return.
class Barrier {
 public:
  explicit Barrier(unsigned int parties) : expected_(parties) {}

  void wait(const char* name) {
    std::unique_lock<std::mutex> lock(mutex_);
    const unsigned long long generation = generation_;
    if (++arrived_ == expected_) {
      open_locked();
      return;
    }
    if (!cv_.wait_for(lock, timeout(), [&] { return generation_ != generation; })) {
      char msg[256];
      snprintf(msg, sizeof msg,
               "%s in block (%u,%u,%u) thread (%u,%u,%u) waited past BRAID_SIMT_TIMEOUT_MS: %u of %u threads "
               "arrived (a barrier in divergent code?)",
               name, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z, arrived_,
               expected_);
      fail(msg);
    }
  }

  // A thread of the party has returned: it no longer holds the others back.
  void leave() {
    std::lock_guard<std::mutex> lock(mutex_);
    expected_--;
    if (arrived_ > 0 && arrived_ == expected_) open_locked();
  }

 private:
  void open_locked() {
    arrived_ = 0;
    generation_++;
    cv_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  unsigned int expected_;
  unsigned int arrived_ = 0;
  unsigned long long generation_ = 0;
};

struct Warp {
  explicit Warp(unsigned int lanes) : barrier(lanes), live(lanes == 32 ? ~0u : (1u << lanes) - 1) {}
  Barrier barrier;
  unsigned long long slot[32] = {};
  std::mutex mutex;  // guards `live`
  unsigned int live;
};

struct Block {
  explicit Block(unsigned int threads) : barrier(threads) {
    for (unsigned int base = 0; base < threads; base += 32)
      warps.emplace_back(new Warp(threads - base < 32 ? threads - base : 32));
  }
  Barrier barrier;
  std::vector<std::unique_ptr<Warp>> warps;
};

struct Self {
  Block* block = nullptr;
  Warp* warp = nullptr;
  unsigned int lane = 0;
};
inline thread_local Self self;

inline unsigned int live_lanes() {
  std::lock_guard<std::mutex> lock(self.warp->mutex);
  return self.warp->live;
}

inline void check_mask(unsigned int mask, const char* name) {
  const unsigned int live = live_lanes();
  if ((mask & live) != live || !((mask >> self.lane) & 1u)) {
    char msg[200];
    snprintf(msg, sizeof msg,
             "%s with mask %#x in block (%u,%u,%u) lane %u: the runner needs every live lane of the warp "
             "(%#x) in the mask",
             name, mask, blockIdx.x, blockIdx.y, blockIdx.z, self.lane, live);
    fail(msg);
  }
}

template <class T>
unsigned long long to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffles move up to 8 bytes");
  unsigned long long b = 0;
  memcpy(&b, &v, sizeof v);
  return b;
}

template <class T>
T from_bits(unsigned long long b) {
  T v;
  memcpy(&v, &b, sizeof v);
  return v;
}

// Every live lane publishes `bits`; returns lane `src`'s (or this lane's own when `src` is not live).
inline unsigned long long exchange(unsigned int mask, unsigned long long bits, unsigned int src, const char* name) {
  check_mask(mask, name);
  Warp& w = *self.warp;
  w.slot[self.lane] = bits;
  w.barrier.wait(name);
  const unsigned long long got = (src < 32 && ((live_lanes() >> src) & 1u)) ? w.slot[src] : bits;
  w.barrier.wait(name);  // every lane has read before any lane writes again
  return got;
}

// One vote of the warp: which lanes voted true, and which lanes took part (every lane alive then).
struct Vote {
  unsigned int ballot, voters;
};

inline Vote vote(unsigned int mask, bool pred, const char* name) {
  check_mask(mask, name);
  Warp& w = *self.warp;
  w.slot[self.lane] = pred;
  w.barrier.wait(name);
  // Between the two barriers no lane of the warp can return, so the live lanes are the voters.
  const unsigned int voters = live_lanes();
  unsigned int ballot = 0;
  for (unsigned int l = 0; l < 32; l++)
    if (((voters >> l) & 1u) && w.slot[l]) ballot |= 1u << l;
  w.barrier.wait(name);
  return Vote{ballot & mask, voters & mask};
}

inline unsigned int segment(int width) {
  return (width >= 1 && width <= 32 && (width & (width - 1)) == 0) ? (unsigned int)width
                                                                     : (fail("a shuffle's width must be a power of two up to 32"), 0u);
}

// How the blocks of a launch run.
enum class Blocks {
  // As many at once as the thread budget allows (`BRAID_SIMT_MAX_THREADS`, default 1024).
  Concurrent,
  // One after another: for kernels with `__shared__` variables.
  InTurn,
};

inline unsigned int max_threads() {
  static const unsigned int n = [] {
    const char* v = getenv("BRAID_SIMT_MAX_THREADS");
    long n = v ? atol(v) : 0;
    return n > 0 ? (unsigned int)n : 1024u;
  }();
  return n;
}

// OS threads kept between launches (creating one per CUDA thread per launch costs more than the
// kernels under ThreadSanitizer). Each runs one CUDA thread of a launch at a time.
class Pool {
 public:
  // Runs every job on its own thread, all at once, and returns when all have returned.
  void run(std::vector<std::function<void()>>& jobs) {
    while (workers_.size() < jobs.size()) workers_.emplace_back(new Worker(*this));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_ = jobs.size();
    }
    for (size_t i = 0; i < jobs.size(); i++) workers_[i]->give(std::move(jobs[i]));
    std::unique_lock<std::mutex> lock(mutex_);
    if (!done_.wait_for(lock, 10 * timeout(), [&] { return pending_ == 0; }))
      fail("a launch ran past 10 x BRAID_SIMT_TIMEOUT_MS (a thread that never returns?)");
  }

  ~Pool() {
    for (auto& w : workers_) w->stop();
  }

 private:
  class Worker {
   public:
    explicit Worker(Pool& pool) : pool_(pool), thread_([this] { loop(); }) {}
    void give(std::function<void()> job) {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = std::move(job);
      cv_.notify_one();
    }
    void stop() {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        quit_ = true;
        cv_.notify_one();
      }
      thread_.join();
    }

   private:
    void loop() {
      for (;;) {
        std::function<void()> job;
        {
          std::unique_lock<std::mutex> lock(mutex_);
          cv_.wait(lock, [&] { return quit_ || job_; });  // idle between launches: no deadline
          if (!job_) return;
          job = std::move(job_);
          job_ = nullptr;
        }
        job();
        std::lock_guard<std::mutex> lock(pool_.mutex_);
        if (--pool_.pending_ == 0) pool_.done_.notify_all();
      }
    }
    Pool& pool_;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::function<void()> job_;
    bool quit_ = false;
    std::thread thread_;  // last: it starts once the rest is built
  };

  std::vector<std::unique_ptr<Worker>> workers_;
  std::mutex mutex_;
  std::condition_variable done_;
  size_t pending_ = 0;
};

inline Pool& pool() {
  static Pool p;
  return p;
}

// One launch at a time, whatever the kernel: every launch shares the one pool.
inline std::mutex& launch_lock() {
  static std::mutex m;
  return m;
}

// Runs `kernel(args...)` over `grid` × `block` threads and returns when every thread has returned.
// Launches from several host threads run one after another (one pool serves them all).
template <class... P, class... A>
void launch(Blocks mode, dim3 grid, dim3 block, void (*kernel)(P...), A&&... args) {
  const unsigned long long per_block = (unsigned long long)block.x * block.y * block.z;
  const unsigned long long blocks = (unsigned long long)grid.x * grid.y * grid.z;
  if (per_block == 0 || per_block > 1024) fail("a block must have 1 to 1024 threads");
  if (blocks == 0) fail("a grid must have at least one block");
  // The parameters are copied once at launch, as the device copies them into its parameter space.
  const std::tuple<typename std::decay<P>::type...> params(std::forward<A>(args)...);
  unsigned long long wave = mode == Blocks::InTurn ? 1 : max_threads() / per_block;
  if (wave == 0) wave = 1;
  std::lock_guard<std::mutex> serial(launch_lock());
  for (unsigned long long first = 0; first < blocks; first += wave) {
    const unsigned long long last = first + wave < blocks ? first + wave : blocks;
    std::vector<std::unique_ptr<Block>> running;
    std::vector<std::function<void()>> threads;
    for (unsigned long long b = first; b < last; b++) {
      running.emplace_back(new Block((unsigned int)per_block));
      Block* blk = running.back().get();
      const uint3 bi{(unsigned int)(b % grid.x), (unsigned int)(b / grid.x % grid.y),
                     (unsigned int)(b / grid.x / grid.y)};
      for (unsigned int t = 0; t < per_block; t++) {
        const uint3 ti{t % block.x, t / block.x % block.y, t / block.x / block.y};
        threads.emplace_back([=, &params] {
          threadIdx = ti;
          blockIdx = bi;
          blockDim = block;
          gridDim = grid;
          self.block = blk;
          self.warp = blk->warps[t / 32].get();
          self.lane = t % 32;
          std::apply(kernel, params);
          {
            std::lock_guard<std::mutex> lock(self.warp->mutex);
            self.warp->live &= ~(1u << self.lane);
          }
          self.warp->barrier.leave();
          blk->barrier.leave();
        });
      }
    }
    pool().run(threads);
  }
}

template <class... P, class... A>
void launch(dim3 grid, dim3 block, void (*kernel)(P...), A&&... args) {
  launch(Blocks::Concurrent, grid, block, kernel, std::forward<A>(args)...);
}

}  // namespace simt

inline void __syncthreads() { simt::self.block->barrier.wait("__syncthreads"); }
inline void __syncwarp(unsigned int mask = 0xffffffffu) {
  simt::check_mask(mask, "__syncwarp");
  simt::self.warp->barrier.wait("__syncwarp");
}
inline unsigned int __activemask() { return simt::live_lanes(); }
// A fence as a sequentially consistent read-modify-write of one word every fence shares: the order
// ThreadSanitizer can see (it does not model stand-alone fences).
inline void __threadfence() {
  static unsigned int word = 0;
  __atomic_fetch_add(&word, 0u, __ATOMIC_SEQ_CST);
}
inline void __threadfence_block() { __threadfence(); }

template <class T>
T __shfl_sync(unsigned int mask, T var, int src_lane, int width = warpSize) {
  const unsigned int w = simt::segment(width);
  const unsigned int src = (simt::self.lane & ~(w - 1)) + ((unsigned int)src_lane & (w - 1));
  return simt::from_bits<T>(simt::exchange(mask, simt::to_bits(var), src, "__shfl_sync"));
}

template <class T>
T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize) {
  const unsigned int w = simt::segment(width), lane = simt::self.lane;
  const unsigned int src = (lane & (w - 1)) >= delta ? lane - delta : lane;
  return simt::from_bits<T>(simt::exchange(mask, simt::to_bits(var), src, "__shfl_up_sync"));
}

template <class T>
T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize) {
  const unsigned int w = simt::segment(width), lane = simt::self.lane;
  const unsigned int src = (lane & (w - 1)) + delta < w ? lane + delta : lane;
  return simt::from_bits<T>(simt::exchange(mask, simt::to_bits(var), src, "__shfl_down_sync"));
}

template <class T>
T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = warpSize) {
  const unsigned int w = simt::segment(width), lane = simt::self.lane;
  const unsigned int src = lane ^ (unsigned int)lane_mask;
  // A lane may read from its own or an earlier group of `width` lanes, not from a later one.
  const unsigned int end = (lane & ~(w - 1)) + w;
  return simt::from_bits<T>(simt::exchange(mask, simt::to_bits(var), src < end ? src : lane, "__shfl_xor_sync"));
}

inline unsigned int __ballot_sync(unsigned int mask, int pred) {
  return simt::vote(mask, pred != 0, "__ballot_sync").ballot;
}
inline int __any_sync(unsigned int mask, int pred) { return simt::vote(mask, pred != 0, "__any_sync").ballot != 0; }
inline int __all_sync(unsigned int mask, int pred) {
  const simt::Vote v = simt::vote(mask, pred != 0, "__all_sync");
  return v.ballot == v.voters;
}

template <class T>
T atomicAdd(T* p, T v) {
  if constexpr (std::is_integral<T>::value) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
  } else {
    T old;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    for (;;) {
      T next = old + v;
      if (__atomic_compare_exchange(p, &old, &next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return old;
    }
  }
}
template <class T>
T atomicSub(T* p, T v) {
  return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED);
}
template <class T>
T atomicExch(T* p, T v) {
  T old;
  __atomic_exchange(p, &v, &old, __ATOMIC_RELAXED);
  return old;
}
template <class T>
T atomicCAS(T* p, T compare, T v) {
  __atomic_compare_exchange(p, &compare, &v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;
}
template <class T>
T atomicMax(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <class T>
T atomicMin(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}

#endif  // BRAID_SIMT_HPP
