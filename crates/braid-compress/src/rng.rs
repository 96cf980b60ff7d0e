//! Counter-based random streams: every random number is a pure function of `(seed, tag, step, i)`.
//!
//! There is no generator state to carry or to keep in step between ranks: element `i` of a stream is
//! computed directly, so a GPU kernel can draw it from thread `i` and get the same bits as this reference.
//!
//! The construction is SplitMix64's output function applied to a Weyl sequence:
//!
//! ```text
//! mix(z)  = z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^ (z >> 31)
//! base    = mix(mix(seed + tag·γ) ^ step)                      (γ = 0x9E3779B97F4A7C15, wrapping u64)
//! draw(i) = mix(base + (i + 1)·γ)
//! ```
//!
//! Each use of randomness in this crate has its own `tag` (the `TAG_*` constants), so streams for the same
//! seed and step never overlap in purpose.

/// The golden-ratio increment of SplitMix64.
pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Stream tag of random-k's index selection.
pub const TAG_RANDOM_K: u64 = 1;
/// Stream tag of the threshold top-k sample.
pub const TAG_SAMPLE: u64 = 2;
/// Stream tag of int8 stochastic rounding.
pub const TAG_ROUNDING: u64 = 3;
/// Stream tag of PowerSGD's initial Q.
pub const TAG_POWER_SGD: u64 = 4;

/// SplitMix64's output function (a bijection on `u64`).
#[inline(always)]
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One random stream, identified by `(seed, tag, step)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream {
    base: u64,
}

impl Stream {
    /// The stream of `tag` for `seed` at training step `step`.
    pub fn new(seed: u64, tag: u64, step: u64) -> Self {
        Stream {
            base: mix(mix(seed.wrapping_add(tag.wrapping_mul(GAMMA))) ^ step),
        }
    }

    /// The `i`-th 64-bit draw.
    #[inline(always)]
    pub fn u64_at(&self, i: u64) -> u64 {
        mix(self
            .base
            .wrapping_add(i.wrapping_add(1).wrapping_mul(GAMMA)))
    }

    /// The `i`-th draw as a uniform `f32` in `[0, 1)`: the top 24 bits times 2⁻²⁴ (exact).
    #[inline(always)]
    pub fn unit_f32_at(&self, i: u64) -> f32 {
        (self.u64_at(i) >> 40) as f32 * (1.0 / 16_777_216.0)
    }

    /// The `i`-th draw as an index in `0..n`: `(draw · n) >> 64` (bias below `n / 2⁶⁴`). `n` must be > 0.
    #[inline(always)]
    pub fn index_at(&self, i: u64, n: u64) -> u64 {
        ((self.u64_at(i) as u128 * n as u128) >> 64) as u64
    }

    /// The `i`-th standard normal draw, by Box–Muller in f64 from draws `2i` and `2i + 1`:
    /// `u1 = ((d₀ >> 11) + 1)·2⁻⁵³ ∈ (0, 1]`, `u2 = (d₁ >> 11)·2⁻⁵³`, `z = √(−2 ln u1)·cos(2π u2)`,
    /// rounded to f32. (Transcendental functions may differ in the last bit between math libraries.)
    pub fn normal_at(&self, i: u64) -> f32 {
        const SCALE: f64 = 1.0 / (1u64 << 53) as f64;
        let d0 = self.u64_at(i.wrapping_mul(2));
        let d1 = self.u64_at(i.wrapping_mul(2).wrapping_add(1));
        let u1 = ((d0 >> 11) + 1) as f64 * SCALE;
        let u2 = (d1 >> 11) as f64 * SCALE;
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_differ_by_seed_tag_and_step() {
        let a = Stream::new(1, TAG_RANDOM_K, 0);
        assert_ne!(a.u64_at(0), Stream::new(2, TAG_RANDOM_K, 0).u64_at(0));
        assert_ne!(a.u64_at(0), Stream::new(1, TAG_SAMPLE, 0).u64_at(0));
        assert_ne!(a.u64_at(0), Stream::new(1, TAG_RANDOM_K, 1).u64_at(0));
        assert_eq!(a.u64_at(7), Stream::new(1, TAG_RANDOM_K, 0).u64_at(7));
    }

    #[test]
    fn uniform_and_normal_moments() {
        let s = Stream::new(42, 99, 3);
        let n = 100_000u64;
        let (mut su, mut sn, mut sn2) = (0f64, 0f64, 0f64);
        for i in 0..n {
            let u = s.unit_f32_at(i);
            assert!((0.0..1.0).contains(&u));
            su += u as f64;
            let z = s.normal_at(i) as f64;
            sn += z;
            sn2 += z * z;
        }
        let n = n as f64;
        assert!((su / n - 0.5).abs() < 0.005);
        assert!((sn / n).abs() < 0.02);
        assert!((sn2 / n - 1.0).abs() < 0.02);
        assert!((0..1000).all(|i| s.index_at(i, 10) < 10));
    }
}
