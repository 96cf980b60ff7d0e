//! The device-resident all-reduce (kernels/braid_collective.cuh) on the host: its `__global__` body,
//! run by tests/host/collective_driver.cpp on the SIMT runner under ThreadSanitizer, with every rank's
//! window in shared memory and the ranks either threads of one process (one grid: ThreadSanitizer sees
//! every rank's threads, so a missing barrier or fence between ranks is a reported race) or processes
//! (as CUDA IPC maps the windows on a real host).
//!
//! What is checked:
//! - results: every rank's output is, bit for bit, braid-core's CPU reference reducing the ranks'
//!   inputs in rank order (`reduce_ordered`), so all ranks agree with each other; over worlds of 1 to 8
//!   ranks, 1 to 3 blocks, the three modes (staged one-shot, staged two-shot, symmetric), every dtype
//!   and op the driver instantiates, counts of 0, 1, 7, 1000 and of many staging chunks (a count that
//!   divides into nothing), in place and not, NaN, infinities, signed zeros, subnormals and random bits
//!   as well as small integers (exact sums), NaNs of different payloads meeting in the arithmetic (the
//!   host build's float arithmetic is the CPU's, so even the payload must be braid-core's),
//!   collectives run back to back, and barrier epochs that cross 2^32;
//! - no data race: ThreadSanitizer reports nothing and the driver exits successfully;
//! - faults end every rank's collective with the right status, soon, never with a hang: a rank that
//!   never runs (a timeout naming it), the host's abort word (long before the deadline), and a rank that
//!   calls a different collective (a mismatch on every rank).
//!
//! What this does not show: the device-only code (inline PTX loads, stores and fences, `%globaltimer`)
//! and the GPU's weaker memory model; the GPU tests cover those.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use braid_core::reduce::{reduce_ordered, Src};
use braid_core::{DType, ReduceOp};
use support::cases::{data, Rng};
use support::{built_once, scratch};

/// The collective driver, built once (with ThreadSanitizer) for all the tests of this file.
fn driver() -> Option<PathBuf> {
    static EXE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let flags = ["-O1", "-Wno-unknown-pragmas", "-fsanitize=thread"];
    built_once(&EXE, "collective_driver.cpp", &flags)
}

/// How the driver runs the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ranks {
    /// Threads of one process, one grid: ThreadSanitizer sees every rank.
    Threads,
    /// One process per rank, forked after the windows are mapped shared.
    Procs,
}

impl Ranks {
    fn name(self) -> &'static str {
        match self {
            Ranks::Threads => "threads",
            Ranks::Procs => "procs",
        }
    }
}

/// What the inputs hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Values {
    /// support::cases::data: random values, with NaN, infinities, signed zeros, subnormals and random
    /// bits among the floats and full-width bits among the integers.
    Awkward,
    /// Integers in -4..=4 (0..=8 for u8): sums and averages that are exact.
    Small,
    /// Floats only: every other element a NaN of random sign and payload (quiet or signalling) on each
    /// rank, so NaNs of different payloads meet in the arithmetic; the rest small integers.
    Nans,
}

/// One run of the collective.
#[derive(Clone, Copy, Debug)]
struct Case {
    ranks: Ranks,
    world: usize,
    blocks: u32,
    threads: u32,
    mode: u32,
    dtype: DType,
    op: ReduceOp,
    count: usize,
    /// Bytes of one staging half.
    stage: usize,
    inplace: bool,
    iters: u32,
    /// The barrier epoch the windows start from.
    epoch: u32,
    values: Values,
}

const BASE: Case = Case {
    ranks: Ranks::Threads,
    world: 2,
    blocks: 2,
    threads: 32,
    mode: 0,
    dtype: DType::F32,
    op: ReduceOp::Sum,
    count: 1000,
    stage: 4096,
    inplace: false,
    iters: 1,
    epoch: 0,
    values: Values::Awkward,
};

/// The driver's name of `dtype`.
fn dtype_arg(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F64 => "f64",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::U8 => "u8",
        other => panic!("the collective driver has no {other} kernels"),
    }
}

