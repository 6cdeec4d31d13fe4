//! Backend choice, capabilities and the forward call over dtype-erased host tensors.

use crate::tensor::{TensorMut, TensorRef};
use softmax_core::{BufferLens, DType, Out, Problem, ProblemError, Qkv, RescalePolicy};

/// A backend, as a name (what [`Backend::kind`] reports).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendKind {
    /// fa-cpu: the SIMD tiled CPU kernel.
    Cpu,
    /// fa-cuda: the NVRTC-compiled CUDA kernels.
    Cuda,
}

impl BackendKind {
    /// The short name used in tables and JSON (`cpu`, `cuda`).
    pub const fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }

    /// What this backend can run, known without opening it.
    pub const fn capabilities(self) -> Capabilities {
        match self {
            BackendKind::Cpu => Capabilities {
                input_dtypes: &[DType::F32, DType::Bf16, DType::F16],
                output_dtypes: OutputDTypes::InputOrF32,
                max_head_dim: softmax_core::MAX_HEAD_DIM,
                head_dim_multiple: 1,
                stride_multiple: 1,
                masks: true,
                softcap: true,
                varlen: true,
                gqa: true,
                lse: true,
                kv_cache: true,
                sinks: true,
            },
            BackendKind::Cuda => Capabilities {
                input_dtypes: &[DType::Bf16, DType::F16],
                output_dtypes: OutputDTypes::Input,
                max_head_dim: softmax_core::MAX_HEAD_DIM,
                head_dim_multiple: 8,
                stride_multiple: 8,
                masks: true,
                softcap: true,
                varlen: true,
                gqa: true,
                lse: true,
                kv_cache: true,
                sinks: false,
            },
        }
    }
}

/// Which backend a caller asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BackendChoice {
    /// CUDA when a device opens and takes the call's dtypes, otherwise the CPU.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// CUDA; an error (with the reason) where no device opens.
    Cuda,
}

impl BackendChoice {
    /// Every choice, in declaration order.
    pub const ALL: [BackendChoice; 3] =
        [BackendChoice::Auto, BackendChoice::Cpu, BackendChoice::Cuda];

    /// The short name (`auto`, `cpu`, `cuda`).
    pub const fn name(self) -> &'static str {
        match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Cpu => "cpu",
            BackendChoice::Cuda => "cuda",
        }
    }

    /// The choice of a short name ([`BackendChoice::name`]'s inverse).
    pub fn from_name(name: &str) -> Option<BackendChoice> {
        BackendChoice::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// The element types of one call: Q, K and V share `input`; O is `output`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DTypes {
    /// Dtype of Q, K and V.
    pub input: DType,
    /// Dtype of O.
    pub output: DType,
}

impl DTypes {
    /// Inputs and output of one dtype.
    pub const fn same(dtype: DType) -> DTypes {
        DTypes {
            input: dtype,
            output: dtype,
        }
    }
}

/// Which output dtypes a backend writes for a given input dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OutputDTypes {
    /// O in the inputs' dtype only.
    Input,
    /// O in the inputs' dtype or f32.
    InputOrF32,
}

/// What a backend can run. [`Backend::check`] applies these (and the backend's size limits)
/// to one problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Dtypes of Q, K and V it takes.
    pub input_dtypes: &'static [DType],
    /// Dtypes of O it writes, relative to the input dtype.
    pub output_dtypes: OutputDTypes,
    /// Largest head dimension (of Q/K and of V/O).
    pub max_head_dim: usize,
    /// Head dimensions must be multiples of this.
    pub head_dim_multiple: usize,
    /// Strides (in elements) must be multiples of this.
    pub stride_multiple: usize,
    /// Causal and sliding-window masks.
    pub masks: bool,
    /// Softcap of the scores.
    pub softcap: bool,
    /// Packed variable-length batches (`cu_seqlens`).
    pub varlen: bool,
    /// Fewer KV heads than query heads (GQA/MQA).
    pub gqa: bool,
    /// The log-sum-exp output.
    pub lse: bool,
    /// K/V read from a padded or paged KV cache (decode, split-KV; [`Options::kv_splits`]).
    pub kv_cache: bool,
    /// Learnable attention sinks ([`softmax_core::ProblemDesc::sinks`]): the forward, and
    /// their gradient through [`Backend::backward_sinks`].
    pub sinks: bool,
}

