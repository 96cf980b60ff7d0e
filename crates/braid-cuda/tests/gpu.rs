//! braid-cuda on a GPU: devices, memory, pointer kinds, streams and events, modules, every reduce-copy
//! kernel of the catalogue against braid-core bit for bit (the cases of the host tests, in device
//! memory), and the device engine against the CPU engine for every kernel the executor hands an engine.
//!
//! Where there is no driver or no GPU these tests print why and return, as CI (which has no GPU) runs
//! them; `BRAID_REQUIRE_GPU=1` (set by scripts/gpu-check.sh) makes that a failure. Without a driver,
//! `without_a_driver_every_constructor_says_so` checks the other side: errors, not panics.

mod support;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use braid_core::{DType, Error, ReduceOp};
use braid_cuda::{
    driver_available, kernel_name, pointer_kind, CudaEngine, CudaMemory, DeviceBuffer, Event, Gpu,
    HostRegistration, IpcMode, Module, PinnedBuffer, PointerKind, Priority, ReduceCopyKernels,
    Shape, Stream,
};
use braid_exec::{CpuEngine, Engine, Kernel, Operand as KOperand};
use braid_testkit::process::{hex, read_marked, unhex, ChildTest};
use braid_transport::Span;
use support::cases::{check_kernel, data, Grid, Operand, Rng, Runner};

fn gpu_required() -> bool {
    std::env::var("BRAID_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// Device 0 (or `BRAID_CUDA_DEVICE`'s), or `None` after printing why there is none.
fn gpu() -> Option<Gpu> {
    match Gpu::for_local_rank(0) {
        Ok(g) => Some(g),
        Err(e) => {
            assert!(!gpu_required(), "BRAID_REQUIRE_GPU=1, but: {e}");
            println!("SKIPPED: needs a GPU: {e}");
            None
        }
    }
}

fn kernels(gpu: &Gpu) -> Arc<ReduceCopyKernels> {
    static K: OnceLock<Arc<ReduceCopyKernels>> = OnceLock::new();
    K.get_or_init(|| Arc::new(ReduceCopyKernels::load(gpu).expect("loading the kernels")))
        .clone()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

#[test]
fn without_a_driver_every_constructor_says_so() {
    if driver_available().is_ok() {
        println!("not applicable: this machine has a CUDA driver (the GPU tests cover it)");
        return;
    }
    for err in [
        Gpu::count().map(|_| ()).unwrap_err(),
        Gpu::open(0).map(|_| ()).unwrap_err(),
        Gpu::for_local_rank(3).map(|_| ()).unwrap_err(),
        pointer_kind(0x1000).map(|_| ()).unwrap_err(),
    ] {
        let text = err.to_string();
        assert!(text.starts_with("no CUDA driver: "), "{text}");
        assert!(text.contains("libcuda.so.1"), "{text}");
    }
}

#[test]
fn the_device_describes_itself() {
    let Some(gpu) = gpu() else { return };
    let name = gpu.name().unwrap();
    let (major, minor) = gpu.compute_capability().unwrap();
    let (least, greatest) = gpu.stream_priorities().unwrap();
    println!(
        "device {}: {name}, sm_{major}{minor}, {} SMs, {} GiB, PCI {}, stream priorities {least}..{greatest}",
        gpu.ordinal(),
        gpu.multiprocessors().unwrap(),
        gpu.total_memory().unwrap() >> 30,
        gpu.pci_address().unwrap()
    );
    assert!(!name.is_empty());
    assert!(major >= 7, "compute capability {major}.{minor}");
    assert_eq!(gpu.arch().unwrap(), 10 * major + minor);
    assert!(gpu.multiprocessors().unwrap() >= 1);
    assert!(gpu.total_memory().unwrap() > 1 << 30);
    assert!(greatest <= least, "{least}..{greatest}");
    assert_eq!(gpu.pci_address().unwrap().len(), 12);
    let count = Gpu::count().unwrap();
    let err = Gpu::open(count).unwrap_err().to_string();
    assert!(
        err.contains(&format!("device {count} does not exist")),
        "{err}"
    );
}

#[test]
fn device_memory_round_trips_and_refuses_what_is_outside_it() {
    let Some(gpu) = gpu() else { return };
    let mut buf = DeviceBuffer::alloc(&gpu, 1 << 20).unwrap();
    let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 7 + 3) as u8).collect();
    buf.write(0, &data).unwrap();
    let mut back = vec![0u8; 1 << 20];
    buf.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    let mut part = vec![0u8; 100];
    buf.read(12345, &mut part).unwrap();
    assert_eq!(part, data[12345..12445]);
    let err = buf.write((1 << 20) - 4, &[0u8; 8]).unwrap_err();
    assert!(err.is_invalid_argument(), "{err}");
    assert!(err.to_string().contains("outside a device buffer"), "{err}");
    assert!(buf.read(usize::MAX, &mut part).is_err());
    let empty = DeviceBuffer::alloc(&gpu, 0).unwrap();
    assert!(empty.is_empty());
    let err = DeviceBuffer::alloc(&gpu, 1 << 60).map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory(_)), "{err}");
}

