//! The bf16 forward on AMX tiles ([`AmxForwardTask`]): the forward task's plan, masks, online
//! softmax and write-back, with its two products on tiles ([`crate::arch::amx::Tiles`]).
//!
//! Layout (all tiles 16 rows × 64 bytes; rows are cut into panels of [`AMX_PANEL`] = 32,
//! two 16-row blocks):
//! - `Sᵀ = K·Qᵀ`: A tiles are 16 keys × 32 channels of K, copied row-major (no packing beyond
//!   the bf16 copy, padded to 32 channels); B tiles are Q in the pair layout, `[channel pair][row
//!   in block][2]`, packed once per task. The C tiles (16 keys × 16 rows, f32) are stored at
//!   `st[j·panel + r]`, the score layout the SIMD path uses, so the scale, softcap, mask and
//!   [`PanelSoftmax`] (softmax-core's rules) run unchanged on them.
//! - `Oᵀ += Vᵀ·Pᵀ`: A tiles are `Vᵀ` (16 channels × 32 keys, transposed once per key tile for
//!   all the rows of the task: a GQA group's heads × a block of positions), B tiles are P
//!   rounded to bf16 in the pair layout (`[key pair][row][2]`, from two score rows at a time:
//!   [`Simd::bf16_pairs`]); the C tiles are `Oᵀ` in the SIMD path's panel-major layout
//!   (`ot[p0·dv32 + c·panel + r]`), loaded, accumulated over the tile's keys and stored back,
//!   after the online softmax's correction is applied to them in place (only when some row of
//!   the panel moved its reference).
//!
//! Products accumulate in f32; the error beyond the SIMD path's is P's rounding to bf16
//! (relative 2⁻⁹ per probability), inside the bf16 contract (1e-2 normwise).

use super::amx_phases::{AmxPhase, Lap};
use super::forward_task::{
    classify_panels, mask_partial, run_task, write_back, Ctx, Dims, KvRows, NextTile, Sink,
    TaskStats,
};
use super::mask::MAX_PANEL;
use super::scratch::{ensure, ensure_aligned, ensure_on_line, Scratch};
use super::softmax::{add_panel_sums, panel_maxima, panel_offsets, softcap_slice};
use super::tiling::Task;
use crate::arch::amx::Tiles;
use crate::arch::{Arch, Simd};
use crate::dispatch::SimdTask;
use crate::element::{sealed, Element};
use softmax_core::{RescalePolicy, RescaleStats, RowState, TileKind};

/// Most keys per key tile of the AMX kernel ([`amx_keys_for`]), what the scratch is sized for.
pub(crate) const fn amx_keys() -> usize {
    256
}

/// Keys per key tile of the AMX kernel: 256 without a mask, 128 with one. Per tile, each
/// panel loads and stores its `Oᵀ` accumulator tiles once, and on the development VM (a Xeon
/// with AMX) a tile load costs ~30 ticks of the time-stamp counter and a store ~20 against
/// ~9.5 per `tdpbf16ps` (a loop of each alone): longer tiles spread that traffic over more
/// products. 256 against 128, alternating on the development VM (pipelined panels, B=1, H=8,
/// N=2048, one thread, 3 rounds, median GFLOP/s): unmasked D=64 293→276 (noise: the rounds
/// spread ±20 %), D=128 343→383, D=256 395→428; causal D=128 304→264, D=256 350→340, so
/// masks keep 128 (a diagonal tile computes more hidden keys when longer). Measured again
/// after the operands were put on cache lines ([`ensure_on_line`]; aligned, loads from L1 cost
/// little beside the products), one thread, same-run paired: 256 under a mask 0.965× of 128,
/// 512 without one 1.016× of 256 (noise), so both stay. Once more with the tile work issued
/// in parts (amx7): 512 against 256 unmasked was 1.06–1.07× at D=256 on the development VM
/// (0.96× at D=64, 1.02× at D=128), but on the GPU machine's Xeon, the target, neither 512
/// above head dim 128 (paired geometric mean over issue 18's 18 shapes 0.996) nor 512 at
/// every head dim (1.000) moved (docs/history/gpu-notes.md, 2026-12-02).
pub(crate) const fn amx_keys_for(masked: bool) -> usize {
    if masked {
        128
    } else {
        256
    }
}

/// Largest number of query rows in an AMX task (the SIMD path's [`super::tiling::Tiling`]
/// with this as `rows`; [`super::tiling::Tiling::amx_rows_for`]'s budget for Qᵀ and Oᵀ may
/// cap it: under a mask or at head dims up to 128 2.5 MiB, 2560 rows at D=128, 1280 at
/// D=256; else 8 MiB). Fewer, larger tasks pack each K/V tile fewer times: alternating on the
/// development Xeon (B=1, H=8, bf16, GFLOP/s), against the SIMD path's 1008: N=2048 D=256
/// 189/192 → 205/206, N=4096 D=128 181/176 → 187/189, N=2048 D=128 unchanged (171/164 →
/// 171/163).
pub(crate) const AMX_TASK_ROWS: usize = 4096;

/// Query rows per panel: two B tiles of 16 rows.
pub(crate) const AMX_PANEL: usize = 32;
/// bf16 elements per A-tile row (channels of a `QKᵀ` step, keys of a `PV` step).
const STEP: usize = 32;
/// Dwords in one tile (16 rows × 64 bytes).
const TILE_DWORDS: usize = 256;

/// The 16-bit type of the AMX kernels' inputs, and how its values become the tiles' bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HalfKind {
    /// bf16: the tiles' own type, copied.
    Bf16,
    /// f16: each value `x` is split into two bf16, `hi` (x rounded to bf16) and `lo = x − hi`,
    /// whose sum is `x` exactly (f16 has 11 significant bits, bf16 8: `x − hi` is a multiple
    /// of x's f16 ulp of at most 2⁻⁸·|x|, so 3 significant bits, and f16's range lies inside
    /// bf16's). `q·k = qh·kh + qh·kl + ql·kh` up to the dropped `ql·kl` (≤ 2⁻¹⁶ of `|q·k|`):
    /// Q·Kᵀ runs over three times the channels, Q as `[hi | hi | lo]`, K as `[hi | lo | hi]`;
    /// `Vᵀ·Pᵀ` over twice the keys, V as `[hi | lo]` against P twice. So f16 inputs keep their
    /// precision, and the only rounding beyond the SIMD path's is P's, as for bf16; the tile
    /// work grows 3× for the scores and 2× for the products (AMX has no f16 product on the
    /// CPUs at hand: AMX-FP16 came with Granite Rapids).
    F16,
}

impl HalfKind {
    /// The kind of inputs of `dtype` (`None`: f32, which the AMX kernels do not take).
    pub(crate) const fn of(dtype: softmax_core::DType) -> Option<HalfKind> {
        match dtype {
            softmax_core::DType::Bf16 => Some(HalfKind::Bf16),
            softmax_core::DType::F16 => Some(HalfKind::F16),
            _ => None,
        }
    }

    /// bf16 parts per channel in Q·Kᵀ's operands.
    pub(crate) const fn qk_parts(self) -> usize {
        match self {
            HalfKind::Bf16 => 1,
            HalfKind::F16 => 3,
        }
    }

    /// bf16 parts per key in `Vᵀ`.
    pub(crate) const fn v_parts(self) -> usize {
        match self {
            HalfKind::Bf16 => 1,
            HalfKind::F16 => 2,
        }
    }
}

