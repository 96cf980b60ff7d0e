//! Collectives on device memory: [`Communicator::device`] sets up rings in device memory between the
//! ranks of the host (braid-transport's `ipc` transport over a [`DeviceMemory`]) and returns a
//! [`DeviceCommunicator`], whose collectives run the same schedules with a device [`Engine`] (braid-cuda's
//! `CudaEngine` on a GPU; braid-exec's `EmulatedDeviceEngine` over braid-transport's `EmulatedDevice`
//! without one).
//!
//! The calls block the calling thread until the collective has finished on the device. Every rank of
//! the communicator must be on one host for now (rings between hosts in device memory need RDMA into
//! device memory or staging through the host, which come later).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

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

/// The device memory and the engine a rank brings to [`Communicator::device_from`].
pub type DeviceParts = (Arc<dyn DeviceMemory>, Box<dyn Engine>);

/// The most bytes a transport's endpoint may take in the exchange.
const ENDPOINT_MAX: usize = 1024;

/// Collectives on device memory among the ranks of a [`Communicator`], one host.
pub struct DeviceCommunicator {
    rank: usize,
    world: usize,
    timeout: std::time::Duration,
    ordinal: u32,
    routes: Vec<&'static str>,
    state: Mutex<State>,
}

struct State {
    exec: braid_exec::Executor<dyn Engine>,
    tuner: Tuner,
    seq: u64,
}

impl Communicator {
    /// Sets up collectives on the device memory `memory` gives, computed by `engine` (which must accept
    /// that memory): every rank of the communicator calls this with memory of its own device, and all
    /// must run on one host. It exchanges the rings' descriptors between the ranks (checked with the
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
                nonce: u64::from_le_bytes(nonce[..8].try_into().expect("8 bytes")),
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
            let mut frame = vec![0u8; ENDPOINT_MAX];
            let fits = blob.len() <= ENDPOINT_MAX - 2;
            if fits {
                frame[..2].copy_from_slice(&(blob.len() as u16).to_le_bytes());
                frame[2..2 + blob.len()].copy_from_slice(&blob);
            }
            let fits = self.all_agree(
                "exchanging device ring endpoints",
                if fits {
                    Ok(())
                } else {
                    Err(Error::Internal(format!(
                        "the ipc endpoint takes {} bytes, more than {ENDPOINT_MAX}",
                        blob.len()
                    )))
                },
            );
            fits?;
            let mut all = vec![0u8; ENDPOINT_MAX * world];
            self.all_gather(&frame, &mut all)?;
            let table: Vec<Peer> = (0..world)
                .map(|p| {
                    let f = &all[p * ENDPOINT_MAX..(p + 1) * ENDPOINT_MAX];
                    let len = (u16::from_le_bytes([f[0], f[1]]) as usize).min(ENDPOINT_MAX - 2);
                    Peer {
                        pid: 0,
                        host: inner.host_ids[p].clone(),
                        endpoints: vec![Endpoint {
                            transport: NAME.into(),
                            blob: f[2..2 + len].to_vec(),
                        }],
                    }
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
            timeout: config.timeout,
            ordinal,
            routes,
            state: Mutex::new(State {
                exec,
                tuner,
                seq: 0,
            }),
        })
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

    #[allow(clippy::too_many_arguments)]
    fn run(
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
    ) -> Result<(), Error> {
        if root >= self.world {
            return Err(Error::invalid(format!(
                "root {root} is out of range for world size {}",
                self.world
            )));
        }
        self.check("the send buffer", &send, send_bytes)?;
        self.check("the receive buffer", &recv, recv_bytes)?;
        let mut state = self.state.lock();
        let st = &mut *state;
        let algo = st.tuner.pick_cached(collective, count * dtype.size());
        let seq = st.seq;
        let op = braid_exec::Op {
            collective,
            root,
            dtype,
            redop,
            count,
            send,
            recv,
        };
        let seqs = &mut st.seq;
        let started = Instant::now();
        let result = st.exec.run_op(op, algo, 0, seq, started, || *seqs += 1);
        if result.is_err() {
            // Kernels queued before the failure may still write the buffers: the caller gets them back
            // only once they have finished (bounded).
            if let Err(e) = st.exec.quiesce(Instant::now() + self.timeout) {
                tracing::warn!("after a failed device collective: {e}");
            }
        }
        result
    }

    fn elems(count: usize, times: usize, dtype: DType) -> Result<usize, Error> {
        count
            .checked_mul(times)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| Error::invalid(format!("{count} × {times} elements overflow")))
    }

    /// All-reduce of `count` elements of `dtype` from `send` into `recv` (both of this device; in place
    /// when equal).
    ///
    /// # Safety
    /// Both spans must be valid device memory for the collective until it returns, untouched by anyone
    /// else meanwhile (nothing queued on the device that reads or writes them may still be running).
    pub unsafe fn all_reduce(
        &self,
        send: Span,
        recv: Span,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        let b = Self::elems(count, 1, dtype)?;
        self.run(Collective::AllReduce, 0, dtype, op, count, send, recv, b, b)
    }

    /// Reduce-scatter: `send` holds `world × count` elements, `recv` receives this rank's `count`.
    ///
    /// # Safety
    /// As [`DeviceCommunicator::all_reduce`].
    pub unsafe fn reduce_scatter(
        &self,
        send: Span,
        recv: Span,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        let (s, r) = (
            Self::elems(count, self.world, dtype)?,
            Self::elems(count, 1, dtype)?,
        );
        self.run(
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

    /// All-gather: every rank's `count` elements of `send` land in `recv` (`world × count`) in rank
    /// order.
    ///
    /// # Safety
    /// As [`DeviceCommunicator::all_reduce`].
    pub unsafe fn all_gather(
        &self,
        send: Span,
        recv: Span,
        count: usize,
        dtype: DType,
    ) -> Result<(), Error> {
        let (s, r) = (
            Self::elems(count, 1, dtype)?,
            Self::elems(count, self.world, dtype)?,
        );
        self.run(
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

    /// Broadcast of `count` elements from `root`'s `send` into every rank's `recv`.
    ///
    /// # Safety
    /// As [`DeviceCommunicator::all_reduce`].
    pub unsafe fn broadcast(
        &self,
        send: Span,
        recv: Span,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<(), Error> {
        let b = Self::elems(count, 1, dtype)?;
        self.run(
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
}
