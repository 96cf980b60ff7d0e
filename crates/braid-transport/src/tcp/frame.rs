//! What travels on a TCP connection, and its validation: the hello that opens a connection and the
//! header in front of every part of a message. Bytes from a socket are untrusted; everything is checked
//! before a byte of payload is written anywhere.
#![forbid(unsafe_code)]

/// First bytes of every connection.
pub const HELLO_MAGIC: [u8; 8] = *b"BRAIDTCP";
/// Version of this protocol; both ends must speak the same.
pub const VERSION: u32 = 2;
/// Size of an encoded [`Hello`].
pub const HELLO_LEN: usize = 8 + 4 * 8 + 16;
/// Marks every part header.
pub const PART_MAGIC: u32 = 0x5452_4150; // "PART"
/// Size of an encoded [`PartHeader`].
pub const PART_LEN: usize = 24;
/// Messages up to this size travel whole on one connection even when there are several: splitting them
/// would only add headers.
pub const SPLIT_MIN: usize = 16 * 1024;

/// Opens a connection: who is sending, to whom, on which of its connections, and the secret.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The communicator's secret.
    pub secret: [u8; 16],
    /// The sending rank.
    pub from: u32,
    /// The receiving rank.
    pub to: u32,
    /// Which of the sender's connections to `to` this is (channel `socket / sockets`).
    pub socket: u32,
    /// How many connections per channel the sender opens to `to`.
    pub sockets: u32,
    /// Channels per pair of ranks; each has its own connections.
    pub channels: u32,
    /// Slots per channel.
    pub slots: u32,
    /// Bytes per slot.
    pub slot_bytes: u32,
}

impl Hello {
    /// The fixed-size encoding.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[..8].copy_from_slice(&HELLO_MAGIC);
        let words = [
            VERSION,
            self.from,
            self.to,
            self.socket,
            self.sockets,
            self.channels,
            self.slots,
            self.slot_bytes,
        ];
        for (i, w) in words.iter().enumerate() {
            out[8 + 4 * i..12 + 4 * i].copy_from_slice(&w.to_le_bytes());
        }
        out[40..].copy_from_slice(&self.secret);
        out
    }

    /// Decodes a hello; checks the magic and the version only (the acceptor checks the rest).
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, String> {
        if b[..8] != HELLO_MAGIC {
            return Err("not a braid connection (bad magic)".into());
        }
        let w =
            |i: usize| u32::from_le_bytes(b[8 + 4 * i..12 + 4 * i].try_into().expect("4 bytes"));
        if w(0) != VERSION {
            return Err(format!(
                "protocol version {} where {VERSION} was expected",
                w(0)
            ));
        }
        Ok(Hello {
            from: w(1),
            to: w(2),
            socket: w(3),
            sockets: w(4),
            channels: w(5),
            slots: w(6),
            slot_bytes: w(7),
            secret: b[40..].try_into().expect("16 bytes"),
        })
    }
}

/// The header in front of one part of a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartHeader {
    /// The collective tag the message belongs to.
    pub tag: u32,
    /// The message's number on this channel (wrapping).
    pub msg: u32,
    /// Total length of the message.
    pub len: u32,
    /// Where this part starts in the message.
    pub offset: u32,
    /// Bytes of this part.
    pub part_len: u32,
}

