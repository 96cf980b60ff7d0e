"""braid for Python: collective communication over braid's C ABI (``libbraid.so``), through ctypes.

``pip install ./python`` (in braid's source tree) installs it with ``libbraid.so`` inside the package.
The library is found through ``BRAID_LIBRARY`` (a path to ``libbraid.so``), next to this package, in
``target/release`` or ``target/debug`` of the source tree this package sits in, or on the system's
library path.

    import numpy as np
    import braid

    with braid.Communicator.from_env() as comm:     # under `braid run -n 4 -- python3 train.py`
        grads = np.ones(1 << 20, dtype=np.float32)
        comm.all_reduce(grads, op="avg")              # in place
        total = comm.all_reduce(grads, out=np.empty_like(grads))   # out of place

Arrays must be C-contiguous numpy arrays (a receive array also writeable). Every failure raises a
subclass of :class:`BraidError` chosen by braid's result code, carrying braid's message.
"""

import contextlib
import ctypes
import ctypes.util
import itertools
import operator
import os
import time
from pathlib import Path

import numpy as np

__all__ = [
    "Communicator",
    "UniqueId",
    "Work",
    "Compressor",
    "Buckets",
    "Registration",
    "BraidError",
    "InvalidArgumentError",
    "BraidTimeoutError",
    "PeerFailedError",
    "AbortedError",
    "MismatchError",
    "BootstrapError",
    "BraidIOError",
    "PoisonedError",
    "InternalError",
    "BraidOutOfMemoryError",
    "version",
    "library_path",
    "timeline_now",
]

# ---------------------------------------------------------------------------------------------------
# Errors, one class per result code.


class BraidError(RuntimeError):
    """A braid call failed. ``code`` is the braid_result, ``message`` braid's explanation."""

    code = None

    def __init__(self, message, code=None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArgumentError(BraidError, ValueError):
    """An argument was rejected before anything happened; the communicator is still usable."""

    code = 1


class BraidTimeoutError(BraidError, TimeoutError):
    """A wait passed its deadline; the communicator is unusable."""

    code = 2


class PeerFailedError(BraidError):
    """A peer died, aborted or reported an error; the communicator is unusable."""

    code = 3


class AbortedError(BraidError):
    """The communicator was aborted."""

    code = 4


class MismatchError(BraidError):
    """Ranks called different collectives (found with debug checks)."""

    code = 5


class BootstrapError(BraidError):
    """Creating the communicator failed."""

    code = 6


class BraidIOError(BraidError, OSError):
    """An operating-system call failed."""

    code = 7


class PoisonedError(BraidError):
    """An earlier error left the communicator unusable."""

    code = 8


class InternalError(BraidError):
    """A bug in braid."""

    code = 9


class BraidOutOfMemoryError(BraidError, MemoryError):
    """Memory the call needs could not be allocated."""

    code = 10


_ERRORS = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        BraidTimeoutError,
        PeerFailedError,
        AbortedError,
        MismatchError,
        BootstrapError,
        BraidIOError,
        PoisonedError,
        InternalError,
        BraidOutOfMemoryError,
    )
}

# ---------------------------------------------------------------------------------------------------
# The library.


def _candidates():
    env = os.environ.get("BRAID_LIBRARY")
    if env:
        yield Path(env)
        return
    here = Path(__file__).resolve().parent
    yield here / "libbraid.so"
    for root in (here.parent.parent, Path.cwd()):
        for profile in ("release", "debug"):
            yield root / "target" / profile / "libbraid.so"
    found = ctypes.util.find_library("braid")
    if found:
        yield Path(found)


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_absolute() and not path.exists():
            continue
        try:
            return ctypes.CDLL(str(path)), str(path)
        except OSError:
            continue
    raise ImportError(
        "braid: libbraid.so not found. Install the package with its library (`pip install ./python` in "
        "braid's source tree), or build it (`cargo build --release -p braid-capi`) and set BRAID_LIBRARY to "
        "target/release/libbraid.so; tried: " + ", ".join(tried)
    )


_lib, library_path = _load()

_UNIQUE_ID_BYTES = 128
_CONFIG_MAGIC = 0x42524346
_CONFIG_VERSION = 1


class _UniqueIdC(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * _UNIQUE_ID_BYTES)]


class _ConfigC(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("timeout_ms", ctypes.c_uint32),
        ("debug_checks", ctypes.c_int32),
        ("reserved", ctypes.c_uint32 * 11),
    ]


_p = ctypes.c_void_p
_pp = ctypes.POINTER(ctypes.c_void_p)
_i = ctypes.c_int
_sz = ctypes.c_size_t
_SIGNATURES = {
    "braid_get_version": [ctypes.POINTER(_i)],
    "braid_config_init": [ctypes.POINTER(_ConfigC)],
    "braid_get_unique_id": [ctypes.POINTER(_UniqueIdC)],
    "braid_get_unique_id_at": [ctypes.POINTER(_UniqueIdC), ctypes.c_char_p],
    "braid_comm_init_rank": [_pp, _i, _UniqueIdC, _i, ctypes.POINTER(_ConfigC)],
    "braid_comm_init_from_env": [_pp],
    "braid_comm_destroy": [_p],
    "braid_comm_abort": [_p],
    "braid_comm_register": [_p, _p, _sz, ctypes.POINTER(_i)],
    "braid_comm_deregister": [_p, _p, _sz],
    "braid_mem_alloc": [_p, _sz, _pp],
    "braid_mem_free": [_p, _p],
    "braid_comm_get_async_error": [_p, ctypes.POINTER(_i)],
    "braid_comm_count": [_p, ctypes.POINTER(_i)],
    "braid_comm_rank": [_p, ctypes.POINTER(_i)],
    "braid_comm_use_cuda_device": [_p, _i],
    "braid_comm_cuda_progress": [_p, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)],
    "braid_all_reduce": [_p, _p, _sz, _i, _i, _p, _p],
    "braid_reduce_scatter": [_p, _p, _sz, _i, _i, _p, _p],
    "braid_all_gather": [_p, _p, _sz, _i, _p, _p],
    "braid_broadcast": [_p, _p, _sz, _i, _i, _p, _p],
    "braid_reduce": [_p, _p, _sz, _i, _i, _i, _p, _p],
    "braid_barrier": [_p, _p],
    "braid_all_reduce_async": [_p, _p, _sz, _i, _i, _p, _p, _pp],
    "braid_all_gather_async": [_p, _p, _sz, _i, _p, _p, _pp],
    "braid_broadcast_async": [_p, _p, _sz, _i, _i, _p, _p, _pp],
    "braid_reduce_scatter_async": [_p, _p, _sz, _i, _i, _p, _p, _pp],
    "braid_reduce_async": [_p, _p, _sz, _i, _i, _i, _p, _p, _pp],
    "braid_all_to_all_async": [_p, _p, _sz, _i, _p, _p, _pp],
    "braid_all_to_all_v_async": [_p, _sz, ctypes.POINTER(_sz), ctypes.POINTER(_sz), _p, _sz,
                                 ctypes.POINTER(_sz), ctypes.POINTER(_sz), _i, _p, _p, _pp],
    "braid_barrier_async": [_p, _p, _pp],
    "braid_work_wait": [_p],
    "braid_work_test": [_p, ctypes.POINTER(_i)],
    "braid_work_free": [_p],
    "braid_work_on_complete": [_p, _p, _p],
}
for _name, _args in _SIGNATURES.items():
    _f = getattr(_lib, _name)
    _f.argtypes = _args
    _f.restype = _i


