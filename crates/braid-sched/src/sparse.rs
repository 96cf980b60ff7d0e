//! The pure half of top-k's sparse all-reduce: which way the pairs go, how the index space is split
//! among the ranks, and exactly what each way sends.
//!
//! Top-k leaves every rank with `k` (index, value) pairs at indices of its own. There are two ways to
//! sum them, and a third for when sparsity no longer pays:
//!
//! * **All-gather** ([`SparseRoute::AllGather`]): every rank gets every rank's pairs and sums them in
//!   rank order. Exact (the result is the sum of the sparse updates), but each rank sends its `k` pairs
//!   to `n − 1` peers, `(n−1)·8k` bytes, more than a dense ring's `2(n−1)/n · 4·len` once `n·k > len`
//!   (beyond 10 ranks at 10% density).
//! * **Reduce-scatter, re-select, all-gather** ([`SparseRoute::ReduceScatter`], in the style of Ok-Topk,
//!   Li & Hoefler 2022): the index space is cut into `n` contiguous ranges ([`Partition`]); each rank
//!   sends rank `j` only its pairs that fall in range `j` ([`Partition::route`], then an all-to-all of
//!   blocks of any size, [`direct::all_to_all_v`](crate::direct::all_to_all_v)); rank `j` sums what it
//!   got in rank order, adds its second error buffer, keeps the [`quota`] largest of its range and
//!   all-gathers them ([`direct::all_gather_v`](crate::direct::all_gather_v)). A rank sends about
//!   `k·(n−1)/n` pairs, then `k/n` pairs to each of `n − 1` peers: `≈ 2·8k·(n−1)/n` bytes, flat in `n`.
//!   What a range owner drops stays in its second error buffer, as the two-phase int8 path's shard
//!   owners keep theirs; the result has about `k` non-zeros instead of up to `n·k`.
//! * **Dense** ([`SparseRoute::Dense`]): when the sparse data would be dense enough, the sparse updates
//!   are all-reduced densely (SparCML's switch).
//!
//! # The partition
//!
//! The ranges are balanced by *load*, the number of pairs each range receives in the reduce-scatter
//! (counting a pair once per rank that sent it): that is the work and the traffic to even out, and it
//! sets each owner's [`quota`], so balanced load also balances the all-gather. Each owner counts the
//! load it received in [`HISTOGRAM_BUCKETS`] equal sub-ranges of its range ([`Partition::histogram`]) and
//! sends the counts along with its quota, so after every reduce-scatter step all ranks hold the same
//! `n · HISTOGRAM_BUCKETS`-bucket histogram of where the selected indices fell, at no extra message.
//! [`Partition::rebalance`] turns it into the next step's ranges with integer arithmetic only, so every
//! rank computes the same boundaries. While the busiest range received at most [`REBALANCE_AT`] (5/4)
//! of the mean load, the partition stays; otherwise [`Partition::balanced`] cuts the cumulative weight `7·len·H(x) + W·x` into `n` equal
//! parts (`H` the histogram's cumulative count, linear within a bucket, `W` its total), so seven eighths
//! of the weight follow the observed load and one eighth is spread evenly, which keeps every range
//! shorter than about `8·len/n` however concentrated the load. The first step, and any step after a
//! reset, uses [`Partition::even`]. Gradients change slowly from step to step, so the last step's load
//! predicts the next one's; a prediction that is off costs balance, never correctness.
//!
//! # What goes on the wire
//!
//! Per peer, in order (all integers little-endian); `n` ranks, this rank `r`:
//!
//! | exchange | bytes to each peer | collective |
//! | --- | --- | --- |
//! | count: `k_r` as u64 (both sparse ways start with it) | [`COUNT_BYTES`] | all-gather |
//! | route: `c_rj`, the pairs for rank `j`, and the [`Partition::fingerprint`], u64 each | [`ROUTE_BYTES`] | all-to-all |
//! | pairs: `c_rj` u32 indices (ascending) then `c_rj` f32 values | `8·c_rj` | all-to-all of any sizes |
//! | load: quota `q_r`, then the [`HISTOGRAM_BUCKETS`] counts of the load `r` received, u64 each | [`LOAD_BYTES`] | all-gather |
//! | kept pairs: `q_r` u32 indices (ascending) then `q_r` f32 values | `8·q_r` | all-gather of any sizes |
//!
//! The all-gather way sends the count, then its encoded sparse tensor (a [`GATHER_HEADER_BYTES`] header
//! and `8·k_r` bytes) padded to the largest rank's. [`all_gather_bytes`], [`reduce_scatter_bytes`] and
//! [`dense_ring_bytes`] count these exactly; [`choose`] picks the way with them.
//!
//! ```
//! use braid_sched::sparse::{choose, traffic, SparsePath, SparseRoute};
//! // 64 ranks, a million elements, 10% density: gathering sends 31× what the reduce-scatter does.
//! let t = traffic(64, 1 << 20, 104_858);
//! assert!(t.all_gather > 30 * t.reduce_scatter && t.reduce_scatter < t.dense_ring);
//! assert_eq!(choose(SparsePath::Auto, 1 << 20, &[104_858; 64], 0.5), SparseRoute::ReduceScatter);
//! ```

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use braid_core::Error;

