//! The compressed all-reduce checks every rank runs, shared by the in-process tests (ranks as threads)
//! and the multi-process harness of `braid-cli`. Each function is called on every rank of a communicator
//! and panics with a message naming the case when a check fails; it returns the number of checks made.

use braid::braid_compress::mx::MxElement;
use braid::braid_compress::{
    k_for_density, l2_norm, top_k, Codec, Compressed, ErrorFeedback, Payload, ThresholdTopK, TopK,
    Transport,
};
use braid::compressed::sparse_model::{self, Partition, SparseRoute};
use braid::{
    CodecSpec, Communicator, CompressedPath, CompressionConfig, DType, GradientCompressor,
    ReduceOp, SparsePath,
};

/// Runs `f` on `n` ranks, each a thread of this process with its own communicator (debug checks on).
pub fn with_ranks<R: Send + 'static>(
    n: usize,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    with_ranks_checked(n, true, f)
}

/// [`with_ranks`] with debug checks on or off (a timeout of a minute).
pub fn with_ranks_checked<R: Send + 'static>(
    n: usize,
    debug_checks: bool,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let cfg = braid::Config {
        debug_checks,
        ..crate::ranks::config(60_000)
    };
    crate::ranks::with_ranks(n, cfg, f)
}

/// Elements per tensor: odd, and not a multiple of any block size used below.
pub const LEN: usize = 3001;
/// Compressed all-reduces per case.
pub const STEPS: u64 = 3;
const SEED: u64 = 7;

fn mix(rank: usize, step: u64, i: usize) -> u64 {
    let mut z = (rank as u64) << 48 ^ step << 32 ^ i as u64;
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A gradient with a heavy tail: most values in (−1, 1), one in sixteen eight times larger.
pub fn gradient(rank: usize, step: u64, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let h = mix(rank, step, i);
            let u = (h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            if h & 15 == 0 {
                u * 8.0
            } else {
                u
            }
        })
        .collect()
}

/// Small integers, whose sums are exact in any order.
pub fn integer_gradient(rank: usize, step: u64, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (mix(rank, step, i) % 9) as f32 - 4.0)
        .collect()
}

fn fnv(v: &[f32]) -> u64 {
    v.iter()
        .flat_map(|x| x.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
            (h ^ x as u64).wrapping_mul(0x0100_0000_01b3)
        })
}

/// Every rank's hash of `v` must be the same bits.
pub fn assert_identical(c: &Communicator, v: &[f32], what: &str) {
    let mut all = vec![0u64; c.world_size()];
    c.all_gather(&[fnv(v)], &mut all).unwrap();
    assert!(
        all.iter().all(|h| *h == all[0]),
        "{what}: ranks disagree bitwise: {all:x?}"
    );
}

/// Every rank's `v` (same length everywhere), in rank order.
fn gather(c: &Communicator, v: &[f32]) -> Vec<Vec<f32>> {
    let mut all = vec![0.0f32; v.len() * c.world_size()];
    c.all_gather(v, &mut all).unwrap();
    all.chunks(v.len().max(1))
        .map(|s| s.to_vec())
        .take(c.world_size())
        .collect()
}

/// Every rank's `v` of any length, concatenated in rank order.
fn gather_concat(c: &Communicator, v: &[f32]) -> Vec<f32> {
    let mut lens = vec![0u64; c.world_size()];
    c.all_gather(&[v.len() as u64], &mut lens).unwrap();
    let max = *lens.iter().max().unwrap() as usize;
    let mut mine = v.to_vec();
    mine.resize(max, 0.0);
    let mut all = vec![0.0f32; max * c.world_size()];
    c.all_gather(&mine, &mut all).unwrap();
    lens.iter()
        .enumerate()
        .flat_map(|(p, l)| all[p * max..p * max + *l as usize].to_vec())
        .collect()
}

/// The sum of `parts` in order, starting from 0, in f32: what a rank-ordered reduction computes.
fn ordered_sum(parts: &[Vec<f32>]) -> Vec<f32> {
    let mut out = vec![0.0f32; parts[0].len()];
    for p in parts {
        out.iter_mut().zip(p).for_each(|(o, x)| *o += x);
    }
    out
}

fn config(codec: CodecSpec) -> CompressionConfig {
    CompressionConfig {
        codec,
        seed: SEED,
        ..CompressionConfig::default()
    }
}

/// The configurations every test runs: each codec, some at edge parameters.
pub fn cases() -> Vec<CompressionConfig> {
    let mut v: Vec<CompressionConfig> = [
        CodecSpec::Dense,
        CodecSpec::TopK { density: 0.1 },
        CodecSpec::TopK { density: 0.3 },
        CodecSpec::TopK { density: 1.0 },
        CodecSpec::ThresholdTopK { density: 0.05 },
        CodecSpec::RandomK { density: 0.25 },
        CodecSpec::Int8 {
            block: 256,
            stochastic: false,
        },
        CodecSpec::Int8 {
            block: 100,
            stochastic: true,
        },
        CodecSpec::Sign { block: 64 },
        CodecSpec::Sign { block: 1000 },
        CodecSpec::Fp16,
        CodecSpec::Bf16,
        CodecSpec::Mx {
            element: MxElement::E4M3,
        },
        CodecSpec::Mx {
            element: MxElement::E5M2,
        },
        CodecSpec::Mx {
            element: MxElement::E2M1,
        },
        CodecSpec::PowerSgd { rank: 2 },
    ]
    .into_iter()
    .map(config)
    .collect();
    // Density 1 with the switch off: the sparse all-gather (or reduce-scatter) of everything.
    v.push(CompressionConfig {
        dense_switch: f64::INFINITY,
        ..config(CodecSpec::TopK { density: 1.0 })
    });
    // Each sparse way forced, whatever the traffic model would pick for the world at hand.
    for (path, codec) in [
        (SparsePath::AllGather, CodecSpec::TopK { density: 0.1 }),
        (SparsePath::ReduceScatter, CodecSpec::TopK { density: 0.1 }),
        (
            SparsePath::ReduceScatter,
            CodecSpec::ThresholdTopK { density: 0.05 },
        ),
    ] {
        v.push(CompressionConfig {
            sparse_path: path,
            ..config(codec)
        });
    }
    v.push(CompressionConfig {
        sparse_path: SparsePath::ReduceScatter,
        dense_switch: f64::INFINITY,
        ..config(CodecSpec::TopK { density: 1.0 })
    });
    v
}