/// Q, K and V as the bits of a 16-bit type the AMX kernels take ([`HalfKind`]).
#[derive(Clone, Copy)]
pub(crate) struct AmxInputs<'a> {
    /// Q's bits.
    pub q: &'a [u16],
    /// K's bits.
    pub k: &'a [u16],
    /// V's bits.
    pub v: &'a [u16],
    /// Their type.
    pub kind: HalfKind,
}

impl<'a> AmxInputs<'a> {
    /// The inputs, if they are bf16 or f16.
    pub fn of<T: Element>(q: &'a [T], k: &'a [T], v: &'a [T]) -> Option<Self> {
        use half::slice::HalfFloatSliceExt;
        use sealed::Slice::{Bf16, F16};
        let view = <T as sealed::Sealed>::view;
        let (q, k, v, kind) = match (view(q), view(k), view(v)) {
            (Bf16(q), Bf16(k), Bf16(v)) => (
                q.reinterpret_cast(),
                k.reinterpret_cast(),
                v.reinterpret_cast(),
                HalfKind::Bf16,
            ),
            (F16(q), F16(k), F16(v)) => (
                q.reinterpret_cast(),
                k.reinterpret_cast(),
                v.reinterpret_cast(),
                HalfKind::F16,
            ),
            _ => return None,
        };
        Some(AmxInputs { q, k, v, kind })
    }
}

/// `x` rounded to bf16 (to nearest even; a NaN stays a quiet NaN), as the bits in the low
/// half. Branch-free apart from the NaN select, so loops of it vectorise.
#[inline(always)]
pub(super) fn bf16_bits(x: f32) -> u32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    if x.is_nan() {
        (b >> 16) | 0x40
    } else {
        rounded
    }
}

/// [`HalfKind::F16`]'s split of an f16 value `x` (exact in f32): the bits of `hi` = x rounded
/// to bf16 and of `lo = x − hi` (exact, so exactly a bf16). Infinities and NaN go whole into
/// `hi`, with `lo = 0`.
#[inline(always)]
pub(super) fn split_bf16(x: f32) -> (u32, u32) {
    let hi = bf16_bits(x);
    let rest = x - f32::from_bits(hi << 16);
    let lo = if rest.is_finite() { bf16_bits(rest) } else { 0 };
    (hi, lo)
}

/// The f16 row `src` widened into `tmp[..width]`, zeros past `src.len()`.
///
/// # Safety
/// S available; `tmp` holds `width ≥ src.len()` floats.
#[inline(always)]
unsafe fn widen_f16_row<S: Simd>(src: &[u16], tmp: &mut [f32], width: usize) {
    let n = src.len();
    // SAFETY: `src` holds n halves and `tmp` width ≥ n floats (caller); S available.
    unsafe { S::widen_f16(src.as_ptr(), tmp.as_mut_ptr(), n) };
    tmp[n..width].fill(0.0);
}

/// One task of the forward pass on AMX tiles `M`, with its worker's scratch.
pub(crate) struct AmxForwardTask<'t, 'a, T, O, M> {
    /// The call's inputs and outputs.
    pub ctx: &'t Ctx<'a, T, O>,
    /// Q, K, V as bf16 or f16 bits (the same buffers as the context's).
    pub inputs: AmxInputs<'t>,
    /// The rows to compute.
    pub task: &'t Task,
    /// The worker's scratch.
    pub scratch: &'t mut Scratch,
    /// The tiles, configured on this thread.
    pub tiles: M,
}

impl<T: Element, O: Element, M: Tiles> SimdTask for AmxForwardTask<'_, '_, T, O, M> {
    type Output = TaskStats;

    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(
        mut self,
    ) -> TaskStats {
        // SAFETY: (all arms) A available and the const generics A's (caller); the context
        // comes from `forward_with_workspace` (problem validated, buffers checked, the tiling
        // of A's level), `inputs` are its Q, K, V; the AMX arms' widths give W·NR = 32.
        unsafe {
            match A::W {
                16 => amx_task::<A, T, O, M, 2>(
                    self.ctx,
                    self.inputs,
                    self.task,
                    self.scratch,
                    &mut self.tiles,
                ),
                8 => amx_task::<A, T, O, M, 4>(
                    self.ctx,
                    self.inputs,
                    self.task,
                    self.scratch,
                    &mut self.tiles,
                ),
                // No 32-row panel at this width: the SIMD path.
                _ => {
                    let keys = 0..self.ctx.problem.seq(self.task.batch).seqlen_k;
                    run_task::<A, T, O, QK, NR, PV>(
                        self.ctx,
                        self.task,
                        keys,
                        Sink::Final,
                        self.scratch,
                    )
                }
            }
        }
    }
}

