//! fa-cpu's split-KV decode over a KV cache (one query per sequence, GQA 32/8, head dim 128,
//! padded and paged with blocks of 16), with the K/V bytes read as throughput so criterion
//! reports the read bandwidth. `cargo bench -p fa-benches --bench cpu_decode`; the fraction of
//! the machine's copy bandwidth in the same run: `fa bench --decode` or
//! `cargo run --release -p fa-cpu --example bench_decode`.

#![allow(missing_docs)] // criterion's macros generate undocumented items

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use fa_cpu::{forward_with_workspace, Element, ForwardOptions, Workspace};
use fa_reference::{CacheLayout, DecodeCase, Rng, Rounding};
use softmax_core::{Out, Qkv, MAX_HEAD_DIM};

fn bench_shape<T: Element>(c: &mut Criterion, batch: usize, cache: usize, page: usize) {
    let (heads, heads_kv, head_dim) = (32, 8, 128);
    let used = vec![cache as u32; batch];
    let layout = if page == 0 {
        CacheLayout::Padded { capacity: cache }
    } else {
        DecodeCase::paged_layout(&used, page)
    };
    let mut rng = Rng::new(1);
    let case = DecodeCase::new(
        &mut rng,
        &used,
        1,
        heads,
        heads_kv,
        head_dim,
        layout,
        Rounding::Bf16,
    );
    let convert = |x: &[f32]| -> Vec<T> { x.iter().map(|&v| T::from_f32(v)).collect() };
    let (q, k, v) = (convert(&case.q), convert(&case.k), convert(&case.v));
    let mut out = vec![T::from_f32(0.0); q.len()];
    let mut lse = vec![0.0f32; batch * heads];
    let mut ws = Workspace::new();
    let opts = ForwardOptions::default();
    let problem = case.desc().validate(MAX_HEAD_DIM).expect("valid problem");
    let kv_bytes = 2 * batch * cache * heads_kv * head_dim * std::mem::size_of::<T>();
    let mut group = c.benchmark_group(format!("cpu_decode_{}", T::NAME));
    group.sample_size(10);
    group.throughput(Throughput::Bytes(kv_bytes as u64));
    let name = format!(
        "b{batch}_cache{cache}_{}",
        if page == 0 {
            "padded".to_string()
        } else {
            format!("page{page}")
        }
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

fn bench_decode(c: &mut Criterion) {
    for page in [0, 16] {
        bench_shape::<f32>(c, 4, 8192, page);
        bench_shape::<half::bf16>(c, 4, 8192, page);
    }
    bench_shape::<half::bf16>(c, 1, 32768, 16);
}

criterion_group!(benches, bench_decode);
criterion_main!(benches);
