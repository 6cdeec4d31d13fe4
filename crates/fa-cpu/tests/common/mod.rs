//! Shared helpers of the fa-cpu integration tests: run a `fa_reference::Case` through
//! `fa_cpu::forward` (outputs poisoned first) and compare with the f64 oracle.

#![allow(dead_code)]

use fa_cpu::{forward, Element, ForwardOptions, ForwardStats, SimdLevel};
use fa_reference::{attention_f64, compare, poison, Case, ErrorReport};
use softmax_core::{Out, Qkv};

/// Every SIMD level this CPU can run (AMX included where the CPU has it and Linux grants it).
pub fn levels() -> Vec<SimdLevel> {
    [
        SimdLevel::Scalar,
        SimdLevel::Avx2Fma,
        SimdLevel::Avx512f,
        SimdLevel::Amx,
    ]
    .into_iter()
    .filter(|l| l.is_available())
    .collect()
}

/// Converts the case's f32 tensors to `T` (exact when the case was rounded to `T`).
pub fn convert<T: Element>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

/// Output and LSE of one forward run.
pub struct Run<O> {
    pub out: Vec<O>,
    pub lse: Vec<f32>,
    pub stats: ForwardStats,
}

/// Runs the case through fa-cpu with inputs of type `T` and output of type `O`.
pub fn run<T: Element, O: Element + fa_reference::Element>(
    case: &Case,
    opts: &ForwardOptions,
) -> Run<O> {
    let problem = case.desc().validate(256).expect("valid case");
    let lens = problem.min_buffer_lens();
    let mut out = vec![O::from_f32(0.0); lens.o];
    poison(&mut out);
    let mut lse = vec![f32::NAN; problem.lse_len()];
    let (q, k, v) = (
        convert::<T>(&case.q),
        convert::<T>(&case.k),
        convert::<T>(&case.v),
    );
    let qkv = Qkv::new(&q[..], &k[..], &v[..]);
    let stats = forward(
        &problem,
        qkv,
        Out::with_lse(&mut out[..], &mut lse[..]),
        opts,
    )
    .expect("forward");
    Run { out, lse, stats }
}

/// Runs and compares with the oracle computed on the same (possibly rounded) inputs.
pub fn check<T: Element, O: Element + fa_reference::Element>(
    case: &Case,
    opts: &ForwardOptions,
) -> ErrorReport {
    let problem = case.desc().validate(256).expect("valid case");
    let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
    let r = run::<T, O>(case, opts);
    compare(&problem, &r.out, Some(&r.lse), &oracle)
}
