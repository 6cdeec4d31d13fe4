//! The AMX backward ([`super::amx_backward_task`]): on emulated tiles against the f64
//! reference backward over odd shapes on every SIMD level (so the packing and the driver are
//! checked on any CPU), bitwise identical for any thread count, different from the SIMD path
//! (so the AMX kernel really ran); on CPUs with AMX the hardware tiles against the reference
//! and the emulation, and their determinism.
//!
//! The hardware tests are `#[ignore]`d (`--include-ignored` on an AMX machine: Intel Sapphire
//! Rapids or later); run there they FAIL when AMX is missing or not granted, never pass
//! silently.

use super::amx_backward_task::{AmxBwdLens, AmxBwdScratch};
use super::amx_task::HalfKind;
use super::amx_tests::large_score_f16_cases;
use crate::arch::amx;
use crate::arch::SimdLevel;
use crate::backward::{backward_on, BackwardInputs, BackwardOptions, BackwardWorkspace};
use crate::dispatch::Isa;
use crate::forward::AmxTiles;
use crate::{forward, Element, ForwardOptions};
use fa_reference::{attention_backward_f64, compare_grads, Case, Rng, Rounding};
use half::{bf16, f16};
use softmax_core::{Grads, Mask, Out, Problem, Qkv};

/// The bound for bf16 gradients (normwise, each of dQ, dK, dV).
const BF16_BOUND: f64 = 2e-2;

/// Every SIMD level this CPU runs, `Amx` excluded (the emulation runs on the SIMD levels).
fn simd_levels() -> Vec<SimdLevel> {
    [SimdLevel::Scalar, SimdLevel::Avx2Fma, SimdLevel::Avx512f]
        .into_iter()
        .filter(|&l| Isa::new(l).is_some())
        .collect()
}

/// Shapes: odd lengths, head dims not multiples of 32 (up to 256), GQA and MQA, every mask
/// kind, softcap (with `seqlen_q > seqlen_k` under causal), `head_dim_v ≠ head_dim` both ways,
/// varlen with empty sequences, padded strides. Inputs rounded by `r` (bf16 or f16).
fn cases(rng: &mut Rng, r: Rounding) -> Vec<(String, Case)> {
    let mut out = Vec::new();
    for &(sq, sk, hq, hkv, d) in &[
        (1, 1, 1, 1, 8),
        (7, 10, 2, 1, 64),
        (65, 68, 2, 1, 72),
        (33, 100, 3, 3, 40),
        (100, 70, 4, 2, 80),
        (130, 257, 2, 1, 128),
        (64, 64, 1, 1, 256),
        (97, 131, 3, 1, 200),
    ] {
        let base = Case::dense(rng, 1, sq, sk, hq, hkv, d).round(r);
        out.push((format!("{sq}x{sk} h{hq}/{hkv} d{d}"), base.clone()));
        out.push((format!("{sq}x{sk} h{hq}/{hkv} d{d} causal"), base.causal()));
    }
    out.push((
        "window".into(),
        Case::dense(rng, 2, 65, 130, 2, 2, 64)
            .round(r)
            .with_mask(Mask::from_flash_args(false, 20, 5)),
    ));
    out.push((
        "softcap".into(),
        Case::dense(rng, 1, 70, 90, 4, 2, 72)
            .round(r)
            .with_softcap(5.0)
            .with_scale(0.5),
    ));
    out.push((
        "softcap causal seqlen_q > seqlen_k".into(),
        Case::dense(rng, 1, 80, 40, 2, 1, 8)
            .round(r)
            .with_softcap(2.0)
            .causal(),
    ));
    out.push((
        "mqa causal".into(),
        Case::dense(rng, 1, 150, 150, 3, 1, 128).round(r).causal(),
    ));
    let mut dv = Case::dense(rng, 1, 33, 70, 4, 1, 64);
    dv.head_dim_v = 24;
    dv.fill(rng, r);
    out.push(("head_dim_v 24 < head_dim 64".into(), dv));
    let mut dv = Case::dense(rng, 2, 70, 90, 4, 2, 48);
    dv.head_dim_v = 72;
    dv.fill(rng, r);
    out.push(("head_dim_v 72 > head_dim 48, causal".into(), dv.causal()));
    out.push((
        "varlen".into(),
        Case::varlen(rng, &[7, 0, 65, 1, 0], &[9, 5, 70, 0, 0], 4, 2, 64)
            .round(r)
            .causal(),
    ));
    out.push((
        "padded strides".into(),
        Case::dense(rng, 2, 20, 31, 2, 1, 16).padded(rng, 3, r),
    ));
    out
}

