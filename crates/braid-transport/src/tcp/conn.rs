//! Opening the connections: the options both ends agree on ([`TcpOptions`]), dialing a peer with a
//! [`Hello`], accepting peers and checking theirs, and the socket checks the bootstrap shares.

use std::io::{ErrorKind, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use braid_core::Error;
use tracing::warn;

use super::frame::{self, Hello};
use crate::greet::{Greeted, Greeter};
use crate::WaitPolicy;

/// How long an accepted connection may take to say hello.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);
/// At most this many connections wait for their hello at once.
const MAX_PENDING_HELLOS: usize = 64;
/// Slice of a blocked send or reader wait between checks.
pub(super) const SLICE: Duration = Duration::from_millis(5);

/// What both ends of every connection agree on.
#[derive(Clone, Copy, Debug)]
pub struct TcpOptions {
    /// This rank.
    pub rank: usize,
    /// Ranks in the communicator.
    pub world: usize,
    /// Independent channels per peer (each has its own connections, so a full ring on one channel never
    /// holds up another).
    pub channels: usize,
    /// Slots per ring.
    pub slots: usize,
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// Connections per peer, channel and direction.
    pub sockets_per_peer: usize,
    /// The communicator's secret.
    pub secret: [u8; 16],
    /// How the executor waits.
    pub policy: WaitPolicy,
}

impl TcpOptions {
    /// Connections per peer and direction, over all channels.
    pub(super) fn connections(&self) -> usize {
        self.sockets_per_peer * self.channels
    }
}

/// Opens connection `j` to `p` and says hello, retrying refused connections until `deadline`.
pub(super) fn dial(
    addr: SocketAddr,
    opts: TcpOptions,
    p: usize,
    j: usize,
    deadline: Instant,
) -> Result<TcpStream, Error> {
    let what = || format!("rank {} connecting to rank {p} at {addr}", opts.rank);
    let mut s = connect_until(addr, deadline, what)?;
    s.set_nodelay(true).map_err(|e| Error::io(what(), e))?;
    let hello = Hello {
        secret: opts.secret,
        from: opts.rank as u32,
        to: p as u32,
        socket: j as u32,
        sockets: opts.sockets_per_peer as u32,
        channels: opts.channels as u32,
        slots: opts.slots as u32,
        slot_bytes: opts.slot_bytes as u32,
    };
    s.write_all(&hello.encode())
        .map_err(|e| Error::io(what(), e))?;
    // Sends wait in slices so that deadlines and aborts are seen.
    s.set_write_timeout(Some(SLICE))
        .map_err(|e| Error::io(what(), e))?;
    Ok(s)
}

/// Whether `s` is a TCP self-connection (simultaneous open of a socket with itself: its local and
/// peer addresses are the same).
pub fn connected_to_itself(s: &TcpStream) -> bool {
    matches!((s.local_addr(), s.peer_addr()), (Ok(a), Ok(b)) if a == b)
}

/// Connects to `addr`, retrying (with backoff up to 100 ms) while the peer is not listening yet, until
/// `deadline`; `what` names the attempt in errors.
pub(crate) fn connect_until(
    addr: SocketAddr,
    deadline: Instant,
    what: impl Fn() -> String,
) -> Result<TcpStream, Error> {
    let mut backoff = Duration::from_millis(1);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Bootstrap(format!("timed out {}", what())));
        }
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
            // A connection to a local port nobody listens on yet may pick that port as its source and
            // reach itself; it is dropped (freeing the port) and tried again.
            Ok(s) if connected_to_itself(&s) => std::thread::sleep(backoff.min(left)),
            Ok(s) => return Ok(s),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::ConnectionRefused | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) =>
            {
                std::thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(100));
            }
            Err(e) => return Err(Error::io(what(), e)),
        }
    }
}

