//! Memory every rank of a host maps: the windows behind `Communicator::alloc`, and the board of flags
//! that orders the collectives which run straight through them.
//!
//! A [`Window`] is a file in `/dev/shm` that its rank creates and every other rank of the host maps;
//! its name goes once everyone has mapped it, so a killed process leaves nothing behind. A [`Board`] is
//! one rank's control window: per stream, a phase counter (a futex word the owner advances and its
//! peers wait on), the descriptor of the collective the owner is running, and one sleep flag per peer.
//! Everything a peer wrote (header, descriptor) is untrusted and checked by whoever reads it.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use braid_core::Error;
use memmap2::MmapRaw;

use crate::wait::{futex_wake, wait_until, PeerProcess, WaitCtx, WaitPolicy};

const MAGIC: u64 = u64::from_le_bytes(*b"BRAIDwin");
const CACHE_LINE: usize = 64;

/// Words in a collective's descriptor.
pub const DESCRIPTOR_WORDS: usize = 10;
/// Bytes a rank can place on its board itself (per stream, twice: collectives alternate between two
/// areas, as they do between two descriptors), for small collectives that need one exchange of flags
/// instead of three: a header line and the input.
pub const INLINE_BYTES: usize = (8 << 10) + CACHE_LINE;

// Board header offsets.
const B_MAGIC: usize = 0;
const B_PID: usize = 8;
const B_WORLD: usize = 12;
const B_STREAMS: usize = 16;
const B_FAILED: usize = 20;
// Per-stream offsets: the counter alone on its line, two descriptors, the peers' sleep flags, then
// two inline areas.
const S_COUNTER: usize = 0;
const S_DESCRIPTOR: usize = CACHE_LINE;
const DESCRIPTOR_STRIDE: usize = (DESCRIPTOR_WORDS * 8).next_multiple_of(CACHE_LINE);
const S_WAITING: usize = S_DESCRIPTOR + 2 * DESCRIPTOR_STRIDE;

/// One rank's mapping of a file in shared memory.
pub struct Window {
    map: MmapRaw,
    path: PathBuf,
    len: usize,
    /// This process created the file (and removes its name when dropped).
    created: bool,
}

// SAFETY: the mapping is shared memory that the collectives access through raw pointers under the
// board's phase protocol (each byte has one writer per phase, read only after the phase ends) and
// through atomics; the struct itself is immutable after construction.
unsafe impl Send for Window {}
// SAFETY: as above.
unsafe impl Sync for Window {}

impl Window {
    /// Creates `dir/name` (which must not exist), `len` bytes, zeroed, and maps it. The pages are
    /// reserved at once (`posix_fallocate`): memory the machine does not have is an
    /// [`Error::OutOfMemory`] here, not a `SIGBUS` when a page is first touched.
    pub fn create(dir: &Path, name: &str, len: usize) -> Result<Window, Error> {
        let path = dir.join(name);
        let ctx = || format!("creating shared memory {}", path.display());
        braid_core::alloc::check_available(len as u128, &ctx())?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| Error::io(ctx(), e))?;
        let reserve = || -> Result<MmapRaw, Error> {
            use std::os::fd::AsRawFd;
            let size = libc::off_t::try_from(len)
                .map_err(|_| Error::OutOfMemory(format!("{}: {len} bytes", ctx())))?;
            if len > 0 {
                // SAFETY: a valid open descriptor and a non-negative range.
                let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size) };
                if rc != 0 {
                    let e = std::io::Error::from_raw_os_error(rc);
                    return Err(if rc == libc::ENOSPC {
                        Error::OutOfMemory(format!("{}: {len} bytes: {e}", ctx()))
                    } else {
                        Error::io(ctx(), e)
                    });
                }
            }
            MmapRaw::map_raw(&file).map_err(|e| Error::io(ctx(), e))
        };
        let map = reserve().inspect_err(|_| {
            let _ = std::fs::remove_file(&path);
        })?;
        Ok(Window {
            map,
            path,
            len,
            created: true,
        })
    }

    /// Maps the window at `path`, which its owner said holds `len` bytes (checked).
    pub fn open(path: &Path, len: usize) -> Result<Window, Error> {
        let ctx = || format!("mapping shared memory {}", path.display());
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(ctx(), e))?;
        let size = file.metadata().map_err(|e| Error::io(ctx(), e))?.len();
        if size != len as u64 {
            return Err(Error::Bootstrap(format!(
                "{}: {size} bytes, its owner said {len}",
                ctx()
            )));
        }
        let map = MmapRaw::map_raw(&file).map_err(|e| Error::io(ctx(), e))?;
        Ok(Window {
            map,
            path: path.to_owned(),
            len,
            created: false,
        })
    }

    /// Removes the file's name; the memory stays mapped until every process unmaps it.
    pub fn unlink(&self) {
        let _ = std::fs::remove_file(&self.path);
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `addr..addr + len` lies inside the window; its offset if so.
    pub fn offset_of(&self, addr: usize, len: usize) -> Option<usize> {
        let base = self.as_ptr() as usize;
        let off = addr.checked_sub(base)?;
        (off.checked_add(len)? <= self.len).then_some(off)
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        if self.created {
            self.unlink();
        }
    }
}

