//! Bytes off an RDMA connection socket and out of a peer-written slot: the connection message two
//! ranks swap, the endpoint text from the bootstrap, a slot's header and a write's immediate. Decoding
//! must never panic; whatever it accepts must round-trip (and a header must fit its slot).
#![no_main]

use braid_transport::rdma::wire::{Connect, Header, Imm, RdmaEndpoint, HEADER};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // However the bytes arrive, the reader asks for no more than a whole message.
    let want = Connect::remaining(data);
    assert!(want <= 92 + 4 * 16);
    if let Ok(c) = Connect::decode(data) {
        assert_eq!(Connect::decode(&c.encode()), Ok(c.clone()));
        assert_eq!(c.encode().len(), data.len());
    }
    if let Ok(e) = RdmaEndpoint::decode(data) {
        assert_eq!(RdmaEndpoint::decode(&e.encode()), Ok(e));
    }
    if let Ok(b) = <&[u8; HEADER]>::try_from(&data[..data.len().min(HEADER)]) {
        let slot_bytes = 1 << 16;
        if let Ok(h) = Header::decode(b, slot_bytes) {
            assert!(h.len as usize <= slot_bytes);
            assert_eq!(&h.encode(), b);
        }
    }
    if data.len() >= 4 {
        let v = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        let i = Imm::decode(v);
        assert_eq!(Imm::decode(i.encode()), i);
    }
});
