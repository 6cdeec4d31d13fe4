//! The native half of the Python package `flash_attention_rs` (module
//! `flash_attention_rs._native`): `forward` (and `append_kv`, new tokens into a KV cache in
//! place; `block_walk`, a paged cache's block walk built on the host) and `backward`, which
//! take what the Python shim gathered from NumPy arrays or PyTorch tensors (address, shape,
//! element strides, dtype name).
//!
//! On the CPU, `backward` and `forward` without a KV cache call Rust directly (issue 49's
//! direction): they build a `softmax_core::ProblemDesc`, validate it, and run the facade's
//! host entries (`flash_attention::host::{forward, backward}`, whose span and overlap checks
//! the C ABI runs too) with the GIL released. The rest still runs through the C ABI
//! (`fa-capi`): `fa_forward_cache_cpu` and `fa_append_kv_cpu` on host memory with the GIL
//! released, `fa_forward_cuda` (and the cache/append entries) on the tensors' device memory,
//! queued on the caller's stream.
//!
//! Validation is never written here: the problem is softmax-core's (`ProblemDesc::validate`,
//! `with_flash_args`), the host buffers' spans, alignment and overlap are the facade's
//! (`flash_attention::host`, which the C ABI calls as well), and the C ABI's own checks
//! apply on its paths. This crate adds only what a C caller states and a Python caller does
//! not: that the tensors' shapes agree with each other, that the last dimension is
//! contiguous, and that the prefix sums end where the packed tensors do. Library errors keep
//! their message and become `ValueError` (invalid or unsupported input) or `RuntimeError` (no
//! device, a CUDA fault).
//!
//! On CUDA, `backward` calls fa-cuda directly too (`Device::plan_backward` →
//! `backward_on_stream` on the tensors' device memory and PyTorch's current stream, through
//! the device handle the forward opened); the CUDA forward still goes through the C ABI.

use fa_capi::{
    fa_append_kv_cpu, fa_append_kv_cuda, fa_block_walk, fa_cuda_device_create,
    fa_cuda_device_destroy, fa_forward_cache_cpu, fa_forward_cache_cuda, fa_forward_cpu,
    fa_forward_cuda, fa_last_error_message, FaCudaDevice, FaKvCache, FaOptions, FaProblem,
    FaTensor, FA_DTYPE_BF16, FA_DTYPE_F16, FA_DTYPE_F32, FA_ERR_INVALID_ARGUMENT,
    FA_ERR_UNSUPPORTED, FA_ERR_VERSION, FA_OK, FA_SEQLENS_VARLEN_DEVICE, FA_SEQLENS_VARLEN_HOST,
};
use flash_attention::host::{HostBackward, HostForward, HostTensor};
use flash_attention::{DType, Options, Problem, ProblemDesc};
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use softmax_core::{Sequences, Strides, Tensor, MAX_HEAD_DIM};
use std::ffi::{c_void, CStr};

/// A tensor as the shim describes it: data address, shape, strides in elements, dtype name.
type TensorArg = (u64, Vec<i64>, Vec<i64>, String);

/// A KV cache: `seqused_k` (int32 `(batch,)`), the block table (int32 `(batch, max_blocks)`;
/// `None`: a padded cache), a forced split count (0: the library's choice) and the paged
/// cache's block walk (int32 `(batch, 2, max_blocks)` on the device; `None`: none).
type CacheArg = (TensorArg, Option<TensorArg>, u32, Option<TensorArg>);

/// Device prefix sums: addresses of `cu_seqlens_q` and `cu_seqlens_k` (int32, `batch + 1`
/// entries each), `batch`, `max_seqlen_q`, `max_seqlen_k`.
type DeviceSeqlensArg = (u64, u64, i64, i64, i64);

fn value_error(message: impl Into<String>) -> PyErr {
    PyValueError::new_err(message.into())
}

/// The library's code and message after a failed C call, as a Python exception.
fn library_error(code: i32, message: String) -> PyErr {
    match code {
        FA_ERR_INVALID_ARGUMENT | FA_ERR_UNSUPPORTED | FA_ERR_VERSION => {
            PyValueError::new_err(message)
        }
        _ => PyRuntimeError::new_err(message),
    }
}

/// Runs one C entry point and, on failure, reads its thread-local message on the same thread.
fn call_c(entry: impl FnOnce() -> i32) -> Result<(), (i32, String)> {
    let code = entry();
    if code == FA_OK {
        return Ok(());
    }
    // SAFETY: the library returns a NUL-terminated string, never null, valid until the next
    // call into it on this thread; it is copied out at once.
    let message = unsafe { CStr::from_ptr(fa_last_error_message()) }
        .to_string_lossy()
        .into_owned();
    Err((code, message))
}

fn dtype_code(dtype: &str, name: &str) -> PyResult<u32> {
    match dtype {
        "float32" => Ok(FA_DTYPE_F32),
        "bfloat16" => Ok(FA_DTYPE_BF16),
        "float16" => Ok(FA_DTYPE_F16),
        other => Err(value_error(format!(
            "{name} has dtype {other}: flash_attention_rs takes float32, bfloat16 or float16"
        ))),
    }
}

/// A checked tensor argument: its dims as `[batch, seqlen, heads, dim]` (varlen: batch 1,
/// seqlen = total tokens), its strides `(batch, seq, head)` in elements (never negative; 0
/// where a dimension is not stepped over), its dtype, and its C descriptor.
struct Checked {
    dims: [i64; 4],
    strides: [i64; 3],
    dtype: DType,
    tensor: FaTensor,
}

impl Checked {
    /// The tensor as the facade's host buffer (address and dtype).
    fn host(&self) -> HostTensor {
        HostTensor {
            addr: self.tensor.data as usize,
            dtype: self.dtype,
        }
    }

    /// The strides as softmax-core's (checked non-negative by `check_tensor`).
    fn core_strides(&self) -> Strides {
        let [batch, seq, head] = self.strides.map(|s| s as usize);
        Strides { batch, seq, head }
    }
}

fn shape_text(shape: &[i64]) -> String {
    let parts: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("({})", parts.join(", "))
}

