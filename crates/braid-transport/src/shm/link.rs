//! [`ShmLink`]: the [`Link`] over mapped segments (see the module above for the protocol), its rings,
//! the [`Mappings`] that an abort wakes, and the [`DevicePlane`] of an `ipc` link.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;

use braid_core::Error;

use super::layout::{
    Layout, CTRL, C_CONSUMED, C_RECV_WAITING, C_SEND_WAITING, H_FAILED, H_WAITING_ON, SLOT_HDR,
    S_LEN, S_SEQ, S_TAG,
};
use super::protocol;
use super::segment::Segment;
use crate::device::DeviceAllocation;
use crate::link::{check_token, misuse, AbortHandle, Event, Link, LinkId, RecvSlot, SendSlot};
use crate::memory::Span;
use crate::wait::{
    futex_wake, peer_alive, peer_stopped, wait_until, PeerProcess, WaitCtx, WaitPolicy,
};

/// The mappings of a link, shareable with other threads so that `abort` can wake a blocked wait.
pub struct Mappings {
    rank: usize,
    own: Segment,
    peers: Vec<Option<Segment>>,
}

impl AbortHandle for Mappings {
    fn fail_and_wake(&self) {
        self.own.word(H_FAILED).store(1, Ordering::Release);
        self.wake_all();
    }

    fn wake_all(&self) {
        let l = self.own.layout;
        for (p, peer) in self.peers.iter().enumerate() {
            if let Some(peer) = peer {
                for ch in 0..l.channels {
                    for i in 0..l.slots {
                        futex_wake(self.own.slot_seq(p, ch, i));
                        futex_wake(peer.slot_seq(self.rank, ch, i));
                    }
                    futex_wake(self.own.ctrl(p, ch, C_CONSUMED));
                    futex_wake(peer.ctrl(self.rank, ch, C_CONSUMED));
                }
            }
        }
    }
}

#[cold]
fn no_ring(peer: usize, ch: usize) -> Error {
    misuse("shm", format!("no ring to rank {peer} on channel {ch}"))
}

/// Per (peer, channel) counters of this rank, all wrapping, and where the two rings of that pair
/// lie, so that a post or a receive finds its slot with one multiply and no bounds arithmetic.
#[derive(Default)]
struct Ring {
    /// Address of the outbound ring's channel block (control words, then slots) in the peer's
    /// segment; 0 for a peer without one (reached over another transport, or this rank).
    tx: usize,
    /// Address of the inbound ring's channel block in this rank's own segment (0 as above).
    rx: usize,
    /// This rank's side of the outbound ring.
    send: protocol::Sender,
    /// This rank's side of the inbound ring.
    recv: protocol::Receiver,
}

/// The accessors below are for a ring of a peer with a segment (`tx` and `rx` set), the only kind
/// [`ShmLink::ring`] hands out; `index` is below the slot count and `stride` the layout's slot stride.
impl Ring {
    /// The address of `seg`'s channel block `ch` from rank `from`, checked once here to lie within
    /// the mapping.
    fn block(seg: &Segment, from: usize, ch: usize) -> usize {
        let off = seg.layout.channel(from, ch);
        assert!(off + seg.layout.channel_stride() <= seg.map.len());
        seg.map.as_mut_ptr() as usize + off
    }

    /// Header of outbound slot `index` (in the peer's segment).
    #[inline]
    fn tx_slot(&self, stride: usize, index: usize) -> *mut u8 {
        debug_assert!(self.tx != 0, "a ring without a segment");
        (self.tx + CTRL + index * stride) as *mut u8
    }

    /// Header of inbound slot `index` (in this rank's segment).
    #[inline]
    fn rx_slot(&self, stride: usize, index: usize) -> *mut u8 {
        debug_assert!(self.rx != 0, "a ring without a segment");
        (self.rx + CTRL + index * stride) as *mut u8
    }

