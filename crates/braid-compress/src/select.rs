//! Exact selection of the `k` largest keys, the primitive under top-k and random-k, and random-k's
//! indices (which the codec and the wire decoder both need).

use std::cmp::Reverse;

use crate::rng::{Stream, TAG_RANDOM_K};

/// Panics when a tensor of `len` elements cannot be indexed with `u32`, the sparse formats' index type.
pub(crate) fn assert_indexable(codec: &str, len: usize) {
    assert!(
        len <= u32::MAX as usize,
        "{codec}: a tensor of {len} elements cannot be indexed with u32; split it into buckets of at most {} elements",
        u32::MAX
    );
}

/// The `k` indices random-k keeps for a tensor of `len` elements at `step`, ascending.
///
/// They are the `k` indices `i` with the smallest `Stream::new(seed, TAG_RANDOM_K, step).u64_at(i)`, ties
/// going to the lower index: a uniformly random `k`-subset that depends only on `(seed, step, len, k)`, and
/// that a GPU computes with the same selection it uses for top-k. `k` is clamped to `len`.
///
/// # Panics
///
/// If `len` exceeds `u32::MAX`.
pub fn random_k_indices(seed: u64, step: u64, len: usize, k: usize) -> Vec<u32> {
    assert_indexable("random-k", len);
    let k = k.min(len);
    if k == 0 || k == len {
        return (0..k as u32).collect();
    }
    let stream = Stream::new(seed, TAG_RANDOM_K, step);
    let key = |i: usize| stream.u64_at(i as u64);
    // The keys are uniform, so the k smallest are almost surely below a bound a few standard deviations
    // above k/len of the range: select among those candidates, and fall back to the full selection in the
    // rare case there are fewer than k of them. Both paths return the same set.
    let expect = k as f64 + 6.0 * (k as f64).sqrt() + 16.0;
    if expect < 0.5 * len as f64 {
        let bound = (expect / len as f64 * 18_446_744_073_709_551_616.0) as u64;
        let cand: Vec<(u64, u32)> = (0..len)
            .map(|i| (key(i), i as u32))
            .filter(|c| c.0 < bound)
            .collect();
        if cand.len() >= k {
            // Candidates are in index order, so the positions come out ascending, as the indices must.
            return top_k_by(cand.len(), k, |j| Reverse(cand[j].0))
                .into_iter()
                .map(|j| cand[j as usize].1)
                .collect();
        }
    }
    top_k_by(len, k, |i| Reverse(key(i)))
}

/// Ascending indices of the `k` largest of `key(0), …, key(len − 1)`, ties going to the lower index.
///
/// With `t` the `k`-th largest key, the result is every index whose key is greater than `t`, then the
/// lowest-indexed ones whose key equals `t` until there are `k`. That is the same set as sorting by
/// (key descending, index ascending) and keeping the first `k`, so the result is unique. `key` is called
/// twice per element. `k` is clamped to `len`; `len` must not exceed `u32::MAX + 1`.
pub(crate) fn top_k_by<K: Ord + Copy>(len: usize, k: usize, key: impl Fn(usize) -> K) -> Vec<u32> {
    let k = k.min(len);
    if k == 0 {
        return Vec::new();
    }
    if k == len {
        return (0..len as u64).map(|i| i as u32).collect();
    }
    let mut scratch: Vec<K> = (0..len).map(&key).collect();
    let (above, &mut t, _) = scratch.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    let greater = above.iter().filter(|&&x| x > t).count();
    let mut ties = k - greater;
    drop(scratch);
    let mut out = Vec::with_capacity(k);
    for i in 0..len {
        let x = key(i);
        if x > t || (x == t && ties > 0) {
            if x == t {
                ties -= 1;
            }
            out.push(i as u32);
        }
    }
    debug_assert_eq!(out.len(), k);
    out
}

