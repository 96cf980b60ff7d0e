//! braid-transport: the one primitive every algorithm runs on.
//!
//! Transports: shared memory between ranks of one host ([`shm`]) and TCP between hosts ([`tcp`]);
//! [`Transport`] puts them behind one interface, routing each peer to one of them.
//!
//! A sender reserves a slot that the *receiver* owns ([`shm::ShmTransport::send_slot`]), writes into it and
//! posts it with a length and a tag; the receiver waits for the post ([`shm::ShmTransport::recv`]), reads
//! the slot in place and releases it, which returns a credit to the sender. NCCL's connectors, MSCCL++'s
//! channels and RDMA write-with-immediate are this same idea; a transport that offers it runs every
//! schedule.
//!
//! The guards encode the protocol: a [`shm::SendSlot`] can only be posted once, a [`shm::RecvSlot`]
//! returns its credit when dropped, and slots are never handed out twice.
//!
//! Every wait spins briefly, then yields, then blocks on a futex in the shared segment, and wakes at least
//! every few milliseconds to check its deadline, an abort request and whether the peer is still alive.

pub mod shm;
pub mod tcp;
mod transport;
mod wait;

pub use transport::{Handle, RecvSlot, Route, SendSlot, Transport};
pub use wait::{peer_alive, peer_stopped, WaitCtx, WaitPolicy};
