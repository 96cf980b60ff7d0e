//! The `braid` command: `braid run` starts ranks of any program; `braid perf` benchmarks a collective
//! (all-reduce by default); `braid compress-eval` measures what gradient compression costs in training
//! quality.

mod compress_bench;
mod device;
mod eval;
mod launch;
mod perf;
mod plot;
mod progress;
mod soak;
mod timeline;
mod tune;

use std::ffi::OsString;

use braid::{Communicator, DType, JobEnv, ReduceOp};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "braid",
    version,
    about = "Collective communication without NCCL: launcher and benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Many collectives of changing kinds and sizes, every result checked exactly, with descriptors and
    /// resident memory compared after a warm-up and at the end (exit 3 on a wrong result or growth).
    /// Runs N local ranks (--ranks), or one rank of a launcher's job.
    Soak {
        /// Local ranks to start (default 2 when not started by a launcher).
        #[arg(long)]
        ranks: Option<usize>,
        /// Collectives per rank.
        #[arg(short = 'n', long = "iters", default_value_t = 10_000)]
        iters: u64,
        /// Largest message in f32 elements.
        #[arg(long = "max-elems", default_value_t = 262_147)]
        max_elems: usize,
    },
    /// Print a fresh random communicator secret (32 hex digits) for BRAID_SECRET or BRAID_SECRET_FILE,
    /// for jobs whose launcher (torchrun, mpirun, srun) makes none.
    Secret,
    /// Start N ranks of a program on this host (like torchrun or mpirun); if one fails, stop the rest.
    Run {
        /// Number of ranks.
        #[arg(short = 'n', long = "nranks")]
        n: usize,
        /// The program and its arguments.
        #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
        command: Vec<OsString>,
    },
    /// Collective benchmark (all-reduce unless --collective says otherwise) with nccl-tests columns.
    /// Runs N local ranks (--ranks), or, started by a launcher (braid run, torchrun, mpirun, srun), as
    /// one rank of that job.
    Perf {
        /// Local ranks to start (default 2 when not started by a launcher).
        #[arg(long)]
        ranks: Option<usize>,
        /// Smallest size in bytes (suffixes K, M, G).
        #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = perf::parse_size)]
        min_bytes: usize,
        /// Largest size in bytes.
        #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = perf::parse_size)]
        max_bytes: usize,
        /// Size multiplication factor between steps (at least 2).
        #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
        factor: usize,
        /// Timed iterations per size.
        #[arg(short = 'n', long = "iters", default_value_t = 20)]
        iters: usize,
        /// Warm-up iterations per size.
        #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
        warmup: usize,
        /// Element type (float, double, half, bfloat16, int8, uint8, int32, uint32, int64, uint64).
        #[arg(short = 'd', long = "datatype", default_value = "float")]
        dtype: String,
        /// Reduction (sum, prod, max, min, avg).
        #[arg(short = 'o', long = "op", default_value = "sum")]
        op: String,
        /// Check results (1) or not (0).
        #[arg(short = 'c', long = "check", default_value_t = 1)]
        check: u8,
        /// Also write the results as JSON to this file.
        #[arg(long)]
        json: Option<String>,
        /// The collective to measure: all_reduce, broadcast, reduce, all_gather, reduce_scatter or
        /// all_to_all (broadcast and reduce from root 0). Sizes follow nccl-tests and are rounded down to
        /// what the collective can split.
        #[arg(long, default_value = "all_reduce")]
        collective: String,
        /// Algorithm of the collective (all-reduce: ring, tree, rhd, direct, hier; all-gather and
        /// reduce-scatter: ring, direct; broadcast and reduce: ring, tree); a comma-separated list
        /// (`ring,hier`) or `all` to measure each side by side (and mark the tuner's pick). Default:
        /// braid chooses.
        #[arg(long)]
        algo: Option<String>,
        /// Also plot busbw against size (log-log) to this PNG file.
        #[arg(long)]
        plot: Option<String>,
        /// Register the send buffer with the transports (`Communicator::register`), so that RDMA
        /// sends from it without a copy.
        #[arg(long)]
        register: bool,
        /// Put the buffers in memory every rank of the host maps (`Communicator::alloc`): the
        /// collectives run straight through it, with no staging copies; the bound column is then
        /// the memory traffic that path needs at the bandwidth measured with every core busy.
        #[arg(long)]
        shared: bool,
        /// Where the buffers live: host (default), cuda (each rank's GPU: device memory, the ipc
        /// transport's rings in GPU memory, the CUDA kernels) or emulated (device memory emulated in
        /// host memory, for machines without a GPU). all_reduce, broadcast, reduce, all_gather and
        /// reduce_scatter; every rank on one host.
        #[arg(long, default_value = "host")]
        device: String,
    },
    /// Compression side by side: each codec's throughput against memcpy, then the dense and the
    /// compressed all-reduce of one gradient (time, speed-up, bytes sent). Runs N local ranks (--ranks),
    /// or, started by a launcher, as one rank of that job.
    CompressBench {
        /// Local ranks to start (default 2 when not started by a launcher).
        #[arg(long)]
        ranks: Option<usize>,
        /// Gradient size in bytes (suffixes K, M, G).
        #[arg(short = 's', long, default_value = "64M", value_parser = perf::parse_size)]
        size: usize,
        /// Codec settings, comma-separated.
        #[arg(
            long,
            default_value = "topk:0.1,topk:0.01,randomk:0.1,int8,sign,fp16,powersgd:4"
        )]
        codecs: String,
        /// Timed rounds (after one warm-up round).
        #[arg(short = 'n', long, default_value_t = 5)]
        rounds: usize,
        /// Sparse paths each top-k codec runs with, comma-separated: auto, allgather, reducescatter.
        #[arg(long, default_value = "auto")]
        sparse: String,
    },
    /// Print the topology. Alone: this host's NUMA nodes, GPUs and NICs. Started by a launcher
    /// (`braid run -n N -- braid topo`, or across hosts): where every rank is, how each peer is reached,
    /// and, with BRAID_TOPO_PROBE=1, what probing measured. BRAID_TOPO_DUMP_FILE writes it as a file.
    Topo,
    /// Summarise BRAID_TIMELINE files (one per rank): per rank, the time spent in compute spans and in
    /// collectives, and how much of it overlapped; optionally merge them into one trace (Perfetto opens
    /// it) and draw them as a PNG.
    Timeline {
        /// The ranks' files (trace.rank0.json trace.rank1.json ...).
        files: Vec<String>,
        /// Write the files merged into one trace here.
        #[arg(long)]
        merge: Option<String>,
        /// Draw the timeline into this PNG.
        #[arg(long)]
        png: Option<String>,
        /// Width of the picture in pixels.
        #[arg(long, default_value_t = 1600)]
        width: u32,
    },
    /// Measure every all-reduce algorithm at every size and write the fastest per size to a tuning file
    /// (use it with BRAID_TUNE_FILE).
    Tune {
        /// Rank counts to tune for, comma-separated (each is run locally).
        #[arg(long, default_value = "2,4", value_delimiter = ',')]
        ranks: Vec<usize>,
        /// The tuning file to write (tables for other rank counts in it are kept).
        #[arg(short = 'o', long, default_value = "braid-tune.json")]
        output: String,
        /// Smallest size in bytes.
        #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = perf::parse_size)]
        min_bytes: usize,
        /// Largest size in bytes.
        #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = perf::parse_size)]
        max_bytes: usize,
        /// Size multiplication factor between steps (at least 2).
        #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
        factor: usize,
        /// Timed iterations per point.
        #[arg(short = 'n', long = "iters", default_value_t = 10)]
        iters: usize,
        /// Warm-up iterations per point.
        #[arg(short = 'w', long = "warmup_iters", default_value_t = 3)]
        warmup: usize,
    },
    /// Train a small MLP data-parallel over N local ranks once per (gradient codec × optimizer) and compare
    /// final loss, accuracy and bytes sent against dense all-reduce.
    #[command(name = "compress-eval")]
    CompressEval {
        /// Local ranks to start (default 2 when not started by a launcher).
        #[arg(long)]
        ranks: Option<usize>,
        /// Task: teacher (a random teacher MLP labels Gaussian inputs), wine (the UCI red wine quality
        /// data, 6 grades) or spirals (two interleaved spirals).
        #[arg(long, default_value = "teacher")]
        task: String,
        /// Settings, comma-separated, in the compression grammar: CODEC[/OPTION]..., e.g. dense, fp16,
        /// topk:0.1, topk:0.1/noef, topk:0.01/momentum=0.9/warmup=150, topk:0.01/adam=150,
        /// topk:0.01/gclip=0.5, int8-stochastic, sign, powersgd:4. Default: a list for --quick, a longer
        /// one otherwise.
        #[arg(long)]
        codecs: Option<String>,
        /// Optimizers, comma-separated: sgd (momentum 0.9), adam.
        #[arg(long, default_value = "sgd,adam")]
        optimizers: String,
        /// Training steps per run (default 600 with --quick, else 1500).
        #[arg(long)]
        steps: Option<u64>,
        /// A small model, a small data set, fewer steps and settings: done in well under a minute.
        #[arg(long)]
        quick: bool,
        /// Global batch size (split over the ranks).
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// Seed of the data, and the first seed of initialisation, batch order and codecs.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Seeds per setting and optimizer (seed, seed + 1, ...); default 2 with --quick, else 3.
        #[arg(long)]
        seeds: Option<usize>,
        /// Learning rate of SGD.
        #[arg(long, default_value_t = 0.05)]
        lr_sgd: f32,
        /// Learning rate of Adam.
        #[arg(long, default_value_t = 0.005)]
        lr_adam: f32,
        /// Directory for the PNG plots (loss, gradient norm, compression error per optimizer).
        #[arg(long)]
        out: Option<String>,
        /// Also write the results as JSON to this file.
        #[arg(long)]
        json: Option<String>,
        /// Synchronise compressed gradients with the local reference (compress on each rank, all-gather
        /// the encodings, sum in rank order) instead of the communicator's compressed all-reduce.
        #[arg(long)]
        gather: bool,
        /// Do not tell the compressor the learning rate: its error buffers then hold gradients, and a
        /// held-back gradient is applied at the (smaller) rate of the step that finally sends it.
        #[arg(long)]
        no_lr_rescale: bool,
    },
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::CompressEval {
            ranks,
            task,
            codecs,
            optimizers,
            steps,
            quick,
            batch,
            seed,
            seeds,
            lr_sgd,
            lr_adam,
            out,
            json,
            gather,
            no_lr_rescale,
        } => {
            let args = (|| -> Result<eval::EvalArgs, String> {
                let task: eval::Task = task.parse()?;
                let settings = match codecs {
                    Some(list) => eval::parse_list(&list, "codecs", |t| t.parse())?,
                    None => eval::default_settings(quick),
                };
                let optimizers = eval::parse_list(&optimizers, "optimizers", |t| t.parse())?;
                let steps = steps.unwrap_or_else(|| eval::default_steps(quick));
                if steps == 0 || batch == 0 {
                    return Err("--steps and --batch must be at least 1".into());
                }
                for (name, lr) in [("--lr-sgd", lr_sgd), ("--lr-adam", lr_adam)] {
                    if !(lr > 0.0 && lr.is_finite()) {
                        return Err(format!("{name} must be a positive number, got {lr}"));
                    }
                }
                if ranks == Some(0) {
                    return Err("--ranks must be at least 1".into());
                }
                if seeds == Some(0) {
                    return Err("--seeds must be at least 1".into());
                }
                Ok(eval::EvalArgs {
                    task,
                    settings,
                    optimizers,
                    steps,
                    quick,
                    batch,
                    seed,
                    seeds: seeds.unwrap_or_else(|| eval::default_seeds(quick)),
                    lr_sgd,
                    lr_adam,
                    out,
                    json,
                    gather,
                    lr_rescale: !no_lr_rescale,
                })
            })();
            match args {
                Err(e) => {
                    eprintln!("braid compress-eval: {e}");
                    2
                }
                Ok(args) => eval_main(ranks, &args),
            }
        }
        Cmd::Run { n, command } => launch::run(n, &command[0], &command[1..], &[]),
        Cmd::Topo => topo_main(),
        Cmd::Timeline {
            files,
            merge,
            png,
            width,
        } => match timeline::run(&files, merge.as_deref(), png.as_deref(), width) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("braid timeline: {e}");
                2
            }
        },
        Cmd::Secret => secret_main(),
        Cmd::Soak {
            ranks,
            iters,
            max_elems,
        } => soak_main(ranks, &soak::SoakArgs { iters, max_elems }),
        Cmd::CompressBench {
            ranks,
            size,
            codecs,
            rounds,
            sparse,
        } => {
            let specs: Result<Vec<braid::CodecSpec>, _> =
                codecs.split(',').map(|c| c.trim().parse()).collect();
            let paths: Result<Vec<braid::SparsePath>, _> =
                sparse.split(',').map(str::parse).collect();
            match (specs, paths) {
                (Err(e), _) => {
                    eprintln!("braid compress-bench: --codecs: {e}");
                    2
                }
                (_, Err(e)) => {
                    eprintln!(
                        "braid compress-bench: --sparse {}: {e}",
                        braid::braid_compress::echo_input(&sparse)
                    );
                    2
                }
                (Ok(codecs), Ok(sparse)) => {
                    let args = compress_bench::BenchArgs {
                        bytes: size / 4 * 4,
                        codecs,
                        rounds: rounds.max(1),
                        sparse,
                    };
                    as_ranks("compress-bench", ranks, |c| {
                        compress_bench::run(c, &args).map(|_| 0)
                    })
                }
            }
        }
        Cmd::Tune {
            ranks,
            output,
            min_bytes,
            max_bytes,
            factor,
            iters,
            warmup,
        } => {
            if let Err(e) = check_factor(factor) {
                eprintln!("braid tune: {e}");
                2
            } else {
                let args = tune::TuneArgs {
                    min_bytes,
                    max_bytes,
                    factor,
                    iters,
                    warmup,
                    output,
                };
                tune_main(&ranks, &args)
            }
        }
        Cmd::Perf {
            ranks,
            min_bytes,
            max_bytes,
            factor,
            iters,
            warmup,
            dtype,
            op,
            check,
            json,
            collective,
            algo,
            plot,
            register,
            shared,
            device,
        } => {
            let args = (|| -> Result<perf::PerfArgs, String> {
                let collective = perf::parse_collective(&collective)?;
                let dtype: DType = dtype.parse().map_err(|e: braid::Error| e.to_string())?;
                let op: ReduceOp = op.parse().map_err(|e: braid::Error| e.to_string())?;
                if min_bytes > max_bytes {
                    return Err(format!("-b {min_bytes} is larger than -e {max_bytes}"));
                }
                check_factor(factor)?;
                if let Some(list) = algo.as_deref().filter(|a| *a != "all") {
                    for a in list.split(',') {
                        let algo = a.parse::<braid::Algo>().map_err(|e| e.to_string())?;
                        if !collective.algos().contains(&algo) {
                            let names: Vec<&str> =
                                collective.algos().iter().map(|a| a.name()).collect();
                            return Err(format!(
                                "--algo {algo}: {collective} has {}",
                                names.join(", ")
                            ));
                        }
                    }
                }
                Ok(perf::PerfArgs {
                    collective,
                    min_bytes,
                    max_bytes,
                    factor,
                    iters,
                    warmup,
                    dtype,
                    op,
                    check: check != 0,
                    json,
                    algo,
                    plot,
                    register,
                    shared,
                    device: device.parse()?,
                })
            })();
            match args {
                Err(e) => {
                    eprintln!("braid perf: {e}");
                    2
                }
                Ok(args) => perf_main(ranks, &args),
            }
        }
    };
    std::process::exit(code);
}

