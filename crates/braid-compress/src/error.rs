//! The error type of the codecs, the wire decoder and error feedback.

/// Everything that can go wrong. Every variant names what was wrong; nothing in this crate panics on input
/// it did not create itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A codec or error-feedback parameter is out of range.
    #[error("invalid parameter: {0}")]
    InvalidParameter(String),
    /// Bytes given to [`Compressed::decode`](crate::Compressed::decode) are not a valid encoding.
    #[error("malformed compressed tensor at byte {offset}: {detail}")]
    Malformed {
        /// Offset in the input where the problem was found.
        offset: usize,
        /// What was wrong.
        detail: String,
    },
    /// A payload given to [`Compressed::new`](crate::Compressed::new) breaks an invariant of its kind.
    #[error("invalid {kind} payload: {detail}")]
    InvalidPayload {
        /// The payload kind (`sparse`, `random-k`, `int8`, `sign`, `f16`, `bf16`, `low-rank`).
        kind: &'static str,
        /// The broken invariant.
        detail: String,
    },
    /// Two buffers that must have the same number of elements do not.
    #[error("length mismatch: {what} has {got} elements, expected {expected}")]
    LengthMismatch {
        /// The buffer that has the wrong length.
        what: &'static str,
        /// The length it must have.
        expected: usize,
        /// The length it has.
        got: usize,
    },
    /// Two compressed tensors cannot be added in their compressed form.
    #[error("cannot add compressed tensors: {0}")]
    NotSummable(String),
    /// State for a tensor of the size asked for cannot be allocated.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
}

/// `n` zeros for `what`, or [`Error::OutOfMemory`].
pub(crate) fn zeros<T: Clone + Default>(n: usize, what: &str) -> Result<Vec<T>> {
    braid_core::alloc::filled(T::default(), n, what).map_err(|e| match e {
        braid_core::Error::OutOfMemory(m) => Error::OutOfMemory(m),
        other => Error::OutOfMemory(other.to_string()),
    })
}

/// A result of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
