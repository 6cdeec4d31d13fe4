//! Masking inside a tile: the keys outside each row's visible range get `−∞` before the
//! softmax (whole tiles and panels the mask hides are skipped by the task, never masked).

use crate::arch::Simd;

/// The widest row panel (`lanes · row_vectors`) of any architecture: AVX-512's 3 × 16.
pub(crate) const MAX_PANEL: usize = 64;

/// Hides the keys outside each row's visible range in a panel's score tile: `Sᵀ[j][l] = −∞`
/// unless `lo[l] ≤ j < hi[l]`, for keys `j < nk`. Two vector compares and blends per score
/// vector; a row at a time, the same −∞ went in one scalar store per hidden score (a column
/// walk through the tile, a few per cent of a causal call at D=64).
///
/// # Safety
/// `st` read/writable for `nk` rows of stride `st_stride` and `NR·W` columns; `lo` and `hi`
/// hold at least `NR·W` values; S available.
#[inline(always)]
pub(crate) unsafe fn mask_panel<S: Simd, const NR: usize>(
    st: *mut f32,
    st_stride: usize,
    nk: usize,
    lo: &[f32],
    hi: &[f32],
) {
    // SAFETY: bounds are the caller's contract.
    unsafe {
        let lo: [S::V; NR] = std::array::from_fn(|n| S::load(lo.as_ptr().add(n * S::W)));
        let hi: [S::V; NR] = std::array::from_fn(|n| S::load(hi.as_ptr().add(n * S::W)));
        let hidden = S::splat(f32::NEG_INFINITY);
        for j in 0..nk {
            let key = S::splat(j as f32);
            for n in 0..NR {
                let p = st.add(j * st_stride + n * S::W);
                let x = S::select_lt(key, lo[n], hidden, S::load(p));
                S::store(p, S::select_lt(key, hi[n], x, hidden));
            }
        }
    }
}
