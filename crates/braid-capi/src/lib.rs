//! The C ABI of braid: `braid.h`, `libbraid.so` and `libbraid.a`.
//!
//! The shape follows NCCL so that a framework that already drives `ncclAllReduce` can drive braid with
//! few changes: a unique id made on one rank and shared with the others, `braid_comm_init_rank`, one call
//! per collective with `(sendbuf, recvbuf, count, dtype, op, comm, stream)`, in place when `sendbuf ==
//! recvbuf`. On top of that:
//!
//! - Every call returns a [`braid_result`]; on failure `braid_get_last_error_message()` says what went
//!   wrong and names the argument. An invalid argument has no effect and leaves the communicator usable;
//!   any other failure leaves it unusable (`braid_comm_get_async_error`) until it is destroyed.
//! - Handles are looked up in a table of live handles, never dereferenced: a destroyed, forged or
//!   mistyped handle is an error (`BRAID_INVALID_ARGUMENT`), not undefined behaviour. `*_destroy(NULL)`
//!   and `*_free(NULL)` do nothing.
//! - Enumerations arrive as plain integers and are checked, so a bad `dtype` or `op` is an error.
//! - Every export runs inside a panic boundary: a bug in braid becomes `BRAID_INTERNAL`, never an unwind
//!   into C.
//!
//! The header is generated from this crate by cbindgen and committed; a test fails when it is stale.

// The types keep their C names (`braid_comm`, `braid_result`, ...) so the generated header reads as C.
#![allow(non_camel_case_types)]

mod buckets;
mod collectives;
mod compress;
mod device;
mod guard;
mod mem;
mod region;
mod registry;
mod timeline;
mod work;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use braid_rt::{Communicator, Config, Error, UniqueId};

use crate::guard::{guard, guard_value, invalid, last_error_ptr, set_last_error};

pub use buckets::*;
pub use collectives::*;
pub use compress::*;
pub use mem::*;
pub use timeline::*;
pub use work::*;

/// The result of every braid call. `BRAID_SUCCESS` is 0; the other codes are stable.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum braid_result {
    /// The call succeeded.
    BRAID_SUCCESS = 0,
    /// An argument was rejected before anything happened; the communicator is still usable.
    BRAID_INVALID_ARGUMENT = 1,
    /// A wait passed its deadline (`timeout_ms`, `BRAID_TIMEOUT_MS`); the communicator is unusable.
    BRAID_TIMEOUT = 2,
    /// A peer died, aborted or reported an error; the communicator is unusable.
    BRAID_PEER_FAILED = 3,
    /// `braid_comm_abort` was called on this communicator.
    BRAID_ABORTED = 4,
    /// Ranks called different collectives, counts, dtypes or roots (found with `debug_checks`).
    BRAID_MISMATCH = 5,
    /// Creating the communicator failed (unreachable root, wrong secret, ranks that disagree).
    BRAID_BOOTSTRAP = 6,
    /// An operating-system call failed.
    BRAID_IO = 7,
    /// An earlier error left this communicator unusable; the message names the first error.
    BRAID_POISONED = 8,
    /// A bug in braid (the message says where); please report it.
    BRAID_INTERNAL = 9,
    /// Memory the call needs could not be allocated; the communicator is unusable.
    BRAID_OUT_OF_MEMORY = 10,
}

/// An element type (one of the `BRAID_INT8` ... `BRAID_BFLOAT16` codes). Passed as an integer and
/// checked: an unknown code is `BRAID_INVALID_ARGUMENT`.
pub type braid_dtype = c_int;
/// `int8_t`.
pub const BRAID_INT8: braid_dtype = 0;
/// `uint8_t`.
pub const BRAID_UINT8: braid_dtype = 1;
/// `int32_t`.
pub const BRAID_INT32: braid_dtype = 2;
/// `uint32_t`.
pub const BRAID_UINT32: braid_dtype = 3;
/// `int64_t`.
pub const BRAID_INT64: braid_dtype = 4;
/// `uint64_t`.
pub const BRAID_UINT64: braid_dtype = 5;
/// IEEE half precision (accumulated in float, rounded once).
pub const BRAID_FLOAT16: braid_dtype = 6;
/// `float`.
pub const BRAID_FLOAT32: braid_dtype = 7;
/// `double`.
pub const BRAID_FLOAT64: braid_dtype = 8;
/// bfloat16 (accumulated in float, rounded once).
pub const BRAID_BFLOAT16: braid_dtype = 9;

