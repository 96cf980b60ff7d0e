//! CUDA device memory for the `ipc` transport's rings, shared with the other processes of the host in
//! one of two ways, chosen by `BRAID_CUDA_IPC` ([`IPC_VARIABLE`], [`IpcMode`]):
//!
//! - **By file descriptor** (`fd`), with the virtual memory management API. Allocating: `cuMemCreate`
//!   (pinned, on this device, POSIX-fd handle type), `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`
//!   (read-write for this device), zeroed, and the descriptor from `cuMemExportToShareableHandle`.
//!   Importing: `cuMemImportFromShareableHandle` on the peer's descriptor, then the same reserve, map and
//!   access for the importing process's device (several ranks on one GPU map each other's rings on that
//!   GPU). Dropping unmaps, frees the address range and releases the handle; the memory goes when the
//!   last process lets go of it.
//! - **By legacy IPC handle** (`legacy`), for devices without VMM or POSIX-fd handles (some containers
//!   and virtual GPUs). Allocating: `cuMemAlloc` (in multiples of [`LEGACY_GRANULARITY`]), zeroed, and
//!   `cuIpcGetMemHandle`. The handle the transport carries holds the driver's 64 bytes and the exporting
//!   process's id, a token drawn once per process, the device ordinal, address and size. Importing:
//!   `cuIpcOpenMemHandle` (peer access enabled lazily); a handle of this very process (which
//!   `cuIpcOpenMemHandle` refuses) is used at its address as it is, nothing opened. Dropping: the
//!   exporter `cuMemFree`s, an importer `cuIpcCloseMemHandle`s. Unlike descriptors, the memory goes when
//!   the exporter frees it, importers or not: the ranks must destroy their communicator together.
//!
//! `auto` (the default) shares by descriptor where the device supports it, by legacy handle otherwise.
//! Either kind imports what a peer shares, whatever this memory's own mode.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void};
use std::hash::{BuildHasher, Hasher};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

use braid_core::Error;
use braid_transport::device::Shareable;
use braid_transport::{DeviceAllocation, DeviceMemory};

use crate::driver::api::{
    self, check, IpcMemHandle, MemAccessDesc, MemAllocationProp, MemLocation,
    IPC_MEM_LAZY_ENABLE_PEER_ACCESS, MEM_ACCESS_FLAGS_PROT_READWRITE, MEM_ALLOCATION_TYPE_PINNED,
    MEM_HANDLE_TYPE_POSIX_FD, MEM_LOCATION_TYPE_DEVICE,
};
use crate::driver::Gpu;

/// The environment variable that picks how ring memory is shared: `auto`, `fd` or `legacy`.
pub const IPC_VARIABLE: &str = "BRAID_CUDA_IPC";

/// The granularity of legacy allocations: `cuMemAlloc` rounds to pages of up to 2 MiB, and a legacy
/// handle exports the whole allocation.
pub const LEGACY_GRANULARITY: usize = 2 << 20;

/// Bytes of the handle a legacy allocation is shared by (see the module docs).
const LEGACY_HANDLE_BYTES: usize = 64 + 4 + 4 + 8 + 8 + 8;

/// How [`CudaMemory`] shares its allocations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpcMode {
    /// By file descriptor where the device supports it, else by legacy handle.
    Auto,
    /// By POSIX file descriptor (VMM): an error on a device without support.
    Fd,
    /// By legacy CUDA IPC handle.
    Legacy,
}

impl IpcMode {
    /// The mode a value of [`IPC_VARIABLE`] asks for: unset or blank is [`IpcMode::Auto`]; `auto`, `fd`
    /// and `legacy` (any case, surrounding space ignored) name one; anything else is an invalid argument
    /// naming the variable.
    pub fn parse(setting: Option<&str>) -> Result<IpcMode, Error> {
        let Some(text) = setting.map(str::trim).filter(|t| !t.is_empty()) else {
            return Ok(IpcMode::Auto);
        };
        match text.to_ascii_lowercase().as_str() {
            "auto" => Ok(IpcMode::Auto),
            "fd" => Ok(IpcMode::Fd),
            "legacy" => Ok(IpcMode::Legacy),
            _ => Err(Error::invalid(format!(
                "{IPC_VARIABLE}={text}: not one of auto, fd, legacy"
            ))),
        }
    }

