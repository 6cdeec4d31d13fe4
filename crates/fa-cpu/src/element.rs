//! The element types the CPU path reads and writes: f32, bf16 and f16. Arithmetic is always
//! f32; 16-bit inputs are widened when a tile is packed, outputs rounded (to nearest even)
//! when they are written.

/// An element type of Q, K, V or O: `f32`, [`half::bf16`] or [`half::f16`] (sealed).
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The dtype's name (`"f32"`, `"bf16"`, `"f16"`).
    const NAME: &'static str;
    /// The dtype as `softmax-core` names it.
    const DTYPE: softmax_core::DType;
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// Rounds from f32 to nearest even.
    fn from_f32(x: f32) -> Self;
}

pub(crate) mod sealed {
    /// A typed view of a slice, so kernels can pick the right widening without unsafe casts.
    pub enum Slice<'a> {
        /// f32 data.
        F32(&'a [f32]),
        /// bf16 data.
        Bf16(&'a [half::bf16]),
        /// f16 data.
        F16(&'a [half::f16]),
    }

    /// Which of the three types an element is (a constant per type, so a `match` on it
    /// compiles to one arm).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Kind {
        /// f32.
        F32,
        /// bf16.
        Bf16,
        /// f16.
        F16,
    }

    /// Keeps [`super::Element`] closed to the three supported types.
    pub trait Sealed {
        /// The type's kind.
        const KIND: Kind;
        /// The slice as a typed view.
        fn view(s: &[Self]) -> Slice<'_>
        where
            Self: Sized;
    }
    impl Sealed for f32 {
        const KIND: Kind = Kind::F32;
        fn view(s: &[f32]) -> Slice<'_> {
            Slice::F32(s)
        }
    }
    impl Sealed for half::bf16 {
        const KIND: Kind = Kind::Bf16;
        fn view(s: &[half::bf16]) -> Slice<'_> {
            Slice::Bf16(s)
        }
    }
    impl Sealed for half::f16 {
        const KIND: Kind = Kind::F16;
        fn view(s: &[half::f16]) -> Slice<'_> {
            Slice::F16(s)
        }
    }
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    const DTYPE: softmax_core::DType = softmax_core::DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Element for half::bf16 {
    const NAME: &'static str = "bf16";
    const DTYPE: softmax_core::DType = softmax_core::DType::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
}

impl Element for half::f16 {
    const NAME: &'static str = "f16";
    const DTYPE: softmax_core::DType = softmax_core::DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}
