//! Streams (owned or borrowed from the caller) and events, with waits that end at a deadline.

use std::ffi::c_uint;
use std::time::{Duration, Instant};

use braid_core::Error;

use super::api::{self, check, Handle, CUDA_ERROR_NOT_READY, CUDA_SUCCESS};
use super::device::Gpu;

/// A stream's priority.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    /// The device's default (lowest) priority.
    Normal,
    /// The device's highest priority: its ready work is scheduled before normal streams' (what
    /// communication streams use, so gradients move while the backward pass computes).
    High,
}

/// A CUDA stream: one created here (non-blocking, destroyed on drop) or the caller's (borrowed).
pub struct Stream {
    gpu: Gpu,
    raw: Handle,
    owned: bool,
    priority: i32,
}

// SAFETY: stream handles may be used from any thread that binds the context, which every method does.
unsafe impl Send for Stream {}
// SAFETY: the driver's stream operations are thread-safe.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new non-blocking stream on `gpu` with `priority`.
    pub fn new(gpu: &Gpu, priority: Priority) -> Result<Stream, Error> {
        let (least, greatest) = gpu.stream_priorities()?;
        let value = match priority {
            Priority::Normal => least,
            Priority::High => greatest,
        };
        let api = gpu.api();
        let mut raw: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current (bound by `stream_priorities`).
        let r =
            unsafe { (api.stream_create_with_priority)(&mut raw, api::STREAM_NON_BLOCKING, value) };
        check(api, r, || format!("cuStreamCreateWithPriority({value})"))?;
        Ok(Stream {
            gpu: gpu.clone(),
            raw,
            owned: true,
            priority: value,
        })
    }

    /// The caller's stream `raw` (a `CUstream`/`cudaStream_t`; null is the legacy default stream),
    /// used but never destroyed.
    ///
    /// # Safety
    /// `raw` must be a stream of `gpu`'s primary context (or null) and outlive the returned value.
    pub unsafe fn borrowed(gpu: &Gpu, raw: *mut std::ffi::c_void) -> Stream {
        Stream {
            gpu: gpu.clone(),
            raw,
            owned: false,
            priority: 0,
        }
    }

    /// The raw handle, for launches and copies.
    pub fn raw(&self) -> Handle {
        self.raw
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The numeric priority it was created with (0 for a borrowed stream).
    pub fn priority(&self) -> i32 {
        self.priority
    }

    /// Whether every operation queued so far has finished.
    pub fn is_done(&self) -> Result<bool, Error> {
        self.gpu.bind()?;
        let api = self.gpu.api();
        // SAFETY: a live stream handle.
        ready(
            api,
            unsafe { (api.stream_query)(self.raw) },
            "cuStreamQuery",
        )
    }

    /// Waits until every operation queued so far has finished, or fails once `until` passes.
    pub fn synchronize(&self, until: Instant) -> Result<(), Error> {
        poll_until(until, "a CUDA stream", || self.is_done())
    }

    /// Makes later work on this stream wait for `event` (on the device: the host does not block).
    pub fn wait_event(&self, event: &Event) -> Result<(), Error> {
        self.gpu.bind()?;
        let api = self.gpu.api();
        // SAFETY: live stream and event handles of one context.
        let r = unsafe { (api.stream_wait_event)(self.raw, event.raw, 0) };
        check(api, r, || "cuStreamWaitEvent".into())
    }

    /// Makes later work on this stream wait, on the device, until the 32-bit word at device address
    /// `addr` reaches `value` (`(int32_t)(*addr - value) >= 0`, so the count may wrap).
    ///
    /// # Safety
    /// `addr` must stay a valid device-mapped word until the wait has passed.
    pub unsafe fn wait_value32(&self, addr: u64, value: u32) -> Result<(), Error> {
        self.gpu.bind()?;
        let api = self.gpu.api();
        // SAFETY: the caller's contract for `addr`; a live stream.
        let r =
            unsafe { (api.stream_wait_value32)(self.raw, addr, value, api::STREAM_WAIT_VALUE_GEQ) };
        check(api, r, || "cuStreamWaitValue32".into())
    }

    /// Makes the device write `value` to the 32-bit word at device address `addr` once the work queued
    /// on this stream before it has finished.
    ///
    /// # Safety
    /// `addr` must stay a valid device-mapped word until the write has happened, written by nothing
    /// else that could race with it.
    pub unsafe fn write_value32(&self, addr: u64, value: u32) -> Result<(), Error> {
        self.gpu.bind()?;
        let api = self.gpu.api();
        // SAFETY: the caller's contract for `addr`; a live stream; flags 0 (default ordering).
        let r = unsafe { (api.stream_write_value32)(self.raw, addr, value, 0) };
        check(api, r, || "cuStreamWriteValue32".into())
    }

    /// Queues `len` bytes from `src` to `dst` (device or pinned host addresses under unified
    /// addressing).
    ///
    /// # Safety
    /// Both ranges must be valid for the copy until it completes on this stream, and `dst` must not
    /// be read or written by anything else meanwhile.
    pub unsafe fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), Error> {
        if len == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let api = self.gpu.api();
        // SAFETY: the caller's contract.
        let r = unsafe { (api.memcpy_async)(dst, src, len, self.raw) };
        check(api, r, || format!("cuMemcpyAsync of {len} bytes"))
    }

    /// Queues setting `len` bytes at `dst` to `value`.
    ///
    /// # Safety
    /// As for [`Stream::copy`], for `dst`.
    pub unsafe fn fill(&self, dst: u64, value: u8, len: usize) -> Result<(), Error> {
        if len == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let api = self.gpu.api();
        // SAFETY: the caller's contract.
        let r = unsafe { (api.memset_d8_async)(dst, value, len, self.raw) };
        check(api, r, || format!("cuMemsetD8Async of {len} bytes"))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let api = self.gpu.api();
        // Destroying a stream with work queued is allowed: the driver releases it once the work ends.
        let done = self.gpu.bind().and_then(|()| {
            // SAFETY: a stream this value created, destroyed once.
            check(api, unsafe { (api.stream_destroy)(self.raw) }, || {
                "cuStreamDestroy".into()
            })
        });
        if let Err(e) = done {
            tracing::warn!("{e}");
        }
    }
}

