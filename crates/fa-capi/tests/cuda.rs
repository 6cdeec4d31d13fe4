//! The CUDA entry points: without a GPU every device call is `FA_ERR_NO_DEVICE`; on a GPU
//! (ignored here) `fa_forward_cuda` runs on a caller's stream on cudarc allocations and
//! matches the f64 reference.

mod common;

use common::*;
use core::ffi::c_void;
use core::ptr::{null, null_mut};
use flash_attention_rs::*;

fn gpu_present() -> bool {
    fa_cuda::Device::open(0).is_ok()
}

#[test]
fn without_a_gpu_device_creation_is_no_device() {
    if gpu_present() {
        eprintln!("a GPU is present: the no-device answer cannot be observed here");
        return;
    }
    let mut handle: *mut FaCudaDevice = std::ptr::dangling_mut();
    // SAFETY: `handle` is a writable local.
    let code = unsafe { fa_cuda_device_create(0, &mut handle) };
    assert_eq!(code, FA_ERR_NO_DEVICE, "{}", last_error());
    assert!(handle.is_null(), "a failure leaves a null handle");
    assert!(!last_error().is_empty());
    // SAFETY: as above; null context = the current one, which cannot exist here.
    let code = unsafe { fa_cuda_device_create_from_context(null_mut(), &mut handle) };
    assert_eq!(code, FA_ERR_NO_DEVICE, "{}", last_error());
    // SAFETY: null is accepted and ignored.
    unsafe { fa_cuda_device_destroy(null_mut()) };
}

#[test]
fn bad_handles_and_out_pointers_are_refused() {
    // SAFETY: a null out-pointer is refused before anything is written.
    let code = unsafe { fa_cuda_device_create(0, null_mut()) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    let mut handle = null_mut();
    // SAFETY: `handle` is a writable local.
    let code = unsafe { fa_cuda_device_create(-1, &mut handle) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    let p = dense(1, 4, 4, 2, 2, 64);
    let t = bshd(16 as *mut c_void, FA_DTYPE_BF16, 4, 2, 64);
    // SAFETY: a null device is refused before anything else is read.
    let code =
        unsafe { fa_forward_cuda(null(), &p, &t, &t, &t, &t, null_mut(), null_mut(), null()) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("device"), "{}", last_error());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forward_on_a_caller_stream_matches_the_reference() {
    use cudarc::driver::{CudaContext, DevicePtr};
    use fa_reference::{compare, Case, Rng, Rounding};
    use half::bf16;

    let ctx = CudaContext::new(0).expect("device 0");
    let stream = ctx.new_stream().expect("a caller stream");
    let mut handle = null_mut();
    // SAFETY: the primary context is current on this thread (CudaContext::new binds it).
    let code = unsafe { fa_cuda_device_create_from_context(null_mut(), &mut handle) };
    assert_eq!(code, FA_OK, "{}", last_error());

    let mut rng = Rng::new(21);
    for causal in [false, true] {
        let mut case = Case::dense(&mut rng, 2, 100, 130, 8, 2, 64).round(Rounding::Bf16);
        if causal {
            case = case.causal();
        }
        let problem = case.desc().validate(256).expect("valid");
        let up = |x: &[f32]| {
            let bits: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            stream.clone_htod(&bits).expect("upload")
        };
        let (q, k, v) = (up(&case.q), up(&case.k), up(&case.v));
        let o = stream
            .alloc_zeros::<u16>(problem.min_buffer_lens().o)
            .expect("alloc");
        let lse = stream.alloc_zeros::<f32>(problem.lse_len()).expect("alloc");
        let mut p = dense(2, 100, 130, 8, 2, 64);
        p.causal = causal as u32;
        let addr =
            |s: &cudarc::driver::CudaSlice<u16>| s.device_ptr(&stream).0 as usize as *mut c_void;
        let tq = bshd(addr(&q), FA_DTYPE_BF16, 100, 8, 64);
        let tk = bshd(addr(&k), FA_DTYPE_BF16, 130, 2, 64);
        let tv = bshd(addr(&v), FA_DTYPE_BF16, 130, 2, 64);
        let to = bshd(addr(&o), FA_DTYPE_BF16, 100, 8, 64);
        let lse_ptr = lse.device_ptr(&stream).0 as usize as *mut f32;
        // SAFETY: allocations of this context sized for the problem, alive until the
        // stream is synchronised below; `stream` is a stream of the same context.
        let code = unsafe {
            fa_forward_cuda(
                handle,
                &p,
                &tq,
                &tk,
                &tv,
                &to,
                lse_ptr,
                stream.cu_stream() as *mut c_void,
                null(),
            )
        };
        assert_eq!(code, FA_OK, "{}", last_error());
        stream.synchronize().expect("synchronise");
        let o_host: Vec<bf16> = stream
            .clone_dtoh(&o)
            .expect("download")
            .into_iter()
            .map(bf16::from_bits)
            .collect();
        let lse_host = stream.clone_dtoh(&lse).expect("download");
        let oracle = fa_reference::attention_f64(&problem, &case.q, &case.k, &case.v);
        let report = compare(&problem, &o_host, Some(&lse_host), &oracle);
        assert!(report.within(1e-2, 1e-3), "causal={causal}: {report:?}");
    }
    // SAFETY: the handle came from fa_cuda_device_create_from_context; work is finished.
    unsafe { fa_cuda_device_destroy(handle) };
}
