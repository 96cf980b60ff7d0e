//! The physical bound each size is compared with: this machine's memory bandwidth, measured by one
//! process producing the same bytes locally (or, for `--shared`, the traffic of the shared path).

use std::time::Instant;

use braid::{Collective, DType, ReduceOp};
use braid_core::reduce::{self, Src};
use serde::Serialize;

#[derive(Serialize)]
pub(super) struct Bound {
    pub(super) size: usize,
    pub(super) time_us: f64,
    pub(super) busbw: f64,
}

/// Longest time [`measure_bound`] measures for, whatever `iters` asks: the other ranks wait meanwhile.
const BOUND_BUDGET: std::time::Duration = std::time::Duration::from_millis(50);

/// Seconds per `out = a + b` (or, with `copy`, `out = a`) over `bytes` bytes: the average of at most
/// `iters` runs, fewer when they would take longer than [`BOUND_BUDGET`] (at least one run).
pub(super) fn measure_bound(bytes: usize, iters: usize, dtype: DType, copy: bool) -> f64 {
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
pub(super) fn shared_bound(
    c: Collective,
    bytes: usize,
    world: usize,
    iters: usize,
    dtype: DType,
) -> f64 {
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

#[cfg(test)]
mod tests {
    use super::*;

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
