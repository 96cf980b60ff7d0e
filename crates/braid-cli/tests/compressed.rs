//! Compressed all-reduce and all-to-all between real processes over real shared memory. This file is
//! its own test harness: run without `BRAID_RANK` it launches copies of itself as ranks through
//! `braid run` and checks how they end; run with `BRAID_RANK` it is a rank and plays the scenario named by
//! its first argument. The checks themselves are shared with the in-process tests of `braid`.

mod common;

use std::time::Instant;

use braid::{CodecSpec, Communicator, CompressionConfig, GradientCompressor, ReduceOp};
use braid_testkit::compression as scenario;
use common::{braid_run, braid_segments, case, no_segments_left, show};

// ---------------------------------------------------------------------------------------------------
// Rank side.

fn rank_main(scenario: &str, args: &[String]) -> i32 {
    common::pretend_hosts_from_env();
    // The configuration comes first: a bad variable must be reported whatever else happens.
    if scenario == "env" {
        match CompressionConfig::from_env() {
            Ok(cfg) => {
                let want: CodecSpec = args[0].parse().unwrap();
                assert_eq!(cfg.codec, want);
                assert!(!cfg.error_feedback);
                assert_eq!(
                    (cfg.clip_norm, cfg.decay, cfg.dense_switch),
                    (Some(2.5), Some(0.9), 0.25)
                );
                assert_eq!(cfg.sparse_path, braid::SparsePath::ReduceScatter);
            }
            Err(e) => {
                println!("config error: {e}");
                return 3;
            }
        }
    }
    let c = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            println!("init failed: {e}");
            return 1;
        }
    };
    let checks = match scenario {
        "all" => {
            scenario::every_codec(&c)
                + scenario::bad_input_clip_warnings_reset(&c)
                + scenario::all_to_all(&c)
                + scenario::tiny_tensors(&c)
                + scenario::sparse_reduce_scatter(&c)
        }
        "env" => {
            // The environment's configuration works end to end.
            let cfg = CompressionConfig::from_env().unwrap();
            let mut st = GradientCompressor::new(cfg, scenario::LEN).unwrap();
            let mut g = scenario::gradient(c.rank(), 0, scenario::LEN);
            c.all_reduce_compressed(&mut g, ReduceOp::Avg, &mut st)
                .unwrap();
            scenario::assert_identical(&c, &g, "configuration from the environment");
            1
        }
        other => {
            println!("unknown scenario {other}");
            return 2;
        }
    };
    println!("rank {} ok: {checks} checks", c.rank());
    0
}

// ---------------------------------------------------------------------------------------------------
// Harness side.

fn test_every_codec_on_processes() {
    let cases: [(usize, &[(&str, &str)]); 6] = [
        (2, &[]),
        (3, &[]),
        (5, &[]),
        (8, &[]),
        (3, &[("BRAID_TRANSPORT", "tcp")]),
        (4, &[("TEST_RANKS_PER_HOST", "2")]),
    ];
    for (n, extra) in cases {
        let start = Instant::now();
        let mut env = vec![("BRAID_TIMEOUT_MS", "120000"), ("BRAID_DEBUG_CHECKS", "1")];
        env.extend_from_slice(extra);
        let o = braid_run(n, &["all"], &env);
        assert!(
            o.status.success(),
            "{n} ranks {extra:?} failed:\n{}",
            show(&o)
        );
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(out.matches(" ok: ").count(), n, "{}", show(&o));
        println!(
            "  every codec on {n} processes {extra:?}: ok ({:.1} s)",
            start.elapsed().as_secs_f64()
        );
    }
}

fn test_configuration_from_the_environment() {
    let good = [
        ("BRAID_COMPRESS", "int8-stochastic:128"),
        ("BRAID_COMPRESS_EF", "0"),
        ("BRAID_COMPRESS_CLIP", "2.5"),
        ("BRAID_COMPRESS_DECAY", "0.9"),
        ("BRAID_COMPRESS_DENSE_SWITCH", "0.25"),
        ("BRAID_COMPRESS_SPARSE", "reducescatter"),
    ];
    let o = braid_run(3, &["env", "int8-stochastic:128"], &good);
    assert!(o.status.success(), "{}", show(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).matches(" ok: ").count(),
        3
    );
    for (var, value) in [
        ("BRAID_COMPRESS", "topk:7"),
        ("BRAID_COMPRESS_DECAY", "-1"),
        ("BRAID_COMPRESS_EF", "sometimes"),
        ("BRAID_COMPRESS_SPARSE", "everywhere"),
    ] {
        let mut env = good.to_vec();
        env.retain(|(k, _)| *k != var);
        env.push((var, value));
        let o = braid_run(2, &["env", "int8-stochastic:128"], &env);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            !o.status.success()
                && out.contains("config error")
                && out.contains(var)
                && out.contains(value),
            "{var}={value}:\n{}",
            show(&o)
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if std::env::var_os("BRAID_RANK").is_some() {
        std::process::exit(rank_main(&args[0], &args[1..]));
    }
    let args = common::arguments();
    let before = braid_segments();
    let tests = vec![
        case(
            "every codec and op, all-to-all and bad input on 2, 3, 5 and 8 processes",
            test_every_codec_on_processes,
        ),
        case(
            "configuration from BRAID_COMPRESS* variables",
            test_configuration_from_the_environment,
        ),
        no_segments_left(
            "/dev/shm holds no braid segments afterwards",
            before,
            |_| true,
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}
