//! Buffers every rank of a host maps ([`Communicator::alloc`]), and collectives that run straight
//! through them: no slot, no staging copy. Rank `r` reduces slice `r` of the vector from every rank's
//! input in rank order (so every rank ends with the same bits) and, for an all-reduce, stores it into
//! every rank's output; a board of flags per rank orders the phases (`braid_transport::shm::window`).
//! Small collectives (inputs up to 8 KiB) go through copies on the boards instead, with one exchange
//! of flags.
//!
//! A collective takes this path when every buffer it names (input and output, where non-empty) lies
//! in memory from [`Communicator::alloc`], on every rank: each rank decides for itself, so all of them
//! must pass shared buffers, or none (a mix is not detected early: it ends in a timeout naming the
//! collective). All-reduce, reduce-scatter, all-gather, broadcast and reduce take it, in place or not;
//! barriers and all-to-all keep the message path.

mod memory;
mod run;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use braid_core::{DType, Element, Error, ReduceOp};
use braid_transport::shm::window::{Board, Window};
use braid_transport::WaitPolicy;

use crate::call::Call;
use crate::Communicator;

use memory::Allocation;
pub(crate) use memory::Shared;
pub(crate) use run::SharedRun;

/// Where shared memory lives (tmpfs).
const DIR: &str = "/dev/shm";
/// Bytes of one rank's record in the allocation exchange.
const RECORD: usize = 256;
const PATH_BYTES: usize = 112;

/// Memory that every rank of the host maps, from [`Communicator::alloc`]. Collectives whose buffers
/// all lie in such memory (on every rank) run through it directly. Page-aligned, zeroed when
/// allocated. Every rank's mapping of it lasts as long as its communicator: dropping the buffer
/// only ends its use by collectives.
pub struct SharedBuffer {
    window: Arc<Window>,
    index: usize,
}

impl SharedBuffer {
    /// Bytes.
    pub fn len(&self) -> usize {
        self.window.len()
    }

    /// Whether it has no bytes (never: allocations are at least one byte).
    pub fn is_empty(&self) -> bool {
        self.window.is_empty()
    }

    /// The allocation's number on this communicator (the same on every rank).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.window.as_ptr()
    }

    /// The first byte, for writing.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.window.as_ptr()
    }

    /// The buffer as elements of `T` (as many whole ones as fit).
    pub fn as_slice<T: Element>(&self) -> &[T] {
        // SAFETY: the mapping is page-aligned (aligned for every element type), `len` bytes long and
        // lives as long as `self`; every bit pattern is a valid `T` (Pod). Other ranks read it only
        // during a collective that borrows it here, and write it only as such a collective's output.
        unsafe {
            std::slice::from_raw_parts(
                self.window.as_ptr() as *const T,
                self.len() / size_of::<T>(),
            )
        }
    }

    /// The buffer as elements of `T`, for writing.
    pub fn as_mut_slice<T: Element>(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only view in this process.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.window.as_ptr() as *mut T,
                self.len() / size_of::<T>(),
            )
        }
    }
}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("index", &self.index)
            .field("len", &self.len())
            .finish()
    }
}

impl Shared {
    /// The run of `op` on shared buffers, when its kind takes that path and all its buffers are
    /// shared; `None` otherwise (the op runs on messages).
    pub(crate) fn start(
        &mut self,
        op: &Call,
        stream: usize,
        seq: u64,
        started: Instant,
        deadline: Instant,
    ) -> Option<SharedRun> {
        let (send, recv) = self.places(op)?;
        let world = self.world();
        let next = self.next.get_mut(stream)?;
        let (base, ops) = *next;
        *next = (base.wrapping_add(3), ops + 1);
        let (input, output) = op.spans();
        Some(SharedRun::new(
            op.kind,
            op.dtype,
            op.redop(),
            op.count,
            (send, recv),
            ((input.addr(), input.len()), output.addr()),
            world,
            stream,
            seq,
            (base, ops),
            started,
            deadline,
        ))
    }

    /// Advances `run` by at most `budget` steps.
    pub(crate) fn poll(
        &self,
        run: &mut SharedRun,
        budget: u64,
    ) -> Result<braid_exec::Progress, Error> {
        run.poll(self, budget)
    }

