//! One rank's links to all of its peers behind one [`Link`]: each peer is reached through exactly one
//! link, picked at setup.

use std::sync::Arc;
use std::time::Instant;

use braid_core::Error;

use crate::link::{misuse, AbortHandle, Event, Link, RecvSlot, SendSlot};
use crate::memory::Span;
use crate::plugin::Geometry;
use crate::WaitCtx;

/// The links of one rank and which peer uses which. It is itself a [`Link`] that forwards each call to
/// the peer's link, so the executor never names a transport.
pub struct Router {
    geometry: Geometry,
    links: Vec<Box<dyn Link>>,
    /// Index into `links` per peer; `None` for this rank.
    routes: Vec<Option<usize>>,
    names: Vec<&'static str>,
}

impl Router {
    /// Puts `links` behind one interface; `routes[p]` is the index of the link that reaches `p`. Every
    /// link must have the geometry's slot size and channels.
    pub fn new(
        geometry: Geometry,
        links: Vec<Box<dyn Link>>,
        routes: Vec<Option<usize>>,
    ) -> Result<Router, Error> {
        if routes.len() != geometry.world {
            return Err(misuse(
                "router",
                format!("{} routes for {} ranks", routes.len(), geometry.world),
            ));
        }
        for (p, r) in routes.iter().enumerate() {
            match r {
                None if p != geometry.rank => {
                    return Err(misuse("router", format!("no link reaches rank {p}")))
                }
                Some(i) if p == geometry.rank || *i >= links.len() => {
                    return Err(misuse("router", format!("a bad route to rank {p}")))
                }
                _ => {}
            }
        }
        for l in &links {
            if l.slot_bytes() != geometry.slot_bytes || l.channels() != geometry.channels {
                return Err(misuse(
                    "router",
                    format!(
                        "the {} link has {} channels of {}-byte slots where {} of {} were agreed",
                        l.name(),
                        l.channels(),
                        l.slot_bytes(),
                        geometry.channels,
                        geometry.slot_bytes
                    ),
                ));
            }
        }
        let names = routes
            .iter()
            .map(|r| r.map_or("self", |i| links[i].name()))
            .collect();
        Ok(Router {
            geometry,
            links,
            routes,
            names,
        })
    }

    /// A router for a communicator of one rank: no links.
    pub fn single(geometry: Geometry) -> Router {
        Router {
            geometry,
            links: Vec::new(),
            routes: vec![None],
            names: vec!["self"],
        }
    }

    /// The router as one [`Link`]: where a single link reaches every peer, that link itself (one
    /// dynamic call less on every operation), else the router.
    pub fn into_link(mut self) -> Box<dyn Link> {
        let me = self.geometry.rank;
        let one = self.links.len() == 1
            && self
                .routes
                .iter()
                .enumerate()
                .all(|(p, r)| p == me || *r == Some(0));
        match (one, self.links.pop()) {
            (true, Some(link)) => link,
            (_, Some(link)) => {
                self.links.push(link);
                Box::new(self)
            }
            (_, None) => Box::new(self),
        }
    }

    /// The agreed geometry.
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// The name of the transport that reaches each rank (`"self"` for this rank), indexed by rank.
    pub fn route_names(&self) -> &[&'static str] {
        &self.names
    }

    #[inline]
    fn to(&self, peer: usize) -> Result<&dyn Link, Error> {
        match self.routes.get(peer) {
            Some(Some(i)) => Ok(&*self.links[*i]),
            _ => Err(misuse(
                "router",
                format!("rank {} has no link to rank {peer}", self.geometry.rank),
            )),
        }
    }
}

/// Aborts every link of a router.
struct AllHandles(Vec<Arc<dyn AbortHandle>>);

impl AbortHandle for AllHandles {
    fn fail_and_wake(&self) {
        for h in &self.0 {
            h.fail_and_wake();
        }
    }
    fn wake_all(&self) {
        for h in &self.0 {
            h.wake_all();
        }
    }
}

impl Link for Router {
    fn name(&self) -> &'static str {
        "router"
    }

    fn slot_bytes(&self) -> usize {
        self.geometry.slot_bytes
    }

    fn channels(&self) -> usize {
        self.geometry.channels
    }

    #[inline]
    fn try_reserve(
        &self,
        peer: usize,
        ch: usize,
        ctx: &WaitCtx<'_>,
    ) -> Result<Option<SendSlot>, Error> {
        self.to(peer)?.try_reserve(peer, ch, ctx)
    }

    #[inline]
    fn post(&self, slot: SendSlot, len: usize, tag: u32, ctx: &WaitCtx<'_>) -> Result<(), Error> {
        self.to(slot.peer)?.post(slot, len, tag, ctx)
    }

    #[inline]
    fn try_recv(
        &self,
        peer: usize,
        ch: usize,
        ctx: &WaitCtx<'_>,
    ) -> Result<Option<RecvSlot>, Error> {
        self.to(peer)?.try_recv(peer, ch, ctx)
    }

    #[inline]
    fn release(&self, slot: RecvSlot) -> Result<(), Error> {
        self.to(slot.peer)?.release(slot)
    }

    fn wait(
        &self,
        peer: usize,
        ch: usize,
        event: Event,
        ctx: &WaitCtx<'_>,
        until: Instant,
    ) -> Result<(), Error> {
        self.to(peer)?.wait(peer, ch, event, ctx, until)
    }

    fn abort_handle(&self) -> Arc<dyn AbortHandle> {
        Arc::new(AllHandles(
            self.links.iter().map(|l| l.abort_handle()).collect(),
        ))
    }

    fn register(&self, span: Span) -> Result<bool, Error> {
        let mut any = false;
        for (i, l) in self.links.iter().enumerate() {
            match l.register(span) {
                Ok(used) => any |= used,
                Err(e) => {
                    // All or nothing: what the others registered goes again.
                    for l in &self.links[..i] {
                        let _ = l.deregister(span);
                    }
                    return Err(e);
                }
            }
        }
        Ok(any)
    }

    fn deregister(&self, span: Span) -> Result<(), Error> {
        let mut first = Ok(());
        for l in &self.links {
            if let Err(e) = l.deregister(span) {
                first = first.and(Err(e));
            }
        }
        first
    }

    #[inline]
    fn post_from(
        &self,
        slot: SendSlot,
        src: Span,
        tag: u32,
        ctx: &WaitCtx<'_>,
    ) -> Result<Option<SendSlot>, Error> {
        self.to(slot.peer)?.post_from(slot, src, tag, ctx)
    }

    fn unsettled(&self, ch: usize) -> Option<usize> {
        self.links.iter().find_map(|l| l.unsettled(ch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemNet;

    #[test]
    fn a_router_of_one_link_that_reaches_everyone_is_that_link() {
        let geometry = Geometry {
            rank: 0,
            world: 3,
            channels: 2,
            slots: 4,
            slot_bytes: 64,
        };
        let net = MemNet::new(3, 2, 4, 64);
        let one = Router::new(
            geometry,
            vec![Box::new(net.link(0))],
            vec![None, Some(0), Some(0)],
        )
        .unwrap();
        assert_eq!(one.into_link().name(), net.link(0).name());
        let two = Router::new(
            geometry,
            vec![Box::new(net.link(0)), Box::new(net.link(0))],
            vec![None, Some(0), Some(1)],
        )
        .unwrap();
        assert_eq!(two.into_link().name(), "router");
    }
}
