//! The oracle against cases with known answers and against itself under re-layouts
//! (GQA = duplicated KV heads, varlen = separate dense problems, strides = contiguous).

use fa_reference::{attention_f64, bf16_pv_slack, compare, Case, Rng, Rounding};
use softmax_core::{Mask, MAX_HEAD_DIM};

#[test]
fn single_key_returns_its_value_and_equal_scores_average() {
    let mut rng = Rng::new(1);
    let case = Case::dense(&mut rng, 1, 3, 1, 1, 1, 8);
    let p = case.desc().validate(MAX_HEAD_DIM).unwrap();
    let r = attention_f64(&p, &case.q, &case.k, &case.v);
    for i in 0..3 {
        for c in 0..8 {
            assert!((r.out[p.o_offset(0, i, 0) + c] - case.v[c] as f64).abs() < 1e-12);
        }
        let s = (0..8)
            .map(|c| case.q[i * 8 + c] as f64 * case.k[c] as f64)
            .sum::<f64>()
            / (8f64).sqrt();
        assert!((r.lse[i] - s).abs() < 1e-6);
    }
    // Scale 0: uniform weights, the output is the mean of the visible values.
    let case = Case::dense(&mut rng, 1, 4, 6, 1, 1, 4)
        .with_scale(0.0)
        .causal();
    let p = case.desc().validate(MAX_HEAD_DIM).unwrap();
    let r = attention_f64(&p, &case.q, &case.k, &case.v);
    for i in 0..4 {
        let visible = i + 3; // bottom-right causal: query i sees keys 0..=i+2
        for c in 0..4 {
            let mean = (0..visible).map(|j| case.v[j * 4 + c] as f64).sum::<f64>() / visible as f64;
            assert!((r.out[i * 4 + c] - mean).abs() < 1e-12);
        }
        assert!((r.lse[i] - (visible as f64).ln()).abs() < 1e-12);
    }
}

#[test]
fn gqa_equals_duplicated_kv_heads() {
    let mut rng = Rng::new(2);
    let gqa = Case::dense(&mut rng, 2, 5, 9, 4, 2, 8).causal();
    let p = gqa.desc().validate(MAX_HEAD_DIM).unwrap();
    let r = attention_f64(&p, &gqa.q, &gqa.k, &gqa.v);
    // Duplicate each KV head for its two query heads.
    let mut mha = Case::dense(&mut rng, 2, 5, 9, 4, 4, 8).causal();
    mha.q = gqa.q.clone();
    for (dst, src) in [(&mut mha.k, &gqa.k), (&mut mha.v, &gqa.v)] {
        for b in 0..2 {
            for j in 0..9 {
                for h in 0..4 {
                    for c in 0..8 {
                        dst[((b * 9 + j) * 4 + h) * 8 + c] = src[((b * 9 + j) * 2 + h / 2) * 8 + c];
                    }
                }
            }
        }
    }
    let pm = mha.desc().validate(MAX_HEAD_DIM).unwrap();
    let rm = attention_f64(&pm, &mha.q, &mha.k, &mha.v);
    assert_eq!(r.out, rm.out);
    assert_eq!(r.lse, rm.lse);
}

#[test]
fn varlen_equals_separate_dense_problems_and_masks_apply_per_sequence() {
    let mut rng = Rng::new(3);
    let lens_q = [3u32, 0, 1, 6];
    let lens_k = [5u32, 2, 1, 4];
    let packed = Case::varlen(&mut rng, &lens_q, &lens_k, 2, 1, 8).causal();
    let p = packed.desc().validate(MAX_HEAD_DIM).unwrap();
    let r = attention_f64(&p, &packed.q, &packed.k, &packed.v);
    for b in 0..4 {
        let s = p.seq(b);
        let mut dense = Case::dense(&mut rng, 1, s.seqlen_q, s.seqlen_k, 2, 1, 8).causal();
        dense.q = packed.q[s.q_start * 16..(s.q_start + s.seqlen_q) * 16].to_vec();
        dense.k = packed.k[s.k_start * 8..(s.k_start + s.seqlen_k) * 8].to_vec();
        dense.v = packed.v[s.k_start * 8..(s.k_start + s.seqlen_k) * 8].to_vec();
        let pd = dense.desc().validate(MAX_HEAD_DIM).unwrap();
        let rd = attention_f64(&pd, &dense.q, &dense.k, &dense.v);
        for h in 0..2 {
            for i in 0..s.seqlen_q {
                let got = &r.out[p.o_offset(b, i, h)..][..8];
                let want = &rd.out[pd.o_offset(0, i, h)..][..8];
                assert_eq!(got, want);
                assert_eq!(r.lse[p.lse_offset(b, h, i)], rd.lse[pd.lse_offset(0, h, i)]);
            }
        }
    }
    // Sequence 3 has 6 queries and 4 keys: its first two rows see no key.
    assert_eq!(r.lse[p.lse_offset(3, 0, 0)], f64::NEG_INFINITY);
    assert!(r.out[p.o_offset(3, 1, 1)..][..8].iter().all(|&x| x == 0.0));
}

