//! Block-scaled floats (OCP Microscaling): MXFP8 (E4M3 or E5M2 elements) and MXFP4 (E2M1), one
//! power-of-two scale per 32 elements ([`crate::mx`] defines the formats and the rounding).

use super::{Codec, Transport};
use crate::mx::{encode_block, MxElement, MX_BLOCK};
use crate::wire::Payload;
use crate::Compressed;

/// MX with element format `element`: per block of 32, the E8M0 scale of the block's largest magnitude
/// and each element rounded to nearest (ties to even, saturating) as the specification converts. A
/// block holding a NaN or an infinity decodes to NaN. 8.25 bits per element for MXFP8, 4.25 for MXFP4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mx {
    element: MxElement,
}

impl Mx {
    /// MX with elements in `element`.
    pub fn new(element: MxElement) -> Mx {
        Mx { element }
    }

    /// The element format.
    pub fn element(&self) -> MxElement {
        self.element
    }
}

impl Codec for Mx {
    fn name(&self) -> String {
        let family = match self.element {
            MxElement::E2M1 => "mxfp4",
            _ => "mxfp8",
        };
        format!("{family}({})", self.element.name())
    }

    fn transport(&self) -> Transport {
        Transport::Gather
    }

    fn compress(&mut self, grad: &[f32], _step: u64) -> Compressed {
        let e = self.element;
        let mut scales = Vec::with_capacity(grad.len().div_ceil(MX_BLOCK));
        let mut codes = Vec::with_capacity(e.code_bytes(grad.len()));
        let mut half: Option<u8> = None;
        for block in grad.chunks(MX_BLOCK) {
            let scale = encode_block(block, e, |c| match e.bits() {
                8 => codes.push(c),
                // Two elements a byte, the first in the low nibble.
                _ => match half.take() {
                    None => half = Some(c),
                    Some(lo) => codes.push(lo | c << 4),
                },
            });
            scales.push(scale);
        }
        if let Some(lo) = half {
            codes.push(lo);
        }
        Compressed::new_unchecked(
            grad.len(),
            Payload::Mx {
                element: e,
                scales,
                codes,
            },
        )
    }
}
