use super::layout::H_PID;
use super::*;
use crate::link::{recv_with, send_bytes, Event, Link, RecvSlot};
use crate::wait::{WaitCtx, WaitPolicy};
use braid_core::Error;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn world(n: usize, slots: usize, slot_bytes: usize) -> Vec<ShmLink> {
    world_ch(n, 1, slots, slot_bytes)
}

fn world_ch(n: usize, channels: usize, slots: usize, slot_bytes: usize) -> Vec<ShmLink> {
    let layout = Layout {
        world: n,
        channels,
        slots,
        slot_bytes,
        device: false,
    };
    let tag: u64 = rand_tag();
    let path = |r: usize| PathBuf::from(format!("/dev/shm/braid-test-{tag:x}-{r}"));
    let own: Vec<Segment> = (0..n)
        .map(|r| Segment::create(&path(r), layout, r).unwrap())
        .collect();
    let transports = own
        .into_iter()
        .enumerate()
        .map(|(r, seg)| {
            let peers = (0..n)
                .map(|p| (p != r).then(|| Segment::open(&path(p), layout, p).unwrap()))
                .collect();
            ShmLink::new(
                seg,
                peers,
                WaitPolicy {
                    spin: Duration::from_micros(5),
                    yield_for: Duration::from_micros(20),
                },
            )
        })
        .collect();
    for r in 0..n {
        std::fs::remove_file(path(r)).unwrap();
    }
    transports
}

/// A name unique to this test process and call.
pub(super) fn rand_tag() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    t ^ ((std::process::id() as u64) << 40) ^ NEXT.fetch_add(1, Ordering::Relaxed)
}

fn ctx<'a>(abort: &'a AtomicBool, ms: u64) -> WaitCtx<'a> {
    let now = Instant::now();
    WaitCtx {
        rank: 0,
        collective: "test",
        seq: 0,
        deadline: now + Duration::from_millis(ms),
        started: now,
        abort,
    }
}

#[test]
fn stream_of_messages_arrives_in_order_across_counter_wrap() {
    // Three slots: a message's slot is its counter modulo 3; four: the counter masked.
    for slots in [3, 4] {
        stream_of_messages(slots);
    }
}

fn stream_of_messages(slots: usize) {
    let mut ts = world(2, slots, 256);
    let b = ts.pop().unwrap();
    let a = ts.pop().unwrap();
    let n = 20_000u32;
    let sender = std::thread::spawn(move || {
        let abort = AtomicBool::new(false);
        for i in 0..n {
            let c = ctx(&abort, 10_000);
            let len = (i % 200) as usize + 4;
            let mut m = vec![i as u8; len];
            m[..4].copy_from_slice(&i.to_le_bytes());
            send_bytes(&a, 1, 0, &m, i, &c).unwrap();
        }
        a
    });
    let abort = AtomicBool::new(false);
    for i in 0..n {
        let c = ctx(&abort, 10_000);
        let (m, tag) = recv_with(&b, 0, 0, &c, |d, t| (d.to_vec(), t)).unwrap();
        let len = (i % 200) as usize + 4;
        assert_eq!((m.len(), tag), (len, i));
        assert_eq!(u32::from_le_bytes(m[..4].try_into().unwrap()), i);
        assert!(m[4..].iter().all(|x| *x == i as u8));
    }
    sender.join().unwrap();
}