class _CompressStatsC(ctypes.Structure):
    _fields_ = [
        ("path", ctypes.c_int),
        ("warnings", ctypes.c_uint32),
        ("len", ctypes.c_uint64),
        ("step", ctypes.c_uint64),
        ("grad_norm", ctypes.c_double),
        ("clip_scale", ctypes.c_double),
        ("residual_norm", ctypes.c_double),
        ("compression_error", ctypes.c_double),
        ("density", ctypes.c_double),
        ("wire_bytes", ctypes.c_uint64),
        ("dense_bytes", ctypes.c_uint64),
        ("sent_bytes", ctypes.c_uint64),
        ("dense_sent_bytes", ctypes.c_uint64),
        ("scheduled_density", ctypes.c_double),
        ("output", ctypes.c_int),
    ]


_PATHS = ["dense", "sum_closed", "power_iteration", "sparse_all_gather", "sparse_dense_switch", "two_phase",
          "sparse_reduce_scatter"]
for _name, _args in {
    "braid_compressor_create": [_pp, ctypes.c_char_p, _i, _sz],
    "braid_compressor_create_layers": [_pp, ctypes.c_char_p, _i, _sz, ctypes.POINTER(ctypes.c_uint64),
                                       ctypes.POINTER(ctypes.c_size_t), _sz],
    "braid_compressor_destroy": [_p],
    "braid_compressor_reset": [_p],
    "braid_compressor_set_learning_rate": [_p, ctypes.c_float],
    "braid_all_reduce_compressed": [_p, _sz, _i, _p, _p, ctypes.POINTER(_CompressStatsC)],
}.items():
    _f = getattr(_lib, _name)
    _f.argtypes = _args
    _f.restype = _i
for _name, _args in {
    "braid_buckets_create": [_pp, _p, _sz, ctypes.POINTER(_sz), ctypes.POINTER(_i), _i, _sz, ctypes.c_char_p,
                             ctypes.c_uint32],
    "braid_buckets_mark_ready": [_p, _sz, _p, _sz, _i, _p],
    "braid_buckets_finish": [_p],
    "braid_buckets_gradient": [_p, _sz, _p, _sz, _i],
    "braid_buckets_layout": [_p, ctypes.POINTER(_sz), ctypes.POINTER(_sz), _sz, ctypes.POINTER(_sz)],
    "braid_buckets_destroy": [_p],
    "braid_timeline_now": [ctypes.POINTER(ctypes.c_uint64)],
    "braid_timeline_event": [_p, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64],
    "braid_timeline_flush": [_p],
}.items():
    _f = getattr(_lib, _name)
    _f.argtypes = _args
    _f.restype = _i
_BUCKETS_NO_REBUILD = 1
_BUCKETS_UNUSED_AS_ZERO = 2
_BUCKETS_PRIVATE_MEMORY = 4
_lib.braid_get_error_string.argtypes = [_i]
_lib.braid_get_error_string.restype = ctypes.c_char_p
_lib.braid_get_last_error_message.argtypes = []
_lib.braid_get_last_error_message.restype = ctypes.c_char_p


def _check(rc):
    """Raises the error class of a non-zero result code, with braid's message for this thread."""
    if rc != 0:
        raise _error_of(rc)


def version():
    """The library's version as major * 10000 + minor * 100 + patch."""
    v = _i()
    _check(_lib.braid_get_version(ctypes.byref(v)))
    return v.value


def timeline_now():
    """The host's monotonic clock in nanoseconds, the clock of the timeline (``BRAID_TIMELINE``)."""
    ns = ctypes.c_uint64()
    _check(_lib.braid_timeline_now(ctypes.byref(ns)))
    return ns.value


# ---------------------------------------------------------------------------------------------------
# Types and ops.

_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4, "band": 5, "bor": 6, "bxor": 7}
_DTYPES = {
    np.dtype(np.int8): 0,
    np.dtype(np.uint8): 1,
    np.dtype(np.int32): 2,
    np.dtype(np.uint32): 3,
    np.dtype(np.int64): 4,
    np.dtype(np.uint64): 5,
    np.dtype(np.float16): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.float64): 8,
}


def _dtype_code(dtype):
    code = _DTYPES.get(np.dtype(dtype))
    if code is None and np.dtype(dtype).name == "bfloat16":  # ml_dtypes.bfloat16
        code = 9
    if code is None:
        raise TypeError(f"braid: unsupported dtype {np.dtype(dtype)}")
    return code


def _op_code(op):
    if isinstance(op, int):
        return op  # checked by braid
    try:
        return _OPS[op.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"braid: unknown op {op!r} (expected one of {', '.join(_OPS)})") from None


# CUDA's handle of the legacy default stream (CU_STREAM_LEGACY): what a CUDA array without a stream of
# its own is ordered on.
_CUDA_STREAM_LEGACY = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DLDeleter)]


_KDL_CUDA = 2
# DLPack (type code, bits) -> braid dtype code; type codes: 0 int, 1 uint, 2 float, 4 bfloat.
_DL_DTYPES = {(0, 8): 0, (1, 8): 1, (0, 32): 2, (1, 32): 3, (0, 64): 4, (1, 64): 5, (2, 16): 6, (2, 32): 7,
              (2, 64): 8, (4, 16): 9}
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_rename = ctypes.pythonapi.PyCapsule_SetName
_capsule_rename.restype = ctypes.c_int
_capsule_rename.argtypes = [ctypes.py_object, ctypes.c_char_p]
# The capsule keeps the pointer to its name: it must outlive every capsule renamed with it.
_USED_DLTENSOR = ctypes.create_string_buffer(b"used_dltensor")


def _contiguous(shape, strides, unit):
    """Whether ``strides`` (in units of ``unit`` bytes, or None) lay ``shape`` out in C order."""
    if strides is None:
        return True
    step, want = unit, []
    for d in reversed(shape):
        want.append(step)
        step *= d
    return tuple(s for s, d in zip(strides, shape) if d > 1) == tuple(
        s for s, d in zip(reversed(want), shape) if d > 1)


def _dlpack_device(obj):
    try:
        return tuple(obj.__dlpack_device__())
    except Exception:
        return None


