//! The environment page of the docs (`docs/src/environment.md`) documents every variable `Config`
//! reads, in a row of its table, once; and every variable a row names is one something reads (`Config`,
//! or any source file of the tree), so the page cannot keep a variable that is gone.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use braid_core::Config;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `BRAID_*` names in `text`: `BRAID_` followed by capitals, digits and underscores, taken whole.
fn names(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("BRAID_") {
        let preceded = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let tail = &rest[at..];
        let len = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..len];
        if !preceded && name.len() > "BRAID_".len() && !name.ends_with('_') {
            out.push(name.to_string());
        }
        rest = &tail[len..];
    }
    out
}

/// The variables each table row of the page names in its first cell, with the row's line number.
fn documented(page: &str) -> BTreeMap<String, Vec<usize>> {
    let mut rows: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, line) in page.lines().enumerate() {
        let Some(cells) = line.trim().strip_prefix('|') else {
            continue;
        };
        let first = cells.split('|').next().unwrap_or("");
        for name in names(first) {
            rows.entry(name).or_default().push(i + 1);
        }
    }
    rows
}

/// Every `BRAID_*` name in the tree's source files (not its documentation), skipping build outputs.
fn read_somewhere() -> BTreeSet<String> {
    const EXTENSIONS: &[&str] = &[
        "rs", "py", "sh", "c", "h", "cpp", "hpp", "cu", "cuh", "toml", "in",
    ];
    const SKIP: &[&str] = &["target", "build", ".git", "__pycache__", "docs"];
    let mut found = BTreeSet::new();
    let mut dirs: Vec<PathBuf> = [
        "crates", "python", "scripts", "benches", "tests", "fuzz", ".ci",
    ]
    .iter()
    .map(|d| root().join(d))
    .collect();
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if !SKIP.contains(&name.as_str()) && !name.ends_with(".egg-info") {
                    dirs.push(path);
                }
                continue;
            }
            let source = path
                .extension()
                .is_some_and(|e| EXTENSIONS.contains(&e.to_string_lossy().as_ref()))
                || dir.ends_with(".ci");
            if source && !path.ends_with("environment_docs.rs") {
                if let Ok(text) = std::fs::read_to_string(&path) {
                    found.extend(names(&text));
                }
            }
        }
    }
    found
}

fn page() -> String {
    let path = root().join("docs/src/environment.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_variable_config_reads_has_a_row() {
    let rows = documented(&page());
    let missing: Vec<&str> = Config::VARIABLES
        .iter()
        .copied()
        .filter(|v| !rows.contains_key(*v))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/src/environment.md has no table row for {missing:?}, which Config::from_env reads"
    );
}

#[test]
fn every_documented_variable_is_read_and_documented_once() {
    let rows = documented(&page());
    assert!(
        rows.len() >= Config::VARIABLES.len(),
        "{} variables in the table",
        rows.len()
    );
    let twice: Vec<_> = rows.iter().filter(|(_, lines)| lines.len() > 1).collect();
    assert!(
        twice.is_empty(),
        "variables with more than one row: {twice:?}"
    );
    let known = read_somewhere();
    let stale: Vec<&String> = rows
        .keys()
        .filter(|v| !Config::VARIABLES.contains(&v.as_str()) && !known.contains(*v))
        .collect();
    assert!(
        stale.is_empty(),
        "docs/src/environment.md documents {stale:?}, which nothing in the tree reads"
    );
}

#[test]
fn names_are_taken_whole() {
    assert_eq!(
        names("`BRAID_IB_*`, `BRAID_TIMEOUT_MS`/MY_BRAID_X, BRAID_RANK2."),
        ["BRAID_TIMEOUT_MS", "BRAID_RANK2"]
    );
}
