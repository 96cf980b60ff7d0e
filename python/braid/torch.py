"""braid as a ``torch.distributed`` backend: ``import braid.torch`` registers ``backend="braid"``.

    import torch.distributed as dist
    import braid.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("braid")            # under torchrun, or with init_method="tcp://..."/"file://..."
    dist.all_reduce(t)                           # every torch.distributed collective on CPU tensors
    model = torch.nn.parallel.DistributedDataParallel(model)   # DDP, with no gloo anywhere

Rendezvous goes through the store torch hands the backend (torchrun's, ``env://``, ``tcp://``,
``file://``): rank 0 of each group makes a braid unique id, listening on an ephemeral port of its own,
and publishes it in the group's store; braid never binds torch's port. Subgroups (``new_group``) are
communicators of their own.

Every call is asynchronous: it queues the collective on braid's progress thread and returns a Work
whose ``get_future()`` is completed by braid's completion callback (no polling thread). Contiguous
tensors are used in place, without copies; a non-contiguous one goes through a contiguous copy.

Types: float32, float64, float16, bfloat16, int8, uint8, int32, int64, uint32, uint64 and bool (as
uint8; its reductions: max, min and the bitwise ones). complex64/complex128 travel as pairs of floats
(sum, avg; and every collective that moves data without reducing it). Reductions: sum, avg, product,
min, max, and on integers and bools band, bor, bxor.

Not (yet) supported, each raising a ``RuntimeError`` that says so: point-to-point ``send``/``recv``,
``PREMUL_SUM``, int16, and CUDA tensors.
"""

import atexit
import contextlib
import datetime
import ipaddress
import os
import socket
import threading
import weakref

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import Work as _C10dWork
from torch.futures import Future

import braid
from braid import _check, _lib

__all__ = ["BraidBackend", "NAME", "CompressionState", "compressed_hook", "GradientBuckets"]

NAME = "braid"

# torch dtype -> (braid dtype code, element count multiplier). Complex numbers travel as float pairs.
_DTYPES = {
    torch.int8: (0, 1),
    torch.uint8: (1, 1),
    torch.bool: (1, 1),
    torch.int32: (2, 1),
    torch.int64: (4, 1),
    torch.float16: (6, 1),
    torch.float32: (7, 1),
    torch.float64: (8, 1),
    torch.bfloat16: (9, 1),
    torch.complex64: (7, 2),
    torch.complex128: (8, 2),
}
for _name, _code in (("uint32", 3), ("uint64", 5)):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = (_code, 1)

_SUM, _PROD, _MAX, _MIN, _AVG, _BAND, _BOR, _BXOR = 0, 1, 2, 3, 4, 5, 6, 7


def _dtype(t, what):
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise RuntimeError(f"braid: {what}: tensors of {t.dtype} are not supported") from None


def _redop(op, t, what):
    """The braid reduction for torch's ReduceOp on tensor ``t``."""
    R = dist.ReduceOp
    table = {R.SUM: _SUM, R.AVG: _AVG, R.PRODUCT: _PROD, R.MIN: _MIN, R.MAX: _MAX, R.BAND: _BAND, R.BOR: _BOR,
             R.BXOR: _BXOR}
    code = None
    for k, v in table.items():
        if op == k:
            code = v
            break
    if code is None:
        raise RuntimeError(
            f"braid: {what}: the reduction {op} is not supported (sum, avg, product, min, max, band, bor, bxor)")
    if t.dtype == torch.bool and code not in (_MIN, _MAX, _BAND, _BOR, _BXOR):
        raise RuntimeError(f"braid: {what}: bool tensors reduce with min, max and the bitwise reductions only")
    if t.is_complex() and code not in (_SUM, _AVG):
        raise RuntimeError(f"braid: {what}: complex tensors reduce with sum or avg only")
    if code in (_BAND, _BOR, _BXOR) and (t.is_floating_point() or t.is_complex()):
        raise RuntimeError(f"braid: {what}: the bitwise reductions take integer and bool tensors, not {t.dtype}")
    return code


