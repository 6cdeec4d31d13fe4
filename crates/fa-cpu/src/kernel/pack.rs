//! Moving tiles into the kernels' layouts: widening bf16/f16 to f32 ([`widen`]), transposes
//! ([`transpose_region`]), packing K groups ([`pack_group`]) and prefetching rows that are a
//! head stride apart.

use super::CACHE_LINE;
use crate::arch::Simd;
use crate::element::{sealed, Element};

/// Widens `n` elements of `src` starting at `offset` into `dst[..n]`.
#[inline(always)]
pub(crate) unsafe fn widen<S: Simd, T: Element>(
    src: &[T],
    offset: usize,
    n: usize,
    dst: &mut [f32],
) {
    let dst = &mut dst[..n];
    match <T as sealed::Sealed>::view(src) {
        sealed::Slice::F32(s) => {
            // A vector loop rather than memcpy: rows are short (≤ 256 floats), where the
            // library call's start-up cost showed up in profiles.
            let s = &s[offset..offset + n];
            let mut i = 0;
            while i + S::W <= n {
                // SAFETY: i + W ≤ n on both sides; S available (caller).
                unsafe { S::store(dst.as_mut_ptr().add(i), S::load(s.as_ptr().add(i))) };
                i += S::W;
            }
            dst[i..].copy_from_slice(&s[i..]);
        }
        sealed::Slice::Bf16(s) => {
            for (d, x) in dst.iter_mut().zip(&s[offset..offset + n]) {
                *d = f32::from_bits((x.to_bits() as u32) << 16);
            }
        }
        sealed::Slice::F16(s) => {
            let s = &s[offset..offset + n];
            // SAFETY: f16 is a transparent u16; `s` and `dst` both hold n elements; the caller
            // runs on S's architecture.
            unsafe { S::widen_f16(s.as_ptr() as *const u16, dst.as_mut_ptr(), n) }
        }
    }
}

/// `dst[c·dst_stride + r] = src[r·src_stride + c]` for `r < rows`, `c < cols`: whole `W × W`
/// blocks with [`Simd::transpose`], the edges element by element. (Transposing `Qᵀ` in and
/// `Oᵀ` out one float at a time cost ~5–10 % of a single-thread run at N=1024.)
///
/// # Safety
/// `src` readable for `rows` rows of stride `src_stride` and `cols` columns, `dst` writable
/// for `cols` rows of stride `dst_stride` and `rows` columns, not overlapping; S available.
#[inline(always)]
pub(crate) unsafe fn transpose_region<S: Simd>(
    src: *const f32,
    src_stride: usize,
    rows: usize,
    cols: usize,
    dst: *mut f32,
    dst_stride: usize,
) {
    let w = S::W;
    let (rb, cb) = (rows / w * w, cols / w * w);
    // SAFETY: every index stays below rows (resp. cols) of its block (caller's contract).
    unsafe {
        for r0 in (0..rb).step_by(w) {
            for c0 in (0..cb).step_by(w) {
                S::transpose(
                    src.add(r0 * src_stride + c0),
                    src_stride,
                    dst.add(c0 * dst_stride + r0),
                    dst_stride,
                );
            }
        }
        for r in 0..rows {
            let c_start = if r < rb { cb } else { 0 };
            for c in c_start..cols {
                *dst.add(c * dst_stride + r) = *src.add(r * src_stride + c);
            }
        }
    }
}

/// `group[c·MR + j] = keys[j·d + c]` for `j < MR`, `c < d`: a group of `MR` key rows in the
/// QKᵀ micro-kernel's `[c][MR]` layout. With `MR = 8` (AVX-512) by 8 × 8 block transposes,
/// the rest element by element (one scalar store per element was a few per cent of a call
/// at N=1024 on the Xeon).
///
/// # Safety
/// `keys` readable for `MR·d` floats, `group` writable for `d·MR`, not overlapping; S
/// available.
#[inline(always)]
pub(crate) unsafe fn pack_group<S: Simd, const MR: usize>(
    keys: *const f32,
    d: usize,
    group: *mut f32,
) {
    // SAFETY: every index stays below MR rows of d (keys) and d rows of MR (group).
    unsafe {
        let mut c0 = 0;
        if MR == 8 {
            while c0 + 8 <= d {
                S::transpose8(keys.add(c0), d, group.add(c0 * 8), 8);
                c0 += 8;
            }
        }
        for c in c0..d {
            for j in 0..MR {
                *group.add(c * MR + j) = *keys.add(j * d + c);
            }
        }
    }
}
/// How many rows ahead the Q packing and the O write-back prefetch. Rows of one head are a
/// head stride apart (4 KiB and more), each in its own page, where the hardware prefetchers
/// do not follow; a few rows ahead cover the latency without flooding the miss queue.
pub(crate) const ROW_PREFETCH_AHEAD: usize = 6;

/// Prefetches the cache lines of `src[offset..offset + n]` (bounds-checked: nothing past the
/// slice is touched).
#[inline(always)]
pub(crate) fn prefetch_row<S: Simd, T: Element>(src: &[T], offset: usize, n: usize) {
    if let Some(row) = src.get(offset..offset + n) {
        prefetch_lines::<S>(row.as_ptr() as *const u8, std::mem::size_of_val(row));
    }
}

/// Prefetches the cache lines of the `bytes` bytes at `base`.
#[inline(always)]
pub(crate) fn prefetch_lines<S: Simd>(base: *const u8, bytes: usize) {
    let mut at = 0;
    while at < bytes {
        // SAFETY: a prefetch never faults and has no architectural effect, whatever the
        // address; callers pass ranges inside their buffers anyway.
        unsafe { S::prefetch(base.wrapping_add(at)) };
        at += CACHE_LINE;
    }
}