class _CudaArray:
    """A C-contiguous array in CUDA device memory, taken without a copy from a DLPack producer on a CUDA
    device (``__dlpack__``: PyTorch, JAX, CuPy; bfloat16 included) or from its
    ``__cuda_array_interface__`` (PyTorch, CuPy, Numba): the device pointer, the element count, braid's
    dtype code, and the stream its producer queued work on (version 3 of the interface), if any. DLPack
    producers are asked to order their work on ``stream`` when they export."""

    def __init__(self, obj, name, stream):
        self.obj, self.stream, self._managed = obj, None, None
        dev = _dlpack_device(obj)
        if dev is not None and dev[0] == _KDL_CUDA and hasattr(obj, "__dlpack__"):
            self._from_dlpack(obj, name, stream)
        else:
            self._from_cai(obj, name)

    def _from_cai(self, obj, name):
        try:
            cai = obj.__cuda_array_interface__
        except Exception as e:  # a framework may refuse to export (e.g. bfloat16 tensors)
            raise TypeError(f"braid: {name}: its __cuda_array_interface__ is not available: {e}") from None
        try:
            shape = tuple(int(d) for d in cai["shape"])
            dtype = np.dtype(cai["typestr"])
            ptr, self.readonly = cai["data"]
        except (KeyError, TypeError, ValueError) as e:
            raise TypeError(f"braid: {name}: a malformed __cuda_array_interface__ ({e})") from None
        self.code, self.itemsize = _dtype_code(dtype), dtype.itemsize
        self.size = int(np.prod(shape, dtype=np.int64)) if shape else 1
        strides = cai.get("strides")
        if self.size > 1 and not _contiguous(shape, strides, self.itemsize):
            raise ValueError(f"braid: {name} must be C-contiguous (strides {tuple(strides)})")
        if cai.get("mask") is not None:
            raise ValueError(f"braid: {name}: masked CUDA arrays are not supported")
        self.ptr = int(ptr or 0)
        self.stream = cai.get("stream")

    def _from_dlpack(self, obj, name, stream):
        try:
            cap = obj.__dlpack__(stream=stream)
            ptr = _capsule_pointer(cap, b"dltensor")
        except Exception as e:
            raise TypeError(f"braid: {name}: its DLPack export failed: {e}") from None
        managed = _DLManagedTensor.from_address(ptr)
        # Consumed: the capsule no longer frees it; braid calls the deleter once the collective is over.
        _capsule_rename(cap, _USED_DLTENSOR)
        self._managed = (ptr, managed.deleter)
        t = managed.dl_tensor
        shape = tuple(t.shape[i] for i in range(t.ndim))
        strides = None if not t.strides else tuple(t.strides[i] for i in range(t.ndim))
        code = _DL_DTYPES.get((t.dtype.code, t.dtype.bits)) if t.dtype.lanes == 1 else None
        if code is None:
            self.release()
            raise TypeError(f"braid: {name}: DLPack dtype (code {t.dtype.code}, {t.dtype.bits} bits, "
                            f"{t.dtype.lanes} lanes) is not one braid reduces")
        self.code, self.itemsize = code, t.dtype.bits // 8
        self.size = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if self.size > 1 and not _contiguous(shape, strides, 1):
            self.release()
            raise ValueError(f"braid: {name} must be C-contiguous (strides {strides})")
        self.ptr = int(t.data or 0) + int(t.byte_offset)
        self.readonly = False

    def release(self):
        """Gives a DLPack export back to its producer (once)."""
        if self._managed is not None:
            ptr, deleter = self._managed
            self._managed = None
            if deleter:
                deleter(ptr)

    def c_ptr(self, offset=0):
        return ctypes.c_void_p(self.ptr + offset) if self.size else None


def _is_cuda(a):
    if a is None or isinstance(a, np.ndarray):
        return False
    dev = _dlpack_device(a)
    return hasattr(a, "__cuda_array_interface__") or (dev is not None and dev[0] == _KDL_CUDA)


def _pick_stream(stream, objs):
    """The stream a collective on CUDA arrays is ordered on, as an int: ``stream`` (a ``cudaStream_t`` as
    an int, or an object with ``cuda_stream``, such as ``torch.cuda.Stream``), else an array's own
    (version 3 of ``__cuda_array_interface__``), else, for PyTorch tensors, PyTorch's current stream of
    their device, else the legacy default stream. A handle of 0 is the legacy default stream too (never
    NULL, which means host memory to braid)."""
    if stream is None:
        for o in objs:
            try:
                s = o.__cuda_array_interface__.get("stream")
            except Exception:
                s = None
            if s not in (None, 0):
                stream = s
                break
    if stream is None:
        for o in objs:
            if type(o).__module__.startswith("torch"):
                import torch

                stream = torch.cuda.current_stream(o.device)
                break
    stream = getattr(stream, "cuda_stream", stream)
    stream = int(stream) if stream is not None else 0
    return stream if stream != 0 else _CUDA_STREAM_LEGACY


def _cuda_stream(stream, *arrays):
    """:func:`_pick_stream` for parsed arrays, as a ``c_void_p``."""
    return ctypes.c_void_p(_pick_stream(stream, [a.obj for a in arrays if a is not None]))


class _CudaCall:
    """``x`` and ``out`` (None: ``x``) as CUDA arrays of one dtype, and the stream; a context manager
    that gives DLPack exports back when the call is over."""

    def __init__(self, x, out, what, writeable_x, stream):
        objs = [x] + ([] if out is None else [out])
        self.stream_int = _pick_stream(stream, objs)
        self.stream = ctypes.c_void_p(self.stream_int)
        self.x = _CudaArray(x, "x", self.stream_int)
        try:
            self.out = self.x if out is None else _CudaArray(out, "out", self.stream_int)
            if writeable_x and self.x.readonly:
                raise ValueError(f"braid: {what}: x is read-only")
            if self.out.readonly:
                raise ValueError(f"braid: {what}: out is read-only")
            if self.x.code != self.out.code:
                raise TypeError(f"braid: {what}: dtypes differ ({self.x.code} and {self.out.code} as braid_dtype)")
        except Exception:
            self.release()
            raise

    def release(self):
        self.x.release()
        if getattr(self, "out", None) is not None and self.out is not self.x:
            self.out.release()


def _array(a, name, writeable=False):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"braid: {name} must be a numpy array, not {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"braid: {name} must be C-contiguous")
    if writeable and not a.flags.writeable:
        raise ValueError(f"braid: {name} must be writeable")
    return a


def _ptr(a):
    return ctypes.c_void_p(a.ctypes.data) if a is not None and a.size else None


def _same_kind(a, b, what):
    if a.dtype != b.dtype:
        raise TypeError(f"braid: {what}: dtypes differ ({a.dtype} and {b.dtype})")


class UniqueId:
    """Names a communicator: ``UniqueId.new()`` on the process that will be rank 0, then its ``text``
    (``host:port/secret``) to every rank by any means, and ``UniqueId(text)`` there."""

    def __init__(self, text):
        raw = text.encode() if isinstance(text, str) else bytes(text)
        if len(raw) >= _UNIQUE_ID_BYTES:
            raise ValueError("braid: a unique id is shorter than 128 bytes")
        self.text = raw.decode()

    @classmethod
    def new(cls, listen=None):
        """A fresh id whose root listens in this process: on the loopback interface, or on ``listen``
        (``"host:port"``, an address the other hosts can reach; port 0 for any)."""
        c = _UniqueIdC()
        if listen is None:
            _check(_lib.braid_get_unique_id(ctypes.byref(c)))
        else:
            _check(_lib.braid_get_unique_id_at(ctypes.byref(c), str(listen).encode()))
        return cls(c.internal)

    def _c(self):
        c = _UniqueIdC()
        c.internal = self.text.encode()
        return c

    def __repr__(self):
        return f"UniqueId({self.text.split('/')[0]}/...)"


