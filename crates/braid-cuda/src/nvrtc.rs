//! Run-time compilation of the reduce-copy kernels with NVRTC, loaded with `dlopen` when first needed.
//!
//! A machine with only the CUDA driver and `libnvrtc` (what a PyTorch install brings) needs no nvcc:
//! [`compile`] hands the embedded [`SOURCES`](crate::SOURCES) to NVRTC and gets a CUBIN for `sm_<arch>`
//! back (PTX for `compute_<arch>` where the NVRTC found predates `nvrtcGetCUBIN`).
//!
//! The binding is a handful of NVRTC calls over `libloading` rather than `cudarc`'s: `cudarc` must be
//! built for one CUDA version (a cargo feature; reading it from the build system fails on CUDA 13.5),
//! and its dynamic loading only tries fixed library names, so it would not find the PyPI wheel's
//! `site-packages/nvidia/cu13/lib/libnvrtc.so.13` anyway. Ten symbols resolved here, each checked when
//! the library is opened, work with any NVRTC from 11.1 on, and a missing or broken library is an
//! [`Error`], never a panic or an abort.
//!
//! Where the library is looked for, in order:
//! 1. `BRAID_NVRTC_LIBRARY`, a path: when set, it is the only place tried;
//! 2. the system loader's names `libnvrtc.so`, `libnvrtc.so.13`, `libnvrtc.so.12` (`LD_LIBRARY_PATH`,
//!    the loader cache);
//! 3. the PyPI wheels (`nvidia-cuda-nvrtc`): `nvidia/cu13/lib` and `nvidia/cuda_nvrtc/lib` under the
//!    site-packages of `VIRTUAL_ENV` and `CONDA_PREFIX`, then under the `nvidia` package `python3`
//!    imports (asked once, with a 5 s limit).
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use braid_core::Error;
use libloading::Library;

/// What [`compile`] produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryKind {
    /// An ELF CUBIN for `sm_<arch>`.
    Cubin,
    /// NUL-terminated PTX for `compute_<arch>` (the driver compiles it when it loads the module).
    Ptx,
}

/// The kernels compiled for one architecture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compiled {
    /// The module image, as `cuModuleLoadData` takes it (either kind).
    pub binary: Vec<u8>,
    /// Whether `binary` is a CUBIN or PTX.
    pub kind: BinaryKind,
    /// NVRTC's log (warnings; empty when there were none).
    pub log: String,
    /// The NVRTC version that compiled it, `(major, minor)`.
    pub version: (i32, i32),
}

type Program = *mut c_void;
type NvrtcResult = c_int;
const NVRTC_SUCCESS: NvrtcResult = 0;
const NVRTC_ERROR_INVALID_OPTION: NvrtcResult = 5;
const NVRTC_ERROR_COMPILATION: NvrtcResult = 6;

type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult;
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> NvrtcResult;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult;
type GetFn = unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> NvrtcResult;
type ErrorStringFn = unsafe extern "C" fn(NvrtcResult) -> *const c_char;

/// An opened NVRTC library and the calls braid makes into it.
pub struct Nvrtc {
    version: VersionFn,
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: GetFn,
    ptx_size: SizeFn,
    ptx: GetFn,
    cubin: Option<(SizeFn, GetFn)>,
    destroy: DestroyFn,
    error_string: ErrorStringFn,
    path: String,
    // Last: the function pointers above point into it, so it must outlive every use of them.
    _library: Library,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc")
            .field("path", &self.path)
            .field("cubin", &self.cubin.is_some())
            .finish()
    }
}

fn not_found(tried: &[String], why: &[String]) -> Error {
    Error::Io {
        context: "loading NVRTC".into(),
        message: format!(
            "no usable libnvrtc was found (tried {}{}); install it with `python3 -m pip install \
             nvidia-cuda-nvrtc` (or a CUDA toolkit), or set BRAID_NVRTC_LIBRARY to the path of \
             libnvrtc.so",
            tried.join(", "),
            if why.is_empty() {
                String::new()
            } else {
                format!(": {}", why.join("; "))
            }
        ),
    }
}

/// `site-packages/nvidia` directories under a Python prefix (`<prefix>/lib/python3.*/site-packages`).
fn nvidia_dirs_under(prefix: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join("site-packages").join("nvidia"))
        .filter(|p| p.is_dir())
        .collect()
}

