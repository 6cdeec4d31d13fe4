//! One task of the forward pass ([`ForwardTask`], run through [`crate::dispatch`]): pack `Qᵀ`;
//! for each key tile the mask leaves, pack K and V, classify the row panels, and run each live
//! panel through `QKᵀ`, softcap, mask, online softmax, the hook and `PV`; then normalise and
//! write O and the LSE. The layout is described in [`crate::kernel`].

use super::mask::{mask_panel, MAX_PANEL};
use super::micro::{on_live_vectors, pv_micro, qk_micro};
use super::pack::{pack_group, prefetch_row, transpose_region, widen, ROW_PREFETCH_AHEAD};
use super::rows::{row_pv, row_scores};
use super::scratch::{ensure, ensure_aligned, Scratch, SharedOut};
use super::softmax::{softcap_slice, softmax_panel};
use super::tiling::{Task, Tiling};
use crate::arch::{Arch, Simd};
use crate::dispatch::SimdTask;
use crate::element::Element;
use crate::Exp2Impl;
use softmax_core::{KvCache, Mask, Problem, RescalePolicy, RescaleStats, RowState, TileKind};
use std::ops::Range;

/// What one task counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TaskStats {
    /// Rescale decisions over all rows and key tiles.
    pub rescale: RescaleStats,
    /// (row panel, key tile) pairs computed.
    pub computed: u64,
    /// (row panel, key tile) pairs skipped because the mask hides them.
    pub skipped: u64,
}

impl TaskStats {
    /// Adds another task's counts.
    pub fn add(mut self, other: TaskStats) -> TaskStats {
        self.rescale.add(&other.rescale);
        self.computed += other.computed;
        self.skipped += other.skipped;
        self
    }
}

/// Everything a task reads, shared by all tasks of a call.
pub(crate) struct Ctx<'a, T, O> {
    /// The validated problem (buffers checked against it).
    pub problem: &'a Problem<'a>,
    /// Q.
    pub q: &'a [T],
    /// K.
    pub k: &'a [T],
    /// V.
    pub v: &'a [T],
    /// O.
    pub out: SharedOut<O>,
    /// The LSE, if asked for.
    pub lse: Option<SharedOut<f32>>,
    /// When to rescale.
    pub policy: RescalePolicy<f32>,
    /// The exponential.
    pub exp2: Exp2Impl,
    /// The streaming decode loop's options (read by `decode_stream::run_item` once per item).
    pub decode: crate::DecodeOptions,
    /// Called on each panel of probabilities before `PV`.
    pub hook: Option<crate::ProbabilityHook<'a>>,
    /// The tiling of the architecture the tasks run on.
    pub tiling: Tiling,
}

/// One task of the forward pass with its worker's scratch: the [`SimdTask`] the forward
/// pass dispatches.
pub(crate) struct ForwardTask<'t, 'a, T, O> {
    /// The call's inputs and outputs.
    pub ctx: &'t Ctx<'a, T, O>,
    /// The rows to compute.
    pub task: &'t Task,
    /// The worker's scratch.
    pub scratch: &'t mut Scratch,
}

impl<T: Element, O: Element> SimdTask for ForwardTask<'_, '_, T, O> {
    type Output = TaskStats;

    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) -> TaskStats {
        // SAFETY: A available and the const generics A's (caller); the context comes from
        // `forward_with_workspace`, which validated the problem, checked the buffers and took
        // the tiling of A's level.
        let keys = 0..self.ctx.problem.seq(self.task.batch).seqlen_k;
        // SAFETY: as above; the key range is the whole sequence.
        unsafe {
            run_task::<A, T, O, QK, NR, PV>(self.ctx, self.task, keys, Sink::Final, self.scratch)
        }
    }
}

/// Where a task's finished rows go.
#[derive(Clone, Copy)]
pub(crate) enum Sink {
    /// Normalised into O (and the LSE): the task covered every key its rows see.
    Final,
    /// Unnormalised into a split-KV partial buffer, for the combine (`merge_into`): row `r`
    /// of the task at `first_row + r` of `states`, its accumulator at `(first_row + r)·dv`
    /// of `acc`.
    Partial {
        /// The partial row of the task's row 0.
        first_row: usize,
        /// `rows × dv` accumulators.
        acc: SharedOut<f32>,
        /// One online-softmax state per row.
        states: SharedOut<RowState<f32>>,
    },
}

