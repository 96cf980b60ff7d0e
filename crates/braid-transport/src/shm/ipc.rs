//! The `ipc` transport: the shared-memory protocol with every slot's payload in device memory (CUDA IPC
//! on a GPU; [`EmulatedDevice`](crate::EmulatedDevice) without one).
//!
//! Setup, per rank:
//! - **prepare:** the segment (headers and credits only), one device allocation for all of this rank's
//!   inbound payload rings, and a Unix socket in the abstract namespace. The endpoint names the segment,
//!   the socket and the allocation's size.
//! - **connect:** every rank serves its allocation's offer to each peer that shows the communicator's
//!   secret (strangers are dropped), and fetches each peer's offer, checks it and its size against the
//!   peer's endpoint and maps it. Both run at once (the serving side on a scoped thread), all before the
//!   setup deadline.
//! - **activate:** the segment's name goes; the link is a [`ShmLink`] with a [`DevicePlane`].
//!
//! An offer is one message of [`OFFER_BYTES`], little-endian: the rings' bytes (u64), what they are
//! shared by (u32: [`KIND_FD`] or [`KIND_HANDLE`]), the handle's length (u32, 0 for a descriptor) and the
//! handle's bytes, zero-padded to [`MAX_HANDLE_BYTES`]; a descriptor comes with it as `SCM_RIGHTS`, a
//! handle without one. A peer's offer is untrusted: a wrong kind or length, a descriptor missing or one
//! too many is a bootstrap error naming the peer (a stray descriptor is closed).
//!
//! A descriptor in flight keeps its memory alive; a handle does not: the exporter's allocation must
//! still be there when a peer opens it, and (CUDA's legacy handles) for as long as the peer uses it. The
//! link keeps a rank's allocation for its whole life, so ranks set up and tear down links together.

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_core::Error;

use super::layout::Layout;
use super::link::{DevicePlane, ShmLink};
use super::segment::{sweep_stale, Segment};
use crate::device::{
    recv_msg, send_msg, DeviceAllocation, DeviceMemory, Shareable, MAX_HANDLE_BYTES,
};
use crate::link::Link;
use crate::plugin::{Connected, Peer, Prepared, Scope, SetupCtx, Transport};
use crate::wait::WaitPolicy;

/// The transport's name, as endpoints and routes say it.
pub const NAME: &str = "ipc";

/// How long a connection may take to say who it is before it is dropped.
const HELLO_PATIENCE: Duration = Duration::from_secs(2);

/// Bytes of an offer (see the module docs).
pub const OFFER_BYTES: usize = 16 + MAX_HANDLE_BYTES;
/// An offer's kind: the rings are shared by the descriptor that comes with it.
pub const KIND_FD: u32 = 1;
/// An offer's kind: the rings are shared by the handle it holds.
pub const KIND_HANDLE: u32 = 2;

/// The offer of `bytes` of rings shared by `shared`.
pub fn encode_offer(bytes: usize, shared: &Shareable) -> Result<[u8; OFFER_BYTES], Error> {
    let mut msg = [0u8; OFFER_BYTES];
    msg[..8].copy_from_slice(&(bytes as u64).to_le_bytes());
    let kind = match shared {
        Shareable::Fd(_) => KIND_FD,
        Shareable::Handle(h) => {
            if h.is_empty() || h.len() > MAX_HANDLE_BYTES {
                return Err(Error::Internal(format!(
                    "ipc: a device memory handle of {} bytes (1 to {MAX_HANDLE_BYTES} fit an offer)",
                    h.len()
                )));
            }
            msg[12..16].copy_from_slice(&(h.len() as u32).to_le_bytes());
            msg[16..16 + h.len()].copy_from_slice(h);
            KIND_HANDLE
        }
    };
    msg[8..12].copy_from_slice(&kind.to_le_bytes());
    Ok(msg)
}

