//! The f64 oracle of exact attention and the test helpers every crate's tests share.
//!
//! - [`attention_f64`]: two-pass attention in f64 over the whole problem description (dense or
//!   packed, strides, GQA, causal/window masks, softcap), returning O and the LSE. It
//!   materialises each row's scores: it is the oracle, not a product path. Its mask rule is
//!   written out from the definition, independently of `softmax_core::Mask`.
//! - [`attention_backward_f64`]: the f64 backward (dQ, dK, dV of `Σ dO ∘ O`), two-pass like
//!   the forward oracle, checked against finite differences of [`attention_f64`] in the
//!   tests; [`compare_grads`] measures a backend's gradients against it.
//!   [`attention_backward_sinks_f64`] adds the gradient of the attention sinks' logits
//!   (checked against finite differences too; [`compare_sink_grads`]).
//! - [`Rng`]: a small seeded generator (xoshiro256**) with normal samples, so that tests draw
//!   fresh, reproducible inputs without extra dependencies.
//! - [`Case`]: a random problem with its owned tensors, optionally rounded to bf16/f16.
//! - [`DecodeCase`]: a random decode problem over a padded or paged KV cache (shuffled block
//!   table), and the same attention gathered into a packed problem without a cache.
//! - [`compare`]: normwise and elementwise error of a backend's output against the oracle.
//! - [`pv_cancellation`]: how much V's values cancel in O, the factor by which a normwise
//!   error bound grows where O is small against the |V| it averages.
//! - [`bf16_pv_slack`]: the extra normwise error allowance of a backend that rounds P to bf16
//!   before `P·V` (scaled by [`pv_cancellation`]).
//! - [`f32_forward_bound`]: the normwise bound of an f32-accumulating forward, scaled by
//!   [`pv_cancellation`] where V's values cancel.
//!
//! # Example
//! ```
//! use fa_reference::{attention_f64, compare, Case, Rng};
//!
//! let mut rng = Rng::new(7);
//! let case = Case::dense(&mut rng, 1, 5, 9, 2, 1, 16).causal();
//! let problem = case.desc().validate(256).unwrap();
//! let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
//! // A backend would write its own output; the oracle rounded to f32 must of course pass.
//! let out: Vec<f32> = oracle.out.iter().map(|&x| x as f32).collect();
//! let lse: Vec<f32> = oracle.lse.iter().map(|&x| x as f32).collect();
//! let report = compare(&problem, &out, Some(&lse), &oracle);
//! assert!(report.rel_l2 < 1e-7 && report.lse_max_abs < 1e-5);
//! ```

use softmax_core::{Mask, Problem, ProblemDesc, Strides, Tensor};

mod backward;
mod decode;
mod rng;
pub use backward::{
    attention_backward_f64, attention_backward_sinks_f64, compare_grads, compare_sink_grads,
    rel_l2_of, tensor_offsets,
};
pub use decode::{CacheLayout, DecodeCase};
pub use rng::Rng;

/// Output of the oracle: O laid out as the problem's O strides say (entries outside the
/// tensor are 0), and the natural-log LSE in the problem's LSE layout.
#[derive(Clone, Debug)]
pub struct Reference {
    /// Output, `problem.min_buffer_lens().o` elements.
    pub out: Vec<f64>,
    /// Log-sum-exp per row, `problem.lse_len()` entries.
    pub lse: Vec<f64>,
}

/// Whether query `i` sees key `j`, written out from the definition in DESIGN.md §2.
fn visible(mask: &Mask, i: usize, j: usize, seqlen_q: usize, seqlen_k: usize) -> bool {
    let aligned = i as i128 + seqlen_k as i128 - seqlen_q as i128;
    let j = j as i128;
    let after_left = mask.left.is_none_or(|l| j >= aligned - l as i128);
    let before_right = mask.right.is_none_or(|r| j <= aligned + r as i128);
    after_left && before_right
}

