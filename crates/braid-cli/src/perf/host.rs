//! The host benchmark: its buffers, the exact result each rank must end with, and the checked and timed
//! calls of a collective.

use std::time::Instant;

use braid::{Collective, Communicator, DType, Element, Error, ReduceOp};
use braid_core::exact::{fill, inputs, reduced, wrong};

use super::args::PerfArgs;
use super::device::DeviceBench;
use super::report::Cell;
use super::shape::{Shape, ROOT};

/// What one rank's buffers start as and must end as, for checking.
pub(super) struct Expect {
    /// The send buffer out of place.
    send: Vec<u8>,
    /// What the receive buffer must hold out of place (`None`: not checked, as off the root of reduce).
    want: Option<Vec<u8>>,
    /// The buffer in place, before the call.
    in_place: Vec<u8>,
    /// Where in the in-place buffer the result is, and what it must be (`None`: not checked).
    want_in_place: Option<(usize, Vec<u8>)>,
}

/// A byte no input holds in any dtype (inputs are small non-negative integers): receive buffers start
/// filled with it, so a result that was never written is counted wrong.
const POISON: u8 = 0xA5;

impl Expect {
    /// The inputs of `c` on `rank` of `world` and their exact results, from braid_core's references.
    pub(super) fn new(
        c: Collective,
        s: &Shape,
        dtype: DType,
        op: ReduceOp,
        rank: usize,
        world: usize,
    ) -> Expect {
        let block = s.count * dtype.size();
        let poison = |n: usize| vec![POISON; n];
        match c {
            Collective::AllReduce | Collective::Reduce => {
                let ins = inputs(s.bytes, dtype, op, world);
                let mine = ins[rank].clone();
                let want =
                    (c == Collective::AllReduce || rank == ROOT).then(|| reduced(&ins, dtype, op));
                Expect {
                    send: mine.clone(),
                    want_in_place: want.clone().map(|w| (0, w)),
                    want,
                    in_place: mine,
                }
            }
            Collective::Broadcast => {
                let mut src = vec![0u8; s.bytes];
                fill(&mut src, dtype, op, ROOT);
                let start = if rank == ROOT {
                    src.clone()
                } else {
                    poison(s.bytes)
                };
                Expect {
                    send: start.clone(),
                    want: Some(src.clone()),
                    in_place: start,
                    want_in_place: Some((0, src)),
                }
            }
            Collective::AllGather => {
                let ins = inputs(block, dtype, op, world);
                let mut in_place = poison(s.bytes);
                in_place[rank * block..(rank + 1) * block].copy_from_slice(&ins[rank]);
                let all = ins.concat();
                Expect {
                    send: ins[rank].clone(),
                    want: Some(all.clone()),
                    in_place,
                    want_in_place: Some((0, all)),
                }
            }
            Collective::ReduceScatter => {
                let ins = inputs(s.bytes, dtype, op, world);
                let mine = reduced(&ins, dtype, op)[rank * block..(rank + 1) * block].to_vec();
                Expect {
                    send: ins[rank].clone(),
                    want: Some(mine.clone()),
                    in_place: ins[rank].clone(),
                    want_in_place: Some((rank * block, mine)),
                }
            }
            _ => {
                // All-to-all: block `rank` of every rank's input, in rank order.
                let ins = inputs(s.bytes, dtype, op, world);
                let want: Vec<u8> = ins
                    .iter()
                    .flat_map(|b| b[rank * block..(rank + 1) * block].iter().copied())
                    .collect();
                Expect {
                    send: ins[rank].clone(),
                    want: Some(want),
                    in_place: Vec::new(),
                    want_in_place: None,
                }
            }
        }
    }
}

/// One out-of-place call of `c`.
fn out_of_place(
    comm: &Communicator,
    c: Collective,
    dtype: DType,
    op: ReduceOp,
    send: &[u8],
    recv: &mut [u8],
) -> Result<(), Error> {
    match c {
        Collective::AllReduce => comm.all_reduce_bytes(send, recv, dtype, op),
        Collective::ReduceScatter => comm.reduce_scatter_bytes(send, recv, dtype, op),
        Collective::AllGather => comm.all_gather_bytes(send, recv, dtype),
        Collective::Broadcast => comm.broadcast_bytes(send, recv, dtype, ROOT),
        Collective::Reduce => comm.reduce_bytes(send, recv, dtype, op, ROOT),
        Collective::AllToAll => comm.all_to_all_bytes(send, recv, dtype),
        Collective::Barrier => comm.barrier(),
    }
}