impl Case {
    /// The driver's arguments (also how a failing case is named).
    fn args(&self) -> Vec<String> {
        vec![
            format!("ranks={}", self.ranks.name()),
            format!("world={}", self.world),
            format!("blocks={}", self.blocks),
            format!("threads={}", self.threads),
            format!("mode={}", self.mode),
            format!("dtype={}", dtype_arg(self.dtype)),
            format!("op={}", self.op.name()),
            format!("count={}", self.count),
            format!("stage={}", self.stage),
            format!("inplace={}", u32::from(self.inplace)),
            format!("iters={}", self.iters),
            format!("epoch={}", self.epoch),
            // Generous: a loaded machine must not turn a slow rank into a timeout.
            "timeout_ms=30000".into(),
        ]
    }

    fn name(&self) -> String {
        format!("{} values={:?}", self.args().join(" "), self.values)
    }

    /// Each rank's input, reproducible from the case itself.
    fn inputs(&self) -> Vec<Vec<u8>> {
        // FNV-1a of the case's name: a seed per case.
        let seed = self.name().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        let mut rng = Rng(seed | 1);
        (0..self.world)
            .map(|_| match self.values {
                Values::Awkward => data(&mut rng, self.dtype, false, self.count),
                Values::Small => small(&mut rng, self.dtype, self.count),
                Values::Nans => nans(&mut rng, self.dtype, self.count),
            })
            .collect()
    }

    /// braid-core's answer: the ranks' inputs reduced in rank order. In place, each collective after
    /// the first reduces the previous one's output (the same on every rank).
    fn reference(&self, inputs: &[Vec<u8>]) -> Vec<u8> {
        let mut out = vec![0u8; self.count * self.dtype.size()];
        let mut current = inputs.to_vec();
        for _ in 0..if self.inplace { self.iters } else { 1 } {
            let srcs: Vec<Src<'_>> = current.iter().map(|b| Src::Buf(b)).collect();
            reduce_ordered(self.dtype, self.op, &mut out, &srcs);
            current = vec![out.clone(); self.world];
        }
        out
    }
}

/// `count` small integers of `dtype`.
fn small(rng: &mut Rng, dtype: DType, count: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        let v = rng.below(9) as i64 - 4;
        match dtype {
            DType::F32 => out.extend((v as f32).to_le_bytes()),
            DType::F64 => out.extend((v as f64).to_le_bytes()),
            DType::F16 => out.extend(half::f16::from_f64(v as f64).to_le_bytes()),
            DType::BF16 => out.extend(half::bf16::from_f64(v as f64).to_le_bytes()),
            DType::U8 => out.push((v + 4) as u8),
            _ => out.extend(&v.to_le_bytes()[..dtype.size()]),
        }
    }
    out
}

/// `count` elements of the float type `dtype`, every other one (at random) a NaN of random sign and
/// payload, the others small integers.
fn nans(rng: &mut Rng, dtype: DType, count: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        let (r, nan) = (rng.next(), rng.below(2) == 0);
        let v = (r % 9) as f64 - 4.0;
        // Sign, all-ones exponent, a nonzero mantissa: a NaN whatever the other bits.
        match dtype {
            DType::F32 if nan => out.extend((0x7f80_0001 | r as u32).to_le_bytes()),
            DType::F64 if nan => out.extend((0x7ff0_0000_0000_0001 | r).to_le_bytes()),
            DType::F16 if nan => out.extend((0x7c01 | r as u16).to_le_bytes()),
            DType::BF16 if nan => out.extend((0x7f81 | r as u16).to_le_bytes()),
            DType::F32 => out.extend((v as f32).to_le_bytes()),
            DType::F64 => out.extend(v.to_le_bytes()),
            DType::F16 => out.extend(half::f16::from_f64(v).to_le_bytes()),
            DType::BF16 => out.extend(half::bf16::from_f64(v).to_le_bytes()),
            other => panic!("{other} has no NaN"),
        }
    }
    out
}

/// One rank's status line: `rank R status CODE PEER BLOCK`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Status {
    code: u32,
    peer: u32,
    block: u32,
}

const OK: u32 = 0;
const TIMEOUT: u32 = 1;
const ABORTED: u32 = 2;
const MISMATCH: u32 = 3;
const BAD_LAUNCH: u32 = 5;

/// What one run of the driver left.
struct Run {
    output: Output,
    elapsed: Duration,
    statuses: Vec<Status>,
}

impl Run {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }

    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.output.stderr).into_owned()
    }
}

