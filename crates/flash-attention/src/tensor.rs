//! Dtype-erased host tensor views: one argument type for f32, bf16 and f16 slices, so that
//! callers that learn the dtype at run time (files, the C ABI, Python) hand buffers over
//! without generics, and the backend picks the typed kernel.

use half::{bf16, f16};
use softmax_core::{DType, Extent};

/// A borrowed, read-only host tensor of any supported dtype (elements only; the shape and
/// strides live in the [`softmax_core::Problem`]).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum TensorRef<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// bf16 elements.
    Bf16(&'a [bf16]),
    /// f16 elements.
    F16(&'a [f16]),
}

/// A borrowed, writable host tensor of any supported dtype.
#[derive(Debug, PartialEq)]
#[non_exhaustive]
pub enum TensorMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// bf16 elements.
    Bf16(&'a mut [bf16]),
    /// f16 elements.
    F16(&'a mut [f16]),
}

impl TensorRef<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            TensorRef::F32(_) => DType::F32,
            TensorRef::Bf16(_) => DType::Bf16,
            TensorRef::F16(_) => DType::F16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorRef::F32(s) => s.len(),
            TensorRef::Bf16(s) => s.len(),
            TensorRef::F16(s) => s.len(),
        }
    }

    /// Whether the view holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl TensorMut<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            TensorMut::F32(_) => DType::F32,
            TensorMut::Bf16(_) => DType::Bf16,
            TensorMut::F16(_) => DType::F16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorMut::F32(s) => s.len(),
            TensorMut::Bf16(s) => s.len(),
            TensorMut::F16(s) => s.len(),
        }
    }

    /// Whether the view holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A shorter-lived writable view of the same elements (to pass the view to several calls).
    pub fn reborrow(&mut self) -> TensorMut<'_> {
        match self {
            TensorMut::F32(s) => TensorMut::F32(s),
            TensorMut::Bf16(s) => TensorMut::Bf16(s),
            TensorMut::F16(s) => TensorMut::F16(s),
        }
    }

    /// A read-only view of the same elements.
    pub fn as_ref(&self) -> TensorRef<'_> {
        match self {
            TensorMut::F32(s) => TensorRef::F32(s),
            TensorMut::Bf16(s) => TensorRef::Bf16(s),
            TensorMut::F16(s) => TensorRef::F16(s),
        }
    }
}

impl Extent for TensorRef<'_> {
    fn elems(&self) -> usize {
        self.len()
    }
}

impl Extent for TensorMut<'_> {
    fn elems(&self) -> usize {
        self.len()
    }
}

macro_rules! from_slices {
    ($($t:ty => $variant:ident),*) => {$(
        impl<'a> From<&'a [$t]> for TensorRef<'a> {
            fn from(s: &'a [$t]) -> Self {
                TensorRef::$variant(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for TensorRef<'a> {
            fn from(s: &'a mut [$t]) -> Self {
                TensorRef::$variant(s)
            }
        }
        impl<'a> From<&'a Vec<$t>> for TensorRef<'a> {
            fn from(s: &'a Vec<$t>) -> Self {
                TensorRef::$variant(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for TensorMut<'a> {
            fn from(s: &'a mut [$t]) -> Self {
                TensorMut::$variant(s)
            }
        }
        impl<'a> From<&'a mut Vec<$t>> for TensorMut<'a> {
            fn from(s: &'a mut Vec<$t>) -> Self {
                TensorMut::$variant(s)
            }
        }
    )*};
}

from_slices!(f32 => F32, bf16 => Bf16, f16 => F16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_know_their_dtype_and_length() {
        let a = vec![0.0f32; 3];
        let mut b = vec![bf16::ZERO; 5];
        let mut c = [f16::ZERO; 2];
        assert_eq!(TensorRef::from(&a).dtype(), DType::F32);
        assert_eq!(TensorRef::from(&a[..]).elems(), 3);
        let mut m = TensorMut::from(&mut b);
        assert_eq!((m.dtype(), m.len()), (DType::Bf16, 5));
        assert_eq!(m.reborrow().as_ref().dtype(), DType::Bf16);
        let m = TensorMut::from(&mut c[..]);
        assert_eq!((m.dtype(), m.elems()), (DType::F16, 2));
        assert!(TensorRef::from(&[] as &[f32]).is_empty());
    }
}
