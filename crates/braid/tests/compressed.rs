//! Compressed all-reduce and all-to-all with ranks as threads of one process, and the configuration's
//! parsing: codec text, environment variables, validation.

use braid_testkit::compression as scenario;
use braid_testkit::compression::{with_ranks, with_ranks_checked};

use braid::braid_compress::mx::MxElement;
use braid::{CodecSpec, CompressionConfig, Error, GradientCompressor};
use proptest::prelude::*;

#[test]
fn every_codec_on_one_two_and_three_ranks() {
    for n in 1..=3 {
        let checks = with_ranks(n, |c| scenario::every_codec(&c));
        assert!(
            checks.iter().all(|k| *k == checks[0] && *k > 50),
            "{checks:?}"
        );
    }
}

#[test]
fn sparse_reduce_scatter_matches_its_reference() {
    for n in [1, 2, 3, 4] {
        let checks = with_ranks(n, |c| scenario::sparse_reduce_scatter(&c));
        assert!(checks.iter().all(|k| *k == 17), "{checks:?}");
    }
}

/// How rank 1 misbehaves in the sparse reduce-scatter: it plays the exchanges by hand.
#[derive(Clone, Copy, Debug)]
enum Lie {
    /// A partition of its own.
    Partition,
    /// More pairs for rank 0 than it selected in all.
    Count,
    /// Pairs outside rank 0's range.
    Indices,
    /// A quota its load does not give.
    Quota,
}

#[test]
fn a_peer_sending_bad_sparse_data_is_a_mismatch_naming_it() {
    use braid::compressed::sparse_model::Partition;
    const N: usize = 200;
    for lie in [Lie::Partition, Lie::Count, Lie::Indices, Lie::Quota] {
        let results = with_ranks_checked(2, false, move |c| {
            let cfg = CompressionConfig {
                sparse_path: braid::SparsePath::ReduceScatter,
                ..CompressionConfig::default()
            };
            // Top-k keeps 20: ten in each rank's half.
            let mut g: Vec<f32> = (0..N)
                .map(|i| if i % 100 < 10 { 5.0 } else { 0.1 })
                .collect();
            if c.rank() == 0 {
                let mut st = GradientCompressor::new(cfg, N).unwrap();
                let e = c
                    .all_reduce_compressed(&mut g, braid::ReduceOp::Sum, &mut st)
                    .unwrap_err();
                return e.to_string();
            }
            let fp = Partition::even(N, 2).fingerprint();
            let pairs = |first: u32| -> Vec<u8> {
                let mut b: Vec<u8> = (first..first + 10).flat_map(|i| i.to_le_bytes()).collect();
                b.extend((0..10).flat_map(|_| 5.0f32.to_le_bytes()));
                b
            };
            let mut counts = [0u64; 2];
            c.all_gather(&[20u64], &mut counts).unwrap();
            let route = match lie {
                Lie::Partition => [10, fp ^ 1, 10, fp ^ 1],
                Lie::Count => [30, fp, 10, fp],
                _ => [10, fp, 10, fp],
            };
            let mut heard = [0u64; 4];
            c.all_to_all(&route, &mut heard).unwrap();
            if matches!(lie, Lie::Indices | Lie::Quota) {
                let first = if matches!(lie, Lie::Indices) { 150 } else { 0 };
                let mut send = pairs(first);
                send.extend(pairs(100));
                let mut got = vec![0u8; 160];
                c.all_to_all_bytes(&send, &mut got, braid::DType::U8)
                    .unwrap();
            }
            if matches!(lie, Lie::Quota) {
                let mut all = [0u64; 18];
                let mut mine = [0u64; 9];
                mine[0] = 5;
                c.all_gather(&mine, &mut all).unwrap();
            }
            // Rank 0 found out and told everyone: the next call fails.
            match c.barrier() {
                Err(e) => format!("told: {e}"),
                Ok(()) => "not told".into(),
            }
        });
        let why = match lie {
            Lie::Partition => "cut the index space differently",
            Lie::Count => "rank 1 sends 30 pairs for range 0..100, but selected 20 in all",
            Lie::Indices => "index 150 (pair 0 of 10) is outside its range 0..100",
            Lie::Quota => {
                "rank 1 keeps 5 pairs of range 100..200 after receiving [0, 0, 0, 0, 0, 0, 0, 0]"
            }
        };
        assert!(
            results[0].contains("mismatch with rank 1") && results[0].contains(why),
            "{lie:?}: {}",
            results[0]
        );
        assert!(results[1].starts_with("told: "), "{lie:?}: {}", results[1]);
    }
}

