//! Times `fa_cpu::forward` on one shape and prints one JSON line in the format of
//! `fa bench --json` (what `scripts/cpu_peer.py` reads):
//!
//! ```text
//! cargo run --release -p fa-cpu --example bench_forward -- \
//!     --dtype f32 --batch 1 --heads 8 --seqlen 4096 --head-dim 128 --causal --threads 2 --reps 5
//! ```
//!
//! Flags: `--dtype f32|bf16|f16`, `--batch`, `--heads`, `--heads-kv` (default: heads),
//! `--seqlen` (or `--seqlen-q`/`--seqlen-k`), `--head-dim`, `--causal`, `--threads`
//! (default: all cores), `--reps` (timed runs, default 5), `--warmup` (default 1),
//! `--exp2 auto|exact|cubic` (default auto), `--simd auto|amx|avx512f|avx2|scalar`. FLOPs:
//! `4·B·H·Nq·Nk·D`, halved when causal with `Nq = Nk` (DESIGN.md §7). `peak_rss_bytes` is the
//! process's high-water mark (VmHWM) after the runs.

mod common;

use common::{median, Inputs};
use fa_cpu::{forward_with_workspace, Element, Exp2Impl, ForwardOptions, SimdLevel, Workspace};
use softmax_core::{Out, ProblemDesc, Qkv};
use std::time::Instant;

struct Args {
    dtype: String,
    batch: usize,
    heads: usize,
    heads_kv: Option<usize>,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
    causal: bool,
    threads: Option<usize>,
    reps: usize,
    warmup: usize,
    exp2: Exp2Impl,
    simd: SimdLevel,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        dtype: "f32".into(),
        batch: 1,
        heads: 8,
        heads_kv: None,
        seqlen_q: 1024,
        seqlen_k: 1024,
        head_dim: 128,
        causal: false,
        threads: None,
        reps: 5,
        warmup: 1,
        exp2: Exp2Impl::Auto,
        simd: SimdLevel::Auto,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let num = |s: String| s.parse::<usize>().map_err(|e| format!("{s}: {e}"));
        match flag.as_str() {
            "--dtype" => a.dtype = value()?,
            "--batch" => a.batch = num(value()?)?,
            "--heads" => a.heads = num(value()?)?,
            "--heads-kv" => a.heads_kv = Some(num(value()?)?),
            "--seqlen" => {
                a.seqlen_q = num(value()?)?;
                a.seqlen_k = a.seqlen_q;
            }
            "--seqlen-q" => a.seqlen_q = num(value()?)?,
            "--seqlen-k" => a.seqlen_k = num(value()?)?,
            "--head-dim" => a.head_dim = num(value()?)?,
            "--causal" => a.causal = true,
            "--threads" => a.threads = Some(num(value()?)?),
            "--reps" => a.reps = num(value()?)?.max(1),
            "--warmup" => a.warmup = num(value()?)?,
            "--exp2" => {
                a.exp2 = match value()?.as_str() {
                    "auto" => Exp2Impl::Auto,
                    "exact" => Exp2Impl::Exact,
                    "cubic" => Exp2Impl::Cubic,
                    other => return Err(format!("unknown exp2 {other}")),
                }
            }
            "--simd" => {
                a.simd = match value()?.as_str() {
                    "auto" => SimdLevel::Auto,
                    "amx" => SimdLevel::Amx,
                    "avx512f" => SimdLevel::Avx512f,
                    "avx2" => SimdLevel::Avx2Fma,
                    "scalar" => SimdLevel::Scalar,
                    other => return Err(format!("unknown simd level {other}")),
                }
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(a)
}

fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// CPU time of the whole process (every thread) in milliseconds, from
/// `/proc/self/task/*/schedstat` (nanoseconds on a CPU); 0 where unavailable.
fn process_cpu_ms() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .sum::<f64>()
        / 1e6
}

fn bench<T: Element>(a: &Args) -> Result<(), String> {
    let heads_kv = a.heads_kv.unwrap_or(a.heads);
    let mut desc = ProblemDesc::new(
        a.batch, a.seqlen_q, a.seqlen_k, a.heads, heads_kv, a.head_dim,
    );
    if a.causal {
        desc = desc.causal();
    }
    let problem = desc.validate(256).map_err(|e| e.to_string())?;
    let lens = problem.min_buffer_lens();
    let mut inputs = Inputs::new();
    let (q, k, v) = (
        inputs.draw::<T>(lens.q),
        inputs.draw::<T>(lens.k),
        inputs.draw::<T>(lens.v),
    );
    let mut out = vec![T::from_f32(0.0); lens.o];
    let mut lse = vec![0.0f32; problem.lse_len()];
    let opts = ForwardOptions {
        threads: a.threads,
        exp2: a.exp2,
        simd: a.simd,
        ..ForwardOptions::default()
    };
    let mut ws = Workspace::new();
    let mut times = Vec::new();
    let mut cpu_times = Vec::new();
    for rep in 0..a.warmup + a.reps {
        let cpu_start = process_cpu_ms();
        let start = Instant::now();
        let qkv = Qkv::new(&q[..], &k[..], &v[..]);
        let out = Out::with_lse(&mut out[..], &mut lse[..]);
        forward_with_workspace(&problem, qkv, out, &opts, &mut ws).map_err(|e| e.to_string())?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        if rep >= a.warmup {
            times.push(ms);
            cpu_times.push(process_cpu_ms() - cpu_start);
        }
    }
    let (median, cpu_median) = (median(&mut times), median(&mut cpu_times));
    let flops = softmax_core::flops::forward(
        a.batch, a.heads, a.seqlen_q, a.seqlen_k, a.head_dim, a.causal,
    );
    let threads = a.threads.unwrap_or_else(rayon_threads);
    println!(
        "{{\"backend\":\"cpu\",\"dtype\":\"{}\",\"batch\":{},\"heads\":{},\"seqlen_q\":{},\"seqlen_k\":{},\"head_dim\":{},\"causal\":{},\"threads\":{},\"time_ms_median\":{:.4},\"time_ms_min\":{:.4},\"cpu_ms_median\":{:.4},\"gflops\":{:.2},\"peak_rss_bytes\":{},\"simd\":\"{}\"}}",
        T::NAME,
        a.batch,
        a.heads,
        a.seqlen_q,
        a.seqlen_k,
        a.head_dim,
        a.causal,
        threads,
        median,
        times[0],
        cpu_median,
        flops / median / 1e6,
        peak_rss_bytes(),
        a.simd.resolve().name(),
    );
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn main() {
    let result = parse().and_then(|a| match a.dtype.as_str() {
        "f32" => bench::<f32>(&a),
        "bf16" => bench::<half::bf16>(&a),
        "f16" => bench::<half::f16>(&a),
        other => Err(format!("unknown dtype {other}")),
    });
    if let Err(e) = result {
        eprintln!("bench_forward: {e}");
        std::process::exit(2);
    }
}
