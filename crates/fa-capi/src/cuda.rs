//! The CUDA side: an opaque device handle over the caller's context, and `fa_forward_cuda` /
//! `fa_forward_cache_cuda` / `fa_backward_cuda` on caller-owned device memory and a caller's
//! stream (nothing synchronised; a KV cache's tables stay on the device).

use crate::convert::*;
use crate::cpu::read_call;
use crate::error::{guard, Failure};
use crate::types::*;
use core::ffi::c_void;
use cudarc::driver::sys;
use fa_cuda::{
    BackwardOptions, BackwardPlan, BackwardTensors, CacheTables, CuSeqlens, CudaElement, Device,
    ForwardOptions, ForwardTensors, RawTensor,
};
use half::{bf16, f16};
use softmax_core::{DType, Grads, Out, Problem, Qkv};

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
        // SAFETY: as above (validated for its size and version; no field but the sinks,
        // refused, applies here).
        refuse_sinks(&unsafe { read_options(options) }?, "fa_forward_cuda")?;
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

/// The checked host side of a KV-cache call on the device: descriptors, the cache by
/// capacity, the options, the dtype.
struct CacheCall {
    call: crate::cpu::Call,
    cache: FaKvCache,
    host: HostCache,
    /// Always `Seqlens::Fixed` (owned here so that the problem can borrow it).
    seqlens: Seqlens,
    opts: ForwardOptions,
    dtype: DType,
}

impl CacheCall {
    /// Reads and checks every descriptor of a cache call (nothing on the device is read). The
    /// host side describes the cache by capacity: every sequence full for an attention call,
    /// every sequence empty for an append (`append`: room for `seqlen_q` new tokens is then
    /// the capacity's; the kernel reads the device lengths and skips positions past it).
    ///
    /// # Safety
    /// Each non-null, aligned pointer must point to an initialised struct (`cache` and
    /// `options` of at least their `size` bytes).
    unsafe fn read(
        problem: *const FaProblem,
        cache: *const FaKvCache,
        tensors: [*const FaTensor; 4],
        options: *const FaOptions,
        append: bool,
    ) -> Result<CacheCall, Failure> {
        let [q, k, v, o] = tensors;
        // SAFETY: this function's contract.
        let mut call = unsafe { read_call(problem, q, k, v, o) }?;
        // SAFETY: as above.
        let cache: FaKvCache = unsafe { read_versioned(cache) }?;
        // SAFETY: as above (validated for its size and version; no field but the sinks,
        // refused, applies here).
        refuse_sinks(&unsafe { read_options(options) }?, "the CUDA cache entries")?;
        let mut host = HostCache::by_capacity(&call.problem, &cache)?;
        if append {
            host.seqused_k.fill(0);
        }
        if host.paged.is_some() {
            call.problem.seqlen_k = 0;
        }
        let names = ["q", "k", "v", "o"];
        let mut dtypes = [DType::F32; 4];
        for (i, t) in call.tensors.iter().enumerate() {
            dtypes[i] = dtype(t, names[i])?;
        }
        let input = dtypes[0];
        if dtypes.iter().any(|&d| d != input) || input == DType::F32 {
            return Err(Failure::unsupported(if append {
                "fa_append_kv_cuda takes a cache and new tokens of one dtype, bf16 or f16"
            } else {
                "fa_forward_cache_cuda takes q, k, v and o of one dtype, bf16 or f16"
            }));
        }
        let opts = ForwardOptions {
            splits: (cache.num_splits != 0).then_some(cache.num_splits),
            ..ForwardOptions::default()
        };
        Ok(CacheCall {
            call,
            cache,
            host,
            seqlens: Seqlens::Fixed,
            opts,
            dtype: input,
        })
    }

    /// The cache's tables on the device (`seqused_k`: `batch` entries; the block table:
    /// `batch · blocks_per_seq`; the block walk, when `walk` and the caller set one:
    /// `batch · 2 · blocks_per_seq`, checked by fa-cuda like the others).
    ///
    /// # Safety
    /// The tables must be device memory of the device's context holding that many int32s,
    /// valid until the stream passes the call's kernels.
    unsafe fn device_tables(&self, problem: &Problem, walk: bool) -> CacheTables {
        let batch = problem.batch();
        let table_len = match problem.kv_cache() {
            softmax_core::KvCache::Paged { blocks_per_seq, .. } => batch * blocks_per_seq,
            _ => 0,
        };
        // SAFETY: forwarded from this function's contract.
        unsafe {
            CacheTables {
                seqused_k: raw::<i32>(self.cache.seqused_k as usize as u64, batch),
                block_table: (!self.cache.block_table.is_null())
                    .then(|| raw::<i32>(self.cache.block_table as usize as u64, table_len)),
                // A padded cache's walk was refused by `cache_geometry`; the validated
                // problem's `batch · blocks_per_seq` does not overflow, and twice it is
                // checked by fa-cuda.
                block_walk: (walk && !self.cache.block_walk.is_null()).then(|| {
                    raw::<i32>(
                        self.cache.block_walk as usize as u64,
                        table_len.saturating_mul(2),
                    )
                }),
            }
        }
    }

