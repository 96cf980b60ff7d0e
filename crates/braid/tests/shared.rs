//! Collectives straight through shared buffers (`Communicator::alloc`): exact results for every
//! collective, dtype and op, in place and out of place, on 2 to 7 ranks (threads of one process map
//! the windows as processes do), the path actually taken (the flight record says "shared"), refusals
//! that change nothing, and disagreements between ranks that end in errors, not hangs.

use std::time::Duration;

use braid::{Communicator, DType, Error, ReduceOp, SharedBuffer};
use braid_core::exact;
use braid_core::reduce::{reduce_ordered, Src};

use braid_testkit::ranks::{config, with_ranks};

/// The algorithm the flight record gives the last op.
fn last_path(c: &Communicator) -> &'static str {
    c.flight_record().last().map_or("none", |r| r.algo)
}

fn bytes_of(buf: &SharedBuffer, n: usize) -> Vec<u8> {
    buf.as_slice::<u8>()[..n].to_vec()
}

/// Checks one collective on shared buffers against the reference, in place and out of place.
fn check_all(c: &Communicator, dtype: DType, op: ReduceOp, count: usize) {
    let (rank, world, es) = (c.rank(), c.world_size(), dtype.size());
    let bytes = count * es;
    let inputs = exact::inputs(bytes * world, dtype, op, world);
    let mine = &inputs[rank];
    let mut send = c.alloc(bytes * world).unwrap();
    let mut recv = c.alloc(bytes * world).unwrap();
    let what = |name: &str, inplace: bool| {
        format!("{name} {dtype} {op:?} n={count} world={world} in_place={inplace} rank={rank}")
    };

    // All-reduce, out of place then in place.
    let want = exact::reduced(
        &inputs
            .iter()
            .map(|b| b[..bytes].to_vec())
            .collect::<Vec<_>>(),
        dtype,
        op,
    );
    send.as_mut_slice::<u8>()[..bytes].copy_from_slice(&mine[..bytes]);
    {
        let s = &send.as_slice::<u8>()[..bytes];
        // SAFETY-free split: two different allocations.
        let r = &mut recv.as_mut_slice::<u8>()[..bytes];
        c.all_reduce_bytes(s, r, dtype, op).unwrap();
    }
    assert_eq!(last_path(c), "shared", "{}", what("all_reduce", false));
    assert_eq!(
        bytes_of(&recv, bytes),
        want,
        "{}",
        what("all_reduce", false)
    );
    c.all_reduce_bytes_in_place(&mut send.as_mut_slice::<u8>()[..bytes], dtype, op)
        .unwrap();
    assert_eq!(bytes_of(&send, bytes), want, "{}", what("all_reduce", true));

    // Reduce-scatter: block r of every rank's input.
    send.as_mut_slice::<u8>()[..bytes * world].copy_from_slice(mine);
    let blocks: Vec<Vec<u8>> = inputs
        .iter()
        .map(|b| b[rank * bytes..(rank + 1) * bytes].to_vec())
        .collect();
    let want = exact::reduced(&blocks, dtype, op);
    c.reduce_scatter_bytes(
        &send.as_slice::<u8>()[..bytes * world],
        &mut recv.as_mut_slice::<u8>()[..bytes],
        dtype,
        op,
    )
    .unwrap();
    assert_eq!(last_path(c), "shared", "{}", what("reduce_scatter", false));
    assert_eq!(
        bytes_of(&recv, bytes),
        want,
        "{}",
        what("reduce_scatter", false)
    );

    // All-gather, out of place and in place (this rank's block inside the output).
    let want: Vec<u8> = inputs.iter().flat_map(|b| b[..bytes].to_vec()).collect();
    send.as_mut_slice::<u8>()[..bytes].copy_from_slice(&mine[..bytes]);
    c.all_gather_bytes(
        &send.as_slice::<u8>()[..bytes],
        &mut recv.as_mut_slice::<u8>()[..bytes * world],
        dtype,
    )
    .unwrap();
    assert_eq!(last_path(c), "shared", "{}", what("all_gather", false));
    assert_eq!(
        bytes_of(&recv, bytes * world),
        want,
        "{}",
        what("all_gather", false)
    );
    recv.as_mut_slice::<u8>()[..bytes * world].fill(0xAB);
    recv.as_mut_slice::<u8>()[rank * bytes..(rank + 1) * bytes].copy_from_slice(&mine[..bytes]);
    c.all_gather_in_place(&mut recv.as_mut_slice::<u8>()[..bytes * world])
        .unwrap();
    assert_eq!(
        bytes_of(&recv, bytes * world),
        want,
        "{}",
        what("all_gather", true)
    );

    // Broadcast from the last rank, out of place and in place.
    let root = world - 1;
    let want = inputs[root][..bytes].to_vec();
    send.as_mut_slice::<u8>()[..bytes].copy_from_slice(&mine[..bytes]);
    recv.as_mut_slice::<u8>()[..bytes].fill(0xCD);
    c.broadcast_bytes(
        &send.as_slice::<u8>()[..bytes],
        &mut recv.as_mut_slice::<u8>()[..bytes],
        dtype,
        root,
    )
    .unwrap();
    assert_eq!(last_path(c), "shared", "{}", what("broadcast", false));
    assert_eq!(bytes_of(&recv, bytes), want, "{}", what("broadcast", false));
    c.broadcast_in_place(&mut send.as_mut_slice::<u8>()[..bytes], root)
        .unwrap();
    assert_eq!(bytes_of(&send, bytes), want, "{}", what("broadcast", true));

    // Reduce to rank 1 (out of place; the non-roots' output is empty).
    let root = 1;
    let want = exact::reduced(
        &inputs
            .iter()
            .map(|b| b[..bytes].to_vec())
            .collect::<Vec<_>>(),
        dtype,
        op,
    );
    send.as_mut_slice::<u8>()[..bytes].copy_from_slice(&mine[..bytes]);
    recv.as_mut_slice::<u8>()[..bytes].fill(0);
    let out_len = if rank == root { bytes } else { 0 };
    c.reduce_bytes(
        &send.as_slice::<u8>()[..bytes],
        &mut recv.as_mut_slice::<u8>()[..out_len],
        dtype,
        op,
        root,
    )
    .unwrap();
    assert_eq!(last_path(c), "shared", "{}", what("reduce", false));
    if rank == root {
        assert_eq!(bytes_of(&recv, bytes), want, "{}", what("reduce", false));
    }
}

