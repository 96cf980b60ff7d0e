//! Bootstrap over TCP: every rank tells the root who it is; the root checks the secret and the
//! parameters, then sends everyone the full table; the same connections then carry barriers until the
//! communicator's transports are up.
//!
//! The root reads each connection on its own thread with a deadline, so a flood of silent, slow or
//! malformed connections cannot stop the real ranks from joining.

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use braid_core::Error;
use braid_transport::greet::{Greeted, Greeter};
use braid_transport::tcp::same_secret;
use tracing::{debug, warn};

use crate::id::UniqueId;
use crate::wire::{
    parse_frame, read_frame, write_frame, Hello, Msg, PeerInfo, MAX_FRAME, MAX_WORLD,
};

/// Parameters every rank must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Agreed {
    pub world: usize,
    pub slots: u32,
    pub slot_bytes: u32,
}

/// The bootstrap connections kept for barriers during setup.
pub(crate) enum Links {
    /// A communicator of one rank.
    Alone,
    /// Rank 0: one connection per other rank (index `r - 1`).
    Root(Vec<TcpStream>),
    /// Any other rank: the connection to the root.
    Peer(TcpStream),
}

fn remaining(deadline: Instant, what: &str) -> Result<Duration, Error> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(Error::Bootstrap(format!("timed out {what}")));
    }
    Ok(left)
}

fn recv(stream: &mut TcpStream, deadline: Instant, what: &str) -> Result<Msg, Error> {
    stream
        .set_read_timeout(Some(remaining(deadline, what)?))
        .map_err(|e| Error::io(what.to_string(), e))?;
    match read_frame(stream) {
        Ok(Ok(m)) => Ok(m),
        Ok(Err(e)) => Err(Error::Bootstrap(format!("{what}: malformed message: {e}"))),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            Err(Error::Bootstrap(format!("timed out {what}")))
        }
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => Err(Error::Bootstrap(format!(
            "{what}: the other side closed the connection"
        ))),
        Err(e) => Err(Error::io(what.to_string(), e)),
    }
}

fn send(stream: &mut TcpStream, msg: &Msg, what: &str) -> Result<(), Error> {
    write_frame(stream, msg).map_err(|e| Error::io(what.to_string(), e))
}

/// Joins the communicator named by `id` as `rank`; returns everyone's info (indexed by rank) and the
/// links for later barriers.
pub(crate) fn join(
    id: &UniqueId,
    rank: usize,
    agreed: Agreed,
    me: PeerInfo,
    deadline: Instant,
) -> Result<(Vec<PeerInfo>, Links), Error> {
    if agreed.world == 1 {
        // Nobody will connect: the listener `UniqueId::new` bound for this id goes now.
        drop(id.take_listener());
        return Ok((vec![me], Links::Alone));
    }
    if agreed.world > MAX_WORLD {
        return Err(Error::invalid(format!(
            "world size {} exceeds {MAX_WORLD}",
            agreed.world
        )));
    }
    if rank == 0 {
        root(id, agreed, me, deadline)
    } else {
        peer(id, rank, agreed, me, deadline)
    }
}

fn bind_root(id: &UniqueId) -> Result<TcpListener, Error> {
    if let Some(l) = id.take_listener() {
        return Ok(l);
    }
    if let Some(l) = id.inherited_listener()? {
        return Ok(l);
    }
    let addr = id.addr();
    TcpListener::bind(addr)
        .or_else(|e| {
            // The advertised address may not be an address of this host (NAT, a DNS alias):
            // listen on every interface at that port instead.
            debug!("binding {addr} failed ({e}); trying every interface");
            TcpListener::bind(SocketAddr::new(
                std::net::Ipv4Addr::UNSPECIFIED.into(),
                addr.port(),
            ))
        })
        .map_err(|e| Error::io(format!("rank 0 binding the bootstrap address {addr}"), e))
}

/// Connections that have not yet said hello, at most: past this the oldest is dropped (a real rank
/// speaks at once), so idle connections can neither exhaust the root nor keep a rank out.
const MAX_PENDING: usize = 64;

/// How long a connection may take to say hello.
const HELLO_WITHIN: Duration = Duration::from_secs(10);

