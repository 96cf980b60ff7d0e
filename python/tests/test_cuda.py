"""braid on PyTorch CUDA tensors, run as every rank of `braid run -n N` on a machine with a GPU (by
scripts/gpu-check.sh): the collectives take the tensors without copies, ordered on the current stream
(after the kernels that produced the input, before the ones that read the result, without the host
waiting), bfloat16 through DLPack, and every result is exact; host arrays still work beside them. Prints "rank R: cuda ok"; fails (exit 1) otherwise, and when
there is no GPU or no torch it says why and fails too, since it is only run where one is expected."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import braid  # noqa: E402

try:
    import torch
except ImportError:
    sys.exit("test_cuda: torch is not installed")
if not torch.cuda.is_available():
    sys.exit("test_cuda: torch sees no CUDA device")

comm = braid.Communicator.from_env()
rank, world = comm.rank, comm.size
torch.cuda.set_device(0)
comm.use_cuda_device(-1)
for n in (1, 1000, 1 << 20, (1 << 22) + 3):
    # Produced by a kernel on the current stream just before the call: braid must wait for it.
    x = torch.arange(n, device="cuda", dtype=torch.float32) * (rank + 1)
    comm.all_reduce(x, stream=torch.cuda.current_stream())
    want = torch.arange(n, device="cuda", dtype=torch.float32) * (world * (world + 1) // 2)
    assert torch.equal(x, want), f"all_reduce of {n}: {x[:4]} != {want[:4]}"
    y = torch.full((n,), rank, device="cuda", dtype=torch.int32)
    out = torch.empty(n * world, device="cuda", dtype=torch.int32)
    comm.all_gather(y, out=out)
    assert torch.equal(out.view(world, n)[:, 0].cpu(), torch.arange(world, dtype=torch.int32))
    z = torch.full((n,), 7.0 if rank == 0 else 0.0, device="cuda", dtype=torch.float16)
    comm.broadcast(z, root=0)
    assert bool((z == 7.0).all()), f"broadcast of {n}"
    big = torch.ones(n * world, device="cuda", dtype=torch.float64)
    shard = torch.empty(n, device="cuda", dtype=torch.float64)
    comm.reduce_scatter(big, out=shard)
    assert bool((shard == world).all()), f"reduce_scatter of {n}"
    r = torch.full((n,), rank + 1, device="cuda", dtype=torch.int64)
    comm.reduce(r, root=world - 1)
    if rank == world - 1:
        assert bool((r == world * (world + 1) // 2).all()), f"reduce of {n}"
    comm.barrier(stream=torch.cuda.current_stream())
    g = torch.full((n,), 0.5 * (rank + 1), device="cuda", dtype=torch.bfloat16)
    comm.all_reduce(g)  # bfloat16 tensors export only through DLPack
    assert bool((g.float() == 0.5 * world * (world + 1) / 2).all()), f"bfloat16 all_reduce of {n}"
comm.cuda_synchronize()
issued, completed = comm._cuda_progress()
assert issued == completed == 4 * 7, (issued, completed)


def watchdog(seconds, what):
    """Ends the process with a message if `what` has not finished within `seconds` (a hang fails the
    test instead of holding the GPU)."""
    import threading

    done = threading.Event()

    def bark():
        if not done.wait(seconds):
            print(f"rank {rank}: {what} did not finish within {seconds} s", flush=True)
            os._exit(3)

    threading.Thread(target=bark, daemon=True).start()
    return done


# The shape of a hang seen before: many collectives on the default stream with host waits and host
# collectives in between, then one on a new stream followed at once by a kernel on that stream.
done = watchdog(60, "collectives on the default stream, then on a new one")
acc = torch.zeros(1024, device="cuda", dtype=torch.float64)
for i in range(60):
    x = torch.full((1024,), float(rank + i), device="cuda", dtype=torch.float32)
    comm.all_reduce(x)
    torch.cuda.synchronize()
    seen = np.zeros(world, dtype=np.int64)
    comm.all_gather(np.array([i], dtype=np.int64), out=seen)
    assert (seen == i).all(), seen
    assert bool((x == float(world * i + world * (world - 1) // 2)).all()), f"call {i}"
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    x = torch.full((1024,), float(rank), device="cuda", dtype=torch.float32)
    comm.all_reduce(x, stream=s)
    acc += x.to(torch.float64)
s.synchronize()
assert bool((acc == world * (world - 1) / 2).all()), acc[:4]
comm.cuda_synchronize()
done.set()

# A collective captured in a CUDA graph and replayed: each replay is a new all-reduce (in place, so the
# value multiplies by the world size each time; exact in float64).
done = watchdog(60, "a captured all-reduce replayed 100 times")
y = torch.ones(1 << 16, device="cuda", dtype=torch.float64)
comm.all_reduce(y)  # warm-up outside the capture (loads the kernel)
comm.cuda_synchronize()
y.fill_(1.0)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    comm.all_reduce(y, stream=torch.cuda.current_stream())
torch.cuda.synchronize()
y.fill_(1.0)  # capture does not run the kernel: start again from ones
torch.cuda.synchronize()
for _ in range(100):
    graph.replay()
torch.cuda.synchronize()
assert bool((y == float(world) ** 100).all()), f"graph replays: {y[:4]}"
done.set()
# Host memory still works next to the device.
h = np.ones(8, dtype=np.float32)
comm.all_reduce(h)
assert (h == world).all()
comm.close()
print(f"rank {rank}: cuda ok", flush=True)
