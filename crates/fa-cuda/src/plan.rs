//! The plan → workspace → run contract every pass follows: a plan is a value computed once,
//! on the host, from the problem, the dtype, the options and the device's properties (pure:
//! it touches no device); it holds what runs (variant, grid), the kernels' parameter block
//! without the device addresses, and the workspace the run needs ([`WorkspaceReq`]: bytes,
//! alignment, named parts, carved by the run from the same values). A run checks the
//! caller's memory against the plan and only launches, so one plan serves any number of
//! runs: every layer of a decode step, or the replays of a captured CUDA graph.
//!
//! [`plan_forward`] → [`ForwardPlan`] covers the forward pass, dense (the sm80 or sm90
//! family) and over a KV cache (the decode family: split-KV decode, then its combine);
//! [`crate::plan_backward`] → [`crate::BackwardPlan`] the backward. Both share
//! [`WorkspaceReq`], the device's one kernel table and its one launch helper.

use crate::error::CudaError;
use crate::kernels::decode::{decode_params, plan_decode, DecodePlan};
use crate::kernels::{plan_forward as plan_launch, DeviceProps, LaunchShape};
use crate::params::{forward_params, supports, ForwardOptions, Params};
use crate::raw::{
    check_cu_seqlens, check_len, check_ptr, check_table_lens, CacheTables, CuSeqlens, RawOut,
    RawTensor,
};
use softmax_core::{BufferLens, DType, KvCache, Problem, ProblemError, Qkv, Sequences, Tensor};

/// One named part of a workspace: where it starts and how long it is, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkspacePart {
    /// The part's name (e.g. `"dq_accum"`).
    pub name: &'static str,
    /// Offset from the workspace's start (aligned as the part's use needs; the backward's
    /// parts are multiples of [`WORKSPACE_ALIGN`]).
    pub offset: usize,
    /// Length.
    pub bytes: usize,
}

/// The device memory a planned call needs besides its tensors: total bytes, the alignment of
/// the base address, and the named parts the run carves out of it (the same values the plan
/// computed: size and use cannot drift).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkspaceReq {
    /// Total bytes (0: no workspace needed).
    pub bytes: usize,
    /// Alignment of the base address in bytes.
    pub align: usize,
    /// The parts, in address order.
    pub parts: Vec<WorkspacePart>,
}

/// Alignment of the backward workspace and of each of its parts.
pub const WORKSPACE_ALIGN: usize = 256;

impl WorkspaceReq {
    /// No workspace.
    pub fn none() -> WorkspaceReq {
        WorkspaceReq {
            bytes: 0,
            align: 1,
            parts: Vec::new(),
        }
    }

    /// The part called `name`.
    pub fn part(&self, name: &str) -> Option<WorkspacePart> {
        self.parts.iter().copied().find(|p| p.name == name)
    }

    /// Checks a caller's workspace against the requirement (length, then a non-null,
    /// aligned base whose range does not wrap); returns its base address (0 when none is
    /// needed).
    pub(crate) fn check(&self, ws: &RawTensor<u8>) -> Result<u64, CudaError> {
        if self.bytes == 0 {
            return Ok(0);
        }
        if ws.len() < self.bytes {
            return Err(CudaError::WorkspaceTooSmall {
                needed: self.bytes,
                len: ws.len(),
            });
        }
        if ws.ptr() == 0 || ws.ptr() % self.align as u64 != 0 {
            return Err(CudaError::BadWorkspace { ptr: ws.ptr() });
        }
        ws.ptr()
            .checked_add(ws.len() as u64)
            .ok_or(ProblemError::Overflow)?;
        Ok(ws.ptr())
    }

    /// The address of part `name` in a workspace at `base` (0: no workspace or no such part).
    pub(crate) fn at(&self, base: u64, name: &str) -> u64 {
        match (base, self.part(name)) {
            (0, _) | (_, None) => 0,
            (base, Some(p)) => base + p.offset as u64,
        }
    }
}

