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

/// `C[m][n] (+)= Σ_{k < nk} B[k][m]·X[k][n]` for `m < rows`, `n < cols`, `C` at `c` with row
/// stride `c_stride`. `rows` must be a multiple of `MR` and `cols` of `W`; the sum over `k`
/// runs in ascending order (so the result depends only on the inputs and the architecture).
///
/// # Safety
/// `ops.b` readable for `nk` rows and `rows` columns, `ops.x` for `nk` rows and `cols`
/// columns, `c` read/writable for `rows` rows and `cols` columns (strides as given); S
/// available.
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
) {
    debug_assert!(rows.is_multiple_of(MR) && cols.is_multiple_of(S::W));
    let mut n0 = 0;
    // Panels of columns outside, blocks of rows inside: the `X` panel (`nk × NR·W`) stays in
    // L1 while every row block streams past it.
    while n0 < cols {
        let live = ((cols - n0) / S::W).min(NR);
        let mut m0 = 0;
        while m0 < rows {
            // SAFETY: m0 + MR ≤ rows and n0 + live·W ≤ cols: inside every operand (caller).
            unsafe {
                let (b, x, cc) = (ops.b.add(m0), ops.x.add(n0), c.add(m0 * c_stride + n0));
                on_live_vectors!(
                    live,
                    NR,
                    gemm_micro::<S, MR, _>(
                        b,
                        ops.b_stride,
                        x,
                        ops.x_stride,
                        nk,
                        cc,
                        c_stride,
                        accumulate
                    )
                );
            }
            m0 += MR;
        }
        n0 += live * S::W;
    }
}
