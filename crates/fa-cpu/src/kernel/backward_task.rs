//! The tasks of the backward pass ([`BackwardTask`], run through [`crate::dispatch`]), with
//! recomputation: no N×N matrix is ever stored, each tile's probabilities are rebuilt from Q,
//! K and the saved LSE (`P = exp2(x − lse·log2 e)`, `x` the log2-domain score of
//! `softmax-core`'s [`ScoreTransform`](softmax_core::ScoreTransform) factors).
//!
//! # One task per (sequence, KV head)
//! A task owns every gradient element of its sequence and KV head: dK and dV of its keys
//! (summed over the query heads of the GQA group) and dQ of the group's query rows. So each
//! element has one writer and its sums run in an order fixed by the problem and the
//! architecture alone: **bitwise identical results for any thread count**, no atomics, and
//! only the five products of the textbook backward (no recomputed `S`/`dP` for a separate dQ
//! pass). The price is memory linear in the sequence: the task keeps its rows of Q and dO
//! (row-major, and where a tile may take [`gemm`]'s path also transposed per row block: on
//! AVX2 and scalar always, on AVX-512 only under a mask, see [`blocked_tiles`]) and a dQ
//! accumulator in f32 for the whole sequence.
//!
//! # The loop
//! The rows of every query head of the group are packed once per task. Then, per group of up
//! to eight blocks of `tile` keys ([`resident_key_tiles`]: K and V packed, dK/dV accumulators
//! zeroed, about 768 KiB in all), per query head, per block of `tile` rows, per key block of
//! the group, each tile the mask leaves visible (the group lets a block of rows, which for
//! long sequences comes from beyond L2, serve several key blocks while it is in cache; every
//! sum keeps the order it has with one key block at a time):
//! 1. `S = Q·Kᵀ` and `dP = dO·Vᵀ` (fresh tiles),
//! 2. `P = exp2(x(S) − lse·log2 e)`, `dS = P ∘ (dP − D) · scale·t'` (`t' = 1 − tanh²` under a
//!    softcap, else 1), hidden pairs 0 (`softmax-core`'s `Mask::key_range`),
//! 3. `dV += Pᵀ·dO`, `dK += dSᵀ·Q`, `dQ += dS·K`.
//!
//! `D = dO·O` per row is one chain of A's multiply-adds in channel order, as each `dP` element
//! is in the product: where a row's softmax is one-hot (one visible key), `O = V_j` exactly and
//! `dP_j − D = 0` exactly, so `dS`, dQ and dK are exactly 0 as in exact arithmetic. (A plain
//! sum against the fused `dP` left a residue there of ~1e-5 normwise against an all-zero
//! reference: the error of the proptest's regression cases, which was not the softcap's.)
//!
//! Every product is the one register-blocked shape of [`super::backward_gemm::gemm`]:
//! `C[m][n] += Σ_k B[k][m]·X[k][n]`, with the contraction index as the row index of both
//! operands. That fixes the layouts: `Qᵀ`/`dOᵀ` (per block `[c][row]`) and `Kᵀ`/`Vᵀ`
//! (`[c][key]`) for `S` and `dP`; `P`, `dS` (`[row][key]`) with row-major dO and Q for dV and
//! dK; `dSᵀ` (`[key][row]`, one tile transpose) with row-major K for dQ.
//!
//! On AVX-512 (32 vector registers) a tile no mask narrows runs every product through
//! [`gemm_wide`] instead: 6 × 4-vector blocks (a 64-wide tile in one panel, 24 accumulators),
//! its broadcast side readable in either orientation, so `S` and `dP` read the Q and dO rows in
//! place (no `Qᵀ`/`dOᵀ` blocks are packed when the problem has no mask), dQ reads `dS` in place
//! (no `dSᵀ`), and `P`/`dS` are computed in `dP`'s block epilogue ([`ProbsSink`]: `dP` never
//! reaches memory). Each element is the same chain of multiply-adds as on the [`gemm`] path,
//! so the gradients are bitwise the same either way.

use super::backward_gemm::{
    gemm, gemm_wide, gemm_wide_into, Dest, Operands, Span, WideOperands, WideSink,
};
use super::pack::{prefetch_row, transpose_region, widen, ROW_PREFETCH_AHEAD};
use super::phase_timing::{timed, Phase};
use super::scratch::SharedOut;
use crate::arch::{exp2_exact, tanh, Arch, Simd, SimdLevel};
use crate::dispatch::{with_arch, ArchFn, Entry, SimdTask};
use crate::element::Element;
use softmax_core::{Mask, Problem, TileKind, LOG2_E};

/// Floats per cache line: row strides are multiples of it, so that from the 64-byte aligned
/// buffers no vector access crosses a line (the forward measured that every other AVX2 access
/// did from a 16-byte aligned start).
const LINE: usize = 16;

/// The tile edge for micro-kernels of `mr` broadcasts and `w` lanes (`w` divides [`LINE`]):
/// the smallest multiple of `mr` and of a cache line that is at least 64, so no product needs
/// a row or column tail and every tile row is whole lines (AVX-512 64, AVX2 96, scalar 64).
pub(crate) const fn bwd_tile(mr: usize, w: usize) -> usize {
    let lcm = lcm_unit(mr, if w > LINE { w } else { LINE });
    64usize.div_ceil(lcm) * lcm
}

/// The row stride for rows of `n` floats: whole lines, an odd number of them. An even count
/// (a power of two at the usual sizes: 64 or 128 floats) would put every row of a tile into a
/// fraction of the L1 sets, so that the operands of a product evict each other.
const fn odd_lines(n: usize) -> usize {
    let lines = n.div_ceil(LINE);
    (if lines.is_multiple_of(2) {
        lines + 1
    } else {
        lines
    }) * LINE
}

/// How many key tiles a task keeps packed at once (each with its dK/dV accumulators): the
/// rows of Q, dO and dQ, which are larger than L2 for long sequences, then stream from memory
/// once per group of key tiles instead of once per key tile. About 768 KiB of key-side buffers
/// (K, V, Kᵀ, Vᵀ, dK, dV: six tiles of `tile × head_dim` floats per key tile), 1 to 8 tiles.
/// The sums run in the same order whatever the count: it changes no result.
const fn resident_key_tiles(tile: usize, d: usize, dv: usize) -> usize {
    let wide = if d > dv { d } else { dv };
    let per_tile = 6 * 4 * tile * odd_lines(wide);
    let n = (768 * 1024) / per_tile;
    if n < 1 {
        1
    } else if n > 8 {
        8
    } else {
        n
    }
}

