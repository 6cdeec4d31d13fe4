//! The f64 backward against central finite differences of the f64 forward, on tiny problems
//! covering every mask, softcap, GQA, varlen (with empty sequences), `head_dim_v ≠ head_dim`
//! and strided layouts.

use fa_reference::{
    attention_backward_f64, attention_backward_sinks_f64, attention_f64, tensor_offsets, Case, Rng,
    Rounding,
};
use softmax_core::{Mask, Problem, Tensor, MAX_HEAD_DIM};

/// `L = Σ dO ∘ O` over O's own elements.
fn loss(problem: &Problem, q: &[f64], k: &[f64], v: &[f64], d_o: &[f64]) -> f64 {
    let out = attention_f64(problem, q, k, v).out;
    tensor_offsets(problem, Tensor::O)
        .into_iter()
        .map(|at| d_o[at] * out[at])
        .sum()
}

/// Checks every gradient element against `(L(x + h) − L(x − h)) / 2h`. Truncation error is
/// O(h²·L''') ≈ 1e-12 and cancellation error ≈ 1e-16·|L|/h ≈ 1e-11 for these O(1)-sized
/// problems: 1e-7 (absolute, plus relative to the element) leaves a wide margin while any
/// wrong term (a missing softcap slope, a dropped GQA head) is off by O(0.1).
fn check(case: &Case, rng: &mut Rng) {
    const H: f64 = 1e-5;
    const TOL: f64 = 1e-7;
    let problem = case.desc().validate(MAX_HEAD_DIM).unwrap();
    let widen = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let (q, k, v) = (widen(&case.q), widen(&case.k), widen(&case.v));
    let d_o: Vec<f64> = (0..problem.min_buffer_lens().o)
        .map(|_| rng.normal())
        .collect();
    let grads = attention_backward_f64(&problem, &q, &k, &v, &d_o);
    let mut checked = 0;
    for (tensor, grad) in [
        (Tensor::Q, &grads.dq),
        (Tensor::K, &grads.dk),
        (Tensor::V, &grads.dv),
    ] {
        for at in tensor_offsets(&problem, tensor) {
            let mut inputs = [q.clone(), k.clone(), v.clone()];
            let which = match tensor {
                Tensor::Q => 0,
                Tensor::K => 1,
                _ => 2,
            };
            inputs[which][at] += H;
            let up = loss(&problem, &inputs[0], &inputs[1], &inputs[2], &d_o);
            inputs[which][at] -= 2.0 * H;
            let down = loss(&problem, &inputs[0], &inputs[1], &inputs[2], &d_o);
            let fd = (up - down) / (2.0 * H);
            let err = (grad[at] - fd).abs();
            assert!(
                err <= TOL * (1.0 + fd.abs()),
                "{tensor:?}[{at}]: analytic {} vs finite difference {fd} (err {err:e})",
                grad[at]
            );
            checked += 1;
        }
    }
    assert!(checked > 0);
}

#[test]
fn matches_finite_differences_dense() {
    let mut rng = Rng::new(11);
    let base = Case::dense(&mut rng, 2, 3, 4, 2, 2, 3);
    check(&base, &mut rng);
    check(&base.clone().causal(), &mut rng);
    check(&base.clone().with_scale(0.9), &mut rng);
    check(
        &base.clone().with_mask(Mask {
            left: Some(1),
            right: Some(1),
        }),
        &mut rng,
    );
    // seqlen_q > seqlen_k under causal: the first row sees no key.
    check(&Case::dense(&mut rng, 1, 4, 2, 1, 1, 2).causal(), &mut rng);
}

#[test]
fn matches_finite_differences_softcap() {
    let mut rng = Rng::new(12);
    // Large scores so that tanh is well into its curve (slope far from 1).
    let case = Case::dense(&mut rng, 1, 3, 5, 2, 1, 4)
        .with_scale(1.5)
        .with_softcap(2.0);
    check(&case, &mut rng);
    check(&case.causal(), &mut rng);
}

#[test]
fn matches_finite_differences_gqa_and_head_dim_v() {
    let mut rng = Rng::new(13);
    let mut case = Case::dense(&mut rng, 1, 3, 4, 4, 2, 3);
    case.head_dim_v = 5;
    case.fill(&mut rng, Rounding::F32);
    check(&case, &mut rng);
    // MQA, window on the left only.
    let mut case = Case::dense(&mut rng, 1, 4, 4, 3, 1, 2).with_mask(Mask {
        left: Some(1),
        right: None,
    });
    case.head_dim_v = 1;
    case.fill(&mut rng, Rounding::F32);
    check(&case, &mut rng);
}