/// Runs the driver over `dir` with `args`, all blocks of all `world` ranks at once, the SIMT runner's
/// waits bounded by `simt_timeout_ms`; checks that it exited successfully, that ThreadSanitizer
/// reported nothing and that it printed one status line per rank.
fn run_driver(
    exe: &Path,
    dir: &Path,
    args: &[String],
    (world, blocks, threads): (usize, u32, u32),
    simt_timeout_ms: u32,
) -> Run {
    let start = Instant::now();
    let output = Command::new(exe)
        .arg(dir)
        .args(args)
        .env(
            "BRAID_SIMT_MAX_THREADS",
            (world as u32 * blocks * threads).to_string(),
        )
        .env("BRAID_SIMT_TIMEOUT_MS", simt_timeout_ms.to_string())
        .env_remove("TSAN_OPTIONS")
        .output()
        .expect("running the collective driver");
    let elapsed = start.elapsed();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let what = args.join(" ");
    assert!(
        output.status.success(),
        "{what}: the driver failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    assert!(
        !stderr.contains("ThreadSanitizer"),
        "{what}: ThreadSanitizer reported:\n{stderr}"
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.len(),
        world,
        "{what}: one status line per rank expected:\n{stdout}\n{stderr}"
    );
    let statuses = lines
        .iter()
        .enumerate()
        .map(|(r, line)| {
            let f: Vec<&str> = line.split_whitespace().collect();
            assert!(
                f.len() == 6 && f[0] == "rank" && f[1] == r.to_string() && f[2] == "status",
                "{what}: a malformed status line for rank {r}: {line:?}"
            );
            let n = |s: &str| -> u32 {
                s.parse()
                    .unwrap_or_else(|_| panic!("{what}: {line:?} is malformed"))
            };
            Status {
                code: n(f[3]),
                peer: n(f[4]),
                block: n(f[5]),
            }
        })
        .collect();
    Run {
        output,
        elapsed,
        statuses,
    }
}

/// The first element where `got` and `want` differ, with the ranks' inputs there, as little-endian
/// bytes, for messages.
fn first_difference(got: &[u8], want: &[u8], inputs: &[Vec<u8>], size: usize) -> String {
    if got.len() != want.len() {
        return format!("{} bytes instead of {}", got.len(), want.len());
    }
    let elem = |b: &[u8], i: usize| format!("{:02x?}", &b[i * size..(i + 1) * size]);
    let differs = |i: &usize| elem(got, *i) != elem(want, *i);
    let n = got.len() / size;
    let i = (0..n).find(differs).expect("the buffers differ");
    let bad = (0..n).filter(differs).count();
    let ins: Vec<String> = inputs.iter().map(|b| elem(b, i)).collect();
    format!(
        "element {i} is {}, not {} ({bad} of {n} elements differ); the inputs there: {}",
        elem(got, i),
        elem(want, i),
        ins.join(" ")
    )
}

/// Runs `case` and checks every rank's status and output; returns how long the driver ran.
fn check(exe: &Path, dir: &Path, case: &Case) -> Duration {
    let name = case.name();
    let inputs = case.inputs();
    for (r, input) in inputs.iter().enumerate() {
        std::fs::write(dir.join(format!("in{r}.bin")), input).unwrap();
    }
    let want = case.reference(&inputs);
    // The SIMT runner's deadline beyond the kernel's (30 s): a hang is the kernel's to report.
    let geometry = (case.world, case.blocks, case.threads);
    let run = run_driver(exe, dir, &case.args(), geometry, 60_000);
    for (r, s) in run.statuses.iter().enumerate() {
        assert_eq!(
            (s.code, s.peer, s.block),
            (OK, 0, 0),
            "{name}: rank {r} failed:\n{}\n{}",
            run.stdout(),
            run.stderr()
        );
    }
    let outs: Vec<Vec<u8>> = (0..case.world)
        .map(|r| std::fs::read(dir.join(format!("out{r}.bin"))).unwrap())
        .collect();
    let size = case.dtype.size();
    for (r, out) in outs.iter().enumerate().skip(1) {
        assert!(
            *out == outs[0],
            "{name}: rank {r}'s output is not rank 0's: {}",
            first_difference(out, &outs[0], &inputs, size)
        );
    }
    assert!(
        outs[0] == want,
        "{name}: the output is not braid-core's reduction: {}",
        first_difference(&outs[0], &want, &inputs, size)
    );
    run.elapsed
}