    /// The validated problem (described by capacity).
    fn problem(&self) -> Result<Problem<'_>, Failure> {
        let desc = describe(&self.call.problem, &self.seqlens, self.call.tensor_refs())?;
        Ok(self
            .host
            .apply(desc)?
            .validate(softmax_core::MAX_HEAD_DIM)?)
    }
}

/// Bytes of device workspace `fa_forward_cache_cuda` needs for this call's key splits
/// (0: one split, or nothing to compute), into `*bytes`. The plan depends only on the problem
/// (by capacity), the dtype, `cache->num_splits` and the device, so the same call always
/// needs the same size. Reads no device memory: the tensors' `data` and the cache's table
/// pointers are not used.
///
/// # Safety
/// `device` a live handle; the descriptors as in `fa_forward_cache_cuda`; `bytes` null
/// (refused) or a writable `size_t`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fa_forward_cache_cuda_workspace_bytes(
    device: *const FaCudaDevice,
    problem: *const FaProblem,
    cache: *const FaKvCache,
    q: *const FaTensor,
    k: *const FaTensor,
    v: *const FaTensor,
    o: *const FaTensor,
    options: *const FaOptions,
    bytes: *mut usize,
) -> i32 {
    guard(|| {
        if bytes.is_null() || !bytes.is_aligned() {
            return Err(Failure::invalid("bytes is a null or misaligned pointer"));
        }
        // SAFETY: this function's contract.
        let device = &unsafe { device_ref(device) }?.device;
        // SAFETY: as above.
        let call = unsafe { CacheCall::read(problem, cache, [q, k, v, o], options, false) }?;
        let problem = call.problem()?;
        let needed = device.decode_workspace_bytes(&problem, call.dtype, &call.opts)?;
        // SAFETY: non-null, aligned (checked), writable (contract).
        unsafe { bytes.write(needed) };
        Ok(())
    })
}

/// Queues a cache call for element type `T` on `stream`: device tables from `call.cache`,
/// the workspace from the caller or allocated on `stream` (freed in stream order).
///
/// # Safety
/// The addresses of `call` and the workspace must satisfy [`RawTensor::from_raw`] for their
/// lengths, as [`fa_forward_cache_cuda`] states.
unsafe fn launch_cache<T: CudaElement>(
    device: &Device,
    call: &CacheCall,
    problem: &Problem,
    lse: Option<(u64, usize)>,
    workspace: Option<(u64, usize)>,
    stream: sys::CUstream,
) -> Result<(), Failure> {
    use cudarc::driver::DevicePtr;
    // Planned once: the workspace size and the run come from the same plan.
    let plan = device.plan_forward(problem, T::DTYPE, &call.opts)?;
    let lens = problem.min_buffer_lens();
    let [tq, tk, tv, to] = &call.call.tensors;
    let addr = |t: &FaTensor| t.data as usize as u64;
    // SAFETY: the caller's contract (fa_forward_cache_cuda's): device memory of this context
    // that stays valid until `stream` passes the kernels.
    let tables = unsafe { call.device_tables(problem, true) };
    // SAFETY: as above.
    let (qkv, out, caller_ws) = unsafe {
        (
            Qkv::new(
                raw::<T>(addr(tq), lens.q),
                raw::<T>(addr(tk), lens.k),
                raw::<T>(addr(tv), lens.v),
            ),
            Out {
                o: raw::<T>(addr(to), lens.o),
                lse: lse.map(|(p, n)| raw::<f32>(p, n)),
            },
            workspace.map(|(p, bytes)| raw::<u8>(p, bytes)),
        )
    };
    // SAFETY: `stream` is a stream of the device's context kept alive by the caller (the
    // contract); fa-cuda refuses a stream of another context.
    let stream = unsafe { device.borrow_stream(stream) };
    let cuda_failure = |what: &str, e: cudarc::driver::DriverError| Failure {
        code: FA_ERR_CUDA,
        message: format!("{what} failed: {e:?}"),
    };
    // No caller workspace: allocated on the stream, so that dropping it after the launch
    // frees it in stream order, after the kernels.
    let owned = match (caller_ws, plan.workspace_bytes()) {
        (None, bytes) if bytes > 0 => Some(
            stream
                .alloc_zeros::<f32>(bytes.div_ceil(4))
                .map_err(|e| cuda_failure("allocating the split workspace", e))?,
        ),
        _ => None,
    };
    let guard = owned.as_ref().map(|s| s.device_ptr(&stream));
    // SAFETY: the caller's workspace (the contract), a live allocation of this context of
    // `s.len()` f32s alive until the stream has passed the kernels (freed in stream order
    // below), or an empty tensor that nothing reads.
    let ws = unsafe {
        match (caller_ws, &guard, &owned) {
            (Some(ws), _, _) => ws,
            (None, Some(g), Some(s)) => raw::<u8>(g.0, s.len() * 4),
            _ => raw::<u8>(0, 0),
        }
    };
    let tensors = ForwardTensors {
        qkv,
        out,
        cu_seqlens: None,
        tables: Some(tables),
    };
    let result = device.run_on_stream(&plan, tensors, ws, &stream);
    drop(guard);
    drop(owned);
    result?;
    Ok(())
}

