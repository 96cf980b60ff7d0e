//! Compressed all-reduce: the codecs of `braid-compress` wired into the collectives.
//!
//! Each codec family needs its own way through the network, because what can be summed on the wire
//! differs ([`braid_compress::Transport`]):
//!
//! * fp16/bf16 casts and random-k with a shared seed are closed under addition, so their compressed form
//!   rides the ordinary all-reduce ([`CompressedPath::SumClosed`]);
//! * PowerSGD sums its two factors one at a time, orthogonalising in between, and warm-starts from the
//!   last summed `Q` ([`CompressedPath::PowerIteration`]); each rank's error buffer keeps what its own share
//!   of the approximation, `P·(Mᵀ·P)ᵀ`, missed, so the ranks' errors add up to what the summed
//!   approximation missed. Given the bucket's [layer shapes](CompressionConfig::layers), each weight is
//!   factorised as its own matrix and 1-D tensors are summed exactly, with every layer's P (and the
//!   exact parts) in one all-reduce and every Q in another;
//! * top-k carries per-rank indices: ranks all-gather their `(index, value)` pairs and every rank sums them
//!   in rank order ([`CompressedPath::SparseAllGather`]); or, so that a rank's traffic does not grow with
//!   the rank count, each rank sends every range of the index space only to that range's owner, which
//!   sums its range in rank order, keeps about `k/n` of it (what it drops stays in a second error buffer
//!   for the range) and all-gathers what it kept ([`CompressedPath::SparseReduceScatter`], Ok-Topk);
//!   [`CompressionConfig::sparse_path`] picks (gathering by default; `auto` asks the traffic model,
//!   [`sparse_model`]). When the sparse data would be dense enough, a dense all-reduce of the sparse
//!   updates is cheaper ([`CompressedPath::SparseDenseSwitch`], SparCML);
//! * int8 and sign carry per-rank scales: DeepSpeed's two-phase scheme exchanges compressed shards
//!   all-to-all, reduces each shard in f32 on its owner, re-compresses it with a second error buffer and
//!   all-gathers the compressed shards ([`CompressedPath::TwoPhase`]).
//!
//! Every rank decodes the same bytes and sums in the same order, so results are bit-identical across
//! ranks. Error feedback remembers what compression dropped and adds it to the next gradient; the
//! statistics of each local compression step (gradient norm, compression error, density, staleness) come
//! back in a [`CompressedReport`] and are logged at debug level under the target `braid::compress`.

pub(crate) use carry::Carried;
pub use options::{AdamSafe, AdamSend, ClipScope, CompressionConfig};
pub use report::{CompressedPath, CompressedReport, Output};
pub use state::GradientCompressor;

use braid_compress::power_sgd::Plan;
use braid_compress::{build_codec, ErrorFeedback, Layout, Staleness, Stats};
pub use braid_compress::{BoxedCodec, CodecSpec, DensityWarmup};
use braid_core::Error;
/// The sparse all-reduce's partition, routing and traffic model.
pub use braid_sched::sparse::{self as sparse_model, SparsePath};

use paths::codec_error;
use report::PathOf;

/// The text of a codec parameter error without its kind prefix.
fn parameter_message(e: braid_compress::Error) -> String {
    match e {
        braid_compress::Error::InvalidParameter(m) => m,
        other => other.to_string(),
    }
}

impl GradientCompressor {
    /// Compression state for a tensor of `len` elements. Fails, naming the problem, if the configuration
    /// is invalid or the tensor too long for the codec (index codecs: at most `u32::MAX` elements).
    pub fn new(config: CompressionConfig, len: usize) -> Result<Self, Error> {
        config.validate()?;
        if config.codec.sends_indices() && len > u32::MAX as usize {
            return Err(Error::invalid(format!(
                "compression codec {}: a tensor of {len} elements cannot be indexed with u32; split it into \
                 buckets of at most {} elements",
                config.codec,
                u32::MAX
            )));
        }
        let layout = match &config.layers {
            Some(shapes) => Some(
                Layout::new(shapes, len)
                    .map_err(|e| Error::invalid(format!("compression {}", parameter_message(e))))?,
            ),
            None => None,
        };
        let power = match (config.codec, &layout) {
            (CodecSpec::PowerSgd { rank }, Some(l)) => Some(Plan::layered(l, rank)),
            (CodecSpec::PowerSgd { rank }, None) => {
                Some(Plan::single(len, None, rank).map_err(|e| {
                    Error::invalid(format!(
                        "compression codec {}: {}",
                        config.codec,
                        parameter_message(e)
                    ))
                })?)
            }
            _ => None,
        };
        let codec = build_codec(config.codec, config.seed)?;
        // Adam-safe compression clips the gradient before it enters the first moment, not the moment.
        let ef_clip = config.local_clip().filter(|_| config.adam.is_none());
        let mut ef = Self::error_feedback(&config, len, ef_clip)?;
        if let Some(m) = config.momentum {
            ef = ef
                .with_momentum(m)
                .map_err(codec_error)?
                .with_masking(config.momentum_masking);
        }
        Ok(GradientCompressor {
            len,
            step: 0,
            codec,
            codec_density: config.codec.density(),
            learning_rate: None,
            adam_m: Vec::new(),
            ef,
            staleness: Staleness::try_new(len).map_err(codec_error)?,
            server: None,
            power,
            sparse: None,
            warm_q: None,
            last: None,
            warned: false,
            config,
        })
    }