/// Checks rank, sizes, strides and dtype of one tensor and builds its descriptor.
fn check_tensor(arg: &TensorArg, name: &str, varlen: bool) -> PyResult<Checked> {
    let (addr, shape, strides, dtype) = arg;
    let (rank, layout) = if varlen {
        (3, "(total_tokens, heads, head_dim)")
    } else {
        (4, "(batch, seqlen, heads, head_dim)")
    };
    if shape.len() != rank || strides.len() != rank {
        return Err(value_error(format!(
            "{name} has shape {}: expected {rank} dimensions {layout}",
            shape_text(shape)
        )));
    }
    if let Some(d) = shape.iter().find(|&&d| d < 0) {
        return Err(value_error(format!("{name} has a negative size {d}")));
    }
    // An empty tensor holds no element, so its strides mean nothing: NumPy gives it all-zero
    // strides, PyTorch the contiguous ones. Both are described by the contiguous ones, so an
    // empty NumPy array meets the same rules (the library's) as an empty tensor.
    let strides: Vec<i64> = if shape.contains(&0) {
        let mut dense = 1i64;
        let mut out = vec![0; rank];
        for (o, &n) in out.iter_mut().zip(shape).rev() {
            *o = dense;
            dense = dense.saturating_mul(n.max(1));
        }
        out
    } else {
        strides.clone()
    };
    // A dimension of size 1 (or 0) is never stepped over: any stride there means nothing
    // (NumPy and PyTorch leave arbitrary, even negative, values in them).
    let strides: Vec<i64> = shape
        .iter()
        .zip(&strides)
        .map(|(&n, &s)| if n <= 1 { 0 } else { s })
        .collect();
    if strides.iter().any(|&s| s < 0) {
        return Err(value_error(format!(
            "{name} has negative strides {}: reversed views are not supported",
            shape_text(&strides)
        )));
    }
    // Stride 0 (a broadcast head_dim) would make the library read past the array.
    if shape[rank - 1] > 1 && strides[rank - 1] != 1 {
        return Err(value_error(format!(
            "{name} has strides {}: the last dimension (head_dim) must be contiguous (stride 1)",
            shape_text(&strides)
        )));
    }
    let dims = if varlen {
        [1, shape[0], shape[1], shape[2]]
    } else {
        [shape[0], shape[1], shape[2], shape[3]]
    };
    let (stride_batch, stride_seq, stride_head) = if varlen {
        (0, strides[0], strides[1])
    } else {
        (strides[0], strides[1], strides[2])
    };
    let code = dtype_code(dtype, name)?;
    Ok(Checked {
        dims,
        strides: [stride_batch, stride_seq, stride_head],
        dtype: match code {
            FA_DTYPE_BF16 => DType::Bf16,
            FA_DTYPE_F16 => DType::F16,
            _ => DType::F32,
        },
        tensor: FaTensor {
            data: *addr as usize as *mut c_void,
            dtype: code,
            stride_batch,
            stride_seq,
            stride_head,
        },
    })
}

/// Checks attention sinks (or their gradient, `name` says which): a contiguous float32 vector
/// of `heads_q` entries, one per query head, in host memory (the library checks the address:
/// null, alignment); returns its address.
fn check_sinks(arg: &TensorArg, name: &str, heads_q: i64) -> PyResult<usize> {
    let (addr, shape, strides, dtype) = arg;
    if shape.as_slice() != [heads_q] {
        return Err(value_error(format!(
            "{name} has shape {}: expected ({heads_q},), one per query head",
            shape_text(shape)
        )));
    }
    if dtype != "float32" {
        return Err(value_error(format!(
            "{name} has dtype {dtype}: attention sinks are float32"
        )));
    }
    if heads_q > 1 && strides.first() != Some(&1) {
        return Err(value_error(format!(
            "{name} has strides {}: it must be contiguous",
            shape_text(strides)
        )));
    }
    Ok(*addr as usize)
}

/// The shapes of Q, K, V and O must describe one problem (the C ABI takes each size once).
/// With a paged cache, K/V's leading dimensions are blocks, not sequences.
fn check_shapes(
    q: &[i64; 4],
    k: &[i64; 4],
    v: &[i64; 4],
    o: &[i64; 4],
    paged: bool,
) -> PyResult<()> {
    let text = |d: &[i64; 4]| shape_text(d);
    if k[..3] != v[..3] {
        return Err(value_error(format!(
            "k {} and v {} differ in batch, seqlen or heads",
            text(k),
            text(v)
        )));
    }
    if !paged && q[0] != k[0] {
        return Err(value_error(format!(
            "q has batch {} but k has batch {}",
            q[0], k[0]
        )));
    }
    if q[3] != k[3] {
        return Err(value_error(format!(
            "q has head_dim {} but k has head_dim {}",
            q[3], k[3]
        )));
    }
    let expected = [q[0], q[1], q[2], v[3]];
    if *o != expected {
        return Err(value_error(format!(
            "out has dims {} (as batch, seqlen, heads, head_dim) but q and v need {}",
            text(o),
            text(&expected)
        )));
    }
    Ok(())
}

/// One side of `window` as the C ABI's `i64`, passed as given (-1: unbounded; the library
/// validates the value); an integer outside `i64` is a `ValueError` naming `window`.
fn window_side(side: &Bound<'_, PyAny>) -> PyResult<i64> {
    side.extract::<i64>().map_err(|_| {
        value_error(format!(
            "window has a side {side}: not an integer within 64 bits (-1: unbounded)"
        ))
    })
}

/// A Python float as the C ABI's `f32`. A finite value that float32 cannot hold (it would
/// round to 0, which the C ABI reads as "not set", or to infinity) is a `ValueError`; NaN and
/// infinities pass unchanged, for the library to refuse with its own message.
fn to_f32(value: f64, name: &str) -> PyResult<f32> {
    let narrow = value as f32;
    if value.is_finite() && (!narrow.is_finite() || (narrow == 0.0 && value != 0.0)) {
        return Err(value_error(format!(
            "{name} = {value:?} is outside float32's range"
        )));
    }
    Ok(narrow)
}

/// Host prefix sums as int32, with the packed tensors' token count as their last entry.
fn host_prefix_sums(values: &[i64], total: i64, name: &str, tensor: &str) -> PyResult<Vec<i32>> {
    let out = values
        .iter()
        .map(|&x| i32::try_from(x))
        .collect::<Result<Vec<i32>, _>>()
        .map_err(|_| value_error(format!("{name} has a value outside int32")))?;
    match out.last() {
        None => Err(value_error(format!(
            "{name} is empty: it needs batch + 1 entries"
        ))),
        Some(&last) if i64::from(last) != total => Err(value_error(format!(
            "{name} ends at {last} but {tensor} holds {total} tokens"
        ))),
        Some(_) => Ok(out),
    }
}

/// Checks a cache table: int32, the expected shape, dense row-major; returns its address.
fn check_table(arg: &TensorArg, name: &str, expected: &[i64], layout: &str) -> PyResult<u64> {
    let (addr, shape, strides, dtype) = arg;
    if dtype != "int32" {
        return Err(value_error(format!(
            "{name} has dtype {dtype}: it must be int32"
        )));
    }
    if shape.as_slice() != expected {
        return Err(value_error(format!(
            "{name} has shape {}: expected {} {layout}",
            shape_text(shape),
            shape_text(expected)
        )));
    }
    // An empty table holds nothing to read: its strides mean nothing (NumPy gives empty
    // arrays zero strides).
    if shape.contains(&0) {
        return Ok(*addr);
    }
    let mut dense = 1;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n > 1 && s != dense {
            return Err(value_error(format!(
                "{name} has strides {}: it must be contiguous (row-major)",
                shape_text(strides)
            )));
        }
        dense *= n;
    }
    Ok(*addr)
}

