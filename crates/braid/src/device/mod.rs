//! Collectives on device memory: [`Communicator::device`] sets up rings in device memory between the
//! ranks of the host (braid-transport's `ipc` transport over a [`DeviceMemory`]) and returns a
//! [`DeviceCommunicator`], whose collectives run the same schedules with a device [`Engine`] (braid-cuda's
//! `CudaEngine` on a GPU; braid-exec's `EmulatedDeviceEngine` over braid-transport's `EmulatedDevice`
//! without one).
//!
//! A collective is described and checked first ([`DeviceCommunicator::all_reduce_op`] and the others:
//! no effect), then either run on the calling thread ([`DeviceCommunicator::run`], which returns once it
//! has finished on the device) or queued ([`DeviceCommunicator::enqueue`]) for the communicator's worker
//! thread, which runs queued collectives in issue order, each once its [`DeviceGate`] opens (the work
//! that produces its input has finished: on a GPU, an event on the caller's stream), and tells its
//! [`DeviceSignal`] when it has ended (on a GPU: a flag the caller's stream waits on), so the caller's
//! thread does not wait for the GPU. Blocking and queued collectives keep one issue order. A failure makes
//! the communicator unusable ([`DeviceCommunicator::async_error`]); later collectives fail at once and
//! their signals still fire, so that nothing waits on them forever.
//!
//! On CUDA ([`Communicator::cuda_device`]), an all-reduce runs device-resident where every rank can
//! (see the `resident` module): one kernel launch per collective, ordered on the caller's stream
//! ([`DeviceCommunicator::launch_on`]) or on the communicator's own (blocking calls), with no host thread
//! on the data path; the other collectives keep the host-driven path above.
//!
//! Every rank of the communicator must be on one host for now (rings between hosts in device memory
//! need RDMA into device memory or staging through the host, which come later).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_core::{DType, Error, ReduceOp};
use braid_exec::{Engine, Settings};
use braid_sched::Collective;
use braid_transport::shm::ipc::{Ipc, NAME};
use braid_transport::{
    DeviceMemory, Endpoint, Geometry, MemKind, Peer, Setup, SetupCtx, Span, TransportChoice,
    WaitPolicy,
};
use parking_lot::Mutex;

use crate::comm::Communicator;
use crate::tune::{AlgoPolicy, Tuner};

mod resident;
pub use resident::RESIDENT_VARIABLE;

/// The device memory and the engine a rank brings to [`Communicator::device_from`].
pub type DeviceParts = (Arc<dyn DeviceMemory>, Box<dyn Engine>);

/// The most bytes a transport's endpoint may take in the exchange.
const ENDPOINT_MAX: usize = 1024;

/// What a queued device collective waits for before it starts.
pub trait DeviceGate: Send {
    /// Returns once the collective's input is ready, or fails once `until` passes.
    fn wait(&mut self, until: Instant) -> Result<(), Error>;
}

/// A gate that is always open.
pub struct Ready;

impl DeviceGate for Ready {
    fn wait(&mut self, _until: Instant) -> Result<(), Error> {
        Ok(())
    }
}

/// Told once, when a queued device collective has ended (finished on the device, or failed).
pub trait DeviceSignal: Send {
    /// The collective's result.
    fn fire(self: Box<Self>, result: &Result<(), Error>);
}

/// One device collective, described and checked (making one has no effect).
#[derive(Clone, Copy, Debug)]
pub struct DeviceOp {
    op: braid_exec::Op,
}

/// Collectives on device memory among the ranks of a [`Communicator`], one host.
pub struct DeviceCommunicator {
    rank: usize,
    world: usize,
    ordinal: u32,
    routes: Vec<&'static str>,
    shared: Arc<Shared>,
    worker: Mutex<Option<Worker>>,
    /// The GPU, for a communicator made by [`Communicator::cuda_device`].
    gpu: Option<braid_cuda::Gpu>,
}

