//! The one tile product of the backward pass: `C[m][n] (+)= Σ_k B[k][m]·X[k][n]`, built from
//! the forward's rank-1 step ([`rank1_update`]): `B` supplies `MR` broadcasts per step
//! (adjacent floats of a row), `X` the `NR·W`-wide row vectors. All five products of the
//! backward (`S`, `dP`, `dV`, `dK`, `dQ`) are this shape once their operands sit in the layout
//! it reads (see `backward_task`).

use super::micro::{on_live_vectors, rank1_update, store_block};
use crate::arch::Simd;

/// One `MR × NR·W` block of `C`: `C = (accumulate ? C : 0) + Σ_{k < nk} B[k][..MR] ⊗ X[k][..NR·W]`.
///
/// # Safety
/// `ops.b` readable for `nk` rows and `MR` columns; `ops.x` readable for `nk` rows and `NR·W`
/// columns; `dest` read/writable for `MR` rows and `NR·W` columns; S available.
#[inline(always)]
unsafe fn gemm_micro<S: Simd, const MR: usize, const NR: usize>(
    ops: Operands,
    nk: usize,
    dest: Dest,
) {
    // SAFETY: the bounds are the caller's contract.
    unsafe {
        let mut acc = dest.start::<S, MR, NR>(0, 0);
        for k in 0..nk {
            rank1_update::<S, MR, NR>(
                &mut acc,
                ops.x.add(k * ops.x_stride),
                ops.b.add(k * ops.b_stride),
            );
        }
        dest.finish::<S, MR, NR>(&acc, 0, 0);
    }
}

/// The operands of one product: `B` (`[k][m]`, broadcast side) and `X` (`[k][n]`, vector
/// side), each a pointer and a row stride in floats.
#[derive(Clone, Copy)]
pub(crate) struct Operands {
    /// `B[k][m]` at `b + k·b_stride + m`.
    pub b: *const f32,
    /// Row stride of `B`.
    pub b_stride: usize,
    /// `X[k][n]` at `x + k·x_stride + n`.
    pub x: *const f32,
    /// Row stride of `X`.
    pub x_stride: usize,
}

impl Operands {
    /// `B` at `b` (row stride `b_stride`), `X` at `x` (row stride `x_stride`).
    pub(crate) fn new(b: *const f32, b_stride: usize, x: *const f32, x_stride: usize) -> Self {
        Operands {
            b,
            b_stride,
            x,
            x_stride,
        }
    }

    /// The same operands with `B` stored transposed: `B[k][m]` at `b + m·b_stride + k` (rows
    /// of `B`'s transpose read in place, which only [`gemm_wide`] can).
    pub(crate) fn b_transposed(self) -> WideOperands {
        WideOperands {
            b: self.b,
            b_k: 1,
            b_m: self.b_stride,
            x: self.x,
            x_stride: self.x_stride,
        }
    }
}

/// Where a product's `C` goes: `C[m][n]` at `c + m·c_stride + n`, overwritten, or added to
/// when `accumulate`. As a [`WideSink`] it is the plain store of [`gemm_wide`].
#[derive(Clone, Copy)]
pub(crate) struct Dest {
    /// `C[0][0]`.
    pub c: *mut f32,
    /// Row stride of `C` (floats).
    pub c_stride: usize,
    /// Whether the sums are added to `C` (else they overwrite it).
    pub accumulate: bool,
}

impl Dest {
    /// `C` at `c` (row stride `c_stride`), overwritten.
    pub(crate) fn overwrite(c: *mut f32, c_stride: usize) -> Dest {
        Dest {
            c,
            c_stride,
            accumulate: false,
        }
    }

    /// `C` at `c` (row stride `c_stride`), added to.
    pub(crate) fn add_to(c: *mut f32, c_stride: usize) -> Dest {
        Dest {
            c,
            c_stride,
            accumulate: true,
        }
    }

    /// The block of `C` from row `m0`, column `n0`.
    ///
    /// # Safety
    /// That element lies inside `C`.
    #[inline(always)]
    unsafe fn at(self, m0: usize, n0: usize) -> Dest {
        Dest {
            // SAFETY: inside `C` (caller).
            c: unsafe { self.c.add(m0 * self.c_stride + n0) },
            ..self
        }
    }
}

