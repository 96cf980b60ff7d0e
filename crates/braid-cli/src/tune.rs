//! `braid tune`: measure every all-reduce algorithm at every size on this machine and write the
//! fastest per size to a tuning file (`BRAID_TUNE_FILE`), with measured link parameters.

use std::time::Instant;

use braid::tune::{LinkParams, Table, TableEntry, TuningFile};
use braid::{Algo, Collective, Communicator, DType, Error, ReduceOp};
use braid_core::reduce::{self, Src};

/// Interleaved timing rounds per point.
const TUNE_ROUNDS: usize = 5;

/// What to measure.
pub struct TuneArgs {
    pub min_bytes: usize,
    pub max_bytes: usize,
    pub factor: usize,
    pub iters: usize,
    pub warmup: usize,
    pub output: String,
}

/// Single-process copy and reduce rates (µs per byte) over `bytes`.
fn local_rates(bytes: usize) -> (f64, f64) {
    let a = vec![1u8; bytes];
    let b = vec![2u8; bytes];
    let mut out = vec![0u8; bytes];
    let reps = 5;
    out.copy_from_slice(&a);
    let t = Instant::now();
    for _ in 0..reps {
        out.copy_from_slice(&a);
        std::hint::black_box(&mut out);
    }
    let copy = t.elapsed().as_secs_f64() * 1e6 / (reps * bytes) as f64;
    let t = Instant::now();
    for _ in 0..reps {
        reduce::reduce_ordered(
            DType::F32,
            ReduceOp::Sum,
            &mut out,
            &[Src::Buf(&a), Src::Buf(&b)],
        );
    }
    let red = t.elapsed().as_secs_f64() * 1e6 / (reps * bytes) as f64;
    (copy, red)
}

/// Runs as one rank; rank 0 writes (or updates) the tuning file.
pub fn run(comm: &Communicator, a: &TuneArgs) -> Result<(), Error> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let sizes = crate::perf::sweep(a.min_bytes.max(4), a.max_bytes, a.factor);
    let max = sizes.iter().copied().max().unwrap_or(4);
    let send = vec![1u8; max];
    let mut recv = vec![0u8; max];
    let mut entries = Vec::new();
    let mut alpha_us = f64::MAX;
    if rank == 0 {
        println!(
            "# braid tune: {world} ranks, all-reduce float sum, {} iterations per point",
            a.iters
        );
        println!(
            "# {:>10}  {}  {:>8}",
            "size",
            Collective::AllReduce
                .algos()
                .iter()
                .map(|x| format!("{:>10}", x.name()))
                .collect::<Vec<_>>()
                .join(" "),
            "best"
        );
    }
    for &size in &sizes {
        let bytes = size / 4 * 4;
        // Interleaved rounds, median per algorithm: robust to whatever else the machine is doing.
        let algos = Collective::AllReduce.algos();
        let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); algos.len()];
        for round in 0..TUNE_ROUNDS {
            for (i, &algo) in algos.iter().enumerate() {
                comm.set_algorithm(Collective::AllReduce, Some(algo))?;
                if round == 0 {
                    for _ in 0..a.warmup {
                        comm.all_reduce_bytes(
                            &send[..bytes],
                            &mut recv[..bytes],
                            DType::F32,
                            ReduceOp::Sum,
                        )?;
                    }
                }
                comm.barrier()?;
                let t = Instant::now();
                for _ in 0..a.iters {
                    comm.all_reduce_bytes(
                        &send[..bytes],
                        &mut recv[..bytes],
                        DType::F32,
                        ReduceOp::Sum,
                    )?;
                }
                let mut x = [t.elapsed().as_secs_f64() * 1e6 / a.iters.max(1) as f64];
                comm.all_reduce_in_place(&mut x, ReduceOp::Max)?;
                rounds[i].push(x[0]);
            }
        }
        let times: Vec<(Algo, f64)> = algos
            .iter()
            .zip(&mut rounds)
            .map(|(a, r)| (*a, crate::perf::median(r)))
            .collect();
        comm.set_algorithm(Collective::AllReduce, None)?;
        let best = times
            .iter()
            .min_by(|x, y| x.1.total_cmp(&y.1))
            .map_or(Algo::Ring, |(a, _)| *a);
        if let Some((_, t)) = times.iter().find(|(al, _)| *al == Algo::Direct) {
            alpha_us = alpha_us.min(*t);
        }
        if rank == 0 {
            let cols: Vec<String> = times.iter().map(|(_, t)| format!("{t:>10.2}")).collect();
            println!("  {bytes:>10}  {}  {:>8}", cols.join(" "), best.name());
        }
        entries.push(TableEntry {
            max_bytes: bytes,
            algo: best.name().to_string(),
        });
    }
    if rank != 0 {
        return Ok(());
    }
    // Neighbouring sizes with the same winner merge into one entry; the last entry covers everything larger.
    let mut merged: Vec<TableEntry> = Vec::new();
    for e in entries {
        match merged.last_mut() {
            Some(last) if last.algo == e.algo => last.max_bytes = e.max_bytes,
            _ => merged.push(e),
        }
    }
    if let Some(last) = merged.last_mut() {
        last.max_bytes = usize::MAX;
    }
    let (copy, red) = local_rates(max.clamp(1 << 20, 64 << 20));
    let link = LinkParams {
        alpha_us: alpha_us.min(1e6),
        beta_us_per_byte: copy,
        gamma_us_per_byte: red,
    };
    let path = std::path::Path::new(&a.output);
    let mut file = if path.exists() {
        TuningFile::load(path)?
    } else {
        TuningFile {
            version: 1,
            shm: link,
            tcp: None,
            rdma: None,
            tables: vec![],
        }
    };
    file.shm = link;
    file.put(Table {
        collective: Collective::AllReduce.name().into(),
        world,
        entries: merged,
    });
    let text = serde_json::to_string_pretty(&file).expect("tuning file serialises");
    std::fs::write(path, text).map_err(|e| Error::io(format!("writing {}", a.output), e))?;
    println!(
        "# wrote {} (use it with BRAID_TUNE_FILE={})",
        a.output, a.output
    );
    Ok(())
}
