//! Split-KV decode's streaming kernel: the decode-specific inner loop for problems whose KV
//! heads each serve a few query rows (a GQA group's heads × a few new tokens).
//!
//! A work [`Item`] is one sequence, a run of **consecutive KV heads** and a range of keys.
//! Its query rows (every query head of those KV heads × the sequence's new tokens) stay in L1,
//! pre-scaled, and K and V rows are read **straight from the cache** (padded, or paged through
//! the block table), key after key and, for each key, head after head: in the usual
//! `[.., seq, heads_kv, head_dim]` layout that is one contiguous run of bytes per key, so the
//! hardware prefetchers stream the cache at full speed and each K/V byte is read once for its
//! whole group. Per key tile:
//! - `S = Q·Kᵀ`: for each (key, head), dot products of up to [`ROW_BLOCK`] rows at once over
//!   the head dim, vectorised along it (two keys per step, so each Q vector loaded from L1
//!   serves two K vectors), one horizontal sum per score;
//! - softcap, mask, then the online softmax per row over the tile's scores (vectorised over
//!   the keys; `softmax_core::RowState` keeps the books), the accumulator rescaled when the
//!   rule says so;
//! - `O += P·V`: for each (head, block of rows), four keys' V rows at a time are multiplied
//!   into the rows' accumulators (vectorised over the head dim); with bf16 K/V and a bf16/f16
//!   output at 16 lanes on AMX, on the tiles instead ([`pv_tile_amx`]).
//!
//! Nothing is copied or packed: bf16 and f16 are widened in registers. bf16 is widened by a
//! shift and a mask per vector ([`Simd::load_bf16_pair`]), which de-interleaves each `2·W`
//! elements into even and odd lanes; Q rows and the accumulators are kept in that same
//! "register order" ([`reg_pos`]), so dot products and `P·V` need no shuffle, and the order is
//! undone when rows are written out.
//!
//! [`plan`] cuts the work: KV heads into runs whose Q and O rows fit [`ITEM_QO_BYTES`], each
//! sequence's visible keys into splits (problem-only rule, so results never depend on the
//! thread count); [`combine`] merges a run's splits with `softmax_core::merge_into`.

use super::decode_task::{merge_rows, split_units, Partials, SplitPlan};
use super::forward_task::{Ctx, KvRows, TaskStats};
use super::pack::{prefetch_row, widen};
use super::scratch::{ensure, ensure_aligned, ensure_on_line, Scratch};
use super::softmax::softcap_slice;
use crate::arch::amx::{Tiles, TILE_ROWS, TILE_ROW_BYTES};
use crate::arch::{exp2_cubic, exp2_exact, Arch, Simd};
use crate::dispatch::SimdTask;
use crate::element::{sealed, Element};
use crate::Exp2Impl;
use softmax_core::{DType, Problem, ProblemError, RescalePolicy, RescaleStats, RowState};
use std::ops::Range;

/// Keys per tile: the scores of a tile (rows × 64 floats) stay in L1, and the per-row softmax
/// bookkeeping is paid once per 64 keys.
pub(crate) const TILE_KEYS: usize = 64;
/// Most query rows per KV head (group × new tokens) this kernel takes; above it the tiled
/// forward's register-blocked GEMMs reuse each K/V tile better.
pub(crate) const MAX_ROWS_PER_HEAD: usize = 32;
/// Bytes of Q and O rows (f32 sizes) an item holds at most: all KV heads of a sequence in one
/// run wherever they fit, so that an item reads whole key rows of the cache. With runs of
/// fewer heads, neighbouring items read alternate parts of each key's K/V row, and (the likely
/// cause, not measured) each core's L2 streamer fetches the part the other item needs. At
/// 64/8 and 128/8 heads (64 and 128 KiB of rows: two and four runs under the former 32 KiB)
/// one run was 1.09× faster from DRAM on the GPU machine's Xeon (geometric mean of 22 paired
/// medians, bf16 and f32, 0.90–1.23, 18 of them ≥ 1.0; the B1 16k shapes 0.90–1.07) and
/// neutral in cache. At 16 rows per KV head (32/8 heads, 4 query tokens: four runs before)
/// one run is 1.11–1.17× from DRAM, but the f32 SIMD path, whose Q rows then leave the L1, is
/// ~0.8× in cache: a decode streams from DRAM (both: docs/history/gpu-notes.md, 2026-12-04).
pub(crate) const ITEM_QO_BYTES: usize = 128 << 10;
/// Work items the automatic split count aims for in all: enough for a many-core host when
/// batch × runs of heads is small. A rule of the problem alone (never the thread count).
pub(crate) const TARGET_ITEMS: usize = 32;
/// Fewest K+V bytes per split under the automatic rule: below this a split's fixed costs
/// (loading Q, the cold start of its K/V streams, writing its partial rows, the combine)
/// start to show. Measured on the GPU machine's Xeon (2 pinned cores, bf16, B=1, 4k keys =
/// 16 MiB, 5 rounds each; docs/history/gpu-notes.md, 2026-12-01, the split sweep of branch
/// dec2): 32 splits of 512 KiB 1.57 ms, 16 of 1 MiB 1.27 ms, 8 of 2 MiB 1.09 ms. Larger caches
/// keep [`TARGET_ITEMS`] splits.
pub(crate) const MIN_SPLIT_BYTES: usize = 2 << 20;
/// Query rows per dot-product / `P·V` block (register blocking).
pub(crate) const ROW_BLOCK: usize = 4;
/// Keys per `Q·Kᵀ` step.
const QK_KEYS: usize = 2;
/// Most query rows per KV head the AMX `Q·Kᵀ` takes: the columns of one C tile.
pub(crate) const AMX_MAX_ROWS: usize = 16;
/// Head-dim elements per AMX step: one A-tile row of bf16.
const AMX_CHUNK: usize = TILE_ROW_BYTES / 2;
/// Keys per AMX step: the rows of an A tile (one key's K row of one head each).
const AMX_KEYS: usize = TILE_ROWS;
/// Dwords per tile.
const TILE_DWORDS: usize = TILE_ROWS * TILE_ROW_BYTES / 4;
/// Keys per `P·V` step.
const PV_KEYS: usize = 4;

/// The software prefetch schedule of the streaming decode loop ([`DecodeOptions::prefetch`];
/// all into L2, `prefetcht1`): a tuning knob for benchmarks; results never depend on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DecodePrefetch {
    /// No software prefetch (the hardware prefetchers alone).
    Off,
    /// The default: one phase ahead: this tile's V rows during `Q·Kᵀ`, the next tile's K
    /// rows during `P·V`, and an item's first K rows before its Q rows are loaded. On the
    /// 2-core Xeon VM (bf16, B=1, 16k keys, one thread, 9 rounds after a cache-evicting copy)
    /// K/V read 0.33–0.38 of the copy bandwidth with it, 0.24–0.31 without.
    #[default]
    Phase,
    /// A fixed distance ahead in each stream: K rows `n` keys (all the item's heads) ahead of
    /// `Q·Kᵀ`, V rows `n` keys ahead of `P·V` (`n` at most 64, the keys of one tile: more
    /// acts as 64, and 0 as no fixed-distance stream).
    Ahead(usize),
    /// Both [`DecodePrefetch::Phase`] and [`DecodePrefetch::Ahead`].
    PhaseAhead(usize),
    /// One tile ahead in both streams, paced by `P·V` (the longer phase): the next tile's K
    /// and V rows during this tile's `P·V`, nothing during `Q·Kᵀ` (except an item's first
    /// tile's V rows, which no earlier `P·V` fetched), and an item's first K rows before its
    /// Q rows are loaded. V rows a whole tile ahead (under `Phase`, only one `Q·Kᵀ` ahead),
    /// and no burst of prefetches during the short AMX `Q·Kᵀ`.
    Next,
}

impl DecodePrefetch {
    /// Parses `off`, `phase`, `next`, `ahead:N` or `phase+ahead:N` (`N` in `1..=64`); `None`
    /// for anything else.
    pub fn parse(s: &str) -> Option<DecodePrefetch> {
        let ahead = |n: &str| {
            n.parse::<usize>()
                .ok()
                .filter(|&n| (1..=TILE_KEYS).contains(&n))
        };
        match s {
            "off" => Some(DecodePrefetch::Off),
            "phase" => Some(DecodePrefetch::Phase),
            "next" => Some(DecodePrefetch::Next),
            _ => {
                if let Some(n) = s.strip_prefix("phase+ahead:") {
                    ahead(n).map(DecodePrefetch::PhaseAhead)
                } else {
                    s.strip_prefix("ahead:")
                        .and_then(ahead)
                        .map(DecodePrefetch::Ahead)
                }
            }
        }
    }

    /// Whether the phase-ahead streams run.
    fn phase(self) -> bool {
        matches!(self, DecodePrefetch::Phase | DecodePrefetch::PhaseAhead(_))
    }

    /// Whether both streams run one tile ahead during `P·V` ([`DecodePrefetch::Next`]).
    fn next(self) -> bool {
        self == DecodePrefetch::Next
    }

    /// Keys of the fixed-distance streams (0: none; at most [`TILE_KEYS`], whatever the
    /// variant holds, so that a hand-built `Ahead(n)` never reads past the offsets).
    fn ahead(self) -> usize {
        match self {
            DecodePrefetch::Ahead(n) | DecodePrefetch::PhaseAhead(n) => n.min(TILE_KEYS),
            _ => 0,
        }
    }
}

/// Options of the split-KV decode's streaming loop (KV-cache problems with at most 32 query
/// rows per KV head and no probability hook; [`crate::ForwardOptions::decode`]). The default
/// is the library's tuned choice. Read once per call and per work item, never per key tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DecodeOptions {
    /// The software prefetch schedule (default [`DecodePrefetch::Phase`]). Results are
    /// bitwise the same under every schedule.
    pub prefetch: DecodePrefetch,
    /// Whether `P·V` of bf16 caches with a bf16 or f16 output runs on AMX tiles beside the
    /// tiles' `Q·Kᵀ` (at most 8 query rows per KV head), P rounded to bf16 (relative 2⁻⁹,
    /// the size of the output's own rounding: inside the bf16/f16 contract of 1e-2). On by
    /// default; `false` keeps that product in f32 on the SIMD kernels. On the GPU machine's
    /// Xeon, one core with the cache in L2, the tiles were 1.05× (h8/2) and 1.16× (h64/8) the
    /// SIMD `P·V`; from DRAM on 2 pinned cores the paired medians of 22 shape pairs had a
    /// geometric mean of 1.04 (the worst 0.93). No effect off AMX.
    pub amx_pv: bool,
    /// Whether the SIMD `Q·Kᵀ` of bf16 caches (no AMX tiles: levels `Avx512f`, or `Amx` where
    /// the tiles do not take the problem) multiplies bf16 pairs with AVX512-BF16's
    /// `vdpbf16ps` (exact products, f32 sums; bf16 denormals read as zero) instead of
    /// widening K to f32. Off by default; ignored where the CPU lacks AVX512-BF16 or the
    /// level is below AVX-512 (then K is widened as by default). Meant for AMD's Zen 4 and
    /// later, which issue `vdpbf16ps` at the FMA's rate (twice the FMA's multiply-adds per
    /// instruction); no end-to-end A/B on such a host has been taken yet. Intel's
    /// AVX512-BF16 CPUs issue it at a quarter of the FMA's rate and run the bf16 decode on
    /// AMX where they have it.
    pub bf16_dots: bool,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            prefetch: DecodePrefetch::default(),
            amx_pv: true,
            bf16_dots: false,
        }
    }
}

