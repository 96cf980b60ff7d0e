//! `braid perf --device`: the device communicator and buffers the benchmark runs on.
//!
//! - `cuda`: the rank's GPU (local rank → device, `BRAID_CUDA_DEVICE` overrides) through
//!   `Communicator::cuda_device` (rings in GPU memory, the CUDA engine, and the device-resident
//!   all-reduce where every rank can take it), and `cuMemAlloc` buffers.
//! - `emulated`: braid-transport's `EmulatedDevice` (host memory shared by descriptor, marked as device
//!   memory) and braid-exec's `EmulatedDeviceEngine`, for machines without a GPU: the same setup,
//!   transport and schedules, kernels on the CPU.

use std::sync::Arc;

use braid::{Communicator, DeviceCommunicator, Error};
use braid_transport::{DeviceAllocation, DeviceMemory, EmulatedDevice, Span};

/// Where `braid perf` puts its buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Host memory and the communicator's own collectives.
    Host,
    /// Emulated device memory (see the module docs).
    Emulated,
    /// CUDA device memory.
    Cuda,
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "host" => Ok(Device::Host),
            "emulated" => Ok(Device::Emulated),
            "cuda" => Ok(Device::Cuda),
            other => Err(format!(
                "unknown device {other:?}: host, cuda or emulated (device memory emulated in host memory)"
            )),
        }
    }
}

/// A buffer of device memory the benchmark fills and reads.
pub trait DeviceBuf {
    /// The first `len` bytes, as a device span.
    fn span(&self, len: usize) -> Span;
    /// Copies `bytes` in at offset 0.
    fn write(&mut self, bytes: &[u8]) -> Result<(), Error>;
    /// Copies `out.len()` bytes out from `at`.
    fn read(&self, at: usize, out: &mut [u8]) -> Result<(), Error>;
}

/// Makes a device buffer of at least the given bytes.
type Allocator = Box<dyn Fn(usize) -> Result<Box<dyn DeviceBuf>, Error>>;

/// The device communicator and a way to make buffers for it.
pub struct DeviceSide {
    pub comm: DeviceCommunicator,
    alloc: Allocator,
    /// What the header names (`cuda device 0 (NVIDIA H200)`, `emulated device memory`).
    pub describe: String,
}

impl DeviceSide {
    /// A buffer of at least `bytes`.
    pub fn buffer(&self, bytes: usize) -> Result<Box<dyn DeviceBuf>, Error> {
        (self.alloc)(bytes)
    }
}

/// Sets up `device` (not [`Device::Host`]) for this rank of `comm`; every rank calls it.
pub fn open(comm: &Communicator, device: Device) -> Result<DeviceSide, Error> {
    match device {
        Device::Host => Err(Error::invalid("host memory needs no device side")),
        Device::Emulated => {
            let memory = EmulatedDevice::new(0);
            let dev = comm.device(
                Arc::new(memory),
                Box::new(braid_exec::EmulatedDeviceEngine::new(0, 1)),
            )?;
            Ok(DeviceSide {
                comm: dev,
                alloc: Box::new(move |bytes| {
                    let size = bytes.max(1).next_multiple_of(memory.granularity());
                    let (alloc, _fd) = memory.allocate(size)?;
                    Ok(Box::new(EmulatedBuf { alloc }) as Box<dyn DeviceBuf>)
                }),
                describe: "emulated device memory".into(),
            })
        }
        Device::Cuda => {
            let dev = comm.cuda_device(None)?;
            let gpu = dev.gpu().cloned().ok_or_else(|| {
                Error::Internal("a CUDA device communicator without its GPU".into())
            })?;
            let describe = format!(
                "cuda device {} ({}), all-reduce {}",
                gpu.ordinal(),
                gpu.name()?,
                if dev.resident() {
                    "device-resident"
                } else {
                    "host-driven"
                }
            );
            Ok(DeviceSide {
                comm: dev,
                alloc: Box::new(move |bytes| {
                    Ok(Box::new(CudaBuf(braid_cuda::DeviceBuffer::alloc(
                        &gpu,
                        bytes.max(1),
                    )?)) as Box<dyn DeviceBuf>)
                }),
                describe,
            })
        }
    }
}

struct EmulatedBuf {
    alloc: Box<dyn DeviceAllocation>,
}

impl EmulatedBuf {
    fn bytes(&self) -> *mut u8 {
        self.alloc.addr() as *mut u8
    }
}

impl DeviceBuf for EmulatedBuf {
    fn span(&self, len: usize) -> Span {
        let len = len.min(self.alloc.len());
        // SAFETY: the allocation lives as long as the buffer, which outlives every collective on it.
        unsafe { Span::device(self.alloc.addr(), len, 0) }
    }
    fn write(&mut self, bytes: &[u8]) -> Result<(), Error> {
        if bytes.len() > self.alloc.len() {
            return Err(Error::invalid("writing past an emulated device buffer"));
        }
        // SAFETY: emulated device memory is host memory mapped in this process; no collective runs on
        // it now; the length is checked above.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.bytes(), bytes.len()) };
        Ok(())
    }
    fn read(&self, at: usize, out: &mut [u8]) -> Result<(), Error> {
        if at
            .checked_add(out.len())
            .is_none_or(|e| e > self.alloc.len())
        {
            return Err(Error::invalid("reading past an emulated device buffer"));
        }
        // SAFETY: as in `write`, for the checked range.
        unsafe { std::ptr::copy_nonoverlapping(self.bytes().add(at), out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}

struct CudaBuf(braid_cuda::DeviceBuffer);

impl DeviceBuf for CudaBuf {
    fn span(&self, len: usize) -> Span {
        let s = self.0.span();
        s.sub(0, len.min(s.len())).unwrap_or(s)
    }
    fn write(&mut self, bytes: &[u8]) -> Result<(), Error> {
        self.0.write(0, bytes)
    }
    fn read(&self, at: usize, out: &mut [u8]) -> Result<(), Error> {
        self.0.read(at, out)
    }
}
