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