/// Forward attention of new queries against a KV cache in device memory the caller owns,
/// queued on the caller's `stream` without waiting (as [`fa_forward_cuda`]): the decode
/// kernel over key splits, then the combine that merges them by their log-sum-exp.
///
/// `problem`, `q`, `o`, `lse` and the K/V cache are laid out as in `fa_forward_cache_cpu`
/// (see [`FaKvCache`]); Q, K, V and O share one dtype, bf16 or f16. The cache's
/// `seqused_k` (`batch` int32s) and non-null `block_table` (`batch · blocks_per_seq` int32s)
/// are **device** memory (PyTorch's `cache_seqlens` and `block_table`) and are never read by
/// the host: the call is planned for the cache's capacity (`seqlen_k` when padded,
/// `blocks_per_seq · block_size` when paged), and the kernels clamp each length to that
/// capacity and each block index to `0..num_blocks`, so wrong device values give wrong
/// results, never an access outside the tensors. Everything else is checked before anything
/// is queued (null, alignment: 16 bytes for tensors, 4 for LSE and tables; overflow;
/// overlaps).
///
/// A paged cache's `block_walk` (API version 4; device memory, `batch · 2 · blocks_per_seq`
/// int32s from `fa_block_walk` over the same lengths and table, copied to the device) lets
/// the kernel read each sequence's blocks in address order where its plan allows; null reads
/// them in the table's order (see [`FaKvCache::block_walk`]). Like the tables it is never
/// read by the host: checked for alignment (4 bytes) only.
///
/// The split workspace: `workspace` (device memory, 16-byte aligned, at least
/// `fa_forward_cache_cuda_workspace_bytes` bytes, given in `workspace_bytes`; not used by
/// other work until `stream` has passed the call) or, when `workspace` is null, allocated by
/// the library on `stream` and freed in stream order after the kernels.
///
/// # Safety
/// As [`fa_forward_cuda`], with `cache` pointing to an initialised `FaKvCache` of at least
/// `cache->size` bytes whose tables (and non-null block walk) are device memory of the
/// device's context holding what is stated above, valid (lengths at most the capacity, used
/// block indices in range, a walk built from these tables, for meaningful results) and not
/// written until `stream` has passed the call; a non-null `workspace` as stated above.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fa_forward_cache_cuda(
    device: *const FaCudaDevice,
    problem: *const FaProblem,
    cache: *const FaKvCache,
    q: *const FaTensor,
    k: *const FaTensor,
    v: *const FaTensor,
    o: *const FaTensor,
    lse: *mut f32,
    workspace: *mut c_void,
    workspace_bytes: usize,
    stream: *mut c_void,
    options: *const FaOptions,
) -> i32 {
    guard(|| {
        // SAFETY: this function's contract.
        let device = &unsafe { device_ref(device) }?.device;
        // SAFETY: as above.
        let call = unsafe { CacheCall::read(problem, cache, [q, k, v, o], options, false) }?;
        if call.cache.seqused_k.is_null() {
            return Err(Failure::invalid("cache.seqused_k is a null pointer"));
        }
        let problem = call.problem()?;
        let min = problem.min_buffer_lens();
        let lens = [min.q, min.k, min.v, min.o];
        let names = ["q", "k", "v", "o"];
        // Outputs must not overlap inputs or each other (the kernels would race).
        let mut spans = Vec::with_capacity(6);
        for (i, t) in call.call.tensors.iter().enumerate() {
            let span = host_span(names[i], t.data as usize, lens[i], call.dtype.size())?;
            spans.push((names[i], span, i == 3));
        }
        let lse = (!lse.is_null()).then(|| (lse as usize as u64, problem.lse_len()));
        if let Some((p, n)) = lse {
            spans.push(("lse", host_span("lse", p as usize, n, 4)?, true));
        }
        let workspace =
            (!workspace.is_null()).then_some((workspace as usize as u64, workspace_bytes));
        if let Some((p, bytes)) = workspace {
            spans.push((
                "workspace",
                host_span("workspace", p as usize, bytes, 1)?,
                true,
            ));
        }
        check_disjoint(&spans)?;
        let stream = stream as sys::CUstream;
        // SAFETY: the addresses follow this function's contract.
        unsafe {
            match call.dtype {
                DType::Bf16 => {
                    launch_cache::<bf16>(device, &call, &problem, lse, workspace, stream)
                }
                _ => launch_cache::<f16>(device, &call, &problem, lse, workspace, stream),
            }
        }
    })
}

