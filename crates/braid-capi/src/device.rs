//! Collectives on CUDA device memory through the C ABI.
//!
//! `braid_comm_use_cuda_device` (collective) gives a communicator a device: its GPU's kernels, a
//! high-priority engine stream, and the `ipc` transport's rings in GPU memory between the ranks of the
//! host. From then on the blocking collectives take a CUDA stream (`cudaStream_t` as `void*`) with
//! device pointers: the collective waits for the work queued on that stream so far (the kernels that
//! produced the input), runs on the engine's stream, and returns when it has finished, so work queued
//! on the caller's stream afterwards sees the result. A NULL stream keeps the host path for host memory.
//! Pointers are told apart by CUDA's pointer attributes: a host pointer with a CUDA stream, a device
//! pointer with NULL, or memory of another device is an invalid argument that names the buffer.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use braid_cuda::{Event, Gpu, PointerKind, RestoreContext, Stream};
use braid_rt::{Communicator, DeviceCommunicator, Error};
use braid_transport::{DeviceMemory, Span};
use parking_lot::Mutex;

use crate::collectives::Region;
use crate::guard::{guard, invalid};
use crate::{braid_comm, braid_result, comm_of};

/// A communicator's device.
pub(crate) struct Device {
    gpu: Gpu,
    pub(crate) comm: DeviceCommunicator,
}

/// The device of each communicator that has one, by handle.
static DEVICES: Mutex<Option<HashMap<usize, Arc<Device>>>> = Mutex::new(None);

/// Whether any communicator has ever had a device: until then a host call with a NULL stream looks
/// nothing up (the 8-byte path stays as it was).
static ANY_DEVICE: AtomicBool = AtomicBool::new(false);

fn device_of(comm: *mut braid_comm) -> Option<Arc<Device>> {
    DEVICES
        .lock()
        .as_ref()
        .and_then(|m| m.get(&(comm as usize)).cloned())
}

/// Forgets `comm`'s device (when the communicator is destroyed).
pub(crate) fn forget(comm: *mut braid_comm) {
    if let Some(m) = DEVICES.lock().as_mut() {
        m.remove(&(comm as usize));
    }
}

/// Gives `comm` CUDA device `device` (-1: the local rank's, `BRAID_CUDA_DEVICE` overriding) for
/// collectives on device memory. Every rank calls it; when any rank cannot (no driver, no GPU, a device
/// without virtual memory management), every rank returns an error and the communicator stays usable
/// on the host. Calling it again on a communicator that has a device is `BRAID_INVALID_ARGUMENT`.
///
/// # Safety
/// None beyond passing a handle value.
#[no_mangle]
pub unsafe extern "C" fn braid_comm_use_cuda_device(
    comm: *mut braid_comm,
    device: c_int,
) -> braid_result {
    guard("braid_comm_use_cuda_device", || {
        let c = comm_of(comm)?;
        let _restore = RestoreContext::save();
        if device < -1 {
            return Err(invalid(format!(
                "device {device}: pass a CUDA device ordinal, or -1 for the local rank's"
            )));
        }
        if let Some(d) = device_of(comm) {
            return Err(invalid(format!(
                "the communicator already uses CUDA device {}",
                d.gpu.ordinal()
            )));
        }
        let opened = open(&c, device);
        let (gpu, made) = match opened {
            Ok((gpu, memory, engine)) => (Some(gpu), Ok((memory, engine))),
            Err(e) => (None, Err(e)),
        };
        let dev = c.device_from(made)?;
        let gpu = gpu.ok_or_else(|| Error::Internal("a device without its GPU".into()))?;
        DEVICES
            .lock()
            .get_or_insert_with(HashMap::new)
            .insert(comm as usize, Arc::new(Device { gpu, comm: dev }));
        ANY_DEVICE.store(true, Ordering::Release);
        Ok(())
    })
}

type Opened = (Gpu, Arc<dyn DeviceMemory>, Box<dyn braid_exec::Engine>);