/// `n` rounded up to a multiple of `m`.
const fn round_up(n: usize, m: usize) -> usize {
    n.div_ceil(m) * m
}

/// One unit of parallel work of the backward pass: every gradient of sequence `batch` and KV
/// head `head_kv` (dK, dV of its keys; dQ of the query heads of its group).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BwdTask {
    /// Sequence.
    pub batch: usize,
    /// KV head.
    pub head_kv: usize,
}

/// The tasks of a problem, the longest sequences first (better balance; the order never
/// changes a result, since each task owns what it writes).
pub(crate) fn backward_tasks(p: &Problem) -> Vec<BwdTask> {
    let mut out = Vec::with_capacity(p.batch() * p.heads_kv());
    for batch in 0..p.batch() {
        for head_kv in 0..p.heads_kv() {
            out.push(BwdTask { batch, head_kv });
        }
    }
    let work = |t: &BwdTask| {
        let s = p.seq(t.batch);
        s.seqlen_q.saturating_mul(s.seqlen_k)
    };
    out.sort_by_key(|t| std::cmp::Reverse(work(t)));
    out
}

/// What one backward task counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct BwdStats {
    /// (query tile, key tile) pairs computed (per query head).
    pub computed: u64,
    /// (query tile, key tile) pairs skipped because the mask hides them.
    pub skipped: u64,
}

impl BwdStats {
    /// Adds another task's counts.
    pub fn add(self, other: BwdStats) -> BwdStats {
        BwdStats {
            computed: self.computed + other.computed,
            skipped: self.skipped + other.skipped,
        }
    }
}

/// Everything a backward task reads and writes, shared by all tasks of a call.
pub(crate) struct BwdCtx<'a, T, O, G> {
    /// The validated problem (buffers checked against it).
    pub problem: &'a Problem<'a>,
    /// Q.
    pub q: &'a [T],
    /// K.
    pub k: &'a [T],
    /// V.
    pub v: &'a [T],
    /// The forward's output O (O's layout).
    pub o: &'a [O],
    /// The output's gradient dO (O's layout).
    pub d_o: &'a [O],
    /// The forward's natural-log LSE.
    pub lse: &'a [f32],
    /// dQ (Q's layout).
    pub dq: SharedOut<G>,
    /// dK (K's layout).
    pub dk: SharedOut<G>,
    /// dV (V's layout).
    pub dv: SharedOut<G>,
}

/// The sizes a worker's scratch depends on: the architecture's tile and lanes, the problem's
/// head dims, group size and longest query sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BwdLens {
    /// Tile edge ([`bwd_tile`]).
    pub tile: usize,
    /// Lanes per vector.
    pub lanes: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// Longest `seqlen_q` of the batch.
    pub max_seqlen_q: usize,
    /// Head dim of Q and K.
    pub head_dim: usize,
    /// Head dim of V.
    pub head_dim_v: usize,
    /// Whether a tile may take [`gemm`]'s path ([`blocked_tiles`]): only then are the buffers
    /// that path alone uses (the per-block `Qᵀ`/`dOᵀ`, `dP`, `dSᵀ`) given memory.
    pub blocked_tiles: bool,
}

impl BwdLens {
    /// The sizes for `problem` on the architecture of `level`.
    pub fn new(problem: &Problem, level: SimdLevel) -> BwdLens {
        /// Reads an architecture's tile and lanes.
        struct Geometry;
        impl ArchFn for Geometry {
            type Output = (usize, usize);
            fn call<A: Entry>(self) -> (usize, usize) {
                (bwd_tile(A::PV_CHANNELS, A::W), A::W)
            }
        }
        let (tile, lanes) = with_arch(level, Geometry);
        BwdLens {
            tile,
            lanes,
            group: problem.group_size(),
            max_seqlen_q: (0..problem.batch())
                .map(|b| problem.seq(b).seqlen_q)
                .max()
                .unwrap_or(0),
            head_dim: problem.head_dim(),
            head_dim_v: problem.head_dim_v(),
            blocked_tiles: blocked_tiles(lanes, &problem.mask()),
        }
    }

    /// Elements of each scratch buffer, in [`BwdScratch::buffers`]' order (saturating: an
    /// absurd size fails to allocate instead of wrapping).
    fn elems(&self) -> [usize; 17] {
        let t = self.tile;
        let ts = odd_lines(t);
        let (d, dv) = (self.head_dim, self.head_dim_v);
        let (d_st, dv_st) = (odd_lines(d), odd_lines(dv));
        let kb = resident_key_tiles(t, d, dv);
        let blocks = self
            .group
            .saturating_mul(self.max_seqlen_q.div_ceil(t).max(1));
        let rows = blocks.saturating_mul(t);
        // The buffers of gemm's path alone: none when every tile is wide.
        let (block_cols, blocked_tile) = if self.blocked_tiles {
            (blocks.saturating_mul(ts), t * ts)
        } else {
            (0, 0)
        };
        [
            block_cols.saturating_mul(d),  // qt
            block_cols.saturating_mul(dv), // dot
            rows.saturating_mul(d_st),     // qr
            rows.saturating_mul(dv_st),    // dor
            rows.saturating_mul(d_st),     // dq
            rows,                          // lse2
            rows,                          // delta
            kb * d * ts,                   // kt
            kb * dv * ts,                  // vt
            kb * t * d_st,                 // kr
            kb * t * dv_st,                // vr
            kb * t * d_st,                 // dk
            kb * t * dv_st,                // dv
            t * ts,                        // p
            blocked_tile,                  // dp
            t * ts,                        // ds
            blocked_tile,                  // dst
        ]
    }

    /// Bytes of one worker's scratch.
    pub fn bytes(&self) -> usize {
        self.elems()
            .iter()
            .fold(0usize, |a, &n| a.saturating_add(n).saturating_add(LINE))
            .saturating_mul(4)
    }
}

/// A buffer whose contents start on a 64-byte boundary (it keeps [`LINE`] floats of slack):
/// with row strides of whole lines, no vector access of the products crosses a cache line.
#[derive(Debug, Default)]
pub(crate) struct Aligned {
    data: Vec<f32>,
    offset: usize,
    len: usize,
}

