"""torch.distributed with backend="braid", run as every rank of a job (torchrun or `braid run`):

    torchrun --nproc_per_node 4 python/tests/test_torch.py
    braid run -n 2 -- python3 python/tests/test_torch.py

Every collective of the backend on random data, every dtype both support, odd sizes and subgroups,
against gloo's result on the same inputs (a gloo group in the same job) or, where gloo has no such
reduction, against the reduction of every rank's input gathered through gloo. Float sums may differ
from gloo's in rounding (another summation order); braid's results must be bit-identical on every
rank. Prints `rank R: torch ok (N checks)` at the end.
"""

import faulthandler
import os
import sys
from pathlib import Path

# A hang must end the test with every thread's stack, not leave it to the harness's timeout.
faulthandler.enable()  # a crash prints every thread's stack
faulthandler.dump_traceback_later(int(os.environ.get("BRAID_TEST_WATCHDOG_S", "300")), exit=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import braid.torch  # noqa: E402,F401

R = dist.ReduceOp
SIZES = [0, 1, 7, 1003, 65537]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
checks = 0


def check(ok, what):
    global checks
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")
    checks += 1


def data(shape, dtype, seed, op=None):
    """Random values whose reductions are exact in integers and finite in floats."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if op == R.PRODUCT:
        v = torch.randint(1, 3, shape, generator=g)
        return v.to(dtype)
    if dtype in FLOATS:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if dtype == torch.complex64:
        return torch.randn(shape, generator=g, dtype=torch.complex64)
    lo = 0 if dtype == torch.uint8 else -20
    return torch.randint(lo, 20, shape, generator=g).to(dtype)


def gathered(t, gloo):
    """Every rank's ``t`` through gloo (as float64 or int64, which gloo moves for every dtype)."""
    wide = t.to(torch.complex128 if t.is_complex() else torch.float64 if t.is_floating_point() else torch.int64)
    out = [torch.empty_like(wide) for _ in range(dist.get_world_size())]
    dist.all_gather(out, wide, group=gloo)
    return out


def same_everywhere(t, gloo, what):
    """braid's result is bit-identical on every rank."""
    raw = t.contiguous().view(torch.uint8).reshape(-1) if t.numel() else torch.empty(0, dtype=torch.uint8)
    for other in gathered(raw, gloo):
        check(torch.equal(other.to(torch.uint8), raw), f"{what}: ranks differ")


def close(got, want, dtype, what):
    if dtype in (torch.float16, torch.bfloat16):
        tol = dict(rtol=2e-2, atol=2e-2)
    elif dtype in (torch.float32, torch.complex64):
        tol = dict(rtol=1e-5, atol=1e-5)
    else:
        tol = dict(rtol=1e-12, atol=1e-12)
    if got.is_floating_point() or got.is_complex():
        ok = torch.allclose(got.to(want.dtype), want, **tol)
    else:
        ok = torch.equal(got.to(want.dtype), want)
    check(ok, f"{what}: {got.reshape(-1)[:6].tolist()} vs {want.reshape(-1)[:6].tolist()}")


def reference(inputs, op, dtype, world):
    """The reduction of every rank's (wide) input, in rank order."""
    acc = inputs[0].clone()
    for x in inputs[1:]:
        if op == R.BAND:
            acc = acc & x
        elif op == R.BOR:
            acc = acc | x
        elif op == R.BXOR:
            acc = acc ^ x
        elif op in (R.SUM, R.AVG):
            acc = acc + x
        elif op == R.PRODUCT:
            acc = acc * x
        elif op == R.MAX:
            acc = torch.maximum(acc, x)
        else:
            acc = torch.minimum(acc, x)
    if op == R.AVG:
        acc = acc / world if acc.is_floating_point() or acc.is_complex() else torch.div(acc, world, rounding_mode="trunc")
    return acc


def all_reduce_cases(rank, world, gloo):
    cases = [(d, op) for d in FLOATS + INTS for op in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX)]
    cases += [(torch.bool, R.MAX), (torch.bool, R.MIN), (torch.complex64, R.SUM), (torch.complex64, R.AVG)]
    cases += [(d, op) for d in INTS + [torch.bool] for op in (R.BAND, R.BOR, R.BXOR)]
    for dtype, op in cases:
        for n in SIZES:
            what = f"all_reduce {dtype} {op} n={n}"
            x = data((n,), dtype, 1000 * rank + n, op)
            t = x.clone()
            dist.all_reduce(t, op=op)
            same_everywhere(t, gloo, what)
            if dtype == torch.bool:
                want = reference([v.bool() for v in gathered(x, gloo)], op, dtype, world)
                check(torch.equal(t, want), what)
                continue
            want = reference(gathered(x, gloo), op, dtype, world)
            close(t, want.to(t.dtype).to(want.dtype), dtype, what)
            if op not in (R.AVG,) and dtype not in (torch.complex64,):
                # gloo's own answer on the same input.
                g = x.clone()
                try:
                    dist.all_reduce(g, op=op, group=gloo)
                except RuntimeError:
                    continue  # a dtype gloo does not reduce: the gathered reference above stands
                close(t, g, dtype, what + " vs gloo")