#[test]
fn pointer_kinds_tell_host_pinned_and_device_memory_apart() {
    let Some(gpu) = gpu() else { return };
    let pageable = vec![0u8; 4096];
    assert_eq!(
        pointer_kind(pageable.as_ptr() as usize).unwrap(),
        PointerKind::Host
    );
    let pinned = PinnedBuffer::alloc(&gpu, 4096).unwrap();
    assert!(pinned.as_slice().iter().all(|&b| b == 0));
    assert_eq!(
        pointer_kind(pinned.as_slice().as_ptr() as usize).unwrap(),
        PointerKind::PinnedHost
    );
    let dev = DeviceBuffer::alloc(&gpu, 4096).unwrap();
    assert_eq!(
        pointer_kind(dev.addr() as usize).unwrap(),
        PointerKind::Device {
            ordinal: gpu.ordinal()
        }
    );
    assert_eq!(
        pointer_kind(dev.addr() as usize + 100).unwrap(),
        PointerKind::Device {
            ordinal: gpu.ordinal()
        }
    );
    let mut registered = vec![0u8; 1 << 16];
    {
        // SAFETY: the vector outlives the registration and nothing else registers it.
        let _reg =
            unsafe { HostRegistration::new(&gpu, registered.as_mut_ptr(), registered.len()) }
                .unwrap();
        assert_eq!(
            pointer_kind(registered.as_ptr() as usize).unwrap(),
            PointerKind::PinnedHost
        );
    }
    assert_eq!(
        pointer_kind(registered.as_ptr() as usize).unwrap(),
        PointerKind::Host
    );
}

#[test]
fn streams_order_work_by_events_and_time_it() {
    let Some(gpu) = gpu() else { return };
    let (least, greatest) = gpu.stream_priorities().unwrap();
    let high = Stream::new(&gpu, Priority::High).unwrap();
    let low = Stream::new(&gpu, Priority::Normal).unwrap();
    assert_eq!((high.priority(), low.priority()), (greatest, least));
    let bytes = 64 << 20;
    let a = DeviceBuffer::alloc(&gpu, bytes).unwrap();
    let b = DeviceBuffer::alloc(&gpu, bytes).unwrap();
    let (start, filled, end) = (
        Event::new(&gpu, true).unwrap(),
        Event::new(&gpu, false).unwrap(),
        Event::new(&gpu, true).unwrap(),
    );
    start.record(&low).unwrap();
    // SAFETY: both buffers live until the streams are synchronised below; nothing else touches them.
    unsafe { low.fill(a.addr(), 0x5a, bytes).unwrap() };
    filled.record(&low).unwrap();
    high.wait_event(&filled).unwrap();
    // SAFETY: as above; the copy is ordered after the fill by the event.
    unsafe { high.copy(b.addr(), a.addr(), bytes).unwrap() };
    end.record(&high).unwrap();
    end.synchronize(soon()).unwrap();
    high.synchronize(soon()).unwrap();
    assert!(high.is_done().unwrap() && end.is_done().unwrap());
    let ms = end.elapsed_ms(&start).unwrap();
    assert!(ms > 0.0, "{ms} ms");
    let mut back = vec![0u8; bytes];
    b.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&x| x == 0x5a));
    println!(
        "64 MiB fill + copy: {ms:.3} ms ({:.0} GB/s counting bytes read and written)",
        3.0 * bytes as f64 / ms as f64 / 1e6
    );
}

