//! `fa demo` (and `fa` alone): one long-sequence run on the best backend, checked against the
//! f64 reference on sampled rows, with its time, throughput and memory beside what a naive
//! implementation would have needed.

use crate::backend::{Backend, BackendChoice, Options};
use crate::bench::{peak_rss_bytes, reset_peak_rss, BenchShape};
use crate::error::CliError;
use crate::plan::human_bytes;
use crate::rows::{compare_rows, reference_rows, sample_rows};
use crate::tensor::{random_normal, DType, HostTensor, TensorViews};
use crate::verify::bounds;
use flash_attention::KernelOrigin;
use flash_attention::{BackendKind, DTypes};
use softmax_core::{Out, Qkv};
use std::fmt::Write as _;
use std::time::Instant;

/// What the demo runs.
#[derive(Clone, Copy, Debug)]
pub struct DemoRequest {
    /// Backend choice.
    pub backend: BackendChoice,
    /// Threads and exp2.
    pub options: Options,
    /// Tokens of the sequence (`None`: 16384 on the CPU, 131072 on CUDA).
    pub seqlen: Option<usize>,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub heads_kv: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Causal mask.
    pub causal: bool,
    /// Element type (`None`: the backend's default, f32 on the CPU, bf16 on CUDA).
    pub dtype: Option<DType>,
    /// Rows checked against the reference.
    pub check_rows: usize,
    /// Seed of the inputs.
    pub seed: u64,
}

impl Default for DemoRequest {
    /// 1 × 16,384 tokens (131,072 on CUDA) × 8 heads × 128, causal: a few seconds on two
    /// cores.
    fn default() -> Self {
        DemoRequest {
            backend: BackendChoice::Auto,
            options: Options::default(),
            seqlen: None,
            heads: 8,
            heads_kv: 8,
            head_dim: 128,
            causal: true,
            dtype: None,
            check_rows: 32,
            seed: 2024,
        }
    }
}

/// The demo's report text and whether the check passed. With `--backend auto`, a CUDA
/// failure (driver, compilation) is reported on stderr and the demo runs on the CPU.
pub fn demo(req: &DemoRequest) -> Result<(String, bool), CliError> {
    // With a dtype given, `auto` takes CUDA only if it runs that dtype.
    let backend = match req.dtype {
        Some(d) => Backend::open_for(req.backend, DTypes::same(d))?,
        None => Backend::open(req.backend)?,
    };
    match demo_on(req, backend) {
        Err(CliError::Backend(why)) if req.backend == BackendChoice::Auto => {
            let first = why.lines().next().unwrap_or("");
            eprintln!("warning: the CUDA backend failed ({first}); running on the CPU instead");
            demo_on(req, Backend::cpu())
        }
        other => other,
    }
}

