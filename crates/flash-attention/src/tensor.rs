//! Dtype-erased host tensor views: one argument type for f32, bf16 and f16 slices, so that
//! callers that learn the dtype at run time (files, the C ABI, Python) hand buffers over
//! without generics, and the backend picks the typed kernel. They are fa-cpu's
//! ([`fa_cpu::TensorRef`]), whose dtype-erased entry points hold the one dtype dispatch of
//! the CPU kernels.

pub use fa_cpu::{TensorMut, TensorRef};

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};
    use softmax_core::{DType, Extent};

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
