//! CUDA kernels of exact attention, compiled at run time by NVRTC through `cudarc`.
//!
//! Two forward kernel families: on Hopper (sm_90a) a `wgmma` kernel with TMA loads from a
//! producer warpgroup ([`kernels::sm90`], chosen by default there for dense problems), and
//! everywhere else (and as the fallback) FlashAttention-2's design written from scratch for sm_80 and newer
//! (`mma.sync.m16n8k16` with f32 accumulation, `ldmatrix`, `cp.async` loads overlapping the
//! matrix products, swizzled shared memory, P kept in registers, output normalised once):
//! bf16 and fp16, head dims that are multiples of 8 up to 256 (64/128/256 are the tuned
//! paths), causal (bottom-right aligned) and sliding-window masks with block skipping,
//! softcap, GQA/MQA, varlen, `seqlen_q ≠ seqlen_k` and the LSE. The online softmax follows
//! `softmax-core`'s rules (log2 domain, threshold rescale, empty rows → 0 and LSE −∞), and bad
//! input is rejected with `softmax-core`'s typed errors before anything runs.
//!
//! - [`Device`]: opens a GPU or wraps a caller's context (an error value, never a panic,
//!   where there is no driver, no NVRTC or no GPU), holds buffers ([`DeviceBuffer`]) and runs
//!   [`Device::forward`] / [`Device::forward_host`], or [`Device::forward_on_stream`] on
//!   caller memory ([`RawTensor`]; see "Embedding");
//! - [`compile`]: NVRTC compilation of any kernel family's variant to a cubin for the device's
//!   architecture, with ptxas' resource report (registers, spills), cached per process and on
//!   disk ([`compile::DiskCache`]: a second process loads the cubin instead of compiling;
//!   [`compile::precompile`] fills the cache without a GPU); [`ForwardStats::kernel_source`]
//!   says where a call's kernel came from;
//! - [`kernels`]: the registry of kernel families (sources embedded with `include_str!`: shared
//!   `common/*.cuh` headers, one directory per family), their variants and one launch-choice
//!   (plan) function per family, which takes the device's properties ([`DeviceProps`]).
//!
//! # Plan → workspace → run
//! Every pass follows one contract. A plan is a value made once on the host from the problem,
//! the dtype, the options and the device's properties (pure; no device is touched):
//! [`plan_forward`] → [`ForwardPlan`] for the forward, dense or over a KV cache (its
//! [`PlannedKernels`]: nothing, a dense launch of the sm80 or sm90 family, or the decode
//! family's decode + combine), [`plan_backward`] → [`BackwardPlan`] for the backward. A plan
//! holds the launch, the kernels' parameter block without the device addresses, and a
//! [`WorkspaceReq`] (bytes, alignment, named parts that the run carves from the same values).
//! [`Device::run_on_stream`] / [`Device::backward_on_stream`] check caller memory against the
//! plan and only launch: no allocation, no host copy, no synchronisation, so one plan serves
//! every layer of a decode step and a run can be captured in a CUDA graph. The older entries
//! ([`Device::forward_on_stream`], [`Device::forward_cache_on_stream`], the owned-buffer
//! layer) plan once per call and run the same path; [`Device::decode_workspace_bytes`] is the
//! plan's [`ForwardPlan::workspace_bytes`].
//!
//! Inside, every kernel shares three things: one parameter block (`kernels/common/params.cuh`'s
//! `AttnParams`, the Rust `Params`: the forward, decode, combine, append and backward kernels
//! each read their pass's fields), the device's one
//! kernel table (every family's loaded functions, by family and variant name) and one launch
//! helper (`cuLaunchKernelEx`, optionally a programmatic dependent launch).
//!
//! # Embedding (a runtime's context, stream and memory)
//! - **Context**: [`Device::open`] retains the device's *primary* context, the one the CUDA
//!   runtime and PyTorch use; [`Device::from_context`] takes any cudarc `CudaContext` the
//!   caller holds (primary or not) and [`Device::from_raw_context`] a raw `CUcontext`, which
//!   must be a primary context (cudarc cannot borrow another one without taking ownership).
//!   Kernels are loaded into that context; cudarc makes it current on the calling thread for
//!   each call.
//! - **Stream**: [`Device::forward_on_stream`] queues on the caller's stream (a cudarc
//!   `CudaStream` of the device's context, or a raw `CUstream` through
//!   [`Device::borrow_stream`]) and returns without waiting.
//! - **Memory**: Q, K, V, O and the LSE are [`RawTensor`]s, device addresses with lengths
//!   that the caller owns (`unsafe` [`RawTensor::from_raw`]: the memory must stay valid until
//!   the stream has passed the kernel). Lengths, null and misaligned addresses (16-byte bases,
//!   4 for the LSE) and overflow are typed errors before anything is queued; a launch error
//!   is returned.
//! - **Varlen**: host prefix sums (`Sequences::Varlen`) are copied on the caller's stream
//!   into memory freed in stream order; prefix sums already on the device go with
//!   `Sequences::VarlenDevice` (sizes only) and [`Device::forward_varlen_on_stream`]
//!   ([`CuSeqlens`], int32), with no copy; the kernel clamps them to the packed tensors.
//! - **Who synchronises**: the caller, before it reads the outputs or frees any buffer (or
//!   it orders that work after the stream). The owned-buffer layer ([`Device::upload`],
//!   [`DeviceBuffer`], [`Device::forward`], [`Device::time_forward`],
//!   [`Device::forward_host`]) runs the same path on the device's default stream and waits
//!   for the kernel before it returns.
//!
//! # Decode (KV cache)
//! A problem with a `softmax_core::KvCache` (padded with `seqused_k`, or paged through an
//! int32 block table, any block size) runs the decode family from every entry above: a
//! split-KV kernel (the query heads of a KV group and the sequence's few queries share one
//! tile, so each K/V byte is read once per group; causal and windows bottom-right against
//! `seqused_k`; softcap; LSE) whose splits are merged by a combine kernel with softmax-core's
//! merge rule (`kernels/common/merge.cuh`). The split count comes from the problem and the SM
//! count ([`num_splits_heuristic`]), or [`ForwardOptions::splits`]; [`ForwardStats::decode`]
//! reports the plan. On the owned-buffer path and [`Device::forward_on_stream`] the host
//! tables are copied and the split workspace allocated on the stream (freed in stream order);
//! [`Device::forward_cache_on_stream`] takes the tables on the device ([`CacheTables`]) and a
//! caller workspace of [`Device::decode_workspace_bytes`] bytes, with no copy or allocation,
//! and so does [`Device::run_on_stream`] with a [`ForwardPlan`] made once per decode step.
//! A paged cache of blocks of 8 keys or more (those the kernel reads whole) is read in address
//! order through a block walk ([`block_walk`]: each sequence's blocks sorted by physical index, with their
//! logical places for the masks): the owned path builds it per call, a runtime builds it once
//! per decode step and passes it in [`CacheTables::block_walk`] to every layer's call.
//! [`Device::append_kv`] / [`Device::append_kv_on_stream`] write new K/V tokens into the cache
//! at each sequence's used length (typed errors for a full cache or a bad block, cache
//! untouched).
//!
//! # Backward (training)
//! The sm80 backward family (`kernels/bwd_sm80/`, [`kernels::bwd_sm80`]; `mma.sync`, runs on
//! sm_80 and newer, Hopper included) in the plan → workspace → run contract:
//! [`plan_backward`] (pure: problem, dtype, [`BackwardOptions`], [`DeviceProps`]) gives a
//! [`BackwardPlan`] with the launch and a [`WorkspaceReq`] (f32 `D = rowsum(dO∘O)` and
//! `LSE·log2 e` per (row, head), the f32 dQ accumulator: `rows × head_dim`, linear in the
//! tokens); [`Device::backward_on_stream`] checks caller memory ([`BackwardTensors`]) and the
//! caller's workspace against it and only launches (pre-pass, main kernel, dQ post-pass);
//! [`Device::backward`] / [`Device::backward_host`] allocate the workspace and run the same
//! path. The main kernel owns a key block of one KV head (K, V in shared memory, dK and dV in
//! registers), recomputes `P` from the forward's LSE for every query block of every query
//! head of its GQA group (so dK/dV are summed over the group in a fixed order, without
//! H-times memory) and adds `dS·K` to the dQ accumulator with f32 atomics: **dQ is not
//! bitwise deterministic** from run to run (dK and dV are); a deterministic mode is a later
//! step ([`BackwardOptions::deterministic`] answers `Unsupported`). bf16 or fp16 (every
//! tensor of the call one dtype, gradients included), head dims multiples of 8 up to 256,
//! causal and sliding windows with query-block skipping, softcap (with its derivative),
//! GQA/MQA, varlen (host prefix sums on the owned paths, device ones on the run entry),
//! `seqlen_q ≠ seqlen_k`, rows that see no key (gradient 0). Tests: `tests/gpu_backward.rs`
//! against `fa-reference`'s f64 backward.
//!
//! # Performance (H200, bf16, 16k tokens, same-call PyTorch SDPA peers; docs/benchmarks.md)
//! The sm90 family (the default on Hopper) at seqlen 8k (docs/history/benchmarks-lab.md,
//! "Forward", the 60dffcd table): hdim 128 627 TFLOP/s non-causal and 591 causal (1.03× /
//! 1.10× cuDNN, 1.82× / 1.88× PyTorch's FlashAttention-2), hdim 256 698 / 623 (1.04× /
//! 1.06× cuDNN), hdim 64 412 / 391 (0.90× / 0.90×; 450 / 404 with the opt-in overlapped
//! pipeline). The sm80 family, at 8k: hdim
//! 128 1.09× FlashAttention-2 (non-causal) and 1.02× (causal), hdim 64 1.11× / 0.95×, hdim
//! 256 1.06× / 0.99×. [`ForwardOptions::family`] forces either family. Problems without a mask whose key tiles are all
//! full run a variant with no mask code; the 8-warp causal kernels run full tiles through a
//! copy of the tile body without it. Tile sizes come from measurements
//! (docs/history/gpu-notes.md); [`ForwardOptions::tiles`] overrides them, for tuning
//! experiments only.
//! `cargo run --release -p fa-cuda --example ptxas_report` prints every variant's registers
//! and spills without a GPU (and writes the cubins for `nvdisasm` with `--cubin-dir`).
//!
//! # Testing without a GPU
//! The unit tests, the NVRTC compile check (`tests/nvrtc_compile.rs`: every variant of every
//! family for sm_80 and sm_90a, the backward's included, no register spill) and the disk-cache tests (`tests/disk_cache.rs`) need no GPU; the check needs `libnvrtc` on the loader
//! path (`source .ci/install-nvrtc.sh`) and fails when `CI` is set and it is missing. The GPU
//! tests (`tests/gpu.rs`, `tests/gpu_decode.rs`, `tests/gpu_backward.rs`) are ignored by
//! default.
//!
//! # Example
//! ```no_run
//! use fa_cuda::{Device, ForwardOptions};
//! use half::bf16;
//! use softmax_core::{Out, ProblemDesc, Qkv, MAX_HEAD_DIM};
//!
//! # fn main() -> Result<(), fa_cuda::CudaError> {
//! let device = Device::open(0)?; // Err(CudaError::NoDriver) on a machine without CUDA
//! // GQA 4:1, validated once at the edge.
//! let problem = ProblemDesc::new(1, 300, 300, 8, 2, 128).causal().validate(MAX_HEAD_DIM)?;
//! let n_q = 300 * 8 * 128;
//! let n_kv = 300 * 2 * 128;
//! let q = vec![bf16::from_f32(0.1); n_q];
//! let k = vec![bf16::from_f32(0.2); n_kv];
//! let v = vec![bf16::from_f32(0.3); n_kv];
//! let mut out = vec![bf16::ZERO; n_q];
//! let mut lse = vec![0.0f32; 8 * 300];
//! let qkv = Qkv::new(&q[..], &k[..], &v[..]);
//! let out = Out::with_lse(&mut out[..], &mut lse[..]);
//! device.forward_host(&problem, qkv, out, &ForwardOptions::default())?;
//! # Ok(())
//! # }
//! ```

mod backward;
mod cache;
pub mod compile;
mod device;
mod error;
pub mod kernels;
mod params;
mod plan;
mod raw;
mod tma;

pub use backward::{plan_backward, supports_backward, BackwardOptions, BackwardPlan};
pub use compile::{precompile, KernelOrigin, PrecompileReport};
pub use device::{
    driver_available, BackwardInputs, BackwardStats, BackwardTensors, CudaElement, Device,
    DeviceBuffer, DeviceElement, DeviceOut, ForwardStats,
};
pub use error::CudaError;
pub use kernels::bwd_sm80::BwdTiles;
pub use kernels::decode::{block_walk, num_splits_heuristic, DecodeOverrides, DecodePlan};
pub use kernels::sm90::Pipeline as Sm90Pipeline;
pub use kernels::{
    arch_for, DeviceProps, ForwardVariant, KernelFamilyChoice, LaunchShape, Tiles, Variant,
};
pub use params::{supports, ForwardOptions};
pub use plan::{
    plan_forward, ForwardPlan, ForwardTensors, PlannedKernels, WorkspacePart, WorkspaceReq,
    WORKSPACE_ALIGN,
};
pub use raw::{CacheTables, CuSeqlens, RawOut, RawTensor};
pub use softmax_core::DType;