/// The path top-k takes when every one of `world` ranks selects `k` pairs.
fn sparse_path(cfg: &CompressionConfig, world: usize, k: usize) -> CompressedPath {
    match sparse_model::choose(
        cfg.sparse_path,
        LEN,
        &vec![k as u64; world],
        cfg.dense_switch,
    ) {
        SparseRoute::AllGather => CompressedPath::SparseAllGather,
        SparseRoute::ReduceScatter => CompressedPath::SparseReduceScatter,
        SparseRoute::Dense => CompressedPath::SparseDenseSwitch,
    }
}

/// Every case, both ops, [`STEPS`] calls each: results bit-identical on every rank, Avg equal to Sum
/// divided by the world size, the paths expected, exact results where they must be exact, and error
/// feedback telescoping (sum of results plus every error buffer equals the sum of the gradients).
pub fn every_codec(c: &Communicator) -> usize {
    let (n, rank) = (c.world_size(), c.rank());
    let mut checks = 0;
    for cfg in cases() {
        let spec = cfg.codec;
        let what = format!(
            "{spec} (dense switch {}, sparse path {})",
            cfg.dense_switch, cfg.sparse_path
        );
        let mut sum_state = GradientCompressor::new(cfg.clone(), LEN).unwrap();
        let mut avg_state = GradientCompressor::new(cfg.clone(), LEN).unwrap();
        let exact_inputs = cfg.dense_switch.is_infinite();
        let mut applied = vec![0.0f64; LEN];
        let mut given = vec![0.0f64; LEN];
        let mut magnitude = vec![0.0f64; LEN];
        for t in 0..STEPS {
            let what = format!("{what} step {t} on {n} ranks");
            let g = if exact_inputs {
                integer_gradient(rank, t, LEN)
            } else {
                gradient(rank, t, LEN)
            };
            let mut x = g.clone();
            let rep = c
                .all_reduce_compressed(&mut x, ReduceOp::Sum, &mut sum_state)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let mut y = g.clone();
            let avg = c
                .all_reduce_compressed(&mut y, ReduceOp::Avg, &mut avg_state)
                .unwrap_or_else(|e| panic!("{what} (avg): {e}"));
            assert_identical(c, &x, &what);
            assert_identical(c, &y, &format!("{what} (avg)"));
            assert_eq!(
                rep.path, avg.path,
                "{what}: sum and avg took different paths"
            );
            assert_eq!(sum_state.step(), t + 1, "{what}");
            checks += 2;

            // The report.
            assert_eq!(rep.stats.len, LEN, "{what}");
            assert_eq!(rep.stats.grad_norm, l2_norm(&g), "{what}: gradient norm");
            assert_eq!(
                rep.dense_sent_bytes,
                (2 * (n as u64 - 1) * 4 * LEN as u64) / n as u64,
                "{what}"
            );
            assert!(
                rep.stats.compression_error >= 0.0 && rep.stats.compression_error <= 1.5,
                "{what}: compression error {}",
                rep.stats.compression_error
            );
            // Codecs that cut the volume by much more than their path's overhead send less than a dense
            // ring. (Casts and random-k ride an all-reduce whose algorithm, for tensors this small, may
            // be the direct one, which sends more than a ring.)
            let saves = match spec {
                CodecSpec::TopK { density } | CodecSpec::ThresholdTopK { density } => {
                    density <= 0.1
                        && matches!(
                            rep.path,
                            CompressedPath::SparseAllGather | CompressedPath::SparseReduceScatter
                        )
                }
                CodecSpec::Int8 { .. }
                | CodecSpec::Sign { .. }
                | CodecSpec::Mx { .. }
                | CodecSpec::PowerSgd { .. } => true,
                _ => false,
            };
            if n > 1 && saves {
                assert!(
                    rep.sent_bytes < rep.dense_sent_bytes,
                    "{what}: sent {} bytes, dense would send {}",
                    rep.sent_bytes,
                    rep.dense_sent_bytes
                );
            }
            if n > 1 {
                assert!(rep.sent_bytes > 0, "{what}: nothing sent");
            }

            // The path.
            let want = match spec {
                CodecSpec::Dense => Some(CompressedPath::Dense),
                CodecSpec::TopK { density } => {
                    let k = ((density as f64 * LEN as f64).round() as usize).clamp(1, LEN);
                    Some(sparse_path(&cfg, n, k))
                }
                CodecSpec::ThresholdTopK { .. } => None,
                CodecSpec::RandomK { .. } | CodecSpec::Fp16 | CodecSpec::Bf16 => {
                    Some(CompressedPath::SumClosed)
                }
                CodecSpec::Int8 { .. } | CodecSpec::Sign { .. } | CodecSpec::Mx { .. } => {
                    Some(CompressedPath::TwoPhase)
                }
                CodecSpec::PowerSgd { .. } => Some(CompressedPath::PowerIteration),
            };
            match want {
                Some(p) => assert_eq!(rep.path, p, "{what}"),
                None => assert!(
                    matches!(
                        rep.path,
                        CompressedPath::SparseAllGather
                            | CompressedPath::SparseDenseSwitch
                            | CompressedPath::SparseReduceScatter
                    ),
                    "{what}: {:?}",
                    rep.path
                ),
            }
            checks += 1;

            // Avg is the sum divided by the world size (dense: the plain all-reduce's avg, below).
            if spec != CodecSpec::Dense {
                let want: Vec<f32> = x.iter().map(|v| v / n as f32).collect();
                assert!(
                    y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: avg is not sum / {n}"
                );
                checks += 1;
            }

            // Exactness.
            if spec == CodecSpec::Dense {
                let mut d = vec![0.0f32; LEN];
                c.all_reduce(&g, &mut d, ReduceOp::Sum).unwrap();
                assert!(x == d, "{what}: dense differs from all_reduce");
                c.all_reduce(&g, &mut d, ReduceOp::Avg).unwrap();
                assert!(y == d, "{what}: dense avg differs from all_reduce avg");
                checks += 2;
            }
            if t == 0 {
                // Before any error accumulates, each rank's update is its codec applied to its gradient,
                // computed here independently of the collective.
                let local: Option<Vec<f32>> = match spec {
                    CodecSpec::TopK { density } => {
                        Some(local_update(&g, &mut TopK::new(density).unwrap()))
                    }
                    CodecSpec::ThresholdTopK { density } => Some(local_update(
                        &g,
                        &mut ThresholdTopK::new(density, SEED).unwrap(),
                    )),
                    _ => None,
                };
                if let (Some(u), CompressedPath::SparseReduceScatter) = (&local, rep.path) {
                    // Each range's owner kept part of the rank-ordered sum of its range, exactly (no
                    // error has accumulated yet), about k pairs in all.
                    let want = ordered_sum(&gather(c, u));
                    let kept = x.iter().filter(|v| **v != 0.0).count();
                    // Pairs selected per rank: top-k's k (zeros included), threshold top-k's non-zeros.
                    let k = match spec {
                        CodecSpec::TopK { density } => Some(k_for_density(LEN, density)),
                        _ => gather(c, u)
                            .iter()
                            .map(|u| u.iter().filter(|v| **v != 0.0).count())
                            .max(),
                    };
                    assert!(
                        x.iter().zip(&want).all(|(a, b)| *a == 0.0 || a == b),
                        "{what}: kept values differ from the sum of the local updates"
                    );
                    assert!(
                        kept <= k.unwrap_or(0) + n,
                        "{what}: kept {kept} pairs, selected {k:?} per rank"
                    );
                    checks += 1;
                } else if let Some(u) = local {
                    let want = if rep.path == CompressedPath::SparseAllGather {
                        ordered_sum(&gather(c, &u))
                    } else {
                        let mut d = vec![0.0f32; LEN];
                        c.all_reduce(&u, &mut d, ReduceOp::Sum).unwrap();
                        d
                    };
                    assert!(
                        x == want,
                        "{what}: differs from the sum of the local updates"
                    );
                    checks += 1;
                }
                if spec == (CodecSpec::TopK { density: 1.0 }) {
                    // Everything is sent: the result is the exact dense sum (integers when gathered,
                    // the very same all-reduce when switched).
                    let mut d = vec![0.0f32; LEN];
                    c.all_reduce(&g, &mut d, ReduceOp::Sum).unwrap();
                    assert!(
                        x == d,
                        "{what}: top-k at density 1 differs from the dense sum"
                    );
                    checks += 1;
                }
            }

            // Telescoping bookkeeping, in f64.
            for r in gather(c, &g) {
                for (j, v) in r.iter().enumerate() {
                    given[j] += *v as f64;
                    magnitude[j] += v.abs() as f64;
                }
            }
            for (a, v) in applied.iter_mut().zip(&x) {
                *a += *v as f64;
            }
        }
        if spec != CodecSpec::Dense {
            // Sum of results + every rank's error buffers = sum of gradients.
            let mut left = vec![0.0f64; LEN];
            for e in gather(c, sum_state.error()) {
                left.iter_mut().zip(&e).for_each(|(l, v)| *l += *v as f64);
            }
            let shards = gather_concat(c, sum_state.shard_error());
            if spec.block().is_some() || !shards.is_empty() {
                assert_eq!(
                    shards.len(),
                    LEN,
                    "{what}: shard errors do not tile the tensor"
                );
                left.iter_mut()
                    .zip(&shards)
                    .for_each(|(l, v)| *l += *v as f64);
            }
            // fp16/bf16 round the sum once more, outside error feedback.
            let rel = match spec {
                CodecSpec::Fp16 => 2e-3,
                CodecSpec::Bf16 => 1e-2,
                _ => 1e-4,
            };
            for j in 0..LEN {
                let diff = (applied[j] + left[j] - given[j]).abs();
                assert!(
                    diff <= rel * (magnitude[j] + 1.0),
                    "{what}: error feedback does not telescope at {j}: results {} + errors {} vs gradients {}",
                    applied[j],
                    left[j],
                    given[j]
                );
            }
            checks += 1;
        }
    }
    checks
}

