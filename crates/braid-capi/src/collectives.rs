//! The blocking collectives, and the checks every collective shares: the handle, the stream, the enum
//! codes, count overflow, NULL buffers and buffers that overlap without being in place.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use braid_rt::{Communicator, DType, Error, ReduceOp};

use crate::device;
use crate::guard::{guard, invalid};
use crate::region::{apart, Region};
use crate::{braid_comm, braid_dtype, braid_redop, braid_result, comm_of};

/// Runs `$body` with `$T` bound to the Rust type of `$dt`.
macro_rules! with_type {
    ($dt:expr, |$T:ident| $body:expr) => {
        match $dt {
            DType::I8 => {
                type $T = i8;
                $body
            }
            DType::U8 => {
                type $T = u8;
                $body
            }
            DType::I32 => {
                type $T = i32;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::U64 => {
                type $T = u64;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
        }
    };
}

/// The dtype with code `d`.
pub(crate) fn dtype_of(d: braid_dtype) -> Result<DType, Error> {
    u32::try_from(d)
        .ok()
        .and_then(|c| DType::from_code(c).ok())
        .ok_or_else(|| invalid(format!("dtype {d} is not a braid_dtype (valid: 0..=9)")))
}

/// The reduction with code `op`.
pub(crate) fn redop_of(op: braid_redop) -> Result<ReduceOp, Error> {
    u32::try_from(op)
        .ok()
        .and_then(|c| ReduceOp::from_code(c).ok())
        .ok_or_else(|| invalid(format!("op {op} is not a braid_redop (valid: 0..=7)")))
}

/// For the calls that take host memory only (the asynchronous ones, the compressed all-reduce):
/// `stream` must be NULL.
pub(crate) fn host_stream(stream: *mut c_void) -> Result<(), Error> {
    if !stream.is_null() {
        return Err(invalid(
            "stream: this call takes host memory and the host stream (NULL); the blocking all-reduce, reduce-scatter, all-gather, broadcast, reduce and barrier take a CUDA stream with device memory",
        ));
    }
    Ok(())
}

/// The communicator, after the stream check of the calls that take host memory only.
pub(crate) fn checked_comm(
    comm: *mut braid_comm,
    stream: *mut c_void,
) -> Result<Arc<Communicator>, Error> {
    let c = comm_of(comm)?;
    host_stream(stream)?;
    Ok(c)
}

/// Bytes of `count · blocks` elements of `dt`, or an error naming `arg` when that overflows.
pub(crate) fn bytes_of(count: usize, blocks: usize, dt: DType, arg: &str) -> Result<usize, Error> {
    count
        .checked_mul(blocks)
        .and_then(|n| n.checked_mul(dt.size()))
        .filter(|b| *b <= isize::MAX as usize)
        .ok_or_else(|| {
            let times = if blocks > 1 {
                format!(" × {blocks} ranks")
            } else {
                String::new()
            };
            invalid(format!(
                "{arg} {count}{times} × {} bytes overflows the address space",
                dt.size()
            ))
        })
}

/// The root as an index.
pub(crate) fn root_of(root: c_int, c: &Communicator) -> Result<usize, Error> {
    usize::try_from(root)
        .ok()
        .filter(|r| *r < c.world_size())
        .ok_or_else(|| {
            invalid(format!(
                "root {root} is out of range for {} ranks",
                c.world_size()
            ))
        })
}

/// All-reduce of `count` elements from `sendbuf` into `recvbuf` on every rank; in place when
/// `sendbuf == recvbuf`. Buffers may be NULL when `count` is 0. `stream` is NULL (the host stream) for
/// host memory; once `braid_comm_use_cuda_device` has given `comm` a GPU, a CUDA stream (`cudaStream_t`)
/// with device memory, and the call is then ordered on that stream and returns without waiting for the
/// GPU. The other blocking collectives (reduce-scatter, all-gather, broadcast, reduce, barrier) take
/// `stream` the same way; the asynchronous calls take the host stream only.
///
/// # Safety
/// `sendbuf` is readable and `recvbuf` writable for `count` elements, and neither is touched by another
/// thread during the call.
#[no_mangle]
pub unsafe extern "C" fn braid_all_reduce(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: braid_dtype,
    op: braid_redop,
    comm: *mut braid_comm,
    stream: *mut c_void,
) -> braid_result {
    guard("braid_all_reduce", || {
        let c = comm_of(comm)?;
        let dt = dtype_of(dtype)?;
        let op = redop_of(op)?;
        let n = bytes_of(count, 1, dt, "count")?;
        let s = Region::new(sendbuf, n, "sendbuf")?;
        let r = Region::new(recvbuf, n, "recvbuf")?;
        if let Some(d) = device::route(comm, stream, &[(s, "sendbuf"), (r, "recvbuf")])? {
            if !(n > 0 && s.ptr == r.ptr) {
                apart(&s, &r, "sendbuf == recvbuf")?;
            }
            // SAFETY: memory of the communicator's device (checked), valid until the stream passes.
            return unsafe {
                d.enqueue(d.comm.all_reduce_op(d.span(&s), d.span(&r), count, dt, op))
            };
        }
        if n > 0 && s.ptr == r.ptr {
            // SAFETY: the caller's buffer, exclusively ours for the call.
            return c.all_reduce_bytes_in_place(unsafe { r.bytes_mut() }, dt, op);
        }
        apart(&s, &r, "sendbuf == recvbuf")?;
        // SAFETY: two disjoint caller buffers (checked just above), ours for the call.
        let (sb, rb) = unsafe { (s.bytes(), r.bytes_mut()) };
        c.all_reduce_bytes(sb, rb, dt, op)
    })
}

/// Reduce-scatter: `sendbuf` holds `nranks · recvcount` elements; rank r receives the reduction of block
/// r in `recvbuf` (`recvcount` elements). In place when `recvbuf == sendbuf + rank · recvcount`.
///
/// # Safety
/// `sendbuf` is readable for `nranks · recvcount` elements and `recvbuf` writable for `recvcount`, and
/// neither is touched by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn braid_reduce_scatter(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dtype: braid_dtype,
    op: braid_redop,
    comm: *mut braid_comm,
    stream: *mut c_void,
) -> braid_result {
    guard("braid_reduce_scatter", || {
        let c = comm_of(comm)?;
        let dt = dtype_of(dtype)?;
        let op = redop_of(op)?;
        let n = bytes_of(recvcount, 1, dt, "recvcount")?;
        let total = bytes_of(recvcount, c.world_size(), dt, "recvcount")?;
        let s = Region::new(sendbuf, total, "sendbuf")?;
        let r = Region::new(recvbuf, n, "recvbuf")?;
        if let Some(d) = device::route(comm, stream, &[(s, "sendbuf"), (r, "recvbuf")])? {
            if s.overlaps(&r) {
                return Err(invalid(
                    "sendbuf and recvbuf overlap: an in-place reduce-scatter on device memory is not supported yet",
                ));
            }
            // SAFETY: disjoint memory of the communicator's device (checked), valid until the stream passes.
            return unsafe {
                d.enqueue(
                    d.comm
                        .reduce_scatter_op(d.span(&s), d.span(&r), recvcount, dt, op),
                )
            };
        }
        if n > 0 && r.at(0) == s.at(c.rank() * n) {
            if s.aligned_for(dt) {
                return with_type!(dt, |T| {
                    // SAFETY: the caller's send buffer, aligned (checked), ours for the call; the
                    // receive block lies inside it and is reached only through this slice.
                    c.reduce_scatter_in_place::<T>(unsafe { s.typed_mut::<T>() }, op)
                });
            }
            // SAFETY: the caller's send buffer, readable; the copy ends before recvbuf is written.
            let copy =
                braid_core::alloc::copied(unsafe { s.bytes() }, "an aligned copy of sendbuf")?;
            // SAFETY: the caller's receive buffer, ours for the call; `copy` is separate memory.
            return c.reduce_scatter_bytes(&copy, unsafe { r.bytes_mut() }, dt, op);
        }
        apart(&s, &r, "recvbuf == sendbuf + rank · recvcount")?;
        // SAFETY: two disjoint caller buffers, ours for the call.
        let (sb, rb) = unsafe { (s.bytes(), r.bytes_mut()) };
        c.reduce_scatter_bytes(sb, rb, dt, op)
    })
}

/// All-gather: every rank's `sendcount` elements land in `recvbuf` (`nranks · sendcount` elements) in
/// rank order. In place when `sendbuf == recvbuf + rank · sendcount`.
///
/// # Safety
/// `sendbuf` is readable for `sendcount` elements and `recvbuf` writable for `nranks · sendcount`, and
/// neither is touched by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn braid_all_gather(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendcount: usize,
    dtype: braid_dtype,
    comm: *mut braid_comm,
    stream: *mut c_void,
) -> braid_result {
    guard("braid_all_gather", || {
        let c = comm_of(comm)?;
        let dt = dtype_of(dtype)?;
        let n = bytes_of(sendcount, 1, dt, "sendcount")?;
        let total = bytes_of(sendcount, c.world_size(), dt, "sendcount")?;
        let s = Region::new(sendbuf, n, "sendbuf")?;
        let r = Region::new(recvbuf, total, "recvbuf")?;
        if let Some(d) = device::route(comm, stream, &[(s, "sendbuf"), (r, "recvbuf")])? {
            if !(n > 0 && s.at(0) == r.at(c.rank() * n)) {
                apart(&s, &r, "sendbuf == recvbuf + rank · sendcount")?;
            }
            // SAFETY: memory of the communicator's device (checked), valid until the stream passes; in
            // place the send block is this rank's block of the output.
            return unsafe {
                d.enqueue(d.comm.all_gather_op(d.span(&s), d.span(&r), sendcount, dt))
            };
        }
        if n > 0 && s.at(0) == r.at(c.rank() * n) {
            if r.aligned_for(dt) {
                return with_type!(dt, |T| {
                    // SAFETY: the caller's receive buffer, aligned, ours for the call; the send block lies
                    // inside it and is reached only through this slice.
                    c.all_gather_in_place::<T>(unsafe { r.typed_mut::<T>() })
                });
            }
            // SAFETY: the caller's send block, readable; the copy ends before recvbuf is written.
            let copy =
                braid_core::alloc::copied(unsafe { s.bytes() }, "an aligned copy of sendbuf")?;
            // SAFETY: the caller's receive buffer, ours for the call; `copy` is separate memory.
            return c.all_gather_bytes(&copy, unsafe { r.bytes_mut() }, dt);
        }
        apart(&s, &r, "sendbuf == recvbuf + rank · sendcount")?;
        // SAFETY: two disjoint caller buffers, ours for the call.
        let (sb, rb) = unsafe { (s.bytes(), r.bytes_mut()) };
        c.all_gather_bytes(sb, rb, dt)
    })
}

