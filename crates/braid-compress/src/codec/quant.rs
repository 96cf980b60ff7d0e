//! Int8 with per-block scales, and 1-bit sign with per-block mean magnitude.

use super::{check_block, Codec, Transport};
use crate::rng::{Stream, TAG_ROUNDING};
use crate::select::abs_key;
use crate::wire::Payload;
use crate::{Compressed, Result};

/// The block size both quantisers use by default.
pub const DEFAULT_BLOCK: usize = 256;

/// How int8 rounds `x / scale` to an integer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// To nearest, ties away from zero (C's `roundf`): error at most `scale / 2` per element.
    Nearest,
    /// Up with probability equal to the fraction, from `Stream::new(seed, TAG_ROUNDING, step)`, draw `i`
    /// for element `i`: unbiased, error below `scale`.
    Stochastic {
        /// Seed of the rounding stream.
        seed: u64,
    },
}

/// Int8 with one f32 scale per block of `block` elements (the last block may be short).
///
/// Per block: `m` is the largest magnitude (compared as in [`TopK`](crate::TopK), so a NaN makes `m` NaN),
/// `scale = m / 127` (f32 division). If `scale == 0` every value is 0. Otherwise, per element,
/// `v = x / scale` (IEEE division, not a reciprocal multiply) and
///
/// * [`Rounding::Nearest`]: `q = round(v)`, ties away from zero;
/// * [`Rounding::Stochastic`]: `q = ⌊v⌋ + (u < v − ⌊v⌋)` with `u` the element's draw in `[0, 1)`
///   (multiples of 2⁻²⁴), so `E[q] = v` up to that resolution;
///
/// then `q` is clamped to `−127..=127` (a NaN `v` becomes 0). Decompression is `q as f32 · scale`, so a
/// block with a non-finite value decompresses to NaN or ±∞ and the problem stays visible.
#[derive(Clone, Debug, PartialEq)]
pub struct Int8 {
    block: u32,
    rounding: Rounding,
}

impl Int8 {
    /// Round-to-nearest int8 with blocks of `block ≥ 1` elements.
    pub fn new(block: usize) -> Result<Self> {
        Ok(Int8 {
            block: check_block("int8", block)?,
            rounding: Rounding::Nearest,
        })
    }

    /// Stochastically rounded (unbiased) int8 with blocks of `block ≥ 1` elements.
    pub fn stochastic(block: usize, seed: u64) -> Result<Self> {
        Ok(Int8 {
            block: check_block("int8", block)?,
            rounding: Rounding::Stochastic { seed },
        })
    }

    /// The block size.
    pub fn block(&self) -> usize {
        self.block as usize
    }

    /// The rounding mode.
    pub fn rounding(&self) -> Rounding {
        self.rounding
    }
}

impl Default for Int8 {
    fn default() -> Self {
        Int8 {
            block: DEFAULT_BLOCK as u32,
            rounding: Rounding::Nearest,
        }
    }
}

impl Codec for Int8 {
    fn name(&self) -> String {
        match self.rounding {
            Rounding::Nearest => format!("int8(block={})", self.block),
            Rounding::Stochastic { seed } => {
                format!("int8(block={}, stochastic, seed={seed})", self.block)
            }
        }
    }

    fn transport(&self) -> Transport {
        Transport::Gather
    }

    fn compress(&mut self, grad: &[f32], step: u64) -> Compressed {
        let block = self.block as usize;
        let mut scales = Vec::with_capacity(grad.len().div_ceil(block));
        let mut quants = vec![0i8; grad.len()];
        let stream = match self.rounding {
            Rounding::Nearest => None,
            Rounding::Stochastic { seed } => Some(Stream::new(seed, TAG_ROUNDING, step)),
        };
        for (b, (x, q)) in grad.chunks(block).zip(quants.chunks_mut(block)).enumerate() {
            let m = f32::from_bits(x.iter().map(|&v| abs_key(v)).max().unwrap_or(0));
            let scale = m / 127.0;
            scales.push(scale);
            if scale == 0.0 {
                continue;
            }
            match stream {
                None => {
                    for (q, &x) in q.iter_mut().zip(x) {
                        *q = round_half_away(x / scale);
                    }
                }
                Some(s) => {
                    let first = (b * block) as u64;
                    for (j, (q, &x)) in q.iter_mut().zip(x).enumerate() {
                        let v = x / scale;
                        let fl = floor(v);
                        let up = s.unit_f32_at(first + j as u64) < v - fl;
                        *q = clamp_i8(fl + if up { 1.0 } else { 0.0 });
                    }
                }
            }
        }
        Compressed::new_unchecked(
            grad.len(),
            Payload::Int8 {
                block: self.block,
                scales,
                quants,
            },
        )
    }
}