/// [`top_k_by`] for `u32` keys, by radix selection: a histogram of the top 12 bits finds the bucket that
/// holds the `k`-th largest key, an exact selection among that bucket's keys finds it, and a last pass emits
/// the indices. Three passes over the keys and a scratch buffer the size of one bucket; same result.
pub(crate) fn top_k_u32(len: usize, k: usize, key: impl Fn(usize) -> u32) -> Vec<u32> {
    const SHIFT: u32 = 20;
    let k = k.min(len);
    if k == 0 {
        return Vec::new();
    }
    if k == len {
        return (0..len as u64).map(|i| i as u32).collect();
    }
    let mut hist = vec![0usize; 1 << (32 - SHIFT)];
    for i in 0..len {
        hist[(key(i) >> SHIFT) as usize] += 1;
    }
    // The bucket b holding the k-th largest key, and how many keys lie in the buckets above it.
    let mut above = 0;
    let mut b = hist.len() - 1;
    while above + hist[b] < k {
        above += hist[b];
        b -= 1;
    }
    let mut bucket: Vec<u32> = Vec::with_capacity(hist[b]);
    for i in 0..len {
        let x = key(i);
        if (x >> SHIFT) as usize == b {
            bucket.push(x);
        }
    }
    let rank = k - above;
    let (before, &mut t, _) = bucket.select_nth_unstable_by(rank - 1, |a, b| b.cmp(a));
    let greater = above + before.iter().filter(|&&x| x > t).count();
    let mut ties = k - greater;
    drop(bucket);
    let mut out = Vec::with_capacity(k);
    for i in 0..len {
        let x = key(i);
        if x > t || (x == t && ties > 0) {
            if x == t {
                ties -= 1;
            }
            out.push(i as u32);
        }
    }
    debug_assert_eq!(out.len(), k);
    out
}

/// The sort key of `|x|`: the bit pattern of `x` with the sign cleared. As an unsigned integer it orders
/// like `|x|.total_cmp`: `+0 < subnormals < normals < +∞ < NaN`, and `−0` equals `+0`.
#[inline(always)]
pub(crate) fn abs_key(x: f32) -> u32 {
    x.to_bits() & 0x7fff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oracle(keys: &[u32], k: usize) -> Vec<u32> {
        let mut idx: Vec<u32> = (0..keys.len() as u32).collect();
        idx.sort_by(|&a, &b| keys[b as usize].cmp(&keys[a as usize]).then(a.cmp(&b)));
        idx.truncate(k);
        idx.sort_unstable();
        idx
    }

    #[test]
    fn matches_sort_oracle_with_ties() {
        let keys: Vec<u32> = (0..200u32).map(|i| (i * 7919) % 13).collect();
        for k in [0, 1, 2, 13, 14, 50, 199, 200, 300] {
            assert_eq!(
                top_k_by(keys.len(), k, |i| keys[i]),
                oracle(&keys, k.min(200)),
                "k = {k}"
            );
        }
    }

    #[test]
    fn radix_selection_matches_the_oracle() {
        let spread: Vec<u32> = (0..3000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let clustered: Vec<u32> = (0..3000u32)
            .map(|i| 0x3f80_0000 + (i * 7919) % 50)
            .collect();
        for keys in [
            spread,
            clustered,
            vec![5; 100],
            vec![u32::MAX, 0, u32::MAX, 1],
        ] {
            for k in [0, 1, 2, 3, 4, 50, 99, 100, 1500, 2999, 3000] {
                let k = k.min(keys.len());
                assert_eq!(
                    top_k_u32(keys.len(), k, |i| keys[i]),
                    oracle(&keys, k),
                    "k = {k}"
                );
            }
        }
    }

    #[test]
    fn abs_key_orders_like_magnitude() {
        let xs = [
            0.0f32,
            -0.0,
            1e-40,
            -1.0,
            2.0,
            -3.5,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        for &a in &xs {
            for &b in &xs {
                assert_eq!(
                    abs_key(a).cmp(&abs_key(b)),
                    a.abs().total_cmp(&b.abs()),
                    "{a} vs {b}"
                );
            }
        }
    }
}
