//! The backward pass against the f64 reference backward (on the same rounded inputs), its
//! error contract (typed errors, gradients untouched) and its determinism (bitwise identical
//! gradients for any thread count at each SIMD level), every level checked on its own.

mod common;

use common::{convert, levels, run};
use fa_cpu::{
    backward, BackwardInputs, BackwardOptions, BackwardStats, Element, ForwardOptions, SimdLevel,
};
use fa_reference::{attention_backward_f64, compare_grads, Case, Rng, Rounding};
use half::bf16;
use proptest::prelude::*;
use softmax_core::{Grads, Mask, ProblemError, Qkv, Tensor};

/// Gradients of one backward run, as `G`.
struct BwdRun<G> {
    grads: Grads<Vec<G>>,
    stats: BackwardStats,
}

/// Draws dO for a case (N(0,1), rounded as asked, laid out as O).
fn draw_d_o(case: &Case, rng: &mut Rng, rounding: Rounding) -> Vec<f32> {
    let problem = case.desc().validate(256).unwrap();
    (0..problem.min_buffer_lens().o)
        .map(|_| rounding.apply(rng.normal() as f32))
        .collect()
}

/// Forward through fa-cpu (inputs and O as `T`), then backward with gradients as `G`
/// (poisoned with NaN first).
fn run_backward<T: Element + fa_reference::Element, G: Element + fa_reference::Element>(
    case: &Case,
    d_o: &[f32],
    opts: &BackwardOptions,
) -> BwdRun<G> {
    let problem = case.desc().validate(256).unwrap();
    let fwd = run::<T, T>(case, &ForwardOptions::default());
    let (q, k, v) = (
        convert::<T>(&case.q),
        convert::<T>(&case.k),
        convert::<T>(&case.v),
    );
    let d_o = convert::<T>(d_o);
    let lens = problem.min_buffer_lens();
    let nan = G::from_f32(f32::NAN);
    let mut grads = Grads::new(vec![nan; lens.q], vec![nan; lens.k], vec![nan; lens.v]);
    let stats = backward(
        &problem,
        Qkv::new(&q[..], &k[..], &v[..]),
        BackwardInputs {
            o: &fwd.out,
            d_o: &d_o,
            lse: &fwd.lse,
        },
        Grads::new(&mut grads.dq[..], &mut grads.dk[..], &mut grads.dv[..]),
        opts,
    )
    .expect("backward");
    BwdRun { grads, stats }
}

/// Normwise errors of dQ, dK, dV against the f64 reference on the case's (rounded) inputs.
fn errors<T: Element + fa_reference::Element, G: Element + fa_reference::Element>(
    case: &Case,
    d_o: &[f32],
    opts: &BackwardOptions,
) -> Grads<f64> {
    let problem = case.desc().validate(256).unwrap();
    let reference = attention_backward_f64(&problem, &case.q, &case.k, &case.v, d_o);
    let r = run_backward::<T, G>(case, d_o, opts);
    compare_grads(
        &problem,
        Grads::new(&r.grads.dq[..], &r.grads.dk[..], &r.grads.dv[..]),
        &reference,
    )
}

fn assert_within(e: &Grads<f64>, bound: f64, what: &str) {
    if std::env::var_os("FA_BWD_PRINT").is_some() {
        eprintln!("{what}: dQ {:.2e} dK {:.2e} dV {:.2e}", e.dq, e.dk, e.dv);
    }
    for (name, x) in [("dQ", e.dq), ("dK", e.dk), ("dV", e.dv)] {
        assert!(x <= bound, "{what}: {name} rel_l2 {x:e} > {bound:e}");
    }
}

