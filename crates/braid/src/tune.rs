//! Choosing an algorithm per collective and size: `BRAID_ALGO` overrides, a measured tuning file
//! (`braid tune`, `BRAID_TUNE_FILE`), and the alpha-beta cost model of `braid-sched` where neither
//! decides.

use braid_core::Error;
use braid_sched::cost::{all_reduce_cost, flat_ring_cost, hier_cost, HostLinks, LinkCost};
pub use braid_sched::{Algo, Collective};
use serde::{Deserialize, Serialize};

/// Which algorithms `BRAID_ALGO` allows, per collective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlgoPolicy {
    /// By [`Collective::index`].
    allowed: [Vec<Algo>; Collective::ALL.len()],
}

impl Default for AlgoPolicy {
    fn default() -> Self {
        AlgoPolicy {
            allowed: Collective::ALL.map(|c| c.algos().to_vec()),
        }
    }
}

impl AlgoPolicy {
    /// Parses `BRAID_ALGO`: `;`-separated items, each `collective:spec` or just `spec` (every
    /// collective with a choice); a spec is a comma-separated list of algorithms, or `^` and a list to
    /// exclude. Collectives are named as [`Collective::name`] or the older way ([`Collective`]'s
    /// `FromStr`). Examples: `ring`, `all_reduce:tree;all_gather:ring`, `allreduce:^direct,rhd`.
    pub fn parse(text: &str) -> Result<AlgoPolicy, Error> {
        let mut p = AlgoPolicy::default();
        for item in text.split(';').map(str::trim).filter(|s| !s.is_empty()) {
            let (colls, spec) = match item.split_once(':') {
                Some((c, spec)) => (vec![c.parse::<Collective>()?], spec),
                None => (Collective::TUNABLE.to_vec(), item),
            };
            let (exclude, list) = match spec.trim().strip_prefix('^') {
                Some(rest) => (true, rest),
                None => (false, spec),
            };
            let named: Vec<Algo> = list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::parse)
                .collect::<Result<_, _>>()?;
            if named.is_empty() {
                return Err(Error::invalid(format!(
                    "BRAID_ALGO item {item:?} names no algorithm"
                )));
            }
            let single = colls.len() == 1;
            for c in colls {
                let allowed: Vec<Algo> = c
                    .algos()
                    .iter()
                    .copied()
                    .filter(|a| named.contains(a) != exclude)
                    .collect();
                if allowed.is_empty() {
                    if single {
                        return Err(Error::invalid(format!(
                            "BRAID_ALGO item {item:?} leaves {} no algorithm (it has {})",
                            c.name(),
                            c.algos()
                                .iter()
                                .map(|a| a.name())
                                .collect::<Vec<_>>()
                                .join(", ")
                        )));
                    }
                    // A global item that does not apply to this collective leaves it alone.
                    continue;
                }
                p.allowed[c.index()] = allowed;
            }
        }
        Ok(p)
    }

    /// The algorithms allowed for `c`.
    pub fn allowed(&self, c: Collective) -> &[Algo] {
        &self.allowed[c.index()]
    }
}

/// Measured link parameters (microseconds and microseconds per byte).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkParams {
    /// Latency of one message.
    pub alpha_us: f64,
    /// Time per byte moved between ranks.
    pub beta_us_per_byte: f64,
    /// Time per byte reduced.
    pub gamma_us_per_byte: f64,
}

impl LinkParams {
    /// Built-in defaults for shared memory on a small machine (about 0.3 µs per message, 5 GB/s moved,
    /// 8 GB/s reduced).
    pub const SHM_DEFAULT: LinkParams = LinkParams {
        alpha_us: 0.3,
        beta_us_per_byte: 1.0 / 5000.0,
        gamma_us_per_byte: 1.0 / 8000.0,
    };

    /// Built-in defaults for TCP between hosts (about 30 µs per message, 1 GB/s), until a tuning file
    /// says otherwise.
    pub const TCP_DEFAULT: LinkParams = LinkParams {
        alpha_us: 30.0,
        beta_us_per_byte: 1.0 / 1000.0,
        gamma_us_per_byte: 1.0 / 8000.0,
    };

    /// Built-in defaults for RDMA between hosts (about 3 µs per message, 10 GB/s: a 100 Gb/s
    /// InfiniBand or RoCE port), until a tuning file or probing says otherwise.
    pub const RDMA_DEFAULT: LinkParams = LinkParams {
        alpha_us: 3.0,
        beta_us_per_byte: 1.0 / 10000.0,
        gamma_us_per_byte: 1.0 / 8000.0,
    };