/// Query head `h`'s attention sink logit in f64 (natural log), if the problem has sinks.
pub(crate) fn sink_of(problem: &Problem, h: usize) -> Option<f64> {
    problem.sinks().map(|s| s[h] as f64)
}

/// Two-pass f64 attention over the whole problem: scores, max, exp, sum, divide.
///
/// Inputs are read at the offsets the problem's strides give (any element type that widens
/// to f64). With attention sinks ([`softmax_core::Problem::sinks`]) head `h`'s logit joins
/// every row's maximum and sum as a score of no value (written out from the definition, not
/// through `softmax_core`'s rule). A row that sees no key yields 0 and LSE −∞ (with a sink:
/// 0 and the sink's logit). NaN/∞ in inputs propagate as IEEE
/// arithmetic does here (this is the behaviour backends must reproduce).
pub fn attention_f64<E: Element>(problem: &Problem, q: &[E], k: &[E], v: &[E]) -> Reference {
    let lens = problem.min_buffer_lens();
    let mut out = vec![0.0f64; lens.o];
    let mut lse = vec![f64::NEG_INFINITY; problem.lse_len()];
    let d = problem.head_dim();
    let dv = problem.head_dim_v();
    let scale = problem.softmax_scale() as f64;
    let softcap = problem.softcap().map(|c| c as f64);
    let mask = problem.mask();
    let mut scores = Vec::new();
    let mut acc = vec![0.0f64; dv];
    for b in 0..problem.batch() {
        let seq = problem.seq(b);
        for h in 0..problem.heads_q() {
            let hk = problem.kv_head(h);
            for i in 0..seq.seqlen_q {
                let qo = problem.q_offset(b, i, h);
                scores.clear();
                for j in 0..seq.seqlen_k {
                    if !visible(&mask, i, j, seq.seqlen_q, seq.seqlen_k) {
                        continue;
                    }
                    let ko = problem.k_offset(b, j, hk);
                    let dot: f64 = (0..d)
                        .map(|c| q[qo + c].to_f64() * k[ko + c].to_f64())
                        .sum();
                    let mut s = dot * scale;
                    if let Some(cap) = softcap {
                        s = cap * (s / cap).tanh();
                    }
                    scores.push((j, s));
                }
                let oo = problem.o_offset(b, i, h);
                let sink = sink_of(problem, h);
                if scores.is_empty() {
                    // Output stays 0; LSE −∞, or the sink's logit (the only term).
                    if let Some(s) = sink {
                        lse[problem.lse_offset(b, h, i)] = s;
                    }
                    continue;
                }
                // The sink is one more score (of no value) in the maximum and the sum.
                let max = scores
                    .iter()
                    .fold(
                        sink.unwrap_or(f64::NEG_INFINITY),
                        |m, &(_, s)| {
                            if s > m {
                                s
                            } else {
                                m
                            }
                        },
                    );
                // Like the online algorithm, a NaN score never becomes the maximum but
                // poisons the sum (and so the row) through exp(NaN).
                let max = if max == f64::NEG_INFINITY { 0.0 } else { max };
                acc.iter_mut().for_each(|a| *a = 0.0);
                let mut sum = sink.map_or(0.0, |s| (s - max).exp());
                for &(j, s) in &scores {
                    let p = (s - max).exp();
                    sum += p;
                    let vo = problem.v_offset(b, j, hk);
                    for c in 0..dv {
                        acc[c] += p * v[vo + c].to_f64();
                    }
                }
                if sum == 0.0 {
                    continue; // every visible score was −∞
                }
                for c in 0..dv {
                    out[oo + c] = acc[c] / sum;
                }
                lse[problem.lse_offset(b, h, i)] = max + sum.ln();
            }
        }
    }
    Reference { out, lse }
}

/// An element type the oracle and the helpers read and write.
pub trait Element: Copy + Send + Sync + 'static {
    /// Widens to f64.
    fn to_f64(self) -> f64;
    /// Rounds from f64 (to nearest even).
    fn from_f64(x: f64) -> Self;
}

