//! The real executor over the in-memory network with faults: a killed or a stalled rank ends every
//! survivor's collective with the right error (or, where the survivor no longer needed the victim, with
//! the exact result), never a hang; latency changes timing and nothing else.

mod common;

use std::time::Duration;

use braid_core::{DType, Error, ReduceOp};
use braid_exec::sim::{self, Fault, Job};
use braid_sched::{Action, Algo};
use common::*;
use proptest::prelude::*;

fn flat_algos() -> impl Strategy<Value = Algo> {
    prop::sample::select(vec![Algo::Ring, Algo::Tree, Algo::Rhd, Algo::Direct])
}

/// Checks every survivor: an error of the expected kinds, or the exact result. Returns the errors.
fn survivors(report: &sim::Report, victim: usize, want: &[u8]) -> Vec<Error> {
    let mut errors = Vec::new();
    for (r, res) in report.results.iter().enumerate() {
        if r == victim {
            // A victim whose schedule was shorter than the fault's step count finished first.
            match res {
                None => {}
                Some(Ok(())) => assert_eq!(report.outputs[r], want, "the victim finished wrong"),
                Some(Err(e)) => panic!("the victim {r} failed itself: {e}"),
            }
            continue;
        }
        match res {
            Some(Ok(())) => assert_eq!(
                report.outputs[r], want,
                "rank {r} succeeded with a wrong result"
            ),
            Some(Err(e)) => errors.push(e.clone()),
            None => panic!("survivor {r} has no result"),
        }
    }
    errors
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 60, ..ProptestConfig::default() })]

    #[test]
    fn a_killed_rank_fails_every_survivor_that_needs_it(algo in flat_algos(), world in 2usize..=64,
        count in 1usize..200, chunk in 1usize..32, victim in any::<prop::sample::Index>(),
        after in 0u64..6, seed in any::<u64>()) {
        let victim = victim.index(world);
        let ins = exact_inputs(DType::I32, ReduceOp::Sum, world, count, seed);
        let want = reference(DType::I32, ReduceOp::Sum, &ins);
        let p = all_reduce_plans(algo, world, count, chunk);
        let mut job = Job::new(&p, DType::I32, ReduceOp::Sum, &ins, count, 2);
        job.faults = vec![Fault::Kill { rank: victim, after }];
        let report = sim::simulate(&job).expect("a fault never looks like a deadlock");
        let errors = survivors(&report, victim, &want);
        for e in &errors {
            prop_assert!(matches!(e, Error::PeerFailed { .. }), "{e}");
        }
        if after == 0 {
            // Every output depends on the victim's input: nobody can have finished.
            prop_assert_eq!(errors.len(), world - 1);
            let named = errors
                .iter()
                .any(|e| matches!(e, Error::PeerFailed { peer, .. } if *peer == victim));
            prop_assert!(named, "{:?}", errors);
        }
    }

    #[test]
    fn a_stalled_rank_times_out_its_peers(algo in flat_algos(), world in 2usize..=64,
        count in 1usize..200, chunk in 1usize..32, victim in any::<prop::sample::Index>(),
        after in 0u64..6, seed in any::<u64>()) {
        let victim = victim.index(world);
        let ins = exact_inputs(DType::F32, ReduceOp::Max, world, count, seed);
        let want = reference(DType::F32, ReduceOp::Max, &ins);
        let p = all_reduce_plans(algo, world, count, chunk);
        let mut job = Job::new(&p, DType::F32, ReduceOp::Max, &ins, count, 2);
        job.timeout = Duration::from_millis(300);
        job.faults = vec![Fault::Stall { rank: victim, after }];
        let report = sim::simulate(&job).expect("a fault never looks like a deadlock");
        prop_assert!(report.elapsed >= job.timeout || report.results.iter().flatten().all(Result::is_ok));
        let errors = survivors(&report, victim, &want);
        for e in &errors {
            prop_assert!(matches!(e, Error::Timeout { .. } | Error::PeerFailed { .. }), "{e}");
        }
        if after == 0 {
            prop_assert_eq!(errors.len(), world - 1);
            // Someone waited on the stalled rank itself and says so.
            let named = errors
                .iter()
                .any(|e| matches!(e, Error::Timeout { peer, .. } if *peer == victim));
            prop_assert!(named, "{:?}", errors);
        }
    }

    #[test]
    fn latency_changes_nothing_but_time(algo in flat_algos(), world in 1usize..=16, count in 0usize..300,
        chunk in 1usize..40, micros in 1u64..500, seed in any::<u64>()) {
        let ins = exact_inputs(DType::I64, ReduceOp::Sum, world, count, seed);
        let want = reference(DType::I64, ReduceOp::Sum, &ins);
        let p = all_reduce_plans(algo, world, count, chunk);
        let mut job = Job::new(&p, DType::I64, ReduceOp::Sum, &ins, count, 2);
        job.latency = Duration::from_micros(micros);
        let report = sim::simulate(&job).unwrap();
        for (r, res) in report.results.iter().enumerate() {
            prop_assert!(matches!(res, Some(Ok(()))), "rank {r}: {res:?}");
            prop_assert_eq!(&report.outputs[r], &want);
        }
        prop_assert_eq!(report.traffic.unread, 0);
        if world > 1 && count > 0 {
            // At least one message crossed: the run took at least one latency.
            prop_assert!(report.elapsed >= job.latency);
        }
    }
}

#[test]
fn a_schedule_that_cannot_finish_is_a_deadlock_not_a_hang() {
    // Both ranks wait for each other first.
    let p = vec![
        vec![
            Action::RecvCopy {
                from: 1,
                output: 0..0,
                forward: None,
            },
            Action::Send {
                to: 1,
                buf: braid_sched::Buf::Output,
                range: 0..0,
            },
        ],
        vec![
            Action::RecvCopy {
                from: 0,
                output: 0..0,
                forward: None,
            },
            Action::Send {
                to: 0,
                buf: braid_sched::Buf::Output,
                range: 0..0,
            },
        ],
    ];
    let ins = vec![vec![], vec![]];
    let err = sim::run(&p, DType::U8, ReduceOp::Sum, &ins, 0, 1).unwrap_err();
    assert_eq!(err, sim::SimError::Deadlock(vec![0, 0]));
}

#[test]
fn a_message_nobody_reads_is_left_over() {
    let p = vec![
        vec![Action::Send {
            to: 1,
            buf: braid_sched::Buf::Input,
            range: 0..1,
        }],
        vec![],
    ];
    let ins = vec![vec![7u8], vec![0u8]];
    assert_eq!(
        sim::run(&p, DType::U8, ReduceOp::Sum, &ins, 1, 1).unwrap_err(),
        sim::SimError::Leftover(1)
    );
}
