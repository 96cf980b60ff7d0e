//! The names of braid's collectives and algorithms, and which algorithms each collective has.
//!
//! These are the only name tables: the environment (`BRAID_ALGO`), tuning files, the CLI, logs, error
//! messages and flight records all print [`Collective::name`] and [`Algo::name`].

use std::fmt;
use std::str::FromStr;

use braid_core::Error;

/// A collective algorithm. The names are used everywhere: environment, CLI, logs, JSON.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Algo {
    /// Reduce-scatter then all-gather around a ring, pipelined in chunks (or a chain for rooted ops).
    Ring,
    /// Double binary tree (all-reduce) or binary tree (broadcast, reduce), pipelined.
    Tree,
    /// Recursive halving-doubling (Rabenseifner).
    Rhd,
    /// Every rank sends to every other rank at once.
    Direct,
    /// Hierarchical: reduce-scatter inside each host, all-reduce of each shard across hosts (every local
    /// rank drives its own shard), all-gather inside each host. On one host it is the ring.
    Hier,
}

impl Algo {
    /// Every algorithm.
    pub const ALL: [Algo; 5] = [Algo::Ring, Algo::Tree, Algo::Rhd, Algo::Direct, Algo::Hier];

    /// The algorithm's name.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::Tree => "tree",
            Algo::Rhd => "rhd",
            Algo::Direct => "direct",
            Algo::Hier => "hier",
        }
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algo {
    type Err = Error;
    fn from_str(s: &str) -> Result<Algo, Error> {
        Algo::ALL
            .into_iter()
            .find(|a| a.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "unknown algorithm {s:?} (ring, tree, rhd, direct, hier)"
                ))
            })
    }
}

/// A collective operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Collective {
    /// All-reduce.
    AllReduce,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-gather.
    AllGather,
    /// Broadcast from a root.
    Broadcast,
    /// Reduce to a root.
    Reduce,
    /// Barrier.
    Barrier,
    /// All-to-all.
    AllToAll,
}

impl Collective {
    /// Every collective, in the order of [`Collective::index`].
    pub const ALL: [Collective; 7] = [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::AllGather,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::Barrier,
        Collective::AllToAll,
    ];

    /// The collectives with a choice of algorithm (more than one in [`Collective::algos`]).
    pub const TUNABLE: [Collective; 5] = [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::AllGather,
        Collective::Broadcast,
        Collective::Reduce,
    ];

    /// Its name, in snake case: in `BRAID_ALGO`, tuning files, logs, errors and flight records.
    /// [`FromStr`] also accepts the names without separators or with dashes (`allreduce`,
    /// `all-reduce`), in any case.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllGather => "all_gather",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::Barrier => "barrier",
            Collective::AllToAll => "all_to_all",
        }
    }

    /// The algorithms implemented for it (barrier and all-to-all have only [`Algo::Direct`]).
    pub fn algos(self) -> &'static [Algo] {
        match self {
            Collective::AllReduce => &[Algo::Ring, Algo::Tree, Algo::Rhd, Algo::Direct, Algo::Hier],
            Collective::AllGather | Collective::ReduceScatter => &[Algo::Ring, Algo::Direct],
            Collective::Broadcast | Collective::Reduce => &[Algo::Ring, Algo::Tree],
            Collective::Barrier | Collective::AllToAll => &[Algo::Direct],
        }
    }

    /// Its position in [`Collective::ALL`] (`0..7`), for tables indexed by collective. It is also the
    /// collective's code in the fingerprints ranks compare under `BRAID_DEBUG_CHECKS`, so the order of
    /// [`Collective::ALL`] is part of that wire format.
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Collective {
    type Err = Error;
    /// Accepts [`Collective::name`] and the older spellings: `allreduce`, `all-reduce`, in any case.
    fn from_str(s: &str) -> Result<Collective, Error> {
        let squash = |t: &str| -> String {
            t.trim()
                .chars()
                .filter(|c| !matches!(c, '_' | '-'))
                .map(|c| c.to_ascii_lowercase())
                .collect()
        };
        let want = squash(s);
        Collective::ALL
            .into_iter()
            .find(|c| squash(c.name()) == want)
            .ok_or_else(|| {
                let names: Vec<&str> = Collective::ALL.iter().map(|c| c.name()).collect();
                Error::invalid(format!("unknown collective {s:?} ({})", names.join(", ")))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_old_spellings_parse() {
        for a in Algo::ALL {
            assert_eq!(a.name().parse::<Algo>().unwrap(), a);
            assert_eq!(a.to_string(), a.name());
        }
        assert_eq!(" RING ".parse::<Algo>().unwrap(), Algo::Ring);
        assert!("butterfly"
            .parse::<Algo>()
            .unwrap_err()
            .is_invalid_argument());
        for (i, c) in Collective::ALL.into_iter().enumerate() {
            assert_eq!(c.index(), i);
            assert_eq!(c.name().parse::<Collective>().unwrap(), c);
            assert_eq!(c.to_string(), c.name());
            assert_eq!(c.algos().len() > 1, Collective::TUNABLE.contains(&c));
            assert!(!c.algos().is_empty());
        }
        for (s, c) in [
            ("allreduce", Collective::AllReduce),
            ("all-reduce", Collective::AllReduce),
            ("All_Reduce", Collective::AllReduce),
            ("ALLREDUCE", Collective::AllReduce),
            ("reducescatter", Collective::ReduceScatter),
            ("allgather", Collective::AllGather),
            (" broadcast", Collective::Broadcast),
            ("alltoall", Collective::AllToAll),
            ("all-to-all", Collective::AllToAll),
            ("Barrier", Collective::Barrier),
        ] {
            assert_eq!(s.parse::<Collective>().unwrap(), c, "{s}");
        }
        for bad in ["", "everything", "all__reduce_x", "gather"] {
            let e = bad.parse::<Collective>().unwrap_err();
            assert!(
                e.is_invalid_argument() && e.to_string().contains("all_reduce"),
                "{bad}: {e}"
            );
        }
        assert_eq!(Collective::Barrier.algos(), &[Algo::Direct]);
        assert_eq!(Collective::AllToAll.algos(), &[Algo::Direct]);
    }
}