#[test]
fn strided_layout_equals_contiguous() {
    let mut rng = Rng::new(4);
    let padded = Case::dense(&mut rng, 2, 7, 5, 2, 2, 8)
        .with_mask(Mask {
            left: Some(2),
            right: Some(1),
        })
        .with_softcap(5.0)
        .padded(&mut rng, 3, Rounding::Bf16);
    let p = padded.desc().validate(MAX_HEAD_DIM).unwrap();
    let r = attention_f64(&p, &padded.q, &padded.k, &padded.v);
    let mut dense = padded.clone();
    dense.strides = [None; 4];
    let gather = |src: &[f32], heads: usize, seqlen: usize, view: [usize; 3]| {
        let mut out = Vec::new();
        for b in 0..2 {
            for t in 0..seqlen {
                for h in 0..heads {
                    let at = b * view[0] + t * view[1] + h * view[2];
                    out.extend_from_slice(&src[at..at + 8]);
                }
            }
        }
        out
    };
    let [sq, sk, sv, _] = p.strides();
    dense.q = gather(&padded.q, 2, 7, [sq.batch, sq.seq, sq.head]);
    dense.k = gather(&padded.k, 2, 5, [sk.batch, sk.seq, sk.head]);
    dense.v = gather(&padded.v, 2, 5, [sv.batch, sv.seq, sv.head]);
    let pd = dense.desc().validate(MAX_HEAD_DIM).unwrap();
    let rd = attention_f64(&pd, &dense.q, &dense.k, &dense.v);
    assert_eq!(r.lse, rd.lse);
    for b in 0..2 {
        for i in 0..7 {
            for h in 0..2 {
                assert_eq!(
                    &r.out[p.o_offset(b, i, h)..][..8],
                    &rd.out[pd.o_offset(b, i, h)..][..8]
                );
            }
        }
    }
    // compare() reads only the tensor's elements: padding poisoned with NaN is ignored.
    let mut out = vec![f32::NAN; r.out.len()];
    for b in 0..2 {
        for i in 0..7 {
            for h in 0..2 {
                let o = p.o_offset(b, i, h);
                for c in 0..8 {
                    out[o + c] = r.out[o + c] as f32;
                }
            }
        }
    }
    let report = compare(&p, &out, None, &r);
    assert!(report.rel_l2 < 1e-7, "{report:?}");
    // ... and an unwritten element inside the tensor fails.
    out[p.o_offset(1, 6, 1)] = f32::NAN;
    assert!(!compare(&p, &out, None, &r).within(1.0, 1.0));
}

