//! GPU tests of the sm80 backward against the f64 reference backward
//! (`fa_reference::attention_backward_f64`) on fresh random inputs (N(0,1), never zeros)
//! rounded to bf16/fp16: odd lengths (1, 17, 129, `seqlen_q ≠ seqlen_k` both ways), causal
//! (with rows that see no key), sliding windows, softcap, GQA and MQA, head dims 64, 96, 128
//! and 256, varlen with an empty sequence, padded strides. The forward's O (rounded to the
//! dtype) and LSE come from the f64 reference, so the backward's own error is measured (one
//! test chains the GPU forward). Gradients are poisoned (NaN) before each run.
//!
//! Bound: normwise ‖g − ref‖/‖ref‖ ≤ 2e-2 for each of dQ, dK and dV (the bound for
//! 16-bit gradients; fa-cpu's AMX backward holds bf16 gradients to the same): P and dS are
//! rounded to the dtype before the products, as FlashAttention-2 does, and the gradients are
//! written in the dtype.
//!
//! Bad input (short dO/dK/LSE, missing LSE, misaligned pointers, a short or misaligned
//! workspace, a plan of another dtype, the unimplemented deterministic mode) gets a typed
//! error with the gradients untouched. Ignored by default: they need a CUDA GPU.

#[allow(dead_code)] // the helpers of the other GPU test files too
mod common;
use common::{device, raw};
use cudarc::driver::{CudaSlice, CudaStream};
use fa_cuda::{
    BackwardInputs, BackwardOptions, BackwardTensors, CudaElement, CudaError, DType, Device,
    ForwardOptions, RawTensor,
};
use fa_reference::{
    attention_backward_f64, attention_f64, compare_grads, poison, Case, Element, Rng, Rounding,
};
use half::{bf16, f16};
use softmax_core::{Grads, Mask, Out, Problem, ProblemError, Qkv, Tensor};
use std::sync::Arc;

/// Normwise bound of each gradient against the f64 reference.
const GRAD_BOUND: f64 = 2e-2;

/// The rounding of a 16-bit element type.
fn rounding_of<T: CudaElement>() -> Rounding {
    match T::DTYPE {
        DType::Bf16 => Rounding::Bf16,
        _ => Rounding::F16,
    }
}

/// A case's tensors in `T` with the forward's O (rounded) and LSE from the f64 reference, a
/// fresh dO and the reference gradients.
struct Prepared<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    o: Vec<T>,
    d_o: Vec<T>,
    lse: Vec<f32>,
    reference: Grads<Vec<f64>>,
}

fn prepare<T: CudaElement + Element>(problem: &Problem, case: &Case, rng: &mut Rng) -> Prepared<T> {
    let lens = problem.min_buffer_lens();
    let r = rounding_of::<T>();
    let d_o32: Vec<f32> = (0..lens.o).map(|_| r.apply(rng.normal() as f32)).collect();
    let fwd = attention_f64(problem, &case.q, &case.k, &case.v);
    let reference = attention_backward_f64(problem, &case.q, &case.k, &case.v, &d_o32);
    let to_t = |x: &[f32]| x.iter().map(|&v| T::from_f64(v as f64)).collect::<Vec<T>>();
    Prepared {
        q: to_t(&case.q),
        k: to_t(&case.k),
        v: to_t(&case.v),
        o: fwd.out.iter().map(|&x| T::from_f64(x)).collect(),
        d_o: to_t(&d_o32),
        lse: fwd.lse.iter().map(|&x| x as f32).collect(),
        reference,
    }
}

/// Poisoned gradient buffers of the problem's sizes.
fn poisoned<T: Element>(problem: &Problem) -> Grads<Vec<T>> {
    let lens = problem.min_buffer_lens();
    let mut g = Grads::new(
        vec![T::from_f64(0.0); lens.q],
        vec![T::from_f64(0.0); lens.k],
        vec![T::from_f64(0.0); lens.v],
    );
    poison(&mut g.dq);
    poison(&mut g.dk);
    poison(&mut g.dv);
    g
}

