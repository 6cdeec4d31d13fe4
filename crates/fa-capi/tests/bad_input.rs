//! `fa_forward_cpu` (and `fa_forward_cuda`'s host-side checks) called from Rust as C would:
//! good calls match flash-attention bitwise; bad ones get their code and message, and the
//! outputs stay untouched.

mod common;

use common::*;
use core::ffi::c_void;
use core::ptr::{null, null_mut};
use fa_reference::{Case, Rng};
use flash_attention::{Backend, Options, Out, Qkv, TensorMut, TensorRef};
use flash_attention_rs::*;
use half::bf16;

const SENTINEL: f32 = 7.0;

/// One f32 call: a causal GQA case, its descriptors, and sentinel-filled outputs.
struct Call {
    case: Case,
    problem: FaProblem,
    o: Vec<f32>,
    lse: Vec<f32>,
}

impl Call {
    fn new() -> Call {
        let mut rng = Rng::new(14);
        let case = Case::dense(&mut rng, 2, 9, 13, 4, 2, 16).causal();
        let mut problem = FaProblem::dense(2, 9, 13, 4, 2, 16);
        problem.causal = 1;
        Call {
            case,
            problem,
            o: vec![SENTINEL; 2 * 9 * 4 * 16],
            lse: vec![SENTINEL; 2 * 4 * 9],
        }
    }

    fn tensors(&mut self) -> [FaTensor; 4] {
        let ptr = |v: &Vec<f32>| v.as_ptr() as *mut c_void;
        [
            bshd(ptr(&self.case.q), FA_DTYPE_F32, 9, 4, 16),
            bshd(ptr(&self.case.k), FA_DTYPE_F32, 13, 2, 16),
            bshd(ptr(&self.case.v), FA_DTYPE_F32, 13, 2, 16),
            bshd(self.o.as_mut_ptr().cast(), FA_DTYPE_F32, 9, 4, 16),
        ]
    }

    /// Runs with `edit` applied to the descriptors first.
    fn run(
        &mut self,
        edit: impl FnOnce(&mut FaProblem, &mut [FaTensor; 4], &mut FaOptions),
    ) -> i32 {
        let mut t = self.tensors();
        let mut problem = self.problem;
        let mut opts = fa_options_default();
        edit(&mut problem, &mut t, &mut opts);
        // SAFETY: every pointer is a live local or a buffer of `self` of the right size
        // (the edits make pointers bad only in ways the library must refuse).
        unsafe {
            fa_forward_cpu(
                &problem,
                &t[0],
                &t[1],
                &t[2],
                &t[3],
                self.lse.as_mut_ptr(),
                &opts,
            )
        }
    }

    fn untouched(&self) -> bool {
        self.o.iter().chain(&self.lse).all(|&x| x == SENTINEL)
    }
}

/// Asserts a refusal: the code, a message containing `words`, outputs untouched.
#[track_caller]
fn refused(
    code: i32,
    words: &str,
    edit: impl FnOnce(&mut FaProblem, &mut [FaTensor; 4], &mut FaOptions),
) {
    let mut call = Call::new();
    let got = call.run(edit);
    assert_refused(got, code, words, call.untouched());
}

#[test]
fn a_good_call_matches_flash_attention_bitwise() {
    let mut call = Call::new();
    assert_eq!(call.run(|_, _, _| {}), FA_OK, "{}", last_error());
    assert_eq!(last_error(), "");
    let problem = call.case.desc().validate(256).expect("valid");
    let mut o = vec![0.0f32; call.o.len()];
    let mut lse = vec![0.0f32; call.lse.len()];
    Backend::cpu()
        .forward(
            &problem,
            Qkv::new(
                TensorRef::from(&call.case.q),
                TensorRef::from(&call.case.k),
                TensorRef::from(&call.case.v),
            ),
            Out::with_lse(TensorMut::from(&mut o), &mut lse[..]),
            &Options::default(),
        )
        .expect("runs");
    assert_eq!(o, call.o);
    assert_eq!(lse, call.lse);
}