fn open(c: &Communicator, device: c_int) -> Result<Opened, Error> {
    let gpu = if device == -1 {
        let local = c
            .hosts()
            .iter()
            .find_map(|h| h.iter().position(|&r| r == c.rank()))
            .unwrap_or(0);
        Gpu::for_local_rank(local)?
    } else {
        Gpu::open(device as usize)?
    };
    let kernels = Arc::new(braid_cuda::ReduceCopyKernels::load(&gpu)?);
    let engine = braid_cuda::CudaEngine::new(kernels, braid_cuda::Priority::High)?;
    let memory = braid_cuda::CudaMemory::new(&gpu)?;
    Ok((gpu, Arc::new(memory), Box::new(engine)))
}

/// A collective routed to a communicator's device: the device, and the caller's CUDA context, restored
/// when the call ends.
pub(crate) struct DeviceCall {
    dev: Arc<Device>,
    _restore: Option<RestoreContext>,
}

impl std::ops::Deref for DeviceCall {
    type Target = Device;
    fn deref(&self) -> &Device {
        &self.dev
    }
}

/// Decides where a collective of `c` on `bufs` (region, argument name) runs, from `stream` and the
/// buffers' pointer attributes: `None` on the host, or the communicator's device, in which case the
/// work queued on the caller's stream so far has finished (waited for, bounded by the timeout).
pub(crate) fn route(
    c: &Communicator,
    comm: *mut braid_comm,
    stream: *mut c_void,
    bufs: &[(Region, &str)],
) -> Result<Option<DeviceCall>, Error> {
    if stream.is_null() && !ANY_DEVICE.load(Ordering::Acquire) {
        return Ok(None);
    }
    let dev = device_of(comm);
    if stream.is_null() {
        // Device pointers are looked for only where the communicator has a device (an attribute query
        // per buffer); without one the host path is as it always was.
        if let Some(d) = &dev {
            for (r, arg) in bufs {
                let on_device = r.len > 0
                    && matches!(
                        kind(r.ptr as usize)?,
                        PointerKind::Device { .. } | PointerKind::Managed { .. }
                    );
                if on_device {
                    return Err(invalid(format!(
                        "{arg} is memory of CUDA device {}, but stream is NULL (the host stream): pass the CUDA stream the data is ordered on",
                        d.gpu.ordinal()
                    )));
                }
            }
        }
        return Ok(None);
    }
    let restore = RestoreContext::save();
    let Some(d) = dev else {
        return Err(invalid(
            "stream: a CUDA stream was given, but the communicator has no device (call braid_comm_use_cuda_device first, or pass NULL for host memory)",
        ));
    };
    let ordinal = d.gpu.ordinal();
    for (r, arg) in bufs {
        if r.len == 0 {
            continue;
        }
        let bad = match kind(r.ptr as usize)? {
            PointerKind::Device { ordinal: o } if o == ordinal => None,
            PointerKind::Device { ordinal: o } => Some(format!(
                "{arg} is memory of CUDA device {o}; the communicator uses device {ordinal}"
            )),
            PointerKind::Managed { .. } => Some(format!(
                "{arg} is managed memory; collectives with a CUDA stream take memory from cudaMalloc"
            )),
            PointerKind::Host | PointerKind::PinnedHost => Some(format!(
                "{arg} is host memory, but stream is a CUDA stream: pass NULL as the stream for host memory"
            )),
        };
        if let Some(m) = bad {
            return Err(invalid(m));
        }
    }
    // The input was produced by work on the caller's stream: wait for it (bounded).
    // SAFETY: the caller passes a stream of the device's primary context, alive during the call.
    let caller = unsafe { Stream::borrowed(&d.gpu, stream) };
    let ready = Event::new(&d.gpu, false)?;
    ready.record(&caller)?;
    ready.synchronize(Instant::now() + c.config().timeout)?;
    Ok(Some(DeviceCall {
        dev: d,
        _restore: restore,
    }))
}

fn kind(addr: usize) -> Result<PointerKind, Error> {
    braid_cuda::pointer_kind(addr)
}

impl Device {
    /// `r` as a span of this device's memory.
    pub(crate) fn span(&self, r: &Region) -> Span {
        // SAFETY: checked to be memory of this device by `route`; the caller's contract keeps it valid
        // and untouched during the call.
        unsafe { Span::device(r.ptr as u64, r.len, self.gpu.ordinal()) }
    }
}