impl Element for f32 {
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}
impl Element for f64 {
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(x: f64) -> Self {
        x
    }
}
impl Element for half::bf16 {
    fn to_f64(self) -> f64 {
        half::bf16::to_f64(self)
    }
    fn from_f64(x: f64) -> Self {
        half::bf16::from_f64(x)
    }
}
impl Element for half::f16 {
    fn to_f64(self) -> f64 {
        half::f16::to_f64(self)
    }
    fn from_f64(x: f64) -> Self {
        half::f16::from_f64(x)
    }
}

/// Rounding applied to random inputs, so that a low-precision backend and the oracle see the
/// very same values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// Keep f32.
    F32,
    /// Round to bf16 (values stay stored as f32).
    Bf16,
    /// Round to f16 (values stay stored as f32).
    F16,
}

impl Rounding {
    /// Rounds one value.
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Rounding::F32 => x,
            Rounding::Bf16 => half::bf16::from_f32(x).to_f32(),
            Rounding::F16 => half::f16::from_f32(x).to_f32(),
        }
    }
}

/// A random attention problem that owns its tensors (f32 storage, possibly rounded).
#[derive(Clone, Debug)]
pub struct Case {
    /// Prefix sums of query lengths (empty for dense problems).
    pub cu_seqlens_q: Vec<u32>,
    /// Prefix sums of key lengths (empty for dense problems).
    pub cu_seqlens_k: Vec<u32>,
    /// Dense shape `(batch, seqlen_q, seqlen_k)` (ignored for packed problems).
    pub dense: (usize, usize, usize),
    /// Query heads.
    pub heads_q: usize,
    /// KV heads.
    pub heads_kv: usize,
    /// Head dim of Q/K.
    pub head_dim: usize,
    /// Head dim of V/O.
    pub head_dim_v: usize,
    /// Mask.
    pub mask: Mask,
    /// Explicit scale.
    pub softmax_scale: Option<f32>,
    /// Softcap.
    pub softcap: Option<f32>,
    /// Strides (Q, K, V, O); `None` for contiguous.
    pub strides: [Option<Strides>; 4],
    /// Attention sink logits, one per query head (`None`: no sinks).
    pub sinks: Option<Vec<f32>>,
    /// Queries.
    pub q: Vec<f32>,
    /// Keys.
    pub k: Vec<f32>,
    /// Values.
    pub v: Vec<f32>,
}

impl Case {
    /// A dense problem with N(0,1) inputs.
    pub fn dense(
        rng: &mut Rng,
        batch: usize,
        seqlen_q: usize,
        seqlen_k: usize,
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
    ) -> Case {
        let mut case = Case {
            cu_seqlens_q: Vec::new(),
            cu_seqlens_k: Vec::new(),
            dense: (batch, seqlen_q, seqlen_k),
            heads_q,
            heads_kv,
            head_dim,
            head_dim_v: head_dim,
            mask: Mask::NONE,
            softmax_scale: None,
            softcap: None,
            strides: [None; 4],
            sinks: None,
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
        };
        case.fill(rng, Rounding::F32);
        case
    }

    /// A packed problem with the given per-sequence lengths and N(0,1) inputs.
    pub fn varlen(
        rng: &mut Rng,
        seqlens_q: &[u32],
        seqlens_k: &[u32],
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
    ) -> Case {
        let prefix = |lens: &[u32]| {
            let mut cu = vec![0u32];
            for &l in lens {
                cu.push(cu.last().copied().unwrap_or(0) + l);
            }
            cu
        };
        let mut case = Case::dense(rng, 1, 0, 0, heads_q, heads_kv, head_dim);
        case.cu_seqlens_q = prefix(seqlens_q);
        case.cu_seqlens_k = prefix(seqlens_k);
        case.fill(rng, Rounding::F32);
        case
    }

