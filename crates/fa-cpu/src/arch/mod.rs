//! The instruction sets: a small vector trait ([`Simd`]) implemented for AVX-512F, AVX2+FMA
//! and a portable scalar fallback, each architecture's kernel sizes ([`Arch`]), the run-time
//! detection (done once, cached), and the element-wise functions written once on top of the
//! trait (`exp2`, `tanh`).
//!
//! This module is a leaf: it knows nothing of the kernels. The kernels in [`crate::kernel`] are
//! generic over [`Arch`] and marked `#[inline(always)]`; [`crate::dispatch`] picks the
//! architecture for a [`SimdLevel`] and enters its `#[target_feature]` trampoline, so the whole
//! tile loop is compiled with that architecture's instructions.

use std::sync::atomic::{AtomicU8, Ordering};

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) mod amx;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod scalar;

/// The instruction set a call runs on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SimdLevel {
    /// The best the CPU supports (detected once per process).
    #[default]
    Auto,
    /// AVX-512F plus Intel AMX tiles: bf16 inputs run their two products on AMX
    /// (`tdpbf16ps`, probabilities rounded to bf16 before `P·V`), and the backward's five
    /// (P and dS rounded to bf16 before the gradient products); everything else, and
    /// whatever the AMX kernel does not cover, runs as [`SimdLevel::Avx512f`]. `Auto` picks it
    /// where the CPU has AMX-BF16 and Linux grants the tile-data permission; ask for `Avx512f`
    /// (in the call's options) to keep AMX off.
    Amx,
    /// AVX-512F (16 f32 lanes, 32 registers).
    Avx512f,
    /// AVX2 with FMA and F16C (8 f32 lanes, 16 registers).
    Avx2Fma,
    /// Portable code (no intrinsics; the compiler may still auto-vectorise it).
    Scalar,
}

impl SimdLevel {
    /// The name [`crate::simd_level`] reports: `"avx512f+amx"`, `"avx512f"`, `"avx2+fma"`
    /// or `"scalar"` (`"auto"` for [`SimdLevel::Auto`]).
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Auto => "auto",
            SimdLevel::Amx => "avx512f+amx",
            SimdLevel::Avx512f => "avx512f",
            SimdLevel::Avx2Fma => "avx2+fma",
            SimdLevel::Scalar => "scalar",
        }
    }

    /// Whether this CPU can run the level (`Auto` and `Scalar` always can).
    pub fn is_available(self) -> bool {
        match self {
            SimdLevel::Auto | SimdLevel::Scalar => true,
            SimdLevel::Avx2Fma => detect_avx2(),
            SimdLevel::Avx512f => detect_avx512(),
            SimdLevel::Amx => detect_avx512() && amx::available(),
        }
    }

    /// `Auto` resolved to the detected level; other levels unchanged.
    pub fn resolve(self) -> SimdLevel {
        match self {
            SimdLevel::Auto => detected(),
            other => other,
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn detect_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}
#[cfg(not(target_arch = "x86_64"))]
fn detect_avx2() -> bool {
    false
}
#[cfg(target_arch = "x86_64")]
fn detect_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f") && detect_avx2()
}
#[cfg(not(target_arch = "x86_64"))]
fn detect_avx512() -> bool {
    false
}

/// Whether this CPU has AVX-512F with AVX512-BF16 and AVX512-BW (`vdpbf16ps`,
/// `vcvtne2ps2bf16`), detected once.
pub(crate) fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            detect_avx512()
                && std::arch::is_x86_feature_detected!("avx512bf16")
                && std::arch::is_x86_feature_detected!("avx512bw")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// 0: not detected yet; otherwise 1 + the level's index.
static DETECTED: AtomicU8 = AtomicU8::new(0);