fn secret_main() -> i32 {
    let any = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    match braid::UniqueId::unbound(any) {
        Ok(id) => {
            println!("{}", id.secret_hex());
            0
        }
        Err(e) => {
            eprintln!("braid secret: {e}");
            1
        }
    }
}

/// The step factor between sizes must grow them: with 0 or 1 a sweep would stop at its first size.
fn check_factor(factor: usize) -> Result<(), String> {
    if factor < 2 {
        return Err(format!(
            "-f {factor}: the step factor must be at least 2 (for a single size, give -b and -e alike)"
        ));
    }
    Ok(())
}

fn topo_main() -> i32 {
    if !JobEnv::present() {
        let host = braid::braid_topo::detect_local();
        match braid::braid_topo::Topology::single_host(host, 1, braid::braid_topo::Source::Detected)
        {
            Ok(t) => {
                print!("{}", t.describe());
                0
            }
            Err(e) => {
                eprintln!("braid topo: {e}");
                1
            }
        }
    } else {
        let comm = match Communicator::from_env() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("braid topo: {e}");
                return 1;
            }
        };
        if comm.rank() == 0 {
            print!("{}", comm.topology().describe());
            println!("transports: {}", comm.transports_summary());
            println!("rank 0 reaches: {}", comm.peer_transports().join(" "));
        }
        // Nobody leaves before rank 0 has printed.
        match comm.barrier() {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("braid topo: {e}");
                1
            }
        }
    }
}

