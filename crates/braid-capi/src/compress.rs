//! Compressed all-reduce of float gradients: a compressor handle per tensor (codec, error-feedback
//! buffers, step counter) and one call per step.

use std::ffi::{c_char, c_int, CStr};
use std::sync::Mutex;

use braid_rt::{CompressedPath, CompressionConfig, GradientCompressor, Output};

use crate::collectives::{bytes_of, checked_comm, redop_of};
use crate::guard::{guard, invalid};
use crate::region::Region;
use crate::{braid_comm, braid_redop, braid_result, need_out, registry, write_out};
use braid_rt::Error;

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
    /// The density the codec was asked for at this step (the density warm-up's, else the codec's); 0 for
    /// codecs without a density.
    pub scheduled_density: f64,
    /// What the gradient buffer holds now: a `BRAID_OUTPUT_*` code.
    pub output: braid_compress_output,
}

/// What a compressed all-reduce left in the gradient buffer (`braid_compress_stats.output`).
pub type braid_compress_output = c_int;
/// The (approximate) sum or average of the ranks' gradients.
pub const BRAID_OUTPUT_GRADIENT: braid_compress_output = 0;
/// Adam-safe compression (`/adam=STEPS`) past its warm-up: Adam's first moment averaged over ranks; the
/// caller's Adam freezes its second moment and steps with this moment (see "Adam-safe compression" in
/// docs/src/compression/all-reduce.md).
pub const BRAID_OUTPUT_MOMENTUM: braid_compress_output = 1;

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

/// Makes the compression state for a float tensor of `len` elements. `codec_spec` is the configuration as
/// text, the grammar `BRAID_COMPRESS` and `braid compress-eval` use: a codec (`none`, `fp16`, `bf16`,
/// `int8`, `int8:BLOCK`, `sign`, `mxfp8`, `mxfp4`, `topk:DENSITY`, `randomk:DENSITY`, `powersgd:RANK`, ...)
/// followed by options (`/noef`, `/clip=X`, `/gclip=X`, `/momentum=M`, `/warmup=STEPS[:START]`, `/adam=STEPS`, ...; see
/// docs/src/compression/all-reduce.md), the defaults for what it does not say; NULL takes the
/// environment (`BRAID_COMPRESS` and the other `BRAID_COMPRESS_*` variables) or the default, top-k at
/// 10%. `error_feedback` is 1 (remember what compression dropped and add it to the next gradient), 0, or
/// -1 (as the text, or the environment, says; default on). Every rank must make the same compressor for
/// the same tensor.
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
        // SAFETY: the caller's contract, passed on.
        unsafe { create(out, codec_spec, error_feedback, len, None) }
    })
}

/// `braid_compressor_create` for a tensor that holds several layers (a gradient bucket), given their
/// shapes in order: tensor `i` has `ndims[i]` dimensions, which are the next `ndims[i]` entries of `dims`
/// (all shapes one after the other). For a linear layer's weight `[out, in]` and bias `[out]`:
/// `dims = {out, in, out}`, `ndims = {2, 1}`, `nlayers = 2`; a scalar has 0 dimensions. The element counts
/// must add up to `len`, and no dimension may be 0. PowerSGD then factorises each tensor of two or more
/// dimensions as its own `dims[0] × (the rest)` matrix and sums 1-D tensors, and matrices too small to
/// gain, exactly; other codecs check the shapes and ignore them. Every rank must pass the same shapes.
///
/// # Safety
/// As `braid_compressor_create`; `ndims` is readable for `nlayers` values and `dims` for the sum of
/// those values (either may be NULL when it holds none).
#[no_mangle]
pub unsafe extern "C" fn braid_compressor_create_layers(
    out: *mut *mut braid_compressor,
    codec_spec: *const c_char,
    error_feedback: c_int,
    len: usize,
    dims: *const u64,
    ndims: *const usize,
    nlayers: usize,
) -> braid_result {
    guard("braid_compressor_create_layers", || {
        need_out(out, "out")?;
        // SAFETY: the caller promises the sizes of both arrays.
        let layers = unsafe { read_layers(dims, ndims, nlayers) }?;
        // SAFETY: the caller's contract, passed on.
        unsafe { create(out, codec_spec, error_feedback, len, Some(layers)) }
    })
}

