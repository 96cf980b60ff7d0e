//! Gradient buckets: gradients fused into few all-reduces that start during the backward pass
//! (`braid::GradientBuckets`).

use std::ffi::c_char;
use std::sync::Mutex;

use braid_rt::{BucketOptions, Error, GradientBuckets};

use crate::collectives::{bytes_of, checked_comm, dtype_of, redop_of};
use crate::compress::config_of;
use crate::guard::{guard, invalid};
use crate::region::Region;
use crate::{braid_comm, braid_dtype, braid_redop, braid_result, need_out, registry, write_out};

/// Gradient buckets of one model (opaque).
pub struct braid_buckets {
    _private: [u8; 0],
}

const BUCKETS: &str = "braid_buckets";

/// `braid_buckets_create` flag: keep the first layout (reverse registration order) instead of rebuilding
/// it in the order the gradients arrived on rank 0 after the first step.
pub const BRAID_BUCKETS_NO_REBUILD: u32 = 1;
/// `braid_buckets_create` flag: a parameter not marked ready by `braid_buckets_finish` counts as a zero
/// gradient (instead of failing the step on every rank).
pub const BRAID_BUCKETS_UNUSED_AS_ZERO: u32 = 2;
/// `braid_buckets_create` flag: keep dense buckets in private memory (by default, when every rank is on
/// one host and there is no compression, they live in memory every rank maps, see `braid_mem_alloc`).
pub const BRAID_BUCKETS_PRIVATE_MEMORY: u32 = 4;

/// The buckets and, per parameter, where `braid_buckets_finish` writes its result this step.
struct Buckets {
    buckets: GradientBuckets,
    /// `(address, bytes)` given to `braid_buckets_mark_ready`, if any.
    results: Vec<Option<(usize, usize)>>,
}

fn buckets_of(b: *mut braid_buckets) -> Result<std::sync::Arc<Mutex<Buckets>>, Error> {
    registry::get::<Mutex<Buckets>>(b as usize, BUCKETS, "buckets")
}

/// Makes gradient buckets for `nparams` parameters, parameter `i` being `counts[i]` elements of
/// `dtypes[i]`, listed in the order the model lists them (every rank passes the same list). Buckets
/// hold consecutive parameters of one dtype, at most `bucket_bytes` bytes each (0: `BRAID_BUCKET_BYTES`,
/// default 25 MiB; the first bucket at most 1 MiB); their all-reduces (`op`) start in bucket order on the
/// communicator's last stream, whose priority becomes high, as soon as a bucket's gradients are all in.
/// `compression` (NULL: none) compresses every bucket with its own compressor, the text in the grammar of
/// `BRAID_COMPRESS` (float parameters only; `op` `BRAID_SUM` or `BRAID_AVG`); those all-reduces run on a
/// helper thread, which owns the communicator from a step's first `braid_buckets_mark_ready` until its
/// `braid_buckets_finish` returns. `flags`: `BRAID_BUCKETS_NO_REBUILD`, `BRAID_BUCKETS_UNUSED_AS_ZERO`,
/// `BRAID_BUCKETS_PRIVATE_MEMORY`.
/// The buckets keep the communicator alive until they are destroyed.
///
/// # Safety
/// `out` is valid for writing a pointer; `counts` and `dtypes` are readable for `nparams` values (either
/// may be NULL when `nparams` is 0); `compression` is NULL or a NUL-terminated string.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn braid_buckets_create(
    out: *mut *mut braid_buckets,
    comm: *mut braid_comm,
    nparams: usize,
    counts: *const usize,
    dtypes: *const braid_dtype,
    op: braid_redop,
    bucket_bytes: usize,
    compression: *const c_char,
    flags: u32,
) -> braid_result {
    guard("braid_buckets_create", || {
        need_out(out, "out")?;
        let c = checked_comm(comm, std::ptr::null_mut())?;
        let op = redop_of(op)?;
        let known =
            BRAID_BUCKETS_NO_REBUILD | BRAID_BUCKETS_UNUSED_AS_ZERO | BRAID_BUCKETS_PRIVATE_MEMORY;
        if flags & !known != 0 {
            return Err(invalid(format!("flags {flags:#x} holds unknown bits")));
        }
        let words = |each: usize, arg: &str| {
            nparams
                .checked_mul(each)
                .filter(|b| *b <= isize::MAX as usize)
                .ok_or_else(|| {
                    invalid(format!(
                        "nparams {nparams} × {each} bytes overflows ({arg})"
                    ))
                })
        };
        let n = Region::new(
            counts.cast(),
            words(size_of::<usize>(), "counts")?,
            "counts",
        )?;
        let d = Region::new(
            dtypes.cast(),
            words(size_of::<braid_dtype>(), "dtypes")?,
            "dtypes",
        )?;
        // SAFETY: readable for `nparams` values per the contract; only read, and copied out (the
        // caller's arrays need not be aligned).
        let (n, d) = unsafe { (n.bytes(), d.bytes()) };
        let mut params = Vec::with_capacity(nparams);
        for (i, (n, d)) in n
            .chunks_exact(size_of::<usize>())
            .zip(d.chunks_exact(size_of::<braid_dtype>()))
            .enumerate()
        {
            let count = usize::from_ne_bytes(n.try_into().expect("a size_t's bytes"));
            let code = braid_dtype::from_ne_bytes(d.try_into().expect("an int's bytes"));
            let dtype = dtype_of(code).map_err(|e| invalid(format!("dtypes[{i}]: {e}")))?;
            bytes_of(count, 1, dtype, &format!("counts[{i}]"))?;
            params.push((count, dtype));
        }
        let compression = if compression.is_null() {
            None
        } else {
            // SAFETY: not NULL, NUL-terminated per the contract.
            Some(unsafe { config_of(compression, "compression") }?)
        };
        let options = BucketOptions {
            bucket_bytes: (bucket_bytes != 0).then_some(bucket_bytes),
            op,
            compression,
            rebuild: flags & BRAID_BUCKETS_NO_REBUILD == 0,
            unused_as_zero: flags & BRAID_BUCKETS_UNUSED_AS_ZERO != 0,
            shared: flags & BRAID_BUCKETS_PRIVATE_MEMORY == 0,
            ..BucketOptions::default()
        };
        let buckets = GradientBuckets::new(&c, &params, options)?;
        let token = registry::insert(
            BUCKETS,
            Mutex::new(Buckets {
                buckets,
                results: vec![None; nparams],
            }),
        );
        // SAFETY: checked above; writable per the contract.
        unsafe { write_out(out, token as *mut braid_buckets, "out") }
    })
}

