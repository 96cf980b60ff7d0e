//! The one primitive: [`Link`].
//!
//! A sender reserves a slot in a ring that the *receiver* owns, writes into it and posts it; the
//! receiver waits for the post, reads the slot in place and releases it, which hands the credit back.
//! Each pair of ranks has several independent rings, one per *channel*, so that operations on different
//! streams never stamp on each other's messages. Per (peer, channel), messages arrive in the order they
//! were posted and are released in the order they were received.
//!
//! The calls never block, except [`Link::wait`] (and [`Link::post`] where a transport must push bytes
//! into the network): a poll-driven executor tries, and waits on the link only when no operation can
//! move. How a link waits is its own business: a futex word in shared memory, a completion queue, a
//! stream's order.
//!
//! A slot is named by a token ([`SendSlot`], [`RecvSlot`]) that only the link can make and that is used
//! up by `post` or `release`, so a slot cannot be posted or released twice. Releasing is explicit: an
//! asynchronous engine may still be reading a slot long after the executor has moved on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use braid_core::Error;

use crate::memory::Span;
use crate::WaitCtx;

/// What [`Link::wait`] waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The next message from the peer on the channel.
    Data,
    /// Room for a message to the peer on the channel.
    Credit,
    /// Every post to the peer on the channel that [`Link::post_from`] made has stopped reading the
    /// caller's memory.
    Sent,
}

impl Event {
    /// How the event reads in a timeout message.
    pub fn describe(self) -> &'static str {
        match self {
            Event::Data => "data",
            Event::Credit => "a free slot",
            Event::Sent => "its sends from the caller's buffer to finish",
        }
    }
}

/// A link's identity, so that a token is only ever accepted by the link that made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkId(u64);

impl LinkId {
    /// A fresh identity.
    pub fn new() -> LinkId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        LinkId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl Default for LinkId {
    fn default() -> Self {
        LinkId::new()
    }
}

/// A reserved slot in a peer's ring: write up to [`SendSlot::span`]'s length, then [`Link::post`] it.
#[derive(Debug)]
#[must_use = "a reserved slot must be posted"]
pub struct SendSlot {
    pub(crate) link: LinkId,
    pub(crate) peer: usize,
    pub(crate) ch: usize,
    pub(crate) msg: u32,
    pub(crate) span: Span,
}

impl SendSlot {
    /// Makes a token (for link implementations).
    ///
    /// # Safety
    /// `span` must be the slot's memory, exclusively the holder's to write until the token is posted, and
    /// valid while the link lives.
    pub unsafe fn new(link: LinkId, peer: usize, ch: usize, msg: u32, span: Span) -> SendSlot {
        SendSlot {
            link,
            peer,
            ch,
            msg,
            span,
        }
    }

    /// The slot's memory (its length is the slot size). Valid until the token is posted and while the
    /// link lives.
    pub fn span(&self) -> Span {
        self.span
    }

    /// The peer the slot belongs to.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// The channel.
    pub fn channel(&self) -> usize {
        self.ch
    }

    /// The message's number on its (peer, channel), wrapping.
    pub fn msg(&self) -> u32 {
        self.msg
    }

    /// The link that made the token.
    pub fn link(&self) -> LinkId {
        self.link
    }
}

/// A received message, in place: read [`RecvSlot::span`], then [`Link::release`] it.
#[derive(Debug)]
#[must_use = "a received slot must be released"]
pub struct RecvSlot {
    pub(crate) link: LinkId,
    pub(crate) peer: usize,
    pub(crate) ch: usize,
    pub(crate) msg: u32,
    pub(crate) tag: u32,
    pub(crate) span: Span,
}

impl RecvSlot {
    /// Makes a token (for link implementations).
    ///
    /// # Safety
    /// `span` must be the message's bytes (already validated against the slot size), unchanged by the
    /// sender until the token is released, and valid while the link lives.
    pub unsafe fn new(
        link: LinkId,
        peer: usize,
        ch: usize,
        msg: u32,
        tag: u32,
        span: Span,
    ) -> RecvSlot {
        RecvSlot {
            link,
            peer,
            ch,
            msg,
            tag,
            span,
        }
    }

