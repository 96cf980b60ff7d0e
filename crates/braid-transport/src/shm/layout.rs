//! The geometry of a segment: [`Layout`], the offsets of its header, channel blocks and slots, and
//! how large a world's segments may grow ([`max_world`], [`MAX_SEGMENT_BYTES`]).

pub(super) const MAGIC: u64 = u64::from_le_bytes(*b"BRAIDshm");
pub(super) const VERSION: u32 = 2;
pub(super) const HEADER: usize = 4096;
pub(super) const CTRL: usize = 256;
/// Slot header: sequence number (the flag the receiver polls), length, tag; the payload follows in the
/// same cache line, so a small message crosses between cores as one line.
pub(super) const SLOT_HDR: usize = 16;
pub(super) const CACHE_LINE: usize = 64;

// Header offsets.
pub(super) const H_MAGIC: usize = 0;
pub(super) const H_VERSION: usize = 8;
pub(super) const H_WORLD: usize = 12;
pub(super) const H_OWNER: usize = 16;
pub(super) const H_PID: usize = 20;
pub(super) const H_SLOTS: usize = 24;
pub(super) const H_SLOT_BYTES: usize = 28;
pub(super) const H_CHANNELS: usize = 32;
/// 1 when the payload lives in device memory (the `ipc` transport), 0 when in the segment.
pub(super) const H_DEVICE: usize = 36;
pub(super) const H_FAILED: usize = 64;
/// Whom this rank is blocked waiting for (rank + 1; 0 when not blocked), so that a timing-out peer can
/// follow the chain of waits to the rank that is actually silent.
pub(super) const H_WAITING_ON: usize = 68;

// Slot header offsets.
pub(super) const S_SEQ: usize = 0;
pub(super) const S_LEN: usize = 4;
pub(super) const S_TAG: usize = 8;

// Channel control offsets, one cache line each: set by a receiver about to sleep; the credit counter
// (messages consumed) and the flag of a sender about to sleep.
pub(super) const C_RECV_WAITING: usize = 0;
pub(super) const C_CONSUMED: usize = 128;
pub(super) const C_SEND_WAITING: usize = 132;

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
    pub(super) fn slot_stride(&self) -> usize {
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
    pub(super) fn device_slot(&self, from: usize, ch: usize, index: usize) -> usize {
        ((from * self.channels + ch) * self.slots + index) * self.device_slot_stride()
    }
    /// Bytes of one rank's device payload allocation, rounded up to `granularity` (a power of two).
    pub fn device_bytes(&self, granularity: usize) -> usize {
        (self.world * self.channels * self.slots * self.device_slot_stride())
            .max(1)
            .next_multiple_of(granularity.max(1))
    }
    pub(super) fn channel_stride(&self) -> usize {
        CTRL + self.slots * self.slot_stride()
    }
    pub(super) fn channel(&self, from: usize, ch: usize) -> usize {
        HEADER + (from * self.channels + ch) * self.channel_stride()
    }
    pub(super) fn slot(&self, from: usize, ch: usize, index: usize) -> usize {
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
