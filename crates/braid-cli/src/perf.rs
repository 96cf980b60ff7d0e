//! `braid perf`: a collective benchmark in nccl-tests' columns (all-reduce unless `--collective` names
//! another).
//!
//! Sizes and bus bandwidths follow nccl-tests: the size is the larger of a rank's send and receive
//! buffers (all-reduce, broadcast, reduce: the buffer; all-gather: the gathered output; reduce-scatter:
//! the input that is scattered; all-to-all: a rank's send buffer), rounded down to whole elements and, where
//! the collective splits it into one block per rank, to a multiple of ranks × element size; the count is
//! the per-rank element count the collective is called with. algbw is size / time; busbw scales it by
//! 2(n−1)/n (all-reduce), (n−1)/n (all-gather, reduce-scatter, all-to-all) or 1 (broadcast, reduce).
//! Rooted collectives use root 0.
//!
//! Inputs are small integers (or powers of two for prod), so the exact result is known whatever the
//! reduction order and `#wrong` counts real errors. Times are the slowest rank's average per iteration.
//! Alongside, rank 0 measures the memory-bandwidth bound of this machine: one process producing the same
//! bytes locally, `out = a + b` for the reductions and a copy for the others.

use std::time::Instant;

use braid::{Algo, Collective, Communicator, DType, Element, Error, ReduceOp};
use braid_core::exact::{fill, inputs, reduced, wrong};
use braid_core::reduce::{self, Src};
use serde::Serialize;

/// What to measure.
#[derive(Clone, Debug)]
pub struct PerfArgs {
    /// The collective measured (one of [`COLLECTIVES`]).
    pub collective: Collective,
    /// Smallest size in bytes.
    pub min_bytes: usize,
    /// Largest size in bytes.
    pub max_bytes: usize,
    /// Size multiplication factor between steps.
    pub factor: usize,
    /// Timed iterations per size.
    pub iters: usize,
    /// Warm-up iterations per size.
    pub warmup: usize,
    /// Element type.
    pub dtype: DType,
    /// Reduction (ignored by the collectives that do not reduce).
    pub op: ReduceOp,
    /// Whether to check each result against the exact one.
    pub check: bool,
    /// Where to write the results as JSON.
    pub json: Option<String>,
    /// `None`: braid chooses; a name forces it; `all` measures every algorithm of the collective.
    pub algo: Option<String>,
    /// Where to plot busbw against size.
    pub plot: Option<String>,
    /// Whether to register the send buffer for sends without a copy.
    pub register: bool,
    /// Whether the buffers are shared memory from [`Communicator::alloc`].
    pub shared: bool,
    /// Where the buffers live (host memory, or a device's through the device communicator).
    pub device: crate::device::Device,
}

/// The collectives `braid perf --device` measures on device memory.
const DEVICE_COLLECTIVES: [Collective; 5] = [
    Collective::AllReduce,
    Collective::Broadcast,
    Collective::Reduce,
    Collective::AllGather,
    Collective::ReduceScatter,
];

/// The collectives `braid perf` measures, in the order its errors list them.
pub const COLLECTIVES: [Collective; 6] = [
    Collective::AllReduce,
    Collective::Broadcast,
    Collective::Reduce,
    Collective::AllGather,
    Collective::ReduceScatter,
    Collective::AllToAll,
];

/// The root of broadcast and reduce, as in nccl-tests.
const ROOT: usize = 0;

/// Parses a `--collective` name (also the spellings [`Collective`] accepts, such as `allreduce`); an
/// unknown name, or one `braid perf` does not measure, is an error that lists the valid names.
pub fn parse_collective(s: &str) -> Result<Collective, String> {
    match s.parse::<Collective>() {
        Ok(c) if COLLECTIVES.contains(&c) => Ok(c),
        _ => {
            let names: Vec<&str> = COLLECTIVES.iter().map(|c| c.name()).collect();
            Err(format!(
                "--collective {s:?}: not a collective braid perf measures (valid: {})",
                names.join(", ")
            ))
        }
    }
}

/// Whether `c` combines the ranks' data with a reduction.
fn reduces(c: Collective) -> bool {
    matches!(
        c,
        Collective::AllReduce | Collective::Reduce | Collective::ReduceScatter
    )
}

/// Whether the communicator has an in-place form of `c`.
fn has_in_place(c: Collective) -> bool {
    c != Collective::AllToAll
}