/// The best level this CPU supports, detected on first use and cached.
pub(crate) fn detected() -> SimdLevel {
    match DETECTED.load(Ordering::Relaxed) {
        1 => SimdLevel::Avx512f,
        2 => SimdLevel::Avx2Fma,
        3 => SimdLevel::Scalar,
        4 => SimdLevel::Amx,
        _ => {
            let level = if detect_avx512() && amx::available() {
                SimdLevel::Amx
            } else if detect_avx512() {
                SimdLevel::Avx512f
            } else if detect_avx2() {
                SimdLevel::Avx2Fma
            } else {
                SimdLevel::Scalar
            };
            let code = match level {
                SimdLevel::Avx512f => 1,
                SimdLevel::Avx2Fma => 2,
                SimdLevel::Amx => 4,
                _ => 3,
            };
            DETECTED.store(code, Ordering::Relaxed);
            level
        }
    }
}

/// An architecture's kernel sizes: the register blocking of its micro-kernels and its tile
/// sizes (all in elements; the lanes are [`Simd::W`]). Only constants: reading them runs no
/// instruction of the architecture.
pub(crate) trait Arch: Simd {
    /// Keys per `QKᵀ` micro-kernel (its `MR`): a key tile is padded to a multiple of it.
    const QK_KEYS: usize;
    /// Row vectors per micro-kernel (`NR`, both kernels): a task's rows are padded to a
    /// multiple of `W·NR`, one row panel.
    const ROW_VECTORS: usize;
    /// Channels per `PV` micro-kernel (its `MR`): `head_dim_v` is padded to a multiple of it.
    const PV_CHANNELS: usize;
    /// Largest number of query rows (heads × positions) in a task: a multiple of
    /// `W·ROW_VECTORS`.
    const TASK_ROWS: usize;
    /// Keys per key tile (`Bc`): a multiple of `QK_KEYS`.
    const TILE_KEYS: usize;
}

