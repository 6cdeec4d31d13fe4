//! `fa bench`: time the forward pass over the paper shapes or given ones.
//!
//! FLOPs are counted as FlashAttention does ([`softmax_core::flops::forward`]): `4 · batch ·
//! heads · seqlen_q · seqlen_k · head_dim`, halved when causal with `seqlen_q = seqlen_k`. Inputs are N(0,1) (never zeros).
//! Peak memory is the process's peak resident set (`VmHWM`), reset before each shape through
//! `/proc/self/clear_refs` where the kernel allows it, beside the bytes the inputs and outputs
//! need.

use crate::backend::{Backend, Options};
use crate::error::CliError;
use crate::peers::PeerRatios;
use crate::plan::human_bytes;
use crate::tensor::{random_normal, DType, HostTensor, TensorViews};
pub use flash_attention::shapes::{paper_shapes, BenchShape};
use softmax_core::{Out, Qkv};

/// The measurement of one shape; serialises as one JSON line.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchResult {
    /// Backend name.
    pub backend: &'static str,
    /// Input dtype (serialised as its name).
    #[serde(serialize_with = "dtype_name")]
    pub dtype: DType,
    /// The shape (its fields appear at the top level of the JSON).
    #[serde(flatten)]
    pub shape: BenchShape,
    /// CPU threads used (0 on CUDA).
    pub threads: usize,
    /// Median time of the timed iterations, milliseconds.
    pub time_ms_median: f64,
    /// Fastest iteration, milliseconds.
    pub time_ms_min: f64,
    /// Timed iterations.
    pub iters: usize,
    /// FLOPs / median time, in GFLOP/s.
    pub gflops: f64,
    /// Peak resident set of the process during this shape (bytes; 0 if unknown).
    pub peak_rss_bytes: u64,
    /// Bytes the inputs and outputs need.
    pub io_bytes: u64,
    /// CUDA tile override of this measurement (`None`: the tuned choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tiles: Option<String>,
    /// PyTorch SDPA's numbers for this shape, with `--peers`.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub peers: Option<PeerRatios>,
}

impl BenchResult {
    /// FLOPs / median time, in TFLOP/s.
    pub fn tflops(&self) -> f64 {
        self.gflops / 1e3
    }
}

fn dtype_name<S: serde::Serializer>(dtype: &DType, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(dtype.name())
}

/// `t` as `128x64x4x2x2` (block_m × block_n × warps × min_blocks × stages).
pub fn tiles_name(t: &flash_attention::Tiles) -> String {
    format!(
        "{}x{}x{}x{}x{}",
        t.block_m, t.block_n, t.warps, t.min_blocks, t.stages
    )
}

/// Peak resident set size of this process (`VmHWM` of `/proc/self/status`), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Resets the peak resident set to the current one (Linux `clear_refs` 5); false if refused.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Median of a non-empty slice (sorted copy).
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Refuses a shape whose host buffers (Q, K, V, O and the f32 LSE) overflow or exceed the
/// memory available, before anything is allocated.
pub fn ensure_shape_fits(shape: &BenchShape, dtype: DType) -> Result<(), CliError> {
    let e = dtype.size();
    let (b, d) = (shape.batch, shape.head_dim);
    let parts = [
        crate::memory::checked_bytes(&[b, shape.seqlen_q, shape.heads, d], e),
        crate::memory::checked_bytes(&[b, shape.seqlen_k, shape.heads_kv, d], 2 * e),
        crate::memory::checked_bytes(&[b, shape.seqlen_q, shape.heads, d], e),
        crate::memory::checked_bytes(&[b, shape.seqlen_q, shape.heads], 4),
    ];
    let total = parts
        .iter()
        .try_fold(0u128, |acc, p| p.and_then(|p| acc.checked_add(p)));
    crate::memory::ensure_fits(
        &format!(
            "b{} h{} n{} d{} {dtype} (Q, K, V, O and LSE)",
            b, shape.heads, shape.seqlen_q, d
        ),
        total,
    )
}

/// Times one shape: `warmup` untimed calls, then `iters` timed ones (at least one).
pub fn bench_shape(
    backend: &Backend,
    shape: &BenchShape,
    dtype: DType,
    opts: &Options,
    warmup: usize,
    iters: usize,
    seed: u64,
) -> Result<BenchResult, CliError> {
    // Sizes first: building the description multiplies the dimensions unchecked.
    ensure_shape_fits(shape, dtype)?;
    let desc = shape.desc();
    let problem = desc.validate(softmax_core::MAX_HEAD_DIM)?;
    reset_peak_rss();
    let mut rng = fa_reference::Rng::new(seed);
    let (b, d) = (shape.batch, shape.head_dim);
    let q = random_normal(&mut rng, dtype, vec![b, shape.seqlen_q, shape.heads, d])?;
    let k = random_normal(&mut rng, dtype, vec![b, shape.seqlen_k, shape.heads_kv, d])?;
    let v = random_normal(&mut rng, dtype, vec![b, shape.seqlen_k, shape.heads_kv, d])?;
    let mut out = HostTensor::zeros(dtype, q.shape.clone())?;
    let mut lse = crate::memory::try_filled(problem.lse_len(), 0.0f32, "the LSE")?;
    let times = backend.time_forward(
        &problem,
        Qkv::new(q.view(), k.view(), v.view()),
        Out::with_lse(out.data.view_mut(), &mut lse[..]),
        opts,
        warmup,
        iters.max(1),
    )?;
    let med = median(&times);
    let min = times.iter().copied().fold(f64::INFINITY, f64::min);
    Ok(BenchResult {
        backend: backend.name(),
        dtype,
        shape: *shape,
        threads: backend.effective_threads(opts.threads),
        time_ms_median: med * 1e3,
        time_ms_min: min * 1e3,
        iters: times.len(),
        gflops: shape.flops() / med / 1e9,
        peak_rss_bytes: peak_rss_bytes().unwrap_or(0),
        io_bytes: shape.io_bytes(dtype),
        tiles: opts.tiles.as_ref().map(tiles_name),
        peers: None,
    })
}

