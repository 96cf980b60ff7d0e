//! The Python binding (`python/braid`): its unittest suite as every rank of `braid run -n 2` and `-n 4`,
//! the PyTorch backend (`braid.torch`: every collective against gloo, DDP) under torchrun and `braid
//! run`, and the PyTorch DDP hook example. Where python3, numpy or torch is missing they say why and
//! pass without running, or fail under `BRAID_REQUIRE_TOOLS=1`.

mod support;

use std::process::Command;

use support::{artifacts, braid_run, show, workspace};

fn python_has(module: &str) -> bool {
    Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn python_with_numpy() -> bool {
    if !support::require("python3", "the Python binding's tests") {
        return false;
    }
    if !python_has("numpy") {
        support::unavailable("numpy is not installed for python3 (pip install numpy)");
        return false;
    }
    true
}

#[test]
fn python_tests_on_2_and_4_ranks() {
    if !python_with_numpy() {
        return;
    }
    let script = workspace().join("python/tests/test_braid.py");
    for n in [2, 4] {
        let out = braid_run(n, &["python3", script.to_str().unwrap()], &[]);
        let text = show(&out);
        assert!(out.status.success(), "python tests on {n} ranks:\n{text}");
        for r in 0..n {
            assert!(
                text.contains(&format!("rank {r}: python ok")),
                "rank {r} of {n}:\n{text}"
            );
        }
    }
}

#[test]
fn ddp_hook_example_runs_or_says_torch_is_missing() {
    if !python_with_numpy() {
        return;
    }
    let script = workspace().join("python/examples/ddp_hook.py");
    if !python_has("torch") {
        let (_, libdir) = artifacts();
        let out = Command::new("python3")
            .arg(&script)
            .env("BRAID_LIBRARY", libdir.join("libbraid.so"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", show(&out));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("PyTorch is not installed"), "{text}");
        println!("torch is not installed: checked only that the example says so");
        return;
    }
    let out = braid_run(2, &["python3", script.to_str().unwrap()], &[]);
    let text = show(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.matches("weights identical across ranks: True").count() == 2,
        "{text}"
    );
}

/// Whether python3 has torch; says why not otherwise (failing under `BRAID_REQUIRE_TOOLS=1`).
fn python_with_torch() -> bool {
    if !python_with_numpy() {
        return false;
    }
    if !python_has("torch") {
        support::unavailable("PyTorch is not installed for python3 (pip install torch)");
        return false;
    }
    true
}

/// `torchrun --standalone --nproc_per_node n script args...` (torch's launcher on a free port), with
/// the built library.
fn torchrun(n: usize, script: &str, args: &[&str]) -> std::process::Output {
    let (_, libdir) = artifacts();
    Command::new("python3")
        .args(["-m", "torch.distributed.run", "--standalone"])
        .arg(format!("--nproc_per_node={n}"))
        .arg(workspace().join(script))
        .args(args)
        .env("BRAID_LIBRARY", libdir.join("libbraid.so"))
        .env("BRAID_TIMEOUT_MS", "60000")
        .env("PYTHONUNBUFFERED", "1")
        .env_remove("BRAID_RANK")
        .output()
        .expect("running torchrun")
}

fn assert_every_rank(out: &std::process::Output, n: usize, line: &str, what: &str) {
    let text = show(out);
    assert!(out.status.success(), "{what}:\n{text}");
    for r in 0..n {
        assert!(
            text.contains(&format!("rank {r}: {line}")),
            "{what}: rank {r} did not print {line:?}:\n{text}"
        );
    }
}

#[test]
fn torch_backend_collectives_match_gloo_under_torchrun_and_braid_run() {
    if !python_with_torch() {
        return;
    }
    for n in [2, 4] {
        let out = torchrun(n, "python/tests/test_torch.py", &[]);
        assert_every_rank(&out, n, "torch ok", &format!("torchrun, {n} ranks"));
    }
    let script = workspace().join("python/tests/test_torch.py");
    let out = braid_run(2, &["python3", script.to_str().unwrap()], &[]);
    assert_every_rank(&out, 2, "torch ok", "braid run, 2 ranks");
}

#[test]
fn ddp_with_backend_braid_alone_matches_gloo() {
    if !python_with_torch() {
        return;
    }
    for n in [2, 4] {
        let dir = std::env::temp_dir().join(format!("braid-ddp-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let d = dir.to_str().unwrap();
        // braid first (it saves its parameters), then gloo (which compares its own with them).
        for backend in ["braid", "gloo"] {
            let out = torchrun(n, "python/tests/torch_ddp.py", &[backend, d]);
            let what = format!("DDP with {backend}, {n} ranks");
            assert_every_rank(&out, n, &format!("ddp {backend} ok"), &what);
            if backend == "braid" {
                assert!(
                    !show(&out).contains("gloo"),
                    "{what}: gloo was mentioned in a run that must not use it:\n{}",
                    show(&out)
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_rank_dying_mid_training_makes_every_survivor_raise_promptly() {
    if !python_with_torch() {
        return;
    }
    // The process group's timeout is 10 s: each survivor must raise within 20 s (the script checks),
    // and the rank that left must be named (by the survivors that waited on it).
    let out = torchrun(3, "python/tests/torch_fault.py", &["10"]);
    let text = show(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("rank 1: leaving"), "{text}");
    for r in [0, 2] {
        assert!(
            text.contains(&format!("rank {r}: raised after")),
            "rank {r} did not raise:\n{text}"
        );
    }
    assert!(
        text.contains("PeerFailedError") && text.contains("rank 1 died"),
        "no survivor's error names rank 1:\n{text}"
    );
}

#[test]
fn pip_install_makes_braid_importable_outside_the_tree() {
    if !python_with_numpy() {
        return;
    }
    let (_, libdir) = artifacts();
    let venv = std::env::temp_dir().join(format!("braid-venv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&venv);
    let run = |cmd: &mut Command, what: &str| {
        let out = cmd.output().expect(what);
        assert!(out.status.success(), "{what}:\n{}", show(&out));
        out
    };
    // The system's packages stay visible (numpy, torch); braid comes only from the install.
    run(
        Command::new("python3")
            .args(["-m", "venv", "--system-site-packages"])
            .arg(&venv),
        "python3 -m venv",
    );
    // The build copies the library named by BRAID_LIBRARY instead of compiling a release build.
    run(
        Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet"])
            .arg(workspace().join("python"))
            .env("BRAID_LIBRARY", libdir.join("libbraid.so")),
        "pip install ./python",
    );
    let scratch = std::env::temp_dir();
    let out = run(
        Command::new(venv.join("bin/python"))
            .args([
                "-c",
                "import braid, numpy as np\n\
                 c = braid.Communicator.init(1, 0, braid.UniqueId.new())\n\
                 x = np.arange(5, dtype=np.float32); c.all_reduce(x, op='max')\n\
                 print(braid.library_path, braid.__file__, x.tolist())",
            ])
            .current_dir(&scratch)
            .env_remove("BRAID_LIBRARY")
            .env_remove("PYTHONPATH"),
        "import braid outside the tree",
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let site = venv.to_str().unwrap();
    let words: Vec<&str> = text.split_whitespace().collect();
    assert!(
        words.len() >= 2 && words[0].starts_with(site) && words[0].ends_with("braid/libbraid.so"),
        "the library does not come from the installed package: {text}"
    );
    assert!(
        words[1].starts_with(site),
        "braid was imported from elsewhere: {text}"
    );
    assert!(text.contains("[0.0, 1.0, 2.0, 3.0, 4.0]"), "{text}");
    let _ = std::fs::remove_dir_all(&venv);
    // What the in-tree build leaves behind is ignored by git.
    for left in ["python/build", "python/braid.egg-info"] {
        let ignored = Command::new("git")
            .args(["check-ignore", "-q", left])
            .current_dir(workspace())
            .status()
            .expect("git check-ignore");
        assert!(ignored.success(), "{left} is not ignored by git");
    }
}

#[test]
fn compressed_ddp_hook_keeps_error_feedback_per_parameter() {
    if !python_with_torch() {
        return;
    }
    let out = torchrun(2, "python/tests/torch_compressed.py", &[]);
    assert_every_rank(
        &out,
        2,
        "compressed ok",
        "DDP with braid's compressed hook, 2 ranks",
    );
}

#[test]
fn torch_gradient_buckets_train_like_one_model_and_compressed_ones_agree() {
    if !python_with_torch() {
        return;
    }
    for n in [2, 4] {
        let out = torchrun(n, "python/tests/torch_buckets.py", &[]);
        assert_every_rank(
            &out,
            n,
            "buckets ok",
            &format!("GradientBuckets, {n} ranks"),
        );
    }
    let out = torchrun(2, "python/tests/torch_buckets.py", &["topk:0.2"]);
    assert_every_rank(&out, 2, "buckets ok", "compressed GradientBuckets, 2 ranks");
}