#[test]
fn null_pointers_are_refused() {
    let mut call = Call::new();
    let t = call.tensors();
    // SAFETY: null descriptors are refused before anything is read.
    let code = unsafe { fa_forward_cpu(null(), &t[0], &t[1], &t[2], &t[3], null_mut(), null()) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("problem is a null pointer"));
    // SAFETY: as above.
    let code = unsafe {
        fa_forward_cpu(
            &call.problem,
            &t[0],
            &t[1],
            null(),
            &t[3],
            null_mut(),
            null(),
        )
    };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("v is a null pointer"));
    assert!(call.untouched());
    refused(FA_ERR_INVALID_ARGUMENT, "k is a null pointer", |_, t, _| {
        t[1].data = null_mut()
    });
    refused(FA_ERR_INVALID_ARGUMENT, "o is a null pointer", |_, t, _| {
        t[3].data = null_mut()
    });
    let mut problem = FaProblem::dense(1, 2, 2, 1, 1, 8);
    problem.seqlens = FA_SEQLENS_VARLEN_HOST;
    let cu = [0i32, 2];
    problem.cu_seqlens_q = cu.as_ptr();
    refused(
        FA_ERR_INVALID_ARGUMENT,
        "cu_seqlens_k is a null pointer",
        |p, _, _| *p = problem,
    );
}

#[test]
fn empty_tensors_may_be_null() {
    let p = FaProblem::dense(1, 0, 5, 2, 2, 8);
    let k = vec![0.5f32; 5 * 2 * 8];
    let tq = bshd(null_mut(), FA_DTYPE_F32, 0, 2, 8);
    let tk = bshd(k.as_ptr() as *mut c_void, FA_DTYPE_F32, 5, 2, 8);
    // SAFETY: the empty tensors are never read; K and V hold 80 elements.
    let code = unsafe { fa_forward_cpu(&p, &tq, &tk, &tk, &tq, null_mut(), null()) };
    assert_eq!(code, FA_OK, "{}", last_error());
}

#[test]
fn misaligned_pointers_are_refused() {
    refused(FA_ERR_INVALID_ARGUMENT, "q is misaligned", |_, t, _| {
        t[0].data = t[0].data.cast::<u8>().wrapping_add(1).cast()
    });
    let mut call = Call::new();
    let mut t = call.tensors();
    let lse = call
        .lse
        .as_mut_ptr()
        .cast::<u8>()
        .wrapping_add(2)
        .cast::<f32>();
    t[0].dtype = FA_DTYPE_F32;
    // SAFETY: the misaligned LSE is refused before anything is written.
    let code = unsafe { fa_forward_cpu(&call.problem, &t[0], &t[1], &t[2], &t[3], lse, null()) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("lse is misaligned"));
    assert!(call.untouched());
    // A misaligned descriptor itself.
    let bytes = [0u8; 2 * core::mem::size_of::<FaTensor>()];
    let odd = bytes.as_ptr().wrapping_add(1).cast::<FaTensor>();
    // SAFETY: refused before it is read.
    let code =
        unsafe { fa_forward_cpu(&call.problem, odd, &t[1], &t[2], &t[3], null_mut(), null()) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("q is misaligned"));
}

#[test]
fn negative_and_overflowing_sizes_and_strides_are_refused() {
    refused(
        FA_ERR_INVALID_ARGUMENT,
        "problem.seqlen_q is -1",
        |p, _, _| p.seqlen_q = -1,
    );
    refused(FA_ERR_INVALID_ARGUMENT, "k.stride_seq is -32", |_, t, _| {
        t[1].stride_seq = -32
    });
    refused(FA_ERR_INVALID_ARGUMENT, "overflow", |_, t, _| {
        t[1].stride_batch = i64::MAX
    });
    refused(FA_ERR_INVALID_ARGUMENT, "overflow", |p, _, _| {
        p.batch = i64::MAX;
        p.seqlen_q = i64::MAX;
    });
    // Strides within usize whose extent passes the end of the address space.
    refused(FA_ERR_INVALID_ARGUMENT, "address space", |_, t, _| {
        t[2].stride_batch = (isize::MAX / 4) as i64
    });
    // Output rows that overlap each other (a head stride smaller than the head).
    refused(FA_ERR_INVALID_ARGUMENT, "o", |_, t, _| t[3].stride_head = 8);
    refused(FA_ERR_INVALID_ARGUMENT, "heads", |p, _, _| p.heads_kv = 3);
    refused(FA_ERR_INVALID_ARGUMENT, "head_dim", |p, _, _| {
        p.head_dim = 100_000
    });
    refused(FA_ERR_INVALID_ARGUMENT, "scale", |p, _, _| {
        p.softmax_scale = f32::NAN
    });
    refused(FA_ERR_INVALID_ARGUMENT, "softcap", |p, _, _| {
        p.softcap = -1.0
    });
    refused(FA_ERR_INVALID_ARGUMENT, "softcap", |p, _, _| {
        p.softcap = f32::INFINITY
    });
    refused(
        FA_ERR_INVALID_ARGUMENT,
        "problem.seqlens is 9",
        |p, _, _| p.seqlens = 9,
    );
}

