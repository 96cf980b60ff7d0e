//! The secret a job's ranks authenticate each other with, when the launcher did not hand one out.
//!
//! A communicator accepts only peers that present its secret. `braid run` generates one and passes it
//! to its children; other launchers (torchrun, mpirun, srun) make none, and everything they do pass
//! (root address, world size, job ids) is public. So, in order:
//!
//! 1. `BRAID_SECRET` (32 hex digits), given to every rank;
//! 2. `BRAID_SECRET_FILE`, a file holding one, that only its owner can read (on a shared home
//!    directory it serves every host of a cluster);
//! 3. for a job on one host (its root address is a loopback address, so every rank is on this host),
//!    a host-local key in a file only this user can read, created on first use, mixed with the job's
//!    identity so that every job gets its own secret;
//! 4. otherwise the communicator refuses to start, saying how to set one.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use braid_core::Error;
use sha2::{Digest, Sha256};

use crate::id::{format_secret, parse_secret, random_secret};

/// Job identifiers launchers export: they tell two jobs of one user on one host apart.
const JOB_IDS: [&str; 4] = [
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "OMPI_MCA_ess_base_jobid",
    "PMI_JOBID",
];

/// A secret file is one line; anything longer is not one.
const MAX_SECRET_FILE: u64 = 4096;

/// The secret of the job whose root is `addr` (written `root`) and which has `world` ranks, from the
/// environment `lookup` reads.
pub(crate) fn job_secret(
    lookup: &dyn Fn(&str) -> Option<String>,
    addr: SocketAddr,
    root: &str,
    world: usize,
) -> Result<[u8; 16], Error> {
    if let Some(s) = lookup("BRAID_SECRET") {
        return parse_secret(&s)
            .map_err(|_| Error::invalid("BRAID_SECRET must be 32 hexadecimal digits"));
    }
    if let Some(p) = lookup("BRAID_SECRET_FILE") {
        return read_secret_file(Path::new(&p), "BRAID_SECRET_FILE");
    }
    if !addr.ip().is_loopback() {
        return Err(Error::invalid(format!(
            "no secret for a job that may span hosts (its root {addr} is not a loopback address): \
             give every rank the same BRAID_SECRET (32 hex digits; `braid secret` prints a fresh one) \
             or BRAID_SECRET_FILE (a file only its owner can read), or start the job with braid run, \
             which makes one"
        )));
    }
    let key = host_key(lookup)?;
    let mut h = Sha256::new();
    h.update(b"braid job secret v1\0");
    h.update(key);
    let mut part = |s: &str| {
        h.update((s.len() as u64).to_le_bytes());
        h.update(s.as_bytes());
    };
    part(root);
    part(&world.to_string());
    for k in JOB_IDS {
        part(&lookup(k).unwrap_or_default());
    }
    let digest = h.finalize();
    let mut out = [0u8; 16];
    out.copy_from_slice(&digest[..16]);
    Ok(out)
}

/// Where this user's host-local key lives: `$XDG_RUNTIME_DIR/braid`, else `$HOME/.cache/braid`.
fn key_dir(lookup: &dyn Fn(&str) -> Option<String>) -> Result<PathBuf, Error> {
    if let Some(d) = lookup("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return Ok(Path::new(&d).join("braid"));
    }
    if let Some(h) = lookup("HOME").filter(|h| !h.is_empty()) {
        return Ok(Path::new(&h).join(".cache").join("braid"));
    }
    Err(Error::invalid(
        "no secret and nowhere to keep a host-local one (neither XDG_RUNTIME_DIR nor HOME is set): \
         set BRAID_SECRET or BRAID_SECRET_FILE",
    ))
}

/// This user's host-local key, created (readable by the user alone) if there is none yet. Ranks that
/// start at once agree: the key appears under its name complete, by a hard link, and only once.
fn host_key(lookup: &dyn Fn(&str) -> Option<String>) -> Result<[u8; 16], Error> {
    let dir = key_dir(lookup)?;
    let path = dir.join("host-secret");
    let io = |what: &str, p: &Path, e: std::io::Error| {
        Error::invalid(format!(
            "the host-local secret: {what} {}: {e} (or set BRAID_SECRET)",
            p.display()
        ))
    };
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|e| io("creating", &dir, e))?;
    if !path.exists() {
        // A name of its own per attempt: ranks may be threads of one process.
        let nonce = format_secret(&random_secret()?);
        let tmp = dir.join(format!("host-secret.{}.tmp", &nonce[..12]));
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| io("creating", &tmp, e))?;
        let written = f
            .write_all(format!("{}\n", format_secret(&random_secret()?)).as_bytes())
            .and_then(|()| f.sync_all());
        drop(f);
        let linked = written.and_then(|()| fs::hard_link(&tmp, &path));
        let _ = fs::remove_file(&tmp);
        match linked {
            Ok(()) => {}
            // Another rank made it first: use theirs.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("creating", &path, e)),
        }
    }
    read_secret_file(&path, "the host-local secret")
}

