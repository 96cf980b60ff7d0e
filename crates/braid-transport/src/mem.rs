//! The in-memory link: every rank of a communicator in one process, over one [`MemNet`].
//!
//! It keeps the primitive's semantics exactly (receiver-owned rings of bounded depth, credits, channels,
//! tags, slot-size limits) and adds what a test needs and a network cannot give on demand: virtual time
//! with a latency per message, a killed rank (its peers see it fail), traffic counts per link, and a
//! count of messages left unread. A stalled rank is one its driver stops polling. The simulator runs the
//! real executor over it, all ranks on one thread; threads can share it too ([`Link::wait`] sleeps on a
//! condition variable).

use std::cell::Cell;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use braid_core::Error;

use crate::link::{check_token, misuse, AbortHandle, Event, Link, LinkId, RecvSlot, SendSlot};
use crate::memory::Span;
use crate::WaitCtx;

/// One ring from one rank to another on one channel.
struct Queue {
    /// Slot memory, allocated on first use.
    bufs: Vec<Option<Box<[u8]>>>,
    posted: u32,
    consumed: u32,
    len: Vec<u32>,
    tag: Vec<u32>,
    /// Virtual time at which each posted slot becomes visible to the receiver.
    visible: Vec<Duration>,
}

struct State {
    queues: Vec<Queue>,
    dead: Vec<bool>,
    now: Duration,
    latency: Duration,
    link_bytes: Vec<Vec<usize>>,
    messages: Vec<usize>,
}

struct Net {
    world: usize,
    channels: usize,
    slots: usize,
    slot_bytes: usize,
    state: Mutex<State>,
    changed: Condvar,
}

impl Net {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave a queue half-updated in a way that matters to
        // the counters' readers; keep going with the data.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn queue(&self, from: usize, to: usize, ch: usize) -> usize {
        (from * self.world + to) * self.channels + ch
    }
}

/// An in-memory network of `world` ranks.
#[derive(Clone)]
pub struct MemNet {
    net: Arc<Net>,
}

/// What crossed a [`MemNet`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Payload bytes sent over each link: `link_bytes[from][to]`.
    pub link_bytes: Vec<Vec<usize>>,
    /// Messages each rank sent.
    pub messages: Vec<usize>,
    /// Messages posted and not yet released, over all rings.
    pub unread: usize,
}

impl Traffic {
    /// Payload bytes each rank sent.
    pub fn bytes_sent(&self) -> Vec<usize> {
        self.link_bytes.iter().map(|row| row.iter().sum()).collect()
    }
}

impl MemNet {
    /// A network of `world` ranks with `channels` rings of `slots` slots of `slot_bytes` per pair.
    pub fn new(world: usize, channels: usize, slots: usize, slot_bytes: usize) -> MemNet {
        let (channels, slots) = (channels.max(1), slots.max(1));
        let queues = (0..world * world * channels)
            .map(|_| Queue {
                bufs: (0..slots).map(|_| None).collect(),
                posted: 0,
                consumed: 0,
                len: vec![0; slots],
                tag: vec![0; slots],
                visible: vec![Duration::ZERO; slots],
            })
            .collect();
        MemNet {
            net: Arc::new(Net {
                world,
                channels,
                slots,
                slot_bytes,
                state: Mutex::new(State {
                    queues,
                    dead: vec![false; world],
                    now: Duration::ZERO,
                    latency: Duration::ZERO,
                    link_bytes: vec![vec![0; world]; world],
                    messages: vec![0; world],
                }),
                changed: Condvar::new(),
            }),
        }
    }

    /// Rank `rank`'s link.
    pub fn link(&self, rank: usize) -> MemLink {
        let n = self.net.world * self.net.channels;
        MemLink {
            id: LinkId::new(),
            rank,
            net: self.net.clone(),
            rings: (0..n).map(|_| Ring::default()).collect(),
        }
    }

    /// Every message posted from now on becomes visible `latency` (virtual time) after its post.
    pub fn set_latency(&self, latency: Duration) {
        self.net.lock().latency = latency;
    }

    /// Moves virtual time forward.
    pub fn advance(&self, by: Duration) {
        self.net.lock().now += by;
        self.net.changed.notify_all();
    }

    /// The virtual time.
    pub fn now(&self) -> Duration {
        self.net.lock().now
    }