/// Runs one task (all its keys, into O and the LSE) with the products on tiles `tiles`.
///
/// # Safety
/// S available, `S::W · NR == AMX_PANEL`; the context's problem validated and buffers checked;
/// `inputs` are the context's Q, K, V.
#[inline(always)]
unsafe fn amx_task<S: Simd, T: Element, O: Element, M: Tiles, const NR: usize>(
    ctx: &Ctx<'_, T, O>,
    inputs: AmxInputs<'_>,
    task: &Task,
    scratch: &mut Scratch,
    tiles: &mut M,
) -> TaskStats {
    const { assert!(AMX_PANEL <= MAX_PANEL) };
    let panel = S::W * NR;
    let p = ctx.problem;
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let (d32, dv32) = (d.div_ceil(STEP) * STEP, dv.div_ceil(STEP) * STEP);
    // Channels of Q·Kᵀ's packed operands and bf16 parts per key of Vᵀ (`HalfKind`).
    let (dk, v_parts) = (inputs.kind.qk_parts() * d32, inputs.kind.v_parts());
    let rows = task.heads * task.len;
    let br = rows.div_ceil(panel) * panel;
    let bc = amx_keys_for(!p.mask().is_none());
    let seq = p.seq(task.batch);
    let dims = Dims {
        d,
        dv,
        dv_pad: dv32,
        v_stride: dv32,
        rows,
        br,
        bc,
        panel,
        few: false,
        d_w: d32,
        dv_w: dv32,
        sq: seq.seqlen_q,
        sk: seq.seqlen_k,
    };
    let mut stats = TaskStats::default();
    let Scratch {
        ot,
        st,
        row,
        corr,
        states,
        kinds,
        kv_offsets,
        amx_q,
        amx_k,
        amx_v,
        amx_p,
        amx_pairs,
        ..
    } = scratch;
    let ot = ensure_aligned(ot, dv32 * br);
    let st = ensure_aligned(st, 2 * bc * panel);
    let row = ensure_aligned(row, amx_row_floats(d, dv));
    let corr = ensure(corr, br, 1.0);
    let states = ensure(states, br, RowState::new());
    let kinds = ensure(kinds, br / panel, TileKind::Full);
    let kv_offsets = ensure(kv_offsets, 4 * bc, 0);
    let (k_offs, v_offs) = kv_offsets.split_at_mut(2 * bc);
    // The tiles' operands start on cache lines: a tile row of 64 bytes then reads one line,
    // not two (a misaligned `tileloadd` ran ~3× slower in a loop on the development VM).
    let qv = ensure_on_line(amx_q, br * dk / 2);
    let kb = ensure_on_line(amx_k, bc * dk);
    let vb = ensure_on_line(amx_v, v_parts * dv32 * bc / 2);
    let pb = ensure_on_line(amx_p, 2 * (bc / 2 * panel));
    let pairs = ensure(amx_pairs, amx_pair_dwords(d, dv, bc, inputs.kind), 0);
    let mut lap = Lap::start();
    // Oᵀ is not cleared: a panel's first products start from zero tiles (`OPanels`).
    let mut o_panels = OPanels::new(br / panel);
    if o_panels.all_written() {
        ot.fill(0.0);
    }
    states.fill(RowState::new());

    // SAFETY: S available (caller); qv holds br·dk/2 dwords, pairs 16·dk/2, row 2·d32.
    unsafe { pack_q::<S, T, O>(inputs, ctx, task, (d, d32), qv, pairs, row) };
    lap.lap(AmxPhase::PackQ);
    let transform = p.score_transform::<f32>();
    let (pre, post) = (transform.pre_factor(), transform.softcap_post_factor());

    let kv = KvRows::new(p, task.batch, task.head_kv);
    let mask = p.mask();
    let q_rows = task.i0..task.i0 + task.len;
    let sk = dims.sk;
    let total_tiles = sk.div_ceil(bc) as u64;
    let key_tiles = mask.key_tile_range(q_rows.clone(), bc, dims.sq, sk);
    for tile in key_tiles.clone() {
        let j0 = tile * bc;
        let nk = bc.min(sk - j0);
        let kind = mask.classify_tile(q_rows.clone(), j0..j0 + nk, dims.sq, sk);
        if kind == TileKind::Empty {
            continue;
        }
        let nk32 = nk.div_ceil(STEP) * STEP;
        // This tile's K/V rows and the next tile's, which the panels prefetch (rows a head
        // stride apart are beyond the hardware prefetchers).
        let has_next = tile + 1 < key_tiles.end;
        let next_rows = kv.tile_offsets(j0, nk, bc, sk, has_next, k_offs, v_offs);
        // SAFETY: S available; kb holds nk32·dk halves, row d32 floats; vb holds
        // v_parts·dv32·nk32/2 dwords, pairs v_parts·nk32/2·dv32, row 2·dv32 floats.
        unsafe {
            pack_k::<S>(inputs, &k_offs[..nk], (d, d32), nk32, kb, row);
            pack_vt::<S>(inputs, &v_offs[..nk], (dv, dv32), nk32, vb, pairs, row);
        }
        classify_panels(kinds, &mask, task, &dims, kind, j0..j0 + nk);
        let live_panels = kinds.iter().filter(|&&k| k != TileKind::Empty).count();
        let mut prefetch = NextTile {
            k_offs: &k_offs[nk..nk + next_rows],
            v_offs: &v_offs[nk..nk + next_rows],
            rows: next_rows,
            total: 2 * next_rows,
            calls: 2 * live_panels,
            done: 0,
            call: 0,
        };
        lap.lap(AmxPhase::PackKv);
        // The panels run as a pipeline: while the vector units run panel i's softmax, the
        // tiles compute panel i+1's scores and panel i−1's products (`TileWork`, with the
        // softmax's vector work issued a share at a time between its parts), so the two
        // kinds of work overlap instead of taking turns. Scores and P are double-buffered (`st`, `pb` halves).
        let mut live = (0..br / panel).filter(|&pi| kinds[pi] != TileKind::Empty);
        let Some(first) = live.next() else {
            continue;
        };
        let q_panel = |pi: usize| qv[(pi * panel / 16) * (dk / STEP) * TILE_DWORDS..].as_ptr();
        let st_buf = [st.as_mut_ptr(), st[bc * panel..].as_mut_ptr()];
        let pb_buf = [pb.as_mut_ptr(), pb[bc / 2 * panel..].as_mut_ptr()];
        let o_base = ot.as_mut_ptr();
        // SAFETY: (scores and products jobs below) `q_panel` points at the panel's two row
        // blocks of dk/32 tiles inside qv, `kb` holds nk32 rows of dk, each st half bc ≥
        // nk32 rows of `panel` floats; `vb` dv32 rows of v_parts·nk32/2 dwords, each pb half
        // nk32/2 rows of `panel` dwords, `o_base + pi·panel·dv32` the panel's dv32 rows of
        // `panel` floats (pi < br/panel).
        let scores_job =
            |pi: usize, b: usize| ScoresJob::new(q_panel(pi), kb.as_ptr(), st_buf[b], dk, nk32);
        let products_job = |pi: usize, b: usize, fresh: bool| ProductsJob {
            vb: vb.as_ptr(),
            pb: pb_buf[b],
            o: o_base.wrapping_add(pi * panel * dv32),
            dv32,
            nk32,
            v_parts,
            fresh,
        };
        let first_scores = TileWork {
            scores: Some(scores_job(first, 0)),
            products: None,
        };
        // SAFETY: the job's buffers (above).
        unsafe { run_tile_work(tiles, &first_scores, &mut Alone) };
        lap.lap(AmxPhase::Scores);
        prefetch.after_call::<S, T, O>(ctx, &dims);
        let (mut cur, mut prev, mut b) = (first, None, 0);
        loop {
            let next = live.next();
            let rv0 = cur * panel;
            let kind = kinds[cur];
            stats.computed += 1;
            // SAFETY: st_buf[b] holds bc ≥ nk rows of `panel` floats, in `st`, not touched
            // by the tiles during this iteration (they write the other half).
            let st_cur = unsafe { std::slice::from_raw_parts_mut(st_buf[b], bc * panel) };
            // The score transform: a positive scale is folded into the softmax's first FMA
            // (`factor`); a softcap (or a scale ≤ 0, which would turn maxima into minima)
            // is applied in place first, and the softmax takes the scores as they are.
            let factor = if post.is_none() && pre > 0.0 {
                pre
            } else {
                // SAFETY: S available (caller); st_cur holds nk·panel floats, a multiple of W.
                unsafe {
                    scale_slice::<S>(st_cur.as_mut_ptr(), nk * panel, pre);
                    if let Some(post) = post {
                        softcap_slice::<S>(st_cur.as_mut_ptr(), nk * panel, post);
                    }
                }
                1.0
            };
            // Only writes −∞ (which any factor keeps −∞).
            // SAFETY: S available; st_cur holds nk rows of `panel`; rv0 < rows.
            unsafe { mask_partial::<S, NR>(kind, &mask, task, &dims, st_cur, rv0, j0, nk) };
            lap.lap(AmxPhase::Softmax);
            let work = TileWork {
                scores: next.map(|n| scores_job(n, b ^ 1)),
                products: prev.map(|pv| products_job(pv, b ^ 1, o_panels.first_write(pv))),
            };
            // SAFETY: st_cur holds nk rows of `panel` floats, pb_buf[b] nk32/2 rows of
            // `panel` dwords (neither touched by `work`, which reads and writes the other
            // halves and other panels' Oᵀ); states and corr hold br ≥ rv0 + panel rows; S
            // available (caller), and with hardware tiles AVX512-BF16 and AVX512-BW
            // (`Tiles::HARDWARE`).
            unsafe {
                let softmax = PanelSoftmax {
                    rv0,
                    rows,
                    policy: &ctx.policy,
                    factor,
                };
                let args = (st_cur.as_ptr(), nk, nk32, pb_buf[b]);
                let (s, c, r) = (&mut *states, &mut *corr, &mut stats.rescale);
                let w = (&work, &mut *tiles);
                // P is rounded to bf16 for the products: `Auto` takes the cubic here.
                match (ctx.exp2.cubic(true), M::HARDWARE) {
                    (false, true) => softmax.run::<S, M, NR, false, true>(args, s, c, r, w),
                    (false, false) => softmax.run::<S, M, NR, false, false>(args, s, c, r, w),
                    (true, true) => softmax.run::<S, M, NR, true, true>(args, s, c, r, w),
                    (true, false) => softmax.run::<S, M, NR, true, false>(args, s, c, r, w),
                }
            }
            lap.lap(AmxPhase::Softmax);
            for _ in 0..work.jobs() {
                prefetch.after_call::<S, T, O>(ctx, &dims);
            }
            let corr_panel = &corr[rv0..rv0 + panel];
            // A panel not yet written has no Oᵀ to correct (its memory is not cleared).
            if o_panels.written(cur) && corr_panel.iter().any(|&c| c != 1.0) {
                // SAFETY: the panel's dv32 rows of `panel` floats inside `ot` (cur < br/panel),
                // not touched by the tiles now (its products come in the next iteration);
                // corr_panel `panel` = NR·W; S available.
                unsafe {
                    let o_panel =
                        std::slice::from_raw_parts_mut(o_base.add(rv0 * dv32), panel * dv32);
                    rescale::<S, NR>(o_panel, corr_panel, dv32)
                };
            }
            lap.lap(AmxPhase::Rescale);
            prev = Some(cur);
            match next {
                Some(n) => {
                    cur = n;
                    b ^= 1;
                }
                None => break,
            }
        }
        // The last panel's products (its P is in pb_buf[b]).
        let fresh = o_panels.first_write(cur);
        let last = TileWork {
            scores: None,
            products: Some(products_job(cur, b, fresh)),
        };
        // SAFETY: the job's buffers (above).
        unsafe { run_tile_work(tiles, &last, &mut Alone) };
        lap.lap(AmxPhase::Products);
        prefetch.after_call::<S, T, O>(ctx, &dims);
        lap.lap(AmxPhase::PackKv);
    }
    stats.skipped = total_tiles * rows.div_ceil(panel) as u64 - stats.computed;
    // Panels no key reached (a mask hid every key tile from them) write zeros.
    for pi in (0..br / panel).filter(|&pi| !o_panels.written(pi)) {
        ot[pi * panel * dv32..(pi + 1) * panel * dv32].fill(0.0);
    }
    // SAFETY: S available; `ot` holds dv32·br floats (dims.dv_pad = dv32), `row` panel·dv,
    // `states` br rows.
    unsafe { write_back::<S, T, O>(ctx, task, &dims, ot, row, states) };
    lap.lap(AmxPhase::Write);
    lap.end_task();
    stats
}