struct Worker {
    tx: mpsc::Sender<Task>,
    handle: std::thread::JoinHandle<()>,
}

struct Task {
    op: DeviceOp,
    gate: Box<dyn DeviceGate>,
    signal: Box<dyn DeviceSignal>,
}

/// What the caller's thread and the worker share.
struct Shared {
    rank: usize,
    timeout: Duration,
    state: Mutex<State>,
    /// The first failure; every later collective fails with it.
    sticky: Mutex<Option<Error>>,
    /// Collectives queued and not yet ended.
    queued: AtomicUsize,
    /// The device-resident all-reduce, where every rank set it up.
    resident: Option<resident::Resident>,
}

struct State {
    exec: braid_exec::Executor<dyn Engine>,
    tuner: Tuner,
    seq: u64,
}

impl Shared {
    fn poisoned(&self) -> Option<Error> {
        self.first_error().map(|first| Error::Poisoned {
            rank: self.rank,
            first: first.to_string(),
        })
    }

    /// The first failure: a host-driven collective's, or one a device-resident kernel recorded.
    fn first_error(&self) -> Option<Error> {
        let mut sticky = self.sticky.lock();
        if sticky.is_none() {
            if let Some(Err(e)) = self.resident.as_ref().map(resident::Resident::status) {
                *sticky = Some(e);
            }
        }
        sticky.clone()
    }

    /// Runs `op` on this thread; a failure makes the communicator unusable.
    fn run_now(&self, op: &DeviceOp) -> Result<(), Error> {
        if let Some(e) = self.poisoned() {
            return Err(e);
        }
        let mut state = self.state.lock();
        if let Some(r) = self.resident.as_ref().filter(|r| r.takes(&op.op)) {
            // SAFETY: `run`'s and the worker's callers keep the spans valid until this returns.
            let result = unsafe { r.run(&op.op, self.timeout) };
            if let Err(e) = &result {
                self.sticky.lock().get_or_insert_with(|| e.clone());
            }
            drop(state);
            return result;
        }
        let st = &mut *state;
        let o = op.op;
        let algo = st.tuner.pick_cached(o.collective, o.count * o.dtype.size());
        let seq = st.seq;
        let seqs = &mut st.seq;
        let result = st
            .exec
            .run_op(o, algo, 0, seq, Instant::now(), || *seqs += 1);
        if let Err(e) = &result {
            // Kernels queued before the failure may still write the buffers: the caller gets them back
            // only once they have finished (bounded).
            if let Err(q) = st.exec.quiesce(Instant::now() + self.timeout) {
                tracing::warn!("after a failed device collective: {q}");
            }
            if !e.is_invalid_argument() {
                self.sticky.lock().get_or_insert_with(|| e.clone());
            }
        }
        result
    }

    /// The worker's loop: queued collectives in issue order.
    fn serve(&self, rx: mpsc::Receiver<Task>) {
        for mut task in rx {
            let result = match task.gate.wait(Instant::now() + self.timeout) {
                Ok(()) => self.run_now(&task.op),
                Err(e) => {
                    // The input never became ready: the peers are left waiting, as with any failure.
                    self.sticky.lock().get_or_insert_with(|| e.clone());
                    Err(e)
                }
            };
            // Counted out before the signal fires: whoever the signal wakes sees it ended.
            self.queued.fetch_sub(1, Ordering::AcqRel);
            task.signal.fire(&result);
        }
    }
}

/// A signal a blocking call waits on.
struct Reply(mpsc::Sender<Result<(), Error>>);

impl DeviceSignal for Reply {
    fn fire(self: Box<Self>, result: &Result<(), Error>) {
        let _ = self.0.send(result.clone());
    }
}

