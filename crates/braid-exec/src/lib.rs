//! braid-exec: runs braid-sched's schedules over any [`Link`](braid_transport::Link), with every
//! reduce and copy on an [`Engine`].
//!
//! - [`Executor`] turns an [`Op`] (a collective over [`Span`](braid_transport::Span)s of host or
//!   device memory) into a [`Run`] and advances it by polling, so one thread can move several runs
//!   forward at once, or block on one ([`Executor::run_blocking`]) with no hand-off;
//! - [`Engine`] is where kernels run: [`CpuEngine`] on host memory, braid-cuda's `CudaEngine` on a CUDA
//!   stream, [`EmulatedDeviceEngine`] on emulated device memory for machines without a GPU (kernels run
//!   late, as a GPU's finish); memory an engine cannot compute on is refused, and posts and releases
//!   wait for the kernels they depend on;
//! - [`sim`] runs every rank of a job on one thread over an in-memory network
//!   ([`MemNet`](braid_transport::mem::MemNet)) with this same executor: the one interpreter of
//!   schedules, with injected latency, a killed rank and a stalled rank.
//!
//! ```
//! use braid_core::{DType, ReduceOp};
//! use braid_exec::sim;
//! use braid_sched::ring;
//! let world = 3;
//! let plans: Vec<_> = (0..world).map(|r| ring::all_reduce(world, r, 5, 2)).collect();
//! let inputs: Vec<Vec<u8>> = (0..world).map(|r| vec![r as u8; 5]).collect();
//! let out = sim::run(&plans, DType::U8, ReduceOp::Sum, &inputs, 5, 2).unwrap();
//! assert!(out.outputs.iter().all(|o| o == &vec![3u8; 5]));
//! ```

mod emulated;
pub mod engine;
mod executor;
mod fingerprint;
pub mod sim;

pub use emulated::EmulatedDeviceEngine;
pub use engine::{CpuEngine, Engine, Kernel, Operand, Scratch, Ticket};
pub use executor::{Executor, Op, Plan, Progress, Run, Settings, Wait};
pub use fingerprint::Fingerprint;
