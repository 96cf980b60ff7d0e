//! CUDA device memory for the `ipc` transport's rings: allocations made with the virtual memory
//! management API so that they can be shared with other processes by a POSIX file descriptor.
//!
//! Allocating: `cuMemCreate` (pinned, on this device, POSIX-fd handle type), `cuMemAddressReserve`,
//! `cuMemMap`, `cuMemSetAccess` (read-write for this device), zeroed, and the descriptor from
//! `cuMemExportToShareableHandle`. Importing: `cuMemImportFromShareableHandle` on the peer's descriptor,
//! then the same reserve, map and access for the importing process's device (several ranks on one GPU
//! map each other's rings on that GPU). Dropping unmaps, frees the address range and releases the
//! handle; the memory goes when the last process lets go of it.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use braid_core::Error;
use braid_transport::{DeviceAllocation, DeviceMemory};

use crate::driver::api::{
    self, check, MemAccessDesc, MemAllocationProp, MemLocation, MEM_ACCESS_FLAGS_PROT_READWRITE,
    MEM_ALLOCATION_TYPE_PINNED, MEM_HANDLE_TYPE_POSIX_FD, MEM_LOCATION_TYPE_DEVICE,
};
use crate::driver::Gpu;

/// Shareable device memory of one GPU (see the module docs).
pub struct CudaMemory {
    gpu: Gpu,
    granularity: usize,
}

impl CudaMemory {
    /// Shareable memory on `gpu`; an error when the device cannot export memory as file descriptors
    /// (no virtual memory management, or no POSIX handle support).
    pub fn new(gpu: &Gpu) -> Result<CudaMemory, Error> {
        for (attr, what) in [
            (api::ATTR_VMM_SUPPORTED, "virtual memory management"),
            (
                api::ATTR_POSIX_FD_SUPPORTED,
                "POSIX file-descriptor handles",
            ),
        ] {
            if gpu.attribute(attr)? == 0 {
                return Err(Error::Io {
                    context: format!("CUDA device {}", gpu.ordinal()),
                    message: format!("it does not support {what}, which the ipc transport needs"),
                });
            }
        }
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
        Ok(CudaMemory {
            gpu: gpu.clone(),
            granularity: granularity.max(4096).next_power_of_two(),
        })
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

    fn allocate(&self, bytes: usize) -> Result<(Box<dyn DeviceAllocation>, OwnedFd), Error> {
        if bytes == 0 || bytes % self.granularity != 0 {
            return Err(Error::invalid(format!(
                "shareable CUDA memory comes in nonzero multiples of {} bytes, not {bytes}",
                self.granularity
            )));
        }
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
        Ok((Box::new(alloc), fd))
    }

    fn import(&self, fd: OwnedFd, bytes: usize) -> Result<Box<dyn DeviceAllocation>, Error> {
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