/// Broadcast of `count` elements from `root`'s `sendbuf` into every rank's `recvbuf`. `sendbuf` is read
/// on the root only (NULL elsewhere is fine); in place when `sendbuf == recvbuf`.
///
/// # Safety
/// On the root `sendbuf` is readable for `count` elements; `recvbuf` is writable for `count` elements;
/// neither is touched by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn braid_broadcast(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: braid_dtype,
    root: c_int,
    comm: *mut braid_comm,
    stream: *mut c_void,
) -> braid_result {
    guard("braid_broadcast", || {
        let c = comm_of(comm)?;
        let dt = dtype_of(dtype)?;
        let root = root_of(root, &c)?;
        let n = bytes_of(count, 1, dt, "count")?;
        let r = Region::new(recvbuf, n, "recvbuf")?;
        // Only the root passes a send buffer: an error in it is one its peers cannot see.
        let s = if c.rank() == root {
            Some(Region::new(sendbuf, n, "sendbuf").map_err(|e| c.one_sided(e))?)
        } else {
            None
        };
        // The stream and recvbuf are every rank's; an error in the root's sendbuf is the root's alone.
        if let Some(d) = device::route(comm, stream, &[(r, "recvbuf")])? {
            let send = match s {
                Some(s) => {
                    d.check(&s, "sendbuf").map_err(|e| c.one_sided(e))?;
                    if !(n > 0 && s.ptr == r.ptr) {
                        apart(&s, &r, "sendbuf == recvbuf").map_err(|e| c.one_sided(e))?;
                    }
                    d.span(&s)
                }
                // Off the root the send buffer is not read: the output stands in for it.
                None => d.span(&r),
            };
            // SAFETY: memory of the communicator's device (checked), valid until the stream passes.
            return unsafe { d.enqueue(d.comm.broadcast_op(send, d.span(&r), count, dt, root)) };
        }
        if let Some(s) = s {
            // The host stream: the root's sendbuf must not be device memory either.
            device::route(comm, stream, &[(s, "sendbuf")]).map_err(|e| c.one_sided(e))?;
        }
        if c.rank() != root {
            // SAFETY: the caller's receive buffer, ours for the call.
            return c.broadcast_bytes(&[], unsafe { r.bytes_mut() }, dt, root);
        }
        let s = s.unwrap_or(r);
        if n > 0 && s.ptr == r.ptr {
            if r.aligned_for(dt) {
                return with_type!(dt, |T| {
                    // SAFETY: the caller's buffer, aligned, ours for the call.
                    c.broadcast_in_place::<T>(unsafe { r.typed_mut::<T>() }, root)
                });
            }
            // SAFETY: readable; the copy ends before the buffer is written.
            let copy =
                braid_core::alloc::copied(unsafe { s.bytes() }, "an aligned copy of sendbuf")?;
            // SAFETY: the caller's buffer, ours for the call; `copy` is separate memory.
            return c.broadcast_bytes(&copy, unsafe { r.bytes_mut() }, dt, root);
        }
        apart(&s, &r, "sendbuf == recvbuf").map_err(|e| c.one_sided(e))?;
        // SAFETY: two disjoint caller buffers, ours for the call.
        let (sb, rb) = unsafe { (s.bytes(), r.bytes_mut()) };
        c.broadcast_bytes(sb, rb, dt, root)
    })
}

