//! Slice-at-a-time FP8 encode and decode, optionally fused with a scale.
//!
//! The loops are written branch-free (selects, integer adds, one f32 add for subnormals)
//! so that the compiler vectorises them. One dispatch point picks, at run time, a copy of the
//! loop compiled with AVX2+FMA (8 lanes) where the CPU has it, else the portable build
//! (SSE2's 4 lanes on x86-64). Decoding has a lookup-table twin ([`Fp8Format::decode`]);
//! the arithmetic decode below vectorises where a gather would not. Every path is tested
//! against the scalar codec on all 256 codes and on sweeps of f32 inputs. `examples/codec_speed.rs`
//! measures them (see the README).
//!
//! Scaled variants compute `encode(x · inv_scale)` and `decode(c) · scale`: one f32 multiply
//! each, the rounding of which is part of the contract (a GPU kernel does the same multiply).

use crate::error::Fp8Error;
use crate::format::{encode_with, Fp8Format, Params, E4M3, E5M2};

/// Which implementation the slice codecs use on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodecPath {
    /// The loop compiled for AVX2+FMA (8 f32 lanes).
    Avx2,
    /// The loop compiled for the baseline target (SSE2 on x86-64, or scalar elsewhere).
    Portable,
}

/// The path the slice codecs take on this CPU (detected once by the standard library).
pub fn codec_path() -> CodecPath {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return CodecPath::Avx2;
        }
    }
    CodecPath::Portable
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), Fp8Error> {
    if expected != got {
        return Err(Fp8Error::LengthMismatch {
            what,
            expected,
            got,
        });
    }
    Ok(())
}

fn check_scale(scale: f32) -> Result<(), Fp8Error> {
    if !(scale.is_finite() && scale > 0.0) {
        return Err(Fp8Error::BadScale { scale });
    }
    Ok(())
}

/// Decodes by arithmetic: the FP8 bit fields placed in an f32 with exponent field taken
/// as is, then multiplied by `2^(127 − bias)` (an f32 subnormal times a power of two gives the
/// FP8 subnormals exactly), with the special codes patched by selects.
#[inline(always)]
fn decode_arith(code: u8, format: Fp8Format) -> f32 {
    let p = format.params();
    let c = code as u32;
    let sign = (c & 0x80) << 24;
    let magnitude = c & 0x7f;
    let unbiased = f32::from_bits(magnitude << (23 - p.mantissa_bits));
    let rebias = f32::from_bits((127 + 127 - p.bias) << 23);
    let value = (unbiased * rebias).to_bits();
    let value = match format {
        Fp8Format::E4m3 => {
            if magnitude == 0x7f {
                0x7fc0_0000
            } else {
                value
            }
        }
        Fp8Format::E5m2 => {
            if magnitude > 0x7c {
                0x7fc0_0000
            } else if magnitude == 0x7c {
                0x7f80_0000
            } else {
                value
            }
        }
    };
    f32::from_bits(value | sign)
}

#[inline(always)]
fn encode_loop(p: &Params, src: &[f32], inv_scale: Option<f32>, dst: &mut [u8]) {
    match inv_scale {
        None => {
            for (d, &x) in dst.iter_mut().zip(src) {
                *d = encode_with(x, p);
            }
        }
        Some(s) => {
            for (d, &x) in dst.iter_mut().zip(src) {
                *d = encode_with(x * s, p);
            }
        }
    }
}

#[inline(always)]
fn decode_loop(format: Fp8Format, src: &[u8], scale: Option<f32>, dst: &mut [f32]) {
    match scale {
        None => {
            for (d, &c) in dst.iter_mut().zip(src) {
                *d = decode_arith(c, format);
            }
        }
        Some(s) => {
            for (d, &c) in dst.iter_mut().zip(src) {
                *d = decode_arith(c, format) * s;
            }
        }
    }
}

/// Monomorphises the loops per format so that the parameters are constants.
#[inline(always)]
fn encode_any(format: Fp8Format, src: &[f32], inv_scale: Option<f32>, dst: &mut [u8]) {
    match format {
        Fp8Format::E4m3 => encode_loop(&E4M3, src, inv_scale, dst),
        Fp8Format::E5m2 => encode_loop(&E5M2, src, inv_scale, dst),
    }
}

