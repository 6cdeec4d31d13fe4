//! The bf16 and f16 backward on AMX tiles ([`AmxBackwardTask`]): the backward task's plan (one
//! task per (sequence, KV head), every gradient element with one writer, sums in an order fixed
//! by the problem alone: bitwise identical results for any thread count) with its five products on
//! tiles ([`crate::arch::amx::Tiles`]) and the element-wise step between them shared with the
//! f32 backward ([`probabilities`]: `P = exp2(x − lse·log2 e)`, `dS = P ∘ (dP − D)·scale·t'`,
//! hidden pairs 0, on AVX-512 — softmax-core's score transform and masks).
//!
//! # Blocks and layouts
//! A tile is [`AMX_BWD_ROWS`] query rows × [`AMX_BWD_KEYS`] keys; head dims are padded to
//! multiples of 32 (`d32`, `dv32`) with zeros. Every product is the one shape of [`tile_gemm`],
//! `C[m][n] (+)= Σ_k A[m][k]·B[k][n]` with `A` row-major bf16 and `B` in the pair layout
//! (`B[k/2][n]` a dword holding `B[k][n]`, `B[k+1][n]`), 2 × 2 C tiles of 16 × 16 f32. The
//! contraction order inside a 32-wide chunk is free (each `A` row and `B` column only has to
//! agree on it), so "pairs" are sometimes elements `t` and `t + 16` of a chunk instead of
//! neighbours: then both operands are a plain interleave of two rows, no 16-bit transpose.
//! - `S = Q·Kᵀ`: `A` = Q rows (`[i][c]`, bf16, packed once per task), `B` = K's channel pairs
//!   by key (`[c/2][j]`: a dword transpose of K's rows, once per key block).
//! - `dP = dO·Vᵀ`: the same with dO (rounded to bf16 when O's type is wider) and V.
//! - `P`, `dS` (f32, `[i][j]`): [`probabilities`], the f32 backward's own code.
//! - `dVᵀ += dOᵀ·P`: `A` = `dOᵀ` (`[c][i]`, rows `t`/`t+16` of each 32-row chunk paired, once per
//!   task), `B` = P's rows paired the same way ([`Simd::bf16_pairs`] of two f32 rows). The
//!   accumulator `dVᵀ[c][j]` (f32) is transposed once per key block when written.
//! - `dKᵀ += Qᵀ·dS`: the same with Q and dS.
//! - `dQ += dS·K`: `A` = dS rounded to bf16 with keys `t`/`t+16` of each 32-key chunk paired,
//!   `B` = K's rows paired the same way (`[j/2][c]`, once per key block); the accumulator (f32,
//!   the whole sequence of the group's rows) is loaded and stored per tile.
//!
//! # Error
//! Products accumulate in f32; beyond the f32 path's rounding, P and dS are rounded to bf16
//! before the three gradient products (relative 2⁻⁹ each), and for bf16 inputs dO too when O
//! is wider than bf16 (f16 inputs split dO: relative 2⁻¹⁷ for an f32 dO, exact for f16).
//! Measured against the f64 reference: see the tests (`amx_backward_tests`); the bf16 and f16
//! contract is 2e-2 normwise.
//!
//! # f16 inputs
//! f16 Q, K, V (and dO) are split exactly into two bf16 each, as the forward does
//! ([`HalfKind::F16`]): `S` and `dP` contract over three parts per channel (Q and dO packed
//! `[hi | lo | hi]`, K and V `[hi | hi | lo]`, so the sum is hi·hi + lo·hi + hi·lo, dropping
//! lo·lo ≤ 2⁻¹⁶ of each term), and each gradient product runs once per part of its input
//! operand (`dVᵀ` over dO's hi and lo, `dKᵀ` over Q's, dQ over K's), added into the same
//! accumulator. So the inputs keep their precision; the rounding beyond the SIMD path's is
//! P's and dS's, as for bf16. The tile work grows 3× for `S` and `dP`, 2× for the gradients.
//!
//! # What is not on AMX
//! This kernel takes bf16 and f16 Q, K and V (any O/dO and gradient type); f32 inputs run the
//! SIMD backward (`backward_task`). Partly masked tiles run whole (the hidden pairs are exact
//! zeros of P and dS) instead of the SIMD path's per-block spans; the SIMD path's grouping of
//! several resident key blocks per pass over the rows is not done here (one key block at a
//! time).

use super::amx_task::{bf16_bits, split_bf16, AmxInputs, HalfKind};
use super::backward_gemm::Dest;
use super::backward_task::{
    block_key_range, probabilities, row_dot, write_dq, BwdCtx, BwdStats, BwdTask, Scores, TileRows,
};
use super::pack::{prefetch_row, widen, ROW_PREFETCH_AHEAD};
use super::phase_timing::{timed, Phase};
use super::scratch::LineBuf;
use crate::arch::amx::Tiles;
use crate::arch::{Arch, Simd};
use crate::dispatch::SimdTask;
use crate::element::Element;
use softmax_core::{Problem, TileKind, LOG2_E};

/// Query rows per tile of the AMX backward (a multiple of 32). 128 rows × 128 keys against 64
/// × 64: each C tile of dK/dV (contraction over the rows) and of dQ (over the keys) is loaded
/// and stored half as often per product; on the development VM (AMX, loaded, 2 threads, B=1
/// H=8, N ∈ {1024, 2048}, D ∈ {64, 128}, causal and not, 3 alternating rounds) the backward
/// took 1.14× less time (geometric mean; 0.95–1.30 per shape, slower only at N=1024 D=128
/// causal, where the diagonal tiles waste more).
pub(crate) const AMX_BWD_ROWS: usize = 128;
/// Keys per tile of the AMX backward (a multiple of 32; see [`AMX_BWD_ROWS`]).
pub(crate) const AMX_BWD_KEYS: usize = 128;
/// bf16 elements per A-tile row: the contraction chunk of one `tdpbf16ps`.
const STEP: usize = 32;