/// A task's sizes, fixed for the whole task.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    /// Head dim of Q and K.
    pub(super) d: usize,
    /// Head dim of V.
    pub(super) dv: usize,
    /// `dv` padded to the PV micro-kernel's channels.
    pub(super) dv_pad: usize,
    /// Row stride of the packed V tile ([`Tiling::v_stride`]).
    pub(super) v_stride: usize,
    /// The task's rows (heads × positions).
    pub(super) rows: usize,
    /// `rows` padded to whole panels.
    pub(super) br: usize,
    /// Keys per key tile.
    pub(super) bc: usize,
    /// Rows per panel (`W·NR`).
    pub(super) panel: usize,
    /// Whether the task holds at most one row vector of rows (decode): then Q, K, V and O stay
    /// row-major and the row micro-kernels ([`super::rows`]) run instead of the panel ones.
    pub(super) few: bool,
    /// `d` padded to whole vectors (row-major Q and K rows).
    pub(super) d_w: usize,
    /// `dv` padded to whole vectors (row-major V rows and O accumulators).
    pub(super) dv_w: usize,
    /// The sequence's query and key lengths.
    pub(super) sq: usize,
    /// See `sq`.
    pub(super) sk: usize,
}

/// Where the task's K and V rows are: key `j` of the sequence at `base + j·seq`, or, in a
/// paged cache, at `base + block·block_stride + (j % block_size)·seq` with `block` read from
/// the sequence's row of the block table. [`KvRows::offsets`] lists a run of keys' offsets
/// once per tile (one division per run, not per key), for packing and prefetching alike.
#[derive(Clone, Copy)]
pub(crate) struct KvRows<'a> {
    k_base: usize,
    v_base: usize,
    k_seq: usize,
    v_seq: usize,
    pages: Option<Pages<'a>>,
}

/// The paging of a KV cache, for one sequence.
#[derive(Clone, Copy)]
struct Pages<'a> {
    /// The sequence's row of the block table (validated for every used key).
    table: &'a [i32],
    block_size: usize,
    k_block: usize,
    v_block: usize,
}

impl<'a> KvRows<'a> {
    /// The rows of KV head `head_kv` of sequence `b`.
    pub(crate) fn new(p: &'a Problem<'a>, b: usize, head_kv: usize) -> Self {
        let [_, ks, vs, _] = p.strides();
        match p.kv_cache() {
            KvCache::Paged {
                block_table,
                blocks_per_seq,
                block_size,
                ..
            } => KvRows {
                k_base: head_kv * ks.head,
                v_base: head_kv * vs.head,
                k_seq: ks.seq,
                v_seq: vs.seq,
                pages: Some(Pages {
                    table: &block_table[b * blocks_per_seq..(b + 1) * blocks_per_seq],
                    block_size,
                    k_block: ks.batch,
                    v_block: vs.batch,
                }),
            },
            _ => KvRows {
                k_base: p.k_offset(b, 0, head_kv),
                v_base: p.v_offset(b, 0, head_kv),
                k_seq: ks.seq,
                v_seq: vs.seq,
                pages: None,
            },
        }
    }

    /// The offsets of a key tile's `nk` rows from `j0` into `k_offs[..nk]` / `v_offs[..nk]`,
    /// followed by those of the next tile (`bc` keys from `j0 + bc`, stopping at `end`) when
    /// `has_next`; returns the next tile's row count (0 without one). Its rows are what the
    /// tasks prefetch while they compute this tile.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn tile_offsets(
        &self,
        j0: usize,
        nk: usize,
        bc: usize,
        end: usize,
        has_next: bool,
        k_offs: &mut [usize],
        v_offs: &mut [usize],
    ) -> usize {
        let next_rows = if has_next {
            bc.min(end.saturating_sub(j0 + bc))
        } else {
            0
        };
        self.offsets(
            j0,
            &mut k_offs[..nk + next_rows],
            &mut v_offs[..nk + next_rows],
        );
        next_rows
    }

    /// Writes the K and V offsets of keys `j0..j0 + k.len()` into `k` and `v`.
    #[inline(always)]
    pub(crate) fn offsets(&self, j0: usize, k: &mut [usize], v: &mut [usize]) {
        match self.pages {
            None => {
                for (j, (ko, vo)) in k.iter_mut().zip(v.iter_mut()).enumerate() {
                    *ko = self.k_base + (j0 + j) * self.k_seq;
                    *vo = self.v_base + (j0 + j) * self.v_seq;
                }
            }
            Some(pages) => {
                let (mut slot, mut r) = (j0 / pages.block_size, j0 % pages.block_size);
                for (ko, vo) in k.iter_mut().zip(v.iter_mut()) {
                    // Validated: used keys' blocks are blocks of the cache (non-negative).
                    let block = pages.table.get(slot).map_or(0, |&b| b.max(0) as usize);
                    *ko = self.k_base + block * pages.k_block + r * self.k_seq;
                    *vo = self.v_base + block * pages.v_block + r * self.v_seq;
                    r += 1;
                    if r == pages.block_size {
                        (slot, r) = (slot + 1, 0);
                    }
                }
            }
        }
    }
}

