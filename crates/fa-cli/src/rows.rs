//! The f64 reference for a few sampled rows of a large problem, without the N² oracle run.
//!
//! Each sampled row `(batch, head, query)` becomes a sub-problem of one query against the keys
//! its mask lets it see (`softmax_core::Mask::key_range`), read in place through the full
//! tensors' strides, and goes through `fa_reference::attention_f64`: the same oracle the test
//! suites use, on O(seqlen) work per row.

use crate::tensor::Data;
use fa_reference::{attention_f64, Element};
use softmax_core::{KvCache, Problem, ProblemDesc, Strides, Tensor};

/// One sampled row of the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowIndex {
    /// Sequence.
    pub batch: usize,
    /// Query head.
    pub head: usize,
    /// Query within the sequence.
    pub query: usize,
}

/// The oracle's output row and LSE.
#[derive(Clone, Debug, PartialEq)]
pub struct RowReference {
    /// `head_dim_v` values.
    pub out: Vec<f64>,
    /// Natural-log LSE (−∞ when the row sees no key).
    pub lse: f64,
}

fn row_typed<E: Element>(p: &Problem, q: &[E], k: &[E], v: &[E], r: RowIndex) -> RowReference {
    let seq = p.seq(r.batch);
    let keys = p.mask().key_range(r.query, seq.seqlen_q, seq.seqlen_k);
    if keys.is_empty() {
        return RowReference {
            out: vec![0.0; p.head_dim_v()],
            lse: f64::NEG_INFINITY,
        };
    }
    let [qs, ks, vs, _] = p.strides();
    let hk = p.kv_head(r.head);
    let qo = p.q_offset(r.batch, r.query, r.head);
    // One query, one head, the visible keys: strides of the full tensors, no mask left.
    let one = |s: Strides| Strides {
        batch: 0,
        seq: s.seq,
        head: s.head,
    };
    // A paged cache's keys are not evenly spaced: gather the visible ones first.
    let (kg, vg);
    let (k, v, ko, vo, ks, vs) = if matches!(p.kv_cache(), KvCache::Paged { .. }) {
        let (d, dv) = (p.head_dim(), p.head_dim_v());
        kg = keys
            .clone()
            .flat_map(|j| {
                let o = p.k_offset(r.batch, j, hk);
                k[o..o + d].iter().copied()
            })
            .collect::<Vec<E>>();
        vg = keys
            .clone()
            .flat_map(|j| {
                let o = p.v_offset(r.batch, j, hk);
                v[o..o + dv].iter().copied()
            })
            .collect::<Vec<E>>();
        let packed = |n: usize| Strides {
            batch: 0,
            seq: n,
            head: n,
        };
        (&kg[..], &vg[..], 0, 0, packed(d), packed(dv))
    } else {
        let ko = p.k_offset(r.batch, keys.start, hk);
        let vo = p.v_offset(r.batch, keys.start, hk);
        (k, v, ko, vo, ks, vs)
    };
    let mut desc = ProblemDesc::new(1, 1, keys.len(), 1, 1, p.head_dim())
        .head_dim_v(p.head_dim_v())
        .scale(p.softmax_scale())
        .strides(Tensor::Q, one(qs))
        .strides(Tensor::K, one(ks))
        .strides(Tensor::V, one(vs));
    desc.softcap = p.softcap();
    match desc.validate(softmax_core::MAX_HEAD_DIM) {
        Ok(sub) => {
            let reference = attention_f64(&sub, &q[qo..], &k[ko..], &v[vo..]);
            RowReference {
                out: reference.out,
                lse: reference.lse[0],
            }
        }
        // The full problem validated, so its one-row sub-problem does too.
        Err(_) => RowReference {
            out: vec![f64::NAN; p.head_dim_v()],
            lse: f64::NAN,
        },
    }
}

