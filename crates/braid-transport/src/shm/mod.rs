//! Shared-memory transport between processes on one host.
//!
//! Each rank owns one segment (a file in `/dev/shm`) that holds its *inbound* rings, `channels` per
//! peer. A ring is `slots` slots of `slot_bytes` bytes, each with a sequence word the sender bumps when
//! it posts the slot, plus a `consumed` counter the receiver bumps when it releases one (the credit). Senders map their peers' segments and write straight into the receiver's slot; the receiver
//! reduces from the slot in place. Counters are 32-bit futex words, so a waiter that has spun long enough
//! sleeps in the kernel and the other side wakes it only when it is actually asleep.
//!
//! Segments are unlinked as soon as every rank has mapped them (see [`Segment::unlink`]); from then on a
//! killed process leaves nothing behind in `/dev/shm`.
//!
//! Everything read from a segment that another process writes (header fields, slot lengths, tags) is
//! validated before it is used.
//!
//! With a [`DeviceMemory`](crate::DeviceMemory), the `ipc` transport ([`ipc`]) runs the same protocol
//! with each slot's payload in device memory: the segment keeps the sequence words, lengths, tags and
//! credits, and every rank's inbound payload rings are one device allocation its peers map from a file
//! descriptor or a legacy handle. Slots are then device spans, written and read only by a device engine; the executor posts
//! a slot after the kernel that filled it has finished and releases one after the kernel that read it.

use std::cell::Cell;
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use braid_core::Error;
use memmap2::MmapRaw;

use crate::device::DeviceAllocation;
use crate::link::{check_token, misuse, AbortHandle, Event, Link, LinkId, RecvSlot, SendSlot};
use crate::memory::Span;
use crate::plugin::{Connected, Peer, Prepared, Scope, SetupCtx, Transport};
use crate::wait::{
    futex_wake, peer_alive, peer_stopped, wait_until, PeerProcess, WaitCtx, WaitPolicy,
};

const MAGIC: u64 = u64::from_le_bytes(*b"BRAIDshm");
const VERSION: u32 = 2;
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
const H_CHANNELS: usize = 32;
/// 1 when the payload lives in device memory (the `ipc` transport), 0 when in the segment.
const H_DEVICE: usize = 36;
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
    /// Ranks in the communicator (`channels` inbound rings from each).
    pub world: usize,
    /// Independent rings per peer.
    pub channels: usize,
    /// Slots per ring (at least 2: a fused receive-and-forward holds its incoming slot until the next
    /// one frees).
    pub slots: usize,
    /// Payload bytes per slot.
    pub slot_bytes: usize,
    /// Whether payloads live in device memory (the segment then holds the slots' headers only).
    pub device: bool,
}

/// Device slots start at multiples of this, so kernels' vector accesses line up.
const DEVICE_SLOT_ALIGN: usize = 256;

impl Layout {
    fn slot_stride(&self) -> usize {
        if self.device {
            CACHE_LINE
        } else {
            (SLOT_HDR + self.slot_bytes).next_multiple_of(CACHE_LINE)
        }
    }
    fn device_slot_stride(&self) -> usize {
        self.slot_bytes.next_multiple_of(DEVICE_SLOT_ALIGN)
    }
    /// Offset of slot `index` of ring `ch` from `from` in the owner's device payload allocation.
    fn device_slot(&self, from: usize, ch: usize, index: usize) -> usize {
        ((from * self.channels + ch) * self.slots + index) * self.device_slot_stride()
    }
    /// Bytes of one rank's device payload allocation, rounded up to `granularity` (a power of two).
    pub fn device_bytes(&self, granularity: usize) -> usize {
        (self.world * self.channels * self.slots * self.device_slot_stride())
            .max(1)
            .next_multiple_of(granularity.max(1))
    }
    fn channel_stride(&self) -> usize {
        CTRL + self.slots * self.slot_stride()
    }
    fn channel(&self, from: usize, ch: usize) -> usize {
        HEADER + (from * self.channels + ch) * self.channel_stride()
    }
    fn slot(&self, from: usize, ch: usize, index: usize) -> usize {
        self.channel(from, ch) + CTRL + index * self.slot_stride()
    }
    /// Total bytes of the segment.
    pub fn size(&self) -> usize {
        HEADER + self.world * self.channels * self.channel_stride()
    }
}

/// The most bytes one rank's segment may span. Every rank maps the segment of each peer on its host, so
/// this keeps a host's mappings well within a process's address space (and a segment within reason for
/// `/dev/shm`).
pub const MAX_SEGMENT_BYTES: usize = 256 << 30;

/// The largest world whose segments, with `channels` rings per peer of `slots` slots of `slot_bytes`
/// bytes, stay within [`MAX_SEGMENT_BYTES`] (at least 1: a single rank needs no segment).
pub fn max_world(channels: usize, slots: usize, slot_bytes: usize) -> usize {
    let probe = Layout {
        world: 1,
        channels,
        slots,
        slot_bytes,
        device: false,
    };
    let per_peer = channels.saturating_mul(probe.channel_stride()).max(1);
    ((MAX_SEGMENT_BYTES - HEADER) / per_peer).max(1)
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
        seg.word(H_CHANNELS)
            .store(layout.channels as u32, Ordering::Relaxed);
        seg.word(H_DEVICE)
            .store(u32::from(layout.device), Ordering::Relaxed);
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
            (
                "channels",
                seg.word(H_CHANNELS).load(Ordering::Relaxed) as usize,
                layout.channels,
            ),
            (
                "device payload",
                seg.word(H_DEVICE).load(Ordering::Relaxed) as usize,
                usize::from(layout.device),
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

    fn ctrl(&self, from: usize, ch: usize, field: usize) -> &AtomicU32 {
        self.word(self.layout.channel(from, ch) + field)
    }

    fn failed(&self) -> bool {
        self.word(H_FAILED).load(Ordering::Acquire) != 0
    }

    /// The sequence word of slot `index` of ring `ch` from `from`.
    fn slot_seq(&self, from: usize, ch: usize, index: usize) -> &AtomicU32 {
        self.word(self.layout.slot(from, ch, index) + S_SEQ)
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

pub mod ipc;
pub mod protocol;
pub mod window;

#[cfg(test)]
mod ipc_tests;
#[cfg(test)]
mod tests;
