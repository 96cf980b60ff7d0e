//! The kernel's list syntax (`0-3,8,10-11`), used for CPU sets in sysfs and in the topology file.

/// The highest CPU id a list may name. Linux builds for at most 8192 CPUs; the bound keeps a hostile
/// `0-4294967295` from allocating gigabytes.
pub const MAX_CPU: u32 = 1 << 16;

/// Parses a list such as `0-3,8,10-11` (whitespace around it and an empty list are accepted).
/// The result is sorted and free of duplicates.
pub fn parse_cpulist(text: &str) -> Result<Vec<u32>, String> {
    let text = text.trim();
    let mut cpus = Vec::new();
    if text.is_empty() {
        return Ok(cpus);
    }
    for part in text.split(',') {
        let part = part.trim();
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (number(a, text)?, number(b, text)?),
            None => {
                let n = number(part, text)?;
                (n, n)
            }
        };
        if lo > hi {
            return Err(format!("range {part:?} in {text:?} runs backwards"));
        }
        if hi > MAX_CPU {
            return Err(format!(
                "cpu {hi} in {text:?} is above the limit of {MAX_CPU}"
            ));
        }
        cpus.extend(lo..=hi);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

fn number(s: &str, whole: &str) -> Result<u32, String> {
    let s = s.trim();
    s.parse::<u32>()
        .map_err(|_| format!("{s:?} in {whole:?} is not a cpu number"))
}

/// Writes ascending numbers in list syntax, runs folded into ranges: `[0, 1, 2, 5]` → `0-2,5`.
pub fn format_ranges(sorted: impl IntoIterator<Item = u64>) -> String {
    let mut out = String::new();
    let mut run: Option<(u64, u64)> = None;
    let flush = |out: &mut String, (a, b): (u64, u64)| {
        if !out.is_empty() {
            out.push(',');
        }
        if a == b {
            out.push_str(&a.to_string());
        } else {
            out.push_str(&format!("{a}-{b}"));
        }
    };
    for n in sorted {
        run = match run {
            Some((a, b)) if n == b + 1 => Some((a, n)),
            Some(r) => {
                flush(&mut out, r);
                Some((n, n))
            }
            None => Some((n, n)),
        };
    }
    if let Some(r) = run {
        flush(&mut out, r);
    }
    out
}

/// Serde glue: a CPU set as a list string in the topology file.
pub(crate) mod serde_cpus {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(cpus: &[u32], s: S) -> Result<S::Ok, S::Error> {
        let mut sorted = cpus.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        s.serialize_str(&super::format_ranges(sorted.into_iter().map(u64::from)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        let text = String::deserialize(d)?;
        super::parse_cpulist(&text).map_err(|e| serde::de::Error::custom(format!("cpus: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ranges_and_singles() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n").unwrap(),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpulist(" \n").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_cpulist("5,1-2,2").unwrap(), vec![1, 2, 5]);
    }

    #[test]
    fn rejects_bad_lists_naming_the_part() {
        let e = parse_cpulist("0-x").unwrap_err();
        assert!(e.contains("\"x\""), "{e}");
        assert!(parse_cpulist("4-2").unwrap_err().contains("backwards"));
        assert!(parse_cpulist("0-4294967295").unwrap_err().contains("limit"));
        assert!(parse_cpulist("1,,2").is_err());
    }

    #[test]
    fn format_folds_runs_and_round_trips() {
        assert_eq!(format_ranges([0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(format_ranges([]), "");
        let cpus = vec![0, 2, 3, 4, 9, 63, 64];
        let text = format_ranges(cpus.iter().map(|&c| u64::from(c)));
        assert_eq!(parse_cpulist(&text).unwrap(), cpus);
    }
}
