//! Queries on the model: host groups, local ranks, ring order, identities, the summary.

use braid_topo::{ring_order, Error, Host, Link, LinkClass, RankPlace, Source, Topology};
use proptest::prelude::*;

fn with_hosts(host_of: &[usize]) -> Topology {
    let hosts = host_of.iter().max().map_or(0, |m| m + 1);
    Topology {
        hosts: (0..hosts).map(|h| Host::named(format!("n{h}"))).collect(),
        ranks: host_of
            .iter()
            .enumerate()
            .map(|(rank, &host)| RankPlace {
                rank,
                host,
                numa: None,
                gpu: None,
            })
            .collect(),
        links: Vec::new(),
        source: Source::File,
    }
}

#[test]
fn identities_group_ranks_by_first_appearance() {
    let ids = ["b", "a", "b", "c", "a", "b"].map(String::from);
    let t = Topology::from_identities(&ids).unwrap();
    t.validate().unwrap();
    assert_eq!(t.source, Source::Detected);
    assert_eq!(
        t.hosts.iter().map(|h| h.name.as_str()).collect::<Vec<_>>(),
        vec!["b", "a", "c"]
    );
    assert_eq!(t.host_groups(), vec![vec![0, 2, 5], vec![1, 4], vec![3]]);
    assert_eq!(
        (0..6).map(|r| t.local_rank(r).unwrap()).collect::<Vec<_>>(),
        vec![0, 0, 1, 0, 1, 2]
    );
    assert_eq!(t.local_world_size(4), Some(2));
    assert_eq!(t.local_rank(6), None);
    assert!(!t.is_uniform());
    assert_eq!(ring_order(&t), vec![0, 2, 5, 1, 4, 3]);
    assert_eq!(t.crossings(&ring_order(&t)), 3);

    let err = Topology::from_identities::<String>(&[]).unwrap_err();
    assert!(err.to_string().contains("no ranks"), "{err}");
    let err = Topology::from_identities(&["a", ""]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "identities[1]: rank reported an empty identity"
    );
}

#[test]
fn groups_must_partition_the_ranks() {
    let t = Topology::from_groups(&[vec![2, 0], vec![1, 3]], Source::Probed).unwrap();
    assert_eq!(t.host_groups(), vec![vec![0, 2], vec![1, 3]]);
    assert!(t.is_uniform());
    let err = Topology::from_groups(&[vec![0, 1], vec![1]], Source::Probed).unwrap_err();
    assert_eq!(err.to_string(), "groups[1]: rank 1 is already in groups[0]");
    let err = Topology::from_groups(&[vec![0, 5]], Source::Probed).unwrap_err();
    assert!(
        matches!(
            err,
            Error::RankOutOfRange {
                rank: 5,
                world_size: 2
            }
        ),
        "{err}"
    );
    let err = Topology::from_groups(&[vec![0], vec![]], Source::Probed).unwrap_err();
    assert_eq!(err.to_string(), "groups[1]: group has no ranks");
}

#[test]
fn link_classes_default_by_host() {
    let mut t = with_hosts(&[0, 0, 1]);
    t.links.push(Link {
        ranks: [2, 0],
        class: LinkClass::Rdma,
        bandwidth: Some(2.5e10),
        latency: None,
    });
    t.validate().unwrap();
    assert_eq!(t.default_class(0, 1), Some(LinkClass::Shm));
    assert_eq!(t.default_class(1, 2), Some(LinkClass::Tcp));
    assert_eq!(t.default_class(0, 2), Some(LinkClass::Rdma));
    assert_eq!(t.link(0, 2).and_then(|l| l.bandwidth), Some(2.5e10));
    assert_eq!(t.default_class(0, 3), None);
}

#[test]
fn hand_built_topologies_are_validated() {
    let mut t = with_hosts(&[0, 1]);
    t.ranks.swap(0, 1);
    t.ranks[0].host = 0;
    t.ranks[1].host = 1;
    let err = t.validate().unwrap_err();
    assert_eq!(
        err.to_string(),
        "ranks[0]: holds rank 1; ranks must be in rank order"
    );
    let mut t = with_hosts(&[0, 1]);
    t.ranks[1].host = 4;
    assert!(matches!(
        t.validate().unwrap_err(),
        Error::UnknownHost {
            rank: 1,
            hosts: 2,
            ..
        }
    ));
    let mut t = with_hosts(&[0, 0]);
    t.ranks[1].rank = 0;
    assert!(matches!(
        t.validate().unwrap_err(),
        Error::DuplicateRank {
            rank: 0,
            first: 0,
            second: 1
        }
    ));
}

#[test]
fn the_summary_names_hosts_ranks_and_links() {
    let mut t = with_hosts(&[0, 1, 0, 1]);
    t.hosts[1].nics.push(braid_topo::Nic {
        name: "ib0".into(),
        speed_mbps: Some(200_000),
        numa_node: Some(1),
        up: Some(true),
        mac: None,
        addresses: vec!["192.168.1.2".into()],
    });
    t.links.push(Link {
        ranks: [0, 1],
        class: LinkClass::Rdma,
        bandwidth: Some(2.4e10),
        latency: Some(3e-6),
    });
    let text = t.to_string();
    assert_eq!(text, t.describe());
    let expected = [
        "topology (file): 2 hosts, 4 ranks, 2 per host",
        "host 0 n0: ranks 0,2",
        "host 1 n1: ranks 1,3",
        "  nic ib0: 200 Gbit/s, numa 1, up, 192.168.1.2",
        "links: 1",
        "  0-1: rdma, 24.00 GB/s, 3.00 µs",
    ];
    assert_eq!(text.lines().collect::<Vec<_>>(), expected);
    let uneven = with_hosts(&[0, 0, 1]).to_string();
    assert!(
        uneven.starts_with("topology (file): 2 hosts, 3 ranks, 2/1 per host\n"),
        "{uneven}"
    );
}

proptest! {
    #[test]
    fn ring_order_crosses_once_per_host(host_of in prop::collection::vec(0usize..6, 1..40)) {
        // Renumber hosts by first appearance so that every listed host runs a rank.
        let mut names: Vec<usize> = Vec::new();
        let host_of: Vec<usize> = host_of.iter().map(|h| match names.iter().position(|x| x == h) {
            Some(i) => i,
            None => { names.push(*h); names.len() - 1 }
        }).collect();
        let t = with_hosts(&host_of);
        t.validate().unwrap();
        let ring = ring_order(&t);
        let mut sorted = ring.clone();
        sorted.sort_unstable();
        prop_assert_eq!(sorted, (0..host_of.len()).collect::<Vec<_>>());
        let hosts = names.len();
        prop_assert_eq!(t.crossings(&ring), if hosts > 1 { hosts } else { 0 });
        // Each host's ranks appear contiguously and ascending; hosts in order of their lowest rank.
        let groups = t.host_groups();
        let mut by_first: Vec<&Vec<usize>> = groups.iter().collect();
        by_first.sort_by_key(|g| g[0]);
        prop_assert_eq!(ring.clone(), by_first.into_iter().flatten().copied().collect::<Vec<_>>());
        prop_assert_eq!(ring, t.ring_order());
        // Local ranks number each host's ranks 0.. in rank order.
        for g in &groups {
            for (i, &r) in g.iter().enumerate() {
                prop_assert_eq!(t.local_rank(r), Some(i));
                prop_assert_eq!(t.local_world_size(r), Some(g.len()));
            }
        }
        prop_assert_eq!(t.is_uniform(), groups.iter().all(|g| g.len() == groups[0].len()));
    }
}