impl Capabilities {
    /// Whether the backend takes these dtypes.
    pub fn takes(&self, dtypes: DTypes) -> bool {
        self.input_dtypes.contains(&dtypes.input)
            && (dtypes.output == dtypes.input
                || (self.output_dtypes == OutputDTypes::InputOrF32 && dtypes.output == DType::F32))
    }
}

/// The software exp2 choice of the CPU kernel (CUDA uses the hardware `ex2`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Exp2 {
    /// The library's choice ([`fa_cpu::Exp2Impl::Auto`]): the cubic in the AMX forward, whose
    /// `P·V` takes the probabilities rounded to bf16, the accurate polynomial everywhere else.
    #[default]
    Auto,
    /// The accurate polynomial (keeps f32 within its 1e-5 bound).
    Exact,
    /// FlashAttention-4's cubic ([`softmax_core::EXP2_CUBIC`]).
    Cubic,
}

/// Options of a call beyond the problem. The default is every backend's default.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Options {
    /// CPU threads in all, the caller included (`None`: rayon's pool); ignored on CUDA.
    pub threads: Option<usize>,
    /// exp2 of the CPU kernel; ignored on CUDA.
    pub exp2: Exp2,
    /// When rows rescale their accumulators (default: FlashAttention-4's threshold, τ = 8).
    pub rescale: RescalePolicy<f32>,
    /// CUDA tile sizes instead of the tuned choice (tuning experiments); ignored on the CPU.
    pub tiles: Option<fa_cuda::Tiles>,
    /// CUDA kernel family (default: the measured-best); ignored on the CPU.
    pub family: fa_cuda::KernelFamilyChoice,
    /// CUDA sm90 load pipeline instead of the plan's choice (tuning); ignored on the CPU.
    pub sm90_pipeline: Option<fa_cuda::Sm90Pipeline>,
    /// Split-KV: the number of key splits per task (`None`: the backend's choice from the
    /// problem; on the CPU KV-cache problems split, others do not; CUDA splits only KV-cache
    /// problems). Results agree with the unsplit call to rounding.
    pub kv_splits: Option<usize>,
    /// CPU instruction set of the forward and the backward (default `Auto`: the best this CPU
    /// has, AMX tiles for bf16 and f16 included). `Avx512f` keeps them off AMX; a level this
    /// CPU lacks is an error. Ignored on CUDA.
    pub cpu_simd: CpuSimd,
    /// The CPU decode loop's options ([`fa_cpu::DecodeOptions`]: prefetch schedule, AMX
    /// `P·V`, `vdpbf16ps` `Q·Kᵀ`; default the library's tuned choice). Ignored on CUDA.
    pub cpu_decode: CpuDecodeOptions,
}

pub use fa_cpu::DecodeOptions as CpuDecodeOptions;
pub use fa_cpu::DecodePrefetch as CpuDecodePrefetch;
pub use fa_cpu::SimdLevel as CpuSimd;

/// What a forward call reported; fields a backend does not measure are `None`.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct ForwardStats {
    /// CPU: (row panel, key tile) pairs computed.
    pub tiles_computed: Option<u64>,
    /// CPU: (row panel, key tile) pairs the mask skipped.
    pub tiles_skipped: Option<u64>,
    /// CPU: rescale decisions.
    pub rescale: Option<softmax_core::RescaleStats>,
    /// CPU: the largest number of key splits of any task (1: unsplit).
    pub kv_splits: Option<usize>,
    /// CUDA: NVRTC compile time in milliseconds, when this call compiled the kernel.
    pub compile_ms: Option<f64>,
    /// CUDA: where the kernel came from (compiled now, the disk cache, the process cache).
    pub kernel_source: Option<fa_cuda::KernelOrigin>,
    /// CUDA: kernel time in milliseconds, when measured.
    pub kernel_ms: Option<f64>,
    /// CUDA: registers per thread of the kernel.
    pub registers: Option<u32>,
    /// CUDA: the launch (variant, grid, block, shared memory).
    pub launch: Option<fa_cuda::LaunchShape>,
}