/// A reduction (one of the `BRAID_SUM` ... `BRAID_BXOR` codes). Passed as an integer and checked; the
/// bitwise ones take integer dtypes only.
pub type braid_redop = c_int;
/// Sum (integers wrap).
pub const BRAID_SUM: braid_redop = 0;
/// Product (integers wrap).
pub const BRAID_PROD: braid_redop = 1;
/// Maximum.
pub const BRAID_MAX: braid_redop = 2;
/// Minimum.
pub const BRAID_MIN: braid_redop = 3;
/// Mean over ranks (integers: the sum divided by the rank count, truncated).
pub const BRAID_AVG: braid_redop = 4;
/// Bitwise AND (integer dtypes; host memory).
pub const BRAID_BAND: braid_redop = 5;
/// Bitwise OR (integer dtypes; host memory).
pub const BRAID_BOR: braid_redop = 6;
/// Bitwise XOR (integer dtypes; host memory).
pub const BRAID_BXOR: braid_redop = 7;

/// Bytes in a `braid_unique_id`.
pub const BRAID_UNIQUE_ID_BYTES: usize = 128;

/// Names a communicator: made once by `braid_get_unique_id` (on the process that will be rank 0) and
/// given to every rank by any means (a file, a socket, MPI_Bcast). It holds the NUL-terminated text
/// `host:port/secret`, so it can also be written by hand from `BRAID_ROOT` and `BRAID_SECRET`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct braid_unique_id {
    /// The text form, NUL-terminated.
    pub internal: [c_char; BRAID_UNIQUE_ID_BYTES],
}

/// `braid_config.magic`.
pub const BRAID_CONFIG_MAGIC: u32 = 0x4252_4346;
/// The newest `braid_config.version` this library understands.
pub const BRAID_CONFIG_VERSION: u32 = 1;

/// Settings for `braid_comm_init_rank`. Fill it with `braid_config_init`, then change fields: the size,
/// magic and version let a newer library read a config written against an older header (and reject one
/// it does not understand). Fields left at their `braid_config_init` values defer to the `BRAID_*`
/// environment variables and then to the built-in defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct braid_config {
    /// `sizeof(braid_config)`.
    pub size: u32,
    /// `BRAID_CONFIG_MAGIC`.
    pub magic: u32,
    /// `BRAID_CONFIG_VERSION` of the header the caller was compiled with.
    pub version: u32,
    /// Deadline of every wait, including bootstrap, in milliseconds (1 ..= 86400000); 0: `BRAID_TIMEOUT_MS`
    /// or 300000.
    pub timeout_ms: u32,
    /// 1: compare every collective's arguments across ranks before running it (`BRAID_MISMATCH` instead
    /// of a hang or garbage); 0: do not; -1: `BRAID_DEBUG_CHECKS` or off.
    pub debug_checks: i32,
    /// Room for later versions; must be zero.
    pub reserved: [u32; 11],
}

/// A communicator (opaque).
pub struct braid_comm {
    _private: [u8; 0],
}

pub(crate) const COMM: &str = "braid_comm";

/// The communicator behind a handle.
pub(crate) fn comm_of(comm: *mut braid_comm) -> Result<Arc<Communicator>, Error> {
    registry::get::<Communicator>(comm as usize, COMM, "comm")
}

