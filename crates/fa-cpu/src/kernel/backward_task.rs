//! The tasks of the backward pass ([`BackwardTask`], run through [`crate::dispatch`]), with
//! recomputation: no N×N matrix is ever stored, each task rebuilds the probabilities of its
//! tiles from Q, K and the saved LSE (`P = exp2(x − lse·log2 e)`, `x` the log2-domain score of
//! `softmax-core`'s [`ScoreTransform`] factors).
//!
//! Two kinds of task, so that every gradient element has exactly one writer and the sums run
//! in an order fixed by the problem alone (never by the thread count or the schedule):
//! - [`BwdTask::KeyBlock`] (sequence, KV head, block of keys): dK and dV of its keys, summed
//!   over every query head of the GQA group and every query tile the mask lets see them, in
//!   ascending (head, query) order;
//! - [`BwdTask::QueryBlock`] (sequence, query head, block of queries): dQ of its rows, summed
//!   over the key tiles the mask leaves in ascending key order.
//!
//! A query block recomputes `S` and `dP` that a key block also computes (7 tile products in
//! all instead of 5): the price of a dQ without atomics, without per-task N-sized partial
//! buffers, and with bitwise identical results for any thread count.
//!
//! Per row `i`: `D_i = dO_i·O_i`; per visible key `j`: `dP = dO_i·V_j`,
//! `dS = P·(dP − D_i)·t'·scale` (`t' = 1 − tanh²` under a softcap, else 1), then
//! `dV_j += P·dO_i`, `dK_j += dS·Q_i`, `dQ_i += dS·K_j`. Arithmetic is f32 in plain loops
//! (compiled inside the architecture's trampoline, so element-wise loops may vectorise;
//! dot products stay sequential, so the bits do not depend on the architecture).

use super::scratch::SharedOut;
use crate::arch::Arch;
use crate::dispatch::SimdTask;
use crate::element::Element;
use softmax_core::{Problem, TileKind, LOG2_E};

/// Keys per key block and per key tile of a query block.
pub(crate) const BWD_KEYS: usize = 64;
/// Query rows per query tile of a key block and per query block.
pub(crate) const BWD_ROWS: usize = 64;

/// One unit of parallel work of the backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BwdTask {
    /// dK and dV of keys `j0..j0+len` of sequence `batch`, KV head `head_kv`.
    KeyBlock {
        /// Sequence.
        batch: usize,
        /// KV head.
        head_kv: usize,
        /// First key (within the sequence).
        j0: usize,
        /// Keys.
        len: usize,
    },
    /// dQ of queries `i0..i0+len` of sequence `batch`, query head `head`.
    QueryBlock {
        /// Sequence.
        batch: usize,
        /// Query head.
        head: usize,
        /// First query (within the sequence).
        i0: usize,
        /// Queries.
        len: usize,
    },
}

/// The tasks of a problem: every key block, then every query block, in an order that depends
/// only on the problem.
pub(crate) fn backward_tasks(p: &Problem) -> Vec<BwdTask> {
    let mut out = Vec::new();
    for batch in 0..p.batch() {
        let seq = p.seq(batch);
        for head_kv in 0..p.heads_kv() {
            for j0 in (0..seq.seqlen_k).step_by(BWD_KEYS) {
                out.push(BwdTask::KeyBlock {
                    batch,
                    head_kv,
                    j0,
                    len: BWD_KEYS.min(seq.seqlen_k - j0),
                });
            }
        }
    }
    for batch in 0..p.batch() {
        let seq = p.seq(batch);
        for head in 0..p.heads_q() {
            for i0 in (0..seq.seqlen_q).step_by(BWD_ROWS) {
                out.push(BwdTask::QueryBlock {
                    batch,
                    head,
                    i0,
                    len: BWD_ROWS.min(seq.seqlen_q - i0),
                });
            }
        }
    }
    out
}

/// What one backward task counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct BwdStats {
    /// (query tile, key tile) pairs computed.
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