/// Reduce of `count` elements from every rank's `sendbuf` into `root`'s `recvbuf`. `recvbuf` is written
/// on the root only (NULL elsewhere is fine); in place when `sendbuf == recvbuf`.
///
/// # Safety
/// `sendbuf` is readable for `count` elements; on the root `recvbuf` is writable for `count` elements;
/// neither is touched by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn braid_reduce(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: braid_dtype,
    op: braid_redop,
    root: c_int,
    comm: *mut braid_comm,
    stream: *mut c_void,
) -> braid_result {
    guard("braid_reduce", || {
        let c = comm_of(comm)?;
        let dt = dtype_of(dtype)?;
        let op = redop_of(op)?;
        let root = root_of(root, &c)?;
        let n = bytes_of(count, 1, dt, "count")?;
        let s = Region::new(sendbuf, n, "sendbuf")?;
        // Only the root passes a receive buffer: an error in it is one its peers cannot see.
        let r = if c.rank() == root {
            Some(Region::new(recvbuf, n, "recvbuf").map_err(|e| c.one_sided(e))?)
        } else {
            None
        };
        // The stream and sendbuf are every rank's; an error in the root's recvbuf is the root's alone.
        if let Some(d) = device::route(comm, stream, &[(s, "sendbuf")])? {
            let recv = match r {
                Some(r) => {
                    d.check(&r, "recvbuf").map_err(|e| c.one_sided(e))?;
                    if !(n > 0 && s.ptr == r.ptr) {
                        apart(&s, &r, "sendbuf == recvbuf").map_err(|e| c.one_sided(e))?;
                    }
                    d.span(&r)
                }
                None => d.span(&s),
            };
            // SAFETY: memory of the communicator's device (checked), valid until the stream passes.
            return unsafe { d.enqueue(d.comm.reduce_op(d.span(&s), recv, count, dt, op, root)) };
        }
        if let Some(r) = r {
            // The host stream: the root's recvbuf must not be device memory either.
            device::route(comm, stream, &[(r, "recvbuf")]).map_err(|e| c.one_sided(e))?;
        }
        let Some(r) = r else {
            // SAFETY: the caller's send buffer, only read.
            return c.reduce_bytes(unsafe { s.bytes() }, &mut [], dt, op, root);
        };
        if n > 0 && s.ptr == r.ptr {
            if r.aligned_for(dt) {
                return with_type!(dt, |T| {
                    // SAFETY: the caller's buffer, aligned, ours for the call.
                    c.reduce_in_place::<T>(unsafe { r.typed_mut::<T>() }, op, root)
                });
            }
            // SAFETY: readable; the copy ends before the buffer is written.
            let copy =
                braid_core::alloc::copied(unsafe { s.bytes() }, "an aligned copy of sendbuf")?;
            // SAFETY: the caller's buffer, ours for the call; `copy` is separate memory.
            return c.reduce_bytes(&copy, unsafe { r.bytes_mut() }, dt, op, root);
        }
        apart(&s, &r, "sendbuf == recvbuf").map_err(|e| c.one_sided(e))?;
        // SAFETY: two disjoint caller buffers, ours for the call.
        let (sb, rb) = unsafe { (s.bytes(), r.bytes_mut()) };
        c.reduce_bytes(sb, rb, dt, op, root)
    })
}