# braid_work_callback: void (*)(void *user_data, braid_result result).
_WORK_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int)
# Callbacks handed to braid and not yet called, by token: ctypes must keep them alive until then.
_pending_callbacks = {}
_callback_tokens = itertools.count(1)


def _error_of(rc):
    """The exception for a failed result code, with this thread's braid message."""
    message = (_lib.braid_get_last_error_message() or b"").decode("utf-8", "replace")
    if not message:
        message = (_lib.braid_get_error_string(rc) or b"").decode()
    return _ERRORS.get(rc, BraidError)(message, rc)


@_WORK_CALLBACK
def _work_done(token, rc):
    entry = _pending_callbacks.pop(token, None)
    if entry is None:
        return
    fn, keep = entry
    try:
        fn(None if rc == 0 else _error_of(rc))
    except BaseException as e:  # a callback's failure must not reach braid's thread
        import sys
        print(f"braid: a completion callback raised {e!r}", file=sys.stderr)


class Work:
    """An asynchronous collective. ``wait()`` returns its result array; ``test()`` whether it is done;
    ``on_complete(fn)`` calls ``fn`` when it completes. The arrays stay referenced here until the work
    completes."""

    def __init__(self, handle, result, keep):
        self._h = handle
        self._result = result
        self._keep = keep

    def on_complete(self, fn):
        """Calls ``fn(error)`` once the collective completes (``error`` is None, or the
        :class:`BraidError` it failed with): at once if it already has, else on braid's progress
        thread, so ``fn`` should return promptly (it may issue collectives and wait for them). One per work."""
        token = next(_callback_tokens)
        # The arrays stay referenced until the callback has run, even if this Work goes first.
        _pending_callbacks[token] = (fn, self._keep)
        rc = _lib.braid_work_on_complete(self._h, _work_done, ctypes.c_void_p(token))
        if rc != 0:
            _pending_callbacks.pop(token, None)
            _check(rc)

    def test(self):
        done = _i()
        _check(_lib.braid_work_test(self._h, ctypes.byref(done)))
        return bool(done.value)

    def wait(self):
        _check(_lib.braid_work_wait(self._h))
        return self._result

    def free(self):
        if self._h:
            h, self._h = self._h, None
            _check(_lib.braid_work_free(h))
            self._keep = None

    def __del__(self):
        try:
            if self._h:
                # Complete before freeing, so the result array is written while it is still referenced.
                _lib.braid_work_wait(self._h)
                self.free()
        except Exception:
            pass


def _layer_arrays(layers):
    """The flattened ``(dims, ndims)`` ctypes arrays of a list of shapes, checked for plain non-negative
    integers (a float or a negative dimension would otherwise be truncated or wrap on its way to C)."""
    dims, ndims = [], []
    for i, shape in enumerate(layers):
        try:
            shape = [operator.index(d) for d in shape]
        except TypeError:
            raise InvalidArgumentError(
                f"braid: layers[{i}] is not a shape (a sequence of integers): {shape!r}"[:200], 1) from None
        if any(d < 0 or d >= 1 << 64 for d in shape):
            raise InvalidArgumentError(f"braid: layers[{i}] has a dimension out of range: {shape}"[:200], 1)
        dims.extend(shape)
        ndims.append(len(shape))
    return (ctypes.c_uint64 * len(dims))(*dims), (ctypes.c_size_t * len(ndims))(*ndims)