/// A worker's tile buffers (f32), sized by the head dims and the tile sizes only.
#[derive(Debug, Default)]
pub(crate) struct BwdScratch {
    /// Rows of Q (or of K in a query block's key tile): `BWD_ROWS × d`.
    a: Vec<f32>,
    /// Rows of dO (or of V in a query block's key tile): `BWD_ROWS × d_v`.
    b: Vec<f32>,
    /// A key block's K (or a query block's Q): `BWD_KEYS × d`.
    own_a: Vec<f32>,
    /// A key block's V (or a query block's dO): `BWD_KEYS × d_v`.
    own_b: Vec<f32>,
    /// dK (or dQ) accumulator: `BWD_KEYS × d`.
    acc_a: Vec<f32>,
    /// dV accumulator: `BWD_KEYS × d_v`.
    acc_b: Vec<f32>,
    /// Per row: `lse·log2 e` and `D`.
    lse2: Vec<f32>,
    /// Per row: `D = dO·O`.
    delta: Vec<f32>,
    /// The probabilities of a tile, `rows × keys` (0 where hidden).
    p: Vec<f32>,
    /// `dS` of a tile (scale and softcap slope folded in), `rows × keys`.
    ds: Vec<f32>,
}

impl BwdScratch {
    /// Sizes every buffer for head dims `d` and `d_v`.
    fn ensure(&mut self, d: usize, d_v: usize) {
        let tile = BWD_ROWS.max(BWD_KEYS);
        let sizes = [
            (&mut self.a, tile * d),
            (&mut self.b, tile * d_v),
            (&mut self.own_a, tile * d),
            (&mut self.own_b, tile * d_v),
            (&mut self.acc_a, tile * d),
            (&mut self.acc_b, tile * d_v),
            (&mut self.lse2, tile),
            (&mut self.delta, tile),
            (&mut self.p, BWD_ROWS * BWD_KEYS),
            (&mut self.ds, BWD_ROWS * BWD_KEYS),
        ];
        for (buf, n) in sizes {
            if buf.len() < n {
                buf.resize(n, 0.0);
            }
        }
    }

    /// Bytes held.
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        4 * [
            &self.a,
            &self.b,
            &self.own_a,
            &self.own_b,
            &self.acc_a,
            &self.acc_b,
            &self.lse2,
            &self.delta,
            &self.p,
            &self.ds,
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>()
    }
}

/// One backward task with its worker's scratch: the [`SimdTask`] the backward dispatches.
pub(crate) struct BackwardTask<'t, 'a, T, O, G> {
    /// The call's inputs and outputs.
    pub ctx: &'t BwdCtx<'a, T, O, G>,
    /// The work.
    pub task: &'t BwdTask,
    /// The worker's scratch.
    pub scratch: &'t mut BwdScratch,
}

impl<T: Element, O: Element, G: Element> SimdTask for BackwardTask<'_, '_, T, O, G> {
    type Output = BwdStats;

    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) -> BwdStats {
        // The body is plain f32 code: nothing of A's is called, it is only compiled with A's
        // features (the trampoline), so no safety condition is used here.
        run_task(self.ctx, self.task, self.scratch)
    }
}

/// Widens `n` elements starting at `src[at]` into `dst[..n]`.
#[inline(always)]
fn widen_row<E: Element>(dst: &mut [f32], src: &[E], at: usize, n: usize) {
    for (d, s) in dst[..n].iter_mut().zip(&src[at..at + n]) {
        *d = s.to_f32();
    }
}

/// `Σ a[c]·b[c]`, in order.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        s += x * y;
    }
    s
}

/// `y += alpha·x`.
#[inline(always)]
fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

/// The score factors: `x = dot·pre` (log2 domain), or with a softcap `x = tanh(dot·pre)·post`;
/// `slope` is `scale·t'` (what turns `∂L/∂s` into `∂L/∂(q·k)`).
#[derive(Clone, Copy)]
struct Scores {
    pre: f32,
    post: Option<f32>,
    scale: f32,
}

impl Scores {
    fn new(problem: &Problem) -> Scores {
        let t = problem.score_transform::<f32>();
        Scores {
            pre: t.pre_factor(),
            post: t.softcap_post_factor(),
            scale: problem.softmax_scale(),
        }
    }

    /// `(x, scale·t'(s))` of one raw dot product.
    #[inline(always)]
    fn of(&self, dot: f32) -> (f32, f32) {
        match self.post {
            None => (dot * self.pre, self.scale),
            Some(post) => {
                let th = (dot * self.pre).tanh();
                (th * post, self.scale * (1.0 - th * th))
            }
        }
    }
}

