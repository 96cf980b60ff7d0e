//! braid-cuda: braid's CUDA side.
//!
//! - The reduce-copy kernels: their CUDA C sources (the top-level `kernels/` directory, embedded here
//!   so no file is needed at run time), their catalogue, and the names of the `extern "C"` entry points
//!   `kernels/reduce_copy.cu` defines for every [`Shape`], [`DType`] and [`ReduceOp`].
//! - Their compilation at run time: [`nvrtc`] (libnvrtc loaded with `dlopen`, so nothing of CUDA is
//!   needed to build or to run without a GPU) and [`load_or_compile`] (a cache on disk).
//! - [`driver`]: the CUDA driver API, also loaded at run time — [`Gpu`] (device choice and primary
//!   context), [`DeviceBuffer`], [`PinnedBuffer`], [`HostRegistration`], [`pointer_kind`], [`Stream`]
//!   (with [`Priority`]), [`Event`], [`Module`].
//! - [`ReduceCopyKernels`]: the catalogue loaded on a device and launched by shape, dtype and op.
//! - [`CudaEngine`]: braid-exec's `Engine` on a CUDA stream, for collectives on device memory.
//! - [`resident`]: collectives that run on the GPU, one launch each ([`ResidentAllReduce`]).
//! - [`CudaMemory`]: shareable device memory (`cuMemCreate` and POSIX file descriptors, or legacy IPC
//!   handles where the device has no VMM; [`IpcMode`], `BRAID_CUDA_IPC`) for the rings of
//!   braid-transport's `ipc` transport.
//!
//! Without a driver or a GPU, everything that needs one returns an error that says so; nothing panics.
//!
//! ```
//! use braid_core::{DType, ReduceOp};
//! use braid_cuda::{kernel_name, Shape};
//! assert_eq!(kernel_name(Shape::Finalize2, DType::F16, ReduceOp::Avg).unwrap(), "braid_rc_finalize2_f16_avg");
//! assert_eq!(kernel_name(Shape::ToAcc, DType::BF16, ReduceOp::Max).unwrap(), "braid_rc_to_acc_bf16");
//! assert!(kernel_name(Shape::Ordered(5), DType::F32, ReduceOp::Sum).is_err());
//! ```
#![deny(unsafe_code)]

pub mod cache;
pub mod compress;
pub mod driver;
mod engine;
mod ipc_memory;
mod launch;

pub mod nvrtc;
pub mod resident;

pub use cache::{
    cache_dir, load_module, load_or_compile, load_or_compile_in, load_or_compile_program,
    load_or_compile_program_in, CacheOutcome,
};
pub use driver::{
    choose_device, driver_available, pointer_kind, DeviceBuffer, Event, Gpu, Graph,
    HostRegistration, Module, PinnedBuffer, PointerKind, Priority, RestoreContext, Stream,
};
pub use engine::CudaEngine;
pub use ipc_memory::{CudaMemory, IpcMode, IPC_VARIABLE, LEGACY_GRANULARITY};
pub use launch::{blocks_for, RcArgs, ReduceCopyKernels, THREADS};
pub use nvrtc::{compile, BinaryKind, Compiled, Nvrtc};
pub use resident::{ResidentAllReduce, WindowLayout};

use braid_core::{DType, Error, ReduceOp};

/// The kernel sources, `(file name, text)`, as `kernels/` holds them; `reduce_copy.cu` includes the
/// two headers by these names.
pub const SOURCES: [(&str, &str); 3] = [
    (
        "braid_reduce.cuh",
        include_str!("../../../kernels/braid_reduce.cuh"),
    ),
    (
        "braid_reduce_copy.cuh",
        include_str!("../../../kernels/braid_reduce_copy.cuh"),
    ),
    (
        "reduce_copy.cu",
        include_str!("../../../kernels/reduce_copy.cu"),
    ),
];

/// The numbers of sources reduced by the [`Shape::Ordered`] kernels of the catalogue.
pub const ORDERED_SOURCES: [usize; 4] = [2, 3, 4, 8];

/// What a reduce-copy kernel reads and writes. Operands are in the dtype (T) or in its accumulator type
/// (A: f32 for f16 and bf16, the dtype otherwise); a T destination receives the finished value (rounded,
/// divided once for avg), an A destination the partial.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shape {
    /// T → A: the first contribution of a chain (`reduce::to_acc`).
    ToAcc,
    /// (A partial, T input) → A (`reduce::combine`).
    Combine,
    /// (A acc, A partial) → A acc, in place (`reduce::combine_acc`).
    CombineAcc,
    /// A → T (`reduce::finish_acc`).
    FinishAcc,
    /// (A partial, T input) → T (`reduce::finalize`).
    Finalize,
    /// (A partial, T input) → T and T: the fused last step of a ring's reduce-scatter, writing the local
    /// output and the next peer's slot in one pass.
    Finalize2,
    /// n T sources → T, left to right (`reduce::reduce_ordered`); n is one of [`ORDERED_SOURCES`].
    Ordered(usize),
}

