//! Streams and the progress engine.
//!
//! A communicator has `BRAID_STREAMS` streams. Each stream runs its ops in the order they were issued, on
//! its own channel of every link (so its messages never meet another stream's); streams progress
//! concurrently, a high-priority stream's ready work first. An op can wait for an event recorded on
//! another stream, and a work handle can carry a completion callback.
//!
//! Whoever holds the scheduler lock makes progress for everyone: a blocking call runs its own op on the
//! calling thread (straight through, with no hand-off, when nothing else is in flight), and a progress
//! thread, started on the first asynchronous call, drives the rest. A round polls every stream's current
//! run in priority order, high-priority runs without a step budget and the others with one, so a long
//! low-priority all-reduce cannot hold back a small high-priority one for more than a few chunks.

use std::any::Any;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use braid_core::Error;
use braid_exec::{Progress, Wait};
use braid_transport::AbortHandle;
use crossbeam_queue::SegQueue;
use parking_lot::{Condvar, Mutex};
use tracing::error;

use crate::call::Call;
use crate::dispatch::{Dispatcher, Running};

/// How urgently a stream's work is advanced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    /// Advanced after the others, a few steps at a time (bulk transfers).
    Low,
    /// The default.
    #[default]
    Normal,
    /// Advanced first each round, as far as it goes (latency-bound ops).
    High,
}

impl Priority {
    /// Steps a run of this priority may take per round before the others get a turn.
    fn budget(self) -> u64 {
        match self {
            Priority::High => u64::MAX,
            Priority::Normal => 64,
            Priority::Low => 16,
        }
    }
}

/// A point on a stream: everything issued on it before the event was recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamEvent {
    owner: usize,
    stream: usize,
    count: u64,
}

type Callback = Box<dyn FnOnce(&Result<(), Error>) + Send>;
/// A task that finished, with its result.
type Finished = (Arc<Task>, Result<(), Error>);

/// One op and what becomes of it.
pub(crate) struct Task {
    pub(crate) op: Call,
    result: Mutex<Option<Result<(), Error>>>,
    done: Condvar,
    keep: Mutex<Option<Box<dyn Any + Send>>>,
    callback: Mutex<Option<Callback>>,
    /// When it was issued (the host's monotonic clock), for the timeline's `queued` phase; 0 when
    /// there is no timeline (the clock is then not read).
    pub(crate) issued_ns: u64,
}

impl Task {
    /// A task of `op`, issued at `issued_ns` ([`crate::timeline::now_ns`], or 0 without a timeline;
    /// [`Streams::task`] chooses).
    pub(crate) fn new(op: Call, keep: Option<Box<dyn Any + Send>>, issued_ns: u64) -> Arc<Task> {
        Arc::new(Task {
            op,
            result: Mutex::new(None),
            done: Condvar::new(),
            keep: Mutex::new(keep),
            callback: Mutex::new(None),
            issued_ns,
        })
    }

    /// Completes a task that never ran.
    pub(crate) fn fail_now(&self, e: Error) {
        run_callbacks(self.complete(Err(e)).into_iter().collect());
    }

    fn is_done(&self) -> bool {
        self.result.lock().is_some()
    }

    /// Sets the result and wakes waiters; returns the callback to run (by the caller, with no lock held).
    fn complete(&self, r: Result<(), Error>) -> Option<(Callback, Result<(), Error>)> {
        let mut cb = self.callback.lock();
        *self.result.lock() = Some(r.clone());
        self.done.notify_all();
        cb.take().map(|f| (f, r))
    }

    /// Waits until the task completes or `deadline` passes; `None` on timeout.
    pub(crate) fn wait_result(&self, deadline: Instant) -> Option<Result<(), Error>> {
        self.wait_until(deadline)
    }

    fn wait_until(&self, deadline: Instant) -> Option<Result<(), Error>> {
        let mut res = self.result.lock();
        while res.is_none() {
            if self.done.wait_until(&mut res, deadline).timed_out() && res.is_none() {
                return None;
            }
        }
        res.clone()
    }
}

