//! Gradient buckets: many small gradients fused into few all-reduces that start during the backward
//! pass, as PyTorch DDP's reducer and Horovod's tensor fusion do, for any framework.
//!
//! The caller registers its parameters (length and dtype of each, in the order the model lists them)
//! once. Each step it hands every gradient over as soon as backward has produced it
//! ([`GradientBuckets::mark_ready`]); the gradient is copied into its bucket, and a bucket whose
//! gradients are all in starts its all-reduce at once, on a high-priority stream (or, compressed, on a
//! helper thread), while backward goes on. [`GradientBuckets::finish`] waits for the last ones; the
//! results are then read per parameter ([`GradientBuckets::gradient`], [`GradientBuckets::unpack`]).
//!
//! - **Layout.** Buckets hold consecutive parameters of one dtype, in reverse registration order (the
//!   order backward usually produces them), at most `bucket_bytes` each (`BRAID_BUCKET_BYTES`, 25 MiB by
//!   default; the first bucket at most `first_bucket_bytes`, 1 MiB by default, so that communication starts
//!   early). A parameter larger than the cap has a bucket of its own.
//! - **Order.** Buckets start in bucket order on every rank, whatever order the gradients arrive in: a
//!   full bucket waits for the buckets before it. So the ranks issue the same collectives in the same
//!   order, and each rank may see its gradients in its own order.
//! - **Rebuild.** After the first step the buckets are rebuilt in the order the gradients actually
//!   arrived on rank 0 (broadcast once, so every rank builds the same layout), as DDP does. A compressed
//!   bucket's error feedback moves with its parameters (see `compressed/carry.rs`): the rebuild loses
//!   nothing error feedback remembers.
//! - **Compression.** With a [`CompressionConfig`], every bucket (f32 parameters only) goes through
//!   [`Communicator::all_reduce_compressed`] with its own [`GradientCompressor`]. Those calls run on a
//!   helper thread, one bucket after another in bucket order; from the first `mark_ready` of a step until
//!   `finish` returns, the communicator belongs to that thread: a collective from another thread then
//!   fails as two threads at once.
//! - **Missing gradients.** A parameter that was not marked ready by `finish` is an error that fails the
//!   step on every rank (its peers wait for a bucket this rank never starts), unless `unused_as_zero` is
//!   set, in which case it counts as a zero gradient (DDP's `find_unused_parameters`).

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use braid_core::{DType, Element, Error, ReduceOp};

use crate::call::Kind;
use crate::comm::OwnedBytes;
use crate::compressed::Carried;
use crate::{
    Communicator, CompressedReport, CompressionConfig, GradientCompressor, Priority, SharedBuffer,
    Work,
};

/// How a [`GradientBuckets`] lays out and reduces its buckets.
#[derive(Clone, Debug)]
pub struct BucketOptions {
    /// Largest bucket, in bytes; `None` takes the communicator's `bucket_bytes` (`BRAID_BUCKET_BYTES`).
    pub bucket_bytes: Option<usize>,
    /// Largest first bucket (the last parameters, whose gradients come first), in bytes; at most
    /// `bucket_bytes`. Default 1 MiB.
    pub first_bucket_bytes: usize,
    /// The reduction (default [`ReduceOp::Avg`]); compressed buckets take `Sum` or `Avg`.
    pub op: ReduceOp,
    /// The stream the dense all-reduces run on; `None` takes the communicator's last stream. Its
    /// priority is set to [`Priority::High`].
    pub stream: Option<usize>,
    /// Compress every bucket with its own compressor of this configuration (f32 parameters only).
    pub compression: Option<CompressionConfig>,
    /// Rebuild the buckets in the observed order after the first step (default true).
    pub rebuild: bool,
    /// Count a parameter not marked ready by `finish` as a zero gradient instead of failing the step.
    pub unused_as_zero: bool,
    /// Keep dense buckets in memory every rank of the host maps ([`Communicator::alloc`]), so that
    /// their all-reduces run straight through it (default true; taken when every rank is on one host
    /// and there is no compression, private memory otherwise).
    pub shared: bool,
}

