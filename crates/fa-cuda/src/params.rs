//! The forward's options, this backend's limits ([`supports`]) and the one parameter block of
//! the attention kernels (`Params`, shared by the forward and decode families) with the
//! dense forward's filling of it; the plan that uses them is `plan.rs`.

use crate::kernels::sm90::Pipeline as Sm90Pipeline;
use crate::kernels::{KernelFamilyChoice, LaunchShape, Tiles};
use softmax_core::{DType, Problem, ProblemError, RescalePolicy};

/// Options of a forward call beyond the problem description. The default: threshold rescale
/// with τ = 8, no timing, the tuned tile choice.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ForwardOptions {
    /// When rows move their reference maximum (softmax-core's policy; `Always` is FlashAttention-2,
    /// the default `Threshold(8)` is FlashAttention-4's conditional rescale).
    pub rescale: RescalePolicy<f32>,
    /// Time the kernel with CUDA events and report it in [`crate::ForwardStats::kernel_ms`].
    pub time_kernel: bool,
    /// Override the launch choice's tile sizes (tuning experiments; `None`: the tuned choice).
    /// Applies to the sm80 family, and forces it.
    pub tiles: Option<Tiles>,
    /// KV-cache (decode) problems: force this many key splits (`None`: the plan's choice from
    /// the problem and the SM count; `Some(0)` is an error).
    pub splits: Option<u32>,
    /// Which kernel family may run the call (default: the measured-best one).
    pub family: KernelFamilyChoice,
    /// Override the sm90 family's load pipeline (tests and tuning; `None`: the plan's choice).
    pub sm90_pipeline: Option<Sm90Pipeline>,
    /// KV-cache (decode) problems: override the decode kernel's K/V stages in flight (tests
    /// and tuning, 2 to 8; `None`: the plan's choice). Fewer stages let more CTAs share an
    /// SM, and the split count follows the CTAs the device holds at once.
    pub decode_stages: Option<u32>,
    /// KV-cache (decode) problems: override the decode kernel's keys per K/V tile (tests and
    /// tuning; 64, 128 or 256; `None`: the plan's choice).
    pub decode_block_n: Option<u32>,
    /// KV-cache (decode) problems: override the decode kernel's warps per CTA (tests and
    /// tuning; 1 to 8; `None`: the plan's choice).
    pub decode_warps: Option<u32>,
    /// KV-cache (decode) problems over a paged cache: read the blocks in the block table's
    /// order even where the plan would walk them in address order (A/B tests and tuning; see
    /// [`crate::DecodePlan::block_walk`]).
    pub decode_table_order: bool,
}

/// The one parameter block of the attention kernels (the forward families, the decode
/// family's decode, combine and append kernels, and the backward's three kernels); `kernels/common/params.cuh`'s `AttnParams` has
/// the same layout. Each kernel reads the fields of its pass; the others stay zero. A plan
/// fills everything but the device addresses, which the run sets.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Params {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub cu_q: u64,
    pub cu_k: u64,
    pub seqused_k: u64,
    pub block_table: u64,
    pub block_walk: u64,
    pub o_part: u64,
    pub ml_part: u64,
    pub k_new: u64,
    pub v_new: u64,
    pub d_o: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub dsum: u64,
    pub lse2: u64,
    pub dq_acc: u64,
    pub q_strides: [i64; 3],
    pub k_strides: [i64; 3],
    pub v_strides: [i64; 3],
    pub o_strides: [i64; 3],
    pub kn_strides: [i64; 3],
    pub vn_strides: [i64; 3],
    pub lse_bs: i64,
    pub lse_hs: i64,
    pub seqlen_q: i32,
    pub seqlen_k: i32,
    pub capacity: i32,
    pub group: i32,
    pub head_dim: i32,
    pub head_dim_v: i32,
    pub win_left: i32,
    pub win_right: i32,
    pub rows: i32,
    pub num_m_blocks: i32,
    pub num_splits: i32,
    pub block_size: i32,
    pub blocks_per_seq: i32,
    pub num_blocks: i32,
    pub batch: i32,
    pub heads_q: i32,
    pub seqlen_new: i32,
    pub pre: f32,
    pub softcap_post: f32,
    pub tau: f32,
    pub scale: f32,
    pub pad: f32,
}

