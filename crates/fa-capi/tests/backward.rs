//! `fa_backward_cpu` called from Rust as C would: after `fa_forward_cpu`, the gradients of
//! fresh random inputs (dense and packed, GQA/MQA, causal, window, softcap, f32 and bf16)
//! against the f64 reference backward; bad calls get their code and message with the
//! gradients untouched.

mod common;

use common::*;
use core::ffi::c_void;
use core::ptr::{null, null_mut};
use fa_reference::{attention_backward_f64, compare_grads, Case, Rng, Rounding};
use flash_attention_rs::*;
use half::bf16;
use softmax_core::{Grads, Mask};

const SENTINEL: f32 = 7.0;

/// The C problem of a reference case (dense or packed; causal/window/softcap/scale copied).
fn c_problem(case: &Case) -> FaProblem {
    let (b, sq, sk) = case.dense;
    let mut p = FaProblem::dense(
        b as i64,
        sq as i64,
        sk as i64,
        case.heads_q as i64,
        case.heads_kv as i64,
        case.head_dim as i64,
    );
    if !case.cu_seqlens_q.is_empty() {
        p.seqlens = FA_SEQLENS_VARLEN_HOST;
        p.batch = case.cu_seqlens_q.len() as i64 - 1;
    }
    p.head_dim_v = case.head_dim_v as i64;
    let (left, right) = (case.mask.left, case.mask.right);
    p.window_left = left.map_or(-1, |x| x as i64);
    p.window_right = right.map_or(-1, |x| x as i64);
    p.softcap = case.softcap.unwrap_or(0.0);
    p.softmax_scale = case.softmax_scale.unwrap_or(0.0);
    p
}

/// Host buffers of one backward call in element type `E`: inputs converted from the case,
/// O and LSE from `fa_forward_cpu`, dO drawn, gradients poisoned with [`SENTINEL`].
struct Buffers<E> {
    case: Case,
    problem: FaProblem,
    cu: (Vec<i32>, Vec<i32>),
    dtype: u32,
    q: Vec<E>,
    k: Vec<E>,
    v: Vec<E>,
    o: Vec<E>,
    lse: Vec<f32>,
    d_o: Vec<E>,
    d_o_f32: Vec<f32>,
    grads: Grads<Vec<E>>,
}