/// `n` rounded up to a multiple of 32.
const fn pad32(n: usize) -> usize {
    n.div_ceil(STEP) * STEP
}

/// The sizes an AMX backward worker's scratch depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AmxBwdLens {
    /// Query heads per KV head.
    pub group: usize,
    /// Longest `seqlen_q` of the batch.
    pub max_seqlen_q: usize,
    /// Head dim of Q and K.
    pub head_dim: usize,
    /// Head dim of V.
    pub head_dim_v: usize,
    /// The inputs' type (f16 packs three bf16 parts per channel: [`HalfKind`]).
    pub kind: HalfKind,
}

impl AmxBwdLens {
    /// The sizes for `problem` with inputs of `kind`.
    pub fn new(problem: &Problem, kind: HalfKind) -> AmxBwdLens {
        AmxBwdLens {
            group: problem.group_size(),
            max_seqlen_q: (0..problem.batch())
                .map(|b| problem.seq(b).seqlen_q)
                .max()
                .unwrap_or(0),
            head_dim: problem.head_dim(),
            head_dim_v: problem.head_dim_v(),
            kind,
        }
    }

    /// Elements of each buffer: `[u16 buffers; 4]`, `[u32 buffers; 8]`, `[f32 buffers; 9]` in
    /// [`AmxBwdScratch`]'s field order (saturating: an absurd size fails to allocate).
    fn elems(&self) -> ([usize; 4], [usize; 8], [usize; 9]) {
        let (br, bc) = (AMX_BWD_ROWS, AMX_BWD_KEYS);
        let (d32, dv32) = (pad32(self.head_dim), pad32(self.head_dim_v));
        // The packed operands' widths: every channel as `qk_parts` bf16.
        let (dk, dvk) = (self.kind.qk_parts() * d32, self.kind.qk_parts() * dv32);
        let rows = self
            .group
            .saturating_mul(self.max_seqlen_q.div_ceil(br).max(1))
            .saturating_mul(br);
        let wide = d32.max(dv32);
        (
            [
                rows.saturating_mul(dk),  // qa
                rows.saturating_mul(dvk), // doa
                bc * dk,                  // krows
                bc * dvk,                 // vrows
            ],
            [
                rows.saturating_mul(dk / 2),    // qta
                rows.saturating_mul(dvk / 2),   // dota
                dk / 2 * bc,                    // kb
                dvk / 2 * bc,                   // vb
                bc / 2 * dk,                    // kp
                br / 2 * bc,                    // pb
                br / 2 * bc + br * bc / 2,      // dsb, dsa
                (br / 2).max(bc) * dk.max(dvk), // pairs
            ],
            [
                rows,                     // lse2
                rows,                     // delta
                rows.saturating_mul(d32), // dq
                d32 * bc,                 // dkt
                dv32 * bc,                // dvt
                br * bc,                  // s
                br * bc,                  // dp
                br * bc,                  // ds
                wide,                     // row
            ],
        )
    }

    /// Bytes of one worker's scratch: each buffer's elements and its line of slack
    /// ([`LineBuf::bytes_for`]), what [`AmxBwdScratch::try_ensure`] allocates from empty.
    pub fn bytes(&self) -> usize {
        fn sum<E>(elems: &[usize]) -> usize {
            elems.iter().fold(0usize, |acc, &n| {
                acc.saturating_add(LineBuf::<E>::bytes_for(n))
            })
        }
        let (a, b, c) = self.elems();
        sum::<u16>(&a)
            .saturating_add(sum::<u32>(&b))
            .saturating_add(sum::<f32>(&c))
    }
}

/// A worker's buffers for the AMX backward, sized by [`AmxBwdLens`] (reserved once per call,
/// typed error when that fails; reused across tasks and calls).
#[derive(Debug, Default)]
pub(crate) struct AmxBwdScratch {
    /// Per query head: Q rows as bf16 (`[i][c]`, `dk` per row: [`Geom`]): the A operand of `S`.
    qa: LineBuf<u16>,
    /// Per query head: dO rows as bf16 (`dvk` per row): the A operand of `dP`.
    doa: LineBuf<u16>,
    /// The key block's K rows as bf16 (`[j][c]`, `dk` per row, zero rows past the keys).
    krows: LineBuf<u16>,
    /// The key block's V rows as bf16 (`dvk` per row).
    vrows: LineBuf<u16>,
    /// Per query head and row block: `Qᵀ` pairs, `[c][chunk·16 + t]` = rows `(t, t + 16)` of
    /// each 32-row chunk (`dk` rows of `rows/2` dwords): the A operand of `dKᵀ`.
    qta: LineBuf<u32>,
    /// Per query head and row block: `dOᵀ` pairs, as `qta`: the A operand of `dVᵀ`.
    dota: LineBuf<u32>,
    /// K's channel pairs by key, `[c/2][j]`: the B operand of `S`.
    kb: LineBuf<u32>,
    /// V's channel pairs by key, `[c/2][j]`: the B operand of `dP`.
    vb: LineBuf<u32>,
    /// K's rows `(t, t + 16)` of each 32-key chunk paired, `[chunk·16 + t][c]`: the B operand
    /// of dQ.
    kp: LineBuf<u32>,
    /// P's rows paired as `qta`'s, `[chunk·16 + t][j]`: the B operand of `dVᵀ`.
    pb: LineBuf<u32>,
    /// dS's rows paired the same way (the B operand of `dKᵀ`), then dS with keys `(t, t + 16)`
    /// of each 32-key chunk paired, `[i][chunk·16 + t]` (the A operand of dQ).
    ds16: LineBuf<u32>,
    /// Rows on their way into a dword transpose.
    pairs: LineBuf<u32>,
    /// Per query head and row: `lse·log2 e` (`+∞` for a row that sees no key).
    lse2: LineBuf<f32>,
    /// Per query head and row: `D = dO·O`.
    delta: LineBuf<f32>,
    /// Per query head: the dQ accumulator (`[i][c]`, `d32` per row).
    dq: LineBuf<f32>,
    /// The key block's `dKᵀ` accumulator (`[c][j]`, `d32` rows of the block's keys).
    dkt: LineBuf<f32>,
    /// The key block's `dVᵀ` accumulator (`dv32` rows).
    dvt: LineBuf<f32>,
    /// `S`, then `P` (`[i][j]`).
    s: LineBuf<f32>,
    /// `dP`.
    dp: LineBuf<f32>,
    /// `dS` (f32).
    ds: LineBuf<f32>,
    /// One row of dO widened (for `D`).
    row: LineBuf<f32>,
}