impl PartHeader {
    /// The fixed-size encoding.
    pub fn encode(&self) -> [u8; PART_LEN] {
        let mut out = [0u8; PART_LEN];
        for (i, w) in [
            PART_MAGIC,
            self.tag,
            self.msg,
            self.len,
            self.offset,
            self.part_len,
        ]
        .iter()
        .enumerate()
        {
            out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// Decodes and validates a header received on connection `socket` of `sockets`, where message
    /// `expect_msg` is due and slots hold `slot_bytes`: the magic, the message number, the length and
    /// the exact part layout ([`part_range`]) must all be as the protocol says.
    pub fn decode(
        b: &[u8; PART_LEN],
        expect_msg: u32,
        socket: usize,
        sockets: usize,
        slot_bytes: usize,
    ) -> Result<PartHeader, String> {
        let w = |i: usize| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        if w(0) != PART_MAGIC {
            return Err(format!("bad part magic {:#010x}", w(0)));
        }
        let h = PartHeader {
            tag: w(1),
            msg: w(2),
            len: w(3),
            offset: w(4),
            part_len: w(5),
        };
        if h.msg != expect_msg {
            return Err(format!(
                "message #{} arrived where #{expect_msg} was due",
                h.msg
            ));
        }
        if h.len as usize > slot_bytes {
            return Err(format!(
                "message of {} bytes exceeds the slot size {slot_bytes}",
                h.len
            ));
        }
        let want = part_range(h.len as usize, h.msg, socket, sockets);
        if (h.offset as usize, h.part_len as usize) != (want.start, want.len()) {
            return Err(format!(
                "part {}..{} of a {}-byte message on connection {socket} (expected {}..{})",
                h.offset,
                h.offset as u64 + h.part_len as u64,
                h.len,
                want.start,
                want.end
            ));
        }
        Ok(h)
    }
}

/// The bytes of message `msg` (of `len` bytes) that connection `socket` of `sockets` carries. A small
/// message travels whole on connection `msg % sockets` (the others carry an empty part, which keeps every
/// connection's message numbers consecutive); a large one is split into 64-byte-aligned parts.
pub fn part_range(len: usize, msg: u32, socket: usize, sockets: usize) -> std::ops::Range<usize> {
    debug_assert!(socket < sockets);
    if sockets == 1 {
        return 0..len;
    }
    if len < SPLIT_MIN {
        return if msg as usize % sockets == socket {
            0..len
        } else {
            0..0
        };
    }
    let part = len.div_ceil(sockets).next_multiple_of(64);
    let start = (socket * part).min(len);
    start..(start + part).min(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn parts_tile_every_message(len in 0usize..1 << 20, msg in any::<u32>(), sockets in 1usize..9) {
            let mut next = 0;
            let mut covered = 0;
            let mut nonempty = 0;
            for s in 0..sockets {
                let r = part_range(len, msg, s, sockets);
                if !r.is_empty() {
                    prop_assert_eq!(r.start, next);
                    next = r.end;
                    nonempty += 1;
                }
                covered += r.len();
            }
            prop_assert_eq!(covered, len);
            prop_assert_eq!(next, len);
            if len < SPLIT_MIN {
                prop_assert!(nonempty <= 1);
            }
        }

        #[test]
        fn headers_round_trip(tag in any::<u32>(), msg in any::<u32>(), len in 0usize..=4096, sockets in 1usize..5) {
            for s in 0..sockets {
                let r = part_range(len, msg, s, sockets);
                let h = PartHeader { tag, msg, len: len as u32, offset: r.start as u32, part_len: r.len() as u32 };
                prop_assert_eq!(PartHeader::decode(&h.encode(), msg, s, sockets, 4096), Ok(h));
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::array::uniform24(any::<u8>()), expect in any::<u32>(), sockets in 1usize..5) {
            if let Ok(h) = PartHeader::decode(&b, expect, 0, sockets, 1 << 16) {
                prop_assert!(h.len as usize <= 1 << 16);
                prop_assert!((h.offset + h.part_len) as usize <= h.len as usize);
            }
        }

        #[test]
        fn hello_round_trips(secret in any::<[u8; 16]>(), from in any::<u32>(), to in any::<u32>(), socket in any::<u32>()) {
            let h = Hello { secret, from, to, socket, sockets: 2, channels: 2, slots: 8, slot_bytes: 1 << 17 };
            prop_assert_eq!(Hello::decode(&h.encode()), Ok(h));
        }
    }

    #[test]
    fn bad_headers_are_named() {
        let good = PartHeader {
            tag: 1,
            msg: 5,
            len: 100,
            offset: 0,
            part_len: 100,
        };
        let cases = [
            (PartHeader { msg: 6, ..good }, "was due"),
            (
                PartHeader {
                    len: 5000,
                    part_len: 5000,
                    ..good
                },
                "exceeds the slot size",
            ),
            (PartHeader { offset: 1, ..good }, "expected 0..100"),
            (
                PartHeader {
                    part_len: 99,
                    ..good
                },
                "expected 0..100",
            ),
        ];
        for (h, want) in cases {
            let e = PartHeader::decode(&h.encode(), 5, 0, 1, 4096).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let mut b = good.encode();
        b[0] ^= 1;
        assert!(PartHeader::decode(&b, 5, 0, 1, 4096)
            .unwrap_err()
            .contains("magic"));
        let mut h = Hello {
            secret: [7; 16],
            from: 1,
            to: 0,
            socket: 0,
            sockets: 1,
            channels: 1,
            slots: 8,
            slot_bytes: 64,
        }
        .encode();
        h[8] = 9;
        assert!(Hello::decode(&h).unwrap_err().contains("version"));
        h[0] = b'X';
        assert!(Hello::decode(&h).unwrap_err().contains("magic"));
    }
}