/// Why a call failed.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// The problem, its buffers or its dtypes were rejected before any work (softmax-core's
    /// typed error; `Unsupported` when the backend cannot run it).
    Problem(ProblemError),
    /// The backend asked for explicitly cannot be opened here.
    Unavailable {
        /// The backend.
        backend: BackendKind,
        /// Why (no driver, no NVRTC, no device, …).
        reason: String,
    },
    /// The CUDA backend failed while running (driver, compilation).
    Cuda(fa_cuda::CudaError),
    /// A buffer given by address was refused before any work ([`crate::host`]: null,
    /// misaligned, past the address space, or an output overlapping another buffer).
    InvalidArgument(String),
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Error::Problem(e) => write!(f, "{e}"),
            Error::Unavailable {
                backend: BackendKind::Cuda,
                reason,
            } => write!(f, "CUDA is not usable here: {reason}"),
            Error::Unavailable { backend, reason } => {
                write!(f, "{} is not usable here: {reason}", backend.name())
            }
            Error::Cuda(e) => write!(f, "{e}"),
            Error::InvalidArgument(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Problem(e) => Some(e),
            _ => None,
        }
    }
}

impl From<ProblemError> for Error {
    fn from(e: ProblemError) -> Self {
        Error::Problem(e)
    }
}

impl From<fa_cuda::CudaError> for Error {
    fn from(e: fa_cuda::CudaError) -> Self {
        match e {
            fa_cuda::CudaError::Problem(p) => Error::Problem(p),
            other => Error::Cuda(other),
        }
    }
}

/// Fills the CUDA kernel cache on disk with every kernel the launch choice can select, for
/// `arch` (e.g. `sm_90a`) or, when `None`, for the architecture of CUDA device 0. NVRTC only:
/// with `arch` given no GPU is needed. A later process then loads cubins instead of compiling
/// them (`FA_CUDA_CACHE_DIR` moves the cache, `FA_CUDA_CACHE=off` turns it off).
pub fn warmup(arch: Option<&str>) -> Result<fa_cuda::PrecompileReport, Error> {
    let arch = match arch {
        Some(a) => a.to_string(),
        None => fa_cuda::Device::open(0)
            .map_err(|e| Error::Unavailable {
                backend: BackendKind::Cuda,
                reason: format!(
                    "{e} (give an architecture, e.g. sm_90a, to compile without a GPU)"
                ),
            })?
            .arch()
            .to_string(),
    };
    Ok(fa_cuda::compile::precompile_all(&arch)?)
}

const MIXED_INPUTS: ProblemError = ProblemError::Unsupported {
    what: "q, k and v must share one dtype",
};
const CPU_DTYPES: ProblemError = fa_cpu::FORWARD_DTYPES;
const CUDA_DTYPES: ProblemError = ProblemError::Unsupported {
    what: "fa-cuda takes bf16 or f16 inputs with an output of the same dtype",
};

/// An opened backend.
///
/// A closed enum inside an opaque struct rather than a trait object: there are exactly two
/// backends, each forward call needs a typed dispatch over the tensors' dtypes that a trait
/// object could not express without generics, and a struct keeps the C ABI's handle one
/// opaque pointer while new backends stay a non-breaking change.
#[derive(Debug)]
pub struct Backend {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Cpu,
    Cuda(Box<fa_cuda::Device>),
}

impl Backend {
    /// The CPU backend (always available).
    pub fn cpu() -> Backend {
        Backend { inner: Inner::Cpu }
    }

    /// Opens the backend chosen. `Auto` takes CUDA when device 0 opens, otherwise the CPU;
    /// an explicit `Cuda` without a usable device is [`Error::Unavailable`] with the reason.
    pub fn open(choice: BackendChoice) -> Result<Backend, Error> {
        match choice {
            BackendChoice::Cpu => Ok(Backend::cpu()),
            BackendChoice::Auto => Ok(Backend::open_cuda().unwrap_or_else(|_| Backend::cpu())),
            BackendChoice::Cuda => Backend::open_cuda(),
        }
    }