impl Aligned {
    /// Grows to `n` aligned floats (zeros), failing instead of aborting.
    fn try_grow(&mut self, n: usize) -> Result<(), std::collections::TryReserveError> {
        if self.len >= n {
            return Ok(());
        }
        let whole = n.saturating_add(LINE);
        if self.data.len() < whole {
            self.data.try_reserve_exact(whole - self.data.len())?;
            self.data.resize(whole, 0.0);
        }
        self.offset = self.data.as_ptr().align_offset(4 * LINE).min(LINE);
        self.len = n;
        Ok(())
    }

    /// Bytes held.
    fn bytes(&self) -> usize {
        4 * self.data.len()
    }
}

impl std::ops::Deref for Aligned {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.data[self.offset..self.offset + self.len]
    }
}

impl std::ops::DerefMut for Aligned {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.data[self.offset..self.offset + self.len]
    }
}

/// A worker's buffers (f32), sized by [`BwdLens`]: reserved once per call (typed error when
/// that fails) and reused across tasks and calls.
#[derive(Debug, Default)]
pub(crate) struct BwdScratch {
    /// Per query head and row block: `Qᵀ` `[c][row]` (`d × tile`).
    qt: Aligned,
    /// Per query head and row block: `dOᵀ` (`d_v × tile`).
    dot: Aligned,
    /// Per query head: Q rows, `d` padded to whole vectors (zeros).
    qr: Aligned,
    /// Per query head: dO rows, `d_v` padded.
    dor: Aligned,
    /// Per query head: the dQ accumulator (rows of `d` padded).
    dq: Aligned,
    /// Per query head and row: `lse·log2 e` (`+∞` for a row that sees no key, so `P = 0`).
    lse2: Aligned,
    /// Per query head and row: `D = dO·O`.
    delta: Aligned,
    /// Per resident key block ([`resident_key_tiles`]): `Kᵀ` (`d × tile`).
    kt: Aligned,
    /// Per resident key block: `Vᵀ` (`d_v × tile`).
    vt: Aligned,
    /// Per resident key block: K rows (`tile × d` padded).
    kr: Aligned,
    /// Per resident key block: V rows (`tile × d_v` padded).
    vr: Aligned,
    /// Per resident key block: the dK accumulator.
    dk: Aligned,
    /// Per resident key block: the dV accumulator.
    dv: Aligned,
    /// `S`, then `P` (`[row][key]`).
    p: Aligned,
    /// `dP` (`[row][key]`; [`gemm`]'s path only: the wide path fuses it away).
    dp: Aligned,
    /// `dS` (`[row][key]`).
    ds: Aligned,
    /// `dSᵀ` (`[key][row]`; [`gemm`]'s path only: the wide path reads `dS` in place).
    dst: Aligned,
}

impl BwdScratch {
    /// The buffers, in [`BwdLens::elems`]' order.
    fn buffers(&mut self) -> [&mut Aligned; 17] {
        [
            &mut self.qt,
            &mut self.dot,
            &mut self.qr,
            &mut self.dor,
            &mut self.dq,
            &mut self.lse2,
            &mut self.delta,
            &mut self.kt,
            &mut self.vt,
            &mut self.kr,
            &mut self.vr,
            &mut self.dk,
            &mut self.dv,
            &mut self.p,
            &mut self.dp,
            &mut self.ds,
            &mut self.dst,
        ]
    }

    /// Grows every buffer to `lens` (zeros), failing instead of aborting when memory runs out.
    pub fn try_ensure(&mut self, lens: &BwdLens) -> Result<(), std::collections::TryReserveError> {
        for (buf, n) in self.buffers().into_iter().zip(lens.elems()) {
            buf.try_grow(n)?;
        }
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&mut self) -> usize {
        self.buffers().iter().map(|v| v.bytes()).sum::<usize>()
    }
}

/// One backward task with its worker's scratch: the [`SimdTask`] the backward dispatches.
pub(crate) struct BackwardTask<'t, 'a, T, O, G> {
    /// The call's inputs and outputs.
    pub ctx: &'t BwdCtx<'a, T, O, G>,
    /// The work.
    pub task: &'t BwdTask,
    /// The worker's scratch, already sized by [`BwdScratch::try_ensure`] for the call.
    pub scratch: &'t mut BwdScratch,
}

impl<T: Element, O: Element, G: Element> SimdTask for BackwardTask<'_, '_, T, O, G> {
    type Output = BwdStats;

    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) -> BwdStats {
        // SAFETY: A's features are present and PV/NR are A's sizes (the trait's contract).
        timed!(Phase::Task, unsafe {
            run_task::<A, NR, PV, T, O, G>(self.ctx, self.task, self.scratch)
        })
    }
}

/// The score factors: `x = s·pre` (log2 domain), or with a softcap `x = tanh(s·pre)·post`;
/// `scale` turns `∂L/∂x`-side slopes into `∂L/∂(q·k)`.
#[derive(Clone, Copy)]
pub(crate) struct Scores {
    pre: f32,
    post: Option<f32>,
    scale: f32,
}

impl Scores {
    /// The factors of `problem`'s score transform and scale.
    pub(crate) fn new(problem: &Problem) -> Scores {
        let t = problem.score_transform::<f32>();
        Scores {
            pre: t.pre_factor(),
            post: t.softcap_post_factor(),
            scale: problem.softmax_scale(),
        }
    }
}

/// Per-call geometry of a task, in floats.
#[derive(Clone, Copy)]
struct Geom {
    tile: usize,
    d: usize,
    dv: usize,
    d_pad: usize,
    dv_pad: usize,
    /// Row strides of the rows of `d_pad` and `dv_pad` floats ([`odd_lines`]).
    d_st: usize,
    dv_st: usize,
    /// Row stride of the tile-wide buffers (`S`, `dP`, `dS`, `dSᵀ`, `Kᵀ`, `Vᵀ`, the `Qᵀ` and
    /// `dOᵀ` blocks).
    ts: usize,
    /// Rows per query head in the row buffers (`seqlen_q` rounded up to whole tiles).
    nq_pad: usize,
    /// Row blocks per query head.
    nqb: usize,
}