/// The effective user id of this process.
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Reads a secret from `path`: a regular file of this user that nobody else can read or write,
/// holding 32 hex digits. `what` names it in errors.
fn read_secret_file(path: &Path, what: &str) -> Result<[u8; 16], Error> {
    let bad = |why: String| Error::invalid(format!("{what} {}: {why}", path.display()));
    let f = File::open(path).map_err(|e| bad(e.to_string()))?;
    let m = f.metadata().map_err(|e| bad(e.to_string()))?;
    if !m.file_type().is_file() {
        return Err(bad("not a regular file".into()));
    }
    if m.uid() != euid() {
        return Err(bad(format!(
            "owned by uid {}, not by this user (uid {})",
            m.uid(),
            euid()
        )));
    }
    if m.mode() & 0o077 != 0 {
        return Err(bad(format!(
            "mode {:o} lets other users read or change it (chmod 600 it)",
            m.mode() & 0o777
        )));
    }
    if m.len() > MAX_SECRET_FILE {
        return Err(bad(format!("{} bytes is not a secret", m.len())));
    }
    let mut text = String::new();
    f.take(MAX_SECRET_FILE)
        .read_to_string(&mut text)
        .map_err(|e| bad(e.to_string()))?;
    parse_secret(text.trim()).map_err(|_| bad("does not hold 32 hexadecimal digits".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("braid-secret-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn env(pairs: Vec<(&'static str, String)>) -> impl Fn(&str) -> Option<String> {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
    }

    fn local() -> SocketAddr {
        "127.0.0.1:29500".parse().unwrap()
    }

    #[test]
    fn a_job_that_may_span_hosts_needs_a_secret() {
        let remote: SocketAddr = "10.1.2.3:29500".parse().unwrap();
        let e = job_secret(&env(vec![]), remote, "10.1.2.3:29500", 2).unwrap_err();
        assert!(e.is_invalid_argument(), "{e}");
        let m = e.to_string();
        assert!(m.contains("BRAID_SECRET") && m.contains("10.1.2.3"), "{m}");
    }

    #[test]
    fn a_one_host_job_gets_a_host_local_secret_no_outsider_can_compute() {
        let home = tmpdir("home");
        let lookup = env(vec![("HOME", home.to_str().unwrap().to_string())]);
        let a = job_secret(&lookup, local(), "127.0.0.1:29500", 2).unwrap();
        // Every rank of the job (same user, same host) derives the same secret.
        assert_eq!(
            job_secret(&lookup, local(), "127.0.0.1:29500", 2).unwrap(),
            a
        );
        // The key is the user's alone.
        let key = home.join(".cache/braid/host-secret");
        let mode = fs::metadata(&key).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "mode {mode:o}");
        // Another job of the same user gets another secret.
        assert_ne!(
            job_secret(&lookup, local(), "127.0.0.1:29501", 2).unwrap(),
            a
        );
        // Someone with every public value but another key (another user) gets another secret.
        let other = tmpdir("other");
        let outsider = env(vec![("HOME", other.to_str().unwrap().to_string())]);
        assert_ne!(
            job_secret(&outsider, local(), "127.0.0.1:29500", 2).unwrap(),
            a
        );
        fs::remove_dir_all(&home).unwrap();
        fs::remove_dir_all(&other).unwrap();
    }

    #[test]
    fn ranks_starting_at_once_agree_on_the_host_key() {
        let home = tmpdir("race");
        let h = home.to_str().unwrap().to_string();
        let secrets: Vec<[u8; 16]> = std::thread::scope(|s| {
            let ts: Vec<_> = (0..8)
                .map(|_| {
                    let h = h.clone();
                    s.spawn(move || {
                        job_secret(&env(vec![("HOME", h)]), local(), "127.0.0.1:1", 8).unwrap()
                    })
                })
                .collect();
            ts.into_iter().map(|t| t.join().unwrap()).collect()
        });
        assert!(secrets.iter().all(|s| *s == secrets[0]));
        fs::remove_dir_all(&home).unwrap();
    }

    #[test]
    fn a_secret_file_must_be_private_and_hold_a_secret() {
        let d = tmpdir("file");
        let f = d.join("s");
        let s = "00112233445566778899aabbccddeeff";
        fs::write(&f, format!("{s}\n")).unwrap();
        let lookup = env(vec![("BRAID_SECRET_FILE", f.to_str().unwrap().to_string())]);
        let remote: SocketAddr = "10.1.2.3:29500".parse().unwrap();
        fs::set_permissions(&f, fs::Permissions::from_mode(0o644)).unwrap();
        let e = job_secret(&lookup, remote, "x", 2).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        fs::set_permissions(&f, fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            job_secret(&lookup, remote, "x", 2).unwrap(),
            parse_secret(s).unwrap()
        );
        fs::write(&f, "not hex").unwrap();
        let e = job_secret(&lookup, remote, "x", 2).unwrap_err();
        assert!(e.to_string().contains("32 hexadecimal"), "{e}");
        let e = job_secret(
            &env(vec![("BRAID_SECRET_FILE", d.to_str().unwrap().to_string())]),
            remote,
            "x",
            2,
        )
        .unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        fs::remove_dir_all(&d).unwrap();
    }
}