impl Communicator {
    /// Sets up collectives on the device memory `memory` gives, computed by `engine` (which must accept
    /// that memory): every rank of the communicator calls this with memory of its own device, and all
    /// must run on one host. It exchanges the rings' descriptors or handles between the ranks (checked with the
    /// communicator's secret) using this communicator's own collectives, so it is ordered like one.
    /// Fails on every rank when it fails on one (after the exchange, all agree).
    pub fn device(
        &self,
        memory: Arc<dyn DeviceMemory>,
        engine: Box<dyn Engine>,
    ) -> Result<DeviceCommunicator, Error> {
        let inner = &self.inner;
        let (rank, world) = (inner.rank, inner.world);
        let elsewhere: Vec<usize> = (0..world)
            .filter(|&p| inner.host_ids[p] != inner.host_ids[rank])
            .collect();
        if !elsewhere.is_empty() {
            return Err(Error::invalid(format!(
                "collectives on device memory need every rank on one host for now; ranks {elsewhere:?} run on another host than rank {rank}"
            )));
        }
        let ordinal = memory.ordinal();
        let config = self.config().clone();
        let geometry = Geometry {
            rank,
            world,
            channels: config.streams,
            slots: config.slots,
            slot_bytes: config.chunk_bytes.next_multiple_of(256),
        };
        let deadline = Instant::now() + config.timeout;
        let policy = WaitPolicy::for_host(world, config.spin_us);
        // Whatever one rank alone can fail at is agreed on before any rank waits for the others, so that
        // every rank returns the error and none is left waiting (or out of step) in a collective.
        let checked = (|| {
            if !engine.accepts(MemKind::Device { ordinal }) {
                return Err(Error::invalid(format!(
                    "the {} engine does not compute on the memory of device {ordinal} ({} memory)",
                    engine.name(),
                    memory.name()
                )));
            }
            let nonce = crate::id::random_secret()?;
            Ok(SetupCtx {
                geometry,
                secret: inner.secret,
                nonce: u64::from_le_bytes([
                    nonce[0], nonce[1], nonce[2], nonce[3], nonce[4], nonce[5], nonce[6], nonce[7],
                ]),
                policy,
                deadline,
            })
        })();
        let router = if world == 1 {
            checked?;
            None
        } else {
            // Prepare, and agree that every rank could.
            let prepared = checked.and_then(|ctx| {
                Setup::prepare(
                    TransportChoice {
                        transports: vec![Box::new(Ipc::new("/dev/shm", memory.clone()))],
                        setting: NAME.into(),
                    },
                    ctx,
                )
            });
            let setup = self.all_agree("preparing device rings", prepared)?;
            let mine = setup.endpoints().into_iter().find(|e| e.transport == NAME);
            let blob = mine.map(|e| e.blob).unwrap_or_default();
            let blobs = self.exchange_blobs("exchanging device ring endpoints", &blob)?;
            let table: Vec<Peer> = blobs
                .into_iter()
                .enumerate()
                .map(|(p, blob)| Peer {
                    pid: 0,
                    host: inner.host_ids[p].clone(),
                    endpoints: vec![Endpoint {
                        transport: NAME.into(),
                        blob,
                    }],
                })
                .collect();
            let connecting = setup.connect(&table, policy);
            let connecting = self.all_agree("connecting device rings", connecting)?;
            let router = connecting.activate();
            Some(self.all_agree("activating device rings", router)?)
        };
        let routes = match &router {
            Some(r) => r.route_names().to_vec(),
            None => vec!["self"],
        };
        let settings = Settings {
            timeout: config.timeout,
            // The executor's debug checks exchange a fingerprint written from host memory into the
            // slots, which device slots cannot take; a device collective runs without them.
            debug_checks: false,
            rings: config.channels,
        };
        let mut exec = braid_exec::Executor::<dyn Engine>::new(
            rank,
            world,
            settings,
            router.map(braid_transport::Router::into_link),
            engine,
            Arc::new(AtomicBool::new(false)),
        );
        exec.set_hosts(self.hosts().to_vec());
        let policy = match config.algo.as_deref() {
            Some(text) => AlgoPolicy::parse(text)
                .map_err(|e| Error::invalid(format!("BRAID_ALGO={text:?}: {e}")))?,
            None => AlgoPolicy::default(),
        };
        let mut tuner = Tuner::new(
            world,
            policy,
            None,
            config.chunk_bytes,
            config.direct_max_bytes,
        );
        tuner.set_hosts(self.hosts().iter().map(Vec::len).collect());
        Ok(DeviceCommunicator {
            rank,
            world,
            ordinal,
            routes,
            shared: Arc::new(Shared {
                rank,
                timeout: config.timeout,
                state: Mutex::new(State {
                    exec,
                    tuner,
                    seq: 0,
                }),
                sticky: Mutex::new(None),
                queued: AtomicUsize::new(0),
                resident: None,
            }),
            worker: Mutex::new(None),
            gpu: None,
        })
    }

