//! Host inference from measurements, for clouds that hide which ranks share a machine.
//!
//! Ranks of one host reach each other through memory, which is an order of magnitude faster than any
//! network; so among the ranks a given rank measured, its same-host peers are the ones before the first
//! large jump in the sorted row ([`GapRule::First`], the default), or before the widest one
//! ([`GapRule::Widest`], for rows whose same-host part is itself spread by a busy machine). Working row by row (rather than with one global threshold) keeps the
//! method right when hosts differ in speed: a slow host's internal latency may exceed a fast host's, but
//! within one row it is still far below the network. The steps:
//!
//! 1. symmetrize: the geometric mean of both directions (a NaN entry marks a direction not measured);
//! 2. per rank, sort the others by the metric (in log scale) and take those before the first ratio of
//!    at least [`ProbeOptions::gap_factor`] (or before the widest such ratio, see [`GapRule`]) as its
//!    near set; a row without such a jump is *alike* when
//!    it spans less than the factor (all peers near) and *unclear* otherwise (no peer near: keeping a
//!    rank apart only costs speed, grouping it wrongly would break shared memory);
//! 3. with both metrics, a rank's near set is what the metrics that show a jump agree on; optional
//!    absolute limits remove pairs no host could be that slow inside;
//! 4. ranks that are in each other's near sets are joined, and the connected components are the hosts.
//!
//! The result carries a confidence in `[0, 1]` and a sentence saying what the decision rests on.
//! Relative measures cannot tell one host from several identical hosts: a world in which every pair
//! looks alike is reported as one host unless an absolute limit says otherwise.

use crate::error::{Error, Result};
use crate::model::{Link, LinkClass, Source, Topology};

/// The default [`ProbeOptions::gap_factor`]: same-host peers must be at least twice as close as the
/// nearest rank on another host, while measurements of one kind of link may vary by less than that.
pub const DEFAULT_GAP_FACTOR: f64 = 2.0;

/// Which jump in a rank's sorted row separates its host from the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GapRule {
    /// The first jump of at least the gap factor: right when other hosts sit at several distances
    /// (racks, switches), wrong when measurements inside a host spread by more than the factor.
    #[default]
    First,
    /// The widest jump, if at least the gap factor: right when measurements inside a host spread (a busy
    /// machine), wrong when distances to other hosts differ by more than the step to the network.
    Widest,
}

/// How [`infer_hosts`] decides.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeOptions {
    /// Which jump counts (default [`GapRule::First`]).
    pub rule: GapRule,
    /// The ratio (> 1) between consecutive sorted measurements that separates same-host peers from the rest.
    pub gap_factor: f64,
    /// One-way latency in seconds above which two ranks are never on one host.
    pub max_same_host_latency: Option<f64>,
    /// Bandwidth in bytes per second below which two ranks are never on one host.
    pub min_same_host_bandwidth: Option<f64>,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions {
            rule: GapRule::First,
            gap_factor: DEFAULT_GAP_FACTOR,
            max_same_host_latency: None,
            min_same_host_bandwidth: None,
        }
    }
}

/// What [`infer_hosts`] concluded.
#[derive(Debug, Clone, PartialEq)]
pub struct Inference {
    /// The ranks of each inferred host, ascending; hosts ordered by their lowest rank.
    pub groups: Vec<Vec<usize>>,
    /// How sure the grouping is, from 0 (a guess) to 1 (clear-cut).
    pub confidence: f64,
    /// What the decision rests on, in one or two sentences.
    pub reason: String,
}

impl Inference {
    /// The inferred topology: one host per group (named `host0`, `host1`, ...), source [`Source::Probed`].
    /// Fails only if `groups` was changed into something that does not partition the ranks.
    pub fn topology(&self) -> Result<Topology> {
        Topology::from_groups(&self.groups, Source::Probed)
    }
}

/// A measured metric, symmetrized, as a log-scale distance (lower is closer).
struct Metric {
    name: &'static str,
    dist: Vec<Vec<f64>>,
    /// Pairs farther than this are never on one host.
    limit: Option<f64>,
}

enum Row {
    /// The ranks before the chosen jump.
    Gap(Vec<usize>),
    /// No jump, and the row spans less than the factor.
    Alike,
    /// No jump, but the row spans more than the factor.
    Unclear,
}

