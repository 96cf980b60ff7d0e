//! `braid compress-bench`: what compression costs and saves, side by side in one run.
//!
//! Rank 0 first times each codec alone (error feedback plus compress, as a step does) in GB/s of gradient,
//! next to a memcpy of the same bytes. Then every rank times the dense all-reduce and the compressed
//! all-reduce of each codec on the same gradient, interleaved in rounds, and rank 0 prints the medians, the
//! speed-up over dense and the bytes each rank sent against dense. Top-k codecs run once per sparse path
//! asked for (`--sparse allgather,reducescatter` puts the all-gather of pairs and the reduce-scatter side
//! by side), and the path each setting took is printed with it.

use std::time::Instant;

use braid::braid_compress::ErrorFeedback;
use braid::{
    CodecSpec, Communicator, CompressedPath, CompressionConfig, Error, GradientCompressor,
    ReduceOp, SparsePath,
};

use crate::perf::median;

/// What to measure.
pub struct BenchArgs {
    /// Gradient size in bytes (f32).
    pub bytes: usize,
    /// Codec settings.
    pub codecs: Vec<CodecSpec>,
    /// Timed rounds (each runs every setting once).
    pub rounds: usize,
    /// The sparse paths each top-k codec runs with.
    pub sparse: Vec<SparsePath>,
}

/// The short name of a path, for the table.
fn path_name(p: Option<CompressedPath>) -> &'static str {
    match p {
        None | Some(CompressedPath::Dense) => "dense",
        Some(CompressedPath::SumClosed) => "sum-closed",
        Some(CompressedPath::PowerIteration) => "power-iteration",
        Some(CompressedPath::SparseAllGather) => "all-gather",
        Some(CompressedPath::SparseDenseSwitch) => "dense-switch",
        Some(CompressedPath::SparseReduceScatter) => "reduce-scatter",
        Some(CompressedPath::TwoPhase) => "two-phase",
    }
}