    /// Control word `field` (a `C_*` offset) of the outbound block.
    #[inline]
    fn tx_ctrl(&self, field: usize) -> &AtomicU32 {
        debug_assert!(self.tx != 0 && field < CTRL, "a ring without a segment");
        // SAFETY: as in `seq`.
        unsafe { atomic_at(self.tx + field) }
    }

    /// Control word `field` of the inbound block.
    #[inline]
    fn rx_ctrl(&self, field: usize) -> &AtomicU32 {
        debug_assert!(self.rx != 0 && field < CTRL, "a ring without a segment");
        // SAFETY: as in `seq`.
        unsafe { atomic_at(self.rx + field) }
    }

    /// The sequence word of the slot whose header is `hdr` (from `tx_slot` or `rx_slot`).
    #[inline]
    fn seq(&self, hdr: *mut u8) -> &AtomicU32 {
        // SAFETY: slot headers and control words lie in a channel block checked within its mapping by
        // `Ring::block`, at 4-aligned offsets (fields and strides are multiples of 4, mappings are
        // page-aligned); the link owns the mappings, so they outlive its rings.
        unsafe { atomic_at(hdr as usize + S_SEQ) }
    }
}

/// The shared 32-bit word at `addr`; cross-process access to these words is atomic.
///
/// # Safety
/// `addr` is 4-aligned and lies within a mapping that outlives `'a`.
#[inline]
unsafe fn atomic_at<'a>(addr: usize) -> &'a AtomicU32 {
    // SAFETY: the caller's contract.
    unsafe { &*(addr as *const AtomicU32) }
}

/// Where the payloads of an `ipc` link live: this rank's inbound rings and its peers', mapped.
pub struct DevicePlane {
    /// The device of every allocation here.
    pub ordinal: u32,
    /// This rank's inbound payload rings.
    pub own: Box<dyn DeviceAllocation>,
    /// Each peer's inbound payload rings, mapped here (`None` for this rank and peers reached otherwise).
    pub peers: Vec<Option<Box<dyn DeviceAllocation>>>,
}

/// The shared-memory link of one rank: its own inbound segment and its peers', plus the local counters.
pub struct ShmLink {
    id: LinkId,
    /// Device payloads (the `ipc` transport), or `None` for payloads in the segments.
    plane: Option<DevicePlane>,
    maps: Arc<Mappings>,
    layout: Layout,
    policy: WaitPolicy,
    rings: Vec<Ring>,
    /// Each peer's process (by pidfd, opened while the peers are known to run: at connection).
    procs: Vec<Option<PeerProcess>>,
    /// Whether this rank has published a wait in its header.
    blocked: Cell<bool>,
    /// `slots - 1` where the slot count is a power of two (the default 8): a message's slot is then
    /// its counter masked, not divided (a division is tens of cycles on every post and receive).
    slot_mask: Option<u32>,
    /// Bytes from one slot's header to the next.
    stride: usize,
}

impl ShmLink {
    /// Builds the link from this rank's own segment and the mapped segments of its peers (`peers[rank]`
    /// must be `None`; so is every peer reached otherwise).
    pub fn new(own: Segment, peers: Vec<Option<Segment>>, policy: WaitPolicy) -> ShmLink {
        ShmLink::build(own, peers, policy, None)
    }

    /// As [`ShmLink::new`], with the payloads in device memory (segments made with `layout.device`;
    /// `plane.peers[p]` mapped for every peer `peers[p]` is for).
    pub fn with_device(
        own: Segment,
        peers: Vec<Option<Segment>>,
        policy: WaitPolicy,
        plane: DevicePlane,
    ) -> ShmLink {
        ShmLink::build(own, peers, policy, Some(plane))
    }

