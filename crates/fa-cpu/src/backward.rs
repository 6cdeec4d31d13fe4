//! The backward pass: validation, the thread pool, the dispatch of each task (the tasks
//! themselves are in `kernel::backward_task`).

use crate::arch::SimdLevel;
use crate::dispatch::dispatch;
use crate::dispatch::Isa;
use crate::forward::{check_level_and_threads, ensure_pool, AmxTiles};
use crate::kernel::amx_backward_task::{AmxBackwardTask, AmxBwdLens, AmxBwdScratch};
use crate::kernel::amx_task::{AmxInputs, HalfKind};
use crate::kernel::backward_task::{
    backward_tasks, BackwardTask, BwdCtx, BwdLens, BwdScratch, BwdStats, BwdTask,
};
use crate::kernel::SharedOut;
use crate::{supports, Element};
use softmax_core::{BufferLens, Grads, Problem, ProblemError, Qkv, Tensor};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

/// What the backward pass reads besides Q, K and V: the forward's output O and its LSE, and
/// the gradient of the loss with respect to O.
#[derive(Clone, Copy, Debug)]
pub struct BackwardInputs<'a, O> {
    /// The forward's output (the problem's O layout).
    pub o: &'a [O],
    /// `∂L/∂O` (the problem's O layout).
    pub d_o: &'a [O],
    /// The forward's natural-log LSE (`[batch, heads_q, seqlen_q]`, or `[heads_q, total_q]`
    /// when packed), as [`crate::forward`] writes it.
    pub lse: &'a [f32],
}

/// The gradient bundle of a host call: dQ, dK, dV laid out as Q, K, V.
pub type HostGrads<'a, G> = Grads<&'a mut [G]>;

/// Options of a backward call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackwardOptions {
    /// Threads in all, the calling thread included: `Some(n)` runs on the caller and a pool
    /// of `n − 1` threads (`Some(1)` starts none); `None`: the caller and rayon's global
    /// pool. The gradients are bitwise identical whatever the count. `Some(0)` is an error,
    /// and so is more than [`crate::MAX_THREADS`].
    pub threads: Option<usize>,
    /// The instruction set the tasks are compiled for (default [`SimdLevel::Auto`]); asking
    /// for one the CPU lacks is an error. The gradients depend on it only by rounding (tile
    /// sizes and fused multiply-adds differ), within the error bounds of the tests.
    pub simd: SimdLevel,
}

impl Default for BackwardOptions {
    fn default() -> Self {
        BackwardOptions {
            threads: None,
            simd: SimdLevel::Auto,
        }
    }
}

/// What a backward call did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackwardStats {
    /// (query tile, key tile) pairs computed, per query head (the tile edge is the
    /// architecture's: 64, or 96 on AVX2; the AMX kernel's tiles are 128 rows × 128 keys).
    pub tiles_computed: u64,
    /// (query tile, key tile) pairs skipped because the mask hides them entirely.
    pub tiles_skipped: u64,
}

/// Reusable scratch and thread pool for [`backward_with_workspace`]: per-worker buffers
/// (linear in the longest query sequence, see [`backward_scratch_bytes_per_thread`]) and, when
/// [`BackwardOptions::threads`] is `Some(n)`, a pool of `n − 1` threads (the caller is the n-th
/// worker), both kept across calls.
#[derive(Debug, Default)]
pub struct BackwardWorkspace {
    slots: Vec<Mutex<BwdScratch>>,
    /// The AMX kernel's per-worker buffers (bf16 inputs on [`SimdLevel::Amx`]).
    amx_slots: Vec<Mutex<AmxBwdScratch>>,
    /// The thread count the pool was built for, and the pool (`None` for one thread).
    pool: Option<(usize, Option<rayon::ThreadPool>)>,
}

impl BackwardWorkspace {
    /// An empty workspace; buffers grow on the first call that needs them.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of scratch currently held (all workers).
    pub fn scratch_bytes(&mut self) -> usize {
        held_bytes(&mut self.slots, BwdScratch::bytes)
            + held_bytes(&mut self.amx_slots, |s: &mut AmxBwdScratch| s.bytes())
    }
}

/// Bytes held by the scratch in `slots` (`bytes` of each).
fn held_bytes<S>(slots: &mut [Mutex<S>], bytes: impl Fn(&mut S) -> usize) -> usize {
    slots
        .iter_mut()
        .map(|s| match s.get_mut() {
            Ok(s) => bytes(s),
            Err(poisoned) => bytes(poisoned.into_inner()),
        })
        .sum()
}

