//! Memory as the executor and its engines see it: a span of bytes that lives either where the CPU can
//! touch it or on a device, where only a device engine may.
//!
//! A [`Span`] is a description, not a borrow: it carries an address, a length and a [`MemKind`]. Making
//! one is `unsafe` (its creator vouches that the bytes stay valid, and unaliased as the protocol says,
//! for as long as the span is used), and so is reading through one. Links hand out spans for their slots;
//! the communicator makes spans for the caller's buffers; engines compute on them.

/// Where a span's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Host memory: ordinary, pinned or shared. The CPU may read and write it.
    Host,
    /// Memory of device `ordinal` (a GPU): only an engine of that device may touch it.
    Device {
        /// The device's ordinal.
        ordinal: u32,
    },
}

impl MemKind {
    /// A short name for errors and logs.
    pub fn describe(self) -> String {
        match self {
            MemKind::Host => "host memory".into(),
            MemKind::Device { ordinal } => format!("memory of device {ordinal}"),
        }
    }
}

/// A range of bytes in some memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    ptr: *mut u8,
    len: usize,
    kind: MemKind,
}

// SAFETY: a span is an address and a length; it grants no access by itself (every read or write through
// it is `unsafe` and bound by the creator's contract), so moving it between threads is harmless.
unsafe impl Send for Span {}
// SAFETY: as above; `&Span` only exposes the address, the length and the kind.
unsafe impl Sync for Span {}

impl Span {
    /// An empty host span.
    pub const EMPTY: Span = Span {
        ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
        len: 0,
        kind: MemKind::Host,
    };

    /// A span of host memory.
    ///
    /// # Safety
    /// `ptr` must be valid for reads (and, where the span is written, for writes) of `len` bytes for as
    /// long as the span or a copy of it is used, and nothing may access those bytes meanwhile in a way
    /// that conflicts with how the span is used. A null or dangling `ptr` is allowed only with `len == 0`.
    pub unsafe fn host(ptr: *mut u8, len: usize) -> Span {
        let ptr = if len == 0 || ptr.is_null() {
            std::ptr::NonNull::<u8>::dangling().as_ptr()
        } else {
            ptr
        };
        Span {
            ptr,
            len,
            kind: MemKind::Host,
        }
    }

    /// A span of device memory (a device address; never dereferenced on the host).
    ///
    /// # Safety
    /// As for [`Span::host`], on the device `ordinal`: the address must stay allocated and usable by
    /// that device's engine for as long as the span is used.
    pub unsafe fn device(addr: u64, len: usize, ordinal: u32) -> Span {
        Span {
            ptr: addr as usize as *mut u8,
            len,
            kind: MemKind::Device { ordinal },
        }
    }

    /// A span of host memory over a shared slice, for reading.
    pub fn of_slice(s: &[u8]) -> Span {
        // SAFETY: valid for `s.len()` bytes while `s` is borrowed; callers that use the span beyond the
        // borrow break the contract of every function that reads through spans, all of which are unsafe.
        unsafe { Span::host(s.as_ptr() as *mut u8, s.len()) }
    }

    /// Bytes in the span.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the span is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where its bytes live.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// The address (a host pointer, or a device address for device memory).
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// The host pointer, if this is host memory.
    pub fn host_ptr(&self) -> Option<*mut u8> {
        (self.kind == MemKind::Host).then_some(self.ptr)
    }

    /// Bytes `start..end` of the span, or `None` if the range is out of bounds.
    pub fn sub(&self, start: usize, end: usize) -> Option<Span> {
        if start > end || end > self.len {
            return None;
        }
        Some(Span {
            ptr: self.ptr.wrapping_add(start),
            len: end - start,
            kind: self.kind,
        })
    }

    /// The first `len` bytes, or `None` if the span is shorter.
    pub fn prefix(&self, len: usize) -> Option<Span> {
        self.sub(0, len)
    }

    /// Whether two spans start at the same address in the same memory.
    pub fn same_start(&self, other: &Span) -> bool {
        self.kind == other.kind && self.ptr == other.ptr
    }

    /// The bytes, for reading on the host.
    ///
    /// # Safety
    /// The span must be host memory, valid as its creator promised, and not written by anyone while the
    /// returned slice lives.
    pub unsafe fn as_slice<'a>(&self) -> &'a [u8] {
        debug_assert_eq!(self.kind, MemKind::Host);
        // SAFETY: the caller guarantees validity and the absence of writers; `ptr` is non-null and
        // dangling only for `len == 0`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, for writing on the host.
    ///
    /// # Safety
    /// The span must be host memory, valid for writes as its creator promised, and accessed by no one else
    /// while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice<'a>(&self) -> &'a mut [u8] {
        debug_assert_eq!(self.kind, MemKind::Host);
        // SAFETY: as in `as_slice`, with exclusive access guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_spans_stay_in_bounds() {
        let mut b = [0u8; 16];
        // SAFETY: `b` outlives the span.
        let s = unsafe { Span::host(b.as_mut_ptr(), b.len()) };
        assert_eq!(s.sub(4, 8).unwrap().len(), 4);
        assert_eq!(s.sub(4, 8).unwrap().addr(), s.addr() + 4);
        assert!(s.sub(8, 4).is_none());
        assert!(s.sub(0, 17).is_none());
        assert_eq!(s.prefix(16).unwrap(), s);
        // SAFETY: an address only, never dereferenced.
        let d = unsafe { Span::device(0x1000, 64, 3) };
        assert_eq!(d.kind(), MemKind::Device { ordinal: 3 });
        assert!(d.host_ptr().is_none());
        assert!(!d.same_start(&s));
    }
}
