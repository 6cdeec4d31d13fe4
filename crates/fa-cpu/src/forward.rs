//! The forward pass: validation, the thread pool, the dispatch of each task.

use crate::arch::amx::Tiles;
use crate::arch::SimdLevel;
use crate::dispatch::{dispatch, Isa, SimdTask};
use crate::kernel::amx_task::{AmxInputs, HalfKind, AMX_TASK_ROWS};
use crate::kernel::decode_stream::{self, QkDots, StreamLens, StreamTask};
use crate::kernel::decode_task::{self, DecodeTask, Partials};
use crate::kernel::scratch::ensure;
use crate::kernel::tiling::Task;
use crate::kernel::{self, Ctx, ForwardTask, Scratch, ScratchLens, SharedOut, TaskStats, Tiling};
use crate::{Element, ForwardOptions, ForwardStats, HostOut};
use softmax_core::{BufferLens, DType, Out, Problem, ProblemError, Qkv, RowState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Reusable scratch and thread pool for [`crate::forward_with_workspace`]: per-thread tile
/// buffers (sized by the problem's head dims and the tiling, never by the sequence length)
/// and, when [`ForwardOptions::threads`] is set to `n`, a local rayon pool of `n − 1` threads
/// (the calling thread is the n-th worker).
#[derive(Debug, Default)]
pub struct Workspace {
    slots: Vec<Mutex<Scratch>>,
    /// The thread count the pool was built for, and the pool (`None` for one thread).
    pool: Option<(usize, Option<rayon::ThreadPool>)>,
    /// Split-KV's partial rows, kept across calls (a warm decode step allocates nothing).
    partials: PartialBufs,
}

/// Split-KV's partial rows: unnormalised O rows and their online-softmax states.
#[derive(Debug, Default)]
struct PartialBufs {
    acc: Vec<f32>,
    states: Vec<RowState<f32>>,
}

/// `v` as `n` copies of `fill`, reusing its allocation; a typed error when it cannot grow.
fn reset<E: Clone>(v: &mut Vec<E>, n: usize, fill: E) -> Result<(), ProblemError> {
    v.clear();
    v.try_reserve_exact(n)
        .map_err(|_| ProblemError::OutOfMemory {
            what: "the split-KV partial results",
            bytes: n.saturating_mul(std::mem::size_of::<E>()),
        })?;
    v.resize(n, fill);
    Ok(())
}

impl Workspace {
    /// An empty workspace; buffers grow on the first call that needs them.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of scratch currently held (all threads).
    pub fn scratch_bytes(&self) -> usize {
        self.slots
            .iter()
            .map(|s| s.lock().map_or(0, |s| s.bytes()))
            .sum()
    }

    /// Reserves what `plan`'s run needs ([`ForwardPlan::workspace`]): its worker pool (when
    /// the plan's options set a thread count) and every worker's scratch. [`run_forward`] does
    /// it too; calling it first makes the run allocate nothing (a no-op once the workspace is
    /// large enough). Errors: `OutOfMemory` for the scratch, `Unsupported` when the worker
    /// threads cannot start.
    pub fn reserve(&mut self, plan: &ForwardPlan<'_>) -> Result<(), ProblemError> {
        ensure_pool(&mut self.pool, plan.threads)?;
        let req = plan.workspace();
        let tiling = plan.tiling;
        self.ensure_slots(plan.workers, req.bytes_per_worker, |scratch| {
            match &plan.work {
                Work::Stream { lens, .. } => scratch.try_reserve_stream(*lens),
                Work::Tiles { lens, .. } | Work::Splits { lens, .. } => {
                    scratch.try_reserve(&tiling, *lens)
                }
            }
        })
    }

    /// Makes `n` scratch slots, each reserved by `reserve` (`bytes`: what one asks, for the
    /// error): allocation failures are typed errors here, and the tasks then run without
    /// allocating.
    fn ensure_slots(
        &mut self,
        n: usize,
        bytes: usize,
        reserve: impl Fn(&mut Scratch) -> Result<(), std::collections::TryReserveError>,
    ) -> Result<(), ProblemError> {
        reserve_slots(&mut self.slots, n, reserve, |what| {
            ProblemError::OutOfMemory { what, bytes }
        })
    }
}

/// Makes sure the first `n` of `slots` exist and each is reserved by `reserve`, failing with
/// `oom(what)` instead of aborting (the forward's and the backward's worker scratch).
pub(crate) fn reserve_slots<S: Default>(
    slots: &mut Vec<Mutex<S>>,
    n: usize,
    reserve: impl Fn(&mut S) -> Result<(), std::collections::TryReserveError>,
    oom: impl Fn(&'static str) -> ProblemError,
) -> Result<(), ProblemError> {
    slots
        .try_reserve(n.saturating_sub(slots.len()))
        .map_err(|_| oom("the scratch slots"))?;
    while slots.len() < n {
        slots.push(Mutex::new(S::default()));
    }
    for slot in &mut slots[..n] {
        let scratch = match slot.get_mut() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        reserve(scratch).map_err(|_| oom("per-thread scratch"))?;
    }
    Ok(())
}

/// Runs `work(slot)` for `slot < workers`: `work(0)` on the calling thread, the others as jobs
/// of the workspace's pool (`threads` set) or of rayon's global pool (`threads: None`).
pub(crate) fn on_workers<F: Fn(usize) + Sync>(
    pool: &Option<(usize, Option<rayon::ThreadPool>)>,
    threads: Option<usize>,
    workers: usize,
    work: &F,
) {
    match (threads, pool.as_ref().and_then(|(_, pool)| pool.as_ref())) {
        (Some(_), Some(pool)) => pool.in_place_scope(|s| run_workers(s, workers, work)),
        (Some(_), None) => work(0),
        (None, _) => rayon::in_place_scope(|s| run_workers(s, workers, work)),
    }
}

/// The most threads [`crate::ForwardOptions::threads`] accepts. Each call with `Some(n)`
/// keeps a pool of `n − 1` threads; past a few times the cores they only queue (a pool of
/// 5000 made a 64-token call take minutes), so the limit is generous but finite.
pub const MAX_THREADS: usize = 1024;

/// Scratch bytes of one worker for `lens` (for error messages).
fn scratch_bytes_per_thread_for(tiling: &Tiling, lens: ScratchLens) -> usize {
    4 * kernel::scratch_elems(tiling, lens.head_dim, lens.head_dim_v, lens.hook)
}

/// Bytes of scratch one worker thread needs for a problem of these head dims at a SIMD
/// level (the scratch-size companion of [`Workspace`]): independent of sequence length and
/// batch, so the total is this times the thread count.
pub fn scratch_bytes_per_thread(head_dim: usize, head_dim_v: usize, level: SimdLevel) -> usize {
    4 * kernel::scratch_elems(&Tiling::for_level(level), head_dim, head_dim_v, true)
}

/// Whether fa-cpu can run a validated problem (any of its dtypes), answered before any buffer
/// is involved (what a backend choice asks); the forward calls check the same. Padded and
/// paged KV caches are supported (through split-KV decode).
pub fn supports(problem: &Problem) -> Result<(), ProblemError> {
    problem.require_host_seqlens()
}

/// The SIMD level and thread bound of a call, checked (the forward's and the backward's
/// options share both rules): a level this CPU lacks is `Unsupported`, `Some(0)` threads is
/// `ZeroDim`, more than [`MAX_THREADS`] is `TooManyThreads`.
pub(crate) fn check_level_and_threads(
    simd: SimdLevel,
    threads: Option<usize>,
) -> Result<(Isa, Option<usize>), ProblemError> {
    let Some(isa) = Isa::new(simd) else {
        return Err(ProblemError::Unsupported {
            what: "the requested SIMD level is not available on this CPU",
        });
    };
    match threads {
        Some(0) => Err(ProblemError::ZeroDim { what: "threads" }),
        Some(n) if n > MAX_THREADS => Err(ProblemError::TooManyThreads {
            threads: n,
            max: MAX_THREADS,
        }),
        other => Ok((isa, other)),
    }
}

/// Keeps a workspace's pool right for a call of `threads` (the caller is worker 0, so `n`
/// threads are a pool of `n − 1`; one thread needs none); `None` uses rayon's global pool and
/// leaves the workspace's alone.
pub(crate) fn ensure_pool(
    pool: &mut Option<(usize, Option<rayon::ThreadPool>)>,
    threads: Option<usize>,
) -> Result<(), ProblemError> {
    let Some(n) = threads else {
        return Ok(());
    };
    if pool.as_ref().is_none_or(|(m, _)| *m != n) {
        let built = match n {
            1 => None,
            _ => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n - 1)
                    .build()
                    .map_err(|_| ProblemError::Unsupported {
                        what: "could not start the worker threads",
                    })?,
            ),
        };
        *pool = Some((n, built));
    }
    Ok(())
}

