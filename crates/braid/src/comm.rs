//! The communicator: setup, argument checks, the collectives, abort and sticky errors. Ops run on
//! streams (`streams.rs`); asynchronous calls on chosen streams and borrowed buffers are in `scope.rs`.
//!
//! Every collective becomes an [`Op`]; blocking calls and the `*_async` calls without a stream run on
//! stream 0, in the order they were issued.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_core::{Config, DType, Element, Error, ReduceOp};
use braid_transport::{Geometry, Link, Router, Setup, SetupCtx, WaitPolicy};
use tracing::debug;

use crate::bootstrap::{self, Agreed};
use crate::exec::{Executor, Kind, Op};
use crate::id::{random_secret, UniqueId};
use crate::job::JobEnv;
use crate::streams::{Streams, Task, Work};
use crate::tune::{Algo, AlgoPolicy, Collective, Tuner, TuningFile};
use crate::wire::PeerInfo;

/// A group of ranks that run collectives together.
///
/// Errors follow NCCL's split: an invalid argument is rejected before anything happens and the
/// communicator stays usable; any other error (timeout, dead or aborted peer, mismatch) makes the
/// communicator unusable, visible through [`Communicator::async_error`], and later calls fail fast.
pub struct Communicator {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    /// How each peer is reached ("self", "shm" or "tcp"), indexed by rank.
    routes: Vec<&'static str>,
    /// The ranks of each host.
    hosts: Vec<Vec<usize>>,
    /// Where the ranks are, as the communicator decided it.
    topology: braid_topo::Topology,
    config: Config,
    pub(crate) streams: Arc<Streams>,
    abort: Arc<AtomicBool>,
    recorder: crate::recorder::Recorder,
}

/// The identity of this host: equal strings mean the same kernel (and the same `/dev/shm`).
/// Where the ranks are: the topology file if there is one, else what probing infers if asked, else the
/// grouping by host identity. Rank 0 writes it to `BRAID_TOPO_DUMP_FILE` if set.
fn choose_topology(
    config: &Config,
    table: &[PeerInfo],
    transport: Option<&Router>,
    rank: usize,
    deadline: Instant,
) -> Result<braid_topo::Topology, Error> {
    let world = table.len();
    let topology = if let Some(path) = &config.topo_file {
        let t = braid_topo::Topology::load(path)
            .and_then(|t| t.check_world_size(world).map(|_| t))
            .map_err(|e| Error::invalid(format!("BRAID_TOPO_FILE={}: {e}", path.display())))?;
        debug!(rank, hosts = t.hosts.len(), "topology from file");
        t
    } else if let (true, Some(t)) = (config.topo_probe, transport) {
        let (lat, bw) = crate::probe::measure(t, rank, world, deadline)?;
        if rank == 0 {
            debug!(
                ?lat,
                ?bw,
                "probe: one-way latency (s) and bandwidth (B/s), [from][to]"
            );
        }
        // Hosts are told apart by bandwidth: over TCP, loopback and a network link can show similar
        // latencies on a busy machine, while their bandwidths stay far apart. Latency is kept on the
        // links for the tuner.
        // The first large jump in each rank's row is the default rule; when it leaves doubt (a busy
        // machine spreads the measurements inside a host), the widest jump is tried too, and the more
        // confident reading wins.
        let infer = |rule| {
            let options = braid_topo::ProbeOptions {
                rule,
                ..braid_topo::ProbeOptions::default()
            };
            braid_topo::infer_topology(None, Some(&bw), &options)
                .map_err(|e| Error::Bootstrap(format!("BRAID_TOPO_PROBE: {e}")))
        };
        let (mut topology, mut inference) = infer(braid_topo::GapRule::First)?;
        if inference.confidence < 1.0 {
            let (t, i) = infer(braid_topo::GapRule::Widest)?;
            if i.confidence > inference.confidence {
                (topology, inference) = (t, i);
            }
        }
        for link in &mut topology.links {
            let [i, j] = link.ranks;
            let l = lat[i][j].min(lat[j][i]);
            link.latency = (l.is_finite() && l > 0.0).then_some(l);
        }
        if rank == 0 {
            tracing::info!(
                groups = ?inference.groups,
                confidence = inference.confidence,
                "probed topology: {}",
                inference.reason
            );
        }
        topology
    } else {
        let ids: Vec<&str> = table.iter().map(|i| i.host.as_str()).collect();
        braid_topo::Topology::from_identities(&ids)
            .map_err(|e| Error::Bootstrap(format!("host identities: {e}")))?
    };
    if let (0, Some(path)) = (rank, &config.topo_dump_file) {
        topology
            .save(path)
            .map_err(|e| Error::invalid(format!("BRAID_TOPO_DUMP_FILE={}: {e}", path.display())))?;
    }
    Ok(topology)
}

