//! A small, fresh-input version of FlashAttention-3's accuracy experiment (the full one is
//! `examples/fp8_accuracy.rs`): on `N(0,1) + N(0,100)·Bernoulli(0.001)` inputs the error
//! ordering f32 < FP16 < BF16 < FP8 per-block + Hadamard < FP8 per-tensor must hold, with
//! the Hadamard variant clearly ahead.

use fa_cpu::{forward, Exp2Impl, ForwardOptions};
use fa_fp8::attention::{forward_fp8, Fp8Options, Fp8Scaling};
use fa_reference::{attention_f64, Rng, Rounding};
use softmax_core::{Out, ProblemDesc, Qkv, RescalePolicy, MAX_HEAD_DIM};

#[test]
fn error_ordering_on_the_outlier_distribution() {
    let (n, d) = (2048usize, 128usize);
    let mut rng = Rng::fresh();
    let mut draw = || -> Vec<f32> {
        (0..n * d)
            .map(|_| {
                let spike = if rng.uniform() < 0.001 {
                    10.0 * rng.normal()
                } else {
                    0.0
                };
                (rng.normal() + spike) as f32
            })
            .collect()
    };
    let (q, k, v) = (draw(), draw(), draw());
    // The reference covers every row. The per-tensor error comes from the rare query/key
    // pairs whose outliers share a coordinate (~0.26 per row at this size, see the README),
    // so a sample of rows makes the ratio below noisy: with 256 evenly spread rows a CI draw
    // gave 1.15; with all rows, 240 seeds gave 1.56–3.25.
    let desc = ProblemDesc::new(1, n, n, 1, 1, d);
    let reference = attention_f64(&desc.validate(256).unwrap(), &q, &k, &v).out;
    let rmse = |out: &[f32]| -> f64 {
        let s: f64 = out
            .iter()
            .zip(&reference)
            .map(|(&o, &r)| (o as f64 - r).powi(2))
            .sum();
        (s / reference.len() as f64).sqrt()
    };
    let rounded = |rounding: Rounding| -> f64 {
        let r = |x: &[f32]| x.iter().map(|&y| rounding.apply(y)).collect::<Vec<_>>();
        let mut out = vec![f32::NAN; n * d];
        let opts = ForwardOptions {
            exp2: Exp2Impl::Exact,
            rescale: RescalePolicy::Always,
            ..ForwardOptions::default()
        };
        let (q, k, v) = (r(&q), r(&k), r(&v));
        let problem = desc.validate(MAX_HEAD_DIM).unwrap();
        let qkv = Qkv::new(&q[..], &k[..], &v[..]);
        forward(&problem, qkv, Out::new(&mut out[..]), &opts).unwrap();
        rmse(&out)
    };
    let fp8 = |scaling: Fp8Scaling, hadamard_seed: Option<u64>| -> f64 {
        let mut out = vec![f32::NAN; n * d];
        let opts = Fp8Options {
            scaling,
            hadamard_seed,
            ..Fp8Options::default()
        };
        forward_fp8(
            &desc,
            Qkv::new(&q[..], &k[..], &v[..]),
            Out::new(&mut out),
            &opts,
        )
        .unwrap();
        rmse(&out)
    };
    let f32_err = rounded(Rounding::F32);
    let f16_err = rounded(Rounding::F16);
    let bf16_err = rounded(Rounding::Bf16);
    let per_tensor = fp8(Fp8Scaling::PerTensor, None);
    let best = fp8(
        Fp8Scaling::PerBlock {
            block_q: 128,
            block_k: 128,
        },
        Some(3),
    );
    eprintln!(
        "RMSE f32 {f32_err:.2e} f16 {f16_err:.2e} bf16 {bf16_err:.2e} fp8 per-tensor \
         {per_tensor:.2e} fp8 block+hadamard {best:.2e} (ratio {:.2})",
        per_tensor / best
    );
    assert!(f32_err < 1e-5);
    assert!(f32_err < f16_err && f16_err < bf16_err && bf16_err < best);
    // Measured at this size over all rows: ratio 1.56–3.25 over 240 seeds, median ~1.9
    // (2.6–3.2 at 8k–16k, see the README).
    assert!(per_tensor > 1.2 * best, "{per_tensor} vs {best}");
    // FlashAttention-3's per-block + Hadamard RMSE is 9.1e-3; ours 6.0e-3–1.1e-2 at this size
    // over the same 240 seeds. The bound leaves room for the tail of a few-outlier statistic;
    // the ordering above is the test's point.
    assert!(best < 2e-2, "{best}");
}
