//! The backward pass: validation, the thread pool, the dispatch of each task (the tasks
//! themselves are in `kernel::backward_task`).

use crate::arch::SimdLevel;
use crate::dispatch::dispatch;
use crate::dispatch::Isa;
use crate::forward::{check_level_and_threads, ensure_pool, on_workers, reserve_slots, AmxTiles};
use crate::kernel::amx_backward_task::{AmxBackwardTask, AmxBwdLens, AmxBwdScratch};
use crate::kernel::amx_task::{AmxInputs, HalfKind};
use crate::kernel::backward_task::{
    backward_tasks, BackwardTask, BwdCtx, BwdLens, BwdScratch, BwdStats, BwdTask,
};
use crate::kernel::SharedOut;
use crate::WorkspaceReq;
use crate::{supports, Element};
use softmax_core::{BufferLens, DType, Grads, Problem, ProblemError, Qkv, Tensor};
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
    let dtypes = BackwardDTypes {
        inputs: T::DTYPE,
        outputs: O::DTYPE,
        grads: G::DTYPE,
    };
    let plan = plan_backward_on(problem, dtypes, opts, amx_tiles)?;
    run_backward(&plan, qkv, inputs, grads, ws)
}

/// The dtypes of a backward call: Q, K, V (`inputs`); O and dO (`outputs`: `inputs` or f32);
/// dQ, dK, dV (`grads`: `inputs` or f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackwardDTypes {
    /// Q, K and V.
    pub inputs: DType,
    /// O and dO.
    pub outputs: DType,
    /// dQ, dK and dV.
    pub grads: DType,
}

/// What one backward call does, decided once from the validated problem, the dtypes and the
/// options ([`plan_backward`]): the SIMD level, the workers, the kernel (SIMD, or all five
/// products on AMX tiles), the task list (one per sequence and KV head) and the scratch it
/// needs ([`BackwardPlan::workspace`]). [`run_backward`] executes it on any tensors of the
/// problem's sizes and the plan's dtypes, as often as wanted (every layer of a model whose
/// layers share a shape).
#[derive(Clone, Debug)]
pub struct BackwardPlan<'a> {
    problem: Problem<'a>,
    dtypes: BackwardDTypes,
    isa: Isa,
    threads: Option<usize>,
    workers: usize,
    amx_tiles: AmxTiles,
    tasks: Vec<BwdTask>,
    kernel: BwdKernel,
}

/// The backward's kernel and its scratch sizes.
#[derive(Clone, Copy, Debug)]
enum BwdKernel {
    /// The SIMD kernel of the plan's level.
    Simd(BwdLens),
    /// All five products on AMX tiles (bf16 or f16 Q, K and V).
    Amx(AmxBwdLens),
}

impl<'a> BackwardPlan<'a> {
    /// The validated problem the plan runs.
    pub fn problem(&self) -> &Problem<'a> {
        &self.problem
    }

    /// The SIMD level the run uses (resolved: never `Auto`).
    pub fn simd(&self) -> SimdLevel {
        self.isa.level()
    }

    /// The kernel: `"simd"` or `"amx"`.
    pub fn variant(&self) -> &'static str {
        match self.kernel {
            BwdKernel::Simd(_) => "simd",
            BwdKernel::Amx(_) => "amx",
        }
    }

    /// Tasks (one per sequence and KV head).
    pub fn work_items(&self) -> usize {
        self.tasks.len()
    }

    /// The memory a run needs besides the tensors (no partial rows: every task owns the
    /// gradient elements it writes).
    pub fn workspace(&self) -> WorkspaceReq {
        WorkspaceReq {
            workers: self.workers,
            bytes_per_worker: match self.kernel {
                BwdKernel::Simd(lens) => lens.bytes(),
                BwdKernel::Amx(lens) => lens.bytes(),
            },
            partial_bytes: 0,
        }
    }
}

/// The plan of a backward call ([`BackwardPlan`]): every check that does not need the
/// tensors (what [`supports_backward`] refuses, the dtypes of [`crate::BACKWARD_DTYPES`], the
/// options) happens here, once; [`run_backward`] then checks the tensors' lengths and dtypes.
pub fn plan_backward<'a>(
    problem: &Problem<'a>,
    dtypes: BackwardDTypes,
    opts: &BackwardOptions,
) -> Result<BackwardPlan<'a>, ProblemError> {
    plan_backward_on(problem, dtypes, opts, AmxTiles::Hardware)
}