impl Shape {
    /// Every shape of the catalogue.
    pub fn all() -> Vec<Shape> {
        let mut v = vec![
            Shape::ToAcc,
            Shape::Combine,
            Shape::CombineAcc,
            Shape::FinishAcc,
            Shape::Finalize,
            Shape::Finalize2,
        ];
        v.extend(ORDERED_SOURCES.iter().map(|&n| Shape::Ordered(n)));
        v
    }

    /// Whether each source is in the accumulator type, in order.
    pub fn sources(self) -> Vec<bool> {
        match self {
            Shape::ToAcc => vec![false],
            Shape::Combine | Shape::Finalize | Shape::Finalize2 => vec![true, false],
            Shape::CombineAcc => vec![true, true],
            Shape::FinishAcc => vec![true],
            Shape::Ordered(n) => vec![false; n],
        }
    }

    /// Whether each destination is in the accumulator type, in order.
    pub fn destinations(self) -> Vec<bool> {
        match self {
            Shape::ToAcc | Shape::Combine | Shape::CombineAcc => vec![true],
            Shape::FinishAcc | Shape::Finalize | Shape::Ordered(_) => vec![false],
            Shape::Finalize2 => vec![false, false],
        }
    }

    /// Whether the kernel's result depends on the reduce op.
    pub fn uses_op(self) -> bool {
        self != Shape::ToAcc
    }

    fn tag(self) -> Result<String, Error> {
        Ok(match self {
            Shape::ToAcc => "to_acc".into(),
            Shape::Combine => "combine".into(),
            Shape::CombineAcc => "combine_acc".into(),
            Shape::FinishAcc => "finish_acc".into(),
            Shape::Finalize => "finalize".into(),
            Shape::Finalize2 => "finalize2".into(),
            Shape::Ordered(n) if ORDERED_SOURCES.contains(&n) => format!("ordered{n}"),
            Shape::Ordered(n) => {
                return Err(Error::invalid(format!(
                    "no reduce-copy kernel reduces {n} sources at once (the catalogue has {ORDERED_SOURCES:?})"
                )))
            }
        })
    }
}

/// The short name of `dtype` in kernel names.
pub const fn dtype_tag(dtype: DType) -> &'static str {
    match dtype {
        DType::I8 => "i8",
        DType::U8 => "u8",
        DType::I32 => "i32",
        DType::U32 => "u32",
        DType::I64 => "i64",
        DType::U64 => "u64",
        DType::F16 => "f16",
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::BF16 => "bf16",
    }
}

/// The entry point of the reduce-copy kernel for `shape`, `dtype` and `op`, or an invalid-argument error
/// when the catalogue has none.
pub fn kernel_name(shape: Shape, dtype: DType, op: ReduceOp) -> Result<String, Error> {
    let tag = shape.tag()?;
    let dt = dtype_tag(dtype);
    Ok(if shape.uses_op() {
        format!("braid_rc_{tag}_{dt}_{}", op.name())
    } else {
        format!("braid_rc_{tag}_{dt}")
    })
}

/// Every (shape, dtype, op) the catalogue holds, each once: shapes that do not use the op appear with
/// [`ReduceOp::Sum`] only.
pub fn entries() -> Vec<(Shape, DType, ReduceOp)> {
    let mut all = Vec::new();
    for dtype in DType::ALL {
        for shape in Shape::all() {
            let ops: &[ReduceOp] = if shape.uses_op() {
                &ReduceOp::ARITHMETIC
            } else {
                &[ReduceOp::Sum]
            };
            all.extend(ops.iter().map(|&op| (shape, dtype, op)));
        }
    }
    all
}

/// Every entry point of the catalogue, each once.
pub fn catalogue() -> Vec<String> {
    entries()
        .into_iter()
        .filter_map(|(shape, dtype, op)| kernel_name(shape, dtype, op).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalogue_is_complete_and_unique() {
        let names = catalogue();
        assert_eq!(names.len(), 10 * (9 * 5 + 1));
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
    }

    #[test]
    fn shapes_match_the_sources() {
        // Every shape of the catalogue is spelled in the header with its operand masks.
        let header = SOURCES[1].1;
        for shape in Shape::all() {
            let mask = |v: Vec<bool>| {
                v.iter()
                    .enumerate()
                    .map(|(i, &a)| u32::from(a) << i)
                    .sum::<u32>()
            };
            let (s, d) = (shape.sources(), shape.destinations());
            let line = format!(
                "{}, dt, T, {}{}, {:#x}u, {}, {:#x}u)",
                shape.tag().unwrap(),
                if shape.uses_op() { "on, OP, " } else { "" },
                s.len(),
                mask(s),
                d.len(),
                mask(d)
            );
            assert!(
                header.contains(&line),
                "{shape:?}: {line} not in braid_reduce_copy.cuh"
            );
        }
    }
}