/// Whether the streaming kernel takes a split-KV problem: few rows per KV head, and no
/// probability hook (which wants the tiled forward's panels).
pub(crate) fn applies(p: &Problem, hook: bool) -> bool {
    !hook && p.group_size().saturating_mul(p.max_seqlen_q()) <= MAX_ROWS_PER_HEAD
}

/// One work item: sequence `batch`, KV heads `heads`, keys `keys`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Item {
    /// The sequence.
    pub batch: usize,
    /// Consecutive KV heads; the item's rows are, per head, its query heads × new tokens.
    pub heads: Range<usize>,
    /// Keys of this split.
    pub keys: Range<usize>,
    /// `None`: the only split, written straight to O; `Some(r)`: its partial rows start at
    /// row `r` of the partial buffers.
    pub first_row: Option<usize>,
}

/// A run of heads whose splits the combine merges: `splits` consecutive blocks of rows from
/// `first_row` on, in split order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Combine {
    /// The sequence.
    pub batch: usize,
    /// The KV heads.
    pub heads: Range<usize>,
    /// Partial row of split 0's row 0.
    pub first_row: usize,
    /// Splits to merge (≥ 2).
    pub splits: usize,
}

/// The streaming plan of a call.
pub(crate) type Plan = SplitPlan<Item, Combine>;

/// `n` rounded up to whole chunks of `2·lanes` (what the kernels load per step).
pub(crate) fn padded(n: usize, lanes: usize) -> usize {
    n.div_ceil(2 * lanes) * 2 * lanes
}

/// Query rows per KV head of sequence `b`.
fn rows_per_head(p: &Problem, b: usize) -> usize {
    p.group_size() * p.seq(b).seqlen_q
}

/// The query head and position of row `r` of a KV head's rows (positions first, then heads,
/// as the tiled forward's tasks).
#[inline(always)]
fn row_of(head_kv: usize, group: usize, sq: usize, r: usize) -> (usize, usize) {
    (head_kv * group + r / sq, r % sq)
}

/// Cuts the work (see the module doc): KV heads into runs of at most [`ITEM_QO_BYTES`] of Q
/// and O rows (balanced), each run's visible keys into splits of whole tiles: `forced` when
/// given (at most one per tile), else [`TARGET_ITEMS`] items spread over the runs with at
/// least [`MIN_SPLIT_BYTES`] of K+V per split and at most
/// [`super::decode_task::MAX_AUTO_SPLITS`] splits.
/// `lanes` is the architecture's vector width, `elem_bytes` the K/V element's size.
pub(crate) fn plan(
    p: &Problem,
    lanes: usize,
    elem_bytes: usize,
    forced: Option<usize>,
) -> Result<Plan, ProblemError> {
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let qo_per_row = 4 * (padded(d, lanes) + padded(dv, lanes));
    let heads_kv = p.heads_kv();
    let mask = p.mask();
    // Per sequence: heads per run, runs, visible keys (None: no query rows).
    let layout = |b: usize| {
        let seq = p.seq(b);
        let rph = rows_per_head(p, b);
        if rph == 0 {
            return None;
        }
        let fit = (ITEM_QO_BYTES / (rph * qo_per_row)).clamp(1, heads_kv);
        let runs = heads_kv.div_ceil(fit);
        let per_run = heads_kv.div_ceil(runs);
        let visible = mask.union_key_range(0..seq.seqlen_q, seq.seqlen_q, seq.seqlen_k);
        Some((per_run, heads_kv.div_ceil(per_run), visible, rph))
    };
    let units: usize = (0..p.batch()).filter_map(layout).map(|l| l.1).sum();
    let wanted = TARGET_ITEMS.div_ceil(units.max(1));
    let cut = |per_run: usize, visible: &Range<usize>| {
        let n = visible.len();
        let key_bytes = (per_run * (d + dv) * elem_bytes).max(1);
        let min_keys = MIN_SPLIT_BYTES.div_ceil(key_bytes).max(1);
        let (tiles, splits) = split_units(n.div_ceil(TILE_KEYS), forced, wanted, n / min_keys);
        (tiles * TILE_KEYS, splits)
    };
    // Two passes: count, then fill, so the lists are allocated with `try_reserve`.
    let (mut n_items, mut n_combines) = (0usize, 0usize);
    for b in 0..p.batch() {
        if let Some((per_run, runs, visible, _)) = layout(b) {
            let (_, splits) = cut(per_run, &visible);
            n_items = splits
                .checked_mul(runs)
                .and_then(|n| n.checked_add(n_items))
                .ok_or(ProblemError::Overflow)?;
            n_combines += if splits > 1 { runs } else { 0 };
        }
    }
    let mut plan = Plan::with_capacity(n_items, n_combines)?;
    let mut first_rows: Vec<usize> = Vec::new();
    for b in 0..p.batch() {
        let Some((per_run, runs, visible, rph)) = layout(b) else {
            continue;
        };
        let (per_split, splits) = cut(per_run, &visible);
        let run_heads = |r: usize| r * per_run..((r + 1) * per_run).min(heads_kv);
        first_rows.clear();
        if splits > 1 {
            first_rows
                .try_reserve_exact(runs)
                .map_err(|_| ProblemError::OutOfMemory {
                    what: "the combine list",
                    bytes: runs.saturating_mul(8),
                })?;
            for r in 0..runs {
                let heads = run_heads(r);
                let first_row = plan.take_rows(splits, heads.len() * rph)?;
                first_rows.push(first_row);
                plan.combines.push(Combine {
                    batch: b,
                    heads,
                    first_row,
                    splits,
                });
            }
        }
        // Work order: a sequence's splits in key order, the runs of heads of one split
        // together (neighbouring items read neighbouring memory).
        for s in 0..splits {
            let keys = if splits == 1 {
                visible.clone()
            } else {
                let start = visible.start + s * per_split;
                start..(start + per_split).min(visible.end)
            };
            for r in 0..runs {
                let heads = run_heads(r);
                plan.max_rows = plan.max_rows.max(heads.len() * rph);
                // Empty when unsplit: then the item writes O itself.
                let first_row = first_rows.get(r).map(|f| f + s * heads.len() * rph);
                plan.items.push(Item {
                    batch: b,
                    heads,
                    keys: keys.clone(),
                    first_row,
                });
            }
        }
    }
    Ok(plan)
}

/// Scratch lengths (f32 elements, before alignment slack) the items of a plan ask for:
/// Q rows, O rows, scores, one natural-order row; `rows` states; the K and V offsets of two
/// tiles; under the AMX `Q·Kᵀ` the Q B tiles, one gathered A tile and the C tile with its
/// transpose. Reserved before the items run (`Scratch::try_reserve_stream`), so that no
/// item allocates.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StreamLens {
    /// The most rows of any item.
    pub rows: usize,
    /// Head dims padded to whole chunks.
    pub d_pad: usize,
    /// See `d_pad`.
    pub dv_pad: usize,
    /// Dwords of the Q B tiles of the item with the most KV heads when the AMX `Q·Kᵀ` runs
    /// ([`amx_q_dwords`]), else 0 (no AMX buffers).
    pub amx_q: usize,
    /// Whether the AMX `P·V` may run ([`amx_pv_applies`]; its P tiles are reserved).
    pub amx_pv: bool,
}

impl StreamLens {
    /// Dwords of one tile: the gathered A tile of the AMX `Q·Kᵀ`.
    pub(crate) const AMX_A_DWORDS: usize = TILE_DWORDS;
    /// Floats of the C tile and its transpose.
    pub(crate) const AMX_C_FLOATS: usize = 2 * TILE_DWORDS;

    /// The lengths of one plan: `amx` when the items run on tiles (their `Q·Kᵀ`, and their
    /// `P·V` too where [`amx_pv_applies`] with the call's `amx_pv`).
    pub(crate) fn of(
        p: &Problem,
        plan: &Plan,
        lanes: usize,
        output: DType,
        amx: bool,
        amx_pv: bool,
    ) -> StreamLens {
        let max_heads = plan.items.iter().map(|i| i.heads.len()).max().unwrap_or(0);
        StreamLens {
            rows: plan.max_rows,
            d_pad: padded(p.head_dim(), lanes),
            dv_pad: padded(p.head_dim_v(), lanes),
            amx_q: if amx {
                amx_q_dwords(max_heads, p.head_dim())
            } else {
                0
            },
            amx_pv: amx && amx_pv_applies(output, lanes, amx_pv),
        }
    }

    /// Dwords of the tile-operand buffer (`Scratch::amx_pairs`): the gathered K rows' A tile,
    /// and under the AMX `P·V` the P A tiles and the V B tiles of one head.
    pub(crate) fn amx_pair_dwords(&self) -> usize {
        amx_pair_dwords(self.amx_q > 0, self.amx_pv)
    }

    /// Bytes the lengths add up to (before alignment slack): what one worker reserves.
    pub(crate) fn bytes(&self) -> usize {
        let floats = self.rows * (self.d_pad + TILE_KEYS)
            + self.rows * self.dv_pad
            + self.d_pad.max(self.dv_pad)
            + if self.amx_q > 0 {
                Self::AMX_C_FLOATS
            } else {
                0
            };
        let dwords = self.amx_q + self.amx_pair_dwords();
        4 * (floats + dwords)
            + self.rows * std::mem::size_of::<RowState<f32>>()
            + 4 * TILE_KEYS * std::mem::size_of::<usize>()
    }
}

/// Whether the AMX `P·V` ([`pv_tile_amx`]) may run beside the AMX `Q·Kᵀ` (an item takes it
/// when its rows per KV head are at most [`AMX_PV_MAX_ROWS`]): at 16 lanes, where a
/// 32-element chunk of an O row in register order is two C-tile rows' worth (even elements,
/// then odd), and for bf16/f16 outputs only: it rounds P to bf16 (relative 2⁻⁹, the size of
/// the output's own rounding), which an f32 output's 1e-5 bound does not allow.
///
/// On by default ([`DecodeOptions::amx_pv`]). On the GPU machine's Xeon, one core with the
/// cache in L2, it is 1.05× (h8/2) and 1.16× (h64/8) the SIMD `P·V`; from DRAM on 2 pinned
/// cores the paired medians of three device calls (22 shape pairs) have a geometric mean of
/// 1.04, 16 of them ≥ 1.0 (the worst 0.93); docs/history/gpu-notes.md, 2026-12-04.
/// `allowed`: the call's option (the emulated tiles of the tests follow it too, so both
/// settings are tested on any CPU).
pub(crate) fn amx_pv_applies(output: DType, lanes: usize, allowed: bool) -> bool {
    allowed && lanes == TILE_ROWS && output != DType::F32
}