impl Geom {
    /// Offset of resident key block `u` in `Kᵀ`.
    fn kt_at(&self, u: usize) -> usize {
        u * self.d * self.ts
    }
    /// Offset of resident key block `u` in `Vᵀ`.
    fn vt_at(&self, u: usize) -> usize {
        u * self.dv * self.ts
    }
    /// Offset of resident key block `u` in the K rows and the dK accumulator.
    fn kr_at(&self, u: usize) -> usize {
        u * self.tile * self.d_st
    }
    /// Offset of resident key block `u` in the V rows and the dV accumulator.
    fn vr_at(&self, u: usize) -> usize {
        u * self.tile * self.dv_st
    }
}

/// Runs one task.
///
/// # Safety
/// A's features are present; `MR` and `NR` are A's `PV_CHANNELS` and `ROW_VECTORS`; `s` was
/// sized by [`BwdScratch::try_ensure`] for this problem and A.
#[inline(always)]
pub(crate) unsafe fn run_task<
    A: Arch,
    const NR: usize,
    const MR: usize,
    T: Element,
    O: Element,
    G: Element,
>(
    ctx: &BwdCtx<'_, T, O, G>,
    task: &BwdTask,
    s: &mut BwdScratch,
) -> BwdStats {
    let p = ctx.problem;
    let w = A::W;
    let tile = bwd_tile(MR, w);
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let seq = p.seq(task.batch);
    let (nq, nk) = (seq.seqlen_q, seq.seqlen_k);
    let nqb = nq.div_ceil(tile);
    let g = Geom {
        tile,
        d,
        dv,
        d_pad: round_up(d, LINE),
        dv_pad: round_up(dv, LINE),
        d_st: odd_lines(d),
        dv_st: odd_lines(dv),
        ts: odd_lines(tile),
        nq_pad: nqb * tile,
        nqb,
    };
    let group = p.group_size();
    let scores = Scores::new(p);
    let mask = p.mask();
    let mut stats = BwdStats::default();

    // SAFETY: every pointer below indexes a scratch buffer within the sizes of
    // `BwdLens::elems` for this problem (`try_ensure` ran), per the layouts documented on the
    // buffers; A's features are present.
    unsafe {
        timed!(Phase::PackRows, {
            for hl in 0..group {
                pack_rows::<A, T, O, G>(ctx, task, task.head_kv * group + hl, hl, &g, s);
            }
        });
        s.dq[..group * g.nq_pad * g.d_st].fill(0.0);

        let kb = resident_key_tiles(tile, d, dv);
        for jb in (0..nk).step_by(tile * kb) {
            // The key blocks `jb + u·tile` for u < blocks, packed and zeroed together; then
            // each row block meets all of them while its rows are in cache. Every sum keeps
            // its order: dK/dV of a key block over (head, row block), dQ of a row block over
            // ascending key blocks.
            let blocks = (nk - jb).div_ceil(tile).min(kb);
            for u in 0..blocks {
                let j0 = jb + u * tile;
                let keys = tile.min(nk - j0);
                timed!(Phase::PackKeys, {
                    pack_keys::<A, T, O, G>(ctx, task, j0, keys, u, &g, s)
                });
                s.dk[g.kr_at(u)..g.kr_at(u + 1)].fill(0.0);
                s.dv[g.vr_at(u)..g.vr_at(u + 1)].fill(0.0);
            }
            for hl in 0..group {
                for ib in 0..nqb {
                    let i0 = ib * tile;
                    let rows = tile.min(nq - i0);
                    for u in 0..blocks {
                        let j0 = jb + u * tile;
                        let keys = tile.min(nk - j0);
                        let kind = mask.classify_tile(i0..i0 + rows, j0..j0 + keys, nq, nk);
                        if kind == TileKind::Empty {
                            stats.skipped += 1;
                            continue;
                        }
                        stats.computed += 1;
                        let range = |r: usize| block_key_range(&mask, i0 + r, nq, nk, j0, keys);
                        tile_step::<A, NR, MR>(
                            s,
                            &g,
                            scores,
                            (hl, ib, rows),
                            (keys, u),
                            (kind == TileKind::Partial).then_some(&range),
                        );
                    }
                }
            }
            timed!(
                Phase::Write,
                for jj in 0..nk.min(jb + blocks * tile) - jb {
                    if jj + ROW_PREFETCH_AHEAD < nk - jb {
                        let ja = jb + jj + ROW_PREFETCH_AHEAD;
                        ctx.dk
                            .prefetch_row::<A>(p.k_offset(task.batch, ja, task.head_kv), d);
                        ctx.dv
                            .prefetch_row::<A>(p.v_offset(task.batch, ja, task.head_kv), dv);
                    }
                    let (u, ju) = (jj / tile, jj % tile);
                    let ko = p.k_offset(task.batch, jb + jj, task.head_kv);
                    let at = g.kr_at(u) + ju * g.d_st;
                    let row = &s.dk[at..at + d];
                    ctx.dk.write_row(ko, row.iter().map(|&x| G::from_f32(x)));
                    let vo = p.v_offset(task.batch, jb + jj, task.head_kv);
                    let at = g.vr_at(u) + ju * g.dv_st;
                    let row = &s.dv[at..at + dv];
                    ctx.dv.write_row(vo, row.iter().map(|&x| G::from_f32(x)));
                }
            );
        }

        timed!(
            Phase::Write,
            write_dq::<A, T, O, G>(ctx, task, g.nq_pad, g.d_st, &s.dq)
        );
    }
    stats
}

/// Writes dQ of the task's rows (rounded to `G`) from the f32 accumulator `dq`: per query head
/// of the group `nq_pad` rows of `stride` floats, the first `head_dim` of each used. Both
/// backward kernels' last step.
#[inline(always)]
pub(crate) fn write_dq<S: Simd, T, O, G: Element>(
    ctx: &BwdCtx<'_, T, O, G>,
    task: &BwdTask,
    nq_pad: usize,
    stride: usize,
    dq: &[f32],
) {
    let p = ctx.problem;
    let (d, group) = (p.head_dim(), p.group_size());
    let nq = p.seq(task.batch).seqlen_q;
    for hl in 0..group {
        let head = task.head_kv * group + hl;
        for i in 0..nq {
            if i + ROW_PREFETCH_AHEAD < nq {
                let qa = p.q_offset(task.batch, i + ROW_PREFETCH_AHEAD, head);
                ctx.dq.prefetch_row::<S>(qa, d);
            }
            let qo = p.q_offset(task.batch, i, head);
            let at = (hl * nq_pad + i) * stride;
            let row = &dq[at..at + d];
            ctx.dq.write_row(qo, row.iter().map(|&x| G::from_f32(x)));
        }
    }
}