/// Runs every case of `cases` in turn (in a scratch directory named `test`), then fails naming every
/// case that failed (each one's message is above it), so that one failure hides no other.
fn check_all(test: &str, cases: &[Case]) {
    let Some(exe) = driver() else { return };
    let dir = scratch(&format!("collective-{test}"));
    let start = Instant::now();
    let mut failed = Vec::new();
    for case in cases {
        match std::panic::catch_unwind(|| check(&exe, &dir, case)) {
            Ok(took) => println!("{took:>8.2?}  {}", case.name()),
            Err(_) => failed.push(case.name()),
        }
    }
    println!("{} cases in {:.2?}", cases.len(), start.elapsed());
    assert!(
        failed.is_empty(),
        "{} of {} cases failed:\n{}",
        failed.len(),
        cases.len(),
        failed.join("\n")
    );
}

#[test]
fn every_world_mode_and_block_count_gives_every_rank_the_reference_result() {
    let mut cases = Vec::new();
    for ranks in [Ranks::Threads, Ranks::Procs] {
        for world in 1..=4 {
            for mode in 0..3 {
                cases.push(Case {
                    ranks,
                    world,
                    mode,
                    blocks: 1 + (world as u32 + mode) % 3,
                    threads: 64,
                    inplace: (world as u32 + mode) % 2 == 1,
                    ..BASE
                });
            }
        }
    }
    // Eight ranks (the most a window has flags for), with few threads to bound the run time.
    for ranks in [Ranks::Threads, Ranks::Procs] {
        for mode in 0..3 {
            cases.push(Case {
                ranks,
                world: 8,
                mode,
                blocks: 1 + mode % 2,
                inplace: mode == 1,
                ..BASE
            });
        }
    }
    cases.push(Case {
        world: 8,
        mode: 1,
        blocks: 2,
        dtype: DType::I64,
        op: ReduceOp::Max,
        count: 3001,
        stage: 1024,
        ..BASE
    });
    check_all("worlds", &cases);
}

#[test]
fn counts_from_zero_to_many_staging_chunks_give_the_reference_result() {
    let mut cases = Vec::new();
    // Fewer elements than blocks, slices or vectors: empty parts, heads and tails only.
    for count in [0, 1, 7] {
        for mode in 0..3 {
            cases.push(Case {
                world: 3,
                blocks: 3,
                mode,
                count,
                inplace: count == 7,
                ..BASE
            });
        }
    }
    cases.push(Case {
        ranks: Ranks::Procs,
        world: 4,
        count: 1,
        mode: 1,
        ..BASE
    });
    // Many chunks through small staging halves, the last one partial (3001 is prime).
    for (i, (dtype, op, world)) in [
        (DType::F32, ReduceOp::Sum, 2),
        (DType::F16, ReduceOp::Sum, 3),
        (DType::BF16, ReduceOp::Avg, 4),
        (DType::U8, ReduceOp::Sum, 3),
        (DType::F64, ReduceOp::Sum, 3),
        (DType::I32, ReduceOp::Min, 4),
    ]
    .into_iter()
    .enumerate()
    {
        for mode in 0..2 {
            cases.push(Case {
                ranks: if i % 3 == 2 {
                    Ranks::Procs
                } else {
                    Ranks::Threads
                },
                world,
                mode,
                dtype,
                op,
                count: 3001,
                stage: if dtype.size() >= 4 { 1024 } else { 512 },
                blocks: 1 + (i as u32 + mode) % 3,
                inplace: (i as u32 + mode) % 2 == 0,
                values: if i % 2 == 0 {
                    Values::Awkward
                } else {
                    Values::Small
                },
                ..BASE
            });
        }
    }
    // A symmetric collective as large (it has no staging: one piece).
    cases.push(Case {
        world: 3,
        mode: 2,
        count: 3001,
        blocks: 3,
        ..BASE
    });
    check_all("counts", &cases);
}

