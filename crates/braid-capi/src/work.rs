//! Asynchronous collectives and their work handles.
//!
//! They copy nothing: the collective reads the caller's send buffer and writes the caller's receive
//! buffer while it runs, as NCCL's do, so both must stay valid and untouched until the work has completed
//! (`braid_work_wait`, or `braid_work_test` reporting done). `braid_work_free` on unfinished work waits for
//! it first (bounded by the timeout), so that no collective touches memory the caller has taken back.

use std::ffi::{c_int, c_void};
use std::sync::Mutex;

use braid_rt::{Error, Work};

use crate::collectives::{apart, bytes_of, checked_comm, dtype_of, redop_of, root_of, Region};
use crate::guard::guard;
use crate::{braid_comm, braid_dtype, braid_redop, braid_result, need_out, registry, write_out};

/// A collective in flight (opaque).
pub struct braid_work {
    _private: [u8; 0],
}

const WORK: &str = "braid_work";

/// A runtime `Work` whose op runs on the caller's buffers.
trait Pending: Send {
    fn done(&self) -> bool;
    fn finish(self: Box<Self>) -> Result<(), Error>;
}

struct Raw(Work<()>);

impl Pending for Raw {
    fn done(&self) -> bool {
        self.0.test()
    }
    fn finish(self: Box<Self>) -> Result<(), Error> {
        self.0.wait()
    }
}

/// A work handle's state: pending until completed once, then its outcome.
struct WorkState {
    pending: Option<Box<dyn Pending>>,
    outcome: Option<Result<(), Error>>,
}

impl WorkState {
    fn complete(&mut self) -> Result<(), Error> {
        if let Some(p) = self.pending.take() {
            self.outcome = Some(p.finish());
        }
        self.outcome.clone().expect("completed")
    }
}

/// Registers a pending op and writes its handle.
///
/// # Safety
/// `out` is valid for writing a pointer (checked for NULL before the op was issued).
unsafe fn publish(out: *mut *mut braid_work, p: Box<dyn Pending>) -> Result<(), Error> {
    let state = Mutex::new(WorkState {
        pending: Some(p),
        outcome: None,
    });
    let token = registry::insert(WORK, state);
    // SAFETY: checked by the caller, writable per the export's contract.
    unsafe { write_out(out, token as *mut braid_work, "out") }
}

/// Queues an all-reduce of `count` elements from `sendbuf` into `recvbuf` (`sendbuf == recvbuf` is
/// fine) on stream 0, without copying. `*out` receives the work handle; free it with `braid_work_free`.
///
/// # Safety
/// `sendbuf` is readable and `recvbuf` writable for `count` elements, both left alone until the work
/// completes or is freed; `out` is NULL or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn braid_all_reduce_async(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: braid_dtype,
    op: braid_redop,
    comm: *mut braid_comm,
    stream: *mut c_void,
    out: *mut *mut braid_work,
) -> braid_result {
    guard("braid_all_reduce_async", || {
        let c = checked_comm(comm, stream)?;
        let dt = dtype_of(dtype)?;
        let op = redop_of(op)?;
        need_out(out, "out")?;
        let n = bytes_of(count, 1, dt, "count")?;
        let s = Region::new(sendbuf, n, "sendbuf")?;
        let r = Region::new(recvbuf, n, "recvbuf")?;
        if s.ptr != r.ptr {
            apart(&s, &r, "sendbuf == recvbuf")?;
        }
        // SAFETY: the caller keeps both buffers valid and untouched until the work completes or is
        // freed (which waits for it); they are the same or apart (checked).
        let work = unsafe { c.all_reduce_raw_async(0, s.ptr, r.ptr, n, dt, op)? };
        // SAFETY: `out` checked above.
        unsafe { publish(out, Box::new(Raw(work))) }
    })
}

/// Queues an all-gather of `sendcount` elements per rank into `recvbuf` (`nranks · sendcount`
/// elements) on stream 0, without copying. In place (`sendbuf == recvbuf + rank · sendcount`) is fine.
///
/// # Safety
/// As `braid_all_reduce_async`, with `recvbuf` writable for `nranks · sendcount` elements.
#[no_mangle]
pub unsafe extern "C" fn braid_all_gather_async(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendcount: usize,
    dtype: braid_dtype,
    comm: *mut braid_comm,
    stream: *mut c_void,
    out: *mut *mut braid_work,
) -> braid_result {
    guard("braid_all_gather_async", || {
        let c = checked_comm(comm, stream)?;
        let dt = dtype_of(dtype)?;
        need_out(out, "out")?;
        let n = bytes_of(sendcount, 1, dt, "sendcount")?;
        let total = bytes_of(sendcount, c.world_size(), dt, "sendcount")?;
        let s = Region::new(sendbuf, n, "sendbuf")?;
        let r = Region::new(recvbuf, total, "recvbuf")?;
        if !(n > 0 && s.at(0) == r.at(c.rank() * n)) {
            apart(&s, &r, "sendbuf == recvbuf + rank · sendcount")?;
        }
        // SAFETY: as in `braid_all_reduce_async`; in place the send block lies inside the output.
        let work = unsafe { c.all_gather_raw_async(0, s.ptr, r.ptr, n, dt)? };
        // SAFETY: `out` checked above.
        unsafe { publish(out, Box::new(Raw(work))) }
    })
}

