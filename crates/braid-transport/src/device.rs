//! Device memory that a link's rings can live in, shared between the processes of one host.
//!
//! A [`DeviceMemory`] allocates memory of one device that other processes can map, and maps what a peer
//! allocated from what the peer shared ([`Shareable`]):
//! - [`Shareable::Fd`], a file descriptor (CUDA: `cuMemCreate` with a POSIX file-descriptor handle,
//!   exported with `cuMemExportToShareableHandle`, mapped with `cuMemImportFromShareableHandle`,
//!   `cuMemMap`, `cuMemSetAccess`). Descriptors travel between processes over a Unix socket as
//!   `SCM_RIGHTS` ([`send_msg`], [`recv_msg`]).
//! - [`Shareable::Handle`], opaque bytes the device's API opens in another process (CUDA's legacy IPC:
//!   `cuIpcGetMemHandle`, `cuIpcOpenMemHandle`), for devices that cannot share memory by descriptor. At
//!   most [`MAX_HANDLE_BYTES`].
//!
//! The transport crate names no device API: the CUDA implementation lives in braid-cuda and is handed to
//! the transport by whoever builds it.
//!
//! [`EmulatedDevice`] is the stand-in for machines without a GPU: host memory from `memfd_create`, whose
//! spans say `MemKind::Device` like a GPU's. It keeps the real one's semantics where the transport can
//! see them (allocation, export, import at another address, per-process mappings, zeroed memory) so the
//! protocol is tested with real processes and sockets; its bytes are host bytes, so a test may read them
//! directly, which a GPU's never allow. [`EmulatedDevice::new`] shares by descriptor;
//! [`EmulatedDevice::with_handles`] emulates legacy handles: its allocations keep their memfd open, the
//! handle names the exporting process and the descriptor's number, and importing opens
//! `/proc/<pid>/fd/<n>` (so, as with CUDA's legacy handles, no descriptor travels and the exporter's
//! allocation must be alive when a peer imports it).
#![allow(unsafe_code)]

use std::fs::File;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use braid_core::Error;
use memmap2::MmapRaw;
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

/// The most bytes a [`Shareable::Handle`] may hold.
pub const MAX_HANDLE_BYTES: usize = 128;

/// What an allocation is shared with other processes by: what [`DeviceMemory::allocate`] gives and
/// [`DeviceMemory::import`] takes.
#[derive(Debug)]
pub enum Shareable {
    /// A file descriptor, passed to peers as `SCM_RIGHTS`.
    Fd(OwnedFd),
    /// Opaque bytes (1 to [`MAX_HANDLE_BYTES`]) that a peer opens through the device's API; no
    /// descriptor travels. Build one with [`Shareable::handle`], which checks the length.
    Handle(Vec<u8>),
}

impl Shareable {
    /// A handle of `bytes`; an invalid argument when it is empty or longer than [`MAX_HANDLE_BYTES`].
    pub fn handle(bytes: Vec<u8>) -> Result<Shareable, Error> {
        if bytes.is_empty() || bytes.len() > MAX_HANDLE_BYTES {
            return Err(Error::invalid(format!(
                "a shareable handle holds 1 to {MAX_HANDLE_BYTES} bytes, not {}",
                bytes.len()
            )));
        }
        Ok(Shareable::Handle(bytes))
    }

    /// `descriptor` or `handle`, for errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Shareable::Fd(_) => "descriptor",
            Shareable::Handle(_) => "handle",
        }
    }
}

/// Memory of one device, allocated shareable and mapped from what peers shared.
pub trait DeviceMemory: Send + Sync {
    /// A short name for errors and logs (`cuda`, `emulated`).
    fn name(&self) -> &'static str;
    /// The device's ordinal: spans over this memory are `MemKind::Device { ordinal }`.
    fn ordinal(&self) -> u32;
    /// The granularity allocations are rounded up to (a power of two).
    fn granularity(&self) -> usize;
    /// `bytes` (a multiple of [`granularity`](Self::granularity)) of zeroed device memory, and what
    /// another process can map it from. A [`Shareable::Handle`] stays valid while the allocation lives.
    fn allocate(&self, bytes: usize) -> Result<(Box<dyn DeviceAllocation>, Shareable), Error>;
    /// Maps `bytes` that another process allocated, from what it shared (either kind, whatever this
    /// memory's own allocations use).
    fn import(&self, shared: Shareable, bytes: usize) -> Result<Box<dyn DeviceAllocation>, Error>;
}

