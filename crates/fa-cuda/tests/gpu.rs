//! GPU tests against the f64 reference (`fa_reference::attention_f64`) on fresh random inputs
//! rounded to bf16/fp16, outputs and LSE poisoned (NaN) before each launch. Bounds: normwise
//! ‖out − ref‖/‖ref‖ ≤ 1e-2 and LSE within 1e-3 (absolute), the DESIGN's contract for 16-bit
//! inputs with f32 accumulation. Every check runs with the sm80 family forced and, on Hopper,
//! with the sm90 family chosen in each of its load pipelines (cp.async; TMA + warp
//! specialization). Ignored by default: they need a CUDA GPU
//! (`cargo test -p fa-cuda -- --include-ignored`, or `scripts/gpu-pack` and the device).

mod common;
use common::{device, raw, read_back, LSE_BOUND, REL_L2_BOUND};
use cudarc::driver::{CudaContext, CudaStream};
use fa_cuda::{
    CuSeqlens, CudaElement, CudaError, DType, Device, ForwardOptions, ForwardVariant,
    KernelFamilyChoice, RawTensor, Sm90Pipeline,
};
use fa_reference::{attention_f64, compare, poison, Case, Rng, Rounding};
use half::{bf16, f16};
use softmax_core::{Mask, Out, ProblemError, Qkv, RescalePolicy, Sequences, Tensor};
use std::sync::Arc;

/// Host slices of Q, K, V as a bundle.
fn qkv<'a, T>(q: &'a [T], k: &'a [T], v: &'a [T]) -> Qkv<&'a [T]> {
    Qkv::new(q, k, v)
}

/// The kernel choices every check runs: the sm80 family forced, and on Hopper the sm90
/// family with each of its load pipelines.
fn families() -> Vec<(KernelFamilyChoice, Option<Sm90Pipeline>)> {
    let props = device().props();
    let mut all = vec![(KernelFamilyChoice::Sm80, None)];
    if (props.major, props.minor) == (9, 0) {
        all.push((KernelFamilyChoice::Sm90, Some(Sm90Pipeline::CpAsync)));
        all.push((
            KernelFamilyChoice::Sm90,
            Some(Sm90Pipeline::WarpSpecialized),
        ));
        all.push((
            KernelFamilyChoice::Sm90,
            Some(Sm90Pipeline::WarpSpecializedOverlap),
        ));
    }
    all
}

/// Runs `case` (already rounded to `T`) on the GPU with every family of [`families`] (the
/// `family` of `opts` is replaced) and checks each against the oracle; returns the largest
/// relative error. With the sm90 family chosen, a problem its plan covers must run on it (no
/// silent fallback to sm80).
fn check_as<T: CudaElement + fa_reference::Element>(
    label: &str,
    case: &Case,
    opts: &ForwardOptions,
) -> f64 {
    let desc = case.desc();
    let problem = desc.validate(256).expect("valid case");
    let to_t = |x: &[f32]| x.iter().map(|&v| T::from_f64(v as f64)).collect::<Vec<T>>();
    let (q, k, v) = (to_t(&case.q), to_t(&case.k), to_t(&case.v));
    let lens = problem.min_buffer_lens();
    let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
    let mut worst = 0.0f64;
    for (family, pipeline) in families() {
        let mut out = vec![T::from_f64(0.0); lens.o];
        poison(&mut out);
        let mut lse = vec![0.0f32; problem.lse_len()];
        poison(&mut lse);
        let opts = ForwardOptions {
            family,
            sm90_pipeline: pipeline,
            ..*opts
        };
        let stats = device()
            .forward_host(
                &problem,
                qkv(&q, &k, &v),
                Out::with_lse(&mut out, &mut lse),
                &opts,
            )
            .unwrap_or_else(|e| panic!("{label} ({family:?} {pipeline:?}): {e}"));
        let report = compare(&problem, &out, Some(&lse), &oracle);
        println!(
            "{label:<48} rel_l2 {:.2e} max_abs {:.2e} lse {:.2e} ({} elements, {})",
            report.rel_l2,
            report.max_abs,
            report.lse_max_abs,
            report.elements,
            stats
                .launch
                .map_or("no launch".to_string(), |l| l.variant.name())
        );
        if family == KernelFamilyChoice::Sm90 && opts.tiles.is_none() {
            let planned = fa_cuda::kernels::sm90::plan_forward(
                &problem,
                T::DTYPE,
                pipeline,
                device().props(),
            )
            .expect("plan")
            .map(|l| l.variant);
            let ran = stats.launch.map(|l| l.variant);
            if planned.is_some() {
                assert_eq!(planned, ran, "{label}: the sm90 family was chosen");
            } else {
                assert!(
                    !matches!(ran, Some(ForwardVariant::Sm90(_))),
                    "{label}: the sm90 plan declined"
                );
            }
        }
        assert!(
            report.within(REL_L2_BOUND, LSE_BOUND),
            "{label} ({family:?} {pipeline:?}): {report:?} exceeds rel_l2 {REL_L2_BOUND} / lse {LSE_BOUND}"
        );
        worst = worst.max(report.rel_l2);
    }
    worst
}

