//! `braid compress-eval`: trains a small MLP data-parallel across ranks once per (gradient codec ×
//! optimizer), from the same initial parameters and the same batch order, and reports how much each codec
//! costs in final loss and accuracy against dense all-reduce, how many bytes it saves, and the seed's
//! warnings (low density with Adam). Rank 0 prints the table and draws the curves.
//!
//! Each rank computes the gradient of its shard of every global batch (the global batch does not depend on
//! the rank count) and hands it to a [`sync::GradSync`]; the synchronised gradient goes to the optimizer,
//! whose learning rate follows a cosine schedule down to zero at the last step.
//! At the end of every run the ranks compare a hash of their parameters: they must be bit-identical.
//!
//! Every (setting × optimizer) runs with several seeds (initial parameters, batch order, codec seeds) on
//! the same data; the table shows the mean and the spread (sample standard deviation) over seeds of the
//! final loss relative to dense with the same seed, the held-out accuracy, and the share of parameters
//! whose synchronised gradient stayed zero for at least [`LAGGING_STEPS`] steps in a row (the seed's
//! lagging parameters).

mod cnn;
mod data;
mod mlp;
mod model;
mod optim;
mod plot;
mod rng;
pub mod sync;

use std::fmt::Write as _;
use std::time::Instant;

use braid::{Communicator, ReduceOp};
use serde::Serialize;

pub use data::Task;
use model::{Net, Workspace};
pub use optim::OptKind;
use optim::Optimizer;
pub use sync::Setting;

/// A run whose final training loss is this many percent above dense (same optimizer) counts as harmed.
pub const HARM_PCT: f64 = 5.0;

/// Steps without an update after which a parameter counts as lagging.
pub const LAGGING_STEPS: u32 = 100;

/// What to evaluate.
#[derive(Clone, Debug)]
pub struct EvalArgs {
    pub task: Task,
    pub settings: Vec<Setting>,
    pub optimizers: Vec<OptKind>,
    pub steps: u64,
    pub quick: bool,
    pub batch: usize,
    pub seed: u64,
    /// Seeds per (setting × optimizer): `seed`, `seed + 1`, ...
    pub seeds: usize,
    pub lr_sgd: f32,
    pub lr_adam: f32,
    pub out: Option<String>,
    pub json: Option<String>,
    /// Synchronise through the local all-gather reference instead of the compressed all-reduce.
    pub gather: bool,
    /// Tell the compressor each step's learning rate, so that its error buffers are rescaled when the
    /// rate moves ([`braid::GradientCompressor::set_learning_rate`]).
    pub lr_rescale: bool,
}

/// The settings evaluated when none are given.
pub fn default_settings(quick: bool) -> Vec<Setting> {
    let list: &[&str] = if quick {
        &[
            "dense",
            "topk:0.1",
            "topk:0.01",
            "topk:0.01/noef",
            "topk:0.005",
            "topk:0.01/momentum=0.9/warmup=60",
            "topk:0.01/adam=60",
        ]
    } else {
        &[
            "dense",
            "fp16",
            "topk:0.1",
            "topk:0.1/noef",
            "topk:0.1/warmup=300:1",
            "topk:0.1/momentum=0.9/warmup=300",
            "topk:0.1/momentum=0.9/mask/warmup=300",
            "topk:0.1/adam=150",
            "topk:0.1/adam=300",
            "topk:0.01",
            "topk:0.01/noef",
            "topk:0.01/momentum=0.9/warmup=300",
            "topk:0.01/momentum=0.9/warmup=600",
            "topk:0.01/momentum=0.9/mask/warmup=300",
            "topk:0.01/adam=300",
            "topk:0.01/adam=450",
            "topk:0.001",
            "topk:0.001/momentum=0.9/warmup=300",
            "topk:0.001/adam=300",
            "dense/clip=2",
            "dense/gclip=2",
            "topk:0.01/clip=2",
            "topk:0.01/gclip=2",
            "randomk:0.1",
            "int8-stochastic",
            "mxfp8",
            "mxfp8:e5m2",
            "mxfp4",
            "sign",
            "sign/adam=150",
            "powersgd:4",
        ]
    };
    list.iter()
        .map(|s| s.parse().expect("built-in setting"))
        .collect()
}

