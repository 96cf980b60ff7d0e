//! The MX compression kernels (`kernels/mx.cu`): per element format, the fused error-feedback
//! compression step and the receiving side's decode-and-accumulate, with braid-compress's `Mx` codec
//! semantics bit for bit (`tests/mx.rs` runs them on the SIMT runner against it). Compiled with
//! NVRTC through the kernel cache like the other kernels; their argument blocks are [`EfArgs`] and
//! [`AccArgs`].

use braid_core::Error;

use crate::cache::load_or_compile_program;

/// The source's file name and text.
pub const SOURCE: (&str, &str) = ("mx.cu", include_str!("../../../kernels/mx.cu"));

/// The headers the source includes.
pub fn headers() -> Vec<(&'static str, &'static str)> {
    vec![
        crate::SOURCES[0],
        (
            "braid_mx.cuh",
            include_str!("../../../kernels/braid_mx.cuh"),
        ),
    ]
}

/// The element formats, by the names the kernels carry (and braid-compress's wire codes' order).
pub const FORMATS: [&str; 3] = ["e4m3", "e5m2", "e2m1"];

/// The fused step's kernel for element format `format` (one of [`FORMATS`]).
pub fn ef_kernel(format: &str) -> String {
    format!("braid_mx_ef_{format}")
}

/// The decode-and-accumulate kernel for element format `format`.
pub fn acc_kernel(format: &str) -> String {
    format!("braid_mx_acc_{format}")
}

/// Threads per block the kernels are built for (`__launch_bounds__`): 8 warps.
pub const THREADS: u32 = 256;

/// The fused step's arguments (`braid::mx::EfArgs`): residual `grad·clip_scale + decay·error` (no
/// multiplication when `clip_scale` is 1, the gradient alone when `decay` is 0), one E8M0 scale per
/// 32 elements into `scales`, the element codes into `codes` (E2M1 two a byte, low nibble first), the
/// new error into `error`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EfArgs {
    /// `n` f32 gradient elements (device memory).
    pub grad: u64,
    /// `n` f32 error elements, read and written.
    pub error: u64,
    /// `⌈n/32⌉` scale bytes, written.
    pub scales: u64,
    /// The code bytes, written.
    pub codes: u64,
    /// Elements.
    pub n: u64,
    /// The gradient's clipping factor (1 for none).
    pub clip_scale: f32,
    /// The weight of the error carried in.
    pub decay: f32,
}

/// The decode-and-accumulate kernel's arguments (`braid::mx::AccArgs`): `out += decode(codes)·scale`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AccArgs {
    /// `⌈n/32⌉` scale bytes.
    pub scales: u64,
    /// The code bytes.
    pub codes: u64,
    /// `n` f32 elements, read and written.
    pub out: u64,
    /// Elements.
    pub n: u64,
}

/// Compiles (or reads from the kernel cache) the MX kernels for `sm_<arch>`.
pub fn compile(arch: u32) -> Result<Vec<u8>, Error> {
    load_or_compile_program(SOURCE.0, SOURCE.1, &headers(), arch).map(|(image, _)| image)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_argument_blocks_have_the_kernels_layout() {
        // Five 8-byte fields and two floats; four 8-byte fields.
        assert_eq!(std::mem::size_of::<EfArgs>(), 48);
        assert_eq!(std::mem::offset_of!(EfArgs, clip_scale), 40);
        assert_eq!(std::mem::offset_of!(EfArgs, decay), 44);
        assert_eq!(std::mem::size_of::<AccArgs>(), 32);
        for f in FORMATS {
            assert!(SOURCE.1.contains(&format!("BRAID_MX_KERNELS({f},")));
        }
        assert!(
            SOURCE.1.contains("braid_mx_ef_##name") && SOURCE.1.contains("braid_mx_acc_##name")
        );
    }
}
