//! One collective run straight through shared buffers, as a polled state machine like the executor's
//! runs: announce (descriptor, then the counter), check every rank's descriptor, reduce or copy this
//! rank's part (for an all-reduce: reduce slice `r` of every input and store it into every rank's
//! output, chunk by chunk); then wait until every rank is done with every buffer, so that the caller
//! may change them again.
//!
//! Each stream's counter moves by three per collective: `base + 1` announced, `base + 3` this rank's
//! part done (`base + 2` is left free).
//!
//! A small collective (every rank's input at most [`INLINE_BYTES`]) needs one exchange instead of
//! three: each rank copies its input onto its own board and announces it (`base + 3` at once); once
//! every rank has, each computes its own output from the boards. No rank reads another's buffers, so
//! nothing waits for the others to finish. Descriptors and inline areas alternate between two copies
//! per stream, so a rank rewrites one only after every peer has announced a later collective (and so
//! finished reading it).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use braid_core::reduce::{reduce_ordered, Src};
use braid_core::{DType, Error, ReduceOp};
use braid_exec::{Progress, Wait};
use braid_sched::shared::slice;
use braid_transport::shm::window::{DESCRIPTOR_WORDS, INLINE_BYTES};
use braid_transport::WaitCtx;

use super::memory::{Place, Shared};
use crate::call::Kind;

/// Bytes of output per step: a poll's budget counts these.
const STEP_BYTES: usize = 256 << 10;
/// Bytes per step of a streamed job: its reduction stays in the core's cache.
const SCRATCH_BYTES: usize = 64 << 10;
/// The smallest output (per rank) whose cold destinations are written with non-temporal stores:
/// smaller ones may still be in cache for whoever reads them next. (Measured with `braid perf
/// --shared`, 2 ranks: from 16 MiB streaming is 1.0–1.5× faster across the collectives, 1.3–1.7× at
/// 64 MiB; at 4 MiB it was up to 2× slower.)
pub(crate) const STREAM_MIN_BYTES: usize = 16 << 20;

/// An inline area starts with its stamp (the counter value of the collective it holds), the
/// collective's kind and shape (two words, the descriptor's first three packed) and the input, so that
/// a small collective's peers find all of it in one cache line.
const INLINE_HEADER: usize = 32;
/// The most input bytes an inline collective takes.
const INLINE_INPUT: usize = 8 << 10;
const _: () = assert!(INLINE_HEADER + INLINE_INPUT <= INLINE_BYTES);
/// Ranks whose sources an inline reduction lists on the stack.
const STACK_RANKS: usize = 16;

/// Where a run stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Announce,
    Check,
    Part,
    Finish,
    Done,
}

/// One piece of work: `reduce(srcs)` (or, with one source, that source) stored into every `dsts`.
/// Without `streamed` the reduction goes straight into `dsts[0]` and is copied from there into the
/// others; with it the reduction goes into a small scratch buffer that stays in cache, and every
/// destination is written with non-temporal stores (no read of the destination's old lines first, and
/// nothing evicted for data this rank will not read again).
struct Job {
    dsts: Vec<usize>,
    srcs: Vec<usize>,
    bytes: usize,
    streamed: bool,
}

impl Job {
    fn new(dsts: Vec<usize>, srcs: Vec<usize>, bytes: usize) -> Job {
        Job {
            dsts,
            srcs,
            bytes,
            streamed: false,
        }
    }
}

/// A collective over shared buffers, started.
pub(crate) struct SharedRun {
    pub(crate) stream: usize,
    pub(crate) seq: u64,
    pub(crate) kind: Kind,
    dtype: DType,
    redop: ReduceOp,
    count: usize,
    desc: [u64; DESCRIPTOR_WORDS],
    /// The counter's value before this run.
    base: u32,
    /// Which of the two descriptors and inline areas it uses.
    parity: usize,
    /// Its number among the stream's collectives on shared buffers, plus one: the inline stamp.
    stamp: u64,
    /// Whether it runs through the boards' inline areas (one exchange).
    inline: bool,
    /// This rank's input, copied onto its board when inline.
    input: (usize, usize),
    /// This rank's output (written by the inline path).
    recv_addr: usize,
    phase: Phase,
    /// Every rank's (input, output) address in this process's mappings, once checked.
    addrs: Vec<(usize, usize)>,
    jobs: Vec<Job>,
    /// Where a streamed job's reduction goes, a piece at a time (allocated when a job streams).
    scratch: Vec<u64>,
    /// The job under way and bytes of it done.
    at: (usize, usize),
    /// The rank and counter value the run waits for.
    waiting: (usize, u32),
    pub(crate) started: Instant,
    deadline: Instant,
}

