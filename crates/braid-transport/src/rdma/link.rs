//! [`RdmaLink`]: the [`Link`] over connected queue pairs (see the module above for the protocol).

use std::cell::{Cell, RefCell};
use std::io::ErrorKind;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_core::Error;
use tracing::debug;

use super::verbs::{Channel, Completion, Cq, Mr, Pd, Qp, Rts, Write};
use super::wire::{stripes, Header, Imm, HEADER};
use crate::link::{check_token, misuse, AbortHandle, Event, Link, LinkId, RecvSlot, SendSlot};
use crate::memory::Span;
use crate::{WaitCtx, WaitPolicy};

/// Bytes between the starts of two slots: header and payload, rounded up to 64.
pub(crate) fn stride(slot_bytes: usize) -> usize {
    (HEADER + slot_bytes).next_multiple_of(64)
}

const KIND_RECV: u64 = 1;
const KIND_DATA: u64 = 2;
const KIND_CREDIT: u64 = 3;
/// A data write whose payload comes from the caller's registered memory.
const KIND_DIRECT: u64 = 4;

/// A work request id: kind, channel, peer index and queue pair.
fn wr_id(kind: u64, pi: usize, q: usize, ch: usize) -> u64 {
    (kind << 60)
        | ((ch as u64 & 0xfff) << 40)
        | ((pi as u64 & 0xffff_ffff) << 8)
        | (q as u64 & 0xff)
}

/// Kind, peer index, queue pair and channel of a work request id.
fn wr_parts(id: u64) -> (u64, usize, usize, usize) {
    (
        id >> 60,
        ((id >> 8) & 0xffff_ffff) as usize,
        (id & 0xff) as usize,
        ((id >> 40) & 0xfff) as usize,
    )
}

/// The work request id of a receive posted for peer `pi` on its queue pair `q`.
pub(crate) fn recv_wr_id(pi: usize, q: usize) -> u64 {
    wr_id(KIND_RECV, pi, q, 0)
}

/// How long deregistering waits for the writes that read the caller's memory.
const SETTLE: Duration = Duration::from_secs(10);

/// Slice of a blocked wait between checks of deadline, abort and the peer.
const SLICE: Duration = Duration::from_millis(5);

/// How long dropping a link waits for its last writes to complete.
const DRAIN: Duration = Duration::from_secs(2);

#[derive(Default)]
struct SendRing {
    /// Messages reserved (the next reservation's number).
    reserved: Cell<u32>,
    /// Messages posted.
    posted: Cell<u32>,
}

struct RecvRing {
    /// Messages handed out by `try_recv` (the next one's number).
    received: Cell<u32>,
    /// Messages released.
    released: Cell<u32>,
    /// Per slot: parts arrived, parts the message takes, low byte of its number.
    arrived: Vec<Cell<u8>>,
    parts: Vec<Cell<u8>>,
    msg: Vec<Cell<u8>>,
}

impl RecvRing {
    fn new(slots: usize) -> RecvRing {
        RecvRing {
            received: Cell::new(0),
            released: Cell::new(0),
            arrived: (0..slots).map(|_| Cell::new(0)).collect(),
            parts: (0..slots).map(|_| Cell::new(0)).collect(),
            msg: (0..slots).map(|_| Cell::new(0)).collect(),
        }
    }
}

/// One peer's queue pairs, remote memory and ring states.
pub(crate) struct PeerLink {
    rank: usize,
    pi: usize,
    qps: Vec<Arc<Qp<Rts>>>,
    ring: (u64, u32),
    credit: (u64, u32),
    socket: Option<TcpStream>,
    outstanding: Vec<Cell<u32>>,
    /// Per channel: writes from the caller's memory not yet completed.
    direct: Vec<Cell<u32>>,
    send: Vec<SendRing>,
    recv: Vec<RecvRing>,
    failed: RefCell<Option<String>>,
}