/// Bytes still missing from the frame that starts `buf` (0 once it is whole, or once its length is
/// seen to be too large).
fn frame_remaining(buf: &[u8]) -> usize {
    match buf.get(..4) {
        None => 4 - buf.len(),
        Some(l) => {
            let len = u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize;
            if len > MAX_FRAME {
                0
            } else {
                (4 + len).saturating_sub(buf.len())
            }
        }
    }
}

fn root(
    id: &UniqueId,
    agreed: Agreed,
    me: PeerInfo,
    deadline: Instant,
) -> Result<(Vec<PeerInfo>, Links), Error> {
    let listener = bind_root(id)?;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("bootstrap listener", e))?;
    let (table, mut conns) = collect(&listener, agreed, id, me, deadline)?;
    for (i, c) in conns.iter_mut().enumerate() {
        send(
            c,
            &Msg::Table(table.clone()),
            &format!("sending the table to rank {}", i + 1),
        )?;
    }
    Ok((table, Links::Root(conns)))
}

/// Serves the listener on this thread until every rank has said hello: accepts, reads what each
/// pending connection has sent without blocking, and answers each complete hello.
fn collect(
    listener: &TcpListener,
    agreed: Agreed,
    id: &UniqueId,
    me: PeerInfo,
    deadline: Instant,
) -> Result<(Vec<PeerInfo>, Vec<TcpStream>), Error> {
    let world = agreed.world;
    let mut infos: Vec<Option<PeerInfo>> = vec![None; world];
    let mut conns: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    infos[0] = Some(me);
    let mut joined = 1;
    let mut greeter = Greeter::new("bootstrap", MAX_PENDING, HELLO_WITHIN);
    while joined < world {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<String> = (0..world)
                .filter(|r| infos[*r].is_none())
                .map(|r| r.to_string())
                .collect();
            return Err(Error::Bootstrap(format!(
                "timed out waiting for ranks [{}] to join ({joined} of {world} joined)",
                missing.join(", ")
            )));
        }
        let (greeted, busy) = greeter.poll(listener, now, deadline, frame_remaining);
        for Greeted {
            mut stream,
            from,
            first,
        } in greeted
        {
            let refusal = match first.map(|b| parse_frame(&b).map(|(m, _)| m)) {
                Ok(Some(Ok(Msg::Hello(h)))) => match check_hello(&h, agreed, id, &infos) {
                    Ok(()) => {
                        let r = h.rank as usize;
                        debug!("bootstrap: rank {r} joined from {from}");
                        infos[r] = Some(h.info);
                        conns[r] = Some(stream);
                        joined += 1;
                        continue;
                    }
                    Err(reason) => reason,
                },
                Ok(Some(Ok(other))) => {
                    format!("expected a hello, got message {:?}", other.encode().first())
                }
                Ok(Some(Err(e))) => format!("malformed message: {e}"),
                Ok(None) => "an incomplete hello".to_string(),
                Err(why) => {
                    debug!("bootstrap: a connection from {from}: {why}");
                    continue;
                }
            };
            warn!("bootstrap: refused a connection from {from}: {refusal}");
            let _ = stream.set_nonblocking(false);
            let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = write_frame(&mut stream, &Msg::Refused(refusal));
        }
        if !busy {
            std::thread::sleep(Duration::from_micros(500));
        }
    }
    let table: Vec<PeerInfo> = infos.into_iter().flatten().collect();
    let conns: Vec<TcpStream> = conns.drain(1..).flatten().collect();
    if table.len() != world || conns.len() != world - 1 {
        return Err(Error::Internal("the bootstrap lost a rank".into()));
    }
    Ok((table, conns))
}

fn check_hello(
    h: &Hello,
    agreed: Agreed,
    id: &UniqueId,
    infos: &[Option<PeerInfo>],
) -> Result<(), String> {
    if !same_secret(&h.secret, id.secret()) {
        return Err("wrong secret: this connection does not belong to the communicator".into());
    }
    if h.world as usize != agreed.world {
        return Err(format!(
            "rank {} expects world size {}, the root has {}",
            h.rank, h.world, agreed.world
        ));
    }
    let r = h.rank as usize;
    if r == 0 || r >= agreed.world {
        return Err(format!("rank {r} is out of range 1..{}", agreed.world));
    }
    if infos[r].is_some() {
        return Err(format!("rank {r} has already joined"));
    }
    if h.slots != agreed.slots || h.slot_bytes != agreed.slot_bytes {
        return Err(format!(
            "rank {r} uses {} slots of {} bytes, the root {} of {} (set BRAID_SLOTS and BRAID_CHUNK_BYTES alike on every rank)",
            h.slots, h.slot_bytes, agreed.slots, agreed.slot_bytes
        ));
    }
    Ok(())
}