/// Dwords of the tile-operand buffer (`Scratch::amx_pairs`) of an item: under the AMX
/// `Q·Kᵀ` (`tiles`) one gathered tile (K rows, or V rows under the AMX `P·V`), and under the
/// AMX `P·V` (`pv`) the P A tiles of one head too. The one rule of [`StreamLens`] (what is
/// reserved) and `run_item` (what is used).
fn amx_pair_dwords(tiles: bool, pv: bool) -> usize {
    match (tiles, pv) {
        (false, _) => 0,
        (true, false) => StreamLens::AMX_A_DWORDS,
        (true, true) => StreamLens::AMX_A_DWORDS + AMX_P_DWORDS,
    }
}

/// Most query rows per KV head the AMX `P·V` takes: its A tiles hold each row twice.
pub(crate) const AMX_PV_MAX_ROWS: usize = TILE_ROWS / 2;
/// Dwords of the P A tiles of one head: one tile per 16-key group of a key tile.
const AMX_P_DWORDS: usize = TILE_KEYS / AMX_KEYS * TILE_DWORDS;
/// Chunks of the V row per pass of the AMX `P·V`: the C tiles beside two A and two B tiles.
const AMX_PV_PASS: usize = 4;

/// Dwords of the AMX `Q·Kᵀ`'s Q B tiles for an item of `heads` KV heads and head dim `d`:
/// one tile per head and 32-element chunk.
pub(crate) fn amx_q_dwords(heads: usize, d: usize) -> usize {
    heads * d.div_ceil(AMX_CHUNK) * TILE_DWORDS
}

/// One item with its worker's scratch: the [`SimdTask`] of the streaming kernel.
pub(crate) struct StreamTask<'t, 'a, T, O, Tl = NoTiles> {
    /// The call's inputs and outputs.
    pub ctx: &'t Ctx<'a, T, O>,
    /// The item to compute.
    pub item: &'t Item,
    /// Where partial rows go.
    pub partials: Partials,
    /// The worker's scratch.
    pub scratch: &'t mut Scratch,
    /// AMX tiles for `S = Q·Kᵀ` ([`amx_applies`]); `None`: the SIMD dot products.
    pub tiles: Option<Tl>,
    /// How the SIMD dot products multiply (without tiles, bf16 inputs; ignored otherwise).
    pub qk: QkDots,
}

impl<T: Element, O: Element, Tl: Tiles> SimdTask for StreamTask<'_, '_, T, O, Tl> {
    type Output = TaskStats;

    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) -> TaskStats {
        // SAFETY: A available (caller); the context comes from `forward_with_workspace`
        // (problem validated, buffers checked); the plan made the item's keys lie within its
        // sequence and sized the partial buffers for every split's rows.
        unsafe {
            run_item::<A, T, O, Tl>(
                self.ctx,
                self.item,
                self.partials,
                self.scratch,
                self.tiles,
                self.qk,
            )
        }
    }
}

/// No tiles: the [`Tiles`] of a [`StreamTask`] that runs without AMX (uninhabited, so none of
/// its operations can run).
pub(crate) enum NoTiles {}

// SAFETY: no value exists, so no operation ever runs.
unsafe impl Tiles for NoTiles {
    const HARDWARE: bool = false;
    unsafe fn load<const T: u8>(&mut self, _src: *const u8, _stride: usize) {
        match *self {}
    }
    unsafe fn store<const T: u8>(&mut self, _dst: *mut u8, _stride: usize) {
        match *self {}
    }
    fn zero<const T: u8>(&mut self) {
        match *self {}
    }
    fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        match *self {}
    }
}

/// Whether the AMX `S = Q·Kᵀ` ([`qk_tile_amx`]) may take a problem's items: bf16 K and Q, and
/// at most [`AMX_MAX_ROWS`] query rows per KV head (one C tile's columns). `P·V` joins it
/// on the tiles where [`amx_pv_applies`], else stays on the SIMD kernels.
pub(crate) fn amx_applies(p: &Problem, inputs: DType) -> bool {
    inputs == DType::Bf16 && p.group_size().saturating_mul(p.max_seqlen_q()) <= AMX_MAX_ROWS
}

/// Where element `e` of a `2·W`-element chunk sits in register order: bf16 chunks are
/// de-interleaved (even elements in the first vector, odd in the second, see
/// [`Simd::load_bf16_pair`]); f32 and f16 keep their order.
#[inline(always)]
pub(crate) fn reg_pos<T: Element>(lanes: usize, e: usize) -> usize {
    match T::KIND {
        sealed::Kind::Bf16 => (e % 2) * lanes + e / 2,
        sealed::Kind::F32 | sealed::Kind::F16 => e,
    }
}

/// Loads the `2·W` elements at `p` as two f32 vectors in register order.
///
/// # Safety
/// S available; `2·W` readable elements at `p`.
#[inline(always)]
unsafe fn load_pair<S: Simd, T: Element>(p: *const T) -> (S::V, S::V) {
    // SAFETY: 2·W readable elements at p (caller); the casts match T's kind (bf16 and f16
    // are transparent u16s); S available (caller).
    unsafe {
        match T::KIND {
            sealed::Kind::F32 => {
                let p = p as *const f32;
                (S::load(p), S::load(p.add(S::W)))
            }
            sealed::Kind::Bf16 => S::load_bf16_pair(p as *const u16),
            sealed::Kind::F16 => {
                let p = p as *const u16;
                (S::load_f16(p), S::load_f16(p.add(S::W)))
            }
        }
    }
}

/// The last, partial chunk of `row` (elements from `from` on) zero-padded to `2·W`.
#[inline(always)]
fn tail_chunk<T: Element>(row: &[T], from: usize) -> [T; 32] {
    let mut tmp = [T::from_f32(0.0); 32];
    let rest = &row[from.min(row.len())..];
    tmp[..rest.len()].copy_from_slice(rest);
    tmp
}

/// `out[g·out_stride + u] = q_g · k_u` for `R` rows of Q (register order, `q_stride` apart,
/// zero-padded to whole chunks) and `U` key rows of `d` elements.
///
/// # Safety
/// S available, `2·W ≤ 32`; `q` readable for `R` rows of `padded(d)` floats `q_stride`
/// apart; `out` writable at `g·out_stride + u` for `g < R`, `u < U`.
#[inline(always)]
pub(crate) unsafe fn dots<S: Simd, T: Element, const R: usize, const U: usize>(
    q: *const f32,
    q_stride: usize,
    k: [&[T]; U],
    d: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let chunk = 2 * S::W;
    let full = d / chunk;
    // SAFETY: S available (caller).
    let zero = unsafe { S::splat(0.0) };
    let mut acc = [[(zero, zero); U]; R];
    let mut k_at = [std::ptr::null::<T>(); U];
    for c in 0..full {
        for u in 0..U {
            // In bounds: (c + 1)·2W ≤ d = each key row's length.
            k_at[u] = k[u][c * chunk..].as_ptr();
        }
        // SAFETY: 2·W readable elements at each k_at; the Q chunk is inside a padded row.
        unsafe { dots_step::<S, T, R, U>(&mut acc, q, q_stride, c * chunk, &k_at) };
    }
    if full * chunk < d {
        let mut tails = [[T::from_f32(0.0); 32]; U];
        for u in 0..U {
            tails[u] = tail_chunk(k[u], full * chunk);
            k_at[u] = tails[u].as_ptr();
        }
        // SAFETY: each tail holds 32 ≥ 2·W elements; the Q chunk is inside a padded row.
        unsafe { dots_step::<S, T, R, U>(&mut acc, q, q_stride, full * chunk, &k_at) };
    }
    // The pairs folded by a loop, not a closure: see dots_bf16_step on closures.
    let mut sums = [[zero; U]; R];
    for (sum_g, acc_g) in sums.iter_mut().zip(&acc) {
        for (sum, a) in sum_g.iter_mut().zip(acc_g) {
            // SAFETY: S available (caller).
            *sum = unsafe { S::add(a.0, a.1) };
        }
    }
    // SAFETY: S available; `out` as the caller's contract.
    unsafe { write_sums::<S, R, U>(&sums, out, out_stride, 1.0) };
}

/// `out[g·out_stride + u] = scale · Σ lanes of acc[g][u]`: the write-out [`dots`] and
/// [`dots_bf16`] share, eight sums at once through the architecture's shuffle tree where
/// `R·U` is eight.
///
/// # Safety
/// S available; `out` writable at `g·out_stride + u` for `g < R`, `u < U`.
#[inline(always)]
unsafe fn write_sums<S: Simd, const R: usize, const U: usize>(
    acc: &[[S::V; U]; R],
    out: *mut f32,
    out_stride: usize,
    scale: f32,
) {
    if R * U == 8 {
        // SAFETY: S available (caller).
        let mut v = [unsafe { S::splat(0.0) }; 8];
        for (i, x) in v.iter_mut().enumerate() {
            *x = acc[i / U][i % U];
        }
        // SAFETY: S available (caller).
        let sums = unsafe { S::hsum8(v) };
        for (i, &x) in sums.iter().enumerate() {
            // SAFETY: inside `out` (caller).
            unsafe { *out.add(i / U * out_stride + i % U) = x * scale };
        }
        return;
    }
    for (g, acc_g) in acc.iter().enumerate() {
        for (u, &a) in acc_g.iter().enumerate() {
            // SAFETY: inside `out` (caller); S available.
            unsafe { *out.add(g * out_stride + u) = S::hsum(a) * scale };
        }
    }
}

/// One chunk of [`dots`]: the `2·W` elements at each `k_at[u]` against each row's chunk at
/// `q + g·q_stride + at`. A function rather than a closure, so that it is inlined into the
/// architecture's trampoline with its features.
///
/// # Safety
/// S available; `2·W` readable elements at each `k_at[u]`, floats `at..at + 2·W` readable in
/// each of the `R` rows of `q`.
#[inline(always)]
unsafe fn dots_step<S: Simd, T: Element, const R: usize, const U: usize>(
    acc: &mut [[(S::V, S::V); U]; R],
    q: *const f32,
    q_stride: usize,
    at: usize,
    k_at: &[*const T; U],
) {
    // SAFETY: as the caller's contract.
    unsafe {
        let zero = S::splat(0.0);
        let mut kv = [(zero, zero); U];
        for u in 0..U {
            kv[u] = load_pair::<S, T>(k_at[u]);
        }
        for (g, acc_g) in acc.iter_mut().enumerate() {
            let qp = q.add(g * q_stride + at);
            let (qa, qb) = (S::load(qp), S::load(qp.add(S::W)));
            for (a, kv_u) in acc_g.iter_mut().zip(&kv) {
                a.0 = S::fma(qa, kv_u.0, a.0);
                a.1 = S::fma(qb, kv_u.1, a.1);
            }
        }
    }
}

/// How the SIMD decode kernel forms `S = Q·Kᵀ` for bf16 inputs (the AMX tiles aside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QkDots {
    /// Q pre-scaled in f32, K widened to f32, multiply-adds ([`dots`]).
    F32,
    /// Q and K as bf16 pairs ([`dots_bf16`], bf16 inputs only): `vdpbf16ps` when `native`
    /// (the task then runs in [`crate::dispatch::dispatch_bf16`]'s trampoline), else its
    /// emulation by two f32 multiply-adds per pair (tests, on any CPU).
    Bf16Pairs {
        /// `vdpbf16ps` itself.
        native: bool,
    },
}

