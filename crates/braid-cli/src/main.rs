//! The `braid` command: `braid run` starts ranks of any program; `braid perf` benchmarks all-reduce.

mod launch;
mod perf;
mod plot;
mod progress;
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
    /// Start N ranks of a program on this host (like torchrun or mpirun); if one fails, stop the rest.
    Run {
        /// Number of ranks.
        #[arg(short = 'n', long = "nranks")]
        n: usize,
        /// The program and its arguments.
        #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
        command: Vec<OsString>,
    },
    /// All-reduce benchmark with nccl-tests columns. Runs N local ranks (--ranks), or, started by a
    /// launcher (braid run, torchrun, mpirun, srun), as one rank of that job.
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
        /// Size multiplication factor between steps.
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
        /// All-reduce algorithm: ring, tree, rhd, direct, hier; a comma-separated list (`ring,hier`) or
        /// `all` to measure each side by side (and mark the tuner's pick). Default: braid chooses.
        #[arg(long)]
        algo: Option<String>,
        /// Also plot busbw against size (log-log) to this PNG file.
        #[arg(long)]
        plot: Option<String>,
    },
    /// Print the topology. Alone: this host's NUMA nodes, GPUs and NICs. Started by a launcher
    /// (`braid run -n N -- braid topo`, or across hosts): where every rank is, how each peer is reached,
    /// and, with BRAID_TOPO_PROBE=1, what probing measured. BRAID_TOPO_DUMP_FILE writes it as a file.
    Topo,
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
        /// Size multiplication factor between steps.
        #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
        factor: usize,
        /// Timed iterations per point.
        #[arg(short = 'n', long = "iters", default_value_t = 10)]
        iters: usize,
        /// Warm-up iterations per point.
        #[arg(short = 'w', long = "warmup_iters", default_value_t = 3)]
        warmup: usize,
    },
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Run { n, command } => launch::run(n, &command[0], &command[1..], &[]),
        Cmd::Topo => topo_main(),
        Cmd::Tune {
            ranks,
            output,
            min_bytes,
            max_bytes,
            factor,
            iters,
            warmup,
        } => {
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
            algo,
            plot,
        } => {
            let args = (|| -> Result<perf::PerfArgs, String> {
                let dtype: DType = dtype.parse().map_err(|e: braid::Error| e.to_string())?;
                let op: ReduceOp = op.parse().map_err(|e: braid::Error| e.to_string())?;
                if min_bytes > max_bytes {
                    return Err(format!("-b {min_bytes} is larger than -e {max_bytes}"));
                }
                if let Some(list) = algo.as_deref().filter(|a| *a != "all") {
                    for a in list.split(',') {
                        a.parse::<braid::Algo>().map_err(|e| e.to_string())?;
                    }
                }
                Ok(perf::PerfArgs {
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

fn perf_main(ranks: Option<usize>, args: &perf::PerfArgs) -> i32 {
    if ranks.is_none() && JobEnv::present() {
        let comm = match Communicator::from_env() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("braid perf: {e}");
                return 1;
            }
        };
        return match perf::run(&comm, args) {
            Ok(0) => 0,
            Ok(_) => 3,
            Err(e) => {
                eprintln!("braid perf: rank {}: {e}", comm.rank());
                1
            }
        };
    }
    // Start the ranks: this same command, under our launcher, without --ranks.
    let n = ranks.unwrap_or(2);
    let exe = match std::env::current_exe() {
        Ok(p) => p.into_os_string(),
        Err(e) => {
            eprintln!("braid perf: cannot find this executable: {e}");
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
