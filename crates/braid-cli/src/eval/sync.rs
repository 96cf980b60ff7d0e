//! Gradient synchronisation behind one small trait, so the trainer does not care how gradients travel.
//!
//! [`DenseSync`] averages with a plain all-reduce. [`CompressedSync`] calls the communicator's compressed
//! all-reduce (sum-closed codecs ride the ring, top-k is all-gathered, int8/sign go two-phase, PowerSGD
//! all-reduces its factors). [`GatherSync`] is the reference it is compared with: each rank compresses
//! locally with `braid_compress` (its own [`ErrorFeedback`] and codec), the encoded bytes are all-gathered,
//! and every rank decodes and sums all contributions in rank order, so all ranks apply bit-identical
//! updates.

use std::fmt;
use std::str::FromStr;

use braid::{
    CodecSpec, Communicator, CompressionConfig, DType, Error, GradientCompressor, ReduceOp,
};
use braid_compress::{
    echo_input, Cast, Codec, Compressed, ErrorFeedback, Int8, Layout, PowerSgd, RandomK, Sign, TopK,
};

/// What one synchronisation did, as seen by this rank.
#[derive(Clone, Debug, Default)]
pub struct SyncInfo {
    /// Bytes this rank put on the wire, counted as ring algorithms move them.
    pub sent_bytes: u64,
    /// L2 norm of this rank's gradient before compression.
    pub grad_norm: f64,
    /// Relative compression error of this rank's contribution (0 when dense).
    pub compression_error: f64,
    /// Fraction of this rank's contribution that is non-zero.
    pub density: f64,
    /// The seed's warnings for this step (low density with an adaptive optimizer, lagging parameters).
    pub warnings: Vec<String>,
}

/// Makes every rank's gradient buffer the average of all ranks' gradients (or an approximation of it).
pub trait GradSync {
    /// Replaces `grad` by the synchronised gradient; `step` keys the codecs' random streams.
    fn sync(&mut self, comm: &Communicator, grad: &mut [f32], step: u64)
        -> Result<SyncInfo, Error>;
}

/// A codec choice, as written on the command line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CodecChoice {
    /// No compression: all-reduce in f32.
    Dense,
    /// Cast to fp16.
    Fp16,
    /// Cast to bf16.
    Bf16,
    /// Keep the largest-magnitude fraction.
    TopK(f32),
    /// Keep a random fraction (the same indices on every rank).
    RandomK(f32),
    /// Int8 with per-block scales, stochastic or nearest rounding.
    Int8 { stochastic: bool },
    /// 1-bit sign with per-block mean magnitude.
    Sign,
    /// PowerSGD of the given rank; in this adapter each rank factorises its own residual.
    PowerSgd(usize),
}

/// A codec and whether error feedback is on: one row of the evaluation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Setting {
    /// The codec.
    pub codec: CodecChoice,
    /// Error feedback on (ignored for dense).
    pub error_feedback: bool,
}

fn density(s: &str, what: &str) -> Result<f32, String> {
    let d: f32 = s
        .parse()
        .map_err(|_| format!("{what} density {} is not a number", echo_input(s)))?;
    if d > 0.0 && d <= 1.0 {
        Ok(d)
    } else {
        Err(format!(
            "{what} density must be in (0, 1], got {}",
            echo_input(s)
        ))
    }
}

impl FromStr for Setting {
    type Err = String;

