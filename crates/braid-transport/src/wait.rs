//! Waiting on a word in shared memory: spin, then yield, then futex, with a deadline and liveness checks.

use std::sync::atomic::{fence, AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use braid_core::Error;

/// How long a wait spins and yields before it sleeps.
#[derive(Clone, Copy, Debug)]
pub struct WaitPolicy {
    /// Busy-spin this long first (0 when ranks outnumber cores).
    pub spin: Duration,
    /// Then call `sched_yield` for this long, which hands the core to a peer that shares it.
    pub yield_for: Duration,
}

impl WaitPolicy {
    /// The policy for `local_ranks` processes on this host, with an optional spin override.
    pub fn for_host(local_ranks: usize, spin_us: Option<u64>) -> WaitPolicy {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let spin = spin_us.unwrap_or(if local_ranks <= cores { 20 } else { 0 });
        WaitPolicy {
            spin: Duration::from_micros(spin),
            yield_for: Duration::from_micros(200),
        }
    }
}

/// Who is waiting for what, so that a failed wait produces an error that names everything.
#[derive(Clone, Copy)]
pub struct WaitCtx<'a> {
    /// This rank.
    pub rank: usize,
    /// The collective being run.
    pub collective: &'a str,
    /// Its sequence number.
    pub seq: u64,
    /// When the wait gives up.
    pub deadline: Instant,
    /// When the collective started (for the message).
    pub started: Instant,
    /// Set by `abort` from any thread.
    pub abort: &'a AtomicBool,
}

impl WaitCtx<'_> {
    pub(crate) fn timeout(&self, peer: usize, what: &str) -> Error {
        Error::Timeout {
            rank: self.rank,
            peer,
            collective: self.collective.to_string(),
            seq: self.seq,
            waited_ms: self.started.elapsed().as_millis() as u64,
            what: what.to_string(),
        }
    }

    pub(crate) fn peer_failed(&self, peer: usize, reason: impl Into<String>) -> Error {
        Error::PeerFailed {
            rank: self.rank,
            peer,
            collective: self.collective.to_string(),
            seq: self.seq,
            reason: reason.into(),
        }
    }

    pub(crate) fn aborted(&self) -> Error {
        Error::Aborted {
            rank: self.rank,
            during: format!(" during {} #{}", self.collective, self.seq),
        }
    }
}

/// A reading of the kernel's coarse monotonic clock (`CLOCK_MONOTONIC_COARSE`, in nanoseconds): the
/// time to within one tick (1 to 10 ms, the kernel's `HZ`) at a fraction of the cost of
/// [`Instant::now`]. An op's start and deadline are taken from it on the 8-byte path, where a
/// collective's timeout is seconds and reading the precise clock twice per call is measurable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp(u64);

impl Stamp {
    /// Now.
    #[inline]
    pub fn now() -> Stamp {
        // Through the C library, which finds the vDSO itself and falls back to the system call
        // where there is none (rustix's own vDSO lookup faults under valgrind).
        // SAFETY: a timespec is plain integers (and padding on some targets): all zeroes is a value.
        let mut t: libc::timespec = unsafe { std::mem::zeroed() };
        // SAFETY: `t` is a valid, writable timespec; CLOCK_MONOTONIC_COARSE exists on every Linux
        // braid runs on (2.6.32+), so the call cannot fail and leaves `t` set.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut t) };
        Stamp(t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64)
    }

    /// The reading, in nanoseconds.
    #[inline]
    pub fn as_nanos(self) -> u64 {
        self.0
    }

    /// Nanoseconds from `earlier` to this stamp (0 if `earlier` is later).
    #[inline]
    pub fn nanos_since(self, earlier: Stamp) -> u64 {
        self.0.saturating_sub(earlier.0)
    }

