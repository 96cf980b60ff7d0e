//! The bootstrap wire format: length-prefixed frames of typed messages.
//!
//! Every byte here comes off a socket from an unauthenticated peer, so decoding checks every length and
//! count before using it and never panics; encode/decode round trips and random bytes are property-tested.
#![forbid(unsafe_code)]

use std::io::{Read, Write};

/// Largest frame accepted, in bytes.
pub const MAX_FRAME: usize = 1 << 20;
/// Largest string field, in bytes.
pub const MAX_STR: usize = 4096;
/// Largest world size braid accepts.
pub const MAX_WORLD: usize = 1 << 16;
/// Protocol magic at the start of every hello.
pub const MAGIC: [u8; 8] = *b"BRAIDBS1";
/// Protocol version.
pub const VERSION: u16 = 2;
/// Most transport endpoints one rank may publish.
pub const MAX_ENDPOINTS: usize = 16;

/// What a rank tells the root about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The communicator's secret, proving the sender was given the unique id.
    pub secret: [u8; 16],
    /// World size the sender expects.
    pub world: u32,
    /// The sender's rank.
    pub rank: u32,
    /// What the sender knows about itself.
    pub info: PeerInfo,
    /// Slots per channel the sender uses.
    pub slots: u32,
    /// Bytes per slot the sender uses.
    pub slot_bytes: u32,
}

/// A rank's identity as the others need it: its pid, its host identity and the endpoint bytes of each
/// of its transports (opaque here: each transport encodes and checks its own).
pub type PeerInfo = braid_transport::Peer;

/// A bootstrap message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Rank → root: join.
    Hello(Hello),
    /// Root → rank: everyone's info, indexed by rank.
    Table(Vec<PeerInfo>),
    /// Root → rank: the join was refused, and why.
    Refused(String),
    /// Rank → root: reached barrier `tag`.
    Barrier(u32),
    /// Root → rank: everyone reached barrier `tag`.
    Release(u32),
}

/// Why bytes could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError(format!(
                "truncated {what}: need {n} bytes, {} left",
                self.buf.len()
            )));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(
            self.take(2, what)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }
    fn string(&mut self, what: &str) -> Result<String, DecodeError> {
        let len = self.u32(what)? as usize;
        if len > MAX_STR {
            return Err(DecodeError(format!(
                "{what} of {len} bytes exceeds {MAX_STR}"
            )));
        }
        let b = self.take(len, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError(format!("{what} is not UTF-8")))
    }
    fn bytes(&mut self, what: &str) -> Result<Vec<u8>, DecodeError> {
        let len = self.u32(what)? as usize;
        if len > MAX_STR {
            return Err(DecodeError(format!(
                "{what} of {len} bytes exceeds {MAX_STR}"
            )));
        }
        Ok(self.take(len, what)?.to_vec())
    }
    fn info(&mut self) -> Result<PeerInfo, DecodeError> {
        let pid = self.u32("pid")?;
        let host = self.string("host")?;
        let n = self.u32("endpoint count")? as usize;
        if n > MAX_ENDPOINTS {
            return Err(DecodeError(format!(
                "{n} transport endpoints exceed {MAX_ENDPOINTS}"
            )));
        }
        let mut endpoints = Vec::with_capacity(n);
        for _ in 0..n {
            endpoints.push(braid_transport::Endpoint {
                transport: self.string("transport name")?,
                blob: self.bytes("endpoint")?,
            });
        }
        Ok(PeerInfo {
            pid,
            host,
            endpoints,
        })
    }
    fn end(&self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError(format!("{} trailing bytes", self.buf.len())))
        }
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u32).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_info(out: &mut Vec<u8>, i: &PeerInfo) {
    out.extend(i.pid.to_le_bytes());
    put_str(out, &i.host);
    out.extend((i.endpoints.len() as u32).to_le_bytes());
    for e in &i.endpoints {
        put_str(out, &e.transport);
        out.extend((e.blob.len() as u32).to_le_bytes());
        out.extend(&e.blob);
    }
}