/// Runs one task over the keys `keys` of its sequence (all of them for the forward pass, one
/// split's for split-KV decode; `keys.start` a multiple of the key tile): packs Qᵀ, streams
/// the key tiles the mask leaves, and hands the rows to `sink` (O and the LSE, or a partial
/// buffer).
///
/// # Safety
/// S's architecture must be available; the const generics must match the tiling
/// (`QMR == tiling.qk_keys`, `NR == tiling.row_vectors`, `VMR == tiling.pv_channels`,
/// `S::W == tiling.lanes`); the context's problem validated and buffers checked;
/// `keys.end ≤` the sequence's key count; a partial sink's buffers hold the task's rows.
#[inline(always)]
pub(crate) unsafe fn run_task<
    S: Simd,
    T: Element,
    O: Element,
    const QMR: usize,
    const NR: usize,
    const VMR: usize,
>(
    ctx: &Ctx<'_, T, O>,
    task: &Task,
    keys: Range<usize>,
    sink: Sink,
    scratch: &mut Scratch,
) -> TaskStats {
    let p = ctx.problem;
    let tiling = ctx.tiling;
    let panel = S::W * NR;
    // Compile-time: the mask's per-row bounds live in MAX_PANEL-long arrays.
    const { assert!(S::W * NR <= MAX_PANEL) };
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let dv_pad = dv.div_ceil(VMR) * VMR;
    let rows = task.heads * task.len;
    let seq = p.seq(task.batch);
    let dims = Dims {
        d,
        dv,
        dv_pad,
        v_stride: Tiling::v_stride(dv_pad),
        rows,
        br: tiling.padded_rows(rows),
        bc: tiling.keys_for(d, dv, !p.mask().is_none()),
        panel,
        few: rows <= S::W,
        d_w: d.div_ceil(S::W) * S::W,
        dv_w: dv.div_ceil(S::W) * S::W,
        sq: seq.seqlen_q,
        sk: seq.seqlen_k,
    };
    let Dims {
        br,
        bc,
        sk,
        few,
        d_w,
        dv_w,
        ..
    } = dims;
    let mut stats = TaskStats::default();

    let Scratch {
        qt,
        ot,
        st,
        kt,
        vt,
        row,
        probs,
        corr,
        states,
        kinds,
        kv_offsets,
        ..
    } = scratch;
    // The row-major layouts of the few-rows path fit the same buffers (see `Scratch`).
    let qt = ensure_aligned(qt, (d * br).max(S::W * d_w));
    let ot = ensure_aligned(ot, (dv_pad * br).max(S::W * dv_w));
    let st = ensure_aligned(st, bc * panel);
    let kt = ensure_aligned(kt, bc * d_w);
    let vt = ensure_aligned(vt, bc * dims.v_stride.max(dv_w));
    let row = ensure_aligned(row, panel * d.max(dv));
    let corr = ensure(corr, br, 1.0);
    let states = ensure(states, br, RowState::new());
    // K and V offsets of this tile's keys and the next's: [K | V] × [this | next].
    let kv_offsets = ensure(kv_offsets, 4 * bc, 0);
    let (k_offs, v_offs) = kv_offsets.split_at_mut(2 * bc);
    ot.fill(0.0);
    states.fill(RowState::new());

    let transform = p.score_transform::<f32>();
    let (pre, post) = (transform.pre_factor(), transform.softcap_post_factor());
    if few {
        // Row-major Q rows, pre-multiplied like Qᵀ, zero-padded to `d_w`.
        for r in 0..rows {
            let (head, i) = task.row(r);
            let dst = &mut qt[r * d_w..(r + 1) * d_w];
            // SAFETY: S available (caller); the offset is inside the checked buffer.
            unsafe { widen::<S, T>(ctx.q, p.q_offset(task.batch, i, head), d, dst) };
            dst[d..].fill(0.0);
            dst.iter_mut().for_each(|x| *x *= pre);
        }
    } else {
        // SAFETY: S available (caller); `qt` and `row` sized above.
        unsafe { pack_q::<S, T, O>(ctx, task, &dims, pre, qt, row) };
    }

    let kv = KvRows::new(p, task.batch, task.head_kv);
    let mask = p.mask();
    let q_rows = task.i0..task.i0 + task.len;
    let end = keys.end.min(sk);
    let first_tile = keys.start / bc;
    let total_tiles = (end.div_ceil(bc).saturating_sub(first_tile)) as u64;
    let visible = mask.key_tile_range(q_rows.clone(), bc, dims.sq, sk);
    let tiles = visible.start.max(first_tile)..visible.end.min(end.div_ceil(bc));
    for tile in tiles.clone() {
        let j0 = tile * bc;
        let nk = bc.min(end - j0);
        let kind = mask.classify_tile(q_rows.clone(), j0..j0 + nk, dims.sq, sk);
        if kind == TileKind::Empty {
            continue;
        }
        let next_rows = kv.tile_offsets(j0, nk, bc, end, tile + 1 < tiles.end, k_offs, v_offs);
        if few {
            // Row-major K and V rows, zero-padded to whole vectors.
            for j in 0..nk {
                let (kr, vr) = (
                    &mut kt[j * d_w..(j + 1) * d_w],
                    &mut vt[j * dv_w..(j + 1) * dv_w],
                );
                // SAFETY: S available (caller); the offsets are rows of the checked buffers.
                unsafe {
                    widen::<S, T>(ctx.k, k_offs[j], d, kr);
                    widen::<S, T>(ctx.v, v_offs[j], dv, vr);
                }
                kr[d..].fill(0.0);
                vr[dv..].fill(0.0);
            }
        } else {
            // SAFETY: S available (caller); `kt`, `vt` and `row` sized above for `bc` keys;
            // the offsets are those of keys j0..j0 + nk.
            unsafe { pack_kv_tile::<S, T, O, QMR>(ctx, &dims, k_offs, v_offs, nk, kt, vt, row) };
        }
        let kinds = ensure(kinds, br / panel, TileKind::Full);
        classify_panels(kinds, &mask, task, &dims, kind, j0..j0 + nk);

        // Each live panel of rows runs the whole tile in turn: Sᵀ = K·Qᵀ into `st` (nk × panel
        // floats, in L1), softcap, mask, online softmax, the hook, then Oᵀ = Oᵀ·corr + Vᵀ·Pᵀ.
        // Fused per panel, the scores never leave L1 (three passes over the whole block's
        // scores went through L2/L3 and cost up to a fifth of the time with two threads).
        // Meanwhile the next tile's K and V rows are prefetched, a few rows per PV micro-kernel
        // call: rows are a head stride apart, too far for the hardware prefetchers, and a
        // burst of prefetches would stall on the miss queue.
        let live_panels = kinds.iter().filter(|&&k| k != TileKind::Empty).count();
        stats.computed += live_panels as u64;
        let mut prefetch = NextTile {
            k_offs: &k_offs[nk..nk + next_rows],
            v_offs: &v_offs[nk..nk + next_rows],
            rows: next_rows,
            total: 2 * next_rows,
            calls: if few {
                live_panels * rows
            } else {
                live_panels * (dv_pad / VMR)
            },
            done: 0,
            call: 0,
        };
        for rv0 in (0..br).step_by(panel) {
            let kind = kinds[rv0 / panel];
            if kind == TileKind::Empty {
                continue; // P = 0 and the states unchanged: nothing to add
            }
            // Row vectors holding at least one real row: the last panel of a block whose row
            // count is not a multiple of the panel width computes only those (at N=1024 with
            // 48-row AVX-512 panels, 32 of 1056 rows would otherwise be padding). The scores of
            // the other vectors are set to 0, what padding rows' zero queries gave before, so
            // the softmax and the hook see the same values.
            let live = (rows - rv0).min(panel).div_ceil(S::W);
            if few {
                // SAFETY: S available (caller); qt holds `rows` rows of d_w, kt nk rows of
                // d_w, st nk rows of `panel`.
                unsafe { row_scores::<S>(qt, kt, d_w, rows, nk, st, panel) };
                if let Some(post) = post {
                    // SAFETY: nk·panel is a multiple of W; st holds bc·panel.
                    unsafe { softcap_slice::<S>(st.as_mut_ptr(), nk * panel, post) };
                }
            } else {
                // SAFETY: S available (caller); rv0 is a panel of `br`; the buffers sized
                // above.
                unsafe {
                    panel_scores::<S, QMR, NR>(&dims, qt, kt, st, rv0, nk, live, post);
                }
            }
            // SAFETY: as above.
            unsafe { mask_partial::<S, NR>(kind, &mask, task, &dims, st, rv0, j0, nk) };
            // SAFETY: the panel's scores sit at `j·panel` in st (bc·panel); rv0 + panel ≤ br =
            // the length of states and corr.
            unsafe {
                softmax_panel::<S, NR>(
                    st.as_mut_ptr(),
                    panel,
                    nk,
                    rv0,
                    rows,
                    states,
                    corr,
                    &ctx.policy,
                    &mut stats.rescale,
                    ctx.exp2,
                );
            }
            if let Some(hook) = ctx.hook {
                // SAFETY: S available (caller); `st` holds nk rows of `panel` floats.
                unsafe { run_hook::<S>(hook, probs, st, panel, nk) };
            }
            if few {
                for r in 0..rows {
                    let o = &mut ot[r * dv_w..(r + 1) * dv_w];
                    // SAFETY: S available (caller); vt holds nk rows of dv_w, st nk rows of
                    // `panel > r`, o dv_w floats.
                    unsafe { row_pv::<S>(st, panel, r, vt, dv_w, nk, corr[r], o) };
                    prefetch.after_call::<S, T, O>(ctx, &dims);
                }
                continue;
            }
            // SAFETY: S available (caller); the buffers sized above.
            unsafe {
                panel_pv::<S, T, O, VMR, NR>(
                    ctx,
                    &dims,
                    st,
                    vt,
                    ot,
                    corr,
                    rv0,
                    nk,
                    live,
                    &mut prefetch,
                );
            }
        }
    }
    stats.skipped = total_tiles * rows.div_ceil(panel) as u64 - stats.computed;

    match sink {
        // SAFETY: S available (caller); `ot` and `row` sized above, `states` holds `br` rows.
        Sink::Final => unsafe { write_back::<S, T, O>(ctx, task, &dims, ot, row, states) },
        Sink::Partial {
            first_row,
            acc,
            states: out_states,
        } => {
            // SAFETY: as above; the partial buffers hold the task's rows (caller).
            unsafe { write_partial::<S>(&dims, first_row, acc, out_states, ot, row, states) }
        }
    }
    stats
}