/// The rings' bytes and what they are shared by, from a peer's offer and the descriptor that came with
/// it (closed when it should not have come); an error says what was wrong.
pub fn decode_offer(
    msg: &[u8; OFFER_BYTES],
    fd: Option<OwnedFd>,
) -> Result<(usize, Shareable), String> {
    let word = |i: usize| u32::from_le_bytes([msg[i], msg[i + 1], msg[i + 2], msg[i + 3]]);
    let mut size = [0u8; 8];
    size.copy_from_slice(&msg[..8]);
    let size = u64::from_le_bytes(size);
    let bytes = usize::try_from(size).map_err(|_| format!("it offered {size} bytes of rings"))?;
    let (kind, len) = (word(8), word(12));
    let shared = match (kind, fd) {
        (KIND_FD, Some(fd)) if len == 0 => Shareable::Fd(fd),
        (KIND_FD, Some(_)) => return Err(format!("its descriptor offer holds {len} handle bytes")),
        (KIND_FD, None) => return Err("its descriptor did not come with its offer".into()),
        (KIND_HANDLE, Some(_)) => {
            return Err("its handle offer came with a descriptor (closed)".into())
        }
        (KIND_HANDLE, None) => {
            let len = len as usize;
            if len == 0 || len > MAX_HANDLE_BYTES {
                return Err(format!(
                    "its offer holds a handle of {len} bytes (1 to {MAX_HANDLE_BYTES} allowed)"
                ));
            }
            Shareable::Handle(msg[16..16 + len].to_vec())
        }
        (kind, _) => return Err(format!("its offer is of unknown kind {kind}")),
    };
    Ok((bytes, shared))
}

/// Device-memory rings between the processes of one host.
pub struct Ipc {
    dir: PathBuf,
    memory: Arc<dyn DeviceMemory>,
}

impl Ipc {
    /// Segments go in `dir` (normally `/dev/shm`), payload rings in `memory`.
    pub fn new(dir: impl Into<PathBuf>, memory: Arc<dyn DeviceMemory>) -> Ipc {
        Ipc {
            dir: dir.into(),
            memory,
        }
    }
}

impl Transport for Ipc {
    fn name(&self) -> &'static str {
        NAME
    }

    fn scope(&self) -> Scope {
        Scope::Host
    }

    fn prepare(self: Box<Self>, ctx: &SetupCtx) -> Result<Box<dyn Prepared>, Error> {
        sweep_stale(&self.dir);
        let g = ctx.geometry;
        let name = format!("braid-{:016x}-r{}-ipc", ctx.nonce, g.rank);
        let layout = Layout {
            world: g.world,
            channels: g.channels,
            slots: g.slots,
            slot_bytes: g.slot_bytes,
            device: true,
        };
        let own = Segment::create(&self.dir.join(&name), layout, g.rank)?;
        let bytes = layout.device_bytes(self.memory.granularity());
        let share = DeviceShare::new(&*self.memory, &name, bytes)?;
        Ok(Box::new(IpcPrepared {
            own,
            layout,
            memory: self.memory,
            share,
        }))
    }
}

/// What a peer published: its segment and its device share.
struct Remote {
    path: String,
    share: ShareRemote,
}

/// Where a peer's device share is fetched from, and how many bytes it must have.
struct ShareRemote {
    socket: String,
    bytes: usize,
}