def _cpu_only(tensors, what):
    for t in tensors:
        if t.device.type != "cpu":
            raise RuntimeError(f"braid: {what}: {t.device.type} tensors are not supported yet (CPU tensors only)")


class _Buffer:
    """A tensor as braid sees it: its data pointer, element count and dtype code; a contiguous copy of
    a non-contiguous tensor (copied back by ``finish`` where the collective writes it)."""

    def __init__(self, t, what, writes):
        self.tensor = t
        self.code, mult = _dtype(t, what)
        self.work = t if t.is_contiguous() else t.contiguous()
        self.count = self.work.numel() * mult
        self.writes = writes and self.work is not t

    @property
    def ptr(self):
        return self.work.data_ptr() if self.count else None

    def finish(self):
        if self.writes:
            self.tensor.copy_(self.work)


class _Work(_C10dWork):
    """One braid collective as torch sees it. ``wait()`` waits for braid's work (bounded by the
    communicator's timeout), raises braid's error if it failed, and returns once the results are in the
    caller's tensors; ``get_future()`` is completed from braid's completion callback.

    A Python Future cannot hold an error that torch's C++ side sees (``set_exception`` stores the
    exception as a value, which DDP's reducer would take for tensors): the future is a ``then`` of a
    trigger, and a callback that raises gives it a real error. (torch's own Work made from a future does
    not raise from ``wait()`` when the error arrives during the wait, so ``wait`` is braid's.) torch
    forwards only ``wait`` and ``get_future`` of a Python backend's Work: completion shows on the future
    (``get_future().done()``). The callback keeps braid's work, and the buffers it holds, until braid has
    completed it, however early torch lets this object go."""

    def __init__(self, bw, result, finish):
        super().__init__()
        self._bw = bw
        self._done = threading.Event()
        state = {"work": bw, "error": None}
        self._state = state
        trigger = Future()

        def outcome(_):
            if state["error"] is not None:
                raise state["error"]
            return result

        self._future = trigger.then(outcome)
        done = self._done

        def completed(error):
            try:
                if error is None and finish is not None:
                    finish()
            except BaseException as e:
                error = e
            state["error"] = error
            state["work"] = None  # braid is done with the buffers
            try:
                trigger.set_result(None)  # the future is done before wait() returns
            finally:
                done.set()

        bw.on_complete(completed)

    def wait(self, timeout=None):
        self._bw.wait()
        # The callback follows braid's completion (copying results back): it is at most moments away.
        self._done.wait()
        if self._state["error"] is not None:
            raise self._state["error"]
        return True

    def get_future(self):
        return self._future


def _advertised_host():
    """An address of this host the group's other ranks can reach: the one this host uses towards the
    store's host (MASTER_ADDR), or the loopback address when that is this host or unknown.
    ``BRAID_LISTEN_HOST`` overrides it."""
    host = os.environ.get("BRAID_LISTEN_HOST")
    if host:
        return host
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(socket.gethostbyname(master)).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


_live = weakref.WeakSet()


@atexit.register
def _close_all():
    # Before the interpreter goes: no completion callback may call into it afterwards.
    for b in list(_live):
        b._close()


