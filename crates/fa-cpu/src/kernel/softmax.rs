//! The online softmax of a panel's score tile ([`softmax_panel`]), with its vector shortcut
//! for rows that keep their reference ([`all_keep`]), and the vector exponentials over slices.

use crate::arch::{exp2_cubic, exp2_exact, tanh, Simd};
use crate::Exp2Impl;
use softmax_core::{RescalePolicy, RescaleStats, RowState};

/// Applies `exp2` (exact or cubic) to `n` values (a multiple of `W`) at `x`, in place.
///
/// # Safety
/// `x` read/writable for `n` f32, `n % W == 0`; S available.
#[inline(always)]
#[cfg(feature = "internal-tests")]
pub(crate) unsafe fn exp2_slice<S: Simd>(x: *mut f32, n: usize, imp: Exp2Impl) {
    let mut i = 0;
    while i < n {
        // SAFETY: i + W ≤ n (n is a multiple of W).
        unsafe {
            let v = S::load(x.add(i));
            let e = if imp.cubic(false) {
                exp2_cubic::<S>(v)
            } else {
                exp2_exact::<S>(v)
            };
            S::store(x.add(i), e);
        }
        i += S::W;
    }
}

/// Applies `tanh` to `n` values (a multiple of `W`) at `x`, multiplied by `post`, in place.
///
/// # Safety
/// `x` read/writable for `n` f32, `n % W == 0`; S available.
#[inline(always)]
pub(crate) unsafe fn softcap_slice<S: Simd>(x: *mut f32, n: usize, post: f32) {
    let mut i = 0;
    while i < n {
        // SAFETY: i + W ≤ n.
        unsafe {
            let v = S::load(x.add(i));
            S::store(x.add(i), S::mul(tanh::<S>(v), S::splat(post)));
        }
        i += S::W;
    }
}

/// The online-softmax step of one score tile for a panel of `NR` row vectors, rows
/// `rv0..rv0 + NR·W`, whose scores are `NR·W` floats at `st + j·st_stride` for keys `j < nk`:
/// block maxima, [`RowState::begin_block`] per row, `exp2(x − offset)` in place, row sums,
/// [`RowState::add_sum`]. Writes each row's accumulator correction into `corr`. The `NR` row
/// vectors go through each loop together (independent dependency chains), and the exponential
/// is chosen once per call, outside the loops ([`exp2_pass`]).
///
/// # Safety
/// `st` read/writable for `nk` rows of stride `st_stride` and `NR·W` columns; `states`
/// and `corr` hold at least `rv0 + NR·W` entries; S available.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn softmax_panel<S: Simd, const NR: usize>(
    st: *mut f32,
    st_stride: usize,
    nk: usize,
    rv0: usize,
    valid_rows: usize,
    states: &mut [RowState<f32>],
    corr: &mut [f32],
    policy: &RescalePolicy<f32>,
    stats: &mut RescaleStats,
    imp: Exp2Impl,
) {
    // SAFETY: bounds are the caller's contract.
    unsafe {
        let mx = panel_maxima::<S, NR>(st, st_stride, nk);
        let offset = panel_offsets::<S, NR>(&mx, rv0, valid_rows, states, corr, policy, stats);
        // P stays f32 on this path: `Auto` is the exact exp2.
        let sum = if imp.cubic(false) {
            exp2_pass::<S, NR, true>(st, st_stride, nk, &offset)
        } else {
            exp2_pass::<S, NR, false>(st, st_stride, nk, &offset)
        };
        add_panel_sums::<S, NR>(&sum, rv0, valid_rows, states);
    }
}

/// The maxima of a panel's `NR` row vectors over keys `j < nk` (scores at `st + j·st_stride`).
///
/// # Safety
/// `st` readable for `nk` rows of stride `st_stride` and `NR·W` columns; S available.
#[inline(always)]
pub(crate) unsafe fn panel_maxima<S: Simd, const NR: usize>(
    st: *const f32,
    st_stride: usize,
    nk: usize,
) -> [S::V; NR] {
    // SAFETY: bounds are the caller's contract.
    unsafe {
        let mut mx = [S::splat(f32::NEG_INFINITY); NR];
        for j in 0..nk {
            for (n, m) in mx.iter_mut().enumerate() {
                *m = S::max(S::load(st.add(j * st_stride + n * S::W)), *m);
            }
        }
        mx
    }
}