/// What one block of `MR` rows of `C` needs, when the mask makes the operands zero outside it:
/// the contraction runs over `k` only (terms outside it are exact zeros: skipping them leaves
/// every sum bitwise the same) and only columns in `n` are written (columns outside it are left
/// as they were, the caller overwrites or ignores them).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Span {
    /// Contraction range `k.0..k.1` (empty: the block is left as it was).
    pub k: (usize, usize),
    /// Columns `n.0..n.1` that may be nonzero (clamped to `cols`).
    pub n: (usize, usize),
}

impl Span {
    /// Every term and column.
    pub const ALL: Span = Span {
        k: (0, usize::MAX),
        n: (0, usize::MAX),
    };
}

/// `C[m][n] (+)= Σ_{k < nk} B[k][m]·X[k][n]` for `m < rows`, `n < cols`, `C` at `dest`
/// ([`Dest`]). `rows` must be a multiple of `MR` and `cols` of `W`; the sum over `k`
/// runs in ascending order (so the result depends only on the inputs and the architecture).
/// `spans` (one per block of `MR` rows), when given, narrows each block's contraction and
/// columns ([`Span`]).
///
/// # Safety
/// `ops.b` readable for `nk` rows and `rows` columns, `ops.x` for `nk` rows and `cols`
/// columns, `dest` read/writable for `rows` rows and `cols` columns (strides as given);
/// `spans` at least `rows / MR` long; S available.
#[inline(always)]
pub(crate) unsafe fn gemm<S: Simd, const MR: usize, const NR: usize>(
    ops: Operands,
    nk: usize,
    rows: usize,
    cols: usize,
    dest: Dest,
    spans: Option<&[Span]>,
) {
    debug_assert!(rows.is_multiple_of(MR) && cols.is_multiple_of(S::W));
    debug_assert!(spans.is_none_or(|sp| sp.len() >= rows / MR));
    let mut n0 = 0;
    // Panels of columns outside, blocks of rows inside: the `X` panel (`nk × NR·W`) stays in
    // L1 while every row block streams past it. The columns are cut into the fewest panels of
    // at most NR vectors, as even as can be (4 vectors with NR = 3: 2 + 2, not 3 + 1: a
    // one-vector panel has too few accumulators to hide the FMA latency, for the same loads).
    // Each element's sum is the same whatever the cut.
    let mut panels_left = (cols / S::W).div_ceil(NR);
    while n0 < cols {
        let live = ((cols - n0) / S::W).div_ceil(panels_left.max(1)).min(NR);
        panels_left = panels_left.saturating_sub(1);
        let mut m0 = 0;
        while m0 < rows {
            let span = spans.map_or(Span::ALL, |sp| sp[m0 / MR]);
            let (k0, k1) = (span.k.0.min(nk), span.k.1.min(nk));
            let n1 = span.n.1.min(cols);
            // The block's columns within this panel that may be nonzero.
            let vecs = if n1 > n0 && span.n.0 < n0 + live * S::W && (k0 < k1 || !dest.accumulate) {
                live.min((n1 - n0).div_ceil(S::W))
            } else {
                0
            };
            if vecs > 0 {
                // SAFETY: m0 + MR ≤ rows, n0 + vecs·W ≤ cols, k0 ≤ k1 ≤ nk: inside every
                // operand (caller).
                unsafe {
                    let block = Operands::new(
                        ops.b.add(k0 * ops.b_stride + m0),
                        ops.b_stride,
                        ops.x.add(k0 * ops.x_stride + n0),
                        ops.x_stride,
                    );
                    on_live_vectors!(
                        vecs,
                        NR,
                        gemm_micro::<S, MR, _>(block, k1.saturating_sub(k0), dest.at(m0, n0))
                    );
                }
            }
            m0 += MR;
        }
        n0 += live * S::W;
    }
}

/// The broadcasts per block of [`gemm_wide`] (rows of `C`): with [`WIDE_NR`] vectors per block,
/// 24 accumulators and 10 loads per 24 multiply-adds (the `8 × 2` blocks [`gemm`] cuts a
/// 64-wide tile into: 16 accumulators, 10 loads per 16).
pub(crate) const WIDE_MR: usize = 6;
/// The vectors per block of [`gemm_wide`] (columns of `C`, in vectors).
pub(crate) const WIDE_NR: usize = 4;

