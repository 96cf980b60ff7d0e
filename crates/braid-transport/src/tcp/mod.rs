//! The TCP transport: the same primitive as shared memory, for peers on other hosts.
//!
//! Every rank listens on one socket ([`TcpEndpoint`]) whose address travels in the bootstrap table.
//! For each peer it reaches over TCP, a rank opens `sockets_per_peer` connections of its own and sends
//! on them; it receives on the connections the peer opened. A connection starts with a [`Hello`] that
//! carries the communicator's secret and is refused without it.
//!
//! The receiver owns the slots, as with shared memory: one reader thread per inbound connection reads
//! each part header, validates it, waits until the slot it names has been released, and then reads the
//! payload straight into that slot. When the last part of a message is in, the slot is published with
//! the same sequence-word protocol the shared-memory channel uses, and the executor waits on it in the
//! same way (spin, yield, futex, with deadline and failure checks). A reader that cannot place a part
//! stops reading, so TCP flow control holds the sender back: the credit is the socket's window.
//!
//! The sender writes header and payload with one vectored `sendmsg` per part, on the executor's thread,
//! in 5 ms slices so that a deadline, an abort or a reset connection ends the wait. The kernel's send
//! buffer lets it run ahead of the network.

pub mod frame;
mod ifaddr;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use braid_core::Error;
use tracing::{debug, warn};

use crate::greet::{Greeted, Greeter};
use crate::link::{check_token, misuse, AbortHandle, Event, Link, LinkId, RecvSlot, SendSlot};
use crate::memory::Span;
use crate::plugin::{Connected, Peer, Prepared, Scope, SetupCtx, Transport};
use crate::wait::{futex_wait, futex_wake, wait_until};
use crate::{WaitCtx, WaitPolicy};
pub use frame::{Hello, PartHeader};
pub use ifaddr::{choose_ip, interfaces};

/// How long an accepted connection may take to say hello.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);
/// Slice of a blocked send or reader wait between checks.
const SLICE: Duration = Duration::from_millis(5);

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
    fn connections(&self) -> usize {
        self.sockets_per_peer * self.channels
    }
}

/// A listening socket, opened before the bootstrap so that its address can be published.
pub struct TcpEndpoint {
    listener: TcpListener,
    addr: SocketAddr,
}

impl TcpEndpoint {
    /// Listens on `ip` at a port the kernel picks.
    pub fn bind(ip: IpAddr) -> Result<TcpEndpoint, Error> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::io(format!("listening for TCP peers on {ip}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the TCP listener's address", e))?;
        Ok(TcpEndpoint { listener, addr })
    }

    /// The address peers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connects to every peer that has an address in `peers` (indexed by rank; `None` for this rank and
    /// for peers reached otherwise) and accepts their connections. Every peer listed must do the same
    /// with this rank before `deadline`.
    pub fn connect(
        self,
        opts: TcpOptions,
        peers: &[Option<SocketAddr>],
        deadline: Instant,
    ) -> Result<TcpLink, Error> {
        if peers.len() != opts.world || peers[opts.rank].is_some() {
            return Err(Error::Internal(format!(
                "tcp: {} peer addresses for {} ranks, or one for this rank",
                peers.len(),
                opts.world
            )));
        }
        let k = opts.connections();
        let remote: Vec<bool> = peers.iter().map(Option::is_some).collect();
        let expected = remote.iter().filter(|r| **r).count() * k;
        let accept = {
            let listener = self
                .listener
                .try_clone()
                .map_err(|e| Error::io("cloning the TCP listener", e))?;
            let remote = remote.clone();
            std::thread::Builder::new()
                .name(format!("braid-accept-{}", opts.rank))
                .spawn(move || accept_all(listener, opts, &remote, expected, deadline))
                .map_err(|e| Error::io("starting the TCP accept thread", e))?
        };
        let mut outbound: Vec<Option<Outbound>> = (0..opts.world).map(|_| None).collect();
        let mut result = Ok(());
        'peers: for (p, addr) in peers.iter().enumerate() {
            let Some(addr) = addr else { continue };
            let mut socks = Vec::with_capacity(k);
            for j in 0..k {
                match dial(*addr, opts, p, j, deadline) {
                    Ok(s) => socks.push(s),
                    Err(e) => {
                        result = Err(e);
                        break 'peers;
                    }
                }
            }
            outbound[p] = Some(Outbound {
                socks,
                rings: (0..opts.channels).map(|_| SendRing::default()).collect(),
            });
        }
        if result.is_err() {
            // Wake the acceptor now rather than at the deadline.
            let _ = TcpStream::connect(self.addr);
        }
        let accepted = accept
            .join()
            .map_err(|_| Error::Bootstrap("the TCP accept thread panicked".into()))?;
        result?;
        let inbound_socks = accepted?;
        let shared = Arc::new(Shared {
            shutdown: AtomicBool::new(false),
            inbound: (0..opts.world)
                .map(|p| {
                    remote[p].then(|| {
                        (0..opts.channels)
                            .map(|_| Inbound::new(opts.slots, opts.slot_bytes, opts.connections()))
                            .collect()
                    })
                })
                .collect(),
            sockets: Mutex::new(Vec::new()),
        });
        let mut readers = Vec::new();
        for (p, socks) in inbound_socks.into_iter().enumerate() {
            for (j, s) in socks.into_iter().enumerate() {
                shared.sockets.lock().push(
                    s.try_clone()
                        .map_err(|e| Error::io("cloning a socket", e))?,
                );
                let sh = shared.clone();
                let h = std::thread::Builder::new()
                    .name(format!("braid-tcp-{}<{p}.{j}", opts.rank))
                    .spawn(move || reader(sh, s, p, j, opts))
                    .map_err(|e| Error::io("starting a TCP reader thread", e))?;
                readers.push(h);
            }
        }
        for o in outbound.iter().flatten() {
            for s in &o.socks {
                shared.sockets.lock().push(
                    s.try_clone()
                        .map_err(|e| Error::io("cloning a socket", e))?,
                );
            }
        }
        debug!(rank = opts.rank, connections = expected, "tcp link ready");
        Ok(TcpLink {
            id: LinkId::new(),
            opts,
            shared,
            outbound,
            recv_rings: (0..opts.world * opts.channels)
                .map(|_| RecvRing::default())
                .collect(),
            readers,
        })
    }
}

