//! One collective run straight through shared buffers, as a polled state machine like the executor's
//! runs: announce (descriptor, then the counter), check every rank's descriptor, reduce or copy this
//! rank's part, and for an all-reduce copy the others' reduced slices once they are done; then wait
//! until every rank is done with every buffer, so that the caller may change them again.
//!
//! Each stream's counter moves by three per collective: `base + 1` announced, `base + 2` this rank's
//! part done, `base + 3` finished with the buffers.

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use braid_core::reduce::{reduce_ordered, Src};
use braid_core::{DType, Error, ReduceOp};
use braid_exec::{Progress, Wait};
use braid_sched::shared::slice;
use braid_transport::shm::window::DESCRIPTOR_WORDS;
use braid_transport::WaitCtx;

use super::Shared;
use crate::exec::Kind;

/// Bytes of output per step: a poll's budget counts these.
const STEP_BYTES: usize = 256 << 10;

/// Where a run stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Announce,
    Check,
    Part,
    Others,
    Gather,
    Finish,
    Done,
}

/// A buffer as a descriptor names it: which allocation, where in it, how long (`u64::MAX` for none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Place {
    pub alloc: u64,
    pub offset: u64,
    pub len: u64,
}

impl Place {
    pub(super) const NONE: Place = Place {
        alloc: u64::MAX,
        offset: 0,
        len: 0,
    };
}