/// The operands of [`gemm_wide`]: as [`Operands`], but `B[k][m]` at `b + k·b_k + m·b_m`, so
/// the broadcast side can be read in either orientation (`b_m = 1`: `[k][m]` rows as
/// [`gemm`] reads them; `b_k = 1`: `[m][k]`, a matrix whose transpose [`gemm`] would need).
#[derive(Clone, Copy)]
pub(crate) struct WideOperands {
    /// `B[k][m]` at `b + k·b_k + m·b_m`.
    pub b: *const f32,
    /// Step of `B` per contraction index.
    pub b_k: usize,
    /// Step of `B` per row of `C`.
    pub b_m: usize,
    /// `X[k][n]` at `x + k·x_stride + n`.
    pub x: *const f32,
    /// Row stride of `X`.
    pub x_stride: usize,
}

impl From<Operands> for WideOperands {
    fn from(o: Operands) -> WideOperands {
        WideOperands {
            b: o.b,
            b_k: o.b_stride,
            b_m: 1,
            x: o.x,
            x_stride: o.x_stride,
        }
    }
}

/// [`gemm`] without spans, in blocks of [`WIDE_MR`] rows × up to [`WIDE_NR`] vectors (the rows
/// past the last whole block in one block of 2 or 4): `C[m][n] (+)= Σ_{k < nk} B[k][m]·X[k][n]`
/// for `m < rows` (even), `n < cols` (a multiple of W). Every element is the same chain of
/// multiply-adds in ascending `k` as in [`gemm`], so the results are bitwise [`gemm`]'s; only
/// the register blocking differs (a 64-wide tile in one panel of 4 vectors instead of two of
/// 2; 24 accumulators instead of 16) and `B`'s orientation is free ([`WideOperands`]). For
/// 32 vector registers (AVX-512): 24 accumulators, 4 row vectors and a broadcast.
///
/// # Safety
/// `B[k][m]` readable for `k < nk`, `m < rows`; `ops.x` readable for `nk` rows and `cols`
/// columns; `dest` read/writable for `rows` rows and `cols` columns; S available.
#[inline(always)]
pub(crate) unsafe fn gemm_wide<S: Simd>(
    ops: WideOperands,
    nk: usize,
    rows: usize,
    cols: usize,
    dest: Dest,
) {
    // SAFETY: the caller's bounds; `dest` writes each block where `gemm` would.
    unsafe { gemm_wide_into::<S, _>(ops, nk, rows, cols, &dest) }
}

/// Where the blocks of [`gemm_wide_into`] start from and go: each `MR × NR·W` block of `C` at
/// row `m0`, column `n0` starts as [`WideSink::start`] says and its finished sums are handed to
/// [`WideSink::finish`] (a plain store, or an element-wise step fused onto the product).
pub(crate) trait WideSink {
    /// The block's starting accumulators (by default zeros).
    ///
    /// # Safety
    /// S available; the block lies inside the sink's buffers.
    #[inline(always)]
    unsafe fn start<S: Simd, const MR: usize, const NR: usize>(
        &self,
        _m0: usize,
        _n0: usize,
    ) -> [[S::V; NR]; MR] {
        // SAFETY: S available (caller).
        unsafe { [[S::splat(0.0); NR]; MR] }
    }
    /// Takes the block's finished sums.
    ///
    /// # Safety
    /// S available; the block lies inside the sink's buffers.
    unsafe fn finish<S: Simd, const MR: usize, const NR: usize>(
        &self,
        acc: &[[S::V; NR]; MR],
        m0: usize,
        n0: usize,
    );
}

/// The plain sink: `C` read first when `accumulate`, then the sums stored.
impl WideSink for Dest {
    #[inline(always)]
    unsafe fn start<S: Simd, const MR: usize, const NR: usize>(
        &self,
        m0: usize,
        n0: usize,
    ) -> [[S::V; NR]; MR] {
        // SAFETY: the block lies inside C (caller).
        unsafe {
            let mut acc = [[S::splat(0.0); NR]; MR];
            if self.accumulate {
                let c = self.c.add(m0 * self.c_stride + n0);
                for (m, row) in acc.iter_mut().enumerate() {
                    for (n, a) in row.iter_mut().enumerate() {
                        *a = S::load(c.add(m * self.c_stride + n * S::W));
                    }
                }
            }
            acc
        }
    }

