//! Per-layer PowerSGD in the compressed all-reduce, with ranks as threads of one process: each weight
//! factorised as its own matrix (checked against a reference computed here from every rank's gradient),
//! 1-D tensors summed exactly, layouts that do not fit refused without effect, and ranks that disagree
//! about the layout told so.

use braid::braid_compress::power_sgd::{multiply, multiply_transposed, orthogonalize};
use braid::braid_compress::rng::{Stream, TAG_POWER_SGD};
use braid::{CodecSpec, CompressedPath, CompressionConfig, Error, GradientCompressor, ReduceOp};
use braid_testkit::compression::{assert_identical, gradient, with_ranks};

const SEED: u64 = 11;

fn powersgd(rank: usize, layers: &[Vec<usize>]) -> CompressionConfig {
    CompressionConfig {
        codec: CodecSpec::PowerSgd { rank },
        seed: SEED,
        layers: Some(layers.to_vec()),
        ..CompressionConfig::default()
    }
}

/// Two weights worth factorising at rank 2 (one 3-D), biases, a scalar, and a weight too small to gain.
fn model() -> Vec<Vec<usize>> {
    vec![
        vec![24, 16],
        vec![24],
        vec![12, 5, 4],
        vec![12],
        vec![3, 2],
        vec![],
        vec![40, 30],
    ]
}

fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

/// PowerSGD with error feedback as the protocol defines it, layer by layer, on every rank's gradient
/// at once: `(sum of the ranks' results, each rank's error buffer)` after each step, in f32.
struct Reference {
    shapes: Vec<Vec<usize>>,
    rank: usize,
    errors: Vec<Vec<f32>>,
    /// Per layer: the last summed Q of a factorised layer.
    warm: Vec<Option<Vec<f32>>>,
}

impl Reference {
    fn new(shapes: Vec<Vec<usize>>, rank: usize, world: usize) -> Self {
        let len = shapes.iter().map(|s| numel(s)).sum();
        Reference {
            warm: vec![None; shapes.len()],
            errors: vec![vec![0.0; len]; world],
            shapes,
            rank,
        }
    }

    fn step(&mut self, grads: &[Vec<f32>], step: u64) -> Vec<f32> {
        let residual: Vec<Vec<f32>> = grads
            .iter()
            .zip(&self.errors)
            .map(|(g, e)| g.iter().zip(e).map(|(a, b)| a + b).collect())
            .collect();
        let len = residual[0].len();
        let mut out = vec![0.0f32; len];
        let (mut at, mut q_at) = (0, 0);
        let stream = Stream::new(SEED, TAG_POWER_SGD, step);
        for (l, s) in self.shapes.iter().enumerate() {
            let n = numel(s);
            let range = at..at + n;
            at += n;
            let (rows, cols) = match s.len() {
                0 | 1 => (0, 0),
                _ => (s[0], n / s[0]),
            };
            let r = self.rank.min(rows).min(cols);
            if s.len() < 2 || r * (rows + cols) >= rows * cols {
                for (m, e) in residual.iter().zip(&mut self.errors) {
                    for i in range.clone() {
                        out[i] += m[i];
                        e[i] = 0.0;
                    }
                }
                continue;
            }
            let q0 = self.warm[l].take().unwrap_or_else(|| {
                let mut q: Vec<f32> = (0..cols * r)
                    .map(|i| stream.normal_at((q_at + i) as u64))
                    .collect();
                orthogonalize(&mut q, r, 0.0);
                q
            });
            q_at += cols * r;
            let mut p = vec![0.0f32; rows * r];
            for m in &residual {
                let mut pr = vec![0.0f32; rows * r];
                multiply(&m[range.clone()], cols, &q0, r, &mut pr);
                p.iter_mut().zip(&pr).for_each(|(a, b)| *a += b);
            }
            orthogonalize(&mut p, r, 0.0);
            let mut q_sum = vec![0.0f32; cols * r];
            for (m, e) in residual.iter().zip(&mut self.errors) {
                let mut q = vec![0.0f32; cols * r];
                multiply_transposed(&m[range.clone()], cols, &p, r, &mut q);
                q_sum.iter_mut().zip(&q).for_each(|(a, b)| *a += b);
                for i in 0..rows {
                    for j in 0..cols {
                        let u: f32 = (0..r).map(|c| p[i * r + c] * q[j * r + c]).sum();
                        let k = range.start + i * cols + j;
                        e[k] = m[k] - u;
                    }
                }
            }
            for i in 0..rows {
                for j in 0..cols {
                    out[range.start + i * cols + j] =
                        (0..r).map(|c| p[i * r + c] * q_sum[j * r + c]).sum();
                }
            }
            self.warm[l] = Some(q_sum);
        }
        out
    }
}

