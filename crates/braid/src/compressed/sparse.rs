//! Top-k's sparse reduce-scatter ([`CompressedPath::SparseReduceScatter`]): the all-gather of pairs sends
//! `(n−1)·k` pairs from every rank, more than a dense ring beyond about `len/k` ranks; here a rank sends
//! each of its pairs to one rank only, the owner of the index range it falls in, and then its share of
//! the re-selected result to everyone, about `2k·(n−1)/n` pairs whatever `n` is.
//!
//! One step, after the local error-feedback step and the count all-gather both sparse paths share
//! (the index arithmetic, the wire layout and the traffic are `braid_sched::sparse`'s):
//!
//! 1. every rank routes its ascending indices by this step's [`Partition`] (the same on every rank:
//!    rebalanced after a step whose load histogram, which all ranks receive, was uneven) and tells each
//!    owner how many pairs it will send, with the partition's fingerprint, so that a rank that cut the
//!    index space differently is a mismatch;
//! 2. the pairs go to their owners (an all-to-all of blocks of any size);
//! 3. the owner checks each block (ascending indices inside its range), sums them in rank order, adds its
//!    second error buffer, keeps the [`quota`] largest and remembers the rest, as the two-phase path's
//!    shard owners do;
//! 4. owners all-gather their quota and the load histogram of their range, then the kept pairs; every
//!    rank decodes the same bytes in rank order, so the result is bit-identical everywhere.
//!
//! When the next step's partition moves a rank's range, the part of its second error buffer that
//! leaves the range is added to the rank's local error buffer: it is sent again, by whichever rank then
//! owns those indices, when it is large enough, and nothing is lost (sum of results plus every error
//! buffer equals the sum of the gradients).

use std::ops::Range;

use braid_compress::{Compressed, Payload, Stats};
use braid_core::{DType, Error};
use braid_sched::sparse::{quota, Partition, HISTOGRAM_BUCKETS, PAIR_BYTES};

use super::paths::internal;
use super::range::RangeState;
use super::report::CompressedPath;
use super::state::GradientCompressor;
use crate::call::{Blocks, Call, Kind};
use crate::Communicator;