impl Msg {
    /// The frame body (type byte and fields), without the length prefix.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Msg::Hello(h) => {
                out.push(1);
                out.extend(MAGIC);
                out.extend(VERSION.to_le_bytes());
                out.extend(h.secret);
                out.extend(h.world.to_le_bytes());
                out.extend(h.rank.to_le_bytes());
                out.extend(h.slots.to_le_bytes());
                out.extend(h.slot_bytes.to_le_bytes());
                put_info(&mut out, &h.info);
            }
            Msg::Table(t) => {
                out.push(2);
                out.extend((t.len() as u32).to_le_bytes());
                for i in t {
                    put_info(&mut out, i);
                }
            }
            Msg::Refused(r) => {
                out.push(3);
                put_str(&mut out, r);
            }
            Msg::Barrier(t) => {
                out.push(4);
                out.extend(t.to_le_bytes());
            }
            Msg::Release(t) => {
                out.push(5);
                out.extend(t.to_le_bytes());
            }
        }
        out
    }

    /// Decodes a frame body, checking every field.
    pub fn decode(body: &[u8]) -> Result<Msg, DecodeError> {
        let mut r = Reader { buf: body };
        let msg = match r.u8("message type")? {
            1 => {
                if r.take(8, "magic")? != MAGIC {
                    return Err(DecodeError("bad magic: not a braid bootstrap peer".into()));
                }
                let v = r.u16("version")?;
                if v != VERSION {
                    return Err(DecodeError(format!(
                        "protocol version {v}, this build speaks {VERSION}"
                    )));
                }
                let secret: [u8; 16] = r.take(16, "secret")?.try_into().expect("16 bytes");
                let world = r.u32("world")?;
                let rank = r.u32("rank")?;
                let slots = r.u32("slots")?;
                let slot_bytes = r.u32("slot bytes")?;
                let info = r.info()?;
                Msg::Hello(Hello {
                    secret,
                    world,
                    rank,
                    info,
                    slots,
                    slot_bytes,
                })
            }
            2 => {
                let n = r.u32("table length")? as usize;
                if n > MAX_WORLD {
                    return Err(DecodeError(format!(
                        "table of {n} ranks exceeds {MAX_WORLD}"
                    )));
                }
                let mut t = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    t.push(r.info()?);
                }
                Msg::Table(t)
            }
            3 => Msg::Refused(r.string("reason")?),
            4 => Msg::Barrier(r.u32("barrier tag")?),
            5 => Msg::Release(r.u32("barrier tag")?),
            t => return Err(DecodeError(format!("unknown message type {t}"))),
        };
        r.end()?;
        Ok(msg)
    }
}

/// Writes one frame: a little-endian u32 length, then the body.
pub fn write_frame(w: &mut impl Write, msg: &Msg) -> std::io::Result<()> {
    let body = msg.encode();
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend((body.len() as u32).to_le_bytes());
    frame.extend(body);
    w.write_all(&frame)?;
    w.flush()
}

/// The first frame in `buf`, the bytes received so far: `None` while it is incomplete, else the message
/// and the bytes it took. A length above [`MAX_FRAME`] is an error as soon as the length is in.
pub fn parse_frame(buf: &[u8]) -> Option<(Result<Msg, DecodeError>, usize)> {
    let len = u32::from_le_bytes(buf.get(..4)?.try_into().ok()?) as usize;
    if len > MAX_FRAME {
        return Some((
            Err(DecodeError(format!(
                "frame of {len} bytes exceeds {MAX_FRAME}"
            ))),
            buf.len(),
        ));
    }
    let body = buf.get(4..4 + len)?;
    Some((Msg::decode(body), 4 + len))
}