/// The cases of the fixed sweep: odd sizes, every mask kind, softcap, GQA/MQA, varlen with
/// empty sequences, `head_dim_v ≠ head_dim`, padded strides.
fn sweep(rng: &mut Rng, rounding: Rounding) -> Vec<(String, Case)> {
    let mut cases = Vec::new();
    for &n in &[1usize, 7, 65, 300] {
        for &d in &[8usize, 64, 72, 128] {
            // Keep the debug-build runtime modest: the largest shapes only with small heads.
            if n == 300 && d > 72 {
                continue;
            }
            let case = Case::dense(rng, 1, n, n + 3, 2, 1, d).round(rounding);
            cases.push((format!("n={n} d={d} gqa"), case.clone()));
            cases.push((format!("n={n} d={d} causal"), case.clone().causal()));
        }
    }
    cases.push((
        "n=300 d=128 causal mqa".into(),
        Case::dense(rng, 1, 300, 300, 3, 1, 128)
            .round(rounding)
            .causal(),
    ));
    cases.push((
        "window".into(),
        Case::dense(rng, 2, 65, 130, 2, 2, 64)
            .round(rounding)
            .with_mask(Mask {
                left: Some(20),
                right: Some(5),
            }),
    ));
    cases.push((
        "softcap".into(),
        Case::dense(rng, 1, 70, 90, 4, 2, 72)
            .round(rounding)
            .with_softcap(5.0)
            .with_scale(0.5),
    ));
    cases.push((
        "softcap causal seqlen_q > seqlen_k".into(),
        Case::dense(rng, 1, 80, 40, 2, 1, 8)
            .round(rounding)
            .with_softcap(2.0)
            .causal(),
    ));
    let mut dv = Case::dense(rng, 1, 33, 70, 4, 1, 64);
    dv.head_dim_v = 24;
    dv.fill(rng, rounding);
    cases.push(("head_dim_v".into(), dv));
    cases.push((
        "varlen".into(),
        Case::varlen(rng, &[7, 0, 65, 1, 0], &[9, 5, 70, 0, 0], 4, 2, 64)
            .round(rounding)
            .causal(),
    ));
    cases.push((
        "padded".into(),
        Case::dense(rng, 2, 20, 31, 2, 1, 16).padded(rng, 3, rounding),
    ));
    cases
}

#[test]
fn f32_within_1e_5_of_the_f64_reference() {
    let mut rng = Rng::new(41);
    for (what, case) in sweep(&mut rng, Rounding::F32) {
        let d_o = draw_d_o(&case, &mut rng, Rounding::F32);
        for simd in levels() {
            let opts = BackwardOptions {
                threads: None,
                simd,
            };
            let e = errors::<f32, f32>(&case, &d_o, &opts);
            assert_within(&e, 1e-5, &format!("{what} {simd:?}"));
        }
    }
}

#[test]
fn bf16_within_2e_2_of_the_f64_reference() {
    let mut rng = Rng::new(42);
    for (what, case) in sweep(&mut rng, Rounding::Bf16) {
        let d_o = draw_d_o(&case, &mut rng, Rounding::Bf16);
        // Gradients in f32 and in the input dtype.
        let e = errors::<bf16, f32>(&case, &d_o, &BackwardOptions::default());
        assert_within(&e, 2e-2, &format!("{what} (f32 grads)"));
        let e = errors::<bf16, bf16>(&case, &d_o, &BackwardOptions::default());
        assert_within(&e, 2e-2, &format!("{what} (bf16 grads)"));
    }
}

#[test]
fn f16_within_2e_2_of_the_f64_reference() {
    let mut rng = Rng::new(43);
    for (what, case) in sweep(&mut rng, Rounding::F16).into_iter().step_by(3) {
        let d_o = draw_d_o(&case, &mut rng, Rounding::F16);
        let e = errors::<half::f16, half::f16>(&case, &d_o, &BackwardOptions::default());
        assert_within(&e, 2e-2, &what);
    }
}

#[test]
fn gradients_are_bitwise_identical_for_any_thread_count() {
    let mut rng = Rng::new(44);
    let cases = [
        Case::dense(&mut rng, 2, 300, 333, 4, 2, 64).causal(),
        Case::varlen(&mut rng, &[17, 0, 250, 1], &[40, 3, 260, 9], 6, 2, 40),
        Case::dense(&mut rng, 1, 200, 130, 8, 1, 72).with_softcap(3.0),
    ];
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    for case in &cases {
        let d_o = draw_d_o(case, &mut rng, Rounding::F32);
        for level in levels() {
            let base = BackwardOptions {
                threads: Some(1),
                simd: level,
            };
            let reference = run_backward::<f32, f32>(case, &d_o, &base);
            for threads in [Some(1), Some(2), Some(3), Some(4), None] {
                let opts = BackwardOptions {
                    threads,
                    simd: level,
                };
                let r = run_backward::<f32, f32>(case, &d_o, &opts);
                // Whole buffers: the padding stays the same NaN in both.
                assert_eq!(
                    bits(&r.grads.dq),
                    bits(&reference.grads.dq),
                    "{level:?} {threads:?} dQ"
                );
                assert_eq!(
                    bits(&r.grads.dk),
                    bits(&reference.grads.dk),
                    "{level:?} {threads:?} dK"
                );
                assert_eq!(
                    bits(&r.grads.dv),
                    bits(&reference.grads.dv),
                    "{level:?} {threads:?} dV"
                );
                assert_eq!(r.stats, reference.stats);
            }
        }
    }
}

