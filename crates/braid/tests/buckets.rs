//! Gradient buckets on ranks that are threads of one process: exact results for every dtype whatever
//! order the gradients arrive in, the rebuild in rank 0's order, refusals that change nothing, missing
//! gradients, and compressed buckets whose error feedback survives the rebuild.

use braid::{
    BucketOptions, CodecSpec, CompressionConfig, DType, GradientBuckets, ReduceOp, SparsePath,
};
use braid_testkit::compression::{with_ranks, with_ranks_checked};
use half::{bf16, f16};

fn mix(a: u64, b: u64, c: u64) -> u64 {
    let mut z = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.rotate_left(21) ^ c.rotate_left(42);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `values` (small integers) as little-endian elements of `dtype`.
fn encode(dtype: DType, values: &[i64]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| -> Vec<u8> {
            match dtype {
                DType::I8 => (v as i8).to_le_bytes().to_vec(),
                DType::U8 => (v as u8).to_le_bytes().to_vec(),
                DType::I32 => (v as i32).to_le_bytes().to_vec(),
                DType::U32 => (v as u32).to_le_bytes().to_vec(),
                DType::I64 => v.to_le_bytes().to_vec(),
                DType::U64 => (v as u64).to_le_bytes().to_vec(),
                DType::F16 => f16::from_f64(v as f64).to_le_bytes().to_vec(),
                DType::F32 => (v as f32).to_le_bytes().to_vec(),
                DType::F64 => (v as f64).to_le_bytes().to_vec(),
                DType::BF16 => bf16::from_f64(v as f64).to_le_bytes().to_vec(),
            }
        })
        .collect()
}

/// Rank `r`'s gradient of parameter `p` at `step`: small integers (exact sums in every dtype; unsigned
/// types non-negative).
fn gradient(r: usize, step: u64, p: usize, len: usize, dtype: DType) -> Vec<i64> {
    (0..len)
        .map(|i| {
            let v = (mix(r as u64, step << 20 | p as u64, i as u64) % 9) as i64;
            if matches!(dtype, DType::U8 | DType::U32 | DType::U64) {
                v
            } else {
                v - 4
            }
        })
        .collect()
}

/// A permutation of `0..n` drawn from `seed`.
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        v.swap(i, (mix(seed, i as u64, 99) % (i as u64 + 1)) as usize);
    }
    v
}

fn params() -> Vec<(usize, DType)> {
    vec![
        (1000, DType::F32),
        (3, DType::F32),
        (0, DType::F32),
        (257, DType::F64),
        (5000, DType::F32),
        (17, DType::I32),
        (64, DType::BF16),
        (1, DType::F32),
        (33, DType::F16),
        (129, DType::U8),
        (9, DType::I64),
    ]
}

#[test]
fn buckets_reduce_every_dtype_exactly_in_any_arrival_order_and_rebuild_in_rank_0s_order() {
    every_dtype_in_any_order(true);
}

#[test]
fn buckets_in_private_memory_reduce_the_same() {
    every_dtype_in_any_order(false);
}

fn every_dtype_in_any_order(shared: bool) {
    const N: usize = 3;
    const STEPS: u64 = 4;
    let out = with_ranks(N, move |c| {
        let params = params();
        let options = BucketOptions {
            bucket_bytes: Some(4096),
            first_bucket_bytes: 1024,
            op: ReduceOp::Sum,
            shared,
            ..BucketOptions::default()
        };
        let mut b = GradientBuckets::new(&c, &params, options).unwrap();
        assert_eq!(b.stream(), c.streams() - 1);
        let initial = b.layout();
        let mut first_order = Vec::new();
        for step in 0..STEPS {
            // Every rank, every step, its own arrival order.
            let order = shuffled(params.len(), mix(c.rank() as u64, step, 1));
            if step == 0 {
                first_order = order.clone();
            }
            for &p in &order {
                let (len, dtype) = params[p];
                b.mark_ready_bytes(
                    p,
                    &encode(dtype, &gradient(c.rank(), step, p, len, dtype)),
                    dtype,
                )
                .unwrap();
            }
            b.finish().unwrap();
            for (p, &(len, dtype)) in params.iter().enumerate() {
                let sum: Vec<i64> = (0..len)
                    .map(|i| (0..N).map(|r| gradient(r, step, p, len, dtype)[i]).sum())
                    .collect();
                assert_eq!(
                    b.gradient_bytes(p, dtype).unwrap(),
                    &encode(dtype, &sum)[..],
                    "rank {} step {step} parameter {p} ({dtype})",
                    c.rank()
                );
            }
            assert!(b.rebuilt());
        }
        assert_eq!(b.steps(), STEPS);
        (initial, first_order, b.layout())
    });
    let (initial, rank0_order, layout) = out[0].clone();
    // Reverse registration order first, one dtype per bucket, caps respected.
    let flat: Vec<usize> = initial.iter().flatten().copied().collect();
    assert_eq!(flat, (0..params().len()).rev().collect::<Vec<_>>());
    // Rebuilt in rank 0's observed order, the same on every rank.
    let flat: Vec<usize> = layout.iter().flatten().copied().collect();
    assert_eq!(flat, rank0_order);
    for (r, o) in out.iter().enumerate() {
        assert_eq!(o.2, layout, "rank {r}'s layout differs from rank 0's");
    }
    let p = params();
    for bucket in &layout {
        assert!(
            bucket.iter().all(|&q| p[q].1 == p[bucket[0]].1),
            "{layout:?}"
        );
    }
}

