//! The table of live handles.
//!
//! A handle given to C (`braid_comm*`, `braid_work*`, `braid_compressor*`) is a token, never an
//! address braid dereferences: every call looks it up here first. A destroyed, forged or mistyped
//! handle therefore fails with `BRAID_INVALID_ARGUMENT` instead of touching freed memory, and tokens
//! are never reused, so a stale handle cannot come back to life as a newer object.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use braid_rt::Error;

use crate::guard::invalid;

struct Slot {
    kind: &'static str,
    obj: Arc<dyn Any + Send + Sync>,
}

fn table() -> MutexGuard<'static, HashMap<usize, Slot>> {
    static TABLE: OnceLock<Mutex<HashMap<usize, Slot>>> = OnceLock::new();
    // A panic while the table is locked cannot leave it half-updated (inserts and removes are single
    // calls), so a poisoned lock is still a consistent table.
    TABLE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Tokens start away from zero and step by 16 so that they look like (and print like) aligned pointers.
const BASE: usize = 0x0b1d_0000;
static NEXT: AtomicUsize = AtomicUsize::new(1);

/// Registers `obj` as a live handle of `kind` and returns its token.
pub(crate) fn insert<T: Any + Send + Sync>(kind: &'static str, obj: T) -> usize {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let token = BASE.wrapping_add(n.wrapping_mul(16));
    table().insert(
        token,
        Slot {
            kind,
            obj: Arc::new(obj),
        },
    );
    token
}

fn check<'a>(
    t: &'a HashMap<usize, Slot>,
    token: usize,
    kind: &'static str,
    arg: &str,
) -> Result<&'a Slot, Error> {
    if token == 0 {
        return Err(invalid(format!("{arg} is NULL")));
    }
    let slot = t.get(&token).ok_or_else(|| {
        invalid(format!(
            "{arg} ({token:#x}) is not a live {kind} (already destroyed, or not made by braid)"
        ))
    })?;
    if slot.kind != kind {
        return Err(invalid(format!(
            "{arg} ({token:#x}) is a {}, not a {kind}",
            slot.kind
        )));
    }
    Ok(slot)
}

fn downcast<T: Any + Send + Sync>(obj: Arc<dyn Any + Send + Sync>) -> Arc<T> {
    obj.downcast::<T>()
        .unwrap_or_else(|_| panic!("handle table holds the wrong type for its kind"))
}

/// The live object behind `token`, which must be of `kind`; `arg` names the argument in errors.
pub(crate) fn get<T: Any + Send + Sync>(
    token: usize,
    kind: &'static str,
    arg: &str,
) -> Result<Arc<T>, Error> {
    let t = table();
    let slot = check(&t, token, kind, arg)?;
    Ok(downcast(slot.obj.clone()))
}

/// Unregisters `token` and returns its object (dropped by the caller once the last in-flight call that
/// holds it returns).
pub(crate) fn remove<T: Any + Send + Sync>(
    token: usize,
    kind: &'static str,
    arg: &str,
) -> Result<Arc<T>, Error> {
    let mut t = table();
    check(&t, token, kind, arg)?;
    let slot = t.remove(&token).expect("checked");
    Ok(downcast(slot.obj))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_forged_and_mistyped_tokens_are_rejected() {
        let a = insert("braid_thing", 5u32);
        let b = insert("braid_other", 6u32);
        assert_ne!(a, b);
        assert_eq!(*get::<u32>(a, "braid_thing", "x").unwrap(), 5);
        let e = get::<u32>(b, "braid_thing", "x").unwrap_err().to_string();
        assert!(e.contains("is a braid_other, not a braid_thing"), "{e}");
        assert!(get::<u32>(0, "braid_thing", "x")
            .unwrap_err()
            .to_string()
            .contains("x is NULL"));
        assert!(get::<u32>(12345, "braid_thing", "x").is_err());
        assert_eq!(*remove::<u32>(a, "braid_thing", "x").unwrap(), 5);
        let e = remove::<u32>(a, "braid_thing", "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a live braid_thing"), "{e}");
        let c = insert("braid_thing", 7u32);
        assert_ne!(c, a, "tokens are never reused");
        remove::<u32>(b, "braid_other", "x").unwrap();
        remove::<u32>(c, "braid_thing", "x").unwrap();
    }
}