/// Opens connection `j` to `p` and says hello, retrying refused connections until `deadline`.
fn dial(
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
fn accept_all(
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

/// At most this many connections wait for their hello at once.
const MAX_PENDING_HELLOS: usize = 64;

/// Slot memory written by reader threads and read by the executor, one slot at a time by protocol.
struct SlotMem {
    ptr: *mut u8,
    len: usize,
}

impl SlotMem {
    fn new(len: usize) -> SlotMem {
        let b: Box<[u8]> = vec![0u8; len.max(1)].into_boxed_slice();
        SlotMem {
            ptr: Box::into_raw(b).cast::<u8>(),
            len: len.max(1),
        }
    }
}

impl Drop for SlotMem {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `len` come from `Box::into_raw` of a boxed slice of exactly that length in
        // `new`, and nothing uses the memory once its owner is dropped.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr, self.len,
            )))
        };
    }
}

// SAFETY: the memory is a plain byte buffer; access to each slot is handed back and forth between the
// reader threads and the executor by the Release/Acquire protocol on `seq` and `consumed`.
unsafe impl Send for SlotMem {}
// SAFETY: as above: at any time one side owns a slot's bytes.
unsafe impl Sync for SlotMem {}

/// The receiving side of one peer's channel.
struct Inbound {
    mem: Vec<SlotMem>,
    /// Per slot: number of the message it holds, plus one, once complete.
    seq: Vec<AtomicU32>,
    len: Vec<AtomicU32>,
    tag: Vec<AtomicU32>,
    /// Per slot: parts of the pending message already in.
    arrived: Vec<AtomicU32>,
    /// Messages the executor has released.
    consumed: AtomicU32,
    /// Set while the executor sleeps waiting for data.
    recv_waiting: AtomicU32,
    /// Readers asleep waiting for a free slot.
    reader_waiting: AtomicU32,
    failed: AtomicBool,
    reason: Mutex<String>,
    /// Connections from this peer still open, over all channels (kept in channel 0's ring); a clean close
    /// counts as a failure only once the last one
    /// has closed, so parts still arriving on the others are delivered.
    open: AtomicU32,
}