trait Elem: Copy {
    const DTYPE: u32;
    fn of(x: f32) -> Self;
    fn f32(self) -> f32;
}
impl Elem for f32 {
    const DTYPE: u32 = FA_DTYPE_F32;
    fn of(x: f32) -> Self {
        x
    }
    fn f32(self) -> f32 {
        self
    }
}
impl Elem for bf16 {
    const DTYPE: u32 = FA_DTYPE_BF16;
    fn of(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

impl<E: Elem> Buffers<E> {
    fn new(case: Case, rng: &mut Rng, rounding: Rounding) -> Buffers<E> {
        let p = case.desc().validate(256).expect("valid case");
        let lens = p.min_buffer_lens();
        let conv = |x: &[f32]| x.iter().map(|&v| E::of(v)).collect::<Vec<E>>();
        let d_o_f32: Vec<f32> = (0..lens.o)
            .map(|_| rounding.apply(rng.normal() as f32))
            .collect();
        let cu = (
            case.cu_seqlens_q.iter().map(|&x| x as i32).collect(),
            case.cu_seqlens_k.iter().map(|&x| x as i32).collect(),
        );
        let sentinel = E::of(SENTINEL);
        let mut b = Buffers {
            problem: c_problem(&case),
            cu,
            dtype: E::DTYPE,
            q: conv(&case.q),
            k: conv(&case.k),
            v: conv(&case.v),
            o: vec![sentinel; lens.o],
            lse: vec![SENTINEL; p.lse_len()],
            d_o: conv(&d_o_f32),
            d_o_f32,
            grads: Grads::new(
                vec![sentinel; lens.q],
                vec![sentinel; lens.k],
                vec![sentinel; lens.v],
            ),
            case,
        };
        if b.problem.seqlens == FA_SEQLENS_VARLEN_HOST {
            b.problem.cu_seqlens_q = b.cu.0.as_ptr();
            b.problem.cu_seqlens_k = b.cu.1.as_ptr();
        }
        let [q, k, v, o] = b.inputs();
        let mut opts = fa_options_default();
        opts.sinks = b.case.sinks.as_ref().map_or(null(), |s| s.as_ptr());
        // SAFETY: live buffers of the problem's sizes, contiguous as described.
        let code = unsafe { fa_forward_cpu(&b.problem, &q, &k, &v, &o, b.lse.as_mut_ptr(), &opts) };
        assert_eq!(code, FA_OK, "forward: {}", last_error());
        b
    }

    /// A contiguous descriptor of `data` laid out as tensor `which` (0 Q, 1 K, 2 V, 3 O).
    fn desc(&self, data: *mut c_void, which: usize) -> FaTensor {
        let c = &self.case;
        let packed = !c.cu_seqlens_q.is_empty();
        let (_, sq, sk) = c.dense;
        let (seqlen, heads, dim) = match which {
            0 => (sq, c.heads_q, c.head_dim),
            1 => (sk, c.heads_kv, c.head_dim),
            2 => (sk, c.heads_kv, c.head_dim_v),
            _ => (sq, c.heads_q, c.head_dim_v),
        };
        let mut t = bshd(data, self.dtype, seqlen, heads, dim);
        if packed {
            t.stride_batch = 0;
        }
        t
    }

    fn inputs(&mut self) -> [FaTensor; 4] {
        let o: *mut c_void = self.o.as_mut_ptr().cast();
        let ptr = |v: &Vec<E>| v.as_ptr() as *mut c_void;
        [
            self.desc(ptr(&self.q), 0),
            self.desc(ptr(&self.k), 1),
            self.desc(ptr(&self.v), 2),
            self.desc(o, 3),
        ]
    }

    /// Runs `fa_backward_cpu` with `edit` applied to the descriptors first: the tensors are
    /// Q, K, V, O, dO, dQ, dK, dV.
    fn run(
        &mut self,
        edit: impl FnOnce(&mut FaProblem, &mut [FaTensor; 8], &mut *const f32, &mut FaOptions),
    ) -> i32 {
        let [q, k, v, o] = self.inputs();
        let d_o = self.desc(self.d_o.as_ptr() as *mut c_void, 3);
        let dq_ptr: *mut c_void = self.grads.dq.as_mut_ptr().cast();
        let dk_ptr: *mut c_void = self.grads.dk.as_mut_ptr().cast();
        let dv_ptr: *mut c_void = self.grads.dv.as_mut_ptr().cast();
        let (dq, dk, dv) = (
            self.desc(dq_ptr, 0),
            self.desc(dk_ptr, 1),
            self.desc(dv_ptr, 2),
        );
        let mut t = [q, k, v, o, d_o, dq, dk, dv];
        let mut problem = self.problem;
        let mut lse = self.lse.as_ptr();
        let mut opts = fa_options_default();
        opts.sinks = self.case.sinks.as_ref().map_or(null(), |s| s.as_ptr());
        edit(&mut problem, &mut t, &mut lse, &mut opts);
        let [q, k, v, o, d_o, dq, dk, dv] = t;
        // SAFETY: every pointer is a live local or a buffer of `self` of the right size (the
        // edits make pointers bad only in ways the library must refuse).
        unsafe { fa_backward_cpu(&problem, &q, &k, &v, &o, lse, &d_o, &dq, &dk, &dv, &opts) }
    }

    fn untouched(&self) -> bool {
        let g = &self.grads;
        g.dq.iter()
            .chain(&g.dk)
            .chain(&g.dv)
            .all(|x| x.f32() == SENTINEL)
    }

    /// Normwise errors of the gradients against the f64 reference on the same (rounded)
    /// inputs.
    fn errors(&self) -> Grads<f64> {
        let p = self.case.desc().validate(256).expect("valid");
        let to32 = |x: &[E]| x.iter().map(|v| v.f32()).collect::<Vec<f32>>();
        let (q, k, v) = (to32(&self.q), to32(&self.k), to32(&self.v));
        let reference = attention_backward_f64(&p, &q, &k, &v, &self.d_o_f32);
        let g = Grads::new(
            to32(&self.grads.dq),
            to32(&self.grads.dk),
            to32(&self.grads.dv),
        );
        compare_grads(&p, Grads::new(&g.dq[..], &g.dk[..], &g.dv[..]), &reference)
    }
}

fn cases(rng: &mut Rng, rounding: Rounding) -> Vec<(&'static str, Case)> {
    let mut round = |mut c: Case| {
        c.fill(rng, rounding);
        c
    };
    let mut fresh = Rng::fresh();
    let window = Mask {
        left: Some(6),
        right: Some(2),
    };
    vec![
        (
            "dense GQA causal",
            round(Case::dense(&mut fresh, 2, 37, 41, 4, 2, 24).causal()),
        ),
        (
            "dense MQA window softcap",
            round(
                Case::dense(&mut fresh, 1, 29, 29, 6, 1, 40)
                    .with_mask(window)
                    .with_softcap(2.5),
            ),
        ),
        (
            "dense scale, more queries than keys, causal",
            round(
                Case::dense(&mut fresh, 1, 45, 20, 2, 2, 16)
                    .causal()
                    .with_scale(0.2),
            ),
        ),
        (
            "varlen GQA causal",
            round(Case::varlen(&mut fresh, &[5, 1, 17], &[9, 3, 17], 4, 2, 32).causal()),
        ),
    ]
}

#[test]
fn f32_gradients_match_the_f64_reference_on_fresh_inputs() {
    let mut rng = Rng::fresh();
    for (what, case) in cases(&mut rng, Rounding::F32) {
        let mut b = Buffers::<f32>::new(case, &mut rng, Rounding::F32);
        let code = b.run(|_, _, _, _| {});
        assert_eq!(code, FA_OK, "{what}: {}", last_error());
        let e = b.errors();
        for (name, x) in [("dq", e.dq), ("dk", e.dk), ("dv", e.dv)] {
            assert!(x <= 1e-5, "{what}: {name} rel_l2 {x:e}");
        }
    }
}

#[test]
fn bf16_gradients_match_the_f64_reference_on_fresh_inputs() {
    let mut rng = Rng::fresh();
    for (what, case) in cases(&mut rng, Rounding::Bf16) {
        let mut b = Buffers::<bf16>::new(case, &mut rng, Rounding::Bf16);
        let code = b.run(|_, _, _, _| {});
        assert_eq!(code, FA_OK, "{what}: {}", last_error());
        let e = b.errors();
        for (name, x) in [("dq", e.dq), ("dk", e.dk), ("dv", e.dv)] {
            assert!(x <= 2e-2, "{what}: {name} rel_l2 {x:e}");
        }
    }
}

#[test]
fn the_gradients_are_the_same_bits_for_any_thread_count() {
    let mut rng = Rng::new(5);
    let case = Case::dense(&mut rng, 2, 19, 23, 4, 2, 16).causal();
    let mut b = Buffers::<f32>::new(case, &mut rng, Rounding::F32);
    assert_eq!(b.run(|_, _, _, _| {}), FA_OK, "{}", last_error());
    let first = b.grads.clone();
    // One thread against all cores: the same bits (the backward is deterministic).
    assert_eq!(b.run(|_, _, _, o| o.threads = 1), FA_OK);
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&first.dq), bits(&b.grads.dq));
    assert_eq!(bits(&first.dk), bits(&b.grads.dk));
    assert_eq!(bits(&first.dv), bits(&b.grads.dv));
}

