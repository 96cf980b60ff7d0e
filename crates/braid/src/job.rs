//! Where a rank learns its place in the job: braid's own variables, or those of the launchers clusters
//! already use (torchrun, Open MPI, PMI, Slurm).

use braid_core::Error;
use tracing::warn;

use crate::id::{parse_secret, resolve, UniqueId};

/// A rank's place in a job, read from the environment.
#[derive(Clone, Debug)]
pub struct JobEnv {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// The communicator id (root address and secret).
    pub id: UniqueId,
    /// Which launcher's variables were used.
    pub source: &'static str,
}

const RANK_VARS: [(&str, &str, &str); 5] = [
    ("BRAID_RANK", "BRAID_WORLD_SIZE", "braid"),
    ("RANK", "WORLD_SIZE", "torchrun"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"),
    ("PMI_RANK", "PMI_SIZE", "PMI"),
    ("SLURM_PROCID", "SLURM_NTASKS", "Slurm"),
];

fn num(name: &str, v: &str) -> Result<usize, Error> {
    v.trim()
        .parse()
        .map_err(|_| Error::invalid(format!("{name}={v:?} is not a non-negative integer")))
}

/// FNV-1a over 128 bits: a stable hash for deriving a secret from job identifiers.
fn fnv128(parts: &[String]) -> [u8; 16] {
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for p in parts {
        for b in p.bytes().chain([0u8]) {
            h ^= b as u128;
            h = h.wrapping_mul(0x0000000001000000000000000000013B);
        }
    }
    h.to_le_bytes()
}

impl JobEnv {
    /// Reads the process environment.
    pub fn detect() -> Result<JobEnv, Error> {
        JobEnv::from_lookup(|k| std::env::var(k).ok())
    }

    /// Whether the environment names a rank at all (so a tool can tell "one rank of a job" from "alone").
    pub fn present() -> bool {
        RANK_VARS
            .iter()
            .any(|(r, _, _)| std::env::var_os(r).is_some())
    }

    /// Reads `lookup` (a stand-in for the environment).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<JobEnv, Error> {
        let mut found = None;
        for (rv, wv, source) in RANK_VARS {
            match (lookup(rv), lookup(wv)) {
                (Some(r), Some(w)) => {
                    found = Some((num(rv, &r)?, num(wv, &w)?, source));
                    break;
                }
                (Some(_), None) => {
                    return Err(Error::invalid(format!("{rv} is set but {wv} is not")))
                }
                (None, Some(_)) => {
                    return Err(Error::invalid(format!("{wv} is set but {rv} is not")))
                }
                (None, None) => {}
            }
        }
        let (rank, world, source) = found.ok_or_else(|| {
            Error::invalid(
                "no rank in the environment: set BRAID_RANK and BRAID_WORLD_SIZE, or start under braid run, \
                 torchrun, mpirun or srun",
            )
        })?;
        if world == 0 || rank >= world {
            return Err(Error::invalid(format!(
                "rank {rank} is out of range for world size {world} ({source})"
            )));
        }
        let root = match (
            lookup("BRAID_ROOT"),
            lookup("MASTER_ADDR"),
            lookup("MASTER_PORT"),
        ) {
            (Some(r), _, _) => r,
            (None, Some(a), Some(p)) => format!("{a}:{p}"),
            _ => return Err(Error::invalid(
                "no bootstrap address: set BRAID_ROOT=host:port (or MASTER_ADDR and MASTER_PORT)",
            )),
        };
        let addr = resolve(&root)?;
        let secret = match lookup("BRAID_SECRET") {
            Some(s) => parse_secret(&s)
                .map_err(|_| Error::invalid("BRAID_SECRET must be 32 hexadecimal digits"))?,
            None => {
                // No secret given (torchrun, mpirun and srun do not make one): derive it from what every
                // rank of this job sees. That stops strays from other jobs, not an attacker.
                if rank == 0 {
                    warn!(target: "braid::security", "BRAID_SECRET is not set: the bootstrap secret is derived from job variables");
                }
                let ids = [
                    "TORCHELASTIC_RUN_ID",
                    "SLURM_JOB_ID",
                    "OMPI_MCA_ess_base_jobid",
                    "PMI_JOBID",
                ];
                let mut parts: Vec<String> =
                    ids.iter().map(|k| lookup(k).unwrap_or_default()).collect();
                parts.push(root.clone());
                parts.push(world.to_string());
                fnv128(&parts)
            }
        };
        Ok(JobEnv {
            rank,
            world,
            id: UniqueId::from_parts(addr, secret),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn reads_each_launcher() {
        let s = "00112233445566778899aabbccddeeff";
        let j = JobEnv::from_lookup(env(&[
            ("BRAID_RANK", "2"),
            ("BRAID_WORLD_SIZE", "4"),
            ("BRAID_ROOT", "127.0.0.1:2000"),
            ("BRAID_SECRET", s),
        ]))
        .unwrap();
        assert_eq!((j.rank, j.world, j.source), (2, 4, "braid"));
        assert_eq!(j.id.to_string(), format!("127.0.0.1:2000/{s}"));
        let t = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]);
        let j = JobEnv::from_lookup(&t).unwrap();
        assert_eq!(
            (j.rank, j.world, j.source, j.id.addr().port()),
            (1, 2, "torchrun", 29500)
        );
        // Two ranks of the same job derive the same secret.
        let t0 = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]);
        assert_eq!(JobEnv::from_lookup(&t0).unwrap().id, j.id);
        let o = env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("BRAID_ROOT", "127.0.0.1:1"),
        ]);
        assert_eq!(JobEnv::from_lookup(o).unwrap().source, "Open MPI");
        let s = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("BRAID_ROOT", "127.0.0.1:1"),
        ]);
        assert_eq!(JobEnv::from_lookup(s).unwrap().source, "Slurm");
    }

    #[test]
    fn bad_environments_say_what_is_wrong() {
        let cases: [(&[(&str, &str)], &str); 5] = [
            (&[], "no rank"),
            (&[("BRAID_RANK", "0")], "BRAID_WORLD_SIZE"),
            (
                &[
                    ("BRAID_RANK", "4"),
                    ("BRAID_WORLD_SIZE", "4"),
                    ("BRAID_ROOT", "127.0.0.1:1"),
                ],
                "out of range",
            ),
            (
                &[("BRAID_RANK", "0"), ("BRAID_WORLD_SIZE", "2")],
                "BRAID_ROOT",
            ),
            (
                &[
                    ("BRAID_RANK", "0"),
                    ("BRAID_WORLD_SIZE", "2"),
                    ("BRAID_ROOT", "127.0.0.1:1"),
                    ("BRAID_SECRET", "xyz"),
                ],
                "BRAID_SECRET",
            ),
        ];
        for (vars, want) in cases {
            let e = JobEnv::from_lookup(env(vars)).unwrap_err();
            assert!(e.to_string().contains(want), "{vars:?}: {e}");
        }
    }
}