/// Queues a broadcast from `root` of `count` elements (read from `sendbuf` on the root) into every
/// rank's `recvbuf` on stream 0, without copying.
///
/// # Safety
/// As `braid_all_reduce_async` (`sendbuf` is read on the root only).
#[no_mangle]
pub unsafe extern "C" fn braid_broadcast_async(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: braid_dtype,
    root: c_int,
    comm: *mut braid_comm,
    stream: *mut c_void,
    out: *mut *mut braid_work,
) -> braid_result {
    guard("braid_broadcast_async", || {
        let c = checked_comm(comm, stream)?;
        let dt = dtype_of(dtype)?;
        let root = root_of(root, &c)?;
        need_out(out, "out")?;
        let n = bytes_of(count, 1, dt, "count")?;
        let r = Region::new(recvbuf, n, "recvbuf")?;
        let send = if c.rank() == root {
            let s = Region::new(sendbuf, n, "sendbuf")?;
            if s.ptr != r.ptr {
                apart(&s, &r, "sendbuf == recvbuf")?;
            }
            s.ptr
        } else {
            r.ptr
        };
        // SAFETY: as in `braid_all_reduce_async`; off the root the send buffer is not read.
        let work = unsafe { c.broadcast_raw_async(0, send, r.ptr, n, dt, root)? };
        // SAFETY: `out` checked above.
        unsafe { publish(out, Box::new(Raw(work))) }
    })
}

/// Queues a barrier.
///
/// # Safety
/// `out` is NULL or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn braid_barrier_async(
    comm: *mut braid_comm,
    stream: *mut c_void,
    out: *mut *mut braid_work,
) -> braid_result {
    guard("braid_barrier_async", || {
        let c = checked_comm(comm, stream)?;
        need_out(out, "out")?;
        let work = c.barrier_async();
        // SAFETY: `out` checked above.
        unsafe { publish(out, Box::new(Raw(work))) }
    })
}

fn state_of(work: *mut braid_work) -> Result<std::sync::Arc<Mutex<WorkState>>, Error> {
    registry::get::<Mutex<WorkState>>(work as usize, WORK, "work")
}

/// Waits for the work and returns the collective's result (the receive buffer then holds it). Waiting again returns the same result. The handle stays valid until
/// `braid_work_free`.
///
/// # Safety
/// None beyond passing a handle value (and the receive buffer's contract from the issuing call).
#[no_mangle]
pub unsafe extern "C" fn braid_work_wait(work: *mut braid_work) -> braid_result {
    guard("braid_work_wait", || {
        let state = state_of(work)?;
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        st.complete()
    })
}

/// Writes 1 to `*done` when the work has completed (the receive buffer then holds its result, and the
/// collective's result is returned), else 0 and `BRAID_SUCCESS`.
///
/// # Safety
/// `done` is NULL or valid for writing an `int`.
#[no_mangle]
pub unsafe extern "C" fn braid_work_test(work: *mut braid_work, done: *mut c_int) -> braid_result {
    guard("braid_work_test", || {
        let state = state_of(work)?;
        need_out(done, "done")?;
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        let finished = st.pending.as_ref().is_none_or(|p| p.done());
        // SAFETY: checked not NULL; writable per the contract.
        unsafe { write_out(done, c_int::from(finished), "done") }?;
        if finished {
            st.complete()
        } else {
            Ok(())
        }
    })
}

/// Releases a work handle. NULL does nothing; a freed handle is `BRAID_INVALID_ARGUMENT`. Freeing work that
/// has not completed waits for it first (bounded by the timeout; a collective cannot be cancelled, and
/// it works on the caller's buffers), then discards its result.
///
/// # Safety
/// None beyond passing a handle value.
#[no_mangle]
pub unsafe extern "C" fn braid_work_free(work: *mut braid_work) -> braid_result {
    guard("braid_work_free", || {
        if work.is_null() {
            return Ok(());
        }
        let state = registry::remove::<Mutex<WorkState>>(work as usize, WORK, "work")?;
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        let _ = st.complete();
        Ok(())
    })
}