/// Fills `p` and `ds` (`rows × BWD_KEYS`, row-major) for query rows `i0..i0+rows` of head
/// `head` against keys `j0..j0+keys`: `q` holds the rows' Q, `d_o` their dO, `k`/`v` the keys'
/// K and V (all widened), `lse2`/`delta` the rows' `lse·log2 e` and `D`. Hidden pairs and rows
/// whose LSE is −∞ get 0 in both.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tile_p_ds(
    problem: &Problem,
    batch: usize,
    scores: Scores,
    (i0, rows): (usize, usize),
    (j0, keys): (usize, usize),
    (q, d_o, k, v): (&[f32], &[f32], &[f32], &[f32]),
    (lse2, delta): (&[f32], &[f32]),
    (p, ds): (&mut [f32], &mut [f32]),
) {
    let (d, d_v) = (problem.head_dim(), problem.head_dim_v());
    let seq = problem.seq(batch);
    let mask = problem.mask();
    for r in 0..rows {
        let prow = &mut p[r * BWD_KEYS..r * BWD_KEYS + keys];
        let dsrow = &mut ds[r * BWD_KEYS..r * BWD_KEYS + keys];
        prow.iter_mut().for_each(|x| *x = 0.0);
        dsrow.iter_mut().for_each(|x| *x = 0.0);
        if lse2[r] == f32::NEG_INFINITY {
            continue; // the row sees no key: P = 0
        }
        let range = mask.key_range(i0 + r, seq.seqlen_q, seq.seqlen_k);
        let lo = range.start.max(j0) - j0;
        let hi = range.end.min(j0 + keys).max(j0) - j0;
        let qr = &q[r * d..(r + 1) * d];
        let dor = &d_o[r * d_v..(r + 1) * d_v];
        for jj in lo..hi {
            let (x, slope) = scores.of(dot(qr, &k[jj * d..(jj + 1) * d]));
            let pj = (x - lse2[r]).exp2();
            let dp = dot(dor, &v[jj * d_v..(jj + 1) * d_v]);
            prow[jj] = pj;
            dsrow[jj] = pj * (dp - delta[r]) * slope;
        }
    }
}

/// Loads query rows `i0..i0+rows` of head `head`: Q into `q`, dO into `d_o`, `lse·log2 e` into
/// `lse2` and `D = dO·O` into `delta`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn load_rows<T: Element, O: Element, G: Element>(
    ctx: &BwdCtx<'_, T, O, G>,
    batch: usize,
    head: usize,
    (i0, rows): (usize, usize),
    q: &mut [f32],
    d_o: &mut [f32],
    lse2: &mut [f32],
    delta: &mut [f32],
) {
    let p = ctx.problem;
    let (d, d_v) = (p.head_dim(), p.head_dim_v());
    for r in 0..rows {
        let i = i0 + r;
        widen_row(&mut q[r * d..], ctx.q, p.q_offset(batch, i, head), d);
        let oo = p.o_offset(batch, i, head);
        widen_row(&mut d_o[r * d_v..], ctx.d_o, oo, d_v);
        let mut dd = 0.0f32;
        for c in 0..d_v {
            dd += d_o[r * d_v + c] * ctx.o[oo + c].to_f32();
        }
        delta[r] = dd;
        let lse = ctx.lse[p.lse_offset(batch, head, i)];
        lse2[r] = if lse == f32::NEG_INFINITY {
            lse
        } else {
            lse * LOG2_E as f32
        };
    }
}

