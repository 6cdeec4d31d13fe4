//! fa-cpu's forward pass against the f64 oracle on fixed, hand-picked problems at every
//! SIMD level this CPU has (the property tests in `proptest_forward.rs` draw random ones).

mod common;

use common::{check, levels, run};
use fa_cpu::{Exp2Impl, ForwardOptions};
use fa_reference::{Case, Rng, Rounding};
use half::{bf16, f16};
use softmax_core::{Mask, RescalePolicy};

const F32_BOUND: f64 = 1e-5;
const HALF_BOUND: f64 = 1e-2;
const LSE_BOUND: f64 = 1e-4;
/// bf16 inputs on AMX, f32 out: P rounded to bf16 (2⁻⁹ relative per probability).
const AMX_BF16_BOUND: f64 = 5e-3;

fn opts(level: fa_cpu::SimdLevel) -> ForwardOptions<'static> {
    ForwardOptions {
        simd: level,
        ..ForwardOptions::default()
    }
}

#[test]
fn dense_shapes_f32() {
    let mut rng = Rng::new(11);
    for level in levels() {
        for &(b, sq, sk, hq, hkv, d) in &[
            (1, 1, 1, 1, 1, 1),
            (1, 7, 9, 2, 1, 16),
            (2, 33, 31, 4, 2, 64),
            (1, 130, 257, 3, 1, 128),
            (1, 97, 65, 2, 2, 256),
            (1, 5, 200, 8, 1, 33),
            (1, 64, 64, 1, 1, 7),
        ] {
            for causal in [false, true] {
                let mut case = Case::dense(&mut rng, b, sq, sk, hq, hkv, d);
                if causal {
                    case = case.causal();
                }
                let rep = check::<f32, f32>(&case, &opts(level));
                assert!(
                    rep.within(F32_BOUND, LSE_BOUND),
                    "{level:?} {b}x{sq}x{sk} h{hq}/{hkv} d{d} causal={causal}: {rep:?}"
                );
            }
        }
    }
}

#[test]
fn masks_softcap_scale_strides() {
    let mut rng = Rng::new(12);
    for level in levels() {
        let masks = [
            Mask::from_flash_args(false, 5, 3),
            Mask::from_flash_args(true, 17, -1),
            Mask::from_flash_args(false, 0, 0),
            Mask::from_flash_args(false, -1, 40),
        ];
        for mask in masks {
            let case = Case::dense(&mut rng, 2, 71, 93, 4, 2, 40)
                .with_mask(mask)
                .with_softcap(5.0)
                .with_scale(0.3)
                .padded(&mut rng, 3, Rounding::F32);
            let rep = check::<f32, f32>(&case, &opts(level));
            assert!(
                rep.within(F32_BOUND, LSE_BOUND),
                "{level:?} {mask:?}: {rep:?}"
            );
        }
    }
}

#[test]
fn fully_masked_rows_give_zero_and_neg_inf() {
    let mut rng = Rng::new(13);
    // seqlen_q > seqlen_k with causal: the first rows see no key.
    let case = Case::dense(&mut rng, 1, 20, 5, 2, 1, 16).causal();
    for level in levels() {
        let r = run::<f32, f32>(&case, &opts(level));
        let problem = case.desc().validate(256).unwrap();
        for h in 0..2 {
            for i in 0..15 {
                let o = problem.o_offset(0, i, h);
                assert!(r.out[o..o + 16].iter().all(|&x| x == 0.0));
                assert_eq!(r.lse[problem.lse_offset(0, h, i)], f32::NEG_INFINITY);
            }
        }
        let rep = check::<f32, f32>(&case, &opts(level));
        assert!(rep.within(F32_BOUND, LSE_BOUND), "{rep:?}");
    }
}

#[test]
fn varlen_with_empty_and_single_sequences() {
    let mut rng = Rng::new(14);
    let case = Case::varlen(&mut rng, &[0, 1, 37, 5, 130], &[3, 1, 0, 77, 130], 4, 1, 24).causal();
    let plain = Case::varlen(&mut rng, &[0, 1, 37, 5, 130], &[3, 1, 0, 77, 130], 4, 2, 24);
    for level in levels() {
        for c in [&case, &plain] {
            let rep = check::<f32, f32>(c, &opts(level));
            assert!(rep.within(F32_BOUND, LSE_BOUND), "{level:?}: {rep:?}");
        }
    }
}

