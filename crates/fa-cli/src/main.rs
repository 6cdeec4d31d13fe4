//! The `fa` command: run, verify, bench, plan and demo exact attention.
//!
//! `fa` with no arguments runs `fa demo`. See `fa --help` and `fa <command> --help`.

use clap::{Args, Parser, Subcommand};
use fa_cli::backend::{parse_dtype, Backend, BackendArg, Exp2Arg, Options};
use fa_cli::bench::{self, BenchShape};
use fa_cli::demo::{demo, DemoRequest};
use fa_cli::peers;
use fa_cli::plan;
use fa_cli::run::{parse_window, run, RunRequest};
use fa_cli::verify;
use fa_cli::CliError;
use flash_attention::{BackendKind, Tiles};
use softmax_core::DType;
use std::path::PathBuf;
use std::process::ExitCode;

/// Counts heap bytes, so that `fa bench --backward` reports what calls allocate.
#[global_allocator]
static ALLOCATOR: fa_cli::alloc_count::Counting = fa_cli::alloc_count::Counting;

#[derive(Parser)]
#[command(
    name = "fa",
    version,
    about = "Exact attention (FlashAttention-style tiling) on CPU and GPU: run, verify, bench, plan, demo",
    long_about = "Exact attention (FlashAttention-style tiling) on CPU and GPU.\n\n\
                  With no command, `fa` runs `fa demo`."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Attention over Q, K, V from .npy/.safetensors files (BSHD); writes O (and the LSE).
    Run(RunArgs),
    /// Check a backend against the f64 reference on random problems; non-zero exit on failure.
    Verify(VerifyArgs),
    /// Time the forward pass: the FlashAttention paper shapes, or the given ones.
    Bench(BenchArgs),
    /// Memory arithmetic: KV cache (MHA/GQA/MQA) and naive score matrix vs the tiled kernel;
    /// --decode: the bandwidth bound on time per decoded token, beside a measured step.
    Plan(PlanArgs),
    /// One long sequence on the best backend, checked against the reference on sampled rows.
    Demo(DemoArgs),
    /// Compile every CUDA kernel into the disk cache (for device 0's arch, or --arch without a GPU).
    Warmup(WarmupArgs),
    /// Measure the software exp2's max relative error over every f32 input in [-125, 128).
    #[command(name = "exp2-error")]
    Exp2Error,
}

/// Backend, threads and exp2, shared by the compute commands.
#[derive(Args, Clone, Copy)]
struct ComputeArgs {
    /// Backend: auto (CUDA when a device opens, for bf16/f16; else the CPU), cpu or cuda.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Worker threads, 1 to the machine's available parallelism (default: all of them).
    #[arg(long, value_parser = parse_threads, allow_negative_numbers = true)]
    threads: Option<usize>,
    /// exp2 of the CPU kernel: auto (the cubic in the AMX forward, whose P is rounded to bf16;
    /// exact elsewhere), exact (library polynomial) or cubic (FlashAttention-4 polynomial).
    #[arg(long, value_enum, default_value_t = Exp2Arg::Auto)]
    exp2: Exp2Arg,
    /// Split-KV: key splits per task, merged by LSE (default: the backend's choice; KV-cache
    /// problems split, others do not). Results agree with the unsplit call to rounding.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    splits: Option<u64>,
    /// CUDA kernel family: auto (the measured-best), sm80 (mma.sync, any GPU) or sm90 (wgmma,
    /// Hopper; the sm80 family where it does not cover the problem).
    #[arg(long, value_enum, default_value_t = FamilyArg::Auto)]
    family: FamilyArg,
    /// CUDA sm90 load pipeline (tuning; default: the plan's choice).
    #[arg(long, value_enum)]
    sm90_pipeline: Option<PipelineArg>,
    /// CPU instruction set: auto (the best this CPU has: AMX tiles for bf16/f16 where
    /// present), amx, avx512f (AVX-512 without AMX), avx2 or scalar; a set this CPU lacks is
    /// an error.
    #[arg(long, value_enum, default_value_t = SimdArg::Auto)]
    simd: SimdArg,
    /// CPU decode: the streaming loop's software prefetch schedule: phase (the default), off,
    /// next, ahead:N or phase+ahead:N (N keys, 1 to 64). Results never depend on it.
    #[arg(long, value_parser = parse_prefetch, default_value = "phase")]
    prefetch: flash_attention::CpuDecodePrefetch,
    /// CPU decode on AMX: keep P·V in f32 on the SIMD kernels instead of AMX tiles (which
    /// round P to bf16; bf16/f16 outputs only).
    #[arg(long)]
    no_amx_pv: bool,
    /// CPU decode without AMX tiles: multiply bf16 Q·Kᵀ pairs with vdpbf16ps where the CPU
    /// has AVX512-BF16 (at the avx512f level; meant for AMD Zen 4 and later).
    #[arg(long)]
    bf16_dots: bool,
}

/// Parses `--prefetch` ([`flash_attention::CpuDecodePrefetch::parse`]).
fn parse_prefetch(s: &str) -> Result<flash_attention::CpuDecodePrefetch, String> {
    flash_attention::CpuDecodePrefetch::parse(s.trim()).ok_or_else(|| {
        format!("{s:?}: expected off, phase, next, ahead:N or phase+ahead:N (N from 1 to 64)")
    })
}

/// `--simd`: the CPU instruction set.
#[derive(Clone, Copy, clap::ValueEnum)]
enum SimdArg {
    /// The best this CPU has.
    Auto,
    /// AVX-512 with AMX tiles for bf16 and f16.
    Amx,
    /// AVX-512 without AMX.
    Avx512f,
    /// AVX2 with FMA.
    Avx2,
    /// Portable scalar code.
    Scalar,
}

impl From<SimdArg> for flash_attention::CpuSimd {
    fn from(s: SimdArg) -> Self {
        match s {
            SimdArg::Auto => flash_attention::CpuSimd::Auto,
            SimdArg::Amx => flash_attention::CpuSimd::Amx,
            SimdArg::Avx512f => flash_attention::CpuSimd::Avx512f,
            SimdArg::Avx2 => flash_attention::CpuSimd::Avx2Fma,
            SimdArg::Scalar => flash_attention::CpuSimd::Scalar,
        }
    }
}

