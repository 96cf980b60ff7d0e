//! Loaded modules (CUBIN or PTX) and their kernels.

use std::ffi::{c_void, CString};

use braid_core::Error;

use super::api::{check, Handle};
use super::device::Gpu;
use super::stream::Stream;

/// A module loaded into a device's context, unloaded on drop.
pub struct Module {
    gpu: Gpu,
    raw: Handle,
}

// SAFETY: module handles may be used from any thread that binds the context, which every method does.
unsafe impl Send for Module {}
// SAFETY: looking up functions is thread-safe in the driver.
unsafe impl Sync for Module {}

impl Module {
    /// Loads `image`: a CUBIN (ELF) or PTX text (a terminating NUL is added when missing).
    pub fn load(gpu: &Gpu, image: &[u8]) -> Result<Module, Error> {
        if image.is_empty() {
            return Err(Error::invalid("a module image cannot be empty"));
        }
        let owned;
        let bytes = if image.starts_with(b"\x7fELF") || image.ends_with(&[0]) {
            image
        } else {
            owned = [image, &[0]].concat();
            &owned
        };
        gpu.bind()?;
        let api = gpu.api();
        let mut raw: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer; `bytes` is a whole CUBIN or NUL-terminated PTX, read during the
        // call only; the context is current.
        let r = unsafe { (api.module_load_data)(&mut raw, bytes.as_ptr().cast()) };
        check(api, r, || {
            format!("cuModuleLoadData ({} bytes)", image.len())
        })?;
        Ok(Module {
            gpu: gpu.clone(),
            raw,
        })
    }

    /// The kernel `name` (an `extern "C"` entry point).
    pub fn function(&self, name: &str) -> Result<Function<'_>, Error> {
        let c = CString::new(name)
            .map_err(|_| Error::invalid(format!("kernel name {name:?} contains a NUL byte")))?;
        self.gpu.bind()?;
        let api = self.gpu.api();
        let mut raw: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer, live module, NUL-terminated name.
        let r = unsafe { (api.module_get_function)(&mut raw, self.raw, c.as_ptr()) };
        check(api, r, || format!("cuModuleGetFunction({name})"))?;
        Ok(Function { module: self, raw })
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let api = self.gpu.api();
        let done = self.gpu.bind().and_then(|()| {
            // SAFETY: a module this value loaded, unloaded once; no `Function` outlives it (borrow).
            check(api, unsafe { (api.module_unload)(self.raw) }, || {
                "cuModuleUnload".into()
            })
        });
        if let Err(e) = done {
            tracing::warn!("{e}");
        }
    }
}

/// A kernel of a loaded module.
#[derive(Clone, Copy)]
pub struct Function<'m> {
    module: &'m Module,
    raw: Handle,
}

// SAFETY: a function handle is an immutable driver object, usable from any thread that binds the context.
unsafe impl Send for Function<'_> {}
// SAFETY: as above.
unsafe impl Sync for Function<'_> {}

impl Function<'_> {
    /// The raw `CUfunction`.
    pub(crate) fn raw(&self) -> Handle {
        self.raw
    }

    /// Queues the kernel on `stream` over `grid` blocks of `block` threads.
    ///
    /// # Safety
    /// `params` must hold one pointer per kernel parameter, each to a value of exactly that parameter's
    /// type, and every memory the kernel touches must stay valid until it completes on `stream`, with
    /// no conflicting access meanwhile.
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), Error> {
        // SAFETY: a function of a live module (borrowed); the caller's contract for the rest.
        unsafe { launch_raw(self.module.gpu(), self.raw, stream, grid, block, params) }
    }
}

/// `cuLaunchKernel` of `function` over `grid` × `block` threads on `stream`.
///
/// # Safety
/// `function` must be a kernel of a module loaded on `gpu` and still loaded, and [`Function::launch`]'s
/// contract holds for `params` and memory.
pub(crate) unsafe fn launch_raw(
    gpu: &Gpu,
    function: Handle,
    stream: &Stream,
    grid: u32,
    block: u32,
    params: &mut [*mut c_void],
) -> Result<(), Error> {
    if grid == 0 || block == 0 || block > 1024 {
        return Err(Error::invalid(format!(
            "a launch needs at least one block of 1 to 1024 threads (got {grid} × {block})"
        )));
    }
    gpu.bind()?;
    let api = gpu.api();
    // SAFETY: the caller's contract for the function, parameters and memory; a live stream.
    let r = unsafe {
        (api.launch_kernel)(
            function,
            grid,
            1,
            1,
            block,
            1,
            1,
            0,
            stream.raw(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    check(api, r, || format!("cuLaunchKernel({grid} × {block})"))
}
