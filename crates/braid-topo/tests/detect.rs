//! Detection from fake sysfs trees, and one real call that only checks consistency.

mod common;

use braid_topo::{detect_host, detect_local, Host, RdmaPort, Source, Topology};
use common::TempDir;

fn pci(dir: &TempDir, addr: &str, vendor: &str, class: &str, numa: &str) {
    let base = format!("sys/bus/pci/devices/{addr}");
    dir.write(&format!("{base}/vendor"), format!("{vendor}\n"));
    dir.write(&format!("{base}/class"), format!("{class}\n"));
    dir.write(&format!("{base}/numa_node"), format!("{numa}\n"));
}

fn nic(dir: &TempDir, name: &str, speed: &str, numa: Option<&str>, state: &str) {
    let base = format!("sys/class/net/{name}");
    dir.write(&format!("{base}/speed"), format!("{speed}\n"));
    dir.write(&format!("{base}/operstate"), format!("{state}\n"));
    dir.write(&format!("{base}/address"), "02:00:00:00:00:07\n");
    if let Some(n) = numa {
        dir.write(&format!("{base}/device/numa_node"), format!("{n}\n"));
    }
}

#[test]
fn a_two_socket_gpu_host() {
    let dir = TempDir::new("detect");
    dir.write("proc/sys/kernel/hostname", "gpu-node-7\n");
    dir.write("sys/devices/system/node/node1/cpulist", "16-31,48-63\n");
    dir.write("sys/devices/system/node/node0/cpulist", "0-15,32-47\n");
    dir.write("sys/devices/system/node/possible", "0-1\n"); // not a node directory
    dir.write("sys/devices/system/cpu/online", "0-63\n");
    nic(&dir, "lo", "-1", None, "unknown");
    nic(&dir, "ens1", "100000", Some("1"), "up");
    nic(&dir, "eth0", "25000", Some("0"), "down");
    pci(&dir, "0000:b1:00.0", "0x10de", "0x030200", "1");
    pci(&dir, "0000:17:00.0", "0x10de", "0x030000", "0");
    pci(&dir, "0000:17:00.1", "0x10de", "0x040300", "0"); // its HDMI audio function
    pci(&dir, "0000:03:00.0", "0x10de", "0x068000", "0"); // an NVIDIA bridge
    pci(&dir, "0000:65:00.0", "0x1002", "0x030000", "0"); // another vendor's GPU
    pci(&dir, "0000:00:1f.0", "0x8086", "0x060100", "-1");

    let host = detect_host(dir.path());
    assert_eq!(host.name, "gpu-node-7");
    assert_eq!(
        host.numa.iter().map(|n| n.id).collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert_eq!(
        host.numa[0].cpus,
        (0..16).chain(32..48).collect::<Vec<u32>>()
    );
    assert_eq!(host.numa[1].cpus.len(), 32);
    let gpus: Vec<(&str, Option<u32>)> = host
        .gpus
        .iter()
        .map(|g| (g.pci_bus_id.as_str(), g.numa_node))
        .collect();
    assert_eq!(
        gpus,
        vec![("0000:17:00.0", Some(0)), ("0000:b1:00.0", Some(1))]
    );
    type NicSummary<'a> = (&'a str, Option<u64>, Option<u32>, Option<bool>);
    let nics: Vec<NicSummary> = host
        .nics
        .iter()
        .map(|n| (n.name.as_str(), n.speed_mbps, n.numa_node, n.up))
        .collect();
    assert_eq!(
        nics,
        vec![
            ("ens1", Some(100_000), Some(1), Some(true)),
            ("eth0", Some(25_000), Some(0), Some(false))
        ]
    );
    assert_eq!(host.nics[0].mac.as_deref(), Some("02:00:00:00:00:07"));

    // The detected host is usable as a topology and shows up in the summary.
    let topo = Topology::single_host(host, 2, Source::Detected).unwrap();
    let text = topo.describe();
    for needle in [
        "gpu-node-7",
        "numa 1: cpus 16-31,48-63 (32)",
        "gpu 1: 0000:b1:00.0, numa 1",
        "nic ens1: 100 Gbit/s",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}

#[test]
fn garbage_in_sysfs_leaves_fields_unknown() {
    let dir = TempDir::new("garbage");
    dir.write("etc/hostname", "from-etc\n");
    dir.write("sys/devices/system/node/node0/cpulist", "0-banana\n");
    dir.write("sys/devices/system/node/nodeX/cpulist", "0-3\n"); // not a node number: skipped
    dir.write("sys/devices/system/node/node2/cpulist", [0xff, 0xfe, 0x00]); // not text
    dir.mkdir("sys/devices/system/node/node3"); // no cpulist at all
    nic(&dir, "eth1", "fast", Some("-1"), "unknown");
    nic(&dir, "eth2", "-1", Some("zero"), "lowerlayerdown");
    dir.mkdir("sys/class/net/eth3"); // nothing inside
    pci(&dir, "0000:17:00.0", "0x10de", "0x030200", "-1");
    pci(&dir, "0000:18:00.0", "0x10de", "0x03zz00", "0"); // class unreadable: not known to be a GPU
    pci(&dir, "0000:19:00.0", "nvidia", "0x030200", "0"); // vendor unreadable
    pci(&dir, "0000:1a:00.0", "10de", "030000", "banana"); // no 0x prefix is still hex

    let host = detect_host(dir.path());
    assert_eq!(host.name, "from-etc");
    assert_eq!(
        host.numa.iter().map(|n| n.id).collect::<Vec<_>>(),
        vec![0, 2, 3]
    );
    assert!(
        host.numa.iter().all(|n| n.cpus.is_empty()),
        "{:?}",
        host.numa
    );
    assert_eq!(host.nics.len(), 3);
    assert!(
        host.nics
            .iter()
            .all(|n| n.speed_mbps.is_none() && n.numa_node.is_none()),
        "{:?}",
        host.nics
    );
    assert_eq!(
        host.nics.iter().map(|n| n.up).collect::<Vec<_>>(),
        vec![None, Some(false), None]
    );
    let gpus: Vec<(&str, Option<u32>)> = host
        .gpus
        .iter()
        .map(|g| (g.pci_bus_id.as_str(), g.numa_node))
        .collect();
    assert_eq!(gpus, vec![("0000:17:00.0", None), ("0000:1a:00.0", None)]);
}

#[test]
fn without_numa_directories_all_online_cpus_form_node_zero() {
    let dir = TempDir::new("nonuma");
    dir.write("sys/devices/system/cpu/online", "0-3\n");
    let host = detect_host(dir.path());
    assert_eq!(host.numa.len(), 1);
    assert_eq!(
        (host.numa[0].id, host.numa[0].cpus.clone()),
        (0, vec![0, 1, 2, 3])
    );
    assert_eq!(host.name, "localhost");
}

#[test]
fn rdma_ports_with_their_state_layer_and_roce_v2_gid() {
    let dir = TempDir::new("rdma");
    let p = "sys/class/infiniband/rxe0/ports/1";
    dir.write(&format!("{p}/state"), "4: ACTIVE\n");
    dir.write(&format!("{p}/link_layer"), "Ethernet\n");
    dir.write(&format!("{p}/rate"), "10 Gb/sec (1X QDR)\n");
    dir.write(&format!("{p}/gid_attrs/ndevs/0"), "braid0\n");
    // As rxe lists them: the link-local IPv6 GID first, then the IPv4 one.
    dir.write(&format!("{p}/gid_attrs/types/0"), "RoCE v2\n");
    dir.write(
        &format!("{p}/gids/0"),
        "fe80:0000:0000:0000:5054:00ff:fe12:3456\n",
    );
    dir.write(&format!("{p}/gid_attrs/types/1"), "RoCE v2\n");
    dir.write(
        &format!("{p}/gids/1"),
        "0000:0000:0000:0000:0000:ffff:c612:6401\n",
    );
    let q = "sys/class/infiniband/mlx5_0/ports/1";
    dir.write(&format!("{q}/state"), "1: DOWN\n");
    dir.write(&format!("{q}/link_layer"), "InfiniBand\n");
    dir.write(&format!("{q}/gid_attrs/types/0"), "IB/RoCE v1\n");
    dir.write("sys/class/infiniband/mlx5_0/device/numa_node", "1\n");
    dir.write(
        "sys/class/infiniband/mlx5_0/ports/garbage/state",
        "4: ACTIVE\n",
    );
    let h = detect_host(dir.path());
    assert_eq!(
        h.rdma,
        vec![
            RdmaPort {
                device: "mlx5_0".into(),
                port: 1,
                active: Some(false),
                link_layer: Some("InfiniBand".into()),
                rate: None,
                netdev: None,
                numa_node: Some(1),
                roce_v2_gid_index: None,
            },
            RdmaPort {
                device: "rxe0".into(),
                port: 1,
                active: Some(true),
                link_layer: Some("Ethernet".into()),
                rate: Some("10 Gb/sec (1X QDR)".into()),
                netdev: Some("braid0".into()),
                numa_node: None,
                roce_v2_gid_index: Some(1),
            },
        ]
    );
    let t = Topology::single_host(h, 1, Source::Detected).unwrap();
    let text = t.describe();
    assert!(
        text.contains(
            "rdma rxe0:1: active, Ethernet, 10 Gb/sec (1X QDR), over braid0, RoCE v2 GID 1"
        ),
        "{text}"
    );
    assert!(
        text.contains("rdma mlx5_0:1: not active, InfiniBand, numa 1"),
        "{text}"
    );
}

#[test]
fn an_empty_or_absent_root_detects_nothing() {
    let dir = TempDir::new("empty");
    assert_eq!(detect_host(dir.path()), Host::named("localhost"));
    assert_eq!(
        detect_host(&dir.path().join("does/not/exist")),
        Host::named("localhost")
    );
}

#[test]
fn the_running_machine_is_consistent() {
    let host = detect_local();
    assert!(
        !host.name.is_empty() && !host.name.contains(char::is_whitespace),
        "{:?}",
        host.name
    );
    assert!(
        host.numa.windows(2).all(|w| w[0].id < w[1].id),
        "{:?}",
        host.numa
    );
    for node in &host.numa {
        assert!(node.cpus.windows(2).all(|w| w[0] < w[1]), "{node:?}");
    }
    let all_cpus: Vec<u32> = host
        .numa
        .iter()
        .flat_map(|n| n.cpus.iter().copied())
        .collect();
    let mut distinct = all_cpus.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        all_cpus.len(),
        "a CPU in two NUMA nodes: {:?}",
        host.numa
    );
    assert!(host.nics.iter().all(|n| n.name != "lo"));
    assert!(host.nics.windows(2).all(|w| w[0].name < w[1].name));
    assert!(host
        .gpus
        .windows(2)
        .all(|w| w[0].pci_bus_id < w[1].pci_bus_id));
    for g in &host.gpus {
        if let Some(n) = g.numa_node {
            assert!(
                host.numa.is_empty() || host.numa.iter().any(|x| x.id == n),
                "{g:?} on an unlisted node"
            );
        }
    }
    // Whatever was found is a valid host and survives the file format.
    let topo = Topology::single_host(host, 1, Source::Detected).unwrap();
    assert_eq!(Topology::from_json(&topo.to_json().unwrap()).unwrap(), topo);
}