/// The `nvidia` package directories `python3` imports, or none when it cannot say within 5 s.
fn nvidia_dirs_from_python() -> Vec<PathBuf> {
    let child = Command::new("python3")
        .args(["-c", "import nvidia\nfor p in nvidia.__path__: print(p)"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let Ok(mut child) = child else {
        return Vec::new();
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Vec::new();
            }
        }
    }
    let Ok(out) = child.wait_with_output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| PathBuf::from(l.trim()))
        .filter(|p| p.is_dir())
        .collect()
}

/// The PyPI wheels' NVRTC libraries that exist on this machine, in the order of the module docs.
fn wheel_candidates() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = std::env::var_os(var) {
            dirs.extend(nvidia_dirs_under(Path::new(&prefix)));
        }
    }
    dirs.extend(nvidia_dirs_from_python());
    let mut found = Vec::new();
    for d in dirs {
        for lib in ["cu13/lib/libnvrtc.so.13", "cuda_nvrtc/lib/libnvrtc.so.12"] {
            let p = d.join(lib);
            if p.is_file() && !found.contains(&p) {
                found.push(p);
            }
        }
    }
    found
}

impl Nvrtc {
    /// The process's NVRTC, found as the module docs say and opened once (a failure is retried on the
    /// next call).
    pub fn get() -> Result<&'static Nvrtc, Error> {
        static LOADED: OnceLock<Nvrtc> = OnceLock::new();
        if let Some(n) = LOADED.get() {
            return Ok(n);
        }
        let n = Nvrtc::find()?;
        Ok(LOADED.get_or_init(|| n))
    }

    /// Finds and opens NVRTC as the module docs say, without the process-wide cache of [`Nvrtc::get`].
    pub fn find() -> Result<Nvrtc, Error> {
        if let Some(path) = std::env::var_os("BRAID_NVRTC_LIBRARY") {
            let path = PathBuf::from(path);
            return Nvrtc::open(&path).map_err(|why| Error::Io {
                context: "loading NVRTC".into(),
                message: format!(
                    "BRAID_NVRTC_LIBRARY={} could not be used: {why}; point it at libnvrtc.so \
                     (`python3 -m pip install nvidia-cuda-nvrtc` installs one) or unset it",
                    path.display()
                ),
            });
        }
        let mut tried = Vec::new();
        let mut why = Vec::new();
        for name in ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"] {
            match Nvrtc::open(Path::new(name)) {
                Ok(n) => return Ok(n),
                Err(e) => {
                    tried.push(name.to_string());
                    // "cannot open shared object file" for every absent name says nothing new.
                    if !e.contains("No such file") && !e.contains("cannot open shared object") {
                        why.push(e);
                    }
                }
            }
        }
        let wheels = wheel_candidates();
        tried.push("the nvidia-cuda-nvrtc wheel's lib/ in python3's site-packages".into());
        for p in wheels {
            match Nvrtc::open(&p) {
                Ok(n) => return Ok(n),
                Err(e) => why.push(e),
            }
        }
        Err(not_found(&tried, &why))
    }

    /// Opens the NVRTC library at `path` (a file name alone goes through the system loader's search)
    /// and resolves its calls; the error says what failed.
    pub fn open(path: &Path) -> Result<Nvrtc, String> {
        // SAFETY: opening libnvrtc runs its initialisers, which is what every program using NVRTC does;
        // the library does nothing else when loaded.
        let library = unsafe { Library::new(path) }
            .map_err(|e| format!("{} could not be loaded: {e}", path.display()))?;
        let path = path.display().to_string();
        macro_rules! symbol {
            ($name:literal, $ty:ty) => {
                // SAFETY: the symbol is NVRTC's C function of that name, whose signature in nvrtc.h is
                // `$ty`; the pointer is only used while `library` (moved into the result) is loaded.
                unsafe { library.get::<$ty>(concat!($name, "\0").as_bytes()) }
                    .map(|s| *s)
                    .map_err(|e| format!("{path} is not NVRTC (no {}): {e}", $name))
            };
        }
        let cubin = match (
            symbol!("nvrtcGetCUBINSize", SizeFn),
            symbol!("nvrtcGetCUBIN", GetFn),
        ) {
            (Ok(a), Ok(b)) => Some((a, b)),
            _ => None,
        };
        Ok(Nvrtc {
            version: symbol!("nvrtcVersion", VersionFn)?,
            create: symbol!("nvrtcCreateProgram", CreateFn)?,
            compile: symbol!("nvrtcCompileProgram", CompileFn)?,
            log_size: symbol!("nvrtcGetProgramLogSize", SizeFn)?,
            log: symbol!("nvrtcGetProgramLog", GetFn)?,
            ptx_size: symbol!("nvrtcGetPTXSize", SizeFn)?,
            ptx: symbol!("nvrtcGetPTX", GetFn)?,
            cubin,
            destroy: symbol!("nvrtcDestroyProgram", DestroyFn)?,
            error_string: symbol!("nvrtcGetErrorString", ErrorStringFn)?,
            path,
            _library: library,
        })
    }

    /// Where the library was loaded from (a path, or the file name the system loader resolved).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// NVRTC's version, `(major, minor)`.
    pub fn version(&self) -> Result<(i32, i32), Error> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints through the pointers, which point at live locals.
        let r = unsafe { (self.version)(&mut major, &mut minor) };
        self.check(r, "nvrtcVersion")?;
        Ok((major, minor))
    }

    /// Whether this NVRTC produces CUBINs (11.1 and later); otherwise [`compile`] gives PTX.
    pub fn has_cubin(&self) -> bool {
        self.cubin.is_some()
    }

    fn describe(&self, r: NvrtcResult) -> String {
        // SAFETY: nvrtcGetErrorString takes any result code and returns a pointer to a static
        // NUL-terminated string (or null, checked).
        let s = unsafe { (self.error_string)(r) };
        if s.is_null() {
            format!("NVRTC error {r}")
        } else {
            // SAFETY: non-null, static and NUL-terminated, as above.
            let text = unsafe { CStr::from_ptr(s) }.to_string_lossy();
            format!("{text} ({r})")
        }
    }

    fn check(&self, r: NvrtcResult, call: &str) -> Result<(), Error> {
        if r == NVRTC_SUCCESS {
            Ok(())
        } else {
            Err(Error::Internal(format!(
                "{call} failed: {} (NVRTC at {})",
                self.describe(r),
                self.path
            )))
        }
    }

    /// Reads one of the program's outputs: `size` reports its length (NUL included for text), `get`
    /// copies it.
    fn output(
        &self,
        prog: Program,
        size: SizeFn,
        get: GetFn,
        what: &str,
    ) -> Result<Vec<u8>, Error> {
        let mut n = 0usize;
        // SAFETY: `prog` is a live program and `n` a live local the call writes the size into.
        self.check(unsafe { size(prog, &mut n) }, what)?;
        let mut buf = vec![0u8; n];
        if n > 0 {
            // SAFETY: the buffer holds exactly the `n` bytes NVRTC just said it will write.
            self.check(unsafe { get(prog, buf.as_mut_ptr().cast()) }, what)?;
        }
        Ok(buf)
    }

    /// Compiles `source` (named `name`, including `headers` by their names) with `options`; returns
    /// the image `kind` asks for and the log. A compilation error carries the log.
    pub fn compile_program(
        &self,
        name: &str,
        source: &str,
        headers: &[(&str, &str)],
        options: &[String],
        kind: BinaryKind,
    ) -> Result<(Vec<u8>, String), Error> {
        let bad = |what: &str| Error::invalid(format!("{what} holds a NUL byte"));
        let c_name = CString::new(name).map_err(|_| bad("the program name"))?;
        let c_source = CString::new(source).map_err(|_| bad(name))?;
        let mut header_names = Vec::new();
        let mut header_texts = Vec::new();
        for (n, t) in headers {
            header_names.push(CString::new(*n).map_err(|_| bad(n))?);
            header_texts.push(CString::new(*t).map_err(|_| bad(n))?);
        }
        let c_options = options
            .iter()
            .map(|o| CString::new(o.as_str()).map_err(|_| bad(o)))
            .collect::<Result<Vec<_>, _>>()?;
        let name_ptrs: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();
        let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|s| s.as_ptr()).collect();
        let option_ptrs: Vec<*const c_char> = c_options.iter().map(|s| s.as_ptr()).collect();
        let count = |n: usize| c_int::try_from(n).map_err(|_| Error::invalid("too many inputs"));

        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: every pointer is to a NUL-terminated string alive until this function returns, the
        // two arrays have `headers.len()` entries, and `prog` receives the new program.
        let r = unsafe {
            (self.create)(
                &mut prog,
                c_source.as_ptr(),
                c_name.as_ptr(),
                count(headers.len())?,
                text_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            )
        };
        self.check(r, "nvrtcCreateProgram")?;
        let result = self.compile_created(prog, count(options.len())?, &option_ptrs, options, kind);
        // SAFETY: `prog` was created above and is destroyed once, here; nothing uses it afterwards.
        let _ = unsafe { (self.destroy)(&mut prog) };
        result
    }

    fn compile_created(
        &self,
        prog: Program,
        n_options: c_int,
        option_ptrs: &[*const c_char],
        options: &[String],
        kind: BinaryKind,
    ) -> Result<(Vec<u8>, String), Error> {
        // SAFETY: `prog` is live; `option_ptrs` holds `n_options` NUL-terminated strings that outlive
        // the call.
        let r = unsafe { (self.compile)(prog, n_options, option_ptrs.as_ptr()) };
        let log = self.output(prog, self.log_size, self.log, "nvrtcGetProgramLog")?;
        let log = String::from_utf8_lossy(&log)
            .trim_end_matches('\0')
            .trim_end()
            .to_string();
        match r {
            NVRTC_SUCCESS => {}
            NVRTC_ERROR_INVALID_OPTION => {
                return Err(Error::invalid(format!(
                    "NVRTC {} rejected the options {options:?}: {}{log}",
                    self.path,
                    self.describe(r)
                )))
            }
            NVRTC_ERROR_COMPILATION => {
                return Err(Error::Internal(format!(
                    "NVRTC ({}) failed to compile the kernels with {options:?}:\n{log}",
                    self.path
                )))
            }
            _ => self.check(r, "nvrtcCompileProgram")?,
        }
        let binary = match (kind, self.cubin) {
            (BinaryKind::Cubin, Some((size, get))) => {
                self.output(prog, size, get, "nvrtcGetCUBIN")?
            }
            (BinaryKind::Cubin, None) => {
                return Err(Error::invalid(format!(
                    "NVRTC {} cannot produce CUBINs",
                    self.path
                )))
            }
            (BinaryKind::Ptx, _) => self.output(prog, self.ptx_size, self.ptx, "nvrtcGetPTX")?,
        };
        Ok((binary, log))
    }
}

