//! The flight recorder: the last collectives of a communicator, so that a hang or a failure says what
//! was running, for how long, and what came before.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use braid_core::Error;
use parking_lot::Mutex;

use crate::exec::Op;
use crate::tune::Algo;

/// How many collectives are kept.
pub const CAPACITY: usize = 64;

/// What became of a collective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Still running (or stuck).
    Running,
    /// Finished.
    Done,
    /// Failed with this error.
    Failed(String),
}

/// One collective as the recorder saw it.
#[derive(Clone, Debug)]
pub struct FlightRecord {
    /// The stream it ran on (0 carries the blocking calls).
    pub stream: usize,
    /// Sequence number on its stream.
    pub seq: u64,
    /// Collective name.
    pub op: &'static str,
    /// Element count.
    pub count: usize,
    /// Element type name.
    pub dtype: &'static str,
    /// Algorithm used.
    pub algo: &'static str,
    /// When it started.
    pub started: SystemTime,
    /// How long it ran (so far, while running).
    pub elapsed: Duration,
    /// Its state.
    pub state: State,
}

impl fmt::Display for FlightRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Running => "RUNNING".to_string(),
            State::Done => "done".to_string(),
            State::Failed(e) => format!("FAILED: {e}"),
        };
        let at = if self.stream == 0 {
            format!("#{}", self.seq)
        } else {
            format!("s{}#{}", self.stream, self.seq)
        };
        write!(
            f,
            "{at:<7} {:<14} count {:<10} {:<8} {:<6} {:>10.1} us  {state}",
            self.op,
            self.count,
            self.dtype,
            self.algo,
            self.elapsed.as_secs_f64() * 1e6
        )
    }
}

/// A shared ring buffer of [`FlightRecord`]s (readable while a collective runs). The hot path stores
/// monotonic start times it already has; wall-clock times are derived only when someone asks.
#[derive(Clone, Default)]
pub struct Recorder {
    records: Arc<Mutex<VecDeque<(Instant, FlightRecord)>>>,
}

impl Recorder {
    pub(crate) fn start(&self, stream: usize, seq: u64, op: &Op, algo: Algo, started: Instant) {
        let mut r = self.records.lock();
        if r.len() == CAPACITY {
            r.pop_front();
        }
        let rec = FlightRecord {
            stream,
            seq,
            op: op.kind.name(),
            count: op.count,
            dtype: op.dtype.name(),
            algo: algo.name(),
            started: SystemTime::UNIX_EPOCH,
            elapsed: Duration::ZERO,
            state: State::Running,
        };
        r.push_back((started, rec));
    }

    pub(crate) fn finish(
        &self,
        stream: usize,
        seq: u64,
        result: &Result<(), Error>,
        elapsed: Duration,
    ) {
        let mut r = self.records.lock();
        if let Some((_, rec)) = r
            .iter_mut()
            .rev()
            .find(|x| x.1.seq == seq && x.1.stream == stream)
        {
            rec.elapsed = elapsed;
            rec.state = match result {
                Ok(()) => State::Done,
                Err(e) => State::Failed(e.to_string()),
            };
        }
    }

    /// A copy of the records, oldest first; running ones show their time so far.
    pub fn snapshot(&self) -> Vec<FlightRecord> {
        let r = self.records.lock();
        let (now_wall, now) = (SystemTime::now(), Instant::now());
        r.iter()
            .map(|(t, x)| {
                let mut x = x.clone();
                x.started = now_wall - now.duration_since(*t);
                if x.state == State::Running {
                    x.elapsed = now.duration_since(*t);
                }
                x
            })
            .collect()
    }

    /// The records as text, one per line.
    pub fn dump(&self) -> String {
        let recs = self.snapshot();
        let mut out = format!(
            "flight recorder (last {} collectives, oldest first):",
            recs.len()
        );
        for r in recs {
            out.push_str("\n  ");
            out.push_str(&r.to_string());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_records_and_their_states() {
        let rec = Recorder::default();
        for seq in 0..(CAPACITY as u64 + 10) {
            rec.records.lock().push_back((
                Instant::now(),
                FlightRecord {
                    stream: 0,
                    seq,
                    op: "all_reduce",
                    count: 4,
                    dtype: "float",
                    algo: "ring",
                    started: SystemTime::now(),
                    elapsed: Duration::ZERO,
                    state: State::Running,
                },
            ));
            if rec.records.lock().len() > CAPACITY {
                rec.records.lock().pop_front();
            }
            let res = if seq % 2 == 0 {
                Ok(())
            } else {
                Err(Error::invalid("x"))
            };
            rec.finish(0, seq, &res, Duration::from_micros(3));
        }
        let snap = rec.snapshot();
        assert_eq!(snap.len(), CAPACITY);
        assert_eq!(snap[0].seq, 10);
        assert_eq!(snap[0].state, State::Done);
        assert!(matches!(snap[1].state, State::Failed(_)));
        assert!(rec.dump().contains("#73"));
    }
}
