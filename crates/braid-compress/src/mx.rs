//! Block-scaled floats as the OCP Microscaling Formats (MX) specification v1.0 defines them: blocks
//! of [`MX_BLOCK`] (32) elements share one E8M0 scale (a power of two, `2^(code − 127)`, code 255 NaN),
//! and each element is a small float: FP8 E4M3 or E5M2 (MXFP8), or FP4 E2M1 (MXFP4).
//!
//! Encoding a block follows the specification's conversion: `shared = ⌊log₂ amax⌋ − emax`, with
//! `amax` the block's largest magnitude and `emax` the exponent of the element format's largest normal
//! (8 for E4M3, 15 for E5M2, 2 for E2M1), clamped to the scale's range `−127..=127` (an all-zero block
//! takes −127); then every element is `x / 2^shared` rounded to the nearest element value, ties to
//! even, saturating at the largest normal (so a block's largest element may be clipped: up to 448 of
//! the 512 an E4M3 block spans, 6 of E2M1's 8). A block holding a NaN or an infinity gets the NaN
//! scale and decodes to NaN everywhere, so the problem stays visible (as with int8, whose scale
//! becomes NaN). Decoding is an element value times a power of two, exact for what the encoder produces
//! (a scale code of at most 127 + 127 − emax); the largest scale codes times the largest elements,
//! which only foreign bytes carry, overflow to ±∞.
//!
//! Element codes are sign-magnitude: bit `bits − 1` is the sign, then the exponent field, then the
//! mantissa. E4M3 has no infinities and its NaN is `S.1111.111`; E5M2 is IEEE-like (`S.11111.00`
//! infinity, `S.11111.xx` NaN otherwise); E2M1 has neither.

use crate::{Error, Result};

/// Elements per scale.
pub const MX_BLOCK: usize = 32;

/// The E8M0 scale code that means NaN.
pub const SCALE_NAN: u8 = 0xFF;

/// The bias of the E8M0 scale: code `c` is `2^(c − 127)`.
const SCALE_BIAS: i32 = 127;

/// An MX element format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MxElement {
    /// FP8 with 4 exponent bits (bias 7) and 3 mantissa bits; largest 448, no infinities.
    E4M3,
    /// FP8 with 5 exponent bits (bias 15) and 2 mantissa bits; largest 57344, IEEE infinities and NaNs.
    E5M2,
    /// FP4 with 2 exponent bits (bias 1) and 1 mantissa bit; values 0, 0.5, 1, 1.5, 2, 3, 4, 6.
    E2M1,
}

impl MxElement {
    /// Every element format.
    pub const ALL: [MxElement; 3] = [MxElement::E4M3, MxElement::E5M2, MxElement::E2M1];