impl Default for BucketOptions {
    fn default() -> Self {
        BucketOptions {
            bucket_bytes: None,
            first_bucket_bytes: 1 << 20,
            op: ReduceOp::Avg,
            stream: None,
            compression: None,
            rebuild: true,
            unused_as_zero: false,
            shared: true,
        }
    }
}

/// The parameters of each bucket, in order: consecutive in `order`, one dtype per bucket, at most `cap`
/// bytes (`first_cap` for the first bucket) unless one parameter alone is larger. Pure.
pub(crate) fn plan(
    params: &[(usize, DType)],
    order: &[usize],
    cap: usize,
    first_cap: usize,
) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut bytes = 0usize;
    for &p in order {
        let (len, dtype) = params[p];
        let size = len.saturating_mul(dtype.size());
        // The bucket this parameter would join: the first one has its own cap.
        let limit = if buckets.len() == 1 { first_cap } else { cap };
        let fits = buckets
            .last()
            .is_some_and(|b| params[b[0]].1 == dtype && bytes.saturating_add(size) <= limit);
        if fits {
            bytes += size;
            if let Some(b) = buckets.last_mut() {
                b.push(p);
            }
        } else {
            buckets.push(vec![p]);
            bytes = size;
        }
    }
    buckets
}

/// Where a parameter's gradient lives: its bucket and its first byte there.
#[derive(Clone, Copy, Debug)]
struct Place {
    bucket: usize,
    offset: usize,
}

/// A bucket's fused gradients: private words (8-byte, so every dtype is aligned), or its range of the
/// dense buckets' one shared allocation (64-byte aligned; no two buckets' ranges overlap).
enum Storage {
    Own(Vec<u64>),
    Shared {
        arena: Arc<SharedBuffer>,
        at: usize,
        len: usize,
    },
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Own(v) => bytemuck::cast_slice(v),
            // SAFETY: `at + len` lies within the arena (checked when `lay_out` handed it out), which
            // stays mapped while this `Arc` lives; the range is this storage's alone (ranges of one
            // layout are disjoint, and the buckets of an older layout are gone before a new layout
            // hands its ranges out) and nothing makes slices of the whole arena.
            Storage::Shared { arena, at, len } => unsafe {
                std::slice::from_raw_parts(arena.as_ptr().add(*at), *len)
            },
        }
    }
}

impl OwnedBytes for Storage {
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Storage::Own(v) => bytemuck::cast_slice_mut(v),
            // SAFETY: as in `bytes`; the mapping is writable, and `&mut self` makes this the only
            // access to the range.
            Storage::Shared { arena, at, len } => unsafe {
                std::slice::from_raw_parts_mut(arena.as_ptr().add(*at) as *mut u8, *len)
            },
        }
    }
}

/// One bucket's layout and its state in the current step.
struct Bucket {
    params: Vec<usize>,
    dtype: DType,
    bytes: usize,
    /// The fused gradients; `None` while in flight, or after a failed step (made again, private, on
    /// the next use).
    buffer: Option<Storage>,
    /// Gradients still missing this step.
    pending: usize,
    /// The dense all-reduce in flight.
    work: Option<Work<Storage>>,
    /// The compressed all-reduce is on the helper thread.
    on_worker: bool,
    /// This bucket's compressor (compressed buckets; away while on the helper thread).
    compressor: Option<GradientCompressor>,
}

impl Bucket {
    fn words(&self) -> usize {
        self.bytes.div_ceil(8)
    }

    /// The bucket's bytes (a private buffer is made if it has none).
    fn buffer(&mut self) -> Result<&mut [u8], Error> {
        if self.buffer.is_none() {
            self.buffer = Some(Storage::Own(braid_core::alloc::filled(
                0u64,
                self.words(),
                "a gradient bucket",
            )?));
        }
        match self.buffer.as_mut() {
            Some(b) => Ok(&mut b.bytes_mut()[..self.bytes]),
            None => Err(Error::Internal("a bucket without its buffer".into())),
        }
    }
}

/// A compressed bucket's all-reduce, sent to the helper thread and back.
struct Job {
    bucket: usize,
    buffer: Vec<u64>,
    elems: usize,
    compressor: GradientCompressor,
    result: Option<Result<CompressedReport, Error>>,
}

