//! Properties of the online softmax: any split of a row into blocks, with either rescale
//! policy, matches the f64 two-pass softmax; merge is commutative and associative; the
//! worked example of the FlashAttention lesson.

use proptest::prelude::*;
use softmax_core::{merge_into, RescalePolicy, RescaleStats, RowState, LOG2_E};

/// Two-pass softmax-weighted sum of `values` (natural-log scores), and the LSE, in f64.
fn two_pass(scores: &[f64], values: &[f64]) -> (f64, f64) {
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return (0.0, f64::NEG_INFINITY);
    }
    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = weights.iter().sum();
    let out = weights.iter().zip(values).map(|(w, v)| w * v).sum::<f64>() / sum;
    (out, max + sum.ln())
}

/// The online softmax over the row split at `cuts`, in precision `T`.
fn online<T: softmax_core::LibmFloat>(
    scores: &[f64],
    values: &[f64],
    cuts: &[usize],
    policy: RescalePolicy<T>,
    stats: &mut RescaleStats,
) -> (f64, f64) {
    let cast = |x: f64| T::from(x).unwrap();
    let mut state = RowState::<T>::new();
    let mut acc = T::zero();
    let mut start = 0;
    for &end in cuts.iter().chain(std::iter::once(&scores.len())) {
        let mut block: Vec<T> = scores[start..end]
            .iter()
            .map(|&s| cast(s * LOG2_E))
            .collect();
        acc = acc * state.update(&mut block, &policy, stats);
        for (p, &v) in block.iter().zip(&values[start..end]) {
            acc = acc + *p * cast(v);
        }
        start = end;
    }
    let done = state.finish();
    (
        (acc * done.inv_sum).to_f64().unwrap(),
        done.lse.to_f64().unwrap(),
    )
}

/// Scores that exercise the corner cases: wide range, ties, −∞ (masked) entries.
fn score() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => -30.0f64..30.0,
        1 => -1000.0f64..1000.0,
        1 => Just(f64::NEG_INFINITY),
        1 => Just(7.0),
        1 => -1e-30f64..1e-30,
    ]
}

fn row_and_cuts() -> impl Strategy<Value = (Vec<f64>, Vec<f64>, Vec<usize>)> {
    (1usize..200).prop_flat_map(|n| {
        (
            prop::collection::vec(score(), n),
            prop::collection::vec(-3.0f64..3.0, n),
            prop::collection::vec(0..=n, 0..8),
        )
            .prop_map(|(s, v, mut cuts)| {
                cuts.sort_unstable();
                (s, v, cuts)
            })
    })
}

fn close(got: f64, want: f64, tol: f64) -> bool {
    if want == f64::NEG_INFINITY {
        return got == f64::NEG_INFINITY;
    }
    (got - want).abs() <= tol * (1.0 + want.abs())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// f64 state: matches the two-pass result to 1e-12 relative, for any split and policy.
    #[test]
    fn any_split_matches_two_pass_f64((scores, values, cuts) in row_and_cuts(), tau in 0.0f64..20.0) {
        let (want_out, want_lse) = two_pass(&scores, &values);
        for policy in [RescalePolicy::Always, RescalePolicy::Threshold(tau)] {
            let mut stats = RescaleStats::default();
            let (out, lse) = online::<f64>(&scores, &values, &cuts, policy, &mut stats);
            prop_assert!(close(out, want_out, 1e-12), "{policy:?}: out {out} vs {want_out}");
            prop_assert!(close(lse, want_lse, 1e-12), "{policy:?}: lse {lse} vs {want_lse}");
        }
    }

    /// f32 state: the bound is f32 rounding (values ≤ 3, up to 200 terms): 1e-5 relative to
    /// the value scale, with the threshold policy's terms up to 2^τ = 256 included.
    #[test]
    fn any_split_matches_two_pass_f32((scores, values, cuts) in row_and_cuts()) {
        // The oracle runs on the very inputs the f32 path sees (log2 scores and values rounded
        // to f32), so the bound measures the arithmetic, not the input rounding: scores near
        // 800 lose ~1e-4 of their difference in f32, which alone would exceed it.
        let scores: Vec<f64> = scores.iter().map(|s| ((s * LOG2_E) as f32) as f64 / LOG2_E).collect();
        let values: Vec<f64> = values.iter().map(|&v| v as f32 as f64).collect();
        let (want_out, want_lse) = two_pass(&scores, &values);
        for policy in [RescalePolicy::Always, RescalePolicy::Threshold(8.0f32)] {
            let mut stats = RescaleStats::default();
            let (out, lse) = online::<f32>(&scores, &values, &cuts, policy, &mut stats);
            prop_assert!((out - want_out).abs() <= 1e-5 * 3.0, "{policy:?}: out {out} vs {want_out}");
            prop_assert!(close(lse, want_lse, 1e-6), "{policy:?}: lse {lse} vs {want_lse}");
        }
    }

    /// Merging partial results of disjoint key sets equals processing the whole row, in any
    /// order and grouping.
    #[test]
    fn merge_is_commutative_and_associative((scores, values, _) in row_and_cuts(), a in 0usize..200, b in 0usize..200) {
        let n = scores.len();
        let (a, b) = (a.min(n).min(b.min(n)), a.min(n).max(b.min(n)));
        let part = |range: std::ops::Range<usize>| {
            let mut state = RowState::<f64>::new();
            let mut stats = RescaleStats::default();
            let mut block: Vec<f64> = scores[range.clone()].iter().map(|s| s * LOG2_E).collect();
            state.update(&mut block, &RescalePolicy::Always, &mut stats);
            let acc: f64 = block.iter().zip(&values[range]).map(|(p, v)| p * v).sum();
            (state, [acc])
        };
        let (s1, a1) = part(0..a);
        let (s2, a2) = part(a..b);
        let (s3, a3) = part(b..n);
        let finish = |s: RowState<f64>, acc: [f64; 1]| acc[0] * s.finish().inv_sum;
        // (1 ⊕ 2) ⊕ 3
        let (mut left, mut left_acc) = (s1, a1);
        merge_into(&mut left, &mut left_acc, &s2, &a2);
        merge_into(&mut left, &mut left_acc, &s3, &a3);
        // 1 ⊕ (3 ⊕ 2)
        let (mut inner, mut inner_acc) = (s3, a3);
        merge_into(&mut inner, &mut inner_acc, &s2, &a2);
        let (mut right, mut right_acc) = (s1, a1);
        merge_into(&mut right, &mut right_acc, &inner, &inner_acc);
        let (want, want_lse) = two_pass(&scores, &values);
        prop_assert!(close(finish(left, left_acc), want, 1e-12));
        prop_assert!(close(finish(right, right_acc), want, 1e-12));
        prop_assert!(close(left.finish().lse, want_lse, 1e-12));
        prop_assert!(close(right.finish().lse, left.finish().lse, 1e-12));
    }
}

