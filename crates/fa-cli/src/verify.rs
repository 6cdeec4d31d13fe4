//! `fa verify`: a backend against the f64 reference on fresh random problems.
//!
//! Every case draws N(0,1) inputs (rounded to bf16/f16 for those dtypes, so that the backend
//! and the oracle see the very same values), poisons the output with NaN, runs the backend and
//! compares with `fa_reference::compare`. Bounds (DESIGN.md §3): normwise error ≤ 1e-5 for f32,
//! ≤ 1e-2 for 16-bit inputs; LSE within 1e-4 (f32) or 1e-3 (16-bit; the LSE is always f32).
//! With the cubic software exp2 the bounds widen by twice its documented relative error.

use crate::backend::{Backend, Exp2, Options};
use crate::tensor::{DType, Data, HostTensor, TensorViews};
use fa_reference::{attention_f64, compare, poison, CacheLayout, Case, DecodeCase, Rng, Rounding};
use softmax_core::{Mask, Out, ProblemError, Qkv, EXP2_CUBIC_MAX_REL_ERROR};

/// One line of the verification table.
#[derive(Clone, Debug)]
pub struct VerifyRow {
    /// `batch×seqlen_q×seqlen_k, heads_q/heads_kv × head_dim` (or the varlen lengths).
    pub shape: String,
    /// Mask, softcap and scale.
    pub mask: String,
    /// Input dtype → output dtype.
    pub dtype: String,
    /// The outcome.
    pub outcome: Outcome,
}

/// The result of one case.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// Compared with the reference.
    Compared {
        /// Normwise error of the output.
        rel_l2: f64,
        /// Largest LSE error.
        lse_max_abs: f64,
        /// Rows whose LSE is −∞/NaN in one and not the other.
        lse_kind_mismatches: usize,
        /// Bound on `rel_l2`.
        bound: f64,
        /// Bound on the LSE error.
        lse_bound: f64,
    },
    /// The backend does not support this case (typed `Unsupported` error).
    Unsupported(String),
    /// The backend failed otherwise.
    Failed(String),
}

impl VerifyRow {
    /// Whether the row counts as a failure.
    pub fn failed(&self) -> bool {
        match &self.outcome {
            Outcome::Compared {
                rel_l2,
                lse_max_abs,
                lse_kind_mismatches,
                bound,
                lse_bound,
            } => !(*rel_l2 <= *bound && *lse_max_abs <= *lse_bound && *lse_kind_mismatches == 0),
            Outcome::Unsupported(_) => false,
            Outcome::Failed(_) => true,
        }
    }
}

/// The bounds `(rel_l2, lse)` of a dtype and exp2 choice.
pub fn bounds(dtype: DType, exp2: Exp2) -> (f64, f64) {
    let (rel, lse) = match dtype {
        DType::F32 => (1e-5, 1e-4),
        // 16-bit inputs (and any narrower type to come).
        _ => (1e-2, 1e-3),
    };
    // `Auto` is the exact exp2 on f32 inputs (the AMX forward takes 16-bit ones only).
    match (exp2, dtype) {
        (Exp2::Exact, _) | (Exp2::Auto, DType::F32) => (rel, lse),
        (Exp2::Cubic, _) | (Exp2::Auto, _) => {
            let e = 2.0 * EXP2_CUBIC_MAX_REL_ERROR;
            (rel + e, lse + e)
        }
    }
}

/// A mask as `fa` prints it: `none`, `causal`, or `window(L,R)` as `--window` takes it, `-1`
/// for an unbounded side (a right side of 0 is causal: `window(100,0)`).
pub fn mask_label(m: softmax_core::Mask) -> String {
    match (m.left, m.right) {
        (None, None) => "none".to_string(),
        (None, Some(0)) => "causal".to_string(),
        (l, r) => {
            let side = |x: Option<usize>| x.map_or("-1".to_string(), |v| v.to_string());
            format!("window({},{})", side(l), side(r))
        }
    }
}

fn describe_mask(case: &Case) -> String {
    let mut s = mask_label(case.mask);
    if let Some(c) = case.softcap {
        s.push_str(&format!(" cap {c:.2}"));
    }
    if let Some(sc) = case.softmax_scale {
        s.push_str(&format!(" scale {sc:.3}"));
    }
    s
}

