//! Host inference from synthetic measurements: exact recovery on random worlds, and the unclear cases.

mod common;

use braid_topo::{infer_hosts, infer_topology, Error, GapRule, LinkClass, ProbeOptions, Source};
use common::Rng;
use proptest::prelude::*;

/// A world: the host of each rank, ranks shuffled so that hosts are not contiguous.
#[derive(Debug, Clone)]
struct World {
    host_of: Vec<usize>,
    hosts: usize,
}

impl World {
    fn expected_groups(&self) -> Vec<Vec<usize>> {
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); self.hosts];
        for (r, &h) in self.host_of.iter().enumerate() {
            groups[h].push(r);
        }
        groups.retain(|g| !g.is_empty());
        groups.sort();
        groups
    }

    /// A matrix with one base value per host (inside) and per pair of hosts (between), each entry
    /// (both directions independently) times a noise factor in [1 - noise, 1 + noise).
    fn matrix(&self, seed: u64, intra: (f64, f64), inter: (f64, f64), noise: f64) -> Vec<Vec<f64>> {
        let mut rng = Rng::new(seed);
        let h = self.hosts;
        let inside: Vec<f64> = (0..h).map(|_| rng.uniform(intra.0, intra.1)).collect();
        let mut between = vec![vec![0.0; h]; h];
        for (a, b) in pairs(h) {
            let v = rng.uniform(inter.0, inter.1);
            between[a][b] = v;
            between[b][a] = v;
        }
        let host_of = &self.host_of;
        host_of
            .iter()
            .enumerate()
            .map(|(i, &a)| {
                host_of
                    .iter()
                    .enumerate()
                    .map(|(j, &b)| {
                        let base = if a == b { inside[a] } else { between[a][b] };
                        if i == j {
                            f64::NAN
                        } else {
                            base * rng.uniform(1.0 - noise, 1.0 + noise)
                        }
                    })
                    .collect()
            })
            .collect()
    }
}

/// 1..=6 hosts of 1..=5 ranks each, ranks shuffled. With `max_singletons`, at most that many hosts
/// run one rank (relative measures cannot tell two lone ranks apart from one host).
fn world(max_singletons: usize) -> impl Strategy<Value = World> {
    prop::collection::vec(1usize..=5, 1..=6)
        .prop_filter("too many one-rank hosts", move |sizes| {
            sizes.iter().filter(|&&s| s == 1).count() <= max_singletons
        })
        .prop_flat_map(|sizes| {
            let labels: Vec<usize> = sizes
                .iter()
                .enumerate()
                .flat_map(|(h, &s)| std::iter::repeat_n(h, s))
                .collect();
            let hosts = sizes.len();
            Just(labels)
                .prop_shuffle()
                .prop_map(move |host_of| World { host_of, hosts })
        })
}

/// The pairs `(i, j)` with `i < j < n`.
fn pairs(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n).flat_map(move |i| (i + 1..n).map(move |j| (i, j)))
}