/// Base alignment of the 16-byte row loads and stores (strides are multiples of 8 elements),
/// and of the decode family's workspace.
pub(crate) const ROW_ALIGN: u64 = 16;

/// What a planned forward call launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlannedKernels {
    /// Nothing to compute (no query, or no key-value pair).
    Nothing,
    /// A dense forward: one launch of the sm80 or sm90 family.
    Forward(LaunchShape),
    /// A KV-cache forward: the decode kernel, then the combine when it splits the keys.
    Decode(DecodePlan),
}

/// How the problem's sequences reach the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PrefixSums {
    /// Fixed-length sequences: none.
    None,
    /// Host prefix sums: the owned paths copy them, a run takes them on the device.
    Host,
    /// Prefix sums that live on the device only.
    Device,
}

/// What the run needs to know about the problem's extents besides the buffer lengths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dims {
    pub batch: usize,
    pub total_q: usize,
    pub total_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
}

/// A planned forward call (dense or over a KV cache): what runs, with which parameters, and
/// the workspace it needs. Made once by [`plan_forward`] (or [`crate::Device::plan_forward`])
/// and run any number of times with [`crate::Device::run_on_stream`] on tensors of the
/// problem it was made for; a KV-cache plan serves every layer of a decode step whose
/// tables are the same.
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardPlan {
    kernels: PlannedKernels,
    workspace: WorkspaceReq,
    dtype: DType,
    props: DeviceProps,
    lens: BufferLens,
    prefix_sums: PrefixSums,
    /// `Some(blocks per sequence)` for a paged cache, `Some(None)` for a padded one.
    cache: Option<Option<usize>>,
    time_kernel: bool,
    pub(crate) dims: Dims,
    pub(crate) params: Params,
}

impl ForwardPlan {
    /// What the plan launches.
    pub fn kernels(&self) -> &PlannedKernels {
        &self.kernels
    }
    /// The dense launch, when the plan has one.
    pub fn launch(&self) -> Option<LaunchShape> {
        match self.kernels {
            PlannedKernels::Forward(l) => Some(l),
            _ => None,
        }
    }
    /// The decode launch, when the plan has one.
    pub fn decode(&self) -> Option<DecodePlan> {
        match self.kernels {
            PlannedKernels::Decode(d) => Some(d),
            _ => None,
        }
    }
    /// The workspace the run needs.
    pub fn workspace(&self) -> &WorkspaceReq {
        &self.workspace
    }
    /// Bytes of workspace the run needs (0: none).
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.bytes
    }
    /// The dtype of Q, K, V and O.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The device properties the plan was made for.
    pub fn props(&self) -> &DeviceProps {
        &self.props
    }
    /// The smallest buffers (elements) the run takes: Q, K, V, O and the LSE.
    pub fn buffer_lens(&self) -> BufferLens {
        self.lens
    }
    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.dims.batch
    }
    /// Whether the run takes prefix sums on the device (a packed problem).
    pub fn is_varlen(&self) -> bool {
        self.prefix_sums != PrefixSums::None
    }
    /// Whether the run takes KV-cache tables.
    pub fn has_kv_cache(&self) -> bool {
        self.cache.is_some()
    }
    /// Whether runs time their kernels ([`ForwardOptions::time_kernel`]).
    pub fn times_kernel(&self) -> bool {
        self.time_kernel
    }
}