/// Packs `Qᵀ`, pre-multiplied by scale·log2(e) (or scale/cap under a softcap), one panel at a
/// time: the panel's rows are widened into `row` (rows × d, in L1), then written out column
/// by column, so the stores to Qᵀ are sequential. Padding rows get 0.
///
/// # Safety
/// S available; `qt` holds `d·br` floats, `row` `panel·d`; the context's buffers checked.
#[inline(always)]
unsafe fn pack_q<S: Simd, T: Element, O>(
    ctx: &Ctx<'_, T, O>,
    task: &Task,
    dims: &Dims,
    pre: f32,
    qt: &mut [f32],
    row: &mut [f32],
) {
    let p = ctx.problem;
    let Dims {
        d, rows, br, panel, ..
    } = *dims;
    for p0 in (0..br).step_by(panel) {
        let valid = rows.saturating_sub(p0).min(panel);
        for l in 0..valid {
            let (head, i) = task.row(p0 + l);
            let ahead = p0 + l + ROW_PREFETCH_AHEAD;
            if ahead < rows {
                let (head, i) = task.row(ahead);
                prefetch_row::<S, T>(ctx.q, p.q_offset(task.batch, i, head), d);
            }
            // SAFETY: S available (caller); the offsets are inside the checked buffer.
            unsafe { widen::<S, T>(ctx.q, p.q_offset(task.batch, i, head), d, &mut row[l * d..]) };
        }
        row[valid * d..panel * d].fill(0.0);
        let dst = &mut qt[p0 * d..(p0 + panel) * d];
        // SAFETY: `row` holds panel × d floats (stride d), `dst` d × panel (stride panel); S
        // available (caller).
        unsafe { transpose_region::<S>(row.as_ptr(), d, panel, d, dst.as_mut_ptr(), panel) };
        // SAFETY: S available (caller).
        let pre_v = unsafe { S::splat(pre) };
        for chunk in dst.chunks_exact_mut(S::W) {
            // SAFETY: W floats in the chunk; S available.
            unsafe { S::store(chunk.as_mut_ptr(), S::mul(S::load(chunk.as_ptr()), pre_v)) };
        }
    }
}

