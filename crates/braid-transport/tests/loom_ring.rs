//! The shared-memory ring's slot protocol, explored by loom over every interleaving (up to a bound on
//! preemptions): a sender and a receiver, 2 slots, 3 messages.
//!
//! This runs the transport's own code, [`braid_transport::shm::protocol`] and the sleep handshake
//! [`sleep_unless`], instantiated with a [`Word`] made of loom's atomics and a loom futex in place of
//! the words in shared memory. What the test adds is only what the link does around the protocol:
//! writing and reading the slot's payload, and repeating the handshake until the wait is over (the
//! link's spinning before it sleeps only re-checks the same condition).
//!
//! A lost wake-up shows as a deadlock, a slot written while the receiver reads it as a data race on
//! the slot's cell, a message read before it is complete as a wrong value. Weakening a fence
//! (`fence_seq_cst` in `Sender::post` or in `sleep_unless`) makes the first test fail with a
//! deadlock.

use std::sync::atomic::Ordering;
use std::time::Duration;

use braid_transport::shm::protocol::{sleep_unless, Receiver, Sender, Word};
use loom::cell::UnsafeCell;
use loom::sync::atomic::{fence, AtomicU32};
use loom::sync::{Arc, Condvar, Mutex};

const SLOTS: u32 = 2;
const MESSAGES: u32 = 3;

/// A word with a futex as the kernel offers one: `sleep` returns at once unless the word still holds
/// `seen`, and a `wake` after the word changed reaches every sleeper. Timeouts are not modelled, so a
/// lost wake-up is a deadlock, which loom reports.
struct LoomWord {
    value: AtomicU32,
    lock: Mutex<()>,
    woken: Condvar,
}

impl LoomWord {
    fn new() -> LoomWord {
        LoomWord {
            value: AtomicU32::new(0),
            lock: Mutex::new(()),
            woken: Condvar::new(),
        }
    }
}

impl Word for LoomWord {
    fn load(&self, order: Ordering) -> u32 {
        self.value.load(order)
    }
    fn store(&self, value: u32, order: Ordering) {
        self.value.store(value, order)
    }
    fn fence_seq_cst(&self) {
        fence(Ordering::SeqCst)
    }
    fn sleep(&self, seen: u32, _timeout: Duration) {
        let g = self.lock.lock().unwrap();
        if self.value.load(Ordering::SeqCst) == seen {
            drop(self.woken.wait(g).unwrap());
        }
    }
    fn wake(&self) {
        let _g = self.lock.lock().unwrap();
        self.woken.notify_all();
    }
}

/// One ring's shared words and payload cells, as a segment holds them.
struct Ring {
    seq: [LoomWord; SLOTS as usize],
    data: [UnsafeCell<u32>; SLOTS as usize],
    consumed: LoomWord,
    recv_waiting: LoomWord,
    send_waiting: LoomWord,
}

// SAFETY: the slot cells are shared under the protocol this test checks; loom reports any access that
// the protocol fails to order.
unsafe impl Sync for Ring {}

impl Ring {
    fn new() -> Ring {
        Ring {
            seq: [LoomWord::new(), LoomWord::new()],
            data: [UnsafeCell::new(0), UnsafeCell::new(0)],
            consumed: LoomWord::new(),
            recv_waiting: LoomWord::new(),
            send_waiting: LoomWord::new(),
        }
    }
}

/// The link's wait: the handshake, until the condition holds.
fn wait(word: &LoomWord, flag: &LoomWord, mut ready: impl FnMut() -> bool) {
    while !ready() {
        if sleep_unless(word, flag, &mut ready, Duration::from_secs(1)) {
            return;
        }
    }
}

fn send(ring: &Ring, tx: &Sender, value: u32) {
    wait(&ring.consumed, &ring.send_waiting, || {
        tx.has_credit(&ring.consumed, SLOTS)
    });
    let s = tx.reserve();
    let i = (s % SLOTS) as usize;
    // SAFETY: the slot is the sender's between the receiver's release of it and this post.
    ring.data[i].with_mut(|p| unsafe { *p = value });
    tx.post(s, &ring.seq[i], &ring.recv_waiting);
}

fn recv(ring: &Ring, rx: &Receiver) -> u32 {
    let r = rx.next();
    let i = (r % SLOTS) as usize;
    wait(&ring.seq[i], &ring.recv_waiting, || {
        rx.is_posted(&ring.seq[i])
    });
    rx.take();
    // SAFETY: the slot is the receiver's from the post it observed until its release below.
    let v = ring.data[i].with(|p| unsafe { *p });
    rx.release(r, &ring.consumed, &ring.send_waiting);
    v
}

#[test]
fn two_slots_three_messages_every_interleaving() {
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(4);
    model.check(|| {
        let ring = Arc::new(Ring::new());
        let theirs = ring.clone();
        let sender = loom::thread::spawn(move || {
            let tx = Sender::default();
            for s in 0..MESSAGES {
                send(&theirs, &tx, 100 + s);
            }
        });
        let rx = Receiver::default();
        let got: Vec<u32> = (0..MESSAGES).map(|_| recv(&ring, &rx)).collect();
        sender.join().unwrap();
        assert_eq!(got, (0..MESSAGES).map(|s| 100 + s).collect::<Vec<_>>());
    });
}

/// The model can fail: a receiver that reads the word before it says it sleeps, and never re-checks
/// (unlike `sleep_unless`), loses a post made between its check and its sleep, and loom finds the
/// deadlock.
#[test]
fn the_model_finds_a_lost_wake_up() {
    let found = std::panic::catch_unwind(|| {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(2);
        model.check(|| {
            let ring = Arc::new(Ring::new());
            let theirs = ring.clone();
            let sender = loom::thread::spawn(move || send(&theirs, &Sender::default(), 100));
            if ring.seq[0].load(Ordering::SeqCst) != 1 {
                ring.recv_waiting.store(1, Ordering::SeqCst);
                let g = ring.seq[0].lock.lock().unwrap();
                drop(ring.seq[0].woken.wait(g).unwrap());
            }
            sender.join().unwrap();
        });
    });
    assert!(found.is_err(), "loom did not find the lost wake-up");
}
