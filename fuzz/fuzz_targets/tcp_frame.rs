//! Bytes off a TCP connection: the hello that opens it and the header in front of every part of a
//! message. Decoding must never panic; whatever it accepts must round-trip and lie within the slot.
#![no_main]

use braid_transport::tcp::frame::{self, Hello, PartHeader};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 6 {
        return;
    }
    let (ctl, rest) = data.split_at(6);
    let expect = u32::from_le_bytes([ctl[0], ctl[1], ctl[2], ctl[3]]);
    let sockets = 1 + (ctl[4] % 8) as usize;
    let socket = (ctl[5] as usize) % sockets;
    let slot_bytes = 1 << 16;
    if let Ok(b) = <&[u8; frame::PART_LEN]>::try_from(&rest[..rest.len().min(frame::PART_LEN)]) {
        if let Ok(h) = PartHeader::decode(b, expect, socket, sockets, slot_bytes) {
            assert!(h.len as usize <= slot_bytes);
            assert!(h.offset as usize + h.part_len as usize <= h.len as usize);
            assert_eq!(h.msg, expect);
            assert_eq!(&h.encode(), b);
        }
    }
    if let Ok(b) = <&[u8; frame::HELLO_LEN]>::try_from(&rest[..rest.len().min(frame::HELLO_LEN)]) {
        if let Ok(h) = Hello::decode(b) {
            assert_eq!(Hello::decode(&h.encode()), Ok(h));
        }
    }
});
