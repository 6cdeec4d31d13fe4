//! From raw dot products `q·k` to the scaled log2-domain scores the online softmax consumes.

use crate::libm_float::LibmFloat;
use num_traits::Float;

/// `log2(e)`, the factor that turns natural-log scores into log2 scores.
pub const LOG2_E: f64 = core::f64::consts::LOG2_E;

/// Maps a raw dot product `q·k` to `x = t(q·k·scale)·log2(e)`, where `t` is the identity or,
/// with a softcap, `cap·tanh(s/cap)` (applied to the scaled score, before the softmax, as in
/// FlashAttention ≥ 2.6).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreTransform<T> {
    /// `scale·log2(e)` without softcap; `scale/cap` with one.
    pre: T,
    /// `None` without softcap; `cap·log2(e)` with one.
    post: Option<T>,
}

impl<T: Float> ScoreTransform<T> {
    /// The transform for `softmax_scale` and an optional softcap (both already validated).
    pub fn new(softmax_scale: f64, softcap: Option<f64>) -> Self {
        let cast = |x: f64| T::from(x).unwrap_or_else(T::nan);
        match softcap {
            None => ScoreTransform {
                pre: cast(softmax_scale * LOG2_E),
                post: None,
            },
            Some(cap) => ScoreTransform {
                pre: cast(softmax_scale / cap),
                post: Some(cast(cap * LOG2_E)),
            },
        }
    }

    /// The multiplier applied to the dot product before anything else (`scale·log2 e`, or
    /// `scale/cap` with a softcap): what a kernel folds into its first FMA.
    pub fn pre_factor(&self) -> T {
        self.pre
    }

    /// `Some(cap·log2 e)` when a softcap is on: the factor after `tanh`.
    pub fn softcap_post_factor(&self) -> Option<T> {
        self.post
    }
}

/// The transform itself: the softcap's `tanh` is the `libm` crate's ([`LibmFloat`]) in every
/// build.
impl<T: LibmFloat> ScoreTransform<T> {
    /// Applies the transform to one raw dot product.
    #[inline(always)]
    pub fn apply(&self, dot: T) -> T {
        match self.post {
            None => dot * self.pre,
            Some(post) => (dot * self.pre).libm_tanh() * post,
        }
    }
}
