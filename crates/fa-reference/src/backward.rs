//! The f64 oracle of the attention backward pass, and the comparison of a backend's
//! gradients with it.

use crate::{sink_of, visible, Element};
use softmax_core::{Grads, Problem, Tensor};

/// Two-pass f64 attention backward: the gradients of `L = Σ dO ∘ O` with respect to Q, K and
/// V, where `O = softmax(t(Q·Kᵀ·scale))·V` and `t` is the identity or the softcap
/// `cap·tanh(s/cap)`.
///
/// `d_o` is laid out as O (the problem's O strides). The gradients come back laid out as Q,
/// K and V (`problem.min_buffer_lens()` elements each, 0 between the tensor's elements). Per
/// query row `i` (of head `h`, reading KV head `h_kv`): `P` from the row's scores (max, exp,
/// sum, divide, as [`crate::attention_f64`]), `O_i = Σ_j P_j V_j`, `D_i = dO_i·O_i`,
/// `dP_j = dO_i·V_j`, `dS_j = P_j (dP_j − D_i)·t'(s_j)` with `t' = 1 − tanh²(s_j/cap)` under a
/// softcap, then `dQ_i += scale·dS_j K_j`, `dK_j += scale·dS_j Q_i`, `dV_j += P_j dO_i`: dK and dV
/// are summed over the query heads of a GQA group. A row that sees no key contributes
/// nothing (its dQ is 0); keys no row sees get dK = dV = 0. Non-finite inputs propagate as
/// IEEE arithmetic does here.
pub fn attention_backward_f64<E: Element>(
    problem: &Problem,
    q: &[E],
    k: &[E],
    v: &[E],
    d_o: &[E],
) -> Grads<Vec<f64>> {
    attention_backward_sinks_f64(problem, q, k, v, d_o).0
}

/// [`attention_backward_f64`] and, when the problem has attention sinks, the gradient of
/// their logits (`heads_q` entries): `∂L/∂s_h = −Σ_i P_sink,i·D_i` over every row `i` of head
/// `h` (all sequences), `P_sink,i = exp(s_h − m)/Σ` the row's probability of the sink and
/// `D_i = dO_i·O_i`. The sink joins each row's maximum and sum (as in
/// [`crate::attention_f64`]), so `P` and `O` are the sink-aware ones; a row that sees no key
/// has `O = 0`, hence `D = 0`, and contributes nothing. `None` without sinks.
pub fn attention_backward_sinks_f64<E: Element>(
    problem: &Problem,
    q: &[E],
    k: &[E],
    v: &[E],
    d_o: &[E],
) -> (Grads<Vec<f64>>, Option<Vec<f64>>) {
    let mut d_sinks = problem.sinks().map(|s| vec![0.0f64; s.len()]);
    let lens = problem.min_buffer_lens();
    let mut dq = vec![0.0f64; lens.q];
    let mut dk = vec![0.0f64; lens.k];
    let mut dv = vec![0.0f64; lens.v];
    let d = problem.head_dim();
    let d_v = problem.head_dim_v();
    let scale = problem.softmax_scale() as f64;
    let softcap = problem.softcap().map(|c| c as f64);
    let mask = problem.mask();
    // (key, score, t'(s)) of the row's visible keys, then their probabilities.
    let mut scores: Vec<(usize, f64, f64)> = Vec::new();
    let mut probs: Vec<f64> = Vec::new();
    let mut out_row = vec![0.0f64; d_v];
    for b in 0..problem.batch() {
        let seq = problem.seq(b);
        for h in 0..problem.heads_q() {
            let hk = problem.kv_head(h);
            for i in 0..seq.seqlen_q {
                let qo = problem.q_offset(b, i, h);
                let oo = problem.o_offset(b, i, h);
                scores.clear();
                for j in 0..seq.seqlen_k {
                    if !visible(&mask, i, j, seq.seqlen_q, seq.seqlen_k) {
                        continue;
                    }
                    let ko = problem.k_offset(b, j, hk);
                    let dot: f64 = (0..d)
                        .map(|c| q[qo + c].to_f64() * k[ko + c].to_f64())
                        .sum();
                    let s = dot * scale;
                    let (s, slope) = match softcap {
                        Some(cap) => {
                            let th = (s / cap).tanh();
                            (cap * th, 1.0 - th * th)
                        }
                        None => (s, 1.0),
                    };
                    scores.push((j, s, slope));
                }
                if scores.is_empty() {
                    continue;
                }
                let sink = sink_of(problem, h);
                let max = scores
                    .iter()
                    .fold(
                        sink.unwrap_or(f64::NEG_INFINITY),
                        |m, &(_, s, _)| {
                            if s > m {
                                s
                            } else {
                                m
                            }
                        },
                    );
                let max = if max == f64::NEG_INFINITY { 0.0 } else { max };
                probs.clear();
                probs.extend(scores.iter().map(|&(_, s, _)| (s - max).exp()));
                let sink_weight = sink.map_or(0.0, |s| (s - max).exp());
                let sum: f64 = probs.iter().sum::<f64>() + sink_weight;
                if sum == 0.0 {
                    continue; // every visible score was −∞: the row is 0 and so is its gradient
                }
                probs.iter_mut().for_each(|p| *p /= sum);
                out_row.iter_mut().for_each(|x| *x = 0.0);
                for (&(j, _, _), &p) in scores.iter().zip(&probs) {
                    let vo = problem.v_offset(b, j, hk);
                    for c in 0..d_v {
                        out_row[c] += p * v[vo + c].to_f64();
                    }
                }
                let delta: f64 = (0..d_v).map(|c| d_o[oo + c].to_f64() * out_row[c]).sum();
                if let Some(ds) = d_sinks.as_mut() {
                    ds[h] -= sink_weight / sum * delta;
                }
                for (&(j, _, slope), &p) in scores.iter().zip(&probs) {
                    let ko = problem.k_offset(b, j, hk);
                    let vo = problem.v_offset(b, j, hk);
                    let dp: f64 = (0..d_v)
                        .map(|c| d_o[oo + c].to_f64() * v[vo + c].to_f64())
                        .sum();
                    for c in 0..d_v {
                        dv[vo + c] += p * d_o[oo + c].to_f64();
                    }
                    let ds = p * (dp - delta) * slope * scale;
                    for c in 0..d {
                        dq[qo + c] += ds * k[ko + c].to_f64();
                        dk[ko + c] += ds * q[qo + c].to_f64();
                    }
                }
            }
        }
    }
    (Grads { dq, dk, dv }, d_sinks)
}

