//! The flight recorder: the last collectives of a communicator, so that a hang or a failure says what
//! was running, for how long, and what came before.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use braid_core::{DType, Error};
use braid_transport::Stamp;
use parking_lot::Mutex;

use crate::call::Call;
use crate::tune::{Algo, Collective};

/// The algorithm byte of a run straight through shared buffers (no algorithm of the table).
const SHARED_PATH: u8 = 0xff;

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

/// One record as the writer left it: every field an atomic, behind a sequence lock, so that the
/// writer (the op's thread) never takes a lock and a reader never sees a record half written. One cache
/// line each.
#[derive(Default)]
#[repr(align(64))]
struct Entry {
    /// Odd while the writer is changing the entry.
    version: AtomicU64,
    /// Which record (counting from 0) the entry holds.
    ordinal: AtomicU64,
    stream: AtomicU64,
    seq: AtomicU64,
    count: AtomicU64,
    /// Collective index, dtype, algorithm and state, a byte each.
    what: AtomicU64,
    /// Start, a coarse [`Stamp`] in nanoseconds.
    started: AtomicU64,
    /// Nanoseconds it ran (when finished).
    elapsed: AtomicU64,
}

const RUNNING: u8 = 0;
const DONE: u8 = 1;
const FAILED: u8 = 2;

/// A record read back, before its names are looked up.
#[derive(Clone, Copy)]
struct Raw {
    ordinal: u64,
    stream: u64,
    seq: u64,
    count: u64,
    what: u64,
    started: u64,
    elapsed: u64,
}

struct Shared {
    entries: Box<[Entry]>,
    /// Records started so far (the next record's ordinal).
    head: AtomicU64,
    /// The messages of failed records, by (stream, seq) (rare: behind a lock).
    failures: Mutex<VecDeque<(u64, u64, String)>>,
}

/// The shared ring buffer of [`FlightRecord`]s, readable from any thread while a collective runs. One
/// writer at a time (the thread that holds the communicator's executor) stores monotonic times it
/// already has, with no lock and no atomic read-modify-write; wall-clock times and names are derived
/// only when someone asks.
#[derive(Clone)]
pub struct Recorder {
    shared: Arc<Shared>,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder {
            shared: Arc::new(Shared {
                entries: (0..CAPACITY).map(|_| Entry::default()).collect(),
                head: AtomicU64::new(0),
                failures: Mutex::new(VecDeque::new()),
            }),
        }
    }
}

impl Recorder {
    /// Writes `raw` into its entry. Only the single writer calls this.
    fn write(&self, raw: Raw) {
        let e = &self.shared.entries[(raw.ordinal % CAPACITY as u64) as usize];
        Self::update(e, || {
            e.ordinal.store(raw.ordinal, Ordering::Relaxed);
            e.stream.store(raw.stream, Ordering::Relaxed);
            e.seq.store(raw.seq, Ordering::Relaxed);
            e.count.store(raw.count, Ordering::Relaxed);
            e.what.store(raw.what, Ordering::Relaxed);
            e.started.store(raw.started, Ordering::Relaxed);
            e.elapsed.store(raw.elapsed, Ordering::Relaxed);
        });
    }

