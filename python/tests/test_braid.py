"""Tests of the Python binding. Run as every rank of a job: `braid run -n 4 -- python3 test_braid.py`.

Every rank runs the same tests in the same order (unittest sorts them by name), so their collectives
match up. Expected values are exact: inputs are small integers.
"""

import os
import sys
import unittest
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import braid  # noqa: E402

DTYPES = [np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16, np.float32, np.float64]
OPS = ["sum", "prod", "max", "min", "avg"]


def inputs(rank, n, dtype, op):
    i = np.arange(n)
    if op == "prod":
        v = 1 + (rank + i) % 2
    else:
        v = (rank * 3 + i) % 11
        if np.issubdtype(dtype, np.signedinteger) or np.issubdtype(dtype, np.floating):
            v = v - 5 if op != "avg" else v
    return v.astype(np.float64)


def expected(world, n, dtype, op):
    rows = np.stack([inputs(r, n, dtype, op) for r in range(world)])
    if op in ("sum", "avg"):
        out = rows.sum(axis=0)
        if op == "avg":
            out = out / world
            if not np.issubdtype(dtype, np.floating):
                out = np.trunc(out)
    elif op == "prod":
        out = rows.prod(axis=0)
    elif op == "max":
        out = rows.max(axis=0)
    else:
        out = rows.min(axis=0)
    return out.astype(dtype)