/// The f64 reference of the sampled rows of `problem` over `q`, `k`, `v` (one dtype).
/// Returns `None` when the inputs' dtypes differ.
pub fn reference_rows(
    problem: &Problem,
    q: &Data,
    k: &Data,
    v: &Data,
    rows: &[RowIndex],
) -> Option<Vec<RowReference>> {
    let refs = match (q, k, v) {
        (Data::F32(q), Data::F32(k), Data::F32(v)) => rows
            .iter()
            .map(|&r| row_typed(problem, q, k, v, r))
            .collect(),
        (Data::Bf16(q), Data::Bf16(k), Data::Bf16(v)) => rows
            .iter()
            .map(|&r| row_typed(problem, q, k, v, r))
            .collect(),
        (Data::F16(q), Data::F16(k), Data::F16(v)) => rows
            .iter()
            .map(|&r| row_typed(problem, q, k, v, r))
            .collect(),
        _ => return None,
    };
    Some(refs)
}

/// Errors of sampled rows against their reference.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RowErrors {
    /// `‖out − ref‖₂ / ‖ref‖₂` over all sampled elements (NaN if a NaN appears).
    pub rel_l2: f64,
    /// Largest `|lse − ref|` over rows with a finite reference LSE.
    pub lse_max_abs: f64,
    /// Rows whose LSE differ in kind (finite, −∞, NaN) from the reference.
    pub lse_kind_mismatches: usize,
    /// Rows with a NaN in the output (or LSE) where the reference has none.
    pub nan_rows: usize,
}

impl RowErrors {
    /// Whether the rows pass the bounds: no NaN row, no LSE of the wrong kind, errors within
    /// the bounds (a NaN error fails).
    pub fn passes(&self, bound: f64, lse_bound: f64) -> bool {
        self.nan_rows == 0
            && self.lse_kind_mismatches == 0
            && self.rel_l2 <= bound
            && self.lse_max_abs <= lse_bound
    }
}

/// Rows of the output (`batch · heads_q · seqlen_q` summed over the sequences).
pub fn row_count(problem: &Problem) -> usize {
    (0..problem.batch())
        .map(|b| problem.seq(b).seqlen_q.saturating_mul(problem.heads_q()))
        .fold(0usize, usize::saturating_add)
}

/// Compares the computed output (`out` widened to f64 by `get(offset)`) and LSE at the
/// sampled rows with their references.
pub fn compare_rows(
    problem: &Problem,
    out: &Data,
    lse: &[f32],
    rows: &[RowIndex],
    refs: &[RowReference],
) -> RowErrors {
    let get = |i: usize| -> f64 {
        match out {
            Data::F32(o) => o[i] as f64,
            Data::Bf16(o) => o[i].to_f64(),
            Data::F16(o) => o[i].to_f64(),
        }
    };
    let (mut diff2, mut ref2, mut nan) = (0.0f64, 0.0f64, false);
    let mut errs = RowErrors::default();
    for (r, reference) in rows.iter().zip(refs) {
        let oo = problem.o_offset(r.batch, r.query, r.head);
        let mut nan_row = false;
        for (c, &want) in reference.out.iter().enumerate() {
            let got = get(oo + c);
            if got.is_nan() || want.is_nan() {
                nan_row |= got.is_nan() != want.is_nan();
                continue;
            }
            diff2 += (got - want) * (got - want);
            ref2 += want * want;
        }
        nan |= nan_row;
        let got = lse[problem.lse_offset(r.batch, r.head, r.query)] as f64;
        nan_row |= got.is_nan() && !reference.lse.is_nan();
        errs.nan_rows += nan_row as usize;
        let kind = |y: f64| (y.is_nan(), y == f64::NEG_INFINITY);
        if kind(got) != kind(reference.lse) {
            errs.lse_kind_mismatches += 1;
        } else if reference.lse.is_finite() {
            errs.lse_max_abs = errs.lse_max_abs.max((got - reference.lse).abs());
        }
    }
    errs.rel_l2 = if nan {
        f64::NAN
    } else if ref2 > 0.0 {
        (diff2 / ref2).sqrt()
    } else {
        diff2.sqrt()
    };
    errs
}