    /// The mode [`IPC_VARIABLE`] asks for in this process's environment.
    pub fn from_env() -> Result<IpcMode, Error> {
        match std::env::var_os(IPC_VARIABLE) {
            None => IpcMode::parse(None),
            Some(v) => match v.to_str() {
                Some(text) => IpcMode::parse(Some(text)),
                None => Err(Error::invalid(format!(
                    "{IPC_VARIABLE} is not valid UTF-8: not one of auto, fd, legacy"
                ))),
            },
        }
    }
}

/// A number drawn once per process, so that a legacy handle of this process is known as one even where
/// process ids repeat (processes in different PID namespaces).
fn process_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish()
    })
}

/// Shareable device memory of one GPU (see the module docs).
pub struct CudaMemory {
    gpu: Gpu,
    granularity: usize,
    legacy: bool,
    /// What the device lacks to share by descriptor, if anything.
    no_fd: Option<&'static str>,
}

impl CudaMemory {
    /// Shareable memory on `gpu`, in the mode `BRAID_CUDA_IPC` asks for (see
    /// [`with_mode`](Self::with_mode)).
    pub fn new(gpu: &Gpu) -> Result<CudaMemory, Error> {
        CudaMemory::with_mode(gpu, IpcMode::from_env()?)
    }

    /// Shareable memory on `gpu`, shared as `mode` says: [`IpcMode::Fd`] is an error naming
    /// [`IPC_VARIABLE`] and the missing capability on a device without virtual memory management or
    /// POSIX file-descriptor handles; [`IpcMode::Auto`] falls back to legacy handles there; legacy
    /// handles need unified addressing.
    pub fn with_mode(gpu: &Gpu, mode: IpcMode) -> Result<CudaMemory, Error> {
        let mut no_fd = None;
        for (attr, what) in [
            (api::ATTR_VMM_SUPPORTED, "virtual memory management"),
            (
                api::ATTR_POSIX_FD_SUPPORTED,
                "POSIX file-descriptor handles",
            ),
        ] {
            if no_fd.is_none() && gpu.attribute(attr)? == 0 {
                no_fd = Some(what);
            }
        }
        let legacy = match (mode, no_fd) {
            (IpcMode::Fd, Some(what)) => {
                return Err(Error::Io {
                    context: format!("CUDA device {}", gpu.ordinal()),
                    message: format!(
                        "{IPC_VARIABLE}=fd, but the device does not support {what}, which sharing ring memory by descriptor needs (auto or legacy use legacy IPC handles)"
                    ),
                })
            }
            (IpcMode::Fd, None) | (IpcMode::Auto, None) => false,
            (IpcMode::Auto, Some(what)) => {
                tracing::info!(
                    "CUDA device {}: no {what}; the ipc transport shares ring memory by legacy IPC handles",
                    gpu.ordinal()
                );
                true
            }
            (IpcMode::Legacy, _) => true,
        };
        if legacy && gpu.attribute(api::ATTR_UNIFIED_ADDRESSING)? == 0 {
            return Err(Error::Io {
                context: format!("CUDA device {}", gpu.ordinal()),
                message: "it does not support unified addressing, which legacy IPC handles need"
                    .into(),
            });
        }
        let granularity = if legacy {
            LEGACY_GRANULARITY
        } else {
            fd_granularity(gpu)?
        };
        Ok(CudaMemory {
            gpu: gpu.clone(),
            granularity,
            legacy,
            no_fd,
        })
    }

    /// How allocations are shared: [`IpcMode::Fd`] or [`IpcMode::Legacy`].
    pub fn mode(&self) -> IpcMode {
        if self.legacy {
            IpcMode::Legacy
        } else {
            IpcMode::Fd
        }
    }