class Collectives(unittest.TestCase):
    comm = None

    @classmethod
    def setUpClass(cls):
        cls.comm = braid.Communicator.from_env()
        cls.rank, cls.world = cls.comm.rank, cls.comm.size

    @classmethod
    def tearDownClass(cls):
        cls.comm.close()

    def test_a_identity(self):
        self.assertEqual(self.rank, int(os.environ["BRAID_RANK"]))
        self.assertEqual(self.world, int(os.environ["BRAID_WORLD_SIZE"]))
        self.assertGreaterEqual(braid.version(), 100)
        self.assertTrue(braid.library_path.endswith("libbraid.so"))

    def test_all_reduce_every_dtype_and_op(self):
        n = 301
        for dtype in DTYPES:
            for op in OPS:
                x = inputs(self.rank, n, dtype, op).astype(dtype)
                want = expected(self.world, n, dtype, op)
                out = self.comm.all_reduce(x, op=op, out=np.zeros_like(x))
                np.testing.assert_array_equal(out, want, err_msg=f"{dtype.__name__} {op}")
                np.testing.assert_array_equal(x, inputs(self.rank, n, dtype, op).astype(dtype))
                same = self.comm.all_reduce(x, op=op)
                self.assertIs(same, x)
                np.testing.assert_array_equal(x, want, err_msg=f"in place {dtype.__name__} {op}")

    def test_all_reduce_2d_and_empty(self):
        x = np.full((64, 33), self.rank + 1, dtype=np.float32)
        self.comm.all_reduce(x)
        self.assertTrue((x == self.world * (self.world + 1) / 2).all())
        empty = np.zeros(0, dtype=np.float64)
        self.comm.all_reduce(empty)
        self.assertEqual(empty.size, 0)

    def test_registered_send_buffer(self):
        n = 100003
        x = np.empty(n, dtype=np.float32)
        y = np.empty(n, dtype=np.float32)
        with self.comm.register(x) as reg:
            # Shared memory copies anyway; the registration is kept and says so.
            self.assertFalse(reg.zero_copy)
            with self.assertRaises(braid.InvalidArgumentError) as e:
                self.comm.register(x[10:20])
            self.assertIn("overlaps", str(e.exception))
            # Rewritten between collectives while registered: each result is of the data sent now.
            for op in ["sum", "max", "prod"]:
                x[:] = inputs(self.rank, n, np.float32, op)
                self.comm.all_reduce(x, op=op, out=y)
                np.testing.assert_array_equal(y, expected(self.world, n, np.float32, op))
        reg.close()  # idempotent
        # Deregistered: the same range registers again.
        self.comm.register(x).close()

    def test_shared_memory(self):
        n = 100003
        x = self.comm.alloc(n, np.float32)
        y = self.comm.alloc((n,), np.float32)
        self.assertEqual((x.shape, x.dtype), ((n,), np.float32))
        self.assertTrue((x == 0).all())
        for op in ["sum", "max", "prod"]:
            x[:] = inputs(self.rank, n, np.float32, op)
            self.comm.all_reduce(x, op=op, out=y)
            np.testing.assert_array_equal(y, expected(self.world, n, np.float32, op))
            self.comm.all_reduce(x, op=op)
            np.testing.assert_array_equal(x, expected(self.world, n, np.float32, op))
        small = self.comm.alloc((2, 3), np.int64)
        small[:] = self.rank
        self.comm.all_reduce(small)
        self.assertTrue((small == self.world * (self.world - 1) // 2).all())
        with self.assertRaises(braid.InvalidArgumentError):
            self.comm.free(np.zeros(4))
        with self.assertRaises(braid.InvalidArgumentError):
            self.comm.alloc(0)
        for a in (x, y, small):
            self.comm.free(a)

    def test_reduce_scatter(self):
        n = 17
        for op in ("sum", "max"):
            x = inputs(self.rank, n * self.world, np.float32, op).astype(np.float32)
            want = expected(self.world, n * self.world, np.float32, op)[self.rank * n:(self.rank + 1) * n]
            np.testing.assert_array_equal(self.comm.reduce_scatter(x, op=op), want)
            block = self.comm.reduce_scatter(x, op=op, in_place=True)
            np.testing.assert_array_equal(block, want)
            np.testing.assert_array_equal(x[self.rank * n:(self.rank + 1) * n], want)

    def test_all_gather(self):
        n = 9
        mine = np.arange(n, dtype=np.int64) + 100 * self.rank
        want = np.concatenate([np.arange(n, dtype=np.int64) + 100 * r for r in range(self.world)])
        np.testing.assert_array_equal(self.comm.all_gather(mine), want)
        buf = np.zeros(n * self.world, dtype=np.int64)
        buf[self.rank * n:(self.rank + 1) * n] = mine
        np.testing.assert_array_equal(self.comm.all_gather_in_place(buf), want)

    def test_cuda_arrays_are_parsed_and_routed_to_the_device_path(self):
        # Objects exporting __cuda_array_interface__ (as PyTorch CUDA tensors do). Without a GPU the
        # communicator has no device, so braid refuses them naming the stream; the parsing, the
        # checks before the call and the no-driver path of use_cuda_device are what runs here.
        class Fake:
            def __init__(self, host, strides=None, readonly=False, stream=None, typestr=None):
                self.host = host
                self.__cuda_array_interface__ = {
                    "shape": host.shape, "typestr": typestr or host.dtype.str, "strides": strides,
                    "data": (host.ctypes.data, readonly), "version": 3, "stream": stream}

        x = np.arange(12, dtype=np.float32)
        # The stream: given, else the array's own, else the legacy default stream (1), never NULL.
        class TorchLikeStream:
            cuda_stream = 0
        stream_of = lambda s, a=None: braid._pick_stream(s, [a or Fake(x)])
        self.assertEqual(stream_of(None), 1)
        self.assertEqual(stream_of(TorchLikeStream()), 1)
        self.assertEqual(stream_of(0), 1)
        self.assertEqual(stream_of(0x7f00), 0x7f00)
        self.assertEqual(stream_of(None, Fake(x, stream=0x5000)), 0x5000)
        with self.assertRaises(braid.InvalidArgumentError) as e:
            self.comm.all_reduce(Fake(x))
        self.assertIn("has no device (call braid_comm_use_cuda_device first", str(e.exception))
        with self.assertRaises(braid.InvalidArgumentError):
            self.comm.all_gather(Fake(x), out=Fake(np.zeros(12 * self.world, dtype=np.float32)), stream=7)
        with self.assertRaises(braid.InvalidArgumentError):
            self.comm.reduce(Fake(x), root=0)
        with self.assertRaises(braid.InvalidArgumentError) as e:
            self.comm.barrier(stream=7)
        self.assertIn("has no device", str(e.exception))
        with self.assertRaises(ValueError) as e:
            self.comm.all_reduce(Fake(np.zeros((3, 4), dtype=np.float32), strides=(4, 12)))
        self.assertIn("C-contiguous", str(e.exception))
        with self.assertRaises(ValueError) as e:
            self.comm.all_reduce(Fake(x, readonly=True))
        self.assertIn("read-only", str(e.exception))
        with self.assertRaises(TypeError) as e:
            self.comm.all_reduce(Fake(x), out=Fake(np.zeros(12, dtype=np.float64)))
        self.assertIn("dtypes differ", str(e.exception))
        with self.assertRaises(ValueError) as e:
            self.comm.all_gather(Fake(x))
        self.assertIn("pass out", str(e.exception))
        with self.assertRaises(ValueError) as e:
            self.comm.reduce_scatter(Fake(x), out=Fake(np.zeros(5, dtype=np.float32)))
        self.assertIn("blocks", str(e.exception))
        np.testing.assert_array_equal(x, np.arange(12, dtype=np.float32))  # nothing was written
        # DLPack producers on a CUDA device (PyTorch's bfloat16 tensors only export this way): the
        # export is parsed (pointer + byte offset, shape, strides, dtype), the stream is handed to the
        # producer, and the export is given back (its deleter called) whatever the outcome.
        import ctypes

        class FakeDL:
            def __init__(self, host, code, bits, strides=None, offset=0):
                self.host, self.code, self.bits, self.strides, self.offset = host, code, bits, strides, offset
                self.deleted, self.streams = 0, []

            def __dlpack_device__(self):
                return (2, 0)

            def __dlpack__(self, stream=None):
                self.streams.append(stream)
                self.shape_c = (ctypes.c_int64 * 1)(self.host.size * self.host.itemsize * 8 // self.bits)
                self.strides_c = None if self.strides is None else (ctypes.c_int64 * 1)(*self.strides)
                self.mt = braid._DLManagedTensor()
                t = self.mt.dl_tensor
                t.data, t.ndim, t.byte_offset = self.host.ctypes.data, 1, self.offset
                t.device.device_type, t.device.device_id = 2, 0
                t.dtype.code, t.dtype.bits, t.dtype.lanes = self.code, self.bits, 1
                t.shape = self.shape_c
                t.strides = self.strides_c
                self.deleter = braid._DLDeleter(lambda _: setattr(self, "deleted", self.deleted + 1))
                self.mt.deleter = self.deleter
                new = ctypes.pythonapi.PyCapsule_New
                new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
                return new(ctypes.addressof(self.mt), b"dltensor", None)

        raw = np.zeros(64, dtype=np.uint16)
        bf = FakeDL(raw, 4, 16, offset=4)
        a = braid._CudaArray(bf, "x", 0x77)
        self.assertEqual((a.code, a.size, a.itemsize, a.ptr), (9, 64, 2, raw.ctypes.data + 4))
        self.assertEqual(bf.streams, [0x77])
        a.release()
        a.release()
        self.assertEqual(bf.deleted, 1)
        self.assertTrue(braid._is_cuda(bf))
        with self.assertRaises(braid.InvalidArgumentError) as e:
            self.comm.all_reduce(bf, stream=0x99)  # routed to the device path: no device here
        self.assertIn("has no device", str(e.exception))
        self.assertEqual((bf.deleted, bf.streams[-1]), (2, 0x99))
        with self.assertRaises(ValueError):
            braid._CudaArray(FakeDL(raw, 2, 32, strides=(2,)), "x", 1)
        with self.assertRaises(TypeError) as e:
            braid._CudaArray(FakeDL(raw, 5, 16), "x", 1)  # complex: not reducible
        self.assertIn("not one braid reduces", str(e.exception))
        # use_cuda_device: every rank at once; without a GPU it raises on every rank, and the
        # communicator keeps working.
        try:
            self.comm.use_cuda_device()
            had_gpu = True
        except braid.BraidError as e:
            had_gpu = False
            self.assertTrue("CUDA" in str(e) or "another rank failed" in str(e), str(e))
        y = np.ones(4, dtype=np.int32)
        self.comm.all_reduce(y)
        self.assertTrue((y == self.world).all())
        if not had_gpu:
            self.assertEqual(self.comm._cuda_progress(), (0, 0))
        self.comm.cuda_synchronize(timeout=5)
        if had_gpu:
            with self.assertRaises(braid.InvalidArgumentError) as e:
                self.comm.all_reduce(Fake(x))  # host memory behind a CUDA array: refused, named
            self.assertIn("is host memory", str(e.exception))

    def test_broadcast_and_reduce_every_root(self):
        n = 50
        for root in range(self.world):
            x = np.arange(n, dtype=np.float64) * (root + 1) if self.rank == root else np.zeros(n)
            self.comm.broadcast(x, root=root)
            np.testing.assert_array_equal(x, np.arange(n) * (root + 1.0))
            y = np.full(n, self.rank + 1, dtype=np.int32)
            out = np.zeros(n, dtype=np.int32)
            self.comm.reduce(y, op="sum", root=root, out=out)
            if self.rank == root:
                self.assertTrue((out == self.world * (self.world + 1) // 2).all())
            else:
                self.assertTrue((out == 0).all())

    def test_async(self):
        xs = [np.full(1000, self.rank + k, dtype=np.float32) for k in range(3)]
        works = [self.comm.all_reduce_async(x, op="sum") for x in xs]
        for k, w in reversed(list(enumerate(works))):
            out = w.wait()
            self.assertTrue((out == sum(r + k for r in range(self.world))).all())
            w.free()
        g = self.comm.all_gather_async(np.array([self.rank], dtype=np.uint8))
        while not g.test():
            pass
        np.testing.assert_array_equal(g.wait(), np.arange(self.world, dtype=np.uint8))
        g.free()
        b = np.full(4, 7.0) if self.rank == 0 else np.zeros(4)
        self.comm.broadcast_async(b, root=0).wait()
        self.assertTrue((b == 7.0).all())
        self.comm.barrier_async().wait()
        self.comm.barrier()

    def test_buckets(self):
        for shared in (True, False):  # in memory every rank maps (the default) and in private memory
            with self.subTest(shared=shared):
                self._buckets(shared)

    def _buckets(self, shared):
        params = [(1000, np.float32), (17, np.int32), (0, np.float32), (5, np.float64), (3000, np.float32)]
        b = braid.Buckets(self.comm, params, op="sum", bucket_bytes=4096, shared=shared)
        self.assertEqual(b.layout(), [[4], [3], [2], [1], [0]])
        rs = self.world * (self.world - 1) // 2
        for step in range(3):
            grads = [np.arange(n, dtype=d) + self.rank + step for n, d in params]
            # Every rank its own order; rank 0 registration order, which the rebuild then follows.
            order = list(range(len(params))) if self.rank == 0 else [4, 1, 3, 0, 2]
            kept = grads[1].copy()
            outs = {}
            for p in order:
                if p == 1:
                    b.mark_ready(p, kept, out=np.zeros_like(kept))
                    outs[p] = b._keep[p]
                else:
                    b.mark_ready(p, grads[p])
            with self.assertRaises(braid.InvalidArgumentError) as e:
                b.mark_ready(0, grads[0])
            self.assertIn("already marked ready", str(e.exception))
            b.finish()
            for p, (n, d) in enumerate(params):
                want = (self.world * np.arange(n) + rs + self.world * step).astype(d)
                got = outs.get(p, grads[p])
                np.testing.assert_array_equal(got, want, err_msg=f"step {step} parameter {p}")
                np.testing.assert_array_equal(b.gradient(p), want)
            np.testing.assert_array_equal(kept, grads[1], err_msg="the gradient given with an out changed")
        self.assertEqual(b.layout(), [[0], [1], [2], [3], [4]])
        with self.assertRaises(braid.InvalidArgumentError) as e:
            b.mark_ready(9, grads[0])
        self.assertIn("parameter 9 does not exist", str(e.exception))
        with self.assertRaises(braid.InvalidArgumentError):
            b.mark_ready(0, grads[0].astype(np.float64))
        b.close()
        with self.assertRaises(braid.InvalidArgumentError):
            b.finish()
        # Compressed, fp16 of small integers (exact), averaged.
        with braid.Buckets(self.comm, [(100, np.float32), (7, np.float32)], op="avg", compression="fp16") as c:
            g = [np.full(100, 2.0 * self.rank, np.float32), np.full(7, 4.0, np.float32)]
            c.mark_ready(1, g[1])
            c.mark_ready(0, g[0])
            c.finish()
            np.testing.assert_array_equal(g[0], np.full(100, self.world - 1.0, np.float32))
            np.testing.assert_array_equal(g[1], np.full(7, 4.0, np.float32))
        with self.assertRaises(braid.InvalidArgumentError) as e:
            braid.Buckets(self.comm, [(4, np.int32)], compression="topk:0.1")
        self.assertIn("compression takes f32 gradients", str(e.exception))

    def test_timeline_markers(self):
        t0 = braid.timeline_now()
        with self.comm.timeline("compute"):
            pass
        t1 = braid.timeline_now()
        self.assertGreaterEqual(t1, t0)
        self.comm.timeline_event("step", t0, t1)
        with self.assertRaises(braid.InvalidArgumentError) as e:
            self.comm.timeline_event("step", t1 + 1, t1)
        self.assertIn("ends", str(e.exception))
        self.comm.timeline_flush()

    def test_compressed(self):
        n = 2048
        i = np.arange(n)
        for codec, exact in (("none", True), ("fp16", True), ("topk:0.1", False), ("topk:0.1/sparse=auto", False),
                             ("int8", False), ("mxfp8", False), ("mxfp8:e5m2", False), ("mxfp4", False),
                             ("powersgd:2", False)):
            with braid.Compressor(n, codec, error_feedback=True) as c:
                for step in range(2):
                    g = ((i * 3 + (self.rank + step) * 7) % 17 - 8).astype(np.float32)
                    st = self.comm.all_reduce_compressed(g, c, op="avg")
                    self.assertEqual((st["step"], st["len"]), (step + 1, n), codec)
                    self.assertTrue(0 < st["density"] <= 1, codec)
                    self.assertIsInstance(st["path"], str)
                    if codec == "topk:0.1/sparse=auto":
                        # The traffic model gathers on two ranks, reduce-scatters from three on.
                        want = "sparse_reduce_scatter" if self.world >= 3 else "sparse_all_gather"
                        self.assertEqual(st["path"], want, codec)
                    elif codec.startswith("topk"):
                        # By default the pairs are gathered (the exact sum of the sparse updates).
                        self.assertIn(st["path"], ("sparse_all_gather", "sparse_dense_switch"), codec)
                    elif codec == "int8" or codec.startswith("mx"):
                        # Quantised in blocks: shards reduced by their owners, then gathered.
                        self.assertEqual(st["path"], "two_phase", codec)
                    everyone = self.comm.all_gather(g).reshape(self.world, n)
                    for r in range(self.world):
                        np.testing.assert_array_equal(everyone[r], g, err_msg=f"{codec}: rank {r} differs")
                    if exact:
                        want = np.mean([(i * 3 + (r + step) * 7) % 17 - 8 for r in range(self.world)], axis=0)
                        np.testing.assert_array_equal(g, want.astype(np.float32), err_msg=codec)
                c.reset()
        with braid.Compressor(n, "topk:0.1") as same, braid.Compressor(n, "topk:0.1") as halved:
            for step in range(2):
                same.set_learning_rate(0.1)
                halved.set_learning_rate(0.1 if step == 0 else 0.05)
                g = ((i * 3 + (self.rank + step) * 7) % 17 - 8).astype(np.float32)
                h = g.copy()
                self.comm.all_reduce_compressed(g, same, op="avg")
                self.comm.all_reduce_compressed(h, halved, op="avg")
                # A halved rate doubles what was held back, so only the second step differs.
                self.assertEqual(bool(np.any(g != h)), step == 1, f"step {step}")
            with self.assertRaises(braid.InvalidArgumentError) as e:
                same.set_learning_rate(-1)
            self.assertIn("learning rate", str(e.exception))
        with braid.Compressor(n, "topk:0.1/adam=1/noef") as c:
            outputs = []
            for step in range(3):
                g = ((i * 3 + (self.rank + step) * 7) % 17 - 8).astype(np.float32)
                outputs.append(self.comm.all_reduce_compressed(g, c, op="avg")["output"])
            self.assertEqual(outputs, ["gradient", "momentum", "momentum"])
        with braid.Compressor(n, "topk:0.01/warmup=4:0.5") as c:
            g = np.ones(n, dtype=np.float32)
            self.assertEqual(self.comm.all_reduce_compressed(g, c)["scheduled_density"], 0.5)
        with self.assertRaises(braid.InvalidArgumentError) as e:
            braid.Compressor(n, "topk:7")
        self.assertIn("codec_spec", str(e.exception))
        with self.assertRaises(braid.InvalidArgumentError) as e:
            braid.Compressor(n, "dense/momentum=0.9")
        self.assertIn("momentum correction", str(e.exception))
        with braid.Compressor(n, "int8") as c, self.assertRaises(braid.InvalidArgumentError) as e:
            self.comm.all_reduce_compressed(np.zeros(n - 1, dtype=np.float32), c)
        self.assertIn("len", str(e.exception))

    def test_compressed_layers(self):
        # A linear layer 64 -> 32 (weight, bias), a 3-D weight, a scalar, a weight too small to factorise.
        shapes = [(32, 64), (32,), (8, 4, 10), (), np.zeros((10, 2)).shape]
        n = sum(int(np.prod(s)) for s in shapes)
        i = np.arange(n)
        with braid.Compressor(n, "powersgd:2", error_feedback=True, layers=shapes) as c:
            for step in range(3):
                g = ((i * 3 + (self.rank + step) * 7) % 17 - 8).astype(np.float32)
                want = sum((i * 3 + (r + step) * 7) % 17 - 8 for r in range(self.world)).astype(np.float32)
                st = self.comm.all_reduce_compressed(g, c, op="sum")
                self.assertEqual(st["path"], "power_iteration")
                self.assertLess(st["wire_bytes"], st["dense_bytes"] / 3)
                everyone = self.comm.all_gather(g).reshape(self.world, n)
                for r in range(self.world):
                    np.testing.assert_array_equal(everyone[r], g, err_msg=f"layers: rank {r} differs")
                # The bias, the scalar and the small weight are summed exactly.
                for lo, hi in ((2048, 2080), (2400, 2421)):
                    np.testing.assert_array_equal(g[lo:hi], want[lo:hi])
        # Only 1-D tensors: the same bits as no compression.
        g = ((i * 5 + self.rank) % 13 - 6).astype(np.float32) * np.float32(0.1)
        h = g.copy()
        with braid.Compressor(n, "powersgd:4", layers=[(n - 1,), ()]) as c, braid.Compressor(n, "none") as d:
            self.comm.all_reduce_compressed(g, c, op="sum")
            self.comm.all_reduce_compressed(h, d, op="sum")
        np.testing.assert_array_equal(g, h)
        for bad, why in (([(32, 64)], "add up to"), ([(32, 0), (n,)], "dimension 1 is 0"),
                         ([(2.5, 2)], "not a shape"), ([(-1,)], "out of range"), ([7], "not a shape")):
            with self.assertRaises(braid.InvalidArgumentError) as e:
                braid.Compressor(n, "powersgd:2", layers=bad)
            self.assertIn(why, str(e.exception), bad)
        with braid.Compressor(0, "powersgd:2", layers=[]) as c:
            self.assertEqual(c.length, 0)

    def test_errors_are_typed_and_leave_the_communicator_usable(self):
        x = np.ones(8, dtype=np.float32)
        with self.assertRaises(braid.InvalidArgumentError) as e:
            self.comm.broadcast(x, root=self.world)
        self.assertIn("root", str(e.exception))
        self.assertEqual(e.exception.code, 1)
        self.assertIsInstance(e.exception, braid.BraidError)
        self.assertIsInstance(e.exception, ValueError)
        with self.assertRaises(braid.InvalidArgumentError) as e:
            self.comm.all_reduce(x, op=17)
        self.assertIn("op 17", e.exception.message)
        with self.assertRaises(ValueError):
            self.comm.all_reduce(x, op="median")
        with self.assertRaises(ValueError):
            self.comm.all_reduce(np.ones((4, 4), dtype=np.float32)[:, 1])
        with self.assertRaises(TypeError):
            self.comm.all_reduce(np.ones(3, dtype=np.complex64))
        with self.assertRaises(TypeError):
            self.comm.all_reduce([1.0, 2.0])
        self.assertIsNone(self.comm.async_error())
        self.comm.all_reduce(x)
        self.assertTrue((x == self.world).all())


class Standalone(unittest.TestCase):
    def test_unique_id_abort_and_close(self):
        uid = braid.UniqueId.new()
        self.assertIn("/", uid.text)
        with braid.Communicator.init(1, 0, uid, timeout_ms=10000, debug_checks=True) as c:
            self.assertEqual((c.rank, c.size), (0, 1))
            x = np.arange(5, dtype=np.float64)
            c.all_reduce(x, op="max")
            np.testing.assert_array_equal(x, np.arange(5))
            c.abort()
            with self.assertRaises((braid.AbortedError, braid.PoisonedError)) as e:
                c.all_reduce(x)
            self.assertIn("abort", str(e.exception))
            self.assertIsInstance(c.async_error(), braid.AbortedError)
        with self.assertRaises(braid.InvalidArgumentError):
            c.barrier()
        c.close()  # idempotent

    def test_unique_id_at_an_address(self):
        uid = braid.UniqueId.new(listen="127.0.0.1:0")
        self.assertTrue(uid.text.startswith("127.0.0.1:"))
        with braid.Communicator.init(1, 0, uid) as c:
            self.assertEqual(c.size, 1)
        with self.assertRaises(braid.InvalidArgumentError) as e:
            braid.UniqueId.new(listen="nowhere:99999")
        self.assertIn("listen_addr", str(e.exception))

    def test_bad_init_arguments(self):
        with self.assertRaises(braid.InvalidArgumentError) as e:
            braid.Communicator.init(2, 5, braid.UniqueId("127.0.0.1:1/" + "0" * 32))
        self.assertIn("rank 5", str(e.exception))
        with self.assertRaises(braid.InvalidArgumentError) as e:
            braid.Communicator.init(2, 0, "not an id")
        self.assertIn("not a braid unique id", str(e.exception))


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=1).result
    rank = os.environ.get("BRAID_RANK", "?")
    ok = result.wasSuccessful() and result.testsRun > 0
    print(f"rank {rank}: python {'ok' if ok else 'FAILED'} ({result.testsRun} tests)", flush=True)
    sys.exit(0 if ok else 1)
