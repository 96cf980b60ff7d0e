//! `braid perf`: the all-reduce benchmark, in nccl-tests' columns.
//!
//! Inputs are small integers (or powers of two for prod), so the exact result is known whatever the
//! reduction order and `#wrong` counts real errors. Times are the slowest rank's average per iteration.
//! Alongside, rank 0 measures the memory-bandwidth bound of this machine: one process computing
//! `out = a + b` over the same bytes, the least memory traffic an all-reduce result needs.

use std::time::Instant;

use braid::{Algo, Collective, Communicator, DType, Error, ReduceOp};
use braid_core::exact::{expected, fill, wrong};
use braid_core::reduce::{self, Src};
use serde::Serialize;

/// What to measure.
#[derive(Clone, Debug)]
pub struct PerfArgs {
    pub min_bytes: usize,
    pub max_bytes: usize,
    pub factor: usize,
    pub iters: usize,
    pub warmup: usize,
    pub dtype: DType,
    pub op: ReduceOp,
    pub check: bool,
    pub json: Option<String>,
    /// `None`: braid chooses; a name forces it; `all` measures every all-reduce algorithm.
    pub algo: Option<String>,
    pub plot: Option<String>,
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
    ip: Cell,
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

/// Seconds per `out = a + b` over `bytes` bytes: the average of at most `iters` runs, fewer when they
/// would take longer than [`BOUND_BUDGET`] (at least one run).
fn measure_bound(bytes: usize, iters: usize, dtype: DType) -> f64 {
    let a = vec![1u8; bytes];
    let b = vec![2u8; bytes];
    let mut out = vec![0u8; bytes];
    let run = |out: &mut [u8]| {
        reduce::reduce_ordered(dtype, ReduceOp::Max, out, &[Src::Buf(&a), Src::Buf(&b)])
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

/// One rank's benchmark state: the buffers, reused across sizes.
struct Bench<'a> {
    comm: &'a Communicator,
    a: &'a PerfArgs,
    send: Vec<u8>,
    recv: Vec<u8>,
    factor: f64,
}

impl Bench<'_> {
    /// Checks one call against `want` (when checking), then times `iters` calls; the slowest rank's
    /// average and the wrong elements summed over ranks.
    fn measure(&mut self, bytes: usize, in_place: bool, want: &[u8]) -> Result<Cell, Error> {
        let (comm, a) = (self.comm, self.a);
        let (dtype, op, rank) = (a.dtype, a.op, comm.rank());
        let (send, recv) = (&mut self.send, &mut self.recv);
        let once = |send: &mut [u8], recv: &mut [u8]| -> Result<(), Error> {
            if in_place {
                comm.all_reduce_bytes_in_place(&mut recv[..bytes], dtype, op)
            } else {
                comm.all_reduce_bytes(&send[..bytes], &mut recv[..bytes], dtype, op)
            }
        };
        let mut w = 0;
        if a.check {
            fill(&mut send[..bytes], dtype, op, rank);
            fill(
                &mut recv[..bytes],
                dtype,
                op,
                if in_place { rank } else { rank + 1000 },
            );
            once(send, recv)?;
            w = wrong(&recv[..bytes], want, dtype.size());
        }
        for _ in 0..a.warmup {
            once(send, recv)?;
        }
        let wrong = sum_over_ranks(comm, w)?;
        let secs = self.time_only(bytes, in_place)?;
        let algbw = bytes as f64 / secs / 1e9;
        Ok(Cell {
            time_us: secs * 1e6,
            algbw,
            busbw: algbw * self.factor,
            wrong,
        })
    }

    /// Times `iters` calls after a barrier: the slowest rank's average, in seconds.
    fn time_only(&mut self, bytes: usize, in_place: bool) -> Result<f64, Error> {
        let (comm, a) = (self.comm, self.a);
        let (send, recv) = (&self.send[..bytes], &mut self.recv[..bytes]);
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..a.iters {
            if in_place {
                comm.all_reduce_bytes_in_place(recv, a.dtype, a.op)?;
            } else {
                comm.all_reduce_bytes(send, recv, a.dtype, a.op)?;
            }
        }
        max_over_ranks(comm, t.elapsed().as_secs_f64() / a.iters.max(1) as f64)
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
    let (dtype, op, es) = (a.dtype, a.op, a.dtype.size());
    let sizes = sweep(a.min_bytes, a.max_bytes, a.factor);
    let max = sizes.iter().copied().max().unwrap_or(0) / es * es;
    let factor = if world > 1 {
        2.0 * (world - 1) as f64 / world as f64
    } else {
        1.0
    };
    let mut bench = Bench {
        comm,
        a,
        send: vec![0u8; max],
        recv: vec![0u8; max],
        factor,
    };
    let candidates: Vec<Algo> = match a.algo.as_deref() {
        Some("all") => Collective::AllReduce.algos().to_vec(),
        Some(list) => list
            .split(',')
            .map(str::parse::<Algo>)
            .collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let all_algos = candidates.len() > 1;
    if let [only] = candidates[..] {
        comm.set_algorithm(Collective::AllReduce, Some(only))?;
    }
    if rank == 0 {
        println!(
            "# braid perf: {world} ranks over {}, {} {}, {} iterations after {} warm-up",
            comm.transports_summary(),
            dtype,
            op,
            a.iters,
            a.warmup
        );
        if all_algos {
            print_algo_header(&candidates);
        } else {
            print_header();
        }
    }
    // Warm up once at the largest and the smallest size (page faults, slots, caches), as nccl-tests does.
    for bytes in [max, sizes.first().map_or(0, |s| s / es * es)] {
        for _ in 0..a.warmup.max(1) {
            let (s, r) = (&bench.send[..bytes], &mut bench.recv[..bytes]);
            comm.all_reduce_bytes(s, r, dtype, op)?;
        }
    }
    let mut report = Report {
        tool: "braid",
        ranks: world,
        dtype: dtype.name().into(),
        op: op.name().into(),
        iters: a.iters,
        warmup: a.warmup,
        results: vec![],
        algos: vec![],
        membw: vec![],
    };
    let mut total_wrong = 0;
    let mut busbw_sum = 0.0;
    let progress = crate::progress::Progress::new(rank == 0, sizes.len());
    for &size in &sizes {
        let count = size / es;
        let bytes = count * es;
        let want = if a.check {
            expected(bytes, dtype, op, world)
        } else {
            Vec::new()
        };
        let bound = if rank == 0 && bytes > 0 {
            measure_bound(bytes, a.iters.max(1), dtype)
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
            let (pick, _) = comm.algorithm(Collective::AllReduce, bytes);
            let mut cells = std::collections::BTreeMap::new();
            // Check and time each algorithm, then time them again in interleaved rounds: on a shared
            // machine a single batch is at the mercy of whatever else runs; the median of the rounds is not.
            let mut times: std::collections::BTreeMap<&'static str, Vec<f64>> = Default::default();
            for algo in &candidates {
                comm.set_algorithm(Collective::AllReduce, Some(*algo))?;
                let c = bench.measure(bytes, false, &want)?;
                total_wrong += c.wrong;
                times.entry(algo.name()).or_default().push(c.time_us / 1e6);
                cells.insert(algo.name(), c);
            }
            for _ in 1..ALGO_ROUNDS {
                for algo in &candidates {
                    comm.set_algorithm(Collective::AllReduce, Some(*algo))?;
                    let t = bench.time_only(bytes, false)?;
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
            comm.set_algorithm(Collective::AllReduce, None)?;
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
                        op,
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
            let oop = bench.measure(bytes, false, &want)?;
            let ip = bench.measure(bytes, true, &want)?;
            total_wrong += oop.wrong + ip.wrong;
            busbw_sum += oop.busbw;
            let algo = comm.algorithm(Collective::AllReduce, bytes).0.name();
            if rank == 0 {
                let pct = if bound_busbw > 0.0 {
                    100.0 * oop.busbw / bound_busbw
                } else {
                    0.0
                };
                progress.suspend(|| {
                    println!(
                        "  {:>10} {:>12} {:>8} {:>6} {:>6} | {:>10.2} {:>8.2} {:>8.2} {:>6} | {:>10.2} {:>8.2} {:>8.2} {:>6} | {:>8.2} {:>5.0}%",
                        bytes, count, dtype.name(), op.name(), algo,
                        oop.time_us, oop.algbw, oop.busbw, oop.wrong,
                        ip.time_us, ip.algbw, ip.busbw, ip.wrong,
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
            busbw_sum / sizes.len().max(1) as f64
        );
        if let Some(path) = &a.json {
            let text = serde_json::to_string_pretty(&report).expect("report serialises");
            std::fs::write(path, text).map_err(|e| Error::io(format!("writing {path}"), e))?;
        }
        if let Some(path) = &a.plot {
            crate::plot::busbw(path, &report_series(&report), world)
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
    op: ReduceOp,
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
        op.name(),
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
    fn the_memory_bound_takes_its_time_budget_not_its_iterations() {
        let t = Instant::now();
        let secs = measure_bound(1 << 20, 20_000, DType::F32);
        let took = t.elapsed();
        assert!(secs > 0.0 && secs.is_finite(), "{secs}");
        // 20000 runs over a MiB take seconds; the budget is 50 ms.
        assert!(took < std::time::Duration::from_secs(1), "took {took:?}");
        // Few iterations are all run.
        let t = Instant::now();
        assert!(measure_bound(64, 3, DType::F32) > 0.0);
        assert!(t.elapsed() < BOUND_BUDGET);
    }
}