/// Packs the `nk` keys whose K and V rows start at `k_offs` and `v_offs` as f32, QMR keys at
/// a time. A group's K rows are widened into `row` and transposed into `[c][QMR]` (key j of
/// group g at `g·d·QMR + c·QMR + j % QMR`), zero keys after the last; V rows go straight to
/// their place (stride `v_stride`, zeros after `dv`).
///
/// # Safety
/// S available; `kt` holds `bc·d` floats, `vt` `bc·v_stride`, `row` at least `QMR·d`;
/// `nk ≤ bc`, the offsets hold `nk` rows inside the context's checked buffers.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_kv_tile<S: Simd, T: Element, O, const QMR: usize>(
    ctx: &Ctx<'_, T, O>,
    dims: &Dims,
    k_offs: &[usize],
    v_offs: &[usize],
    nk: usize,
    kt: &mut [f32],
    vt: &mut [f32],
    row: &mut [f32],
) {
    let Dims {
        d,
        dv,
        dv_pad,
        v_stride,
        ..
    } = *dims;
    let nk_pad = nk.div_ceil(QMR) * QMR;
    for g in 0..nk_pad / QMR {
        let in_group = nk.saturating_sub(g * QMR).min(QMR);
        for l in 0..in_group {
            let j = g * QMR + l;
            let (ko, vo) = (k_offs[j], v_offs[j]);
            // SAFETY: S available; offsets inside the checked buffers.
            unsafe {
                widen::<S, T>(ctx.k, ko, d, &mut row[l * d..]);
                widen::<S, T>(ctx.v, vo, dv, &mut vt[j * v_stride..]);
            }
            vt[j * v_stride + dv..j * v_stride + dv_pad].fill(0.0);
        }
        row[in_group * d..QMR * d].fill(0.0);
        let group = &mut kt[g * d * QMR..(g + 1) * d * QMR];
        // SAFETY: `row` holds QMR rows of d floats (panel·max(d, dv) ≥ QMR·d), `group` d
        // rows of QMR; S available (caller).
        unsafe { pack_group::<S, QMR>(row.as_ptr(), d, group.as_mut_ptr()) };
    }
}

