//! Round-trip bounds, statistical properties and determinism of every codec.

mod common;

use braid_compress::power_sgd::{matrix_shape, orthogonalize};
use braid_compress::rng::{Stream, TAG_RANDOM_K};
use braid_compress::{
    k_for_density, random_k_indices, Cast, Codec, Compressed, Error, Int8, Payload, PowerSgd,
    RandomK, Sign, ThresholdTopK, TopK, Transport,
};
use common::{all_codecs, grad, orthonormal};
use proptest::prelude::*;

/// Indices of the k largest |x|, ties to the lower index, by sorting.
fn top_k_oracle(x: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..x.len() as u32).collect();
    idx.sort_by(|&a, &b| {
        x[b as usize]
            .abs()
            .total_cmp(&x[a as usize].abs())
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

fn sparse(c: &Compressed) -> (&[u32], &[f32]) {
    match c.payload() {
        Payload::Sparse { indices, values } => (indices, values),
        p => panic!("expected a sparse payload, got {}", p.kind_name()),
    }
}

proptest! {
    #[test]
    fn top_k_keeps_exactly_the_k_largest(
        x in prop::collection::vec(-8i32..=8, 0..400),
        density in 0.001f32..=1.0,
    ) {
        // Small integers: many ties, so the tie rule is exercised.
        let x: Vec<f32> = x.into_iter().map(|v| v as f32 * 0.5).collect();
        let c = TopK::new(density).unwrap().compress(&x, 0);
        let k = k_for_density(x.len(), density);
        let (indices, values) = sparse(&c);
        prop_assert_eq!(indices, &top_k_oracle(&x, k)[..]);
        for (&i, &v) in indices.iter().zip(values) {
            prop_assert_eq!(v.to_bits(), x[i as usize].to_bits());
        }
        let dense = c.to_dense();
        for (i, (&d, &v)) in dense.iter().zip(&x).enumerate() {
            prop_assert!(d == 0.0 || d == v, "element {}", i);
        }
    }

    #[test]
    fn int8_nearest_error_is_at_most_half_a_scale(
        x in prop::collection::vec(-1e3f32..1e3, 1..600),
        block in 1usize..300,
        tiny in any::<bool>(),
    ) {
        let x: Vec<f32> = if tiny { x.iter().map(|v| v * 1e-30).collect() } else { x };
        let c = Int8::new(block).unwrap().compress(&x, 0);
        let Payload::Int8 { scales, .. } = c.payload() else { panic!("not int8") };
        prop_assert_eq!(scales.len(), x.len().div_ceil(block));
        let y = c.to_dense();
        for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
            let s = scales[i / block];
            let m = x[(i / block) * block..((i / block + 1) * block).min(x.len())].iter().fold(0f32, |m, v| m.max(v.abs()));
            prop_assert_eq!(s, m / 127.0);
            prop_assert!((a - b).abs() <= s * (0.5 + 1e-5), "element {}: {} vs {} (scale {})", i, a, b, s);
        }
    }

    #[test]
    fn int8_stochastic_error_is_below_one_scale(x in prop::collection::vec(-1e3f32..1e3, 1..600), seed in any::<u64>()) {
        let c = Int8::stochastic(64, seed).unwrap().compress(&x, 3);
        let Payload::Int8 { scales, .. } = c.payload() else { panic!("not int8") };
        for (i, (&a, &b)) in x.iter().zip(&c.to_dense()).enumerate() {
            prop_assert!((a - b).abs() <= scales[i / 64] * (1.0 + 1e-5), "element {}", i);
        }
    }

    #[test]
    fn sign_reconstructs_sign_times_block_mean_magnitude(
        x in prop::collection::vec(-1e3f32..1e3, 0..600),
        block in 1usize..100,
    ) {
        let c = Sign::new(block).unwrap().compress(&x, 0);
        let y = c.to_dense();
        for (b, (xb, yb)) in x.chunks(block).zip(y.chunks(block)).enumerate() {
            let scale = (xb.iter().map(|v| v.abs() as f64).sum::<f64>() / xb.len() as f64) as f32;
            for (j, (&a, &r)) in xb.iter().zip(yb).enumerate() {
                let want = if a < 0.0 { -scale } else { scale };
                prop_assert_eq!(r.to_bits(), want.to_bits(), "block {} element {}", b, j);
            }
        }
    }

    #[test]
    fn casts_are_round_to_nearest_even(x in prop::collection::vec(any::<f32>(), 0..300)) {
        let h = Cast::F16.compress(&x, 0).to_dense();
        let b = Cast::Bf16.compress(&x, 0).to_dense();
        for i in 0..x.len() {
            let (hv, bv) = (half::f16::from_f32(x[i]).to_f32(), half::bf16::from_f32(x[i]).to_f32());
            prop_assert!(h[i].to_bits() == hv.to_bits() || (h[i].is_nan() && hv.is_nan()), "f16 element {}", i);
            prop_assert!(b[i].to_bits() == bv.to_bits() || (b[i].is_nan() && bv.is_nan()), "bf16 element {}", i);
        }
    }

    #[test]
    fn casts_stay_within_their_rounding(x in prop::collection::vec(prop_oneof![6.2e-5f32..65000.0, -65000.0f32..-6.2e-5], 1..300)) {
        let h = Cast::F16.compress(&x, 0).to_dense();
        let b = Cast::Bf16.compress(&x, 0).to_dense();
        for i in 0..x.len() {
            prop_assert!((x[i] - h[i]).abs() <= x[i].abs() * 2f32.powi(-11), "f16 element {}", i);
            prop_assert!((x[i] - b[i]).abs() <= x[i].abs() * 2f32.powi(-8), "bf16 element {}", i);
        }
    }

    #[test]
    fn random_k_indices_are_the_k_smallest_keys(seed in any::<u64>(), step in 0u64..1000, len in 0usize..3000, frac in 0.0f64..=1.0) {
        let k = (frac * len as f64) as usize;
        let got = random_k_indices(seed, step, len, k);
        let s = Stream::new(seed, TAG_RANDOM_K, step);
        let mut all: Vec<(u64, u32)> = (0..len as u32).map(|i| (s.u64_at(i as u64), i)).collect();
        all.sort_unstable();
        let mut want: Vec<u32> = all[..k].iter().map(|p| p.1).collect();
        want.sort_unstable();
        prop_assert_eq!(got, want);
    }

    #[test]
    fn power_sgd_is_exact_for_rank_r_matrices(rows in 1usize..40, cols in 1usize..40, r in 1usize..5, seed in any::<u64>()) {
        // M = A·diag(σ)·Bᵀ with orthonormal A, B and σ from 1 down to 0.4: rank r, well conditioned.
        let r = r.min(rows).min(cols);
        let a = orthonormal(seed, rows, r);
        let b = orthonormal(seed ^ 1, cols, r);
        let sigma = |c: usize| 1.0 - 0.6 * c as f32 / 4.0;
        let m: Vec<f32> = (0..rows * cols)
            .map(|e| (0..r).map(|c| a[(e / cols) * r + c] * sigma(c) * b[(e % cols) * r + c]).sum())
            .collect();
        let scale = m.iter().fold(0f32, |s, v| s.max(v.abs()));
        let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let mut codec = PowerSgd::new(r, 7).unwrap().with_cols(cols).unwrap();
        // The first step starts from a random Q: exact in exact arithmetic, but f32 rounding is amplified
        // by the conditioning of Bᵀ·Q, which a random Q occasionally makes poor. It is a projection, so it
        // never exceeds M.
        let y0 = codec.compress(&m, 0).to_dense();
        let e0: Vec<f32> = m.iter().zip(&y0).map(|(p, q)| p - q).collect();
        prop_assert!(norm(&e0) <= norm(&m) * (1.0 + 1e-5));
        // From the second step the warm-started Q spans M's row space: exact to f32 rounding.
        for step in 1..3 {
            let y = codec.compress(&m, step).to_dense();
            for (i, (&p, &q)) in m.iter().zip(&y).enumerate() {
                prop_assert!((p - q).abs() <= 1e-5 * scale, "step {} element {}: {} vs {}", step, i, p, q);
            }
        }
    }
}

#[test]
fn top_k_defaults_to_ten_percent_and_sends_nan() {
    assert_eq!(TopK::default().density(), 0.1);
    let mut x = grad(1, 1000);
    x[500] = f32::NAN;
    let c = TopK::default().compress(&x, 0);
    let (indices, _) = sparse(&c);
    assert_eq!(indices.len(), 100);
    assert!(
        indices.contains(&500),
        "NaN ranks above every finite magnitude"
    );
    assert_eq!(TopK::default().compress(&[], 0).len(), 0);
    assert_eq!(
        sparse(&TopK::new(1e-9).unwrap().compress(&[0.0, -0.0, 0.0], 0)).0,
        &[0]
    );
}

#[test]
fn threshold_top_k_reports_the_density_it_achieves() {
    let x = grad(2, 200_000);
    let mut codec = ThresholdTopK::new(0.01, 9).unwrap();
    let c = codec.compress(&x, 5);
    let (indices, _) = sparse(&c);
    let density = indices.len() as f64 / x.len() as f64;
    assert!(
        (0.005..=0.02).contains(&density),
        "achieved density {density}"
    );
    // A threshold: everything sent is at least as large as everything dropped.
    let sent_min = indices
        .iter()
        .map(|&i| x[i as usize].abs())
        .fold(f32::INFINITY, f32::min);
    let mut kept = vec![false; x.len()];
    indices.iter().for_each(|&i| kept[i as usize] = true);
    let dropped_max = x
        .iter()
        .zip(&kept)
        .filter(|p| !*p.1)
        .map(|p| p.0.abs())
        .fold(0.0, f32::max);
    assert!(sent_min > dropped_max);
    // The same seed and step give the same bytes; another seed samples differently.
    assert_eq!(
        c.encode(),
        ThresholdTopK::new(0.01, 9)
            .unwrap()
            .compress(&x, 5)
            .encode()
    );
    assert_ne!(
        c.encode(),
        ThresholdTopK::new(0.01, 10)
            .unwrap()
            .compress(&x, 5)
            .encode()
    );
    let mut ef = braid_compress::ErrorFeedback::disabled(x.len());
    let (_, stats) = ef.step(&x, &mut codec, 5).unwrap();
    assert_eq!(stats.density, density);
}

#[test]
fn threshold_top_k_falls_back_to_exact_selection_on_overshoot() {
    // All magnitudes equal: the threshold passes everything, far above the target.
    let x: Vec<f32> = (0..5000)
        .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    let c = ThresholdTopK::new(0.1, 1).unwrap().compress(&x, 0);
    assert_eq!(c, TopK::new(0.1).unwrap().compress(&x, 0));
    // A tensor smaller than the minimum sample is its own sample: exact top-k when there are no ties.
    let y = grad(3, 500);
    assert_eq!(
        ThresholdTopK::new(0.1, 1).unwrap().compress(&y, 0),
        TopK::new(0.1).unwrap().compress(&y, 0)
    );
}

#[test]
fn random_k_depends_only_on_seed_step_len_and_k() {
    let a = random_k_indices(11, 4, 10_000, 1000);
    assert_eq!(a.len(), 1000);
    assert!(a.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(a, random_k_indices(11, 4, 10_000, 1000));
    assert_ne!(a, random_k_indices(11, 5, 10_000, 1000));
    assert_ne!(a, random_k_indices(12, 4, 10_000, 1000));
    // The values do not matter, only the shape.
    let x = grad(4, 10_000);
    let y = grad(5, 10_000);
    let cx = RandomK::new(0.1, 11).unwrap().compress(&x, 4);
    let cy = RandomK::new(0.1, 11).unwrap().compress(&y, 4);
    let support = |c: &Compressed| c.to_dense().iter().map(|v| *v != 0.0).collect::<Vec<_>>();
    assert_eq!(support(&cx), support(&cy));
}

#[test]
fn random_k_is_sum_closed() {
    let ranks: Vec<Vec<f32>> = (0..4).map(|r| grad(100 + r, 5000)).collect();
    let sum: Vec<f32> = (0..5000)
        .map(|i| ranks.iter().fold(0.0, |s, g| s + g[i]))
        .collect();
    let mut codec = RandomK::new(0.05, 77).unwrap();
    let parts: Vec<Compressed> = ranks.iter().map(|g| codec.compress(g, 9)).collect();
    let total = parts[1..]
        .iter()
        .fold(parts[0].clone(), |acc, c| acc.try_add(c).unwrap());
    assert_eq!(
        total,
        codec.compress(&sum, 9),
        "sum of compressed == compressed sum, bit for bit"
    );

    let mut unbiased = RandomK::new(0.05, 77).unwrap().unbiased();
    let parts: Vec<Compressed> = ranks.iter().map(|g| unbiased.compress(g, 9)).collect();
    let total = parts[1..]
        .iter()
        .fold(parts[0].clone(), |acc, c| acc.try_add(c).unwrap())
        .to_dense();
    let direct = unbiased.compress(&sum, 9).to_dense();
    for (a, b) in total.iter().zip(&direct) {
        assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0));
    }
    assert_eq!(unbiased.transport(), Transport::SumClosed);
}