#[test]
fn tiny_and_empty_tensors() {
    for n in [1, 3, 4] {
        let checks = with_ranks(n, |c| scenario::tiny_tensors(&c));
        assert!(
            checks.iter().all(|k| *k == 5 * scenario::cases().len()),
            "{checks:?}"
        );
    }
}

#[test]
fn bad_input_clipping_warnings_and_reset() {
    for n in [1, 2] {
        let checks = with_ranks(n, |c| scenario::bad_input_clip_warnings_reset(&c));
        assert!(checks.iter().all(|k| *k == 7), "{checks:?}");
    }
}

#[test]
fn all_to_all_on_threads() {
    for n in [1, 2, 3] {
        let checks = with_ranks(n, |c| scenario::all_to_all(&c));
        assert!(checks.iter().all(|k| *k == 7), "{checks:?}");
    }
}

#[test]
fn ranks_with_different_configurations_are_told_under_debug_checks() {
    let errs = with_ranks(2, |c| {
        let density = if c.rank() == 0 { 0.1 } else { 0.2 };
        let cfg = CompressionConfig {
            codec: CodecSpec::TopK { density },
            ..CompressionConfig::default()
        };
        let mut st = GradientCompressor::new(cfg, 100).unwrap();
        let mut g = vec![1.0f32; 100];
        let e = c
            .all_reduce_compressed(&mut g, braid::ReduceOp::Sum, &mut st)
            .unwrap_err();
        // The mismatch is sticky: the communicator says so, and the next call fails fast instead of
        // pairing with whatever the peer runs next.
        assert_eq!(c.async_error().as_ref(), Some(&e), "rank {}", c.rank());
        let later = c.all_reduce_in_place(&mut [1.0f32], braid::ReduceOp::Sum);
        assert!(matches!(later, Err(Error::Poisoned { .. })), "{later:?}");
        e
    });
    for (r, e) in errs.iter().enumerate() {
        assert!(
            matches!(e, Error::Mismatch { peer, .. } if *peer == 1 - r),
            "rank {r}: {e}"
        );
        assert!(e.to_string().contains("topk:"), "{e}");
    }
}

#[test]
fn codec_text_forms() {
    let ok = [
        ("none", CodecSpec::Dense),
        ("dense", CodecSpec::Dense),
        (" TopK:0.1 ", CodecSpec::TopK { density: 0.1 }),
        ("topk", CodecSpec::TopK { density: 0.1 }),
        (
            "threshold-topk:0.01",
            CodecSpec::ThresholdTopK { density: 0.01 },
        ),
        ("randomk:0.1", CodecSpec::RandomK { density: 0.1 }),
        (
            "int8",
            CodecSpec::Int8 {
                block: 256,
                stochastic: false,
            },
        ),
        (
            "int8:1024",
            CodecSpec::Int8 {
                block: 1024,
                stochastic: false,
            },
        ),
        (
            "int8-stochastic",
            CodecSpec::Int8 {
                block: 256,
                stochastic: true,
            },
        ),
        ("sign", CodecSpec::Sign { block: 256 }),
        ("sign:1024", CodecSpec::Sign { block: 1024 }),
        ("fp16", CodecSpec::Fp16),
        ("bf16", CodecSpec::Bf16),
        ("powersgd:4", CodecSpec::PowerSgd { rank: 4 }),
        (
            "mxfp8",
            CodecSpec::Mx {
                element: MxElement::E4M3,
            },
        ),
        (
            " MXFP8:E5M2 ",
            CodecSpec::Mx {
                element: MxElement::E5M2,
            },
        ),
        (
            "mxfp4",
            CodecSpec::Mx {
                element: MxElement::E2M1,
            },
        ),
        (
            "mxfp4:e2m1",
            CodecSpec::Mx {
                element: MxElement::E2M1,
            },
        ),
    ];
    for (text, want) in ok {
        assert_eq!(text.parse::<CodecSpec>().unwrap(), want, "{text}");
    }
    let bad = [
        ("topk:0", "density 0"),
        ("topk:1.5", "(0, 1]"),
        ("topk:abc", "\"abc\" is not a number"),
        ("randomk:nan", "(0, 1]"),
        ("int8:0", "block size"),
        ("sign:-3", "block size"),
        ("powersgd:0", "rank"),
        ("fp16:2", "takes no parameter"),
        ("mxfp8:e2m1", "mxfp8 elements are e4m3 or e5m2"),
        ("mxfp4:e4m3", "mxfp4 elements are e2m1"),
        ("zstd", "unknown codec"),
        ("", "unknown codec"),
    ];
    for (text, why) in bad {
        let e = text.parse::<CodecSpec>().unwrap_err();
        let m = e.to_string();
        assert!(e.is_invalid_argument(), "{text}: {m}");
        assert!(m.contains(&format!("{text:?}")), "{text}: {m}");
        assert!(m.contains(why), "{text}: {m}");
        assert!(
            m.contains("threshold-topk:D") && m.contains("powersgd:R"),
            "{m}"
        );
    }
}

