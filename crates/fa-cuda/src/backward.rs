//! The backward pass's host side, in the plan → workspace → run contract: [`plan_backward`]
//! (a pure function of the problem, the dtype, the options and the device's properties)
//! gives a [`BackwardPlan`] holding the launch ([`BwdLaunch`]: variant, grids, shared
//! memory), the kernel parameters and the workspace the call needs ([`WorkspaceReq`]: total
//! bytes, alignment, named parts); [`crate::Device::backward_on_stream`] checks the caller's
//! tensors and workspace against the plan and only launches. The owned-buffer conveniences
//! ([`crate::Device::backward`], [`crate::Device::backward_host`]) allocate the workspace and
//! call the same path.
//!
//! The kernels (`kernels/bwd_sm80/`): a pre-pass writes `D = rowsum(dO∘O)` and `LSE·log2 e`
//! per (row, head) into the workspace and zeroes the f32 dQ accumulator; the main kernel (one
//! CTA per key block, KV head and sequence) recomputes `P` from the forward's LSE and adds
//! `dV = Pᵀ·dO`, `dK = dSᵀ·Q·scale` in registers over every query head of its GQA group (a
//! fixed order: dK and dV are deterministic) and `dS·K` into the dQ accumulator with f32
//! atomics; a post-pass scales the accumulator and rounds it into dQ. **dQ is not bitwise
//! deterministic** (the atomics' order varies from run to run, by rounding only); a
//! deterministic mode is not implemented yet ([`BackwardOptions::deterministic`] is a typed
//! error).

use crate::kernels::bwd_sm80::{self, BwdLaunch, BwdTiles};
use crate::kernels::DeviceProps;
use crate::params::{forward_params, supports, Params};
use crate::plan::{WorkspacePart, WorkspaceReq, WORKSPACE_ALIGN};
use softmax_core::{BufferLens, DType, Problem, ProblemError, RescalePolicy, Sequences};

/// Options of a backward call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackwardOptions {
    /// Ask for bitwise identical gradients on every run. Not implemented yet: `true` is a
    /// typed `Unsupported` error (the default path's dQ uses f32 atomics, see the module
    /// docs).
    pub deterministic: bool,
    /// Time the three kernels with CUDA events ([`crate::BackwardStats::kernel_ms`]; the
    /// call then waits for them).
    pub time_kernel: bool,
    /// Override the plan's tiles and code choices (tuning experiments; `None`: the tuned
    /// choice).
    pub tiles: Option<BwdTiles>,
}

/// A planned backward call: what runs, with which parameters, and the workspace it needs.
/// Computed once by [`plan_backward`] (or [`crate::Device::plan_backward`]); run any number
/// of times with [`crate::Device::backward_on_stream`] on tensors of the problem it was made
/// for.
#[derive(Clone, Debug, PartialEq)]
pub struct BackwardPlan {
    launch: BwdLaunch,
    workspace: WorkspaceReq,
    dtype: DType,
    props: DeviceProps,
    lens: BufferLens,
    lse_len: usize,
    /// Sequences in the batch (the prefix sums' length is this + 1).
    batch: usize,
    /// Whether the problem is packed (the run then takes device prefix sums).
    varlen: bool,
    pub(crate) params: Params,
}

impl BackwardPlan {
    /// The launch: the main kernel's variant, grids and shared memory.
    pub fn launch(&self) -> &BwdLaunch {
        &self.launch
    }
    /// The workspace the run needs.
    pub fn workspace(&self) -> &WorkspaceReq {
        &self.workspace
    }
    /// Bytes of workspace the run needs (the scratch-size companion of the run).
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.bytes
    }
    /// The dtype of every tensor of the call.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The device properties the plan was made for.
    pub fn props(&self) -> &DeviceProps {
        &self.props
    }
    /// The smallest buffers (elements) of the problem: Q, K, V (and dQ, dK, dV) and O (and dO).
    pub fn buffer_lens(&self) -> BufferLens {
        self.lens
    }
    /// Elements of the LSE.
    pub fn lse_len(&self) -> usize {
        self.lse_len
    }
    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Whether the run takes device prefix sums (a packed problem).
    pub fn is_varlen(&self) -> bool {
        self.varlen
    }
}

/// Whether fa-cuda's backward runs a validated problem with tensors of `dtype` (all of them:
/// Q, K, V, O, dO and the gradients): the forward's limits ([`crate::supports`]), no KV cache.
pub fn supports_backward(problem: &Problem, dtype: DType) -> Result<(), ProblemError> {
    supports(problem, dtype)?;
    if problem.has_kv_cache() {
        return Err(ProblemError::Unsupported {
            what: "the backward takes no KV cache (padded or paged): give K and V as sequences",
        });
    }
    Ok(())
}