    fn cost(&self) -> LinkCost {
        LinkCost {
            alpha_us: self.alpha_us,
            beta_us_per_byte: self.beta_us_per_byte,
            gamma_us_per_byte: self.gamma_us_per_byte,
        }
    }
}

/// One measured choice: up to `max_bytes`, use `algo`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableEntry {
    /// Largest message size (bytes) this entry covers.
    pub max_bytes: usize,
    /// The algorithm that was fastest there.
    pub algo: String,
}

/// Measured choices for one collective at one world size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Table {
    /// Collective name: [`Collective::name`] (`all_reduce`, ...); files written before it read the
    /// older spelling (`allreduce`), which loading rewrites.
    pub collective: String,
    /// World size measured.
    pub world: usize,
    /// Entries sorted by `max_bytes`.
    pub entries: Vec<TableEntry>,
}

/// The file `braid tune` writes and `BRAID_TUNE_FILE` names.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TuningFile {
    /// Format version (1).
    pub version: u32,
    /// Shared-memory link parameters.
    pub shm: LinkParams,
    /// TCP link parameters between hosts, where measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<LinkParams>,
    /// RDMA link parameters between hosts, where measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<LinkParams>,
    /// Measured tables.
    pub tables: Vec<Table>,
}

impl TuningFile {
    /// Reads and validates a tuning file.
    pub fn load(path: &std::path::Path) -> Result<TuningFile, Error> {
        let text = braid_topo::read_config_file(path)
            .map_err(|e| Error::invalid(format!("BRAID_TUNE_FILE {}: {e}", path.display())))?;
        let mut f: TuningFile = serde_json::from_str(&text)
            .map_err(|e| Error::invalid(format!("BRAID_TUNE_FILE {}: {e}", path.display())))?;
        if f.version != 1 {
            return Err(Error::invalid(format!(
                "BRAID_TUNE_FILE {}: version {} (expected 1)",
                path.display(),
                f.version
            )));
        }
        for t in &mut f.tables {
            let c: Collective = t.collective.parse()?;
            // Written back (`braid tune`), the file names collectives the canonical way.
            t.collective = c.name().to_string();
            for e in &t.entries {
                let a: Algo = e.algo.parse()?;
                if !c.algos().contains(&a) {
                    return Err(Error::invalid(format!(
                        "BRAID_TUNE_FILE: {} has no algorithm {a}",
                        c.name()
                    )));
                }
            }
            if t.entries
                .windows(2)
                .any(|w| w[0].max_bytes >= w[1].max_bytes)
            {
                return Err(Error::invalid(format!(
                    "BRAID_TUNE_FILE {}: entries of {} at world {} are not sorted by max_bytes",
                    path.display(),
                    t.collective,
                    t.world
                )));
            }
        }
        Ok(f)
    }

    /// Adds or replaces the table for (collective, world), whichever spelling of the collective either
    /// table uses.
    pub fn put(&mut self, mut table: Table) {
        if let Ok(c) = table.collective.parse::<Collective>() {
            table.collective = c.name().to_string();
        }
        let same = |t: &Table| match (
            t.collective.parse::<Collective>(),
            table.collective.parse::<Collective>(),
        ) {
            (Ok(a), Ok(b)) => a == b,
            _ => t.collective == table.collective,
        };
        self.tables.retain(|t| !(same(t) && t.world == table.world));
        self.tables.push(table);
        self.tables.sort_by(|a, b| {
            (a.collective.as_str(), a.world).cmp(&(b.collective.as_str(), b.world))
        });
    }
}

/// Picks algorithms for one communicator.
#[derive(Clone, Debug)]
pub struct Tuner {
    world: usize,
    policy: AlgoPolicy,
    file: Option<TuningFile>,
    chunk_bytes: usize,
    direct_max_bytes: usize,
    /// By [`Collective::index`].
    forced: [Option<Algo>; Collective::ALL.len()],
    /// Decisions already taken, by (collective, bytes): the model is not free, a hash lookup nearly is.
    cache: std::collections::HashMap<(Collective, usize), Algo>,
    /// The last decision, checked before the map: loops repeat one size.
    last: Option<(Collective, usize, Algo)>,
    /// Ranks per host, when there is more than one host.
    hosts: Vec<usize>,
    /// The link between hosts as measured at start-up (`BRAID_TOPO_PROBE`).
    measured_between: Option<LinkParams>,
    /// The transport between hosts.
    network: Network,
}

