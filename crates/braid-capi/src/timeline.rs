//! The timeline (`BRAID_TIMELINE`): the caller's own spans beside braid's collectives.

use std::ffi::{c_char, CStr};

use crate::guard::{guard, invalid};
use crate::{braid_comm, braid_result, comm_of, write_out};

/// The host's monotonic clock in nanoseconds, the clock of the timeline (`CLOCK_MONOTONIC`).
///
/// # Safety
/// `out_ns` is valid for writing a `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn braid_timeline_now(out_ns: *mut u64) -> braid_result {
    guard("braid_timeline_now", || {
        // SAFETY: checked for NULL by `write_out`; writable per the contract.
        unsafe { write_out(out_ns, braid_rt::timeline::now_ns(), "out_ns") }
    })
}

/// Puts the caller's span `name` from `start_ns` to `end_ns` (`braid_timeline_now` readings) on the
/// timeline's `compute` thread; does nothing when `BRAID_TIMELINE` is not set. An end before the start is
/// `BRAID_INVALID_ARGUMENT`.
///
/// # Safety
/// `name` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn braid_timeline_event(
    comm: *mut braid_comm,
    name: *const c_char,
    start_ns: u64,
    end_ns: u64,
) -> braid_result {
    guard("braid_timeline_event", || {
        let c = comm_of(comm)?;
        if name.is_null() {
            return Err(invalid("name is NULL"));
        }
        // SAFETY: not NULL, NUL-terminated per the contract.
        let name = unsafe { CStr::from_ptr(name) }
            .to_str()
            .map_err(|_| invalid("name is not UTF-8"))?;
        c.timeline_event(name, start_ns, end_ns)
    })
}

/// Writes the timeline's file now (it is also written when the communicator is destroyed); does
/// nothing without `BRAID_TIMELINE`.
///
/// # Safety
/// None beyond passing a handle value.
#[no_mangle]
pub unsafe extern "C" fn braid_timeline_flush(comm: *mut braid_comm) -> braid_result {
    guard("braid_timeline_flush", || {
        comm_of(comm)?.timeline_flush().map(|_| ())
    })
}