/// One rank's flags: per stream a phase counter, the running collective's descriptor and its peers'
/// sleep flags.
pub struct Board {
    win: Window,
    world: usize,
    streams: usize,
    /// The owner's process (for peers: to notice that it died).
    owner: Option<PeerProcess>,
}

impl Board {
    fn inline_offset(world: usize) -> usize {
        S_WAITING + (world * 4).next_multiple_of(CACHE_LINE)
    }

    fn stream_stride(world: usize) -> usize {
        Board::inline_offset(world) + 2 * INLINE_BYTES
    }

    /// Bytes of a board for `world` ranks and `streams` streams.
    pub fn size(world: usize, streams: usize) -> usize {
        CACHE_LINE + streams * Board::stream_stride(world)
    }

    /// Creates this rank's board as `dir/name`.
    pub fn create(dir: &Path, name: &str, world: usize, streams: usize) -> Result<Board, Error> {
        let win = Window::create(dir, name, Board::size(world, streams))?;
        let b = Board {
            win,
            world,
            streams,
            owner: None,
        };
        b.word(B_PID).store(std::process::id(), Ordering::Relaxed);
        b.word(B_WORLD).store(world as u32, Ordering::Relaxed);
        b.word(B_STREAMS).store(streams as u32, Ordering::Relaxed);
        b.word64(B_MAGIC).store(MAGIC, Ordering::Release);
        Ok(b)
    }

    /// Maps rank `owner`'s board at `path` and checks its header.
    pub fn open(path: &Path, owner: usize, world: usize, streams: usize) -> Result<Board, Error> {
        let win = Window::open(path, Board::size(world, streams))?;
        let mut b = Board {
            win,
            world,
            streams,
            owner: None,
        };
        let bad = |what: String| {
            Error::Bootstrap(format!(
                "rank {owner}'s shared-memory board {}: {what}",
                path.display()
            ))
        };
        if b.word64(B_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(bad("not a braid board".into()));
        }
        for (name, off, want) in [("world", B_WORLD, world), ("streams", B_STREAMS, streams)] {
            let got = b.word(off).load(Ordering::Relaxed) as usize;
            if got != want {
                return Err(bad(format!("{name} is {got}, expected {want}")));
            }
        }
        b.owner = Some(PeerProcess::open(b.word(B_PID).load(Ordering::Relaxed)));
        Ok(b)
    }

    /// Removes the board's name (the mapping stays).
    pub fn unlink(&self) {
        self.win.unlink();
    }

    /// The board's path.
    pub fn path(&self) -> &Path {
        self.win.path()
    }

