//! The device handle, device buffers, and the forward launch.

use crate::compile::{compile_cached, nvrtc_available, KernelOrigin};
use crate::error::CudaError;
use crate::kernels::decode::CombineVariant;
use crate::kernels::{arch_for, DeviceProps, ForwardVariant, KernelVariant, LaunchShape};
use crate::params::{ForwardOptions, Params};
use crate::plan::{check_run, plan_forward, ForwardPlan, ForwardTensors, PlannedKernels, Source};
use crate::raw::{CuSeqlens, RawOut, RawTensor};
use crate::tma::{tile_map, TensorMap, TileSource};
use cudarc::driver::sys::{self, CUdevice_attribute, CUevent_flags, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    ValidAsZeroBits,
};
use half::slice::HalfFloatSliceExt;
use softmax_core::DType;
use softmax_core::{BufferLens, Extent, Out, Problem, ProblemError, Qkv};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, OnceLock};

mod backward;
mod decode;

pub use backward::{BackwardInputs, BackwardStats, BackwardTensors};
use decode::OwnedInputs;

/// Whether the CUDA driver library can be loaded. `cudarc` panics on the first driver call
/// when it cannot, so [`Device::open`] checks this first.
pub fn driver_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate library names.
    *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
    impl Sealed for f32 {}
}

/// An element type that device buffers hold: `bf16`, `f16` (Q, K, V, O) and `f32` (LSE).
pub trait DeviceElement: sealed::Sealed + Copy {
    /// The plain type the driver copies.
    #[doc(hidden)]
    type Raw: DeviceRepr + ValidAsZeroBits + Copy + Default + Unpin;
    /// Views a host slice as raw elements.
    #[doc(hidden)]
    fn raw(slice: &[Self]) -> &[Self::Raw];
    /// Views a mutable host slice as raw elements.
    #[doc(hidden)]
    fn raw_mut(slice: &mut [Self]) -> &mut [Self::Raw];
}

/// A 16-bit element type the attention kernels take: `half::bf16` or `half::f16`.
pub trait CudaElement: DeviceElement {
    /// The kernel dtype.
    const DTYPE: DType;
}

impl DeviceElement for half::bf16 {
    type Raw = u16;
    fn raw(slice: &[Self]) -> &[u16] {
        slice.reinterpret_cast()
    }
    fn raw_mut(slice: &mut [Self]) -> &mut [u16] {
        slice.reinterpret_cast_mut()
    }
}
impl DeviceElement for half::f16 {
    type Raw = u16;
    fn raw(slice: &[Self]) -> &[u16] {
        slice.reinterpret_cast()
    }
    fn raw_mut(slice: &mut [Self]) -> &mut [u16] {
        slice.reinterpret_cast_mut()
    }
}
impl DeviceElement for f32 {
    type Raw = f32;
    fn raw(slice: &[Self]) -> &[f32] {
        slice
    }
    fn raw_mut(slice: &mut [Self]) -> &mut [f32] {
        slice
    }
}
impl CudaElement for half::bf16 {
    const DTYPE: DType = DType::Bf16;
}
impl CudaElement for half::f16 {
    const DTYPE: DType = DType::F16;
}

// Keep the u16 views honest: both half types are 16-bit transparent wrappers.
const _: () = assert!(core::mem::size_of::<half::bf16>() == 2);
const _: () = assert!(core::mem::size_of::<half::f16>() == 2);

/// A buffer in device memory of one [`Device`].
pub struct DeviceBuffer<T: DeviceElement> {
    slice: CudaSlice<T::Raw>,
    _element: PhantomData<T>,
}

impl<T: DeviceElement> Extent for DeviceBuffer<T> {
    fn elems(&self) -> usize {
        self.slice.len()
    }
}

/// The output bundle of a call on device buffers: O and, optionally, the f32 LSE.
pub type DeviceOut<'a, T> = Out<&'a mut DeviceBuffer<T>, &'a mut DeviceBuffer<f32>>;

impl<T: DeviceElement> DeviceBuffer<T> {
    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.slice.len()
    }
    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }
}

/// What a forward call did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ForwardStats {
    /// The launch (variant, grid, block, shared memory); `None` when there was nothing to do.
    pub launch: Option<LaunchShape>,
    /// NVRTC compile time in milliseconds, when this call compiled the variant.
    pub compile_ms: Option<f64>,
    /// Where the kernel came from: compiled by this call, the disk cache, or already loaded in
    /// this process; `None` when there was nothing to do.
    pub kernel_source: Option<KernelOrigin>,
    /// Registers per thread of the variant (ptxas' report).
    pub registers: Option<u32>,
    /// Kernel time from CUDA events, when [`ForwardOptions::time_kernel`] was set (with a KV
    /// cache: the decode and the combine kernel together).
    pub kernel_ms: Option<f32>,
    /// The decode launch (split count, grid, workspace) of a KV-cache problem; `launch` is
    /// then `None`.
    pub decode: Option<crate::kernels::decode::DecodePlan>,
}