fn soak_main(ranks: Option<usize>, args: &soak::SoakArgs) -> i32 {
    as_ranks("soak", ranks, |comm| {
        let r = soak::run(comm, args)?;
        println!(
            "rank {}: {} collectives in {:.1} s, {} wrong; descriptors {} -> {}; resident memory {} -> {} KiB{}",
            comm.rank(),
            r.ops,
            r.seconds,
            r.wrong,
            r.fds.0,
            r.fds.1,
            r.rss_kib.0,
            r.rss_kib.1,
            if r.clean() { "" } else { "  NOT CLEAN" }
        );
        Ok(if r.clean() { 0 } else { 3 })
    })
}

fn perf_main(ranks: Option<usize>, args: &perf::PerfArgs) -> i32 {
    as_ranks("perf", ranks, |comm| {
        perf::run(comm, args).map(|wrong| if wrong == 0 { 0 } else { 3 })
    })
}

/// Runs `body` as one rank of the job this process belongs to, or, without a job (or with `--ranks`),
/// starts `ranks` copies of this very command (without `--ranks`) under the launcher.
fn as_ranks(
    name: &str,
    ranks: Option<usize>,
    body: impl FnOnce(&Communicator) -> Result<i32, braid::Error>,
) -> i32 {
    if ranks.is_none() && JobEnv::present() {
        let comm = match Communicator::from_env() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("braid {name}: {e}");
                return 1;
            }
        };
        return match body(&comm) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("braid {name}: rank {}: {e}", comm.rank());
                1
            }
        };
    }
    let n = ranks.unwrap_or(2);
    let exe = match std::env::current_exe() {
        Ok(p) => p.into_os_string(),
        Err(e) => {
            eprintln!("braid {name}: cannot find this executable: {e}");
            return 1;
        }
    };
    let mut rest: Vec<OsString> = Vec::new();
    let mut it = std::env::args_os().skip(1).peekable();
    while let Some(a) = it.next() {
        if a == "--ranks" {
            it.next();
        } else if a.to_string_lossy().starts_with("--ranks=") {
        } else {
            rest.push(a);
        }
    }
    launch::run(n, &exe, &rest, &[])
}

/// Runs `braid compress-eval` as one rank of a job, or starts the ranks.
fn eval_main(ranks: Option<usize>, args: &eval::EvalArgs) -> i32 {
    as_ranks("compress-eval", ranks, |comm| match eval::run(comm, args) {
        Ok(_) => Ok(0),
        Err(e) => {
            eprintln!("braid compress-eval: rank {}: {e}", comm.rank());
            Ok(1)
        }
    })
}

/// Runs `braid tune` as one rank of a job, or launches it for each rank count.
fn tune_main(ranks: &[usize], args: &tune::TuneArgs) -> i32 {
    if JobEnv::present() {
        let comm = match Communicator::from_env() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("braid tune: {e}");
                return 1;
            }
        };
        return match tune::run(&comm, args) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("braid tune: rank {}: {e}", comm.rank());
                1
            }
        };
    }
    let exe = match std::env::current_exe() {
        Ok(p) => p.into_os_string(),
        Err(e) => {
            eprintln!("braid tune: cannot find this executable: {e}");
            return 1;
        }
    };
    let rest: Vec<OsString> = std::env::args_os().skip(1).collect();
    for &n in ranks {
        let code = launch::run(n, &exe, &rest, &[]);
        if code != 0 {
            return code;
        }
    }
    0
}
