//! The CUDA side: an opaque device handle over the caller's context, and `fa_forward_cuda` on
//! caller-owned device memory and a caller's stream (nothing synchronised).

use crate::convert::*;
use crate::cpu::read_call;
use crate::error::{guard, Failure};
use crate::types::*;
use core::ffi::c_void;
use cudarc::driver::sys;
use fa_cuda::{CuSeqlens, CudaElement, Device, ForwardOptions, RawTensor};
use half::{bf16, f16};
use softmax_core::{DType, Out, Problem, Qkv};

/// Checks an out-parameter and clears it (so a failure leaves a null handle behind).
///
/// # Safety
/// A non-null, aligned `out` must be writable.
unsafe fn clear_out(out: *mut *mut FaCudaDevice) -> Result<(), Failure> {
    if out.is_null() {
        return Err(Failure::invalid("out is a null pointer"));
    }
    if !out.is_aligned() {
        return Err(Failure::invalid("out is misaligned"));
    }
    // SAFETY: non-null, aligned (checked), writable (contract).
    unsafe { out.write(core::ptr::null_mut()) };
    Ok(())
}

/// Hands a device to C through a checked out-parameter.
///
/// # Safety
/// `out` must have passed [`clear_out`].
unsafe fn hand_out(out: *mut *mut FaCudaDevice, device: Device) {
    let handle = Box::into_raw(Box::new(FaCudaDevice { device }));
    // SAFETY: `out` is non-null, aligned and writable (clear_out and the contract).
    unsafe { out.write(handle) };
}

/// Opens CUDA device `ordinal` in its primary context (the one the CUDA runtime, and so
/// PyTorch, uses) and stores a handle in `*out` (null on failure). Without a driver, NVRTC or
/// such a device: `FA_ERR_NO_DEVICE`. Free the handle with `fa_cuda_device_destroy`.
///
/// # Safety
/// `out` must be null (refused) or point to a writable `FaCudaDevice *`.
#[no_mangle]
pub unsafe extern "C" fn fa_cuda_device_create(ordinal: i32, out: *mut *mut FaCudaDevice) -> i32 {
    guard(|| {
        // SAFETY: this function's contract.
        unsafe { clear_out(out) }?;
        let ordinal = usize::try_from(ordinal)
            .map_err(|_| Failure::invalid(format!("ordinal is {ordinal}: negative")))?;
        let device = Device::open(ordinal)?;
        // SAFETY: `out` passed clear_out.
        unsafe { hand_out(out, device) };
        Ok(())
    })
}

/// The calling thread's current context, after checking that the driver loads.
///
/// # Safety
/// None beyond the driver's: `cuCtxGetCurrent` only reads this thread's state.
unsafe fn current_context() -> Result<sys::CUcontext, Failure> {
    if !fa_cuda::driver_available() {
        return Err(fa_cuda::CudaError::NoDriver.into());
    }
    let mut ctx: sys::CUcontext = core::ptr::null_mut();
    // SAFETY: the driver library loads (checked); the call writes one handle into `ctx`.
    let result = unsafe { sys::cuCtxGetCurrent(&mut ctx) };
    if result != sys::CUresult::CUDA_SUCCESS {
        return Err(Failure {
            code: FA_ERR_CUDA,
            message: format!("cuCtxGetCurrent failed: {result:?}"),
        });
    }
    if ctx.is_null() {
        return Err(Failure::invalid(
            "no CUDA context is current on this thread (pass one, or use fa_cuda_device_create)",
        ));
    }
    Ok(ctx)
}

