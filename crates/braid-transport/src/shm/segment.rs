//! [`Segment`]: one rank's inbound segment in `/dev/shm`, created or mapped and checked, its header
//! words, and the sweep of segments that dead processes left behind ([`sweep_stale`]).

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use braid_core::Error;
use memmap2::MmapRaw;

use super::layout::{
    Layout, H_CHANNELS, H_DEVICE, H_FAILED, H_MAGIC, H_OWNER, H_PID, H_SLOTS, H_SLOT_BYTES,
    H_VERSION, H_WORLD, MAGIC, S_SEQ, VERSION,
};
use crate::wait::peer_alive;

/// One rank's inbound segment, mapped into this process.
pub struct Segment {
    pub(super) map: MmapRaw,
    path: PathBuf,
    pub(super) layout: Layout,
    pub(super) owner: usize,
    pid: u32,
}

// SAFETY: the mapping is shared memory accessed only through atomics and through slot slices whose
// exclusive use the slot protocol guarantees; the struct itself is immutable after construction.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates the segment of rank `owner` at `path` (which must not exist), sized for `layout`.
    pub fn create(path: &Path, layout: Layout, owner: usize) -> Result<Segment, Error> {
        let ctx = || format!("creating shared-memory segment {}", path.display());
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| Error::io(ctx(), e))?;
        let setup = || -> Result<MmapRaw, Error> {
            file.set_len(layout.size() as u64)
                .map_err(|e| Error::io(ctx(), e))?;
            MmapRaw::map_raw(&file).map_err(|e| Error::io(ctx(), e))
        };
        let map = match setup() {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(e);
            }
        };
        let pid = std::process::id();
        let seg = Segment {
            map,
            path: path.to_owned(),
            layout,
            owner,
            pid,
        };
        seg.word(H_VERSION).store(VERSION, Ordering::Relaxed);
        seg.word(H_WORLD)
            .store(layout.world as u32, Ordering::Relaxed);
        seg.word(H_OWNER).store(owner as u32, Ordering::Relaxed);
        seg.word(H_PID).store(pid, Ordering::Relaxed);
        seg.word(H_SLOTS)
            .store(layout.slots as u32, Ordering::Relaxed);
        seg.word(H_SLOT_BYTES)
            .store(layout.slot_bytes as u32, Ordering::Relaxed);
        seg.word(H_CHANNELS)
            .store(layout.channels as u32, Ordering::Relaxed);
        seg.word(H_DEVICE)
            .store(u32::from(layout.device), Ordering::Relaxed);
        seg.word64(H_MAGIC).store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Maps rank `owner`'s segment at `path` and checks that its header matches `layout`.
    pub fn open(path: &Path, layout: Layout, owner: usize) -> Result<Segment, Error> {
        let ctx = || {
            format!(
                "mapping rank {owner}'s shared-memory segment {}",
                path.display()
            )
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(ctx(), e))?;
        let len = file.metadata().map_err(|e| Error::io(ctx(), e))?.len();
        if len != layout.size() as u64 {
            return Err(Error::Bootstrap(format!(
                "{}: size {len}, expected {}",
                ctx(),
                layout.size()
            )));
        }
        let map = MmapRaw::map_raw(&file).map_err(|e| Error::io(ctx(), e))?;
        let mut seg = Segment {
            map,
            path: path.to_owned(),
            layout,
            owner,
            pid: 0,
        };
        let magic = seg.word64(H_MAGIC).load(Ordering::Acquire);
        let fields = [
            (
                "version",
                seg.word(H_VERSION).load(Ordering::Relaxed) as usize,
                VERSION as usize,
            ),
            (
                "world",
                seg.word(H_WORLD).load(Ordering::Relaxed) as usize,
                layout.world,
            ),
            (
                "owner",
                seg.word(H_OWNER).load(Ordering::Relaxed) as usize,
                owner,
            ),
            (
                "slots",
                seg.word(H_SLOTS).load(Ordering::Relaxed) as usize,
                layout.slots,
            ),
            (
                "slot bytes",
                seg.word(H_SLOT_BYTES).load(Ordering::Relaxed) as usize,
                layout.slot_bytes,
            ),
            (
                "channels",
                seg.word(H_CHANNELS).load(Ordering::Relaxed) as usize,
                layout.channels,
            ),
            (
                "device payload",
                seg.word(H_DEVICE).load(Ordering::Relaxed) as usize,
                usize::from(layout.device),
            ),
        ];
        if magic != MAGIC {
            return Err(Error::Bootstrap(format!("{}: not a braid segment", ctx())));
        }
        for (name, got, want) in fields {
            if got != want {
                return Err(Error::Bootstrap(format!(
                    "{}: {name} is {got}, expected {want}",
                    ctx()
                )));
            }
        }
        seg.pid = seg.word(H_PID).load(Ordering::Relaxed);
        Ok(seg)
    }

    /// Removes the segment's name; the memory stays mapped until every process unmaps it.
    pub fn unlink(&self) -> Result<(), Error> {
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(format!("unlinking {}", self.path.display()), e)),
        }
    }

    /// The segment's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The pid of the process that created the segment.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub(super) fn word(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.layout.size());
        // SAFETY: in bounds and 4-aligned (the mapping is page-aligned); the mapping lives as long as
        // `self`; all cross-process access to control words is atomic.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU32) }
    }

    fn word64(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.layout.size());
        // SAFETY: as in `word`, 8-aligned.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) }
    }

    pub(super) fn ctrl(&self, from: usize, ch: usize, field: usize) -> &AtomicU32 {
        self.word(self.layout.channel(from, ch) + field)
    }

    pub(super) fn failed(&self) -> bool {
        self.word(H_FAILED).load(Ordering::Acquire) != 0
    }

    /// The sequence word of slot `index` of ring `ch` from `from`.
    pub(super) fn slot_seq(&self, from: usize, ch: usize, index: usize) -> &AtomicU32 {
        self.word(self.layout.slot(from, ch, index) + S_SEQ)
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.owner_is_me() {
            let _ = self.unlink();
        }
    }
}

impl Segment {
    fn owner_is_me(&self) -> bool {
        self.pid == std::process::id()
            && self.word(H_OWNER).load(Ordering::Relaxed) as usize == self.owner
    }
}

/// Removes segments in `dir` left behind by processes that no longer exist (killed before they could
/// remove their own), and returns how many it removed. Segments of live processes, foreign files and
/// segments still being created are left alone.
pub fn sweep_stale(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with("braid-") || name.starts_with("braid-test-") {
            continue;
        }
        let Ok(bytes) = std::fs::File::open(e.path()).and_then(|mut f| {
            let mut b = [0u8; H_PID + 4];
            std::io::Read::read_exact(&mut f, &mut b).map(|_| b)
        }) else {
            continue;
        };
        let magic = u64::from_ne_bytes(bytes[H_MAGIC..H_MAGIC + 8].try_into().expect("8 bytes"));
        let pid = u32::from_ne_bytes(bytes[H_PID..H_PID + 4].try_into().expect("4 bytes"));
        if magic == MAGIC && pid != 0 && !peer_alive(pid) && std::fs::remove_file(e.path()).is_ok()
        {
            tracing::info!(
                "removed {} left behind by process {pid}",
                e.path().display()
            );
            removed += 1;
        }
    }
    removed
}