/// nccl-tests' bus bandwidth factor of `c` on `world` ranks: busbw = algbw × factor.
pub fn busbw_factor(c: Collective, world: usize) -> f64 {
    let n = world.max(1) as f64;
    match c {
        Collective::AllReduce => 2.0 * (n - 1.0) / n,
        Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// The buffers of one call of a collective at one requested size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// The size reported: the larger of the send and receive buffers, in bytes.
    pub bytes: usize,
    /// The element count the collective is called with (per rank, per block where it splits).
    pub count: usize,
    /// A rank's send buffer out of place, in bytes.
    pub send: usize,
    /// A rank's receive buffer out of place, in bytes.
    pub recv: usize,
}

impl Shape {
    /// The shape of `c` at `size` bytes of `elem`-byte elements on `world` ranks: rounded down to whole
    /// elements, and to a multiple of `world` elements where the collective splits the size into blocks.
    pub fn new(c: Collective, size: usize, elem: usize, world: usize) -> Shape {
        let elems = size / elem.max(1);
        let per = elems / world.max(1);
        let block = per * elem;
        let total = block * world;
        match c {
            Collective::AllGather => Shape {
                bytes: total,
                count: per,
                send: block,
                recv: total,
            },
            Collective::ReduceScatter => Shape {
                bytes: total,
                count: per,
                send: total,
                recv: block,
            },
            Collective::AllToAll => Shape {
                bytes: total,
                count: per,
                send: total,
                recv: total,
            },
            _ => Shape {
                bytes: elems * elem,
                count: elems,
                send: elems * elem,
                recv: elems * elem,
            },
        }
    }
}

/// What one rank's buffers start as and must end as, for checking.
struct Expect {
    /// The send buffer out of place.
    send: Vec<u8>,
    /// What the receive buffer must hold out of place (`None`: not checked, as off the root of reduce).
    want: Option<Vec<u8>>,
    /// The buffer in place, before the call.
    in_place: Vec<u8>,
    /// Where in the in-place buffer the result is, and what it must be (`None`: not checked).
    want_in_place: Option<(usize, Vec<u8>)>,
}

/// A byte no input holds in any dtype (inputs are small non-negative integers): receive buffers start
/// filled with it, so a result that was never written is counted wrong.
const POISON: u8 = 0xA5;

impl Expect {
    /// The inputs of `c` on `rank` of `world` and their exact results, from braid_core's references.
    fn new(
        c: Collective,
        s: &Shape,
        dtype: DType,
        op: ReduceOp,
        rank: usize,
        world: usize,
    ) -> Expect {
        let block = s.count * dtype.size();
        let poison = |n: usize| vec![POISON; n];
        match c {
            Collective::AllReduce | Collective::Reduce => {
                let ins = inputs(s.bytes, dtype, op, world);
                let mine = ins[rank].clone();
                let want =
                    (c == Collective::AllReduce || rank == ROOT).then(|| reduced(&ins, dtype, op));
                Expect {
                    send: mine.clone(),
                    want_in_place: want.clone().map(|w| (0, w)),
                    want,
                    in_place: mine,
                }
            }
            Collective::Broadcast => {
                let mut src = vec![0u8; s.bytes];
                fill(&mut src, dtype, op, ROOT);
                let start = if rank == ROOT {
                    src.clone()
                } else {
                    poison(s.bytes)
                };
                Expect {
                    send: start.clone(),
                    want: Some(src.clone()),
                    in_place: start,
                    want_in_place: Some((0, src)),
                }
            }
            Collective::AllGather => {
                let ins = inputs(block, dtype, op, world);
                let mut in_place = poison(s.bytes);
                in_place[rank * block..(rank + 1) * block].copy_from_slice(&ins[rank]);
                let all = ins.concat();
                Expect {
                    send: ins[rank].clone(),
                    want: Some(all.clone()),
                    in_place,
                    want_in_place: Some((0, all)),
                }
            }
            Collective::ReduceScatter => {
                let ins = inputs(s.bytes, dtype, op, world);
                let mine = reduced(&ins, dtype, op)[rank * block..(rank + 1) * block].to_vec();
                Expect {
                    send: ins[rank].clone(),
                    want: Some(mine.clone()),
                    in_place: ins[rank].clone(),
                    want_in_place: Some((rank * block, mine)),
                }
            }
            _ => {
                // All-to-all: block `rank` of every rank's input, in rank order.
                let ins = inputs(s.bytes, dtype, op, world);
                let want: Vec<u8> = ins
                    .iter()
                    .flat_map(|b| b[rank * block..(rank + 1) * block].iter().copied())
                    .collect();
                Expect {
                    send: ins[rank].clone(),
                    want: Some(want),
                    in_place: Vec::new(),
                    want_in_place: None,
                }
            }
        }
    }
}

/// One out-of-place call of `c`.
fn out_of_place(
    comm: &Communicator,
    c: Collective,
    dtype: DType,
    op: ReduceOp,
    send: &[u8],
    recv: &mut [u8],
) -> Result<(), Error> {
    match c {
        Collective::AllReduce => comm.all_reduce_bytes(send, recv, dtype, op),
        Collective::ReduceScatter => comm.reduce_scatter_bytes(send, recv, dtype, op),
        Collective::AllGather => comm.all_gather_bytes(send, recv, dtype),
        Collective::Broadcast => comm.broadcast_bytes(send, recv, dtype, ROOT),
        Collective::Reduce => comm.reduce_bytes(send, recv, dtype, op, ROOT),
        Collective::AllToAll => comm.all_to_all_bytes(send, recv, dtype),
        Collective::Barrier => comm.barrier(),
    }
}

/// One in-place call of `c` on `buf` (aligned for `dtype`: the in-place forms beyond all-reduce are typed).
fn in_place(
    comm: &Communicator,
    c: Collective,
    dtype: DType,
    op: ReduceOp,
    buf: &mut [u8],
) -> Result<(), Error> {
    if c == Collective::AllReduce {
        return comm.all_reduce_bytes_in_place(buf, dtype, op);
    }
    match dtype {
        DType::I8 => in_place_typed::<i8>(comm, c, op, buf),
        DType::U8 => in_place_typed::<u8>(comm, c, op, buf),
        DType::I32 => in_place_typed::<i32>(comm, c, op, buf),
        DType::U32 => in_place_typed::<u32>(comm, c, op, buf),
        DType::I64 => in_place_typed::<i64>(comm, c, op, buf),
        DType::U64 => in_place_typed::<u64>(comm, c, op, buf),
        DType::F16 => in_place_typed::<half::f16>(comm, c, op, buf),
        DType::BF16 => in_place_typed::<half::bf16>(comm, c, op, buf),
        DType::F32 => in_place_typed::<f32>(comm, c, op, buf),
        DType::F64 => in_place_typed::<f64>(comm, c, op, buf),
    }
}

fn in_place_typed<T: Element>(
    comm: &Communicator,
    c: Collective,
    op: ReduceOp,
    buf: &mut [u8],
) -> Result<(), Error> {
    let buf: &mut [T] = bytemuck::cast_slice_mut(buf);
    match c {
        Collective::AllReduce => comm.all_reduce_in_place(buf, op),
        Collective::ReduceScatter => comm.reduce_scatter_in_place(buf, op),
        Collective::AllGather => comm.all_gather_in_place(buf),
        Collective::Broadcast => comm.broadcast_in_place(buf, ROOT),
        Collective::Reduce => comm.reduce_in_place(buf, op, ROOT),
        other => Err(Error::invalid(format!("{other} has no in-place form"))),
    }
}

#[derive(Serialize, Clone, Copy, Default)]
struct Cell {
    time_us: f64,
    algbw: f64,
    busbw: f64,
    wrong: u64,
}

#[derive(Serialize)]
struct Row {
    size: usize,
    count: usize,
    algo: &'static str,
    oop: Cell,
    /// Absent for a collective without an in-place form (all-to-all).
    #[serde(skip_serializing_if = "Option::is_none")]
    ip: Option<Cell>,
}

#[derive(Serialize)]
struct Bound {
    size: usize,
    time_us: f64,
    busbw: f64,
}

#[derive(Serialize)]
struct Report {
    tool: &'static str,
    collective: &'static str,
    /// The root of a rooted collective.
    #[serde(skip_serializing_if = "Option::is_none")]
    root: Option<usize>,
    ranks: usize,
    dtype: String,
    op: String,
    iters: usize,
    warmup: usize,
    results: Vec<Row>,
    algos: Vec<AlgoRow>,
    membw: Vec<Bound>,
}

/// Parses `8`, `64K`, `16M`, `1G` (powers of two).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.eq_ignore_ascii_case(&'k') => (&s[..i], 1usize << 10),
        Some((i, c)) if c.eq_ignore_ascii_case(&'m') => (&s[..i], 1 << 20),
        Some((i, c)) if c.eq_ignore_ascii_case(&'g') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a size (examples: 8, 64K, 16M, 1G)"))
}

