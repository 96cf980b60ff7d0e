//! What `braid perf` reports: the measured cells and rows, the JSON report, the printed table's headers
//! and per-algorithm rows, and the series it plots.

use braid::{Algo, DType};
use serde::Serialize;

use super::bound::Bound;

#[derive(Serialize, Clone, Copy, Default)]
pub(super) struct Cell {
    pub(super) time_us: f64,
    pub(super) algbw: f64,
    pub(super) busbw: f64,
    pub(super) wrong: u64,
}

#[derive(Serialize)]
pub(super) struct Row {
    pub(super) size: usize,
    pub(super) count: usize,
    pub(super) algo: &'static str,
    pub(super) oop: Cell,
    /// Absent for a collective without an in-place form (all-to-all).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) ip: Option<Cell>,
}

#[derive(Serialize)]
pub(super) struct Report {
    pub(super) tool: &'static str,
    pub(super) collective: &'static str,
    /// The root of a rooted collective.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) root: Option<usize>,
    pub(super) ranks: usize,
    pub(super) dtype: String,
    pub(super) op: String,
    pub(super) iters: usize,
    pub(super) warmup: usize,
    pub(super) results: Vec<Row>,
    pub(super) algos: Vec<AlgoRow>,
    pub(super) membw: Vec<Bound>,
}

#[derive(Serialize)]
pub(super) struct AlgoRow {
    pub(super) size: usize,
    pub(super) count: usize,
    pub(super) pick: &'static str,
    pub(super) best: &'static str,
    pub(super) algos: std::collections::BTreeMap<&'static str, Cell>,
}

/// The median of `v` (sorted in place).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Busbw series per algorithm (or the single measured line), for plotting.
pub(super) fn report_series(r: &Report) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut out: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    if !r.results.is_empty() {
        out.push((
            "braid".into(),
            r.results
                .iter()
                .map(|x| (x.size as f64, x.oop.busbw))
                .collect(),
        ));
    }
    if let Some(first) = r.algos.first() {
        for name in first.algos.keys() {
            let pts = r
                .algos
                .iter()
                .filter_map(|x| x.algos.get(name).map(|c| (x.size as f64, c.busbw)))
                .collect();
            out.push((name.to_string(), pts));
        }
        out.push((
            "tuner pick".into(),
            r.algos
                .iter()
                .map(|x| (x.size as f64, x.algos[x.pick].busbw))
                .collect(),
        ));
    }
    out.push((
        "memory bound".into(),
        r.membw
            .iter()
            .filter(|b| b.busbw > 0.0)
            .map(|b| (b.size as f64, b.busbw))
            .collect(),
    ));
    out
}

pub(super) fn print_header() {
    println!("#");
    println!("# {:>10} {:>12} {:>8} {:>6} {:>6} | {:>10} {:>8} {:>8} {:>6} | {:>10} {:>8} {:>8} {:>6} | {:>8} {:>6}",
        "", "", "", "", "", "out-of-place", "", "", "", "in-place", "", "", "", "bound", "");
    println!("# {:>10} {:>12} {:>8} {:>6} {:>6} | {:>10} {:>8} {:>8} {:>6} | {:>10} {:>8} {:>8} {:>6} | {:>8} {:>6}",
        "size", "count", "type", "redop", "algo", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "busbw", "%bound");
    println!("# {:>10} {:>12} {:>8} {:>6} {:>6} | {:>10} {:>8} {:>8} {:>6} | {:>10} {:>8} {:>8} {:>6} | {:>8} {:>6}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "(GB/s)", "");
}

pub(super) fn print_algo_header(candidates: &[Algo]) {
    println!("# out-of-place busbw (GB/s) per algorithm; * marks the fastest, < the tuner's pick");
    let names: Vec<String> = candidates
        .iter()
        .map(|a| format!("{:>10}", a.name()))
        .collect();
    println!(
        "# {:>10} {:>12} {:>8} {:>6} | {} | {:>6} {:>6} {:>9} {:>8}",
        "size",
        "count",
        "type",
        "redop",
        names.join(" "),
        "pick",
        "best",
        "pick/best",
        "bound"
    );
}

#[allow(clippy::too_many_arguments)]
pub(super) fn print_algo_row(
    bytes: usize,
    count: usize,
    dtype: DType,
    op: &str,
    cells: &std::collections::BTreeMap<&'static str, Cell>,
    pick: &str,
    best: &str,
    bound: f64,
    candidates: &[Algo],
) {
    let cols: Vec<String> = candidates
        .iter()
        .map(|a| {
            let c = cells[a.name()];
            let mark = match (a.name() == best, a.name() == pick) {
                (true, true) => "*<",
                (true, false) => "* ",
                (false, true) => " <",
                _ => "  ",
            };
            format!("{:>8.2}{mark}", c.busbw)
        })
        .collect();
    // The pick may be outside the measured list; then there is no ratio to show.
    let ratio = cells
        .get(pick)
        .map_or(f64::NAN, |p| cells[best].time_us / p.time_us);
    println!(
        "  {:>10} {:>12} {:>8} {:>6} | {} | {:>6} {:>6} {:>8.0}% {:>8.2}",
        bytes,
        count,
        dtype.name(),
        op,
        cols.join(" "),
        pick,
        best,
        100.0 * ratio,
        bound
    );
}