/// The C descriptor of a KV cache of `batch` sequences whose K tensor has dims `k_dims`:
/// `seqused_k` `(batch,)` and, for a paged cache, the block table `(batch, max_blocks)` (then
/// K's leading dims are `(num_blocks, block_size)`) and optionally its block walk
/// `(batch, 2, max_blocks)`; tables int32, dense.
fn cache_desc(
    seqused_k: &TensorArg,
    block_table: Option<&TensorArg>,
    block_walk: Option<&TensorArg>,
    batch: i64,
    k_dims: &[i64; 4],
) -> PyResult<FaKvCache> {
    let used = check_table(seqused_k, "seqused_k", &[batch], "(batch,)")?;
    let mut desc = FaKvCache {
        seqused_k: used as usize as *const i32,
        ..FaKvCache::default()
    };
    if let Some(table) = block_table {
        if table.1.len() != 2 {
            return Err(value_error(format!(
                "block_table has shape {}: expected 2 dimensions (batch, max_blocks)",
                shape_text(&table.1)
            )));
        }
        let max_blocks = table.1[1];
        let addr = check_table(
            table,
            "block_table",
            &[batch, max_blocks],
            "(batch, max_blocks)",
        )?;
        desc.block_table = addr as usize as *const i32;
        desc.blocks_per_seq = max_blocks;
        desc.block_size = k_dims[1];
        desc.num_blocks = k_dims[0];
        if let Some(walk) = block_walk {
            let addr = check_table(
                walk,
                "block_walk",
                &[batch, 2, max_blocks],
                "(batch, 2, max_blocks)",
            )?;
            desc.block_walk = addr as usize as *const i32;
        }
    } else if block_walk.is_some() {
        return Err(value_error(
            "block_walk needs block_table: a padded cache has no blocks to walk",
        ));
    }
    Ok(desc)
}

/// A CUDA device handle of the C ABI: the primary context of one ordinal (PyTorch's).
struct DeviceHandle(*mut FaCudaDevice);

// SAFETY: the handle owns a `fa_cuda::Device` (asserted Send + Sync below) and nothing else;
// the pointer is only passed back to the library that made it.
unsafe impl Send for DeviceHandle {}
// SAFETY: as above; the library takes the handle as `*const` and synchronises inside.
unsafe impl Sync for DeviceHandle {}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<fa_cuda::Device>();
};

impl Drop for DeviceHandle {
    fn drop(&mut self) {
        // SAFETY: a live handle from fa_cuda_device_create, destroyed once, here.
        unsafe { fa_cuda_device_destroy(self.0) };
    }
}

/// The library's handle on CUDA device `ordinal` in its primary context (the one PyTorch
/// uses). Opening it fails with `RuntimeError` (the library's message) where CUDA is not
/// usable: no driver, no NVRTC, no such device.
#[pyclass(frozen, module = "flash_attention_rs._native")]
struct CudaDevice {
    handle: DeviceHandle,
    ordinal: i32,
}

#[pymethods]
impl CudaDevice {
    #[new]
    fn new(py: Python<'_>, ordinal: i32) -> PyResult<CudaDevice> {
        let handle = py
            .detach(|| {
                let mut raw: *mut FaCudaDevice = core::ptr::null_mut();
                // SAFETY: `raw` is a writable out-parameter.
                call_c(|| unsafe { fa_cuda_device_create(ordinal, &mut raw) })
                    .map(|()| DeviceHandle(raw))
            })
            .map_err(|(code, message)| library_error(code, message))?;
        Ok(CudaDevice { handle, ordinal })
    }

    /// The CUDA ordinal this handle was opened on.
    #[getter]
    fn ordinal(&self) -> i32 {
        self.ordinal
    }

    fn __repr__(&self) -> String {
        format!("CudaDevice({})", self.ordinal)
    }
}

/// Everything one C call takes, plain data only, so that it can run with the GIL released.
struct Call {
    problem: FaProblem,
    tensors: [FaTensor; 4],
    lse: *mut f32,
    /// Attention sinks (`heads_q` f32s) or null.
    sinks: *const f32,
    /// The KV cache the keys are read from (its tables are the caller's arrays).
    cache: Option<FaKvCache>,
    /// Host prefix sums `problem.cu_seqlens_*` point into (kept alive by the call).
    _host_seqlens: Option<(Vec<i32>, Vec<i32>)>,
}

// SAFETY: the addresses in `Call` point to memory the Python caller keeps alive (the arguments
// of `attention`, referenced for the whole call) or to the vectors `Call` owns; nothing is
// shared with another thread while the call runs.
unsafe impl Send for Call {}

impl Call {
    /// The options: the defaults and the call's attention sinks.
    fn options(&self) -> FaOptions {
        FaOptions {
            sinks: self.sinks,
            ..FaOptions::default()
        }
    }

    fn run_cpu(&self) -> i32 {
        let options = self.options();
        let [q, k, v, o] = &self.tensors;
        // SAFETY: every address comes from a live NumPy array or CPU tensor whose shape and
        // strides the descriptors state (checked against each other above), so the memory
        // covers what the problem reaches; the library checks null, alignment, overflow and
        // overlap itself. A cache's tables are int32 host arrays of the checked shapes.
        unsafe {
            match &self.cache {
                None => fa_forward_cpu(&self.problem, q, k, v, o, self.lse, &options),
                Some(cache) => {
                    fa_forward_cache_cpu(&self.problem, cache, q, k, v, o, self.lse, &options)
                }
            }
        }
    }

    fn run_cuda(&self, device: &CudaDevice, stream: u64) -> i32 {
        let options = self.options();
        let [q, k, v, o] = &self.tensors;
        if let Some(cache) = &self.cache {
            // SAFETY: as in the plain call below; the cache's tables are int32 tensors of the
            // checked shapes on the same device, and the split workspace is allocated by the
            // library on the stream (freed in stream order).
            return unsafe {
                fa_forward_cache_cuda(
                    device.handle.0,
                    &self.problem,
                    cache,
                    q,
                    k,
                    v,
                    o,
                    self.lse,
                    core::ptr::null_mut(),
                    0,
                    stream as usize as *mut c_void,
                    &options,
                )
            };
        }
        // SAFETY: as in run_cpu, for device memory of the handle's device (the shim passes only
        // tensors on that device); PyTorch keeps the stream alive and orders later uses and
        // frees of these tensors after its work, as for its own kernels.
        unsafe {
            fa_forward_cuda(
                device.handle.0,
                &self.problem,
                q,
                k,
                v,
                o,
                self.lse,
                stream as usize as *mut c_void,
                &options,
            )
        }
    }
}

/// The mask and score options as the C ABI and softmax-core's `with_flash_args` take them.
#[derive(Clone, Copy)]
struct FlashArgs {
    /// `(left, right)`, -1: unbounded (the library validates the values).
    window: (i64, i64),
    /// `None`: `1/sqrt(head_dim)`.
    scale: Option<f32>,
    /// 0: none.
    softcap: f32,
}