impl PeerLink {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rank: usize,
        pi: usize,
        qps: Vec<Qp<Rts>>,
        ring: (u64, u32),
        credit: (u64, u32),
        socket: Option<TcpStream>,
        channels: usize,
        slots: usize,
    ) -> PeerLink {
        if let Some(s) = &socket {
            let _ = s.set_nonblocking(true);
        }
        PeerLink {
            rank,
            pi,
            outstanding: qps.iter().map(|_| Cell::new(0)).collect(),
            qps: qps.into_iter().map(Arc::new).collect(),
            ring,
            credit,
            socket,
            direct: (0..channels).map(|_| Cell::new(0)).collect(),
            send: (0..channels).map(|_| SendRing::default()).collect(),
            recv: (0..channels).map(|_| RecvRing::new(slots)).collect(),
            failed: RefCell::new(None),
        }
    }

    fn fail(&self, why: String) {
        let mut f = self.failed.borrow_mut();
        if f.is_none() {
            debug!(peer = self.rank, "rdma peer failed: {why}");
            *f = Some(why);
        }
    }

    /// Whether its connection socket says the process is gone (checked without blocking).
    fn socket_closed(&self) -> bool {
        let Some(s) = &self.socket else { return false };
        let mut b = [0u8; 1];
        match s.peek(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
        }
    }
}

/// What [`RdmaLink::new`] is made of.
pub(crate) struct Parts {
    pub rank: usize,
    pub world: usize,
    pub channels: usize,
    pub slots: usize,
    pub slot_bytes: usize,
    pub policy: WaitPolicy,
    pub peers: Vec<PeerLink>,
    pub inbound: Mr,
    pub staging: Mr,
    pub control: Mr,
    pub cq: Arc<Cq>,
    pub channel: Arc<Channel>,
    pub pd: Arc<Pd>,
    pub device: String,
    pub bad_rkey: bool,
}

/// Caller memory registered for sends without a copy.
struct Registered {
    start: usize,
    len: usize,
    mr: Mr,
}

/// A rank's RDMA connections to its RDMA peers.
pub struct RdmaLink {
    id: LinkId,
    rank: usize,
    channels: usize,
    slots: usize,
    slot_bytes: usize,
    stride: usize,
    policy: WaitPolicy,
    by_rank: Vec<Option<usize>>,
    // Field order is drop order: queue pairs (in `peers`) before the memory and the queue.
    peers: Vec<PeerLink>,
    inbound: Mr,
    staging: Mr,
    control: Mr,
    registered: RefCell<Vec<Registered>>,
    cq: Arc<Cq>,
    channel: Arc<Channel>,
    pd: Arc<Pd>,
    device: String,
    bad_rkey: bool,
    scratch: RefCell<Vec<Completion>>,
    /// Messages posted from the staging ring and straight from registered memory (for the log).
    posted: Cell<(u64, u64)>,
}

// SAFETY: the link is used by one thread at a time (`Link: Send`, not `Sync`); its cells are never
// shared, and the verbs objects and registered memory it owns may move between threads.
unsafe impl Send for RdmaLink {}

impl RdmaLink {
    pub(crate) fn new(p: Parts) -> RdmaLink {
        let mut by_rank = vec![None; p.world];
        for (i, peer) in p.peers.iter().enumerate() {
            by_rank[peer.rank] = Some(i);
        }
        RdmaLink {
            id: LinkId::new(),
            rank: p.rank,
            channels: p.channels,
            slots: p.slots,
            slot_bytes: p.slot_bytes,
            stride: stride(p.slot_bytes),
            policy: p.policy,
            by_rank,
            peers: p.peers,
            inbound: p.inbound,
            staging: p.staging,
            control: p.control,
            registered: RefCell::new(Vec::new()),
            cq: p.cq,
            channel: p.channel,
            pd: p.pd,
            device: p.device,
            bad_rkey: p.bad_rkey,
            scratch: RefCell::new(Vec::with_capacity(32)),
            posted: Cell::new((0, 0)),
        }
    }

    /// The device it runs on.
    pub fn device(&self) -> &str {
        &self.device
    }

    fn peer(&self, peer: usize, ch: usize) -> Result<&PeerLink, Error> {
        match self.by_rank.get(peer).copied().flatten() {
            Some(i) if ch < self.channels => Ok(&self.peers[i]),
            _ => Err(misuse(
                "rdma",
                format!("no ring to rank {peer} on channel {ch}"),
            )),
        }
    }

    /// Offset of (peer index, channel, slot) in the local rings.
    fn offset(&self, pi: usize, ch: usize, slot: usize) -> usize {
        ((pi * self.channels + ch) * self.slots + slot) * self.stride
    }