fn local_update(g: &[f32], codec: &mut dyn Codec) -> Vec<f32> {
    let mut ef = ErrorFeedback::new(g.len());
    ef.step(g, codec, 0).unwrap();
    ef.last_update().to_vec()
}

/// Bad input is rejected without effect, the communicator stays usable; clipping, warnings and reset.
pub fn bad_input_clip_warnings_reset(c: &Communicator) -> usize {
    let n = c.world_size();
    let mut checks = 0;
    let mut st = GradientCompressor::new(config(CodecSpec::TopK { density: 0.1 }), LEN).unwrap();
    let mut g = gradient(c.rank(), 0, LEN - 1);
    let before = g.clone();
    let e = c
        .all_reduce_compressed(&mut g, ReduceOp::Sum, &mut st)
        .unwrap_err();
    assert!(
        e.is_invalid_argument()
            && e.to_string().contains("3000 elements")
            && e.to_string().contains("3001"),
        "{e}"
    );
    assert!(g == before && st.step() == 0 && st.error().iter().all(|v| *v == 0.0));
    let mut g = gradient(c.rank(), 0, LEN);
    let before = g.clone();
    let e = c
        .all_reduce_compressed(&mut g, ReduceOp::Max, &mut st)
        .unwrap_err();
    assert!(
        e.is_invalid_argument() && e.to_string().contains("sum or avg"),
        "{e}"
    );
    assert!(g == before && st.step() == 0);
    assert!(c.async_error().is_none());
    checks += 2;

    // Still usable; then reset clears the error buffer.
    c.all_reduce_compressed(&mut g, ReduceOp::Sum, &mut st)
        .unwrap();
    assert!(st.error().iter().any(|v| *v != 0.0));
    st.reset();
    assert!(st.error().iter().all(|v| *v == 0.0) && st.step() == 1);
    checks += 1;

    // Clipping before compression.
    let clip = 5.0f32;
    let mut st = GradientCompressor::new(
        CompressionConfig {
            clip_norm: Some(clip),
            ..config(CodecSpec::Int8 {
                block: 256,
                stochastic: false,
            })
        },
        LEN,
    )
    .unwrap();
    let g = gradient(c.rank(), 1, LEN);
    let norm = l2_norm(&g);
    assert!(norm > clip as f64);
    let mut x = g.clone();
    let rep = c
        .all_reduce_compressed(&mut x, ReduceOp::Sum, &mut st)
        .unwrap();
    assert_eq!(rep.stats.clip_scale, (clip as f64 / norm) as f32);
    assert!((rep.stats.residual_norm - clip as f64).abs() < 1e-3);
    assert!(
        l2_norm(&x) <= n as f64 * clip as f64 * 1.05,
        "clipped sum too large"
    );
    assert_identical(c, &x, "clipped int8");
    checks += 2;

    // Warnings: below 1% density with an adaptive optimizer, not without one.
    for adaptive in [false, true] {
        let mut st = GradientCompressor::new(
            CompressionConfig {
                adaptive_optimizer: adaptive,
                ..config(CodecSpec::TopK { density: 0.005 })
            },
            LEN,
        )
        .unwrap();
        let mut x = gradient(c.rank(), 2, LEN);
        let rep = c
            .all_reduce_compressed(&mut x, ReduceOp::Avg, &mut st)
            .unwrap();
        assert!(rep.stats.density < 0.01);
        assert_eq!(!rep.warnings.is_empty(), adaptive, "{:?}", rep.warnings);
        if adaptive {
            assert!(
                rep.warnings[0].contains("adaptive optimizer"),
                "{:?}",
                rep.warnings
            );
        }
        assert_eq!(st.last_stats().map(|s| s.density), Some(rep.stats.density));
        checks += 1;
    }
    checks
}

