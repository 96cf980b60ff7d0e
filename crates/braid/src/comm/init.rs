//! Creating a communicator: the bootstrap, the transports, the topology and the executor.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_core::{Config, Error};
use braid_transport::{Geometry, Link, Router, Setup, SetupCtx, WaitPolicy};
use tracing::debug;

use super::state::{Communicator, Inner};
use crate::bootstrap::{self, Agreed};
use crate::dispatch::Dispatcher;
use crate::id::{random_secret, UniqueId};
use crate::job::JobEnv;
use crate::streams::Streams;
use crate::tune::{AlgoPolicy, Tuner, TuningFile};
use crate::wire::{PeerInfo, MAX_WORLD};

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
    Ok(topology)
}

/// The link between hosts as probing measured it (median latency and bandwidth over every pair of ranks
/// on different hosts), for the tuner's model.
fn measured_between_hosts(t: &braid_topo::Topology) -> Option<crate::tune::LinkParams> {
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
        if world > MAX_WORLD {
            return Err(Error::invalid(format!(
                "nranks {world} exceeds the maximum {MAX_WORLD}"
            )));
        }
        if world == 0 || rank >= world {
            return Err(Error::invalid(format!(
                "rank {rank} is out of range for world size {world}"
            )));
        }
        config.check()?;
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
        braid_transport::check_world(&config, &geometry)?;
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
        let abort = Arc::new(AtomicBool::new(false));
        let maps = transport.abort_handle();
        let routes: Vec<&'static str> = transport.route_names().to_vec();
        let transport = (world > 1).then_some(transport);
        let topology = choose_topology(&config, &table, transport.as_ref(), rank, deadline)?;
        // Rank 0 writes the topology; if it cannot, init fails on every rank, not on rank 0 alone.
        let dumped = match (rank, &config.topo_dump_file) {
            (0, Some(path)) => topology.save(path).map_err(|e| {
                Error::invalid(format!("BRAID_TOPO_DUMP_FILE={}: {e}", path.display()))
            }),
            _ => Ok(()),
        };
        links.barrier_or_refuse(2, deadline, dumped)?;
        drop(links);
        debug!(rank, world, "communicator ready");
        let hosts = topology.host_groups();
        let link = transport.map(Router::into_link);
        let mut executor = Dispatcher::new(rank, world, config.clone(), tuner, link, abort.clone());
        executor.set_hosts(hosts.clone());
        // The tuner models the link between hosts by the transport that carries it.
        let other_host = |p: usize| !hosts.iter().any(|h| h.contains(&rank) && h.contains(&p));
        if (0..world).any(|p| other_host(p) && routes[p] == "rdma") {
            executor.tuner.set_network(crate::tune::Network::Rdma);
        }
        if let Some(link) = measured_between_hosts(&topology) {
            debug!(rank, ?link, "link between hosts, as probed");
            executor.tuner.set_measured_link(link);
        }
        let recorder = executor.recorder.clone();
        let timeline = executor.timeline.clone();
        let limit = config.timeout * 2 + Duration::from_secs(10);
        let streams = Arc::new(Streams::new(
            rank,
            executor,
            config.streams,
            maps,
            abort.clone(),
            limit,
        ));
        let host_ids = table.iter().map(|p| p.host.clone()).collect();
        let inner = Inner {
            rank,
            world,
            secret: *id.secret(),
            host_ids,
            routes,
            hosts,
            topology,
            streams,
            recorder,
            timeline,
            config,
            abort,
            registered: Default::default(),
        };
        Ok(Communicator {
            inner: Arc::new(inner),
        })
    }

    /// Joins the job described by the environment (`BRAID_RANK`/`BRAID_WORLD_SIZE`/`BRAID_ROOT`/
    /// `BRAID_SECRET`, or torchrun's, Open MPI's, PMI's or Slurm's variables), configured by `BRAID_*`.
    pub fn from_env() -> Result<Communicator, Error> {
        let config = Config::from_env()?;
        // Detecting the job can warn (a derived secret): the logger must exist first.
        init_logging(&config);
        let job = JobEnv::detect()?;
        Communicator::init(job.world, job.rank, &job.id, config)
    }
}
