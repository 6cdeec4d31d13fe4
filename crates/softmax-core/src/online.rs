//! Online softmax of one row: running maximum and sum, accumulator correction, merge of
//! partial results, and finalisation to `1/ℓ` and the LSE.
//!
//! Scores enter in the **scaled log2 domain** `x = s·scale·log2(e)` (see
//! [`crate::ScoreTransform`]), so every exponential is an `exp2` and the scale costs one FMA.
//! A row's state is `(m, ℓ)`: `m` the reference value subtracted before exponentiating (the
//! running maximum, or a stale one under [`RescalePolicy::Threshold`]) and `ℓ = Σ exp2(x − m)`.
//! The caller keeps the accumulator `acc = Σ exp2(x − m)·v` and multiplies it by the
//! correction that each step returns.
//!
//! SIMD and GPU backends do the vector work themselves (row maximum, `exp2`, row sum) and call
//! [`RowState::begin_block`] / [`RowState::add_sum`] for the bookkeeping, so that the rules live
//! here once; [`RowState::update`] does the whole step on a slice for scalar code.

use crate::libm_float::LibmFloat;
use crate::rescale::{Decision, RescalePolicy, RescaleStats};
use num_traits::Float;

/// Running state of one row of the online softmax.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowState<T> {
    /// Reference value `m` (log2 domain): −∞ until a visible key arrives.
    pub max: T,
    /// `ℓ = Σ exp2(x − m)` over the keys seen so far.
    pub sum: T,
}

/// What a block step tells the caller.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockStep<T> {
    /// Subtract this from the block's log2 scores before `exp2` (the row's reference, or 0
    /// while the row has seen only masked keys, so that `−∞ − 0` gives `exp2 = 0`, not NaN).
    pub offset: T,
    /// Multiply the row's accumulator by this (exactly 1 when the reference did not move).
    pub correction: T,
}

/// The normalisation of a finished row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowResult<T> {
    /// Multiply the accumulator by this to get the output (0 for a row that saw no key, so its
    /// output is 0, never NaN).
    pub inv_sum: T,
    /// Natural-log log-sum-exp of the row's scaled scores (−∞ for a row that saw no key).
    pub lse: T,
}

impl<T: Float> Default for RowState<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Float> RowState<T> {
    /// The state of a row that has seen nothing.
    #[inline]
    pub fn new() -> Self {
        RowState {
            max: T::neg_infinity(),
            sum: T::zero(),
        }
    }

    /// The offset to subtract before exponentiating given the current reference.
    #[inline]
    fn offset(&self) -> T {
        if self.max == T::neg_infinity() {
            T::zero()
        } else {
            self.max
        }
    }

    /// Adds the sum of the block's `exp2(x − offset)` terms to `ℓ`.
    #[inline]
    pub fn add_sum(&mut self, block_sum: T) {
        self.sum = self.sum + block_sum;
    }
}

/// The rules that exponentiate or take a logarithm: `exp2` and `log2` are the `libm` crate's
/// ([`LibmFloat`]) in every build.
impl<T: LibmFloat> RowState<T> {
    /// Starts a block whose largest log2 score is `block_max` (−∞ if all of it is masked):
    /// moves the reference if the policy says so, rescales `ℓ`, and returns the offset for
    /// this block's `exp2` and the correction for the accumulator.
    #[inline]
    pub fn begin_block(
        &mut self,
        block_max: T,
        policy: &RescalePolicy<T>,
        stats: &mut RescaleStats,
    ) -> BlockStep<T> {
        let mut correction = T::one();
        if policy.decide(self.max, block_max, stats) == Decision::Move {
            // exp2(−∞ − finite) = 0: the first visible block zeroes an (empty) accumulator,
            // which is harmless and keeps the rule branch-free on the GPU.
            correction = (self.max - block_max).libm_exp2();
            self.sum = self.sum * correction;
            self.max = block_max;
        }
        BlockStep {
            offset: self.offset(),
            correction,
        }
    }

    /// The whole step on a slice: replaces each log2 score by its unnormalised probability
    /// `exp2(x − offset)` and returns the accumulator correction. `exp2` is the exponential to
    /// use (e.g. `T::libm_exp2` or [`crate::exp2_cubic`]).
    #[inline]
    pub fn update_with(
        &mut self,
        scores: &mut [T],
        policy: &RescalePolicy<T>,
        stats: &mut RescaleStats,
        exp2: impl Fn(T) -> T,
    ) -> T {
        let block_max = scores
            .iter()
            .fold(T::neg_infinity(), |m, &x| if x > m { x } else { m });
        let step = self.begin_block(block_max, policy, stats);
        let mut block_sum = T::zero();
        for x in scores.iter_mut() {
            *x = exp2(*x - step.offset);
            block_sum = block_sum + *x;
        }
        self.add_sum(block_sum);
        step.correction
    }

