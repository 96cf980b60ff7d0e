//! Progress of long sweeps on stderr (only where stderr is a terminal, and only on rank 0).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A progress bar that is a no-op when hidden.
pub struct Progress {
    bar: Option<ProgressBar>,
}

impl Progress {
    /// A bar of `len` steps, shown when `visible` and stderr is a terminal.
    pub fn new(visible: bool, len: usize) -> Progress {
        let shown = visible && std::io::IsTerminal::is_terminal(&std::io::stderr());
        let bar = shown.then(|| {
            let b = ProgressBar::with_draw_target(Some(len as u64), ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template("{bar:40} {pos}/{len} sizes, {elapsed}")
            {
                b.set_style(style);
            }
            b
        });
        Progress { bar }
    }

    /// Runs `f` (which prints) without the bar in the way.
    pub fn suspend(&self, f: impl FnOnce()) {
        match &self.bar {
            Some(b) => b.suspend(f),
            None => f(),
        }
    }

    /// One step done.
    pub fn step(&self) {
        if let Some(b) = &self.bar {
            b.inc(1);
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
