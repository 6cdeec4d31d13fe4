//! `fa bench --backward`: the backward pass (and forward + backward) over the same shapes as
//! the forward bench, with the bytes the calls allocate.
//!
//! FLOPs: [`softmax_core::flops::backward`] (2.5 × the forward's, the usual convention);
//! forward + backward is 3.5 × the forward's. Each iteration times one forward (LSE written)
//! and then one backward on its outputs; the medians are over iterations, and the total's
//! median is of the per-iteration sums. Memory comes from the counting allocator the `fa`
//! binary installs ([`crate::alloc_count`]): `backward_alloc_bytes` is the peak of what the
//! first backward call of the shape allocated beyond the live buffers (its workspace when it
//! is cold: run one shape per process for a clean number), `heap_peak_bytes` the peak of the
//! whole shape (buffers included) beside `io_bytes`, the bytes of Q, K, V, O, LSE, dO and the
//! gradients.

use crate::alloc_count;
use crate::backend::{Backend, Options};
use crate::bench::{heads_label, median, throughput, BenchShape};
use crate::error::CliError;
use crate::plan::human_bytes;
use crate::tensor::{random_normal, DType, HostTensor, TensorViews};
use flash_attention::backward::BackwardInputs;
use softmax_core::{Grads, Out, Qkv};

/// The measurement of one shape; serialises as one JSON line.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BackwardBenchResult {
    /// Backend name.
    pub backend: &'static str,
    /// Always `"backward"` (tells these lines from the forward bench's).
    pub pass: &'static str,
    /// Input dtype name (gradients in the same dtype).
    pub dtype: &'static str,
    /// The shape (its fields appear at the top level of the JSON).
    #[serde(flatten)]
    pub shape: BenchShape,
    /// CPU threads used.
    pub threads: usize,
    /// Timed iterations.
    pub iters: usize,
    /// Median forward time (with LSE), milliseconds.
    pub forward_ms_median: f64,
    /// Median backward time, milliseconds.
    pub backward_ms_median: f64,
    /// Fastest backward, milliseconds.
    pub backward_ms_min: f64,
    /// Median of forward + backward per iteration, milliseconds.
    pub total_ms_median: f64,
    /// Backward FLOPs / median backward time, GFLOP/s.
    pub backward_gflops: f64,
    /// Forward + backward FLOPs (3.5 × forward) / median total, GFLOP/s.
    pub total_gflops: f64,
    /// Peak bytes the first backward call allocated beyond the live buffers (0: the counting
    /// allocator is not installed).
    pub backward_alloc_bytes: u64,
    /// Peak live heap bytes of the whole shape (buffers, workspaces).
    pub heap_peak_bytes: u64,
    /// Bytes of Q, K, V, O, LSE, dO, dQ, dK and dV.
    pub io_bytes: u64,
    /// PyTorch SDPA's backward numbers for this shape, with `--peers` (ratios of
    /// `backward_gflops`).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub peers: Option<crate::peers::PeerRatios>,
}