/// Mean of `draws` decompressions of `x` at steps `0..draws`.
fn mean_over_steps(codec: &mut dyn Codec, x: &[f32], draws: u64) -> Vec<f64> {
    let mut mean = vec![0f64; x.len()];
    for step in 0..draws {
        for (m, v) in mean.iter_mut().zip(codec.compress(x, step).to_dense()) {
            *m += v as f64;
        }
    }
    mean.iter().map(|m| m / draws as f64).collect()
}

#[test]
fn int8_stochastic_rounding_is_unbiased() {
    let x = grad(6, 64);
    let n = 4000;
    let mut codec = Int8::stochastic(64, 1234).unwrap();
    let scale = x.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0;
    let mean = mean_over_steps(&mut codec, &x, n);
    for (i, (&m, &v)) in mean.iter().zip(&x).enumerate() {
        // One draw's variance is scale²·f(1−f) ≤ scale²/4.
        let se = scale / 2.0 / (n as f64).sqrt();
        assert!(
            (m - v as f64).abs() <= 5.0 * se + 1e-6 * scale,
            "element {i}: mean {m}, value {v}, se {se}"
        );
    }
    // Round to nearest, by contrast, is deterministic: its mean is a single rounding.
    let nearest = Int8::new(64).unwrap().compress(&x, 0).to_dense();
    assert!(nearest.iter().zip(&x).any(|(a, b)| a != b));
}

