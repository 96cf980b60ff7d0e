//! Which codec compresses a gradient, as a value: parsing, printing, checking, and the codec it builds.

use std::fmt;
use std::str::FromStr;

use braid_core::Error;

use crate::mx::MxElement;
use crate::{
    Cast, Codec, Int8, Mx, RandomK, Sign, ThresholdTopK, TopK, DEFAULT_BLOCK, DEFAULT_DENSITY,
};

/// The forms [`CodecSpec`]'s parser accepts, for error messages.
const ACCEPTED: &str = "none, dense, topk:D, threshold-topk:D, randomk:D, int8, int8:B, int8-stochastic, \
                        int8-stochastic:B, sign, sign:B, fp16, bf16, mxfp8, mxfp8:e4m3, mxfp8:e5m2, mxfp4, mxfp4:e2m1, \
                        powersgd:R (D a density in (0, 1], B a block size ≥ 1, R a rank ≥ 1)";

/// The most characters of its input an error message repeats.
const ECHO_CHARS: usize = 80;

/// `text` quoted for an error message; past 80 characters it is cut, with an ellipsis and
/// the whole length.
pub fn echo_input(text: &str) -> String {
    let n = text.chars().count();
    if n <= ECHO_CHARS {
        format!("{text:?}")
    } else {
        let head: String = text.chars().take(ECHO_CHARS).collect();
        format!("{head:?}… ({n} characters)")
    }
}

/// Which codec compresses the gradient, with its parameters. Text form: see [`FromStr`](#impl-FromStr-for-CodecSpec).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CodecSpec {
    /// No compression: a plain all-reduce.
    Dense,
    /// Exact top-k by magnitude, keeping `density` of the elements.
    TopK {
        /// Fraction of elements kept, in `(0, 1]`.
        density: f32,
    },
    /// Top-k by a sampled threshold (Deep Gradient Compression); the achieved density is approximate.
    ThresholdTopK {
        /// Target fraction of elements kept, in `(0, 1]`.
        density: f32,
    },
    /// Random-k with the configuration's seed, the same indices on every rank.
    RandomK {
        /// Fraction of elements kept, in `(0, 1]`.
        density: f32,
    },
    /// Int8 with one scale per `block` elements, rounding to nearest or stochastically.
    Int8 {
        /// Elements per scale, `1..=u32::MAX`.
        block: usize,
        /// Unbiased stochastic rounding (seeded by the configuration's seed).
        stochastic: bool,
    },
    /// 1-bit sign with one scale (mean magnitude) per `block` elements.
    Sign {
        /// Elements per scale, `1..=u32::MAX`.
        block: usize,
    },
    /// Cast to IEEE binary16.
    Fp16,
    /// Cast to bfloat16.
    Bf16,
    /// Block-scaled floats (OCP MX): MXFP8 with E4M3 or E5M2 elements, or MXFP4 (E2M1), one
    /// power-of-two scale per 32 elements.
    Mx {
        /// The element format.
        element: MxElement,
    },
    /// PowerSGD of the given rank.
    PowerSgd {
        /// Number of factors, at least 1.
        rank: usize,
    },
}

impl CodecSpec {
    /// The codec's local (one-rank) reference from braid-compress, e.g. to time compression alone;
    /// `None` for [`CodecSpec::Dense`].
    pub fn local_codec(&self, seed: u64) -> Result<Option<BoxedCodec>, Error> {
        match *self {
            CodecSpec::PowerSgd { rank } => Ok(Some(Box::new(
                crate::PowerSgd::new(rank, seed).map_err(codec_error)?,
            ))),
            other => build_codec(other, seed),
        }
    }

    /// Elements per scale of a codec that quantises in blocks (int8, sign, MX), whose compressed
    /// tensor can be cut at any multiple of it; `None` for the others.
    pub fn block(&self) -> Option<usize> {
        match *self {
            CodecSpec::Int8 { block, .. } | CodecSpec::Sign { block } => Some(block),
            CodecSpec::Mx { .. } => Some(crate::mx::MX_BLOCK),
            _ => None,
        }
    }

    /// The density of a codec that keeps a fraction of the elements (top-k, threshold top-k, random-k).
    pub fn density(&self) -> Option<f32> {
        match *self {
            CodecSpec::TopK { density }
            | CodecSpec::ThresholdTopK { density }
            | CodecSpec::RandomK { density } => Some(density),
            _ => None,
        }
    }

