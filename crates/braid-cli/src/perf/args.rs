//! What `braid perf` is asked to measure ([`PerfArgs`]), read by the sweep and by both benchmarks.

use braid::{Collective, DType, ReduceOp};

/// What to measure.
#[derive(Clone, Debug)]
pub struct PerfArgs {
    /// The collective measured (one of [`COLLECTIVES`](super::COLLECTIVES)).
    pub collective: Collective,
    /// Smallest size in bytes.
    pub min_bytes: usize,
    /// Largest size in bytes.
    pub max_bytes: usize,
    /// Size multiplication factor between steps.
    pub factor: usize,
    /// Timed iterations per size.
    pub iters: usize,
    /// Warm-up iterations per size.
    pub warmup: usize,
    /// Element type.
    pub dtype: DType,
    /// Reduction (ignored by the collectives that do not reduce).
    pub op: ReduceOp,
    /// Whether to check each result against the exact one.
    pub check: bool,
    /// Where to write the results as JSON.
    pub json: Option<String>,
    /// `None`: braid chooses; a name forces it; `all` measures every algorithm of the collective.
    pub algo: Option<String>,
    /// Where to plot busbw against size.
    pub plot: Option<String>,
    /// Whether to register the send buffer for sends without a copy.
    pub register: bool,
    /// Whether the buffers are shared memory from
    /// [`Communicator::alloc`](braid::Communicator::alloc).
    pub shared: bool,
    /// Where the buffers live (host memory, or a device's through the device communicator).
    pub device: crate::device::Device,
}
