//! Device memory, pinned host memory, host memory registered with the driver, and what kind of memory
//! a pointer is.

use std::ffi::{c_uint, c_void};

use braid_core::Error;
use braid_transport::Span;

use super::api::{self, api, check, CuDevicePtr};
use super::device::Gpu;

/// Device memory from `cuMemAlloc`, freed on drop.
pub struct DeviceBuffer {
    gpu: Gpu,
    addr: CuDevicePtr,
    len: usize,
}

// SAFETY: a device address is usable from any thread that binds the device's context, which every
// method does first.
unsafe impl Send for DeviceBuffer {}
// SAFETY: `&DeviceBuffer` hands out only the address, the length and the device.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// `len` bytes of uninitialised device memory on `gpu` (none for 0).
    pub fn alloc(gpu: &Gpu, len: usize) -> Result<DeviceBuffer, Error> {
        let mut addr: CuDevicePtr = 0;
        if len > 0 {
            gpu.bind()?;
            let api = gpu.api();
            // SAFETY: valid out-pointer; the context is current.
            check(api, unsafe { (api.mem_alloc)(&mut addr, len) }, || {
                format!("cuMemAlloc of {len} bytes on device {}", gpu.ordinal())
            })?;
        }
        Ok(DeviceBuffer {
            gpu: gpu.clone(),
            addr,
            len,
        })
    }

    /// The device address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device it lives on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The buffer as a span of device memory (valid while the buffer lives).
    pub fn span(&self) -> Span {
        // SAFETY: the address is this buffer's allocation of `len` bytes on this device; a span is a
        // description, and every use of it is unsafe and bound by the buffer's lifetime.
        unsafe { Span::device(self.addr, self.len, self.gpu.ordinal()) }
    }

    /// Copies `src` into the buffer at `offset`, synchronously.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), Error> {
        self.check_range(offset, src.len(), "write")?;
        if src.is_empty() {
            return Ok(());
        }
        self.gpu.bind()?;
        let api = self.gpu.api();
        // SAFETY: the destination range is inside this allocation (checked); `src` is valid for its
        // length; the null stream with a synchronous host source completes before returning.
        let r = unsafe {
            (api.memcpy_async)(
                self.addr + offset as u64,
                src.as_ptr() as CuDevicePtr,
                src.len(),
                std::ptr::null_mut(),
            )
        };
        check(api, r, || {
            format!("copying {} bytes to the device", src.len())
        })?;
        self.gpu.synchronize()
    }

    /// Copies bytes of the buffer from `offset` into `dst`, synchronously.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), Error> {
        self.check_range(offset, dst.len(), "read")?;
        if dst.is_empty() {
            return Ok(());
        }
        self.gpu.bind()?;
        let api = self.gpu.api();
        // SAFETY: the source range is inside this allocation (checked); `dst` is valid for writes of
        // its length and borrowed exclusively until the synchronisation below.
        let r = unsafe {
            (api.memcpy_async)(
                dst.as_mut_ptr() as CuDevicePtr,
                self.addr + offset as u64,
                dst.len(),
                std::ptr::null_mut(),
            )
        };
        check(api, r, || {
            format!("copying {} bytes from the device", dst.len())
        })?;
        self.gpu.synchronize()
    }

    fn check_range(&self, offset: usize, len: usize, what: &str) -> Result<(), Error> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::invalid(format!(
                "{what} of {len} bytes at offset {offset} is outside a device buffer of {} bytes",
                self.len
            )));
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        let api = self.gpu.api();
        let freed = self.gpu.bind().and_then(|()| {
            // SAFETY: the address came from cuMemAlloc and is freed once, here.
            check(api, unsafe { (api.mem_free)(self.addr) }, || {
                "cuMemFree".into()
            })
        });
        if let Err(e) = freed {
            tracing::warn!("freeing {} bytes of device memory: {e}", self.len);
        }
    }
}

