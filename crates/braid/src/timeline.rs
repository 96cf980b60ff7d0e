//! The timeline (`BRAID_TIMELINE=FILE`): every collective's phases per stream, and the caller's own
//! markers (compute), as Chrome trace-event JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing
//! open; `braid timeline` summarises, merges and draws it.
//!
//! Each rank writes its own file: `FILE` with `{rank}` replaced by the rank, or, without `{rank}`,
//! `.rank<r>` put before the extension (`trace.json` → `trace.rank0.json`). A rank is a process (`pid`)
//! named `rank <r>`; each stream is a thread (`tid` = the stream) named `stream <s>`; the caller's
//! markers are on the thread `compute` (`tid` 1000). A collective is a complete event (`ph: "X"`) named
//! after it, with its count, dtype, algorithm, bytes, sequence number and result in `args`, preceded by
//! a `queued` event for the time it waited on its stream behind others. Times are microseconds of the
//! host's monotonic clock, so ranks on one host line up.
//!
//! Events are kept in memory (at most [`MAX_EVENTS`]; later ones are counted and dropped) and written
//! when the communicator is dropped or [`crate::Communicator::timeline_flush`] is called.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use braid_core::Error;
use parking_lot::Mutex;

/// Events kept per rank before later ones are dropped (and counted).
pub const MAX_EVENTS: usize = 1 << 20;

/// The thread id of the caller's markers.
pub const COMPUTE_TID: u64 = 1000;

/// Nanoseconds of the host's monotonic clock (`CLOCK_MONOTONIC`, shared by the processes of a host).
pub fn now_ns() -> u64 {
    // SAFETY: a timespec is plain integers; all zeroes is a value.
    let mut t: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: `t` is a valid, writable timespec and CLOCK_MONOTONIC exists on every Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    (t.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(t.tv_nsec as u64)
}

/// One complete event.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Event {
    pub(crate) name: String,
    pub(crate) cat: &'static str,
    pub(crate) tid: u64,
    pub(crate) start_ns: u64,
    pub(crate) end_ns: u64,
    /// `args` as JSON (an object), or empty.
    pub(crate) args: serde_json::Map<String, serde_json::Value>,
}

/// A rank's timeline.
pub(crate) struct Timeline {
    rank: usize,
    path: PathBuf,
    events: Mutex<Vec<Event>>,
    streams: usize,
    dropped: AtomicU64,
}

/// The file rank `rank` writes for `BRAID_TIMELINE=pattern`.
pub fn rank_path(pattern: &Path, rank: usize) -> PathBuf {
    let text = pattern.to_string_lossy();
    if text.contains("{rank}") {
        return PathBuf::from(text.replace("{rank}", &rank.to_string()));
    }
    match (pattern.file_stem(), pattern.extension()) {
        (Some(stem), Some(ext)) => pattern.with_file_name(format!(
            "{}.rank{rank}.{}",
            stem.to_string_lossy(),
            ext.to_string_lossy()
        )),
        _ => PathBuf::from(format!("{text}.rank{rank}")),
    }
}

impl Timeline {
    pub(crate) fn new(pattern: &Path, rank: usize, streams: usize) -> Timeline {
        Timeline {
            rank,
            path: rank_path(pattern, rank),
            events: Mutex::new(Vec::new()),
            streams,
            dropped: AtomicU64::new(0),
        }
    }

    pub(crate) fn push(&self, e: Event) {
        let mut events = self.events.lock();
        if events.len() >= MAX_EVENTS {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        } else {
            events.push(e);
        }
    }

