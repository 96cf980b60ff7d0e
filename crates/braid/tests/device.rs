//! Collectives on device memory through [`Communicator::device`], on machines without a GPU: the
//! `ipc` transport's rings in emulated device memory (memfd, shared by descriptor over real sockets),
//! and braid-exec's emulated device engine, whose kernels run only when their tickets complete, some
//! polls late, as a GPU's do. Ranks are threads, each with its own communicator. Every result is
//! compared bit for bit with the same collective run by the host communicator on host memory.

use std::sync::Arc;
use std::time::Duration;

use braid::{Communicator, Config, DType, DeviceCommunicator, ReduceOp};
use braid_exec::{CpuEngine, EmulatedDeviceEngine};
use braid_transport::{DeviceAllocation, DeviceMemory, EmulatedDevice, Span};

use braid_testkit::ranks::with_ranks_each;

fn config() -> Config {
    Config {
        timeout: Duration::from_secs(30),
        // Small slots, so that larger collectives pipeline through many of them.
        chunk_bytes: 4096,
        ..Config::default()
    }
}

/// Emulated device memory of `bytes`, with its host view.
struct Buf {
    alloc: Box<dyn DeviceAllocation>,
    len: usize,
}

impl Buf {
    fn new(mem: &EmulatedDevice, bytes: usize) -> Buf {
        let (alloc, _fd) = mem.allocate(bytes.max(1).next_multiple_of(4096)).unwrap();
        Buf { alloc, len: bytes }
    }
    fn span(&self) -> Span {
        // SAFETY: the allocation lives as long as the buffer, longer than every collective on it.
        unsafe { Span::device(self.alloc.addr(), self.len, 0) }
    }
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: emulated device memory is host memory mapped here; no collective runs on it now.
        unsafe { std::slice::from_raw_parts_mut(self.alloc.addr() as *mut u8, self.len) }
    }
}

fn device(c: &Communicator, lag: u32) -> DeviceCommunicator {
    c.device(
        Arc::new(EmulatedDevice::new(0)),
        Box::new(EmulatedDeviceEngine::new(0, lag)),
    )
    .expect("device communicator")
}

fn input(rank: usize, dtype: DType, bytes: usize, salt: usize) -> Vec<u8> {
    (0..bytes)
        .map(|i| {
            let e = i / dtype.size();
            match (dtype, i % dtype.size()) {
                // Floats from small integers (exactly summable), as whole elements.
                (DType::F32, 3) | (DType::F64, 7) => 0x40,
                (DType::F32, _) | (DType::F64, _) => 0,
                (DType::BF16 | DType::F16, 1) => 0x3c + ((e + rank + salt) % 3) as u8,
                _ => ((e * 7 + rank * 13 + salt) % 251) as u8,
            }
        })
        .collect()
}

#[test]
fn device_collectives_equal_the_host_collectives_bit_for_bit() {
    let results = with_ranks_each(
        3,
        |_| config(),
        |c| {
            let dev = device(&c, 2);
            assert_eq!(
                dev.peer_transports()
                    .iter()
                    .filter(|t| **t == "ipc")
                    .count(),
                2
            );
            let mem = EmulatedDevice::new(0);
            let rank = c.rank();
            let world = c.world_size();
            let mut checked = 0;
            for (dtype, op) in [
                (DType::F32, ReduceOp::Sum),
                (DType::I32, ReduceOp::Max),
                (DType::BF16, ReduceOp::Avg),
                (DType::U8, ReduceOp::Prod),
                (DType::F64, ReduceOp::Min),
            ] {
                for count in [1usize, 1000, 40_000] {
                    let bytes = count * dtype.size();
                    let data = input(rank, dtype, bytes, count);
                    // The host's answer.
                    let mut want = vec![0u8; bytes];
                    c.all_reduce_bytes(&data, &mut want, dtype, op).unwrap();
                    // Out of place on the device.
                    let (mut s, mut r) = (Buf::new(&mem, bytes), Buf::new(&mem, bytes));
                    s.bytes().copy_from_slice(&data);
                    // SAFETY: both buffers live through the call and nothing else touches them.
                    unsafe {
                        dev.all_reduce_op(s.span(), r.span(), count, dtype, op)
                            .and_then(|op| dev.run(op))
                    }
                    .unwrap();
                    assert_eq!(r.bytes(), &want[..], "all_reduce {dtype} {op:?} × {count}");
                    // In place.
                    // SAFETY: as above.
                    unsafe {
                        dev.all_reduce_op(s.span(), s.span(), count, dtype, op)
                            .and_then(|op| dev.run(op))
                    }
                    .unwrap();
                    assert_eq!(s.bytes(), &want[..], "in place {dtype} {op:?} × {count}");
                    checked += 2;
                }
            }
            // All-gather, reduce-scatter and broadcast against the host's.
            let count = 5000;
            let data = input(rank, DType::F32, count * 4, 1);
            let mut want = vec![0f32; count * world];
            let send: Vec<f32> = data
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            c.all_gather(&send, &mut want).unwrap();
            let (mut s, mut r) = (Buf::new(&mem, count * 4), Buf::new(&mem, count * 4 * world));
            s.bytes().copy_from_slice(&data);
            // SAFETY: as above.
            unsafe {
                dev.all_gather_op(s.span(), r.span(), count, DType::F32)
                    .and_then(|op| dev.run(op))
            }
            .unwrap();
            let got: Vec<f32> = r
                .bytes()
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            assert_eq!(got, want, "all_gather");
            let big = input(rank, DType::F32, count * 4 * world, 2);
            let mut shard = vec![0u8; count * 4];
            c.reduce_scatter_bytes(&big, &mut shard, DType::F32, ReduceOp::Sum)
                .unwrap();
            let (mut s, mut r) = (Buf::new(&mem, big.len()), Buf::new(&mem, count * 4));
            s.bytes().copy_from_slice(&big);
            // SAFETY: as above.
            unsafe {
                dev.reduce_scatter_op(s.span(), r.span(), count, DType::F32, ReduceOp::Sum)
                    .and_then(|op| dev.run(op))
            }
            .unwrap();
            assert_eq!(r.bytes(), &shard[..], "reduce_scatter");
            let (mut s, mut r) = (Buf::new(&mem, 999), Buf::new(&mem, 999));
            s.bytes().fill(rank as u8 + 10);
            // SAFETY: as above.
            unsafe {
                dev.broadcast_op(s.span(), r.span(), 999, DType::U8, 2)
                    .and_then(|op| dev.run(op))
            }
            .unwrap();
            assert!(r.bytes().iter().all(|&b| b == 12), "broadcast from rank 2");
            checked + 3
        },
    );
    assert_eq!(results, vec![33; 3]);
}