/// Runs `case` (inputs already rounded to `T`) through `Device::backward_host` and checks
/// each gradient against the reference; returns the worst normwise error.
fn check_case<T: CudaElement + Element>(label: &str, case: &Case, rng: &mut Rng) -> f64 {
    check_case_with::<T>(label, case, rng, &BackwardOptions::default())
}

/// [`check_case`] with options (tile overrides).
fn check_case_with<T: CudaElement + Element>(
    label: &str,
    case: &Case,
    rng: &mut Rng,
    opts: &BackwardOptions,
) -> f64 {
    let problem = case.desc().validate(256).expect("valid case");
    let p = prepare::<T>(&problem, case, rng);
    let mut g = poisoned::<T>(&problem);
    let stats = device()
        .backward_host(
            &problem,
            Qkv::new(&p.q[..], &p.k[..], &p.v[..]),
            BackwardInputs {
                o: &p.o[..],
                d_o: &p.d_o[..],
                lse: &p.lse[..],
            },
            Grads::new(&mut g.dq[..], &mut g.dk[..], &mut g.dv[..]),
            opts,
        )
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    let e = compare_grads(
        &problem,
        Grads::new(&g.dq[..], &g.dk[..], &g.dv[..]),
        &p.reference,
    );
    let name = stats.launch.map(|l| l.variant.name()).unwrap_or_default();
    println!(
        "{label:<44} {:<5} dq {:.2e} dk {:.2e} dv {:.2e}  {name} ({} regs)",
        T::DTYPE.name(),
        e.dq,
        e.dk,
        e.dv,
        stats.registers.unwrap_or(0)
    );
    for (what, x) in [("dq", e.dq), ("dk", e.dk), ("dv", e.dv)] {
        assert!(
            x <= GRAD_BOUND,
            "{label} {}: {what} normwise error {x:e} (bound {GRAD_BOUND:e}; NaN: a gradient not written)",
            T::DTYPE.name()
        );
    }
    e.dq.max(e.dk).max(e.dv)
}

