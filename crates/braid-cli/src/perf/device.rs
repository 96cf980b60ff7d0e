//! The device benchmark (`--device`): the device communicator's buffers and one call of a collective on
//! them. The device communicator and its buffers themselves come from [`crate::device`].

use braid::{Collective, Error};

use super::args::PerfArgs;
use super::shape::{Shape, ROOT};

/// The collectives `braid perf --device` measures on device memory.
pub(super) const DEVICE_COLLECTIVES: [Collective; 5] = [
    Collective::AllReduce,
    Collective::Broadcast,
    Collective::Reduce,
    Collective::AllGather,
    Collective::ReduceScatter,
];

pub(super) struct DeviceBench {
    pub(super) side: crate::device::DeviceSide,
    pub(super) send: Box<dyn crate::device::DeviceBuf>,
    pub(super) recv: Box<dyn crate::device::DeviceBuf>,
}

impl DeviceBench {
    /// One call of `c` on the device buffers.
    pub(super) fn call(&self, a: &PerfArgs, s: &Shape, in_place: bool) -> Result<(), Error> {
        let d = &self.side.comm;
        let (dt, rank) = (a.dtype, d.rank());
        let recv = self.recv.span(if in_place { s.bytes } else { s.recv });
        let send = if in_place {
            match a.collective {
                // The rank's own block of the output is the input.
                Collective::AllGather => {
                    let block = s.count * dt.size();
                    recv.sub(rank * block, (rank + 1) * block)
                        .ok_or_else(|| Error::invalid("all_gather in place: block out of range"))?
                }
                _ => recv,
            }
        } else {
            self.send.span(s.send)
        };
        // SAFETY: both buffers are this benchmark's device buffers, alive for the whole run, and
        // nothing else touches them during the call.
        unsafe {
            match a.collective {
                Collective::AllReduce => d.run(d.all_reduce_op(send, recv, s.count, dt, a.op)?),
                Collective::ReduceScatter => {
                    d.run(d.reduce_scatter_op(send, recv, s.count, dt, a.op)?)
                }
                Collective::AllGather => d.run(d.all_gather_op(send, recv, s.count, dt)?),
                Collective::Broadcast => d.run(d.broadcast_op(send, recv, s.count, dt, ROOT)?),
                Collective::Reduce => d.run(d.reduce_op(send, recv, s.count, dt, a.op, ROOT)?),
                other => Err(Error::invalid(format!(
                    "{} does not run on device memory yet",
                    other.name()
                ))),
            }
        }
    }
}
