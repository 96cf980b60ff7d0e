//! `braid compress-eval --quick` end to end: real rank processes train, compare and plot.

use std::path::PathBuf;
use std::process::Command;

fn braid() -> Command {
    Command::new(env!("CARGO_BIN_EXE_braid"))
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run_of<'a>(runs: &'a [serde_json::Value], setting: &str, opt: &str) -> &'a serde_json::Value {
    runs.iter()
        .find(|r| r["setting"] == setting && r["optimizer"] == opt)
        .unwrap_or_else(|| panic!("no run {setting} {opt} in {runs:?}"))
}

#[test]
fn quick_evaluation_learns_agrees_and_plots() {
    let dir = scratch("compress-eval");
    let out = dir.join("plots");
    let json = dir.join("report.json");
    let res = braid()
        .args(["compress-eval", "--quick", "--ranks", "2", "--out"])
        .arg(&out)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&res.stdout);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(
        res.status.success(),
        "exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        res.status
    );

    // The table: a header and one row per (setting, optimizer).
    assert!(
        stdout.contains("setting") && stdout.contains("train loss"),
        "{stdout}"
    );
    let row = |setting: &str, opt: &str| {
        stdout
            .lines()
            .any(|l| l.split_whitespace().take(2).eq([setting, opt]))
    };
    for setting in [
        "dense",
        "topk:0.1",
        "topk:0.01",
        "topk:0.01/noef",
        "topk:0.005",
    ] {
        for opt in ["sgd", "adam"] {
            assert!(row(setting, opt), "no row {setting} {opt}:\n{stdout}");
        }
    }
    // Momentum correction replaces SGD's momentum; Adam-safe compression needs Adam.
    let mc = "topk:0.01/momentum=0.9/warmup=60:0.25";
    let adam = "topk:0.01/adam=60:0.9";
    assert!(row(mc, "sgd") && !row(mc, "adam"), "{stdout}");
    assert!(row(adam, "adam") && !row(adam, "sgd"), "{stdout}");
    assert!(stdout.contains("2 seeds (mean ± sample sd)"), "{stdout}");
    assert!(
        stdout.contains("parameters bit-identical on all 2 ranks after each of the 24 runs"),
        "{stdout}"
    );

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["ranks"], 2);
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 24);
    let summary = report["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 12);
    for s in summary {
        assert_eq!(s["seeds"], 2, "{s}");
        let share = s["lagging_share"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&share), "{s}");
    }
    // Plain dense updates nearly every parameter; 1% top-k without error feedback leaves most lagging.
    let lag = |setting: &str| {
        summary
            .iter()
            .find(|s| s["setting"] == setting && s["optimizer"] == "sgd")
            .unwrap()["lagging_share"]
            .as_f64()
            .unwrap()
    };
    assert!(lag("topk:0.01/noef") > lag("dense") + 0.2, "{summary:?}");
    // Each seed is compared with its own dense run.
    let seeds: Vec<u64> = runs
        .iter()
        .filter(|r| r["setting"] == "dense" && r["optimizer"] == "sgd")
        .map(|r| r["seed"].as_u64().unwrap())
        .collect();
    assert_eq!(seeds, [1, 2]);
    for r in runs.iter().filter(|r| r["setting"] == "dense") {
        assert_eq!(r["loss_vs_dense_pct"].as_f64(), Some(0.0), "{r}");
        assert_eq!(r["accuracy_vs_dense_pts"].as_f64(), Some(0.0), "{r}");
    }
    for opt in ["sgd", "adam"] {
        let dense = run_of(runs, "dense", opt);
        let (init, fin) = (
            dense["initial_train_loss"].as_f64().unwrap(),
            dense["final_train_loss"].as_f64().unwrap(),
        );
        assert!(
            fin < 0.5 * init,
            "{opt}: dense went from {init} to {fin} only"
        );
        assert!(
            dense["test_accuracy"].as_f64().unwrap() > 0.5,
            "{opt}: {dense}"
        );
        let topk = run_of(runs, "topk:0.1", opt);
        let rel = topk["loss_vs_dense_pct"].as_f64().unwrap();
        assert!(
            rel < 5.0,
            "{opt}: top-k 10% with error feedback ends {rel:+.2}% from dense"
        );
        // Compression saves bytes.
        assert!(topk["sent_bytes"].as_u64().unwrap() * 3 < dense["sent_bytes"].as_u64().unwrap());
    }
    // Density below 1% with Adam is warned about; with SGD it is not.
    assert!(!run_of(runs, "topk:0.005", "adam")["warnings"]
        .as_array()
        .unwrap()
        .is_empty());
    assert!(run_of(runs, "topk:0.005", "sgd")["warnings"]
        .as_array()
        .unwrap()
        .is_empty());
    assert!(
        stdout.contains("below 1% with an adaptive optimizer"),
        "{stdout}"
    );

    for kind in ["loss", "grad_norm", "compression_error"] {
        for opt in ["sgd", "adam"] {
            let png = out.join(format!("{kind}_{opt}.png"));
            let bytes = std::fs::read(&png).unwrap_or_else(|e| panic!("{}: {e}", png.display()));
            assert!(
                bytes.len() > 1000,
                "{} has {} bytes",
                png.display(),
                bytes.len()
            );
            assert_eq!(
                &bytes[..8],
                b"\x89PNG\r\n\x1a\n",
                "{} is not a PNG",
                png.display()
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_arguments_are_refused_before_any_rank_starts() {
    for (args, needle) in [
        (&["--codecs", "topk:2"][..], "(0, 1]"),
        (&["--codecs", "gzip"][..], "unknown codec"),
        (&["--codecs", "topk:0.1/frob"][..], "unknown option"),
        (&["--seeds", "0"][..], "at least 1"),
        (&["--optimizers", "lion"][..], "unknown optimizer"),
        (&["--task", "imagenet"][..], "unknown task"),
        (&["--steps", "0"][..], "at least 1"),
        (&["--ranks", "0"][..], "at least 1"),
    ] {
        let res = braid().arg("compress-eval").args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

/// The communicator's compressed all-reduce and the local all-gather reference train top-k alike.
#[test]
fn compressed_all_reduce_matches_the_gather_reference() {
    let dir = scratch("compress-eval-gather");
    let mut losses = Vec::new();
    for gather in [false, true] {
        let json = dir.join(format!("gather-{gather}.json"));
        let mut cmd = braid();
        cmd.args([
            "compress-eval",
            "--quick",
            "--ranks",
            "2",
            "--codecs",
            "topk:0.1,topk:0.01/noef,topk:0.01/momentum=0.9",
            "--optimizers",
            "sgd",
            "--seeds",
            "1",
            "--steps",
            "60",
            "--json",
        ])
        .arg(&json);
        if gather {
            cmd.arg("--gather");
        }
        let res = cmd.output().unwrap();
        assert!(
            res.status.success(),
            "{}",
            String::from_utf8_lossy(&res.stderr)
        );
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let runs = report["runs"].as_array().unwrap().clone();
        losses.push(
            runs.iter()
                .map(|r| r["final_train_loss"].as_f64().unwrap())
                .collect::<Vec<_>>(),
        );
    }
    for (a, b) in losses[0].iter().zip(&losses[1]) {
        assert!(
            (a - b).abs() <= 1e-6 * a.abs(),
            "all_reduce_compressed {a} vs gather {b}"
        );
    }
    assert_eq!(losses[0].len(), 3);
    assert_ne!(losses[0][0], losses[0][1], "the settings should differ");
    assert_ne!(losses[0][1], losses[0][2], "the settings should differ");
    let _ = std::fs::remove_dir_all(&dir);
}
