//! Which transports a rank offers, in order of preference, from its configuration.
//!
//! This is the one place that lists the transports: a new one adds its module and a line here.

use std::net::SocketAddr;

use braid_core::{Config, Error};

use crate::plugin::{Geometry, Transport};
use crate::rdma::IbOptions;

/// Every transport braid knows, in the order `auto` prefers them: shared memory inside a host, RDMA
/// between hosts where a usable device exists, TCP otherwise.
const KNOWN: &[&str] = &["shm", "rdma", "tcp"];

/// The names `BRAID_TRANSPORT` accepts besides `auto`.
pub fn transport_names() -> &'static [&'static str] {
    KNOWN
}

/// The transports a configuration allows, in order of preference, and the setting they came from.
pub struct TransportChoice {
    /// The transports.
    pub transports: Vec<Box<dyn Transport>>,
    /// `BRAID_TRANSPORT` as given, for messages.
    pub setting: String,
}

/// Parses `BRAID_TRANSPORT` (`auto`, or a comma-separated list of names in order of preference).
fn names(setting: &str) -> Result<Vec<&'static str>, Error> {
    let s = setting.trim().to_ascii_lowercase();
    if s.is_empty() || s == "auto" {
        return Ok(KNOWN.to_vec());
    }
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some(name) = KNOWN.iter().find(|k| **k == item) else {
            return Err(Error::invalid(format!(
                "BRAID_TRANSPORT={setting:?}: {item:?} is not a transport (auto, {})",
                KNOWN.join(", ")
            )));
        };
        if !out.contains(name) {
            out.push(*name);
        }
    }
    if out.is_empty() {
        return Err(Error::invalid(format!(
            "BRAID_TRANSPORT={setting:?} names no transport"
        )));
    }
    Ok(out)
}

fn is_auto(setting: &str) -> bool {
    let s = setting.trim();
    s.is_empty() || s.eq_ignore_ascii_case("auto")
}

/// The RDMA transport, if this build has it and a device is usable. Under `auto` its absence is
/// quiet (TCP carries what it would have); asked for by name, it is an error that says why.
#[cfg(feature = "rdma")]
fn rdma(
    config: &Config,
    opts: &IbOptions,
    root: SocketAddr,
    auto: bool,
) -> Result<Option<Box<dyn Transport>>, Error> {
    if let Err(why) = crate::rdma::usable(opts) {
        if auto {
            tracing::debug!("rdma is not offered: {why}");
            return Ok(None);
        }
        return Err(Error::invalid(format!(
            "BRAID_TRANSPORT={} asks for rdma: {why}",
            config.transport
        )));
    }
    let ip = crate::tcp::choose_ip(config.socket_ifname.as_deref(), root)?;
    Ok(Some(Box::new(crate::rdma::Rdma::new(opts.clone(), ip))))
}

#[cfg(not(feature = "rdma"))]
fn rdma(
    config: &Config,
    _opts: &IbOptions,
    _root: SocketAddr,
    auto: bool,
) -> Result<Option<Box<dyn Transport>>, Error> {
    if auto {
        return Ok(None);
    }
    Err(Error::invalid(format!(
        "BRAID_TRANSPORT={} asks for rdma, which this build of braid does not have (build with the \
         cargo feature rdma, which needs libibverbs)",
        config.transport
    )))
}

/// Refuses a geometry whose world is larger than the transports `config` allows can carry: with shared
/// memory, every rank's segment must stay within [`crate::shm::MAX_SEGMENT_BYTES`]. Nothing is created.
pub fn check_world(config: &Config, geometry: &Geometry) -> Result<(), Error> {
    let g = geometry;
    if g.world <= 1 || !names(&config.transport)?.contains(&"shm") {
        return Ok(());
    }
    let max = crate::shm::max_world(g.channels, g.slots, g.slot_bytes);
    if g.world > max {
        return Err(Error::invalid(format!(
            "nranks {} exceeds the maximum {max} for shared memory: a rank's shared-memory segment holds \
             {} streams × {} slots × {} bytes per peer and may span at most {} GiB (lower BRAID_STREAMS, \
             BRAID_SLOTS or BRAID_CHUNK_BYTES, or set BRAID_TRANSPORT=tcp)",
            g.world,
            g.channels,
            g.slots,
            g.slot_bytes,
            crate::shm::MAX_SEGMENT_BYTES >> 30
        )));
    }
    Ok(())
}

/// The transports `config` allows for a communicator of `world` ranks whose root listens at `root`
/// (TCP listens on the interface that routes there, unless `BRAID_SOCKET_IFNAME` says otherwise).
pub fn transports(
    config: &Config,
    world: usize,
    root: SocketAddr,
) -> Result<TransportChoice, Error> {
    let auto = is_auto(&config.transport);
    let wanted = names(&config.transport)?;
    // The RDMA transport's own settings, checked in every build (a bad value is an error whether or
    // not the transport is built or chosen), before anything is set up.
    let ib = IbOptions::from_env()?;
    let mut transports: Vec<Box<dyn Transport>> = Vec::new();
    if world > 1 {
        for name in wanted {
            match name {
                "shm" => transports.push(Box::new(crate::shm::Shm::new("/dev/shm"))),
                "rdma" => {
                    if let Some(t) = rdma(config, &ib, root, auto)? {
                        transports.push(t);
                    }
                }
                "tcp" => {
                    let ip = crate::tcp::choose_ip(config.socket_ifname.as_deref(), root)?;
                    transports.push(Box::new(crate::tcp::Tcp::new(ip, config.sockets_per_peer)));
                }
                other => {
                    return Err(Error::Internal(format!(
                        "transport {other} is listed but not built"
                    )))
                }
            }
        }
    }
    Ok(TransportChoice {
        transports,
        setting: config.transport.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_in_order_and_bad_names_are_named() {
        assert_eq!(names("auto").unwrap(), vec!["shm", "rdma", "tcp"]);
        assert_eq!(names("").unwrap(), vec!["shm", "rdma", "tcp"]);
        assert_eq!(names("TCP").unwrap(), vec!["tcp"]);
        assert_eq!(names("tcp, shm,tcp").unwrap(), vec!["tcp", "shm"]);
        let e = names("shm,carrier-pigeon").unwrap_err().to_string();
        assert!(
            e.contains("carrier-pigeon") && e.contains("auto, shm, rdma, tcp"),
            "{e}"
        );
        assert!(names(",").is_err());
    }
}