    /// Its name, `e4m3`, `e5m2` or `e2m1`.
    pub fn name(self) -> &'static str {
        match self {
            MxElement::E4M3 => "e4m3",
            MxElement::E5M2 => "e5m2",
            MxElement::E2M1 => "e2m1",
        }
    }

    /// The format of `name` (`e4m3`, `e5m2`, `e2m1`).
    pub fn from_name(name: &str) -> Result<MxElement> {
        MxElement::ALL
            .into_iter()
            .find(|e| e.name() == name)
            .ok_or_else(|| {
                Error::InvalidParameter(format!(
                    "{name:?} is not an MX element format (e4m3, e5m2, e2m1)"
                ))
            })
    }

    /// Bits per element code: 8, or 4 for E2M1.
    pub fn bits(self) -> u32 {
        match self {
            MxElement::E2M1 => 4,
            _ => 8,
        }
    }

    /// Bytes of element codes for `len` elements: one a byte, or two for E2M1.
    pub fn code_bytes(self, len: usize) -> usize {
        match self.bits() {
            8 => len,
            _ => len.div_ceil(2),
        }
    }

    /// (exponent bits, mantissa bits, exponent bias).
    fn fields(self) -> (u32, u32, i32) {
        match self {
            MxElement::E4M3 => (4, 3, 7),
            MxElement::E5M2 => (5, 2, 15),
            MxElement::E2M1 => (2, 1, 1),
        }
    }

    /// The exponent of its largest normal value (`emax` of the specification).
    pub fn emax(self) -> i32 {
        match self {
            MxElement::E4M3 => 8,
            MxElement::E5M2 => 15,
            MxElement::E2M1 => 2,
        }
    }

    /// Its largest finite value.
    pub fn max(self) -> f32 {
        match self {
            MxElement::E4M3 => 448.0,
            MxElement::E5M2 => 57344.0,
            MxElement::E2M1 => 6.0,
        }
    }

    /// The code of its largest finite value (positive).
    fn max_code(self) -> u8 {
        match self {
            MxElement::E4M3 => 0x7E,
            MxElement::E5M2 => 0x7B,
            MxElement::E2M1 => 0x7,
        }
    }

    /// The value of element code `code` (its low [`MxElement::bits`] bits), from the fields as the
    /// specification defines them.
    pub fn decode(self, code: u8) -> f32 {
        let (eb, mb, bias) = self.fields();
        let bits = self.bits();
        let code = u32::from(code) & ((1 << bits) - 1);
        let negative = code >> (bits - 1) != 0;
        let e = (code >> mb) & ((1 << eb) - 1);
        let m = code & ((1 << mb) - 1);
        let top = (1 << eb) - 1;
        let magnitude = match self {
            MxElement::E4M3 if e == top && m == (1 << mb) - 1 => f32::NAN,
            MxElement::E5M2 if e == top && m == 0 => f32::INFINITY,
            MxElement::E5M2 if e == top => f32::NAN,
            _ if e == 0 => m as f32 * pow2(1 - bias - mb as i32),
            _ => ((1 << mb) + m) as f32 * pow2(e as i32 - bias - mb as i32),
        };
        if negative {
            -magnitude
        } else {
            magnitude
        }
    }

    /// The code of `v`: the nearest element value, ties to the even code (mantissa's last bit 0),
    /// saturating at ±[`MxElement::max`] (infinities too). A NaN gives the format's NaN code where it
    /// has one, and 0 for E2M1 (a block holding a NaN carries the NaN scale instead).
    pub fn encode(self, v: f32) -> u8 {
        let sign = if v.is_sign_negative() {
            1u8 << (self.bits() - 1)
        } else {
            0
        };
        if v.is_nan() {
            return match self {
                MxElement::E4M3 => sign | 0x7F,
                MxElement::E5M2 => sign | 0x7E,
                MxElement::E2M1 => 0,
            };
        }
        let a = v.abs();
        if a >= self.max() {
            return sign | self.max_code();
        }
        let (_, mb, bias) = self.fields();
        let mb = mb as i32;
        // The spacing of element values around `a`: subnormal spacing below the smallest normal.
        let quantum = floor_log2(a).max(1 - bias) - mb;
        // `a / 2^quantum` is exact (a power-of-two scaling well inside f32's range), and so is its
        // rounding to an integer: the value's significand in units of the spacing.
        let n = (a * pow2(-quantum)).round_ties_even() as u32;
        if n == 0 {
            return sign;
        }
        // The code is the exponent field of the spacing's binade followed by the significand's
        // fraction bits; a subnormal's field is 1 with its leading bit 0, which comes out the same
        // (code = n), and a significand rounded up to 2^(mb + 1) carries into the exponent field.
        let field = (quantum + mb + bias) as u32;
        let code = ((field << mb) + n - (1 << mb)).min(u32::from(self.max_code()));
        sign | code as u8
    }
}

/// `2^k` for `k` in `−149..=127`, exactly.
fn pow2(k: i32) -> f32 {
    debug_assert!((-149..=127).contains(&k));
    if k >= -126 {
        f32::from_bits(((k + 127) as u32) << 23)
    } else {
        f32::from_bits(1 << (k + 149))
    }
}

/// `⌊log₂ a⌋` of a positive finite f32 (subnormals included).
fn floor_log2(a: f32) -> i32 {
    let bits = a.to_bits() & 0x7FFF_FFFF;
    let e = (bits >> 23) as i32;
    if e > 0 {
        e - 127
    } else {
        -118 - (bits & 0x7F_FFFF).leading_zeros() as i32
    }
}

/// The E8M0 scale code of a block whose largest magnitude is `amax` (NaN if `amax` is not finite).
pub fn scale_code(amax: f32, element: MxElement) -> u8 {
    if !amax.is_finite() {
        return SCALE_NAN;
    }
    let shared = if amax == 0.0 {
        -SCALE_BIAS
    } else {
        (floor_log2(amax) - element.emax()).clamp(-SCALE_BIAS, SCALE_BIAS)
    };
    (shared + SCALE_BIAS) as u8
}

