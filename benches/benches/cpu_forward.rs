//! fa-cpu's forward pass on a few shapes (B=1, H=8, f32 and bf16, causal and not), with
//! FLOP throughput (`softmax_core::flops::forward`: `4·B·H·N²·D`, halved when causal) so
//! criterion reports GFLOP/s.
//! `cargo bench -p fa-benches --bench cpu_forward`; PyTorch comparisons: scripts/cpu_peer.py.

#![allow(missing_docs)] // criterion's macros generate undocumented items

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use fa_cpu::{forward_with_workspace, Element, ForwardOptions, Workspace};
use fa_reference::Rng;
use softmax_core::{Out, ProblemDesc, Qkv, MAX_HEAD_DIM};

fn inputs<T: Element>(rng: &mut Rng, n: usize) -> Vec<T> {
    (0..n).map(|_| T::from_f32(rng.normal() as f32)).collect()
}

fn bench_shape<T: Element>(c: &mut Criterion, seqlen: usize, head_dim: usize, causal: bool) {
    let heads = 8;
    let mut desc = ProblemDesc::new(1, seqlen, seqlen, heads, heads, head_dim);
    if causal {
        desc = desc.causal();
    }
    let mut rng = Rng::new(1);
    let n = seqlen * heads * head_dim;
    let (q, k, v) = (
        inputs::<T>(&mut rng, n),
        inputs::<T>(&mut rng, n),
        inputs::<T>(&mut rng, n),
    );
    let mut out = vec![T::from_f32(0.0); n];
    let mut lse = vec![0.0f32; heads * seqlen];
    let mut ws = Workspace::new();
    let opts = ForwardOptions::default();
    let problem = desc.validate(MAX_HEAD_DIM).expect("valid problem");
    let flops = softmax_core::flops::forward(1, heads, seqlen, seqlen, head_dim, causal);
    let mut group = c.benchmark_group(format!("cpu_forward_{}", T::NAME));
    group.sample_size(10);
    group.throughput(Throughput::Elements(flops as u64));
    let name = format!(
        "n{seqlen}_d{head_dim}{}",
        if causal { "_causal" } else { "" }
    );
    group.bench_function(name, |b| {
        b.iter(|| {
            let qkv = Qkv::new(&q[..], &k[..], &v[..]);
            let bundle = Out::with_lse(&mut out[..], &mut lse[..]);
            forward_with_workspace(&problem, qkv, bundle, &opts, &mut ws).expect("valid problem");
            black_box(&out);
        })
    });
    group.finish();
}

fn bench_forward(c: &mut Criterion) {
    for &(seqlen, head_dim) in &[(1024, 64), (1024, 128), (2048, 128), (1024, 256)] {
        for causal in [false, true] {
            bench_shape::<f32>(c, seqlen, head_dim, causal);
        }
    }
    bench_shape::<half::bf16>(c, 1024, 128, false);
}

criterion_group! {
    name = benches;
    config = Criterion::default();
    targets = bench_forward
}
criterion_main!(benches);
