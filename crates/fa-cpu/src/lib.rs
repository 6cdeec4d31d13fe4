//! SIMD tiled CPU implementation of exact attention: the fallback for hosts without a GPU.
//!
//! [`forward`] computes `softmax(QKᵀ·scale)·V` (and the natural-log LSE) for everything a
//! [`softmax_core::ProblemDesc`] describes: f32, bf16 and f16 inputs with f32 accumulation,
//! any head dim `1..=256`, `seqlen_q ≠ seqlen_k`, causal (bottom-right) and sliding-window
//! masks with tile skipping, softcap, GQA/MQA, packed variable-length batches and strided
//! BSHD views, without ever holding an N×N matrix: a task keeps a block of query rows (all
//! the query heads of one GQA group) resident, streams key/value tiles through a
//! register-blocked micro-kernel, and runs `softmax-core`'s online softmax on each tile.
//!
//! - SIMD: AVX-512F, AVX2+FMA(+F16C) or portable code, detected once at run time
//!   ([`simd_level`]); bf16/f16 are widened to f32 when tiles are packed.
//! - Threads: rayon over (sequence, KV head, query block); results are bitwise identical for
//!   any thread count (the split never changes the arithmetic).
//! - Numerics: each row's running max and sum are `softmax-core`'s [`softmax_core::RowState`]
//!   (threshold rescaling by default). A vector of rows whose block maxima all keep their
//!   reference skips the per-row calls through the vector form of that one outcome of
//!   [`RescalePolicy::decide`], tested lane by lane against it; results are the same bits.
//! - Memory: per-thread scratch sized by the head dims and the tiling only
//!   ([`scratch_bytes_per_thread`]), reusable through a [`Workspace`].
//! - Plan → workspace → run: [`plan_forward`] decides a call once (checked options, SIMD
//!   level, variant, work list) into a [`ForwardPlan`] whose [`ForwardPlan::workspace`] says
//!   what memory it needs ([`WorkspaceReq`]); [`run_forward`] runs it on any tensors of its
//!   sizes and dtypes, so one plan serves every layer of a decode step ([`plan_backward`] /
//!   [`run_backward`] likewise). [`forward`] and [`backward`] are a plan and one run.
//! - Dtype-erased calls: [`forward_dyn`], [`backward_dyn`] and [`append_kv_dyn`] take
//!   [`TensorRef`]/[`TensorMut`] views and hold the one match from dtypes to the typed
//!   kernels; callers that learn the dtype at run time use them, and every kernel instance
//!   they reach is compiled in this crate once.
//! - [`backward`]: the gradients dQ, dK, dV with recomputation from the saved LSE, bitwise
//!   identical for any thread count (f32 arithmetic on the SIMD micro-kernels; bf16 inputs at
//!   [`SimdLevel::Amx`] run the five products on AMX tiles).
//! - Decode: problems with a KV cache (padded with `seqused_k`, or paged through a block
//!   table) run split-KV: each task's keys are cut into splits computed in parallel into
//!   partial rows (O unnormalised + the online-softmax state), merged in split order by
//!   `softmax_core::merge_into`; the split count comes from the problem
//!   ([`ForwardOptions::kv_splits`] overrides it). With few query rows per KV head (a GQA
//!   group × a few new tokens) a decode-specific loop runs: K and V rows read straight from
//!   the cache (no packing), several KV heads per work item so the cache streams
//!   contiguously, bf16/f16 widened in registers. [`append_kv`] writes new tokens into a
//!   cache in place.
//! - AMX: where the CPU has AMX-BF16 and Linux grants the tile-data permission,
//!   [`SimdLevel::Auto`] resolves to [`SimdLevel::Amx`] and bf16 and f16 forward calls run
//!   both products on AMX tiles (P rounded to bf16 before `P·V`: ~2e-3 normwise against the
//!   f64 reference, inside the bf16/f16 contract of 1e-2). f16 goes through conversion
//!   without losing its precision: each value is split exactly into two bf16 (`hi + lo`), and
//!   `Q·Kᵀ` takes three products (`hi·hi + hi·lo + lo·hi`), `P·V` two, so scores and the LSE
//!   are as exact as on the f32 FMAs (the CPUs at hand have no AMX-FP16). `simd:
//!   SimdLevel::Avx512f` in the call's options keeps AMX off. bf16 and f16 backward
//!   calls run all five products on AMX tiles too (P and dS rounded to bf16 before the
//!   gradient products: ~2e-3 normwise against the f64 reference, inside the contract of
//!   2e-2; f16's Q, K, V and dO split into two bf16 each as in the forward). The decode loop
//!   runs `Q·Kᵀ` of bf16 caches on the tiles at ≤ 16 query rows per KV head (exact products,
//!   f32 sums: the f32 bound), and its `P·V` too for bf16/f16 outputs at ≤ 8 rows per KV
//!   head, P rounded to bf16 ([`DecodeOptions::amx_pv`] set to `false` keeps that product in
//!   f32); the general split-KV path, f16 caches and probability hooks run through f32 FMAs. The tiles
//!   read K and V rows in place: a cache that starts on a 64-byte line, with rows a multiple
//!   of 64 bytes apart (PyTorch's CPU allocator places tensors so), loads one line per tile
//!   row; one 16 bytes past a line (a large NumPy array or `Vec`) loads two and ran ~1.27×
//!   slower from L2 on an AMX host (the same from DRAM). Without
//!   AMX, [`DecodeOptions::bf16_dots`] makes the decode's bf16 `Q·Kᵀ` multiply bf16 pairs
//!   with AVX512-BF16's `vdpbf16ps` (exact products, f32 sums; denormal inputs read as zero)
//!   instead of widening K: meant for AMD's Zen 4 and later, which issue it at the FMA's
//!   rate; off by default until an A/B on such a host says it pays.
//! - Options: every choice is the call's ([`ForwardOptions`], [`BackwardOptions`]); nothing
//!   is read from environment variables or kept in process-wide settings. The decode loop's
//!   knobs (prefetch schedule, AMX `P·V`, `vdpbf16ps`) are [`ForwardOptions::decode`].
//!
//! # Example
//! ```
//! use fa_cpu::{forward, ForwardOptions};
//! use softmax_core::{Out, ProblemDesc, Qkv, MAX_HEAD_DIM};
//!
//! // One sequence of 3 queries and 4 keys, 2 query heads sharing 1 KV head, head dim 8.
//! // Validated once, here at the edge; the backend takes the validated problem.
//! let problem = ProblemDesc::new(1, 3, 4, 2, 1, 8).causal().validate(MAX_HEAD_DIM)?;
//! let q: Vec<f32> = (0..3 * 2 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
//! let k: Vec<f32> = (0..4 * 8).map(|i| (i as f32 * 0.11).cos()).collect();
//! let v: Vec<f32> = (0..4 * 8).map(|i| i as f32).collect();
//! let mut out = vec![0.0f32; 3 * 2 * 8];
//! let mut lse = vec![0.0f32; 2 * 3];
//! let qkv = Qkv::new(&q[..], &k[..], &v[..]);
//! let stats = forward(&problem, qkv, Out::with_lse(&mut out, &mut lse), &ForwardOptions::default())?;
//! // Query 0 sits at key position 1 (bottom-right alignment): it sees keys 0 and 1, so its
//! // output is a convex combination of V rows 0 and 1.
//! assert!(out[..8].iter().zip(0..8).all(|(&o, c)| o >= c as f32 - 1e-4 && o <= (8 + c) as f32 + 1e-4));
//! assert!(lse.iter().all(|x| x.is_finite()));
//! assert_eq!(stats.tiles_computed, 1); // one panel of rows, one tile of keys
//! # Ok::<(), softmax_core::ProblemError>(())
//! ```

