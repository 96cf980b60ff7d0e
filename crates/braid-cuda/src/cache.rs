//! The on-disk cache of compiled kernels, so NVRTC runs once per (sources, options, architecture,
//! NVRTC major version) on a machine.
//!
//! An entry is `<cache dir>/<key>.bin`, the key the SHA-256 of everything that shapes the binary: the
//! embedded sources and headers, the NVRTC options, the architecture and NVRTC's major version. The
//! minor version is left out on purpose: CUDA's minor-version compatibility lets a driver load a CUBIN
//! that a newer NVRTC of the same major version made, so a cache built ahead with another CUDA 13.x is
//! used as it is; [`load_module`] compiles again (and replaces the entry) only when the driver refuses
//! the cached image. The file is
//! a header (magic, key, kind, length, SHA-256 of the image) and the image; it is written to a
//! temporary file and renamed into place, and read back only when the header matches, so a torn or
//! corrupt entry is compiled again (and replaced) rather than trusted. A cache directory that cannot
//! be written costs only the compile: a warning says so.
//!
//! The directory is `BRAID_CUDA_CACHE` when set, else `$XDG_CACHE_HOME/braid/cuda`, else
//! `$HOME/.cache/braid/cuda`.

use std::io::Write;
use std::path::{Path, PathBuf};

use braid_core::Error;
use sha2::{Digest, Sha256};

use crate::driver::{Gpu, Module};
use crate::nvrtc::{self, BinaryKind, Nvrtc};

/// Whether [`load_or_compile`] found the kernels in the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CacheOutcome {
    /// Read from a valid cache entry.
    Hit,
    /// Compiled (no entry, or a corrupt one, or no usable cache directory).
    Miss,
}

const MAGIC: &[u8; 8] = b"BRAIDCK1";
const HEADER: usize = 8 + 32 + 1 + 8 + 32;

/// The cache directory: `BRAID_CUDA_CACHE`, else `$XDG_CACHE_HOME/braid/cuda`, else
/// `$HOME/.cache/braid/cuda`; `None` when none of the three is set.
pub fn cache_dir() -> Option<PathBuf> {
    let set = |v: &str| {
        std::env::var_os(v)
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = set("BRAID_CUDA_CACHE") {
        return Some(d);
    }
    if let Some(d) = set("XDG_CACHE_HOME") {
        return Some(d.join("braid").join("cuda"));
    }
    set("HOME").map(|h| h.join(".cache").join("braid").join("cuda"))
}

/// The cache key of the kernels compiled with `options` for `arch` by NVRTC `version` (its major part).
pub fn cache_key(options: &[String], arch: u32, version: (i32, i32)) -> [u8; 32] {
    let (name, source, headers) = nvrtc::program();
    program_key(name, source, &headers, options, arch, version)
}

/// The cache key of the program `name` (`source` and the `headers` it includes) compiled with
/// `options` for `arch` by NVRTC `version` (its major part: see the module docs).
pub fn program_key(
    name: &str,
    source: &str,
    headers: &[(&str, &str)],
    options: &[String],
    arch: u32,
    version: (i32, i32),
) -> [u8; 32] {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(b"braid-cuda kernels, NVRTC");
    for (name, text) in headers.iter().chain([&(name, source)]) {
        field(name.as_bytes());
        field(text.as_bytes());
    }
    for o in options {
        field(o.as_bytes());
    }
    field(&arch.to_le_bytes());
    field(&version.0.to_le_bytes());
    h.finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The path of the entry for `key` in `dir`.
pub fn entry_path(dir: &Path, key: &[u8; 32]) -> PathBuf {
    dir.join(format!("{}.bin", hex(key)))
}

fn encode(key: &[u8; 32], kind: BinaryKind, image: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + image.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(key);
    out.push(match kind {
        BinaryKind::Cubin => 0,
        BinaryKind::Ptx => 1,
    });
    out.extend_from_slice(&(image.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(image));
    out.extend_from_slice(image);
    out
}

/// The image in an entry's bytes, or why they are not a valid entry for `key`.
fn decode(key: &[u8; 32], bytes: &[u8]) -> Result<(BinaryKind, Vec<u8>), &'static str> {
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return Err("not a cache entry");
    }
    if &bytes[8..40] != key {
        return Err("the entry is for another key");
    }
    let kind = match bytes[40] {
        0 => BinaryKind::Cubin,
        1 => BinaryKind::Ptx,
        _ => return Err("unknown image kind"),
    };
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[41..49]);
    let image = &bytes[HEADER..];
    if u64::try_from(image.len()).ok() != Some(u64::from_le_bytes(len)) {
        return Err("the image is truncated or too long");
    }
    if Sha256::digest(image).as_slice() != &bytes[49..81] {
        return Err("the image does not match its checksum");
    }
    Ok((kind, image.to_vec()))
}