#[test]
fn masked_tiles_are_skipped() {
    let mut rng = Rng::new(45);
    let case = Case::dense(&mut rng, 1, 256, 256, 1, 1, 8).causal();
    let d_o = draw_d_o(&case, &mut rng, Rounding::F32);
    // The scalar level's tiles are 64 × 64 (AVX2's are 96).
    let opts = BackwardOptions {
        threads: None,
        simd: SimdLevel::Scalar,
    };
    let r = run_backward::<f32, f32>(&case, &d_o, &opts);
    // 4 × 4 tiles of 64: 10 on or below the diagonal, 6 above.
    assert_eq!(
        r.stats,
        BackwardStats {
            tiles_computed: 10,
            tiles_skipped: 6
        }
    );
}

#[test]
fn bad_input_is_a_typed_error_and_leaves_the_gradients_untouched() {
    let mut rng = Rng::new(46);
    let case = Case::dense(&mut rng, 1, 9, 11, 2, 1, 8).causal();
    let problem = case.desc().validate(256).unwrap();
    let lens = problem.min_buffer_lens();
    let d_o = vec![1.0f32; lens.o];
    let o = vec![0.5f32; lens.o];
    let lse = vec![0.0f32; problem.lse_len()];
    let good = || {
        (
            case.q.clone(),
            case.k.clone(),
            case.v.clone(),
            o.clone(),
            d_o.clone(),
            lse.clone(),
        )
    };
    type Bufs = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);
    let attempt = |bufs: Bufs, short_dq: bool, opts: BackwardOptions| -> ProblemError {
        let (q, k, v, o, d_o, lse) = bufs;
        let sentinel = 7.25f32;
        let mut dq = vec![sentinel; lens.q - usize::from(short_dq)];
        let mut dk = vec![sentinel; lens.k];
        let mut dv = vec![sentinel; lens.v];
        let err = backward(
            &problem,
            Qkv::new(&q[..], &k[..], &v[..]),
            BackwardInputs {
                o: &o,
                d_o: &d_o,
                lse: &lse,
            },
            Grads::new(&mut dq[..], &mut dk[..], &mut dv[..]),
            &opts,
        )
        .expect_err("must fail");
        for g in [&dq, &dk, &dv] {
            assert!(
                g.iter().all(|&x| x == sentinel),
                "gradients written on error"
            );
        }
        err
    };
    let opts = BackwardOptions::default();
    let too_small = |e: &ProblemError, t: Tensor| matches!(e, ProblemError::BufferTooSmall { tensor, .. } if *tensor == t);
    // Each input one element short.
    for (i, t) in [
        Tensor::Q,
        Tensor::K,
        Tensor::V,
        Tensor::O,
        Tensor::O,
        Tensor::Lse,
    ]
    .into_iter()
    .enumerate()
    {
        let mut b = good();
        match i {
            0 => b.0.pop(),
            1 => b.1.pop(),
            2 => b.2.pop(),
            3 => b.3.pop(),
            4 => b.4.pop(),
            _ => b.5.pop(),
        };
        let e = attempt(b, false, opts);
        assert!(too_small(&e, t), "input {i}: {e:?}");
    }
    // dQ one element short.
    let e = attempt(good(), true, opts);
    assert!(too_small(&e, Tensor::Q), "{e:?}");
    let e = attempt(
        good(),
        false,
        BackwardOptions {
            threads: Some(0),
            ..opts
        },
    );
    assert!(matches!(e, ProblemError::ZeroDim { what: "threads" }));
    for level in [SimdLevel::Avx2Fma, SimdLevel::Avx512f] {
        if !level.is_available() {
            let e = attempt(
                good(),
                false,
                BackwardOptions {
                    simd: level,
                    ..opts
                },
            );
            assert!(matches!(e, ProblemError::Unsupported { .. }));
        }
    }
}

