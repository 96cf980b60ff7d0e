//! The reduce-copy kernels' semantics, checked on the host, against braid-core's CPU reference bit for
//! bit: every kernel of the catalogue, every dtype × op, odd lengths, heads that misalign the vector
//! path, operands that share no alignment, operands not even element-aligned, in place. Two builds of
//! one driver (tests/host/driver.cpp) run them:
//!
//! - the `__host__ __device__` body the kernels share (kernels/braid_reduce_copy.cuh), compiled with
//!   AddressSanitizer and UBSan and called thread by thread: every access inside its operands, no
//!   undefined behaviour;
//! - the real `__global__` entry points of kernels/reduce_copy.cu, launched on the SIMT runner
//!   (tests/host/simt.hpp: one CPU thread per CUDA thread, several blocks at once) under
//!   ThreadSanitizer: no two threads of a launch touch the same byte unsynchronised.
//!
//! What this does not show: the device-only code (`ld.global.v4`, the f16/bf16 `cvt` instructions) and
//! the GPU's weaker memory model; those wait for a GPU.

mod support;

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;

use braid_core::reduce::{self, Src};
use braid_core::{DType, ReduceOp};
use braid_cuda::{kernel_name, Shape};
use support::cases::{check_kernel, Grid, Operand, Rng, Runner};
use support::{build_host_program, cxx, scratch, unavailable};

/// How the driver runs a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Build {
    /// The shared body, thread by thread, under AddressSanitizer and UBSan.
    Body,
    /// The `__global__` kernel on the SIMT runner, under ThreadSanitizer.
    Simt,
}

/// The host driver of `build`, compiled once for all the tests of this file (at -O0: its 460 template
/// instances take 25 s there and over a minute at -O1 on two cores).
fn build_driver(build: Build) -> Option<PathBuf> {
    static BODY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    static SIMT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let cell = match build {
        Build::Body => &BODY,
        Build::Simt => &SIMT,
    };
    match cell.get_or_init(|| cxx().map(|cxx| compile_driver(&cxx, build))) {
        Ok(p) => Some(p.clone()),
        Err(why) => {
            unavailable(why);
            None
        }
    }
}

fn compile_driver(cxx: &str, build: Build) -> PathBuf {
    let exe = scratch(&format!("driver-{build:?}")).join("driver");
    let flags: &[&str] = match build {
        Build::Body => &[
            "-O0",
            "-Wno-unknown-pragmas",
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
        ],
        Build::Simt => &[
            "-O0",
            "-Wno-unknown-pragmas",
            "-DBRAID_SIMT",
            "-fsanitize=thread",
        ],
    };
    build_host_program(cxx, "driver.cpp", flags, &exe);
    exe
}

struct Driver {
    child: Child,
    input: BufWriter<ChildStdin>,
    output: BufReader<ChildStdout>,
}

impl Driver {
    fn start(exe: &PathBuf) -> Driver {
        let mut child = Command::new(exe)
            // The first race ends the run, so the failing kernel is the one named.
            .env("TSAN_OPTIONS", "halt_on_error=1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the host driver");
        let input = BufWriter::new(child.stdin.take().unwrap());
        let output = BufReader::new(child.stdout.take().unwrap());
        Driver {
            child,
            input,
            output,
        }
    }

    fn finish(mut self) {
        drop(self.input);
        let status = self.child.wait().unwrap();
        assert!(
            status.success(),
            "the host driver exited with {status} (a sanitizer report is above)"
        );
    }
}

impl Runner for Driver {
    fn run(
        &mut self,
        name: &str,
        grid: Grid,
        count: usize,
        nranks: u32,
        srcs: &[Operand],
        dsts: &[(u32, usize)],
        alias: Option<usize>,
    ) -> Vec<Vec<u8>> {
        let w = &mut self.input;
        let mut put = |b: &[u8]| w.write_all(b).expect("writing to the host driver");
        put(&(name.len() as u32).to_le_bytes());
        put(name.as_bytes());
        put(&grid.0.to_le_bytes());
        put(&grid.1.to_le_bytes());
        put(&(count as u64).to_le_bytes());
        put(&nranks.to_le_bytes());
        put(&(srcs.len() as u32).to_le_bytes());
        put(&(dsts.len() as u32).to_le_bytes());
        put(&alias.map_or(u32::MAX, |a| a as u32).to_le_bytes());
        for s in srcs {
            put(&s.misalign.to_le_bytes());
            put(&(s.bytes.len() as u64).to_le_bytes());
            put(&s.bytes);
        }
        for (mis, len) in dsts {
            put(&mis.to_le_bytes());
            put(&(*len as u64).to_le_bytes());
        }
        self.input.flush().unwrap();
        let mut status = [0u8; 4];
        self.output.read_exact(&mut status).unwrap_or_else(|e| {
            panic!("the host driver died on {name} (a sanitizer report is above): {e}")
        });
        assert_eq!(
            u32::from_le_bytes(status),
            0,
            "the host driver refused {name}"
        );
        dsts.iter()
            .map(|_| {
                let mut len = [0u8; 8];
                self.output.read_exact(&mut len).unwrap();
                let mut b = vec![0u8; u64::from_le_bytes(len) as usize];
                self.output.read_exact(&mut b).unwrap();
                b
            })
            .collect()
    }
}