#[test]
fn unbiased_random_k_is_unbiased() {
    let x = grad(7, 64);
    let n = 8000;
    let mut codec = RandomK::new(0.125, 99).unwrap().unbiased();
    let mean = mean_over_steps(&mut codec, &x, n);
    for (i, (&m, &v)) in mean.iter().zip(&x).enumerate() {
        // Each draw is v·8 with probability 1/8, else 0: variance v²·7.
        let se = (v as f64).abs() * 7f64.sqrt() / (n as f64).sqrt();
        assert!(
            (m - v as f64).abs() <= 5.0 * se + 1e-6,
            "element {i}: mean {m}, value {v}, se {se}"
        );
    }
}

#[test]
fn power_sgd_warm_start_converges_on_a_fixed_gradient() {
    // Decaying spectrum: repeated steps on the same matrix are subspace iteration, so the warm-started
    // approximation improves while the cold one does not.
    let (rows, cols) = (48, 32);
    let mut m = vec![0f32; rows * cols];
    for c in 0..8 {
        let a = grad(20 + c, rows);
        let b = grad(40 + c, cols);
        let w = 0.5f32.powi(c as i32);
        for i in 0..rows {
            for j in 0..cols {
                m[i * cols + j] += w * a[i] * b[j];
            }
        }
    }
    let err = |y: &[f32]| {
        m.iter()
            .zip(y)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    let mut warm = PowerSgd::new(2, 1).unwrap().with_cols(cols).unwrap();
    let mut cold = PowerSgd::new(2, 1)
        .unwrap()
        .with_cols(cols)
        .unwrap()
        .without_warm_start();
    let first = err(&warm.compress(&m, 0).to_dense());
    let mut last = first;
    for step in 1..10 {
        last = err(&warm.compress(&m, step).to_dense());
    }
    assert!(last < 0.9 * first, "warm start: {first} → {last}");
    assert_eq!(
        cold.compress(&m, 3),
        cold.compress(&m, 3),
        "cold start depends only on the step"
    );
    warm.reset();
    assert_eq!(
        warm.compress(&m, 0),
        PowerSgd::new(2, 1)
            .unwrap()
            .with_cols(cols)
            .unwrap()
            .compress(&m, 0)
    );
}

#[test]
fn power_sgd_pads_the_last_row_and_orthonormalises_p() {
    let x = grad(8, 1001);
    let codec = PowerSgd::new(4, 3).unwrap();
    assert_eq!(codec.shape(1001), (32, 32, 4));
    assert_eq!(matrix_shape(1024, None, 4), (32, 32, 4));
    assert_eq!(matrix_shape(5, Some(100), 9), (1, 5, 1));
    assert_eq!(matrix_shape(0, None, 4), (0, 1, 0));
    let c = PowerSgd::new(4, 3).unwrap().compress(&x, 0);
    let Payload::LowRank {
        rows,
        cols,
        rank,
        p,
        ..
    } = c.payload()
    else {
        panic!("not low-rank")
    };
    assert_eq!((*rows, *cols, *rank), (32, 32, 4));
    for a in 0..4 {
        for b in 0..4 {
            let dot: f32 = p.chunks(4).map(|r| r[a] * r[b]).sum();
            assert!(
                (dot - if a == b { 1.0 } else { 0.0 }).abs() < 1e-5,
                "P columns {a}, {b}: {dot}"
            );
        }
    }
    assert_eq!(c.to_dense().len(), 1001);
    // A well-started rank-2 matrix is exact from the first step.
    let (a, b) = (orthonormal(1, 30, 2), orthonormal(2, 20, 2));
    let m: Vec<f32> = (0..600)
        .map(|e| {
            a[(e / 20) * 2] * b[(e % 20) * 2] + 0.5 * a[(e / 20) * 2 + 1] * b[(e % 20) * 2 + 1]
        })
        .collect();
    let y = PowerSgd::new(2, 0)
        .unwrap()
        .with_cols(20)
        .unwrap()
        .compress(&m, 0)
        .to_dense();
    assert!(
        m.iter().zip(&y).all(|(p, q)| (p - q).abs() < 1e-6),
        "rank-2 matrix from step 0"
    );
    // A zero column stays zero instead of becoming NaN.
    let mut z = vec![0.0, 1.0, 0.0, 2.0];
    orthogonalize(&mut z, 2, 0.0);
    assert_eq!(z, [0.0, 0.4472136, 0.0, 0.8944272]);
    assert!(PowerSgd::new(2, 0)
        .unwrap()
        .compress(&[0.0; 50], 0)
        .to_dense()
        .iter()
        .all(|v| *v == 0.0));
}

#[test]
fn every_codec_is_deterministic_and_seeded() {
    let x = grad(9, 3000);
    let once: Vec<Vec<u8>> = all_codecs(5)
        .iter_mut()
        .map(|c| c.compress(&x, 17).encode())
        .collect();
    let twice: Vec<Vec<u8>> = all_codecs(5)
        .iter_mut()
        .map(|c| c.compress(&x, 17).encode())
        .collect();
    assert_eq!(once, twice);
    let other: Vec<Vec<u8>> = all_codecs(6)
        .iter_mut()
        .map(|c| c.compress(&x, 17).encode())
        .collect();
    for ((a, b), codec) in once.iter().zip(&other).zip(all_codecs(5)) {
        let seeded = ["threshold", "random-k", "stochastic", "power-sgd"]
            .iter()
            .any(|s| codec.name().contains(s));
        assert_eq!(a != b, seeded, "{}", codec.name());
    }
}

#[test]
fn every_codec_round_trips_through_bytes_and_names_its_transport() {
    let x = grad(10, 777);
    for mut codec in all_codecs(1) {
        let c = codec.compress(&x, 2);
        assert_eq!(c.len(), x.len(), "{}", codec.name());
        let bytes = c.encode();
        assert_eq!(bytes.len(), c.wire_bytes(), "{}", codec.name());
        let d = Compressed::decode(&bytes).unwrap();
        assert_eq!(d.encode(), bytes, "{}", codec.name());
        let mut out = vec![f32::NAN; x.len()];
        codec.decompress(&d, &mut out).unwrap();
        assert_eq!(out, c.to_dense(), "{}", codec.name());
        let want = match codec.name().split('(').next().unwrap() {
            "fp16" | "bf16" | "random-k" => Transport::SumClosed,
            "power-sgd" => Transport::PowerIteration,
            _ => Transport::Gather,
        };
        assert_eq!(codec.transport(), want, "{}", codec.name());
        // Empty tensors are fine everywhere.
        let e = codec.compress(&[], 0);
        assert_eq!(
            Compressed::decode(&e.encode()).unwrap(),
            e,
            "{}",
            codec.name()
        );
    }
}

#[test]
fn invalid_parameters_are_named() {
    let msg = |e: Error| e.to_string();
    assert!(msg(TopK::new(0.0).unwrap_err()).contains("top-k density must be in (0, 1], got 0"));
    assert!(msg(TopK::new(1.5).unwrap_err()).contains("got 1.5"));
    assert!(msg(RandomK::new(f32::NAN, 0).unwrap_err()).contains("random-k density"));
    assert!(msg(Int8::new(0).unwrap_err()).contains("int8 block size"));
    assert!(msg(Sign::new(usize::MAX).unwrap_err()).contains("sign block size"));
    assert!(msg(PowerSgd::new(0, 0).unwrap_err()).contains("PowerSGD rank"));
    assert!(msg(PowerSgd::new(1, 0).unwrap().with_cols(0).unwrap_err()).contains("PowerSGD cols"));
    assert!(msg(ThresholdTopK::new(0.1, 0)
        .unwrap()
        .with_sample(0.0, 1)
        .unwrap_err())
    .contains("sample fraction"));
    assert!(msg(ThresholdTopK::new(0.1, 0)
        .unwrap()
        .with_max_overshoot(0.5)
        .unwrap_err())
    .contains("overshoot"));
}