    /// The problem description (borrows the case's `cu_seqlens`).
    pub fn desc(&self) -> ProblemDesc<'_> {
        let mut desc = if self.cu_seqlens_q.is_empty() {
            let (b, sq, sk) = self.dense;
            ProblemDesc::new(b, sq, sk, self.heads_q, self.heads_kv, self.head_dim)
        } else {
            ProblemDesc::varlen(
                &self.cu_seqlens_q,
                &self.cu_seqlens_k,
                self.heads_q,
                self.heads_kv,
                self.head_dim,
            )
        };
        desc = desc.head_dim_v(self.head_dim_v).with_mask(self.mask);
        desc.softmax_scale = self.softmax_scale;
        desc.softcap = self.softcap;
        desc.sinks = self.sinks.as_deref();
        let tensors = [Tensor::Q, Tensor::K, Tensor::V, Tensor::O];
        for (t, s) in tensors.into_iter().zip(self.strides) {
            if let Some(s) = s {
                desc = desc.strides(t, s);
            }
        }
        desc
    }

    /// Redraws Q, K, V as N(0,1) sized for the current shape and strides, rounded as asked.
    /// Panics if the description is invalid (a test helper, not library code).
    pub fn fill(&mut self, rng: &mut Rng, rounding: Rounding) {
        let lens = match self.desc().validate(softmax_core::MAX_HEAD_DIM) {
            Ok(p) => p.min_buffer_lens(),
            Err(e) => panic!("invalid test case: {e}"),
        };
        let mut draw = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| rounding.apply(rng.normal() as f32))
                .collect()
        };
        self.q = draw(lens.q);
        self.k = draw(lens.k);
        self.v = draw(lens.v);
    }

    /// Rounds the current inputs (e.g. to bf16) in place.
    pub fn round(mut self, rounding: Rounding) -> Case {
        for x in self.q.iter_mut().chain(&mut self.k).chain(&mut self.v) {
            *x = rounding.apply(*x);
        }
        self
    }

    /// Makes the mask causal (inputs unchanged).
    pub fn causal(mut self) -> Case {
        self.mask.right = Some(0);
        self
    }

    /// Sets the mask (inputs unchanged).
    pub fn with_mask(mut self, mask: Mask) -> Case {
        self.mask = mask;
        self
    }

    /// Sets the softcap (inputs unchanged).
    pub fn with_softcap(mut self, cap: f32) -> Case {
        self.softcap = Some(cap);
        self
    }

    /// Draws attention sinks: one logit per query head, `N(0, 1)·2` rounded to a multiple of
    /// 2⁻⁸ (exact in f32, so that finite differences of ±2⁻¹² stay exact too). Scores of
    /// N(0,1) inputs are O(1): such sinks take from a few percent to most of a row's mass.
    pub fn with_random_sinks(mut self, rng: &mut Rng) -> Case {
        self.sinks = Some(random_sinks(rng, self.heads_q));
        self
    }

    /// Sets the attention sinks (one logit per query head; inputs unchanged).
    pub fn with_sinks(mut self, sinks: Vec<f32>) -> Case {
        self.sinks = Some(sinks);
        self
    }

    /// Sets the scale (inputs unchanged).
    pub fn with_scale(mut self, scale: f32) -> Case {
        self.softmax_scale = Some(scale);
        self
    }

    /// Sets padded strides for Q, K, V and O (`pad` extra elements after each head and
    /// token) and redraws the inputs to fit.
    pub fn padded(mut self, rng: &mut Rng, pad: usize, rounding: Rounding) -> Case {
        let (_, sq, sk) = self.dense;
        let varlen = !self.cu_seqlens_q.is_empty();
        let tq = if varlen {
            *self.cu_seqlens_q.last().unwrap_or(&0) as usize
        } else {
            sq
        };
        let tk = if varlen {
            *self.cu_seqlens_k.last().unwrap_or(&0) as usize
        } else {
            sk
        };
        let strided = |seq: usize, heads: usize, dim: usize| {
            let head = dim + pad;
            let token = heads * head + pad;
            Strides {
                batch: seq * token + pad,
                seq: token,
                head,
            }
        };
        self.strides = [
            Some(strided(tq, self.heads_q, self.head_dim)),
            Some(strided(tk, self.heads_kv, self.head_dim)),
            Some(strided(tk, self.heads_kv, self.head_dim_v)),
            Some(strided(tq, self.heads_q, self.head_dim_v)),
        ];
        self.fill(rng, rounding);
        self
    }
}

