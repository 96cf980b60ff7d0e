//! Error feedback, statistics, staleness and warnings.

mod common;

use braid_compress::{
    l2_norm, warnings, Codec, ErrorFeedback, Int8, RandomK, Sign, Staleness, StalenessHistogram,
    TopK,
};
use common::{all_codecs, grad};
use proptest::prelude::*;

/// Runs `steps` steps and checks Σ updates + final error == Σ gradients.
fn check_telescoping(codec: &mut dyn Codec, len: usize, steps: u64, seed: u64) {
    let mut ef = ErrorFeedback::new(len);
    let mut sent = vec![0f64; len];
    let mut given = vec![0f64; len];
    let mut scale = 0f64;
    for step in 0..steps {
        let g = grad(seed + step, len);
        let (c, _) = ef.step(&g, codec, step).unwrap();
        for (i, v) in c.to_dense().into_iter().enumerate() {
            sent[i] += v as f64;
            given[i] += g[i] as f64;
            scale = scale.max(g[i].abs() as f64);
        }
    }
    for i in 0..len {
        let lhs = sent[i] + ef.error[i] as f64;
        // Each step rounds the residual and the new error once in f32.
        let tol = 4.0 * steps as f64 * f32::EPSILON as f64 * (scale * steps as f64);
        assert!(
            (lhs - given[i]).abs() <= tol,
            "{}: element {i}: {lhs} vs {}",
            codec.name(),
            given[i]
        );
    }
}