    /// The credit word peer `pi` writes for channel `ch`: how many of this rank's messages it released.
    fn credit_in(&self, pi: usize, ch: usize) -> u32 {
        let off = (pi * self.channels + ch) * 4;
        // SAFETY: inside the control region (sized for every peer and channel, twice), 4-aligned;
        // the device writes it, so it is read as an atomic.
        let w = unsafe { &*(self.control.ptr().add(off) as *const AtomicU32) };
        w.load(Ordering::Acquire)
    }

    /// The word this rank's credit writes to peer `pi` on channel `ch` are sent from.
    fn credit_out(&self, pi: usize, ch: usize) -> &AtomicU32 {
        let off = (self.peers.len() * self.channels + pi * self.channels + ch) * 4;
        // SAFETY: inside the second half of the control region, 4-aligned; only this thread writes
        // it and the device reads it.
        unsafe { &*(self.control.ptr().add(off) as *const AtomicU32) }
    }

    /// Takes what the completion queue has and applies it.
    fn progress(&self) -> Result<(), Error> {
        let mut buf = self.scratch.borrow_mut();
        loop {
            buf.clear();
            let n = self.cq.poll(&mut buf, 32)?;
            for c in buf.iter() {
                self.complete(c);
            }
            if n < 32 {
                return Ok(());
            }
        }
    }

    fn complete(&self, c: &Completion) {
        let (kind, pi, q, ch) = wr_parts(c.wr_id);
        let Some(peer) = self.peers.get(pi) else {
            return;
        };
        match kind {
            KIND_RECV => {
                if let Some((status, vendor)) = c.error {
                    peer.fail(format!(
                        "a receive from rank {} completed with {status} (vendor error {vendor:#x})",
                        peer.rank
                    ));
                    return;
                }
                match c.imm.map(Imm::decode) {
                    Some(Imm::Data {
                        ch,
                        slot,
                        parts,
                        msg,
                    }) => {
                        let (ch, slot) = (ch as usize, slot as usize);
                        if ch >= self.channels || slot >= self.slots || parts == 0 {
                            peer.fail(format!(
                                "rank {} wrote channel {ch} slot {slot} in {parts} parts, outside \
                                 {} channels of {} slots",
                                peer.rank, self.channels, self.slots
                            ));
                            return;
                        }
                        let r = &peer.recv[ch];
                        let a = r.arrived[slot].get();
                        if a > 0 && (r.parts[slot].get() != parts || r.msg[slot].get() != msg) {
                            peer.fail(format!(
                                "rank {} wrote a second message into slot {slot} of channel {ch} \
                                 before it was released",
                                peer.rank
                            ));
                            return;
                        }
                        r.arrived[slot].set(a.saturating_add(1));
                        r.parts[slot].set(parts);
                        r.msg[slot].set(msg);
                    }
                    // The credit word is already in memory; the completion only woke this rank.
                    Some(Imm::Credit { .. }) => {}
                    None => {
                        peer.fail(format!(
                            "rank {} sent a message without immediate",
                            peer.rank
                        ));
                        return;
                    }
                }
                if let Some(qp) = peer.qps.get(q) {
                    if let Err(e) = qp.post_recv(c.wr_id, None) {
                        peer.fail(format!("reposting a receive for rank {}: {e}", peer.rank));
                    }
                }
            }
            KIND_DATA | KIND_CREDIT | KIND_DIRECT => {
                if let Some(o) = peer.outstanding.get(q) {
                    o.set(o.get().saturating_sub(1));
                }
                if kind == KIND_DIRECT {
                    if let Some(d) = peer.direct.get(ch) {
                        d.set(d.get().saturating_sub(1));
                    }
                }
                if let Some((status, vendor)) = c.error {
                    let what = if kind == KIND_CREDIT {
                        "a credit"
                    } else {
                        "a write"
                    };
                    peer.fail(format!(
                        "{what} to rank {} completed with {status} (vendor error {vendor:#x})",
                        peer.rank
                    ));
                }
            }
            _ => {}
        }
    }

    fn data_ready(&self, peer: &PeerLink, ch: usize) -> bool {
        let r = &peer.recv[ch];
        let slot = (r.received.get() % self.slots as u32) as usize;
        let a = r.arrived[slot].get();
        a > 0 && a >= r.parts[slot].get()
    }