/// The source [`compile`] hands to NVRTC and the headers it includes, from [`SOURCES`](crate::SOURCES).
pub fn program() -> (
    &'static str,
    &'static str,
    Vec<(&'static str, &'static str)>,
) {
    let (name, text) = crate::SOURCES[crate::SOURCES.len() - 1];
    let headers = crate::SOURCES[..crate::SOURCES.len() - 1].to_vec();
    (name, text, headers)
}

/// What [`compile`] produces for `arch` with `nvrtc`, and the NVRTC options for it: those of the nvcc
/// tests (C++17, optimised device code; the kernels need no include path, not even CUDA's headers).
pub fn options(nvrtc: &Nvrtc, arch: u32) -> Result<(BinaryKind, Vec<String>), Error> {
    if !(30..10_000).contains(&arch) {
        return Err(Error::invalid(format!(
            "GPU architecture {arch}: expected a compute capability as a number, such as 80 or 90"
        )));
    }
    let (kind, target) = if nvrtc.has_cubin() {
        (BinaryKind::Cubin, format!("sm_{arch}"))
    } else {
        (BinaryKind::Ptx, format!("compute_{arch}"))
    };
    let mut options = vec![format!("--gpu-architecture={target}"), "--std=c++17".into()];
    // NVRTC optimises device code unless told otherwise, as nvcc does; from 12.0 on it says so too.
    if nvrtc.version()?.0 >= 12 {
        options.push("--dopt=on".into());
    }
    Ok((kind, options))
}

/// Compiles every reduce-copy kernel for `sm_<arch>` (80 for A100, 90 for H100) with the process's
/// NVRTC ([`Nvrtc::get`]): a CUBIN, or PTX where that NVRTC cannot make CUBINs.
pub fn compile(arch: u32) -> Result<Compiled, Error> {
    compile_with(Nvrtc::get()?, arch)
}

/// [`compile`] with a given NVRTC.
pub fn compile_with(nvrtc: &Nvrtc, arch: u32) -> Result<Compiled, Error> {
    let (kind, options) = options(nvrtc, arch)?;
    let (name, source, headers) = program();
    let (binary, log) = nvrtc.compile_program(name, source, &headers, &options, kind)?;
    Ok(Compiled {
        binary,
        kind,
        log,
        version: nvrtc.version()?,
    })
}