/// Sizes from `min` to `max`, multiplying by `factor`.
pub fn sweep(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        v.push(s);
        if factor <= 1 {
            break;
        }
        s = match s.checked_mul(factor) {
            Some(n) => n,
            None => break,
        };
    }
    v
}

/// Slowest rank's value.
fn max_over_ranks(comm: &Communicator, v: f64) -> Result<f64, Error> {
    let mut x = [v];
    comm.all_reduce_in_place(&mut x, ReduceOp::Max)?;
    Ok(x[0])
}

fn sum_over_ranks(comm: &Communicator, v: u64) -> Result<u64, Error> {
    let mut x = [v];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
    Ok(x[0])
}

/// Longest time [`measure_bound`] measures for, whatever `iters` asks: the other ranks wait meanwhile.
const BOUND_BUDGET: std::time::Duration = std::time::Duration::from_millis(50);

/// Seconds per `out = a + b` (or, with `copy`, `out = a`) over `bytes` bytes: the average of at most
/// `iters` runs, fewer when they would take longer than [`BOUND_BUDGET`] (at least one run).
fn measure_bound(bytes: usize, iters: usize, dtype: DType, copy: bool) -> f64 {
    let a = vec![1u8; bytes];
    let b = vec![2u8; bytes];
    let mut out = vec![0u8; bytes];
    let run = |out: &mut [u8]| {
        if copy {
            out.copy_from_slice(&a);
            std::hint::black_box(&mut *out);
        } else {
            reduce::reduce_ordered(dtype, ReduceOp::Max, out, &[Src::Buf(&a), Src::Buf(&b)])
        }
    };
    for _ in 0..2 {
        run(&mut out);
    }
    let t = Instant::now();
    let mut done = 0usize;
    while done < iters.max(1) {
        run(&mut out);
        done += 1;
        if t.elapsed() >= BOUND_BUDGET {
            break;
        }
    }
    t.elapsed().as_secs_f64() / done as f64
}

/// Seconds the shared path needs at best for `c` over `bytes` on `world` ranks: every rank's memory
/// traffic ([`braid_sched::shared::traffic`]) at the bandwidth this machine's memory moves with
/// `min(world, cores)` threads each copying `bytes` at once (each copy's read and write counted),
/// that is `world × traffic / bandwidth`.
fn shared_bound(c: Collective, bytes: usize, world: usize, iters: usize, dtype: DType) -> f64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = world.min(cores).max(1);
    let per_thread: Vec<f64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| s.spawn(|| measure_bound(bytes, iters, dtype, true)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or(f64::INFINITY))
            .collect()
    });
    let bandwidth: f64 = per_thread.iter().map(|t| 2.0 * bytes as f64 / t).sum();
    world as f64 * braid_sched::shared::traffic(c, bytes, world) / bandwidth
}

/// Interleaved timing rounds per algorithm in `--algo all`.
const ALGO_ROUNDS: usize = 5;