/// Reads `window`, `scale` and `softcap` as the forward and the backward take them.
fn flash_args(
    window: Option<&(Bound<'_, PyAny>, Bound<'_, PyAny>)>,
    scale: Option<f64>,
    softcap: Option<f64>,
) -> PyResult<FlashArgs> {
    let window = match window {
        None => (-1, -1),
        Some((left, right)) => (window_side(left)?, window_side(right)?),
    };
    // The C ABI reads 0 as "not set"; an explicit 0 would silently become the default.
    if scale == Some(0.0) {
        return Err(value_error(
            "scale=0.0 is not supported (every key would weigh the same); pass None for 1/sqrt(head_dim)",
        ));
    }
    let scale = scale.map(|s| to_f32(s, "scale")).transpose()?;
    // softcap 0 (or None) is off, FlashAttention's convention; any other value goes to the
    // library, which refuses negative, NaN and infinite caps.
    let softcap = match softcap {
        Some(c) if c != 0.0 => to_f32(c, "softcap")?,
        _ => 0.0,
    };
    Ok(FlashArgs {
        window,
        scale,
        softcap,
    })
}

/// Checks an LSE argument: float32, of the `expected` shape, contiguous; returns its address.
fn check_lse(arg: &TensorArg, expected: &[i64]) -> PyResult<u64> {
    let (addr, shape, strides, dtype) = arg;
    if shape.as_slice() != expected || dtype != "float32" {
        return Err(value_error(format!(
            "lse must be float32 of shape {}, got {dtype} {}",
            shape_text(expected),
            shape_text(shape)
        )));
    }
    // An empty lse holds nothing: its strides mean nothing (torch's are not the product of
    // the sizes after a 0, NumPy's are all zero).
    let mut dense = 1;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n > 1 && s != dense && !shape.contains(&0) {
            return Err(value_error("lse must be a contiguous array"));
        }
        dense *= n;
    }
    Ok(*addr)
}

/// A facade error as a Python exception: invalid or unsupported input is `ValueError`,
/// anything else (no device, a CUDA fault) `RuntimeError`.
fn facade_error(e: flash_attention::Error) -> PyErr {
    match e {
        flash_attention::Error::Problem(_) | flash_attention::Error::InvalidArgument(_) => {
            PyValueError::new_err(e.to_string())
        }
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

/// A CPU problem as plain data (so that it crosses into the GIL-free closure), described and
/// validated by softmax-core itself: no C structs on this path.
struct HostProblem {
    /// Q's dims `[batch, seqlen_q, heads_q, head_dim]` (varlen: batch 1, total tokens).
    q: [i64; 4],
    /// K's seqlen (or total tokens) and heads, V's head dim.
    seqlen_k: i64,
    heads_kv: i64,
    head_dim_v: i64,
    /// Q, K, V, O strides.
    strides: [Strides; 4],
    causal: bool,
    args: FlashArgs,
    /// Host prefix sums (varlen).
    seqlens: Option<(Vec<u32>, Vec<u32>)>,
    /// The address of the attention sinks (`heads_q` f32s), if any.
    sinks: Option<usize>,
}

impl HostProblem {
    /// The problem of checked Q, K, V, O tensors (their shapes agree: `check_shapes`).
    fn new(
        [q, k, v, o]: [&Checked; 4],
        causal: bool,
        args: FlashArgs,
        seqlens: Option<(Vec<i32>, Vec<i32>)>,
        sinks: Option<usize>,
    ) -> PyResult<HostProblem> {
        let unsigned = |values: Vec<i32>, name: &str| -> PyResult<Vec<u32>> {
            values
                .into_iter()
                .map(|x| {
                    u32::try_from(x)
                        .map_err(|_| value_error(format!("{name} has a negative entry {x}")))
                })
                .collect()
        };
        let seqlens = match seqlens {
            Some((cu_q, cu_k)) => Some((
                unsigned(cu_q, "cu_seqlens_q")?,
                unsigned(cu_k, "cu_seqlens_k")?,
            )),
            None => None,
        };
        Ok(HostProblem {
            q: q.dims,
            seqlen_k: k.dims[1],
            heads_kv: k.dims[2],
            head_dim_v: v.dims[3],
            strides: [q, k, v, o].map(Checked::core_strides),
            causal,
            args,
            seqlens,
            sinks,
        })
    }

    /// `ProblemDesc` → `validate`: softmax-core's checks, with the facade's size check first.
    fn validate(&self) -> Result<Problem<'_>, flash_attention::Error> {
        let size = |x: i64| x as usize; // checked non-negative by check_tensor
        let [batch, seqlen_q, heads_q, head_dim] = self.q.map(size);
        let mut desc = ProblemDesc::new(
            batch,
            seqlen_q,
            size(self.seqlen_k),
            heads_q,
            size(self.heads_kv),
            head_dim,
        )
        .head_dim_v(size(self.head_dim_v));
        if let Some((cu_q, cu_k)) = &self.seqlens {
            desc.sequences = Sequences::Varlen {
                cu_seqlens_q: cu_q,
                cu_seqlens_k: cu_k,
            };
        }
        flash_attention::host::check_sizes(&desc)?;
        let (left, right) = self.args.window;
        desc = desc.with_flash_args(self.causal, left, right, self.args.softcap)?;
        desc.softmax_scale = self.args.scale;
        for (tensor, strides) in [Tensor::Q, Tensor::K, Tensor::V, Tensor::O]
            .into_iter()
            .zip(self.strides)
        {
            desc = desc.strides(tensor, strides);
        }
        if let Some(addr) = self.sinks {
            flash_attention::host::span("sinks", addr, heads_q, 4)?;
            // SAFETY: the span passed for `heads_q` f32s; the address comes from a live
            // float32 array of that shape (check_sinks) that the caller keeps alive and
            // unwritten for the call.
            desc.sinks = Some(unsafe { flash_attention::host::slice_ref::<f32>(addr, heads_q) });
        }
        Ok(desc.validate(MAX_HEAD_DIM)?)
    }
}

/// Exact attention forward: `o = softmax(q·kᵀ·scale)·v` (and the log-sum-exp into `lse`).
///
/// Tensors are `(address, shape, element strides, dtype)`: BSHD `(batch, seqlen, heads,
/// head_dim)`, or `(total_tokens, heads, head_dim)` with prefix sums (varlen). `lse` is a
/// float32 tensor of shape `(batch, heads_q, seqlen_q)` (varlen: `(heads_q, total_q)`).
/// Without `device` it runs on the CPU with the GIL released; with one, it is queued on
/// `stream` (a `cudaStream_t` of that device, 0: the legacy default stream) and returns
/// without waiting. Host prefix sums go in `cu_seqlens`, device ones in `device_cu_seqlens`.
/// `cache = (seqused_k, block_table or None, num_splits, block_walk or None)` reads K/V from a
/// KV cache: `k`/`v` are the padded cache `(batch, capacity, heads_kv, head_dim)` or, with a
/// block table `(batch, max_blocks)`, the paged cache `(num_blocks, block_size, heads_kv,
/// head_dim)`; the tables are int32, host arrays on the CPU and device tensors on CUDA; a
/// paged cache's block walk `(batch, 2, max_blocks)` is a device tensor (CUDA only: the CPU
/// refuses one). `sinks` (float32 `(heads_q,)`, host memory) adds attention sinks: one logit per
/// query head in every row's softmax denominator (the CPU paths; CUDA answers unsupported).
#[pyfunction]
#[pyo3(signature = (q, k, v, o, lse=None, *, causal=false, window=None, softcap=None,
    scale=None, cu_seqlens=None, device_cu_seqlens=None, cache=None, sinks=None, device=None,
    stream=0))]