fn parse_endpoint(p: usize, blob: &[u8]) -> Result<Remote, Error> {
    let bad = || Error::Bootstrap(format!("rank {p} published a malformed ipc endpoint"));
    let text = std::str::from_utf8(blob).map_err(|_| bad())?;
    let mut parts = text.split('\n');
    let (Some(path), Some(socket), Some(bytes), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    Ok(Remote {
        path: path.to_string(),
        share: ShareRemote {
            socket: socket.to_string(),
            bytes: bytes.parse().map_err(|_| bad())?,
        },
    })
}

struct IpcPrepared {
    own: Segment,
    layout: Layout,
    memory: Arc<dyn DeviceMemory>,
    share: DeviceShare,
}

fn left(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
}

/// One device allocation of this rank that the other ranks of the host map: offered over an abstract
/// Unix socket to each peer that shows the communicator's secret, and fetched from each peer's socket
/// (an offer of [`OFFER_BYTES`], with its descriptor as `SCM_RIGHTS` where it is shared by one). The
/// `ipc` transport shares its rings so; the device-resident collectives share their windows so.
pub struct DeviceShare {
    alloc: Box<dyn DeviceAllocation>,
    /// What `alloc` is shared by: a descriptor stays open until the exchange is over.
    shared: Shareable,
    offer: [u8; OFFER_BYTES],
    listener: UnixListener,
    socket: String,
    bytes: usize,
}

/// This rank's allocation and every peer's as mapped here (`None` for this rank and for ranks that
/// were not asked for).
pub struct SharedAllocations {
    /// This rank's allocation.
    pub own: Box<dyn DeviceAllocation>,
    /// Each peer's allocation, mapped in this process.
    pub peers: Vec<Option<Box<dyn DeviceAllocation>>>,
}

impl DeviceShare {
    /// Allocates `bytes` (a multiple of the memory's granularity) of zeroed device memory and listens
    /// on the abstract socket `@name` for peers (non-blocking).
    pub fn new(memory: &dyn DeviceMemory, name: &str, bytes: usize) -> Result<DeviceShare, Error> {
        let (alloc, shared) = memory.allocate(bytes)?;
        let offer = encode_offer(bytes, &shared)?;
        let what = || format!("listening on the abstract socket @{name}");
        let addr =
            SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| Error::io(what(), e))?;
        let listener = UnixListener::bind_addr(&addr).map_err(|e| Error::io(what(), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io(what(), e))?;
        Ok(DeviceShare {
            alloc,
            shared,
            offer,
            listener,
            socket: name.to_string(),
            bytes,
        })
    }

    /// The device address of this rank's allocation.
    pub fn addr(&self) -> u64 {
        self.alloc.addr()
    }

    /// What peers need to fetch the allocation: `socket\nbytes`.
    pub fn endpoint(&self) -> Vec<u8> {
        format!("{}\n{}", self.socket, self.bytes).into_bytes()
    }

    /// Serves this rank's offer to the peers that `endpoints` names (`Some`: each peer's
    /// [`endpoint`](Self::endpoint)) while fetching and mapping each of theirs, all before the setup
    /// deadline. A peer's endpoint or offer that is malformed, or that disagrees with its endpoint, is
    /// a bootstrap error naming the peer.
    pub fn exchange(
        self,
        ctx: &SetupCtx,
        memory: &dyn DeviceMemory,
        endpoints: &[Option<&[u8]>],
    ) -> Result<SharedAllocations, Error> {
        let mut remotes = Vec::with_capacity(endpoints.len());
        for (p, e) in endpoints.iter().enumerate() {
            remotes.push(match e {
                None => None,
                Some(blob) => {
                    let bad =
                        || Error::Bootstrap(format!("rank {p} published a malformed device share"));
                    let text = std::str::from_utf8(blob).map_err(|_| bad())?;
                    let (socket, bytes) = text.split_once('\n').ok_or_else(bad)?;
                    Some(ShareRemote {
                        socket: socket.to_string(),
                        bytes: bytes.parse().map_err(|_| bad())?,
                    })
                }
            });
        }
        let peers = self.swap(ctx, memory, &remotes)?;
        Ok(SharedAllocations {
            own: self.alloc,
            peers,
        })
    }

    /// Serves this rank's offer to every peer in `remotes` while fetching theirs.
    fn swap(
        &self,
        ctx: &SetupCtx,
        memory: &dyn DeviceMemory,
        remotes: &[Option<ShareRemote>],
    ) -> Result<Vec<Option<Box<dyn DeviceAllocation>>>, Error> {
        let expected: Vec<usize> = (0..remotes.len())
            .filter(|&p| remotes[p].is_some())
            .collect();
        let (served, fetched) = std::thread::scope(|s| {
            let server = s.spawn(|| self.serve(ctx, &expected));
            let fetched: Result<Vec<Option<Box<dyn DeviceAllocation>>>, Error> = remotes
                .iter()
                .enumerate()
                .map(|(p, r)| r.as_ref().map(|r| fetch(ctx, memory, p, r)).transpose())
                .collect();
            let served = server.join().unwrap_or_else(|_| {
                Err(Error::Internal("ipc: the serving thread panicked".into()))
            });
            (served, fetched)
        });
        served?;
        fetched
    }

    /// Hands this rank's offer to each of `expected` peers that shows the secret.
    fn serve(&self, ctx: &SetupCtx, expected: &[usize]) -> Result<(), Error> {
        let mut served = vec![false; ctx.geometry.world];
        let mut pending = expected.len();
        while pending > 0 {
            let Some(remaining) = left(ctx.deadline) else {
                let missing: Vec<usize> =
                    expected.iter().copied().filter(|&p| !served[p]).collect();
                return Err(Error::Bootstrap(format!(
                    "ipc: ranks {missing:?} did not fetch rank {}'s device rings before the setup deadline",
                    ctx.geometry.rank
                )));
            };
            let sock = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(1).min(remaining));
                    continue;
                }
                Err(e) => return Err(Error::io("ipc: accepting a peer", e)),
            };
            // A peer sends its hello as soon as it connects: a connection that stays silent (a stranger)
            // is dropped after a short wait instead of holding the real peers back until the deadline.
            let patience = remaining.min(HELLO_PATIENCE);
            let hello = (|| -> std::io::Result<[u8; 20]> {
                sock.set_nonblocking(false)?;
                sock.set_read_timeout(Some(patience))?;
                sock.set_write_timeout(Some(patience))?;
                let mut hello = [0u8; 20];
                (&sock).read_exact(&mut hello)?;
                Ok(hello)
            })();
            let Ok(hello) = hello else { continue };
            let rank = u32::from_le_bytes([hello[16], hello[17], hello[18], hello[19]]) as usize;
            if hello[..16] != ctx.secret || !expected.contains(&rank) || served[rank] {
                tracing::warn!(
                    "ipc: refused a connection that did not show the communicator's secret"
                );
                continue;
            }
            let fd = match &self.shared {
                Shareable::Fd(fd) => Some(fd.as_fd()),
                Shareable::Handle(_) => None,
            };
            send_msg(&sock, &self.offer, fd)?;
            served[rank] = true;
            pending -= 1;
        }
        Ok(())
    }
}