    /// `CODEC[:PARAM][/ef|/noef]`: `dense` (or `none`), `fp16`, `bf16`, `topk:0.1`, `randomk:0.1`, `int8`
    /// (stochastic rounding), `int8:nearest`, `sign`, `powersgd:4`. Error feedback is on unless `/noef`.
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim().to_ascii_lowercase();
        let (spec, ef) = match s.split_once('/') {
            None => (s.as_str(), true),
            Some((spec, "ef")) => (spec, true),
            Some((spec, "noef")) => (spec, false),
            Some((_, other)) => {
                return Err(format!(
                    "{}: unknown suffix /{} (expected /ef or /noef)",
                    echo_input(&s),
                    echo_input(other)
                ))
            }
        };
        let (name, param) = match spec.split_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (spec, None),
        };
        let codec = match (name, param) {
            ("dense" | "none", None) => CodecChoice::Dense,
            ("fp16", None) => CodecChoice::Fp16,
            ("bf16", None) => CodecChoice::Bf16,
            ("topk", Some(p)) => CodecChoice::TopK(density(p, "top-k")?),
            ("randomk", Some(p)) => CodecChoice::RandomK(density(p, "random-k")?),
            ("int8", None | Some("stochastic")) => CodecChoice::Int8 { stochastic: true },
            ("int8", Some("nearest")) => CodecChoice::Int8 { stochastic: false },
            ("sign", None) => CodecChoice::Sign,
            ("powersgd", Some(p)) => {
                CodecChoice::PowerSgd(p.parse().ok().filter(|r| *r > 0).ok_or_else(|| {
                    format!("powersgd rank {} is not a positive integer", echo_input(p))
                })?)
            }
            ("topk" | "randomk" | "powersgd", None) => {
                return Err(format!(
                    "{name} needs a parameter, e.g. {name}:{}",
                    if name == "powersgd" { "4" } else { "0.1" }
                ))
            }
            _ => {
                return Err(format!(
                    "unknown codec {} (expected dense, fp16, bf16, topk:D, randomk:D, int8, \
                     int8:nearest, sign or powersgd:R, optionally followed by /ef or /noef)",
                    echo_input(spec)
                ))
            }
        };
        if codec == CodecChoice::Dense && s.contains('/') {
            return Err(format!(
                "{}: dense has no error feedback to turn on or off",
                echo_input(&s)
            ));
        }
        Ok(Setting {
            codec,
            error_feedback: ef && codec != CodecChoice::Dense,
        })
    }
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.codec {
            CodecChoice::Dense => return f.write_str("dense"),
            CodecChoice::Fp16 => f.write_str("fp16")?,
            CodecChoice::Bf16 => f.write_str("bf16")?,
            CodecChoice::TopK(d) => write!(f, "topk:{d}")?,
            CodecChoice::RandomK(d) => write!(f, "randomk:{d}")?,
            CodecChoice::Int8 { stochastic: true } => f.write_str("int8")?,
            CodecChoice::Int8 { stochastic: false } => f.write_str("int8:nearest")?,
            CodecChoice::Sign => f.write_str("sign")?,
            CodecChoice::PowerSgd(r) => write!(f, "powersgd:{r}")?,
        }
        f.write_str(if self.error_feedback { "/ef" } else { "/noef" })
    }
}

/// The communicator's compressed all-reduce for `setting` (dense stays a plain all-reduce); PowerSGD
/// factorises each of `layers` (the model's tensor shapes, adding up to `len`) on its own.
pub fn make_compressed(
    setting: Setting,
    len: usize,
    layers: &[Vec<usize>],
    seed: u64,
    adaptive: bool,
) -> Result<Box<dyn GradSync>, String> {
    let block = braid_compress::DEFAULT_BLOCK;
    let codec = match setting.codec {
        CodecChoice::Dense => return Ok(Box::new(DenseSync)),
        CodecChoice::Fp16 => CodecSpec::Fp16,
        CodecChoice::Bf16 => CodecSpec::Bf16,
        CodecChoice::TopK(density) => CodecSpec::TopK { density },
        CodecChoice::RandomK(density) => CodecSpec::RandomK { density },
        CodecChoice::Int8 { stochastic } => CodecSpec::Int8 { block, stochastic },
        CodecChoice::Sign => CodecSpec::Sign { block },
        CodecChoice::PowerSgd(rank) => CodecSpec::PowerSgd { rank },
    };
    let config = CompressionConfig {
        codec,
        error_feedback: setting.error_feedback,
        adaptive_optimizer: adaptive,
        seed,
        layers: matches!(codec, CodecSpec::PowerSgd { .. }).then(|| layers.to_vec()),
        ..CompressionConfig::default()
    };
    let state = GradientCompressor::new(config, len).map_err(|e| e.to_string())?;
    Ok(Box::new(CompressedSync { state }))
}

