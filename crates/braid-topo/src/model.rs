//! The model: where each rank runs and what connects the ranks.
//!
//! Ranks point at hosts by index, GPUs by index into their host's list, and links join two ranks, so a
//! topology is plain data that any part of the runtime can query without lookups by name. Queries
//! assume a topology that passes [`Topology::validate`]; on one that does not they skip what does not
//! resolve instead of panicking.

use std::collections::{BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Where a topology came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// Written by hand or by a tool into a topology file.
    File,
    /// Read from sysfs or from the host identities ranks report at bootstrap.
    Detected,
    /// Inferred from latency and bandwidth measured between ranks.
    Probed,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Source::File => "file",
            Source::Detected => "detected",
            Source::Probed => "probed",
        })
    }
}

/// One NUMA node of a host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaNode {
    /// The kernel's node number.
    pub id: u32,
    /// The CPUs of the node, ascending; empty when unknown. Written as a list string (`"0-15,32-47"`).
    #[serde(with = "crate::cpulist::serde_cpus")]
    pub cpus: Vec<u32>,
}

/// One GPU of a host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// PCI address, `domain:bus:device.function` (`0000:17:00.0`).
    #[serde(rename = "pci")]
    pub pci_bus_id: String,
    /// NUMA node the GPU is attached to, when known.
    #[serde(rename = "numa", default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// Model name, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// One network interface of a host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Nic {
    /// Interface name (`eth0`, `ib0`).
    pub name: String,
    /// Link speed in Mbit/s, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speed_mbps: Option<u64>,
    /// NUMA node the NIC is attached to, when known.
    #[serde(rename = "numa", default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// Whether the link is up, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub up: Option<bool>,
    /// Hardware address, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// Network addresses (IP), when known.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
}

/// One port of an RDMA device (InfiniBand, RoCE, Soft-RoCE).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RdmaPort {
    /// Device name (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Port number (from 1).
    pub port: u32,
    /// Whether the port is active, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active: Option<bool>,
    /// Link layer: `InfiniBand` or `Ethernet` (RoCE), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_layer: Option<String>,
    /// Rate as the driver states it (`100 Gb/sec (4X EDR)`), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<String>,
    /// The network device under a RoCE port, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netdev: Option<String>,
    /// NUMA node the device is attached to, when known.
    #[serde(rename = "numa", default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// Index of the first RoCE v2 GID, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub roce_v2_gid_index: Option<u32>,
}

/// One host (machine, or anything the ranks on it can share memory through).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Host {
    /// The host's name, unique within a topology.
    pub name: String,
    /// NUMA nodes, by id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub numa: Vec<NumaNode>,
    /// GPUs; ranks refer to them by index.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<Gpu>,
    /// Network interfaces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nics: Vec<Nic>,
    /// RDMA device ports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rdma: Vec<RdmaPort>,
}

impl Host {
    /// A host with a name and nothing else known.
    pub fn named(name: impl Into<String>) -> Self {
        Host {
            name: name.into(),
            numa: Vec::new(),
            gpus: Vec::new(),
            nics: Vec::new(),
            rdma: Vec::new(),
        }
    }
}

/// Where one rank runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlace {
    /// The rank; equal to its index in [`Topology::ranks`].
    pub rank: usize,
    /// Index into [`Topology::hosts`].
    pub host: usize,
    /// NUMA node id the rank is bound to, when known; one of the host's nodes when the host lists any.
    pub numa: Option<u32>,
    /// Index into the host's [`Host::gpus`], when the rank drives a GPU.
    pub gpu: Option<usize>,
}

/// What carries the bytes between two ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkClass {
    /// Shared memory; both ranks on one host.
    Shm,
    /// TCP over any network.
    Tcp,
    /// RDMA (InfiniBand, RoCE).
    Rdma,
    /// NVLink between GPUs.
    Nvlink,
    /// PCIe between GPUs of one host.
    Pcie,
}

impl LinkClass {
    /// Whether the class only exists between ranks of one host.
    pub fn is_intra_host(self) -> bool {
        matches!(self, LinkClass::Shm | LinkClass::Pcie)
    }
}

impl std::fmt::Display for LinkClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LinkClass::Shm => "shm",
            LinkClass::Tcp => "tcp",
            LinkClass::Rdma => "rdma",
            LinkClass::Nvlink => "nvlink",
            LinkClass::Pcie => "pcie",
        })
    }
}

/// A link between two ranks (both directions), with what is known of its speed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// The two ranks.
    pub ranks: [usize; 2],
    /// What carries the bytes.
    pub class: LinkClass,
    /// Bandwidth in bytes per second, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth: Option<f64>,
    /// One-way latency in seconds, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<f64>,
}

