//! Setting links up, as typed stages the compiler keeps in order:
//!
//! ```text
//!   Transport ──prepare──▶ Prepared ──(publish endpoint bytes; bootstrap exchanges them)──▶
//!   Prepared ──connect(peers' endpoints)──▶ Connected ──(every rank connected: barrier)──▶
//!   Connected ──activate──▶ Link
//! ```
//!
//! A transport's endpoint is opaque bytes (a segment path, a socket address, a queue pair number and
//! key); the bootstrap carries them by name, so a new transport brings its endpoint without a change to
//! the bootstrap's format. [`Setup`] runs the stages for every transport of a rank and decides, the same
//! way on both ends of every pair, which transport reaches which peer.

use braid_core::Error;
use std::time::Instant;

use crate::link::Link;
use crate::registry::TransportChoice;
use crate::router::Router;
use crate::WaitPolicy;

/// What every link of a communicator agrees on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// This rank.
    pub rank: usize,
    /// Ranks in the communicator.
    pub world: usize,
    /// Independent channels (rings) per pair of ranks.
    pub channels: usize,
    /// Slots per ring (at least 2).
    pub slots: usize,
    /// Payload bytes per slot.
    pub slot_bytes: usize,
}

/// What setting up a link needs to know.
#[derive(Clone, Copy, Debug)]
pub struct SetupCtx {
    /// The agreed geometry.
    pub geometry: Geometry,
    /// The communicator's secret: links across processes refuse peers that cannot show it.
    pub secret: [u8; 16],
    /// A random number unique to this communicator and rank (for names of shared resources).
    pub nonce: u64,
    /// How waits spin and sleep.
    pub policy: WaitPolicy,
    /// When setup gives up.
    pub deadline: Instant,
}

/// Which peers a transport can reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Only ranks on the same host.
    Host,
    /// Any rank it has an endpoint of.
    Network,
}

/// One transport's endpoint, as published through the bootstrap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// The transport's name.
    pub transport: String,
    /// Its opaque bytes.
    pub blob: Vec<u8>,
}

/// A rank as the others see it after the bootstrap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Process id.
    pub pid: u32,
    /// Host identity: equal strings mean the same kernel (and the same `/dev/shm`).
    pub host: String,
    /// The endpoints of its transports, in its order of preference.
    pub endpoints: Vec<Endpoint>,
}

impl Peer {
    /// The endpoint bytes of `transport`, if the peer published one.
    pub fn endpoint(&self, transport: &str) -> Option<&[u8]> {
        self.endpoints
            .iter()
            .find(|e| e.transport == transport)
            .map(|e| e.blob.as_slice())
    }

    /// The endpoint of `transport` as text (for messages), or an empty string.
    pub fn endpoint_text(&self, transport: &str) -> String {
        self.endpoint(transport)
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default()
    }
}

/// A kind of link, configured, before anything is set up.
pub trait Transport: Send {
    /// Its name, as endpoints and routes say it (`shm`, `tcp`, ...).
    fn name(&self) -> &'static str;
    /// Which peers it can reach.
    fn scope(&self) -> Scope;
    /// Acquires what the link needs locally (a segment, a listening socket, a device context) and
    /// returns what peers need to know about it.
    fn prepare(self: Box<Self>, ctx: &SetupCtx) -> Result<Box<dyn Prepared>, Error>;
}

/// A transport with its local resources, waiting for the peers' endpoints.
pub trait Prepared: Send {
    /// The bytes peers need to reach this rank.
    fn endpoint(&self) -> Vec<u8>;
    /// Connects to the peers routed to this transport (`peers[p]` is `Some` for those; never this
    /// rank), all of which do the same towards this rank before `ctx.deadline`.
    fn connect(
        self: Box<Self>,
        ctx: &SetupCtx,
        peers: &[Option<&Peer>],
    ) -> Result<Box<dyn Connected>, Error>;
}

/// A transport connected to its peers, live once every rank of the communicator has connected.
pub trait Connected: Send {
    /// Called after every rank has connected (a barrier): what only had to exist until then (names in
    /// `/dev/shm`) can go now.
    fn activate(self: Box<Self>) -> Result<Box<dyn Link>, Error>;
}

/// The transports of one rank through the setup stages.
pub struct Setup {
    ctx: SetupCtx,
    prepared: Vec<(&'static str, Scope, Box<dyn Prepared>)>,
    setting: String,
}

impl Setup {
    /// Prepares every transport, in order of preference.
    pub fn prepare(choice: TransportChoice, ctx: SetupCtx) -> Result<Setup, Error> {
        let mut prepared = Vec::with_capacity(choice.transports.len());
        for t in choice.transports {
            let (name, scope) = (t.name(), t.scope());
            prepared.push((name, scope, t.prepare(&ctx)?));
        }
        Ok(Setup {
            ctx,
            prepared,
            setting: choice.setting,
        })
    }