    /// The trace as Chrome trace-event JSON.
    pub(crate) fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        let pid = self.rank;
        let mut out = vec![
            json!({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": format!("rank {pid}")}}),
            json!({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}),
            json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": COMPUTE_TID, "args": {"name": "compute"}}),
        ];
        for s in 0..self.streams {
            out.push(
                json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": s,
                "args": {"name": format!("stream {s}")}}),
            );
        }
        for e in self.events.lock().iter() {
            out.push(json!({
                "ph": "X",
                "name": e.name,
                "cat": e.cat,
                "pid": pid,
                "tid": e.tid,
                "ts": e.start_ns as f64 / 1000.0,
                "dur": e.end_ns.saturating_sub(e.start_ns) as f64 / 1000.0,
                "args": e.args,
            }));
        }
        json!({
            "traceEvents": out,
            "displayTimeUnit": "ms",
            "otherData": {"braid_rank": pid, "dropped_events": self.dropped.load(Ordering::Relaxed)},
        })
    }

    /// Writes the trace to its file (replacing it); the events stay, so a later flush writes them again
    /// with what came since.
    pub(crate) fn flush(&self) -> Result<PathBuf, Error> {
        let text = serde_json::to_vec(&self.to_json())
            .map_err(|e| Error::Internal(format!("the timeline does not serialise: {e}")))?;
        let tmp = self.path.with_extension("tmp");
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&text)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &self.path)
        };
        write().map_err(|e| {
            Error::invalid(format!(
                "BRAID_TIMELINE: cannot write {}: {e}",
                self.path.display()
            ))
        })?;
        Ok(self.path.clone())
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!("{e}");
        }
    }
}

impl crate::Communicator {
    /// Whether this communicator keeps a timeline (`BRAID_TIMELINE`).
    pub fn timeline_enabled(&self) -> bool {
        self.inner.timeline.is_some()
    }

    /// Puts the caller's span `name` from `start_ns` to `end_ns` ([`now_ns`]) on the timeline's
    /// `compute` thread (forward, backward, optimizer, a layer...); nothing without a timeline. An end
    /// before the start is refused.
    pub fn timeline_event(&self, name: &str, start_ns: u64, end_ns: u64) -> Result<(), Error> {
        if end_ns < start_ns {
            return Err(Error::invalid(format!(
                "timeline event {name:?} ends ({end_ns} ns) before it starts ({start_ns} ns)"
            )));
        }
        if let Some(t) = &self.inner.timeline {
            t.push(Event {
                name: name.to_string(),
                cat: "compute",
                tid: COMPUTE_TID,
                start_ns,
                end_ns,
                args: Default::default(),
            });
        }
        Ok(())
    }

    /// A span of the caller's on the timeline, from now until the guard is dropped.
    pub fn timeline_span(&self, name: &str) -> TimelineSpan<'_> {
        TimelineSpan {
            comm: self,
            name: self.timeline_enabled().then(|| name.to_string()),
            start_ns: now_ns(),
        }
    }

    /// Writes the timeline's file now (it is written when the communicator is dropped too); returns its
    /// path, or `None` without a timeline.
    pub fn timeline_flush(&self) -> Result<Option<PathBuf>, Error> {
        self.inner.timeline.as_ref().map(|t| t.flush()).transpose()
    }
}

/// A caller's span on the timeline ([`crate::Communicator::timeline_span`]), ended when dropped.
pub struct TimelineSpan<'a> {
    comm: &'a crate::Communicator,
    name: Option<String>,
    start_ns: u64,
}

impl Drop for TimelineSpan<'_> {
    fn drop(&mut self) {
        if let Some(name) = self.name.take() {
            let _ = self.comm.timeline_event(&name, self.start_ns, now_ns());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_paths() {
        let p = |s: &str, r| rank_path(Path::new(s), r).to_string_lossy().into_owned();
        assert_eq!(p("/t/trace.json", 3), "/t/trace.rank3.json");
        assert_eq!(p("/t/trace-{rank}.json", 2), "/t/trace-2.json");
        assert_eq!(p("trace", 1), "trace.rank1");
    }

    #[test]
    fn the_trace_is_chrome_json_with_named_threads_and_complete_events() {
        let t = Timeline::new(Path::new("unused.json"), 2, 2);
        t.push(Event {
            name: "all_reduce".into(),
            cat: "collective",
            tid: 1,
            start_ns: 5_000,
            end_ns: 7_500,
            args: serde_json::Map::new(),
        });
        let j = t.to_json();
        let events = j["traceEvents"].as_array().unwrap();
        let x: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(x.len(), 1);
        assert_eq!(
            (x[0]["ts"].as_f64(), x[0]["dur"].as_f64()),
            (Some(5.0), Some(2.5))
        );
        assert_eq!(
            (x[0]["pid"].as_u64(), x[0]["tid"].as_u64()),
            (Some(2), Some(1))
        );
        let names: Vec<_> = events
            .iter()
            .filter(|e| e["name"] == "thread_name")
            .map(|e| e["args"]["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(names, ["compute", "stream 0", "stream 1"]);
        std::mem::forget(t); // no file
    }
}