    /// Collectives on the memory of this rank's GPU: device `ordinal`, or the local rank's
    /// (`BRAID_CUDA_DEVICE` overriding) when `None`. The reduce-copy kernels, a high-priority engine
    /// stream, the `ipc` transport's rings in GPU memory and, where every rank can take it, the
    /// device-resident all-reduce. Every rank calls it; when any rank cannot open its
    /// GPU, every rank returns an error.
    pub fn cuda_device(&self, ordinal: Option<usize>) -> Result<DeviceCommunicator, Error> {
        let local = self.topology().local_rank(self.rank()).unwrap_or(0);
        let opened = (|| {
            let gpu = match ordinal {
                Some(o) => braid_cuda::Gpu::open(o)?,
                None => braid_cuda::Gpu::for_local_rank(local)?,
            };
            let kernels = Arc::new(braid_cuda::ReduceCopyKernels::load(&gpu)?);
            let engine = braid_cuda::CudaEngine::new(kernels, braid_cuda::Priority::High)?;
            let memory = Arc::new(braid_cuda::CudaMemory::new(&gpu)?);
            Ok::<_, Error>((gpu, memory, engine))
        })();
        let (opened, made) = match opened {
            Ok((gpu, memory, engine)) => (
                Some((gpu, memory.clone())),
                Ok((
                    memory as Arc<dyn DeviceMemory>,
                    Box::new(engine) as Box<dyn Engine>,
                )),
            ),
            Err(e) => (None, Err(e)),
        };
        let mut dev = self.device_from(made)?;
        let (gpu, memory) =
            opened.ok_or_else(|| Error::Internal("a device without its GPU".into()))?;
        let resident = resident::Resident::setup(self, &gpu, &*memory)?;
        match Arc::get_mut(&mut dev.shared) {
            Some(shared) => shared.resident = resident,
            None => {
                return Err(Error::Internal(
                    "a new device communicator is already shared".into(),
                ))
            }
        }
        dev.gpu = Some(gpu);
        Ok(dev)
    }

    /// [`Communicator::device`] with the memory and engine each rank has made (or failed to make, e.g.
    /// without a GPU): every rank calls this, and when any rank's `made` is an error, every rank returns
    /// an error (its own, or one saying another rank failed) without waiting for the others.
    pub fn device_from(
        &self,
        made: Result<DeviceParts, Error>,
    ) -> Result<DeviceCommunicator, Error> {
        let (memory, engine) = self.all_agree("opening the device", made)?;
        self.device(memory, engine)
    }

