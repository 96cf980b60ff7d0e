//! braid: collective communication for distributed training, without NCCL.
//!
//! A [`Communicator`] joins `world` ranks (processes) and runs collectives among them: all-reduce,
//! reduce-scatter, all-gather, broadcast, reduce and barrier, for every [`DType`] and [`ReduceOp`], in
//! place or out of place, blocking or asynchronous ([`Work`]). Ranks on one host talk through shared
//! memory; the algorithms are the pure schedules of `braid-sched`.
//!
//! ```no_run
//! use braid::{Communicator, ReduceOp};
//! // Under `braid run -n 4 -- prog`, torchrun, mpirun or srun:
//! let comm = Communicator::from_env()?;
//! let mut grads = vec![1.0f32; 1 << 20];
//! comm.all_reduce_in_place(&mut grads, ReduceOp::Avg)?;
//! # Ok::<(), braid::Error>(())
//! ```
//!
//! Errors name the rank, the collective, its sequence number and the peer; every wait has a deadline
//! (`BRAID_TIMEOUT_MS`); a dead or aborted peer becomes an error on every rank, never a hang.

mod bootstrap;
mod buckets;
mod call;
mod comm;
pub mod compressed;
mod device;
mod dispatch;
mod id;
mod job;
mod probe;
pub mod recorder;
mod scope;
mod secret;
pub mod shared;
mod streams;
pub mod timeline;
pub mod tune;
pub mod wire;

pub use braid_compress;
pub use braid_core::{Config, DType, DebugLevel, Element, Error, ReduceOp, Result};
pub use braid_topo;
pub use buckets::{BucketOptions, GradientBuckets};
pub use comm::{Communicator, Registration};
pub use compressed::{
    AdamSafe, AdamSend, ClipScope, CodecSpec, CompressedPath, CompressedReport, CompressionConfig,
    DensityWarmup, GradientCompressor, Output, SparsePath,
};
pub use device::{
    DeviceCommunicator, DeviceGate, DeviceOp, DeviceParts, DeviceSignal, Ready, RESIDENT_VARIABLE,
};
pub use id::UniqueId;
pub use job::JobEnv;
pub use recorder::FlightRecord;
pub use scope::{Scope, ScopedWork};
pub use shared::SharedBuffer;
pub use streams::{Priority, StreamEvent, Work};
pub use timeline::TimelineSpan;
pub use tune::{Algo, Collective};