impl Inbound {
    fn new(slots: usize, slot_bytes: usize, connections: usize) -> Inbound {
        let z = |_| AtomicU32::new(0);
        Inbound {
            mem: (0..slots).map(|_| SlotMem::new(slot_bytes)).collect(),
            seq: (0..slots).map(z).collect(),
            len: (0..slots).map(z).collect(),
            tag: (0..slots).map(z).collect(),
            arrived: (0..slots).map(z).collect(),
            consumed: AtomicU32::new(0),
            recv_waiting: AtomicU32::new(0),
            reader_waiting: AtomicU32::new(0),
            failed: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
            open: AtomicU32::new(connections as u32),
        }
    }

    fn fail(&self, reason: String) {
        let mut r = self.reason.lock();
        if !self.failed.load(Ordering::Acquire) {
            *r = reason;
            self.failed.store(true, Ordering::Release);
        }
        drop(r);
        for s in &self.seq {
            futex_wake(s);
        }
    }
}

/// State shared by the transport and its reader threads.
struct Shared {
    shutdown: AtomicBool,
    /// Per peer reached over TCP, per channel.
    inbound: Vec<Option<Vec<Inbound>>>,
    /// Clones of every connection, so that shutdown or abort can close them from any thread.
    sockets: Mutex<Vec<TcpStream>>,
}

impl Shared {
    fn close_all(&self) {
        for s in self.sockets.lock().iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
        for ib in self.inbound.iter().flatten().flatten() {
            futex_wake(&ib.consumed);
        }
    }
}

/// Reads messages from connection `c` of peer `p` into its slots until the connection ends. The
/// connection belongs to channel `c / sockets_per_peer`, as its `j = c % sockets_per_peer`-th.
fn reader(sh: Arc<Shared>, mut s: TcpStream, p: usize, c: usize, opts: TcpOptions) {
    let (ch, j) = (c / opts.sockets_per_peer, c % opts.sockets_per_peer);
    let Some(ib) = sh.inbound[p].as_ref().and_then(|v| v.get(ch)) else {
        return;
    };
    let slots = opts.slots as u32;
    let k = opts.sockets_per_peer as u32;
    let mut next: u32 = 0;
    let fail = |why: String| {
        if !sh.shutdown.load(Ordering::Acquire) {
            ib.fail(why);
        }
    };
    loop {
        let mut hb = [0u8; frame::PART_LEN];
        match read_full(&mut s, &mut hb) {
            Ok(true) => {}
            Ok(false) => {
                // Every connection of the peer, over all channels, counts: the others may still be
                // delivering what was sent before the close.
                let all = sh.inbound[p].as_deref().unwrap_or_default();
                if let Some(first) = all.first() {
                    if first.open.fetch_sub(1, Ordering::AcqRel) == 1
                        && !sh.shutdown.load(Ordering::Acquire)
                    {
                        for ib in all {
                            ib.fail("closed the connection".into());
                        }
                    }
                }
                return;
            }
            Err(e) => return fail(format!("connection failed: {e}")),
        }
        let h = match PartHeader::decode(&hb, next, j, opts.sockets_per_peer, opts.slot_bytes) {
            Ok(h) => h,
            Err(e) => return fail(format!("sent an invalid message header: {e}")),
        };
        // Wait until the slot's previous message has been released.
        loop {
            if next.wrapping_sub(ib.consumed.load(Ordering::Acquire)) < slots {
                break;
            }
            if sh.shutdown.load(Ordering::Acquire) {
                return;
            }
            ib.reader_waiting.fetch_add(1, Ordering::SeqCst);
            let seen = ib.consumed.load(Ordering::SeqCst);
            if next.wrapping_sub(seen) >= slots {
                futex_wait(&ib.consumed, seen, SLICE);
            }
            ib.reader_waiting.fetch_sub(1, Ordering::SeqCst);
        }
        let index = (next % slots) as usize;
        let mem = &ib.mem[index];
        let (off, n) = (h.offset as usize, h.part_len as usize);
        debug_assert!(off + n <= mem.len);
        // SAFETY: `off + n <= len <= slot_bytes` was validated by `PartHeader::decode`; the slot is free
        // (its previous message was released, checked above) and not yet published, and the parts of one
        // message cover disjoint ranges (`part_range`), so no one else touches these bytes now.
        let dst = unsafe { std::slice::from_raw_parts_mut(mem.ptr.add(off), n) };
        match read_full(&mut s, dst) {
            Ok(true) => {}
            Ok(false) => return fail("closed the connection in the middle of a message".into()),
            Err(e) => return fail(format!("connection failed: {e}")),
        }
        ib.len[index].store(h.len, Ordering::Relaxed);
        ib.tag[index].store(h.tag, Ordering::Relaxed);
        if ib.arrived[index].fetch_add(1, Ordering::AcqRel) + 1 == k {
            ib.arrived[index].store(0, Ordering::Relaxed);
            ib.seq[index].store(next.wrapping_add(1), Ordering::SeqCst);
            if ib.recv_waiting.load(Ordering::SeqCst) != 0 {
                futex_wake(&ib.seq[index]);
            }
        }
        next = next.wrapping_add(1);
    }
}