    /// Reserves an address range, maps `handle` there read-write for this device, and wraps it; on
    /// failure releases what it made (and the handle).
    fn map(&self, handle: u64, bytes: usize) -> Result<CudaAllocation, Error> {
        let api = self.gpu.api();
        self.gpu.bind()?;
        let mut alloc = CudaAllocation {
            gpu: self.gpu.clone(),
            handle,
            addr: 0,
            len: bytes,
            mapped: false,
        };
        // SAFETY: valid out-pointer; a fresh range of `bytes` at the allocation's alignment.
        let r =
            unsafe { (api.mem_address_reserve)(&mut alloc.addr, bytes, self.granularity, 0, 0) };
        check(api, r, || format!("cuMemAddressReserve of {bytes} bytes"))?;
        // SAFETY: the reserved range and a live handle of at least `bytes`.
        let r = unsafe { (api.mem_map)(alloc.addr, bytes, 0, handle, 0) };
        check(api, r, || format!("cuMemMap of {bytes} bytes"))?;
        alloc.mapped = true;
        let access = MemAccessDesc {
            location: MemLocation {
                kind: MEM_LOCATION_TYPE_DEVICE,
                id: self.gpu.ordinal() as c_int,
            },
            flags: MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the mapped range; one descriptor.
        let r = unsafe { (api.mem_set_access)(alloc.addr, bytes, &access, 1) };
        check(api, r, || format!("cuMemSetAccess of {bytes} bytes"))?;
        Ok(alloc)
    }

    /// `bytes` of zeroed VMM memory and the descriptor it is shared by.
    fn allocate_fd(&self, bytes: usize) -> Result<(Box<dyn DeviceAllocation>, Shareable), Error> {
        let api = self.gpu.api();
        self.gpu.bind()?;
        let prop = props(self.gpu.ordinal());
        let mut handle = 0u64;
        // SAFETY: valid out-pointer and properties; the context is current.
        let r = unsafe { (api.mem_create)(&mut handle, bytes, &prop, 0) };
        check(api, r, || format!("cuMemCreate of {bytes} shareable bytes"))?;
        let alloc = self.map(handle, bytes)?;
        // SAFETY: the mapped range of this allocation.
        let r = unsafe { (api.memset_d8)(alloc.addr, 0, bytes) };
        check(api, r, || format!("zeroing {bytes} bytes of ring memory"))?;
        // The memset is asynchronous for device memory: it must be done before any peer maps the rings.
        self.gpu.synchronize()?;
        let mut fd: c_int = -1;
        // SAFETY: for the POSIX handle type the driver writes an int descriptor.
        let r = unsafe {
            (api.mem_export_to_shareable_handle)(
                (&mut fd as *mut c_int).cast::<c_void>(),
                handle,
                MEM_HANDLE_TYPE_POSIX_FD,
                0,
            )
        };
        check(api, r, || "cuMemExportToShareableHandle".into())?;
        if fd < 0 {
            return Err(Error::Internal(
                "cuMemExportToShareableHandle gave no descriptor".into(),
            ));
        }
        // SAFETY: the driver handed us a new descriptor, ours to close.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok((Box::new(alloc), Shareable::Fd(fd)))
    }

    /// Maps `bytes` of a peer's VMM memory from its descriptor.
    fn import_fd(&self, fd: OwnedFd, bytes: usize) -> Result<Box<dyn DeviceAllocation>, Error> {
        if let Some(what) = self.no_fd {
            return Err(Error::Io {
                context: format!("CUDA device {}", self.gpu.ordinal()),
                message: format!(
                    "a peer shares its ring memory by descriptor, but this device does not support {what}; set {IPC_VARIABLE}=legacy on every rank"
                ),
            });
        }
        let api = self.gpu.api();
        self.gpu.bind()?;
        let mut handle = 0u64;
        // SAFETY: the POSIX handle type takes the descriptor's value as the pointer argument; the
        // driver does not keep `fd` (closed when it drops here).
        let r = unsafe {
            (api.mem_import_from_shareable_handle)(
                &mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                MEM_HANDLE_TYPE_POSIX_FD,
            )
        };
        check(api, r, || "cuMemImportFromShareableHandle".into())?;
        Ok(Box::new(self.map(handle, bytes)?))
    }

    /// `bytes` of zeroed `cuMemAlloc` memory and the legacy handle it is shared by.
    fn allocate_legacy(
        &self,
        bytes: usize,
    ) -> Result<(Box<dyn DeviceAllocation>, Shareable), Error> {
        let api = self.gpu.api();
        self.gpu.bind()?;
        let mut addr = 0;
        // SAFETY: valid out-pointer; the context is current.
        let r = unsafe { (api.mem_alloc)(&mut addr, bytes) };
        check(api, r, || format!("cuMemAlloc of {bytes} shareable bytes"))?;
        // Freed by its drop from here on, whatever fails next.
        let alloc = LegacyAllocation {
            gpu: self.gpu.clone(),
            addr,
            len: bytes,
            owner: Owner::Exporter,
        };
        // SAFETY: the `bytes` just allocated.
        let r = unsafe { (api.memset_d8)(alloc.addr, 0, bytes) };
        check(api, r, || format!("zeroing {bytes} bytes of ring memory"))?;
        // The memset is asynchronous for device memory: it must be done before any peer opens the rings.
        self.gpu.synchronize()?;
        let mut ipc = IpcMemHandle { reserved: [0; 64] };
        // SAFETY: valid out-pointer; the base address of a live `cuMemAlloc` allocation.
        let r = unsafe { (api.ipc_get_mem_handle)(&mut ipc, alloc.addr) };
        check(api, r, || "cuIpcGetMemHandle".into())?;
        let handle = LegacyHandle {
            ipc,
            pid: std::process::id(),
            ordinal: self.gpu.ordinal(),
            token: process_token(),
            addr: alloc.addr,
            len: bytes as u64,
        };
        Ok((Box::new(alloc), Shareable::handle(handle.to_bytes())?))
    }

    /// Opens `bytes` of a peer's memory from its legacy handle (this process's own: at its address).
    fn import_legacy(
        &self,
        handle: &[u8],
        bytes: usize,
    ) -> Result<Box<dyn DeviceAllocation>, Error> {
        let handle = LegacyHandle::from_bytes(handle)?;
        if handle.len != bytes as u64 {
            return Err(Error::Bootstrap(format!(
                "a legacy CUDA IPC handle of {} bytes, not {bytes}",
                handle.len
            )));
        }
        if handle.token == process_token() && handle.pid == std::process::id() {
            if handle.ordinal != self.gpu.ordinal() {
                return Err(Error::Io {
                    context: format!("CUDA device {}", self.gpu.ordinal()),
                    message: format!(
                        "a rank of this process on device {} shares its ring memory by legacy IPC handle, which this process cannot open, and this device may not reach that memory directly; run one process per GPU or set {IPC_VARIABLE}=fd",
                        handle.ordinal
                    ),
                });
            }
            return Ok(Box::new(LegacyAllocation {
                gpu: self.gpu.clone(),
                addr: handle.addr,
                len: bytes,
                owner: Owner::SameProcess,
            }));
        }
        let api = self.gpu.api();
        self.gpu.bind()?;
        let mut addr = 0;
        // SAFETY: valid out-pointer; the handle is passed by value; the context is current. The driver
        // checks the handle: garbage is an error, not a mapping.
        let r = unsafe {
            (api.ipc_open_mem_handle)(&mut addr, handle.ipc, IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        };
        check(api, r, || {
            format!("cuIpcOpenMemHandle of process {}'s ring memory", handle.pid)
        })?;
        Ok(Box::new(LegacyAllocation {
            gpu: self.gpu.clone(),
            addr,
            len: bytes,
            owner: Owner::Importer,
        }))
    }
}

/// What a legacy allocation's handle carries (see the module docs), little-endian after the driver's
/// 64 bytes.
struct LegacyHandle {
    ipc: IpcMemHandle,
    pid: u32,
    ordinal: u32,
    token: u64,
    addr: u64,
    len: u64,
}

impl LegacyHandle {
    fn to_bytes(&self) -> Vec<u8> {
        let mut v: Vec<u8> = self.ipc.reserved.iter().map(|&c| c as u8).collect();
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.ordinal.to_le_bytes());
        v.extend_from_slice(&self.token.to_le_bytes());
        v.extend_from_slice(&self.addr.to_le_bytes());
        v.extend_from_slice(&self.len.to_le_bytes());
        v
    }

    fn from_bytes(bytes: &[u8]) -> Result<LegacyHandle, Error> {
        if bytes.len() != LEGACY_HANDLE_BYTES {
            return Err(Error::Bootstrap(format!(
                "a legacy CUDA IPC handle is {LEGACY_HANDLE_BYTES} bytes, not {}",
                bytes.len()
            )));
        }
        let mut ipc = IpcMemHandle { reserved: [0; 64] };
        for (c, &b) in ipc.reserved.iter_mut().zip(&bytes[..64]) {
            *c = b as c_char;
        }
        let u32_at =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Ok(LegacyHandle {
            ipc,
            pid: u32_at(64),
            ordinal: u32_at(68),
            token: u64_at(72),
            addr: u64_at(80),
            len: u64_at(88),
        })
    }
}

/// The granularity VMM allocations of `gpu` are rounded to: the driver's recommendation, a power of two
/// of at least 4096.
fn fd_granularity(gpu: &Gpu) -> Result<usize, Error> {
    let prop = props(gpu.ordinal());
    let api = gpu.api();
    gpu.bind()?;
    let mut granularity = 0usize;
    // SAFETY: valid out-pointer and properties.
    let r = unsafe {
        (api.mem_get_allocation_granularity)(
            &mut granularity,
            &prop,
            api::MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    };
    check(api, r, || "cuMemGetAllocationGranularity".into())?;
    Ok(granularity.max(4096).next_power_of_two())
}

fn props(ordinal: u32) -> MemAllocationProp {
    MemAllocationProp {
        kind: MEM_ALLOCATION_TYPE_PINNED,
        requested_handle_types: MEM_HANDLE_TYPE_POSIX_FD,
        location: MemLocation {
            kind: MEM_LOCATION_TYPE_DEVICE,
            id: ordinal as c_int,
        },
        win32_handle_meta_data: std::ptr::null_mut(),
        compression_type: 0,
        gpu_direct_rdma_capable: 0,
        usage: 0,
        reserved: [0; 4],
    }
}

impl DeviceMemory for CudaMemory {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn ordinal(&self) -> u32 {
        self.gpu.ordinal()
    }

    fn granularity(&self) -> usize {
        self.granularity
    }

    fn allocate(&self, bytes: usize) -> Result<(Box<dyn DeviceAllocation>, Shareable), Error> {
        if bytes == 0 || bytes % self.granularity != 0 {
            return Err(Error::invalid(format!(
                "shareable CUDA memory comes in nonzero multiples of {} bytes, not {bytes}",
                self.granularity
            )));
        }
        if self.legacy {
            self.allocate_legacy(bytes)
        } else {
            self.allocate_fd(bytes)
        }
    }

    fn import(&self, shared: Shareable, bytes: usize) -> Result<Box<dyn DeviceAllocation>, Error> {
        match shared {
            Shareable::Fd(fd) => self.import_fd(fd, bytes),
            Shareable::Handle(handle) => self.import_legacy(&handle, bytes),
        }
    }
}

/// A mapping of shareable device memory.
struct CudaAllocation {
    gpu: Gpu,
    handle: u64,
    addr: u64,
    len: usize,
    mapped: bool,
}

// SAFETY: the handle and range are plain numbers the driver accepts from any thread that binds the
// context, which `drop` does.
unsafe impl Send for CudaAllocation {}
// SAFETY: `&CudaAllocation` exposes only the address and length.
unsafe impl Sync for CudaAllocation {}

impl DeviceAllocation for CudaAllocation {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for CudaAllocation {
    fn drop(&mut self) {
        let api = self.gpu.api();
        if let Err(e) = self.gpu.bind() {
            tracing::warn!("releasing ring memory: {e}");
            return;
        }
        let step = |r, what: &str| {
            if let Err(e) = check(api, r, || what.into()) {
                tracing::warn!("releasing ring memory: {e}");
            }
        };
        if self.mapped {
            // SAFETY: the range mapped by `map`, unmapped once.
            step(
                unsafe { (api.mem_unmap)(self.addr, self.len) },
                "cuMemUnmap",
            );
        }
        if self.addr != 0 {
            // SAFETY: the range reserved by `map`, freed once.
            step(
                unsafe { (api.mem_address_free)(self.addr, self.len) },
                "cuMemAddressFree",
            );
        }
        // SAFETY: the handle created or imported for this allocation, released once.
        step(unsafe { (api.mem_release)(self.handle) }, "cuMemRelease");
    }
}

/// Who frees a legacy allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    /// This process allocated it: `cuMemFree`.
    Exporter,
    /// Opened from another process's handle: `cuIpcCloseMemHandle`.
    Importer,
    /// Another rank of this process allocated it, and frees it.
    SameProcess,
}

/// Legacy ring memory: allocated here, opened from a peer's handle, or another rank's of this process.
struct LegacyAllocation {
    gpu: Gpu,
    addr: u64,
    len: usize,
    owner: Owner,
}

// SAFETY: the address is a plain number the driver accepts from any thread that binds the context,
// which `drop` does.
unsafe impl Send for LegacyAllocation {}
// SAFETY: `&LegacyAllocation` exposes only the address and length.
unsafe impl Sync for LegacyAllocation {}

impl DeviceAllocation for LegacyAllocation {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for LegacyAllocation {
    fn drop(&mut self) {
        if self.addr == 0 || self.owner == Owner::SameProcess {
            return;
        }
        let api = self.gpu.api();
        if let Err(e) = self.gpu.bind() {
            tracing::warn!("releasing ring memory: {e}");
            return;
        }
        let (r, what) = match self.owner {
            Owner::Exporter => {
                // SAFETY: the allocation `cuMemAlloc` made for this value, freed once.
                let r = unsafe { (api.mem_free)(self.addr) };
                (r, "cuMemFree")
            }
            Owner::Importer => {
                // SAFETY: the address `cuIpcOpenMemHandle` returned for this value, closed once.
                let r = unsafe { (api.ipc_close_mem_handle)(self.addr) };
                (r, "cuIpcCloseMemHandle")
            }
            Owner::SameProcess => return,
        };
        if let Err(e) = check(api, r, || what.into()) {
            tracing::warn!("releasing ring memory: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ipc_variable_names_a_mode_or_is_refused_by_name() {
        for (setting, mode) in [
            (None, IpcMode::Auto),
            (Some(""), IpcMode::Auto),
            (Some("  "), IpcMode::Auto),
            (Some("auto"), IpcMode::Auto),
            (Some("fd"), IpcMode::Fd),
            (Some(" FD "), IpcMode::Fd),
            (Some("legacy"), IpcMode::Legacy),
            (Some("Legacy"), IpcMode::Legacy),
        ] {
            assert_eq!(IpcMode::parse(setting).unwrap(), mode, "{setting:?}");
        }
        for bad in ["posix", "fd,legacy", "1", "cuda-ipc"] {
            let e = IpcMode::parse(Some(bad)).unwrap_err();
            assert!(e.is_invalid_argument(), "{bad}: {e}");
            let text = e.to_string();
            assert!(text.contains(&format!("{IPC_VARIABLE}={bad}")), "{text}");
            assert!(text.contains("auto, fd, legacy"), "{text}");
        }
    }

    #[test]
    fn legacy_handles_round_trip_and_bad_lengths_are_refused() {
        let mut ipc = IpcMemHandle { reserved: [0; 64] };
        for (i, c) in ipc.reserved.iter_mut().enumerate() {
            *c = (i as u8).wrapping_mul(37) as c_char;
        }
        let h = LegacyHandle {
            ipc,
            pid: 4242,
            ordinal: 3,
            token: 0x0123_4567_89ab_cdef,
            addr: 0x7f00_0020_0000,
            len: 6 << 20,
        };
        let bytes = h.to_bytes();
        assert_eq!(bytes.len(), LEGACY_HANDLE_BYTES);
        assert!(bytes.len() <= braid_transport::device::MAX_HANDLE_BYTES);
        let back = LegacyHandle::from_bytes(&bytes).unwrap();
        assert_eq!(back.ipc.reserved, h.ipc.reserved);
        assert_eq!(
            (back.pid, back.ordinal, back.token, back.addr, back.len),
            (4242, 3, 0x0123_4567_89ab_cdef, 0x7f00_0020_0000, 6 << 20)
        );
        for len in [0, 8, LEGACY_HANDLE_BYTES - 1, LEGACY_HANDLE_BYTES + 1] {
            let e = LegacyHandle::from_bytes(&vec![0; len]).err().unwrap();
            assert!(
                e.to_string()
                    .contains(&format!("{LEGACY_HANDLE_BYTES} bytes, not {len}")),
                "{e}"
            );
        }
        assert_eq!(process_token(), process_token());
        assert!(LEGACY_GRANULARITY.is_power_of_two() && LEGACY_GRANULARITY >= 4096);
    }
}
