//! Setting the TCP link up: the listening [`TcpEndpoint`], which connects to and accepts every peer and
//! starts the reader threads, and [`Tcp`], the typed stages of [`crate::setup`].

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use braid_core::Error;
use parking_lot::Mutex;
use tracing::debug;

use super::conn::{accept_all, dial, TcpOptions};
use super::link::{Outbound, RecvRing, SendRing, TcpLink};
use super::reader::{reader, Inbound, Shared};
use crate::link::{Link, LinkId};
use crate::plugin::{Connected, Peer, Prepared, Scope, SetupCtx, Transport};

/// A listening socket, opened before the bootstrap so that its address can be published.
pub struct TcpEndpoint {
    listener: TcpListener,
    addr: SocketAddr,
}

impl TcpEndpoint {
    /// Listens on `ip` at a port the kernel picks.
    pub fn bind(ip: IpAddr) -> Result<TcpEndpoint, Error> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::io(format!("listening for TCP peers on {ip}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the TCP listener's address", e))?;
        Ok(TcpEndpoint { listener, addr })
    }

    /// The address peers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connects to every peer that has an address in `peers` (indexed by rank; `None` for this rank and
    /// for peers reached otherwise) and accepts their connections. Every peer listed must do the same
    /// with this rank before `deadline`.
    pub fn connect(
        self,
        opts: TcpOptions,
        peers: &[Option<SocketAddr>],
        deadline: Instant,
    ) -> Result<TcpLink, Error> {
        if peers.len() != opts.world || peers[opts.rank].is_some() {
            return Err(Error::Internal(format!(
                "tcp: {} peer addresses for {} ranks, or one for this rank",
                peers.len(),
                opts.world
            )));
        }
        let k = opts.connections();
        let remote: Vec<bool> = peers.iter().map(Option::is_some).collect();
        let expected = remote.iter().filter(|r| **r).count() * k;
        let accept = {
            let listener = self
                .listener
                .try_clone()
                .map_err(|e| Error::io("cloning the TCP listener", e))?;
            let remote = remote.clone();
            std::thread::Builder::new()
                .name(format!("braid-accept-{}", opts.rank))
                .spawn(move || accept_all(listener, opts, &remote, expected, deadline))
                .map_err(|e| Error::io("starting the TCP accept thread", e))?
        };
        let mut outbound: Vec<Option<Outbound>> = (0..opts.world).map(|_| None).collect();
        let mut result = Ok(());
        'peers: for (p, addr) in peers.iter().enumerate() {
            let Some(addr) = addr else { continue };
            let mut socks = Vec::with_capacity(k);
            for j in 0..k {
                match dial(*addr, opts, p, j, deadline) {
                    Ok(s) => socks.push(s),
                    Err(e) => {
                        result = Err(e);
                        break 'peers;
                    }
                }
            }
            outbound[p] = Some(Outbound {
                socks,
                rings: (0..opts.channels).map(|_| SendRing::default()).collect(),
            });
        }
        if result.is_err() {
            // Wake the acceptor now rather than at the deadline.
            let _ = TcpStream::connect(self.addr);
        }
        let accepted = accept
            .join()
            .map_err(|_| Error::Bootstrap("the TCP accept thread panicked".into()))?;
        result?;
        let inbound_socks = accepted?;
        let shared = Arc::new(Shared {
            shutdown: AtomicBool::new(false),
            inbound: (0..opts.world)
                .map(|p| {
                    remote[p].then(|| {
                        (0..opts.channels)
                            .map(|_| Inbound::new(opts.slots, opts.slot_bytes, opts.connections()))
                            .collect()
                    })
                })
                .collect(),
            sockets: Mutex::new(Vec::new()),
        });
        let mut readers = Vec::new();
        for (p, socks) in inbound_socks.into_iter().enumerate() {
            for (j, s) in socks.into_iter().enumerate() {
                shared.sockets.lock().push(
                    s.try_clone()
                        .map_err(|e| Error::io("cloning a socket", e))?,
                );
                let sh = shared.clone();
                let h = std::thread::Builder::new()
                    .name(format!("braid-tcp-{}<{p}.{j}", opts.rank))
                    .spawn(move || reader(sh, s, p, j, opts))
                    .map_err(|e| Error::io("starting a TCP reader thread", e))?;
                readers.push(h);
            }
        }
        for o in outbound.iter().flatten() {
            for s in &o.socks {
                shared.sockets.lock().push(
                    s.try_clone()
                        .map_err(|e| Error::io("cloning a socket", e))?,
                );
            }
        }
        debug!(rank = opts.rank, connections = expected, "tcp link ready");
        Ok(TcpLink {
            id: LinkId::new(),
            opts,
            shared,
            outbound,
            recv_rings: (0..opts.world * opts.channels)
                .map(|_| RecvRing::default())
                .collect(),
            readers,
        })
    }
}

/// TCP between any two ranks: the [`Transport`] that makes [`TcpLink`]s.
pub struct Tcp {
    ip: IpAddr,
    sockets_per_peer: usize,
}

impl Tcp {
    /// Listens on `ip`, with `sockets_per_peer` connections per peer and channel.
    pub fn new(ip: IpAddr, sockets_per_peer: usize) -> Tcp {
        Tcp {
            ip,
            sockets_per_peer: sockets_per_peer.max(1),
        }
    }
}

impl Transport for Tcp {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn scope(&self) -> Scope {
        Scope::Network
    }

    fn prepare(self: Box<Self>, _ctx: &SetupCtx) -> Result<Box<dyn Prepared>, Error> {
        Ok(Box::new(TcpPrepared {
            endpoint: TcpEndpoint::bind(self.ip)?,
            sockets_per_peer: self.sockets_per_peer,
        }))
    }
}

struct TcpPrepared {
    endpoint: TcpEndpoint,
    sockets_per_peer: usize,
}

impl Prepared for TcpPrepared {
    fn endpoint(&self) -> Vec<u8> {
        self.endpoint.addr().to_string().into_bytes()
    }

    fn connect(
        self: Box<Self>,
        ctx: &SetupCtx,
        peers: &[Option<&Peer>],
    ) -> Result<Box<dyn Connected>, Error> {
        let addrs = peers
            .iter()
            .enumerate()
            .map(|(p, peer)| {
                let Some(peer) = peer else { return Ok(None) };
                let text = peer.endpoint_text("tcp");
                text.parse().map(Some).map_err(|_| {
                    Error::Bootstrap(format!(
                        "rank {p} published no usable TCP address ({text:?})"
                    ))
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let g = ctx.geometry;
        let opts = TcpOptions {
            rank: g.rank,
            world: g.world,
            channels: g.channels,
            slots: g.slots,
            slot_bytes: g.slot_bytes,
            sockets_per_peer: self.sockets_per_peer,
            secret: ctx.secret,
            policy: ctx.policy,
        };
        let link = self.endpoint.connect(opts, &addrs, ctx.deadline)?;
        Ok(Box::new(TcpConnected(link)))
    }
}

struct TcpConnected(TcpLink);

impl Connected for TcpConnected {
    fn activate(self: Box<Self>) -> Result<Box<dyn Link>, Error> {
        Ok(Box::new(self.0))
    }
}
