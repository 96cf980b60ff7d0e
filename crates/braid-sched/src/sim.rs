//! A reference executor: runs every rank's schedule in memory, with the real reduce kernels and channels
//! of bounded depth (like a transport's slots), and reports results, bytes moved and deadlocks.

use std::collections::VecDeque;
use std::fmt;

use braid_core::reduce::{self, Src};
use braid_core::{DType, ReduceOp};

use crate::{Action, Buf};

/// What one simulated run produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Each rank's output buffer.
    pub outputs: Vec<Vec<u8>>,
    /// Payload bytes each rank sent.
    pub bytes_sent: Vec<usize>,
    /// Messages each rank sent.
    pub messages: Vec<usize>,
    /// Payload bytes sent over each link: `link_bytes[from][to]`.
    pub link_bytes: Vec<Vec<usize>>,
}

/// Why a simulated run failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SimError {
    /// No rank could make progress; each rank's next action index.
    Deadlock(Vec<usize>),
    /// A message arrived with a length the receiver did not expect.
    LengthMismatch {
        /// Receiving rank.
        rank: usize,
        /// Sending rank.
        from: usize,
        /// Bytes expected.
        expected: usize,
        /// Bytes received.
        got: usize,
    },
    /// Ranks finished with messages still unread.
    Leftover(usize),
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

struct Net {
    queues: Vec<VecDeque<Vec<u8>>>, // index from * n + to
    n: usize,
    depth: usize,
}

impl Net {
    fn has(&self, from: usize, to: usize) -> bool {
        !self.queues[from * self.n + to].is_empty()
    }
    fn room(&self, from: usize, to: usize) -> bool {
        self.queues[from * self.n + to].len() < self.depth
    }
    fn pop(&mut self, from: usize, to: usize, expected: usize) -> Result<Vec<u8>, SimError> {
        let m = self.queues[from * self.n + to]
            .pop_front()
            .expect("checked by has()");
        if m.len() != expected {
            return Err(SimError::LengthMismatch {
                rank: to,
                from,
                expected,
                got: m.len(),
            });
        }
        Ok(m)
    }
}