fn specs() -> impl Strategy<Value = CodecSpec> {
    let density = prop_oneof![
        Just(1.0f32),
        Just(0.1f32),
        (1u32..=u32::MAX).prop_map(|b| (b as f64 / u32::MAX as f64) as f32)
    ]
    .prop_filter("in (0, 1]", |d| *d > 0.0 && *d <= 1.0);
    let block = prop_oneof![Just(1usize), Just(256), 1usize..=u32::MAX as usize];
    prop_oneof![
        Just(CodecSpec::Dense),
        density
            .clone()
            .prop_map(|density| CodecSpec::TopK { density }),
        density
            .clone()
            .prop_map(|density| CodecSpec::ThresholdTopK { density }),
        density.prop_map(|density| CodecSpec::RandomK { density }),
        (block.clone(), any::<bool>())
            .prop_map(|(block, stochastic)| CodecSpec::Int8 { block, stochastic }),
        block.prop_map(|block| CodecSpec::Sign { block }),
        Just(CodecSpec::Fp16),
        Just(CodecSpec::Bf16),
        prop::sample::select(MxElement::ALL.to_vec()).prop_map(|element| CodecSpec::Mx { element }),
        (1usize..=u32::MAX as usize).prop_map(|rank| CodecSpec::PowerSgd { rank }),
    ]
}

proptest! {
    #[test]
    fn codec_text_round_trips(spec in specs()) {
        let text = spec.to_string();
        prop_assert_eq!(text.parse::<CodecSpec>().unwrap(), spec);
        prop_assert!(spec.validate().is_ok());
    }
}

fn lookup<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| {
        pairs
            .iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    }
}

#[test]
fn long_codec_text_is_cut_in_errors() {
    let text = "x".repeat(20_000);
    let e = text.parse::<CodecSpec>().unwrap_err().to_string();
    let about_input = e.split("; accepted:").next().unwrap_or_default();
    assert!(
        about_input.len() < 200 && e.len() < 500,
        "{} bytes: {e}",
        e.len()
    );
    assert!(e.contains("20000 characters") && e.contains("…"), "{e}");
    let arg = format!("topk:{}", "9".repeat(5000));
    let e = arg.parse::<CodecSpec>().unwrap_err().to_string();
    assert!(e.len() < 700 && e.contains("5005 characters"), "{e}");
    let e = CompressionConfig::from_lookup(lookup(&[("BRAID_COMPRESS", &text)]))
        .unwrap_err()
        .to_string();
    assert!(
        e.len() < 700 && e.starts_with("invalid argument: BRAID_COMPRESS="),
        "{e}"
    );
}