/// A vector of `W` f32 lanes and the operations the kernels need.
///
/// # Safety
/// Every method may use instructions of its architecture: call them only from code compiled
/// for that architecture (inside its `#[target_feature]` entry point) after detection said
/// the CPU has it. Pointer arguments must be valid for `W` consecutive f32 (loads/stores).
pub(crate) unsafe trait Simd: Copy + 'static {
    /// The vector type.
    type V: Copy;
    /// Lanes per vector.
    const W: usize;
    /// All lanes `x`.
    unsafe fn splat(x: f32) -> Self::V;
    /// Loads `W` f32 from `p` (no alignment needed).
    unsafe fn load(p: *const f32) -> Self::V;
    /// Stores `W` f32 to `p` (no alignment needed).
    unsafe fn store(p: *mut f32, v: Self::V);
    /// `a + b`.
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// `a − b`.
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    /// `a · b`.
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// `a / b`.
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    /// `a·b + c` (fused where the architecture has FMA, else two roundings).
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// `if a > b { a } else { b }` per lane (so a NaN in `a` yields `b`: NaN never wins).
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// `if a < b { a } else { b }` per lane.
    unsafe fn min(a: Self::V, b: Self::V) -> Self::V;
    /// `|a|`.
    unsafe fn abs(a: Self::V) -> Self::V;
    /// Round down.
    unsafe fn floor(a: Self::V) -> Self::V;
    /// `2^n` for an integral float `n ∈ [−127, 128]`, built from exponent bits `n + 127`:
    /// 0 for `n = −127`, `+∞` for `n = 128` (NaN in gives some finite value: callers
    /// multiply it by a NaN anyway).
    unsafe fn pow2i(n: Self::V) -> Self::V;
    /// `2^n` from `biased = n + ROUND_MAGIC` (an integral `n ∈ [−127, 128]`), built from the
    /// integer bits of `biased`: `(bits(biased) − bits(ROUND_MAGIC) + 127) << 23`; 0 for
    /// `n = −127`, `+∞` for `n = 128`, as [`Simd::pow2i`].
    unsafe fn pow2i_biased(biased: Self::V) -> Self::V;
    /// [`exp2_exact`]'s result, bit for bit, for lanes `x ≤ 127` (NaN and `−∞` included):
    /// the softmax's arguments, which never exceed the rescale threshold
    /// ([`softmax_core::MAX_RESCALE_THRESHOLD`] = 64). Architectures with a scale-by-power-of-two
    /// instruction take fewer operations; the default is [`exp2_exact`] itself.
    #[inline(always)]
    unsafe fn exp2_softmax(x: Self::V) -> Self::V {
        // SAFETY: S available (caller).
        unsafe { exp2_exact::<Self>(x) }
    }
    /// [`exp2_cubic`]'s result, bit for bit, for lanes `x ≤ 127` (NaN and `−∞` included):
    /// the softmax's arguments under [`crate::Exp2Impl::Cubic`] (see [`Simd::exp2_softmax`]).
    /// Architectures with a scale-by-power-of-two instruction take fewer operations; the
    /// default is [`exp2_cubic`] itself.
    #[inline(always)]
    unsafe fn exp2_cubic_softmax(x: Self::V) -> Self::V {
        // SAFETY: S available (caller).
        unsafe { exp2_cubic::<Self>(x) }
    }
    /// A bit mask of the lanes where `a > b` (bit `i` for lane `i`; false where either is NaN).
    unsafe fn gt_mask(a: Self::V, b: Self::V) -> u32;
    /// `if a < b { t } else { f }` per lane.
    unsafe fn select_lt(a: Self::V, b: Self::V, t: Self::V, f: Self::V) -> Self::V;
    /// `if x is NaN { t } else { f }` per lane.
    unsafe fn select_nan(x: Self::V, t: Self::V, f: Self::V) -> Self::V;
    /// Hints the cache to fetch the line holding `p` (no effect on results; any address).
    unsafe fn prefetch(p: *const u8);
    /// Widens `n` f16 values (bit patterns) at `src` to f32 at `dst`.
    unsafe fn widen_f16(src: *const u16, dst: *mut f32, n: usize);
    /// Rounds `W` f32 at `lo` and `W` at `hi` to bf16 (to nearest even; NaN stays a quiet
    /// NaN) and stores them as `W` dwords, `dst[i] = bf16(lo[i]) | bf16(hi[i]) << 16`: a
    /// row of an AMX B tile (the VNNI pair layout) from two rows of f32. The default is the
    /// scalar loop over `half`'s conversion; architectures with integer vectors override it.
    #[inline(always)]
    unsafe fn bf16_pairs(lo: *const f32, hi: *const f32, dst: *mut u32) {
        for i in 0..Self::W {
            // SAFETY: i < W: inside the caller's W floats at lo and hi and W dwords at dst.
            unsafe {
                let l = half::bf16::from_f32(*lo.add(i)).to_bits() as u32;
                let h = half::bf16::from_f32(*hi.add(i)).to_bits() as u32;
                *dst.add(i) = l | (h << 16);
            }
        }
    }
    /// [`Simd::bf16_pairs`] from registers: `dst[i] = bf16(lo[i]) | bf16(hi[i]) << 16` for the
    /// `W` lanes. With `NATIVE` the architecture may use the CPU's own bf16 conversion
    /// (AVX512-BF16's `vcvtne2ps2bf16`, which also reads f32 denormals as zero — what AMX's
    /// `tdpbf16ps` does with bf16 denormals anyway); without it the result is exactly
    /// [`Simd::bf16_pairs`]'s. The default stores the lanes and calls [`Simd::bf16_pairs`].
    ///
    /// # Safety
    /// S available; `W` writable dwords at `dst`; with `NATIVE`, the CPU has AVX512-BF16 and
    /// AVX512-BW (every AMX-BF16 CPU: [`amx::available`] checks them).
    #[inline(always)]
    unsafe fn bf16_pairs_v<const NATIVE: bool>(lo: Self::V, hi: Self::V, dst: *mut u32) {
        let (mut l, mut h) = ([0.0f32; 16], [0.0f32; 16]);
        // SAFETY: both arrays hold 16 ≥ W floats; `dst` W dwords (caller).
        unsafe {
            Self::store(l.as_mut_ptr(), lo);
            Self::store(h.as_mut_ptr(), hi);
            Self::bf16_pairs(l.as_ptr(), h.as_ptr(), dst);
        }
    }
    /// The sum of the lanes, in an order of the architecture's choosing (a shuffle tree on
    /// x86; the default adds lane by lane).
    #[inline(always)]
    unsafe fn hsum(v: Self::V) -> f32 {
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` holds 16 ≥ W floats; S available (caller).
        unsafe { Self::store(lanes.as_mut_ptr(), v) };
        lanes[..Self::W].iter().sum()
    }
    /// The lane sums of eight vectors (`out[i] = hsum(v[i])`), in an order of the
    /// architecture's choosing: a transposing shuffle tree on AVX-512 (31 operations for
    /// eight sums, against ~9 per [`Simd::hsum`]); the default sums each on its own.
    #[inline(always)]
    unsafe fn hsum8(v: [Self::V; 8]) -> [f32; 8] {
        let mut out = [0.0f32; 8];
        for (o, x) in out.iter_mut().zip(v) {
            // SAFETY: S available (caller).
            *o = unsafe { Self::hsum(x) };
        }
        out
    }
    /// The largest lane (of lanes without NaN; callers keep NaN out of what they reduce).
    #[inline(always)]
    unsafe fn hmax(v: Self::V) -> f32 {
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` holds 16 ≥ W floats; S available (caller).
        unsafe { Self::store(lanes.as_mut_ptr(), v) };
        lanes[1..Self::W]
            .iter()
            .fold(lanes[0], |m, &x| if x > m { x } else { m })
    }
    /// Loads `2·W` bf16 values (bit patterns) at `p`, widened to f32 and **de-interleaved**:
    /// lane `i` of the first vector is element `2i`, of the second element `2i + 1`. Widening
    /// this way is a shift and a mask per vector, no shuffle; kernels that only sum products
    /// keep their other operand in the same order (see `kernel::decode_stream`).
    #[inline(always)]
    unsafe fn load_bf16_pair(p: *const u16) -> (Self::V, Self::V) {
        let (mut even, mut odd) = ([0.0f32; 16], [0.0f32; 16]);
        for i in 0..Self::W {
            // SAFETY: 2·W readable u16 at p (caller's contract).
            unsafe {
                even[i] = f32::from_bits((*p.add(2 * i) as u32) << 16);
                odd[i] = f32::from_bits((*p.add(2 * i + 1) as u32) << 16);
            }
        }
        // SAFETY: both arrays hold 16 ≥ W floats; S available (caller).
        unsafe { (Self::load(even.as_ptr()), Self::load(odd.as_ptr())) }
    }
    /// bf16 pair dot products: `a` and `b` each hold `2·W` bf16 values (bit patterns, loaded
    /// as they lie in memory: lane `i` has elements `2i` and `2i + 1`), and lane `i` of the
    /// result is `acc[i] + a[2i + 1]·b[2i + 1] + a[2i]·b[2i]` (the odd product added first,
    /// as Intel's pseudo-code for `vdpbf16ps` orders it; bf16 products are exact in f32).
    /// With `NATIVE` the architecture may use the CPU's `vdpbf16ps`, which also reads bf16
    /// denormals as zero and flushes denormal results (the rounding of the two additions may
    /// differ by CPU); without it, two f32 multiply-adds per lane. The default stores the
    /// lanes and widens them.
    ///
    /// # Safety
    /// S available; with `NATIVE`, the CPU has AVX512-BF16 (only AVX-512 overrides it).
    #[inline(always)]
    unsafe fn dot_bf16_pairs<const NATIVE: bool>(acc: Self::V, a: Self::V, b: Self::V) -> Self::V {
        let (mut la, mut lb) = ([0.0f32; 16], [0.0f32; 16]);
        // SAFETY: both arrays hold 16 ≥ W floats; S available (caller).
        unsafe {
            Self::store(la.as_mut_ptr(), a);
            Self::store(lb.as_mut_ptr(), b);
        }
        let split = |x: &[f32; 16]| {
            let (mut even, mut odd) = ([0.0f32; 16], [0.0f32; 16]);
            for i in 0..Self::W {
                even[i] = f32::from_bits(x[i].to_bits() << 16);
                odd[i] = f32::from_bits(x[i].to_bits() & 0xffff_0000);
            }
            (even, odd)
        };
        let ((ae, ao), (be, bo)) = (split(&la), split(&lb));
        // SAFETY: the arrays hold 16 ≥ W floats; S available (caller).
        unsafe {
            let odd = Self::fma(Self::load(ao.as_ptr()), Self::load(bo.as_ptr()), acc);
            Self::fma(Self::load(ae.as_ptr()), Self::load(be.as_ptr()), odd)
        }
    }
    /// Loads `W` f16 values (bit patterns) at `p`, widened to f32 in order.
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self::V {
        let mut lanes = [0.0f32; 16];
        // SAFETY: W readable u16 at p (caller's contract), `lanes` holds 16 ≥ W floats; S
        // available (caller).
        unsafe {
            Self::widen_f16(p, lanes.as_mut_ptr(), Self::W);
            Self::load(lanes.as_ptr())
        }
    }
    /// Transposes an 8 × 8 block: `dst[c·dst_stride + r] = src[r·src_stride + c]` for
    /// `r, c < 8` (packs K tiles into the AVX-512 QKᵀ kernel's 8-key groups). The default is
    /// the scalar loop; architectures with shuffles override it.
    #[inline(always)]
    unsafe fn transpose8(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
        for r in 0..8 {
            for c in 0..8 {
                // SAFETY: r, c < 8: inside both blocks (caller's contract).
                unsafe { *dst.add(c * dst_stride + r) = *src.add(r * src_stride + c) };
            }
        }
    }
    /// Transposes a `W × 4` strip: `dst[c·dst_stride + r] = src[r·src_stride + c]` for
    /// `r < W`, `c < 4` (`W` rows of 4 readable floats at `src`, 4 rows of `W` writable
    /// floats at `dst`, the two not overlapping): the columns of a C tile that a decode head's
    /// few query rows use, without [`Simd::transpose`]'s whole block. The default is the
    /// scalar loop; architectures with shuffles override it.
    #[inline(always)]
    unsafe fn transpose_w4(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
        for r in 0..Self::W {
            for c in 0..4 {
                // SAFETY: r < W, c < 4: inside both blocks (caller's contract).
                unsafe { *dst.add(c * dst_stride + r) = *src.add(r * src_stride + c) };
            }
        }
    }
    /// Transposes a `W × W` block: `dst[c·dst_stride + r] = src[r·src_stride + c]` for
    /// `r, c < W` (`W` rows of `W` readable floats at `src`, `W` rows of `W` writable floats
    /// at `dst`, the two not overlapping). The default is the scalar loop; architectures with
    /// shuffles override it.
    #[inline(always)]
    unsafe fn transpose(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
        for r in 0..Self::W {
            for c in 0..Self::W {
                // SAFETY: r, c < W: inside both blocks (caller's contract).
                unsafe { *dst.add(c * dst_stride + r) = *src.add(r * src_stride + c) };
            }
        }
    }
}