#[test]
fn matches_finite_differences_varlen_and_strides() {
    let mut rng = Rng::new(14);
    let case = Case::varlen(&mut rng, &[2, 0, 3, 1], &[3, 2, 0, 2], 2, 1, 3).causal();
    check(&case, &mut rng);
    let case = Case::dense(&mut rng, 2, 2, 3, 2, 1, 2).padded(&mut rng, 1, Rounding::F32);
    check(&case, &mut rng);
}

#[test]
fn gradients_outside_the_tensor_and_of_hidden_keys_are_zero() {
    let mut rng = Rng::new(15);
    let case = Case::dense(&mut rng, 1, 2, 5, 1, 1, 3)
        .with_mask(Mask {
            left: Some(0),
            right: Some(0),
        })
        .padded(&mut rng, 2, Rounding::F32);
    let problem = case.desc().validate(MAX_HEAD_DIM).unwrap();
    let d_o: Vec<f32> = (0..problem.min_buffer_lens().o).map(|_| 1.0).collect();
    let grads = attention_backward_f64(&problem, &case.q, &case.k, &case.v, &d_o);
    // Keys 0..3 are seen by nobody (queries sit at key positions 3 and 4, window 0).
    for j in 0..3 {
        let ko = problem.k_offset(0, j, 0);
        assert!(grads.dk[ko..ko + 3].iter().all(|&x| x == 0.0));
        assert!(grads.dv[ko..ko + 3].iter().all(|&x| x == 0.0));
    }
    let own: std::collections::HashSet<usize> =
        tensor_offsets(&problem, Tensor::Q).into_iter().collect();
    for (at, &x) in grads.dq.iter().enumerate() {
        if !own.contains(&at) {
            assert_eq!(x, 0.0, "padding at {at}");
        }
    }
}

/// The sinks' gradient against central differences of `L` in each sink logit, and the
/// Q/K/V gradients of a problem with sinks (the same [`check`]). `H = 2⁻¹²` keeps `s ± H`
/// exact in f32 (the sinks are multiples of 2⁻⁸); truncation O(H²) ≈ 6e-8.
fn check_sinks(case: &Case, rng: &mut Rng) {
    const H: f32 = 1.0 / 4096.0;
    const TOL: f64 = 1e-6;
    check(case, rng);
    let problem = case.desc().validate(MAX_HEAD_DIM).unwrap();
    let widen = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let (q, k, v) = (widen(&case.q), widen(&case.k), widen(&case.v));
    let d_o: Vec<f64> = (0..problem.min_buffer_lens().o)
        .map(|_| rng.normal())
        .collect();
    let (_, d_sinks) = attention_backward_sinks_f64(&problem, &q, &k, &v, &d_o);
    let d_sinks = d_sinks.expect("sinks set");
    let sinks = case.sinks.clone().unwrap();
    let mut nonzero = 0;
    for (h, &analytic) in d_sinks.iter().enumerate() {
        let at = |delta: f32| {
            let mut moved = sinks.clone();
            moved[h] += delta;
            let c = case.clone().with_sinks(moved);
            let p = c.desc().validate(MAX_HEAD_DIM).unwrap();
            loss(&p, &q, &k, &v, &d_o)
        };
        let fd = (at(H) - at(-H)) / (2.0 * H as f64);
        let err = (analytic - fd).abs();
        assert!(
            err <= TOL * (1.0 + fd.abs()),
            "d_sinks[{h}]: analytic {analytic} vs finite difference {fd} (err {err:e})"
        );
        nonzero += usize::from(analytic != 0.0);
    }
    assert!(nonzero > 0);
}

#[test]
fn sink_gradients_match_finite_differences() {
    let mut rng = Rng::new(53);
    let base = Case::dense(&mut rng, 2, 3, 4, 2, 2, 3).with_random_sinks(&mut rng);
    check_sinks(&base, &mut rng);
    check_sinks(&base.clone().causal().with_softcap(1.5), &mut rng);
    // GQA, a row that sees no key (causal, seqlen_q > seqlen_k), a window.
    let gqa = Case::dense(&mut rng, 1, 5, 3, 4, 2, 2)
        .causal()
        .with_random_sinks(&mut rng);
    check_sinks(&gqa, &mut rng);
    let window = Case::dense(&mut rng, 1, 4, 6, 2, 1, 3)
        .with_mask(Mask {
            left: Some(1),
            right: Some(0),
        })
        .with_random_sinks(&mut rng);
    check_sinks(&window, &mut rng);
    // Varlen with an empty sequence, and a very large sink (most of the mass).
    let varlen =
        Case::varlen(&mut rng, &[2, 0, 3], &[3, 2, 0], 2, 1, 3).with_sinks(vec![4.0, -3.0]);
    check_sinks(&varlen, &mut rng);
}