/// The online-softmax step of a block for a panel's `NR` row vectors (rows `rv0..rv0 + NR·W`)
/// whose block maxima are `mx`: [`RowState::begin_block`] per row (or its vector shortcut
/// [`all_keep`]), each row's accumulator correction written into `corr`; returns the offsets
/// to subtract before `exp2` (padding rows, `valid_rows` and beyond: offset 0, correction 1).
///
/// # Safety
/// `states` and `corr` hold at least `rv0 + NR·W` entries; S available.
#[inline(always)]
pub(crate) unsafe fn panel_offsets<S: Simd, const NR: usize>(
    mx: &[S::V; NR],
    rv0: usize,
    valid_rows: usize,
    states: &mut [RowState<f32>],
    corr: &mut [f32],
    policy: &RescalePolicy<f32>,
    stats: &mut RescaleStats,
) -> [S::V; NR] {
    let w = S::W;
    let mut lanes = [0.0f32; 16];
    // SAFETY: bounds are the caller's contract; `lanes` holds 16 ≥ W floats.
    unsafe {
        let mut offset = [S::splat(0.0); NR];
        for (n, (m, off)) in mx.iter().zip(offset.iter_mut()).enumerate() {
            let base = rv0 + n * w;
            if base + w <= valid_rows {
                // The common case after a row's first tiles: no row of the vector moves its
                // reference. Then the offsets are the current references and the corrections
                // 1, with no per-row work.
                for (lane, x) in lanes.iter_mut().enumerate().take(w) {
                    *x = states[base + lane].max;
                }
                let current = S::load(lanes.as_ptr());
                if let Some(skipped) = all_keep::<S>(policy, current, *m) {
                    stats.blocks += w as u64;
                    stats.skipped += u64::from(skipped);
                    *off = current;
                    corr[base..base + w].fill(1.0);
                    continue;
                }
            }
            S::store(lanes.as_mut_ptr(), *m);
            for (lane, x) in lanes.iter_mut().enumerate().take(w) {
                let r = base + lane;
                if r < valid_rows {
                    let step = states[r].begin_block(*x, policy, stats);
                    *x = step.offset;
                    corr[r] = step.correction;
                } else {
                    *x = 0.0;
                    corr[r] = 1.0;
                }
            }
            *off = S::load(lanes.as_ptr());
        }
        offset
    }
}

/// Adds a block's row sums `sum` of a panel's `NR` row vectors (rows `rv0..`) to the row
/// states ([`RowState::add_sum`]); padding rows (`valid_rows` and beyond) are left alone.
///
/// # Safety
/// `states` holds at least `min(rv0 + NR·W, valid_rows)` entries; S available.
#[inline(always)]
pub(crate) unsafe fn add_panel_sums<S: Simd, const NR: usize>(
    sum: &[S::V; NR],
    rv0: usize,
    valid_rows: usize,
    states: &mut [RowState<f32>],
) {
    let mut lanes = [0.0f32; 16];
    for (n, total) in sum.iter().enumerate() {
        // SAFETY: `lanes` holds 16 ≥ W floats; S available (caller).
        unsafe { S::store(lanes.as_mut_ptr(), *total) };
        for (lane, &x) in lanes.iter().enumerate().take(S::W) {
            let r = rv0 + n * S::W + lane;
            if r < valid_rows {
                states[r].add_sum(x);
            }
        }
    }
}

/// Whether [`RescalePolicy::decide`] keeps the reference of every lane, for references
/// `current` and block maxima `block_max`; if so, how many of those lanes it counts as
/// skipped rescales. `None` when any lane would move (or has no reference yet, `−∞`): the
/// caller then runs the per-row rule. The vector form of `decide`'s `Keep` outcome (tested
/// against it lane by lane), so a vector that takes this path gets exactly the offsets,
/// corrections and statistics the per-row calls would give.
///
/// # Safety
/// S available.
#[inline(always)]
pub(crate) unsafe fn all_keep<S: Simd>(
    policy: &RescalePolicy<f32>,
    current: S::V,
    block_max: S::V,
) -> Option<u32> {
    // SAFETY: S available (caller).
    unsafe {
        // −∞ is the only value below f32::MIN.
        if S::gt_mask(S::splat(f32::MIN), current) != 0 {
            return None;
        }
        // `block_max > current` is false for a NaN maximum, as in `decide`.
        let above = S::gt_mask(block_max, current);
        match *policy {
            RescalePolicy::Always => (above == 0).then_some(0),
            RescalePolicy::Threshold(tau) => {
                (S::gt_mask(S::sub(block_max, current), S::splat(tau)) == 0)
                    .then_some(above.count_ones())
            }
        }
    }
}

/// `exp2(x − offset)` in place over `nk` rows of a panel's `NR` row vectors (the exponential
/// fixed at compile time, `CUBIC`: [`exp2_cubic`], else [`exp2_exact`]); returns the row sums.
///
/// # Safety
/// As [`softmax_panel`].
#[inline(always)]
unsafe fn exp2_pass<S: Simd, const NR: usize, const CUBIC: bool>(
    st: *mut f32,
    st_stride: usize,
    nk: usize,
    offset: &[S::V; NR],
) -> [S::V; NR] {
    // SAFETY: bounds are the caller's contract.
    unsafe {
        let mut sum = [S::splat(0.0); NR];
        for j in 0..nk {
            for (n, total) in sum.iter_mut().enumerate() {
                let p = st.add(j * st_stride + n * S::W);
                let x = S::sub(S::load(p), offset[n]);
                let e = if CUBIC {
                    exp2_cubic::<S>(x)
                } else {
                    exp2_exact::<S>(x)
                };
                S::store(p, e);
                *total = S::add(*total, e);
            }
        }
        sum
    }
}
