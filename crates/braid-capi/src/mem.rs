//! Shared buffers in the C ABI: `braid_mem_alloc` hands out memory every rank of the host maps
//! (`Communicator::alloc`), `braid_mem_free` ends its use; collectives whose buffers all lie in such
//! memory run straight through it.

use std::collections::HashMap;
use std::ffi::c_void;

use braid_rt::{Error, SharedBuffer};
use parking_lot::Mutex;

use crate::guard::guard;
use crate::{braid_comm, braid_result, comm_of, write_out};

/// Every live allocation, by its address: the communicator handle it belongs to and the buffer.
static BUFFERS: Mutex<Option<HashMap<usize, (usize, SharedBuffer)>>> = Mutex::new(None);

/// Drops the allocations of a communicator being destroyed.
pub(crate) fn forget(comm: *mut braid_comm) {
    if let Some(map) = BUFFERS.lock().as_mut() {
        map.retain(|_, (owner, _)| *owner != comm as usize);
    }
}

/// Allocates `bytes` of memory that every rank of the host maps, zeroed and page-aligned, and writes
/// its address to `*out`. Collective: every rank of the communicator calls it, in the same order (the
/// sizes may differ). A collective whose buffers all lie in such memory, on every rank, runs straight
/// through it (no staging copies); all ranks must pass such buffers, or none. Refused on every rank
/// (and `*out` untouched): 0 bytes on some rank (`BRAID_INVALID_ARGUMENT`), more memory than the
/// machine has (`BRAID_OUT_OF_MEMORY`, naming the rank), ranks on several hosts.
///
/// # Safety
/// `out` must be valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn braid_mem_alloc(
    comm: *mut braid_comm,
    bytes: usize,
    out: *mut *mut c_void,
) -> braid_result {
    guard("braid_mem_alloc", || {
        let c = comm_of(comm)?;
        if out.is_null() {
            return Err(Error::invalid("braid_mem_alloc: out is NULL"));
        }
        let mut buf = c.alloc(bytes)?;
        let ptr = buf.as_mut_ptr();
        // SAFETY: checked not NULL; the caller promises it is writable.
        unsafe { write_out(out, ptr.cast::<c_void>(), "out")? };
        BUFFERS
            .lock()
            .get_or_insert_with(HashMap::new)
            .insert(ptr as usize, (comm as usize, buf));
        Ok(())
    })
}

/// Ends the use of memory from `braid_mem_alloc` by collectives. Not collective; the memory stays
/// mapped (so nothing that still points into it faults) until the communicator is destroyed. A pointer
/// that `braid_mem_alloc` did not return for this communicator is `BRAID_INVALID_ARGUMENT`; NULL is
/// ignored.
///
/// # Safety
/// None beyond passing a handle value: the pointer is only compared with allocated ones.
#[no_mangle]
pub unsafe extern "C" fn braid_mem_free(comm: *mut braid_comm, ptr: *mut c_void) -> braid_result {
    guard("braid_mem_free", || {
        comm_of(comm)?;
        if ptr.is_null() {
            return Ok(());
        }
        let mut map = BUFFERS.lock();
        let known = map
            .as_ref()
            .and_then(|m| m.get(&(ptr as usize)))
            .is_some_and(|(owner, _)| *owner == comm as usize);
        if !known {
            return Err(Error::invalid(format!(
                "braid_mem_free: {ptr:p} is not memory braid_mem_alloc returned for this communicator"
            )));
        }
        if let Some(m) = map.as_mut() {
            m.remove(&(ptr as usize));
        }
        Ok(())
    })
}