/// Appends new keys and values to a KV cache in device memory the caller owns, in place,
/// queued on the caller's `stream` without waiting (as [`fa_forward_cuda`]): token `i` of
/// sequence `b` in `k_new`/`v_new` goes to position `seqused_k[b] + i` of the padded or paged
/// cache (see [`FaKvCache`] and `fa_append_kv_cpu`, whose arguments these are: `problem.seqlen_q`
/// new tokens per sequence, `heads_q`, masks, scale, softcap, `num_splits` and a paged cache's
/// `block_walk` not read). The lengths are not changed: the attention call that follows adds
/// `seqlen_q` to `seqused_k`.
///
/// The cache and the new tokens share one dtype, bf16 or f16; `k_new`/`v_new` are dense
/// `[batch, seqlen_q, heads_kv, head_dim(_v)]`. The cache's tables are **device** memory and
/// never read by the host: the host checks that the capacity holds `seqlen_q` new tokens and
/// everything it can see (null, alignment: 16 bytes for tensors, 4 for tables; overflow;
/// overlaps) before anything is queued; the kernel skips, rather than writes, a position past
/// the capacity or a block index outside `0..num_blocks`, so wrong device values lose tokens,
/// never write outside the cache.
///
/// # Safety
/// `device` a live handle; the descriptors as in `fa_append_kv_cpu`, with every `data` and the
/// cache's tables device memory of the device's context holding what their shapes and strides
/// reach, not used by other work until `stream` (a stream of that context, or null for the
/// legacy default stream) has passed the call.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fa_append_kv_cuda(
    device: *const FaCudaDevice,
    problem: *const FaProblem,
    cache: *const FaKvCache,
    k_new: *const FaTensor,
    v_new: *const FaTensor,
    k_cache: *const FaTensor,
    v_cache: *const FaTensor,
    stream: *mut c_void,
) -> i32 {
    guard(|| {
        // SAFETY: this function's contract.
        let device = &unsafe { device_ref(device) }?.device;
        // SAFETY: as above.
        let (p, new) = unsafe {
            (
                read_struct::<FaProblem>(problem, "problem")?,
                [read_struct(k_new, "k_new")?, read_struct(v_new, "v_new")?],
            )
        };
        // The attention call's Q and O, as the problem states them (never accessed): the
        // cache call's description then validates the cache exactly as it does there.
        let dense = |dim: i64| -> Result<FaTensor, Failure> {
            let overflow = || Failure::invalid("problem sizes overflow");
            let seq = p.heads_q.checked_mul(dim).ok_or_else(overflow)?;
            Ok(FaTensor {
                data: core::ptr::null_mut(),
                dtype: new[0].dtype,
                stride_batch: p.seqlen_q.checked_mul(seq).ok_or_else(overflow)?,
                stride_seq: seq,
                stride_head: dim,
            })
        };
        let dv = if p.head_dim_v == 0 {
            p.head_dim
        } else {
            p.head_dim_v
        };
        let (q, o) = (dense(p.head_dim)?, dense(dv)?);
        // SAFETY: as above; `q` and `o` are locals.
        let call = unsafe {
            CacheCall::read(
                problem,
                cache,
                [&q, k_cache, v_cache, &o],
                core::ptr::null(),
                true,
            )
        }?;
        if call.cache.seqused_k.is_null() {
            return Err(Failure::invalid("cache.seqused_k is a null pointer"));
        }
        let problem = call.problem()?;
        let names = ["k_new", "v_new", "k_cache", "v_cache"];
        let [_, tk, tv, _] = &call.call.tensors;
        let dtype = crate::cpu::append_dtype(&[new[0], new[1], *tk, *tv], names)?;
        let seqlen_new = size(p.seqlen_q, "problem.seqlen_q")?;
        let (batch, heads_kv) = (problem.batch(), problem.heads_kv());
        let mut lens = [0usize; 4];
        for (i, (t, d)) in new
            .iter()
            .zip([problem.head_dim(), problem.head_dim_v()])
            .enumerate()
        {
            // Dense rows: a stride counts only where its dimension is stepped over.
            let want = [
                (batch, seqlen_new * heads_kv * d, t.stride_batch),
                (seqlen_new, heads_kv * d, t.stride_seq),
                (heads_kv, d, t.stride_head),
            ];
            if want
                .iter()
                .any(|&(n, s, got)| n > 1 && i64::try_from(s).ok() != Some(got))
            {
                return Err(Failure::unsupported(format!(
                    "{} must be dense [batch, seqlen_q, heads_kv, head_dim] on CUDA",
                    names[i]
                )));
            }
            lens[i] = batch
                .checked_mul(seqlen_new)
                .and_then(|n| n.checked_mul(heads_kv * d))
                .ok_or_else(|| Failure::invalid("new-token sizes overflow"))?;
        }
        let min = problem.min_buffer_lens();
        (lens[2], lens[3]) = (min.k, min.v);
        let datas = [new[0].data, new[1].data, tk.data, tv.data];
        let mut spans = Vec::with_capacity(4);
        for i in 0..4 {
            let span = host_span(names[i], datas[i] as usize, lens[i], dtype.size())?;
            spans.push((names[i], span, i >= 2));
        }
        check_disjoint(&spans)?;
        let stream = stream as sys::CUstream;
        // SAFETY: the addresses and the stream follow this function's contract.
        unsafe {
            match dtype {
                DType::Bf16 => {
                    append_on::<bf16>(device, &call, &problem, seqlen_new, datas, lens, stream)
                }
                _ => append_on::<f16>(device, &call, &problem, seqlen_new, datas, lens, stream),
            }
        }
    })
}

