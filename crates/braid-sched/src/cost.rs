//! An alpha-beta-gamma cost model of the all-reduce schedules, and the exact traffic each one sends.
//!
//! A message of `s` bytes costs `α + s·β` on the path it is on, and combining a partial costs `γ` per
//! accumulator byte. Partials weigh `acc_bytes_factor` times the data (2 for f16/bf16, which accumulate
//! in f32), and a message carries at most one slot (`chunk_bytes`) of partials: a range needs
//! `⌈partial bytes / chunk_bytes⌉` messages. With `n` ranks and `B` bytes (`f` the factor):
//!
//! - ring: each of `k = ⌈fB/n / chunk_bytes⌉` chunk positions goes once around the ring, `n−1` partial
//!   hops (each combined) then `n−1` result hops: `2(n−1)k·α + (n−1)/n·B·((1+f)β + fγ)`.
//! - tree: each half takes `k = ⌈fB/2 / chunk_bytes⌉` chunks. The first crosses the height `h` up and
//!   down (`2h` hops, each node combining two children), then the pipeline delivers one chunk per
//!   period, the time the busiest rank spends per chunk position on both trees (its messages, bytes
//!   sent and bytes combined).
//! - rhd: `log2 p` exchanges of halving sizes, each in pieces, combined on the way down and copied on
//!   the way back (`p` the largest power of two `≤ n`), plus the fold in and out for the `n − p` extra
//!   ranks. Not pipelined: the steps add up.
//! - direct: `⌈fB / chunk_bytes⌉` rounds of one hop; each rank sends `B` to `n−1` peers and combines
//!   `n−1` contributions.
//!
//! The model ranks algorithms; its absolute numbers are only as good as `α`, `β` and `γ`.

use crate::{chunks_needed, partition, rhd, tree};

/// Costs of one link, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkCost {
    /// Latency of one message.
    pub alpha_us: f64,
    /// Time per byte moved between ranks.
    pub beta_us_per_byte: f64,
    /// Time per (accumulator) byte reduced.
    pub gamma_us_per_byte: f64,
}

/// The modelled time, in microseconds, of an all-reduce of `bytes` bytes on `world` ranks with
/// algorithm `algo` (`"ring"`, `"tree"`, `"rhd"` or `"direct"`; any other name costs infinity, so a
/// selector never picks it). Partials weigh `acc_bytes_factor` times the data; a message carries at
/// most `chunk_bytes` bytes of partials. One rank costs nothing.
pub fn all_reduce_cost(
    algo: &str,
    world: usize,
    bytes: usize,
    acc_bytes_factor: f64,
    chunk_bytes: usize,
    link: &LinkCost,
) -> f64 {
    if !matches!(algo, "ring" | "tree" | "rhd" | "direct") {
        return f64::INFINITY;
    }
    if world <= 1 {
        return 0.0;
    }
    let (a, be, g) = (link.alpha_us, link.beta_us_per_byte, link.gamma_us_per_byte);
    let (n, b, f) = (world as f64, bytes as f64, acc_bytes_factor);
    let slot = chunk_bytes.max(1) as f64;
    // Messages for a range of `partial` accumulator bytes (at least one).
    let msgs = |partial: f64| (partial / slot).ceil().max(1.0);
    match algo {
        "ring" => {
            let k = msgs(b * f / n);
            2.0 * (n - 1.0) * k * a + (n - 1.0) / n * b * ((1.0 + f) * be + f * g)
        }
        "tree" => {
            let k = msgs(b * f / 2.0);
            let (sp, sd) = (b * f / 2.0 / k, b / 2.0 / k);
            let h = tree::height(world) as f64;
            let fill = h * (a + sp * be + 2.0 * sp * g) + h * (a + sd * be);
            let period = (0..world)
                .map(|r| {
                    tree::double_tree(world, r)
                        .iter()
                        .map(|node| {
                            let up = if node.parent.is_some() { 1.0 } else { 0.0 };
                            let kids = node.children.len() as f64;
                            up * (a + sp * be) + kids * (a + sd * be + sp * g)
                        })
                        .sum::<f64>()
                })
                .fold(0.0, f64::max);
            // Interior nodes accumulate in scratch: one more pass over the data.
            fill + (k - 1.0) * period + b * f * g
        }
        "rhd" => {
            let p = rhd::fold_size(world);
            let mut t = 0.0;
            let mut part = b;
            for _ in 0..p.trailing_zeros() {
                part /= 2.0;
                t += 2.0 * msgs(part * f) * a + part * (f * be + f * g) + part * be;
            }
            if p < world {
                t += 2.0 * msgs(b * f) * a + b * (f * be + f * g) + b * be;
            }
            // The whole buffer is loaded into scratch first and is not pipelined with the exchanges.
            t + b * f * g
        }
        "direct" => msgs(b * f) * a + (n - 1.0) * b * (be + f * g),
        _ => f64::INFINITY,
    }
}