/// Fetches and maps peer `p`'s device rings.
fn fetch(
    ctx: &SetupCtx,
    memory: &dyn DeviceMemory,
    p: usize,
    remote: &ShareRemote,
) -> Result<Box<dyn DeviceAllocation>, Error> {
    let what = || {
        format!(
            "ipc: fetching rank {p}'s device rings from @{}",
            remote.socket
        )
    };
    let addr = SocketAddr::from_abstract_name(remote.socket.as_bytes())
        .map_err(|e| Error::io(what(), e))?;
    let sock = loop {
        match UnixStream::connect_addr(&addr) {
            Ok(s) => break s,
            Err(e) => match left(ctx.deadline) {
                Some(r) => std::thread::sleep(Duration::from_millis(2).min(r)),
                None => return Err(Error::io(what(), e)),
            },
        }
    };
    let remaining = left(ctx.deadline).unwrap_or(Duration::from_millis(1));
    sock.set_read_timeout(Some(remaining))
        .and_then(|()| sock.set_write_timeout(Some(remaining)))
        .map_err(|e| Error::io(what(), e))?;
    let mut hello = [0u8; 20];
    hello[..16].copy_from_slice(&ctx.secret);
    hello[16..].copy_from_slice(&(ctx.geometry.rank as u32).to_le_bytes());
    (&sock)
        .write_all(&hello)
        .map_err(|e| Error::io(what(), e))?;
    let mut offer = [0u8; OFFER_BYTES];
    let fd =
        recv_msg(&sock, &mut offer).map_err(|e| Error::Bootstrap(format!("{}: {e}", what())))?;
    let (bytes, shared) =
        decode_offer(&offer, fd).map_err(|why| Error::Bootstrap(format!("{}: {why}", what())))?;
    if bytes != remote.bytes {
        return Err(Error::Bootstrap(format!(
            "{}: it sent {bytes} bytes of rings, its endpoint said {}",
            what(),
            remote.bytes
        )));
    }
    memory.import(shared, bytes).map_err(|e| match e {
        Error::Bootstrap(why) => Error::Bootstrap(format!("{}: {why}", what())),
        e => e,
    })
}

impl Prepared for IpcPrepared {
    fn endpoint(&self) -> Vec<u8> {
        format!(
            "{}\n{}\n{}",
            self.own.path().display(),
            self.share.socket,
            self.share.bytes
        )
        .into_bytes()
    }

    fn connect(
        self: Box<Self>,
        ctx: &SetupCtx,
        peers: &[Option<&Peer>],
    ) -> Result<Box<dyn Connected>, Error> {
        let mut remotes = Vec::with_capacity(peers.len());
        for (p, peer) in peers.iter().enumerate() {
            remotes.push(match peer {
                None => None,
                Some(peer) => Some(parse_endpoint(p, peer.endpoint(NAME).unwrap_or_default())?),
            });
        }
        let mut segments = Vec::with_capacity(peers.len());
        for (p, r) in remotes.iter().enumerate() {
            segments.push(match r {
                None => None,
                Some(r) => Some(Segment::open(Path::new(&r.path), self.layout, p)?),
            });
        }
        let shares: Vec<Option<ShareRemote>> =
            remotes.into_iter().map(|r| r.map(|r| r.share)).collect();
        let fetched = self.share.swap(ctx, &*self.memory, &shares)?;
        let IpcPrepared {
            own, memory, share, ..
        } = *self;
        let alloc = share.alloc;
        Ok(Box::new(IpcConnected {
            own,
            peers: segments,
            policy: ctx.policy,
            plane: DevicePlane {
                ordinal: memory.ordinal(),
                own: alloc,
                peers: fetched,
            },
        }))
    }
}

struct IpcConnected {
    own: Segment,
    peers: Vec<Option<Segment>>,
    policy: WaitPolicy,
    plane: DevicePlane,
}

impl Connected for IpcConnected {
    fn activate(self: Box<Self>) -> Result<Box<dyn Link>, Error> {
        self.own.unlink()?;
        Ok(Box::new(ShmLink::with_device(
            self.own,
            self.peers,
            self.policy,
            self.plane,
        )))
    }
}