#[test]
fn credits_bound_the_sender_and_timeouts_name_the_peer() {
    let ts = world(2, 2, 64);
    let abort = AtomicBool::new(false);
    for _ in 0..2 {
        send_bytes(&ts[0], 1, 0, &[1; 8], 0, &ctx(&abort, 1000)).unwrap();
    }
    // Both slots are full: no credit, and a wait for one times out naming the peer.
    assert!(ts[0].try_reserve(1, 0, &ctx(&abort, 50)).unwrap().is_none());
    let c = ctx(&abort, 50);
    let e = send_bytes(&ts[0], 1, 0, &[], 0, &c).unwrap_err();
    assert!(
        matches!(&e, Error::Timeout { peer: 1, what, .. } if what == "a free slot"),
        "{e}"
    );
    // Receiving one returns a credit.
    recv_with(&ts[1], 0, 0, &ctx(&abort, 1000), |_, _| ()).unwrap();
    send_bytes(&ts[0], 1, 0, &[], 0, &ctx(&abort, 50)).unwrap();
    // Nothing from rank 1: a receive times out naming it.
    let e = recv_with(&ts[0], 1, 0, &ctx(&abort, 30), |_, _| ()).unwrap_err();
    assert!(
        matches!(&e, Error::Timeout { peer: 1, what, .. } if what == "data"),
        "{e}"
    );
    // A wait that reaches its own limit before the deadline returns to the caller.
    let c = ctx(&abort, 10_000);
    let until = Instant::now() + Duration::from_millis(20);
    ts[0].wait(1, 0, Event::Data, &c, until).unwrap();
    assert!(Instant::now() >= until);
}

#[test]
fn channels_are_independent_rings() {
    let ts = world_ch(2, 3, 2, 64);
    let abort = AtomicBool::new(false);
    let c = ctx(&abort, 1000);
    for ch in 0..3 {
        for i in 0..2u8 {
            send_bytes(
                &ts[0],
                1,
                ch,
                &[ch as u8, i],
                (10 * ch) as u32 + i as u32,
                &c,
            )
            .unwrap();
        }
        assert!(ts[0].try_reserve(1, ch, &c).unwrap().is_none());
    }
    for ch in (0..3).rev() {
        for i in 0..2u8 {
            let got = recv_with(&ts[1], 0, ch, &c, |d, t| (d.to_vec(), t)).unwrap();
            assert_eq!(got, (vec![ch as u8, i], (10 * ch) as u32 + i as u32));
        }
    }
    assert!(ts[0].try_reserve(1, 3, &c).is_err(), "channel out of range");
}

#[test]
fn releases_may_come_later_but_in_order() {
    let ts = world(2, 4, 64);
    let abort = AtomicBool::new(false);
    let c = ctx(&abort, 1000);
    for i in 0..4u8 {
        send_bytes(&ts[0], 1, 0, &[i], 0, &c).unwrap();
    }
    let held: Vec<RecvSlot> = (0..4)
        .map(|_| ts[1].try_recv(0, 0, &c).unwrap().unwrap())
        .collect();
    assert_eq!(
        held.iter()
            .map(|m| m.host_bytes().unwrap()[0])
            .collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    // Held slots are not free yet.
    assert!(ts[0].try_reserve(1, 0, &c).unwrap().is_none());
    let mut held = held.into_iter();
    let first = held.next().unwrap();
    let second = held.next().unwrap();
    let e = ts[1].release(second).unwrap_err();
    assert!(matches!(e, Error::Internal(_)), "{e}");
    ts[1].release(first).unwrap();
    let s = ts[0]
        .try_reserve(1, 0, &c)
        .unwrap()
        .expect("one credit back");
    ts[0].post(s, 0, 0, &c).unwrap();
}

#[test]
fn tags_travel_and_peer_failure_is_an_error() {
    let ts = world(3, 2, 64);
    let abort = AtomicBool::new(false);
    send_bytes(&ts[0], 1, 0, &[0; 4], 7, &ctx(&abort, 1000)).unwrap();
    let tag = recv_with(&ts[1], 0, 0, &ctx(&abort, 1000), |_, t| t).unwrap();
    assert_eq!(tag, 7);
    // Rank 2 fails: rank 1 waiting on it gets an error naming it well before the deadline.
    ts[2].abort_handle().fail_and_wake();
    let start = Instant::now();
    let e = recv_with(&ts[1], 2, 0, &ctx(&abort, 10_000), |_, _| ()).unwrap_err();
    assert!(matches!(&e, Error::PeerFailed { peer: 2, .. }), "{e}");
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn abort_from_another_thread_unblocks_a_wait() {
    let ts = world(2, 2, 64);
    let abort = std::sync::Arc::new(AtomicBool::new(false));
    let maps = ts[0].abort_handle();
    let a2 = abort.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        a2.store(true, Ordering::SeqCst);
        maps.wake_all();
    });
    let e = recv_with(&ts[0], 1, 0, &ctx(&abort, 60_000), |_, _| ()).unwrap_err();
    assert!(matches!(e, Error::Aborted { .. }), "{e}");
    t.join().unwrap();
}

