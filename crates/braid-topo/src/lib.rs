//! braid-topo: where ranks run and what connects them.
//!
//! It owns the model ([`Topology`]: [`Host`]s with their [`NumaNode`]s, [`Gpu`]s and [`Nic`]s, a
//! [`RankPlace`] per rank, [`Link`]s between ranks) and the three ways to fill it in, the [`Source`]s:
//!
//! - **detected**: [`detect_host`] reads sysfs under any root directory ([`detect_local`] reads `/`), and
//!   [`Topology::from_identities`] groups ranks by the host identity each reports at bootstrap;
//! - **file**: the JSON format below, named by `BRAID_TOPO_FILE` ([`Topology::from_env`]);
//! - **probed**: [`infer_hosts`] (or [`infer_topology`], which keeps the measurements as links) groups ranks from measured latency and/or bandwidth, where a cloud
//!   hides which ranks share a machine.
//!
//! On top of the model: [`ring_order`] (a ring that crosses between hosts once per host),
//! [`Topology::host_groups`], [`Topology::local_rank`], [`Topology::is_uniform`], and a readable
//! summary ([`Topology::describe`], also `Display`). It knows nothing of data; its only I/O is reading
//! sysfs and reading or writing topology files; it contains no `unsafe` code.
//!
//! # The topology file (`BRAID_TOPO_FILE`)
//!
//! A JSON object:
//!
//! | field | meaning |
//! | --- | --- |
//! | `version` | `1` (required; a newer version is refused by name) |
//! | `source` | `"file"` (default), `"detected"` or `"probed"`: where the description came from |
//! | `hosts` | list of hosts: `name` (unique, required), `numa`, `gpus`, `nics` (all optional) |
//! | `hosts[].numa[]` | `id` (kernel node number), `cpus` (list string, `"0-15,32-47"`) |
//! | `hosts[].gpus[]` | `pci` (PCI address), `numa` and `name` (optional) |
//! | `hosts[].nics[]` | `name`, and optional `speed_mbps`, `numa`, `up`, `mac`, `addresses` (list of strings) |
//! | `hosts[].rdma[]` | `device`, `port`, and optional `active`, `link_layer`, `rate`, `netdev`, `numa`, `roce_v2_gid_index` |
//! | `ranks` | one entry per rank, any order: `rank`, `host` (a host name, or an index into `hosts`), optional `numa` (node id) and `gpu` (index into the host's `gpus`) |
//! | `links` | optional list: `ranks` (two ranks), `class` (`shm`, `tcp`, `rdma`, `nvlink`, `pcie`), optional `bandwidth` (bytes/s) and `latency` (seconds, one way) |
//!
//! Unknown fields are errors. After parsing, the whole file is checked and the first problem is named:
//! a rank listed twice, ranks missing from `0..=max`, a rank on a host not listed, a host without
//! ranks, a host name used twice, a NUMA node or GPU the host does not list, a link to an unknown rank
//! or to itself, a pair linked twice, `shm`/`pcie` between hosts, a bandwidth that is not positive, a
//! negative latency. [`Topology::check_world_size`] (and [`Topology::from_env`] given a world size) also
//! requires exactly the ranks of the world.
//!
//! ```
//! use braid_topo::{LinkClass, Topology};
//!
//! let text = r#"{
//!   "version": 1,
//!   "hosts": [
//!     { "name": "node-a",
//!       "numa": [ { "id": 0, "cpus": "0-15" }, { "id": 1, "cpus": "16-31" } ],
//!       "gpus": [ { "pci": "0000:17:00.0", "numa": 0, "name": "H100" },
//!                 { "pci": "0000:b1:00.0", "numa": 1 } ],
//!       "nics": [ { "name": "eth0", "speed_mbps": 100000, "numa": 0, "up": true,
//!                   "addresses": ["10.0.0.1"] } ] },
//!     { "name": "node-b" }
//!   ],
//!   "ranks": [
//!     { "rank": 0, "host": "node-a", "numa": 0, "gpu": 0 },
//!     { "rank": 1, "host": "node-a", "numa": 1, "gpu": 1 },
//!     { "rank": 3, "host": 1 },
//!     { "rank": 2, "host": "node-b" }
//!   ],
//!   "links": [
//!     { "ranks": [0, 1], "class": "nvlink", "bandwidth": 4.5e11, "latency": 2e-6 },
//!     { "ranks": [1, 2], "class": "rdma", "bandwidth": 5e10 }
//!   ]
//! }"#;
//! let topo = Topology::from_json(text)?;
//! assert_eq!(topo.host_groups(), vec![vec![0, 1], vec![2, 3]]);
//! assert_eq!(topo.local_rank(3), Some(1));
//! assert_eq!(topo.default_class(0, 1), Some(LinkClass::Nvlink));
//! assert_eq!(topo.default_class(0, 3), Some(LinkClass::Tcp)); // not listed, different hosts
//! assert_eq!(topo.ring_order(), vec![0, 1, 2, 3]);
//!
//! // What is saved reads back the same.
//! assert_eq!(Topology::from_json(&topo.to_json()?)?, topo);
//!
//! // Errors name what is wrong.
//! let bad = text.replace(r#""rank": 2"#, r#""rank": 1"#);
//! let err = Topology::from_json(&bad).unwrap_err();
//! assert_eq!(err.to_string(), "rank 1 is listed twice (ranks[1] and ranks[3])");
//! # Ok::<(), braid_topo::Error>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod cpulist;
mod describe;
mod detect;
mod error;
mod file;
mod model;
mod probe;

pub use cpulist::{format_ranges, parse_cpulist, MAX_CPU};
pub use detect::{detect_host, detect_local, NVIDIA_VENDOR};
pub use error::{Error, Result};
pub use file::{read_config_file, FORMAT_VERSION, MAX_CONFIG_FILE, TOPO_FILE_ENV};
pub use model::{
    ring_order, Gpu, Host, Link, LinkClass, Nic, NumaNode, RankPlace, RdmaPort, Source, Topology,
};
pub use probe::{
    infer_hosts, infer_topology, GapRule, Inference, ProbeOptions, DEFAULT_GAP_FACTOR,
};