/// Infers which ranks share a host from an `n × n` matrix of one-way latencies (seconds) and/or of
/// bandwidths (bytes per second) measured between ranks: entry `[i][j]` is what rank `i` measured
/// towards rank `j`. The diagonal is ignored; NaN marks a direction not measured; every other entry must
/// be positive and finite. See the module documentation for the method.
pub fn infer_hosts(
    latency: Option<&[Vec<f64>]>,
    bandwidth: Option<&[Vec<f64>]>,
    options: &ProbeOptions,
) -> Result<Inference> {
    infer(latency, bandwidth, options).map(|(inference, _)| inference)
}

/// [`infer_hosts`], and the topology it implies with the measurements kept: one [`Link`] per pair of
/// ranks, holding the symmetrized latency and/or bandwidth, of class [`LinkClass::Shm`] inside a host and
/// [`LinkClass::Tcp`] between hosts (probing cannot tell which network carries the bytes).
pub fn infer_topology(
    latency: Option<&[Vec<f64>]>,
    bandwidth: Option<&[Vec<f64>]>,
    options: &ProbeOptions,
) -> Result<(Topology, Inference)> {
    let (inference, metrics) = infer(latency, bandwidth, options)?;
    let mut topology = inference.topology()?;
    let measured = |name: &str| metrics.iter().find(|m| m.name == name);
    let (lat, bw) = (measured("latency"), measured("bandwidth"));
    let n = topology.world_size();
    for i in 0..n {
        for j in i + 1..n {
            topology.links.push(Link {
                ranks: [i, j],
                class: if topology.same_host(i, j) {
                    LinkClass::Shm
                } else {
                    LinkClass::Tcp
                },
                latency: lat.map(|m| m.dist[i][j].exp()),
                bandwidth: bw.map(|m| (-m.dist[i][j]).exp()),
            });
        }
    }
    topology.validate()?;
    Ok((topology, inference))
}

