//! Shared-memory transport between processes on one host.
//!
//! Each rank owns one segment (a file in `/dev/shm`) that holds its *inbound* channels, one per peer.
//! A channel is a ring of `slots` slots of `slot_bytes` bytes plus two counters: `posted`, bumped by the
//! sender when a slot is full, and `consumed`, bumped by the receiver when it is done with one (the
//! credit). Senders map their peers' segments and write straight into the receiver's slot; the receiver
//! reduces from the slot in place. Counters are 32-bit futex words, so a waiter that has spun long enough
//! sleeps in the kernel and the other side wakes it only when it is actually asleep.
//!
//! Segments are unlinked as soon as every rank has mapped them (see [`Segment::unlink`]); from then on a
//! killed process leaves nothing behind in `/dev/shm`.
//!
//! Everything read from a segment that another process writes (header fields, slot lengths, tags) is
//! validated before it is used.

use std::cell::Cell;
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use braid_core::Error;
use memmap2::MmapRaw;

use crate::wait::{futex_wake, peer_alive, peer_stopped, wait_until, WaitCtx, WaitPolicy};

const MAGIC: u64 = u64::from_le_bytes(*b"BRAIDshm");
const VERSION: u32 = 1;
const HEADER: usize = 4096;
const CTRL: usize = 256;
/// Slot header: sequence number (the flag the receiver polls), length, tag; the payload follows in the
/// same cache line, so a small message crosses between cores as one line.
const SLOT_HDR: usize = 16;
const CACHE_LINE: usize = 64;

// Header offsets.
const H_MAGIC: usize = 0;
const H_VERSION: usize = 8;
const H_WORLD: usize = 12;
const H_OWNER: usize = 16;
const H_PID: usize = 20;
const H_SLOTS: usize = 24;
const H_SLOT_BYTES: usize = 28;
const H_FAILED: usize = 64;
/// Whom this rank is blocked waiting for (rank + 1; 0 when not blocked), so that a timing-out peer can
/// follow the chain of waits to the rank that is actually silent.
const H_WAITING_ON: usize = 68;

// Slot header offsets.
const S_SEQ: usize = 0;
const S_LEN: usize = 4;
const S_TAG: usize = 8;

// Channel control offsets, one cache line each: set by a receiver about to sleep; the credit counter
// (messages consumed) and the flag of a sender about to sleep.
const C_RECV_WAITING: usize = 0;
const C_CONSUMED: usize = 128;
const C_SEND_WAITING: usize = 132;

/// The geometry of a segment; every rank of a communicator uses the same one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Ranks in the communicator (one inbound channel each).
    pub world: usize,
    /// Slots per channel (at least 2; see `braid_sched::sim::run`).
    pub slots: usize,
    /// Payload bytes per slot.
    pub slot_bytes: usize,
}

impl Layout {
    fn slot_stride(&self) -> usize {
        (SLOT_HDR + self.slot_bytes).next_multiple_of(CACHE_LINE)
    }
    fn channel_stride(&self) -> usize {
        CTRL + self.slots * self.slot_stride()
    }
    fn channel(&self, from: usize) -> usize {
        HEADER + from * self.channel_stride()
    }
    fn slot(&self, from: usize, index: usize) -> usize {
        self.channel(from) + CTRL + index * self.slot_stride()
    }
    /// Total bytes of the segment.
    pub fn size(&self) -> usize {
        HEADER + self.world * self.channel_stride()
    }
}

/// One rank's inbound segment, mapped into this process.
pub struct Segment {
    map: MmapRaw,
    path: PathBuf,
    layout: Layout,
    owner: usize,
    pid: u32,
}

