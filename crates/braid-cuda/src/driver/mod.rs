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
mod library;
mod memory;
mod module;
mod stream;

pub use device::{choose_device, Gpu, RestoreContext, DEVICE_VARIABLE};
pub use library::{driver_available, DRIVER_LIBRARY};
pub use memory::{pointer_kind, DeviceBuffer, HostRegistration, PinnedBuffer, PointerKind};
pub(crate) use module::launch_raw;
pub use module::{Function, Module};
pub use stream::{Event, Graph, Priority, Stream};