fn infer(
    latency: Option<&[Vec<f64>]>,
    bandwidth: Option<&[Vec<f64>]>,
    options: &ProbeOptions,
) -> Result<(Inference, Vec<Metric>)> {
    let f = options.gap_factor;
    if !(f.is_finite() && f > 1.0) {
        return Err(Error::Probe {
            metric: "probe",
            reason: format!("gap factor {f} must be a finite number above 1"),
        });
    }
    let limit = |name: &'static str, v: Option<f64>| -> Result<Option<f64>> {
        match v {
            Some(x) if !(x.is_finite() && x > 0.0) => Err(Error::Probe {
                metric: name,
                reason: format!("same-host limit {x} must be positive and finite"),
            }),
            other => Ok(other),
        }
    };
    let mut metrics = Vec::new();
    if let Some(m) = latency {
        let lim = limit("latency", options.max_same_host_latency)?;
        metrics.push(Metric {
            name: "latency",
            dist: symmetrize("latency", m, |x| x.ln())?,
            limit: lim.map(f64::ln),
        });
    }
    if let Some(m) = bandwidth {
        let lim = limit("bandwidth", options.min_same_host_bandwidth)?;
        metrics.push(Metric {
            name: "bandwidth",
            dist: symmetrize("bandwidth", m, |x| -x.ln())?,
            limit: lim.map(|x| -x.ln()),
        });
    }
    if metrics.is_empty() {
        return Err(Error::Probe {
            metric: "probe",
            reason: "neither latency nor bandwidth was given".into(),
        });
    }
    let n = metrics[0].dist.len();
    if let Some(m) = metrics.iter().find(|m| m.dist.len() != n) {
        return Err(Error::Probe {
            metric: m.name,
            reason: format!("has {} ranks but the latency matrix has {n}", m.dist.len()),
        });
    }
    if n == 1 {
        let inference = Inference {
            groups: vec![vec![0]],
            confidence: 1.0,
            reason: "one rank: one host".into(),
        };
        return Ok((inference, metrics));
    }
    let gap = f.ln();

    // Near sets, row by row.
    let mut near = vec![vec![false; n]; n];
    let mut unclear = Vec::new();
    let mut disagree = Vec::new();
    let mut limited = false;
    let mut all_alike = true;
    for (i, near_i) in near.iter_mut().enumerate() {
        let rows: Vec<Row> = metrics
            .iter()
            .map(|m| classify(&m.dist, i, gap, options.rule))
            .collect();
        // The near set of each metric that shows a jump, as a membership mask.
        let masks: Vec<Vec<bool>> = rows
            .iter()
            .filter_map(|r| match r {
                Row::Gap(set) => {
                    let mut mask = vec![false; n];
                    set.iter().for_each(|&j| mask[j] = true);
                    Some(mask)
                }
                _ => None,
            })
            .collect();
        all_alike &= rows.iter().all(|r| matches!(r, Row::Alike));
        if let Some(first) = masks.first() {
            for (j, slot) in near_i.iter_mut().enumerate() {
                *slot = masks.iter().all(|m| m[j]);
            }
            if masks.iter().any(|m| m != first) {
                disagree.push(i);
            }
        } else if rows.iter().any(|r| matches!(r, Row::Unclear)) {
            unclear.push(i);
        } else {
            (0..n).filter(|&j| j != i).for_each(|j| near_i[j] = true);
        }
        for m in &metrics {
            if let Some(lim) = m.limit {
                for j in (0..n).filter(|&j| j != i) {
                    if m.dist[i][j] > lim {
                        limited |= near_i[j];
                        near_i[j] = false;
                    }
                }
            }
        }
    }

    // Mutual nearness joins ranks; components are hosts.
    let mut parent: Vec<usize> = (0..n).collect();
    fn find(p: &mut [usize], mut x: usize) -> usize {
        while p[x] != x {
            p[x] = p[p[x]];
            x = p[x];
        }
        x
    }
    for (i, j) in (0..n).flat_map(|i| (i + 1..n).map(move |j| (i, j))) {
        if near[i][j] && near[j][i] {
            let (a, b) = (find(&mut parent, i), find(&mut parent, j));
            parent[a.max(b)] = a.min(b);
        }
    }
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut slot = vec![usize::MAX; n];
    for i in 0..n {
        let root = find(&mut parent, i);
        if slot[root] == usize::MAX {
            slot[root] = groups.len();
            groups.push(Vec::new());
        }
        groups[slot[root]].push(i);
    }
    let group_of: Vec<usize> = (0..n).map(|i| slot[find(&mut parent, i)]).collect();

    // Joined through others but not near each other: the grouping is not a clean clique.
    let mut chained = None;
    'outer: for g in &groups {
        for (x, &i) in g.iter().enumerate() {
            for &j in &g[x + 1..] {
                if !(near[i][j] && near[j][i]) {
                    chained = Some((i, j));
                    break 'outer;
                }
            }
        }
    }

    let (mut confidence, mut reason) = if groups.len() == 1 {
        let spread = metrics
            .iter()
            .map(|m| format!("{} spread {:.1}×", m.name, spread(&m.dist).exp()))
            .collect::<Vec<_>>()
            .join(", ");
        let limits_given = metrics.iter().any(|m| m.limit.is_some());
        if all_alike && limits_given {
            (0.9, format!("all {n} ranks look alike ({spread}) and are within the same-host limit: one host"))
        } else if all_alike {
            (
                0.5,
                format!(
                    "all {n} ranks look alike ({spread}, below the {f}× gap factor): one host assumed; \
                     identical separate hosts would look the same (a same-host limit tells them apart)"
                ),
            )
        } else {
            (
                0.6,
                format!("all {n} ranks are joined through their nearest peers: one host"),
            )
        }
    } else if groups.iter().all(|g| g.len() == 1) {
        if limited || (all_alike && metrics.iter().any(|m| m.limit.is_some())) {
            (0.9, format!("no pair of the {n} ranks is within the same-host limit: every rank on its own host"))
        } else if !unclear.is_empty() {
            (
                0.2,
                format!(
                    "no clear gap between the {n} ranks' measurements: every rank kept on its own host \
                     (the safe choice)"
                ),
            )
        } else {
            (0.5, format!("no two of the {n} ranks see each other as nearest peers: every rank on its own host"))
        }
    } else {
        // The smallest margin, over ranks with same-host peers, between the farthest peer and the
        // nearest rank elsewhere (each rank judged by its clearest metric).
        let mut margin = f64::INFINITY;
        let mut by = "";
        for i in 0..n {
            let g = group_of[i];
            if groups[g].len() < 2 {
                continue;
            }
            let (best, name) = metrics
                .iter()
                .map(|m| {
                    let inside = (0..n)
                        .filter(|&j| j != i && group_of[j] == g)
                        .map(|j| m.dist[i][j]);
                    let outside = (0..n).filter(|&j| group_of[j] != g).map(|j| m.dist[i][j]);
                    (
                        outside.fold(f64::INFINITY, f64::min)
                            - inside.fold(f64::NEG_INFINITY, f64::max),
                        m.name,
                    )
                })
                .fold(
                    (f64::NEG_INFINITY, ""),
                    |a, b| if b.0 > a.0 { b } else { a },
                );
            if best < margin {
                margin = best;
                by = name;
            }
        }
        let sizes = groups
            .iter()
            .map(|g| g.len().to_string())
            .collect::<Vec<_>>()
            .join("+");
        (
            (margin / (2.0 * gap)).clamp(0.0, 1.0),
            format!(
                "{} hosts ({sizes} ranks): same-host peers are at least {:.1}× closer than any other rank \
                 ({by})",
                groups.len(),
                margin.exp()
            ),
        )
    };
    if let Some((i, j)) = chained {
        confidence *= 0.3;
        reason.push_str(&format!(
            "; ranks {i} and {j} were grouped through other ranks but do not look like peers of each other"
        ));
    }
    if !unclear.is_empty() && groups.iter().any(|g| g.len() > 1) {
        confidence *= 0.5;
        reason.push_str(&format!(
            "; rank(s) {} showed no clear gap and were kept apart",
            join(&unclear)
        ));
    }
    if !disagree.is_empty() {
        confidence *= 0.7;
        reason.push_str(&format!(
            "; latency and bandwidth disagree for rank(s) {}, only peers both show were grouped",
            join(&disagree)
        ));
    }
    Ok((
        Inference {
            groups,
            confidence,
            reason,
        },
        metrics,
    ))
}

