//! One error type for the whole runtime.
//!
//! The split follows NCCL: [`Error::InvalidArgument`] is returned before anything happens and leaves the
//! communicator usable; every other variant means the communicator may be out of step with its peers, so
//! it becomes sticky (see `Communicator::async_error`) and later calls fail fast with [`Error::Poisoned`].

/// A braid result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong. Variants name the rank, the peer, the collective and its sequence number
/// wherever those are known.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The call was rejected before it had any effect.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A wait passed its deadline.
    #[error("rank {rank}: {collective} #{seq} timed out after {waited_ms} ms waiting for rank {peer} ({what})")]
    Timeout {
        /// The rank that gave up.
        rank: usize,
        /// The rank that did not answer.
        peer: usize,
        /// The collective being run.
        collective: String,
        /// Its sequence number on this communicator (0 is the first).
        seq: u64,
        /// How long the wait lasted.
        waited_ms: u64,
        /// What was awaited (data or a credit).
        what: String,
    },
    /// A peer died, aborted or reported an error.
    #[error("rank {rank}: {collective} #{seq} failed: rank {peer} {reason}")]
    PeerFailed {
        /// The rank reporting.
        rank: usize,
        /// The rank that failed.
        peer: usize,
        /// The collective being run.
        collective: String,
        /// Its sequence number.
        seq: u64,
        /// What happened to the peer.
        reason: String,
    },
    /// `abort` was called on this communicator.
    #[error("rank {rank}: communicator aborted{during}")]
    Aborted {
        /// The rank reporting.
        rank: usize,
        /// Empty, or `" during <collective> #<seq>"`.
        during: String,
    },
    /// Peers disagree about what is being run (different collectives, counts or dtypes).
    #[error("rank {rank}: {collective} #{seq}: mismatch with rank {peer}: {detail}")]
    Mismatch {
        /// The rank reporting.
        rank: usize,
        /// The disagreeing peer.
        peer: usize,
        /// The collective this rank is running.
        collective: String,
        /// Its sequence number.
        seq: u64,
        /// Both sides' views.
        detail: String,
    },
    /// Creating the communicator failed.
    #[error("bootstrap failed: {0}")]
    Bootstrap(String),
    /// An operating-system call failed.
    #[error("{context}: {message}")]
    Io {
        /// What braid was doing.
        context: String,
        /// The OS error.
        message: String,
    },
    /// Memory that a call needs could not be allocated (the message says how much, for what).
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// An invariant of braid itself was broken (a bug); the communicator is unusable.
    #[error("internal error: {0}")]
    Internal(String),
    /// An earlier error left this communicator unusable.
    #[error("rank {rank}: communicator is unusable after an earlier error: {first}")]
    Poisoned {
        /// The rank reporting.
        rank: usize,
        /// The first error.
        first: String,
    },
}

impl Error {
    /// An [`Error::InvalidArgument`] with this message.
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// An [`Error::Io`] from an OS error and what was being done.
    pub fn io(context: impl Into<String>, err: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            message: err.to_string(),
        }
    }

    /// Whether the call was rejected without effect (the communicator stays usable).
    pub fn is_invalid_argument(&self) -> bool {
        matches!(self, Error::InvalidArgument(_))
    }
}