/// One piece of work: `dst = reduce(srcs)` or, with one source, a copy.
struct Job {
    dst: usize,
    srcs: Vec<usize>,
    bytes: usize,
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
    phase: Phase,
    /// Every rank's (input, output) address in this process's mappings, once checked.
    addrs: Vec<(usize, usize)>,
    jobs: Vec<Job>,
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
        send: Place,
        recv: Place,
        stream: usize,
        seq: u64,
        base: u32,
        started: Instant,
        deadline: Instant,
    ) -> SharedRun {
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
            phase: Phase::Announce,
            addrs: Vec::new(),
            jobs: Vec::new(),
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
                    sh.own().set_descriptor(stream, &self.desc);
                    sh.own().advance(stream, base.wrapping_add(1));
                    self.phase = Phase::Check;
                }
                Phase::Check => {
                    if !self.all_reached(sh, base.wrapping_add(1)) {
                        return Ok(self.wait_for());
                    }
                    self.check(sh)?;
                    self.jobs = self.part(sh.rank, sh.world());
                    self.at = (0, 0);
                    self.phase = Phase::Part;
                }
                Phase::Part | Phase::Gather => {
                    if !self.work(&mut steps, budget) {
                        return Ok(Progress::Yielded);
                    }
                    if self.phase == Phase::Part && self.kind == Kind::AllReduce {
                        sh.own().advance(stream, base.wrapping_add(2));
                        self.phase = Phase::Others;
                    } else {
                        sh.own().advance(stream, base.wrapping_add(3));
                        self.phase = Phase::Finish;
                    }
                }
                Phase::Others => {
                    if !self.all_reached(sh, base.wrapping_add(2)) {
                        return Ok(self.wait_for());
                    }
                    self.jobs = self.gather(sh.rank, sh.world());
                    self.at = (0, 0);
                    self.phase = Phase::Gather;
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
        let r = sh.boards[peer].wait(
            self.stream,
            target,
            sh.rank,
            peer,
            &sh.policy,
            &ctx,
            until.min(self.deadline),
        );
        if r.is_err() {
            self.phase = Phase::Done;
            sh.own().fail();
        }
        r
    }

    /// Checks every rank's descriptor against this one and resolves their buffers' addresses.
    fn check(&mut self, sh: &Shared) -> Result<(), Error> {
        let (world, es) = (sh.world(), self.dtype.size());
        let mut addrs = Vec::with_capacity(world);
        for p in 0..world {
            let d = if p == sh.rank {
                self.desc
            } else {
                sh.boards[p].descriptor(self.stream)
            };
            if d[..3] != self.desc[..3] {
                return Err(Error::Mismatch {
                    rank: sh.rank,
                    peer: p,
                    collective: self.kind.name().into(),
                    seq: self.seq,
                    detail: format!(
                        "on shared buffers this rank runs {}, rank {p} {}",
                        describe(&self.desc),
                        describe(&d)
                    ),
                });
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
            Kind::AllReduce | Kind::Reduce { .. } => {
                let s = slice(c, es, world, rank);
                let dst_rank = match self.kind {
                    Kind::Reduce { root } => root,
                    _ => rank,
                };
                vec![Job {
                    dst: recv(dst_rank) + s.start * es,
                    srcs: every(s.start * es),
                    bytes: s.len() * es,
                }]
            }
            Kind::ReduceScatter => vec![Job {
                dst: recv(rank),
                srcs: every(rank * c * es),
                bytes: c * es,
            }],
            Kind::AllGather => (0..world)
                .map(|p| Job {
                    dst: recv(rank) + p * c * es,
                    srcs: vec![send(p)],
                    bytes: c * es,
                })
                .collect(),
            Kind::Broadcast { root } => vec![Job {
                dst: recv(rank),
                srcs: vec![send(root)],
                bytes: c * es,
            }],
            Kind::Barrier | Kind::AllToAll => Vec::new(),
        }
    }

    /// An all-reduce's second part: the other ranks' reduced slices.
    fn gather(&self, rank: usize, world: usize) -> Vec<Job> {
        let es = self.dtype.size();
        (0..world)
            .filter(|&p| p != rank)
            .map(|p| {
                let s = slice(self.count, es, world, p);
                Job {
                    dst: self.addrs[rank].1 + s.start * es,
                    srcs: vec![self.addrs[p].1 + s.start * es],
                    bytes: s.len() * es,
                }
            })
            .collect()
    }

    /// Runs jobs until they are all done (`true`) or the step budget is spent.
    fn work(&mut self, steps: &mut u64, budget: u64) -> bool {
        let es = self.dtype.size();
        let step = STEP_BYTES.next_multiple_of(64) / es * es;
        while let Some(job) = self.jobs.get(self.at.0) {
            let done = self.at.1;
            if done >= job.bytes {
                self.at = (self.at.0 + 1, 0);
                continue;
            }
            if *steps >= budget {
                return false;
            }
            let n = step.min(job.bytes - done);
            let dst = job.dst + done;
            let reduce = job.srcs.len() > 1;
            // SAFETY: every address was resolved inside a mapped window against the length its
            // owner's descriptor names and this collective needs (`check`); the phase protocol gives
            // this rank the only write access to `dst..dst + n` until it advances its counter, and no
            // rank writes a source range while this phase reads it. Only copies alias (a rank's own
            // block in place, skipped) and reductions see an aliasing source as `Src::Dst`.
            unsafe {
                if reduce {
                    let out = std::slice::from_raw_parts_mut(dst as *mut u8, n);
                    let srcs: Vec<Src<'_>> = job
                        .srcs
                        .iter()
                        .map(|&s| {
                            if s + done == dst {
                                Src::Dst
                            } else {
                                Src::Buf(std::slice::from_raw_parts((s + done) as *const u8, n))
                            }
                        })
                        .collect();
                    reduce_ordered(self.dtype, self.redop, out, &srcs);
                } else if job.srcs[0] + done != dst {
                    std::ptr::copy_nonoverlapping((job.srcs[0] + done) as *const u8, dst as *mut u8, n);
                }
            }
            self.at.1 += n;
            *steps += 1;
        }
        true
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
    fn every_rank_names_the_lengths_its_collective_needs() {
        assert_eq!(lens(Kind::AllReduce, 3, 4, 2, 1), (12, 12));
        assert_eq!(lens(Kind::ReduceScatter, 3, 4, 5, 0), (60, 12));
        assert_eq!(lens(Kind::AllGather, 3, 2, 5, 4), (6, 30));
        assert_eq!(lens(Kind::Reduce { root: 1 }, 3, 8, 3, 0), (24, 0));
        assert_eq!(lens(Kind::Reduce { root: 1 }, 3, 8, 3, 1), (24, 24));
        let d = SharedRun::new(
            Kind::Broadcast { root: 2 },
            DType::F32,
            ReduceOp::Sum,
            7,
            Place::NONE,
            Place::NONE,
            0,
            0,
            0,
            Instant::now(),
            Instant::now(),
        )
        .desc;
        assert_eq!(describe(&d), "broadcast (root 2, sum) of 7 float");
    }
}
