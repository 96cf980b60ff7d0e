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
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use braid_core::Error;
use tracing::{debug, warn};

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
    /// Slots per channel.
    pub slots: usize,
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// Connections per peer and direction.
    pub sockets_per_peer: usize,
    /// The communicator's secret.
    pub secret: [u8; 16],
    /// How the executor waits.
    pub policy: WaitPolicy,
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
    ) -> Result<TcpTransport, Error> {
        assert_eq!(peers.len(), opts.world);
        assert!(peers[opts.rank].is_none(), "no connection to self");
        let k = opts.sockets_per_peer;
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
                staging: RefCell::new(vec![0u8; opts.slot_bytes]),
                sent: Cell::new(0),
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
                .map(|p| remote[p].then(|| Inbound::new(opts.slots, opts.slot_bytes, k)))
                .collect(),
            sockets: Mutex::new(Vec::new()),
        });
        let mut readers = Vec::new();
        for (p, socks) in inbound_socks.into_iter().enumerate() {
            for (j, s) in socks.into_iter().enumerate() {
                shared.sockets.lock().expect("socket list").push(
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
                shared.sockets.lock().expect("socket list").push(
                    s.try_clone()
                        .map_err(|e| Error::io("cloning a socket", e))?,
                );
            }
        }
        debug!(
            rank = opts.rank,
            connections = expected,
            "tcp transport ready"
        );
        Ok(TcpTransport {
            opts,
            shared,
            outbound,
            recvd: (0..opts.world).map(|_| Cell::new(0)).collect(),
            reserved: (0..opts.world).map(|_| Cell::new(false)).collect(),
            tag: Cell::new(0),
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
    let mut backoff = Duration::from_millis(1);
    let mut s = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Bootstrap(format!("timed out {}", what())));
        }
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
            Ok(s) => break s,
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
    };
    s.set_nodelay(true).map_err(|e| Error::io(what(), e))?;
    let hello = Hello {
        secret: opts.secret,
        from: opts.rank as u32,
        to: p as u32,
        socket: j as u32,
        sockets: opts.sockets_per_peer as u32,
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
    if h.sockets as usize != opts.sockets_per_peer || h.socket >= h.sockets {
        return Err(format!(
            "connection {} of {} where {} per peer are configured",
            h.socket, h.sockets, opts.sockets_per_peer
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
    let k = opts.sockets_per_peer;
    let mut got: Vec<Vec<Option<TcpStream>>> = (0..opts.world)
        .map(|p| (0..if remote[p] { k } else { 0 }).map(|_| None).collect())
        .collect();
    let mut have = 0;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("configuring the TCP listener", e))?;
    let (tx, rx) = mpsc::channel::<(TcpStream, Result<Hello, String>)>();
    while have < expected {
        if Instant::now() >= deadline {
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
        match listener.accept() {
            Ok((s, from)) => {
                let tx = tx.clone();
                let hello_deadline = (Instant::now() + HELLO_DEADLINE).min(deadline);
                let _ = std::thread::Builder::new()
                    .name("braid-hello".into())
                    .spawn(move || {
                        let h = read_hello(&s, hello_deadline).map_err(|e| format!("{from}: {e}"));
                        let _ = tx.send((s, h));
                    });
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => warn!("accepting a TCP connection failed: {e}"),
        }
        while let Ok((s, h)) = rx.recv_timeout(Duration::from_millis(2)) {
            let h = match h.and_then(|h| check_hello(&h, &opts, remote).map(|_| h)) {
                Ok(h) => h,
                Err(e) => {
                    warn!(rank = opts.rank, "refused a TCP connection: {e}");
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
            if s.set_nonblocking(false).is_err() || s.set_nodelay(true).is_err() {
                continue;
            }
            *slot = Some(s);
            have += 1;
            if have == expected {
                break;
            }
        }
    }
    Ok(got
        .into_iter()
        .map(|v| v.into_iter().map(|s| s.expect("all accepted")).collect())
        .collect())
}

fn read_hello(s: &TcpStream, deadline: Instant) -> Result<Hello, String> {
    let mut s = s;
    let mut b = [0u8; frame::HELLO_LEN];
    let mut got = 0;
    while got < b.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("no hello before the deadline".into());
        }
        s.set_read_timeout(Some(left)).map_err(|e| e.to_string())?;
        match s.read(&mut b[got..]) {
            Ok(0) => return Err("closed before saying hello".into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    s.set_read_timeout(None).map_err(|e| e.to_string())?;
    Hello::decode(&b)
}

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
    /// Connections from this peer still open; a clean close counts as a failure only once the last one
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
        let mut r = self.reason.lock().expect("reason");
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
    inbound: Vec<Option<Inbound>>,
    /// Clones of every connection, so that shutdown or abort can close them from any thread.
    sockets: Mutex<Vec<TcpStream>>,
}

impl Shared {
    fn close_all(&self) {
        for s in self.sockets.lock().expect("socket list").iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
        for ib in self.inbound.iter().flatten() {
            futex_wake(&ib.consumed);
        }
    }
}

/// Reads messages from connection `j` of peer `p` into its slots until the connection ends.
fn reader(sh: Arc<Shared>, mut s: TcpStream, p: usize, j: usize, opts: TcpOptions) {
    let ib = sh.inbound[p].as_ref().expect("inbound channel");
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
                if ib.open.fetch_sub(1, Ordering::AcqRel) == 1 {
                    fail("closed the connection".into());
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

/// The sending side of one peer's channel.
struct Outbound {
    socks: Vec<TcpStream>,
    staging: RefCell<Vec<u8>>,
    sent: Cell<u32>,
}

/// The TCP transport of one rank. Used by one thread at a time, like the shared-memory transport.
pub struct TcpTransport {
    opts: TcpOptions,
    shared: Arc<Shared>,
    outbound: Vec<Option<Outbound>>,
    recvd: Vec<Cell<u32>>,
    reserved: Vec<Cell<bool>>,
    tag: Cell<u32>,
    readers: Vec<JoinHandle<()>>,
}

/// The handle other threads use to abort a TCP transport.
#[derive(Clone)]
pub struct TcpHandle {
    shared: Arc<Shared>,
}

impl TcpHandle {
    /// Closes every connection, so peers see this rank fail at once, and wakes every wait.
    pub fn fail_and_wake(&self) {
        self.shared.close_all();
    }
}

impl TcpTransport {
    /// The handle for `abort` from other threads.
    pub fn handle(&self) -> TcpHandle {
        TcpHandle {
            shared: self.shared.clone(),
        }
    }

    /// Payload capacity of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.opts.slot_bytes
    }

    /// Sets the tag stamped on every message from now on.
    pub fn set_tag(&self, tag: u32) {
        self.tag.set(tag);
    }

    /// Whether `peer` is reached over TCP.
    pub fn reaches(&self, peer: usize) -> bool {
        self.outbound.get(peer).is_some_and(Option::is_some)
    }

    /// Hands out the staging buffer for a message to `to`.
    pub fn send_slot(&self, to: usize) -> TcpSendSlot<'_> {
        assert!(!self.reserved[to].get(), "slot to rank {to} reserved twice");
        self.reserved[to].set(true);
        let out = self.outbound[to].as_ref().expect("not a TCP peer");
        TcpSendSlot {
            t: self,
            to,
            buf: out.staging.borrow_mut(),
        }
    }

    fn send_parts(&self, to: usize, data: &[u8], ctx: &WaitCtx<'_>) -> Result<(), Error> {
        let out = self.outbound[to].as_ref().expect("not a TCP peer");
        let msg = out.sent.get();
        let k = out.socks.len();
        for (j, s) in out.socks.iter().enumerate() {
            let r = frame::part_range(data.len(), msg, j, k);
            let h = PartHeader {
                tag: self.tag.get(),
                msg,
                len: data.len() as u32,
                offset: r.start as u32,
                part_len: r.len() as u32,
            }
            .encode();
            send_all(s, &h, &data[r], ctx, to, &self.shared)?;
        }
        out.sent.set(msg.wrapping_add(1));
        Ok(())
    }

    /// Waits for the next message from `from` and returns it in place.
    pub fn recv(&self, from: usize, ctx: &WaitCtx<'_>) -> Result<TcpRecvSlot<'_>, Error> {
        let ib = self.shared.inbound[from].as_ref().expect("not a TCP peer");
        let r = self.recvd[from].get();
        let index = (r % self.opts.slots as u32) as usize;
        let want = r.wrapping_add(1);
        let seq = &ib.seq[index];
        wait_until(
            &self.opts.policy,
            ctx,
            from,
            "data",
            seq,
            &ib.recv_waiting,
            || seq.load(Ordering::Acquire) == want,
            || {
                if ib.failed.load(Ordering::Acquire) {
                    let why = ib.reason.lock().expect("reason").clone();
                    return Err(ctx.peer_failed(from, why));
                }
                Ok(())
            },
        )?;
        let len = ib.len[index].load(Ordering::Relaxed) as usize;
        let tag = ib.tag[index].load(Ordering::Relaxed);
        if tag != self.tag.get() {
            return Err(Error::Mismatch {
                rank: self.opts.rank,
                peer: from,
                collective: ctx.collective.to_string(),
                seq: ctx.seq,
                detail: format!(
                    "message belongs to collective #{tag}, this rank is at #{}",
                    self.tag.get()
                ),
            });
        }
        let mem = &ib.mem[index];
        // SAFETY: `len <= slot_bytes` (validated by the reader before it wrote the slot); the Acquire load
        // of `seq` above observed the reader's publication, and the reader will not write this slot again
        // until `TcpRecvSlot::drop` releases it.
        let data = unsafe { std::slice::from_raw_parts(mem.ptr, len) };
        Ok(TcpRecvSlot {
            t: self,
            from,
            data,
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
    shared: &Shared,
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
                if let Some(ib) = shared.inbound[to].as_ref() {
                    if ib.failed.load(Ordering::Acquire) {
                        let why = ib.reason.lock().expect("reason").clone();
                        return Err(ctx.peer_failed(to, why));
                    }
                }
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
    let iov = [
        libc::iovec {
            iov_base: a.as_ptr() as *mut libc::c_void,
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        },
    ];
    // SAFETY: msghdr is plain data; zeroed is a valid empty header, then pointed at `iov`.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = if b.is_empty() { 1 } else { 2 };
    // SAFETY: the iovecs point at live slices for the duration of the call, and the kernel only reads
    // them; the descriptor is open (owned by `s`).
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.close_all();
        for h in self.readers.drain(..) {
            let _ = h.join();
        }
    }
}

/// A message being written for a TCP peer; [`TcpSendSlot::post`] sends it.
pub struct TcpSendSlot<'a> {
    t: &'a TcpTransport,
    to: usize,
    buf: std::cell::RefMut<'a, Vec<u8>>,
}

impl TcpSendSlot<'_> {
    /// The payload area (its capacity is the slot size).
    pub fn data(&mut self) -> &mut [u8] {
        &mut self.buf[..]
    }

    /// Sends the first `len` bytes.
    pub fn post(self, len: usize, ctx: &WaitCtx<'_>) -> Result<(), Error> {
        assert!(
            len <= self.buf.len(),
            "posting {len} bytes into a slot of {}",
            self.buf.len()
        );
        self.t.send_parts(self.to, &self.buf[..len], ctx)
    }
}

impl Drop for TcpSendSlot<'_> {
    fn drop(&mut self) {
        self.t.reserved[self.to].set(false);
    }
}

/// A received message, read in place; dropping it releases the slot.
pub struct TcpRecvSlot<'a> {
    t: &'a TcpTransport,
    from: usize,
    data: &'a [u8],
}

impl TcpRecvSlot<'_> {
    /// The payload.
    pub fn data(&self) -> &[u8] {
        self.data
    }
}

impl Drop for TcpRecvSlot<'_> {
    fn drop(&mut self) {
        let t = self.t;
        let ib = t.shared.inbound[self.from].as_ref().expect("inbound");
        let r = t.recvd[self.from].get().wrapping_add(1);
        t.recvd[self.from].set(r);
        ib.consumed.store(r, Ordering::SeqCst);
        if ib.reader_waiting.load(Ordering::SeqCst) != 0 {
            futex_wake(&ib.consumed);
        }
    }
}

#[cfg(test)]
mod tests;
