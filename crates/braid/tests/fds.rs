//! Creating and destroying communicators leaks no file descriptors (its own process: the count is
//! process-wide).

use braid::{Communicator, Config, UniqueId};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn a_hundred_one_rank_communicators_leave_no_descriptor_behind() {
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
