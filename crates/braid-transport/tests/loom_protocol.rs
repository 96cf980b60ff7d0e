//! A loom model of the shared-memory ring protocol, explored over every interleaving (up to a bound on
//! preemptions): a sender and a receiver, 2 slots, 3 messages.
//!
//! It is the protocol of `shm`, step for step, on loom's atomics:
//! - the sender has credit for message `s` while `s - consumed < SLOTS`; it writes the slot, stores the
//!   slot's sequence word (`s + 1`, Release), and after a SeqCst fence reads whether the receiver has
//!   said it sleeps, and if so wakes it;
//! - the receiver has message `r` when the slot's sequence word reads `r + 1` (Acquire); it reads the
//!   slot in place, stores `consumed = r + 1` (Release), and after a SeqCst fence wakes the sender if
//!   it has said it sleeps;
//! - either side, before sleeping, sets its waiting flag, and after a SeqCst fence reads the word it
//!   sleeps on, checks once more, and only then sleeps on that word for as long as it still holds what
//!   it read (a futex: modelled by a lock and a condition variable, so a wake-up after the check is
//!   never lost).
//!
//! The two fences make the store-then-load handshake (Dekker's) correct: at least one side sees the
//! other's store. They are fences rather than SeqCst accesses because that is what loom can check
//! (it models SeqCst accesses as AcqRel), and the transport is written the same way.
//!
//! A lost wake-up shows as a deadlock, a slot written while the receiver reads it as a data race on
//! the slot's cell, a message read before it is complete as a wrong value.

use loom::cell::UnsafeCell;
use loom::sync::atomic::{fence, AtomicU32, Ordering};
use loom::sync::{Arc, Condvar, Mutex};

const SLOTS: u32 = 2;
const MESSAGES: u32 = 3;

/// A futex as the kernel offers it: `wait` sleeps only while the word still holds `seen`, and a `wake`
/// after the word changed reaches every sleeper.
#[derive(Default)]
struct Futex {
    lock: Mutex<()>,
    woken: Condvar,
}

impl Futex {
    fn wait(&self, word: &AtomicU32, seen: u32) {
        let g = self.lock.lock().unwrap();
        if word.load(Ordering::SeqCst) == seen {
            drop(self.woken.wait(g).unwrap());
        }
    }

    fn wake(&self) {
        let _g = self.lock.lock().unwrap();
        self.woken.notify_all();
    }
}

struct Ring {
    seq: [AtomicU32; SLOTS as usize],
    data: [UnsafeCell<u32>; SLOTS as usize],
    consumed: AtomicU32,
    recv_waiting: AtomicU32,
    send_waiting: AtomicU32,
    seq_futex: [Futex; SLOTS as usize],
    consumed_futex: Futex,
}

// SAFETY: the slot cells are shared under the protocol this test checks; loom reports any access that
// the protocol fails to order.
unsafe impl Sync for Ring {}

impl Ring {
    fn new() -> Ring {
        Ring {
            seq: [AtomicU32::new(0), AtomicU32::new(0)],
            data: [UnsafeCell::new(0), UnsafeCell::new(0)],
            consumed: AtomicU32::new(0),
            recv_waiting: AtomicU32::new(0),
            send_waiting: AtomicU32::new(0),
            seq_futex: [Futex::default(), Futex::default()],
            consumed_futex: Futex::default(),
        }
    }
}

/// `wait_until` of the transport, without the spinning (which only delays the same steps).
fn wait_until(word: &AtomicU32, flag: &AtomicU32, futex: &Futex, ready: impl Fn() -> bool) {
    while !ready() {
        flag.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let seen = word.load(Ordering::Relaxed);
        if ready() {
            flag.store(0, Ordering::Relaxed);
            return;
        }
        futex.wait(word, seen);
        flag.store(0, Ordering::Relaxed);
    }
}

fn send(ring: &Ring, s: u32) {
    let credit = || s.wrapping_sub(ring.consumed.load(Ordering::Acquire)) < SLOTS;
    wait_until(
        &ring.consumed,
        &ring.send_waiting,
        &ring.consumed_futex,
        credit,
    );
    let i = (s % SLOTS) as usize;
    // SAFETY: the slot is the sender's between the receiver's release of it and this post.
    ring.data[i].with_mut(|p| unsafe { *p = 100 + s });
    ring.seq[i].store(s + 1, Ordering::Release);
    fence(Ordering::SeqCst);
    if ring.recv_waiting.load(Ordering::Relaxed) != 0 {
        ring.seq_futex[i].wake();
    }
}

fn recv(ring: &Ring, r: u32) -> u32 {
    let i = (r % SLOTS) as usize;
    let ready = || ring.seq[i].load(Ordering::Acquire) == r + 1;
    wait_until(&ring.seq[i], &ring.recv_waiting, &ring.seq_futex[i], ready);
    // SAFETY: the slot is the receiver's from the post it observed until its release below.
    let v = ring.data[i].with(|p| unsafe { *p });
    ring.consumed.store(r + 1, Ordering::Release);
    fence(Ordering::SeqCst);
    if ring.send_waiting.load(Ordering::Relaxed) != 0 {
        ring.consumed_futex.wake();
    }
    v
}

#[test]
fn two_slots_three_messages_every_interleaving() {
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(4);
    model.check(|| {
        let ring = Arc::new(Ring::new());
        let tx = ring.clone();
        let sender = loom::thread::spawn(move || {
            for s in 0..MESSAGES {
                send(&tx, s);
            }
        });
        let got: Vec<u32> = (0..MESSAGES).map(|r| recv(&ring, r)).collect();
        sender.join().unwrap();
        assert_eq!(got, (0..MESSAGES).map(|s| 100 + s).collect::<Vec<_>>());
    });
}

/// The model can fail: without the SeqCst re-check before sleeping, a post between the receiver's
/// check and its sleep is lost, and loom finds the deadlock.
#[test]
fn the_model_finds_a_lost_wake_up() {
    let found = std::panic::catch_unwind(|| {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(2);
        model.check(|| {
            let ring = Arc::new(Ring::new());
            let tx = ring.clone();
            let sender = loom::thread::spawn(move || {
                // SAFETY: as in `send`.
                tx.data[0].with_mut(|p| unsafe { *p = 100 });
                tx.seq[0].store(1, Ordering::SeqCst);
                if tx.recv_waiting.load(Ordering::SeqCst) != 0 {
                    tx.seq_futex[0].wake();
                }
            });
            // Broken: reads the word before publishing that it waits, and never re-checks.
            let seen = ring.seq[0].load(Ordering::SeqCst);
            if seen != 1 {
                ring.recv_waiting.store(1, Ordering::SeqCst);
                let g = ring.seq_futex[0].lock.lock().unwrap();
                drop(ring.seq_futex[0].woken.wait(g).unwrap());
            }
            sender.join().unwrap();
        });
    });
    assert!(found.is_err(), "loom did not find the lost wake-up");
}