/// `2^f ≈ 1 + f·P(f)` on `[−½, ½]`, `P` of degree 4 (highest coefficient first): fitted here
/// for the smallest maximum relative error (iteratively reweighted least squares), 9.2e-8 in
/// exact arithmetic and 1.7e-7 evaluated in f32 with fused multiply-adds. One degree fewer than
/// Cephes' `exp2f` polynomial at the same accuracy: f32 rounding dominates either way.
pub(crate) const EXP2_EXACT: [f32; 5] = [
    1.326_468e-3,
    9.671_503e-3,
    5.550_734e-2,
    2.402_224_2e-1,
    6.931_470_4e-1,
];

/// `1.5·2^23`: adding it to an `x` with `|x| ≤ 2^22` rounds `x` to an integer (nearest, ties
/// to even) and leaves that integer in the low mantissa bits of the sum, so one addition
/// replaces a rounding instruction and a float-to-int conversion (see [`Simd::pow2i_biased`]).
pub(crate) const ROUND_MAGIC: f32 = 12_582_912.0;

/// What [`Simd::pow2i_biased`] adds to the integer bits of `n + ROUND_MAGIC` to get the biased
/// exponent `n + 127`.
pub(crate) const POW2I_BIAS: i32 = 127 - ROUND_MAGIC.to_bits() as i32;