/// Packs query head `head` (the `hl`-th of the group): Q and dO rows (widened, padded with
/// zeros to whole vectors and whole tiles), their per-block transposes, `lse·log2 e` and
/// `D = dO·O` per row (pad rows: `+∞` and 0, so their `P` is 0).
///
/// # Safety
/// A's features are present; `s` sized for the call.
#[inline(always)]
unsafe fn pack_rows<A: Arch, T: Element, O: Element, G: Element>(
    ctx: &BwdCtx<'_, T, O, G>,
    task: &BwdTask,
    head: usize,
    hl: usize,
    g: &Geom,
    s: &mut BwdScratch,
) {
    let p = ctx.problem;
    let nq = p.seq(task.batch).seqlen_q;
    let base = hl * g.nq_pad;
    for i in 0..g.nq_pad {
        let qrow = &mut s.qr[(base + i) * g.d_st..(base + i) * g.d_st + g.d_pad];
        let orow = &mut s.dor[(base + i) * g.dv_st..(base + i) * g.dv_st + g.dv_pad];
        if i >= nq {
            qrow.fill(0.0);
            orow.fill(0.0);
            s.lse2[base + i] = f32::INFINITY;
            s.delta[base + i] = 0.0;
            continue;
        }
        // Rows of one head are a head stride apart (a page each, past the prefetchers' reach).
        let ahead = i + ROW_PREFETCH_AHEAD;
        if ahead < nq {
            prefetch_row::<A, T>(ctx.q, p.q_offset(task.batch, ahead, head), g.d);
            let oa = p.o_offset(task.batch, ahead, head);
            prefetch_row::<A, O>(ctx.d_o, oa, g.dv);
            prefetch_row::<A, O>(ctx.o, oa, g.dv);
        }
        // SAFETY: A available (caller); offsets validated against the buffers.
        unsafe {
            widen::<A, T>(ctx.q, p.q_offset(task.batch, i, head), g.d, qrow);
            let oo = p.o_offset(task.batch, i, head);
            widen::<A, O>(ctx.d_o, oo, g.dv, orow);
            qrow[g.d..].fill(0.0);
            orow[g.dv..].fill(0.0);
            s.delta[base + i] = row_dot::<A, O>(&orow[..g.dv], &ctx.o[oo..oo + g.dv]);
        }
        let lse = ctx.lse[p.lse_offset(task.batch, head, i)];
        s.lse2[base + i] = if lse == f32::NEG_INFINITY {
            f32::INFINITY
        } else {
            lse * LOG2_E as f32
        };
    }
    for ib in (0..g.nqb).filter(|_| blocked_tiles(A::W, &p.mask())) {
        let r0 = base + ib * g.tile;
        let blk = (hl * g.nqb + ib) * g.ts;
        // SAFETY: a tile of rows of the padded row buffers into its `[c][row]` block.
        unsafe {
            transpose_region::<A>(
                s.qr.as_ptr().add(r0 * g.d_st),
                g.d_st,
                g.tile,
                g.d,
                s.qt.as_mut_ptr().add(blk * g.d),
                g.ts,
            );
            transpose_region::<A>(
                s.dor.as_ptr().add(r0 * g.dv_st),
                g.dv_st,
                g.tile,
                g.dv,
                s.dot.as_mut_ptr().add(blk * g.dv),
                g.ts,
            );
        }
    }
}

/// Query `i`'s visible keys within the key block `j0..j0 + keys`, relative to `j0` (an empty
/// range, `lo == hi`, when the row sees none of them): the per-row bounds of a tile step.
#[inline(always)]
pub(crate) fn block_key_range(
    mask: &Mask,
    i: usize,
    nq: usize,
    nk: usize,
    j0: usize,
    keys: usize,
) -> (usize, usize) {
    let kr = mask.key_range(i, nq, nk);
    let lo = kr.start.clamp(j0, j0 + keys) - j0;
    let hi = kr.end.clamp(j0, j0 + keys) - j0;
    (lo, hi.max(lo))
}

/// `Σ x·o`, one sum in element order with A's multiply-add (fused where A fuses), the very
/// arithmetic of `dP = dO·Vᵀ` in [`gemm`] (a chain from 0 in channel order): a row whose
/// softmax is one-hot has `O = V_j` exactly, so `dP_j − D` is exactly 0 as in exact arithmetic.
///
/// # Safety
/// A's features are present.
#[inline(always)]
pub(crate) unsafe fn row_dot<A: Simd, O: Element>(x: &[f32], o: &[O]) -> f32 {
    // SAFETY: A available (caller); `lane` holds W ≥ 1 floats.
    unsafe {
        let mut acc = A::splat(0.0);
        for (xv, ov) in x.iter().zip(o) {
            acc = A::fma(A::splat(*xv), A::splat(ov.to_f32()), acc);
        }
        let mut lane = [0.0f32; 16];
        A::store(lane.as_mut_ptr(), acc);
        lane[0]
    }
}