/// What rank `rank` sends in the all-reduce schedule `algo` (`"ring"`, `"tree"`, `"rhd"` or `"direct"`)
/// of `count` elements of `elem_bytes` bytes (partials `acc_bytes`), `chunk` elements per message:
/// `(messages, payload bytes)`, exactly as the schedule's actions do.
///
/// # Panics
///
/// On an unknown algorithm, a rank outside the world or a zero chunk.
pub fn all_reduce_traffic(
    algo: &str,
    world: usize,
    rank: usize,
    count: usize,
    elem_bytes: usize,
    acc_bytes: usize,
    chunk: usize,
) -> (usize, usize) {
    assert!(
        matches!(algo, "ring" | "tree" | "rhd" | "direct"),
        "unknown algorithm {algo:?}"
    );
    assert!(rank < world, "rank {rank} out of range for world {world}");
    assert!(chunk > 0, "chunk of zero elements");
    if world == 1 {
        return (0, 0);
    }
    let n = world;
    let pieces = |len: usize| len.div_ceil(chunk);
    match algo {
        "ring" => {
            // Partials of every segment but its own, results of every segment but the next rank's, in
            // 2(n-1) messages per chunk position (empty ones included).
            let segs = partition(count, n);
            let positions = chunks_needed(&segs, chunk);
            let partials = count - segs[rank].len();
            let results = count - segs[(rank + 1) % n].len();
            (
                2 * (n - 1) * positions,
                partials * acc_bytes + results * elem_bytes,
            )
        }
        "direct" => {
            let positions = chunks_needed(std::slice::from_ref(&(0..count)), chunk);
            ((n - 1) * positions, (n - 1) * count * elem_bytes)
        }
        "tree" => {
            // Per tree: the half goes up once (partials) and down to each child (results).
            let halves = partition(count, 2);
            let mut out = (0, 0);
            for (node, half) in tree::double_tree(n, rank).iter().zip(&halves) {
                let up = usize::from(node.parent.is_some());
                let kids = node.children.len();
                out.0 += pieces(half.len()) * (up + kids);
                out.1 += half.len() * (up * acc_bytes + kids * elem_bytes);
            }
            out
        }
        "rhd" => {
            let p = rhd::fold_size(n);
            if rank >= p {
                return (pieces(count), count * acc_bytes);
            }
            let mut out = (0, 0);
            let mut cur = 0..count;
            for k in 0..p.trailing_zeros() {
                let (keep, give) = rhd::halves(&cur, rank >> k & 1 == 1);
                // Halving gives `give` away as partials; doubling later sends `keep`, finished.
                out.0 += pieces(give.len()) + pieces(keep.len());
                out.1 += give.len() * acc_bytes + keep.len() * elem_bytes;
                cur = keep;
            }
            if rank + p < n {
                out.0 += pieces(count);
                out.1 += count * elem_bytes;
            }
            out
        }
        _ => unreachable!("checked above"),
    }
}