fn check(label: &str, case: Case) -> f64 {
    check_as::<bf16>(
        label,
        &case.round(Rounding::Bf16),
        &ForwardOptions::default(),
    )
}

fn masks() -> Vec<(&'static str, Mask)> {
    vec![
        ("none", Mask::NONE),
        ("causal", Mask::CAUSAL),
        (
            "window(32,8)",
            Mask {
                left: Some(32),
                right: Some(8),
            },
        ),
        (
            "window(0,0)",
            Mask {
                left: Some(0),
                right: Some(0),
            },
        ),
        (
            "window(-,5)",
            Mask {
                left: None,
                right: Some(5),
            },
        ),
        (
            "window(70,-)",
            Mask {
                left: Some(70),
                right: None,
            },
        ),
        (
            "causal+left 64",
            Mask {
                left: Some(64),
                right: Some(0),
            },
        ),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn seqlens_and_head_dims() {
    let mut rng = Rng::new(1);
    for &s in &[1usize, 17, 127, 1000] {
        for &d in &[64usize, 96, 128, 256] {
            for causal in [false, true] {
                let mut case = Case::dense(&mut rng, 2, s, s, 3, 3, d);
                if causal {
                    case = case.causal();
                }
                check(&format!("s={s} d={d} causal={causal}"), case);
            }
        }
    }
    // A long sequence (one head, sampled by the full oracle: kept moderate for the host CPU).
    for causal in [false, true] {
        let mut case = Case::dense(&mut rng, 1, 4097, 4097, 1, 1, 64);
        if causal {
            case = case.causal();
        }
        check(&format!("s=4097 d=64 causal={causal}"), case);
    }
    let case = Case::dense(&mut rng, 1, 4097, 4097, 1, 1, 128).causal();
    check("s=4097 d=128 causal", case);
}

/// Whether the launch choice compiles the mask code out for `case` (every key tile full).
fn runs_unmasked(case: &Case) -> bool {
    let desc = case.desc();
    let problem = desc.validate(256).expect("valid case");
    fa_cuda::kernels::plan_forward(
        &problem,
        DType::Bf16,
        KernelFamilyChoice::Sm80,
        None,
        None,
        &fa_cuda::DeviceProps::h200(),
    )
    .ok()
    .flatten()
    .is_some_and(|l| !l.variant.masked())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn full_tiles_without_mask_code() {
    // No mask and seqlen_k a multiple of 128: the `_full` variants (no mask code). Queries of
    // any length, GQA, softcap, fp16, varlen with empty sequences.
    let mut rng = Rng::new(7);
    for &(sq, sk) in &[
        (1usize, 128usize),
        (100, 256),
        (256, 256),
        (1000, 1024),
        (129, 384),
    ] {
        for &d in &[64usize, 96, 128, 256] {
            let case = Case::dense(&mut rng, 2, sq, sk, 4, 2, d);
            assert!(
                runs_unmasked(&case),
                "sq={sq} sk={sk} d={d} should run unmasked"
            );
            check(&format!("full tiles sq={sq} sk={sk} d={d}"), case);
        }
    }
    for &d in &[64usize, 128, 256] {
        let case = Case::dense(&mut rng, 1, 200, 512, 2, 1, d).round(Rounding::F16);
        assert!(runs_unmasked(&case));
        check_as::<f16>(
            &format!("full tiles fp16 d={d}"),
            &case,
            &ForwardOptions::default(),
        );
        let case = Case::dense(&mut rng, 1, 300, 256, 2, 2, d)
            .with_softcap(5.0)
            .round(Rounding::Bf16);
        assert!(runs_unmasked(&case));
        check_as::<bf16>(
            &format!("full tiles softcap d={d}"),
            &case,
            &ForwardOptions::default(),
        );
    }
    let case = Case::varlen(&mut rng, &[5, 0, 300, 128], &[128, 0, 256, 384], 4, 4, 128);
    assert!(runs_unmasked(&case));
    check("full tiles varlen d=128", case);
    // One sequence with a key tail: the whole launch keeps the mask.
    let case = Case::varlen(&mut rng, &[5, 300], &[128, 257], 4, 4, 128);
    assert!(!runs_unmasked(&case));
    check("varlen with a key tail d=128", case);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn odd_head_dims() {
    let mut rng = Rng::new(2);
    for &d in &[8usize, 40, 72, 136, 200, 248] {
        for causal in [false, true] {
            let mut case = Case::dense(&mut rng, 1, 129, 200, 2, 1, d);
            if causal {
                case = case.causal();
            }
            check(&format!("d={d} s=129x200 causal={causal}"), case);
        }
    }
    // head_dim_v != head_dim
    let mut case = Case::dense(&mut rng, 1, 70, 90, 2, 2, 64);
    case.head_dim_v = 128;
    case.fill(&mut rng, Rounding::Bf16);
    check("d=64 dv=128", case);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_mask_with_unequal_lengths() {
    let mut rng = Rng::new(3);
    for &(sq, sk) in &[
        (17usize, 1000usize),
        (1000, 17),
        (1, 4097),
        (127, 300),
        (300, 127),
        (200, 200),
    ] {
        for (name, mask) in masks() {
            let case = Case::dense(&mut rng, 1, sq, sk, 2, 1, 64).with_mask(mask);
            check(&format!("sq={sq} sk={sk} mask={name}"), case);
        }
    }
    // Rows that see no key at all (causal with seqlen_q > seqlen_k): output 0, LSE -inf.
    let case = Case::dense(&mut rng, 1, 300, 40, 2, 2, 128).causal();
    check("sq=300 sk=40 causal (empty rows)", case);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gqa_mqa_and_strides() {
    let mut rng = Rng::new(4);
    for &(hq, hk) in &[(8usize, 1usize), (16, 2), (6, 3)] {
        for causal in [false, true] {
            let mut case = Case::dense(&mut rng, 2, 257, 257, hq, hk, 128);
            if causal {
                case = case.causal();
            }
            check(&format!("heads {hq}:{hk} causal={causal}"), case);
        }
    }
    let case = Case::dense(&mut rng, 2, 150, 190, 4, 2, 64)
        .causal()
        .padded(&mut rng, 8, Rounding::Bf16);
    check("padded strides d=64", case);
    let case = Case::dense(&mut rng, 2, 150, 190, 4, 1, 256).padded(&mut rng, 16, Rounding::Bf16);
    check("padded strides d=256 MQA", case);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn varlen_with_empty_and_single_token_sequences() {
    let mut rng = Rng::new(5);
    let seqlens_q = [0u32, 1, 17, 300, 5, 1, 129];
    let seqlens_k = [3u32, 1, 0, 280, 9, 200, 129];
    for (name, mask) in masks() {
        for &d in &[64usize, 128] {
            let case = Case::varlen(&mut rng, &seqlens_q, &seqlens_k, 4, 2, d).with_mask(mask);
            check(&format!("varlen d={d} mask={name}"), case);
        }
    }
    let case = Case::varlen(&mut rng, &seqlens_q, &seqlens_k, 8, 1, 256)
        .causal()
        .padded(&mut rng, 8, Rounding::Bf16);
    check("varlen padded d=256 MQA causal", case);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp16_softcap_scale_and_rescale_policies() {
    let mut rng = Rng::new(6);
    for &d in &[64usize, 128, 256] {
        let case = Case::dense(&mut rng, 1, 300, 300, 2, 1, d)
            .causal()
            .round(Rounding::F16);
        check_as::<f16>(
            &format!("fp16 d={d} causal"),
            &case,
            &ForwardOptions::default(),
        );
        let case = Case::dense(&mut rng, 1, 300, 333, 2, 2, d)
            .with_softcap(5.0)
            .with_scale(0.5)
            .round(Rounding::Bf16);
        check_as::<bf16>(
            &format!("softcap 5 scale 0.5 d={d}"),
            &case,
            &ForwardOptions::default(),
        );
    }
    // A wide dynamic range (large scale) makes the running max move often: both policies must
    // agree with the oracle.
    for policy in [
        RescalePolicy::Always,
        RescalePolicy::Threshold(8.0),
        RescalePolicy::Threshold(0.5),
    ] {
        let case = Case::dense(&mut rng, 1, 500, 700, 2, 2, 128)
            .with_scale(1.5)
            .round(Rounding::Bf16);
        let opts = ForwardOptions {
            rescale: policy,
            ..ForwardOptions::default()
        };
        check_as::<bf16>(&format!("scale 1.5 policy {policy:?}"), &case, &opts);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_input_is_rejected_and_outputs_untouched() {
    let mut rng = Rng::new(7);
    let case = Case::dense(&mut rng, 1, 64, 64, 2, 2, 64).round(Rounding::Bf16);
    let desc = case.desc();
    let to_bf = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
    let (q, k, v) = (to_bf(&case.q), to_bf(&case.k), to_bf(&case.v));
    let mut out = vec![bf16::from_f32(7.0); q.len() - 1];
    let problem = desc.validate(256).expect("valid");
    let err = device()
        .forward_host(
            &problem,
            qkv(&q, &k, &v),
            Out::new(&mut out),
            &ForwardOptions::default(),
        )
        .expect_err("short output");
    assert!(matches!(
        err,
        CudaError::Problem(ProblemError::BufferTooSmall { .. })
    ));
    assert!(out.iter().all(|&x| x == bf16::from_f32(7.0)));
    // A NaN scale never reaches the backend: validation at the edge rejects it, and no
    // `Problem` (what every backend takes) exists to call with.
    let bad = desc.scale(f32::NAN);
    assert!(matches!(
        bad.validate(256),
        Err(ProblemError::NonFiniteScale { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn repeated_runs_agree_bitwise() {
    // A race would show as run-to-run differences on the same inputs.
    let mut rng = Rng::new(8);
    let case = Case::dense(&mut rng, 2, 1000, 1000, 4, 1, 128)
        .causal()
        .round(Rounding::Bf16);
    let problem = case.desc().validate(256).expect("valid");
    let to_bf = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
    let (q, k, v) = (to_bf(&case.q), to_bf(&case.k), to_bf(&case.v));
    for (family, pipeline) in families() {
        let opts = ForwardOptions {
            family,
            sm90_pipeline: pipeline,
            ..ForwardOptions::default()
        };
        let mut first = vec![bf16::ZERO; q.len()];
        device()
            .forward_host(&problem, qkv(&q, &k, &v), Out::new(&mut first), &opts)
            .expect("runs");
        for _ in 0..3 {
            let mut again = vec![bf16::ZERO; q.len()];
            poison(&mut again);
            device()
                .forward_host(&problem, qkv(&q, &k, &v), Out::new(&mut again), &opts)
                .expect("runs");
            assert!(
                first
                    .iter()
                    .zip(&again)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{family:?} {pipeline:?}"
            );
        }
    }
}

/// The sizes-only description of a varlen case (its prefix sums go to the device).
fn device_sizes(case: &Case) -> Sequences<'static> {
    let longest = |cu: &[u32]| {
        cu.windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0)
    };
    Sequences::VarlenDevice {
        batch: case.cu_seqlens_q.len() - 1,
        total_q: *case.cu_seqlens_q.last().unwrap() as usize,
        total_k: *case.cu_seqlens_k.last().unwrap() as usize,
        max_seqlen_q: longest(&case.cu_seqlens_q),
        max_seqlen_k: longest(&case.cu_seqlens_k),
    }
}

/// Runs a bf16 `case` the way an embedding runtime does: inputs and poisoned outputs
/// allocated and copied with cudarc on the caller's `stream`, the forward queued there (with
/// the prefix sums on the device when `device_cu`), then the caller synchronises and reads
/// back. Checks O and LSE against the oracle; returns O.
fn check_caller_memory(
    label: &str,
    device: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    device_cu: bool,
) -> Vec<bf16> {
    let host_problem = case.desc().validate(256).expect("valid case");
    let desc = if device_cu {
        case.desc().with_sequences(device_sizes(case))
    } else {
        case.desc()
    };
    let problem = desc.validate(256).expect("valid case");
    let bits = |x: &[f32]| {
        x.iter()
            .map(|&v| bf16::from_f32(v).to_bits())
            .collect::<Vec<u16>>()
    };
    let up = |x: &[u16]| stream.clone_htod(x).expect("copy to the device");
    let (q, k, v) = (up(&bits(&case.q)), up(&bits(&case.k)), up(&bits(&case.v)));
    let mut o_host = vec![bf16::ZERO; problem.min_buffer_lens().o];
    poison(&mut o_host);
    let o = up(&o_host.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    let mut lse_host = vec![0.0f32; problem.lse_len()];
    poison(&mut lse_host);
    let lse = stream.clone_htod(&lse_host).expect("copy to the device");
    let cu = |c: &[u32]| {
        stream
            .clone_htod(&c.iter().map(|&x| x as i32).collect::<Vec<i32>>())
            .expect("copy to the device")
    };
    let cu_slices = device_cu.then(|| (cu(&case.cu_seqlens_q), cu(&case.cu_seqlens_k)));
    let qkv = Qkv::<RawTensor<bf16>>::new(raw(&q, stream), raw(&k, stream), raw(&v, stream));
    let out = Out::with_lse(raw(&o, stream), raw(&lse, stream));
    let opts = ForwardOptions::default();
    let stats = match &cu_slices {
        Some((cu_q, cu_k)) => {
            let cu_seqlens = CuSeqlens {
                q: raw(cu_q, stream),
                k: raw(cu_k, stream),
            };
            device.forward_varlen_on_stream(&problem, cu_seqlens, qkv, out, stream, &opts)
        }
        None => device.forward_on_stream(&problem, qkv, out, stream, &opts),
    }
    .unwrap_or_else(|e| panic!("{label}: {e}"));
    // The caller's side of the contract: synchronise before reading (or freeing) anything.
    let (o_back, lse_back) = read_back(stream, &o, &lse);
    let oracle = attention_f64(&host_problem, &case.q, &case.k, &case.v);
    let report = compare(&host_problem, &o_back, Some(&lse_back), &oracle);
    println!(
        "{label:<48} rel_l2 {:.2e} lse {:.2e} ({})",
        report.rel_l2,
        report.lse_max_abs,
        stats
            .launch
            .map_or("no launch".to_string(), |l| l.variant.name())
    );
    assert!(
        report.within(REL_L2_BOUND, LSE_BOUND),
        "{label}: {report:?} exceeds rel_l2 {REL_L2_BOUND} / lse {LSE_BOUND}"
    );
    o_back
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn caller_context_stream_and_memory() {
    // A context fa-cuda did not create and that is not the primary one (a second
    // `CudaContext::new(0)` would retain the primary context again), a stream of its own.
    let ctx = CudaContext::new_non_primary(0, 0).expect("a non-primary context");
    assert!(!ctx.is_primary());
    let caller = Device::from_context(ctx.clone()).expect("device on the caller's context");
    let stream = ctx.new_stream().expect("a non-default stream");
    let mut rng = Rng::new(9);
    let case = Case::dense(&mut rng, 2, 300, 257, 8, 2, 128)
        .causal()
        .round(Rounding::Bf16);
    let o = check_caller_memory(
        "caller memory dense causal GQA",
        &caller,
        &stream,
        &case,
        false,
    );
    // Same inputs through the owned-buffer layer (another context): the same bits.
    let problem = case.desc().validate(256).expect("valid");
    let to_bf = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
    let (q, k, v) = (to_bf(&case.q), to_bf(&case.k), to_bf(&case.v));
    let mut owned = vec![bf16::ZERO; o.len()];
    device()
        .forward_host(
            &problem,
            qkv(&q, &k, &v),
            Out::new(&mut owned),
            &ForwardOptions::default(),
        )
        .expect("runs");
    assert!(o
        .iter()
        .zip(&owned)
        .all(|(a, b)| a.to_bits() == b.to_bits()));

    // Host prefix sums on the caller's stream (copied and freed in stream order).
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
    check_caller_memory(
        "caller memory varlen, host cu_seqlens",
        &caller,
        &stream,
        &case,
        false,
    );
    check_caller_memory(
        "caller memory varlen, device cu_seqlens",
        &caller,
        &stream,
        &case,
        true,
    );

    // Refusals, before anything is queued.
    let problem = case.desc().validate(256).expect("valid");
    let lens = problem.min_buffer_lens();
    let buf = stream
        .alloc_zeros::<u16>(lens.q.max(lens.k).max(lens.o))
        .expect("alloc");
    let t = raw::<bf16, u16>(&buf, &stream);
    let primary_stream = device().default_stream().clone();
    assert_eq!(
        caller.forward_on_stream(
            &problem,
            Qkv::new(t, t, t),
            Out::new(t),
            &primary_stream,
            &ForwardOptions::default()
        ),
        Err(CudaError::ForeignStream)
    );
    // SAFETY: a null address is refused before anything is queued.
    let null = unsafe { RawTensor::<bf16>::from_raw(0, lens.k) };
    assert_eq!(
        caller.forward_on_stream(
            &problem,
            Qkv::new(t, null, t),
            Out::new(t),
            &stream,
            &ForwardOptions::default()
        ),
        Err(CudaError::NullPointer { tensor: Tensor::K })
    );
    stream.synchronize().expect("synchronise");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn varlen_with_device_prefix_sums() {
    let stream = device()
        .context()
        .new_stream()
        .expect("a non-default stream");
    let mut rng = Rng::new(10);
    let seqlens_q = [0u32, 1, 17, 300, 5, 1, 129];
    let seqlens_k = [3u32, 1, 0, 280, 9, 200, 129];
    for (name, mask) in masks() {
        for &d in &[64usize, 128] {
            let case = Case::varlen(&mut rng, &seqlens_q, &seqlens_k, 4, 2, d)
                .with_mask(mask)
                .round(Rounding::Bf16);
            check_caller_memory(
                &format!("device cu_seqlens d={d} mask={name}"),
                device(),
                &stream,
                &case,
                true,
            );
        }
    }
    // Whole key tiles everywhere: the host cannot see it, the masked variant still agrees.
    let case = Case::varlen(&mut rng, &[5, 0, 300, 128], &[128, 0, 256, 384], 4, 4, 128)
        .round(Rounding::Bf16);
    check_caller_memory(
        "device cu_seqlens full tiles",
        device(),
        &stream,
        &case,
        true,
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_context_and_stream_handles() {
    // A C/Python caller's CUcontext: the primary context is shared, another one is refused.
    let primary = device().context().cu_ctx();
    // SAFETY: the handle is live (the test's device holds the primary context).
    let shared = unsafe { Device::from_raw_context(primary) }.expect("primary context");
    assert_eq!(shared.context().cu_ctx(), primary);
    let other = CudaContext::new_non_primary(0, 0).expect("a non-primary context");
    // SAFETY: `other` is live for the call.
    let refused = unsafe { Device::from_raw_context(other.cu_ctx()) };
    assert_eq!(refused.unwrap_err(), CudaError::NotPrimaryContext);
    // A caller's raw CUstream, borrowed for one call.
    let owner = shared.context().new_stream().expect("a stream");
    // SAFETY: `owner` keeps the stream alive for the whole test.
    let borrowed = unsafe { shared.borrow_stream(owner.cu_stream()) };
    let mut rng = Rng::new(11);
    let case = Case::dense(&mut rng, 1, 200, 200, 2, 2, 64).round(Rounding::Bf16);
    check_caller_memory("borrowed raw stream", &shared, &borrowed, &case, false);
}
