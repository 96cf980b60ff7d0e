//! Asynchronous collectives and their work handles.
//!
//! The runtime's asynchronous collectives own their buffers, so a C call copies the send buffer in when
//! it is issued and copies the result out to the caller's receive buffer when the work completes
//! (`braid_work_wait`, or `braid_work_test` reporting done). The receive buffer must therefore stay valid
//! until then, or until `braid_work_free`; the send buffer may be reused as soon as the call returns.

use std::ffi::{c_int, c_void};
use std::sync::Mutex;

use braid_rt::{DType, Element, Error, Work};

use crate::collectives::{
    apart, bytes_of, checked_comm, dtype_of, redop_of, root_of, with_type, Region,
};
use crate::guard::guard;
use crate::{braid_comm, braid_dtype, braid_redop, braid_result, need_out, registry, write_out};

/// A collective in flight (opaque).
pub struct braid_work {
    _private: [u8; 0],
}

const WORK: &str = "braid_work";

/// The caller's receive buffer, written once when the work completes.
struct Out(Region);

// SAFETY: the address is only written by whichever thread completes the work, under the work's lock; the
// caller promised the buffer stays valid and untouched until then.
unsafe impl Send for Out {}

/// A runtime `Work` and where its result goes.
trait Pending: Send {
    fn done(&self) -> bool;
    fn finish(self: Box<Self>) -> Result<(), Error>;
}

struct Typed<R> {
    work: Work<R>,
    out: Out,
}

impl<T: Element> Pending for Typed<Vec<T>> {
    fn done(&self) -> bool {
        self.work.test()
    }
    fn finish(self: Box<Self>) -> Result<(), Error> {
        let v = self.work.wait()?;
        let b: &[u8] = bytemuck::cast_slice(&v);
        let out = &self.out.0;
        assert_eq!(b.len(), out.len, "result length of an async collective");
        // SAFETY: the caller's receive buffer is valid for `out.len` bytes until the work completes (the
        // contract of the async calls), and `v` is our own memory.
        unsafe { out.bytes_mut() }.copy_from_slice(b);
        Ok(())
    }
}

impl Pending for Typed<()> {
    fn done(&self) -> bool {
        self.work.test()
    }
    fn finish(self: Box<Self>) -> Result<(), Error> {
        self.work.wait()
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

/// A vector of `T` holding a copy of `src`.
fn owned<T: Element>(src: &[u8]) -> Vec<T> {
    let mut v = vec![<T as bytemuck::Zeroable>::zeroed(); src.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(src);
    v
}

/// Queues an all-reduce of `count` elements: `sendbuf` is copied now, the result is written to `recvbuf`
/// when the work completes (`sendbuf == recvbuf` is fine). `*out` receives the work handle; free it with
/// `braid_work_free`.
///
/// # Safety
/// `sendbuf` is readable for `count` elements during the call; `recvbuf` is writable for `count` elements
/// and left alone until the work completes or is freed; `out` is NULL or valid for writing a pointer.
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
        // SAFETY: the caller's send buffer, readable during the call.
        let src = unsafe { s.bytes() };
        let p: Box<dyn Pending> = with_type!(dt, |T| Box::new(Typed {
            work: c.all_reduce_async(owned::<T>(src), op),
            out: Out(r),
        }));
        // SAFETY: `out` checked above.
        unsafe { publish(out, p) }
    })
}

/// Queues an all-gather: `sendcount` elements of `sendbuf` are copied now; `recvbuf` (`nranks ·
/// sendcount` elements) is written when the work completes. In place (`sendbuf == recvbuf + rank ·
/// sendcount`) is fine.
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
        // SAFETY: the caller's send buffer, readable during the call.
        let src = unsafe { s.bytes() };
        let p: Box<dyn Pending> = with_type!(dt, |T| Box::new(Typed {
            work: c.all_gather_async(owned::<T>(src)),
            out: Out(r),
        }));
        // SAFETY: `out` checked above.
        unsafe { publish(out, p) }
    })
}

/// Queues a broadcast from `root`: on the root `sendbuf` is copied now; every rank's `recvbuf` is written
/// when the work completes.
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
        let zeros;
        let src: &[u8] = if c.rank() == root {
            let s = Region::new(sendbuf, n, "sendbuf")?;
            if s.ptr != r.ptr {
                apart(&s, &r, "sendbuf == recvbuf")?;
            }
            // SAFETY: the caller's send buffer, readable during the call.
            unsafe { s.bytes() }
        } else {
            zeros = vec![0u8; n];
            &zeros
        };
        let p: Box<dyn Pending> = with_type!(dt, |T| Box::new(Typed {
            work: c.broadcast_async(owned::<T>(src), root)?,
            out: Out(r),
        }));
        // SAFETY: `out` checked above.
        unsafe { publish(out, p) }
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
        let empty = Region::new(std::ptr::null(), 0, "recvbuf")?;
        let p: Box<dyn Pending> = Box::new(Typed {
            work: c.barrier_async(),
            out: Out(empty),
        });
        // SAFETY: `out` checked above.
        unsafe { publish(out, p) }
    })
}

fn state_of(work: *mut braid_work) -> Result<std::sync::Arc<Mutex<WorkState>>, Error> {
    registry::get::<Mutex<WorkState>>(work as usize, WORK, "work")
}

/// Waits for the work, writes its result to the receive buffer given when it was issued, and returns the
/// collective's result. Waiting again returns the same result. The handle stays valid until
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

/// Writes 1 to `*done` when the work has completed (its result is then in the receive buffer, and the
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
/// has not completed does not cancel the collective (it still runs, in order), but its result is
/// discarded and the receive buffer is not written.
///
/// # Safety
/// None beyond passing a handle value.
#[no_mangle]
pub unsafe extern "C" fn braid_work_free(work: *mut braid_work) -> braid_result {
    guard("braid_work_free", || {
        if work.is_null() {
            return Ok(());
        }
        drop(registry::remove::<Mutex<WorkState>>(
            work as usize,
            WORK,
            "work",
        )?);
        Ok(())
    })
}
