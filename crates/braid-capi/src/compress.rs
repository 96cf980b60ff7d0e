//! Compressed all-reduce of float gradients: a compressor handle per tensor (codec, error-feedback
//! buffers, step counter) and one call per step.

use std::ffi::{c_char, c_int, CStr};
use std::sync::Mutex;

use braid_rt::{CodecSpec, CompressedPath, CompressionConfig, GradientCompressor};

use crate::collectives::{bytes_of, checked_comm, redop_of, Region};
use crate::guard::{guard, invalid};
use crate::{braid_comm, braid_redop, braid_result, need_out, registry, write_out};

/// The compression state of one tensor (opaque).
pub struct braid_compressor {
    _private: [u8; 0],
}

const COMPRESSOR: &str = "braid_compressor";

/// Which way a compressed all-reduce went (`braid_compress_stats.path`).
pub type braid_compress_path = c_int;
/// A plain all-reduce of the float gradient (codec `none`, or `dense`).
pub const BRAID_PATH_DENSE: braid_compress_path = 0;
/// The compressed form itself was all-reduced (`fp16`, `bf16`, `randomk`).
pub const BRAID_PATH_SUM_CLOSED: braid_compress_path = 1;
/// PowerSGD: all-reduce P, orthogonalise, all-reduce Q.
pub const BRAID_PATH_POWER_ITERATION: braid_compress_path = 2;
/// Top-k pairs all-gathered and summed in rank order.
pub const BRAID_PATH_SPARSE_ALL_GATHER: braid_compress_path = 3;
/// Top-k whose ranks' non-zeros passed the dense switch: the sparse updates all-reduced densely.
pub const BRAID_PATH_SPARSE_DENSE_SWITCH: braid_compress_path = 4;
/// Int8 and sign: compressed shards exchanged, reduced and re-compressed per shard, then all-gathered.
pub const BRAID_PATH_TWO_PHASE: braid_compress_path = 5;
/// Top-k pairs sent to the owner of their index range, summed and re-selected there (what is dropped
/// stays in the range's second error buffer), the kept pairs all-gathered: traffic per rank flat in the
/// rank count (`BRAID_COMPRESS_SPARSE`).
pub const BRAID_PATH_SPARSE_REDUCE_SCATTER: braid_compress_path = 6;

/// What one `braid_all_reduce_compressed` call did.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct braid_compress_stats {
    /// A `BRAID_PATH_*` code.
    pub path: braid_compress_path,
    /// Warnings the step's density raised (e.g. density below 1% for an adaptive optimizer).
    pub warnings: u32,
    /// Elements in the tensor.
    pub len: u64,
    /// The compressor's step counter after this call.
    pub step: u64,
    /// L2 norm of the local gradient as given, before clipping and error feedback.
    pub grad_norm: f64,
    /// The factor clipping applied (1 when not clipped).
    pub clip_scale: f64,
    /// L2 norm of what was compressed (clipped gradient plus the remembered error).
    pub residual_norm: f64,
    /// ‖residual − decompressed‖ / ‖residual‖: the relative compression error.
    pub compression_error: f64,
    /// Fraction of elements whose decompressed update is non-zero.
    pub density: f64,
    /// Bytes of the local encoding.
    pub wire_bytes: u64,
    /// Bytes of the same tensor in float (4 · len).
    pub dense_bytes: u64,
    /// Bytes this rank sent in this call.
    pub sent_bytes: u64,
    /// Bytes a dense ring all-reduce of the float gradient would have sent from this rank.
    pub dense_sent_bytes: u64,
}

fn path_code(p: CompressedPath) -> braid_compress_path {
    match p {
        CompressedPath::Dense => BRAID_PATH_DENSE,
        CompressedPath::SumClosed => BRAID_PATH_SUM_CLOSED,
        CompressedPath::PowerIteration => BRAID_PATH_POWER_ITERATION,
        CompressedPath::SparseAllGather => BRAID_PATH_SPARSE_ALL_GATHER,
        CompressedPath::SparseDenseSwitch => BRAID_PATH_SPARSE_DENSE_SWITCH,
        CompressedPath::TwoPhase => BRAID_PATH_TWO_PHASE,
        CompressedPath::SparseReduceScatter => BRAID_PATH_SPARSE_REDUCE_SCATTER,
    }
}

/// Makes the compression state for a float tensor of `len` elements. `codec_spec` is the codec as text:
/// `none`, `fp16`, `bf16`, `int8`, `int8:BLOCK`, `sign`, `topk:DENSITY`, `randomk:DENSITY`,
/// `powersgd:RANK`, ...; NULL takes `BRAID_COMPRESS` or the default, top-k at 10%. `error_feedback` is 1
/// (remember what compression dropped and add it to the next gradient), 0, or -1 (`BRAID_COMPRESS_EF`,
/// default on). Every rank must make the same compressor for the same tensor.
///
/// # Safety
/// `out` is NULL or valid for writing a pointer; `codec_spec` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn braid_compressor_create(
    out: *mut *mut braid_compressor,
    codec_spec: *const c_char,
    error_feedback: c_int,
    len: usize,
) -> braid_result {
    guard("braid_compressor_create", || {
        need_out(out, "out")?;
        let mut config = CompressionConfig::from_env()?;
        if !codec_spec.is_null() {
            // SAFETY: not NULL, and the caller promises a NUL-terminated string.
            let text = unsafe { CStr::from_ptr(codec_spec) }
                .to_str()
                .map_err(|_| invalid("codec_spec is not UTF-8"))?;
            config.codec = text.parse::<CodecSpec>().map_err(|e| match e {
                braid_rt::Error::InvalidArgument(m) => invalid(format!("codec_spec: {m}")),
                other => other,
            })?;
        }
        match error_feedback {
            -1 => {}
            0 | 1 => config.error_feedback = error_feedback == 1,
            e => return Err(invalid(format!("error_feedback is {e}, not -1, 0 or 1"))),
        }
        let state = GradientCompressor::new(config, len)?;
        let token = registry::insert(COMPRESSOR, Mutex::new(state));
        // SAFETY: checked above; writable per the contract.
        unsafe { write_out(out, token as *mut braid_compressor, "out") }
    })
}