/// Fills `buf`; `Ok(false)` if the stream ended first (cleanly only before the first byte of an empty
/// read target is a non-issue: an empty buffer always succeeds).
fn read_full(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Ok(false),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// The sending side of one (peer, channel): staging buffers, one per reserved and unposted slot.
#[derive(Default)]
struct SendRing {
    /// Messages reserved, and posted (sent), wrapping.
    reserved: Cell<u32>,
    posted: Cell<u32>,
    /// Buffers of reserved slots, oldest first (the next to post is at the front).
    outstanding: RefCell<VecDeque<Box<[u8]>>>,
    /// Buffers to reuse.
    free: RefCell<Vec<Box<[u8]>>>,
}

/// The sending side of one peer.
struct Outbound {
    /// `sockets_per_peer` connections per channel, channel by channel.
    socks: Vec<TcpStream>,
    rings: Vec<SendRing>,
}

/// The receiving side of one (peer, channel), as the executor sees it.
#[derive(Default)]
struct RecvRing {
    recvd: Cell<u32>,
    released: Cell<u32>,
}

/// The TCP link of one rank. Used by one thread at a time, like every link.
pub struct TcpLink {
    id: LinkId,
    opts: TcpOptions,
    shared: Arc<Shared>,
    outbound: Vec<Option<Outbound>>,
    recv_rings: Vec<RecvRing>,
    readers: Vec<JoinHandle<()>>,
}

/// The handle other threads use to abort a TCP link.
struct TcpAbort {
    shared: Arc<Shared>,
}

impl AbortHandle for TcpAbort {
    /// Closes every connection, so peers see this rank fail at once, and wakes every wait.
    fn fail_and_wake(&self) {
        self.shared.close_all();
    }
}

impl TcpLink {
    fn out(&self, peer: usize, ch: usize) -> Result<(&Outbound, &SendRing), Error> {
        match self.outbound.get(peer).and_then(Option::as_ref) {
            Some(o) if ch < self.opts.channels => Ok((o, &o.rings[ch])),
            _ => Err(misuse(
                "tcp",
                format!("no ring to rank {peer} on channel {ch}"),
            )),
        }
    }

    fn inbound(&self, peer: usize, ch: usize) -> Result<(&Inbound, &RecvRing), Error> {
        match self.shared.inbound.get(peer).and_then(Option::as_ref) {
            Some(v) if ch < self.opts.channels => {
                Ok((&v[ch], &self.recv_rings[peer * self.opts.channels + ch]))
            }
            _ => Err(misuse(
                "tcp",
                format!("no ring from rank {peer} on channel {ch}"),
            )),
        }
    }

    fn peer_error(&self, peer: usize, ctx: &WaitCtx<'_>) -> Result<(), Error> {
        if let Some(v) = self.shared.inbound.get(peer).and_then(Option::as_ref) {
            for ib in v {
                if ib.failed.load(Ordering::Acquire) {
                    let why = ib.reason.lock().clone();
                    return Err(ctx.peer_failed(peer, why));
                }
            }
        }
        Ok(())
    }
}

impl Link for TcpLink {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn slot_bytes(&self) -> usize {
        self.opts.slot_bytes
    }

    fn channels(&self) -> usize {
        self.opts.channels
    }

    fn try_reserve(
        &self,
        peer: usize,
        ch: usize,
        _ctx: &WaitCtx<'_>,
    ) -> Result<Option<SendSlot>, Error> {
        let (_, ring) = self.out(peer, ch)?;
        let mut outstanding = ring.outstanding.borrow_mut();
        if outstanding.len() >= self.opts.slots {
            return Ok(None);
        }
        let mut buf = ring
            .free
            .borrow_mut()
            .pop()
            .unwrap_or_else(|| vec![0u8; self.opts.slot_bytes].into_boxed_slice());
        let msg = ring.reserved.get();
        ring.reserved.set(msg.wrapping_add(1));
        // SAFETY: the buffer is a heap allocation owned by this ring until the slot is posted (moving the
        // box into the queue does not move its heap bytes); nobody else writes it meanwhile.
        let slot = unsafe {
            let span = Span::host(buf.as_mut_ptr(), buf.len());
            SendSlot::new(self.id, peer, ch, msg, span)
        };
        outstanding.push_back(buf);
        Ok(Some(slot))
    }

    fn post(&self, slot: SendSlot, len: usize, tag: u32, ctx: &WaitCtx<'_>) -> Result<(), Error> {
        let (out, ring) = self.out(slot.peer, slot.ch)?;
        check_token(
            "tcp",
            self.id,
            slot.link,
            slot.msg,
            ring.posted.get(),
            "post",
        )?;
        if len > self.opts.slot_bytes {
            return Err(misuse(
                "tcp",
                format!(
                    "posting {len} bytes into a slot of {}",
                    self.opts.slot_bytes
                ),
            ));
        }
        let Some(buf) = ring.outstanding.borrow_mut().pop_front() else {
            return Err(misuse("tcp", "post without a reserved slot".into()));
        };
        let msg = slot.msg;
        ring.posted.set(msg.wrapping_add(1));
        let k = self.opts.sockets_per_peer;
        let data = &buf[..len];
        let mut result = Ok(());
        for (j, s) in out.socks[slot.ch * k..(slot.ch + 1) * k].iter().enumerate() {
            let r = frame::part_range(data.len(), msg, j, k);
            let h = PartHeader {
                tag,
                msg,
                len: data.len() as u32,
                offset: r.start as u32,
                part_len: r.len() as u32,
            }
            .encode();
            result = send_all(s, &h, &data[r], ctx, slot.peer, self);
            if result.is_err() {
                break;
            }
        }
        ring.free.borrow_mut().push(buf);
        result
    }

    fn try_recv(
        &self,
        peer: usize,
        ch: usize,
        _ctx: &WaitCtx<'_>,
    ) -> Result<Option<RecvSlot>, Error> {
        let (ib, ring) = self.inbound(peer, ch)?;
        let r = ring.recvd.get();
        let index = (r % self.opts.slots as u32) as usize;
        if ib.seq[index].load(Ordering::Acquire) != r.wrapping_add(1) {
            return Ok(None);
        }
        let len = ib.len[index].load(Ordering::Relaxed) as usize;
        let tag = ib.tag[index].load(Ordering::Relaxed);
        ring.recvd.set(r.wrapping_add(1));
        let mem = &ib.mem[index];
        // SAFETY: `len <= slot_bytes` (validated by the reader before it wrote the slot); the Acquire load
        // of `seq` above observed the reader's publication, and the reader will not write this slot again
        // until `release` returns it; the memory lives as long as the link.
        let slot = unsafe {
            let span = Span::host(mem.ptr, len);
            RecvSlot::new(self.id, peer, ch, r, tag, span)
        };
        Ok(Some(slot))
    }

    fn release(&self, slot: RecvSlot) -> Result<(), Error> {
        let (ib, ring) = self.inbound(slot.peer, slot.ch)?;
        check_token(
            "tcp",
            self.id,
            slot.link,
            slot.msg,
            ring.released.get(),
            "release",
        )?;
        let r = slot.msg.wrapping_add(1);
        ring.released.set(r);
        ib.consumed.store(r, Ordering::SeqCst);
        if ib.reader_waiting.load(Ordering::SeqCst) != 0 {
            futex_wake(&ib.consumed);
        }
        Ok(())
    }

    fn wait(
        &self,
        peer: usize,
        ch: usize,
        event: Event,
        ctx: &WaitCtx<'_>,
        until: Instant,
    ) -> Result<(), Error> {
        match event {
            // A slot is free again as soon as the post that used it returns, and the post has
            // stopped reading the caller's memory by then.
            Event::Credit | Event::Sent => {
                self.out(peer, ch)?;
                self.peer_error(peer, ctx)
            }
            Event::Data => {
                let (ib, ring) = self.inbound(peer, ch)?;
                let r = ring.recvd.get();
                let index = (r % self.opts.slots as u32) as usize;
                let want = r.wrapping_add(1);
                let seq = &ib.seq[index];
                wait_until(
                    &self.opts.policy,
                    ctx,
                    until,
                    peer,
                    event.describe(),
                    seq,
                    &ib.recv_waiting,
                    || seq.load(Ordering::Acquire) == want,
                    || self.peer_error(peer, ctx),
                )
            }
        }
    }

    fn abort_handle(&self) -> Arc<dyn AbortHandle> {
        Arc::new(TcpAbort {
            shared: self.shared.clone(),
        })
    }
}

/// Writes header and payload as one vectored send, in slices, until done or a wait fails.
fn send_all(
    s: &TcpStream,
    hdr: &[u8],
    data: &[u8],
    ctx: &WaitCtx<'_>,
    to: usize,
    link: &TcpLink,
) -> Result<(), Error> {
    let total = hdr.len() + data.len();
    let mut done = 0;
    while done < total {
        let (a, b) = if done < hdr.len() {
            (&hdr[done..], data)
        } else {
            (&data[done - hdr.len()..], &[][..])
        };
        match send_vectored(s, a, b) {
            Ok(n) => done += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if ctx.abort.load(Ordering::Relaxed) {
                    return Err(ctx.aborted());
                }
                if Instant::now() >= ctx.deadline {
                    return Err(ctx.timeout(to, "the network to accept data"));
                }
                link.peer_error(to, ctx)?;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(
                    ctx.peer_failed(to, format!("is unreachable: sending to it failed ({e})"))
                )
            }
        }
    }
    Ok(())
}

