//! Split-KV ("flash-decoding") over the forward's tasks: the plan ([`plan`]) cuts each task's
//! visible keys into splits, [`DecodeTask`] runs one split through the forward's tile loop
//! (`forward_task::run_task`: same packing, micro-kernels, mask and online softmax, K/V read
//! through a padded or paged cache) into a partial buffer, and [`combine`] merges a task's
//! splits in split order with `softmax_core::merge_into`, then normalises into O and the LSE.
//!
//! A task already holds every query head of a GQA group (its rows are heads × positions), so
//! each K/V byte of a split is read once per group. The split count depends only on the
//! problem and the tiling, never on the thread count, and the combine order is fixed, so
//! results are bitwise identical for any number of threads.

use super::forward_task::{run_task, Ctx, Sink, TaskStats};
use super::scratch::{Scratch, SharedOut};
use super::tiling::{Task, Tiling};
use crate::arch::Arch;
use crate::dispatch::SimdTask;
use crate::element::Element;
use softmax_core::{merge_into, Problem, ProblemError, RowState};
use std::ops::Range;

/// Work items the automatic split count aims for in all (tasks × splits): enough for a
/// many-core host to stay busy when batch × KV heads is small. A rule of the problem alone,
/// so that results never depend on the thread count.
pub(crate) const TARGET_ITEMS: usize = 64;
/// Fewest key tiles per split under the automatic rule (≈ 256 keys): below this a split's
/// fixed costs (packing Q, writing its partial rows, the combine) outweigh its keys.
pub(crate) const MIN_SPLIT_TILES: usize = 4;
/// Most splits per task under either planner's automatic rule (FlashAttention-2's cap).
pub(crate) const MAX_AUTO_SPLITS: usize = 128;

/// One split of one task: its keys, and where its rows go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Split {
    /// The task (rows: query heads × positions of one GQA group).
    pub task: Task,
    /// Keys of the sequence this split covers (starts on a key tile).
    pub keys: Range<usize>,
    /// `None`: the task's only split, written straight to O; `Some(r)`: its partial rows start
    /// at row `r` of the partial buffers.
    pub first_row: Option<usize>,
}

/// A task whose splits the combine merges: `splits` consecutive blocks of `task.heads ·
/// task.len` partial rows from `first_row` on, in split order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Combine {
    /// The task.
    pub task: Task,
    /// Partial row of split 0's row 0.
    pub first_row: usize,
    /// Splits to merge (≥ 2).
    pub splits: usize,
}

/// The split-KV plan of a call: [`SplitPlan`] over this module's splits.
pub(crate) type Plan = SplitPlan<Split, Combine>;

/// What both split-KV planners (this module's over the tiled forward's tasks, and
/// `decode_stream`'s) build: the two phases' work lists and the partial rows they need.
#[derive(Clone, Debug)]
pub(crate) struct SplitPlan<I, C> {
    /// Work items of the first phase (every split).
    pub items: Vec<I>,
    /// Work items of the second phase (one per split task or run of heads).
    pub combines: Vec<C>,
    /// Rows of the partial buffers.
    pub partial_rows: usize,
    /// The largest split count.
    pub max_splits: usize,
    /// The most query rows of any item.
    pub max_rows: usize,
}

impl<I, C> SplitPlan<I, C> {
    /// An empty plan with room for `items` and `combines` (a typed error when there is none).
    pub(crate) fn with_capacity(items: usize, combines: usize) -> Result<Self, ProblemError> {
        let oom = |what, n: usize, size: usize| ProblemError::OutOfMemory {
            what,
            bytes: n.saturating_mul(size),
        };
        let mut plan = SplitPlan {
            items: Vec::new(),
            combines: Vec::new(),
            partial_rows: 0,
            max_splits: 1,
            max_rows: 0,
        };
        plan.items
            .try_reserve_exact(items)
            .map_err(|_| oom("the split list", items, std::mem::size_of::<I>()))?;
        plan.combines
            .try_reserve_exact(combines)
            .map_err(|_| oom("the combine list", combines, std::mem::size_of::<C>()))?;
        Ok(plan)
    }