/// Inputs are clamped to `[EXP2_LO, EXP2_HI]` before the range reduction: `2^−127` is built
/// as the scale 0 (so `−∞` and anything below −126.5 gives exactly 0) and `2^128` as `+∞`.
pub(crate) const EXP2_LO: f32 = -127.0;
/// See [`EXP2_LO`].
const EXP2_HI: f32 = 128.0;

/// Accurate `2^x` per lane: `2^x = p(x − n)·2^n` with `n = round(x)` and the degree-5
/// polynomial [`EXP2_EXACT`] on `[−½, ½]`; relative error below 3e-7 (about 2.5 ulp; measured
/// in the tests) wherever the result is a normal f32.
///
/// `n` comes from adding [`ROUND_MAGIC`], and `2^n` from the bits of that sum, which is 0 for
/// `n = −127` and `+∞` for `n = 128`. Special values need no branch or blend: `x` is clamped
/// to `[−127, 128]` (NaN passes through the clamp), so NaN → NaN, `x ≥ 127.5` → `+∞`,
/// `x < −126.5` (and `−∞`) → 0, and results between 2^−127 and 2^−126 come out subnormal.
/// About 14 vector operations, the softmax's main cost beside the two products.
#[inline(always)]
pub(crate) unsafe fn exp2_exact<S: Simd>(x: S::V) -> S::V {
    // SAFETY: the caller runs on S's architecture (trait contract).
    unsafe {
        let xc = S::min(S::splat(EXP2_HI), S::max(S::splat(EXP2_LO), x));
        let biased = S::add(xc, S::splat(ROUND_MAGIC));
        let n = S::sub(biased, S::splat(ROUND_MAGIC));
        let f = S::sub(xc, n);
        let mut p = S::splat(EXP2_EXACT[0]);
        for &c in &EXP2_EXACT[1..] {
            p = S::fma(p, f, S::splat(c));
        }
        let p = S::fma(p, f, S::splat(1.0));
        S::mul(p, S::pow2i_biased(biased))
    }
}