/// Shapes × masks × dtypes: every case for bf16 and for fp16.
fn shape_cases(rng: &mut Rng, r: Rounding) -> Vec<(String, Case)> {
    let mut out = Vec::new();
    for &(b, sq, sk, hq, hkv, d) in &[
        (1, 1, 1, 1, 1, 64),
        (1, 1, 17, 2, 1, 64),
        (2, 17, 17, 2, 2, 64),
        (1, 129, 129, 4, 4, 64),
        (2, 129, 300, 4, 1, 128),
        (1, 300, 129, 8, 2, 128),
        (1, 17, 200, 2, 2, 96),
        (1, 130, 77, 2, 1, 256),
        (1, 200, 333, 2, 2, 256),
    ] {
        let base = Case::dense(rng, b, sq, sk, hq, hkv, d).round(r);
        let name = format!("{b}x{sq}x{sk} h{hq}/{hkv} d{d}");
        out.push((name.clone(), base.clone()));
        out.push((format!("{name} causal"), base.clone().causal()));
        if sq > 1 {
            out.push((
                format!("{name} window(20,5)"),
                base.clone().with_mask(Mask::from_flash_args(false, 20, 5)),
            ));
            out.push((format!("{name} softcap 5"), base.causal().with_softcap(5.0)));
        }
    }
    out
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gradients_match_the_reference_bf16() {
    let mut rng = Rng::fresh();
    let mut worst = 0.0f64;
    for (label, case) in shape_cases(&mut rng, Rounding::Bf16) {
        worst = worst.max(check_case::<bf16>(&label, &case, &mut rng));
    }
    println!("bf16: worst normwise gradient error {worst:.2e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gradients_match_the_reference_f16() {
    let mut rng = Rng::fresh();
    let mut worst = 0.0f64;
    for (label, case) in shape_cases(&mut rng, Rounding::F16) {
        worst = worst.max(check_case::<f16>(&label, &case, &mut rng));
    }
    println!("f16: worst normwise gradient error {worst:.2e}");
}

/// Larger problems (several key blocks per CTA row, many query blocks, dQ sums from many
/// CTAs), varlen with an empty key sequence, padded strides, head dims that are not a
/// multiple of 64, `head_dim_v ≠ head_dim`, a scale of its own.
#[test]
#[ignore = "needs a CUDA GPU"]
fn larger_varlen_and_strided_problems() {
    let mut rng = Rng::fresh();
    let b = Rounding::Bf16;
    let big = Case::dense(&mut rng, 2, 520, 520, 4, 2, 128).round(b);
    check_case::<bf16>(
        "2x520x520 h4/2 d128 causal",
        &big.clone().causal(),
        &mut rng,
    );
    check_case::<bf16>(
        "2x520x520 h4/2 d128 window(100,0)",
        &big.with_mask(Mask::from_flash_args(false, 100, 0)),
        &mut rng,
    );
    let long = Case::dense(&mut rng, 1, 700, 1100, 2, 1, 64).round(Rounding::F16);
    check_case::<f16>("1x700x1100 h2/1 d64", &long, &mut rng);
    check_case::<f16>("1x700x1100 h2/1 d64 causal", &long.causal(), &mut rng);
    let varlen = Case::varlen(
        &mut rng,
        &[0, 1, 17, 300, 129],
        &[3, 1, 0, 280, 129],
        4,
        2,
        64,
    )
    .round(b);
    check_case::<bf16>("varlen h4/2 d64", &varlen, &mut rng);
    check_case::<bf16>("varlen h4/2 d64 causal", &varlen.causal(), &mut rng);
    let padded = Case::dense(&mut rng, 2, 77, 130, 4, 2, 64).padded(&mut rng, 8, b);
    check_case::<bf16>(
        "2x77x130 h4/2 d64 padded strides",
        &padded.causal(),
        &mut rng,
    );
    let mut dv = Case::dense(&mut rng, 1, 90, 150, 2, 2, 64);
    dv.head_dim_v = 128;
    dv.fill(&mut rng, b);
    check_case::<bf16>("1x90x150 d64 dv128 causal", &dv.causal(), &mut rng);
    let scaled = Case::dense(&mut rng, 1, 100, 100, 2, 2, 40)
        .round(b)
        .with_scale(0.3);
    check_case::<bf16>("1x100x100 d40 scale 0.3", &scaled, &mut rng);
}

/// The GPU forward's O and LSE feed the backward (the training step's chain).
#[test]
#[ignore = "needs a CUDA GPU"]
fn forward_then_backward_on_the_gpu() {
    let mut rng = Rng::fresh();
    let case = Case::dense(&mut rng, 2, 257, 300, 8, 2, 128)
        .causal()
        .round(Rounding::Bf16);
    let problem = case.desc().validate(256).expect("valid");
    let p = prepare::<bf16>(&problem, &case, &mut rng);
    let lens = problem.min_buffer_lens();
    let mut o = vec![bf16::ZERO; lens.o];
    let mut lse = vec![0.0f32; problem.lse_len()];
    device()
        .forward_host(
            &problem,
            Qkv::new(&p.q[..], &p.k[..], &p.v[..]),
            Out::with_lse(&mut o[..], &mut lse[..]),
            &ForwardOptions::default(),
        )
        .expect("forward");
    let mut g = poisoned::<bf16>(&problem);
    device()
        .backward_host(
            &problem,
            Qkv::new(&p.q[..], &p.k[..], &p.v[..]),
            BackwardInputs {
                o: &o[..],
                d_o: &p.d_o[..],
                lse: &lse[..],
            },
            Grads::new(&mut g.dq[..], &mut g.dk[..], &mut g.dv[..]),
            &BackwardOptions::default(),
        )
        .expect("backward");
    let e = compare_grads(
        &problem,
        Grads::new(&g.dq[..], &g.dk[..], &g.dv[..]),
        &p.reference,
    );
    println!(
        "forward → backward: dq {:.2e} dk {:.2e} dv {:.2e}",
        e.dq, e.dk, e.dv
    );
    assert!(e.dq.max(e.dk).max(e.dv) <= GRAD_BOUND, "{e:?}");
}

/// Caller memory on a stream of the caller: the plan → workspace → run entry, a second run
/// with the same plan and workspace giving the same dK and dV bits (they are summed in a
/// fixed order; dQ's atomics are not), and every bad input rejected with the gradients
/// untouched.
#[test]
#[ignore = "needs a CUDA GPU"]
fn plan_workspace_run_on_caller_memory() {
    let dev = device();
    let stream = dev.context().new_stream().expect("a stream");
    let mut rng = Rng::fresh();
    let case = Case::dense(&mut rng, 2, 190, 257, 8, 2, 64)
        .causal()
        .round(Rounding::Bf16);
    let problem = case.desc().validate(256).expect("valid");
    let p = prepare::<bf16>(&problem, &case, &mut rng);
    let up = |x: &[bf16]| -> CudaSlice<u16> {
        stream
            .clone_htod(&x.iter().map(|v| v.to_bits()).collect::<Vec<u16>>())
            .expect("upload")
    };
    let (q, k, v, o, d_o) = (up(&p.q), up(&p.k), up(&p.v), up(&p.o), up(&p.d_o));
    let lse = stream.clone_htod(&p.lse).expect("upload");
    let sentinel = bf16::from_f32(7.0);
    let lens = problem.min_buffer_lens();
    let (dq, dk, dv) = (
        up(&vec![sentinel; lens.q]),
        up(&vec![sentinel; lens.k]),
        up(&vec![sentinel; lens.v]),
    );
    let plan = dev
        .plan_backward(&problem, DType::Bf16, &BackwardOptions::default())
        .expect("plan");
    let ws_len = plan.workspace_bytes() + 512;
    let ws = stream.alloc_zeros::<u8>(ws_len).expect("workspace");
    let good = BackwardTensors::<bf16> {
        qkv: Qkv::new(raw(&q, &stream), raw(&k, &stream), raw(&v, &stream)),
        o: raw(&o, &stream),
        d_o: raw(&d_o, &stream),
        lse: Some(raw(&lse, &stream)),
        grads: Grads::new(raw(&dq, &stream), raw(&dk, &stream), raw(&dv, &stream)),
        cu_seqlens: None,
    };
    let ws_raw: RawTensor<u8> = raw(&ws, &stream);
    let shrink = |t: RawTensor<bf16>, by: usize| {
        // SAFETY: a shorter view of the same allocation (rejected before any launch).
        unsafe { RawTensor::<bf16>::from_raw(t.ptr(), t.len() - by) }
    };
    let shift = |t: RawTensor<bf16>| {
        // SAFETY: a misaligned view of the same length (rejected before any launch, so the
        // element past the allocation is never touched).
        unsafe { RawTensor::<bf16>::from_raw(t.ptr() + 2, t.len()) }
    };
    let expect_err = |tensors: BackwardTensors<bf16>, ws: RawTensor<u8>, what: &str| {
        let e = dev
            .backward_on_stream(&plan, tensors, ws, &stream)
            .expect_err(what);
        println!("{what}: {e}");
        e
    };
    let mut bad = good;
    bad.d_o = shrink(good.d_o, 1);
    assert!(matches!(
        expect_err(bad, ws_raw, "short dO"),
        CudaError::Problem(ProblemError::BufferTooSmall {
            tensor: Tensor::O,
            ..
        })
    ));
    let mut bad = good;
    bad.grads.dk = shrink(good.grads.dk, 8);
    assert!(matches!(
        expect_err(bad, ws_raw, "short dK"),
        CudaError::Problem(ProblemError::BufferTooSmall {
            tensor: Tensor::K,
            ..
        })
    ));
    let mut bad = good;
    bad.lse = None;
    assert!(matches!(
        expect_err(bad, ws_raw, "missing LSE"),
        CudaError::Problem(ProblemError::Unsupported { .. })
    ));
    let mut bad = good;
    // SAFETY: a shorter view of the LSE (rejected before any launch).
    bad.lse = Some(unsafe { RawTensor::from_raw(lse_ptr(&good), problem.lse_len() - 1) });
    assert!(matches!(
        expect_err(bad, ws_raw, "short LSE"),
        CudaError::Problem(ProblemError::BufferTooSmall {
            tensor: Tensor::Lse,
            ..
        })
    ));
    let mut bad = good;
    bad.d_o = shift(good.d_o);
    assert!(matches!(
        expect_err(bad, ws_raw, "misaligned dO"),
        CudaError::Misaligned {
            tensor: Tensor::O,
            ..
        }
    ));
    let mut bad = good;
    bad.grads.dq = shift(good.grads.dq);
    assert!(matches!(
        expect_err(bad, ws_raw, "misaligned dQ"),
        CudaError::Misaligned {
            tensor: Tensor::Q,
            ..
        }
    ));
    // SAFETY: views of the workspace allocation (rejected before any launch).
    let short_ws = unsafe { RawTensor::<u8>::from_raw(ws_raw.ptr(), plan.workspace_bytes() - 1) };
    assert!(matches!(
        expect_err(good, short_ws, "short workspace"),
        CudaError::WorkspaceTooSmall { .. }
    ));
    // SAFETY: as above.
    let odd_ws = unsafe { RawTensor::<u8>::from_raw(ws_raw.ptr() + 16, ws_len - 16) };
    assert!(matches!(
        expect_err(good, odd_ws, "misaligned workspace"),
        CudaError::BadWorkspace { .. }
    ));
    let f16_plan = dev
        .plan_backward(&problem, DType::F16, &BackwardOptions::default())
        .expect("plan");
    assert!(matches!(
        dev.backward_on_stream(&f16_plan, good, ws_raw, &stream),
        Err(CudaError::Problem(ProblemError::Unsupported { .. }))
    ));
    assert!(matches!(
        dev.plan_backward(
            &problem,
            DType::Bf16,
            &BackwardOptions {
                deterministic: true,
                ..BackwardOptions::default()
            }
        ),
        Err(CudaError::Problem(ProblemError::Unsupported { .. }))
    ));
    // Nothing ran: the gradients still hold the sentinel.
    let back = |x: &CudaSlice<u16>| -> Vec<u16> {
        stream.synchronize().expect("sync");
        stream.clone_dtoh(x).expect("download")
    };
    for g in [&dq, &dk, &dv] {
        assert!(back(g).iter().all(|&b| b == sentinel.to_bits()));
    }

    // The good call, twice with the same plan and workspace.
    dev.backward_on_stream(&plan, good, ws_raw, &stream)
        .expect("runs");
    let first = (back(&dq), back(&dk), back(&dv));
    dev.backward_on_stream(&plan, good, ws_raw, &stream)
        .expect("runs again");
    let second = (back(&dq), back(&dk), back(&dv));
    assert_eq!(first.1, second.1, "dK is summed in a fixed order");
    assert_eq!(first.2, second.2, "dV is summed in a fixed order");
    let as_bf = |x: &[u16]| x.iter().map(|&b| bf16::from_bits(b)).collect::<Vec<_>>();
    let (gq, gk, gv) = (as_bf(&second.0), as_bf(&second.1), as_bf(&second.2));
    let e = compare_grads(
        &problem,
        Grads::new(&gq[..], &gk[..], &gv[..]),
        &p.reference,
    );
    println!(
        "caller memory: dq {:.2e} dk {:.2e} dv {:.2e}",
        e.dq, e.dk, e.dv
    );
    assert!(e.dq.max(e.dk).max(e.dv) <= GRAD_BOUND, "{e:?}");
    let _keep: &Arc<CudaStream> = &stream;
}

/// The LSE's address of a call (for a shortened view).
fn lse_ptr(t: &BackwardTensors<bf16>) -> u64 {
    t.lse.map_or(0, |l| l.ptr())
}

/// The host entry checks lengths before anything is copied: gradients untouched.
#[test]
#[ignore = "needs a CUDA GPU"]
fn host_entry_rejects_short_buffers_untouched() {
    let dev: &Device = device();
    let mut rng = Rng::fresh();
    let case = Case::dense(&mut rng, 1, 40, 50, 4, 2, 64).round(Rounding::F16);
    let problem = case.desc().validate(256).expect("valid");
    let p = prepare::<f16>(&problem, &case, &mut rng);
    let lens = problem.min_buffer_lens();
    let seven = f16::from_f32(7.0);
    let mut g = Grads::new(
        vec![seven; lens.q],
        vec![seven; lens.k],
        vec![seven; lens.v],
    );
    let run = |d_o: &[f16], lse: &[f32], g: &mut Grads<Vec<f16>>, dk_short: usize| {
        let dk_len = g.dk.len() - dk_short;
        dev.backward_host(
            &problem,
            Qkv::new(&p.q[..], &p.k[..], &p.v[..]),
            BackwardInputs {
                o: &p.o[..],
                d_o,
                lse,
            },
            Grads::new(&mut g.dq[..], &mut g.dk[..dk_len], &mut g.dv[..]),
            &BackwardOptions::default(),
        )
    };
    let e = run(&p.d_o[..lens.o - 1], &p.lse, &mut g, 0).unwrap_err();
    assert!(matches!(
        e,
        CudaError::Problem(ProblemError::BufferTooSmall {
            tensor: Tensor::O,
            ..
        })
    ));
    let e = run(&p.d_o, &p.lse[..1], &mut g, 0).unwrap_err();
    assert!(matches!(
        e,
        CudaError::Problem(ProblemError::BufferTooSmall {
            tensor: Tensor::Lse,
            ..
        })
    ));
    let e = run(&p.d_o, &p.lse, &mut g, 1).unwrap_err();
    assert!(matches!(
        e,
        CudaError::Problem(ProblemError::BufferTooSmall {
            tensor: Tensor::K,
            ..
        })
    ));
    assert!(g.dq.iter().chain(&g.dk).chain(&g.dv).all(|&x| x == seven));
}

/// Tile choices the plan's are compared with (tuning): `(head dim, BwdTiles::parse
/// string)`; `None` in [`timing_paper_shapes`] is the plan's own choice. The first of each
/// head dim is the first choice (one CTA per SM, scalar dQ atomics), which the plan's
/// replaced after a same-call A/B on an H100 (see `kernels::bwd_sm80::tile_config`).
const CANDIDATES: [(usize, &str); 6] = [
    (64, "64x128x1x1x2x1"),
    (64, "64x128x1x1x2x1+v"),
    (64, "64x64x1x4x2x4+nv"),
    (128, "64x128x1x2x2x1"),
    (128, "64x128x1x2x2x1+v"),
    (128, "64x64x2x4x2x2+nv"),
];

fn tiles_opts(tiles: &str) -> BackwardOptions {
    BackwardOptions {
        tiles: Some(fa_cuda::BwdTiles::parse(tiles).expect("candidate tiles")),
        ..BackwardOptions::default()
    }
}

/// Every tuning candidate holds the bound on odd shapes, masks, GQA and both dtypes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn candidate_tiles_match_the_reference() {
    let mut rng = Rng::fresh();
    for (d, tiles) in CANDIDATES {
        let opts = tiles_opts(tiles);
        let a = Case::dense(&mut rng, 2, 129, 300, 4, 1, d).round(Rounding::Bf16);
        check_case_with::<bf16>(
            &format!("{tiles} 2x129x300 h4/1 d{d} causal"),
            &a.causal(),
            &mut rng,
            &opts,
        );
        let b = Case::dense(&mut rng, 1, 300, 129, 8, 2, d).round(Rounding::F16);
        check_case_with::<f16>(
            &format!("{tiles} 1x300x129 h8/2 d{d} window"),
            &b.with_mask(Mask::from_flash_args(false, 20, 5)),
            &mut rng,
            &opts,
        );
        let c = Case::dense(&mut rng, 2, 17, 17, 2, 2, d).round(Rounding::Bf16);
        check_case_with::<bf16>(
            &format!("{tiles} 2x17x17 d{d} softcap"),
            &c.with_softcap(5.0),
            &mut rng,
            &opts,
        );
        let e = Case::dense(&mut rng, 1, 260, 260, 2, 2, d).round(Rounding::Bf16);
        check_case_with::<bf16>(&format!("{tiles} 1x260x260 d{d}"), &e, &mut rng, &opts);
    }
}

/// Backward kernel times (CUDA events around the pre-pass, main kernel and post-pass) on the
/// paper's shapes: 16k tokens, hidden 2048, bf16, seqlen 2k and 8k, hdim 64 and 128, causal
/// and not; TFLOP/s counted as 2.5× the forward's FLOPs (softmax-core's `flops::backward`).
/// Prints only (a reading, not a check); `scripts/torch_sdpa.py --backward` gives the peers.
#[test]
#[ignore = "needs a CUDA GPU"]
fn timing_paper_shapes() {
    let dev = device();
    let mut rng = Rng::new(1);
    for d in [64usize, 128] {
        for n in [2048usize, 8192] {
            for causal in [false, true] {
                let (b, h) = (16384 / n, 2048 / d);
                let mut desc = softmax_core::ProblemDesc::new(b, n, n, h, h, d);
                if causal {
                    desc = desc.causal();
                }
                let problem = desc.validate(256).expect("valid");
                let lens = problem.min_buffer_lens();
                let draw = |len: usize, rng: &mut Rng| -> Vec<bf16> {
                    (0..len)
                        .map(|_| bf16::from_f32(rng.normal() as f32))
                        .collect()
                };
                let (q, k, v) = (
                    draw(lens.q, &mut rng),
                    draw(lens.k, &mut rng),
                    draw(lens.v, &mut rng),
                );
                let d_o = draw(lens.o, &mut rng);
                let (q, k, v, d_o) = (
                    dev.upload(&q).expect("up"),
                    dev.upload(&k).expect("up"),
                    dev.upload(&v).expect("up"),
                    dev.upload(&d_o).expect("up"),
                );
                let mut o = dev.alloc_zeroed::<bf16>(lens.o).expect("alloc");
                let mut lse = dev.alloc_zeroed::<f32>(problem.lse_len()).expect("alloc");
                dev.forward(
                    &problem,
                    Qkv::new(&q, &k, &v),
                    Out::with_lse(&mut o, &mut lse),
                    &ForwardOptions::default(),
                )
                .expect("forward");
                let mut dq = dev.alloc_zeroed::<bf16>(lens.q).expect("alloc");
                let mut dk = dev.alloc_zeroed::<bf16>(lens.k).expect("alloc");
                let mut dv = dev.alloc_zeroed::<bf16>(lens.v).expect("alloc");
                let configs = std::iter::once(None).chain(
                    CANDIDATES
                        .iter()
                        .filter(|(cd, _)| *cd == d)
                        .map(|(_, t)| Some(*t)),
                );
                for tiles in configs {
                    let opts = tiles.map_or_else(BackwardOptions::default, tiles_opts);
                    let ms = dev
                        .time_backward(
                            &problem,
                            Qkv::new(&q, &k, &v),
                            BackwardInputs {
                                o: &o,
                                d_o: &d_o,
                                lse: &lse,
                            },
                            Grads::new(&mut dq, &mut dk, &mut dv),
                            &opts,
                            3,
                            10,
                        )
                        .expect("timed");
                    let mut sorted = ms.clone();
                    sorted.sort_by(f32::total_cmp);
                    let median = f64::from(sorted[sorted.len() / 2]);
                    let flops = softmax_core::flops::backward(b, h, n, n, d, causal);
                    println!(
                        "backward bf16 d{d} seqlen {n} {} [{}]: {median:.3} ms, {:.0} TFLOP/s",
                        if causal { "causal" } else { "non-causal" },
                        tiles.unwrap_or("plan"),
                        flops / (median * 1e-3) / 1e12
                    );
                }
            }
        }
    }
}

/// A packed batch whose prefix sums live on the device (`Sequences::VarlenDevice`) through the
/// run entry: the same gradients as the reference of the host-described problem (an empty
/// key sequence and an empty query sequence included).
#[test]
#[ignore = "needs a CUDA GPU"]
fn varlen_with_device_prefix_sums() {
    let dev = device();
    let stream = dev.context().new_stream().expect("a stream");
    let mut rng = Rng::fresh();
    let case = Case::varlen(
        &mut rng,
        &[0, 1, 17, 300, 129],
        &[3, 1, 0, 280, 129],
        4,
        2,
        64,
    )
    .causal()
    .round(Rounding::Bf16);
    let host = case.desc().validate(256).expect("valid");
    let p = prepare::<bf16>(&host, &case, &mut rng);
    let sizes = softmax_core::Sequences::VarlenDevice {
        batch: host.batch(),
        total_q: host.total_q(),
        total_k: host.total_k(),
        max_seqlen_q: host.max_seqlen_q(),
        max_seqlen_k: host.max_seqlen_k(),
    };
    let on_device = softmax_core::ProblemDesc::new(1, 0, 0, 4, 2, 64)
        .causal()
        .with_sequences(sizes)
        .validate(256)
        .expect("valid");
    let up = |x: &[bf16]| -> CudaSlice<u16> {
        stream
            .clone_htod(&x.iter().map(|v| v.to_bits()).collect::<Vec<u16>>())
            .expect("upload")
    };
    let lens = host.min_buffer_lens();
    let (q, k, v, o, d_o) = (up(&p.q), up(&p.k), up(&p.v), up(&p.o), up(&p.d_o));
    let nan = vec![bf16::NAN; lens.q.max(lens.k)];
    let (dq, dk, dv) = (up(&nan[..lens.q]), up(&nan[..lens.k]), up(&nan[..lens.v]));
    let lse = stream.clone_htod(&p.lse).expect("upload");
    let as_i32 = |x: &[u32]| x.iter().map(|&v| v as i32).collect::<Vec<i32>>();
    let cu_q = stream
        .clone_htod(&as_i32(&case.cu_seqlens_q))
        .expect("upload");
    let cu_k = stream
        .clone_htod(&as_i32(&case.cu_seqlens_k))
        .expect("upload");
    let plan = dev
        .plan_backward(&on_device, DType::Bf16, &BackwardOptions::default())
        .expect("plan");
    let ws = stream
        .alloc_zeros::<u8>(plan.workspace_bytes())
        .expect("workspace");
    let tensors = BackwardTensors::<bf16> {
        qkv: Qkv::new(raw(&q, &stream), raw(&k, &stream), raw(&v, &stream)),
        o: raw(&o, &stream),
        d_o: raw(&d_o, &stream),
        lse: Some(raw(&lse, &stream)),
        grads: Grads::new(raw(&dq, &stream), raw(&dk, &stream), raw(&dv, &stream)),
        cu_seqlens: Some(fa_cuda::CuSeqlens {
            q: raw(&cu_q, &stream),
            k: raw(&cu_k, &stream),
        }),
    };
    // Without the prefix sums: a typed error.
    let missing = BackwardTensors {
        cu_seqlens: None,
        ..tensors
    };
    assert!(matches!(
        dev.backward_on_stream(&plan, missing, raw(&ws, &stream), &stream),
        Err(CudaError::Problem(ProblemError::Unsupported { .. }))
    ));
    dev.backward_on_stream(&plan, tensors, raw(&ws, &stream), &stream)
        .expect("runs");
    stream.synchronize().expect("sync");
    let back = |x: &CudaSlice<u16>| -> Vec<bf16> {
        stream
            .clone_dtoh(x)
            .expect("download")
            .into_iter()
            .map(bf16::from_bits)
            .collect()
    };
    let (gq, gk, gv) = (back(&dq), back(&dk), back(&dv));
    let e = compare_grads(&host, Grads::new(&gq[..], &gk[..], &gv[..]), &p.reference);
    println!(
        "device prefix sums: dq {:.2e} dk {:.2e} dv {:.2e}",
        e.dq, e.dk, e.dv
    );
    assert!(e.dq.max(e.dk).max(e.dv) <= GRAD_BOUND, "{e:?}");
}