#[allow(clippy::too_many_arguments)]
fn forward(
    py: Python<'_>,
    q: TensorArg,
    k: TensorArg,
    v: TensorArg,
    o: TensorArg,
    lse: Option<TensorArg>,
    causal: bool,
    window: Option<(Bound<'_, PyAny>, Bound<'_, PyAny>)>,
    softcap: Option<f64>,
    scale: Option<f64>,
    cu_seqlens: Option<(Vec<i64>, Vec<i64>)>,
    device_cu_seqlens: Option<DeviceSeqlensArg>,
    cache: Option<CacheArg>,
    sinks: Option<TensorArg>,
    device: Option<PyRef<'_, CudaDevice>>,
    stream: u64,
) -> PyResult<()> {
    if cu_seqlens.is_some() && device_cu_seqlens.is_some() {
        return Err(value_error(
            "give prefix sums on the host or on the device, not both",
        ));
    }
    let varlen = cu_seqlens.is_some() || device_cu_seqlens.is_some();
    if varlen && cache.is_some() {
        return Err(value_error(
            "a KV cache (seqused_k) takes a fixed-length batch of queries: no cu_seqlens",
        ));
    }
    let [cq, ck, cv, co] = [(&q, "q"), (&k, "k"), (&v, "v"), (&o, "out")]
        .map(|(t, name)| check_tensor(t, name, varlen));
    let (cq, ck, cv, co) = (cq?, ck?, cv?, co?);
    let paged = matches!(cache, Some((_, Some(_), _, _)));
    check_shapes(&cq.dims, &ck.dims, &cv.dims, &co.dims, paged)?;
    let [batch, seqlen_q, heads_q, head_dim] = cq.dims;
    let (seqlen_k, heads_kv, head_dim_v) = (ck.dims[1], ck.dims[2], cv.dims[3]);
    let sinks = match &sinks {
        Some(arg) => Some(check_sinks(arg, "sinks", heads_q)?),
        None => None,
    };
    let args = flash_args(window.as_ref(), scale, softcap)?;
    let FlashArgs {
        window,
        scale,
        softcap,
    } = args;
    let mut problem = FaProblem {
        head_dim_v,
        causal: u32::from(causal),
        window_left: window.0,
        window_right: window.1,
        softmax_scale: scale.unwrap_or(0.0),
        softcap,
        ..FaProblem::dense(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
    };
    let host_seqlens = match cu_seqlens {
        Some((cu_q, cu_k)) => {
            if cu_q.len() != cu_k.len() {
                return Err(value_error(format!(
                    "cu_seqlens_q has {} entries but cu_seqlens_k has {}",
                    cu_q.len(),
                    cu_k.len()
                )));
            }
            let cu_q = host_prefix_sums(&cu_q, seqlen_q, "cu_seqlens_q", "q")?;
            let cu_k = host_prefix_sums(&cu_k, seqlen_k, "cu_seqlens_k", "k")?;
            problem.seqlens = FA_SEQLENS_VARLEN_HOST;
            problem.batch = cu_q.len() as i64 - 1;
            problem.cu_seqlens_q = cu_q.as_ptr();
            problem.cu_seqlens_k = cu_k.as_ptr();
            Some((cu_q, cu_k))
        }
        None => None,
    };
    if let Some((addr_q, addr_k, batch, max_q, max_k)) = device_cu_seqlens {
        problem.seqlens = FA_SEQLENS_VARLEN_DEVICE;
        problem.batch = batch;
        problem.cu_seqlens_q = addr_q as usize as *const i32;
        problem.cu_seqlens_k = addr_k as usize as *const i32;
        problem.total_q = seqlen_q;
        problem.total_k = seqlen_k;
        problem.max_seqlen_q = max_q;
        problem.max_seqlen_k = max_k;
    }
    let cache = match &cache {
        None => None,
        Some((seqused_k, block_table, num_splits, block_walk)) => {
            let desc = cache_desc(
                seqused_k,
                block_table.as_ref(),
                block_walk.as_ref(),
                cq.dims[0],
                &ck.dims,
            )?;
            if !desc.block_table.is_null() {
                // The paged cache has no capacity per sequence of its own.
                problem.seqlen_k = 0;
            }
            Some(FaKvCache {
                num_splits: *num_splits,
                ..desc
            })
        }
    };
    let lse = match &lse {
        None => core::ptr::null_mut(),
        Some(arg) => {
            let expected = if varlen {
                vec![heads_q, seqlen_q]
            } else {
                vec![problem.batch, heads_q, seqlen_q]
            };
            check_lse(arg, &expected)? as usize as *mut f32
        }
    };
    if device.is_none() && cache.is_none() {
        // The CPU forward calls Rust directly (issue 49): softmax-core describes and
        // validates the problem, the facade checks the buffers (the same code as the C
        // ABI's) and runs it, with the GIL released. KV caches and CUDA still go through the
        // C ABI below.
        let problem = HostProblem::new([&cq, &ck, &cv, &co], causal, args, host_seqlens, sinks)?;
        let buffers = HostForward {
            q: cq.host(),
            k: ck.host(),
            v: cv.host(),
            o: co.host(),
            lse: (!lse.is_null()).then_some(lse as usize),
        };
        return py
            .detach(move || -> Result<(), flash_attention::Error> {
                let problem = problem.validate()?;
                // SAFETY: every address comes from a live NumPy array or CPU tensor whose
                // shape and strides were checked against each other above, so the memory
                // covers what the problem reaches; the caller keeps them alive for the call
                // and writes none meanwhile. The facade checks null, alignment, overflow and
                // overlap before anything is written.
                unsafe { flash_attention::host::forward(&problem, &buffers, &Options::default()) }?;
                Ok(())
            })
            .map_err(facade_error);
    }
    let call = Call {
        problem,
        tensors: [cq.tensor, ck.tensor, cv.tensor, co.tensor],
        lse,
        sinks: sinks.map_or(core::ptr::null(), |a| a as *const f32),
        cache,
        _host_seqlens: host_seqlens,
    };
    let result = match device {
        None => py.detach(move || call_c(|| call.run_cpu())),
        Some(device) => {
            let device: &CudaDevice = &device;
            py.detach(move || call_c(|| call.run_cuda(device, stream)))
        }
    };
    result.map_err(|(code, message)| library_error(code, message))
}

/// A fa-cuda error as a Python exception: invalid or unsupported input is `ValueError`,
/// anything else (no device, a CUDA fault) `RuntimeError`.
fn cuda_error(e: fa_cuda::CudaError) -> PyErr {
    use fa_cuda::CudaError as C;
    match e {
        C::Problem(_)
        | C::ForeignBuffer
        | C::ForeignStream
        | C::NullPointer { .. }
        | C::Misaligned { .. }
        | C::WorkspaceTooSmall { .. }
        | C::BadWorkspace { .. }
        | C::UnsupportedArch { .. } => PyValueError::new_err(e.to_string()),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

/// Queues fa-cuda's backward for element type `T` on the caller's `stream` (no waiting):
/// host prefix sums of a packed problem copied on the stream, the workspace allocated on it
/// (both freed in stream order after the kernels), then `Device::backward_on_stream`, which
/// checks every address against the plan before it queues a kernel.
///
/// # Safety
/// `addrs` (Q, K, V, O, dO, dQ, dK, dV) and `lse` must be device memory of the device's
/// context holding what the plan's problem reaches, kept alive and otherwise untouched until
/// `stream` has passed the kernels; `stream` a live stream of that context (0: the legacy
/// default stream).
unsafe fn cuda_backward<T: fa_cuda::CudaElement>(
    device: &fa_cuda::Device,
    plan: &fa_cuda::BackwardPlan,
    problem: &Problem,
    addrs: [u64; 8],
    lse: u64,
    stream: u64,
) -> PyResult<()> {
    use cudarc::driver::DevicePtr;
    use fa_cuda::{BackwardTensors, CuSeqlens, RawTensor};
    use softmax_core::{Grads, Qkv};
    let driver = |what: &str, e: cudarc::driver::DriverError| {
        PyRuntimeError::new_err(format!("{what} failed: {e:?}"))
    };
    // SAFETY: the caller's contract: a live stream of the device's context.
    let stream = unsafe { device.borrow_stream(stream as usize as cudarc::driver::sys::CUstream) };
    let host_cu = match problem.sequences() {
        Sequences::Varlen {
            cu_seqlens_q,
            cu_seqlens_k,
        } => {
            let up = |x: &[u32]| {
                stream
                    .clone_htod(x)
                    .map_err(|e| driver("copying the prefix sums", e))
            };
            Some((up(cu_seqlens_q)?, up(cu_seqlens_k)?))
        }
        _ => None,
    };
    let cu_guards = host_cu
        .as_ref()
        .map(|(q, k)| (q.device_ptr(&stream), k.device_ptr(&stream)));
    let (bytes, align) = (plan.workspace_bytes(), plan.workspace().align);
    let owned = match bytes {
        0 => None,
        _ => Some(
            stream
                .alloc_zeros::<u8>(bytes + align)
                .map_err(|e| driver("allocating the backward workspace", e))?,
        ),
    };
    let ws_guard = owned.as_ref().map(|s| s.device_ptr(&stream));
    let lens = plan.buffer_lens();
    let [q, k, v, o, d_o, dq, dk, dv] = addrs;
    // SAFETY: the caller's contract for its addresses; the allocations above are live
    // allocations of this context of the stated lengths (the workspace's start rounded up
    // to its alignment inside its `bytes + align`), kept until the kernels are queued and
    // then freed in stream order.
    let (tensors, workspace) = unsafe {
        let t = |addr: u64, len: usize| RawTensor::<T>::from_raw(addr, len);
        let tensors = BackwardTensors {
            qkv: Qkv::new(t(q, lens.q), t(k, lens.k), t(v, lens.v)),
            o: t(o, lens.o),
            d_o: t(d_o, lens.o),
            lse: Some(RawTensor::<f32>::from_raw(lse, plan.lse_len())),
            grads: Grads::new(t(dq, lens.q), t(dk, lens.k), t(dv, lens.v)),
            cu_seqlens: match (&cu_guards, &host_cu) {
                (Some((gq, gk)), Some((sq, sk))) => Some(CuSeqlens {
                    q: RawTensor::from_raw(gq.0, sq.len()),
                    k: RawTensor::from_raw(gk.0, sk.len()),
                }),
                _ => None,
            },
        };
        let workspace = match (&ws_guard, &owned) {
            (Some(g), Some(s)) => {
                let start = g.0.next_multiple_of(align as u64);
                RawTensor::<u8>::from_raw(start, s.len() - (start - g.0) as usize)
            }
            _ => RawTensor::<u8>::from_raw(0, 0),
        };
        (tensors, workspace)
    };
    let result = device.backward_on_stream(plan, tensors, workspace, &stream);
    drop(ws_guard);
    drop(owned);
    drop(cu_guards);
    drop(host_cu);
    result.map(|_| ()).map_err(cuda_error)
}

/// Exact attention backward: `dq`, `dk`, `dv` receive the gradients of a loss with respect
/// to `q`, `k`, `v`, given the forward's `o` and `lse` and `d_o = ∂L/∂o` (GQA: `dk`/`dv`
/// summed over each KV head's group of query heads).
///
/// The tensors are as in [`forward`] (BSHD, or packed with host `cu_seqlens`); `d_o` must
/// have `o`'s shape and strides and each gradient its input's, `lse` is the forward's
/// (float32 `(batch, heads_q, seqlen_q)`, varlen `(heads_q, total_q)`, contiguous). The
/// options are the forward's. Python calls Rust directly here: the problem is built as a
/// `softmax_core::ProblemDesc` and validated by it, the buffers are checked by the facade
/// (`flash_attention::host`, the same code the C ABI runs) and the CPU backward runs with the
/// GIL released; nothing is written on error.
///
/// With `device` (a CUDA device handle) the tensors are that device's memory, all of one
/// dtype (bfloat16 or float16; the gradients come out in it), and the call runs fa-cuda's
/// backward directly (`Device::plan_backward` → `backward_on_stream`, no C structs) queued
/// on `stream` (a `cudaStream_t` of that device, 0: the legacy default stream) without
/// waiting; the workspace (and a packed problem's prefix sums, given on the host) are
/// allocated on the stream and freed in stream order. dQ is summed with f32 atomics: it may
/// differ from run to run by rounding (dK and dV do not).
///
/// `sinks` are the forward's attention sinks (float32 `(heads_q,)`, host memory); `d_sinks`
/// (the same shape), when given, receives their gradient (it needs `sinks`). CPU only for now:
/// with `device` they raise `NotImplementedError`.
#[pyfunction]
#[pyo3(signature = (q, k, v, o, lse, d_o, dq, dk, dv, *, causal=false, window=None,
    softcap=None, scale=None, cu_seqlens=None, sinks=None, d_sinks=None, device=None,
    stream=0))]
