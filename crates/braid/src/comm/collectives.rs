//! The blocking collectives: argument checks, then one op on stream 0.

use braid_core::{DType, Element, Error, ReduceOp};

use super::state::Communicator;
use crate::call::{Call, Kind};

/// Which side of a collective a caller's buffer is.
enum In<'a> {
    Buf(&'a [u8]),
    InPlace,
}

impl Communicator {
    // ---- argument checks -------------------------------------------------------------------------

    pub(crate) fn elems(&self, len: usize, dtype: DType, what: &str) -> Result<usize, Error> {
        if len % dtype.size() != 0 {
            return Err(Error::invalid(format!(
                "{what} buffer of {len} bytes is not a whole number of {dtype} elements"
            )));
        }
        Ok(len / dtype.size())
    }

    /// Returns `e`, an argument error that only this rank can see (one about a buffer that only the root
    /// passes), after poisoning the communicator on every rank: the peers are already in the collective
    /// and fail at once, naming this rank, instead of pairing this rank's next collective with their
    /// unfinished one. For bindings that check such arguments themselves (the C ABI's null checks on
    /// the root).
    pub fn one_sided(&self, e: Error) -> Error {
        if self.inner.world > 1 {
            self.inner.streams.poison_one_sided(&e);
        }
        e
    }

    pub(crate) fn check_root(&self, root: usize) -> Result<(), Error> {
        if root >= self.inner.world {
            return Err(Error::invalid(format!(
                "root {root} is out of range for world size {}",
                self.inner.world
            )));
        }
        Ok(())
    }