/// `heads` random sink logits: `N(0, 1)·2` rounded to a multiple of 2⁻⁸ (see
/// [`Case::with_random_sinks`]).
pub fn random_sinks(rng: &mut Rng, heads: usize) -> Vec<f32> {
    (0..heads)
        .map(|_| ((rng.normal() * 2.0 * 256.0).round() / 256.0) as f32)
        .collect()
}

/// How far a backend's output is from the oracle.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ErrorReport {
    /// `‖out − ref‖₂ / ‖ref‖₂` over the tensor's elements (absolute `‖out − ref‖₂` when the
    /// reference is all zeros). NaN if any compared element is NaN where the oracle is not.
    pub rel_l2: f64,
    /// Largest `|out − ref|`.
    pub max_abs: f64,
    /// Largest `|lse − ref|` over rows with a finite reference LSE (0 when not compared).
    pub lse_max_abs: f64,
    /// Rows whose LSE disagree in kind (finite vs −∞ vs NaN).
    pub lse_kind_mismatches: usize,
    /// Elements compared.
    pub elements: usize,
}

impl ErrorReport {
    /// Whether the output is within `rel_l2_bound` normwise and the LSE within `lse_bound`.
    pub fn within(&self, rel_l2_bound: f64, lse_bound: f64) -> bool {
        self.rel_l2 <= rel_l2_bound
            && self.lse_max_abs <= lse_bound
            && self.lse_kind_mismatches == 0
    }
}

/// Compares a backend's output (laid out with the problem's O strides) and optional LSE with
/// the oracle. Only the tensor's own elements are read: padding between them is ignored.
pub fn compare<E: Element>(
    problem: &Problem,
    out: &[E],
    lse: Option<&[f32]>,
    oracle: &Reference,
) -> ErrorReport {
    let mut diff2 = 0.0f64;
    let mut ref2 = 0.0f64;
    let mut max_abs = 0.0f64;
    let mut nan_mismatch = false;
    let mut elements = 0usize;
    let mut lse_max_abs = 0.0f64;
    let mut lse_kind_mismatches = 0usize;
    for b in 0..problem.batch() {
        let seq = problem.seq(b);
        for h in 0..problem.heads_q() {
            for i in 0..seq.seqlen_q {
                let oo = problem.o_offset(b, i, h);
                for c in 0..problem.head_dim_v() {
                    let x = out[oo + c].to_f64();
                    let r = oracle.out[oo + c];
                    elements += 1;
                    if x.is_nan() != r.is_nan() {
                        nan_mismatch = true;
                        continue;
                    }
                    if r.is_nan() {
                        continue;
                    }
                    let d = (x - r).abs();
                    diff2 += d * d;
                    ref2 += r * r;
                    max_abs = max_abs.max(d);
                }
                if let Some(lse) = lse {
                    let at = problem.lse_offset(b, h, i);
                    let (x, r) = (lse[at] as f64, oracle.lse[at]);
                    let kind = |y: f64| (y.is_nan(), y == f64::NEG_INFINITY);
                    if kind(x) != kind(r) {
                        lse_kind_mismatches += 1;
                    } else if r.is_finite() {
                        lse_max_abs = lse_max_abs.max((x - r).abs());
                    }
                }
            }
        }
    }
    let rel_l2 = if nan_mismatch {
        f64::NAN
    } else if ref2 > 0.0 {
        (diff2 / ref2).sqrt()
    } else {
        diff2.sqrt()
    };
    ErrorReport {
        rel_l2,
        max_abs,
        lse_max_abs,
        lse_kind_mismatches,
        elements,
    }
}

