//! Helpers shared by fa-cuda's GPU test files (`gpu.rs`, `gpu_decode.rs`): the error bounds,
//! the device, caller memory as raw tensors, and reading results back.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use fa_cuda::{Device, RawTensor};
use half::bf16;
use std::sync::{Arc, OnceLock};

/// Normwise bound of ‖out − ref‖ / ‖ref‖ for 16-bit inputs.
pub const REL_L2_BOUND: f64 = 1e-2;
/// Largest absolute LSE error.
pub const LSE_BOUND: f64 = 1e-3;

/// Device 0, opened once per test binary; these tests need a CUDA GPU and say so.
pub fn device() -> &'static Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE.get_or_init(|| match Device::open(0) {
        Ok(d) => d,
        Err(e) => panic!("these tests need a CUDA GPU: {e}"),
    })
}

/// Caller memory: a cudarc allocation seen as a raw tensor of `T` (same size as `R`).
pub fn raw<T, R: DeviceRepr>(slice: &CudaSlice<R>, stream: &CudaStream) -> RawTensor<T> {
    assert_eq!(core::mem::size_of::<T>(), core::mem::size_of::<R>());
    let (ptr, _record) = slice.device_ptr(stream);
    // SAFETY: a live allocation of the stream's context holding `len` values of `T`'s layout;
    // the tests keep every slice until they have synchronised the stream.
    unsafe { RawTensor::from_raw(ptr, slice.len()) }
}

/// The caller's side of the contract: synchronises `stream`, then reads O (bf16 bits) and the
/// LSE back to the host.
pub fn read_back(
    stream: &Arc<CudaStream>,
    o: &CudaSlice<u16>,
    lse: &CudaSlice<f32>,
) -> (Vec<bf16>, Vec<f32>) {
    stream.synchronize().expect("synchronise");
    let o_back: Vec<bf16> = stream
        .clone_dtoh(o)
        .expect("copy back")
        .into_iter()
        .map(bf16::from_bits)
        .collect();
    let lse_back = stream.clone_dtoh(lse).expect("copy back");
    stream.synchronize().expect("synchronise");
    (o_back, lse_back)
}