/// All-to-all on real buffers: every dtype size, block sizes around the slot size, and bad lengths.
pub fn all_to_all(c: &Communicator) -> usize {
    let (n, rank) = (c.world_size(), c.rank());
    let mut checks = 0;
    let slot = c.config().chunk_bytes;
    for block in [0usize, 1, 7, slot / 8 + 3, 3 * slot / 8] {
        let send: Vec<u64> = (0..n * block)
            .map(|i| ((rank as u64) << 40) | i as u64)
            .collect();
        let mut recv = vec![u64::MAX; n * block];
        c.all_to_all(&send, &mut recv).unwrap();
        for p in 0..n {
            for j in 0..block {
                assert_eq!(
                    recv[p * block + j],
                    ((p as u64) << 40) | (rank * block + j) as u64,
                    "all_to_all block {block}: from rank {p}, element {j}"
                );
            }
        }
        checks += 1;
    }
    // Bytes with an element size that does not divide a slot evenly.
    let block = 1001;
    let send: Vec<u8> = (0..n * block * 2).map(|i| (i + rank * 31) as u8).collect();
    let mut recv = vec![0u8; send.len()];
    c.all_to_all_bytes(&send, &mut recv, DType::F16).unwrap();
    for p in 0..n {
        for j in 0..block * 2 {
            assert_eq!(
                recv[p * block * 2 + j],
                (rank * block * 2 + j + p * 31) as u8
            );
        }
    }
    checks += 1;
    // Bad lengths change nothing.
    if n > 1 {
        let send = vec![1u32; n * 4 + 1];
        let mut recv = vec![9u32; n * 4 + 1];
        let e = c.all_to_all(&send, &mut recv).unwrap_err();
        assert!(
            e.is_invalid_argument() && e.to_string().contains("equal blocks"),
            "{e}"
        );
        assert!(recv.iter().all(|v| *v == 9));
    }
    let send = vec![1u32; n * 4];
    let mut recv = vec![9u32; n * 5];
    let e = c.all_to_all(&send, &mut recv).unwrap_err();
    assert!(
        e.is_invalid_argument() && e.to_string().contains("receive buffer"),
        "{e}"
    );
    assert!(recv.iter().all(|v| *v == 9));
    let mut odd = vec![0u8; n * 4];
    let e = c
        .all_to_all_bytes(&[0u8; 3], &mut odd, DType::F32)
        .unwrap_err();
    assert!(e.to_string().contains("whole number"), "{e}");
    assert!(c.async_error().is_none());
    checks + 1
}

