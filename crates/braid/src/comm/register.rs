//! Buffers registered for sends without a copy: NCCL's `ncclCommRegister`, with the borrow checker
//! holding the buffer still while it is registered.

use std::marker::PhantomData;

use braid_core::{Element, Error};
use braid_transport::Span;
use tracing::warn;

use super::state::Communicator;

/// A buffer registered with the communicator's transports (see [`Communicator::register`]):
/// deregistered when dropped, after every send from it has finished reading it.
#[must_use = "dropping a registration deregisters the buffer at once"]
pub struct Registration<'a> {
    comm: &'a Communicator,
    span: Span,
    zero_copy: bool,
    _buf: PhantomData<&'a [u8]>,
}

impl Registration<'_> {
    /// Whether a transport of the communicator sends from this buffer without a copy (RDMA does;
    /// shared memory and TCP copy into the receiver's slot or the socket anyway).
    pub fn zero_copy(&self) -> bool {
        self.zero_copy
    }

    /// The registered bytes.
    pub fn len(&self) -> usize {
        self.span.len()
    }

    /// Whether the registration is empty.
    pub fn is_empty(&self) -> bool {
        self.span.is_empty()
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.comm.deregister_span(self.span) {
            warn!(
                rank = self.comm.rank(),
                "deregistering a buffer failed: {e}"
            );
        }
    }
}

impl Communicator {
    /// Registers `buf` so that a collective that sends from it — the input of an out-of-place
    /// all-reduce, reduce-scatter, all-gather, broadcast (root) or reduce — lets an RDMA NIC read it
    /// directly instead of copying it into a transport slot first. The registration borrows `buf`,
    /// so nothing changes it while a write may read it, and ends when dropped (then the pages are
    /// no longer pinned). Registering costs a system call and pins memory: register buffers that are
    /// sent from again and again (gradient buckets), not every buffer. Where no transport of this
    /// communicator can use it the registration is kept anyway and [`Registration::zero_copy`] is
    /// `false`. A buffer that overlaps one already registered is an invalid argument.
    pub fn register<'a, T: Element>(&'a self, buf: &'a [T]) -> Result<Registration<'a>, Error> {
        let bytes = std::mem::size_of_val(buf);
        // SAFETY: the span covers `buf`, which the registration borrows: it stays valid and
        // unchanged (shared borrow) until the registration drops and deregisters it.
        let span = unsafe { Span::host(buf.as_ptr() as *mut u8, bytes) };
        let zero_copy = self.register_span(span)?;
        Ok(Registration {
            comm: self,
            span,
            zero_copy,
            _buf: PhantomData,
        })
    }

    /// Registers raw memory (the C ABI's `braid_comm_register`); returns whether a transport sends
    /// from it without a copy.
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay mapped until [`Communicator::deregister_raw`] with the same range,
    /// and must not change while a collective that sends from it runs.
    pub unsafe fn register_raw(&self, ptr: *const u8, len: usize) -> Result<bool, Error> {
        // SAFETY: the caller's contract above.
        let span = unsafe { Span::host(ptr as *mut u8, len) };
        self.register_span(span)
    }

    /// Ends a registration made by [`Communicator::register_raw`] with the same range, once no
    /// write reads it. A range that is not registered is ignored.
    pub fn deregister_raw(&self, ptr: *const u8, len: usize) -> Result<(), Error> {
        // SAFETY: the span is only compared with registered ones, never read through.
        let span = unsafe { Span::host(ptr as *mut u8, len) };
        self.deregister_span(span)
    }

    fn register_span(&self, span: Span) -> Result<bool, Error> {
        if let Some(e) = self.inner.streams.sticky() {
            return Err(e);
        }
        if span.is_empty() {
            return Ok(false);
        }
        let (start, len) = (span.addr(), span.len());
        let mut registered = self.inner.registered.lock();
        if let Some((s, l)) = registered
            .iter()
            .find(|(s, l)| start < s + l && *s < start + len)
        {
            return Err(Error::invalid(format!(
                "rank {}: the buffer at {start:#x} ({len} bytes) overlaps one registered at {s:#x} \
                 ({l} bytes)",
                self.rank()
            )));
        }
        let sched = self.inner.streams.sched.lock();
        let used = match sched.exec.link() {
            Some(link) => link.register(span)?,
            None => false,
        };
        registered.push((start, len));
        Ok(used)
    }

    fn deregister_span(&self, span: Span) -> Result<(), Error> {
        let (start, len) = (span.addr(), span.len());
        let mut registered = self.inner.registered.lock();
        let Some(i) = registered.iter().position(|r| *r == (start, len)) else {
            return Ok(());
        };
        let sched = self.inner.streams.sched.lock();
        if let Some(link) = sched.exec.link() {
            link.deregister(span)?;
        }
        registered.swap_remove(i);
        Ok(())
    }
}