/// [`crate::forward`] with caller-owned scratch and pool (reused across calls): a plan
/// ([`plan_forward`]) run once ([`run_forward`]).
pub fn forward_with_workspace<T: Element, O: Element>(
    problem: &Problem,
    qkv: Qkv<&[T]>,
    out: HostOut<'_, O>,
    opts: &ForwardOptions,
    ws: &mut Workspace,
) -> Result<ForwardStats, ProblemError> {
    forward_on(problem, qkv, out, opts, ws, AmxTiles::Hardware)
}

/// Which tiles the AMX kernel runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AmxTiles {
    /// The CPU's, when the call's level is [`SimdLevel::Amx`] (otherwise no AMX kernel).
    Hardware,
    /// The software emulation, on whatever level the call runs (tests: the AMX kernel's
    /// packing and driver checked on any CPU).
    #[cfg(feature = "internal-tests")]
    Emulated,
}

/// [`forward_with_workspace`] with the AMX tiles chosen ([`AmxTiles`]).
pub(crate) fn forward_on<T: Element, O: Element>(
    problem: &Problem,
    qkv: Qkv<&[T]>,
    out: HostOut<'_, O>,
    opts: &ForwardOptions,
    ws: &mut Workspace,
    amx_tiles: AmxTiles,
) -> Result<ForwardStats, ProblemError> {
    forward_on_with(problem, qkv, out, opts, ws, amx_tiles, None)
}