    fn build(
        own: Segment,
        peers: Vec<Option<Segment>>,
        policy: WaitPolicy,
        plane: Option<DevicePlane>,
    ) -> ShmLink {
        let layout = own.layout;
        let rank = own.owner;
        debug_assert_eq!(peers.len(), layout.world);
        debug_assert!(peers[rank].is_none());
        let procs = peers
            .iter()
            .map(|p| p.as_ref().map(|seg| PeerProcess::open(seg.pid())))
            .collect();
        ShmLink {
            id: LinkId::new(),
            plane,
            procs,
            layout,
            policy,
            rings: (0..layout.world * layout.channels)
                .map(|i| {
                    let (p, ch) = (i / layout.channels, i % layout.channels);
                    match &peers[p] {
                        Some(seg) => Ring {
                            tx: Ring::block(seg, rank, ch),
                            rx: Ring::block(&own, p, ch),
                            ..Ring::default()
                        },
                        None => Ring::default(),
                    }
                })
                .collect(),
            stride: layout.slot_stride(),
            blocked: Cell::new(false),
            slot_mask: layout
                .slots
                .is_power_of_two()
                .then(|| layout.slots as u32 - 1),
            maps: Arc::new(Mappings { rank, own, peers }),
        }
    }

    /// The slot of message counter `m`: `m` modulo the slot count. A count that is not a power of two
    /// (the runtime refuses one; tests use 3) does not divide 2^32, so its slots stay paired only
    /// until the counter wraps.
    #[inline]
    fn index(&self, m: u32) -> usize {
        match self.slot_mask {
            Some(mask) => (m & mask) as usize,
            None => (m % self.layout.slots as u32) as usize,
        }
    }

    /// The ring to or from `peer` on channel `ch`, and the peer's segment.
    #[inline]
    fn ring(&self, peer: usize, ch: usize) -> Result<(&Ring, &Segment), Error> {
        let ring = (ch < self.layout.channels)
            .then(|| self.rings.get(peer * self.layout.channels + ch))
            .flatten();
        match (self.peer(peer), ring) {
            (Some(seg), Some(ring)) => Ok((ring, seg)),
            _ => Err(no_ring(peer, ch)),
        }
    }

    fn peer(&self, p: usize) -> Option<&Segment> {
        self.maps.peers.get(p).and_then(Option::as_ref)
    }

    /// Called between sleeps of a blocked wait: publishes whom we wait for, and checks that peer.
    fn check_peer(&self, ctx: &WaitCtx<'_>, p: usize, seg: &Segment) -> Result<(), Error> {
        if !self.blocked.get() {
            self.blocked.set(true);
            self.maps
                .own
                .word(H_WAITING_ON)
                .store(p as u32 + 1, Ordering::Release);
        }
        if seg.failed() {
            return Err(ctx.peer_failed(p, "failed or aborted"));
        }
        if !self
            .procs
            .get(p)
            .and_then(Option::as_ref)
            .map_or_else(|| peer_alive(seg.pid()), PeerProcess::alive)
        {
            return Err(ctx.peer_failed(p, format!("died (pid {} is gone)", seg.pid())));
        }
        Ok(())
    }

    /// Ends a wait: clears the published wait, and turns a timeout into one that names the rank at the
    /// end of the chain of waits (the one that is silent), not merely the neighbour we waited for.
    fn end_wait(&self, r: Result<(), Error>) -> Result<(), Error> {
        if self.blocked.get() {
            self.blocked.set(false);
            self.maps.own.word(H_WAITING_ON).store(0, Ordering::Release);
        }
        match r {
            Err(Error::Timeout {
                rank,
                peer,
                collective,
                seq,
                waited_ms,
                what,
            }) => {
                let mut chain = vec![peer];
                let mut cur = peer;
                loop {
                    let seg = if cur == self.maps.rank {
                        &self.maps.own
                    } else {
                        // A peer reached over another transport publishes nothing here.
                        match self.peer(cur) {
                            Some(seg) => seg,
                            None => break,
                        }
                    };
                    // A stopped process is the silent one, whatever wait it had published.
                    if cur != self.maps.rank && peer_stopped(seg.pid()) {
                        break;
                    }
                    let w = seg.word(H_WAITING_ON).load(Ordering::Acquire) as usize;
                    if w == 0
                        || w > self.layout.world
                        || chain.contains(&(w - 1))
                        || w - 1 == self.maps.rank
                    {
                        break;
                    }
                    cur = w - 1;
                    chain.push(cur);
                }
                let culprit = cur;
                let what = if chain.len() > 1 {
                    let path: Vec<String> = chain.iter().map(|r| r.to_string()).collect();
                    format!(
                        "{what}; rank {} is itself waiting: chain of waits {}",
                        peer,
                        path.join(" → ")
                    )
                } else {
                    what
                };
                Err(Error::Timeout {
                    rank,
                    peer: culprit,
                    collective,
                    seq,
                    waited_ms,
                    what,
                })
            }
            other => other,
        }
    }