    /// Changes fields of `e` (in `store`) under its sequence lock: a reader sees all of them or none.
    /// Only the single writer calls this.
    fn update(e: &Entry, store: impl FnOnce()) {
        let v = e.version.load(Ordering::Relaxed);
        e.version.store(v.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        store();
        e.version.store(v.wrapping_add(2), Ordering::Release);
    }

    /// Reads entry `i` consistently; `None` while (or if ever) the writer is in it.
    fn read(&self, i: usize) -> Option<Raw> {
        let e = &self.shared.entries[i];
        for _ in 0..1000 {
            let v1 = e.version.load(Ordering::Acquire);
            if v1 % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let raw = Raw {
                ordinal: e.ordinal.load(Ordering::Relaxed),
                stream: e.stream.load(Ordering::Relaxed),
                seq: e.seq.load(Ordering::Relaxed),
                count: e.count.load(Ordering::Relaxed),
                what: e.what.load(Ordering::Relaxed),
                started: e.started.load(Ordering::Relaxed),
                elapsed: e.elapsed.load(Ordering::Relaxed),
            };
            fence(Ordering::Acquire);
            if e.version.load(Ordering::Relaxed) == v1 {
                return Some(raw);
            }
        }
        None
    }

    /// Records that `op` started with `algo` (`None`: straight through shared buffers).
    pub(crate) fn start(
        &self,
        stream: usize,
        seq: u64,
        op: &Call,
        algo: Option<Algo>,
        started: Stamp,
    ) {
        let ordinal = self.shared.head.load(Ordering::Relaxed);
        let what = op.kind.collective().index() as u64
            | (op.dtype as u64) << 8
            | (algo.map_or(SHARED_PATH, |a| a as u8) as u64) << 16
            | (RUNNING as u64) << 24;
        self.write(Raw {
            ordinal,
            stream: stream as u64,
            seq,
            count: op.count as u64,
            what,
            started: started.as_nanos(),
            elapsed: 0,
        });
        self.shared.head.store(ordinal + 1, Ordering::Release);
    }

    pub(crate) fn finish(
        &self,
        stream: usize,
        seq: u64,
        result: &Result<(), Error>,
        elapsed_ns: u64,
    ) {
        let head = self.shared.head.load(Ordering::Relaxed);
        let first = head.saturating_sub(CAPACITY as u64);
        for ordinal in (first..head).rev() {
            let e = &self.shared.entries[(ordinal % CAPACITY as u64) as usize];
            // The writer reads its own stores: no lock needed.
            if e.stream.load(Ordering::Relaxed) != stream as u64
                || e.seq.load(Ordering::Relaxed) != seq
            {
                continue;
            }
            let state = match result {
                Ok(()) => DONE,
                Err(err) => {
                    let mut f = self.shared.failures.lock();
                    if f.len() == CAPACITY {
                        f.pop_front();
                    }
                    f.push_back((stream as u64, seq, err.to_string()));
                    FAILED
                }
            };
            // Only the state and the time change: the rest of the record stays as written.
            let what = e.what.load(Ordering::Relaxed) & 0xff_ffff | (state as u64) << 24;
            Self::update(e, || {
                e.what.store(what, Ordering::Relaxed);
                e.elapsed.store(elapsed_ns, Ordering::Relaxed);
            });
            return;
        }
    }

    /// A copy of the records, oldest first; running ones show their time so far.
    pub fn snapshot(&self) -> Vec<FlightRecord> {
        let head = self.shared.head.load(Ordering::Acquire);
        let first = head.saturating_sub(CAPACITY as u64);
        let (now_wall, now) = (SystemTime::now(), Stamp::now().as_nanos());
        let failures = self.shared.failures.lock().clone();
        (first..head)
            .filter_map(|ordinal| self.read((ordinal % CAPACITY as u64) as usize))
            // An entry already reused by a newer record is left out here and shown in its turn.
            .filter(|raw| raw.ordinal >= first && raw.ordinal < head)
            .map(|raw| {
                let ran = Duration::from_nanos(now.saturating_sub(raw.started));
                let byte = |k: u32| (raw.what >> (8 * k)) as u8;
                let state = match byte(3) {
                    RUNNING => State::Running,
                    DONE => State::Done,
                    _ => State::Failed(
                        failures
                            .iter()
                            .rev()
                            .find(|(s, q, _)| *s == raw.stream && *q == raw.seq)
                            .map(|(_, _, m)| m.clone())
                            .unwrap_or_default(),
                    ),
                };
                FlightRecord {
                    stream: raw.stream as usize,
                    seq: raw.seq,
                    op: Collective::ALL
                        .get(byte(0) as usize)
                        .map_or("?", |c| c.name()),
                    count: raw.count as usize,
                    dtype: DType::ALL
                        .iter()
                        .find(|d| **d as u8 == byte(1))
                        .map_or("?", |d| d.name()),
                    algo: match byte(2) {
                        SHARED_PATH => "shared",
                        code => Algo::ALL
                            .iter()
                            .find(|a| **a as u8 == code)
                            .map_or("?", |a| a.name()),
                    },
                    started: now_wall.checked_sub(ran).unwrap_or(now_wall),
                    elapsed: if state == State::Running {
                        ran
                    } else {
                        Duration::from_nanos(raw.elapsed)
                    },
                    state,
                }
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
        let op = Call::barrier();
        for seq in 0..(CAPACITY as u64 + 10) {
            rec.start(0, seq, &op, Some(Algo::Ring), Stamp::now());
            let res = if seq % 2 == 0 {
                Ok(())
            } else {
                Err(Error::invalid(format!("x{seq}")))
            };
            if seq != CAPACITY as u64 + 9 {
                rec.finish(0, seq, &res, 3000);
            }
        }
        let snap = rec.snapshot();
        assert_eq!(snap.len(), CAPACITY);
        assert_eq!(snap[0].seq, 10);
        assert_eq!(snap[0].state, State::Done);
        assert_eq!(snap[0].op, "barrier");
        assert_eq!(snap[0].algo, "ring");
        assert_eq!(snap[0].dtype, DType::U8.name());
        assert_eq!(snap[0].elapsed, Duration::from_micros(3));
        assert!(matches!(&snap[1].state, State::Failed(m) if m.contains("x11")));
        assert_eq!(snap[CAPACITY - 1].state, State::Running);
        assert!(rec.dump().contains("#73"));
    }

    #[test]
    fn a_reader_never_sees_a_record_half_written() {
        use std::sync::atomic::AtomicUsize;
        let rec = Recorder::default();
        let reader = rec.clone();
        let seen = Arc::new(AtomicUsize::new(0));
        let seen2 = seen.clone();
        let t = std::thread::spawn(move || {
            while seen2.load(Ordering::Relaxed) < 50_000 {
                for r in reader.snapshot() {
                    // The writer keeps count == seq: a torn read would break it.
                    assert_eq!(r.count as u64, r.seq);
                    seen2.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        let until = std::time::Instant::now() + Duration::from_secs(20);
        let mut seq = 0u64;
        while seen.load(Ordering::Relaxed) < 50_000 && std::time::Instant::now() < until {
            // SAFETY: no memory at all (null with zero lengths).
            let op = unsafe {
                Call::new(
                    crate::call::Kind::AllReduce,
                    DType::F32,
                    braid_core::ReduceOp::Sum,
                    seq as usize,
                    std::ptr::null(),
                    0,
                    std::ptr::null_mut(),
                    0,
                )
            };
            rec.start(1, seq, &op, Some(Algo::Direct), Stamp::now());
            rec.finish(1, seq, &Ok(()), seq);
            seq += 1;
        }
        t.join().unwrap();
        assert!(seen.load(Ordering::Relaxed) >= 50_000);
    }
}