/// Queues an append for element type `T` on `stream`.
///
/// # Safety
/// As [`fa_append_kv_cuda`]: `datas` (new K, new V, K cache, V cache) device memory of
/// `lens` elements each, the cache's tables and `stream` of the device's context.
unsafe fn append_on<T: CudaElement>(
    device: &Device,
    call: &CacheCall,
    problem: &Problem,
    seqlen_new: usize,
    datas: [*mut c_void; 4],
    lens: [usize; 4],
    stream: sys::CUstream,
) -> Result<(), Failure> {
    let t = |i: usize| {
        // SAFETY: the caller's contract.
        unsafe { raw::<T>(datas[i] as usize as u64, lens[i]) }
    };
    // SAFETY: the caller's contract. The append never reads a walk (FaKvCache::block_walk).
    let (tables, stream) = unsafe {
        (
            call.device_tables(problem, false),
            device.borrow_stream(stream),
        )
    };
    device.append_kv_on_stream(
        problem,
        seqlen_new,
        Some(tables),
        t(0),
        t(1),
        t(2),
        t(3),
        &stream,
    )?;
    Ok(())
}

/// The checked host side of a backward call on the device: the problem and Q, K, V, O
/// descriptors, dO and the gradients' descriptors (laid out as O, Q, K and V: checked), the
/// prefix sums and the one dtype of every tensor.
struct BackwardCall {
    call: crate::cpu::Call,
    /// dO, dQ, dK, dV.
    grads: [FaTensor; 4],
    seqlens: Seqlens,
    dtype: DType,
}

impl BackwardCall {
    /// Reads and checks the descriptors, the options and the prefix sums (host ones are
    /// copied; device ones kept as addresses). `grads` null: a size query (no dO or
    /// gradients to read).
    ///
    /// # Safety
    /// Each non-null, aligned pointer must point to an initialised struct (`options` of at
    /// least its `size` bytes); host prefix sums as in `fa_forward_cuda`.
    unsafe fn read(
        problem: *const FaProblem,
        tensors: [*const FaTensor; 4],
        grads: Option<[*const FaTensor; 4]>,
        options: *const FaOptions,
    ) -> Result<BackwardCall, Failure> {
        let [q, k, v, o] = tensors;
        // SAFETY: this function's contract.
        let call = unsafe { read_call(problem, q, k, v, o) }?;
        let names = ["d_o", "dq", "dk", "dv"];
        let [tq, tk, tv, to] = call.tensors;
        let grads = match grads {
            // A size query: dO and the gradients as the layouts they must have.
            None => [to, tq, tk, tv],
            Some(ptrs) => {
                let mut out = [to, tq, tk, tv];
                for (i, p) in ptrs.into_iter().enumerate() {
                    // SAFETY: as above.
                    out[i] = unsafe { read_struct(p, names[i]) }?;
                }
                out
            }
        };
        let varlen = call.problem.seqlens != FA_SEQLENS_FIXED;
        let [tq, tk, tv, to] = &call.tensors;
        for (i, like) in [(0, to), (1, tq), (2, tk), (3, tv)] {
            let like_name = ["o", "q", "k", "v"][i];
            crate::cpu::check_same_layout(&grads[i], like, (names[i], like_name), varlen)?;
        }
        // SAFETY: as above (validated for its size and version; no field but the sinks,
        // refused, applies here).
        refuse_sinks(&unsafe { read_options(options) }?, "fa_backward_cuda")?;
        // SAFETY: host prefix sums follow this function's contract.
        let seqlens = unsafe { read_seqlens(&call.problem, true) }?;
        let input = dtype(tq, "q")?;
        let all = [
            (tk, "k"),
            (tv, "v"),
            (to, "o"),
            (&grads[0], "d_o"),
            (&grads[1], "dq"),
            (&grads[2], "dk"),
            (&grads[3], "dv"),
        ];
        for (t, name) in all {
            if dtype(t, name)? != input {
                return Err(Failure::unsupported(
                    "fa_backward_cuda takes q, k, v, o, d_o, dq, dk and dv of one dtype, bf16 \
                     or f16",
                ));
            }
        }
        if input == DType::F32 {
            return Err(Failure::unsupported(
                "fa_backward_cuda takes bf16 or f16 tensors (f32 runs on the CPU: \
                 fa_backward_cpu)",
            ));
        }
        Ok(BackwardCall {
            call,
            grads,
            seqlens,
            dtype: input,
        })
    }