#[test]
fn every_dtype_and_op_gives_the_reference_result_bit_for_bit() {
    let dtypes = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I32,
        DType::I64,
        DType::U8,
    ];
    let mut cases = Vec::new();
    for (d, &dtype) in dtypes.iter().enumerate() {
        for (o, &op) in ReduceOp::ARITHMETIC.iter().enumerate() {
            let i = (d * ReduceOp::ARITHMETIC.len() + o) as u32;
            // Awkward values (NaN, infinities, random bits) for every combination, small integers for
            // some more; every mode, block count and placement in turn.
            for values in [Values::Awkward, Values::Small] {
                if values == Values::Small && i % 4 != 0 {
                    continue;
                }
                let small = values == Values::Small;
                cases.push(Case {
                    ranks: if i % 4 == 3 {
                        Ranks::Procs
                    } else {
                        Ranks::Threads
                    },
                    world: 3 + (i as usize / 2 + usize::from(small)) % 2,
                    mode: (i + u32::from(small)) % 3,
                    blocks: 1 + (i / 3) % 3,
                    dtype,
                    op,
                    inplace: if small { i % 8 == 0 } else { i % 2 == 0 },
                    count: 301,
                    values,
                    ..BASE
                });
            }
        }
    }
    // NaNs of different payloads meeting in every op of every float type: the result's payload is
    // braid-core's too (the host build's arithmetic is the CPU's).
    for (i, dtype) in [DType::F32, DType::F16, DType::BF16, DType::F64]
        .into_iter()
        .enumerate()
    {
        for op in ReduceOp::ARITHMETIC {
            cases.push(Case {
                world: 2 + i % 3,
                mode: i as u32 % 3,
                dtype,
                op,
                count: 64,
                values: Values::Nans,
                ..BASE
            });
        }
    }
    check_all("dtypes", &cases);
}

#[test]
fn collectives_back_to_back_and_across_the_epoch_wrap_give_the_reference_result() {
    let mut cases = Vec::new();
    for ranks in [Ranks::Threads, Ranks::Procs] {
        for mode in 0..3 {
            // Three in a row over the same buffers (in place: each reduces the previous result),
            // several chunks each where staged, alternating staging halves.
            cases.push(Case {
                ranks,
                world: 3,
                mode,
                iters: 3,
                count: 2001,
                stage: 1024,
                blocks: 2,
                inplace: mode != 1,
                values: Values::Small,
                ..BASE
            });
            // The same from 6 below 2^32: the barrier counters wrap within the first collectives.
            cases.push(Case {
                ranks,
                world: 4,
                mode,
                iters: 3,
                epoch: 4_294_967_290,
                count: 1000,
                stage: 1024,
                blocks: 3 - mode % 2,
                inplace: mode == 1,
                ..BASE
            });
        }
    }
    check_all("iters", &cases);
}