/// The lesson's worked example: scores [1, 3] then [5].
#[test]
fn worked_example_from_the_lesson() {
    let log2 = |s: f64| s * LOG2_E;
    let mut state = RowState::<f64>::new();
    let mut stats = RescaleStats::default();
    let mut first = [log2(1.0), log2(3.0)];
    state.update(&mut first, &RescalePolicy::Always, &mut stats);
    // After [1, 3]: m = 3, ℓ = e^-2 + 1.
    assert!((state.sum - (1.0 + (-2.0f64).exp())).abs() < 1e-15);
    let mut second = [log2(5.0)];
    let correction = state.update(&mut second, &RescalePolicy::Always, &mut stats);
    // The max moved from 3 to 5: the accumulator is scaled by e^-2, ℓ = 1.1353·e^-2 + 1.
    assert!((correction - (-2.0f64).exp()).abs() < 1e-15);
    assert!((state.sum - 1.153_650_6).abs() < 1e-6, "ℓ = {}", state.sum);
    assert_eq!(stats.rescales, 1);
    // The weight of the score 3.0: the true softmax gives 0.117; a local softmax over the
    // first block alone (the mistake the online algorithm corrects) gives 0.881.
    let truth = (3.0f64 - 5.0).exp() * state.finish().inv_sum;
    assert!((truth - 0.117).abs() < 5e-4, "{truth}");
    let local = (3.0f64).exp() / ((1.0f64).exp() + (3.0f64).exp());
    assert!((local - 0.881).abs() < 5e-4, "{local}");
}

/// A row whose every key is masked: output 0 and LSE −∞, never NaN.
#[test]
fn fully_masked_row_gives_zero_and_neg_infinity() {
    for policy in [RescalePolicy::Always, RescalePolicy::Threshold(8.0f32)] {
        let mut state = RowState::<f32>::new();
        let mut stats = RescaleStats::default();
        let mut block = [f32::NEG_INFINITY; 5];
        let c = state.update(&mut block, &policy, &mut stats);
        assert_eq!(c, 1.0);
        assert!(block.iter().all(|&p| p == 0.0));
        let done = state.finish();
        assert_eq!(done.inv_sum, 0.0);
        assert_eq!(done.lse, f32::NEG_INFINITY);
    }
}

/// NaN in a score propagates to the row's output (as IEEE arithmetic does in the reference).
#[test]
fn nan_score_propagates() {
    let mut state = RowState::<f32>::new();
    let mut stats = RescaleStats::default();
    let mut block = [1.0, f32::NAN, 2.0];
    state.update(&mut block, &RescalePolicy::default(), &mut stats);
    assert!(state.sum.is_nan());
    assert!(state.finish().inv_sum.is_nan());
}