/// Returns when every rank has called it.
///
/// # Safety
/// None beyond passing a handle value.
#[no_mangle]
pub unsafe extern "C" fn braid_barrier(comm: *mut braid_comm, stream: *mut c_void) -> braid_result {
    guard("braid_barrier", || {
        let c = comm_of(comm)?;
        if let Some(d) = device::route(comm, stream, &[])? {
            // SAFETY: a barrier touches no memory.
            return unsafe { d.enqueue(d.comm.barrier_op()) };
        }
        c.barrier()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_counts_are_checked() {
        assert_eq!(dtype_of(7).unwrap(), DType::F32);
        assert!(dtype_of(-1).unwrap_err().to_string().contains("dtype -1"));
        assert!(dtype_of(10).is_err());
        assert_eq!(redop_of(4).unwrap(), ReduceOp::Avg);
        assert_eq!(redop_of(7).unwrap(), ReduceOp::BitXor);
        assert!(redop_of(8).unwrap_err().to_string().contains("op 8"));
        assert_eq!(bytes_of(3, 2, DType::F64, "count").unwrap(), 48);
        let e = bytes_of(usize::MAX / 4, 1, DType::F64, "count").unwrap_err();
        assert!(e.to_string().contains("count"), "{e}");
        assert!(bytes_of(usize::MAX / 2, 4, DType::U8, "sendcount").is_err());
        let mut x = [0u8; 4];
        assert!(host_stream(x.as_mut_ptr().cast()).is_err());
    }
}