/// A collective in flight. [`Work::wait`] returns what the op was given (an owned buffer, now holding
/// the result, or `()`). Dropping a `Work` does not cancel the op; it still runs, in order.
#[must_use = "a collective's result is only known after wait()"]
pub struct Work<R> {
    task: Arc<Task>,
    rank: usize,
    limit: Duration,
    /// Aborted when the op overruns (none for work that never ran). Weak: a work handle does not keep
    /// a dropped communicator's links alive.
    streams: Option<Weak<Streams>>,
    _r: PhantomData<fn() -> R>,
}

impl<R: 'static> Work<R> {
    pub(crate) fn new(
        task: Arc<Task>,
        rank: usize,
        limit: Duration,
        streams: Option<Weak<Streams>>,
    ) -> Work<R> {
        Work {
            task,
            rank,
            limit,
            streams,
            _r: PhantomData,
        }
    }

    /// Whether the op has finished (successfully or not).
    pub fn test(&self) -> bool {
        self.task.is_done()
    }

    /// Calls `f` with the op's result once it completes: at once, on this thread, if it already has;
    /// otherwise on the thread that completes it (the progress thread, or a blocking caller). `f` should
    /// return promptly; it may issue collectives and wait for them (on the progress thread the wait
    /// advances the streams itself). A second callback replaces the first.
    pub fn on_complete(&self, f: impl FnOnce(&Result<(), Error>) + Send + 'static) {
        let mut cb = self.task.callback.lock();
        let done = self.task.result.lock().clone();
        match done {
            Some(r) => {
                drop(cb);
                f(&r);
            }
            None => *cb = Some(Box::new(f)),
        }
    }

    /// Waits for the op and returns its buffer. The wait is bounded: an op cannot outlive the
    /// communicator's timeout by much. One that somehow does makes this abort the communicator (so that
    /// it ends promptly, with an error, and lets go of its buffers) and wait once more; only if even that
    /// fails does this return without the op having ended.
    ///
    /// On the communicator's progress thread (a completion callback waiting for another collective) it
    /// advances the streams itself instead of waiting for that thread, which is this one.
    pub fn wait(self) -> Result<R, Error> {
        let streams = self.streams.as_ref().and_then(Weak::upgrade);
        let wait_for = |deadline: Instant| match &streams {
            Some(s) if s.on_progress_thread() => s.drive(&self.task, deadline),
            _ => self.task.wait_until(deadline),
        };
        let mut r = wait_for(Instant::now() + self.limit);
        if r.is_none() {
            let overrun = Error::Poisoned {
                rank: self.rank,
                first: format!(
                    "{} did not complete within {:?}",
                    self.task.op.kind.name(),
                    self.limit
                ),
            };
            if let Some(s) = &streams {
                s.abort(overrun.clone());
                r = wait_for(Instant::now() + self.limit);
            }
            if r.is_none() {
                return Err(overrun);
            }
        }
        let Some(r) = r else {
            return Err(Error::Internal("a finished task has no result".into()));
        };
        r?;
        let keep = self.task.keep.lock().take();
        let Some(keep) = keep else {
            return Err(Error::Internal("a work's buffer was taken twice".into()));
        };
        keep.downcast::<R>()
            .map(|b| *b)
            .map_err(|_| Error::Internal("a work's buffer has the wrong type".into()))
    }
}

/// What a stream's queue holds.
enum Item {
    Call(Arc<Task>),
    /// Wait until `count` ops of `stream` have completed.
    After {
        stream: usize,
        count: u64,
    },
}

struct StreamState {
    queue: VecDeque<Item>,
    active: Option<(Arc<Task>, Running, Option<Wait>)>,
    completed: u64,
    priority: Priority,
}

/// Everything the lock holder needs.
pub(crate) struct Sched {
    pub(crate) exec: Dispatcher,
    streams: Vec<StreamState>,
    /// Stream indices, highest priority first.
    order: Vec<usize>,
}