/// Releases a compressor. NULL does nothing; a destroyed handle is `BRAID_INVALID_ARGUMENT`.
///
/// # Safety
/// None beyond passing a handle value.
#[no_mangle]
pub unsafe extern "C" fn braid_compressor_destroy(
    compressor: *mut braid_compressor,
) -> braid_result {
    guard("braid_compressor_destroy", || {
        if compressor.is_null() {
            return Ok(());
        }
        drop(registry::remove::<Mutex<GradientCompressor>>(
            compressor as usize,
            COMPRESSOR,
            "compressor",
        )?);
        Ok(())
    })
}

/// Clears a compressor's error buffers and codec state (as after loading a checkpoint); the step counter
/// is kept. Every rank must reset at the same step.
///
/// # Safety
/// None beyond passing a handle value.
#[no_mangle]
pub unsafe extern "C" fn braid_compressor_reset(compressor: *mut braid_compressor) -> braid_result {
    guard("braid_compressor_reset", || {
        let state = registry::get::<Mutex<GradientCompressor>>(
            compressor as usize,
            COMPRESSOR,
            "compressor",
        )?;
        state.lock().unwrap_or_else(|e| e.into_inner()).reset();
        Ok(())
    })
}

/// All-reduces the float gradient `grad` (`count` elements, in place) compressed as `compressor` says,
/// with its error feedback; the result is bit-identical on every rank. `op` is `BRAID_SUM` or `BRAID_AVG`;
/// `count` must be the compressor's `len`. `out_stats` (nullable) receives what the call did.
///
/// # Safety
/// `grad` is readable and writable for `count` floats and not touched by another thread during the call;
/// `out_stats` is NULL or valid for writing a `braid_compress_stats`.
#[no_mangle]
pub unsafe extern "C" fn braid_all_reduce_compressed(
    grad: *mut f32,
    count: usize,
    op: braid_redop,
    compressor: *mut braid_compressor,
    comm: *mut braid_comm,
    out_stats: *mut braid_compress_stats,
) -> braid_result {
    guard("braid_all_reduce_compressed", || {
        let c = checked_comm(comm, std::ptr::null_mut())?;
        let op = redop_of(op)?;
        let state = registry::get::<Mutex<GradientCompressor>>(
            compressor as usize,
            COMPRESSOR,
            "compressor",
        )?;
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        if count != state.len() {
            return Err(invalid(format!(
                "count {count} differs from the compressor's len {}",
                state.len()
            )));
        }
        let n = bytes_of(count, 1, braid_rt::DType::F32, "count")?;
        let g = Region::new(grad.cast(), n, "grad")?;
        let report = if g.aligned_for(braid_rt::DType::F32) {
            // SAFETY: the caller's gradient, aligned (checked), ours for the call.
            c.all_reduce_compressed(unsafe { g.typed_mut::<f32>() }, op, &mut state)?
        } else {
            // An unaligned gradient goes through an aligned copy.
            let mut copy =
                braid_core::alloc::filled(0f32, count, "an aligned copy of the gradient")?;
            // SAFETY: the caller's gradient, readable; the copy ends before it is written.
            let bytes = unsafe { g.bytes() };
            bytemuck::cast_slice_mut::<f32, u8>(&mut copy).copy_from_slice(bytes);
            let report = c.all_reduce_compressed(&mut copy, op, &mut state)?;
            // SAFETY: the caller's gradient, writable, not aliased by `copy`.
            unsafe { g.bytes_mut() }.copy_from_slice(bytemuck::cast_slice(&copy));
            report
        };
        if out_stats.is_null() {
            return Ok(());
        }
        let s = &report.stats;
        let stats = braid_compress_stats {
            path: path_code(report.path),
            warnings: report.warnings.len() as u32,
            len: s.len as u64,
            step: state.step(),
            grad_norm: s.grad_norm,
            clip_scale: s.clip_scale.into(),
            residual_norm: s.residual_norm,
            compression_error: s.compression_error,
            density: s.density,
            wire_bytes: s.wire_bytes as u64,
            dense_bytes: s.dense_bytes as u64,
            sent_bytes: report.sent_bytes,
            dense_sent_bytes: report.dense_sent_bytes,
        };
        // SAFETY: not NULL; writable per the contract.
        unsafe { write_out(out_stats, stats, "out_stats") }
    })
}