// SAFETY: the mapping is shared memory accessed only through atomics and through slot slices whose
// exclusive use the slot protocol guarantees; the struct itself is immutable after construction.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates the segment of rank `owner` at `path` (which must not exist), sized for `layout`.
    pub fn create(path: &Path, layout: Layout, owner: usize) -> Result<Segment, Error> {
        let ctx = || format!("creating shared-memory segment {}", path.display());
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| Error::io(ctx(), e))?;
        let setup = || -> Result<MmapRaw, Error> {
            file.set_len(layout.size() as u64)
                .map_err(|e| Error::io(ctx(), e))?;
            MmapRaw::map_raw(&file).map_err(|e| Error::io(ctx(), e))
        };
        let map = match setup() {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(e);
            }
        };
        let pid = std::process::id();
        let seg = Segment {
            map,
            path: path.to_owned(),
            layout,
            owner,
            pid,
        };
        seg.word(H_VERSION).store(VERSION, Ordering::Relaxed);
        seg.word(H_WORLD)
            .store(layout.world as u32, Ordering::Relaxed);
        seg.word(H_OWNER).store(owner as u32, Ordering::Relaxed);
        seg.word(H_PID).store(pid, Ordering::Relaxed);
        seg.word(H_SLOTS)
            .store(layout.slots as u32, Ordering::Relaxed);
        seg.word(H_SLOT_BYTES)
            .store(layout.slot_bytes as u32, Ordering::Relaxed);
        seg.word64(H_MAGIC).store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Maps rank `owner`'s segment at `path` and checks that its header matches `layout`.
    pub fn open(path: &Path, layout: Layout, owner: usize) -> Result<Segment, Error> {
        let ctx = || {
            format!(
                "mapping rank {owner}'s shared-memory segment {}",
                path.display()
            )
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(ctx(), e))?;
        let len = file.metadata().map_err(|e| Error::io(ctx(), e))?.len();
        if len != layout.size() as u64 {
            return Err(Error::Bootstrap(format!(
                "{}: size {len}, expected {}",
                ctx(),
                layout.size()
            )));
        }
        let map = MmapRaw::map_raw(&file).map_err(|e| Error::io(ctx(), e))?;
        let mut seg = Segment {
            map,
            path: path.to_owned(),
            layout,
            owner,
            pid: 0,
        };
        let magic = seg.word64(H_MAGIC).load(Ordering::Acquire);
        let fields = [
            (
                "version",
                seg.word(H_VERSION).load(Ordering::Relaxed) as usize,
                VERSION as usize,
            ),
            (
                "world",
                seg.word(H_WORLD).load(Ordering::Relaxed) as usize,
                layout.world,
            ),
            (
                "owner",
                seg.word(H_OWNER).load(Ordering::Relaxed) as usize,
                owner,
            ),
            (
                "slots",
                seg.word(H_SLOTS).load(Ordering::Relaxed) as usize,
                layout.slots,
            ),
            (
                "slot bytes",
                seg.word(H_SLOT_BYTES).load(Ordering::Relaxed) as usize,
                layout.slot_bytes,
            ),
        ];
        if magic != MAGIC {
            return Err(Error::Bootstrap(format!("{}: not a braid segment", ctx())));
        }
        for (name, got, want) in fields {
            if got != want {
                return Err(Error::Bootstrap(format!(
                    "{}: {name} is {got}, expected {want}",
                    ctx()
                )));
            }
        }
        seg.pid = seg.word(H_PID).load(Ordering::Relaxed);
        Ok(seg)
    }

    /// Removes the segment's name; the memory stays mapped until every process unmaps it.
    pub fn unlink(&self) -> Result<(), Error> {
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(format!("unlinking {}", self.path.display()), e)),
        }
    }

    /// The segment's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The pid of the process that created the segment.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    fn word(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.layout.size());
        // SAFETY: in bounds and 4-aligned (the mapping is page-aligned); the mapping lives as long as
        // `self`; all cross-process access to control words is atomic.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU32) }
    }

    fn word64(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.layout.size());
        // SAFETY: as in `word`, 8-aligned.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) }
    }

    fn ctrl(&self, from: usize, field: usize) -> &AtomicU32 {
        self.word(self.layout.channel(from) + field)
    }

    fn failed(&self) -> bool {
        self.word(H_FAILED).load(Ordering::Acquire) != 0
    }

    /// The sequence word of slot `index` of the channel from `from`.
    fn slot_seq(&self, from: usize, index: usize) -> &AtomicU32 {
        self.word(self.layout.slot(from, index) + S_SEQ)
    }

    /// Raw pointer to slot `index` of the channel from `from`: its header, then the payload.
    fn slot_ptr(&self, from: usize, index: usize) -> *mut u8 {
        let off = self.layout.slot(from, index);
        assert!(off + self.layout.slot_stride() <= self.layout.size());
        // SAFETY: `off` plus a whole slot is within the mapping, checked above.
        unsafe { self.map.as_mut_ptr().add(off) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.owner_is_me() {
            let _ = self.unlink();
        }
    }
}