/// A bad call: its code, a message containing `needle`, the gradients untouched.
fn refused(
    edit: impl FnOnce(&mut FaProblem, &mut [FaTensor; 8], &mut *const f32, &mut FaOptions),
    code: i32,
    needle: &str,
) {
    let mut rng = Rng::new(77);
    let case = Case::dense(&mut rng, 2, 9, 13, 4, 2, 16).causal();
    let mut b = Buffers::<f32>::new(case, &mut rng, Rounding::F32);
    let got = b.run(edit);
    let message = last_error();
    assert_eq!(
        got, code,
        "expected code {code} ({needle}), got {got}: {message}"
    );
    assert!(message.contains(needle), "{needle:?} not in {message:?}");
    assert!(
        b.untouched(),
        "gradients written by a refused call ({needle})"
    );
}

#[test]
fn bad_calls_get_their_code_and_leave_the_gradients_untouched() {
    let invalid = FA_ERR_INVALID_ARGUMENT;
    // A missing LSE.
    refused(
        |_, _, lse, _| *lse = null(),
        invalid,
        "lse is a null pointer",
    );
    // A misaligned LSE.
    refused(
        |_, _, lse, _| *lse = (*lse as usize + 2) as *const f32,
        invalid,
        "lse is misaligned",
    );
    // A null gradient.
    refused(
        |_, t, _, _| t[6].data = null_mut(),
        invalid,
        "dk is a null pointer",
    );
    // dO laid out otherwise than O.
    refused(
        |_, t, _, _| t[4].stride_seq += 16,
        invalid,
        "the backward takes d_o laid out as o",
    );
    // dQ laid out otherwise than Q.
    refused(
        |_, t, _, _| t[5].stride_head = 17,
        invalid,
        "dq laid out as q",
    );
    // A gradient that overlaps an input.
    refused(|_, t, _, _| t[7].data = t[2].data, invalid, "overlap");
    // Two gradients that overlap each other.
    refused(
        |_, t, _, _| t[6].data = t[7].data,
        invalid,
        "dk and dv overlap",
    );
    // Gradients of mixed dtypes (bf16 dV with f32 dQ/dK): the backend's dtype rule.
    refused(
        |_, t, _, _| t[7].dtype = FA_DTYPE_BF16,
        FA_ERR_UNSUPPORTED,
        "gradients in that dtype or f32",
    );
    // dO in another dtype than O.
    refused(
        |_, t, _, _| t[4].dtype = FA_DTYPE_BF16,
        FA_ERR_UNSUPPORTED,
        "O and dO in that dtype",
    );
    // An unknown dtype value.
    refused(|_, t, _, _| t[5].dtype = 9, invalid, "dq.dtype is 9");
    // A window side other than -1 or ≥ 0: the problem's own validation.
    refused(|p, _, _, _| p.window_left = -3, invalid, "window");
    // A negative size.
    refused(
        |p, _, _, _| p.heads_kv = -2,
        invalid,
        "problem.heads_kv is -2",
    );
    // GQA heads that do not divide.
    refused(|p, _, _, _| p.heads_kv = 3, invalid, "");
    // Device prefix sums on the CPU.
    refused(
        |p, _, _, _| p.seqlens = FA_SEQLENS_VARLEN_DEVICE,
        FA_ERR_UNSUPPORTED,
        "FA_SEQLENS_VARLEN_DEVICE",
    );
    // Options of a newer header.
    refused(
        |_, _, _, o| o.version = FA_API_VERSION + 1,
        FA_ERR_VERSION,
        "options.version",
    );
    // A null descriptor.
    let mut rng = Rng::new(78);
    let case = Case::dense(&mut rng, 1, 4, 4, 1, 1, 8);
    let mut b = Buffers::<f32>::new(case, &mut rng, Rounding::F32);
    let [q, k, v, o] = b.inputs();
    let lse = b.lse.as_ptr();
    // SAFETY: live descriptors; the null `d_o` must be refused before anything is read.
    let code =
        unsafe { fa_backward_cpu(&b.problem, &q, &k, &v, &o, lse, null(), &q, &k, &v, null()) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("d_o is a null pointer"),
        "{}",
        last_error()
    );
}