#[test]
fn modules_refuse_bad_images_and_unknown_kernels() {
    let Some(gpu) = gpu() else { return };
    let err = Module::load(&gpu, b"not a module").map(|_| ()).unwrap_err();
    assert!(err.to_string().contains("cuModuleLoadData"), "{err}");
    assert!(Module::load(&gpu, b"").is_err());
    let k = kernels(&gpu);
    drop(k);
    let (image, _) = braid_cuda::load_or_compile(gpu.arch().unwrap()).unwrap();
    let module = Module::load(&gpu, &image).unwrap();
    let err = module
        .function("braid_rc_no_such_kernel")
        .map(|_| ())
        .unwrap_err();
    assert!(err.to_string().contains("braid_rc_no_such_kernel"), "{err}");
    assert!(module
        .function(&kernel_name(Shape::Finalize2, DType::BF16, ReduceOp::Avg).unwrap())
        .is_ok());
}

/// Runs catalogue kernels in device memory: each operand its own allocation at its misalignment.
struct DeviceRunner {
    kernels: Arc<ReduceCopyKernels>,
    stream: Stream,
}

impl Runner for DeviceRunner {
    fn run(
        &mut self,
        name: &str,
        _grid: Grid,
        count: usize,
        nranks: u32,
        srcs: &[Operand],
        dsts: &[(u32, usize)],
        alias: Option<usize>,
    ) -> Vec<Vec<u8>> {
        let gpu = self.kernels.gpu().clone();
        let (shape, dtype, op) = braid_cuda::entries()
            .into_iter()
            .find(|&(s, d, o)| kernel_name(s, d, o).unwrap() == name)
            .expect("a kernel of the catalogue");
        let mut held = Vec::new();
        let mut src_addrs = Vec::new();
        for s in srcs {
            let mut b = DeviceBuffer::alloc(&gpu, s.misalign as usize + s.bytes.len() + 1).unwrap();
            b.write(s.misalign as usize, &s.bytes).unwrap();
            src_addrs.push(b.addr() + s.misalign as u64);
            held.push(b);
        }
        let mut dst_addrs = Vec::new();
        let mut dst_at = Vec::new();
        for (j, &(mis, len)) in dsts.iter().enumerate() {
            if let (0, Some(a)) = (j, alias) {
                dst_addrs.push(src_addrs[a]);
                dst_at.push((a, srcs[a].misalign as usize, len));
            } else {
                let mut b = DeviceBuffer::alloc(&gpu, mis as usize + len + 1).unwrap();
                b.write(0, &vec![0xa5; mis as usize + len + 1]).unwrap();
                dst_addrs.push(b.addr() + mis as u64);
                dst_at.push((held.len(), mis as usize, len));
                held.push(b);
            }
        }
        // SAFETY: every address is inside a buffer held until after the stream is synchronised.
        unsafe {
            self.kernels
                .launch(
                    &self.stream,
                    shape,
                    dtype,
                    op,
                    &src_addrs,
                    &dst_addrs,
                    count,
                    nranks as usize,
                )
                .unwrap()
        };
        self.stream.synchronize(soon()).unwrap();
        dst_at
            .iter()
            .map(|&(buf, off, len)| {
                let mut out = vec![0u8; len];
                held[buf].read(off, &mut out).unwrap();
                out
            })
            .collect()
    }
}

#[test]
fn every_kernel_on_the_gpu_matches_braid_core_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    let kernels = kernels(&gpu);
    let mut runner = DeviceRunner {
        stream: Stream::new(&gpu, Priority::High).unwrap(),
        kernels,
    };
    let mut rng = Rng(0x5eed_b4a1_d000_0001);
    let mut cases = 0;
    for (shape, dtype, op) in braid_cuda::entries() {
        cases += check_kernel(&mut runner, &mut rng, shape, dtype, op);
    }
    println!(
        "{} kernels, {cases} cases on the GPU, all bit-identical to braid-core",
        braid_cuda::catalogue().len()
    );
}

/// A buffer on both sides: host bytes for the CPU engine, a device copy for the CUDA engine.
struct Twin {
    host: Vec<u8>,
    dev: DeviceBuffer,
}

impl Twin {
    fn new(gpu: &Gpu, bytes: Vec<u8>) -> Twin {
        let mut dev = DeviceBuffer::alloc(gpu, bytes.len()).unwrap();
        dev.write(0, &bytes).unwrap();
        Twin { host: bytes, dev }
    }
    fn host_span(&mut self) -> Span {
        // SAFETY: the vector outlives every kernel of the test (each completes before it returns).
        unsafe { Span::host(self.host.as_mut_ptr(), self.host.len()) }
    }
    fn dev_span(&self) -> Span {
        self.dev.span()
    }
    fn device_bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.host.len()];
        self.dev.read(0, &mut out).unwrap();
        out
    }
}