/// [`forward_on`] with the decode's SIMD `Q·Kᵀ` chosen (`qk_dots`; `None`: the options'
/// choice, see [`plan_forward`]). Tests force `QkDots::Bf16Pairs` (emulated on any CPU).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_on_with<T: Element, O: Element>(
    problem: &Problem,
    qkv: Qkv<&[T]>,
    out: HostOut<'_, O>,
    opts: &ForwardOptions,
    ws: &mut Workspace,
    amx_tiles: AmxTiles,
    qk_dots: Option<QkDots>,
) -> Result<ForwardStats, ProblemError> {
    let plan = plan_on(problem, T::DTYPE, O::DTYPE, opts, amx_tiles, qk_dots)?;
    run_forward(&plan, qkv, out, ws)
}

/// What one forward call does, decided once from the validated problem, the dtypes and the
/// options ([`plan_forward`]): the SIMD level and the workers, the variant (whole sequences on
/// the SIMD kernel or on AMX tiles, split-KV over the tiles, or the streaming decode loop)
/// with its work list, and the scratch it needs ([`ForwardPlan::workspace`]).
///
/// [`run_forward`] executes a plan on any tensors of the problem's sizes and the plan's
/// dtypes, as often as wanted: every layer of a decode step can run the step's one plan.
/// Planning is the part of a call that decides and allocates the work list; a run only
/// computes (after reserving its workspace, a no-op once the workspace is large enough).
#[derive(Clone)]
pub struct ForwardPlan<'a> {
    problem: Problem<'a>,
    opts: ForwardOptions<'a>,
    inputs: DType,
    output: DType,
    isa: Isa,
    threads: Option<usize>,
    workers: usize,
    tiling: Tiling,
    amx_tiles: AmxTiles,
    work: Work,
}

/// A plan's variant and its work list.
#[derive(Clone, Debug)]
enum Work {
    /// Whole sequences: the tasks on the SIMD kernel, or on AMX tiles for inputs of `amx`'s
    /// kind.
    Tiles {
        tasks: Vec<Task>,
        amx: Option<HalfKind>,
        lens: ScratchLens,
    },
    /// Split-KV over the tiled kernel's tasks, then the combines.
    Splits {
        plan: decode_task::Plan,
        lens: ScratchLens,
    },
    /// Split-KV through the streaming decode loop (few query rows per KV head).
    Stream {
        plan: decode_stream::Plan,
        lens: StreamLens,
        amx: bool,
        qk: QkDots,
    },
}