/// The plan of a forward call: checks what this backend supports (and the τ rule for the
/// dtype), picks the kernels for the device `props` describes — a KV-cache problem the decode
/// family ([`plan_decode`]), any other the forward family [`ForwardOptions::family`] allows
/// ([`crate::kernels::plan_forward`]) —, sizes the workspace (the decode's split partials:
/// part `"o_part"`, f32 `[splits, batch, heads_q, seqlen_q, head_dim_v]`, then `"ml_part"`,
/// the (m, l) pairs; 16-byte aligned) and fills the kernels' parameters. Pure: touches no
/// device.
pub fn plan_forward(
    problem: &Problem,
    dtype: DType,
    opts: &ForwardOptions,
    props: &DeviceProps,
) -> Result<ForwardPlan, ProblemError> {
    supports(problem, dtype)?;
    // P is stored as a 16-bit operand of the inputs' dtype and reaches 2^tau.
    opts.rescale.check(dtype.max_finite(), 0.0)?;
    let (kernels, params, workspace) = if problem.has_kv_cache() {
        match plan_decode(problem, dtype, opts.into(), props)? {
            None => (
                PlannedKernels::Nothing,
                Params::default(),
                WorkspaceReq::none(),
            ),
            Some(plan) => {
                let (params, ml_offset) = decode_params(problem, &plan, opts.rescale);
                let workspace = if plan.workspace_bytes == 0 {
                    WorkspaceReq::none()
                } else {
                    let ml = ml_offset * 4;
                    WorkspaceReq {
                        bytes: plan.workspace_bytes,
                        align: ROW_ALIGN as usize,
                        parts: vec![
                            WorkspacePart {
                                name: "o_part",
                                offset: 0,
                                bytes: ml,
                            },
                            WorkspacePart {
                                name: "ml_part",
                                offset: ml,
                                bytes: plan.workspace_bytes - ml,
                            },
                        ],
                    }
                };
                (PlannedKernels::Decode(plan), params, workspace)
            }
        }
    } else {
        let launch = plan_launch(
            problem,
            dtype,
            opts.family,
            opts.tiles,
            opts.sm90_pipeline,
            props,
        )?;
        let params = forward_params(problem, launch.as_ref(), opts.rescale);
        let kernels = launch.map_or(PlannedKernels::Nothing, PlannedKernels::Forward);
        (kernels, params, WorkspaceReq::none())
    };
    let cache = match problem.kv_cache() {
        KvCache::None => None,
        KvCache::Padded { .. } => Some(None),
        KvCache::Paged { blocks_per_seq, .. } => Some(Some(blocks_per_seq)),
    };
    Ok(ForwardPlan {
        kernels,
        workspace,
        dtype,
        props: *props,
        lens: problem.min_buffer_lens(),
        prefix_sums: match problem.sequences() {
            Sequences::Varlen { .. } => PrefixSums::Host,
            Sequences::VarlenDevice { .. } => PrefixSums::Device,
            _ => PrefixSums::None,
        },
        cache,
        time_kernel: opts.time_kernel,
        dims: Dims {
            batch: problem.batch(),
            total_q: problem.total_q(),
            total_k: problem.total_k(),
            heads_q: problem.heads_q(),
            heads_kv: problem.heads_kv(),
            head_dim: problem.head_dim(),
            head_dim_v: problem.head_dim_v(),
        },
        params,
    })
}

/// The caller memory of a planned forward run: Q, K, V, O (and the LSE), the prefix sums of
/// a packed problem and the tables of a KV-cache problem, all on the device (valid as
/// [`RawTensor::from_raw`] requires).
#[derive(Debug)]
pub struct ForwardTensors<T> {
    /// Q, K, V.
    pub qkv: Qkv<RawTensor<T>>,
    /// O and, optionally, the f32 LSE.
    pub out: RawOut<T>,
    /// The prefix sums: required for a packed problem (the same values as the problem's host
    /// ones where it has them), absent otherwise.
    pub cu_seqlens: Option<CuSeqlens>,
    /// The cache tables: required for a KV-cache problem, absent otherwise.
    pub tables: Option<CacheTables>,
}

/// Where the run's inputs come from: the caller's device memory, or the owned paths' copies
/// of the problem's host tables and their stream-ordered workspace (filled in after the
/// check).
pub(crate) enum Source {
    /// [`ForwardTensors::cu_seqlens`], [`ForwardTensors::tables`] and this workspace.
    Caller(RawTensor<u8>),
    /// Copied and allocated by the owned path after the check.
    Owned,
}

