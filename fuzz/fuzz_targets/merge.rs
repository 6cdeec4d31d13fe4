//! Merge of partial results over an arbitrary three-way split equals the whole row, in both
//! groupings, on arbitrary f32 scores.
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