/// Tensors shorter than the world, a block or a matrix row, and empty ones: every codec still gives
/// bit-identical results, dense is exact, and one step's results plus errors equal the gradients' sum.
pub fn tiny_tensors(c: &Communicator) -> usize {
    let mut checks = 0;
    for len in [0usize, 1, 2, 5, 17] {
        for cfg in cases() {
            let spec = cfg.codec;
            let what = format!("{spec} on {len} elements, {} ranks", c.world_size());
            let mut st = GradientCompressor::new(cfg, len).unwrap();
            let g = gradient(c.rank(), 0, len);
            let mut x = g.clone();
            let rep = c
                .all_reduce_compressed(&mut x, ReduceOp::Sum, &mut st)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!((rep.stats.len, st.step()), (len, 1), "{what}");
            assert_identical(c, &x, &what);
            if spec == CodecSpec::Dense {
                let mut d = vec![0.0f32; len];
                c.all_reduce(&g, &mut d, ReduceOp::Sum).unwrap();
                assert!(x == d, "{what}: dense differs from all_reduce");
            } else if len > 0 {
                let mut left: Vec<f64> = x.iter().map(|v| *v as f64).collect();
                let mut e = vec![0.0f32; len];
                c.all_reduce(st.error(), &mut e, ReduceOp::Sum).unwrap();
                left.iter_mut().zip(&e).for_each(|(l, v)| *l += *v as f64);
                let shards = gather_concat(c, st.shard_error());
                if !shards.is_empty() {
                    assert_eq!(
                        shards.len(),
                        len,
                        "{what}: shard errors do not tile the tensor"
                    );
                    left.iter_mut()
                        .zip(&shards)
                        .for_each(|(l, v)| *l += *v as f64);
                }
                let rel = match spec {
                    CodecSpec::Fp16 => 2e-3,
                    CodecSpec::Bf16 => 1e-2,
                    _ => 1e-4,
                };
                let all = gather(c, &g);
                for j in 0..len {
                    let want: f64 = all.iter().map(|r| r[j] as f64).sum();
                    let mag: f64 = all.iter().map(|r| r[j].abs() as f64).sum();
                    assert!(
                        (left[j] - want).abs() <= rel * (mag + 1.0),
                        "{what}: results plus errors {} differ from the gradients' sum {want} at {j}",
                        left[j]
                    );
                }
            }
            checks += 1;
        }
    }
    checks
}

/// `got` and `want` are the same bits; otherwise the first difference is named (not whole vectors).
fn same(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element {i} is {} where {} was expected",
            got[i], want[i]
        );
    }
}