/// dO for a case (N(0,1), rounded by `r`, laid out as O).
fn draw_d_o(case: &Case, rng: &mut Rng, r: Rounding) -> Vec<f32> {
    let problem = case.desc().validate(256).expect("valid case");
    (0..problem.min_buffer_lens().o)
        .map(|_| r.apply(rng.normal() as f32))
        .collect()
}

/// The forward (inputs and O as `T`, the default level) then the backward on `tiles` with
/// gradients as `G`, poisoned with NaN first.
fn run_backward<T: Element, G: Element>(
    case: &Case,
    d_o: &[f32],
    opts: &BackwardOptions,
    tiles: AmxTiles,
) -> Grads<Vec<G>> {
    let problem = case.desc().validate(256).expect("valid case");
    let lens = problem.min_buffer_lens();
    let conv = |x: &[f32]| x.iter().map(|&v| T::from_f32(v)).collect::<Vec<_>>();
    let (q, k, v, d_o) = (conv(&case.q), conv(&case.k), conv(&case.v), conv(d_o));
    let mut o = vec![T::from_f32(f32::NAN); lens.o];
    let mut lse = vec![f32::NAN; problem.lse_len()];
    forward(
        &problem,
        Qkv::new(&q[..], &k[..], &v[..]),
        Out::with_lse(&mut o[..], &mut lse[..]),
        &ForwardOptions::default(),
    )
    .expect("forward");
    let nan = G::from_f32(f32::NAN);
    let mut grads = Grads::new(vec![nan; lens.q], vec![nan; lens.k], vec![nan; lens.v]);
    backward_on(
        &problem,
        Qkv::new(&q[..], &k[..], &v[..]),
        BackwardInputs {
            o: &o,
            d_o: &d_o,
            lse: &lse,
        },
        Grads::new(&mut grads.dq[..], &mut grads.dk[..], &mut grads.dv[..]),
        opts,
        &mut BackwardWorkspace::new(),
        tiles,
    )
    .expect("backward");
    grads
}

/// The input types the AMX backward takes, as the rounding that gives a case their values.
const HALVES: [Rounding; 2] = [Rounding::Bf16, Rounding::F16];

/// [`run_backward`] with inputs and O in `half`'s type (one of [`HALVES`]).
fn run_half<G: Element>(
    half: Rounding,
    case: &Case,
    d_o: &[f32],
    opts: &BackwardOptions,
    tiles: AmxTiles,
) -> Grads<Vec<G>> {
    match half {
        Rounding::Bf16 => run_backward::<bf16, G>(case, d_o, opts, tiles),
        Rounding::F16 => run_backward::<f16, G>(case, d_o, opts, tiles),
        Rounding::F32 => panic!("the AMX backward takes bf16 or f16 inputs"),
    }
}

/// Normwise errors of dQ, dK, dV against the f64 reference backward on the same inputs.
fn errors(case: &Case, d_o: &[f32], grads: &Grads<Vec<f32>>) -> Grads<f64> {
    let (problem, reference) = reference_backward(case, d_o);
    errors_against(&problem, &reference, grads)
}

/// The validated problem of `case` and the f64 reference backward on its inputs.
fn reference_backward<'c>(case: &'c Case, d_o: &[f32]) -> (Problem<'c>, Grads<Vec<f64>>) {
    let problem = case.desc().validate(256).expect("valid case");
    let reference = attention_backward_f64(&problem, &case.q, &case.k, &case.v, d_o);
    (problem, reference)
}

