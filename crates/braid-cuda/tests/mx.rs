//! The MX kernels (kernels/mx.cu: MXFP8 E4M3 and E5M2, MXFP4 E2M1), their real `__global__` entry
//! points run on the SIMT runner under ThreadSanitizer (tests/host/mx_driver.cpp), checked against
//! braid-compress's CPU codec bit for bit: the fused error-feedback step gives the scales and codes of
//! `ErrorFeedback::step` with the `Mx` codec and its new error buffer, over two chained steps (so the
//! error carried in is not zero), with clipping and every kind of decay; the decode-and-accumulate
//! kernel adds what `Compressed::accumulate` adds. Gradients hold NaNs and infinities (whole blocks
//! then decode to NaN), zeros, subnormals, exact ties between element values, values past the format's
//! largest, and lengths that are not a multiple of the 32-element block or of a warp, over several
//! grid shapes (one warp, blocks of warps striding, more warps than blocks).
//!
//! A NaN compares equal to any NaN: on a GPU, arithmetic returns the canonical NaN where the CPU
//! keeps the operand's payload.

mod support;

use std::io::Write;
use std::path::PathBuf;
use std::sync::OnceLock;

use braid_compress::mx::{MxElement, MX_BLOCK};
use braid_compress::{Compressed, ErrorFeedback, Mx, Payload};
use support::{built_once, f32s, same_bits_or_both_nan, HostProgram};

fn driver() -> Option<PathBuf> {
    static EXE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    built_once(
        &EXE,
        "mx_driver.cpp",
        &[
            "-O1",
            "-DBRAID_SIMT",
            "-fsanitize=thread",
            "-ffp-contract=off",
        ],
    )
}

/// The MX driver's requests.
struct Driver(HostProgram);

impl Driver {
    fn header(&mut self, format: u32, kind: u32, grid: (u32, u32), n: usize) {
        for v in [format, kind, grid.0, grid.1] {
            self.0.input.write_all(&v.to_le_bytes()).unwrap();
        }
        self.0.input.write_all(&(n as u64).to_le_bytes()).unwrap();
    }

    fn send_floats(&mut self, v: &[f32]) {
        for x in v {
            self.0.input.write_all(&x.to_le_bytes()).unwrap();
        }
    }

    /// One fused step: (scales, codes, new error).
    #[allow(clippy::too_many_arguments)]
    fn ef_step(
        &mut self,
        e: MxElement,
        grid: (u32, u32),
        grad: &[f32],
        error: &[f32],
        clip_scale: f32,
        decay: f32,
    ) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
        let n = grad.len();
        self.header(format(e), 0, grid, n);
        self.send_floats(&[clip_scale, decay]);
        self.send_floats(grad);
        self.send_floats(error);
        let (ns, nc) = (n.div_ceil(MX_BLOCK), e.code_bytes(n));
        let b = self.0.reply(ns + nc + 4 * n);
        (
            b[..ns].to_vec(),
            b[ns..ns + nc].to_vec(),
            f32s(&b[ns + nc..]),
        )
    }

    /// out + decode(scales, codes).
    fn accumulate(
        &mut self,
        e: MxElement,
        grid: (u32, u32),
        scales: &[u8],
        codes: &[u8],
        out: &[f32],
    ) -> Vec<f32> {
        self.header(format(e), 1, grid, out.len());
        self.0.input.write_all(scales).unwrap();
        self.0.input.write_all(codes).unwrap();
        self.send_floats(out);
        f32s(&self.0.reply(4 * out.len()))
    }
}

