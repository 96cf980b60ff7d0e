//! braid-compress: the CPU reference gradient codecs.
//!
//! It owns the codecs ([`TopK`], [`ThresholdTopK`], [`RandomK`], [`Int8`], [`Sign`], [`Cast`] to fp16/bf16,
//! [`PowerSgd`], per layer with a [`Layout`]) behind the [`Codec`] trait, the value they produce ([`Compressed`]) with its stable byte
//! encoding ([`wire`]), error feedback ([`ErrorFeedback`]) and what users need to see about each step
//! ([`Stats`], [`Staleness`], [`warnings`]). Semantics are exact and documented down to rounding and the
//! random streams ([`rng`]), because GPU kernels are tested against these references. It performs no I/O,
//! starts no threads and contains no `unsafe` code.
//!
//! The defaults follow the seed's advice: top-k at 10% density with error feedback on, clipping (when asked
//! for) before compression, and warnings when the density gets low enough to hurt.
//!
//! ```
//! use braid_compress::{Compressed, ErrorFeedback, TopK};
//! let grad: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 - 50.0).collect();
//! let mut codec = TopK::default(); // 10% density
//! let mut ef = ErrorFeedback::new(grad.len()); // error feedback on
//! let (compressed, stats) = ef.step(&grad, &mut codec, 0).unwrap();
//! assert_eq!(stats.density, 0.1);
//! assert!(stats.wire_bytes < stats.dense_bytes);
//! assert!(stats.warnings(true).is_empty());
//!
//! // What travels is bytes; the receiver validates them before use.
//! let received = Compressed::decode(&compressed.encode()).unwrap();
//! let mut update = vec![0.0; grad.len()];
//! received.decompress(&mut update).unwrap();
//! assert_eq!(update, ef.last_update());
//! ```
#![forbid(unsafe_code)]

mod codec;
mod error;
mod feedback;
mod layout;
pub mod mx;
pub mod rng;
mod select;
mod spec;
mod warmup;
pub mod wire;

pub use codec::cast::Cast;
pub use codec::mx::Mx;
pub use codec::power_sgd::{self, PowerSgd};
pub use codec::quant::{Int8, Rounding, Sign, DEFAULT_BLOCK};
pub use codec::random_k::RandomK;
pub use codec::top_k::{top_k, ThresholdTopK, TopK, DEFAULT_DENSITY};
pub use codec::{k_for_density, Codec, Transport};
pub use error::{Error, Result};
pub use feedback::{
    l2_norm, warnings, ErrorFeedback, Staleness, StalenessHistogram, Stats, ADAPTIVE_MIN_DENSITY,
    LAGGING_MIN_DENSITY, STALENESS_BUCKETS,
};
pub use layout::Layout;
pub use select::random_k_indices;
pub use spec::{build_codec, echo_input, BoxedCodec, CodecSpec};
pub use warmup::DensityWarmup;
pub use wire::{Compressed, Payload, Piece};