/// Hosts, where every rank runs, and the links between ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    /// The hosts; every one runs at least one rank.
    pub hosts: Vec<Host>,
    /// One entry per rank, in rank order.
    pub ranks: Vec<RankPlace>,
    /// Links whose class or speed is known; a pair without one is unknown (see
    /// [`Topology::default_class`]).
    pub links: Vec<Link>,
    /// Where this description came from.
    pub source: Source,
}

impl Topology {
    /// One host running `world_size` ranks (ranks unbound to NUMA nodes or GPUs).
    pub fn single_host(host: Host, world_size: usize, source: Source) -> Result<Self> {
        let ranks = (0..world_size)
            .map(|rank| RankPlace {
                rank,
                host: 0,
                numa: None,
                gpu: None,
            })
            .collect();
        let t = Topology {
            hosts: vec![host],
            ranks,
            links: Vec::new(),
            source,
        };
        t.validate()?;
        Ok(t)
    }

    /// Groups ranks by the identity each reported at bootstrap (`identities[rank]`): ranks with equal
    /// identities share a host. Hosts are named by their identity and numbered by first appearance.
    pub fn from_identities<S: AsRef<str>>(identities: &[S]) -> Result<Self> {
        if identities.is_empty() {
            return Err(Error::invalid(
                "identities",
                "no ranks reported an identity",
            ));
        }
        let mut index: HashMap<&str, usize> = HashMap::new();
        let mut hosts = Vec::new();
        let mut ranks = Vec::with_capacity(identities.len());
        for (rank, id) in identities.iter().enumerate() {
            let id = id.as_ref();
            if id.trim().is_empty() {
                return Err(Error::invalid(
                    format!("identities[{rank}]"),
                    "rank reported an empty identity",
                ));
            }
            let host = *index.entry(id).or_insert_with(|| {
                hosts.push(Host::named(id));
                hosts.len() - 1
            });
            ranks.push(RankPlace {
                rank,
                host,
                numa: None,
                gpu: None,
            });
        }
        Ok(Topology {
            hosts,
            ranks,
            links: Vec::new(),
            source: Source::Detected,
        })
    }

    /// A topology from explicit groups of ranks (one group per host, hosts named `host0`, `host1`, ...).
    /// The groups must partition `0..n`.
    pub fn from_groups(groups: &[Vec<usize>], source: Source) -> Result<Self> {
        let n: usize = groups.iter().map(Vec::len).sum();
        let mut host_of: Vec<Option<usize>> = vec![None; n];
        for (h, group) in groups.iter().enumerate() {
            if group.is_empty() {
                return Err(Error::invalid(format!("groups[{h}]"), "group has no ranks"));
            }
            for &r in group {
                match host_of.get_mut(r) {
                    None => {
                        return Err(Error::RankOutOfRange {
                            rank: r,
                            world_size: n,
                        })
                    }
                    Some(Some(prev)) => {
                        return Err(Error::invalid(
                            format!("groups[{h}]"),
                            format!("rank {r} is already in groups[{prev}]"),
                        ))
                    }
                    Some(slot) => *slot = Some(h),
                }
            }
        }
        let ranks = host_of
            .into_iter()
            .enumerate()
            .map(|(rank, h)| RankPlace {
                rank,
                host: h.unwrap_or(0),
                numa: None,
                gpu: None,
            })
            .collect();
        let hosts = (0..groups.len())
            .map(|h| Host::named(format!("host{h}")))
            .collect();
        let t = Topology {
            hosts,
            ranks,
            links: Vec::new(),
            source,
        };
        t.validate()?;
        Ok(t)
    }