fn every_kernel_matches_braid_core(build: Build) {
    let Some(exe) = build_driver(build) else {
        return;
    };
    let mut d = Driver::start(&exe);
    let mut rng = Rng(0x5eed_b4a1_d000_0001);
    let mut cases = 0;
    let mut kernels = 0;
    for (shape, dtype, op) in braid_cuda::entries() {
        cases += check_kernel(&mut d, &mut rng, shape, dtype, op);
        kernels += 1;
    }
    d.finish();
    assert_eq!(kernels, braid_cuda::catalogue().len());
    println!("{build:?}: {kernels} kernels, {cases} cases, all bit-identical to braid-core");
}

#[test]
fn every_kernel_body_matches_braid_core_bit_for_bit() {
    every_kernel_matches_braid_core(Build::Body);
}

#[test]
fn every_global_kernel_on_the_simt_runner_matches_braid_core_without_races() {
    every_kernel_matches_braid_core(Build::Simt);
}

#[test]
fn half_and_bfloat16_conversions_match_braid_core_exhaustively() {
    // Loading: every one of the 65536 bit patterns. Rounding: every f32 near a rounding boundary of
    // either format (halfway points, their neighbours, overflow and subnormal edges) plus random bits.
    let Some(exe) = build_driver(Build::Body) else {
        return;
    };
    let mut d = Driver::start(&exe);
    let all: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
    let mut rng = Rng(42);
    let mut f32s: Vec<u32> = Vec::new();
    for hi in 0..=u16::MAX as u32 {
        for lo in [
            0u32, 1, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x7fff, 0x8000, 0x8001, 0xffff,
        ] {
            f32s.push((hi << 16) | lo);
        }
        f32s.push(rng.next() as u32);
    }
    let accs: Vec<u8> = f32s.iter().flat_map(|b| b.to_le_bytes()).collect();
    for dtype in [DType::F16, DType::BF16] {
        let n = all.len() / 2;
        let name = kernel_name(Shape::ToAcc, dtype, ReduceOp::Sum).unwrap();
        let got = d.run(
            &name,
            Grid(1, 5),
            n,
            1,
            &[Operand {
                misalign: 0,
                bytes: all.clone(),
            }],
            &[(0, n * 4)],
            None,
        );
        let mut want = vec![0u8; n * 4];
        reduce::to_acc(dtype, &mut want, &all);
        for e in 0..n {
            assert_eq!(
                got[0][e * 4..e * 4 + 4],
                want[e * 4..e * 4 + 4],
                "{dtype} load of bits {e:#06x}"
            );
        }
        let n = f32s.len();
        let name = kernel_name(Shape::FinishAcc, dtype, ReduceOp::Sum).unwrap();
        let got = d.run(
            &name,
            Grid(1, 5),
            n,
            1,
            &[Operand {
                misalign: 0,
                bytes: accs.clone(),
            }],
            &[(0, n * 2)],
            None,
        );
        let mut want = vec![0u8; n * 2];
        reduce::finish_acc(dtype, ReduceOp::Sum, 1, &mut want, &accs);
        for e in 0..n {
            assert_eq!(
                got[0][e * 2..e * 2 + 2],
                want[e * 2..e * 2 + 2],
                "{dtype} rounding of f32 bits {:#010x}",
                f32s[e]
            );
        }
    }
    d.finish();
}

#[test]
fn integer_avg_and_wrapping_edges_match_braid_core() {
    // The edges random data rarely hits: MIN / 1, MIN / 2, MAX + 1, MIN * -1, -1 / n for large n.
    let Some(exe) = build_driver(Build::Body) else {
        return;
    };
    let mut d = Driver::start(&exe);
    for dtype in [
        DType::I8,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
    ] {
        let s = dtype.size();
        let pattern = |v: i128| (v as u128).to_le_bytes()[..s].to_vec();
        let bits = (8 * s) as u32;
        let (min, max) = if matches!(dtype, DType::I8 | DType::I32 | DType::I64) {
            (-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1)
        } else {
            (0, (1i128 << bits) - 1)
        };
        let vals = [min, max, -1, 1, 0, min + 1, max - 1, 2, -2, 3];
        let a: Vec<u8> = vals.iter().flat_map(|&v| pattern(v)).collect();
        let b: Vec<u8> = vals.iter().rev().flat_map(|&v| pattern(v)).collect();
        for op in ReduceOp::ARITHMETIC {
            for nranks in [1u32, 2, 3, 7, 1 << 20, u32::MAX] {
                let name = kernel_name(Shape::Finalize, dtype, op).unwrap();
                let srcs = [
                    Operand {
                        misalign: 0,
                        bytes: a.clone(),
                    },
                    Operand {
                        misalign: 0,
                        bytes: b.clone(),
                    },
                ];
                let got = d.run(
                    &name,
                    Grid(1, 2),
                    vals.len(),
                    nranks,
                    &srcs,
                    &[(0, a.len())],
                    None,
                );
                let mut want = vec![0u8; a.len()];
                reduce::finalize(dtype, op, nranks as usize, &mut want, &a, Src::Buf(&b));
                assert_eq!(got[0], want, "{name} with nranks {nranks}");
            }
        }
    }
    d.finish();
}