class BraidBackend(_C10dBackend):
    """A torch.distributed backend over one braid communicator (one per process group)."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        timeout_ms = max(1, int(timeout.total_seconds() * 1000)) if timeout else None
        key = "braid/unique_id"
        if rank == 0:
            uid = braid.UniqueId.new(listen=f"{_advertised_host()}:0")
            store.set(key, uid.text)
        else:
            uid = braid.UniqueId(store.get(key).decode())
        self._comm = braid.Communicator.init(size, rank, uid, timeout_ms=timeout_ms)
        _live.add(self)

    # -- torch's introspection -----------------------------------------------------------------------

    def getBackendName(self):
        return NAME

    def _get_backend_name(self):
        return NAME

    def name(self):
        return NAME

    def _close(self):
        comm, self._comm = getattr(self, "_comm", None), None
        if comm is not None:
            comm.close()

    def shutdown(self):
        self._close()

    def abort(self):
        if self._comm is not None:
            self._comm.abort()

    # -- plumbing ----------------------------------------------------------------------------------

    @property
    def _h(self):
        if self._comm is None:
            raise RuntimeError("braid: the process group was shut down")
        return self._comm.handle

    def _queue(self, call, result, keep, finish=None):
        """Issues ``call(out_handle_ptr)`` and wraps its braid work; ``keep`` stays referenced until it
        completes, ``finish`` runs (on completion, before the future) to copy results back."""
        import ctypes

        h = ctypes.c_void_p()
        _check(call(ctypes.byref(h)))
        return _Work(braid.Work(h, None, keep), result, finish)

    @staticmethod
    def _finish_all(buffers, extra=None):
        def finish():
            for b in buffers:
                b.finish()
            if extra is not None:
                extra()

        return finish

    def _one_sided(self, what):
        """An argument error only this rank can see (the root's buffers), after aborting the
        communicator: its peers are about to run the collective and fail at once, naming this rank,
        instead of waiting for it until the timeout. The process group is then unusable, as after any
        failed collective."""
        self.abort()
        return RuntimeError(f"braid: {what} (an error on this rank only: the process group was aborted, so "
                            "that its peers fail at once)")

    def _one(self, tensors, what):
        if len(tensors) != 1:
            raise RuntimeError(f"braid: {what}: one tensor per call (got {len(tensors)})")
        _cpu_only(tensors, what)
        return tensors[0]

    # -- collectives -------------------------------------------------------------------------------

    def allreduce(self, tensors, opts):
        t = self._one(tensors, "allreduce")
        op = _redop(opts.reduceOp, t, "allreduce")
        b = _Buffer(t, "allreduce", writes=True)
        return self._queue(
            lambda w: _lib.braid_all_reduce_async(b.ptr, b.ptr, b.count, b.code, op, self._h, None, w),
            tensors, (b,), self._finish_all([b]))

    def allreduce_coalesced(self, tensors, opts):
        _cpu_only(tensors, "allreduce_coalesced")
        if not tensors:
            return self.barrier(None)
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise RuntimeError("braid: allreduce_coalesced: the tensors must share one dtype")
        op = _redop(opts.reduceOp, tensors[0], "allreduce_coalesced")
        flat = torch.cat([t.reshape(-1) for t in tensors])
        b = _Buffer(flat, "allreduce_coalesced", writes=False)

        def unpack():
            at = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[at:at + n].view_as(t))
                at += n

        return self._queue(
            lambda w: _lib.braid_all_reduce_async(b.ptr, b.ptr, b.count, b.code, op, self._h, None, w),
            tensors, (b,), unpack)

    def broadcast(self, tensors, opts):
        t = self._one(tensors, "broadcast")
        root = opts.rootRank
        b = _Buffer(t, "broadcast", writes=True)
        return self._queue(
            lambda w: _lib.braid_broadcast_async(b.ptr, b.ptr, b.count, b.code, root, self._h, None, w),
            tensors, (b,), self._finish_all([b]))

    def reduce(self, tensors, opts):
        t = self._one(tensors, "reduce")
        op = _redop(opts.reduceOp, t, "reduce")
        root = opts.rootRank
        b = _Buffer(t, "reduce", writes=self._rank == root)
        recv = b.ptr if self._rank == root else None
        return self._queue(
            lambda w: _lib.braid_reduce_async(b.ptr, recv, b.count, b.code, op, root, self._h, None, w),
            tensors, (b,), self._finish_all([b]))

    def _allgather_base(self, output, input, opts=None):
        _cpu_only([output, input], "all_gather_into_tensor")
        _same_dtype([output, input], "all_gather_into_tensor")
        if output.numel() != input.numel() * self._size:
            raise RuntimeError(
                f"braid: all_gather_into_tensor: the output has {output.numel()} elements, "
                f"{self._size} × {input.numel()} expected")
        i = _Buffer(input, "all_gather_into_tensor", writes=False)
        o = _Buffer(output, "all_gather_into_tensor", writes=True)
        return self._queue(
            lambda w: _lib.braid_all_gather_async(i.ptr, o.ptr, i.count, i.code, self._h, None, w),
            [output], (i, o), self._finish_all([o]))

    def allgather(self, output_tensors, input_tensors, opts=None):
        inp = self._one(input_tensors, "allgather")
        if len(output_tensors) != 1 or len(output_tensors[0]) != self._size:
            raise RuntimeError(f"braid: allgather: one list of {self._size} output tensors expected")
        outs = output_tensors[0]
        _cpu_only(outs, "allgather")
        _same_dtype([inp, *outs], "allgather")
        for o in outs:
            if o.numel() != inp.numel():
                raise RuntimeError("braid: allgather: every output tensor must have the input's size")
        flat = torch.empty((self._size, inp.numel()), dtype=inp.dtype)
        i = _Buffer(inp, "allgather", writes=False)
        o = _Buffer(flat, "allgather", writes=False)

        def unpack():
            for r, t in enumerate(outs):
                t.copy_(flat[r].view_as(t))

        return self._queue(
            lambda w: _lib.braid_all_gather_async(i.ptr, o.ptr, i.count, i.code, self._h, None, w),
            output_tensors, (i, o), unpack)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        if len(outputs) != len(inputs):
            raise RuntimeError("braid: allgather_into_tensor_coalesced: as many outputs as inputs")
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _All(works, outputs)

    def _reduce_scatter_base(self, output, input, opts):
        _cpu_only([output, input], "reduce_scatter_tensor")
        _same_dtype([output, input], "reduce_scatter_tensor")
        op = _redop(opts.reduceOp, input, "reduce_scatter_tensor")
        if input.numel() != output.numel() * self._size:
            raise RuntimeError(
                f"braid: reduce_scatter_tensor: the input has {input.numel()} elements, "
                f"{self._size} × {output.numel()} expected")
        i = _Buffer(input, "reduce_scatter_tensor", writes=False)
        o = _Buffer(output, "reduce_scatter_tensor", writes=True)
        return self._queue(
            lambda w: _lib.braid_reduce_scatter_async(i.ptr, o.ptr, o.count, o.code, op, self._h, None, w),
            [output], (i, o), self._finish_all([o]))

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        out = self._one(output_tensors, "reduce_scatter")
        if len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
            raise RuntimeError(f"braid: reduce_scatter: one list of {self._size} input tensors expected")
        ins = input_tensors[0]
        _cpu_only(ins, "reduce_scatter")
        _same_dtype([out, *ins], "reduce_scatter")
        for t in ins:
            if t.numel() != out.numel():
                raise RuntimeError("braid: reduce_scatter: every input tensor must have the output's size")
        op = _redop(opts.reduceOp, out, "reduce_scatter")
        flat = torch.cat([t.reshape(-1) for t in ins]) if ins else torch.empty(0, dtype=out.dtype)
        i = _Buffer(flat, "reduce_scatter", writes=False)
        o = _Buffer(out, "reduce_scatter", writes=True)
        return self._queue(
            lambda w: _lib.braid_reduce_scatter_async(i.ptr, o.ptr, o.count, o.code, op, self._h, None, w),
            output_tensors, (i, o), self._finish_all([o]))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        if len(outputs) != len(inputs):
            raise RuntimeError("braid: reduce_scatter_tensor_coalesced: as many outputs as inputs")
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _All(works, outputs)

    def _all_to_all_v(self, out, inp, send_counts, recv_counts, what, result, finish=None):
        """All-to-all of blocks of the given element counts (of ``inp``'s dtype; packed in rank order)."""
        _cpu_only([out, inp], what)
        _same_dtype([out, inp], what)
        i = _Buffer(inp, what, writes=False)
        o = _Buffer(out, what, writes=True)
        mult = _DTYPES[inp.dtype][1]
        n = self._size
        import ctypes

        arrays = []
        for counts in (send_counts, recv_counts):
            counts = [int(c) * mult for c in counts]
            displs, at = [], 0
            for c in counts:
                displs.append(at)
                at += c
            arrays += [(ctypes.c_size_t * n)(*counts), (ctypes.c_size_t * n)(*displs)]
        extra = finish
        return self._queue(
            lambda w: _lib.braid_all_to_all_v_async(i.ptr, i.count, arrays[0], arrays[1], o.ptr, o.count,
                                                    arrays[2], arrays[3], i.code, self._h, None, w),
            result, (i, o, arrays), self._finish_all([o], extra))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self._size
        if not output_split_sizes and not input_split_sizes:
            if (input.dim() and input.shape[0] % n) or (output.dim() and output.shape[0] % n):
                raise RuntimeError(f"braid: all_to_all_single: the tensors' first dimension does not divide into "
                                   f"{n} equal splits")
            if input.numel() % n or output.numel() != input.numel():
                raise RuntimeError(
                    f"braid: all_to_all_single: {input.numel()} input and {output.numel()} output elements "
                    f"do not split into {n} equal blocks")
            _cpu_only([output, input], "all_to_all_single")
            _same_dtype([output, input], "all_to_all_single")
            i = _Buffer(input, "all_to_all_single", writes=False)
            o = _Buffer(output, "all_to_all_single", writes=True)
            return self._queue(
                lambda w: _lib.braid_all_to_all_async(i.ptr, o.ptr, i.count // n, i.code, self._h, None, w),
                [output], (i, o), self._finish_all([o]))
        # Splits are along the first dimension; a row has the same number of elements in both.
        row_in = input[0].numel() if input.dim() and input.shape[0] else 1
        row_out = output[0].numel() if output.dim() and output.shape[0] else 1
        ins = list(input_split_sizes) or [input.shape[0] // n] * n
        outs = list(output_split_sizes) or [output.shape[0] // n] * n
        if len(ins) != n or len(outs) != n:
            raise RuntimeError(f"braid: all_to_all_single: split sizes must have {n} entries")
        if sum(ins) != (input.shape[0] if input.dim() else 0) or sum(outs) != (output.shape[0] if output.dim() else 0):
            raise RuntimeError("braid: all_to_all_single: the split sizes do not add up to the tensors' first dimension")
        return self._all_to_all_v(output, input, [c * row_in for c in ins], [c * row_out for c in outs],
                                  "all_to_all_single", [output])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        n = self._size
        if len(output_tensors) != n or len(input_tensors) != n:
            raise RuntimeError(f"braid: all_to_all: {n} input and {n} output tensors expected")
        _cpu_only([*output_tensors, *input_tensors], "all_to_all")
        _same_dtype([*output_tensors, *input_tensors], "all_to_all")
        dtype = input_tensors[0].dtype
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype)

        def unpack():
            at = 0
            for t in output_tensors:
                t.copy_(flat_out[at:at + t.numel()].view_as(t))
                at += t.numel()

        return self._all_to_all_v(flat_out, flat_in, [t.numel() for t in input_tensors],
                                  [t.numel() for t in output_tensors], "all_to_all", output_tensors, unpack)

    def gather(self, output_tensors, input_tensors, opts):
        """Every rank's tensor to the root only (an all-to-all in which only the root receives)."""
        inp = self._one(input_tensors, "gather")
        root, n = opts.rootRank, self._size
        is_root = self._rank == root
        k = inp.numel()
        if is_root:
            if len(output_tensors) != 1 or len(output_tensors[0]) != n:
                raise self._one_sided(f"gather: one list of {n} output tensors expected on the root")
            outs = output_tensors[0]
            if any(t.device.type != "cpu" or t.dtype != inp.dtype or t.numel() != k for t in outs):
                raise self._one_sided(f"gather: every output tensor must be a CPU {inp.dtype} tensor of {k} elements")
        elif output_tensors and any(len(o) for o in output_tensors):
            raise self._one_sided("gather: output tensors are given on the root only")
        flat = torch.empty(n * k if is_root else 0, dtype=inp.dtype)
        send = [k if j == root else 0 for j in range(n)]
        recv = [k if is_root else 0 for _ in range(n)]

        def unpack():
            if is_root:
                for r, t in enumerate(outs):
                    t.copy_(flat[r * k:(r + 1) * k].view_as(t))

        return self._all_to_all_v(flat, inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().reshape(-1),
                                  send, recv, "gather", output_tensors, unpack)

    def scatter(self, output_tensors, input_tensors, opts):
        """The root's tensor j to rank j (an all-to-all in which only the root sends)."""
        out = self._one(output_tensors, "scatter")
        root, n = opts.rootRank, self._size
        is_root = self._rank == root
        k = out.numel()
        if is_root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != n:
                raise self._one_sided(f"scatter: one list of {n} input tensors expected on the root")
            ins = input_tensors[0]
            if any(t.device.type != "cpu" or t.dtype != out.dtype or t.numel() != k for t in ins):
                raise self._one_sided(f"scatter: every input tensor must be a CPU {out.dtype} tensor of {k} elements "
                                      "(the output's)")
            flat = torch.cat([t.reshape(-1) for t in ins])
        elif input_tensors and any(len(i) for i in input_tensors):
            raise self._one_sided("scatter: input tensors are given on the root only")
        else:
            flat = torch.empty(0, dtype=out.dtype)
        send = [k if is_root else 0 for _ in range(n)]
        recv = [k if j == root else 0 for j in range(n)]
        return self._all_to_all_v(out, flat, send, recv, "scatter", output_tensors)

    # torch 2.10 and later call these by their new names; earlier ones by the old.
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_to_all_single = alltoall_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def barrier(self, opts=None):
        return self._queue(lambda w: _lib.braid_barrier_async(self._h, None, w), [], ())

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        # braid's barrier is bounded by the timeout and names a rank that did not arrive.
        return self.barrier(opts).wait()

    def send(self, tensors, dst, tag):
        raise RuntimeError("braid: point-to-point send/recv is not supported yet")

    def recv(self, tensors, src, tag):
        raise RuntimeError("braid: point-to-point send/recv is not supported yet")

    def recv_anysource(self, tensors, tag):
        raise RuntimeError("braid: point-to-point send/recv is not supported yet")


def _same_dtype(tensors, what):
    if len({t.dtype for t in tensors}) > 1:
        raise RuntimeError(f"braid: {what}: the tensors' dtypes differ")


class _All(_C10dWork):
    """Several works as one (the coalesced calls): ``wait`` raises the first failure, and the future
    fails if any of theirs does."""

    def __init__(self, works, result):
        super().__init__()
        self._works = works

        def outcome(fut):
            for f in fut.value():
                f.value()  # raises the first failure
            return result

        self._future = torch.futures.collect_all([w.get_future() for w in works]).then(outcome)

    def wait(self, timeout=None):
        for w in self._works:
            w.wait()
        return True

    def get_future(self):
        return self._future


class CompressionState:
    """The state of :func:`compressed_hook`: one braid compressor per parameter (error feedback,
    momentum correction, warm-up and step count), kept by the parameter itself, so that DDP rebuilding
    its buckets after the first step (or any change of bucket layout) loses none of it.

    ``codec`` is braid's compression text (``"topk:0.1"``, ``"int8"``, ``"powersgd:4"``,
    ``"topk:0.01/momentum=0.9/warmup=200"``, ...; see :class:`braid.Compressor`); ``process_group`` a group
    whose backend is braid (default: the default group). ``stats[param]`` holds the last step's statistics
    of each parameter (compression error, density, gradient norm, bytes sent, step)."""

    def __init__(self, codec="topk:0.1", error_feedback=None, process_group=None):
        self.codec = codec
        self.error_feedback = error_feedback
        self.process_group = process_group
        self.compressors = {}
        self.stats = {}

    def communicator(self):
        return _communicator(self.process_group, "compressed_hook")

    def compressor(self, param):
        c = self.compressors.get(param)
        if c is None:
            c = braid.Compressor(param.numel(), self.codec, self.error_feedback, layers=[tuple(param.shape)])
            self.compressors[param] = c
        return c


def _communicator(process_group, what):
    """The braid communicator behind ``process_group`` (default: the default group)."""
    pg = process_group or dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    if not isinstance(backend, BraidBackend):
        raise RuntimeError(
            f"braid: {what} needs a process group whose backend is braid "
            "(dist.init_process_group(\"braid\") or new_group(backend=\"braid\"))")
    return backend._comm


class GradientBuckets:
    """Bucketed gradient all-reduce that overlaps the backward pass, for a training loop without DDP
    (braid's :class:`braid.Buckets` driven by autograd): each parameter's gradient is handed to braid the
    moment autograd has accumulated it (a post-accumulate-grad hook), a full bucket starts its all-reduce
    on braid's high-priority stream while backward goes on, and :meth:`finish` (call it after
    ``loss.backward()``, before ``optimizer.step()``) waits for the rest and writes the reduced gradients
    into ``p.grad``. After the first step the buckets follow the order backward produced the gradients.

    ``op`` is ``"avg"`` (default) or ``"sum"``; ``bucket_bytes`` caps a bucket (None:
    ``BRAID_BUCKET_BYTES``, 25 MiB); ``compression`` (``"topk:0.01"``, ``"int8"``, ...) compresses every
    bucket with error feedback kept per parameter across the rebuild; ``unused_as_zero`` lets a
    parameter without a gradient count as zeros (otherwise the step fails on every rank). Contiguous CPU
    gradients; every rank registers the same parameters. :meth:`no_sync` skips the all-reduce for gradient
    accumulation steps; :meth:`remove` takes the hooks off."""

    def __init__(self, parameters, process_group=None, op="avg", bucket_bytes=None, compression=None,
                 rebuild=True, unused_as_zero=False):
        self.params = [p for p in parameters if p.requires_grad]
        comm = _communicator(process_group, "GradientBuckets")
        specs = []
        for i, p in enumerate(self.params):
            if p.device.type != "cpu":
                raise RuntimeError(f"braid: GradientBuckets: parameter {i} is on {p.device} (CPU tensors only)")
            code, mult = _dtype(p, "GradientBuckets")
            specs.append((p.numel() * mult, code))
        self.buckets = braid.Buckets(comm, specs, op=op, bucket_bytes=bucket_bytes, compression=compression,
                                     rebuild=rebuild, unused_as_zero=unused_as_zero)
        self._sync = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def _hook(self, i):
        def ready(p):
            if not self._sync:
                return
            g = p.grad
            if g is None:
                return
            if not g.is_contiguous() or g.device.type != "cpu":
                raise RuntimeError(f"braid: GradientBuckets: parameter {i}'s gradient is not a contiguous CPU tensor")
            count, code = self.buckets.params[i]
            self.buckets._mark(i, g.data_ptr(), count, code, g.data_ptr(), g)
        return ready

    def mark_all(self):
        """Hands over every parameter's gradient now, last parameter first (after backward passes under
        :meth:`no_sync`, to all-reduce what they accumulated without overlap)."""
        for i in reversed(range(len(self.params))):
            self._hook(i)(self.params[i])

    def finish(self):
        """Waits for every bucket of this step and writes the reduced gradients into ``p.grad``."""
        self.buckets.finish()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block accumulate gradients locally, without all-reducing them."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def layout(self):
        """The parameters (indices into the registered list) of each bucket, in the order they start."""
        return self.buckets.layout()

    def remove(self):
        """Takes the hooks off and releases the buckets."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.buckets.close()


def compressed_hook(state, bucket):
    """A DDP communication hook (``model.register_comm_hook(braid.torch.CompressionState("topk:0.1"),
    braid.torch.compressed_hook)``) that averages each parameter's gradient with braid's compressed
    all-reduce (bit-identical on every rank), its compression state kept per parameter. CPU float32
    gradients."""
    comm = state.communicator()
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        if grad.dtype != torch.float32 or grad.device.type != "cpu" or not grad.is_contiguous():
            raise RuntimeError(
                f"braid: compressed_hook takes contiguous CPU float32 gradients, not {grad.dtype} on {grad.device}")
        state.stats[param] = comm.all_reduce_compressed(grad.numpy().reshape(-1), state.compressor(param), op="avg")
    fut = Future()
    fut.set_result(bucket.buffer())
    return fut


def _create(opts, backend_options=None):
    timeout = opts.timeout if isinstance(opts.timeout, datetime.timedelta) else None
    return BraidBackend(opts.store, opts.group_rank, opts.group_size, timeout)


dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