    fn credit_ready(&self, peer: &PeerLink, ch: usize) -> bool {
        let s = &peer.send[ch];
        s.reserved.get().wrapping_sub(self.credit_in(peer.pi, ch)) < self.slots as u32
    }

    fn failure(&self, peer: &PeerLink, ctx: &WaitCtx<'_>) -> Result<(), Error> {
        match peer.failed.borrow().as_ref() {
            // An abort here moved the queue pairs to the error state itself: what failed is this rank.
            Some(_) if ctx.abort.load(Ordering::Relaxed) => Err(ctx.aborted()),
            Some(why) => {
                Err(ctx.peer_failed(peer.rank, format!("over rdma ({}): {why}", self.device)))
            }
            None => Ok(()),
        }
    }

    /// Waits until queue pair `q` of `peer` has room for one more send, polling completions.
    fn room(&self, peer: &PeerLink, q: usize, until: Instant) -> Result<(), String> {
        let cap = self.slots as u32 * self.channels as u32 * 2 + 4;
        loop {
            if peer.outstanding[q].get() < cap {
                return Ok(());
            }
            self.progress().map_err(|e| e.to_string())?;
            if peer.failed.borrow().is_some() {
                return Err("the peer failed".into());
            }
            if Instant::now() >= until {
                return Err(format!(
                    "the send queue to rank {} stayed full ({cap} writes outstanding)",
                    peer.rank
                ));
            }
            std::hint::spin_loop();
        }
    }

    /// Writes a posted slot into the peer's ring: the header from the staging slot, the payload
    /// from the staging slot or, with `direct` (address and local key), from the caller's memory.
    fn write_slot(
        &self,
        slot: SendSlot,
        len: usize,
        tag: u32,
        ctx: &WaitCtx<'_>,
        direct: Option<(u64, u32)>,
    ) -> Result<(), Error> {
        let p = self.peer(slot.peer, slot.ch)?;
        let s = &p.send[slot.ch];
        check_token("rdma", self.id, slot.link, slot.msg, s.posted.get(), "post")?;
        if len > self.slot_bytes {
            return Err(misuse(
                "rdma",
                format!("a post of {len} bytes into a slot of {}", self.slot_bytes),
            ));
        }
        self.failure(p, ctx)?;
        let (ch, msg) = (slot.ch, slot.msg);
        let index = (msg % self.slots as u32) as usize;
        let off = self.offset(p.pi, ch, index);
        let header = Header {
            len: len as u32,
            tag,
            msg,
        }
        .encode();
        // SAFETY: the slot's header bytes, ours to write until posted (as the payload after them).
        unsafe {
            std::ptr::copy_nonoverlapping(header.as_ptr(), self.staging.ptr().add(off), HEADER)
        };
        let remote_off = ((ch * self.slots + index) * self.stride) as u64;
        let parts = stripes(HEADER + len, p.qps.len());
        let rkey = if self.bad_rkey {
            p.ring.1 ^ 0x00a5_5a00
        } else {
            p.ring.1
        };
        let imm = Imm::Data {
            ch: ch as u8,
            slot: index as u8,
            parts: parts.len() as u8,
            msg: msg as u8,
        }
        .encode();
        let staged = |from: usize, n: usize| {
            (
                self.staging.addr() + (off + from) as u64,
                n as u32,
                self.staging.lkey(),
            )
        };
        for (q, (at, n)) in parts.into_iter().enumerate() {
            // The part's bytes of [header | payload], in one or two pieces.
            let (local, pieces, kind) = match direct {
                None => ([staged(at, n), (0, 0, 0)], 1, KIND_DATA),
                Some((addr, lkey)) => {
                    let end = at + n;
                    let head = (at < HEADER).then(|| staged(at, end.min(HEADER) - at));
                    let body = (end > HEADER).then(|| {
                        let from = at.max(HEADER) - HEADER;
                        (addr + from as u64, (end - HEADER - from) as u32, lkey)
                    });
                    match (head, body) {
                        (Some(h), Some(b)) => ([h, b], 2, KIND_DIRECT),
                        (Some(h), None) => ([h, (0, 0, 0)], 1, KIND_DIRECT),
                        (None, Some(b)) => ([b, (0, 0, 0)], 1, KIND_DIRECT),
                        (None, None) => ([(0, 0, 0); 2], 0, KIND_DIRECT),
                    }
                }
            };
            let w = Write {
                wr_id: wr_id(kind, p.pi, q, ch),
                local,
                pieces,
                remote: (p.ring.0 + remote_off + at as u64, rkey),
                imm: Some(imm),
                signaled: true,
                inline: false,
            };
            if let Err(why) = self.post_write(p, q, &w) {
                p.fail(format!("posting a write to rank {}: {why}", p.rank));
                return self.failure(p, ctx);
            }
            if kind == KIND_DIRECT {
                p.direct[ch].set(p.direct[ch].get() + 1);
            }
        }
        s.posted.set(msg.wrapping_add(1));
        let (staged, direct_n) = self.posted.get();
        self.posted.set(if direct.is_some() {
            (staged, direct_n + 1)
        } else {
            (staged + 1, direct_n)
        });
        Ok(())
    }