#[test]
fn open_rejects_a_foreign_or_mismatched_segment() {
    let layout = Layout {
        world: 2,
        channels: 1,
        slots: 2,
        slot_bytes: 64,
        device: false,
    };
    let p = PathBuf::from(format!("/dev/shm/braid-test-open-{:x}", rand_tag()));
    std::fs::write(&p, vec![0u8; layout.size()]).unwrap();
    let e = Segment::open(&p, layout, 0).err().unwrap();
    assert!(e.to_string().contains("not a braid segment"), "{e}");
    std::fs::remove_file(&p).unwrap();
    let seg = Segment::create(&p, layout, 0).unwrap();
    let e = Segment::open(&p, Layout { slots: 4, ..layout }, 0)
        .err()
        .unwrap();
    assert!(e.to_string().contains("size"), "{e}");
    let e = Segment::open(&p, layout, 1).err().unwrap();
    assert!(e.to_string().contains("owner is 0"), "{e}");
    drop(seg);
    assert!(!p.exists(), "the creator removes its segment when dropped");
}

#[test]
fn a_timeout_names_the_rank_at_the_end_of_the_chain_of_waits() {
    // Rank 1 waits for rank 0 (silent); rank 2 waits for rank 1 and must blame rank 0.
    let mut ts = world(3, 2, 64);
    let t2 = ts.pop().unwrap();
    let t1 = ts.pop().unwrap();
    let waiter = std::thread::spawn(move || {
        let abort = AtomicBool::new(false);
        let e = recv_with(&t1, 0, 0, &ctx(&abort, 1500), |_, _| ()).unwrap_err();
        (e, t1)
    });
    std::thread::sleep(Duration::from_millis(100));
    let abort = AtomicBool::new(false);
    let e = recv_with(&t2, 1, 0, &ctx(&abort, 300), |_, _| ()).unwrap_err();
    assert!(
        matches!(&e, Error::Timeout { peer: 0, what, .. } if what.contains("1 → 0")),
        "{e}"
    );
    let (e1, _t1) = waiter.join().unwrap();
    assert!(matches!(&e1, Error::Timeout { peer: 0, .. }), "{e1}");
}

#[test]
fn stale_segments_of_dead_processes_are_swept() {
    let dir = std::env::temp_dir().join(format!("braid-sweep-{}", rand_tag()));
    std::fs::create_dir(&dir).unwrap();
    let layout = Layout {
        world: 2,
        channels: 1,
        slots: 2,
        slot_bytes: 64,
        device: false,
    };
    let mine = Segment::create(&dir.join("braid-live-r0"), layout, 0).unwrap();
    // A segment whose creator is gone: rewrite the pid of a copy to a reaped child's.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let mut bytes = std::fs::read(mine.path()).unwrap();
    bytes[H_PID..H_PID + 4].copy_from_slice(&dead.to_ne_bytes());
    std::fs::write(dir.join("braid-dead-r1"), &bytes).unwrap();
    std::fs::write(dir.join("braid-foreign"), b"not a segment").unwrap();
    std::fs::write(dir.join("unrelated"), b"x").unwrap();
    assert_eq!(sweep_stale(&dir), 1);
    assert!(
        mine.path().exists()
            && dir.join("braid-foreign").exists()
            && dir.join("unrelated").exists()
    );
    assert!(!dir.join("braid-dead-r1").exists());
    drop(mine);
    std::fs::remove_dir_all(&dir).unwrap();
}
