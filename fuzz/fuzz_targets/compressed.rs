//! Bytes of a compressed gradient from a peer: decoding must never panic or over-allocate, anything
//! accepted must be canonical (re-encode to the same bytes) and decompress into its declared length.
#![no_main]

use braid_compress::Compressed;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(c) = Compressed::decode_for(data, 1 << 16) {
        assert_eq!(c.encode(), data);
        let mut out = vec![0f32; c.len()];
        c.decompress(&mut out)
            .expect("a decoded value decompresses");
    }
});
