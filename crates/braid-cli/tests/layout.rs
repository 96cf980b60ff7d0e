//! The source tree's layout: no file of a crate imports a file that imports it back
//! (`scripts/import-cycles.py` finds such circles; it must find none, and must find planted ones, a
//! module root and its child among them).

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn import_cycles(args: &[&Path]) -> (bool, String) {
    let out = Command::new("python3")
        .arg(root().join("scripts/import-cycles.py"))
        .args(args)
        .output()
        .expect("python3 runs scripts/import-cycles.py (install python3)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn no_file_imports_a_file_that_imports_it_back() {
    let (ok, text) = import_cycles(&[]);
    assert!(ok, "import circles between files:\n{text}");
    assert!(text.contains("no import circles"), "{text}");
}

#[test]
fn a_planted_circle_is_found() {
    let dir = std::env::temp_dir().join(format!("braid-import-cycles-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("inner")).unwrap();
    std::fs::write(src.join("lib.rs"), "mod a;\nmod inner;\n").unwrap();
    std::fs::write(
        src.join("a.rs"),
        "use crate::inner::b::Thing;\npub struct Other;\n",
    )
    .unwrap();
    std::fs::write(src.join("inner/mod.rs"), "pub mod b;\n").unwrap();
    std::fs::write(
        src.join("inner/b.rs"),
        "pub struct Thing;\nfn f() -> super::super::a::Other {\n    super::super::a::Other\n}\n",
    )
    .unwrap();
    let (ok, text) = import_cycles(&[&dir]);
    std::fs::remove_dir_all(&dir).ok();
    assert!(!ok, "the planted circle was not found:\n{text}");
    assert!(
        text.contains("src/a.rs <-> src/inner/b.rs"),
        "the circle is not named: {text}"
    );
}

#[test]
fn a_parent_and_its_child_are_a_circle() {
    let dir =
        std::env::temp_dir().join(format!("braid-import-cycles-child-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("path")).unwrap();
    std::fs::create_dir_all(src.join("group")).unwrap();
    std::fs::write(src.join("lib.rs"), "mod group;\nmod path;\n").unwrap();
    // The parent names its child's item by a plain path; the child names the parent's.
    std::fs::write(
        src.join("path/mod.rs"),
        "mod child;\npub struct Y;\nfn f() -> child::X {\n    child::X\n}\n",
    )
    .unwrap();
    std::fs::write(
        src.join("path/child.rs"),
        "use super::Y;\npub struct X;\nfn g() -> Y {\n    Y\n}\n",
    )
    .unwrap();
    // The parent re-exports its child's items as a group.
    std::fs::write(
        src.join("group/mod.rs"),
        "mod child;\npub use child::{X, Z};\npub struct Y;\n",
    )
    .unwrap();
    std::fs::write(
        src.join("group/child.rs"),
        "pub struct X;\npub struct Z;\nfn g() -> super::Y {\n    super::Y\n}\n",
    )
    .unwrap();
    let (ok, text) = import_cycles(&[&dir]);
    std::fs::remove_dir_all(&dir).ok();
    assert!(!ok, "the planted circles were not found:\n{text}");
    for circle in [
        "src/path/mod.rs <-> src/path/child.rs",
        "src/group/mod.rs <-> src/group/child.rs",
    ] {
        assert!(text.contains(circle), "{circle} is not named: {text}");
    }
}
