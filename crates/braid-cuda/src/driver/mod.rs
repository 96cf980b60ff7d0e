//! The CUDA driver, safely: devices and their primary contexts ([`Gpu`]), device and pinned host memory,
//! streams with priorities, events, pointer attributes and modules. Every handle owns what it created
//! and frees it on drop (never panicking: a failure there is logged), holds its device's context alive,
//! and binds that context to the calling thread before each driver call, so handles may move between
//! threads. Without a driver or a GPU every constructor returns an error that says so.
//!
//! [`driver_available`] answers whether the library is there without calling into it.
#![allow(unsafe_code)]

pub mod api;
mod device;
mod memory;
mod module;
mod stream;

pub use device::{choose_device, Gpu, RestoreContext, DEVICE_VARIABLE};
pub use memory::{pointer_kind, DeviceBuffer, HostRegistration, PinnedBuffer, PointerKind};
pub(crate) use module::launch_raw;
pub use module::{Function, Module};
pub use stream::{Event, Graph, Priority, Stream};

use braid_core::Error;
use libloading::Library;

/// The driver library's name, as the system loader finds it.
pub const DRIVER_LIBRARY: &str = "libcuda.so.1";

/// `Ok` when `libcuda.so.1` loads and exports `cuInit`; otherwise an error that starts "no CUDA
/// driver" and gives the loader's reason. Nothing in the driver is called (no `cuInit`), so this is
/// safe to ask on any machine.
pub fn driver_available() -> Result<(), Error> {
    let no_driver = |message: String| Error::Io {
        context: "no CUDA driver".into(),
        message,
    };
    // SAFETY: loading libcuda runs only its initialisers, which every CUDA program runs too; none of
    // its functions is called here.
    let library = unsafe { Library::new(DRIVER_LIBRARY) }
        .map_err(|e| no_driver(format!("{DRIVER_LIBRARY} could not be loaded: {e}")))?;
    // SAFETY: the symbol is only looked up, never called, and not kept past `library`.
    let init = unsafe { library.get::<unsafe extern "C" fn(u32) -> i32>(b"cuInit\0") };
    init.map(|_| ())
        .map_err(|e| no_driver(format!("{DRIVER_LIBRARY} has no cuInit: {e}")))
}