#[test]
fn every_collective_dtype_and_op_is_exact_on_shared_buffers() {
    for world in [2usize, 3] {
        with_ranks(world, config(20_000), |c| {
            for dtype in DType::ALL {
                for op in ReduceOp::ARITHMETIC {
                    // Small counts go through the boards (one exchange), 20 001 through the buffers.
                    for count in [1usize, 37, 20_001] {
                        check_all(&c, dtype, op, count);
                    }
                }
                if !dtype.is_float() {
                    for op in ReduceOp::BITWISE {
                        check_all(&c, dtype, op, 37);
                        check_all(&c, dtype, op, 20_001);
                    }
                }
            }
        });
    }
}

#[test]
fn large_odd_sizes_on_up_to_seven_ranks_match_the_rank_order_reduction_bit_for_bit() {
    for world in [5usize, 7] {
        with_ranks(world, config(60_000), move |c| {
            for count in [70_001usize, 300_007] {
                check_all(&c, DType::F32, ReduceOp::Sum, count);
                check_all(&c, DType::BF16, ReduceOp::Avg, count);
            }
            // Random floats: the shared path reduces in rank order, so every rank holds exactly
            // what the rank-order reduction gives.
            let n = 100_003usize;
            let input = |r: usize| -> Vec<f32> {
                (0..n)
                    .map(|i| ((i * 2654435761 + r * 40503) % 1_000_003) as f32 / 7.3 - 60_000.0)
                    .collect()
            };
            let mut buf = c.alloc(n * 4).unwrap();
            buf.as_mut_slice::<f32>()[..n].copy_from_slice(&input(c.rank()));
            c.all_reduce_in_place(&mut buf.as_mut_slice::<f32>()[..n], ReduceOp::Sum)
                .unwrap();
            let ins: Vec<Vec<f32>> = (0..c.world_size()).map(input).collect();
            let mut want = vec![0f32; n];
            let srcs: Vec<Src> = ins
                .iter()
                .map(|v| Src::Buf(bytemuck::cast_slice(v)))
                .collect();
            reduce_ordered(
                DType::F32,
                ReduceOp::Sum,
                bytemuck::cast_slice_mut(&mut want),
                &srcs,
            );
            assert!(
                buf.as_slice::<f32>()[..n]
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "rank {}",
                c.rank()
            );
        });
    }
}

#[test]
fn outputs_of_16_mib_and_more_are_written_with_streaming_stores_and_exact() {
    // From 16 MiB of output per rank the cold destinations are written with non-temporal stores from
    // a reduction kept in cache: odd sizes, one-byte elements (every alignment of the tails).
    with_ranks(2, config(60_000), |c| {
        check_all(&c, DType::F32, ReduceOp::Sum, (16 << 20) / 4 + 15);
        check_all(&c, DType::I8, ReduceOp::Max, (16 << 20) + 3);
    });
    with_ranks(3, config(60_000), |c| {
        check_all(&c, DType::F64, ReduceOp::Avg, (16 << 20) / 8 + 3);
    });
}