/// Writes `v` through `out`, which must not be NULL (`arg` names it in the error).
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
pub(crate) unsafe fn write_out<T>(out: *mut T, v: T, arg: &str) -> Result<(), Error> {
    if out.is_null() {
        return Err(invalid(format!("{arg} is NULL")));
    }
    // SAFETY: not NULL, and the caller promises it is valid for a write.
    unsafe { out.write(v) };
    Ok(())
}

/// Checks an output pointer before any work is done, so a failure has no effect.
pub(crate) fn need_out<T>(out: *mut T, arg: &str) -> Result<(), Error> {
    if out.is_null() {
        return Err(invalid(format!("{arg} is NULL")));
    }
    Ok(())
}

fn int_to_usize(v: c_int, arg: &str) -> Result<usize, Error> {
    usize::try_from(v).map_err(|_| invalid(format!("{arg} is negative ({v})")))
}

/// The configuration: the environment, then the fields of `cfg` that are set.
///
/// # Safety
/// `cfg` is NULL or points to at least its own `size` readable bytes.
unsafe fn config_from(cfg: *const braid_config) -> Result<Config, Error> {
    let mut config = Config::from_env()?;
    if cfg.is_null() {
        return Ok(config);
    }
    // SAFETY: every version of the struct starts with size, magic and version; read them without
    // assuming the rest is there.
    let (size, magic, version) = unsafe {
        (
            ptr::addr_of!((*cfg).size).read(),
            ptr::addr_of!((*cfg).magic).read(),
            ptr::addr_of!((*cfg).version).read(),
        )
    };
    if magic != BRAID_CONFIG_MAGIC {
        return Err(invalid(format!(
            "cfg->magic is {magic:#x}, not BRAID_CONFIG_MAGIC (was cfg filled by braid_config_init?)"
        )));
    }
    if version == 0 || version > BRAID_CONFIG_VERSION {
        return Err(invalid(format!(
            "cfg->version {version} is not supported by this library (newest: {BRAID_CONFIG_VERSION})"
        )));
    }
    if size as usize != std::mem::size_of::<braid_config>() {
        return Err(invalid(format!(
            "cfg->size is {size}, version {version} has {}",
            std::mem::size_of::<braid_config>()
        )));
    }
    // SAFETY: the caller's struct has our size, checked just above.
    let c = unsafe { cfg.read() };
    if c.reserved.iter().any(|r| *r != 0) {
        return Err(invalid("cfg->reserved must be zero"));
    }
    match c.timeout_ms {
        0 => {}
        1..=86_400_000 => config.timeout = Duration::from_millis(c.timeout_ms.into()),
        t => {
            return Err(invalid(format!(
                "cfg->timeout_ms {t} is out of range 1..=86400000 (0: the default)"
            )))
        }
    }
    match c.debug_checks {
        -1 => {}
        0 | 1 => config.debug_checks = c.debug_checks == 1,
        d => return Err(invalid(format!("cfg->debug_checks is {d}, not -1, 0 or 1"))),
    }
    Ok(config)
}

/// Parses the text in a unique id.
fn parse_id(id: &braid_unique_id) -> Result<UniqueId, Error> {
    // SAFETY: `c_char` and `u8` have the same size and alignment, and the array is initialised.
    let bytes: &[u8; BRAID_UNIQUE_ID_BYTES] = unsafe { &*(&id.internal as *const _ as *const _) };
    let text = CStr::from_bytes_until_nul(bytes)
        .map_err(|_| invalid("id is not NUL-terminated within its 128 bytes"))?
        .to_str()
        .map_err(|_| invalid("id is not UTF-8 text"))?;
    text.parse::<UniqueId>()
        .map_err(|e| invalid(format!("id {text:?} is not a braid unique id: {e}")))
}

