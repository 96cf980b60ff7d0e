//! The CUDA driver API, loaded from `libcuda.so.1` at run time: the entry points braid calls, their
//! constants, and error codes turned into braid errors. Nothing here is linked, so braid builds and runs
//! on machines without CUDA; the first call that needs the driver loads it (and `cuInit`s it) once.
//!
//! Each entry point is declared with its Rust signature and, beside it, its C parameter list, which
//! `tests/driver_abi.rs` compiles against CUDA's own `cuda.h`: a wrong name or parameter type there is a
//! compile error, not a corrupted call.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use braid_core::Error;
use libloading::Library;

use super::library::DRIVER_LIBRARY;

/// `CUresult`.
pub type CuResult = c_int;
/// `CUdevice`.
pub type CuDevice = c_int;
/// `CUdeviceptr`: a device address.
pub type CuDevicePtr = u64;
/// `CUcontext`, `CUstream`, `CUevent`, `CUmodule`, `CUfunction`: opaque handles.
pub type Handle = *mut c_void;

/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: CuResult = 0;
/// `CUDA_ERROR_INVALID_VALUE`: also what `cuPointerGetAttribute` answers for memory CUDA does not know.
pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
/// `CUDA_ERROR_NOT_READY`: a stream or event query whose work has not finished.
pub const CUDA_ERROR_NOT_READY: CuResult = 600;

/// `CU_STREAM_CAPTURE_STATUS_NONE`: the stream is not being captured.
pub const STREAM_CAPTURE_STATUS_NONE: c_int = 0;
/// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`: a capture that other threads' unsafe calls do not end.
pub const STREAM_CAPTURE_MODE_THREAD_LOCAL: c_int = 1;

/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`.
pub const ATTR_MULTIPROCESSOR_COUNT: c_int = 16;
/// `CU_DEVICE_ATTRIBUTE_PCI_BUS_ID`.
pub const ATTR_PCI_BUS_ID: c_int = 33;
/// `CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID`.
pub const ATTR_PCI_DEVICE_ID: c_int = 34;
/// `CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING`.
pub const ATTR_UNIFIED_ADDRESSING: c_int = 41;
/// `CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID`.
pub const ATTR_PCI_DOMAIN_ID: c_int = 50;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`.
pub const ATTR_CC_MAJOR: c_int = 75;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR`.
pub const ATTR_CC_MINOR: c_int = 76;
/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
pub const ATTR_VMM_SUPPORTED: c_int = 102;
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
pub const ATTR_POSIX_FD_SUPPORTED: c_int = 103;

/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`.
pub const POINTER_MEMORY_TYPE: c_int = 2;
/// `CU_POINTER_ATTRIBUTE_IS_MANAGED`.
pub const POINTER_IS_MANAGED: c_int = 8;
/// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
pub const POINTER_DEVICE_ORDINAL: c_int = 9;
/// `CU_MEMORYTYPE_HOST`.
pub const MEMORYTYPE_HOST: c_uint = 1;
/// `CU_MEMORYTYPE_DEVICE`.
pub const MEMORYTYPE_DEVICE: c_uint = 2;
/// `CU_MEMORYTYPE_UNIFIED`.
pub const MEMORYTYPE_UNIFIED: c_uint = 4;

