//! Bytes off a bootstrap socket: framing and message decoding must never panic, never allocate more
//! than the frame limit, and whatever decodes must re-encode to the same message.
#![no_main]

use braid::wire::{read_frame, Msg};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(Ok(msg)) = read_frame(&mut &data[..]) {
        assert_eq!(Msg::decode(&msg.encode()), Ok(msg));
    }
    if let Ok(msg) = Msg::decode(data) {
        assert_eq!(Msg::decode(&msg.encode()), Ok(msg));
    }
});