// SAFETY: plain old data with a C layout matching the kernels' `AttnParams` (checked by the
// size and offset assertions below, the size assertion in `common/params.cuh`, and the GPU
// tests).
unsafe impl cudarc::driver::DeviceRepr for Params {}
const _: () = assert!(core::mem::size_of::<Params>() == 416);
// Field offsets as `common/params.cuh` lays them out (21 pointers, 20 strides, 17 ints, 5 floats).
const _: () = assert!(core::mem::offset_of!(Params, d_o) == 112);
const _: () = assert!(core::mem::offset_of!(Params, q_strides) == 168);
const _: () = assert!(core::mem::offset_of!(Params, kn_strides) == 264);
const _: () = assert!(core::mem::offset_of!(Params, lse_bs) == 312);
const _: () = assert!(core::mem::offset_of!(Params, seqlen_q) == 328);
const _: () = assert!(core::mem::offset_of!(Params, seqlen_new) == 392);
const _: () = assert!(core::mem::offset_of!(Params, pre) == 396);
const _: () = assert!(core::mem::offset_of!(Params, scale) == 408);

/// The rescale threshold as the kernels take it (log2 units; 0: rescale always).
pub(crate) fn tau_of(rescale: RescalePolicy<f32>) -> f32 {
    match rescale {
        RescalePolicy::Always => 0.0,
        RescalePolicy::Threshold(t) => t,
    }
}

/// Largest token count, window or head count the kernel's 32-bit index arithmetic allows.
const MAX_TOKENS: usize = 1 << 30;

/// Whether fa-cuda's kernels can run a validated problem with inputs of `dtype`, answered on
/// the host before any buffer or device is involved (what a backend choice asks). The calls
/// check the same, so an answer of `Ok` leaves only buffer lengths and device limits.
pub fn supports(problem: &Problem, dtype: DType) -> Result<(), ProblemError> {
    let unsupported = |what: &'static str| Err(ProblemError::Unsupported { what });
    if !matches!(dtype, DType::Bf16 | DType::F16) {
        return unsupported("fa-cuda takes bf16 or f16 inputs with an output of the same dtype");
    }
    if problem.head_dim() % 8 != 0 || problem.head_dim_v() % 8 != 0 {
        return unsupported("fa-cuda needs head dims that are multiples of 8");
    }
    if problem
        .strides()
        .iter()
        .any(|s| s.batch % 8 != 0 || s.seq % 8 != 0 || s.head % 8 != 0)
    {
        return unsupported("fa-cuda needs strides that are multiples of 8 elements");
    }
    if problem.total_q() >= MAX_TOKENS || problem.total_k() >= MAX_TOKENS {
        return unsupported("fa-cuda handles fewer than 2^30 tokens per tensor");
    }
    if problem.heads_q() > 65535 || problem.batch() > 65535 {
        return unsupported("fa-cuda handles at most 65535 heads and 65535 sequences");
    }
    if problem.sinks().is_some() {
        return unsupported("fa-cuda does not run attention sinks yet (the CPU backend does)");
    }
    Ok(())
}

