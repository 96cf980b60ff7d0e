//! Bytes a peer sent as a collective's fingerprint: decoding must never panic and
//! must round-trip whatever it accepts.
#![no_main]

use braid_exec::Fingerprint;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(f) = Fingerprint::decode(data) {
        assert_eq!(Fingerprint::decode(&f.encode()), Ok(f));
        assert_eq!(&f.encode()[..], data);
    }
});
