//! Tests that run other processes: their output for assertion messages, and the lines two processes
//! of one test exchange (bytes as hex after a marker the harness cannot mistake).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdout, Command, Output, Stdio};

/// A finished process's status and output, for assertion messages.
pub fn show(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `bytes` as lowercase hex, two digits a byte.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of `text` written by [`hex`]; panics on anything else (a test's own line went wrong).
pub fn unhex(text: &str) -> Vec<u8> {
    assert!(text.len() % 2 == 0, "odd-length hex {text:?}");
    (0..text.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(&text[i..i + 2], 16)
                .unwrap_or_else(|_| panic!("not hex at {i}: {text:?}"))
        })
        .collect()
}

/// The rest of the first line read from `input` that holds `marker` (the test harness may print
/// before it on the same line), trimmed; a panic when the input ends first.
pub fn read_marked(input: &mut impl BufRead, marker: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            input.read_line(&mut line).unwrap() > 0,
            "the other process ended before it sent {marker:?}"
        );
        if let Some(at) = line.find(marker) {
            return line[at + marker.len()..].trim().to_string();
        }
    }
}

/// One test of this test binary run again in a child process (alone, its output not captured), to
/// play another rank: it finds its part through an environment variable, and the two talk through
/// its stdin and stdout in lines of [`hex`] after a marker.
pub struct ChildTest {
    child: Child,
    output: BufReader<ChildStdout>,
}

impl ChildTest {
    /// Starts test `name` (its whole path, as `--exact` wants it) with `var` set to `value`.
    pub fn start(name: &str, var: &str, value: &str) -> ChildTest {
        let exe = std::env::current_exe().expect("the test binary's path");
        let mut child = Command::new(exe)
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env(var, value)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting test {name} in a child process: {e}"));
        let output = BufReader::new(child.stdout.take().expect("piped stdout"));
        ChildTest { child, output }
    }

    /// Sends `bytes` to the child after `marker`, then closes its stdin (one message each way).
    pub fn send_marked(&mut self, marker: &str, bytes: &[u8]) {
        let mut input = self.child.stdin.take().expect("the child's stdin, once");
        writeln!(input, "{marker}{}", hex(bytes)).expect("writing to the child");
    }

    /// The rest of the first line the child prints with `marker` (see [`read_marked`]).
    pub fn read_marked(&mut self, marker: &str) -> String {
        read_marked(&mut self.output, marker)
    }

    /// Waits for the child to end: whether it succeeded, and the rest of what it printed.
    pub fn finish(mut self) -> (bool, String) {
        let mut rest = String::new();
        let _ = self.output.read_to_string(&mut rest);
        let ok = self.child.wait().is_ok_and(|s| s.success());
        (ok, rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_every_byte() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&all)), all);
        assert_eq!(hex(&[0x0a, 0xff]), "0aff");
    }

    #[test]
    fn the_marked_line_is_found_after_other_output() {
        let text = "noise\ntest foo ... BRAID-KEY  abc01 \nlater BRAID-KEY zz\n";
        let mut input = std::io::Cursor::new(text);
        assert_eq!(read_marked(&mut input, "BRAID-KEY"), "abc01");
    }

    #[test]
    #[should_panic(expected = "ended before it sent")]
    fn input_that_ends_first_is_a_panic_naming_the_marker() {
        read_marked(&mut std::io::Cursor::new("nothing here\n"), "BRAID-KEY");
    }
}
