//! One rank's transport to all of its peers: shared memory to those on its host, TCP to the rest.
//! The executor sees a single primitive whichever way a peer is reached.

use braid_core::Error;

use crate::shm::{self, Mappings, ShmTransport};
use crate::tcp::{TcpHandle, TcpRecvSlot, TcpSendSlot, TcpTransport};
use crate::WaitCtx;

/// How a peer is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// This rank itself.
    Local,
    /// Shared memory (same host).
    Shm,
    /// TCP.
    Tcp,
}

impl Route {
    /// Short name for logs and tables.
    pub fn name(self) -> &'static str {
        match self {
            Route::Local => "self",
            Route::Shm => "shm",
            Route::Tcp => "tcp",
        }
    }
}

/// The transports of one rank and which peer uses which.
pub struct Transport {
    routes: Vec<Route>,
    shm: Option<ShmTransport>,
    tcp: Option<TcpTransport>,
    slot_bytes: usize,
}

/// Wakes or fails a [`Transport`] from another thread (abort).
#[derive(Clone)]
pub struct Handle {
    shm: Option<std::sync::Arc<Mappings>>,
    tcp: Option<TcpHandle>,
}

impl Handle {
    /// Marks this rank failed to its peers and wakes every wait.
    pub fn fail_and_wake(&self) {
        if let Some(m) = &self.shm {
            m.fail_and_wake();
        }
        if let Some(t) = &self.tcp {
            t.fail_and_wake();
        }
    }

    /// Wakes every wait on shared memory without marking anything (a TCP wait wakes within 5 ms).
    pub fn wake_all(&self) {
        if let Some(m) = &self.shm {
            m.wake_all();
        }
    }
}

impl Transport {
    /// Combines the transports; `routes[p]` says how peer `p` is reached and must match what each
    /// transport was built for. Both must use the same slot size.
    pub fn new(
        routes: Vec<Route>,
        shm: Option<ShmTransport>,
        tcp: Option<TcpTransport>,
    ) -> Transport {
        assert_eq!(
            routes.contains(&Route::Shm),
            shm.is_some(),
            "shm routes without shm transport"
        );
        assert_eq!(
            routes.contains(&Route::Tcp),
            tcp.is_some(),
            "tcp routes without tcp transport"
        );
        let slot_bytes = match (&shm, &tcp) {
            (Some(s), Some(t)) => {
                assert_eq!(
                    s.slot_bytes(),
                    t.slot_bytes(),
                    "transports disagree on the slot size"
                );
                s.slot_bytes()
            }
            (Some(s), None) => s.slot_bytes(),
            (None, Some(t)) => t.slot_bytes(),
            (None, None) => usize::MAX,
        };
        Transport {
            routes,
            shm,
            tcp,
            slot_bytes,
        }
    }

    /// How each peer is reached, indexed by rank.
    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// The handle for other threads.
    pub fn handle(&self) -> Handle {
        Handle {
            shm: self.shm.as_ref().map(ShmTransport::mappings),
            tcp: self.tcp.as_ref().map(TcpTransport::handle),
        }
    }

    /// Payload capacity of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Stamps `tag` on every message from now on.
    pub fn set_tag(&self, tag: u32) {
        if let Some(s) = &self.shm {
            s.set_tag(tag);
        }
        if let Some(t) = &self.tcp {
            t.set_tag(tag);
        }
    }

    /// Waits for room for a message to `to` and hands out where to write it.
    pub fn send_slot(&self, to: usize, ctx: &WaitCtx<'_>) -> Result<SendSlot<'_>, Error> {
        match self.routes[to] {
            Route::Shm => Ok(SendSlot::Shm(
                self.shm.as_ref().expect("shm").send_slot(to, ctx)?,
            )),
            Route::Tcp => Ok(SendSlot::Tcp(self.tcp.as_ref().expect("tcp").send_slot(to))),
            Route::Local => panic!("rank {to} sending to itself"),
        }
    }

    /// Waits for the next message from `from`.
    pub fn recv(&self, from: usize, ctx: &WaitCtx<'_>) -> Result<RecvSlot<'_>, Error> {
        match self.routes[from] {
            Route::Shm => Ok(RecvSlot::Shm(
                self.shm.as_ref().expect("shm").recv(from, ctx)?,
            )),
            Route::Tcp => Ok(RecvSlot::Tcp(
                self.tcp.as_ref().expect("tcp").recv(from, ctx)?,
            )),
            Route::Local => panic!("rank {from} receiving from itself"),
        }
    }
}

/// Where a message to one peer is written before it is posted.
pub enum SendSlot<'a> {
    /// A slot in the peer's shared segment.
    Shm(shm::SendSlot<'a>),
    /// A staging buffer sent on post.
    Tcp(TcpSendSlot<'a>),
}

impl SendSlot<'_> {
    /// The payload area.
    pub fn data(&mut self) -> &mut [u8] {
        match self {
            SendSlot::Shm(s) => s.data(),
            SendSlot::Tcp(s) => s.data(),
        }
    }

    /// Publishes the first `len` bytes (over TCP: sends them, which can fail).
    pub fn post(self, len: usize, ctx: &WaitCtx<'_>) -> Result<(), Error> {
        match self {
            SendSlot::Shm(s) => {
                s.post(len);
                Ok(())
            }
            SendSlot::Tcp(s) => s.post(len, ctx),
        }
    }
}

/// A received message, read in place; dropping it returns the slot.
pub enum RecvSlot<'a> {
    /// From shared memory.
    Shm(shm::RecvSlot<'a>),
    /// From TCP.
    Tcp(TcpRecvSlot<'a>),
}

impl RecvSlot<'_> {
    /// The payload.
    pub fn data(&self) -> &[u8] {
        match self {
            RecvSlot::Shm(s) => s.data(),
            RecvSlot::Tcp(s) => s.data(),
        }
    }
}