    /// Opens the backend chosen for calls of `dtypes`: like [`Backend::open`], except that
    /// `Auto` takes CUDA only when it also takes these dtypes (f32 runs on the CPU).
    pub fn open_for(choice: BackendChoice, dtypes: DTypes) -> Result<Backend, Error> {
        if choice == BackendChoice::Auto && !BackendKind::Cuda.capabilities().takes(dtypes) {
            return Ok(Backend::cpu());
        }
        Backend::open(choice)
    }

    fn open_cuda() -> Result<Backend, Error> {
        fa_cuda::Device::open(0)
            .map(|d| Backend {
                inner: Inner::Cuda(Box::new(d)),
            })
            .map_err(|e| Error::Unavailable {
                backend: BackendKind::Cuda,
                reason: e.to_string(),
            })
    }

    /// Which backend this is.
    pub fn kind(&self) -> BackendKind {
        match self.inner {
            Inner::Cpu => BackendKind::Cpu,
            Inner::Cuda(_) => BackendKind::Cuda,
        }
    }

    /// The CUDA device of a CUDA backend (`None` on the CPU).
    pub(crate) fn cuda_device(&self) -> Option<&fa_cuda::Device> {
        match &self.inner {
            Inner::Cpu => None,
            Inner::Cuda(d) => Some(d),
        }
    }

    /// A short name for tables and JSON (`cpu`, `cuda`).
    pub fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// A longer description (SIMD level; device name and architecture).
    pub fn describe(&self) -> String {
        match &self.inner {
            Inner::Cpu => format!("cpu (fa-cpu, SIMD: {})", fa_cpu::simd_level()),
            Inner::Cuda(d) => format!("cuda (fa-cuda, {} {})", d.name(), d.arch()),
        }
    }

    /// [`Backend::describe`] for calls with `opts`: on the CPU, the instruction set
    /// `opts.cpu_simd` resolves to (what the calls run on; `Auto`: the detected one).
    pub fn describe_for(&self, opts: &Options) -> String {
        match &self.inner {
            Inner::Cpu => format!("cpu (fa-cpu, SIMD: {})", opts.cpu_simd.resolve().name()),
            Inner::Cuda(_) => self.describe(),
        }
    }

    /// What this backend can run.
    pub fn capabilities(&self) -> Capabilities {
        self.kind().capabilities()
    }

    /// The dtype to use when the caller has no preference: f32 on the CPU, bf16 on CUDA
    /// (whose kernels take 16-bit inputs).
    pub fn default_dtype(&self) -> DType {
        match self.kind() {
            BackendKind::Cpu => DType::F32,
            BackendKind::Cuda => DType::Bf16,
        }
    }

    /// The CPU threads a call with `threads` uses here (for reports; 0 on CUDA, where host
    /// threads do not compute).
    pub fn effective_threads(&self, threads: Option<usize>) -> usize {
        match self.kind() {
            BackendKind::Cpu => threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            BackendKind::Cuda => 0,
        }
    }

    /// Whether this backend can run `problem` with `dtypes`, answered before any work:
    /// `Err(ProblemError::Unsupported { .. })` names what it lacks.
    pub fn check(&self, problem: &Problem, dtypes: DTypes) -> Result<(), ProblemError> {
        check_kind(self.kind(), problem, dtypes)
    }

    /// Forward attention on host tensors: `out.o` (and `out.lse`, natural log,
    /// FlashAttention's layout) receive `softmax(QKᵀ·scale)·V`. Q, K and V share one dtype.
    /// Everything is checked ([`Backend::check`], buffer lengths) before anything is written.
    /// On CUDA the tensors are copied to the device and back.
    pub fn forward(
        &self,
        problem: &Problem,
        qkv: Qkv<TensorRef<'_>>,
        out: Out<TensorMut<'_>, &mut [f32]>,
        opts: &Options,
    ) -> Result<ForwardStats, Error> {
        let dtypes = dtypes_of(&qkv, &out.o)?;
        self.check(problem, dtypes)?;
        problem.check_buffers(BufferLens::of(&qkv, &out))?;
        match &self.inner {
            Inner::Cpu => cpu_forward(problem, qkv, out, opts),
            Inner::Cuda(d) => cuda_forward(d, problem, qkv, out, opts),
        }
    }