use crate::partition;

/// Bytes of an (index, value) pair: a u32 index and an f32 value.
pub const PAIR_BYTES: u64 = 8;
/// Bytes per peer of the count exchange both sparse ways start with (a rank's pairs, u64).
pub const COUNT_BYTES: u64 = 8;
/// Bytes of the all-gather way's envelope around its pairs: an encoded tensor's header (12) and count (4).
pub const GATHER_HEADER_BYTES: u64 = 16;
/// Bytes per peer of the reduce-scatter's route exchange: the pairs for that peer and the partition's
/// fingerprint, u64 each.
pub const ROUTE_BYTES: u64 = 16;
/// Sub-ranges of each owner's range in the load histogram.
pub const HISTOGRAM_BUCKETS: usize = 8;
/// Bytes per peer of the load exchange: the quota and the histogram, u64 each.
pub const LOAD_BYTES: u64 = 8 * (1 + HISTOGRAM_BUCKETS as u64);
/// [`Partition::rebalance`] keeps a partition whose busiest range received at most this fraction
/// (5/4) of the mean load. Above what a balanced partition leaves (the evenly spread eighth allows
/// about 8/7), so a balanced partition stays put.
pub const REBALANCE_AT: (u128, u128) = (5, 4);

/// Which way top-k's pairs may go (the configuration's choice; `BRAID_COMPRESS_SPARSE`). The default
/// is [`AllGather`](Self::AllGather), whose result is the exact sum of the ranks' sparse updates; the
/// reduce-scatter sends less from three ranks on but keeps only about `k` of the summed pairs, which
/// costs training quality at low density, so it is chosen, not defaulted to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SparsePath {
    /// The one the traffic model says sends less ([`choose`]).
    Auto,
    /// Always all-gather the pairs (exact sum of the sparse updates); the default.
    #[default]
    AllGather,
    /// Always reduce-scatter, re-select and all-gather (traffic flat in the rank count).
    ReduceScatter,
}

impl SparsePath {
    /// The text form: `auto`, `allgather`, `reducescatter`.
    pub fn name(self) -> &'static str {
        match self {
            SparsePath::Auto => "auto",
            SparsePath::AllGather => "allgather",
            SparsePath::ReduceScatter => "reducescatter",
        }
    }
}

impl fmt::Display for SparsePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SparsePath {
    type Err = Error;

    /// `auto`; `allgather` (also `all-gather`, `all_gather`, `ag`); `reducescatter` (also
    /// `reduce-scatter`, `reduce_scatter`, `rs`); any case, surrounding blanks ignored.
    fn from_str(s: &str) -> Result<Self, Error> {
        match s
            .trim()
            .to_ascii_lowercase()
            .replace(['-', '_'], "")
            .as_str()
        {
            "auto" => Ok(SparsePath::Auto),
            "allgather" | "ag" => Ok(SparsePath::AllGather),
            "reducescatter" | "rs" => Ok(SparsePath::ReduceScatter),
            _ => Err(Error::invalid(
                "not a sparse path; accepted: auto, allgather (ag), reducescatter (rs)",
            )),
        }
    }
}

/// The way one step's pairs go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SparseRoute {
    /// All-gather every rank's pairs, sum in rank order.
    AllGather,
    /// Reduce-scatter by range, re-select per range, all-gather the kept pairs.
    ReduceScatter,
    /// A dense all-reduce of the sparse updates.
    Dense,
}