/// The shapes of `braid_compressor_create_layers`, copied out of the caller's arrays (which need not be
/// aligned).
///
/// # Safety
/// `ndims` is readable for `nlayers` values and `dims` for their sum (or NULL when that is 0).
unsafe fn read_layers(
    dims: *const u64,
    ndims: *const usize,
    nlayers: usize,
) -> Result<Vec<Vec<usize>>, Error> {
    let bytes = |n: usize, each: usize, arg: &str| {
        n.checked_mul(each)
            .filter(|b| *b <= isize::MAX as usize)
            .ok_or_else(|| {
                invalid(format!(
                    "{arg} {n} × {each} bytes overflows the address space"
                ))
            })
    };
    let counts = Region::new(
        ndims.cast(),
        bytes(nlayers, std::mem::size_of::<usize>(), "nlayers")?,
        "ndims",
    )?;
    // SAFETY: readable for `nlayers` values per the contract; only read here.
    let counts: Vec<usize> = unsafe { counts.bytes() }
        .chunks_exact(std::mem::size_of::<usize>())
        .map(|b| usize::from_ne_bytes(b.try_into().expect("a usize's bytes")))
        .collect();
    let total = counts
        .iter()
        .try_fold(0usize, |t, &n| t.checked_add(n))
        .ok_or_else(|| invalid("ndims: the dimension counts overflow size_t"))?;
    let all = Region::new(dims.cast(), bytes(total, 8, "the sum of ndims")?, "dims")?;
    // SAFETY: readable for the sum of `ndims` values per the contract; only read here.
    let bytes = unsafe { all.bytes() };
    let mut values = bytes.chunks_exact(8).enumerate().map(|(i, b)| {
        let d = u64::from_ne_bytes(b.try_into().expect("8 bytes"));
        usize::try_from(d).map_err(|_| invalid(format!("dims[{i}] = {d} does not fit size_t")))
    });
    counts
        .iter()
        .map(|&n| values.by_ref().take(n).collect())
        .collect()
}

/// The compression configuration `text` (not NULL) gives, in the grammar of `BRAID_COMPRESS`; `arg`
/// names the argument in errors.
///
/// # Safety
/// `text` is a NUL-terminated string.
pub(crate) unsafe fn config_of(text: *const c_char, arg: &str) -> Result<CompressionConfig, Error> {
    // SAFETY: the caller promises a NUL-terminated string.
    let text = unsafe { CStr::from_ptr(text) }
        .to_str()
        .map_err(|_| invalid(format!("{arg} is not UTF-8")))?;
    text.parse::<CompressionConfig>().map_err(|e| match e {
        braid_rt::Error::InvalidArgument(m) => invalid(format!("{arg}: {m}")),
        other => other,
    })
}

/// The body of both create functions: every argument is checked before the handle is made.
///
/// # Safety
/// `out` is valid for writing a pointer (checked for NULL here); `codec_spec` is NULL or a
/// NUL-terminated string.
unsafe fn create(
    out: *mut *mut braid_compressor,
    codec_spec: *const c_char,
    error_feedback: c_int,
    len: usize,
    layers: Option<Vec<Vec<usize>>>,
) -> Result<(), Error> {
    need_out(out, "out")?;
    let mut config = if codec_spec.is_null() {
        CompressionConfig::from_env()?
    } else {
        // SAFETY: not NULL, and the caller promises a NUL-terminated string.
        unsafe { config_of(codec_spec, "codec_spec") }?
    };
    match error_feedback {
        -1 => {}
        0 | 1 => config.error_feedback = error_feedback == 1,
        e => return Err(invalid(format!("error_feedback is {e}, not -1, 0 or 1"))),
    }
    config.layers = layers;
    let state = GradientCompressor::new(config, len)?;
    let token = registry::insert(COMPRESSOR, Mutex::new(state));
    // SAFETY: checked above; writable per the contract.
    unsafe { write_out(out, token as *mut braid_compressor, "out") }
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

/// Tells a compressor the learning rate the caller's optimizer applies to the next result; call it before
/// every `braid_all_reduce_compressed` under a schedule that changes the rate. When the rate moves from
/// `a` to `b`, the error buffers are scaled by `a / b`, so a held-back gradient moves the parameters as
/// far as it would have at its own step (momentum correction's velocity is not scaled). 0 scales nothing;
/// a negative or non-finite `lr` is `BRAID_INVALID_ARGUMENT` and changes nothing. Every rank gives the
/// same rates.
///
/// # Safety
/// None beyond passing a handle value.
#[no_mangle]
pub unsafe extern "C" fn braid_compressor_set_learning_rate(
    compressor: *mut braid_compressor,
    lr: f32,
) -> braid_result {
    guard("braid_compressor_set_learning_rate", || {
        let state = registry::get::<Mutex<GradientCompressor>>(
            compressor as usize,
            COMPRESSOR,
            "compressor",
        )?;
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        state.set_learning_rate(lr)
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
            scheduled_density: report.scheduled_density.map_or(0.0, f64::from),
            output: match report.output {
                Output::Gradient => BRAID_OUTPUT_GRADIENT,
                Output::Momentum => BRAID_OUTPUT_MOMENTUM,
            },
        };
        // SAFETY: not NULL; writable per the contract.
        unsafe { write_out(out_stats, stats, "out_stats") }
    })
}
