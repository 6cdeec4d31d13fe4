//! Times the dense forward (bf16, 16k tokens per shape: batch = 16384 / seqlen, 2048 / head
//! dim query and KV heads) on each seqlen × head dim × causal shape through
//! [`fa_cuda::Device::time_forward`] (CUDA events around each launch) and prints one JSON
//! line per shape: median kernel time and TFLOP/s (causal counts half the matrix products).
//!
//! ```text
//! cargo run --release -p fa-cuda --example forward_bench -- [--seqlens 2048,8192]
//!     [--hdims 64,128,256] [--iters 30]
//! ```

use fa_cuda::{Device, ForwardOptions};
use half::bf16;
use softmax_core::{ProblemDesc, Qkv, MAX_HEAD_DIM};

fn list(v: &str) -> Vec<usize> {
    v.split(',')
        .map(|x| x.parse().expect("a list of numbers"))
        .collect()
}

fn main() {
    let (mut seqlens, mut hdims, mut iters) = (vec![2048, 8192], vec![64, 128, 256], 30usize);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next().unwrap_or_default();
        match a.as_str() {
            "--seqlens" => seqlens = list(&v),
            "--hdims" => hdims = list(&v),
            "--iters" => iters = v.parse().expect("--iters N"),
            other => panic!("unknown argument {other}"),
        }
    }
    let dev = Device::open(0).unwrap_or_else(|e| panic!("needs a CUDA GPU: {e}"));
    for &s in &seqlens {
        for &d in &hdims {
            for causal in [false, true] {
                let batch = (16384 / s).max(1);
                let heads = (2048 / d).max(1);
                let mut desc = ProblemDesc::new(batch, s, s, heads, heads, d);
                if causal {
                    desc = desc.causal();
                }
                let problem = desc.validate(MAX_HEAD_DIM).expect("shape");
                let n = batch * s * heads * d;
                let host: Vec<bf16> = (0..n)
                    .map(|i| bf16::from_f32(((i * 7919) % 1000) as f32 / 1000.0 - 0.5))
                    .collect();
                let q = dev.upload(&host).expect("upload");
                let k = dev.upload(&host).expect("upload");
                let v = dev.upload(&host).expect("upload");
                let mut o = dev.alloc_zeroed::<bf16>(n).expect("alloc");
                let opts = ForwardOptions::default();
                let mut times = dev
                    .time_forward(&problem, Qkv::new(&q, &k, &v), &mut o, &opts, 3, iters)
                    .expect("forward");
                times.sort_by(f32::total_cmp);
                let ms = times[times.len() / 2] as f64;
                let flops = 4.0 * (batch * heads) as f64 * (s * s * d) as f64
                    / if causal { 2.0 } else { 1.0 };
                println!(
                    "{{\"seqlen\":{s},\"hdim\":{d},\"causal\":{causal},\"ms\":{ms:.4},\"tflops\":{:.1}}}",
                    flops / (ms * 1e-3) / 1e12
                );
            }
        }
    }
}