/// A gradient with some structure: mostly small values and a few large ones, different on every rank.
fn gradient(len: usize, rank: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let x =
                ((i as u64 * 2_654_435_761 + rank as u64 * 97) % 10_007) as f32 / 10_007.0 - 0.5;
            if i % 97 == 0 {
                x * 40.0
            } else {
                x
            }
        })
        .collect()
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// Runs the benchmark on this rank; rank 0 prints.
pub fn run(comm: &Communicator, a: &BenchArgs) -> Result<(), Error> {
    let len = a.bytes / 4;
    let grad = gradient(len, comm.rank());
    if comm.rank() == 0 {
        println!(
            "# braid compress-bench: {} ranks over {}, {} MiB of f32 gradient, {} rounds",
            comm.world_size(),
            comm.transports_summary(),
            a.bytes >> 20,
            a.rounds
        );
        let mut dst = vec![0f32; len];
        let t = Instant::now();
        for _ in 0..3 {
            dst.copy_from_slice(&grad);
        }
        let copy = gbps(a.bytes, t.elapsed().as_secs_f64() / 3.0);
        std::hint::black_box(&dst);
        println!("# codec alone (error feedback + compress), GB/s of gradient; memcpy of the same bytes: {copy:.2} GB/s");
        println!(
            "# {:<22} {:>10} {:>9} {:>12}",
            "codec", "GB/s", "/memcpy", "wire/dense"
        );
        for spec in &a.codecs {
            let Some(mut codec) = spec.local_codec(1)? else {
                continue;
            };
            let mut ef = ErrorFeedback::new(len);
            let mut times = Vec::new();
            let mut ratio = 0.0;
            for step in 0..3 {
                let t = Instant::now();
                let (c, stats) = ef
                    .step(&grad, codec.as_mut(), step)
                    .map_err(|e| Error::invalid(e.to_string()))?;
                times.push(t.elapsed().as_secs_f64());
                ratio = stats.wire_bytes as f64 / stats.dense_bytes as f64;
                std::hint::black_box(c);
            }
            let g = gbps(a.bytes, median(&mut times));
            println!(
                "  {:<22} {g:>10.2} {:>8.0}% {:>11.1}%",
                spec.to_string(),
                100.0 * g / copy,
                100.0 * ratio
            );
        }
    }
    comm.barrier()?;
    // All-reduce: dense and every codec, interleaved in rounds.
    let mut settings: Vec<(String, Option<GradientCompressor>)> = vec![("dense".into(), None)];
    for spec in &a.codecs {
        let sparse = matches!(
            spec,
            CodecSpec::TopK { .. } | CodecSpec::ThresholdTopK { .. }
        );
        let paths: &[SparsePath] = if sparse {
            &a.sparse
        } else {
            &[SparsePath::Auto]
        };
        for path in paths {
            let config = CompressionConfig {
                codec: *spec,
                sparse_path: *path,
                ..CompressionConfig::default()
            };
            let name = if sparse && a.sparse.len() > 1 {
                format!("{spec} {path}")
            } else {
                spec.to_string()
            };
            settings.push((name, Some(GradientCompressor::new(config, len)?)));
        }
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); settings.len()];
    let mut sent = vec![0u64; settings.len()];
    let mut took = vec![None; settings.len()];
    let mut buf = grad.clone();
    let dense_sent = 2 * (comm.world_size() as u64 - 1) * a.bytes as u64 / comm.world_size() as u64;
    for round in 0..=a.rounds {
        for (i, (_, state)) in settings.iter_mut().enumerate() {
            buf.copy_from_slice(&grad);
            comm.barrier()?;
            let t = Instant::now();
            match state {
                None => comm.all_reduce_in_place(&mut buf, ReduceOp::Avg)?,
                Some(s) => {
                    let rep = comm.all_reduce_compressed(&mut buf, ReduceOp::Avg, s)?;
                    sent[i] = rep.sent_bytes;
                    took[i] = Some(rep.path);
                }
            }
            let dt = t.elapsed().as_secs_f64();
            // Round 0 warms up.
            if round > 0 {
                times[i].push(dt);
            }
        }
    }
    sent[0] = dense_sent;
    // The busiest rank's bytes count (the reduce-scatter's ranks send different amounts).
    let mut all_sent = vec![0u64; sent.len() * comm.world_size()];
    comm.all_gather(&sent, &mut all_sent)?;
    for (i, s) in sent.iter_mut().enumerate() {
        *s = (0..comm.world_size())
            .map(|r| all_sent[r * settings.len() + i])
            .max()
            .unwrap_or(0);
    }
    // The slowest rank's time counts.
    let mut mine: Vec<f64> = times.iter_mut().map(|t| median(t)).collect();
    let mut all = vec![0f64; mine.len() * comm.world_size()];
    comm.all_gather(&mine, &mut all)?;
    for (i, m) in mine.iter_mut().enumerate() {
        *m = (0..comm.world_size())
            .map(|r| all[r * settings.len() + i])
            .fold(0.0, f64::max);
    }
    if comm.rank() == 0 {
        println!(
            "# all-reduce (avg) of the gradient, median of {} rounds, slowest rank",
            a.rounds
        );
        println!(
            "# {:<30} {:>15} {:>11} {:>10} {:>14} {:>10}",
            "setting", "path", "time (ms)", "vs dense", "sent (MiB)", "vs dense"
        );
        for (i, (name, _)) in settings.iter().enumerate() {
            println!(
                "  {name:<30} {:>15} {:>11.2} {:>9.2}x {:>14.2} {:>9.1}%",
                path_name(took[i]),
                mine[i] * 1e3,
                mine[0] / mine[i],
                sent[i] as f64 / (1 << 20) as f64,
                100.0 * sent[i] as f64 / dense_sent as f64
            );
        }
    }
    comm.barrier()
}
