//! What a compressed all-reduce reports: the way it went ([`CompressedPath`], and through [`PathOf`]
//! the way a codec's tensors go before any switch), what it left in the buffer ([`Output`]), and the
//! [`CompressedReport`] itself.

use braid_compress::{CodecSpec, Stats};

/// What braid does with a codec: the path its tensors take, and whether it sends indices.
pub(super) trait PathOf {
    fn nominal_path(&self) -> CompressedPath;
    fn sends_indices(&self) -> bool;
}

impl PathOf for CodecSpec {
    /// The path a tensor compressed with this codec takes (before any dense switch).
    fn nominal_path(&self) -> CompressedPath {
        match self {
            CodecSpec::Dense => CompressedPath::Dense,
            CodecSpec::TopK { .. } | CodecSpec::ThresholdTopK { .. } => {
                CompressedPath::SparseAllGather
            }
            CodecSpec::RandomK { .. } | CodecSpec::Fp16 | CodecSpec::Bf16 => {
                CompressedPath::SumClosed
            }
            CodecSpec::Int8 { .. } | CodecSpec::Sign { .. } | CodecSpec::Mx { .. } => {
                CompressedPath::TwoPhase
            }
            CodecSpec::PowerSgd { .. } => CompressedPath::PowerIteration,
        }
    }

    /// Whether the codec sends element indices as u32 (which bounds the tensor length).
    fn sends_indices(&self) -> bool {
        matches!(
            self,
            CodecSpec::TopK { .. } | CodecSpec::ThresholdTopK { .. } | CodecSpec::RandomK { .. }
        )
    }
}

/// What a compressed all-reduce left in the gradient buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// The (approximate) sum or average of the ranks' gradients.
    Gradient,
    /// Adam-safe compression past its warm-up: Adam's first moment, averaged over ranks.
    Momentum,
}

/// Which way a compressed all-reduce went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompressedPath {
    /// A plain all-reduce of the f32 gradient.
    Dense,
    /// The compressed form was all-reduced (fp16/bf16, random-k).
    SumClosed,
    /// PowerSGD: all-reduce P, orthogonalise, all-reduce Q.
    PowerIteration,
    /// Top-k pairs all-gathered and summed in rank order.
    SparseAllGather,
    /// Top-k whose ranks' non-zeros exceeded the dense switch: a dense all-reduce of the sparse updates.
    SparseDenseSwitch,
    /// Top-k pairs sent to the owner of their index range, summed there in rank order, re-selected with
    /// the range's second error buffer, and the kept pairs all-gathered.
    SparseReduceScatter,
    /// Int8/sign: all-to-all of compressed shards, reduce and re-compress per shard, all-gather.
    TwoPhase,
}

/// What one [`Communicator::all_reduce_compressed`](crate::Communicator::all_reduce_compressed) call did.
#[derive(Clone, Debug)]
pub struct CompressedReport {
    /// The local compression step's statistics (norms, compression error, achieved density, wire bytes,
    /// staleness).
    pub stats: Stats,
    /// The way the call went.
    pub path: CompressedPath,
    /// Bytes this rank put on the wire in this call (from the schedules' traffic).
    pub sent_bytes: u64,
    /// What a dense ring all-reduce of the f32 gradient would have sent from this rank: `2(n−1)/n · 4 · len`.
    pub dense_sent_bytes: u64,
    /// The seed's warnings for this step's density (see [`braid_compress::warnings`]).
    pub warnings: Vec<String>,
    /// The density the codec was asked for at this step (the warm-up's, else the codec's); `None` for
    /// codecs without a density.
    pub scheduled_density: Option<f32>,
    /// What the gradient buffer holds now.
    pub output: Output,
}
