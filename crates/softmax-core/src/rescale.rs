//! When to rescale the accumulators: always, or FlashAttention-4's threshold policy.
//!
//! # Why the threshold policy is exact
//! The online softmax subtracts a reference value `m` from every score before exponentiating.
//! Any `m` gives the same final result, because the output is `acc / ℓ` and both `acc` and
//! `ℓ` are built from the *same* `exp2(x − m)` terms: a different `m` multiplies numerator
//! and denominator by the same power of two, which cancels. The running maximum is merely the
//! choice that keeps every term ≤ 1. Keeping a stale `m` while the true maximum stays within
//! `τ` of it keeps every term ≤ `2^τ` (256 for `τ = 8`): no overflow in f32, and within the
//! range of a 16-bit P operand (bf16/f16 max ≈ 2^16 and 2^127), so the result is unchanged up to
//! rounding while the `O(Br·d)` rescale of the accumulator is skipped. The LSE stays exact too:
//! it is computed from `m` and `ℓ` together.

use crate::error::ProblemError;
use crate::libm_float::LibmFloat;
use num_traits::Float;

/// Default threshold for 16-bit P operands, in log2 units (a factor of 256).
pub const DEFAULT_RESCALE_THRESHOLD: f32 = 8.0;

/// The largest threshold any backend accepts, in log2 units: a row sum of up to 2^32 terms
/// of at most `2^64` each stays 2^32 below f32's overflow.
pub const MAX_RESCALE_THRESHOLD: f32 = 64.0;

/// Policy for moving the reference maximum of a row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RescalePolicy<T> {
    /// Move the reference whenever the running maximum grows (FlashAttention-2).
    Always,
    /// Move it only when the new maximum exceeds the reference by more than `τ` log2 units
    /// (FlashAttention-4). `τ` must be finite and non-negative, and `τ` plus the offset of the
    /// P operand must stay below `log2` of that dtype's largest finite value.
    Threshold(T),
}

impl<T: Float> Default for RescalePolicy<T> {
    fn default() -> Self {
        RescalePolicy::Threshold(T::from(DEFAULT_RESCALE_THRESHOLD).unwrap_or_else(T::zero))
    }
}

/// Counts of what the policy decided, so callers can report the rescales it saved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RescaleStats {
    /// Blocks seen (each a call of the update).
    pub blocks: u64,
    /// Blocks where the reference moved and the accumulator was rescaled.
    pub rescales: u64,
    /// Blocks where the maximum grew but the policy kept the stale reference.
    pub skipped: u64,
}

impl RescaleStats {
    /// Adds another set of counts (e.g. from another thread or row).
    pub fn add(&mut self, other: &RescaleStats) {
        self.blocks += other.blocks;
        self.rescales += other.rescales;
        self.skipped += other.skipped;
    }
}

/// What the policy decided for one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Keep the current reference (the block's maximum did not grow, or grew by at most `τ`).
    Keep,
    /// Move the reference to the block's maximum.
    Move,
}

impl<T: Float> RescalePolicy<T> {
    /// The largest `log2` an unnormalised probability `exp2(x − m)` can reach under this
    /// policy: 0 for [`RescalePolicy::Always`], `τ` for the threshold policy. A P operand
    /// stored in a narrow type after multiplying by `2^offset_log2` stays finite when
    /// `max_term_log2() + offset_log2 < log2(type max)` (e.g. e4m3: `τ + 8 < log2 448 ≈ 8.81`,
    /// so FP8 with FlashAttention-3's offset needs `Always`).
    pub fn max_term_log2(&self) -> T {
        match *self {
            RescalePolicy::Always => T::zero(),
            RescalePolicy::Threshold(tau) => tau,
        }
    }

    /// Decides for a row whose reference is `current` (−∞ before any visible key) when a block
    /// with maximum `block_max` arrives, and records the decision in `stats`.
    #[inline]
    pub fn decide(&self, current: T, block_max: T, stats: &mut RescaleStats) -> Decision {
        stats.blocks += 1;
        // NaN never compares greater, so a NaN block maximum keeps the reference; the NaN
        // still reaches the output through exp2(NaN − m).
        if block_max.is_nan() || block_max <= current {
            return Decision::Keep;
        }
        if current == T::neg_infinity() {
            // The first visible key: nothing has been accumulated, so there is nothing to
            // rescale; this is neither a rescale nor a skip.
            return Decision::Move;
        }
        match *self {
            RescalePolicy::Always => {
                stats.rescales += 1;
                Decision::Move
            }
            RescalePolicy::Threshold(tau) => {
                if block_max - current > tau {
                    stats.rescales += 1;
                    Decision::Move
                } else {
                    stats.skipped += 1;
                    Decision::Keep
                }
            }
        }
    }
}

/// The checks that take a logarithm: `log2` is the `libm` crate's ([`LibmFloat`]) in every
/// build, so a threshold at the edge is accepted or refused the same way everywhere.
impl<T: LibmFloat> RescalePolicy<T> {
    /// Whether terms scaled by `2^offset_log2` stay below `dtype_max` (see
    /// [`RescalePolicy::max_term_log2`]).
    pub fn fits(&self, offset_log2: T, dtype_max: T) -> bool {
        self.max_term_log2() + offset_log2 < dtype_max.libm_log2()
    }

    /// The one rule every backend applies to a policy before it runs (FlashAttention-4's
    /// condition): a threshold `τ` must be finite, in `0..=`[`MAX_RESCALE_THRESHOLD`], and the
    /// largest unnormalised probability, `2^τ` times the P operand's scale `2^offset_log2`,
    /// must stay below `p_max`, the largest finite value of the type P is stored in
    /// ([`crate::DType::max_finite`] for f32/bf16/f16, 448 for FP8 e4m3). `Always` has
    /// `τ = 0`.
    pub fn check(&self, p_max: f32, offset_log2: f32) -> Result<(), ProblemError> {
        let tau = match *self {
            RescalePolicy::Always => 0.0,
            RescalePolicy::Threshold(t) => t.to_f32().unwrap_or(f32::NAN),
        };
        let p_max_log2 = libm::log2f(p_max);
        let fits = match (T::from(offset_log2), T::from(p_max)) {
            (Some(offset), Some(max)) => self.fits(offset, max),
            _ => false,
        };
        if tau.is_finite() && (0.0..=MAX_RESCALE_THRESHOLD).contains(&tau) && fits {
            Ok(())
        } else {
            Err(ProblemError::RescaleThreshold {
                tau,
                offset_log2,
                p_max_log2,
            })
        }
    }
}