fn kind_code(kind: Kind) -> u64 {
    match kind {
        Kind::AllReduce => 1,
        Kind::ReduceScatter => 2,
        Kind::AllGather => 3,
        Kind::Broadcast { root } => 4 | (root as u64) << 8,
        Kind::Reduce { root } => 5 | (root as u64) << 8,
        Kind::Barrier => 6,
        Kind::AllToAll => 7,
    }
}

/// The bytes rank `p` must name as input and output for `kind` over `count` elements.
fn lens(kind: Kind, count: usize, es: usize, world: usize, p: usize) -> (usize, usize) {
    let c = count * es;
    match kind {
        Kind::AllReduce | Kind::Broadcast { .. } => (c, c),
        Kind::ReduceScatter => (world * c, c),
        Kind::AllGather => (c, world * c),
        Kind::Reduce { root } => (c, if p == root { c } else { 0 }),
        Kind::Barrier | Kind::AllToAll => (0, 0),
    }
}

impl SharedRun {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        kind: Kind,
        dtype: DType,
        redop: ReduceOp,
        count: usize,
        (send, recv): (Place, Place),
        (input, recv_addr): ((usize, usize), usize),
        world: usize,
        stream: usize,
        seq: u64,
        (base, ops): (u32, u64),
        started: Instant,
        deadline: Instant,
    ) -> SharedRun {
        let inline =
            (0..world).all(|p| lens(kind, count, dtype.size(), world, p).0 <= INLINE_INPUT);
        let desc = [
            kind_code(kind),
            dtype as u64 | (redop as u64) << 8,
            count as u64,
            send.alloc,
            send.offset,
            send.len,
            recv.alloc,
            recv.offset,
            recv.len,
            0,
        ];
        SharedRun {
            stream,
            seq,
            kind,
            dtype,
            redop,
            count,
            desc,
            base,
            parity: (ops & 1) as usize,
            stamp: ops + 1,
            inline,
            input,
            recv_addr,
            phase: Phase::Announce,
            addrs: Vec::new(),
            jobs: Vec::new(),
            scratch: Vec::new(),
            at: (0, 0),
            waiting: (0, 0),
            started,
            deadline,
        }
    }

    /// Whether every rank has reached `target`; if not, waits for the first that has not.
    fn all_reached(&mut self, sh: &Shared, target: u32) -> bool {
        for (p, b) in sh.boards.iter().enumerate() {
            if !b.reached(self.stream, target) {
                self.waiting = (p, target);
                return false;
            }
        }
        true
    }

    /// Whether every rank has stamped its inline area for this run; if not, waits for the first that
    /// has not.
    fn all_stamped(&mut self, sh: &Shared) -> bool {
        let want = self.stamp;
        for (p, b) in sh.boards.iter().enumerate() {
            if b.inline_stamp(self.stream, self.parity)
                .load(Ordering::Acquire)
                != want
            {
                self.waiting = (p, 0);
                return false;
            }
        }
        true
    }

    fn wait_for(&self) -> Progress {
        Progress::Blocked(Wait::Flag {
            peer: self.waiting.0,
        })
    }

    /// Advances the run by at most `budget` steps.
    pub(crate) fn poll(&mut self, sh: &Shared, budget: u64) -> Result<Progress, Error> {
        let r = self.poll_inner(sh, budget);
        if r.is_err() {
            self.phase = Phase::Done;
            sh.own().fail();
        }
        r
    }

    fn poll_inner(&mut self, sh: &Shared, budget: u64) -> Result<Progress, Error> {
        let (stream, base) = (self.stream, self.base);
        let mut steps = 0u64;
        loop {
            match self.phase {
                Phase::Announce => {
                    let own = sh.own();
                    if self.inline {
                        let (at, len) = self.input;
                        let area = own.inline_area(stream, self.parity);
                        let header = self.header();
                        // SAFETY: the op's input is valid for `len` bytes (the op's contract);
                        // the header and `len <= INLINE_INPUT` bytes fit the area; the area is
                        // this rank's to write until it announces (see the module docs), and
                        // 64-byte aligned.
                        unsafe {
                            (area.add(8) as *mut [u64; 2]).write(header);
                            std::ptr::copy_nonoverlapping(
                                at as *const u8,
                                area.add(INLINE_HEADER),
                                len,
                            );
                        }
                        // The stamp last (release): whoever sees it sees the input.
                        let done = base.wrapping_add(3);
                        own.inline_stamp(stream, self.parity)
                            .store(self.stamp, Ordering::Release);
                        // Nothing follows that a peer waits for: the run's last value at once.
                        own.advance(stream, done);
                    } else {
                        own.set_descriptor(stream, self.parity, &self.desc);
                        own.advance(stream, base.wrapping_add(1));
                    }
                    self.phase = Phase::Check;
                }
                Phase::Check => {
                    if self.inline {
                        if !self.all_stamped(sh) {
                            return Ok(self.wait_for());
                        }
                        self.run_inline(sh)?;
                        self.phase = Phase::Done;
                        continue;
                    }
                    if !self.all_reached(sh, base.wrapping_add(1)) {
                        return Ok(self.wait_for());
                    }
                    self.check(sh)?;
                    self.jobs = self.part(sh.rank, sh.world());
                    self.stream_cold_outputs();
                    self.at = (0, 0);
                    self.phase = Phase::Part;
                }
                Phase::Part => {
                    if !self.work(&mut steps, budget) {
                        return Ok(Progress::Yielded);
                    }
                    sh.own().advance(stream, base.wrapping_add(3));
                    self.phase = Phase::Finish;
                }
                Phase::Finish => {
                    if !self.all_reached(sh, base.wrapping_add(3)) {
                        return Ok(self.wait_for());
                    }
                    self.phase = Phase::Done;
                }
                Phase::Done => return Ok(Progress::Done),
            }
        }
    }

    /// Sleeps until the flag the run waits for may have moved, or `until`.
    pub(crate) fn wait(
        &mut self,
        sh: &Shared,
        abort: &AtomicBool,
        until: Instant,
    ) -> Result<(), Error> {
        let (peer, target) = self.waiting;
        let ctx = WaitCtx {
            rank: sh.rank,
            collective: self.kind.name(),
            seq: self.seq,
            deadline: self.deadline,
            started: self.started,
            abort,
        };
        let board = &sh.boards[peer];
        let until = until.min(self.deadline);
        let r = if self.inline {
            let (stamp, want) = (board.inline_stamp(self.stream, self.parity), self.stamp);
            board.wait_for(self.stream, sh.rank, peer, &sh.policy, &ctx, until, || {
                stamp.load(Ordering::Acquire) == want
            })
        } else {
            board.wait(self.stream, target, sh.rank, peer, &sh.policy, &ctx, until)
        };
        if r.is_err() {
            self.phase = Phase::Done;
            sh.own().fail();
        }
        r
    }

    /// The error for rank `peer` running the collective `theirs` describes instead of this one.
    fn mismatch(&self, rank: usize, peer: usize, theirs: &[u64; DESCRIPTOR_WORDS]) -> Error {
        Error::Mismatch {
            rank,
            peer,
            collective: self.kind.name().into(),
            seq: self.seq,
            detail: format!(
                "on shared buffers this rank runs {}, rank {peer} {}",
                describe(&self.desc),
                describe(theirs)
            ),
        }
    }

    /// Checks every rank's descriptor against this one and resolves their buffers' addresses.
    fn check(&mut self, sh: &Shared) -> Result<(), Error> {
        let (world, es) = (sh.world(), self.dtype.size());
        let mut addrs = Vec::with_capacity(world);
        for p in 0..world {
            let d = if p == sh.rank {
                self.desc
            } else {
                sh.boards[p].descriptor(self.stream, self.parity)
            };
            if d[..3] != self.desc[..3] {
                return Err(self.mismatch(sh.rank, p, &d));
            }
            let (send_len, recv_len) = lens(self.kind, self.count, es, world, p);
            let send = Place {
                alloc: d[3],
                offset: d[4],
                len: d[5],
            };
            let recv = Place {
                alloc: d[6],
                offset: d[7],
                len: d[8],
            };
            let bad = |what: &str, place: Place, want: usize| Error::Mismatch {
                rank: sh.rank,
                peer: p,
                collective: self.kind.name().into(),
                seq: self.seq,
                detail: format!(
                    "rank {p}'s {what} buffer ({place:?}) is not {want} bytes of its shared memory"
                ),
            };
            let send_at = sh
                .resolve(p, send, send_len)
                .ok_or_else(|| bad("input", send, send_len))?;
            let recv_at = sh
                .resolve(p, recv, recv_len)
                .ok_or_else(|| bad("output", recv, recv_len))?;
            addrs.push((send_at, recv_at));
        }
        self.addrs = addrs;
        Ok(())
    }

    /// This rank's part: what it reduces or copies once every rank has announced its buffers.
    fn part(&self, rank: usize, world: usize) -> Vec<Job> {
        let es = self.dtype.size();
        let c = self.count;
        let send = |p: usize| self.addrs[p].0;
        let recv = |p: usize| self.addrs[p].1;
        let every = |at: usize| (0..world).map(|p| send(p) + at).collect::<Vec<_>>();
        match self.kind {
            Kind::AllReduce => {
                // Chunk by chunk: reduce it, and store it into every rank's output (this rank's
                // first) while it is still in this core's cache.
                let s = slice(c, es, world, rank);
                let step = (STEP_BYTES / es).max(1);
                let outputs = |off: usize| {
                    std::iter::once(rank)
                        .chain((0..world).filter(|&p| p != rank))
                        .map(|p| recv(p) + off)
                        .collect()
                };
                (s.start..s.end)
                    .step_by(step)
                    .map(|at| {
                        let (off, bytes) = (at * es, step.min(s.end - at) * es);
                        Job::new(outputs(off), every(off), bytes)
                    })
                    .collect()
            }
            Kind::Reduce { root } => {
                let s = slice(c, es, world, rank);
                vec![Job::new(
                    vec![recv(root) + s.start * es],
                    every(s.start * es),
                    s.len() * es,
                )]
            }
            Kind::ReduceScatter => vec![Job::new(vec![recv(rank)], every(rank * c * es), c * es)],
            Kind::AllGather => (0..world)
                .map(|p| Job::new(vec![recv(rank) + p * c * es], vec![send(p)], c * es))
                .collect(),
            Kind::Broadcast { root } => vec![Job::new(vec![recv(rank)], vec![send(root)], c * es)],
            Kind::Barrier | Kind::AllToAll => Vec::new(),
        }
    }

    /// Marks the jobs of a large collective whose destinations none of their sources is (so this rank
    /// has not just read them: an out-of-place output) to write with non-temporal stores.
    fn stream_cold_outputs(&mut self) {
        // The largest output of any rank (a reduce's is the root's), so every rank streams alike;
        // elsewhere than x86-64 there are no streaming stores to gain from.
        let world = self.addrs.len();
        let out = (0..world)
            .map(|p| lens(self.kind, self.count, self.dtype.size(), world, p).1)
            .max()
            .unwrap_or(0);
        if out < STREAM_MIN_BYTES || !cfg!(target_arch = "x86_64") {
            return;
        }
        for job in &mut self.jobs {
            job.streamed = job.dsts.iter().all(|d| !job.srcs.contains(d));
        }
        if self.jobs.iter().any(|j| j.streamed) {
            self.scratch = vec![0u64; SCRATCH_BYTES / 8];
        }
    }

    /// The inline area's header: the descriptor's kind, dtype and op, and count, packed.
    fn header(&self) -> [u64; 2] {
        [self.desc[0], self.desc[1] | self.desc[2] << 16]
    }

    /// An inline collective once every rank has announced it: checks every rank's header, then
    /// computes this rank's whole output from the copies on the boards (no allocation for up to
    /// [`STACK_RANKS`] ranks).
    fn run_inline(&self, sh: &Shared) -> Result<(), Error> {
        let (rank, world, stream) = (sh.rank, sh.world(), self.stream);
        let want = self.header();
        let area = |p: usize| sh.boards[p].inline_area(stream, self.parity);
        for p in (0..world).filter(|&p| p != rank) {
            // SAFETY: the area is 64-byte aligned and at least a header long; rank `p` wrote it before
            // advancing the counter this rank has seen (acquire), and rewrites it only after this
            // rank has announced a later collective.
            let got = unsafe { (area(p).add(8) as *const [u64; 2]).read() };
            if got != want {
                let mut desc = [0u64; DESCRIPTOR_WORDS];
                desc[0] = got[0];
                desc[1] = got[1] & 0xffff;
                desc[2] = got[1] >> 16;
                return Err(self.mismatch(rank, p, &desc));
            }
        }
        let (es, c) = (self.dtype.size(), self.count);
        let out_len = lens(self.kind, c, es, world, rank).1;
        let recv = self.recv_addr;
        // SAFETY: `recv` is this rank's output of `out_len` bytes (the op's contract), which no peer
        // reads or writes on the inline path; every source lies within a peer's inline area (its input
        // is at most INLINE_INPUT bytes, checked when the run chose the inline path), which its owner
        // does not rewrite until this rank announces a later collective.
        unsafe {
            let out = std::slice::from_raw_parts_mut(recv as *mut u8, out_len);
            let input = |p: usize, at: usize, len: usize| {
                std::slice::from_raw_parts(area(p).add(INLINE_HEADER + at) as *const u8, len)
            };
            let reduce = |out: &mut [u8], at: usize| {
                let n = out.len();
                if world <= STACK_RANKS {
                    let mut srcs = [Src::Dst; STACK_RANKS];
                    for (p, s) in srcs.iter_mut().enumerate().take(world) {
                        *s = Src::Buf(input(p, at, n));
                    }
                    reduce_ordered(self.dtype, self.redop, out, &srcs[..world]);
                } else {
                    let srcs: Vec<Src<'_>> =
                        (0..world).map(|p| Src::Buf(input(p, at, n))).collect();
                    reduce_ordered(self.dtype, self.redop, out, &srcs);
                }
            };
            match self.kind {
                Kind::AllReduce => reduce(out, 0),
                Kind::Reduce { root } if root == rank => reduce(out, 0),
                Kind::ReduceScatter => reduce(out, rank * c * es),
                Kind::AllGather => {
                    for (p, block) in out.chunks_exact_mut(c * es).enumerate() {
                        block.copy_from_slice(input(p, 0, c * es));
                    }
                }
                Kind::Broadcast { root } => out.copy_from_slice(input(root, 0, c * es)),
                Kind::Reduce { .. } | Kind::Barrier | Kind::AllToAll => {}
            }
        }
        Ok(())
    }

    /// Runs jobs until they are all done (`true`) or the step budget is spent.
    fn work(&mut self, steps: &mut u64, budget: u64) -> bool {
        let es = self.dtype.size();
        while let Some(job) = self.jobs.get(self.at.0) {
            let done = self.at.1;
            if done >= job.bytes {
                self.at = (self.at.0 + 1, 0);
                continue;
            }
            if *steps >= budget {
                return false;
            }
            let step = if job.streamed {
                SCRATCH_BYTES
            } else {
                STEP_BYTES
            };
            let n = (step / es * es).min(job.bytes - done);
            let at = |a: usize| a + done;
            // SAFETY: every address was resolved inside a mapped window against the length its
            // owner's descriptor names and this collective needs (`check`); the phase protocol gives
            // this rank the only write access to every destination range until it advances its
            // counter, and no rank writes a source range while this phase reads it. A destination
            // that is also a source is only ever the reduction's own (`Src::Dst`) or a copy's (then
            // skipped); the scratch buffer is this run's, at least `n` bytes and 8-byte aligned.
            unsafe {
                let (from, rest) = if job.srcs.len() > 1 {
                    let into = if job.streamed {
                        self.scratch.as_mut_ptr() as usize
                    } else {
                        at(job.dsts[0])
                    };
                    let out = std::slice::from_raw_parts_mut(into as *mut u8, n);
                    let srcs: Vec<Src<'_>> = job
                        .srcs
                        .iter()
                        .map(|&s| {
                            if at(s) == into {
                                Src::Dst
                            } else {
                                Src::Buf(std::slice::from_raw_parts(at(s) as *const u8, n))
                            }
                        })
                        .collect();
                    reduce_ordered(self.dtype, self.redop, out, &srcs);
                    let rest = if job.streamed {
                        &job.dsts[..]
                    } else {
                        &job.dsts[1..]
                    };
                    (into, rest)
                } else {
                    (at(job.srcs[0]), &job.dsts[..])
                };
                for &d in rest {
                    let d = at(d);
                    if job.streamed {
                        stream_copy(from as *const u8, d as *mut u8, n);
                    } else if d != from {
                        std::ptr::copy_nonoverlapping(from as *const u8, d as *mut u8, n);
                    }
                }
            }
            self.at.1 += n;
            *steps += 1;
        }
        true
    }
}

