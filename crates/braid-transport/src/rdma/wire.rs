//! The RDMA link's pure parts: the device filter (`BRAID_IB_HCA`), the endpoint it publishes, the
//! connection message two ranks exchange, the immediate data of its writes, the header of a slot and
//! how a message is striped over queue pairs. No verbs, no sockets: unit- and property-tested.

use std::net::SocketAddr;

use braid_core::Error;

/// `BRAID_IB_HCA`, in NCCL's syntax: a comma-separated list of `device[:port]` (a name prefix, or the
/// exact name after a leading `=`); a leading `^` makes it a list of devices *not* to use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HcaFilter {
    exclude: bool,
    exact: bool,
    items: Vec<(String, Option<u8>)>,
}

impl HcaFilter {
    /// Parses the setting; empty means every device.
    pub fn parse(setting: &str) -> Result<HcaFilter, Error> {
        let mut s = setting.trim();
        let mut f = HcaFilter::default();
        if let Some(rest) = s.strip_prefix('^') {
            f.exclude = true;
            s = rest;
        }
        if let Some(rest) = s.strip_prefix('=') {
            f.exact = true;
            s = rest;
        }
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, port) = match item.split_once(':') {
                Some((n, p)) => {
                    let port: u8 = p.trim().parse().ok().filter(|p| *p > 0).ok_or_else(|| {
                        Error::invalid(format!(
                            "BRAID_IB_HCA={setting:?}: {p:?} in {item:?} is not a port number (1-255)"
                        ))
                    })?;
                    (n.trim(), Some(port))
                }
                None => (item, None),
            };
            if name.is_empty() {
                return Err(Error::invalid(format!(
                    "BRAID_IB_HCA={setting:?}: {item:?} names no device"
                )));
            }
            f.items.push((name.to_string(), port));
        }
        if (f.exclude || f.exact) && f.items.is_empty() {
            return Err(Error::invalid(format!(
                "BRAID_IB_HCA={setting:?} names no device"
            )));
        }
        Ok(f)
    }

    /// Whether port `port` of device `name` may be used.
    pub fn allows(&self, name: &str, port: u8) -> bool {
        if self.items.is_empty() {
            return true;
        }
        let listed = self.items.iter().any(|(n, p)| {
            let name_ok = if self.exact {
                name == n
            } else {
                name.starts_with(n.as_str())
            };
            name_ok && p.is_none_or(|p| p == port)
        });
        listed != self.exclude
    }
}

/// The endpoint a rank publishes: the device and port it uses (for messages and `braid topo`) and
/// the address of its connection socket, where peers fetch its queue pairs and keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaEndpoint {
    /// The device's name.
    pub device: String,
    /// The port.
    pub port: u8,
    /// Where to connect.
    pub addr: SocketAddr,
}

impl RdmaEndpoint {
    /// As text: `device:port@address`.
    pub fn encode(&self) -> Vec<u8> {
        format!("{}:{}@{}", self.device, self.port, self.addr).into_bytes()
    }

    /// Reads the text form back, refusing anything else.
    pub fn decode(bytes: &[u8]) -> Result<RdmaEndpoint, Error> {
        let bad = || {
            Error::Bootstrap(format!(
                "an RDMA endpoint {:?} is not device:port@address",
                String::from_utf8_lossy(&bytes[..bytes.len().min(96)])
            ))
        };
        let text = std::str::from_utf8(bytes).map_err(|_| bad())?;
        let (dev, addr) = text.split_once('@').ok_or_else(bad)?;
        let (device, port) = dev.rsplit_once(':').ok_or_else(bad)?;
        if device.is_empty() || device.len() > 64 {
            return Err(bad());
        }
        Ok(RdmaEndpoint {
            device: device.to_string(),
            port: port.parse().map_err(|_| bad())?,
            addr: addr.parse().map_err(|_| bad())?,
        })
    }
}