#[test]
fn bucket_layout_follows_the_caps_and_the_dtypes() {
    let out = with_ranks(1, |c| {
        let f = |n| (n, DType::F32);
        let params = vec![
            f(100),
            f(100),
            f(300),
            f(10),
            (10, DType::F64),
            f(10),
            f(2000),
        ];
        let options = BucketOptions {
            bucket_bytes: Some(1600),
            first_bucket_bytes: 500,
            rebuild: false,
            ..BucketOptions::default()
        };
        GradientBuckets::new(&c, &params, options).unwrap().layout()
    });
    // Reverse order. 6 (8000 bytes) is larger than any cap: a bucket of its own. 5 cannot join the first
    // bucket (500 bytes at most); 4 is f64, so neither joins it nor lets 3 join it; 3 and 2 make 1240
    // bytes, 1 would make 1640 > 1600, so it starts the last bucket, which 0 joins.
    assert_eq!(
        out[0],
        vec![vec![6], vec![5], vec![4], vec![3, 2], vec![1, 0]]
    );
}

#[test]
fn refused_marks_change_nothing() {
    let out = with_ranks(2, |c| {
        let params = vec![(10, DType::F32), (4, DType::I32)];
        let mut b = GradientBuckets::new(
            &c,
            &params,
            BucketOptions {
                op: ReduceOp::Sum,
                ..BucketOptions::default()
            },
        )
        .unwrap();
        let mut errors = vec![
            b.mark_ready(2, &[0f32; 10]).unwrap_err(),
            b.mark_ready(0, &[0f64; 10]).unwrap_err(),
            b.mark_ready(0, &[0f32; 9]).unwrap_err(),
            b.mark_ready_bytes(0, &[0u8; 7], DType::F32).unwrap_err(),
        ];
        b.mark_ready(0, &[1f32; 10]).unwrap();
        errors.push(b.mark_ready(0, &[5f32; 10]).unwrap_err());
        b.mark_ready(1, &[c.rank() as i32 + 1; 4]).unwrap();
        b.finish().unwrap();
        assert_eq!(b.gradient::<f32>(0).unwrap(), &[2f32; 10]);
        assert_eq!(b.gradient::<i32>(1).unwrap(), &[3i32; 4]);
        let mut out = [0i32; 4];
        b.unpack(1, &mut out).unwrap();
        assert_eq!(out, [3; 4]);
        errors.push(b.gradient::<f32>(1).unwrap_err());
        errors.push(b.unpack(0, &mut [0f32; 3]).unwrap_err());
        errors
            .into_iter()
            .map(|e| (e.is_invalid_argument(), e.to_string()))
            .collect::<Vec<_>>()
    });
    let wants = [
        "parameter 2 does not exist (2 were registered)",
        "parameter 0 is 10 elements of float; got 10 of double",
        "parameter 0 is 10 elements of float; got 9 of float",
        "not a whole number of float",
        "parameter 0 was already marked ready this step",
        "parameter 1 is 4 elements of int32; got 4 of float",
        "parameter 0 has 10 elements; the output has 3",
    ];
    for (r, errors) in out.iter().enumerate() {
        for ((invalid, e), want) in errors.iter().zip(wants) {
            assert!(
                *invalid && e.contains(want),
                "rank {r}: {e} (wanted {want})"
            );
        }
    }
}