/// The index space `0..len` cut into one contiguous range per rank, in rank order (ranges may be empty).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Partition {
    /// `n + 1` non-decreasing boundaries from 0 to `len`: range `j` is `bounds[j]..bounds[j + 1]`.
    bounds: Vec<usize>,
}

impl Partition {
    /// `len` elements in `n ≥ 1` ranges whose lengths differ by at most one ([`crate::partition`]).
    pub fn even(len: usize, n: usize) -> Partition {
        let parts = partition(len, n.max(1));
        let mut bounds = Vec::with_capacity(parts.len() + 1);
        bounds.push(0);
        bounds.extend(parts.iter().map(|r| r.end));
        Partition { bounds }
    }

    /// The partition with these boundaries: `n + 1 ≥ 2` of them, non-decreasing, from 0 (an error
    /// naming the first bad one otherwise).
    pub fn from_bounds(bounds: Vec<usize>) -> Result<Partition, Error> {
        if bounds.len() < 2 || bounds[0] != 0 {
            return Err(Error::invalid(format!(
                "a partition needs at least two boundaries starting at 0, got {bounds:?}"
            )));
        }
        if let Some(j) = bounds.windows(2).position(|w| w[0] > w[1]) {
            return Err(Error::invalid(format!(
                "partition boundary {j} ({}) is after boundary {} ({})",
                bounds[j],
                j + 1,
                bounds[j + 1]
            )));
        }
        Ok(Partition { bounds })
    }

    /// The number of ranges (ranks).
    pub fn ranks(&self) -> usize {
        self.bounds.len() - 1
    }