/// Floats of the `row` scratch the AMX forward asks for: the write-back's panel of rows, and
/// two widened f16 rows of the packing ([`HalfKind::F16`]).
pub(crate) fn amx_row_floats(d: usize, dv: usize) -> usize {
    let (d32, dv32) = (d.div_ceil(STEP) * STEP, dv.div_ceil(STEP) * STEP);
    (AMX_PANEL * d.max(dv)).max(2 * d32.max(dv32))
}

/// Dwords of the `pairs` scratch the AMX forward asks for at `bc` keys per tile: Q's 16-row
/// blocks and `Vᵀ`'s key pairs before their transposes.
pub(crate) fn amx_pair_dwords(d: usize, dv: usize, bc: usize, kind: HalfKind) -> usize {
    let (d32, dv32) = (d.div_ceil(STEP) * STEP, dv.div_ceil(STEP) * STEP);
    (kind.v_parts() * bc / 2 * dv32).max(16 * kind.qk_parts() * d32 / 2)
}

/// Q's rows of the task as B tiles of `dk = qk_parts·d32` channels ([`HalfKind`]; f16 rows
/// as `[hi | hi | lo]`): the dword (channel pair `cp`) of row `r` at `(r/16·(dk/32) +
/// cp/16)·256 + (cp%16)·16 + r%16`, zeros in the padding. Per 16 rows, the rows' dwords are
/// gathered row-major into `pairs` (16 × dk/2) and transposed 16 × 16 at a time (a dword
/// transpose moves bf16 pairs whole).
///
/// # Safety
/// S available; `qv` holds `rows.div_ceil(16)·16·dk/2` dwords, `pairs` `16·dk/2`, `tmp`
/// `d32` floats.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_q<S: Simd, T, O>(
    inputs: AmxInputs<'_>,
    ctx: &Ctx<'_, T, O>,
    task: &Task,
    (d, d32): (usize, usize),
    qv: &mut [u32],
    pairs: &mut [u32],
    tmp: &mut [f32],
) {
    let p = ctx.problem;
    let rows = task.heads * task.len;
    let dk = inputs.kind.qk_parts() * d32;
    let (half, hk) = (d32 / 2, dk / 2);
    for rb in 0..rows.div_ceil(16) {
        let block = &mut pairs[..16 * hk];
        for l in 0..16 {
            let dst = &mut block[l * hk..(l + 1) * hk];
            let r = rb * 16 + l;
            if r >= rows {
                dst.fill(0);
                continue;
            }
            let (head, i) = task.row(r);
            let off = p.q_offset(task.batch, i, head);
            let src = &inputs.q[off..off + d];
            if inputs.kind == HalfKind::F16 {
                // SAFETY: `tmp` holds d32 ≥ d floats (caller); S available.
                unsafe { widen_f16_row::<S>(src, tmp, d32) };
                let (hi, rest) = dst.split_at_mut(half);
                let (hi_again, lo) = rest.split_at_mut(half);
                for (cp, (h, l)) in hi.iter_mut().zip(lo.iter_mut()).enumerate() {
                    let (h0, l0) = split_bf16(tmp[2 * cp]);
                    let (h1, l1) = split_bf16(tmp[2 * cp + 1]);
                    *h = h0 | h1 << 16;
                    *l = l0 | l1 << 16;
                }
                hi_again.copy_from_slice(hi);
                continue;
            }
            if cfg!(target_endian = "little") {
                // A row's channel pairs are its bf16 in memory order: dword cp = channel 2cp
                // in the low half, 2cp + 1 in the high half. Copy the bytes, zero the rest.
                let bytes = 2 * d;
                // SAFETY: `src` holds d bf16 (2d bytes), `dst` hk = d32/2 ≥ d/2 dwords
                // (4·hk ≥ 2d bytes); distinct buffers.
                unsafe {
                    let to = dst.as_mut_ptr() as *mut u8;
                    std::ptr::copy_nonoverlapping(src.as_ptr() as *const u8, to, bytes);
                    std::ptr::write_bytes(to.add(bytes), 0, 4 * hk - bytes);
                }
                continue;
            }
            for (cp, x) in dst.iter_mut().enumerate() {
                let lo = src.get(2 * cp).map_or(0, |&v| v as u32);
                let hi = src.get(2 * cp + 1).map_or(0, |&v| v as u32);
                *x = lo | hi << 16;
            }
        }
        let out = &mut qv[rb * 16 * hk..(rb + 1) * 16 * hk];
        for cc in 0..dk / STEP {
            // SAFETY: the block holds 16 rows of `hk` dwords (columns cc·16..cc·16 + 16
            // inside), `out` the 16 × 16 tile at cc·256; bits move unchanged (dwords as f32
            // through loads and stores, no arithmetic); S available (caller).
            unsafe {
                transpose16::<S>(
                    block.as_ptr().add(cc * 16) as *const f32,
                    hk,
                    out.as_mut_ptr().add(cc * TILE_DWORDS) as *mut f32,
                    16,
                )
            };
        }
    }
}

