//! Devices, the choice of one per rank, and their primary contexts.

use std::ffi::{c_char, c_int};
use std::sync::Arc;

use braid_core::Error;

use super::api::{self, api, check, Api, CuDevice, Handle};

/// The environment variable that overrides which device a rank uses: one ordinal for every rank of the
/// host, or a comma-separated list indexed by local rank (`BRAID_CUDA_DEVICE=2,3`).
pub const DEVICE_VARIABLE: &str = "BRAID_CUDA_DEVICE";

/// The device local rank `local_rank` uses among `count`: `setting` (the value of
/// [`DEVICE_VARIABLE`], if set) when given, else `local_rank % count` (ranks share devices round robin
/// when there are more ranks than devices). An error names the variable and what was wrong with it.
pub fn choose_device(
    local_rank: usize,
    count: usize,
    setting: Option<&str>,
) -> Result<usize, Error> {
    if count == 0 {
        return Err(Error::Io {
            context: "no usable CUDA device".into(),
            message: "the driver lists no device".into(),
        });
    }
    let Some(text) = setting.map(str::trim).filter(|t| !t.is_empty()) else {
        return Ok(local_rank % count);
    };
    let list: Vec<&str> = text.split(',').map(str::trim).collect();
    let pick = if list.len() == 1 {
        list[0]
    } else {
        list.get(local_rank).copied().ok_or_else(|| {
            Error::invalid(format!(
                "{DEVICE_VARIABLE}={text} names {} devices, one per local rank, but local rank {local_rank} has none",
                list.len()
            ))
        })?
    };
    let ordinal: usize = pick.parse().map_err(|_| {
        Error::invalid(format!(
            "{DEVICE_VARIABLE}={text}: {pick:?} is not a device ordinal"
        ))
    })?;
    if ordinal >= count {
        return Err(Error::invalid(format!(
            "{DEVICE_VARIABLE}={text}: device {ordinal} does not exist (this host has {count})"
        )));
    }
    Ok(ordinal)
}

/// A device's primary context, retained while any handle of the device lives.
pub(crate) struct Context {
    pub(crate) api: &'static Api,
    pub(crate) device: CuDevice,
    pub(crate) ordinal: u32,
    raw: Handle,
}

// SAFETY: a CUDA context handle may be used from any thread (the driver API is thread-safe; a thread
// makes it current before use, which `bind` does).
unsafe impl Send for Context {}
// SAFETY: as above; nothing in `Context` is mutated after creation.
unsafe impl Sync for Context {}

impl Context {
    /// Makes this context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<(), Error> {
        // SAFETY: `raw` is a retained primary context, valid while `self` lives.
        let r = unsafe { (self.api.ctx_set_current)(self.raw) };
        check(self.api, r, || {
            format!("cuCtxSetCurrent for device {}", self.ordinal)
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context was retained once by `Gpu::open`; this releases it once.
        let r = unsafe { (self.api.primary_ctx_release)(self.device) };
        if let Err(e) = check(self.api, r, || "cuDevicePrimaryCtxRelease".into()) {
            tracing::warn!("{e}");
        }
    }
}

/// The calling thread's current CUDA context, put back when this drops: braid binds its device's context
/// before each driver call, and a caller (a framework's thread) keeps the context it had.
pub struct RestoreContext {
    api: &'static Api,
    previous: Handle,
}

impl RestoreContext {
    /// Remembers the calling thread's current context (`None` without a driver: nothing to restore).
    pub fn save() -> Option<RestoreContext> {
        let api = api().ok()?;
        let mut previous: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let r = unsafe { (api.ctx_get_current)(&mut previous) };
        (r == api::CUDA_SUCCESS).then_some(RestoreContext { api, previous })
    }
}

impl Drop for RestoreContext {
    fn drop(&mut self) {
        // SAFETY: `previous` was current on this thread when saved (or null: no context), and a context
        // handle stays valid while some thread or retain holds it.
        let r = unsafe { (self.api.ctx_set_current)(self.previous) };
        if let Err(e) = check(self.api, r, || "restoring the caller's CUDA context".into()) {
            tracing::warn!("{e}");
        }
    }
}

// SAFETY: a context handle is a plain value; the guard is used and dropped on the thread that made it
// in practice, and cuCtxSetCurrent is valid on any thread.
unsafe impl Send for RestoreContext {}

/// One GPU, through its primary context (the one the CUDA runtime and PyTorch use, so memory and
/// streams are shared with them). Cheap to clone.
#[derive(Clone)]
pub struct Gpu {
    pub(crate) ctx: Arc<Context>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({})", self.ctx.ordinal)
    }
}

impl Gpu {
    /// How many devices the driver lists; an error when there is no driver or it cannot initialise.
    pub fn count() -> Result<usize, Error> {
        let api = api()?;
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer.
        check(api, unsafe { (api.device_get_count)(&mut n) }, || {
            "cuDeviceGetCount".into()
        })?;
        Ok(n.max(0) as usize)
    }

    /// Device `ordinal`, with its primary context retained.
    pub fn open(ordinal: usize) -> Result<Gpu, Error> {
        let api = api()?;
        let count = Gpu::count()?;
        if ordinal >= count {
            return Err(Error::invalid(format!(
                "CUDA device {ordinal} does not exist (this host has {count})"
            )));
        }
        let mut device: CuDevice = 0;
        // SAFETY: valid out-pointer; the ordinal is in range.
        let r = unsafe { (api.device_get)(&mut device, ordinal as c_int) };
        check(api, r, || format!("cuDeviceGet({ordinal})"))?;
        let mut raw: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device.
        let r = unsafe { (api.primary_ctx_retain)(&mut raw, device) };
        check(api, r, || {
            format!("cuDevicePrimaryCtxRetain for device {ordinal}")
        })?;
        let gpu = Gpu {
            ctx: Arc::new(Context {
                api,
                device,
                ordinal: ordinal as u32,
                raw,
            }),
        };
        gpu.ctx.bind()?;
        Ok(gpu)
    }