impl AmxBwdScratch {
    /// Grows every buffer to `lens`, failing instead of aborting when memory runs out.
    pub fn try_ensure(
        &mut self,
        lens: &AmxBwdLens,
    ) -> Result<(), std::collections::TryReserveError> {
        let (a, b, c) = lens.elems();
        for (buf, n) in [
            &mut self.qa,
            &mut self.doa,
            &mut self.krows,
            &mut self.vrows,
        ]
        .into_iter()
        .zip(a)
        {
            buf.try_grow(n)?;
        }
        let (dsb, dsa) = (
            AMX_BWD_ROWS / 2 * AMX_BWD_KEYS,
            AMX_BWD_ROWS * AMX_BWD_KEYS / 2,
        );
        debug_assert_eq!(b[6], dsb + dsa);
        for (buf, n) in [
            &mut self.qta,
            &mut self.dota,
            &mut self.kb,
            &mut self.vb,
            &mut self.kp,
            &mut self.pb,
            &mut self.ds16,
            &mut self.pairs,
        ]
        .into_iter()
        .zip(b)
        {
            buf.try_grow(n)?;
        }
        for (buf, n) in [
            &mut self.lse2,
            &mut self.delta,
            &mut self.dq,
            &mut self.dkt,
            &mut self.dvt,
            &mut self.s,
            &mut self.dp,
            &mut self.ds,
            &mut self.row,
        ]
        .into_iter()
        .zip(c)
        {
            buf.try_grow(n)?;
        }
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        2 * (self.qa.capacity()
            + self.doa.capacity()
            + self.krows.capacity()
            + self.vrows.capacity())
            + 4 * [
                &self.qta,
                &self.dota,
                &self.kb,
                &self.vb,
                &self.kp,
                &self.pb,
                &self.ds16,
                &self.pairs,
            ]
            .iter()
            .map(|v| v.capacity())
            .sum::<usize>()
            + 4 * [
                &self.lse2,
                &self.delta,
                &self.dq,
                &self.dkt,
                &self.dvt,
                &self.s,
                &self.dp,
                &self.ds,
                &self.row,
            ]
            .iter()
            .map(|v| v.capacity())
            .sum::<usize>()
    }
}

/// One backward task on AMX tiles `M` with its worker's scratch: the [`SimdTask`] the
/// backward dispatches for bf16 and f16 inputs on [`crate::SimdLevel::Amx`] (and, in tests,
/// on emulated tiles at any level).
pub(crate) struct AmxBackwardTask<'t, 'a, T, O, G, M> {
    /// The call's inputs and outputs.
    pub ctx: &'t BwdCtx<'a, T, O, G>,
    /// Q, K, V as bf16 or f16 bits (the context's buffers).
    pub inputs: AmxInputs<'t>,
    /// The work.
    pub task: &'t BwdTask,
    /// The worker's scratch, sized by [`AmxBwdScratch::try_ensure`] for the call.
    pub scratch: &'t mut AmxBwdScratch,
    /// The tiles, configured on this thread.
    pub tiles: &'t mut M,
}

impl<T: Element, O: Element, G: Element, M: Tiles> SimdTask
    for AmxBackwardTask<'_, '_, T, O, G, M>
{
    type Output = BwdStats;

    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) -> BwdStats {
        // SAFETY: A available (the trait's contract); the context comes from the backward
        // (problem validated, buffers checked), `inputs` are its Q, K, V; the scratch was
        // sized for this problem.
        timed!(Phase::Task, unsafe {
            run_task::<A, T, O, G, M>(self.ctx, self.inputs, self.task, self.scratch, self.tiles)
        })
    }
}

/// Where f16's `lo` part goes in the packed rows of Q and dO (`[hi | lo | hi]`).
const ROW_LO: usize = 1;
/// Where f16's `lo` part goes in the packed rows of K and V (`[hi | hi | lo]`): against
/// [`ROW_LO`], the three parts of `S` and `dP` sum hi·hi + lo·hi + hi·lo.
const KEY_LO: usize = 2;

/// Per-task geometry.
#[derive(Clone, Copy)]
struct Geom {
    d: usize,
    dv: usize,
    d32: usize,
    dv32: usize,
    /// Packed width of Q's and K's rows: `kind.qk_parts()·d32` (bf16: `d32`; f16: three parts).
    dk: usize,
    /// Packed width of dO's and V's rows.
    dvk: usize,
    /// The inputs' type.
    kind: HalfKind,
    /// Rows per query head in the row buffers (`seqlen_q` rounded up to whole row blocks).
    nq_pad: usize,
    /// Row blocks per query head.
    nqb: usize,
}