/// Device memory mapped into this process; unmapped (and freed, when the last mapping goes) on drop.
pub trait DeviceAllocation: Send + Sync {
    /// The device address of the first byte.
    fn addr(&self) -> u64;
    /// Bytes mapped.
    fn len(&self) -> usize;
    /// Whether nothing is mapped.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Host memory standing in for a device's, for machines without a GPU (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct EmulatedDevice {
    ordinal: u32,
    handles: bool,
}

impl EmulatedDevice {
    /// An emulated device with `ordinal`, sharing its allocations by file descriptor.
    pub fn new(ordinal: u32) -> EmulatedDevice {
        EmulatedDevice {
            ordinal,
            handles: false,
        }
    }

    /// An emulated device with `ordinal` that shares its allocations by handle, emulating CUDA's legacy
    /// IPC handles: the handle is the exporting process's id and the number of the memfd its allocation
    /// keeps open; importing opens `/proc/<pid>/fd/<n>` (see the module docs).
    pub fn with_handles(ordinal: u32) -> EmulatedDevice {
        EmulatedDevice {
            ordinal,
            handles: true,
        }
    }

    /// Whether allocations are shared by handle ([`with_handles`](Self::with_handles)).
    pub fn uses_handles(&self) -> bool {
        self.handles
    }
}

/// The memfd name of emulated device memory (`/proc/<pid>/fd/<n>` links to `/memfd:` and this).
const MEMFD_NAME: &str = "braid-emulated-device";
/// Bytes of an emulated handle: the process id and the descriptor's number, both u32 little-endian.
const EMULATED_HANDLE_BYTES: usize = 8;

/// A shared mapping of a memfd; in handle mode the exporter keeps the memfd open, which is what its
/// handle names.
struct EmulatedAllocation {
    map: MmapRaw,
    _exported: Option<OwnedFd>,
}

impl DeviceAllocation for EmulatedAllocation {
    fn addr(&self) -> u64 {
        self.map.as_mut_ptr() as u64
    }
    fn len(&self) -> usize {
        self.map.len()
    }
}

fn map_file(file: &File, bytes: usize, what: &str) -> Result<MmapRaw, Error> {
    let len = file.metadata().map_err(|e| Error::io(what, e))?.len();
    if len != bytes as u64 {
        return Err(Error::Bootstrap(format!(
            "{what}: the shared memory holds {len} bytes, not {bytes}"
        )));
    }
    MmapRaw::map_raw(file).map_err(|e| Error::io(what, e))
}

fn map_fd(fd: &OwnedFd, bytes: usize, what: &str) -> Result<MmapRaw, Error> {
    let file = File::from(fd.try_clone().map_err(|e| Error::io(what, e))?);
    map_file(&file, bytes, what)
}

/// Opens the memfd an emulated handle names and maps it.
fn map_handle(handle: &[u8], bytes: usize) -> Result<MmapRaw, Error> {
    let what = "mapping a peer's emulated device memory by handle";
    let Ok(raw) = <[u8; EMULATED_HANDLE_BYTES]>::try_from(handle) else {
        return Err(Error::Bootstrap(format!(
            "{what}: an emulated handle is {EMULATED_HANDLE_BYTES} bytes, not {}",
            handle.len()
        )));
    };
    let pid = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
    let fd = u32::from_le_bytes([raw[4], raw[5], raw[6], raw[7]]);
    let path = format!("/proc/{pid}/fd/{fd}");
    let what = format!("{what} ({path})");
    // Only emulated device memory may be mapped this way, not whatever else the number names.
    let target = std::fs::read_link(&path).map_err(|e| Error::io(&what, e))?;
    if !target
        .to_string_lossy()
        .starts_with(&format!("/memfd:{MEMFD_NAME}"))
    {
        return Err(Error::Bootstrap(format!(
            "{what}: it names {}, not emulated device memory",
            target.display()
        )));
    }
    let file = File::options()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io(&what, e))?;
    map_file(&file, bytes, &what)
}