/// Memory a plan's run needs besides the tensors ([`ForwardPlan::workspace`]). A
/// [`Workspace`] reserves it before any task starts, so running out of memory is a typed
/// error and the tasks allocate nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkspaceReq {
    /// Workers of the run (one scratch slot each).
    pub workers: usize,
    /// Scratch bytes of one worker.
    pub bytes_per_worker: usize,
    /// Bytes of split-KV partial rows (unnormalised O rows and their softmax states), shared
    /// by the workers; 0 without splits.
    pub partial_bytes: usize,
}

impl WorkspaceReq {
    /// All the bytes: the workers' scratch and the partial rows (saturating).
    pub fn bytes(&self) -> usize {
        self.workers
            .saturating_mul(self.bytes_per_worker)
            .saturating_add(self.partial_bytes)
    }
}

impl std::fmt::Debug for ForwardPlan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwardPlan")
            .field("variant", &self.variant())
            .field("inputs", &self.inputs)
            .field("output", &self.output)
            .field("simd", &self.isa.level())
            .field("workers", &self.workers)
            .field("work_items", &self.work_items())
            .field("kv_splits", &self.kv_splits())
            .field("workspace", &self.workspace())
            .finish()
    }
}

impl<'a> ForwardPlan<'a> {
    /// The validated problem the plan runs.
    pub fn problem(&self) -> &Problem<'a> {
        &self.problem
    }

    /// The SIMD level the run uses (resolved: never `Auto`).
    pub fn simd(&self) -> SimdLevel {
        self.isa.level()
    }

    /// The variant: `"tiles"` (the SIMD kernel), `"amx"` (both products on AMX tiles),
    /// `"split-kv"` (split-KV over the tiled kernel) or `"stream"` (the decode loop; `"stream
    /// amx"` with its `Q·Kᵀ` on AMX tiles).
    pub fn variant(&self) -> &'static str {
        match &self.work {
            Work::Tiles { amx: None, .. } => "tiles",
            Work::Tiles { amx: Some(_), .. } => "amx",
            Work::Splits { .. } => "split-kv",
            Work::Stream { amx: false, .. } => "stream",
            Work::Stream { amx: true, .. } => "stream amx",
        }
    }

    /// Work items of the (first) parallel phase.
    pub fn work_items(&self) -> usize {
        match &self.work {
            Work::Tiles { tasks, .. } => tasks.len(),
            Work::Splits { plan, .. } => plan.items.len(),
            Work::Stream { plan, .. } => plan.items.len(),
        }
    }

    /// The largest number of splits of any task's keys (1 without split-KV).
    pub fn kv_splits(&self) -> usize {
        match &self.work {
            Work::Tiles { .. } => 1,
            Work::Splits { plan, .. } => plan.max_splits,
            Work::Stream { plan, .. } => plan.max_splits,
        }
    }

    /// The memory a run needs besides the tensors.
    pub fn workspace(&self) -> WorkspaceReq {
        let (bytes_per_worker, partial_rows) = match &self.work {
            Work::Tiles { lens, .. } => (scratch_bytes_per_thread_for(&self.tiling, *lens), 0),
            Work::Splits { plan, lens } => (
                scratch_bytes_per_thread_for(&self.tiling, *lens),
                plan.partial_rows,
            ),
            Work::Stream { plan, lens, .. } => (lens.bytes(), plan.partial_rows),
        };
        let partial_row_bytes =
            4 * self.problem.head_dim_v() + std::mem::size_of::<RowState<f32>>();
        WorkspaceReq {
            workers: self.workers,
            bytes_per_worker,
            partial_bytes: partial_rows.saturating_mul(partial_row_bytes),
        }
    }
}

/// The plan of a forward call ([`ForwardPlan`]) on inputs Q, K, V of dtype `inputs` and an
/// output of dtype `output` (`inputs` or f32): every check that does not need the tensors
/// themselves (the options, the SIMD level, the dtypes) happens here, once; [`run_forward`]
/// then checks only the tensors' lengths and dtypes.
pub fn plan_forward<'a>(
    problem: &Problem<'a>,
    inputs: DType,
    output: DType,
    opts: &ForwardOptions<'a>,
) -> Result<ForwardPlan<'a>, ProblemError> {
    plan_on(problem, inputs, output, opts, AmxTiles::Hardware, None)
}

