//! Rank-side scenarios shared by the multi-process harnesses.

use braid::{Collective, Communicator, DType, ReduceOp};
use braid_core::exact::{inputs, reduced};

pub fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, x| {
        (h ^ *x as u64).wrapping_mul(0x100000001b3)
    })
}

/// Every rank's hash of `out` must be the same bits.
pub fn assert_identical(c: &Communicator, out: &[u8], what: &str) {
    let mut all = vec![0u64; c.world_size()];
    c.all_gather(&[fnv(out)], &mut all).unwrap();
    assert!(
        all.iter().all(|h| *h == all[0]),
        "{what}: ranks disagree bitwise: {all:x?}"
    );
}

/// A buffer whose data starts one byte past an aligned address, so kernels see unaligned slices.
/// Every algorithm of every collective, forced in turn, against the exact reference.
pub fn scenario_algorithms(c: &Communicator) -> usize {
    scenario_algorithms_registering(c, false)
}

/// `buf` registered with `c` when `register` is set; the registration must send without a copy
/// (unless there is nothing to send).
fn reg<'a>(c: &'a Communicator, register: bool, buf: &'a [u8]) -> Option<braid::Registration<'a>> {
    register.then(|| {
        let r = c.register(buf).unwrap();
        assert!(
            r.zero_copy() || buf.is_empty(),
            "rank {}: a registration without zero copy",
            c.rank()
        );
        r
    })
}

/// [`scenario_algorithms`], with each send buffer registered (and the registration dropped after its
/// collective) when `register` is set: every registration must send without a copy.
pub fn scenario_algorithms_registering(c: &Communicator, register: bool) -> usize {
    let (rank, world) = (c.rank(), c.world_size());
    let mut checks = 0;
    for coll in Collective::TUNABLE {
        for &algo in coll.algos() {
            c.set_algorithm(coll, Some(algo)).unwrap();
            for (dtype, op) in [
                (DType::F32, ReduceOp::Sum),
                (DType::BF16, ReduceOp::Avg),
                (DType::I64, ReduceOp::Max),
                (DType::F64, ReduceOp::Prod),
            ] {
                let es = dtype.size();
                for count in [0usize, 1, world + 1, 40_009] {
                    let what = format!("{} {algo} {dtype} {op} count {count}", coll.name());
                    match coll {
                        Collective::AllReduce => {
                            let ins = inputs(count * es, dtype, op, world);
                            let want = reduced(&ins, dtype, op);
                            let mut out = vec![0u8; count * es];
                            let r = reg(c, register, &ins[rank]);
                            c.all_reduce_bytes(&ins[rank], &mut out, dtype, op).unwrap();
                            drop(r);
                            assert!(out == want, "{what}");
                            assert_identical(c, &out, &what);
                            let mut buf = ins[rank].clone();
                            c.all_reduce_bytes_in_place(&mut buf, dtype, op).unwrap();
                            assert!(buf == want, "{what} in place");
                        }
                        Collective::ReduceScatter => {
                            let ins = inputs(world * count * es, dtype, op, world);
                            let want = reduced(&ins, dtype, op);
                            let mut out = vec![0u8; count * es];
                            let r = reg(c, register, &ins[rank]);
                            c.reduce_scatter_bytes(&ins[rank], &mut out, dtype, op)
                                .unwrap();
                            drop(r);
                            assert!(
                                out == want[rank * count * es..(rank + 1) * count * es],
                                "{what}"
                            );
                        }
                        Collective::AllGather => {
                            let ins = inputs(count * es, dtype, op, world);
                            let mut out = vec![0u8; world * count * es];
                            let r = reg(c, register, &ins[rank]);
                            c.all_gather_bytes(&ins[rank], &mut out, dtype).unwrap();
                            drop(r);
                            assert!(out == ins.concat(), "{what}");
                        }
                        Collective::Broadcast | Collective::Reduce => {
                            let ins = inputs(count * es, dtype, op, world);
                            let want = reduced(&ins, dtype, op);
                            for root in [0, world - 1] {
                                let mut b = ins[rank].clone();
                                let _r = reg(c, register, &ins[rank]);
                                if coll == Collective::Broadcast {
                                    c.broadcast_bytes(&ins[rank], &mut b, dtype, root).unwrap();
                                    assert!(b == ins[root], "{what} root {root}");
                                } else {
                                    c.reduce_bytes(&ins[rank], &mut b, dtype, op, root).unwrap();
                                    if rank == root {
                                        assert!(b == want, "{what} root {root}");
                                    }
                                }
                            }
                        }
                        Collective::Barrier | Collective::AllToAll => unreachable!("no choice"),
                    }
                    checks += 1;
                }
            }
        }
        c.set_algorithm(coll, None).unwrap();
    }
    checks
}
