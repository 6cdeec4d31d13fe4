//! fa-cpu's backward pass on a few shapes (B=1, H=8, f32, causal and not; one bf16), with FLOP
//! throughput (`softmax_core::flops::backward`: 2.5 × the forward's `4·B·H·N²·D`, halved when
//! causal) so criterion reports GFLOP/s. O and the LSE come from one forward call beforehand.
//! `cargo bench -p fa-benches --bench cpu_backward`; PyTorch comparisons: `scripts/cpu_peer.py
//! --backward`.

#![allow(missing_docs)] // criterion's macros generate undocumented items

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use fa_cpu::{
    backward_with_workspace, forward, BackwardInputs, BackwardOptions, BackwardWorkspace, Element,
    ForwardOptions,
};
use fa_reference::Rng;
use softmax_core::{Grads, Out, ProblemDesc, Qkv, MAX_HEAD_DIM};

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
    let (q, k, v, d_o) = (
        inputs::<T>(&mut rng, n),
        inputs::<T>(&mut rng, n),
        inputs::<T>(&mut rng, n),
        inputs::<T>(&mut rng, n),
    );
    let problem = desc.validate(MAX_HEAD_DIM).expect("valid problem");
    let mut out = vec![T::from_f32(0.0); n];
    let mut lse = vec![0.0f32; heads * seqlen];
    forward(
        &problem,
        Qkv::new(&q[..], &k[..], &v[..]),
        Out::with_lse(&mut out[..], &mut lse[..]),
        &ForwardOptions::default(),
    )
    .expect("valid problem");
    let zero = T::from_f32(0.0);
    let (mut dq, mut dk, mut dv) = (vec![zero; n], vec![zero; n], vec![zero; n]);
    let mut ws = BackwardWorkspace::new();
    let opts = BackwardOptions::default();
    let flops = softmax_core::flops::backward(1, heads, seqlen, seqlen, head_dim, causal);
    let mut group = c.benchmark_group(format!("cpu_backward_{}", T::NAME));
    group.sample_size(10);
    group.throughput(Throughput::Elements(flops as u64));
    let name = format!(
        "n{seqlen}_d{head_dim}{}",
        if causal { "_causal" } else { "" }
    );
    group.bench_function(name, |b| {
        b.iter(|| {
            let inputs = BackwardInputs {
                o: &out,
                d_o: &d_o,
                lse: &lse,
            };
            let grads = Grads::new(&mut dq[..], &mut dk[..], &mut dv[..]);
            backward_with_workspace(
                &problem,
                Qkv::new(&q[..], &k[..], &v[..]),
                inputs,
                grads,
                &opts,
                &mut ws,
            )
            .expect("valid problem");
            black_box(&dq);
        })
    });
    group.finish();
}

fn bench_backward(c: &mut Criterion) {
    for &(seqlen, head_dim) in &[(1024, 64), (1024, 128), (2048, 128)] {
        for causal in [false, true] {
            bench_shape::<f32>(c, seqlen, head_dim, causal);
        }
    }
    bench_shape::<half::bf16>(c, 1024, 128, false);
}

criterion_group! {
    name = benches;
    config = Criterion::default();
    targets = bench_backward
}
criterion_main!(benches);