fn peer(
    id: &UniqueId,
    rank: usize,
    agreed: Agreed,
    me: PeerInfo,
    deadline: Instant,
) -> Result<(Vec<PeerInfo>, Links), Error> {
    let addr = id.addr();
    let mut pause = Duration::from_millis(5);
    let mut stream = loop {
        let left = remaining(deadline, &format!("connecting to the root at {addr}"))?;
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(2))) {
            Ok(s) if !braid_transport::tcp::connected_to_itself(&s) => break s,
            Ok(_) => {
                // Connecting to a local port nobody listens on yet can pick that very port as the
                // source and connect to itself, which would also keep rank 0 from binding it.
                debug!("rank {rank}: a connection to {addr} reached itself; retrying");
                std::thread::sleep(pause.min(left));
            }
            Err(e) => {
                debug!("rank {rank}: root at {addr} not reachable yet: {e}");
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(Duration::from_millis(200));
            }
        }
    };
    let _ = stream.set_nodelay(true);
    let hello = Hello {
        secret: *id.secret(),
        world: agreed.world as u32,
        rank: rank as u32,
        info: me.clone(),
        slots: agreed.slots,
        slot_bytes: agreed.slot_bytes,
    };
    send(&mut stream, &Msg::Hello(hello), "sending the hello")?;
    match recv(&mut stream, deadline, "waiting for the root's table")? {
        Msg::Table(t) if t.len() == agreed.world && t[rank] == me => Ok((t, Links::Peer(stream))),
        Msg::Table(t) => Err(Error::Bootstrap(format!(
            "the root sent a table of {} ranks that does not list this rank",
            t.len()
        ))),
        Msg::Refused(why) => Err(Error::Bootstrap(format!(
            "the root refused rank {rank}: {why}"
        ))),
        _ => Err(Error::Bootstrap(
            "the root sent an unexpected message".into(),
        )),
    }
}

impl Links {
    /// Waits until every rank has called `barrier(tag)`.
    pub(crate) fn barrier(&mut self, tag: u32, deadline: Instant) -> Result<(), Error> {
        self.barrier_or_refuse(tag, deadline, Ok(()))
    }

    /// [`Links::barrier`], where the root may bring a failure of its own (`mine`): then every rank's
    /// barrier fails with it, so a step only the root takes fails init on every rank.
    pub(crate) fn barrier_or_refuse(
        &mut self,
        tag: u32,
        deadline: Instant,
        mine: Result<(), Error>,
    ) -> Result<(), Error> {
        match self {
            Links::Alone => mine,
            Links::Peer(s) => {
                send(s, &Msg::Barrier(tag), "sending a bootstrap barrier")?;
                match recv(s, deadline, "waiting for the bootstrap barrier")? {
                    Msg::Release(t) if t == tag => Ok(()),
                    Msg::Refused(why) => Err(Error::Bootstrap(format!("the root gave up: {why}"))),
                    _ => Err(Error::Bootstrap(
                        "unexpected message at a bootstrap barrier".into(),
                    )),
                }
            }
            Links::Root(conns) => {
                let mut result = mine;
                for (i, c) in conns.iter_mut().enumerate() {
                    if result.is_err() {
                        break;
                    }
                    let what = format!("waiting for rank {} at a bootstrap barrier", i + 1);
                    match recv(c, deadline, &what) {
                        Ok(Msg::Barrier(t)) if t == tag => {}
                        Ok(_) => {
                            result = Err(Error::Bootstrap(format!(
                                "rank {} sent an unexpected message",
                                i + 1
                            )))
                        }
                        Err(e) => result = Err(e),
                    }
                }
                // Release everyone, or tell them why not, so no rank waits out its deadline.
                let reply = match &result {
                    Ok(()) => Msg::Release(tag),
                    Err(e) => Msg::Refused(e.to_string()),
                };
                for c in conns.iter_mut() {
                    let _ = write_frame(c, &reply);
                }
                result
            }
        }
    }
}

#[cfg(test)]
mod tests;