/// Momentum correction, density warm-up, global clipping and Adam-safe compression, each against a
/// reference computed here from every rank's gradients.
pub fn modes(c: &Communicator) -> usize {
    let (n, rank) = (c.world_size(), c.rank());
    let mut checks = 0;

    // Momentum correction: each rank's contribution is its own error feedback with momentum over top-k;
    // the result is their sum in rank order.
    let cfg: CompressionConfig = "topk:0.05/momentum=0.9/seed=7/switch=inf".parse().unwrap();
    let mut st = GradientCompressor::new(cfg, LEN).unwrap();
    let mut reference = ErrorFeedback::new(LEN).with_momentum(0.9).unwrap();
    let mut codec = TopK::new(0.05).unwrap();
    for step in 0..4 {
        let g = gradient(rank, step, LEN);
        reference.step(&g, &mut codec, step).unwrap();
        let mut x = g.clone();
        let rep = c
            .all_reduce_compressed(&mut x, ReduceOp::Sum, &mut st)
            .unwrap();
        let want = ordered_sum(&gather(c, reference.last_update()));
        same(&x, &want, &format!("momentum correction, step {step}"));
        same(
            st.velocity(),
            reference.velocity(),
            &format!("velocity, step {step}"),
        );
        assert_eq!(rep.output, braid::Output::Gradient);
        checks += 1;
    }
    assert!(st.velocity().iter().any(|v| *v != 0.0));

    // Density warm-up: the codec's density follows the schedule, then stays at the target.
    let cfg: CompressionConfig = "topk:0.01/warmup=4:0.4/switch=inf".parse().unwrap();
    let warmup = cfg.warmup.unwrap();
    let mut st = GradientCompressor::new(cfg, LEN).unwrap();
    for step in 0..6 {
        let mut x = gradient(rank, step, LEN);
        let rep = c
            .all_reduce_compressed(&mut x, ReduceOp::Avg, &mut st)
            .unwrap();
        let want = warmup.density(0.01, step);
        assert_eq!(rep.scheduled_density, Some(want), "step {step}");
        let k = braid::braid_compress::k_for_density(LEN, want);
        assert_eq!(rep.stats.density, k as f64 / LEN as f64, "step {step}");
        assert_identical(c, &x, "warm-up");
        checks += 1;
    }
    // Periodic flush: every third step is sent whole, exactly the dense sum of gradient and residual,
    // and leaves no residual behind; the others are top-k at the target density.
    let cfg: CompressionConfig = "topk:0.01/flush=3".parse().unwrap();
    let mut st = GradientCompressor::new(cfg, LEN).unwrap();
    for step in 0..7u64 {
        let g = gradient(rank, step, LEN);
        let carried: Vec<f32> = g.iter().zip(st.error()).map(|(a, e)| a + e).collect();
        let mut x = g.clone();
        let rep = c
            .all_reduce_compressed(&mut x, ReduceOp::Sum, &mut st)
            .unwrap();
        if (step + 1) % 3 == 0 {
            assert_eq!(rep.scheduled_density, Some(1.0), "step {step}");
            // The whole carried gradient, summed (the dense path's order of addition may differ from
            // rank order by an ulp).
            let want = ordered_sum(&gather(c, &carried));
            for (i, (a, b)) in x.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                    "flush, step {step}: element {i} is {a}, expected {b}"
                );
            }
            assert!(
                st.error().iter().all(|e| *e == 0.0),
                "step {step}: a residual after a flush"
            );
        } else {
            assert_eq!(rep.scheduled_density, Some(0.01), "step {step}");
            assert!(
                st.error().iter().any(|e| *e != 0.0),
                "step {step}: no residual at 1%"
            );
        }
        assert_identical(c, &x, "flush");
        checks += 1;
    }
    for bad in ["topk:0.01/flush=1", "int8/flush=10", "topk/flush=3:2"] {
        assert!(
            bad.parse::<CompressionConfig>()
                .and_then(|c| GradientCompressor::new(c, LEN).map(|_| ()))
                .is_err(),
            "{bad}"
        );
    }
    assert_eq!(
        GradientCompressor::new("int8".parse().unwrap(), 4).map(|_| ()),
        Ok(())
    );

    // Global clipping: the bound from the mean of the local norms, the same factor on every rank.
    let clip = 1.0f32;
    let g = gradient(rank, 9, LEN);
    let norms = gather(c, &[l2_norm(&g) as f32]);
    let mut local = [l2_norm(&g)];
    c.all_reduce_in_place(&mut local, ReduceOp::Sum).unwrap();
    let bound = local[0] / n as f64;
    let cfg: CompressionConfig = "int8/gclip=1".parse().unwrap();
    let mut st = GradientCompressor::new(cfg, LEN).unwrap();
    let mut x = g.clone();
    let rep = c
        .all_reduce_compressed(&mut x, ReduceOp::Avg, &mut st)
        .unwrap();
    assert_eq!(
        rep.stats.clip_scale,
        (clip as f64 / bound) as f32,
        "{norms:?}"
    );
    assert_eq!(rep.stats.grad_norm, l2_norm(&g));
    assert!(
        l2_norm(&x) <= clip as f64 * 1.05,
        "globally clipped average {} exceeds the bound",
        l2_norm(&x)
    );
    assert_identical(c, &x, "global clipping");
    // The dense path clips the all-reduced gradient itself, exactly.
    let mut st = GradientCompressor::new("dense/gclip=1".parse().unwrap(), LEN).unwrap();
    let mut x = g.clone();
    let rep = c
        .all_reduce_compressed(&mut x, ReduceOp::Avg, &mut st)
        .unwrap();
    let mut avg = g.clone();
    c.all_reduce_in_place(&mut avg, ReduceOp::Avg).unwrap();
    let exact = (clip as f64 / l2_norm(&avg)) as f32;
    assert_eq!(rep.stats.clip_scale, exact.min(1.0));
    assert!((l2_norm(&x) - (l2_norm(&avg)).min(clip as f64)).abs() < 1e-4);
    checks += 2;

    // Adam-safe compression: dense warm-up tracking the first moment, then the compressed moment
    // (1-bit Adam) or the compressed gradient feeding the moment (the default for top-k).
    for (text, send_moment) in [
        ("topk:0.1/adam=2/switch=inf/adamsend=moment", true),
        ("topk:0.1/adam=2/switch=inf", false),
    ] {
        let cfg: CompressionConfig = text.parse().unwrap();
        let mut st = GradientCompressor::new(cfg, LEN).unwrap();
        let mut g = gradient(rank, 0, LEN);
        let before = g.clone();
        let e = c
            .all_reduce_compressed(&mut g, ReduceOp::Sum, &mut st)
            .unwrap_err();
        assert!(
            e.is_invalid_argument() && e.to_string().contains("must be avg"),
            "{e}"
        );
        assert!(g == before && st.step() == 0 && c.async_error().is_none());
        let mut m = vec![0.0f32; LEN];
        let mut ef = ErrorFeedback::new(LEN);
        let mut codec = TopK::new(0.1).unwrap();
        let b = 0.9f32;
        let d = n as f32;
        for step in 0..5 {
            let g = gradient(rank, step, LEN);
            let mut x = g.clone();
            let rep = c
                .all_reduce_compressed(&mut x, ReduceOp::Avg, &mut st)
                .unwrap();
            if step < 2 {
                let mut avg = g.clone();
                c.all_reduce_in_place(&mut avg, ReduceOp::Avg).unwrap();
                same(&x, &avg, &format!("{text}: warm-up step {step} is dense"));
                assert_eq!(
                    (rep.path, rep.output),
                    (CompressedPath::Dense, braid::Output::Gradient)
                );
                m.iter_mut()
                    .zip(&avg)
                    .for_each(|(m, g)| *m = b * *m + (1.0 - b) * g);
            } else {
                let local: Vec<f32> = if send_moment {
                    m.iter()
                        .zip(&g)
                        .map(|(m, g)| b * m + (1.0 - b) * g)
                        .collect()
                } else {
                    g.clone()
                };
                ef.step(&local, &mut codec, step).unwrap();
                let mut avg = ordered_sum(&gather(c, ef.last_update()));
                avg.iter_mut().for_each(|w| *w /= d);
                if send_moment {
                    m.copy_from_slice(&avg);
                } else {
                    m.iter_mut()
                        .zip(&avg)
                        .for_each(|(m, g)| *m = b * *m + (1.0 - b) * g);
                }
                same(&x, &m, &format!("{text}: compressed step {step}"));
                assert_eq!(rep.output, braid::Output::Momentum);
            }
            same(
                st.adam_momentum(),
                &m,
                &format!("{text}: first moment, step {step}"),
            );
            checks += 1;
        }
    }
    checks
}

/// Exactly `k` of the largest magnitudes ([`top_k`]): the range owner's re-selection, as a codec.
struct Keep(usize);

impl Codec for Keep {
    fn name(&self) -> String {
        format!("keep {}", self.0)
    }
    fn transport(&self) -> Transport {
        Transport::Gather
    }
    fn compress(&mut self, grad: &[f32], _step: u64) -> Compressed {
        top_k(grad, self.0)
    }
}

/// The sparse reduce-scatter of every rank computed on one rank, on whole tensors: each rank's error
/// feedback and top-k, each range's rank-ordered sum, second error buffer and quota, the next partition
/// from the load, and what leaves a range going back to its owner's local error buffer.
struct SparseReference {
    local: Vec<ErrorFeedback>,
    codecs: Vec<TopK>,
    partition: Partition,
    ranges: Vec<ErrorFeedback>,
}