/// Packs keys `j0..j0+keys` into resident key block `u`: K and V rows (widened, padded with
/// zero rows and columns) and their transposes.
///
/// # Safety
/// A's features are present; `s` sized for the call.
#[inline(always)]
unsafe fn pack_keys<A: Arch, T: Element, O: Element, G: Element>(
    ctx: &BwdCtx<'_, T, O, G>,
    task: &BwdTask,
    j0: usize,
    keys: usize,
    u: usize,
    g: &Geom,
    s: &mut BwdScratch,
) {
    let p = ctx.problem;
    let (kr0, vr0) = (g.kr_at(u), g.vr_at(u));
    for jj in 0..g.tile {
        let krow = &mut s.kr[kr0 + jj * g.d_st..kr0 + jj * g.d_st + g.d_pad];
        let vrow = &mut s.vr[vr0 + jj * g.dv_st..vr0 + jj * g.dv_st + g.dv_pad];
        if jj >= keys {
            krow.fill(0.0);
            vrow.fill(0.0);
            continue;
        }
        if jj + ROW_PREFETCH_AHEAD < keys {
            let ja = j0 + jj + ROW_PREFETCH_AHEAD;
            prefetch_row::<A, T>(ctx.k, p.k_offset(task.batch, ja, task.head_kv), g.d);
            prefetch_row::<A, T>(ctx.v, p.v_offset(task.batch, ja, task.head_kv), g.dv);
        }
        // SAFETY: A available (caller); offsets validated against the buffers.
        unsafe {
            widen::<A, T>(
                ctx.k,
                p.k_offset(task.batch, j0 + jj, task.head_kv),
                g.d,
                krow,
            );
            widen::<A, T>(
                ctx.v,
                p.v_offset(task.batch, j0 + jj, task.head_kv),
                g.dv,
                vrow,
            );
        }
        krow[g.d..].fill(0.0);
        vrow[g.dv..].fill(0.0);
    }
    // SAFETY: the whole padded tile of rows into `[c][key]`.
    unsafe {
        transpose_region::<A>(
            s.kr.as_ptr().add(kr0),
            g.d_st,
            g.tile,
            g.d,
            s.kt.as_mut_ptr().add(g.kt_at(u)),
            g.ts,
        );
        transpose_region::<A>(
            s.vr.as_ptr().add(vr0),
            g.dv_st,
            g.tile,
            g.dv,
            s.vt.as_mut_ptr().add(g.vt_at(u)),
            g.ts,
        );
    }
}

/// One (query block, key block) tile of query head `hl`, against resident key block `u`: the
/// five products and the element-wise step between them. `range(r)` gives row `r`'s visible
/// keys within the block for a partly hidden tile (`None`: the tile is fully visible).
///
/// # Safety
/// A's features are present; `MR`/`NR` are A's; `s` sized for the call and packed for this
/// head, row block and key block.
#[inline(always)]
unsafe fn tile_step<A: Arch, const NR: usize, const MR: usize>(
    s: &mut BwdScratch,
    g: &Geom,
    scores: Scores,
    (hl, ib, rows): (usize, usize, usize),
    (keys, u): (usize, usize),
    range: Option<&dyn Fn(usize) -> (usize, usize)>,
) {
    let t = g.tile;
    let ts = g.ts;
    // Rows and key columns rounded up to whole micro-kernel blocks and vectors (≤ tile).
    let rc = round_up(rows, lcm_unit(MR, A::W)).min(t);
    let kc = round_up(keys, lcm_unit(MR, A::W)).min(t);
    let blk = (hl * g.nqb + ib) * ts;
    let row0 = hl * g.nq_pad + ib * t;
    // A partly hidden tile: per block of MR rows or MR keys, what the products need (the
    // diagonal tiles of a causal mask then cost about half).
    let spans = range.map(|f| MaskSpans::new::<MR>(f, rows, rc, kc));
    let sp = spans.as_ref();
    // The tile's one choice of path: every product on `gemm_wide` (AVX-512, no spans), which
    // reads the Q, dO and dS rows in place and fuses P/dS onto dP, or every product on `gemm`
    // (with the spans), through the `Qᵀ`/`dOᵀ` blocks, a stored dP and dSᵀ.
    let wide = sp.is_none() && has_wide(A::W);
    // SAFETY: every block below lies inside its buffer (sizes: `BwdLens::elems`, whose
    // gemm-only buffers exist whenever a tile can be `!wide`; rc, kc ≤ tile).
    unsafe {
        let (qr, dor) = (
            s.qr.as_ptr().add(row0 * g.d_st),
            s.dor.as_ptr().add(row0 * g.dv_st),
        );
        let (kt, vt) = (s.kt.as_ptr().add(g.kt_at(u)), s.vt.as_ptr().add(g.vt_at(u)));
        // S = Q·Kᵀ: Q's rows read in place (`B[c][row]` as `[row][c]`) or its `Qᵀ` block.
        let q_ops = if wide {
            Operands::new(qr, g.d_st, kt, ts).b_transposed()
        } else {
            Operands::new(s.qt.as_ptr().add(blk * g.d), ts, kt, ts).into()
        };
        timed!(
            Phase::S,
            product::<A, MR, NR>(
                wide,
                q_ops,
                g.d,
                rc,
                kc,
                Dest::overwrite(s.p.as_mut_ptr(), ts),
                sp.map(|m| &m.row_n[..]),
            )
        );
        // dP = dO·Vᵀ, then P and dS.
        if wide {
            // The element-wise step fused onto dP's blocks (dP never stored), then the zeros
            // `probabilities` gives rows past `rows` and keys past `keys`.
            timed!(
                Phase::DP,
                gemm_wide_into::<A, _>(
                    Operands::new(dor, g.dv_st, vt, ts).b_transposed(),
                    g.dv,
                    rc,
                    kc,
                    &ProbsSink {
                        p: s.p.as_mut_ptr(),
                        ds: s.ds.as_mut_ptr(),
                        stride: ts,
                        lse2: s.lse2.as_ptr().add(row0),
                        delta: s.delta.as_ptr().add(row0),
                        scores,
                    },
                )
            );
            for r in 0..rc {
                let from = if r < rows { keys } else { 0 };
                s.p[r * ts + from..r * ts + kc].fill(0.0);
                s.ds[r * ts + from..r * ts + kc].fill(0.0);
            }
        } else {
            timed!(
                Phase::DP,
                gemm::<A, MR, NR>(
                    Operands::new(s.dot.as_ptr().add(blk * g.dv), ts, vt, ts),
                    g.dv,
                    rc,
                    kc,
                    Dest::overwrite(s.dp.as_mut_ptr(), ts),
                    sp.map(|m| &m.row_n[..]),
                )
            );
            timed!(
                Phase::Probs,
                probabilities::<A>(
                    TileRows {
                        p: &mut s.p[..],
                        dp: &s.dp[..],
                        ds: &mut s.ds[..],
                        stride: ts,
                        lse2: &s.lse2[row0..],
                        delta: &s.delta[row0..],
                    },
                    (rows, rc),
                    (keys, kc),
                    scores,
                    range
                )
            );
        }
        // dV += Pᵀ·dO, dK += dSᵀ·Q (sums over this block's rows, in order).
        timed!(
            Phase::DV,
            product::<A, MR, NR>(
                wide,
                Operands::new(s.p.as_ptr(), ts, dor, g.dv_st).into(),
                rows,
                kc,
                g.dv_pad,
                Dest::add_to(s.dv.as_mut_ptr().add(g.vr_at(u)), g.dv_st),
                sp.map(|m| &m.key_k[..]),
            )
        );
        timed!(
            Phase::DK,
            product::<A, MR, NR>(
                wide,
                Operands::new(s.ds.as_ptr(), ts, qr, g.d_st).into(),
                rows,
                kc,
                g.d_pad,
                Dest::add_to(s.dk.as_mut_ptr().add(g.kr_at(u)), g.d_st),
                sp.map(|m| &m.key_k[..]),
            )
        );
        // dQ += dS·K (the contraction runs over keys): dS read in place as `B[key][row]`, or
        // through dSᵀ. The same chains either way.
        let kr = s.kr.as_ptr().add(g.kr_at(u));
        let ds_ops = if wide {
            Operands::new(s.ds.as_ptr(), ts, kr, g.d_st).b_transposed()
        } else {
            timed!(
                Phase::DsT,
                transpose_region::<A>(s.ds.as_ptr(), ts, rc, keys, s.dst.as_mut_ptr(), ts)
            );
            Operands::new(s.dst.as_ptr(), ts, kr, g.d_st).into()
        };
        timed!(
            Phase::DQ,
            product::<A, MR, NR>(
                wide,
                ds_ops,
                keys,
                rc,
                g.d_pad,
                Dest::add_to(s.dq.as_mut_ptr().add(row0 * g.d_st), g.d_st),
                sp.map(|m| &m.row_k[..]),
            )
        );
    }
}