#[inline(always)]
fn decode_any(format: Fp8Format, src: &[u8], scale: Option<f32>, dst: &mut [f32]) {
    match format {
        Fp8Format::E4m3 => decode_loop(Fp8Format::E4m3, src, scale, dst),
        Fp8Format::E5m2 => decode_loop(Fp8Format::E5m2, src, scale, dst),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
/// # Safety
/// The CPU must support AVX2 and FMA.
unsafe fn encode_avx2(format: Fp8Format, src: &[f32], inv_scale: Option<f32>, dst: &mut [u8]) {
    encode_any(format, src, inv_scale, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
/// # Safety
/// The CPU must support AVX2 and FMA.
unsafe fn decode_avx2(format: Fp8Format, src: &[u8], scale: Option<f32>, dst: &mut [f32]) {
    decode_any(format, src, scale, dst)
}

/// Encodes through a chosen path (the public functions pick [`codec_path`]); exposed so that
/// tests and the speed example can compare the paths.
pub fn encode_with_path(
    path: CodecPath,
    format: Fp8Format,
    src: &[f32],
    inv_scale: Option<f32>,
    dst: &mut [u8],
) -> Result<(), Fp8Error> {
    check_len("encode", src.len(), dst.len())?;
    if let Some(s) = inv_scale {
        check_scale(s)?;
    }
    match path {
        #[cfg(target_arch = "x86_64")]
        CodecPath::Avx2 if codec_path() == CodecPath::Avx2 => {
            // SAFETY: the CPU supports AVX2 and FMA (checked by `codec_path` just above), the
            // only requirement of calling a `#[target_feature(enable = "avx2,fma")]` function.
            unsafe { encode_avx2(format, src, inv_scale, dst) }
        }
        _ => encode_any(format, src, inv_scale, dst),
    }
    Ok(())
}

/// Decodes through a chosen path (see [`encode_with_path`]).
pub fn decode_with_path(
    path: CodecPath,
    format: Fp8Format,
    src: &[u8],
    scale: Option<f32>,
    dst: &mut [f32],
) -> Result<(), Fp8Error> {
    check_len("decode", src.len(), dst.len())?;
    if let Some(s) = scale {
        check_scale(s)?;
    }
    match path {
        #[cfg(target_arch = "x86_64")]
        CodecPath::Avx2 if codec_path() == CodecPath::Avx2 => {
            // SAFETY: the CPU supports AVX2 and FMA (checked by `codec_path` just above), the
            // only requirement of calling a `#[target_feature(enable = "avx2,fma")]` function.
            unsafe { decode_avx2(format, src, scale, dst) }
        }
        _ => decode_any(format, src, scale, dst),
    }
    Ok(())
}

/// Encodes `src` into `dst` (equal lengths) with saturating round-to-nearest-even.
pub fn encode_slice(format: Fp8Format, src: &[f32], dst: &mut [u8]) -> Result<(), Fp8Error> {
    encode_with_path(codec_path(), format, src, None, dst)
}

/// Decodes `src` into `dst` (equal lengths).
pub fn decode_slice(format: Fp8Format, src: &[u8], dst: &mut [f32]) -> Result<(), Fp8Error> {
    decode_with_path(codec_path(), format, src, None, dst)
}

/// Encodes `x · inv_scale` for each `x` (quantisation with a scale `1/inv_scale`);
/// `inv_scale` must be finite and positive.
pub fn encode_scaled(
    format: Fp8Format,
    src: &[f32],
    inv_scale: f32,
    dst: &mut [u8],
) -> Result<(), Fp8Error> {
    encode_with_path(codec_path(), format, src, Some(inv_scale), dst)
}

/// Decodes `code · scale` for each code (dequantisation); `scale` must be finite and
/// positive.
pub fn decode_scaled(
    format: Fp8Format,
    src: &[u8],
    scale: f32,
    dst: &mut [f32],
) -> Result<(), Fp8Error> {
    decode_with_path(codec_path(), format, src, Some(scale), dst)
}

/// Rounds `values` in place to the format (`decode(encode(x))`), after multiplying by
/// `inv_scale` and before multiplying back by `scale`: what a quantise–dequantise pair does.
/// Used for simulated quantisation (e.g. of P). `inv_scale` and `scale` must be finite and
/// positive.
pub fn round_scaled_in_place(
    format: Fp8Format,
    values: &mut [f32],
    inv_scale: f32,
    scale: f32,
) -> Result<(), Fp8Error> {
    check_scale(inv_scale)?;
    check_scale(scale)?;
    round_in_place_unchecked(format, values, inv_scale, scale);
    Ok(())
}

#[inline(always)]
fn round_loop(format: Fp8Format, values: &mut [f32], inv_scale: f32, scale: f32) {
    let p = format.params();
    for x in values.iter_mut() {
        *x = decode_arith(encode_with(*x * inv_scale, &p), format) * scale;
    }
}

#[inline(always)]
fn round_any(format: Fp8Format, values: &mut [f32], inv_scale: f32, scale: f32) {
    match format {
        Fp8Format::E4m3 => round_loop(Fp8Format::E4m3, values, inv_scale, scale),
        Fp8Format::E5m2 => round_loop(Fp8Format::E5m2, values, inv_scale, scale),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
/// # Safety
/// The CPU must support AVX2 and FMA.
unsafe fn round_avx2(format: Fp8Format, values: &mut [f32], inv_scale: f32, scale: f32) {
    round_any(format, values, inv_scale, scale)
}

/// [`round_scaled_in_place`] without the scale checks (callers have validated them).
pub(crate) fn round_in_place_unchecked(
    format: Fp8Format,
    values: &mut [f32],
    inv_scale: f32,
    scale: f32,
) {
    match codec_path() {
        #[cfg(target_arch = "x86_64")]
        CodecPath::Avx2 => {
            // SAFETY: `codec_path` returned Avx2, so the CPU supports AVX2 and FMA, the only
            // requirement of calling a `#[target_feature(enable = "avx2,fma")]` function.
            unsafe { round_avx2(format, values, inv_scale, scale) }
        }
        _ => round_any(format, values, inv_scale, scale),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_decode_matches_table_on_every_code() {
        for format in Fp8Format::ALL {
            for code in 0..=255u8 {
                let a = decode_arith(code, format);
                let t = format.decode(code);
                assert!(
                    a.to_bits() == t.to_bits() || (a.is_nan() && t.is_nan()),
                    "{} code {code:#04x}: arith {a} table {t}",
                    format.name()
                );
            }
        }
    }
}
