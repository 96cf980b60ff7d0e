//! The reduce-copy kernels loaded on a device and launched by (shape, dtype, op).
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;

use braid_core::{DType, Error, ReduceOp};

use crate::driver::{Gpu, Module, Stream};
use crate::{entries, kernel_name, Shape};

/// Threads per block of every reduce-copy launch (the kernels' `__launch_bounds__`).
pub const THREADS: u32 = 512;

/// Bytes one block covers per pass before a second block pays off: 512 threads × 4 packs of 16 bytes.
const BYTES_PER_BLOCK: usize = THREADS as usize * 64;

/// The kernels' argument, laid out as `braid::RcArgs` in kernels/braid_reduce_copy.cuh (checked by
/// `tests/driver_abi.rs` against the C++ compiler's layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RcArgs {
    /// Source addresses, in order; unused ones zero.
    pub src: [u64; 8],
    /// Destination addresses.
    pub dst: [u64; 2],
    /// Elements.
    pub count: u64,
    /// The divisor of avg.
    pub nranks: u32,
}

/// How many blocks a launch over `bytes` (of its largest operand) takes on a device with `sms`
/// multiprocessors: one per 32 KiB, at most four per multiprocessor (the kernels are grid-stride
/// loops, so any grid covers any length).
pub fn blocks_for(bytes: usize, sms: u32) -> u32 {
    let want = bytes.div_ceil(BYTES_PER_BLOCK).max(1);
    want.min(4 * sms.max(1) as usize) as u32
}

/// The catalogue, loaded on one device: compiled by NVRTC for its architecture (or read from the
/// kernel cache) and every entry point resolved once.
pub struct ReduceCopyKernels {
    module: Module,
    functions: HashMap<(Shape, DType, ReduceOp), usize>,
    sms: u32,
}

impl ReduceCopyKernels {
    /// Compiles (or loads from the cache) and loads the catalogue on `gpu`.
    pub fn load(gpu: &Gpu) -> Result<ReduceCopyKernels, Error> {
        let (name, source, headers) = crate::nvrtc::program();
        let module = crate::load_module(gpu, name, source, &headers)?;
        let mut functions = HashMap::new();
        for (shape, dtype, op) in entries() {
            let name = kernel_name(shape, dtype, op)?;
            let raw = module.function(&name)?.raw() as usize;
            functions.insert((shape, dtype, op), raw);
        }
        Ok(ReduceCopyKernels {
            sms: gpu.multiprocessors()?,
            module,
            functions,
        })
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        self.module.gpu()
    }

    /// Queues the kernel for (`shape`, `dtype`, `op`) on `stream` over `count` elements: `srcs` and
    /// `dsts` are device addresses, as many as the shape has operands, each in the dtype or in its
    /// accumulator type as the shape says. A destination may be a source (in place) only when it is
    /// exactly that source.
    ///
    /// # Safety
    /// Every address must be valid device memory of this device for `count` elements of its operand's
    /// type until the kernel completes on `stream`, destinations written by nothing else meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        shape: Shape,
        dtype: DType,
        op: ReduceOp,
        srcs: &[u64],
        dsts: &[u64],
        count: usize,
        nranks: usize,
    ) -> Result<(), Error> {
        let (sacc, dacc) = (shape.sources(), shape.destinations());
        if srcs.len() != sacc.len() || dsts.len() != dacc.len() {
            return Err(Error::invalid(format!(
                "the {shape:?} kernel takes {} sources and {} destinations, not {} and {}",
                sacc.len(),
                dacc.len(),
                srcs.len(),
                dsts.len()
            )));
        }
        if count == 0 {
            return Ok(());
        }
        let op = if shape.uses_op() { op } else { ReduceOp::Sum };
        let function = *self.functions.get(&(shape, dtype, op)).ok_or_else(|| {
            Error::invalid(match kernel_name(shape, dtype, op) {
                Ok(name) => {
                    format!("no kernel {name} was loaded ({op} of {dtype} has no GPU kernel)")
                }
                Err(e) => e.to_string(),
            })
        })?;
        let nranks = u32::try_from(nranks)
            .map_err(|_| Error::invalid(format!("{nranks} contributions do not fit a kernel")))?;
        let mut args = RcArgs {
            count: count as u64,
            nranks,
            ..RcArgs::default()
        };
        args.src[..srcs.len()].copy_from_slice(srcs);
        args.dst[..dsts.len()].copy_from_slice(dsts);
        let widest = sacc
            .iter()
            .chain(&dacc)
            .map(|&acc| {
                if acc {
                    dtype.accumulator().size()
                } else {
                    dtype.size()
                }
            })
            .max()
            .unwrap_or(1);
        let grid = blocks_for(count * widest, self.sms);
        let mut params = [(&mut args as *mut RcArgs).cast::<c_void>()];
        // SAFETY: `function` was resolved from this module (alive in `self`) and takes one `RcArgs` by
        // value, which `params[0]` points to (the driver copies it at launch); the caller vouches for
        // the memory.
        unsafe {
            crate::driver::launch_raw(
                self.gpu(),
                function as *mut c_void,
                stream,
                grid,
                THREADS,
                &mut params,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_grow_with_the_length_up_to_four_blocks_per_multiprocessor() {
        assert_eq!(blocks_for(0, 132), 1);
        assert_eq!(blocks_for(1, 132), 1);
        assert_eq!(blocks_for(BYTES_PER_BLOCK, 132), 1);
        assert_eq!(blocks_for(BYTES_PER_BLOCK + 1, 132), 2);
        assert_eq!(blocks_for(64 << 20, 132), 528);
        assert_eq!(blocks_for(64 << 20, 0), 4);
    }

    #[test]
    fn the_argument_block_has_the_kernels_layout() {
        assert_eq!(std::mem::size_of::<RcArgs>(), 96);
        assert_eq!(std::mem::align_of::<RcArgs>(), 8);
        assert_eq!(std::mem::offset_of!(RcArgs, dst), 64);
        assert_eq!(std::mem::offset_of!(RcArgs, count), 80);
        assert_eq!(std::mem::offset_of!(RcArgs, nranks), 88);
    }
}
