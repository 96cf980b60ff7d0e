//! The committed `include/braid.h` is exactly what cbindgen generates from this crate, so the header
//! never drifts from the library. `BRAID_BLESS=1` rewrites it instead of failing.

use std::path::PathBuf;

#[test]
fn committed_header_matches_the_generated_one() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut fresh = Vec::new();
    cbindgen::Builder::new()
        .with_crate(&dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut fresh);
    let fresh = String::from_utf8(fresh).expect("the header is UTF-8");
    let path = dir.join("include/braid.h");
    if std::env::var_os("BRAID_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("writing include/braid.h");
        println!("wrote {}", path.display());
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != fresh {
        let line = committed
            .lines()
            .zip(fresh.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(committed.lines().count().min(fresh.lines().count()));
        panic!(
            "include/braid.h is stale (first difference at line {}); regenerate it with \
             `BRAID_BLESS=1 cargo test -p braid-capi --test header` and commit it",
            line + 1
        );
    }
    for symbol in [
        "braid_comm_init_rank",
        "braid_all_reduce",
        "braid_work_wait",
        "braid_compressor_create_layers",
        "BRAID_INVALID_ARGUMENT",
        "BRAID_FLOAT32",
        "BRAID_CONFIG_MAGIC",
    ] {
        assert!(fresh.contains(symbol), "the header lacks {symbol}");
    }
}
