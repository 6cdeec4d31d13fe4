//! Merge of partial results over an arbitrary three-way split equals the whole row, in both
//! groupings, on arbitrary f32 scores: the two groupings agree with each other, and each agrees
//! with the f64 two-pass softmax of the whole row (NaN exactly where the reference is NaN).
#![no_main]

use libfuzzer_sys::fuzz_target;
use softmax_core::{merge_into, RescalePolicy, RescaleStats, RowState};

fn part(x: &[f32]) -> (RowState<f32>, [f32; 1]) {
    let mut state = RowState::new();
    let mut stats = RescaleStats::default();
    let mut b = x.to_vec();
    state.update(&mut b, &RescalePolicy::Always, &mut stats);
    // Values: a fixed ramp, so the weighted sum depends on which key got which weight.
    let acc = b.iter().enumerate().map(|(j, p)| p * (j % 5) as f32).sum();
    (state, [acc])
}

/// The f64 two-pass weighted sum and LSE of the whole row (log2-domain scores, natural-log LSE),
/// with each part's values as `part` makes them (its local index mod 5).
fn two_pass(parts: [&[f32]; 3]) -> (f64, f64) {
    let scores = || parts.iter().flat_map(|p| p.iter().map(|&s| s as f64));
    let max = scores().fold(f64::NEG_INFINITY, |m, s| if s > m { s } else { m });
    // As in fa-reference: NaN never becomes the maximum but poisons the sum; all −∞ sums to 0.
    let max = if max == f64::NEG_INFINITY { 0.0 } else { max };
    let (mut sum, mut acc) = (0.0f64, 0.0f64);
    for p in parts {
        for (j, &s) in p.iter().enumerate() {
            let w = (s as f64 - max).exp2();
            sum += w;
            acc += w * (j % 5) as f64;
        }
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
    let x: Vec<f32> = data[2..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let n = x.len();
    let (a, b) = ((data[0] as usize).min(n), (data[1] as usize).min(n));
    let (a, b) = (a.min(b), a.max(b));
    // Both groupings merge the very same three parts.
    let (s1, a1) = part(&x[..a]);
    let (s2, a2) = part(&x[a..b]);
    let (s3, a3) = part(&x[b..]);
    let (mut left, mut left_acc) = (s1, a1);
    merge_into(&mut left, &mut left_acc, &s2, &a2);
    merge_into(&mut left, &mut left_acc, &s3, &a3);
    let (mut inner, mut inner_acc) = (s3, a3);
    merge_into(&mut inner, &mut inner_acc, &s2, &a2);
    let (mut right, mut right_acc) = (s1, a1);
    merge_into(&mut right, &mut right_acc, &inner, &inner_acc);
    let (l, r) = (left.finish(), right.finish());
    let (ol, or) = (left_acc[0] * l.inv_sum, right_acc[0] * r.inv_sum);
    let (want, want_lse) = two_pass([&x[..a], &x[a..b], &x[b..]]);
    for (name, out, lse) in [("left", ol, l.lse), ("right", or, r.lse)] {
        if want.is_nan() {
            assert!(out.is_nan(), "{name}: NaN must propagate, got {out}");
            continue;
        }
        assert!(!out.is_nan(), "{name}: spurious NaN (want {want})");
        // f32 rounding of n-term sums and two merges, values at most 4 (relative error, as in
        // the online_softmax target).
        let tol = 4.0 * 4.0 * f32::EPSILON as f64 * (n as f64 + 8.0);
        assert!((out as f64 - want).abs() <= tol, "{name}: {out} want {want}");
        if want_lse.is_finite() {
            assert!(
                (lse as f64 - want_lse).abs() <= 1e-4 * (1.0 + want_lse.abs()),
                "{name}: lse {lse} want {want_lse}"
            );
        } else {
            assert_eq!(lse as f64, want_lse, "{name}: lse");
        }
    }
    if ol.is_nan() || or.is_nan() {
        assert!(ol.is_nan() && or.is_nan(), "NaN in one grouping only: {ol} vs {or}");
        return;
    }
    assert!((ol - or).abs() <= 1e-5 * 5.0, "{ol} vs {or}");
    if l.lse.is_finite() {
        assert!((l.lse - r.lse).abs() <= 1e-4 * (1.0 + l.lse.abs()), "{} vs {}", l.lse, r.lse);
    } else {
        assert_eq!(l.lse, r.lse);
    }
});
