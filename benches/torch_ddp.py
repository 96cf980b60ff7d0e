"""DDP step time with one torch.distributed backend, as every rank of a job (see compare-torch.sh):

    torchrun --standalone --nproc_per_node 2 benches/torch_ddp.py braid
    torchrun --standalone --nproc_per_node 2 benches/torch_ddp.py gloo

An MLP of WIDTH × WIDTH layers (DEPTH of them; about DEPTH · WIDTH² parameters) trains on BATCH random
rows per rank; after WARMUP steps, STEPS steps are timed. Rank 0 prints one line of JSON: the backend,
ranks, parameters, gradient bytes, mean and median step time, and the time of one all-reduce of the
whole gradient alone (the communication a step must do, without compute to hide it).
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))


def env(name, default):
    return int(os.environ.get(name, default))


def main():
    backend = sys.argv[1]
    if backend == "braid":
        import braid.torch  # noqa: F401
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    width, depth, batch = env("WIDTH", 1024), env("DEPTH", 8), env("BATCH", 16)
    warmup, steps = env("WARMUP", 3), env("STEPS", 10)
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(warmup + steps):
        x = torch.randn(batch, width, generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    flat = torch.ones(params)
    comm = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        comm.append(time.perf_counter() - t0)
    # Every rank's times: the step ends when the slowest rank's does.
    mine = torch.tensor([statistics.mean(times), statistics.median(times), statistics.median(comm)],
                        dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({
            "backend": backend, "ranks": world, "params": params, "grad_bytes": params * 4,
            "step_mean_s": mine[0].item(), "step_median_s": mine[1].item(), "allreduce_s": mine[2].item(),
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