/// Fills `cfg` with the defaults (every field deferring to the environment).
///
/// # Safety
/// `cfg` is NULL or valid for writing a `braid_config`.
#[no_mangle]
pub unsafe extern "C" fn braid_config_init(cfg: *mut braid_config) -> braid_result {
    guard("braid_config_init", || {
        let v = braid_config {
            size: std::mem::size_of::<braid_config>() as u32,
            magic: BRAID_CONFIG_MAGIC,
            version: BRAID_CONFIG_VERSION,
            timeout_ms: 0,
            debug_checks: -1,
            reserved: [0; 11],
        };
        // SAFETY: the caller promises `cfg` is NULL or writable.
        unsafe { write_out(cfg, v, "cfg") }
    })
}

/// Writes a unique id's text into `out`.
///
/// # Safety
/// `out` is valid for writing a `braid_unique_id` (checked for NULL by the caller).
unsafe fn write_id(out: *mut braid_unique_id, id: UniqueId) -> Result<(), Error> {
    let text = id.to_string();
    if text.len() >= BRAID_UNIQUE_ID_BYTES {
        return Err(invalid(format!("unique id {text:?} is too long")));
    }
    let mut raw = braid_unique_id {
        internal: [0; BRAID_UNIQUE_ID_BYTES],
    };
    for (d, s) in raw.internal.iter_mut().zip(text.bytes()) {
        *d = s as c_char;
    }
    // SAFETY: the caller checked `out` and promises it is writable.
    unsafe { write_out(out, raw, "out") }
}

/// Makes a new unique id whose root listens on an ephemeral port of the loopback interface, bound now in
/// this process: rank 0 must be initialised in this process, and every rank must run on this host (see
/// `braid_get_unique_id_at` for ranks on other hosts).
///
/// # Safety
/// `out` is NULL or valid for writing a `braid_unique_id`.
#[no_mangle]
pub unsafe extern "C" fn braid_get_unique_id(out: *mut braid_unique_id) -> braid_result {
    guard("braid_get_unique_id", || {
        need_out(out, "out")?;
        // SAFETY: checked not NULL; the caller promises it is writable.
        unsafe { write_id(out, UniqueId::new()?) }
    })
}

/// Like `braid_get_unique_id`, with the root listening on `listen_addr` (`host:port`, e.g.
/// `"10.0.0.5:29500"`, or port 0 for any free port), bound now in this process. Give an address the other
/// hosts can reach; an unspecified one (`0.0.0.0:...`) is advertised as the loopback address. NULL is
/// `braid_get_unique_id`.
///
/// # Safety
/// `out` is NULL or valid for writing a `braid_unique_id`; `listen_addr` is NULL or a NUL-terminated
/// string.
#[no_mangle]
pub unsafe extern "C" fn braid_get_unique_id_at(
    out: *mut braid_unique_id,
    listen_addr: *const c_char,
) -> braid_result {
    guard("braid_get_unique_id_at", || {
        need_out(out, "out")?;
        let id = if listen_addr.is_null() {
            UniqueId::new()?
        } else {
            // SAFETY: not NULL, and the caller promises a NUL-terminated string.
            let text = unsafe { CStr::from_ptr(listen_addr) }
                .to_str()
                .map_err(|_| invalid("listen_addr is not UTF-8"))?;
            UniqueId::listen(text).map_err(|e| match e {
                Error::Io { message, .. } => invalid(format!(
                    "listen_addr {text:?}: cannot listen there: {message}"
                )),
                other => other,
            })?
        };
        // SAFETY: checked not NULL; the caller promises it is writable.
        unsafe { write_id(out, id) }
    })
}

/// Registers a new communicator and writes its handle.
///
/// # Safety
/// `out` is valid for writing a pointer (checked for NULL before this is called).
unsafe fn publish(out: *mut *mut braid_comm, comm: Communicator) -> Result<(), Error> {
    let token = registry::insert(COMM, comm);
    // SAFETY: the caller checked `out` and promises it is writable.
    unsafe { write_out(out, token as *mut braid_comm, "out") }
}

