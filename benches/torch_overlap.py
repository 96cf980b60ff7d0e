"""Overlap of communication with the backward pass, on a real model's parameters and real CPU work, run
as every rank of a job (benches/overlap.sh starts it on namespaced hosts joined by a shaped link):

    torchrun --nproc_per_node 2 benches/torch_overlap.py

The model is GPT-2 small (124M parameters; MODEL=gpt2-mini for a 2-layer, 256-wide one), trained with SGD
on random tokens (BATCH x SEQ, defaults 1 x 128). One run measures, as medians over STEPS steps after one
warm-up step each:

- compute: forward and backward alone (no communication);
- comm: braid's bucketed all-reduce of the whole gradient alone;
- sequential: backward, then the bucketed all-reduce;
- overlapped: braid.torch.GradientBuckets, each bucket all-reduced during backward;
- DDP over gloo and DDP over braid (the same model, DDP's own 25 MiB buckets and overlap).

Rank 0 prints a JSON line with the times, the overlap efficiency (T_compute + T_comm - T_step) /
min(T_compute, T_comm), and braid's DDP step time over gloo's. With BRAID_TIMELINE set, the overlapped
steps carry forward/backward spans beside the collectives.
"""

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import braid.torch  # noqa: E402

CONFIGS = {
    "gpt2": dict(layers=12, width=768, heads=12, vocab=50257, context=1024),
    "gpt2-mini": dict(layers=2, width=256, heads=4, vocab=8192, context=256),
}


class Block(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.fc, self.out = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, layers, width, heads, vocab, context):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, width), torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(width)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln(x) @ self.wte.weight.t()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def median_time(step, steps):
    step()  # warm-up (and, for the buckets, the rebuild)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    cfg = CONFIGS[os.environ.get("MODEL", "gpt2")]
    batch, seq, steps = (int(os.environ.get(k, d)) for k, d in (("BATCH", 1), ("SEQ", 128), ("STEPS", 3)))
    dist.init_process_group("braid")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = GPT(**cfg)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(cfg["vocab"], (batch, seq), generator=g)
    tgt = torch.randint(cfg["vocab"], (batch, seq), generator=g)
    opt = torch.optim.SGD(params, lr=1e-4)
    comm = braid.torch._communicator(None, "the overlap benchmark")
    buckets = braid.torch.GradientBuckets(params)

    def compute():
        opt.zero_grad()
        with buckets.no_sync():
            model(idx, tgt).backward()

    def comm_only():
        buckets.mark_all()
        buckets.finish()

    def sequential():
        compute()
        buckets.mark_all()
        buckets.finish()
        opt.step()

    def overlapped():
        opt.zero_grad()
        with comm.timeline("forward"):
            loss = model(idx, tgt)
        with comm.timeline("backward"):
            loss.backward()
        buckets.finish()
        opt.step()

    out = {"model": os.environ.get("MODEL", "gpt2"), "params": n_params, "ranks": world, "batch": batch, "seq": seq}
    out["compute_s"] = median_time(compute, steps)
    compute()  # gradients to all-reduce
    out["comm_s"] = median_time(comm_only, steps)
    out["sequential_s"] = median_time(sequential, steps)
    out["overlapped_s"] = median_time(overlapped, steps)
    buckets.remove()
    tc, tm, ts = out["compute_s"], out["comm_s"], out["overlapped_s"]
    out["overlap_efficiency"] = (tc + tm - ts) / min(tc, tm)
    out["overlapped_over_sequential"] = ts / out["sequential_s"]
    out["gradient_mb"] = n_params * 4 / 1e6
    for name, pg in (("gloo", gloo), ("braid", None)):
        torch.manual_seed(0)
        m = GPT(**cfg)
        ddp = DDP(m, process_group=pg)
        o = torch.optim.SGD(ddp.parameters(), lr=1e-4)

        def ddp_step():
            o.zero_grad()
            ddp(idx, tgt).backward()
            o.step()

        out[f"ddp_{name}_s"] = median_time(ddp_step, steps)
        del ddp, m, o
    out["ddp_braid_over_gloo"] = out["ddp_braid_s"] / out["ddp_gloo_s"]
    dist.barrier()
    comm.timeline_flush()
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
