//! The device-resident all-reduce on one GPU, measured in nccl-tests' columns against the bound of the
//! same GPU, every result checked.
//!
//! ```text
//! resident_bench --ranks N [--procs] [--min B] [--max B] [--iters K] [--timeout-ms T]
//! resident_bench --procs --ranks N --die R     # rank R exits mid-run: the others must report it
//! resident_bench --compile-only ARCH           # fill the kernel cache (f32 and f64 sum)
//! ```
//!
//! Ranks are threads of this process sharing one context (default), or processes (`--procs`; run the
//! CUDA MPS daemon first, or the GPU time-slices between them) whose windows are shared by CUDA IPC
//! (POSIX descriptors passed over a Unix socket through the launching process). Each size runs staged
//! (buffers anywhere) and symmetric (buffers in the windows' heaps). A collective captured in a CUDA
//! graph is replayed 100 times and checked.
//!
//! The bound: all ranks share one GPU, so an all-reduce must at least read every rank's input and write
//! every rank's output once: 2·n·S bytes at the device-to-device copy bandwidth `C` (bytes read plus
//! written, measured first in the same run). Its time is 2·n·S / C and its busbw
//! (S / t)·2(n−1)/n = C·(n−1)/n².
#![allow(unsafe_code)]

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_core::{DType, Error, ReduceOp};
use braid_cuda::resident::{compile_kernel, ResidentAllReduce, WindowLayout, MAX_BLOCKS};
use braid_cuda::{CudaMemory, DeviceBuffer, Event, Gpu, Priority, Stream};
use braid_transport::device::{recv_msg, send_msg, Shareable};
use braid_transport::shm::ipc::{decode_offer, encode_offer, OFFER_BYTES};
use braid_transport::{DeviceAllocation, DeviceMemory};

#[derive(Clone, Debug)]
struct Args {
    ranks: usize,
    procs: bool,
    min: usize,
    max: usize,
    iters: usize,
    timeout_ms: u64,
    die: Option<usize>,
    child: Option<(usize, String, f64)>,
}

fn parse() -> Result<Option<Args>, String> {
    let mut a = Args {
        ranks: 2,
        procs: false,
        min: 8,
        max: 256 << 20,
        iters: 20,
        timeout_ms: 10_000,
        die: None,
        child: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let num = |v: String| v.parse::<usize>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--ranks" => a.ranks = num(value()?)?,
            "--procs" => a.procs = true,
            "--min" => a.min = num(value()?)?,
            "--max" => a.max = num(value()?)?,
            "--iters" => a.iters = num(value()?)?,
            "--timeout-ms" => a.timeout_ms = num(value()?)? as u64,
            "--die" => a.die = Some(num(value()?)?),
            "--child" => {
                let v = value()?;
                let mut p = v.split(',');
                let (Some(r), Some(s), Some(c)) = (p.next(), p.next(), p.next()) else {
                    return Err("--child RANK,SOCKET,COPY_GBPS".into());
                };
                a.child = Some((
                    r.parse().map_err(|_| "--child rank")?,
                    s.to_string(),
                    c.parse().map_err(|_| "--child copy")?,
                ));
            }
            "--compile-only" => {
                let arch: u32 = value()?.parse().map_err(|_| "--compile-only ARCH")?;
                for world in 1..=braid_cuda::resident::MAX_RANKS {
                    for dtype in [DType::F32, DType::F64] {
                        compile_kernel(dtype, ReduceOp::Sum, world, arch)
                            .map_err(|e| e.to_string())?;
                    }
                }
                return Ok(None);
            }
            _ => return Err(format!("unknown flag {flag} (see the source's doc)")),
        }
    }
    if !(1..=braid_cuda::resident::MAX_RANKS).contains(&a.ranks) {
        return Err("--ranks: 1 to 8".into());
    }
    if a.max < 1 << 20 || a.min > a.max {
        return Err(
            "--max must be at least 1 MiB (the graph check uses 1 MiB) and --min at most --max"
                .into(),
        );
    }
    Ok(Some(a))
}