/// A CUDA event.
pub struct Event {
    gpu: Gpu,
    raw: Handle,
}

// SAFETY: event handles may be used from any thread that binds the context, which every method does.
unsafe impl Send for Event {}
// SAFETY: the driver's event operations are thread-safe.
unsafe impl Sync for Event {}

impl Event {
    /// A new event; `timing` makes [`Event::elapsed_ms`] available (at a small cost per record).
    pub fn new(gpu: &Gpu, timing: bool) -> Result<Event, Error> {
        gpu.bind()?;
        let api = gpu.api();
        let flags: c_uint = if timing {
            api::EVENT_DEFAULT
        } else {
            api::EVENT_DISABLE_TIMING
        };
        let mut raw: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current.
        check(api, unsafe { (api.event_create)(&mut raw, flags) }, || {
            "cuEventCreate".into()
        })?;
        Ok(Event {
            gpu: gpu.clone(),
            raw,
        })
    }

    /// Records the event at the current end of `stream`.
    pub fn record(&self, stream: &Stream) -> Result<(), Error> {
        self.gpu.bind()?;
        let api = self.gpu.api();
        // SAFETY: live event and stream handles.
        let r = unsafe { (api.event_record)(self.raw, stream.raw) };
        check(api, r, || "cuEventRecord".into())
    }

    /// Whether the work before the last record has finished (true for an event never recorded).
    pub fn is_done(&self) -> Result<bool, Error> {
        self.gpu.bind()?;
        let api = self.gpu.api();
        // SAFETY: a live event handle.
        ready(api, unsafe { (api.event_query)(self.raw) }, "cuEventQuery")
    }

    /// Waits for the event, or fails once `until` passes.
    pub fn synchronize(&self, until: Instant) -> Result<(), Error> {
        poll_until(until, "a CUDA event", || self.is_done())
    }

    /// Milliseconds from `start` to this event (both recorded with timing, both finished).
    pub fn elapsed_ms(&self, start: &Event) -> Result<f32, Error> {
        self.gpu.bind()?;
        let api = self.gpu.api();
        let mut ms = 0f32;
        // SAFETY: valid out-pointer and live events.
        let r = unsafe { (api.event_elapsed_time)(&mut ms, start.raw, self.raw) };
        check(api, r, || "cuEventElapsedTime".into())?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let api = self.gpu.api();
        let done = self.gpu.bind().and_then(|()| {
            // SAFETY: an event this value created, destroyed once (the driver defers the release of a
            // recorded event until it completes).
            check(api, unsafe { (api.event_destroy)(self.raw) }, || {
                "cuEventDestroy".into()
            })
        });
        if let Err(e) = done {
            tracing::warn!("{e}");
        }
    }
}