/// The kind of link between hosts, which picks the tuning file's entry and the built-in default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Network {
    /// TCP sockets.
    Tcp,
    /// RDMA verbs.
    Rdma,
}

impl Tuner {
    /// A tuner for `world` ranks.
    pub fn new(
        world: usize,
        policy: AlgoPolicy,
        file: Option<TuningFile>,
        chunk_bytes: usize,
        direct_max_bytes: usize,
    ) -> Tuner {
        Tuner {
            world,
            policy,
            file,
            chunk_bytes,
            direct_max_bytes,
            forced: [None; Collective::ALL.len()],
            cache: Default::default(),
            last: None,
            hosts: Vec::new(),
            measured_between: None,
            network: Network::Tcp,
        }
    }

    /// Uses `link` for the link between hosts: measured in this run, it outranks a tuning file's and the
    /// built-in defaults.
    pub fn set_measured_link(&mut self, link: LinkParams) {
        self.measured_between = Some(link);
        self.cache.clear();
        self.last = None;
    }

    /// Says which transport carries the bytes between hosts.
    pub fn set_network(&mut self, network: Network) {
        self.network = network;
        self.cache.clear();
        self.last = None;
    }

    /// Tells the tuner how many ranks each host has; with more than one host, all-reduce is chosen by
    /// the two-class model (shared memory inside hosts, TCP between them).
    pub fn set_hosts(&mut self, ranks_per_host: Vec<usize>) {
        self.hosts = if ranks_per_host.len() > 1 {
            ranks_per_host
        } else {
            Vec::new()
        };
        self.cache.clear();
        self.last = None;
    }

    /// The link between hosts the model uses: measured at start-up, else the tuning file's for the
    /// transport in use (`tcp` or `rdma`), else the built-in default for it.
    pub fn between_hosts_link(&self) -> LinkParams {
        let filed = self.file.as_ref().and_then(|f| match self.network {
            Network::Tcp => f.tcp,
            Network::Rdma => f.rdma,
        });
        let default = match self.network {
            Network::Tcp => LinkParams::TCP_DEFAULT,
            Network::Rdma => LinkParams::RDMA_DEFAULT,
        };
        self.measured_between.or(filed).unwrap_or(default)
    }

    /// The modelled time of all-reduce `algo` over several hosts.
    fn multi_host_cost(&self, algo: Algo, bytes: usize) -> f64 {
        let (i, x) = (self.link(), self.between_hosts_link());
        let links = HostLinks {
            intra_alpha_us: i.alpha_us,
            intra_beta_us_per_byte: i.beta_us_per_byte,
            inter_alpha_us: x.alpha_us,
            inter_beta_us_per_byte: x.beta_us_per_byte,
            gamma_us_per_byte: i.gamma_us_per_byte,
        };
        match algo {
            Algo::Ring => flat_ring_cost(&self.hosts, bytes, 1.0, self.chunk_bytes, &links),
            Algo::Hier => hier_cost(&self.hosts, bytes, 1.0, self.chunk_bytes, &links),
            // The others are not host-aware: model them as if every link were the slow one.
            other => all_reduce_cost(other, self.world, bytes, 1.0, self.chunk_bytes, &x.cost()),
        }
    }

    /// Forces (or, with `None`, frees) the algorithm of one collective, above every other rule.
    pub fn force(&mut self, c: Collective, algo: Option<Algo>) -> Result<(), Error> {
        if let Some(a) = algo {
            if !c.algos().contains(&a) {
                return Err(Error::invalid(format!("{} has no algorithm {a}", c.name())));
            }
        }
        self.forced[c.index()] = algo;
        self.cache.clear();
        self.last = None;
        Ok(())
    }

    fn link(&self) -> LinkParams {
        self.file
            .as_ref()
            .map_or(LinkParams::SHM_DEFAULT, |f| f.shm)
    }