    fn times_world(&self, count: usize, dtype: DType) -> Result<usize, Error> {
        count
            .checked_mul(self.inner.world)
            .and_then(|c| dtype.bytes_for(c).ok())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "count {count} × world size {} overflows",
                    self.inner.world
                ))
            })
    }

    // ---- byte-level collectives (any dtype) -------------------------------------------------------

    /// All-reduce of `recv.len() / dtype.size()` elements from `send` into `recv`.
    pub fn all_reduce_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.all_reduce_impl(In::Buf(send), recv, dtype, op)
    }

    /// All-reduce in place.
    pub fn all_reduce_bytes_in_place(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.all_reduce_impl(In::InPlace, buf, dtype, op)
    }

    fn all_reduce_impl(
        &self,
        send: In<'_>,
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        let count = self.elems(recv.len(), dtype, "receive")?;
        if let In::Buf(s) = send {
            if s.len() != recv.len() {
                return Err(Error::invalid(format!(
                    "all_reduce: send buffer has {} bytes, receive buffer {}",
                    s.len(),
                    recv.len()
                )));
            }
        }
        self.run(Kind::AllReduce, dtype, op, count, send, recv)
    }

    /// Reduce-scatter: `send` holds `world` blocks of `recv.len()` bytes; rank `r` gets the reduction of
    /// block `r`.
    pub fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        let count = self.elems(recv.len(), dtype, "receive")?;
        let need = self.times_world(count, dtype)?;
        if send.len() != need {
            return Err(Error::invalid(format!(
                "reduce_scatter: send buffer must hold world × {count} elements ({need} bytes), has {}",
                send.len()
            )));
        }
        self.run(Kind::ReduceScatter, dtype, op, count, In::Buf(send), recv)
    }

    /// All-gather: `recv` gets every rank's `send`, in rank order.
    pub fn all_gather_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
    ) -> Result<(), Error> {
        let count = self.elems(send.len(), dtype, "send")?;
        let need = self.times_world(count, dtype)?;
        if recv.len() != need {
            return Err(Error::invalid(format!(
                "all_gather: receive buffer must hold world × {count} elements ({need} bytes), has {}",
                recv.len()
            )));
        }
        self.run(
            Kind::AllGather,
            dtype,
            ReduceOp::Sum,
            count,
            In::Buf(send),
            recv,
        )
    }

    /// All-to-all: `send` and `recv` each hold `world` blocks of equal size; rank `r`'s send block `j`
    /// arrives in rank `j`'s receive block `r` (its own block is copied locally). The block size is
    /// `send.len() / world` bytes, a whole number of `dtype` elements.
    pub fn all_to_all_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
    ) -> Result<(), Error> {
        let world = self.inner.world;
        let total = self.elems(send.len(), dtype, "send")?;
        if total % world != 0 {
            return Err(Error::invalid(format!(
                "all_to_all: the send buffer's {total} {dtype} elements do not split into {world} equal blocks"
            )));
        }
        if recv.len() != send.len() {
            return Err(Error::invalid(format!(
                "all_to_all: receive buffer has {} bytes, send buffer {} (both must hold world × block)",
                recv.len(),
                send.len()
            )));
        }
        self.run(
            Kind::AllToAll,
            dtype,
            ReduceOp::Sum,
            total / world,
            In::Buf(send),
            recv,
        )
    }

    /// Broadcast of `root`'s `send` into every rank's `recv` (`send` is read on the root only).
    pub fn broadcast_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<(), Error> {
        self.check_root(root)?;
        let count = self.elems(recv.len(), dtype, "receive")?;
        if self.inner.rank == root && send.len() != recv.len() {
            return Err(self.one_sided(Error::invalid(format!(
                "broadcast: the root's send buffer has {} bytes, its receive buffer {}",
                send.len(),
                recv.len()
            ))));
        }
        let send = if self.inner.rank == root {
            In::Buf(send)
        } else {
            In::InPlace
        };
        self.run(
            Kind::Broadcast { root },
            dtype,
            ReduceOp::Sum,
            count,
            send,
            recv,
        )
    }

    /// Reduce to `root`: `recv` is written on the root only.
    pub fn reduce_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Error> {
        self.check_root(root)?;
        let count = self.elems(send.len(), dtype, "send")?;
        if self.inner.rank == root && recv.len() != send.len() {
            return Err(self.one_sided(Error::invalid(format!(
                "reduce: the root's receive buffer has {} bytes, its send buffer {}",
                recv.len(),
                send.len()
            ))));
        }
        let len = send.len();
        if self.inner.rank == root {
            return self.run(Kind::Reduce { root }, dtype, op, count, In::Buf(send), recv);
        }
        // Off the root only the send buffer is read; the op sees it as both sides.
        let ptr = send.as_ptr();
        // SAFETY: `send` is borrowed for the whole (blocking) call and only read by a non-root schedule.
        let op = unsafe {
            Call::new(
                Kind::Reduce { root },
                dtype,
                op,
                count,
                ptr,
                len,
                ptr as *mut u8,
                0,
            )
        };
        self.run_blocking(op)
    }

    fn run(
        &self,
        kind: Kind,
        dtype: DType,
        redop: ReduceOp,
        count: usize,
        send: In<'_>,
        recv: &mut [u8],
    ) -> Result<(), Error> {
        let rl = recv.len();
        let rp = recv.as_mut_ptr();
        let (sp, sl) = match send {
            In::Buf(s) => (s.as_ptr(), s.len()),
            In::InPlace => (rp as *const u8, rl),
        };
        // SAFETY: both slices are borrowed for the whole blocking call; lengths were checked by the
        // caller; a shared and a mutable borrow never overlap (the borrow checker saw to that), and in
        // place they are the same pointer.
        let op = unsafe { Call::new(kind, dtype, redop, count, sp, sl, rp, rl) };
        self.run_blocking(op)
    }

    fn run_blocking(&self, op: Call) -> Result<(), Error> {
        self.inner.streams.run_blocking(op, 0)
    }

    // ---- typed collectives ------------------------------------------------------------------------

    /// All-reduce `send` into `recv` (same length).
    pub fn all_reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.all_reduce_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            op,
        )
    }

    /// All-reduce in place.
    pub fn all_reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.all_reduce_bytes_in_place(bytemuck::cast_slice_mut(buf), T::DTYPE, op)
    }

    /// Reduce-scatter: `send.len() == world * recv.len()`.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.reduce_scatter_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            op,
        )
    }

    /// Reduce-scatter in place: `buf` holds `world` blocks; this rank's block receives the result.
    pub fn reduce_scatter_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        let world = self.inner.world;
        if buf.len() % world != 0 {
            return Err(Error::invalid(format!(
                "reduce_scatter_in_place: {} elements do not split into {world} blocks",
                buf.len()
            )));
        }
        let count = buf.len() / world;
        let es = T::DTYPE.size();
        let total = buf.len() * es;
        let base = buf.as_mut_ptr() as *mut u8;
        // SAFETY: `buf` is borrowed mutably for the whole call; the receive side is this rank's block
        // inside it, which the reduce-scatter schedule reads as its own input (same address, `Src::Dst`).
        let op = unsafe {
            Call::new(
                Kind::ReduceScatter,
                T::DTYPE,
                op,
                count,
                base,
                total,
                base.add(self.inner.rank * count * es),
                count * es,
            )
        };
        self.run_blocking(op)
    }

    /// All-gather: `recv.len() == world * send.len()`.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), Error> {
        self.all_gather_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
        )
    }

    /// All-gather in place: this rank's block of `buf` is its contribution.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<(), Error> {
        let world = self.inner.world;
        if buf.len() % world != 0 {
            return Err(Error::invalid(format!(
                "all_gather_in_place: {} elements do not split into {world} blocks",
                buf.len()
            )));
        }
        let count = buf.len() / world;
        let base = buf.as_mut_ptr() as *mut u8;
        // SAFETY: `buf` holds `world × count` elements and is borrowed mutably for the whole call.
        let op =
            unsafe { Call::all_gather_in_place(T::DTYPE, count, self.inner.rank, world, base) };
        self.run_blocking(op)
    }

    /// All-to-all of per-peer blocks: `send` and `recv` both hold `world × block` elements; this rank's
    /// send block `j` goes to rank `j`, and receive block `p` is what rank `p` sent to this rank.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), Error> {
        let world = self.inner.world;
        if send.len() % world != 0 {
            return Err(Error::invalid(format!(
                "all_to_all: {} send elements do not split into {world} equal blocks",
                send.len()
            )));
        }
        if recv.len() != send.len() {
            return Err(Error::invalid(format!(
                "all_to_all: receive buffer has {} elements, send buffer {} (both must hold world × block)",
                recv.len(),
                send.len()
            )));
        }
        self.all_to_all_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
        )
    }

    /// Broadcast from `root`: `send` is read on the root only (pass `&[]` elsewhere).
    pub fn broadcast<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        root: usize,
    ) -> Result<(), Error> {
        self.broadcast_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            root,
        )
    }

    /// Broadcast in place.
    pub fn broadcast_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<(), Error> {
        self.check_root(root)?;
        let count = buf.len();
        self.run(
            Kind::Broadcast { root },
            T::DTYPE,
            ReduceOp::Sum,
            count,
            In::InPlace,
            bytemuck::cast_slice_mut(buf),
        )
    }

    /// Reduce to `root`: `recv` is written on the root only (pass `&mut []` elsewhere).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Error> {
        self.reduce_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            op,
            root,
        )
    }

    /// Reduce to `root` in place (other ranks' buffers are left as they were).
    pub fn reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Error> {
        self.check_root(root)?;
        let count = buf.len();
        self.run(
            Kind::Reduce { root },
            T::DTYPE,
            op,
            count,
            In::InPlace,
            bytemuck::cast_slice_mut(buf),
        )
    }

    /// Waits until every rank has reached the barrier.
    pub fn barrier(&self) -> Result<(), Error> {
        self.run(
            Kind::Barrier,
            DType::U8,
            ReduceOp::Sum,
            0,
            In::InPlace,
            &mut [],
        )
    }
}