    /// Sleeps until what `run` waits for may have happened, or `until`.
    pub(crate) fn wait(
        &self,
        run: &mut SharedRun,
        abort: &AtomicBool,
        until: Instant,
    ) -> Result<(), Error> {
        run.wait(self, abort, until)
    }
}

/// The peers' windows, every rank's (address, bytes), and the peers' boards (the first time).
type Mapped = (Vec<Window>, Vec<(usize, usize)>, Vec<Option<Board>>);

/// This rank's part of an allocation exchange.
struct Record {
    /// 0, or what went wrong: 1 out of memory, 2 an error creating the file.
    status: u64,
    bytes: u64,
    window: String,
    board: String,
}

impl Record {
    fn encode(&self) -> [u8; RECORD] {
        let mut b = [0u8; RECORD];
        b[0..8].copy_from_slice(&self.status.to_le_bytes());
        b[8..16].copy_from_slice(&self.bytes.to_le_bytes());
        for (at, s) in [(16, &self.window), (16 + PATH_BYTES, &self.board)] {
            let s = s.as_bytes();
            let n = s.len().min(PATH_BYTES);
            b[at..at + n].copy_from_slice(&s[..n]);
        }
        b
    }

    fn decode(b: &[u8]) -> Record {
        let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default());
        let text = |at: usize| {
            let s = &b[at..at + PATH_BYTES];
            let end = s.iter().position(|&c| c == 0).unwrap_or(PATH_BYTES);
            String::from_utf8_lossy(&s[..end]).into_owned()
        };
        Record {
            status: word(0),
            bytes: word(8),
            window: text(16),
            board: text(16 + PATH_BYTES),
        }
    }
}

fn unique_name(what: &str, rank: usize) -> Result<String, Error> {
    let mut r = [0u8; 8];
    getrandom::fill(&mut r).map_err(|e| Error::Internal(format!("no randomness: {e}")))?;
    Ok(format!(
        "braid-{what}-{}-{:016x}-r{rank}",
        std::process::id(),
        u64::from_le_bytes(r)
    ))
}