    /// The message's bytes. Valid until the token is released and while the link lives.
    pub fn span(&self) -> Span {
        self.span
    }

    /// The message's length.
    pub fn len(&self) -> usize {
        self.span.len()
    }

    /// Whether the message is empty (a pure signal).
    pub fn is_empty(&self) -> bool {
        self.span.is_empty()
    }

    /// The tag its sender posted it with (the operation's sequence number).
    pub fn tag(&self) -> u32 {
        self.tag
    }

    /// The sending peer.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// The channel.
    pub fn channel(&self) -> usize {
        self.ch
    }

    /// The message's number on its (peer, channel), wrapping.
    pub fn msg(&self) -> u32 {
        self.msg
    }

    /// The link that made the token.
    pub fn link(&self) -> LinkId {
        self.link
    }

    /// The payload for reading on the host, if the message is in host memory.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        // SAFETY: the token is outstanding (it is consumed by `release`), so the sender leaves the bytes
        // alone; the link that made it lives as long as its tokens are used (a link outlives the
        // operations that hold its tokens); the slice borrows the token, so it cannot outlive the release.
        self.span
            .host_ptr()
            .map(|_| unsafe { self.span.as_slice() })
    }
}

/// Wakes or fails a link from another thread (abort).
pub trait AbortHandle: Send + Sync {
    /// Marks this rank failed to the peers of the link and wakes every wait on it, here and there.
    fn fail_and_wake(&self);
    /// Wakes every wait on the link without marking anything.
    fn wake_all(&self) {}
}

/// One rank's connection to some of its peers through one transport.
///
/// Used by one thread at a time (`Send`, not `Sync`); [`Link::abort_handle`] gives other threads what
/// they may do. Every method that can fail names the peer, the collective and its sequence number from
/// the [`WaitCtx`].
pub trait Link: Send {
    /// The transport's short name (`shm`, `tcp`, `mem`, ...).
    fn name(&self) -> &'static str;

    /// Payload capacity of one slot.
    fn slot_bytes(&self) -> usize;

    /// Independent channels per peer.
    fn channels(&self) -> usize;

    /// Reserves the next slot to `peer` on channel `ch`, or `None` if the peer's ring has no credit.
    fn try_reserve(
        &self,
        peer: usize,
        ch: usize,
        ctx: &WaitCtx<'_>,
    ) -> Result<Option<SendSlot>, Error>;