/// Writes `contents` to `path` through a temporary file in the same directory and a rename.
fn write_atomically(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(
        ".{}.{}.{nanos}.tmp",
        name.unwrap_or_default(),
        std::process::id()
    ));
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(contents)?;
        f.sync_all()
    });
    let result = written.and_then(|()| std::fs::rename(&tmp, path));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The kernels for `sm_<arch>` (see [`nvrtc::compile`]), from the cache in [`cache_dir`] or compiled
/// and stored there; the image is a CUBIN, or PTX where the NVRTC found cannot make CUBINs, as
/// `cuModuleLoadData` takes either.
pub fn load_or_compile(arch: u32) -> Result<(Vec<u8>, CacheOutcome), Error> {
    match cache_dir() {
        Some(dir) => load_or_compile_in(&dir, arch),
        None => {
            tracing::warn!(
                "no cache directory for compiled CUDA kernels (set BRAID_CUDA_CACHE, XDG_CACHE_HOME \
                 or HOME): compiling them for sm_{arch} without caching"
            );
            Ok((nvrtc::compile(arch)?.binary, CacheOutcome::Miss))
        }
    }
}

/// [`load_or_compile`] with the cache in `dir`.
pub fn load_or_compile_in(dir: &Path, arch: u32) -> Result<(Vec<u8>, CacheOutcome), Error> {
    let (name, source, headers) = nvrtc::program();
    load_or_compile_program_in(dir, name, source, &headers, arch)
}

/// The program `name` (`source` including `headers`) compiled for `sm_<arch>`, from the cache in
/// [`cache_dir`] or compiled and stored there (uncached when there is no cache directory).
pub fn load_or_compile_program(
    name: &str,
    source: &str,
    headers: &[(&str, &str)],
    arch: u32,
) -> Result<(Vec<u8>, CacheOutcome), Error> {
    match cache_dir() {
        Some(dir) => load_or_compile_program_in(&dir, name, source, headers, arch),
        None => {
            let nvrtc = Nvrtc::get()?;
            let (kind, options) = nvrtc::options(nvrtc, arch)?;
            let (image, _) = nvrtc.compile_program(name, source, headers, &options, kind)?;
            Ok((image, CacheOutcome::Miss))
        }
    }
}

/// [`load_or_compile_program`] with the cache in `dir`.
pub fn load_or_compile_program_in(
    dir: &Path,
    name: &str,
    source: &str,
    headers: &[(&str, &str)],
    arch: u32,
) -> Result<(Vec<u8>, CacheOutcome), Error> {
    cached(dir, name, source, headers, arch, true)
}