mod append;
mod arch;
mod backward;
mod dispatch;
mod element;
mod erased;
mod forward;
mod kernel;

pub use append::append_kv;
pub use arch::SimdLevel;
pub use backward::{
    backward, backward_scratch_bytes_per_thread, backward_with_workspace, plan_backward,
    run_backward, supports_backward, BackwardDTypes, BackwardInputs, BackwardOptions, BackwardPlan,
    BackwardStats, BackwardWorkspace, HostGrads,
};
pub use element::Element;
pub use erased::{
    append_kv_dyn, backward_dyn, forward_dyn, DynBackwardInputs, TensorMut, TensorRef,
    APPEND_DTYPES, BACKWARD_DTYPES, FORWARD_DTYPES,
};
pub use forward::{
    forward_with_workspace, plan_forward, run_forward, scratch_bytes_per_thread, supports,
    ForwardPlan, Workspace, WorkspaceReq, MAX_THREADS,
};
#[cfg(feature = "phase-timing")]
pub use kernel::amx_phases::{take_amx_forward_phases, AMX_FORWARD_PHASE_NAMES};
pub use kernel::decode_stream::{DecodeOptions, DecodePrefetch};

/// The crate's white-box tests (SIMD kernels against their scalar twins, emulated AMX tiles,
/// packers), compiled into the library under the `internal-tests` feature and run from
/// `tests/internal.rs`. Not part of the API.
///
/// They sit here, not under `#[cfg(test)]`, so that `cargo test` compiles the kernel tree
/// once: a `cfg(test)` build of the library compiled every kernel instance a second time, the
/// longest step of the CI's compile (see `Cargo.toml`).
#[cfg(feature = "internal-tests")]
#[doc(hidden)]
pub mod internal_tests {
    pub use crate::kernel::scratch::tests as scratch_tests;
    pub use crate::kernel::{
        amx_backward_tests, amx_tests, backward_gemm_speed, backward_twin_tests,
        decode_stream_tests, twin_tests,
    };
}
#[cfg(feature = "phase-timing")]
pub use kernel::phase_timing::{take_backward_phases, PHASE_NAMES as BACKWARD_PHASE_NAMES};