impl Segment {
    fn owner_is_me(&self) -> bool {
        self.pid == std::process::id()
            && self.word(H_OWNER).load(Ordering::Relaxed) as usize == self.owner
    }
}

/// Removes segments in `dir` left behind by processes that no longer exist (killed before they could
/// remove their own), and returns how many it removed. Segments of live processes, foreign files and
/// segments still being created are left alone.
pub fn sweep_stale(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with("braid-") || name.starts_with("braid-test-") {
            continue;
        }
        let Ok(bytes) = std::fs::File::open(e.path()).and_then(|mut f| {
            let mut b = [0u8; H_PID + 4];
            std::io::Read::read_exact(&mut f, &mut b).map(|_| b)
        }) else {
            continue;
        };
        let magic = u64::from_ne_bytes(bytes[H_MAGIC..H_MAGIC + 8].try_into().expect("8 bytes"));
        let pid = u32::from_ne_bytes(bytes[H_PID..H_PID + 4].try_into().expect("4 bytes"));
        if magic == MAGIC && pid != 0 && !peer_alive(pid) && std::fs::remove_file(e.path()).is_ok()
        {
            tracing::info!(
                "removed {} left behind by process {pid}",
                e.path().display()
            );
            removed += 1;
        }
    }
    removed
}

/// The mappings of a transport, shareable with other threads so that `abort` can wake a blocked wait.
pub struct Mappings {
    rank: usize,
    own: Segment,
    peers: Vec<Option<Segment>>,
}

impl Mappings {
    /// Marks this rank failed (so peers stop waiting for it) and wakes every wait on this rank's
    /// channels, in this process and in peers.
    pub fn fail_and_wake(&self) {
        self.own.word(H_FAILED).store(1, Ordering::Release);
        self.wake_all();
    }

    /// Wakes every wait on this rank's channels without marking anything.
    pub fn wake_all(&self) {
        for (p, peer) in self.peers.iter().enumerate() {
            if let Some(peer) = peer {
                for i in 0..self.own.layout.slots {
                    futex_wake(self.own.slot_seq(p, i));
                    futex_wake(peer.slot_seq(self.rank, i));
                }
                futex_wake(self.own.ctrl(p, C_CONSUMED));
                futex_wake(peer.ctrl(self.rank, C_CONSUMED));
            }
        }
    }
}

/// The shared-memory transport of one rank: its own inbound segment and its peers', plus the local
/// sequence counters. It is used by one thread at a time (it is `Send`, not `Sync`).
pub struct ShmTransport {
    maps: Arc<Mappings>,
    layout: Layout,
    policy: WaitPolicy,
    sent: Vec<Cell<u32>>,
    recvd: Vec<Cell<u32>>,
    /// The last credit counter read from each peer, so a sender with credits left reads nothing remote.
    credit_seen: Vec<Cell<u32>>,
    reserved: Vec<Cell<bool>>,
    tag: Cell<u32>,
    /// Whether this rank has published a wait in its header.
    blocked: Cell<bool>,
}

