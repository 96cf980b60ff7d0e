//! Asynchronous collectives and their work handles.
//!
//! They copy nothing: the collective reads the caller's send buffer and writes the caller's receive
//! buffer while it runs, as NCCL's do, so both must stay valid and untouched until the work has completed
//! (`braid_work_wait`, or `braid_work_test` reporting done). `braid_work_free` on unfinished work waits for
//! it first (bounded by the timeout), so that no collective touches memory the caller has taken back.

use std::ffi::{c_int, c_void};
use std::sync::Mutex;

use braid_rt::{Error, Work};

use crate::collectives::{bytes_of, checked_comm, dtype_of, redop_of, root_of};
use crate::guard::{guard, invalid};
use crate::region::{apart, Region};
use crate::{braid_comm, braid_dtype, braid_redop, braid_result, need_out, registry, write_out};

/// A collective in flight (opaque).
pub struct braid_work {
    _private: [u8; 0],
}

const WORK: &str = "braid_work";

/// What a completion callback is given.
type Done = Box<dyn FnOnce(&Result<(), Error>) + Send>;

/// A runtime `Work` whose op runs on the caller's buffers.
trait Pending: Send {
    fn done(&self) -> bool;
    fn on_complete(&self, f: Done);
    fn finish(self: Box<Self>) -> Result<(), Error>;
}

struct Raw(Work<()>);

impl Pending for Raw {
    fn done(&self) -> bool {
        self.0.test()
    }
    fn on_complete(&self, f: Done) {
        self.0.on_complete(f)
    }
    fn finish(self: Box<Self>) -> Result<(), Error> {
        self.0.wait()
    }
}