/// Classifies each panel of rows against the key tile `keys` (whose kind for the whole task
/// is `kind`): on the diagonal of a causal or windowed mask whole panels can be empty, and
/// those skip QKᵀ, softmax and PV.
#[inline(always)]
pub(super) fn classify_panels(
    kinds: &mut [TileKind],
    mask: &Mask,
    task: &Task,
    dims: &Dims,
    kind: TileKind,
    keys: Range<usize>,
) {
    let Dims {
        rows,
        panel,
        sq,
        sk,
        ..
    } = *dims;
    for (pi, k) in kinds.iter_mut().enumerate() {
        let (r0, r1) = (pi * panel, ((pi + 1) * panel).min(rows));
        *k = if r0 >= rows {
            TileKind::Empty // padding only
        } else if kind == TileKind::Full {
            TileKind::Full
        } else {
            // Positions of rows r0..r1: contiguous unless the panel crosses into the
            // next head's rows (then take the task's whole range: conservative).
            let i_range = if r0 / task.len == (r1 - 1) / task.len {
                task.row(r0).1..task.row(r1 - 1).1 + 1
            } else {
                task.i0..task.i0 + task.len
            };
            mask.classify_tile(i_range, keys.clone(), sq, sk)
        };
    }
}

/// The scores of the panel at row `rv0` against the packed key tile: `Sᵀ = K·Qᵀ` on the
/// `live` row vectors (the others set to 0), then the softcap (before the mask: tanh(−∞)
/// would be finite).
///
/// # Safety
/// S available; `qt` holds `d·br` floats, `kt` `bc·d`, `st` `bc·panel`; `rv0 + panel ≤ br`,
/// `nk ≤ bc`, `1 ≤ live ≤ NR`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn panel_scores<S: Simd, const QMR: usize, const NR: usize>(
    dims: &Dims,
    qt: &[f32],
    kt: &[f32],
    st: &mut [f32],
    rv0: usize,
    nk: usize,
    live: usize,
    post: Option<f32>,
) {
    let Dims { d, panel, .. } = *dims;
    let nk_pad = nk.div_ceil(QMR) * QMR;
    for j in (0..nk_pad).step_by(QMR) {
        // SAFETY: rv0 + panel ≤ br; j + QMR ≤ nk_pad ≤ bc; kt holds bc·d (group j/QMR
        // at j·d); qt holds d·br (panel rv0/panel starts at rv0·d); st holds bc·panel;
        // live ≤ NR.
        unsafe {
            on_live_vectors!(
                live,
                NR,
                qk_micro::<S, QMR, _>(
                    qt.as_ptr().add(rv0 * d),
                    panel,
                    kt.as_ptr().add(j * d),
                    d,
                    st.as_mut_ptr().add(j * panel),
                    panel,
                )
            );
        }
    }
    if live < NR {
        for j in 0..nk_pad {
            st[j * panel + live * S::W..(j + 1) * panel].fill(0.0);
        }
    }
    if let Some(post) = post {
        // SAFETY: nk_pad·panel is a multiple of W; st holds bc·panel ≥ nk_pad·panel.
        unsafe { softcap_slice::<S>(st.as_mut_ptr(), nk_pad * panel, post) };
    }
}

/// Hides, in the panel at row `rv0`, the keys of the tile `j0..j0 + nk` its rows do not see,
/// when the panel's tile is `Partial` (`kind`); nothing for a `Full` one. The step both the
/// SIMD and the AMX task take between the scores and the softmax; it only writes `−∞`, so it
/// may come before or after a positive scale.
///
/// # Safety
/// S available; `st` holds `nk` rows of `panel` floats; `rv0 < rows`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn mask_partial<S: Simd, const NR: usize>(
    kind: TileKind,
    mask: &Mask,
    task: &Task,
    dims: &Dims,
    st: &mut [f32],
    rv0: usize,
    j0: usize,
    nk: usize,
) {
    if kind != TileKind::Partial {
        return;
    }
    let Dims {
        rows,
        panel,
        sq,
        sk,
        ..
    } = *dims;
    // Each row's visible keys within the tile, `lo..hi` (as floats: below nk ≤ 2^24,
    // exact); padding rows hide nothing.
    let (mut lo, mut hi) = ([0.0f32; MAX_PANEL], [nk as f32; MAX_PANEL]);
    for r in rv0..(rv0 + panel).min(rows) {
        let visible = mask.key_range(task.row(r).1, sq, sk);
        let first = visible.start.clamp(j0, j0 + nk) - j0;
        lo[r - rv0] = first as f32;
        hi[r - rv0] = (visible.end.clamp(j0 + first, j0 + nk) - j0) as f32;
    }
    // SAFETY: st holds nk ≤ bc rows of `panel` floats; lo and hi hold
    // MAX_PANEL ≥ panel (checked when the kernel starts); S available (caller).
    unsafe { mask_panel::<S, NR>(st.as_mut_ptr(), panel, nk, &lo, &hi) };
}

