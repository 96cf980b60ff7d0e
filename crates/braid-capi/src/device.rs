//! Collectives on CUDA device memory through the C ABI.
//!
//! `braid_comm_use_cuda_device` (collective) gives a communicator a device: its GPU's kernels, a
//! high-priority engine stream, and the `ipc` transport's rings in GPU memory between the ranks of the
//! host (`Communicator::cuda_device`). From then on the collectives take a CUDA stream (`cudaStream_t`
//! as `void*`) with device pointers, and are ordered on it as NCCL's are. An all-reduce that runs
//! device-resident is one kernel launched on the caller's stream (captured, under CUDA graph capture);
//! the other collectives go through the worker: the call records an event on the caller's stream and
//! queues the collective for the device communicator's worker, which starts it once that event has
//! passed (the kernels that produced the input have finished); the call then makes the caller's stream
//! wait (`cuStreamWaitValue32`, on the device) for a counter in mapped pinned memory that the worker
//! sets when the collective has ended, and returns at once. The buffers must stay valid until the
//! stream has passed that point. A failure is reported by `braid_comm_get_async_error` (the counter is
//! set anyway, so the stream never waits forever). A NULL stream keeps the host path for host memory.
//! Pointers are told apart by CUDA's pointer attributes: a host pointer with a CUDA stream, a device
//! pointer with NULL, or memory of another device is an invalid argument that names the buffer.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use braid_cuda::{Event, Gpu, PinnedBuffer, PointerKind, RestoreContext, Stream};
use braid_rt::{DeviceCommunicator, DeviceGate, DeviceOp, DeviceSignal, Error};
use braid_transport::Span;
use parking_lot::Mutex;

use crate::guard::{guard, invalid};
use crate::region::Region;
use crate::{braid_comm, braid_result, comm_of};

/// A communicator's device.
pub(crate) struct Device {
    gpu: Gpu,
    pub(crate) comm: DeviceCommunicator,
    /// The counter callers' streams wait on.
    flag: Arc<Flag>,
}

/// A 32-bit counter in pinned memory mapped into the device: the worker sets it to a collective's
/// number when that collective has ended, and a caller's stream waits for it to reach that number.
struct Flag {
    word: PinnedBuffer,
    device_addr: u64,
    issued: AtomicU64,
}

impl Flag {
    fn word(&self) -> &AtomicU32 {
        // SAFETY: the buffer holds at least 4 bytes, 4-aligned (page-aligned allocation), alive while
        // `self` is; the host and the device access it only as a whole 32-bit word.
        unsafe { &*(self.word.as_ptr() as *const AtomicU32) }
    }

    /// The worker's collective `seq` has ended.
    fn set(&self, seq: u64) {
        self.word().store(seq as u32, Ordering::Release);
    }

    /// How many of the `issued` collectives have ended: the word holds the low 32 bits of the last one
    /// (set by the worker, or written by the device after a device-resident kernel), and fewer than
    /// 2^31 are ever outstanding.
    fn completed(&self, issued: u64) -> u64 {
        let behind = (issued as u32).wrapping_sub(self.word().load(Ordering::Acquire));
        issued.saturating_sub(u64::from(behind))
    }
}

/// Opens once an event recorded on the caller's stream has passed.
struct EventGate(Event);

impl DeviceGate for EventGate {
    fn wait(&mut self, until: Instant) -> Result<(), Error> {
        self.0.synchronize(until)
    }
}

/// Sets the counter to the collective's number, whatever its result.
struct FlagSignal {
    flag: Arc<Flag>,
    seq: u64,
}

impl DeviceSignal for FlagSignal {
    fn fire(self: Box<Self>, _result: &Result<(), Error>) {
        self.flag.set(self.seq);
    }
}

/// The first error of `comm`'s device collectives, if any.
pub(crate) fn async_error(comm: *mut braid_comm) -> Option<Error> {
    device_of(comm).and_then(|d| d.comm.async_error())
}

/// How many collectives with a CUDA stream the communicator has issued and how many have ended (on
/// the GPU or in failure): a binding keeps the buffers of the ones between alive. Without a device both
/// are 0.
///
/// # Safety
/// `issued` and `completed` are NULL or valid for writing a `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn braid_comm_cuda_progress(
    comm: *mut braid_comm,
    issued: *mut u64,
    completed: *mut u64,
) -> braid_result {
    guard("braid_comm_cuda_progress", || {
        comm_of(comm)?;
        let (i, c) = device_of(comm).map_or((0, 0), |d| {
            let issued = d.flag.issued.load(Ordering::Acquire);
            (issued, d.flag.completed(issued))
        });
        // SAFETY: each is NULL or writable (the caller's contract).
        unsafe {
            if !issued.is_null() {
                *issued = i;
            }
            if !completed.is_null() {
                *completed = c;
            }
        }
        Ok(())
    })
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
        let dev = c.cuda_device((device >= 0).then_some(device as usize))?;
        let gpu = dev
            .gpu()
            .cloned()
            .ok_or_else(|| Error::Internal("a CUDA device communicator without its GPU".into()))?;
        let word = PinnedBuffer::alloc_mapped(&gpu, 64)?;
        let flag = Arc::new(Flag {
            device_addr: word.device_addr()?,
            word,
            issued: AtomicU64::new(0),
        });
        DEVICES.lock().get_or_insert_with(HashMap::new).insert(
            comm as usize,
            Arc::new(Device {
                gpu,
                comm: dev,
                flag,
            }),
        );
        ANY_DEVICE.store(true, Ordering::Release);
        Ok(())
    })
}