/// The median of `v` (sorted in place).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The send buffer's registration (`--register`), ended on every way out of [`run`].
struct SendRegistration<'a> {
    comm: &'a Communicator,
    ptr: *const u8,
    len: usize,
    zero_copy: bool,
}

impl<'a> SendRegistration<'a> {
    fn new(comm: &'a Communicator, buf: &[u64]) -> Result<SendRegistration<'a>, Error> {
        let (ptr, len) = (buf.as_ptr().cast::<u8>(), std::mem::size_of_val(buf));
        // SAFETY: `buf` is the benchmark's send vector, which lives (and is never reallocated) for as
        // long as `run` holds this registration; it is rewritten only between collectives.
        let zero_copy = unsafe { comm.register_raw(ptr, len)? };
        Ok(SendRegistration {
            comm,
            ptr,
            len,
            zero_copy,
        })
    }
}

impl Drop for SendRegistration<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.comm.deregister_raw(self.ptr, self.len) {
            eprintln!("braid perf: deregistering the send buffer: {e}");
        }
    }
}

/// A host buffer of the benchmark: private memory, or memory every rank of the host maps.
enum HostBuf {
    Own(Vec<u64>),
    Shared(braid::SharedBuffer),
}

impl HostBuf {
    fn new(comm: &Communicator, bytes: usize, shared: bool) -> Result<HostBuf, Error> {
        Ok(if shared {
            HostBuf::Shared(comm.alloc(bytes.max(8).next_multiple_of(8))?)
        } else {
            HostBuf::Own(braid_core::alloc::filled(
                0u64,
                bytes.div_ceil(8),
                "a benchmark buffer",
            )?)
        })
    }

    fn words(&self) -> &[u64] {
        match self {
            HostBuf::Own(v) => v,
            HostBuf::Shared(s) => s.as_slice(),
        }
    }

    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self.words())
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            HostBuf::Own(v) => bytemuck::cast_slice_mut(v),
            HostBuf::Shared(s) => s.as_mut_slice(),
        }
    }
}

/// One rank's benchmark state: the buffers, reused across sizes. They are held as 8-byte words so that
/// the typed in-place calls can view them as any element type.
struct Bench<'a> {
    comm: &'a Communicator,
    a: &'a PerfArgs,
    /// The op the inputs are made for: the reduction, or sum for the collectives that do not reduce.
    data_op: ReduceOp,
    send: HostBuf,
    recv: HostBuf,
    factor: f64,
    /// With `--device`: the device communicator and its buffers (then `send` and `recv` are the host
    /// copies results are checked in).
    dev: Option<DeviceBench>,
}

struct DeviceBench {
    side: crate::device::DeviceSide,
    send: Box<dyn crate::device::DeviceBuf>,
    recv: Box<dyn crate::device::DeviceBuf>,
}

impl DeviceBench {
    /// One call of `c` on the device buffers.
    fn call(&self, a: &PerfArgs, s: &Shape, in_place: bool) -> Result<(), Error> {
        let d = &self.side.comm;
        let (dt, rank) = (a.dtype, d.rank());
        let recv = self.recv.span(if in_place { s.bytes } else { s.recv });
        let send = if in_place {
            match a.collective {
                // The rank's own block of the output is the input.
                Collective::AllGather => {
                    let block = s.count * dt.size();
                    recv.sub(rank * block, (rank + 1) * block)
                        .ok_or_else(|| Error::invalid("all_gather in place: block out of range"))?
                }
                _ => recv,
            }
        } else {
            self.send.span(s.send)
        };
        // SAFETY: both buffers are this benchmark's device buffers, alive for the whole run, and
        // nothing else touches them during the call.
        unsafe {
            match a.collective {
                Collective::AllReduce => d.run(d.all_reduce_op(send, recv, s.count, dt, a.op)?),
                Collective::ReduceScatter => {
                    d.run(d.reduce_scatter_op(send, recv, s.count, dt, a.op)?)
                }
                Collective::AllGather => d.run(d.all_gather_op(send, recv, s.count, dt)?),
                Collective::Broadcast => d.run(d.broadcast_op(send, recv, s.count, dt, ROOT)?),
                Collective::Reduce => d.run(d.reduce_op(send, recv, s.count, dt, a.op, ROOT)?),
                other => Err(Error::invalid(format!(
                    "{} does not run on device memory yet",
                    other.name()
                ))),
            }
        }
    }
}

