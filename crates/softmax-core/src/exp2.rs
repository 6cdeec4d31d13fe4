//! Software `exp2` (FlashAttention-4): `2^x = 2^⌊x⌋ · p(x − ⌊x⌋)` with `p` a minimax cubic on
//! `[0, 1)`, the integer part added into the exponent bits with an integer add.
//!
//! On a GPU this moves part of the exponentials from the special-function unit to the FMA
//! pipes; on a CPU it vectorises without a libm call. [`EXP2_CUBIC`] holds the coefficients so
//! that SIMD and CUDA versions evaluate the very same polynomial in the same order.

/// Coefficients `c0..c3` of `p(f) = ((c3·f + c2)·f + c1)·f + c0 ≈ 2^f` on `[0, 1)`, minimax in
/// relative error (Remez exchange; real-arithmetic error 7.48e-5).
pub const EXP2_CUBIC: [f32; 4] = [0.999_925_2, 0.695_833_6, 0.226_067_16, 0.078_024_52];

/// Smallest input for which [`exp2_cubic`] returns a normal number; below it returns 0.
pub const EXP2_CUBIC_MIN: f32 = -125.0;
/// Inputs at or above this overflow to `+∞`.
pub const EXP2_CUBIC_MAX: f32 = 128.0;

/// Maximum relative error of [`exp2_cubic`] against the exact `2^x`, measured over **every**
/// f32 in `[EXP2_CUBIC_MIN, EXP2_CUBIC_MAX)` by `cargo run --release -p fa-cli -- exp2-error`
/// (or `cargo test --release -p softmax-core --test exp2 -- --ignored`).
pub const EXP2_CUBIC_MAX_REL_ERROR: f64 = 7.5e-5;

/// `2^x` by a cubic and an exponent-bit add.
///
/// Maximum relative error 7.490e-5, at x = −0.16456 ([`EXP2_CUBIC_MAX_REL_ERROR`] = 7.5e-5 rounds it
/// up), below bf16's 2^-8 = 3.9e-3 by
/// a factor of 52, measured over every f32 input in `[-125, 128)`.
///
/// Special values: NaN → NaN; `x ≥ 128` (and `+∞`) → `+∞`; `x < −125` (and `−∞`) → `0`
/// (results that would be subnormal are flushed to zero, an absolute error below 2^-125; `p(0) = c0 < 1`, so at −126 the
/// product would already be subnormal and the exponent-bit add would be wrong).
#[inline]
pub fn exp2_cubic(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x >= EXP2_CUBIC_MAX {
        return f32::INFINITY;
    }
    if x < EXP2_CUBIC_MIN {
        return 0.0;
    }
    let whole = libm::floorf(x);
    let frac = x - whole;
    let [c0, c1, c2, c3] = EXP2_CUBIC;
    let p = ((c3 * frac + c2) * frac + c1) * frac + c0;
    // p lies in [c0, 2): a normal number with exponent field 127 (or 128 when it rounds to 2);
    // adding ⌊x⌋ to the exponent field multiplies by 2^⌊x⌋. ⌊x⌋ ∈ [−125, 127] and the field of
    // p is 126 or 127, so the result's field stays in [1, 255]: at 255 (x close to 128) the result is +∞, as overflow should be.
    let shifted = (p.to_bits() as i32).wrapping_add((whole as i32) << 23);
    f32::from_bits(shifted as u32)
}

/// Number of f32 values in the measured domain `[−125, 128)`: every non-negative value below
/// 128 (`+0` included) and every non-positive value down to −125 (`−0` included).
pub const EXP2_DOMAIN_LEN: u64 = POSITIVE_LEN + NEGATIVE_LEN;
const POSITIVE_LEN: u64 = 0x4300_0000; // bits of 128.0: +0.0 ..< 128.0
const NEGATIVE_LEN: u64 = 0xC2FA_0000 - 0x8000_0000 + 1; // −0.0 ..= −125.0

/// The `index`-th f32 of the domain (`index < EXP2_DOMAIN_LEN`), in bit-pattern order.
pub fn exp2_domain_input(index: u64) -> f32 {
    if index < POSITIVE_LEN {
        f32::from_bits(index as u32)
    } else {
        f32::from_bits(0x8000_0000 + (index - POSITIVE_LEN) as u32)
    }
}

/// Largest relative error of [`exp2_cubic`] against `libm::exp2` (f64) over the domain inputs
/// with indices in `indices`, stepping by `step` (1 for an exhaustive sweep). Returns the
/// worst input and its error. Split the index range across threads to sweep faster.
pub fn exp2_max_rel_error(indices: core::ops::Range<u64>, step: u64) -> (f32, f64) {
    let mut worst = (0.0f32, 0.0f64);
    let mut index = indices.start;
    while index < indices.end.min(EXP2_DOMAIN_LEN) {
        let x = exp2_domain_input(index);
        let exact = libm::exp2(x as f64);
        let err = ((exp2_cubic(x) as f64 - exact) / exact).abs();
        if err > worst.1 || err.is_nan() {
            worst = (x, err);
        }
        index += step.max(1);
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_values() {
        assert!(exp2_cubic(f32::NAN).is_nan());
        assert_eq!(exp2_cubic(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2_cubic(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp2_cubic(128.0), f32::INFINITY);
        assert_eq!(exp2_cubic(-125.5), 0.0);
        assert!(exp2_cubic(-125.0) >= f32::MIN_POSITIVE);
        assert!(exp2_cubic(127.999_99).is_finite() || exp2_cubic(127.999_99).is_infinite());
        assert!((exp2_cubic(0.0) - 1.0).abs() < 1e-4);
        assert!((exp2_cubic(-1.0) - 0.5).abs() < 1e-4);
    }
}