    /// Takes `splits × rows` partial rows for one combine (split `s`'s row `r` at
    /// `first + s·rows + r`); returns `first`.
    pub(crate) fn take_rows(&mut self, splits: usize, rows: usize) -> Result<usize, ProblemError> {
        let first = self.partial_rows;
        self.partial_rows = splits
            .checked_mul(rows)
            .and_then(|n| n.checked_add(first))
            .ok_or(ProblemError::Overflow)?;
        self.max_splits = self.max_splits.max(splits);
        Ok(first)
    }
}

/// The split rule both planners share, over `units` (key tiles) of one task: `forced` splits
/// when given, else `wanted` capped by `by_size` (the most splits that keep each split's
/// minimum of work) and [`MAX_AUTO_SPLITS`]; at least one split, at most one per unit.
/// Returns (units per split, splits).
pub(crate) fn split_units(
    units: usize,
    forced: Option<usize>,
    wanted: usize,
    by_size: usize,
) -> (usize, usize) {
    let splits = forced
        .unwrap_or_else(|| wanted.min(by_size).min(MAX_AUTO_SPLITS))
        .clamp(1, units.max(1));
    let per_split = units.div_ceil(splits).max(1);
    (per_split, units.div_ceil(per_split).max(1))
}

/// Cuts each task's visible keys into splits of whole key tiles: `forced` splits when given
/// (at most one per visible tile), else [`TARGET_ITEMS`] work items spread over the tasks, at
/// least [`MIN_SPLIT_TILES`] tiles per split and at most [`MAX_AUTO_SPLITS`] splits.
pub(crate) fn plan(
    p: &Problem,
    tiling: &Tiling,
    tasks: &[Task],
    forced: Option<usize>,
) -> Result<Plan, ProblemError> {
    let bc = tiling.keys_for(p.head_dim(), p.head_dim_v(), !p.mask().is_none());
    let mask = p.mask();
    let wanted = TARGET_ITEMS.div_ceil(tasks.len().max(1));
    // Two passes: count, then fill, so the lists are allocated with `try_reserve`.
    let ranges = |task: &Task| {
        let seq = p.seq(task.batch);
        let visible = mask.union_key_range(task.i0..task.i0 + task.len, seq.seqlen_q, seq.seqlen_k);
        let tiles = if visible.is_empty() {
            0..0
        } else {
            visible.start / bc..visible.end.div_ceil(bc)
        };
        let n_tiles = tiles.len();
        let (per_split, splits) = split_units(n_tiles, forced, wanted, n_tiles / MIN_SPLIT_TILES);
        (tiles.start, per_split, splits, seq.seqlen_k)
    };
    let mut n_splits = 0usize;
    let mut n_combines = 0usize;
    for task in tasks {
        let (_, _, splits, _) = ranges(task);
        n_splits = n_splits.checked_add(splits).ok_or(ProblemError::Overflow)?;
        n_combines += usize::from(splits > 1);
    }
    let mut plan = Plan::with_capacity(n_splits, n_combines)?;
    for task in tasks {
        let (first_tile, per_split, splits, seqlen_k) = ranges(task);
        let rows = task.heads * task.len;
        plan.max_rows = plan.max_rows.max(rows);
        if splits == 1 {
            plan.items.push(Split {
                task: *task,
                keys: 0..seqlen_k,
                first_row: None,
            });
            continue;
        }
        let first_row = plan.take_rows(splits, rows)?;
        for s in 0..splits {
            let start = (first_tile + s * per_split) * bc;
            let end = ((first_tile + (s + 1) * per_split) * bc).min(seqlen_k);
            plan.items.push(Split {
                task: *task,
                keys: start..end,
                first_row: Some(first_row + s * rows),
            });
        }
        plan.combines.push(Combine {
            task: *task,
            first_row,
            splits,
        });
    }
    // Work order (never the arithmetic): a sequence's KV heads over the same key range one
    // after another, so that the workers walk each stretch of the cache together. A head's
    // rows are a head stride apart (4 KiB at 8 KV heads × 128 × f32), one page per key;
    // heads in turn reuse those pages' TLB entries and DRAM rows instead of each head
    // sweeping the whole cache on its own.
    plan.items.sort_by_key(|s| {
        (
            s.task.batch,
            s.keys.start,
            s.task.head_kv,
            s.task.head0,
            s.task.i0,
        )
    });
    Ok(plan)
}