/// Under the threshold policy, terms stay below 2^τ and the rescale count drops.
#[test]
fn threshold_policy_bounds_terms_and_saves_rescales() {
    let tau = 8.0f32;
    // Increasing scores: the worst case for rescaling (the max grows at every block).
    let scores: Vec<f32> = (0..1024).map(|i| i as f32 * 0.05).collect();
    let mut stats_always = RescaleStats::default();
    let mut stats_threshold = RescaleStats::default();
    let mut state_a = RowState::<f32>::new();
    let mut state_t = RowState::<f32>::new();
    for block in scores.chunks(16) {
        let mut a = block.to_vec();
        let mut t = block.to_vec();
        state_a.update(&mut a, &RescalePolicy::Always, &mut stats_always);
        state_t.update(&mut t, &RescalePolicy::Threshold(tau), &mut stats_threshold);
        assert!(t.iter().all(|&p| p <= tau.exp2()), "a term exceeded 2^τ");
    }
    assert_eq!(stats_always.rescales, 63);
    assert!(stats_threshold.rescales < stats_always.rescales / 4);
    assert_eq!(
        stats_threshold.rescales + stats_threshold.skipped,
        stats_always.rescales
    );
    let (la, lt) = (state_a.finish().lse, state_t.finish().lse);
    assert!((la - lt).abs() <= 1e-5 * la.abs(), "{la} vs {lt}");
}

/// The headroom rule of DESIGN.md §3: τ + offset < log2(dtype max).
#[test]
fn policy_headroom() {
    let threshold = RescalePolicy::Threshold(8.0f32);
    assert!(threshold.fits(0.0, 65504.0)); // f16 P, no offset
    assert!(!threshold.fits(8.0, 448.0)); // e4m3 with FA3's 2^8 offset: needs Always
    assert!(RescalePolicy::<f32>::Always.fits(8.0, 448.0));
    assert!(!RescalePolicy::<f32>::Always.fits(9.0, 448.0));
}

proptest! {
    /// A sink folded into a finished row (any split, either policy) is the two-pass softmax
    /// with one more score of zero value; its gradient term is `−P_sink·D`.
    #[test]
    fn sink_joins_the_denominator(
        scores in prop::collection::vec(-30.0f64..30.0, 0..40),
        sink in -40.0f64..40.0,
        cut in 0usize..40,
    ) {
        let values: Vec<f64> = (0..scores.len()).map(|i| (i as f64 * 0.7).sin() + 0.3).collect();
        let cut = cut.min(scores.len());
        let mut state = RowState::<f64>::new();
        let mut stats = RescaleStats::default();
        let policy = RescalePolicy::Threshold(8.0);
        let mut acc = 0.0;
        for (lo, hi) in [(0, cut), (cut, scores.len())] {
            let mut block: Vec<f64> = scores[lo..hi].iter().map(|s| s * LOG2_E).collect();
            acc *= state.update(&mut block, &policy, &mut stats);
            acc += block.iter().zip(&values[lo..hi]).map(|(p, v)| p * v).sum::<f64>();
        }
        let result = state.finish_with_sink(Some(sink * LOG2_E));
        let out = acc * result.inv_sum;
        // Two-pass with the sink as an extra score of value 0.
        let max = scores.iter().cloned().fold(sink, f64::max);
        let denom: f64 = scores.iter().map(|s| (s - max).exp()).sum::<f64>() + (sink - max).exp();
        let num: f64 = scores.iter().zip(&values).map(|(s, v)| (s - max).exp() * v).sum();
        let expected = num / denom;
        prop_assert!((out - expected).abs() <= 1e-12 * (1.0 + expected.abs()), "{out} vs {expected}");
        let lse = max + denom.ln();
        prop_assert!((result.lse - lse).abs() <= 1e-12 * (1.0 + lse.abs()));
        let d = 0.37;
        let term = softmax_core::sink_grad_term(sink, result.lse, d);
        prop_assert!((term + (sink - lse).exp() * d).abs() <= 1e-12);
        // No sink: exactly finish().
        prop_assert_eq!(state.finish_with_sink(None), state.finish());
    }
}

#[test]
fn a_row_without_keys_but_a_sink_is_zero_with_the_sinks_lse() {
    let state = RowState::<f32>::new();
    let r = state.finish_with_sink(Some(1.5 * LOG2_E as f32));
    assert_eq!(r.inv_sum, 0.0);
    assert!((r.lse - 1.5).abs() < 1e-6, "{}", r.lse);
    // A sink far above every score: finite LSE, the output goes to 0 without NaN.
    let mut state = RowState::<f32>::new();
    let mut stats = RescaleStats::default();
    let mut s = [0.0f32, 1.0];
    state.update(&mut s, &RescalePolicy::Always, &mut stats);
    let r = state.finish_with_sink(Some(1000.0));
    assert!(r.inv_sum.is_finite() && r.inv_sum >= 0.0 && r.inv_sum < 1e-30);
    assert!((r.lse - 1000.0 * core::f32::consts::LN_2).abs() < 1e-3);
}
