//! Online softmax over arbitrary f32 scores (NaN, ±∞, subnormals included) and an arbitrary
//! split into blocks, with both rescale policies, against the f64 two-pass softmax.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softmax_core::{RescalePolicy, RescaleStats, RowState};

/// The f64 two-pass weighted sum and LSE (log2 domain in, natural log out).
fn two_pass(x: &[f32], v: &[f32]) -> (f64, f64) {
    let max = x.iter().map(|&s| s as f64).fold(f64::NEG_INFINITY, |m, s| if s > m { s } else { m });
    // As in fa-reference: a NaN never becomes the maximum but poisons the sum; a row of
    // only −∞ (masked) scores sums to 0 and yields 0 and LSE −∞.
    let max = if max == f64::NEG_INFINITY { 0.0 } else { max };
    let (mut sum, mut acc) = (0.0f64, 0.0f64);
    for (&s, &val) in x.iter().zip(v) {
        let p = (s as f64 - max).exp2();
        sum += p;
        acc += p * val as f64;
    }
    if sum == 0.0 {
        return (0.0, f64::NEG_INFINITY);
    }
    (acc / sum, (max + sum.log2()) * core::f64::consts::LN_2)
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let block = 1 + data[0] as usize % 17;
    let tau = (data[1] % 16) as f32;
    let floats: Vec<f32> = data[2..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let n = floats.len() / 2;
    let (scores, values) = (&floats[..n], &floats[n..2 * n]);
    // Values are bounded like real V entries; scores are anything at all.
    let values: Vec<f32> = values.iter().map(|v| if v.is_finite() { v.clamp(-8.0, 8.0) } else { 1.0 }).collect();
    let (want, want_lse) = two_pass(scores, &values);
    for policy in [RescalePolicy::Always, RescalePolicy::Threshold(tau)] {
        let mut state = RowState::<f32>::new();
        let mut stats = RescaleStats::default();
        let mut acc = 0.0f32;
        for (s, v) in scores.chunks(block).zip(values.chunks(block)) {
            let mut b = s.to_vec();
            acc *= state.update(&mut b, &policy, &mut stats);
            acc += b.iter().zip(v).map(|(p, v)| p * v).sum::<f32>();
        }
        let done = state.finish();
        let out = (acc * done.inv_sum) as f64;
        if want.is_nan() {
            assert!(out.is_nan(), "NaN must propagate: got {out}");
            continue;
        }
        assert!(!out.is_nan(), "spurious NaN (want {want})");
        // Worst-case f32 rounding of n-term sums (relative, so a stale maximum does not
        // matter: numerator and denominator share it), values bounded by 8.
        let tol = 8.0 * 4.0 * f32::EPSILON as f64 * (n as f64 + 4.0);
        assert!((out - want).abs() <= tol, "out {out} want {want} ({policy:?})");
        if want_lse.is_finite() {
            assert!((done.lse as f64 - want_lse).abs() <= 1e-4 * (1.0 + want_lse.abs()));
        } else {
            assert_eq!(done.lse as f64, want_lse);
        }
    }
});
