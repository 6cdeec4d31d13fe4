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
/// `b` readable for `nk` rows of stride `b_stride` and `MR` columns; `x` readable for `nk`
/// rows of stride `x_stride` and `NR·W` columns; `c` read/writable for `MR` rows of stride
/// `c_stride` and `NR·W` columns; S available.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_micro<S: Simd, const MR: usize, const NR: usize>(
    b: *const f32,
    b_stride: usize,
    x: *const f32,
    x_stride: usize,
    nk: usize,
    c: *mut f32,
    c_stride: usize,
    accumulate: bool,
) {
    // SAFETY: the bounds are the caller's contract.
    unsafe {
        let mut acc = [[S::splat(0.0); NR]; MR];
        if accumulate {
            for (m, row) in acc.iter_mut().enumerate() {
                for (n, a) in row.iter_mut().enumerate() {
                    *a = S::load(c.add(m * c_stride + n * S::W));
                }
            }
        }
        for k in 0..nk {
            rank1_update::<S, MR, NR>(&mut acc, x.add(k * x_stride), b.add(k * b_stride));
        }
        store_block::<S, MR, NR>(&acc, c, c_stride);
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

/// `C[m][n] (+)= Σ_{k < nk} B[k][m]·X[k][n]` for `m < rows`, `n < cols`, `C` at `c` with row
/// stride `c_stride`. `rows` must be a multiple of `MR` and `cols` of `W`; the sum over `k`
/// runs in ascending order (so the result depends only on the inputs and the architecture).
/// `spans` (one per block of `MR` rows), when given, narrows each block's contraction and
/// columns ([`Span`]).
///
/// # Safety
/// `ops.b` readable for `nk` rows and `rows` columns, `ops.x` for `nk` rows and `cols`
/// columns, `c` read/writable for `rows` rows and `cols` columns (strides as given); `spans`
/// at least `rows / MR` long; S available.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm<S: Simd, const MR: usize, const NR: usize>(
    ops: Operands,
    nk: usize,
    rows: usize,
    cols: usize,
    c: *mut f32,
    c_stride: usize,
    accumulate: bool,
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
            let vecs = if n1 > n0 && span.n.0 < n0 + live * S::W && (k0 < k1 || !accumulate) {
                live.min((n1 - n0).div_ceil(S::W))
            } else {
                0
            };
            if vecs > 0 {
                // SAFETY: m0 + MR ≤ rows, n0 + vecs·W ≤ cols, k0 ≤ k1 ≤ nk: inside every
                // operand (caller).
                unsafe {
                    let (b, x, cc) = (
                        ops.b.add(k0 * ops.b_stride + m0),
                        ops.x.add(k0 * ops.x_stride + n0),
                        c.add(m0 * c_stride + n0),
                    );
                    on_live_vectors!(
                        vecs,
                        NR,
                        gemm_micro::<S, MR, _>(
                            b,
                            ops.b_stride,
                            x,
                            ops.x_stride,
                            k1.saturating_sub(k0),
                            cc,
                            c_stride,
                            accumulate
                        )
                    );
                }
            }
            m0 += MR;
        }
        n0 += live * S::W;
    }
}