impl Bench<'_> {
    /// One call of the collective at `s`, out of place (the send and receive buffers) or in place (the
    /// receive buffer, `s.bytes` long).
    fn call(&mut self, s: &Shape, in_place: bool) -> Result<(), Error> {
        if let Some(d) = &self.dev {
            return d.call(self.a, s, in_place);
        }
        let (comm, a) = (self.comm, self.a);
        let recv = self.recv.bytes_mut();
        if in_place {
            self::in_place(comm, a.collective, a.dtype, a.op, &mut recv[..s.bytes])
        } else {
            let send = self.send.bytes();
            out_of_place(
                comm,
                a.collective,
                a.dtype,
                a.op,
                &send[..s.send],
                &mut recv[..s.recv],
            )
        }
    }

    /// Checks one call against `want` (when checking), then times `iters` calls; the slowest rank's
    /// average and the wrong elements summed over ranks.
    fn measure(&mut self, s: &Shape, in_place: bool, want: Option<&Expect>) -> Result<Cell, Error> {
        let es = self.a.dtype.size();
        let mut w = 0;
        if let Some(e) = want {
            let send = self.send.bytes_mut();
            let recv = self.recv.bytes_mut();
            if in_place {
                recv[..s.bytes].copy_from_slice(&e.in_place);
            } else {
                send[..s.send].copy_from_slice(&e.send);
                recv[..s.recv].fill(POISON);
            }
            if let Some(d) = &mut self.dev {
                // The device buffers start as the host copies do; the result comes back into them.
                if !in_place {
                    d.send.write(&self.send.bytes()[..s.send])?;
                }
                let n = if in_place { s.bytes } else { s.recv };
                d.recv.write(&self.recv.bytes()[..n])?;
            }
            self.call(s, in_place)?;
            if let Some(d) = &self.dev {
                let recv = self.recv.bytes_mut();
                let n = if in_place { s.bytes } else { s.recv };
                d.recv.read(0, &mut recv[..n])?;
            }
            let recv = self.recv.bytes();
            w = match (in_place, &e.want, &e.want_in_place) {
                (false, Some(want), _) => wrong(&recv[..s.recv], want, es),
                (true, _, Some((at, want))) => wrong(&recv[*at..*at + want.len()], want, es),
                _ => 0,
            };
        }
        for _ in 0..self.a.warmup {
            self.call(s, in_place)?;
        }
        let wrong = sum_over_ranks(self.comm, w)?;
        let secs = self.time_only(s, in_place)?;
        let algbw = s.bytes as f64 / secs / 1e9;
        Ok(Cell {
            time_us: secs * 1e6,
            algbw,
            busbw: algbw * self.factor,
            wrong,
        })
    }

    /// Times `iters` calls after a barrier: the slowest rank's average, in seconds.
    fn time_only(&mut self, s: &Shape, in_place: bool) -> Result<f64, Error> {
        self.comm.barrier()?;
        let t = Instant::now();
        for _ in 0..self.a.iters {
            self.call(s, in_place)?;
        }
        max_over_ranks(
            self.comm,
            t.elapsed().as_secs_f64() / self.a.iters.max(1) as f64,
        )
    }
}

#[derive(Serialize)]
struct AlgoRow {
    size: usize,
    count: usize,
    pick: &'static str,
    best: &'static str,
    algos: std::collections::BTreeMap<&'static str, Cell>,
}