class _Closes:
    """What a handle that frees itself needs besides ``close()``: ``with`` closes it at the block's end,
    garbage collection at the latest (an error then is swallowed: there is no one to tell)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Compressor(_Closes):
    """The compression state of one float32 tensor of ``length`` elements: the configuration as text, a
    codec and options (``"topk:0.1"``, ``"int8"``, ``"topk:0.01/momentum=0.9/warmup=200"``,
    ``"topk:0.1/adam=100"``, ``"powersgd:4"``, ``"none"``, ...; None: the ``BRAID_COMPRESS*`` environment or
    top-k at 10%), error feedback (None: as the text or environment says, default on) and step counter.
    Make one per tensor, the same on every rank, and pass it to :meth:`Communicator.all_reduce_compressed`
    every step.

    ``layers`` lists the shapes of the tensors the buffer holds, in order, e.g. ``[p.shape for p in
    params]`` for a flattened bucket of parameters; their element counts must add up to ``length``.
    PowerSGD then factorises each weight as its own matrix (shape ``(d0, d1, ...)`` as ``d0 x d1*...``) and
    sums 1-D tensors exactly; other codecs check the shapes and ignore them."""

    def __init__(self, length, codec=None, error_feedback=None, layers=None):
        ef = -1 if error_feedback is None else (1 if error_feedback else 0)
        h = ctypes.c_void_p()
        spec = None if codec is None else str(codec).encode()
        if layers is None:
            _check(_lib.braid_compressor_create(ctypes.byref(h), spec, ef, int(length)))
        else:
            dims, ndims = _layer_arrays(layers)
            _check(_lib.braid_compressor_create_layers(ctypes.byref(h), spec, ef, int(length), dims, ndims,
                                                       len(ndims)))
        self._h = h
        self.length = int(length)

    @property
    def handle(self):
        if not self._h:
            raise InvalidArgumentError("braid: the compressor is closed", 1)
        return self._h

    def reset(self):
        """Clears the error buffers (as after loading a checkpoint); every rank resets at the same step."""
        _check(_lib.braid_compressor_reset(self.handle))

    def set_learning_rate(self, lr):
        """Tells the compressor the learning rate the optimizer applies to the next result (call it before
        every compressed all-reduce under a changing schedule, e.g. with ``scheduler.get_last_lr()[0]``):
        when the rate moves from ``a`` to ``b`` the error buffers are scaled by ``a / b``, so a held-back
        gradient moves the parameters as far as it would have at its own step. 0 scales nothing; a
        negative or non-finite rate raises :class:`InvalidArgumentError`. Every rank gives the same rates."""
        _check(_lib.braid_compressor_set_learning_rate(self.handle, float(lr)))

    def close(self):
        if self._h:
            h, self._h = self._h, None
            _check(_lib.braid_compressor_destroy(h))



class Buckets(_Closes):
    """Gradient buckets: many gradients fused into few all-reduces that start during the backward pass, as
    PyTorch DDP's reducer and Horovod's tensor fusion do, for any framework.

    ``params`` lists every parameter as ``(count, dtype)`` (a numpy dtype or a braid dtype code) in the
    order the model lists them, the same on every rank. Buckets hold consecutive parameters of one dtype, in reverse order, at most
    ``bucket_bytes`` bytes each (None: ``BRAID_BUCKET_BYTES``, 25 MiB); the first at most 1 MiB. Each step,
    hand every gradient over as soon as it exists (:meth:`mark_ready`): it is copied into its bucket, and a
    full bucket starts its all-reduce (``op``) at once, after the buckets before it, on the communicator's
    last stream at high priority. :meth:`finish` waits for the rest and writes each result where
    :meth:`mark_ready` said. After the first step the buckets are rebuilt in the order the gradients came on
    rank 0 (``rebuild=False`` keeps the first layout).

    ``compression`` (e.g. ``"topk:0.01"``, ``"int8"``; the grammar of ``BRAID_COMPRESS``) compresses every
    bucket of float32 parameters with its own compressor, ``op`` ``"sum"`` or ``"avg"``; the rebuild keeps
    every parameter's error feedback. Those all-reduces run on a helper thread which owns the communicator
    from a step's first :meth:`mark_ready` until :meth:`finish` returns (no other calls on it meanwhile).

    A parameter not marked by :meth:`finish` fails the step on every rank, unless ``unused_as_zero``.

    With every rank on one host and no compression, the buckets live in memory every rank maps (see
    :meth:`Communicator.alloc`) and their all-reduces run straight through it; ``shared=False`` keeps them in
    private memory."""

    def __init__(self, comm, params, op="avg", bucket_bytes=None, compression=None, rebuild=True,
                 unused_as_zero=False, shared=True):
        params = [(int(n), d if isinstance(d, int) else _dtype_code(d)) for n, d in params]
        self._n = len(params)
        counts = (_sz * self._n)(*[n for n, _ in params])
        codes = (_i * self._n)(*[d for _, d in params])
        flags = (0 if rebuild else _BUCKETS_NO_REBUILD) | (_BUCKETS_UNUSED_AS_ZERO if unused_as_zero else 0)
        flags |= 0 if shared else _BUCKETS_PRIVATE_MEMORY
        spec = None if compression is None else str(compression).encode()
        h = ctypes.c_void_p()
        _check(_lib.braid_buckets_create(ctypes.byref(h), comm.handle, self._n, counts, codes, _op_code(op),
                                         int(bucket_bytes or 0), spec, flags))
        self._h, self._comm, self._keep = h, comm, {}
        self.params = params

    @property
    def handle(self):
        if not self._h:
            raise InvalidArgumentError("braid: the buckets are closed", 1)
        return self._h

    def mark_ready(self, param, grad, out=None):
        """Hands over parameter ``param``'s gradient (a C-contiguous numpy array of its count and dtype),
        copied before this returns. ``out`` (default: ``grad`` if writeable, else none) receives the reduced
        gradient at :meth:`finish`; it stays referenced until then. Refused, changing nothing, for a
        parameter that does not exist, another count or dtype, or a second mark in one step."""
        _array(grad, "grad")
        if out is None and grad.flags.writeable:
            out = grad
        if out is not None:
            _array(out, "out", writeable=True)
            _same_kind(grad, out, "mark_ready")
            if out.size != grad.size:
                raise ValueError(f"braid: mark_ready: out has {out.size} elements, grad {grad.size}")
        self._mark(param, grad.ctypes.data, grad.size, _dtype_code(grad.dtype),
                   None if out is None else out.ctypes.data, out)

    def _mark(self, param, ptr, count, code, out_ptr, keep):
        """:meth:`mark_ready` on raw addresses; ``keep`` stays referenced until :meth:`finish`."""
        _check(_lib.braid_buckets_mark_ready(self.handle, int(param), ctypes.c_void_p(ptr or None), int(count),
                                             code, ctypes.c_void_p(out_ptr or None)))
        if keep is not None:
            self._keep[int(param)] = keep

    def finish(self):
        """Waits for every bucket of this step and writes the results; raises a braid error if a collective
        failed (the communicator is then unusable) or a parameter was not marked."""
        try:
            _check(_lib.braid_buckets_finish(self.handle))
        finally:
            self._keep = {}

    def gradient(self, param, out=None):
        """Parameter ``param``'s reduced gradient of the last step, copied into ``out`` (allocated if None)."""
        n, code = self.params[param]
        if out is None:
            dt = next((d for d, c in _DTYPES.items() if c == code), None)
            if dt is None:
                raise TypeError("braid: gradient: give an out array for bfloat16 parameters")
            out = np.empty(n, dtype=dt)
        _array(out, "out", writeable=True)
        _check(_lib.braid_buckets_gradient(self.handle, int(param), _ptr(out), out.size, _dtype_code(out.dtype)))
        return out

    def layout(self):
        """The parameters of each bucket, in the order the buckets start."""
        order, of = (_sz * max(self._n, 1))(), (_sz * max(self._n, 1))()
        nb = _sz()
        _check(_lib.braid_buckets_layout(self.handle, order, of, self._n, ctypes.byref(nb)))
        out = [[] for _ in range(nb.value)]
        for i in range(self._n):
            out[of[order[i]]].append(order[i])
        return out

    def close(self):
        if self._h:
            h, self._h = self._h, None
            self._keep = {}
            _check(_lib.braid_buckets_destroy(h))


class Registration(_Closes):
    """A numpy array registered with a communicator's transports (:meth:`Communicator.register`).

    Holds the array (so it stays allocated) until :meth:`close`, the end of a ``with`` block, or garbage
    collection deregisters it. ``zero_copy`` says whether a transport sends from it without a copy
    (RDMA does; shared memory and TCP copy anyway)."""

    def __init__(self, comm, array, zero_copy):
        self._comm, self._array, self.zero_copy = comm, array, zero_copy

    def close(self):
        """Deregisters (idempotent), once no send reads the array any more."""
        if self._array is not None:
            a, self._array = self._array, None
            if self._comm._h:
                _check(_lib.braid_comm_deregister(self._comm.handle, _ptr(a), a.nbytes))