#[test]
fn shared_and_private_buffers_mix_on_one_communicator_and_streams_run_shared_work_async() {
    with_ranks(3, config(20_000), |c| {
        let n = 10_000;
        let mut shared = c.alloc(n * 4).unwrap();
        let mut private = vec![0f32; n];
        for round in 0..20 {
            let v = (c.rank() + round) as f32;
            shared.as_mut_slice::<f32>()[..n].fill(v);
            private.fill(v);
            c.all_reduce_in_place(&mut shared.as_mut_slice::<f32>()[..n], ReduceOp::Sum)
                .unwrap();
            assert_eq!(last_path(&c), "shared");
            c.all_reduce_in_place(&mut private, ReduceOp::Sum).unwrap();
            assert_ne!(last_path(&c), "shared");
            let want = (3 * round + 3) as f32;
            assert!(shared.as_slice::<f32>()[..n].iter().all(|&x| x == want));
            assert!(private.iter().all(|&x| x == want));
        }
        // Asynchronous, on two streams at once.
        let mut a = c.alloc(n * 4).unwrap();
        let mut b = c.alloc(n * 4).unwrap();
        a.as_mut_slice::<f32>()[..n].fill(1.0);
        b.as_mut_slice::<f32>()[..n].fill(2.0);
        c.scope(|s| {
            let wa = s
                .all_reduce_in_place(0, &mut a.as_mut_slice::<f32>()[..n], ReduceOp::Sum)
                .unwrap();
            let wb = s
                .all_reduce_in_place(1, &mut b.as_mut_slice::<f32>()[..n], ReduceOp::Max)
                .unwrap();
            wa.wait().unwrap();
            wb.wait().unwrap();
        });
        assert!(a.as_slice::<f32>()[..n].iter().all(|&x| x == 3.0));
        assert!(b.as_slice::<f32>()[..n].iter().all(|&x| x == 2.0));
    });
}

#[test]
fn refused_allocations_fail_on_every_rank_and_change_nothing() {
    let results = with_ranks(3, config(20_000), |c| {
        // Rank 2 asks for 0 bytes: every rank is told, naming rank 2.
        let e = c.alloc(if c.rank() == 2 { 0 } else { 4096 }).unwrap_err();
        assert!(e.to_string().contains("rank 2"), "{e}");
        // More memory than the machine has, on rank 1.
        let avail = braid_core::alloc::mem_available().unwrap() as usize;
        let e = c
            .alloc(if c.rank() == 1 {
                avail + (1 << 30)
            } else {
                4096
            })
            .unwrap_err();
        assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
        assert!(e.to_string().contains("rank 1"), "{e}");
        // The communicator works on, and the next allocation is good.
        let mut b = c.alloc(64).unwrap();
        b.as_mut_slice::<u32>()[..4].fill(c.rank() as u32);
        c.all_reduce_in_place(&mut b.as_mut_slice::<u32>()[..4], ReduceOp::Sum)
            .unwrap();
        b.as_slice::<u32>()[0]
    });
    assert_eq!(results, vec![3, 3, 3]);
}

#[test]
fn ranks_that_disagree_on_shared_buffers_all_get_a_mismatch() {
    let results = with_ranks(2, config(5_000), |c| {
        let mut b = c.alloc(4096).unwrap();
        let n = if c.rank() == 0 { 10 } else { 12 };
        c.all_reduce_in_place(&mut b.as_mut_slice::<f32>()[..n], ReduceOp::Sum)
            .unwrap_err()
    });
    for e in results {
        assert!(matches!(e, Error::Mismatch { .. }), "{e}");
        assert!(
            e.to_string().contains("of 10 float") && e.to_string().contains("of 12 float"),
            "{e}"
        );
    }
}

#[test]
fn a_rank_that_never_comes_is_a_timeout_naming_it() {
    let results = with_ranks(2, config(1_000), |c| {
        let mut b = c.alloc(4096).unwrap();
        if c.rank() == 1 {
            // Rank 1 stays away until rank 0 has given up.
            std::thread::sleep(Duration::from_millis(2_500));
            return None;
        }
        Some(
            c.all_reduce_in_place(&mut b.as_mut_slice::<f32>()[..16], ReduceOp::Sum)
                .unwrap_err(),
        )
    });
    let e = results[0].as_ref().unwrap();
    assert!(matches!(e, Error::Timeout { peer: 1, .. }), "{e}");
}