impl Gpu {
    /// Waits for all work on this device (used by the synchronous copies; streams have their own
    /// deadline-bound waits).
    pub fn synchronize(&self) -> Result<(), Error> {
        self.bind()?;
        let api = self.api();
        // SAFETY: no arguments; the context is current.
        check(api, unsafe { (api.ctx_synchronize)() }, || {
            format!("cuCtxSynchronize on device {}", self.ordinal())
        })
    }
}

/// Page-locked host memory from `cuMemHostAlloc` (portable, not write-combined, so the CPU reads it at
/// full speed), zeroed, freed on drop.
pub struct PinnedBuffer {
    gpu: Gpu,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer owns its memory exclusively; access goes through `&`/`&mut` slices.
unsafe impl Send for PinnedBuffer {}
// SAFETY: `&PinnedBuffer` only gives shared slices.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// `len` zeroed bytes of pinned host memory.
    pub fn alloc(gpu: &Gpu, len: usize) -> Result<PinnedBuffer, Error> {
        PinnedBuffer::alloc_with(gpu, len, api::MEMHOSTALLOC_PORTABLE)
    }

    /// `len` zeroed bytes of pinned host memory that is also mapped into the device's address space
    /// ([`PinnedBuffer::device_addr`]): what stream memory operations wait on.
    pub fn alloc_mapped(gpu: &Gpu, len: usize) -> Result<PinnedBuffer, Error> {
        PinnedBuffer::alloc_with(
            gpu,
            len,
            api::MEMHOSTALLOC_PORTABLE | api::MEMHOSTALLOC_DEVICEMAP,
        )
    }

    fn alloc_with(gpu: &Gpu, len: usize, flags: std::ffi::c_uint) -> Result<PinnedBuffer, Error> {
        let mut ptr: *mut c_void = std::ptr::NonNull::<u8>::dangling().as_ptr().cast();
        if len > 0 {
            gpu.bind()?;
            let api = gpu.api();
            // SAFETY: valid out-pointer; the context is current.
            let r = unsafe { (api.mem_host_alloc)(&mut ptr, len, flags) };
            check(api, r, || format!("cuMemHostAlloc of {len} bytes"))?;
            // SAFETY: the driver returned `len` writable bytes at `ptr`.
            unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, len) };
        }
        Ok(PinnedBuffer {
            gpu: gpu.clone(),
            ptr: ptr as *mut u8,
            len,
        })
    }

    /// The device address of a buffer from [`PinnedBuffer::alloc_mapped`].
    pub fn device_addr(&self) -> Result<u64, Error> {
        if self.len == 0 {
            return Ok(0);
        }
        self.gpu.bind()?;
        let api = self.gpu.api();
        let mut addr: CuDevicePtr = 0;
        // SAFETY: valid out-pointer; a pointer this buffer allocated; flags must be 0.
        let r = unsafe { (api.mem_host_get_device_pointer)(&mut addr, self.ptr.cast(), 0) };
        check(api, r, || "cuMemHostGetDevicePointer".into())?;
        Ok(addr)
    }

    /// The host address of the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes owned by this buffer (dangling but aligned when empty).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, borrowed exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        let api = self.gpu.api();
        let freed = self.gpu.bind().and_then(|()| {
            // SAFETY: the pointer came from cuMemHostAlloc and is freed once, here.
            check(api, unsafe { (api.mem_free_host)(self.ptr.cast()) }, || {
                "cuMemFreeHost".into()
            })
        });
        if let Err(e) = freed {
            tracing::warn!("freeing {} bytes of pinned memory: {e}", self.len);
        }
    }
}