#[test]
fn the_device_engine_computes_what_the_cpu_engine_computes() {
    let Some(gpu) = gpu() else { return };
    let mut cuda = CudaEngine::new(kernels(&gpu), Priority::High).unwrap();
    let mut cpu = CpuEngine::new();
    let mut rng = Rng(77);
    let count = 3001;
    let mut checked = 0;
    for dtype in DType::ALL {
        for op in ReduceOp::ARITHMETIC {
            let t = |rng: &mut Rng| Twin::new(&gpu, data(rng, dtype, false, count));
            let a = |rng: &mut Rng| Twin::new(&gpu, data(rng, dtype, true, count));
            // Each case: the twins, and a kernel built over one side's spans.
            type Build = fn(DType, ReduceOp, &[Span], &[KOperand]) -> Kernel<'static>;
            let cases: Vec<(&str, Vec<Twin>, Build)> = vec![
                ("copy", vec![t(&mut rng), t(&mut rng)], |_, _, s, _| {
                    Kernel::Copy {
                        dst: s[0],
                        src: s[1],
                    }
                }),
                ("to_acc", vec![a(&mut rng), t(&mut rng)], |d, _, s, _| {
                    Kernel::ToAcc {
                        dtype: d,
                        dst: s[0],
                        src: s[1],
                    }
                }),
                (
                    "combine",
                    vec![a(&mut rng), a(&mut rng), t(&mut rng)],
                    |d, o, s, _| Kernel::Combine {
                        dtype: d,
                        op: o,
                        dst: s[0],
                        partial: s[1],
                        input: s[2],
                    },
                ),
                (
                    "finalize",
                    vec![t(&mut rng), a(&mut rng), t(&mut rng)],
                    |d, o, s, _| Kernel::Finalize {
                        dtype: d,
                        op: o,
                        nranks: 3,
                        dst: s[0],
                        partial: s[1],
                        own: KOperand::Span(s[2]),
                    },
                ),
                (
                    "finalize in place",
                    vec![t(&mut rng), a(&mut rng)],
                    |d, o, s, _| Kernel::Finalize {
                        dtype: d,
                        op: o,
                        nranks: 5,
                        dst: s[0],
                        partial: s[1],
                        own: KOperand::Dst,
                    },
                ),
                (
                    "combine_acc",
                    vec![a(&mut rng), a(&mut rng)],
                    |d, o, s, _| Kernel::CombineAcc {
                        dtype: d,
                        op: o,
                        acc: s[0],
                        partial: s[1],
                    },
                ),
                (
                    "finish_acc",
                    vec![t(&mut rng), a(&mut rng)],
                    |d, o, s, _| Kernel::FinishAcc {
                        dtype: d,
                        op: o,
                        nranks: 7,
                        dst: s[0],
                        acc: s[1],
                    },
                ),
            ];
            for (what, mut twins, build) in cases {
                let host: Vec<Span> = twins.iter_mut().map(|t| t.host_span()).collect();
                let dev: Vec<Span> = twins.iter().map(|t| t.dev_span()).collect();
                run_both(
                    &mut cpu,
                    &mut cuda,
                    &build(dtype, op, &host, &[]),
                    &build(dtype, op, &dev, &[]),
                );
                assert_eq!(
                    twins[0].device_bytes(),
                    twins[0].host,
                    "{what} {dtype} {op:?}"
                );
                checked += 1;
            }
            // Ordered reductions of every arity the executor uses, chained where the catalogue has none,
            // with the destination among the sources at one place.
            for n in [1usize, 2, 3, 4, 5, 8, 9, 13] {
                let mut twins: Vec<Twin> = (0..=n).map(|_| t(&mut rng)).collect();
                let in_place = n / 2;
                let host: Vec<Span> = twins.iter_mut().map(|t| t.host_span()).collect();
                let dev: Vec<Span> = twins.iter().map(|t| t.dev_span()).collect();
                let ops = |spans: &[Span]| -> Vec<KOperand> {
                    (0..n)
                        .map(|i| {
                            if i == in_place {
                                KOperand::Dst
                            } else {
                                KOperand::Span(spans[i + 1])
                            }
                        })
                        .collect()
                };
                let (hs, ds) = (ops(&host), ops(&dev));
                run_both(
                    &mut cpu,
                    &mut cuda,
                    &Kernel::ReduceOrdered {
                        dtype,
                        op,
                        dst: host[0],
                        srcs: &hs,
                    },
                    &Kernel::ReduceOrdered {
                        dtype,
                        op,
                        dst: dev[0],
                        srcs: &ds,
                    },
                );
                assert_eq!(
                    twins[0].device_bytes(),
                    twins[0].host,
                    "reduce_ordered of {n} {dtype} {op:?}"
                );
                checked += 1;
            }
        }
    }
    println!("{checked} kernels: the device engine equals the cpu engine");
}

