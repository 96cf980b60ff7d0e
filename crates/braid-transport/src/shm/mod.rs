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

mod layout;
mod link;
mod segment;
mod setup;

pub mod ipc;
pub mod protocol;
pub mod window;

pub use layout::{max_world, Layout, MAX_SEGMENT_BYTES};
pub use link::{DevicePlane, Mappings, ShmLink};
pub use segment::{sweep_stale, Segment};
pub use setup::Shm;

#[cfg(test)]
mod ipc_tests;
#[cfg(test)]
mod tests;
