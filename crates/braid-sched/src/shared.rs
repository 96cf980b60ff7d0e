//! Collectives over buffers every rank of a host maps: who reduces or copies which range, and the
//! memory traffic that costs (the `bound` of `braid perf --shared`).
//!
//! With shared buffers there are no messages: after every rank has announced its buffers, rank `r`
//! reduces slice `r` of the vector straight from every rank's input, in rank order (so every rank's
//! result is the same bits), and, for an all-reduce, stores it into every rank's output.

use std::ops::Range;

use crate::Collective;

/// Slices start on this many bytes, so two ranks never write the same cache line.
pub const SLICE_ALIGN: usize = 64;

/// Rank `r`'s slice of `count` elements of `elem_bytes` bytes split among `world` ranks: as equal as
/// whole cache lines allow, in rank order, covering `0..count` exactly (later slices may be empty).
pub fn slice(count: usize, elem_bytes: usize, world: usize, r: usize) -> Range<usize> {
    let unit = (SLICE_ALIGN / elem_bytes.max(1)).max(1);
    let units = count.div_ceil(unit);
    let world = world.max(1);
    let (per, extra) = (units / world, units % world);
    let start = r * per + r.min(extra);
    let end = start + per + usize::from(r < extra);
    (start * unit).min(count)..(end * unit).min(count)
}

/// Bytes of memory one rank reads and writes for `collective` over shared buffers, where `bytes` is
/// the size of one rank's vector as nccl-tests counts it (the all-reduce's buffer, the all-gather's
/// and reduce-scatter's full output and input, the broadcast's and reduce's buffer), with `world`
/// ranks. Averaged over the ranks (the reduce's and broadcast's root does less).
///
/// - all-reduce: read every rank's slice (`S`), write the reduced slice into every output (`S`; the
///   copies read it back from cache, not counted): `2 S`;
/// - reduce-scatter: read `n` blocks of `S/n`, write one: `S (n + 1) / n`;
/// - all-gather: read and write the `n − 1` blocks of the others: `2 S (n − 1) / n`;
/// - broadcast: the `n − 1` other ranks read and write `S`: `2 S (n − 1) / n` on average;
/// - reduce: read every rank's slice, write one into the root: `S (n + 1) / n`.
pub fn traffic(collective: Collective, bytes: usize, world: usize) -> f64 {
    let (s, n) = (bytes as f64, world.max(1) as f64);
    match collective {
        Collective::AllReduce => 2.0 * s,
        Collective::ReduceScatter | Collective::Reduce => s * (n + 1.0) / n,
        Collective::AllGather | Collective::Broadcast => 2.0 * s * (n - 1.0) / n,
        Collective::Barrier | Collective::AllToAll => 2.0 * s * (n - 1.0) / n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn slices_tile_the_vector_in_order_on_cache_lines(
            count in 0usize..100_000,
            es in prop::sample::select(vec![1usize, 2, 4, 8]),
            world in 1usize..12,
        ) {
            let mut at = 0;
            for r in 0..world {
                let s = slice(count, es, world, r);
                prop_assert_eq!(s.start, at);
                prop_assert!(s.start <= s.end);
                if s.start < count {
                    prop_assert_eq!((s.start * es) % SLICE_ALIGN, 0);
                }
                at = s.end;
            }
            prop_assert_eq!(at, count);
            // Balanced: slices differ by at most one cache line (and the last one's partial line).
            let lens: Vec<usize> = (0..world).map(|r| slice(count, es, world, r).len()).collect();
            let unit = (SLICE_ALIGN / es).max(1);
            let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
            prop_assert!(hi - lo < 2 * unit, "{:?}", lens);
        }
    }

    #[test]
    fn traffic_follows_the_formulas() {
        // Two ranks, 1 MiB all-reduce: each reads 1 MiB and writes 1 MiB.
        let m = 1 << 20;
        assert_eq!(traffic(Collective::AllReduce, m, 2), 2.0 * m as f64);
        assert_eq!(traffic(Collective::AllGather, m, 4), 1.5 * m as f64);
        assert_eq!(traffic(Collective::ReduceScatter, m, 4), 1.25 * m as f64);
    }
}
