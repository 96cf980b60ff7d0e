//! The evaluation tasks: a teacher network's labels on Gaussian inputs, the red wine quality data set
//! (UCI, 1599 wines, shipped by the `linfa-datasets` crate), two interleaved spirals, and small noisy
//! images of eight shapes for a convolutional network. Each is split into a training and a test set.

use std::fmt;
use std::str::FromStr;

use super::cnn::Cnn;
use super::mlp::{argmax, Mlp, Workspace};
use super::model::Net;
use super::rng::Rng;

/// Which task to train on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    /// A fixed random teacher MLP (32 → 64 → 10) labels standard-normal inputs; 10 classes.
    Teacher,
    /// Red wine quality (UCI): 11 physico-chemical measurements, standardised; the quality grade
    /// (3 to 8) as 6 classes, most of them 5 or 6.
    Wine,
    /// Two interleaved noisy spirals in the plane; 2 classes.
    Spirals,
    /// 12 × 12 grey images of eight shapes (bars, diagonals, a plus, a cross, a box, a blob) of random
    /// size, position and brightness, in Gaussian noise with a distracting stroke; trained with a small
    /// CNN.
    Shapes,
}

impl FromStr for Task {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "teacher" => Ok(Task::Teacher),
            "wine" => Ok(Task::Wine),
            "spirals" => Ok(Task::Spirals),
            "shapes" => Ok(Task::Shapes),
            other => Err(format!(
                "unknown task {other:?} (expected teacher, wine, spirals or shapes)"
            )),
        }
    }
}

impl fmt::Display for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Task::Teacher => "teacher",
            Task::Wine => "wine",
            Task::Spirals => "spirals",
            Task::Shapes => "shapes",
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
            Task::Wine => wine(seed),
            Task::Shapes => Ok(shapes(seed, if quick { 4096 } else { 16384 }, 2048)),
        }
    }

    /// The network trained on this task's `data`.
    pub fn net(self, quick: bool, data: &Dataset) -> Result<Net, String> {
        let mlp = |hidden: &[usize]| -> Result<Net, String> {
            let mut sizes = vec![data.dim];
            sizes.extend_from_slice(hidden);
            sizes.push(data.classes);
            Ok(Net::Mlp(Mlp::new(&sizes)?))
        };
        match (self, quick) {
            (Task::Teacher, true) => mlp(&[64]),
            (Task::Teacher, false) => mlp(&[128, 64]),
            (Task::Wine, _) => mlp(&[64]),
            (Task::Spirals, _) => mlp(&[64, 64]),
            (Task::Shapes, true) => Ok(Net::Cnn(Cnn::new(SHAPE_SIDE, 4, 8, 16, data.classes)?)),
            (Task::Shapes, false) => Ok(Net::Cnn(Cnn::new(SHAPE_SIDE, 8, 16, 32, data.classes)?)),
        }
    }
}

/// Side of the shape images.
const SHAPE_SIDE: usize = 12;

/// One 12 × 12 image of shape `class` (see [`Task::Shapes`]) into `img`.
fn draw_shape(class: usize, rng: &mut Rng, img: &mut [f32]) {
    let s = SHAPE_SIDE as i64;
    let size = 3 + rng.below(5) as i64; // 3..=7 pixels across
    let x0 = rng.below((s - size) as usize + 1) as i64;
    let y0 = rng.below((s - size) as usize + 1) as i64;
    let ink = (0.7 + 0.6 * rng.uniform()) as f32;
    let mut put = |x: i64, y: i64, v: f32| {
        if (0..s).contains(&x) && (0..s).contains(&y) {
            img[(y * s + x) as usize] += v;
        }
    };
    let mid = size / 2;
    for t in 0..size {
        match class {
            0 => put(x0 + t, y0 + mid, ink),
            1 => put(x0 + mid, y0 + t, ink),
            2 => put(x0 + t, y0 + t, ink),
            3 => put(x0 + size - 1 - t, y0 + t, ink),
            4 => {
                put(x0 + t, y0 + mid, ink);
                if t != mid {
                    put(x0 + mid, y0 + t, ink);
                }
            }
            5 => {
                put(x0 + t, y0 + t, ink);
                if size - 1 - t != t {
                    put(x0 + size - 1 - t, y0 + t, ink);
                }
            }
            6 => {
                put(x0 + t, y0, ink);
                put(x0 + t, y0 + size - 1, ink);
                if t > 0 && t < size - 1 {
                    put(x0, y0 + t, ink);
                    put(x0 + size - 1, y0 + t, ink);
                }
            }
            _ => {
                for u in 0..size {
                    let (dx, dy) = (2 * t - (size - 1), 2 * u - (size - 1));
                    if dx * dx + dy * dy <= (size - 1) * (size - 1) {
                        put(x0 + t, y0 + u, ink);
                    }
                }
            }
        }
    }
    // A distracting two-pixel stroke anywhere, then noise.
    let (sx, sy) = (rng.below(SHAPE_SIDE) as i64, rng.below(SHAPE_SIDE) as i64);
    let horizontal = rng.below(2) == 0;
    put(sx, sy, 0.8);
    if horizontal {
        put(sx + 1, sy, 0.8);
    } else {
        put(sx, sy + 1, 0.8);
    }
    for v in img.iter_mut() {
        *v += (0.35 * rng.normal()) as f32;
    }
}

