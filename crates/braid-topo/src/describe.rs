//! The human-readable summary a `braid topo` command prints.

use std::fmt::{self, Write as _};

use crate::cpulist::format_ranges;
use crate::model::Topology;

impl Topology {
    /// A multi-line summary: hosts and their ranks, NUMA nodes, GPUs, NICs, then the listed links.
    pub fn describe(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let groups = self.host_groups();
        let per_host = if self.is_uniform() {
            groups
                .first()
                .map_or(String::new(), |g| format!(", {} per host", g.len()))
        } else {
            format!(
                ", {} per host",
                groups
                    .iter()
                    .map(|g| g.len().to_string())
                    .collect::<Vec<_>>()
                    .join("/")
            )
        };
        writeln!(
            f,
            "topology ({}): {} host{}, {} rank{}{per_host}",
            self.source,
            self.hosts.len(),
            plural(self.hosts.len()),
            self.ranks.len(),
            plural(self.ranks.len()),
        )?;
        for (h, host) in self.hosts.iter().enumerate() {
            let ranks = groups.get(h).map_or(String::new(), |g| {
                format_ranges(g.iter().map(|&r| r as u64))
            });
            writeln!(f, "host {h} {}: ranks {ranks}", host.name)?;
            for node in &host.numa {
                let cpus = if node.cpus.is_empty() {
                    "unknown".to_owned()
                } else {
                    format!(
                        "{} ({})",
                        format_ranges(node.cpus.iter().map(|&c| u64::from(c))),
                        node.cpus.len()
                    )
                };
                writeln!(f, "  numa {}: cpus {cpus}", node.id)?;
            }
            for (g, gpu) in host.gpus.iter().enumerate() {
                let mut line = format!("  gpu {g}: {}", gpu.pci_bus_id);
                if let Some(name) = &gpu.name {
                    let _ = write!(line, " {name}");
                }
                if let Some(numa) = gpu.numa_node {
                    let _ = write!(line, ", numa {numa}");
                }
                let users: Vec<usize> = groups
                    .get(h)
                    .into_iter()
                    .flatten()
                    .copied()
                    .filter(|&r| self.ranks[r].gpu == Some(g))
                    .collect();
                if !users.is_empty() {
                    let _ = write!(
                        line,
                        ", rank {}",
                        format_ranges(users.iter().map(|&r| r as u64))
                    );
                }
                writeln!(f, "{line}")?;
            }
            for nic in &host.nics {
                let mut line = format!("  nic {}:", nic.name);
                match nic.speed_mbps {
                    Some(s) if s >= 1000 && s % 1000 == 0 => {
                        let _ = write!(line, " {} Gbit/s", s / 1000);
                    }
                    Some(s) => {
                        let _ = write!(line, " {s} Mbit/s");
                    }
                    None => line.push_str(" speed unknown"),
                }
                if let Some(numa) = nic.numa_node {
                    let _ = write!(line, ", numa {numa}");
                }
                match nic.up {
                    Some(true) => line.push_str(", up"),
                    Some(false) => line.push_str(", down"),
                    None => {}
                }
                if !nic.addresses.is_empty() {
                    let _ = write!(line, ", {}", nic.addresses.join(" "));
                }
                writeln!(f, "{line}")?;
            }
            for r in &host.rdma {
                let mut line = format!("  rdma {}:{}:", r.device, r.port);
                match r.active {
                    Some(true) => line.push_str(" active"),
                    Some(false) => line.push_str(" not active"),
                    None => line.push_str(" state unknown"),
                }
                for (what, v) in [("", &r.link_layer), ("", &r.rate), ("over ", &r.netdev)] {
                    if let Some(v) = v {
                        let _ = write!(line, ", {what}{v}");
                    }
                }
                if let Some(i) = r.roce_v2_gid_index {
                    let _ = write!(line, ", RoCE v2 GID {i}");
                }
                if let Some(numa) = r.numa_node {
                    let _ = write!(line, ", numa {numa}");
                }
                writeln!(f, "{line}")?;
            }
        }
        if !self.links.is_empty() {
            writeln!(f, "links: {}", self.links.len())?;
            for link in &self.links {
                let mut line = format!("  {}-{}: {}", link.ranks[0], link.ranks[1], link.class);
                if let Some(bw) = link.bandwidth {
                    let _ = write!(line, ", {:.2} GB/s", bw / 1e9);
                }
                if let Some(lat) = link.latency {
                    let _ = write!(line, ", {:.2} µs", lat * 1e6);
                }
                writeln!(f, "{line}")?;
            }
        }
        Ok(())
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}