#[test]
fn bad_arguments_are_refused_and_change_nothing() {
    with_ranks_each(
        2,
        |_| config(),
        |c| {
            let dev = device(&c, 0);
            let mem = EmulatedDevice::new(0);
            let (mut s, mut r) = (Buf::new(&mem, 64), Buf::new(&mem, 64));
            s.bytes().fill(1);
            r.bytes().fill(9);
            let mut host = vec![0u8; 64];
            let h = Span::of_slice(&host);
            let other = {
                // SAFETY: an address only; refused before use.
                unsafe { Span::device(s.span().addr() as u64, 64, 1) }
            };
            let cases: [(Span, Span, usize, &str); 4] = [
                (h, r.span(), 16, "the send buffer is host memory"),
                (
                    s.span(),
                    other,
                    16,
                    "the receive buffer is memory of device 1",
                ),
                (
                    s.span(),
                    r.span(),
                    15,
                    "has 64 bytes, the collective needs 60",
                ),
                (s.span(), r.span(), usize::MAX / 2, "overflow"),
            ];
            for (send, recv, count, want) in cases {
                // SAFETY: every span is refused before the collective touches it.
                let e = unsafe {
                    dev.all_reduce_op(send, recv, count, DType::F32, ReduceOp::Sum)
                        .and_then(|op| dev.run(op))
                }
                .unwrap_err();
                assert!(
                    e.is_invalid_argument() && e.to_string().contains(want),
                    "{e}"
                );
            }
            // SAFETY: as above.
            let e = unsafe {
                dev.broadcast_op(s.span(), r.span(), 16, DType::F32, 2)
                    .and_then(|op| dev.run(op))
            }
            .unwrap_err();
            assert!(e.to_string().contains("root 2 is out of range"), "{e}");
            assert!(
                r.bytes().iter().all(|&b| b == 9),
                "a refused call wrote its output"
            );
            host[0] = 1;
            // Still usable: the next collective is exact.
            // SAFETY: both buffers live through the call.
            unsafe {
                dev.all_reduce_op(s.span(), r.span(), 64, DType::U8, ReduceOp::Sum)
                    .and_then(|op| dev.run(op))
            }
            .unwrap();
            assert!(r.bytes().iter().all(|&b| b == 2));
            // An engine that cannot compute on the memory is refused on every rank alike.
            let e = c
                .device(Arc::new(EmulatedDevice::new(0)), Box::new(CpuEngine::new()))
                .map(|_| ())
                .unwrap_err();
            assert!(
                e.to_string()
                    .contains("does not compute on the memory of device 0"),
                "{e}"
            );
        },
    );
}

