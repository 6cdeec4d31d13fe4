//! Host tensors as the command reads and writes them: a shape and typed data (f32, bf16, f16),
//! handed to the library as dtype-erased views ([`TensorRef`], [`TensorMut`]).
//!
//! The tensor types are fa-io's (re-exported here); the views, which need the
//! `flash_attention` library, are [`TensorViews`].

use crate::error::CliError;
use crate::memory::try_with_capacity;
pub use fa_io::tensor::{element_count, DType, Data, HostTensor};
use flash_attention::{TensorMut, TensorRef};
use half::{bf16, f16};

/// Dtype-erased views of host tensors, for the library (`use fa_cli::tensor::TensorViews` to
/// call them).
pub trait TensorViews {
    /// A read-only view of the elements, for the library.
    fn view(&self) -> TensorRef<'_>;
    /// A writable view of the elements, for the library.
    fn view_mut(&mut self) -> TensorMut<'_>;
}

impl TensorViews for Data {
    fn view(&self) -> TensorRef<'_> {
        match self {
            Data::F32(v) => TensorRef::from(v),
            Data::Bf16(v) => TensorRef::from(v),
            Data::F16(v) => TensorRef::from(v),
        }
    }

    fn view_mut(&mut self) -> TensorMut<'_> {
        match self {
            Data::F32(v) => TensorMut::from(v),
            Data::Bf16(v) => TensorMut::from(v),
            Data::F16(v) => TensorMut::from(v),
        }
    }
}

impl TensorViews for HostTensor {
    fn view(&self) -> TensorRef<'_> {
        self.data.view()
    }

    fn view_mut(&mut self) -> TensorMut<'_> {
        self.data.view_mut()
    }
}

/// Collects `n` items into a vector reserved fallibly.
fn try_extend<T>(n: usize, items: impl Iterator<Item = T>) -> Result<Vec<T>, CliError> {
    let mut v = try_with_capacity(n, "a tensor")?;
    v.extend(items);
    Ok(v)
}

/// N(0,1) values from the shared test generator (never zeros), for benchmarks and the demo.
pub fn random_normal(
    rng: &mut fa_reference::Rng,
    dtype: DType,
    shape: Vec<usize>,
) -> Result<HostTensor, CliError> {
    let n = element_count(&shape, dtype)?;
    let data = match dtype {
        DType::F32 => Data::F32(try_extend(n, (0..n).map(|_| rng.normal() as f32))?),
        DType::Bf16 => Data::Bf16(try_extend(n, (0..n).map(|_| bf16::from_f64(rng.normal())))?),
        DType::F16 => Data::F16(try_extend(n, (0..n).map(|_| f16::from_f64(rng.normal())))?),
        other => return Err(fa_io::Error::UnsupportedDtype(other).into()),
    };
    Ok(HostTensor { shape, data })
}

/// A host tensor's elements copied to start on a 64-byte cache line, as PyTorch's CPU
/// allocator and inference runtimes place a KV cache. A `Vec` promises no such thing (glibc
/// returns large blocks 16 bytes past a page), and fa-cpu's AMX decode reads K and V rows in
/// place, where a 64-byte tile row that straddles two lines costs twice the lines: `fa bench
/// --decode` measures the cache a runtime would hand it (docs/history/gpu-notes.md, 2026-12-05).
pub struct OnLine {
    data: Data,
    at: usize,
}

impl OnLine {
    /// A copy of `tensor`'s elements on a cache line (fallible allocation).
    pub fn new(tensor: &HostTensor) -> Result<OnLine, CliError> {
        fn place<T: Copy + Default>(src: &[T]) -> Result<(Vec<T>, usize), CliError> {
            let size = std::mem::size_of::<T>();
            let mut v: Vec<T> = try_with_capacity(src.len() + 64 / size, "a tensor")?;
            let at = v.as_ptr().align_offset(64).min(64 / size);
            // Within the capacity reserved: the buffer never moves, so the placement holds.
            // Zeros ahead of the tensor (an empty tensor has no element to repeat).
            v.resize(at, T::default());
            v.extend_from_slice(src);
            Ok((v, at))
        }
        let (data, at) = match &tensor.data {
            Data::F32(v) => place(v.as_slice()).map(|(v, at)| (Data::F32(v), at))?,
            Data::Bf16(v) => place(v.as_slice()).map(|(v, at)| (Data::Bf16(v), at))?,
            Data::F16(v) => place(v.as_slice()).map(|(v, at)| (Data::F16(v), at))?,
        };
        Ok(OnLine { data, at })
    }
}

impl TensorViews for OnLine {
    fn view(&self) -> TensorRef<'_> {
        let at = self.at;
        match &self.data {
            Data::F32(v) => TensorRef::from(&v[at..]),
            Data::Bf16(v) => TensorRef::from(&v[at..]),
            Data::F16(v) => TensorRef::from(&v[at..]),
        }
    }

    fn view_mut(&mut self) -> TensorMut<'_> {
        let at = self.at;
        match &mut self.data {
            Data::F32(v) => TensorMut::from(&mut v[at..]),
            Data::Bf16(v) => TensorMut::from(&mut v[at..]),
            Data::F16(v) => TensorMut::from(&mut v[at..]),
        }
    }
}
