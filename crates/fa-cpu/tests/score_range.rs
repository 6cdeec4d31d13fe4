//! Issue 16, item 4: a softmax scale or softcap whose f32 factors overflow gave NaN where the
//! exact answer is finite (`softcap` 1e-39: NaN in most rows; `scale` 1e38: all NaN). Such
//! settings are now rejected by validation with the safe range; at the edges of that range the
//! output matches the f64 reference.

mod common;

use common::{levels, run};
use fa_cpu::ForwardOptions;
use fa_reference::{attention_f64, compare, Case, Rng};
use softmax_core::{ProblemError, MAX_SCALE_OVER_SOFTCAP, MAX_SOFTCAP, MAX_SOFTMAX_SCALE};

const F32_BOUND: f64 = 1e-5;
const LSE_BOUND: f64 = 1e-4;

fn opts(level: fa_cpu::SimdLevel) -> ForwardOptions<'static> {
    ForwardOptions {
        simd: level,
        ..ForwardOptions::default()
    }
}

fn base(rng: &mut Rng) -> Case {
    Case::dense(rng, 1, 37, 53, 2, 1, 64)
}

/// The settings the issue found: whatever validation says, a run that is accepted must not
/// produce NaN (the inputs hold none, and the reference is finite).
#[test]
fn no_silent_nan_from_extreme_scale_or_softcap() {
    let mut rng = Rng::new(1601);
    let cases = [
        ("softcap 1e-39", base(&mut rng).with_softcap(1e-39)),
        ("scale 1e38", base(&mut rng).with_scale(1e38)),
        ("scale -1e38", base(&mut rng).with_scale(-1e38)),
        ("softcap 3e38", base(&mut rng).with_softcap(3e38)),
    ];
    for (name, case) in &cases {
        let problem = case.desc().validate(256);
        let Ok(problem) = problem else { continue };
        let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
        assert!(oracle.out.iter().all(|x| x.is_finite()), "{name}: oracle");
        for level in levels() {
            let r = run::<f32, f32>(case, &opts(level));
            assert!(
                !r.out.iter().chain(&r.lse).any(|x| x.is_nan()),
                "{name} {level:?}: accepted, and the output holds NaN"
            );
        }
    }
}

#[test]
fn out_of_range_scale_and_softcap_are_typed_errors() {
    let mut rng = Rng::new(1602);
    let e = base(&mut rng)
        .with_scale(1e38)
        .desc()
        .validate(256)
        .unwrap_err();
    assert_eq!(
        e,
        ProblemError::ScaleOutOfRange {
            scale: 1e38,
            max: MAX_SOFTMAX_SCALE
        }
    );
    let e = base(&mut rng)
        .with_softcap(1e-39)
        .desc()
        .validate(256)
        .unwrap_err();
    assert!(
        matches!(e, ProblemError::SoftcapOutOfRange { softcap, min, max }
            if softcap == 1e-39 && min == 0.125 / MAX_SCALE_OVER_SOFTCAP && max == MAX_SOFTCAP),
        "{e:?}"
    );
    let e = base(&mut rng)
        .with_softcap(3e38)
        .desc()
        .validate(256)
        .unwrap_err();
    assert!(matches!(e, ProblemError::SoftcapOutOfRange { .. }), "{e:?}");
    // The message names the range.
    let msg = ProblemError::ScaleOutOfRange {
        scale: 1e38,
        max: MAX_SOFTMAX_SCALE,
    }
    .to_string();
    assert!(msg.contains("4.2949673e9"), "{msg}");
}

/// At the largest accepted scale (±) and the smallest accepted softcap, random inputs give the
/// reference's answer within the f32 bound. The LSE is compared relative to its size: at a
/// scale of 2³² it is ~1e10, and f32 holds it to a few ulps of that, not to 1e-4.
#[test]
fn edges_of_the_accepted_range_match_the_reference() {
    let mut rng = Rng::new(1603);
    let default_scale = 1.0 / 8.0;
    let cases = [
        ("max scale", base(&mut rng).with_scale(MAX_SOFTMAX_SCALE)),
        ("-max scale", base(&mut rng).with_scale(-MAX_SOFTMAX_SCALE)),
        (
            "min softcap",
            base(&mut rng).with_softcap(default_scale / MAX_SCALE_OVER_SOFTCAP),
        ),
        (
            "min softcap at scale 3",
            base(&mut rng)
                .with_scale(3.0)
                .with_softcap(3.0 / MAX_SCALE_OVER_SOFTCAP),
        ),
        (
            "min softcap, causal",
            base(&mut rng)
                .causal()
                .with_softcap(default_scale / MAX_SCALE_OVER_SOFTCAP),
        ),
    ];
    for (name, case) in &cases {
        let problem = case.desc().validate(256).expect(name);
        let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
        let lse_scale = oracle
            .lse
            .iter()
            .filter(|x| x.is_finite())
            .fold(0.0f64, |m, x| m.max(x.abs()));
        let lse_bound = LSE_BOUND.max(lse_scale * 128.0 * f32::EPSILON as f64);
        for level in levels() {
            let r = run::<f32, f32>(case, &opts(level));
            let rep = compare(&problem, &r.out, Some(&r.lse), &oracle);
            assert!(
                rep.within(F32_BOUND, lse_bound),
                "{name} {level:?}: {rep:?} (lse bound {lse_bound:e})"
            );
        }
    }
}