/// Joins the communicator named by `id` as `rank` of `nranks`. Every rank calls this with the same `id`
/// and `nranks`; it returns when all have joined (or after the timeout). `cfg` may be NULL (defaults and
/// the `BRAID_*` environment).
///
/// # Safety
/// `out` is NULL or valid for writing a pointer; `cfg` is NULL or points to a `braid_config` filled by
/// `braid_config_init`.
#[no_mangle]
pub unsafe extern "C" fn braid_comm_init_rank(
    out: *mut *mut braid_comm,
    nranks: c_int,
    id: braid_unique_id,
    rank: c_int,
    cfg: *const braid_config,
) -> braid_result {
    guard("braid_comm_init_rank", || {
        need_out(out, "out")?;
        let world = int_to_usize(nranks, "nranks")?;
        if world == 0 {
            return Err(invalid("nranks is 0"));
        }
        let r = int_to_usize(rank, "rank")?;
        if r >= world {
            return Err(invalid(format!(
                "rank {r} is out of range for nranks {world}"
            )));
        }
        let id = parse_id(&id)?;
        // SAFETY: the caller promises `cfg` is NULL or a filled config.
        let config = unsafe { config_from(cfg) }?;
        let comm = Communicator::init(world, r, &id, config)?;
        // SAFETY: `out` was checked above and the caller promises it is writable.
        unsafe { publish(out, comm) }
    })
}

/// Joins the job described by the environment: `BRAID_RANK`, `BRAID_WORLD_SIZE`, `BRAID_ROOT`,
/// `BRAID_SECRET` (set by `braid run`), or torchrun's, Open MPI's, PMI's or Slurm's variables.
///
/// # Safety
/// `out` is NULL or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn braid_comm_init_from_env(out: *mut *mut braid_comm) -> braid_result {
    guard("braid_comm_init_from_env", || {
        need_out(out, "out")?;
        let comm = Communicator::from_env()?;
        // SAFETY: `out` was checked above and the caller promises it is writable.
        unsafe { publish(out, comm) }
    })
}

/// Releases a communicator. NULL does nothing; a handle that was already destroyed is
/// `BRAID_INVALID_ARGUMENT`. Queued asynchronous collectives still run first. A collective blocked in
/// another thread keeps the communicator alive until it returns; call `braid_comm_abort` first to end it.
///
/// # Safety
/// None beyond passing a handle value: the handle is looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn braid_comm_destroy(comm: *mut braid_comm) -> braid_result {
    guard("braid_comm_destroy", || {
        if comm.is_null() {
            return Ok(());
        }
        drop(registry::remove::<Communicator>(
            comm as usize,
            COMM,
            "comm",
        )?);
        device::forget(comm);
        mem::forget(comm);
        Ok(())
    })
}

/// Aborts a communicator from any thread: a blocked or later collective returns `BRAID_ABORTED` (or
/// `BRAID_POISONED`) promptly and the peers learn that this rank failed. The handle must still be
/// destroyed.
///
/// # Safety
/// None beyond passing a handle value.
#[no_mangle]
pub unsafe extern "C" fn braid_comm_abort(comm: *mut braid_comm) -> braid_result {
    guard("braid_comm_abort", || {
        comm_of(comm)?.abort();
        Ok(())
    })
}