    /// Every rank's `blob` (at most [`ENDPOINT_MAX`] − 2 bytes), in rank order, through this
    /// communicator's all-gather. A rank whose blob does not fit makes the call fail on every rank.
    fn exchange_blobs(&self, what: &str, blob: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        let mut frame = vec![0u8; ENDPOINT_MAX];
        let fits = blob.len() <= ENDPOINT_MAX - 2;
        if fits {
            frame[..2].copy_from_slice(&(blob.len() as u16).to_le_bytes());
            frame[2..2 + blob.len()].copy_from_slice(blob);
        }
        self.all_agree(
            what,
            if fits {
                Ok(())
            } else {
                Err(Error::Internal(format!(
                    "{what}: an endpoint of {} bytes, more than {}",
                    blob.len(),
                    ENDPOINT_MAX - 2
                )))
            },
        )?;
        let mut all = vec![0u8; ENDPOINT_MAX * self.world_size()];
        self.all_gather(&frame, &mut all)?;
        Ok(all
            .chunks_exact(ENDPOINT_MAX)
            .map(|f| {
                let len = (u16::from_le_bytes([f[0], f[1]]) as usize).min(ENDPOINT_MAX - 2);
                f[2..2 + len].to_vec()
            })
            .collect())
    }

    /// Returns `result` when every rank's step succeeded; otherwise every rank returns an error (its
    /// own, or one naming the first rank that failed), so that none waits for the others in vain.
    fn all_agree<T>(&self, what: &str, result: Result<T, Error>) -> Result<T, Error> {
        let failed = [u32::from(result.is_err())];
        let mut any = [0u32];
        self.all_reduce(&failed, &mut any, ReduceOp::Max)?;
        match result {
            Err(e) => Err(e),
            Ok(_) if any[0] != 0 => Err(Error::Bootstrap(format!(
                "{what}: another rank failed (its error says why)"
            ))),
            Ok(v) => Ok(v),
        }
    }
}

impl DeviceCommunicator {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The device whose memory the collectives take.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// How this rank reaches each rank (`"ipc"`, or `"self"`).
    pub fn peer_transports(&self) -> &[&'static str] {
        &self.routes
    }

    fn check(&self, what: &str, span: &Span, bytes: usize) -> Result<(), Error> {
        if span.kind()
            != (MemKind::Device {
                ordinal: self.ordinal,
            })
            && !(span.is_empty() && bytes == 0)
        {
            return Err(Error::invalid(format!(
                "{what} is {}; this communicator's collectives take memory of device {}",
                span.kind().describe(),
                self.ordinal
            )));
        }
        if span.len() != bytes {
            return Err(Error::invalid(format!(
                "{what} has {} bytes, the collective needs {bytes}",
                span.len()
            )));
        }
        Ok(())
    }

    /// The first error that made this communicator unusable, if any (a device-resident kernel's
    /// failure counts once its launch has ended).
    pub fn async_error(&self) -> Option<Error> {
        self.shared.first_error()
    }

    /// The GPU of a communicator made by [`Communicator::cuda_device`].
    pub fn gpu(&self) -> Option<&braid_cuda::Gpu> {
        self.gpu.as_ref()
    }

    /// Whether all-reduces run device-resident (one kernel each, no host thread on the data path).
    pub fn resident(&self) -> bool {
        self.shared.resident.is_some()
    }

    /// Ends every wait of this rank's device-resident kernels, running or later, with an error (the
    /// peers' kernels then end by their deadline, or by their own abort).
    pub fn abort(&self) {
        if let Some(r) = &self.shared.resident {
            r.abort();
        }
    }

    /// Whether `op` runs device-resident (every rank answers the same for the same op).
    pub fn takes_resident(&self, op: &DeviceOp) -> bool {
        self.shared
            .resident
            .as_ref()
            .is_some_and(|r| r.takes(&op.op))
    }

