//! What the kernel tests need from the machine: the CUDA compiler from PyPI (or a CUDA install), a C++
//! compiler, and the `BRAID_REQUIRE_TOOLS=1` rule (a test that cannot run fails instead of passing).
#![allow(dead_code)]

pub mod cases;

use std::path::{Path, PathBuf};
use std::process::Command;

#[allow(unused_imports)] // each test target uses its own part
pub use braid_testkit::tools::{tools_required, unavailable};

/// The repository's `kernels/` directory.
pub fn kernels_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels")
}

/// Directories that may hold the CUDA tools: `BRAID_CUDA_BIN`, then `PATH` (by returning nothing
/// special), then the `bin/` of PyPI's CUDA 13 wheels (`nvidia-cuda-nvcc` and friends install into
/// `site-packages/nvidia/cu13`, and their `nvcc.profile` finds `include/` and libdevice from there).
fn cuda_bin_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("BRAID_CUDA_BIN") {
        dirs.push(PathBuf::from(d));
    }
    let py = Command::new("python3")
        .args([
            "-c",
            "import nvidia, os\nfor p in nvidia.__path__: print(os.path.join(p, 'cu13', 'bin'))",
        ])
        .output();
    if let Ok(o) = py {
        for line in String::from_utf8_lossy(&o.stdout).lines() {
            dirs.push(PathBuf::from(line.trim()));
        }
    }
    dirs
}

/// The path of CUDA tool `name` (`nvcc`, `cuobjdump`), or why there is none.
pub fn cuda_tool(name: &str) -> Result<PathBuf, String> {
    for d in cuda_bin_dirs() {
        let p = d.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    if Command::new(name)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Ok(PathBuf::from(name));
    }
    Err(format!(
        "{name} was not found (set BRAID_CUDA_BIN, put it on PATH, or `python3 -m pip install \
         nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-crt nvidia-nvvm nvidia-cuda-cuobjdump \
         nvidia-cuda-nvdisasm`)"
    ))
}

/// The directory holding CUDA's `cuda.h`: beside the `bin/` of the CUDA tools (the PyPI wheels, or a
/// CUDA install), else `/usr/local/cuda/include`.
pub fn cuda_include() -> Result<PathBuf, String> {
    let mut dirs: Vec<PathBuf> = cuda_bin_dirs()
        .into_iter()
        .filter_map(|b| b.parent().map(|p| p.join("include")))
        .collect();
    dirs.push(PathBuf::from("/usr/local/cuda/include"));
    dirs.into_iter()
        .find(|d| d.join("cuda.h").is_file())
        .ok_or_else(|| {
            "cuda.h was not found (set BRAID_CUDA_BIN to a CUDA bin/ directory, or `python3 -m pip \
             install nvidia-cuda-runtime nvidia-cuda-crt`)"
                .to_string()
        })
}

/// A C++ compiler: `CXX`, else `g++`.
pub fn cxx() -> Result<String, String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    if Command::new(&cxx)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        Ok(cxx)
    } else {
        Err(format!(
            "the C++ compiler {cxx} is not installed; the host tests of the kernels need it"
        ))
    }
}

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("braid-cuda-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Builds the host program `tests/host/<source>` (the kernels and `tests/host` on the include path)
/// with the C++ compiler, `-std=c++17 -g -Wall -Wextra -Werror` and `flags`, into `exe`; panics with
/// the compiler's output when it fails.
pub fn build_host_program(cxx: &str, source: &str, flags: &[&str], exe: &Path) {
    let host = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/host");
    let out = Command::new(cxx)
        .args(["-std=c++17", "-g", "-Wall", "-Wextra", "-Werror"])
        .args(flags)
        .arg("-I")
        .arg(kernels_dir())
        .arg("-I")
        .arg(&host)
        .arg(host.join(source))
        .arg("-o")
        .arg(exe)
        .output()
        .expect("running the C++ compiler");
    assert!(
        out.status.success(),
        "building {source} with {flags:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The host program `tests/host/<source>` built into a scratch `exe` with `flags`, once per test
/// binary (`cell` keeps it); `None`, after [`unavailable`] has said why, where there is no C++
/// compiler.
pub fn built_once(
    cell: &'static std::sync::OnceLock<Result<PathBuf, String>>,
    source: &str,
    flags: &[&str],
) -> Option<PathBuf> {
    let built = cell.get_or_init(|| {
        let cxx = cxx()?;
        let stem = source.trim_end_matches(".cpp");
        let exe = scratch(stem).join(stem);
        build_host_program(&cxx, source, flags, &exe);
        Ok(exe)
    });
    match built {
        Ok(p) => Some(p.clone()),
        Err(why) => {
            unavailable(why);
            None
        }
    }
}

/// A running host program that answers requests on its stdin with replies on its stdout (the
/// drivers under `tests/host`), stopped at the first ThreadSanitizer report.
pub struct HostProgram {
    child: std::process::Child,
    /// Requests.
    pub input: std::io::BufWriter<std::process::ChildStdin>,
    /// Replies.
    pub output: std::io::BufReader<std::process::ChildStdout>,
}

impl HostProgram {
    /// Starts `exe`.
    pub fn start(exe: &Path) -> HostProgram {
        use std::process::Stdio;
        let mut child = Command::new(exe)
            .env("TSAN_OPTIONS", "halt_on_error=1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", exe.display()));
        let input = std::io::BufWriter::new(child.stdin.take().expect("piped stdin"));
        let output = std::io::BufReader::new(child.stdout.take().expect("piped stdout"));
        HostProgram {
            child,
            input,
            output,
        }
    }

    /// Sends what was written, then reads a reply's status word (0: done) and `n` bytes after it.
    pub fn reply(&mut self, n: usize) -> Vec<u8> {
        use std::io::{Read, Write};
        self.input.flush().expect("writing to the host program");
        let mut status = [0u8; 4];
        self.output
            .read_exact(&mut status)
            .expect("the host program's reply");
        assert_eq!(
            u32::from_le_bytes(status),
            0,
            "the host program refused a request"
        );
        let mut b = vec![0u8; n];
        self.output
            .read_exact(&mut b)
            .expect("the host program's reply");
        b
    }

    /// Closes its input and checks that it ended well (a sanitizer report would be above).
    pub fn finish(mut self) {
        drop(self.input);
        let status = self.child.wait().expect("waiting for the host program");
        assert!(
            status.success(),
            "the host program exited with {status} (a sanitizer report is above)"
        );
    }
}

/// `b` as little-endian f32s.
pub fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// Whether `got` and `want` hold the same bits, a NaN matching any NaN (a GPU's arithmetic returns
/// the canonical NaN where the CPU keeps the operand's payload); panics naming the first difference.
pub fn same_bits_or_both_nan(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{what}: element {i} is {g} ({:#010x}), the CPU says {w} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}
