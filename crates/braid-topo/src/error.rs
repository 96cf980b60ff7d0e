//! The error type: every variant names the field, rank, file or matrix entry that was wrong.

use std::path::PathBuf;

/// Everything that can go wrong when reading, checking or inferring a topology.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A topology file could not be read.
    #[error("cannot read topology file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A topology file could not be written.
    #[error("cannot write topology file {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The text is not JSON, or not the shape of the topology format.
    #[error("topology JSON, line {line} column {column}: {message}")]
    Parse {
        /// Line of the problem (1-based; 0 when unknown).
        line: usize,
        /// Column of the problem (1-based; 0 when unknown).
        column: usize,
        /// What the parser expected or found.
        message: String,
    },
    /// The file's `version` is not one this build reads.
    #[error(
        "topology file version {found} is not supported (this build reads version {supported})"
    )]
    UnsupportedVersion {
        /// The version in the file.
        found: u64,
        /// The version this build reads.
        supported: u64,
    },
    /// The same rank is placed twice.
    #[error("rank {rank} is listed twice (ranks[{first}] and ranks[{second}])")]
    DuplicateRank {
        /// The rank.
        rank: usize,
        /// Index of its first entry in `ranks`.
        first: usize,
        /// Index of its second entry in `ranks`.
        second: usize,
    },
    /// Some ranks of the world have no place.
    #[error(
        "world of {world_size} ranks: no place given for rank(s) {}",
        list(missing)
    )]
    MissingRanks {
        /// The number of ranks the topology must describe.
        world_size: usize,
        /// The ranks without a place (ascending).
        missing: Vec<usize>,
    },
    /// A rank number is not below the world size.
    #[error("rank {rank} is out of range for a world of {world_size} ranks")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// A rank is placed on a host the topology does not list.
    #[error("rank {rank} is placed on host {host}, which is not among the {hosts} listed host(s)")]
    UnknownHost {
        /// The rank.
        rank: usize,
        /// The host as written: a name in quotes or an index.
        host: String,
        /// How many hosts are listed.
        hosts: usize,
    },
    /// Two hosts have the same name.
    #[error("host name {name:?} is used by hosts[{first}] and hosts[{second}]")]
    DuplicateHost {
        /// The name.
        name: String,
        /// Index of the first host with it.
        first: usize,
        /// Index of the second host with it.
        second: usize,
    },
    /// A field holds a value outside its domain.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field, as a path into the file format (`links[2].bandwidth`, `hosts[0].name`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An environment variable holds something unusable.
    #[error("{var}: {reason}")]
    Env {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A measurement matrix given to [`infer_hosts`](crate::infer_hosts) cannot be used.
    #[error("{metric} matrix: {reason}")]
    Probe {
        /// `latency` or `bandwidth` (or `probe` for options).
        metric: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

fn list(ranks: &[usize]) -> String {
    const SHOWN: usize = 16;
    let mut s = crate::cpulist::format_ranges(ranks.iter().take(SHOWN).map(|&r| r as u64));
    if ranks.len() > SHOWN {
        s.push_str(&format!(" and {} more", ranks.len() - SHOWN));
    }
    s
}