/// What one reference step gives: the result, and each rank's pairs sent to other ranks and quota.
struct SparseStep {
    result: Vec<f32>,
    off_rank: Vec<u64>,
    quotas: Vec<u64>,
    counts: Vec<u64>,
}

impl SparseReference {
    fn new(n: usize, density: f32) -> Self {
        let partition = Partition::even(LEN, n);
        SparseReference {
            local: (0..n).map(|_| ErrorFeedback::new(LEN)).collect(),
            codecs: (0..n).map(|_| TopK::new(density).unwrap()).collect(),
            ranges: (0..n)
                .map(|j| ErrorFeedback::new(partition.range(j).len()))
                .collect(),
            partition,
        }
    }

    /// One step; `reduce_scatter` false is the all-gather way (the ranges stay as they are).
    fn step(&mut self, grads: &[Vec<f32>], t: u64, reduce_scatter: bool) -> SparseStep {
        let n = grads.len();
        let mut sel = Vec::new();
        for ((ef, codec), g) in self.local.iter_mut().zip(&mut self.codecs).zip(grads) {
            let (c, _) = ef.step(g, codec, t).unwrap();
            let Payload::Sparse { indices, values } = c.into_payload() else {
                panic!("top-k is sparse")
            };
            sel.push((indices, values));
        }
        let counts: Vec<u64> = sel.iter().map(|s| s.0.len() as u64).collect();
        let mut result = vec![0.0f32; LEN];
        if !reduce_scatter {
            for (i, v) in &sel {
                i.iter().zip(v).for_each(|(i, v)| result[*i as usize] += v);
            }
            return SparseStep {
                result,
                off_rank: vec![],
                quotas: vec![],
                counts,
            };
        }
        let p = self.partition.clone();
        let routes: Vec<_> = sel.iter().map(|s| p.route(&s.0)).collect();
        let mut histogram = Vec::new();
        let mut quotas = Vec::new();
        for j in 0..n {
            let own = p.range(j);
            let mut sum = vec![0.0f32; own.len()];
            let mut load = 0;
            let mut h = [0u64; sparse_model::HISTOGRAM_BUCKETS];
            for (s, rt) in sel.iter().zip(&routes) {
                for e in rt[j].clone() {
                    sum[s.0[e] as usize - own.start] += s.1[e];
                }
                load += rt[j].len() as u64;
                let part = p.histogram(j, s.0[rt[j].clone()].iter().copied());
                h.iter_mut().zip(part).for_each(|(a, x)| *a += x);
            }
            histogram.extend(h);
            let q = sparse_model::quota(load, n, own.len());
            quotas.push(q);
            let (kept, _) = self.ranges[j].step(&sum, &mut Keep(q as usize), t).unwrap();
            let mut dense = vec![0.0f32; own.len()];
            kept.decompress(&mut dense).unwrap();
            result[own].copy_from_slice(&dense);
        }
        let next = p.rebalance(&histogram);
        for j in 0..n {
            let (old, new) = (p.range(j), next.range(j));
            let mut ef = ErrorFeedback::new(new.len());
            for (i, e) in old.zip(&self.ranges[j].error) {
                if new.contains(&i) {
                    ef.error[i - new.start] = *e;
                } else {
                    self.local[j].error[i] += *e;
                }
            }
            self.ranges[j] = ef;
        }
        self.partition = next;
        SparseStep {
            result,
            off_rank: (0..n)
                .map(|r| counts[r] - routes[r][r].len() as u64)
                .collect(),
            quotas,
            counts,
        }
    }
}

/// The sparse reduce-scatter against [`SparseReference`], bit for bit, over several steps (the
/// partition moving with the load): the result, this rank's local and second error buffers, the path
/// the traffic model picks, and the bytes sent exactly as `braid_sched::sparse` counts them.
pub fn sparse_reduce_scatter(c: &Communicator) -> usize {
    let (n, me) = (c.world_size(), c.rank());
    let mut checks = 0;
    for (path, density) in [
        (SparsePath::ReduceScatter, 0.1),
        (SparsePath::ReduceScatter, 0.02),
        (SparsePath::Auto, 0.1),
        (SparsePath::Auto, 0.003),
    ] {
        let cfg = CompressionConfig {
            sparse_path: path,
            ..config(CodecSpec::TopK { density })
        };
        let mut st = GradientCompressor::new(cfg.clone(), LEN).unwrap();
        let mut re = SparseReference::new(n, density);
        for t in 0..4 {
            let what = format!("topk:{density}, sparse path {path}, step {t} on {n} ranks");
            // A band of larger gradients that moves between steps, so the partition has to follow.
            let grads: Vec<Vec<f32>> = (0..n)
                .map(|r| {
                    let mut g = gradient(r, t, LEN);
                    let band = (t as usize * 400)..(t as usize * 400 + 600);
                    g[band].iter_mut().for_each(|x| *x *= 10.0);
                    g
                })
                .collect();
            let k = k_for_density(LEN, density) as u64;
            let route = sparse_model::choose(path, LEN, &vec![k; n], cfg.dense_switch);
            let want = re.step(&grads, t, route == SparseRoute::ReduceScatter);
            assert!(want.counts.iter().all(|x| *x == k), "{what}");
            let mut x = grads[me].clone();
            let rep = c
                .all_reduce_compressed(&mut x, ReduceOp::Sum, &mut st)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_identical(c, &x, &what);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&x) == bits(&want.result),
                "{what}: differs from the reference"
            );
            assert!(
                bits(st.error()) == bits(&re.local[me].error),
                "{what}: local error buffer"
            );
            let ag = sparse_model::all_gather_bytes(&want.counts);
            match route {
                SparseRoute::ReduceScatter => {
                    assert_eq!(rep.path, CompressedPath::SparseReduceScatter, "{what}");
                    assert!(
                        bits(st.shard_error()) == bits(&re.ranges[me].error),
                        "{what}: second error buffer"
                    );
                    let bytes =
                        sparse_model::reduce_scatter_bytes(n, want.off_rank[me], want.quotas[me]);
                    assert_eq!(rep.sent_bytes, bytes, "{what}: bytes sent");
                    let kept = x.iter().filter(|v| **v != 0.0).count() as u64;
                    assert!(kept <= k + n as u64, "{what}: kept {kept} of k = {k}");
                    // Less than a dense ring; less than gathering too once the partition has
                    // followed the load and pairs outweigh the fixed exchanges.
                    let balanced = t > 0 && density >= 0.1;
                    if n >= 4 {
                        assert!(
                            (rep.sent_bytes < ag || !balanced)
                                && rep.sent_bytes < rep.dense_sent_bytes,
                            "{what}: {} bytes, all-gather {ag}, dense {}",
                            rep.sent_bytes,
                            rep.dense_sent_bytes
                        );
                    }
                }
                SparseRoute::AllGather => {
                    assert_eq!(rep.path, CompressedPath::SparseAllGather, "{what}");
                    assert_eq!(rep.sent_bytes, ag, "{what}: bytes sent");
                    assert!(st.shard_error().is_empty(), "{what}");
                }
                SparseRoute::Dense => panic!("{what}: no case here goes dense"),
            }
            checks += 1;
        }
    }
    // Auto's choice at this size: gathering on one or two ranks, the reduce-scatter from three on
    // (at 0.3%, gathering 9 pairs per rank costs less than the reduce-scatter's fixed exchanges up
    // to a few ranks).
    let k = k_for_density(LEN, 0.1) as u64;
    let auto = sparse_model::choose(SparsePath::Auto, LEN, &vec![k; n], 0.5);
    assert_eq!(
        auto == SparseRoute::ReduceScatter,
        n >= 3,
        "auto on {n} ranks: {auto:?}"
    );
    checks + 1
}