    /// The validated problem.
    fn problem(&self) -> Result<Problem<'_>, Failure> {
        Ok(
            describe(&self.call.problem, &self.seqlens, self.call.tensor_refs())?
                .validate(softmax_core::MAX_HEAD_DIM)?,
        )
    }
}

/// Bytes of device workspace `fa_backward_cuda` needs for this call (its plan: the f32
/// `D = rowsum(dO∘O)` and `LSE·log2 e` per (row, head) and the f32 dQ accumulator), into
/// `*bytes`; the workspace's address must be aligned to 256 bytes (as `cudaMalloc`'s are).
/// The plan depends only on the problem, the dtype and the device, so the same call always
/// needs the same size. Reads no device memory (the tensors' `data` are not used; device
/// prefix sums are not read). Since API version 7.
///
/// # Safety
/// `device` a live handle; the descriptors as in `fa_forward_cuda`; `bytes` null (refused)
/// or a writable `size_t`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fa_backward_cuda_workspace_bytes(
    device: *const FaCudaDevice,
    problem: *const FaProblem,
    q: *const FaTensor,
    k: *const FaTensor,
    v: *const FaTensor,
    o: *const FaTensor,
    options: *const FaOptions,
    bytes: *mut usize,
) -> i32 {
    guard(|| {
        if bytes.is_null() || !bytes.is_aligned() {
            return Err(Failure::invalid("bytes is a null or misaligned pointer"));
        }
        // SAFETY: this function's contract.
        let device = &unsafe { device_ref(device) }?.device;
        // SAFETY: as above.
        let call = unsafe { BackwardCall::read(problem, [q, k, v, o], None, options) }?;
        let problem = call.problem()?;
        let plan = device.plan_backward(&problem, call.dtype, &BackwardOptions::default())?;
        // SAFETY: non-null, aligned (checked), writable (contract).
        unsafe { bytes.write(plan.workspace_bytes()) };
        Ok(())
    })
}

/// Device addresses of a checked backward call: Q, K, V, O, dO, dQ, dK, dV, the LSE, the
/// caller's workspace (address, bytes) if any, device prefix sums (q, k, entries) if any.
struct BackwardAddrs {
    tensors: [u64; 8],
    lse: u64,
    workspace: Option<(u64, usize)>,
    device_seqlens: Option<(u64, u64, usize)>,
}