/// The partial buffers of a call: per partial row, its online-softmax state and its
/// unnormalised accumulator (`head_dim_v` floats).
#[derive(Clone, Copy)]
pub(crate) struct Partials {
    /// `partial_rows × head_dim_v` accumulators.
    pub acc: SharedOut<f32>,
    /// `partial_rows` states.
    pub states: SharedOut<RowState<f32>>,
}

/// One split with its worker's scratch: the [`SimdTask`] of split-KV decode's first phase.
pub(crate) struct DecodeTask<'t, 'a, T, O> {
    /// The call's inputs and outputs.
    pub ctx: &'t Ctx<'a, T, O>,
    /// The split to compute.
    pub split: &'t Split,
    /// Where partial rows go.
    pub partials: Partials,
    /// The worker's scratch.
    pub scratch: &'t mut Scratch,
}

impl<T: Element, O: Element> SimdTask for DecodeTask<'_, '_, T, O> {
    type Output = TaskStats;

    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) -> TaskStats {
        let sink = match self.split.first_row {
            None => Sink::Final,
            Some(first_row) => Sink::Partial {
                first_row,
                acc: self.partials.acc,
                states: self.partials.states,
            },
        };
        // SAFETY: A available and the const generics A's (caller); the context comes from
        // `forward_with_workspace` (problem validated, buffers checked, A's tiling); the plan
        // made the key range tile-aligned within the sequence and sized the partial buffers
        // for every split's rows.
        unsafe {
            run_task::<A, T, O, QK, NR, PV>(
                self.ctx,
                &self.split.task,
                self.split.keys.clone(),
                sink,
                self.scratch,
            )
        }
    }
}

/// Merges a task's splits in split order (`merge_into`) and writes O and the LSE. `acc_row`
/// is scratch of `head_dim_v` floats. Reads partial rows the first phase wrote (the caller
/// runs the phases one after the other).
pub(crate) fn combine<T, O: Element>(
    ctx: &Ctx<'_, T, O>,
    item: &Combine,
    acc: &[f32],
    states: &[RowState<f32>],
    acc_row: &mut [f32],
) {
    let task = &item.task;
    merge_rows(
        ctx,
        task.batch,
        task.heads * task.len,
        item.first_row,
        item.splits,
        |r| task.row(r),
        acc,
        states,
        acc_row,
    );
}

/// The combine of `rows` rows of sequence `batch` split `splits` ways: split `s`'s row `r`
/// is partial row `first_row + s·rows + r`; rows are merged in split order with
/// `softmax_core::merge_into`, normalised and written to O (and the LSE) at the (query head,
/// position) `row_at(r)`. `acc_row` is scratch of `head_dim_v` floats.
#[allow(clippy::too_many_arguments)]
pub(crate) fn merge_rows<T, O: Element>(
    ctx: &Ctx<'_, T, O>,
    batch: usize,
    rows: usize,
    first_row: usize,
    splits: usize,
    row_at: impl Fn(usize) -> (usize, usize),
    acc: &[f32],
    states: &[RowState<f32>],
    acc_row: &mut [f32],
) {
    let p = ctx.problem;
    let dv = p.head_dim_v();
    for r in 0..rows {
        let row_of = |s: usize| first_row + s * rows + r;
        let first = row_of(0);
        let mut state = states[first];
        acc_row.copy_from_slice(&acc[first * dv..(first + 1) * dv]);
        for s in 1..splits {
            let at = row_of(s);
            merge_into(
                &mut state,
                acc_row,
                &states[at],
                &acc[at * dv..(at + 1) * dv],
            );
        }
        let (head, i) = row_at(r);
        // The sink joins the merged row once, never per split.
        let result = state.finish_with_sink(p.sink_log2(head));
        // A row that saw no key gets 0, whatever V holds (as in the forward's write-back).
        let seen = result.inv_sum != 0.0;
        let values = acc_row
            .iter()
            .map(|&a| O::from_f32(if seen { a * result.inv_sum } else { 0.0 }));
        ctx.out.write_row(p.o_offset(batch, i, head), values);
        if let Some(lse) = &ctx.lse {
            lse.write(p.lse_offset(batch, head, i), result.lse);
        }
    }
}
