//! The element types tensors hold, shared by every crate of the workspace.

use core::fmt;

/// Element type of a tensor (Q, K, V, O, and P where a kernel stores it narrowly).
///
/// One enum for the whole workspace: backends say which they take, file readers say which
/// they found, and the rescale rule ([`crate::RescalePolicy::check`]) asks for the largest
/// finite value of the type P is stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    Bf16,
    /// IEEE half precision.
    F16,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }

    /// The short name used in tables, JSON and command lines (`f32`, `bf16`, `f16`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        }
    }

    /// The dtype of a short name ([`DType::name`]'s inverse).
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// The largest finite value.
    pub const fn max_finite(self) -> f32 {
        match self {
            DType::F32 => f32::MAX,
            // 0x7f7f: the largest finite bfloat16, (2 − 2^-7)·2^127.
            DType::Bf16 => 3.389_531_4e38,
            DType::F16 => 65504.0,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes() {
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
        assert_eq!(DType::from_name("f64"), None);
        assert_eq!(DType::Bf16.size(), 2);
        assert_eq!(DType::F32.size(), 4);
        // bf16's max is f32's max with the low 16 mantissa bits cleared.
        assert_eq!(DType::Bf16.max_finite().to_bits(), 0x7f7f_0000);
    }
}