#[test]
fn ranks_on_several_hosts_are_refused_on_every_rank() {
    let errors = with_ranks_each(
        2,
        |r| Config {
            host_id: Some(format!("host-{r}")),
            transport: "tcp".into(),
            ..config()
        },
        |c| {
            c.device(
                Arc::new(EmulatedDevice::new(0)),
                Box::new(EmulatedDeviceEngine::new(0, 0)),
            )
            .map(|_| ())
            .unwrap_err()
            .to_string()
        },
    );
    for e in errors {
        assert!(e.contains("need every rank on one host"), "{e}");
    }
}

#[test]
fn a_rank_that_cannot_open_its_device_fails_the_call_on_every_rank() {
    let errors = with_ranks_each(
        3,
        |_| config(),
        |c| {
            let made: Result<braid::DeviceParts, braid::Error> = if c.rank() == 1 {
                Err(braid::Error::Io {
                    context: "no CUDA driver".into(),
                    message: "not on this rank".into(),
                })
            } else {
                Ok((
                    Arc::new(EmulatedDevice::new(0)),
                    Box::new(EmulatedDeviceEngine::new(0, 0)),
                ))
            };
            let e = c.device_from(made).map(|_| ()).unwrap_err().to_string();
            // The communicator stays usable.
            let mut x = [1u32];
            c.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
            assert_eq!(x[0], 3);
            e
        },
    );
    assert!(
        errors[1].contains("no CUDA driver: not on this rank"),
        "{}",
        errors[1]
    );
    for e in [&errors[0], &errors[2]] {
        assert!(e.contains("opening the device: another rank failed"), "{e}");
    }
}

struct FlagGate(Arc<std::sync::atomic::AtomicBool>);

