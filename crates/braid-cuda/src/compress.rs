//! The compression kernels, each with braid-compress's codec and error feedback semantics bit for bit
//! (NaN payloads aside: a GPU returns the canonical NaN; the tests run them on the SIMT runner against
//! the CPU codecs):
//! - `kernels/mx.cu` (MXFP8, MXFP4): per element format, the fused error-feedback step and the
//!   receiving side's decode-and-accumulate ([`MxEfArgs`], [`MxAccArgs`]; `tests/mx.rs`);
//! - `kernels/int8.cu`: the fused error-feedback step of int8 with a scale per block of any size,
//!   nearest or stochastic rounding ([`Int8EfArgs`]; `tests/int8.rs`).
//!
//! Both compile with NVRTC through the kernel cache like the other kernels.

use braid_core::Error;

use crate::cache::load_or_compile_program;

/// The MX kernels' file name and text.
pub const MX_SOURCE: (&str, &str) = ("mx.cu", include_str!("../../../kernels/mx.cu"));

/// The int8 kernel's file name and text.
pub const INT8_SOURCE: (&str, &str) = ("int8.cu", include_str!("../../../kernels/int8.cu"));

/// The headers the sources include.
pub fn headers() -> Vec<(&'static str, &'static str)> {
    vec![
        crate::SOURCES[0],
        (
            "braid_mx.cuh",
            include_str!("../../../kernels/braid_mx.cuh"),
        ),
        (
            "braid_int8.cuh",
            include_str!("../../../kernels/braid_int8.cuh"),
        ),
    ]
}

/// The MX element formats, by the names the kernels carry (and braid-compress's wire codes' order).
pub const MX_FORMATS: [&str; 3] = ["e4m3", "e5m2", "e2m1"];

/// The MX fused step's kernel for element format `format` (one of [`MX_FORMATS`]).
pub fn mx_ef_kernel(format: &str) -> String {
    format!("braid_mx_ef_{format}")
}

/// The MX decode-and-accumulate kernel for element format `format`.
pub fn mx_acc_kernel(format: &str) -> String {
    format!("braid_mx_acc_{format}")
}

/// The int8 fused step's kernel.
pub const INT8_EF_KERNEL: &str = "braid_int8_ef";

/// Threads per block the kernels are built for (`__launch_bounds__`): 8 warps, the most either takes.
/// The MX kernels need whole warps (a multiple of 32: every lane takes part in the shuffles); the int8
/// kernel takes any count.
pub const THREADS: u32 = 256;

/// The MX fused step's arguments (`braid::mx::EfArgs`): residual `grad·clip_scale + decay·error` (no
/// multiplication when `clip_scale` is 1, the gradient alone when `decay` is 0), one E8M0 scale per
/// 32 elements into `scales`, the element codes into `codes` (E2M1 two a byte, low nibble first), the
/// new error into `error`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MxEfArgs {
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

/// The MX decode-and-accumulate kernel's arguments (`braid::mx::AccArgs`): `out += decode(codes)·scale`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MxAccArgs {
    /// `⌈n/32⌉` scale bytes.
    pub scales: u64,
    /// The code bytes.
    pub codes: u64,
    /// `n` f32 elements, read and written.
    pub out: u64,
    /// Elements.
    pub n: u64,
}

/// The int8 fused step's arguments (`braid::int8::EfArgs`): residual as for MX, one f32 scale per
/// `block` elements into `scales`, one int8 per element into `quants`, the new error into `error`.
/// With `stochastic` 1, rounding draws from the stream whose base is `rng_base`
/// (`mix(mix(seed + 3·γ) ^ step)`, braid-compress's `Stream::new(seed, TAG_ROUNDING, step)`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Int8EfArgs {
    /// `n` f32 gradient elements (device memory).
    pub grad: u64,
    /// `n` f32 error elements, read and written.
    pub error: u64,
    /// `⌈n/block⌉` f32 scales, written.
    pub scales: u64,
    /// `n` int8 values, written.
    pub quants: u64,
    /// Elements.
    pub n: u64,
    /// The rounding stream's base.
    pub rng_base: u64,
    /// Elements per scale, at least 1.
    pub block: u32,
    /// 1 for stochastic rounding, 0 for nearest.
    pub stochastic: u32,
    /// The gradient's clipping factor (1 for none).
    pub clip_scale: f32,
    /// The weight of the error carried in.
    pub decay: f32,
}

/// Compiles (or reads from the kernel cache) the MX kernels for `sm_<arch>`.
pub fn compile_mx(arch: u32) -> Result<Vec<u8>, Error> {
    load_or_compile_program(MX_SOURCE.0, MX_SOURCE.1, &headers(), arch).map(|(image, _)| image)
}

/// Compiles (or reads from the kernel cache) the int8 kernel for `sm_<arch>`.
pub fn compile_int8(arch: u32) -> Result<Vec<u8>, Error> {
    load_or_compile_program(INT8_SOURCE.0, INT8_SOURCE.1, &headers(), arch).map(|(image, _)| image)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_argument_blocks_have_the_kernels_layout() {
        // Five 8-byte fields and two floats; four 8-byte fields.
        assert_eq!(std::mem::size_of::<MxEfArgs>(), 48);
        assert_eq!(std::mem::offset_of!(MxEfArgs, clip_scale), 40);
        assert_eq!(std::mem::offset_of!(MxEfArgs, decay), 44);
        assert_eq!(std::mem::size_of::<MxAccArgs>(), 32);
        // Six 8-byte fields, then four 4-byte ones.
        assert_eq!(std::mem::size_of::<Int8EfArgs>(), 64);
        assert_eq!(std::mem::offset_of!(Int8EfArgs, block), 48);
        assert_eq!(std::mem::offset_of!(Int8EfArgs, decay), 60);
        for f in MX_FORMATS {
            assert!(MX_SOURCE.1.contains(&format!("BRAID_MX_KERNELS({f},")));
        }
        assert!(MX_SOURCE.1.contains("braid_mx_ef_##name"));
        assert!(MX_SOURCE.1.contains("braid_mx_acc_##name"));
        assert!(INT8_SOURCE.1.contains(&format!(
            "__launch_bounds__(BRAID_INT8_THREADS) {INT8_EF_KERNEL}("
        )));
    }
}