const US: f64 = 1e-6;
const GB: f64 = 1e9;
const LAT_INTRA: (f64, f64) = (0.5 * US, 2.0 * US);
const LAT_INTER: (f64, f64) = (20.0 * US, 200.0 * US);
const BW_INTRA: (f64, f64) = (5.0 * GB, 20.0 * GB);
const BW_INTER: (f64, f64) = (0.1 * GB, 1.2 * GB);
const NOISE: f64 = 0.3;

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn latency_alone_recovers_the_hosts(w in world(1), seed in any::<u64>()) {
        let lat = w.matrix(seed, LAT_INTRA, LAT_INTER, NOISE);
        let inf = infer_hosts(Some(&lat), None, &ProbeOptions::default()).unwrap();
        prop_assert_eq!(&inf.groups, &w.expected_groups(), "{}", inf.reason);
        prop_assert!(inf.confidence > 0.0 && inf.confidence <= 1.0, "{} {}", inf.confidence, inf.reason);
        prop_assert!(!inf.reason.is_empty());
        let topo = inf.topology().unwrap();
        prop_assert_eq!(topo.source, Source::Probed);
        for (r, &h) in w.host_of.iter().enumerate() {
            for (s, &g) in w.host_of.iter().enumerate() {
                prop_assert_eq!(topo.same_host(r, s), h == g);
            }
        }
    }

    #[test]
    fn bandwidth_alone_recovers_the_hosts(w in world(1), seed in any::<u64>()) {
        let bw = w.matrix(seed, BW_INTRA, BW_INTER, NOISE);
        let inf = infer_hosts(None, Some(&bw), &ProbeOptions::default()).unwrap();
        prop_assert_eq!(&inf.groups, &w.expected_groups(), "{}", inf.reason);
        prop_assert!(inf.confidence > 0.0, "{}", inf.reason);
    }

    #[test]
    fn both_metrics_recover_the_hosts(w in world(1), seed in any::<u64>()) {
        let lat = w.matrix(seed, LAT_INTRA, LAT_INTER, NOISE);
        let bw = w.matrix(seed ^ 0x5555, BW_INTRA, BW_INTER, NOISE);
        let inf = infer_hosts(Some(&lat), Some(&bw), &ProbeOptions::default()).unwrap();
        prop_assert_eq!(&inf.groups, &w.expected_groups(), "{}", inf.reason);
        let (topo, again) = infer_topology(Some(&lat), Some(&bw), &ProbeOptions::default()).unwrap();
        prop_assert_eq!(again, inf);
        let n = w.host_of.len();
        prop_assert_eq!(topo.links.len(), n * (n - 1) / 2);
        for link in &topo.links {
            let [a, b] = link.ranks;
            let same = w.host_of[a] == w.host_of[b];
            prop_assert_eq!(link.class, if same { LinkClass::Shm } else { LinkClass::Tcp });
            let (lat_ab, bw_ab) = (link.latency.unwrap(), link.bandwidth.unwrap());
            let (lo, hi) = if same { LAT_INTRA } else { LAT_INTER };
            prop_assert!(lat_ab >= lo * (1.0 - NOISE) && lat_ab <= hi * (1.0 + NOISE), "{}", lat_ab);
            let (lo, hi) = if same { BW_INTRA } else { BW_INTER };
            prop_assert!(bw_ab >= lo * (1.0 - NOISE) && bw_ab <= hi * (1.0 + NOISE), "{}", bw_ab);
        }
    }

    #[test]
    fn absolute_limits_recover_any_world(w in world(6), seed in any::<u64>(), use_latency in any::<bool>()) {
        let options = ProbeOptions {
            max_same_host_latency: Some(8.0 * US),
            min_same_host_bandwidth: Some(2.5 * GB),
            ..ProbeOptions::default()
        };
        let inf = if use_latency {
            infer_hosts(Some(&w.matrix(seed, LAT_INTRA, LAT_INTER, NOISE)), None, &options)
        } else {
            infer_hosts(None, Some(&w.matrix(seed, BW_INTRA, BW_INTER, NOISE)), &options)
        }
        .unwrap();
        prop_assert_eq!(&inf.groups, &w.expected_groups(), "{}", inf.reason);
    }
}

fn uniform(n: usize, v: f64) -> Vec<Vec<f64>> {
    (0..n)
        .map(|i| (0..n).map(|j| if i == j { 0.0 } else { v }).collect())
        .collect()
}

#[test]
fn all_pairs_alike_is_one_host_unless_a_limit_says_otherwise() {
    let lat = uniform(4, 50.0 * US);
    let inf = infer_hosts(Some(&lat), None, &ProbeOptions::default()).unwrap();
    assert_eq!(inf.groups, vec![vec![0, 1, 2, 3]]);
    assert!(
        inf.reason.contains("look alike") && inf.reason.contains("same-host limit"),
        "{}",
        inf.reason
    );
    assert!(inf.confidence <= 0.5, "{}", inf.confidence);

    let options = ProbeOptions {
        max_same_host_latency: Some(10.0 * US),
        ..ProbeOptions::default()
    };
    let inf = infer_hosts(Some(&lat), None, &options).unwrap();
    assert_eq!(inf.groups, vec![vec![0], vec![1], vec![2], vec![3]]);
    assert!(
        inf.reason.contains("within the same-host limit"),
        "{}",
        inf.reason
    );

    let inf = infer_hosts(Some(&uniform(3, 1.0 * US)), None, &options).unwrap();
    assert_eq!(inf.groups, vec![vec![0, 1, 2]]);
    assert!(inf.confidence > 0.5, "{} {}", inf.confidence, inf.reason);
}

#[test]
fn a_gradual_spread_keeps_ranks_apart_with_low_confidence() {
    // Every pair differs from the next by less than the gap factor, but they span 30×.
    let n = 4;
    let mut lat = vec![vec![0.0; n]; n];
    let mut v = 1.0 * US;
    for (i, j) in pairs(n) {
        lat[i][j] = v;
        lat[j][i] = v;
        v *= 1.9;
    }
    let inf = infer_hosts(Some(&lat), None, &ProbeOptions::default()).unwrap();
    assert_eq!(inf.groups.len(), n, "{:?} {}", inf.groups, inf.reason);
    assert!(
        inf.confidence < 0.5 && inf.reason.contains("no clear gap"),
        "{} {}",
        inf.confidence,
        inf.reason
    );
}

