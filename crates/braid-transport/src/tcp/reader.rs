//! The receiving side: each (peer, channel)'s slots and counters ([`Inbound`]), the state the link
//! shares with its reader threads ([`Shared`]), and the reader threads that place parts into slots.

use std::io::{ErrorKind, Read};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::conn::{TcpOptions, SLICE};
use super::frame::{self, PartHeader};
use crate::wait::{futex_wait, futex_wake};

/// Slot memory written by reader threads and read by the executor, one slot at a time by protocol.
pub(super) struct SlotMem {
    pub(super) ptr: *mut u8,
    len: usize,
}

impl SlotMem {
    fn new(len: usize) -> SlotMem {
        let b: Box<[u8]> = vec![0u8; len.max(1)].into_boxed_slice();
        SlotMem {
            ptr: Box::into_raw(b).cast::<u8>(),
            len: len.max(1),
        }
    }
}

impl Drop for SlotMem {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `len` come from `Box::into_raw` of a boxed slice of exactly that length in
        // `new`, and nothing uses the memory once its owner is dropped.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr, self.len,
            )))
        };
    }
}

// SAFETY: the memory is a plain byte buffer; access to each slot is handed back and forth between the
// reader threads and the executor by the Release/Acquire protocol on `seq` and `consumed`.
unsafe impl Send for SlotMem {}
// SAFETY: as above: at any time one side owns a slot's bytes.
unsafe impl Sync for SlotMem {}

/// The receiving side of one peer's channel.
pub(super) struct Inbound {
    pub(super) mem: Vec<SlotMem>,
    /// Per slot: number of the message it holds, plus one, once complete.
    pub(super) seq: Vec<AtomicU32>,
    pub(super) len: Vec<AtomicU32>,
    pub(super) tag: Vec<AtomicU32>,
    /// Per slot: parts of the pending message already in.
    arrived: Vec<AtomicU32>,
    /// Messages the executor has released.
    pub(super) consumed: AtomicU32,
    /// Set while the executor sleeps waiting for data.
    pub(super) recv_waiting: AtomicU32,
    /// Readers asleep waiting for a free slot.
    pub(super) reader_waiting: AtomicU32,
    pub(super) failed: AtomicBool,
    pub(super) reason: Mutex<String>,
    /// Connections from this peer still open, over all channels (kept in channel 0's ring); a clean close
    /// counts as a failure only once the last one
    /// has closed, so parts still arriving on the others are delivered.
    open: AtomicU32,
}

impl Inbound {
    pub(super) fn new(slots: usize, slot_bytes: usize, connections: usize) -> Inbound {
        let z = |_| AtomicU32::new(0);
        Inbound {
            mem: (0..slots).map(|_| SlotMem::new(slot_bytes)).collect(),
            seq: (0..slots).map(z).collect(),
            len: (0..slots).map(z).collect(),
            tag: (0..slots).map(z).collect(),
            arrived: (0..slots).map(z).collect(),
            consumed: AtomicU32::new(0),
            recv_waiting: AtomicU32::new(0),
            reader_waiting: AtomicU32::new(0),
            failed: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
            open: AtomicU32::new(connections as u32),
        }
    }

    fn fail(&self, reason: String) {
        let mut r = self.reason.lock();
        if !self.failed.load(Ordering::Acquire) {
            *r = reason;
            self.failed.store(true, Ordering::Release);
        }
        drop(r);
        for s in &self.seq {
            futex_wake(s);
        }
    }
}

/// State shared by the transport and its reader threads.
pub(super) struct Shared {
    pub(super) shutdown: AtomicBool,
    /// Per peer reached over TCP, per channel.
    pub(super) inbound: Vec<Option<Vec<Inbound>>>,
    /// Clones of every connection, so that shutdown or abort can close them from any thread.
    pub(super) sockets: Mutex<Vec<TcpStream>>,
}

impl Shared {
    pub(super) fn close_all(&self) {
        for s in self.sockets.lock().iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
        for ib in self.inbound.iter().flatten().flatten() {
            futex_wake(&ib.consumed);
        }
    }
}