/// One product of a tile on the tile's path: [`gemm_wide`]'s 6 × 4 blocks when `wide` (no
/// spans; `B` in either orientation), else [`gemm`]'s `MR × NR` blocks (`B` as `[k][m]` rows,
/// `ops.b_m == 1`) narrowed by `spans`. Both give every element the same chain of
/// multiply-adds (ascending contraction), so the path changes no result bit.
///
/// # Safety
/// As [`gemm`] (as [`gemm_wide`] when `wide`); `rows` a multiple of `MR` and of 2.
#[inline(always)]
unsafe fn product<A: Arch, const MR: usize, const NR: usize>(
    wide: bool,
    ops: WideOperands,
    nk: usize,
    rows: usize,
    cols: usize,
    dest: Dest,
    spans: Option<&[Span]>,
) {
    // SAFETY: the caller's bounds, which both shapes share.
    unsafe {
        if wide {
            gemm_wide::<A>(ops, nk, rows, cols, dest)
        } else {
            debug_assert_eq!(ops.b_m, 1, "gemm reads B as [k][m] rows");
            let ops = Operands::new(ops.b, ops.b_k, ops.x, ops.x_stride);
            gemm::<A, MR, NR>(ops, nk, rows, cols, dest, spans)
        }
    }
}

/// Whether an architecture of `lanes`-wide vectors runs [`gemm_wide`] on the tiles no mask
/// narrows: its 6 × 4-vector blocks (24 accumulators) want AVX-512's 32 vector registers.
const fn has_wide(lanes: usize) -> bool {
    lanes == 16
}

/// Whether a tile of a problem under `mask` may take [`gemm`]'s path on `lanes`-wide vectors:
/// then the buffers only that path reads (the per-block `Qᵀ`/`dOᵀ`, `dP`, `dSᵀ`) are needed.
/// Where A [`has_wide`] and there is no mask, every tile is full, so every product is
/// [`gemm_wide`]'s.
fn blocked_tiles(lanes: usize, mask: &Mask) -> bool {
    !(has_wide(lanes) && mask.is_none())
}

/// The largest tile edge [`MaskSpans`] holds (every architecture's [`bwd_tile`] is at most 96).
const MAX_TILE: usize = 128;

/// The [`Span`]s of a partly hidden tile, from each row's visible keys: per block of `MR` rows,
/// the keys any of them sees (the columns of `S` and `dP`, the contraction of dQ); per block of
/// `MR` keys, the rows that see any of them (the contraction of dV and dK). Everything outside
/// is an exact zero of `P` and `dS`.
struct MaskSpans {
    /// `S`, `dP`: columns per row block.
    row_n: [Span; MAX_TILE],
    /// dQ: contraction (keys) per row block.
    row_k: [Span; MAX_TILE],
    /// dV, dK: contraction (rows) per key block.
    key_k: [Span; MAX_TILE],
}

impl MaskSpans {
    /// The spans of rows `< rows` (of `rc`, rounded) against key columns `< kc`, row `r` seeing
    /// keys `range(r)`.
    fn new<const MR: usize>(
        range: &dyn Fn(usize) -> (usize, usize),
        rows: usize,
        rc: usize,
        kc: usize,
    ) -> MaskSpans {
        assert!(rc <= MAX_TILE && kc <= MAX_TILE);
        let mut seen = [(0usize, 0usize); MAX_TILE];
        for (r, x) in seen.iter_mut().enumerate().take(rows) {
            *x = range(r);
        }
        let seen = &seen[..rows];
        let mut out = MaskSpans {
            row_n: [Span::ALL; MAX_TILE],
            row_k: [Span::ALL; MAX_TILE],
            key_k: [Span::ALL; MAX_TILE],
        };
        for (bi, r0) in (0..rc).step_by(MR).enumerate() {
            let (lo, hi) = seen
                .iter()
                .take((r0 + MR).min(rows))
                .skip(r0)
                .filter(|(l, h)| l < h)
                .fold((usize::MAX, 0), |(a, b), &(l, h)| (a.min(l), b.max(h)));
            let keys = if lo < hi { (lo, hi) } else { (0, 0) };
            out.row_n[bi].n = keys;
            out.row_k[bi].k = keys;
        }
        for (bi, j0) in (0..kc).step_by(MR).enumerate() {
            let sees = |&(_, &(l, h)): &(usize, &(usize, usize))| l < h && l < j0 + MR && h > j0;
            let first = seen.iter().enumerate().find(sees).map(|(r, _)| r);
            let last = seen.iter().enumerate().rfind(sees).map(|(r, _)| r + 1);
            out.key_k[bi].k = (first.unwrap_or(0), last.unwrap_or(0));
        }
        out
    }
}