impl Communicator {
    /// Allocates `bytes` of memory that every rank of the host maps, zeroed. Collective: every rank
    /// calls it, in the same order (each may ask for a different size). Collectives whose buffers all
    /// lie in such memory — on every rank — run straight through it, with no staging copies (see the
    /// [module docs](crate::shared)). Memory the machine does not have (`MemAvailable`, or the space
    /// left in `/dev/shm`) is refused on every rank with [`Error::OutOfMemory`] naming the rank, and
    /// so is a communicator whose ranks are on several hosts ([`Error::InvalidArgument`]).
    pub fn alloc(&self, bytes: usize) -> Result<SharedBuffer, Error> {
        let inner = &self.inner;
        if inner.hosts.len() > 1 {
            return Err(Error::invalid(format!(
                "alloc: shared buffers need every rank on one host; this communicator spans {} hosts",
                inner.hosts.len()
            )));
        }
        let (rank, world) = (inner.rank, inner.world);
        let streams = inner.config.streams.max(1);
        let first = inner.streams.sched.lock().exec.shared.is_none();
        let dir = std::path::Path::new(DIR);
        // Make this rank's window (and board, the first time); say how it went.
        let mut made: Result<(Window, Option<Board>), Error> = if bytes == 0 {
            Err(Error::invalid("alloc: 0 bytes asked for"))
        } else {
            unique_name("mem", rank)
                .and_then(|name| Window::create(dir, &name, bytes))
                .and_then(|w| {
                    let board = if first {
                        Some(Board::create(
                            dir,
                            &unique_name("board", rank)?,
                            world,
                            streams,
                        )?)
                    } else {
                        None
                    };
                    Ok((w, board))
                })
        };
        let me = Record {
            status: match &made {
                Ok(_) => 0,
                Err(Error::OutOfMemory(_)) => 1,
                Err(Error::InvalidArgument(_)) => 3,
                Err(_) => 2,
            },
            bytes: bytes as u64,
            window: made
                .as_ref()
                .map(|(w, _)| w.path().display().to_string())
                .unwrap_or_default(),
            board: match &made {
                Ok((_, Some(b))) => b.path().display().to_string(),
                _ => String::new(),
            },
        };
        let mut all = vec![0u8; RECORD * world];
        self.all_gather_bytes(&me.encode(), &mut all, DType::U8)?;
        let records: Vec<Record> = all.chunks(RECORD).map(Record::decode).collect();
        if let Some((p, r)) = records.iter().enumerate().find(|(_, r)| r.status != 0) {
            let why = match (&made, r.status) {
                (Err(e), _) if p == rank => e.to_string(),
                (_, 1) => "the memory is not there".into(),
                (_, 3) => "it asked for 0 bytes".into(),
                _ => "creating its shared memory failed".into(),
            };
            let msg = format!(
                "alloc: rank {p} could not allocate {} bytes: {why}",
                r.bytes
            );
            return Err(if r.status == 1 {
                Error::OutOfMemory(msg)
            } else {
                Error::invalid(msg)
            });
        }
        // Map everyone's window (and board); then agree that everyone could.
        let opened = (|| -> Result<Mapped, Error> {
            let mut maps = Vec::new();
            let mut places = Vec::with_capacity(world);
            let mut boards = Vec::with_capacity(world);
            let (own_w, _) = made.as_ref().map_err(Clone::clone)?;
            for (p, r) in records.iter().enumerate() {
                if p == rank {
                    places.push((own_w.as_ptr() as usize, own_w.len()));
                    boards.push(None);
                    continue;
                }
                let len = usize::try_from(r.bytes).map_err(|_| {
                    Error::Bootstrap(format!("rank {p} announced {} bytes", r.bytes))
                })?;
                let w = Window::open(std::path::Path::new(&r.window), len)?;
                places.push((w.as_ptr() as usize, w.len()));
                maps.push(w);
                boards.push(if first {
                    Some(Board::open(
                        std::path::Path::new(&r.board),
                        p,
                        world,
                        streams,
                    )?)
                } else {
                    None
                });
            }
            Ok((maps, places, boards))
        })();
        let ok = [u32::from(opened.is_err())];
        let mut failed = [0u32; 1];
        let agreed = self.all_reduce(&ok, &mut failed, ReduceOp::Max);
        let Ok((window, own_board)) = made.as_mut().map(|(w, b)| (w, b.take())) else {
            return Err(Error::Internal("alloc lost its window".into()));
        };
        window.unlink();
        if let Some(b) = &own_board {
            b.unlink();
        }
        agreed?;
        let (maps, places, boards) = match opened {
            Err(e) => return Err(e),
            Ok(_) if failed[0] != 0 => {
                return Err(Error::Bootstrap(
                    "alloc: another rank could not map this rank's shared memory".into(),
                ))
            }
            Ok(o) => o,
        };
        let Ok((window, _)) = made else {
            return Err(Error::Internal("alloc lost its window".into()));
        };
        let window = Arc::new(window);
        let mut sched = inner.streams.sched.lock();
        let exec = &mut sched.exec;
        if exec.shared.is_none() {
            let (Some(own), true) = (own_board, first) else {
                return Err(Error::Internal("alloc: no board".into()));
            };
            let mut all = Vec::with_capacity(world);
            let mut own = Some(own);
            for (p, b) in boards.into_iter().enumerate() {
                match b {
                    Some(b) => all.push(b),
                    None if p == rank => match own.take() {
                        Some(o) => all.push(o),
                        None => return Err(Error::Internal("alloc: no board".into())),
                    },
                    None => return Err(Error::Internal("alloc: a peer's board is missing".into())),
                }
            }
            let all: Vec<Arc<Board>> = all.into_iter().map(Arc::new).collect();
            inner.streams.also_fail(all[rank].clone());
            let local = inner.hosts.first().map_or(world, Vec::len);
            exec.shared = Some(Shared {
                rank,
                boards: all,
                allocations: Vec::new(),
                policy: WaitPolicy::for_host(local, inner.config.spin_us),
                next: vec![(0, 0); streams],
            });
        }
        let Some(shared) = exec.shared.as_mut() else {
            return Err(Error::Internal("alloc: no shared state".into()));
        };
        let index = shared.allocations.len();
        shared.allocations.push(Allocation {
            own: window.clone(),
            places,
            maps,
        });
        Ok(SharedBuffer { window, index })
    }
}
