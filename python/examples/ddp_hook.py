"""A PyTorch DDP communication hook that all-reduces gradient buckets through braid.

    braid run -n 2 -- python3 python/examples/ddp_hook.py

DDP still needs a process group for its own bookkeeping (parameter broadcast at start-up); this example
uses gloo for that, on the port after braid's root, and hands every gradient bucket to braid. The hook
averages CPU buckets in place; a CUDA bucket is staged through host memory (this build of braid has no
CUDA streams).
"""

import os
import sys
from pathlib import Path

try:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
except ImportError:
    print("ddp_hook.py: PyTorch is not installed, so there is nothing to run (pip install torch)")
    sys.exit(0)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import braid  # noqa: E402


def braid_allreduce_hook(comm):
    """A DDP comm hook: `model.register_comm_hook(state=None, hook=braid_allreduce_hook(comm))`."""

    def hook(state, bucket):
        grads = bucket.buffer()
        host = grads.detach().cpu() if grads.is_cuda else grads.detach()
        comm.all_reduce(host.numpy(), op="avg")  # shares memory with the tensor
        if grads.is_cuda:
            grads.copy_(host, non_blocking=False)
        fut = torch.futures.Future()
        fut.set_result(grads)
        return fut

    return hook


def main():
    comm = braid.Communicator.from_env()
    host, port = os.environ["BRAID_ROOT"].rsplit(":", 1)
    os.environ.setdefault("MASTER_ADDR", host)
    os.environ.setdefault("MASTER_PORT", str(int(port) + 1))
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 4))
    model.register_comm_hook(state=None, hook=braid_allreduce_hook(comm))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + comm.rank)  # different data on every rank
    for step in range(5):
        x, y = torch.randn(32, 16), torch.randn(32, 4)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    # Gradients were averaged by braid, so every rank holds the same weights.
    w = model.module.weight.detach().numpy().copy()
    gathered = comm.all_gather(w.reshape(-1))
    same = all((gathered.reshape(comm.size, -1)[r] == w.reshape(-1)).all() for r in range(comm.size))
    print(f"rank {comm.rank}: loss {loss.item():.4f}, weights identical across ranks: {same}")
    dist.destroy_process_group()
    comm.close()
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