/// The item's Q rows as [`qk_tile`] reads them.
#[derive(Clone, Copy)]
enum QRows<'q> {
    /// Pre-multiplied f32 rows in register order (`d_pad` floats each).
    F32(&'q [f32]),
    /// Unscaled bf16 rows (bit patterns) in natural order, zero past `d` (`d_pad` each); the
    /// sums are multiplied by `pre` ([`QkDots::Bf16Pairs`]).
    Bf16 {
        /// The rows.
        bits: &'q [u16],
        /// `vdpbf16ps` itself.
        native: bool,
        /// The score factor.
        pre: f32,
    },
}

/// `out[g·out_stride + u] = pre · (q_g · k_u)` for `R` bf16 rows of Q (natural order, bit
/// patterns, `q_stride` apart, zero-padded to whole chunks) and `U` bf16 key rows of `d`
/// elements, by [`Simd::dot_bf16_pairs`]: one instruction per chunk of `2·W` elements where
/// [`dots`] widens K and multiplies twice.
///
/// # Safety
/// S available, `2·W ≤ 32`, `T` is bf16; with `NATIVE` the CPU has AVX512-BF16; `q` readable
/// for `R` rows of `padded(d)` u16 `q_stride` apart; `out` writable at `g·out_stride + u` for
/// `g < R`, `u < U`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn dots_bf16<S: Simd, T: Element, const R: usize, const U: usize, const NATIVE: bool>(
    q: *const u16,
    q_stride: usize,
    k: [&[T]; U],
    d: usize,
    out: *mut f32,
    out_stride: usize,
    pre: f32,
) {
    debug_assert!(T::KIND == sealed::Kind::Bf16);
    let chunk = 2 * S::W;
    let full = d / chunk;
    // SAFETY: S available (caller).
    let zero = unsafe { S::splat(0.0) };
    let mut acc = [[zero; U]; R];
    let mut k_at = [std::ptr::null::<T>(); U];
    for c in 0..full {
        for u in 0..U {
            // In bounds: (c + 1)·2W ≤ d = each key row's length.
            k_at[u] = k[u][c * chunk..].as_ptr();
        }
        // SAFETY: 2·W readable elements at each k_at; the Q chunk is inside a padded row.
        unsafe { dots_bf16_step::<S, T, R, U, NATIVE>(&mut acc, q, q_stride, c * chunk, &k_at) };
    }
    if full * chunk < d {
        let mut tails = [[T::from_f32(0.0); 32]; U];
        for u in 0..U {
            tails[u] = tail_chunk(k[u], full * chunk);
            k_at[u] = tails[u].as_ptr();
        }
        // SAFETY: each tail holds 32 ≥ 2·W elements; the Q chunk is inside a padded row.
        unsafe { dots_bf16_step::<S, T, R, U, NATIVE>(&mut acc, q, q_stride, full * chunk, &k_at) };
    }
    // SAFETY: S available; `out` as the caller's contract.
    unsafe { write_sums::<S, R, U>(&acc, out, out_stride, pre) };
}

/// One chunk of [`dots_bf16`]: each key's `2·W` bf16 at `k_at[u]` as `W` dwords, against
/// each row's chunk at `q + g·q_stride + at`. A function, not a closure: a closure is not
/// compiled with the trampoline's features unless inlined, and out of line every intrinsic
/// in it became a call (the in-cache decode ran 8× slower).
///
/// # Safety
/// As [`dots_bf16`]; `2·W` readable bf16 at each `k_at[u]` and at `at` in each row of `q`.
#[inline(always)]
unsafe fn dots_bf16_step<
    S: Simd,
    T: Element,
    const R: usize,
    const U: usize,
    const NATIVE: bool,
>(
    acc: &mut [[S::V; U]; R],
    q: *const u16,
    q_stride: usize,
    at: usize,
    k_at: &[*const T; U],
) {
    // SAFETY: as the caller's contract (2·W bf16 = W f32-sized dwords per load).
    unsafe {
        let mut kv = [S::splat(0.0); U];
        for u in 0..U {
            kv[u] = S::load(k_at[u] as *const f32);
        }
        for (g, acc_g) in acc.iter_mut().enumerate() {
            let qv = S::load(q.add(g * q_stride + at) as *const f32);
            for (a, &kv_u) in acc_g.iter_mut().zip(&kv) {
                *a = S::dot_bf16_pairs::<NATIVE>(*a, qv, kv_u);
            }
        }
    }
}

/// [`dots`] or [`dots_bf16`] for rows `first..first + R` of the item's Q.
///
/// # Safety
/// As [`dots`] (or [`dots_bf16`] for bf16 rows) with `q` at row `first`.
#[inline(always)]
unsafe fn dots_of<S: Simd, T: Element, const R: usize, const U: usize>(
    q: QRows<'_>,
    first: usize,
    d_pad: usize,
    k: [&[T]; U],
    d: usize,
    out: *mut f32,
    out_stride: usize,
) {
    // SAFETY: as the caller's contract; bf16 rows exist only for bf16 inputs (`run_item`).
    unsafe {
        match q {
            QRows::F32(q) => {
                dots::<S, T, R, U>(q.as_ptr().add(first * d_pad), d_pad, k, d, out, out_stride)
            }
            QRows::Bf16 { bits, native, pre } if T::KIND == sealed::Kind::Bf16 => {
                let q = bits.as_ptr().add(first * d_pad);
                if native {
                    dots_bf16::<S, T, R, U, true>(q, d_pad, k, d, out, out_stride, pre)
                } else {
                    dots_bf16::<S, T, R, U, false>(q, d_pad, k, d, out, out_stride, pre)
                }
            }
            QRows::Bf16 { .. } => unreachable!("bf16 Q rows for non-bf16 inputs"),
        }
    }
}

/// `o_g += Σ_u p[g·p_stride + u] · v_u` for `R` accumulator rows (register order, `o_stride`
/// apart, padded to whole chunks) and `U` value rows of `dv` elements.
///
/// # Safety
/// S available, `2·W ≤ 32`; `p` readable at `g·p_stride + u`; `o` read/writable for `R` rows
/// of `padded(dv)` floats `o_stride` apart.
#[inline(always)]
pub(crate) unsafe fn pv_rows<S: Simd, T: Element, const R: usize, const U: usize>(
    p: *const f32,
    p_stride: usize,
    v: [&[T]; U],
    dv: usize,
    o: *mut f32,
    o_stride: usize,
) {
    let chunk = 2 * S::W;
    let full = dv / chunk;
    // SAFETY: S available (caller).
    let zero = unsafe { S::splat(0.0) };
    let mut probs = [[zero; U]; R];
    for (g, pg) in probs.iter_mut().enumerate() {
        for (u, pu) in pg.iter_mut().enumerate() {
            // SAFETY: `p` readable at these indices (caller); S available.
            *pu = unsafe { S::splat(*p.add(g * p_stride + u)) };
        }
    }
    let mut v_at = [std::ptr::null::<T>(); U];
    for c in 0..full {
        for u in 0..U {
            // In bounds: (c + 1)·2W ≤ dv = each value row's length.
            v_at[u] = v[u][c * chunk..].as_ptr();
        }
        // SAFETY: 2·W readable elements at each v_at; the O chunk is inside a padded row.
        unsafe { pv_step::<S, T, R, U>(&probs, &v_at, o, o_stride, c * chunk) };
    }
    if full * chunk < dv {
        let mut tails = [[T::from_f32(0.0); 32]; U];
        for u in 0..U {
            tails[u] = tail_chunk(v[u], full * chunk);
            v_at[u] = tails[u].as_ptr();
        }
        // SAFETY: each tail holds 32 ≥ 2·W elements; the O chunk is inside a padded row.
        unsafe { pv_step::<S, T, R, U>(&probs, &v_at, o, o_stride, full * chunk) };
    }
}

/// One chunk of [`pv_rows`] (a function, not a closure: see [`dots_step`]).
///
/// # Safety
/// S available; `2·W` readable elements at each `v_at[u]`; floats `at..at + 2·W` read/
/// writable in each of the `R` rows of `o`.
#[inline(always)]
unsafe fn pv_step<S: Simd, T: Element, const R: usize, const U: usize>(
    probs: &[[S::V; U]; R],
    v_at: &[*const T; U],
    o: *mut f32,
    o_stride: usize,
    at: usize,
) {
    // SAFETY: as the caller's contract.
    unsafe {
        let zero = S::splat(0.0);
        let mut vv = [(zero, zero); U];
        for u in 0..U {
            vv[u] = load_pair::<S, T>(v_at[u]);
        }
        for (g, pg) in probs.iter().enumerate() {
            let op = o.add(g * o_stride + at);
            let (mut a, mut b) = (S::load(op), S::load(op.add(S::W)));
            for (pu, vu) in pg.iter().zip(&vv) {
                a = S::fma(*pu, vu.0, a);
                b = S::fma(*pu, vu.1, b);
            }
            S::store(op, a);
            S::store(op.add(S::W), b);
        }
    }
}

/// One prefetch stream of a tile loop: the buffer, the row offsets (entry `j` is prefetched
/// at the loop's key `j`, for every head of the item), elements between heads, row length.
type PfStream<'a, T> = (&'a [T], &'a [usize], usize, usize);

/// The sizes of one item, fixed while it runs.
#[derive(Clone, Copy)]
struct Shape {
    /// Head dims of Q/K and V.
    d: usize,
    /// See `d`.
    dv: usize,
    /// Padded to whole chunks: the row strides of Q and O.
    d_pad: usize,
    /// See `d_pad`.
    dv_pad: usize,
    /// KV heads of the item.
    heads: usize,
    /// Rows per KV head.
    rph: usize,
    /// Element strides between consecutive KV heads' rows of one key in K and V.
    k_head: usize,
    /// See `k_head`.
    v_head: usize,
}