/// [`errors`] against a reference already computed.
fn errors_against(
    problem: &Problem,
    reference: &Grads<Vec<f64>>,
    grads: &Grads<Vec<f32>>,
) -> Grads<f64> {
    compare_grads(
        problem,
        Grads::new(&grads.dq[..], &grads.dk[..], &grads.dv[..]),
        reference,
    )
}

/// Asserts each of dQ, dK, dV within `bound` (NaN fails); returns the worst.
fn assert_within(e: &Grads<f64>, bound: f64, what: &str) -> f64 {
    if std::env::var_os("FA_BWD_PRINT").is_some() {
        eprintln!("{what}: dQ {:.2e} dK {:.2e} dV {:.2e}", e.dq, e.dk, e.dv);
    }
    for (name, x) in [("dQ", e.dq), ("dK", e.dk), ("dV", e.dv)] {
        assert!(x <= bound, "{what}: {name} rel_l2 {x:e} > {bound:e}");
    }
    e.dq.max(e.dk).max(e.dv)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

pub fn the_reserved_size_companion_counts_what_the_scratch_allocates() {
    // `AmxBwdLens::bytes` is what a worker's scratch is reported to need (the error of a
    // failed reservation, `backward_scratch_bytes_per_thread`): from empty, `try_ensure`
    // allocates exactly that, slack included; growing to a larger problem, that one's bytes.
    let mut rng = Rng::fresh();
    let lens: Vec<AmxBwdLens> = cases(&mut rng, Rounding::Bf16)
        .iter()
        .flat_map(|(_, case)| {
            let problem = case.desc().validate(256).expect("valid case");
            [HalfKind::Bf16, HalfKind::F16].map(|kind| AmxBwdLens::new(&problem, kind))
        })
        .collect();
    for l in &lens {
        let mut s = AmxBwdScratch::default();
        s.try_ensure(l).expect("small");
        assert_eq!(s.bytes(), l.bytes(), "{l:?}");
    }
    let small = AmxBwdLens {
        group: 1,
        max_seqlen_q: 7,
        head_dim: 40,
        head_dim_v: 40,
        kind: HalfKind::Bf16,
    };
    let large = AmxBwdLens {
        group: 3,
        max_seqlen_q: 300,
        head_dim: 200,
        head_dim_v: 72,
        kind: HalfKind::F16,
    };
    let mut s = AmxBwdScratch::default();
    s.try_ensure(&small).expect("small");
    s.try_ensure(&large).expect("small");
    assert_eq!(s.bytes(), large.bytes());
}

pub fn emulated_amx_backward_matches_the_reference_on_every_level() {
    let mut rng = Rng::fresh();
    for half in HALVES {
        let mut worst = 0.0f64;
        for (what, case) in &cases(&mut rng, half) {
            let d_o = draw_d_o(case, &mut rng, half);
            for simd in simd_levels() {
                for threads in [Some(1), Some(3)] {
                    let opts = BackwardOptions { threads, simd };
                    let g = run_half::<f32>(half, case, &d_o, &opts, AmxTiles::Emulated);
                    let e = errors(case, &d_o, &g);
                    let what = format!("{what} {half:?} {simd:?} (emulated)");
                    worst = worst.max(assert_within(&e, BF16_BOUND, &what));
                }
            }
        }
        eprintln!(
            "emulated AMX backward, {half:?} inputs: worst normwise error {worst:.3e} (bound \
             {BF16_BOUND:e})"
        );
    }
}

pub fn emulated_amx_backward_writes_half_gradients_within_the_bound() {
    let mut rng = Rng::fresh();
    for (what, case) in cases(&mut rng, Rounding::Bf16).iter().step_by(3) {
        check_half_gradients::<bf16>(Rounding::Bf16, case, what, &mut rng);
    }
    for (what, case) in cases(&mut rng, Rounding::F16).iter().skip(1).step_by(3) {
        check_half_gradients::<f16>(Rounding::F16, case, what, &mut rng);
    }
}

/// `case` with inputs in `half`'s type and gradients written as `G` (that type), on emulated
/// tiles: within the bound of the reference.
fn check_half_gradients<G: Element>(half: Rounding, case: &Case, what: &str, rng: &mut Rng) {
    let d_o = draw_d_o(case, rng, half);
    let opts = BackwardOptions::default();
    let g = run_half::<G>(half, case, &d_o, &opts, AmxTiles::Emulated);
    let wide = |x: &[G]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    let g = Grads::new(wide(&g.dq), wide(&g.dk), wide(&g.dv));
    assert_within(&errors(case, &d_o, &g), BF16_BOUND, what);
}

pub fn emulated_amx_backward_keeps_f16_scores_exact() {
    // Large scores (scale 1, |s| up to ~100) make P, and so every gradient, sensitive to the
    // inputs' rounding: f16 inputs merely rounded to bf16 would move the scores by ~2⁻⁹·|s|.
    // The exact split keeps them to f32 accuracy, so the gradients keep the error of P's and
    // dS's rounding alone. The last assertion shows that the check can fail: the reference
    // backward on the same inputs rounded to bf16 is far outside the bound.
    // dQ and dK carry dS's rounding through a cancelling sum (each row of dS sums to zero and
    // peaked rows nearly cancel), so their error spreads from draw to draw; with 2 query heads
    // 300 draws of 40x300 d64 gave a median of 2.6e-3 and a largest of 6.8e-3 (the old bound,
    // 5e-3, failed about 1 run in 30), and bf16 rounding moved the gradients by as little as
    // 1.5e-2. Eight query heads per case average each norm over four times the rows: 123 draws
    // gave a largest error of 3.9e-3 (40x300 d64) and moved the gradients by at least 2.1e-2.
    let mut rng = Rng::fresh();
    let bound = 5e-3;
    for (what, case) in large_score_f16_cases(&mut rng, 8) {
        let d_o = draw_d_o(&case, &mut rng, Rounding::F16);
        let (problem, exact) = reference_backward(&case, &d_o);
        for simd in simd_levels() {
            let opts = BackwardOptions {
                threads: Some(2),
                simd,
            };
            let g = run_half::<f32>(Rounding::F16, &case, &d_o, &opts, AmxTiles::Emulated);
            let e = errors_against(&problem, &exact, &g);
            assert_within(&e, bound, &format!("{what} {simd:?}"));
        }
        let rounded = case.clone().round(Rounding::Bf16);
        let coarse = attention_backward_f64(&problem, &rounded.q, &rounded.k, &rounded.v, &d_o);
        let as_f32 = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
        let e = compare_grads(
            &problem,
            Grads::new(
                &as_f32(&coarse.dq)[..],
                &as_f32(&coarse.dk)[..],
                &as_f32(&coarse.dv)[..],
            ),
            &exact,
        );
        let moved = e.dq.max(e.dk).max(e.dv);
        eprintln!("{what}: bf16 rounding moves the gradients by {moved:e} (normwise)");
        assert!(
            moved > 2.0 * bound,
            "{what}: bf16 rounding moved the gradients by only {moved:e}"
        );
    }
}

pub fn emulated_amx_backward_is_bitwise_identical_for_any_thread_count() {
    let mut rng = Rng::fresh();
    let cases = [
        (
            Rounding::Bf16,
            Case::dense(&mut rng, 2, 150, 133, 4, 2, 64)
                .round(Rounding::Bf16)
                .causal(),
        ),
        (
            Rounding::Bf16,
            Case::varlen(&mut rng, &[17, 0, 130, 1], &[40, 3, 100, 9], 6, 2, 40)
                .round(Rounding::Bf16),
        ),
        (
            Rounding::F16,
            Case::varlen(&mut rng, &[17, 0, 130, 1], &[40, 3, 100, 9], 6, 2, 72)
                .round(Rounding::F16)
                .causal(),
        ),
    ];
    let simd = *simd_levels().last().expect("scalar always runs");
    for (half, case) in &cases {
        let d_o = draw_d_o(case, &mut rng, *half);
        let base = BackwardOptions {
            threads: Some(1),
            simd,
        };
        let want = run_half::<f32>(*half, case, &d_o, &base, AmxTiles::Emulated);
        for threads in [Some(2), Some(3), Some(5), None] {
            let opts = BackwardOptions { threads, simd };
            let got = run_half::<f32>(*half, case, &d_o, &opts, AmxTiles::Emulated);
            assert_eq!(bits(&got.dq), bits(&want.dq), "{threads:?} dQ");
            assert_eq!(bits(&got.dk), bits(&want.dk), "{threads:?} dK");
            assert_eq!(bits(&got.dv), bits(&want.dv), "{threads:?} dV");
        }
    }
}

pub fn emulated_amx_backward_differs_from_the_simd_path() {
    // The SIMD path keeps P and dS in f32: both within the bound of the reference (the bf16 O
    // of the forward already costs ~2e-3 through `D = dO·O`), but not equal, so the AMX kernel
    // really ran.
    let mut rng = Rng::fresh();
    let simd = *simd_levels().last().expect("scalar always runs");
    for (half, skip) in [(Rounding::Bf16, 2), (Rounding::F16, 3)] {
        for (what, case) in cases(&mut rng, half).iter().skip(skip).step_by(4) {
            check_amx_ran(half, case, what, simd, &mut rng);
        }
    }
}

/// Runs `case` on emulated tiles and on the SIMD path (`simd`, not AMX): both within the
/// bound, and different everywhere (so the AMX kernel really ran).
fn check_amx_ran(half: Rounding, case: &Case, what: &str, simd: SimdLevel, rng: &mut Rng) {
    let d_o = draw_d_o(case, rng, half);
    let opts = BackwardOptions {
        threads: Some(2),
        simd,
    };
    let amx_g = run_half::<f32>(half, case, &d_o, &opts, AmxTiles::Emulated);
    let simd_g = run_half::<f32>(half, case, &d_o, &opts, AmxTiles::Hardware);
    let e = errors(case, &d_o, &simd_g);
    assert_within(&e, BF16_BOUND, &format!("{what}: SIMD path"));
    let differ = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count()
    };
    assert!(
        differ(&amx_g.dq, &simd_g.dq) > 0
            && differ(&amx_g.dk, &simd_g.dk) > 0
            && differ(&amx_g.dv, &simd_g.dv) > 0,
        "{what}: the AMX kernel did not run"
    );
}