fn demo_on(req: &DemoRequest, backend: Backend) -> Result<(String, bool), CliError> {
    let dtype = req.dtype.unwrap_or_else(|| backend.default_dtype());
    let seqlen = req.seqlen.unwrap_or(match backend.kind() {
        BackendKind::Cuda => 131072,
        _ => 16384,
    });
    let shape = BenchShape {
        batch: 1,
        heads: req.heads,
        heads_kv: req.heads_kv,
        seqlen_q: seqlen,
        seqlen_k: seqlen,
        head_dim: req.head_dim,
        causal: req.causal,
    };
    for (flag, n) in [
        ("--seqlen", seqlen),
        ("--heads", req.heads),
        ("--heads-kv", req.heads_kv),
        ("--head-dim", req.head_dim),
    ] {
        if n == 0 {
            return Err(CliError::Usage(format!("{flag} must be at least 1")));
        }
    }
    // Sizes first: building the description multiplies the dimensions unchecked.
    crate::bench::ensure_shape_fits(&shape, dtype)?;
    let desc = shape.desc();
    let problem = desc.validate(softmax_core::MAX_HEAD_DIM)?;
    reset_peak_rss();
    let rss_before = peak_rss_bytes().unwrap_or(0);
    let mut rng = fa_reference::Rng::new(req.seed);
    let dims = |h| vec![1, seqlen, h, req.head_dim];
    let q = random_normal(&mut rng, dtype, dims(req.heads))?;
    let k = random_normal(&mut rng, dtype, dims(req.heads_kv))?;
    let v = random_normal(&mut rng, dtype, dims(req.heads_kv))?;
    let mut out = HostTensor::zeros(dtype, q.shape.clone())?;
    let qkv = Qkv::new(q.view(), k.view(), v.view());
    let mut lse = crate::memory::try_filled(problem.lse_len(), 0.0f32, "the LSE")?;

    let start = Instant::now();
    let stats = backend.forward(
        &problem,
        qkv,
        Out::with_lse(out.data.view_mut(), &mut lse[..]),
        &req.options,
    )?;
    let mut seconds = start.elapsed().as_secs_f64();
    let peak = peak_rss_bytes().unwrap_or(0);
    let mut timing = "wall clock, one call";
    if backend.kind() == BackendKind::Cuda {
        // The first call compiled the kernel and copied the tensors: time the kernel alone.
        let (mut out2, mut lse2) = (out.data.clone(), lse.clone());
        let times = backend.time_forward(
            &problem,
            qkv,
            Out::with_lse(out2.view_mut(), &mut lse2[..]),
            &req.options,
            1,
            5,
        )?;
        seconds = crate::bench::median(&times);
        timing = "kernel only, CUDA events, median of 5";
    }

    let check_start = Instant::now();
    let total_rows = crate::rows::row_count(&problem);
    let rows = sample_rows(&problem, req.check_rows.min(total_rows), &mut rng);
    let refs = reference_rows(&problem, &q.data, &k.data, &v.data, &rows).unwrap_or_default();
    let errors = compare_rows(&problem, &out.data, &lse, &rows, &refs);
    let check_seconds = check_start.elapsed().as_secs_f64();
    let (bound, lse_bound) = bounds(dtype, req.options.exp2);
    // Nothing checked is not a pass, but not a failure either: the report says so.
    let checked = !rows.is_empty();
    let pass = !checked || errors.passes(bound, lse_bound);

    let n = seqlen as u128;
    let scores_f32 = n * n * 4 * req.heads as u128;
    let io = shape.io_bytes(dtype) as u128;
    let mut s = String::new();
    let _ = writeln!(s, "fa demo: exact attention over one long sequence");
    let _ = writeln!(s, "  backend    {}", backend.describe());
    if let Some(origin) = stats.kernel_source {
        let variant = stats
            .launch
            .map_or(String::new(), |l| format!("{}, ", l.variant.name()));
        let _ = writeln!(s, "  kernel     {variant}{}", describe_origin(origin));
    }
    let _ = writeln!(
        s,
        "  problem    1 sequence x {} tokens, {} query heads / {} KV heads, head_dim {}, {}, {}",
        seqlen,
        req.heads,
        req.heads_kv,
        req.head_dim,
        dtype,
        if req.causal { "causal" } else { "no mask" }
    );
    let _ = writeln!(
        s,
        "  time       {:.4} s ({timing}{}), {} ({:.3e} FLOPs)",
        seconds,
        match backend.kind() {
            BackendKind::Cuda => String::new(),
            _ => format!(
                ", {} threads",
                backend.effective_threads(req.options.threads)
            ),
        },
        crate::bench::throughput(shape.flops() / seconds / 1e9),
        shape.flops()
    );
    let clamped = if req.check_rows > rows.len() && checked {
        format!(
            " (clamped from {}: the problem has {total_rows} rows)",
            req.check_rows
        )
    } else {
        String::new()
    };
    if !checked {
        let _ = writeln!(s, "  check      not checked (--check-rows 0)");
    } else {
        let _ = writeln!(
            s,
            "  check      {} sampled rows{clamped} against the f64 reference ({:.2} s): rel_l2 {:.2e} (bound {:.0e}), LSE err {:.2e} (bound {:.0e}){}: {}",
            rows.len(),
            check_seconds,
            errors.rel_l2,
            bound,
            errors.lse_max_abs,
            lse_bound,
            if errors.nan_rows > 0 {
                format!(", {} rows with NaN", errors.nan_rows)
            } else {
                String::new()
            },
            if pass { "pass" } else { "FAIL" }
        );
    }
    let _ = writeln!(s, "  memory");
    let _ = writeln!(
        s,
        "    naive attention: the {}x{} f32 score matrix of every head  {:>12}",
        seqlen,
        seqlen,
        human_bytes(scores_f32)
    );
    let _ = writeln!(
        s,
        "    inputs + outputs (Q, K, V, O, LSE)                           {:>12}",
        human_bytes(io)
    );
    if peak > 0 {
        let _ = writeln!(
            s,
            "    peak resident memory of this process                         {:>12}  ({:.2}x inputs + outputs; {} before the inputs)",
            human_bytes(peak as u128),
            peak as f64 / io as f64,
            human_bytes(rss_before as u128)
        );
    }
    let _ = writeln!(
        s,
        "    the naive score matrix would be {:.0}x the memory this run used",
        scores_f32 as f64 / peak.max(io as u64) as f64
    );
    Ok((s, pass))
}

/// How a CUDA call got its kernel, for the demo's report.
fn describe_origin(origin: KernelOrigin) -> String {
    match origin {
        KernelOrigin::Compiled { ms } => {
            format!("compiled by NVRTC in {ms:.0} ms (kept in the disk cache unless it is off)")
        }
        KernelOrigin::DiskCache => {
            "loaded from the disk cache (cache hit: nothing compiled)".into()
        }
        KernelOrigin::ProcessCache => "already loaded in this process".into(),
    }
}