/// The learning rate rescales the error buffers: against a reference whose error is scaled by the old
/// over the new rate before each step (a rate of 0 skipped), the velocity left alone; then the second
/// error buffers of the two-phase path and the sparse reduce-scatter, and nothing held back at density 1.
pub fn learning_rate(c: &Communicator) -> usize {
    let rank = c.rank();
    let mut checks = 0;
    let cfg: CompressionConfig = "topk:0.05/momentum=0.9/switch=inf".parse().unwrap();
    let mut st = GradientCompressor::new(cfg, LEN).unwrap();
    let mut reference = ErrorFeedback::new(LEN).with_momentum(0.9).unwrap();
    let mut codec = TopK::new(0.05).unwrap();
    // (rate, factor the reference's error is scaled by before the step)
    let rates = [
        (0.1f32, 1.0f32),
        (0.05, 2.0),
        (0.0, 1.0),
        (0.025, 2.0),
        (0.025, 1.0),
        (0.1, 0.25),
    ];
    for (step, &(lr, factor)) in rates.iter().enumerate() {
        let step = step as u64;
        st.set_learning_rate(lr).unwrap();
        reference.error.iter_mut().for_each(|e| *e *= factor);
        same(st.error(), &reference.error, &format!("error, step {step}"));
        let g = gradient(rank, step, LEN);
        reference.step(&g, &mut codec, step).unwrap();
        let mut x = g.clone();
        c.all_reduce_compressed(&mut x, ReduceOp::Sum, &mut st)
            .unwrap();
        let want = ordered_sum(&gather(c, reference.last_update()));
        same(&x, &want, &format!("learning rate {lr}, step {step}"));
        same(
            st.velocity(),
            reference.velocity(),
            &format!("velocity, step {step}"),
        );
        checks += 1;
    }
    assert_eq!(st.learning_rate(), Some(0.1));
    assert!(st.error().iter().any(|e| *e != 0.0));
    for bad in [-0.1, f32::NAN, f32::INFINITY] {
        let before = st.error().to_vec();
        assert!(st.set_learning_rate(bad).is_err(), "{bad}");
        assert_eq!((st.learning_rate(), st.error()), (Some(0.1), &before[..]));
    }

    // The second error buffers scale with the first.
    for text in ["int8", "topk:0.05/sparse=reducescatter/switch=inf"] {
        let mut st = GradientCompressor::new(text.parse().unwrap(), LEN).unwrap();
        st.set_learning_rate(0.2).unwrap();
        let mut x = gradient(rank, 0, LEN);
        c.all_reduce_compressed(&mut x, ReduceOp::Avg, &mut st)
            .unwrap();
        let (local, shard) = (st.error().to_vec(), st.shard_error().to_vec());
        // One rank has no second phase.
        assert!(
            c.world_size() == 1 || shard.iter().any(|e| *e != 0.0),
            "{text}: no second residual"
        );
        st.set_learning_rate(0.05).unwrap();
        let four = |v: &[f32]| v.iter().map(|e| e * 4.0).collect::<Vec<f32>>();
        same(st.error(), &four(&local), &format!("{text}: error"));
        same(
            st.shard_error(),
            &four(&shard),
            &format!("{text}: second error"),
        );
        checks += 1;
    }

    // At density 1 nothing is held back: the rate changes nothing, and momentum correction is dense
    // momentum SGD's velocity.
    let mut st = GradientCompressor::new("topk:1/momentum=0.9".parse().unwrap(), LEN).unwrap();
    for (step, lr) in [0.1f32, 0.05, 0.01].into_iter().enumerate() {
        st.set_learning_rate(lr).unwrap();
        let mut x = gradient(rank, step as u64, LEN);
        c.all_reduce_compressed(&mut x, ReduceOp::Sum, &mut st)
            .unwrap();
        assert!(
            st.error().iter().all(|e| *e == 0.0),
            "density 1, step {step}"
        );
        checks += 1;
    }
    checks
}