/// Runs one task.
///
/// # Safety
/// S available; the context's problem validated and its buffers checked; `inputs` are the
/// context's Q, K, V; `s` sized by [`AmxBwdScratch::try_ensure`] for the problem.
#[inline(always)]
unsafe fn run_task<S: Simd, T: Element, O: Element, G: Element, M: Tiles>(
    ctx: &BwdCtx<'_, T, O, G>,
    inputs: AmxInputs<'_>,
    task: &BwdTask,
    s: &mut AmxBwdScratch,
    t: &mut M,
) -> BwdStats {
    let (br, bc) = (AMX_BWD_ROWS, AMX_BWD_KEYS);
    let p = ctx.problem;
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let seq = p.seq(task.batch);
    let (nq, nk) = (seq.seqlen_q, seq.seqlen_k);
    let nqb = nq.div_ceil(br);
    let g = Geom {
        d,
        dv,
        d32: pad32(d),
        dv32: pad32(dv),
        dk: inputs.kind.qk_parts() * pad32(d),
        dvk: inputs.kind.qk_parts() * pad32(dv),
        kind: inputs.kind,
        nq_pad: nqb * br,
        nqb,
    };
    let group = p.group_size();
    let scores = Scores::new(p);
    let mask = p.mask();
    let mut stats = BwdStats::default();

    timed!(Phase::PackRows, {
        for hl in 0..group {
            // SAFETY: S available; the scratch holds `group` heads of `nq_pad` rows.
            unsafe {
                pack_rows::<S, T, O, G>(ctx, inputs.q, task, task.head_kv * group + hl, hl, &g, s)
            };
        }
    });
    s.dq[..group * g.nq_pad * g.d32].fill(0.0);

    for j0 in (0..nk).step_by(bc) {
        let keys = bc.min(nk - j0);
        // SAFETY: S available; the key-block buffers hold one block of `bc` keys.
        timed!(Phase::PackKeys, unsafe {
            pack_keys::<S, T, O, G>(ctx, inputs, task, j0, keys, &g, s)
        });
        s.dkt[..g.d32 * bc].fill(0.0);
        s.dvt[..g.dv32 * bc].fill(0.0);
        for hl in 0..group {
            for ib in 0..nqb {
                let i0 = ib * br;
                let rows = br.min(nq - i0);
                let kind = mask.classify_tile(i0..i0 + rows, j0..j0 + keys, nq, nk);
                if kind == TileKind::Empty {
                    stats.skipped += 1;
                    continue;
                }
                stats.computed += 1;
                let range = |r: usize| block_key_range(&mask, i0 + r, nq, nk, j0, keys);
                // SAFETY: S available; the scratch is packed for this head's rows and this
                // key block.
                unsafe {
                    tile_step::<S, M>(
                        t,
                        s,
                        &g,
                        scores,
                        (hl, ib, rows),
                        keys,
                        (kind == TileKind::Partial).then_some(&range),
                    )
                };
            }
        }
        // dK, dV of the block's keys, from their transposed accumulators.
        for jj in 0..keys {
            let ko = p.k_offset(task.batch, j0 + jj, task.head_kv);
            let dk = &s.dkt[..d * bc];
            ctx.dk
                .write_row(ko, (0..d).map(|c| G::from_f32(dk[c * bc + jj])));
            let vo = p.v_offset(task.batch, j0 + jj, task.head_kv);
            let dvt = &s.dvt[..dv * bc];
            ctx.dv
                .write_row(vo, (0..dv).map(|c| G::from_f32(dvt[c * bc + jj])));
        }
    }

    timed!(
        Phase::Write,
        write_dq::<S, T, O, G>(ctx, task, g.nq_pad, g.d32, &s.dq)
    );
    stats
}