    /// Where the choice came from, for logs and `braid perf`: `forced`, `table`, `model` or `rule` (a
    /// size rule, or the only algorithm of a barrier or all-to-all).
    pub fn pick_with_reason(&self, c: Collective, bytes: usize) -> (Algo, &'static str) {
        if let [only] = c.algos() {
            return (*only, "rule");
        }
        if let Some(a) = self.forced[c.index()] {
            return (a, "forced");
        }
        let allowed = self.policy.allowed(c);
        if allowed.len() == 1 {
            return (allowed[0], "forced");
        }
        if let Some(t) = self.file.as_ref().and_then(|f| {
            f.tables.iter().find(|t| {
                t.world == self.world && t.collective.parse::<Collective>().ok() == Some(c)
            })
        }) {
            let entry = t
                .entries
                .iter()
                .find(|e| bytes <= e.max_bytes)
                .or(t.entries.last());
            if let Some(a) = entry.and_then(|e| e.algo.parse::<Algo>().ok()) {
                if allowed.contains(&a) {
                    return (a, "table");
                }
            }
        }
        match c {
            Collective::AllReduce => {
                let link = self.link().cost();
                let best = allowed
                    .iter()
                    .copied()
                    .map(|a| {
                        let t = if !self.hosts.is_empty() {
                            self.multi_host_cost(a, bytes)
                        } else if a == Algo::Hier {
                            // One host: hier is the ring; let the ring stand for it.
                            f64::INFINITY
                        } else {
                            all_reduce_cost(a, self.world, bytes, 1.0, self.chunk_bytes, &link)
                        };
                        (a, t)
                    })
                    .min_by(|x, y| x.1.total_cmp(&y.1))
                    .map(|(a, _)| a)
                    .unwrap_or(Algo::Ring);
                (best, "model")
            }
            _ => {
                let prefer = if bytes <= self.direct_max_bytes {
                    [Algo::Direct, Algo::Tree]
                } else {
                    [Algo::Ring, Algo::Ring]
                };
                let a = prefer
                    .into_iter()
                    .find(|a| allowed.contains(a))
                    .unwrap_or(allowed[0]);
                (a, "rule")
            }
        }
    }

    /// The algorithm for `c` at `bytes`.
    pub fn pick(&self, c: Collective, bytes: usize) -> Algo {
        self.pick_with_reason(c, bytes).0
    }