#[test]
fn options_that_cannot_work_are_refused() {
    with_ranks(1, |c| {
        let f32s = [(8, DType::F32)];
        let bad = |params: &[(usize, DType)], o: BucketOptions| {
            GradientBuckets::new(&c, params, o).unwrap_err().to_string()
        };
        let e = bad(
            &f32s,
            BucketOptions {
                stream: Some(9),
                ..Default::default()
            },
        );
        assert!(e.contains("stream 9 does not exist"), "{e}");
        let e = bad(
            &f32s,
            BucketOptions {
                bucket_bytes: Some(0),
                ..Default::default()
            },
        );
        assert!(e.contains("at least 1"), "{e}");
        let compressed = BucketOptions {
            compression: Some(CompressionConfig::default()),
            ..Default::default()
        };
        let e = bad(&[(8, DType::F32), (8, DType::F16)], compressed.clone());
        assert!(e.contains("parameter 1 is half"), "{e}");
        let e = bad(
            &f32s,
            BucketOptions {
                op: ReduceOp::Max,
                ..compressed
            },
        );
        assert!(e.contains("sum or avg"), "{e}");
        let e = bad(
            &[(8, DType::F32)],
            BucketOptions {
                op: ReduceOp::BitAnd,
                ..Default::default()
            },
        );
        assert!(e.contains("parameter 0's dtype float"), "{e}");
    });
}

#[test]
fn a_missing_gradient_fails_the_step_on_every_rank_and_names_the_rank() {
    let out = with_ranks_checked(2, false, |c| {
        let params = vec![(1000, DType::F32), (1000, DType::F32)];
        let options = BucketOptions {
            bucket_bytes: Some(4000),
            ..BucketOptions::default()
        };
        let mut b = GradientBuckets::new(&c, &params, options).unwrap();
        b.mark_ready(1, &[1f32; 1000]).unwrap();
        if c.rank() == 0 {
            b.mark_ready(0, &[1f32; 1000]).unwrap();
        }
        b.finish().unwrap_err().to_string()
    });
    assert!(
        out[1].contains("rank 1: 1 parameter(s) were not marked ready this step (0)"),
        "{}",
        out[1]
    );
    assert!(out[0].contains("rank 1"), "rank 0 got: {}", out[0]);
}

#[test]
fn unused_as_zero_counts_a_missing_gradient_as_zero() {
    let out = with_ranks(2, |c| {
        let params = vec![(5, DType::F32), (5, DType::F32)];
        let options = BucketOptions {
            op: ReduceOp::Sum,
            unused_as_zero: true,
            ..BucketOptions::default()
        };
        let mut b = GradientBuckets::new(&c, &params, options).unwrap();
        b.mark_ready(0, &[2f32; 5]).unwrap();
        if c.rank() == 0 {
            b.mark_ready(1, &[3f32; 5]).unwrap();
        }
        b.finish().unwrap();
        (
            b.gradient::<f32>(0).unwrap().to_vec(),
            b.gradient::<f32>(1).unwrap().to_vec(),
        )
    });
    for (g0, g1) in out {
        assert_eq!((g0, g1), (vec![4f32; 5], vec![3f32; 5]));
    }
}

/// What a rank reports of a compressed run: every step's results, and at the end its local error and the
/// second buffer it owns, per bucket, with the layout.
struct Compressed {
    results: Vec<Vec<Vec<f32>>>,
    local: Vec<Vec<f32>>,
    second: Vec<Vec<f32>>,
    initial: Vec<Vec<usize>>,
    layout: Vec<Vec<usize>>,
}

fn compressed_gradient(r: usize, step: u64, p: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let u =
                (mix(r as u64, step << 20 | p as u64, i as u64) >> 11) as f64 / (1u64 << 53) as f64;
            // A few large values per block, so that quantization and selection both drop a lot.
            let big = if i % 37 == 0 { 100.0 } else { 1.0 };
            ((u - 0.5) * big) as f32
        })
        .collect()
}

