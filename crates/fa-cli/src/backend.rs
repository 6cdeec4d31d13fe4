//! Backend selection (`--backend auto|cpu|cuda`) and one forward call over typed host tensors.

use crate::error::CliError;
use crate::tensor::{DType, Data};
use softmax_core::{Out, Problem, Qkv};

/// Which backend the user asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    /// CUDA when a device opens, otherwise the CPU.
    #[default]
    Auto,
    /// The SIMD tiled CPU kernel (fa-cpu).
    Cpu,
    /// The CUDA kernels (fa-cuda).
    Cuda,
}

/// The software exp2 choice of the CPU kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Exp2Choice {
    /// The library `exp2`.
    #[default]
    Exact,
    /// FlashAttention-4's cubic polynomial (softmax-core's `exp2_cubic`).
    Cubic,
}

/// Per-call options common to every subcommand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallOptions {
    /// Bound on the worker threads (`None`: all cores).
    pub threads: Option<usize>,
    /// exp2 implementation of the CPU kernel.
    pub exp2: Exp2Choice,
}

/// An opened backend.
pub enum Backend {
    /// fa-cpu.
    Cpu,
    /// fa-cuda on device 0.
    Cuda(Box<fa_cuda::Device>),
}

impl Backend {
    /// Opens the backend the user chose. `Auto` falls back to the CPU when no CUDA device
    /// opens; an explicit `Cuda` without a usable device is an error with the reason.
    pub fn open(choice: BackendChoice) -> Result<Backend, CliError> {
        match choice {
            BackendChoice::Cpu => Ok(Backend::Cpu),
            BackendChoice::Auto => Ok(fa_cuda::Device::open(0)
                .map(|d| Backend::Cuda(Box::new(d)))
                .unwrap_or(Backend::Cpu)),
            BackendChoice::Cuda => fa_cuda::Device::open(0)
                .map(|d| Backend::Cuda(Box::new(d)))
                .map_err(|e| CliError::Backend(format!("CUDA is not usable here: {e}"))),
        }
    }

    /// A short name for tables and JSON (`cpu`, `cuda`).
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda(_) => "cuda",
        }
    }

    /// A longer description (SIMD level, device name).
    pub fn describe(&self) -> String {
        match self {
            Backend::Cpu => format!("cpu (fa-cpu, SIMD: {})", fa_cpu::simd_level()),
            Backend::Cuda(d) => format!("cuda (fa-cuda, {} {})", d.name(), d.arch()),
        }
    }

    /// The dtype a run uses when none is given: f32 on the CPU, bf16 on CUDA (whose kernels
    /// take 16-bit inputs).
    pub fn default_dtype(&self) -> DType {
        match self {
            Backend::Cpu => DType::F32,
            Backend::Cuda(_) => DType::Bf16,
        }
    }

    /// The CPU thread count a run with `threads` uses on this backend (for reports; 0 on
    /// CUDA, where host threads do not compute).
    pub fn effective_threads(&self, threads: Option<usize>) -> usize {
        match self {
            Backend::Cpu => threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            Backend::Cuda(_) => 0,
        }
    }

    /// Runs the forward pass. `q`, `k`, `v` share one dtype; `out` is that dtype or f32.
    /// (The arguments mirror the backends' `forward`.)
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        problem: &Problem,
        q: &Data,
        k: &Data,
        v: &Data,
        out: &mut Data,
        lse: Option<&mut [f32]>,
        opts: CallOptions,
    ) -> Result<(), CliError> {
        match self {
            Backend::Cpu => cpu_forward(problem, q, k, v, out, lse, opts),
            Backend::Cuda(d) => cuda_forward(d, problem, q, k, v, out, lse),
        }
    }

    /// Seconds per call of `iters` timed forward calls after `warmup` untimed ones. On CUDA
    /// the inputs are uploaded once and the kernel is timed with CUDA events (no transfers);
    /// on the CPU each call is timed with the wall clock.
    #[allow(clippy::too_many_arguments)]
    pub fn time_forward(
        &self,
        problem: &Problem,
        q: &Data,
        k: &Data,
        v: &Data,
        out: &mut Data,
        lse: &mut [f32],
        opts: CallOptions,
        warmup: usize,
        iters: usize,
    ) -> Result<Vec<f64>, CliError> {
        match self {
            Backend::Cpu => {
                let mut times = Vec::with_capacity(iters);
                for i in 0..warmup + iters {
                    let start = std::time::Instant::now();
                    cpu_forward(problem, q, k, v, out, Some(&mut *lse), opts)?;
                    if i >= warmup {
                        times.push(start.elapsed().as_secs_f64());
                    }
                }
                Ok(times)
            }
            Backend::Cuda(d) => {
                let cuda = |e: fa_cuda::CudaError| cuda_error(e);
                macro_rules! timed {
                    ($q:expr, $k:expr, $v:expr, $o:expr) => {{
                        let (dq, dk, dv) = (
                            d.upload($q).map_err(cuda)?,
                            d.upload($k).map_err(cuda)?,
                            d.upload($v).map_err(cuda)?,
                        );
                        let mut dout = d.upload(&*$o).map_err(cuda)?;
                        let opts = fa_cuda::ForwardOptions::default();
                        let dqkv = Qkv::new(&dq, &dk, &dv);
                        d.time_forward(problem, dqkv, &mut dout, &opts, warmup, iters)
                            .map_err(cuda)?
                    }};
                }
                let ms = match (q, k, v, out) {
                    (Data::Bf16(q), Data::Bf16(k), Data::Bf16(v), Data::Bf16(o)) => {
                        timed!(q, k, v, o)
                    }
                    (Data::F16(q), Data::F16(k), Data::F16(v), Data::F16(o)) => timed!(q, k, v, o),
                    _ => return Err(CliError::Problem(CUDA_DTYPES)),
                };
                Ok(ms.into_iter().map(|t| t as f64 / 1e3).collect())
            }
        }
    }
}