/// Copies `n` bytes from `src` to `dst` with non-temporal stores where the machine has them (x86-64),
/// an ordinary copy elsewhere; then orders those stores before any later store (`sfence`), so that
/// the release store announcing them covers them.
///
/// # Safety
/// `src` is readable and `dst` writable for `n` bytes, and the ranges do not overlap.
unsafe fn stream_copy(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let head = dst.align_offset(16).min(n);
        // SAFETY: within both ranges (the caller's contract); the streamed stores go to 16-byte
        // aligned addresses of `dst`, and SSE2 is part of x86-64.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let mut i = head;
            while i + 64 <= n {
                let (s, d) = (src.add(i) as *const __m128i, dst.add(i) as *mut __m128i);
                let v = [
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                ];
                for (k, v) in v.into_iter().enumerate() {
                    _mm_stream_si128(d.add(k), v);
                }
                i += 64;
            }
            while i + 16 <= n {
                _mm_stream_si128(
                    dst.add(i) as *mut __m128i,
                    _mm_loadu_si128(src.add(i) as *const __m128i),
                );
                i += 16;
            }
            std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i);
            _mm_sfence();
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, n);
    }
}

fn describe(d: &[u64; DESCRIPTOR_WORDS]) -> String {
    let kind = match d[0] & 0xff {
        1 => "all_reduce",
        2 => "reduce_scatter",
        3 => "all_gather",
        4 => "broadcast",
        5 => "reduce",
        _ => "an unknown collective",
    };
    let dtype = DType::ALL
        .get((d[1] & 0xff) as usize)
        .map_or("?", |t| t.name());
    let op = ReduceOp::ARITHMETIC
        .iter()
        .chain(&ReduceOp::BITWISE)
        .find(|o| **o as u64 == (d[1] >> 8) & 0xff)
        .map_or("?", |o| o.name());
    format!("{kind} (root {}, {op}) of {} {dtype}", d[0] >> 8, d[2])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streamed_copy_copies_every_length_at_every_alignment() {
        let src: Vec<u8> = (0..400u32).map(|i| (i * 7 + 3) as u8).collect();
        for n in (0..200).chain([255, 256, 257, 320]) {
            for s_off in 0..17 {
                for d_off in 0..17 {
                    let mut dst = vec![0xeeu8; 400];
                    // SAFETY: both ranges lie within their vectors (offsets < 17, n ≤ 320 < 400 − 17),
                    // which do not overlap.
                    unsafe { stream_copy(src.as_ptr().add(s_off), dst.as_mut_ptr().add(d_off), n) };
                    assert_eq!(
                        &dst[d_off..d_off + n],
                        &src[s_off..s_off + n],
                        "n {n} at {s_off}→{d_off}"
                    );
                    assert!(dst[..d_off]
                        .iter()
                        .chain(&dst[d_off + n..])
                        .all(|&b| b == 0xee));
                }
            }
        }
    }

    #[test]
    fn a_collective_is_inline_when_every_rank_s_input_fits_its_board() {
        let run = |kind, count, world| {
            SharedRun::new(
                kind,
                DType::F64,
                ReduceOp::Sum,
                count,
                (Place::NONE, Place::NONE),
                ((0, 0), 0),
                world,
                0,
                0,
                (0, 0),
                Instant::now(),
                Instant::now(),
            )
            .inline
        };
        assert!(run(Kind::AllReduce, INLINE_INPUT / 8, 4));
        assert!(!run(Kind::AllReduce, INLINE_INPUT / 8 + 1, 4));
        // A reduce-scatter's input is world blocks.
        assert!(!run(Kind::ReduceScatter, INLINE_INPUT / 8 / 4 + 1, 4));
        assert!(run(Kind::AllGather, INLINE_INPUT / 8, 4));
    }

    #[test]
    fn every_rank_names_the_lengths_its_collective_needs() {
        assert_eq!(lens(Kind::AllReduce, 3, 4, 2, 1), (12, 12));
        assert_eq!(lens(Kind::ReduceScatter, 3, 4, 5, 0), (60, 12));
        assert_eq!(lens(Kind::AllGather, 3, 2, 5, 4), (6, 30));
        assert_eq!(lens(Kind::Reduce { root: 1 }, 3, 8, 3, 0), (24, 0));
        assert_eq!(lens(Kind::Reduce { root: 1 }, 3, 8, 3, 1), (24, 24));
        let r = SharedRun::new(
            Kind::Broadcast { root: 2 },
            DType::F32,
            ReduceOp::Sum,
            7,
            (Place::NONE, Place::NONE),
            ((0, 28), 0),
            3,
            0,
            0,
            (0, 0),
            Instant::now(),
            Instant::now(),
        );
        assert!(r.inline, "28 bytes go through the boards");
        let d = r.desc;
        assert_eq!(describe(&d), "broadcast (root 2, sum) of 7 float");
    }
}