impl Sched {
    fn idle(&self) -> bool {
        self.streams
            .iter()
            .all(|s| s.active.is_none() && s.queue.is_empty())
    }
}

/// The streams of one communicator and their progress engine.
pub(crate) struct Streams {
    rank: usize,
    /// Whether the communicator writes a timeline (tasks are then stamped when issued).
    timeline: bool,
    /// Number of streams.
    count: usize,
    /// Set once `sticky` holds an error (read without the lock on the hot path).
    poisoned: AtomicBool,
    /// The executor's abort flag: set, every run fails at its next poll.
    abort_flag: Arc<AtomicBool>,
    id: usize,
    pub(crate) sched: Mutex<Sched>,
    /// Items issued and not yet picked up by a lock holder, with their stream (lock-free).
    incoming: SegQueue<(usize, Item)>,
    /// Ops issued on each stream so far.
    issued: Vec<AtomicU64>,
    /// Where the progress thread sleeps when there is nothing to do, and the signal that wakes it.
    sleep: Mutex<()>,
    queued: Condvar,
    sticky: Mutex<Option<Error>>,
    maps: Arc<dyn AbortHandle>,
    /// More of this rank's flags to mark failed with the links (the shared-memory board).
    more_maps: Mutex<Vec<Arc<dyn AbortHandle>>>,
    shutdown: AtomicBool,
    progress: Mutex<Option<JoinHandle<()>>>,
    limit: Duration,
    /// The thread inside a call that issues work ([`thread_token`]; 0 when none): a communicator is
    /// used by one thread at a time.
    caller: AtomicU64,
}

/// A number for the calling thread, unique in the process (never 0).
fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static TOKEN: u64 = NEXT.fetch_add(1, Ordering::Relaxed));
    TOKEN.with(|t| *t)
}

/// A thread's turn at issuing work; nested calls of the same thread (a compressed all-reduce's
/// collectives) hold none of their own.
pub(crate) struct Turn<'a>(Option<&'a AtomicU64>);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.0 {
            c.store(0, Ordering::Release);
        }
    }
}

/// The longest a lock holder sleeps on one run before looking at the others again.
const NAP: Duration = Duration::from_micros(500);

impl Streams {
    /// A task of `op` to submit here, stamped with its issue time only when there is a timeline to
    /// show its `queued` phase (an asynchronous call reads no clock otherwise).
    pub(crate) fn task(&self, op: Call, keep: Option<Box<dyn Any + Send>>) -> Arc<Task> {
        let issued_ns = if self.timeline {
            crate::timeline::now_ns()
        } else {
            0
        };
        Task::new(op, keep, issued_ns)
    }

    pub(crate) fn new(
        rank: usize,
        exec: Dispatcher,
        streams: usize,
        maps: Arc<dyn AbortHandle>,
        abort_flag: Arc<AtomicBool>,
        limit: Duration,
    ) -> Streams {
        let streams = streams.max(1);
        Streams {
            rank,
            timeline: exec.timeline.is_some(),
            count: streams,
            poisoned: AtomicBool::new(false),
            abort_flag,
            id: next_id(),
            sched: Mutex::new(Sched {
                exec,
                streams: (0..streams)
                    .map(|_| StreamState {
                        queue: VecDeque::new(),
                        active: None,
                        completed: 0,
                        priority: Priority::Normal,
                    })
                    .collect(),
                order: (0..streams).collect(),
            }),
            incoming: SegQueue::new(),
            issued: (0..streams).map(|_| AtomicU64::new(0)).collect(),
            sleep: Mutex::new(()),
            queued: Condvar::new(),
            sticky: Mutex::new(None),
            maps,
            more_maps: Mutex::new(Vec::new()),
            shutdown: AtomicBool::new(false),
            progress: Mutex::new(None),
            limit,
            caller: AtomicU64::new(0),
        }
    }