/// Runs the benchmark as one rank of `comm`; rank 0 prints and writes the report.
pub fn run(comm: &Communicator, a: &PerfArgs) -> Result<u64, Error> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let (coll, dtype, es) = (a.collective, a.dtype, a.dtype.size());
    let reducing = reduces(coll);
    let op_name = if reducing { a.op.name() } else { "none" };
    let shapes: Vec<Shape> = sweep(a.min_bytes, a.max_bytes, a.factor)
        .into_iter()
        .map(|size| Shape::new(coll, size, es, world))
        .collect();
    let max = shapes.iter().map(|s| s.bytes).max().unwrap_or(0);
    let factor = if world > 1 {
        busbw_factor(coll, world)
    } else {
        1.0
    };
    let on_device = a.device != crate::device::Device::Host;
    if on_device {
        if !DEVICE_COLLECTIVES.contains(&coll) {
            return Err(Error::invalid(format!(
                "--device: {} does not run on device memory yet (all_reduce, broadcast, reduce, all_gather and reduce_scatter do)",
                coll.name()
            )));
        }
        if a.algo.is_some() || a.register || a.shared {
            return Err(Error::invalid(
                "--device takes neither --algo nor --register nor --shared yet",
            ));
        }
    }
    if a.shared && a.algo.is_some() {
        return Err(Error::invalid(
            "--shared takes no --algo: collectives on shared buffers have one path",
        ));
    }
    let dev = if on_device {
        let side = crate::device::open(comm, a.device)?;
        let (send, recv) = (side.buffer(max)?, side.buffer(max)?);
        Some(DeviceBench { side, send, recv })
    } else {
        None
    };
    let mut bench = Bench {
        comm,
        a,
        data_op: if reducing { a.op } else { ReduceOp::Sum },
        send: HostBuf::new(comm, max, a.shared)?,
        recv: HostBuf::new(comm, max, a.shared)?,
        factor,
        dev,
    };
    // Registered for as long as this function runs: the buffer is never reallocated meanwhile.
    let registered = if a.register {
        Some(SendRegistration::new(comm, bench.send.words())?)
    } else {
        None
    };
    let candidates: Vec<Algo> = match a.algo.as_deref() {
        Some("all") => coll.algos().to_vec(),
        Some(list) => list
            .split(',')
            .map(str::parse::<Algo>)
            .collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let all_algos = candidates.len() > 1;
    if let [only] = candidates[..] {
        comm.set_algorithm(coll, Some(only))?;
    }
    let root = matches!(coll, Collective::Broadcast | Collective::Reduce).then_some(ROOT);
    if rank == 0 {
        println!(
            "# braid perf: {}{}, {world} ranks over {}, {}{}, {} iterations after {} warm-up",
            coll.name(),
            root.map_or(String::new(), |r| format!(" from root {r}")),
            comm.transports_summary(),
            dtype,
            if reducing {
                format!(" {}", a.op)
            } else {
                String::new()
            },
            a.iters,
            a.warmup
        );
        if let Some(d) = &bench.dev {
            println!(
                "# buffers in {}, {} ranks through {}",
                d.side.describe,
                world,
                d.side
                    .comm
                    .peer_transports()
                    .iter()
                    .find(|t| **t != "self")
                    .copied()
                    .unwrap_or("self")
            );
        }
        if a.shared {
            println!(
                "# buffers in memory every rank of the host maps (Communicator::alloc); bound: {} of memory traffic per rank at the copy bandwidth of {} busy cores",
                match coll {
                    Collective::AllReduce => "2S",
                    Collective::ReduceScatter | Collective::Reduce => "S(n+1)/n",
                    _ => "2S(n-1)/n",
                },
                world.min(std::thread::available_parallelism().map_or(1, |n| n.get()))
            );
        }
        if let Some(r) = &registered {
            println!(
                "# send buffer registered: {}",
                if r.zero_copy {
                    "sent without a copy where the route is rdma"
                } else {
                    "no transport here sends without a copy"
                }
            );
        }
        if all_algos {
            print_algo_header(&candidates);
        } else {
            print_header();
        }
    }
    // Warm up once at the largest and the smallest size (page faults, slots, caches), as nccl-tests does.
    let largest = shapes.iter().max_by_key(|s| s.bytes).copied();
    for s in largest.iter().chain(shapes.first()) {
        for _ in 0..a.warmup.max(1) {
            bench.call(s, false)?;
        }
    }
    let mut report = Report {
        tool: "braid",
        collective: coll.name(),
        root,
        ranks: world,
        dtype: dtype.name().into(),
        op: op_name.into(),
        iters: a.iters,
        warmup: a.warmup,
        results: vec![],
        algos: vec![],
        membw: vec![],
    };
    let mut total_wrong = 0;
    let mut busbw_sum = 0.0;
    let progress = crate::progress::Progress::new(rank == 0, shapes.len());
    for s in &shapes {
        let (bytes, count) = (s.bytes, s.count);
        // What the tuner is asked about: the element count of the call, in bytes.
        let tuner_bytes = count * es;
        let expect = a
            .check
            .then(|| Expect::new(coll, s, dtype, bench.data_op, rank, world));
        let want = expect.as_ref();
        let bound = if rank == 0 && bytes > 0 && a.shared {
            shared_bound(coll, bytes, world, a.iters.max(1), dtype)
        } else if rank == 0 && bytes > 0 && !on_device {
            measure_bound(bytes, a.iters.max(1), dtype, !reducing)
        } else {
            0.0
        };
        comm.barrier()?;
        let bound_busbw = if bound > 0.0 {
            bytes as f64 / bound / 1e9 * factor
        } else {
            0.0
        };
        if all_algos {
            let (pick, _) = comm.algorithm(coll, tuner_bytes);
            let mut cells = std::collections::BTreeMap::new();
            // Check and time each algorithm, then time them again in interleaved rounds: on a shared
            // machine a single batch is at the mercy of whatever else runs; the median of the rounds is not.
            let mut times: std::collections::BTreeMap<&'static str, Vec<f64>> = Default::default();
            for algo in &candidates {
                comm.set_algorithm(coll, Some(*algo))?;
                let c = bench.measure(s, false, want)?;
                total_wrong += c.wrong;
                times.entry(algo.name()).or_default().push(c.time_us / 1e6);
                cells.insert(algo.name(), c);
            }
            for _ in 1..ALGO_ROUNDS {
                for algo in &candidates {
                    comm.set_algorithm(coll, Some(*algo))?;
                    let t = bench.time_only(s, false)?;
                    times.entry(algo.name()).or_default().push(t);
                }
            }
            for (name, ts) in &mut times {
                let secs = median(ts);
                let algbw = bytes as f64 / secs / 1e9;
                let c = cells.get_mut(name).expect("measured");
                *c = Cell {
                    time_us: secs * 1e6,
                    algbw,
                    busbw: algbw * factor,
                    wrong: c.wrong,
                };
            }
            comm.set_algorithm(coll, None)?;
            let best = cells
                .iter()
                .min_by(|x, y| x.1.time_us.total_cmp(&y.1.time_us))
                .map(|(n, _)| *n)
                .unwrap_or("ring");
            busbw_sum += cells[best].busbw;
            if rank == 0 {
                progress.suspend(|| {
                    print_algo_row(
                        bytes,
                        count,
                        dtype,
                        op_name,
                        &cells,
                        pick.name(),
                        best,
                        bound_busbw,
                        &candidates,
                    )
                });
                report.algos.push(AlgoRow {
                    size: bytes,
                    count,
                    pick: pick.name(),
                    best,
                    algos: cells,
                });
            }
        } else {
            let oop = bench.measure(s, false, want)?;
            let ip = if has_in_place(coll) && !(on_device && coll == Collective::ReduceScatter) {
                Some(bench.measure(s, true, want)?)
            } else {
                None
            };
            total_wrong += oop.wrong + ip.map_or(0, |c| c.wrong);
            busbw_sum += oop.busbw;
            let algo = if a.shared {
                "shared"
            } else {
                comm.algorithm(coll, tuner_bytes).0.name()
            };
            if rank == 0 {
                let pct = if bound_busbw > 0.0 {
                    100.0 * oop.busbw / bound_busbw
                } else {
                    0.0
                };
                let ip_cols = match ip {
                    Some(ip) => format!(
                        "{:>10.2} {:>8.2} {:>8.2} {:>6}",
                        ip.time_us, ip.algbw, ip.busbw, ip.wrong
                    ),
                    None => format!("{:>10} {:>8} {:>8} {:>6}", "n/a", "n/a", "n/a", "n/a"),
                };
                progress.suspend(|| {
                    println!(
                        "  {:>10} {:>12} {:>8} {:>6} {:>6} | {:>10.2} {:>8.2} {:>8.2} {:>6} | {ip_cols} | {:>8.2} {:>5.0}%",
                        bytes, count, dtype.name(), op_name, algo,
                        oop.time_us, oop.algbw, oop.busbw, oop.wrong,
                        bound_busbw, pct
                    )
                });
                report.results.push(Row {
                    size: bytes,
                    count,
                    algo,
                    oop,
                    ip,
                });
            }
        }
        if rank == 0 {
            report.membw.push(Bound {
                size: bytes,
                time_us: bound * 1e6,
                busbw: bound_busbw,
            });
        }
        progress.step();
    }
    progress.finish();
    if rank == 0 {
        println!(
            "# Out of bounds values : {total_wrong} {}",
            if total_wrong == 0 { "OK" } else { "FAILED" }
        );
        println!(
            "# Avg bus bandwidth    : {:.3}",
            busbw_sum / shapes.len().max(1) as f64
        );
        if let Some(path) = &a.json {
            let text = serde_json::to_string_pretty(&report).expect("report serialises");
            std::fs::write(path, text).map_err(|e| Error::io(format!("writing {path}"), e))?;
        }
        if let Some(path) = &a.plot {
            crate::plot::busbw(path, &report_series(&report), coll.name(), world)
                .map_err(|e| Error::io(format!("plotting {path}"), std::io::Error::other(e)))?;
        }
    }
    Ok(total_wrong)
}