/// A work handle's state: pending until completed once, then its outcome.
struct WorkState {
    pending: Option<Box<dyn Pending>>,
    outcome: Option<Result<(), Error>>,
    /// Whether `braid_work_on_complete` was called.
    callback_set: bool,
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
        callback_set: false,
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

/// Queues a reduce-scatter on stream 0, without copying: `sendbuf` holds `nranks · recvcount` elements
/// and rank r's `recvbuf` (`recvcount` elements) gets the reduction of block r. In place when `recvbuf ==
/// sendbuf + rank · recvcount`.
///
/// # Safety
/// As `braid_all_reduce_async`, with `sendbuf` readable for `nranks · recvcount` elements.
#[no_mangle]
pub unsafe extern "C" fn braid_reduce_scatter_async(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dtype: braid_dtype,
    op: braid_redop,
    comm: *mut braid_comm,
    stream: *mut c_void,
    out: *mut *mut braid_work,
) -> braid_result {
    guard("braid_reduce_scatter_async", || {
        let c = checked_comm(comm, stream)?;
        let dt = dtype_of(dtype)?;
        let op = redop_of(op)?;
        need_out(out, "out")?;
        let n = bytes_of(recvcount, 1, dt, "recvcount")?;
        let total = bytes_of(recvcount, c.world_size(), dt, "recvcount")?;
        let s = Region::new(sendbuf, total, "sendbuf")?;
        let r = Region::new(recvbuf, n, "recvbuf")?;
        if !(n > 0 && r.at(0) == s.at(c.rank() * n)) {
            apart(&s, &r, "recvbuf == sendbuf + rank · recvcount")?;
        }
        // SAFETY: as in `braid_all_reduce_async`; in place the receive block lies inside the input.
        let work = unsafe { c.reduce_scatter_raw_async(0, s.ptr, r.ptr, n, dt, op)? };
        // SAFETY: `out` checked above.
        unsafe { publish(out, Box::new(Raw(work))) }
    })
}

/// Queues a reduce of `count` elements from every rank's `sendbuf` into `root`'s `recvbuf` on stream 0,
/// without copying. `recvbuf` is written on the root only (NULL elsewhere is fine); in place when
/// `sendbuf == recvbuf`.
///
/// # Safety
/// As `braid_all_reduce_async` (`recvbuf` is used on the root only).
#[no_mangle]
pub unsafe extern "C" fn braid_reduce_async(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: braid_dtype,
    op: braid_redop,
    root: c_int,
    comm: *mut braid_comm,
    stream: *mut c_void,
    out: *mut *mut braid_work,
) -> braid_result {
    guard("braid_reduce_async", || {
        let c = checked_comm(comm, stream)?;
        let dt = dtype_of(dtype)?;
        let op = redop_of(op)?;
        let root = root_of(root, &c)?;
        need_out(out, "out")?;
        let n = bytes_of(count, 1, dt, "count")?;
        let s = Region::new(sendbuf, n, "sendbuf")?;
        // Only the root passes a receive buffer: an error in it is one its peers cannot see.
        let recv = if c.rank() == root {
            let r = Region::new(recvbuf, n, "recvbuf").map_err(|e| c.one_sided(e))?;
            if s.ptr != r.ptr {
                apart(&s, &r, "sendbuf == recvbuf").map_err(|e| c.one_sided(e))?;
            }
            Some(r.ptr)
        } else {
            None
        };
        // SAFETY: as in `braid_all_reduce_async`; off the root the send buffer is only read.
        let work = unsafe { c.reduce_raw_async(0, s.ptr, recv, n, dt, op, root)? };
        // SAFETY: `out` checked above.
        unsafe { publish(out, Box::new(Raw(work))) }
    })
}

/// Queues an all-to-all on stream 0, without copying: `sendbuf` and `recvbuf` each hold `nranks`
/// blocks of `count` elements; this rank's send block j goes to rank j, and receive block p is what rank
/// p sent to this rank. The buffers must not overlap.
///
/// # Safety
/// As `braid_all_reduce_async`, with both buffers valid for `nranks · count` elements.
#[no_mangle]
pub unsafe extern "C" fn braid_all_to_all_async(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: braid_dtype,
    comm: *mut braid_comm,
    stream: *mut c_void,
    out: *mut *mut braid_work,
) -> braid_result {
    guard("braid_all_to_all_async", || {
        let c = checked_comm(comm, stream)?;
        let dt = dtype_of(dtype)?;
        need_out(out, "out")?;
        let n = bytes_of(count, 1, dt, "count")?;
        let total = bytes_of(count, c.world_size(), dt, "count")?;
        let s = Region::new(sendbuf, total, "sendbuf")?;
        let r = Region::new(recvbuf, total, "recvbuf")?;
        apart(&s, &r, "(no in-place all-to-all)")?;
        // SAFETY: as in `braid_all_reduce_async`; the buffers are apart (checked).
        let work = unsafe { c.all_to_all_raw_async(0, s.ptr, r.ptr, n, dt)? };
        // SAFETY: `out` checked above.
        unsafe { publish(out, Box::new(Raw(work))) }
    })
}

/// Reads `nranks` (count, displacement) pairs in elements from two C arrays into ranges, checking that
/// each ends within `limit` elements.
///
/// # Safety
/// `counts` and `displs` are NULL or readable for `n` elements.
unsafe fn blocks_of(
    counts: *const usize,
    displs: *const usize,
    n: usize,
    limit: usize,
    what: &str,
) -> Result<Vec<std::ops::Range<usize>>, Error> {
    if counts.is_null() || displs.is_null() {
        return Err(invalid(format!(
            "{what}counts and {what}displs must not be NULL"
        )));
    }
    // SAFETY: not NULL, and the caller promises `n` readable elements each.
    let (c, d) = unsafe {
        (
            std::slice::from_raw_parts(counts, n),
            std::slice::from_raw_parts(displs, n),
        )
    };
    c.iter()
        .zip(d)
        .enumerate()
        .map(|(j, (&count, &displ))| {
            displ
                .checked_add(count)
                .filter(|end| *end <= limit)
                .map(|end| displ..end)
                .ok_or_else(|| {
                    invalid(format!(
                        "{what}counts[{j}] = {count} at {what}displs[{j}] = {displ} ends past the buffer's {limit} elements"
                    ))
                })
        })
        .collect()
}

/// Queues an all-to-all whose blocks differ in size (MPI's `MPI_Alltoallv`) on stream 0, without
/// copying: `sendcounts[j]` elements at `sdispls[j]` of `sendbuf` go to rank j, and what rank p sends
/// here lands in `recvcounts[p]` elements at `rdispls[p]` of `recvbuf`. Counts and displacements are in
/// elements; `sendbuf` holds `sendlen` elements and `recvbuf` `recvlen`, and they must not overlap. The
/// counts must agree pairwise (rank i's `sendcounts[j]` is rank j's `recvcounts[i]`), as in MPI: a rank
/// that receives a block of another non-zero size than it expects fails with `BRAID_MISMATCH` (and its
/// peers at their next collective), but a block expected and never sent, or sent and not expected (a zero
/// on one side only), is noticed only by a later collective or the timeout.
///
/// # Safety
/// As `braid_all_reduce_async`, with `sendbuf` readable for `sendlen` elements and `recvbuf` writable
/// for `recvlen`; the four arrays are readable for `nranks` elements each.
#[no_mangle]
pub unsafe extern "C" fn braid_all_to_all_v_async(
    sendbuf: *const c_void,
    sendlen: usize,
    sendcounts: *const usize,
    sdispls: *const usize,
    recvbuf: *mut c_void,
    recvlen: usize,
    recvcounts: *const usize,
    rdispls: *const usize,
    dtype: braid_dtype,
    comm: *mut braid_comm,
    stream: *mut c_void,
    out: *mut *mut braid_work,
) -> braid_result {
    guard("braid_all_to_all_v_async", || {
        let c = checked_comm(comm, stream)?;
        let dt = dtype_of(dtype)?;
        need_out(out, "out")?;
        let world = c.world_size();
        let sn = bytes_of(sendlen, 1, dt, "sendlen")?;
        let rn = bytes_of(recvlen, 1, dt, "recvlen")?;
        // SAFETY: the caller promises `nranks` readable elements in each array (NULL is refused).
        let (send, recv) = unsafe {
            (
                blocks_of(sendcounts, sdispls, world, sendlen, "send")?,
                blocks_of(recvcounts, rdispls, world, recvlen, "recv")?,
            )
        };
        let s = Region::new(sendbuf, sn, "sendbuf")?;
        let r = Region::new(recvbuf, rn, "recvbuf")?;
        apart(&s, &r, "(no in-place all-to-all)")?;
        // SAFETY: as in `braid_all_reduce_async`; the buffers are apart and every block lies within
        // its buffer (checked).
        let work = unsafe { c.all_to_all_v_raw_async(0, s.ptr, sn, send, r.ptr, rn, recv, dt)? };
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

/// Called once when a collective completes, with `user_data` and the collective's result. On failure
/// `braid_get_last_error_message()` on the calling thread gives the message while the callback runs.
pub type braid_work_callback =
    Option<unsafe extern "C" fn(user_data: *mut c_void, result: braid_result)>;

/// A `*mut c_void` that crosses to the progress thread: the caller of `braid_work_on_complete`
/// promises that its callback may run there with it.
struct UserData(*mut c_void);
// SAFETY: see `braid_work_on_complete`'s contract: the pointer is only handed back to the caller's
// callback, which accepts being called on another thread.
unsafe impl Send for UserData {}

/// Calls `callback(user_data, result)` once the work completes: at once, on this thread, if it
/// already has; otherwise on the thread that completes it (braid's progress thread), so the callback
/// should return promptly; it may issue collectives and wait for them (a wait on braid's progress thread
/// advances the communicator itself). The work's result stays available to
/// `braid_work_wait`/`braid_work_test` (which then return at once), and the handle must still be freed. One
/// callback per handle: a second call is `BRAID_INVALID_ARGUMENT` and changes nothing.
///
/// # Safety
/// `callback` may be called on another thread with `user_data`, which must stay valid until then.
#[no_mangle]
pub unsafe extern "C" fn braid_work_on_complete(
    work: *mut braid_work,
    callback: braid_work_callback,
    user_data: *mut c_void,
) -> braid_result {
    guard("braid_work_on_complete", || {
        let state = state_of(work)?;
        let Some(callback) = callback else {
            return Err(invalid("callback must not be NULL"));
        };
        let user = UserData(user_data);
        let call = move |r: &Result<(), Error>| {
            let user = user;
            let code = match r {
                Ok(()) => braid_result::BRAID_SUCCESS,
                Err(e) => {
                    crate::guard::set_last_error(&format!("work: {e}"));
                    crate::guard::code_of(e)
                }
            };
            // SAFETY: the caller's contract: its callback accepts this pointer on this thread. A
            // panic cannot cross it (it is C code, or a Rust `extern "C"` fn, which aborts instead).
            unsafe { callback(user.0, code) };
            crate::guard::set_last_error("");
        };
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        if st.callback_set {
            return Err(invalid("this work already has a completion callback"));
        }
        st.callback_set = true;
        let Some(p) = st.pending.as_ref() else {
            // Completed through wait or test: call at once, without the lock (the callback may call
            // braid_work_wait on this handle).
            let r = st.outcome.clone().unwrap_or(Ok(()));
            drop(st);
            call(&r);
            return Ok(());
        };
        // The runtime calls the closure at once, on this thread, when the op has already completed, or
        // later on the progress thread; a closure that runs while this thread still holds the state's
        // lock (registering) leaves the result for this thread to call with after letting go of it.
        let slot = std::sync::Arc::new(Mutex::new(Handoff {
            registering: true,
            result: None,
            call: Some(Box::new(call)),
        }));
        let theirs = slot.clone();
        p.on_complete(Box::new(move |r: &Result<(), Error>| {
            let mut h = theirs.lock().unwrap_or_else(|e| e.into_inner());
            if h.registering {
                h.result = Some(r.clone());
            } else if let Some(call) = h.call.take() {
                drop(h);
                call(r);
            }
        }));
        drop(st);
        let mut h = slot.lock().unwrap_or_else(|e| e.into_inner());
        h.registering = false;
        if let Some(r) = h.result.take() {
            if let Some(call) = h.call.take() {
                drop(h);
                call(&r);
            }
        }
        Ok(())
    })
}

/// A completion callback on its way from the progress thread (or the registering call) to the caller.
struct Handoff {
    registering: bool,
    result: Option<Result<(), Error>>,
    call: Option<Done>,
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