/// [`Communicator::all_reduce_compressed`] with [`ReduceOp::Avg`].
pub struct CompressedSync {
    state: GradientCompressor,
}

impl GradSync for CompressedSync {
    fn sync(
        &mut self,
        comm: &Communicator,
        grad: &mut [f32],
        _step: u64,
    ) -> Result<SyncInfo, Error> {
        let r = comm.all_reduce_compressed(grad, ReduceOp::Avg, &mut self.state)?;
        Ok(SyncInfo {
            sent_bytes: r.sent_bytes,
            grad_norm: r.stats.grad_norm,
            compression_error: r.stats.compression_error,
            density: r.stats.density,
            warnings: r.warnings,
        })
    }
}

/// The local reference synchroniser ([`GatherSync`]) for `setting` over `len` elements (the tensors
/// `layers`, which PowerSGD factorises one by one) on `rank`; `seed` is the run's seed and `adaptive` says
/// whether the optimizer is adaptive (for the warnings).
pub fn make(
    setting: Setting,
    len: usize,
    layers: &[Vec<usize>],
    rank: usize,
    seed: u64,
    adaptive: bool,
) -> Result<Box<dyn GradSync>, String> {
    let err = |e: braid_compress::Error| e.to_string();
    // Random-k shares its seed across ranks (same indices everywhere); stochastic rounding and PowerSGD's
    // start differ per rank so that rounding errors do not line up.
    let rank_seed = seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let codec: Box<dyn Codec> = match setting.codec {
        CodecChoice::Dense => return Ok(Box::new(DenseSync)),
        CodecChoice::Fp16 => Box::new(Cast::F16),
        CodecChoice::Bf16 => Box::new(Cast::Bf16),
        CodecChoice::TopK(d) => Box::new(TopK::new(d).map_err(err)?),
        CodecChoice::RandomK(d) => Box::new(RandomK::new(d, seed).map_err(err)?),
        CodecChoice::Int8 { stochastic: true } => {
            Box::new(Int8::stochastic(braid_compress::DEFAULT_BLOCK, rank_seed).map_err(err)?)
        }
        CodecChoice::Int8 { stochastic: false } => {
            Box::new(Int8::new(braid_compress::DEFAULT_BLOCK).map_err(err)?)
        }
        CodecChoice::Sign => Box::new(Sign::new(braid_compress::DEFAULT_BLOCK).map_err(err)?),
        CodecChoice::PowerSgd(r) => Box::new(
            PowerSgd::new(r, rank_seed)
                .map_err(err)?
                .with_layout(Layout::new(layers, len).map_err(err)?),
        ),
    };
    let ef = if setting.error_feedback {
        ErrorFeedback::new(len)
    } else {
        ErrorFeedback::disabled(len)
    };
    Ok(Box::new(GatherSync {
        codec,
        ef,
        adaptive,
        sum: vec![0.0; len],
    }))
}

/// Plain f32 all-reduce with [`ReduceOp::Avg`].
pub struct DenseSync;

impl GradSync for DenseSync {
    fn sync(
        &mut self,
        comm: &Communicator,
        grad: &mut [f32],
        _step: u64,
    ) -> Result<SyncInfo, Error> {
        let grad_norm = braid_compress::l2_norm(grad);
        comm.all_reduce_in_place(grad, ReduceOp::Avg)?;
        let n = comm.world_size() as u64;
        Ok(SyncInfo {
            // Ring all-reduce: reduce-scatter then all-gather, (n − 1)/n of the buffer each.
            sent_bytes: 2 * (n - 1) * (4 * grad.len() as u64) / n,
            grad_norm,
            compression_error: 0.0,
            density: 1.0,
            warnings: Vec::new(),
        })
    }
}

