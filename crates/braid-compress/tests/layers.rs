//! Per-layer PowerSGD: a layout's tensors are factorised one by one (each with its block of the initial
//! Q), 1-D and too-small tensors pass through exactly, and the result round-trips through the wire.

mod common;

use braid_compress::power_sgd::{
    initial_q, multiply, multiply_transposed, orthogonalize, worth_factorising, Plan, Segment,
};
use braid_compress::rng::{Stream, TAG_POWER_SGD};
use braid_compress::{Codec, Compressed, ErrorFeedback, Layout, Payload, Piece, PowerSgd};
use common::{grad, orthonormal};
use proptest::prelude::*;

/// Shapes of 0 to 3 dimensions, each dimension 1..=9.
fn shapes() -> impl Strategy<Value = Vec<Vec<usize>>> {
    prop::collection::vec(prop::collection::vec(1usize..=9, 0..=3), 0..6)
}

fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

/// One step of PowerSGD on one `rows × cols` layer alone, starting from `q0`: (approximation, new Q).
fn one_layer(m: &[f32], cols: usize, rank: usize, q0: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let rows = m.len() / cols;
    let mut p = vec![0.0; rows * rank];
    multiply(m, cols, q0, rank, &mut p);
    orthogonalize(&mut p, rank, 0.0);
    let mut q = q0.to_vec();
    multiply_transposed(m, cols, &p, rank, &mut q);
    let mut y = vec![0.0; m.len()];
    for i in 0..rows {
        for j in 0..cols {
            let mut acc = 0.0f32;
            for c in 0..rank {
                acc += p[i * rank + c] * q[j * rank + c];
            }
            y[i * cols + j] = acc;
        }
    }
    (y, q)
}

/// The per-layer reference for `steps` steps on the same gradient: each factorised layer alone, its
/// first Q the stream's normals from the layer's offset in the concatenated Q, then warm-started.
fn reference(shapes: &[Vec<usize>], rank: usize, seed: u64, x: &[f32], steps: u64) -> Vec<f32> {
    let stream = Stream::new(seed, TAG_POWER_SGD, 0);
    let mut out = x.to_vec();
    let (mut at, mut q_at) = (0, 0);
    for s in shapes {
        let n = numel(s);
        let m = &x[at..at + n];
        if s.len() >= 2 {
            let (rows, cols) = (s[0], n / s[0]);
            let r = rank.min(rows).min(cols);
            if r * (rows + cols) < rows * cols {
                let mut q: Vec<f32> = (0..cols * r)
                    .map(|i| stream.normal_at((q_at + i) as u64))
                    .collect();
                orthogonalize(&mut q, r, 0.0);
                q_at += cols * r;
                for _ in 0..steps {
                    let (y, next) = one_layer(m, cols, r, &q);
                    out[at..at + n].copy_from_slice(&y);
                    q = next;
                }
            }
        }
        at += n;
    }
    out
}

proptest! {
    #[test]
    fn each_layer_is_factorised_alone_and_the_rest_passes_through(
        shapes in shapes(),
        rank in 1usize..6,
        seed in any::<u64>(),
    ) {
        let len: usize = shapes.iter().map(|s| numel(s)).sum();
        let x = grad(seed, len);
        let layout = Layout::new(&shapes, len).unwrap();
        let mut codec = PowerSgd::new(rank, seed).unwrap().with_layout(layout.clone());
        for step in 1..=3u64 {
            // The step keys only the first draw; warm start carries each layer's Q on.
            let c = codec.compress(&x, if step == 1 { 0 } else { step });
            prop_assert!(matches!(c.payload(), Payload::Layered(_)));
            prop_assert_eq!(c.to_dense(), reference(&shapes, rank, seed, &x, step), "step {}", step);
            let round = Compressed::decode_for(&c.encode(), len).unwrap();
            prop_assert_eq!(&round, &c);
            prop_assert_eq!(c.wire_bytes(), c.encode().len());
        }
        // Every element of a tensor that is not factorised is carried bit for bit.
        let y = codec.compress(&x, 9).to_dense();
        let plan = Plan::layered(&layout, rank);
        let mut covered = 0;
        for s in plan.segments() {
            match s {
                Segment::Dense { range, .. } => {
                    prop_assert_eq!(&y[range.clone()], &x[range.clone()]);
                    covered += range.len();
                }
                Segment::Matrix { range, rows, cols, rank: r, .. } => {
                    prop_assert!(worth_factorising(*rows, *cols, *r) && *r <= rank);
                    prop_assert_eq!(rows * cols, range.len());
                    covered += range.len();
                }
            }
        }
        prop_assert_eq!(covered, len);
    }

    #[test]
    fn a_rank_of_at_least_min_dims_reproduces_every_layer_exactly(
        shapes in shapes(),
        seed in any::<u64>(),
    ) {
        let len: usize = shapes.iter().map(|s| numel(s)).sum();
        let x = grad(seed, len);
        let rank = shapes.iter().map(|s| s.first().copied().unwrap_or(1)).max().unwrap_or(1);
        let layout = Layout::new(&shapes, len).unwrap();
        let c = PowerSgd::new(rank, seed).unwrap().with_layout(layout).compress(&x, 0);
        prop_assert_eq!(c.to_dense(), x);
    }

    #[test]
    fn low_rank_layers_are_reproduced_to_rounding(
        dims in prop::collection::vec((4usize..24, 4usize..24), 1..4),
        r in 1usize..3,
        seed in any::<u64>(),
    ) {
        // Rank-r layers (well conditioned) between biases; from the second step the warm Q spans each
        // layer's row space.
        let mut shapes = Vec::new();
        let mut x = Vec::new();
        for (l, &(rows, cols)) in dims.iter().enumerate() {
            let a = orthonormal(seed ^ l as u64, rows, r);
            let b = orthonormal(seed ^ (l as u64 + 100), cols, r);
            for e in 0..rows * cols {
                x.push((0..r).map(|c| a[(e / cols) * r + c] * (1.0 - 0.3 * c as f32) * b[(e % cols) * r + c]).sum());
            }
            x.extend(grad(seed ^ l as u64, rows).iter().map(|b| 0.01 * b));
            shapes.push(vec![rows, cols]);
            shapes.push(vec![rows]);
        }
        let layout = Layout::new(&shapes, x.len()).unwrap();
        let mut codec = PowerSgd::new(r, seed).unwrap().with_layout(layout);
        let _ = codec.compress(&x, 0);
        let y = codec.compress(&x, 1).to_dense();
        let scale = x.iter().fold(0f32, |s, v| s.max(v.abs()));
        for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
            prop_assert!((a - b).abs() <= 1e-5 * scale, "element {}: {} vs {}", i, a, b);
        }
    }
}