/// The link between hosts as probing measured it (median latency and bandwidth over every pair of ranks
/// on different hosts), for the tuner's model.
fn measured_tcp_link(t: &braid_topo::Topology) -> Option<crate::tune::LinkParams> {
    if t.source != braid_topo::Source::Probed {
        return None;
    }
    let median = |mut v: Vec<f64>| {
        v.retain(|x| x.is_finite() && *x > 0.0);
        v.sort_by(f64::total_cmp);
        (!v.is_empty()).then(|| v[v.len() / 2])
    };
    let between = || t.links.iter().filter(|l| !l.class.is_intra_host());
    let latency = median(between().filter_map(|l| l.latency).collect())?;
    let bandwidth = median(between().filter_map(|l| l.bandwidth).collect())?;
    Some(crate::tune::LinkParams {
        alpha_us: latency * 1e6,
        beta_us_per_byte: 1e6 / bandwidth,
        gamma_us_per_byte: crate::tune::LinkParams::SHM_DEFAULT.gamma_us_per_byte,
    })
}

/// This host's identity: hostname, boot id and network namespace, so that containers or network
/// namespaces sharing a kernel count as separate hosts (`BRAID_HOST_ID` overrides it).
fn host_identity() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!("{}#{}#{}", name.trim(), boot.trim(), netns)
}

/// Holds back SIGTERM, SIGINT and SIGHUP on this thread while alive; a signal that arrives meanwhile is
/// delivered when it is dropped.
struct TerminationHold {
    old: libc::sigset_t,
}

impl TerminationHold {
    fn new() -> TerminationHold {
        // SAFETY: sigset_t is plain data, initialised by sigemptyset/sigaddset before use; pthread_sigmask
        // only changes this thread's signal mask and saves the previous one in `old`.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
                libc::sigaddset(&mut set, sig);
            }
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
            TerminationHold { old }
        }
    }
}

impl Drop for TerminationHold {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved in `new` on this same thread.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut());
        }
    }
}