/// Writes `indices` (u32) then `values` (f32), little-endian, into `out` (exactly `8·k` bytes).
fn put_pairs(out: &mut [u8], indices: impl Iterator<Item = u32>, values: &[f32]) {
    let (ib, vb) = out.split_at_mut(4 * values.len());
    for (o, i) in ib.chunks_exact_mut(4).zip(indices) {
        o.copy_from_slice(&i.to_le_bytes());
    }
    for (o, v) in vb.chunks_exact_mut(4).zip(values) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

/// The pairs of a received block (`k` u32 indices then `k` f32 values): checked first (indices strictly
/// ascending, inside `range`), then handed to `f` in order. The error says what is wrong.
fn read_pairs(
    block: &[u8],
    range: &Range<usize>,
    mut f: impl FnMut(usize, f32),
) -> Result<(), String> {
    let k = block.len() / 8;
    let (ib, vb) = block.split_at(4 * k);
    let index = |c: &[u8]| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize;
    let mut prev: Option<usize> = None;
    for (e, c) in ib.chunks_exact(4).enumerate() {
        let i = index(c);
        if !range.contains(&i) {
            return Err(format!(
                "index {i} (pair {e} of {k}) is outside its range {}..{}",
                range.start, range.end
            ));
        }
        if let Some(p) = prev.filter(|p| *p >= i) {
            return Err(format!(
                "index {i} (pair {e} of {k}) does not follow {p} in increasing order"
            ));
        }
        prev = Some(i);
    }
    for (i, v) in ib.chunks_exact(4).zip(vb.chunks_exact(4)) {
        f(index(i), f32::from_le_bytes([v[0], v[1], v[2], v[3]]));
    }
    Ok(())
}

/// Consecutive ranges of `8·counts[p]` bytes, and their total.
fn byte_blocks(counts: impl Iterator<Item = u64>) -> Result<(Vec<Range<usize>>, usize), Error> {
    let mut at = 0usize;
    let mut blocks = Vec::new();
    for c in counts {
        let bytes = usize::try_from(c)
            .ok()
            .and_then(|c| c.checked_mul(PAIR_BYTES as usize))
            .and_then(|b| b.checked_add(at))
            .ok_or_else(|| Error::OutOfMemory(format!("{c} pairs do not fit in memory")))?;
        blocks.push(at..bytes);
        at = bytes;
    }
    Ok((blocks, at))
}

impl GradientCompressor {
    /// Gives the sparse reduce-scatter's second error buffer back to the local one (over this rank's
    /// range), as when the communicator's shape changes.
    pub(super) fn fold_range_state(&mut self) {
        if let Some(old) = self.sparse.take() {
            let r = old.partition.range(old.rank);
            add_into(&mut self.ef.error, r, &old.error);
        }
    }

    /// The sparse state for `rank` of `world`, made (even partition, empty second buffer) if there is
    /// none for this shape; one made for another shape gives its second buffer back to the local one.
    fn range_state(&mut self, world: usize, rank: usize) -> Result<&mut RangeState, Error> {
        let fits = matches!(&self.sparse, Some(s) if (s.world, s.rank) == (world, rank));
        if !fits {
            self.fold_range_state();
            let partition = Partition::even(self.len, world);
            let (error, sum) = RangeState::buffers(partition.range(rank).len())?;
            // The decay rule of every other error buffer (off without error feedback).
            let decay = GradientCompressor::error_feedback(&self.config, 0, None)?.decay;
            self.sparse = Some(RangeState {
                world,
                rank,
                partition,
                error,
                sum,
                decay,
            });
        }
        self.sparse
            .as_mut()
            .ok_or_else(|| internal("the sparse state is missing".into()))
    }
}

/// `dst[range] += src` (a second error buffer given back to the local one).
pub(super) fn add_into(dst: &mut [f32], range: Range<usize>, src: &[f32]) {
    if let Some(d) = dst.get_mut(range) {
        d.iter_mut().zip(src).for_each(|(d, s)| *d += s);
    }
}

impl Communicator {
    /// All-to-all of byte blocks whose sizes every rank agreed on beforehand: `send[send_blocks[j]]`
    /// goes to rank `j`, rank `i`'s block lands in `recv[recv_blocks[i]]`. `agreed` is the same on every
    /// rank (the total over all ranks' blocks), which the ranks compare under debug checks.
    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_blocks: Vec<Range<usize>>,
        recv: &mut [u8],
        recv_blocks: Vec<Range<usize>>,
        agreed: usize,
    ) -> Result<(), Error> {
        let (n, me) = (self.world_size(), self.rank());
        let inside =
            |b: &[Range<usize>], len: usize| b.iter().all(|r| r.start <= r.end && r.end <= len);
        if send_blocks.len() != n
            || recv_blocks.len() != n
            || !inside(&send_blocks, send.len())
            || !inside(&recv_blocks, recv.len())
            || send_blocks[me].len() != recv_blocks[me].len()
        {
            return Err(internal(format!(
                "{} send and {} receive blocks of an all-to-all on {n} ranks do not fit buffers of {} \
                 and {} bytes",
                send_blocks.len(),
                recv_blocks.len(),
                send.len(),
                recv.len()
            )));
        }
        let (sl, rl) = (send.len(), recv.len());
        // SAFETY: both slices are borrowed for the whole blocking call and do not overlap (one shared,
        // one mutable borrow); every block lies within its buffer (checked above).
        let op = unsafe {
            Call::new(
                Kind::AllToAll,
                DType::U8,
                braid_core::ReduceOp::Sum,
                agreed,
                send.as_ptr(),
                sl,
                recv.as_mut_ptr(),
                rl,
            )
            .with_blocks(Blocks {
                send: send_blocks,
                recv: recv_blocks,
            })
        };
        self.inner.streams.run_blocking(op, 0)
    }

    /// The sparse reduce-scatter (see the module documentation), after the local step that produced
    /// `c` and the count all-gather that produced `counts` (checked, and already in `sent`).
    pub(super) fn sparse_reduce_scatter(
        &self,
        grad: &mut [f32],
        state: &mut GradientCompressor,
        c: Compressed,
        counts: &[u64],
        stats: Stats,
        mut sent: u64,
    ) -> Result<(Stats, CompressedPath, u64), Error> {
        let (n, me, len, step) = (self.world_size(), self.rank(), grad.len(), state.step);
        let Payload::Sparse { indices, values } = c.payload() else {
            return Err(internal(format!(
                "a {} payload on the sparse reduce-scatter",
                c.payload().kind_name()
            )));
        };
        let total: u64 = counts.iter().sum();
        let part = state.range_state(n, me)?.partition.clone();
        if part.len() != len || part.ranks() != n {
            return Err(internal(format!(
                "a partition of {} elements in {} ranges for {len} elements on {n} ranks",
                part.len(),
                part.ranks()
            )));
        }
        let own = part.range(me);

        // 1. How many pairs go to each owner, and the partition they were cut by.
        let routes = part.route(indices);
        let fp = part.fingerprint();
        let route: Vec<u64> = routes.iter().flat_map(|r| [r.len() as u64, fp]).collect();
        let mut heard = vec![0u64; 2 * n];
        self.all_to_all(&route, &mut heard)?;
        sent += self.gather_sent(16);
        let mut incoming = Vec::with_capacity(n);
        for p in 0..n {
            let (k, their) = (heard[2 * p], heard[2 * p + 1]);
            if their != fp {
                return Err(self.mismatch(
                    p,
                    step,
                    format!(
                        "rank {p} cut the index space differently (partition fingerprint {their:#x}, \
                         this rank's {fp:#x}): did every rank reset at the same step?"
                    ),
                ));
            }
            if k > counts[p] || k > own.len() as u64 {
                return Err(self.mismatch(
                    p,
                    step,
                    format!(
                        "rank {p} sends {k} pairs for range {}..{}, but selected {} in all",
                        own.start, own.end, counts[p]
                    ),
                ));
            }
            incoming.push(k);
        }

        // 2. The pairs to their owners.
        let (send_blocks, send_len) = byte_blocks(routes.iter().map(|r| r.len() as u64))?;
        let mut out = braid_core::alloc::filled(0u8, send_len, "the routed sparse pairs")?;
        for (b, r) in send_blocks.iter().zip(&routes) {
            put_pairs(
                &mut out[b.clone()],
                indices[r.clone()].iter().copied(),
                &values[r.clone()],
            );
        }
        let (recv_blocks, recv_len) = byte_blocks(incoming.iter().copied())?;
        let mut got =
            braid_core::alloc::filled(0u8, recv_len, "the sparse pairs of this rank's range")?;
        let agreed = usize::try_from(total.saturating_mul(PAIR_BYTES)).unwrap_or(usize::MAX);
        self.all_to_all_v_bytes(&out, send_blocks, &mut got, recv_blocks.clone(), agreed)?;
        let off_rank = (indices.len() - routes[me].len()) as u64;
        sent += PAIR_BYTES * off_rank;
        drop(out);

        // 3. Sum the range in rank order, then keep the largest with the range's own error buffer.
        let rs = state.range_state(n, me)?;
        if rs.sum.len() != own.len() || rs.error.len() != own.len() {
            return Err(internal(format!(
                "range buffers of {} and {} elements for range {own:?}",
                rs.sum.len(),
                rs.error.len()
            )));
        }
        let sum = &mut rs.sum;
        let mut load = [0u64; HISTOGRAM_BUCKETS];
        for (p, b) in recv_blocks.iter().enumerate() {
            let block = &got[b.clone()];
            read_pairs(block, &own, |i, v| sum[i - own.start] += v).map_err(|e| {
                self.mismatch(
                    p,
                    step,
                    format!("rank {p}'s pairs for this rank's range: {e}"),
                )
            })?;
            let h = part.histogram(
                me,
                block[..block.len() / 2]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
            load.iter_mut().zip(h).for_each(|(l, x)| *l += x);
        }
        drop(got);
        let received: u64 = incoming.iter().sum();
        let keep = quota(received, n, own.len());
        let kept = state.range_state(n, me)?.keep(keep as usize);
        let Payload::Sparse {
            indices: kept_idx,
            values: kept_val,
        } = kept.payload()
        else {
            return Err(internal("the re-selection is not sparse".into()));
        };
        if kept_idx.len() as u64 != keep {
            return Err(internal(format!(
                "kept {} pairs of the quota {keep}",
                kept_idx.len()
            )));
        }

        // 4. Every owner's quota and load, then the kept pairs, decoded in rank order.
        let mut mine = Vec::with_capacity(1 + HISTOGRAM_BUCKETS);
        mine.push(keep);
        mine.extend_from_slice(&load);
        let mut loads = vec![0u64; n * mine.len()];
        self.all_gather(&mine, &mut loads)?;
        sent += self.gather_sent(8 * mine.len());
        let mut quotas = Vec::with_capacity(n);
        let mut histogram = Vec::with_capacity(n * HISTOGRAM_BUCKETS);
        for (p, l) in loads.chunks_exact(mine.len()).enumerate() {
            let h = &l[1..];
            let w = h.iter().try_fold(0u64, |a, x| a.checked_add(*x));
            let want = w.map(|w| quota(w, n, part.range(p).len()));
            if w.is_none_or(|w| w > total) || want != Some(l[0]) {
                return Err(self.mismatch(
                    p,
                    step,
                    format!(
                        "rank {p} keeps {} pairs of range {:?} after receiving {:?} (of {total} pairs \
                         sent in all)",
                        l[0],
                        part.range(p),
                        h
                    ),
                ));
            }
            quotas.push(l[0]);
            histogram.extend_from_slice(h);
        }
        let mut mine =
            braid_core::alloc::filled(0u8, (PAIR_BYTES * keep) as usize, "the kept sparse pairs")?;
        put_pairs(
            &mut mine,
            kept_idx.iter().map(|&i| i + own.start as u32),
            kept_val,
        );
        let (blocks, all_len) = byte_blocks(quotas.iter().copied())?;
        let mut all = braid_core::alloc::filled(0u8, all_len, "the gathered kept pairs")?;
        self.all_to_all_v_bytes(
            &mine,
            vec![0..mine.len(); n],
            &mut all,
            blocks.clone(),
            all_len,
        )?;
        sent += self.gather_sent(mine.len());
        grad.fill(0.0);
        for (p, b) in blocks.iter().enumerate() {
            read_pairs(&all[b.clone()], &part.range(p), |i, v| grad[i] = v)
                .map_err(|e| self.mismatch(p, step, format!("rank {p}'s kept pairs: {e}")))?;
        }

        // The next step's partition, from the load every rank now holds; what leaves this rank's range
        // goes back to its local error buffer.
        let next = part.rebalance(&histogram);
        let new_own = next.range(me);
        if new_own != own {
            let (mut error, sum) = RangeState::buffers(new_own.len())?;
            let old = std::mem::take(&mut state.range_state(n, me)?.error);
            for (i, e) in own.clone().zip(&old) {
                if new_own.contains(&i) {
                    error[i - new_own.start] = *e;
                } else {
                    state.ef.error[i] += *e;
                }
            }
            let rs = state.range_state(n, me)?;
            (rs.error, rs.sum) = (error, sum);
        }
        state.range_state(n, me)?.partition = next;
        Ok((stats, CompressedPath::SparseReduceScatter, sent))
    }
}
