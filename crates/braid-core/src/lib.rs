//! braid-core: the vocabulary every other braid crate speaks.
//!
//! It owns the element types ([`DType`]), the reductions ([`ReduceOp`]), the error type shared by the
//! whole runtime ([`Error`]), the configuration read from `BRAID_*` environment variables ([`Config`])
//! and the CPU reduce kernels ([`reduce`]). It performs no I/O and contains no `unsafe` code.
//!
//! ```
//! use braid_core::{reduce, DType, ReduceOp};
//! let a = 1.5f32.to_ne_bytes();
//! let b = 2.0f32.to_ne_bytes();
//! let mut out = [0u8; 4];
//! reduce::reduce_ordered(DType::F32, ReduceOp::Sum, &mut out, &[reduce::Src::Buf(&a), reduce::Src::Buf(&b)]);
//! assert_eq!(f32::from_ne_bytes(out), 3.5);
//! ```
#![forbid(unsafe_code)]

pub mod alloc;
mod config;
mod dtype;
mod error;
pub mod exact;
pub mod reduce;

pub use config::{parse_bool, Config, DebugLevel, Limit};
pub use dtype::{DType, Element, ReduceOp};
pub use error::{Error, Result};