/// Hands over parameter `param`'s gradient for this step: `count` elements of `dtype` at `grad`, copied
/// into its bucket before this returns; a bucket whose gradients are now all in starts its all-reduce
/// (after the buckets before it). `result` (nullable; may be `grad`) is where `braid_buckets_finish`
/// writes the reduced gradient. A parameter that does not exist, a count or dtype other than the
/// registered ones, or a second mark in one step is `BRAID_INVALID_ARGUMENT` and changes nothing.
///
/// # Safety
/// `grad` is readable for `count` elements; `result` is NULL or writable for `count` elements, and stays
/// so, untouched by anyone else, until `braid_buckets_finish` returns.
#[no_mangle]
pub unsafe extern "C" fn braid_buckets_mark_ready(
    buckets: *mut braid_buckets,
    param: usize,
    grad: *const std::ffi::c_void,
    count: usize,
    dtype: braid_dtype,
    result: *mut std::ffi::c_void,
) -> braid_result {
    guard("braid_buckets_mark_ready", || {
        let b = buckets_of(buckets)?;
        let mut b = b.lock().unwrap_or_else(|e| e.into_inner());
        let dtype = dtype_of(dtype)?;
        let bytes = bytes_of(count, 1, dtype, "count")?;
        let g = Region::new(grad, bytes, "grad")?;
        let result = if result.is_null() {
            None
        } else {
            let r = Region::new(result, bytes, "result")?;
            Some((r.ptr as usize, bytes))
        };
        // SAFETY: readable for `count` elements per the contract; copied before this returns.
        let grad = unsafe { g.bytes() };
        b.buckets.mark_ready_bytes(param, grad, dtype)?;
        if let Some(slot) = b.results.get_mut(param) {
            *slot = result;
        }
        Ok(())
    })
}

/// Waits for every bucket of this step and writes each reduced gradient where its
/// `braid_buckets_mark_ready` said; after the first step, rebuilds the buckets in the order the gradients
/// arrived on rank 0. A failed collective is returned (the communicator is then unusable); a parameter
/// not marked ready fails the step on every rank, unless `BRAID_BUCKETS_UNUSED_AS_ZERO`.
///
/// # Safety
/// The `result` buffers given this step are valid as `braid_buckets_mark_ready` requires.
#[no_mangle]
pub unsafe extern "C" fn braid_buckets_finish(buckets: *mut braid_buckets) -> braid_result {
    guard("braid_buckets_finish", || {
        let b = buckets_of(buckets)?;
        let mut b = b.lock().unwrap_or_else(|e| e.into_inner());
        let Buckets { buckets, results } = &mut *b;
        let done = buckets.finish();
        let results = std::mem::replace(results, vec![None; results.len()]);
        done?;
        for (p, r) in results.into_iter().enumerate() {
            let Some((ptr, bytes)) = r else { continue };
            let dtype = buckets.params()[p].1;
            let src = buckets.gradient_bytes(p, dtype)?;
            let dst = Region::new(ptr as *const std::ffi::c_void, bytes, "result")?;
            // SAFETY: writable for the parameter's bytes until now, per `mark_ready`'s contract.
            unsafe { dst.bytes_mut() }.copy_from_slice(src);
        }
        Ok(())
    })
}