    /// The device local rank `local_rank` uses: [`choose_device`] with [`DEVICE_VARIABLE`] from the
    /// environment.
    pub fn for_local_rank(local_rank: usize) -> Result<Gpu, Error> {
        let setting = std::env::var(DEVICE_VARIABLE).ok();
        Gpu::open(choose_device(
            local_rank,
            Gpu::count()?,
            setting.as_deref(),
        )?)
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ctx.ordinal
    }

    pub(crate) fn api(&self) -> &'static Api {
        self.ctx.api
    }

    /// Makes this device's context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<(), Error> {
        self.ctx.bind()
    }

    /// A device attribute (`CU_DEVICE_ATTRIBUTE_*`, see [`api`]).
    pub fn attribute(&self, attribute: c_int) -> Result<i32, Error> {
        let api = self.api();
        let mut v: c_int = 0;
        // SAFETY: valid out-pointer and device.
        let r = unsafe { (api.device_get_attribute)(&mut v, attribute, self.ctx.device) };
        check(api, r, || format!("cuDeviceGetAttribute({attribute})"))?;
        Ok(v)
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> Result<String, Error> {
        let api = self.api();
        let mut buf = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated.
        let r =
            unsafe { (api.device_get_name)(buf.as_mut_ptr(), buf.len() as c_int, self.ctx.device) };
        check(api, r, || "cuDeviceGetName".into())?;
        let bytes: Vec<u8> = buf
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The compute capability, (major, minor).
    pub fn compute_capability(&self) -> Result<(u32, u32), Error> {
        Ok((
            self.attribute(api::ATTR_CC_MAJOR)? as u32,
            self.attribute(api::ATTR_CC_MINOR)? as u32,
        ))
    }

    /// The architecture number NVRTC takes: 90 for sm_90.
    pub fn arch(&self) -> Result<u32, Error> {
        let (major, minor) = self.compute_capability()?;
        Ok(10 * major + minor)
    }

    /// The number of streaming multiprocessors.
    pub fn multiprocessors(&self) -> Result<u32, Error> {
        Ok(self.attribute(api::ATTR_MULTIPROCESSOR_COUNT)?.max(1) as u32)
    }

    /// The PCI address, `domain:bus:device.0` in hex as sysfs spells it (`0000:3b:00.0`).
    pub fn pci_address(&self) -> Result<String, Error> {
        Ok(format!(
            "{:04x}:{:02x}:{:02x}.0",
            self.attribute(api::ATTR_PCI_DOMAIN_ID)?,
            self.attribute(api::ATTR_PCI_BUS_ID)?,
            self.attribute(api::ATTR_PCI_DEVICE_ID)?
        ))
    }

    /// Bytes of device memory.
    pub fn total_memory(&self) -> Result<usize, Error> {
        let api = self.api();
        let mut bytes = 0usize;
        // SAFETY: valid out-pointer and device.
        let r = unsafe { (api.device_total_mem)(&mut bytes, self.ctx.device) };
        check(api, r, || "cuDeviceTotalMem".into())?;
        Ok(bytes)
    }

    /// The stream priorities this device offers, (lowest, highest); numerically the highest priority
    /// is the smallest (e.g. (0, -5)).
    pub fn stream_priorities(&self) -> Result<(i32, i32), Error> {
        self.bind()?;
        let api = self.api();
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: valid out-pointers; the context is current.
        let r = unsafe { (api.ctx_get_stream_priority_range)(&mut least, &mut greatest) };
        check(api, r, || "cuCtxGetStreamPriorityRange".into())?;
        Ok((least, greatest))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_take_devices_round_robin_unless_told() {
        assert_eq!(choose_device(0, 8, None).unwrap(), 0);
        assert_eq!(choose_device(5, 8, None).unwrap(), 5);
        assert_eq!(choose_device(9, 8, None).unwrap(), 1);
        assert_eq!(choose_device(3, 1, None).unwrap(), 0);
        assert_eq!(choose_device(3, 4, Some("")).unwrap(), 3);
        assert_eq!(choose_device(3, 4, Some("2")).unwrap(), 2);
        assert_eq!(choose_device(1, 4, Some(" 3, 1 ")).unwrap(), 1);
        assert_eq!(choose_device(0, 4, Some("3,1")).unwrap(), 3);
    }

    #[test]
    fn a_bad_device_setting_names_the_variable_and_the_fault() {
        let err =
            |r: usize, n: usize, s: &str| choose_device(r, n, Some(s)).unwrap_err().to_string();
        assert!(
            err(0, 4, "four").contains("BRAID_CUDA_DEVICE=four: \"four\" is not a device ordinal")
        );
        assert!(err(0, 4, "4").contains("device 4 does not exist (this host has 4)"));
        assert!(err(2, 4, "0,1").contains("local rank 2 has none"));
        assert!(err(1, 4, "0,x").contains("\"x\" is not a device ordinal"));
        assert!(choose_device(0, 0, None)
            .unwrap_err()
            .to_string()
            .contains("no usable CUDA device"));
    }
}