/// `--sm90-pipeline`: the sm90 family's load pipeline.
#[derive(Clone, Copy, clap::ValueEnum)]
enum PipelineArg {
    /// cp.async loads by every thread.
    Cpasync,
    /// A TMA producer warpgroup, independent consumers.
    Ws,
    /// As ws, with each consumer's softmax overlapping its previous PV.
    Wso,
}

impl From<PipelineArg> for flash_attention::Sm90Pipeline {
    fn from(p: PipelineArg) -> Self {
        match p {
            PipelineArg::Cpasync => flash_attention::Sm90Pipeline::CpAsync,
            PipelineArg::Ws => flash_attention::Sm90Pipeline::WarpSpecialized,
            PipelineArg::Wso => flash_attention::Sm90Pipeline::WarpSpecializedOverlap,
        }
    }
}

/// `--family`: the CUDA kernel family.
#[derive(Clone, Copy, clap::ValueEnum)]
enum FamilyArg {
    /// The measured-best family.
    Auto,
    /// The mma.sync family.
    Sm80,
    /// The wgmma family (Hopper).
    Sm90,
}

impl From<FamilyArg> for flash_attention::KernelFamilyChoice {
    fn from(f: FamilyArg) -> Self {
        match f {
            FamilyArg::Auto => flash_attention::KernelFamilyChoice::Auto,
            FamilyArg::Sm80 => flash_attention::KernelFamilyChoice::Sm80,
            FamilyArg::Sm90 => flash_attention::KernelFamilyChoice::Sm90,
        }
    }
}

impl ComputeArgs {
    fn options(&self) -> Options {
        Options {
            threads: self.threads,
            exp2: self.exp2.into(),
            family: self.family.into(),
            sm90_pipeline: self.sm90_pipeline.map(Into::into),
            cpu_simd: self.simd.into(),
            cpu_decode: flash_attention::CpuDecodeOptions {
                prefetch: self.prefetch,
                amx_pv: !self.no_amx_pv,
                bf16_dots: self.bf16_dots,
            },
            kv_splits: self
                .splits
                .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            ..Options::default()
        }
    }
}

#[derive(Args)]
struct RunArgs {
    /// Queries: [batch, seqlen_q, heads_q, head_dim] (.npy, or tensor `q` of a .safetensors).
    #[arg(long)]
    q: PathBuf,
    /// Keys: [batch, seqlen_k, heads_kv, head_dim] (tensor `k` of a .safetensors).
    #[arg(long)]
    k: PathBuf,
    /// Values: [batch, seqlen_k, heads_kv, head_dim_v] (tensor `v` of a .safetensors).
    #[arg(long)]
    v: PathBuf,
    /// Output [batch, seqlen_q, heads_q, head_dim_v], in the inputs' dtype; format from the
    /// extension (.npy / .safetensors, tensor `out`), else the input's format.
    #[arg(short, long)]
    output: PathBuf,
    /// Also write the LSE (natural log, f32, [batch, heads_q, seqlen_q]); may be the output's
    /// .safetensors path (tensor `lse`).
    #[arg(long)]
    lse: Option<PathBuf>,
    /// Causal mask, bottom-right aligned when seqlen_q ≠ seqlen_k.
    #[arg(long)]
    causal: bool,
    /// Sliding window LEFT,RIGHT around the aligned diagonal (-1: unbounded).
    #[arg(long, value_parser = parse_window, allow_hyphen_values = true)]
    window: Option<(i64, i64)>,
    /// Softcap: cap·tanh(s/cap) on the scaled scores (0: none).
    #[arg(long, allow_negative_numbers = true)]
    softcap: Option<f32>,
    /// Softmax scale, finite and non-zero (default 1/sqrt(head_dim)).
    #[arg(long, allow_negative_numbers = true)]
    scale: Option<f32>,
    /// After the run, check this many sampled rows against the f64 reference.
    #[arg(long, default_value_t = 0)]
    check_rows: usize,
    /// ∂L/∂O for the backward pass (the output's shape and dtype): with --dq, --dk and --dv,
    /// the gradients are computed after the forward (CPU; not over a KV cache).
    #[arg(long, requires_all = ["dq", "dk", "dv"], conflicts_with = "seqused_k")]
    dout: Option<PathBuf>,
    /// Where dQ goes (Q's shape).
    #[arg(long, requires = "dout")]
    dq: Option<PathBuf>,
    /// Where dK goes (K's shape).
    #[arg(long, requires = "dout")]
    dk: Option<PathBuf>,
    /// Where dV goes (V's shape).
    #[arg(long, requires = "dout")]
    dv: Option<PathBuf>,
    /// Gradient dtype: the input dtype (default) or f32.
    #[arg(long, value_parser = parse_dtype, requires = "dout")]
    grad_dtype: Option<DType>,
    /// Decode over a KV cache: the keys each sequence uses (int32 .npy, one entry per
    /// sequence). K/V are then a padded cache (batch, capacity, heads_kv, head_dim), or a paged
    /// one with --block-table; causal and window masks align bottom-right against each
    /// sequence's length.
    #[arg(long)]
    seqused_k: Option<PathBuf>,
    /// Paged KV cache: the block table (int32 .npy, [batch, max_blocks_per_seq]); K/V then
    /// hold [num_blocks, block_size, heads_kv, head_dim]. Needs --seqused-k.
    #[arg(long, requires = "seqused_k")]
    block_table: Option<PathBuf>,
    #[command(flatten)]
    compute: ComputeArgs,
}

/// The backward files of `fa run`, when --dout was given (clap makes --dq/--dk/--dv required
/// with it).
fn run_backward_files(a: &RunArgs) -> Option<fa_cli::run_backward::BackwardFiles> {
    Some(fa_cli::run_backward::BackwardFiles {
        d_o: a.dout.clone()?,
        dq: a.dq.clone()?,
        dk: a.dk.clone()?,
        dv: a.dv.clone()?,
        grad_dtype: a.grad_dtype,
    })
}

