//! What a transport implements to plug into the setup stages (see [`setup`](crate::setup), which
//! composes them): the geometry and context every link agrees on, the peers as the bootstrap describes
//! them, and the three stage traits.

use braid_core::Error;
use std::time::Instant;

use crate::link::Link;
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
