//! AVX2 + FMA + F16C: 8 f32 lanes, 16 registers.

use super::Simd;
use std::arch::x86_64::*;

/// The AVX2 vector of eight f32 lanes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2;

// SAFETY: every method uses AVX/AVX2/FMA/F16C intrinsics only; the trait's contract makes the
// caller run them on a CPU that has those features, from code compiled for them.
unsafe impl Simd for Avx2 {
    type V = __m256;
    const W: usize = 8;

    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        // SAFETY: AVX2 present (trait contract).
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: 8 readable f32 at p (trait contract).
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        // SAFETY: 8 writable f32 at p (trait contract).
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX2 present (trait contract).
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX2 present (trait contract).
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX2 present (trait contract).
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn div(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX2 present (trait contract).
        unsafe { _mm256_div_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: FMA present (trait contract).
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX present (trait contract). vmaxps returns the second operand when
        // either is NaN: a > b ? a : b.
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn min(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX2 present (trait contract).
        unsafe { _mm256_min_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn abs(a: __m256) -> __m256 {
        // SAFETY: AVX2 present (trait contract).
        unsafe { _mm256_andnot_ps(_mm256_set1_ps(-0.0), a) }
    }
    #[inline(always)]
    unsafe fn floor(a: __m256) -> __m256 {
        // SAFETY: AVX2 present (trait contract).
        unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(a) }
    }
    #[inline(always)]
    unsafe fn pow2i(n: __m256) -> __m256 {
        // SAFETY: AVX2 present (trait contract).
        unsafe {
            let biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased))
        }
    }
    #[inline(always)]
    unsafe fn pow2i_biased(biased: __m256) -> __m256 {
        // SAFETY: AVX2 present (trait contract).
        unsafe {
            let e = _mm256_add_epi32(
                _mm256_castps_si256(biased),
                _mm256_set1_epi32(super::POW2I_BIAS),
            );
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
        }
    }
    #[inline(always)]
    unsafe fn gt_mask(a: __m256, b: __m256) -> u32 {
        // SAFETY: AVX2 present (trait contract).
        unsafe { _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(a, b)) as u32 }
    }
    #[inline(always)]
    unsafe fn select_lt(a: __m256, b: __m256, t: __m256, f: __m256) -> __m256 {
        // SAFETY: AVX2 present (trait contract).
        unsafe { _mm256_blendv_ps(f, t, _mm256_cmp_ps::<_CMP_LT_OQ>(a, b)) }
    }
    #[inline(always)]
    unsafe fn select_nan(x: __m256, t: __m256, f: __m256) -> __m256 {
        // SAFETY: AVX2 present (trait contract).
        unsafe { _mm256_blendv_ps(f, t, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x)) }
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        // SAFETY: a prefetch never faults, whatever the address; SSE present. Into L2
        // (T1): a whole tile would not fit in L1 beside the working set.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) }
    }
    #[inline(always)]
    unsafe fn transpose(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
        // SAFETY: 8 rows of 8 floats readable at src and writable at dst (trait contract);
        // AVX present.
        unsafe {
            let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * src_stride)));
            // Interleave pairs of rows, then pairs of pairs, then swap 128-bit halves.
            let t0 = _mm256_unpacklo_ps(r[0], r[1]);
            let t1 = _mm256_unpackhi_ps(r[0], r[1]);
            let t2 = _mm256_unpacklo_ps(r[2], r[3]);
            let t3 = _mm256_unpackhi_ps(r[2], r[3]);
            let t4 = _mm256_unpacklo_ps(r[4], r[5]);
            let t5 = _mm256_unpackhi_ps(r[4], r[5]);
            let t6 = _mm256_unpacklo_ps(r[6], r[7]);
            let t7 = _mm256_unpackhi_ps(r[6], r[7]);
            let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            let out = [
                _mm256_permute2f128_ps::<0x20>(u0, u4),
                _mm256_permute2f128_ps::<0x20>(u1, u5),
                _mm256_permute2f128_ps::<0x20>(u2, u6),
                _mm256_permute2f128_ps::<0x20>(u3, u7),
                _mm256_permute2f128_ps::<0x31>(u0, u4),
                _mm256_permute2f128_ps::<0x31>(u1, u5),
                _mm256_permute2f128_ps::<0x31>(u2, u6),
                _mm256_permute2f128_ps::<0x31>(u3, u7),
            ];
            for (c, v) in out.iter().enumerate() {
                _mm256_storeu_ps(dst.add(c * dst_stride), *v);
            }
        }
    }
    #[inline(always)]
    unsafe fn transpose8(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
        // SAFETY: 8 rows of 8 floats at src and dst (trait contract); AVX2 present (trait contract).
        unsafe { Self::transpose(src, src_stride, dst, dst_stride) }
    }
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: AVX present (trait contract).
        unsafe {
            let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            let h = _mm_add_ss(h, _mm_movehdup_ps(h));
            _mm_cvtss_f32(h)
        }
    }
    #[inline(always)]
    unsafe fn hmax(v: __m256) -> f32 {
        // SAFETY: AVX present (trait contract). maxps trees: a NaN lane loses to any number.
        unsafe {
            let h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            let h = _mm_max_ss(h, _mm_movehdup_ps(h));
            _mm_cvtss_f32(h)
        }
    }
    #[inline(always)]
    unsafe fn load_bf16_pair(p: *const u16) -> (__m256, __m256) {
        // SAFETY: 16 readable u16 at p (trait contract); AVX2 present. Little-endian: the
        // 32-bit lane i holds element 2i in its low half and 2i + 1 in its high half.
        unsafe {
            let x = _mm256_loadu_si256(p as *const __m256i);
            let even = _mm256_slli_epi32::<16>(x);
            let odd = _mm256_and_si256(x, _mm256_set1_epi32(0xffff_0000u32 as i32));
            (_mm256_castsi256_ps(even), _mm256_castsi256_ps(odd))
        }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> __m256 {
        // SAFETY: 8 readable u16 at p (trait contract); F16C present.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn widen_f16(src: *const u16, dst: *mut f32, n: usize) {
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n: 8 readable u16 and 8 writable f32 (caller's contract);
            // F16C present (trait contract).
            unsafe {
                let h = _mm_loadu_si128(src.add(i) as *const __m128i);
                _mm256_storeu_ps(dst.add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        for j in i..n {
            // SAFETY: j < n (caller's contract).
            unsafe { *dst.add(j) = half::f16::from_bits(*src.add(j)).to_f32() };
        }
    }
}

impl super::Arch for Avx2 {
    const QK_KEYS: usize = 6;
    const ROW_VECTORS: usize = 2;
    const PV_CHANNELS: usize = 6;
    const TASK_ROWS: usize = 1024;
    const TILE_KEYS: usize = 66;
}
