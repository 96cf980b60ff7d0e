//! One entry point from (collective, algorithm, topology) to a rank's schedule.

use crate::{direct, hier, rhd, ring, tree, Action, Algo, Collective};

/// What to plan: one rank's part of one collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanSpec<'a> {
    /// The collective.
    pub collective: Collective,
    /// The root rank of broadcast and reduce (ignored by the others).
    pub root: usize,
    /// The algorithm. One the collective does not have ([`Collective::algos`]) runs its ring (the only
    /// one for barrier and all-to-all).
    pub algo: Algo,
    /// Number of ranks.
    pub world: usize,
    /// The rank planned for.
    pub rank: usize,
    /// Elements, in the collective's NCCL convention (all-reduce, broadcast, reduce: per buffer;
    /// reduce-scatter: output elements; all-gather: input elements; all-to-all: per peer).
    pub count: usize,
    /// Elements per message.
    pub chunk: usize,
    /// The ranks of each host. Empty or one host is a flat world of `world` ranks; with several, rings
    /// visit the hosts in turn ([`hier::host_order`]) and [`Algo::Hier`] is the hierarchical
    /// all-reduce.
    pub hosts: &'a [Vec<usize>],
    /// Rings of a flat ring all-reduce ([`ring::all_reduce_channels`]); `0` counts as one.
    pub channels: usize,
}

impl PlanSpec<'_> {
    /// Whether the ranks are spread over more than one host.
    pub fn multi_host(&self) -> bool {
        self.hosts.len() > 1
    }
}

/// The schedule of rank `spec.rank` for `spec`.
///
/// - All-reduce: [`Algo::Ring`] is the ring over the ranks host by host across several hosts, else
///   the flat ring on `spec.channels` rings; [`Algo::Hier`] is [`hier::all_reduce`] across several
///   hosts and the (single) ring on one; the others are [`tree`], [`rhd`] and [`direct`].
/// - Reduce-scatter and all-gather: [`Algo::Direct`], else the ring (host by host across hosts).
/// - Broadcast and reduce: [`Algo::Tree`], else the chain.
/// - Barrier and all-to-all: [`direct`], whatever `spec.algo`.
///
/// # Panics
///
/// As the schedule it builds: a rank or root outside the world, or a zero chunk where one is used.
pub fn plan(spec: &PlanSpec<'_>) -> Vec<Action> {
    let PlanSpec {
        collective,
        root,
        algo,
        world: n,
        rank: r,
        count: c,
        chunk,
        hosts,
        channels,
    } = *spec;
    let multi = spec.multi_host();
    match (collective, algo) {
        (Collective::AllReduce, Algo::Ring) if multi => {
            ring::all_reduce_ordered(&hier::host_order(hosts), r, c, chunk)
        }
        (Collective::AllReduce, Algo::Ring) => ring::all_reduce_channels(n, r, c, chunk, channels),
        (Collective::AllReduce, Algo::Hier) if multi => hier::all_reduce(hosts, r, c, chunk),
        (Collective::AllReduce, Algo::Hier) => ring::all_reduce(n, r, c, chunk),
        (Collective::AllReduce, Algo::Tree) => tree::all_reduce(n, r, c, chunk),
        (Collective::AllReduce, Algo::Rhd) => rhd::all_reduce(n, r, c, chunk),
        (Collective::AllReduce, Algo::Direct) => direct::all_reduce(n, r, c, chunk),
        (Collective::ReduceScatter, Algo::Direct) => direct::reduce_scatter(n, r, c, chunk),
        (Collective::ReduceScatter, _) if multi => {
            ring::reduce_scatter_ordered(&hier::host_order(hosts), r, c, chunk)
        }
        (Collective::ReduceScatter, _) => ring::reduce_scatter(n, r, c, chunk),
        (Collective::AllGather, Algo::Direct) => direct::all_gather(n, r, c, chunk),
        (Collective::AllGather, _) if multi => {
            ring::all_gather_ordered(&hier::host_order(hosts), r, c, chunk)
        }
        (Collective::AllGather, _) => ring::all_gather(n, r, c, chunk),
        (Collective::Broadcast, Algo::Tree) => tree::broadcast(n, r, root, c, chunk),
        (Collective::Broadcast, _) => ring::broadcast(n, r, root, c, chunk),
        (Collective::Reduce, Algo::Tree) => tree::reduce(n, r, root, c, chunk),
        (Collective::Reduce, _) => ring::reduce(n, r, root, c, chunk),
        (Collective::Barrier, _) => direct::barrier(n, r),
        (Collective::AllToAll, _) => direct::all_to_all(n, r, c, chunk),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(collective: Collective, algo: Algo, world: usize, rank: usize) -> PlanSpec<'static> {
        PlanSpec {
            collective,
            root: world - 1,
            algo,
            world,
            rank,
            count: 13,
            chunk: 4,
            hosts: &[],
            channels: 1,
        }
    }

    #[test]
    fn every_algorithm_of_every_collective_plans() {
        let two_hosts = [vec![0, 2], vec![1, 3, 4]];
        for world in [1, 2, 3, 5, 8] {
            for c in Collective::ALL {
                for &a in c.algos() {
                    for rank in 0..world {
                        let mut s = spec(c, a, world, rank);
                        let p = plan(&s);
                        if world > 1 || c != Collective::Barrier {
                            assert!(!p.is_empty(), "{c} {a} world {world} rank {rank}");
                        }
                        if world == 5 {
                            s.hosts = &two_hosts;
                            plan(&s);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn hier_on_one_host_is_the_ring_and_ring_takes_the_channels() {
        let one_host = [vec![0, 1, 2, 3]];
        for rank in 0..4 {
            let mut s = spec(Collective::AllReduce, Algo::Hier, 4, rank);
            let ring = ring::all_reduce(4, rank, s.count, s.chunk);
            assert_eq!(plan(&s), ring);
            s.hosts = &one_host;
            s.channels = 3;
            assert_eq!(plan(&s), ring);
            s.algo = Algo::Ring;
            assert_eq!(plan(&s), ring::all_reduce_channels(4, rank, 13, 4, 3));
            assert_ne!(plan(&s), ring);
        }
    }

    #[test]
    fn across_hosts_rings_go_host_by_host_and_hier_is_hierarchical() {
        let hosts = [vec![0, 2], vec![1, 3]];
        let order = hier::host_order(&hosts);
        for rank in 0..4 {
            let mut s = spec(Collective::AllReduce, Algo::Ring, 4, rank);
            s.hosts = &hosts;
            s.channels = 2;
            assert_eq!(plan(&s), ring::all_reduce_ordered(&order, rank, 13, 4));
            s.algo = Algo::Hier;
            assert_eq!(plan(&s), hier::all_reduce(&hosts, rank, 13, 4));
            s.algo = Algo::Tree;
            assert_eq!(plan(&s), tree::all_reduce(4, rank, 13, 4));
            s.collective = Collective::AllGather;
            assert_eq!(plan(&s), ring::all_gather_ordered(&order, rank, 13, 4));
            s.algo = Algo::Direct;
            assert_eq!(plan(&s), direct::all_gather(4, rank, 13, 4));
        }
    }
}
