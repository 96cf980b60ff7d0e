//! Gradient synchronisation behind one small trait, so the trainer does not care how gradients travel.
//!
//! [`DenseSync`] averages with a plain all-reduce. [`CompressedSync`] calls the communicator's compressed
//! all-reduce (sum-closed codecs ride the ring, top-k is all-gathered, int8/sign go two-phase, PowerSGD
//! all-reduces its factors) with every option of the configuration (momentum correction, density
//! warm-up, clipping, Adam-safe compression). [`GatherSync`] is the reference it is compared with: each
//! rank compresses locally with `braid_compress` (its own [`ErrorFeedback`] and codec), the encoded bytes
//! are all-gathered, and every rank decodes and sums all contributions in rank order, so all ranks apply
//! bit-identical updates.

use std::fmt;
use std::str::FromStr;

use braid::{
    ClipScope, CodecSpec, Communicator, CompressionConfig, DType, Error, GradientCompressor,
    Output, ReduceOp,
};
use braid_compress::{echo_input, Compressed, ErrorFeedback, Layout, PowerSgd};

use super::optim::OptKind;

/// What one synchronisation did, as seen by this rank.
#[derive(Clone, Debug)]
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
    /// What the gradient buffer holds now (Adam-safe compression returns the first moment).
    pub output: Output,
}

/// Makes every rank's gradient buffer the average of all ranks' gradients (or an approximation of it).
pub trait GradSync {
    /// Replaces `grad` by the synchronised gradient; `step` keys the codecs' random streams.
    fn sync(&mut self, comm: &Communicator, grad: &mut [f32], step: u64)
        -> Result<SyncInfo, Error>;

    /// The learning rate the optimizer applies to the next result (the compressed all-reduce scales its
    /// error buffers by the change, [`GradientCompressor::set_learning_rate`]); ignored by default.
    fn set_learning_rate(&mut self, _lr: f32) -> Result<(), Error> {
        Ok(())
    }
}

/// One row of the evaluation: a compression configuration in the runtime's text form
/// (`CompressionConfig`'s grammar: `topk:0.01/momentum=0.9/warmup=150`, `topk:0.1/adam=200`, ...).
/// The evaluation sets the seed (the run's) and whether the optimizer is adaptive.
#[derive(Clone, Debug)]
pub struct Setting {
    /// The configuration.
    pub config: CompressionConfig,
}

impl FromStr for Setting {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let config: CompressionConfig = s.parse().map_err(|e: Error| match e {
            Error::InvalidArgument(m) => m,
            other => other.to_string(),
        })?;
        if config.seed != 0 || config.adaptive_optimizer {
            return Err(format!(
                "{}: compress-eval sets the seed (--seed) and adaptivity (from the optimizer) itself",
                echo_input(s)
            ));
        }
        Ok(Setting { config })
    }
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_plain_dense() {
            return f.write_str("dense");
        }
        self.config.fmt(f)
    }
}

impl Setting {
    /// Dense with no option: the baseline, a plain all-reduce.
    pub fn is_plain_dense(&self) -> bool {
        self.config.codec == CodecSpec::Dense
            && self.config.clip_norm.is_none()
            && self.config.adam.is_none()
    }

    /// Whether error feedback is on (never for dense).
    pub fn error_feedback(&self) -> bool {
        self.config.error_feedback && self.config.codec != CodecSpec::Dense
    }

    /// Whether the setting is meant for `opt`: momentum correction replaces SGD's momentum, Adam-safe
    /// compression needs Adam's cooperation; everything else runs with both.
    pub fn applies_to(&self, opt: OptKind) -> bool {
        match opt {
            OptKind::Sgd => self.config.adam.is_none(),
            OptKind::Adam => self.config.momentum.is_none(),
        }
    }

    /// The momentum SGD runs with: none when the compressor keeps it (momentum correction).
    pub fn sgd_momentum(&self) -> f32 {
        if self.config.momentum.is_some() {
            0.0
        } else {
            0.9
        }
    }

    fn seeded(&self, seed: u64, adaptive: bool) -> CompressionConfig {
        CompressionConfig {
            seed,
            adaptive_optimizer: adaptive,
            ..self.config.clone()
        }
    }
}

/// The communicator's compressed all-reduce for `setting` (plain dense stays a plain all-reduce); PowerSGD
/// factorises each of `layers` (the model's tensor shapes, adding up to `len`) on its own.
pub fn make_compressed(
    setting: &Setting,
    len: usize,
    layers: &[Vec<usize>],
    seed: u64,
    adaptive: bool,
) -> Result<Box<dyn GradSync>, String> {
    if setting.is_plain_dense() {
        return Ok(Box::new(DenseSync));
    }
    let mut config = setting.seeded(seed, adaptive);
    if matches!(config.codec, CodecSpec::PowerSgd { .. }) {
        config.layers = Some(layers.to_vec());
    }
    let state = GradientCompressor::new(config, len).map_err(|e| e.to_string())?;
    Ok(Box::new(CompressedSync { state }))
}

/// [`Communicator::all_reduce_compressed`] with [`ReduceOp::Avg`].
pub struct CompressedSync {
    state: GradientCompressor,
}

impl GradSync for CompressedSync {
    fn set_learning_rate(&mut self, lr: f32) -> Result<(), Error> {
        self.state.set_learning_rate(lr)
    }

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
            output: r.output,
        })
    }
}

