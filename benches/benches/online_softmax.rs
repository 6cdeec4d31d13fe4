//! Online softmax bookkeeping over a long row in blocks, with the exact and the software exp2
//! and both rescale policies: the per-element cost every backend pays.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use fa_reference::Rng;
use softmax_core::{exp2_cubic, RescalePolicy, RescaleStats, RowState};

fn bench_online(c: &mut Criterion) {
    let mut rng = Rng::new(1);
    let row: Vec<f32> = (0..4096).map(|_| rng.normal() as f32 * 4.0).collect();
    let mut group = c.benchmark_group("online_softmax_row4096_block64");
    group.throughput(Throughput::Elements(row.len() as u64));
    let policies = [
        ("always", RescalePolicy::Always),
        ("threshold8", RescalePolicy::Threshold(8.0)),
    ];
    for (name, policy) in policies {
        for (exp_name, exp2) in [("libm", f32::exp2 as fn(f32) -> f32), ("cubic", exp2_cubic)] {
            group.bench_function(format!("{name}/{exp_name}"), |b| {
                let mut scratch = row.clone();
                b.iter(|| {
                    scratch.copy_from_slice(&row);
                    let mut state = RowState::new();
                    let mut stats = RescaleStats::default();
                    for block in scratch.chunks_mut(64) {
                        black_box(state.update_with(block, &policy, &mut stats, exp2));
                    }
                    black_box(state.finish())
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_online);
criterion_main!(benches);