impl braid::DeviceGate for FlagGate {
    fn wait(&mut self, until: std::time::Instant) -> Result<(), braid::Error> {
        while !self.0.load(std::sync::atomic::Ordering::Acquire) {
            if std::time::Instant::now() >= until {
                return Err(braid::Error::invalid("the gate never opened"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }
}

struct Record(Arc<std::sync::Mutex<Vec<(usize, bool)>>>, usize);

impl braid::DeviceSignal for Record {
    fn fire(self: Box<Self>, result: &Result<(), braid::Error>) {
        self.0.lock().unwrap().push((self.1, result.is_ok()));
    }
}

#[test]
fn queued_device_collectives_keep_issue_order_wait_for_their_gate_and_signal_when_done() {
    with_ranks_each(
        3,
        |_| config(),
        |c| {
            let dev = device(&c, 3);
            let mem = EmulatedDevice::new(0);
            let world = c.world_size() as u32;
            let rank = c.rank() as u32;
            let count = 20_000;
            let bufs: Vec<Buf> = (0..3).map(|_| Buf::new(&mem, count * 4)).collect();
            let mut bufs = bufs;
            for (i, b) in bufs.iter_mut().enumerate() {
                let v: Vec<u8> = (0..count as u32)
                    .flat_map(|e| (e + rank * 7 + i as u32).to_le_bytes())
                    .collect();
                b.bytes().copy_from_slice(&v);
            }
            let open = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let fired = Arc::new(std::sync::Mutex::new(Vec::new()));
            for (i, b) in bufs.iter().enumerate() {
                let op = dev
                    .all_reduce_op(b.span(), b.span(), count, DType::U32, ReduceOp::Sum)
                    .unwrap();
                let gate: Box<dyn braid::DeviceGate> = if i == 0 {
                    Box::new(FlagGate(open.clone()))
                } else {
                    Box::new(braid::Ready)
                };
                // SAFETY: the buffers live until every signal has fired (waited for below).
                unsafe { dev.enqueue(op, gate, Box::new(Record(fired.clone(), i))) }.unwrap();
            }
            // The first waits for its gate, and the others wait behind it: nothing has run yet.
            std::thread::sleep(Duration::from_millis(100));
            assert!(
                fired.lock().unwrap().is_empty(),
                "a collective ran before its gate opened"
            );
            assert_eq!(dev.queued(), 3);
            open.store(true, std::sync::atomic::Ordering::Release);
            // A blocking collective issued now runs after the three queued ones.
            let mut x = Buf::new(&mem, 4);
            x.bytes().copy_from_slice(&1u32.to_le_bytes());
            // SAFETY: `x` lives through the call.
            unsafe {
                dev.all_reduce_op(x.span(), x.span(), 1, DType::U32, ReduceOp::Sum)
                    .and_then(|op| dev.run(op))
            }
            .unwrap();
            assert_eq!(x.bytes(), &world.to_le_bytes());
            assert_eq!(
                *fired.lock().unwrap(),
                vec![(0, true), (1, true), (2, true)]
            );
            assert_eq!(dev.queued(), 0);
            let sum_r: u32 = (0..world).map(|r| r * 7).sum();
            for (i, b) in bufs.iter_mut().enumerate() {
                let got = b.bytes();
                for e in [0usize, 1, count / 2, count - 1] {
                    let v = u32::from_le_bytes(got[e * 4..e * 4 + 4].try_into().unwrap());
                    assert_eq!(
                        v,
                        world * (e as u32 + i as u32) + sum_r,
                        "op {i} element {e}"
                    );
                }
            }
            assert!(dev.async_error().is_none());
        },
    );
}

#[test]
fn a_failed_queued_collective_still_signals_and_every_later_one_fails_at_once() {
    let cfg = || Config {
        timeout: Duration::from_millis(500),
        ..config()
    };
    with_ranks_each(
        2,
        move |_| cfg(),
        |c| {
            let dev = device(&c, 0);
            let mem = EmulatedDevice::new(0);
            let b = Buf::new(&mem, 64);
            let fired = Arc::new(std::sync::Mutex::new(Vec::new()));
            let never = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let op = dev
                .all_reduce_op(b.span(), b.span(), 16, DType::F32, ReduceOp::Sum)
                .unwrap();
            // SAFETY: `b` lives until the signal has fired (waited for below).
            unsafe {
                dev.enqueue(
                    op,
                    Box::new(FlagGate(never)),
                    Box::new(Record(fired.clone(), 0)),
                )
            }
            .unwrap();
            let t = std::time::Instant::now();
            while fired.lock().unwrap().is_empty() {
                assert!(
                    t.elapsed() < Duration::from_secs(20),
                    "the signal never fired"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(*fired.lock().unwrap(), vec![(0, false)]);
            let first = dev.async_error().expect("the failure is sticky");
            assert!(
                first.to_string().contains("the gate never opened"),
                "{first}"
            );
            // SAFETY: refused before anything runs.
            let e = unsafe {
                dev.enqueue(
                    op,
                    Box::new(braid::Ready),
                    Box::new(Record(fired.clone(), 1)),
                )
            }
            .unwrap_err();
            assert!(matches!(e, braid::Error::Poisoned { .. }), "{e}");
            // SAFETY: refused before anything runs.
            let e = unsafe { dev.run(op) }.unwrap_err();
            assert!(e.to_string().contains("the gate never opened"), "{e}");
            assert_eq!(
                fired.lock().unwrap().len(),
                1,
                "a refused collective fired its signal"
            );
            // The host communicator is untouched.
            let mut y = [1u8];
            c.all_reduce_in_place(&mut y, ReduceOp::Sum).unwrap();
            assert_eq!(y[0], 2);
        },
    );
}

#[test]
fn device_reduce_to_every_root_and_a_queued_barrier() {
    with_ranks_each(
        3,
        |_| config(),
        |c| {
            let dev = device(&c, 1);
            let mem = EmulatedDevice::new(0);
            let rank = c.rank();
            let count = 3000;
            for root in 0..c.world_size() {
                let data = input(rank, DType::I32, count * 4, root);
                let mut want = vec![0u8; count * 4];
                c.reduce_bytes(&data, &mut want, DType::I32, ReduceOp::Sum, root)
                    .unwrap();
                let (mut s, mut r) = (Buf::new(&mem, count * 4), Buf::new(&mem, count * 4));
                s.bytes().copy_from_slice(&data);
                r.bytes().fill(0x5a);
                let op = dev
                    .reduce_op(s.span(), r.span(), count, DType::I32, ReduceOp::Sum, root)
                    .unwrap();
                // SAFETY: both buffers live through the call.
                unsafe { dev.run(op) }.unwrap();
                if rank == root {
                    assert_eq!(r.bytes(), &want[..], "reduce to root {root}");
                } else {
                    assert!(
                        r.bytes().iter().all(|&b| b == 0x5a),
                        "a non-root's receive buffer was written"
                    );
                    assert_eq!(s.bytes(), &data[..], "a non-root's send buffer changed");
                }
            }
            let fired = Arc::new(std::sync::Mutex::new(Vec::new()));
            // SAFETY: a barrier touches no memory.
            unsafe {
                dev.enqueue(
                    dev.barrier_op().unwrap(),
                    Box::new(braid::Ready),
                    Box::new(Record(fired.clone(), 7)),
                )
            }
            .unwrap();
            let mut x = Buf::new(&mem, 4);
            x.bytes().copy_from_slice(&2u32.to_le_bytes());
            // SAFETY: `x` lives through the call (which runs after the queued barrier).
            unsafe {
                dev.all_reduce_op(x.span(), x.span(), 1, DType::U32, ReduceOp::Sum)
                    .and_then(|op| dev.run(op))
            }
            .unwrap();
            assert_eq!(x.bytes(), &6u32.to_le_bytes());
            assert_eq!(*fired.lock().unwrap(), vec![(7, true)]);
        },
    );
}