#[test]
fn configuration_from_the_environment() {
    let d = CompressionConfig::from_lookup(lookup(&[])).unwrap();
    assert_eq!(d.codec, CodecSpec::TopK { density: 0.1 });
    assert!(d.error_feedback && d.decay.is_none() && d.clip_norm.is_none());
    assert_eq!(
        (d.dense_switch, d.seed, d.adaptive_optimizer),
        (0.5, 0, false)
    );
    assert_eq!(d.sparse_path, braid::SparsePath::AllGather);
    let c = CompressionConfig::from_lookup(lookup(&[
        ("BRAID_COMPRESS", "int8-stochastic:128"),
        ("BRAID_COMPRESS_EF", "0"),
        ("BRAID_COMPRESS_CLIP", "2.5"),
        ("BRAID_COMPRESS_DECAY", "0.9"),
        ("BRAID_COMPRESS_DENSE_SWITCH", "0.25"),
        ("BRAID_COMPRESS_SPARSE", "reduce-scatter"),
    ]))
    .unwrap();
    assert_eq!(c.sparse_path, braid::SparsePath::ReduceScatter);
    for (text, want) in [
        (" AllGather", braid::SparsePath::AllGather),
        ("rs", braid::SparsePath::ReduceScatter),
        ("auto", braid::SparsePath::Auto),
    ] {
        let c = CompressionConfig::from_lookup(lookup(&[("BRAID_COMPRESS_SPARSE", text)])).unwrap();
        assert_eq!(c.sparse_path, want, "{text}");
    }
    assert_eq!(
        c.codec,
        CodecSpec::Int8 {
            block: 128,
            stochastic: true
        }
    );
    assert!(!c.error_feedback);
    assert_eq!(
        (c.clip_norm, c.decay, c.dense_switch),
        (Some(2.5), Some(0.9), 0.25)
    );
    let c = CompressionConfig::from_lookup(lookup(&[("BRAID_COMPRESS_CLIP", "none")])).unwrap();
    assert_eq!(c.clip_norm, None);
    for (var, value) in [
        ("BRAID_COMPRESS", "topk:2"),
        ("BRAID_COMPRESS", "gzip"),
        ("BRAID_COMPRESS_EF", "maybe"),
        ("BRAID_COMPRESS_CLIP", "-1"),
        ("BRAID_COMPRESS_CLIP", "inf"),
        ("BRAID_COMPRESS_DECAY", "1.5"),
        ("BRAID_COMPRESS_DECAY", "x"),
        ("BRAID_COMPRESS_DENSE_SWITCH", "-0.1"),
        ("BRAID_COMPRESS_DENSE_SWITCH", "NaN"),
        ("BRAID_COMPRESS_SPARSE", "ring"),
    ] {
        let e = CompressionConfig::from_lookup(lookup(&[(var, value)])).unwrap_err();
        assert!(e.is_invalid_argument(), "{var}={value}: {e}");
        assert!(
            e.to_string().contains(&format!("{var}=")) && e.to_string().contains(value),
            "{var}={value}: {e}"
        );
    }
}

#[test]
fn invalid_configurations_are_refused_with_the_reason() {
    let base = CompressionConfig::default();
    let cases = [
        (
            CompressionConfig {
                codec: CodecSpec::TopK { density: 0.0 },
                ..base.clone()
            },
            "density 0",
        ),
        (
            CompressionConfig {
                codec: CodecSpec::RandomK { density: f32::NAN },
                ..base.clone()
            },
            "density NaN",
        ),
        (
            CompressionConfig {
                codec: CodecSpec::Sign { block: 0 },
                ..base.clone()
            },
            "block size 0",
        ),
        (
            CompressionConfig {
                codec: CodecSpec::PowerSgd { rank: 0 },
                ..base.clone()
            },
            "rank 0",
        ),
        (
            CompressionConfig {
                decay: Some(1.5),
                ..base.clone()
            },
            "decay 1.5",
        ),
        (
            CompressionConfig {
                clip_norm: Some(-1.0),
                ..base.clone()
            },
            "clip norm -1",
        ),
        (
            CompressionConfig {
                dense_switch: f64::NAN,
                ..base.clone()
            },
            "dense switch NaN",
        ),
    ];
    for (cfg, why) in cases {
        let e = GradientCompressor::new(cfg.clone(), 10).unwrap_err();
        assert!(
            e.is_invalid_argument() && e.to_string().contains(why),
            "{cfg:?}: {e}"
        );
    }
    let st = GradientCompressor::new(base.clone(), 10).unwrap();
    assert_eq!((st.len(), st.step()), (10, 0));
    assert_eq!(st.config().codec, base.codec);
    assert!(st.last_stats().is_none() && st.shard_error().is_empty());
}

#[test]
fn a_compressor_too_big_for_memory_is_an_error_not_an_abort() {
    // 2^40 elements (4 TiB of residual) is refused by the kernel unless it overcommits without limit;
    // then 2^45 (beyond the address space) is.
    let always = std::fs::read_to_string("/proc/sys/vm/overcommit_memory")
        .map(|s| s.trim() == "1")
        .unwrap_or(false);
    let len = if always { 1usize << 45 } else { 1usize << 40 };
    let cfg = CompressionConfig {
        codec: "int8".parse().unwrap(),
        ..CompressionConfig::default()
    };
    let e = GradientCompressor::new(cfg, len).unwrap_err();
    assert!(
        matches!(&e, braid::Error::OutOfMemory(m) if m.contains("error-feedback")),
        "{e}"
    );
}

#[test]
fn momentum_correction_warm_up_global_clipping_and_adam_safe_compression() {
    for n in [1, 2, 3] {
        let checks = with_ranks(n, |c| scenario::modes(&c));
        assert!(checks.iter().all(|k| *k == 29), "{checks:?}");
    }
}

#[test]
fn the_learning_rate_rescales_the_error_buffers() {
    for n in [1, 2, 3] {
        let checks = with_ranks(n, |c| scenario::learning_rate(&c));
        assert!(checks.iter().all(|k| *k == 11), "{checks:?}");
    }
}