/// Existing host memory page-locked with `cuMemHostRegister` (portable) until dropped.
pub struct HostRegistration {
    gpu: Gpu,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the registration only remembers the range to unregister; it grants no access.
unsafe impl Send for HostRegistration {}

impl HostRegistration {
    /// Registers `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The range must be one live allocation that outlives the registration, and no other
    /// registration may overlap it.
    pub unsafe fn new(gpu: &Gpu, ptr: *mut u8, len: usize) -> Result<HostRegistration, Error> {
        if ptr.is_null() || len == 0 {
            return Err(Error::invalid(
                "registering host memory needs a non-null pointer and a nonzero length",
            ));
        }
        gpu.bind()?;
        let api = gpu.api();
        // SAFETY: the caller vouches for the range; the context is current.
        let r = unsafe { (api.mem_host_register)(ptr.cast(), len, api::MEMHOSTREGISTER_PORTABLE) };
        check(api, r, || format!("cuMemHostRegister of {len} bytes"))?;
        Ok(HostRegistration {
            gpu: gpu.clone(),
            ptr,
            len,
        })
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let api = self.gpu.api();
        let done = self.gpu.bind().and_then(|()| {
            // SAFETY: the pointer was registered by `new` and is unregistered once, here.
            let r = unsafe { (api.mem_host_unregister)(self.ptr.cast()) };
            check(api, r, || "cuMemHostUnregister".into())
        });
        if let Err(e) = done {
            tracing::warn!("unregistering {} bytes of host memory: {e}", self.len);
        }
    }
}

/// What kind of memory an address is, as the driver sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PointerKind {
    /// Host memory the driver does not know (pageable).
    Host,
    /// Host memory the driver has page-locked (`cuMemHostAlloc`, `cuMemHostRegister`).
    PinnedHost,
    /// Memory of device `ordinal`.
    Device {
        /// The device's ordinal.
        ordinal: u32,
    },
    /// Managed (unified) memory, last attached to device `ordinal`.
    Managed {
        /// The device's ordinal.
        ordinal: u32,
    },
}

/// The kind of memory at `addr` (`cuPointerGetAttribute`); an error without a driver.
pub fn pointer_kind(addr: usize) -> Result<PointerKind, Error> {
    let api = api()?;
    let query = |attribute, out: *mut c_void| {
        // SAFETY: `out` points to storage of the attribute's type (c_uint or c_int, both 4 bytes).
        unsafe { (api.pointer_get_attribute)(out, attribute, addr as CuDevicePtr) }
    };
    let mut memory_type: c_uint = 0;
    let r = query(
        api::POINTER_MEMORY_TYPE,
        (&mut memory_type as *mut c_uint).cast(),
    );
    if r == api::CUDA_ERROR_INVALID_VALUE {
        return Ok(PointerKind::Host);
    }
    check(api, r, || format!("cuPointerGetAttribute({addr:#x})"))?;
    let mut managed: c_uint = 0;
    check(
        api,
        query(
            api::POINTER_IS_MANAGED,
            (&mut managed as *mut c_uint).cast(),
        ),
        || format!("cuPointerGetAttribute({addr:#x}, IS_MANAGED)"),
    )?;
    let ordinal = || -> Result<u32, Error> {
        let mut ordinal: i32 = 0;
        check(
            api,
            query(
                api::POINTER_DEVICE_ORDINAL,
                (&mut ordinal as *mut i32).cast(),
            ),
            || format!("cuPointerGetAttribute({addr:#x}, DEVICE_ORDINAL)"),
        )?;
        Ok(ordinal.max(0) as u32)
    };
    Ok(match (memory_type, managed != 0) {
        (_, true) => PointerKind::Managed {
            ordinal: ordinal()?,
        },
        (api::MEMORYTYPE_HOST, false) => PointerKind::PinnedHost,
        (api::MEMORYTYPE_DEVICE | api::MEMORYTYPE_UNIFIED, false) => PointerKind::Device {
            ordinal: ordinal()?,
        },
        (other, false) => {
            return Err(Error::invalid(format!(
                "memory at {addr:#x} is of CUDA memory type {other}, which braid cannot use"
            )))
        }
    })
}