/// Bytes of scratch one worker of the backward needs for `problem` at a SIMD level (the
/// scratch-size companion of [`BackwardWorkspace`]): the rows of Q and dO of one GQA group
/// (row-major; also transposed where a tile may take the blocked products' path: on AVX2 and
/// scalar, and on AVX-512 under a mask), its dQ accumulator in f32 and a few tiles, so linear
/// in the longest query sequence and independent of the batch; the total is this times the
/// workers.
/// At [`SimdLevel::Amx`] (which runs bf16 and f16 inputs on AMX tiles with buffers of its
/// own, f32 inputs on the AVX-512 kernel) the larger of the two kernels' needs, with the AMX
/// kernel's for f16 (the larger: three bf16 parts per channel).
pub fn backward_scratch_bytes_per_thread(problem: &Problem, level: SimdLevel) -> usize {
    let simd = BwdLens::new(problem, level).bytes();
    if level.resolve() == SimdLevel::Amx {
        simd.max(AmxBwdLens::new(problem, HalfKind::F16).bytes())
    } else {
        simd
    }
}

/// What the backward runs: what the forward does ([`crate::supports`]) but KV caches (decode
/// is inference; training inputs are plain or varlen sequences).
pub fn supports_backward(problem: &Problem) -> Result<(), ProblemError> {
    supports(problem)?;
    if !matches!(problem.kv_cache(), softmax_core::KvCache::None) {
        return Err(ProblemError::Unsupported {
            what: "the backward takes no KV cache (padded or paged): give K and V as sequences",
        });
    }
    Ok(())
}

/// Checks that a buffer of `len` elements holds `needed`.
fn check_len(tensor: Tensor, len: usize, needed: usize) -> Result<(), ProblemError> {
    if len < needed {
        return Err(ProblemError::BufferTooSmall {
            tensor,
            needed,
            len,
        });
    }
    Ok(())
}

/// Exact attention backward with recomputation: the gradients of a loss `L` with respect to
/// Q, K and V, given `∂L/∂O`, the forward's O and its LSE.
///
/// The probabilities are recomputed tile by tile from Q, K and the LSE (no N×N storage;
/// scratch per worker: [`backward_scratch_bytes_per_thread`], linear in the sequence);
/// `D = rowsum(dO ∘ O)` (with the arithmetic of `dP`'s sums, so a one-hot row's `dP_j − D` is
/// exactly 0), `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ∘ (dP − D)` (times `1 − tanh²`
/// under a softcap), `dQ = dS·K·scale`, `dK = dSᵀ·Q·scale`, masks and scores as the forward
/// (`softmax-core`'s `Mask` and `ScoreTransform`), every product on the SIMD micro-kernels of
/// the chosen level (at [`SimdLevel::Amx`], bf16 inputs run all five products on AMX tiles:
/// P and dS are rounded to bf16 before the three gradient products, see
/// `kernel::amx_backward_task`). dK and dV are summed over the query heads of a GQA group. Inputs
/// f32/bf16/f16 (`T` for Q/K/V, `O` for O and dO), f32 arithmetic, gradients written as `G`
/// (the input dtype or f32). Gradients are written for every element of Q, K and V (0 for
/// rows that see no key and keys no row sees); padding between elements is not touched.
///
/// Work: one task per (sequence, KV head) writes dK/dV of its keys and dQ of its group's
/// rows; every element has one writer and its sums run in an order fixed by the problem and
/// the SIMD level, so results are **bitwise identical for any thread count** (no atomics).
/// Parallelism is therefore `batch × heads_kv` tasks.
///
/// Uses a thread-local [`BackwardWorkspace`] (scratch and pool kept across calls on this
/// thread); [`backward_with_workspace`] takes the caller's.
///
/// `problem` was validated by the caller. Errors, checked before anything is written (the
/// gradients are then untouched): what [`supports_backward`] refuses (KV caches among them); a buffer too short for
/// the problem (`BufferTooSmall` names Q/K/V for both an input and its gradient, O for both O
/// and dO, Lse for the LSE); `threads == Some(0)` or above [`crate::MAX_THREADS`]; a SIMD level this
/// CPU lacks; scratch that cannot be allocated (`OutOfMemory`).
pub fn backward<T: Element, O: Element, G: Element>(
    problem: &Problem,
    qkv: Qkv<&[T]>,
    inputs: BackwardInputs<'_, O>,
    grads: HostGrads<'_, G>,
    opts: &BackwardOptions,
) -> Result<BackwardStats, ProblemError> {
    thread_local! {
        static CACHED: std::cell::RefCell<BackwardWorkspace> =
            std::cell::RefCell::new(BackwardWorkspace::new());
    }
    CACHED.with(|cached| match cached.try_borrow_mut() {
        Ok(mut ws) => backward_with_workspace(problem, qkv, inputs, grads, opts, &mut ws),
        Err(_) => backward_with_workspace(
            problem,
            qkv,
            inputs,
            grads,
            opts,
            &mut BackwardWorkspace::new(),
        ),
    })
}