    /// Queues `op` on `stream` (a stream of this communicator's GPU) when it runs device-resident, and
    /// says whether it did: `false` leaves `op` to [`enqueue`](Self::enqueue) or [`run`](Self::run).
    /// Every rank decides the same for the same op. The kernel is ordered after the work queued on
    /// `stream` before it, and the work queued after it waits for it; nothing waits on the host, and
    /// under CUDA graph capture the launch is captured (its arguments do not change between calls, so
    /// replays are new collectives). A failure shows in [`async_error`](Self::async_error) once the
    /// kernel has ended.
    ///
    /// # Safety
    /// The op's spans must stay valid device memory, untouched by anything not ordered on `stream`,
    /// until the kernel completes on `stream`.
    pub unsafe fn launch_on(
        &self,
        op: &DeviceOp,
        stream: &braid_cuda::Stream,
    ) -> Result<bool, Error> {
        let Some(r) = self.shared.resident.as_ref().filter(|r| r.takes(&op.op)) else {
            return Ok(false);
        };
        if let Some(e) = self.shared.poisoned() {
            return Err(e);
        }
        // SAFETY: the caller's contract.
        unsafe { r.launch(&op.op, stream)? };
        Ok(true)
    }

    /// Collectives queued and not yet ended.
    pub fn queued(&self) -> usize {
        self.shared.queued.load(Ordering::Acquire)
    }

    #[allow(clippy::too_many_arguments)]
    fn describe(
        &self,
        collective: Collective,
        root: usize,
        dtype: DType,
        redop: ReduceOp,
        count: usize,
        send: Span,
        recv: Span,
        send_bytes: usize,
        recv_bytes: usize,
    ) -> Result<DeviceOp, Error> {
        if root >= self.world {
            return Err(Error::invalid(format!(
                "root {root} is out of range for world size {}",
                self.world
            )));
        }
        if redop.is_bitwise() {
            return Err(Error::invalid(format!(
                "the bitwise reduction {redop} runs on host memory only (no GPU kernel has it yet)"
            )));
        }
        self.check("the send buffer", &send, send_bytes)?;
        self.check("the receive buffer", &recv, recv_bytes)?;
        Ok(DeviceOp {
            op: braid_exec::Op {
                collective,
                root,
                dtype,
                redop,
                count,
                send,
                recv,
            },
        })
    }