#[test]
fn error_feedback_telescopes_for_every_codec() {
    for mut codec in all_codecs(4) {
        check_telescoping(codec.as_mut(), 600, 12, 1);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn error_feedback_telescopes_for_any_top_k(len in 1usize..500, density in 0.001f32..=1.0, seed in any::<u64>()) {
        check_telescoping(&mut TopK::new(density).unwrap(), len, 8, seed);
    }
}

#[test]
fn clipping_happens_before_the_error_is_added() {
    let mut ef = ErrorFeedback::new(4).with_clip(1.0).unwrap();
    ef.error = vec![5.0, 0.0, 0.0, 0.0];
    let g = [0.0, 6.0, 8.0, 0.0]; // norm 10
    let (_, stats) = ef.step(&g, &mut TopK::new(0.25).unwrap(), 0).unwrap();
    assert_eq!(
        stats.grad_norm, 10.0,
        "the norm reported is the raw gradient's"
    );
    assert_eq!(stats.clip_scale, 0.1);
    // residual = clip(g) + error = [5, 0.6, 0.8, 0], not clip(g + error).
    assert!((stats.residual_norm - (25.0f64 + 0.36 + 0.64).sqrt()).abs() < 1e-6);
    assert_eq!(ef.last_update(), [5.0, 0.0, 0.0, 0.0]);
    assert!((ef.error[1] - 0.6).abs() < 1e-7 && (ef.error[2] - 0.8).abs() < 1e-7);
    // Below the bound nothing is scaled.
    let (_, stats) = ef
        .step(&[0.1, 0.0, 0.0, 0.0], &mut TopK::default(), 1)
        .unwrap();
    assert_eq!(stats.clip_scale, 1.0);
}

#[test]
fn decay_weights_the_error_and_zero_turns_feedback_off() {
    let g = [3.0, 1.0];
    let mut half = ErrorFeedback::new(2).with_decay(0.5).unwrap();
    half.step(&g, &mut TopK::new(0.5).unwrap(), 0).unwrap();
    assert_eq!(half.error, [0.0, 1.0]);
    half.step(&g, &mut TopK::new(0.5).unwrap(), 1).unwrap();
    assert_eq!(half.error, [0.0, 1.5], "residual [3, 1 + 0.5·1]");

    let mut off = ErrorFeedback::disabled(2);
    for step in 0..3 {
        let (_, stats) = off.step(&g, &mut TopK::new(0.5).unwrap(), step).unwrap();
        assert_eq!(
            stats.residual_norm,
            l2_norm(&g),
            "the error is never added back"
        );
    }
    assert_eq!(
        off.staleness().counts(),
        [0, 3],
        "without feedback the small element never moves"
    );
    assert!(ErrorFeedback::new(1).with_decay(1.5).is_err());
    assert!(ErrorFeedback::new(1).with_clip(0.0).is_err());
}

#[test]
fn stats_report_norm_error_density_and_bytes() {
    let g = grad(3, 10_000);
    let mut ef = ErrorFeedback::new(g.len());
    let (c, stats) = ef.step(&g, &mut TopK::default(), 0).unwrap();
    assert_eq!(stats.len, 10_000);
    assert_eq!(stats.grad_norm, l2_norm(&g));
    assert_eq!(
        stats.residual_norm,
        l2_norm(&g),
        "first step: the error is zero"
    );
    assert_eq!(stats.density, 0.1);
    assert_eq!(stats.wire_bytes, c.encode().len());
    assert_eq!(stats.wire_bytes, 12 + 4 + 8 * 1000);
    assert_eq!(stats.dense_bytes, 40_000);
    assert!((stats.compression_ratio() - 40_000.0 / 8016.0).abs() < 1e-12);
    let dropped: Vec<f32> = g.iter().zip(&c.to_dense()).map(|(a, b)| a - b).collect();
    assert!((stats.compression_error - l2_norm(&dropped) / l2_norm(&g)).abs() < 1e-12);
    assert!(stats.compression_error > 0.0 && stats.compression_error < 1.0);

    // Int8 sends almost everything with a small error.
    let (_, stats) = ErrorFeedback::new(g.len())
        .step(&g, &mut Int8::default(), 0)
        .unwrap();
    assert!(
        stats.compression_error < 0.05,
        "{}",
        stats.compression_error
    );
    assert!(stats.density > 0.5);
    // An all-zero gradient: no error, nothing updated.
    let (_, stats) = ErrorFeedback::new(8)
        .step(&[0.0; 8], &mut Sign::default(), 0)
        .unwrap();
    assert_eq!((stats.compression_error, stats.density), (0.0, 0.0));
}

#[test]
fn staleness_counts_steps_without_an_update() {
    // One large element and many small ones: with error feedback the small ones accumulate error until
    // they are sent, so staleness stays bounded; the histogram shows how long they waited.
    let mut g = vec![0.01f32; 100];
    g[0] = 100.0;
    let mut ef = ErrorFeedback::new(100);
    let mut codec = TopK::new(0.05).unwrap();
    let mut last = None;
    for step in 0..40 {
        let (_, stats) = ef.step(&g, &mut codec, step).unwrap();
        assert_eq!(stats.staleness.buckets.iter().sum::<u64>(), 100);
        assert_eq!(stats.staleness.buckets[0], 5);
        last = Some(stats);
    }
    let h = last.unwrap().staleness;
    assert_eq!(h, ef.staleness().histogram());
    assert!(h.max >= 8 && h.max < 40, "max staleness {}", h.max);
    assert_eq!(
        ef.staleness().counts()[0],
        0,
        "the large element is sent every step"
    );

    assert_eq!(StalenessHistogram::bucket_of(0), 0);
    assert_eq!(StalenessHistogram::bucket_of(1), 1);
    assert_eq!(StalenessHistogram::bucket_of(3), 2);
    assert_eq!(StalenessHistogram::bucket_of(4), 3);
    assert_eq!(StalenessHistogram::bucket_of(7), 3);
    assert_eq!(StalenessHistogram::bucket_of(u32::MAX), 32);
    assert_eq!(StalenessHistogram::bucket_range(0), (0, 0));
    assert_eq!(StalenessHistogram::bucket_range(3), (4, 7));
    assert_eq!(StalenessHistogram::bucket_range(32), (1 << 31, u32::MAX));

    let mut s = Staleness::new(3);
    s.observe(&[1.0, 0.0, f32::NAN]).unwrap();
    let h = s.observe(&[0.0, 0.0, 1.0]).unwrap();
    assert_eq!(s.counts(), [1, 2, 0]);
    assert_eq!(&h.buckets[..3], [1, 1, 1]);
    assert_eq!(h.at_least(1), 2);
    assert_eq!(h.at_least(2), 1);
    assert!(s
        .observe(&[0.0])
        .unwrap_err()
        .to_string()
        .contains("update has 1 elements, expected 3"));
}

#[test]
fn reset_forgets_error_and_staleness() {
    let g = grad(5, 100);
    let mut ef = ErrorFeedback::new(100);
    let mut codec = RandomK::new(0.1, 1).unwrap();
    ef.step(&g, &mut codec, 0).unwrap();
    assert!(ef.error.iter().any(|e| *e != 0.0));
    ef.reset();
    assert!(ef.error.iter().all(|e| *e == 0.0));
    assert!(ef.staleness().counts().iter().all(|c| *c == 0));
    assert!(ef.last_update().iter().all(|c| *c == 0.0));
    // After a reset the next step is the same as a fresh buffer's.
    let (a, _) = ef.step(&g, &mut codec, 1).unwrap();
    let (b, _) = ErrorFeedback::new(100).step(&g, &mut codec, 1).unwrap();
    assert_eq!(a, b);
}

#[test]
fn a_second_buffer_serves_two_phase_all_reduce() {
    // Phase 1: each of 4 ranks compresses its gradient with its own buffer; phase 2: the owner of a chunk
    // reduces the decompressed parts in f32 and re-compresses the sum with a second buffer of the chunk's
    // length. Both phases keep the telescoping identity.
    let (ranks, len, chunk) = (4, 400, 100..200);
    let mut first: Vec<ErrorFeedback> = (0..ranks).map(|_| ErrorFeedback::new(len)).collect();
    let mut second = ErrorFeedback::new(chunk.len());
    let mut codec = TopK::new(0.2).unwrap();
    let (mut given, mut sent) = (vec![0f64; chunk.len()], vec![0f64; chunk.len()]);
    for step in 0..10 {
        let mut reduced = vec![0f32; chunk.len()];
        for (r, ef) in first.iter_mut().enumerate() {
            let g = grad(1000 * r as u64 + step, len);
            let (c, _) = ef.step(&g, &mut codec, step).unwrap();
            let d = c.to_dense();
            for (j, i) in chunk.clone().enumerate() {
                reduced[j] += d[i];
                given[j] += d[i] as f64;
            }
        }
        let (c, _) = second.step(&reduced, &mut codec, step).unwrap();
        c.to_dense()
            .iter()
            .enumerate()
            .for_each(|(j, v)| sent[j] += *v as f64);
    }
    for j in 0..chunk.len() {
        assert!(
            (sent[j] + second.error[j] as f64 - given[j]).abs() < 1e-3,
            "element {j}"
        );
    }
}

#[test]
fn step_rejects_a_gradient_of_the_wrong_length() {
    let mut ef = ErrorFeedback::new(3);
    let e = ef.step(&[1.0; 4], &mut TopK::default(), 0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "length mismatch: gradient has 4 elements, expected 3"
    );
    assert_eq!(ef.error, [0.0; 3], "nothing changed");
}

#[test]
fn the_adam_warning_fires_below_one_percent() {
    assert!(
        warnings(0.1, true).is_empty(),
        "the default density is quiet"
    );
    assert!(
        warnings(0.01, true).is_empty(),
        "exactly 1% is not below 1%"
    );
    let w = warnings(0.005, true);
    assert_eq!(w.len(), 1);
    assert!(
        w[0].contains("0.500%")
            && w[0].contains("adaptive optimizer")
            && w[0].contains("second-moment")
    );
    assert!(
        warnings(0.005, false).is_empty(),
        "plain SGD is not warned at 0.5%"
    );
    let w = warnings(0.0001, false);
    assert_eq!(w.len(), 1);
    assert!(w[0].contains("lag") && w[0].contains("downstream"));
    assert_eq!(warnings(0.0001, true).len(), 2);

    // From a real step.
    let g = grad(8, 10_000);
    let (_, stats) = ErrorFeedback::new(g.len())
        .step(&g, &mut TopK::new(0.005).unwrap(), 0)
        .unwrap();
    assert_eq!(stats.density, 0.005);
    assert_eq!(stats.warnings(true).len(), 1);
    assert!(stats.warnings(false).is_empty());
}

// Momentum correction (DGC): the velocity lives in the error feedback; the caller runs plain SGD.

#[test]
fn masked_momentum_correction_with_every_coordinate_sent_is_plain_sgd() {
    // Masking clears the velocity wherever it sends, so sending everything sends the gradient itself:
    // the momentum lives only in coordinates that wait between sends.
    let mut ef = ErrorFeedback::new(3)
        .with_momentum(0.9)
        .unwrap()
        .with_masking(true);
    let mut all = TopK::new(1.0).unwrap();
    for (step, g) in [[1.0, -2.0, 0.5], [0.5, 0.5, -1.0]].iter().enumerate() {
        let (c, _) = ef.step(g, &mut all, step as u64).unwrap();
        assert_eq!(c.to_dense(), g.to_vec());
        assert!(ef.velocity().iter().chain(&ef.error).all(|x| *x == 0.0));
    }
}

#[test]
fn masked_momentum_correction_loses_nothing_sent_plus_residual_is_the_accumulated_velocity() {
    let len = 50;
    let mut ef = ErrorFeedback::new(len)
        .with_momentum(0.9)
        .unwrap()
        .with_masking(true);
    let mut codec = TopK::new(0.1).unwrap();
    let (mut sent, mut accumulated, mut u) = (vec![0f64; len], vec![0f64; len], vec![0f64; len]);
    for step in 0..40u64 {
        let g = grad(step, len);
        for i in 0..len {
            u[i] = 0.9 * u[i] + g[i] as f64;
            accumulated[i] += u[i];
        }
        let (c, stats) = ef.step(&g, &mut codec, step).unwrap();
        assert_eq!(stats.density, 0.1);
        for (i, v) in c.to_dense().into_iter().enumerate() {
            if v != 0.0 {
                sent[i] += v as f64;
                // Masking: the reference's momentum restarts there too.
                u[i] = 0.0;
            }
        }
        for i in 0..len {
            let total = sent[i] + ef.error[i] as f64;
            assert!(
                (total - accumulated[i]).abs() < 1e-3 * (1.0 + accumulated[i].abs()),
                "step {step} element {i}: {total} vs {}",
                accumulated[i]
            );
            assert!((ef.velocity()[i] as f64 - u[i]).abs() < 1e-3 * (1.0 + u[i].abs()));
        }
    }
}

#[test]
fn masked_momentum_correction_sends_the_largest_residuals_and_masks_their_momentum() {
    let mut ef = ErrorFeedback::new(4)
        .with_momentum(0.5)
        .unwrap()
        .with_masking(true);
    let mut codec = TopK::new(0.5).unwrap();
    let (c, _) = ef.step(&[0.1, -3.0, 2.0, 0.2], &mut codec, 0).unwrap();
    assert_eq!(c.to_dense(), vec![0.0, -3.0, 2.0, 0.0]);
    assert_eq!(ef.error, vec![0.1, 0.0, 0.0, 0.2]);
    assert_eq!(ef.velocity(), &[0.1, 0.0, 0.0, 0.2]);
    // Next step: the unsent keep their momentum (u = 0.5·0.1 + 0.1 = 0.15, residual 0.25; element 3:
    // u = 0.5·0.2 + 0.01 = 0.11, residual 0.31), the sent start afresh from their new gradient (0).
    let mut one = TopK::new(0.25).unwrap();
    let (c, _) = ef.step(&[0.1, 0.0, 0.0, 0.01], &mut one, 1).unwrap();
    let d = c.to_dense();
    assert_eq!(d[..3], [0.0, 0.0, 0.0]);
    assert!((d[3] - 0.31).abs() < 1e-6, "{d:?}");
    assert_eq!(ef.velocity()[3], 0.0, "sent, so masked");
    assert!((ef.velocity()[0] - 0.15).abs() < 1e-6);
    assert!((ef.error[0] - 0.25).abs() < 1e-6);
    assert_eq!(ef.velocity()[1..3], [0.0, 0.0]);
    // A reset clears the velocity too.
    ef.reset();
    assert!(ef.velocity().iter().all(|v| *v == 0.0));
}

#[test]
fn unmasked_momentum_correction_applies_every_gradient_with_its_full_momentum_weight() {
    // Without masking the velocity is dense momentum SGD's: what has been sent plus the residual is the
    // sum of the velocities so far, exactly what momentum SGD would have applied (before the learning
    // rate), whatever top-k chose.
    let len = 40;
    let mut ef = ErrorFeedback::new(len).with_momentum(0.9).unwrap();
    assert!(!ef.masking());
    let mut codec = TopK::new(0.05).unwrap();
    let (mut sent, mut applied, mut u) = (vec![0f64; len], vec![0f64; len], vec![0f64; len]);
    for step in 0..60u64 {
        let g = grad(step + 100, len);
        for i in 0..len {
            u[i] = 0.9 * u[i] + g[i] as f64;
            applied[i] += u[i];
        }
        let (c, _) = ef.step(&g, &mut codec, step).unwrap();
        for (i, v) in c.to_dense().into_iter().enumerate() {
            sent[i] += v as f64;
        }
        for i in 0..len {
            let total = sent[i] + ef.error[i] as f64;
            assert!(
                (total - applied[i]).abs() < 1e-3 * (1.0 + applied[i].abs()),
                "step {step} element {i}: {total} vs {}",
                applied[i]
            );
            assert!((ef.velocity()[i] as f64 - u[i]).abs() < 1e-3 * (1.0 + u[i].abs()));
        }
    }
}

#[test]
fn momentum_correction_refuses_a_bad_factor_and_zero_turns_it_off() {
    for bad in [1.0, -0.1, f32::NAN] {
        assert!(ErrorFeedback::new(3).with_momentum(bad).is_err(), "{bad}");
    }
    let ef = ErrorFeedback::new(3).with_momentum(0.0).unwrap();
    assert_eq!(ef.momentum(), 0.0);
    assert!(ef.velocity().is_empty());
}