fn ready(api: &api::Api, r: api::CuResult, what: &str) -> Result<bool, Error> {
    match r {
        CUDA_SUCCESS => Ok(true),
        CUDA_ERROR_NOT_READY => Ok(false),
        _ => check(api, r, || what.into()).map(|()| false),
    }
}

/// Polls `done` (spinning briefly, then sleeping up to 100 µs between polls) until it says true, or
/// fails with a timeout error naming `what` once `until` passes.
pub(crate) fn poll_until(
    until: Instant,
    what: &str,
    mut done: impl FnMut() -> Result<bool, Error>,
) -> Result<(), Error> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if done()? {
            return Ok(());
        }
        let now = Instant::now();
        if now >= until {
            return Err(Error::Io {
                context: format!("waiting for {what}"),
                message: format!(
                    "the GPU work had not finished after {} ms",
                    now.duration_since(start).as_millis()
                ),
            });
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(100).min(until - now));
        }
    }
}

/// A CUDA graph captured from a stream ([`Stream::begin_capture`], [`Stream::end_capture`]),
/// instantiated and ready to launch; destroyed on drop.
pub struct Graph {
    gpu: Gpu,
    graph: Handle,
    exec: Handle,
}

// SAFETY: graph handles may be used from any thread that binds the context, which every method does.
unsafe impl Send for Graph {}

impl Stream {
    /// Starts capturing the work queued on this stream (thread-local capture mode) into a graph.
    pub fn begin_capture(&self) -> Result<(), Error> {
        self.gpu.bind()?;
        let api = self.gpu.api();
        // SAFETY: a live stream of the current context.
        let r =
            unsafe { (api.stream_begin_capture)(self.raw, api::STREAM_CAPTURE_MODE_THREAD_LOCAL) };
        check(api, r, || "cuStreamBeginCapture".into())
    }

    /// Whether work queued on this stream is being captured into a graph (rather than run).
    pub fn is_capturing(&self) -> Result<bool, Error> {
        self.gpu.bind()?;
        let api = self.gpu.api();
        let mut status: std::ffi::c_int = 0;
        // SAFETY: a live stream; valid out-pointer.
        let r = unsafe { (api.stream_is_capturing)(self.raw, &mut status) };
        check(api, r, || "cuStreamIsCapturing".into())?;
        Ok(status != api::STREAM_CAPTURE_STATUS_NONE)
    }

    /// Ends the capture begun by [`begin_capture`](Self::begin_capture) and instantiates the graph.
    pub fn end_capture(&self) -> Result<Graph, Error> {
        self.gpu.bind()?;
        let api = self.gpu.api();
        let mut graph: Handle = std::ptr::null_mut();
        // SAFETY: a live stream being captured; valid out-pointer.
        let r = unsafe { (api.stream_end_capture)(self.raw, &mut graph) };
        check(api, r, || "cuStreamEndCapture".into())?;
        let mut exec: Handle = std::ptr::null_mut();
        // SAFETY: the graph just captured; valid out-pointer.
        let r = unsafe { (api.graph_instantiate)(&mut exec, graph, 0) };
        if let Err(e) = check(api, r, || "cuGraphInstantiateWithFlags".into()) {
            // SAFETY: the graph was created above and is destroyed once, here.
            unsafe { (api.graph_destroy)(graph) };
            return Err(e);
        }
        Ok(Graph {
            gpu: self.gpu.clone(),
            graph,
            exec,
        })
    }
}

impl Graph {
    /// Queues one replay of the graph on `stream`.
    pub fn launch(&self, stream: &Stream) -> Result<(), Error> {
        self.gpu.bind()?;
        let api = self.gpu.api();
        // SAFETY: a live instantiated graph and a live stream of the same context.
        let r = unsafe { (api.graph_launch)(self.exec, stream.raw) };
        check(api, r, || "cuGraphLaunch".into())
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if self.gpu.bind().is_err() {
            return;
        }
        let api = self.gpu.api();
        // SAFETY: both handles were created by `end_capture` and are destroyed once, here.
        unsafe {
            (api.graph_exec_destroy)(self.exec);
            (api.graph_destroy)(self.graph);
        }
    }
}
