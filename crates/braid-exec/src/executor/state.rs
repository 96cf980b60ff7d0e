//! The executor's state: its fixed settings, the fields of an [`Executor`] (its methods are in mod.rs,
//! step.rs and eager.rs), and what a step borrows of them ([`Cx`]).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use braid_transport::{Link, RecvSlot};

use super::plan::{Plan, PlanKey};
use crate::engine::{Engine, Operand, Scratch};

/// The executor's fixed settings.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// How long one collective may take before it fails with a timeout.
    pub timeout: Duration,
    /// Compare every op's fingerprint with every peer's first (`BRAID_DEBUG_CHECKS`).
    pub debug_checks: bool,
    /// Rings of a ring all-reduce (`BRAID_CHANNELS`).
    pub rings: usize,
}

/// One rank's executor, computing with an engine of type `E`: a concrete engine (calls to it are
/// direct) or, by default, any engine behind `dyn Engine`.
pub struct Executor<E: Engine + ?Sized = dyn Engine> {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) settings: Settings,
    /// Declared (so dropped) before the link: a device engine waits for its queued kernels when it
    /// drops, and they may still use the link's slots, which go with the link.
    pub(super) engine: Box<E>,
    pub(super) link: Option<Box<dyn Link>>,
    /// The link's slot size and channels (fixed: read once, not on every op).
    pub(super) slot_bytes: usize,
    pub(super) channels: usize,
    pub(super) abort: Arc<AtomicBool>,
    pub(super) hosts: Vec<Vec<usize>>,
    /// Recently used plans, most recent first.
    pub(super) plans: Vec<(PlanKey, Arc<Plan>)>,
    pub(super) spare_scratch: Vec<Scratch>,
    pub(super) spare_rx: Vec<Vec<Option<RecvSlot>>>,
    /// The eager path's received messages, one place per rank (every place empty once a call
    /// returns).
    pub(super) eager_rx: Vec<Option<RecvSlot>>,
    pub(super) srcs: Vec<Operand>,
}

/// What a step needs from the executor while it mutates a run.
pub(super) struct Cx<'a, E: Engine + ?Sized> {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) link: &'a dyn Link,
    pub(super) engine: &'a mut E,
    pub(super) abort: &'a AtomicBool,
    pub(super) srcs: &'a mut Vec<Operand>,
}