fn run_both(
    cpu: &mut CpuEngine,
    cuda: &mut CudaEngine,
    on_host: &Kernel<'_>,
    on_device: &Kernel<'_>,
) {
    // SAFETY: every span is a live buffer of the test, complete before the next use.
    assert_eq!(unsafe { cpu.submit(on_host) }.unwrap(), None);
    // SAFETY: as above; the ticket is waited for before the buffers are read or dropped.
    let ticket = unsafe { cuda.submit(on_device) }
        .unwrap()
        .expect("the device engine queues its kernels");
    cuda.wait(ticket, soon()).unwrap();
    assert!(cuda.complete(ticket).unwrap());
}

#[test]
fn the_device_engine_refuses_host_memory_and_gives_zeroed_scratch() {
    let Some(gpu) = gpu() else { return };
    let mut cuda = CudaEngine::new(kernels(&gpu), Priority::Normal).unwrap();
    assert!(!cuda.accepts(braid_transport::MemKind::Host));
    let mut host = vec![0u8; 64];
    let dev = DeviceBuffer::alloc(&gpu, 64).unwrap();
    // SAFETY: both live through the call; the kernel is refused before anything is queued.
    let err = unsafe {
        cuda.submit(&Kernel::Copy {
            dst: dev.span(),
            src: Span::host(host.as_mut_ptr(), 64),
        })
    }
    .unwrap_err();
    assert!(err.to_string().contains("was given host memory"), "{err}");
    let scratch = cuda.scratch(1 << 20).unwrap();
    assert!(scratch.span().len() >= 1 << 20);
    let out = DeviceBuffer::alloc(&gpu, 1 << 20).unwrap();
    // SAFETY: both live until the ticket completes below.
    let t = unsafe {
        cuda.submit(&Kernel::Copy {
            dst: out.span(),
            src: scratch.span().sub(0, 1 << 20).unwrap(),
        })
    }
    .unwrap()
    .unwrap();
    cuda.wait(t, soon()).unwrap();
    let mut back = vec![1u8; 1 << 20];
    out.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0));
}

/// The setup context of rank `rank` of a two-rank `ipc` test.
fn ipc_ctx(rank: usize, nonce: u64) -> braid_transport::SetupCtx {
    use braid_transport::{Geometry, SetupCtx, WaitPolicy};
    SetupCtx {
        geometry: Geometry {
            rank,
            world: 2,
            channels: 1,
            slots: 2,
            slot_bytes: 1 << 20,
        },
        secret: *b"gpu-ipc-secret!!",
        nonce,
        policy: WaitPolicy {
            spin: Duration::from_micros(5),
            yield_for: Duration::from_micros(20),
        },
        deadline: soon(),
    }
}

/// A peer that published the `ipc` endpoint `blob`.
fn ipc_peer(blob: Vec<u8>) -> braid_transport::Peer {
    braid_transport::Peer {
        pid: std::process::id(),
        host: "here".into(),
        endpoints: vec![braid_transport::Endpoint {
            transport: braid_transport::shm::ipc::NAME.into(),
            blob,
        }],
    }
}

/// The 1 MiB message of the `ipc` tests.
fn ipc_message() -> Vec<u8> {
    (0..(1 << 20)).map(|i: u32| (i % 251) as u8).collect()
}

/// What the ipc exchanges below name in their errors: `rank`, a deadline [`soon`].
fn ipc_wait_ctx(
    rank: usize,
    abort: &std::sync::atomic::AtomicBool,
) -> braid_transport::WaitCtx<'_> {
    braid_transport::WaitCtx {
        rank,
        collective: "gpu ipc",
        seq: 0,
        deadline: soon(),
        started: Instant::now(),
        abort,
    }
}

