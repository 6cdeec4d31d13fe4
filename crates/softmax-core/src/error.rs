//! Typed errors of problem validation.

use core::fmt;

/// Which tensor of an attention call an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tensor {
    /// Queries.
    Q,
    /// Keys.
    K,
    /// Values.
    V,
    /// Output.
    O,
    /// Log-sum-exp of each row (natural log).
    Lse,
}

impl fmt::Display for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tensor::Q => "q",
            Tensor::K => "k",
            Tensor::V => "v",
            Tensor::O => "output",
            Tensor::Lse => "lse",
        })
    }
}

/// Why an attention problem was rejected. Backends return it before touching any output.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum ProblemError {
    /// A dimension that must be at least one is zero (`what` names it).
    ZeroDim {
        /// The dimension's name.
        what: &'static str,
    },
    /// `head_dim` (or `head_dim_v`) outside `1..=max`.
    HeadDimOutOfRange {
        /// The dimension's name (`head_dim` or `head_dim_v`).
        what: &'static str,
        /// The value given.
        head_dim: usize,
        /// The largest supported.
        max: usize,
    },
    /// `heads_q` is not a multiple of `heads_kv` (grouped-query attention needs it).
    GqaRatio {
        /// Query heads.
        heads_q: usize,
        /// Key/value heads.
        heads_kv: usize,
    },
    /// The softmax scale is NaN or infinite.
    NonFiniteScale {
        /// The value given.
        scale: f32,
    },
    /// The softcap is NaN, infinite, zero or negative.
    BadSoftcap {
        /// The value given.
        softcap: f32,
    },
    /// `cu_seqlens_q` and `cu_seqlens_k` differ in length, or are shorter than two entries.
    CuSeqlensLength {
        /// Entries of `cu_seqlens_q`.
        len_q: usize,
        /// Entries of `cu_seqlens_k`.
        len_k: usize,
    },
    /// A `cu_seqlens` array does not start at zero or decreases somewhere.
    CuSeqlensNotMonotone {
        /// The tensor whose prefix sums are wrong (Q or K).
        tensor: Tensor,
        /// The first index where it goes wrong.
        index: usize,
    },
    /// A stride makes rows of a tensor overlap (each head's `head_dim` elements are contiguous).
    StrideTooSmall {
        /// The tensor.
        tensor: Tensor,
        /// The stride's name.
        what: &'static str,
        /// The stride given.
        stride: usize,
        /// The smallest stride that avoids overlap.
        min: usize,
    },
    /// A buffer is shorter than its shape and strides need.
    BufferTooSmall {
        /// The tensor.
        tensor: Tensor,
        /// Elements needed.
        needed: usize,
        /// Elements given.
        len: usize,
    },
    /// Index arithmetic overflowed `usize` (absurd shapes or strides).
    Overflow,
    /// The backend does not support this (dtype, head dim, architecture, feature).
    Unsupported {
        /// What is not supported.
        what: &'static str,
    },
}

impl fmt::Display for ProblemError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ProblemError::ZeroDim { what } => write!(f, "{what} must be at least 1"),
            ProblemError::HeadDimOutOfRange {
                what,
                head_dim,
                max,
            } => {
                write!(
                    f,
                    "{what} = {head_dim} is out of range: supported 1..={max}"
                )
            }
            ProblemError::GqaRatio { heads_q, heads_kv } => write!(
                f,
                "heads_q = {heads_q} is not a multiple of heads_kv = {heads_kv} (GQA/MQA need it)"
            ),
            ProblemError::NonFiniteScale { scale } => {
                write!(f, "softmax_scale = {scale} is not finite")
            }
            ProblemError::BadSoftcap { softcap } => {
                write!(f, "softcap = {softcap} must be finite and positive")
            }
            ProblemError::CuSeqlensLength { len_q, len_k } => write!(
                f,
                "cu_seqlens_q has {len_q} entries and cu_seqlens_k {len_k}: both need batch + 1 ≥ 2"
            ),
            ProblemError::CuSeqlensNotMonotone { tensor, index } => write!(
                f,
                "cu_seqlens of {tensor} must start at 0 and never decrease (wrong at index {index})"
            ),
            ProblemError::StrideTooSmall {
                tensor,
                what,
                stride,
                min,
            } => write!(
                f,
                "{tensor}: {what} = {stride} makes elements overlap (at least {min} needed)"
            ),
            ProblemError::BufferTooSmall {
                tensor,
                needed,
                len,
            } => write!(
                f,
                "{tensor}: buffer holds {len} elements, the shape and strides need {needed}"
            ),
            ProblemError::Overflow => f.write_str("shape or strides overflow the index range"),
            ProblemError::Unsupported { what } => write!(f, "unsupported: {what}"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for ProblemError {}
