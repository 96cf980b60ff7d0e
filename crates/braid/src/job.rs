//! Where a rank learns its place in the job: braid's own variables, or those of the launchers clusters
//! already use (torchrun, Open MPI, PMI, Slurm).

use crate::id::{resolve, UniqueId};
use braid_core::Error;

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
            // Under torchrun (TORCHELASTIC_RUN_ID) its agent's store holds MASTER_PORT: braid's root
            // takes the port after it.
            (None, Some(a), Some(p)) if lookup("TORCHELASTIC_RUN_ID").is_some() => {
                let next = num("MASTER_PORT", &p)?
                    .checked_add(1)
                    .filter(|q| *q <= usize::from(u16::MAX))
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "MASTER_PORT={p}: braid's root takes the port after torchrun's store, and there is none"
                        ))
                    })?;
                format!("{a}:{next}")
            }
            (None, Some(a), Some(p)) => format!("{a}:{p}"),
            _ => return Err(Error::invalid(
                "no bootstrap address: set BRAID_ROOT=host:port (or MASTER_ADDR and MASTER_PORT)",
            )),
        };
        let addr = resolve(&root)?;
        let secret = crate::secret::job_secret(&lookup, addr, &root, world)?;
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

    /// A home directory for the host-local secret of jobs on loopback.
    fn home() -> &'static str {
        let d = std::env::temp_dir().join(format!("braid-job-home-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d.to_str().unwrap().to_string().leak()
    }

    #[test]
    fn reads_each_launcher() {
        let s = "00112233445566778899aabbccddeeff";
        let h = home();
        let j = JobEnv::from_lookup(env(&[
            ("BRAID_RANK", "2"),
            ("BRAID_WORLD_SIZE", "4"),
            ("BRAID_ROOT", "127.0.0.1:2000"),
            ("BRAID_SECRET", s),
        ]))
        .unwrap();
        assert_eq!((j.rank, j.world, j.source), (2, 4, "braid"));
        assert_eq!(j.id.to_string(), format!("127.0.0.1:2000/{s}"));
        let t_vars = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("HOME", h),
        ];
        let t = env(&t_vars);
        let j = JobEnv::from_lookup(&t).unwrap();
        assert_eq!(
            (j.rank, j.world, j.source, j.id.addr().port()),
            (1, 2, "torchrun", 29500)
        );
        // Two ranks of the same job derive the same secret.
        let t0_vars = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("HOME", h),
        ];
        let t0 = env(&t0_vars);
        assert_eq!(JobEnv::from_lookup(&t0).unwrap().id, j.id);
        // Under torchrun its store holds MASTER_PORT: braid's root is the port after it.
        let te_vars = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "none"),
            ("HOME", h),
        ];
        let te = JobEnv::from_lookup(env(&te_vars)).unwrap();
        assert_eq!(te.id.addr().port(), 29501);
        let top_vars = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "65535"),
            ("TORCHELASTIC_RUN_ID", "none"),
            ("HOME", h),
        ];
        let err = JobEnv::from_lookup(env(&top_vars)).unwrap_err().to_string();
        assert!(err.contains("MASTER_PORT=65535"), "{err}");
        let o_vars = [
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("BRAID_ROOT", "127.0.0.1:1"),
            ("HOME", h),
        ];
        let o = env(&o_vars);
        assert_eq!(JobEnv::from_lookup(o).unwrap().source, "Open MPI");
        let s_vars = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("BRAID_ROOT", "127.0.0.1:1"),
            ("HOME", h),
        ];
        let s = env(&s_vars);
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
