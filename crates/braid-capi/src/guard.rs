//! The panic boundary every export runs inside, the mapping from [`Error`] to result codes, and the
//! thread-local last error message.
//!
//! A panic must never unwind into C (it would abort the process, or worse), so each export's body runs
//! under `catch_unwind` and a panic becomes `BRAID_INTERNAL` with the panic's message.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use braid_rt::Error;

use crate::braid_result;

thread_local! {
    /// The message of the last failed call on this thread (empty after a call that succeeded).
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Replaces this thread's last error message.
pub(crate) fn set_last_error(msg: &str) {
    // An interior NUL would truncate the C string; replace it so the whole message survives.
    let text = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = text);
}

/// This thread's last error message as a C string; valid until the next braid call on this thread.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// The result code of an error.
pub(crate) fn code_of(e: &Error) -> braid_result {
    match e {
        Error::InvalidArgument(_) => braid_result::BRAID_INVALID_ARGUMENT,
        Error::Timeout { .. } => braid_result::BRAID_TIMEOUT,
        Error::PeerFailed { .. } => braid_result::BRAID_PEER_FAILED,
        Error::Aborted { .. } => braid_result::BRAID_ABORTED,
        Error::Mismatch { .. } => braid_result::BRAID_MISMATCH,
        Error::Bootstrap(_) => braid_result::BRAID_BOOTSTRAP,
        Error::Io { .. } => braid_result::BRAID_IO,
        Error::Poisoned { .. } => braid_result::BRAID_POISONED,
        Error::OutOfMemory(_) => braid_result::BRAID_OUT_OF_MEMORY,
        _ => braid_result::BRAID_INTERNAL,
    }
}

/// Text of a panic payload.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

/// Runs an export's body: clears the last error, catches panics, records the message of a failure
/// (prefixed with the export's name) and returns its code.
pub(crate) fn guard(name: &str, body: impl FnOnce() -> Result<(), Error>) -> braid_result {
    set_last_error("");
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => braid_result::BRAID_SUCCESS,
        Ok(Err(e)) => {
            set_last_error(&format!("{name}: {e}"));
            code_of(&e)
        }
        Err(p) => {
            set_last_error(&format!("{name}: internal error: {}", panic_text(&*p)));
            braid_result::BRAID_INTERNAL
        }
    }
}

/// Like [`guard`] for exports that return a value instead of a code (`fallback` on panic).
pub(crate) fn guard_value<T>(fallback: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(fallback)
}

/// An invalid-argument error.
pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::invalid(msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn a_panic_becomes_internal_with_its_message() {
        let r = guard("braid_test", || panic!("boom {}", 7));
        assert_eq!(r, braid_result::BRAID_INTERNAL);
        // SAFETY: the pointer comes from this thread's last-error string, unchanged since the call.
        let msg = unsafe { CStr::from_ptr(last_error_ptr()) }
            .to_str()
            .unwrap();
        assert!(
            msg.contains("braid_test") && msg.contains("boom 7"),
            "{msg}"
        );
    }

    #[test]
    fn success_clears_and_failure_names_the_call() {
        let r = guard("braid_x", || Err(invalid("count is negative")));
        assert_eq!(r, braid_result::BRAID_INVALID_ARGUMENT);
        // SAFETY: as above.
        let msg = unsafe { CStr::from_ptr(last_error_ptr()) }
            .to_str()
            .unwrap();
        assert_eq!(msg, "braid_x: invalid argument: count is negative");
        assert_eq!(guard("braid_x", || Ok(())), braid_result::BRAID_SUCCESS);
        // SAFETY: as above.
        assert!(unsafe { CStr::from_ptr(last_error_ptr()) }.is_empty());
        set_last_error("a\0b");
        assert_eq!(
            // SAFETY: as above.
            unsafe { CStr::from_ptr(last_error_ptr()) }.to_str(),
            Ok("a\\0b")
        );
    }
}
