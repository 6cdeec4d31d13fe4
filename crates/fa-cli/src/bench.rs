//! `fa bench`: time the forward pass over the paper shapes or given ones.
//!
//! FLOPs are counted as FlashAttention does: `4 · batch · heads · seqlen_q · seqlen_k ·
//! head_dim`, halved when causal with `seqlen_q = seqlen_k`. Inputs are N(0,1) (never zeros).
//! Peak memory is the process's peak resident set (`VmHWM`), reset before each shape through
//! `/proc/self/clear_refs` where the kernel allows it, beside the bytes the inputs and outputs
//! need.

use crate::backend::{Backend, CallOptions};
use crate::error::CliError;
use crate::plan::human_bytes;
use crate::tensor::{random_normal, DType, HostTensor};
use softmax_core::ProblemDesc;

/// One benchmark shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BenchShape {
    /// Sequences.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub heads_kv: usize,
    /// Queries per sequence.
    pub seqlen_q: usize,
    /// Keys per sequence.
    pub seqlen_k: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Causal (bottom-right aligned) mask.
    pub causal: bool,
}

impl BenchShape {
    /// Forward FLOPs: `4·B·H·Nq·Nk·D`, halved when causal with `Nq = Nk`.
    pub fn flops(&self) -> f64 {
        let full = 4.0
            * self.batch as f64
            * self.heads as f64
            * self.seqlen_q as f64
            * self.seqlen_k as f64
            * self.head_dim as f64;
        if self.causal && self.seqlen_q == self.seqlen_k {
            full / 2.0
        } else {
            full
        }
    }

    /// Bytes of Q, K, V and O in `dtype` plus the f32 LSE.
    pub fn io_bytes(&self, dtype: DType) -> u64 {
        let (b, d) = (self.batch as u64, self.head_dim as u64);
        let q_o = 2 * b * self.seqlen_q as u64 * self.heads as u64 * d;
        let k_v = 2 * b * self.seqlen_k as u64 * self.heads_kv as u64 * d;
        let lse = 4 * b * self.heads as u64 * self.seqlen_q as u64;
        (q_o + k_v) * dtype.size() as u64 + lse
    }

    /// The problem description.
    pub fn desc(&self) -> ProblemDesc<'static> {
        let d = ProblemDesc::new(
            self.batch,
            self.seqlen_q,
            self.seqlen_k,
            self.heads,
            self.heads_kv,
            self.head_dim,
        );
        if self.causal {
            d.causal()
        } else {
            d
        }
    }
}

/// The FlashAttention papers' shapes: batch·seqlen = 16k tokens, hidden 2048 (heads =
/// 2048/head_dim), seqlen 512…16k, head_dim 64/128/256, non-causal and causal.
pub fn paper_shapes() -> Vec<BenchShape> {
    let mut shapes = Vec::new();
    for head_dim in [64, 128, 256] {
        for causal in [false, true] {
            for seqlen in [512, 1024, 2048, 4096, 8192, 16384] {
                shapes.push(BenchShape {
                    batch: 16384 / seqlen,
                    heads: 2048 / head_dim,
                    heads_kv: 2048 / head_dim,
                    seqlen_q: seqlen,
                    seqlen_k: seqlen,
                    head_dim,
                    causal,
                });
            }
        }
    }
    shapes
}

/// The measurement of one shape; serialises as one JSON line.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchResult {
    /// Backend name.
    pub backend: &'static str,
    /// Input dtype.
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

/// Times one shape: `warmup` untimed calls, then `iters` timed ones (at least one).
pub fn bench_shape(
    backend: &Backend,
    shape: &BenchShape,
    dtype: DType,
    opts: CallOptions,
    warmup: usize,
    iters: usize,
    seed: u64,
) -> Result<BenchResult, CliError> {
    reset_peak_rss();
    let mut rng = fa_reference::Rng::new(seed);
    let (b, d) = (shape.batch, shape.head_dim);
    let q = random_normal(&mut rng, dtype, vec![b, shape.seqlen_q, shape.heads, d]);
    let k = random_normal(&mut rng, dtype, vec![b, shape.seqlen_k, shape.heads_kv, d]);
    let v = random_normal(&mut rng, dtype, vec![b, shape.seqlen_k, shape.heads_kv, d]);
    let mut out = HostTensor::zeros(dtype, q.shape.clone());
    let mut lse = vec![0.0f32; b * shape.heads * shape.seqlen_q];
    let desc = shape.desc();
    let problem = desc.validate(softmax_core::MAX_HEAD_DIM)?;
    let times = backend.time_forward(
        &problem,
        &q.data,
        &k.data,
        &v.data,
        &mut out.data,
        &mut lse,
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

/// One table row.
pub fn table_row(r: &BenchResult) -> String {
    let s = &r.shape;
    let heads = if s.heads_kv == s.heads {
        s.heads.to_string()
    } else {
        format!("{}/{}", s.heads, s.heads_kv)
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_and_paper_shapes() {
        let s = BenchShape {
            batch: 2,
            heads: 3,
            heads_kv: 1,
            seqlen_q: 5,
            seqlen_k: 7,
            head_dim: 11,
            causal: true,
        };
        // seqlen_q ≠ seqlen_k: no halving.
        assert_eq!(s.flops(), 4.0 * 2.0 * 3.0 * 5.0 * 7.0 * 11.0);
        let sq = BenchShape { seqlen_k: 5, ..s };
        assert_eq!(sq.flops(), 2.0 * 2.0 * 3.0 * 5.0 * 5.0 * 11.0);
        assert_eq!(
            s.io_bytes(DType::Bf16),
            (2 * 2 * 5 * 3 * 11 + 2 * 2 * 7 * 11) * 2 + 4 * 2 * 3 * 5
        );
        let shapes = paper_shapes();
        assert_eq!(shapes.len(), 36);
        for s in shapes {
            assert_eq!(s.batch * s.seqlen_q, 16384);
            assert_eq!(s.heads * s.head_dim, 2048);
        }
    }

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