#[test]
fn bf16_pv_slack_scales_with_cancellation_in_o() {
    let unit = 2f64.powi(-8);
    // One query, two keys, head_dim 2, scale 0: P = (1/2, 1/2), O = the mean of the V rows.
    let mut rng = Rng::new(5);
    let case = Case::dense(&mut rng, 1, 1, 2, 1, 1, 2).with_scale(0.0);
    let p = case.desc().validate(MAX_HEAD_DIM).unwrap();
    let hand = [
        // V rows (3, 1) and (−1, 1): O = (1, 1), O_|V| = (2, 1): ratio √5/√2.
        ([3.0, 1.0, -1.0, 1.0], (5.0f64 / 2.0).sqrt()),
        // V rows (1, 1) and (−1, 1): O = (0, 1), O_|V| = (1, 1): ratio √2.
        ([1.0, 1.0, -1.0, 1.0], 2f64.sqrt()),
        // V rows (1, 2) and (−1, −2): O = 0, so the slack is absolute: 2⁻⁸·‖O_|V|‖ = 2⁻⁸·√5.
        ([1.0, 2.0, -1.0, -2.0], 5f64.sqrt()),
        // V rows (1, 2) and (3, 4): no cancellation, ratio 1.
        ([1.0, 2.0, 3.0, 4.0], 1.0),
    ];
    for (v, ratio) in hand {
        let slack = bf16_pv_slack(&p, &case.q, &case.k, &v);
        assert!(
            (slack - unit * ratio).abs() < 1e-15,
            "{v:?}: {slack} vs {}",
            unit * ratio
        );
    }

    // All-positive V on a random GQA, masked, padded bf16 problem: O_|V| = O, ratio exactly 1.
    let case = Case::dense(&mut rng, 2, 7, 11, 4, 2, 16)
        .with_mask(Mask {
            left: Some(3),
            right: Some(0),
        })
        .padded(&mut rng, 2, Rounding::Bf16);
    let p = case.desc().validate(MAX_HEAD_DIM).unwrap();
    let abs_v: Vec<f32> = case.v.iter().map(|x| x.abs()).collect();
    assert_eq!(bf16_pv_slack(&p, &case.q, &case.k, &abs_v), unit);
    // With its N(0,1) V the values cancel: the slack exceeds 2⁻⁸, and the bf16 element type
    // reads the same (bf16-rounded) values as f32, so it gives the very same number.
    let slack = bf16_pv_slack(&p, &case.q, &case.k, &case.v);
    assert!(slack > unit, "{slack}");
    let bf =
        |x: &[f32]| -> Vec<half::bf16> { x.iter().map(|&y| half::bf16::from_f32(y)).collect() };
    let (q, k, v) = (bf(&case.q), bf(&case.k), bf(&case.v));
    assert_eq!(bf16_pv_slack(&p, &q, &k, &v), slack);
}

/// A sink only adds `exp(s_h)` to each row's denominator: `LSE' = logaddexp(LSE, s_h)` and
/// `O' = O·exp(LSE − LSE')`, checked against the oracle without sinks (GQA, causal with rows
/// that see no key, varlen with an empty sequence).
#[test]
fn sinks_rescale_rows_by_the_denominator() {
    let mut rng = Rng::new(5353);
    let cases = [
        Case::dense(&mut rng, 2, 6, 4, 4, 2, 5).causal(),
        Case::varlen(&mut rng, &[3, 0, 2], &[1, 4, 0], 2, 1, 3),
    ];
    for case in cases {
        let with = case.clone().with_random_sinks(&mut rng);
        let sinks = with.sinks.clone().unwrap();
        let p0 = case.desc().validate(MAX_HEAD_DIM).unwrap();
        let p1 = with.desc().validate(MAX_HEAD_DIM).unwrap();
        let r0 = attention_f64(&p0, &case.q, &case.k, &case.v);
        let r1 = attention_f64(&p1, &with.q, &with.k, &with.v);
        for b in 0..p0.batch() {
            for (h, &sink) in sinks.iter().enumerate() {
                for i in 0..p0.seq(b).seqlen_q {
                    let at = p0.lse_offset(b, h, i);
                    let (l0, s) = (r0.lse[at], sink as f64);
                    let l1 = if l0 == f64::NEG_INFINITY {
                        s
                    } else {
                        l0.max(s) + ((l0 - l0.max(s)).exp() + (s - l0.max(s)).exp()).ln()
                    };
                    assert!(
                        (r1.lse[at] - l1).abs() < 1e-12,
                        "lse {} vs {l1}",
                        r1.lse[at]
                    );
                    let oo = p0.o_offset(b, i, h);
                    for c in 0..p0.head_dim_v() {
                        let expect = if l0 == f64::NEG_INFINITY {
                            0.0
                        } else {
                            r0.out[oo + c] * (l0 - l1).exp()
                        };
                        assert!((r1.out[oo + c] - expect).abs() < 1e-12);
                    }
                }
            }
        }
    }
}