/// The helper thread of compressed buckets.
struct Worker {
    jobs: Option<Sender<Box<Job>>>,
    done: Receiver<Box<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    fn start(comm: Communicator, op: ReduceOp) -> Result<Worker, Error> {
        let (jobs, todo) = mpsc::channel::<Box<Job>>();
        let (finished, done) = mpsc::channel::<Box<Job>>();
        let thread = std::thread::Builder::new()
            .name("braid-buckets".into())
            .spawn(move || {
                for mut job in todo {
                    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let grad =
                            &mut bytemuck::cast_slice_mut::<u64, f32>(&mut job.buffer)[..job.elems];
                        comm.all_reduce_compressed(grad, op, &mut job.compressor)
                    }));
                    job.result = Some(run.unwrap_or_else(|_| {
                        Err(Error::Internal(
                            "a compressed bucket's all-reduce panicked".into(),
                        ))
                    }));
                    if finished.send(job).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| {
                Error::Internal(format!("cannot start the buckets' helper thread: {e}"))
            })?;
        Ok(Worker {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the queue ends the thread after the bucket it is on (bounded by the timeout).
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Gradients fused into buckets whose all-reduces overlap the backward pass. See the
/// [module documentation](self).
pub struct GradientBuckets {
    comm: Communicator,
    options: BucketOptions,
    stream: usize,
    cap: usize,
    params: Vec<(usize, DType)>,
    places: Vec<Place>,
    buckets: Vec<Bucket>,
    /// The dense buckets' shared memory, one allocation sized for any layout, so that a rebuild
    /// reuses it.
    arena: Option<Arc<SharedBuffer>>,
    /// Which parameters were marked this step, and in which order.
    marked: Vec<bool>,
    order: Vec<usize>,
    /// The first bucket not yet started this step.
    next: usize,
    /// A failure of this step, reported by `finish`.
    failed: Option<Error>,
    steps: u64,
    rebuilt: bool,
    reports: Vec<Option<CompressedReport>>,
    worker: Option<Worker>,
}

impl std::fmt::Debug for GradientBuckets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradientBuckets")
            .field("params", &self.params.len())
            .field("buckets", &self.layout())
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

impl GradientBuckets {
    /// Buckets for parameters of the given `(length in elements, dtype)`, in the order the model lists
    /// them; every rank must pass the same list and options. Fails, naming the problem, on a stream
    /// that does not exist, a cap of 0, a compression configuration that is invalid, or compression of
    /// parameters that are not f32.
    pub fn new(
        comm: &Communicator,
        params: &[(usize, DType)],
        options: BucketOptions,
    ) -> Result<GradientBuckets, Error> {
        let cap = options.bucket_bytes.unwrap_or(comm.config().bucket_bytes);
        if cap == 0 || options.first_bucket_bytes == 0 {
            return Err(Error::invalid(
                "buckets: bucket_bytes and first_bucket_bytes must be at least 1",
            ));
        }
        let stream = options.stream.unwrap_or(comm.streams() - 1);
        if stream >= comm.streams() {
            return Err(Error::invalid(format!(
                "buckets: stream {stream} does not exist (the communicator has {}; set BRAID_STREAMS for \
                 more)",
                comm.streams()
            )));
        }
        if let Some(c) = &options.compression {
            c.validate()?;
            if !matches!(options.op, ReduceOp::Sum | ReduceOp::Avg) {
                return Err(Error::invalid(format!(
                    "buckets: compressed buckets reduce with sum or avg, not {}",
                    options.op
                )));
            }
            if c.layers.is_some() {
                return Err(Error::invalid(
                    "buckets: a compression configuration with layer shapes describes one tensor; \
                     buckets compress each bucket as one tensor (leave layers unset)",
                ));
            }
            if let Some(p) = params.iter().position(|(_, d)| *d != DType::F32) {
                return Err(Error::invalid(format!(
                    "buckets: compression takes f32 gradients; parameter {p} is {}",
                    params[p].1
                )));
            }
        } else if let Some(p) = params
            .iter()
            .position(|(_, d)| options.op.check_dtype(*d).is_err())
        {
            return Err(Error::invalid(format!(
                "buckets: {} does not apply to parameter {p}'s dtype {}",
                options.op, params[p].1
            )));
        }
        if let Some(p) = params
            .iter()
            .position(|(n, d)| n.checked_mul(d.size()).is_none())
        {
            return Err(Error::invalid(format!(
                "buckets: parameter {p} of {} elements is too large",
                params[p].0
            )));
        }
        if options.compression.is_none() {
            comm.set_stream_priority(stream, Priority::High)?;
        }
        let reversed: Vec<usize> = (0..params.len()).rev().collect();
        let mut b = GradientBuckets {
            comm: comm.handle(),
            stream,
            cap,
            params: params.to_vec(),
            places: Vec::new(),
            arena: None,
            buckets: Vec::new(),
            marked: vec![false; params.len()],
            order: Vec::with_capacity(params.len()),
            next: 0,
            failed: None,
            steps: 0,
            rebuilt: !options.rebuild,
            reports: Vec::new(),
            worker: None,
            options,
        };
        b.lay_out(&reversed, Vec::new())?;
        Ok(b)
    }

    /// Makes the buckets for `order`, with the compressors' carried states (empty: fresh ones).
    fn lay_out(
        &mut self,
        order: &[usize],
        carried: Vec<(Carried, Vec<(usize, usize)>)>,
    ) -> Result<(), Error> {
        let first = self.options.first_bucket_bytes.min(self.cap);
        let groups = plan(&self.params, order, self.cap, first);
        let mut places = vec![
            Place {
                bucket: 0,
                offset: 0
            };
            self.params.len()
        ];
        // Where each parameter sat in the carried states: (state, first element, length).
        let mut was: Vec<Option<(usize, usize)>> = vec![None; self.params.len()];
        for (s, (_, members)) in carried.iter().enumerate() {
            for &(p, at) in members {
                was[p] = Some((s, at));
            }
        }
        let mut buckets = Vec::with_capacity(groups.len());
        for (i, members) in groups.into_iter().enumerate() {
            let dtype = self.params[members[0]].1;
            let mut bytes = 0;
            let mut parts = Vec::new();
            for &p in &members {
                places[p] = Place {
                    bucket: i,
                    offset: bytes,
                };
                let len = self.params[p].0;
                if let Some((s, at)) = was[p] {
                    parts.push((&carried[s].0, at..at + len, bytes / 4));
                }
                bytes += len * dtype.size();
            }
            let compressor = match &self.options.compression {
                Some(c) => Some(GradientCompressor::carry_in(c.clone(), bytes / 4, &parts)?),
                None => None,
            };
            buckets.push(Bucket {
                pending: members.len(),
                params: members,
                dtype,
                bytes,
                buffer: None,
                work: None,
                on_worker: false,
                compressor,
            });
        }
        // Dense buckets in shared memory, allocated in bucket order (every rank lays out the same
        // buckets at the same point). A refusal is the same on every rank: then private memory.
        let comm = &self.comm;
        if self.options.shared
            && self.options.compression.is_none()
            && comm.world_size() > 1
            && comm.hosts().len() == 1
        {
            // One allocation for every bucket, with room for any layout's padding (each bucket
            // starts on a cache line, and there are at most as many buckets as parameters), so the
            // rebuild reuses it. Every rank lays out the same buckets, so every rank takes the
            // same branch here.
            let need = buckets.iter().try_fold(0usize, |sum, b| {
                sum.checked_add(b.bytes.checked_next_multiple_of(64)?)
            });
            let total = self.params.iter().try_fold(64usize, |sum, &(n, d)| {
                sum.checked_add(n.checked_mul(d.size())?)?.checked_add(64)
            });
            let arena = match (need, total) {
                (Some(need), Some(total)) => match &self.arena {
                    Some(a) if a.len() >= need => Ok(a.clone()),
                    _ => comm.alloc(total.max(need)).map(Arc::new),
                },
                _ => Err(Error::OutOfMemory(
                    "the gradient buckets need more bytes than an address holds".into(),
                )),
            };
            // Each bucket's range, checked against the arena (the same on every rank).
            let ranges = arena.and_then(|arena| {
                let mut at = 0usize;
                let mut ranges = Vec::with_capacity(buckets.len());
                for b in &buckets {
                    let end = at.checked_add(b.bytes).filter(|&e| e <= arena.len());
                    let Some(end) = end else {
                        return Err(Error::Internal(format!(
                            "a gradient bucket of {} bytes at {at} does not fit its {} bytes of \
                             shared memory",
                            b.bytes,
                            arena.len()
                        )));
                    };
                    ranges.push(at);
                    at = end.next_multiple_of(64);
                }
                Ok((arena, ranges))
            });
            match ranges {
                Ok((arena, ranges)) => {
                    for (b, at) in buckets.iter_mut().zip(ranges) {
                        b.buffer = Some(Storage::Shared {
                            arena: arena.clone(),
                            at,
                            len: b.bytes,
                        });
                    }
                    self.arena = Some(arena);
                }
                Err(e) => {
                    tracing::debug!(rank = comm.rank(), "buckets in private memory: {e}");
                }
            }
        }
        self.places = places;
        self.buckets = buckets;
        Ok(())
    }

    /// The parameters as registered: `(length in elements, dtype)`.
    pub fn params(&self) -> &[(usize, DType)] {
        &self.params
    }

    /// The parameters of each bucket, in bucket (launch) order.
    pub fn layout(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.params.clone()).collect()
    }

    /// Whether the buckets have been rebuilt in the observed order (or rebuilding is off).
    pub fn rebuilt(&self) -> bool {
        self.rebuilt
    }

    /// Steps finished so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The stream the dense all-reduces run on.
    pub fn stream(&self) -> usize {
        self.stream
    }

    /// The compressed all-reduces' reports of the last step, one per bucket in that step's layout (empty
    /// without compression).
    pub fn reports(&self) -> Vec<CompressedReport> {
        self.reports.iter().flatten().cloned().collect()
    }

    /// Each bucket's compressor (empty without compression), for its statistics and error buffers.
    pub fn compressors(&self) -> Vec<&GradientCompressor> {
        self.buckets
            .iter()
            .filter_map(|b| b.compressor.as_ref())
            .collect()
    }

    fn check_param(&self, param: usize, dtype: DType, len: usize) -> Result<Place, Error> {
        let Some(&(want, d)) = self.params.get(param) else {
            return Err(Error::invalid(format!(
                "buckets: parameter {param} does not exist ({} were registered)",
                self.params.len()
            )));
        };
        if d != dtype || want != len {
            return Err(Error::invalid(format!(
                "buckets: parameter {param} is {want} elements of {d}; got {len} of {dtype}"
            )));
        }
        Ok(self.places[param])
    }

    /// Hands over parameter `param`'s gradient for this step (copied into its bucket); starts every
    /// bucket that is now complete and whose predecessors have started. Fails, changing nothing, if the
    /// parameter does not exist, the gradient's length or type differs from the registered one, or it
    /// was already marked this step.
    pub fn mark_ready<T: Element>(&mut self, param: usize, grad: &[T]) -> Result<(), Error> {
        self.mark_ready_bytes(param, bytemuck::cast_slice(grad), T::DTYPE)
    }

    /// [`GradientBuckets::mark_ready`] for a gradient given as bytes of `dtype` elements.
    pub fn mark_ready_bytes(
        &mut self,
        param: usize,
        grad: &[u8],
        dtype: DType,
    ) -> Result<(), Error> {
        if grad.len() % dtype.size() != 0 {
            return Err(Error::invalid(format!(
                "buckets: a gradient of {} bytes is not a whole number of {dtype} elements",
                grad.len()
            )));
        }
        let place = self.check_param(param, dtype, grad.len() / dtype.size())?;
        if self.marked[param] {
            return Err(Error::invalid(format!(
                "buckets: parameter {param} was already marked ready this step"
            )));
        }
        let bucket = &mut self.buckets[place.bucket];
        if bucket.on_worker || bucket.work.is_some() {
            return Err(Error::Internal(format!(
                "buckets: bucket {} is in flight with a gradient missing",
                place.bucket
            )));
        }
        let buffer = bucket.buffer()?;
        buffer[place.offset..place.offset + grad.len()].copy_from_slice(grad);
        bucket.pending -= 1;
        self.marked[param] = true;
        self.order.push(param);
        self.launch_ready();
        Ok(())
    }

    /// Starts every complete bucket from the first one not yet started, in order.
    fn launch_ready(&mut self) {
        while self.next < self.buckets.len() && self.buckets[self.next].pending == 0 {
            let i = self.next;
            self.next += 1;
            if let Err(e) = self.launch(i) {
                self.failed.get_or_insert(e);
            }
        }
    }

    fn launch(&mut self, i: usize) -> Result<(), Error> {
        let bucket = &mut self.buckets[i];
        bucket.buffer()?;
        let (Some(buffer), bytes, dtype) = (bucket.buffer.take(), bucket.bytes, bucket.dtype)
        else {
            return Err(Error::Internal("a bucket without its buffer".into()));
        };
        if let Some(compressor) = bucket.compressor.take() {
            let Storage::Own(buffer) = buffer else {
                return Err(Error::Internal(
                    "a compressed bucket in shared memory".into(),
                ));
            };
            if self.worker.is_none() {
                self.worker = Some(Worker::start(self.comm.handle(), self.options.op)?);
            }
            let job = Box::new(Job {
                bucket: i,
                buffer,
                elems: bytes / 4,
                compressor,
                result: None,
            });
            let sent = self
                .worker
                .as_ref()
                .and_then(|w| w.jobs.as_ref())
                .map(|j| j.send(job));
            match sent {
                Some(Ok(())) => self.buckets[i].on_worker = true,
                Some(Err(mpsc::SendError(job))) => {
                    self.buckets[i].compressor = Some(job.compressor);
                    return Err(Error::Internal(
                        "the buckets' helper thread has ended".into(),
                    ));
                }
                None => {
                    return Err(Error::Internal(
                        "the buckets' helper thread is missing".into(),
                    ))
                }
            }
            return Ok(());
        }
        let work = self.comm.submit_buffer_on(
            self.stream,
            Kind::AllReduce,
            dtype,
            self.options.op,
            buffer,
            bytes,
        )?;
        self.buckets[i].work = Some(work);
        Ok(())
    }

    /// Waits for every bucket of this step, then (after the first step) rebuilds the buckets in the
    /// observed order. Afterwards [`GradientBuckets::gradient`] gives the reduced gradients. A failed
    /// collective is returned (the communicator is then unusable, as after any such failure); a
    /// parameter not marked ready is an error too unless `unused_as_zero` is set.
    pub fn finish(&mut self) -> Result<(), Error> {
        let missing: Vec<usize> = (0..self.params.len())
            .filter(|p| !self.marked[*p])
            .collect();
        if !missing.is_empty() {
            if self.options.unused_as_zero {
                for &p in &missing {
                    let place = self.places[p];
                    let bytes = self.params[p].0 * self.params[p].1.size();
                    let bucket = &mut self.buckets[place.bucket];
                    match bucket.buffer() {
                        Ok(b) => b[place.offset..place.offset + bytes].fill(0),
                        Err(e) => {
                            self.failed.get_or_insert(e);
                        }
                    }
                    bucket.pending -= 1;
                    self.marked[p] = true;
                    self.order.push(p);
                }
                self.launch_ready();
            } else {
                let shown: Vec<String> = missing.iter().take(8).map(|p| p.to_string()).collect();
                let e = Error::invalid(format!(
                    "buckets: rank {}: {} parameter(s) were not marked ready this step ({}{}); their \
                     buckets never started, so the step fails on every rank (mark a parameter without a \
                     gradient with zeros, or set unused_as_zero)",
                    self.comm.rank(),
                    missing.len(),
                    shown.join(", "),
                    if missing.len() > 8 { ", ..." } else { "" }
                ));
                self.failed.get_or_insert(self.comm.one_sided(e));
            }
        }
        self.collect();
        let failed = self.failed.take();
        for b in &mut self.buckets {
            b.pending = b.params.len();
        }
        self.marked.fill(false);
        self.next = 0;
        let order = std::mem::take(&mut self.order);
        if let Some(e) = failed {
            return Err(e);
        }
        self.steps += 1;
        if !self.rebuilt {
            self.rebuild(order)?;
        }
        Ok(())
    }

    /// Waits for every bucket started this step and takes its buffer (and compressor) back.
    fn collect(&mut self) {
        for i in 0..self.buckets.len() {
            if let Some(work) = self.buckets[i].work.take() {
                match work.wait() {
                    Ok(buffer) => self.buckets[i].buffer = Some(buffer),
                    Err(e) => {
                        self.failed.get_or_insert(e);
                    }
                }
            }
        }
        let mut away = self.buckets.iter().filter(|b| b.on_worker).count();
        if away > 0 {
            self.reports = vec![None; self.buckets.len()];
        }
        let deadline = Instant::now() + self.comm.inner.streams_limit();
        let mut aborted = false;
        while away > 0 {
            let Some(worker) = &self.worker else { break };
            let wait = deadline.saturating_duration_since(Instant::now());
            match worker.done.recv_timeout(wait) {
                Ok(job) => {
                    away -= 1;
                    let b = &mut self.buckets[job.bucket];
                    b.on_worker = false;
                    b.buffer = Some(Storage::Own(job.buffer));
                    b.compressor = Some(job.compressor);
                    match job.result {
                        Some(Ok(r)) => self.reports[job.bucket] = Some(r),
                        Some(Err(e)) => {
                            self.failed.get_or_insert(e);
                        }
                        None => {
                            self.failed.get_or_insert(Error::Internal(
                                "a compressed bucket came back without a result".into(),
                            ));
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) if !aborted => {
                    // Its collective overran every deadline: abort, so that it ends with an error.
                    self.comm.abort();
                    aborted = true;
                }
                Err(_) => {
                    self.failed.get_or_insert(Error::Internal(
                        "a compressed bucket did not come back from the helper thread".into(),
                    ));
                    break;
                }
            }
        }
    }

    /// Rebuilds the buckets in rank 0's observed order (every rank gets it by broadcast), carrying the
    /// reduced gradients and every compressor's state over.
    fn rebuild(&mut self, order: Vec<usize>) -> Result<(), Error> {
        let mut wire: Vec<u32> = order.iter().map(|&p| p as u32).collect();
        if wire.len() != self.params.len() || self.params.len() > u32::MAX as usize {
            return Err(Error::Internal(format!(
                "buckets: {} parameters in the observed order of {}",
                wire.len(),
                self.params.len()
            )));
        }
        self.comm.broadcast_in_place(&mut wire, 0)?;
        let mut seen = vec![false; self.params.len()];
        for &p in &wire {
            match seen.get_mut(p as usize) {
                Some(s) if !*s => *s = true,
                _ => {
                    return Err(Error::Internal(format!(
                    "buckets: rank 0's observed order is not a permutation of the {} parameters",
                    self.params.len()
                )))
                }
            }
        }
        self.rebuilt = true;
        let order: Vec<usize> = wire.iter().map(|&p| p as usize).collect();
        let first = self.options.first_bucket_bytes.min(self.cap);
        if plan(&self.params, &order, self.cap, first) == self.layout() {
            return Ok(());
        }
        // The reduced gradients of this step move to the new layout too. The buckets in shared memory
        // are copied to private memory first, before anything changes (the copies are what may fail
        // here, for want of memory): the new layout reuses that memory for other buckets.
        let mut copies = Vec::with_capacity(self.buckets.len());
        for b in &self.buckets {
            copies.push(match &b.buffer {
                Some(shared @ Storage::Shared { .. }) => {
                    let bytes = shared.bytes();
                    let mut own = braid_core::alloc::filled(
                        0u64,
                        bytes.len().div_ceil(8),
                        "a gradient bucket",
                    )?;
                    bytemuck::cast_slice_mut(&mut own)[..bytes.len()].copy_from_slice(bytes);
                    Some(Storage::Own(own))
                }
                _ => None,
            });
        }
        let old_places = self.places.clone();
        let old = std::mem::take(&mut self.buckets);
        let mut buffers = Vec::with_capacity(old.len());
        let mut carried = Vec::new();
        for (mut b, copy) in old.into_iter().zip(copies) {
            if let Some(c) = b.compressor.take() {
                let at = b
                    .params
                    .iter()
                    .map(|&p| (p, old_places[p].offset / 4))
                    .collect();
                carried.push((c.carry_out(), at));
            }
            buffers.push(copy.or(b.buffer.take()));
        }
        self.lay_out(&order, carried)?;
        for (p, from) in old_places.into_iter().enumerate() {
            let bytes = self.params[p].0 * self.params[p].1.size();
            let to = self.places[p];
            let Some(src) = buffers[from.bucket].as_ref() else {
                continue;
            };
            let src = &src.bytes()[from.offset..from.offset + bytes];
            let dst = self.buckets[to.bucket].buffer()?;
            dst[to.offset..to.offset + bytes].copy_from_slice(src);
        }
        Ok(())
    }

    /// Parameter `param`'s reduced gradient after [`GradientBuckets::finish`] (before the first step,
    /// or after a failed one: zeros or the gradient as handed over). Fails if the parameter does not
    /// exist or is not of type `T`.
    pub fn gradient<T: Element>(&self, param: usize) -> Result<&[T], Error> {
        Ok(bytemuck::cast_slice(self.gradient_bytes(param, T::DTYPE)?))
    }

    /// Parameter `param`'s reduced gradient as bytes of `dtype` elements; see [`GradientBuckets::gradient`].
    pub fn gradient_bytes(&self, param: usize, dtype: DType) -> Result<&[u8], Error> {
        let len = self.params.get(param).map_or(0, |p| p.0);
        let place = self.check_param(param, dtype, len)?;
        let bytes = len * dtype.size();
        match &self.buckets[place.bucket].buffer {
            Some(b) => Ok(&b.bytes()[place.offset..place.offset + bytes]),
            None => Err(Error::invalid(format!(
                "buckets: parameter {param}'s bucket holds no result (its last step failed)"
            ))),
        }
    }

    /// Copies parameter `param`'s reduced gradient into `out` (as long as the parameter).
    pub fn unpack<T: Element>(&self, param: usize, out: &mut [T]) -> Result<(), Error> {
        let g = self.gradient::<T>(param)?;
        if g.len() != out.len() {
            return Err(Error::invalid(format!(
                "buckets: parameter {param} has {} elements; the output has {}",
                g.len(),
                out.len()
            )));
        }
        out.copy_from_slice(g);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn plans_keep_the_order_one_dtype_per_bucket_and_the_caps(
            params in prop::collection::vec((0usize..3000, prop::sample::select(DType::ALL.to_vec())), 0..40),
            cap in 1usize..20_000,
            first in 1usize..20_000,
            seed in any::<u64>(),
        ) {
            let mut order: Vec<usize> = (0..params.len()).collect();
            let mut z = seed;
            for i in (1..order.len()).rev() {
                z = z.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                order.swap(i, (z >> 33) as usize % (i + 1));
            }
            let first = first.min(cap);
            let buckets = plan(&params, &order, cap, first);
            let flat: Vec<usize> = buckets.iter().flatten().copied().collect();
            prop_assert_eq!(flat, order);
            for (i, b) in buckets.iter().enumerate() {
                prop_assert!(!b.is_empty());
                prop_assert!(b.iter().all(|&p| params[p].1 == params[b[0]].1));
                let bytes: usize = b.iter().map(|&p| params[p].0 * params[p].1.size()).sum();
                let limit = if i == 0 { first } else { cap };
                prop_assert!(b.len() == 1 || bytes <= limit, "bucket {} of {} bytes", i, bytes);
                // Greedy: the next bucket's first parameter would not have fitted.
                if let Some(next) = buckets.get(i + 1) {
                    let p = next[0];
                    let fits = params[p].1 == params[b[0]].1
                        && bytes + params[p].0 * params[p].1.size() <= limit;
                    prop_assert!(!fits);
                }
            }
        }
    }
}