fn describe_shape(case: &Case) -> String {
    let heads = format!("{}/{}", case.heads_q, case.heads_kv);
    let dims = if case.head_dim_v == case.head_dim {
        case.head_dim.to_string()
    } else {
        format!("{}/{}", case.head_dim, case.head_dim_v)
    };
    if case.cu_seqlens_q.is_empty() {
        let (b, sq, sk) = case.dense;
        format!("{b}x{sq}x{sk} h{heads} d{dims}")
    } else {
        let lens = |cu: &[u32]| {
            cu.windows(2)
                .map(|w| (w[1] - w[0]).to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        format!(
            "varlen q[{}] k[{}] h{heads} d{dims}",
            lens(&case.cu_seqlens_q),
            lens(&case.cu_seqlens_k)
        )
    }
}

/// The fixed cases (odd shapes, GQA/MQA, every mask kind, seqlen_q ≠ seqlen_k, fully masked
/// rows, softcap, explicit scale, padded strides, varlen) followed by `random` drawn ones.
pub fn cases(rng: &mut Rng, random: usize) -> Vec<Case> {
    let mut v = fixed_cases(rng);
    for _ in 0..random {
        v.push(random_case(rng));
    }
    v
}

/// The cases of [`cases`] for `Rng::new(seed)`, drawn one at a time as they are consumed: memory
/// stays bounded however many random cases are asked for, and the same seed gives the same
/// cases.
pub fn case_stream(seed: u64, random: usize) -> impl Iterator<Item = Case> {
    let mut rng = Rng::new(seed);
    let fixed = fixed_cases(&mut rng);
    let mut left = random;
    fixed.into_iter().chain(core::iter::from_fn(move || {
        left = left.checked_sub(1)?;
        Some(random_case(&mut rng))
    }))
}

/// The fixed cases.
fn fixed_cases(rng: &mut Rng) -> Vec<Case> {
    vec![
        Case::dense(rng, 1, 1, 1, 1, 1, 1),
        Case::dense(rng, 2, 37, 37, 4, 4, 64),
        Case::dense(rng, 1, 130, 130, 8, 2, 128).causal(),
        Case::dense(rng, 2, 65, 200, 6, 3, 80).causal(),
        // seqlen_q > seqlen_k with causal: the first rows see no key (output 0, LSE −∞).
        Case::dense(rng, 1, 200, 65, 4, 1, 32).causal(),
        Case::dense(rng, 1, 300, 300, 2, 2, 256).with_mask(Mask::from_flash_args(true, 64, -1)),
        Case::dense(rng, 1, 97, 131, 4, 2, 48)
            .with_mask(Mask::from_flash_args(false, 16, 16))
            .with_softcap(30.0),
        Case::dense(rng, 3, 33, 47, 2, 1, 128).with_scale(0.3),
        Case::dense(rng, 2, 31, 33, 4, 2, 127).padded(rng, 3, Rounding::F32),
        Case::varlen(rng, &[5, 64, 1, 100], &[7, 64, 33, 100], 4, 2, 64).causal(),
    ]
}

/// One random case.
fn random_case(rng: &mut Rng) -> Case {
    let dims = [1, 16, 32, 64, 96, 128, 192, 256];
    let heads_kv = 1 + rng.below(3);
    let heads_q = heads_kv * (1 + rng.below(4));
    let d = dims[rng.below(dims.len())];
    let sq = 1 + rng.below(300);
    let sk = if rng.below(2) == 0 {
        sq
    } else {
        1 + rng.below(300)
    };
    let batch = 1 + rng.below(2);
    let mut c = Case::dense(rng, batch, sq, sk, heads_q, heads_kv, d);
    c = match rng.below(4) {
        0 => c,
        1 => c.causal(),
        2 => c.with_mask(Mask::from_flash_args(
            false,
            rng.below(64) as i64,
            rng.below(64) as i64,
        )),
        _ => c.with_mask(Mask::from_flash_args(true, rng.below(128) as i64, -1)),
    };
    if rng.below(4) == 0 {
        c = c.with_softcap(5.0 + 45.0 * rng.uniform() as f32);
    }
    c
}

/// The reference's rounding of an input dtype (`None`: it has none).
pub(crate) fn rounding_of(dtype: DType) -> Option<Rounding> {
    match dtype {
        DType::F32 => Some(Rounding::F32),
        DType::Bf16 => Some(Rounding::Bf16),
        DType::F16 => Some(Rounding::F16),
        _ => None,
    }
}

/// A row's dtype column: the input dtype, with `->out` when the output's differs.
pub(crate) fn dtype_label(dtype: DType, out_dtype: DType) -> String {
    if out_dtype == dtype {
        dtype.to_string()
    } else {
        format!("{dtype}->{out_dtype}")
    }
}

/// `values` converted to `dtype`'s element storage.
pub(crate) fn to_data(values: &[f32], dtype: DType) -> Result<Data, String> {
    HostTensor::from_f32(dtype, vec![values.len()], values)
        .map(|t| t.data)
        .map_err(|e| e.to_string())
}

/// Runs one case on the backend at `dtype`, output in `dtype` (or f32 when `out_f32`).
pub fn verify_case(
    backend: &Backend,
    case: &Case,
    dtype: DType,
    out_f32: bool,
    opts: &Options,
) -> VerifyRow {
    let rounding = match rounding_of(dtype) {
        Some(r) => r,
        None => {
            return VerifyRow {
                shape: describe_shape(case),
                mask: describe_mask(case),
                dtype: dtype.to_string(),
                outcome: Outcome::Unsupported("no reference rounding for this dtype".into()),
            }
        }
    };
    let case = case.clone().round(rounding);
    let out_dtype = if out_f32 { DType::F32 } else { dtype };
    let row = |outcome| VerifyRow {
        shape: describe_shape(&case),
        mask: describe_mask(&case),
        dtype: dtype_label(dtype, out_dtype),
        outcome,
    };
    let outcome = run_and_compare(
        backend,
        &case.desc(),
        [&case.q, &case.k, &case.v],
        dtype,
        out_dtype,
        opts,
    );
    row(outcome)
}

/// Validates `desc`, runs it on the backend with the inputs converted to `dtype` (exact: they
/// were rounded to it) and O in `out_dtype` (poisoned first), and compares O and the LSE with
/// the f64 oracle on the same inputs.
fn run_and_compare(
    backend: &Backend,
    desc: &softmax_core::ProblemDesc,
    [q, k, v]: [&[f32]; 3],
    dtype: DType,
    out_dtype: DType,
    opts: &Options,
) -> Outcome {
    let problem = match desc.validate(softmax_core::MAX_HEAD_DIM) {
        Ok(p) => p,
        Err(e) => return Outcome::Failed(e.to_string()),
    };
    let lens = problem.min_buffer_lens();
    let mut out = vec![0.0f32; lens.o];
    poison(&mut out);
    let tensors = (|| {
        Ok::<_, String>((
            to_data(q, dtype)?,
            to_data(k, dtype)?,
            to_data(v, dtype)?,
            to_data(&out, out_dtype)?,
        ))
    })();
    let (qd, kd, vd, mut out) = match tensors {
        Ok(t) => t,
        Err(why) => return Outcome::Failed(why),
    };
    let mut lse = vec![0.0f32; problem.lse_len()];
    poison(&mut lse);
    let qkv = Qkv::new(qd.view(), kd.view(), vd.view());
    match backend.forward(
        &problem,
        qkv,
        Out::with_lse(out.view_mut(), &mut lse[..]),
        opts,
    ) {
        Ok(_) => {}
        Err(flash_attention::Error::Problem(ProblemError::Unsupported { what })) => {
            return Outcome::Unsupported(what.to_string())
        }
        Err(e) => return Outcome::Failed(crate::CliError::from(e).to_string()),
    }
    let oracle = attention_f64(&problem, q, k, v);
    let report = match &out {
        Data::F32(o) => compare(&problem, o, Some(&lse), &oracle),
        Data::Bf16(o) => compare(&problem, o, Some(&lse), &oracle),
        Data::F16(o) => compare(&problem, o, Some(&lse), &oracle),
    };
    let (bound, lse_bound) = bounds(dtype, opts.exp2);
    Outcome::Compared {
        rel_l2: report.rel_l2,
        lse_max_abs: report.lse_max_abs,
        lse_kind_mismatches: report.lse_kind_mismatches,
        bound,
        lse_bound,
    }
}

/// The decode cases: padded and paged KV caches (blocks of 1, 16, 64 and 256 keys, shuffled
/// tables), lengths 0, 1 and odd, 1–4 queries, GQA 8:1 and MQA, causal, window and softcap.
pub fn decode_cases(rng: &mut Rng) -> Vec<DecodeCase> {
    let lens: [&[u32]; 4] = [&[0, 1, 333, 1000], &[777], &[1, 64, 256, 3], &[2049, 5]];
    let mut v = Vec::new();
    let shapes = [
        // (queries, heads_q, heads_kv, head_dim, page size (0: padded))
        (1, 32, 4, 128, 0),
        (1, 64, 8, 128, 16),
        (2, 8, 1, 64, 1),
        (4, 16, 2, 96, 64),
        (3, 4, 4, 256, 256),
    ];
    for (i, (sq, hq, hk, d, page)) in shapes.into_iter().enumerate() {
        let used = lens[i % lens.len()];
        let layout = if page == 0 {
            CacheLayout::Padded {
                capacity: used.iter().copied().max().unwrap_or(0) as usize + 3,
            }
        } else {
            DecodeCase::paged_layout(used, page)
        };
        let case = DecodeCase::new(rng, used, sq, hq, hk, d, layout, Rounding::F32);
        v.push(match i % 3 {
            0 => case.causal(),
            1 => case.causal().with_softcap(30.0),
            _ => case.with_mask(Mask {
                left: Some(100),
                right: Some(0),
            }),
        });
    }
    v
}

/// Runs one decode case on the backend at `dtype` (output in `dtype`, or f32 when `out_f32`).
pub fn verify_decode_case(
    backend: &Backend,
    case: &DecodeCase,
    dtype: DType,
    out_f32: bool,
    opts: &Options,
) -> VerifyRow {
    let rounding = match dtype {
        DType::Bf16 => Rounding::Bf16,
        DType::F16 => Rounding::F16,
        _ => Rounding::F32,
    };
    let mut case = case.clone();
    for x in case.q.iter_mut().chain(&mut case.k).chain(&mut case.v) {
        *x = rounding.apply(*x);
    }
    let out_dtype = if out_f32 { DType::F32 } else { dtype };
    let layout = match case.layout {
        CacheLayout::Padded { capacity } => format!("padded {capacity}"),
        CacheLayout::Paged { block_size, .. } => format!("paged blk {block_size}"),
    };
    let lens: Vec<String> = case.seqused_k.iter().map(|l| l.to_string()).collect();
    let shape = format!(
        "decode q{} k[{}] h{}/{} d{} {layout}",
        case.seqlen_q,
        lens.join(","),
        case.heads_q,
        case.heads_kv,
        case.head_dim
    );
    let mut mask = mask_label(case.mask);
    if let Some(c) = case.softcap {
        mask.push_str(&format!(" cap {c:.2}"));
    }
    let outcome = run_and_compare(
        backend,
        &case.desc(),
        [&case.q, &case.k, &case.v],
        dtype,
        out_dtype,
        opts,
    );
    VerifyRow {
        shape,
        mask,
        dtype: dtype_label(dtype, out_dtype),
        outcome,
    }
}

/// The table header.
pub fn table_header() -> String {
    format!(
        "{:<46} {:<26} {:<9} {:>10} {:>10} {:>8} {:>8}  result",
        "shape (b x sq x sk, heads q/kv, d)",
        "mask",
        "dtype",
        "rel_l2",
        "LSE err",
        "bound",
        "LSE bnd"
    )
}

/// One table row.
pub fn table_row(r: &VerifyRow) -> String {
    let head = format!("{:<46} {:<26} {:<9}", r.shape, r.mask, r.dtype);
    match &r.outcome {
        Outcome::Compared {
            rel_l2,
            lse_max_abs,
            lse_kind_mismatches,
            bound,
            lse_bound,
        } => {
            let verdict = if r.failed() { "FAIL" } else { "pass" };
            let kinds = if *lse_kind_mismatches > 0 {
                format!(" ({lse_kind_mismatches} LSE rows differ in kind)")
            } else {
                String::new()
            };
            format!(
                "{head} {rel_l2:>10.2e} {lse_max_abs:>10.2e} {bound:>8.1e} {lse_bound:>8.1e}  {verdict}{kinds}"
            )
        }
        Outcome::Unsupported(what) => format!("{head} {:>50}  skip (unsupported: {what})", ""),
        Outcome::Failed(why) => {
            // Keep the table one line per case (NVRTC logs span many lines).
            let first = why.lines().next().unwrap_or("");
            let more = if why.lines().nth(1).is_some() {
                " …"
            } else {
                ""
            };
            format!("{head} {:>50}  FAIL ({first}{more})", "")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lazy stream draws the very cases of the eager list, in order.
    #[test]
    fn case_stream_is_cases_drawn_lazily() {
        let eager = cases(&mut Rng::new(42), 5);
        let lazy: Vec<Case> = case_stream(42, 5).collect();
        assert_eq!(eager.len(), lazy.len());
        for (a, b) in eager.iter().zip(&lazy) {
            assert_eq!((&a.q, &a.k, &a.v, a.dense), (&b.q, &b.k, &b.v, b.dense));
        }
        // A huge count costs nothing until consumed.
        assert_eq!(case_stream(1, usize::MAX).take(12).count(), 12);
    }

    /// Masks print as `--window` takes them. Fails on the old decode rows, which printed
    /// `window(Some(100),Some(0))`.
    #[test]
    fn masks_print_as_the_window_flag_takes_them() {
        use softmax_core::Mask;
        let w = |left, right| mask_label(Mask { left, right });
        assert_eq!(w(None, None), "none");
        assert_eq!(w(None, Some(0)), "causal");
        assert_eq!(w(Some(100), Some(0)), "window(100,0)");
        assert_eq!(w(Some(16), Some(16)), "window(16,16)");
        assert_eq!(w(None, Some(40)), "window(-1,40)");
        assert_eq!(w(Some(5), None), "window(5,-1)");
        for case in decode_cases(&mut Rng::new(3)) {
            let label = mask_label(case.mask);
            assert!(
                !label.contains("Some") && !label.contains("None"),
                "{label}"
            );
        }
    }
}