/// `CU_MEMHOSTALLOC_PORTABLE`: pinned memory usable from every context.
pub const MEMHOSTALLOC_PORTABLE: c_uint = 1;
/// `CU_MEMHOSTALLOC_DEVICEMAP`: pinned memory mapped into the device's address space.
pub const MEMHOSTALLOC_DEVICEMAP: c_uint = 2;
/// `CU_STREAM_WAIT_VALUE_GEQ`: wait until `(int32_t)(*addr - value) >= 0`.
pub const STREAM_WAIT_VALUE_GEQ: c_uint = 0;
/// `CU_MEMHOSTREGISTER_PORTABLE`.
pub const MEMHOSTREGISTER_PORTABLE: c_uint = 1;
/// `CU_STREAM_NON_BLOCKING`: no implicit synchronisation with the legacy default stream.
pub const STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_DEFAULT`.
pub const EVENT_DEFAULT: c_uint = 0;
/// `CU_EVENT_DISABLE_TIMING`.
pub const EVENT_DISABLE_TIMING: c_uint = 2;

/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
pub const MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
pub const MEM_HANDLE_TYPE_POSIX_FD: c_int = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub const MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub const MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;
/// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`.
pub const MEM_ALLOC_GRANULARITY_RECOMMENDED: c_int = 1;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: the one flag `cuIpcOpenMemHandle` takes.
pub const IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MemLocation {
    /// `type` (`CU_MEM_LOCATION_TYPE_*`).
    pub kind: c_int,
    /// `id`: the device ordinal for device locations.
    pub id: c_int,
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MemAllocationProp {
    /// `type` (`CU_MEM_ALLOCATION_TYPE_*`).
    pub kind: c_int,
    /// `requestedHandleTypes`.
    pub requested_handle_types: c_int,
    /// `location`.
    pub location: MemLocation,
    /// `win32HandleMetaData` (null here).
    pub win32_handle_meta_data: *mut c_void,
    /// `allocFlags.compressionType`.
    pub compression_type: u8,
    /// `allocFlags.gpuDirectRDMACapable`.
    pub gpu_direct_rdma_capable: u8,
    /// `allocFlags.usage`.
    pub usage: u16,
    /// `allocFlags.reserved`.
    pub reserved: [u8; 4],
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MemAccessDesc {
    /// `location`.
    pub location: MemLocation,
    /// `flags` (`CU_MEM_ACCESS_FLAGS_*`).
    pub flags: c_int,
}

/// `CUipcMemHandle`: a legacy IPC handle of device memory, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IpcMemHandle {
    /// `reserved`: the handle's opaque bytes.
    pub reserved: [c_char; 64],
}

/// A struct's C layout: its C name, its size, and (C field, offset) for each field.
pub type StructLayout = (&'static str, usize, &'static [(&'static str, usize)]);

/// The C layout of every struct above, for `tests/driver_abi.rs`.
pub const STRUCTS: &[StructLayout] = &[
    (
        "CUmemLocation",
        std::mem::size_of::<MemLocation>(),
        &[
            ("type", std::mem::offset_of!(MemLocation, kind)),
            ("id", std::mem::offset_of!(MemLocation, id)),
        ],
    ),
    (
        "CUmemAllocationProp",
        std::mem::size_of::<MemAllocationProp>(),
        &[
            ("type", std::mem::offset_of!(MemAllocationProp, kind)),
            (
                "requestedHandleTypes",
                std::mem::offset_of!(MemAllocationProp, requested_handle_types),
            ),
            (
                "location",
                std::mem::offset_of!(MemAllocationProp, location),
            ),
            (
                "win32HandleMetaData",
                std::mem::offset_of!(MemAllocationProp, win32_handle_meta_data),
            ),
            (
                "allocFlags.compressionType",
                std::mem::offset_of!(MemAllocationProp, compression_type),
            ),
            (
                "allocFlags.gpuDirectRDMACapable",
                std::mem::offset_of!(MemAllocationProp, gpu_direct_rdma_capable),
            ),
            (
                "allocFlags.usage",
                std::mem::offset_of!(MemAllocationProp, usage),
            ),
            (
                "allocFlags.reserved",
                std::mem::offset_of!(MemAllocationProp, reserved),
            ),
        ],
    ),
    (
        "CUmemAccessDesc",
        std::mem::size_of::<MemAccessDesc>(),
        &[
            ("location", std::mem::offset_of!(MemAccessDesc, location)),
            ("flags", std::mem::offset_of!(MemAccessDesc, flags)),
        ],
    ),
    (
        "CUipcMemHandle",
        std::mem::size_of::<IpcMemHandle>(),
        &[("reserved", std::mem::offset_of!(IpcMemHandle, reserved))],
    ),
];

/// Every constant above with its `cuda.h` name, for `tests/driver_abi.rs`.
pub const CONSTANTS: &[(&str, i64)] = &[
    ("CUDA_SUCCESS", CUDA_SUCCESS as i64),
    ("CUDA_ERROR_INVALID_VALUE", CUDA_ERROR_INVALID_VALUE as i64),
    ("CUDA_ERROR_OUT_OF_MEMORY", CUDA_ERROR_OUT_OF_MEMORY as i64),
    (
        "CU_STREAM_CAPTURE_STATUS_NONE",
        STREAM_CAPTURE_STATUS_NONE as i64,
    ),
    (
        "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL",
        STREAM_CAPTURE_MODE_THREAD_LOCAL as i64,
    ),
    ("CUDA_ERROR_NOT_READY", CUDA_ERROR_NOT_READY as i64),
    (
        "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT",
        ATTR_MULTIPROCESSOR_COUNT as i64,
    ),
    ("CU_DEVICE_ATTRIBUTE_PCI_BUS_ID", ATTR_PCI_BUS_ID as i64),
    (
        "CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID",
        ATTR_PCI_DEVICE_ID as i64,
    ),
    (
        "CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING",
        ATTR_UNIFIED_ADDRESSING as i64,
    ),
    (
        "CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID",
        ATTR_PCI_DOMAIN_ID as i64,
    ),
    (
        "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR",
        ATTR_CC_MAJOR as i64,
    ),
    (
        "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR",
        ATTR_CC_MINOR as i64,
    ),
    (
        "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
        ATTR_VMM_SUPPORTED as i64,
    ),
    (
        "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
        ATTR_POSIX_FD_SUPPORTED as i64,
    ),
    (
        "CU_POINTER_ATTRIBUTE_MEMORY_TYPE",
        POINTER_MEMORY_TYPE as i64,
    ),
    ("CU_POINTER_ATTRIBUTE_IS_MANAGED", POINTER_IS_MANAGED as i64),
    (
        "CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL",
        POINTER_DEVICE_ORDINAL as i64,
    ),
    ("CU_MEMORYTYPE_HOST", MEMORYTYPE_HOST as i64),
    ("CU_MEMORYTYPE_DEVICE", MEMORYTYPE_DEVICE as i64),
    ("CU_MEMORYTYPE_UNIFIED", MEMORYTYPE_UNIFIED as i64),
    ("CU_MEMHOSTALLOC_PORTABLE", MEMHOSTALLOC_PORTABLE as i64),
    (
        "CU_MEMHOSTREGISTER_PORTABLE",
        MEMHOSTREGISTER_PORTABLE as i64,
    ),
    ("CU_STREAM_NON_BLOCKING", STREAM_NON_BLOCKING as i64),
    ("CU_EVENT_DEFAULT", EVENT_DEFAULT as i64),
    ("CU_EVENT_DISABLE_TIMING", EVENT_DISABLE_TIMING as i64),
    (
        "CU_MEM_ALLOCATION_TYPE_PINNED",
        MEM_ALLOCATION_TYPE_PINNED as i64,
    ),
    (
        "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
        MEM_HANDLE_TYPE_POSIX_FD as i64,
    ),
    (
        "CU_MEM_LOCATION_TYPE_DEVICE",
        MEM_LOCATION_TYPE_DEVICE as i64,
    ),
    (
        "CU_MEM_ACCESS_FLAGS_PROT_READWRITE",
        MEM_ACCESS_FLAGS_PROT_READWRITE as i64,
    ),
    (
        "CU_MEM_ALLOC_GRANULARITY_RECOMMENDED",
        MEM_ALLOC_GRANULARITY_RECOMMENDED as i64,
    ),
    (
        "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS",
        IPC_MEM_LAZY_ENABLE_PEER_ACCESS as i64,
    ),
];

macro_rules! driver_api {
    ($( $(#[$doc:meta])* $field:ident = [$($name:literal),+] fn($($arg:ty),*) as $c:literal; )*) => {
        /// The driver's entry points, resolved once; the library stays loaded while this lives (for the
        /// life of the process: it is kept in a `static`).
        pub struct Api {
            $( $(#[$doc])* pub $field: unsafe extern "C" fn($($arg),*) -> CuResult, )*
            _library: Library,
        }

        /// Every entry point: the names tried in order (a newer versioned name first), its C parameter
        /// list, and its Rust parameter types as written, for `tests/driver_abi.rs`.
        pub const ENTRY_POINTS: &[(&[&str], &str, &[&str])] =
            &[ $( (&[$($name),+], $c, &[$(stringify!($arg)),*]), )* ];

        impl Api {
            fn resolve(library: Library) -> Result<Api, String> {
                Ok(Api {
                    $( $field: resolve(&library, &[$($name),+])?, )*
                    _library: library,
                })
            }
        }
    };
}

driver_api! {
    /// `cuInit`.
    init = ["cuInit"] fn(c_uint) as "unsigned int";
    /// `cuDriverGetVersion`.
    driver_get_version = ["cuDriverGetVersion"] fn(*mut c_int) as "int*";
    /// `cuGetErrorName`.
    get_error_name = ["cuGetErrorName"] fn(CuResult, *mut *const c_char) as "CUresult, const char**";
    /// `cuGetErrorString`.
    get_error_string = ["cuGetErrorString"] fn(CuResult, *mut *const c_char) as "CUresult, const char**";
    /// `cuDeviceGetCount`.
    device_get_count = ["cuDeviceGetCount"] fn(*mut c_int) as "int*";
    /// `cuDeviceGet`.
    device_get = ["cuDeviceGet"] fn(*mut CuDevice, c_int) as "CUdevice*, int";
    /// `cuDeviceGetName`.
    device_get_name = ["cuDeviceGetName"] fn(*mut c_char, c_int, CuDevice) as "char*, int, CUdevice";
    /// `cuDeviceGetAttribute`.
    device_get_attribute = ["cuDeviceGetAttribute"] fn(*mut c_int, c_int, CuDevice)
        as "int*, CUdevice_attribute, CUdevice";
    /// `cuDeviceTotalMem`.
    device_total_mem = ["cuDeviceTotalMem_v2"] fn(*mut usize, CuDevice) as "size_t*, CUdevice";
    /// `cuDevicePrimaryCtxRetain`.
    primary_ctx_retain = ["cuDevicePrimaryCtxRetain"] fn(*mut Handle, CuDevice) as "CUcontext*, CUdevice";
    /// `cuDevicePrimaryCtxRelease`.
    primary_ctx_release = ["cuDevicePrimaryCtxRelease_v2"] fn(CuDevice) as "CUdevice";
    /// `cuCtxSetCurrent`.
    ctx_set_current = ["cuCtxSetCurrent"] fn(Handle) as "CUcontext";
    /// `cuCtxGetCurrent`.
    ctx_get_current = ["cuCtxGetCurrent"] fn(*mut Handle) as "CUcontext*";
    /// `cuCtxGetStreamPriorityRange`.
    ctx_get_stream_priority_range = ["cuCtxGetStreamPriorityRange"] fn(*mut c_int, *mut c_int) as "int*, int*";
    /// `cuCtxSynchronize`.
    ctx_synchronize = ["cuCtxSynchronize"] fn() as "void";
    /// `cuMemAlloc`.
    mem_alloc = ["cuMemAlloc_v2"] fn(*mut CuDevicePtr, usize) as "CUdeviceptr*, size_t";
    /// `cuMemFree`.
    mem_free = ["cuMemFree_v2"] fn(CuDevicePtr) as "CUdeviceptr";
    /// `cuMemHostAlloc`.
    mem_host_alloc = ["cuMemHostAlloc"] fn(*mut *mut c_void, usize, c_uint) as "void**, size_t, unsigned int";
    /// `cuMemHostGetDevicePointer`.
    mem_host_get_device_pointer = ["cuMemHostGetDevicePointer_v2"] fn(*mut CuDevicePtr, *mut c_void, c_uint)
        as "CUdeviceptr*, void*, unsigned int";
    /// `cuStreamWaitValue32`.
    stream_wait_value32 = ["cuStreamWaitValue32_v2"] fn(Handle, CuDevicePtr, u32, c_uint)
        as "CUstream, CUdeviceptr, cuuint32_t, unsigned int";
    /// `cuStreamWriteValue32`.
    stream_write_value32 = ["cuStreamWriteValue32_v2"] fn(Handle, CuDevicePtr, u32, c_uint)
        as "CUstream, CUdeviceptr, cuuint32_t, unsigned int";
    /// `cuMemFreeHost`.
    mem_free_host = ["cuMemFreeHost"] fn(*mut c_void) as "void*";
    /// `cuMemHostRegister`.
    mem_host_register = ["cuMemHostRegister_v2"] fn(*mut c_void, usize, c_uint) as "void*, size_t, unsigned int";
    /// `cuMemHostUnregister`.
    mem_host_unregister = ["cuMemHostUnregister"] fn(*mut c_void) as "void*";
    /// `cuMemcpyAsync` (unified addressing: either side host or device).
    memcpy_async = ["cuMemcpyAsync"] fn(CuDevicePtr, CuDevicePtr, usize, Handle)
        as "CUdeviceptr, CUdeviceptr, size_t, CUstream";
    /// `cuMemsetD8Async`.
    memset_d8_async = ["cuMemsetD8Async"] fn(CuDevicePtr, u8, usize, Handle)
        as "CUdeviceptr, unsigned char, size_t, CUstream";
    /// `cuPointerGetAttribute`.
    pointer_get_attribute = ["cuPointerGetAttribute"] fn(*mut c_void, c_int, CuDevicePtr)
        as "void*, CUpointer_attribute, CUdeviceptr";
    /// `cuStreamCreateWithPriority`.
    stream_create_with_priority = ["cuStreamCreateWithPriority"] fn(*mut Handle, c_uint, c_int)
        as "CUstream*, unsigned int, int";
    /// `cuStreamDestroy`.
    stream_destroy = ["cuStreamDestroy_v2"] fn(Handle) as "CUstream";
    /// `cuStreamQuery`.
    stream_query = ["cuStreamQuery"] fn(Handle) as "CUstream";
    /// `cuStreamSynchronize`.
    stream_synchronize = ["cuStreamSynchronize"] fn(Handle) as "CUstream";
    /// `cuStreamWaitEvent`.
    stream_wait_event = ["cuStreamWaitEvent"] fn(Handle, Handle, c_uint) as "CUstream, CUevent, unsigned int";
    /// `cuEventCreate`.
    event_create = ["cuEventCreate"] fn(*mut Handle, c_uint) as "CUevent*, unsigned int";
    /// `cuEventDestroy`.
    event_destroy = ["cuEventDestroy_v2"] fn(Handle) as "CUevent";
    /// `cuEventRecord`.
    event_record = ["cuEventRecord"] fn(Handle, Handle) as "CUevent, CUstream";
    /// `cuEventQuery`.
    event_query = ["cuEventQuery"] fn(Handle) as "CUevent";
    /// `cuEventSynchronize`.
    event_synchronize = ["cuEventSynchronize"] fn(Handle) as "CUevent";
    /// `cuEventElapsedTime` (`_v2` from CUDA 12.8, the plain name before).
    event_elapsed_time = ["cuEventElapsedTime_v2", "cuEventElapsedTime"] fn(*mut f32, Handle, Handle)
        as "float*, CUevent, CUevent";
    /// `cuModuleLoadData`.
    module_load_data = ["cuModuleLoadData"] fn(*mut Handle, *const c_void) as "CUmodule*, const void*";
    /// `cuModuleUnload`.
    module_unload = ["cuModuleUnload"] fn(Handle) as "CUmodule";
    /// `cuModuleGetFunction`.
    module_get_function = ["cuModuleGetFunction"] fn(*mut Handle, Handle, *const c_char)
        as "CUfunction*, CUmodule, const char*";
    /// `cuMemGetAllocationGranularity`.
    mem_get_allocation_granularity = ["cuMemGetAllocationGranularity"]
        fn(*mut usize, *const MemAllocationProp, c_int)
        as "size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags";
    /// `cuMemCreate`.
    mem_create = ["cuMemCreate"] fn(*mut u64, usize, *const MemAllocationProp, u64)
        as "CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long";
    /// `cuMemRelease`.
    mem_release = ["cuMemRelease"] fn(u64) as "CUmemGenericAllocationHandle";
    /// `cuMemExportToShareableHandle`.
    mem_export_to_shareable_handle = ["cuMemExportToShareableHandle"] fn(*mut c_void, u64, c_int, u64)
        as "void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long";
    /// `cuMemImportFromShareableHandle`.
    mem_import_from_shareable_handle = ["cuMemImportFromShareableHandle"] fn(*mut u64, *mut c_void, c_int)
        as "CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType";
    /// `cuMemAddressReserve`.
    mem_address_reserve = ["cuMemAddressReserve"] fn(*mut CuDevicePtr, usize, usize, CuDevicePtr, u64)
        as "CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long";
    /// `cuMemAddressFree`.
    mem_address_free = ["cuMemAddressFree"] fn(CuDevicePtr, usize) as "CUdeviceptr, size_t";
    /// `cuMemMap`.
    mem_map = ["cuMemMap"] fn(CuDevicePtr, usize, usize, u64, u64)
        as "CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long";
    /// `cuMemUnmap`.
    mem_unmap = ["cuMemUnmap"] fn(CuDevicePtr, usize) as "CUdeviceptr, size_t";
    /// `cuMemSetAccess`.
    mem_set_access = ["cuMemSetAccess"] fn(CuDevicePtr, usize, *const MemAccessDesc, usize)
        as "CUdeviceptr, size_t, const CUmemAccessDesc*, size_t";
    /// `cuIpcGetMemHandle`.
    ipc_get_mem_handle = ["cuIpcGetMemHandle"] fn(*mut IpcMemHandle, CuDevicePtr)
        as "CUipcMemHandle*, CUdeviceptr";
    /// `cuIpcOpenMemHandle` (`_v2` in current drivers, the plain name in older ones).
    ipc_open_mem_handle = ["cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"]
        fn(*mut CuDevicePtr, IpcMemHandle, c_uint) as "CUdeviceptr*, CUipcMemHandle, unsigned int";
    /// `cuIpcCloseMemHandle`.
    ipc_close_mem_handle = ["cuIpcCloseMemHandle"] fn(CuDevicePtr) as "CUdeviceptr";
    /// `cuMemsetD8`.
    memset_d8 = ["cuMemsetD8_v2"] fn(CuDevicePtr, u8, usize) as "CUdeviceptr, unsigned char, size_t";
    /// `cuStreamBeginCapture` (`_v2` takes the capture mode).
    stream_begin_capture = ["cuStreamBeginCapture_v2"] fn(Handle, c_int) as "CUstream, CUstreamCaptureMode";
    /// `cuStreamIsCapturing`.
    stream_is_capturing = ["cuStreamIsCapturing"] fn(Handle, *mut c_int) as "CUstream, CUstreamCaptureStatus*";
    /// `cuStreamEndCapture`.
    stream_end_capture = ["cuStreamEndCapture"] fn(Handle, *mut Handle) as "CUstream, CUgraph*";
    /// `cuGraphInstantiateWithFlags`.
    graph_instantiate = ["cuGraphInstantiateWithFlags"] fn(*mut Handle, Handle, u64)
        as "CUgraphExec*, CUgraph, unsigned long long";
    /// `cuGraphLaunch`.
    graph_launch = ["cuGraphLaunch"] fn(Handle, Handle) as "CUgraphExec, CUstream";
    /// `cuGraphExecDestroy`.
    graph_exec_destroy = ["cuGraphExecDestroy"] fn(Handle) as "CUgraphExec";
    /// `cuGraphDestroy`.
    graph_destroy = ["cuGraphDestroy"] fn(Handle) as "CUgraph";
    /// `cuLaunchKernel`.
    launch_kernel = ["cuLaunchKernel"] fn(Handle, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint,
        Handle, *mut *mut c_void, *mut *mut c_void)
        as "CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int, \
            unsigned int, CUstream, void**, void**";
}

fn resolve<T: Copy>(library: &Library, names: &[&str]) -> Result<T, String> {
    for name in names {
        // SAFETY: the symbol is a driver entry point whose C signature `T` mirrors (checked against
        // cuda.h by tests/driver_abi.rs); the pointer is kept only in `Api`, which keeps the library.
        if let Ok(symbol) = unsafe { library.get::<T>(name.as_bytes()) } {
            return Ok(*symbol);
        }
    }
    Err(format!(
        "{DRIVER_LIBRARY} has no {} (a driver older than CUDA 12?)",
        names.join(" or ")
    ))
}

/// The driver, loaded and initialised on first use; an error that starts "no CUDA driver" (no
/// library, or one without braid's entry points) or "no usable CUDA device" (`cuInit` failed, e.g.
/// without a GPU) when it cannot be had. The answer is kept for the life of the process.
pub fn api() -> Result<&'static Api, Error> {
    static API: OnceLock<Result<Api, Error>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Api, Error> {
    let no_driver = |message: String| Error::Io {
        context: "no CUDA driver".into(),
        message,
    };
    // SAFETY: loading libcuda runs only its initialisers, which every CUDA program runs too.
    let library = unsafe { Library::new(DRIVER_LIBRARY) }
        .map_err(|e| no_driver(format!("{DRIVER_LIBRARY} could not be loaded: {e}")))?;
    let api = Api::resolve(library).map_err(no_driver)?;
    // SAFETY: `cuInit(0)` takes no pointers; every CUDA program calls it first.
    let r = unsafe { (api.init)(0) };
    if r != CUDA_SUCCESS {
        return Err(Error::Io {
            context: "no usable CUDA device: cuInit failed".into(),
            message: describe(&api, r),
        });
    }
    Ok(api)
}

/// `NAME (code): text` for a driver result.
pub fn describe(api: &Api, r: CuResult) -> String {
    let text = |f: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult| {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: the driver writes a pointer to a static string (or leaves it null on an unknown code).
        let ok = unsafe { f(r, &mut p) } == CUDA_SUCCESS && !p.is_null();
        // SAFETY: a non-null answer is a NUL-terminated static string owned by the driver.
        ok.then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    match (text(api.get_error_name), text(api.get_error_string)) {
        (Some(name), Some(s)) => format!("{name} ({r}): {s}"),
        (Some(name), None) => format!("{name} ({r})"),
        _ => format!("CUDA error {r}"),
    }
}

/// `Ok` for `CUDA_SUCCESS`; otherwise an error naming `what` braid was doing and the driver's answer
/// (out of memory as [`Error::OutOfMemory`]).
pub fn check(api: &Api, r: CuResult, what: impl FnOnce() -> String) -> Result<(), Error> {
    match r {
        CUDA_SUCCESS => Ok(()),
        CUDA_ERROR_OUT_OF_MEMORY => Err(Error::OutOfMemory(format!(
            "{}: {}",
            what(),
            describe(api, r)
        ))),
        _ => Err(Error::Io {
            context: format!("CUDA {}", what()),
            message: describe(api, r),
        }),
    }
}