def data_movement(rank, world, gloo):
    for dtype in [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64]:
        for n in [0, 5, 4099]:
            # Broadcast from every root.
            for root in range(world):
                t = data((n,), dtype, 7 * rank + n)
                want = data((n,), dtype, 7 * root + n)
                dist.broadcast(t, src=root)
                check(torch.equal(t, want), f"broadcast {dtype} n={n} root={root}")
            # All-gather, as a list and into one tensor.
            x = data((n,), dtype, 11 * rank + n)
            outs = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(outs, x)
            for r in range(world):
                check(torch.equal(outs[r], data((n,), dtype, 11 * r + n)), f"all_gather {dtype} n={n} block {r}")
            flat = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(flat, x)
            check(torch.equal(flat, torch.cat(outs)), f"all_gather_into_tensor {dtype} n={n}")
            # All-to-all, equal blocks, into one tensor and as lists.
            x = data((world * n,), dtype, 13 * rank + n)
            y = torch.empty_like(x)
            dist.all_to_all_single(y, x)
            for p in range(world):
                check(torch.equal(y[p * n:(p + 1) * n], data((world * n,), dtype, 13 * p + n)[rank * n:(rank + 1) * n]),
                      f"all_to_all_single {dtype} n={n} from {p}")
            ins = list(x.chunk(world)) if n else [torch.empty(0, dtype=dtype) for _ in range(world)]
            outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
            dist.all_to_all(outs, [t.contiguous() for t in ins])
            check(torch.equal(torch.cat(outs), y), f"all_to_all {dtype} n={n}")
        # Uneven splits along rows of a 2-D tensor: rank r sends r + j + 1 rows of 3 to rank j.
        cols = 3
        send = [rank + j + 1 for j in range(world)]
        recv = [p + rank + 1 for p in range(world)]
        x = data((sum(send), cols), dtype, 17 * rank)
        y = torch.empty((sum(recv), cols), dtype=dtype)
        dist.all_to_all_single(y, x, recv, send)
        at = 0
        for p in range(world):
            theirs = data((sum(p + j + 1 for j in range(world)), cols), dtype, 17 * p)
            start = sum(p + j + 1 for j in range(rank))
            check(torch.equal(y[at:at + recv[p]], theirs[start:start + recv[p]]),
                  f"all_to_all_single uneven {dtype} from {p}")
            at += recv[p]
        # Gather and scatter, every root.
        for root in range(world):
            x = data((9,), dtype, 19 * rank)
            outs = [torch.empty_like(x) for _ in range(world)] if rank == root else None
            dist.gather(x, outs, dst=root)
            if rank == root:
                for r in range(world):
                    check(torch.equal(outs[r], data((9,), dtype, 19 * r)), f"gather {dtype} root={root} from {r}")
            o = torch.empty(9, dtype=dtype)
            ins = [data((9,), dtype, 23 * j + root) for j in range(world)] if rank == root else None
            dist.scatter(o, ins, src=root)
            check(torch.equal(o, data((9,), dtype, 23 * rank + root)), f"scatter {dtype} root={root}")


