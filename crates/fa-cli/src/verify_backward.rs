//! `fa verify`'s backward rows: per case, the backend's forward (for O and the LSE) and then
//! its backward on a fresh N(0,1) dO, gradients poisoned with NaN first, compared with
//! `fa_reference::attention_backward_f64` on the same rounded inputs. Bounds (issue 17):
//! normwise ≤ 1e-5 for f32, ≤ 2e-2 for 16-bit inputs, on each of dQ, dK and dV (the row
//! reports the largest of the three).

use crate::backend::{Backend, Exp2, Options};
use crate::tensor::{DType, Data, TensorViews};
use crate::verify::{dtype_label, rounding_of, to_data, Outcome, VerifyRow};
use fa_reference::{attention_backward_f64, compare_grads, poison, Case, Rng};
use flash_attention::backward::BackwardInputs;
use softmax_core::{Grads, Out, ProblemError, Qkv, EXP2_CUBIC_MAX_REL_ERROR};

/// The gradients' bound for an input dtype and exp2 choice.
pub fn backward_bound(dtype: DType, exp2: Exp2) -> f64 {
    let rel = match dtype {
        DType::F32 => 1e-5,
        _ => 2e-2,
    };
    match (exp2, dtype) {
        (Exp2::Exact, _) | (Exp2::Auto, DType::F32) => rel,
        // The forward's O and LSE may come from the cubic exp2 (`Auto` on 16-bit inputs: the
        // AMX forward); the backward's P is exact.
        (Exp2::Cubic, _) | (Exp2::Auto, _) => rel + 4.0 * EXP2_CUBIC_MAX_REL_ERROR,
    }
}

/// The backward of one case on the backend: inputs in `dtype`; O, dO and the gradients in
/// `dtype` (or f32 when `out_f32`).
pub fn verify_backward_case(
    backend: &Backend,
    case: &Case,
    dtype: DType,
    out_f32: bool,
    opts: &Options,
) -> VerifyRow {
    let Some(rounding) = rounding_of(dtype) else {
        return VerifyRow {
            shape: String::new(),
            mask: "backward".into(),
            dtype: dtype.to_string(),
            outcome: Outcome::Unsupported("no reference rounding for this dtype".into()),
        };
    };
    let case = case.clone().round(rounding);
    let out_dtype = if out_f32 { DType::F32 } else { dtype };
    let row = |outcome| VerifyRow {
        shape: "  (the case above)".into(),
        mask: "backward".into(),
        dtype: dtype_label(dtype, out_dtype),
        outcome,
    };
    let problem = match case.desc().validate(softmax_core::MAX_HEAD_DIM) {
        Ok(p) => p,
        Err(e) => return row(Outcome::Failed(e.to_string())),
    };
    let lens = problem.min_buffer_lens();
    let mut rng = Rng::new(0xd0_d0 ^ lens.q as u64);
    let d_o: Vec<f32> = (0..lens.o)
        .map(|_| rounding.apply(rng.normal() as f32))
        .collect();
    let nan = |n: usize| {
        let mut x = vec![0.0f32; n];
        poison(&mut x);
        x
    };
    let buffers = (|| {
        Ok::<_, String>((
            to_data(&case.q, dtype)?,
            to_data(&case.k, dtype)?,
            to_data(&case.v, dtype)?,
            to_data(&nan(lens.o), out_dtype)?,
            to_data(&d_o, out_dtype)?,
            Grads::new(
                to_data(&nan(lens.q), out_dtype)?,
                to_data(&nan(lens.k), out_dtype)?,
                to_data(&nan(lens.v), out_dtype)?,
            ),
        ))
    })();
    let (q, k, v, mut out, d_o_data, mut grads) = match buffers {
        Ok(t) => t,
        Err(why) => return row(Outcome::Failed(why)),
    };
    let mut lse = nan(problem.lse_len());
    let qkv = Qkv::new(q.view(), k.view(), v.view());
    let fail = |e: flash_attention::Error| match e {
        flash_attention::Error::Problem(ProblemError::Unsupported { what }) => {
            Outcome::Unsupported(what.to_string())
        }
        e => Outcome::Failed(crate::CliError::from(e).to_string()),
    };
    if let Err(e) = backend.forward(
        &problem,
        qkv,
        Out::with_lse(out.view_mut(), &mut lse[..]),
        opts,
    ) {
        return row(fail(e));
    }
    if let Err(e) = backend.backward(
        &problem,
        qkv,
        BackwardInputs {
            o: out.view(),
            d_o: d_o_data.view(),
            lse: &lse,
        },
        Grads::new(
            grads.dq.view_mut(),
            grads.dk.view_mut(),
            grads.dv.view_mut(),
        ),
        opts,
    ) {
        return row(fail(e));
    }
    let reference = attention_backward_f64(&problem, &case.q, &case.k, &case.v, &d_o);
    let e = match (&grads.dq, &grads.dk, &grads.dv) {
        (Data::F32(a), Data::F32(b), Data::F32(c)) => {
            compare_grads(&problem, Grads::new(&a[..], &b[..], &c[..]), &reference)
        }
        (Data::Bf16(a), Data::Bf16(b), Data::Bf16(c)) => {
            compare_grads(&problem, Grads::new(&a[..], &b[..], &c[..]), &reference)
        }
        (Data::F16(a), Data::F16(b), Data::F16(c)) => {
            compare_grads(&problem, Grads::new(&a[..], &b[..], &c[..]), &reference)
        }
        _ => return row(Outcome::Failed("mixed gradient dtypes".into())),
    };
    // NaN (a gradient left unwritten) must fail: `max` would drop it.
    let worst = [e.dq, e.dk, e.dv].into_iter().fold(0.0f64, |a, x| {
        if x.is_nan() || a.is_nan() {
            f64::NAN
        } else {
            a.max(x)
        }
    });
    row(Outcome::Compared {
        rel_l2: worst,
        lse_max_abs: 0.0,
        lse_kind_mismatches: 0,
        bound: backward_bound(dtype, opts.exp2),
        lse_bound: 0.0,
    })
}