#[test]
fn one_direction_may_be_missing_and_asymmetry_is_averaged() {
    let nan = f64::NAN;
    let lat = vec![
        vec![nan, 1.0 * US, 80.0 * US, 90.0 * US],
        vec![nan, nan, 70.0 * US, nan],
        vec![nan, 60.0 * US, nan, 0.5 * US],
        vec![85.0 * US, 95.0 * US, 2.0 * US, nan],
    ];
    let inf = infer_hosts(Some(&lat), None, &ProbeOptions::default()).unwrap();
    assert_eq!(inf.groups, vec![vec![0, 1], vec![2, 3]], "{}", inf.reason);
    assert!(inf.reason.contains("2 hosts (2+2 ranks)"), "{}", inf.reason);
    assert!(inf.confidence > 0.9, "{}", inf.confidence);

    // The measurements are kept as links: symmetrized, one per pair, shm inside a host.
    let (topo, again) = infer_topology(Some(&lat), None, &ProbeOptions::default()).unwrap();
    assert_eq!(again, inf);
    assert_eq!(topo.links.len(), 6);
    let latency = |a, b| topo.link(a, b).and_then(|l| l.latency).unwrap() / US;
    let close = |x: f64, y: f64| (x - y).abs() < 1e-9 * y;
    assert!(close(latency(0, 1), 1.0), "{}", latency(0, 1)); // one direction only
    assert!(close(latency(3, 2), 1.0), "{}", latency(3, 2)); // sqrt(0.5 * 2)
    assert!(
        close(latency(2, 1), (70.0f64 * 60.0).sqrt()),
        "{}",
        latency(2, 1)
    );
    assert!(topo.links.iter().all(|l| l.bandwidth.is_none()));
    assert_eq!(topo.default_class(0, 1), Some(LinkClass::Shm));
    assert_eq!(topo.default_class(1, 2), Some(LinkClass::Tcp));
}

#[test]
fn ranks_joined_only_through_a_third_lower_the_confidence() {
    // 0~1 and 1~2 look like peers, 0 and 2 do not.
    let lat = vec![
        vec![0.0, 1.0 * US, 9.0 * US, 100.0 * US],
        vec![1.0 * US, 0.0, 1.2 * US, 100.0 * US],
        vec![9.0 * US, 1.2 * US, 0.0, 100.0 * US],
        vec![100.0 * US, 100.0 * US, 100.0 * US, 0.0],
    ];
    let mut clique = lat.clone();
    clique[0][2] = 1.1 * US;
    clique[2][0] = 1.1 * US;
    let clean = infer_hosts(Some(&clique), None, &ProbeOptions::default()).unwrap();
    assert_eq!(
        clean.groups,
        vec![vec![0, 1, 2], vec![3]],
        "{}",
        clean.reason
    );
    assert!(
        !clean.reason.contains("grouped through"),
        "{}",
        clean.reason
    );
    let inf = infer_hosts(Some(&lat), None, &ProbeOptions::default()).unwrap();
    assert_eq!(inf.groups, vec![vec![0, 1, 2], vec![3]], "{}", inf.reason);
    assert!(inf.reason.contains("ranks 0 and 2"), "{}", inf.reason);
    assert!(
        inf.confidence <= clean.confidence * 0.3 + 1e-12,
        "{} vs {}",
        inf.confidence,
        clean.confidence
    );
}

#[test]
fn metrics_that_disagree_group_only_what_both_show() {
    let lat = vec![
        vec![0.0, 1.0 * US, 1.0 * US, 50.0 * US],
        vec![1.0 * US, 0.0, 1.0 * US, 50.0 * US],
        vec![1.0 * US, 1.0 * US, 0.0, 50.0 * US],
        vec![50.0 * US, 50.0 * US, 50.0 * US, 0.0],
    ];
    // Bandwidth puts rank 2 apart from 0 and 1.
    let bw = vec![
        vec![0.0, 10.0 * GB, 0.5 * GB, 0.5 * GB],
        vec![10.0 * GB, 0.0, 0.5 * GB, 0.5 * GB],
        vec![0.5 * GB, 0.5 * GB, 0.0, 0.5 * GB],
        vec![0.5 * GB, 0.5 * GB, 0.5 * GB, 0.0],
    ];
    let inf = infer_hosts(Some(&lat), Some(&bw), &ProbeOptions::default()).unwrap();
    assert_eq!(
        inf.groups,
        vec![vec![0, 1], vec![2], vec![3]],
        "{}",
        inf.reason
    );
    assert!(inf.reason.contains("disagree"), "{}", inf.reason);
}

#[test]
fn one_rank_is_one_host() {
    let inf = infer_hosts(Some(&[vec![f64::NAN]]), None, &ProbeOptions::default()).unwrap();
    assert_eq!((inf.groups, inf.confidence), (vec![vec![0]], 1.0));
}