/// Passes a panel's probabilities (`st`: `nk` rows of `panel`) to the hook row-major, through
/// `probs`, and takes back what it made of them.
///
/// # Safety
/// S available; `st` holds `nk·panel` floats.
#[inline(always)]
unsafe fn run_hook<S: Simd>(
    hook: crate::ProbabilityHook<'_>,
    probs: &mut Vec<f32>,
    st: &mut [f32],
    panel: usize,
    nk: usize,
) {
    let probs = ensure(probs, panel * nk, 0.0);
    // SAFETY: st holds nk rows of `panel` floats, probs panel rows of nk; S
    // available (caller).
    unsafe { transpose_region::<S>(st.as_ptr(), panel, nk, panel, probs.as_mut_ptr(), nk) };
    hook(probs);
    // SAFETY: as above, the other way round.
    unsafe { transpose_region::<S>(probs.as_ptr(), nk, panel, nk, st.as_mut_ptr(), panel) };
}

/// The prefetch of the next key tile's K and V rows, spread over a tile's PV micro-kernel
/// calls: `total` rows (K's then V's) over `calls` calls.
pub(super) struct NextTile<'o> {
    /// Offsets of the next tile's K rows.
    pub(super) k_offs: &'o [usize],
    /// Offsets of the next tile's V rows.
    pub(super) v_offs: &'o [usize],
    /// Keys in the next tile (0: no next tile).
    pub(super) rows: usize,
    /// Rows to prefetch in all (`2·rows`: K, then V).
    pub(super) total: usize,
    /// PV micro-kernel calls this tile makes.
    pub(super) calls: usize,
    /// Rows prefetched so far.
    pub(super) done: usize,
    /// Calls made so far.
    pub(super) call: usize,
}

impl NextTile<'_> {
    /// Counts one PV call and prefetches the rows due by then.
    #[inline(always)]
    pub(super) fn after_call<S: Simd, T: Element, O>(&mut self, ctx: &Ctx<'_, T, O>, dims: &Dims) {
        self.call += 1;
        let target = self.call * self.total / self.calls.max(1);
        while self.done < target {
            let j = self.done % self.rows;
            if self.done < self.rows {
                prefetch_row::<S, T>(ctx.k, self.k_offs[j], dims.d);
            } else {
                prefetch_row::<S, T>(ctx.v, self.v_offs[j], dims.dv);
            }
            self.done += 1;
        }
    }
}

/// `Oᵀ = Oᵀ·corr + Vᵀ·Pᵀ` for the panel at row `rv0` on its `live` row vectors, `VMR`
/// channels per micro-kernel call, prefetching some of the next tile after each call.
///
/// # Safety
/// S available; `st` holds this panel's `nk` rows of `panel` floats, `vt` `nk` rows of stride
/// `v_stride`, `ot` `dv_pad·br` (panel-major), `corr` `br`; `rv0 + panel ≤ br`,
/// `1 ≤ live ≤ NR`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn panel_pv<S: Simd, T: Element, O, const VMR: usize, const NR: usize>(
    ctx: &Ctx<'_, T, O>,
    dims: &Dims,
    st: &[f32],
    vt: &[f32],
    ot: &mut [f32],
    corr: &[f32],
    rv0: usize,
    nk: usize,
    live: usize,
    prefetch: &mut NextTile<'_>,
) {
    let Dims {
        dv_pad,
        v_stride,
        panel,
        ..
    } = *dims;
    let corr_ptr = if corr[rv0..rv0 + panel].iter().any(|&c| c != 1.0) {
        corr[rv0..].as_ptr()
    } else {
        std::ptr::null()
    };
    for c0 in (0..dv_pad).step_by(VMR) {
        // SAFETY: rv0 + panel ≤ br; c0 + VMR ≤ dv_pad; st holds this panel's nk rows
        // of `panel` floats, ot (dv_pad·br, panel-major) its dv_pad rows; vt holds nk
        // rows of stride v_stride; corr holds br.
        unsafe {
            on_live_vectors!(
                live,
                NR,
                pv_micro::<S, VMR, _>(
                    st.as_ptr(),
                    panel,
                    vt.as_ptr().add(c0),
                    v_stride,
                    nk,
                    ot.as_mut_ptr().add(rv0 * dv_pad + c0 * panel),
                    panel,
                    corr_ptr,
                )
            );
        }
        prefetch.after_call::<S, T, O>(ctx, dims);
    }
}

