//! Allocation whose size a caller chose: a failure is an [`Error::OutOfMemory`] naming what was being
//! allocated, not an abort of the host process.

use crate::Error;

/// `n` copies of `value`, or an out-of-memory error about `what`.
pub fn filled<T: Clone>(value: T, n: usize, what: &str) -> Result<Vec<T>, Error> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| too_big::<T>(n, what))?;
    v.resize(n, value);
    Ok(v)
}

/// A copy of `src`, or an out-of-memory error about `what`.
pub fn copied<T: Copy>(src: &[T], what: &str) -> Result<Vec<T>, Error> {
    let mut v = Vec::new();
    v.try_reserve_exact(src.len())
        .map_err(|_| too_big::<T>(src.len(), what))?;
    v.extend_from_slice(src);
    Ok(v)
}

fn too_big<T>(n: usize, what: &str) -> Error {
    let bytes = (n as u128) * std::mem::size_of::<T>() as u128;
    Error::OutOfMemory(format!(
        "{what}: {n} elements ({bytes} bytes) cannot be allocated"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_impossible_size_is_an_error_not_an_abort() {
        let e = filled(0u64, usize::MAX / 4, "the test buffer").unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory(m) if m.contains("the test buffer")),
            "{e}"
        );
        assert_eq!(filled(7u8, 3, "x").unwrap(), vec![7, 7, 7]);
        assert_eq!(copied(&[1u16, 2], "x").unwrap(), vec![1, 2]);
    }
}