/// A device handle over the caller's `CUcontext` (`context`; null: the context current on
/// the calling thread). Only primary contexts can be shared (the CUDA runtime's and
/// PyTorch's are); another is `FA_ERR_INVALID_ARGUMENT`. Stores the handle in `*out` (null
/// on failure); free it with `fa_cuda_device_destroy`.
///
/// # Safety
/// `context` must be null or a live `CUcontext`; `out` as in `fa_cuda_device_create`.
#[no_mangle]
pub unsafe extern "C" fn fa_cuda_device_create_from_context(
    context: *mut c_void,
    out: *mut *mut FaCudaDevice,
) -> i32 {
    guard(|| {
        // SAFETY: this function's contract.
        unsafe { clear_out(out) }?;
        let ctx = if context.is_null() {
            // SAFETY: reads this thread's driver state only.
            unsafe { current_context() }?
        } else {
            context as sys::CUcontext
        };
        // SAFETY: `ctx` is live: the caller's contract, or current on this thread.
        let device = unsafe { Device::from_raw_context(ctx) }?;
        // SAFETY: `out` passed clear_out.
        unsafe { hand_out(out, device) };
        Ok(())
    })
}

/// Frees a handle from `fa_cuda_device_create*` (null: nothing). Work queued through it on
/// the caller's streams must have finished or be ordered before the context is destroyed.
///
/// # Safety
/// `device` must be null or a handle not yet destroyed; it is invalid afterwards.
#[no_mangle]
pub unsafe extern "C" fn fa_cuda_device_destroy(device: *mut FaCudaDevice) {
    guard(|| {
        if !device.is_null() {
            // SAFETY: a live handle made by Box::into_raw (the contract), freed once.
            drop(unsafe { Box::from_raw(device) });
        }
        Ok(())
    });
}

/// Borrows the device behind a handle.
///
/// # Safety
/// A non-null `device` must be a live handle.
unsafe fn device_ref<'a>(device: *const FaCudaDevice) -> Result<&'a FaCudaDevice, Failure> {
    if device.is_null() || !device.is_aligned() {
        return Err(Failure::invalid("device is a null or misaligned pointer"));
    }
    // SAFETY: a live handle (the contract).
    Ok(unsafe { &*device })
}

/// A raw device tensor of `len` elements at `addr`.
///
/// # Safety
/// As [`RawTensor::from_raw`].
unsafe fn raw<T>(addr: u64, len: usize) -> RawTensor<T> {
    // SAFETY: forwarded.
    unsafe { RawTensor::from_raw(addr, len) }
}

/// Device addresses and lengths of a checked call.
struct DeviceCall<'p, 'a> {
    problem: &'p Problem<'a>,
    ptrs: [u64; 4],
    lens: [usize; 4],
    lse: Option<(u64, usize)>,
    cu_seqlens: Option<(u64, u64, usize)>,
}

/// Queues the kernel for element type `T` on `stream`.
///
/// # Safety
/// The addresses of `call` must satisfy [`RawTensor::from_raw`] for their lengths.
unsafe fn launch<T: CudaElement>(
    device: &Device,
    call: &DeviceCall,
    stream: sys::CUstream,
) -> Result<(), Failure> {
    // SAFETY: the caller's contract (fa_forward_cuda's): device memory of this context that
    // stays valid until `stream` passes the kernel.
    let (qkv, out, cu) = unsafe {
        let [q, k, v, o] = call.ptrs;
        let [lq, lk, lv, lo] = call.lens;
        (
            Qkv::new(raw::<T>(q, lq), raw::<T>(k, lk), raw::<T>(v, lv)),
            Out {
                o: raw::<T>(o, lo),
                lse: call.lse.map(|(p, n)| raw::<f32>(p, n)),
            },
            call.cu_seqlens.map(|(q, k, n)| CuSeqlens {
                q: raw::<i32>(q, n),
                k: raw::<i32>(k, n),
            }),
        )
    };
    // SAFETY: `stream` is a stream of the device's context kept alive by the caller (the
    // contract); fa-cuda refuses a stream of another context.
    let stream = unsafe { device.borrow_stream(stream) };
    let opts = ForwardOptions::default();
    match cu {
        None => device.forward_on_stream(call.problem, qkv, out, &stream, &opts)?,
        Some(cu) => device.forward_varlen_on_stream(call.problem, cu, qkv, out, &stream, &opts)?,
    };
    Ok(())
}