/// `S = Q·Kᵀ` for the tile's `nk` keys (row offsets `k_offs`, for the item's first head) into
/// `s` (row `r` of the item at `r·TILE_KEYS`).
///
/// # Safety
/// S available; `q` holds the item's rows (`rows·d_pad`), `s` `rows·TILE_KEYS`; the offsets
/// are rows of the checked K buffer.
#[inline(always)]
unsafe fn qk_tile<S: Simd, T: Element>(
    k: &[T],
    k_offs: &[usize],
    sh: &Shape,
    q: QRows<'_>,
    s: &mut [f32],
    prefetch: [PfStream<'_, T>; 2],
) {
    let Shape {
        d,
        d_pad,
        heads,
        rph,
        k_head,
        ..
    } = *sh;
    let nk = k_offs.len();
    let sp = s.as_mut_ptr();
    let mut j = 0;
    while j < nk {
        let u = (nk - j).min(QK_KEYS);
        for h in 0..heads {
            for &(pf_src, pf_offs, pf_head, pf_len) in &prefetch {
                for &off in pf_offs.iter().skip(j).take(u) {
                    prefetch_row::<S, T>(pf_src, off + h * pf_head, pf_len);
                }
            }
            // Bounds-checked once per row: the kernels load inside these slices.
            let row = |jj: usize| {
                let at = k_offs[jj] + h * k_head;
                &k[at..at + d]
            };
            let mut rb = 0;
            while rb < rph {
                let r = (rph - rb).min(ROW_BLOCK);
                let first = h * rph + rb;
                // SAFETY: rows first..first + r of q (d_pad each) and of s (TILE_KEYS each,
                // keys j..j + u < TILE_KEYS); S available (caller).
                unsafe {
                    let s0 = sp.add(first * TILE_KEYS + j);
                    let (st, f) = (TILE_KEYS, first);
                    match (r, u) {
                        (4, 2) => {
                            dots_of::<S, T, 4, 2>(q, f, d_pad, [row(j), row(j + 1)], d, s0, st)
                        }
                        (3, 2) => {
                            dots_of::<S, T, 3, 2>(q, f, d_pad, [row(j), row(j + 1)], d, s0, st)
                        }
                        (2, 2) => {
                            dots_of::<S, T, 2, 2>(q, f, d_pad, [row(j), row(j + 1)], d, s0, st)
                        }
                        (1, 2) => {
                            dots_of::<S, T, 1, 2>(q, f, d_pad, [row(j), row(j + 1)], d, s0, st)
                        }
                        (4, _) => dots_of::<S, T, 4, 1>(q, f, d_pad, [row(j)], d, s0, st),
                        (3, _) => dots_of::<S, T, 3, 1>(q, f, d_pad, [row(j)], d, s0, st),
                        (2, _) => dots_of::<S, T, 2, 1>(q, f, d_pad, [row(j)], d, s0, st),
                        _ => dots_of::<S, T, 1, 1>(q, f, d_pad, [row(j)], d, s0, st),
                    }
                }
                rb += r;
            }
        }
        j += u;
    }
}

/// The buffers of [`qk_tile_amx`]: the item's Q B tiles, one A tile of gathered K rows, the
/// C tile and its transpose, and the score factor.
struct AmxBufs<'b> {
    /// Q rows as B tiles (see `run_item`).
    qb: &'b [u32],
    /// K rows gathered into one A tile (when they cannot be loaded in place).
    a_rows: &'b mut [u32],
    /// The C tile (16 keys × 16 rows of f32) and, after it, its transpose.
    c_buf: &'b mut [f32],
    /// The factor of the scores (`scale·log2 e`, or `scale/cap` under a softcap).
    pre: f32,
}

/// `S = Q·Kᵀ` for the tile's `nk` keys on AMX tiles (bf16 K, Q as B tiles): per head and
/// group of 16 keys, the K rows are the A tile (loaded in place when the 16 rows lie one
/// stride apart and the chunk is whole, else gathered with zero padding), one `tdpbf16ps`
/// per 32-element chunk of the head dim into C (16 keys × the head's rows), then C is
/// transposed and scaled into `s`. Tiles: C in 0 or 1, A in 2 or 3, B in 4..8 (kept per head
/// when the head dim has at most four chunks, else loaded per chunk into 4).
///
/// # Safety
/// S available; `T` is bf16; `bufs.qb` holds the item's B tiles, `bufs.a_rows` one tile,
/// `bufs.c_buf` two; `s` holds `rows·TILE_KEYS`; the offsets are rows of the checked K buffer.
#[inline(always)]
unsafe fn qk_tile_amx<S: Simd, T: Element, Tl: Tiles>(
    tiles: &mut Tl,
    k: &[T],
    k_offs: &[usize],
    sh: &Shape,
    bufs: AmxBufs<'_>,
    s: &mut [f32],
    prefetch: [PfStream<'_, T>; 2],
) {
    let Shape {
        d,
        heads,
        rph,
        k_head,
        ..
    } = *sh;
    let AmxBufs {
        qb,
        a_rows,
        c_buf,
        pre,
    } = bufs;
    let nk = k_offs.len();
    let chunks = d.div_ceil(AMX_CHUNK);
    let resident = chunks <= 4;
    let esize = std::mem::size_of::<T>();
    let (c_tile, c_t) = c_buf.split_at_mut(TILE_DWORDS);
    for h in 0..heads {
        let b_tile = |c: usize| qb[(h * chunks + c) * TILE_DWORDS..][..TILE_DWORDS].as_ptr();
        if resident {
            for c in 0..chunks {
                // SAFETY: each B tile is TILE_DWORDS dwords (16 rows of 64 bytes) of qb.
                unsafe {
                    let src = b_tile(c) as *const u8;
                    match c {
                        0 => tiles.load::<4>(src, TILE_ROW_BYTES),
                        1 => tiles.load::<5>(src, TILE_ROW_BYTES),
                        2 => tiles.load::<6>(src, TILE_ROW_BYTES),
                        _ => tiles.load::<7>(src, TILE_ROW_BYTES),
                    }
                }
            }
        }
        let mut j = 0;
        while j < nk {
            let u_n = (nk - j).min(AMX_KEYS);
            for &(pf_src, pf_offs, pf_head, pf_len) in &prefetch {
                for &off in pf_offs.iter().skip(j).take(u_n) {
                    prefetch_row::<S, T>(pf_src, off + h * pf_head, pf_len);
                }
            }
            // Bounds-checked once per row: the tile loads read inside these rows.
            let row = |u: usize| {
                let at = k_offs[j + u] + h * k_head;
                &k[at..at + d]
            };
            // In place when 16 rows lie one positive stride apart.
            let stride = group_stride(&k_offs[j..j + u_n]);
            let first = row(0).as_ptr();
            if stride.is_some() {
                // The last row is checked too: every row between lies in the buffer.
                let _ = row(AMX_KEYS - 1);
            }
            // C alternates between tiles 0 and 1 from group to group, A between 2 and 3 from
            // chunk to chunk, so that a tile load need not wait for the product before it.
            let odd = (j / AMX_KEYS) % 2 == 1;
            if odd {
                tiles.zero::<1>();
            } else {
                tiles.zero::<0>();
            }
            for c in 0..chunks {
                let lo = c * AMX_CHUNK;
                let whole = lo + AMX_CHUNK <= d;
                let (a_src, a_stride) = match stride {
                    // Element lo of the first row (inside it: the chunk is whole).
                    Some(st) if whole => (first.wrapping_add(lo) as *const u8, st * esize),
                    _ => gather_chunk(a_rows, u_n, row, lo),
                };
                // SAFETY: the A source is 16 rows of 64 readable bytes a_stride apart (whole
                // chunks of 16 rows checked above, or the gathered tile); the B tiles are
                // inside qb.
                unsafe {
                    amx_step(tiles, odd, c, resident, a_src, a_stride, b_tile(c));
                }
            }
            // C[u][n] = row n's score of key j + u: transposed, scaled, into s.
            // SAFETY: c_tile and c_t are 16 × 16 floats each (a strip's columns and rows
            // n0..n0 + 4 ≤ 16: rph ≤ 12 there); the rows of s written are the
            // head's (h·rph + n < rows), keys j..j + 16 ≤ TILE_KEYS; S available (caller).
            unsafe {
                let c_dst = c_tile.as_mut_ptr() as *mut u8;
                if odd {
                    tiles.store::<1>(c_dst, TILE_ROW_BYTES);
                } else {
                    tiles.store::<0>(c_dst, TILE_ROW_BYTES);
                }
                if S::W == TILE_ROWS {
                    // Only the head's rph columns: strips of 4 (rows of c_t past rph are
                    // scratch), the whole block's transpose where more than 12 are used.
                    if rph <= 3 * TILE_ROWS / 4 {
                        for n0 in (0..rph).step_by(4) {
                            S::transpose_w4(
                                c_tile.as_ptr().add(n0),
                                TILE_ROWS,
                                c_t.as_mut_ptr().add(n0 * TILE_ROWS),
                                TILE_ROWS,
                            );
                        }
                    } else {
                        S::transpose(c_tile.as_ptr(), TILE_ROWS, c_t.as_mut_ptr(), TILE_ROWS);
                    }
                } else {
                    for u in 0..TILE_ROWS {
                        for n in 0..TILE_ROWS {
                            c_t[n * TILE_ROWS + u] = c_tile[u * TILE_ROWS + n];
                        }
                    }
                }
                let f = S::splat(pre);
                for n in 0..rph {
                    let dst = s[(h * rph + n) * TILE_KEYS + j..][..AMX_KEYS].as_mut_ptr();
                    let src = c_t[n * TILE_ROWS..][..TILE_ROWS].as_ptr();
                    for v in 0..AMX_KEYS / S::W {
                        S::store(dst.add(v * S::W), S::mul(S::load(src.add(v * S::W)), f));
                    }
                }
            }
            j += u_n;
        }
    }
}

/// The stride of a group of row offsets when it is [`AMX_KEYS`] rows one positive stride apart
/// (so that one tile load reads them in place), else `None`.
#[inline(always)]
fn group_stride(offs: &[usize]) -> Option<usize> {
    if offs.len() != AMX_KEYS || offs[1] <= offs[0] {
        return None;
    }
    let st = offs[1] - offs[0];
    (2..AMX_KEYS)
        .all(|u| offs[u] == offs[0] + u * st)
        .then_some(st)
}

/// Gathers elements `lo..lo + 32` (those that exist) of rows `row(0..n)`, `n ≤ 16`, into the
/// rows of one zeroed tile; returns the tile's address and row stride for a tile load.
#[inline(always)]
fn gather_chunk<'r, T: Element + 'r>(
    tile: &mut [u32],
    n: usize,
    row: impl Fn(usize) -> &'r [T],
    lo: usize,
) -> (*const u8, usize) {
    let tile = &mut tile[..TILE_DWORDS];
    tile.fill(0);
    for u in 0..n.min(TILE_ROWS) {
        let r = row(u);
        let src = &r[lo..r.len().min(lo + AMX_CHUNK)];
        // SAFETY: src.len() ≤ 32 bf16 = 64 bytes, tile row u (< 16) of the TILE_DWORDS
        // dwords; bf16 is a transparent u16 (the only T of the tile paths).
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr() as *const u8,
                (tile.as_mut_ptr() as *mut u8).add(u * TILE_ROW_BYTES),
                std::mem::size_of_val(src).min(TILE_ROW_BYTES),
            )
        };
    }
    (tile.as_ptr() as *const u8, TILE_ROW_BYTES)
}

/// One chunk of [`qk_tile_amx`]: A ← 16 rows at `a_src` (`a_stride` bytes apart), then
/// `C += A·B` with chunk `c`'s B tile (resident in tile 4 + c, else loaded from `b_src`).
/// C is tile 1 when `odd`, else 0; A is tile 3 for odd chunks, else 2.
///
/// # Safety
/// As [`Tiles::load`] for `a_src` (and `b_src` when not resident); when `resident`, `c < 4`
/// and tile 4 + c holds chunk c's B tile.
#[inline(always)]
unsafe fn amx_step<Tl: Tiles>(
    tiles: &mut Tl,
    odd: bool,
    c: usize,
    resident: bool,
    a_src: *const u8,
    a_stride: usize,
    b_src: *const u32,
) {
    // SAFETY: the caller's contract.
    unsafe {
        if !resident {
            tiles.load::<4>(b_src as *const u8, TILE_ROW_BYTES);
        }
        let b = if resident { c } else { 0 };
        macro_rules! dot {
            ($c:literal, $a:literal) => {
                match b {
                    0 => tiles.dot::<$c, $a, 4>(),
                    1 => tiles.dot::<$c, $a, 5>(),
                    2 => tiles.dot::<$c, $a, 6>(),
                    _ => tiles.dot::<$c, $a, 7>(),
                }
            };
        }
        match (odd, c % 2 == 1) {
            (false, false) => {
                tiles.load::<2>(a_src, a_stride);
                dot!(0, 2)
            }
            (false, true) => {
                tiles.load::<3>(a_src, a_stride);
                dot!(0, 3)
            }
            (true, false) => {
                tiles.load::<2>(a_src, a_stride);
                dot!(1, 2)
            }
            (true, true) => {
                tiles.load::<3>(a_src, a_stride);
                dot!(1, 3)
            }
        }
    }
}