/// How much V's values cancel in O: `‖O_|V|‖₂ / ‖O‖₂`, where O is [`attention_f64`] of
/// `(q, k, v)` and O_|V| the same with |V| in place of V (`‖O_|V|‖₂` itself where the
/// reference O is all zeros, as [`compare`] then reports an absolute error).
///
/// Why: a perturbation of the probabilities (a rounding of P, or of the scores it comes
/// from) of relative size ε moves an output element `Σⱼ pⱼvⱼ / l` by up to ε·`Σⱼ pⱼ|vⱼ| / l`,
/// i.e. ε times the same element of O_|V|; normwise O moves by up to ε·‖O_|V|‖ and its
/// relative error by ε times this ratio. It is 1 when V's values do not cancel in O (all of
/// one sign) and grows where they do (O small against the |V| it averages: a single output
/// element of a few keys can be near zero). A normwise bound on [`ErrorReport::rel_l2`]
/// scales with it ([`bf16_pv_slack`]; the f32 bound of fa-cpu's property test).
///
/// The norms run over the whole O buffer (`problem.min_buffer_lens().o`), whose entries
/// outside the tensor are 0. Like [`attention_f64`], this materialises each row's scores (twice):
/// a test helper, not a product path.
pub fn pv_cancellation<E: Element>(problem: &Problem, q: &[E], k: &[E], v: &[E]) -> f64 {
    let abs_v: Vec<E> = v.iter().map(|&x| E::from_f64(x.to_f64().abs())).collect();
    let norm = |x: &[f64]| x.iter().map(|y| y * y).sum::<f64>().sqrt();
    let o = norm(&attention_f64(problem, q, k, v).out);
    let o_abs = norm(&attention_f64(problem, q, k, &abs_v).out);
    if o > 0.0 {
        o_abs / o
    } else {
        o_abs
    }
}

/// The normwise bound ([`ErrorReport::rel_l2`]) of an f32-accumulating forward against the
/// oracle, given [`pv_cancellation`]'s ratio: 1e-5 up to a ratio of 4, then in proportion
/// (the rounding error moves O relative to the |V| it averages; without cancellation it is
/// ~1e-7). fa-cpu's property test and its `cpu_forward` fuzz target hold f32 outputs to it.
pub fn f32_forward_bound(cancellation: f64) -> f64 {
    1e-5 * (cancellation / 4.0).max(1.0)
}

/// The extra normwise error allowance of a backend that rounds the probabilities P to bf16
/// before the `P·V` product (fa-cpu's AMX path does): `2⁻⁸·`[`pv_cancellation`].
///
/// Why: rounding each `pⱼ` to bf16 changes it by at most 2⁻⁹·pⱼ (relative), so the output's
/// relative error grows by at most 2⁻⁹ times the cancellation ratio. The result is twice that
/// rounding bound, leaving room for the f32 terms: 2⁻⁸ ≈ 3.9e-3 without cancellation. A
/// tolerance on [`ErrorReport::rel_l2`] adds it to the bound of the unrounded path.
pub fn bf16_pv_slack<E: Element>(problem: &Problem, q: &[E], k: &[E], v: &[E]) -> f64 {
    bf16_pv_slack_for(pv_cancellation(problem, q, k, v))
}

/// [`bf16_pv_slack`] from an already computed [`pv_cancellation`] ratio: `2⁻⁸·cancellation`.
pub fn bf16_pv_slack_for(cancellation: f64) -> f64 {
    2f64.powi(-8) * cancellation
}

/// The value outputs are filled with before a kernel runs, so that an element it forgets to
/// write is caught (NaN fails every comparison).
pub const POISON: f32 = f32::NAN;

/// Fills a buffer with [`POISON`].
pub fn poison<E: Element>(buf: &mut [E]) {
    let p = E::from_f64(POISON as f64);
    buf.iter_mut().for_each(|x| *x = p);
}
