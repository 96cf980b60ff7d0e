//! The topology file: round trips, and errors that name what is wrong.

mod common;

use braid_topo::{Error, Gpu, Host, Link, LinkClass, Nic, NumaNode, RankPlace, Source, Topology};
use common::TempDir;
use proptest::prelude::*;

fn two_hosts() -> Topology {
    let mut a = Host::named("node-a");
    a.numa = vec![
        NumaNode {
            id: 0,
            cpus: (0..8).collect(),
        },
        NumaNode {
            id: 1,
            cpus: vec![8, 9, 12],
        },
    ];
    a.gpus = vec![
        Gpu {
            pci_bus_id: "0000:17:00.0".into(),
            numa_node: Some(0),
            name: Some("H100".into()),
        },
        Gpu {
            pci_bus_id: "0000:b1:00.0".into(),
            numa_node: None,
            name: None,
        },
    ];
    a.nics = vec![Nic {
        name: "eth0".into(),
        speed_mbps: Some(25_000),
        numa_node: Some(1),
        up: Some(true),
        mac: Some("02:00:00:00:00:01".into()),
        addresses: vec!["10.0.0.1".into(), "fe80::1".into()],
    }];
    let b = Host::named("node-b");
    Topology {
        hosts: vec![a, b],
        ranks: vec![
            RankPlace {
                rank: 0,
                host: 0,
                numa: Some(0),
                gpu: Some(0),
            },
            RankPlace {
                rank: 1,
                host: 0,
                numa: Some(1),
                gpu: Some(1),
            },
            RankPlace {
                rank: 2,
                host: 1,
                numa: None,
                gpu: None,
            },
        ],
        links: vec![
            Link {
                ranks: [0, 1],
                class: LinkClass::Nvlink,
                bandwidth: Some(4.5e11),
                latency: Some(2e-6),
            },
            Link {
                ranks: [2, 1],
                class: LinkClass::Tcp,
                bandwidth: None,
                latency: Some(3.5e-5),
            },
        ],
        source: Source::Detected,
    }
}

fn json(t: &Topology) -> serde_json::Value {
    serde_json::from_str(&t.to_json().unwrap()).unwrap()
}

fn from_value(v: &serde_json::Value) -> Result<Topology, Error> {
    Topology::from_json(&v.to_string())
}

