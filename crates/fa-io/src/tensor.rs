//! Host tensors as the file formats hold them: a shape and typed data (f32, bf16, f16) in C
//! order. (fa-cli hands them to the attention library as dtype-erased views.)

use crate::error::Error;
use crate::memory::{checked_bytes, checked_product, ensure_fits, try_filled, try_with_capacity};
use half::{bf16, f16};
pub use softmax_core::DType;

/// The element count of `shape`, checked: an overflow or a size beyond the available memory is
/// [`Error::TooLarge`].
pub fn element_count(shape: &[usize], dtype: DType) -> Result<usize, Error> {
    let what = format!("a {dtype} tensor of shape {shape:?}");
    ensure_fits(&what, checked_bytes(shape, dtype.size()))?;
    checked_product(shape).ok_or(Error::TooLarge {
        what,
        needed: None,
        available: None,
    })
}

/// Collects `n` items into a vector reserved fallibly.
fn try_extend<T>(n: usize, items: impl Iterator<Item = T>) -> Result<Vec<T>, Error> {
    let mut v = try_with_capacity(n, "a tensor")?;
    v.extend(items);
    Ok(v)
}

/// Typed element storage.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    /// f32 elements.
    F32(Vec<f32>),
    /// bf16 elements.
    Bf16(Vec<bf16>),
    /// f16 elements.
    F16(Vec<f16>),
}

impl Data {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Data::F32(_) => DType::F32,
            Data::Bf16(_) => DType::Bf16,
            Data::F16(_) => DType::F16,
        }
    }
}

/// A dense, C-ordered tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Elements in C order; `shape.iter().product()` of them.
    pub data: Data,
}

impl HostTensor {
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.data {
            Data::F32(v) => v.len(),
            Data::Bf16(v) => v.len(),
            Data::F16(v) => v.len(),
        }
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the element data.
    pub fn byte_len(&self) -> usize {
        self.len() * self.dtype().size()
    }

    /// A tensor of `dtype` filled with zeros.
    /// Sizes are checked and the allocation is fallible: a shape too large is
    /// [`Error::TooLarge`], never an abort.
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Result<HostTensor, Error> {
        let n = element_count(&shape, dtype)?;
        let data = match dtype {
            DType::F32 => Data::F32(try_filled(n, 0.0, "a tensor")?),
            DType::Bf16 => Data::Bf16(try_filled(n, bf16::ZERO, "a tensor")?),
            DType::F16 => Data::F16(try_filled(n, f16::ZERO, "a tensor")?),
            other => return Err(Error::UnsupportedDtype(other)),
        };
        Ok(HostTensor { shape, data })
    }

    /// A tensor of `dtype` from f32 values (rounded to nearest even).
    pub fn from_f32(dtype: DType, shape: Vec<usize>, values: &[f32]) -> Result<HostTensor, Error> {
        let data = match dtype {
            DType::F32 => Data::F32(values.to_vec()),
            DType::Bf16 => Data::Bf16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
            DType::F16 => Data::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
            other => return Err(Error::UnsupportedDtype(other)),
        };
        Ok(HostTensor { shape, data })
    }

    /// The elements widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.data {
            Data::F32(v) => v.clone(),
            Data::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Data::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// Decodes raw element bytes (`big_endian` selects the byte order). The caller checked
    /// that `bytes.len()` is the element count times the element size.
    pub fn from_bytes(
        dtype: DType,
        shape: Vec<usize>,
        bytes: &[u8],
        big_endian: bool,
    ) -> Result<Self, Error> {
        let two = |c: &[u8]| {
            let b = [c[0], c[1]];
            if big_endian {
                u16::from_be_bytes(b)
            } else {
                u16::from_le_bytes(b)
            }
        };
        let n = bytes.len() / dtype.size().max(1);
        let data = match dtype {
            DType::F32 => Data::F32(try_extend(
                n,
                bytes.chunks_exact(4).map(|c| {
                    let b = [c[0], c[1], c[2], c[3]];
                    if big_endian {
                        f32::from_be_bytes(b)
                    } else {
                        f32::from_le_bytes(b)
                    }
                }),
            )?),
            DType::Bf16 => Data::Bf16(try_extend(
                n,
                bytes.chunks_exact(2).map(|c| bf16::from_bits(two(c))),
            )?),
            DType::F16 => Data::F16(try_extend(
                n,
                bytes.chunks_exact(2).map(|c| f16::from_bits(two(c))),
            )?),
            other => return Err(Error::UnsupportedDtype(other)),
        };
        Ok(HostTensor { shape, data })
    }

    /// Appends the elements as little-endian bytes.
    pub fn append_le_bytes(&self, out: &mut Vec<u8>) {
        out.reserve(self.byte_len());
        match &self.data {
            Data::F32(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            Data::Bf16(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes())),
            Data::F16(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes())),
        }
    }
}