/// What one rank tells one peer when they connect: who it is, the geometry it runs, its queue pairs
/// and where the peer may write (its slots for the peer, and its credit words for the peer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Connect {
    /// The communicator's secret.
    pub secret: [u8; 16],
    /// The sender's rank.
    pub from: u32,
    /// The rank it means to reach.
    pub to: u32,
    /// Channels per peer.
    pub channels: u32,
    /// Slots per ring.
    pub slots: u32,
    /// Payload bytes per slot.
    pub slot_bytes: u32,
    /// Its port's GID.
    pub gid: [u8; 16],
    /// Its port's LID.
    pub lid: u16,
    /// `IBV_MTU_*` of its port.
    pub mtu: u8,
    /// The first packet sequence number of its queue pairs.
    pub psn: u32,
    /// Its queue pair numbers for this peer (`BRAID_IB_QPS_PER_PEER` of them).
    pub qpns: Vec<u32>,
    /// Address and key of its slot rings for this peer.
    pub ring: (u64, u32),
    /// Address and key of its credit words for this peer.
    pub credit: (u64, u32),
}

/// Magic and version of a [`Connect`] message.
const CONNECT_MAGIC: &[u8; 8] = b"braidib1";
/// Bytes of a [`Connect`] message before its queue pair numbers.
const CONNECT_FIXED: usize = 8 + 16 + 4 * 5 + 16 + 2 + 1 + 4 + 1 + 8 + 4 + 8 + 4;
/// The most queue pairs per peer.
pub const MAX_QPS: usize = 16;

impl Connect {
    /// The message's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut o = Vec::with_capacity(CONNECT_FIXED + 4 * self.qpns.len());
        o.extend_from_slice(CONNECT_MAGIC);
        o.extend_from_slice(&self.secret);
        for v in [
            self.from,
            self.to,
            self.channels,
            self.slots,
            self.slot_bytes,
        ] {
            o.extend_from_slice(&v.to_le_bytes());
        }
        o.extend_from_slice(&self.gid);
        o.extend_from_slice(&self.lid.to_le_bytes());
        o.push(self.mtu);
        o.extend_from_slice(&self.psn.to_le_bytes());
        o.push(self.qpns.len() as u8);
        o.extend_from_slice(&self.ring.0.to_le_bytes());
        o.extend_from_slice(&self.ring.1.to_le_bytes());
        o.extend_from_slice(&self.credit.0.to_le_bytes());
        o.extend_from_slice(&self.credit.1.to_le_bytes());
        for q in &self.qpns {
            o.extend_from_slice(&q.to_le_bytes());
        }
        o
    }

    /// How many more bytes a message that starts with `got` needs (0 when whole, or when it can be
    /// seen to be bad: [`Connect::decode`] then says why).
    pub fn remaining(got: &[u8]) -> usize {
        if got.len() < CONNECT_FIXED {
            return CONNECT_FIXED - got.len();
        }
        if &got[..8] != CONNECT_MAGIC {
            return 0;
        }
        let n = got[CONNECT_FIXED - 8 - 4 - 8 - 4 - 1] as usize;
        if n == 0 || n > MAX_QPS {
            return 0;
        }
        (CONNECT_FIXED + 4 * n).saturating_sub(got.len())
    }

    /// Decodes a whole message, refusing anything malformed.
    pub fn decode(b: &[u8]) -> Result<Connect, Error> {
        let bad = |why: &str| Error::Bootstrap(format!("a bad RDMA connection message: {why}"));
        if b.len() < CONNECT_FIXED {
            return Err(bad("too short"));
        }
        if &b[..8] != CONNECT_MAGIC {
            return Err(bad("not braid's (wrong magic or version)"));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let mut secret = [0u8; 16];
        secret.copy_from_slice(&b[8..24]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[44..60]);
        let n = b[67] as usize;
        if n == 0 || n > MAX_QPS {
            return Err(bad(&format!("{n} queue pairs (1 to {MAX_QPS})")));
        }
        if b.len() != CONNECT_FIXED + 4 * n {
            return Err(bad(&format!(
                "{} bytes for {n} queue pairs (expected {})",
                b.len(),
                CONNECT_FIXED + 4 * n
            )));
        }
        Ok(Connect {
            secret,
            from: u32_at(24),
            to: u32_at(28),
            channels: u32_at(32),
            slots: u32_at(36),
            slot_bytes: u32_at(40),
            gid,
            lid: u16::from_le_bytes([b[60], b[61]]),
            mtu: b[62],
            psn: u32_at(63),
            ring: (u64_at(68), u32_at(76)),
            credit: (u64_at(80), u32_at(88)),
            qpns: (0..n).map(|i| u32_at(CONNECT_FIXED + 4 * i)).collect(),
        })
    }
}

