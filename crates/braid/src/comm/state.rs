//! The communicator's handle and the state every handle shares ([`Inner`]): what every part of the
//! communicator reads; its methods are in mod.rs, init.rs, collectives.rs and register.rs.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use braid_core::Config;

use crate::streams::Streams;

/// A group of ranks that run collectives together.
///
/// Errors follow NCCL's split: an invalid argument is rejected before anything happens and the
/// communicator stays usable; any other error (timeout, dead or aborted peer, mismatch) makes the
/// communicator unusable, visible through [`Communicator::async_error`], and later calls fail fast.
pub struct Communicator {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    /// How each peer is reached ("self", "shm" or "tcp"), indexed by rank.
    pub(super) routes: Vec<&'static str>,
    /// The ranks of each host.
    pub(crate) hosts: Vec<Vec<usize>>,
    /// Where the ranks are, as the communicator decided it.
    pub(super) topology: braid_topo::Topology,
    pub(crate) config: Config,
    pub(crate) streams: Arc<Streams>,
    pub(super) abort: Arc<AtomicBool>,
    pub(super) recorder: crate::recorder::Recorder,
    /// The timeline (`BRAID_TIMELINE`), for the caller's markers.
    pub(crate) timeline: Option<Arc<crate::timeline::Timeline>>,
    /// Registered buffers, as (address, length), whichever transport uses them.
    pub(super) registered: parking_lot::Mutex<Vec<(usize, usize)>>,
    /// The communicator's secret (links set up later, such as device rings, check it too).
    pub(crate) secret: [u8; 16],
    /// Each rank's host identity, as the bootstrap exchanged it (equal: same kernel, same /dev/shm).
    pub(crate) host_ids: Vec<String>,
}

impl Inner {
    pub(crate) fn streams_limit(&self) -> Duration {
        self.config.timeout * 2 + Duration::from_secs(10)
    }
}

impl Drop for Inner {
    /// The last handle is gone (the caller's, or one a [`crate::GradientBuckets`] worker held).
    fn drop(&mut self) {
        // Queued ops still run (their buffers are owned by their tasks); each is bounded by the
        // timeout, so this is bounded too.
        self.streams.shut_down();
    }
}