fn probe_err(
    lat: Option<&[Vec<f64>]>,
    bw: Option<&[Vec<f64>]>,
    options: &ProbeOptions,
    needle: &str,
) {
    let err = infer_hosts(lat, bw, options).unwrap_err();
    assert!(matches!(err, Error::Probe { .. }), "{err:?}");
    assert!(
        err.to_string().contains(needle),
        "expected {needle:?} in: {err}"
    );
}

#[test]
fn bad_measurements_are_named() {
    let d = ProbeOptions::default();
    let mut lat = uniform(3, 1.0 * US);
    probe_err(None, None, &d, "neither latency nor bandwidth");
    probe_err(Some(&[]), None, &d, "latency matrix: is empty");
    probe_err(
        Some(&lat[..2]),
        None,
        &d,
        "latency matrix: row 0 has 3 entries, expected 2",
    );
    probe_err(
        Some(&lat),
        Some(&uniform(2, GB)),
        &d,
        "bandwidth matrix: has 2 ranks but the latency matrix has 3",
    );
    lat[1][2] = -1.0;
    probe_err(
        Some(&lat),
        None,
        &d,
        "latency[1][2] = -1 is not a positive, finite measurement",
    );
    lat[1][2] = f64::INFINITY;
    probe_err(Some(&lat), None, &d, "latency[1][2] = inf");
    lat[1][2] = f64::NAN;
    lat[2][1] = f64::NAN;
    probe_err(
        Some(&lat),
        None,
        &d,
        "latency[1][2] and latency[2][1] are both missing",
    );
    let mut bw = uniform(3, GB);
    bw[0][1] = 0.0;
    probe_err(None, Some(&bw), &d, "bandwidth[0][1] = 0");
    let lat = uniform(3, 1.0 * US);
    probe_err(
        Some(&lat),
        None,
        &ProbeOptions {
            gap_factor: 1.0,
            ..d.clone()
        },
        "gap factor 1 must be",
    );
    probe_err(
        Some(&lat),
        None,
        &ProbeOptions {
            gap_factor: f64::NAN,
            ..d.clone()
        },
        "gap factor NaN",
    );
    let bad_limit = ProbeOptions {
        max_same_host_latency: Some(-1.0),
        ..d
    };
    probe_err(
        Some(&lat),
        None,
        &bad_limit,
        "latency matrix: same-host limit -1",
    );
}

#[test]
fn a_large_world_is_recovered() {
    // 64 hosts of 8 ranks, ranks dealt out in a scrambled order.
    let (hosts, per_host) = (64, 8);
    let mut rng = Rng::new(7);
    let mut host_of: Vec<usize> = (0..hosts * per_host).map(|r| r % hosts).collect();
    for i in (1..host_of.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        host_of.swap(i, j);
    }
    let w = World { host_of, hosts };
    let lat = w.matrix(11, LAT_INTRA, LAT_INTER, NOISE);
    let bw = w.matrix(12, BW_INTRA, BW_INTER, NOISE);
    let inf = infer_hosts(Some(&lat), Some(&bw), &ProbeOptions::default()).unwrap();
    assert_eq!(inf.groups, w.expected_groups(), "{}", inf.reason);
    assert!(inf.reason.starts_with("64 hosts (8+8+"), "{}", inf.reason);
    assert!(inf.topology().unwrap().is_uniform());
}

#[test]
fn the_widest_rule_keeps_a_spread_host_together() {
    // Bandwidths measured on a busy machine: inside host {1, 3, 5} they spread over 7×; every link
    // to the other host runs at about 35 MB/s.
    const MB: f64 = 1e6;
    let mut bw = vec![vec![35.0 * MB; 6]; 6];
    for (a, b, v) in [
        (1, 3, 300.0),
        (3, 5, 1800.0),
        (1, 5, 520.0),
        (0, 2, 600.0),
        (2, 4, 700.0),
        (0, 4, 650.0),
    ] {
        bw[a][b] = v * MB;
        bw[b][a] = v * MB;
    }
    let first = infer_hosts(None, Some(&bw), &ProbeOptions::default()).unwrap();
    let widest = infer_hosts(
        None,
        Some(&bw),
        &ProbeOptions {
            rule: GapRule::Widest,
            ..ProbeOptions::default()
        },
    )
    .unwrap();
    assert_eq!(
        widest.groups,
        vec![vec![0, 2, 4], vec![1, 3, 5]],
        "{}",
        widest.reason
    );
    assert_ne!(first.groups, widest.groups, "{}", first.reason);
    assert!(
        widest.confidence > first.confidence,
        "{} vs {}",
        widest.confidence,
        first.confidence
    );
}
