//! The slot protocol of one shared-memory ring, written over any [`Word`], so that the loom model
//! (`tests/loom_ring.rs`) checks this very code on loom's atomics while [`ShmLink`](super::ShmLink)
//! runs it on words in the segments.
//!
//! A ring is `slots` slots, each with a sequence word, and one `consumed` counter; all counters wrap.
//! - The sender has credit for message `s` while `s - consumed < slots`. It writes the slot, then
//!   [`Sender::post`]s it: stores the slot's sequence word `s + 1` (Release), and after a
//!   sequentially consistent fence reads whether the receiver said it sleeps, and if so wakes it.
//! - The receiver has message `r` when the slot's sequence word reads `r + 1` (Acquire). It reads the
//!   slot in place, then [`Receiver::release`]s it: stores `consumed = r + 1` (Release), and after a
//!   fence wakes the sender if it said it sleeps.
//! - Either side waits with [`sleep_unless`]: it says that it sleeps, fences, and reads once more
//!   before sleeping, so that with the fence after the other side's store no wake-up is lost.

use std::cell::Cell;
use std::sync::atomic::Ordering;

pub use crate::wait::{sleep_unless, Word};

/// The sending side's counters of one ring, all wrapping.
#[derive(Debug, Default)]
pub struct Sender {
    /// Messages whose slot has been handed out.
    reserved: Cell<u32>,
    /// Messages posted.
    posted: Cell<u32>,
    /// The last `consumed` counter read, so that a sender with credit left reads nothing remote.
    credit_seen: Cell<u32>,
}

impl Sender {
    /// Whether the next message to reserve has a free slot among `slots`, given the receiver's
    /// `consumed` counter (read, Acquire, only when the last reading leaves no credit).
    #[inline]
    pub fn has_credit<W: Word + ?Sized>(&self, consumed: &W, slots: u32) -> bool {
        let s = self.reserved.get();
        if s.wrapping_sub(self.credit_seen.get()) < slots {
            return true;
        }
        let c = consumed.load(Ordering::Acquire);
        self.credit_seen.set(c);
        s.wrapping_sub(c) < slots
    }

    /// Hands out the next message's slot and returns the message's counter. Only with credit.
    #[inline]
    pub fn reserve(&self) -> u32 {
        let s = self.reserved.get();
        self.reserved.set(s.wrapping_add(1));
        s
    }

    /// The message the next post must be.
    #[inline]
    pub fn next_post(&self) -> u32 {
        self.posted.get()
    }

    /// Posts message `s` (the next one, whose slot the caller has written): stores its slot's
    /// sequence word `seq` as `s + 1` (Release: what the caller wrote to the slot before is visible
    /// to a receiver that sees it), then fences and wakes the receiver if `recv_waiting` says it
    /// sleeps.
    #[inline]
    pub fn post<W: Word + ?Sized>(&self, s: u32, seq: &W, recv_waiting: &W) {
        self.posted.set(s.wrapping_add(1));
        seq.store(s.wrapping_add(1), Ordering::Release);
        // With the fence in `sleep_unless`: the receiver sees this post, or we see that it sleeps.
        seq.fence_seq_cst();
        if recv_waiting.load(Ordering::Relaxed) != 0 {
            seq.wake();
        }
    }
}

/// The receiving side's counters of one ring, all wrapping.
#[derive(Debug, Default)]
pub struct Receiver {
    /// Messages taken.
    recvd: Cell<u32>,
    /// Messages released (their slots handed back).
    released: Cell<u32>,
}

impl Receiver {
    /// The next message to take.
    #[inline]
    pub fn next(&self) -> u32 {
        self.recvd.get()
    }

    /// Whether the next message has been posted, given its slot's sequence word (Acquire: the
    /// slot's contents are then visible).
    #[inline]
    pub fn is_posted<W: Word + ?Sized>(&self, seq: &W) -> bool {
        seq.load(Ordering::Acquire) == self.recvd.get().wrapping_add(1)
    }

    /// Takes the next message (after [`Receiver::is_posted`]); the caller reads its slot until it
    /// releases it.
    #[inline]
    pub fn take(&self) {
        self.recvd.set(self.recvd.get().wrapping_add(1));
    }

    /// The message the next release must be.
    #[inline]
    pub fn next_release(&self) -> u32 {
        self.released.get()
    }

    /// Releases message `r` (the next one): stores `consumed` as `r + 1` (Release: the caller's
    /// reads of the slot happen before the sender may write it again), then fences and wakes the
    /// sender if `send_waiting` says it sleeps.
    #[inline]
    pub fn release<W: Word + ?Sized>(&self, r: u32, consumed: &W, send_waiting: &W) {
        let c = r.wrapping_add(1);
        self.released.set(c);
        consumed.store(c, Ordering::Release);
        // As in `post`: the sender sees the credit, or we see that it sleeps.
        consumed.fence_seq_cst();
        if send_waiting.load(Ordering::Relaxed) != 0 {
            consumed.wake();
        }
    }
}