    /// The number of elements partitioned.
    pub fn len(&self) -> usize {
        self.bounds[self.bounds.len() - 1]
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `n + 1` boundaries.
    pub fn bounds(&self) -> &[usize] {
        &self.bounds
    }

    /// Range `j` (empty for `j` out of range).
    pub fn range(&self, j: usize) -> Range<usize> {
        match (self.bounds.get(j), self.bounds.get(j + 1)) {
            (Some(&a), Some(&b)) => a..b,
            _ => self.len()..self.len(),
        }
    }

    /// The rank whose range holds `index` (the last rank for an index past the end).
    pub fn owner(&self, index: usize) -> usize {
        (self.bounds.partition_point(|&b| b <= index) - 1).min(self.ranks() - 1)
    }

    /// For ascending `indices`, the positions in `indices` that fall in each range, in rank order: rank
    /// `j` gets `indices[route[j]]`. Indices at or past [`len`](Self::len) fall in no range.
    pub fn route(&self, indices: &[u32]) -> Vec<Range<usize>> {
        let mut start = 0;
        (1..self.bounds.len())
            .map(|j| {
                let end = self.bounds[j];
                let stop = start + indices[start..].partition_point(|&i| (i as usize) < end);
                let r = start..stop;
                start = stop;
                r
            })
            .collect()
    }

    /// A hash of the boundaries (FNV-1a over them as u64): ranks compare it before they exchange
    /// pairs, so a rank whose partition differs is a mismatch, never a silent misrouting.
    pub fn fingerprint(&self) -> u64 {
        self.bounds
            .iter()
            .flat_map(|b| (*b as u64).to_le_bytes())
            .fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
                (h ^ x as u64).wrapping_mul(0x0100_0000_01b3)
            })
    }

    /// The [`HISTOGRAM_BUCKETS`] sub-ranges of range `j` the load is counted in (lengths differing by at
    /// most one; empty ones when the range is shorter).
    pub fn sub_ranges(&self, j: usize) -> Vec<Range<usize>> {
        let r = self.range(j);
        partition(r.len(), HISTOGRAM_BUCKETS)
            .into_iter()
            .map(|s| s.start + r.start..s.end + r.start)
            .collect()
    }

    /// The load histogram of range `j`: how many of `indices` fall in each of its
    /// [`sub_ranges`](Self::sub_ranges). Indices outside the range are not counted.
    pub fn histogram(
        &self,
        j: usize,
        indices: impl IntoIterator<Item = u32>,
    ) -> [u64; HISTOGRAM_BUCKETS] {
        let r = self.range(j);
        let (len, b) = (r.len(), HISTOGRAM_BUCKETS);
        let (base, extra) = (len / b, len % b);
        let long = extra * (base + 1);
        let mut h = [0u64; HISTOGRAM_BUCKETS];
        for i in indices {
            let i = i as usize;
            if !r.contains(&i) {
                continue;
            }
            let p = i - r.start;
            // The first `extra` sub-ranges hold one element more ([`crate::partition`]).
            let bucket = if p < long {
                p / (base + 1)
            } else {
                extra + (p - long) / base
            };
            h[bucket] += 1;
        }
        h
    }

    /// The next step's partition, from the load this one received (`load` as for
    /// [`balanced`](Self::balanced)): this one while its busiest range received at most
    /// [`REBALANCE_AT`] times the mean load, else the balanced one. Keeping a partition that is good
    /// enough keeps each second error buffer with its owner and spares moving it.
    pub fn rebalance(&self, load: &[u64]) -> Partition {
        let n = self.ranks();
        if load.len() == n * HISTOGRAM_BUCKETS {
            let per: Vec<u128> = load
                .chunks(HISTOGRAM_BUCKETS)
                .map(|h| h.iter().map(|&x| x as u128).sum())
                .collect();
            let (most, total) = (
                per.iter().copied().max().unwrap_or(0),
                per.iter().sum::<u128>(),
            );
            let (num, den) = REBALANCE_AT;
            if total > 0 && most * n as u128 * den <= total * num {
                return self.clone();
            }
        }
        self.balanced(load)
    }

    /// The partition that evens out `load`, the counts this one's ranges received: [`HISTOGRAM_BUCKETS`]
    /// per range, rank-major (what every rank holds after a reduce-scatter step). Integer arithmetic
    /// only, so every rank computes the same boundaries; see the [module documentation](self) for the
    /// rule. A histogram of the wrong size, or one without load, gives [`Partition::even`].
    pub fn balanced(&self, load: &[u64]) -> Partition {
        let (n, len) = (self.ranks(), self.len());
        if load.len() != n * HISTOGRAM_BUCKETS || n == 1 {
            return Partition::even(len, n);
        }
        // Keep the counts' total within 2^32 (their shape is what matters), so that nothing below
        // overflows u128 for any length.
        let raw: u128 = load.iter().map(|&h| h as u128).sum();
        let shift = (128 - raw.leading_zeros()).saturating_sub(32);
        let h: Vec<u128> = load.iter().map(|&x| (x as u128) >> shift).collect();
        let w: u128 = h.iter().sum();
        if w == 0 || len == 0 {
            return Partition::even(len, n);
        }
        let l = len as u128;
        // Bucket `b` spans `span[b]` and weighs `7·len·h[b] + W·|span[b]|`; the total is `8·W·len`.
        let spans: Vec<Range<usize>> = (0..n).flat_map(|j| self.sub_ranges(j)).collect();
        let total = 8 * w * l;
        let mut bounds = Vec::with_capacity(n + 1);
        bounds.push(0);
        let (mut b, mut before) = (0usize, 0u128);
        for m in 1..n {
            let target = total * m as u128 / n as u128;
            // The bucket where the cumulative weight reaches the target.
            loop {
                let weight = 7 * l * h[b] + w * spans[b].len() as u128;
                if (before + weight >= target && weight > 0) || b + 1 == spans.len() {
                    let x = if weight == 0 {
                        spans[b].end
                    } else {
                        let into = (target.saturating_sub(before)).min(weight);
                        spans[b].start + (into * spans[b].len() as u128 / weight) as usize
                    };
                    let prev = bounds[bounds.len() - 1];
                    bounds.push(x.clamp(prev, len));
                    break;
                }
                before += weight;
                b += 1;
            }
        }
        bounds.push(len);
        Partition { bounds }
    }
}

/// How many pairs the owner of a range keeps after the reduce-scatter, given the `load` it received
/// from `n` ranks: `⌈load / n⌉`, at most the range's length. With every rank selecting `k` pairs and a
/// balanced partition, that is about `k/n` per range and `k` in all.
pub fn quota(load: u64, n: usize, range_len: usize) -> u64 {
    load.div_ceil(n.max(1) as u64).min(range_len as u64)
}

/// Bytes a rank sends on the all-gather way when the ranks select `counts[r]` pairs each: the count,
/// then the encoded pairs padded to the largest rank's, to every peer.
pub fn all_gather_bytes(counts: &[u64]) -> u64 {
    let n = counts.len() as u64;
    let most = counts.iter().copied().max().unwrap_or(0);
    n.saturating_sub(1) * (COUNT_BYTES + GATHER_HEADER_BYTES + PAIR_BYTES * most)
}

