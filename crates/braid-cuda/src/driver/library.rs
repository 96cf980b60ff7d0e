//! Whether the driver library is there: its name, and a check that loads it without calling into it.

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