#[derive(Args)]
struct VerifyArgs {
    /// Dtypes to verify, comma-separated: f32, bf16, f16 (default: all three on the CPU;
    /// bf16,f16 on CUDA).
    #[arg(long, value_parser = parse_dtype, value_delimiter = ',')]
    dtype: Vec<DType>,
    /// Random problems in addition to the fixed cases.
    #[arg(long, default_value_t = 8)]
    random: usize,
    /// Seed (default: fresh from the clock, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Write 16-bit results as f32 instead of the input dtype.
    #[arg(long)]
    out_f32: bool,
    /// Skip the backward rows (by default every case is also checked through the backward:
    /// dQ, dK, dV against the f64 reference backward).
    #[arg(long)]
    no_backward: bool,
    #[command(flatten)]
    compute: ComputeArgs,
}

#[derive(Args)]
struct BenchArgs {
    /// Sequences (comma-separated list sweeps).
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
    /// Query heads (comma-separated list sweeps).
    #[arg(long, value_delimiter = ',')]
    heads: Vec<usize>,
    /// KV heads (default: = heads).
    #[arg(long)]
    heads_kv: Option<usize>,
    /// Tokens per sequence (comma-separated list sweeps).
    #[arg(long, value_delimiter = ',')]
    seqlen: Vec<usize>,
    /// Keys per sequence when different from --seqlen.
    #[arg(long)]
    seqlen_k: Option<usize>,
    /// Head dimension (comma-separated list sweeps).
    #[arg(long, value_delimiter = ',')]
    head_dim: Vec<usize>,
    /// Causal mask only (the paper sweep runs both masks unless given).
    #[arg(long, conflicts_with = "no_causal")]
    causal: bool,
    /// No mask only (paper sweep).
    #[arg(long)]
    no_causal: bool,
    /// The paper shapes (16k tokens, hidden 2048) even when --seqlen / --head-dim are given:
    /// they then select among them.
    #[arg(long, conflicts_with_all = ["batch", "heads", "heads_kv", "seqlen_k"])]
    paper: bool,
    /// Element type: f32, bf16 or f16 (default: f32 on the CPU, bf16 on CUDA).
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<DType>,
    /// Timed iterations per shape, at least 1, median reported (default: 5 on the CPU, 30 on
    /// CUDA).
    #[arg(long, value_parser = parse_iters)]
    iters: Option<usize>,
    /// Untimed iterations before timing (default: 1 on the CPU, 5 on CUDA).
    #[arg(long)]
    warmup: Option<usize>,
    /// PyTorch SDPA numbers (`torch_sdpa.py --json`, same device session): print our
    /// throughput over theirs per shape (and in --json); a missing file only warns.
    #[arg(long)]
    peers: Option<PathBuf>,
    /// CUDA tile overrides to compare (tuning), comma-separated: default or
    /// BLOCK_MxBLOCK_NxWARPSxMIN_BLOCKS, optionally followed by xSTAGES, e.g.
    /// default,128x64x4x2.
    #[arg(long, value_delimiter = ',', value_parser = parse_tiles)]
    tiles: Vec<TileChoice>,
    /// Print one JSON object per shape instead of the table.
    #[arg(long)]
    json: bool,
    /// Time the backward pass (and forward + backward) instead of the forward, with the bytes
    /// the first backward call allocates (heap: what the CPU path allocates; on CUDA the
    /// times are the kernels', from CUDA events). With --peers: PyTorch SDPA's backward
    /// (`torch_sdpa.py --backward --json`) beside ours.
    #[arg(long, conflicts_with_all = ["tiles", "decode"])]
    backward: bool,
    /// Seed of the N(0,1) inputs.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Decode over a KV cache instead of the forward sweep: time, GB/s of K/V read and the
    /// fraction of the copy bandwidth measured in the same run (CPU). Sweeps --batch
    /// (default 4), --cache-len, --heads (default 32), --head-dim (default 128), --page-size;
    /// --heads-kv sets the GQA group (default heads/4).
    #[arg(long, conflicts_with_all = ["paper", "peers", "tiles", "seqlen", "seqlen_k", "causal", "no_causal"])]
    decode: bool,
    /// Decode: keys in each sequence's cache (comma-separated list sweeps; default 8192).
    #[arg(long, value_delimiter = ',', requires = "decode")]
    cache_len: Vec<usize>,
    /// Decode: keys per block of a paged cache, 0 for a padded cache (comma-separated list
    /// sweeps; default 0,16).
    #[arg(long, value_delimiter = ',', requires = "decode")]
    page_size: Vec<usize>,
    /// Decode: new queries per sequence (speculative decoding verifies several).
    #[arg(long, default_value_t = 1, requires = "decode")]
    queries: usize,
    #[command(flatten)]
    compute: ComputeArgs,
}

#[derive(Args)]
struct PlanArgs {
    /// Model preset for both sections: llama3-70b or qwen3.8-27b (default: Llama-3 70B for the
    /// KV cache, Qwen3.8-27B for the score matrix).
    #[arg(long)]
    preset: Option<String>,
    /// Layers.
    #[arg(long)]
    layers: Option<u64>,
    /// Query heads.
    #[arg(long)]
    heads: Option<u64>,
    /// KV heads.
    #[arg(long)]
    heads_kv: Option<u64>,
    /// Head dimension.
    #[arg(long)]
    head_dim: Option<u64>,
    /// Context length in tokens.
    #[arg(long)]
    tokens: Option<u64>,
    /// Sequences.
    #[arg(long)]
    batch: Option<u64>,
    /// Bytes per element (2: fp16/bf16, 1: fp8, 4: fp32).
    #[arg(long)]
    bytes: Option<u64>,
    /// Threads of the tiled kernel (its per-thread tile scratch), at least 1; with --decode
    /// also the threads of this host's copy and of a CPU measurement.
    #[arg(long, value_parser = parse_plan_threads, allow_negative_numbers = true)]
    threads: Option<u64>,
    /// The decode view instead of the memory sections: the KV cache of the model (default
    /// Llama-3 70B at 128k) and the bandwidth bound on attention's time per decoded token (H200
    /// spec, H200 measured copy, this host's copy measured now, --bandwidth), beside a measured
    /// step when CUDA opens or with --measure.
    #[arg(long)]
    decode: bool,
    /// Decode: more bandwidths to bound against, GB/s (comma-separated).
    #[arg(long, value_delimiter = ',', value_parser = parse_gbps, requires = "decode")]
    bandwidth: Vec<f64>,
    /// Decode: time one layer's step on the CPU too when no CUDA device opens (one layer's
    /// time × layers; slow at long contexts). A CUDA device is timed without it.
    #[arg(long, requires = "decode")]
    measure: bool,
    /// Decode: backend of the measured figure: auto (CUDA when a device opens), cpu or cuda.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto, requires = "decode")]
    backend: BackendArg,
}