/// Queues a checked backward for element type `T` on `stream`: host prefix sums copied on
/// `stream`, the workspace the caller's or allocated on `stream` (both freed in stream
/// order after the kernels).
///
/// # Safety
/// The addresses of `addrs` must satisfy [`RawTensor::from_raw`] for the plan's lengths, as
/// [`fa_backward_cuda`] states; `stream` a stream of the device's context kept alive.
unsafe fn launch_backward<T: CudaElement>(
    device: &Device,
    plan: &BackwardPlan,
    problem: &Problem,
    addrs: &BackwardAddrs,
    stream: sys::CUstream,
) -> Result<(), Failure> {
    use cudarc::driver::DevicePtr;
    let lens = plan.buffer_lens();
    let [q, k, v, o, d_o, dq, dk, dv] = addrs.tensors;
    // SAFETY: the caller's contract.
    let stream = unsafe { device.borrow_stream(stream) };
    let cuda_failure = |what: &str, e: cudarc::driver::DriverError| Failure {
        code: FA_ERR_CUDA,
        message: format!("{what} failed: {e:?}"),
    };
    // Host prefix sums go up on the stream (freed in stream order when dropped below).
    let host_cu = match problem.sequences() {
        softmax_core::Sequences::Varlen {
            cu_seqlens_q,
            cu_seqlens_k,
        } => {
            let up = |x: &[u32]| {
                stream
                    .clone_htod(x)
                    .map_err(|e| cuda_failure("copying the prefix sums", e))
            };
            Some((up(cu_seqlens_q)?, up(cu_seqlens_k)?))
        }
        _ => None,
    };
    let host_guards = host_cu
        .as_ref()
        .map(|(q, k)| (q.device_ptr(&stream), k.device_ptr(&stream)));
    // No caller workspace: allocated on the stream with room to align its start.
    let align = plan.workspace().align as u64;
    let owned = match (addrs.workspace, plan.workspace_bytes()) {
        (Some(_), _) | (None, 0) => None,
        (None, bytes) => Some(
            stream
                .alloc_zeros::<u8>(bytes + align as usize)
                .map_err(|e| cuda_failure("allocating the backward workspace", e))?,
        ),
    };
    let ws_guard = owned.as_ref().map(|s| s.device_ptr(&stream));
    // SAFETY: the caller's contract (fa_backward_cuda's) for the caller's addresses; the
    // library's own allocations are live allocations of this context of the stated lengths,
    // kept until the kernels have been queued and then freed in stream order.
    let tensors = unsafe {
        BackwardTensors {
            qkv: Qkv::new(
                raw::<T>(q, lens.q),
                raw::<T>(k, lens.k),
                raw::<T>(v, lens.v),
            ),
            o: raw::<T>(o, lens.o),
            d_o: raw::<T>(d_o, lens.o),
            lse: Some(raw::<f32>(addrs.lse, plan.lse_len())),
            grads: Grads::new(
                raw::<T>(dq, lens.q),
                raw::<T>(dk, lens.k),
                raw::<T>(dv, lens.v),
            ),
            cu_seqlens: match (addrs.device_seqlens, &host_guards, &host_cu) {
                (Some((q, k, n)), _, _) => Some(CuSeqlens {
                    q: raw::<i32>(q, n),
                    k: raw::<i32>(k, n),
                }),
                (None, Some((gq, gk)), Some((sq, sk))) => Some(CuSeqlens {
                    q: raw::<i32>(gq.0, sq.len()),
                    k: raw::<i32>(gk.0, sk.len()),
                }),
                _ => None,
            },
        }
    };
    // SAFETY: as above; the owned allocation is `bytes + align` long, so its start rounded
    // up to `align` leaves `bytes` in it.
    let workspace = unsafe {
        match (addrs.workspace, &ws_guard, &owned) {
            (Some((p, bytes)), _, _) => raw::<u8>(p, bytes),
            (None, Some(g), Some(s)) => {
                let start = g.0.next_multiple_of(align);
                raw::<u8>(start, s.len() - (start - g.0) as usize)
            }
            _ => raw::<u8>(0, 0),
        }
    };
    let result = device.backward_on_stream(plan, tensors, workspace, &stream);
    drop(ws_guard);
    drop(owned);
    drop(host_guards);
    drop(host_cu);
    result?;
    Ok(())
}