#[test]
fn a_kv_cache_is_refused_and_the_gradients_stay_untouched() {
    let mut rng = Rng::new(47);
    let case = Case::dense(&mut rng, 2, 3, 40, 2, 1, 8);
    let lens_used = [17u32, 40];
    let problem = case
        .desc()
        .padded_cache(&lens_used)
        .validate(256)
        .expect("a valid padded-cache problem");
    let lens = problem.min_buffer_lens();
    let (o, d_o, lse) = (
        vec![0.5f32; lens.o],
        vec![1.0f32; lens.o],
        vec![0.0f32; problem.lse_len()],
    );
    let sentinel = -3.5f32;
    let (mut dq, mut dk, mut dv) = (
        vec![sentinel; lens.q],
        vec![sentinel; lens.k],
        vec![sentinel; lens.v],
    );
    let err = backward(
        &problem,
        Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
        BackwardInputs {
            o: &o,
            d_o: &d_o,
            lse: &lse,
        },
        Grads::new(&mut dq[..], &mut dk[..], &mut dv[..]),
        &BackwardOptions::default(),
    )
    .expect_err("the backward takes no KV cache");
    assert!(
        matches!(err, ProblemError::Unsupported { what } if what.contains("KV cache")),
        "{err:?}"
    );
    for g in [&dq, &dk, &dv] {
        assert!(
            g.iter().all(|&x| x == sentinel),
            "gradients written on error"
        );
    }
}

#[test]
fn short_dk_and_dv_are_errors_too() {
    let mut rng = Rng::new(47);
    let case = Case::dense(&mut rng, 1, 5, 6, 1, 1, 4);
    let problem = case.desc().validate(256).unwrap();
    let lens = problem.min_buffer_lens();
    let (o, d_o) = (vec![0.0f32; lens.o], vec![0.0f32; lens.o]);
    let lse = vec![0.0f32; problem.lse_len()];
    for (which, t) in [(1, Tensor::K), (2, Tensor::V)] {
        let mut dq = vec![3.0f32; lens.q];
        let mut dk = vec![3.0f32; lens.k - usize::from(which == 1)];
        let mut dv = vec![3.0f32; lens.v - usize::from(which == 2)];
        let e = backward(
            &problem,
            Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
            BackwardInputs {
                o: &o,
                d_o: &d_o,
                lse: &lse,
            },
            Grads::new(&mut dq[..], &mut dk[..], &mut dv[..]),
            &BackwardOptions::default(),
        )
        .expect_err("short gradient");
        assert!(matches!(e, ProblemError::BufferTooSmall { tensor, .. } if tensor == t));
        assert!(dq.iter().chain(&dk).chain(&dv).all(|&x| x == 3.0));
    }
}

/// A random problem for the proptest.
#[derive(Clone, Debug)]
struct Params {
    seed: u64,
    seqlens: Vec<(u32, u32)>,
    varlen: bool,
    heads_kv: usize,
    group: usize,
    head_dim: usize,
    head_dim_v: usize,
    mask: (bool, i64, i64),
    softcap: Option<f32>,
    threads: usize,
}

fn params() -> impl Strategy<Value = Params> {
    (
        any::<u64>(),
        prop::collection::vec((0u32..80, 0u32..100), 1..4),
        any::<bool>(),
        (1usize..3, prop::sample::select(vec![1usize, 2, 3])),
        prop::sample::select(vec![1usize, 5, 8, 33, 64, 72, 128]),
        prop::sample::select(vec![0usize, 1, 24]),
        (any::<bool>(), -1i64..40, -1i64..40),
        prop::option::of(1.0f32..30.0),
        1usize..4,
    )
        .prop_map(
            |(seed, seqlens, varlen, (heads_kv, group), head_dim, dv, mask, softcap, threads)| {
                Params {
                    seed,
                    seqlens,
                    varlen,
                    heads_kv,
                    group,
                    head_dim,
                    head_dim_v: if dv == 0 { head_dim } else { dv },
                    mask,
                    softcap,
                    threads,
                }
            },
        )
}

