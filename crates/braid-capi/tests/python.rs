//! The Python binding (`python/braid`): its unittest suite as every rank of `braid run -n 2` and `-n 4`,
//! and the PyTorch DDP hook example. Where python3 or numpy is missing they say why and pass without
//! running, or fail under `BRAID_REQUIRE_TOOLS=1`.

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
