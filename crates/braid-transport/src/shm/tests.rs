use super::*;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

fn world(n: usize, slots: usize, slot_bytes: usize) -> Vec<ShmTransport> {
    let layout = Layout {
        world: n,
        slots,
        slot_bytes,
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
            ShmTransport::new(
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
fn rand_tag() -> u64 {
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
    let mut ts = world(2, 3, 256);
    let b = ts.pop().unwrap();
    let a = ts.pop().unwrap();
    let n = 20_000u32;
    let sender = std::thread::spawn(move || {
        let abort = AtomicBool::new(false);
        for i in 0..n {
            let c = ctx(&abort, 10_000);
            let mut s = a.send_slot(1, &c).unwrap();
            let len = (i % 200) as usize + 4;
            s.data()[..4].copy_from_slice(&i.to_le_bytes());
            s.data()[4..len].fill(i as u8);
            s.post(len);
        }
        a
    });
    let abort = AtomicBool::new(false);
    for i in 0..n {
        let c = ctx(&abort, 10_000);
        let m = b.recv(0, &c).unwrap();
        let len = (i % 200) as usize + 4;
        assert_eq!(m.data().len(), len);
        assert_eq!(u32::from_le_bytes(m.data()[..4].try_into().unwrap()), i);
        assert!(m.data()[4..].iter().all(|x| *x == i as u8));
    }
    sender.join().unwrap();
}

#[test]
fn credits_bound_the_sender_and_timeouts_name_the_peer() {
    let ts = world(2, 2, 64);
    let abort = AtomicBool::new(false);
    for _ in 0..2 {
        ts[0].send_slot(1, &ctx(&abort, 1000)).unwrap().post(8);
    }
    // Both slots are full: the third send waits for a credit and times out.
    let e = ts[0].send_slot(1, &ctx(&abort, 50)).err().unwrap();
    assert!(
        matches!(&e, Error::Timeout { peer: 1, what, .. } if what == "a free slot"),
        "{e}"
    );
    // Receiving one returns a credit.
    drop(ts[1].recv(0, &ctx(&abort, 1000)).unwrap());
    ts[0].send_slot(1, &ctx(&abort, 50)).unwrap().post(0);
    // Nothing from rank 1: a receive times out naming it.
    let e = ts[0].recv(1, &ctx(&abort, 30)).err().unwrap();
    assert!(
        matches!(&e, Error::Timeout { peer: 1, what, .. } if what == "data"),
        "{e}"
    );
}

#[test]
fn tag_mismatch_and_peer_failure_are_errors() {
    let ts = world(3, 2, 64);
    let abort = AtomicBool::new(false);
    ts[0].set_tag(7);
    ts[0].send_slot(1, &ctx(&abort, 1000)).unwrap().post(4);
    ts[1].set_tag(8);
    let e = ts[1].recv(0, &ctx(&abort, 1000)).err().unwrap();
    assert!(
        matches!(&e, Error::Mismatch { peer: 0, .. }) && e.to_string().contains("#7"),
        "{e}"
    );
    // Rank 2 fails: rank 1 waiting on it gets an error naming it well before the deadline.
    ts[2].mappings().fail_and_wake();
    let start = Instant::now();
    let e = ts[1].recv(2, &ctx(&abort, 10_000)).err().unwrap();
    assert!(matches!(&e, Error::PeerFailed { peer: 2, .. }), "{e}");
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn abort_from_another_thread_unblocks_a_wait() {
    let ts = world(2, 2, 64);
    let abort = std::sync::Arc::new(AtomicBool::new(false));
    let maps = ts[0].mappings();
    let a2 = abort.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        a2.store(true, Ordering::SeqCst);
        maps.wake_all();
    });
    let e = ts[0].recv(1, &ctx(&abort, 60_000)).err().unwrap();
    assert!(matches!(e, Error::Aborted { .. }), "{e}");
    t.join().unwrap();
}

#[test]
fn open_rejects_a_foreign_or_mismatched_segment() {
    let layout = Layout {
        world: 2,
        slots: 2,
        slot_bytes: 64,
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
        let e = t1.recv(0, &ctx(&abort, 1500)).err().unwrap();
        (e, t1)
    });
    std::thread::sleep(Duration::from_millis(100));
    let abort = AtomicBool::new(false);
    let e = t2.recv(1, &ctx(&abort, 300)).err().unwrap();
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
        slots: 2,
        slot_bytes: 64,
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