/// The tile's K rows as A tiles: bf16 rows of `dk = qk_parts·d32` channels (f16 rows as
/// `[hi | lo | hi]`, [`HalfKind`]), each part zero-padded to `d32` channels, and zero rows up
/// to `nk32` keys.
///
/// # Safety
/// S available; `kb` holds `nk32·dk` halves, `tmp` `d32` floats.
#[inline(always)]
unsafe fn pack_k<S: Simd>(
    inputs: AmxInputs<'_>,
    k_offs: &[usize],
    (d, d32): (usize, usize),
    nk32: usize,
    kb: &mut [u16],
    tmp: &mut [f32],
) {
    let dk = inputs.kind.qk_parts() * d32;
    for (j, dst) in kb[..nk32 * dk].chunks_exact_mut(dk).enumerate() {
        let Some(&off) = k_offs.get(j) else {
            dst.fill(0);
            continue;
        };
        let src = &inputs.k[off..off + d];
        match inputs.kind {
            HalfKind::Bf16 => {
                dst[..d].copy_from_slice(src);
                dst[d..].fill(0);
            }
            HalfKind::F16 => {
                // SAFETY: `tmp` holds d32 ≥ d floats (caller); S available.
                unsafe { widen_f16_row::<S>(src, tmp, d32) };
                let (hi, rest) = dst.split_at_mut(d32);
                let (lo, hi_again) = rest.split_at_mut(d32);
                for ((h, l), &x) in hi.iter_mut().zip(lo.iter_mut()).zip(&tmp[..d32]) {
                    let (xh, xl) = split_bf16(x);
                    (*h, *l) = (xh as u16, xl as u16);
                }
                hi_again.copy_from_slice(hi);
            }
        }
    }
}

/// The tile's V rows as A tiles of `Vᵀ`: dword `(c, jp)` = `V[2jp][c] | V[2jp+1][c] << 16` at
/// `c·(v_parts·nk32/2) + jp`, zero-padded to `dv32` channels and `nk32` keys; for f16
/// ([`HalfKind`]) the `hi` parts' pairs, then the `lo` parts' (`jp + nk32/2`). Pairs of V
/// rows are interleaved row-major into `pairs` (`v_parts·nk32/2 × dv32`), then transposed.
///
/// # Safety
/// S available; `vb` holds `v_parts·dv32·nk32/2` dwords, `pairs` `v_parts·nk32/2·dv32`, `tmp`
/// `2·dv32` floats; `nk32` a multiple of 32, `dv32` of 32.
#[inline(always)]
unsafe fn pack_vt<S: Simd>(
    inputs: AmxInputs<'_>,
    v_offs: &[usize],
    (dv, dv32): (usize, usize),
    nk32: usize,
    vb: &mut [u32],
    pairs: &mut [u32],
    tmp: &mut [f32],
) {
    let nk = v_offs.len();
    let half = nk32 / 2;
    let v = inputs.v;
    let row = |j: usize| v_offs.get(j).map(|&off| &v[off..off + dv]);
    let (his, los) = pairs[..inputs.kind.v_parts() * half * dv32].split_at_mut(half * dv32);
    for jp in 0..half {
        let dst = &mut his[jp * dv32..(jp + 1) * dv32];
        if inputs.kind == HalfKind::F16 {
            let (ta, tb) = tmp[..2 * dv32].split_at_mut(dv32);
            for (t, r) in [(&mut *ta, row(2 * jp)), (&mut *tb, row(2 * jp + 1))] {
                match r {
                    // SAFETY: `t` holds dv32 ≥ dv floats; S available (caller).
                    Some(r) => unsafe { widen_f16_row::<S>(r, t, dv32) },
                    None => t.fill(0.0),
                }
            }
            let lo = &mut los[jp * dv32..(jp + 1) * dv32];
            for (((h, l), &a), &b) in dst.iter_mut().zip(lo.iter_mut()).zip(&*ta).zip(&*tb) {
                let ((ah, al), (bh, bl)) = (split_bf16(a), split_bf16(b));
                (*h, *l) = (ah | bh << 16, al | bl << 16);
            }
            continue;
        }
        match (row(2 * jp), row(2 * jp + 1)) {
            (Some(a), Some(b)) => {
                for ((x, &y), &z) in dst.iter_mut().zip(a).zip(b) {
                    *x = y as u32 | (z as u32) << 16;
                }
                dst[dv..].fill(0);
            }
            (Some(a), None) => {
                for (x, &y) in dst.iter_mut().zip(a) {
                    *x = y as u32;
                }
                dst[dv..].fill(0);
            }
            _ => dst.fill(0),
        }
    }
    debug_assert!(2 * half >= nk);
    // Key pairs of all parts, one part after the other (half is a multiple of 16).
    let pair_rows = inputs.kind.v_parts() * half;
    for j0 in (0..pair_rows).step_by(16) {
        for c0 in (0..dv32).step_by(16) {
            // SAFETY: rows j0..j0 + 16 ≤ pair_rows of `pairs` (stride dv32), columns c0..c0 +
            // 16 ≤ dv32; into rows c0.. of vb (stride pair_rows), columns j0..; bits move
            // unchanged; S available (caller).
            unsafe {
                transpose16::<S>(
                    pairs.as_ptr().add(j0 * dv32 + c0) as *const f32,
                    dv32,
                    vb.as_mut_ptr().add(c0 * pair_rows + j0) as *mut f32,
                    pair_rows,
                )
            };
        }
    }
}

/// Transposes a 16 × 16 block of dwords (`dst[c·dst_stride + r] = src[r·src_stride + c]`)
/// with the architecture's `W × W` float transposes, which move bits unchanged (loads,
/// shuffles and stores only).
///
/// # Safety
/// S available; 16 rows of 16 readable dwords at `src`, 16 of 16 writable at `dst`, not
/// overlapping.
#[inline(always)]
unsafe fn transpose16<S: Simd>(
    src: *const f32,
    src_stride: usize,
    dst: *mut f32,
    dst_stride: usize,
) {
    if 16 % S::W == 0 {
        for r0 in (0..16).step_by(S::W) {
            for c0 in (0..16).step_by(S::W) {
                // SAFETY: the W × W block (r0, c0) lies inside both 16 × 16 blocks.
                unsafe {
                    S::transpose(
                        src.add(r0 * src_stride + c0),
                        src_stride,
                        dst.add(c0 * dst_stride + r0),
                        dst_stride,
                    )
                };
            }
        }
    } else {
        for r in 0..16 {
            for c in 0..16 {
                // SAFETY: r, c < 16.
                unsafe {
                    *(dst.add(c * dst_stride + r) as *mut u32) =
                        *(src.add(r * src_stride + c) as *const u32)
                };
            }
        }
    }
}

/// `x[..n] *= factor` (`n` a multiple of `W`).
///
/// # Safety
/// S available; `x` read/writable for `n` floats.
#[inline(always)]
unsafe fn scale_slice<S: Simd>(x: *mut f32, n: usize, factor: f32) {
    // SAFETY: S available (caller).
    let f = unsafe { S::splat(factor) };
    let mut i = 0;
    while i + S::W <= n {
        // SAFETY: i + W ≤ n.
        unsafe { S::store(x.add(i), S::mul(S::load(x.add(i)), f)) };
        i += S::W;
    }
}