/// Reads messages from connection `c` of peer `p` into its slots until the connection ends. The
/// connection belongs to channel `c / sockets_per_peer`, as its `j = c % sockets_per_peer`-th.
pub(super) fn reader(sh: Arc<Shared>, mut s: TcpStream, p: usize, c: usize, opts: TcpOptions) {
    let (ch, j) = (c / opts.sockets_per_peer, c % opts.sockets_per_peer);
    let Some(ib) = sh.inbound[p].as_ref().and_then(|v| v.get(ch)) else {
        return;
    };
    let slots = opts.slots as u32;
    let k = opts.sockets_per_peer as u32;
    let mut next: u32 = 0;
    let fail = |why: String| {
        if !sh.shutdown.load(Ordering::Acquire) {
            ib.fail(why);
        }
    };
    loop {
        let mut hb = [0u8; frame::PART_LEN];
        match read_full(&mut s, &mut hb) {
            Ok(true) => {}
            Ok(false) => {
                // Every connection of the peer, over all channels, counts: the others may still be
                // delivering what was sent before the close.
                let all = sh.inbound[p].as_deref().unwrap_or_default();
                if let Some(first) = all.first() {
                    if first.open.fetch_sub(1, Ordering::AcqRel) == 1
                        && !sh.shutdown.load(Ordering::Acquire)
                    {
                        for ib in all {
                            ib.fail("closed the connection".into());
                        }
                    }
                }
                return;
            }
            Err(e) => return fail(format!("connection failed: {e}")),
        }
        let h = match PartHeader::decode(&hb, next, j, opts.sockets_per_peer, opts.slot_bytes) {
            Ok(h) => h,
            Err(e) => return fail(format!("sent an invalid message header: {e}")),
        };
        // Wait until the slot's previous message has been released.
        loop {
            if next.wrapping_sub(ib.consumed.load(Ordering::Acquire)) < slots {
                break;
            }
            if sh.shutdown.load(Ordering::Acquire) {
                return;
            }
            ib.reader_waiting.fetch_add(1, Ordering::SeqCst);
            let seen = ib.consumed.load(Ordering::SeqCst);
            if next.wrapping_sub(seen) >= slots {
                futex_wait(&ib.consumed, seen, SLICE);
            }
            ib.reader_waiting.fetch_sub(1, Ordering::SeqCst);
        }
        let index = (next % slots) as usize;
        let mem = &ib.mem[index];
        let (off, n) = (h.offset as usize, h.part_len as usize);
        debug_assert!(off + n <= mem.len);
        // SAFETY: `off + n <= len <= slot_bytes` was validated by `PartHeader::decode`; the slot is free
        // (its previous message was released, checked above) and not yet published, and the parts of one
        // message cover disjoint ranges (`part_range`), so no one else touches these bytes now.
        let dst = unsafe { std::slice::from_raw_parts_mut(mem.ptr.add(off), n) };
        match read_full(&mut s, dst) {
            Ok(true) => {}
            Ok(false) => return fail("closed the connection in the middle of a message".into()),
            Err(e) => return fail(format!("connection failed: {e}")),
        }
        ib.len[index].store(h.len, Ordering::Relaxed);
        ib.tag[index].store(h.tag, Ordering::Relaxed);
        if ib.arrived[index].fetch_add(1, Ordering::AcqRel) + 1 == k {
            ib.arrived[index].store(0, Ordering::Relaxed);
            ib.seq[index].store(next.wrapping_add(1), Ordering::SeqCst);
            if ib.recv_waiting.load(Ordering::SeqCst) != 0 {
                futex_wake(&ib.seq[index]);
            }
        }
        next = next.wrapping_add(1);
    }
}

/// Fills `buf`; `Ok(false)` if the stream ended first (cleanly only before the first byte of an empty
/// read target is a non-issue: an empty buffer always succeeds).
fn read_full(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Ok(false),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}