/// One in-place call of `c` on `buf` (aligned for `dtype`: the in-place forms beyond all-reduce are typed).
fn in_place(
    comm: &Communicator,
    c: Collective,
    dtype: DType,
    op: ReduceOp,
    buf: &mut [u8],
) -> Result<(), Error> {
    if c == Collective::AllReduce {
        return comm.all_reduce_bytes_in_place(buf, dtype, op);
    }
    match dtype {
        DType::I8 => in_place_typed::<i8>(comm, c, op, buf),
        DType::U8 => in_place_typed::<u8>(comm, c, op, buf),
        DType::I32 => in_place_typed::<i32>(comm, c, op, buf),
        DType::U32 => in_place_typed::<u32>(comm, c, op, buf),
        DType::I64 => in_place_typed::<i64>(comm, c, op, buf),
        DType::U64 => in_place_typed::<u64>(comm, c, op, buf),
        DType::F16 => in_place_typed::<half::f16>(comm, c, op, buf),
        DType::BF16 => in_place_typed::<half::bf16>(comm, c, op, buf),
        DType::F32 => in_place_typed::<f32>(comm, c, op, buf),
        DType::F64 => in_place_typed::<f64>(comm, c, op, buf),
    }
}

fn in_place_typed<T: Element>(
    comm: &Communicator,
    c: Collective,
    op: ReduceOp,
    buf: &mut [u8],
) -> Result<(), Error> {
    let buf: &mut [T] = bytemuck::cast_slice_mut(buf);
    match c {
        Collective::AllReduce => comm.all_reduce_in_place(buf, op),
        Collective::ReduceScatter => comm.reduce_scatter_in_place(buf, op),
        Collective::AllGather => comm.all_gather_in_place(buf),
        Collective::Broadcast => comm.broadcast_in_place(buf, ROOT),
        Collective::Reduce => comm.reduce_in_place(buf, op, ROOT),
        other => Err(Error::invalid(format!("{other} has no in-place form"))),
    }
}

/// Slowest rank's value.
fn max_over_ranks(comm: &Communicator, v: f64) -> Result<f64, Error> {
    let mut x = [v];
    comm.all_reduce_in_place(&mut x, ReduceOp::Max)?;
    Ok(x[0])
}

fn sum_over_ranks(comm: &Communicator, v: u64) -> Result<u64, Error> {
    let mut x = [v];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
    Ok(x[0])
}

/// The send buffer's registration (`--register`), ended on every way out of [`run`](super::run).
pub(super) struct SendRegistration<'a> {
    comm: &'a Communicator,
    ptr: *const u8,
    len: usize,
    pub(super) zero_copy: bool,
}

impl<'a> SendRegistration<'a> {
    pub(super) fn new(comm: &'a Communicator, buf: &[u64]) -> Result<SendRegistration<'a>, Error> {
        let (ptr, len) = (buf.as_ptr().cast::<u8>(), std::mem::size_of_val(buf));
        // SAFETY: `buf` is the benchmark's send vector, which lives (and is never reallocated) for as
        // long as `run` holds this registration; it is rewritten only between collectives.
        let zero_copy = unsafe { comm.register_raw(ptr, len)? };
        Ok(SendRegistration {
            comm,
            ptr,
            len,
            zero_copy,
        })
    }
}

impl Drop for SendRegistration<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.comm.deregister_raw(self.ptr, self.len) {
            eprintln!("braid perf: deregistering the send buffer: {e}");
        }
    }
}

/// A host buffer of the benchmark: private memory, or memory every rank of the host maps.
pub(super) enum HostBuf {
    Own(Vec<u64>),
    Shared(braid::SharedBuffer),
}

impl HostBuf {
    pub(super) fn new(comm: &Communicator, bytes: usize, shared: bool) -> Result<HostBuf, Error> {
        Ok(if shared {
            HostBuf::Shared(comm.alloc(bytes.max(8).next_multiple_of(8))?)
        } else {
            HostBuf::Own(braid_core::alloc::filled(
                0u64,
                bytes.div_ceil(8),
                "a benchmark buffer",
            )?)
        })
    }

    pub(super) fn words(&self) -> &[u64] {
        match self {
            HostBuf::Own(v) => v,
            HostBuf::Shared(s) => s.as_slice(),
        }
    }

    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self.words())
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            HostBuf::Own(v) => bytemuck::cast_slice_mut(v),
            HostBuf::Shared(s) => s.as_mut_slice(),
        }
    }
}

/// One rank's benchmark state: the buffers, reused across sizes. They are held as 8-byte words so that
/// the typed in-place calls can view them as any element type.
pub(super) struct Bench<'a> {
    pub(super) comm: &'a Communicator,
    pub(super) a: &'a PerfArgs,
    /// The op the inputs are made for: the reduction, or sum for the collectives that do not reduce.
    pub(super) data_op: ReduceOp,
    pub(super) send: HostBuf,
    pub(super) recv: HostBuf,
    pub(super) factor: f64,
    /// With `--device`: the device communicator and its buffers (then `send` and `recv` are the host
    /// copies results are checked in).
    pub(super) dev: Option<DeviceBench>,
}