/// Bytes a rank sends on the reduce-scatter way among `n` ranks when it routes `off_rank` of its pairs
/// to other ranks and keeps `quota` pairs of its own range (exact; the count exchange included).
pub fn reduce_scatter_bytes(n: usize, off_rank: u64, quota: u64) -> u64 {
    let peers = n.saturating_sub(1) as u64;
    if peers == 0 {
        return 0;
    }
    peers * (COUNT_BYTES + ROUTE_BYTES + LOAD_BYTES) + PAIR_BYTES * (off_rank + peers * quota)
}

/// [`reduce_scatter_bytes`] before the routing is known, for the rank with `k` of the `total` pairs,
/// when the partition is balanced and the rank's indices spread like everyone's: `⌈k·(n−1)/n⌉` pairs off
/// the rank and a quota of `⌈⌈total/n⌉/n⌉`.
pub fn reduce_scatter_estimate(n: usize, k: u64, total: u64) -> u64 {
    let m = n.max(1) as u64;
    let off = (k * (m - 1)).div_ceil(m);
    reduce_scatter_bytes(n, off, total.div_ceil(m).div_ceil(m))
}

/// Bytes a rank sends in a ring all-reduce of `len` f32 elements: `2(n−1)/n · 4·len` (rounded down),
/// exact when `n` divides `len`.
pub fn dense_ring_bytes(n: usize, len: usize) -> u64 {
    let n = n.max(1) as u64;
    2 * (n - 1) * 4 * len as u64 / n
}

/// The bytes per rank of each way for `n` ranks that each select `k` of `len` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseTraffic {
    /// The all-gather way ([`all_gather_bytes`]).
    pub all_gather: u64,
    /// The reduce-scatter way, balanced ([`reduce_scatter_estimate`]).
    pub reduce_scatter: u64,
    /// A dense ring all-reduce of the gradient ([`dense_ring_bytes`]).
    pub dense_ring: u64,
}

/// The traffic model of the three ways for `n` ranks selecting `k` of `len` elements each.
pub fn traffic(n: usize, len: usize, k: u64) -> SparseTraffic {
    let counts = vec![k; n.max(1)];
    SparseTraffic {
        all_gather: all_gather_bytes(&counts),
        reduce_scatter: reduce_scatter_estimate(n, k, k * n.max(1) as u64),
        dense_ring: dense_ring_bytes(n, len),
    }
}