fn close(got: &[f32], want: &[f32], what: &str) {
    let scale = want.iter().fold(1f32, |s, v| s.max(v.abs()));
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * scale,
            "{what}: element {i} is {a}, the per-layer reference {b}"
        );
    }
}

#[test]
fn each_layer_is_factorised_as_in_a_per_layer_reference() {
    for n in [1, 2, 3] {
        let checks = with_ranks(n, move |c| {
            let shapes = model();
            let len: usize = shapes.iter().map(|s| numel(s)).sum();
            let mut st = GradientCompressor::new(powersgd(2, &shapes), len).unwrap();
            let mut reference = Reference::new(shapes, 2, n);
            let mut checks = 0;
            for t in 0..4 {
                let what = format!("step {t} on {n} ranks");
                let g = gradient(c.rank(), t, len);
                let mut all = vec![0.0f32; len * n];
                c.all_gather(&g, &mut all).unwrap();
                let grads: Vec<Vec<f32>> = all.chunks(len).map(<[f32]>::to_vec).collect();
                let want = reference.step(&grads, t);
                let mut x = g.clone();
                let rep = c
                    .all_reduce_compressed(&mut x, ReduceOp::Sum, &mut st)
                    .unwrap();
                assert_identical(&c, &x, &what);
                assert_eq!(rep.path, CompressedPath::PowerIteration, "{what}");
                close(&x, &want, &what);
                close(
                    st.error(),
                    &reference.errors[c.rank()],
                    &format!("{what}: error"),
                );
                // The 1-D tensors, the scalar and the small weight are summed exactly.
                let dense_sum: Vec<f32> = (0..len)
                    .map(|i| grads.iter().fold(0.0, |s, g| s + g[i]))
                    .collect();
                for range in [384..408, 648..667] {
                    for i in range {
                        assert_eq!(st.error()[i], 0.0, "{what}: error at dense element {i}");
                        if n <= 2 {
                            assert_eq!(x[i], dense_sum[i], "{what}: dense element {i}");
                        }
                    }
                }
                if n > 1 {
                    assert!(
                        rep.sent_bytes < rep.dense_sent_bytes / 2,
                        "{what}: sent {} of a dense {}",
                        rep.sent_bytes,
                        rep.dense_sent_bytes
                    );
                }
                checks += 1;
            }
            checks
        });
        assert_eq!(checks, vec![4; n]);
    }
}

