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
use support::{cxx, kernels_dir, scratch, unavailable};

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
    let dir = scratch(&format!("driver-{build:?}"));
    let exe = dir.join("driver");
    let host = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/host");
    let mut cmd = Command::new(cxx);
    cmd.args([
        "-std=c++17",
        "-O0",
        "-g",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-Wno-unknown-pragmas",
    ]);
    match build {
        Build::Body => cmd.args(["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]),
        Build::Simt => cmd.args(["-DBRAID_SIMT", "-fsanitize=thread"]),
    };
    let out = cmd
        .arg("-I")
        .arg(kernels_dir())
        .arg("-I")
        .arg(&host)
        .arg(host.join("driver.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("running the C++ compiler");
    assert!(
        out.status.success(),
        "building the {build:?} host driver failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// A grid: blocks × threads per block.
#[derive(Clone, Copy, Debug)]
struct Grid(u32, u32);

struct Driver {
    child: Child,
    input: BufWriter<ChildStdin>,
    output: BufReader<ChildStdout>,
}

/// One operand of a request.
struct Operand {
    misalign: u32,
    bytes: Vec<u8>,
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

    /// Runs kernel `name` over `grid`; returns each destination's bytes.
    #[allow(clippy::too_many_arguments)]
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

    fn finish(mut self) {
        drop(self.input);
        let status = self.child.wait().unwrap();
        assert!(
            status.success(),
            "the host driver exited with {status} (a sanitizer report is above)"
        );
    }
}

/// xorshift64*: reproducible inputs without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `count` elements of `dtype` (or of its accumulator type when `acc`): random bits for integers; for
/// floats mostly small values whose sums round (with now and then a NaN, an infinity, a signed zero, a
/// subnormal or random bits).
fn data(rng: &mut Rng, dtype: DType, acc: bool, count: usize) -> Vec<u8> {
    let t = if acc { dtype.accumulator() } else { dtype };
    let mut out = Vec::with_capacity(count * t.size());
    for _ in 0..count {
        let r = rng.next();
        let special = rng.below(16) == 0;
        let x = (rng.below(20001) as f64 - 10000.0) / 64.0 * (1.0 + (r % 7) as f64 / 3.0);
        let pick = rng.below(6);
        match t {
            DType::F32 => {
                let v = if !special {
                    x as f32
                } else {
                    [
                        f32::NAN,
                        f32::INFINITY,
                        -0.0,
                        1e-40,
                        f32::from_bits(r as u32),
                        65504.0,
                    ][pick as usize]
                };
                out.extend(v.to_le_bytes());
            }
            DType::F64 => {
                let v = if !special {
                    x
                } else {
                    [
                        f64::NAN,
                        f64::NEG_INFINITY,
                        -0.0,
                        1e-310,
                        f64::from_bits(r),
                        3.0,
                    ][pick as usize]
                };
                out.extend(v.to_le_bytes());
            }
            DType::F16 => {
                let v = if !special {
                    half::f16::from_f64(x)
                } else {
                    half::f16::from_bits(r as u16)
                };
                out.extend(v.to_le_bytes());
            }
            DType::BF16 => {
                let v = if !special {
                    half::bf16::from_f64(x)
                } else {
                    half::bf16::from_bits(r as u16)
                };
                out.extend(v.to_le_bytes());
            }
            _ => {
                // Integers: mostly small values (products stay interesting), sometimes full-width bits.
                let v = if special { r } else { (r % 7).wrapping_sub(3) };
                out.extend(&v.to_le_bytes()[..t.size()]);
            }
        }
    }
    out
}

/// braid-core's answer for `shape` (every destination gets the same bytes).
fn reference(
    shape: Shape,
    dtype: DType,
    op: ReduceOp,
    nranks: usize,
    srcs: &[Vec<u8>],
    count: usize,
) -> Vec<u8> {
    let dsize = if shape.destinations()[0] {
        dtype.accumulator().size()
    } else {
        dtype.size()
    };
    let mut out = vec![0u8; count * dsize];
    match shape {
        Shape::ToAcc => reduce::to_acc(dtype, &mut out, &srcs[0]),
        Shape::Combine => reduce::combine(dtype, op, &mut out, &srcs[0], &srcs[1]),
        Shape::CombineAcc => {
            out.copy_from_slice(&srcs[0]);
            reduce::combine_acc(dtype, op, &mut out, &srcs[1]);
        }
        Shape::FinishAcc => reduce::finish_acc(dtype, op, nranks, &mut out, &srcs[0]),
        Shape::Finalize | Shape::Finalize2 => {
            reduce::finalize(dtype, op, nranks, &mut out, &srcs[0], Src::Buf(&srcs[1]))
        }
        Shape::Ordered(_) => {
            let s: Vec<Src<'_>> = srcs.iter().map(|b| Src::Buf(b)).collect();
            reduce::reduce_ordered(dtype, op, &mut out, &s);
        }
    }
    out
}

/// The ways operands are laid out in memory: misalignment of each operand, in bytes.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// Every operand 16-byte aligned.
    Aligned,
    /// Every operand shifted by the same number of elements: a scalar head, then the vector path.
    SameHead,
    /// Element-aligned operands that no head aligns together: the element path.
    Mismatched,
    /// Operands off their element alignment: the byte path.
    Bytes,
}

fn misalign(layout: Layout, rng: &mut Rng, elem: usize, shift: u64, i: usize) -> u32 {
    let m = match layout {
        Layout::Aligned => 0,
        Layout::SameHead => (shift as usize * elem) % 16,
        Layout::Mismatched => {
            // Operand 0 aligned, the others one element off (when an element is under 16 bytes; else a
            // further 8 bytes, which 8-byte types see as misaligned for 16-byte packs).
            if i == 0 {
                0
            } else {
                (elem % 16).max(8)
            }
        }
        Layout::Bytes => 1 + rng.below(elem.max(2) as u64 - 1) as usize,
    };
    m as u32
}

fn check_kernel(d: &mut Driver, rng: &mut Rng, shape: Shape, dtype: DType, op: ReduceOp) -> usize {
    let name = kernel_name(shape, dtype, op).unwrap();
    let (sacc, dacc) = (shape.sources(), shape.destinations());
    let size = |acc: bool| {
        if acc {
            dtype.accumulator().size()
        } else {
            dtype.size()
        }
    };
    let mut cases = 0;
    let group = 16 / dtype.size();
    // Lengths: empty, shorter than a pack, and odd lengths over the unrolled loop and its remainder.
    let counts = [
        0,
        1,
        group - 1,
        4 * group * 3 + 5,
        8 * group * 5 + group / 2 + 3,
        1021,
    ];
    let layouts = [
        Layout::Aligned,
        Layout::SameHead,
        Layout::Mismatched,
        Layout::Bytes,
    ];
    for (ci, &count) in counts.iter().enumerate() {
        for (li, &layout) in layouts.iter().enumerate() {
            if (ci + li) % 2 == 1 && count > group {
                continue; // every layout meets short and long lengths; not every pair is needed
            }
            // One thread, one partial warp, several blocks of odd size, two full warps in two blocks.
            let grid = [Grid(1, 1), Grid(1, 3), Grid(3, 7), Grid(2, 32)][(ci + li) % 4];
            let shift = 1 + rng.below(group as u64 - 1).min(group as u64);
            let nranks = match shape {
                Shape::Ordered(n) => n,
                _ => 1 + rng.below(6) as usize,
            };
            let srcs: Vec<Vec<u8>> = sacc.iter().map(|&a| data(rng, dtype, a, count)).collect();
            let ops: Vec<Operand> = srcs
                .iter()
                .zip(&sacc)
                .enumerate()
                .map(|(i, (b, &a))| Operand {
                    misalign: misalign(layout, rng, size(a), shift, i),
                    bytes: b.clone(),
                })
                .collect();
            let dsts: Vec<(u32, usize)> = dacc
                .iter()
                .enumerate()
                .map(|(j, &a)| {
                    (
                        misalign(layout, rng, size(a), shift, j + 1),
                        count * size(a),
                    )
                })
                .collect();
            // combine_acc runs in place (acc is source 0 and destination 0), as the executor runs it.
            let alias = (shape == Shape::CombineAcc).then_some(0);
            let got = d.run(&name, grid, count, nranks as u32, &ops, &dsts, alias);
            let want = reference(shape, dtype, op, nranks, &srcs, count);
            for (j, g) in got.iter().enumerate() {
                if *g != want {
                    let es = size(dacc[j]);
                    let first =
                        (0..count).find(|&e| g[e * es..(e + 1) * es] != want[e * es..(e + 1) * es]);
                    panic!(
                        "{name}: destination {j} differs from braid-core ({count} elements, {layout:?}, \
                         grid {grid:?}, nranks {nranks}), first at element {first:?}: got {:02x?}, want {:02x?}",
                        first.map(|e| &g[e * es..(e + 1) * es]),
                        first.map(|e| &want[e * es..(e + 1) * es])
                    );
                }
            }
            cases += 1;
        }
    }
    cases
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
        for op in ReduceOp::ALL {
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