/// Reads one frame, refusing lengths above [`MAX_FRAME`] before allocating.
pub fn read_frame(r: &mut impl Read) -> std::io::Result<Result<Msg, DecodeError>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Ok(Err(DecodeError(format!(
            "frame of {len} bytes exceeds {MAX_FRAME}"
        ))));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(Msg::decode(&body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parse_frame_waits_for_the_whole_frame_and_refuses_huge_ones() {
        let mut frame = Vec::new();
        write_frame(&mut frame, &Msg::Refused("no".into())).unwrap();
        frame.extend([9, 9]);
        for cut in 0..frame.len() - 2 {
            assert!(parse_frame(&frame[..cut]).is_none(), "{cut} bytes");
        }
        let (m, used) = parse_frame(&frame).unwrap();
        assert_eq!(
            (m.unwrap(), used),
            (Msg::Refused("no".into()), frame.len() - 2)
        );
        let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
        assert!(parse_frame(&huge).unwrap().0.is_err());
    }

    fn info() -> impl Strategy<Value = PeerInfo> {
        (
            any::<u32>(),
            ".{0,40}",
            proptest::collection::vec(
                ("[a-z]{1,8}", proptest::collection::vec(any::<u8>(), 0..80)),
                0..4,
            ),
        )
            .prop_map(|(pid, host, eps)| PeerInfo {
                pid,
                host,
                endpoints: eps
                    .into_iter()
                    .map(|(transport, blob)| braid_transport::Endpoint { transport, blob })
                    .collect(),
            })
    }

    fn msg() -> impl Strategy<Value = Msg> {
        prop_oneof![
            (
                any::<[u8; 16]>(),
                any::<u32>(),
                any::<u32>(),
                info(),
                any::<u32>(),
                any::<u32>()
            )
                .prop_map(|(secret, world, rank, info, slots, slot_bytes)| Msg::Hello(
                    Hello {
                        secret,
                        world,
                        rank,
                        info,
                        slots,
                        slot_bytes
                    }
                )),
            prop::collection::vec(info(), 0..10).prop_map(Msg::Table),
            ".{0,100}".prop_map(Msg::Refused),
            any::<u32>().prop_map(Msg::Barrier),
            any::<u32>().prop_map(Msg::Release),
        ]
    }

    proptest! {
        #[test]
        fn round_trip(m in msg()) {
            prop_assert_eq!(Msg::decode(&m.encode()), Ok(m.clone()));
            let mut buf = Vec::new();
            write_frame(&mut buf, &m).unwrap();
            prop_assert_eq!(read_frame(&mut buf.as_slice()).unwrap(), Ok(m));
        }

        #[test]
        fn random_bytes_never_panic(b in prop::collection::vec(any::<u8>(), 0..300)) {
            let _ = Msg::decode(&b);
            let _ = read_frame(&mut b.as_slice());
        }

        #[test]
        fn truncation_is_an_error(m in msg(), cut in any::<prop::sample::Index>()) {
            let enc = m.encode();
            let cut = cut.index(enc.len());
            prop_assert!(Msg::decode(&enc[..cut]).is_err());
        }
    }

    #[test]
    fn hostile_lengths_are_refused_before_allocation() {
        let mut frame = (u32::MAX).to_le_bytes().to_vec();
        frame.extend([0u8; 8]);
        assert!(read_frame(&mut frame.as_slice())
            .unwrap()
            .unwrap_err()
            .0
            .contains("exceeds"));
        let mut body = vec![2u8];
        body.extend((u32::MAX).to_le_bytes());
        assert!(Msg::decode(&body).unwrap_err().0.contains("exceeds"));
        let mut body = vec![3u8];
        body.extend((MAX_STR as u32 + 1).to_le_bytes());
        assert!(Msg::decode(&body).unwrap_err().0.contains("exceeds"));
        let mut hello = Msg::Hello(Hello {
            secret: [0; 16],
            world: 2,
            rank: 1,
            info: PeerInfo {
                pid: 1,
                host: "h".into(),
                endpoints: vec![braid_transport::Endpoint {
                    transport: "shm".into(),
                    blob: b"p".to_vec(),
                }],
            },
            slots: 2,
            slot_bytes: 64,
        })
        .encode();
        hello[1] = b'X';
        assert!(Msg::decode(&hello).unwrap_err().0.contains("magic"));
        assert!(Msg::decode(&[9])
            .unwrap_err()
            .0
            .contains("unknown message type 9"));
    }
}