/// Copies parameter `param`'s reduced gradient of the last step (`count` elements of `dtype`, as
/// registered) to `out`.
///
/// # Safety
/// `out` is writable for `count` elements.
#[no_mangle]
pub unsafe extern "C" fn braid_buckets_gradient(
    buckets: *mut braid_buckets,
    param: usize,
    out: *mut std::ffi::c_void,
    count: usize,
    dtype: braid_dtype,
) -> braid_result {
    guard("braid_buckets_gradient", || {
        let b = buckets_of(buckets)?;
        let b = b.lock().unwrap_or_else(|e| e.into_inner());
        let dtype = dtype_of(dtype)?;
        let bytes = bytes_of(count, 1, dtype, "count")?;
        let src = b.buckets.gradient_bytes(param, dtype)?;
        if src.len() != bytes {
            return Err(invalid(format!(
                "count {count}: parameter {param} has {} elements",
                src.len() / dtype.size()
            )));
        }
        let dst = Region::new(out, bytes, "out")?;
        // SAFETY: writable for `count` elements per the contract.
        unsafe { dst.bytes_mut() }.copy_from_slice(src);
        Ok(())
    })
}

/// The current layout. `order` (nullable; `nparams` entries) receives the parameters in layout order
/// (bucket 0's first, each bucket's in the order they sit in it), `bucket_of` (nullable; `nparams`
/// entries) each parameter's bucket (buckets start in index order), and `nbuckets` (nullable) the
/// number of buckets.
///
/// # Safety
/// `order` and `bucket_of` are NULL or writable for `nparams` values; `nbuckets` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn braid_buckets_layout(
    buckets: *mut braid_buckets,
    order: *mut usize,
    bucket_of: *mut usize,
    nparams: usize,
    nbuckets: *mut usize,
) -> braid_result {
    guard("braid_buckets_layout", || {
        let b = buckets_of(buckets)?;
        let b = b.lock().unwrap_or_else(|e| e.into_inner());
        let layout = b.buckets.layout();
        let have = b.results.len();
        if (!order.is_null() || !bucket_of.is_null()) && nparams != have {
            return Err(invalid(format!(
                "nparams {nparams}: the buckets hold {have} parameters"
            )));
        }
        let write =
            |to: *mut usize, arg: &str, values: &mut dyn Iterator<Item = (usize, usize)>| {
                if to.is_null() {
                    return Ok(());
                }
                let r = Region::new(to.cast(), have * size_of::<usize>(), arg)?;
                // SAFETY: writable for `nparams` values per the contract (nparams checked above).
                let out = unsafe { r.bytes_mut() };
                for (at, v) in values {
                    out[at * size_of::<usize>()..(at + 1) * size_of::<usize>()]
                        .copy_from_slice(&v.to_ne_bytes());
                }
                Ok::<(), Error>(())
            };
        let flat = layout
            .iter()
            .enumerate()
            .flat_map(|(k, m)| m.iter().map(move |&p| (k, p)));
        write(
            order,
            "order",
            &mut flat.clone().enumerate().map(|(i, (_, p))| (i, p)),
        )?;
        write(bucket_of, "bucket_of", &mut flat.map(|(k, p)| (p, k)))?;
        if !nbuckets.is_null() {
            // SAFETY: not NULL; writable per the contract.
            unsafe { write_out(nbuckets, layout.len(), "nbuckets") }?;
        }
        Ok(())
    })
}

/// Releases the buckets (and their hold on the communicator). NULL does nothing; a destroyed handle is
/// `BRAID_INVALID_ARGUMENT`. Buckets in flight still complete first (bounded by the timeout).
///
/// # Safety
/// None beyond passing a handle value.
#[no_mangle]
pub unsafe extern "C" fn braid_buckets_destroy(buckets: *mut braid_buckets) -> braid_result {
    guard("braid_buckets_destroy", || {
        if buckets.is_null() {
            return Ok(());
        }
        drop(registry::remove::<Mutex<Buckets>>(
            buckets as usize,
            BUCKETS,
            "buckets",
        )?);
        Ok(())
    })
}
