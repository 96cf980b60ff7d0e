//! Tests that run other processes: their output for assertion messages, and the lines two processes
//! of one test exchange (bytes as hex after a marker the harness cannot mistake).

use std::io::BufRead;
use std::process::Output;

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