impl DeviceMemory for EmulatedDevice {
    fn name(&self) -> &'static str {
        "emulated"
    }

    fn ordinal(&self) -> u32 {
        self.ordinal
    }

    fn granularity(&self) -> usize {
        4096
    }

    fn allocate(&self, bytes: usize) -> Result<(Box<dyn DeviceAllocation>, Shareable), Error> {
        let what = format!("allocating {bytes} bytes of emulated device memory");
        if bytes == 0 || bytes % self.granularity() != 0 {
            return Err(Error::invalid(format!(
                "{what}: the size must be a nonzero multiple of {}",
                self.granularity()
            )));
        }
        let fd = rustix::fs::memfd_create(MEMFD_NAME, rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| Error::io(&what, e.into()))?;
        rustix::fs::ftruncate(&fd, bytes as u64).map_err(|e| Error::io(&what, e.into()))?;
        let map = map_fd(&fd, bytes, &what)?;
        if self.handles {
            let mut handle = std::process::id().to_le_bytes().to_vec();
            handle.extend_from_slice(&(fd.as_raw_fd() as u32).to_le_bytes());
            let alloc = EmulatedAllocation {
                map,
                _exported: Some(fd),
            };
            return Ok((Box::new(alloc), Shareable::handle(handle)?));
        }
        let alloc = EmulatedAllocation {
            map,
            _exported: None,
        };
        Ok((Box::new(alloc), Shareable::Fd(fd)))
    }

    fn import(&self, shared: Shareable, bytes: usize) -> Result<Box<dyn DeviceAllocation>, Error> {
        let map = match shared {
            Shareable::Fd(fd) => map_fd(&fd, bytes, "mapping a peer's emulated device memory")?,
            Shareable::Handle(handle) => map_handle(&handle, bytes)?,
        };
        Ok(Box::new(EmulatedAllocation {
            map,
            _exported: None,
        }))
    }
}