#[allow(clippy::too_many_arguments)]
fn backward(
    py: Python<'_>,
    q: TensorArg,
    k: TensorArg,
    v: TensorArg,
    o: TensorArg,
    lse: TensorArg,
    d_o: TensorArg,
    dq: TensorArg,
    dk: TensorArg,
    dv: TensorArg,
    causal: bool,
    window: Option<(Bound<'_, PyAny>, Bound<'_, PyAny>)>,
    softcap: Option<f64>,
    scale: Option<f64>,
    cu_seqlens: Option<(Vec<i64>, Vec<i64>)>,
    sinks: Option<TensorArg>,
    d_sinks: Option<TensorArg>,
    device: Option<PyRef<'_, CudaDevice>>,
    stream: u64,
) -> PyResult<()> {
    let varlen = cu_seqlens.is_some();
    let checked = [
        (&q, "q"),
        (&k, "k"),
        (&v, "v"),
        (&o, "out"),
        (&d_o, "d_out"),
        (&dq, "dq"),
        (&dk, "dk"),
        (&dv, "dv"),
    ]
    .map(|(t, name)| check_tensor(t, name, varlen));
    let [cq, ck, cv, co, cdo, cdq, cdk, cdv] = checked;
    let (cq, ck, cv, co, cdo, cdq, cdk, cdv) = (cq?, ck?, cv?, co?, cdo?, cdq?, cdk?, cdv?);
    check_shapes(&cq.dims, &ck.dims, &cv.dims, &co.dims, false)?;
    for (grad, input, names) in [
        (&cdo, &co, ("d_out", "out")),
        (&cdq, &cq, ("dq", "q")),
        (&cdk, &ck, ("dk", "k")),
        (&cdv, &cv, ("dv", "v")),
    ] {
        // The backward reads dO in O's layout and writes each gradient in its input's.
        let strides = |c: &Checked| {
            if varlen {
                [0, c.strides[1], c.strides[2]]
            } else {
                c.strides
            }
        };
        if grad.dims != input.dims || strides(grad) != strides(input) {
            return Err(value_error(format!(
                "{} has dims {} and strides {} but {} has {} and {}: the backward takes {} \
                 laid out as {}",
                names.0,
                shape_text(&grad.dims),
                shape_text(&strides(grad)),
                names.1,
                shape_text(&input.dims),
                shape_text(&strides(input)),
                names.0,
                names.1
            )));
        }
    }
    let [batch, seqlen_q, heads_q, _] = cq.dims;
    let seqlen_k = ck.dims[1];
    let sinks = match &sinks {
        Some(arg) => Some(check_sinks(arg, "sinks", heads_q)?),
        None => None,
    };
    let d_sinks = match &d_sinks {
        Some(arg) => Some(check_sinks(arg, "d_sinks", heads_q)?),
        None => None,
    };
    let args = flash_args(window.as_ref(), scale, softcap)?;
    let seqlens = match cu_seqlens {
        Some((cu_q, cu_k)) => {
            if cu_q.len() != cu_k.len() {
                return Err(value_error(format!(
                    "cu_seqlens_q has {} entries but cu_seqlens_k has {}",
                    cu_q.len(),
                    cu_k.len()
                )));
            }
            Some((
                host_prefix_sums(&cu_q, seqlen_q, "cu_seqlens_q", "q")?,
                host_prefix_sums(&cu_k, seqlen_k, "cu_seqlens_k", "k")?,
            ))
        }
        None => None,
    };
    let problem = HostProblem::new([&cq, &ck, &cv, &co], causal, args, seqlens, sinks)?;
    let expected_lse = if varlen {
        vec![heads_q, seqlen_q]
    } else {
        vec![batch, heads_q, seqlen_q]
    };
    let lse = check_lse(&lse, &expected_lse)? as usize;
    if let Some(device) = device {
        if sinks.is_some() || d_sinks.is_some() {
            return Err(PyNotImplementedError::new_err(
                "attention sinks run on the CPU only for now (the CUDA kernels take none yet)",
            ));
        }
        let all = [&cq, &ck, &cv, &co, &cdo, &cdq, &cdk, &cdv];
        let dtype = cq.dtype;
        if dtype == DType::F32 || all.iter().any(|c| c.dtype != dtype) {
            return Err(value_error(
                "the CUDA backward takes q, k, v, out, d_out, dq, dk and dv of one dtype, \
                 bfloat16 or float16",
            ));
        }
        let addrs = all.map(|c| c.tensor.data as usize as u64);
        let device: &CudaDevice = &device;
        return py.detach(move || -> PyResult<()> {
            let problem = problem.validate().map_err(facade_error)?;
            // SAFETY: a live handle owned by `device` (destroyed only when it drops).
            let dev = unsafe { &*device.handle.0 }.device();
            let plan = dev
                .plan_backward(&problem, dtype, &fa_cuda::BackwardOptions::default())
                .map_err(cuda_error)?;
            // SAFETY: every address comes from a live CUDA tensor of the handle's device (the
            // shim passes only those) whose shape and strides were checked against each
            // other above (d_out as out, each gradient as its input), so the memory covers
            // what the problem reaches; PyTorch keeps the stream alive and orders later uses
            // and frees of the tensors after its work on it, as for its own kernels.
            unsafe {
                match dtype {
                    DType::Bf16 => {
                        cuda_backward::<half::bf16>(dev, &plan, &problem, addrs, lse as u64, stream)
                    }
                    _ => {
                        cuda_backward::<half::f16>(dev, &plan, &problem, addrs, lse as u64, stream)
                    }
                }
            }
        });
    }
    let buffers = HostBackward {
        q: cq.host(),
        k: ck.host(),
        v: cv.host(),
        o: co.host(),
        lse,
        d_o: cdo.host(),
        dq: cdq.host(),
        dk: cdk.host(),
        dv: cdv.host(),
        d_sinks,
    };
    py.detach(move || -> Result<(), flash_attention::Error> {
        let problem = problem.validate()?;
        // SAFETY: every address comes from a live CPU tensor or NumPy array whose shape and
        // strides were checked against each other above (d_out as out, each gradient as its
        // input), so the memory covers what the problem reaches; the caller keeps them alive
        // for the call and writes none meanwhile. The facade checks null, alignment,
        // overflow and overlap before anything is written.
        unsafe { flash_attention::host::backward(&problem, &buffers, &Options::default()) }?;
        Ok(())
    })
    .map_err(facade_error)
}

