//! `braid timeline`: what `BRAID_TIMELINE` files say. A table per rank (busy time of every stream and of
//! the caller's compute spans, and how much communication overlapped compute), optionally the ranks'
//! files merged into one trace, and a picture: one row per rank and thread, time across.

use std::collections::BTreeMap;

use plotters::prelude::*;
use serde_json::Value;

/// One complete event of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub pid: u64,
    pub tid: u64,
    pub name: String,
    pub cat: String,
    /// Microseconds.
    pub ts: f64,
    pub dur: f64,
}

/// Thread names by (pid, tid).
pub type Names = BTreeMap<(u64, u64), String>;
/// Intervals, microseconds.
type Intervals = Vec<(f64, f64)>;

/// The thread id of the caller's spans (as braid writes them).
const COMPUTE_TID: u64 = 1000;

/// The complete events and thread names of a trace's JSON.
pub fn parse(text: &str, what: &str) -> Result<(Vec<Span>, Names), String> {
    let j: Value = serde_json::from_str(text).map_err(|e| format!("{what}: not JSON: {e}"))?;
    let events = j["traceEvents"]
        .as_array()
        .or_else(|| j.as_array())
        .ok_or_else(|| format!("{what}: no traceEvents array"))?;
    let (mut spans, mut names) = (Vec::new(), BTreeMap::new());
    for e in events {
        let (pid, tid) = (
            e["pid"].as_u64().unwrap_or(0),
            e["tid"].as_u64().unwrap_or(0),
        );
        match e["ph"].as_str() {
            Some("X") => spans.push(Span {
                pid,
                tid,
                name: e["name"].as_str().unwrap_or("?").to_string(),
                cat: e["cat"].as_str().unwrap_or("").to_string(),
                ts: e["ts"]
                    .as_f64()
                    .ok_or_else(|| format!("{what}: an event without ts"))?,
                dur: e["dur"].as_f64().unwrap_or(0.0).max(0.0),
            }),
            Some("M") if e["name"] == "thread_name" => {
                if let Some(n) = e["args"]["name"].as_str() {
                    names.insert((pid, tid), n.to_string());
                }
            }
            _ => {}
        }
    }
    Ok((spans, names))
}

