//! Detection from sysfs. The root directory is a parameter so that tests (and tools that inspect a
//! container's or another machine's tree) can point it anywhere; `/` is the running machine.
//!
//! sysfs is read as it comes: a file that is missing, unreadable or holds something unexpected leaves its
//! field unknown (`None`, or an empty list) and never fails the detection, because the kernel, the
//! driver and the container runtime all decide what appears there.

use std::fs;
use std::path::{Path, PathBuf};

use crate::cpulist::parse_cpulist;
use crate::model::{Gpu, Host, Nic, NumaNode, RdmaPort};

/// PCI vendor id of NVIDIA.
pub const NVIDIA_VENDOR: u32 = 0x10de;

/// The host that `root` describes: name, NUMA nodes, NICs and NVIDIA GPUs, each list sorted.
///
/// - name: `<root>/proc/sys/kernel/hostname`, else `<root>/etc/hostname`, else `localhost`;
/// - NUMA: `<root>/sys/devices/system/node/node<N>/cpulist`; without node directories (a kernel
///   without NUMA), one node 0 holding `<root>/sys/devices/system/cpu/online`;
/// - NICs: `<root>/sys/class/net/*` except `lo`, with `speed`, `device/numa_node`, `operstate` and
///   `address`;
/// - GPUs: `<root>/sys/bus/pci/devices/*` whose `vendor` is `0x10de` and whose `class` is a VGA or 3D
///   controller (`0x0300xx`, `0x0302xx`), with `numa_node`;
/// - RDMA ports: `<root>/sys/class/infiniband/<device>/ports/<n>` with `state`, `link_layer`, `rate`,
///   `gid_attrs/ndevs/0`, the RoCE v2 GID (`gid_attrs/types/<i>`) whose `gids/<i>` is an IPv4 address,
///   else the first RoCE v2 one, and the device's `device/numa_node`.
pub fn detect_host(root: &Path) -> Host {
    Host {
        name: hostname(root),
        numa: numa_nodes(root),
        gpus: gpus(root),
        nics: nics(root),
        rdma: rdma_ports(root),
    }
}

/// [`detect_host`] on the running machine's `/`.
pub fn detect_local() -> Host {
    detect_host(Path::new("/"))
}

fn read_trimmed(path: &Path) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    Some(text.trim().to_owned())
}

/// Directory entries, sorted by name; an unreadable directory has none.
fn entries(dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(rd) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, PathBuf)> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| Some((e.file_name().into_string().ok()?, e.path())))
        .collect();
    out.sort();
    out
}

fn hostname(root: &Path) -> String {
    ["proc/sys/kernel/hostname", "etc/hostname"]
        .iter()
        .filter_map(|p| read_trimmed(&root.join(p)))
        .find(|n| !n.is_empty() && !n.contains(char::is_whitespace))
        .unwrap_or_else(|| "localhost".to_owned())
}

/// A sysfs `numa_node`: a node number, or `-1` for none.
fn numa_node(path: &Path) -> Option<u32> {
    read_trimmed(path)?.parse::<u32>().ok()
}

fn numa_nodes(root: &Path) -> Vec<NumaNode> {
    let mut nodes: Vec<NumaNode> = entries(&root.join("sys/devices/system/node"))
        .into_iter()
        .filter_map(|(name, path)| {
            let id = name.strip_prefix("node")?.parse::<u32>().ok()?;
            let cpus = read_trimmed(&path.join("cpulist"))
                .and_then(|t| parse_cpulist(&t).ok())
                .unwrap_or_default();
            Some(NumaNode { id, cpus })
        })
        .collect();
    nodes.sort_by_key(|n| n.id);
    if nodes.is_empty() {
        if let Some(cpus) = read_trimmed(&root.join("sys/devices/system/cpu/online"))
            .and_then(|t| parse_cpulist(&t).ok())
        {
            if !cpus.is_empty() {
                nodes.push(NumaNode { id: 0, cpus });
            }
        }
    }
    nodes
}

fn nics(root: &Path) -> Vec<Nic> {
    entries(&root.join("sys/class/net"))
        .into_iter()
        .filter(|(name, _)| name != "lo")
        .map(|(name, path)| Nic {
            // A down link reads as -1 or fails with EINVAL; both mean unknown.
            speed_mbps: read_trimmed(&path.join("speed"))
                .and_then(|s| s.parse::<u64>().ok())
                .filter(|&s| s > 0),
            numa_node: numa_node(&path.join("device/numa_node")),
            up: read_trimmed(&path.join("operstate")).and_then(|s| match s.as_str() {
                "up" => Some(true),
                "down" | "lowerlayerdown" | "notpresent" | "dormant" => Some(false),
                _ => None,
            }),
            mac: read_trimmed(&path.join("address")).filter(|a| !a.is_empty()),
            addresses: Vec::new(),
            name,
        })
        .collect()
}

fn rdma_ports(root: &Path) -> Vec<RdmaPort> {
    let mut out = Vec::new();
    for (device, dev) in entries(&root.join("sys/class/infiniband")) {
        let numa = numa_node(&dev.join("device/numa_node"));
        for (port, p) in entries(&dev.join("ports")) {
            let Ok(port) = port.parse::<u32>() else {
                continue;
            };
            // `state` reads `4: ACTIVE`.
            let active = read_trimmed(&p.join("state")).map(|s| s.ends_with("ACTIVE"));
            // The RoCE v2 entry of an IPv4 address (`::ffff:a.b.c.d`) if there is one, as the RDMA
            // transport picks it; else the first RoCE v2 entry (an IPv6 one, link-local included).
            let v2: Vec<u32> = (0..256u32)
                .filter(|i| {
                    read_trimmed(&p.join(format!("gid_attrs/types/{i}")))
                        .is_some_and(|t| t.eq_ignore_ascii_case("RoCE v2"))
                })
                .collect();
            let ipv4 = |i: &u32| {
                read_trimmed(&p.join(format!("gids/{i}")))
                    .is_some_and(|g| g.starts_with("0000:0000:0000:0000:0000:ffff:"))
            };
            let roce_v2_gid_index = v2.iter().copied().find(ipv4).or(v2.first().copied());
            out.push(RdmaPort {
                device: device.clone(),
                port,
                active,
                link_layer: read_trimmed(&p.join("link_layer")).filter(|s| !s.is_empty()),
                rate: read_trimmed(&p.join("rate")).filter(|s| !s.is_empty()),
                netdev: read_trimmed(&p.join("gid_attrs/ndevs/0")).filter(|s| !s.is_empty()),
                numa_node: numa,
                roce_v2_gid_index,
            });
        }
    }
    out
}

fn hex(path: &Path) -> Option<u32> {
    let text = read_trimmed(path)?;
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(&text);
    u32::from_str_radix(digits, 16).ok()
}

fn gpus(root: &Path) -> Vec<Gpu> {
    entries(&root.join("sys/bus/pci/devices"))
        .into_iter()
        .filter(|(_, path)| {
            hex(&path.join("vendor")) == Some(NVIDIA_VENDOR)
                && matches!(
                    hex(&path.join("class")).map(|c| c >> 8),
                    Some(0x0300 | 0x0302)
                )
        })
        .map(|(name, path)| Gpu {
            numa_node: numa_node(&path.join("numa_node")),
            name: None,
            pci_bus_id: name,
        })
        .collect()
}