proptest! {
    // 24 cases by default; PROPTEST_CASES=N runs N (with_cases alone would ignore it).
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(24),
    ))]
    #[test]
    fn random_problems_match_the_reference(p in params()) {
        let mut rng = Rng::new(p.seed);
        let heads_q = p.heads_kv * p.group;
        let mut case = if p.varlen {
            let (q, k): (Vec<u32>, Vec<u32>) = p.seqlens.iter().copied().unzip();
            Case::varlen(&mut rng, &q, &k, heads_q, p.heads_kv, p.head_dim)
        } else {
            // A dense batch of empty sequences has zero strides, which the reference refuses
            // as overlapping: dense cases take at least one query and one key (the varlen
            // cases cover empty sequences).
            let (sq, sk) = p.seqlens[0];
            let (sq, sk) = (sq.max(1) as usize, sk.max(1) as usize);
            Case::dense(&mut rng, p.seqlens.len(), sq, sk, heads_q, p.heads_kv, p.head_dim)
        };
        case.head_dim_v = p.head_dim_v;
        case = case.with_mask(Mask::from_flash_args(p.mask.0, p.mask.1, p.mask.2));
        case.softcap = p.softcap;
        case.fill(&mut rng, Rounding::F32);
        let d_o = draw_d_o(&case, &mut rng, Rounding::F32);
        let opts = BackwardOptions { threads: Some(p.threads), ..BackwardOptions::default() };
        let e = errors::<f32, f32>(&case, &d_o, &opts);
        // DESIGN's f32 bound, softcap or not.
        let bound = 1e-5;
        for (name, x) in [("dQ", e.dq), ("dK", e.dk), ("dV", e.dv)] {
            prop_assert!(x <= bound, "{}: rel_l2 {:e} (bound {:e})", name, x, bound);
        }
    }
}

/// Each row sees one key (causal with a left window of 0): the softmax is one-hot, `O = V_j`
/// and `dS = P·(dP − D) = 0`, so dQ and dK are exactly 0 (the f64 reference's are too). `D`
/// is formed with the arithmetic of `dP` for that; with an unfused `D` against the fused `dP`
/// the residue was the whole "error" of the proptest's regression cases (dQ 1.03e-5
/// absolute against an all-zero reference, with and without softcap).
#[test]
fn a_one_hot_softmax_gives_exactly_zero_dq_and_dk() {
    let mut rng = Rng::new(48);
    for &(sq, sk, heads_q, heads_kv, d, softcap) in &[
        (
            54usize,
            55usize,
            4usize,
            2usize,
            33usize,
            Some(15.925146f32),
        ),
        (59, 62, 1, 1, 64, None),
        (130, 130, 3, 1, 128, Some(2.0)),
        (7, 20, 2, 2, 8, None),
    ] {
        let mut case = Case::dense(&mut rng, 2, sq, sk, heads_q, heads_kv, d)
            .with_mask(Mask::from_flash_args(true, 0, 33));
        case.softcap = softcap;
        case.fill(&mut rng, Rounding::F32);
        let d_o = draw_d_o(&case, &mut rng, Rounding::F32);
        for simd in levels() {
            let opts = BackwardOptions {
                threads: Some(2),
                simd,
            };
            let r = run_backward::<f32, f32>(&case, &d_o, &opts);
            let problem = case.desc().validate(256).unwrap();
            for (name, g, t) in [
                ("dQ", &r.grads.dq, Tensor::Q),
                ("dK", &r.grads.dk, Tensor::K),
            ] {
                let nonzero = fa_reference::tensor_offsets(&problem, t)
                    .into_iter()
                    .filter(|&at| g[at] != 0.0)
                    .count();
                assert_eq!(nonzero, 0, "{sq}x{sk} d={d} {softcap:?} {simd:?}: {name}");
            }
            let e = errors::<f32, f32>(&case, &d_o, &opts);
            assert_within(&e, 1e-5, &format!("{sq}x{sk} d={d} {softcap:?} {simd:?}"));
        }
    }
}

