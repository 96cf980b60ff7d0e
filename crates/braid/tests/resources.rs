//! What communicators cost the process: no descriptor left behind, no thread per connection (a test
//! binary of its own, since the counts are process-wide).

use braid::{Communicator, Config, UniqueId};

/// The tests count process-wide resources: one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn a_hundred_one_rank_communicators_leave_no_descriptor_behind() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    // One first: lazily opened process-wide things (the logger, the randomness source) stay.
    drop(Communicator::init(1, 0, &UniqueId::new().unwrap(), Config::default()).unwrap());
    let before = open_fds();
    for _ in 0..100 {
        let id = UniqueId::new().unwrap();
        let c = Communicator::init(1, 0, &id, Config::default()).unwrap();
        let mut x = vec![1.0f32; 4];
        c.all_reduce_in_place(&mut x, braid::ReduceOp::Sum).unwrap();
        drop(c);
    }
    let after = open_fds();
    assert!(
        after <= before + 2,
        "{before} descriptors before, {after} after"
    );
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[test]
fn hundreds_of_idle_connections_neither_cost_threads_nor_keep_a_rank_out() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    use std::time::{Duration, Instant};
    let id = UniqueId::new().unwrap();
    let cfg = Config {
        timeout: Duration::from_secs(30),
        ..Config::default()
    };
    let base = threads();
    let (id0, cfg0) = (id.clone(), cfg.clone());
    let root = std::thread::spawn(move || Communicator::init(2, 0, &id0, cfg0));
    // Connections that never say hello, more than the root keeps pending.
    let idle: Vec<_> = (0..300)
        .map(|_| std::net::TcpStream::connect(id.addr()).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let during = threads();
    let start = Instant::now();
    let c1 = Communicator::init(2, 1, &id, cfg).unwrap();
    let c0 = root.join().unwrap().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    // The root's thread, and none per connection.
    assert!(
        during <= base + 3,
        "{base} threads before, {during} with {} idle connections",
        idle.len()
    );
    let t = std::thread::spawn(move || {
        let mut x = vec![1.0f32; 4];
        c1.all_reduce_in_place(&mut x, braid::ReduceOp::Sum)
            .map(|()| x)
    });
    let mut y = vec![1.0f32; 4];
    c0.all_reduce_in_place(&mut y, braid::ReduceOp::Sum)
        .unwrap();
    assert_eq!(t.join().unwrap().unwrap(), vec![2.0; 4]);
    assert_eq!(y, vec![2.0; 4]);
    drop(idle);
}

#[test]
fn the_last_handle_may_go_in_a_completion_callback() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let c = Communicator::init(1, 0, &UniqueId::new().unwrap(), Config::default()).unwrap();
    let work = c.all_reduce_async(vec![1.0f32; 1 << 16], braid::ReduceOp::Sum);
    let (tx, rx) = std::sync::mpsc::channel();
    // The communicator is dropped on whichever thread completes the op: the progress thread, which
    // must not try to join itself.
    work.on_complete(move |r| {
        drop(c);
        let _ = tx.send(r.is_ok());
    });
    assert_eq!(
        rx.recv_timeout(std::time::Duration::from_secs(20)),
        Ok(true)
    );
}