/// Runs one task.
#[inline(always)]
fn run_task<T: Element, O: Element, G: Element>(
    ctx: &BwdCtx<'_, T, O, G>,
    task: &BwdTask,
    s: &mut BwdScratch,
) -> BwdStats {
    let p = ctx.problem;
    let (d, d_v) = (p.head_dim(), p.head_dim_v());
    s.ensure(d, d_v);
    let scores = Scores::new(p);
    let mask = p.mask();
    let mut stats = BwdStats::default();
    match *task {
        BwdTask::KeyBlock {
            batch,
            head_kv,
            j0,
            len: keys,
        } => {
            let seq = p.seq(batch);
            for jj in 0..keys {
                widen_row(
                    &mut s.own_a[jj * d..],
                    ctx.k,
                    p.k_offset(batch, j0 + jj, head_kv),
                    d,
                );
                widen_row(
                    &mut s.own_b[jj * d_v..],
                    ctx.v,
                    p.v_offset(batch, j0 + jj, head_kv),
                    d_v,
                );
            }
            s.acc_a[..keys * d].iter_mut().for_each(|x| *x = 0.0);
            s.acc_b[..keys * d_v].iter_mut().for_each(|x| *x = 0.0);
            let group = p.group_size();
            for head in head_kv * group..(head_kv + 1) * group {
                for i0 in (0..seq.seqlen_q).step_by(BWD_ROWS) {
                    let rows = BWD_ROWS.min(seq.seqlen_q - i0);
                    let kind = mask.classify_tile(
                        i0..i0 + rows,
                        j0..j0 + keys,
                        seq.seqlen_q,
                        seq.seqlen_k,
                    );
                    if kind == TileKind::Empty {
                        stats.skipped += 1;
                        continue;
                    }
                    stats.computed += 1;
                    load_rows(
                        ctx,
                        batch,
                        head,
                        (i0, rows),
                        &mut s.a,
                        &mut s.b,
                        &mut s.lse2,
                        &mut s.delta,
                    );
                    tile_p_ds(
                        p,
                        batch,
                        scores,
                        (i0, rows),
                        (j0, keys),
                        (&s.a, &s.b, &s.own_a, &s.own_b),
                        (&s.lse2, &s.delta),
                        (&mut s.p, &mut s.ds),
                    );
                    for r in 0..rows {
                        let qr = &s.a[r * d..(r + 1) * d];
                        let dor = &s.b[r * d_v..(r + 1) * d_v];
                        for jj in 0..keys {
                            let pj = s.p[r * BWD_KEYS + jj];
                            if pj != 0.0 {
                                axpy(&mut s.acc_b[jj * d_v..(jj + 1) * d_v], pj, dor);
                            }
                            let dsj = s.ds[r * BWD_KEYS + jj];
                            if dsj != 0.0 {
                                axpy(&mut s.acc_a[jj * d..(jj + 1) * d], dsj, qr);
                            }
                        }
                    }
                }
            }
            for jj in 0..keys {
                let ko = p.k_offset(batch, j0 + jj, head_kv);
                for c in 0..d {
                    ctx.dk.write(ko + c, G::from_f32(s.acc_a[jj * d + c]));
                }
                let vo = p.v_offset(batch, j0 + jj, head_kv);
                for c in 0..d_v {
                    ctx.dv.write(vo + c, G::from_f32(s.acc_b[jj * d_v + c]));
                }
            }
        }
        BwdTask::QueryBlock {
            batch,
            head,
            i0,
            len: rows,
        } => {
            let seq = p.seq(batch);
            let head_kv = p.kv_head(head);
            load_rows(
                ctx,
                batch,
                head,
                (i0, rows),
                &mut s.own_a,
                &mut s.own_b,
                &mut s.lse2,
                &mut s.delta,
            );
            s.acc_a[..rows * d].iter_mut().for_each(|x| *x = 0.0);
            let tiles = mask.key_tile_range(i0..i0 + rows, BWD_KEYS, seq.seqlen_q, seq.seqlen_k);
            stats.skipped += (seq.seqlen_k.div_ceil(BWD_KEYS) - tiles.len()) as u64;
            for t in tiles {
                let j0 = t * BWD_KEYS;
                let keys = BWD_KEYS.min(seq.seqlen_k - j0);
                stats.computed += 1;
                for jj in 0..keys {
                    widen_row(
                        &mut s.a[jj * d..],
                        ctx.k,
                        p.k_offset(batch, j0 + jj, head_kv),
                        d,
                    );
                    widen_row(
                        &mut s.b[jj * d_v..],
                        ctx.v,
                        p.v_offset(batch, j0 + jj, head_kv),
                        d_v,
                    );
                }
                tile_p_ds(
                    p,
                    batch,
                    scores,
                    (i0, rows),
                    (j0, keys),
                    (&s.own_a, &s.own_b, &s.a, &s.b),
                    (&s.lse2, &s.delta),
                    (&mut s.p, &mut s.ds),
                );
                for r in 0..rows {
                    let acc = &mut s.acc_a[r * d..(r + 1) * d];
                    for jj in 0..keys {
                        let dsj = s.ds[r * BWD_KEYS + jj];
                        if dsj != 0.0 {
                            axpy(acc, dsj, &s.a[jj * d..(jj + 1) * d]);
                        }
                    }
                }
            }
            for r in 0..rows {
                let qo = p.q_offset(batch, i0 + r, head);
                for c in 0..d {
                    ctx.dq.write(qo + c, G::from_f32(s.acc_a[r * d + c]));
                }
            }
        }
    }
    stats
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_is_what_the_public_estimate_says() {
        for (d, d_v) in [(1, 1), (64, 64), (72, 40), (256, 256)] {
            let mut s = BwdScratch::default();
            s.ensure(d, d_v);
            assert_eq!(s.bytes(), crate::backward_scratch_bytes_per_thread(d, d_v));
        }
    }
}
