//! Device memory that a link's rings can live in, shared between the processes of one host by file
//! descriptor.
//!
//! A [`DeviceMemory`] allocates memory of one device that other processes can map (CUDA: `cuMemCreate`
//! with a POSIX file-descriptor handle, exported with `cuMemExportToShareableHandle`) and maps what a
//! peer allocated from the descriptor the peer sent (`cuMemImportFromShareableHandle`, `cuMemMap`,
//! `cuMemSetAccess`). Descriptors travel between processes over a Unix socket as `SCM_RIGHTS`
//! ([`send_fd`], [`recv_fd`]). The transport crate names no device API: the CUDA implementation lives in
//! braid-cuda and is handed to the transport by whoever builds it.
//!
//! [`EmulatedDevice`] is the stand-in for machines without a GPU: host memory from `memfd_create`,
//! shared by the same descriptor passing, whose spans say `MemKind::Device` like a GPU's. It keeps the
//! real one's semantics where the transport can see them (allocation, export, import at another
//! address, per-process mappings, zeroed memory) so the protocol is tested with real processes and
//! sockets; its bytes are host bytes, so a test may read them directly, which a GPU's never allow.
#![allow(unsafe_code)]

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use braid_core::Error;
use memmap2::MmapRaw;
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Memory of one device, allocated shareable and mapped from peers' descriptors.
pub trait DeviceMemory: Send + Sync {
    /// A short name for errors and logs (`cuda`, `emulated`).
    fn name(&self) -> &'static str;
    /// The device's ordinal: spans over this memory are `MemKind::Device { ordinal }`.
    fn ordinal(&self) -> u32;
    /// The granularity allocations are rounded up to (a power of two).
    fn granularity(&self) -> usize;
    /// `bytes` (a multiple of [`granularity`](Self::granularity)) of zeroed device memory, and a
    /// descriptor another process can map it from.
    fn allocate(&self, bytes: usize) -> Result<(Box<dyn DeviceAllocation>, OwnedFd), Error>;
    /// Maps `bytes` that another process allocated, from the descriptor it sent.
    fn import(&self, fd: OwnedFd, bytes: usize) -> Result<Box<dyn DeviceAllocation>, Error>;
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
}

impl EmulatedDevice {
    /// An emulated device with `ordinal`.
    pub fn new(ordinal: u32) -> EmulatedDevice {
        EmulatedDevice { ordinal }
    }
}

/// A shared mapping of a memfd.
struct EmulatedAllocation {
    map: MmapRaw,
}

impl DeviceAllocation for EmulatedAllocation {
    fn addr(&self) -> u64 {
        self.map.as_mut_ptr() as u64
    }
    fn len(&self) -> usize {
        self.map.len()
    }
}

fn map_fd(fd: &OwnedFd, bytes: usize, what: &str) -> Result<MmapRaw, Error> {
    let file = std::fs::File::from(fd.try_clone().map_err(|e| Error::io(what, e))?);
    let len = file.metadata().map_err(|e| Error::io(what, e))?.len();
    if len != bytes as u64 {
        return Err(Error::Bootstrap(format!(
            "{what}: the shared memory holds {len} bytes, not {bytes}"
        )));
    }
    MmapRaw::map_raw(&file).map_err(|e| Error::io(what, e))
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

    fn allocate(&self, bytes: usize) -> Result<(Box<dyn DeviceAllocation>, OwnedFd), Error> {
        let what = format!("allocating {bytes} bytes of emulated device memory");
        if bytes == 0 || bytes % self.granularity() != 0 {
            return Err(Error::invalid(format!(
                "{what}: the size must be a nonzero multiple of {}",
                self.granularity()
            )));
        }
        let fd = rustix::fs::memfd_create("braid-emulated-device", rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| Error::io(&what, e.into()))?;
        rustix::fs::ftruncate(&fd, bytes as u64).map_err(|e| Error::io(&what, e.into()))?;
        let map = map_fd(&fd, bytes, &what)?;
        Ok((Box::new(EmulatedAllocation { map }), fd))
    }

    fn import(&self, fd: OwnedFd, bytes: usize) -> Result<Box<dyn DeviceAllocation>, Error> {
        let map = map_fd(&fd, bytes, "mapping a peer's emulated device memory")?;
        Ok(Box::new(EmulatedAllocation { map }))
    }
}

/// Sends `bytes` and one descriptor over `sock` (one `sendmsg` with `SCM_RIGHTS`).
pub fn send_fd(sock: &UnixStream, bytes: &[u8], fd: &OwnedFd) -> Result<(), Error> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [fd.as_fd()];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
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
    .map_err(|e| Error::io("sending a descriptor to a peer", e.into()))?;
    if sent != bytes.len() {
        return Err(Error::Io {
            context: "sending a descriptor to a peer".into(),
            message: format!("sent {sent} of {} bytes", bytes.len()),
        });
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes and the one descriptor that comes with them (sent by [`send_fd`]);
/// the socket's read timeout bounds the wait.
pub fn recv_fd(sock: &UnixStream, buf: &mut [u8]) -> Result<OwnedFd, Error> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = recvmsg(
        sock,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC | RecvFlags::WAITALL,
    )
    .map_err(|e| Error::io("receiving a descriptor from a peer", e.into()))?;
    let mut fd = None;
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = msg {
            for f in fds {
                // Keep the first; any other is closed as it drops.
                fd.get_or_insert(f);
            }
        }
    }
    if got.bytes != buf.len() {
        return Err(Error::Bootstrap(format!(
            "a peer sent {} bytes with its descriptor, not {}",
            got.bytes,
            buf.len()
        )));
    }
    fd.ok_or_else(|| Error::Bootstrap("a peer's message came without its descriptor".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emulated_memory_is_shared_through_a_passed_descriptor() {
        let dev = EmulatedDevice::new(3);
        let (a, fd) = dev.allocate(8192).unwrap();
        assert_eq!((a.len(), dev.ordinal()), (8192, 3));
        let (left, right) = UnixStream::pair().unwrap();
        send_fd(&left, b"ring", &fd).unwrap();
        drop(fd);
        let mut tag = [0u8; 4];
        let got = recv_fd(&right, &mut tag).unwrap();
        assert_eq!(&tag, b"ring");
        let b = dev.import(got, 8192).unwrap();
        assert_ne!(
            a.addr(),
            b.addr(),
            "a second mapping lives at another address"
        );
        // SAFETY: both mappings are 8192 bytes of the same shared memory, alive in this scope.
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
    fn bad_sizes_and_missing_descriptors_are_refused() {
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
        let (left, right) = UnixStream::pair().unwrap();
        use std::io::Write;
        (&left).write_all(b"ring").unwrap();
        let mut tag = [0u8; 4];
        let err = recv_fd(&right, &mut tag).unwrap_err().to_string();
        assert!(err.contains("without its descriptor"), "{err}");
    }
}
