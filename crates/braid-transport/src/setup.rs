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
//! the bootstrap's format. The stages' types are in [`plugin`](crate::plugin); [`Setup`] runs the stages for every transport of a rank and decides, the same
//! way on both ends of every pair, which transport reaches which peer.

use braid_core::Error;

use crate::link::Link;
use crate::plugin::{Connected, Endpoint, Geometry, Peer, Prepared, Scope, SetupCtx};
use crate::registry::TransportChoice;
use crate::router::Router;
use crate::WaitPolicy;

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