/// One `sendmsg` of two buffers, without raising SIGPIPE on a closed connection.
fn send_vectored(s: &TcpStream, a: &[u8], b: &[u8]) -> std::io::Result<usize> {
    let both = [std::io::IoSlice::new(a), std::io::IoSlice::new(b)];
    let iov = if b.is_empty() { &both[..1] } else { &both[..] };
    rustix::net::sendmsg(
        s,
        iov,
        &mut rustix::net::SendAncillaryBuffer::default(),
        rustix::net::SendFlags::NOSIGNAL,
    )
    .map_err(std::io::Error::from)
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.close_all();
        for h in self.readers.drain(..) {
            let _ = h.join();
        }
    }
}

/// TCP between any two ranks: the [`Transport`] that makes [`TcpLink`]s.
pub struct Tcp {
    ip: IpAddr,
    sockets_per_peer: usize,
}

impl Tcp {
    /// Listens on `ip`, with `sockets_per_peer` connections per peer and channel.
    pub fn new(ip: IpAddr, sockets_per_peer: usize) -> Tcp {
        Tcp {
            ip,
            sockets_per_peer: sockets_per_peer.max(1),
        }
    }
}

impl Transport for Tcp {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn scope(&self) -> Scope {
        Scope::Network
    }

    fn prepare(self: Box<Self>, _ctx: &SetupCtx) -> Result<Box<dyn Prepared>, Error> {
        Ok(Box::new(TcpPrepared {
            endpoint: TcpEndpoint::bind(self.ip)?,
            sockets_per_peer: self.sockets_per_peer,
        }))
    }
}