/// [`plan_forward`] with the AMX tiles and the decode's SIMD `Q·Kᵀ` chosen (tests).
pub(crate) fn plan_on<'a>(
    problem: &Problem<'a>,
    inputs: DType,
    output: DType,
    opts: &ForwardOptions<'a>,
    amx_tiles: AmxTiles,
    qk_dots: Option<QkDots>,
) -> Result<ForwardPlan<'a>, ProblemError> {
    supports(problem)?;
    if output != inputs && output != DType::F32 {
        return Err(crate::FORWARD_DTYPES);
    }
    // P stays f32 here (a probability hook may narrow it, and checks its own range).
    opts.rescale.check(DType::F32.max_finite(), 0.0)?;
    let (isa, threads) = check_level_and_threads(opts.simd, opts.threads)?;
    if opts.kv_splits == Some(0) {
        return Err(ProblemError::ZeroDim { what: "kv_splits" });
    }
    let workers = threads.unwrap_or_else(|| rayon::current_num_threads().max(1));
    let hook = opts.probability_hook.is_some();
    // KV caches always take the split-KV path (the split rule gives one split where the
    // tasks alone fill the machine); other problems only when splits are asked for.
    let decode = problem.has_kv_cache() || opts.kv_splits.is_some();
    let tiling = Tiling::for_level(isa.level());
    let work = if decode && decode_stream::applies(problem, hook) {
        plan_stream(
            problem, inputs, output, opts, isa, &tiling, amx_tiles, qk_dots,
        )?
    } else {
        // The AMX kernel: bf16 or f16 inputs (f16 split exactly into two bf16 each:
        // `HalfKind`), the whole-sequence forward (not split-KV), no hook (it would see P
        // before the rounding to bf16 that the tiles need).
        let amx = match amx_tiles {
            AmxTiles::Hardware if isa.level() != SimdLevel::Amx => None,
            _ if decode || hook => None,
            _ => HalfKind::of(inputs),
        };
        // AMX tasks may be larger than the SIMD path's (`Tiling::amx_rows_for`: the 2.5 MiB
        // rule of `rows_for` under a mask or at head dims up to 128, else 8 MiB): each task
        // packs every K/V tile it reads, and at 1008 rows a 2048-token head took three
        // tasks, so three packings.
        let tasks = if amx.is_some() {
            let task_tiling = Tiling {
                rows: AMX_TASK_ROWS,
                ..tiling
            };
            let rows = task_tiling.amx_rows_for(
                problem.head_dim(),
                problem.head_dim_v(),
                !problem.mask().is_none(),
            );
            kernel::tasks_of_rows(problem, &task_tiling, rows)?
        } else {
            kernel::tasks(problem, &tiling)?
        };
        let lens = ScratchLens {
            max_rows: tasks.iter().map(|t| t.heads * t.len).max().unwrap_or(0),
            head_dim: problem.head_dim(),
            head_dim_v: problem.head_dim_v(),
            masked: !problem.mask().is_none(),
            hook,
            amx,
        };
        if decode {
            // Every split of every task, then the combines (which read what the splits
            // wrote, so the two phases run one after the other).
            let plan = decode_task::plan(problem, &tiling, &tasks, opts.kv_splits)?;
            Work::Splits { plan, lens }
        } else {
            Work::Tiles { tasks, amx, lens }
        }
    };
    Ok(ForwardPlan {
        problem: *problem,
        opts: *opts,
        inputs,
        output,
        isa,
        threads,
        workers,
        tiling,
        amx_tiles,
        work,
    })
}

/// The streaming decode's plan: its items and combines, and which `Q·Kᵀ` runs.
#[allow(clippy::too_many_arguments)]
fn plan_stream(
    problem: &Problem,
    inputs: DType,
    output: DType,
    opts: &ForwardOptions,
    isa: Isa,
    tiling: &Tiling,
    amx_tiles: AmxTiles,
    qk_dots: Option<QkDots>,
) -> Result<Work, ProblemError> {
    let lanes = tiling.lanes;
    // bf16 `Q·Kᵀ` on AMX tiles (`decode_stream::amx_applies`): at the Amx level on hardware
    // tiles, or (tests) on the emulation at any level.
    let amx = decode_stream::amx_applies(problem, inputs)
        && match amx_tiles {
            AmxTiles::Hardware => isa.level() == SimdLevel::Amx,
            #[cfg(feature = "internal-tests")]
            AmxTiles::Emulated => true,
        };
    // The SIMD `Q·Kᵀ` of bf16 inputs off the tiles: `vdpbf16ps` where the options ask for
    // it (`DecodeOptions::bf16_dots`) at the AVX-512 levels, else widened to f32. A native
    // product needs the CPU's instruction and its trampoline, forced or not.
    let native_bf16 = matches!(isa.level(), SimdLevel::Avx512f | SimdLevel::Amx)
        && crate::arch::has_avx512_bf16();
    let bf16 = inputs == DType::Bf16;
    let qk = match qk_dots {
        Some(QkDots::Bf16Pairs { native: true }) if !native_bf16 => QkDots::F32,
        Some(forced) => forced,
        None if bf16 && native_bf16 && opts.decode.bf16_dots => QkDots::Bf16Pairs { native: true },
        None => QkDots::F32,
    };
    let plan = decode_stream::plan(problem, lanes, inputs.size(), opts.kv_splits)?;
    let lens = StreamLens::of(problem, &plan, lanes, output, amx, opts.decode.amx_pv);
    Ok(Work::Stream {
        plan,
        lens,
        amx,
        qk,
    })
}