    fn has_credit(&self, ring: &Ring) -> bool {
        ring.send
            .has_credit(ring.tx_ctrl(C_CONSUMED), self.layout.slots as u32)
    }
}

impl ShmLink {
    /// The device span of `len` bytes at `offset` of `alloc`.
    ///
    /// # Safety
    /// The caller owns that range of the allocation under the slot protocol while the span is used.
    unsafe fn device_span(
        &self,
        alloc: Option<&dyn DeviceAllocation>,
        ordinal: u32,
        offset: usize,
        len: usize,
    ) -> Result<Span, Error> {
        match alloc {
            Some(a) if offset + len <= a.len() => {
                // SAFETY: in bounds of the mapped allocation; the caller's contract for its use.
                Ok(unsafe { Span::device(a.addr() + offset as u64, len, ordinal) })
            }
            _ => Err(misuse(
                "ipc",
                format!("no device ring holds {len} bytes at offset {offset}"),
            )),
        }
    }
}

impl Link for ShmLink {
    fn name(&self) -> &'static str {
        if self.plane.is_some() {
            "ipc"
        } else {
            "shm"
        }
    }

    fn slot_bytes(&self) -> usize {
        self.layout.slot_bytes
    }

    fn channels(&self) -> usize {
        self.layout.channels
    }

    fn try_reserve(
        &self,
        peer: usize,
        ch: usize,
        _ctx: &WaitCtx<'_>,
    ) -> Result<Option<SendSlot>, Error> {
        let (ring, _) = self.ring(peer, ch)?;
        if !self.has_credit(ring) {
            return Ok(None);
        }
        let s = ring.send.reserve();
        let index = self.index(s);
        let ptr = ring.tx_slot(self.stride, index);
        // SAFETY: the slot is ours until posted: the receiver has released it (credit checked above) and
        // will not touch it before its sequence word moves past it; `reserved` hands it out once. The
        // payload lies within the mapping (of the segment, or of the peer's device rings, checked by
        // `device_span`), which lives as long as the link.
        let slot = unsafe {
            let span = match &self.plane {
                None => Span::host(ptr.add(SLOT_HDR), self.layout.slot_bytes),
                Some(plane) => self.device_span(
                    plane.peers.get(peer).and_then(|a| a.as_deref()),
                    plane.ordinal,
                    self.layout.device_slot(self.maps.rank, ch, index),
                    self.layout.slot_bytes,
                )?,
            };
            SendSlot::new(self.id, peer, ch, s, span)
        };
        Ok(Some(slot))
    }

    fn post(&self, slot: SendSlot, len: usize, tag: u32, _ctx: &WaitCtx<'_>) -> Result<(), Error> {
        let (ring, _) = self.ring(slot.peer, slot.ch)?;
        check_token(
            "shm",
            self.id,
            slot.link,
            slot.msg,
            ring.send.next_post(),
            "post",
        )?;
        if len > self.layout.slot_bytes {
            return Err(misuse(
                "shm",
                format!(
                    "posting {len} bytes into a slot of {}",
                    self.layout.slot_bytes
                ),
            ));
        }
        let s = slot.msg;
        let hdr = ring.tx_slot(self.stride, self.index(s));
        // SAFETY: `hdr` points at this slot's header, which we own until the store below.
        unsafe {
            hdr.add(S_LEN).cast::<u32>().write_volatile(len as u32);
            hdr.add(S_TAG).cast::<u32>().write_volatile(tag);
        }
        ring.send
            .post(s, ring.seq(hdr), ring.tx_ctrl(C_RECV_WAITING));
        Ok(())
    }

    fn try_recv(
        &self,
        peer: usize,
        ch: usize,
        ctx: &WaitCtx<'_>,
    ) -> Result<Option<RecvSlot>, Error> {
        let (ring, _) = self.ring(peer, ch)?;
        let r = ring.recv.next();
        let index = self.index(r);
        let ptr = ring.rx_slot(self.stride, index);
        if !ring.recv.is_posted(ring.seq(ptr)) {
            return Ok(None);
        }
        // SAFETY: the slot header is within the mapping; the sender wrote it before the Release store of
        // the sequence word that the Acquire load above observed.
        let (len, tag) = unsafe {
            (
                ptr.add(S_LEN).cast::<u32>().read_volatile(),
                ptr.add(S_TAG).cast::<u32>().read_volatile(),
            )
        };
        if len as usize > self.layout.slot_bytes {
            return Err(Error::Mismatch {
                rank: self.maps.rank,
                peer,
                collective: ctx.collective.to_string(),
                seq: ctx.seq,
                detail: format!(
                    "message of {len} bytes exceeds the slot size {}",
                    self.layout.slot_bytes
                ),
            });
        }
        // SAFETY: `len` was checked against the slot size; the sender will not write this slot again
        // until we return the credit in `release`; the mapping lives as long as the link.
        let span = unsafe {
            match &self.plane {
                None => Span::host(ptr.add(SLOT_HDR), len as usize),
                Some(plane) => self.device_span(
                    Some(&*plane.own),
                    plane.ordinal,
                    self.layout.device_slot(peer, ch, index),
                    len as usize,
                )?,
            }
        };
        ring.recv.take();
        // SAFETY: as above.
        let slot = unsafe { RecvSlot::new(self.id, peer, ch, r, tag, span) };
        Ok(Some(slot))
    }

    fn release(&self, slot: RecvSlot) -> Result<(), Error> {
        let (ring, _) = self.ring(slot.peer, slot.ch)?;
        check_token(
            "shm",
            self.id,
            slot.link,
            slot.msg,
            ring.recv.next_release(),
            "release",
        )?;
        ring.recv.release(
            slot.msg,
            ring.rx_ctrl(C_CONSUMED),
            ring.rx_ctrl(C_SEND_WAITING),
        );
        Ok(())
    }

    fn wait(
        &self,
        peer: usize,
        ch: usize,
        event: Event,
        ctx: &WaitCtx<'_>,
        until: Instant,
    ) -> Result<(), Error> {
        let (ring, seg) = self.ring(peer, ch)?;
        let r = match event {
            Event::Data => {
                let seq = ring.seq(ring.rx_slot(self.stride, self.index(ring.recv.next())));
                wait_until(
                    &self.policy,
                    ctx,
                    until,
                    peer,
                    event.describe(),
                    seq,
                    ring.rx_ctrl(C_RECV_WAITING),
                    || ring.recv.is_posted(seq),
                    || self.check_peer(ctx, peer, seg),
                )
            }
            Event::Credit => wait_until(
                &self.policy,
                ctx,
                until,
                peer,
                event.describe(),
                ring.tx_ctrl(C_CONSUMED),
                ring.tx_ctrl(C_SEND_WAITING),
                || self.has_credit(ring),
                || self.check_peer(ctx, peer, seg),
            ),
            // Posts copy into the peer's slot: nothing reads the caller's memory afterwards.
            Event::Sent => Ok(()),
        };
        self.end_wait(r)
    }

    fn abort_handle(&self) -> Arc<dyn AbortHandle> {
        self.maps.clone()
    }
}