/// The way this step's pairs go, the same on every rank (it depends only on what all ranks know: the
/// configuration, `len` and every rank's count). `Auto` takes the reduce-scatter when the model says the
/// busiest rank sends less that way ([`reduce_scatter_estimate`] against [`all_gather_bytes`]), the
/// all-gather otherwise (on one or two ranks it always does: the two cost the same there, and
/// gathering is exact). Then the dense switch: the all-gather way goes dense when the ranks' pairs add
/// up to more than `dense_switch · len` (the union could be that dense), the reduce-scatter way when
/// the average rank's do (its ranges then hold that many).
pub fn choose(path: SparsePath, len: usize, counts: &[u64], dense_switch: f64) -> SparseRoute {
    let n = counts.len();
    let total: u64 = counts.iter().sum();
    let most = counts.iter().copied().max().unwrap_or(0);
    let route = match path {
        SparsePath::AllGather => SparseRoute::AllGather,
        SparsePath::ReduceScatter => SparseRoute::ReduceScatter,
        SparsePath::Auto => {
            if reduce_scatter_estimate(n, most, total) < all_gather_bytes(counts) {
                SparseRoute::ReduceScatter
            } else {
                SparseRoute::AllGather
            }
        }
    };
    let bound = dense_switch * len as f64;
    let dense = match route {
        SparseRoute::ReduceScatter => total as f64 > bound * n.max(1) as f64,
        _ => total as f64 > bound,
    };
    if dense {
        SparseRoute::Dense
    } else {
        route
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The weight `rebalance` gives `0..x` (in f64), for checking its cuts.
    fn weight(p: &Partition, load: &[u64], x: usize) -> f64 {
        let w: f64 = load.iter().map(|&h| h as f64).sum();
        let l = p.len() as f64;
        let spans: Vec<_> = (0..p.ranks()).flat_map(|j| p.sub_ranges(j)).collect();
        let mut f = w * x as f64;
        for (s, &h) in spans.iter().zip(load) {
            if x >= s.end {
                f += 7.0 * l * h as f64;
            } else if x > s.start {
                f += 7.0 * l * h as f64 * (x - s.start) as f64 / s.len() as f64;
            }
        }
        f
    }

    #[test]
    fn even_ranges_and_owners() {
        let p = Partition::even(10, 4);
        assert_eq!(p.bounds(), &[0, 3, 6, 8, 10]);
        assert_eq!((p.ranks(), p.len()), (4, 10));
        assert_eq!(p.range(2), 6..8);
        assert_eq!(p.range(9), 10..10);
        let owners: Vec<usize> = (0..12).map(|i| p.owner(i)).collect();
        assert_eq!(owners, [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3]);
        let q = Partition::even(2, 4);
        assert_eq!(q.bounds(), &[0, 1, 2, 2, 2]);
        assert_eq!(q.owner(1), 1);
        assert!(Partition::even(0, 3).is_empty());
    }

    #[test]
    fn bad_bounds_are_refused_with_the_reason() {
        for (b, why) in [
            (vec![], "at least two"),
            (vec![1, 4], "starting at 0"),
            (vec![0, 5, 3], "boundary 1 (5) is after boundary 2 (3)"),
        ] {
            let e = Partition::from_bounds(b).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
        }
        assert_eq!(
            Partition::from_bounds(vec![0, 3, 3, 9]).unwrap().range(1),
            3..3
        );
    }

    #[test]
    fn routing_splits_sorted_indices_by_range() {
        let p = Partition::from_bounds(vec![0, 4, 4, 10]).unwrap();
        let idx = [0u32, 3, 4, 9, 10, 12];
        assert_eq!(p.route(&idx), vec![0..2, 2..2, 2..4]);
        assert_eq!(p.route(&[]), vec![0..0, 0..0, 0..0]);
    }

    #[test]
    fn histogram_counts_sub_ranges() {
        // Range 1 is 10..29 (19 elements): sub-ranges of 3,3,3,2,2,2,2,2.
        let p = Partition::from_bounds(vec![0, 10, 29]).unwrap();
        let s = p.sub_ranges(1);
        assert_eq!(s[0], 10..13);
        assert_eq!(s[3], 19..21);
        assert_eq!(s[7], 27..29);
        let h = p.histogram(1, [10, 12, 13, 19, 20, 28, 5, 29]);
        assert_eq!(h, [2, 1, 0, 2, 0, 0, 0, 1]);
        // Shorter than the bucket count: one element per bucket, the rest empty.
        let p = Partition::from_bounds(vec![0, 3]).unwrap();
        assert_eq!(p.histogram(0, [0, 2, 2]), [1, 0, 2, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn rebalance_follows_the_load() {
        // All the load in the first eighth of rank 0's range: the cuts crowd in there.
        let p = Partition::even(8000, 4);
        let mut load = vec![0u64; 4 * HISTOGRAM_BUCKETS];
        load[0] = 1000;
        let q = p.balanced(&load);
        assert_eq!(p.rebalance(&load), q);
        // Weight: 7·8000·1000 in 0..250, 1000 per element everywhere; total 8·1000·8000, a quarter
        // is 16e6: the first cut at 16e6 / (7·8000·1000/250 + 1000) = 16e6 / 225000 → 71.
        assert_eq!(q.bounds(), &[0, 71, 142, 213, 8000]);
        // No load, or a histogram of the wrong size: even.
        assert_eq!(p.balanced(&vec![0; 32]), p);
        assert_eq!(p.balanced(&[1, 2, 3]), p);
        assert_eq!(q.rebalance(&[1, 2, 3]), p);
        // Uniform load: even (up to rounding).
        assert_eq!(p.balanced(&vec![5; 32]), p);
        // Load within a quarter of the mean on every range: the partition stays, even if another
        // would be better; beyond, it moves.
        let mut skewed = vec![5u64; 32];
        skewed[0] = 15; // range 0: 50 of a mean of 42.5
        assert_eq!(q.rebalance(&skewed), q);
        assert_ne!(q.balanced(&skewed), q);
        skewed[0] = 30; // range 0: 65, over 5/4 of the mean 46.25
        assert_eq!(q.rebalance(&skewed), q.balanced(&skewed));
    }

    proptest! {
        #[test]
        fn rebalance_cuts_equal_weights(len in 0usize..100_000, n in 1usize..70,
            load in proptest::collection::vec(prop_oneof![Just(0u64), 0u64..1000, any::<u64>()], 0..560),
            old in proptest::collection::vec(0usize..100_000, 0..70)) {
            // Any old partition of `len` (sorted cuts).
            let mut cuts: Vec<usize> = old.into_iter().map(|c| c % (len + 1)).take(n - 1).collect();
            cuts.resize(n - 1, len);
            cuts.sort();
            let mut bounds = vec![0];
            bounds.extend(cuts);
            bounds.push(len);
            let p = Partition::from_bounds(bounds).unwrap();
            let mut load = load;
            load.resize(n * HISTOGRAM_BUCKETS, 0);
            // Leave out sub-ranges that hold no elements (their load cannot be real).
            let spans: Vec<_> = (0..n).flat_map(|j| p.sub_ranges(j)).collect();
            for (h, s) in load.iter_mut().zip(&spans) {
                if s.is_empty() { *h = 0; }
            }
            let q = p.balanced(&load);
            let kept = p.rebalance(&load);
            prop_assert!(kept == q || kept == p);
            prop_assert_eq!(q.ranks(), n);
            prop_assert_eq!(q.len(), len);
            prop_assert!(Partition::from_bounds(q.bounds().to_vec()).is_ok());
            // Deterministic.
            prop_assert_eq!(&q, &p.balanced(&load));
            // Every cut within one element's weight of its target (f64, so with slack).
            let raw: u128 = load.iter().map(|&h| h as u128).sum();
            let shift = (128 - raw.leading_zeros()).saturating_sub(32);
            let scaled: Vec<u64> = load.iter().map(|&h| ((h as u128) >> shift) as u64).collect();
            let w: f64 = scaled.iter().map(|&h| h as f64).sum();
            if w > 0.0 && len > 0 && n > 1 {
                let total = weight(&p, &scaled, len);
                let most = spans.iter().zip(&scaled)
                    .filter(|(s, _)| !s.is_empty())
                    .map(|(s, &h)| 7.0 * len as f64 * h as f64 / s.len() as f64 + w)
                    .fold(0.0, f64::max);
                for m in 1..n {
                    let got = weight(&p, &scaled, q.bounds()[m]);
                    let want = total * m as f64 / n as f64;
                    prop_assert!(got <= want * (1.0 + 1e-9) + 1.0 && got > want - most * (1.0 + 1e-9) - 1.0,
                        "cut {} at {}: weight {} for target {} (one element {})", m, q.bounds()[m], got, want, most);
                }
                // The even eighth keeps ranges short.
                for j in 0..n {
                    prop_assert!(q.range(j).len() as f64 <= 8.0 * len as f64 / n as f64 + most / w + 1.0);
                }
            } else {
                prop_assert_eq!(q, Partition::even(len, n));
            }
        }

        #[test]
        fn routes_tile_the_indices(len in 1usize..5000, n in 1usize..40, picks in proptest::collection::btree_set(0u32..5000, 0..300)) {
            let p = Partition::even(len, n);
            let idx: Vec<u32> = picks.into_iter().filter(|&i| (i as usize) < len).collect();
            let routes = p.route(&idx);
            prop_assert_eq!(routes.len(), n);
            let mut next = 0;
            for (j, r) in routes.iter().enumerate() {
                prop_assert_eq!(r.start, next);
                next = r.end;
                for &i in &idx[r.clone()] {
                    prop_assert!(p.range(j).contains(&(i as usize)));
                    prop_assert_eq!(p.owner(i as usize), j);
                }
                let h = p.histogram(j, idx.iter().copied());
                prop_assert_eq!(h.iter().sum::<u64>(), r.len() as u64);
            }
            prop_assert_eq!(next, idx.len());
        }

        #[test]
        fn quotas_add_up_to_the_average_rank(n in 1usize..70, loads in proptest::collection::vec(0u64..1_000_000, 70)) {
            // Whatever the loads, the quotas add up to the total over n plus at most one per range.
            let p = Partition::even(1 << 30, n);
            let total: u64 = loads[..n].iter().sum();
            let kept: u64 = loads[..n].iter().enumerate().map(|(j, &w)| quota(w, n, p.range(j).len())).sum();
            prop_assert!(kept * n as u64 >= total && kept <= total / n as u64 + n as u64);
            // Never more than the range holds.
            prop_assert_eq!(quota(5, 2, 1), 1);
            prop_assert_eq!(quota(0, n, 9), 0);
        }

        #[test]
        fn the_reduce_scatter_does_not_grow_with_n(len in 1usize..(1 << 26), density in 0.001f64..0.5) {
            let k = ((density * len as f64) as u64).max(1);
            let (t4, t64) = (traffic(4, len, k), traffic(64, len, k));
            // Pairs: about 2·8k(n−1)/n for any n, plus 96 bytes of counts per peer.
            for (n, t) in [(4u64, t4), (64, t64)] {
                let pairs = t.reduce_scatter - (n - 1) * 96;
                prop_assert!(pairs <= 16 * k + 16 * n && pairs + 16 * n >= 16 * k * (n - 1) / n);
                prop_assert_eq!(t.all_gather, (n - 1) * (24 + 8 * k));
            }
            prop_assert_eq!(t64.dense_ring, 2 * 63 * 4 * len as u64 / 64);
        }
    }

    #[test]
    fn choose_by_the_model_and_the_dense_switch() {
        let len = 1 << 20;
        let k = 104_858u64; // 10%
                            // One or two ranks: gathering (the same bytes, and exact).
        assert_eq!(
            choose(SparsePath::Auto, len, &[k], 0.5),
            SparseRoute::AllGather
        );
        assert_eq!(
            choose(SparsePath::Auto, len, &[k; 2], 0.5),
            SparseRoute::AllGather
        );
        // Three or more: the reduce-scatter, also where gathering would have gone dense.
        assert_eq!(
            choose(SparsePath::Auto, len, &[k; 3], 0.5),
            SparseRoute::ReduceScatter
        );
        assert_eq!(
            choose(SparsePath::AllGather, len, &[k; 8], 0.5),
            SparseRoute::Dense
        );
        assert_eq!(
            choose(SparsePath::Auto, len, &[k; 8], 0.5),
            SparseRoute::ReduceScatter
        );
        // Tiny counts: the fixed cost of the reduce-scatter's exchanges dominates.
        assert_eq!(
            choose(SparsePath::Auto, len, &[2; 4], 0.5),
            SparseRoute::AllGather
        );
        // Forced ways, and their switches.
        assert_eq!(
            choose(SparsePath::ReduceScatter, len, &[k; 2], 0.5),
            SparseRoute::ReduceScatter
        );
        assert_eq!(
            choose(SparsePath::ReduceScatter, 100, &[60; 4], 0.5),
            SparseRoute::Dense
        );
        assert_eq!(
            choose(SparsePath::ReduceScatter, 100, &[40, 40, 40, 79], 0.5),
            SparseRoute::ReduceScatter
        );
        assert_eq!(
            choose(SparsePath::AllGather, 100, &[100; 4], f64::INFINITY),
            SparseRoute::AllGather
        );
    }

    #[test]
    fn exact_bytes_of_each_way() {
        assert_eq!(all_gather_bytes(&[3, 7, 5]), 2 * (8 + 16 + 56));
        assert_eq!(all_gather_bytes(&[9]), 0);
        assert_eq!(reduce_scatter_bytes(4, 10, 2), 3 * 96 + 8 * (10 + 3 * 2));
        assert_eq!(reduce_scatter_bytes(1, 0, 9), 0);
        assert_eq!(
            reduce_scatter_estimate(4, 100, 400),
            3 * 96 + 8 * (75 + 3 * 25)
        );
        assert_eq!(dense_ring_bytes(4, 1000), 6000);
        assert_eq!(dense_ring_bytes(1, 1000), 0);
    }

    #[test]
    fn path_text_forms() {
        for (t, p) in [
            ("auto", SparsePath::Auto),
            (" AllGather ", SparsePath::AllGather),
            ("all-gather", SparsePath::AllGather),
            ("ag", SparsePath::AllGather),
            ("reduce_scatter", SparsePath::ReduceScatter),
            ("RS", SparsePath::ReduceScatter),
        ] {
            assert_eq!(t.parse::<SparsePath>().unwrap(), p, "{t}");
            assert_eq!(p.to_string().parse::<SparsePath>().unwrap(), p);
        }
        let e = "ring".parse::<SparsePath>().unwrap_err();
        assert!(
            e.is_invalid_argument() && e.to_string().contains("reducescatter"),
            "{e}"
        );
    }
}
