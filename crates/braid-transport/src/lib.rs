//! braid-transport: the one primitive every algorithm runs on, and the transports that offer it.
//!
//! A sender reserves a slot that the *receiver* owns, writes into it and posts it with a length and a
//! tag; the receiver waits for the post, reads the slot in place and releases it, which returns a credit
//! to the sender. NCCL's connectors, MSCCL++'s channels and RDMA write-with-immediate are this same idea;
//! [`Link`] is its one interface, with several independent channels per pair of ranks so that several
//! operations can be in flight at once.
//!
//! Each transport is one module implementing [`Link`] and the setup stages of [`plugin`] (which [`setup`] composes):
//!
//! - [`shm`]: shared memory between processes of one host (futex words in a segment per rank); with a
//!   [`DeviceMemory`], the same protocol with the slots' payload in device memory shared between the
//!   processes by file descriptor or legacy handle (the `ipc` transport: CUDA IPC);
//! - [`tcp`]: TCP between any two ranks (reader threads place parts straight into the receiver's slots);
//! - `rdma` (cargo feature `rdma`): RDMA writes with immediate over reliable-connected queue pairs
//!   (InfiniBand, RoCE), into slots the receiver registered;
//! - [`mem`]: in one process, with virtual time and injected faults (latency, a killed or a stalled
//!   rank), for the simulator and tests.
//!
//! [`Router`] puts one rank's links behind a single [`Link`], and [`transports`] lists the transports a
//! configuration allows, in order of preference, so that nothing above this crate names a transport.
//!
//! ```
//! use braid_transport::mem::MemNet;
//! use braid_transport::{recv_with, send_bytes, Link, WaitCtx};
//! use std::sync::atomic::AtomicBool;
//! use std::time::{Duration, Instant};
//! let net = MemNet::new(2, 1, 4, 64);
//! let (a, b) = (net.link(0), net.link(1));
//! let abort = AtomicBool::new(false);
//! let now = Instant::now();
//! let ctx = WaitCtx { rank: 0, collective: "example", seq: 0, deadline: now + Duration::from_secs(5), started: now, abort: &abort };
//! send_bytes(&a, 1, 0, b"hello", 7, &ctx).unwrap();
//! let got = recv_with(&b, 0, 0, &ctx, |bytes, tag| (bytes.to_vec(), tag)).unwrap();
//! assert_eq!(got, (b"hello".to_vec(), 7));
//! ```

pub mod device;
pub mod greet;
mod link;
pub mod mem;
pub mod memory;
pub mod plugin;
pub mod rdma;
mod registry;
mod router;
pub mod setup;
pub mod shm;
pub mod tcp;
mod wait;

pub use device::{DeviceAllocation, DeviceMemory, EmulatedDevice};
pub use link::{recv_with, send_bytes, AbortHandle, Event, Link, LinkId, RecvSlot, SendSlot};
pub use memory::{MemKind, Span};
pub use plugin::{Endpoint, Geometry, Peer, SetupCtx};
pub use registry::{check_world, transport_names, transports, TransportChoice};
pub use router::Router;
pub use setup::{Connecting, Setup};
pub use wait::{peer_alive, peer_stopped, PeerProcess, Stamp, WaitCtx, WaitPolicy};