    /// Seconds per call of `iters` timed forward calls after `warmup` untimed ones. On the
    /// CPU each call is timed with the wall clock (LSE written when given); on CUDA the inputs
    /// are uploaded once and each kernel is timed with CUDA events (no transfers, no LSE, the
    /// output left on the device).
    pub fn time_forward(
        &self,
        problem: &Problem,
        qkv: Qkv<TensorRef<'_>>,
        mut out: Out<TensorMut<'_>, &mut [f32]>,
        opts: &Options,
        warmup: usize,
        iters: usize,
    ) -> Result<Vec<f64>, Error> {
        let dtypes = dtypes_of(&qkv, &out.o)?;
        self.check(problem, dtypes)?;
        problem.check_buffers(BufferLens::of(&qkv, &out))?;
        match &self.inner {
            Inner::Cpu => {
                // `iters` comes from the user: a count too large for memory is a typed error,
                // not an abort.
                let calls = warmup.checked_add(iters).ok_or(ProblemError::Overflow)?;
                let mut times = Vec::new();
                times
                    .try_reserve_exact(iters)
                    .map_err(|_| ProblemError::OutOfMemory {
                        what: "the timing list",
                        bytes: iters.saturating_mul(std::mem::size_of::<f64>()),
                    })?;
                for i in 0..calls {
                    let call = Out {
                        o: out.o.reborrow(),
                        lse: out.lse.as_deref_mut(),
                    };
                    let start = std::time::Instant::now();
                    cpu_forward(problem, qkv, call, opts)?;
                    if i >= warmup {
                        times.push(start.elapsed().as_secs_f64());
                    }
                }
                Ok(times)
            }
            Inner::Cuda(d) => {
                let fopts = cuda_options(opts);
                macro_rules! timed {
                    ($q:expr, $k:expr, $v:expr, $o:expr) => {{
                        let (dq, dk, dv) = (d.upload($q)?, d.upload($k)?, d.upload($v)?);
                        let mut dout = d.upload(&*$o)?;
                        let dqkv = Qkv::new(&dq, &dk, &dv);
                        d.time_forward(problem, dqkv, &mut dout, &fopts, warmup, iters)?
                    }};
                }
                let ms = match (qkv.q, qkv.k, qkv.v, out.o) {
                    (
                        TensorRef::Bf16(q),
                        TensorRef::Bf16(k),
                        TensorRef::Bf16(v),
                        TensorMut::Bf16(o),
                    ) => {
                        timed!(q, k, v, o)
                    }
                    (
                        TensorRef::F16(q),
                        TensorRef::F16(k),
                        TensorRef::F16(v),
                        TensorMut::F16(o),
                    ) => {
                        timed!(q, k, v, o)
                    }
                    _ => return Err(CUDA_DTYPES.into()),
                };
                Ok(ms.into_iter().map(|t| t as f64 / 1e3).collect())
            }
        }
    }
}

/// The dtypes of a call's tensors (Q, K and V must agree).
fn dtypes_of(qkv: &Qkv<TensorRef<'_>>, o: &TensorMut<'_>) -> Result<DTypes, ProblemError> {
    let input = qkv.q.dtype();
    if qkv.k.dtype() != input || qkv.v.dtype() != input {
        return Err(MIXED_INPUTS);
    }
    Ok(DTypes {
        input,
        output: o.dtype(),
    })
}

/// [`Backend::check`] for a kind: the capabilities, then the backend's own limits (the same
/// rules fa-cpu and fa-cuda apply when called, so that the answer comes before any work).
fn check_kind(kind: BackendKind, problem: &Problem, dtypes: DTypes) -> Result<(), ProblemError> {
    let caps = kind.capabilities();
    let unsupported = |what: &'static str| Err(ProblemError::Unsupported { what });
    if !caps.takes(dtypes) {
        return Err(match kind {
            BackendKind::Cpu => CPU_DTYPES,
            BackendKind::Cuda => CUDA_DTYPES,
        });
    }
    if problem.sinks().is_some() && !caps.sinks {
        return unsupported("this backend does not run attention sinks yet (the CPU backend does)");
    }
    if problem.head_dim().max(problem.head_dim_v()) > caps.max_head_dim {
        return unsupported("the head dimension is larger than the backend supports");
    }
    // The rules themselves live in each backend, beside the code they protect.
    match kind {
        BackendKind::Cpu => fa_cpu::supports(problem),
        BackendKind::Cuda => fa_cuda::supports(problem, dtypes.input),
    }
}