/// Parses `--iters`: at least 1 (a median of no timings is no measurement).
fn parse_iters(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("'{s}': --iters must be at least 1")),
    }
}

/// Refuses a `--simd` level this CPU lacks, on the CPU backend (CUDA ignores it).
fn check_simd(backend: &Backend, opts: &Options) -> Result<(), CliError> {
    if backend.kind() == BackendKind::Cpu && !opts.cpu_simd.is_available() {
        return Err(CliError::Usage(format!(
            "--simd: this CPU does not have {} (the best it has: {})",
            opts.cpu_simd.name(),
            flash_attention::CpuSimd::Auto.resolve().name()
        )));
    }
    Ok(())
}

/// What `fa bench` (forward and backward) checks before it prints anything: the SIMD level
/// and every shape (sizes, then the problem's validation), so that a bad argument is an error
/// with no table header before it.
fn check_bench(
    backend: &Backend,
    opts: &Options,
    shapes: &[BenchShape],
    dtype: DType,
) -> Result<(), CliError> {
    check_simd(backend, opts)?;
    for shape in shapes {
        // Sizes first: building the description multiplies the dimensions unchecked.
        bench::ensure_shape_fits(shape, dtype)?;
        shape.desc().validate(softmax_core::MAX_HEAD_DIM)?;
    }
    Ok(())
}

/// Parses a `--bandwidth` value: GB/s, positive and finite.
fn parse_gbps(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(g) if g > 0.0 && g.is_finite() => Ok(g),
        _ => Err(format!(
            "'{s}' is not a bandwidth in GB/s (a positive number)"
        )),
    }
}

#[derive(Args)]
struct DemoArgs {
    /// Tokens of the sequence (default: 16384 on the CPU, 131072 on CUDA).
    #[arg(long)]
    seqlen: Option<usize>,
    /// Query heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// KV heads (default: = heads).
    #[arg(long)]
    heads_kv: Option<usize>,
    /// Head dimension.
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// No causal mask (the demo is causal by default).
    #[arg(long)]
    no_causal: bool,
    /// Element type: f32, bf16 or f16 (default: f32 on the CPU, bf16 on CUDA).
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<DType>,
    /// Rows checked against the f64 reference.
    #[arg(long, default_value_t = 32)]
    check_rows: usize,
    #[command(flatten)]
    compute: ComputeArgs,
}

/// Parses `--threads`: at least 1, at most the machine's available parallelism (more threads
/// than cores only add scheduling: a pool of thousands stalls a small run for minutes).
fn parse_threads(s: &str) -> Result<usize, String> {
    let n: i64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of threads"))?;
    let max = std::thread::available_parallelism().map_or(1, |n| n.get());
    softmax_core::thread_count(n, max).map_err(|e| match e {
        softmax_core::ProblemError::TooManyThreads { .. } => {
            format!("--threads {n} exceeds this machine's available parallelism ({max})")
        }
        e => format!("--threads must be at least 1 ({e})"),
    })
}

/// Parses `fa plan --threads`: at least 1 (the plan is arithmetic for any machine, so no upper
/// bound here; `--decode` bounds it by this host's parallelism).
fn parse_plan_threads(s: &str) -> Result<u64, String> {
    let n: i64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of threads"))?;
    softmax_core::thread_count(n, usize::MAX)
        .map(|n| n as u64)
        .map_err(|e| format!("--threads must be at least 1 ({e})"))
}

/// Writes report text to stdout; a closed pipe (`fa plan | head -1`) comes back as an
/// [`CliError::Io`] with `BrokenPipe`, which `main` ends quietly with success.
fn emit(text: std::fmt::Arguments<'_>) -> Result<(), CliError> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_fmt(text)
        .and_then(|()| stdout.flush())
        .map_err(|source| CliError::Io {
            path: PathBuf::from("standard output"),
            source,
        })
}

/// `println!` through [`emit`], returning the error from the enclosing function.
macro_rules! outln {
    ($($arg:tt)*) => {
        emit(format_args!("{}\n", format_args!($($arg)*)))?
    };
}

