//! The numerical core of exact, IO-aware attention, shared by every backend.
//!
//! `softmax(QKᵀ·scale)·V` computed tile by tile never holds the N×N score matrix; what makes
//! that exact is the bookkeeping in this crate, written once and reused by the CPU, CUDA and
//! FP8 backends (the CUDA kernels mirror the same rules and are tested to agree):
//!
//! - [`online`]: per-row running maximum and sum, the accumulator correction, the **merge** of
//!   two partial results (split-KV, ring attention), finalisation to `1/ℓ` and the LSE, and
//!   the one rule of a learnable attention sink ([`RowState::finish_with_sink`],
//!   [`sink_grad_term`]);
//! - [`rescale`]: when to rescale: always, or FlashAttention-4's threshold `τ`, with counters,
//!   and the one rule a threshold must meet for the type P is stored in
//!   ([`RescalePolicy::check`]);
//! - [`exp2`](mod@exp2): a software `exp2` (cubic + exponent-bit add) with an exhaustively
//!   measured error bound;
//! - [`mask`]: causal (bottom-right aligned) and sliding-window rules per element and per tile;
//! - [`problem`]: the problem description (shapes, strides, varlen, GQA, scale, softcap, mask,
//!   KV caches, attention sinks) and its validation, once, into a [`Problem`] that backends take, or a typed
//!   [`ProblemError`];
//! - [`tensors`]: the bundles a call's buffers travel in ([`Qkv`], [`Out`]), whatever holds
//!   them (host slices, device buffers);
//! - [`dtype`](mod@dtype): the one [`DType`] enum of the workspace;
//! - [`flops`]: the forward pass's FLOP count, the one formula every benchmark reports;
//! - [`score`]: raw dot product → scaled log2-domain score (with optional softcap).
//!
//! # Policies
//! - `#![no_std]`, no allocation; the `std` feature only adds `std::error::Error` impls.
//! - Scores live in the log2 domain (`x = s·scale·log2 e`), so every exponential is an `exp2`.
//! - A row that sees no key produces output 0 and LSE −∞, never NaN. NaN or ±∞ inside the
//!   inputs propagate as IEEE arithmetic does in the two-pass reference.
//! - Generic over `f32`/`f64` (through `num_traits::Float`) where that costs nothing; every
//!   `exp2`, `log2` and `tanh` is the `libm` crate's ([`LibmFloat`]), never `Float`'s, whose
//!   implementation Cargo's feature unification picks (the platform's math library when any
//!   crate in the build enables `num-traits/std`): results do not depend on what else is built.
//!
//! # Example
//! The online softmax of one row seen in two blocks, against the two-pass answer:
//! ```
//! use softmax_core::{RescalePolicy, RescaleStats, RowState};
//!
//! let scores = [1.0f64, 3.0, 5.0];
//! let to_log2 = |s: f64| s * core::f64::consts::LOG2_E;
//! let mut state = RowState::new();
//! let mut stats = RescaleStats::default();
//! let policy = RescalePolicy::Always;
//! let values = [10.0f64, 20.0, 30.0];
//! let mut acc = 0.0;
//!
//! let mut first = [to_log2(scores[0]), to_log2(scores[1])];
//! acc *= state.update(&mut first, &policy, &mut stats);
//! acc += first[0] * values[0] + first[1] * values[1];
//!
//! let mut second = [to_log2(scores[2])];
//! acc *= state.update(&mut second, &policy, &mut stats);
//! acc += second[0] * values[2];
//!
//! let out = acc * state.finish().inv_sum;
//! let weights: Vec<f64> = scores.iter().map(|s| (s - 5.0).exp()).collect();
//! let total: f64 = weights.iter().sum();
//! let expected: f64 = weights.iter().zip(values).map(|(w, v)| w * v).sum::<f64>() / total;
//! assert!((out - expected).abs() < 1e-12);
//! assert_eq!(stats.rescales, 1); // the max moved from 3 to 5 once
//! ```
#![no_std]
#![deny(unsafe_code)]

#[cfg(feature = "std")]
extern crate std;

pub mod append;
pub mod dtype;
pub mod error;
pub mod exp2;
pub mod flops;
pub mod libm_float;
pub mod mask;
pub mod online;
pub mod problem;
pub mod rescale;
pub mod score;
pub mod tensors;

pub use append::{Append, AppendDesc, AppendLens};
pub use dtype::DType;
pub use error::{ProblemError, Tensor};
pub use exp2::{exp2_cubic, EXP2_CUBIC, EXP2_CUBIC_MAX_REL_ERROR};
pub use libm_float::LibmFloat;
pub use mask::{Mask, TileKind};
pub use online::{merge_into, sink_grad_term, BlockStep, RowResult, RowState};
pub use problem::{
    explicit_scale, mask_from_flash, softcap_from_flash, thread_count, window_side, BufferLens,
    KvCache, Problem, ProblemDesc, SeqSpan, Sequences, Strides, MAX_HEAD_DIM,
    MAX_SCALE_OVER_SOFTCAP, MAX_SOFTCAP, MAX_SOFTMAX_SCALE,
};
pub use rescale::{RescalePolicy, RescaleStats, DEFAULT_RESCALE_THRESHOLD, MAX_RESCALE_THRESHOLD};
pub use score::{ScoreTransform, LOG2_E};
pub use tensors::{Extent, Grads, Out, Qkv};