/// The error for dtypes fa-cuda does not take.
const CUDA_DTYPES: softmax_core::ProblemError = softmax_core::ProblemError::Unsupported {
    what: "fa-cuda takes bf16 or f16 inputs with an output of the same dtype (use --dtype bf16)",
};

fn cuda_error(e: fa_cuda::CudaError) -> CliError {
    match e {
        fa_cuda::CudaError::Problem(p) => CliError::Problem(p),
        other => CliError::Backend(other.to_string()),
    }
}

fn cuda_forward(
    d: &fa_cuda::Device,
    problem: &Problem,
    q: &Data,
    k: &Data,
    v: &Data,
    out: &mut Data,
    lse: Option<&mut [f32]>,
) -> Result<(), CliError> {
    let opts = fa_cuda::ForwardOptions::default();
    let r = match (q, k, v, out) {
        (Data::Bf16(q), Data::Bf16(k), Data::Bf16(v), Data::Bf16(o)) => {
            d.forward_host(problem, Qkv::new(q, k, v), Out { o, lse }, &opts)
        }
        (Data::F16(q), Data::F16(k), Data::F16(v), Data::F16(o)) => {
            d.forward_host(problem, Qkv::new(q, k, v), Out { o, lse }, &opts)
        }
        _ => return Err(CliError::Problem(CUDA_DTYPES)),
    };
    r.map(|_| ()).map_err(cuda_error)
}

fn cpu_forward(
    problem: &Problem,
    q: &Data,
    k: &Data,
    v: &Data,
    out: &mut Data,
    lse: Option<&mut [f32]>,
    opts: CallOptions,
) -> Result<(), CliError> {
    let fopts = fa_cpu::ForwardOptions {
        threads: opts.threads,
        exp2: match opts.exp2 {
            Exp2Choice::Exact => fa_cpu::Exp2Impl::Exact,
            Exp2Choice::Cubic => fa_cpu::Exp2Impl::Cubic,
        },
        ..Default::default()
    };
    macro_rules! call {
        ($q:expr, $k:expr, $v:expr, $o:expr) => {
            fa_cpu::forward(problem, Qkv::new($q, $k, $v), Out { o: $o, lse }, &fopts)
                .map(|_| ())
                .map_err(CliError::from)
        };
    }
    let out_dtype = dtype_of(out);
    match (q, k, v, out) {
        (Data::F32(q), Data::F32(k), Data::F32(v), Data::F32(o)) => call!(q, k, v, o),
        (Data::Bf16(q), Data::Bf16(k), Data::Bf16(v), Data::Bf16(o)) => call!(q, k, v, o),
        (Data::Bf16(q), Data::Bf16(k), Data::Bf16(v), Data::F32(o)) => call!(q, k, v, o),
        (Data::F16(q), Data::F16(k), Data::F16(v), Data::F16(o)) => call!(q, k, v, o),
        (Data::F16(q), Data::F16(k), Data::F16(v), Data::F32(o)) => call!(q, k, v, o),
        _ => Err(CliError::Shape(format!(
            "q, k and v must share one dtype and the output be that dtype or f32 \
             (got q {}, k {}, v {}, output {})",
            dtype_of(q),
            dtype_of(k),
            dtype_of(v),
            out_dtype
        ))),
    }
}

fn dtype_of(d: &Data) -> DType {
    match d {
        Data::F32(_) => DType::F32,
        Data::Bf16(_) => DType::Bf16,
        Data::F16(_) => DType::F16,
    }
}
