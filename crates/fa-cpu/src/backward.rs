//! The backward pass: validation, the thread pool, the dispatch of each task (the tasks
//! themselves are in `kernel::backward_task`).

use crate::arch::SimdLevel;
use crate::dispatch::{dispatch, Isa};
use crate::kernel::backward_task::{
    backward_tasks, BackwardTask, BwdCtx, BwdScratch, BwdStats, BWD_KEYS, BWD_ROWS,
};
use crate::kernel::SharedOut;
use crate::{supports, Element};
use softmax_core::{BufferLens, Grads, Problem, ProblemError, Qkv, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// pool. The gradients are bitwise identical whatever the count. `Some(0)` is an error.
    pub threads: Option<usize>,
    /// The instruction set the tasks are compiled for (default [`SimdLevel::Auto`]); asking
    /// for one the CPU lacks is an error. The gradients do not depend on it.
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
    /// (query tile, key tile) pairs computed, over the dK/dV and the dQ tasks (tiles of 64
    /// queries × 64 keys).
    pub tiles_computed: u64,
    /// (query tile, key tile) pairs skipped because the mask hides them entirely.
    pub tiles_skipped: u64,
}

/// Bytes of scratch one worker of the backward needs for these head dims: independent of
/// the sequence lengths and the batch.
pub fn backward_scratch_bytes_per_thread(head_dim: usize, head_dim_v: usize) -> usize {
    let tile = BWD_ROWS.max(BWD_KEYS);
    4 * (3 * tile * (head_dim + head_dim_v) + 2 * tile + 2 * BWD_ROWS * BWD_KEYS)
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
/// scratch per worker: [`backward_scratch_bytes_per_thread`]); `D = rowsum(dO ∘ O)`,
/// `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ∘ (dP − D)` (times `1 − tanh²` under a softcap),
/// `dQ = dS·K·scale`, `dK = dSᵀ·Q·scale`, masks and scores as the forward (`softmax-core`'s
/// `Mask` and `ScoreTransform`). dK and dV are summed over the query heads of a GQA group.
/// Inputs f32/bf16/f16 (`T` for Q/K/V, `O` for O and dO), f32 arithmetic, gradients written
/// as `G` (the input dtype or f32). Gradients are written for every element of Q, K and V
/// (0 for rows that see no key and keys no row sees); padding between elements is not
/// touched.
///
/// Work: tasks over (sequence, KV head, 64-key block) write dK/dV, tasks over (sequence,
/// query head, 64-query block) write dQ; every element has one writer and its sum runs in an
/// order fixed by the problem, so results are **bitwise identical for any thread count**
/// (no atomics).
///
/// `problem` was validated by the caller. Errors, checked before anything is written (the
/// gradients are then untouched): what [`crate::supports`] refuses; a buffer too short for
/// the problem (`BufferTooSmall` names Q/K/V for both an input and its gradient, O for both O
/// and dO, Lse for the LSE); `threads == Some(0)`; a SIMD level this CPU lacks.
pub fn backward<T: Element, O: Element, G: Element>(
    problem: &Problem,
    qkv: Qkv<&[T]>,
    inputs: BackwardInputs<'_, O>,
    grads: HostGrads<'_, G>,
    opts: &BackwardOptions,
) -> Result<BackwardStats, ProblemError> {
    supports(problem)?;
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
    let Some(isa) = Isa::new(opts.simd) else {
        return Err(ProblemError::Unsupported {
            what: "the requested SIMD level is not available on this CPU",
        });
    };
    let pool = match opts.threads {
        Some(0) => return Err(ProblemError::ZeroDim { what: "threads" }),
        Some(n) if n > 1 => Some(
            rayon::ThreadPoolBuilder::new()
                .num_threads(n - 1)
                .build()
                .map_err(|_| ProblemError::Unsupported {
                    what: "could not start the worker threads",
                })?,
        ),
        _ => None,
    };
    let workers = opts
        .threads
        .unwrap_or_else(|| rayon::current_num_threads().max(1));

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
    let task_list = backward_tasks(problem);
    let next = AtomicUsize::new(0);
    let totals = Mutex::new(BwdStats::default());
    // Each worker takes the next task from one shared counter; which worker runs a task never
    // changes its arithmetic (each task owns the elements it writes and starts its sums at 0).
    let work = || {
        let mut scratch = BwdScratch::default();
        let mut mine = BwdStats::default();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(task) = task_list.get(i) else { break };
            mine = mine.add(dispatch(
                isa,
                BackwardTask {
                    ctx: &ctx,
                    task,
                    scratch: &mut scratch,
                },
            ));
        }
        let mut t = match totals.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        *t = t.add(mine);
    };
    match (&pool, opts.threads) {
        (Some(pool), _) => pool.in_place_scope(|s| run_workers(s, workers, &work)),
        (None, Some(_)) => work(),
        (None, None) => rayon::in_place_scope(|s| run_workers(s, workers, &work)),
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

/// Runs `work` on the calling thread and `workers − 1` times as jobs of the scope's pool.
fn run_workers<'s, F: Fn() + Sync>(scope: &rayon::Scope<'s>, workers: usize, work: &'s F) {
    for _ in 1..workers {
        scope.spawn(move |_| work());
    }
    work();
}