#[test]
fn a_layout_of_only_one_dimensional_tensors_is_the_dense_all_reduce() {
    let checks = with_ranks(3, |c| {
        let layers = vec![vec![1000], vec![1], vec![], vec![1998]];
        let mut st = GradientCompressor::new(powersgd(4, &layers), 3000).unwrap();
        let dense = CompressionConfig {
            codec: CodecSpec::Dense,
            ..CompressionConfig::default()
        };
        let mut plain = GradientCompressor::new(dense, 3000).unwrap();
        for t in 0..2 {
            let g = gradient(c.rank(), t, 3000);
            let mut x = g.clone();
            let rep = c
                .all_reduce_compressed(&mut x, ReduceOp::Sum, &mut st)
                .unwrap();
            let mut d = vec![0.0f32; 3000];
            c.all_reduce(&g, &mut d, ReduceOp::Sum).unwrap();
            assert!(x == d, "step {t}: differs from the dense all-reduce");
            assert_eq!(rep.path, CompressedPath::PowerIteration);
            assert_eq!(rep.stats.compression_error, 0.0);
            assert!(st.error().iter().all(|e| *e == 0.0));
            // One all-reduce of the whole tensor in f32, no Q: what the dense path sends.
            let mut y = g.clone();
            let dense = c
                .all_reduce_compressed(&mut y, ReduceOp::Sum, &mut plain)
                .unwrap();
            assert!(y == x, "step {t}: differs from the dense path");
            assert_eq!(rep.sent_bytes, dense.sent_bytes, "step {t}");
        }
        2
    });
    assert_eq!(checks, [2, 2, 2]);
}

#[test]
fn a_layout_that_does_not_fit_is_refused_with_the_reason() {
    let cases: [(&[&[usize]], &str); 4] = [
        (
            &[&[10, 10], &[5]],
            "add up to 105 elements, but the buffer has 100",
        ),
        (
            &[&[10, 10], &[0]],
            "tensor 1 has shape [0]: dimension 0 is 0",
        ),
        (&[&[usize::MAX, 3]], "tensor 0 has shape"),
        (&[&[1 << 33, 2], &[]], "does not fit u32"),
    ];
    for (shapes, why) in cases {
        let layers: Vec<Vec<usize>> = shapes.iter().map(|s| s.to_vec()).collect();
        for codec in [
            CodecSpec::PowerSgd { rank: 2 },
            CodecSpec::TopK { density: 0.1 },
        ] {
            let cfg = CompressionConfig {
                codec,
                layers: Some(layers.clone()),
                ..CompressionConfig::default()
            };
            let e = GradientCompressor::new(cfg, 100).unwrap_err();
            assert!(e.is_invalid_argument(), "{shapes:?}: {e}");
            assert!(
                e.to_string().contains("compression layer shapes:") && e.to_string().contains(why),
                "{shapes:?}: {e}"
            );
        }
    }
    // The same layout for the right length is accepted.
    let ok = GradientCompressor::new(powersgd(2, &[vec![10, 10]]), 100).unwrap();
    assert_eq!(ok.config().layers.as_deref(), Some(&[vec![10, 10]][..]));
}

#[test]
fn a_rank_with_a_bad_layout_changes_nothing_and_ranks_with_different_layouts_are_told() {
    let errs = with_ranks(2, |c| {
        // Rank 1's layout does not add up: only rank 1 is told, nothing happens on either rank, and the
        // communicator still works for both.
        let mine = if c.rank() == 0 {
            vec![vec![10, 10]]
        } else {
            vec![vec![10, 9]]
        };
        let refused = GradientCompressor::new(powersgd(2, &mine), 100);
        assert_eq!(refused.is_err(), c.rank() == 1);
        let mut v = [1.0f32];
        c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, [2.0]);
        // Two valid layouts that differ: every rank is told which peer differs, and it is sticky.
        let mine = if c.rank() == 0 {
            vec![vec![10, 10]]
        } else {
            vec![vec![20, 5]]
        };
        let mut st = GradientCompressor::new(powersgd(2, &mine), 100).unwrap();
        let mut g = vec![1.0f32; 100];
        let before = g.clone();
        let e = c
            .all_reduce_compressed(&mut g, ReduceOp::Sum, &mut st)
            .unwrap_err();
        assert_eq!(g, before, "the refused call changed the gradient");
        assert_eq!(c.async_error().as_ref(), Some(&e));
        e
    });
    for (r, e) in errs.iter().enumerate() {
        assert!(
            matches!(e, Error::Mismatch { peer, .. } if *peer == 1 - r),
            "rank {r}: {e}"
        );
        assert!(e.to_string().contains("layers"), "{e}");
    }
}
