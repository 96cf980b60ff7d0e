"""Training with `braid.torch.GradientBuckets` (no DDP, no gloo), run as every rank of a job:

    torchrun --nproc_per_node 2 python/tests/torch_buckets.py [COMPRESSION]

A small model trains for a few steps; autograd hands each gradient to braid as it is produced, small
buckets start their all-reduces during backward, and `finish()` writes the averages into `p.grad`.
Without compression every rank's parameters must be bit-identical and equal, within float tolerance, to
one model trained on all ranks' data at once (the average of the ranks' mean-loss gradients is the
gradient of the mean over all their data); the buckets must have been rebuilt in backward's order (the
last layer first). With a compression text (e.g. `topk:0.2`) the parameters must be bit-identical across
ranks and the loss must fall. `no_sync()` accumulation is checked too. Prints `rank R: buckets ok`.
"""

import faulthandler
import hashlib
import os
import sys
from pathlib import Path

faulthandler.enable()
faulthandler.dump_traceback_later(int(os.environ.get("BRAID_TEST_WATCHDOG_S", "300")), exit=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import braid.torch  # noqa: E402


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 48), torch.nn.ReLU(),
                               torch.nn.Linear(48, 4)).double()


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 24, generator=g, dtype=torch.float64), torch.randn(16, 4, generator=g, dtype=torch.float64)


def main():
    compression = sys.argv[1] if len(sys.argv) > 1 else None
    dist.init_process_group("braid")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model()
    if compression:
        net = net.float()
    params = list(net.parameters())
    buckets = braid.torch.GradientBuckets(params, bucket_bytes=2048, compression=compression)
    first = buckets.layout()
    opt = torch.optim.SGD(params, lr=0.05)
    steps, losses = 6, []
    for step in range(steps):
        x, y = batch(rank, step)
        if compression:
            x, y = x.float(), y.float()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        buckets.finish()
        opt.step()
        losses.append(loss.item())
    rebuilt = buckets.layout()
    # Backward produces the last layer's gradients first: the rebuilt layout starts with them.
    if rebuilt[0][0] not in (len(params) - 1, len(params) - 2):
        raise AssertionError(f"rank {rank}: the rebuilt layout {rebuilt} does not start with the last layer "
                             f"(first layout {first})")
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest()
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise AssertionError(f"rank {rank}: parameters differ across ranks: {digests}")
    if compression:
        all_losses = [None] * world
        dist.all_gather_object(all_losses, losses)
        first_mean = sum(l[0] for l in all_losses) / world
        last_mean = sum(l[-1] for l in all_losses) / world
        if not last_mean < first_mean:
            raise AssertionError(f"rank {rank}: the loss did not fall: {all_losses}")
    else:
        ref = model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        for step in range(steps):
            xs, ys = zip(*(batch(r, step) for r in range(world)))
            ref_opt.zero_grad()
            sum(torch.nn.functional.mse_loss(ref(x), y) for x, y in zip(xs, ys)).div(world).backward()
            ref_opt.step()
        for i, (p, q) in enumerate(zip(params, ref.parameters())):
            if not torch.allclose(p, q, rtol=1e-9, atol=1e-12):
                raise AssertionError(f"rank {rank}: parameter {i} differs from the single-model reference by "
                                     f"{(p - q).abs().max().item()}")
        # Gradient accumulation: a local backward under no_sync, then one synchronised; the result is the
        # average of what the ranks accumulated.
        opt.zero_grad()
        with buckets.no_sync():
            x, y = batch(rank, 100)
            torch.nn.functional.mse_loss(net(x), y).backward()
        x, y = batch(rank, 101)
        torch.nn.functional.mse_loss(net(x), y).backward()
        accumulated = [p.grad.clone() for p in params]
        buckets.finish()
        # The buckets may take another path than a plain all-reduce (on one host they live in shared
        # memory and reduce in rank order), so the average is compared within rounding, and the result
        # must be bit-identical on every rank.
        for i, (a, p) in enumerate(zip(accumulated, params)):
            every = [torch.empty_like(a) for _ in range(world)]
            dist.all_gather(every, a)
            mean = sum(every[1:], every[0]) / world
            if not torch.allclose(mean, p.grad, rtol=1e-12, atol=1e-15):
                raise AssertionError(f"rank {rank}: accumulated gradient {i} differs from the average of the "
                                     f"ranks' accumulations by {(mean - p.grad).abs().max().item()}")
            grads = [torch.empty_like(a) for _ in range(world)]
            dist.all_gather(grads, p.grad)
            if not all(torch.equal(g, p.grad) for g in grads):
                raise AssertionError(f"rank {rank}: the accumulated gradient {i} differs between ranks")
    buckets.remove()
    dist.destroy_process_group()
    print(f"rank {rank}: buckets ok", flush=True)


if __name__ == "__main__":
    main()
