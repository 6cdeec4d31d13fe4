//! The tiled forward kernel, written once over [`crate::arch::Arch`] and run per
//! architecture through [`crate::dispatch`].
//!
//! # Layout: query rows along the vector lanes
//! A task owns a block of query rows (the rows of every query head of one GQA group, for a
//! range of query positions) and keeps them **transposed**: `Qᵀ[c][r]` (`head_dim × rows`),
//! the score tile `Sᵀ[j][r]` (`keys × rows`) and the accumulator `Oᵀ[c][r]`. Then
//! - `Sᵀ = K·Qᵀ` is a GEMM micro-kernel that broadcasts `K[j][c]` (K in its natural
//!   row-major layout: packing a K tile is a plain copy, no transposition) against vectors of
//!   `Qᵀ[c][r..r+W]`, `MR × NR` accumulators in registers;
//! - the online softmax runs down the key axis with one row per lane: row maxima and sums are
//!   vertical `max`/`add` of vectors (no horizontal reductions), `exp2` is vectorised;
//! - `Oᵀ += Vᵀ·Pᵀ` broadcasts `V[j][c]` (natural layout again) against vectors of `Pᵀ[j][r..]`,
//!   and the accumulator correction of the online softmax is folded into the load of `Oᵀ`.
//!
//! The transposed tiles are stored **panel-major**: the rows are cut into panels of `W·NR`
//! (the micro-kernels' width) and each panel is contiguous (`Qᵀ` panel `p` holds
//! `[c][W·NR]` at `p·d·W·NR`), so a micro-kernel walks unit-stride memory; a row-major
//! `[c][rows]` layout put every `Qᵀ` row a multiple of 1 KiB apart, into a handful of L1 sets.
//!
//! Q is transposed once per task and O once at the end; K and V tiles are copied (and widened
//! from bf16/f16) once per key tile for all the query heads of the group.
//!
//! # Modules
//! - [`tiling`]: the tile sizes ([`Tiling`]) and the plan: the list of [`tiling::Task`]s of a problem;
//! - [`scratch`]: per-thread buffers ([`Scratch`]) and the shared output ([`SharedOut`]);
//! - [`pack`]: widening to f32, transposes, packing K groups, prefetching rows;
//! - [`micro`]: the register-blocked `QKᵀ` and `PV` micro-kernels;
//! - [`rows`]: row-major micro-kernels (vectorised over the head dim) for tasks of at most
//!   one row vector, i.e. decode;
//! - [`mask`]: hiding the keys a row does not see within a tile;
//! - [`softmax`]: the online-softmax step of a panel, the vector exponentials over slices;
//! - [`forward_task`]: one task of the forward pass, the [`crate::dispatch::SimdTask`] that
//!   strings the steps above together;
//! - [`amx_task`]: the same task for bf16 inputs with both products on AMX tiles (its own
//!   packing: Q and P in the tiles' pair layout, Vᵀ), the rest shared with `forward_task`;
//! - [`decode_task`]: split-KV decode over the forward's tasks: the split plan, one split
//!   through the forward's tile loop into partial rows, the combine (`merge_into`, fixed order);
//! - [`decode_stream`]: split-KV decode's own inner loop for few rows per KV head (decode
//!   proper): K/V rows streamed straight from the cache, a run of KV heads per item;
//! - [`backward_task`]: the tasks of the backward pass (dK/dV per key block, dQ per query
//!   block), with probabilities recomputed from the saved LSE;
//! - [`amx_backward_task`]: the same tasks for bf16 inputs with the five products on AMX
//!   tiles (its own packing: bf16 rows, pair layouts), the element-wise step shared with
//!   `backward_task`.

// Only x86_64 has AMX tiles: elsewhere the kernel is compiled (and tested on emulated tiles)
// but never run.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) mod amx_backward_task;
pub(crate) mod amx_phases;
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) mod amx_task;
pub(crate) mod backward_gemm;
pub(crate) mod backward_task;
pub(crate) mod decode_stream;
pub(crate) mod decode_task;
pub(crate) mod forward_task;
pub(crate) mod mask;
pub(crate) mod micro;
pub(crate) mod pack;
pub(crate) mod phase_timing;
pub(crate) mod rows;
pub(crate) mod scratch;
pub(crate) mod softmax;
pub(crate) mod tiling;

#[cfg(feature = "internal-tests")]
#[allow(missing_docs)]
pub mod amx_backward_tests;
#[cfg(feature = "internal-tests")]
#[allow(missing_docs)]
pub mod amx_tests;
#[cfg(feature = "internal-tests")]
#[allow(missing_docs)]
pub mod backward_gemm_speed;
#[cfg(feature = "internal-tests")]
#[allow(missing_docs)]
pub mod backward_twin_tests;
#[cfg(feature = "internal-tests")]
#[allow(missing_docs)]
pub mod decode_stream_tests;
#[cfg(feature = "internal-tests")]
#[allow(missing_docs)]
pub mod twin_tests;

pub(crate) use forward_task::{Ctx, ForwardTask, TaskStats};
pub(crate) use scratch::{scratch_elems, Scratch, ScratchLens, SharedOut};
pub(crate) use tiling::{tasks, tasks_of_rows, Tiling};

/// The cache line (bytes) the scratch is aligned to and prefetches step by.
const CACHE_LINE: usize = 64;