/// Times the backward of one shape: one forward + backward to warm up (and to measure the
/// first backward's allocation), `warmup − 1` more untimed pairs, then `iters` timed ones
/// (wall clock). On CUDA the reported medians are then taken again from the kernels alone
/// (CUDA events, inputs uploaded once: `Backend::time_forward` / `time_backward`).
pub fn bench_backward_shape(
    backend: &Backend,
    shape: &BenchShape,
    dtype: DType,
    opts: &Options,
    warmup: usize,
    iters: usize,
    seed: u64,
) -> Result<BackwardBenchResult, CliError> {
    // The forward's check first (checked arithmetic): past it, the backward's buffers (about
    // twice the forward's) cannot overflow a u64.
    crate::bench::ensure_shape_fits(shape, dtype)?;
    crate::memory::ensure_fits(
        &format!(
            "b{} h{} n{} d{} {dtype} (inputs, outputs and gradients)",
            shape.batch, shape.heads, shape.seqlen_q, shape.head_dim
        ),
        Some(shape.backward_io_bytes(dtype) as u128),
    )?;
    let problem = shape.desc().validate(softmax_core::MAX_HEAD_DIM)?;
    let base = alloc_count::live_bytes();
    alloc_count::reset_peak();
    let mut rng = fa_reference::Rng::new(seed);
    let (b, d) = (shape.batch, shape.head_dim);
    let q_shape = vec![b, shape.seqlen_q, shape.heads, d];
    let kv_shape = vec![b, shape.seqlen_k, shape.heads_kv, d];
    let q = random_normal(&mut rng, dtype, q_shape.clone())?;
    let k = random_normal(&mut rng, dtype, kv_shape.clone())?;
    let v = random_normal(&mut rng, dtype, kv_shape.clone())?;
    let d_o = random_normal(&mut rng, dtype, q_shape.clone())?;
    let mut out = HostTensor::zeros(dtype, q_shape.clone())?;
    let mut lse = crate::memory::try_filled(problem.lse_len(), 0.0f32, "the LSE")?;
    let mut dq = HostTensor::zeros(dtype, q_shape)?;
    let mut dk = HostTensor::zeros(dtype, kv_shape.clone())?;
    let mut dv = HostTensor::zeros(dtype, kv_shape)?;
    let qkv = Qkv::new(q.view(), k.view(), v.view());

    let forward = |out: &mut HostTensor, lse: &mut [f32]| -> Result<f64, CliError> {
        let start = std::time::Instant::now();
        backend.forward(&problem, qkv, Out::with_lse(out.data.view_mut(), lse), opts)?;
        Ok(start.elapsed().as_secs_f64())
    };
    let mut fwd_times = Vec::new();
    let mut bwd_times = Vec::new();
    let (mut backward_alloc, mut heap_peak) = (0usize, 0usize);
    // CUDA: the first pair only (the allocation measure, O and the LSE); the timing is the
    // kernels' below.
    let cuda = backend.kind() == flash_attention::BackendKind::Cuda;
    let calls = if cuda {
        1
    } else {
        warmup.max(1) + iters.max(1)
    };
    for i in 0..calls {
        let tf = forward(&mut out, &mut lse)?;
        let inputs = BackwardInputs {
            o: out.view(),
            d_o: d_o.view(),
            lse: &lse,
        };
        let grads = Grads::new(dq.data.view_mut(), dk.data.view_mut(), dv.data.view_mut());
        if i == 0 {
            heap_peak = alloc_count::peak_bytes();
            let before = alloc_count::live_bytes();
            alloc_count::reset_peak();
            backend.backward(&problem, qkv, inputs, grads, opts)?;
            backward_alloc = alloc_count::peak_bytes().saturating_sub(before);
            heap_peak = heap_peak.max(alloc_count::peak_bytes());
            continue;
        }
        let start = std::time::Instant::now();
        backend.backward(&problem, qkv, inputs, grads, opts)?;
        let tb = start.elapsed().as_secs_f64();
        if i >= warmup.max(1) {
            fwd_times.push(tf);
            bwd_times.push(tb);
        }
    }
    heap_peak = heap_peak.max(alloc_count::peak_bytes());
    if cuda {
        // On CUDA the host calls above include the transfers: the medians come from the
        // kernels alone, timed with CUDA events on inputs uploaded once (the library's
        // time_forward / time_backward), as the forward bench and the peers' do_bench do.
        fwd_times = backend.time_forward(
            &problem,
            qkv,
            Out::with_lse(out.data.view_mut(), &mut lse[..]),
            opts,
            warmup,
            iters.max(1),
        )?;
        let inputs = BackwardInputs {
            o: out.view(),
            d_o: d_o.view(),
            lse: &lse,
        };
        let grads = Grads::new(dq.data.view_mut(), dk.data.view_mut(), dv.data.view_mut());
        bwd_times =
            backend.time_backward(&problem, qkv, inputs, grads, opts, warmup, iters.max(1))?;
    }
    let totals: Vec<f64> = fwd_times
        .iter()
        .zip(&bwd_times)
        .map(|(f, b)| f + b)
        .collect();
    let (fwd, bwd, total) = (median(&fwd_times), median(&bwd_times), median(&totals));
    Ok(BackwardBenchResult {
        backend: backend.name(),
        pass: "backward",
        dtype: dtype.name(),
        shape: *shape,
        threads: backend.effective_threads(opts.threads),
        iters: bwd_times.len(),
        forward_ms_median: fwd * 1e3,
        backward_ms_median: bwd * 1e3,
        backward_ms_min: bwd_times.iter().copied().fold(f64::INFINITY, f64::min) * 1e3,
        total_ms_median: total * 1e3,
        backward_gflops: shape.backward_flops() / bwd / 1e9,
        total_gflops: (shape.flops() + shape.backward_flops()) / total / 1e9,
        backward_alloc_bytes: backward_alloc as u64,
        heap_peak_bytes: heap_peak.saturating_sub(base) as u64,
        io_bytes: shape.backward_io_bytes(dtype),
        peers: None,
    })
}

/// The table header matching [`backward_table_row`].
pub fn backward_table_header() -> String {
    format!(
        "{:<5} {:>5} {:>7} {:>7} {:>5} {:<6} {:>3} {:>9} {:>9} {:>9} {:>15} {:>15} {:>10} {:>10} {:>10}",
        "dtype",
        "batch",
        "heads",
        "seq",
        "hdim",
        "causal",
        "thr",
        "fwd ms",
        "bwd ms",
        "f+b ms",
        "bwd",
        "fwd+bwd",
        "bwd alloc",
        "heap peak",
        "in+out+dX"
    )
}

/// One table row.
pub fn backward_table_row(r: &BackwardBenchResult) -> String {
    let s = &r.shape;
    let heads = heads_label(s);
    format!(
        "{:<5} {:>5} {:>7} {:>7} {:>5} {:<6} {:>3} {:>9.2} {:>9.2} {:>9.2} {:>15} {:>15} {:>10} {:>10} {:>10}",
        r.dtype,
        s.batch,
        heads,
        s.seqlen_q,
        s.head_dim,
        if s.causal { "yes" } else { "no" },
        r.threads,
        r.forward_ms_median,
        r.backward_ms_median,
        r.total_ms_median,
        throughput(r.backward_gflops),
        throughput(r.total_gflops),
        human_bytes(r.backward_alloc_bytes as u128),
        human_bytes(r.heap_peak_bytes as u128),
        human_bytes(r.io_bytes as u128)
    )
}

/// One row of the backward `--peers` summary, in the columns of [`crate::bench::peers_header`]
/// (our backward median and TFLOP/s, PyTorch SDPA flash's and cuDNN's backward TFLOP/s and our
/// ratios over them; `-` where a peer number is missing).
pub fn backward_peers_row(r: &BackwardBenchResult) -> String {
    let s = &r.shape;
    let p = r.peers.unwrap_or_default();
    let fmt = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.1}"));
    let ratio = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}"));
    format!(
        "{:>5} {:>6} {:>5} {:>5} {:>6} {:>10.3} {:>9.1} {:>8} {:>8} {:>7} {:>7} backward",
        s.head_dim,
        s.seqlen_q,
        s.batch,
        s.heads,
        s.causal,
        r.backward_ms_median,
        r.backward_gflops / 1e3,
        fmt(p.peer_flash_tflops),
        fmt(p.peer_cudnn_tflops),
        ratio(p.vs_flash),
        ratio(p.vs_cudnn),
    )
}