    /// Checks every invariant the queries rely on; the error names the first field found wrong.
    pub fn validate(&self) -> Result<()> {
        if self.ranks.is_empty() {
            return Err(Error::invalid("ranks", "the topology places no ranks"));
        }
        let mut names: HashMap<&str, usize> = HashMap::new();
        for (h, host) in self.hosts.iter().enumerate() {
            if host.name.trim().is_empty() {
                return Err(Error::invalid(
                    format!("hosts[{h}].name"),
                    "host name is empty",
                ));
            }
            if let Some(&first) = names.get(host.name.as_str()) {
                return Err(Error::DuplicateHost {
                    name: host.name.clone(),
                    first,
                    second: h,
                });
            }
            names.insert(&host.name, h);
            validate_host(h, host)?;
        }
        let world_size = self.ranks.len();
        let mut seen: Vec<Option<usize>> = vec![None; world_size];
        for (i, place) in self.ranks.iter().enumerate() {
            match seen.get_mut(place.rank) {
                None => {
                    return Err(Error::RankOutOfRange {
                        rank: place.rank,
                        world_size,
                    })
                }
                Some(Some(first)) => {
                    return Err(Error::DuplicateRank {
                        rank: place.rank,
                        first: *first,
                        second: i,
                    })
                }
                Some(slot) => *slot = Some(i),
            }
        }
        // No duplicates and every rank below the count: the ranks are a permutation of 0..n.
        if let Some(i) = (0..world_size).find(|&i| self.ranks[i].rank != i) {
            return Err(Error::invalid(
                format!("ranks[{i}]"),
                format!(
                    "holds rank {}; ranks must be in rank order",
                    self.ranks[i].rank
                ),
            ));
        }
        let mut used = vec![false; self.hosts.len()];
        for place in &self.ranks {
            let r = place.rank;
            let Some(host) = self.hosts.get(place.host) else {
                return Err(Error::UnknownHost {
                    rank: r,
                    host: place.host.to_string(),
                    hosts: self.hosts.len(),
                });
            };
            used[place.host] = true;
            if let Some(numa) = place.numa {
                if !host.numa.is_empty() && !host.numa.iter().any(|n| n.id == numa) {
                    return Err(Error::invalid(
                        format!("ranks[{r}].numa"),
                        format!(
                            "rank {r} is bound to NUMA node {numa}, which host {:?} does not list",
                            host.name
                        ),
                    ));
                }
            }
            if let Some(gpu) = place.gpu {
                if gpu >= host.gpus.len() {
                    return Err(Error::invalid(
                        format!("ranks[{r}].gpu"),
                        format!(
                            "rank {r} uses GPU {gpu}, but host {:?} lists {} GPU(s)",
                            host.name,
                            host.gpus.len()
                        ),
                    ));
                }
            }
        }
        if let Some(h) = used.iter().position(|u| !u) {
            return Err(Error::invalid(
                format!("hosts[{h}]"),
                format!("host {:?} runs no rank", self.hosts[h].name),
            ));
        }
        let mut pairs: HashMap<(usize, usize), usize> = HashMap::new();
        for (l, link) in self.links.iter().enumerate() {
            let [a, b] = link.ranks;
            for r in [a, b] {
                if r >= world_size {
                    return Err(Error::invalid(
                        format!("links[{l}].ranks"),
                        format!("rank {r} is out of range for a world of {world_size} ranks"),
                    ));
                }
            }
            if a == b {
                return Err(Error::invalid(
                    format!("links[{l}].ranks"),
                    format!("links rank {a} to itself"),
                ));
            }
            if let Some(first) = pairs.insert((a.min(b), a.max(b)), l) {
                return Err(Error::invalid(
                    format!("links[{l}].ranks"),
                    format!("ranks {a} and {b} are already linked by links[{first}]"),
                ));
            }
            if link.class.is_intra_host() && self.ranks[a].host != self.ranks[b].host {
                return Err(Error::invalid(
                    format!("links[{l}].class"),
                    format!(
                        "{} joins ranks of one host, but ranks {a} and {b} are on different hosts",
                        link.class
                    ),
                ));
            }
            if let Some(bw) = link.bandwidth {
                if !(bw.is_finite() && bw > 0.0) {
                    return Err(Error::invalid(
                        format!("links[{l}].bandwidth"),
                        format!("{bw} is not a positive, finite number of bytes per second"),
                    ));
                }
            }
            if let Some(lat) = link.latency {
                if !(lat.is_finite() && lat >= 0.0) {
                    return Err(Error::invalid(
                        format!("links[{l}].latency"),
                        format!("{lat} is not a non-negative, finite number of seconds"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks that the topology describes exactly `world_size` ranks.
    pub fn check_world_size(&self, world_size: usize) -> Result<()> {
        let n = self.ranks.len();
        if n < world_size {
            return Err(Error::MissingRanks {
                world_size,
                missing: (n..world_size).collect(),
            });
        }
        if n > world_size {
            return Err(Error::RankOutOfRange {
                rank: world_size,
                world_size,
            });
        }
        Ok(())
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// The host index of `rank`.
    pub fn host_of(&self, rank: usize) -> Option<usize> {
        self.ranks.get(rank).map(|p| p.host)
    }

    /// The ranks of each host, in rank order; entry `h` belongs to `hosts[h]`.
    pub fn host_groups(&self) -> Vec<Vec<usize>> {
        let mut groups = vec![Vec::new(); self.hosts.len()];
        for (rank, place) in self.ranks.iter().enumerate() {
            if let Some(g) = groups.get_mut(place.host) {
                g.push(rank);
            }
        }
        groups
    }

    /// The position of `rank` among the ranks of its host (its `BRAID_LOCAL_RANK`).
    pub fn local_rank(&self, rank: usize) -> Option<usize> {
        let host = self.host_of(rank)?;
        Some(self.ranks[..rank].iter().filter(|p| p.host == host).count())
    }

    /// The number of ranks on the host of `rank` (its `BRAID_LOCAL_WORLD_SIZE`).
    pub fn local_world_size(&self, rank: usize) -> Option<usize> {
        let host = self.host_of(rank)?;
        Some(self.ranks.iter().filter(|p| p.host == host).count())
    }

    /// Whether every host runs the same number of ranks (what hierarchical algorithms need).
    pub fn is_uniform(&self) -> bool {
        let groups = self.host_groups();
        groups.windows(2).all(|w| w[0].len() == w[1].len())
    }

    /// Whether two ranks share a host.
    pub fn same_host(&self, a: usize, b: usize) -> bool {
        matches!((self.host_of(a), self.host_of(b)), (Some(x), Some(y)) if x == y)
    }

    /// The listed link between two ranks, in either direction.
    pub fn link(&self, a: usize, b: usize) -> Option<&Link> {
        self.links
            .iter()
            .find(|l| l.ranks == [a, b] || l.ranks == [b, a])
    }

    /// The link class between two ranks: the listed one, else [`LinkClass::Shm`] on one host and
    /// [`LinkClass::Tcp`] between hosts. `None` when a rank is unknown.
    pub fn default_class(&self, a: usize, b: usize) -> Option<LinkClass> {
        if let Some(l) = self.link(a, b) {
            return Some(l.class);
        }
        let (x, y) = (self.host_of(a)?, self.host_of(b)?);
        Some(if x == y {
            LinkClass::Shm
        } else {
            LinkClass::Tcp
        })
    }

    /// The number of steps of the ring `order` (closing back to its start) that join ranks of
    /// different hosts.
    pub fn crossings(&self, order: &[usize]) -> usize {
        if order.len() < 2 {
            return 0;
        }
        (0..order.len())
            .filter(|&i| !self.same_host(order[i], order[(i + 1) % order.len()]))
            .count()
    }

    /// See [`ring_order`].
    pub fn ring_order(&self) -> Vec<usize> {
        ring_order(self)
    }
}

/// A ring through all ranks that visits each host's ranks contiguously, so it crosses between hosts
/// exactly once per host (never on one host). Hosts come in the order of their lowest rank, ranks in
/// ascending order within a host; the same topology always gives the same ring.
pub fn ring_order(topology: &Topology) -> Vec<usize> {
    let groups = topology.host_groups();
    let mut order: Vec<&Vec<usize>> = groups.iter().filter(|g| !g.is_empty()).collect();
    order.sort_by_key(|g| g[0]);
    order.into_iter().flatten().copied().collect()
}

fn validate_host(h: usize, host: &Host) -> Result<()> {
    let mut ids = BTreeSet::new();
    for (i, node) in host.numa.iter().enumerate() {
        if !ids.insert(node.id) {
            return Err(Error::invalid(
                format!("hosts[{h}].numa[{i}].id"),
                format!("NUMA node {} is listed twice", node.id),
            ));
        }
    }
    let mut pci = BTreeSet::new();
    for (i, gpu) in host.gpus.iter().enumerate() {
        if gpu.pci_bus_id.trim().is_empty() {
            return Err(Error::invalid(
                format!("hosts[{h}].gpus[{i}].pci"),
                "PCI address is empty",
            ));
        }
        if !pci.insert(gpu.pci_bus_id.to_ascii_lowercase()) {
            return Err(Error::invalid(
                format!("hosts[{h}].gpus[{i}].pci"),
                format!("GPU {} is listed twice", gpu.pci_bus_id),
            ));
        }
    }
    let mut nics = BTreeSet::new();
    for (i, nic) in host.nics.iter().enumerate() {
        if nic.name.trim().is_empty() {
            return Err(Error::invalid(
                format!("hosts[{h}].nics[{i}].name"),
                "interface name is empty",
            ));
        }
        if !nics.insert(nic.name.as_str()) {
            return Err(Error::invalid(
                format!("hosts[{h}].nics[{i}].name"),
                format!("interface {} is listed twice", nic.name),
            ));
        }
    }
    Ok(())
}