/// The online softmax of one panel's score tile, fused with P's packing: block maxima of
/// `factor·S` (`factor > 0`, so they are `factor` times the maxima of S: rounding is
/// monotonic), softmax-core's block step per row ([`panel_offsets`]), then per pair of keys
/// `exp2(factor·s − offset)` (one FMA), the row sums, and P rounded to bf16 straight into the
/// B-tile pair layout: key pair `jp`, row `r` of block `rb` at dword `((jp/16)·2 + rb)·256 +
/// (jp%16)·16 + r%16`; keys `nk..nk32` are zeros. S is read twice from L1 and P never goes
/// back to f32 memory.
struct PanelSoftmax<'p> {
    /// First row of the panel.
    rv0: usize,
    /// Real rows of the task (the panel's rows past them are padding).
    rows: usize,
    /// The rescale policy.
    policy: &'p RescalePolicy<f32>,
    /// The positive factor applied to the scores.
    factor: f32,
}

impl PanelSoftmax<'_> {
    /// Runs it on `(st, nk, nk32, pb)`: `st` holds `nk` rows of `NR·W` (= [`AMX_PANEL`])
    /// scores, `pb` gets `nk32/2` rows of pair dwords; `states` and `corr` are the task's.
    /// `CUBIC`: [`Simd::exp2_cubic_softmax`], else [`Simd::exp2_softmax`] ([`crate::arch::exp2_exact`]'s
    /// values); `NATIVE`: the CPU's bf16 conversion.
    ///
    /// `work` runs on `tiles` meanwhile, and it sets the pace: after each of its parts
    /// ([`run_tile_work`]) the softmax advances by its share of [`SoftmaxUnits`] (the maxima
    /// pass first, then one row vector of a key pair per unit), so that the two kinds of work
    /// end together. The tile work's loops are plain nested loops and a unit is a few vector
    /// instructions behind one counter, so the interleaving costs little scalar work.
    ///
    /// # Safety
    /// S available (and with `NATIVE` AVX512-BF16 and AVX512-BW); `st` readable for `nk·NR·W`
    /// floats, `pb` writable for `nk32/2·NR·W` dwords; `states` and `corr` hold `rv0 +
    /// NR·W` entries; `1 ≤ nk ≤ nk32`, `nk32` even; `NR·W == AMX_PANEL`; `work` as
    /// [`run_tile_work`] asks, its buffers apart from `st` and `pb`.
    #[inline(always)]
    #[allow(clippy::type_complexity)]
    unsafe fn run<S: Simd, M: Tiles, const NR: usize, const CUBIC: bool, const NATIVE: bool>(
        &self,
        (st, nk, nk32, pb): (*const f32, usize, usize, *mut u32),
        states: &mut [RowState<f32>],
        corr: &mut [f32],
        stats: &mut RescaleStats,
        (work, tiles): (&TileWork, &mut M),
    ) {
        let units = 1 + nk / 2 * NR;
        // SAFETY: S available (caller).
        let (f, zero) = unsafe { (S::splat(self.factor), S::splat(0.0)) };
        let mut softmax = SoftmaxUnits::<S, NR, CUBIC, NATIVE> {
            panel: self,
            st,
            nk,
            pb,
            states,
            corr,
            stats,
            f,
            neg: [zero; NR],
            sum: [zero; NR],
            done: 0,
            units,
            parts: work.parts().max(1),
            owed: 0,
        };
        // SAFETY: bounds are the caller's contract, and `work`'s ([`run_tile_work`]).
        unsafe {
            run_tile_work(tiles, work, &mut softmax);
            while softmax.done < units {
                softmax.unit();
            }
            softmax.finish(nk32);
        }
    }
}

/// `exp2(f·s − offset)` of the W scores at `p` (`neg` = −offset). No closures here: a
/// closure would not inherit the trampoline's target features, and its vector intrinsics
/// would become calls.
///
/// # Safety
/// S available; W readable floats at `p`.
#[inline(always)]
unsafe fn exp_scores<S: Simd, const CUBIC: bool>(p: *const f32, f: S::V, neg: S::V) -> S::V {
    // SAFETY: the caller's.
    unsafe {
        // x = factor·s − offset ≤ the rescale threshold (≤ 64): both take softmax arguments.
        let x = S::fma(S::load(p), f, neg);
        if CUBIC {
            S::exp2_cubic_softmax(x)
        } else {
            S::exp2_softmax(x)
        }
    }
}

/// The dword of key pair `jp`, rows `r..r + W` in P's B-tile layout: offset into `pb`.
#[inline(always)]
fn pair_dword(jp: usize, r: usize) -> usize {
    ((jp / 16) * 2 + r / 16) * 256 + (jp % 16) * 16 + r % 16
}

/// [`PanelSoftmax::run`]'s vector work in units: unit 0 the maxima pass and the offsets, unit
/// `1 + NR·jp + n` the exponentials, sums and bf16 pairs of key pair `jp`, row vector `n`;
/// [`SoftmaxUnits::finish`] the odd last key, P's zero padding and the sums. As
/// [`Between`], it takes `units/parts` units per part of the tile work (without a division:
/// `owed` carries the remainder).
struct SoftmaxUnits<'u, 'p, S: Simd, const NR: usize, const CUBIC: bool, const NATIVE: bool> {
    panel: &'u PanelSoftmax<'p>,
    st: *const f32,
    nk: usize,
    pb: *mut u32,
    states: &'u mut [RowState<f32>],
    corr: &'u mut [f32],
    stats: &'u mut RescaleStats,
    /// The factor, splatted.
    f: S::V,
    /// −offset per row vector (after unit 0).
    neg: [S::V; NR],
    /// The row sums so far.
    sum: [S::V; NR],
    /// Units done, of `units`.
    done: usize,
    units: usize,
    /// Parts of the tile work (≥ 1), and `parts_done · units mod parts`.
    parts: usize,
    owed: usize,
}

impl<S: Simd, const NR: usize, const CUBIC: bool, const NATIVE: bool>
    SoftmaxUnits<'_, '_, S, NR, CUBIC, NATIVE>
{
    /// The next unit (`done < units`).
    ///
    /// # Safety
    /// As [`PanelSoftmax::run`].
    #[inline(always)]
    unsafe fn unit(&mut self) {
        let w = S::W;
        let panel = NR * w;
        let p = self.panel;
        // SAFETY: bounds are the caller's contract (unit `1 + NR·jp + n` reads keys 2jp and
        // 2jp + 1 < nk, writes pair jp < nk32/2).
        unsafe {
            if self.done == 0 {
                let mut mx = panel_maxima::<S, NR>(self.st, panel, self.nk);
                for m in mx.iter_mut() {
                    *m = S::mul(*m, self.f);
                }
                let offset = panel_offsets::<S, NR>(
                    &mx,
                    p.rv0,
                    p.rows,
                    self.states,
                    self.corr,
                    p.policy,
                    self.stats,
                );
                for (x, off) in self.neg.iter_mut().zip(&offset) {
                    *x = S::sub(*x, *off);
                }
            } else {
                let u = self.done - 1;
                let (jp, n) = (u / NR, u % NR);
                let at = self.st.add(2 * jp * panel);
                // One arm per row vector, so that the arrays' indices are constants and they
                // stay in registers.
                for i in 0..NR {
                    if i == n {
                        let lo = exp_scores::<S, CUBIC>(at.add(i * w), self.f, self.neg[i]);
                        let hi = exp_scores::<S, CUBIC>(at.add(panel + i * w), self.f, self.neg[i]);
                        self.sum[i] = S::add(S::add(self.sum[i], lo), hi);
                        S::bf16_pairs_v::<NATIVE>(lo, hi, self.pb.add(pair_dword(jp, i * w)));
                    }
                }
            }
        }
        self.done += 1;
    }

    /// After the last unit: the odd last key, P's zero pairs up to `nk32`, the row sums into
    /// the states.
    ///
    /// # Safety
    /// As [`PanelSoftmax::run`].
    #[inline(always)]
    unsafe fn finish(mut self, nk32: usize) {
        let w = S::W;
        let panel = NR * w;
        let nk = self.nk;
        // SAFETY: bounds are the caller's contract; S available.
        unsafe {
            let zero = S::splat(0.0);
            let mut jp = nk / 2;
            if nk % 2 == 1 {
                for n in 0..NR {
                    let at = self.st.add((nk - 1) * panel + n * w);
                    let lo = exp_scores::<S, CUBIC>(at, self.f, self.neg[n]);
                    self.sum[n] = S::add(self.sum[n], lo);
                    S::bf16_pairs_v::<NATIVE>(lo, zero, self.pb.add(pair_dword(jp, n * w)));
                }
                jp += 1;
            }
            while jp < nk32 / 2 {
                for n in 0..NR {
                    S::bf16_pairs_v::<NATIVE>(zero, zero, self.pb.add(pair_dword(jp, n * w)));
                }
                jp += 1;
            }
            add_panel_sums::<S, NR>(&self.sum, self.panel.rv0, self.panel.rows, self.states);
        }
    }
}

