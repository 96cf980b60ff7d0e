//! Setting the shared-memory link up: [`Shm`], the typed stages of [`crate::setup`] (a segment
//! created, then every peer's mapped, then the names removed).

use std::path::{Path, PathBuf};

use braid_core::Error;

use super::layout::Layout;
use super::link::ShmLink;
use super::segment::{sweep_stale, Segment};
use crate::link::Link;
use crate::plugin::{Connected, Peer, Prepared, Scope, SetupCtx, Transport};
use crate::wait::WaitPolicy;

/// Shared memory between the ranks of one host: the [`Transport`] that makes [`ShmLink`]s.
pub struct Shm {
    dir: PathBuf,
}

impl Shm {
    /// Segments go in `dir` (normally `/dev/shm`).
    pub fn new(dir: impl Into<PathBuf>) -> Shm {
        Shm { dir: dir.into() }
    }
}

impl Transport for Shm {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn scope(&self) -> Scope {
        Scope::Host
    }

    fn prepare(self: Box<Self>, ctx: &SetupCtx) -> Result<Box<dyn Prepared>, Error> {
        sweep_stale(&self.dir);
        let nonce = ctx.nonce;
        let name = format!("braid-{nonce:016x}-r{}", ctx.geometry.rank);
        let g = ctx.geometry;
        let layout = Layout {
            world: g.world,
            channels: g.channels,
            slots: g.slots,
            slot_bytes: g.slot_bytes,
            device: false,
        };
        let own = Segment::create(&self.dir.join(name), layout, g.rank)?;
        Ok(Box::new(ShmPrepared { own, layout }))
    }
}

/// A segment created and not yet mapped by peers.
struct ShmPrepared {
    own: Segment,
    layout: Layout,
}

impl Prepared for ShmPrepared {
    fn endpoint(&self) -> Vec<u8> {
        self.own.path().as_os_str().as_encoded_bytes().to_vec()
    }

    fn connect(
        self: Box<Self>,
        ctx: &SetupCtx,
        peers: &[Option<&Peer>],
    ) -> Result<Box<dyn Connected>, Error> {
        let mut maps = Vec::with_capacity(peers.len());
        for (p, peer) in peers.iter().enumerate() {
            let Some(peer) = peer else {
                maps.push(None);
                continue;
            };
            let blob = peer.endpoint("shm").unwrap_or_default();
            let path = std::str::from_utf8(blob).map_err(|_| {
                Error::Bootstrap(format!(
                    "rank {p} published a segment path that is not UTF-8"
                ))
            })?;
            maps.push(Some(Segment::open(Path::new(path), self.layout, p)?));
        }
        Ok(Box::new(ShmConnected {
            own: self.own,
            peers: maps,
            policy: ctx.policy,
        }))
    }
}

/// Segments mapped both ways; the names go once every rank has mapped every segment.
struct ShmConnected {
    own: Segment,
    peers: Vec<Option<Segment>>,
    policy: WaitPolicy,
}

impl Connected for ShmConnected {
    fn activate(self: Box<Self>) -> Result<Box<dyn Link>, Error> {
        self.own.unlink()?;
        Ok(Box::new(ShmLink::new(self.own, self.peers, self.policy)))
    }
}