/// Packs query head `head` (the `hl`-th of the group): Q and dO rows as bf16 parts
/// ([`pack_parts`]: zeros past `d`, `dv` and past the sequence), their paired transposes per
/// row block, `lse·log2 e` and `D = dO·O` per row (pad rows: `+∞` and 0, so their `P` is 0).
///
/// # Safety
/// S available; `s` sized for the call.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_rows<S: Simd, T: Element, O: Element, G: Element>(
    ctx: &BwdCtx<'_, T, O, G>,
    q_bits: &[u16],
    task: &BwdTask,
    head: usize,
    hl: usize,
    g: &Geom,
    s: &mut AmxBwdScratch,
) {
    let p = ctx.problem;
    let nq = p.seq(task.batch).seqlen_q;
    let base = hl * g.nq_pad;
    let (d, dv, d32, dv32, dk, dvk) = (g.d, g.dv, g.d32, g.dv32, g.dk, g.dvk);
    for i in 0..g.nq_pad {
        let qrow = &mut s.qa[(base + i) * dk..(base + i + 1) * dk];
        let orow = &mut s.doa[(base + i) * dvk..(base + i + 1) * dvk];
        if i >= nq {
            qrow.fill(0);
            orow.fill(0);
            s.lse2[base + i] = f32::INFINITY;
            s.delta[base + i] = 0.0;
            continue;
        }
        let ahead = i + ROW_PREFETCH_AHEAD;
        if ahead < nq {
            prefetch_row::<S, T>(ctx.q, p.q_offset(task.batch, ahead, head), d);
            let oa = p.o_offset(task.batch, ahead, head);
            prefetch_row::<S, O>(ctx.d_o, oa, dv);
            prefetch_row::<S, O>(ctx.o, oa, dv);
        }
        let qo = p.q_offset(task.batch, i, head);
        // SAFETY: S available (caller); the offset was validated against Q.
        unsafe {
            pack_input_row::<S, T>(
                ctx.q,
                q_bits,
                qo,
                (d, d32),
                g.kind,
                ROW_LO,
                &mut s.row,
                qrow,
            )
        };
        let oo = p.o_offset(task.batch, i, head);
        let wide = &mut s.row[..dv];
        // SAFETY: S available (caller); the offset was validated against dO.
        unsafe { widen::<S, O>(ctx.d_o, oo, dv, wide) };
        pack_parts(wide, dv32, g.kind, ROW_LO, orow);
        // SAFETY: S available (caller).
        s.delta[base + i] = unsafe { row_dot::<S, O>(wide, &ctx.o[oo..oo + dv]) };
        let lse = ctx.lse[p.lse_offset(task.batch, head, i)];
        s.lse2[base + i] = if lse == f32::NEG_INFINITY {
            f32::INFINITY
        } else {
            lse * LOG2_E as f32
        };
    }
    let br = AMX_BWD_ROWS;
    for ib in 0..g.nqb {
        let r0 = base + ib * br;
        let blk = (hl * g.nqb + ib) * br / 2;
        // SAFETY: the block's rows lie in qa/doa; `pairs` holds br/2 rows of max(dk, dvk);
        // the destinations hold dk (dvk) rows of br/2 dwords at blk·dk (blk·dvk).
        unsafe {
            pair_rows_transposed::<S>(
                &s.qa[r0 * dk..(r0 + br) * dk],
                dk,
                &mut s.pairs,
                &mut s.qta[blk * dk..(blk + br / 2) * dk],
            );
            pair_rows_transposed::<S>(
                &s.doa[r0 * dvk..(r0 + br) * dvk],
                dvk,
                &mut s.pairs,
                &mut s.dota[blk * dvk..(blk + br / 2) * dvk],
            );
        }
    }
}

/// The values `x` (zeros past `x.len()` up to `w32`) as the tiles' bf16 in `out`
/// (`kind.qk_parts()·w32`): rounded to bf16 ([`HalfKind::Bf16`]: for dO wider than bf16), or
/// split exactly ([`HalfKind::F16`], [`split_bf16`]) with `lo` in part `lo_part` and `hi` in
/// the other two.
fn pack_parts(x: &[f32], w32: usize, kind: HalfKind, lo_part: usize, out: &mut [u16]) {
    let n = x.len();
    match kind {
        HalfKind::Bf16 => {
            for (o, &v) in out[..n].iter_mut().zip(x) {
                *o = bf16_bits(v) as u16;
            }
            out[n..w32].fill(0);
        }
        HalfKind::F16 => {
            let (p0, rest) = out[..3 * w32].split_at_mut(w32);
            let (p1, p2) = rest.split_at_mut(w32);
            for (c, &v) in x.iter().enumerate() {
                let (hi, lo) = split_bf16(v);
                let (hi, lo) = (hi as u16, lo as u16);
                p0[c] = hi;
                p1[c] = if lo_part == 1 { lo } else { hi };
                p2[c] = if lo_part == 2 { lo } else { hi };
            }
            for part in [p0, p1, p2] {
                part[n..].fill(0);
            }
        }
    }
}

/// Row `offset..offset + n` of the input `src` (Q, K or V; `bits` its 16-bit view) packed
/// into `out` (`kind.qk_parts()·w32` bf16): bf16 copied, f16 widened into `tmp` and split
/// ([`pack_parts`], `lo` in part `lo_part`).
///
/// # Safety
/// S available; the row lies inside `src` (= `bits`); `tmp` holds `n` floats.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_input_row<S: Simd, T: Element>(
    src: &[T],
    bits: &[u16],
    offset: usize,
    (n, w32): (usize, usize),
    kind: HalfKind,
    lo_part: usize,
    tmp: &mut [f32],
    out: &mut [u16],
) {
    match kind {
        HalfKind::Bf16 => {
            out[..n].copy_from_slice(&bits[offset..offset + n]);
            out[n..w32].fill(0);
        }
        HalfKind::F16 => {
            // SAFETY: S available, the row inside `src` (caller).
            unsafe { widen::<S, T>(src, offset, n, tmp) };
            pack_parts(&tmp[..n], w32, kind, lo_part, out);
        }
    }
}

/// `rows` (bf16, `AMX_BWD_ROWS` rows of `width` channels) into `[c][chunk·16 + t]` dwords,
/// each the pair (row `chunk·32 + t`, row `chunk·32 + 16 + t`) of channel `c`: the rows are
/// interleaved into `pairs` (`[chunk·16 + t][c]`), then transposed by dwords.
///
/// # Safety
/// S available; `rows` holds `AMX_BWD_ROWS·width`, `pairs` at least `AMX_BWD_ROWS/2·width`,
/// `dst` `width·AMX_BWD_ROWS/2`; `width` a multiple of 32.
#[inline(always)]
unsafe fn pair_rows_transposed<S: Simd>(
    rows: &[u16],
    width: usize,
    pairs: &mut [u32],
    dst: &mut [u32],
) {
    let half = AMX_BWD_ROWS / 2;
    interleave_rows(rows, width, AMX_BWD_ROWS, &mut pairs[..half * width]);
    // SAFETY: `pairs` holds half rows of `width` dwords, `dst` width rows of half; both
    // multiples of 16; S available (caller).
    unsafe { transpose_dwords::<S>(pairs.as_ptr(), width, half, width, dst.as_mut_ptr(), half) };
}

