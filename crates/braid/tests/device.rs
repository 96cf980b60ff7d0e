//! Collectives on device memory through [`Communicator::device`], on machines without a GPU: the
//! `ipc` transport's rings in emulated device memory (memfd, shared by descriptor over real sockets),
//! and braid-exec's emulated device engine, whose kernels run only when their tickets complete, some
//! polls late, as a GPU's do. Ranks are threads, each with its own communicator. Every result is
//! compared bit for bit with the same collective run by the host communicator on host memory.

use std::sync::Arc;
use std::time::Duration;

use braid::{Communicator, Config, DType, DeviceCommunicator, ReduceOp, UniqueId};
use braid_exec::{CpuEngine, EmulatedDeviceEngine};
use braid_transport::{DeviceAllocation, DeviceMemory, EmulatedDevice, Span};

fn config() -> Config {
    Config {
        timeout: Duration::from_secs(30),
        // Small slots, so that larger collectives pipeline through many of them.
        chunk_bytes: 4096,
        ..Config::default()
    }
}

fn with_ranks<R: Send + 'static>(
    n: usize,
    configs: impl Fn(usize) -> Config,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let id = UniqueId::new().unwrap();
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (id, cfg, f) = (id.clone(), configs(r), f.clone());
            std::thread::spawn(move || f(Communicator::init(n, r, &id, cfg).expect("init")))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
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
    let results = with_ranks(
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
                    unsafe { dev.all_reduce(s.span(), r.span(), count, dtype, op) }.unwrap();
                    assert_eq!(r.bytes(), &want[..], "all_reduce {dtype} {op:?} × {count}");
                    // In place.
                    // SAFETY: as above.
                    unsafe { dev.all_reduce(s.span(), s.span(), count, dtype, op) }.unwrap();
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
            unsafe { dev.all_gather(s.span(), r.span(), count, DType::F32) }.unwrap();
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
            unsafe { dev.reduce_scatter(s.span(), r.span(), count, DType::F32, ReduceOp::Sum) }
                .unwrap();
            assert_eq!(r.bytes(), &shard[..], "reduce_scatter");
            let (mut s, mut r) = (Buf::new(&mem, 999), Buf::new(&mem, 999));
            s.bytes().fill(rank as u8 + 10);
            // SAFETY: as above.
            unsafe { dev.broadcast(s.span(), r.span(), 999, DType::U8, 2) }.unwrap();
            assert!(r.bytes().iter().all(|&b| b == 12), "broadcast from rank 2");
            checked + 3
        },
    );
    assert_eq!(results, vec![33; 3]);
}

#[test]
fn bad_arguments_are_refused_and_change_nothing() {
    with_ranks(
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
                let e = unsafe { dev.all_reduce(send, recv, count, DType::F32, ReduceOp::Sum) }
                    .unwrap_err();
                assert!(
                    e.is_invalid_argument() && e.to_string().contains(want),
                    "{e}"
                );
            }
            // SAFETY: as above.
            let e = unsafe { dev.broadcast(s.span(), r.span(), 16, DType::F32, 2) }.unwrap_err();
            assert!(e.to_string().contains("root 2 is out of range"), "{e}");
            assert!(
                r.bytes().iter().all(|&b| b == 9),
                "a refused call wrote its output"
            );
            host[0] = 1;
            // Still usable: the next collective is exact.
            // SAFETY: both buffers live through the call.
            unsafe { dev.all_reduce(s.span(), r.span(), 64, DType::U8, ReduceOp::Sum) }.unwrap();
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
    let errors = with_ranks(
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
    let errors = with_ranks(
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
