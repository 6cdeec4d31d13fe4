//! AVX-512F: 16 f32 lanes, 32 registers.

use super::Simd;
use std::arch::x86_64::*;

/// The AVX-512 vector of sixteen f32 lanes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512;

// SAFETY: every method uses AVX-512F intrinsics only; the trait's contract makes the caller
// run them on a CPU that has AVX-512F, from code compiled for it.
unsafe impl Simd for Avx512 {
    type V = __m512;
    const W: usize = 16;

    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: 16 readable f32 at p (trait contract).
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        // SAFETY: 16 writable f32 at p (trait contract).
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn div(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract). vmaxps is exactly a > b ? a : b (the
        // second operand when either is NaN or both are zeros), one µop; a compare and blend
        // spelled the same rule in two, on the ports the FMAs need.
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn min(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract). vminps: a < b ? a : b, as above.
        unsafe { _mm512_min_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn abs(a: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe {
            _mm512_castsi512_ps(_mm512_and_si512(
                _mm512_castps_si512(a),
                _mm512_set1_epi32(0x7fff_ffff),
            ))
        }
    }
    #[inline(always)]
    unsafe fn floor(a: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe { _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(a) }
    }
    #[inline(always)]
    unsafe fn pow2i(n: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe {
            let biased = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased))
        }
    }
    #[inline(always)]
    unsafe fn pow2i_biased(biased: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe {
            let e = _mm512_add_epi32(
                _mm512_castps_si512(biased),
                _mm512_set1_epi32(super::POW2I_BIAS),
            );
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e))
        }
    }
    /// [`super::exp2_exact`]'s steps with AVX-512's rounding and scaling instructions: `n` by
    /// `vrndscaleps` (nearest, ties to even, as the `ROUND_MAGIC` sum gives it), `p·2^n` by
    /// `vscalefps` (correctly rounded, as the product with an exact `2^n` is), and `n = −127`
    /// (inputs below −126.5, and `−∞`) zeroed by the mask, where the default builds the scale
    /// 0: 10 operations against 13. No upper clamp: inputs stay at or below 127 (the caller's
    /// contract); NaN stays NaN (its lanes are unordered, so the mask keeps them).
    #[inline(always)]
    unsafe fn exp2_softmax(x: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe {
            let xc = _mm512_max_ps(_mm512_set1_ps(super::EXP2_LO), x);
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(xc);
            let f = _mm512_sub_ps(xc, n);
            let c = super::EXP2_EXACT;
            let mut p = _mm512_set1_ps(c[0]);
            for &ci in &c[1..] {
                p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(ci));
            }
            let p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0));
            let keep = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(n, _mm512_set1_ps(super::EXP2_LO));
            _mm512_maskz_scalef_ps(keep, p, n)
        }
    }
    /// [`super::exp2_cubic`]'s steps with AVX-512's rounding and scaling instructions:
    /// `floor` by `vrndscaleps`, `p·2^n` by `vscalefps` (correctly rounded, as the product
    /// with the exact `2^n` is), and `n = −127` (inputs below −126, and `−∞`) zeroed by the
    /// mask, where the default builds the scale 0: 8 operations against the default's 11 and
    /// [`Simd::exp2_softmax`]'s 10. The mask, not a lower clamp that scales to 0, gives the
    /// masked keys' zeros: a `vscalefps` that underflows takes a microcode assist (a clamp at
    /// −151 ran causal shapes at 0.5–0.8× on the GPU machine's Xeon; docs/history/gpu-notes.md,
    /// 2026-12-06). No upper clamp: inputs stay at or below 127 (the caller's contract); NaN
    /// stays NaN (its lanes are unordered, so the mask keeps them).
    #[inline(always)]
    unsafe fn exp2_cubic_softmax(x: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe {
            let xc = _mm512_max_ps(_mm512_set1_ps(super::EXP2_LO), x);
            let whole = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(xc);
            let frac = _mm512_sub_ps(xc, whole);
            let [c0, c1, c2, c3] = softmax_core::EXP2_CUBIC;
            let p = _mm512_fmadd_ps(_mm512_set1_ps(c3), frac, _mm512_set1_ps(c2));
            let p = _mm512_fmadd_ps(p, frac, _mm512_set1_ps(c1));
            let p = _mm512_fmadd_ps(p, frac, _mm512_set1_ps(c0));
            let keep = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(whole, _mm512_set1_ps(super::EXP2_LO));
            _mm512_maskz_scalef_ps(keep, p, whole)
        }
    }
    #[inline(always)]
    unsafe fn gt_mask(a: __m512, b: __m512) -> u32 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe { _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, b) as u32 }
    }
    #[inline(always)]
    unsafe fn select_lt(a: __m512, b: __m512, t: __m512, f: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe { _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, b), f, t) }
    }
    #[inline(always)]
    unsafe fn select_nan(x: __m512, t: __m512, f: __m512) -> __m512 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe { _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x), f, t) }
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        // SAFETY: a prefetch never faults, whatever the address; SSE present. Into L2
        // (T1): a whole tile would not fit in L1 beside the working set.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) }
    }
    #[inline(always)]
    unsafe fn transpose(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
        // Four 8×8 blocks with AVX2's shuffles (AVX2 is among this level's features): source
        // block (r0, c0) lands at (c0, r0). Replaces the trait's float-by-float default.
        for (r0, c0) in [(0, 0), (0, 8), (8, 0), (8, 8)] {
            // SAFETY: each block lies inside the 16 × 16 blocks of the caller's contract; AVX2
            // present (this level's features include it).
            unsafe {
                super::avx2::Avx2::transpose(
                    src.add(r0 * src_stride + c0),
                    src_stride,
                    dst.add(c0 * dst_stride + r0),
                    dst_stride,
                )
            }
        }
    }
    #[inline(always)]
    unsafe fn transpose_w4(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
        // SAFETY: 16 rows of 4 readable floats at src, 4 rows of 16 writable floats at dst
        // (trait contract); AVX-512F present.
        unsafe {
            // v[a]: 128-bit lane l holds source row 4l + a (one load, three load-inserts).
            // (Loops, not closures: the intrinsics stay inlined into the caller's features.)
            let mut v = [_mm512_setzero_ps(); 4];
            for (a, x) in v.iter_mut().enumerate() {
                let row = |r: usize| src.add(r * src_stride);
                *x = _mm512_castps128_ps512(_mm_loadu_ps(row(a)));
                *x = _mm512_insertf32x4::<1>(*x, _mm_loadu_ps(row(4 + a)));
                *x = _mm512_insertf32x4::<2>(*x, _mm_loadu_ps(row(8 + a)));
                *x = _mm512_insertf32x4::<3>(*x, _mm_loadu_ps(row(12 + a)));
            }
            // A 4 × 4 transpose inside each 128-bit lane: lane l of output c is column c of
            // rows 4l..4l + 4, i.e. output c is column c of all 16 rows in order.
            let t0 = _mm512_castps_pd(_mm512_unpacklo_ps(v[0], v[1]));
            let t1 = _mm512_castps_pd(_mm512_unpackhi_ps(v[0], v[1]));
            let t2 = _mm512_castps_pd(_mm512_unpacklo_ps(v[2], v[3]));
            let t3 = _mm512_castps_pd(_mm512_unpackhi_ps(v[2], v[3]));
            let out = [
                _mm512_unpacklo_pd(t0, t2),
                _mm512_unpackhi_pd(t0, t2),
                _mm512_unpacklo_pd(t1, t3),
                _mm512_unpackhi_pd(t1, t3),
            ];
            for (c, o) in out.into_iter().enumerate() {
                _mm512_storeu_ps(dst.add(c * dst_stride), _mm512_castpd_ps(o));
            }
        }
    }
    #[inline(always)]
    unsafe fn transpose8(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
        // SAFETY: 8 rows of 8 floats at src and dst (trait contract); AVX2 present (this level's features include it).
        unsafe { super::avx2::Avx2::transpose(src, src_stride, dst, dst_stride) }
    }
    #[inline(always)]
    unsafe fn bf16_pairs(lo: *const f32, hi: *const f32, dst: *mut u32) {
        // SAFETY: 16 readable f32 at lo and hi, 16 writable dwords at dst (trait contract);
        // AVX-512F present.
        unsafe { Self::bf16_pairs_v::<false>(_mm512_loadu_ps(lo), _mm512_loadu_ps(hi), dst) }
    }
    #[inline(always)]
    unsafe fn bf16_pairs_v<const NATIVE: bool>(lo: __m512, hi: __m512, dst: *mut u32) {
        /// Round to nearest even on the bits: add 0x7fff plus the lowest kept bit, keep the
        /// high half; NaNs instead keep their high half with the quiet bit set (what `half`
        /// does), so no NaN rounds into an infinity.
        #[inline(always)]
        unsafe fn round(x: __m512) -> __m512i {
            // SAFETY: AVX-512F present (caller).
            unsafe {
                let bits = _mm512_castps_si512(x);
                let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
                let rounded =
                    _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
                let quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x0040_0000));
                _mm512_mask_mov_epi32(rounded, nan, quiet)
            }
        }
        if NATIVE {
            // SAFETY: AVX512-BF16 and AVX512-BW present (caller); 16 writable dwords at dst.
            // `vcvtne2ps2bf16` puts lo's 16 bf16 in words 0..16 and hi's in 16..32; the word
            // permutation interleaves them (word 2i ← i, word 2i + 1 ← 16 + i).
            unsafe {
                let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                let idx = _mm512_set_epi16(
                    31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                    5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0,
                );
                _mm512_storeu_si512(dst as *mut __m512i, _mm512_permutexvar_epi16(idx, packed));
            }
            return;
        }
        // SAFETY: 16 writable dwords at dst (trait contract); AVX-512F present.
        unsafe {
            let l = _mm512_srli_epi32::<16>(round(lo));
            let h = _mm512_and_si512(round(hi), _mm512_set1_epi32(0xffff_0000u32 as i32));
            _mm512_storeu_si512(dst as *mut __m512i, _mm512_or_si512(l, h));
        }
    }
    #[inline(always)]
    unsafe fn hsum(v: __m512) -> f32 {
        // SAFETY: AVX-512F present (trait contract).
        unsafe { _mm512_reduce_add_ps(v) }
    }
    #[inline(always)]
    unsafe fn hsum8(v: [__m512; 8]) -> [f32; 8] {
        // SAFETY: AVX-512F present (trait contract). Each level halves the lanes per sum and
        // doubles the sums per vector: 256-bit halves, then 128-bit blocks (block k: the four
        // partials of v[k] or v[4 + k]), then pairs and neighbours inside each block.
        unsafe {
            let halves = |a: __m512, b: __m512| {
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                    _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
                )
            };
            let blocks = |a: __m512, b: __m512| {
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                    _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
                )
            };
            let lo = blocks(halves(v[0], v[1]), halves(v[2], v[3]));
            let hi = blocks(halves(v[4], v[5]), halves(v[6], v[7]));
            let pairs = _mm512_add_ps(
                _mm512_shuffle_ps::<0b10_00_10_00>(lo, hi),
                _mm512_shuffle_ps::<0b11_01_11_01>(lo, hi),
            );
            let sums = _mm512_add_ps(pairs, _mm512_permute_ps::<0b10_11_00_01>(pairs));
            let mut lanes = [0.0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), sums);
            [
                lanes[0], lanes[4], lanes[8], lanes[12], lanes[2], lanes[6], lanes[10], lanes[14],
            ]
        }
    }
    #[inline(always)]
    unsafe fn hmax(v: __m512) -> f32 {
        // SAFETY: AVX-512F present (trait contract). A tree of vmaxps: a NaN lane loses to
        // any number it meets, as in the trait's fold.
        unsafe {
            let h = _mm512_max_ps(v, _mm512_shuffle_f32x4::<0b01_00_11_10>(v, v));
            let h = _mm512_max_ps(h, _mm512_shuffle_f32x4::<0b10_11_00_01>(h, h));
            let h = _mm512_max_ps(h, _mm512_permute_ps::<0b01_00_11_10>(h));
            let h = _mm512_max_ps(h, _mm512_permute_ps::<0b10_11_00_01>(h));
            _mm512_cvtss_f32(h)
        }
    }
    #[inline(always)]
    unsafe fn load_bf16_pair(p: *const u16) -> (__m512, __m512) {
        // SAFETY: 32 readable u16 at p (trait contract); AVX-512F present. Little-endian: the
        // 32-bit lane i holds element 2i in its low half and 2i + 1 in its high half.
        unsafe {
            let x = _mm512_loadu_si512(p as *const _);
            let even = _mm512_slli_epi32::<16>(x);
            let odd = _mm512_and_si512(x, _mm512_set1_epi32(0xffff_0000u32 as i32));
            (_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd))
        }
    }
    #[inline(always)]
    unsafe fn dot_bf16_pairs<const NATIVE: bool>(acc: __m512, a: __m512, b: __m512) -> __m512 {
        if NATIVE {
            // SAFETY: AVX512-BF16 present (caller); the vectors' bits are 32 bf16 each
            // (transmutes between 512-bit vector types of the same size).
            return unsafe {
                _mm512_dpbf16_ps(
                    acc,
                    std::mem::transmute::<__m512, __m512bh>(a),
                    std::mem::transmute::<__m512, __m512bh>(b),
                )
            };
        }
        // SAFETY: AVX-512F present (trait contract). Even elements to the high half of each
        // lane by a shift, odd ones kept in place by a mask: exact bf16 → f32 widening.
        unsafe {
            let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
            let (ai, bi) = (_mm512_castps_si512(a), _mm512_castps_si512(b));
            let odd = _mm512_fmadd_ps(
                _mm512_castsi512_ps(_mm512_and_si512(ai, high)),
                _mm512_castsi512_ps(_mm512_and_si512(bi, high)),
                acc,
            );
            _mm512_fmadd_ps(
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(ai)),
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bi)),
                odd,
            )
        }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> __m512 {
        // SAFETY: 16 readable u16 at p (trait contract); AVX-512F present.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline(always)]
    unsafe fn widen_f16(src: *const u16, dst: *mut f32, n: usize) {
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 ≤ n: 16 readable u16 and 16 writable f32 (caller's contract);
            // AVX-512F present (trait contract).
            unsafe {
                let h = _mm256_loadu_si256(src.add(i) as *const __m256i);
                _mm512_storeu_ps(dst.add(i), _mm512_cvtph_ps(h));
            }
            i += 16;
        }
        for j in i..n {
            // SAFETY: j < n (caller's contract).
            unsafe { *dst.add(j) = half::f16::from_bits(*src.add(j)).to_f32() };
        }
    }
}

impl super::Arch for Avx512 {
    const QK_KEYS: usize = 8;
    const ROW_VECTORS: usize = 3;
    const PV_CHANNELS: usize = 8;
    const TASK_ROWS: usize = 1008;
    const TILE_KEYS: usize = 64;
}