    /// The earliest virtual time at which a message in transit becomes visible, if one is in transit.
    pub fn next_arrival(&self) -> Option<Duration> {
        let st = self.net.lock();
        let now = st.now;
        st.queues
            .iter()
            .flat_map(|q| {
                (q.consumed..q.posted).map(move |m| q.visible[(m % self.net.slots as u32) as usize])
            })
            .filter(|v| *v > now)
            .min()
    }

    /// Kills `rank`: its peers see it fail (after the messages it posted before), and its own link
    /// refuses every call.
    pub fn kill(&self, rank: usize) {
        if let Some(d) = self.net.lock().dead.get_mut(rank) {
            *d = true;
        }
        self.net.changed.notify_all();
    }

    /// What has crossed the network so far.
    pub fn traffic(&self) -> Traffic {
        let st = self.net.lock();
        Traffic {
            link_bytes: st.link_bytes.clone(),
            messages: st.messages.clone(),
            unread: st
                .queues
                .iter()
                .map(|q| q.posted.wrapping_sub(q.consumed) as usize)
                .sum(),
        }
    }
}

/// Per (peer, channel) counters of one rank.
#[derive(Default)]
struct Ring {
    reserved: Cell<u32>,
    posted: Cell<u32>,
    recvd: Cell<u32>,
    released: Cell<u32>,
}

/// One rank's link on a [`MemNet`].
pub struct MemLink {
    id: LinkId,
    rank: usize,
    net: Arc<Net>,
    rings: Vec<Ring>,
}

struct MemAbort {
    rank: usize,
    net: Arc<Net>,
}

impl AbortHandle for MemAbort {
    fn fail_and_wake(&self) {
        if let Some(d) = self.net.lock().dead.get_mut(self.rank) {
            *d = true;
        }
        self.net.changed.notify_all();
    }
    fn wake_all(&self) {
        self.net.changed.notify_all();
    }
}

impl MemLink {
    fn ring(&self, peer: usize, ch: usize) -> Result<&Ring, Error> {
        if peer >= self.net.world || peer == self.rank || ch >= self.net.channels {
            return Err(misuse(
                "mem",
                format!(
                    "no ring between rank {} and rank {peer} on channel {ch}",
                    self.rank
                ),
            ));
        }
        Ok(&self.rings[peer * self.net.channels + ch])
    }

    fn alive(&self, st: &State, ctx: &WaitCtx<'_>) -> Result<(), Error> {
        if st.dead[self.rank] {
            return Err(ctx.aborted());
        }
        Ok(())
    }

    /// Whether the event can happen now, or an error if it never will.
    fn ready(
        &self,
        st: &State,
        peer: usize,
        ch: usize,
        event: Event,
        ctx: &WaitCtx<'_>,
    ) -> Result<bool, Error> {
        self.alive(st, ctx)?;
        let ring = self.ring(peer, ch)?;
        let slots = self.net.slots as u32;
        let ready = match event {
            Event::Data => {
                let q = &st.queues[self.net.queue(peer, self.rank, ch)];
                let r = ring.recvd.get();
                q.posted.wrapping_sub(r) > 0 && q.visible[(r % slots) as usize] <= st.now
            }
            Event::Credit => {
                let q = &st.queues[self.net.queue(self.rank, peer, ch)];
                ring.reserved.get().wrapping_sub(q.consumed) < slots
            }
            // Posts copy into the slot: nothing reads the caller's memory afterwards.
            Event::Sent => true,
        };
        if !ready && st.dead[peer] {
            return Err(ctx.peer_failed(peer, "was killed"));
        }
        Ok(ready)
    }
}