    /// The endpoints to publish, in order of preference.
    pub fn endpoints(&self) -> Vec<Endpoint> {
        self.prepared
            .iter()
            .map(|(name, _, p)| Endpoint {
                transport: name.to_string(),
                blob: p.endpoint(),
            })
            .collect()
    }

    /// Picks a transport for every peer from the bootstrap table (`table[rank]` is this rank) and
    /// connects each transport to its peers. Both ends of a pair pick alike: the first transport in this
    /// rank's order that both published and whose scope covers the pair.
    /// `policy` says how the links wait (it depends on how many ranks share this host, which the table
    /// tells).
    pub fn connect(mut self, table: &[Peer], policy: WaitPolicy) -> Result<Connecting, Error> {
        self.ctx.policy = policy;
        let g = self.ctx.geometry;
        if table.len() != g.world {
            return Err(Error::Bootstrap(format!(
                "the bootstrap table lists {} ranks, the communicator has {}",
                table.len(),
                g.world
            )));
        }
        let routes = choose_routes(g.rank, table, &self.prepared, &self.setting)?;
        let mut connected = Vec::with_capacity(self.prepared.len());
        for (i, (name, _, p)) in self.prepared.into_iter().enumerate() {
            let peers: Vec<Option<&Peer>> = table
                .iter()
                .enumerate()
                .map(|(q, info)| (routes[q] == Some(i)).then_some(info))
                .collect();
            if peers.iter().all(Option::is_none) {
                // Nobody uses it: its resources go when it drops.
                connected.push(None);
                continue;
            }
            connected.push(Some((name, p.connect(&self.ctx, &peers)?)));
        }
        Ok(Connecting {
            geometry: g,
            routes,
            connected,
        })
    }
}

/// Which prepared transport reaches each peer (`None` for this rank).
fn choose_routes(
    rank: usize,
    table: &[Peer],
    prepared: &[(&'static str, Scope, Box<dyn Prepared>)],
    setting: &str,
) -> Result<Vec<Option<usize>>, Error> {
    let me = &table[rank];
    table
        .iter()
        .enumerate()
        .map(|(p, info)| {
            if p == rank {
                return Ok(None);
            }
            let same_host = info.host == me.host;
            let pick = prepared.iter().position(|(name, scope, _)| {
                (*scope == Scope::Network || same_host)
                    && me.endpoint(name).is_some()
                    && info.endpoint(name).is_some()
            });
            match pick {
                Some(i) => Ok(Some(i)),
                None => {
                    let names = |peer: &Peer| {
                        let v: Vec<&str> =
                            peer.endpoints.iter().map(|e| e.transport.as_str()).collect();
                        if v.is_empty() {
                            "none".to_string()
                        } else {
                            v.join(", ")
                        }
                    };
                    let why = if same_host {
                        format!("ranks {rank} and {p} have no transport in common")
                    } else {
                        format!(
                            "rank {p} runs on another host ({}) than rank {rank} ({})",
                            info.host, me.host
                        )
                    };
                    Err(Error::Bootstrap(format!(
                        "{why}: rank {rank} offers {}, rank {p} offers {} (BRAID_TRANSPORT={setting} here; allow a transport that reaches both, such as tcp or auto, on every rank)",
                        names(me),
                        names(info)
                    )))
                }
            }
        })
        .collect()
}

/// Transports connected, waiting for every rank to get here.
pub struct Connecting {
    geometry: Geometry,
    routes: Vec<Option<usize>>,
    connected: Vec<Option<(&'static str, Box<dyn Connected>)>>,
}

impl Connecting {
    /// The transport that reaches each peer (`"self"` for this rank).
    pub fn route_names(&self) -> Vec<&'static str> {
        self.routes
            .iter()
            .map(|r| match r {
                None => "self",
                Some(i) => self.connected[*i].as_ref().map_or("?", |(n, _)| n),
            })
            .collect()
    }

    /// Makes every link live (after every rank has connected) and puts them behind one [`Router`].
    pub fn activate(self) -> Result<Router, Error> {
        let mut links: Vec<Box<dyn Link>> = Vec::new();
        let mut index = vec![usize::MAX; self.connected.len()];
        for (i, c) in self.connected.into_iter().enumerate() {
            if let Some((_, c)) = c {
                index[i] = links.len();
                links.push(c.activate()?);
            }
        }
        let routes = self.routes.iter().map(|r| r.map(|i| index[i])).collect();
        Router::new(self.geometry, links, routes)
    }
}
