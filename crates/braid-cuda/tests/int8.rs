//! The int8 compression kernel (kernels/int8.cu), its real `__global__` entry point run on the SIMT
//! runner under ThreadSanitizer (tests/host/int8_driver.cpp), checked against braid-compress's CPU
//! codec bit for bit: the fused error-feedback step gives the scales and quantised values of
//! `ErrorFeedback::step` with `Int8` (nearest and stochastic rounding from the codec's random stream)
//! and its new error buffer, over two chained steps, with clipping and every kind of decay. Blocks of
//! 1, 7, 100, 256 and 1000 elements, lengths that are not a multiple of them, NaN and infinite blocks,
//! zeros, subnormals, values on the rounding boundaries, and grids with fewer, as many and more thread
//! blocks than quantisation blocks.
//!
//! A NaN compares equal to any NaN: on a GPU, arithmetic returns the canonical NaN where the CPU
//! keeps the operand's payload.

mod support;

use std::io::Write;
use std::path::PathBuf;
use std::sync::OnceLock;

use braid_compress::rng::{mix, GAMMA, TAG_ROUNDING};
use braid_compress::{ErrorFeedback, Int8, Payload};
use support::{built_once, f32s, same_bits_or_both_nan, HostProgram};

fn driver() -> Option<PathBuf> {
    static EXE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    built_once(
        &EXE,
        "int8_driver.cpp",
        &[
            "-O1",
            "-DBRAID_SIMT",
            "-fsanitize=thread",
            "-ffp-contract=off",
        ],
    )
}

/// What one launch returns: scales, quantised values, new error.
type Step = (Vec<f32>, Vec<i8>, Vec<f32>);

/// The int8 driver's requests.
struct Driver(HostProgram);

impl Driver {
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        grid: (u32, u32),
        block: usize,
        rng_base: Option<u64>,
        grad: &[f32],
        error: &[f32],
        clip_scale: f32,
        decay: f32,
    ) -> Step {
        let n = grad.len();
        let w = &mut self.0.input;
        w.write_all(&grid.0.to_le_bytes()).unwrap();
        w.write_all(&grid.1.to_le_bytes()).unwrap();
        w.write_all(&(n as u64).to_le_bytes()).unwrap();
        w.write_all(&(block as u32).to_le_bytes()).unwrap();
        w.write_all(&u32::from(rng_base.is_some()).to_le_bytes())
            .unwrap();
        w.write_all(&rng_base.unwrap_or(0).to_le_bytes()).unwrap();
        for x in [clip_scale, decay].iter().chain(grad).chain(error) {
            w.write_all(&x.to_le_bytes()).unwrap();
        }
        let ns = n.div_ceil(block);
        let b = self.0.reply(4 * ns + n + 4 * n);
        (
            f32s(&b[..4 * ns]),
            b[4 * ns..4 * ns + n].iter().map(|&q| q as i8).collect(),
            f32s(&b[4 * ns + n..]),
        )
    }
}

/// The base of braid-compress's stream `(seed, TAG_ROUNDING, step)`, as the kernel takes it.
fn rng_base(seed: u64, step: u64) -> u64 {
    mix(mix(seed.wrapping_add(TAG_ROUNDING.wrapping_mul(GAMMA))) ^ step)
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        mix(self.0)
    }

    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// A gradient of `n` elements in blocks of `block`: spread magnitudes, and now and then a zero, a
/// subnormal, a value exactly half a step between two quantised values, a block of zeros, and (with
/// `special`) a NaN or an infinity.
fn gradient(rng: &mut Rng, n: usize, block: usize, special: bool) -> Vec<f32> {
    let mut g: Vec<f32> = (0..n)
        .map(|_| (rng.unit() * 2.0 - 1.0) * 2f32.powi((rng.next() % 30) as i32 - 15))
        .collect();
    for (b, chunk) in g.chunks_mut(block).enumerate() {
        let len = chunk.len();
        let pick = |rng: &mut Rng| (rng.next() % len as u64) as usize;
        match rng.next() % 7 {
            0 => chunk[pick(rng)] = 0.0,
            1 => chunk[pick(rng)] = -f32::from_bits(1 + (rng.next() % 1000) as u32),
            2 if len > 1 => {
                // amax 127: scale 1, and x.5 values round away from zero.
                chunk[0] = 127.0;
                let i = 1 + pick(rng) % (len - 1);
                chunk[i] = (rng.next() % 100) as f32 + 0.5;
            }
            3 => chunk.iter_mut().for_each(|x| *x = 0.0),
            4 if special && b % 2 == 0 => chunk[pick(rng)] = f32::NAN,
            5 if special && b % 2 == 1 => chunk[pick(rng)] = f32::INFINITY,
            _ => {}
        }
    }
    g
}

#[test]
fn the_fused_int8_step_is_the_cpu_codec_to_the_bit() {
    let Some(exe) = driver() else { return };
    let mut d = Driver(HostProgram::start(&exe));
    let mut rng = Rng(0x18);
    // Thread counts that are not powers of two, nor whole warps, too: the reduction carries the odd one.
    let grids = [(1u32, 32u32), (2, 96), (5, 256), (64, 128), (3, 7)];
    let mut cases = 0;
    for (k, (block, n)) in [
        (1usize, 5usize),
        (7, 50),
        (100, 1),
        (100, 333),
        (256, 1031),
        (1000, 2100),
    ]
    .into_iter()
    .enumerate()
    {
        for stochastic in [false, true] {
            for (decay, clip) in [(1.0f32, None), (0.5, Some(2.0f32)), (0.0, None)] {
                let grid = grids[(k + cases) % grids.len()];
                let seed = 11 + k as u64;
                let what = format!(
                    "block {block}, {n} elements, stochastic {stochastic}, decay {decay}, clip {clip:?}, grid {grid:?}"
                );
                let mut codec = if stochastic {
                    Int8::stochastic(block, seed).unwrap()
                } else {
                    Int8::new(block).unwrap()
                };
                let mut ef = ErrorFeedback::new(n).with_decay(decay).unwrap();
                if let Some(c) = clip {
                    ef = ef.with_clip(c).unwrap();
                }
                let mut error = vec![0.0f32; n];
                for step in 0..2u64 {
                    let g = gradient(&mut rng, n, block, step == 1);
                    let norm = braid_compress::l2_norm(&g);
                    let clip_scale = match clip {
                        Some(max) if norm > max as f64 => (max as f64 / norm) as f32,
                        _ => 1.0,
                    };
                    let (c, _) = ef.step(&g, &mut codec, step).unwrap();
                    let Payload::Int8 { scales, quants, .. } = c.payload() else {
                        panic!("not an int8 payload")
                    };
                    let base = stochastic.then(|| rng_base(seed, step));
                    let (ks, kq, ke) = d.step(grid, block, base, &g, &error, clip_scale, decay);
                    same_bits_or_both_nan(&ks, scales, &format!("{what}, step {step}: scales"));
                    assert_eq!(&kq, quants, "{what}, step {step}: quantised values");
                    same_bits_or_both_nan(&ke, &ef.error, &format!("{what}, step {step}: error"));
                    error = ke;
                    cases += 1;
                }
            }
        }
    }
    d.0.finish();
    assert_eq!(cases, 6 * 2 * 3 * 2);
}