/// The union of intervals, sorted and disjoint. Pure.
pub fn union(mut iv: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    iv.retain(|(a, b)| b > a);
    iv.sort_by(|x, y| x.0.total_cmp(&y.0));
    let mut out: Vec<(f64, f64)> = Vec::new();
    for (a, b) in iv {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// Total length of sorted disjoint intervals. Pure.
pub fn length(iv: &[(f64, f64)]) -> f64 {
    iv.iter().map(|(a, b)| b - a).sum()
}

/// Length of the intersection of two unions (sorted, disjoint). Pure.
pub fn overlap(x: &[(f64, f64)], y: &[(f64, f64)]) -> f64 {
    let (mut i, mut j, mut total) = (0, 0, 0.0);
    while i < x.len() && j < y.len() {
        let (a, b) = (x[i].0.max(y[j].0), x[i].1.min(y[j].1));
        if b > a {
            total += b - a;
        }
        if x[i].1 < y[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    total
}

/// Per rank: (span of the trace, compute busy, communication busy, their overlap), microseconds.
pub fn summary(spans: &[Span]) -> BTreeMap<u64, (f64, f64, f64, f64)> {
    let mut ranks: BTreeMap<u64, (Intervals, Intervals, f64, f64)> = BTreeMap::new();
    for s in spans {
        let r = ranks
            .entry(s.pid)
            .or_insert_with(|| (Vec::new(), Vec::new(), f64::MAX, f64::MIN));
        r.2 = r.2.min(s.ts);
        r.3 = r.3.max(s.ts + s.dur);
        if s.tid == COMPUTE_TID {
            r.0.push((s.ts, s.ts + s.dur));
        } else if s.cat != "queue" {
            r.1.push((s.ts, s.ts + s.dur));
        }
    }
    ranks
        .into_iter()
        .map(|(pid, (compute, comm, first, last))| {
            let (c, m) = (union(compute), union(comm));
            (pid, (last - first, length(&c), length(&m), overlap(&c, &m)))
        })
        .collect()
}

/// The colour of an event: compute green, queued grey, collectives by name.
fn colour(s: &Span) -> RGBColor {
    match (s.tid, s.cat.as_str(), s.name.as_str()) {
        (COMPUTE_TID, _, _) => RGBColor(76, 160, 90),
        (_, "queue", _) => RGBColor(200, 200, 200),
        (_, _, "all_reduce") => RGBColor(52, 101, 164),
        (_, _, "broadcast") => RGBColor(204, 121, 32),
        (_, _, "all_gather") => RGBColor(117, 80, 123),
        (_, _, "reduce_scatter") => RGBColor(193, 67, 67),
        _ => RGBColor(120, 120, 60),
    }
}

/// Draws the spans: a row per (rank, thread), compute first; time in milliseconds from the first event.
pub fn draw(path: &str, spans: &[Span], names: &Names, width: u32) -> Result<(), String> {
    crate::plot::load_font()?;
    if spans.is_empty() {
        return Err("no events to draw".into());
    }
    let mut rows: Vec<(u64, u64)> = spans.iter().map(|s| (s.pid, s.tid)).collect();
    // Compute above the streams of its rank.
    rows.sort_by_key(|&(p, t)| (p, if t == COMPUTE_TID { 0 } else { t + 1 }));
    rows.dedup();
    let t0 = spans.iter().map(|s| s.ts).fold(f64::MAX, f64::min);
    let t1 = spans.iter().map(|s| s.ts + s.dur).fold(f64::MIN, f64::max);
    let ms = |us: f64| (us - t0) / 1000.0;
    let height = 90 + 34 * rows.len() as u32;
    let root = BitMapBackend::new(path, (width.max(400), height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let labels: Vec<String> = rows
        .iter()
        .map(|&(p, t)| {
            let thread = names
                .get(&(p, t))
                .cloned()
                .unwrap_or_else(|| format!("tid {t}"));
            format!("rank {p} {thread}")
        })
        .collect();
    let n = rows.len() as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption("braid timeline", ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(150)
        .build_cartesian_2d(0f64..ms(t1).max(1e-3), 0f64..n)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc("time (ms)")
        .y_labels(rows.len() * 2 + 1)
        .y_label_formatter(&|y| {
            let i = (n - y - 0.5).round();
            if (n - y - 0.5 - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
                labels[i as usize].clone()
            } else {
                String::new()
            }
        })
        .draw()
        .map_err(|e| e.to_string())?;
    let row_of: BTreeMap<(u64, u64), usize> =
        rows.iter().enumerate().map(|(i, r)| (*r, i)).collect();
    // Waiting in a stream's queue is a thin bar under the collectives, which are drawn over it.
    let mut order: Vec<&Span> = spans.iter().collect();
    order.sort_by_key(|s| s.cat != "queue");
    chart
        .draw_series(order.into_iter().map(|s| {
            let i = row_of[&(s.pid, s.tid)] as f64;
            let (y0, y1) = if s.cat == "queue" {
                (n - i - 0.6, n - i - 0.4)
            } else {
                (n - i - 0.9, n - i - 0.1)
            };
            let x1 = ms(s.ts + s.dur).max(ms(s.ts) + (ms(t1) / width as f64));
            Rectangle::new([(ms(s.ts), y0), (x1, y1)], colour(s).filled())
        }))
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

/// `braid timeline FILES... [--merge OUT] [--png OUT]`.
pub fn run(
    files: &[String],
    merge: Option<&str>,
    png: Option<&str>,
    width: u32,
) -> Result<(), String> {
    if files.is_empty() {
        return Err("no timeline files given (BRAID_TIMELINE writes one per rank)".into());
    }
    let (mut spans, mut names) = (Vec::new(), BTreeMap::new());
    let mut raw = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{f}: {e}"))?;
        let (s, n) = parse(&text, f)?;
        spans.extend(s);
        names.extend(n);
        let j: Value = serde_json::from_str(&text).map_err(|e| format!("{f}: {e}"))?;
        if let Some(events) = j["traceEvents"].as_array() {
            raw.extend(events.iter().cloned());
        }
    }
    println!(
        "{:>5} {:>12} {:>12} {:>12} {:>12} {:>9}",
        "rank", "span ms", "compute ms", "comm ms", "overlap ms", "overlap"
    );
    for (rank, (span, compute, comm, both)) in summary(&spans) {
        let shorter = compute.min(comm);
        let share = if shorter > 0.0 {
            format!("{:.0}%", 100.0 * both / shorter)
        } else {
            "-".into()
        };
        println!(
            "{rank:>5} {:>12.3} {:>12.3} {:>12.3} {:>12.3} {share:>9}",
            span / 1e3,
            compute / 1e3,
            comm / 1e3,
            both / 1e3
        );
    }
    println!("(overlap: the time communication ran during the caller's spans, as a share of the shorter of the two)");
    if let Some(out) = merge {
        let text =
            serde_json::to_vec(&serde_json::json!({"traceEvents": raw, "displayTimeUnit": "ms"}))
                .map_err(|e| e.to_string())?;
        std::fs::write(out, text).map_err(|e| format!("{out}: {e}"))?;
        println!("merged trace: {out}");
    }
    if let Some(out) = png {
        draw(out, &spans, &names, width)?;
        println!("picture: {out}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unions_and_overlaps() {
        let u = union(vec![(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (9.0, 9.0)]);
        assert_eq!(u, vec![(0.0, 3.0), (5.0, 7.0)]);
        assert_eq!(length(&u), 5.0);
        let v = union(vec![(2.0, 6.0)]);
        assert_eq!(overlap(&u, &v), 2.0);
        assert_eq!(overlap(&v, &u), 2.0);
        assert_eq!(overlap(&u, &[]), 0.0);
    }

    #[test]
    fn summary_per_rank_ignores_the_queue() {
        let s = |pid, tid, cat: &str, ts, dur| Span {
            pid,
            tid,
            name: "x".into(),
            cat: cat.into(),
            ts,
            dur,
        };
        let spans = vec![
            s(0, COMPUTE_TID, "compute", 0.0, 10.0),
            s(0, 1, "collective", 5.0, 10.0),
            s(0, 1, "queue", 0.0, 5.0),
            s(1, 0, "collective", 100.0, 1.0),
        ];
        let m = summary(&spans);
        assert_eq!(m[&0], (15.0, 10.0, 10.0, 5.0));
        assert_eq!(m[&1], (1.0, 0.0, 1.0, 0.0));
    }

    #[test]
    fn parses_braids_trace_and_refuses_other_text() {
        let text = r#"{"traceEvents":[{"ph":"M","name":"thread_name","pid":0,"tid":1000,"args":{"name":"compute"}},
            {"ph":"X","name":"all_reduce","cat":"collective","pid":0,"tid":1,"ts":1.5,"dur":2.0,"args":{}}]}"#;
        let (spans, names) = parse(text, "t").unwrap();
        assert_eq!(spans.len(), 1);
        assert_eq!((spans[0].ts, spans[0].dur, spans[0].tid), (1.5, 2.0, 1));
        assert_eq!(names[&(0, 1000)], "compute");
        assert!(parse("{}", "t").unwrap_err().contains("no traceEvents"));
        assert!(parse("nope", "t").unwrap_err().contains("not JSON"));
    }
}