impl<S: Simd, const NR: usize, const CUBIC: bool, const NATIVE: bool> Between
    for SoftmaxUnits<'_, '_, S, NR, CUBIC, NATIVE>
{
    #[inline(always)]
    unsafe fn between(&mut self) {
        self.owed += self.units;
        while self.owed >= self.parts {
            self.owed -= self.parts;
            // SAFETY: the caller's ([`PanelSoftmax::run`]); after all `parts` parts exactly
            // `units` units are done, never more.
            unsafe { self.unit() };
        }
    }
}

/// `Oᵀ[c][r] *= corr[r]` over the panel's `dv32` channel rows.
///
/// # Safety
/// S available; `o` holds `dv32` rows of `NR·W` floats, `corr` `NR·W`.
#[inline(always)]
unsafe fn rescale<S: Simd, const NR: usize>(o: &mut [f32], corr: &[f32], dv32: usize) {
    let panel = NR * S::W;
    // SAFETY: corr holds NR·W floats (caller); S available.
    let c: [S::V; NR] = std::array::from_fn(|n| unsafe { S::load(corr.as_ptr().add(n * S::W)) });
    for ch in 0..dv32 {
        for (n, cv) in c.iter().enumerate() {
            // SAFETY: ch·panel + n·W + W ≤ dv32·panel.
            unsafe {
                let at = o.as_mut_ptr().add(ch * panel + n * S::W);
                S::store(at, S::mul(S::load(at), *cv));
            }
        }
    }
}

/// `Sᵀ = K·Qᵀ` for one panel ([`run_tile_work`]): per 32 keys, four C tiles (2 key blocks ×
/// 2 row blocks) zeroed, accumulated over the `dk/32` channel chunks (two K tiles, two Q
/// tiles, four products each) and stored at `st[j·32 + r]`.
#[derive(Clone, Copy)]
struct ScoresJob {
    /// The panel's Q tiles: row block 0's `dk/32` tiles, then row block 1's.
    q: *const u32,
    /// `nk32` K rows of `dk` bf16.
    kb: *const u16,
    /// `nk32` rows of 32 floats.
    st: *mut f32,
    /// Channels of the packed operands (`qk_parts·d32`, [`HalfKind`]).
    dk: usize,
    nk32: usize,
}

impl ScoresJob {
    fn new(q: *const u32, kb: *const u16, st: *mut f32, dk: usize, nk32: usize) -> ScoresJob {
        ScoresJob {
            q,
            kb,
            st,
            dk,
            nk32,
        }
    }

    /// Parts ([`run_tile_work`]): per 32 keys, 4 per channel chunk and 4 stores.
    fn parts(&self) -> usize {
        self.nk32 / 32 * (self.dk / STEP + 1) * 4
    }
}

/// `Oᵀ += Vᵀ·Pᵀ` for one panel ([`run_tile_work`]): per 32 channels, four C tiles (2 channel
/// blocks × 2 row blocks) loaded from `o` (or zeroed for the panel's first products),
/// accumulated over the 32-key chunks of each part of `Vᵀ` (two Vᵀ tiles, two P tiles, four
/// products each) and stored back.
#[derive(Clone, Copy)]
struct ProductsJob {
    /// `dv32` rows of `v_parts·nk32/2` dwords (`Vᵀ` pairs, part after part).
    vb: *const u32,
    /// `nk32/2` rows of 32 dwords (P pairs, B-tile layout).
    pb: *const u32,
    /// The panel's `Oᵀ`: `dv32` rows of 32 floats.
    o: *mut f32,
    dv32: usize,
    nk32: usize,
    /// bf16 parts per key of `Vᵀ` ([`HalfKind::v_parts`]), each against the same P.
    v_parts: usize,
    /// The panel's first products: the accumulators start from zero tiles, not from `o`
    /// (which holds nothing yet).
    fresh: bool,
}

impl ProductsJob {
    /// Parts ([`run_tile_work`]): per 32 channels, 4 per key chunk and part, and 4 stores.
    fn parts(&self) -> usize {
        self.dv32 / 32 * (self.v_parts * self.nk32 / STEP + 1) * 4
    }
}

/// Which panels' `Oᵀ` the products have written: the task's `Oᵀ` is not cleared up front (a
/// megabyte of stores per 2048-row task at head dim 128), so a panel's first products start
/// from zero tiles, its correction is skipped until then, and panels never written are zeroed
/// before the write-back. Tracks up to [`OPanels::MAX`] panels; a task with more (none under
/// [`AMX_TASK_ROWS`]) clears `Oᵀ` up front and counts every panel as written.
struct OPanels {
    bits: [u64; 2],
    all: bool,
}

impl OPanels {
    /// Panels tracked at most.
    const MAX: usize = 128;

    fn new(panels: usize) -> OPanels {
        OPanels {
            bits: [0; 2],
            all: panels > Self::MAX,
        }
    }

    /// Whether every panel counts as written (and `Oᵀ` must be cleared up front).
    fn all_written(&self) -> bool {
        self.all
    }

    /// Whether panel `pi`'s `Oᵀ` holds products.
    fn written(&self, pi: usize) -> bool {
        self.all || self.bits[pi / 64] >> (pi % 64) & 1 == 1
    }

    /// Marks panel `pi` written; true if this is its first write.
    fn first_write(&mut self, pi: usize) -> bool {
        if self.written(pi) {
            return false;
        }
        self.bits[pi / 64] |= 1 << (pi % 64);
        true
    }
}

/// The tile work of one pipeline step: a panel's scores, then another panel's products. Both
/// jobs use all eight tiles, so they run one after the other.
struct TileWork {
    scores: Option<ScoresJob>,
    products: Option<ProductsJob>,
}

impl TileWork {
    /// Jobs held (0 to 2).
    fn jobs(&self) -> usize {
        self.scores.is_some() as usize + self.products.is_some() as usize
    }