#[test]
fn compressed_buckets_keep_error_feedback_across_the_rebuild() {
    const N: usize = 3;
    const STEPS: u64 = 4;
    let lens = [700usize, 1300, 64, 2000, 5];
    let codecs = [
        (
            "top-k, gathered",
            CodecSpec::TopK { density: 0.05 },
            SparsePath::AllGather,
        ),
        (
            "top-k, by range",
            CodecSpec::TopK { density: 0.05 },
            SparsePath::ReduceScatter,
        ),
        (
            "int8",
            CodecSpec::Int8 {
                block: 64,
                stochastic: false,
            },
            SparsePath::AllGather,
        ),
    ];
    for (name, codec, sparse_path) in codecs {
        let out = with_ranks(N, move |c| {
            let params: Vec<(usize, DType)> = lens.iter().map(|&n| (n, DType::F32)).collect();
            let options = BucketOptions {
                bucket_bytes: Some(4096),
                first_bucket_bytes: 4096,
                op: ReduceOp::Sum,
                compression: Some(CompressionConfig {
                    codec,
                    sparse_path,
                    ..CompressionConfig::default()
                }),
                ..BucketOptions::default()
            };
            let mut b = GradientBuckets::new(&c, &params, options).unwrap();
            let initial = b.layout();
            let mut results = Vec::new();
            for step in 0..STEPS {
                // Registration order on rank 0 (not the initial reverse one): the rebuild moves things.
                let order: Vec<usize> = if c.rank() == 0 {
                    (0..lens.len()).collect()
                } else {
                    shuffled(lens.len(), mix(c.rank() as u64, step, 5))
                };
                for &p in &order {
                    b.mark_ready(p, &compressed_gradient(c.rank(), step, p, lens[p]))
                        .unwrap();
                }
                b.finish().unwrap();
                assert_eq!(b.reports().len(), b.layout().len());
                results.push(
                    (0..lens.len())
                        .map(|p| b.gradient::<f32>(p).unwrap().to_vec())
                        .collect::<Vec<_>>(),
                );
            }
            let local = b.compressors().iter().map(|k| k.error().to_vec()).collect();
            let second = b
                .compressors()
                .iter()
                .map(|k| k.shard_error().to_vec())
                .collect();
            Compressed {
                results,
                local,
                second,
                initial,
                layout: b.layout(),
            }
        });
        let layout = &out[0].layout;
        assert_ne!(
            &out[0].initial, layout,
            "{name}: the rebuild changed nothing"
        );
        // The error of every element, summed over ranks: local buffers, plus the second buffers, which tile
        // each bucket in rank order.
        let mut error: Vec<Vec<f64>> = lens.iter().map(|&n| vec![0.0; n]).collect();
        for (k, bucket) in layout.iter().enumerate() {
            let mut whole = vec![0f64; bucket.iter().map(|&p| lens[p]).sum()];
            for o in &out {
                for (w, e) in whole.iter_mut().zip(&o.local[k]) {
                    *w += *e as f64;
                }
            }
            let second: Vec<f32> = out.iter().flat_map(|o| o.second[k].clone()).collect();
            if !second.is_empty() {
                assert_eq!(
                    second.len(),
                    whole.len(),
                    "{name}: second buffers do not tile bucket {k}"
                );
                for (w, e) in whole.iter_mut().zip(&second) {
                    *w += *e as f64;
                }
            }
            let mut at = 0;
            for &p in bucket {
                error[p].copy_from_slice(&whole[at..at + lens[p]]);
                at += lens[p];
            }
        }
        // Nothing is lost: what all steps delivered plus what is still held back is what every rank gave.
        let mut held = 0f64;
        for (p, &len) in lens.iter().enumerate() {
            for i in 0..len {
                let given: f64 = (0..STEPS)
                    .flat_map(|s| (0..N).map(move |r| (s, r)))
                    .map(|(s, r)| compressed_gradient(r, s, p, len)[i] as f64)
                    .sum();
                let delivered: f64 = out[0].results.iter().map(|step| step[p][i] as f64).sum();
                for o in &out[1..] {
                    let theirs: Vec<f32> = o.results.iter().map(|step| step[p][i]).collect();
                    let ours: Vec<f32> = out[0].results.iter().map(|step| step[p][i]).collect();
                    assert_eq!(
                        theirs.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        ours.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "{name}: ranks differ at parameter {p} element {i}"
                    );
                }
                held += error[p][i].abs();
                let scale = 1.0 + given.abs().max(error[p][i].abs());
                assert!(
                    (delivered + error[p][i] - given).abs() <= 1e-3 * scale,
                    "{name}: parameter {p} element {i}: delivered {delivered} + held back {} != given {given}",
                    error[p][i]
                );
            }
        }
        assert!(
            held > 1.0,
            "{name}: nothing was held back ({held}); the test proves nothing"
        );
    }
}