/// The plan's dtypes do not match the tensors'.
const PLAN_DTYPES: ProblemError = ProblemError::Unsupported {
    what: "the tensors' dtypes are not the ones the forward plan was made for",
};

/// Runs a plan ([`plan_forward`]) on tensors of its problem's sizes and its dtypes, with the
/// caller's workspace (reserved here to [`ForwardPlan::workspace`], a no-op once it is large
/// enough). Checks the tensors' lengths against the problem and their dtypes against the
/// plan first; on error nothing is written.
pub fn run_forward<T: Element, O: Element>(
    plan: &ForwardPlan<'_>,
    qkv: Qkv<&[T]>,
    out: HostOut<'_, O>,
    ws: &mut Workspace,
) -> Result<ForwardStats, ProblemError> {
    if T::DTYPE != plan.inputs || O::DTYPE != plan.output {
        return Err(PLAN_DTYPES);
    }
    let problem = &plan.problem;
    problem.check_buffers(BufferLens::of(&qkv, &out))?;
    let Qkv { q, k, v } = qkv;
    let Out { o: out, lse } = out;
    let opts = &plan.opts;
    let ctx = Ctx {
        problem,
        q,
        k,
        v,
        out: SharedOut::new(out),
        lse: lse.map(SharedOut::new),
        policy: opts.rescale,
        exp2: opts.exp2,
        decode: opts.decode,
        hook: opts.probability_hook,
        tiling: plan.tiling,
    };
    ws.reserve(plan)?;
    let (isa, threads, workers) = (plan.isa, plan.threads, plan.workers);
    match &plan.work {
        Work::Tiles { tasks, amx, .. } => {
            let amx_inputs = amx.and_then(|_| AmxInputs::of(q, k, v));
            let stats = run_items(ws, threads, workers, tasks.len(), |scratch, i| {
                let task = &tasks[i];
                if let Some(inputs) = amx_inputs {
                    let work = ForwardOnTiles {
                        ctx: &ctx,
                        inputs,
                        task,
                        scratch: &mut *scratch,
                    };
                    if let Some(stats) = run_on_tiles(isa, plan.amx_tiles, work) {
                        return stats;
                    }
                }
                dispatch(
                    isa,
                    ForwardTask {
                        ctx: &ctx,
                        task,
                        scratch,
                    },
                )
            });
            Ok(ForwardStats {
                rescale: stats.rescale,
                tiles_computed: stats.computed,
                tiles_skipped: stats.skipped,
                kv_splits: 1,
            })
        }
        Work::Splits { plan: splits, .. } => {
            let stats = run_split_kv(
                ws,
                threads,
                workers,
                splits.partial_rows,
                problem.head_dim_v(),
                splits.items.len(),
                |scratch, i, partials| {
                    dispatch(
                        isa,
                        DecodeTask {
                            ctx: &ctx,
                            split: &splits.items[i],
                            partials,
                            scratch,
                        },
                    )
                },
                splits.combines.len(),
                |i, acc, states, acc_row| {
                    decode_task::combine(&ctx, &splits.combines[i], acc, states, acc_row)
                },
            )?;
            Ok(ForwardStats {
                rescale: stats.rescale,
                tiles_computed: stats.computed,
                tiles_skipped: stats.skipped,
                kv_splits: splits.max_splits,
            })
        }
        Work::Stream {
            plan: stream,
            amx,
            qk,
            ..
        } => forward_stream(
            &ctx,
            ws,
            threads,
            workers,
            isa,
            plan.amx_tiles,
            stream,
            *amx,
            *qk,
        ),
    }
}