/// [`plan_backward`] with the AMX tiles chosen (tests: `Emulated`).
pub(crate) fn plan_backward_on<'a>(
    problem: &Problem<'a>,
    dtypes: BackwardDTypes,
    opts: &BackwardOptions,
    amx_tiles: AmxTiles,
) -> Result<BackwardPlan<'a>, ProblemError> {
    supports_backward(problem)?;
    let BackwardDTypes {
        inputs,
        outputs,
        grads,
    } = dtypes;
    if (outputs != inputs && outputs != DType::F32) || (grads != inputs && grads != DType::F32) {
        return Err(crate::BACKWARD_DTYPES);
    }
    let (isa, threads) = check_level_and_threads(opts.simd, opts.threads)?;
    let tasks = backward_tasks(problem);
    // More workers than tasks would only hold scratch.
    let workers = threads
        .unwrap_or_else(|| rayon::current_num_threads().max(1))
        .min(tasks.len().max(1));
    // The AMX kernel: bf16 or f16 Q, K and V (any O/dO and gradient type) on the AMX level,
    // or on emulated tiles in tests. Everything else runs the SIMD kernel of the level.
    let amx = match amx_tiles {
        AmxTiles::Hardware if isa.level() != SimdLevel::Amx => None,
        _ => HalfKind::of(inputs),
    };
    let kernel = match amx {
        Some(kind) => BwdKernel::Amx(AmxBwdLens::new(problem, kind)),
        None => BwdKernel::Simd(BwdLens::new(problem, isa.level())),
    };
    Ok(BackwardPlan {
        problem: *problem,
        dtypes,
        isa,
        threads,
        workers,
        amx_tiles,
        tasks,
        kernel,
    })
}

impl BackwardWorkspace {
    /// Reserves what `plan`'s run needs ([`BackwardPlan::workspace`]): its worker pool (when
    /// the plan's options set a thread count) and every worker's scratch. [`run_backward`]
    /// does it too; calling it first makes the run allocate nothing. Errors: `OutOfMemory`,
    /// or `Unsupported` when the worker threads cannot start.
    pub fn reserve(&mut self, plan: &BackwardPlan<'_>) -> Result<(), ProblemError> {
        ensure_pool(&mut self.pool, plan.threads)?;
        match plan.kernel {
            BwdKernel::Amx(lens) => reserve_slots(
                &mut self.amx_slots,
                plan.workers,
                |s: &mut AmxBwdScratch| s.try_ensure(&lens),
                |what| ProblemError::OutOfMemory {
                    what,
                    bytes: lens.bytes(),
                },
            ),
            BwdKernel::Simd(lens) => reserve_slots(
                &mut self.slots,
                plan.workers,
                |s: &mut BwdScratch| s.try_ensure(&lens),
                |what| ProblemError::OutOfMemory {
                    what,
                    bytes: lens.bytes(),
                },
            ),
        }
    }
}

/// The plan's dtypes do not match the tensors'.
const PLAN_DTYPES: ProblemError = ProblemError::Unsupported {
    what: "the tensors' dtypes are not the ones the backward plan was made for",
};

/// Runs a plan ([`plan_backward`]) on tensors of its problem's sizes and its dtypes, with the
/// caller's workspace (reserved here to [`BackwardPlan::workspace`], a no-op once it is large
/// enough). Errors, checked before anything is written (the gradients are then untouched):
/// dtypes other than the plan's; a buffer too short for the problem (`BufferTooSmall` names
/// Q/K/V for both an input and its gradient, O for both O and dO, Lse for the LSE); scratch
/// that cannot be allocated.
pub fn run_backward<T: Element, O: Element, G: Element>(
    plan: &BackwardPlan<'_>,
    qkv: Qkv<&[T]>,
    inputs: BackwardInputs<'_, O>,
    grads: HostGrads<'_, G>,
    ws: &mut BackwardWorkspace,
) -> Result<BackwardStats, ProblemError> {
    let dtypes = BackwardDTypes {
        inputs: T::DTYPE,
        outputs: O::DTYPE,
        grads: G::DTYPE,
    };
    if dtypes != plan.dtypes {
        return Err(PLAN_DTYPES);
    }
    let problem = &plan.problem;
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
    ws.reserve(plan)?;
    let (isa, threads, workers, amx_tiles) = (plan.isa, plan.threads, plan.workers, plan.amx_tiles);
    let task_list = &plan.tasks[..];
    let amx_inputs = match plan.kernel {
        BwdKernel::Amx(_) => AmxInputs::of(qkv.q, qkv.k, qkv.v),
        BwdKernel::Simd(_) => None,
    };

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
            match run_amx_tasks(isa, amx_tiles, &ctx, amx, task_list, &next, &mut guard) {
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
    on_workers(&ws.pool, threads, workers, &work);
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
