"""DDP with braid's compressed communication hook, run as every rank of a job:

    torchrun --nproc_per_node 2 python/tests/torch_compressed.py

A small model trains with `braid.torch.compressed_hook` (top-k 10% with error feedback) and small buckets,
which DDP rebuilds after the first step. Every parameter's compressor must have seen every step (its
error feedback was never reset by a bucket rebuild), hold a non-zero residual, and the parameters must be
bit-identical across ranks. Prints `rank R: compressed ok` at the end.
"""

import faulthandler
import hashlib
import os
import sys
from pathlib import Path

faulthandler.enable()  # a crash prints every thread's stack
faulthandler.dump_traceback_later(int(os.environ.get("BRAID_TEST_WATCHDOG_S", "300")), exit=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import braid.torch  # noqa: E402


def main():
    dist.init_process_group("braid")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 48), torch.nn.ReLU(),
                                torch.nn.Linear(48, 4))
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = braid.torch.CompressionState("topk:0.1")
    ddp.register_comm_hook(state, braid.torch.compressed_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(7 + rank)
    steps = 6
    for _ in range(steps):
        x, y = torch.randn(16, 24, generator=g), torch.randn(16, 4, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = list(model.parameters())
    if set(state.compressors) != set(params):
        raise AssertionError(f"rank {rank}: {len(state.compressors)} compressors for {len(params)} parameters")
    for i, p in enumerate(params):
        st = state.stats[p]
        if st["step"] != steps:
            raise AssertionError(f"rank {rank}: parameter {i}'s compressor saw {st['step']} of {steps} steps "
                                 "(its error feedback was reset)")
        if not st["residual_norm"] > 0:
            raise AssertionError(f"rank {rank}: parameter {i} holds no error feedback ({st})")
        if st["density"] > 0.5:
            raise AssertionError(f"rank {rank}: parameter {i} was not compressed ({st})")
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest()
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise AssertionError(f"rank {rank}: parameters differ across ranks: {digests}")
    dist.destroy_process_group()
    print(f"rank {rank}: compressed ok", flush=True)


if __name__ == "__main__":
    main()