/// The dense passes' parameter block of a validated problem and its launch (device addresses
/// still zero): the tensors' element strides (the batch stride 0 when packed), the LSE layout
/// (packed: head-major over the total tokens), the lengths (packed: the totals, which bound
/// the kernels' reads of the prefix sums), the window (-1: unbounded), the score transform's
/// factors, the query blocks and the rescale threshold. The forward's, and with the scale the
/// backward's.
pub(crate) fn forward_params(
    problem: &Problem,
    launch: Option<&LaunchShape>,
    rescale: RescalePolicy<f32>,
) -> Params {
    let varlen = problem.is_varlen();
    let triple = |s: &softmax_core::Strides| {
        [
            if varlen { 0 } else { s.batch as i64 },
            s.seq as i64,
            s.head as i64,
        ]
    };
    let strides = problem.strides();
    let (lse_bs, lse_hs) = if varlen {
        (0, problem.total_q() as i64)
    } else {
        (
            (problem.heads_q() * problem.total_q()) as i64,
            problem.total_q() as i64,
        )
    };
    // Windows beyond any sequence are unbounded in effect; the kernels' indices are 32-bit.
    let window = |w: Option<usize>| w.map_or(-1, |w| w.min(MAX_TOKENS) as i32);
    let mask = problem.mask();
    let transform = problem.score_transform::<f64>();
    Params {
        q_strides: triple(&strides[0]),
        k_strides: triple(&strides[1]),
        v_strides: triple(&strides[2]),
        o_strides: triple(&strides[3]),
        lse_bs,
        lse_hs,
        seqlen_q: problem.total_q() as i32,
        seqlen_k: problem.total_k() as i32,
        group: problem.group_size() as i32,
        head_dim: problem.head_dim() as i32,
        head_dim_v: problem.head_dim_v() as i32,
        win_left: window(mask.left),
        win_right: window(mask.right),
        num_m_blocks: launch.map_or(0, |l| l.grid.0 as i32),
        pre: transform.pre_factor() as f32,
        softcap_post: transform.softcap_post_factor().unwrap_or(0.0) as f32,
        tau: tau_of(rescale),
        ..Params::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::DeviceProps;
    use softmax_core::BufferLens;
    use softmax_core::{Mask, ProblemDesc, Strides, Tensor};

    const H200: DeviceProps = DeviceProps::h200();

    fn lens_of(desc: &ProblemDesc) -> BufferLens {
        desc.validate(256).expect("valid").min_buffer_lens()
    }

    /// What the tests look at: the launch and the parameter block of a plan.
    struct Prepared {
        launch: Option<LaunchShape>,
        params: Params,
    }

    /// Validation at the edge, the buffer lengths, then this backend's plan: any may reject.
    fn prepare(
        desc: &ProblemDesc<'_>,
        lens: BufferLens,
        dtype: DType,
        opts: &ForwardOptions,
        props: &DeviceProps,
    ) -> Result<Prepared, ProblemError> {
        let problem = desc.validate(256)?;
        problem.check_buffers(lens)?;
        let plan = crate::plan::plan_forward(&problem, dtype, opts, props)?;
        Ok(Prepared {
            launch: plan.launch(),
            params: plan.params,
        })
    }

    /// A valid description prepared with exact buffer lengths and default options.
    fn prepared(desc: &ProblemDesc<'_>, dtype: DType) -> Prepared {
        prepare(
            desc,
            lens_of(desc),
            dtype,
            &ForwardOptions::default(),
            &H200,
        )
        .expect("valid")
    }

    #[test]
    fn dense_params_follow_the_problem() {
        let desc = ProblemDesc::new(2, 100, 300, 8, 2, 128).causal();
        let p = prepared(&desc, DType::Bf16);
        let launch = p.launch.expect("work to do");
        assert_eq!(launch.grid, (1, 8, 2));
        assert!(launch.variant.name().contains("_d128_"));
        assert_eq!(p.params.group, 4);
        assert_eq!(p.params.q_strides, [100 * 8 * 128, 8 * 128, 128]);
        assert_eq!(p.params.k_strides, [300 * 2 * 128, 2 * 128, 128]);
        assert_eq!((p.params.win_left, p.params.win_right), (-1, 0));
        assert_eq!((p.params.lse_bs, p.params.lse_hs), (8 * 100, 100));
        let expected_pre = (1.0 / (128f64).sqrt()) * softmax_core::LOG2_E;
        assert!((p.params.pre as f64 - expected_pre).abs() < 1e-7);
        assert_eq!(p.params.tau, softmax_core::DEFAULT_RESCALE_THRESHOLD);
    }

    #[test]
    fn varlen_params_use_packed_layout() {
        let cu_q = [0u32, 5, 5, 40];
        let cu_k = [0u32, 7, 9, 9];
        let desc = ProblemDesc::varlen(&cu_q, &cu_k, 4, 4, 72).window(Some(3), Some(2));
        let p = prepared(&desc, DType::F16);
        let launch = p.launch.expect("work");
        assert_eq!(launch.grid, (1, 4, 3));
        assert!(launch.variant.name().contains("_d128_"));
        assert_eq!(p.params.q_strides[0], 0);
        assert_eq!((p.params.lse_bs, p.params.lse_hs), (0, 40));
        assert_eq!((p.params.win_left, p.params.win_right), (3, 2));
    }

    #[test]
    fn sinks_are_unsupported_for_now() {
        let sinks = [0.5f32; 8];
        let desc = ProblemDesc::new(1, 16, 16, 8, 2, 64).with_sinks(&sinks);
        let err = prepare(
            &desc,
            lens_of(&desc),
            DType::Bf16,
            &ForwardOptions::default(),
            &H200,
        )
        .err();
        assert!(
            matches!(err, Some(ProblemError::Unsupported { what }) if what.contains("sinks")),
            "{err:?}"
        );
    }

    #[test]
    fn bad_input_gets_typed_errors() {
        let opts = ForwardOptions::default();
        let desc = ProblemDesc::new(1, 4, 4, 3, 2, 64);
        assert!(matches!(
            prepare(
                &desc,
                BufferLens {
                    q: 0,
                    k: 0,
                    v: 0,
                    o: 0,
                    lse: None
                },
                DType::Bf16,
                &opts,
                &H200
            ),
            Err(ProblemError::GqaRatio { .. })
        ));
        let desc = ProblemDesc::new(1, 4, 4, 2, 2, 64);
        let mut lens = lens_of(&desc);
        lens.o -= 1;
        assert!(matches!(
            prepare(&desc, lens, DType::Bf16, &opts, &H200),
            Err(ProblemError::BufferTooSmall {
                tensor: Tensor::O,
                ..
            })
        ));
        let desc = ProblemDesc::new(1, 4, 4, 2, 2, 60);
        assert!(matches!(
            prepare(&desc, lens_of(&desc), DType::Bf16, &opts, &H200),
            Err(ProblemError::Unsupported { .. })
        ));
        let desc = ProblemDesc::new(1, 4, 4, 2, 2, 64).strides(
            Tensor::Q,
            Strides {
                batch: 4 * 132,
                seq: 132,
                head: 66,
            },
        );
        assert!(matches!(
            prepare(&desc, lens_of(&desc), DType::Bf16, &opts, &H200),
            Err(ProblemError::Unsupported { .. })
        ));
        let desc = ProblemDesc::new(1, 4, 4, 2, 2, 64).with_mask(Mask::CAUSAL);
        let bad_tau = ForwardOptions {
            rescale: RescalePolicy::Threshold(20.0),
            ..opts
        };
        assert!(prepare(&desc, lens_of(&desc), DType::F16, &bad_tau, &H200).is_err());
        assert!(prepare(&desc, lens_of(&desc), DType::Bf16, &bad_tau, &H200).is_ok());
    }

    #[test]
    fn device_prefix_sums_keep_the_mask_code() {
        let sizes = softmax_core::Sequences::VarlenDevice {
            batch: 2,
            total_q: 300,
            total_k: 512,
            max_seqlen_q: 200,
            max_seqlen_k: 256,
        };
        let desc = ProblemDesc::new(1, 0, 0, 4, 4, 128).with_sequences(sizes);
        let p = prepared(&desc, DType::Bf16);
        let launch = p.launch.expect("work");
        assert!(launch.variant.masked());
        assert_eq!(launch.grid.2, 2);
        assert_eq!((p.params.seqlen_q, p.params.seqlen_k), (300, 512));
        assert_eq!((p.params.lse_bs, p.params.lse_hs), (0, 300));
        // The same sizes with host prefix sums whose key tiles are all full: no mask code.
        let (cu_q, cu_k) = ([0u32, 200, 300], [0u32, 256, 512]);
        let host = prepared(&ProblemDesc::varlen(&cu_q, &cu_k, 4, 4, 128), DType::Bf16);
        assert!(!host.launch.expect("work").variant.masked());
    }

    #[test]
    fn empty_problem_has_no_launch() {
        let desc = ProblemDesc::new(1, 0, 5, 2, 2, 64);
        let p = prepared(&desc, DType::Bf16);
        assert!(p.launch.is_none());
    }
}