/// `train + test` shape images with balanced classes in random order.
fn shapes(seed: u64, train: usize, test: usize) -> Dataset {
    let (dim, classes) = (SHAPE_SIDE * SHAPE_SIDE, 8);
    let mut rng = Rng::new(seed, 0x5a9e);
    let n = train + test;
    let mut xs = vec![0f32; n * dim];
    let mut ys = Vec::with_capacity(n);
    for i in 0..n {
        let class = i % classes;
        draw_shape(class, &mut rng, &mut xs[i * dim..(i + 1) * dim]);
        ys.push(class as u32);
    }
    // Shuffle rows so that the test split is balanced and batches mix classes.
    let mut order: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut order);
    let mut sx = Vec::with_capacity(xs.len());
    let mut sy = Vec::with_capacity(n);
    for &i in &order {
        sx.extend_from_slice(&xs[i * dim..(i + 1) * dim]);
        sy.push(ys[i]);
    }
    split(dim, classes, sx, sy, test)
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

/// The red wine quality data as `linfa-datasets` ships it: features row-major, and grades mapped to
/// classes `0..` in increasing order. Fails if the data is not what it should be.
pub fn wine_data() -> Result<(Vec<f32>, Vec<u32>, usize, usize), String> {
    let ds = linfa_datasets::winequality();
    let n = ds.targets.len();
    let dim = ds.records.ncols();
    if n == 0 || dim == 0 || ds.records.nrows() != n {
        return Err(format!(
            "wine data: {} rows of {dim} features for {n} labels",
            ds.records.nrows()
        ));
    }
    let mut grades: Vec<usize> = ds.targets.iter().copied().collect();
    grades.sort_unstable();
    grades.dedup();
    let ys = ds
        .targets
        .iter()
        .map(|g| grades.binary_search(g).expect("listed") as u32)
        .collect();
    // Standardise every feature (mean 0, deviation 1): the raw ones span five orders of magnitude.
    let mut xs = vec![0f32; n * dim];
    for j in 0..dim {
        let col = ds.records.column(j);
        let mean = col.sum() / n as f64;
        let var = col.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        let sd = var.sqrt().max(1e-12);
        for (i, x) in col.iter().enumerate() {
            xs[i * dim + j] = ((x - mean) / sd) as f32;
        }
    }
    Ok((xs, ys, dim, grades.len()))
}

/// The wines, shuffled with `seed`, 20% held out for test.
fn wine(seed: u64) -> Result<Dataset, String> {
    let (xs, ys, dim, classes) = wine_data()?;
    let n = ys.len();
    let mut order: Vec<usize> = (0..n).collect();
    Rng::new(seed, 0xd161).shuffle(&mut order);
    let mut sx = Vec::with_capacity(xs.len());
    let mut sy = Vec::with_capacity(n);
    for &i in &order {
        sx.extend_from_slice(&xs[i * dim..(i + 1) * dim]);
        sy.push(ys[i]);
    }
    Ok(split(dim, classes, sx, sy, n / 5))
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
    fn wine_data_is_standardised_with_six_grades() {
        let (xs, ys, dim, classes) = wine_data().unwrap();
        assert_eq!((ys.len(), dim, classes), (1599, 11, 6));
        for j in 0..dim {
            let mean: f64 =
                (0..ys.len()).map(|i| xs[i * dim + j] as f64).sum::<f64>() / ys.len() as f64;
            assert!(mean.abs() < 1e-4, "feature {j} mean {mean}");
        }
        for c in 0..classes as u32 {
            assert!(ys.contains(&c), "grade class {c} unused");
        }
    }

    #[test]
    fn tasks_are_deterministic_and_use_several_classes() {
        for task in [Task::Teacher, Task::Wine, Task::Spirals, Task::Shapes] {
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
