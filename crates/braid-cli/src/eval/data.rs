//! The evaluation tasks: a teacher network's labels on Gaussian inputs, the handwritten digits shipped
//! with the project, and two interleaved spirals. Each is split into a training and a test set.

use std::fmt;
use std::str::FromStr;

use super::mlp::{argmax, Mlp, Workspace};
use super::rng::Rng;

/// The UCI handwritten digits (8×8 images, pixels 0..16, 1797 samples), one sample per line: the label,
/// a space, then 64 pixels as base-17 digits `0-9a-g`. See `data/README.md` for where it comes from.
const DIGITS: &str = include_str!("../../data/digits.txt");

/// Which task to train on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    /// A fixed random teacher MLP (32 → 64 → 10) labels standard-normal inputs; 10 classes.
    Teacher,
    /// Handwritten digits, 64 inputs scaled to [0, 1]; 10 classes.
    Digits,
    /// Two interleaved noisy spirals in the plane; 2 classes.
    Spirals,
}

impl FromStr for Task {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "teacher" => Ok(Task::Teacher),
            "digits" => Ok(Task::Digits),
            "spirals" => Ok(Task::Spirals),
            other => Err(format!(
                "unknown task {other:?} (expected teacher, digits or spirals)"
            )),
        }
    }
}

impl fmt::Display for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Task::Teacher => "teacher",
            Task::Digits => "digits",
            Task::Spirals => "spirals",
        })
    }
}

/// A classification data set, split.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// Input width.
    pub dim: usize,
    /// Number of classes.
    pub classes: usize,
    /// Training inputs, row-major, `train_y.len()` rows.
    pub train_x: Vec<f32>,
    /// Training labels.
    pub train_y: Vec<u32>,
    /// Test inputs.
    pub test_x: Vec<f32>,
    /// Test labels.
    pub test_y: Vec<u32>,
}

impl Dataset {
    /// Number of training samples.
    pub fn train_len(&self) -> usize {
        self.train_y.len()
    }

    /// Copies the training rows `idx` into `xs`/`ys`.
    pub fn gather(&self, idx: &[usize], xs: &mut Vec<f32>, ys: &mut Vec<u32>) {
        xs.clear();
        ys.clear();
        for &i in idx {
            xs.extend_from_slice(&self.train_x[i * self.dim..(i + 1) * self.dim]);
            ys.push(self.train_y[i]);
        }
    }
}

impl Task {
    /// Builds the task's data set; `seed` fixes every random choice; `quick` makes the synthetic sets
    /// smaller.
    pub fn load(self, seed: u64, quick: bool) -> Result<Dataset, String> {
        match self {
            Task::Teacher => Ok(teacher(seed, if quick { 16384 } else { 32768 }, 4096)),
            Task::Spirals => Ok(spirals(seed, if quick { 1024 } else { 4096 }, 1024)),
            Task::Digits => digits(seed),
        }
    }

    /// Hidden layer widths of the student network for this task.
    pub fn hidden(self, quick: bool) -> Vec<usize> {
        match (self, quick) {
            (Task::Teacher, true) => vec![64],
            (Task::Teacher, false) => vec![128, 64],
            (Task::Digits, _) => vec![64],
            (Task::Spirals, _) => vec![64, 64],
        }
    }
}

fn split(dim: usize, classes: usize, xs: Vec<f32>, ys: Vec<u32>, test: usize) -> Dataset {
    let n = ys.len();
    let train = n - test;
    Dataset {
        dim,
        classes,
        train_x: xs[..train * dim].to_vec(),
        train_y: ys[..train].to_vec(),
        test_x: xs[train * dim..].to_vec(),
        test_y: ys[train..].to_vec(),
    }
}

/// `train + test` standard-normal points in 32 dimensions labelled by the arg-max of a random teacher.
fn teacher(seed: u64, train: usize, test: usize) -> Dataset {
    let (dim, classes) = (32, 10);
    let net = Mlp::new(&[dim, 64, classes]).expect("valid shape");
    // A larger gain than the student's makes the teacher's decision boundaries sharper and more curved.
    let params = net.init(seed ^ 0x7eac, 2.0);
    let mut rng = Rng::new(seed, 0xda7a);
    let n = train + test;
    let xs: Vec<f32> = (0..n * dim).map(|_| rng.normal() as f32).collect();
    let mut ws = Workspace::default();
    let ys = (0..n)
        .map(|i| argmax(&net.logits(&params, &xs[i * dim..(i + 1) * dim], &mut ws)) as u32)
        .collect();
    split(dim, classes, xs, ys, test)
}

/// Two spirals of `(train + test) / 2` points each, radius up to 1, 1.5 turns, Gaussian noise 0.03.
fn spirals(seed: u64, train: usize, test: usize) -> Dataset {
    let mut rng = Rng::new(seed, 0x5b17);
    let n = train + test;
    let mut xs = Vec::with_capacity(2 * n);
    let mut ys = Vec::with_capacity(n);
    for i in 0..n {
        let class = (i % 2) as u32;
        let t = rng.uniform();
        let angle = t * 3.0 * std::f64::consts::PI + class as f64 * std::f64::consts::PI;
        let r = 0.1 + 0.9 * t;
        xs.push((r * angle.cos() + 0.03 * rng.normal()) as f32);
        xs.push((r * angle.sin() + 0.03 * rng.normal()) as f32);
        ys.push(class);
    }
    split(2, 2, xs, ys, test)
}