/// What the immediate data of an incoming write says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Imm {
    /// One part of a message: it landed in slot `slot` of channel `ch`, which takes `parts` parts;
    /// `msg` is the low byte of the message's number (a check of order).
    Data {
        /// The channel.
        ch: u8,
        /// The slot.
        slot: u8,
        /// Parts of the whole message.
        parts: u8,
        /// The message's number, low byte.
        msg: u8,
    },
    /// The peer's credit word for channel `ch` moved (it released messages).
    Credit {
        /// The channel.
        ch: u8,
    },
}

/// Set in credit immediates.
const IMM_CREDIT: u32 = 1 << 31;

impl Imm {
    /// The 32 bits carried.
    pub fn encode(self) -> u32 {
        match self {
            // ch < 128 (bits 30..24), slot, parts, msg.
            Imm::Data {
                ch,
                slot,
                parts,
                msg,
            } => {
                (u32::from(ch & 0x7f) << 24)
                    | (u32::from(slot) << 16)
                    | (u32::from(parts) << 8)
                    | u32::from(msg)
            }
            Imm::Credit { ch } => IMM_CREDIT | (u32::from(ch & 0x7f) << 24),
        }
    }

    /// Reads 32 bits back.
    pub fn decode(v: u32) -> Imm {
        let ch = ((v >> 24) & 0x7f) as u8;
        if v & IMM_CREDIT != 0 {
            Imm::Credit { ch }
        } else {
            Imm::Data {
                ch,
                slot: (v >> 16) as u8,
                parts: (v >> 8) as u8,
                msg: v as u8,
            }
        }
    }
}

/// The most channels, slots and parts the immediate can name.
pub const MAX_CHANNELS: usize = 128;
/// See [`MAX_CHANNELS`].
pub const MAX_SLOTS: usize = 256;

/// Bytes of a slot's header, before its payload.
pub const HEADER: usize = 16;
const HEADER_MAGIC: u32 = 0x6272_6469; // "brdi"

/// A slot's header: the payload's length, its tag and the message's number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Payload bytes.
    pub len: u32,
    /// The tag it was posted with.
    pub tag: u32,
    /// The message's number on its (peer, channel).
    pub msg: u32,
}

impl Header {
    /// Its bytes.
    pub fn encode(&self) -> [u8; HEADER] {
        let mut o = [0u8; HEADER];
        o[..4].copy_from_slice(&self.len.to_le_bytes());
        o[4..8].copy_from_slice(&self.tag.to_le_bytes());
        o[8..12].copy_from_slice(&self.msg.to_le_bytes());
        o[12..].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
        o
    }

    /// Reads a header of a slot of `slot_bytes`, refusing one that cannot be right.
    pub fn decode(b: &[u8; HEADER], slot_bytes: usize) -> Result<Header, String> {
        let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        if w(12) != HEADER_MAGIC {
            return Err("a slot without a header (corrupted or written elsewhere)".into());
        }
        let h = Header {
            len: w(0),
            tag: w(4),
            msg: w(8),
        };
        if h.len as usize > slot_bytes {
            return Err(format!(
                "a message of {} bytes in a slot of {slot_bytes}",
                h.len
            ));
        }
        Ok(h)
    }
}

/// Below this many bytes per part, a message is not split further over queue pairs.
pub const STRIPE_MIN: usize = 64 * 1024;

