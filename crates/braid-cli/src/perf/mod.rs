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
//!
//! This file reads the arguments and runs the sweep; [`args`] is what is measured, [`shape`] the buffers
//! of one call, [`host`] and [`device`] the two benchmarks, [`bound`] the memory-bandwidth bound and
//! [`report`] what is printed, written and plotted.

mod args;
mod bound;
mod device;
mod host;
mod report;
mod shape;

use braid::{Algo, Collective, Communicator, Error, ReduceOp};

pub use args::PerfArgs;
use bound::{measure_bound, shared_bound, Bound};
use device::{DeviceBench, DEVICE_COLLECTIVES};
use host::{Bench, Expect, HostBuf, SendRegistration};
pub use report::median;
use report::{
    print_algo_header, print_algo_row, print_header, report_series, AlgoRow, Cell, Report, Row,
};
use shape::ROOT;
pub use shape::{busbw_factor, Shape};

/// The collectives `braid perf` measures, in the order its errors list them.
pub const COLLECTIVES: [Collective; 6] = [
    Collective::AllReduce,
    Collective::Broadcast,
    Collective::Reduce,
    Collective::AllGather,
    Collective::ReduceScatter,
    Collective::AllToAll,
];

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

/// Interleaved timing rounds per algorithm in `--algo all`.
const ALGO_ROUNDS: usize = 5;

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
}