    /// Publishes the first `len` bytes of a reserved slot, stamped with `tag`. Slots of one (peer,
    /// channel) are posted in the order they were reserved. Over a network this sends, which can fail or
    /// take until the network accepts the bytes.
    fn post(&self, slot: SendSlot, len: usize, tag: u32, ctx: &WaitCtx<'_>) -> Result<(), Error>;

    /// The next message from `peer` on channel `ch`, or `None` if it has not arrived.
    fn try_recv(
        &self,
        peer: usize,
        ch: usize,
        ctx: &WaitCtx<'_>,
    ) -> Result<Option<RecvSlot>, Error>;

    /// Hands a received slot back to its sender. Slots of one (peer, channel) are released in the order
    /// they were received.
    fn release(&self, slot: RecvSlot) -> Result<(), Error>;

    /// Waits until `event` may have happened for (`peer`, `ch`), or until `until`: spins, then sleeps in
    /// whatever way the transport wakes fastest. Returns `Ok` when the caller should try again, an error
    /// when the peer failed, the operation was aborted or `ctx.deadline` passed.
    fn wait(
        &self,
        peer: usize,
        ch: usize,
        event: Event,
        ctx: &WaitCtx<'_>,
        until: Instant,
    ) -> Result<(), Error>;

    /// What other threads may do to this link.
    fn abort_handle(&self) -> Arc<dyn AbortHandle>;

    /// Registers caller memory so that [`Link::post_from`] can send from it without a copy; returns
    /// whether this link will. The memory must stay mapped until [`Link::deregister`]. Links that copy
    /// anyway keep nothing and return `false`.
    fn register(&self, span: Span) -> Result<bool, Error> {
        let _ = span;
        Ok(false)
    }

    /// Forgets a registration made by [`Link::register`] with the same span, once no post reads it.
    fn deregister(&self, span: Span) -> Result<(), Error> {
        let _ = span;
        Ok(())
    }

    /// Posts a reserved slot whose payload is `src` itself, without copying it into the slot, where
    /// this link can (`src` inside registered memory): `Ok(None)`. Otherwise `Ok(Some(slot))` hands the
    /// token back, and the caller writes the slot and posts it as usual. After `Ok(None)` the caller
    /// leaves `src` unchanged until [`Link::unsettled`] no longer names the peer on the channel.
    fn post_from(
        &self,
        slot: SendSlot,
        src: Span,
        tag: u32,
        ctx: &WaitCtx<'_>,
    ) -> Result<Option<SendSlot>, Error> {
        let _ = (src, tag, ctx);
        Ok(Some(slot))
    }

    /// A peer that a [`Link::post_from`] on channel `ch` still reads the caller's memory for, if any
    /// (wait for it with [`Event::Sent`]).
    fn unsettled(&self, ch: usize) -> Option<usize> {
        let _ = ch;
        None
    }
}

/// An error for a token used on a link that did not make it, or out of order.
pub(crate) fn misuse(link: &str, what: String) -> Error {
    Error::Internal(format!("{link} link: {what}"))
}

/// Checks that `slot` is this link's and the one due: `msg == due`. Inlined: on every post and
/// release, where the check is two comparisons and the message is built only when it fails.
#[inline]
pub(crate) fn check_token(
    name: &str,
    id: LinkId,
    token: LinkId,
    msg: u32,
    due: u32,
    what: &str,
) -> Result<(), Error> {
    if token == id && msg == due {
        return Ok(());
    }
    token_error(name, id, token, msg, due, what)
}

#[cold]
#[inline(never)]
fn token_error(
    name: &str,
    id: LinkId,
    token: LinkId,
    msg: u32,
    due: u32,
    what: &str,
) -> Result<(), Error> {
    if token != id {
        return Err(misuse(name, format!("{what} of another link's slot")));
    }
    if msg != due {
        return Err(misuse(
            name,
            format!("{what} of message #{msg} where #{due} is due (out of order)"),
        ));
    }
    Ok(())
}

/// Sends `data` to `peer` on channel `ch` as one message, waiting for credit (setup and probing; the
/// executor drives links itself).
pub fn send_bytes(
    link: &dyn Link,
    peer: usize,
    ch: usize,
    data: &[u8],
    tag: u32,
    ctx: &WaitCtx<'_>,
) -> Result<(), Error> {
    let slot = loop {
        if let Some(s) = link.try_reserve(peer, ch, ctx)? {
            break s;
        }
        link.wait(peer, ch, Event::Credit, ctx, ctx.deadline)?;
    };
    let span = slot.span();
    if data.len() > span.len() {
        return Err(Error::invalid(format!(
            "a message of {} bytes does not fit a slot of {}",
            data.len(),
            span.len()
        )));
    }
    let Some(ptr) = span.host_ptr() else {
        return Err(misuse(
            link.name(),
            "a host message in device memory".into(),
        ));
    };
    // SAFETY: the reserved slot is ours to write until posted, valid for `span.len() >= data.len()`
    // bytes while `link` (borrowed for this call) lives.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, data.len()) };
    link.post(slot, data.len(), tag, ctx)
}

/// Receives the next message from `peer` on channel `ch`, hands its bytes to `f` and releases it.
pub fn recv_with<R>(
    link: &dyn Link,
    peer: usize,
    ch: usize,
    ctx: &WaitCtx<'_>,
    f: impl FnOnce(&[u8], u32) -> R,
) -> Result<R, Error> {
    let slot = loop {
        if let Some(s) = link.try_recv(peer, ch, ctx)? {
            break s;
        }
        link.wait(peer, ch, Event::Data, ctx, ctx.deadline)?;
    };
    let r = match slot.host_bytes() {
        Some(b) => Ok(f(b, slot.tag())),
        None => Err(misuse(
            link.name(),
            "a host message in device memory".into(),
        )),
    };
    link.release(slot)?;
    r
}