/// Everything one append takes, plain data only (run with the GIL released).
struct AppendCall {
    problem: FaProblem,
    cache: FaKvCache,
    /// New K, new V, K cache, V cache.
    tensors: [FaTensor; 4],
}

// SAFETY: as for `Call`: the addresses point to memory the Python caller keeps alive for the
// whole call, shared with no other thread meanwhile.
unsafe impl Send for AppendCall {}

impl AppendCall {
    fn run(&self, device: Option<(&CudaDevice, u64)>) -> i32 {
        let [kn, vn, kc, vc] = &self.tensors;
        match device {
            // SAFETY: host arrays of the checked shapes and strides (the library checks null,
            // alignment, overflow, overlap, room and block indices itself).
            None => unsafe { fa_append_kv_cpu(&self.problem, &self.cache, kn, vn, kc, vc) },
            // SAFETY: device tensors of the handle's device, of the checked shapes, kept
            // alive by the caller; PyTorch orders later uses after its stream's work.
            Some((device, stream)) => unsafe {
                fa_append_kv_cuda(
                    device.handle.0,
                    &self.problem,
                    &self.cache,
                    kn,
                    vn,
                    kc,
                    vc,
                    stream as usize as *mut c_void,
                )
            },
        }
    }
}

/// Appends new tokens to a KV cache in place: `k_new`/`v_new` `(batch, seqlen_new, heads_kv,
/// head_dim)` go into `k_cache`/`v_cache` at positions `seqused_k[b] + i` (a padded cache
/// `(batch, capacity, heads_kv, head_dim)`, or with a block table `(batch, max_blocks)` a paged
/// one `(num_blocks, block_size, heads_kv, head_dim)`). Without `device` on the CPU with the
/// GIL released; with one, queued on `stream` without waiting. The lengths are not changed.
#[pyfunction]
#[pyo3(signature = (k_new, v_new, k_cache, v_cache, seqused_k, block_table=None, *,
    device=None, stream=0))]
