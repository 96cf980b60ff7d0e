//! Allocation whose size a caller chose: a failure is an [`Error::OutOfMemory`] naming what was being
//! allocated, not an abort of the host process.

use crate::Error;

/// Allocations from this size up are checked against the memory the machine has before they are made.
const CHECKED_FROM: u128 = 64 << 20;

/// The memory the kernel says can be allocated without swapping (`MemAvailable` in `/proc/meminfo`),
/// in bytes; `None` where it does not say.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

/// Refuses `bytes` for `what` when the machine does not have them (`MemAvailable`): Linux overcommits,
/// so an allocation far beyond it succeeds and the process is killed (SIGKILL, no message) when the
/// pages are touched. A refusal is an [`Error::OutOfMemory`] that names both sizes.
pub fn check_available(bytes: u128, what: &str) -> Result<(), Error> {
    match mem_available() {
        Some(avail) if bytes > u128::from(avail) => Err(Error::OutOfMemory(format!(
            "{what}: {bytes} bytes asked for, the machine has {avail} available (MemAvailable)"
        ))),
        _ => Ok(()),
    }
}

fn check_large<T>(n: usize, what: &str) -> Result<(), Error> {
    let bytes = (n as u128) * std::mem::size_of::<T>() as u128;
    if bytes >= CHECKED_FROM {
        check_available(bytes, what)?;
    }
    Ok(())
}

/// `n` copies of `value`, or an out-of-memory error about `what` (also when the machine does not
/// have the memory: see [`check_available`]).
pub fn filled<T: Clone>(value: T, n: usize, what: &str) -> Result<Vec<T>, Error> {
    check_large::<T>(n, what)?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| too_big::<T>(n, what))?;
    v.resize(n, value);
    Ok(v)
}

/// A copy of `src`, or an out-of-memory error about `what`.
pub fn copied<T: Copy>(src: &[T], what: &str) -> Result<Vec<T>, Error> {
    check_large::<T>(src.len(), what)?;
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
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(parse_mem_available(text), Some(2 << 20));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots kB\n"), None);
    }

    #[test]
    fn an_impossible_size_is_an_error_not_an_abort() {
        let e = filled(0u64, usize::MAX / 4, "the test buffer").unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory(m) if m.contains("the test buffer")),
            "{e}"
        );
        assert_eq!(filled(7u8, 3, "x").unwrap(), vec![7, 7, 7]);
        // More than the machine has, though the address space would allow it: refused before the
        // kernel could overcommit it.
        let avail = mem_available().expect("Linux reports MemAvailable");
        let n = (avail / 8 + (1 << 28)) as usize;
        let e = filled(0u64, n, "the big buffer").unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory(m) if m.contains("the big buffer") && m.contains("MemAvailable")),
            "{e}"
        );
        assert_eq!(copied(&[1u16, 2], "x").unwrap(), vec![1, 2]);
    }
}