/// Normalises once per row and writes O and the LSE, one panel at a time: the panel of
/// Oᵀ is read sequentially and transposed into `row` (rows × dv, in L1), then each row
/// is written out contiguously.
///
/// # Safety
/// S available; `ot` holds `dv_pad·br` floats, `row` `panel·dv`, `states` `br` rows.
#[inline(always)]
pub(super) unsafe fn write_back<S: Simd, T, O: Element>(
    ctx: &Ctx<'_, T, O>,
    task: &Task,
    dims: &Dims,
    ot: &[f32],
    row: &mut [f32],
    states: &[RowState<f32>],
) {
    let p = ctx.problem;
    let Dims {
        dv,
        rows,
        br,
        panel,
        ..
    } = *dims;
    for p0 in (0..br).step_by(panel) {
        let valid = rows.saturating_sub(p0).min(panel);
        // SAFETY: S available (caller); `ot` and `row` sized by run_task.
        let (src_rows, stride) = unsafe { row_major::<S>(dims, ot, row, p0) };
        for l in 0..valid {
            let r = p0 + l;
            let (head, i) = task.row(r);
            let result = states[r].finish_with_sink(p.sink_log2(head));
            let oo = p.o_offset(task.batch, i, head);
            let ahead = r + ROW_PREFETCH_AHEAD;
            if ahead < rows {
                let (head, i) = task.row(ahead);
                ctx.out
                    .prefetch_row::<S>(p.o_offset(task.batch, i, head), dv);
            }
            // A row that saw no key gets 0, whatever V holds.
            let seen = result.inv_sum != 0.0;
            let values = src_rows[l * stride..l * stride + dv]
                .iter()
                .map(|&acc| O::from_f32(if seen { acc * result.inv_sum } else { 0.0 }));
            ctx.out.write_row(oo, values);
            if let Some(lse) = &ctx.lse {
                lse.write(p.lse_offset(task.batch, head, i), result.lse);
            }
        }
    }
}

/// Writes the task's rows unnormalised into a split-KV partial buffer: each row's
/// online-softmax state and its accumulator (the combine merges the splits with
/// `softmax_core::merge_into` and normalises).
///
/// # Safety
/// S available; `ot` holds `dv_pad·br` floats, `row` `panel·dv`, `states` `br` rows; `acc`
/// and `out_states` hold rows `first_row..first_row + rows`.
#[inline(always)]
unsafe fn write_partial<S: Simd>(
    dims: &Dims,
    first_row: usize,
    acc: SharedOut<f32>,
    out_states: SharedOut<RowState<f32>>,
    ot: &[f32],
    row: &mut [f32],
    states: &[RowState<f32>],
) {
    let Dims {
        dv,
        rows,
        br,
        panel,
        ..
    } = *dims;
    for p0 in (0..br).step_by(panel) {
        let valid = rows.saturating_sub(p0).min(panel);
        // SAFETY: S available (caller); `ot` and `row` sized by run_task.
        let (src_rows, stride) = unsafe { row_major::<S>(dims, ot, row, p0) };
        for l in 0..valid {
            let r = first_row + p0 + l;
            acc.write_row(
                r * dv,
                src_rows[l * stride..l * stride + dv].iter().copied(),
            );
            out_states.write(r, states[p0 + l]);
        }
    }
}

/// The accumulator rows of the panel at row `p0`, row-major, and their stride: the
/// few-rows path keeps them so in `ot` (stride `dv_w`); otherwise the panel of `Oᵀ` is
/// transposed into `row` (stride `dv`).
///
/// # Safety
/// S available; `ot` holds `dv_pad·br` floats (few rows: `rows·dv_w`), `row` `panel·dv`.
#[inline(always)]
unsafe fn row_major<'b, S: Simd>(
    dims: &Dims,
    ot: &'b [f32],
    row: &'b mut [f32],
    p0: usize,
) -> (&'b [f32], usize) {
    if dims.few {
        return (&ot[..dims.rows * dims.dv_w], dims.dv_w);
    }
    let Dims {
        dv, dv_pad, panel, ..
    } = *dims;
    let src = &ot[p0 * dv_pad..(p0 + panel) * dv_pad];
    // SAFETY: `src` holds dv_pad ≥ dv rows of `panel` floats, `row` panel rows of dv; S
    // available (caller).
    unsafe { transpose_region::<S>(src.as_ptr(), panel, dv, panel, row.as_mut_ptr(), dv) };
    (&row[..panel * dv], dv)
}