/// A collective routed to a communicator's device: the device, the caller's stream, and the caller's
/// CUDA context, restored when the call ends.
pub(crate) struct DeviceCall {
    dev: Arc<Device>,
    caller: Stream,
    _restore: Option<RestoreContext>,
}

impl DeviceCall {
    /// Checks a buffer only some ranks pass (the root's) as `route` checks the others.
    pub(crate) fn check(&self, r: &Region, arg: &str) -> Result<(), Error> {
        check_kind(self.dev.gpu.ordinal(), r, arg)
    }

    /// Queues `op` ordered on the caller's stream (see the module docs) and returns at once.
    ///
    /// # Safety
    /// The op's buffers stay valid device memory until the caller's stream has passed this point.
    pub(crate) unsafe fn enqueue(&self, op: Result<DeviceOp, Error>) -> Result<(), Error> {
        let op = op?;
        let d = &self.dev;
        let seq = d.flag.issued.load(Ordering::Acquire) + 1;
        if d.comm.takes_resident(&op) && self.caller.is_capturing()? {
            // Captured into a CUDA graph: the kernel alone. A replay is a new collective (the kernel
            // keeps its epochs on the device); the flag is not involved, since a replayed write would
            // set it back to the captured count.
            // SAFETY: the caller's contract keeps the buffers as long as the graph may run.
            unsafe { d.comm.launch_on(&op, &self.caller)? };
            return Ok(());
        }
        if d.comm.takes_resident(&op) {
            // Device-resident: one kernel on the caller's stream, after every collective issued before
            // it has ended (they end in issue order, whatever stream they were issued on), then the
            // device itself counts it ended. Nothing for the worker to do.
            // SAFETY: the flag's mapped word outlives the communicator's use of the stream; the caller's
            // contract keeps the buffers until the stream has passed the kernel.
            unsafe {
                self.caller
                    .wait_value32(d.flag.device_addr, (seq - 1) as u32)?;
                d.comm.launch_on(&op, &self.caller)?;
                self.caller.write_value32(d.flag.device_addr, seq as u32)?;
            }
            d.flag.issued.store(seq, Ordering::Release);
            return Ok(());
        }
        // After every collective issued before it has ended (a device-resident one on another stream
        // too), so that the flag only grows.
        // SAFETY: the flag's mapped word outlives the communicator's use of the stream.
        unsafe {
            self.caller
                .wait_value32(d.flag.device_addr, (seq - 1) as u32)?
        };
        let ready = Event::new(&d.gpu, false)?;
        ready.record(&self.caller)?;
        let signal = FlagSignal {
            flag: d.flag.clone(),
            seq,
        };
        // SAFETY: the caller's contract keeps the buffers until the stream passes the wait below, which
        // is after the signal fires.
        unsafe {
            d.comm
                .enqueue(op, Box::new(EventGate(ready)), Box::new(signal))?
        };
        d.flag.issued.store(seq, Ordering::Release);
        // SAFETY: the flag's mapped word lives as long as the device, which outlives the communicator's
        // use of the stream (a destroyed communicator's worker finishes its queue first).
        unsafe { self.caller.wait_value32(d.flag.device_addr, seq as u32) }
    }
}

impl std::ops::Deref for DeviceCall {
    type Target = Device;
    fn deref(&self) -> &Device {
        &self.dev
    }
}

/// Decides where a collective of `comm` on `bufs` (region, argument name) runs, from `stream` and the
/// buffers' pointer attributes: `None` on the host, or the communicator's device with the caller's
/// stream.
pub(crate) fn route(
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
    for (r, arg) in bufs {
        check_kind(d.gpu.ordinal(), r, arg)?;
    }
    // SAFETY: the caller passes a stream of the device's primary context, alive during the call.
    let caller = unsafe { Stream::borrowed(&d.gpu, stream) };
    Ok(Some(DeviceCall {
        dev: d,
        caller,
        _restore: restore,
    }))
}

/// `r` must be memory of device `ordinal` (from cudaMalloc) for a collective with a CUDA stream.
fn check_kind(ordinal: u32, r: &Region, arg: &str) -> Result<(), Error> {
    if r.len == 0 {
        return Ok(());
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
    match bad {
        Some(m) => Err(invalid(m)),
        None => Ok(()),
    }
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