/// The least common multiple of `mr` and `w`: rows and key columns are rounded up to it.
const fn lcm_unit(mr: usize, w: usize) -> usize {
    let (mut a, mut b) = (mr, w);
    while b != 0 {
        let t = a % b;
        a = b;
        b = t;
    }
    mr / a * w
}

/// One tile's buffers for [`probabilities`], all `[row][key]` with row stride `stride`: `p`
/// holds `S` (becomes `P`), `dp` holds `dP`, `ds` receives `dS`; `lse2` and `delta` are the
/// tile's rows' `lse·log2 e` and `D` (from its first row).
pub(crate) struct TileRows<'s> {
    /// `S` in, `P` out.
    pub p: &'s mut [f32],
    /// `dP`.
    pub dp: &'s [f32],
    /// `dS` out.
    pub ds: &'s mut [f32],
    /// Row stride of `p`, `dp` and `ds` (floats).
    pub stride: usize,
    /// Per row: `lse·log2 e` (`+∞` for a row that sees no key).
    pub lse2: &'s [f32],
    /// Per row: `D = dO·O`.
    pub delta: &'s [f32],
}

/// The element-wise step of a tile, in place (the one both backward kernels use, the f32
/// SIMD tiles and the bf16 AMX tiles): `p` holds `S` and becomes `P`, `ds` gets
/// `dS = P·(dP − D)·scale·t'`, for rows `< rows` and key columns `< kc`; rows `rows..rc` are
/// zeroed; hidden pairs (outside `range(r)`, or past `keys`) get 0 in both.
///
/// # Safety
/// A's features are present; `rc`, `kc` ≤ `stride`, multiples of W; the buffers hold `rc`
/// rows of `stride` (the last one `kc` at least), `lse2`/`delta` `rows` values.
#[inline(always)]
pub(crate) unsafe fn probabilities<A: Simd>(
    tile: TileRows<'_>,
    (rows, rc): (usize, usize),
    (keys, kc): (usize, usize),
    scores: Scores,
    range: Option<&dyn Fn(usize) -> (usize, usize)>,
) {
    let w = A::W;
    let t = tile.stride;
    for r in 0..rc {
        let prow = &mut tile.p[r * t..r * t + kc];
        let dsrow = &mut tile.ds[r * t..r * t + kc];
        if r >= rows {
            prow.fill(0.0);
            dsrow.fill(0.0);
            continue;
        }
        let dprow = &tile.dp[r * t..r * t + kc];
        let lse2 = tile.lse2[r];
        let delta = tile.delta[r];
        // SAFETY: c + W ≤ kc (a multiple of W) in every row slice; A available.
        unsafe {
            let (lse2v, deltav) = (A::splat(lse2), A::splat(delta));
            let mut c = 0;
            while c < kc {
                let (pv, dsv) = prob_vec::<A>(
                    A::load(prow.as_ptr().add(c)),
                    A::load(dprow.as_ptr().add(c)),
                    (lse2v, deltav),
                    scores,
                );
                A::store(prow.as_mut_ptr().add(c), pv);
                A::store(dsrow.as_mut_ptr().add(c), dsv);
                c += w;
            }
        }
        let (lo, hi) = match range {
            Some(f) => f(r),
            None => (0, keys),
        };
        if lo > 0 || hi < kc {
            prow[..lo].fill(0.0);
            dsrow[..lo].fill(0.0);
            prow[hi..].fill(0.0);
            dsrow[hi..].fill(0.0);
        }
    }
}

/// One vector of the element-wise step: from scores `s` and `dP` of one row (its
/// `lse·log2 e` and `D` splat), `(P, dS)`: `P = exp2(x(s) − lse·log2 e)`,
/// `dS = P·(dP − D)·scale·t'`.
///
/// # Safety
/// A's features are present.
#[inline(always)]
unsafe fn prob_vec<A: Simd>(
    s: A::V,
    dp: A::V,
    (lse2, delta): (A::V, A::V),
    scores: Scores,
) -> (A::V, A::V) {
    // SAFETY: A available (caller).
    unsafe {
        let (pre, scale) = (A::splat(scores.pre), A::splat(scores.scale));
        let sv = A::mul(s, pre);
        let (x, slope) = match scores.post {
            None => (sv, scale),
            Some(post) => {
                let th = tanh::<A>(sv);
                let one = A::splat(1.0);
                (
                    A::mul(th, A::splat(post)),
                    A::mul(scale, A::sub(one, A::mul(th, th))),
                )
            }
        };
        let pv = exp2_exact::<A>(A::sub(x, lse2));
        (pv, A::mul(A::mul(pv, A::sub(dp, delta)), slope))
    }
}

/// The sink that fuses the element-wise step onto `dP = dO·Vᵀ` ([`gemm_wide_into`]): each
/// finished block of `dP` never reaches memory; with `S` at `p` it becomes `P` (over `S`) and
/// `dS` at `ds`, exactly as [`probabilities`] computes them from a stored `dP` (the same
/// [`prob_vec`] on the same values).
struct ProbsSink {
    /// `S` in, `P` out (`[row][key]`, row stride `stride`).
    p: *mut f32,
    /// `dS` out.
    ds: *mut f32,
    /// Row stride of `p` and `ds`.
    stride: usize,
    /// Per row: `lse·log2 e`.
    lse2: *const f32,
    /// Per row: `D`.
    delta: *const f32,
    /// The score factors.
    scores: Scores,
}

impl WideSink for ProbsSink {
    #[inline(always)]
    unsafe fn finish<S: Simd, const MR: usize, const NR: usize>(
        &self,
        acc: &[[S::V; NR]; MR],
        m0: usize,
        n0: usize,
    ) {
        // SAFETY: the block's rows and columns lie inside the tile buffers and their rows
        // inside `lse2`/`delta` (caller).
        unsafe {
            for (m, row) in acc.iter().enumerate() {
                let r = m0 + m;
                let lse_delta = (S::splat(*self.lse2.add(r)), S::splat(*self.delta.add(r)));
                for (n, &dp) in row.iter().enumerate() {
                    let at = r * self.stride + n0 + n * S::W;
                    let (pv, dsv) =
                        prob_vec::<S>(S::load(self.p.add(at)), dp, lse_delta, self.scores);
                    S::store(self.p.add(at), pv);
                    S::store(self.ds.add(at), dsv);
                }
            }
        }
    }
}