#[test]
fn the_timeline_shows_bucket_all_reduces_on_their_stream_and_the_callers_spans() {
    let dir = std::env::temp_dir().join(format!("braid-timeline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pattern = dir.join("trace.json");
    let id = braid::UniqueId::new().unwrap();
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let (id, pattern) = (id.clone(), pattern.clone());
            std::thread::spawn(move || {
                let cfg = braid::Config {
                    timeline: Some(pattern),
                    ..braid::Config::default()
                };
                let c = braid::Communicator::init(2, r, &id, cfg).unwrap();
                assert!(c.timeline_enabled());
                let params = vec![(4096, DType::F32); 4];
                let options = BucketOptions {
                    bucket_bytes: Some(16384),
                    first_bucket_bytes: 16384,
                    ..BucketOptions::default()
                };
                let mut b = GradientBuckets::new(&c, &params, options).unwrap();
                for _ in 0..2 {
                    let span = c.timeline_span("backward");
                    for p in (0..4).rev() {
                        b.mark_ready(p, &vec![1f32; 4096]).unwrap();
                    }
                    drop(span);
                    b.finish().unwrap();
                }
                let e = c.timeline_event("bad", 10, 5).unwrap_err();
                assert!(e.to_string().contains("ends"), "{e}");
                let stream = b.stream();
                drop(b);
                drop(c);
                stream
            })
        })
        .collect();
    let streams: Vec<usize> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    for (r, stream) in streams.into_iter().enumerate() {
        let path = dir.join(format!("trace.rank{r}.json"));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let j: serde_json::Value = serde_json::from_str(&text).unwrap();
        let events = j["traceEvents"].as_array().unwrap();
        let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
        let on = |name: &str, tid: u64| {
            complete
                .iter()
                .filter(|e| e["name"] == name && e["tid"].as_u64() == Some(tid))
                .count()
        };
        let buckets_on = |tid: u64| {
            complete
                .iter()
                .filter(|e| {
                    e["name"] == "all_reduce"
                        && e["tid"].as_u64() == Some(tid)
                        && e["args"]["bytes"].as_u64() == Some(16384)
                })
                .count()
        };
        // Four buckets of one parameter each, two steps: eight all-reduces of a bucket on the buckets'
        // stream (beside the small ones that allocate the buckets' shared memory); the rebuild's
        // broadcast of rank 0's order on stream 0; two backward spans.
        assert_eq!(buckets_on(stream as u64), 8, "rank {r}: {text}");
        assert_eq!(on("broadcast", 0), 1, "rank {r}");
        assert_eq!(on("backward", 1000), 2, "rank {r}");
        for e in &complete {
            assert!(e["dur"].as_f64().unwrap() >= 0.0 && e["pid"].as_u64() == Some(r as u64));
        }
        let reduce = complete
            .iter()
            .find(|e| e["name"] == "all_reduce" && e["args"]["bytes"].as_u64() == Some(16384))
            .unwrap();
        assert_eq!(reduce["args"]["result"], "ok");
        // The buckets live in shared memory: their all-reduces run straight through it.
        assert_eq!(reduce["args"]["algo"], "shared", "rank {r}");
        // Each bucket's all-reduce is issued asynchronously, so its wait in the stream's queue is
        // shown as a `queued` phase on that stream (the issue time is stamped with a timeline on).
        let queued = complete
            .iter()
            .filter(|e| e["name"] == "queued" && e["tid"].as_u64() == Some(stream as u64))
            .count();
        assert!(queued >= 8, "rank {r}: {queued} queued phases: {text}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn parameters_too_large_to_address_together_are_an_error_not_a_wild_range() {
    // Each fits a usize, their sum with padding does not: the shared buckets' arena must not wrap.
    let out = with_ranks(2, |c| {
        let params = vec![
            (usize::MAX / 2, DType::U8),
            (usize::MAX / 2, DType::U8),
            (3, DType::F32),
        ];
        match GradientBuckets::new(&c, &params, BucketOptions::default()) {
            Err(e) => e.to_string(),
            Ok(b) => b.gradient_bytes(0, DType::U8).unwrap_err().to_string(),
        }
    });
    for e in out {
        assert!(!e.is_empty());
    }
}
