//! Setting the RDMA link up: choosing the port and GID, the typed stages of [`crate::setup`], and
//! the exchange of connection messages over one TCP connection per pair.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_core::Error;
use tracing::{debug, warn};

use super::link::RdmaLink;
use super::options::IbOptions;
use super::verbs::{Channel, Context, Cq, Init, Mr, PathOpts, Pd, Qp, QpCaps, Remote};
use super::wire::{Connect, RdmaEndpoint};
use crate::greet::{Greeted, Greeter};
use crate::link::Link;
use crate::plugin::{Connected, Peer, Prepared, Scope, SetupCtx, Transport};
use crate::tcp::same_secret;

/// One usable port of one device, with the GID to use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortChoice {
    /// The device.
    pub device: String,
    /// The port.
    pub port: super::verbs::PortInfo,
    /// The GID.
    pub gid: super::verbs::GidEntry,
}

/// Every active port of every device, with the GID `opts` would use, and why a port cannot be used.
pub fn survey(opts: &IbOptions) -> Vec<Result<PortChoice, String>> {
    let mut names = super::verbs::device_names();
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let ctx = match Context::open(&name) {
            Ok(c) => c,
            Err(e) => {
                out.push(Err(format!("{name}: {e}")));
                continue;
            }
        };
        let ports = ctx.port_count().unwrap_or(0);
        for p in 1..=ports {
            if !opts.hca.allows(&name, p) {
                continue;
            }
            out.push(port_choice(&ctx, p, opts).map_err(|why| format!("{name}:{p}: {why}")));
        }
    }
    out
}

fn port_choice(ctx: &Context, p: u8, opts: &IbOptions) -> Result<PortChoice, String> {
    let port = ctx.port(p).map_err(|e| e.to_string())?;
    if !port.active {
        return Err("the port is not active".into());
    }
    let gid = match opts.gid_index {
        Some(i) => ctx
            .gid(p, i)
            .ok_or_else(|| format!("GID index {i} (BRAID_IB_GID_INDEX) holds no GID"))?,
        None => {
            let all: Vec<super::verbs::GidEntry> = (0..port.gid_table_len.min(256))
                .filter_map(|i| ctx.gid(p, i))
                .collect();
            let pick = if port.ethernet {
                all.iter()
                    .find(|g| g.roce_v2() && g.ipv4())
                    .or_else(|| all.iter().find(|g| g.roce_v2()))
                    .or(all.first())
            } else {
                all.first()
            };
            *pick.ok_or("the port has no GID (no address on its network device?)")?
        }
    };
    Ok(PortChoice {
        device: ctx.name().to_string(),
        port,
        gid,
    })
}

/// Why no port is usable, from a [`survey`] that found none.
fn none_usable(all: &[Result<PortChoice, String>]) -> String {
    let why: Vec<&str> = all
        .iter()
        .filter_map(|r| r.as_ref().err().map(String::as_str))
        .collect();
    if why.is_empty() {
        "no RDMA device is usable: the verbs library lists none (no RDMA NIC, no provider package \
         such as ibverbs-providers, or BRAID_IB_HCA excludes them all)"
            .to_string()
    } else {
        format!("no RDMA port is usable: {}", why.join("; "))
    }
}

/// Whether some port is usable; else why none is.
pub fn usable(opts: &IbOptions) -> Result<(), String> {
    let all = survey(opts);
    if all.iter().any(Result::is_ok) {
        Ok(())
    } else {
        Err(none_usable(&all))
    }
}

/// The port this rank uses: of the usable ones, `rank`'s share (ranks of a host spread over its
/// devices); an error that lists why each port was refused when none is usable.
pub fn choose_port(opts: &IbOptions, rank: usize) -> Result<PortChoice, Error> {
    let all = survey(opts);
    let usable: Vec<&PortChoice> = all.iter().filter_map(|r| r.as_ref().ok()).collect();
    if usable.is_empty() {
        return Err(Error::invalid(none_usable(&all)));
    }
    Ok(usable[rank % usable.len()].clone())
}