#[test]
fn half_inputs_within_bound() {
    let mut rng = Rng::new(15);
    for level in levels() {
        let bf = Case::dense(&mut rng, 1, 150, 150, 4, 2, 64)
            .causal()
            .round(Rounding::Bf16);
        let rep = check::<bf16, bf16>(&bf, &opts(level));
        assert!(rep.within(HALF_BOUND, 1e-2), "bf16 {level:?}: {rep:?}");
        let rep = check::<bf16, f32>(&bf, &opts(level));
        // AMX rounds P to bf16 before P·V (measured ~2e-3); the other levels keep it f32.
        let bound = if level == fa_cpu::SimdLevel::Amx {
            AMX_BF16_BOUND
        } else {
            1e-5
        };
        assert!(rep.within(bound, LSE_BOUND), "bf16->f32 {level:?}: {rep:?}");
        let hf = Case::dense(&mut rng, 1, 77, 99, 2, 1, 128).round(Rounding::F16);
        let rep = check::<f16, f16>(&hf, &opts(level));
        assert!(rep.within(HALF_BOUND, 1e-2), "f16 {level:?}: {rep:?}");
        let rep = check::<f16, f32>(&hf, &opts(level));
        // f16 on AMX too (split exactly into two bf16 each; P rounded as for bf16).
        assert!(rep.within(bound, LSE_BOUND), "f16->f32 {level:?}: {rep:?}");
    }
}

#[test]
fn cubic_exp2_and_always_rescale() {
    let mut rng = Rng::new(16);
    let case = Case::dense(&mut rng, 1, 100, 300, 2, 1, 64).causal();
    for level in levels() {
        let cubic = ForwardOptions {
            exp2: Exp2Impl::Cubic,
            ..opts(level)
        };
        let rep = check::<f32, f32>(&case, &cubic);
        assert!(rep.within(5e-4, 1e-3), "cubic {level:?}: {rep:?}");
        let always = ForwardOptions {
            rescale: RescalePolicy::Always,
            ..opts(level)
        };
        let rep = check::<f32, f32>(&case, &always);
        assert!(
            rep.within(F32_BOUND, LSE_BOUND),
            "always {level:?}: {rep:?}"
        );
    }
}

/// Attention sinks (one logit per query head in every row's denominator) against the f64
/// oracle: odd shapes, GQA/MQA, causal rows that see no key (O = 0, LSE = the sink), window +
/// softcap + scale + padded strides, varlen with empty sequences, every dtype, and the
/// split-KV path of a problem without a cache (the sink joins once, after the combine).
#[test]
fn sinks_match_the_oracle() {
    let mut rng = Rng::new(5301);
    for level in levels() {
        let mut cases = vec![
            Case::dense(&mut rng, 2, 33, 31, 4, 2, 64),
            Case::dense(&mut rng, 1, 7, 9, 3, 1, 16).causal(),
            Case::dense(&mut rng, 1, 130, 257, 2, 2, 128).causal(),
            Case::dense(&mut rng, 1, 20, 5, 4, 1, 33).causal(),
            Case::dense(&mut rng, 2, 71, 93, 4, 2, 40)
                .with_mask(Mask::from_flash_args(false, 5, 3))
                .with_softcap(5.0)
                .with_scale(0.3)
                .padded(&mut rng, 3, Rounding::F32),
            Case::varlen(&mut rng, &[0, 1, 37, 5, 130], &[3, 1, 0, 77, 130], 4, 1, 24).causal(),
        ];
        // One large sink (most of each row's mass) and one far below every score.
        cases.push(Case::dense(&mut rng, 1, 9, 11, 2, 1, 8).with_sinks(vec![12.0, -60.0]));
        for case in cases {
            let case = if case.sinks.is_some() {
                case
            } else {
                case.with_random_sinks(&mut rng)
            };
            let rep = check::<f32, f32>(&case, &opts(level));
            assert!(
                rep.within(F32_BOUND, LSE_BOUND),
                "{level:?} {:?} {:?}: {rep:?}",
                case.dense,
                case.sinks
            );
            for splits in [2, 5] {
                let split = ForwardOptions {
                    kv_splits: Some(splits),
                    ..opts(level)
                };
                let rep = check::<f32, f32>(&case, &split);
                assert!(
                    rep.within(F32_BOUND, LSE_BOUND),
                    "{level:?} splits {splits}: {rep:?}"
                );
            }
        }
        let bf = Case::dense(&mut rng, 1, 150, 150, 4, 2, 64)
            .causal()
            .round(Rounding::Bf16)
            .with_random_sinks(&mut rng);
        let rep = check::<bf16, bf16>(&bf, &opts(level));
        assert!(rep.within(HALF_BOUND, 1e-2), "bf16 {level:?}: {rep:?}");
        let bound = if level == fa_cpu::SimdLevel::Amx {
            AMX_BF16_BOUND
        } else {
            F32_BOUND
        };
        let rep = check::<bf16, f32>(&bf, &opts(level));
        assert!(rep.within(bound, LSE_BOUND), "bf16->f32 {level:?}: {rep:?}");
        let hf = Case::dense(&mut rng, 1, 77, 99, 2, 1, 128)
            .round(Rounding::F16)
            .with_random_sinks(&mut rng);
        let rep = check::<f16, f16>(&hf, &opts(level));
        assert!(rep.within(HALF_BOUND, 1e-2), "f16 {level:?}: {rep:?}");
        let rep = check::<f16, f32>(&hf, &opts(level));
        assert!(rep.within(bound, LSE_BOUND), "f16->f32 {level:?}: {rep:?}");
    }
}