/// Forward attention on device memory the caller owns, queued on the caller's `stream` (a
/// `CUstream`/`cudaStream_t` of the device's context; null: the legacy default stream)
/// without waiting for it: order later work after `stream` before reading `o`/`lse` or
/// freeing anything. Q, K, V and O share one dtype, bf16 or f16; `lse` (nullable) is a
/// device pointer to f32s laid out as in `fa_forward_cpu`. Prefix sums may be on the host
/// (`FA_SEQLENS_VARLEN_HOST`: copied on `stream`) or on the device
/// (`FA_SEQLENS_VARLEN_DEVICE`). Everything is checked before anything is queued (null,
/// alignment: 16 bytes for tensors, 4 for LSE and prefix sums; overflow; strides and head
/// dimensions multiples of 8). The options' CPU fields are ignored.
///
/// # Safety
/// `device` must be a live handle; the descriptors as in `fa_forward_cpu`; every `data`,
/// `lse` and device prefix-sum pointer must be device memory usable in the device's context
/// holding what the problem reaches, which stays allocated and is not written by other work
/// (inputs) or touched at all (outputs) until `stream` has passed the kernel; device prefix
/// sums must be valid (`batch + 1` non-decreasing values from 0 to `total_q`/`total_k`, no
/// sequence longer than `max_seqlen_q`/`max_seqlen_k`); `stream` must stay alive meanwhile.
#[no_mangle]
pub unsafe extern "C" fn fa_forward_cuda(
    device: *const FaCudaDevice,
    problem: *const FaProblem,
    q: *const FaTensor,
    k: *const FaTensor,
    v: *const FaTensor,
    o: *const FaTensor,
    lse: *mut f32,
    stream: *mut c_void,
    options: *const FaOptions,
) -> i32 {
    guard(|| {
        // SAFETY: this function's contract.
        let device = &unsafe { device_ref(device) }?.device;
        // SAFETY: as above.
        let call = unsafe { read_call(problem, q, k, v, o) }?;
        // SAFETY: as above (validated for its size and version; no field applies here).
        unsafe { read_options(options) }?;
        // SAFETY: host prefix sums follow this function's contract.
        let seqlens = unsafe { read_seqlens(&call.problem, true) }?;
        let problem = describe(&call.problem, &seqlens, call.tensor_refs())?
            .validate(softmax_core::MAX_HEAD_DIM)?;
        let names = ["q", "k", "v", "o"];
        let mut dtypes = [DType::F32; 4];
        for (i, t) in call.tensors.iter().enumerate() {
            dtypes[i] = dtype(t, names[i])?;
        }
        let input = dtypes[0];
        if dtypes.iter().any(|&d| d != input) || input == DType::F32 {
            return Err(Failure::unsupported(
                "fa_forward_cuda takes q, k, v and o of one dtype, bf16 or f16",
            ));
        }
        let min = problem.min_buffer_lens();
        let lens = [min.q, min.k, min.v, min.o];
        // Outputs must not overlap inputs or each other (the kernel would race).
        let mut spans = Vec::with_capacity(5);
        for (i, t) in call.tensors.iter().enumerate() {
            let span = host_span(names[i], t.data as usize, lens[i], input.size())?;
            spans.push((names[i], span, i == 3));
        }
        let lse = (!lse.is_null()).then(|| (lse as usize as u64, problem.lse_len()));
        if let Some((p, n)) = lse {
            spans.push(("lse", host_span("lse", p as usize, n, 4)?, true));
        }
        check_disjoint(&spans)?;
        let call = DeviceCall {
            problem: &problem,
            ptrs: call.tensors.map(|t| t.data as usize as u64),
            lens,
            lse,
            cu_seqlens: match seqlens {
                Seqlens::Device { q, k, entries } => Some((q, k, entries)),
                _ => None,
            },
        };
        let stream = stream as sys::CUstream;
        // SAFETY: the addresses follow this function's contract.
        unsafe {
            match input {
                DType::Bf16 => launch::<bf16>(device, &call, stream),
                _ => launch::<f16>(device, &call, stream),
            }
        }
    })
}