/// Parses the shipped digits file.
pub fn parse_digits(text: &str) -> Result<(Vec<f32>, Vec<u32>), String> {
    let mut xs = Vec::new();
    let mut ys = Vec::new();
    for (no, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let bad = |why: &str| format!("digits data, line {}: {why}", no + 1);
        let (label, pixels) = line
            .split_once(' ')
            .ok_or_else(|| bad("no space after the label"))?;
        let label: u32 = label
            .parse()
            .ok()
            .filter(|l| *l < 10)
            .ok_or_else(|| bad("label is not a digit 0-9"))?;
        if pixels.len() != 64 {
            return Err(bad(&format!("{} pixels, expected 64", pixels.len())));
        }
        for c in pixels.chars() {
            let v = c
                .to_digit(17)
                .ok_or_else(|| bad(&format!("pixel {c:?} is not in 0-9a-g")))?;
            xs.push(v as f32 / 16.0);
        }
        ys.push(label);
    }
    if ys.is_empty() {
        return Err("digits data is empty".into());
    }
    Ok((xs, ys))
}

/// The digits, shuffled with `seed`, 20% held out for test.
fn digits(seed: u64) -> Result<Dataset, String> {
    let (xs, ys) = parse_digits(DIGITS)?;
    let n = ys.len();
    let mut order: Vec<usize> = (0..n).collect();
    Rng::new(seed, 0xd161).shuffle(&mut order);
    let mut sx = Vec::with_capacity(xs.len());
    let mut sy = Vec::with_capacity(n);
    for &i in &order {
        sx.extend_from_slice(&xs[i * 64..(i + 1) * 64]);
        sy.push(ys[i]);
    }
    Ok(split(64, 10, sx, sy, n / 5))
}

/// The training rows of step `step` for `rank` of `world`: the step's global batch of `batch` rows
/// (consecutive slices of a per-epoch shuffle keyed by `seed`), then every `world`-th of them starting at
/// `rank`. The global batch does not depend on `world`.
pub fn shard(
    seed: u64,
    n: usize,
    batch: usize,
    step: u64,
    rank: usize,
    world: usize,
    order: &mut (u64, Vec<usize>),
) -> Vec<usize> {
    let per_epoch = (n / batch).max(1) as u64;
    let epoch = step / per_epoch;
    if order.1.len() != n || order.0 != epoch {
        order.1 = (0..n).collect();
        Rng::new(seed, 0xe90c ^ epoch.wrapping_mul(0x100_0000_01b3)).shuffle(&mut order.1);
        order.0 = epoch;
    }
    let start = ((step % per_epoch) as usize * batch).min(n);
    let end = (start + batch).min(n);
    order.1[start..end]
        .iter()
        .skip(rank)
        .step_by(world)
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_digits_parse_with_every_class() {
        let (xs, ys) = parse_digits(DIGITS).unwrap();
        assert_eq!(ys.len(), 1797);
        assert_eq!(xs.len(), 1797 * 64);
        assert!(xs.iter().all(|x| (0.0..=1.0).contains(x)));
        for c in 0..10 {
            let count = ys.iter().filter(|y| **y == c).count();
            assert!(count > 150, "class {c}: {count}");
        }
    }

    #[test]
    fn bad_digits_lines_are_named() {
        assert!(parse_digits("3 00").unwrap_err().contains("line 1"));
        assert!(parse_digits(&format!("x {}", "0".repeat(64))).is_err());
        assert!(parse_digits(&format!("1 {}h", "0".repeat(63)))
            .unwrap_err()
            .contains("'h'"));
        assert!(parse_digits("").is_err());
    }

    #[test]
    fn tasks_are_deterministic_and_use_several_classes() {
        for task in [Task::Teacher, Task::Digits, Task::Spirals] {
            let a = task.load(4, true).unwrap();
            let b = task.load(4, true).unwrap();
            assert_eq!(a.train_x, b.train_x);
            assert_eq!(a.test_y, b.test_y);
            assert_eq!(a.train_x.len(), a.train_len() * a.dim);
            assert!(!a.test_y.is_empty());
            let used = (0..a.classes as u32)
                .filter(|c| a.train_y.contains(c))
                .count();
            assert!(used * 2 > a.classes, "{task}: only {used} classes used");
        }
        assert_ne!(
            Task::Teacher.load(4, true).unwrap().train_y,
            Task::Teacher.load(5, true).unwrap().train_y
        );
    }

    #[test]
    fn shards_partition_the_global_batch_whatever_the_rank_count() {
        let n = 100;
        for step in [0u64, 3, 7, 12] {
            let mut one = (u64::MAX, Vec::new());
            let mut global = shard(9, n, 16, step, 0, 1, &mut one);
            global.sort_unstable();
            for world in [2, 3, 4] {
                let mut all = Vec::new();
                for rank in 0..world {
                    let mut o = (u64::MAX, Vec::new());
                    all.extend(shard(9, n, 16, step, rank, world, &mut o));
                }
                all.sort_unstable();
                assert_eq!(all, global, "step {step}, world {world}");
            }
        }
        // Different epochs see different orders; within an epoch batches do not overlap.
        let mut o = (u64::MAX, Vec::new());
        let a = shard(9, n, 16, 0, 0, 1, &mut o);
        let b = shard(9, n, 16, 1, 0, 1, &mut o);
        assert!(a.iter().all(|i| !b.contains(i)));
        let c = shard(9, n, 16, 6, 0, 1, &mut o);
        assert_ne!(a, c);
    }
}