/// The plan of a backward call: checks what this backend supports, picks the sm80 backward
/// variant and grids for the device `props` describes, sizes the workspace (f32 `D` and
/// `LSE·log2 e` per (row, head), the f32 dQ accumulator of `head_dim` columns per row; each
/// part [`WORKSPACE_ALIGN`]-aligned) and fills the kernel parameters. Pure: touches no device.
pub fn plan_backward(
    problem: &Problem,
    dtype: DType,
    opts: &BackwardOptions,
    props: &DeviceProps,
) -> Result<BackwardPlan, ProblemError> {
    supports_backward(problem, dtype)?;
    if opts.deterministic {
        return Err(ProblemError::Unsupported {
            what: "fa-cuda's deterministic backward is not implemented yet (dQ uses atomics)",
        });
    }
    let launch = bwd_sm80::plan_backward(problem, dtype, opts.tiles, props)?;
    let lse_len = problem.lse_len();
    let round = |x: usize| {
        x.checked_next_multiple_of(WORKSPACE_ALIGN)
            .ok_or(ProblemError::Overflow)
    };
    let row_bytes = lse_len.checked_mul(4).ok_or(ProblemError::Overflow)?;
    let acc_bytes = row_bytes
        .checked_mul(problem.head_dim())
        .ok_or(ProblemError::Overflow)?;
    let d_off = 0;
    let lse_off = round(row_bytes)?;
    let acc_off = lse_off
        .checked_add(round(row_bytes)?)
        .ok_or(ProblemError::Overflow)?;
    let total = acc_off
        .checked_add(round(acc_bytes)?)
        .ok_or(ProblemError::Overflow)?;
    let workspace = WorkspaceReq {
        bytes: total,
        align: WORKSPACE_ALIGN,
        parts: vec![
            WorkspacePart {
                name: "d",
                offset: d_off,
                bytes: row_bytes,
            },
            WorkspacePart {
                name: "lse_log2",
                offset: lse_off,
                bytes: row_bytes,
            },
            WorkspacePart {
                name: "dq_accum",
                offset: acc_off,
                bytes: acc_bytes,
            },
        ],
    };
    // The dense forward's block (strides, LSE layout, lengths, window, score factors) and
    // the scale that dK and dQ take; the backward reads no rescale threshold or query blocks.
    let params = Params {
        scale: problem.softmax_scale(),
        ..forward_params(problem, None, RescalePolicy::Always)
    };
    Ok(BackwardPlan {
        launch,
        workspace,
        dtype,
        props: *props,
        lens: problem.min_buffer_lens(),
        lse_len,
        batch: problem.batch(),
        varlen: matches!(
            problem.sequences(),
            Sequences::Varlen { .. } | Sequences::VarlenDevice { .. }
        ),
        params,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use softmax_core::ProblemDesc;

    const H200: DeviceProps = DeviceProps::h200();

    #[test]
    fn workspace_parts_are_aligned_and_cover_the_rows() {
        let p = ProblemDesc::new(2, 100, 300, 8, 2, 96)
            .causal()
            .validate(256)
            .expect("valid");
        let plan =
            plan_backward(&p, DType::Bf16, &BackwardOptions::default(), &H200).expect("plan");
        let ws = plan.workspace();
        let rows = 2 * 8 * 100;
        assert_eq!(ws.part("d").map(|d| d.bytes), Some(rows * 4));
        assert_eq!(ws.part("lse_log2").map(|d| d.bytes), Some(rows * 4));
        let acc = ws.part("dq_accum").expect("accumulator");
        assert_eq!(acc.bytes, rows * 96 * 4);
        assert!(ws.parts.iter().all(|p| p.offset % WORKSPACE_ALIGN == 0));
        assert!(acc.offset + acc.bytes <= ws.bytes);
        assert_eq!(plan.workspace_bytes(), ws.bytes);
        assert_eq!(plan.params.group, 4);
        assert_eq!((plan.params.lse_bs, plan.params.lse_hs), (800, 100));
        assert_eq!((plan.params.win_left, plan.params.win_right), (-1, 0));
        // Pure: the same inputs give the same plan.
        let again = plan_backward(&p, DType::Bf16, &BackwardOptions::default(), &H200);
        assert_eq!(again.as_ref(), Ok(&plan));
    }

    #[test]
    fn unsupported_requests_get_typed_errors() {
        let p = ProblemDesc::new(1, 10, 10, 2, 2, 64)
            .validate(256)
            .expect("valid");
        let opts = BackwardOptions::default();
        assert!(matches!(
            plan_backward(&p, DType::F32, &opts, &H200),
            Err(ProblemError::Unsupported { .. })
        ));
        let det = BackwardOptions {
            deterministic: true,
            ..opts
        };
        assert!(matches!(
            plan_backward(&p, DType::Bf16, &det, &H200),
            Err(ProblemError::Unsupported { .. })
        ));
        let used = [5u32];
        let cache = ProblemDesc::new(1, 1, 16, 2, 2, 64)
            .padded_cache(&used)
            .validate(256)
            .expect("valid");
        assert!(matches!(
            plan_backward(&cache, DType::Bf16, &opts, &H200),
            Err(ProblemError::Unsupported { .. })
        ));
        let odd = ProblemDesc::new(1, 10, 10, 2, 2, 60)
            .validate(256)
            .expect("valid");
        assert!(plan_backward(&odd, DType::Bf16, &opts, &H200).is_err());
    }

    #[test]
    fn varlen_plans_use_the_packed_layout() {
        let (cu_q, cu_k) = ([0u32, 5, 5, 40], [0u32, 7, 9, 9]);
        let p = ProblemDesc::varlen(&cu_q, &cu_k, 4, 2, 64)
            .window(Some(3), Some(2))
            .validate(256)
            .expect("valid");
        let plan = plan_backward(&p, DType::F16, &BackwardOptions::default(), &H200).expect("plan");
        assert!(plan.is_varlen());
        assert_eq!(plan.batch(), 3);
        assert_eq!(plan.params.q_strides[0], 0);
        assert_eq!((plan.params.lse_bs, plan.params.lse_hs), (0, 40));
        assert_eq!(plan.lse_len(), 4 * 40);
        assert_eq!(plan.launch().grid, Some((1, 2, 3)));
    }
}