#[allow(clippy::too_many_arguments)]
fn append_kv(
    py: Python<'_>,
    k_new: TensorArg,
    v_new: TensorArg,
    k_cache: TensorArg,
    v_cache: TensorArg,
    seqused_k: TensorArg,
    block_table: Option<TensorArg>,
    device: Option<PyRef<'_, CudaDevice>>,
    stream: u64,
) -> PyResult<()> {
    let [kn, vn, kc, vc] = [
        (&k_new, "k_new"),
        (&v_new, "v_new"),
        (&k_cache, "k_cache"),
        (&v_cache, "v_cache"),
    ]
    .map(|(t, name)| check_tensor(t, name, false));
    let (kn, vn, kc, vc) = (kn?, vn?, kc?, vc?);
    let text = |d: &[i64; 4]| shape_text(d);
    if kn.dims[..3] != vn.dims[..3] || kc.dims[..3] != vc.dims[..3] {
        return Err(value_error(format!(
            "k_new {} and v_new {}, k_cache {} and v_cache {} must agree in all but head_dim",
            text(&kn.dims),
            text(&vn.dims),
            text(&kc.dims),
            text(&vc.dims)
        )));
    }
    if kn.dims[2..] != kc.dims[2..] || vn.dims[3] != vc.dims[3] {
        return Err(value_error(format!(
            "k_new {} / v_new {} and the cache {} / {} differ in heads_kv or head_dim",
            text(&kn.dims),
            text(&vn.dims),
            text(&kc.dims),
            text(&vc.dims)
        )));
    }
    let [batch, seqlen_new, heads_kv, head_dim] = kn.dims;
    let cache = cache_desc(&seqused_k, block_table.as_ref(), None, batch, &kc.dims)?;
    if block_table.is_none() && kc.dims[0] != batch {
        return Err(value_error(format!(
            "k_new has batch {batch} but the padded cache k_cache has batch {}",
            kc.dims[0]
        )));
    }
    let seqlen_k = if block_table.is_some() { 0 } else { kc.dims[1] };
    let problem = FaProblem {
        head_dim_v: vn.dims[3],
        ..FaProblem::dense(batch, seqlen_new, seqlen_k, heads_kv, heads_kv, head_dim)
    };
    let call = AppendCall {
        problem,
        cache,
        tensors: [kn.tensor, vn.tensor, kc.tensor, vc.tensor],
    };
    let result = match device {
        None => py.detach(move || call_c(|| call.run(None))),
        Some(device) => {
            let device: &CudaDevice = &device;
            py.detach(move || call_c(|| call.run(Some((device, stream)))))
        }
    };
    result.map_err(|(code, message)| library_error(code, message))
}

/// Builds the block walk of a paged KV cache into `walk` (host int32 `(batch, 2, max_blocks)`)
/// with `fa_block_walk`: per sequence its used blocks sorted by physical index (plane 0) and
/// their logical indices (plane 1), zeros after. `seqused_k` `(batch,)` and `block_table`
/// `(batch, max_blocks)` are host int32 arrays, dense; the library checks them as the CPU
/// cache call does (`ValueError`, `walk` untouched).
#[pyfunction]
fn block_walk(
    py: Python<'_>,
    seqused_k: TensorArg,
    block_table: TensorArg,
    block_size: i64,
    num_blocks: i64,
    walk: TensorArg,
) -> PyResult<()> {
    if block_table.1.len() != 2 {
        return Err(value_error(format!(
            "block_table has shape {}: expected 2 dimensions (batch, max_blocks)",
            shape_text(&block_table.1)
        )));
    }
    let (batch, max_blocks) = (block_table.1[0], block_table.1[1]);
    let used = check_table(&seqused_k, "seqused_k", &[batch], "(batch,)")?;
    let table = check_table(
        &block_table,
        "block_table",
        &[batch, max_blocks],
        "(batch, max_blocks)",
    )?;
    let out = check_table(
        &walk,
        "walk",
        &[batch, 2, max_blocks],
        "(batch, 2, max_blocks)",
    )?;
    let len = usize::try_from(batch)
        .ok()
        .zip(usize::try_from(max_blocks).ok())
        .and_then(|(b, m)| b.checked_mul(m)?.checked_mul(2))
        .ok_or_else(|| value_error("the walk's size overflows"))?;
    py.detach(move || {
        // SAFETY: int32 host arrays of the checked shapes, dense, kept alive by the caller
        // for the call (the library checks null, alignment, overlap and every used entry).
        call_c(|| unsafe {
            fa_block_walk(
                used as usize as *const i32,
                table as usize as *const i32,
                batch,
                max_blocks,
                block_size,
                num_blocks,
                out as usize as *mut i32,
                len,
            )
        })
    })
    .map_err(|(code, message)| library_error(code, message))
}

/// The library's version (`MAJOR.MINOR.PATCH`).
#[pyfunction]
fn version() -> String {
    // SAFETY: a static NUL-terminated string.
    unsafe { CStr::from_ptr(fa_capi::fa_version()) }
        .to_string_lossy()
        .into_owned()
}

/// The module `flash_attention_rs._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(forward, m)?)?;
    m.add_function(wrap_pyfunction!(backward, m)?)?;
    m.add_function(wrap_pyfunction!(append_kv, m)?)?;
    m.add_function(wrap_pyfunction!(block_walk, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_class::<CudaDevice>()?;
    Ok(())
}