/// Runs `plans` (one per rank) with `inputs[r]` as rank `r`'s input and an output of `out_count`
/// elements per rank. Channels hold at most `depth` messages, as a transport's slots do; ring schedules
/// need `depth >= 2`, because a fused receive-and-forward holds its incoming slot until the next slot frees.
pub fn run(
    plans: &[Vec<Action>],
    dtype: DType,
    op: ReduceOp,
    inputs: &[Vec<u8>],
    out_count: usize,
    depth: usize,
) -> Result<Outcome, SimError> {
    let n = plans.len();
    let (es, acc) = (dtype.size(), dtype.accumulator().size());
    let b = |r: &std::ops::Range<usize>, size: usize| r.start * size..r.end * size;
    let mut net = Net {
        queues: vec![VecDeque::new(); n * n],
        n,
        depth: depth.max(1),
    };
    let mut outputs = vec![vec![0u8; out_count * es]; n];
    let mut pc = vec![0usize; n];
    let mut scratch: Vec<Vec<u8>> = vec![Vec::new(); n];
    let mut bytes_sent = vec![0usize; n];
    let mut messages = vec![0usize; n];
    let mut link_bytes = vec![vec![0usize; n]; n];
    loop {
        let mut progressed = false;
        for r in 0..n {
            while let Some(action) = plans[r].get(pc[r]) {
                let ready = match action {
                    Action::Copy { .. } => true,
                    Action::Send { to, .. } | Action::SendAcc { to, .. } => net.room(r, *to),
                    Action::RecvReduceSend { from, to, .. } => {
                        net.has(*from, r) && net.room(r, *to)
                    }
                    Action::RecvReduceFinal { from, forward, .. }
                    | Action::RecvCopy { from, forward, .. } => {
                        net.has(*from, r) && forward.is_none_or(|t| net.room(r, t))
                    }
                    Action::RecvReduceAll { .. } => {
                        (0..n).filter(|p| *p != r).all(|p| net.has(p, r))
                    }
                    Action::LoadAcc { .. } | Action::FinishScratch { .. } => true,
                    Action::RecvCombine { from, .. } => net.has(*from, r),
                    Action::SendScratch { to, .. } => net.room(r, *to),
                };
                if !ready {
                    break;
                }
                let input = &inputs[r];
                let mut send = |to: usize, m: Vec<u8>, net: &mut Net| {
                    bytes_sent[r] += m.len();
                    link_bytes[r][to] += m.len();
                    messages[r] += 1;
                    net.queues[r * n + to].push_back(m);
                };
                match action {
                    Action::Copy { src, dst } => {
                        outputs[r][b(dst, es)].copy_from_slice(&input[b(src, es)])
                    }
                    Action::Send { to, buf, range } => {
                        let m = match buf {
                            Buf::Input => input[b(range, es)].to_vec(),
                            Buf::Output => outputs[r][b(range, es)].to_vec(),
                        };
                        send(*to, m, &mut net);
                    }
                    Action::SendAcc { to, range } => {
                        let mut m = vec![0u8; range.len() * acc];
                        reduce::to_acc(dtype, &mut m, &input[b(range, es)]);
                        send(*to, m, &mut net);
                    }
                    Action::RecvReduceSend { from, to, range } => {
                        let p = net.pop(*from, r, range.len() * acc)?;
                        let mut m = vec![0u8; range.len() * acc];
                        reduce::combine(dtype, op, &mut m, &p, &input[b(range, es)]);
                        send(*to, m, &mut net);
                    }
                    Action::RecvReduceFinal {
                        from,
                        input: ir,
                        output,
                        forward,
                        nranks,
                    } => {
                        let p = net.pop(*from, r, ir.len() * acc)?;
                        let out = &mut outputs[r][b(output, es)];
                        reduce::finalize(dtype, op, *nranks, out, &p, Src::Buf(&input[b(ir, es)]));
                        if let Some(t) = forward {
                            let m = out.to_vec();
                            send(*t, m, &mut net);
                        }
                    }
                    Action::RecvCopy {
                        from,
                        output,
                        forward,
                    } => {
                        let m = net.pop(*from, r, output.len() * es)?;
                        outputs[r][b(output, es)].copy_from_slice(&m);
                        if let Some(t) = forward {
                            send(*t, m, &mut net);
                        }
                    }
                    Action::RecvReduceAll {
                        input: ir,
                        output,
                        nranks,
                    } => {
                        let mut got = Vec::with_capacity(n);
                        for p in 0..n {
                            got.push(if p == r {
                                None
                            } else {
                                Some(net.pop(p, r, ir.len() * es)?)
                            });
                        }
                        let srcs: Vec<Src> = got
                            .iter()
                            .map(|m| Src::Buf(m.as_deref().unwrap_or(&input[b(ir, es)])))
                            .collect();
                        debug_assert_eq!(srcs.len(), *nranks);
                        reduce::reduce_ordered(dtype, op, &mut outputs[r][b(output, es)], &srcs);
                    }
                    Action::LoadAcc { range } => {
                        grow(&mut scratch[r], range.end * acc);
                        reduce::to_acc(dtype, &mut scratch[r][b(range, acc)], &input[b(range, es)]);
                    }
                    Action::RecvCombine { from, range } => {
                        let m = net.pop(*from, r, range.len() * acc)?;
                        grow(&mut scratch[r], range.end * acc);
                        reduce::combine_acc(dtype, op, &mut scratch[r][b(range, acc)], &m);
                    }
                    Action::SendScratch { to, range } => {
                        grow(&mut scratch[r], range.end * acc);
                        let m = scratch[r][b(range, acc)].to_vec();
                        send(*to, m, &mut net);
                    }
                    Action::FinishScratch { range, nranks } => {
                        grow(&mut scratch[r], range.end * acc);
                        let out = &mut outputs[r][b(range, es)];
                        reduce::finish_acc(dtype, op, *nranks, out, &scratch[r][b(range, acc)]);
                    }
                }
                pc[r] += 1;
                progressed = true;
            }
        }
        if (0..n).all(|r| pc[r] == plans[r].len()) {
            let left: usize = net.queues.iter().map(|q| q.len()).sum();
            if left > 0 {
                return Err(SimError::Leftover(left));
            }
            return Ok(Outcome {
                outputs,
                bytes_sent,
                messages,
                link_bytes,
            });
        }
        if !progressed {
            return Err(SimError::Deadlock(pc));
        }
    }
}

fn grow(v: &mut Vec<u8>, len: usize) {
    if v.len() < len {
        v.resize(len, 0);
    }
}