/// Device-to-device copy bandwidth (bytes read + written per second) over 256 MiB.
fn copy_bandwidth(gpu: &Gpu) -> Result<f64, Error> {
    let bytes = 256usize << 20;
    let (a, b) = (
        DeviceBuffer::alloc(gpu, bytes)?,
        DeviceBuffer::alloc(gpu, bytes)?,
    );
    let stream = Stream::new(gpu, Priority::Normal)?;
    let (e0, e1) = (Event::new(gpu, true)?, Event::new(gpu, true)?);
    let mut times = Vec::new();
    for i in 0..13 {
        e0.record(&stream)?;
        // SAFETY: two live buffers of `bytes` each.
        unsafe { stream.copy(b.addr(), a.addr(), bytes)? };
        e1.record(&stream)?;
        e1.synchronize(Instant::now() + Duration::from_secs(10))?;
        if i >= 3 {
            times.push(e1.elapsed_ms(&e0)? as f64 / 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * bytes as f64 / times[times.len() / 2])
}

/// What one rank measured at one size.
struct Row {
    bytes: usize,
    symmetric: bool,
    secs: f64,
    wrong: usize,
}

/// One rank's part of the whole benchmark: every size staged and symmetric, then a graph replay.
///
/// `ready` is called once this rank has allocated everything, before its first collective: ranks that
/// share one context must not allocate (or load modules) while a peer's kernel waits for them.
fn rank_main(
    gpu: &Gpu,
    ar: &ResidentAllReduce,
    args: &Args,
    ready: &dyn Fn(),
    report: &mut dyn FnMut(Row),
) -> Result<usize, Error> {
    let rank = ar.rank();
    let world = ar.world();
    let max = args.max.next_multiple_of(4);
    let made = (|| {
        Ok::<_, Error>((
            Stream::new(gpu, Priority::High)?,
            Event::new(gpu, true)?,
            Event::new(gpu, true)?,
            DeviceBuffer::alloc(gpu, max)?,
            DeviceBuffer::alloc(gpu, max)?,
        ))
    })();
    // Every rank gets here, allocated or not, so that none waits for the others in vain.
    ready();
    let (stream, e0, e1, staged_in, staged_out) = made?;
    let (heap, _) = ar.heap();
    let deadline = || Instant::now() + Duration::from_millis(args.timeout_ms * 3);
    let mut collectives = 0usize;
    let mut bytes = args.min.max(4);
    while bytes <= max {
        let count = bytes / 4;
        let input: Vec<u8> = (0..count)
            .flat_map(|i| (((i % 13) + rank + 1) as f32).to_le_bytes())
            .collect();
        let expect = |i: usize| (world * (i % 13 + 1) + world * (world - 1) / 2) as f32;
        for symmetric in [false, true] {
            let (send, recv) = if symmetric {
                (heap, heap + max as u64)
            } else {
                (staged_in.addr(), staged_out.addr())
            };
            // SAFETY: both ranges lie in live device memory this rank owns (its staging
            // buffers, or its heap sized for two `max` buffers).
            unsafe {
                stream.copy(send, input.as_ptr() as u64, bytes)?;
                stream.fill(recv, 0xff, bytes)?;
            }
            let run = |n: usize, done: usize| -> Result<(), Error> {
                for _ in 0..n {
                    if args.die == Some(rank) && done > 3 {
                        eprintln!("rank {rank}: exiting mid-run, as --die asks");
                        std::process::exit(0);
                    }
                    // SAFETY: live buffers of `bytes`, untouched until the stream is synchronised.
                    unsafe {
                        ar.all_reduce(&stream, send, recv, count, DType::F32, ReduceOp::Sum)?
                    };
                }
                Ok(())
            };
            run(3, collectives)?;
            collectives += 3;
            e0.record(&stream)?;
            run(args.iters, collectives)?;
            collectives += args.iters;
            e1.record(&stream)?;
            e1.synchronize(deadline())?;
            ar.status()?;
            let secs = e1.elapsed_ms(&e0)? as f64 / 1e3 / args.iters as f64;
            let mut out = vec![0u8; bytes];
            // SAFETY: `recv` holds `bytes` written by the finished collectives.
            unsafe { stream.copy(out.as_mut_ptr() as u64, recv, bytes)? };
            stream.synchronize(deadline())?;
            let wrong = out
                .chunks_exact(4)
                .enumerate()
                .filter(|(i, c)| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != expect(*i))
                .count();
            report(Row {
                bytes,
                symmetric,
                secs,
                wrong,
            });
        }
        bytes *= 4;
    }
    // A captured collective replayed 100 times: the epochs advance on the device, so each replay is a
    // new collective. In place, each replay multiplies by the world size: f64 starting at 2^-1000
    // stays exact (at most 8^100 = 2^300 later), and the result is the same product computed here.
    let count = (1usize << 20) / 8;
    let start = f64::powi(2.0, -1000);
    let input: Vec<u8> = (0..count).flat_map(|_| start.to_le_bytes()).collect();
    // SAFETY: the staging input buffer holds at least 1 MiB (the caller's --max is checked).
    unsafe { stream.copy(staged_in.addr(), input.as_ptr() as u64, input.len())? };
    stream.synchronize(deadline())?;
    stream.begin_capture()?;
    // SAFETY: in place on the live input buffer; captured, run by the replays below.
    let captured = unsafe {
        ar.all_reduce(
            &stream,
            staged_in.addr(),
            staged_in.addr(),
            count,
            DType::F64,
            ReduceOp::Sum,
        )
    };
    let graph = stream.end_capture();
    captured?;
    let graph = graph?;
    let replays = 100usize;
    for _ in 0..replays {
        graph.launch(&stream)?;
    }
    stream.synchronize(deadline())?;
    ar.status()?;
    let mut out = vec![0u8; input.len()];
    // SAFETY: the input buffer after the replays.
    unsafe { stream.copy(out.as_mut_ptr() as u64, staged_in.addr(), out.len())? };
    stream.synchronize(deadline())?;
    let mut want = start;
    for _ in 0..replays {
        want *= world as f64;
    }
    let mut w = [0u8; 8];
    let graph_wrong = out
        .chunks_exact(8)
        .filter(|c| {
            w.copy_from_slice(c);
            f64::from_le_bytes(w).to_bits() != want.to_bits()
        })
        .count();
    Ok(graph_wrong)
}

fn print_header(world: usize, copy: f64, how: &str) {
    let bound = copy * (world - 1) as f64 / (world * world) as f64 / 1e9;
    println!(
        "# device-resident all-reduce, f32 sum, {world} ranks ({how}) on one GPU; copy bandwidth {:.0} GB/s \
         (read + written); bound busbw C(n-1)/n^2 = {bound:.1} GB/s",
        copy / 1e9
    );
    println!(
        "# {:>12} {:>10} {:>9} {:>10} {:>9} {:>9} {:>7} {:>7}",
        "size", "count", "buffers", "time(us)", "algbw", "busbw", "%bound", "#wrong"
    );
}

fn print_row(world: usize, copy: f64, r: &Row) {
    let algbw = r.bytes as f64 / r.secs / 1e9;
    let busbw = algbw * 2.0 * (world - 1) as f64 / world as f64;
    let bound = copy * (world - 1) as f64 / (world * world) as f64 / 1e9;
    println!(
        "  {:>12} {:>10} {:>9} {:>10.2} {:>9.2} {:>9.2} {:>6.1}% {:>7}",
        r.bytes,
        r.bytes / 4,
        if r.symmetric { "symmetric" } else { "staged" },
        r.secs * 1e6,
        algbw,
        busbw,
        if world > 1 {
            100.0 * busbw / bound
        } else {
            0.0
        },
        r.wrong
    );
}

fn layout(args: &Args) -> WindowLayout {
    WindowLayout::new(16 << 20, 2 * args.max.next_multiple_of(4) + 4096)
}

fn blocks(gpu: &Gpu, world: usize) -> Result<usize, Error> {
    Ok((gpu.multiprocessors()? as usize / world).clamp(1, MAX_BLOCKS))
}

/// Ranks as threads of this process.
fn threads(args: &Args) -> Result<bool, Error> {
    let gpu = Gpu::open(0)?;
    let copy = copy_bandwidth(&gpu)?;
    let layout = layout(args);
    let stream = Stream::new(&gpu, Priority::Normal)?;
    let windows: Vec<DeviceBuffer> = (0..args.ranks)
        .map(|_| DeviceBuffer::alloc(&gpu, layout.bytes()))
        .collect::<Result<_, _>>()?;
    for w in &windows {
        // SAFETY: the whole of a live window.
        unsafe { stream.fill(w.addr(), 0, w.len())? };
    }
    stream.synchronize(Instant::now() + Duration::from_secs(10))?;
    let addrs: Vec<u64> = windows.iter().map(DeviceBuffer::addr).collect();
    let max_blocks = blocks(&gpu, args.ranks)?;
    print_header(args.ranks, copy, "threads of one process");
    let rows = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let setup = std::sync::Barrier::new(args.ranks);
    let results: Vec<Result<usize, Error>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.ranks)
            .map(|r| {
                let (gpu, addrs, rows, setup) = (gpu.clone(), addrs.clone(), rows.clone(), &setup);
                s.spawn(move || {
                    let made = ResidentAllReduce::new(
                        &gpu,
                        r,
                        addrs,
                        layout,
                        max_blocks,
                        Duration::from_millis(args.timeout_ms),
                    )
                    .and_then(|ar| {
                        ar.prepare(DType::F32, ReduceOp::Sum)?;
                        ar.prepare(DType::F64, ReduceOp::Sum)?;
                        Ok(ar)
                    });
                    let ar = match made {
                        Ok(ar) => ar,
                        Err(e) => {
                            setup.wait();
                            return Err(e);
                        }
                    };
                    let ready = || {
                        setup.wait();
                    };
                    rank_main(&gpu, &ar, args, &ready, &mut |row| {
                        rows.lock().push((r, row))
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Internal("a rank panicked".into())))
            })
            .collect()
    });
    let mut ok = true;
    let rows = rows.lock();
    for (r, row) in rows.iter() {
        if *r == 0 {
            let wrong: usize = rows
                .iter()
                .filter(|(_, o)| o.bytes == row.bytes && o.symmetric == row.symmetric)
                .map(|(_, o)| o.wrong)
                .sum();
            ok &= wrong == 0;
            print_row(
                args.ranks,
                copy,
                &Row {
                    wrong,
                    bytes: row.bytes,
                    symmetric: row.symmetric,
                    secs: row.secs,
                },
            );
        }
    }
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(0) => println!("# rank {r}: graph of one all-reduce replayed 100 times: exact"),
            Ok(n) => {
                ok = false;
                println!("# rank {r}: graph replays: {n} wrong elements")
            }
            Err(e) => {
                ok = false;
                println!("# rank {r}: {e}")
            }
        }
    }
    Ok(ok)
}