/// Panics unless AMX is there: the hardware tests fail, never pass, without it.
fn require_amx() {
    assert!(
        amx::available(),
        "this test needs AMX-BF16 with Linux's tile-data permission (Intel Sapphire Rapids or \
         later); run it with --include-ignored only there"
    );
    assert!(SimdLevel::Amx.is_available());
}

/// `‖x − y‖₂ / ‖exact‖₂` over the finite elements (equal non-finite values, the poison in the
/// gradients' padding, skipped); `‖x − y‖₂` itself where `exact` is all zeros, as
/// `fa_reference::rel_l2_of` does. Two runs' gradients compare against the reference's norm, not
/// one run's: a gradient that is zero in exact arithmetic (one query against one key: dS =
/// P·(dP − D) with O = V, so dQ and dK are zero up to the two dot products' rounding) is rounding
/// noise in both runs, and their difference over one noise's norm measured 9e-2.
fn rel_to(x: &[f32], y: &[f32], exact: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for ((a, b), e) in x.iter().zip(y).zip(exact) {
        if !a.is_finite() && a.to_bits() == b.to_bits() {
            continue;
        }
        num += (*a as f64 - *b as f64).powi(2);
        if e.is_finite() {
            den += e * e;
        }
    }
    if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    }
}

pub fn hardware_amx_backward_matches_the_reference_and_the_emulation() {
    require_amx();
    let mut rng = Rng::fresh();
    let (mut worst_ref, mut worst_emu) = (0.0f64, 0.0f64);
    let all: Vec<(String, Case, Rounding)> = HALVES
        .iter()
        .flat_map(|&half| {
            let named = cases(&mut rng, half).into_iter();
            named.map(move |(what, case)| (format!("{what} {half:?}"), case, half))
        })
        .collect();
    for (what, case, half) in &all {
        let d_o = draw_d_o(case, &mut rng, *half);
        let hw = BackwardOptions {
            threads: Some(2),
            simd: SimdLevel::Amx,
        };
        let g = run_half::<f32>(*half, case, &d_o, &hw, AmxTiles::Hardware);
        let (problem, reference) = reference_backward(case, &d_o);
        let e = errors_against(&problem, &reference, &g);
        worst_ref = worst_ref.max(assert_within(&e, BF16_BOUND, &format!("{what} (hardware)")));
        // The emulated tiles under the same AVX-512 element-wise step: the same up to the
        // products' f32 rounding (the hardware's sum order is not the emulation's) and the few
        // P and dS values whose bf16 rounding that flips.
        let emu = BackwardOptions {
            simd: SimdLevel::Avx512f,
            ..hw
        };
        let ge = run_half::<f32>(*half, case, &d_o, &emu, AmxTiles::Emulated);
        // Normwise against the f64 reference's norm, as the bound above: a gradient that is
        // zero in exact arithmetic (one key: dS = dP − D = 0, so dQ = dK = 0) is rounding
        // noise in both runs, and the difference of two noises relative to one of them means
        // nothing (seen: 9e-2 on a 1 × 1, d 8 f16 case).
        for (name, x, y, exact) in [
            ("dQ", &g.dq, &ge.dq, &reference.dq),
            ("dK", &g.dk, &ge.dk, &reference.dk),
            ("dV", &g.dv, &ge.dv, &reference.dv),
        ] {
            let r = rel_to(x, y, exact);
            assert!(r <= 1e-3, "{what}: hardware vs emulated {name} {r:e}");
            worst_emu = worst_emu.max(r);
        }
    }
    eprintln!(
        "hardware AMX backward: worst normwise error {worst_ref:.3e} against the f64 \
         reference, {worst_emu:.3e} against the emulation"
    );
}

