//! fp16 and bf16 casts.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::{Codec, Transport};
use crate::wire::Payload;
use crate::Compressed;

/// A cast to a 16-bit float, round to nearest even (the `half` crate's conversions, the same as the
/// hardware's): fp16 overflows to ±∞ beyond 65504 and flushes below 2⁻²⁴ to (signed) zero; bf16 keeps f32's
/// range. NaN stays NaN. Relative error at most 2⁻¹¹ (fp16, normal range) or 2⁻⁸ (bf16).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cast {
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl Codec for Cast {
    fn name(&self) -> String {
        match self {
            Cast::F16 => "fp16".into(),
            Cast::Bf16 => "bf16".into(),
        }
    }

    fn transport(&self) -> Transport {
        Transport::SumClosed
    }

    fn compress(&mut self, grad: &[f32], _step: u64) -> Compressed {
        let payload = match self {
            Cast::F16 => {
                let mut v = vec![f16::ZERO; grad.len()];
                v.convert_from_f32_slice(grad);
                Payload::F16(v)
            }
            Cast::Bf16 => {
                let mut v = vec![bf16::ZERO; grad.len()];
                v.convert_from_f32_slice(grad);
                Payload::Bf16(v)
            }
        };
        Compressed::new_unchecked(grad.len(), payload)
    }
}