/// One CUDA device: its context, a stream, and the kernels loaded into it.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    name: String,
    props: DeviceProps,
    /// The one kernel table: every family's loaded kernels.
    functions: Mutex<Functions>,
}

/// Loaded kernels of every family, by (family, variant name), with their register counts.
type Functions = HashMap<(&'static str, String), (CudaFunction, u32)>;

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name)
            .field("arch", &self.arch)
            .field("sm_count", &self.props.sm_count)
            .finish()
    }
}

impl Device {
    /// Opens device `ordinal` in its primary context (`cuDevicePrimaryCtxRetain`: the context
    /// the CUDA runtime, and so PyTorch, uses on that device). A machine without driver, NVRTC
    /// or such a device gets an error value, never a panic.
    pub fn open(ordinal: usize) -> Result<Device, CudaError> {
        Self::check_libraries()?;
        let count = CudaContext::device_count()
            .map_err(|e| CudaError::driver("cuDeviceGetCount", e))?
            .max(0) as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| CudaError::driver("cuDevicePrimaryCtxRetain", e))?;
        Self::from_context(ctx)
    }

    /// A device on a context the caller already has (a cudarc `CudaContext`, primary or not):
    /// kernels are loaded into it and buffers of it are accepted. The device keeps the `Arc`
    /// (the context lives as long as the device does).
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Device, CudaError> {
        Self::check_libraries()?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver("cuDeviceGetAttribute", e))?;
        if major < 8 {
            return Err(CudaError::UnsupportedArch { major, minor });
        }
        let attr = |a: CUdevice_attribute| {
            ctx.attribute(a)
                .map(|v| v.max(0) as u32)
                .map_err(|e| CudaError::driver("cuDeviceGetAttribute", e))
        };
        let props = DeviceProps {
            smem_per_sm_bytes: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            )?,
            regs_per_sm: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR,
            )?,
            l2_bytes: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
            ..DeviceProps::new(
                major,
                minor,
                attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
                attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
            )
        };
        let name = ctx.name().unwrap_or_else(|_| "unknown".to_string());
        let stream = ctx.default_stream();
        Ok(Device {
            ctx,
            stream,
            arch: arch_for(major, minor),
            name,
            props,
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// A device on a raw `CUcontext` handed over by a C or Python caller. cudarc can share a
    /// context without owning it only when it is a primary context (retained again here and
    /// released when the device is dropped), which is what the CUDA runtime and PyTorch use;
    /// any other context is [`CudaError::NotPrimaryContext`].
    ///
    /// # Safety
    /// `raw` must be a live context handle (not destroyed) for the duration of this call.
    pub unsafe fn from_raw_context(raw: sys::CUcontext) -> Result<Device, CudaError> {
        Self::check_libraries()?;
        let mut dev: sys::CUdevice = 0;
        // SAFETY: `raw` is a live context (the caller's contract); pushing it, asking its
        // device and popping it leaves this thread's context stack as it was.
        unsafe {
            sys::cuCtxPushCurrent_v2(raw)
                .result()
                .map_err(|e| CudaError::driver("cuCtxPushCurrent", e))?;
            let got = sys::cuCtxGetDevice(&mut dev).result();
            let mut popped: sys::CUcontext = core::ptr::null_mut();
            sys::cuCtxPopCurrent_v2(&mut popped)
                .result()
                .map_err(|e| CudaError::driver("cuCtxPopCurrent", e))?;
            got.map_err(|e| CudaError::driver("cuCtxGetDevice", e))?;
        }
        let count = CudaContext::device_count()
            .map_err(|e| CudaError::driver("cuDeviceGetCount", e))?
            .max(0) as usize;
        for ordinal in 0..count {
            let this = cudarc::driver::result::device::get(ordinal as i32)
                .map_err(|e| CudaError::driver("cuDeviceGet", e))?;
            if this == dev {
                let device = Self::open(ordinal)?;
                return if device.ctx.cu_ctx() == raw {
                    Ok(device)
                } else {
                    Err(CudaError::NotPrimaryContext)
                };
            }
        }
        Err(CudaError::NoDevice {
            ordinal: dev.max(0) as usize,
            count,
        })
    }

    /// The driver and NVRTC libraries load (cudarc panics on the first call without them).
    fn check_libraries() -> Result<(), CudaError> {
        if !driver_available() {
            return Err(CudaError::NoDriver);
        }
        if !nvrtc_available() {
            return Err(CudaError::NoNvrtc);
        }
        Ok(())
    }

    /// The context the device runs in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream of the owned-buffer API (the context's default stream).
    pub fn default_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Wraps a caller's raw `CUstream` (e.g. PyTorch's `torch.cuda.current_stream().cuda_stream`)
    /// for [`Device::forward_on_stream`]; dropping the wrapper does not destroy the stream.
    ///
    /// # Safety
    /// `raw` must be a stream of this device's context (or null: the legacy default stream)
    /// that its owner keeps alive while the wrapper is used.
    pub unsafe fn borrow_stream(&self, raw: sys::CUstream) -> Arc<CudaStream> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.ctx.wrap_borrowed_stream(raw) }
    }

    /// The device's name as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The architecture kernels are compiled for (e.g. `sm_90a`).
    pub fn arch(&self) -> &str {
        &self.arch
    }
    /// Streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.props.sm_count
    }
    /// The properties the launch plans are made for.
    pub fn props(&self) -> &DeviceProps {
        &self.props
    }

    /// Copies a host slice into a new device buffer.
    pub fn upload<T: DeviceElement>(&self, host: &[T]) -> Result<DeviceBuffer<T>, CudaError> {
        let slice = self
            .stream
            .clone_htod(T::raw(host))
            .map_err(|e| CudaError::driver("cuMemcpyHtoD", e))?;
        Ok(DeviceBuffer {
            slice,
            _element: PhantomData,
        })
    }

    /// A new zero-filled device buffer of `len` elements.
    pub fn alloc_zeroed<T: DeviceElement>(&self, len: usize) -> Result<DeviceBuffer<T>, CudaError> {
        let slice = self
            .stream
            .alloc_zeros::<T::Raw>(len)
            .map_err(|e| CudaError::driver("cuMemAlloc", e))?;
        Ok(DeviceBuffer {
            slice,
            _element: PhantomData,
        })
    }

    /// Copies a device buffer into a host slice of the same length.
    pub fn download<T: DeviceElement>(
        &self,
        buf: &DeviceBuffer<T>,
        host: &mut [T],
    ) -> Result<(), CudaError> {
        if host.len() != buf.len() {
            return Err(CudaError::Problem(
                softmax_core::ProblemError::Unsupported {
                    what: "download needs a host slice of the buffer's length",
                },
            ));
        }
        self.stream
            .memcpy_dtoh(&buf.slice, T::raw_mut(host))
            .map_err(|e| CudaError::driver("cuMemcpyDtoH", e))?;
        self.synchronize()
    }

    /// Waits for all work queued on the device's stream; reports asynchronous errors.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(|e| CudaError::driver("cuStreamSynchronize", e))
    }

    /// The compiled and loaded function of a variant of any family, from the device's one
    /// kernel table (compiled once per process or loaded from the disk cache; loaded into this
    /// context once, with `smem_bytes` of dynamic shared memory allowed), where it came from,
    /// and its register count. The plan has already checked the shared memory against the
    /// device.
    pub(crate) fn function<V: KernelVariant + Clone + Send + Sync + 'static>(
        &self,
        variant: &V,
        smem_bytes: u32,
    ) -> Result<(CudaFunction, KernelOrigin, u32), CudaError> {
        let mut functions = self.functions.lock().map_err(|_| CudaError::Driver {
            what: "kernel table",
            error: "poisoned lock".into(),
        })?;
        let key = (variant.family().name, variant.name());
        if let Some((f, regs)) = functions.get(&key) {
            return Ok((f.clone(), KernelOrigin::ProcessCache, *regs));
        }
        let (compiled, origin) = compile_cached(variant, &self.arch)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin.clone()))
            .map_err(|e| CudaError::driver("cuModuleLoadData", e))?;
        let f = module
            .load_function(variant.entry())
            .map_err(|e| CudaError::driver("cuModuleGetFunction", e))?;
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem_bytes as i32,
        )
        .map_err(|e| CudaError::driver("cuFuncSetAttribute", e))?;
        let regs = compiled.usage.registers;
        functions.insert(key, (f.clone(), regs));
        Ok((f, origin, regs))
    }

    /// Checks that a buffer was allocated in this device's context.
    fn owns<T: DeviceElement>(&self, buf: &DeviceBuffer<T>) -> Result<(), CudaError> {
        // Same context, whichever `Arc` wraps it (a primary context retained twice is one).
        if **buf.slice.context() == *self.ctx {
            Ok(())
        } else {
            Err(CudaError::ForeignBuffer)
        }
    }

    /// Forward attention on device buffers: `out.o` (and `out.lse`, natural log,
    /// FlashAttention's layout) receive softmax(QKᵀ·scale)·V for the validated `problem` (BSHD
    /// with strides, or packed varlen: its `cu_seqlens` are copied to the device by this call).
    /// Bad input returns a [`CudaError::Problem`] before anything is queued. Runs on the
    /// device's default stream through [`Device::forward_on_stream`] and waits for the kernel
    /// (so the buffers are free to reuse when it returns).
    pub fn forward<T: CudaElement>(
        &self,
        problem: &Problem,
        qkv: Qkv<&DeviceBuffer<T>>,
        out: DeviceOut<'_, T>,
        opts: &ForwardOptions,
    ) -> Result<ForwardStats, CudaError> {
        let stats = self.forward_owned(problem, qkv, out, opts, 1)?;
        Ok(stats.into_iter().next().unwrap_or_default())
    }

    /// Times `iters` forward launches (after `warmup` untimed ones) with CUDA events around each
    /// launch; returns the kernel times in milliseconds. Same arguments as [`Device::forward`]
    /// (no LSE).
    pub fn time_forward<T: CudaElement>(
        &self,
        problem: &Problem,
        qkv: Qkv<&DeviceBuffer<T>>,
        out: &mut DeviceBuffer<T>,
        opts: &ForwardOptions,
        warmup: usize,
        iters: usize,
    ) -> Result<Vec<f32>, CudaError> {
        let untimed = ForwardOptions {
            time_kernel: false,
            ..*opts
        };
        self.forward_owned(problem, qkv, Out::new(&mut *out), &untimed, warmup)?;
        let timed = ForwardOptions {
            time_kernel: true,
            ..*opts
        };
        let stats = self.forward_owned(problem, qkv, Out::new(out), &timed, iters)?;
        Ok(stats.iter().filter_map(|s| s.kernel_ms).collect())
    }

    /// The owned-buffer layer: checks that the buffers are this context's, views them as raw
    /// tensors, plans once, queues `repeat` runs of the plan on the default stream and waits.
    fn forward_owned<T: CudaElement>(
        &self,
        problem: &Problem,
        qkv: Qkv<&DeviceBuffer<T>>,
        out: DeviceOut<'_, T>,
        opts: &ForwardOptions,
        repeat: usize,
    ) -> Result<Vec<ForwardStats>, CudaError> {
        let Out { o, lse } = out;
        for b in [qkv.q, qkv.k, qkv.v, &*o] {
            self.owns(b)?;
        }
        if let Some(l) = lse.as_deref() {
            self.owns(l)?;
        }
        let plan = self.plan_forward(problem, T::DTYPE, opts)?;
        let stream = &self.stream;
        // The guards record cudarc's read/write events when the launch is queued.
        let (q, _gq) = raw_view(qkv.q, stream);
        let (k, _gk) = raw_view(qkv.k, stream);
        let (v, _gv) = raw_view(qkv.v, stream);
        let (o, _go) = raw_view(&*o, stream);
        let lse = lse.as_deref().map(|l| raw_view(l, stream));
        let tensors = ForwardTensors {
            qkv: Qkv::new(q, k, v),
            out: Out {
                o,
                lse: lse.as_ref().map(|l| l.0),
            },
            cu_seqlens: None,
            tables: None,
        };
        let stats = self.run(Some(problem), &plan, tensors, Source::Owned, stream, repeat)?;
        self.synchronize()?;
        Ok(stats)
    }

    /// Forward attention on memory the caller owns, queued on the caller's `stream` (a stream
    /// of this device's context: [`CudaError::ForeignStream`] otherwise) without waiting for
    /// it. Everything is checked before anything is queued: the lengths against the problem,
    /// null and misaligned addresses (bases 16-byte aligned, the LSE 4), address overflow.
    /// Host prefix sums (`Sequences::Varlen`) are copied on `stream` into memory freed in
    /// stream order after the kernel (cudarc's `cuMemFreeAsync`; where the device has no
    /// memory pools, cudarc waits for the stream before it frees); device prefix sums
    /// (`Sequences::VarlenDevice`) go through [`Device::forward_varlen_on_stream`]. A KV-cache
    /// problem runs the decode kernels: its host `seqused_k` and block table are copied and
    /// its split workspace allocated the same way (stream-ordered);
    /// [`Device::forward_cache_on_stream`] takes both from the caller instead. The caller
    /// synchronises (or orders later work after `stream`) before it reads the outputs or
    /// frees the buffers; with [`ForwardOptions::time_kernel`] this call waits for the kernel
    /// to read its events. Plans the call ([`Device::plan_forward`]) and runs the plan.
    pub fn forward_on_stream<T: CudaElement>(
        &self,
        problem: &Problem,
        qkv: Qkv<RawTensor<T>>,
        out: RawOut<T>,
        stream: &Arc<CudaStream>,
        opts: &ForwardOptions,
    ) -> Result<ForwardStats, CudaError> {
        let plan = self.plan_forward(problem, T::DTYPE, opts)?;
        let tensors = ForwardTensors {
            qkv,
            out,
            cu_seqlens: None,
            tables: None,
        };
        let stats = self.run(Some(problem), &plan, tensors, Source::Owned, stream, 1)?;
        Ok(stats.into_iter().next().unwrap_or_default())
    }

    /// [`Device::forward_on_stream`] for a packed batch whose prefix sums are already on the
    /// device (`problem` built with `Sequences::VarlenDevice`; `cu_seqlens` int32,
    /// `batch + 1` entries each, valid as [`RawTensor::from_raw`] requires). No host copy,
    /// no host synchronisation.
    pub fn forward_varlen_on_stream<T: CudaElement>(
        &self,
        problem: &Problem,
        cu_seqlens: CuSeqlens,
        qkv: Qkv<RawTensor<T>>,
        out: RawOut<T>,
        stream: &Arc<CudaStream>,
        opts: &ForwardOptions,
    ) -> Result<ForwardStats, CudaError> {
        if !matches!(
            problem.sequences(),
            softmax_core::Sequences::VarlenDevice { .. }
        ) || problem.has_kv_cache()
        {
            return Err(ProblemError::Unsupported {
                what: "device prefix sums go with Sequences::VarlenDevice only",
            }
            .into());
        }
        let plan = self.plan_forward(problem, T::DTYPE, opts)?;
        let tensors = ForwardTensors {
            qkv,
            out,
            cu_seqlens: Some(cu_seqlens),
            tables: None,
        };
        // SAFETY: an empty tensor: the plan of a problem without a KV cache needs no
        // workspace, and nothing reads it.
        let no_workspace = unsafe { RawTensor::from_raw(0, 0) };
        self.run_on_stream(&plan, tensors, no_workspace, stream)
    }

    /// [`plan_forward`](crate::plan_forward) for this device's properties: the plan of a
    /// forward call (dense, or over a KV cache), made once and run with
    /// [`Device::run_on_stream`] as often as the problem's tensors are run (e.g. every layer
    /// of a decode step).
    pub fn plan_forward(
        &self,
        problem: &Problem,
        dtype: DType,
        opts: &ForwardOptions,
    ) -> Result<ForwardPlan, CudaError> {
        Ok(plan_forward(problem, dtype, opts, &self.props)?)
    }

    /// Runs a forward plan on caller memory and the caller's `stream` (a stream of this
    /// device's context) without waiting: every input is on the device ([`ForwardTensors`]:
    /// the prefix sums of a packed problem, the tables of a KV-cache problem) and `workspace`
    /// holds at least [`ForwardPlan::workspace_bytes`] bytes at the plan's alignment (an
    /// empty tensor when that is 0), used by nothing else until the stream has passed the
    /// call. No host copy, no allocation, no synchronisation (unless the plan times its
    /// kernels), so a run can be captured in a CUDA graph and replayed. Everything is checked
    /// against the plan before anything is queued: dtype and device, lengths, null and
    /// misaligned addresses, the prefix sums, the tables and the workspace.
    pub fn run_on_stream<T: CudaElement>(
        &self,
        plan: &ForwardPlan,
        tensors: ForwardTensors<T>,
        workspace: RawTensor<u8>,
        stream: &Arc<CudaStream>,
    ) -> Result<ForwardStats, CudaError> {
        let stats = self.run(None, plan, tensors, Source::Caller(workspace), stream, 1)?;
        Ok(stats.into_iter().next().unwrap_or_default())
    }

    /// The one launch path of the forward and the decode: checks the call against the plan;
    /// with [`Source::Owned`] copies the problem's host prefix sums or cache tables (and the
    /// block walk the plan reads by) on `stream` and allocates the workspace there, all freed
    /// in stream order after the kernels; queues `repeat` runs. Does not wait unless timing.
    fn run<T: CudaElement>(
        &self,
        problem: Option<&Problem>,
        plan: &ForwardPlan,
        tensors: ForwardTensors<T>,
        source: Source,
        stream: &Arc<CudaStream>,
        repeat: usize,
    ) -> Result<Vec<ForwardStats>, CudaError> {
        if **stream.context() != *self.ctx {
            return Err(CudaError::ForeignStream);
        }
        let mut params = check_run(plan, &tensors, &source, &self.props)?;
        if matches!(plan.kernels(), PlannedKernels::Nothing) {
            return Ok(vec![ForwardStats::default(); repeat]);
        }
        let owned = match (&source, problem) {
            (Source::Owned, Some(problem)) => Some(OwnedInputs::upload(problem, plan, stream)?),
            (Source::Owned, None) => {
                return Err(ProblemError::Unsupported {
                    what: "an owned run needs the problem's host tables",
                }
                .into())
            }
            (Source::Caller(_), _) => None,
        };
        let guards = owned.as_ref().map(|o| o.fill(plan, &mut params, stream));
        let stats = self.enqueue(plan, &params, stream, plan.times_kernel(), repeat);
        drop(guards);
        drop(owned);
        let stats = stats?;
        self.ctx
            .check_err()
            .map_err(|e| CudaError::driver("deferred driver call", e))?;
        Ok(stats)
    }

    /// Queues `repeat` runs of a checked plan on `stream` (CUDA events around each when
    /// `time`; reading them waits for the kernels): the dense kernel, or the decode kernel and,
    /// when it splits the keys, the combine (on sm_90 a programmatic dependent launch, so its
    /// launch overlaps the decode).
    fn enqueue(
        &self,
        plan: &ForwardPlan,
        params: &Params,
        stream: &Arc<CudaStream>,
        time: bool,
        repeat: usize,
    ) -> Result<Vec<ForwardStats>, CudaError> {
        let compile_ms = |origin| match origin {
            KernelOrigin::Compiled { ms } => Some(ms),
            _ => None,
        };
        match *plan.kernels() {
            PlannedKernels::Nothing => Ok(vec![ForwardStats::default(); repeat]),
            PlannedKernels::Forward(shape) => {
                let (func, origin, registers) =
                    self.function(&shape.variant, shape.variant.smem_bytes())?;
                let cfg = LaunchConfig {
                    grid_dim: shape.grid,
                    block_dim: (shape.block, 1, 1),
                    shared_mem_bytes: shape.smem_bytes,
                };
                // The warp-specialized sm90 kernel reads Q, K, V through TMA tensor maps.
                let maps = match shape.variant {
                    ForwardVariant::Sm90(v) if v.ws() => Some(sm90_tensor_maps(plan, params, v)?),
                    _ => None,
                };
                let extra: &[TensorMap] = maps.as_ref().map_or(&[], |m| &m[..]);
                self.repeat_timed(stream, repeat, time, || {
                    // SAFETY: `params` matches the kernel's `AttnParams` layout (and the tensor
                    // maps its `TensorMap` parameters: they encode the same checked addresses
                    // with the problem's extents and strides, and TMA reads nothing outside
                    // them); every address in it was checked against the plan (non-null,
                    // aligned, long enough for the problem's extents, which bound the kernel's
                    // reads and writes) and is device memory of this context that stays valid
                    // until `stream` passes the kernel: caller memory by
                    // `RawTensor::from_raw`'s contract, owned buffers because their callers
                    // wait for the stream, host prefix sums because they are freed in stream
                    // order.
                    unsafe { launch(&func, cfg, stream, params, extra, false) }?;
                    Ok(ForwardStats {
                        launch: Some(shape),
                        compile_ms: compile_ms(origin),
                        kernel_source: Some(origin),
                        registers: Some(registers),
                        kernel_ms: None,
                        decode: None,
                    })
                })
            }
            PlannedKernels::Decode(mut decode) => {
                decode.block_walk = params.block_walk != 0;
                let (func, origin, registers) =
                    self.function(&decode.variant, decode.smem_bytes)?;
                let combine = if decode.num_splits > 1 {
                    let variant = CombineVariant {
                        dtype: plan.dtype(),
                    };
                    Some(self.function(&variant, 0)?.0)
                } else {
                    None
                };
                let decode_cfg = LaunchConfig {
                    grid_dim: decode.grid,
                    block_dim: (decode.block, 1, 1),
                    shared_mem_bytes: decode.smem_bytes,
                };
                let combine_cfg = LaunchConfig {
                    grid_dim: (decode.combine_blocks, 1, 1),
                    block_dim: (CombineVariant::WARPS * 32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let dependent = self.props.major >= 9;
                self.repeat_timed(stream, repeat, time, || {
                    // SAFETY: `params` matches the kernels' `AttnParams` layout; every address
                    // in it was checked against the plan (non-null, aligned, long enough for
                    // the problem's extents, the cache tables and the workspace) and is device
                    // memory of this context that stays valid until `stream` passes the
                    // kernels: caller memory by `RawTensor::from_raw`'s contract, owned
                    // buffers because their callers wait for the stream, copied tables and
                    // workspace because they are freed in stream order. Device-side lengths
                    // and block indices are clamped by the kernel.
                    unsafe { launch(&func, decode_cfg, stream, params, &[], false) }?;
                    if let Some(combine) = &combine {
                        // SAFETY: as above; the combine reads the workspace the decode kernel
                        // wrote (ordered after it on the same stream; as a dependent launch it
                        // waits, `griddepcontrol.wait`, for the decode kernel to complete and
                        // its writes to be visible) and writes O and the LSE.
                        unsafe { launch(combine, combine_cfg, stream, params, &[], dependent) }?;
                    }
                    Ok(ForwardStats {
                        launch: None,
                        compile_ms: compile_ms(origin),
                        kernel_source: Some(origin),
                        registers: Some(registers),
                        kernel_ms: None,
                        decode: Some(decode),
                    })
                })
            }
        }
    }

    /// Runs `launch` (which queues one call's kernels on `stream` and returns its stats)
    /// `repeat` times; with `time`, brackets each call with CUDA events and, after the last,
    /// fills each call's [`ForwardStats::kernel_ms`] (waiting for the stream).
    pub(crate) fn repeat_timed(
        &self,
        stream: &Arc<CudaStream>,
        repeat: usize,
        time: bool,
        launch: impl FnMut() -> Result<ForwardStats, CudaError>,
    ) -> Result<Vec<ForwardStats>, CudaError> {
        let timed = self.timed(stream, repeat, time, launch)?;
        Ok(timed
            .into_iter()
            .map(|(stats, ms)| ForwardStats {
                kernel_ms: ms,
                ..stats
            })
            .collect())
    }

    /// Runs `launch` (which queues one call's kernels on `stream`) `repeat` times; with
    /// `time`, brackets each call with CUDA events and, after the last, reads each call's
    /// kernel time in milliseconds (waiting for the stream). Every pass times this way.
    pub(crate) fn timed<S>(
        &self,
        stream: &Arc<CudaStream>,
        repeat: usize,
        time: bool,
        mut launch: impl FnMut() -> Result<S, CudaError>,
    ) -> Result<Vec<(S, Option<f32>)>, CudaError> {
        let mut all = Vec::with_capacity(repeat);
        let mut events = Vec::new();
        for _ in 0..repeat {
            let timing = if time {
                let ev = || {
                    self.ctx
                        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                        .map_err(|e| CudaError::driver("cuEventCreate", e))
                };
                let (start, end) = (ev()?, ev()?);
                start
                    .record(stream)
                    .map_err(|e| CudaError::driver("cuEventRecord", e))?;
                Some((start, end))
            } else {
                None
            };
            all.push((launch()?, None));
            if let Some((start, end)) = timing {
                end.record(stream)
                    .map_err(|e| CudaError::driver("cuEventRecord", e))?;
                events.push((start, end));
            }
        }
        for (stat, (start, end)) in all.iter_mut().zip(&events) {
            stat.1 = Some(
                start
                    .elapsed_ms(end)
                    .map_err(|e| CudaError::driver("cuEventElapsedTime", e))?,
            );
        }
        Ok(all)
    }

    /// Host convenience: validates, uploads Q, K, V (and the current `out`/`lse`, so that
    /// elements outside the tensors stay untouched), runs [`Device::forward`] and copies the
    /// results back. Bad input returns an error before anything is copied.
    pub fn forward_host<T: CudaElement>(
        &self,
        problem: &Problem,
        qkv: Qkv<&[T]>,
        out: Out<&mut [T], &mut [f32]>,
        opts: &ForwardOptions,
    ) -> Result<ForwardStats, CudaError> {
        problem.check_buffers(BufferLens::of(&qkv, &out))?;
        self.plan_forward(problem, T::DTYPE, opts)?;
        let Out { o: out, lse } = out;
        let dq = self.upload(qkv.q)?;
        let dk = self.upload(qkv.k)?;
        let dv = self.upload(qkv.v)?;
        let mut dout = self.upload(&*out)?;
        let mut dlse = match lse.as_deref() {
            Some(l) => Some(self.upload(l)?),
            None => None,
        };
        let dqkv = Qkv::new(&dq, &dk, &dv);
        let dev_out = Out {
            o: &mut dout,
            lse: dlse.as_mut(),
        };
        let stats = self.forward(problem, dqkv, dev_out, opts)?;
        self.download(&dout, out)?;
        if let (Some(host), Some(dev)) = (lse, dlse.as_ref()) {
            self.download(dev, host)?;
        }
        Ok(stats)
    }
}

/// The Q, K and V tensor maps of a dense problem for the warp-specialized sm90 kernel (tiles
/// of 128 query rows and `block_n` keys), from the checked call's addresses and the plan's
/// extents and strides.
fn sm90_tensor_maps(
    plan: &ForwardPlan,
    params: &Params,
    variant: crate::kernels::sm90::Variant,
) -> Result<[TensorMap; 3], CudaError> {
    let dims = &plan.dims;
    let source = |address, head_dim, tokens, heads, strides| TileSource {
        address,
        head_dim,
        tokens,
        heads,
        batch: dims.batch,
        strides,
    };
    let q = source(
        params.q,
        dims.head_dim,
        dims.total_q,
        dims.heads_q,
        params.q_strides,
    );
    let k = source(
        params.k,
        dims.head_dim,
        dims.total_k,
        dims.heads_kv,
        params.k_strides,
    );
    let v = source(
        params.v,
        dims.head_dim_v,
        dims.total_k,
        dims.heads_kv,
        params.v_strides,
    );
    Ok([
        tile_map(&q, variant.dtype, variant.block_m())?,
        tile_map(&k, variant.dtype, variant.block_n)?,
        tile_map(&v, variant.dtype, variant.block_n)?,
    ])
}

/// Launches `func` on `stream` with the parameter block `params` and the by-value arguments
/// `extra` after it (the sm90 kernel's tensor maps): the one launch helper of every kernel
/// (forward, decode, combine, append, backward). With `dependent`, a programmatic dependent
/// launch (sm_90+): its CTAs may be scheduled while the previous kernel on the stream still
/// runs (that kernel lets them, `griddepcontrol.launch_dependents`), which hides the second
/// launch's latency; only for kernels that execute `griddepcontrol.wait` before reading
/// anything the previous kernel wrote.
///
/// # Safety
/// As for any kernel launch: `P` (then `extra`) is the kernel's parameter list and every
/// address in it is valid device memory for what the kernel accesses, until the stream
/// passes the kernel; with `dependent`, the kernel waits as described above.
pub(crate) unsafe fn launch<P>(
    func: &CudaFunction,
    cfg: LaunchConfig,
    stream: &CudaStream,
    params: &P,
    extra: &[TensorMap],
    dependent: bool,
) -> Result<(), CudaError> {
    let err = |e| CudaError::driver("cuLaunchKernelEx", e);
    stream.context().bind_to_thread().map_err(err)?;
    // SAFETY: a plain C struct of integers and a union of plain values: all-zero is valid.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(dependent),
    };
    // The driver copies the arguments out of `args` during the call.
    let mut args = [std::ptr::null_mut::<std::ffi::c_void>(); 4];
    args[0] = params as *const P as *mut std::ffi::c_void;
    for (slot, map) in args[1..].iter_mut().zip(extra) {
        *slot = map as *const TensorMap as *mut std::ffi::c_void;
    }
    // SAFETY: `config` and `args` outlive the call; `args` holds the parameter block and at
    // most three tensor maps (the kernels take no more); the caller upholds the launch
    // contract.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(err)
}

/// An owned buffer seen as a raw tensor for one call on `stream`, with cudarc's guard (which
/// records the buffer's use on the stream when dropped).
fn raw_view<'a, T: DeviceElement>(
    buf: &'a DeviceBuffer<T>,
    stream: &'a CudaStream,
) -> (RawTensor<T>, impl Drop + 'a) {
    let (ptr, guard) = buf.slice.device_ptr(stream);
    // SAFETY: the slice is a live allocation of the buffer's context holding `len` elements
    // of `T` (`T::Raw` has `T`'s layout), borrowed for the whole call, and the owned-buffer
    // layer waits for the stream before it returns.
    (unsafe { RawTensor::from_raw(ptr, buf.len()) }, guard)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_is_an_error_value_where_there_is_no_device() {
        if driver_available() && nvrtc_available() {
            // A machine with CUDA: an ordinal that cannot exist.
            assert!(matches!(
                Device::open(1 << 20),
                Err(CudaError::NoDevice { ordinal, .. }) if ordinal == 1 << 20
            ));
        } else if !driver_available() {
            assert_eq!(Device::open(0).unwrap_err(), CudaError::NoDriver);
        } else {
            assert_eq!(Device::open(0).unwrap_err(), CudaError::NoNvrtc);
        }
    }
}