    /// The stamp on [`Instant`]'s scale: the coarse clock is `Instant`'s timeline read at the last
    /// tick, placed by one precise reading taken on the first call. The result differs from what
    /// `Instant::now()` said at the stamp by less than one tick either way.
    pub fn instant(self) -> Instant {
        static BASE: std::sync::OnceLock<(Instant, Stamp)> = std::sync::OnceLock::new();
        let (base, at) = *BASE.get_or_init(|| (Instant::now(), Stamp::now()));
        if self >= at {
            base + Duration::from_nanos(self.nanos_since(at))
        } else {
            base.checked_sub(Duration::from_nanos(at.nanos_since(self)))
                .unwrap_or(base)
        }
    }
}

/// Whether process `pid` on this host still runs (a zombie counts as dead).
pub fn peer_alive(pid: u32) -> bool {
    !matches!(process_state(pid), None | Some('Z') | Some('X') | Some('x'))
}

/// Whether process `pid` is stopped (SIGSTOP, or traced and halted).
pub fn peer_stopped(pid: u32) -> bool {
    matches!(process_state(pid), Some('T') | Some('t'))
}

/// The state letter of `/proc/<pid>/stat` (`R`, `S`, `T`, `Z`, ...), or `None` if there is no such
/// process. A process whose state cannot be parsed counts as running.
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].trim_start().chars().next());
    Some(state.unwrap_or('R'))
}

/// Spins before a wait first reads the clock (a few microseconds).
const FIRST_SPINS: u32 = 64;

/// Slice of a blocking wait between checks of deadline, abort and liveness.
const SLICE: Duration = Duration::from_millis(5);

/// Waits until `ready()` holds or `until` passes (whichever is first; `Ok` either way). `word` is the
/// futex word the other side bumps (and wakes when `flag` is set); `check` is asked, between sleeps,
/// whether the peer has failed. Passing `ctx.deadline` is a timeout.
#[allow(clippy::too_many_arguments)]
pub(crate) fn wait_until(
    policy: &WaitPolicy,
    ctx: &WaitCtx<'_>,
    until: Instant,
    peer: usize,
    what: &str,
    word: &AtomicU32,
    flag: &AtomicU32,
    mut ready: impl FnMut() -> bool,
    mut check: impl FnMut() -> Result<(), Error>,
) -> Result<(), Error> {
    if ready() {
        return Ok(());
    }
    if !policy.spin.is_zero() {
        // Most waits for a small message end within a few spins: no clock is read before then.
        for _ in 0..FIRST_SPINS {
            std::hint::spin_loop();
            if ready() {
                return Ok(());
            }
        }
    }
    let start = Instant::now();
    if !policy.spin.is_zero() {
        let mut i = 0u32;
        loop {
            std::hint::spin_loop();
            if ready() {
                return Ok(());
            }
            i += 1;
            if i % 64 == 0 && start.elapsed() >= policy.spin {
                break;
            }
        }
    }
    // With no spin (more ranks than cores), the peer waited for needs this core: hand it over at once.
    let yield_end = policy.spin + policy.yield_for;
    while start.elapsed() < yield_end {
        std::thread::yield_now();
        if ready() {
            return Ok(());
        }
    }
    loop {
        if ctx.abort.load(Ordering::Relaxed) {
            return Err(ctx.aborted());
        }
        // A peer that posted its last message and then went away has still delivered it.
        if let Err(e) = check() {
            return if ready() { Ok(()) } else { Err(e) };
        }
        let now = Instant::now();
        if now >= ctx.deadline {
            return Err(ctx.timeout(peer, what));
        }
        if now >= until {
            return Ok(());
        }
        if sleep_unless(
            word,
            flag,
            &mut ready,
            SLICE.min(ctx.deadline.min(until) - now),
        ) {
            return Ok(());
        }
    }
}

/// A 32-bit word that two sides of a protocol share, with the futex operations on it: the one
/// primitive the ring protocol ([`crate::shm::protocol`]) and [`sleep_unless`] are written over. The
/// transport's words are [`AtomicU32`]s in shared memory; a model checker implements it over its own
/// atomics, so that it checks this very code.
pub trait Word {
    /// Reads the word.
    fn load(&self, order: Ordering) -> u32;
    /// Writes the word.
    fn store(&self, value: u32, order: Ordering);
    /// A sequentially consistent fence in the memory model of this word's atomics.
    fn fence_seq_cst(&self);
    /// Sleeps while the word reads `seen`, at most `timeout`. Spurious returns are fine: callers
    /// re-check.
    fn sleep(&self, seen: u32, timeout: Duration);
    /// Wakes every sleeper.
    fn wake(&self);
}