/// Local compression with error feedback, then an all-gather of the encodings.
pub struct GatherSync {
    codec: Box<dyn Codec>,
    ef: ErrorFeedback,
    adaptive: bool,
    sum: Vec<f32>,
}

impl GradSync for GatherSync {
    fn sync(
        &mut self,
        comm: &Communicator,
        grad: &mut [f32],
        step: u64,
    ) -> Result<SyncInfo, Error> {
        let bad = |e: braid_compress::Error| Error::invalid(format!("compression: {e}"));
        let (compressed, stats) = self.ef.step(grad, self.codec.as_mut(), step).map_err(bad)?;
        let bytes = compressed.encode();
        let world = comm.world_size();
        // Encodings differ in length between ranks: gather the lengths, then blocks padded to the longest.
        let mut lens = vec![0u64; world];
        comm.all_gather(&[bytes.len() as u64], &mut lens)?;
        let block = lens.iter().copied().max().unwrap_or(0) as usize;
        let mut send = bytes;
        send.resize(block, 0);
        let mut all = vec![0u8; block * world];
        comm.all_gather_bytes(&send, &mut all, DType::U8)?;
        self.sum.fill(0.0);
        for (r, &len) in lens.iter().enumerate() {
            let part = &all[r * block..r * block + len as usize];
            let c = Compressed::decode_for(part, grad.len())
                .map_err(|e| Error::invalid(format!("rank {r}'s compressed gradient: {e}")))?;
            c.accumulate(&mut self.sum).map_err(bad)?;
        }
        let inv = 1.0 / world as f32;
        for (g, s) in grad.iter_mut().zip(&self.sum) {
            *g = s * inv;
        }
        let n = world as u64;
        Ok(SyncInfo {
            // Ring all-gather: every rank forwards n − 1 blocks (of lengths, then of encodings).
            sent_bytes: (n - 1) * (8 + block as u64),
            grad_norm: stats.grad_norm,
            compression_error: stats.compression_error,
            density: stats.density,
            warnings: stats.warnings(self.adaptive),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_print_back() {
        for (text, shown) in [
            ("dense", "dense"),
            ("none", "dense"),
            ("fp16", "fp16/ef"),
            ("topk:0.1", "topk:0.1/ef"),
            ("TopK:0.01/noef", "topk:0.01/noef"),
            ("randomk:0.1/ef", "randomk:0.1/ef"),
            ("int8", "int8/ef"),
            ("int8:nearest/noef", "int8:nearest/noef"),
            ("sign", "sign/ef"),
            ("powersgd:4", "powersgd:4/ef"),
        ] {
            let s: Setting = text.parse().unwrap();
            assert_eq!(s.to_string(), shown, "{text}");
            assert_eq!(shown.parse::<Setting>().unwrap(), s);
        }
        assert!(!"dense".parse::<Setting>().unwrap().error_feedback);
        assert!(!"topk:0.1/noef".parse::<Setting>().unwrap().error_feedback);
    }

    #[test]
    fn bad_settings_say_what_is_wrong() {
        for (text, needle) in [
            ("topk", "needs a parameter"),
            ("topk:0", "(0, 1]"),
            ("topk:1.5", "(0, 1]"),
            ("randomk:x", "not a number"),
            ("powersgd:0", "positive integer"),
            ("zip", "unknown codec"),
            ("topk:0.1/maybe", "unknown suffix"),
            ("dense/noef", "no error feedback"),
        ] {
            let e = text.parse::<Setting>().unwrap_err();
            assert!(e.contains(needle), "{text}: {e}");
        }
        // Long input is cut in the message, which says how long it was.
        for text in [
            format!("zip{}", "x".repeat(20_000)),
            format!("topk:{}", "9".repeat(20_000)),
            format!("topk:0.1/{}", "y".repeat(20_000)),
        ] {
            let e = text.parse::<Setting>().unwrap_err();
            assert!(
                e.len() < 400 && e.contains("characters)"),
                "{} bytes: {e}",
                e.len()
            );
        }
    }
}