/// `O += P·V` for the tile's `nk` keys (row offsets `v_offs`, for the item's first head),
/// probabilities in `s`.
///
/// # Safety
/// S available; `s` holds `rows·TILE_KEYS`, `o` `rows·dv_pad`; the offsets are rows of the
/// checked V buffer.
#[inline(always)]
unsafe fn pv_tile<S: Simd, T: Element>(
    v: &[T],
    v_offs: &[usize],
    sh: &Shape,
    s: &[f32],
    o: &mut [f32],
    prefetch: [PfStream<'_, T>; 2],
) {
    let Shape {
        dv,
        dv_pad,
        heads,
        rph,
        v_head,
        ..
    } = *sh;
    let nk = v_offs.len();
    let (sp, op) = (s.as_ptr(), o.as_mut_ptr());
    let mut j = 0;
    while j < nk {
        let u = if nk - j >= PV_KEYS { PV_KEYS } else { 1 };
        for h in 0..heads {
            for &(pf_src, pf_offs, pf_head, pf_len) in &prefetch {
                for &off in pf_offs.iter().skip(j).take(u) {
                    prefetch_row::<S, T>(pf_src, off + h * pf_head, pf_len);
                }
            }
            let row = |jj: usize| {
                let at = v_offs[jj] + h * v_head;
                &v[at..at + dv]
            };
            let mut rb = 0;
            while rb < rph {
                let r = (rph - rb).min(ROW_BLOCK);
                let first = h * rph + rb;
                // SAFETY: rows first..first + r of s (TILE_KEYS each, keys j..j + u) and of o
                // (dv_pad each); S available (caller).
                unsafe {
                    let (p0, o0) = (sp.add(first * TILE_KEYS + j), op.add(first * dv_pad));
                    let st = TILE_KEYS;
                    if u == PV_KEYS {
                        let rows = [row(j), row(j + 1), row(j + 2), row(j + 3)];
                        match r {
                            4 => pv_rows::<S, T, 4, 4>(p0, st, rows, dv, o0, dv_pad),
                            3 => pv_rows::<S, T, 3, 4>(p0, st, rows, dv, o0, dv_pad),
                            2 => pv_rows::<S, T, 2, 4>(p0, st, rows, dv, o0, dv_pad),
                            _ => pv_rows::<S, T, 1, 4>(p0, st, rows, dv, o0, dv_pad),
                        }
                    } else {
                        let rows = [row(j)];
                        match r {
                            4 => pv_rows::<S, T, 4, 1>(p0, st, rows, dv, o0, dv_pad),
                            3 => pv_rows::<S, T, 3, 1>(p0, st, rows, dv, o0, dv_pad),
                            2 => pv_rows::<S, T, 2, 1>(p0, st, rows, dv, o0, dv_pad),
                            _ => pv_rows::<S, T, 1, 1>(p0, st, rows, dv, o0, dv_pad),
                        }
                    }
                }
                rb += r;
            }
        }
        j += u;
    }
}

/// `O += P·V` for the tile's `nk` keys on AMX tiles (bf16 V, 16 lanes), probabilities in `s`,
/// with V's rows loaded **in place** as B tiles (no repacking). A B tile of 16 keys' V rows
/// pairs each key's elements `2i` and `2i + 1`, which a VNNI product would sum; so each
/// probability stands in an A tile twice, once against the even element of the pair (row m:
/// `bf16(P) | 0`) and once against the odd (row `rph + m`: `0 | bf16(P) << 16`): C row m
/// gathers O row m's even elements of the 32-element chunk, row `rph + m` its odd ones,
/// which is the chunk in register order ([`reg_pos`]). Half of each product's K depth
/// multiplies zeros, which the tiles can afford: they replace the SIMD kernel's 40 vector
/// operations per key and head (32/8 heads): 5–16 % less time in cache on the Xeon, a few
/// per cent from DRAM (see [`DecodeOptions::amx_pv`]). (A `vdpbf16ps` `P·V` with two keys' V rows
/// interleaved halves the FMA count but runs slower: the instruction issues once per two
/// cycles where an FMA issues twice per cycle; docs/history/gpu-notes.md, 2026-12-04.)
///
/// Per head: the 16-key groups' A tiles built in `pa`, then in passes of up to
/// [`AMX_PV_PASS`] chunks of the V row: C tiles zeroed, per group its A tile and per chunk
/// the V rows' B tile (in place when the group's 16 rows lie one stride apart and the chunk
/// is whole, else gathered into `gather` with zero padding), one `tdpbf16ps` each; then each
/// C tile through `c_buf` added into O's rows (already rescaled by the softmax). Tiles: C in
/// 0..4, A in 4 and 5, B in 6 and 7 (alternating), so that four products are in flight.
///
/// # Safety
/// S available with 16 lanes; `T` is bf16; `sh.rph ≤` [`AMX_PV_MAX_ROWS`]; `s` holds
/// `rows·TILE_KEYS`, `o` `rows·dv_pad`; `pa` holds [`AMX_P_DWORDS`] dwords, zero past each
/// group's `2·rph` rows; `gather` and `c_buf` one tile each; the offsets are rows of the
/// checked V buffer.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_tile_amx<S: Simd, T: Element, Tl: Tiles>(
    tiles: &mut Tl,
    v: &[T],
    v_offs: &[usize],
    sh: &Shape,
    s: &mut [f32],
    o: &mut [f32],
    bufs: PvBufs<'_>,
    prefetch: [PfStream<'_, T>; 2],
) {
    let (dv, dv_pad, rph, v_head) = (sh.dv, sh.dv_pad, sh.rph, sh.v_head);
    let PvBufs { pa, gather, c_buf } = bufs;
    let nk = v_offs.len();
    let groups = nk.div_ceil(AMX_KEYS);
    let chunks = dv.div_ceil(AMX_CHUNK);
    let esize = std::mem::size_of::<T>();
    for h in 0..sh.heads {
        // The P A tiles, from the probabilities of keys 16g..16g + 16 of each of the head's
        // rows (zero past nk).
        // SAFETY: 16 floats at each load (a sliced group of the row) and 16 dwords at each
        // store (a sliced row of the group's tile; rph + m < 16: rph ≤ 8); S available with
        // 16 lanes (caller).
        unsafe {
            let zero = S::splat(0.0);
            for m in 0..rph {
                let row = &mut s[(h * rph + m) * TILE_KEYS..][..TILE_KEYS];
                row[nk..groups * AMX_KEYS].fill(0.0);
                for g in 0..groups {
                    let p = S::load(row[g * AMX_KEYS..][..AMX_KEYS].as_ptr());
                    let tile = &mut pa[g * TILE_DWORDS..][..TILE_DWORDS];
                    let even = tile[m * TILE_ROWS..][..TILE_ROWS].as_mut_ptr();
                    let odd = tile[(rph + m) * TILE_ROWS..][..TILE_ROWS].as_mut_ptr();
                    if Tl::HARDWARE {
                        S::bf16_pairs_v::<true>(p, zero, even);
                        S::bf16_pairs_v::<true>(zero, p, odd);
                    } else {
                        S::bf16_pairs_v::<false>(p, zero, even);
                        S::bf16_pairs_v::<false>(zero, p, odd);
                    }
                }
            }
        }
        // Per group: its first row and, when its 16 rows lie one positive stride apart,
        // that stride (elements).
        let row = |key: usize| {
            let at = v_offs[key] + h * v_head;
            &v[at..at + dv]
        };
        let in_place = |g: usize| -> Option<(*const T, usize)> {
            let j = g * AMX_KEYS;
            let st = group_stride(&v_offs[j..nk.min(j + AMX_KEYS)])?;
            // The last row is checked too: every row between lies in the buffer.
            let _ = row(j + AMX_KEYS - 1);
            Some((row(j).as_ptr(), st))
        };
        for pass in (0..chunks).step_by(AMX_PV_PASS) {
            let n_c = AMX_PV_PASS.min(chunks - pass);
            for ci in 0..n_c {
                pv_c_zero(tiles, ci);
            }
            for g in 0..groups {
                if pass == 0 {
                    for &(pf_src, pf_offs, pf_head, pf_len) in &prefetch {
                        for &off in pf_offs.iter().skip(g * AMX_KEYS).take(AMX_KEYS) {
                            prefetch_row::<S, T>(pf_src, off + h * pf_head, pf_len);
                        }
                    }
                }
                let a_src = pa[g * TILE_DWORDS..][..TILE_DWORDS].as_ptr() as *const u8;
                let placed = in_place(g);
                for ci in 0..n_c {
                    let lo = (pass + ci) * AMX_CHUNK;
                    let (b_src, b_stride) = match placed {
                        Some((first, st)) if lo + AMX_CHUNK <= dv => {
                            (first.wrapping_add(lo) as *const u8, st * esize)
                        }
                        _ => {
                            let n = AMX_KEYS.min(nk - g * AMX_KEYS);
                            gather_chunk(gather, n, |u| row(g * AMX_KEYS + u), lo)
                        }
                    };
                    // SAFETY: the A tile is TILE_DWORDS dwords of pa; the B source is 16 rows
                    // of 64 readable bytes b_stride apart (a whole chunk of 16 rows checked
                    // by `in_place`, or the gathered tile).
                    unsafe { pv_amx_step(tiles, ci, g % 2 == 1, ci == 0, a_src, b_src, b_stride) };
                }
            }
            for ci in 0..n_c {
                let lo = (pass + ci) * AMX_CHUNK;
                // SAFETY: c_buf is one tile (16 rows of 64 bytes); C rows m and rph + m
                // (< 16) are O row h·rph + m's chunk lo..lo + 32 (≤ dv_pad, a multiple of
                // 32 at 16 lanes) in register order; S available with 16 lanes (caller).
                unsafe {
                    pv_c_store(tiles, ci, c_buf.as_mut_ptr() as *mut u8);
                    let cb = c_buf.as_ptr();
                    for m in 0..rph {
                        let dst = o[(h * rph + m) * dv_pad + lo..][..AMX_CHUNK].as_mut_ptr();
                        let (even, odd) = (cb.add(m * TILE_ROWS), cb.add((rph + m) * TILE_ROWS));
                        S::store(dst, S::add(S::load(dst), S::load(even)));
                        let dst = dst.add(TILE_ROWS);
                        S::store(dst, S::add(S::load(dst), S::load(odd)));
                    }
                }
            }
        }
    }
}

/// The buffers of [`pv_tile_amx`].
struct PvBufs<'b> {
    /// The key groups' P A tiles ([`AMX_P_DWORDS`]).
    pa: &'b mut [u32],
    /// One B tile of V rows gathered with zero padding (when they cannot be loaded in place).
    gather: &'b mut [u32],
    /// One C tile on its way into O.
    c_buf: &'b mut [f32],
}