/// `gflops` as `62.9 GFLOP/s`, or `315.1 TFLOP/s` from 1000 GFLOP/s on.
pub fn throughput(gflops: f64) -> String {
    if gflops >= 1000.0 {
        format!("{:.1} TFLOP/s", gflops / 1000.0)
    } else {
        format!("{gflops:.1} GFLOP/s")
    }
}

/// The table header matching [`table_row`].
pub fn table_header() -> String {
    format!(
        "{:<7} {:<5} {:>5} {:>7} {:>7} {:>7} {:>5} {:<6} {:>3} {:>11} {:>15} {:>11} {:>11}",
        "backend",
        "dtype",
        "batch",
        "heads",
        "seq_q",
        "seq_k",
        "hdim",
        "causal",
        "thr",
        "median ms",
        "throughput",
        "peak RSS",
        "in+out"
    )
}

/// A table's heads column: `8`, or `8/2` (query/KV) under GQA.
pub(crate) fn heads_label(s: &BenchShape) -> String {
    if s.heads_kv == s.heads {
        s.heads.to_string()
    } else {
        format!("{}/{}", s.heads, s.heads_kv)
    }
}

/// One table row.
pub fn table_row(r: &BenchResult) -> String {
    let s = &r.shape;
    let heads = heads_label(s);
    format!(
        "{:<7} {:<5} {:>5} {:>7} {:>7} {:>7} {:>5} {:<6} {:>3} {:>11.3} {:>15} {:>11} {:>11}",
        r.backend,
        r.dtype.name(),
        s.batch,
        heads,
        s.seqlen_q,
        s.seqlen_k,
        s.head_dim,
        if s.causal { "yes" } else { "no" },
        if r.threads == 0 {
            "-".to_string()
        } else {
            r.threads.to_string()
        },
        r.time_ms_median,
        throughput(r.gflops),
        human_bytes(r.peak_rss_bytes as u128),
        human_bytes(r.io_bytes as u128)
    )
}

/// The header of the table `--peers` prints (the GPU session logs' columns: our TFLOP/s, PyTorch
/// SDPA flash's and cuDNN's, and our ratios over them, then the tile choice).
pub fn peers_header() -> String {
    format!(
        "{:>5} {:>6} {:>5} {:>5} {:>6} {:>10} {:>9} {:>8} {:>8} {:>7} {:>7}",
        "hdim",
        "seqlen",
        "batch",
        "heads",
        "causal",
        "median_ms",
        "TFLOP/s",
        "flash",
        "cudnn",
        "/flash",
        "/cudnn"
    )
}

/// One row of the `--peers` table (the numbers of [`BenchResult::peers`]; `-` where the peer
/// has none).
pub fn peers_row(r: &BenchResult) -> String {
    let s = &r.shape;
    let p = r.peers.unwrap_or_default();
    let fmt = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.1}"));
    let ratio = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}"));
    format!(
        "{:>5} {:>6} {:>5} {:>5} {:>6} {:>10.3} {:>9.1} {:>8} {:>8} {:>7} {:>7} {}",
        s.head_dim,
        s.seqlen_q,
        s.batch,
        s.heads,
        s.causal,
        r.time_ms_median,
        r.tflops(),
        fmt(p.peer_flash_tflops),
        fmt(p.peer_cudnn_tflops),
        ratio(p.vs_flash),
        ratio(p.vs_cudnn),
        r.tiles.as_deref().unwrap_or("default")
    )
}

/// The line that opens the `--peers` summary (scripts cut the log from it on).
pub const PEERS_SUMMARY: &str =
    "summary (TFLOP/s; ratios over PyTorch SDPA measured in the same device call):";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(throughput(62.94), "62.9 GFLOP/s");
        assert_eq!(throughput(315_100.5), "315.1 TFLOP/s");
    }

    #[test]
    fn peak_rss_is_readable_here() {
        // Linux exposes VmHWM; the bench reports 0 elsewhere.
        if cfg!(target_os = "linux") {
            assert!(peak_rss_bytes().unwrap() > 0);
        }
    }
}