/// Sends `bytes` over `sock` in one `sendmsg`, with `fd` as `SCM_RIGHTS` when there is one.
pub fn send_msg(sock: &UnixStream, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<(), Error> {
    let what = "sending shared memory to a peer";
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(Error::Internal(
            "no room for a descriptor in the control buffer".into(),
        ));
    }
    let sent = sendmsg(
        sock,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .map_err(|e| Error::io(what, e.into()))?;
    if sent != bytes.len() {
        return Err(Error::Io {
            context: what.into(),
            message: format!("sent {sent} of {} bytes", bytes.len()),
        });
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes and the descriptor that came with them, if one did (sent by
/// [`send_msg`]); the socket's read timeout bounds the wait. Fewer bytes, or more than one descriptor,
/// is an error (any descriptors that came are closed).
pub fn recv_msg(sock: &UnixStream, buf: &mut [u8]) -> Result<Option<OwnedFd>, Error> {
    // Room for a few descriptors, so that a peer sending more than one is seen and refused.
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = recvmsg(
        sock,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC | RecvFlags::WAITALL,
    )
    .map_err(|e| Error::io("receiving shared memory from a peer", e.into()))?;
    let mut fds = Vec::new();
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = msg {
            fds.extend(received);
        }
    }
    if got.bytes != buf.len() {
        return Err(Error::Bootstrap(format!(
            "a peer sent {} bytes, not {}",
            got.bytes,
            buf.len()
        )));
    }
    if fds.len() > 1 || got.flags.contains(ReturnFlags::CTRUNC) {
        return Err(Error::Bootstrap(
            "a peer sent more than one descriptor".into(),
        ));
    }
    Ok(fds.pop())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// Writes through `a` and reads through `b`, two mappings of the same 8192 or more bytes.
    fn shared(a: &dyn DeviceAllocation, b: &dyn DeviceAllocation) {
        assert_ne!(
            a.addr(),
            b.addr(),
            "a second mapping lives at another address"
        );
        // SAFETY: both mappings are at least 8192 bytes of the same shared memory, alive in this scope.
        unsafe {
            assert_eq!(
                *(b.addr() as *const u8).add(100),
                0,
                "allocations start zeroed"
            );
            *(a.addr() as *mut u8).add(100) = 42;
            assert_eq!(*(b.addr() as *const u8).add(100), 42);
        }
    }

    #[test]
    fn emulated_memory_is_shared_through_a_passed_descriptor() {
        let dev = EmulatedDevice::new(3);
        assert!(!dev.uses_handles());
        let (a, fd) = dev.allocate(8192).unwrap();
        assert_eq!((a.len(), dev.ordinal()), (8192, 3));
        let Shareable::Fd(fd) = fd else {
            panic!("descriptor mode gave a {}", fd.kind())
        };
        let (left, right) = UnixStream::pair().unwrap();
        send_msg(&left, b"ring", Some(fd.as_fd())).unwrap();
        drop(fd);
        let mut tag = [0u8; 4];
        let got = recv_msg(&right, &mut tag).unwrap().expect("a descriptor");
        assert_eq!(&tag, b"ring");
        let b = dev.import(Shareable::Fd(got), 8192).unwrap();
        shared(&*a, &*b);
    }

    #[test]
    fn emulated_handles_name_the_exporters_memfd_and_map_it_again() {
        let dev = EmulatedDevice::with_handles(1);
        assert!(dev.uses_handles());
        let (a, handle) = dev.allocate(8192).unwrap();
        let Shareable::Handle(bytes) = &handle else {
            panic!("handle mode gave a {}", handle.kind())
        };
        assert_eq!(bytes.len(), EMULATED_HANDLE_BYTES);
        assert_eq!(bytes[..4], std::process::id().to_le_bytes());
        let b = dev.import(Shareable::Handle(bytes.clone()), 8192).unwrap();
        shared(&*a, &*b);
        // A descriptor-mode device imports a handle too, and a handle-mode one a descriptor.
        let c = EmulatedDevice::new(1).import(handle, 8192).unwrap();
        // SAFETY: as in `shared`.
        assert_eq!(unsafe { *(c.addr() as *const u8).add(100) }, 42);
        let (d, fd) = EmulatedDevice::new(1).allocate(4096).unwrap();
        let e = dev.import(fd, 4096).unwrap();
        assert_eq!((d.len(), e.len()), (4096, 4096));
    }

    #[test]
    fn bad_emulated_handles_are_refused() {
        let dev = EmulatedDevice::with_handles(0);
        // A size no other test allocates: a descriptor number reused after `a` goes is still refused.
        let size = 7 * 4096;
        let (a, handle) = dev.allocate(size).unwrap();
        let Shareable::Handle(bytes) = handle else {
            unreachable!()
        };
        let err = |h: Vec<u8>, n: usize| {
            dev.import(Shareable::Handle(h), n)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        };
        let e = err(bytes.clone(), 8192);
        assert!(e.contains("holds 28672 bytes, not 8192"), "{e}");
        let e = err(bytes[..7].to_vec(), size);
        assert!(e.contains("8 bytes, not 7"), "{e}");
        // A descriptor that is not emulated device memory.
        let file = File::open("/proc/self/status").unwrap();
        let mut other = std::process::id().to_le_bytes().to_vec();
        other.extend_from_slice(&(file.as_raw_fd() as u32).to_le_bytes());
        let e = err(other, size);
        assert!(e.contains("not emulated device memory"), "{e}");
        // Once the exporter frees its allocation, its handle opens nothing.
        drop(a);
        err(bytes, size);
        assert!(Shareable::handle(Vec::new()).is_err());
        assert!(Shareable::handle(vec![0; MAX_HANDLE_BYTES + 1])
            .unwrap_err()
            .is_invalid_argument());
        assert!(Shareable::handle(vec![0; MAX_HANDLE_BYTES]).is_ok());
    }

    #[test]
    fn bad_sizes_short_messages_and_extra_descriptors_are_refused() {
        let dev = EmulatedDevice::new(0);
        assert!(dev
            .allocate(0)
            .map(|_| ())
            .unwrap_err()
            .is_invalid_argument());
        assert!(dev
            .allocate(100)
            .map(|_| ())
            .unwrap_err()
            .is_invalid_argument());
        let (_, fd) = dev.allocate(4096).unwrap();
        let err = dev.import(fd, 8192).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("holds 4096 bytes, not 8192"), "{err}");
        use std::io::Write;
        // Bytes without a descriptor: no descriptor, no error.
        let (left, right) = UnixStream::pair().unwrap();
        (&left).write_all(b"ring").unwrap();
        let mut tag = [0u8; 4];
        assert!(recv_msg(&right, &mut tag).unwrap().is_none());
        // Too few bytes before the peer hangs up.
        (&left).write_all(b"ri").unwrap();
        drop(left);
        let err = recv_msg(&right, &mut tag).unwrap_err().to_string();
        assert!(err.contains("sent 2 bytes, not 4"), "{err}");
        // Two descriptors in one message.
        let (left, right) = UnixStream::pair().unwrap();
        let (x, y) = (
            File::open("/dev/null").unwrap(),
            File::open("/dev/null").unwrap(),
        );
        let fds = [x.as_fd(), y.as_fd()];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        sendmsg(
            &left,
            &[IoSlice::new(b"ring")],
            &mut control,
            SendFlags::empty(),
        )
        .unwrap();
        let err = recv_msg(&right, &mut tag).unwrap_err().to_string();
        assert!(err.contains("more than one descriptor"), "{err}");
    }
}
