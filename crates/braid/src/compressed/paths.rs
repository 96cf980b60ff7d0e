//! The compressed all-reduce's ways through the network, one per codec family (see the parent
//! module): dense, sum-closed, PowerSGD's power iteration, sparse all-gather with the dense switch,
//! and the two-phase scheme (the sparse reduce-scatter is in `sparse.rs`).

use std::ops::Range;

use braid_compress::mx::MX_BLOCK;
use braid_compress::{build_codec, l2_norm, CodecSpec, Compressed, Payload, Staleness, Stats};
use braid_core::{DType, Error, ReduceOp};
use braid_sched::partition;
use braid_sched::sparse::{self as sparse_model, SparseRoute};
use tracing::{debug, warn};

use super::options::{AdamSafe, AdamSend, ClipScope};
use super::report::{CompressedPath, CompressedReport, Output, PathOf};
use super::state::GradientCompressor;
use crate::{Collective, Communicator};

/// Bytes of a compressed tensor's header (`braid_compress::wire`).
const HEADER: usize = braid_compress::wire::HEADER_BYTES;

/// The clip factor error feedback applies for `grad_norm` (the same rule as [`ErrorFeedback`]).
fn clip_scale(clip: Option<f32>, grad_norm: f64) -> f32 {
    match clip {
        Some(max) if grad_norm > max as f64 => (max as f64 / grad_norm) as f32,
        _ => 1.0,
    }
}

/// Statistics of a step whose update is `update` (for the paths that do not run `ErrorFeedback::step`).
fn stats_for(
    staleness: &mut Staleness,
    update: &[f32],
    norms: (f64, f32, f64, f64),
    wire_bytes: usize,
) -> Result<Stats, Error> {
    let staleness = staleness.observe(update).map_err(codec_error)?;
    Ok(Stats::from_step(update.len(), norms, wire_bytes, staleness))
}

/// Element ranges of the `n` shards of the two-phase path: block-aligned, so that a shard's encoding is
/// exactly the slice of the whole tensor's.
pub(super) fn shards(len: usize, block: usize, n: usize) -> Vec<Range<usize>> {
    partition(len.div_ceil(block), n)
        .into_iter()
        .map(|b| (b.start * block).min(len)..(b.end * block).min(len))
        .collect()
}

/// Encoded size of an int8, sign or MX tensor of `len` elements.
fn quant_bytes(spec: CodecSpec, len: usize) -> Result<usize, Error> {
    match spec {
        CodecSpec::Int8 { block, .. } => Ok(HEADER + 4 + 4 * len.div_ceil(block) + len),
        CodecSpec::Sign { block } => Ok(HEADER + 4 + 4 * len.div_ceil(block) + len.div_ceil(8)),
        CodecSpec::Mx { element } => {
            Ok(HEADER + 1 + len.div_ceil(MX_BLOCK) + element.code_bytes(len))
        }
        other => Err(internal(format!("{other} on the two-phase path"))),
    }
}

/// A broken invariant of the compressed paths (a bug), as an error rather than a panic.
pub(super) fn internal(what: String) -> Error {
    Error::Internal(format!("compressed all-reduce: {what}"))
}

pub(super) fn codec_error(e: braid_compress::Error) -> Error {
    match e {
        braid_compress::Error::OutOfMemory(m) => Error::OutOfMemory(m),
        e => Error::invalid(e.to_string()),
    }
}