impl ShmTransport {
    /// Builds the transport from this rank's own segment and the mapped segments of its peers
    /// (`peers[rank]` must be `None`).
    pub fn new(own: Segment, peers: Vec<Option<Segment>>, policy: WaitPolicy) -> ShmTransport {
        let layout = own.layout;
        let rank = own.owner;
        assert_eq!(peers.len(), layout.world);
        assert!(peers[rank].is_none());
        let n = layout.world;
        ShmTransport {
            maps: Arc::new(Mappings { rank, own, peers }),
            layout,
            policy,
            sent: (0..n).map(|_| Cell::new(0)).collect(),
            recvd: (0..n).map(|_| Cell::new(0)).collect(),
            credit_seen: (0..n).map(|_| Cell::new(0)).collect(),
            reserved: (0..n).map(|_| Cell::new(false)).collect(),
            tag: Cell::new(0),
            blocked: Cell::new(false),
        }
    }

    /// The handle other threads use to wake or fail this transport.
    pub fn mappings(&self) -> Arc<Mappings> {
        self.maps.clone()
    }

    /// Payload capacity of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.layout.slot_bytes
    }

    /// Sets the tag stamped on every message from now on (the collective's sequence number); a received
    /// message with another tag is a mismatch between ranks.
    pub fn set_tag(&self, tag: u32) {
        self.tag.set(tag);
    }

    fn peer(&self, p: usize) -> &Segment {
        self.maps.peers[p].as_ref().expect("no channel to self")
    }

    /// Called between sleeps of a blocked wait: publishes whom we wait for, and checks that peer.
    fn check_peer(&self, ctx: &WaitCtx<'_>, p: usize) -> Result<(), Error> {
        if !self.blocked.get() {
            self.blocked.set(true);
            self.maps
                .own
                .word(H_WAITING_ON)
                .store(p as u32 + 1, Ordering::Release);
        }
        let seg = self.peer(p);
        if seg.failed() {
            return Err(ctx.peer_failed(p, "failed or aborted"));
        }
        if !peer_alive(seg.pid()) {
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
                        match self.maps.peers[cur].as_ref() {
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

    /// Waits for a free slot in `to`'s channel from this rank and hands it out for writing.
    pub fn send_slot(&self, to: usize, ctx: &WaitCtx<'_>) -> Result<SendSlot<'_>, Error> {
        assert!(!self.reserved[to].get(), "slot to rank {to} reserved twice");
        let seg = self.peer(to);
        let me = self.maps.rank;
        let consumed = seg.ctrl(me, C_CONSUMED);
        let s = self.sent[to].get();
        let slots = self.layout.slots as u32;
        if s.wrapping_sub(self.credit_seen[to].get()) >= slots {
            let has_credit = || {
                let c = consumed.load(Ordering::Acquire);
                self.credit_seen[to].set(c);
                s.wrapping_sub(c) < slots
            };
            let r = wait_until(
                &self.policy,
                ctx,
                to,
                "a free slot",
                consumed,
                seg.ctrl(me, C_SEND_WAITING),
                has_credit,
                || self.check_peer(ctx, to),
            );
            self.end_wait(r)?;
        }
        let ptr = seg.slot_ptr(me, (s % slots) as usize);
        self.reserved[to].set(true);
        // SAFETY: the slot is ours until posted: the receiver has consumed it (credit checked above) and
        // will not touch it before `posted` moves past it; `reserved` prevents handing it out twice.
        let data =
            unsafe { std::slice::from_raw_parts_mut(ptr.add(SLOT_HDR), self.layout.slot_bytes) };
        Ok(SendSlot {
            t: self,
            to,
            hdr: ptr,
            data,
        })
    }

    /// Waits for the next message from `from` and returns it in place.
    pub fn recv(&self, from: usize, ctx: &WaitCtx<'_>) -> Result<RecvSlot<'_>, Error> {
        let own = &self.maps.own;
        let r = self.recvd[from].get();
        let index = (r % self.layout.slots as u32) as usize;
        let seq = own.slot_seq(from, index);
        let want = r.wrapping_add(1);
        let r = wait_until(
            &self.policy,
            ctx,
            from,
            "data",
            seq,
            own.ctrl(from, C_RECV_WAITING),
            || seq.load(Ordering::Acquire) == want,
            || self.check_peer(ctx, from),
        );
        self.end_wait(r)?;
        let ptr = own.slot_ptr(from, index);
        // SAFETY: the slot header is within the mapping; the sender wrote it before the Release store of
        // the sequence word that the Acquire load above observed.
        let (len, tag) = unsafe {
            (
                ptr.add(S_LEN).cast::<u32>().read_volatile(),
                ptr.add(S_TAG).cast::<u32>().read_volatile(),
            )
        };
        let mismatch = |detail: String| Error::Mismatch {
            rank: self.maps.rank,
            peer: from,
            collective: ctx.collective.to_string(),
            seq: ctx.seq,
            detail,
        };
        if len as usize > self.layout.slot_bytes {
            return Err(mismatch(format!(
                "message of {len} bytes exceeds the slot size {}",
                self.layout.slot_bytes
            )));
        }
        if tag != self.tag.get() {
            return Err(mismatch(format!(
                "message belongs to collective #{tag}, this rank is at #{}",
                self.tag.get()
            )));
        }
        // SAFETY: `len` was checked against the slot size; the sender will not write this slot again
        // until we return the credit in `RecvSlot::drop`.
        let data = unsafe { std::slice::from_raw_parts(ptr.add(SLOT_HDR), len as usize) };
        Ok(RecvSlot {
            t: self,
            from,
            data,
        })
    }
}

/// A reserved slot in a peer's segment; write the payload, then [`SendSlot::post`] it.
pub struct SendSlot<'a> {
    t: &'a ShmTransport,
    to: usize,
    hdr: *mut u8,
    data: &'a mut [u8],
}

impl SendSlot<'_> {
    /// The slot's payload area (its capacity is the slot size).
    pub fn data(&mut self) -> &mut [u8] {
        self.data
    }

    /// Publishes the first `len` bytes to the receiver.
    pub fn post(self, len: usize) {
        assert!(
            len <= self.data.len(),
            "posting {len} bytes into a slot of {}",
            self.data.len()
        );
        let t = self.t;
        let me = t.maps.rank;
        // SAFETY: `hdr` points at this slot's header, which we own until the store below.
        unsafe {
            self.hdr.add(S_LEN).cast::<u32>().write_volatile(len as u32);
            self.hdr
                .add(S_TAG)
                .cast::<u32>()
                .write_volatile(t.tag.get());
        }
        let seg = t.peer(self.to);
        let s = t.sent[self.to].get();
        t.sent[self.to].set(s.wrapping_add(1));
        let seq = seg.slot_seq(me, (s % t.layout.slots as u32) as usize);
        seq.store(s.wrapping_add(1), Ordering::SeqCst);
        if seg.ctrl(me, C_RECV_WAITING).load(Ordering::SeqCst) != 0 {
            futex_wake(seq);
        }
    }
}

impl Drop for SendSlot<'_> {
    fn drop(&mut self) {
        self.t.reserved[self.to].set(false);
    }
}

/// A received message, read in place; dropping it returns the slot to the sender.
pub struct RecvSlot<'a> {
    t: &'a ShmTransport,
    from: usize,
    data: &'a [u8],
}

impl RecvSlot<'_> {
    /// The payload.
    pub fn data(&self) -> &[u8] {
        self.data
    }
}

impl Drop for RecvSlot<'_> {
    fn drop(&mut self) {
        let t = self.t;
        let own = &t.maps.own;
        let r = t.recvd[self.from].get().wrapping_add(1);
        t.recvd[self.from].set(r);
        own.ctrl(self.from, C_CONSUMED).store(r, Ordering::SeqCst);
        if own.ctrl(self.from, C_SEND_WAITING).load(Ordering::SeqCst) != 0 {
            futex_wake(own.ctrl(self.from, C_CONSUMED));
        }
    }
}

#[cfg(test)]
mod tests;