    /// [`RowState::update_with`] with the `libm` crate's `exp2` ([`LibmFloat::libm_exp2`]).
    #[inline]
    pub fn update(
        &mut self,
        scores: &mut [T],
        policy: &RescalePolicy<T>,
        stats: &mut RescaleStats,
    ) -> T {
        self.update_with(scores, policy, stats, T::libm_exp2)
    }

    /// Merges two partial results over disjoint key sets. Returns the merged state and the
    /// factors by which the first and second accumulators must be multiplied before adding.
    /// Exact, commutative and associative up to rounding.
    #[inline]
    pub fn merge(self, other: RowState<T>) -> (RowState<T>, T, T) {
        let max = if other.max > self.max {
            other.max
        } else {
            self.max
        };
        if max == T::neg_infinity() {
            return (RowState::new(), T::one(), T::one());
        }
        let factor_self = (self.max - max).libm_exp2();
        let factor_other = (other.max - max).libm_exp2();
        let sum = self.sum * factor_self + other.sum * factor_other;
        (RowState { max, sum }, factor_self, factor_other)
    }

    /// Normalisation of the finished row: `1/ℓ` and `LSE = (m + log2 ℓ)·ln 2`.
    #[inline]
    pub fn finish(&self) -> RowResult<T> {
        if self.sum <= T::zero() {
            return RowResult {
                inv_sum: T::zero(),
                lse: T::neg_infinity(),
            };
        }
        let ln2 = T::from(core::f64::consts::LN_2).unwrap_or_else(T::one);
        RowResult {
            inv_sum: self.sum.recip(),
            lse: (self.max + self.sum.libm_log2()) * ln2,
        }
    }
}

/// The rules of a learnable attention sink (gpt-oss): a per-head logit that joins every row's
/// softmax denominator with no value, `O = Σ_j exp(x_j − m)·V_j / (exp(s − m) + Σ_j exp(x_j − m))`.
/// Backends fold it into a **finished** row once, with [`RowState::finish_with_sink`] (after all
/// splits are merged, never per split); the backward's `∂L/∂s` sums [`sink_grad_term`] over rows.
impl<T: LibmFloat> RowState<T> {
    /// [`RowState::finish`] with an attention sink of log2-domain logit `sink_log2`
    /// (`s·log2 e`, see [`crate::Problem::sink_log2`]; `None`: no sink, exactly `finish`).
    ///
    /// The sink is merged like a partial row of one key whose probability has no value: the
    /// new reference is `M = max(m, sink)`, `ℓ' = ℓ·2^(m−M) + 2^(sink−M)`, and the returned
    /// `inv_sum = 2^(m−M)/ℓ'` multiplies the row's accumulator (kept relative to `m`) into
    /// the output; `lse = (M + log2 ℓ')·ln 2` includes the sink, so a backward's
    /// `P = exp(x − lse)` stays right. A row that saw no key gets `inv_sum = 0` (output 0)
    /// and `lse = sink·ln 2` (the sink's logit).
    #[inline]
    pub fn finish_with_sink(&self, sink_log2: Option<T>) -> RowResult<T> {
        let Some(sink) = sink_log2 else {
            return self.finish();
        };
        let (merged, factor_self, _) = self.merge(RowState {
            max: sink,
            sum: T::one(),
        });
        let result = merged.finish();
        RowResult {
            inv_sum: result.inv_sum * factor_self,
            lse: result.lse,
        }
    }
}

/// One row's term of an attention sink's gradient: `∂L/∂s` is the sum over the rows of the
/// sink's head (every sequence) of `−exp(s − lse)·D`, with `s` the sink's natural-log logit,
/// `lse` the row's natural-log LSE (which includes the sink) and `D = Σ_c dO_c·O_c` the row's
/// `rowsum(dO ∘ O)`. Exact: `exp(s − lse)` is the probability the row gives the sink, and the
/// sink carries no value, so its score's gradient is `P_sink·(0 − D)`.
#[inline]
pub fn sink_grad_term<T: LibmFloat>(sink: T, lse: T, delta: T) -> T {
    let log2_e = T::from(core::f64::consts::LOG2_E).unwrap_or_else(T::one);
    -(((sink - lse) * log2_e).libm_exp2() * delta)
}

/// Merges partial row `b` (state and accumulator) into partial row `a`: `acc_a` becomes the
/// accumulator of the union of their keys. Split-KV decode and multi-device ring attention are
/// this one operation.
pub fn merge_into<T: LibmFloat>(
    a: &mut RowState<T>,
    acc_a: &mut [T],
    b: &RowState<T>,
    acc_b: &[T],
) {
    let (merged, fa, fb) = a.merge(*b);
    for (x, &y) in acc_a.iter_mut().zip(acc_b) {
        *x = *x * fa + y * fb;
    }
    *a = merged;
}