/// Default number of seeds per setting.
pub fn default_seeds(quick: bool) -> usize {
    if quick {
        2
    } else {
        3
    }
}

/// Default number of steps.
pub fn default_steps(quick: bool) -> u64 {
    if quick {
        600
    } else {
        1500
    }
}

/// Parses a comma-separated list with `parse`, refusing an empty one.
pub fn parse_list<T>(
    text: &str,
    what: &str,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Vec<T>, String> {
    let items: Vec<&str> = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if items.is_empty() {
        return Err(format!("--{what} is empty"));
    }
    items.into_iter().map(parse).collect()
}

/// One training run's results (rank 0's view; every rank agrees on the parameters).
#[derive(Serialize, Clone, Debug)]
pub struct RunResult {
    pub setting: String,
    pub optimizer: String,
    pub seed: u64,
    pub error_feedback: bool,
    pub initial_train_loss: f64,
    pub final_train_loss: f64,
    pub test_accuracy: f64,
    /// `(final − dense final) / dense final · 100`, same optimizer and seed; absent without a dense run.
    pub loss_vs_dense_pct: Option<f64>,
    /// `(accuracy − dense accuracy) · 100`, in points, same optimizer and seed.
    pub accuracy_vs_dense_pts: Option<f64>,
    /// Share of parameters whose synchronised gradient stayed exactly zero for at least
    /// [`LAGGING_STEPS`] consecutive steps at some point of the run.
    pub lagging_share: f64,
    /// Bytes this rank sent for gradients over the run.
    pub sent_bytes: u64,
    /// What the same run would have sent dense.
    pub dense_sent_bytes: u64,
    pub seconds: f64,
    /// The loss became NaN or infinite; training stopped there.
    pub diverged: bool,
    /// Achieved density averaged over steps (rank 0's contribution).
    pub mean_density: f64,
    /// Distinct warnings and how many steps raised each.
    pub warnings: Vec<(String, u64)>,
    /// Per step: global mini-batch loss, mean gradient norm before compression, mean compression error.
    #[serde(skip)]
    pub curves: Curves,
}

/// Per-step series of one run.
#[derive(Clone, Debug, Default)]
pub struct Curves {
    pub loss: Vec<f64>,
    pub grad_norm: Vec<f64>,
    pub compression_error: Vec<f64>,
}

/// Everything one evaluation produced.
#[derive(Serialize, Debug)]
pub struct Report {
    pub task: String,
    pub ranks: usize,
    pub steps: u64,
    pub global_batch: usize,
    pub parameters: usize,
    pub seed: u64,
    pub seeds: usize,
    pub runs: Vec<RunResult>,
    /// One row per (setting × optimizer): means and spreads over seeds.
    pub summary: Vec<Summary>,
}

/// Mean and sample standard deviation (0 for one value) of `xs`; NaN when empty or any value is NaN.
fn mean_sd(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() == 1 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// A (setting × optimizer) over its seeds.
#[derive(Serialize, Clone, Debug)]
pub struct Summary {
    pub setting: String,
    pub optimizer: String,
    pub seeds: usize,
    /// Mean and spread of the final training loss.
    pub final_train_loss: (f64, f64),
    /// Mean and spread of the loss relative to dense (percent); NaN without dense runs.
    pub loss_vs_dense_pct: (f64, f64),
    /// Mean and spread of the held-out accuracy (0..1).
    pub test_accuracy: (f64, f64),
    /// Mean and spread of the accuracy relative to dense (points).
    pub accuracy_vs_dense_pts: (f64, f64),
    /// Mean share of lagging parameters.
    pub lagging_share: f64,
    /// Bytes sent per rank over a run, and dense's, averaged over seeds.
    pub sent_bytes: u64,
    pub dense_sent_bytes: u64,
    pub mean_density: f64,
    pub diverged: usize,
    /// Distinct warnings and in how many runs each appeared.
    pub warnings: Vec<(String, u64)>,
}

/// Groups `runs` by (setting, optimizer), in order of first appearance.
fn summarise(runs: &[RunResult]) -> Vec<Summary> {
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in runs {
        let k = (r.setting.clone(), r.optimizer.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.into_iter()
        .map(|(setting, optimizer)| {
            let rs: Vec<&RunResult> = runs
                .iter()
                .filter(|r| r.setting == setting && r.optimizer == optimizer)
                .collect();
            let pick = |f: &dyn Fn(&RunResult) -> f64| -> (f64, f64) {
                mean_sd(&rs.iter().map(|r| f(r)).collect::<Vec<_>>())
            };
            let n = rs.len() as u64;
            let mut warnings: Vec<(String, u64)> = Vec::new();
            for r in &rs {
                for (w, _) in &r.warnings {
                    match warnings.iter_mut().find(|(t, _)| t == w) {
                        Some((_, c)) => *c += 1,
                        None => warnings.push((w.clone(), 1)),
                    }
                }
            }
            Summary {
                seeds: rs.len(),
                final_train_loss: pick(&|r| r.final_train_loss),
                loss_vs_dense_pct: pick(&|r| r.loss_vs_dense_pct.unwrap_or(f64::NAN)),
                test_accuracy: pick(&|r| r.test_accuracy),
                accuracy_vs_dense_pts: pick(&|r| r.accuracy_vs_dense_pts.unwrap_or(f64::NAN)),
                lagging_share: pick(&|r| r.lagging_share).0,
                sent_bytes: rs.iter().map(|r| r.sent_bytes).sum::<u64>() / n.max(1),
                dense_sent_bytes: rs.iter().map(|r| r.dense_sent_bytes).sum::<u64>() / n.max(1),
                mean_density: pick(&|r| r.mean_density).0,
                diverged: rs.iter().filter(|r| r.diverged).count(),
                warnings,
                setting,
                optimizer,
            }
        })
        .collect()
}

fn fnv(params: &[f32]) -> u64 {
    params
        .iter()
        .flat_map(|p| p.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        })
}

/// Summed loss over this rank's share of the training set, correct answers over its share of the test
/// set, all-reduced: (mean train loss, test accuracy).
fn evaluate(
    comm: &Communicator,
    net: &Net,
    data: &data::Dataset,
    params: &[f32],
    ws: &mut Workspace,
) -> Result<(f64, f64), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let d = data.dim;
    let rows = |xs: &[f32], ys: &[u32]| -> (Vec<f32>, Vec<u32>) {
        let mut sx = Vec::new();
        let mut sy = Vec::new();
        for i in (rank..ys.len()).step_by(world) {
            sx.extend_from_slice(&xs[i * d..(i + 1) * d]);
            sy.push(ys[i]);
        }
        (sx, sy)
    };
    let (tx, ty) = rows(&data.train_x, &data.train_y);
    let (ex, ey) = rows(&data.test_x, &data.test_y);
    let (train_loss, _) = net.evaluate(params, &tx, &ty, ws);
    let (_, correct) = net.evaluate(params, &ex, &ey, ws);
    let mut sums = [train_loss, correct as f64];
    comm.all_reduce_in_place(&mut sums, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    Ok((
        sums[0] / data.train_len() as f64,
        sums[1] / data.test_y.len() as f64,
    ))
}

/// Trains once with `setting`, `opt` and `seed`; every rank returns the same numbers.
#[allow(clippy::too_many_arguments)]
fn train(
    comm: &Communicator,
    args: &EvalArgs,
    net: &Net,
    data: &data::Dataset,
    setting: &Setting,
    opt: OptKind,
    seed: u64,
) -> Result<RunResult, String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let len = net.num_params();
    let mut params = net.init(seed);
    let lr = match opt {
        OptKind::Sgd => args.lr_sgd,
        OptKind::Adam => args.lr_adam,
    };
    let mut optimizer = match opt {
        OptKind::Sgd => Optimizer::sgd_with(lr, setting.sgd_momentum(), len),
        OptKind::Adam => Optimizer::adam(lr, len),
    };
    let layers = net.layer_shapes();
    let mut sync = if args.gather {
        sync::make(setting, len, &layers, rank, seed, opt.is_adaptive())?
    } else {
        sync::make_compressed(setting, len, &layers, seed, opt.is_adaptive())?
    };
    // Steps each parameter's synchronised gradient has been zero in a row, and the longest such run.
    let mut idle = vec![0u32; len];
    let mut longest = vec![0u32; len];
    let mut ws = Workspace::default();
    let (initial_train_loss, _) = evaluate(comm, net, data, &params, &mut ws)?;
    let mut grad = vec![0.0f32; len];
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    let mut order = (u64::MAX, Vec::new());
    let mut curves = Curves::default();
    let mut sent_bytes = 0u64;
    let mut warnings: Vec<(String, u64)> = Vec::new();
    let mut density_sum = 0.0;
    let mut diverged = false;
    // The local gradient is the shard's summed gradient times world / batch: the average over ranks is
    // then the global batch's mean gradient, whatever the shard sizes.
    let scale = world as f32 / args.batch as f32;
    let start = Instant::now();
    for step in 0..args.steps {
        let idx = data::shard(
            seed,
            data.train_len(),
            args.batch,
            step,
            rank,
            world,
            &mut order,
        );
        data.gather(&idx, &mut xs, &mut ys);
        grad.fill(0.0);
        let loss = net.loss_and_grad(&params, &xs, &ys, scale, &mut grad, &mut ws);
        let step_lr = lr * optim::cosine(step, args.steps);
        optimizer.set_lr(step_lr);
        if args.lr_rescale {
            sync.set_learning_rate(step_lr)
                .map_err(|e| format!("{setting}, {opt}, step {step}: {e}"))?;
        }
        let info = sync
            .sync(comm, &mut grad, step)
            .map_err(|e| format!("{setting}, {opt}, step {step}: {e}"))?;
        for ((g, i), l) in grad.iter().zip(&mut idle).zip(&mut longest) {
            *i = if *g == 0.0 { i.saturating_add(1) } else { 0 };
            *l = (*l).max(*i);
        }
        optimizer.step_with(&mut params, &grad, info.output);
        sent_bytes += info.sent_bytes;
        density_sum += info.density;
        for w in info.warnings {
            match warnings.iter_mut().find(|(t, _)| *t == w) {
                Some((_, n)) => *n += 1,
                None => warnings.push((w, 1)),
            }
        }
        let mut m = [
            loss,
            ys.len() as f64,
            info.grad_norm,
            info.compression_error,
        ];
        comm.all_reduce_in_place(&mut m, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        let batch_loss = m[0] / m[1];
        curves.loss.push(batch_loss);
        curves.grad_norm.push(m[2] / world as f64);
        curves.compression_error.push(m[3] / world as f64);
        if !batch_loss.is_finite() {
            // Every rank sees the same reduced loss, so every rank stops here.
            diverged = true;
            break;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let (final_train_loss, test_accuracy) = evaluate(comm, net, data, &params, &mut ws)?;
    let mut hashes = vec![0u64; world];
    comm.all_gather(&[fnv(&params)], &mut hashes)
        .map_err(|e| e.to_string())?;
    if let Some(r) = hashes.iter().position(|h| *h != hashes[0]) {
        return Err(format!(
            "{setting}, {opt}: ranks ended with different parameters (rank 0 hash {:016x}, rank {r} {:016x})",
            hashes[0], hashes[r]
        ));
    }
    let steps_run = curves.loss.len() as u64;
    let n = world as u64;
    let lagging = longest.iter().filter(|l| **l >= LAGGING_STEPS).count();
    Ok(RunResult {
        setting: setting.to_string(),
        optimizer: opt.to_string(),
        seed,
        error_feedback: setting.error_feedback(),
        initial_train_loss,
        final_train_loss: if diverged { f64::NAN } else { final_train_loss },
        test_accuracy,
        loss_vs_dense_pct: None,
        accuracy_vs_dense_pts: None,
        lagging_share: lagging as f64 / len.max(1) as f64,
        sent_bytes,
        dense_sent_bytes: steps_run * 2 * (n - 1) * 4 * len as u64 / n,
        seconds,
        diverged,
        mean_density: density_sum / steps_run.max(1) as f64,
        warnings,
        curves,
    })
}

/// Runs the whole evaluation on this rank; rank 0 prints and writes the outputs.
pub fn run(comm: &Communicator, args: &EvalArgs) -> Result<Report, String> {
    let data = args.task.load(args.seed, args.quick)?;
    if args.batch < comm.world_size() {
        return Err(format!(
            "--batch {} is smaller than the {} ranks: some ranks would get no samples",
            args.batch,
            comm.world_size()
        ));
    }
    let net = args.task.net(args.quick, &data)?;
    if args.seeds == 0 {
        return Err("--seeds must be at least 1".into());
    }
    let lead = comm.rank() == 0;
    if lead {
        eprintln!(
            "compress-eval: task {}, {} ranks, {net} ({} parameters), {} steps of global batch {}, \
             {} seeds, {} train / {} test samples",
            args.task,
            comm.world_size(),
            net.num_params(),
            args.steps,
            args.batch,
            args.seeds,
            data.train_len(),
            data.test_y.len()
        );
    }
    let jobs: Vec<(OptKind, &Setting)> = args
        .optimizers
        .iter()
        .flat_map(|&o| args.settings.iter().map(move |s| (o, s)))
        .filter(|(o, s)| s.applies_to(*o))
        .collect();
    let total = jobs.len() * args.seeds;
    let mut runs = Vec::with_capacity(total);
    for (opt, setting) in jobs {
        for k in 0..args.seeds as u64 {
            let seed = args.seed.wrapping_add(k);
            let r = train(comm, args, &net, &data, setting, opt, seed)?;
            if lead {
                eprintln!(
                    "[{}/{}] {setting} {opt} seed {seed}: train loss {:.4}, test accuracy {:.1}%, \
                     lagging {:.1}%, {:.1} s",
                    runs.len() + 1,
                    total,
                    r.final_train_loss,
                    100.0 * r.test_accuracy,
                    100.0 * r.lagging_share,
                    r.seconds
                );
            }
            runs.push(r);
        }
    }
    fill_relative(&mut runs);
    let summary = summarise(&runs);
    let report = Report {
        task: args.task.to_string(),
        ranks: comm.world_size(),
        steps: args.steps,
        global_batch: args.batch,
        parameters: net.num_params(),
        seed: args.seed,
        seeds: args.seeds,
        runs,
        summary,
    };
    if lead {
        print!("{}", table(&report));
        println!(
            "parameters bit-identical on all {} ranks after each of the {} runs",
            report.ranks,
            report.runs.len()
        );
        if let Some(dir) = &args.out {
            let files = write_plots(dir, &report)?;
            println!("plots: {}", files.join(", "));
        }
        if let Some(path) = &args.json {
            let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
            std::fs::write(path, text).map_err(|e| format!("cannot write {path}: {e}"))?;
        }
    }
    Ok(report)
}

/// Fills `loss_vs_dense_pct` and `accuracy_vs_dense_pts` from the dense run of the same optimizer and
/// seed.
fn fill_relative(runs: &mut [RunResult]) {
    let dense: Vec<(String, u64, f64, f64)> = runs
        .iter()
        .filter(|r| r.setting == "dense")
        .map(|r| {
            (
                r.optimizer.clone(),
                r.seed,
                r.final_train_loss,
                r.test_accuracy,
            )
        })
        .collect();
    for r in runs.iter_mut() {
        let d = dense
            .iter()
            .find(|(o, s, _, _)| *o == r.optimizer && *s == r.seed);
        r.loss_vs_dense_pct = d.map(|(_, _, l, _)| 100.0 * (r.final_train_loss - l) / l);
        r.accuracy_vs_dense_pts = d.map(|(_, _, _, a)| 100.0 * (r.test_accuracy - a));
    }
}

fn mb(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / 1e6)
}

/// `mean ± sd` with `digits` decimals and `unit`, or `-` when not a number.
fn pm(v: (f64, f64), digits: usize, unit: &str, signed: bool) -> String {
    if !v.0.is_finite() {
        return "-".into();
    }
    if signed {
        format!("{:+.*}{unit} ±{:.*}", digits, v.0, digits, v.1)
    } else {
        format!("{:.*}{unit} ±{:.*}", digits, v.0, digits, v.1)
    }
}

/// The results table (means ± spreads over seeds), then the settings that harm each optimizer and the
/// warnings.
pub fn table(report: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# braid compress-eval: task {}, {} ranks, {} parameters, {} steps, global batch {}, {} seeds \
         (mean ± sample sd)",
        report.task, report.ranks, report.parameters, report.steps, report.global_batch, report.seeds
    );
    let _ = writeln!(
        s,
        "{:<36} {:<5} {:>10} {:>16} {:>14} {:>14} {:>8} {:>12} {:>7}  note",
        "setting",
        "opt",
        "train loss",
        "vs dense",
        "test acc",
        "acc vs dense",
        "lagging",
        "MB sent/rank",
        "ratio"
    );
    for r in &report.summary {
        let mut note = Vec::new();
        if r.diverged > 0 {
            note.push(format!("DIVERGED ({} of {})", r.diverged, r.seeds));
        } else if r.loss_vs_dense_pct.0 > HARM_PCT {
            note.push(format!("HARMED (>{HARM_PCT}% above dense)"));
        }
        if !r.warnings.is_empty() {
            note.push(format!("warned: density {:.3}%", 100.0 * r.mean_density));
        }
        let _ = writeln!(
            s,
            "{:<36} {:<5} {:>10.4} {:>16} {:>14} {:>14} {:>7.1}% {:>12} {:>7}  {}",
            r.setting,
            r.optimizer,
            r.final_train_loss.0,
            pm(r.loss_vs_dense_pct, 2, "%", true),
            pm(
                (100.0 * r.test_accuracy.0, 100.0 * r.test_accuracy.1),
                2,
                "%",
                false
            ),
            pm(r.accuracy_vs_dense_pts, 2, "", true),
            100.0 * r.lagging_share,
            mb(r.sent_bytes),
            // One rank sends nothing either way.
            match r.sent_bytes {
                0 => "-".to_string(),
                sent => format!("{:.1}x", r.dense_sent_bytes as f64 / sent as f64),
            },
            note.join("; ")
        );
    }
    let _ = writeln!(
        s,
        "vs dense: final training loss relative to dense with the same optimizer and seed; acc vs dense: \
         held-out accuracy difference in points; lagging: share of parameters whose synchronised gradient \
         stayed zero for >= {LAGGING_STEPS} steps in a row; MB sent/rank: dense as a ring all-reduce moves \
         it (2(n-1)/n of the f32 gradient per step), compressed as the compressed all-reduce reports it \
         (with --gather: an all-gather of every rank's encoding, (n-1) x the largest); ratio = dense / \
         sent. momentum=M runs with SGD only (its momentum off), adam=STEPS with Adam only (its second \
         moment frozen after the warm-up)."
    );
    for opt in ["sgd", "adam"] {
        let harmed: Vec<String> = report
            .summary
            .iter()
            .filter(|r| r.optimizer == opt)
            .filter(|r| r.diverged > 0 || r.loss_vs_dense_pct.0 > HARM_PCT)
            .map(|r| match r.diverged {
                0 => format!("{} ({:+.1}%)", r.setting, r.loss_vs_dense_pct.0),
                _ => format!("{} (diverged)", r.setting),
            })
            .collect();
        if report
            .summary
            .iter()
            .any(|r| r.optimizer == opt && r.setting == "dense")
        {
            let _ = writeln!(
                s,
                "{opt}: {}",
                if harmed.is_empty() {
                    format!("no setting ends more than {HARM_PCT}% above dense")
                } else {
                    format!(
                        "harmed (final train loss >{HARM_PCT}% above dense): {}",
                        harmed.join(", ")
                    )
                }
            );
        }
    }
    // Settings that cost Adam more than they cost SGD.
    let worse: Vec<String> = report
        .summary
        .iter()
        .filter(|a| a.optimizer == "adam")
        .filter_map(|a| {
            let s = report
                .summary
                .iter()
                .find(|s| s.optimizer == "sgd" && s.setting == a.setting)?;
            let (pa, ps) = (a.loss_vs_dense_pct.0, s.loss_vs_dense_pct.0);
            (pa - ps > HARM_PCT || (a.diverged > 0 && s.diverged == 0))
                .then(|| format!("{} (adam {pa:+.1}% vs sgd {ps:+.1}%)", a.setting))
        })
        .collect();
    if !worse.is_empty() {
        let _ = writeln!(s, "worse for adam than for sgd: {}", worse.join(", "));
    }
    for r in &report.summary {
        for (w, n) in &r.warnings {
            let _ = writeln!(
                s,
                "warning ({}, {}, {n} of {} runs): {w}",
                r.setting, r.optimizer, r.seeds
            );
        }
    }
    s
}

/// Mean over windows, so that curves of hundreds of noisy steps stay readable.
fn smooth(v: &[f64], points: usize) -> Vec<(f64, f64)> {
    let w = v.len().div_ceil(points.max(1)).max(1);
    v.chunks(w)
        .enumerate()
        .map(|(i, c)| {
            (
                (i * w + c.len() / 2) as f64,
                c.iter().sum::<f64>() / c.len() as f64,
            )
        })
        .collect()
}

fn write_plots(dir: &str, report: &Report) -> Result<Vec<String>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {dir}: {e}"))?;
    let mut files = Vec::new();
    let mut opts: Vec<&str> = Vec::new();
    for r in &report.runs {
        if !opts.contains(&r.optimizer.as_str()) {
            opts.push(&r.optimizer);
        }
    }
    type Pick = fn(&Curves) -> &Vec<f64>;
    let kinds: [(&str, &str, Pick); 3] = [
        ("loss", "training loss (mini-batch, smoothed)", |c| &c.loss),
        ("grad_norm", "gradient norm before compression", |c| {
            &c.grad_norm
        }),
        ("compression_error", "relative compression error", |c| {
            &c.compression_error
        }),
    ];
    for opt in opts {
        for (file, what, pick) in kinds {
            let series: Vec<plot::Series> = report
                .runs
                .iter()
                .filter(|r| r.optimizer == opt && r.seed == report.seed)
                .map(|r| (r.setting.clone(), smooth(pick(&r.curves), 75)))
                .collect();
            let path = format!("{dir}/{file}_{opt}.png");
            let title = format!(
                "{} task, {} ranks, {opt}: {what}",
                report.task, report.ranks
            );
            match plot::lines(&path, &title, what, &series) {
                Ok(()) => files.push(path),
                // Dense-only runs have no compression error to draw; say so rather than fail.
                Err(e) if e.ends_with("nothing to plot") => eprintln!("compress-eval: {e}"),
                Err(e) => return Err(e),
            }
        }
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_of(setting: &str, opt: &str, loss: f64) -> RunResult {
        RunResult {
            setting: setting.into(),
            optimizer: opt.into(),
            seed: 1,
            accuracy_vs_dense_pts: None,
            lagging_share: 0.25,
            error_feedback: true,
            initial_train_loss: 2.3,
            final_train_loss: loss,
            test_accuracy: 0.5,
            loss_vs_dense_pct: None,
            sent_bytes: 100,
            dense_sent_bytes: 1000,
            seconds: 1.0,
            diverged: false,
            mean_density: 0.1,
            warnings: Vec::new(),
            curves: Curves::default(),
        }
    }

    #[test]
    fn relative_loss_uses_the_dense_run_of_the_same_optimizer_and_harm_is_shown() {
        let mut runs = vec![
            run_of("dense", "sgd", 0.5),
            run_of("topk:0.1/ef", "sgd", 0.51),
            run_of("dense", "adam", 0.2),
            run_of("topk:0.1/ef", "adam", 0.3),
            // A second seed: its own dense baseline.
            RunResult {
                seed: 2,
                ..run_of("dense", "adam", 0.4)
            },
            RunResult {
                seed: 2,
                test_accuracy: 0.47,
                ..run_of("topk:0.1/ef", "adam", 0.6)
            },
        ];
        fill_relative(&mut runs);
        assert!((runs[1].loss_vs_dense_pct.unwrap() - 2.0).abs() < 1e-9);
        assert!((runs[3].loss_vs_dense_pct.unwrap() - 50.0).abs() < 1e-9);
        assert!((runs[5].loss_vs_dense_pct.unwrap() - 50.0).abs() < 1e-9);
        assert!((runs[5].accuracy_vs_dense_pts.unwrap() + 3.0).abs() < 1e-9);
        let summary = summarise(&runs);
        assert_eq!(summary.len(), 4);
        let adam_topk = &summary[3];
        assert_eq!(
            (adam_topk.seeds, adam_topk.setting.as_str()),
            (2, "topk:0.1/ef")
        );
        assert!((adam_topk.loss_vs_dense_pct.0 - 50.0).abs() < 1e-9);
        assert!(adam_topk.loss_vs_dense_pct.1.abs() < 1e-9);
        // Accuracy 0.5 and 0.47: mean 0.485, sample sd 0.0212.
        assert!((adam_topk.test_accuracy.0 - 0.485).abs() < 1e-9);
        assert!((adam_topk.test_accuracy.1 - 0.03 / 2f64.sqrt()).abs() < 1e-9);
        let report = Report {
            task: "teacher".into(),
            ranks: 2,
            steps: 10,
            global_batch: 8,
            parameters: 100,
            seed: 1,
            seeds: 2,
            runs,
            summary,
        };
        let t = table(&report);
        assert!(t.contains("sgd: no setting ends more than"), "{t}");
        assert!(
            t.contains("adam: harmed") && t.contains("topk:0.1/ef (+50.0%)"),
            "{t}"
        );
        assert!(t.contains("+50.00% ±0.00") && t.contains("25.0%"), "{t}");
        assert!(
            t.contains("worse for adam than for sgd: topk:0.1/ef"),
            "{t}"
        );
        assert!(t.contains("10.0x"), "{t}");
    }

    #[test]
    fn smoothing_averages_windows() {
        let v: Vec<f64> = (0..10).map(|i| i as f64).collect();
        let s = smooth(&v, 5);
        assert_eq!(s.len(), 5);
        assert_eq!(s[0], (1.0, 0.5));
        assert_eq!(s[4], (9.0, 8.5));
    }

    #[test]
    fn lists_parse_and_refuse_empty() {
        let s = parse_list("dense, topk:0.1", "codecs", |t| t.parse::<Setting>()).unwrap();
        assert_eq!(s.len(), 2);
        assert!(parse_list(" , ", "codecs", |t| t.parse::<Setting>()).is_err());
        assert!(parse_list("sgd,lion", "optimizers", |t| t.parse::<OptKind>()).is_err());
        assert_eq!(default_settings(true)[0].to_string(), "dense");
    }
}