impl Bench<'_> {
    /// One call of the collective at `s`, out of place (the send and receive buffers) or in place (the
    /// receive buffer, `s.bytes` long).
    pub(super) fn call(&mut self, s: &Shape, in_place: bool) -> Result<(), Error> {
        if let Some(d) = &self.dev {
            return d.call(self.a, s, in_place);
        }
        let (comm, a) = (self.comm, self.a);
        let recv = self.recv.bytes_mut();
        if in_place {
            self::in_place(comm, a.collective, a.dtype, a.op, &mut recv[..s.bytes])
        } else {
            let send = self.send.bytes();
            out_of_place(
                comm,
                a.collective,
                a.dtype,
                a.op,
                &send[..s.send],
                &mut recv[..s.recv],
            )
        }
    }

    /// Checks one call against `want` (when checking), then times `iters` calls; the slowest rank's
    /// average and the wrong elements summed over ranks.
    pub(super) fn measure(
        &mut self,
        s: &Shape,
        in_place: bool,
        want: Option<&Expect>,
    ) -> Result<Cell, Error> {
        let es = self.a.dtype.size();
        let mut w = 0;
        if let Some(e) = want {
            let send = self.send.bytes_mut();
            let recv = self.recv.bytes_mut();
            if in_place {
                recv[..s.bytes].copy_from_slice(&e.in_place);
            } else {
                send[..s.send].copy_from_slice(&e.send);
                recv[..s.recv].fill(POISON);
            }
            if let Some(d) = &mut self.dev {
                // The device buffers start as the host copies do; the result comes back into them.
                if !in_place {
                    d.send.write(&self.send.bytes()[..s.send])?;
                }
                let n = if in_place { s.bytes } else { s.recv };
                d.recv.write(&self.recv.bytes()[..n])?;
            }
            self.call(s, in_place)?;
            if let Some(d) = &self.dev {
                let recv = self.recv.bytes_mut();
                let n = if in_place { s.bytes } else { s.recv };
                d.recv.read(0, &mut recv[..n])?;
            }
            let recv = self.recv.bytes();
            w = match (in_place, &e.want, &e.want_in_place) {
                (false, Some(want), _) => wrong(&recv[..s.recv], want, es),
                (true, _, Some((at, want))) => wrong(&recv[*at..*at + want.len()], want, es),
                _ => 0,
            };
        }
        for _ in 0..self.a.warmup {
            self.call(s, in_place)?;
        }
        let wrong = sum_over_ranks(self.comm, w)?;
        let secs = self.time_only(s, in_place)?;
        let algbw = s.bytes as f64 / secs / 1e9;
        Ok(Cell {
            time_us: secs * 1e6,
            algbw,
            busbw: algbw * self.factor,
            wrong,
        })
    }

    /// Times `iters` calls after a barrier: the slowest rank's average, in seconds.
    pub(super) fn time_only(&mut self, s: &Shape, in_place: bool) -> Result<f64, Error> {
        self.comm.barrier()?;
        let t = Instant::now();
        for _ in 0..self.a.iters {
            self.call(s, in_place)?;
        }
        max_over_ranks(
            self.comm,
            t.elapsed().as_secs_f64() / self.a.iters.max(1) as f64,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::{has_in_place, COLLECTIVES};
    use super::*;

    #[test]
    fn expected_results_agree_with_what_the_ranks_send() {
        let (op, world) = (ReduceOp::Sum, 3);
        for (dtype, c) in DType::ALL
            .into_iter()
            .flat_map(|d| COLLECTIVES.map(|c| (d, c)))
        {
            let es = dtype.size();
            let s = Shape::new(c, 4 * 3 * 10, es, world);
            let e: Vec<Expect> = (0..world)
                .map(|r| Expect::new(c, &s, dtype, op, r, world))
                .collect();
            let block = s.count * es;
            let sends: Vec<Vec<u8>> = e.iter().map(|x| x.send.clone()).collect();
            for (r, x) in e.iter().enumerate() {
                assert_eq!(x.send.len(), s.send, "{c}");
                if has_in_place(c) {
                    assert_eq!(x.in_place.len(), s.bytes, "{c}");
                }
                let want = x.want.clone();
                match c {
                    Collective::AllReduce => assert_eq!(want, Some(reduced(&sends, dtype, op))),
                    Collective::Reduce => assert_eq!(
                        want,
                        (r == ROOT).then(|| reduced(&sends, dtype, op)),
                        "{c} {r}"
                    ),
                    Collective::Broadcast => assert_eq!(want.as_ref(), Some(&sends[ROOT])),
                    Collective::AllGather => {
                        assert_eq!(want, Some(sends.concat()));
                        assert_eq!(x.in_place[r * block..(r + 1) * block], sends[r][..]);
                    }
                    Collective::ReduceScatter => {
                        let all = reduced(&sends, dtype, op);
                        assert_eq!(want.as_deref(), Some(&all[r * block..(r + 1) * block]));
                        assert_eq!(x.want_in_place.as_ref().map(|w| w.0), Some(r * block));
                    }
                    _ => {
                        for (p, send) in sends.iter().enumerate() {
                            assert_eq!(
                                want.as_ref().unwrap()[p * block..(p + 1) * block],
                                send[r * block..(r + 1) * block],
                                "{c}: block {p} of rank {r}"
                            );
                        }
                    }
                }
                // A result never written (still poisoned) is wrong in every element.
                if let Some(w) = &x.want {
                    assert!(!w.is_empty(), "{c}");
                    assert_eq!(
                        wrong(&vec![POISON; w.len()], w, es),
                        (w.len() / es) as u64,
                        "{c} {dtype}"
                    );
                }
            }
        }
    }
}