#[test]
fn the_api_version_names_the_backward() {
    assert!(fa_api_version() >= 6);
}

/// Attention sinks through `options.sinks` (API version 8): the forward and the backward of
/// fresh inputs with random sinks against the f64 reference (dQ, dK, dV and `options.d_sinks`);
/// `d_sinks` without `sinks`, on a forward, or overlapping a gradient is refused, and a NaN
/// sink is `FA_ERR_INVALID_ARGUMENT`, with everything untouched.
#[test]
fn sinks_and_their_gradient_match_the_f64_reference() {
    use fa_reference::{attention_backward_sinks_f64, compare_sink_grads};
    let mut rng = Rng::fresh();
    for (what, case) in cases(&mut rng, Rounding::F32) {
        let case = case.with_random_sinks(&mut rng);
        let heads = case.heads_q;
        let mut b = Buffers::<f32>::new(case, &mut rng, Rounding::F32);
        let mut d_sinks = vec![SENTINEL; heads];
        let out = d_sinks.as_mut_ptr();
        let code = b.run(|_, _, _, o| o.d_sinks = out);
        assert_eq!(code, FA_OK, "{what}: {}", last_error());
        let e = b.errors();
        for (name, x) in [("dq", e.dq), ("dk", e.dk), ("dv", e.dv)] {
            assert!(x <= 1e-5, "{what}: {name} rel_l2 {x:e}");
        }
        let p = b.case.desc().validate(256).expect("valid");
        let (_, reference) = attention_backward_sinks_f64(&p, &b.q, &b.k, &b.v, &b.d_o_f32);
        let err = compare_sink_grads(&d_sinks, &reference.expect("sinks"));
        assert!(err <= 1e-4, "{what}: d sinks {d_sinks:?} ({err:e})");
    }
    let case = Case::dense(&mut rng, 1, 9, 11, 4, 2, 16).with_random_sinks(&mut rng);
    let mut b = Buffers::<f32>::new(case, &mut rng, Rounding::F32);
    b.grads.dq.fill(SENTINEL);
    b.grads.dk.fill(SENTINEL);
    b.grads.dv.fill(SENTINEL);
    let mut d_sinks = [SENTINEL; 4];
    let out = d_sinks.as_mut_ptr();
    // d_sinks without sinks.
    let code = b.run(|_, _, _, o| {
        o.sinks = null();
        o.d_sinks = out;
    });
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT, "{}", last_error());
    // d_sinks over dQ.
    let dq = b.grads.dq.as_mut_ptr();
    let code = b.run(|_, _, _, o| o.d_sinks = dq);
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT, "{}", last_error());
    assert!(last_error().contains("overlap"), "{}", last_error());
    // A NaN sink.
    let bad = [0.0f32, f32::NAN, 0.0, 0.0];
    let code = b.run(|_, _, _, o| {
        o.sinks = bad.as_ptr();
        o.d_sinks = out;
    });
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT, "{}", last_error());
    assert!(last_error().contains("sinks[1]"), "{}", last_error());
    assert!(b.untouched());
    assert_eq!(d_sinks, [SENTINEL; 4]);
    // d_sinks on a forward.
    let [q, k, v, o] = b.inputs();
    let mut opts = fa_options_default();
    opts.sinks = b.case.sinks.as_ref().map_or(null(), |s| s.as_ptr());
    opts.d_sinks = out;
    let before = b.o.clone();
    // SAFETY: live buffers of the problem's sizes; the call is refused before any write.
    let code = unsafe { fa_forward_cpu(&b.problem, &q, &k, &v, &o, null_mut(), &opts) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT, "{}", last_error());
    assert_eq!(b.o, before);
    assert_eq!(d_sinks, [SENTINEL; 4]);
}