pub fn hardware_amx_backward_is_bitwise_identical_for_any_thread_count() {
    require_amx();
    let mut rng = Rng::fresh();
    let cases = [
        Case::dense(&mut rng, 2, 300, 333, 4, 2, 64)
            .round(Rounding::Bf16)
            .causal(),
        Case::varlen(&mut rng, &[17, 0, 250, 1], &[40, 3, 260, 9], 6, 2, 40).round(Rounding::Bf16),
        Case::dense(&mut rng, 1, 200, 130, 8, 1, 72)
            .round(Rounding::Bf16)
            .with_softcap(3.0),
        Case::dense(&mut rng, 1, 300, 290, 4, 1, 136)
            .round(Rounding::F16)
            .causal(),
    ];
    for (i, case) in cases.iter().enumerate() {
        // The last case's inputs are f16.
        let half = if i + 1 == cases.len() {
            Rounding::F16
        } else {
            Rounding::Bf16
        };
        let d_o = draw_d_o(case, &mut rng, half);
        let base = BackwardOptions {
            threads: Some(1),
            simd: SimdLevel::Amx,
        };
        let want = run_half::<f32>(half, case, &d_o, &base, AmxTiles::Hardware);
        for threads in [Some(2), Some(3), Some(4), None] {
            let opts = BackwardOptions {
                threads,
                simd: SimdLevel::Amx,
            };
            let got = run_half::<f32>(half, case, &d_o, &opts, AmxTiles::Hardware);
            assert_eq!(bits(&got.dq), bits(&want.dq), "{threads:?} dQ");
            assert_eq!(bits(&got.dk), bits(&want.dk), "{threads:?} dK");
            assert_eq!(bits(&got.dv), bits(&want.dv), "{threads:?} dV");
        }
    }
}