/// The value of E8M0 scale code `code`: `2^(code − 127)`, NaN for 255.
pub fn scale_value(code: u8) -> f32 {
    if code == SCALE_NAN {
        f32::NAN
    } else {
        pow2(i32::from(code) - SCALE_BIAS)
    }
}

/// Encodes one block (at most [`MX_BLOCK`] values): its scale code, and each element's code passed
/// to `put` in order.
pub fn encode_block(x: &[f32], element: MxElement, mut put: impl FnMut(u8)) -> u8 {
    debug_assert!(x.len() <= MX_BLOCK);
    let amax = x.iter().fold(0.0f32, |m, v| {
        if v.is_finite() && m.is_finite() {
            m.max(v.abs())
        } else {
            f32::NAN
        }
    });
    let scale = scale_code(amax, element);
    if scale == SCALE_NAN {
        x.iter().for_each(|_| put(0));
        return scale;
    }
    // Dividing by the scale is multiplying by its inverse, a power of two: exact wherever the result
    // is a normal f32 (|x| / 2^shared < 2^(emax + 1) keeps it in range), and a result small enough
    // to be subnormal is far below the element's smallest value, so it encodes as zero either way.
    let inv = pow2(SCALE_BIAS - i32::from(scale));
    for &v in x {
        put(element.encode(v * inv));
    }
    scale
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of every code of `e`, independently of `decode`: sign · 2^(E − bias) · (1 + M/2^m)
    /// for a nonzero exponent field, sign · 2^(1 − bias) · M/2^m for zero, and the format's specials.
    fn definition(e: MxElement, code: u8) -> f32 {
        let (eb, mb, bias) = e.fields();
        let bits = e.bits();
        let s = if (code >> (bits - 1)) & 1 == 1 {
            -1.0f64
        } else {
            1.0
        };
        let ef = i32::from(code >> mb) & ((1 << eb) - 1);
        let mf = f64::from(code & ((1 << mb) - 1));
        let top = (1 << eb) - 1;
        match e {
            MxElement::E4M3 if ef == top && mf == 7.0 => return f32::NAN,
            MxElement::E5M2 if ef == top => {
                return if mf == 0.0 {
                    (s * f64::INFINITY) as f32
                } else {
                    f32::NAN
                }
            }
            _ => {}
        }
        let v = if ef == 0 {
            2f64.powi(1 - bias) * mf / 2f64.powi(mb as i32)
        } else {
            2f64.powi(ef - bias) * (1.0 + mf / 2f64.powi(mb as i32))
        };
        (s * v) as f32
    }

    #[test]
    fn every_code_decodes_as_the_format_defines_and_encodes_back() {
        for e in MxElement::ALL {
            let n = 1u32 << e.bits();
            let mut finite = 0;
            for c in 0..n {
                let c = c as u8;
                let (got, want) = (e.decode(c), definition(e, c));
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{e:?} code {c:#04x}: decodes to {got}, the definition says {want}"
                );
                if got.is_finite() {
                    finite += 1;
                    assert_eq!(e.encode(got), c, "{e:?} code {c:#04x} ({got}) encodes back");
                }
            }
            // Both zeros count; E4M3 loses its two NaNs, E5M2 its 6 NaNs and 2 infinities.
            let expected = match e {
                MxElement::E4M3 => 254,
                MxElement::E5M2 => 248,
                MxElement::E2M1 => 16,
            };
            assert_eq!(finite, expected, "{e:?}");
            assert_eq!(e.decode(e.max_code()), e.max());
            assert_eq!(e.emax(), floor_log2(e.max()));
        }
    }

    #[test]
    fn rounding_is_to_nearest_ties_to_even_and_saturates() {
        for e in MxElement::ALL {
            let n = 1u32 << (e.bits() - 1);
            let mut values: Vec<(f32, u8)> = (0..n as u8)
                .map(|c| (e.decode(c), c))
                .filter(|(v, _)| v.is_finite())
                .collect();
            values.sort_by(|a, b| a.0.total_cmp(&b.0));
            for w in values.windows(2) {
                let ((lo, lc), (hi, hc)) = (w[0], w[1]);
                let mid = (lo + hi) / 2.0; // exact: both have few significant bits
                let even = if lc % 2 == 0 { lc } else { hc };
                assert_eq!(
                    e.encode(mid),
                    even,
                    "{e:?}: tie {mid} between {lo} and {hi}"
                );
                let below = f32::from_bits(mid.to_bits() - 1);
                let above = f32::from_bits(mid.to_bits() + 1);
                assert_eq!(e.encode(below), lc, "{e:?}: {below} just below the tie");
                assert_eq!(e.encode(above), hc, "{e:?}: {above} just above the tie");
                assert_eq!(e.encode(-above), hc | (n as u8), "{e:?}: the negative side");
            }
            let max = e.max();
            for big in [max * 1.01, max * 2.0, f32::MAX, f32::INFINITY] {
                assert_eq!(e.decode(e.encode(big)), max, "{e:?}: {big} saturates");
                assert_eq!(e.decode(e.encode(-big)), -max, "{e:?}: {} saturates", -big);
            }
            assert_eq!(
                e.encode(f32::from_bits(1)),
                0,
                "the smallest f32 rounds to +0"
            );
            assert_eq!(e.encode(-0.0), n as u8, "−0 keeps its sign");
        }
        assert!(MxElement::E4M3
            .decode(MxElement::E4M3.encode(f32::NAN))
            .is_nan());
        assert!(MxElement::E5M2
            .decode(MxElement::E5M2.encode(f32::NAN))
            .is_nan());
    }

    #[test]
    fn scales_follow_the_specification_at_the_exponent_limits() {
        for e in MxElement::ALL {
            // amax in [2^k, 2^(k+1)) gives 2^(k − emax).
            for k in [-140, -127, -126, -1, 0, 1, 100, 127] {
                let amax = pow2(k.max(-149));
                let want = (k - e.emax()).clamp(-127, 127);
                assert_eq!(
                    i32::from(scale_code(amax, e)) - 127,
                    want,
                    "{e:?} amax 2^{k}"
                );
            }
            assert_eq!(scale_code(f32::MAX, e), (127 - e.emax() + 127) as u8);
            assert_eq!(
                scale_code(0.0, e),
                0,
                "an all-zero block takes the smallest scale"
            );
            assert_eq!(scale_code(f32::INFINITY, e), SCALE_NAN);
            assert_eq!(scale_code(f32::NAN, e), SCALE_NAN);
        }
        assert_eq!(scale_value(0), pow2(-127));
        assert_eq!(scale_value(127), 1.0);
        assert_eq!(scale_value(254), pow2(127));
        assert!(scale_value(SCALE_NAN).is_nan());
    }

    #[test]
    fn a_block_encodes_within_half_a_step_and_its_largest_value_at_most_clipped_to_max() {
        let x: Vec<f32> = (0..MX_BLOCK)
            .map(|i| ((i as f32) * 0.37 - 5.0) * 1.3e-3)
            .collect();
        for e in MxElement::ALL {
            let mut codes = Vec::new();
            let scale = encode_block(&x, e, |c| codes.push(c));
            let s = scale_value(scale);
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let (_, mb, bias) = e.fields();
            for (&v, &c) in x.iter().zip(&codes) {
                let got = e.decode(c) * s;
                let err = (got - v).abs();
                let scaled = v.abs() / s;
                if scaled > e.max() {
                    assert_eq!(
                        got.abs(),
                        e.max() * s,
                        "{e:?}: {v} clipped to the largest value"
                    );
                    continue;
                }
                // Half the spacing of the element values around v / s.
                let spacing =
                    pow2(floor_log2(scaled.max(f32::MIN_POSITIVE)).max(1 - bias) - mb as i32);
                assert!(
                    err <= spacing * s / 2.0,
                    "{e:?}: {v} became {got} (scale {s}, amax {amax})"
                );
            }
        }
        let mut codes = Vec::new();
        let with_nan = [1.0, f32::NAN, 2.0];
        assert_eq!(
            encode_block(&with_nan, MxElement::E4M3, |c| codes.push(c)),
            SCALE_NAN
        );
        assert_eq!(codes, [0, 0, 0]);
        let tiny = [f32::from_bits(3), -f32::from_bits(1), 0.0];
        let mut codes = Vec::new();
        let scale = encode_block(&tiny, MxElement::E5M2, |c| codes.push(c));
        assert_eq!(scale, 0, "a subnormal block takes the smallest scale");
        let back: Vec<f32> = codes
            .iter()
            .map(|&c| MxElement::E5M2.decode(c) * scale_value(scale))
            .collect();
        assert_eq!(back[2], 0.0);
    }
}