    /// Number of streams.
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// The first error, if the communicator is poisoned.
    pub(crate) fn sticky(&self) -> Option<Error> {
        self.sticky.lock().clone()
    }

    fn poisoned(&self) -> Option<Error> {
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        self.sticky.lock().as_ref().map(|first| Error::Poisoned {
            rank: self.rank,
            first: first.to_string(),
        })
    }

    /// Records `e` as the communicator's first error (unless it is an argument error) and tells the
    /// peers; also for errors found outside the executor (the compressed paths' checks).
    pub(crate) fn poison(&self, e: &Error) {
        if !e.is_invalid_argument() {
            error!("{e}");
            self.sticky.lock().get_or_insert(e.clone());
            self.poisoned.store(true, Ordering::Release);
            self.fail_and_wake();
        }
    }

    /// An argument error that only this rank could see (a buffer only the root passes): its peers are
    /// already in the collective, so the communicator is poisoned on every rank (they fail at once,
    /// naming this rank) rather than left to pair this rank's next collective with their stale one.
    /// The caller still gets `e`, the invalid argument.
    pub(crate) fn poison_one_sided(&self, e: &Error) {
        let first = Error::Poisoned {
            rank: self.rank,
            first: format!(
                "{e} (an argument error on this rank only; its peers' collective cannot complete)"
            ),
        };
        error!("{first}");
        self.sticky.lock().get_or_insert(first);
        self.poisoned.store(true, Ordering::Release);
        self.fail_and_wake();
    }