fn init_logging(config: &Config) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(config.debug.directive()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Which side of a collective a caller's buffer is.
enum In<'a> {
    Buf(&'a [u8]),
    InPlace,
}

impl Communicator {
    /// Joins the communicator named by `id` as `rank` of `world`; every rank must call this with the same
    /// id, world and transport settings. Blocks until every rank has joined (at most `config.timeout`).
    pub fn init(
        world: usize,
        rank: usize,
        id: &UniqueId,
        config: Config,
    ) -> Result<Communicator, Error> {
        init_logging(&config);
        if world == 0 || rank >= world {
            return Err(Error::invalid(format!(
                "rank {rank} is out of range for world size {world}"
            )));
        }
        if config.slots < 2 {
            return Err(Error::invalid("a channel needs at least 2 slots"));
        }
        let policy = match config.algo.as_deref() {
            Some(text) => AlgoPolicy::parse(text)
                .map_err(|e| Error::invalid(format!("BRAID_ALGO={text:?}: {e}")))?,
            None => AlgoPolicy::default(),
        };
        let file = config
            .tune_file
            .as_deref()
            .map(TuningFile::load)
            .transpose()?;
        let tuner = Tuner::new(
            world,
            policy,
            file,
            config.chunk_bytes,
            config.direct_max_bytes,
        );
        let deadline = Instant::now() + config.timeout;
        let slot_bytes = config.chunk_bytes.next_multiple_of(64);
        let geometry = Geometry {
            rank,
            world,
            channels: config.streams,
            slots: config.slots,
            slot_bytes,
        };
        let host = config.host_id.clone().unwrap_or_else(host_identity);
        let choice = braid_transport::transports(&config, world, id.addr())?;
        let nonce = random_secret()?;
        let setup = Setup::prepare(
            choice,
            SetupCtx {
                geometry,
                secret: *id.secret(),
                nonce: u64::from_le_bytes(nonce[..8].try_into().expect("8 bytes")),
                policy: WaitPolicy::for_host(1, config.spin_us),
                deadline,
            },
        )?;
        let me = PeerInfo {
            pid: std::process::id(),
            host,
            endpoints: setup.endpoints(),
        };
        let agreed = Agreed {
            world,
            slots: geometry.slots as u32,
            slot_bytes: geometry.slot_bytes as u32,
        };
        let (table, mut links) = bootstrap::join(id, rank, agreed, me.clone(), deadline)?;
        let transport = if world == 1 {
            Router::single(geometry)
        } else {
            let local = table.iter().filter(|i| i.host == me.host).count();
            let policy = WaitPolicy::for_host(local, config.spin_us);
            let connecting = setup.connect(&table, policy)?;
            // Everyone has connected to everyone: what had to stay findable until now (names in
            // /dev/shm) can go, so nothing outlives a killed process. A launcher stopping the job right
            // now must not catch us between the two steps.
            let _hold = TerminationHold::new();
            links.barrier(1, deadline)?;
            let router = connecting.activate()?;
            debug!(rank, routes = ?router.route_names(), "transports ready");
            router
        };
        drop(links);
        let abort = Arc::new(AtomicBool::new(false));
        let maps = transport.abort_handle();
        debug!(rank, world, "communicator ready");
        let routes: Vec<&'static str> = transport.route_names().to_vec();
        let transport = (world > 1).then_some(transport);
        let topology = choose_topology(&config, &table, transport.as_ref(), rank, deadline)?;
        let hosts = topology.host_groups();
        let link = transport.map(|t| Box::new(t) as Box<dyn Link>);
        let mut executor = Executor::new(rank, world, config.clone(), tuner, link, abort.clone());
        executor.set_hosts(hosts.clone());
        if let Some(link) = measured_tcp_link(&topology) {
            debug!(rank, ?link, "link between hosts, as probed");
            executor.tuner.set_tcp_link(link);
        }
        let recorder = executor.recorder.clone();
        let limit = config.timeout * 2 + Duration::from_secs(10);
        let streams = Arc::new(Streams::new(rank, executor, config.streams, maps, limit));
        let inner = Inner {
            rank,
            world,
            routes,
            hosts,
            topology,
            streams,
            recorder,
            config,
            abort,
        };
        Ok(Communicator {
            inner: Arc::new(inner),
        })
    }

    /// Joins the job described by the environment (`BRAID_RANK`/`BRAID_WORLD_SIZE`/`BRAID_ROOT`/
    /// `BRAID_SECRET`, or torchrun's, Open MPI's, PMI's or Slurm's variables), configured by `BRAID_*`.
    pub fn from_env() -> Result<Communicator, Error> {
        let config = Config::from_env()?;
        let job = JobEnv::detect()?;
        Communicator::init(job.world, job.rank, &job.id, config)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.world
    }

    /// How this rank reaches each rank: `"self"`, `"shm"` or `"tcp"`, indexed by rank.
    pub fn peer_transports(&self) -> &[&'static str] {
        &self.inner.routes
    }

    /// The ranks of each host, as the communicator groups them (hosts in order of their first rank).
    pub fn hosts(&self) -> &[Vec<usize>] {
        &self.inner.hosts
    }

    /// The topology in use: from `BRAID_TOPO_FILE`, from probing (`BRAID_TOPO_PROBE`), or from the host
    /// identities exchanged at bootstrap.
    pub fn topology(&self) -> &braid_topo::Topology {
        &self.inner.topology
    }

    /// A one-line summary of the transports in use, e.g. `shm+tcp, 2 hosts`.
    pub fn transports_summary(&self) -> String {
        let mut kinds: Vec<&str> = self
            .inner
            .routes
            .iter()
            .copied()
            .filter(|r| *r != "self")
            .collect();
        kinds.sort_unstable();
        kinds.dedup();
        let kinds = if kinds.is_empty() {
            "nothing (one rank)".to_string()
        } else {
            kinds.join("+")
        };
        match self.inner.hosts.len() {
            1 => format!("{kinds}, 1 host"),
            h => format!("{kinds}, {h} hosts"),
        }
    }

    /// The configuration in effect.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The algorithm braid would use for `c` at `bytes` bytes, and why (`forced`, `table`, `model`,
    /// `rule`).
    pub fn algorithm(&self, c: Collective, bytes: usize) -> (Algo, &'static str) {
        self.inner
            .streams
            .sched
            .lock()
            .exec
            .tuner
            .pick_with_reason(c, bytes)
    }

    /// Forces the algorithm of `c` on this rank from the next call on (`None` returns the choice to
    /// braid). Every rank must make the same call at the same point in its sequence of collectives.
    pub fn set_algorithm(&self, c: Collective, algo: Option<Algo>) -> Result<(), Error> {
        self.inner.streams.sched.lock().exec.tuner.force(c, algo)
    }

    /// The last collectives of this communicator (up to 64), oldest first: what ran, with which
    /// algorithm, for how long, and how it ended. Readable while a collective is blocked.
    pub fn flight_record(&self) -> Vec<crate::FlightRecord> {
        self.inner.recorder.snapshot()
    }

    /// The first error that made this communicator unusable, if any.
    pub fn async_error(&self) -> Option<Error> {
        self.inner.streams.sticky()
    }

    /// Aborts: every blocked or later call on this communicator returns an error promptly, and peers
    /// waiting on this rank learn that it failed. Safe to call from any thread.
    pub fn abort(&self) {
        let inner = &self.inner;
        inner.abort.store(true, Ordering::SeqCst);
        inner.streams.abort(Error::Aborted {
            rank: inner.rank,
            during: String::new(),
        });
    }

    // ---- argument checks -------------------------------------------------------------------------

    pub(crate) fn elems(&self, len: usize, dtype: DType, what: &str) -> Result<usize, Error> {
        if len % dtype.size() != 0 {
            return Err(Error::invalid(format!(
                "{what} buffer of {len} bytes is not a whole number of {dtype} elements"
            )));
        }
        Ok(len / dtype.size())
    }

    fn check_root(&self, root: usize) -> Result<(), Error> {
        if root >= self.inner.world {
            return Err(Error::invalid(format!(
                "root {root} is out of range for world size {}",
                self.inner.world
            )));
        }
        Ok(())
    }

    fn times_world(&self, count: usize, dtype: DType) -> Result<usize, Error> {
        count
            .checked_mul(self.inner.world)
            .and_then(|c| dtype.bytes_for(c).ok())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "count {count} × world size {} overflows",
                    self.inner.world
                ))
            })
    }

    // ---- byte-level collectives (any dtype) -------------------------------------------------------

    /// All-reduce of `recv.len() / dtype.size()` elements from `send` into `recv`.
    pub fn all_reduce_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.all_reduce_impl(In::Buf(send), recv, dtype, op)
    }

    /// All-reduce in place.
    pub fn all_reduce_bytes_in_place(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.all_reduce_impl(In::InPlace, buf, dtype, op)
    }

    fn all_reduce_impl(
        &self,
        send: In<'_>,
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        let count = self.elems(recv.len(), dtype, "receive")?;
        if let In::Buf(s) = send {
            if s.len() != recv.len() {
                return Err(Error::invalid(format!(
                    "all_reduce: send buffer has {} bytes, receive buffer {}",
                    s.len(),
                    recv.len()
                )));
            }
        }
        self.run(Kind::AllReduce, dtype, op, count, send, recv)
    }

    /// Reduce-scatter: `send` holds `world` blocks of `recv.len()` bytes; rank `r` gets the reduction of
    /// block `r`.
    pub fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        let count = self.elems(recv.len(), dtype, "receive")?;
        let need = self.times_world(count, dtype)?;
        if send.len() != need {
            return Err(Error::invalid(format!(
                "reduce_scatter: send buffer must hold world × {count} elements ({need} bytes), has {}",
                send.len()
            )));
        }
        self.run(Kind::ReduceScatter, dtype, op, count, In::Buf(send), recv)
    }

    /// All-gather: `recv` gets every rank's `send`, in rank order.
    pub fn all_gather_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
    ) -> Result<(), Error> {
        let count = self.elems(send.len(), dtype, "send")?;
        let need = self.times_world(count, dtype)?;
        if recv.len() != need {
            return Err(Error::invalid(format!(
                "all_gather: receive buffer must hold world × {count} elements ({need} bytes), has {}",
                recv.len()
            )));
        }
        self.run(
            Kind::AllGather,
            dtype,
            ReduceOp::Sum,
            count,
            In::Buf(send),
            recv,
        )
    }

    /// All-to-all: `send` and `recv` each hold `world` blocks of equal size; rank `r`'s send block `j`
    /// arrives in rank `j`'s receive block `r` (its own block is copied locally). The block size is
    /// `send.len() / world` bytes, a whole number of `dtype` elements.
    pub fn all_to_all_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
    ) -> Result<(), Error> {
        let world = self.inner.world;
        let total = self.elems(send.len(), dtype, "send")?;
        if total % world != 0 {
            return Err(Error::invalid(format!(
                "all_to_all: the send buffer's {total} {dtype} elements do not split into {world} equal blocks"
            )));
        }
        if recv.len() != send.len() {
            return Err(Error::invalid(format!(
                "all_to_all: receive buffer has {} bytes, send buffer {} (both must hold world × block)",
                recv.len(),
                send.len()
            )));
        }
        self.run(
            Kind::AllToAll,
            dtype,
            ReduceOp::Sum,
            total / world,
            In::Buf(send),
            recv,
        )
    }

    /// Broadcast of `root`'s `send` into every rank's `recv` (`send` is read on the root only).
    pub fn broadcast_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<(), Error> {
        self.check_root(root)?;
        let count = self.elems(recv.len(), dtype, "receive")?;
        if self.inner.rank == root && send.len() != recv.len() {
            return Err(Error::invalid(format!(
                "broadcast: the root's send buffer has {} bytes, its receive buffer {}",
                send.len(),
                recv.len()
            )));
        }
        let send = if self.inner.rank == root {
            In::Buf(send)
        } else {
            In::InPlace
        };
        self.run(
            Kind::Broadcast { root },
            dtype,
            ReduceOp::Sum,
            count,
            send,
            recv,
        )
    }

    /// Reduce to `root`: `recv` is written on the root only.
    pub fn reduce_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Error> {
        self.check_root(root)?;
        let count = self.elems(send.len(), dtype, "send")?;
        if self.inner.rank == root && recv.len() != send.len() {
            return Err(Error::invalid(format!(
                "reduce: the root's receive buffer has {} bytes, its send buffer {}",
                recv.len(),
                send.len()
            )));
        }
        let len = send.len();
        if self.inner.rank == root {
            return self.run(Kind::Reduce { root }, dtype, op, count, In::Buf(send), recv);
        }
        // Off the root only the send buffer is read; the op sees it as both sides.
        let ptr = send.as_ptr();
        // SAFETY: `send` is borrowed for the whole (blocking) call and only read by a non-root schedule.
        let op = unsafe {
            Op::new(
                Kind::Reduce { root },
                dtype,
                op,
                count,
                ptr,
                len,
                ptr as *mut u8,
                0,
            )
        };
        self.run_blocking(op)
    }

    fn run(
        &self,
        kind: Kind,
        dtype: DType,
        redop: ReduceOp,
        count: usize,
        send: In<'_>,
        recv: &mut [u8],
    ) -> Result<(), Error> {
        let rl = recv.len();
        let rp = recv.as_mut_ptr();
        let (sp, sl) = match send {
            In::Buf(s) => (s.as_ptr(), s.len()),
            In::InPlace => (rp as *const u8, rl),
        };
        // SAFETY: both slices are borrowed for the whole blocking call; lengths were checked by the
        // caller; a shared and a mutable borrow never overlap (the borrow checker saw to that), and in
        // place they are the same pointer.
        let op = unsafe { Op::new(kind, dtype, redop, count, sp, sl, rp, rl) };
        self.run_blocking(op)
    }

    fn run_blocking(&self, op: Op) -> Result<(), Error> {
        self.inner.streams.run_blocking(op, 0)
    }

    // ---- typed collectives ------------------------------------------------------------------------

    /// All-reduce `send` into `recv` (same length).
    pub fn all_reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.all_reduce_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            op,
        )
    }

    /// All-reduce in place.
    pub fn all_reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.all_reduce_bytes_in_place(bytemuck::cast_slice_mut(buf), T::DTYPE, op)
    }

    /// Reduce-scatter: `send.len() == world * recv.len()`.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.reduce_scatter_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            op,
        )
    }

    /// Reduce-scatter in place: `buf` holds `world` blocks; this rank's block receives the result.
    pub fn reduce_scatter_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        let world = self.inner.world;
        if buf.len() % world != 0 {
            return Err(Error::invalid(format!(
                "reduce_scatter_in_place: {} elements do not split into {world} blocks",
                buf.len()
            )));
        }
        let count = buf.len() / world;
        let es = T::DTYPE.size();
        let total = buf.len() * es;
        let base = buf.as_mut_ptr() as *mut u8;
        // SAFETY: `buf` is borrowed mutably for the whole call; the receive side is this rank's block
        // inside it, which the reduce-scatter schedule reads as its own input (same address, `Src::Dst`).
        let op = unsafe {
            Op::new(
                Kind::ReduceScatter,
                T::DTYPE,
                op,
                count,
                base,
                total,
                base.add(self.inner.rank * count * es),
                count * es,
            )
        };
        self.run_blocking(op)
    }

    /// All-gather: `recv.len() == world * send.len()`.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), Error> {
        self.all_gather_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
        )
    }

    /// All-gather in place: this rank's block of `buf` is its contribution.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<(), Error> {
        let world = self.inner.world;
        if buf.len() % world != 0 {
            return Err(Error::invalid(format!(
                "all_gather_in_place: {} elements do not split into {world} blocks",
                buf.len()
            )));
        }
        let count = buf.len() / world;
        let es = T::DTYPE.size();
        let base = buf.as_mut_ptr() as *mut u8;
        // SAFETY: `buf` is borrowed mutably for the whole call; the send side is this rank's own block
        // inside it, which the all-gather schedule only reads (and never writes to another block's range).
        let op = unsafe {
            Op::new(
                Kind::AllGather,
                T::DTYPE,
                ReduceOp::Sum,
                count,
                base.add(self.inner.rank * count * es),
                count * es,
                base,
                buf.len() * es,
            )
        };
        self.run_blocking(op)
    }

    /// All-to-all of per-peer blocks: `send` and `recv` both hold `world × block` elements; this rank's
    /// send block `j` goes to rank `j`, and receive block `p` is what rank `p` sent to this rank.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), Error> {
        let world = self.inner.world;
        if send.len() % world != 0 {
            return Err(Error::invalid(format!(
                "all_to_all: {} send elements do not split into {world} equal blocks",
                send.len()
            )));
        }
        if recv.len() != send.len() {
            return Err(Error::invalid(format!(
                "all_to_all: receive buffer has {} elements, send buffer {} (both must hold world × block)",
                recv.len(),
                send.len()
            )));
        }
        self.all_to_all_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
        )
    }

    /// Broadcast from `root`: `send` is read on the root only (pass `&[]` elsewhere).
    pub fn broadcast<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        root: usize,
    ) -> Result<(), Error> {
        self.broadcast_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            root,
        )
    }

    /// Broadcast in place.
    pub fn broadcast_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<(), Error> {
        self.check_root(root)?;
        let count = buf.len();
        self.run(
            Kind::Broadcast { root },
            T::DTYPE,
            ReduceOp::Sum,
            count,
            In::InPlace,
            bytemuck::cast_slice_mut(buf),
        )
    }

    /// Reduce to `root`: `recv` is written on the root only (pass `&mut []` elsewhere).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Error> {
        self.reduce_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            op,
            root,
        )
    }

    /// Reduce to `root` in place (other ranks' buffers are left as they were).
    pub fn reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Error> {
        self.check_root(root)?;
        let count = buf.len();
        self.run(
            Kind::Reduce { root },
            T::DTYPE,
            op,
            count,
            In::InPlace,
            bytemuck::cast_slice_mut(buf),
        )
    }

    /// Waits until every rank has reached the barrier.
    pub fn barrier(&self) -> Result<(), Error> {
        self.run(
            Kind::Barrier,
            DType::U8,
            ReduceOp::Sum,
            0,
            In::InPlace,
            &mut [],
        )
    }

    // ---- asynchronous collectives -----------------------------------------------------------------

    /// Enqueues an in-place all-reduce of an owned buffer; [`Work::wait`] gives it back reduced.
    pub fn all_reduce_async<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.submit_owned(Kind::AllReduce, op, buf)
    }

    /// Enqueues an in-place broadcast of an owned buffer from `root`.
    pub fn broadcast_async<T: Element>(
        &self,
        buf: Vec<T>,
        root: usize,
    ) -> Result<Work<Vec<T>>, Error> {
        self.check_root(root)?;
        Ok(self.submit_owned(Kind::Broadcast { root }, ReduceOp::Sum, buf))
    }

    /// Enqueues an all-gather; [`Work::wait`] returns the gathered buffer (`world × send.len()`).
    pub fn all_gather_async<T: Element>(&self, send: Vec<T>) -> Work<Vec<T>> {
        let world = self.inner.world;
        let count = send.len();
        let mut out = vec![T::zeroed(); count * world];
        out[self.inner.rank * count..(self.inner.rank + 1) * count].copy_from_slice(&send);
        drop(send);
        let es = T::DTYPE.size();
        let mut boxed = Box::new(out);
        let base = boxed.as_mut_ptr() as *mut u8;
        // SAFETY: the vector's heap buffer is owned by the task until it completes and is not touched by
        // anyone else meanwhile; the send side is this rank's block inside it (in-place all-gather).
        let op = unsafe {
            Op::new(
                Kind::AllGather,
                T::DTYPE,
                ReduceOp::Sum,
                count,
                base.add(self.inner.rank * count * es),
                count * es,
                base,
                count * world * es,
            )
        };
        self.submit(op, boxed)
    }

    /// Enqueues a barrier.
    pub fn barrier_async(&self) -> Work<()> {
        self.submit(Op::barrier(), Box::new(()))
    }

    fn submit_owned<T: Element>(&self, kind: Kind, redop: ReduceOp, buf: Vec<T>) -> Work<Vec<T>> {
        self.submit_owned_on(0, kind, redop, buf)
            .unwrap_or_else(|e| self.failed_work(e))
    }

    /// Queues `kind` in place on an owned buffer on `stream`.
    pub(crate) fn submit_owned_on<T: Element>(
        &self,
        stream: usize,
        kind: Kind,
        redop: ReduceOp,
        buf: Vec<T>,
    ) -> Result<Work<Vec<T>>, Error> {
        let mut boxed = Box::new(buf);
        let len = boxed.len() * T::DTYPE.size();
        let count = boxed.len();
        let ptr = boxed.as_mut_ptr() as *mut u8;
        // SAFETY: the vector's heap buffer is owned by the task until it completes (moving the box does
        // not move the heap buffer) and nobody else touches it meanwhile.
        let op = unsafe { Op::new(kind, T::DTYPE, redop, count, ptr, len, ptr, len) };
        self.submit_on(stream, op, boxed)
    }

    fn submit<R: Send + 'static>(&self, op: Op, keep: Box<R>) -> Work<R> {
        self.submit_on(0, op, keep)
            .unwrap_or_else(|e| self.failed_work(e))
    }

    pub(crate) fn submit_on<R: Send + 'static>(
        &self,
        stream: usize,
        op: Op,
        keep: Box<R>,
    ) -> Result<Work<R>, Error> {
        let inner = &self.inner;
        let task = Task::new(op, Some(keep));
        inner.streams.submit(task.clone(), stream)?;
        Ok(Work::new(task, inner.rank, inner.streams_limit()))
    }

    /// A work handle that already holds `e` (a submission that could not be queued).
    fn failed_work<R: Send + 'static>(&self, e: Error) -> Work<R> {
        let task = Task::new(Op::barrier(), None);
        task.fail_now(e);
        Work::new(task, self.inner.rank, Duration::ZERO)
    }
}

impl Inner {
    pub(crate) fn streams_limit(&self) -> Duration {
        self.config.timeout * 2 + Duration::from_secs(10)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Queued ops still run (their buffers are owned by their tasks); each is bounded by the
        // timeout, so this is bounded too.
        self.inner.streams.shut_down();
    }
}