impl Link for MemLink {
    fn name(&self) -> &'static str {
        "mem"
    }

    fn slot_bytes(&self) -> usize {
        self.net.slot_bytes
    }

    fn channels(&self) -> usize {
        self.net.channels
    }

    fn try_reserve(
        &self,
        peer: usize,
        ch: usize,
        ctx: &WaitCtx<'_>,
    ) -> Result<Option<SendSlot>, Error> {
        let mut st = self.net.lock();
        if !self.ready(&st, peer, ch, Event::Credit, ctx)? {
            return Ok(None);
        }
        if st.dead[peer] {
            return Err(ctx.peer_failed(peer, "was killed"));
        }
        let ring = self.ring(peer, ch)?;
        let msg = ring.reserved.get();
        ring.reserved.set(msg.wrapping_add(1));
        let qi = self.net.queue(self.rank, peer, ch);
        let index = (msg % self.net.slots as u32) as usize;
        let slot_bytes = self.net.slot_bytes;
        let buf = st.queues[qi].bufs[index]
            .get_or_insert_with(|| vec![0u8; slot_bytes].into_boxed_slice());
        // SAFETY: the slot's memory is a heap allocation that lives as long as the network (boxes are
        // never replaced or dropped before it); the receiver has released it (credit checked) and will not
        // read it before it is posted.
        let slot = unsafe {
            let span = Span::host(buf.as_mut_ptr(), buf.len());
            SendSlot::new(self.id, peer, ch, msg, span)
        };
        Ok(Some(slot))
    }

    fn post(&self, slot: SendSlot, len: usize, tag: u32, ctx: &WaitCtx<'_>) -> Result<(), Error> {
        let ring = self.ring(slot.peer, slot.ch)?;
        check_token(
            "mem",
            self.id,
            slot.link,
            slot.msg,
            ring.posted.get(),
            "post",
        )?;
        if len > self.net.slot_bytes {
            return Err(misuse(
                "mem",
                format!("posting {len} bytes into a slot of {}", self.net.slot_bytes),
            ));
        }
        let mut st = self.net.lock();
        self.alive(&st, ctx)?;
        let (now, latency) = (st.now, st.latency);
        let q = &mut st.queues[self.net.queue(self.rank, slot.peer, slot.ch)];
        let index = (slot.msg % self.net.slots as u32) as usize;
        q.len[index] = len as u32;
        q.tag[index] = tag;
        q.visible[index] = now + latency;
        q.posted = q.posted.wrapping_add(1);
        ring.posted.set(slot.msg.wrapping_add(1));
        st.link_bytes[self.rank][slot.peer] += len;
        st.messages[self.rank] += 1;
        drop(st);
        self.net.changed.notify_all();
        Ok(())
    }

    fn try_recv(
        &self,
        peer: usize,
        ch: usize,
        ctx: &WaitCtx<'_>,
    ) -> Result<Option<RecvSlot>, Error> {
        let st = self.net.lock();
        if !self.ready(&st, peer, ch, Event::Data, ctx)? {
            return Ok(None);
        }
        let ring = self.ring(peer, ch)?;
        let r = ring.recvd.get();
        let q = &st.queues[self.net.queue(peer, self.rank, ch)];
        let index = (r % self.net.slots as u32) as usize;
        let (len, tag) = (q.len[index] as usize, q.tag[index]);
        let Some(buf) = q.bufs[index].as_ref() else {
            return Err(misuse("mem", "a posted slot without memory".into()));
        };
        ring.recvd.set(r.wrapping_add(1));
        // SAFETY: `len <= slot_bytes` (checked at post); the memory lives as long as the network and the
        // sender will not reserve this slot again until it is released.
        let slot = unsafe {
            let span = Span::host(buf.as_ptr() as *mut u8, len);
            RecvSlot::new(self.id, peer, ch, r, tag, span)
        };
        Ok(Some(slot))
    }

    fn release(&self, slot: RecvSlot) -> Result<(), Error> {
        let ring = self.ring(slot.peer, slot.ch)?;
        check_token(
            "mem",
            self.id,
            slot.link,
            slot.msg,
            ring.released.get(),
            "release",
        )?;
        ring.released.set(slot.msg.wrapping_add(1));
        let mut st = self.net.lock();
        let q = &mut st.queues[self.net.queue(slot.peer, self.rank, slot.ch)];
        q.consumed = q.consumed.wrapping_add(1);
        drop(st);
        self.net.changed.notify_all();
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
        let mut st = self.net.lock();
        loop {
            if self.ready(&st, peer, ch, event, ctx)? {
                return Ok(());
            }
            if ctx.abort.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(ctx.aborted());
            }
            let now = Instant::now();
            if now >= ctx.deadline {
                return Err(ctx.timeout(peer, event.describe()));
            }
            if now >= until {
                return Ok(());
            }
            let slice = (ctx.deadline.min(until) - now).min(Duration::from_millis(5));
            st = self
                .net
                .changed
                .wait_timeout(st, slice)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn abort_handle(&self) -> Arc<dyn AbortHandle> {
        Arc::new(MemAbort {
            rank: self.rank,
            net: self.net.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::{recv_with, send_bytes};
    use std::sync::atomic::AtomicBool;

    fn ctx(abort: &AtomicBool) -> WaitCtx<'_> {
        let now = Instant::now();
        WaitCtx {
            rank: 0,
            collective: "test",
            seq: 0,
            deadline: now + Duration::from_secs(5),
            started: now,
            abort,
        }
    }

    #[test]
    fn rings_are_bounded_ordered_and_independent_per_channel() {
        let net = MemNet::new(2, 2, 2, 16);
        let (a, b) = (net.link(0), net.link(1));
        let abort = AtomicBool::new(false);
        let c = ctx(&abort);
        for i in 0..2u8 {
            send_bytes(&a, 1, 0, &[i; 3], 10 + i as u32, &c).unwrap();
        }
        // The ring of channel 0 is full; channel 1 still has room.
        assert!(a.try_reserve(1, 0, &c).unwrap().is_none());
        send_bytes(&a, 1, 1, b"x", 99, &c).unwrap();
        assert_eq!(
            recv_with(&b, 0, 1, &c, |d, t| (d.to_vec(), t)).unwrap(),
            (b"x".to_vec(), 99)
        );
        for i in 0..2u8 {
            let got = recv_with(&b, 0, 0, &c, |d, t| (d.to_vec(), t)).unwrap();
            assert_eq!(got, (vec![i; 3], 10 + i as u32));
        }
        assert!(a.try_reserve(1, 0, &c).unwrap().is_some());
        let t = net.traffic();
        assert_eq!(t.link_bytes[0][1], 7);
        assert_eq!(t.messages, vec![3, 0]);
        assert_eq!(t.unread, 0);
    }

    #[test]
    fn tokens_are_checked_and_released_in_order() {
        let net = MemNet::new(2, 1, 4, 16);
        let other = MemNet::new(2, 1, 4, 16);
        let (a, b, x) = (net.link(0), net.link(1), other.link(0));
        let abort = AtomicBool::new(false);
        let c = ctx(&abort);
        let s = x.try_reserve(1, 0, &c).unwrap().unwrap();
        assert!(matches!(a.post(s, 0, 0, &c), Err(Error::Internal(_))));
        send_bytes(&a, 1, 0, b"1", 0, &c).unwrap();
        send_bytes(&a, 1, 0, b"2", 0, &c).unwrap();
        let m1 = b.try_recv(0, 0, &c).unwrap().unwrap();
        let m2 = b.try_recv(0, 0, &c).unwrap().unwrap();
        let e = b.release(m2).unwrap_err();
        assert!(e.to_string().contains("out of order"), "{e}");
        b.release(m1).unwrap();
        let too_long = a.try_reserve(1, 0, &c).unwrap().unwrap();
        assert!(a.post(too_long, 17, 0, &c).is_err());
        assert!(a.try_reserve(0, 0, &c).is_err(), "no ring to itself");
    }

    #[test]
    fn latency_hides_a_message_until_its_time() {
        let net = MemNet::new(2, 1, 2, 8);
        net.set_latency(Duration::from_micros(50));
        let (a, b) = (net.link(0), net.link(1));
        let abort = AtomicBool::new(false);
        let c = ctx(&abort);
        send_bytes(&a, 1, 0, b"late", 1, &c).unwrap();
        assert!(b.try_recv(0, 0, &c).unwrap().is_none());
        assert_eq!(net.next_arrival(), Some(Duration::from_micros(50)));
        net.advance(Duration::from_micros(50));
        let m = b.try_recv(0, 0, &c).unwrap().unwrap();
        assert_eq!(m.host_bytes(), Some(&b"late"[..]));
        b.release(m).unwrap();
    }

    #[test]
    fn a_killed_rank_fails_its_peers_after_its_last_message() {
        let net = MemNet::new(3, 1, 2, 8);
        let (a, b) = (net.link(0), net.link(1));
        let abort = AtomicBool::new(false);
        let c = ctx(&abort);
        send_bytes(&a, 1, 0, b"last", 0, &c).unwrap();
        net.kill(0);
        let m = b.try_recv(0, 0, &c).unwrap().unwrap();
        b.release(m).unwrap();
        let e = b.try_recv(0, 0, &c).unwrap_err();
        assert!(matches!(e, Error::PeerFailed { peer: 0, .. }), "{e}");
        assert!(matches!(
            b.try_reserve(0, 0, &c),
            Err(Error::PeerFailed { peer: 0, .. })
        ));
        assert!(matches!(
            a.try_reserve(1, 0, &c),
            Err(Error::Aborted { .. })
        ));
        // A wait on a rank that never sends ends at the deadline.
        let now = Instant::now();
        let short = WaitCtx {
            deadline: now + Duration::from_millis(20),
            ..c
        };
        let e = b
            .wait(2, 0, Event::Data, &short, short.deadline)
            .unwrap_err();
        assert!(matches!(e, Error::Timeout { peer: 2, .. }), "{e}");
    }
}