    /// Takes this thread's turn at issuing work. A second thread arriving while another is inside a
    /// call is refused, and since its peers may already run the op it would have issued (in another
    /// order than this rank's), the communicator is poisoned on every rank: two threads calling at
    /// once would otherwise pair ops wrongly and mix data without a word.
    pub(crate) fn turn(&self) -> Result<Turn<'_>, Error> {
        let me = thread_token();
        match self
            .caller
            .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
        {
            Ok(_) => Ok(Turn(Some(&self.caller))),
            Err(owner) if owner == me => Ok(Turn(None)),
            Err(_) => {
                let e = Error::invalid(format!(
                    "rank {}: two threads called the communicator at once; a communicator is used by \
                     one thread at a time (serialise the calls, in the same order on every rank)",
                    self.rank
                ));
                self.poison_one_sided(&e);
                Err(e)
            }
        }
    }

    fn check_stream(&self, stream: usize) -> Result<(), Error> {
        let n = self.count();
        if stream >= n {
            return Err(Error::invalid(format!(
                "stream {stream} does not exist (the communicator has {n}; set BRAID_STREAMS for more)"
            )));
        }
        Ok(())
    }

    /// Poisons the communicator with `e` (unless it already is) and wakes everyone.
    /// Marks this rank failed on every link and board, and wakes their waits.
    fn fail_and_wake(&self) {
        self.maps.fail_and_wake();
        for m in self.more_maps.lock().iter() {
            m.fail_and_wake();
        }
    }

    /// Adds a flag that failing this rank marks too (a shared-memory board); marked at once if the
    /// communicator is already unusable.
    pub(crate) fn also_fail(&self, m: Arc<dyn AbortHandle>) {
        if self.poisoned.load(Ordering::Acquire) {
            m.fail_and_wake();
        }
        self.more_maps.lock().push(m);
    }

    pub(crate) fn abort(&self, e: Error) {
        self.abort_flag.store(true, Ordering::SeqCst);
        self.sticky.lock().get_or_insert(e);
        self.poisoned.store(true, Ordering::Release);
        self.fail_and_wake();
        let _guard = self.sleep.lock();
        self.queued.notify_all();
    }

    /// Sets a stream's priority.
    pub(crate) fn set_priority(&self, stream: usize, p: Priority) -> Result<(), Error> {
        self.check_stream(stream)?;
        let mut s = self.sched.lock();
        s.streams[stream].priority = p;
        let mut order: Vec<usize> = (0..s.streams.len()).collect();
        order.sort_by_key(|i| std::cmp::Reverse(s.streams[*i].priority));
        s.order = order;
        Ok(())
    }

    /// A stream's priority.
    pub(crate) fn priority(&self, stream: usize) -> Result<Priority, Error> {
        self.check_stream(stream)?;
        Ok(self.sched.lock().streams[stream].priority)
    }

    /// An event at the current end of `stream`.
    pub(crate) fn record(&self, stream: usize) -> Result<StreamEvent, Error> {
        self.check_stream(stream)?;
        Ok(StreamEvent {
            owner: self.id,
            stream,
            count: self.issued[stream].load(Ordering::Acquire),
        })
    }

    /// Makes everything issued on `stream` from now on wait for `event`.
    pub(crate) fn wait_event(&self, stream: usize, event: &StreamEvent) -> Result<(), Error> {
        self.check_stream(stream)?;
        if event.owner != self.id {
            return Err(Error::invalid(
                "the event was recorded on another communicator's stream",
            ));
        }
        self.push(
            stream,
            Item::After {
                stream: event.stream,
                count: event.count,
            },
        );
        self.wake();
        Ok(())
    }

    /// Runs `op` on `stream` and waits for it, on this thread.
    pub(crate) fn run_blocking(&self, op: Call, stream: usize) -> Result<(), Error> {
        op.check()?;
        let _turn = self.turn()?;
        self.check_stream(stream)?;
        if let Some(e) = self.poisoned() {
            return Err(e);
        }
        let mut sched = self.sched.lock();
        {
            if self.incoming.is_empty() && sched.idle() {
                // Nothing else in flight: straight through, no queue, no hand-off.
                self.count_issued(stream);
                let seq = sched.exec.next_seq(stream);
                let r = catch_unwind(AssertUnwindSafe(|| sched.exec.run(&op, stream)))
                    .unwrap_or_else(|p| Err(panicked(self.rank, &op, seq, p)));
                sched.streams[stream].completed += 1;
                drop(sched);
                if let Err(e) = &r {
                    self.poison(e);
                }
                return r;
            }
        }
        let task = self.task(op, None);
        self.push(stream, Item::Call(task.clone()));
        let deadline = Instant::now() + self.limit;
        let mut callbacks = Vec::new();
        let mut aborted = false;
        loop {
            let (progressed, done) = self.round(&mut sched);
            callbacks.extend(finish_all(done));
            if task.is_done() {
                break;
            }
            if !aborted && Instant::now() >= deadline {
                // The op works on the caller's borrowed buffers: this call cannot return before it
                // ends. Aborting makes it (and everything queued) end promptly with an error.
                aborted = true;
                self.abort(Error::Poisoned {
                    rank: self.rank,
                    first: format!(
                        "{} did not complete within {:?}",
                        task.op.kind.name(),
                        self.limit
                    ),
                });
            }
            if !progressed {
                callbacks.extend(finish_all(self.nap(&mut sched).into_iter().collect()));
            }
        }
        let others = !sched.idle();
        drop(sched);
        run_callbacks(callbacks);
        if others {
            // Work of other streams was picked up here; the progress thread carries it on.
            self.wake();
        }
        task.wait_until(Instant::now())
            .unwrap_or_else(|| Err(Error::Internal("a finished task has no result".into())))
    }

    /// Whether the calling thread is this communicator's progress thread.
    fn on_progress_thread(&self) -> bool {
        self.progress
            .lock()
            .as_ref()
            .is_some_and(|h| h.thread().id() == std::thread::current().id())
    }

    /// Advances every stream on this thread until `task` completes (its result) or `deadline` passes
    /// (`None`): how the progress thread waits for work from inside a completion callback.
    fn drive(&self, task: &Task, deadline: Instant) -> Option<Result<(), Error>> {
        loop {
            let mut sched = self.sched.lock();
            let (progressed, done) = self.round(&mut sched);
            let mut callbacks = finish_all(done);
            if !progressed && !task.is_done() {
                callbacks.extend(finish_all(self.nap(&mut sched).into_iter().collect()));
            }
            drop(sched);
            run_callbacks(callbacks);
            if task.is_done() {
                return task.wait_until(Instant::now());
            }
            if Instant::now() >= deadline {
                return None;
            }
        }
    }

    /// Queues `task` on `stream` for the progress thread.
    pub(crate) fn submit(self: &Arc<Self>, task: Arc<Task>, stream: usize) -> Result<(), Error> {
        task.op.check()?;
        let _turn = self.turn()?;
        self.check_stream(stream)?;
        self.push(stream, Item::Call(task));
        self.ensure_progress_thread()?;
        self.wake();
        Ok(())
    }

    /// Counts one more op issued on `stream`. Only the thread holding the turn ([`Streams::turn`])
    /// issues, so a load and a store do (no read-modify-write on the 8-byte path).
    fn count_issued(&self, stream: usize) {
        let n = &self.issued[stream];
        n.store(n.load(Ordering::Relaxed) + 1, Ordering::Release);
    }

    fn push(&self, stream: usize, item: Item) {
        if matches!(item, Item::Call(_)) {
            self.count_issued(stream);
        }
        self.incoming.push((stream, item));
    }

    /// Wakes the progress thread. Taking its lock first means a thread that has just found the queue
    /// empty is either already asleep (and woken) or will see the new item.
    fn wake(&self) {
        let _guard = self.sleep.lock();
        self.queued.notify_one();
    }

    /// One pass over every stream. Returns whether anything moved, and the tasks that finished (to be
    /// completed once the lock is released, so that callbacks run without it).
    fn round(&self, s: &mut Sched) -> (bool, Vec<Finished>) {
        let mut progressed = false;
        let mut done = Vec::new();
        while let Some((stream, item)) = self.incoming.pop() {
            s.streams[stream].queue.push_back(item);
            progressed = true;
        }
        let now = Instant::now();
        for k in 0..s.order.len() {
            let si = s.order[k];
            loop {
                if s.streams[si].active.is_none() {
                    match s.streams[si].queue.front() {
                        None => break,
                        Some(Item::After { stream, count }) => {
                            if s.streams.get(*stream).is_none_or(|o| o.completed >= *count) {
                                s.streams[si].queue.pop_front();
                                progressed = true;
                                continue;
                            }
                            break;
                        }
                        Some(Item::Call(_)) => {}
                    }
                    let Some(Item::Call(task)) = s.streams[si].queue.pop_front() else {
                        break;
                    };
                    progressed = true;
                    if let Some(e) = self.poisoned() {
                        s.streams[si].completed += 1;
                        done.push((task, Err(e)));
                        continue;
                    }
                    match s.exec.start(&task.op, si, task.issued_ns) {
                        Ok(r) => s.streams[si].active = Some((task, r, None)),
                        Err(e) => {
                            self.poison(&e);
                            s.streams[si].completed += 1;
                            done.push((task, Err(e)));
                            continue;
                        }
                    }
                }
                let budget = s.streams[si].priority.budget();
                let Sched { exec, streams, .. } = &mut *s;
                let st = &mut streams[si];
                let Some((task, run, blocked)) = st.active.as_mut() else {
                    break;
                };
                let seq = run.seq();
                let r = catch_unwind(AssertUnwindSafe(|| exec.poll(run, now, budget)))
                    .unwrap_or_else(|p| Err(panicked(self.rank, &task.op, seq, p)));
                match r {
                    Ok(Progress::Done) => {}
                    Ok(Progress::Yielded) => {
                        *blocked = None;
                        progressed = true;
                        break;
                    }
                    Ok(Progress::Blocked(w)) => {
                        progressed |= *blocked != Some(w);
                        *blocked = Some(w);
                        break;
                    }
                    Err(e) => {
                        self.poison(&e);
                        let Some((task, _, _)) = st.active.take() else {
                            break;
                        };
                        st.completed += 1;
                        done.push((task, Err(e)));
                        progressed = true;
                        continue;
                    }
                }
                let Some((task, _, _)) = st.active.take() else {
                    break;
                };
                st.completed += 1;
                done.push((task, Ok(())));
                progressed = true;
            }
        }
        (progressed, done)
    }

    /// Sleeps briefly on what the most urgent blocked run waits for. A wait that fails (the peer died,
    /// the deadline passed) ends that run with the error; its task is returned to be completed.
    fn nap(&self, s: &mut Sched) -> Option<Finished> {
        let until = Instant::now() + NAP;
        let Sched {
            exec,
            streams,
            order,
        } = s;
        for &si in order.iter() {
            let st = &mut streams[si];
            let Some((_, run, Some(w))) = st.active.as_mut() else {
                continue;
            };
            let w = *w;
            if let Err(e) = exec.wait(run, w, until) {
                self.poison(&e);
                let (task, _, _) = st.active.take()?;
                st.completed += 1;
                return Some((task, Err(e)));
            }
            return None;
        }
        // Only events between streams are pending: they resolve as other runs complete.
        std::thread::sleep(Duration::from_micros(50));
        None
    }

    fn ensure_progress_thread(self: &Arc<Self>) -> Result<(), Error> {
        let mut slot = self.progress.lock();
        if slot.is_some() {
            return Ok(());
        }
        let me = self.clone();
        let handle = std::thread::Builder::new()
            .name(format!("braid-progress-{}", self.rank))
            .spawn(move || me.progress_loop())
            .map_err(|e| Error::io("starting the progress thread", e))?;
        *slot = Some(handle);
        Ok(())
    }

    fn progress_loop(&self) {
        loop {
            {
                let mut guard = self.sleep.lock();
                // Whoever holds the scheduler is busy with it: not a reason to sleep.
                let idle = self.sched.try_lock().is_some_and(|s| s.idle());
                if self.incoming.is_empty() && idle {
                    if self.shutdown.load(Ordering::Acquire) {
                        return;
                    }
                    self.queued.wait_for(&mut guard, Duration::from_millis(100));
                    continue;
                }
            }
            let mut sched = self.sched.lock();
            let (progressed, mut done) = self.round(&mut sched);
            if !progressed && !sched.idle() {
                done.extend(self.nap(&mut sched));
            }
            drop(sched);
            run_callbacks(finish_all(done));
        }
    }

    /// Stops the progress thread once every queued op has run (each is bounded by the timeout).
    pub(crate) fn shut_down(&self) {
        self.shutdown.store(true, Ordering::Release);
        {
            let _guard = self.sleep.lock();
            self.queued.notify_all();
        }
        if let Some(h) = self.progress.lock().take() {
            // The last handle may go in a completion callback, on the progress thread itself: it ends
            // on its own once it sees the shutdown, and joining it from itself could panic.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

/// Completes tasks; returns their callbacks.
#[must_use]
fn finish_all(done: Vec<Finished>) -> Vec<(Callback, Result<(), Error>)> {
    done.into_iter()
        .filter_map(|(task, r)| task.complete(r))
        .collect()
}

/// Runs completion callbacks; a panicking one must not take the progress thread down with it.
fn run_callbacks(cbs: Vec<(Callback, Result<(), Error>)>) {
    for (f, r) in cbs {
        let _ = catch_unwind(AssertUnwindSafe(|| f(&r)));
    }
}

/// A panic inside the executor as an error that poisons the communicator.
fn panicked(rank: usize, op: &Call, seq: u64, p: Box<dyn Any + Send>) -> Error {
    let msg = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned());
    Error::Poisoned {
        rank,
        first: format!(
            "internal error in {} #{seq}: {}",
            op.kind.name(),
            msg.unwrap_or_default()
        ),
    }
}

/// A process-unique number for each communicator (events name theirs).
fn next_id() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