struct TcpPrepared {
    endpoint: TcpEndpoint,
    sockets_per_peer: usize,
}

impl Prepared for TcpPrepared {
    fn endpoint(&self) -> Vec<u8> {
        self.endpoint.addr().to_string().into_bytes()
    }

    fn connect(
        self: Box<Self>,
        ctx: &SetupCtx,
        peers: &[Option<&Peer>],
    ) -> Result<Box<dyn Connected>, Error> {
        let addrs = peers
            .iter()
            .enumerate()
            .map(|(p, peer)| {
                let Some(peer) = peer else { return Ok(None) };
                let text = peer.endpoint_text("tcp");
                text.parse().map(Some).map_err(|_| {
                    Error::Bootstrap(format!(
                        "rank {p} published no usable TCP address ({text:?})"
                    ))
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let g = ctx.geometry;
        let opts = TcpOptions {
            rank: g.rank,
            world: g.world,
            channels: g.channels,
            slots: g.slots,
            slot_bytes: g.slot_bytes,
            sockets_per_peer: self.sockets_per_peer,
            secret: ctx.secret,
            policy: ctx.policy,
        };
        let link = self.endpoint.connect(opts, &addrs, ctx.deadline)?;
        Ok(Box::new(TcpConnected(link)))
    }
}

struct TcpConnected(TcpLink);

impl Connected for TcpConnected {
    fn activate(self: Box<Self>) -> Result<Box<dyn Link>, Error> {
        Ok(Box::new(self.0))
    }
}

#[cfg(test)]
mod tests;