/// Registers `bytes` bytes at `buf` with the communicator's transports (NCCL's `ncclCommRegister`):
/// a collective that sends from inside the range (the send buffer of an out-of-place collective) lets
/// an RDMA NIC read it directly instead of copying it into a transport slot. Writes to `*zero_copy`
/// (when not NULL) 1 if a transport of this communicator sends from it without a copy, 0 if none does
/// (shared memory and TCP copy anyway; the registration is still kept). A range that overlaps a
/// registered one is `BRAID_INVALID_ARGUMENT`. Register buffers that are sent again and again:
/// registering pins the memory and costs a system call.
///
/// # Safety
/// The range must stay mapped until `braid_comm_deregister` with the same `buf` and `bytes` (or
/// `braid_comm_destroy`), and must not change while a collective that sends from it runs.
/// `zero_copy` is NULL or valid for writing an `int`.
#[no_mangle]
pub unsafe extern "C" fn braid_comm_register(
    comm: *mut braid_comm,
    buf: *const c_void,
    bytes: usize,
    zero_copy: *mut c_int,
) -> braid_result {
    guard("braid_comm_register", || {
        let c = comm_of(comm)?;
        if buf.is_null() && bytes > 0 {
            return Err(Error::invalid("braid_comm_register: buf is NULL"));
        }
        // SAFETY: the caller's contract above.
        let used = unsafe { c.register_raw(buf.cast(), bytes)? };
        if !zero_copy.is_null() {
            // SAFETY: checked not NULL; the caller promises it is writable.
            unsafe { write_out(zero_copy, c_int::from(used), "zero_copy")? };
        }
        Ok(())
    })
}

/// Ends the registration of exactly `bytes` bytes at `buf` made by `braid_comm_register`, once no
/// write reads the range any more; the range may then be freed. A range that is not registered is
/// ignored.
///
/// # Safety
/// None beyond passing a handle value: the range is only compared with registered ones.
#[no_mangle]
pub unsafe extern "C" fn braid_comm_deregister(
    comm: *mut braid_comm,
    buf: *const c_void,
    bytes: usize,
) -> braid_result {
    guard("braid_comm_deregister", || {
        comm_of(comm)?.deregister_raw(buf.cast(), bytes)?;
        Ok(())
    })
}

/// Writes `BRAID_SUCCESS` to `*out` if the communicator is healthy, else the code of the first error that
/// made it unusable (whose text `braid_get_last_error_message` then returns).
///
/// # Safety
/// `out` is NULL or valid for writing a `braid_result`.
#[no_mangle]
pub unsafe extern "C" fn braid_comm_get_async_error(
    comm: *mut braid_comm,
    out: *mut braid_result,
) -> braid_result {
    guard("braid_comm_get_async_error", || {
        let c = comm_of(comm)?;
        need_out(out, "out")?;
        let code = match c.async_error().or_else(|| device::async_error(comm)) {
            None => braid_result::BRAID_SUCCESS,
            Some(e) => {
                set_last_error(&e.to_string());
                guard::code_of(&e)
            }
        };
        // SAFETY: checked not NULL; the caller promises it is writable.
        unsafe { write_out(out, code, "out") }
    })
}

/// Writes the number of ranks.
///
/// # Safety
/// `out` is NULL or valid for writing an `int`.
#[no_mangle]
pub unsafe extern "C" fn braid_comm_count(comm: *mut braid_comm, out: *mut c_int) -> braid_result {
    guard("braid_comm_count", || {
        let n = comm_of(comm)?.world_size() as c_int;
        // SAFETY: the caller promises `out` is NULL or writable.
        unsafe { write_out(out, n, "out") }
    })
}

/// Writes this rank.
///
/// # Safety
/// `out` is NULL or valid for writing an `int`.
#[no_mangle]
pub unsafe extern "C" fn braid_comm_rank(comm: *mut braid_comm, out: *mut c_int) -> braid_result {
    guard("braid_comm_rank", || {
        let r = comm_of(comm)?.rank() as c_int;
        // SAFETY: the caller promises `out` is NULL or writable.
        unsafe { write_out(out, r, "out") }
    })
}

/// A static, NUL-terminated description of a result code ("unknown result code" for others).
#[no_mangle]
pub extern "C" fn braid_get_error_string(result: c_int) -> *const c_char {
    guard_value(c"internal error".as_ptr(), || {
        let s: &'static CStr = match result {
            0 => c"success",
            1 => c"invalid argument",
            2 => c"timeout",
            3 => c"peer failed",
            4 => c"aborted",
            5 => c"mismatched collectives across ranks",
            6 => c"bootstrap failed",
            7 => c"operating-system error",
            8 => c"communicator unusable after an earlier error",
            9 => c"internal error",
            _ => c"unknown result code",
        };
        s.as_ptr()
    })
}