    /// [`Tuner::pick`], remembering the answer (for the executor's hot path).
    pub fn pick_cached(&mut self, c: Collective, bytes: usize) -> Algo {
        if let Some((lc, lb, a)) = self.last {
            if lc == c && lb == bytes {
                return a;
            }
        }
        let a = match self.cache.get(&(c, bytes)) {
            Some(a) => *a,
            None => {
                let a = self.pick(c, bytes);
                if self.cache.len() >= 4096 {
                    self.cache.clear();
                }
                self.cache.insert((c, bytes), a);
                a
            }
        };
        self.last = Some((c, bytes, a));
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tuning_file_that_is_a_device_is_refused_by_name() {
        let e = TuningFile::load(std::path::Path::new("/dev/zero")).unwrap_err();
        assert!(e.is_invalid_argument(), "{e}");
        let text = e.to_string();
        assert!(
            text.contains("BRAID_TUNE_FILE /dev/zero") && text.contains("not a regular file"),
            "{text}"
        );
    }

    #[test]
    fn hier_is_chosen_across_hosts_for_large_messages_only() {
        let mut t = Tuner::new(4, AlgoPolicy::default(), None, 128 << 10, 16 << 10);
        for bytes in [8, 1 << 20, 64 << 20] {
            assert_ne!(
                t.pick(Collective::AllReduce, bytes),
                Algo::Hier,
                "one host, {bytes} B"
            );
        }
        t.set_hosts(vec![2, 2]);
        assert_eq!(t.pick(Collective::AllReduce, 64 << 20), Algo::Hier);
        assert_ne!(t.pick(Collective::AllReduce, 8), Algo::Hier);
        let (a, why) = t.pick_with_reason(Collective::AllReduce, 64 << 20);
        assert_eq!((a, why), (Algo::Hier, "model"));
    }

    #[test]
    fn the_link_between_hosts_is_measured_then_filed_then_default() {
        let filed = LinkParams {
            alpha_us: 7.0,
            ..LinkParams::TCP_DEFAULT
        };
        let filed_rdma = LinkParams {
            alpha_us: 1.5,
            ..LinkParams::RDMA_DEFAULT
        };
        let file = TuningFile {
            version: 1,
            shm: LinkParams::SHM_DEFAULT,
            tcp: Some(filed),
            rdma: Some(filed_rdma),
            tables: vec![],
        };
        let mut t = Tuner::new(4, AlgoPolicy::default(), None, 128 << 10, 16 << 10);
        assert_eq!(t.between_hosts_link(), LinkParams::TCP_DEFAULT);
        let mut t2 = Tuner::new(4, AlgoPolicy::default(), Some(file), 128 << 10, 16 << 10);
        assert_eq!(t2.between_hosts_link(), filed);
        // Over RDMA the file's rdma entry counts, or the RDMA default.
        t.set_network(Network::Rdma);
        t2.set_network(Network::Rdma);
        assert_eq!(t.between_hosts_link(), LinkParams::RDMA_DEFAULT);
        assert_eq!(t2.between_hosts_link(), filed_rdma);
        let measured = LinkParams {
            alpha_us: 11.0,
            ..LinkParams::TCP_DEFAULT
        };
        t.set_measured_link(measured);
        t2.set_measured_link(measured);
        assert_eq!(
            (t.between_hosts_link(), t2.between_hosts_link()),
            (measured, measured)
        );
        // A slow, high-latency network moves the crossover: small all-reduces stay off hier.
        t.set_hosts(vec![2, 2]);
        t.set_measured_link(LinkParams {
            alpha_us: 5000.0,
            ..LinkParams::TCP_DEFAULT
        });
        assert_ne!(t.pick(Collective::AllReduce, 4096), Algo::Hier);
    }

    #[test]
    fn the_network_class_moves_the_choice_between_hosts() {
        // The same job over TCP and over RDMA: the modelled costs differ, and with them the pick for
        // some size (the faster network is never modelled slower).
        let mut tcp = Tuner::new(8, AlgoPolicy::default(), None, 128 << 10, 16 << 10);
        tcp.set_hosts(vec![4, 4]);
        let mut rdma = tcp.clone();
        rdma.set_network(Network::Rdma);
        for bytes in [64 << 10, 1 << 20, 64 << 20] {
            for algo in [Algo::Ring, Algo::Hier] {
                assert!(
                    rdma.multi_host_cost(algo, bytes) < tcp.multi_host_cost(algo, bytes),
                    "{algo} at {bytes} B"
                );
            }
        }
    }

    #[test]
    fn policy_parses_includes_excludes_and_scopes() {
        // Canonical names and the older spellings alike.
        for text in [
            "all_reduce:tree;all_gather:ring",
            "allreduce:tree;allgather:ring",
            "All-Reduce:tree; ALLGATHER:ring",
        ] {
            let p = AlgoPolicy::parse(text).unwrap();
            assert_eq!(p.allowed(Collective::AllReduce), &[Algo::Tree], "{text}");
            assert_eq!(p.allowed(Collective::AllGather), &[Algo::Ring], "{text}");
            assert_eq!(p.allowed(Collective::Broadcast), &[Algo::Ring, Algo::Tree]);
        }
        let p = AlgoPolicy::parse("^direct").unwrap();
        assert_eq!(
            p.allowed(Collective::AllReduce),
            &[Algo::Ring, Algo::Tree, Algo::Rhd, Algo::Hier]
        );
        assert_eq!(p.allowed(Collective::AllGather), &[Algo::Ring]);
        let p = AlgoPolicy::parse("ring").unwrap();
        assert!(Collective::TUNABLE
            .iter()
            .all(|c| p.allowed(*c) == [Algo::Ring]));
        // Barrier and all-to-all have one algorithm, which a global item leaves alone.
        assert_eq!(p.allowed(Collective::Barrier), &[Algo::Direct]);
        assert_eq!(
            AlgoPolicy::parse("all_to_all:direct")
                .unwrap()
                .allowed(Collective::AllToAll),
            &[Algo::Direct]
        );
        // A global "tree" applies where a tree exists and leaves the rest alone.
        let p = AlgoPolicy::parse("tree").unwrap();
        assert_eq!(
            p.allowed(Collective::AllGather),
            &[Algo::Ring, Algo::Direct]
        );
        assert_eq!(p.allowed(Collective::Reduce), &[Algo::Tree]);
        for bad in [
            "butterfly",
            "allreduce:",
            "allgather:tree",
            "barrier:ring",
            "everything:ring",
            "allreduce:^ring,tree,rhd,direct,hier",
        ] {
            let e = AlgoPolicy::parse(bad).unwrap_err();
            assert!(e.is_invalid_argument(), "{bad}: {e}");
        }
    }

    #[test]
    fn tables_then_model_decide_and_forcing_wins() {
        let file = TuningFile {
            version: 1,
            shm: LinkParams::SHM_DEFAULT,
            tcp: None,
            rdma: None,
            tables: vec![Table {
                collective: "allreduce".into(),
                world: 4,
                entries: vec![
                    TableEntry {
                        max_bytes: 4096,
                        algo: "direct".into(),
                    },
                    TableEntry {
                        max_bytes: 1 << 20,
                        algo: "tree".into(),
                    },
                    TableEntry {
                        max_bytes: 64 << 20,
                        algo: "ring".into(),
                    },
                ],
            }],
        };
        let mut t = Tuner::new(4, AlgoPolicy::default(), Some(file.clone()), 1 << 17, 16384);
        assert_eq!(
            t.pick_with_reason(Collective::AllReduce, 8),
            (Algo::Direct, "table")
        );
        assert_eq!(t.pick(Collective::AllReduce, 5000), Algo::Tree);
        assert_eq!(t.pick(Collective::AllReduce, 1 << 30), Algo::Ring);
        t.force(Collective::AllReduce, Some(Algo::Rhd)).unwrap();
        assert_eq!(
            t.pick_with_reason(Collective::AllReduce, 8),
            (Algo::Rhd, "forced")
        );
        assert!(t.force(Collective::AllGather, Some(Algo::Tree)).is_err());
        assert!(t.force(Collective::Barrier, Some(Algo::Ring)).is_err());
        assert_eq!(
            t.pick_with_reason(Collective::AllToAll, 1 << 20),
            (Algo::Direct, "rule")
        );
        // Another world size: the table does not apply, the model does.
        let t = Tuner::new(8, AlgoPolicy::default(), Some(file), 1 << 17, 16384);
        assert_eq!(
            t.pick_with_reason(Collective::AllReduce, 1 << 26).1,
            "model"
        );
        // The policy filters table entries.
        let t = Tuner::new(
            4,
            AlgoPolicy::parse("allreduce:^direct").unwrap(),
            None,
            1 << 17,
            16384,
        );
        assert_ne!(t.pick(Collective::AllReduce, 8), Algo::Direct);
    }

    #[test]
    fn tuning_files_are_validated() {
        let dir = std::env::temp_dir();
        let p = dir.join(format!("braid-tune-test-{}.json", std::process::id()));
        std::fs::write(&p, r#"{"version":1,"shm":{"alpha_us":0.3,"beta_us_per_byte":0.0002,"gamma_us_per_byte":0.0001},"tables":[{"collective":"allgather","world":2,"entries":[{"max_bytes":8,"algo":"tree"}]}]}"#).unwrap();
        assert!(TuningFile::load(&p)
            .unwrap_err()
            .to_string()
            .contains("no algorithm tree"));
        std::fs::write(&p, "not json").unwrap();
        assert!(TuningFile::load(&p)
            .unwrap_err()
            .to_string()
            .contains("BRAID_TUNE_FILE"));
        std::fs::remove_file(&p).unwrap();
        assert!(TuningFile::load(&p).is_err());
    }

    #[test]
    fn older_tuning_files_read_and_are_rewritten_with_canonical_names() {
        let p = std::env::temp_dir().join(format!("braid-tune-old-{}.json", std::process::id()));
        std::fs::write(&p, r#"{"version":1,"shm":{"alpha_us":0.3,"beta_us_per_byte":0.0002,"gamma_us_per_byte":0.0001},"tables":[{"collective":"allreduce","world":2,"entries":[{"max_bytes":18446744073709551615,"algo":"rhd"}]}]}"#).unwrap();
        let mut f = TuningFile::load(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        assert_eq!(f.tables[0].collective, "all_reduce");
        let t = Tuner::new(2, AlgoPolicy::default(), Some(f.clone()), 1 << 17, 16384);
        assert_eq!(
            t.pick_with_reason(Collective::AllReduce, 1 << 20),
            (Algo::Rhd, "table")
        );
        // A new table replaces the old one, whichever spelling either uses.
        f.tables[0].collective = "allreduce".into();
        f.put(Table {
            collective: "all-reduce".into(),
            world: 2,
            entries: vec![TableEntry {
                max_bytes: usize::MAX,
                algo: "tree".into(),
            }],
        });
        assert_eq!(f.tables.len(), 1);
        assert_eq!(
            (
                f.tables[0].collective.as_str(),
                f.tables[0].entries[0].algo.as_str()
            ),
            ("all_reduce", "tree")
        );
    }
}