/// Gradients of a loss with respect to Q, K and V (the backward of [`fa_forward_cuda`]) on
/// device memory the caller owns, queued on the caller's `stream` (a `CUstream`/`cudaStream_t`
/// of the device's context; null: the legacy default stream) without waiting: order later
/// work after `stream` before reading `dq`/`dk`/`dv` or freeing anything. Exact, recomputing
/// the probabilities from the forward's `lse` (no N×N storage); GQA/MQA: `dk`/`dv` summed
/// over each KV head's group of query heads (in a fixed order: deterministic); `dq` is summed
/// with f32 atomics, so it may differ from run to run by rounding.
///
/// `problem` is the forward's (fixed-length, or varlen with host prefix sums, copied on
/// `stream`, or device ones, `FA_SEQLENS_VARLEN_DEVICE`; mask, window, scale and softcap as
/// given to the forward). Inputs: `q`, `k`, `v`, the forward's output `o`, `d_o` = ∂L/∂O
/// (laid out as `o`: the same strides) and `lse`, the forward's natural-log LSE as
/// `fa_forward_cuda` wrote it (device f32, `[batch, heads_q, seqlen_q]` dense or
/// `[heads_q, total_q]` packed; required). Outputs: `dq`, `dk`, `dv`, laid out as `q`, `k`
/// and `v`. All eight tensors share one dtype, bf16 or f16 (the gradients come out in it).
///
/// The workspace: `workspace` (device memory, 256-byte aligned, at least
/// `fa_backward_cuda_workspace_bytes` bytes, given in `workspace_bytes`; its contents need
/// not be initialised; not used by other work until `stream` has passed the call) or, when
/// `workspace` is null, allocated by the library on `stream` and freed in stream order after
/// the kernels. Everything is checked before anything is queued, the gradients untouched on
/// an error code: null, alignment (16 bytes for tensors, 4 for the LSE and prefix sums, 256
/// for the workspace), overflow, strides that differ from their input's
/// (`FA_ERR_INVALID_ARGUMENT`), gradients or workspace that overlap any other buffer, a
/// workspace too small; dtypes or problems the kernel lacks are `FA_ERR_UNSUPPORTED`. The
/// options' CPU fields are ignored. Since API version 7.
///
/// # Safety
/// `device` must be a live handle; the descriptors as in `fa_forward_cuda`; every `data`,
/// `lse`, device prefix-sum pointer and a non-null `workspace` must be device memory usable
/// in the device's context holding what the problem reaches (`d_o` as `o`, each gradient as
/// its input), which stays allocated and is not written by other work (inputs) or touched at
/// all (outputs, workspace) until `stream` has passed the kernels; device prefix sums must be
/// the forward's; `stream` must stay alive meanwhile.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fa_backward_cuda(
    device: *const FaCudaDevice,
    problem: *const FaProblem,
    q: *const FaTensor,
    k: *const FaTensor,
    v: *const FaTensor,
    o: *const FaTensor,
    lse: *const f32,
    d_o: *const FaTensor,
    dq: *const FaTensor,
    dk: *const FaTensor,
    dv: *const FaTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    stream: *mut c_void,
    options: *const FaOptions,
) -> i32 {
    guard(|| {
        // SAFETY: this function's contract.
        let device = &unsafe { device_ref(device) }?.device;
        // SAFETY: as above.
        let call =
            unsafe { BackwardCall::read(problem, [q, k, v, o], Some([d_o, dq, dk, dv]), options) }?;
        let problem = call.problem()?;
        let plan = device.plan_backward(&problem, call.dtype, &BackwardOptions::default())?;
        if lse.is_null() {
            return Err(Failure::invalid(
                "lse is a null pointer: the backward needs the forward's LSE",
            ));
        }
        let lens = plan.buffer_lens();
        let names = ["q", "k", "v", "o", "d_o", "dq", "dk", "dv"];
        let descs = [
            call.call.tensors[0],
            call.call.tensors[1],
            call.call.tensors[2],
            call.call.tensors[3],
            call.grads[0],
            call.grads[1],
            call.grads[2],
            call.grads[3],
        ];
        let elems = [
            lens.q, lens.k, lens.v, lens.o, lens.o, lens.q, lens.k, lens.v,
        ];
        // Spans (null, element alignment, overflow), then the device's 16 bytes; outputs
        // must overlap nothing (the kernels would race).
        let mut spans = Vec::with_capacity(10);
        for i in 0..8 {
            let addr = descs[i].data as usize;
            let span = host_span(names[i], addr, elems[i], call.dtype.size())?;
            if elems[i] > 0 && !addr.is_multiple_of(16) {
                return Err(Failure::invalid(format!(
                    "{} is at {addr:#x}: device tensors must be 16-byte aligned",
                    names[i]
                )));
            }
            spans.push((names[i], span, i >= 5));
        }
        spans.push((
            "lse",
            host_span("lse", lse as usize, plan.lse_len(), 4)?,
            false,
        ));
        let needed = plan.workspace_bytes();
        let workspace =
            (!workspace.is_null()).then_some((workspace as usize as u64, workspace_bytes));
        if let Some((p, bytes)) = workspace {
            if bytes < needed {
                return Err(Failure::invalid(format!(
                    "workspace_bytes is {bytes}: the call needs {needed} \
                     (fa_backward_cuda_workspace_bytes)"
                )));
            }
            let align = plan.workspace().align as u64;
            if !p.is_multiple_of(align) {
                return Err(Failure::invalid(format!(
                    "workspace is at {p:#x}: it must be {align}-byte aligned"
                )));
            }
            spans.push((
                "workspace",
                host_span("workspace", p as usize, bytes, 1)?,
                true,
            ));
        }
        check_disjoint(&spans)?;
        let addrs = BackwardAddrs {
            tensors: descs.map(|t| t.data as usize as u64),
            lse: lse as usize as u64,
            workspace,
            device_seqlens: match call.seqlens {
                Seqlens::Device { q, k, entries } => Some((q, k, entries)),
                _ => None,
            },
        };
        let stream = stream as sys::CUstream;
        // SAFETY: the addresses and the stream follow this function's contract.
        unsafe {
            match call.dtype {
                DType::Bf16 => launch_backward::<bf16>(device, &plan, &problem, &addrs, stream),
                _ => launch_backward::<f16>(device, &plan, &problem, &addrs, stream),
            }
        }
    })
}