/// Compares secrets in constant time (the bootstrap checks its connections with it too).
pub fn same_secret(a: &[u8; 16], b: &[u8; 16]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Checks a hello against what this rank expects; the error says what was wrong.
fn check_hello(h: &Hello, opts: &TcpOptions, remote: &[bool]) -> Result<(), String> {
    if !same_secret(&h.secret, &opts.secret) {
        return Err("wrong secret".into());
    }
    if h.to as usize != opts.rank {
        return Err(format!(
            "addressed to rank {}, this is rank {}",
            h.to, opts.rank
        ));
    }
    let from = h.from as usize;
    if from >= remote.len() || !remote[from] {
        return Err(format!("rank {} is not a TCP peer of this rank", h.from));
    }
    if h.sockets as usize != opts.sockets_per_peer
        || h.channels as usize != opts.channels
        || h.socket as usize >= opts.connections()
    {
        return Err(format!(
            "connection {} of {} per channel over {} channels where {} per channel over {} are configured",
            h.socket, h.sockets, h.channels, opts.sockets_per_peer, opts.channels
        ));
    }
    if (h.slots as usize, h.slot_bytes as usize) != (opts.slots, opts.slot_bytes) {
        return Err(format!(
            "{} slots of {} bytes where this rank uses {} of {}",
            h.slots, h.slot_bytes, opts.slots, opts.slot_bytes
        ));
    }
    Ok(())
}

type Accepted = Vec<Vec<TcpStream>>;

/// Accepts until every expected connection has said a valid hello, or the deadline. Each connection's
/// hello is read on its own thread, so silent or slow strangers cannot hold up the real peers.
pub(super) fn accept_all(
    listener: TcpListener,
    opts: TcpOptions,
    remote: &[bool],
    expected: usize,
    deadline: Instant,
) -> Result<Accepted, Error> {
    let k = opts.connections();
    let mut got: Vec<Vec<Option<TcpStream>>> = (0..opts.world)
        .map(|p| (0..if remote[p] { k } else { 0 }).map(|_| None).collect())
        .collect();
    let mut have = 0;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("configuring the TCP listener", e))?;
    // Connections that have not said hello yet, served from this loop (no thread per connection).
    let mut greeter = Greeter::new("the TCP data port", MAX_PENDING_HELLOS, HELLO_DEADLINE);
    while have < expected {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<String> = got
                .iter()
                .enumerate()
                .filter(|(_, s)| s.iter().any(Option::is_none))
                .map(|(p, _)| p.to_string())
                .collect();
            return Err(Error::Bootstrap(format!(
                "rank {} timed out waiting for TCP connections from rank(s) {}",
                opts.rank,
                missing.join(", ")
            )));
        }
        let (greeted, busy) = greeter.poll(&listener, now, deadline, |b| {
            frame::HELLO_LEN.saturating_sub(b.len())
        });
        for Greeted {
            stream: s,
            from,
            first,
        } in greeted
        {
            let hello =
                first.and_then(
                    |b| match <&[u8; frame::HELLO_LEN]>::try_from(b.as_slice()) {
                        Ok(b) => Hello::decode(b),
                        Err(_) => Err(format!("a hello of {} bytes", b.len())),
                    },
                );
            let h = match hello.and_then(|h| check_hello(&h, &opts, remote).map(|_| h)) {
                Ok(h) => h,
                Err(e) => {
                    warn!(
                        rank = opts.rank,
                        "refused a TCP connection from {from}: {e}"
                    );
                    continue;
                }
            };
            let slot = &mut got[h.from as usize][h.socket as usize];
            if slot.is_some() {
                warn!(
                    rank = opts.rank,
                    "refused a duplicate connection {} from rank {}", h.socket, h.from
                );
                continue;
            }
            *slot = Some(s);
            have += 1;
        }
        if !busy && have < expected {
            std::thread::sleep(Duration::from_micros(500));
        }
    }
    let mut all = Vec::with_capacity(got.len());
    for (p, v) in got.into_iter().enumerate() {
        let socks: Option<Vec<TcpStream>> = v.into_iter().collect();
        all.push(socks.ok_or_else(|| {
            Error::Internal(format!(
                "rank {}: a connection from rank {p} was lost",
                opts.rank
            ))
        })?);
    }
    Ok(all)
}