/// `out[(chunk·16 + t)·width + c] = rows[chunk·32 + t][c] | rows[chunk·32 + 16 + t][c] << 16`
/// for the `n` rows (a multiple of 32) of `width` bf16 in `rows`.
#[inline(always)]
fn interleave_rows(rows: &[u16], width: usize, n: usize, out: &mut [u32]) {
    for chunk in 0..n / STEP {
        for t in 0..16 {
            let lo = &rows[(chunk * STEP + t) * width..][..width];
            let hi = &rows[(chunk * STEP + 16 + t) * width..][..width];
            let dst = &mut out[(chunk * 16 + t) * width..][..width];
            for ((x, &l), &h) in dst.iter_mut().zip(lo).zip(hi) {
                *x = l as u32 | (h as u32) << 16;
            }
        }
    }
}

/// Packs keys `j0..j0 + keys` (zero rows up to `AMX_BWD_KEYS`): K and V rows as bf16 parts
/// ([`pack_input_row`]), their channel pairs by key (`kb`, `vb`) and K's key pairs (`kp`).
///
/// # Safety
/// S available; the context's buffers checked against its problem; `s` sized for the call.
#[inline(always)]
unsafe fn pack_keys<S: Simd, T: Element, O: Element, G: Element>(
    ctx: &BwdCtx<'_, T, O, G>,
    inputs: AmxInputs<'_>,
    task: &BwdTask,
    j0: usize,
    keys: usize,
    g: &Geom,
    s: &mut AmxBwdScratch,
) {
    let bc = AMX_BWD_KEYS;
    let p = ctx.problem;
    let (d, dv, d32, dv32, dk, dvk) = (g.d, g.dv, g.d32, g.dv32, g.dk, g.dvk);
    for jj in 0..bc {
        let krow = &mut s.krows[jj * dk..(jj + 1) * dk];
        let vrow = &mut s.vrows[jj * dvk..(jj + 1) * dvk];
        if jj >= keys {
            krow.fill(0);
            vrow.fill(0);
            continue;
        }
        if jj + ROW_PREFETCH_AHEAD < keys {
            let ja = j0 + jj + ROW_PREFETCH_AHEAD;
            prefetch_row::<S, T>(ctx.k, p.k_offset(task.batch, ja, task.head_kv), d);
            prefetch_row::<S, T>(ctx.v, p.v_offset(task.batch, ja, task.head_kv), dv);
        }
        let (kind, tmp) = (g.kind, &mut s.row);
        let ko = p.k_offset(task.batch, j0 + jj, task.head_kv);
        let vo = p.v_offset(task.batch, j0 + jj, task.head_kv);
        // SAFETY: S available (caller); the offsets were validated against K and V.
        unsafe {
            pack_input_row::<S, T>(ctx.k, inputs.k, ko, (d, d32), kind, KEY_LO, tmp, krow);
            pack_input_row::<S, T>(ctx.v, inputs.v, vo, (dv, dv32), kind, KEY_LO, tmp, vrow);
        }
    }
    // Channel pairs by key: the rows' dwords (`[j][c/2]`) transposed.
    for (rows, width, dst) in [(&s.krows, dk, &mut s.kb), (&s.vrows, dvk, &mut s.vb)] {
        let half = width / 2;
        let pairs = &mut s.pairs[..bc * half];
        for (x, pair) in pairs.iter_mut().zip(rows[..bc * width].chunks_exact(2)) {
            *x = pair[0] as u32 | (pair[1] as u32) << 16;
        }
        // SAFETY: `pairs` holds bc rows of half dwords, `dst` half rows of bc; multiples of
        // 16; S available (caller).
        unsafe { transpose_dwords::<S>(pairs.as_ptr(), half, bc, half, dst.as_mut_ptr(), bc) };
    }
    interleave_rows(&s.krows, dk, bc, &mut s.kp[..bc / 2 * dk]);
}