/// Plan → workspace → run for the backward: one plan runs several "layers" (fresh Q, K, V,
/// dO of the plan's sizes) with the bits `backward` gives and a workspace that does not grow;
/// tensors of other dtypes than the plan's are a typed error with the gradients untouched;
/// the plan refuses the dtypes and options `backward` refuses.
#[test]
fn one_backward_plan_runs_every_layer() {
    use fa_cpu::{plan_backward, run_backward, BackwardDTypes, BackwardWorkspace};
    use softmax_core::DType;
    let mut rng = Rng::new(45);
    let opts = BackwardOptions {
        threads: Some(2),
        simd: SimdLevel::Auto,
    };
    let shape = Case::dense(&mut rng, 2, 70, 90, 4, 2, 40).causal();
    let problem = shape.desc().validate(256).unwrap();
    let dtypes = BackwardDTypes {
        inputs: DType::Bf16,
        outputs: DType::Bf16,
        grads: DType::F32,
    };
    let plan = plan_backward(&problem, dtypes, &opts).expect("plan");
    assert_eq!(plan.work_items(), 2 * 2);
    assert!(plan.workspace().bytes_per_worker > 0, "{plan:?}");
    let mut ws = BackwardWorkspace::new();
    ws.reserve(&plan).expect("reserve");
    let reserved = ws.scratch_bytes();
    let lens = problem.min_buffer_lens();
    for layer in 0..3 {
        // Same sizes, fresh values.
        let case = Case::dense(&mut rng, 2, 70, 90, 4, 2, 40).causal();
        let d_o = draw_d_o(&case, &mut rng, Rounding::Bf16);
        let fwd = run::<bf16, bf16>(&case, &ForwardOptions::default());
        let (q, k, v) = (
            convert::<bf16>(&case.q),
            convert::<bf16>(&case.k),
            convert::<bf16>(&case.v),
        );
        let d_o = convert::<bf16>(&d_o);
        let inputs = BackwardInputs {
            o: &fwd.out,
            d_o: &d_o,
            lse: &fwd.lse,
        };
        let qkv = Qkv::new(&q[..], &k[..], &v[..]);
        let fresh = || {
            Grads::new(
                vec![f32::NAN; lens.q],
                vec![f32::NAN; lens.k],
                vec![f32::NAN; lens.v],
            )
        };
        let mut planned = fresh();
        let stats = run_backward(
            &plan,
            qkv,
            inputs,
            Grads::new(
                &mut planned.dq[..],
                &mut planned.dk[..],
                &mut planned.dv[..],
            ),
            &mut ws,
        )
        .expect("run");
        assert_eq!(
            ws.scratch_bytes(),
            reserved,
            "layer {layer}: the workspace grew"
        );
        let mut want = fresh();
        let want_stats = backward(
            &problem,
            qkv,
            inputs,
            Grads::new(&mut want.dq[..], &mut want.dk[..], &mut want.dv[..]),
            &opts,
        )
        .expect("backward");
        assert_eq!(stats, want_stats);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&planned.dq), bits(&want.dq), "layer {layer} dQ");
        assert_eq!(bits(&planned.dk), bits(&want.dk), "layer {layer} dK");
        assert_eq!(bits(&planned.dv), bits(&want.dv), "layer {layer} dV");
        // Gradients of another dtype than the plan's: a typed error, untouched.
        let mut g16 = Grads::new(
            vec![bf16::from_f32(5.0); lens.q],
            vec![bf16::from_f32(5.0); lens.k],
            vec![bf16::from_f32(5.0); lens.v],
        );
        let e = run_backward(
            &plan,
            qkv,
            inputs,
            Grads::new(&mut g16.dq[..], &mut g16.dk[..], &mut g16.dv[..]),
            &mut ws,
        )
        .unwrap_err();
        assert!(matches!(e, ProblemError::Unsupported { .. }), "{e:?}");
        assert!(g16
            .dq
            .iter()
            .chain(&g16.dk)
            .chain(&g16.dv)
            .all(|x| x.to_f32() == 5.0));
    }
    // The plan refuses what the call would: O or gradients in a third dtype, zero threads.
    for (outputs, grads, threads) in [
        (DType::F16, DType::F32, Some(1)),
        (DType::Bf16, DType::F16, Some(1)),
        (DType::Bf16, DType::F32, Some(0)),
    ] {
        let dtypes = BackwardDTypes {
            inputs: DType::Bf16,
            outputs,
            grads,
        };
        let opts = BackwardOptions {
            threads,
            simd: SimdLevel::Auto,
        };
        let e = plan_backward(&problem, dtypes, &opts).unwrap_err();
        assert!(
            matches!(
                e,
                ProblemError::Unsupported { .. } | ProblemError::ZeroDim { .. }
            ),
            "{outputs:?} {grads:?} {threads:?}: {e:?}"
        );
    }
}