impl Word for AtomicU32 {
    #[inline]
    fn load(&self, order: Ordering) -> u32 {
        AtomicU32::load(self, order)
    }
    #[inline]
    fn store(&self, value: u32, order: Ordering) {
        AtomicU32::store(self, value, order)
    }
    #[inline]
    fn fence_seq_cst(&self) {
        fence(Ordering::SeqCst)
    }
    fn sleep(&self, seen: u32, timeout: Duration) {
        futex_wait(self, seen, timeout)
    }
    fn wake(&self) {
        futex_wake(self)
    }
}

/// The sleeping side of the store-then-load handshake (Dekker's): says that it sleeps (`flag`), then,
/// after a sequentially consistent fence, reads `word` and `ready()` once more, and sleeps on `word`
/// only while it still holds what was read. The waking side stores its change to `word`, fences, and
/// wakes if it reads `flag` set: with the two fences, either it sees the flag (and wakes) or this side
/// sees its store (and does not sleep), so no wake-up is lost. Returns whether `ready()` held; a
/// `false` is a wake-up, a timeout or a spurious return, and the caller checks again.
pub fn sleep_unless<W: Word + ?Sized>(
    word: &W,
    flag: &W,
    mut ready: impl FnMut() -> bool,
    timeout: Duration,
) -> bool {
    flag.store(1, Ordering::Relaxed);
    flag.fence_seq_cst();
    let seen = word.load(Ordering::Relaxed);
    if ready() {
        flag.store(0, Ordering::Relaxed);
        return true;
    }
    word.sleep(seen, timeout);
    flag.store(0, Ordering::Relaxed);
    ready()
}

/// Sleeps while `*word == seen`, at most `timeout`. Spurious returns are fine: callers re-check.
pub(crate) fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = rustix::thread::futex::Timespec {
        tv_sec: timeout.as_secs() as _,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    // Not private: the word lives in a mapping shared between processes. An error (the word moved on,
    // a signal, the timeout) is a wake-up like any other.
    let _ =
        rustix::thread::futex::wait(word, rustix::thread::futex::Flags::empty(), seen, Some(&ts));
}

/// Wakes every process sleeping on `word`.
pub(crate) fn futex_wake(word: &AtomicU32) {
    let _ =
        rustix::thread::futex::wake(word, rustix::thread::futex::Flags::empty(), i32::MAX as u32);
}

/// A peer process, watched through a pidfd: unlike a pid, which the system may give to a new process
/// once the peer is gone, a pidfd names the process it was opened for until it is closed.
#[derive(Debug)]
pub struct PeerProcess {
    pid: u32,
    /// `None` where pidfds are not available (kernels before 5.3): then `/proc` is asked by pid.
    fd: Option<std::os::fd::OwnedFd>,
}