/// A window side is -1 (unbounded) or a number of keys ≥ 0: any other negative is refused
/// with the problem's own message (the one `fa --window` and Python give). Fails before the
/// shared conversion: -5 ran as unbounded.
#[test]
fn window_sides_other_than_minus_one_are_refused() {
    refused(FA_ERR_INVALID_ARGUMENT, "window left = -5", |p, _, _| {
        p.window_left = -5
    });
    refused(FA_ERR_INVALID_ARGUMENT, "-1 for unbounded", |p, _, _| {
        p.window_right = i64::MIN
    });
    // -1 on both sides is no window (causal stays): the good call's result.
    let mut call = Call::new();
    assert_eq!(call.run(|_, _, _| {}), FA_OK, "{}", last_error());
    let want = (call.o.clone(), call.lse.clone());
    let mut call = Call::new();
    let got = call.run(|p, _, _| {
        p.window_left = -1;
        p.window_right = -1;
        p.softcap = 0.0;
    });
    assert_eq!(got, FA_OK, "{}", last_error());
    assert_eq!((call.o, call.lse), want);
}

#[test]
fn outputs_that_overlap_inputs_are_refused() {
    refused(FA_ERR_INVALID_ARGUMENT, "q and o overlap", |_, t, _| {
        t[3].data = t[0].data
    });
    // Inputs may share memory (Q = K here, with K's shape inside Q's buffer).
    let mut call = Call::new();
    assert_eq!(
        call.run(|_, t, _| t[2].data = t[1].data),
        FA_OK,
        "{}",
        last_error()
    );
}

#[test]
fn wrong_dtype_combinations_are_refused() {
    refused(FA_ERR_UNSUPPORTED, "share one dtype", |_, t, _| {
        t[1].dtype = FA_DTYPE_BF16
    });
    refused(FA_ERR_UNSUPPORTED, "same dtype or f32", |_, t, _| {
        t[3].dtype = FA_DTYPE_F16
    });
    refused(FA_ERR_INVALID_ARGUMENT, "v.dtype is 3", |_, t, _| {
        t[2].dtype = 3
    });
}

#[test]
fn bf16_inputs_with_an_f32_output_run() {
    let mut call = Call::new();
    let q: Vec<bf16> = call.case.q.iter().map(|&x| bf16::from_f32(x)).collect();
    let k: Vec<bf16> = call.case.k.iter().map(|&x| bf16::from_f32(x)).collect();
    let v: Vec<bf16> = call.case.v.iter().map(|&x| bf16::from_f32(x)).collect();
    let code = call.run(|_, t, _| {
        for (t, b) in t.iter_mut().zip([&q, &k, &v]) {
            t.data = b.as_ptr() as *mut c_void;
            t.dtype = FA_DTYPE_BF16;
        }
    });
    assert_eq!(code, FA_OK, "{}", last_error());
    assert!(call.o.iter().all(|x| x.is_finite() && *x != SENTINEL));
}