fn cuda_options(opts: &Options) -> fa_cuda::ForwardOptions {
    fa_cuda::ForwardOptions {
        rescale: opts.rescale,
        tiles: opts.tiles,
        family: opts.family,
        sm90_pipeline: opts.sm90_pipeline,
        splits: opts.kv_splits.map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        ..fa_cuda::ForwardOptions::default()
    }
}

fn cuda_forward(
    d: &fa_cuda::Device,
    problem: &Problem,
    qkv: Qkv<TensorRef<'_>>,
    out: Out<TensorMut<'_>, &mut [f32]>,
    opts: &Options,
) -> Result<ForwardStats, Error> {
    let fopts = cuda_options(opts);
    let Out { o, lse } = out;
    let stats = match (qkv.q, qkv.k, qkv.v, o) {
        (TensorRef::Bf16(q), TensorRef::Bf16(k), TensorRef::Bf16(v), TensorMut::Bf16(o)) => {
            d.forward_host(problem, Qkv::new(q, k, v), Out { o, lse }, &fopts)?
        }
        (TensorRef::F16(q), TensorRef::F16(k), TensorRef::F16(v), TensorMut::F16(o)) => {
            d.forward_host(problem, Qkv::new(q, k, v), Out { o, lse }, &fopts)?
        }
        _ => return Err(CUDA_DTYPES.into()),
    };
    Ok(ForwardStats {
        compile_ms: stats.compile_ms,
        kernel_source: stats.kernel_source,
        kernel_ms: stats.kernel_ms.map(f64::from),
        registers: stats.registers,
        launch: stats.launch,
        ..ForwardStats::default()
    })
}

fn cpu_forward(
    problem: &Problem,
    qkv: Qkv<TensorRef<'_>>,
    out: Out<TensorMut<'_>, &mut [f32]>,
    opts: &Options,
) -> Result<ForwardStats, Error> {
    let fopts = fa_cpu::ForwardOptions {
        threads: opts.threads,
        simd: opts.cpu_simd,
        exp2: match opts.exp2 {
            Exp2::Auto => fa_cpu::Exp2Impl::Auto,
            Exp2::Exact => fa_cpu::Exp2Impl::Exact,
            Exp2::Cubic => fa_cpu::Exp2Impl::Cubic,
        },
        rescale: opts.rescale,
        kv_splits: opts.kv_splits,
        decode: opts.cpu_decode,
        ..Default::default()
    };
    let stats = fa_cpu::forward_dyn(problem, qkv, out, &fopts, None)?;
    Ok(ForwardStats {
        tiles_computed: Some(stats.tiles_computed),
        tiles_skipped: Some(stats.tiles_skipped),
        rescale: Some(stats.rescale),
        kv_splits: Some(stats.kv_splits),
        ..ForwardStats::default()
    })
}

/// Writes new keys and values into a KV cache in host memory at each sequence's position
/// (see [`softmax_core::AppendDesc`]; padded or paged), in place, whatever backend then reads
/// it. The cache and the new tokens share one dtype (f32, bf16 or f16). Buffer lengths are
/// checked before anything is written: on error the cache is untouched. The lengths are not
/// changed: add `seqlen_new` to `seqused_k` for the attention call that follows.
pub fn append_kv(
    append: &softmax_core::Append,
    k_new: TensorRef<'_>,
    v_new: TensorRef<'_>,
    k_cache: TensorMut<'_>,
    v_cache: TensorMut<'_>,
) -> Result<(), Error> {
    fa_cpu::append_kv_dyn(append, k_new, v_new, k_cache, v_cache)?;
    Ok(())
}

/// [`check_kind`] for the crate's tests: the CUDA rules without a device.
#[cfg(test)]
pub(crate) fn check_kind_for_tests(
    kind: BackendKind,
    problem: &Problem,
    dtypes: DTypes,
) -> Result<(), ProblemError> {
    check_kind(kind, problem, dtypes)
}