/// The offsets of a tensor's own elements (Q, K, V or O; nothing for the others), in a fixed
/// order: sequence, token, head, channel.
pub fn tensor_offsets(problem: &Problem, tensor: Tensor) -> Vec<usize> {
    let (heads, dim) = match tensor {
        Tensor::Q => (problem.heads_q(), problem.head_dim()),
        Tensor::K => (problem.heads_kv(), problem.head_dim()),
        Tensor::V => (problem.heads_kv(), problem.head_dim_v()),
        Tensor::O => (problem.heads_q(), problem.head_dim_v()),
        _ => return Vec::new(),
    };
    let mut out = Vec::new();
    for b in 0..problem.batch() {
        let seq = problem.seq(b);
        let tokens = match tensor {
            Tensor::Q | Tensor::O => seq.seqlen_q,
            _ => seq.seqlen_k,
        };
        for t in 0..tokens {
            for h in 0..heads {
                let start = match tensor {
                    Tensor::Q => problem.q_offset(b, t, h),
                    Tensor::K => problem.k_offset(b, t, h),
                    Tensor::V => problem.v_offset(b, t, h),
                    _ => problem.o_offset(b, t, h),
                };
                out.extend(start..start + dim);
            }
        }
    }
    out
}

/// Normwise error `‖x − ref‖₂ / ‖ref‖₂` (absolute when the reference is all zeros) over the
/// elements of one tensor (`tensor` names the layout: Q for dQ, K for dK, V for dV); NaN if
/// an element is NaN where the reference is not, or the other way round.
pub fn rel_l2_of<E: Element>(problem: &Problem, tensor: Tensor, x: &[E], reference: &[f64]) -> f64 {
    let mut diff2 = 0.0f64;
    let mut ref2 = 0.0f64;
    for at in tensor_offsets(problem, tensor) {
        let (a, r) = (x[at].to_f64(), reference[at]);
        if a.is_nan() != r.is_nan() {
            return f64::NAN;
        }
        if r.is_nan() {
            continue;
        }
        diff2 += (a - r) * (a - r);
        ref2 += r * r;
    }
    if ref2 > 0.0 {
        (diff2 / ref2).sqrt()
    } else {
        diff2.sqrt()
    }
}

/// [`rel_l2_of`] for each of a backend's dQ, dK and dV against the oracle's.
pub fn compare_grads<E: Element>(
    problem: &Problem,
    grads: Grads<&[E]>,
    reference: &Grads<Vec<f64>>,
) -> Grads<f64> {
    Grads {
        dq: rel_l2_of(problem, Tensor::Q, grads.dq, &reference.dq),
        dk: rel_l2_of(problem, Tensor::K, grads.dk, &reference.dk),
        dv: rel_l2_of(problem, Tensor::V, grads.dv, &reference.dv),
    }
}

/// The largest error of a backend's sink gradient against the oracle's
/// ([`attention_backward_sinks_f64`]), relative to `1 + Σ_i P_sink,i·|D_i|`-sized terms: the
/// largest `|x − ref| / (1 + |ref|)` over the heads (NaN if any entry is NaN where the
/// reference is not).
pub fn compare_sink_grads(d_sinks: &[f32], reference: &[f64]) -> f64 {
    let mut worst = 0.0f64;
    for (&x, &r) in d_sinks.iter().zip(reference) {
        let x = x as f64;
        if x.is_nan() != r.is_nan() {
            return f64::NAN;
        }
        if !r.is_nan() {
            worst = worst.max((x - r).abs() / (1.0 + r.abs()));
        }
    }
    worst
}