/// A well-mixed seed for the second (shard) codec of `rank`, so stochastic rounding of different shards
/// does not reuse the same draws.
fn shard_seed(seed: u64, rank: usize) -> u64 {
    let mut z = seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The scales of the block-aligned element `range` (none for an empty one).
fn block_range(range: &Range<usize>, block: usize) -> Range<usize> {
    let first = range.start / block;
    first..first + range.len().div_ceil(block)
}

/// The part of an int8, sign or MX tensor covering the block-aligned `range`.
fn slice_quant(c: &Compressed, range: &Range<usize>) -> Result<Compressed, Error> {
    let payload = match c.payload() {
        Payload::Int8 {
            block,
            scales,
            quants,
        } => {
            let b = *block as usize;
            Payload::Int8 {
                block: *block,
                scales: scales[block_range(range, b)].to_vec(),
                quants: quants[range.clone()].to_vec(),
            }
        }
        Payload::Sign {
            block,
            scales,
            bits,
        } => {
            let b = *block as usize;
            let mut out = vec![0u8; range.len().div_ceil(8)];
            for (j, i) in range.clone().enumerate() {
                out[j / 8] |= ((bits[i / 8] >> (i % 8)) & 1) << (j % 8);
            }
            Payload::Sign {
                block: *block,
                scales: scales[block_range(range, b)].to_vec(),
                bits: out,
            }
        }
        Payload::Mx {
            element,
            scales,
            codes,
        } => {
            // Blocks of 32 start on whole bytes of codes, also at two codes a byte.
            let per_byte = 8 / element.bits() as usize;
            let first = range.start / per_byte;
            let bytes = first..first + range.len().div_ceil(per_byte);
            Payload::Mx {
                element: *element,
                scales: scales[block_range(range, MX_BLOCK)].to_vec(),
                codes: codes[bytes].to_vec(),
            }
        }
        other => {
            return Err(internal(format!(
                "a {} payload on the two-phase path",
                other.kind_name()
            )))
        }
    };
    Compressed::new(range.len(), payload).map_err(|e| internal(format!("a shard's slice: {e}")))
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ *x as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Communicator {
    /// All-reduces the gradient `grad` compressed as `state` says, with error feedback; the result
    /// overwrites `grad` and is bit-identical on every rank. `op` is [`ReduceOp::Sum`] or
    /// [`ReduceOp::Avg`] (the sum divided by the world size in f32).
    ///
    /// Every rank must call this with the same configuration and length, in the same order relative to its
    /// other collectives. `grad.len() != state.len()` or another `op` is an [`Error::InvalidArgument`]
    /// that changes nothing. See the [module documentation](crate::compressed) for the paths.
    pub fn all_reduce_compressed(
        &self,
        grad: &mut [f32],
        op: ReduceOp,
        state: &mut GradientCompressor,
    ) -> Result<CompressedReport, Error> {
        // One turn for all the collectives it is made of: no other thread's op may come in between.
        let _turn = self.inner.streams.turn()?;
        if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
            return Err(Error::invalid(format!(
                "all_reduce_compressed: op must be sum or avg, got {op}"
            )));
        }
        if grad.len() != state.len {
            return Err(Error::invalid(format!(
                "all_reduce_compressed: the gradient has {} elements, the compressor was made for {}",
                grad.len(),
                state.len
            )));
        }
        let adam = state.config.adam;
        if adam.is_some() && op != ReduceOp::Avg {
            return Err(Error::invalid(format!(
                "all_reduce_compressed: Adam-safe compression averages the first moment; the op must be avg, \
                 got {op}"
            )));
        }
        let (n, len) = (self.world_size(), state.len);
        if self.config().debug_checks {
            self.check_same_compression(state)?;
        }
        let scheduled_density = state.schedule_density()?;
        // Adam-safe compression: dense through the warm-up, then the local first moment goes through the
        // codec in place of the gradient.
        let adam_dense = adam.is_some_and(|a| state.step < a.warmup_steps);
        let spec = state.config.codec;
        let path = if adam_dense {
            CompressedPath::Dense
        } else {
            spec.nominal_path()
        };
        let global_clip = match (state.config.clip_scope, state.config.clip_norm) {
            (ClipScope::Global, Some(max)) if len > 0 => Some(max),
            _ => None,
        };
        let (pre_clip, clip_sent) = if path == CompressedPath::Dense {
            (None, 0)
        } else {
            self.clip_before_compressing(grad, op, state, global_clip)?
        };
        let send_moment = adam.is_some_and(|a| a.send.resolve(spec) == AdamSend::Moment);
        if let Some(a) = adam {
            adam_before(state, grad, a, !adam_dense && send_moment)?;
        }
        let (mut stats, path, mut sent) = if len == 0 {
            let stats = stats_for(&mut state.staleness, &[], (0.0, 1.0, 0.0, 0.0), 0)?;
            (stats, path, 0)
        } else {
            match path {
                CompressedPath::Dense => self.compressed_dense(grad, op, state)?,
                CompressedPath::SumClosed => self.compressed_sum_closed(grad, state)?,
                CompressedPath::PowerIteration => self.compressed_power(grad, state)?,
                CompressedPath::TwoPhase => self.compressed_two_phase(grad, state)?,
                _ => self.compressed_sparse(grad, state)?,
            }
        };
        sent += clip_sent;
        if let Some((local, scale)) = pre_clip {
            stats.grad_norm = local;
            stats.clip_scale = scale;
        }
        if op == ReduceOp::Avg && path != CompressedPath::Dense {
            let d = n as f32;
            grad.iter_mut().for_each(|x| *x /= d);
        }
        if let (Some(max), CompressedPath::Dense) = (global_clip, path) {
            // The dense path clips the all-reduced gradient itself, exactly.
            let scale = clip_scale(Some(max), l2_norm(grad));
            if scale != 1.0 {
                grad.iter_mut().for_each(|x| *x *= scale);
            }
            stats.clip_scale = scale;
        }
        let output = match adam {
            Some(a) => adam_after(state, grad, a, adam_dense, send_moment),
            None => Output::Gradient,
        };
        state.step += 1;
        let dense_sent_bytes = (2 * (n as u64 - 1) * 4 * len as u64) / n as u64;
        // Past the warm-up, Adam-safe compression freezes the second moment that low density miscalibrates.
        let adaptive = state.config.adaptive_optimizer && output == Output::Gradient;
        let warnings = stats.warnings(adaptive);
        debug!(
            target: "braid::compress",
            rank = self.rank(),
            step = state.step - 1,
            codec = %spec,
            path = ?path,
            grad_norm = stats.grad_norm,
            clip_scale = stats.clip_scale,
            compression_error = stats.compression_error,
            density = stats.density,
            wire_bytes = stats.wire_bytes,
            sent_bytes = sent,
            dense_sent_bytes,
            stale_max = stats.staleness.max,
            stale_buckets = ?&stats.staleness.buckets[..],
            "compressed all-reduce"
        );
        if !warnings.is_empty() && !state.warned {
            state.warned = true;
            for w in &warnings {
                warn!(target: "braid::compress", rank = self.rank(), codec = %spec, "{w}");
            }
        }
        state.last = Some(stats.clone());
        Ok(CompressedReport {
            stats,
            path,
            sent_bytes: sent,
            dense_sent_bytes,
            warnings,
            scheduled_density,
            output,
        })
    }

    /// Clipping before compression where error feedback does not do it: global clipping on a compressing
    /// path (every rank scales by the bound the ranks' local norms give, one 8-byte all-reduce), and
    /// Adam-safe compression, which clips the gradient before it enters the first moment. Returns the
    /// local norm and the factor applied (for the statistics), and the bytes the norms' all-reduce sent.
    fn clip_before_compressing(
        &self,
        grad: &mut [f32],
        op: ReduceOp,
        state: &GradientCompressor,
        global_clip: Option<f32>,
    ) -> Result<(Option<(f64, f32)>, u64), Error> {
        let local = l2_norm(grad);
        let (scale, sent) = match global_clip {
            Some(max) => {
                let mut total = [local];
                self.all_reduce_in_place(&mut total, ReduceOp::Sum)?;
                let bound = if op == ReduceOp::Avg {
                    total[0] / self.world_size() as f64
                } else {
                    total[0]
                };
                (
                    clip_scale(Some(max), bound),
                    self.all_reduce_sent(1, DType::F64),
                )
            }
            None if state.config.adam.is_some() => {
                (clip_scale(state.config.local_clip(), local), 0)
            }
            None => return Ok((None, 0)),
        };
        if scale != 1.0 {
            grad.iter_mut().for_each(|x| *x *= scale);
        }
        Ok((Some((local, scale)), sent))
    }

    /// Bytes this rank sends in an all-reduce of `count` elements of `dtype`, as the schedule braid picks
    /// sends them.
    pub(super) fn all_reduce_sent(&self, count: usize, dtype: DType) -> u64 {
        let n = self.world_size();
        if n == 1 || count == 0 {
            return 0;
        }
        let (es, acc) = (dtype.size(), dtype.accumulator().size());
        let (algo, _) = self.algorithm(Collective::AllReduce, count * es);
        let slot = self.config().chunk_bytes.next_multiple_of(64);
        let spec = braid_sched::PlanSpec {
            collective: Collective::AllReduce,
            root: 0,
            algo,
            world: n,
            rank: self.rank(),
            count,
            chunk: (slot / acc).max(1),
            hosts: self.hosts(),
            channels: self.config().channels,
        };
        braid_sched::cost::traffic(&spec, es, acc).bytes as u64
    }

    /// Bytes this rank sends in an all-gather or all-to-all of `block` bytes per rank.
    pub(super) fn gather_sent(&self, block: usize) -> u64 {
        ((self.world_size() - 1) * block) as u64
    }

    /// Peers disagree about the compressed call at `step`.
    /// A disagreement between ranks, which leaves the communicator unusable (sticky, and the peers are
    /// told), as every non-argument error does.
    pub(super) fn mismatch(&self, peer: usize, step: u64, detail: String) -> Error {
        let e = Error::Mismatch {
            rank: self.rank(),
            peer,
            collective: "all_reduce_compressed".into(),
            seq: step,
            detail,
        };
        self.inner.streams.poison(&e);
        e
    }

    /// `BRAID_DEBUG_CHECKS`: every rank compares a hash of its configuration, length and step.
    fn check_same_compression(&self, state: &GradientCompressor) -> Result<(), Error> {
        let text = format!("{:?}/{}/{}", state.config, state.len, state.step);
        let mine = fnv(text.as_bytes());
        let (codec, len, step) = (state.config.codec, state.len, state.step);
        let mut all = vec![0u64; self.world_size()];
        self.all_gather(&[mine], &mut all)?;
        match all.iter().position(|h| *h != mine) {
            None => Ok(()),
            Some(p) => Err(self.mismatch(
                p,
                state.step,
                format!(
                    "rank {} compresses {len} elements with {codec} at step {step} ({:?}); rank {p} has a \
                     different configuration, length or step",
                    self.rank(),
                    state.config
                ),
            )),
        }
    }

    fn compressed_dense(
        &self,
        grad: &mut [f32],
        op: ReduceOp,
        state: &mut GradientCompressor,
    ) -> Result<(Stats, CompressedPath, u64), Error> {
        let grad_norm = l2_norm(grad);
        let scale = clip_scale(state.config.local_clip(), grad_norm);
        let residual_norm = if scale == 1.0 {
            grad_norm
        } else {
            grad.iter_mut().for_each(|x| *x *= scale);
            l2_norm(grad)
        };
        let stats = stats_for(
            &mut state.staleness,
            grad,
            (grad_norm, scale, residual_norm, 0.0),
            4 * grad.len(),
        )?;
        self.all_reduce_in_place(grad, op)?;
        let sent = self.all_reduce_sent(grad.len(), DType::F32);
        Ok((stats, CompressedPath::Dense, sent))
    }

    fn compressed_sum_closed(
        &self,
        grad: &mut [f32],
        state: &mut GradientCompressor,
    ) -> Result<(Stats, CompressedPath, u64), Error> {
        let len = grad.len();
        let (c, stats) = local_step(state, grad, "sum-closed")?;
        let sent = match c.into_payload() {
            Payload::F16(mut v) => {
                self.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
                grad.iter_mut().zip(&v).for_each(|(g, x)| *g = x.to_f32());
                self.all_reduce_sent(len, DType::F16)
            }
            Payload::Bf16(mut v) => {
                self.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
                grad.iter_mut().zip(&v).for_each(|(g, x)| *g = x.to_f32());
                self.all_reduce_sent(len, DType::BF16)
            }
            Payload::RandomK {
                seed,
                step,
                mut values,
            } => {
                self.all_reduce_in_place(&mut values, ReduceOp::Sum)?;
                let k = values.len();
                Compressed::new(len, Payload::RandomK { seed, step, values })
                    .and_then(|sum| sum.decompress(grad))
                    .map_err(codec_error)?;
                self.all_reduce_sent(k, DType::F32)
            }
            other => {
                return Err(internal(format!(
                    "a sum-closed codec produced {}",
                    other.kind_name()
                )))
            }
        };
        Ok((stats, CompressedPath::SumClosed, sent))
    }

    /// PowerSGD over the compressor's plan: one matrix, or one per layer with the dense parts exact.
    /// The first all-reduce sums `[P of every matrix | dense values]`, the second every matrix's Q.
    fn compressed_power(
        &self,
        grad: &mut [f32],
        state: &mut GradientCompressor,
    ) -> Result<(Stats, CompressedPath, u64), Error> {
        let Some(plan) = state.power.as_ref() else {
            return Err(internal(format!(
                "{} on the PowerSGD path without a plan",
                state.config.codec
            )));
        };
        let plan_error = |e| internal(format!("PowerSGD plan: {e}"));
        // The residual, exactly as error feedback forms it: clipped gradient plus decayed error.
        let grad_norm = l2_norm(grad);
        let scale = clip_scale(state.config.local_clip(), grad_norm);
        let decay = state.ef.decay;
        let m = &mut state.ef.error;
        for (e, &g) in m.iter_mut().zip(grad.iter()) {
            let g = if scale == 1.0 { g } else { g * scale };
            *e = if decay == 0.0 { g } else { g + decay * *e };
        }
        let residual_norm = l2_norm(m);
        let q0 = match state.warm_q.take() {
            Some(q) if q.len() == plan.q_len() => q,
            _ => plan.initial_q(state.config.seed, state.step),
        };
        let (pl, dl) = (plan.p_len(), plan.dense_len());
        let mut first = braid_core::alloc::filled(0.0f32, pl + dl, "PowerSGD's P and dense parts")?;
        let (p, dense) = first.split_at_mut(pl);
        plan.multiply(m, &q0, p).map_err(plan_error)?;
        plan.dense(m, dense).map_err(plan_error)?;
        self.all_reduce_in_place(&mut first, ReduceOp::Sum)?;
        let mut sent = self.all_reduce_sent(first.len(), DType::F32);
        let (p, dense_sum) = first.split_at_mut(pl);
        plan.orthogonalize(p, 0.0).map_err(plan_error)?;
        let mut q = q0;
        plan.multiply_transposed(m, p, &mut q).map_err(plan_error)?;
        let mut q_sum = q.clone();
        // Every rank has the same plan, so all skip the Q all-reduce when nothing is factorised.
        if !q_sum.is_empty() {
            self.all_reduce_in_place(&mut q_sum, ReduceOp::Sum)?;
            sent += self.all_reduce_sent(q_sum.len(), DType::F32);
        }
        // This rank's share of the approximation, P·(Mᵀ·P)ᵀ and its own dense values, is what leaves
        // its error buffer (the dense parts leave it entirely).
        let mut dense_local = braid_core::alloc::filled(0.0f32, dl, "PowerSGD's dense parts")?;
        plan.dense(m, &mut dense_local).map_err(plan_error)?;
        let local = plan.compressed(p, &q, &dense_local).map_err(codec_error)?;
        let wire_bytes = local.wire_bytes();
        local.decompress(grad).map_err(codec_error)?;
        for (e, &u) in m.iter_mut().zip(grad.iter()) {
            *e -= u;
        }
        let error_norm = l2_norm(m);
        let stats = stats_for(
            &mut state.staleness,
            grad,
            (grad_norm, scale, residual_norm, error_norm),
            wire_bytes,
        )?;
        plan.compressed(p, &q_sum, dense_sum)
            .and_then(|sum| sum.decompress(grad))
            .map_err(codec_error)?;
        state.warm_q = Some(q_sum);
        Ok((stats, CompressedPath::PowerIteration, sent))
    }

    fn compressed_sparse(
        &self,
        grad: &mut [f32],
        state: &mut GradientCompressor,
    ) -> Result<(Stats, CompressedPath, u64), Error> {
        let (n, len) = (self.world_size(), grad.len());
        let (c, stats) = local_step(state, grad, "sparse")?;
        let nnz = match c.payload() {
            Payload::Sparse { indices, .. } => indices.len(),
            other => {
                return Err(internal(format!(
                    "a sparse codec produced {}",
                    other.kind_name()
                )))
            }
        };
        let mut counts = vec![0u64; n];
        self.all_gather(&[nnz as u64], &mut counts)?;
        let mut sent = self.gather_sent(8);
        if let Some(p) = counts.iter().position(|k| *k > len as u64) {
            return Err(self.mismatch(
                p,
                state.step,
                format!(
                    "rank {p} sends {} non-zeros of a {len}-element tensor",
                    counts[p]
                ),
            ));
        }
        let cfg = &state.config;
        match sparse_model::choose(cfg.sparse_path, len, &counts, cfg.dense_switch) {
            SparseRoute::AllGather => {}
            SparseRoute::ReduceScatter => {
                return self.sparse_reduce_scatter(grad, state, c, &counts, stats, sent)
            }
            SparseRoute::Dense => {
                grad.copy_from_slice(state.ef.last_update());
                self.all_reduce_in_place(grad, ReduceOp::Sum)?;
                sent += self.all_reduce_sent(len, DType::F32);
                return Ok((stats, CompressedPath::SparseDenseSwitch, sent));
            }
        }
        let bytes = |k: u64| HEADER + 4 + 8 * k as usize;
        let block = bytes(counts.iter().copied().max().unwrap_or(0));
        let mut mine = c.encode();
        mine.resize(block, 0);
        let mut all = ranks_times(n, block, "the gathered sparse tensors")?;
        self.all_gather_bytes(&mine, &mut all, DType::U8)?;
        sent += self.gather_sent(block);
        grad.fill(0.0);
        for (p, k) in counts.iter().enumerate() {
            let part = &all[p * block..p * block + bytes(*k)];
            let got = Compressed::decode_for(part, len).map_err(|e| {
                self.mismatch(p, state.step, format!("rank {p}'s sparse update: {e}"))
            })?;
            if !matches!(got.payload(), Payload::Sparse { .. }) {
                return Err(self.mismatch(
                    p,
                    state.step,
                    format!(
                        "rank {p} sent a {} tensor where sparse was expected",
                        got.payload().kind_name()
                    ),
                ));
            }
            got.accumulate(grad).map_err(codec_error)?;
        }
        Ok((stats, CompressedPath::SparseAllGather, sent))
    }

    fn compressed_two_phase(
        &self,
        grad: &mut [f32],
        state: &mut GradientCompressor,
    ) -> Result<(Stats, CompressedPath, u64), Error> {
        let (n, me, len) = (self.world_size(), self.rank(), grad.len());
        let spec = state.config.codec;
        let (block, kind) = match spec {
            CodecSpec::Int8 { block, .. } => (block, "int8"),
            CodecSpec::Sign { block } => (block, "sign"),
            CodecSpec::Mx { .. } => (MX_BLOCK, "mx"),
            other => return Err(internal(format!("{other} on the two-phase path"))),
        };
        let (c, stats) = local_step(state, grad, "two-phase")?;
        let parts = shards(len, block, n);
        let mut slot = 0;
        for s in &parts {
            slot = slot.max(quant_bytes(spec, s.len())?);
        }
        // Phase 1: shard j of the compressed residual goes to rank j.
        let mut send = ranks_times(n, slot, "the compressed shards to send")?;
        for (j, s) in parts.iter().enumerate() {
            let e = slice_quant(&c, s)?.encode();
            send[j * slot..j * slot + e.len()].copy_from_slice(&e);
        }
        let mut recv = ranks_times(n, slot, "the compressed shards received")?;
        self.all_to_all_bytes(&send, &mut recv, DType::U8)?;
        let mut sent = self.gather_sent(slot);
        let step = state.step;
        let decode = |bytes: &[u8], want: usize, p: usize| -> Result<Compressed, Error> {
            let got = Compressed::decode_for(&bytes[..quant_bytes(spec, want)?], want)
                .map_err(|e| self.mismatch(p, step, format!("rank {p}'s {kind} shard: {e}")))?;
            let ok = match got.payload() {
                Payload::Int8 { block: b, .. } => kind == "int8" && *b as usize == block,
                Payload::Sign { block: b, .. } => kind == "sign" && *b as usize == block,
                Payload::Mx { element, .. } => spec == CodecSpec::Mx { element: *element },
                _ => false,
            };
            if !ok {
                let sent = match got.payload() {
                    Payload::Int8 { block: b, .. } | Payload::Sign { block: b, .. } => {
                        format!("{} shard with block {b}", got.payload().kind_name())
                    }
                    Payload::Mx { element, .. } => format!("mx shard of {}", element.name()),
                    other => format!("{} shard", other.kind_name()),
                };
                return Err(self.mismatch(
                    p,
                    step,
                    format!("rank {p} sent a {sent} where {spec} ({kind}, blocks of {block}) was expected"),
                ));
            }
            Ok(got)
        };
        // Reduce this rank's shard in f32, in rank order.
        let own = parts[me].clone();
        let mut sum = vec![0.0f32; own.len()];
        for p in 0..n {
            decode(&recv[p * slot..(p + 1) * slot], own.len(), p)?
                .accumulate(&mut sum)
                .map_err(codec_error)?;
        }
        // Re-compress it with the shard's own error buffer.
        let stale = !matches!(&state.server, Some((w, r, _, ef)) if (*w, *r, ef.len()) == (n, me, own.len()));
        if stale {
            let server_codec = build_codec(spec, shard_seed(state.config.seed, me))?
                .ok_or_else(|| internal(format!("{spec} builds no codec")))?;
            let ef = GradientCompressor::error_feedback(&state.config, own.len(), None)?;
            state.server = Some((n, me, server_codec, ef));
        }
        let Some((_, _, server_codec, server_ef)) = state.server.as_mut() else {
            return Err(internal("the shard's codec is missing".into()));
        };
        let (shard, _) = server_ef
            .step(&sum, &mut **server_codec, state.step)
            .map_err(codec_error)?;
        // Phase 2: every rank gets every compressed shard and decodes the same bytes.
        let mut mine = shard.encode();
        mine.resize(slot, 0);
        let mut all = ranks_times(n, slot, "the gathered compressed shards")?;
        self.all_gather_bytes(&mine, &mut all, DType::U8)?;
        sent += self.gather_sent(slot);
        for (p, s) in parts.iter().enumerate() {
            decode(&all[p * slot..(p + 1) * slot], s.len(), p)?
                .decompress(&mut grad[s.clone()])
                .map_err(codec_error)?;
        }
        Ok((stats, CompressedPath::TwoPhase, sent))
    }
}

/// A zeroed buffer of `n` blocks of `block` bytes (sizes that peers' counts decide): an error, not an
/// abort, when it is too big.
fn ranks_times(n: usize, block: usize, what: &str) -> Result<Vec<u8>, Error> {
    let total = n
        .checked_mul(block)
        .ok_or_else(|| Error::OutOfMemory(format!("{what}: {n} × {block} bytes overflows")))?;
    braid_core::alloc::filled(0u8, total, what)
}

/// One step of error feedback through the local codec of `state`: the compressed residual and the
/// step's statistics. `path` names the path in the error if the codec is missing.
fn local_step(
    state: &mut GradientCompressor,
    grad: &[f32],
    path: &str,
) -> Result<(Compressed, Stats), Error> {
    let codec = state
        .codec
        .as_mut()
        .ok_or_else(|| internal(format!("the {path} path without a codec")))?;
    state
        .ef
        .step(grad, &mut **codec, state.step)
        .map_err(codec_error)
}

/// Adam-safe compression before the path: the first moment's buffer, and past the warm-up with
/// `send_moment`, the local first moment `β1·m + (1−β1)·g` in place of the gradient.
fn adam_before(
    state: &mut GradientCompressor,
    grad: &mut [f32],
    a: AdamSafe,
    send_moment: bool,
) -> Result<(), Error> {
    if state.adam_m.len() != grad.len() {
        state.adam_m = braid_core::alloc::filled(0.0f32, grad.len(), "Adam-safe first moment")?;
    }
    if send_moment {
        let b = a.beta1;
        for (g, m) in grad.iter_mut().zip(&state.adam_m) {
            *g = b * *m + (1.0 - b) * *g;
        }
    }
    Ok(())
}

/// Adam-safe compression after the path: the first moment from the averaged result (the result itself
/// when it was the moment that travelled), returned in `grad` past the warm-up.
fn adam_after(
    state: &mut GradientCompressor,
    grad: &mut [f32],
    a: AdamSafe,
    warming_up: bool,
    sent_moment: bool,
) -> Output {
    if warming_up || !sent_moment {
        let b = a.beta1;
        for (m, g) in state.adam_m.iter_mut().zip(grad.iter()) {
            *m = b * *m + (1.0 - b) * *g;
        }
    } else {
        state.adam_m.copy_from_slice(grad);
    }
    if warming_up {
        return Output::Gradient;
    }
    grad.copy_from_slice(&state.adam_m);
    Output::Momentum
}