    /// The same codec at another density; codecs without one are returned unchanged.
    pub fn with_density(self, density: f32) -> CodecSpec {
        match self {
            CodecSpec::TopK { .. } => CodecSpec::TopK { density },
            CodecSpec::ThresholdTopK { .. } => CodecSpec::ThresholdTopK { density },
            CodecSpec::RandomK { .. } => CodecSpec::RandomK { density },
            other => other,
        }
    }

    /// Checks the parameters; an error names what is wrong.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |why: String| Err(Error::invalid(format!("compression codec {self}: {why}")));
        match *self {
            CodecSpec::TopK { density }
            | CodecSpec::ThresholdTopK { density }
            | CodecSpec::RandomK { density }
                if !(density > 0.0 && density <= 1.0) =>
            {
                bad(format!("density {density} is not in (0, 1]"))
            }
            CodecSpec::Int8 { block, .. } | CodecSpec::Sign { block }
                if block == 0 || block > u32::MAX as usize =>
            {
                bad(format!("block size {block} is not in 1..={}", u32::MAX))
            }
            CodecSpec::PowerSgd { rank } if rank == 0 || rank > u32::MAX as usize => {
                bad(format!("rank {rank} is not in 1..={}", u32::MAX))
            }
            _ => Ok(()),
        }
    }
}

/// Parses the text forms `none` or `dense`, `topk:D`, `threshold-topk:D`, `randomk:D` (`D` a density in
/// `(0, 1]`; without it, 0.1), `int8`, `int8:B`, `int8-stochastic`, `int8-stochastic:B`, `sign`, `sign:B`
/// (`B` a block size, 256 without it), `fp16`, `bf16`, `mxfp8` (E4M3 elements), `mxfp8:e4m3`,
/// `mxfp8:e5m2`, `mxfp4` (E2M1), `powersgd:R` (`R` the rank, 1 without it). Case and
/// surrounding spaces are ignored. An error names the bad text and lists the accepted forms.
impl FromStr for CodecSpec {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self, Error> {
        let t = text.trim().to_ascii_lowercase();
        let (name, arg) = match t.split_once(':') {
            Some((n, a)) => (n.trim(), Some(a.trim())),
            None => (t.as_str(), None),
        };
        let bad = |why: String| {
            Error::invalid(format!(
                "compression codec {}: {why}; accepted: {ACCEPTED}",
                echo_input(text)
            ))
        };
        let density = || -> Result<f32, Error> {
            let Some(a) = arg else {
                return Ok(DEFAULT_DENSITY);
            };
            let d: f32 = a
                .parse()
                .map_err(|_| bad(format!("density {} is not a number", echo_input(a))))?;
            if d > 0.0 && d <= 1.0 {
                Ok(d)
            } else {
                Err(bad(format!("density {d} is not in (0, 1]")))
            }
        };
        let block = || -> Result<usize, Error> {
            let Some(a) = arg else {
                return Ok(DEFAULT_BLOCK);
            };
            match a.parse::<usize>() {
                Ok(b) if b >= 1 && b <= u32::MAX as usize => Ok(b),
                _ => Err(bad(format!(
                    "block size {} is not an integer in 1..={}",
                    echo_input(a),
                    u32::MAX
                ))),
            }
        };
        let no_arg = |spec: CodecSpec| match arg {
            None => Ok(spec),
            Some(a) => Err(bad(format!(
                "{name} takes no parameter, got {}",
                echo_input(a)
            ))),
        };
        match name {
            "none" | "dense" => no_arg(CodecSpec::Dense),
            "topk" | "top-k" => Ok(CodecSpec::TopK {
                density: density()?,
            }),
            "threshold-topk" | "threshold-top-k" => Ok(CodecSpec::ThresholdTopK {
                density: density()?,
            }),
            "randomk" | "random-k" => Ok(CodecSpec::RandomK {
                density: density()?,
            }),
            "int8" => Ok(CodecSpec::Int8 {
                block: block()?,
                stochastic: false,
            }),
            "int8-stochastic" => Ok(CodecSpec::Int8 {
                block: block()?,
                stochastic: true,
            }),
            "sign" => Ok(CodecSpec::Sign { block: block()? }),
            "fp16" => no_arg(CodecSpec::Fp16),
            "mxfp8" => match arg {
                None | Some("e4m3") => Ok(CodecSpec::Mx {
                    element: MxElement::E4M3,
                }),
                Some("e5m2") => Ok(CodecSpec::Mx {
                    element: MxElement::E5M2,
                }),
                Some(a) => Err(bad(format!(
                    "mxfp8 elements are e4m3 or e5m2, got {}",
                    echo_input(a)
                ))),
            },
            "mxfp4" => match arg {
                None | Some("e2m1") => Ok(CodecSpec::Mx {
                    element: MxElement::E2M1,
                }),
                Some(a) => Err(bad(format!(
                    "mxfp4 elements are e2m1, got {}",
                    echo_input(a)
                ))),
            },
            "bf16" => no_arg(CodecSpec::Bf16),
            "powersgd" | "power-sgd" => {
                let rank = match arg {
                    None => 1,
                    Some(a) => match a.parse::<usize>() {
                        Ok(r) if r >= 1 && r <= u32::MAX as usize => r,
                        _ => {
                            return Err(bad(format!(
                                "rank {} is not an integer in 1..={}",
                                echo_input(a),
                                u32::MAX
                            )))
                        }
                    },
                };
                Ok(CodecSpec::PowerSgd { rank })
            }
            // Without a parameter the name is the whole input, already shown.
            _ if arg.is_none() => Err(bad("unknown codec".into())),
            other => Err(bad(format!("unknown codec {}", echo_input(other)))),
        }
    }
}