/// Runs a fault case (world 4, blocks 2) and returns its statuses, after checking that the driver
/// ended cleanly and within 10 s.
fn fault(exe: &Path, dir: &Path, ranks: Ranks, mode: u32, extra: &[&str]) -> (Run, String) {
    let (world, blocks, threads) = (4usize, 2u32, 32u32);
    let bytes = 1000 * 4;
    for r in 0..world {
        std::fs::write(dir.join(format!("in{r}.bin")), vec![1u8; bytes]).unwrap();
    }
    let mut args = vec![
        format!("ranks={}", ranks.name()),
        format!("world={world}"),
        format!("blocks={blocks}"),
        format!("threads={threads}"),
        format!("mode={mode}"),
        "count=1000".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let run = run_driver(exe, dir, &args, (world, blocks, threads), 20_000);
    let what = format!("{}:\n{}{}", args.join(" "), run.stdout(), run.stderr());
    assert!(
        run.elapsed < Duration::from_secs(10),
        "{what}\nthe driver ran {:.2?}",
        run.elapsed
    );
    for s in &run.statuses {
        assert!(
            s.block < blocks && (s.peer as usize) < world,
            "{what}\na status names no block or rank of the run"
        );
    }
    (run, what)
}

/// With a rank missing no barrier can be passed: no rank may have written any of its output (the
/// driver's outputs start zeroed and every input element is 1).
fn assert_nothing_computed(dir: &Path, what: &str) {
    for r in 0..4 {
        let out = std::fs::read(dir.join(format!("out{r}.bin"))).unwrap();
        assert!(
            out.iter().all(|&b| b == 0),
            "{what}\nrank {r} wrote output though a rank never ran (a barrier passed without it)"
        );
    }
}

#[test]
fn a_rank_that_never_runs_times_its_peers_out_naming_it() {
    let Some(exe) = driver() else { return };
    let dir = scratch("collective-missing");
    for ranks in [Ranks::Threads, Ranks::Procs] {
        for mode in 0..3 {
            let (run, what) = fault(&exe, &dir, ranks, mode, &["missing=1", "timeout_ms=300"]);
            for (r, s) in run.statuses.iter().enumerate() {
                if r == 1 {
                    assert_eq!(
                        (s.code, s.peer, s.block),
                        (OK, 0, 0),
                        "{what}\nthe missing rank never ran"
                    );
                } else {
                    // The first failure of every present rank is its wait for rank 1: nothing else
                    // can fail first (the other ranks all arrive).
                    assert_eq!(
                        (s.code, s.peer),
                        (TIMEOUT, 1),
                        "{what}\nrank {r} did not time out waiting for rank 1"
                    );
                }
            }
            assert_nothing_computed(&dir, &what);
            println!("{:>8.2?}  {what}", run.elapsed);
        }
    }
}

#[test]
fn the_abort_word_ends_every_rank_long_before_the_deadline() {
    let Some(exe) = driver() else { return };
    let dir = scratch("collective-abort");
    // Block 0's threads also start apart (late_ms), its barrier's waiters last, well after block 1
    // was aborted: every thread of a block must act on the same reading of the status, or the
    // threads still running would pass the barrier without the waiters and reduce without rank 2.
    for (ranks, late_ms) in [(Ranks::Threads, 0), (Ranks::Procs, 0), (Ranks::Threads, 10)] {
        for mode in 0..3 {
            // The deadline is 100 s and the run must end within 10 s: only the abort can end it.
            let late = format!("late_ms={late_ms}");
            let extra = ["missing=2", "abort_ms=100", "timeout_ms=100000", &late];
            let (run, what) = fault(&exe, &dir, ranks, mode, &extra);
            for (r, s) in run.statuses.iter().enumerate() {
                if r == 2 {
                    assert_eq!(
                        (s.code, s.peer, s.block),
                        (OK, 0, 0),
                        "{what}\nthe missing rank never ran"
                    );
                } else {
                    // Aborted while waiting for some peer: rank 2, or one whose threads had not yet
                    // started when the abort came.
                    assert!(
                        s.code == ABORTED && s.peer as usize != r,
                        "{what}\nrank {r} was not aborted"
                    );
                }
            }
            assert_nothing_computed(&dir, &what);
            println!("{:>8.2?}  {what}", run.elapsed);
        }
    }
}

#[test]
fn a_rank_calling_another_collective_is_a_mismatch_on_every_rank() {
    let Some(exe) = driver() else { return };
    let dir = scratch("collective-mismatch");
    for ranks in [Ranks::Threads, Ranks::Procs] {
        for mode in 0..3 {
            let (run, what) = fault(&exe, &dir, ranks, mode, &["mismatch=3"]);
            for (r, s) in run.statuses.iter().enumerate() {
                // Rank 3 differs from every peer; the others differ from rank 3 only.
                assert!(
                    s.code == MISMATCH && s.peer as usize != r && (r == 3 || s.peer == 3),
                    "{what}\nrank {r} did not report the mismatch"
                );
            }
            println!("{:>8.2?}  {what}", run.elapsed);
        }
    }
}

#[test]
fn launches_the_kernel_cannot_serve_fail_on_every_rank() {
    let Some(exe) = driver() else { return };
    let dir = scratch("collective-bad-launch");
    let (world, blocks) = (4usize, 1u32);
    for r in 0..world {
        std::fs::write(dir.join(format!("in{r}.bin")), vec![1u8; 100 * 4]).unwrap();
    }
    // Fewer threads than ranks (the barriers need one thread per peer), and a staging half smaller
    // than the 16 bytes a chunk needs: every rank reports it instead of computing nothing.
    for (threads, extra) in [(2u32, "stage=4096"), (32, "stage=8")] {
        let args: Vec<String> = [
            "ranks=threads".to_string(),
            format!("world={world}"),
            format!("blocks={blocks}"),
            format!("threads={threads}"),
            "mode=0".into(),
            "count=100".into(),
            extra.into(),
        ]
        .into();
        let run = run_driver(&exe, &dir, &args, (world, blocks, threads), 20_000);
        let what = format!("{}:\n{}{}", args.join(" "), run.stdout(), run.stderr());
        for (r, s) in run.statuses.iter().enumerate() {
            assert_eq!(
                (s.code, s.peer as usize),
                (BAD_LAUNCH, r),
                "{what}\nrank {r} did not refuse the launch"
            );
        }
    }
}