/// Ranks as processes: this one launches them and passes their windows' descriptors around.
fn launcher(args: &Args) -> Result<bool, Error> {
    let gpu = Gpu::open(0)?;
    let copy = copy_bandwidth(&gpu)?;
    drop(gpu);
    let name = format!("braid-resident-bench-{}", std::process::id());
    let addr = SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| Error::io("the bench's socket", e))?;
    let listener =
        UnixListener::bind_addr(&addr).map_err(|e| Error::io("binding the bench's socket", e))?;
    let exe = std::env::current_exe().map_err(|e| Error::io("finding this program", e))?;
    let mut kids = Vec::new();
    for r in 0..args.ranks {
        let mut cmd = Command::new(&exe);
        cmd.args(std::env::args().skip(1))
            .arg("--child")
            .arg(format!("{r},{name},{copy}"));
        kids.push(cmd.spawn().map_err(|e| Error::io("starting a rank", e))?);
    }
    // Every rank's offer (with its descriptor), then every rank gets all of them in rank order.
    let mut socks = Vec::new();
    let mut offers: Vec<Option<_>> = (0..args.ranks).map(|_| None).collect();
    for _ in 0..args.ranks {
        let (sock, _) = listener
            .accept()
            .map_err(|e| Error::io("accepting a rank", e))?;
        let mut rank = [0u8; 4];
        (&sock)
            .read_exact(&mut rank)
            .map_err(|e| Error::io("reading a rank", e))?;
        let mut offer = [0u8; OFFER_BYTES];
        let fd = recv_msg(&sock, &mut offer)?;
        let r = u32::from_le_bytes(rank) as usize;
        offers[r.min(args.ranks - 1)] = Some((offer, fd));
        socks.push(sock);
    }
    for sock in &socks {
        for o in offers.iter().flatten() {
            send_msg(sock, &o.0, o.1.as_ref().map(|f| f.as_fd()))?;
        }
    }
    let mut ok = true;
    for mut k in kids {
        let st = k.wait().map_err(|e| Error::io("waiting for a rank", e))?;
        ok &= st.success();
    }
    Ok(ok)
}