    /// The local key of the registration that holds `span` whole.
    fn registered_key(&self, span: &Span) -> Option<u32> {
        let (a, n) = (span.host_ptr()? as usize, span.len());
        self.registered
            .borrow()
            .iter()
            .find(|r| a >= r.start && a + n <= r.start + r.len)
            .map(|r| r.mr.lkey())
    }

    /// Polls until no write reads the caller's memory, or `SETTLE` passes.
    fn settle_all(&self) -> Result<(), Error> {
        let until = Instant::now() + SETTLE;
        loop {
            self.progress()?;
            let busy = self
                .peers
                .iter()
                .any(|p| p.failed.borrow().is_none() && p.direct.iter().any(|d| d.get() > 0));
            if !busy {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(Error::Internal(format!(
                    "rdma: writes from a registered buffer did not complete within {SETTLE:?}"
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn post_write(&self, peer: &PeerLink, q: usize, w: &Write) -> Result<(), String> {
        self.room(peer, q, Instant::now() + Duration::from_secs(10))?;
        peer.qps[q].post_write(w).map_err(|e| e.to_string())?;
        peer.outstanding[q].set(peer.outstanding[q].get() + 1);
        Ok(())
    }
}

impl Link for RdmaLink {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn channels(&self) -> usize {
        self.channels
    }

    fn try_reserve(
        &self,
        peer: usize,
        ch: usize,
        ctx: &WaitCtx<'_>,
    ) -> Result<Option<SendSlot>, Error> {
        let p = self.peer(peer, ch)?;
        self.failure(p, ctx)?;
        if !self.credit_ready(p, ch) {
            self.progress()?;
            self.failure(p, ctx)?;
            if !self.credit_ready(p, ch) {
                return Ok(None);
            }
        }
        let s = &p.send[ch];
        let msg = s.reserved.get();
        let slot = (msg % self.slots as u32) as usize;
        let off = self.offset(p.pi, ch, slot) + HEADER;
        s.reserved.set(msg.wrapping_add(1));
        // SAFETY: the staging slot is inside the staging region; credit says the peer released the
        // message that used it last, so its write completed and nothing reads it until this token is
        // posted.
        let span = unsafe { Span::host(self.staging.ptr().add(off), self.slot_bytes) };
        // SAFETY: as above; the region lives as long as the link.
        Ok(Some(unsafe { SendSlot::new(self.id, peer, ch, msg, span) }))
    }

    fn post(&self, slot: SendSlot, len: usize, tag: u32, ctx: &WaitCtx<'_>) -> Result<(), Error> {
        self.write_slot(slot, len, tag, ctx, None)
    }

    fn try_recv(
        &self,
        peer: usize,
        ch: usize,
        ctx: &WaitCtx<'_>,
    ) -> Result<Option<RecvSlot>, Error> {
        let p = self.peer(peer, ch)?;
        if !self.data_ready(p, ch) {
            self.progress()?;
            if !self.data_ready(p, ch) {
                self.failure(p, ctx)?;
                return Ok(None);
            }
        }
        let r = &p.recv[ch];
        let msg = r.received.get();
        let index = (msg % self.slots as u32) as usize;
        let off = self.offset(p.pi, ch, index);
        let mut hb = [0u8; HEADER];
        // SAFETY: every part of the message has landed (their completions were polled), so the
        // header is whole; the sender does not write the slot again until it is released.
        unsafe {
            std::ptr::copy_nonoverlapping(self.inbound.ptr().add(off), hb.as_mut_ptr(), HEADER)
        };
        let h = match Header::decode(&hb, self.slot_bytes) {
            Ok(h) if h.msg == msg && r.msg[index].get() == msg as u8 => h,
            Ok(h) => {
                p.fail(format!(
                    "rank {peer} delivered message #{} on channel {ch} where #{msg} is due",
                    h.msg
                ));
                return self.failure(p, ctx).map(|()| None);
            }
            Err(why) => {
                p.fail(format!("rank {peer} on channel {ch}: {why}"));
                return self.failure(p, ctx).map(|()| None);
            }
        };
        r.received.set(msg.wrapping_add(1));
        // SAFETY: the payload of a whole message in the inbound region, unchanged until released.
        let span = unsafe { Span::host(self.inbound.ptr().add(off + HEADER), h.len as usize) };
        // SAFETY: as above; the region lives as long as the link.
        Ok(Some(unsafe {
            RecvSlot::new(self.id, peer, ch, msg, h.tag, span)
        }))
    }

    fn release(&self, slot: RecvSlot) -> Result<(), Error> {
        let p = self.peer(slot.peer, slot.ch)?;
        let r = &p.recv[slot.ch];
        check_token(
            "rdma",
            self.id,
            slot.link,
            slot.msg,
            r.released.get(),
            "release",
        )?;
        let index = (slot.msg % self.slots as u32) as usize;
        r.arrived[index].set(0);
        r.parts[index].set(0);
        let released = slot.msg.wrapping_add(1);
        r.released.set(released);
        if p.failed.borrow().is_some() {
            // Nobody to give the credit to.
            return Ok(());
        }
        let word = self.credit_out(p.pi, slot.ch);
        word.store(released, Ordering::Release);
        let q = slot.ch % p.qps.len();
        let inline = p.qps[q].max_inline() >= 4;
        let w = Write {
            wr_id: wr_id(KIND_CREDIT, p.pi, q, slot.ch),
            local: [
                (word as *const AtomicU32 as u64, 4, self.control.lkey()),
                (0, 0, 0),
            ],
            pieces: 1,
            remote: (p.credit.0 + (slot.ch * 4) as u64, p.credit.1),
            imm: Some(Imm::Credit { ch: slot.ch as u8 }.encode()),
            signaled: true,
            inline,
        };
        if let Err(why) = self.post_write(p, q, &w) {
            p.fail(format!("returning credit to rank {}: {why}", p.rank));
        }
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
        let p = self.peer(peer, ch)?;
        let ready = || {
            p.failed.borrow().is_some()
                || match event {
                    Event::Data => self.data_ready(p, ch),
                    Event::Credit => self.credit_ready(p, ch),
                    Event::Sent => p.direct[ch].get() == 0,
                }
        };
        self.progress()?;
        if ready() {
            return Ok(());
        }
        let start = Instant::now();
        let mut i = 0u32;
        if !self.policy.spin.is_zero() {
            loop {
                self.progress()?;
                if ready() {
                    return Ok(());
                }
                i += 1;
                if i % 16 == 0 && start.elapsed() >= self.policy.spin {
                    break;
                }
            }
        }
        let yield_end = self.policy.spin + self.policy.yield_for;
        while start.elapsed() < yield_end {
            std::thread::yield_now();
            self.progress()?;
            if ready() {
                return Ok(());
            }
        }
        loop {
            if ctx.abort.load(Ordering::Relaxed) {
                return Err(ctx.aborted());
            }
            if p.socket_closed() {
                // What it posted before it went is delivered first: look once more.
                self.progress()?;
                p.fail(format!(
                    "rank {peer} closed the connection (it aborted, or its process ended)"
                ));
                return Ok(());
            }
            let now = Instant::now();
            if now >= ctx.deadline {
                return Err(ctx.timeout(peer, event.describe()));
            }
            if now >= until {
                return Ok(());
            }
            // Arm, then look once more: a completion that came before arming raises no event.
            self.cq.arm()?;
            self.progress()?;
            if ready() {
                return Ok(());
            }
            let slice = SLICE.min(ctx.deadline.min(until) - now);
            poll_readable(self.channel.fd(), slice);
            let mut events = 0;
            while self.channel.take_event() {
                events += 1;
            }
            self.cq.ack_events(events);
            self.progress()?;
            if ready() {
                return Ok(());
            }
        }
    }

    fn register(&self, span: Span) -> Result<bool, Error> {
        let Some(ptr) = span.host_ptr() else {
            return Ok(false);
        };
        if span.is_empty() {
            return Ok(false);
        }
        let (start, len) = (ptr as usize, span.len());
        if let Some(r) = self
            .registered
            .borrow()
            .iter()
            .find(|r| start < r.start + r.len && r.start < start + len)
        {
            return Err(Error::invalid(format!(
                "the buffer at {start:#x} ({len} bytes) overlaps one registered at {:#x} ({} bytes)",
                r.start, r.len
            )));
        }
        // SAFETY: `Link::register`'s contract: the memory stays mapped until it is deregistered.
        let mr = unsafe { Mr::register(&self.pd, ptr, len)? };
        self.registered
            .borrow_mut()
            .push(Registered { start, len, mr });
        Ok(true)
    }

    fn deregister(&self, span: Span) -> Result<(), Error> {
        let Some(ptr) = span.host_ptr() else {
            return Ok(());
        };
        let (start, len) = (ptr as usize, span.len());
        let found = self
            .registered
            .borrow()
            .iter()
            .position(|r| r.start == start && r.len == len);
        let Some(i) = found else {
            return Ok(());
        };
        // No write may still read the memory when the device forgets it.
        self.settle_all()?;
        drop(self.registered.borrow_mut().swap_remove(i));
        Ok(())
    }

    fn post_from(
        &self,
        slot: SendSlot,
        src: Span,
        tag: u32,
        ctx: &WaitCtx<'_>,
    ) -> Result<Option<SendSlot>, Error> {
        if src.len() > self.slot_bytes {
            return Ok(Some(slot));
        }
        let Some(lkey) = self.registered_key(&src) else {
            return Ok(Some(slot));
        };
        self.write_slot(slot, src.len(), tag, ctx, Some((src.addr() as u64, lkey)))?;
        Ok(None)
    }

    fn unsettled(&self, ch: usize) -> Option<usize> {
        // Completions that came in since the last poll may settle it.
        let _ = self.progress();
        self.peers
            .iter()
            .find(|p| p.failed.borrow().is_none() && p.direct.get(ch).is_some_and(|d| d.get() > 0))
            .map(|p| p.rank)
    }

    fn abort_handle(&self) -> Arc<dyn AbortHandle> {
        Arc::new(RdmaAbort {
            qps: self
                .peers
                .iter()
                .flat_map(|p| p.qps.iter().cloned())
                .collect(),
            sockets: self
                .peers
                .iter()
                .filter_map(|p| p.socket.as_ref().and_then(|s| s.try_clone().ok()))
                .collect(),
        })
    }
}

/// Sleeps until `fd` is readable or `timeout` passes.
fn poll_readable(fd: i32, timeout: Duration) {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd; an error or a signal is a wake-up like any other.
    unsafe { libc::poll(&mut pfd, 1, ms) };
}

struct RdmaAbort {
    qps: Vec<Arc<Qp<Rts>>>,
    sockets: Vec<TcpStream>,
}

impl AbortHandle for RdmaAbort {
    /// Closes every connection socket (peers see this rank fail at once) and moves every queue pair
    /// to the error state (outstanding work is flushed; the peers' next writes fail).
    fn fail_and_wake(&self) {
        for s in &self.sockets {
            let _ = s.shutdown(Shutdown::Both);
        }
        for qp in &self.qps {
            qp.set_error();
        }
    }
}

impl Drop for RdmaLink {
    fn drop(&mut self) {
        // Let the last writes land before the queue pairs go: a peer may still wait for them. A
        // peer whose connection closed waits for nothing.
        let until = Instant::now() + DRAIN;
        loop {
            let mut busy = false;
            for p in &self.peers {
                if p.failed.borrow().is_none() && p.outstanding.iter().any(|o| o.get() > 0) {
                    if p.socket_closed() {
                        p.fail("closed the connection".into());
                    } else {
                        busy = true;
                    }
                }
            }
            if !busy || Instant::now() >= until || self.progress().is_err() {
                break;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        for p in &self.peers {
            if let Some(s) = &p.socket {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        let (staged, direct) = self.posted.get();
        debug!(
            rank = self.rank,
            device = self.device,
            staged,
            direct,
            "rdma link closed: messages sent from the staging ring and from registered memory"
        );
    }
}