#[test]
fn options_of_bad_sizes_and_values_are_refused() {
    refused(FA_ERR_VERSION, "newer header", |_, _, o| o.size += 4);
    refused(FA_ERR_INVALID_ARGUMENT, "too small", |_, _, o| o.size = 0);
    refused(FA_ERR_VERSION, "API version", |_, _, o| {
        o.version = FA_API_VERSION + 1
    });
    refused(FA_ERR_INVALID_ARGUMENT, "options.exp2 is 5", |_, _, o| {
        o.exp2 = 5
    });
    // An older, smaller layout (size and version only) is read with default threads/exp2.
    let mut call = Call::new();
    assert_eq!(call.run(|_, _, o| o.size = 8), FA_OK, "{}", last_error());
}

#[test]
fn host_prefix_sums_are_checked_and_run() {
    let mut rng = Rng::new(3);
    let case = Case::varlen(&mut rng, &[3, 0, 5], &[4, 2, 6], 2, 1, 8).causal();
    let cu_q: Vec<i32> = case.cu_seqlens_q.iter().map(|&x| x as i32).collect();
    let cu_k: Vec<i32> = case.cu_seqlens_k.iter().map(|&x| x as i32).collect();
    let mut p = FaProblem::dense(3, 0, 0, 2, 1, 8);
    p.seqlens = FA_SEQLENS_VARLEN_HOST;
    p.causal = 1;
    p.cu_seqlens_q = cu_q.as_ptr();
    p.cu_seqlens_k = cu_k.as_ptr();
    let mut o = vec![SENTINEL; 8 * 2 * 8];
    let mut lse = vec![SENTINEL; 2 * 8];
    let ptr = |v: &Vec<f32>| v.as_ptr() as *mut c_void;
    let tq = bshd(ptr(&case.q), FA_DTYPE_F32, 8, 2, 8);
    let tk = bshd(ptr(&case.k), FA_DTYPE_F32, 12, 1, 8);
    let tv = bshd(ptr(&case.v), FA_DTYPE_F32, 12, 1, 8);
    let to = bshd(o.as_mut_ptr().cast(), FA_DTYPE_F32, 8, 2, 8);
    // SAFETY: buffers sized for the packed problem; prefix sums of 4 entries.
    let code = unsafe { fa_forward_cpu(&p, &tq, &tk, &tv, &to, lse.as_mut_ptr(), null()) };
    assert_eq!(code, FA_OK, "{}", last_error());
    let problem = case.desc().validate(256).expect("valid");
    let oracle = fa_reference::attention_f64(&problem, &case.q, &case.k, &case.v);
    let report = fa_reference::compare(&problem, &o, Some(&lse), &oracle);
    assert!(report.within(1e-5, 1e-5), "{report:?}");

    // A negative prefix sum, non-monotone sums, device sums on the CPU.
    let bad = [0i32, 3, -1, 8];
    let mut q = p;
    q.cu_seqlens_q = bad.as_ptr();
    o.fill(SENTINEL);
    // SAFETY: as above.
    let code = unsafe { fa_forward_cpu(&q, &tq, &tk, &tv, &to, null_mut(), null()) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("cu_seqlens_q[2] is -1"),
        "{}",
        last_error()
    );
    let down = [0i32, 5, 3, 8];
    q.cu_seqlens_q = down.as_ptr();
    // SAFETY: as above.
    let code = unsafe { fa_forward_cpu(&q, &tq, &tk, &tv, &to, null_mut(), null()) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT, "{}", last_error());
    q.seqlens = FA_SEQLENS_VARLEN_DEVICE;
    // SAFETY: refused before the (host) addresses would be used as device ones.
    let code = unsafe { fa_forward_cpu(&q, &tq, &tk, &tv, &to, null_mut(), null()) };
    assert_eq!(code, FA_ERR_UNSUPPORTED);
    assert!(o.iter().all(|&x| x == SENTINEL));
}

#[test]
fn version_strings_and_defaults() {
    // SAFETY: a static NUL-terminated string.
    let v = unsafe { std::ffi::CStr::from_ptr(fa_version()) };
    assert_eq!(v.to_str(), Ok(env!("CARGO_PKG_VERSION")));
    assert_eq!(fa_api_version(), FA_API_VERSION);
    let o = fa_options_default();
    assert_eq!(o.size as usize, core::mem::size_of::<FaOptions>());
    assert_eq!(
        (o.version, o.threads, o.exp2),
        (FA_API_VERSION, 0, FA_EXP2_AUTO)
    );
}