/// Split-KV's two phases, for the tiled splits and the streaming kernel alike: `split(scratch,
/// i, partials)` for every item (each writes its partial rows, or O when unsplit), then
/// `combine(i, acc, states, acc_row)` for every combine (which reads what the items wrote, so
/// the phases run one after the other). The `rows` partial rows of `dv` floats live in the
/// workspace across calls.
#[allow(clippy::too_many_arguments)]
fn run_split_kv<F, G>(
    ws: &mut Workspace,
    threads: Option<usize>,
    workers: usize,
    rows: usize,
    dv: usize,
    items: usize,
    split: F,
    combines: usize,
    combine: G,
) -> Result<TaskStats, ProblemError>
where
    F: Fn(&mut Scratch, usize, Partials) -> TaskStats + Sync,
    G: Fn(usize, &[f32], &[RowState<f32>], &mut [f32]) + Sync,
{
    let mut bufs = std::mem::take(&mut ws.partials);
    reset(
        &mut bufs.acc,
        rows.checked_mul(dv).ok_or(ProblemError::Overflow)?,
        0.0,
    )?;
    reset(&mut bufs.states, rows, RowState::new())?;
    let partials = Partials {
        acc: SharedOut::new(&mut bufs.acc),
        states: SharedOut::new(&mut bufs.states),
    };
    let stats = run_items(ws, threads, workers, items, |scratch, i| {
        split(scratch, i, partials)
    });
    let (acc, states) = (&bufs.acc[..], &bufs.states[..]);
    run_items(ws, threads, workers, combines, |scratch, i| {
        combine(i, acc, states, ensure(&mut scratch.row, dv, 0.0));
        TaskStats::default()
    });
    ws.partials = bufs;
    Ok(stats)
}

/// Work whose task runs on AMX tiles of either kind: [`run_on_tiles`] builds the task around
/// the tiles it gets.
trait WithTiles {
    /// The task around tiles `Tl`.
    type Task<Tl: Tiles>: SimdTask<Output = TaskStats>;
    /// The task around `tiles`.
    fn with<Tl: Tiles>(self, tiles: Tl) -> Self::Task<Tl>;
}

/// Runs `work`'s task on AMX tiles (configured here, on the worker's thread: hardware tiles
/// through [`crate::dispatch::dispatch_amx`], the emulation through [`dispatch`]); `None`
/// when the tiles cannot be had (then the caller runs the SIMD task).
fn run_on_tiles<W: WithTiles>(isa: Isa, amx_tiles: AmxTiles, work: W) -> Option<TaskStats> {
    match amx_tiles {
        #[cfg(target_arch = "x86_64")]
        AmxTiles::Hardware => {
            let tiles = crate::arch::amx::HwTiles::configure()?;
            Some(crate::dispatch::dispatch_amx(isa, work.with(tiles)))
        }
        #[cfg(not(target_arch = "x86_64"))]
        AmxTiles::Hardware => {
            let _ = (isa, work);
            None
        }
        #[cfg(feature = "internal-tests")]
        AmxTiles::Emulated => Some(dispatch(isa, work.with(crate::arch::amx::EmuTiles::new()))),
    }
}

/// The AMX forward's task without its tiles.
struct ForwardOnTiles<'t, 'a, T, O> {
    ctx: &'t Ctx<'a, T, O>,
    inputs: AmxInputs<'t>,
    task: &'t kernel::tiling::Task,
    scratch: &'t mut Scratch,
}

impl<'t, 'a, T: Element, O: Element> WithTiles for ForwardOnTiles<'t, 'a, T, O> {
    type Task<Tl: Tiles> = crate::kernel::amx_task::AmxForwardTask<'t, 'a, T, O, Tl>;
    fn with<Tl: Tiles>(self, tiles: Tl) -> Self::Task<Tl> {
        let ForwardOnTiles {
            ctx,
            inputs,
            task,
            scratch,
        } = self;
        crate::kernel::amx_task::AmxForwardTask {
            ctx,
            inputs,
            task,
            scratch,
            tiles,
        }
    }
}

/// A streaming decode item without its tiles (its `Q·Kᵀ` runs on them).
struct StreamOnTiles<'t, 'a, T, O> {
    ctx: &'t Ctx<'a, T, O>,
    item: &'t decode_stream::Item,
    partials: Partials,
    scratch: &'t mut Scratch,
}