/// The canonical text form, which [`FromStr`] parses back to the same value.
impl fmt::Display for CodecSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CodecSpec::Dense => write!(f, "dense"),
            CodecSpec::TopK { density } => write!(f, "topk:{density}"),
            CodecSpec::ThresholdTopK { density } => write!(f, "threshold-topk:{density}"),
            CodecSpec::RandomK { density } => write!(f, "randomk:{density}"),
            CodecSpec::Int8 {
                block,
                stochastic: false,
            } => write!(f, "int8:{block}"),
            CodecSpec::Int8 {
                block,
                stochastic: true,
            } => write!(f, "int8-stochastic:{block}"),
            CodecSpec::Sign { block } => write!(f, "sign:{block}"),
            CodecSpec::Fp16 => write!(f, "fp16"),
            CodecSpec::Bf16 => write!(f, "bf16"),
            CodecSpec::Mx {
                element: MxElement::E2M1,
            } => write!(f, "mxfp4"),
            CodecSpec::Mx { element } => write!(f, "mxfp8:{}", element.name()),
            CodecSpec::PowerSgd { rank } => write!(f, "powersgd:{rank}"),
        }
    }
}

/// A codec behind a pointer, as [`CodecSpec::local_codec`] returns it.
pub type BoxedCodec = Box<dyn Codec + Send + Sync>;

fn codec_error(e: crate::Error) -> Error {
    Error::invalid(e.to_string())
}

/// The codec of `spec` seeded with `seed`; `None` for [`CodecSpec::Dense`] and for
/// [`CodecSpec::PowerSgd`], whose runtime path uses the PowerSGD helpers directly.
pub fn build_codec(spec: CodecSpec, seed: u64) -> Result<Option<BoxedCodec>, Error> {
    Ok(match spec {
        CodecSpec::Dense | CodecSpec::PowerSgd { .. } => None,
        CodecSpec::TopK { density } => Some(Box::new(TopK::new(density).map_err(codec_error)?)),
        CodecSpec::ThresholdTopK { density } => Some(Box::new(
            ThresholdTopK::new(density, seed).map_err(codec_error)?,
        )),
        CodecSpec::RandomK { density } => {
            Some(Box::new(RandomK::new(density, seed).map_err(codec_error)?))
        }
        CodecSpec::Int8 { block, stochastic } => Some(Box::new(if stochastic {
            Int8::stochastic(block, seed).map_err(codec_error)?
        } else {
            Int8::new(block).map_err(codec_error)?
        })),
        CodecSpec::Sign { block } => Some(Box::new(Sign::new(block).map_err(codec_error)?)),
        CodecSpec::Fp16 => Some(Box::new(Cast::F16)),
        CodecSpec::Bf16 => Some(Box::new(Cast::Bf16)),
        CodecSpec::Mx { element } => Some(Box::new(Mx::new(element))),
    })
}