/// Busbw series per algorithm (or the single measured line), for plotting.
fn report_series(r: &Report) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut out: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    if !r.results.is_empty() {
        out.push((
            "braid".into(),
            r.results
                .iter()
                .map(|x| (x.size as f64, x.oop.busbw))
                .collect(),
        ));
    }
    if let Some(first) = r.algos.first() {
        for name in first.algos.keys() {
            let pts = r
                .algos
                .iter()
                .filter_map(|x| x.algos.get(name).map(|c| (x.size as f64, c.busbw)))
                .collect();
            out.push((name.to_string(), pts));
        }
        out.push((
            "tuner pick".into(),
            r.algos
                .iter()
                .map(|x| (x.size as f64, x.algos[x.pick].busbw))
                .collect(),
        ));
    }
    out.push((
        "memory bound".into(),
        r.membw
            .iter()
            .filter(|b| b.busbw > 0.0)
            .map(|b| (b.size as f64, b.busbw))
            .collect(),
    ));
    out
}

fn print_header() {
    println!("#");
    println!("# {:>10} {:>12} {:>8} {:>6} {:>6} | {:>10} {:>8} {:>8} {:>6} | {:>10} {:>8} {:>8} {:>6} | {:>8} {:>6}",
        "", "", "", "", "", "out-of-place", "", "", "", "in-place", "", "", "", "bound", "");
    println!("# {:>10} {:>12} {:>8} {:>6} {:>6} | {:>10} {:>8} {:>8} {:>6} | {:>10} {:>8} {:>8} {:>6} | {:>8} {:>6}",
        "size", "count", "type", "redop", "algo", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "busbw", "%bound");
    println!("# {:>10} {:>12} {:>8} {:>6} {:>6} | {:>10} {:>8} {:>8} {:>6} | {:>10} {:>8} {:>8} {:>6} | {:>8} {:>6}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "(GB/s)", "");
}

fn print_algo_header(candidates: &[Algo]) {
    println!("# out-of-place busbw (GB/s) per algorithm; * marks the fastest, < the tuner's pick");
    let names: Vec<String> = candidates
        .iter()
        .map(|a| format!("{:>10}", a.name()))
        .collect();
    println!(
        "# {:>10} {:>12} {:>8} {:>6} | {} | {:>6} {:>6} {:>9} {:>8}",
        "size",
        "count",
        "type",
        "redop",
        names.join(" "),
        "pick",
        "best",
        "pick/best",
        "bound"
    );
}

#[allow(clippy::too_many_arguments)]
fn print_algo_row(
    bytes: usize,
    count: usize,
    dtype: DType,
    op: &str,
    cells: &std::collections::BTreeMap<&'static str, Cell>,
    pick: &str,
    best: &str,
    bound: f64,
    candidates: &[Algo],
) {
    let cols: Vec<String> = candidates
        .iter()
        .map(|a| {
            let c = cells[a.name()];
            let mark = match (a.name() == best, a.name() == pick) {
                (true, true) => "*<",
                (true, false) => "* ",
                (false, true) => " <",
                _ => "  ",
            };
            format!("{:>8.2}{mark}", c.busbw)
        })
        .collect();
    // The pick may be outside the measured list; then there is no ratio to show.
    let ratio = cells
        .get(pick)
        .map_or(f64::NAN, |p| cells[best].time_us / p.time_us);
    println!(
        "  {:>10} {:>12} {:>8} {:>6} | {} | {:>6} {:>6} {:>8.0}% {:>8.2}",
        bytes,
        count,
        dtype.name(),
        op,
        cols.join(" "),
        pick,
        best,
        100.0 * ratio,
        bound
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_sweep() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("1k").unwrap(), 1024);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999999G").is_err());
        assert_eq!(sweep(8, 64, 2), vec![8, 16, 32, 64]);
        assert_eq!(sweep(8, 8, 2), vec![8]);
        assert_eq!(sweep(8, 100, 1), vec![8]);
    }

    #[test]
    fn collectives_parse_and_an_unknown_one_lists_the_valid_names() {
        assert_eq!(
            parse_collective("broadcast").unwrap(),
            Collective::Broadcast
        );
        assert_eq!(
            parse_collective("allgather").unwrap(),
            Collective::AllGather
        );
        for c in COLLECTIVES {
            assert_eq!(parse_collective(c.name()).unwrap(), c);
        }
        for bad in ["gather", "barrier", ""] {
            let e = parse_collective(bad).unwrap_err();
            for c in COLLECTIVES {
                assert!(e.contains(c.name()), "{e}");
            }
            assert!(!e.contains("barrier,"), "{e}");
        }
    }

    #[test]
    fn sizes_and_bus_bandwidth_follow_nccl_tests() {
        // 1000 bytes of f32 on 3 ranks: 250 elements, 83 per rank, 996 bytes in all.
        let s = |c| Shape::new(c, 1000, 4, 3);
        let whole = Shape {
            bytes: 1000,
            count: 250,
            send: 1000,
            recv: 1000,
        };
        assert_eq!(s(Collective::AllReduce), whole);
        assert_eq!(s(Collective::Broadcast), whole);
        assert_eq!(s(Collective::Reduce), whole);
        let gather = Shape {
            bytes: 996,
            count: 83,
            send: 332,
            recv: 996,
        };
        assert_eq!(s(Collective::AllGather), gather);
        assert_eq!(
            s(Collective::ReduceScatter),
            Shape {
                send: 996,
                recv: 332,
                ..gather
            }
        );
        assert_eq!(
            s(Collective::AllToAll),
            Shape {
                send: 996,
                recv: 996,
                ..gather
            }
        );
        // Partial elements go first: 10 bytes of f64 are one element.
        assert_eq!(Shape::new(Collective::AllReduce, 10, 8, 2).bytes, 8);
        assert_eq!(Shape::new(Collective::AllGather, 8, 4, 3).bytes, 0);
        assert_eq!(busbw_factor(Collective::AllReduce, 4), 1.5);
        assert_eq!(busbw_factor(Collective::AllGather, 4), 0.75);
        assert_eq!(busbw_factor(Collective::ReduceScatter, 4), 0.75);
        assert_eq!(busbw_factor(Collective::AllToAll, 4), 0.75);
        assert_eq!(busbw_factor(Collective::Broadcast, 4), 1.0);
        assert_eq!(busbw_factor(Collective::Reduce, 4), 1.0);
    }

    #[test]
    fn expected_results_agree_with_what_the_ranks_send() {
        let (op, world) = (ReduceOp::Sum, 3);
        for (dtype, c) in DType::ALL
            .into_iter()
            .flat_map(|d| COLLECTIVES.map(|c| (d, c)))
        {
            let es = dtype.size();
            let s = Shape::new(c, 4 * 3 * 10, es, world);
            let e: Vec<Expect> = (0..world)
                .map(|r| Expect::new(c, &s, dtype, op, r, world))
                .collect();
            let block = s.count * es;
            let sends: Vec<Vec<u8>> = e.iter().map(|x| x.send.clone()).collect();
            for (r, x) in e.iter().enumerate() {
                assert_eq!(x.send.len(), s.send, "{c}");
                if has_in_place(c) {
                    assert_eq!(x.in_place.len(), s.bytes, "{c}");
                }
                let want = x.want.clone();
                match c {
                    Collective::AllReduce => assert_eq!(want, Some(reduced(&sends, dtype, op))),
                    Collective::Reduce => assert_eq!(
                        want,
                        (r == ROOT).then(|| reduced(&sends, dtype, op)),
                        "{c} {r}"
                    ),
                    Collective::Broadcast => assert_eq!(want.as_ref(), Some(&sends[ROOT])),
                    Collective::AllGather => {
                        assert_eq!(want, Some(sends.concat()));
                        assert_eq!(x.in_place[r * block..(r + 1) * block], sends[r][..]);
                    }
                    Collective::ReduceScatter => {
                        let all = reduced(&sends, dtype, op);
                        assert_eq!(want.as_deref(), Some(&all[r * block..(r + 1) * block]));
                        assert_eq!(x.want_in_place.as_ref().map(|w| w.0), Some(r * block));
                    }
                    _ => {
                        for (p, send) in sends.iter().enumerate() {
                            assert_eq!(
                                want.as_ref().unwrap()[p * block..(p + 1) * block],
                                send[r * block..(r + 1) * block],
                                "{c}: block {p} of rank {r}"
                            );
                        }
                    }
                }
                // A result never written (still poisoned) is wrong in every element.
                if let Some(w) = &x.want {
                    assert!(!w.is_empty(), "{c}");
                    assert_eq!(
                        wrong(&vec![POISON; w.len()], w, es),
                        (w.len() / es) as u64,
                        "{c} {dtype}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_memory_bound_takes_its_time_budget_not_its_iterations() {
        let t = Instant::now();
        let secs = measure_bound(1 << 20, 20_000, DType::F32, false);
        let took = t.elapsed();
        assert!(secs > 0.0 && secs.is_finite(), "{secs}");
        // 20000 runs over a MiB take seconds; the budget is 50 ms.
        assert!(took < std::time::Duration::from_secs(1), "took {took:?}");
        // Few iterations are all run.
        let t = Instant::now();
        assert!(measure_bound(64, 3, DType::F32, false) > 0.0);
        assert!(measure_bound(64, 3, DType::F32, true) > 0.0);
        assert!(t.elapsed() < BOUND_BUDGET);
    }
}
