"""DistributedDataParallel training with one backend, run as every rank of a job:

    torchrun --nproc_per_node 2 python/tests/torch_ddp.py braid DIR    # backend="braid", no gloo anywhere
    torchrun --nproc_per_node 2 python/tests/torch_ddp.py gloo DIR     # then gloo, compared with braid's

A small MLP trains for a few steps on different data per rank, with small buckets (several per step,
rebuilt by DDP after the first). Each rank checks that its parameters are bit-identical to every other
rank's (through the backend under test) and saves them to DIR/params_<backend>_<rank>.pt; the gloo run
then checks that braid's parameters equal gloo's within float tolerance. Prints
`rank R: ddp <backend> ok` at the end.
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


def main():
    backend, out = sys.argv[1], Path(sys.argv[2])
    if backend == "braid":
        import braid.torch  # noqa: F401
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    # Every rank starts from rank 0's weights through DDP's own broadcast: perturb the others first.
    if rank:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)
    ddp = DDP(model, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(8):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise AssertionError(f"rank {rank}: parameters differ across ranks after DDP with {backend}: {digests}")
    out.mkdir(parents=True, exist_ok=True)
    torch.save(params, out / f"params_{backend}_{rank}.pt")
    if backend != "braid":
        theirs = torch.load(out / f"params_braid_{rank}.pt")
        for i, (a, b) in enumerate(zip(params, theirs)):
            if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                raise AssertionError(
                    f"rank {rank}: parameter {i} after DDP differs between {backend} and braid by "
                    f"{(a - b).abs().max().item()}")
    dist.destroy_process_group()
    print(f"rank {rank}: ddp {backend} ok", flush=True)


if __name__ == "__main__":
    main()