/// Checks a run's memory against the plan, touching nothing: the dtype and device, the
/// lengths, every address (16-byte bases, 4 for the LSE, prefix sums and tables), and with
/// [`Source::Caller`] the prefix sums, tables and workspace. Returns the parameter block with
/// the caller's addresses filled in and whether the decode walks the blocks.
pub(crate) fn check_run<T: crate::CudaElement>(
    plan: &ForwardPlan,
    t: &ForwardTensors<T>,
    source: &Source,
    props: &DeviceProps,
) -> Result<Params, CudaError> {
    if plan.dtype != T::DTYPE {
        return Err(ProblemError::Unsupported {
            what: "the tensors' dtype is not the one the forward plan was made for",
        }
        .into());
    }
    if plan.props != *props {
        return Err(ProblemError::Unsupported {
            what: "the forward plan was made for another device",
        }
        .into());
    }
    let lens = plan.lens;
    let Qkv { q, k, v } = &t.qkv;
    for (tensor, x, needed) in [
        (Tensor::Q, q, lens.q),
        (Tensor::K, k, lens.k),
        (Tensor::V, v, lens.v),
        (Tensor::O, &t.out.o, lens.o),
    ] {
        check_len(tensor, x, needed)?;
    }
    if let (Some(l), Some(needed)) = (&t.out.lse, lens.lse) {
        check_len(Tensor::Lse, l, needed)?;
    }
    for (tensor, x) in [
        (Tensor::Q, q),
        (Tensor::K, k),
        (Tensor::V, v),
        (Tensor::O, &t.out.o),
    ] {
        check_ptr(tensor, x, ROW_ALIGN)?;
    }
    if let Some(lse) = &t.out.lse {
        check_ptr(Tensor::Lse, lse, 4)?;
    }
    let mut params = Params {
        q: q.ptr(),
        k: k.ptr(),
        v: v.ptr(),
        o: t.out.o.ptr(),
        lse: t.out.lse.map_or(0, |l| l.ptr()),
        ..plan.params
    };
    let caller_ws = match source {
        Source::Owned => {
            if t.cu_seqlens.is_some() || t.tables.is_some() {
                return Err(ProblemError::Unsupported {
                    what: "device prefix sums go with Sequences::VarlenDevice only",
                }
                .into());
            }
            if plan.prefix_sums == PrefixSums::Device {
                return Err(ProblemError::Unsupported {
                    what: "a problem with device prefix sums needs them: forward_varlen_on_stream",
                }
                .into());
            }
            return Ok(params);
        }
        Source::Caller(ws) => ws,
    };
    match (plan.prefix_sums, &t.cu_seqlens) {
        (PrefixSums::None, Some(_)) => {
            return Err(ProblemError::Unsupported {
                what: "device prefix sums go with a packed problem only",
            }
            .into())
        }
        (PrefixSums::None, None) => {}
        (_, None) => {
            return Err(ProblemError::Unsupported {
                what: "a packed problem needs its prefix sums on the device",
            }
            .into())
        }
        (_, Some(cu)) => (params.cu_q, params.cu_k) = check_cu_seqlens(plan.dims.batch, cu)?,
    }
    match (plan.cache, &t.tables) {
        (None, Some(_)) => {
            return Err(ProblemError::Unsupported {
                what: "device cache tables go with a KV-cache problem",
            }
            .into())
        }
        (None, None) => {}
        (Some(_), None) => {
            return Err(ProblemError::Unsupported {
                what: "a KV-cache problem needs its cache tables on the device",
            }
            .into())
        }
        (Some(blocks_per_seq), Some(tables)) => {
            let (used, table, walk) = check_table_lens(plan.dims.batch, blocks_per_seq, tables)?;
            params.seqused_k = used;
            params.block_table = table;
            params.block_walk = match plan.decode() {
                Some(d) if d.block_walk => walk,
                _ => 0,
            };
        }
    }
    let base = plan.workspace.check(caller_ws)?;
    set_workspace(plan, &mut params, base);
    Ok(params)
}

/// Points the decode's split partials at a workspace at `base` (0: none).
pub(crate) fn set_workspace(plan: &ForwardPlan, params: &mut Params, base: u64) {
    params.o_part = plan.workspace.at(base, "o_part");
    params.ml_part = plan.workspace.at(base, "ml_part");
}