/// [`backward`] with caller-owned scratch and pool (reused across calls).
pub fn backward_with_workspace<T: Element, O: Element, G: Element>(
    problem: &Problem,
    qkv: Qkv<&[T]>,
    inputs: BackwardInputs<'_, O>,
    grads: HostGrads<'_, G>,
    opts: &BackwardOptions,
    ws: &mut BackwardWorkspace,
) -> Result<BackwardStats, ProblemError> {
    backward_on(problem, qkv, inputs, grads, opts, ws, AmxTiles::Hardware)
}

/// Makes sure the first `workers` slots exist and hold scratch of `lens` (`ensure(scratch,
/// lens)`), failing with `oom` instead of aborting.
fn ensure_slots<S: Default, L>(
    slots: &mut Vec<Mutex<S>>,
    workers: usize,
    lens: &L,
    ensure: impl Fn(&mut S, &L) -> Result<(), std::collections::TryReserveError>,
    oom: impl Fn() -> ProblemError,
) -> Result<(), ProblemError> {
    slots
        .try_reserve(workers.saturating_sub(slots.len()))
        .map_err(|_| oom())?;
    while slots.len() < workers {
        slots.push(Mutex::new(S::default()));
    }
    for slot in &mut slots[..workers] {
        let scratch = match slot.get_mut() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        ensure(scratch, lens).map_err(|_| oom())?;
    }
    Ok(())
}

/// [`backward_with_workspace`] with the AMX tiles chosen ([`AmxTiles`]): `Hardware` runs bf16
/// inputs on the CPU's tiles when the level is [`SimdLevel::Amx`]; `Emulated` (tests) runs
/// bf16 inputs on software tiles at any level.
pub(crate) fn backward_on<T: Element, O: Element, G: Element>(
    problem: &Problem,
    qkv: Qkv<&[T]>,
    inputs: BackwardInputs<'_, O>,
    grads: HostGrads<'_, G>,
    opts: &BackwardOptions,
    ws: &mut BackwardWorkspace,
    amx_tiles: AmxTiles,
) -> Result<BackwardStats, ProblemError> {
    supports_backward(problem)?;
    problem.check_buffers(BufferLens {
        q: qkv.q.len(),
        k: qkv.k.len(),
        v: qkv.v.len(),
        o: inputs.o.len(),
        lse: Some(inputs.lse.len()),
    })?;
    let lens = problem.min_buffer_lens();
    check_len(Tensor::O, inputs.d_o.len(), lens.o)?;
    check_len(Tensor::Q, grads.dq.len(), lens.q)?;
    check_len(Tensor::K, grads.dk.len(), lens.k)?;
    check_len(Tensor::V, grads.dv.len(), lens.v)?;
    let (isa, threads) = check_level_and_threads(opts.simd, opts.threads)?;
    ensure_pool(&mut ws.pool, threads)?;
    let task_list = backward_tasks(problem);
    // More workers than tasks would only hold scratch.
    let workers = threads
        .unwrap_or_else(|| rayon::current_num_threads().max(1))
        .min(task_list.len().max(1));
    // The AMX kernel: bf16 or f16 Q, K and V (any O/dO and gradient type) on the AMX level,
    // or on emulated tiles in tests. Everything else runs the SIMD kernel of the level.
    let amx_inputs = match amx_tiles {
        AmxTiles::Hardware if isa.level() != SimdLevel::Amx => None,
        _ => AmxInputs::of(qkv.q, qkv.k, qkv.v),
    };
    if let Some(inputs) = amx_inputs {
        let lens = AmxBwdLens::new(problem, inputs.kind);
        ensure_slots(
            &mut ws.amx_slots,
            workers,
            &lens,
            AmxBwdScratch::try_ensure,
            || ProblemError::OutOfMemory {
                what: "backward scratch (AMX)",
                bytes: lens.bytes(),
            },
        )?;
    } else {
        let lens = BwdLens::new(problem, isa.level());
        ensure_slots(
            &mut ws.slots,
            workers,
            &lens,
            BwdScratch::try_ensure,
            || ProblemError::OutOfMemory {
                what: "backward scratch",
                bytes: lens.bytes(),
            },
        )?;
    }

    let Grads { dq, dk, dv } = grads;
    let ctx = BwdCtx {
        problem,
        q: qkv.q,
        k: qkv.k,
        v: qkv.v,
        o: inputs.o,
        d_o: inputs.d_o,
        lse: inputs.lse,
        dq: SharedOut::new(dq),
        dk: SharedOut::new(dk),
        dv: SharedOut::new(dv),
    };
    let (slots, amx_slots) = (&ws.slots, &ws.amx_slots);
    let next = AtomicUsize::new(0);
    let totals = Mutex::new(BwdStats::default());
    let tiles_lost = AtomicBool::new(false);
    // Each worker takes the next task from one shared counter; which worker runs a task never
    // changes its arithmetic (each task owns the elements it writes and starts its sums at 0).
    let work = |slot: usize| {
        let mut mine = BwdStats::default();
        if let Some(amx) = amx_inputs {
            let mut guard = match amx_slots[slot].lock() {
                Ok(g) => g,
                Err(poisoned) => poisoned.into_inner(),
            };
            match run_amx_tasks(isa, amx_tiles, &ctx, amx, &task_list, &next, &mut guard) {
                Some(stats) => mine = stats,
                None => tiles_lost.store(true, Ordering::Relaxed),
            }
        } else {
            let mut guard = match slots[slot].lock() {
                Ok(g) => g,
                Err(poisoned) => poisoned.into_inner(),
            };
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(task) = task_list.get(i) else { break };
                mine = mine.add(dispatch(
                    isa,
                    BackwardTask {
                        ctx: &ctx,
                        task,
                        scratch: &mut guard,
                    },
                ));
            }
        }
        let mut t = match totals.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        *t = t.add(mine);
    };
    // The calling thread is worker 0 (as in the forward).
    match (
        threads,
        ws.pool.as_ref().and_then(|(_, pool)| pool.as_ref()),
    ) {
        (Some(_), Some(pool)) => pool.in_place_scope(|s| run_workers(s, workers, &work)),
        (Some(_), None) => work(0),
        (None, _) => rayon::in_place_scope(|s| run_workers(s, workers, &work)),
    }
    if tiles_lost.into_inner() {
        return Err(ProblemError::Unsupported {
            what: "the AMX tiles could not be configured on a worker thread",
        });
    }
    let stats = match totals.into_inner() {
        Ok(s) => s,
        Err(poisoned) => poisoned.into_inner(),
    };
    Ok(BackwardStats {
        tiles_computed: stats.computed,
        tiles_skipped: stats.skipped,
    })
}