use softmax_core::{Out, Problem, ProblemError, Qkv, RescalePolicy, RescaleStats};

/// The output bundle of a host call: O and, optionally, the f32 LSE.
pub type HostOut<'a, O> = Out<&'a mut [O], &'a mut [f32]>;

/// Which `exp2` the softmax uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Exp2Impl {
    /// The default: [`Exp2Impl::Cubic`] in the AMX forward (bf16 and f16 inputs on AMX
    /// tiles), whose `P·V` product takes the probabilities rounded to bf16 (relative error up
    /// to 2⁻⁹, 26 times the cubic's 7.5e-5, so the cubic changes the result's accuracy by
    /// little), and [`Exp2Impl::Exact`] everywhere else: f32 inputs, the SIMD paths (whose P
    /// stays f32), the decode and the backward. On the GPU machine's Xeon (issue 18's 18
    /// shapes, 10 alternating rounds beside an A/A control; docs/history/gpu-notes.md,
    /// 2026-12-06) the cubic made the AMX forward 4.5 % faster at head dim 64, 1.5 % at 128
    /// and no faster at 256, where the tiles, not the exponentials, bound it.
    #[default]
    Auto,
    /// Accurate vectorised `exp2` (a degree-5 polynomial fitted for relative error after
    /// round-to-nearest range reduction; relative error below 3e-7, measured in the tests):
    /// keeps f32 within the 1e-5 normwise bound.
    Exact,
    /// FlashAttention-4's cubic ([`softmax_core::EXP2_CUBIC`], relative error 7.5e-5),
    /// vectorised: fewer operations, accurate enough for bf16/f16 but not for the f32 bound.
    Cubic,
}

impl Exp2Impl {
    /// Whether a kernel uses the cubic: asked for, or [`Exp2Impl::Auto`] in a kernel whose
    /// `P·V` rounds P to bf16 (`p_to_bf16`: the AMX forward).
    pub(crate) fn cubic(self, p_to_bf16: bool) -> bool {
        match self {
            Exp2Impl::Auto => p_to_bf16,
            Exp2Impl::Exact => false,
            Exp2Impl::Cubic => true,
        }
    }
}

/// A function applied to tiles of unnormalised probabilities (see
/// [`ForwardOptions::probability_hook`]).
pub type ProbabilityHook<'a> = &'a (dyn Fn(&mut [f32]) + Sync);

/// Options of a forward call.
#[derive(Clone, Copy)]
pub struct ForwardOptions<'a> {
    /// Threads in all, the calling thread included: `Some(n)` runs on the caller and a pool
    /// of `n − 1` threads kept in the workspace (`Some(1)` starts none); `None`: the caller
    /// and rayon's global pool, as many as that pool has threads. Results are identical
    /// whatever the count. `Some(0)` and more than [`MAX_THREADS`] are errors
    /// ([`ProblemError::ZeroDim`], [`ProblemError::TooManyThreads`]).
    pub threads: Option<usize>,
    /// When to rescale the accumulators (default: `Threshold(8.0)`, FlashAttention-4's).
    pub rescale: RescalePolicy<f32>,
    /// The exponential (default [`Exp2Impl::Auto`]: the cubic in the AMX forward, else the
    /// exact one).
    pub exp2: Exp2Impl,
    /// Called on every block of unnormalised probabilities `exp2(x − m)` just before the P·V
    /// product (after the row sums are taken), as a row-major `rows × keys` slice: one panel
    /// of the task's query rows (the micro-kernels' row count, padding rows included) by the
    /// tile's keys; masked entries are 0; panels the mask hides entirely are not passed. Meant
    /// for element-wise changes (fa-fp8 quantises P with it). `None`: nothing is called and
    /// nothing is copied.
    pub probability_hook: Option<ProbabilityHook<'a>>,
    /// The instruction set (default [`SimdLevel::Auto`]); asking for one the CPU lacks is an
    /// error.
    pub simd: SimdLevel,
    /// Split-KV: cut each task's visible keys into this many splits (at most one per key
    /// tile of 64–132 keys), merged afterwards by LSE (`softmax_core::merge_into`, in split
    /// order). `None`: problems with a KV cache choose the count from the problem (enough
    /// work items for a many-core host, at least ~256 keys per split; never from the thread
    /// count, so results stay bitwise identical for any count); others run unsplit.
    /// `Some(n)` forces `n` (and the split path) on any problem; results agree with the
    /// unsplit call to rounding. `Some(0)` is an error.
    pub kv_splits: Option<usize>,
    /// The split-KV decode's streaming loop (KV-cache problems with few query rows per KV
    /// head): its prefetch schedule, whether its `P·V` runs on AMX tiles, whether its bf16
    /// `Q·Kᵀ` uses `vdpbf16ps` (default: [`DecodeOptions::default`], the tuned choice).
    pub decode: DecodeOptions,
}

