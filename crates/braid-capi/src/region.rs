//! A caller's buffer as the C functions receive it: an address and a length, checked before use.

use std::ffi::c_void;

use braid_rt::{DType, Error};

use crate::guard::invalid;

/// A caller's buffer: an address and a length in bytes, checked for NULL and for wrapping around the
/// address space. An empty region may have any address (NULL included) and is never dereferenced.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Region {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
}

impl Region {
    pub(crate) fn new(p: *const c_void, len: usize, arg: &str) -> Result<Region, Error> {
        if len == 0 {
            return Ok(Region {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len: 0,
            });
        }
        if p.is_null() {
            return Err(invalid(format!("{arg} is NULL but holds {len} bytes")));
        }
        if (p as usize).checked_add(len).is_none() {
            return Err(invalid(format!(
                "{arg} ({p:p}) + {len} bytes runs past the end of the address space"
            )));
        }
        Ok(Region {
            ptr: p as *mut u8,
            len,
        })
    }

    /// The address `off` bytes in (for comparing with another buffer; never dereferenced as is).
    pub(crate) fn at(&self, off: usize) -> usize {
        (self.ptr as usize).wrapping_add(off)
    }

    pub(crate) fn overlaps(&self, o: &Region) -> bool {
        self.len > 0 && o.len > 0 && self.at(0) < o.at(o.len) && o.at(0) < self.at(self.len)
    }

    /// # Safety
    /// The region is readable for `len` bytes and not written through another path while the slice
    /// lives.
    pub(crate) unsafe fn bytes<'a>(&self) -> &'a [u8] {
        // SAFETY: non-null (dangling but aligned when empty), in bounds per the caller.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// # Safety
    /// The region is writable for `len` bytes and not accessed through another path while the slice
    /// lives.
    pub(crate) unsafe fn bytes_mut<'a>(&self) -> &'a mut [u8] {
        // SAFETY: as above, with exclusive access per the caller.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Whether the region can be viewed as elements of `dt` (each type here is aligned to its size).
    pub(crate) fn aligned_for(&self, dt: DType) -> bool {
        self.len == 0 || (self.ptr as usize) % dt.size() == 0
    }

    /// # Safety
    /// As [`Region::bytes_mut`], and the region is aligned for `T` and a whole number of `T`.
    pub(crate) unsafe fn typed_mut<'a, T: bytemuck::Pod>(&self) -> &'a mut [T] {
        let n = self.len / std::mem::size_of::<T>();
        // SAFETY: aligned and in bounds per the caller; every bit pattern is a valid `T` (Pod).
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, n) }
    }
}

/// Rejects buffers that share bytes without being the in-place layout.
pub(crate) fn apart(send: &Region, recv: &Region, in_place: &str) -> Result<(), Error> {
    if send.overlaps(recv) {
        return Err(invalid(format!(
            "sendbuf and recvbuf overlap without being in place ({in_place})"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_check_null_wrap_and_overlap() {
        let buf = [0u8; 32];
        let p = buf.as_ptr() as *const c_void;
        assert!(Region::new(std::ptr::null(), 0, "x").is_ok());
        assert!(Region::new(std::ptr::null(), 1, "x")
            .unwrap_err()
            .to_string()
            .contains("x is NULL"));
        assert!(Region::new(usize::MAX as *const c_void, 2, "x").is_err());
        let a = Region::new(p, 16, "a").unwrap();
        // SAFETY: only used as an address for comparison.
        let b = Region::new(unsafe { buf.as_ptr().add(8) } as *const c_void, 16, "b").unwrap();
        // SAFETY: as above.
        let c = Region::new(unsafe { buf.as_ptr().add(16) } as *const c_void, 16, "c").unwrap();
        assert!(a.overlaps(&b) && b.overlaps(&a) && b.overlaps(&c));
        assert!(!a.overlaps(&c) && !c.overlaps(&a));
        assert!(apart(&a, &b, "in place").is_err());
        let e = Region::new(p, 0, "e").unwrap();
        assert!(!e.overlaps(&a));
    }
}