    /// Parts in all ([`run_tile_work`]).
    fn parts(&self) -> usize {
        self.scores.map_or(0, |j| j.parts()) + self.products.map_or(0, |j| j.parts())
    }
}

/// What runs between the parts of the tile work ([`run_tile_work`]).
trait Between {
    /// Called after each part.
    ///
    /// # Safety
    /// The implementor's.
    unsafe fn between(&mut self);
}

/// Nothing between the parts: the tile work alone.
struct Alone;

impl Between for Alone {
    #[inline(always)]
    unsafe fn between(&mut self) {}
}

/// Runs `work` on `t`, calling `b.between()` after each part: a product (after the tile
/// loads it is the first to need) or a tile store. [`TileWork::parts`] counts them.
///
/// The parts are this small because the softmax's vector work goes between them: on the
/// development VM a 2 × 2 step (4 products, ~54 ticks) and 128 FMAs (~55) cost their sum
/// back to back, while 64 FMAs hide beside it; on the GPU machine's Xeon (2 pinned cores,
/// bf16, 18 shapes × 3 rounds, alternating, geometric mean of paired ratios against main;
/// docs/history/gpu-notes.md, 2026-12-02): parts of 1 product 1.147×, 2 products
/// 1.064×, whole steps 1.032×. The loops here are fixed for a job, so the interleaving's
/// scalar cost is the loop counters and `b`'s own (an earlier version chose each part in a
/// state machine called from the softmax, ~1.5 ms of ~23 at head dim 128 on the development
/// VM).
///
/// # Safety
/// The jobs' pointers are valid as their fields say (read for `q`, `kb`, `vb`, `pb`, read and
/// written for `o`, written for `st`) and `b` touches none of the bytes the jobs write, nor
/// the tiles.
#[inline(always)]
unsafe fn run_tile_work<M: Tiles, B: Between>(t: &mut M, work: &TileWork, b: &mut B) {
    if let Some(j) = work.scores {
        let chunks = j.dk / STEP;
        for jb in (0..j.nk32).step_by(32) {
            zero_c(t);
            for cc in 0..chunks {
                // SAFETY: keys jb..jb + 32 ≤ nk32 rows of dk u16 from column cc·32 (64
                // bytes each); the Q tiles of row blocks 0 and 1, chunk cc, inside `q`; rows
                // jb..jb + 32 ≤ nk32 of 32 floats in `st`.
                unsafe {
                    let k0 = j.kb.add(jb * j.dk + cc * STEP);
                    let q0 = j.q.add(cc * TILE_DWORDS);
                    dot_2x2(
                        t,
                        (k0 as *const u8, k0.add(16 * j.dk) as *const u8, 2 * j.dk),
                        (q0 as *const u8, q0.add(chunks * TILE_DWORDS) as *const u8),
                        b,
                    );
                }
            }
            // SAFETY: as above.
            unsafe { store_c(t, j.st.add(jb * AMX_PANEL), b) };
        }
    }
    if let Some(j) = work.products {
        // Dwords per row of `Vᵀ`: the key pairs of every part.
        let row = j.v_parts * j.nk32 / 2;
        let steps = j.nk32 / STEP;
        for cb in (0..j.dv32).step_by(32) {
            // SAFETY: channel rows cb..cb + 32 ≤ dv32 of 32 floats in `o`; channel rows
            // cb..cb + 32 of `vb` (`row` dwords each) from key pair (part·steps + kc)·16 (64
            // bytes); the P tiles of chunk kc (row blocks 0 and 1) inside pb's nk32/2·32
            // dwords.
            unsafe {
                let oc = j.o.add(cb * AMX_PANEL);
                if j.fresh {
                    zero_c(t);
                } else {
                    load_c(t, oc);
                }
                for part in 0..j.v_parts {
                    for kc in 0..steps {
                        let v0 = j.vb.add(cb * row + (part * steps + kc) * 16);
                        let p0 = j.pb.add(kc * 2 * 256);
                        dot_2x2(
                            t,
                            (v0 as *const u8, v0.add(16 * row) as *const u8, 4 * row),
                            (p0 as *const u8, p0.add(256) as *const u8),
                            b,
                        );
                    }
                }
                store_c(t, oc, b);
            }
        }
    }
}

/// Tiles 0–3 ← zeros (the accumulators of a fresh 32 × 32 block).
#[inline(always)]
fn zero_c<M: Tiles>(t: &mut M) {
    t.zero::<0>();
    t.zero::<1>();
    t.zero::<2>();
    t.zero::<3>();
}

/// Tiles 0–3 ← the 32 × 32 floats at `c` (rows of [`AMX_PANEL`] floats): tiles 0 and 1 rows
/// 0..16, columns 0..16 and 16..32; tiles 2 and 3 rows 16..32.
///
/// # Safety
/// 32 rows of 32 readable floats at `c`.
#[inline(always)]
unsafe fn load_c<M: Tiles>(t: &mut M, c: *const f32) {
    let stride = 4 * AMX_PANEL;
    // SAFETY: each tile's 16 rows of 64 bytes lie inside the caller's 32 × 32 floats.
    unsafe {
        t.load::<0>(c as *const u8, stride);
        t.load::<1>(c.add(16) as *const u8, stride);
        t.load::<2>(c.add(16 * AMX_PANEL) as *const u8, stride);
        t.load::<3>(c.add(16 * AMX_PANEL + 16) as *const u8, stride);
    }
}

/// Tiles 0–3 → the 32 × 32 floats at `c` (the layout of [`load_c`]), `b` after each store.
///
/// # Safety
/// 32 rows of 32 writable floats at `c`; `b` as [`run_tile_work`] asks.
#[inline(always)]
unsafe fn store_c<M: Tiles, B: Between>(t: &mut M, c: *mut f32, b: &mut B) {
    let stride = 4 * AMX_PANEL;
    // SAFETY: each tile's 16 rows of 64 bytes lie inside the caller's 32 × 32 floats.
    unsafe {
        t.store::<0>(c as *mut u8, stride);
        b.between();
        t.store::<1>(c.add(16) as *mut u8, stride);
        b.between();
        t.store::<2>(c.add(16 * AMX_PANEL) as *mut u8, stride);
        b.between();
        t.store::<3>(c.add(16 * AMX_PANEL + 16) as *mut u8, stride);
        b.between();
    }
}

/// The 2 × 2 tile block: A tiles 4, 5 ← 16 rows of 64 bytes at `a0`, `a1` (`a_stride` bytes
/// apart), B tiles 6, 7 ← 1 KiB at `b0`, `b1`, and the products `C(2i + j) += A(4 + i)·B(6 +
/// j)` in the order (0,0), (0,1), (1,0), (1,1), each after the loads it is the first to need
/// and followed by `b`.
///
/// # Safety
/// The four tiles' bytes readable; `b` as [`run_tile_work`] asks.
#[inline(always)]
unsafe fn dot_2x2<M: Tiles, B: Between>(
    t: &mut M,
    (a0, a1, a_stride): (*const u8, *const u8, usize),
    (b0, b1): (*const u8, *const u8),
    b: &mut B,
) {
    // SAFETY: the caller's.
    unsafe {
        t.load::<4>(a0, a_stride);
        t.load::<6>(b0, 64);
        t.dot::<0, 4, 6>();
        b.between();
        t.load::<7>(b1, 64);
        t.dot::<1, 4, 7>();
        b.between();
        t.load::<5>(a1, a_stride);
        t.dot::<2, 5, 6>();
        b.between();
        t.dot::<3, 5, 7>();
        b.between();
    }
}