/// A row that sees no key but has a sink: O = 0 and LSE = the sink's logit, exactly as the
/// f32 rule gives it (`s·log2 e` rounded, times ln 2), at every level and split count.
#[test]
fn sinks_on_rows_without_keys_give_zero_and_the_sink() {
    let mut rng = Rng::new(5302);
    let sinks = vec![0.75f32, -2.5];
    let case = Case::dense(&mut rng, 1, 20, 5, 2, 1, 16)
        .causal()
        .with_sinks(sinks.clone());
    let problem = case.desc().validate(256).unwrap();
    for level in levels() {
        for splits in [None, Some(3)] {
            let o = ForwardOptions {
                kv_splits: splits,
                ..opts(level)
            };
            let r = run::<f32, f32>(&case, &o);
            for (h, &s) in sinks.iter().enumerate() {
                for i in 0..15 {
                    let at = problem.o_offset(0, i, h);
                    assert!(r.out[at..at + 16].iter().all(|&x| x == 0.0));
                    let lse = r.lse[problem.lse_offset(0, h, i)];
                    assert!(
                        (lse - s).abs() <= 1e-6,
                        "{level:?} h{h} row {i}: {lse} vs {s}"
                    );
                }
            }
        }
    }
}

/// With sinks the forward stays bitwise identical for any thread count (tiles and split-KV).
#[test]
fn sinks_bitwise_identical_for_any_thread_count() {
    let mut rng = Rng::new(5303);
    let case = Case::varlen(&mut rng, &[17, 0, 250, 1], &[40, 3, 260, 9], 6, 2, 40)
        .causal()
        .with_random_sinks(&mut rng);
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    for level in levels() {
        for splits in [None, Some(4)] {
            let base = ForwardOptions {
                threads: Some(1),
                kv_splits: splits,
                ..opts(level)
            };
            let one = run::<f32, f32>(&case, &base);
            for threads in [Some(2), Some(3), None] {
                let other = run::<f32, f32>(&case, &ForwardOptions { threads, ..base });
                assert_eq!(
                    bits(&one.out),
                    bits(&other.out),
                    "{level:?} {splits:?} {threads:?}"
                );
                assert_eq!(
                    bits(&one.lse),
                    bits(&other.lse),
                    "{level:?} {splits:?} {threads:?}"
                );
            }
        }
    }
}

/// Bad sinks (wrong length, NaN, ±∞) are typed errors of validation: no backend runs, the
/// outputs stay as they were.
#[test]
fn bad_sinks_are_typed_errors_and_leave_outputs_untouched() {
    use softmax_core::{Out, ProblemError, Qkv};
    let mut rng = Rng::new(5304);
    let case = Case::dense(&mut rng, 1, 5, 6, 2, 1, 8);
    let lens = case.desc().validate(256).unwrap().min_buffer_lens();
    let sentinel = 4321.0f32;
    let bad: [&[f32]; 4] = [
        &[0.0],
        &[0.0, f32::NAN],
        &[f32::INFINITY, 0.0],
        &[0.0, 0.0, 0.0],
    ];
    for sinks in bad {
        let mut out = vec![sentinel; lens.o];
        let mut lse = vec![sentinel; 2 * 5];
        let err = case
            .desc()
            .with_sinks(sinks)
            .validate(256)
            .and_then(|p| {
                fa_cpu::forward(
                    &p,
                    Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
                    Out::with_lse(&mut out[..], &mut lse[..]),
                    &ForwardOptions::default(),
                )
            })
            .expect_err("bad sinks must be rejected");
        assert!(
            matches!(
                err,
                ProblemError::SinksLength { needed: 2, .. } | ProblemError::NonFiniteSink { .. }
            ),
            "{err:?}"
        );
        assert!(out.iter().chain(&lse).all(|&x| x == sentinel));
    }
}
