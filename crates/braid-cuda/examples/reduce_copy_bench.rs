//! Times every reduce-copy kernel shape on the GPU against the device-to-device copy bandwidth measured
//! in the same run, counting bytes read and written the same way for both.
//!
//! ```text
//! cargo run --release -p braid-cuda --example reduce_copy_bench -- [--bytes N] [--iters K] [--dtypes all|f32,bf16,...]
//! cargo run --release -p braid-cuda --example reduce_copy_bench -- --compile-only ARCH   # fill the kernel cache
//! ```
//!
//! Each kernel's largest operand is `--bytes` (default 256 MiB); the time is the median of `--iters`
//! launches (default 20, after 3 warm-ups), taken with CUDA events on a high-priority stream.
#![allow(unsafe_code)]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use braid_core::{DType, Error, ReduceOp};
use braid_cuda::{
    load_or_compile, DeviceBuffer, Event, Gpu, Priority, ReduceCopyKernels, Shape, Stream,
};

struct Args {
    bytes: usize,
    iters: usize,
    dtypes: Vec<DType>,
    compile_only: Option<u32>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        bytes: 256 << 20,
        iters: 20,
        dtypes: DType::ALL.to_vec(),
        compile_only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--bytes" => a.bytes = value()?.parse().map_err(|e| format!("--bytes: {e}"))?,
            "--iters" => a.iters = value()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--dtypes" => {
                let v = value()?;
                if v != "all" {
                    a.dtypes = v
                        .split(',')
                        .map(|d| d.parse::<DType>().map_err(|e| format!("--dtypes: {e}")))
                        .collect::<Result<_, _>>()?;
                }
            }
            "--compile-only" => {
                a.compile_only = Some(
                    value()?
                        .parse()
                        .map_err(|e| format!("--compile-only: {e}"))?,
                )
            }
            "-h" | "--help" => {
                return Err(
                    "usage: reduce_copy_bench [--bytes N] [--iters K] [--dtypes all|LIST] \
                            [--compile-only ARCH]"
                        .into(),
                )
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.bytes < 16 || a.iters == 0 {
        return Err("--bytes must be at least 16 and --iters at least 1".into());
    }
    Ok(a)
}

fn until() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

/// The median of `iters` timed runs of `f` on `stream` (after 3 untimed), in milliseconds.
fn time(
    gpu: &Gpu,
    stream: &Stream,
    iters: usize,
    mut f: impl FnMut() -> Result<(), Error>,
) -> Result<f64, Error> {
    for _ in 0..3 {
        f()?;
    }
    stream.synchronize(until())?;
    let mut ms = Vec::with_capacity(iters);
    let (start, end) = (Event::new(gpu, true)?, Event::new(gpu, true)?);
    for _ in 0..iters {
        start.record(stream)?;
        f()?;
        end.record(stream)?;
        end.synchronize(until())?;
        ms.push(end.elapsed_ms(&start)? as f64);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

fn run(a: &Args) -> Result<(), Error> {
    if let Some(arch) = a.compile_only {
        let t = Instant::now();
        let (image, outcome) = load_or_compile(arch)?;
        println!(
            "sm_{arch}: {} bytes, {outcome:?}, {:.1} s",
            image.len(),
            t.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    let gpu = Gpu::for_local_rank(0)?;
    let t = Instant::now();
    let kernels = ReduceCopyKernels::load(&gpu)?;
    println!(
        "# {} (sm_{}), {} SMs; kernels loaded in {:.2} s",
        gpu.name()?,
        gpu.arch()?,
        gpu.multiprocessors()?,
        t.elapsed().as_secs_f64()
    );
    let stream = Stream::new(&gpu, Priority::High)?;
    // Operands: up to 2 in the accumulator type (f32 for 16-bit types) and 8 in the dtype.
    let n = a.bytes;
    let big: Vec<DeviceBuffer> = (0..10)
        .map(|_| DeviceBuffer::alloc(&gpu, 2 * n))
        .collect::<Result<_, _>>()?;
    for b in &big {
        // SAFETY: the buffers live until the end of `run`, after the stream is synchronised.
        unsafe { stream.fill(b.addr(), 0, b.len())? };
    }
    let copy_ms = time(&gpu, &stream, a.iters, || {
        // SAFETY: as above.
        unsafe { stream.copy(big[1].addr(), big[0].addr(), n) }
    })?;
    let copy_gbs = 2.0 * n as f64 / copy_ms / 1e6;
    println!("# device-to-device copy of {n} bytes: {copy_ms:.3} ms, {copy_gbs:.0} GB/s (read + written)");
    println!(
        "# {:<14} {:>5} {:>5} {:>12} {:>10} {:>9} {:>7}",
        "kernel", "dtype", "op", "bytes moved", "time (ms)", "GB/s", "% copy"
    );
    let mut worst: Option<(f64, String)> = None;
    for &dtype in &a.dtypes {
        let ops: &[ReduceOp] = if dtype.is_float() {
            &[ReduceOp::Sum, ReduceOp::Avg]
        } else {
            &[ReduceOp::Sum]
        };
        for shape in Shape::all() {
            for &op in if shape.uses_op() {
                ops
            } else {
                &[ReduceOp::Sum]
            } {
                let (s, d) = (shape.sources(), shape.destinations());
                let size = |acc: bool| {
                    if acc {
                        dtype.accumulator().size()
                    } else {
                        dtype.size()
                    }
                };
                let widest = s.iter().chain(&d).map(|&x| size(x)).max().unwrap_or(1);
                let count = n / widest;
                let srcs: Vec<u64> = (0..s.len()).map(|i| big[i].addr()).collect();
                let dsts: Vec<u64> = (0..d.len()).map(|j| big[8 + j].addr()).collect();
                let moved: usize = s.iter().chain(&d).map(|&x| count * size(x)).sum();
                let ms = time(&gpu, &stream, a.iters, || {
                    // SAFETY: every operand is a live buffer of at least `count` elements of its type.
                    unsafe { kernels.launch(&stream, shape, dtype, op, &srcs, &dsts, count, 4) }
                })?;
                let gbs = moved as f64 / ms / 1e6;
                let pct = 100.0 * gbs / copy_gbs;
                let name = format!("{shape:?}").to_lowercase();
                println!(
                    "  {name:<14} {:>5} {:>5} {moved:>12} {ms:>10.3} {gbs:>9.0} {pct:>6.1}%",
                    dtype.to_string(),
                    op.name()
                );
                if worst.as_ref().is_none_or(|(w, _)| pct < *w) {
                    worst = Some((pct, format!("{name} {dtype} {}", op.name())));
                }
            }
        }
    }
    stream.synchronize(until())?;
    if let Some((pct, what)) = worst {
        println!("# slowest: {what} at {pct:.1}% of the copy bandwidth");
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("reduce_copy_bench: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("reduce_copy_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