class Communicator(_Closes):
    """A group of ranks running collectives together (``braid_comm``)."""

    def __init__(self, handle):
        self._h = ctypes.c_void_p(handle)

    @classmethod
    def from_env(cls):
        """Joins the job described by the environment (``braid run``, torchrun, mpirun, srun)."""
        h = ctypes.c_void_p()
        _check(_lib.braid_comm_init_from_env(ctypes.byref(h)))
        return cls(h.value)

    @classmethod
    def init(cls, nranks, rank, unique_id, timeout_ms=None, debug_checks=None):
        """Joins the communicator named by ``unique_id`` (a :class:`UniqueId` or its text) as ``rank`` of
        ``nranks``. ``timeout_ms`` and ``debug_checks`` override the environment."""
        if not isinstance(unique_id, UniqueId):
            unique_id = UniqueId(unique_id)
        cfg = _ConfigC()
        _check(_lib.braid_config_init(ctypes.byref(cfg)))
        if timeout_ms is not None:
            cfg.timeout_ms = int(timeout_ms)
        if debug_checks is not None:
            cfg.debug_checks = 1 if debug_checks else 0
        h = ctypes.c_void_p()
        _check(_lib.braid_comm_init_rank(ctypes.byref(h), int(nranks), unique_id._c(), int(rank),
                                         ctypes.byref(cfg)))
        return cls(h.value)

    # -- lifetime ----------------------------------------------------------------------------------

    @property
    def handle(self):
        if not self._h:
            raise InvalidArgumentError("braid: the communicator is closed", 1)
        return self._h

    def close(self):
        """Destroys the communicator (idempotent); queued CUDA collectives end first."""
        if self._h:
            h, self._h = self._h, None
            _check(_lib.braid_comm_destroy(h))
            for _, call in self.__dict__.pop("_cuda_pending", []):
                call.release()

    def abort(self):
        """Aborts from any thread: blocked and later collectives fail promptly, peers are told."""
        _check(_lib.braid_comm_abort(self.handle))

    def async_error(self):
        """None, or the error that made the communicator unusable."""
        code = _i()
        _check(_lib.braid_comm_get_async_error(self.handle, ctypes.byref(code)))
        if code.value == 0:
            return None
        message = (_lib.braid_get_last_error_message() or b"").decode("utf-8", "replace")
        return _ERRORS.get(code.value, BraidError)(message, code.value)


    @property
    def rank(self):
        v = _i()
        _check(_lib.braid_comm_rank(self.handle, ctypes.byref(v)))
        return v.value

    @property
    def size(self):
        v = _i()
        _check(_lib.braid_comm_count(self.handle, ctypes.byref(v)))
        return v.value

    def register(self, x):
        """Registers the C-contiguous array ``x`` for sends without a copy (``braid_comm_register``):
        a collective that sends from it out of place (``all_reduce(x, out=y)``, ...) lets an RDMA NIC
        read it directly. Keep ``x`` unchanged while such a collective runs; rewrite it between them
        freely. Returns a :class:`Registration` (a context manager). An array overlapping a registered
        one raises :class:`InvalidArgumentError`."""
        _array(x, "x")
        zero_copy = _i()
        _check(_lib.braid_comm_register(self.handle, _ptr(x), x.nbytes, ctypes.byref(zero_copy)))
        return Registration(self, x, bool(zero_copy.value))

    def alloc(self, shape, dtype=np.float32):
        """A zeroed numpy array of ``shape`` and ``dtype`` in memory every rank of the host maps
        (``braid_mem_alloc``). Collective: every rank calls it, in the same order. Collectives whose
        arrays all lie in such memory, on every rank, run straight through it, with no staging copies
        (all ranks must pass such arrays, or none). Memory the machine does not have raises
        :class:`BraidOutOfMemoryError` on every rank. The memory stays mapped until :meth:`close`: do not use
        the array after closing the communicator."""
        dt = np.dtype(dtype)
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        ptr = ctypes.c_void_p()
        _check(_lib.braid_mem_alloc(self.handle, nbytes, ctypes.byref(ptr)))
        raw = (ctypes.c_char * nbytes).from_address(ptr.value)
        return np.frombuffer(raw, dtype=dt).reshape(shape)

    def free(self, x):
        """Ends the use by collectives of an array from :meth:`alloc` (``braid_mem_free``; not
        collective). Anything else raises :class:`InvalidArgumentError`."""
        _check(_lib.braid_mem_free(self.handle, ctypes.c_void_p(x.__array_interface__["data"][0])))

    # -- collectives -------------------------------------------------------------------------------

    def use_cuda_device(self, device=-1):
        """Gives the communicator a CUDA device (``braid_comm_use_cuda_device``; every rank calls it; -1:
        the local rank's GPU, ``BRAID_CUDA_DEVICE`` overriding), after which the collectives also take
        CUDA arrays (objects with ``__cuda_array_interface__``: PyTorch CUDA tensors, CuPy, Numba) without
        copies. Raises on every rank when any rank has no usable GPU; the communicator stays usable."""
        _check(_lib.braid_comm_use_cuda_device(self.handle, int(device)))

    def _cuda_progress(self):
        issued, completed = ctypes.c_uint64(), ctypes.c_uint64()
        _check(_lib.braid_comm_cuda_progress(self.handle, ctypes.byref(issued), ctypes.byref(completed)))
        return issued.value, completed.value

    def _cuda(self, call, run):
        """A queued CUDA collective: ``run(call)`` checks the arguments and makes the C call, returning its
        result code. On failure the call's exports are given back at once; otherwise they are held until
        the collective ends. Returns the output object."""
        try:
            _check(run(call))
        except BaseException:
            call.release()
            raise
        return self._hold(call)

    def _hold(self, call):
        """Keeps a queued CUDA collective's arrays (and DLPack exports) until it has ended."""
        issued, _ = self._cuda_progress()
        pending = self.__dict__.setdefault("_cuda_pending", [])
        pending.append((issued, call))
        self._prune()
        return call.out.obj

    def _prune(self):
        pending = self.__dict__.get("_cuda_pending")
        if not pending or not self._h:
            return
        _, completed = self._cuda_progress()
        keep = []
        for seq, call in pending:
            if seq <= completed:
                call.release()
            else:
                keep.append((seq, call))
        self._cuda_pending = keep

    def cuda_synchronize(self, timeout=60.0):
        """Waits until every collective issued with a CUDA stream has ended on the GPU (then their
        arrays and DLPack exports are let go), or raises :class:`BraidTimeoutError` after ``timeout``
        seconds; then raises the first error of a device collective, if any."""
        deadline = time.monotonic() + timeout
        while True:
            issued, completed = self._cuda_progress()
            if completed >= issued:
                break
            if time.monotonic() >= deadline:
                raise BraidTimeoutError(f"braid: {issued - completed} CUDA collectives still running", 2)
            time.sleep(0.0002)
        self._prune()
        rc = _i()
        _check(_lib.braid_comm_get_async_error(self.handle, ctypes.byref(rc)))
        _check(rc.value)

    def all_reduce(self, x, op="sum", out=None, stream=None):
        """Reduces ``x`` across ranks into ``out`` (default: ``x`` itself, in place); returns it.

        ``x`` and ``out`` are numpy arrays, or CUDA arrays after :meth:`use_cuda_device`: then the
        collective is ordered after the work queued on ``stream`` (default: the array's own stream, else
        the legacy default stream) and returns once it has finished on the GPU."""
        if _is_cuda(x) or _is_cuda(out):
            def run(c):
                if c.out.size != c.x.size:
                    raise ValueError(f"braid: all_reduce: out has {c.out.size} elements, x {c.x.size}")
                return _lib.braid_all_reduce(c.x.c_ptr(), c.out.c_ptr(), c.x.size, c.x.code, _op_code(op),
                                             self.handle, c.stream)
            return self._cuda(_CudaCall(x, out, "all_reduce", out is None, stream), run)
        _array(x, "x", writeable=out is None)
        out = x if out is None else _array(out, "out", writeable=True)
        _same_kind(x, out, "all_reduce")
        if out.size != x.size:
            raise ValueError(f"braid: all_reduce: out has {out.size} elements, x {x.size}")
        _check(_lib.braid_all_reduce(_ptr(x), _ptr(out), x.size, _dtype_code(x.dtype), _op_code(op),
                                     self.handle, None))
        return out

    def reduce_scatter(self, x, op="sum", out=None, in_place=False, stream=None):
        """Reduces ``x`` (``size`` blocks) across ranks; this rank gets block ``rank``. Returns ``out``
        (allocated if None), or with ``in_place`` the block of ``x`` itself. CUDA arrays as in
        :meth:`all_reduce` (``out`` must then be given, and ``in_place`` is not supported)."""
        world = self.size
        if _is_cuda(x) or _is_cuda(out):
            if out is None or in_place:
                raise ValueError("braid: reduce_scatter: pass out (not in_place) for a CUDA array")
            def run(c):
                if c.x.size % world or c.out.size != c.x.size // world:
                    raise ValueError(f"braid: reduce_scatter: x ({c.x.size}) must be {world} blocks of out's "
                                     f"{c.out.size} elements")
                return _lib.braid_reduce_scatter(c.x.c_ptr(), c.out.c_ptr(), c.out.size, c.x.code, _op_code(op),
                                                 self.handle, c.stream)
            return self._cuda(_CudaCall(x, out, "reduce_scatter", False, stream), run)
        _array(x, "x", writeable=in_place)
        if x.size % world:
            raise ValueError(f"braid: reduce_scatter: {x.size} elements do not split into {world} blocks")
        n = x.size // world
        flat = x.reshape(-1)
        if in_place:
            out = flat[self.rank * n:(self.rank + 1) * n]
        elif out is None:
            out = np.empty(n, dtype=x.dtype)
        else:
            _array(out, "out", writeable=True)
            _same_kind(x, out, "reduce_scatter")
            if out.size != n:
                raise ValueError(f"braid: reduce_scatter: out must hold {n} elements, has {out.size}")
        _check(_lib.braid_reduce_scatter(_ptr(x), _ptr(out), n, _dtype_code(x.dtype), _op_code(op),
                                         self.handle, None))
        return out

    def all_gather(self, x, out=None, stream=None):
        """Every rank's ``x`` in rank order, in ``out`` (allocated if None: ``size · x.size`` elements).
        CUDA arrays as in :meth:`all_reduce` (``out`` must then be given: braid allocates no device memory
        for the caller)."""
        if _is_cuda(x) or _is_cuda(out):
            if out is None:
                raise ValueError("braid: all_gather: pass out for a CUDA array")
            def run(c):
                if c.out.size != c.x.size * self.size:
                    raise ValueError(f"braid: all_gather: out must hold {c.x.size * self.size} elements, "
                                     f"has {c.out.size}")
                return _lib.braid_all_gather(c.x.c_ptr(), c.out.c_ptr(), c.x.size, c.x.code, self.handle,
                                             c.stream)
            return self._cuda(_CudaCall(x, out, "all_gather", False, stream), run)
        _array(x, "x")
        world = self.size
        if out is None:
            out = np.empty(x.size * world, dtype=x.dtype)
        else:
            _array(out, "out", writeable=True)
            _same_kind(x, out, "all_gather")
            if out.size != x.size * world:
                raise ValueError(f"braid: all_gather: out must hold {x.size * world} elements, has {out.size}")
        _check(_lib.braid_all_gather(_ptr(x), _ptr(out), x.size, _dtype_code(x.dtype), self.handle, None))
        return out

    def all_gather_in_place(self, buf):
        """``buf`` holds ``size`` blocks; this rank's block is its contribution. Returns ``buf``."""
        _array(buf, "buf", writeable=True)
        world = self.size
        if buf.size % world:
            raise ValueError(f"braid: all_gather_in_place: {buf.size} elements do not split into {world} blocks")
        n = buf.size // world
        flat = buf.reshape(-1)
        block = flat[self.rank * n:(self.rank + 1) * n]
        _check(_lib.braid_all_gather(_ptr(block), _ptr(buf), n, _dtype_code(buf.dtype), self.handle, None))
        return buf

    def broadcast(self, x, root=0, out=None, stream=None):
        """``root``'s ``x`` into every rank's ``out`` (default: ``x`` itself, in place). CUDA arrays as in
        :meth:`all_reduce`."""
        if _is_cuda(x) or _is_cuda(out):
            def run(c):
                if c.out.size != c.x.size:
                    raise ValueError(f"braid: broadcast: out has {c.out.size} elements, x {c.x.size}")
                return _lib.braid_broadcast(c.x.c_ptr(), c.out.c_ptr(), c.out.size, c.x.code, int(root),
                                            self.handle, c.stream)
            return self._cuda(_CudaCall(x, out, "broadcast", out is None, stream), run)
        _array(x, "x", writeable=out is None)
        out = x if out is None else _array(out, "out", writeable=True)
        _same_kind(x, out, "broadcast")
        if out.size != x.size:
            raise ValueError(f"braid: broadcast: out has {out.size} elements, x {x.size}")
        _check(_lib.braid_broadcast(_ptr(x), _ptr(out), out.size, _dtype_code(x.dtype), int(root),
                                    self.handle, None))
        return out

    def reduce(self, x, op="sum", root=0, out=None, stream=None):
        """Reduces ``x`` across ranks into ``root``'s ``out`` (default: ``x``, in place); other ranks'
        ``out`` is left alone. CUDA arrays as in :meth:`all_reduce`."""
        if _is_cuda(x) or _is_cuda(out):
            def run(c):
                if c.out.size != c.x.size:
                    raise ValueError(f"braid: reduce: out has {c.out.size} elements, x {c.x.size}")
                return _lib.braid_reduce(c.x.c_ptr(), c.out.c_ptr(), c.x.size, c.x.code, _op_code(op), int(root),
                                         self.handle, c.stream)
            return self._cuda(_CudaCall(x, out, "reduce", out is None, stream), run)
        _array(x, "x", writeable=out is None)
        out = x if out is None else _array(out, "out", writeable=True)
        _same_kind(x, out, "reduce")
        if out.size != x.size:
            raise ValueError(f"braid: reduce: out has {out.size} elements, x {x.size}")
        _check(_lib.braid_reduce(_ptr(x), _ptr(out), x.size, _dtype_code(x.dtype), _op_code(op), int(root),
                                 self.handle, None))
        return out

    def barrier(self, stream=None):
        """Returns when every rank has called it; with a CUDA ``stream`` (after :meth:`use_cuda_device`),
        orders that stream's later work after every rank's barrier instead, and returns at once."""
        _check(_lib.braid_barrier(self.handle, None if stream is None else _cuda_stream(stream)))

    def all_reduce_compressed(self, grad, compressor, op="avg"):
        """All-reduces the float32 gradient ``grad`` in place, compressed as ``compressor`` says; returns
        the step's statistics as a dict (``path``, ``compression_error``, ``density``, ``grad_norm``,
        ``wire_bytes``, ``sent_bytes``, ``scheduled_density``, ``output``, ...). ``output`` is ``"gradient"``,
        or ``"momentum"`` for Adam-safe compression past its warm-up (``grad`` then holds Adam's first
        moment averaged over ranks: freeze the optimizer's second moment and step with it)."""
        _array(grad, "grad", writeable=True)
        if grad.dtype != np.float32:
            raise TypeError(f"braid: all_reduce_compressed takes float32, not {grad.dtype}")
        st = _CompressStatsC()
        _check(_lib.braid_all_reduce_compressed(_ptr(grad), grad.size, _op_code(op), compressor.handle,
                                                self.handle, ctypes.byref(st)))
        out = {name: getattr(st, name) for name, _ in _CompressStatsC._fields_}
        out["path"] = _PATHS[st.path] if 0 <= st.path < len(_PATHS) else st.path
        out["output"] = "momentum" if st.output == 1 else "gradient"
        return out

    # -- timeline ----------------------------------------------------------------------------------

    def timeline_event(self, name, start_ns, end_ns):
        """Puts the span ``name`` from ``start_ns`` to ``end_ns`` (:func:`timeline_now` readings) on the
        timeline's ``compute`` thread, beside braid's collectives; nothing without ``BRAID_TIMELINE``."""
        _check(_lib.braid_timeline_event(self.handle, str(name).encode(), int(start_ns), int(end_ns)))

    @contextlib.contextmanager
    def timeline(self, name):
        """``with comm.timeline("backward"):`` marks the block as a span on the timeline."""
        start = timeline_now()
        try:
            yield
        finally:
            self.timeline_event(name, start, timeline_now())

    def timeline_flush(self):
        """Writes the timeline's file now (it is also written when the communicator is closed)."""
        _check(_lib.braid_timeline_flush(self.handle))

    # -- asynchronous ------------------------------------------------------------------------------

    def _work(self, call, result, keep):
        h = ctypes.c_void_p()
        _check(call(ctypes.byref(h)))
        return Work(h, result, keep)

    def all_reduce_async(self, x, op="sum", out=None):
        """Queues an all-reduce that works on ``x`` and ``out`` in place, without copies (both stay
        referenced until it completes); ``wait()`` returns ``out`` (default ``x``)."""
        _array(x, "x", writeable=out is None)
        out = x if out is None else _array(out, "out", writeable=True)
        _same_kind(x, out, "all_reduce_async")
        if out.size != x.size:
            raise ValueError(f"braid: all_reduce_async: out has {out.size} elements, x {x.size}")
        code, o = _dtype_code(x.dtype), _op_code(op)
        return self._work(
            lambda w: _lib.braid_all_reduce_async(_ptr(x), _ptr(out), x.size, code, o, self.handle, None, w),
            out, (x, out))

    def all_gather_async(self, x, out=None):
        """Queues an all-gather; ``wait()`` returns ``out`` (allocated if None)."""
        _array(x, "x")
        if out is None:
            out = np.empty(x.size * self.size, dtype=x.dtype)
        _array(out, "out", writeable=True)
        _same_kind(x, out, "all_gather_async")
        if out.size != x.size * self.size:
            raise ValueError(f"braid: all_gather_async: out must hold {x.size * self.size} elements")
        code = _dtype_code(x.dtype)
        return self._work(
            lambda w: _lib.braid_all_gather_async(_ptr(x), _ptr(out), x.size, code, self.handle, None, w),
            out, (x, out))

    def broadcast_async(self, x, root=0):
        """Queues a broadcast from ``root`` into ``x``; ``wait()`` returns ``x``."""
        _array(x, "x", writeable=True)
        code = _dtype_code(x.dtype)
        return self._work(
            lambda w: _lib.braid_broadcast_async(_ptr(x), _ptr(x), x.size, code, int(root), self.handle, None, w),
            x, (x,))

    def reduce_scatter_async(self, x, op="sum", out=None):
        """Queues a reduce-scatter of ``x`` (``size`` equal blocks); ``wait()`` returns ``out``
        (allocated if None), this rank's reduced block."""
        _array(x, "x")
        if x.size % self.size:
            raise ValueError(f"braid: reduce_scatter_async: {x.size} elements do not split into {self.size} blocks")
        n = x.size // self.size
        if out is None:
            out = np.empty(n, dtype=x.dtype)
        _array(out, "out", writeable=True)
        _same_kind(x, out, "reduce_scatter_async")
        if out.size != n:
            raise ValueError(f"braid: reduce_scatter_async: out must hold {n} elements")
        code, o = _dtype_code(x.dtype), _op_code(op)
        return self._work(
            lambda w: _lib.braid_reduce_scatter_async(_ptr(x), _ptr(out), n, code, o, self.handle, None, w),
            out, (x, out))

    def reduce_async(self, x, op="sum", root=0, out=None):
        """Queues a reduce of ``x`` into ``root``'s ``out`` (default ``x``, in place); ``wait()``
        returns ``out`` on the root and None elsewhere."""
        is_root = self.rank == root
        _array(x, "x", writeable=is_root and out is None)
        if is_root:
            out = x if out is None else _array(out, "out", writeable=True)
            _same_kind(x, out, "reduce_async")
            if out.size != x.size:
                raise ValueError(f"braid: reduce_async: out has {out.size} elements, x {x.size}")
        else:
            out = None
        code, o = _dtype_code(x.dtype), _op_code(op)
        return self._work(
            lambda w: _lib.braid_reduce_async(_ptr(x), _ptr(out), x.size, code, o, int(root), self.handle,
                                              None, w),
            out, (x, out))

    def all_to_all_async(self, x, out=None):
        """Queues an all-to-all: ``x`` and ``out`` (allocated if None) hold ``size`` equal blocks; block j
        of ``x`` goes to rank j, and block p of ``out`` comes from rank p."""
        _array(x, "x")
        if x.size % self.size:
            raise ValueError(f"braid: all_to_all_async: {x.size} elements do not split into {self.size} blocks")
        if out is None:
            out = np.empty_like(x)
        _array(out, "out", writeable=True)
        _same_kind(x, out, "all_to_all_async")
        if out.size != x.size:
            raise ValueError(f"braid: all_to_all_async: out has {out.size} elements, x {x.size}")
        code = _dtype_code(x.dtype)
        return self._work(
            lambda w: _lib.braid_all_to_all_async(_ptr(x), _ptr(out), x.size // self.size, code, self.handle,
                                                  None, w),
            out, (x, out))

    def all_to_all_v_async(self, x, send_counts, recv_counts, out=None, send_displs=None, recv_displs=None):
        """Queues an all-to-all of blocks of any size (``MPI_Alltoallv``): ``send_counts[j]`` elements of
        ``x`` (at ``send_displs[j]``, default packed in rank order) go to rank j, and rank p's block lands
        in ``recv_counts[p]`` elements of ``out`` (at ``recv_displs[p]``; ``out`` allocated if None). Counts
        must agree pairwise, or the collective fails on both ranks with :class:`MismatchError`."""
        _array(x, "x")
        n = self.size
        send_counts, recv_counts = _counts(send_counts, n, "send_counts"), _counts(recv_counts, n, "recv_counts")
        send_displs = _displs(send_displs, send_counts, "send_displs")
        recv_displs = _displs(recv_displs, recv_counts, "recv_displs")
        if out is None:
            out = np.empty(max((d + c for d, c in zip(recv_displs, recv_counts)), default=0), dtype=x.dtype)
        _array(out, "out", writeable=True)
        _same_kind(x, out, "all_to_all_v_async")
        arrays = [(ctypes.c_size_t * n)(*v) for v in (send_counts, send_displs, recv_counts, recv_displs)]
        code = _dtype_code(x.dtype)
        return self._work(
            lambda w: _lib.braid_all_to_all_v_async(_ptr(x), x.size, arrays[0], arrays[1], _ptr(out), out.size,
                                                    arrays[2], arrays[3], code, self.handle, None, w),
            out, (x, out, arrays))

    def barrier_async(self):
        return self._work(lambda w: _lib.braid_barrier_async(self.handle, None, w), None, ())


def _counts(v, n, name):
    try:
        v = [operator.index(c) for c in v]
    except TypeError:
        raise InvalidArgumentError(f"braid: {name} must be integers", 1) from None
    if len(v) != n or any(c < 0 for c in v):
        raise InvalidArgumentError(f"braid: {name} must be {n} non-negative integers, one per rank", 1)
    return v


def _displs(v, counts, name):
    if v is None:
        out, at = [], 0
        for c in counts:
            out.append(at)
            at += c
        return out
    return _counts(v, len(counts), name)
