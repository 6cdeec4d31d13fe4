//! The device handle, device buffers, and the forward launch.

use crate::compile::{compile_cached, nvrtc_available, KernelOrigin};
use crate::error::CudaError;
use crate::kernels::{arch_for, DeviceProps, KernelVariant, LaunchShape, Variant};
use crate::params::{prepare, ForwardOptions, KernelParams, Prepared};
use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};
use half::slice::HalfFloatSliceExt;
use softmax_core::DType;
use softmax_core::{BufferLens, Extent, Out, Problem, Qkv};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, OnceLock};

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
    /// Kernel time from CUDA events, when [`ForwardOptions::time_kernel`] was set.
    pub kernel_ms: Option<f32>,
}

/// One CUDA device: its context, a stream, and the kernels loaded into it.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    name: String,
    props: DeviceProps,
    functions: Mutex<HashMap<Variant, (CudaFunction, u32)>>,
}

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
    /// Opens device `ordinal`. A machine without driver, NVRTC or such a device gets an error
    /// value, never a panic.
    pub fn open(ordinal: usize) -> Result<Device, CudaError> {
        if !driver_available() {
            return Err(CudaError::NoDriver);
        }
        if !nvrtc_available() {
            return Err(CudaError::NoNvrtc);
        }
        let count = CudaContext::device_count()
            .map_err(|e| CudaError::driver("cuDeviceGetCount", e))?
            .max(0) as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::driver("cuCtxCreate", e))?;
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

    /// The compiled and loaded function of a variant (compiled once per process, or loaded from
    /// the disk cache; loaded into this context once), where it came from, and its register
    /// count. The plan has already checked the variant's shared memory against the device.
    fn function(&self, variant: &Variant) -> Result<(CudaFunction, KernelOrigin, u32), CudaError> {
        let mut functions = self.functions.lock().map_err(|_| CudaError::Driver {
            what: "kernel table",
            error: "poisoned lock".into(),
        })?;
        if let Some((f, regs)) = functions.get(variant) {
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
            variant.smem_bytes() as i32,
        )
        .map_err(|e| CudaError::driver("cuFuncSetAttribute", e))?;
        let regs = compiled.usage.registers;
        functions.insert(*variant, (f.clone(), regs));
        Ok((f, origin, regs))
    }

    /// Checks that a buffer was allocated in this device's context.
    fn owns<T: DeviceElement>(&self, buf: &DeviceBuffer<T>) -> Result<(), CudaError> {
        if Arc::ptr_eq(buf.slice.context(), &self.ctx) {
            Ok(())
        } else {
            Err(CudaError::ForeignBuffer)
        }
    }

    /// Forward attention on device buffers: `out.o` (and `out.lse`, natural log,
    /// FlashAttention's layout) receive softmax(QKᵀ·scale)·V for the validated `problem` (BSHD
    /// with strides, or packed varlen: its `cu_seqlens` are copied to the device by this call).
    /// Bad input returns a [`CudaError::Problem`] before anything is queued. Waits for the
    /// kernel.
    pub fn forward<T: CudaElement>(
        &self,
        problem: &Problem,
        qkv: Qkv<&DeviceBuffer<T>>,
        out: DeviceOut<'_, T>,
        opts: &ForwardOptions,
    ) -> Result<ForwardStats, CudaError> {
        let Out { o, lse } = out;
        let prepared = self.check(problem, qkv, &*o, lse.as_deref(), opts)?;
        let stats = self.launch(&prepared, qkv, o, lse.as_deref(), opts.time_kernel, 1)?;
        self.synchronize()?;
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
        let prepared = self.check(problem, qkv, &*out, None, opts)?;
        self.launch(&prepared, qkv, out, None, false, warmup)?;
        let stats = self.launch(&prepared, qkv, out, None, true, iters)?;
        self.synchronize()?;
        Ok(stats.iter().filter_map(|s| s.kernel_ms).collect())
    }

    /// Checks a call on device buffers: the lengths through `softmax-core`, this backend's
    /// limits, and that every buffer is this device's.
    fn check<'a, T: CudaElement>(
        &self,
        problem: &Problem<'a>,
        qkv: Qkv<&DeviceBuffer<T>>,
        out: &DeviceBuffer<T>,
        lse: Option<&DeviceBuffer<f32>>,
        opts: &ForwardOptions,
    ) -> Result<Prepared<'a>, CudaError> {
        let lens = BufferLens::of(&qkv, &Out { o: out, lse });
        let prepared = prepare(problem, lens, T::DTYPE, opts, &self.props)?;
        for b in [qkv.q, qkv.k, qkv.v, out] {
            self.owns(b)?;
        }
        if let Some(l) = lse {
            self.owns(l)?;
        }
        Ok(prepared)
    }

    /// Queues `repeat` launches of a prepared call (buffers already checked).
    fn launch<T: CudaElement>(
        &self,
        prepared: &Prepared,
        Qkv { q, k, v }: Qkv<&DeviceBuffer<T>>,
        out: &DeviceBuffer<T>,
        lse: Option<&DeviceBuffer<f32>>,
        time: bool,
        repeat: usize,
    ) -> Result<Vec<ForwardStats>, CudaError> {
        let Some(shape) = prepared.launch else {
            return Ok(vec![ForwardStats::default(); repeat]);
        };
        let (func, origin, registers) = self.function(&shape.variant)?;
        let compile_ms = match origin {
            KernelOrigin::Compiled { ms } => Some(ms),
            _ => None,
        };
        let problem = &prepared.problem;
        let cu = if problem.is_varlen() {
            let b = problem.batch();
            let mut cu_q = Vec::with_capacity(b + 1);
            let mut cu_k = Vec::with_capacity(b + 1);
            cu_q.push(0u32);
            cu_k.push(0u32);
            for i in 0..b {
                let s = problem.seq(i);
                cu_q.push((s.q_start + s.seqlen_q) as u32);
                cu_k.push((s.k_start + s.seqlen_k) as u32);
            }
            let up = |x: &[u32]| {
                self.stream
                    .clone_htod(x)
                    .map_err(|e| CudaError::driver("cuMemcpyHtoD", e))
            };
            Some((up(&cu_q)?, up(&cu_k)?))
        } else {
            None
        };
        let stream = &self.stream;
        let (q_ptr, _gq) = q.slice.device_ptr(stream);
        let (k_ptr, _gk) = k.slice.device_ptr(stream);
        let (v_ptr, _gv) = v.slice.device_ptr(stream);
        let (o_ptr, _go) = out.slice.device_ptr(stream);
        let lse_guard = lse.map(|l| l.slice.device_ptr(stream));
        let cu_guards = cu
            .as_ref()
            .map(|(a, b)| (a.device_ptr(stream), b.device_ptr(stream)));
        let params = KernelParams {
            q: q_ptr,
            k: k_ptr,
            v: v_ptr,
            o: o_ptr,
            lse: lse_guard.as_ref().map_or(0, |g| g.0),
            cu_q: cu_guards.as_ref().map_or(0, |g| g.0 .0),
            cu_k: cu_guards.as_ref().map_or(0, |g| g.1 .0),
            ..prepared.params
        };
        let cfg = LaunchConfig {
            grid_dim: shape.grid,
            block_dim: (shape.block, 1, 1),
            shared_mem_bytes: shape.smem_bytes,
        };
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
            let mut builder = stream.launch_builder(&func);
            builder.arg(&params);
            // SAFETY: `params` matches the kernel's `Params` layout; every pointer in it refers
            // to a live allocation of this context whose length `prepare` checked against the
            // problem's extents (the kernel reads and writes only inside them); the buffers
            // and guards outlive the launch because callers synchronize before returning.
            unsafe { builder.launch(cfg) }.map_err(|e| CudaError::driver("cuLaunchKernel", e))?;
            if let Some((start, end)) = timing {
                end.record(stream)
                    .map_err(|e| CudaError::driver("cuEventRecord", e))?;
                events.push((start, end));
            }
            all.push(ForwardStats {
                launch: Some(shape),
                compile_ms,
                kernel_source: Some(origin),
                registers: Some(registers),
                kernel_ms: None,
            });
        }
        for (stat, (start, end)) in all.iter_mut().zip(&events) {
            stat.kernel_ms = Some(
                start
                    .elapsed_ms(end)
                    .map_err(|e| CudaError::driver("cuEventElapsedTime", e))?,
            );
        }
        // The varlen prefix sums must stay alive until the kernels have run.
        if cu.is_some() {
            self.synchronize()?;
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
        prepare(
            problem,
            BufferLens::of(&qkv, &out),
            T::DTYPE,
            opts,
            &self.props,
        )?;
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