    fn word(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.win.len());
        // SAFETY: in bounds and 4-aligned (the mapping is page-aligned); the mapping lives as long as
        // `self`; every cross-process access to the board is atomic.
        unsafe { &*(self.win.as_ptr().add(off) as *const AtomicU32) }
    }

    fn word64(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.win.len());
        // SAFETY: as in `word`, 8-aligned.
        unsafe { &*(self.win.as_ptr().add(off) as *const AtomicU64) }
    }

    fn stream_base(&self, stream: usize) -> usize {
        assert!(stream < self.streams, "stream {stream} of {}", self.streams);
        CACHE_LINE + stream * Board::stream_stride(self.world)
    }

    fn counter(&self, stream: usize) -> &AtomicU32 {
        self.word(self.stream_base(stream) + S_COUNTER)
    }

    fn waiting(&self, stream: usize, waiter: usize) -> &AtomicU32 {
        assert!(waiter < self.world);
        self.word(self.stream_base(stream) + S_WAITING + 4 * waiter)
    }

    /// The owner's counter on `stream` (acquire: what the owner wrote before advancing it is visible).
    pub fn count(&self, stream: usize) -> u32 {
        self.counter(stream).load(Ordering::Acquire)
    }

    /// Whether the owner's counter on `stream` has reached `target` (counters wrap: "reached" means
    /// at most 2³¹ behind).
    pub fn reached(&self, stream: usize, target: u32) -> bool {
        (self.count(stream).wrapping_sub(target) as i32) >= 0
    }

    /// Writes the descriptor of the owner's next collective on `stream` into area `parity` (0 or 1:
    /// collectives alternate), before advancing the counter that announces it.
    pub fn set_descriptor(&self, stream: usize, parity: usize, words: &[u64; DESCRIPTOR_WORDS]) {
        let base = self.stream_base(stream) + S_DESCRIPTOR + (parity & 1) * DESCRIPTOR_STRIDE;
        for (i, w) in words.iter().enumerate() {
            self.word64(base + 8 * i).store(*w, Ordering::Relaxed);
        }
    }

    /// The descriptor the owner wrote in area `parity` (read after [`Board::reached`] said it is
    /// there).
    pub fn descriptor(&self, stream: usize, parity: usize) -> [u64; DESCRIPTOR_WORDS] {
        let base = self.stream_base(stream) + S_DESCRIPTOR + (parity & 1) * DESCRIPTOR_STRIDE;
        std::array::from_fn(|i| self.word64(base + 8 * i).load(Ordering::Relaxed))
    }

    /// The first byte of inline area `parity` of `stream` ([`INLINE_BYTES`] long, 64-byte aligned),
    /// in this process's mapping. Written by the owner before it announces a collective, read by the
    /// peers after; the area alternates, so the owner rewrites it only once every peer has moved on
    /// to a later collective.
    pub fn inline_area(&self, stream: usize, parity: usize) -> *mut u8 {
        let off = self.stream_base(stream)
            + Board::inline_offset(self.world)
            + (parity & 1) * INLINE_BYTES;
        assert!(off + INLINE_BYTES <= self.win.len());
        // SAFETY: in bounds (checked above) of a mapping that lives as long as `self`.
        unsafe { self.win.as_ptr().add(off) }
    }

    /// Advances the owner's counter on `stream` to `value` (release: everything written before is
    /// visible to whoever sees the value) and wakes peers asleep on it.
    pub fn advance(&self, stream: usize, value: u32) {
        let counter = self.counter(stream);
        counter.store(value, Ordering::Release);
        // Pairs with the waiter's fence between raising its flag and reading the counter: either it
        // sees the new value or this sees its flag.
        fence(Ordering::SeqCst);
        if (0..self.world).any(|w| self.waiting(stream, w).load(Ordering::Relaxed) != 0) {
            futex_wake(counter);
        }
    }

    /// Marks the owner as failed: peers waiting on it stop with an error at once.
    pub fn fail(&self) {
        self.word(B_FAILED).store(1, Ordering::Release);
        fence(Ordering::SeqCst);
        for s in 0..self.streams {
            futex_wake(self.counter(s));
        }
    }

    /// Wakes every peer asleep on this board's counters.
    pub fn wake_all(&self) {
        for s in 0..self.streams {
            futex_wake(self.counter(s));
        }
    }

    /// Whether the owner marked itself failed.
    pub fn failed(&self) -> bool {
        self.word(B_FAILED).load(Ordering::Acquire) != 0
    }

    /// Waits, as rank `waiter`, until this board's owner (rank `owner`) has reached `target` on
    /// `stream`, or `until` passes (`Ok` either way; check [`Board::reached`]). A dead or failed owner,
    /// an abort and the collective's deadline are errors.
    #[allow(clippy::too_many_arguments)]
    pub fn wait(
        &self,
        stream: usize,
        target: u32,
        waiter: usize,
        owner: usize,
        policy: &WaitPolicy,
        ctx: &WaitCtx<'_>,
        until: Instant,
    ) -> Result<(), Error> {
        self.wait_for(stream, waiter, owner, policy, ctx, until, || {
            self.reached(stream, target)
        })
    }

    /// The stamp word at the start of inline area `parity` of `stream`: the owner stores the counter
    /// value of the collective whose input the area holds (release, after the input), so that a peer
    /// polling it finds flag and input in one cache line.
    pub fn inline_stamp(&self, stream: usize, parity: usize) -> &AtomicU64 {
        let off = self.stream_base(stream)
            + Board::inline_offset(self.world)
            + (parity & 1) * INLINE_BYTES;
        self.word64(off)
    }

    /// [`Board::wait`] for any condition on what the owner writes before it advances its counter on
    /// `stream` (the counter is the word sleepers are woken on).
    #[allow(clippy::too_many_arguments)]
    pub fn wait_for(
        &self,
        stream: usize,
        waiter: usize,
        owner: usize,
        policy: &WaitPolicy,
        ctx: &WaitCtx<'_>,
        until: Instant,
        ready: impl FnMut() -> bool,
    ) -> Result<(), Error> {
        wait_until(
            policy,
            ctx,
            until,
            owner,
            "its turn in a collective on shared buffers",
            self.counter(stream),
            self.waiting(stream, waiter),
            ready,
            || {
                if self.failed() {
                    return Err(
                        ctx.peer_failed(owner, "it failed in a collective on shared buffers")
                    );
                }
                match &self.owner {
                    Some(p) if !p.alive() => {
                        Err(ctx.peer_failed(owner, format!("its process {} exited", p.pid())))
                    }
                    _ => Ok(()),
                }
            },
        )
    }
}