/// Zeroes [`pv_tile_amx`]'s C tile `ci` (tile `ci`, `ci < 4`).
#[inline(always)]
fn pv_c_zero<Tl: Tiles>(tiles: &mut Tl, ci: usize) {
    match ci {
        0 => tiles.zero::<0>(),
        1 => tiles.zero::<1>(),
        2 => tiles.zero::<2>(),
        _ => tiles.zero::<3>(),
    }
}

/// Stores [`pv_tile_amx`]'s C tile `ci` (16 rows of 64 bytes) at `dst`.
///
/// # Safety
/// As [`Tiles::store`] for 16 rows of 64 bytes at `dst`.
#[inline(always)]
unsafe fn pv_c_store<Tl: Tiles>(tiles: &mut Tl, ci: usize, dst: *mut u8) {
    // SAFETY: the caller's contract.
    unsafe {
        match ci {
            0 => tiles.store::<0>(dst, TILE_ROW_BYTES),
            1 => tiles.store::<1>(dst, TILE_ROW_BYTES),
            2 => tiles.store::<2>(dst, TILE_ROW_BYTES),
            _ => tiles.store::<3>(dst, TILE_ROW_BYTES),
        }
    }
}

/// One product of [`pv_tile_amx`]: A ← the group's P tile at `a_src` when `load_a` (tile 5
/// for odd groups, else 4), B ← 16 V rows at `b_src` (`b_stride` bytes apart; tile 7 for odd
/// `ci`, else 6), then C tile `ci` += A·B.
///
/// # Safety
/// As [`Tiles::load`] for `a_src` (64-byte rows, packed) and `b_src`; `ci < 4`.
#[inline(always)]
unsafe fn pv_amx_step<Tl: Tiles>(
    tiles: &mut Tl,
    ci: usize,
    odd_group: bool,
    load_a: bool,
    a_src: *const u8,
    b_src: *const u8,
    b_stride: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        if load_a {
            if odd_group {
                tiles.load::<5>(a_src, TILE_ROW_BYTES);
            } else {
                tiles.load::<4>(a_src, TILE_ROW_BYTES);
            }
        }
        if ci % 2 == 1 {
            tiles.load::<7>(b_src, b_stride);
        } else {
            tiles.load::<6>(b_src, b_stride);
        }
        macro_rules! dot {
            ($a:literal, $b:literal) => {
                match ci {
                    0 => tiles.dot::<0, $a, $b>(),
                    1 => tiles.dot::<1, $a, $b>(),
                    2 => tiles.dot::<2, $a, $b>(),
                    _ => tiles.dot::<3, $a, $b>(),
                }
            };
        }
        match (odd_group, ci % 2 == 1) {
            (false, false) => dot!(4, 6),
            (false, true) => dot!(4, 7),
            (true, false) => dot!(5, 6),
            (true, true) => dot!(5, 7),
        }
    }
}

/// `exp2(x − offset)` in place over `row` (a multiple of W long); returns the sum.
///
/// # Safety
/// S available.
#[inline(always)]
unsafe fn exp2_row<S: Simd, const CUBIC: bool>(row: &mut [f32], offset: f32) -> f32 {
    // SAFETY: every load/store covers one W-chunk of `row`; S available (caller).
    unsafe {
        let off = S::splat(offset);
        let mut sum = S::splat(0.0);
        for x in row.chunks_exact_mut(S::W) {
            let y = S::sub(S::load(x.as_ptr()), off);
            let e = if CUBIC {
                exp2_cubic::<S>(y)
            } else {
                exp2_exact::<S>(y)
            };
            S::store(x.as_mut_ptr(), e);
            sum = S::add(sum, e);
        }
        S::hsum(sum)
    }
}

/// The online-softmax step of one row's tile scores `row` (`nk` keys, then padding to a
/// multiple of W): softcap, keys outside `visible` (tile-relative) to −∞, block maximum,
/// [`RowState::begin_block`], `exp2` in place, [`RowState::add_sum`]. Returns the
/// accumulator correction.
///
/// # Safety
/// S available; `row.len()` a multiple of W, `visible.end ≤ row.len()`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn softmax_row<S: Simd>(
    row: &mut [f32],
    visible: Range<usize>,
    post: Option<f32>,
    state: &mut RowState<f32>,
    policy: &RescalePolicy<f32>,
    stats: &mut RescaleStats,
    imp: Exp2Impl,
) -> f32 {
    // SAFETY: `row` is whole W-chunks (caller); S available (caller).
    unsafe {
        if let Some(post) = post {
            // Before the mask: tanh(−∞) would be finite.
            softcap_slice::<S>(row.as_mut_ptr(), row.len(), post);
        }
        row[..visible.start].fill(f32::NEG_INFINITY);
        row[visible.end..].fill(f32::NEG_INFINITY);
        let mut m = S::splat(f32::NEG_INFINITY);
        for x in row.chunks_exact(S::W) {
            // A NaN score never wins (max's rule), as in the tiled forward.
            m = S::max(S::load(x.as_ptr()), m);
        }
        let step = state.begin_block(S::hmax(m), policy, stats);
        // The decode keeps `Auto` exact (it is bound by memory, not by the exponentials).
        let sum = if imp.cubic(false) {
            exp2_row::<S, true>(row, step.offset)
        } else {
            exp2_row::<S, false>(row, step.offset)
        };
        state.add_sum(sum);
        step.correction
    }
}