/// Runs `work(0)` on the calling thread and `work(1..workers)` as jobs of the scope's pool.
fn run_workers<'s, F: Fn(usize) + Sync>(scope: &rayon::Scope<'s>, workers: usize, work: &'s F) {
    for slot in 1..workers {
        scope.spawn(move |_| work(slot));
    }
    work(0);
}

/// Runs tasks from the shared counter `next` on AMX tiles (configured here, once, on the
/// worker's thread) until none is left. `None` when the hardware tiles cannot be configured,
/// which does not happen: [`SimdLevel::Amx`] passed `Isa::new`, so AMX is available and the
/// permission granted process-wide (`arch::amx::available`).
fn run_amx_tasks<T: Element, O: Element, G: Element>(
    isa: Isa,
    amx_tiles: AmxTiles,
    ctx: &BwdCtx<'_, T, O, G>,
    inputs: AmxInputs<'_>,
    task_list: &[BwdTask],
    next: &AtomicUsize,
    scratch: &mut AmxBwdScratch,
) -> Option<BwdStats> {
    /// The loop over tasks with tiles `M`.
    fn drain<T: Element, O: Element, G: Element, M: crate::arch::amx::Tiles>(
        isa: Isa,
        tiles: &mut M,
        ctx: &BwdCtx<'_, T, O, G>,
        inputs: AmxInputs<'_>,
        task_list: &[BwdTask],
        next: &AtomicUsize,
        scratch: &mut AmxBwdScratch,
    ) -> BwdStats {
        let mut mine = BwdStats::default();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(task) = task_list.get(i) else { break };
            mine = mine.add(dispatch(
                isa,
                AmxBackwardTask {
                    ctx,
                    inputs,
                    task,
                    scratch: &mut *scratch,
                    tiles: &mut *tiles,
                },
            ));
        }
        mine
    }
    match amx_tiles {
        #[cfg(target_arch = "x86_64")]
        AmxTiles::Hardware => {
            let mut tiles = crate::arch::amx::HwTiles::configure()?;
            Some(drain(
                isa, &mut tiles, ctx, inputs, task_list, next, scratch,
            ))
        }
        #[cfg(not(target_arch = "x86_64"))]
        AmxTiles::Hardware => {
            let _ = (isa, ctx, inputs, task_list, next, scratch);
            None
        }
        #[cfg(feature = "internal-tests")]
        AmxTiles::Emulated => Some(drain(
            isa,
            &mut crate::arch::amx::EmuTiles::new(),
            ctx,
            inputs,
            task_list,
            next,
            scratch,
        )),
    }
}