/// One (row block, key block) tile of query head `hl`: `S` and `dP` on tiles, `P` and `dS` by
/// [`probabilities`], the three gradient products on tiles.
///
/// # Safety
/// S available; `s` sized for the call and packed for this head's rows and this key block.
#[inline(always)]
unsafe fn tile_step<S: Simd, M: Tiles>(
    t: &mut M,
    s: &mut AmxBwdScratch,
    g: &Geom,
    scores: Scores,
    (hl, ib, rows): (usize, usize, usize),
    keys: usize,
    range: Option<&dyn Fn(usize) -> (usize, usize)>,
) {
    let (br, bc) = (AMX_BWD_ROWS, AMX_BWD_KEYS);
    let (d32, dv32, dk, dvk) = (g.d32, g.dv32, g.dk, g.dvk);
    // The gradient products take one side's bf16 parts one at a time: hi, and f16's lo.
    let (row_parts, key_parts): (&[usize], &[usize]) = match g.kind {
        HalfKind::Bf16 => (&[0], &[0]),
        HalfKind::F16 => (&[0, ROW_LO], &[0, KEY_LO]),
    };
    let row0 = hl * g.nq_pad + ib * br;
    let blk = (hl * g.nqb + ib) * br / 2;
    // SAFETY: every operand below lies inside its buffer (sizes: `AmxBwdLens::elems`): the
    // row block's rows `row0..row0 + br` of qa/doa/dq, its paired transposes at blk·dk
    // (blk·dvk) with each part's d32 (dv32) rows at part·d32·br/2 inside, the key block's
    // packs (a part of kp: columns part·d32.. of rows of dk), the tile buffers of br × bc.
    unsafe {
        // S = Q·Kᵀ, dP = dO·Vᵀ.
        timed!(
            Phase::S,
            tile_gemm(
                t,
                TileOperand::rows(s.qa.as_ptr().add(row0 * dk), dk),
                TileOperand::rows(s.kb.as_ptr(), bc),
                Dest::overwrite(s.s.as_mut_ptr(), bc),
                (br, bc, dk),
            )
        );
        timed!(
            Phase::DP,
            tile_gemm(
                t,
                TileOperand::rows(s.doa.as_ptr().add(row0 * dvk), dvk),
                TileOperand::rows(s.vb.as_ptr(), bc),
                Dest::overwrite(s.dp.as_mut_ptr(), bc),
                (br, bc, dvk),
            )
        );
        let probs_start = phase_start();
        probabilities::<S>(
            TileRows {
                p: &mut s.s[..br * bc],
                dp: &s.dp[..br * bc],
                ds: &mut s.ds[..br * bc],
                stride: bc,
                lse2: &s.lse2[row0..row0 + br],
                delta: &s.delta[row0..row0 + br],
            },
            (rows, br),
            (keys, bc),
            scores,
            range,
        );
        phase_end(Phase::Probs, probs_start);
        // P and dS rounded to bf16: rows paired for dVᵀ and dKᵀ, keys paired for dQ (counted
        // as the phase `dS_T`, the SIMD path's transpose of dS).
        let pairs_start = phase_start();
        let (dsb, dsa) = s.ds16.split_at_mut(br / 2 * bc);
        pair_f32_rows::<S>(&s.s, bc, &mut s.pb);
        pair_f32_rows::<S>(&s.ds, bc, dsb);
        for r in 0..br {
            for c0 in (0..bc).step_by(STEP) {
                let src = s.ds.as_ptr().add(r * bc + c0);
                let dst = dsa.as_mut_ptr().add(r * bc / 2 + c0 / 2);
                for v in (0..16).step_by(S::W) {
                    S::bf16_pairs(src.add(v), src.add(16 + v), dst.add(v));
                }
            }
        }
        phase_end(Phase::DsT, pairs_start);
        // dVᵀ += dOᵀ·P, dKᵀ += Qᵀ·dS (sums over this block's rows): the A operands are
        // bf16 pairs (rows of `br` bf16; part `part` of dO's and Q's packed channels), the B
        // operands rows of `bc` dwords.
        for &part in row_parts {
            timed!(
                Phase::DV,
                tile_gemm(
                    t,
                    TileOperand::rows(
                        s.dota.as_ptr().add(blk * dvk + part * dv32 * br / 2),
                        br / 2
                    ),
                    TileOperand::rows(s.pb.as_ptr(), bc),
                    Dest::add_to(s.dvt.as_mut_ptr(), bc),
                    (dv32, bc, br),
                )
            );
            timed!(
                Phase::DK,
                tile_gemm(
                    t,
                    TileOperand::rows(s.qta.as_ptr().add(blk * dk + part * d32 * br / 2), br / 2),
                    TileOperand::rows(dsb.as_ptr(), bc),
                    Dest::add_to(s.dkt.as_mut_ptr(), bc),
                    (d32, bc, br),
                )
            );
        }
        // dQ += dS·K (sums over this block's keys; part `part` of K's packed channels).
        for &part in key_parts {
            timed!(
                Phase::DQ,
                tile_gemm(
                    t,
                    TileOperand::rows(dsa.as_ptr(), bc / 2),
                    TileOperand::rows(s.kp.as_ptr().add(part * d32), dk),
                    Dest::add_to(s.dq.as_mut_ptr().add(row0 * d32), d32),
                    (br, d32, bc),
                )
            );
        }
    }
}

/// The f32 rows of a tile (`AMX_BWD_ROWS` rows of `width`) rounded to bf16 and paired as
/// [`interleave_rows`] pairs bf16 rows: `out[(chunk·16 + t)·width + j]` = (row `chunk·32 + t`,
/// row `chunk·32 + 16 + t`) of column `j`.
///
/// # Safety
/// S available; `x` holds `AMX_BWD_ROWS·width` floats, `out` `AMX_BWD_ROWS/2·width` dwords;
/// `width` a multiple of `S::W`.
#[inline(always)]
unsafe fn pair_f32_rows<S: Simd>(x: &[f32], width: usize, out: &mut [u32]) {
    assert!(x.len() >= AMX_BWD_ROWS * width && out.len() >= AMX_BWD_ROWS / 2 * width);
    for chunk in 0..AMX_BWD_ROWS / STEP {
        for t in 0..16 {
            let lo = x[(chunk * STEP + t) * width..].as_ptr();
            let hi = x[(chunk * STEP + 16 + t) * width..].as_ptr();
            let dst = out[(chunk * 16 + t) * width..].as_mut_ptr();
            for j in (0..width).step_by(S::W) {
                // SAFETY: j + W ≤ width inside each row (asserted lengths); S available.
                unsafe { S::bf16_pairs(lo.add(j), hi.add(j), dst.add(j)) };
            }
        }
    }
}

