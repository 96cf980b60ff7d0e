//! Tests that cannot run here: what they need is missing (a tool, a privilege, a GPU). Such a test
//! says why and passes without running, unless `BRAID_REQUIRE_TOOLS=1` is set (as CI sets it): then
//! it fails, naming what was missing, so that nothing passes by skipping where it must run.

use std::process::Command;

/// Whether `BRAID_REQUIRE_TOOLS=1` is set: then a test that cannot run here fails instead of passing
/// without running.
pub fn tools_required() -> bool {
    std::env::var("BRAID_REQUIRE_TOOLS").is_ok_and(|v| v == "1")
}

/// The failure message of a test that cannot run here because of `why` under
/// `BRAID_REQUIRE_TOOLS=1`.
pub fn required_but_unavailable(why: &str) -> String {
    format!("cannot run here, and BRAID_REQUIRE_TOOLS=1 requires it to: {why}")
}

/// A test that cannot run here because of `why`: says so and returns (the test passes without
/// running); under `BRAID_REQUIRE_TOOLS=1` it panics, naming `why`.
pub fn unavailable(why: &str) {
    assert!(!tools_required(), "{}", required_but_unavailable(why));
    println!("SKIPPED: cannot run here: {why}");
}

/// Whether `program --version` runs.
pub fn have(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Whether `program` runs here; where it does not, [`unavailable`] says (or fails) that it is
/// missing and what `for_what` needs it.
pub fn require(program: &str, for_what: &str) -> bool {
    if have(program) {
        return true;
    }
    unavailable(&format!("{program} is not installed; {for_what} need it"));
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_what_was_missing_and_the_rule() {
        let m = required_but_unavailable("nvcc is not installed");
        assert!(m.contains("nvcc is not installed") && m.contains("BRAID_REQUIRE_TOOLS=1"));
    }

    #[test]
    fn a_program_that_exists_is_found_and_one_that_does_not_is_not() {
        assert!(have("sh") || have("true") || have("ls"));
        assert!(!have("braid-no-such-program-anywhere"));
    }
}