/// Writes `msg` into a device slot of `link`'s ring at `peer` (channel 0) and posts it with tag 9.
fn ipc_send(gpu: &Gpu, link: &dyn braid_transport::Link, peer: usize, msg: &[u8]) {
    let abort = std::sync::atomic::AtomicBool::new(false);
    let wctx = ipc_wait_ctx(0, &abort);
    let stream = Stream::new(gpu, Priority::High).unwrap();
    let slot = link.try_reserve(peer, 0, &wctx).unwrap().expect("credit");
    assert_eq!(
        slot.span().kind(),
        braid_transport::MemKind::Device {
            ordinal: gpu.ordinal()
        }
    );
    // SAFETY: the slot is ours until posted; `msg` lives until the stream is synchronised.
    unsafe { stream.copy(slot.span().addr() as u64, msg.as_ptr() as u64, msg.len()) }.unwrap();
    stream.synchronize(soon()).unwrap();
    link.post(slot, msg.len(), 9, &wctx).unwrap();
}

/// Waits for the message from `peer` (channel 0) on `link`, checks its tag and returns its bytes.
fn ipc_receive(gpu: &Gpu, link: &dyn braid_transport::Link, peer: usize) -> Vec<u8> {
    use braid_transport::Event as LinkEvent;
    let abort = std::sync::atomic::AtomicBool::new(false);
    let wctx = ipc_wait_ctx(1, &abort);
    let stream = Stream::new(gpu, Priority::High).unwrap();
    link.wait(peer, 0, LinkEvent::Data, &wctx, soon()).unwrap();
    let got = link.try_recv(peer, 0, &wctx).unwrap().expect("a message");
    assert_eq!(got.tag(), 9);
    let mut back = vec![0u8; got.len()];
    // SAFETY: the slot is ours until released; `back` lives until the stream is synchronised.
    unsafe {
        stream.copy(
            back.as_mut_ptr() as u64,
            got.span().addr() as u64,
            back.len(),
        )
    }
    .unwrap();
    stream.synchronize(soon()).unwrap();
    link.release(got).unwrap();
    back
}

/// `CudaMemory` on `gpu` shared as `mode`, or `None` after printing why the device cannot (only `fd`
/// may be missing: legacy handles need only unified addressing).
fn ipc_memory(gpu: &Gpu, mode: IpcMode) -> Option<Arc<dyn braid_transport::DeviceMemory>> {
    match CudaMemory::with_mode(gpu, mode) {
        Ok(m) => {
            assert_eq!(m.mode(), mode);
            Some(Arc::new(m))
        }
        Err(e) if mode == IpcMode::Fd => {
            let auto = CudaMemory::with_mode(gpu, IpcMode::Auto).unwrap();
            assert_eq!(auto.mode(), IpcMode::Legacy, "auto did not fall back: {e}");
            assert!(e.to_string().contains("BRAID_CUDA_IPC=fd"), "{e}");
            println!("SKIPPED: sharing ring memory by descriptor: {e}");
            None
        }
        Err(e) => panic!("{mode:?}: {e}"),
    }
}