/// Runs one item: Q rows in, each key tile through `Q·Kᵀ`, the online softmax and `P·V`,
/// then the rows out (O and the LSE, or partial rows).
///
/// # Safety
/// S available; the context's problem validated and buffers checked; the item from
/// [`plan`] for this problem (keys within its sequence, partial rows inside `partials`).
#[inline(always)]
unsafe fn run_item<S: Simd, T: Element, O: Element, Tl: Tiles>(
    ctx: &Ctx<'_, T, O>,
    item: &Item,
    partials: Partials,
    scratch: &mut Scratch,
    tiles: Option<Tl>,
    qk: QkDots,
) -> TaskStats {
    let p = ctx.problem;
    let (w, b) = (S::W, item.batch);
    const { assert!(2 * S::W <= 32) };
    let seq = p.seq(b);
    let (sq, sk) = (seq.seqlen_q, seq.seqlen_k);
    let group = p.group_size();
    let [_, ks, vs, _] = p.strides();
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let sh = Shape {
        d,
        dv,
        d_pad: padded(d, w),
        dv_pad: padded(dv, w),
        heads: item.heads.len(),
        rph: group * sq,
        k_head: ks.head,
        v_head: vs.head,
    };
    let rows = sh.heads * sh.rph;
    let h0 = item.heads.start;
    let at_row = |r: usize| row_of(h0 + r / sh.rph, group, sq, r % sh.rph);
    let Scratch {
        qt,
        ot,
        st,
        kt,
        row,
        states,
        kv_offsets,
        amx_q,
        amx_pairs,
        ..
    } = scratch;
    // The AMX `Q·Kᵀ`: bf16 Q rows as B tiles (one per head and 32-element chunk of the head
    // dim), one A tile's worth of gathered K rows, the C tile and its transpose.
    let mut tiles = tiles.filter(|_| T::KIND == sealed::Kind::Bf16 && sh.rph <= AMX_MAX_ROWS);
    let chunks = d.div_ceil(AMX_CHUNK);
    let amx_len = |on: bool, n: usize| if on { n } else { 0 };
    // Reserved by `Scratch::try_reserve_stream` (`StreamLens`): no allocation here.
    // The tile operands start on cache lines: a 64-byte tile row that straddles two lines
    // costs every `tileloadd` twice the lines.
    let qb = ensure_on_line(amx_q, amx_len(tiles.is_some(), amx_q_dwords(sh.heads, d)));
    // The AMX `P·V` (`pv_tile_amx`): each head's O rows padded to a C tile's 16 rows.
    let amx_pv = tiles.is_some()
        && sh.rph <= AMX_PV_MAX_ROWS
        && amx_pv_applies(O::DTYPE, w, ctx.decode.amx_pv);
    let pair_dwords = amx_pair_dwords(tiles.is_some(), amx_pv);
    let (a_rows, pa) = ensure_on_line(amx_pairs, pair_dwords)
        .split_at_mut(pair_dwords.min(StreamLens::AMX_A_DWORDS));
    let c_buf = ensure_aligned(kt, amx_len(tiles.is_some(), StreamLens::AMX_C_FLOATS));
    let q = ensure_aligned(qt, rows * sh.d_pad);
    let o = ensure_aligned(ot, rows * sh.dv_pad);
    let s = ensure_aligned(st, rows * TILE_KEYS);
    let nat = ensure_aligned(row, d.max(dv));
    let states = ensure(states, rows, RowState::new());
    // K and V offsets of this tile's keys and the next's: [K | V] × [this | next].
    let offsets = ensure(kv_offsets, 4 * TILE_KEYS, 0);
    let (k_offs, v_offs) = offsets.split_at_mut(2 * TILE_KEYS);
    o.fill(0.0);
    // The P A tiles' rows past the head's 2·rph stay zero (their C rows are not read).
    pa.fill(0);
    states.fill(RowState::new());

    let kv = KvRows::new(p, b, h0);
    let pf = ctx.decode.prefetch;
    let ahead = pf.ahead();
    let end = item.keys.end.min(sk);
    // The item's first K rows (the first tile's under `Phase`, the first `ahead` keys' under
    // `Ahead`) start on their way while the Q rows are loaded.
    let first = match (pf.phase() || pf.next(), ahead) {
        (true, _) => TILE_KEYS,
        (false, n) => n,
    }
    .min(end.saturating_sub(item.keys.start));
    if first > 0 {
        kv.offsets(item.keys.start, &mut k_offs[..first], &mut v_offs[..first]);
        for &off in &k_offs[..first] {
            for h in 0..sh.heads {
                prefetch_row::<S, T>(ctx.k, off + h * sh.k_head, d);
            }
        }
    }

    // Q rows, pre-multiplied (scale·log2 e, or scale/cap), in register order, zero-padded.
    let transform = p.score_transform::<f32>();
    let (pre, post) = (transform.pre_factor(), transform.softcap_post_factor());
    let chunk = 2 * w;
    if tiles.is_some() {
        // B tile (head h, chunk c) at (h·chunks + c)·TILE_DWORDS: dword k·16 + n holds row
        // n's elements 32c + 2k and 32c + 2k + 1 (the VNNI pairs), unscaled (bf16 × bf16 is
        // exact in f32; the scores are scaled after the product); zero past the rows and d.
        if S::W == TILE_ROWS && d % AMX_CHUNK == 0 {
            // Whole chunks at 16 lanes: a chunk of a bf16 row is the tile's 16 pairs as
            // dwords in memory order: row n of a 16 × 16 dword block per (head, chunk), rows
            // past the head's zero, then transposed into the B tile (float shuffles move the
            // bits unchanged).
            let stage = &mut c_buf[..TILE_DWORDS];
            for h in 0..sh.heads {
                for c in 0..chunks {
                    stage.fill(0.0);
                    for n in 0..sh.rph {
                        let (head, i) = at_row(h * sh.rph + n);
                        let src = &ctx.q[p.q_offset(b, i, head) + c * AMX_CHUNK..][..AMX_CHUNK];
                        // SAFETY: src is AMX_CHUNK bf16 = 64 bytes, row n (< 16) of stage is
                        // TILE_ROWS dwords = 64 bytes; T is bf16 (`tiles` is None otherwise).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                src.as_ptr() as *const u8,
                                stage.as_mut_ptr().add(n * TILE_ROWS) as *mut u8,
                                TILE_ROW_BYTES,
                            )
                        };
                    }
                    let dst = &mut qb[(h * chunks + c) * TILE_DWORDS..][..TILE_DWORDS];
                    // SAFETY: W = 16: a 16 × 16 block at both (TILE_DWORDS each); S available.
                    unsafe {
                        S::transpose(
                            stage.as_ptr(),
                            TILE_ROWS,
                            dst.as_mut_ptr() as *mut f32,
                            TILE_ROWS,
                        )
                    };
                }
            }
        } else {
            // Pair by pair.
            qb.fill(0);
            for r in 0..rows {
                let (head, i) = at_row(r);
                let (h, n) = (r / sh.rph, r % sh.rph);
                let src = &ctx.q[p.q_offset(b, i, head)..][..d];
                // SAFETY: T is bf16 (`tiles` is None otherwise), a transparent u16.
                let bits = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u16, d) };
                for (e2, pair) in bits.chunks(2).enumerate() {
                    let hi = pair.get(1).map_or(0, |&x| u32::from(x) << 16);
                    let (c, k) = (2 * e2 / AMX_CHUNK, e2 % (AMX_CHUNK / 2));
                    qb[(h * chunks + c) * TILE_DWORDS + k * TILE_ROWS + n] =
                        u32::from(pair[0]) | hi;
                }
            }
        }
    }
    // The bf16 pair products (`QkDots::Bf16Pairs`): Q rows as they are, bit patterns in
    // natural order, unscaled (the sums are scaled), zero past d.
    let pair_dots = match qk {
        QkDots::Bf16Pairs { native } if tiles.is_none() && T::KIND == sealed::Kind::Bf16 => {
            Some(native)
        }
        _ => None,
    };
    if pair_dots.is_some() {
        // SAFETY: `q` holds rows·d_pad floats, room for as many u16 (half its bytes); u16
        // needs less alignment than f32.
        let bits =
            unsafe { std::slice::from_raw_parts_mut(q.as_mut_ptr() as *mut u16, rows * sh.d_pad) };
        bits.fill(0);
        for r in 0..rows {
            let (head, i) = at_row(r);
            let src = &ctx.q[p.q_offset(b, i, head)..][..d];
            // SAFETY: T is bf16 (`pair_dots` is None otherwise), a transparent u16.
            let src = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u16, d) };
            bits[r * sh.d_pad..][..d].copy_from_slice(src);
        }
    }
    if tiles.is_none() && pair_dots.is_none() {
        // The f32 Q rows, pre-scaled, in register order.
        for r in 0..rows {
            let (head, i) = at_row(r);
            // SAFETY: S available (caller); the offset is a row of the checked Q buffer.
            unsafe { widen::<S, T>(ctx.q, p.q_offset(b, i, head), d, nat) };
            let dst = &mut q[r * sh.d_pad..(r + 1) * sh.d_pad];
            dst.fill(0.0);
            for (e, &x) in nat[..d].iter().enumerate() {
                dst[e / chunk * chunk + reg_pos::<T>(w, e % chunk)] = x * pre;
            }
        }
    }

    let mask = p.mask();
    let mut stats = TaskStats::default();
    let mut j0 = item.keys.start;
    while j0 < end {
        let nk = TILE_KEYS.min(end - j0);
        let nk_w = nk.div_ceil(w) * w;
        let next = TILE_KEYS.min(end - j0 - nk);
        kv.offsets(j0, &mut k_offs[..nk + next], &mut v_offs[..nk + next]);
        // Prefetch (into L2), per the schedule: one phase ahead (this tile's V rows during
        // Q·Kᵀ, the next tile's K rows during P·V) and/or `ahead` keys ahead in each stream,
        // or (`Next`) the next tile's K and V rows during P·V.
        let none: PfStream<'_, T> = (ctx.k, &[], 0, 0);
        let ahead_from = ahead.min(nk + next);
        let first_tile = j0 == item.keys.start;
        let qk_pf = [
            if pf.phase() || (pf.next() && first_tile) {
                (ctx.v, &v_offs[..nk], sh.v_head, dv)
            } else {
                none
            },
            if ahead > 0 {
                (ctx.k, &k_offs[ahead_from..nk + next], sh.k_head, d)
            } else {
                none
            },
        ];
        let pv_pf = [
            if pf.phase() || pf.next() {
                (ctx.k, &k_offs[nk..nk + next], sh.k_head, d)
            } else {
                none
            },
            if pf.next() {
                (ctx.v, &v_offs[nk..nk + next], sh.v_head, dv)
            } else if ahead > 0 {
                (ctx.v, &v_offs[ahead_from..nk + next], sh.v_head, dv)
            } else {
                none
            },
        ];
        // SAFETY: S available (caller); q, s sized above for `rows`; the offsets are those
        // of keys j0..j0 + nk < sk, rows of the checked buffers.
        match tiles.as_mut() {
            // SAFETY: as above; the B tiles hold the item's heads (built above, T is bf16
            // and rph ≤ AMX_MAX_ROWS: `tiles` is None otherwise).
            Some(t) => unsafe {
                let bufs = AmxBufs {
                    qb,
                    a_rows,
                    c_buf,
                    pre,
                };
                qk_tile_amx::<S, T, Tl>(t, ctx.k, &k_offs[..nk], &sh, bufs, s, qk_pf)
            },
            // SAFETY: as above.
            None => unsafe {
                let q_rows = match pair_dots {
                    // SAFETY: the rows·d_pad u16 written above, inside `q`.
                    Some(native) => QRows::Bf16 {
                        bits: std::slice::from_raw_parts(q.as_ptr() as *const u16, rows * sh.d_pad),
                        native,
                        pre,
                    },
                    None => QRows::F32(q),
                };
                qk_tile::<S, T>(ctx.k, &k_offs[..nk], &sh, q_rows, s, qk_pf)
            },
        }
        for r in 0..rows {
            let (_, i) = at_row(r);
            let vis = mask.key_range(i, sq, sk);
            let lo = vis.start.clamp(j0, j0 + nk) - j0;
            let hi = vis.end.clamp(j0 + lo, j0 + nk) - j0;
            let srow = &mut s[r * TILE_KEYS..r * TILE_KEYS + nk_w];
            // SAFETY: S available (caller); srow is whole W-chunks (TILE_KEYS is a multiple
            // of W), hi ≤ nk ≤ nk_w.
            let c = unsafe {
                softmax_row::<S>(
                    srow,
                    lo..hi,
                    post,
                    &mut states[r],
                    &ctx.policy,
                    &mut stats.rescale,
                    ctx.exp2,
                )
            };
            if c != 1.0 {
                o[r * sh.dv_pad..(r + 1) * sh.dv_pad]
                    .iter_mut()
                    .for_each(|x| *x *= c);
            }
        }
        // Meanwhile the next tile's K rows are prefetched.
        match tiles.as_mut() {
            // SAFETY: as for qk_tile; o sized for `rows`; 16 lanes, T is bf16 and
            // rph ≤ AMX_PV_MAX_ROWS (`amx_pv`); pa the P tiles (zero past each group's
            // 2·rph rows: pv_tile_amx writes no others), a_rows and c_buf a tile each.
            Some(t) if amx_pv => unsafe {
                let bufs = PvBufs {
                    pa,
                    gather: a_rows,
                    c_buf: &mut c_buf[..TILE_DWORDS],
                };
                pv_tile_amx::<S, T, Tl>(t, ctx.v, &v_offs[..nk], &sh, s, o, bufs, pv_pf)
            },
            // SAFETY: as for qk_tile; o sized for `rows`.
            _ => unsafe { pv_tile::<S, T>(ctx.v, &v_offs[..nk], &sh, s, o, pv_pf) },
        }
        stats.computed += 1;
        j0 += nk;
    }

    // Out: rows back to natural order (through `nat`, one row at a time).
    for (r, state) in states.iter().enumerate().take(rows) {
        let (head, i) = at_row(r);
        natural_row::<T>(&o[r * sh.dv_pad..(r + 1) * sh.dv_pad], w, &mut nat[..dv]);
        match item.first_row {
            None => {
                let result = state.finish();
                // A row that saw no key gets 0, whatever V holds.
                let at = p.o_offset(b, i, head);
                if result.inv_sum != 0.0 {
                    let f = result.inv_sum;
                    ctx.out
                        .write_row(at, nat[..dv].iter().map(|&x| O::from_f32(x * f)));
                } else {
                    ctx.out.write_row(at, (0..dv).map(|_| O::from_f32(0.0)));
                }
                if let Some(lse) = &ctx.lse {
                    lse.write(p.lse_offset(b, head, i), result.lse);
                }
            }
            Some(first_row) => {
                let at = first_row + r;
                partials.acc.write_row(at * dv, nat[..dv].iter().copied());
                partials.states.write(at, *state);
            }
        }
    }
    stats
}

/// `dst[e]` = element `e` of the register-order row `src` (whole chunks of `2·lanes`, see
/// [`reg_pos`]), for `e < dst.len()`.
#[inline(always)]
pub(crate) fn natural_row<T: Element>(src: &[f32], lanes: usize, dst: &mut [f32]) {
    let chunk = 2 * lanes;
    let whole = dst.len() / chunk * chunk;
    let (head, tail) = dst.split_at_mut(whole);
    for (d, s) in head.chunks_exact_mut(chunk).zip(src.chunks_exact(chunk)) {
        match T::KIND {
            // Even elements in the first half of the chunk, odd in the second.
            sealed::Kind::Bf16 => {
                let (even, odd) = s.split_at(lanes);
                for ((pair, &a), &b) in d.chunks_exact_mut(2).zip(even).zip(odd) {
                    pair[0] = a;
                    pair[1] = b;
                }
            }
            sealed::Kind::F32 | sealed::Kind::F16 => d.copy_from_slice(s),
        }
    }
    for (e, x) in tail.iter_mut().enumerate() {
        *x = src[whole + reg_pos::<T>(lanes, e)];
    }
}

/// Merges a run's splits in split order and writes O and the LSE (see
/// [`super::decode_task::merge_rows`]).
pub(crate) fn combine<T, O: Element>(
    ctx: &Ctx<'_, T, O>,
    item: &Combine,
    acc: &[f32],
    states: &[RowState<f32>],
    acc_row: &mut [f32],
) {
    let p = ctx.problem;
    let sq = p.seq(item.batch).seqlen_q;
    let (group, rph) = (p.group_size(), rows_per_head(p, item.batch));
    let rows = item.heads.len() * rph;
    let h0 = item.heads.start;
    merge_rows(
        ctx,
        item.batch,
        rows,
        item.first_row,
        item.splits,
        |r| row_of(h0 + r / rph, group, sq, r % rph),
        acc,
        states,
        acc_row,
    );
}
