"""braid against NCCL on the same GPU buffers, in one run: each rank of `braid run -n N` (several ranks on
one GPU) times NCCL's all-reduce (libnccl loaded with ctypes from the `nvidia-nccl-cu12`/`-cu13` wheel,
`NCCL_MULTI_RANK_GPU_ENABLE=1` for several ranks per GPU) and braid's on the same PyTorch CUDA tensors,
size by size, interleaved, and rank 0 prints nccl-tests' columns for both and braid's busbw as a share
of NCCL's. Where NCCL cannot run (not installed, too old to accept several ranks on one GPU) it prints
why and braid's columns alone. Results are checked: inputs are small integers, so sums are exact.

Environment: SIZES ("8:256M:4": min, max, factor), ITERS (20), WARMUP (5), DTYPE (float32).
"""
import ctypes
import glob
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import braid  # noqa: E402

try:
    import torch
except ImportError:
    sys.exit("nccl_compare: torch is not installed (it provides the CUDA tensors)")
if not torch.cuda.is_available():
    sys.exit("nccl_compare: torch sees no CUDA device")


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


lo, hi, factor = (os.environ.get("SIZES", "8:256M:4").split(":") + ["4"])[:3]
lo, hi, factor = parse_size(lo), parse_size(hi), int(factor)
iters, warmup = int(os.environ.get("ITERS", "20")), int(os.environ.get("WARMUP", "5"))
dtype = getattr(torch, os.environ.get("DTYPE", "float32"))
NCCL_TYPES = {torch.float32: 7, torch.float16: 6, torch.bfloat16: 9, torch.float64: 8, torch.int32: 2}


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def load_nccl():
    """libnccl, or the reason there is none."""
    names = []
    try:
        import nvidia

        for p in nvidia.__path__:
            names += glob.glob(os.path.join(p, "**", "libnccl.so*"), recursive=True)
    except ImportError:
        pass
    names.append("libnccl.so.2")
    for n in names:
        try:
            lib = ctypes.CDLL(n)
            lib.ncclGetErrorString.restype = ctypes.c_char_p
            return lib, n
        except OSError:
            continue
    return None, "libnccl.so.2 was not found (pip install nvidia-nccl-cu13)"


comm = braid.Communicator.from_env()
rank, world = comm.rank, comm.size
torch.cuda.set_device(0)
comm.use_cuda_device(-1)

os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
nccl, where = load_nccl()
nccl_comm, why = None, None
if nccl is None:
    why = where
else:
    version = ctypes.c_int()
    nccl.ncclGetVersion(ctypes.byref(version))
    uid = NcclUniqueId()
    got_id = 1
    if rank == 0:
        rc = nccl.ncclGetUniqueId(ctypes.byref(uid))
        if rc != 0:
            got_id, why = 0, f"ncclGetUniqueId: {nccl.ncclGetErrorString(rc).decode()}"
    # The id and whether rank 0 got one, to every rank: none calls ncclCommInitRank with a blank id.
    raw = np.zeros(129, dtype=np.uint8)
    raw[:128] = np.frombuffer(ctypes.string_at(ctypes.byref(uid), 128), dtype=np.uint8)
    raw[128] = got_id
    comm.broadcast(raw, root=0)
    if raw[128] == 0:
        why = why or "rank 0 could not get an NCCL id"
    else:
        ctypes.memmove(ctypes.byref(uid), raw.ctypes.data, 128)
        handle = ctypes.c_void_p()
        rc = nccl.ncclCommInitRank(ctypes.byref(handle), world, uid, rank)
        ok = np.array([1 if rc == 0 else 0], dtype=np.int32)
        comm.all_reduce(ok, op="min")
        if ok[0] == 1:
            nccl_comm = handle
        else:
            why = (f"NCCL {version.value} refused {world} ranks on one GPU"
                   f" ({nccl.ncclGetErrorString(rc).decode() if rc else 'on another rank'})")

stream = torch.cuda.current_stream()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def timed(fn):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    comm.barrier()
    start.record(stream)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    end.record(stream)
    end.synchronize()
    host = (time.perf_counter() - t0) / iters
    # The slowest rank's time, by the host clock (braid's calls block the host; NCCL's do not until the
    # event), as nccl-tests reports it.
    worst = np.array([max(host, start.elapsed_time(end) / 1e3 / iters)])
    comm.all_reduce(worst, op="max")
    return float(worst[0])


if rank == 0:
    print(f"# braid vs NCCL all-reduce, {world} ranks on one GPU ({torch.cuda.get_device_name(0)}), {dtype}, "
          f"{iters} iterations after {warmup}")
    if why:
        print(f"# NCCL skipped: {why}")
    print(f"# {'size':>10} {'count':>12} | {'nccl us':>10} {'busbw':>8} | {'braid us':>10} {'busbw':>8} {'wrong':>6} | "
          f"{'braid/nccl':>10}")
size, wrong_total = lo, 0
while size <= hi:
    count = max(1, size // torch.tensor([], dtype=dtype).element_size())
    x = torch.full((count,), float(rank + 1), device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    comm.all_reduce(x, out=y, stream=stream)
    wrong = int((y != world * (world + 1) // 2).sum().item())
    wrong_total += wrong
    t_braid = timed(lambda: comm.all_reduce(x, out=y, stream=stream))
    t_nccl = None
    if nccl_comm is not None and dtype in NCCL_TYPES:
        def run_nccl():
            rc = nccl.ncclAllReduce(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                                    ctypes.c_size_t(count), NCCL_TYPES[dtype], 0, nccl_comm,
                                    ctypes.c_void_p(stream.cuda_stream))
            if rc != 0:
                raise RuntimeError(f"ncclAllReduce: {nccl.ncclGetErrorString(rc).decode()}")
        t_nccl = timed(run_nccl)
    nbytes = count * x.element_size()
    bus = lambda t: nbytes / t / 1e9 * 2 * (world - 1) / world  # noqa: E731
    if rank == 0:
        nccl_cols = f"{t_nccl * 1e6:>10.2f} {bus(t_nccl):>8.2f}" if t_nccl else f"{'-':>10} {'-':>8}"
        ratio = f"{t_nccl / t_braid:>9.2f}x" if t_nccl else f"{'-':>10}"
        print(f"  {nbytes:>10} {count:>12} | {nccl_cols} | {t_braid * 1e6:>10.2f} {bus(t_braid):>8.2f} {wrong:>6} | "
              f"{ratio}", flush=True)
    size *= factor
if nccl_comm is not None:
    nccl.ncclCommDestroy(nccl_comm)
if rank == 0:
    print(f"# braid out of bounds values: {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}")
comm.close()
sys.exit(0 if wrong_total == 0 else 3)