/// `count` rows spread over the problem: the first and last query of the first sequence, and
/// the rest drawn at random (seeded).
pub fn sample_rows(problem: &Problem, count: usize, rng: &mut fa_reference::Rng) -> Vec<RowIndex> {
    let mut rows = Vec::with_capacity(count);
    let batch = problem.batch();
    let heads = problem.heads_q();
    let first = problem.seq(0).seqlen_q;
    if count > 0 && first > 0 {
        rows.push(RowIndex {
            batch: 0,
            head: 0,
            query: 0,
        });
    }
    if count > 1 && first > 1 {
        rows.push(RowIndex {
            batch: 0,
            head: heads - 1,
            query: first - 1,
        });
    }
    let mut attempts = 0;
    while rows.len() < count && attempts < 16 * count {
        attempts += 1;
        let b = rng.below(batch);
        let n = problem.seq(b).seqlen_q;
        if n == 0 {
            continue;
        }
        rows.push(RowIndex {
            batch: b,
            head: rng.below(heads),
            query: rng.below(n),
        });
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use fa_reference::{Case, Rng};
    use softmax_core::Mask;

    /// The per-row sub-problems agree with the whole-problem oracle (strides, GQA, masks,
    /// softcap, seqlen_q ≠ seqlen_k, rows that see no key).
    #[test]
    fn rows_match_the_full_oracle() {
        let mut rng = Rng::new(11);
        let masks = [
            Mask::NONE,
            Mask::CAUSAL,
            Mask::from_flash_args(false, 3, 2),
            Mask::from_flash_args(true, 5, -1),
        ];
        for (n, mask) in masks.into_iter().enumerate() {
            let case = Case::dense(&mut rng, 2, 9 + n, 6 + 3 * n, 4, 2, 5)
                .with_mask(mask)
                .with_softcap(3.0)
                .padded(&mut rng, 2, fa_reference::Rounding::F32);
            let p = case.desc().validate(256).unwrap();
            let full = attention_f64(&p, &case.q, &case.k, &case.v);
            let rows: Vec<RowIndex> = (0..2)
                .flat_map(|b| {
                    (0..4).flat_map(move |h| {
                        (0..9 + n).map(move |i| RowIndex {
                            batch: b,
                            head: h,
                            query: i,
                        })
                    })
                })
                .collect();
            let data = |x: &Vec<f32>| Data::F32(x.clone());
            let refs =
                reference_rows(&p, &data(&case.q), &data(&case.k), &data(&case.v), &rows).unwrap();
            for (r, got) in rows.iter().zip(&refs) {
                let oo = p.o_offset(r.batch, r.query, r.head);
                for (c, x) in got.out.iter().enumerate() {
                    assert!((x - full.out[oo + c]).abs() < 1e-12, "{mask:?} {r:?}");
                }
                let want = full.lse[p.lse_offset(r.batch, r.head, r.query)];
                assert!(want == got.lse || (want - got.lse).abs() < 1e-12);
            }
        }
    }

    /// A NaN where the reference is finite is a mismatching row and fails the check.
    #[test]
    fn nan_rows_fail_the_check() {
        let mut rng = Rng::new(3);
        let case = Case::dense(&mut rng, 1, 4, 4, 1, 1, 2);
        let p = case.desc().validate(256).unwrap();
        let rows = [RowIndex {
            batch: 0,
            head: 0,
            query: 1,
        }];
        let data = |x: &Vec<f32>| Data::F32(x.clone());
        let refs =
            reference_rows(&p, &data(&case.q), &data(&case.k), &data(&case.v), &rows).unwrap();
        let full = attention_f64(&p, &case.q, &case.k, &case.v);
        let mut out: Vec<f32> = full.out.iter().map(|&x| x as f32).collect();
        let lse: Vec<f32> = full.lse.iter().map(|&x| x as f32).collect();
        let ok = compare_rows(&p, &Data::F32(out.clone()), &lse, &rows, &refs);
        assert!(ok.passes(1e-5, 1e-4) && ok.nan_rows == 0, "{ok:?}");
        out[p.o_offset(0, 1, 0)] = f32::NAN;
        let bad = compare_rows(&p, &Data::F32(out), &lse, &rows, &refs);
        assert_eq!(bad.nan_rows, 1);
        assert!(!bad.passes(1e-5, 1e-4), "{bad:?}");
    }
}
