//! The TCP transport: the same primitive as shared memory, for peers on other hosts.
//!
//! Every rank listens on one socket ([`TcpEndpoint`]) whose address travels in the bootstrap table.
//! For each peer it reaches over TCP, a rank opens `sockets_per_peer` connections of its own and sends
//! on them; it receives on the connections the peer opened. A connection starts with a [`Hello`] that
//! carries the communicator's secret and is refused without it.
//!
//! The receiver owns the slots, as with shared memory: one reader thread per inbound connection reads
//! each part header, validates it, waits until the slot it names has been released, and then reads the
//! payload straight into that slot. When the last part of a message is in, the slot is published with
//! the same sequence-word protocol the shared-memory channel uses, and the executor waits on it in the
//! same way (spin, yield, futex, with deadline and failure checks). A reader that cannot place a part
//! stops reading, so TCP flow control holds the sender back: the credit is the socket's window.
//!
//! The sender writes header and payload with one vectored `sendmsg` per part, on the executor's thread,
//! in 5 ms slices so that a deadline, an abort or a reset connection ends the wait. The kernel's send
//! buffer lets it run ahead of the network.

mod conn;
pub mod frame;
mod ifaddr;
mod link;
mod reader;
mod setup;

// The RDMA transport exchanges its connection messages over a connection dialed with it.
#[cfg(feature = "rdma")]
pub(crate) use conn::connect_until;
pub use conn::{connected_to_itself, same_secret, TcpOptions};
pub use frame::{Hello, PartHeader};
pub use ifaddr::{choose_ip, interfaces};
pub use link::TcpLink;
pub use setup::{Tcp, TcpEndpoint};

#[cfg(test)]
mod tests;
