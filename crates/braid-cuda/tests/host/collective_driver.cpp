// The device-resident all-reduce (kernels/braid_collective.cuh) on CPU threads, through the SIMT runner:
// `world` ranks whose windows are shared memory, run either as threads of this process (one grid whose
// y dimension is the rank, so ThreadSanitizer sees every rank's threads) or as processes (forked after
// the windows are mapped shared, as CUDA IPC would map them; a rank can be killed).
//
//   collective_driver DIR KEY=VALUE...
//
// Keys: ranks=threads|procs, world (1-4 or 8), blocks, threads, dtype (f32 f16 bf16 f64 i32 i64 u8), op (sum prod
// max min avg), count, mode (0 one-shot, 1 two-shot, 2 symmetric), stage (bytes of a staging half),
// iters (collectives run in a row, each over the same inputs), epoch (the barrier epoch the windows
// start from, to cross the 2^32 wrap), timeout_ms, missing (a rank that never runs: killed at start in
// procs mode), abort_ms (the abort word is set this long after start), mismatch (a rank that calls
// with count + 1), inplace (0/1: the output is the input), late_ms (thread t of block 0 of every rank starts
// (threads - 1 - t) * late_ms late: a block whose threads start apart, its barrier's waiters last).
// Inputs: DIR/in<r>.bin (count elements each); outputs: DIR/out<r>.bin (the last iteration's result);
// stdout: one line per rank, `rank R status CODE PEER BLOCK`.
#include "simt.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <string>

#include "braid_collective.cuh"

namespace {

std::map<std::string, std::string> opts;

long long opt(const char* key, long long fallback) {
  auto it = opts.find(key);
  return it == opts.end() ? fallback : atoll(it->second.c_str());
}

std::string opt_s(const char* key, const char* fallback) {
  auto it = opts.find(key);
  return it == opts.end() ? fallback : it->second;
}

typedef void (*Kernel)(braid::ArArgs);

// Holds back the start of block 0's threads (late_ms): the last thread starts first.
void start_late(long long late_ms) {
  if (late_ms > 0 && blockIdx.x == 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(late_ms * (blockDim.x - 1 - threadIdx.x)));
}

// One grid of (blocks × world): block (x, y) is block x of rank y.
__global__ void all_ranks(const braid::ArArgs* args, Kernel k, long long late_ms) {
  // The kernel reads blockIdx.x and gridDim.x only: present rank y's blocks as a grid of their own.
  const braid::ArArgs a = args[blockIdx.y];
  blockIdx.y = 0;
  gridDim.y = 1;
  start_late(late_ms);
  k(a);
}

__global__ void late_rank(braid::ArArgs a, Kernel k, long long late_ms) {
  start_late(late_ms);
  k(a);
}

template <class T, int OP, int W>
__global__ void one_rank(braid::ArArgs a) {
  braid::AllReduce<T, OP, W>::run(a);
}

// The world sizes the driver is built for (each is a kernel of its own, as on a GPU).
template <class T, int OP>
Kernel for_world(unsigned world) {
  switch (world) {
    case 1: return one_rank<T, OP, 1>;
    case 2: return one_rank<T, OP, 2>;
    case 3: return one_rank<T, OP, 3>;
    case 4: return one_rank<T, OP, 4>;
    case 8: return one_rank<T, OP, 8>;
    default: return nullptr;
  }
}

template <class T>
Kernel for_op(const std::string& op, unsigned world) {
  if (op == "sum") return for_world<T, braid::OP_SUM>(world);
  if (op == "prod") return for_world<T, braid::OP_PROD>(world);
  if (op == "max") return for_world<T, braid::OP_MAX>(world);
  if (op == "min") return for_world<T, braid::OP_MIN>(world);
  if (op == "avg") return for_world<T, braid::OP_AVG>(world);
  return nullptr;
}

Kernel kernel_for(const std::string& dt, const std::string& op, unsigned world, size_t* size) {
  if (dt == "f32") return *size = 4, for_op<float>(op, world);
  if (dt == "f16") return *size = 2, for_op<braid::half_t>(op, world);
  if (dt == "bf16") return *size = 2, for_op<braid::bfloat16_t>(op, world);
  if (dt == "f64") return *size = 8, for_op<double>(op, world);
  if (dt == "i32") return *size = 4, for_op<int>(op, world);
  if (dt == "i64") return *size = 8, for_op<long long>(op, world);
  if (dt == "u8") return *size = 1, for_op<unsigned char>(op, world);
  return nullptr;
}

void* shared_map(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) simt::fail("mmap of a shared window failed");
  return p;
}

