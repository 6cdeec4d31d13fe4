//! The register-blocked micro-kernels: `Sᵀ = K·Qᵀ` ([`qk_micro`]) and `Oᵀ = Oᵀ·corr + Vᵀ·Pᵀ`
//! ([`pv_micro`]), both made of the same rank-1 update of `MR × NR` vector accumulators.

use crate::arch::Simd;

/// `Sᵀ[j][r] = Σ_c K[j][c]·Qᵀ[c][r]` for `MR` keys × `NR·W` rows, K packed as `[c][MR]`
/// (the `MR` broadcasts of a step are adjacent floats behind one pointer).
///
/// # Safety
/// `qt` readable for `d` rows of stride `qt_stride` and `NR·W` columns; `k` readable for
/// `d·MR` floats; `st` writable for `MR` rows of stride `st_stride` and `NR·W` columns; S's
/// architecture available.
#[inline(always)]
pub(crate) unsafe fn qk_micro<S: Simd, const MR: usize, const NR: usize>(
    qt: *const f32,
    qt_stride: usize,
    k: *const f32,
    d: usize,
    st: *mut f32,
    st_stride: usize,
) {
    // SAFETY: the bounds are the caller's contract.
    unsafe {
        let mut acc = [[S::splat(0.0); NR]; MR];
        for c in 0..d {
            rank1_update::<S, MR, NR>(&mut acc, qt.add(c * qt_stride), k.add(c * MR));
        }
        store_block::<S, MR, NR>(&acc, st, st_stride);
    }
}

/// `Oᵀ[c][r] = Oᵀ[c][r]·corr[r] + Σ_j V[j][c]·Pᵀ[j][r]` for `MR` channels × `NR·W` rows and
/// `nk` keys (`corr` null: no correction).
///
/// # Safety
/// `pt` readable for `nk` rows of stride `pt_stride` and `NR·W` columns; `v` readable for `nk`
/// rows of stride `v_stride` and `MR` columns; `ot` read/writable for `MR` rows of stride
/// `ot_stride` and `NR·W` columns; `corr` null or readable for `NR·W`; S available.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pv_micro<S: Simd, const MR: usize, const NR: usize>(
    pt: *const f32,
    pt_stride: usize,
    v: *const f32,
    v_stride: usize,
    nk: usize,
    ot: *mut f32,
    ot_stride: usize,
    corr: *const f32,
) {
    // SAFETY: the bounds are the caller's contract.
    unsafe {
        let mut acc = [[S::splat(0.0); NR]; MR];
        for (m, row) in acc.iter_mut().enumerate() {
            for (n, a) in row.iter_mut().enumerate() {
                *a = S::load(ot.add(m * ot_stride + n * S::W));
                if !corr.is_null() {
                    *a = S::mul(*a, S::load(corr.add(n * S::W)));
                }
            }
        }
        for j in 0..nk {
            rank1_update::<S, MR, NR>(&mut acc, pt.add(j * pt_stride), v.add(j * v_stride));
        }
        store_block::<S, MR, NR>(&acc, ot, ot_stride);
    }
}

/// Calls a micro-kernel (`qk_micro` or `pv_micro`, written with `_` for its row-vector count)
/// on the first `live` of `NR` row vectors (`1 ≤ live ≤ NR`): the narrower kernels serve a
/// block's last, partly filled panel.
macro_rules! on_live_vectors {
    ($live:expr, $nr:ident, $kernel:ident::<$s:ident, $mr:ident, _>($($arg:expr),* $(,)?)) => {
        match $live {
            1 if $nr > 1 => $kernel::<$s, $mr, 1>($($arg),*),
            2 if $nr > 2 => $kernel::<$s, $mr, 2>($($arg),*),
            _ => $kernel::<$s, $mr, $nr>($($arg),*),
        }
    };
}
pub(crate) use on_live_vectors;

/// The step both micro-kernels are made of: `acc[m][n] += b[m] · x[n·W..(n+1)·W]` for `MR`
/// broadcasts `b` (adjacent floats) against `NR` vectors `x` (adjacent vectors).
///
/// # Safety
/// `x` readable for `NR·W` floats, `b` for `MR`; S available.
#[inline(always)]
pub(crate) unsafe fn rank1_update<S: Simd, const MR: usize, const NR: usize>(
    acc: &mut [[S::V; NR]; MR],
    x: *const f32,
    b: *const f32,
) {
    // SAFETY: the bounds are the caller's contract.
    unsafe {
        let mut xv = [S::splat(0.0); NR];
        for (n, v) in xv.iter_mut().enumerate() {
            *v = S::load(x.add(n * S::W));
        }
        for (m, row) in acc.iter_mut().enumerate() {
            let bm = S::splat(*b.add(m));
            for (a, &v) in row.iter_mut().zip(&xv) {
                *a = S::fma(bm, v, *a);
            }
        }
    }
}

/// Stores an `MR × NR` block of vectors: row `m` at `dst + m·stride`, its vectors adjacent.
///
/// # Safety
/// `dst` writable for `MR` rows of stride `stride` and `NR·W` columns; S available.
#[inline(always)]
pub(crate) unsafe fn store_block<S: Simd, const MR: usize, const NR: usize>(
    acc: &[[S::V; NR]; MR],
    dst: *mut f32,
    stride: usize,
) {
    for (m, row) in acc.iter().enumerate() {
        for (n, &a) in row.iter().enumerate() {
            // SAFETY: m < MR, n < NR: inside the block (caller's contract).
            unsafe { S::store(dst.add(m * stride + n * S::W), a) };
        }
    }
}