fn join(ranks: &[usize]) -> String {
    crate::cpulist::format_ranges(ranks.iter().map(|&r| r as u64))
}

/// Checks a measurement matrix and returns its symmetrized log-distance form.
fn symmetrize(
    name: &'static str,
    m: &[Vec<f64>],
    to_dist: fn(f64) -> f64,
) -> Result<Vec<Vec<f64>>> {
    let n = m.len();
    if n == 0 {
        return Err(Error::Probe {
            metric: name,
            reason: "is empty".into(),
        });
    }
    if let Some((i, row)) = m.iter().enumerate().find(|(_, r)| r.len() != n) {
        return Err(Error::Probe {
            metric: name,
            reason: format!("row {i} has {} entries, expected {n}", row.len()),
        });
    }
    let mut d = vec![vec![0.0; n]; n];
    for (i, row) in m.iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
            if i != j && !v.is_nan() && !(v.is_finite() && v > 0.0) {
                return Err(Error::Probe {
                    metric: name,
                    reason: format!(
                        "{name}[{i}][{j}] = {v} is not a positive, finite measurement (NaN marks one not taken)"
                    ),
                });
            }
        }
    }
    for i in 0..n {
        for j in i + 1..n {
            let both: Vec<f64> = [m[i][j], m[j][i]]
                .into_iter()
                .filter(|v| !v.is_nan())
                .map(to_dist)
                .collect();
            if both.is_empty() {
                return Err(Error::Probe {
                    metric: name,
                    reason: format!("{name}[{i}][{j}] and {name}[{j}][{i}] are both missing"),
                });
            }
            let s = both.iter().sum::<f64>() / both.len() as f64;
            d[i][j] = s;
            d[j][i] = s;
        }
    }
    Ok(d)
}

fn classify(dist: &[Vec<f64>], i: usize, gap: f64, rule: GapRule) -> Row {
    let mut others: Vec<(f64, usize)> = dist[i]
        .iter()
        .enumerate()
        .filter(|&(j, _)| j != i)
        .map(|(j, &v)| (v, j))
        .collect();
    others.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let jumps = others.windows(2).map(|w| w[1].0 - w[0].0).enumerate();
    let cut = match rule {
        GapRule::First => jumps.clone().find(|&(_, d)| d >= gap),
        GapRule::Widest => jumps
            .clone()
            .filter(|&(_, d)| d >= gap)
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0))),
    };
    if let Some((k, _)) = cut {
        return Row::Gap(others[..=k].iter().map(|&(_, j)| j).collect());
    }
    match (others.first(), others.last()) {
        (Some(a), Some(b)) if b.0 - a.0 >= gap => Row::Unclear,
        _ => Row::Alike,
    }
}

fn spread(dist: &[Vec<f64>]) -> f64 {
    let vals = dist.iter().enumerate().flat_map(|(i, r)| {
        r.iter()
            .enumerate()
            .filter(move |&(j, _)| j > i)
            .map(|(_, &v)| v)
    });
    let (lo, hi) = vals.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if lo.is_finite() {
        hi - lo
    } else {
        0.0
    }
}