#[test]
fn without_a_layout_or_for_another_length_it_is_one_matrix_as_before() {
    let x = grad(3, 1001);
    let plain = PowerSgd::new(4, 3).unwrap().compress(&x, 0);
    let layout = Layout::new([vec![10, 10]], 100).unwrap();
    let mut layered = PowerSgd::new(4, 3).unwrap().with_layout(layout);
    assert_eq!(layered.compress(&x, 0), plain);
    assert!(matches!(plain.payload(), Payload::LowRank { .. }));
    let plan = Plan::single(1001, None, 4).unwrap();
    assert!(!plan.is_layered());
    assert_eq!(
        (plan.p_len(), plan.q_len(), plan.dense_len()),
        (32 * 4, 32 * 4, 0)
    );
    assert_eq!(plan.initial_q(3, 5), initial_q(3, 5, 32, 4));
    assert_eq!(layered.plan(1001).unwrap(), plan);
    assert!(layered.plan(100).unwrap().is_layered());
    assert!(layered.name().contains("layers=1"), "{}", layered.name());
    let e = PowerSgd::new(1, 0)
        .unwrap()
        .with_cols(1)
        .unwrap()
        .plan(u32::MAX as usize + 1)
        .unwrap_err();
    assert!(e.to_string().contains("does not fit u32"), "{e}");
}

#[test]
fn biases_only_is_dense_and_error_feedback_keeps_nothing() {
    let layout = Layout::new([vec![7], vec![], vec![5]], 13).unwrap();
    let plan = Plan::layered(&layout, 4);
    assert_eq!(
        plan.segments(),
        [Segment::Dense {
            range: 0..13,
            at: 0
        }]
    );
    let x = grad(5, 13);
    let mut codec = PowerSgd::new(4, 1).unwrap().with_layout(layout);
    let mut ef = ErrorFeedback::new(13);
    let (c, stats) = ef.step(&x, &mut codec, 0).unwrap();
    assert_eq!(
        c.payload(),
        &Payload::Layered(vec![Piece::Dense(x.clone())])
    );
    assert_eq!(stats.compression_error, 0.0);
    assert!(ef.error.iter().all(|e| *e == 0.0));
}

#[test]
fn each_factorised_layer_starts_from_its_own_block_of_q() {
    // Two identical layers: one stream, consecutive blocks, so their first Qs differ.
    let layout = Layout::new([vec![16, 8], vec![16, 8]], 256).unwrap();
    let plan = Plan::layered(&layout, 2);
    let q = plan.initial_q(9, 0);
    assert_eq!(q.len(), 2 * 8 * 2);
    assert_ne!(q[..16], q[16..]);
    assert_eq!(q[..16], initial_q(9, 0, 8, 2)[..]);
    let Segment::Matrix { p_at, q_at, .. } = plan.segments()[1] else {
        panic!("{:?}", plan.segments())
    };
    assert_eq!((p_at, q_at), (32, 16));
    // Buffers of the wrong size are errors naming the buffer.
    let mut p = vec![0.0; plan.p_len() + 1];
    let e = plan.multiply(&[0.0; 256], &q, &mut p).unwrap_err();
    assert!(e.to_string().contains("PowerSGD P"), "{e}");
    let e = plan.compressed(&[], &[], &[]).unwrap_err();
    assert!(e.to_string().contains("PowerSGD P"), "{e}");
}