/// The program `name` loaded on `gpu`: from the cache when the driver loads the cached image, else
/// compiled for the device's architecture (and the cache entry replaced).
pub fn load_module(
    gpu: &Gpu,
    name: &str,
    source: &str,
    headers: &[(&str, &str)],
) -> Result<Module, Error> {
    let arch = gpu.arch()?;
    let (image, outcome) = load_or_compile_program(name, source, headers, arch)?;
    match Module::load(gpu, &image) {
        Err(e) if outcome == CacheOutcome::Hit => {
            tracing::warn!(
                "the cached image of {name} for sm_{arch} does not load on this driver ({e}): \
                 compiling it again"
            );
            let image = match cache_dir() {
                Some(dir) => cached(&dir, name, source, headers, arch, false)?.0,
                None => load_or_compile_program(name, source, headers, arch)?.0,
            };
            Module::load(gpu, &image)
        }
        loaded => loaded,
    }
}

/// The cached image (when `read` and an entry is valid), else a fresh compile stored in `dir`.
fn cached(
    dir: &Path,
    name: &str,
    source: &str,
    headers: &[(&str, &str)],
    arch: u32,
    read: bool,
) -> Result<(Vec<u8>, CacheOutcome), Error> {
    let nvrtc = Nvrtc::get()?;
    let (kind, options) = nvrtc::options(nvrtc, arch)?;
    let key = program_key(name, source, headers, &options, arch, nvrtc.version()?);
    let path = entry_path(dir, &key);
    match std::fs::read(&path) {
        _ if !read => {}
        Ok(bytes) => match decode(&key, &bytes) {
            Ok((_, image)) => return Ok((image, CacheOutcome::Hit)),
            Err(why) => tracing::warn!(
                "cached CUDA kernels {} are unusable ({why}): compiling them again",
                path.display()
            ),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(
            "cached CUDA kernels {} could not be read ({e}): compiling them again",
            path.display()
        ),
    }
    let started = std::time::Instant::now();
    let (binary, log) = nvrtc.compile_program(name, source, headers, &options, kind)?;
    let version = nvrtc.version()?;
    tracing::debug!(
        "compiled {name} for sm_{arch} with NVRTC {}.{} in {:.1} s{}{}",
        version.0,
        version.1,
        started.elapsed().as_secs_f64(),
        if log.is_empty() { "" } else { ":\n" },
        log
    );
    if let Err(e) = write_atomically(&path, &encode(&key, kind, &binary)) {
        tracing::warn!(
            "the compiled CUDA kernels could not be cached in {} ({e}): they will be compiled again \
             next time (set BRAID_CUDA_CACHE to a writable directory)",
            dir.display()
        );
    }
    Ok((binary, CacheOutcome::Miss))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_damage_is_seen() {
        let key = [7u8; 32];
        let image = b"\x7fELF some image".to_vec();
        let bytes = encode(&key, BinaryKind::Cubin, &image);
        assert_eq!(decode(&key, &bytes), Ok((BinaryKind::Cubin, image.clone())));
        assert!(decode(&[8u8; 32], &bytes).is_err());
        assert!(decode(&key, &bytes[..bytes.len() - 1]).is_err());
        assert!(decode(&key, &bytes[..10]).is_err());
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(decode(&key, &flipped).is_err());
        let mut longer = bytes;
        longer.push(0);
        assert!(decode(&key, &longer).is_err());
    }

    #[test]
    fn keys_depend_on_options_arch_and_major_version() {
        let o = vec!["--gpu-architecture=sm_80".to_string()];
        let k = cache_key(&o, 80, (13, 0));
        assert_eq!(k, cache_key(&o, 80, (13, 0)));
        assert_ne!(k, cache_key(&o, 90, (13, 0)));
        assert_ne!(k, cache_key(&o, 80, (12, 0)));
        assert_ne!(k, cache_key(&[], 80, (13, 0)));
        // Minor-version compatibility: a CUBIN of NVRTC 13.5 is offered to a 13.0 driver.
        assert_eq!(k, cache_key(&o, 80, (13, 5)));
        let p = |src: &str| program_key("a.cu", src, &[("h.cuh", "x")], &o, 80, (13, 0));
        assert_ne!(p("one"), p("two"));
    }
}