    fn elems(count: usize, times: usize, dtype: DType) -> Result<usize, Error> {
        count
            .checked_mul(times)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| Error::invalid(format!("{count} × {times} elements overflow")))
    }

    /// An all-reduce of `count` elements of `dtype` from `send` into `recv` (both of this device; in
    /// place when equal), checked.
    pub fn all_reduce_op(
        &self,
        send: Span,
        recv: Span,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<DeviceOp, Error> {
        let b = Self::elems(count, 1, dtype)?;
        self.describe(Collective::AllReduce, 0, dtype, op, count, send, recv, b, b)
    }

    /// A reduce-scatter: `send` holds `world × count` elements, `recv` receives this rank's `count`.
    pub fn reduce_scatter_op(
        &self,
        send: Span,
        recv: Span,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<DeviceOp, Error> {
        let (s, r) = (
            Self::elems(count, self.world, dtype)?,
            Self::elems(count, 1, dtype)?,
        );
        self.describe(
            Collective::ReduceScatter,
            0,
            dtype,
            op,
            count,
            send,
            recv,
            s,
            r,
        )
    }

    /// An all-gather: every rank's `count` elements of `send` land in `recv` (`world × count`) in rank
    /// order.
    pub fn all_gather_op(
        &self,
        send: Span,
        recv: Span,
        count: usize,
        dtype: DType,
    ) -> Result<DeviceOp, Error> {
        let (s, r) = (
            Self::elems(count, 1, dtype)?,
            Self::elems(count, self.world, dtype)?,
        );
        self.describe(
            Collective::AllGather,
            0,
            dtype,
            ReduceOp::Sum,
            count,
            send,
            recv,
            s,
            r,
        )
    }

    /// A broadcast of `count` elements from `root`'s `send` into every rank's `recv`.
    pub fn broadcast_op(
        &self,
        send: Span,
        recv: Span,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<DeviceOp, Error> {
        let b = Self::elems(count, 1, dtype)?;
        self.describe(
            Collective::Broadcast,
            root,
            dtype,
            ReduceOp::Sum,
            count,
            send,
            recv,
            b,
            b,
        )
    }

    /// A reduce of `count` elements from every rank's `send` into `root`'s `recv` (in place when equal).
    /// Off the root `recv` is not used (pass any span, or `send`).
    pub fn reduce_op(
        &self,
        send: Span,
        recv: Span,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<DeviceOp, Error> {
        let b = Self::elems(count, 1, dtype)?;
        // Off the root only the send buffer is read: the op sees it as both sides.
        let recv = if root == self.rank { recv } else { send };
        self.describe(Collective::Reduce, root, dtype, op, count, send, recv, b, b)
    }

    /// A barrier among the ranks (no memory).
    pub fn barrier_op(&self) -> Result<DeviceOp, Error> {
        self.describe(
            Collective::Barrier,
            0,
            DType::U8,
            ReduceOp::Sum,
            0,
            Span::EMPTY,
            Span::EMPTY,
            0,
            0,
        )
    }

    /// Runs `op` and returns once it has finished on the device, after every collective queued before it.
    ///
    /// # Safety
    /// The op's spans must be valid device memory until it returns, untouched by anyone else meanwhile
    /// (nothing on the device that reads or writes them may still be running).
    pub unsafe fn run(&self, op: DeviceOp) -> Result<(), Error> {
        if self.queued() == 0 {
            return self.shared.run_now(&op);
        }
        // Behind queued collectives: in the queue, and wait for it.
        let (tx, rx) = mpsc::channel();
        // SAFETY: the caller's contract covers the spans until this returns, which is after the op ends.
        unsafe { self.enqueue(op, Box::new(Ready), Box::new(Reply(tx)))? };
        let limit = self.shared.timeout * 2 + Duration::from_secs(10);
        rx.recv_timeout(limit).unwrap_or_else(|_| {
            Err(Error::Internal(format!(
                "a queued device collective did not end within {} s",
                limit.as_secs()
            )))
        })
    }

    /// Queues `op` for the worker thread and returns at once: it starts once `gate` opens and every
    /// collective issued before it has ended, and `signal` fires when it ends. When this returns an
    /// error (the communicator is unusable, or the worker could not be started), nothing was queued and
    /// `signal` does not fire.
    ///
    /// # Safety
    /// The op's spans must stay valid device memory, untouched by anyone else, until `signal` fires.
    pub unsafe fn enqueue(
        &self,
        op: DeviceOp,
        gate: Box<dyn DeviceGate>,
        signal: Box<dyn DeviceSignal>,
    ) -> Result<(), Error> {
        if let Some(e) = self.shared.poisoned() {
            return Err(e);
        }
        let mut worker = self.worker.lock();
        let w = match &mut *worker {
            Some(w) => w,
            None => {
                let (tx, rx) = mpsc::channel::<Task>();
                let shared = self.shared.clone();
                let handle = std::thread::Builder::new()
                    .name(format!("braid-device-{}", self.rank))
                    .spawn(move || shared.serve(rx))
                    .map_err(|e| {
                        Error::io("starting the device communicator's worker thread", e)
                    })?;
                worker.insert(Worker { tx, handle })
            }
        };
        self.shared.queued.fetch_add(1, Ordering::AcqRel);
        if let Err(mpsc::SendError(task)) = w.tx.send(Task { op, gate, signal }) {
            self.shared.queued.fetch_sub(1, Ordering::AcqRel);
            drop(task);
            return Err(Error::Internal(
                "the device communicator's worker thread has stopped".into(),
            ));
        }
        Ok(())
    }
}

impl Drop for DeviceCommunicator {
    fn drop(&mut self) {
        // The queued collectives end first (each bounded by the timeout), so no signal is lost.
        if let Some(w) = self.worker.get_mut().take() {
            drop(w.tx);
            if w.handle.join().is_err() {
                tracing::warn!("the device communicator's worker thread panicked");
            }
        }
    }
}