/// How a message of `total` bytes (header included) is split over `qps` queue pairs: byte ranges,
/// part `i` on queue pair `i`. One part when the message is small.
pub fn stripes(total: usize, qps: usize) -> Vec<(usize, usize)> {
    let parts = total.div_ceil(STRIPE_MIN).clamp(1, qps.max(1));
    // Part boundaries on 64-byte multiples, so that parts start aligned.
    let per = total.div_ceil(parts).next_multiple_of(64);
    let mut out = Vec::with_capacity(parts);
    let mut at = 0;
    while at < total {
        let end = (at + per).min(total);
        out.push((at, end - at));
        at = end;
    }
    if out.is_empty() {
        out.push((0, 0));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hca_filters_follow_nccl() {
        let f = HcaFilter::parse("mlx5_0:1,mlx5_1").unwrap();
        assert!(f.allows("mlx5_0", 1) && !f.allows("mlx5_0", 2));
        assert!(f.allows("mlx5_1", 2) && f.allows("mlx5_10", 1));
        assert!(!f.allows("rxe0", 1));
        let f = HcaFilter::parse("=mlx5_1").unwrap();
        assert!(f.allows("mlx5_1", 1) && !f.allows("mlx5_10", 1));
        let f = HcaFilter::parse("^rxe1").unwrap();
        assert!(f.allows("rxe0", 1) && !f.allows("rxe1", 1));
        assert!(HcaFilter::parse("").unwrap().allows("anything", 3));
        for bad in ["mlx5_0:x", "mlx5_0:0", ":1", "^", "^="] {
            let e = HcaFilter::parse(bad).unwrap_err().to_string();
            assert!(e.contains("BRAID_IB_HCA"), "{bad}: {e}");
        }
    }

    #[test]
    fn endpoints_read_back_and_bad_ones_are_refused() {
        let e = RdmaEndpoint {
            device: "rxe0".into(),
            port: 1,
            addr: "10.77.0.1:4711".parse().unwrap(),
        };
        assert_eq!(RdmaEndpoint::decode(&e.encode()).unwrap(), e);
        let v6 = RdmaEndpoint {
            device: "mlx5_0".into(),
            port: 2,
            addr: "[fe80::1]:9".parse().unwrap(),
        };
        assert_eq!(RdmaEndpoint::decode(&v6.encode()).unwrap(), v6);
        for bad in [
            &b"rxe0@1.2.3.4:5"[..],
            b"rxe0:1",
            b":1@1.2.3.4:5",
            b"rxe0:x@1.2.3.4:5",
            b"\xff",
        ] {
            assert!(RdmaEndpoint::decode(bad).is_err(), "{bad:?}");
        }
    }

    fn connect() -> Connect {
        Connect {
            secret: [7; 16],
            from: 3,
            to: 1,
            channels: 2,
            slots: 8,
            slot_bytes: 131072,
            gid: [0xfe; 16],
            lid: 9,
            mtu: 3,
            psn: 0x12_3456,
            qpns: vec![17, 18, 19],
            ring: (0x7f00_0000_1000, 0xabcd),
            credit: (0x7f00_0000_2000, 0x1234),
        }
    }

    #[test]
    fn connect_messages_read_back_in_pieces_and_refuse_garbage() {
        let c = connect();
        let b = c.encode();
        assert_eq!(Connect::remaining(&[]), CONNECT_FIXED);
        assert_eq!(Connect::remaining(&b[..CONNECT_FIXED]), 12);
        assert_eq!(Connect::remaining(&b), 0);
        assert_eq!(Connect::decode(&b).unwrap(), c);
        let mut wrong = b.clone();
        wrong[0] = b'x';
        assert_eq!(Connect::remaining(&wrong[..CONNECT_FIXED]), 0);
        assert!(Connect::decode(&wrong)
            .unwrap_err()
            .to_string()
            .contains("magic"));
        assert!(Connect::decode(&b[..b.len() - 1]).is_err());
        let mut many = b.clone();
        many[67] = 200;
        assert_eq!(Connect::remaining(&many), 0);
        assert!(Connect::decode(&many).is_err());
    }

    proptest! {
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Connect::decode(&bytes);
            let _ = Connect::remaining(&bytes);
            let _ = RdmaEndpoint::decode(&bytes);
        }

        #[test]
        fn immediates_read_back(ch in 0u8..128, slot: u8, parts: u8, msg: u8) {
            let d = Imm::Data { ch, slot, parts, msg };
            prop_assert_eq!(Imm::decode(d.encode()), d);
            let c = Imm::Credit { ch };
            prop_assert_eq!(Imm::decode(c.encode()), c);
        }

        #[test]
        fn stripes_cover_the_message_once(total in 0usize..2_000_000, qps in 1usize..=16) {
            let s = stripes(total, qps);
            prop_assert!(!s.is_empty() && s.len() <= qps);
            let mut at = 0;
            for (off, len) in &s {
                prop_assert_eq!(*off, at);
                prop_assert!(off % 64 == 0);
                at += len;
            }
            prop_assert_eq!(at, total);
            if total <= STRIPE_MIN {
                prop_assert_eq!(s.len(), 1);
            }
        }
    }

    #[test]
    fn headers_read_back_and_lies_are_caught() {
        let h = Header {
            len: 100,
            tag: 7,
            msg: 3,
        };
        assert_eq!(Header::decode(&h.encode(), 100).unwrap(), h);
        assert!(Header::decode(&h.encode(), 99)
            .unwrap_err()
            .contains("100 bytes"));
        assert!(Header::decode(&[0; HEADER], 100).is_err());
    }
}
