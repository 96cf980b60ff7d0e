//! `braid soak`: many collectives of changing kinds and sizes, each result checked exactly, with this
//! process's descriptors and resident memory sampled after a warm-up and at the end, so a leak or a
//! wrong result in a long run shows.

use std::time::Instant;

use braid::{Communicator, Error, ReduceOp};

/// What a soak run is asked to do.
pub struct SoakArgs {
    /// Collectives per rank.
    pub iters: u64,
    /// Largest message, in f32 elements.
    pub max_elems: usize,
}

/// What one rank saw.
#[derive(Clone, Copy, Debug)]
pub struct SoakReport {
    /// Collectives run.
    pub ops: u64,
    /// Results that were not exactly what every rank must get.
    pub wrong: u64,
    /// Open descriptors after the warm-up and at the end.
    pub fds: (usize, usize),
    /// Resident memory (KiB) after the warm-up and at the end.
    pub rss_kib: (u64, u64),
    /// Seconds the run took.
    pub seconds: f64,
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Sizes visited in turn: small, odd and large.
fn size_of_step(i: u64, max: usize) -> usize {
    const SIZES: [usize; 8] = [1, 2, 7, 64, 1000, 4099, 65536, 262_147];
    SIZES[(i % SIZES.len() as u64) as usize].min(max.max(1))
}

/// Every rank's value at element `j` of step `i`: small integers, so every sum is exact in f32.
fn value(rank: usize, i: u64, j: usize) -> f32 {
    ((rank as u64 * 7 + i * 3 + j as u64) % 17) as f32
}

/// Runs the soak on `comm`.
pub fn run(comm: &Communicator, args: &SoakArgs) -> Result<SoakReport, Error> {
    let (me, n) = (comm.rank(), comm.world_size());
    let warmup = (args.iters / 10).max(1);
    let mut wrong = 0u64;
    let mut first = (0, 0);
    let start = Instant::now();
    for i in 0..args.iters {
        if i == warmup {
            first = (open_fds(), rss_kib());
        }
        let len = size_of_step(i, args.max_elems);
        let ok = match i % 4 {
            0 => {
                let mut x: Vec<f32> = (0..len).map(|j| value(me, i, j)).collect();
                comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
                x.iter()
                    .enumerate()
                    .all(|(j, v)| *v == (0..n).map(|r| value(r, i, j)).sum::<f32>())
            }
            1 => {
                let root = (i as usize / 4) % n;
                let mut x: Vec<f32> = (0..len).map(|j| value(me, i, j)).collect();
                comm.broadcast_in_place(&mut x, root)?;
                x.iter().enumerate().all(|(j, v)| *v == value(root, i, j))
            }
            2 => {
                let send: Vec<f32> = (0..len).map(|j| value(me, i, j)).collect();
                let mut out = vec![0.0f32; len * n];
                comm.all_gather(&send, &mut out)?;
                out.chunks(len.max(1))
                    .enumerate()
                    .all(|(r, c)| c.iter().enumerate().all(|(j, v)| *v == value(r, i, j)))
            }
            _ => {
                let send: Vec<f32> = (0..len * n).map(|j| value(me, i, j)).collect();
                let mut out = vec![0.0f32; len];
                comm.reduce_scatter(&send, &mut out, ReduceOp::Sum)?;
                out.iter()
                    .enumerate()
                    .all(|(j, v)| *v == (0..n).map(|r| value(r, i, me * len + j)).sum::<f32>())
            }
        };
        if !ok {
            wrong += 1;
        }
    }
    if args.iters <= warmup {
        first = (open_fds(), rss_kib());
    }
    Ok(SoakReport {
        ops: args.iters,
        wrong,
        fds: (first.0, open_fds()),
        rss_kib: (first.1, rss_kib()),
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Resident memory may grow this much after the warm-up (allocator and page-cache noise) before it
/// counts as growth.
pub const RSS_SLACK_KIB: u64 = 16 * 1024;

impl SoakReport {
    /// Whether the run is clean: nothing wrong, no descriptor or memory growth.
    pub fn clean(&self) -> bool {
        self.wrong == 0
            && self.fds.1 <= self.fds.0
            && self.rss_kib.1 <= self.rss_kib.0 + RSS_SLACK_KIB
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_values_keep_sums_exact() {
        assert_eq!(size_of_step(6, 100), 100);
        assert_eq!(size_of_step(0, 100), 1);
        // The largest sum over 64 ranks stays far below 2^24.
        assert!((0..64).map(|r| value(r, 5, 9)).sum::<f32>() < 16.0 * 64.0 + 1.0);
    }

    #[test]
    fn a_wrong_result_or_growth_is_not_clean() {
        let ok = SoakReport {
            ops: 1,
            wrong: 0,
            fds: (10, 10),
            rss_kib: (1000, 1000 + RSS_SLACK_KIB),
            seconds: 0.0,
        };
        assert!(ok.clean());
        assert!(!SoakReport { wrong: 1, ..ok }.clean());
        assert!(!SoakReport {
            fds: (10, 11),
            ..ok
        }
        .clean());
        assert!(!SoakReport {
            rss_kib: (1000, 1001 + RSS_SLACK_KIB),
            ..ok
        }
        .clean());
    }
}
