//! Typed errors of the FP8 crate.

use core::fmt;
use softmax_core::ProblemError;

/// Why an FP8 operation was rejected. Nothing is written to any output when one is returned.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum Fp8Error {
    /// Two slices that must have equal lengths do not (`what` names the operation).
    LengthMismatch {
        /// The operation or buffer.
        what: &'static str,
        /// The length required.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// The Hadamard transform needs a power-of-two dimension in `1..=256`.
    HadamardDim {
        /// The dimension given.
        dim: usize,
    },
    /// A block of zero rows was asked for.
    ZeroBlock,
    /// A scale is zero, negative, NaN or infinite.
    BadScale {
        /// The value given.
        scale: f32,
    },
    /// The rescale threshold plus the P offset would let the unnormalised probabilities
    /// overflow e4m3 (`τ + offset ≥ log2(448)`).
    PRange {
        /// `τ` in log2 units (0 for [`softmax_core::RescalePolicy::Always`]).
        tau: f32,
        /// The P offset in log2 units (8 in FlashAttention-3).
        offset: f32,
    },
    /// The attention problem itself is invalid.
    Problem(ProblemError),
}

impl From<ProblemError> for Fp8Error {
    fn from(e: ProblemError) -> Self {
        Fp8Error::Problem(e)
    }
}

impl fmt::Display for Fp8Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fp8Error::LengthMismatch {
                what,
                expected,
                got,
            } => write!(f, "{what}: expected {expected} elements, got {got}"),
            Fp8Error::HadamardDim { dim } => write!(
                f,
                "the Hadamard transform needs a power-of-two dimension up to 256, got {dim}"
            ),
            Fp8Error::ZeroBlock => f.write_str("block size must be at least one row"),
            Fp8Error::BadScale { scale } => {
                write!(f, "scale must be finite and positive, got {scale}")
            }
            Fp8Error::PRange { tau, offset } => write!(
                f,
                "rescale threshold {tau} + P offset {offset} must stay below log2(448) = 8.807"
            ),
            Fp8Error::Problem(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Fp8Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Fp8Error::Problem(e) => Some(e),
            _ => None,
        }
    }
}