impl Default for ForwardOptions<'_> {
    fn default() -> Self {
        ForwardOptions {
            threads: None,
            rescale: RescalePolicy::default(),
            exp2: Exp2Impl::default(),
            probability_hook: None,
            simd: SimdLevel::Auto,
            kv_splits: None,
            decode: DecodeOptions::default(),
        }
    }
}

impl std::fmt::Debug for ForwardOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwardOptions")
            .field("threads", &self.threads)
            .field("rescale", &self.rescale)
            .field("exp2", &self.exp2)
            .field("probability_hook", &self.probability_hook.map(|_| "Fn"))
            .field("simd", &self.simd)
            .field("kv_splits", &self.kv_splits)
            .field("decode", &self.decode)
            .finish()
    }
}

/// What a forward call did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForwardStats {
    /// Rescale decisions, summed over rows and key tiles.
    pub rescale: RescaleStats,
    /// (row panel, key tile) pairs computed: a row panel is the micro-kernels' block of
    /// query rows (16 with AVX2, 48 with AVX-512, 16 scalar), a key tile 64–66 keys. In the
    /// decode loop (few rows per KV head) a "panel" is one work item's rows (a run of KV
    /// heads' query rows) and a tile 64 keys.
    pub tiles_computed: u64,
    /// (row panel, key tile) pairs skipped because the mask hides them entirely.
    pub tiles_skipped: u64,
    /// The largest number of key splits of any task (1: unsplit).
    pub kv_splits: usize,
}

/// Exact attention forward: writes `out` (BSHD, the problem's O strides) and, if given, the
/// natural-log LSE (`[batch, heads_q, seqlen_q]`, or `[heads_q, total_q]` when packed).
///
/// Scratch (a few MiB per worker at most) and, when [`ForwardOptions::threads`] is set, the
/// thread pool are cached per calling thread and reused by the next call; use
/// [`forward_with_workspace`] to own them instead.
///
/// `problem` was validated by the caller ([`softmax_core::ProblemDesc::validate`]); this call
/// checks what is its own (buffer lengths, the rescale threshold, the SIMD level, the thread
/// count; KV-cache layouts are not supported yet) before anything is written: on error the
/// outputs are untouched. NaN/∞ in the inputs propagate
/// as in the f64 reference; a row that sees no key gets output 0 and LSE −∞. One difference
/// from the reference, shared with FlashAttention: a masked key inside a computed tile gets
/// probability 0, so an ∞ or NaN in its V row still reaches the row as `0·∞ = NaN`.
///
/// Work is split into tasks of up to ~1000 query rows (all query heads of a GQA group ×
/// a block of positions); each task streams 64–66-key tiles of K and V (twice that for
/// unmasked head dims up to 64), packed (and widened from bf16/f16) once per tile for all
/// its rows, and runs each panel of rows through the whole tile — `QKᵀ`, online softmax,
/// `PV` — while its scores are in L1, with register-blocked micro-kernels (AVX2: 6 keys ×
/// 16 rows for `QKᵀ`, 6 channels × 16 rows for `PV`; AVX-512: 8 × 48).
pub fn forward<T: Element, O: Element>(
    problem: &Problem,
    qkv: Qkv<&[T]>,
    out: HostOut<'_, O>,
    opts: &ForwardOptions,
) -> Result<ForwardStats, ProblemError> {
    thread_local! {
        // Each calling thread keeps its scratch and (with `threads` set) its pool between
        // calls: a new pool per call costs thread start-ups, new scratch page faults.
        static CACHED: std::cell::RefCell<Workspace> = std::cell::RefCell::new(Workspace::new());
    }
    CACHED.with(|cached| match cached.try_borrow_mut() {
        Ok(mut ws) => forward_with_workspace(problem, qkv, out, opts, &mut ws),
        // Re-entered (e.g. from a probability hook): use a fresh workspace.
        Err(_) => forward_with_workspace(problem, qkv, out, opts, &mut Workspace::new()),
    })
}

/// The instruction set the dispatch picks on this CPU: `"avx512f+amx"`, `"avx512f"`,
/// `"avx2+fma"` or `"scalar"` (detected once, cached).
pub fn simd_level() -> &'static str {
    SimdLevel::Auto.resolve().name()
}