/// The MTU code of `bytes` (256 to 4096).
fn mtu_code(bytes: u32) -> Option<u32> {
    match bytes {
        256 => Some(1),
        512 => Some(2),
        1024 => Some(3),
        2048 => Some(4),
        4096 => Some(5),
        _ => None,
    }
}

/// The RDMA transport, configured.
pub struct Rdma {
    opts: IbOptions,
    ip: IpAddr,
}

impl Rdma {
    /// RDMA with `opts`; the connection socket listens on `ip`.
    pub fn new(opts: IbOptions, ip: IpAddr) -> Rdma {
        Rdma { opts, ip }
    }
}

impl Transport for Rdma {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn scope(&self) -> Scope {
        Scope::Network
    }

    fn prepare(self: Box<Self>, ctx: &SetupCtx) -> Result<Box<dyn Prepared>, Error> {
        // Options set in code get the variables' ranges too (zero queue pairs would divide by zero).
        self.opts.check()?;
        let g = ctx.geometry;
        if g.channels > super::wire::MAX_CHANNELS || g.slots > super::wire::MAX_SLOTS {
            return Err(Error::invalid(format!(
                "rdma carries at most {} channels of {} slots ({} channels of {} slots asked)",
                super::wire::MAX_CHANNELS,
                super::wire::MAX_SLOTS,
                g.channels,
                g.slots
            )));
        }
        if g.slot_bytes + super::wire::HEADER > u32::MAX as usize / 2 {
            return Err(Error::invalid(format!(
                "rdma slots of {} bytes are too large",
                g.slot_bytes
            )));
        }
        let choice = choose_port(&self.opts, g.rank)?;
        let device = Context::open(&choice.device)?;
        let pd = Pd::new(&device)?;
        let channel = Channel::new(&device)?;
        let listener = TcpListener::bind(SocketAddr::new(self.ip, 0))
            .map_err(|e| Error::io(format!("listening for RDMA peers on {}", self.ip), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the RDMA listener's address", e))?;
        debug!(
            rank = g.rank,
            device = choice.device,
            port = choice.port.port,
            gid_index = choice.gid.index,
            "rdma prepared"
        );
        Ok(Box::new(RdmaPrepared {
            opts: self.opts,
            choice,
            pd,
            channel,
            listener,
            addr,
        }))
    }
}

struct RdmaPrepared {
    opts: IbOptions,
    choice: PortChoice,
    pd: Arc<Pd>,
    channel: Arc<Channel>,
    listener: TcpListener,
    addr: SocketAddr,
}

/// Everything of one peer before its queue pairs are connected.
struct Pending {
    rank: usize,
    qps: Vec<Qp<Init>>,
    psn: u32,
}

/// Receives a queue pair holds per (peer) queue pair: a part of every slot of every channel, and a
/// credit for every slot of every channel.
fn recvs_per_qp(channels: usize, slots: usize) -> u32 {
    (2 * channels * slots) as u32
}

impl Prepared for RdmaPrepared {
    fn endpoint(&self) -> Vec<u8> {
        RdmaEndpoint {
            device: self.choice.device.clone(),
            port: self.choice.port.port,
            addr: self.addr,
        }
        .encode()
    }

    fn connect(
        self: Box<Self>,
        ctx: &SetupCtx,
        peers: &[Option<&Peer>],
    ) -> Result<Box<dyn Connected>, Error> {
        let g = ctx.geometry;
        let me = *self;
        let ranks: Vec<usize> = (0..g.world).filter(|p| peers[*p].is_some()).collect();
        let mut endpoints = HashMap::new();
        for &p in &ranks {
            let blob = peers[p]
                .and_then(|i| i.endpoint("rdma"))
                .unwrap_or_default();
            endpoints.insert(p, RdmaEndpoint::decode(blob)?);
        }
        let nq = me.opts.qps_per_peer;
        let stride = super::link::stride(g.slot_bytes);
        let ring_bytes = g.channels * g.slots * stride;
        let n = ranks.len();
        let inbound = Mr::alloc(&me.pd, n * ring_bytes, true)?;
        let staging = Mr::alloc(&me.pd, n * ring_bytes, false)?;
        let control = Mr::alloc(&me.pd, 2 * n * g.channels * 4, true)?;
        let recv_per_qp = recvs_per_qp(g.channels, g.slots);
        let send_per_qp = recv_per_qp + 4;
        let cq = Cq::new(
            me.pd.context(),
            &me.channel,
            (n * nq) as u32 * (recv_per_qp + send_per_qp),
        )?;
        let caps = QpCaps {
            send: send_per_qp,
            recv: recv_per_qp,
            inline: 64,
        };
        let port = me.choice.port.port;
        let mut pending = Vec::with_capacity(n);
        let mut mine: HashMap<usize, Connect> = HashMap::new();
        for (pi, &p) in ranks.iter().enumerate() {
            let mut qps = Vec::with_capacity(nq);
            for q in 0..nq {
                let qp = Qp::create(&me.pd, &cq, caps, port)?;
                for _ in 0..recv_per_qp {
                    qp.post_recv(super::link::recv_wr_id(pi, q), None)?;
                }
                qps.push(qp);
            }
            let psn = (rand_u32() ^ (p as u32).wrapping_mul(0x9e37_79b9)) & 0x00ff_ffff;
            mine.insert(
                p,
                Connect {
                    secret: ctx.secret,
                    from: g.rank as u32,
                    to: p as u32,
                    channels: g.channels as u32,
                    slots: g.slots as u32,
                    slot_bytes: g.slot_bytes as u32,
                    gid: me.choice.gid.gid,
                    lid: me.choice.port.lid,
                    mtu: me.choice.port.active_mtu as u8,
                    psn,
                    qpns: qps.iter().map(Qp::qpn).collect(),
                    ring: (inbound.addr() + (pi * ring_bytes) as u64, inbound.rkey()),
                    credit: (
                        control.addr() + (pi * g.channels * 4) as u64,
                        control.rkey(),
                    ),
                },
            );
            pending.push(Pending { rank: p, qps, psn });
        }
        let (theirs, mut sockets) = exchange(
            g.rank,
            &me.listener,
            &ranks,
            &endpoints,
            &mine,
            ctx.deadline,
        )?;
        let mut peers_live = Vec::with_capacity(n);
        for (pi, pend) in pending.into_iter().enumerate() {
            let p = pend.rank;
            let c = &theirs[&p];
            let mtu = match me.opts.mtu {
                Some(b) => mtu_code(b).ok_or_else(|| {
                    Error::invalid(format!(
                        "BRAID_IB_MTU={b} is not 256, 512, 1024, 2048 or 4096"
                    ))
                })?,
                None => u32::from(c.mtu),
            }
            .min(me.choice.port.active_mtu)
            .min(u32::from(c.mtu))
            .max(1);
            let path = PathOpts {
                port,
                gid_index: me.choice.gid.index as u8,
                global: me.choice.port.ethernet || c.lid == 0,
                mtu,
                traffic_class: me.opts.traffic_class,
                timeout: me.opts.timeout,
                retry_cnt: me.opts.retry_cnt,
            };
            let mut qps = Vec::with_capacity(nq);
            for (q, qp) in pend.qps.into_iter().enumerate() {
                let remote = Remote {
                    qpn: c.qpns[q],
                    psn: c.psn,
                    gid: c.gid,
                    lid: c.lid,
                    mtu,
                };
                let qp = qp
                    .ready_to_receive(&remote, &path)
                    .map_err(|e| {
                        Error::Bootstrap(format!(
                            "rank {} connecting to rank {p} over {}: {e}",
                            g.rank, me.choice.device
                        ))
                    })?
                    .ready_to_send(pend.psn, &path)?;
                qps.push(qp);
            }
            peers_live.push(super::link::PeerLink::new(
                p,
                pi,
                qps,
                c.ring,
                c.credit,
                sockets.remove(&p),
                g.channels,
                g.slots,
            ));
        }
        debug!(rank = g.rank, peers = n, qps = nq, "rdma connected");
        let link = RdmaLink::new(super::link::Parts {
            rank: g.rank,
            world: g.world,
            channels: g.channels,
            slots: g.slots,
            slot_bytes: g.slot_bytes,
            policy: ctx.policy,
            peers: peers_live,
            inbound,
            staging,
            control,
            cq,
            channel: me.channel,
            pd: me.pd.clone(),
            device: me.choice.device.clone(),
            bad_rkey: me.opts.bad_rkey_rank == Some(g.rank),
        });
        Ok(Box::new(RdmaConnected(link)))
    }
}

/// Every peer's [`Connect`] message, and the socket to it.
type Exchanged = (HashMap<usize, Connect>, HashMap<usize, TcpStream>);

/// Swaps [`Connect`] messages with every peer: this rank dials the lower ranks and accepts the higher
/// ones. Returns each peer's message and the socket to it (kept: it closes when the peer's process
/// ends, which is how a peer's death is seen on any host).
fn exchange(
    rank: usize,
    listener: &TcpListener,
    ranks: &[usize],
    endpoints: &HashMap<usize, RdmaEndpoint>,
    mine: &HashMap<usize, Connect>,
    deadline: Instant,
) -> Result<Exchanged, Error> {
    let higher: Vec<usize> = ranks.iter().copied().filter(|p| *p > rank).collect();
    let replies: HashMap<usize, Vec<u8>> = higher.iter().map(|p| (*p, mine[p].encode())).collect();
    let expect: HashMap<usize, Connect> = higher.iter().map(|p| (*p, mine[p].clone())).collect();
    let l = listener
        .try_clone()
        .map_err(|e| Error::io("cloning the RDMA listener", e))?;
    let accept = std::thread::Builder::new()
        .name(format!("braid-ib-accept-{rank}"))
        .spawn(move || accept_all(l, rank, replies, expect, deadline))
        .map_err(|e| Error::io("starting the RDMA accept thread", e))?;
    let mut theirs = HashMap::new();
    let mut sockets = HashMap::new();
    let mut result = Ok(());
    for &p in ranks.iter().filter(|p| **p < rank) {
        match dial(rank, p, endpoints[&p].addr, &mine[&p], deadline) {
            Ok((c, s)) => {
                theirs.insert(p, c);
                sockets.insert(p, s);
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    if result.is_err() {
        // Wake the acceptor now rather than at the deadline.
        if let Ok(a) = listener.local_addr() {
            let _ = TcpStream::connect(a);
        }
    }
    let accepted = accept
        .join()
        .map_err(|_| Error::Bootstrap("the RDMA accept thread panicked".into()))?;
    result?;
    for (p, c, s) in accepted? {
        theirs.insert(p, c);
        sockets.insert(p, s);
    }
    Ok((theirs, sockets))
}

/// Checks a peer's [`Connect`] against this rank's message to it.
fn check_connect(c: &Connect, mine: &Connect) -> Result<(), String> {
    if !same_secret(&c.secret, &mine.secret) {
        return Err("wrong secret".into());
    }
    if c.to != mine.from || c.from != mine.to {
        return Err(format!(
            "from rank {} to rank {}, where rank {} expects rank {}",
            c.from, c.to, mine.from, mine.to
        ));
    }
    if (c.channels, c.slots, c.slot_bytes) != (mine.channels, mine.slots, mine.slot_bytes) {
        return Err(format!(
            "{} channels of {} slots of {} bytes where this rank uses {} of {} of {}",
            c.channels, c.slots, c.slot_bytes, mine.channels, mine.slots, mine.slot_bytes
        ));
    }
    if c.qpns.len() != mine.qpns.len() {
        return Err(format!(
            "{} queue pairs per peer where this rank uses {} (set BRAID_IB_QPS_PER_PEER alike on every rank)",
            c.qpns.len(),
            mine.qpns.len()
        ));
    }
    Ok(())
}

/// Slice of a blocked read or write on a connection socket.
const SLICE: Duration = Duration::from_millis(5);

fn dial(
    rank: usize,
    p: usize,
    addr: SocketAddr,
    mine: &Connect,
    deadline: Instant,
) -> Result<(Connect, TcpStream), Error> {
    let what = || format!("rank {rank} connecting to rank {p} (rdma) at {addr}");
    let mut s = crate::tcp::connect_until(addr, deadline, what)?;
    let _ = s.set_nodelay(true);
    s.set_read_timeout(Some(SLICE))
        .map_err(|e| Error::io(what(), e))?;
    s.write_all(&mine.encode())
        .map_err(|e| Error::io(what(), e))?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 256];
    loop {
        let want = Connect::remaining(&buf).min(chunk.len());
        if want == 0 {
            break;
        }
        if Instant::now() >= deadline {
            return Err(Error::Bootstrap(format!("timed out {}: no reply", what())));
        }
        match s.read(&mut chunk[..want]) {
            Ok(0) => {
                return Err(Error::Bootstrap(format!(
                    "{}: the peer closed the connection (it refused this rank: see its log)",
                    what()
                )))
            }
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(Error::io(what(), e)),
        }
    }
    let c = Connect::decode(&buf)?;
    check_connect(&c, mine).map_err(|why| Error::Bootstrap(format!("{}: {why}", what())))?;
    Ok((c, s))
}

type Accepted = Vec<(usize, Connect, TcpStream)>;

/// Accepts the higher ranks' connections until each has sent a valid [`Connect`] and had its reply,
/// or the deadline. Strangers and bad messages are refused with a warning and do not count.
fn accept_all(
    listener: TcpListener,
    rank: usize,
    replies: HashMap<usize, Vec<u8>>,
    expect: HashMap<usize, Connect>,
    deadline: Instant,
) -> Result<Accepted, Error> {
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("configuring the RDMA listener", e))?;
    let mut greeter = Greeter::new("the RDMA connection port", 64, Duration::from_secs(10));
    let mut got: Accepted = Vec::new();
    while got.len() < expect.len() {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<String> = expect
                .keys()
                .filter(|p| !got.iter().any(|(q, _, _)| q == *p))
                .map(|p| p.to_string())
                .collect();
            return Err(Error::Bootstrap(format!(
                "rank {rank} timed out waiting for RDMA connections from rank(s) {}",
                missing.join(", ")
            )));
        }
        let (greeted, busy) = greeter.poll(&listener, now, deadline, Connect::remaining);
        for Greeted {
            mut stream,
            from,
            first,
        } in greeted
        {
            let checked = first
                .and_then(|b| Connect::decode(&b).map_err(|e| e.to_string()))
                .and_then(|c| {
                    let p = c.from as usize;
                    match expect.get(&p) {
                        None => Err(format!("rank {p} is not an RDMA peer of rank {rank}")),
                        Some(_) if got.iter().any(|(q, _, _)| *q == p) => {
                            Err(format!("a second connection from rank {p}"))
                        }
                        Some(mine) => check_connect(&c, mine).map(|()| c),
                    }
                });
            let c = match checked {
                Ok(c) => c,
                Err(why) => {
                    warn!(rank, "refused an RDMA connection from {from}: {why}");
                    continue;
                }
            };
            let p = c.from as usize;
            let _ = stream.set_nodelay(true);
            let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
            if let Err(e) = stream.write_all(&replies[&p]) {
                warn!(
                    rank,
                    "replying to rank {p} over its RDMA connection failed: {e}"
                );
                continue;
            }
            got.push((p, c, stream));
        }
        if !busy && got.len() < expect.len() {
            std::thread::sleep(Duration::from_micros(500));
        }
    }
    Ok(got)
}

/// A random 32-bit number (for packet sequence numbers).
fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        b = (t ^ std::process::id()).to_le_bytes();
    }
    u32::from_le_bytes(b)
}

struct RdmaConnected(RdmaLink);

impl Connected for RdmaConnected {
    fn activate(self: Box<Self>) -> Result<Box<dyn Link>, Error> {
        Ok(Box::new(self.0))
    }
}