#[cfg(test)]
mod tests {
    use super::*;
    use softmax_core::ProblemDesc;

    const H200: DeviceProps = DeviceProps::h200();

    #[test]
    fn workspace_is_checked() {
        let at = |ptr: u64, len: usize| {
            // SAFETY: only the host-side check sees it.
            unsafe { RawTensor::<u8>::from_raw(ptr, len) }
        };
        let req = WorkspaceReq {
            bytes: 64,
            align: 16,
            parts: vec![],
        };
        assert_eq!(WorkspaceReq::none().check(&at(0, 0)), Ok(0));
        assert_eq!(
            req.check(&at(0, 0)),
            Err(CudaError::WorkspaceTooSmall { needed: 64, len: 0 })
        );
        assert_eq!(
            req.check(&at(0x1000, 60)),
            Err(CudaError::WorkspaceTooSmall {
                needed: 64,
                len: 60
            })
        );
        assert_eq!(
            req.check(&at(0x1008, 64)),
            Err(CudaError::BadWorkspace { ptr: 0x1008 })
        );
        assert_eq!(req.check(&at(0x1000, 64)), Ok(0x1000));
    }

    #[test]
    fn a_decode_plan_carves_its_split_workspace() {
        let used = [4000u32];
        let p = ProblemDesc::new(1, 1, 4096, 64, 8, 128)
            .padded_cache(&used)
            .validate(256)
            .expect("valid");
        let plan = plan_forward(&p, DType::Bf16, &ForwardOptions::default(), &H200).expect("plan");
        let d = plan.decode().expect("a decode launch");
        assert!(d.num_splits > 1);
        let ws = plan.workspace();
        assert_eq!(ws.bytes, d.workspace_bytes);
        let o = ws.part("o_part").expect("partials");
        let ml = ws.part("ml_part").expect("(m, l)");
        assert_eq!(o.bytes, d.num_splits as usize * 64 * 128 * 4);
        assert_eq!(ml.offset, o.bytes);
        assert_eq!(ml.offset + ml.bytes, ws.bytes);
        assert_eq!(ml.bytes, d.num_splits as usize * 64 * 2 * 4);
        assert!(plan.has_kv_cache() && !plan.is_varlen());
        // Pure: the same inputs give the same plan.
        let again = plan_forward(&p, DType::Bf16, &ForwardOptions::default(), &H200);
        assert_eq!(again.as_ref(), Ok(&plan));
    }

    #[test]
    fn a_run_is_checked_against_its_plan() {
        let at = |ptr: u64, len: usize| {
            // SAFETY: only the host-side checks see it; nothing is launched.
            unsafe { RawTensor::<half::bf16>::from_raw(ptr, len) }
        };
        let p = ProblemDesc::new(1, 64, 64, 2, 2, 64)
            .validate(256)
            .expect("valid");
        let plan = plan_forward(&p, DType::Bf16, &ForwardOptions::default(), &H200).expect("plan");
        let lens = plan.buffer_lens();
        let mut t = ForwardTensors {
            qkv: Qkv::new(
                at(0x10_0000, lens.q),
                at(0x20_0000, lens.k),
                at(0x30_0000, lens.v),
            ),
            out: RawOut::new(at(0x40_0000, lens.o)),
            cu_seqlens: None,
            tables: None,
        };
        // SAFETY: an empty workspace at a made-up address; never dereferenced.
        let ws = Source::Caller(unsafe { RawTensor::from_raw(0, 0) });
        let params = check_run(&plan, &t, &ws, &H200).expect("valid run");
        assert_eq!((params.q, params.o), (0x10_0000, 0x40_0000));
        assert!(check_run(&plan, &t, &ws, &DeviceProps::a100()).is_err());
        t.out.o = at(0x40_0000, lens.o - 1);
        assert!(matches!(
            check_run(&plan, &t, &ws, &H200),
            Err(CudaError::Problem(ProblemError::BufferTooSmall {
                tensor: Tensor::O,
                ..
            }))
        ));
    }
}