/// `roundf(v)` clamped to `−127..=127`, NaN to 0, without a libm call: `v ± 0.5` is exact in f64 for a
/// 24-bit `v`, and truncation then rounds half away from zero.
#[inline(always)]
fn round_half_away(v: f32) -> i8 {
    let v = (v as f64).clamp(-127.0, 127.0);
    (v + 0.5f64.copysign(v)) as i8
}

/// `⌊v⌋` for the `|v| ≤ 128` (or NaN) that int8 quantisation produces, without a libm call.
#[inline(always)]
fn floor(v: f32) -> f32 {
    let t = v.clamp(-256.0, 256.0) as i32 as f32;
    if t > v {
        t - 1.0
    } else if v.is_nan() {
        v
    } else {
        t
    }
}

/// Clamps to `−127..=127` and converts (NaN to 0).
#[inline(always)]
fn clamp_i8(v: f32) -> i8 {
    v.clamp(-127.0, 127.0) as i8
}

/// 1-bit sign with a scale per block, as in EF-signSGD: element `i` decompresses to `±scale` of its block.
///
/// The bit is set when `x < 0` (so ±0 and NaN send `+scale`). The scale is the block's mean magnitude,
/// `Σ|x| / n`, summed in f64 in index order over the block's `n` elements and rounded to f32 once. With
/// [`whole_tensor`](Self::whole_tensor) there is one scale, `‖x‖₁ / len`, exactly EF-signSGD.
#[derive(Clone, Debug, PartialEq)]
pub struct Sign {
    block: u32,
}

impl Sign {
    /// Sign with blocks of `block ≥ 1` elements.
    pub fn new(block: usize) -> Result<Self> {
        Ok(Sign {
            block: check_block("sign", block)?,
        })
    }

    /// One scale for the whole tensor (blocks of `u32::MAX` elements).
    pub fn whole_tensor() -> Self {
        Sign { block: u32::MAX }
    }

    /// The block size.
    pub fn block(&self) -> usize {
        self.block as usize
    }
}

impl Default for Sign {
    fn default() -> Self {
        Sign {
            block: DEFAULT_BLOCK as u32,
        }
    }
}

impl Codec for Sign {
    fn name(&self) -> String {
        format!("sign(block={})", self.block)
    }

    fn transport(&self) -> Transport {
        Transport::Gather
    }

    fn compress(&mut self, grad: &[f32], _step: u64) -> Compressed {
        let block = self.block as usize;
        let scales = grad
            .chunks(block)
            .map(|x| (x.iter().map(|&v| v.abs() as f64).sum::<f64>() / x.len() as f64) as f32)
            .collect();
        let mut bits = vec![0u8; grad.len().div_ceil(8)];
        for (byte, x) in bits.iter_mut().zip(grad.chunks(8)) {
            for (j, &v) in x.iter().enumerate() {
                *byte |= ((v < 0.0) as u8) << j;
            }
        }
        Compressed::new_unchecked(
            grad.len(),
            Payload::Sign {
                block: self.block,
                scales,
                bits,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_helpers_match_libm() {
        let mut vs = vec![
            0.0f32, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5, 126.5, -126.5, 127.0, 127.4, 127.6, -127.6,
            128.0,
        ];
        vs.extend([
            0.49999997f32,
            -0.49999997,
            1.4999999,
            2.4999998,
            126.49999,
            0.99999994,
            -0.99999994,
            1e-30,
        ]);
        let s = Stream::new(0, 0, 0);
        vs.extend((0..20_000).map(|i| (s.unit_f32_at(i) - 0.5) * 260.0));
        for v in vs {
            assert_eq!(
                round_half_away(v),
                v.round().clamp(-127.0, 127.0) as i8,
                "round({v})"
            );
            if v.abs() <= 128.0 {
                assert_eq!(floor(v), v.floor(), "floor({v})");
            }
        }
        assert_eq!(round_half_away(f32::NAN), 0);
        assert!(floor(f32::NAN).is_nan());
        assert_eq!(clamp_i8(f32::NAN), 0);
        assert_eq!(clamp_i8(-300.0), -127);
    }
}