    #[inline(always)]
    unsafe fn finish<S: Simd, const MR: usize, const NR: usize>(
        &self,
        acc: &[[S::V; NR]; MR],
        m0: usize,
        n0: usize,
    ) {
        // SAFETY: the block lies inside C (caller).
        unsafe { store_block::<S, MR, NR>(acc, self.c.add(m0 * self.c_stride + n0), self.c_stride) }
    }
}

/// [`gemm_wide`]'s blocks and sums, each block started and finished by `sink` ([`WideSink`]).
///
/// # Safety
/// `B[k][m]` readable for `k < nk`, `m < rows` (even); `ops.x` readable for `nk` rows and
/// `cols` (a multiple of W) columns; `sink` valid for every block of `rows × cols`; S
/// available.
#[inline(always)]
pub(crate) unsafe fn gemm_wide_into<S: Simd, K: WideSink>(
    ops: WideOperands,
    nk: usize,
    rows: usize,
    cols: usize,
    sink: &K,
) {
    debug_assert!(rows.is_multiple_of(2) && cols.is_multiple_of(S::W));
    // Panels as [`gemm`] cuts them (the fewest of at most WIDE_NR vectors, as even as can be).
    let mut panels_left = (cols / S::W).div_ceil(WIDE_NR);
    let mut n0 = 0;
    while n0 < cols {
        let live = ((cols - n0) / S::W)
            .div_ceil(panels_left.max(1))
            .min(WIDE_NR);
        panels_left = panels_left.saturating_sub(1);
        let mut m0 = 0;
        while m0 < rows {
            let height = (rows - m0).min(WIDE_MR);
            /// The micro-kernel of `$mr` rows on `live` vectors.
            macro_rules! rows_of {
                ($mr:literal) => {
                    match live {
                        1 => wide_micro::<S, K, $mr, 1>(ops, nk, sink, m0, n0),
                        2 => wide_micro::<S, K, $mr, 2>(ops, nk, sink, m0, n0),
                        3 => wide_micro::<S, K, $mr, 3>(ops, nk, sink, m0, n0),
                        _ => wide_micro::<S, K, $mr, 4>(ops, nk, sink, m0, n0),
                    }
                };
            }
            // SAFETY: m0 + height ≤ rows, n0 + live·W ≤ cols: inside every operand (caller).
            unsafe {
                match height {
                    2 => rows_of!(2),
                    4 => rows_of!(4),
                    _ => rows_of!(6),
                }
            }
            m0 += height;
        }
        n0 += live * S::W;
    }
}

/// One `MR × NR·W` block at row `m0`, column `n0`: the sink's start plus
/// `Σ_{k < nk} B[k][m0..m0 + MR] ⊗ X[k][n0..n0 + NR·W]` in ascending `k` (the chains of
/// [`gemm_micro`]), handed to the sink.
///
/// # Safety
/// The block inside `B`, `X` (`nk` rows) and the sink; S available.
#[inline(always)]
unsafe fn wide_micro<S: Simd, K: WideSink, const MR: usize, const NR: usize>(
    ops: WideOperands,
    nk: usize,
    sink: &K,
    m0: usize,
    n0: usize,
) {
    // SAFETY: the bounds are the caller's contract.
    unsafe {
        let mut acc = sink.start::<S, MR, NR>(m0, n0);
        let (mut b, mut x) = (ops.b.add(m0 * ops.b_m), ops.x.add(n0));
        for _ in 0..nk {
            let mut xv = [S::splat(0.0); NR];
            for (n, v) in xv.iter_mut().enumerate() {
                *v = S::load(x.add(n * S::W));
            }
            for (m, row) in acc.iter_mut().enumerate() {
                let bm = S::splat(*b.add(m * ops.b_m));
                for (a, &v) in row.iter_mut().zip(&xv) {
                    *a = S::fma(bm, v, *a);
                }
            }
            b = b.add(ops.b_k);
            x = x.add(ops.x_stride);
        }
        sink.finish::<S, MR, NR>(&acc, m0, n0);
    }
}
