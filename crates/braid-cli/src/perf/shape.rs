//! One call of a collective at one size, as nccl-tests counts it: its buffers ([`Shape`]), the root of
//! the rooted collectives, and the bus-bandwidth factor.

use braid::Collective;

/// The root of broadcast and reduce, as in nccl-tests.
pub(super) const ROOT: usize = 0;

/// nccl-tests' bus bandwidth factor of `c` on `world` ranks: busbw = algbw × factor.
pub fn busbw_factor(c: Collective, world: usize) -> f64 {
    let n = world.max(1) as f64;
    match c {
        Collective::AllReduce => 2.0 * (n - 1.0) / n,
        Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// The buffers of one call of a collective at one requested size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// The size reported: the larger of the send and receive buffers, in bytes.
    pub bytes: usize,
    /// The element count the collective is called with (per rank, per block where it splits).
    pub count: usize,
    /// A rank's send buffer out of place, in bytes.
    pub send: usize,
    /// A rank's receive buffer out of place, in bytes.
    pub recv: usize,
}

impl Shape {
    /// The shape of `c` at `size` bytes of `elem`-byte elements on `world` ranks: rounded down to whole
    /// elements, and to a multiple of `world` elements where the collective splits the size into blocks.
    pub fn new(c: Collective, size: usize, elem: usize, world: usize) -> Shape {
        let elems = size / elem.max(1);
        let per = elems / world.max(1);
        let block = per * elem;
        let total = block * world;
        match c {
            Collective::AllGather => Shape {
                bytes: total,
                count: per,
                send: block,
                recv: total,
            },
            Collective::ReduceScatter => Shape {
                bytes: total,
                count: per,
                send: total,
                recv: block,
            },
            Collective::AllToAll => Shape {
                bytes: total,
                count: per,
                send: total,
                recv: total,
            },
            _ => Shape {
                bytes: elems * elem,
                count: elems,
                send: elems * elem,
                recv: elems * elem,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_bus_bandwidth_follow_nccl_tests() {
        // 1000 bytes of f32 on 3 ranks: 250 elements, 83 per rank, 996 bytes in all.
        let s = |c| Shape::new(c, 1000, 4, 3);
        let whole = Shape {
            bytes: 1000,
            count: 250,
            send: 1000,
            recv: 1000,
        };
        assert_eq!(s(Collective::AllReduce), whole);
        assert_eq!(s(Collective::Broadcast), whole);
        assert_eq!(s(Collective::Reduce), whole);
        let gather = Shape {
            bytes: 996,
            count: 83,
            send: 332,
            recv: 996,
        };
        assert_eq!(s(Collective::AllGather), gather);
        assert_eq!(
            s(Collective::ReduceScatter),
            Shape {
                send: 996,
                recv: 332,
                ..gather
            }
        );
        assert_eq!(
            s(Collective::AllToAll),
            Shape {
                send: 996,
                recv: 996,
                ..gather
            }
        );
        // Partial elements go first: 10 bytes of f64 are one element.
        assert_eq!(Shape::new(Collective::AllReduce, 10, 8, 2).bytes, 8);
        assert_eq!(Shape::new(Collective::AllGather, 8, 4, 3).bytes, 0);
        assert_eq!(busbw_factor(Collective::AllReduce, 4), 1.5);
        assert_eq!(busbw_factor(Collective::AllGather, 4), 0.75);
        assert_eq!(busbw_factor(Collective::ReduceScatter, 4), 0.75);
        assert_eq!(busbw_factor(Collective::AllToAll, 4), 0.75);
        assert_eq!(busbw_factor(Collective::Broadcast, 4), 1.0);
        assert_eq!(busbw_factor(Collective::Reduce, 4), 1.0);
    }
}
