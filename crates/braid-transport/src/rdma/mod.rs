//! The RDMA transport (cargo feature `rdma`): reliable-connected queue pairs and RDMA writes with
//! immediate, over InfiniBand or RoCE (Soft-RoCE included), through libibverbs. Its pure parts
//! ([`wire`]: the device filter, the endpoint, the connection message, immediates, slot headers,
//! striping) are built without the feature too, for tests and fuzzing.
//!
//! The primitive is the one every link offers, mapped onto verbs:
//!
//! - The *receiver* owns a registered ring of slots per (peer, channel). The sender fills a slot of a
//!   registered staging ring that mirrors it, then RDMA-writes the slot (a 16-byte [`wire::Header`]
//!   with length, tag and message number, then the payload) into the receiver's ring, *with
//!   immediate*: the immediate names channel, slot and how many parts the message took
//!   ([`wire::Imm`]), and its completion on the receiver's queue is the "posted" signal. A large
//!   message is striped over `BRAID_IB_QPS_PER_PEER` queue pairs, one part on each.
//! - Releasing a slot returns the credit with an RDMA write of the release counter into the
//!   sender's registered credit word, with an immediate too, so that a sender that waits for credit
//!   wakes on its completion queue.
//! - Waits spin on the completion queue, then block on the completion channel's descriptor with
//!   `poll`, in slices that check the deadline, the abort flag and the peer: its connection socket
//!   (closed when its process ends, on any host) and failed completions (a flushed or retried-out
//!   queue pair, a remote access error).
//!
//! Setup follows the typed stages of [`crate::setup`]: `prepare` opens the device (chosen by
//! `BRAID_IB_HCA`), its port and GID (RoCE v2 by default, `BRAID_IB_GID_INDEX`) and a listening
//! socket, and publishes `device:port@address`; `connect` registers the rings, creates the queue
//! pairs (INIT, receives posted), swaps a [`wire::Connect`] message with every peer over that socket
//! (queue pair numbers, GID, addresses and keys, checked against the communicator's secret and
//! geometry), and moves every queue pair to RTR and RTS. The first write is posted only after every
//! rank has connected (the activation barrier), so no packet reaches a queue pair that is not ready.

#[cfg(feature = "rdma")]
mod link;
mod options;
#[cfg(feature = "rdma")]
mod setup;
#[cfg(feature = "rdma")]
pub mod verbs;
pub mod wire;

#[cfg(feature = "rdma")]
pub use link::RdmaLink;
pub use options::IbOptions;
#[cfg(feature = "rdma")]
pub use setup::{choose_port, survey, usable, PortChoice, Rdma};