def reductions_to_parts(rank, world, gloo):
    for dtype in [torch.float32, torch.float64, torch.bfloat16, torch.int32]:
        for n in [0, 3, 2049]:
            for op in (R.SUM, R.MAX):
                x = data((world * n,), dtype, 29 * rank + n)
                want = reference(gathered(x, gloo), op, dtype, world)
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, x, op=op)
                close(out, want[rank * n:(rank + 1) * n], dtype, f"reduce_scatter_tensor {dtype} {op} n={n}")
                same_everywhere(torch.cat(gathered(out, gloo)), gloo, "reduce_scatter_tensor")
                out2 = torch.empty(n, dtype=dtype)
                dist.reduce_scatter(out2, list(x.chunk(world)) if n else [torch.empty(0, dtype=dtype)] * world, op=op)
                check(torch.equal(out2, out), f"reduce_scatter list {dtype} {op} n={n}")
                for root in range(world):
                    t = x[:n].clone()
                    dist.reduce(t, dst=root, op=op)
                    if rank == root:
                        w = reference(gathered(x[:n], gloo), op, dtype, world)
                        close(t, w, dtype, f"reduce {dtype} {op} n={n} root={root}")
                    else:
                        gathered(x[:n], gloo)  # keep the gloo calls in step
                        check(torch.equal(t, x[:n]), f"reduce leaves rank {rank}'s input alone")


def asynchronous(rank, world, gloo):
    # Several in flight, futures chained, waited in reverse order.
    ts = [data((4096 + k,), torch.float32, 31 * rank + k) for k in range(6)]
    wants = [reference(gathered(t, gloo), R.SUM, torch.float32, world) for t in ts]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    sums = [w.get_future().then(lambda f: f.value()[0].double().sum().item()) for w in works]
    for k in reversed(range(len(works))):
        works[k].wait()
        # torch 2.15 forwards only wait() and get_future() of a Python backend's Work (its
        # is_completed() stays False): completion shows on the future.
        check(works[k].get_future().done(), f"all_reduce {k}'s future is not done after wait()")
        close(ts[k], wants[k], torch.float32, f"async all_reduce {k}")
        check(abs(sums[k].wait() - ts[k].double().sum().item()) < 1e-6, f"future of all_reduce {k}")
    # A then() callback (it runs on braid's progress thread) may run a blocking collective of its own.
    def chained(fut):
        t = torch.ones(3)
        dist.all_reduce(t)
        return fut.value()[0].sum().item() + t.sum().item()

    f = dist.all_reduce(torch.ones(2), async_op=True).get_future().then(chained)
    check(f.wait() == 5 * world, f"a blocking all_reduce inside a then() callback gave {f.wait()}")
    # torch.futures.wait_all over the backend's futures.
    xs = [torch.full((10,), float(rank + k)) for k in range(3)]
    futs = [dist.all_reduce(x, async_op=True).get_future() for x in xs]
    torch.futures.wait_all(futs)
    for k, x in enumerate(xs):
        check(torch.equal(x, torch.full((10,), float(sum(r + k for r in range(world))))), f"wait_all {k}")
    # A non-contiguous tensor is reduced through a copy and written back.
    m = data((6, 5), torch.float64, 37 * rank).t()
    want = reference([v.t() for v in gathered(m.t().contiguous(), gloo)], R.SUM, torch.float64, world)
    dist.all_reduce(m)
    close(m, want, torch.float64, "non-contiguous all_reduce")
    # Objects go through the backend's all-gather and broadcast.
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"})
    check(objs == [{"rank": r, "name": f"r{r}"} for r in range(world)], "all_gather_object")
    box = [("hello", rank)]
    dist.broadcast_object_list(box, src=world - 1)
    check(box == [("hello", world - 1)], "broadcast_object_list")
    dist.barrier()