    fn error_feedback(
        config: &CompressionConfig,
        len: usize,
        clip: Option<f32>,
    ) -> Result<ErrorFeedback, Error> {
        let mut ef = ErrorFeedback::try_new(len).map_err(codec_error)?;
        if !config.error_feedback {
            ef = ef.with_decay(0.0).map_err(codec_error)?;
        }
        if let (true, Some(d)) = (config.error_feedback, config.decay) {
            ef = ef.with_decay(d).map_err(codec_error)?;
        }
        if let Some(c) = clip {
            ef = ef.with_clip(c).map_err(codec_error)?;
        }
        Ok(ef)
    }

    /// Number of elements of the tensor.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The density the codec is asked for at this step under the warm-up (rebuilding the codec when the
    /// schedule moves); `None` for codecs without a density.
    fn schedule_density(&mut self) -> Result<Option<f32>, Error> {
        let Some(target) = self.config.codec.density() else {
            return Ok(None);
        };
        let flush = self.config.flush.is_some_and(|n| (self.step + 1) % n == 0);
        let want = if flush {
            1.0
        } else {
            self.config
                .warmup
                .map_or(target, |w| w.density(target, self.step))
        };
        if self.codec_density != Some(want) {
            self.codec = build_codec(self.config.codec.with_density(want), self.config.seed)?;
            self.codec_density = Some(want);
        }
        Ok(Some(want))
    }

    /// The configuration.
    pub fn config(&self) -> &CompressionConfig {
        &self.config
    }

    /// Number of completed compressed all-reduces (it keys the codecs' random streams).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The statistics of the last call, if any.
    pub fn last_stats(&self) -> Option<&Stats> {
        self.last.as_ref()
    }

    /// The local error buffer: what compression has dropped so far and will add to the next gradient
    /// (zeros without error feedback's memory, or before the first call).
    pub fn error(&self) -> &[f32] {
        &self.ef.error
    }

    /// Momentum correction's velocity (empty when it is off). Save it with checkpoints, as the error.
    pub fn velocity(&self) -> &[f32] {
        self.ef.velocity()
    }

    /// Adam-safe compression's first moment, the same on every rank (empty when it is off or before the
    /// first call).
    pub fn adam_momentum(&self) -> &[f32] {
        &self.adam_m
    }

    /// The second error buffer of the part of the tensor this rank owns: its shard on the two-phase path
    /// (int8, sign), its index range on the sparse reduce-scatter (top-k; ranges move with the load, and
    /// what leaves a rank's range moves to its local error buffer). The parts tile the tensor in rank
    /// order. Empty before the first call of such a path.
    pub fn shard_error(&self) -> &[f32] {
        match (&self.server, &self.sparse) {
            (Some(s), _) => &s.3.error[..],
            (None, Some(s)) => s.error(),
            (None, None) => &[],
        }
    }

    /// Tells the compressor the learning rate the caller's optimizer applies to the next result (call it
    /// before every compressed all-reduce, or whenever the rate changes); fails, changing nothing, unless
    /// `lr` is finite and ≥ 0.
    ///
    /// What error feedback holds back was computed under the rate of its own step, but is applied when it
    /// is finally sent, under the rate of that step. With a decaying schedule that is a smaller rate, and
    /// what is still held back when the schedule reaches zero is never applied. So when the rate moves
    /// from `a` to `b`, every error buffer (the local one, the two-phase shard's, the sparse range's) is
    /// scaled by `a / b`: the buffers then hold back updates rather than gradients, as in EF-SGD
    /// (Karimireddy et al. 2019), and a held-back gradient moves the parameters as far as it would have at
    /// its own step. Momentum correction's velocity is not scaled: dense momentum SGD also applies its
    /// velocity at the current rate, so with nothing held back (density 1) the result is dense momentum
    /// SGD's. A rate of 0 scales nothing (the next positive rate is compared with the last positive one).
    /// Without calls, or with a constant rate, nothing is ever scaled.
    ///
    /// ```
    /// use braid::{CompressionConfig, GradientCompressor};
    /// let mut c = GradientCompressor::new(CompressionConfig::default(), 10).unwrap();
    /// c.set_learning_rate(0.1).unwrap();
    /// assert_eq!(c.learning_rate(), Some(0.1));
    /// assert!(c.set_learning_rate(-1.0).is_err() && c.set_learning_rate(f32::NAN).is_err());
    /// c.set_learning_rate(0.0).unwrap();
    /// assert_eq!(c.learning_rate(), Some(0.1));
    /// ```
    pub fn set_learning_rate(&mut self, lr: f32) -> Result<(), Error> {
        if !(lr >= 0.0 && lr.is_finite()) {
            return Err(Error::invalid(format!(
                "compression: the learning rate {lr} is not a finite number ≥ 0"
            )));
        }
        if lr == 0.0 {
            return Ok(());
        }
        if let Some(prev) = self.learning_rate.replace(lr) {
            if prev != lr {
                let f = prev / lr;
                let scale = |b: &mut [f32]| b.iter_mut().for_each(|e| *e *= f);
                scale(&mut self.ef.error);
                if let Some(s) = &mut self.server {
                    scale(&mut s.3.error);
                }
                if let Some(s) = &mut self.sparse {
                    scale(s.error_mut());
                }
            }
        }
        Ok(())
    }

    /// The last positive learning rate given to [`set_learning_rate`](Self::set_learning_rate), if any.
    pub fn learning_rate(&self) -> Option<f32> {
        self.learning_rate
    }

    /// Clears the error buffers, staleness and codec state (PowerSGD's warm start), as after loading a
    /// checkpoint. The step counter is kept, so the random streams do not repeat.
    pub fn reset(&mut self) {
        self.ef.reset();
        self.staleness.reset();
        self.adam_m.clear();
        self.server = None;
        self.sparse = None;
        self.warm_q = None;
        if let Some(c) = &mut self.codec {
            c.reset();
        }
        self.last = None;
    }
}

mod carry;
mod config;
mod options;
mod paths;
mod range;
mod report;
mod sparse;
mod state;