/// FlashAttention-4's cubic `2^x` per lane: the polynomial [`softmax_core::EXP2_CUBIC`] on
/// `[0, 1)` after `n = floor(x)`, evaluated in the same order as [`softmax_core::exp2_cubic`]
/// (with fused multiply-adds where the architecture has them). Special values as
/// [`exp2_exact`] (NaN → NaN, `−∞` → 0, `+∞` → `+∞`); unlike the scalar version it does not
/// flush results in `[2^−127, 2^−125)` to zero.
#[inline(always)]
pub(crate) unsafe fn exp2_cubic<S: Simd>(x: S::V) -> S::V {
    // SAFETY: the caller runs on S's architecture (trait contract).
    unsafe {
        let xc = S::min(S::splat(EXP2_HI), S::max(S::splat(EXP2_LO), x));
        let whole = S::floor(xc);
        let frac = S::sub(xc, whole);
        let [c0, c1, c2, c3] = softmax_core::EXP2_CUBIC;
        let p = S::fma(S::splat(c3), frac, S::splat(c2));
        let p = S::fma(p, frac, S::splat(c1));
        let p = S::fma(p, frac, S::splat(c0));
        S::mul(p, S::pow2i(whole))
    }
}

/// `tanh(y)` per lane as `1 − 2/(e^{2|y|} + 1)` with the sign of `y`: absolute error below
/// 1e-6 (what a softcap needs; measured in the tests). NaN → NaN.
#[inline(always)]
pub(crate) unsafe fn tanh<S: Simd>(y: S::V) -> S::V {
    // SAFETY: the caller runs on S's architecture (trait contract).
    unsafe {
        let a = S::min(S::abs(y), S::splat(9.0));
        let e = exp2_exact::<S>(S::mul(a, S::splat(2.0 * std::f32::consts::LOG2_E)));
        let one = S::splat(1.0);
        let t = S::sub(one, S::div(S::splat(2.0), S::add(e, one)));
        let signed = S::select_lt(y, S::splat(0.0), S::sub(S::splat(0.0), t), t);
        S::select_nan(y, y, signed)
    }
}