std::vector<unsigned char> read_file(const std::string& path) {
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) simt::fail("cannot open an input file");
  std::vector<unsigned char> v;
  unsigned char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) v.insert(v.end(), buf, buf + n);
  fclose(f);
  return v;
}

void write_file(const std::string& path, const unsigned char* p, size_t n) {
  FILE* f = fopen(path.c_str(), "wb");
  if (!f || fwrite(p, 1, n, f) != n) simt::fail("cannot write an output file");
  fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) simt::fail("usage: collective_driver DIR KEY=VALUE...");
  const std::string dir = argv[1];
  for (int i = 2; i < argc; i++) {
    std::string kv = argv[i];
    size_t eq = kv.find('=');
    if (eq == std::string::npos) simt::fail("arguments are KEY=VALUE");
    opts[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  const bool procs = opt_s("ranks", "threads") == "procs";
  const unsigned world = (unsigned)opt("world", 2), blocks = (unsigned)opt("blocks", 2);
  const unsigned threads = (unsigned)opt("threads", 64);
  const unsigned long long count = (unsigned long long)opt("count", 1000);
  const unsigned mode = (unsigned)opt("mode", 0);
  const unsigned long long stage = (unsigned long long)opt("stage", 4096);
  const int iters = (int)opt("iters", 1);
  const unsigned epoch0 = (unsigned)opt("epoch", 0);
  const long long missing = opt("missing", -1), mismatch = opt("mismatch", -1), abort_ms = opt("abort_ms", -1);
  const bool inplace = opt("inplace", 0) != 0;
  const long long late_ms = opt("late_ms", 0);
  size_t size = 0;
  Kernel kernel = kernel_for(opt_s("dtype", "f32"), opt_s("op", "sum"), world, &size);
  if (!kernel) simt::fail("unknown dtype or op, or a world size the driver is not built for (1-4, 8)");
  if (world < 1 || world > braid::AR_MAX_RANKS || blocks < 1 || blocks > braid::AR_MAX_BLOCKS)
    simt::fail("world or blocks out of range");

  const size_t bytes = count * size;
  const size_t heap = (bytes + 15) / 16 * 16 * 2 + 64;
  const size_t window_bytes = braid::AR_STAGE_OFF + 2 * stage + heap;
  const unsigned long long heap_off = braid::AR_STAGE_OFF + 2 * stage;
  std::vector<unsigned char*> windows(world);
  for (unsigned r = 0; r < world; r++) {
    windows[r] = (unsigned char*)shared_map(window_bytes);
    for (unsigned b = 0; b < braid::AR_MAX_BLOCKS; b++) {
      braid::ar_state((unsigned long long)windows[r], b)->epoch = epoch0;
      for (unsigned p = 0; p < braid::AR_MAX_RANKS; p++) *braid::ar_flag((unsigned long long)windows[r], b, p) = epoch0;
    }
  }
  // Status words and the abort word: host memory every rank sees (as mapped pinned memory would be).
  unsigned int* status = (unsigned int*)shared_map(4096);
  unsigned int* abort_word = status + 512;

  // Each rank's buffers: symmetric ones in its heap (input at 0, output after it), else private.
  std::vector<unsigned char*> in(world), out(world);
  const unsigned long long in_off = 0, out_off = inplace ? 0 : (bytes + 15) / 16 * 16 + 16;
  for (unsigned r = 0; r < world; r++) {
    std::vector<unsigned char> data = read_file(dir + "/in" + std::to_string(r) + ".bin");
    if (data.size() != bytes) simt::fail("an input file has the wrong size");
    if (mode == braid::AR_SYMMETRIC) {
      in[r] = windows[r] + heap_off + in_off;
      out[r] = windows[r] + heap_off + out_off;
    } else {
      // Misaligned by one element on odd ranks, to cover the unaligned copy paths.
      unsigned char* base = (unsigned char*)shared_map(2 * bytes + 64);
      in[r] = base + (r % 2) * size;
      out[r] = inplace ? in[r] : base + bytes + 32;
    }
    memcpy(in[r], data.data(), bytes);
  }

  std::vector<braid::ArArgs> args(world);
  for (unsigned r = 0; r < world; r++) {
    braid::ArArgs& a = args[r];
    memset(&a, 0, sizeof a);
    for (unsigned q = 0; q < world; q++) a.window[q] = (unsigned long long)windows[q];
    a.send = mode == braid::AR_SYMMETRIC ? in_off : (unsigned long long)in[r];
    a.recv = mode == braid::AR_SYMMETRIC ? out_off : (unsigned long long)out[r];
    a.count = count + ((long long)r == mismatch ? 1 : 0);
    a.stage_bytes = stage;
    a.heap_off = heap_off;
    a.timeout_ns = (unsigned long long)opt("timeout_ms", 5000) * 1000000ull;
    a.abort_word = (unsigned long long)abort_word;
    a.status = (unsigned long long)(status + 8 * r);
    a.rank = r;
    a.world = world;
    a.mode = mode;
    a.tag = 7;
  }

  // Sets the abort word after abort_ms (started after any fork: a forked child has no threads).
  std::thread aborter;
  auto start_aborter = [&] {
    if (abort_ms >= 0)
      aborter = std::thread([=] {
        std::this_thread::sleep_for(std::chrono::milliseconds(abort_ms));
        __atomic_store_n(abort_word, 1u, __ATOMIC_RELEASE);
      });
  };

  bool failed_child = false;
  if (procs) {
    std::vector<pid_t> kids;
    for (unsigned r = 0; r < world; r++) {
      pid_t pid = fork();
      if (pid < 0) simt::fail("fork failed");
      if (pid == 0) {
        if ((long long)r == missing) raise(SIGKILL);
        for (int i = 0; i < iters; i++) {
          simt::launch(dim3(blocks), dim3(threads), late_rank, args[r], kernel, late_ms);
          if (status[8 * r]) break;
        }
        _exit(0);
      }
      kids.push_back(pid);
    }
    start_aborter();
    for (unsigned r = 0; r < world; r++) {
      int st = 0;
      if (waitpid(kids[r], &st, 0) < 0) simt::fail("waitpid failed");
      // Every rank's process but the one killed on purpose must end normally.
      if ((long long)r != missing && (!WIFEXITED(st) || WEXITSTATUS(st) != 0)) {
        fprintf(stderr, "collective_driver: rank %u's process ended abnormally (status %#x)\n", r, st);
        failed_child = true;
      }
    }
  } else {
    start_aborter();
    braid::ArArgs* dev_args = args.data();
    for (int i = 0; i < iters; i++) {
      if (missing >= 0) {
        // The missing rank's blocks never start: the others run alone.
        std::vector<braid::ArArgs> present;
        for (unsigned r = 0; r < world; r++)
          if ((long long)r != missing) present.push_back(args[r]);
        simt::launch(dim3(blocks, (unsigned)present.size()), dim3(threads), all_ranks, present.data(), kernel,
                     late_ms);
      } else {
        simt::launch(dim3(blocks, world), dim3(threads), all_ranks, dev_args, kernel, late_ms);
      }
      bool failed = false;
      for (unsigned r = 0; r < world; r++) failed = failed || status[8 * r];
      if (failed) break;
    }
  }
  if (aborter.joinable()) aborter.join();

  for (unsigned r = 0; r < world; r++) {
    write_file(dir + "/out" + std::to_string(r) + ".bin", out[r], bytes);
    printf("rank %u status %u %u %u\n", r, status[8 * r], status[8 * r + 1], status[8 * r + 2]);
  }
  return failed_child ? 1 : 0;
}