/// The local reference synchroniser ([`GatherSync`]) for `setting` over `len` elements (the tensors
/// `layers`, which PowerSGD factorises one by one) on `rank`; `seed` is the run's seed and `adaptive` says
/// whether the optimizer is adaptive (for the warnings). It implements the codec, error feedback, decay,
/// local clipping and momentum correction; the options that need the runtime (global clipping, warm-up,
/// Adam-safe compression) are refused.
pub fn make(
    setting: &Setting,
    len: usize,
    layers: &[Vec<usize>],
    rank: usize,
    seed: u64,
    adaptive: bool,
) -> Result<Box<dyn GradSync>, String> {
    if setting.is_plain_dense() {
        return Ok(Box::new(DenseSync));
    }
    let c = &setting.config;
    if c.codec == CodecSpec::Dense
        || c.warmup.is_some()
        || c.adam.is_some()
        || c.clip_scope == ClipScope::Global && c.clip_norm.is_some()
    {
        return Err(format!(
            "{setting}: --gather's local reference implements codecs, noef, decay, clip and momentum only"
        ));
    }
    let err = |e: braid_compress::Error| e.to_string();
    // Random-k shares its seed across ranks (same indices everywhere); stochastic rounding and PowerSGD's
    // start differ per rank so that rounding errors do not line up.
    let rank_seed = match c.codec {
        CodecSpec::RandomK { .. } => seed,
        _ => seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
    };
    let codec: braid::compressed::BoxedCodec = match c.codec {
        CodecSpec::PowerSgd { rank } => Box::new(
            PowerSgd::new(rank, rank_seed)
                .map_err(err)?
                .with_layout(Layout::new(layers, len).map_err(err)?),
        ),
        other => other
            .local_codec(rank_seed)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("{setting}: no local codec"))?,
    };
    let mut ef = ErrorFeedback::try_new(len).map_err(err)?;
    if !c.error_feedback {
        ef = ef.with_decay(0.0).map_err(err)?;
    } else if let Some(d) = c.decay {
        ef = ef.with_decay(d).map_err(err)?;
    }
    if let Some(clip) = c.clip_norm {
        ef = ef.with_clip(clip).map_err(err)?;
    }
    if let Some(m) = c.momentum {
        ef = ef
            .with_momentum(m)
            .map_err(err)?
            .with_masking(c.momentum_masking);
    }
    Ok(Box::new(GatherSync {
        codec,
        ef,
        adaptive,
        sum: vec![0.0; len],
        lr: None,
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
            output: Output::Gradient,
        })
    }
}

/// Local compression with error feedback, then an all-gather of the encodings.
pub struct GatherSync {
    codec: braid::compressed::BoxedCodec,
    ef: ErrorFeedback,
    adaptive: bool,
    sum: Vec<f32>,
    /// The last positive learning rate, as [`GradientCompressor::set_learning_rate`] keeps it.
    lr: Option<f32>,
}

impl GradSync for GatherSync {
    /// Scales the error buffer by the old over the new rate, as the compressed all-reduce does.
    fn set_learning_rate(&mut self, lr: f32) -> Result<(), Error> {
        if !(lr >= 0.0 && lr.is_finite()) {
            return Err(Error::invalid(format!(
                "the learning rate {lr} is not a finite number ≥ 0"
            )));
        }
        if lr > 0.0 {
            if let Some(prev) = self.lr.replace(lr) {
                let f = prev / lr;
                if f != 1.0 {
                    self.ef.error.iter_mut().for_each(|e| *e *= f);
                }
            }
        }
        Ok(())
    }

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
            output: Output::Gradient,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_use_the_runtime_grammar_and_print_back() {
        for (text, shown) in [
            ("dense", "dense"),
            ("none", "dense"),
            ("fp16", "fp16"),
            ("topk:0.1", "topk:0.1"),
            ("TopK:0.01/noef", "topk:0.01/noef"),
            ("int8-stochastic", "int8-stochastic:256"),
            (
                "topk:0.01/momentum=0.9/warmup=150",
                "topk:0.01/momentum=0.9/warmup=150:0.25",
            ),
            ("topk:0.1/adam=200", "topk:0.1/adam=200:0.9"),
            ("dense/gclip=1", "dense/gclip=1"),
        ] {
            let s: Setting = text.parse().unwrap();
            assert_eq!(s.to_string(), shown, "{text}");
            assert_eq!(shown.parse::<Setting>().unwrap().to_string(), shown);
        }
        assert!(!"dense".parse::<Setting>().unwrap().error_feedback());
        assert!(!"topk:0.1/noef".parse::<Setting>().unwrap().error_feedback());
        let mc: Setting = "topk:0.01/momentum=0.9".parse().unwrap();
        assert!(mc.applies_to(OptKind::Sgd) && !mc.applies_to(OptKind::Adam));
        assert_eq!(mc.sgd_momentum(), 0.0);
        let adam: Setting = "topk:0.01/adam=10".parse().unwrap();
        assert!(!adam.applies_to(OptKind::Sgd) && adam.applies_to(OptKind::Adam));
        assert!(!"dense/gclip=1".parse::<Setting>().unwrap().is_plain_dense());
    }

    #[test]
    fn bad_settings_say_what_is_wrong() {
        for (text, needle) in [
            ("topk:0", "(0, 1]"),
            ("topk:1.5", "(0, 1]"),
            ("randomk:x", "not a number"),
            ("powersgd:0", "rank"),
            ("zip", "unknown codec"),
            ("topk:0.1/maybe", "unknown option"),
            ("topk:0.1/seed=3", "sets the seed"),
            ("dense/momentum=0.9", "momentum correction"),
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
                e.len() < 600 && e.contains("characters)"),
                "{} bytes: {e}",
                e.len()
            );
        }
    }
}