/// The message of the last failed braid call on this thread ("" if it succeeded). Valid until the next
/// braid call on this thread.
#[no_mangle]
pub extern "C" fn braid_get_last_error_message() -> *const c_char {
    guard_value(c"".as_ptr(), last_error_ptr)
}

/// `BRAID_VERSION_CODE` of this library: major · 10000 + minor · 100 + patch.
pub const BRAID_VERSION_CODE: c_int = 100;

/// Writes the library's version as major · 10000 + minor · 100 + patch (compare with
/// `BRAID_VERSION_CODE` from the header).
///
/// # Safety
/// `version` is NULL or valid for writing an `int`.
#[no_mangle]
pub unsafe extern "C" fn braid_get_version(version: *mut c_int) -> braid_result {
    guard("braid_get_version", || {
        // SAFETY: the caller promises `version` is NULL or writable.
        unsafe { write_out(version, BRAID_VERSION_CODE, "version") }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_rt::{DType, ReduceOp};

    #[test]
    fn codes_match_the_runtime() {
        let d = [
            (BRAID_INT8, DType::I8),
            (BRAID_UINT8, DType::U8),
            (BRAID_INT32, DType::I32),
            (BRAID_UINT32, DType::U32),
            (BRAID_INT64, DType::I64),
            (BRAID_UINT64, DType::U64),
            (BRAID_FLOAT16, DType::F16),
            (BRAID_FLOAT32, DType::F32),
            (BRAID_FLOAT64, DType::F64),
            (BRAID_BFLOAT16, DType::BF16),
        ];
        assert_eq!(d.len(), DType::ALL.len());
        for (c, t) in d {
            assert_eq!(c, t as c_int, "{t}");
        }
        let o = [
            (BRAID_SUM, ReduceOp::Sum),
            (BRAID_PROD, ReduceOp::Prod),
            (BRAID_MAX, ReduceOp::Max),
            (BRAID_MIN, ReduceOp::Min),
            (BRAID_AVG, ReduceOp::Avg),
            (BRAID_BAND, ReduceOp::BitAnd),
            (BRAID_BOR, ReduceOp::BitOr),
            (BRAID_BXOR, ReduceOp::BitXor),
        ];
        assert_eq!(o.len(), ReduceOp::ALL.len());
        for (c, t) in o {
            assert_eq!(c, t as c_int, "{t}");
        }
    }

    #[test]
    fn version_code_follows_the_package_version() {
        let part = |s: &str| s.parse::<c_int>().unwrap();
        let want = part(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
            + part(env!("CARGO_PKG_VERSION_MINOR")) * 100
            + part(env!("CARGO_PKG_VERSION_PATCH"));
        assert_eq!(BRAID_VERSION_CODE, want);
    }

    #[test]
    fn error_strings_cover_every_code() {
        for code in 0..=9 {
            // SAFETY: the returned pointer is a static C string.
            let s = unsafe { CStr::from_ptr(braid_get_error_string(code)) };
            assert_ne!(s.to_str().unwrap(), "unknown result code", "{code}");
        }
        // SAFETY: as above.
        let s = unsafe { CStr::from_ptr(braid_get_error_string(77)) };
        assert_eq!(s.to_str().unwrap(), "unknown result code");
    }

    #[test]
    fn config_is_checked_field_by_field() {
        let mut c = std::mem::MaybeUninit::<braid_config>::uninit();
        assert_eq!(
            // SAFETY: a valid pointer to writable memory.
            unsafe { braid_config_init(c.as_mut_ptr()) },
            braid_result::BRAID_SUCCESS
        );
        // SAFETY: initialised by braid_config_init.
        let good = unsafe { c.assume_init() };
        assert_eq!(good.size as usize, 64);
        type Spoil = fn(&mut braid_config);
        let cases: [(&str, Spoil); 6] = [
            ("magic", |c| c.magic = 1),
            ("version", |c| c.version = 2),
            ("size", |c| c.size = 60),
            ("reserved", |c| c.reserved[3] = 1),
            ("timeout_ms", |c| c.timeout_ms = 86_400_001),
            ("debug_checks", |c| c.debug_checks = 2),
        ];
        for (field, spoil) in cases {
            let mut bad = good;
            spoil(&mut bad);
            // SAFETY: points to a whole config.
            let e = unsafe { config_from(&bad) }.unwrap_err().to_string();
            assert!(e.contains(field), "{field}: {e}");
        }
        let mut set = good;
        set.timeout_ms = 1234;
        set.debug_checks = 1;
        // SAFETY: as above.
        let cfg = unsafe { config_from(&set) }.unwrap();
        assert_eq!(cfg.timeout, Duration::from_millis(1234));
        assert!(cfg.debug_checks);
    }

    #[test]
    fn unique_ids_listen_where_asked() {
        let mut id = braid_unique_id {
            internal: [0; BRAID_UNIQUE_ID_BYTES],
        };
        // SAFETY: valid pointers; the address is a NUL-terminated literal.
        let rc = unsafe { braid_get_unique_id_at(&mut id, c"127.0.0.1:0".as_ptr()) };
        assert_eq!(rc, braid_result::BRAID_SUCCESS);
        let parsed = parse_id(&id).unwrap();
        assert_eq!(parsed.addr().ip().to_string(), "127.0.0.1");
        assert_ne!(parsed.addr().port(), 0);
        let before = id.internal;
        // SAFETY: as above.
        let rc = unsafe { braid_get_unique_id_at(&mut id, c"not an address".as_ptr()) };
        assert_eq!(rc, braid_result::BRAID_INVALID_ARGUMENT);
        // SAFETY: this thread's last error string.
        let msg = unsafe { CStr::from_ptr(braid_get_last_error_message()) };
        assert!(msg.to_str().unwrap().contains("listen_addr"), "{msg:?}");
        assert_eq!(id.internal, before, "a failed call wrote the id");
    }

    #[test]
    fn an_oversized_world_is_an_invalid_argument_naming_the_limit() {
        let mut id = braid_unique_id {
            internal: [0; BRAID_UNIQUE_ID_BYTES],
        };
        assert_eq!(
            // SAFETY: a valid pointer to writable memory.
            unsafe { braid_get_unique_id(&mut id) },
            braid_result::BRAID_SUCCESS
        );
        let mut comm: *mut braid_comm = ptr::null_mut();
        // SAFETY: valid pointers; a NULL config means the defaults.
        let rc = unsafe { braid_comm_init_rank(&mut comm, 65_537, id, 1, ptr::null()) };
        assert_eq!(rc, braid_result::BRAID_INVALID_ARGUMENT);
        assert!(comm.is_null());
        // SAFETY: this thread's last error string.
        let msg = unsafe { CStr::from_ptr(braid_get_last_error_message()) };
        assert!(
            msg.to_str()
                .unwrap()
                .contains("nranks 65537 exceeds the maximum 65536"),
            "{msg:?}"
        );
    }

    #[test]
    fn unique_ids_round_trip_and_bad_text_is_rejected() {
        let mut id = braid_unique_id {
            internal: [1; BRAID_UNIQUE_ID_BYTES],
        };
        let e = parse_id(&id).unwrap_err().to_string();
        assert!(e.contains("NUL-terminated"), "{e}");
        assert_eq!(
            // SAFETY: a valid pointer to writable memory.
            unsafe { braid_get_unique_id(&mut id) },
            braid_result::BRAID_SUCCESS
        );
        let parsed = parse_id(&id).unwrap();
        assert!(parsed.addr().ip().is_loopback());
        id.internal[0] = b'!' as c_char;
        assert!(parse_id(&id).is_err());
    }
}