/// `dst[c·dst_stride + r] = src[r·src_stride + c]` for `r < rows`, `c < cols` (multiples of
/// 16), dwords moved unchanged: 16 × 16 blocks through the architecture's float transposes
/// where its width divides 16 and is at least 8 (loads, shuffles and stores: bits unchanged),
/// else dword by dword.
///
/// # Safety
/// `src` readable for `rows` rows of stride `src_stride` (`cols` used), `dst` writable for
/// `cols` rows of stride `dst_stride` (`rows` used), not overlapping; S available.
#[inline(always)]
unsafe fn transpose_dwords<S: Simd>(
    src: *const u32,
    src_stride: usize,
    rows: usize,
    cols: usize,
    dst: *mut u32,
    dst_stride: usize,
) {
    debug_assert!(rows.is_multiple_of(16) && cols.is_multiple_of(16));
    for r0 in (0..rows).step_by(16) {
        for c0 in (0..cols).step_by(16) {
            // SAFETY: the 16 × 16 block (r0, c0) lies inside both regions (caller).
            unsafe {
                let (s0, d0) = (src.add(r0 * src_stride + c0), dst.add(c0 * dst_stride + r0));
                if S::W >= 8 && 16 % S::W == 0 {
                    for rr in (0..16).step_by(S::W) {
                        for cc in (0..16).step_by(S::W) {
                            S::transpose(
                                s0.add(rr * src_stride + cc) as *const f32,
                                src_stride,
                                d0.add(cc * dst_stride + rr) as *mut f32,
                                dst_stride,
                            );
                        }
                    }
                } else {
                    for r in 0..16 {
                        for c in 0..16 {
                            *d0.add(c * dst_stride + r) = *s0.add(r * src_stride + c);
                        }
                    }
                }
            }
        }
    }
}

/// One operand of [`tile_gemm`]: the start of its first row and the bytes between rows.
#[derive(Clone, Copy)]
struct TileOperand {
    start: *const u8,
    stride: usize,
}

impl TileOperand {
    /// Rows of `row_len` elements of `E` from `start` (bf16 rows of an `A`, dword rows of a
    /// `B`'s pair layout, or bf16 pairs as dwords).
    fn rows<E>(start: *const E, row_len: usize) -> TileOperand {
        TileOperand {
            start: start as *const u8,
            stride: row_len * std::mem::size_of::<E>(),
        }
    }
}

/// `C (+)= A·B` on tiles: `C` is `m × n` f32 (`dest`: overwritten, or added to when
/// `dest.accumulate`), `A` `m × k` bf16 row-major, `B` the pair layout of a `k × n` matrix
/// (`k/2` rows of `n` dwords); `m`, `n`, `k` multiples of 32. Per 32 × 32 block of C, four C
/// tiles (loaded when accumulating, else zeroed) over the `k/32` chunks, in order, then
/// stored: the sums' order is fixed by the shapes alone.
///
/// # Safety
/// The three regions are valid for the shapes (C writable, `A`/`B` readable); tile numbers
/// and pointers as [`Tiles`] requires.
#[inline(always)]
unsafe fn tile_gemm<M: Tiles>(
    t: &mut M,
    a: TileOperand,
    b: TileOperand,
    dest: Dest,
    (m, n, k): (usize, usize, usize),
) {
    let (a, a_stride, b, b_stride) = (a.start, a.stride, b.start, b.stride);
    let (c, c_stride) = (dest.c, dest.c_stride);
    let cs = 4 * c_stride;
    for m0 in (0..m).step_by(32) {
        for n0 in (0..n).step_by(32) {
            // SAFETY: rows m0..m0 + 32 ≤ m and columns n0..n0 + 32 ≤ n of C; rows m0.. of A
            // and the chunk's bytes; rows k0/2..k0/2 + 16 of B, columns n0.. (caller).
            unsafe {
                let c0 = c.add(m0 * c_stride + n0);
                if dest.accumulate {
                    t.load::<0>(c0 as *const u8, cs);
                    t.load::<1>(c0.add(16) as *const u8, cs);
                    t.load::<2>(c0.add(16 * c_stride) as *const u8, cs);
                    t.load::<3>(c0.add(16 * c_stride + 16) as *const u8, cs);
                } else {
                    t.zero::<0>();
                    t.zero::<1>();
                    t.zero::<2>();
                    t.zero::<3>();
                }
                for k0 in (0..k).step_by(STEP) {
                    let a0 = a.add(m0 * a_stride + 2 * k0);
                    t.load::<4>(a0, a_stride);
                    t.load::<5>(a0.add(16 * a_stride), a_stride);
                    let b0 = b.add(k0 / 2 * b_stride + 4 * n0);
                    t.load::<6>(b0, b_stride);
                    t.load::<7>(b0.add(64), b_stride);
                    t.dot::<0, 4, 6>();
                    t.dot::<1, 4, 7>();
                    t.dot::<2, 5, 6>();
                    t.dot::<3, 5, 7>();
                }
                t.store::<0>(c0 as *mut u8, cs);
                t.store::<1>(c0.add(16) as *mut u8, cs);
                t.store::<2>(c0.add(16 * c_stride) as *mut u8, cs);
                t.store::<3>(c0.add(16 * c_stride + 16) as *mut u8, cs);
            }
        }
    }
}

/// The start of a phase that `timed!` cannot wrap (it spans statements): an instant with the
/// feature `phase-timing`, nothing without.
#[inline(always)]
fn phase_start() -> PhaseStart {
    #[cfg(feature = "phase-timing")]
    return std::time::Instant::now();
    #[cfg(not(feature = "phase-timing"))]
    PhaseStart
}

/// What [`phase_start`] returns.
#[cfg(feature = "phase-timing")]
type PhaseStart = std::time::Instant;
/// What [`phase_start`] returns (nothing to record without the feature).
#[cfg(not(feature = "phase-timing"))]
#[derive(Clone, Copy)]
struct PhaseStart;

/// Adds the time since `start` to `phase` (with the feature `phase-timing`).
#[inline(always)]
fn phase_end(phase: Phase, start: PhaseStart) {
    #[cfg(feature = "phase-timing")]
    super::phase_timing::add(phase, start.elapsed());
    #[cfg(not(feature = "phase-timing"))]
    let _ = (phase, start);
}