/// Two ranks (threads) of an `ipc` transport on this GPU, in both ways of sharing ring memory: rings
/// exported and imported by file descriptor over the transport's Unix sockets, or by legacy handle (which
/// in one process takes the exporter's address as it is); a message written into the peer's device slot
/// and read back from the receiver's.
#[test]
fn the_ipc_transport_moves_messages_through_device_rings() {
    use braid_transport::plugin::{Prepared, Transport};
    use braid_transport::shm::ipc::Ipc;
    use braid_transport::Link;
    let Some(gpu) = gpu() else { return };
    let auto = CudaMemory::with_mode(&gpu, IpcMode::Auto).unwrap();
    println!("auto shares ring memory as {:?}", auto.mode());
    for (k, mode) in [IpcMode::Fd, IpcMode::Legacy].into_iter().enumerate() {
        let Some(memory) = ipc_memory(&gpu, mode) else {
            continue;
        };
        let nonce = std::process::id() as u64 ^ 0x1bc0_0000 ^ ((k as u64) << 40);
        let prepared: Vec<Box<dyn Prepared>> = (0..2)
            .map(|r| {
                Box::new(Ipc::new("/dev/shm", memory.clone()))
                    .prepare(&ipc_ctx(r, nonce))
                    .unwrap()
            })
            .collect();
        let table: Vec<_> = prepared.iter().map(|p| ipc_peer(p.endpoint())).collect();
        let links: Vec<Box<dyn Link>> = std::thread::scope(|s| {
            let hs: Vec<_> = prepared
                .into_iter()
                .enumerate()
                .map(|(r, p)| {
                    let table = &table;
                    s.spawn(move || {
                        let peers: Vec<Option<&braid_transport::Peer>> =
                            (0..2).map(|q| (q != r).then(|| &table[q])).collect();
                        p.connect(&ipc_ctx(r, nonce), &peers)
                            .unwrap()
                            .activate()
                            .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let msg = ipc_message();
        ipc_send(&gpu, &*links[0], 1, &msg);
        assert_eq!(ipc_receive(&gpu, &*links[1], 0), msg, "{mode:?}");
    }
}

/// The variable that makes `ipc_rank_1_of_a_child_process` a rank (its value: the mode), set only by
/// the test that starts it.
const IPC_CHILD: &str = "BRAID_TEST_IPC_CHILD";

/// Rank 0 here and rank 1 in a child process (this test binary again), in both ways of sharing ring
/// memory, so that each imports the other's by descriptor or opens it with `cuIpcOpenMemHandle`: the
/// endpoints cross through the child's stdin and stdout, 1 MiB goes from rank 0 into rank 1's device
/// ring, and the child checks what it received.
#[test]
fn the_ipc_transport_moves_messages_between_processes() {
    use braid_transport::plugin::Transport;
    use braid_transport::shm::ipc::Ipc;
    let Some(gpu) = gpu() else { return };
    for (k, mode, name) in [(0u64, IpcMode::Fd, "fd"), (1, IpcMode::Legacy, "legacy")] {
        let Some(memory) = ipc_memory(&gpu, mode) else {
            continue;
        };
        let nonce = std::process::id() as u64 ^ 0x2bc0_0000 ^ (k << 40);
        let prepared = Box::new(Ipc::new("/dev/shm", memory))
            .prepare(&ipc_ctx(0, nonce))
            .unwrap();
        let mut child = ChildTest::start(
            "ipc_rank_1_of_a_child_process",
            IPC_CHILD,
            &format!("{name} {nonce}"),
        );
        child.send_marked("BRAID-ENDPOINT ", &prepared.endpoint());
        let theirs = child.read_marked("BRAID-ENDPOINT ");
        let link = prepared
            .connect(&ipc_ctx(0, nonce), &[None, Some(&ipc_peer(unhex(&theirs)))])
            .unwrap()
            .activate()
            .unwrap();
        ipc_send(&gpu, &*link, 1, &ipc_message());
        let verdict = child.read_marked("BRAID-RECEIVED ");
        let (ok, rest) = child.finish();
        assert_eq!(
            verdict, "ok",
            "{mode:?}: the child received another message\n{rest}"
        );
        assert!(ok, "{mode:?}: the child failed\n{rest}");
        // Legacy: the child's rings went with it; closing them here may warn, never panic.
        drop(link);
    }
}

/// Rank 1 of `the_ipc_transport_moves_messages_between_processes`, in the child process it starts;
/// elsewhere it does nothing.
#[test]
fn ipc_rank_1_of_a_child_process() {
    use braid_transport::plugin::Transport;
    use braid_transport::shm::ipc::Ipc;
    let Ok(setting) = std::env::var(IPC_CHILD) else {
        return;
    };
    let (name, nonce) = setting.split_once(' ').unwrap();
    let mode = IpcMode::parse(Some(name)).unwrap();
    let nonce: u64 = nonce.parse().unwrap();
    let gpu = Gpu::for_local_rank(0).unwrap();
    let memory = Arc::new(CudaMemory::with_mode(&gpu, mode).unwrap());
    let prepared = Box::new(Ipc::new("/dev/shm", memory))
        .prepare(&ipc_ctx(1, nonce))
        .unwrap();
    println!("\nBRAID-ENDPOINT {}", hex(&prepared.endpoint()));
    let theirs = read_marked(&mut std::io::stdin().lock(), "BRAID-ENDPOINT ");
    let link = prepared
        .connect(&ipc_ctx(1, nonce), &[Some(&ipc_peer(unhex(&theirs))), None])
        .unwrap()
        .activate()
        .unwrap();
    let got = ipc_receive(&gpu, &*link, 0);
    let verdict = if got == ipc_message() { "ok" } else { "wrong" };
    println!("\nBRAID-RECEIVED {verdict}");
}
