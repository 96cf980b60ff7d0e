//! Ranks as threads of this process, each with its own communicator, and a configuration with a
//! short timeout.

use std::sync::Arc;
use std::time::Duration;

use braid::{Communicator, Config, UniqueId};

/// The default configuration with a timeout of `timeout_ms`.
pub fn config(timeout_ms: u64) -> Config {
    Config {
        timeout: Duration::from_millis(timeout_ms),
        ..Config::default()
    }
}

/// Runs `f` on `n` ranks, each a thread with its own communicator made with `cfg`; their results in
/// rank order.
pub fn with_ranks<R: Send + 'static>(
    n: usize,
    cfg: Config,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    with_ranks_each(n, move |_| cfg.clone(), f)
}

/// As [`with_ranks`], rank `r` with the configuration `configs(r)`.
pub fn with_ranks_each<R: Send + 'static>(
    n: usize,
    configs: impl Fn(usize) -> Config,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let id = UniqueId::new().unwrap();
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (id, cfg, f) = (id.clone(), configs(r), f.clone());
            std::thread::spawn(move || f(Communicator::init(n, r, &id, cfg).expect("init")))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}