/// `print!` through [`emit`].
macro_rules! out {
    ($($arg:tt)*) => {
        emit(format_args!($($arg)*))?
    };
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        None => cmd_demo(&DemoArgs {
            seqlen: None,
            heads: 8,
            heads_kv: None,
            head_dim: 128,
            no_causal: false,
            dtype: None,
            check_rows: 32,
            compute: ComputeArgs {
                backend: BackendArg::Auto,
                threads: None,
                exp2: Exp2Arg::Auto,
                family: FamilyArg::Auto,
                sm90_pipeline: None,
                splits: None,
                simd: SimdArg::Auto,
                prefetch: flash_attention::CpuDecodePrefetch::default(),
                no_amx_pv: false,
                bf16_dots: false,
            },
        }),
        Some(Command::Run(a)) => cmd_run(a),
        Some(Command::Verify(a)) => cmd_verify(&a),
        Some(Command::Bench(a)) => cmd_bench(&a),
        Some(Command::Plan(a)) => cmd_plan(&a),
        Some(Command::Demo(a)) => cmd_demo(&a),
        Some(Command::Warmup(a)) => cmd_warmup(&a),
        Some(Command::Exp2Error) => cmd_exp2_error(),
    };
    match result {
        Ok(code) => code,
        // The reader went away (`fa plan | head -1`): stop quietly, as Unix tools do.
        Err(CliError::Io { source, .. }) if source.kind() == std::io::ErrorKind::BrokenPipe => {
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn cmd_run(a: RunArgs) -> Result<ExitCode, CliError> {
    let backward = run_backward_files(&a);
    let req = RunRequest {
        q: a.q,
        k: a.k,
        v: a.v,
        output: a.output,
        lse: a.lse,
        causal: a.causal,
        window: a.window,
        softcap: a.softcap,
        scale: a.scale,
        backend: a.compute.backend.into(),
        options: a.compute.options(),
        check_rows: a.check_rows,
        backward,
        seqused_k: a.seqused_k,
        block_table: a.block_table,
    };
    let summary = run(&req)?;
    // The forward ran first: its line comes first.
    eprintln!(
        "fa run: {} on {} in {:.3} s -> {}",
        summary.shape,
        summary.backend,
        summary.seconds,
        req.output.display()
    );
    if let (Some(s), Some(b)) = (summary.backward_seconds, &req.backward) {
        eprintln!(
            "fa run: backward in {s:.3} s -> {}, {}, {}",
            b.dq.display(),
            b.dk.display(),
            b.dv.display()
        );
    }
    if let Some(c) = summary.check {
        let clamped = if c.requested > c.rows {
            format!(
                " (clamped from {}: the output has {} rows)",
                c.requested, c.rows
            )
        } else {
            String::new()
        };
        let nan = if c.errors.nan_rows > 0 {
            format!(", {} rows with NaN", c.errors.nan_rows)
        } else {
            String::new()
        };
        eprintln!(
            "check: {} rows{clamped} against the f64 reference: rel_l2 {:.2e} (bound {:.0e}), LSE err {:.2e} (bound {:.0e}){nan}: {}",
            c.rows,
            c.errors.rel_l2,
            c.bound,
            c.errors.lse_max_abs,
            c.lse_bound,
            if c.pass { "pass" } else { "FAIL" }
        );
        if !c.pass {
            return Ok(ExitCode::FAILURE);
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn cmd_verify(a: &VerifyArgs) -> Result<ExitCode, CliError> {
    let backend = Backend::open(a.compute.backend.into())?;
    check_simd(&backend, &a.compute.options())?;
    // One seed, printed once: `--seed` with it reproduces the run.
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x5eed, |d| d.as_nanos() as u64)
    });
    outln!(
        "fa verify: backend {}, exp2 {:?}, seed {seed}",
        backend.describe(),
        a.compute.exp2
    );
    outln!("{}", verify::table_header());
    let dtypes = if !a.dtype.is_empty() {
        a.dtype.clone()
    } else if backend.kind() == BackendKind::Cuda {
        vec![DType::Bf16, DType::F16]
    } else {
        vec![DType::F32, DType::Bf16, DType::F16]
    };
    let (mut failed, mut skipped, mut total) = (0, 0, 0);
    for dtype in dtypes {
        // Drawn lazily, the same cases for every dtype: memory does not grow with --random.
        for case in verify::case_stream(seed, a.random) {
            let row = verify::verify_case(&backend, &case, dtype, a.out_f32, &a.compute.options());
            let backward = (!a.no_backward).then(|| {
                fa_cli::verify_backward::verify_backward_case(
                    &backend,
                    &case,
                    dtype,
                    a.out_f32,
                    &a.compute.options(),
                )
            });
            for row in std::iter::once(row).chain(backward) {
                outln!("{}", verify::table_row(&row));
                total += 1;
                failed += row.failed() as usize;
                skipped += matches!(row.outcome, verify::Outcome::Unsupported(_)) as usize;
            }
        }
        // Decode over padded and paged KV caches (split-KV), same seed.
        let mut rng = fa_reference::Rng::new(seed ^ 0xdec0de);
        for case in verify::decode_cases(&mut rng) {
            let row =
                verify::verify_decode_case(&backend, &case, dtype, a.out_f32, &a.compute.options());
            outln!("{}", verify::table_row(&row));
            total += 1;
            failed += row.failed() as usize;
            skipped += matches!(row.outcome, verify::Outcome::Unsupported(_)) as usize;
        }
    }
    outln!(
        "{} passed, {failed} failed, {skipped} skipped (unsupported by the backend) of {total} cases",
        total - failed - skipped
    );
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// A `--tiles` entry: the tuned choice or an override.
#[derive(Clone, Copy, Debug)]
struct TileChoice(Option<Tiles>);

fn parse_tiles(s: &str) -> Result<TileChoice, String> {
    match s {
        "default" => Ok(TileChoice(None)),
        t => Tiles::parse(t)
            .map(|t| TileChoice(Some(t)))
            .ok_or_else(|| format!("bad tiles '{t}' (e.g. 128x64x4x2)")),
    }
}

/// The shapes `fa bench` measures: the paper sweep (filtered by --head-dim, --seqlen and the
/// mask flags), or the grid of the given dimensions.
fn bench_shapes(a: &BenchArgs) -> Vec<BenchShape> {
    let given = !(a.batch.is_empty()
        && a.heads.is_empty()
        && a.seqlen.is_empty()
        && a.head_dim.is_empty()
        && a.heads_kv.is_none()
        && a.seqlen_k.is_none());
    if given && !a.paper {
        let or = |v: &Vec<usize>, d: usize| if v.is_empty() { vec![d] } else { v.clone() };
        let mut shapes = Vec::new();
        for &head_dim in &or(&a.head_dim, 128) {
            for &seqlen in &or(&a.seqlen, 4096) {
                for &heads in &or(&a.heads, 8) {
                    for &batch in &or(&a.batch, 1) {
                        shapes.push(BenchShape {
                            batch,
                            heads,
                            heads_kv: a.heads_kv.unwrap_or(heads),
                            seqlen_q: seqlen,
                            seqlen_k: a.seqlen_k.unwrap_or(seqlen),
                            head_dim,
                            causal: a.causal,
                        });
                    }
                }
            }
        }
        return shapes;
    }
    let keep = |list: &Vec<usize>, x: usize| list.is_empty() || list.contains(&x);
    bench::paper_shapes()
        .into_iter()
        .filter(|s| !a.causal || s.causal)
        .filter(|s| !a.no_causal || !s.causal)
        .filter(|s| keep(&a.head_dim, s.head_dim) && keep(&a.seqlen, s.seqlen_q))
        .collect()
}

/// `fa bench --decode`: the grid of decode shapes, one row (or JSON line) each.
fn cmd_bench_decode(a: &BenchArgs) -> Result<ExitCode, CliError> {
    use fa_cli::decode_bench::{bench_decode, table_header, table_row, DecodeShape};
    let backend = match a.dtype {
        Some(d) => Backend::open_for(a.compute.backend.into(), flash_attention::DTypes::same(d))?,
        None => Backend::open(a.compute.backend.into())?,
    };
    let dtype = a.dtype.unwrap_or_else(|| backend.default_dtype());
    let cuda = backend.kind() == BackendKind::Cuda;
    let iters = a.iters.unwrap_or(if cuda { 30 } else { 7 });
    let warmup = a.warmup.unwrap_or(if cuda { 5 } else { 1 });
    let or = |v: &Vec<usize>, d: &[usize]| if v.is_empty() { d.to_vec() } else { v.clone() };
    // Every shape checked before the header is printed.
    check_simd(&backend, &a.compute.options())?;
    let mut shapes = Vec::new();
    for &head_dim in &or(&a.head_dim, &[128]) {
        for &heads in &or(&a.heads, &[32]) {
            for &batch in &or(&a.batch, &[4]) {
                for &cache_len in &or(&a.cache_len, &[8192]) {
                    for &page_size in &or(&a.page_size, &[0, 16]) {
                        let shape = DecodeShape {
                            batch,
                            queries: a.queries,
                            cache_len,
                            heads,
                            heads_kv: a.heads_kv.unwrap_or((heads / 4).max(1)),
                            head_dim,
                            page_size,
                        };
                        fa_cli::decode_bench::check_decode_shape(&shape)?;
                        shapes.push(shape);
                    }
                }
            }
        }
    }
    if !a.json {
        outln!(
            "fa bench --decode: {}, {} rounds of (copy, decode) after {} warm-up (medians)",
            backend.describe(),
            iters,
            warmup
        );
        outln!("{}", table_header());
    }
    let mut failed = 0usize;
    let opts = a.compute.options();
    for shape in &shapes {
        match bench_decode(&backend, shape, dtype, &opts, warmup, iters, a.seed) {
            Ok(r) if a.json => outln!(
                "{}",
                serde_json::to_string(&r).map_err(|e| CliError::Usage(e.to_string()))?
            ),
            Ok(r) => outln!("{}", table_row(&r)),
            Err(e) => {
                eprintln!("error: {shape:?}: {e}");
                failed += 1;
            }
        }
    }
    Ok(if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn cmd_bench(a: &BenchArgs) -> Result<ExitCode, CliError> {
    if a.backward {
        return cmd_bench_backward(a);
    }
    if a.decode {
        return cmd_bench_decode(a);
    }
    let shapes = bench_shapes(a);
    let backend = match a.dtype {
        Some(d) => Backend::open_for(a.compute.backend.into(), flash_attention::DTypes::same(d))?,
        None => Backend::open(a.compute.backend.into())?,
    };
    let dtype = a.dtype.unwrap_or_else(|| backend.default_dtype());
    check_bench(&backend, &a.compute.options(), &shapes, dtype)?;
    let cuda = backend.kind() == BackendKind::Cuda;
    let iters = a.iters.unwrap_or(if cuda { 30 } else { 5 });
    let warmup = a.warmup.unwrap_or(if cuda { 5 } else { 1 });
    let tiles = if a.tiles.is_empty() {
        vec![TileChoice(None)]
    } else {
        a.tiles.clone()
    };
    let peers = a.peers.as_ref().map(|path| {
        peers::read_peers(path).unwrap_or_else(|e| {
            eprintln!("no peer numbers: {e}");
            Vec::new()
        })
    });
    let total = shapes.len() * tiles.len();
    let bar = if total > 1 {
        let bar = indicatif::ProgressBar::new(total as u64);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} shapes, {elapsed} elapsed, eta {eta} {msg}",
        ) {
            bar.set_style(style);
        }
        Some(bar)
    } else {
        None
    };
    let print = |line: String| -> Result<(), CliError> {
        match &bar {
            Some(b) if !b.is_hidden() => b.println(line),
            _ => outln!("{line}"),
        }
        Ok(())
    };
    if !a.json {
        print(format!(
            "fa bench: {}, {} timed iterations after {} warm-up (median)",
            backend.describe_for(&a.compute.options()),
            iters,
            warmup
        ))?;
        print(if peers.is_some() {
            bench::peers_header()
        } else {
            bench::table_header()
        })?;
    }
    let (mut summary, mut failed) = (Vec::new(), 0usize);
    for &TileChoice(tile) in &tiles {
        let opts = Options {
            tiles: tile,
            ..a.compute.options()
        };
        for shape in &shapes {
            if let Some(b) = &bar {
                b.set_message(format!(
                    "b{} h{} n{} d{}{}",
                    shape.batch,
                    shape.heads,
                    shape.seqlen_q,
                    shape.head_dim,
                    if shape.causal { " causal" } else { "" }
                ));
            }
            let start = std::time::Instant::now();
            let measured = bench::bench_shape(&backend, shape, dtype, &opts, warmup, iters, a.seed);
            if let Some(b) = &bar {
                b.inc(1);
            }
            let mut r = match measured {
                Ok(r) => r,
                // One shape or tile choice that cannot run does not end the sweep.
                Err(e) if total > 1 => {
                    eprintln!(
                        "error: b{} h{} n{} d{} causal={} tiles {}: {e}",
                        shape.batch,
                        shape.heads,
                        shape.seqlen_q,
                        shape.head_dim,
                        shape.causal,
                        tile.as_ref()
                            .map_or("default".to_string(), bench::tiles_name)
                    );
                    failed += 1;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if let Some(p) = &peers {
                r.peers = Some(peers::ratios(p, shape, r.tflops()));
            }
            let line = if a.json {
                serde_json::to_string(&r).map_err(|e| CliError::Usage(e.to_string()))?
            } else if peers.is_some() {
                let row = bench::peers_row(&r);
                summary.push(row.clone());
                format!(
                    "{row}  ({:.1} s incl. warm-up)",
                    start.elapsed().as_secs_f64()
                )
            } else {
                bench::table_row(&r)
            };
            print(line)?;
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if peers.is_some() && !a.json {
        outln!("\n{}", bench::PEERS_SUMMARY);
        for line in summary {
            outln!("{line}");
        }
    }
    if failed > 0 {
        return Err(CliError::Backend(format!(
            "{failed} of {total} measurements failed (see above)"
        )));
    }
    Ok(ExitCode::SUCCESS)
}

/// `fa bench --backward`: the shapes of [`bench_shapes`], timed through the library's
/// backward (forward + backward per iteration).
fn cmd_bench_backward(a: &BenchArgs) -> Result<ExitCode, CliError> {
    use fa_cli::bench_backward::{backward_table_header, backward_table_row, bench_backward_shape};
    let shapes = bench_shapes(a);
    let backend = match a.dtype {
        Some(d) => Backend::open_for(a.compute.backend.into(), flash_attention::DTypes::same(d))?,
        None => Backend::open(a.compute.backend.into())?,
    };
    let dtype = a.dtype.unwrap_or_else(|| backend.default_dtype());
    let cuda = backend.kind() == BackendKind::Cuda;
    let iters = a.iters.unwrap_or(if cuda { 20 } else { 5 });
    let warmup = a.warmup.unwrap_or(if cuda { 5 } else { 1 });
    let opts = a.compute.options();
    check_bench(&backend, &opts, &shapes, dtype)?;
    if !a.json {
        outln!(
            "fa bench --backward: {}, {} timed forward + backward iterations after {} warm-up (median); FLOPs: backward 2.5 x forward",
            backend.describe(),
            iters,
            warmup.max(1)
        );
        outln!("{}", backward_table_header());
    }
    let peers = a.peers.as_ref().map(|path| {
        peers::read_peers(path).unwrap_or_else(|e| {
            eprintln!("no peer numbers: {e}");
            Vec::new()
        })
    });
    let mut failed = 0usize;
    let mut summary = Vec::new();
    for shape in &shapes {
        match bench_backward_shape(&backend, shape, dtype, &opts, warmup, iters, a.seed) {
            Ok(mut r) => {
                if let Some(p) = &peers {
                    r.peers = Some(peers::backward_ratios(p, shape, r.backward_gflops / 1e3));
                }
                if a.json {
                    let line =
                        serde_json::to_string(&r).map_err(|e| CliError::Usage(e.to_string()))?;
                    outln!("{line}");
                } else {
                    outln!("{}", backward_table_row(&r));
                }
                summary.push(r);
            }
            Err(e) if shapes.len() > 1 => {
                eprintln!(
                    "error: b{} h{} n{} d{} causal={}: {e}",
                    shape.batch, shape.heads, shape.seqlen_q, shape.head_dim, shape.causal
                );
                failed += 1;
            }
            Err(e) => return Err(e),
        }
    }
    if peers.is_some() && !a.json {
        outln!("");
        outln!("backward {}", bench::PEERS_SUMMARY);
        outln!("{}", bench::peers_header());
        for r in &summary {
            outln!("{}", fa_cli::bench_backward::backward_peers_row(r));
        }
    }
    if failed > 0 {
        return Err(CliError::Backend(format!(
            "{failed} of {} measurements failed (see above)",
            shapes.len()
        )));
    }
    Ok(ExitCode::SUCCESS)
}

fn cmd_plan(a: &PlanArgs) -> Result<ExitCode, CliError> {
    let base = |default: plan::ModelShape| -> Result<plan::ModelShape, CliError> {
        let mut m = match &a.preset {
            Some(name) => plan::preset(name).ok_or_else(|| {
                CliError::Usage(format!(
                    "unknown preset '{name}' (known: {})",
                    plan::PRESETS.join(", ")
                ))
            })?,
            None => default,
        };
        let set = |field: &mut u64, v: Option<u64>| {
            if let Some(v) = v {
                *field = v;
            }
        };
        set(&mut m.layers, a.layers);
        set(&mut m.heads_q, a.heads);
        set(&mut m.heads_kv, a.heads_kv);
        set(&mut m.head_dim, a.head_dim);
        set(&mut m.tokens, a.tokens);
        set(&mut m.batch, a.batch);
        set(&mut m.bytes, a.bytes);
        let custom = [
            a.layers, a.heads, a.heads_kv, a.head_dim, a.tokens, a.batch, a.bytes,
        ]
        .iter()
        .any(Option::is_some);
        if custom {
            m.name = format!("{} (modified)", m.name);
        }
        for (what, v) in [
            ("--heads", m.heads_q),
            ("--heads-kv", m.heads_kv),
            ("--head-dim", m.head_dim),
            ("--bytes", m.bytes),
            ("--batch", m.batch),
        ] {
            if v == 0 {
                return Err(CliError::Usage(format!("{what} must be at least 1")));
            }
        }
        Ok(m)
    };
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()) as u64);
    let kv = base(plan::llama3_70b())?;
    if a.decode {
        plan::check_decode_sizes(&kv).map_err(CliError::Usage)?;
        return cmd_plan_decode(a, &kv, threads);
    }
    let scores = base(plan::qwen_27b())?;
    for m in [&kv, &scores] {
        plan::check_sizes(m, threads).map_err(CliError::Usage)?;
    }
    outln!("{}", plan::kv_cache_report(&kv));
    out!("{}", plan::score_report(&scores, threads));
    Ok(ExitCode::SUCCESS)
}

/// `fa plan --decode`: the KV cache and the bandwidth bound per decoded token, the host's copy
/// measured now, and a measured step (one layer × layers) when CUDA opens or with --measure.
fn cmd_plan_decode(a: &PlanArgs, m: &plan::ModelShape, threads: u64) -> Result<ExitCode, CliError> {
    use fa_cli::decode_bench::{bench_decode, CopyProbe, DecodeShape};
    use flash_attention::{BackendChoice, DTypes};
    use plan::Bandwidth;
    for (what, v) in [("--tokens", m.tokens), ("--layers", m.layers)] {
        if v == 0 {
            return Err(CliError::Usage(format!(
                "{what} must be at least 1 for --decode"
            )));
        }
    }
    let max = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = usize::try_from(threads)
        .ok()
        .filter(|t| (1..=max).contains(t))
        .ok_or_else(|| {
            CliError::Usage(format!(
                "--threads {threads}: the decode view copies (and measures) on this host, so \
                 1 to its available parallelism ({max})"
            ))
        })?;
    let mut notes = Vec::new();
    let mut bandwidths = vec![
        Bandwidth {
            label: "H200 HBM3e, specification".into(),
            gbps: plan::H200_SPEC_GBPS,
        },
        Bandwidth {
            label: "H200 device copy, measured (benchmarks.md)".into(),
            gbps: plan::H200_COPY_GBPS,
        },
    ];
    // This host's copy (read + write), median of 3 after one untimed pass, over buffers larger
    // than the caches and at least one layer's K/V (up to 1 GiB each).
    let layer_bytes = plan::kv_cache_bytes_per_layer(m);
    let probe_bytes = layer_bytes.clamp(256 << 20, 1 << 30) as usize;
    let mut host = None;
    match CopyProbe::new(probe_bytes) {
        Ok(mut p) => {
            p.copy_gbps(threads);
            let runs: Vec<f64> = (0..3).map(|_| p.copy_gbps(threads)).collect();
            host = Some(bandwidths.len());
            bandwidths.push(Bandwidth {
                label: format!("this host's copy, measured now (threads: {threads})"),
                gbps: bench::median(&runs),
            });
        }
        Err(e) => notes.push(format!("this host's copy bandwidth is not measured: {e}")),
    }
    for &gbps in &a.bandwidth {
        bandwidths.push(Bandwidth {
            label: "given (--bandwidth)".into(),
            gbps,
        });
    }
    // The measured figure's backend: CUDA when it opens (bf16), the CPU only when asked.
    let dtype = match m.bytes {
        2 => Some(DType::Bf16),
        4 => Some(DType::F32),
        _ => None,
    };
    let cpu_if_asked = |notes: &mut Vec<String>| {
        if a.measure {
            Some(Backend::cpu())
        } else {
            notes.push("no measured figure: --measure times one layer's step on the CPU".into());
            None
        }
    };
    let backend = match (dtype, a.backend) {
        (None, _) => {
            notes.push(format!(
                "no measured figure: the kernels take 2- or 4-byte elements, not --bytes {}",
                m.bytes
            ));
            None
        }
        (Some(_), BackendArg::Cpu) => {
            notes.push("GPU figure absent: --backend cpu".into());
            cpu_if_asked(&mut notes)
        }
        (Some(d), BackendArg::Cuda) => {
            Some(Backend::open_for(BackendChoice::Cuda, DTypes::same(d))?)
        }
        (Some(d), BackendArg::Auto) => {
            if !BackendKind::Cuda.capabilities().takes(DTypes::same(d)) {
                notes.push(format!(
                    "GPU figure absent: the CUDA kernels take 16-bit inputs, not {d} (--bytes 4)"
                ));
                cpu_if_asked(&mut notes)
            } else {
                match Backend::open(BackendChoice::Cuda) {
                    Ok(b) => Some(b),
                    Err(e) => {
                        notes.push(format!("GPU figure absent: no CUDA device opened ({e})"));
                        cpu_if_asked(&mut notes)
                    }
                }
            }
        }
    };
    let mut measured = None;
    if let (Some(b), Some(d)) = (backend, dtype) {
        let size = |v: u64| {
            usize::try_from(v).map_err(|_| CliError::TooLarge {
                what: "the measured layer's cache".into(),
                needed: None,
                available: None,
            })
        };
        let shape = DecodeShape {
            batch: size(m.batch)?,
            queries: 1,
            cache_len: size(m.tokens)?,
            heads: size(m.heads_q)?,
            heads_kv: size(m.heads_kv)?,
            head_dim: size(m.head_dim)?,
            page_size: 0,
        };
        let cuda = b.kind() == BackendKind::Cuda;
        let opts = Options {
            threads: (!cuda).then_some(threads),
            ..Options::default()
        };
        let (warmup, iters) = if cuda { (5, 20) } else { (1, 3) };
        let r = bench_decode(&b, &shape, d, &opts, warmup, iters, 1)?;
        let reference = if cuda {
            1
        } else if let Some(i) = host {
            i
        } else {
            bandwidths.push(Bandwidth {
                label: format!("this host's copy, in the measured rounds (threads: {threads})"),
                gbps: r.copy_gbps.unwrap_or(f64::NAN),
            });
            bandwidths.len() - 1
        };
        measured = Some(plan::MeasuredDecode {
            backend: b.describe(),
            dtype: d.name(),
            layer_seconds: r.time_ms_median / 1e3,
            kv_splits: r.kv_splits,
            reference,
        });
    }
    out!(
        "{}",
        plan::decode_report(m, &bandwidths, measured.as_ref(), &notes)
    );
    Ok(ExitCode::SUCCESS)
}

fn cmd_demo(a: &DemoArgs) -> Result<ExitCode, CliError> {
    let req = DemoRequest {
        backend: a.compute.backend.into(),
        options: a.compute.options(),
        seqlen: a.seqlen,
        heads: a.heads,
        heads_kv: a.heads_kv.unwrap_or(a.heads),
        head_dim: a.head_dim,
        causal: !a.no_causal,
        dtype: a.dtype,
        check_rows: a.check_rows,
        ..DemoRequest::default()
    };
    let (report, pass) = demo(&req)?;
    out!("{report}");
    Ok(if pass {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `fa warmup`'s arguments.
#[derive(Args)]
struct WarmupArgs {
    /// NVRTC architecture (e.g. sm_90a, sm_80); default: that of CUDA device 0.
    #[arg(long)]
    arch: Option<String>,
}

fn cmd_warmup(a: &WarmupArgs) -> Result<ExitCode, CliError> {
    let report = flash_attention::warmup(a.arch.as_deref())?;
    let compiled = report.compiled();
    outln!(
        "{} kernels for {}: {compiled} compiled now, {} already in the cache; cache: {}",
        report.kernels.len(),
        report.arch,
        report.kernels.len() - compiled,
        report
            .cache_dir
            .as_ref()
            .map_or("off (FA_CUDA_CACHE=off): nothing kept".into(), |d| d
                .display()
                .to_string())
    );
    if let Some(k) = report.kernels.iter().find(|k| !k.cached) {
        outln!("warning: {} could not be written to the cache", k.name);
    }
    Ok(ExitCode::SUCCESS)
}

fn cmd_exp2_error() -> Result<ExitCode, CliError> {
    let (worst_x, worst) = fa_cli::exp2_error::sweep_exp2();
    let bound = softmax_core::EXP2_CUBIC_MAX_REL_ERROR;
    outln!(
        "exp2_cubic: max relative error {worst:.3e} at x = {worst_x:e} over every f32 in [-125, 128) (documented bound {bound:e})"
    );
    Ok(if worst > bound {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