impl crate::AbortHandle for Board {
    fn fail_and_wake(&self) {
        self.fail();
    }
    fn wake_all(&self) {
        Board::wake_all(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    /// A fresh directory under the system's temporary one, removed when dropped.
    struct Dir(PathBuf);
    impl Dir {
        fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn dir() -> Dir {
        static N: AtomicU32 = AtomicU32::new(0);
        let d = std::env::temp_dir().join(format!(
            "braid-window-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&d).expect("a temporary directory");
        Dir(d)
    }

    #[test]
    fn a_window_is_the_same_memory_in_every_mapping_and_its_name_goes_with_its_creator() {
        let d = dir();
        let a = Window::create(d.path(), "w", 4096).unwrap();
        let b = Window::open(a.path(), 4096).unwrap();
        // SAFETY: both map 4096 bytes of one file; no one else touches it.
        unsafe { a.as_ptr().add(100).write(7) };
        // SAFETY: as above.
        assert_eq!(unsafe { b.as_ptr().add(100).read() }, 7);
        assert_eq!(a.offset_of(a.as_ptr() as usize + 96, 4000), Some(96));
        assert_eq!(a.offset_of(a.as_ptr() as usize + 97, 4000), None);
        assert_eq!(a.offset_of(a.as_ptr() as usize - 1, 1), None);
        assert!(
            Window::open(a.path(), 8192).is_err(),
            "a size mismatch is refused"
        );
        let path = a.path().to_owned();
        drop(a);
        assert!(!path.exists());
        // The second mapping still works after the name is gone.
        // SAFETY: still mapped by `b`.
        assert_eq!(unsafe { b.as_ptr().add(100).read() }, 7);
    }

    #[test]
    fn a_board_orders_phases_and_a_failed_owner_ends_the_wait() {
        let d = dir();
        let own = Board::create(d.path(), "b0", 2, 2).unwrap();
        let seen = Board::open(own.path(), 0, 2, 2).unwrap();
        assert!(
            Board::open(own.path(), 0, 3, 2).is_err(),
            "a world mismatch is refused"
        );
        own.set_descriptor(1, 1, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        own.set_descriptor(1, 0, &[0; DESCRIPTOR_WORDS]);
        own.advance(1, 1);
        assert!(seen.reached(1, 1) && !seen.reached(1, 2) && !seen.reached(0, 1));
        assert_eq!(seen.descriptor(1, 1), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        assert_eq!(seen.descriptor(1, 0), [0; DESCRIPTOR_WORDS]);
        // The inline areas are the same memory in both mappings, and apart from each other.
        // SAFETY: in the areas, which nothing else touches here.
        unsafe {
            own.inline_area(1, 1).add(INLINE_BYTES - 1).write(9);
            assert_eq!(seen.inline_area(1, 1).add(INLINE_BYTES - 1).read(), 9);
            assert_eq!(seen.inline_area(1, 0).add(INLINE_BYTES - 1).read(), 0);
        }
        assert_eq!(own.inline_area(0, 0) as usize % CACHE_LINE, 0);
        // Wrapping: u32::MAX is reached once the counter wraps to 0.
        own.advance(0, 0);
        assert!(seen.reached(0, u32::MAX));
        let abort = AtomicBool::new(false);
        let now = Instant::now();
        let ctx = WaitCtx {
            rank: 1,
            collective: "all_reduce",
            seq: 0,
            deadline: now + Duration::from_secs(10),
            started: now,
            abort: &abort,
        };
        let policy = WaitPolicy {
            spin: Duration::ZERO,
            yield_for: Duration::ZERO,
        };
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                own.advance(1, 2);
            });
            seen.wait(1, 2, 1, 0, &policy, &ctx, now + Duration::from_secs(5))
                .unwrap();
        });
        assert!(seen.reached(1, 2));
        own.fail();
        let e = seen
            .wait(1, 3, 1, 0, &policy, &ctx, now + Duration::from_secs(5))
            .unwrap_err();
        assert!(e.to_string().contains("failed"), "{e}");
    }
}