impl<'t, 'a, T: Element, O: Element> WithTiles for StreamOnTiles<'t, 'a, T, O> {
    type Task<Tl: Tiles> = StreamTask<'t, 'a, T, O, Tl>;
    fn with<Tl: Tiles>(self, tiles: Tl) -> Self::Task<Tl> {
        let StreamOnTiles {
            ctx,
            item,
            partials,
            scratch,
        } = self;
        StreamTask {
            ctx,
            item,
            partials,
            scratch,
            tiles: Some(tiles),
            qk: QkDots::F32,
        }
    }
}

/// Split-KV decode through the streaming kernel (`kernel::decode_stream`): every split of
/// every run of KV heads, then the combines (the workers' scratch already reserved).
#[allow(clippy::too_many_arguments)]
fn forward_stream<T: Element, O: Element>(
    ctx: &Ctx<'_, T, O>,
    ws: &mut Workspace,
    threads: Option<usize>,
    workers: usize,
    isa: Isa,
    amx_tiles: AmxTiles,
    plan: &decode_stream::Plan,
    amx: bool,
    qk: QkDots,
) -> Result<ForwardStats, ProblemError> {
    let stats = run_split_kv(
        ws,
        threads,
        workers,
        plan.partial_rows,
        ctx.problem.head_dim_v(),
        plan.items.len(),
        |scratch, i, partials| {
            let item = &plan.items[i];
            if amx {
                let work = StreamOnTiles {
                    ctx,
                    item,
                    partials,
                    scratch: &mut *scratch,
                };
                if let Some(stats) = run_on_tiles(isa, amx_tiles, work) {
                    return stats;
                }
            }
            let task = StreamTask {
                ctx,
                item,
                partials,
                scratch,
                tiles: None::<decode_stream::NoTiles>,
                qk,
            };
            if qk == (QkDots::Bf16Pairs { native: true }) {
                crate::dispatch::dispatch_bf16(isa, task)
            } else {
                dispatch(isa, task)
            }
        },
        plan.combines.len(),
        |i, acc, states, acc_row| {
            decode_stream::combine(ctx, &plan.combines[i], acc, states, acc_row)
        },
    )?;
    Ok(ForwardStats {
        rescale: stats.rescale,
        tiles_computed: stats.computed,
        tiles_skipped: 0,
        kv_splits: plan.max_splits,
    })
}

/// Runs `item(scratch, i)` for every `i < n` on `workers` workers (the calling thread and the
/// workspace's pool, or rayon's global pool when `threads` is `None`) and sums what they
/// count.
///
/// Dynamic scheduling: every worker takes the next item from one shared counter, so the
/// workers move through the list together and read the same K/V head at the same time
/// (shared in L3), and the heaviest causal blocks (listed first) go out first. Which worker
/// runs an item never changes its arithmetic.
fn run_items<F>(
    ws: &Workspace,
    threads: Option<usize>,
    workers: usize,
    n: usize,
    item: F,
) -> TaskStats
where
    F: Fn(&mut Scratch, usize) -> TaskStats + Sync,
{
    let slots = &ws.slots;
    let next = AtomicUsize::new(0);
    let totals = Mutex::new(TaskStats::default());
    // One scratch slot per worker, by the worker's number (not by the thread that runs it).
    let work = |slot: usize| {
        let mut guard = match slots[slot].lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut mine = TaskStats::default();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            mine = mine.add(item(&mut guard, i));
        }
        let mut t = match totals.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        *t = t.add(mine);
    };
    // The calling thread is worker 0 and starts at once; workers 1.. are jobs for the pool.
    // It keeps the call at `workers` runnable threads, one wake-up fewer: with the caller
    // blocked and all workers woken, two of them could share a core while another sat idle,
    // which doubled the time of some short calls on the 2-core Xeon.
    let workers = workers.min(n.max(1));
    on_workers(&ws.pool, threads, workers, &work);
    match totals.into_inner() {
        Ok(s) => s,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// Runs `work(0)` on the calling thread and `work(1..workers)` as jobs of the scope's pool.
fn run_workers<'s, F: Fn(usize) + Sync>(scope: &rayon::Scope<'s>, workers: usize, work: &'s F) {
    for slot in 1..workers {
        scope.spawn(move |_| work(slot));
    }
    work(0);
}