impl PeerProcess {
    /// Watches process `pid`, which must be the peer now (open it while the peer is known to be alive:
    /// right after it has spoken).
    pub fn open(pid: u32) -> PeerProcess {
        let fd = rustix::process::Pid::from_raw(pid as i32).and_then(|p| {
            rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
        });
        PeerProcess { pid, fd }
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether it still runs (a zombie counts as gone).
    pub fn alive(&self) -> bool {
        match &self.fd {
            Some(fd) => {
                // A pidfd turns readable when its process exits.
                let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
                let zero = rustix::event::Timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                match rustix::event::poll(&mut fds, Some(&zero)) {
                    Ok(n) => n == 0,
                    Err(_) => peer_alive(self.pid),
                }
            }
            None => peer_alive(self.pid),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_coarse_clock_stays_within_a_tick_of_the_precise_one() {
        // A tick is at most 10 ms (HZ >= 100); the coarse clock lags the precise one by up to a tick
        // and its base reading may sit a tick either way.
        let tick = Duration::from_millis(10);
        let mut last = Stamp::now().instant();
        for _ in 0..200 {
            let before = Instant::now();
            let c = Stamp::now().instant();
            let after = Instant::now();
            assert!(
                c + tick >= before && c <= after + tick,
                "{c:?} not within a tick of {before:?}..{after:?}"
            );
            assert!(c >= last, "the coarse clock went backwards");
            last = c;
            let (a, b) = (Stamp::now(), Stamp::now());
            assert!(b >= a && b.nanos_since(a) < tick.as_nanos() as u64);
            assert_eq!(
                a.nanos_since(b),
                0,
                "a later stamp is no time before an earlier one"
            );
            std::thread::sleep(Duration::from_micros(300));
        }
    }

    #[test]
    fn a_stopped_child_is_alive_and_stopped() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) };
        let start = std::time::Instant::now();
        while !peer_stopped(pid) && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(peer_stopped(pid) && peer_alive(pid));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!peer_stopped(pid) && !peer_alive(pid));
    }

    #[test]
    fn a_pidfd_sees_its_process_exit_before_it_is_reaped() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let p = PeerProcess::open(child.id());
        assert!(p.fd.is_some(), "no pidfd on this kernel");
        assert!(p.alive());
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
        let start = std::time::Instant::now();
        while p.alive() && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(2));
        }
        // Gone while still a zombie (not reaped): its pid cannot have been reused yet, and the pidfd
        // would not follow a reused pid anyway.
        assert!(!p.alive());
        child.wait().unwrap();
        assert!(PeerProcess::open(std::process::id()).alive());
    }

    #[test]
    fn liveness_of_self_and_of_a_reaped_child() {
        assert!(peer_alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!peer_alive(pid));
    }

    #[test]
    fn wait_times_out_and_aborts() {
        let word = AtomicU32::new(0);
        let flag = AtomicU32::new(0);
        let abort = AtomicBool::new(false);
        let policy = WaitPolicy {
            spin: Duration::ZERO,
            yield_for: Duration::ZERO,
        };
        let now = Instant::now();
        let ctx = WaitCtx {
            rank: 0,
            collective: "test",
            seq: 3,
            deadline: now + Duration::from_millis(30),
            started: now,
            abort: &abort,
        };
        let e = wait_until(
            &policy,
            &ctx,
            ctx.deadline,
            1,
            "data",
            &word,
            &flag,
            || false,
            || Ok(()),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Timeout { seq: 3, .. }), "{e}");
        assert!(now.elapsed() >= Duration::from_millis(30));
        abort.store(true, Ordering::Relaxed);
        let ctx = WaitCtx {
            deadline: Instant::now() + Duration::from_secs(60),
            ..ctx
        };
        let e = wait_until(
            &policy,
            &ctx,
            ctx.deadline,
            1,
            "data",
            &word,
            &flag,
            || false,
            || Ok(()),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Aborted { .. }), "{e}");
    }

    #[test]
    fn wake_crosses_threads() {
        let word = std::sync::Arc::new(AtomicU32::new(0));
        let flag = std::sync::Arc::new(AtomicU32::new(0));
        let abort = AtomicBool::new(false);
        let (w, f) = (word.clone(), flag.clone());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            w.store(1, Ordering::SeqCst);
            if f.load(Ordering::SeqCst) != 0 {
                futex_wake(&w);
            }
        });
        let policy = WaitPolicy {
            spin: Duration::ZERO,
            yield_for: Duration::ZERO,
        };
        let now = Instant::now();
        let ctx = WaitCtx {
            rank: 0,
            collective: "test",
            seq: 0,
            deadline: now + Duration::from_secs(10),
            started: now,
            abort: &abort,
        };
        wait_until(
            &policy,
            &ctx,
            ctx.deadline,
            1,
            "data",
            &word,
            &flag,
            || word.load(Ordering::Acquire) == 1,
            || Ok(()),
        )
        .unwrap();
        t.join().unwrap();
    }
}