def subgroups(rank, world):
    # Even and odd ranks, each a braid communicator of its own; a group listed out of order.
    evens = list(range(0, world, 2))
    odds = list(range(1, world, 2))
    g_even = dist.new_group(evens, backend="braid")
    g_odd = dist.new_group(odds, backend="braid")
    mine, members = (g_even, evens) if rank % 2 == 0 else (g_odd, odds)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    check(t.item() == float(sum(members)), f"subgroup all_reduce gave {t.item()}")
    check(dist.get_rank(mine) == members.index(rank), "subgroup rank")
    backwards = list(reversed(range(world)))
    g_back = dist.new_group(backwards, backend="braid")
    outs = [torch.empty(1) for _ in range(world)]
    dist.all_gather(outs, torch.tensor([float(rank)]), group=g_back)
    check([o.item() for o in outs] == [float(r) for r in range(world)], f"all_gather in {backwards}")
    for g in (g_even, g_odd, g_back):
        dist.destroy_process_group(g)


def refusals(rank, world):
    for call, what in [
        (lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16)), "int16"),
        (lambda: dist.all_reduce(torch.ones(3), op=R.BAND), "BAND of floats"),
        (lambda: dist.send(torch.ones(1), dst=(rank + 1) % world), "send"),
    ]:
        try:
            call()
        except RuntimeError as e:
            check("braid" in str(e) and ("not supported" in str(e) or "take integer" in str(e)), f"{what}: {e}")
        else:
            check(False, f"{what} was not refused")
    # The communicator still works after the refusals.
    t = torch.ones(2)
    dist.all_reduce(t)
    check(torch.equal(t, torch.full((2,), float(world))), "all_reduce after refusals")


def one_sided_errors(rank, world):
    """An error in the root's arguments only (it alone raises) aborts its process group, so the other
    ranks fail at once instead of waiting for the root until the timeout (30 minutes here)."""
    import time

    g = dist.new_group(backend="braid")
    start = time.monotonic()
    out = torch.empty(4)
    ins = [torch.empty(5) for _ in range(world)] if rank == 0 else None  # 5 elements for outputs of 4
    try:
        dist.scatter(out, ins, src=0, group=g)
    except RuntimeError as e:
        took = time.monotonic() - start
        if rank == 0:
            check("this rank only" in str(e) and "4 elements" in str(e), f"the root's scatter error: {e}")
        else:
            check("rank 0" in str(e), f"rank {rank}'s scatter error names no root: {e}")
        check(took < 60, f"the scatter error took {took:.1f} s")
    else:
        check(False, "a scatter with inputs of the wrong size did not fail")
    # Splits that do not divide the first dimension fail on every rank, before anything runs.
    try:
        dist.all_to_all_single(torch.empty(world + 1, 2), torch.empty(world + 1, 2))
    except RuntimeError as e:
        check("first dimension" in str(e), f"all_to_all_single: {e}")
    else:
        check(False, "all_to_all_single of an indivisible first dimension did not fail")


def main():
    dist.init_process_group("braid")
    rank, world = dist.get_rank(), dist.get_world_size()
    check(dist.get_backend() == "braid", f"backend is {dist.get_backend()}")
    gloo = dist.new_group(backend="gloo")
    all_reduce_cases(rank, world, gloo)
    data_movement(rank, world, gloo)
    reductions_to_parts(rank, world, gloo)
    asynchronous(rank, world, gloo)
    subgroups(rank, world)
    refusals(rank, world)
    one_sided_errors(rank, world)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: torch ok ({checks} checks)", flush=True)


if __name__ == "__main__":
    main()
