//! Micro-kernels for tasks of at most one row vector (decode: a GQA group's query heads ×
//! a few new tokens), vectorised over the head dimension instead of over rows.
//!
//! The forward's micro-kernels ([`super::micro`]) put query rows along the vector lanes and
//! broadcast K and V elements: with 4 live rows of 8 (or 16) lanes, most of each FMA is
//! padding, and each K tile is transposed into groups first. Here K and V rows stay
//! row-major (widened to f32, zero-padded to a whole number of vectors), `S = Q·Kᵀ` is a dot
//! product per (row, key) over `d/W` vectors, and `O += P·V` broadcasts one probability per
//! (row, key) against `dv/W` vectors of V. The scores still go into the panel's transposed
//! tile `Sᵀ[j][r]`, so masking and the online softmax are the forward's own.

use crate::arch::Simd;

/// `Sᵀ[j][r] = q_r · k_j` for rows `r < rows` and keys `j < nk`; lanes `rows..panel` of each
/// key are set to 0 (the forward's value for padding rows).
///
/// # Safety
/// S available; `q` holds `rows` rows of `d_w` floats (a multiple of `W`, zero-padded), `k`
/// `nk` rows of `d_w`, `st` `nk` rows of `panel ≥ rows` floats.
#[inline(always)]
pub(crate) unsafe fn row_scores<S: Simd>(
    q: &[f32],
    k: &[f32],
    d_w: usize,
    rows: usize,
    nk: usize,
    st: &mut [f32],
    panel: usize,
) {
    let w = S::W;
    let mut lanes = [0.0f32; 16];
    for j in 0..nk {
        let kj = &k[j * d_w..(j + 1) * d_w];
        let out = &mut st[j * panel..(j + 1) * panel];
        for r in 0..rows {
            let qr = &q[r * d_w..(r + 1) * d_w];
            // SAFETY: every load reads W floats inside `kj` or `qr` (c + W ≤ d_w); `lanes`
            // holds 16 ≥ W floats; S available (caller).
            let dot = unsafe {
                // Four independent chains: one FMA chain is latency-bound.
                let mut acc = [S::splat(0.0); 4];
                let mut c = 0;
                while c + 4 * w <= d_w {
                    for (u, a) in acc.iter_mut().enumerate() {
                        let at = c + u * w;
                        *a = S::fma(
                            S::load(qr.as_ptr().add(at)),
                            S::load(kj.as_ptr().add(at)),
                            *a,
                        );
                    }
                    c += 4 * w;
                }
                while c < d_w {
                    acc[0] = S::fma(
                        S::load(qr.as_ptr().add(c)),
                        S::load(kj.as_ptr().add(c)),
                        acc[0],
                    );
                    c += w;
                }
                let sum = S::add(S::add(acc[0], acc[1]), S::add(acc[2], acc[3]));
                S::store(lanes.as_mut_ptr(), sum);
                lanes[..w].iter().sum::<f32>()
            };
            out[r] = dot;
        }
        out[rows..].fill(0.0);
    }
}

/// `o_r = o_r·corr + Σ_j Pᵀ[j][r]·v_j` for one row `r` over `dv_w` channels.
///
/// # Safety
/// S available; `o` holds `dv_w` floats (a multiple of `W`), `v` `nk` rows of `dv_w`
/// (zero-padded), `st` `nk` rows of `panel > r` floats.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn row_pv<S: Simd>(
    st: &[f32],
    panel: usize,
    r: usize,
    v: &[f32],
    dv_w: usize,
    nk: usize,
    corr: f32,
    o: &mut [f32],
) {
    let w = S::W;
    let o = &mut o[..dv_w];
    // SAFETY: every load/store covers W floats inside `o` or a row of `v` (c + W ≤ dv_w);
    // S available (caller).
    unsafe {
        let scale = S::splat(corr);
        let mut c = 0;
        while c + 4 * w <= dv_w {
            let mut acc = [S::splat(0.0); 4];
            for (u, a) in acc.iter_mut().enumerate() {
                *a = S::load(o.as_ptr().add(c + u * w));
                if corr != 1.0 {
                    *a = S::mul(*a, scale);
                }
            }
            for j in 0..nk {
                let p = S::splat(st[j * panel + r]);
                let vj = v.as_ptr().add(j * dv_w + c);
                for (u, a) in acc.iter_mut().enumerate() {
                    *a = S::fma(p, S::load(vj.add(u * w)), *a);
                }
            }
            for (u, a) in acc.iter().enumerate() {
                S::store(o.as_mut_ptr().add(c + u * w), *a);
            }
            c += 4 * w;
        }
        while c < dv_w {
            let mut a = S::load(o.as_ptr().add(c));
            if corr != 1.0 {
                a = S::mul(a, scale);
            }
            for j in 0..nk {
                a = S::fma(
                    S::splat(st[j * panel + r]),
                    S::load(v.as_ptr().add(j * dv_w + c)),
                    a,
                );
            }
            S::store(o.as_mut_ptr().add(c), a);
            c += w;
        }
    }
}