fn format(e: MxElement) -> u32 {
    match e {
        MxElement::E4M3 => 0,
        MxElement::E5M2 => 1,
        MxElement::E2M1 => 2,
    }
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// A gradient of `n` elements with every kind of hard value: mostly spread magnitudes, and per block
/// now and then a zero, a subnormal, an exact tie between two element values of the block's scale, a
/// value past the element format's largest, and (in `special` blocks) a NaN or an infinity.
fn gradient(rng: &mut Rng, n: usize, e: MxElement, special: bool) -> Vec<f32> {
    let mut g: Vec<f32> = (0..n)
        .map(|_| {
            let m = rng.unit() * 2.0 - 1.0;
            m * 2f32.powi((rng.next() % 40) as i32 - 20)
        })
        .collect();
    for (b, block) in g.chunks_mut(MX_BLOCK).enumerate() {
        let len = block.len();
        let pick = |rng: &mut Rng| (rng.next() % len as u64) as usize;
        match rng.next() % 8 {
            0 => block[pick(rng)] = 0.0,
            1 => block[pick(rng)] = f32::from_bits(1 + (rng.next() % 1000) as u32),
            2 => {
                // A whole block on one scale: amax 1, so elements are x / 2^-emax; ties between
                // consecutive element values appear as their midpoints.
                block.iter_mut().for_each(|x| *x = 0.0);
                block[0] = 1.0;
                let lo = e.decode(1 + (rng.next() % 5) as u8);
                let hi = e.decode(2 + (rng.next() % 5) as u8);
                let s = 2f32.powi(-e.emax());
                for x in block.iter_mut().skip(1) {
                    *x = (lo + hi) / 2.0 * s;
                }
            }
            3 => {
                // Past the largest value once scaled: clipped to it.
                block[0] = 1.99;
                block[pick(rng)] = -1.98;
            }
            4 if special && b % 3 == 0 => block[pick(rng)] = f32::NAN,
            5 if special && b % 3 == 1 => block[pick(rng)] = f32::NEG_INFINITY,
            _ => {}
        }
    }
    g
}

const GRIDS: [(u32, u32); 3] = [(1, 32), (3, 64), (2, 256)];

#[test]
fn the_fused_error_feedback_step_is_the_cpu_codec_to_the_bit() {
    let Some(exe) = driver() else { return };
    let mut d = Driver(HostProgram::start(&exe));
    let mut rng = Rng(0x5eed);
    let mut cases = 0;
    for e in MxElement::ALL {
        for (k, n) in [0usize, 1, 31, 32, 33, 95, 257, 1031]
            .into_iter()
            .enumerate()
        {
            for (decay, clip) in [(1.0f32, None), (0.5, Some(3.0f32)), (0.0, None)] {
                let grid = GRIDS[(k + cases) % GRIDS.len()];
                let what =
                    format!("{e:?}, {n} elements, decay {decay}, clip {clip:?}, grid {grid:?}");
                let mut ef = ErrorFeedback::new(n).with_decay(decay).unwrap();
                if let Some(c) = clip {
                    ef = ef.with_clip(c).unwrap();
                }
                let mut codec = Mx::new(e);
                let mut error = vec![0.0f32; n];
                for step in 0..2u64 {
                    let g = gradient(&mut rng, n, e, step == 1);
                    let norm = braid_compress::l2_norm(&g);
                    let clip_scale = match clip {
                        Some(max) if norm > max as f64 => (max as f64 / norm) as f32,
                        _ => 1.0,
                    };
                    let (c, _) = ef.step(&g, &mut codec, step).unwrap();
                    let Payload::Mx { scales, codes, .. } = c.payload() else {
                        panic!("not an MX payload")
                    };
                    let (ks, kc, ke) = d.ef_step(e, grid, &g, &error, clip_scale, decay);
                    assert_eq!(&ks, scales, "{what}, step {step}: scales");
                    assert_eq!(&kc, codes, "{what}, step {step}: codes");
                    same_bits_or_both_nan(&ke, &ef.error, &format!("{what}, step {step}: error"));
                    error = ke;
                    cases += 1;
                }
            }
        }
    }
    d.0.finish();
    assert_eq!(cases, 3 * 8 * 3 * 2);
}

#[test]
fn decode_and_accumulate_adds_what_the_cpu_adds() {
    let Some(exe) = driver() else { return };
    let mut d = Driver(HostProgram::start(&exe));
    let mut rng = Rng(0xacc);
    for e in MxElement::ALL {
        for (k, n) in [1usize, 32, 33, 500].into_iter().enumerate() {
            let g = gradient(&mut rng, n, e, true);
            let c = {
                use braid_compress::Codec;
                Mx::new(e).compress(&g, 0)
            };
            let Payload::Mx { scales, codes, .. } = c.payload() else {
                panic!("not an MX payload")
            };
            let out: Vec<f32> = (0..n).map(|_| rng.unit() - 0.5).collect();
            let mut want = out.clone();
            c.accumulate(&mut want).unwrap();
            let got = d.accumulate(e, GRIDS[k % GRIDS.len()], scales, codes, &out);
            same_bits_or_both_nan(&got, &want, &format!("{e:?}, {n} elements"));
            // The bytes decode on the CPU side too.
            assert_eq!(Compressed::decode(&c.encode()).unwrap(), c);
        }
    }
    d.0.finish();
}
