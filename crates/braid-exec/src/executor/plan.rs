//! A rank's schedule for one op as the executor caches it: its actions, what is known of them up front
//! (whether they need scratch, whether they are one eager round) and the key it is cached under.

use braid_sched::{Action, Algo, Buf, Collective};

/// A rank's schedule for one op, as cached.
#[derive(Debug)]
pub struct Plan {
    pub(super) actions: Vec<Action>,
    pub(super) scratch: bool,
    /// One eager round (`is_eager`).
    pub(super) eager: bool,
}

impl Plan {
    /// A plan of these actions.
    pub fn new(actions: Vec<Action>) -> Plan {
        let scratch = actions.iter().any(|a| matches!(a, Action::LoadAcc { .. }));
        let eager = is_eager(&actions);
        Plan {
            actions,
            scratch,
            eager,
        }
    }

    /// The actions.
    pub fn actions(&self) -> &[Action] {
        &self.actions
    }
}

/// Whether `actions` are one eager round: sends of one range of the input, then the reduction of
/// that range from every rank.
pub(super) fn is_eager(actions: &[Action]) -> bool {
    let Some((
        Action::RecvReduceAll {
            input: range,
            output,
            ..
        },
        sends,
    )) = actions.split_last()
    else {
        return false;
    };
    !sends.is_empty()
        && output.len() == range.len()
        && sends
            .iter()
            .all(|a| matches!(a, Action::Send { buf: Buf::Input, range: r, .. } if r == range))
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct PlanKey {
    pub(super) collective: Collective,
    pub(super) root: usize,
    pub(super) algo: Algo,
    pub(super) count: usize,
    pub(super) chunk: usize,
}