#[test]
fn save_and_load_round_trip_through_a_file() {
    let dir = TempDir::new("file");
    let path = dir.path().join("topo.json");
    let t = two_hosts();
    t.save(&path).unwrap();
    let back = Topology::load(&path).unwrap();
    assert_eq!(back, t);
    // The writer names hosts, writes CPU sets as lists and keeps the source.
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(r#""host": "node-b""#), "{text}");
    assert!(text.contains(r#""cpus": "8-9,12""#), "{text}");
    assert!(text.contains(r#""source": "detected""#), "{text}");
}

#[test]
fn a_device_a_fifo_or_a_huge_file_is_refused_without_reading_it() {
    // /dev/zero would grow memory without end; a FIFO nobody writes would block forever.
    let e = Topology::load("/dev/zero").unwrap_err();
    assert!(e.to_string().contains("not a regular file"), "{e}");
    let dir = TempDir::new("special");
    let fifo = dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success(), "mkfifo failed");
    // Opening it would block until a writer came; it is refused before it is opened.
    let e = Topology::load(&fifo).unwrap_err();
    assert!(e.to_string().contains("not a regular file"), "{e}");
    let big = dir.path().join("big.json");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(braid_topo::MAX_CONFIG_FILE + 1).unwrap();
    let e = Topology::load(&big).unwrap_err();
    assert!(e.to_string().contains("larger than"), "{e}");
    assert!(
        e.to_string().contains("big.json"),
        "the error names the file: {e}"
    );
}

#[test]
fn ranks_may_come_in_any_order_and_name_hosts_by_index() {
    let text = r#"{"version": 1, "hosts": [{"name": "a"}, {"name": "b"}],
        "ranks": [{"rank": 2, "host": 0}, {"rank": 0, "host": "b"}, {"rank": 1, "host": 1}]}"#;
    let t = Topology::from_json(text).unwrap();
    assert_eq!(t.source, Source::File);
    assert_eq!(
        t.ranks.iter().map(|p| p.rank).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert_eq!(t.host_groups(), vec![vec![2], vec![0, 1]]);
}

#[test]
fn load_of_a_missing_file_names_the_file() {
    let dir = TempDir::new("missing");
    let path = dir.path().join("nope.json");
    let err = Topology::load(&path).unwrap_err();
    assert!(matches!(err, Error::Read { .. }));
    assert!(err.to_string().contains("nope.json"), "{err}");
}

#[test]
fn an_invalid_topology_is_not_saved() {
    let dir = TempDir::new("invalid-save");
    let path = dir.path().join("t.json");
    let mut t = two_hosts();
    t.links[0].bandwidth = Some(-1.0);
    let err = t.save(&path).unwrap_err();
    assert!(err.to_string().contains("links[0].bandwidth"), "{err}");
    assert!(!path.exists());
}

/// Applies `edit` to the JSON form of [`two_hosts`] and expects an error whose text contains `needle`.
fn rejects(edit: impl FnOnce(&mut serde_json::Value), needle: &str) -> Error {
    let mut v = json(&two_hosts());
    edit(&mut v);
    let err = from_value(&v).expect_err(needle);
    assert!(
        err.to_string().contains(needle),
        "expected {needle:?} in: {err}"
    );
    err
}

#[test]
fn duplicate_rank_is_named() {
    let err = rejects(
        |v| v["ranks"][2]["rank"] = 1.into(),
        "rank 1 is listed twice (ranks[1] and ranks[2])",
    );
    assert!(matches!(
        err,
        Error::DuplicateRank {
            rank: 1,
            first: 1,
            second: 2
        }
    ));
}

#[test]
fn rank_on_unknown_host_is_named() {
    let err = rejects(
        |v| v["ranks"][1]["host"] = "node-z".into(),
        "rank 1 is placed on host \"node-z\"",
    );
    assert!(matches!(
        err,
        Error::UnknownHost {
            rank: 1,
            hosts: 2,
            ..
        }
    ));
    rejects(
        |v| v["ranks"][2]["host"] = 7.into(),
        "rank 2 is placed on host 7",
    );
    rejects(
        |v| v["ranks"][2]["host"] = (-1).into(),
        "a host name or an index",
    );
}

#[test]
fn missing_ranks_are_listed() {
    let err = rejects(
        |v| {
            v["ranks"][0]["rank"] = 5.into();
        },
        "no place given for rank(s) 0,3-4",
    );
    assert!(
        matches!(err, Error::MissingRanks { world_size: 6, ref missing } if missing == &[0, 3, 4])
    );
}

#[test]
fn world_size_is_checked() {
    let t = two_hosts();
    t.check_world_size(3).unwrap();
    let err = t.check_world_size(5).unwrap_err();
    assert!(
        matches!(err, Error::MissingRanks { world_size: 5, ref missing } if missing == &[3, 4]),
        "{err}"
    );
    let err = t.check_world_size(2).unwrap_err();
    assert_eq!(
        err.to_string(),
        "rank 2 is out of range for a world of 2 ranks"
    );
}

#[test]
fn link_values_are_checked() {
    rejects(
        |v| v["links"][0]["bandwidth"] = (-5.0).into(),
        "links[0].bandwidth: -5 is not a positive",
    );
    rejects(
        |v| v["links"][0]["bandwidth"] = 0.0.into(),
        "links[0].bandwidth: 0 is not a positive",
    );
    rejects(
        |v| v["links"][1]["latency"] = (-1e-6).into(),
        "links[1].latency",
    );
    rejects(
        |v| v["links"][1]["ranks"] = serde_json::json!([2, 9]),
        "links[1].ranks: rank 9 is out of range",
    );
    rejects(
        |v| v["links"][1]["ranks"] = serde_json::json!([2, 2]),
        "links rank 2 to itself",
    );
    rejects(
        |v| v["links"][1]["ranks"] = serde_json::json!([1, 0]),
        "already linked by links[0]",
    );
    rejects(
        |v| v["links"][1]["class"] = "shm".into(),
        "links[1].class: shm joins ranks of one host",
    );
    rejects(
        |v| v["links"][1]["class"] = "carrier-pigeon".into(),
        "unknown variant `carrier-pigeon`",
    );
}

#[test]
fn host_and_rank_details_are_checked() {
    rejects(
        |v| v["hosts"][1]["name"] = "node-a".into(),
        "host name \"node-a\" is used by hosts[0] and hosts[1]",
    );
    rejects(
        |v| {
            v["hosts"][1]["name"] = " ".into();
            v["ranks"][2]["host"] = 1.into();
        },
        "hosts[1].name: host name is empty",
    );
    rejects(
        |v| v["ranks"][2]["host"] = 0.into(),
        "hosts[1]: host \"node-b\" runs no rank",
    );
    rejects(
        |v| v["ranks"][0]["numa"] = 4.into(),
        "ranks[0].numa: rank 0 is bound to NUMA node 4",
    );
    rejects(
        |v| v["ranks"][1]["gpu"] = 2.into(),
        "ranks[1].gpu: rank 1 uses GPU 2, but host \"node-a\" lists 2",
    );
    rejects(
        |v| v["hosts"][0]["numa"][1]["id"] = 0.into(),
        "hosts[0].numa[1].id: NUMA node 0 is listed twice",
    );
    rejects(
        |v| v["hosts"][0]["numa"][0]["cpus"] = "0-x".into(),
        "cpus: \"x\" in \"0-x\" is not a cpu number",
    );
    rejects(
        |v| v["hosts"][0]["gpus"][1]["pci"] = "0000:17:00.0".into(),
        "hosts[0].gpus[1].pci",
    );
    rejects(
        |v| v["ranks"] = serde_json::json!([]),
        "ranks: the topology places no ranks",
    );
}

#[test]
fn format_errors_are_named() {
    rejects(
        |v| v["version"] = 2.into(),
        "version 2 is not supported (this build reads version 1)",
    );
    rejects(
        |v| v["version"] = "one".into(),
        "version: \"one\" is not a version number",
    );
    rejects(
        |v| drop(v.as_object_mut().unwrap().remove("version")),
        "version: missing",
    );
    let err = rejects(
        |v| v["hosts"][0]["colour"] = "blue".into(),
        "unknown field `colour`",
    );
    assert!(matches!(err, Error::Parse { line: 1, .. }), "{err:?}");
    rejects(
        |v| drop(v["ranks"][0].as_object_mut().unwrap().remove("host")),
        "missing field `host`",
    );
    let err = Topology::from_json("[]").unwrap_err();
    assert!(
        err.to_string()
            .contains("expected a JSON object holding a topology, found an array"),
        "{err}"
    );
    let err = Topology::from_json("").unwrap_err();
    assert!(err.to_string().contains("EOF while parsing"), "{err}");
    let err = Topology::from_json("{\n  \"version\": 1,\n  \"hosts\": [,]\n}").unwrap_err();
    assert!(matches!(err, Error::Parse { line: 3, .. }), "{err:?}");
}

fn arb_topology() -> impl Strategy<Value = Topology> {
    let host = (
        prop::collection::vec(prop::collection::btree_set(0u32..64, 0..6), 0..3),
        prop::collection::vec((any::<bool>(), prop::option::of(0u32..2)), 0..3),
        prop::collection::vec(
            (
                prop::option::of(1u64..400_000),
                prop::option::of(any::<bool>()),
            ),
            0..3,
        ),
    );
    (
        prop::collection::vec(host, 1..4),
        prop::collection::vec(any::<u32>(), 1..10),
        any::<u64>(),
    )
        .prop_map(|(hosts, rank_seeds, link_seed)| {
            let hosts: Vec<Host> = hosts
                .into_iter()
                .enumerate()
                .map(|(h, (numa, gpus, nics))| Host {
                    name: format!("h{h}"),
                    numa: numa
                        .into_iter()
                        .enumerate()
                        .map(|(i, cpus)| NumaNode {
                            id: i as u32,
                            cpus: cpus.into_iter().collect(),
                        })
                        .collect(),
                    gpus: gpus
                        .into_iter()
                        .enumerate()
                        .map(|(i, (named, numa))| Gpu {
                            pci_bus_id: format!("0000:{:02x}:00.0", i + 1),
                            numa_node: numa,
                            name: named.then(|| format!("gpu model {i}")),
                        })
                        .collect(),
                    nics: nics
                        .into_iter()
                        .enumerate()
                        .map(|(i, (speed, up))| Nic {
                            name: format!("eth{i}"),
                            speed_mbps: speed,
                            numa_node: None,
                            up,
                            mac: None,
                            addresses: (0..i).map(|k| format!("10.0.{h}.{k}")).collect(),
                        })
                        .collect(),
                    rdma: (0..h % 2)
                        .map(|i| braid_topo::RdmaPort {
                            device: format!("mlx5_{i}"),
                            port: 1,
                            active: Some(true),
                            link_layer: Some("Ethernet".into()),
                            rate: Some("200 Gb/sec (4X HDR)".into()),
                            netdev: Some(format!("eth{i}")),
                            numa_node: Some(0),
                            roce_v2_gid_index: Some(3),
                        })
                        .collect(),
                })
                .collect();
            // Every host runs a rank; the rest are spread by the seeds.
            let mut ranks = Vec::new();
            for (rank, &s) in rank_seeds.iter().enumerate() {
                let host = if rank < hosts.len() {
                    rank
                } else {
                    s as usize % hosts.len()
                };
                let hs = &hosts[host];
                let numa = (!hs.numa.is_empty() && s & 1 == 1)
                    .then(|| hs.numa[(s as usize >> 1) % hs.numa.len()].id);
                let gpu =
                    (!hs.gpus.is_empty() && s & 2 == 2).then(|| (s as usize >> 2) % hs.gpus.len());
                ranks.push(RankPlace {
                    rank,
                    host,
                    numa,
                    gpu,
                });
            }
            let n = ranks.len().max(hosts.len());
            while ranks.len() < n {
                let rank = ranks.len();
                ranks.push(RankPlace {
                    rank,
                    host: rank,
                    numa: None,
                    gpu: None,
                });
            }
            let mut links = Vec::new();
            for a in 0..n {
                for b in a + 1..n {
                    let bits = link_seed.rotate_left((a * 7 + b) as u32);
                    if bits & 3 != 0 {
                        continue;
                    }
                    let same = ranks[a].host == ranks[b].host;
                    let class = if same {
                        LinkClass::Shm
                    } else {
                        LinkClass::Rdma
                    };
                    let k = (bits >> 8) % 1000 + 1;
                    links.push(Link {
                        ranks: if bits & 4 == 0 { [a, b] } else { [b, a] },
                        class,
                        bandwidth: (bits & 8 == 0).then_some(k as f64 * 1e8),
                        latency: (bits & 16 == 0).then(|| k as f64 / 1e7),
                    });
                }
            }
            let source = [Source::File, Source::Detected, Source::Probed][(link_seed % 3) as usize];
            Topology {
                hosts,
                ranks,
                links,
                source,
            }
        })
}

proptest! {
    #[test]
    fn any_valid_topology_round_trips(t in arb_topology()) {
        t.validate().unwrap();
        let text = t.to_json().unwrap();
        let back = Topology::from_json(&text).unwrap();
        prop_assert_eq!(&back, &t);
        prop_assert_eq!(back.to_json().unwrap(), text);
    }
}