fn child(args: &Args, rank: usize, socket: &str, copy: f64) -> Result<bool, Error> {
    let gpu = Gpu::open(0)?;
    let layout = layout(args);
    let memory = CudaMemory::new(&gpu)?;
    let bytes = layout.bytes().next_multiple_of(memory.granularity());
    let (own, shared) = memory.allocate(bytes)?;
    let addr = SocketAddr::from_abstract_name(socket.as_bytes())
        .map_err(|e| Error::io("the bench's socket", e))?;
    let sock =
        UnixStream::connect_addr(&addr).map_err(|e| Error::io("connecting to the launcher", e))?;
    (&sock)
        .write_all(&(rank as u32).to_le_bytes())
        .map_err(|e| Error::io("sending the rank", e))?;
    let fd = match &shared {
        Shareable::Fd(fd) => Some(fd.as_fd()),
        Shareable::Handle(_) => None,
    };
    send_msg(&sock, &encode_offer(bytes, &shared)?, fd)?;
    let mut peers: Vec<Box<dyn DeviceAllocation>> = Vec::new();
    let mut addrs = Vec::new();
    for q in 0..args.ranks {
        let mut offer = [0u8; OFFER_BYTES];
        let fd = recv_msg(&sock, &mut offer)?;
        let (len, shareable) = decode_offer(&offer, fd).map_err(Error::Bootstrap)?;
        if q == rank {
            addrs.push(own.addr());
            continue;
        }
        let mapped = memory.import(shareable, len)?;
        addrs.push(mapped.addr());
        peers.push(mapped);
    }
    let ar = ResidentAllReduce::new(
        &gpu,
        rank,
        addrs,
        layout,
        blocks(&gpu, args.ranks)?,
        Duration::from_millis(args.timeout_ms),
    )?;
    ar.prepare(DType::F32, ReduceOp::Sum)?;
    ar.prepare(DType::F64, ReduceOp::Sum)?;
    if rank == 0 {
        print_header(args.ranks, copy, "processes, CUDA IPC");
    }
    let mut wrong_total = 0;
    let result = rank_main(&gpu, &ar, args, &|| (), &mut |row| {
        wrong_total += row.wrong;
        if rank == 0 {
            print_row(args.ranks, copy, &row);
        } else if row.wrong > 0 {
            println!("# rank {rank}: {} wrong at {} bytes", row.wrong, row.bytes);
        }
    });
    match result {
        Ok(graph_wrong) => {
            if rank == 0 {
                println!("# graph of one all-reduce replayed 100 times: {graph_wrong} wrong elements on rank 0");
            }
            Ok(wrong_total == 0 && graph_wrong == 0)
        }
        Err(e) => {
            println!("# rank {rank}: {e}");
            Ok(false)
        }
    }
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(Some(a)) => a,
        Ok(None) => return ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("resident_bench: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match (&args.child, args.procs) {
        (Some((r, s, c)), _) => child(&args, *r, s, *c),
        (None, true) => launcher(&args),
        (None, false) => threads(&args),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("resident_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
