//! The portable path: 8-lane arrays of f32 with plain arithmetic (no fused multiply-add),
//! which the compiler may auto-vectorise for the build target. It is the twin every SIMD
//! kernel is tested against, and the fallback on CPUs without AVX2.

use super::Simd;

/// The portable "vector" of eight lanes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scalar;

const W: usize = 8;
type V = [f32; W];

#[inline(always)]
fn map(a: V, f: impl Fn(f32) -> f32) -> V {
    let mut r = [0.0; W];
    for i in 0..W {
        r[i] = f(a[i]);
    }
    r
}

#[inline(always)]
fn zip(a: V, b: V, f: impl Fn(f32, f32) -> f32) -> V {
    let mut r = [0.0; W];
    for i in 0..W {
        r[i] = f(a[i], b[i]);
    }
    r
}

/// Round half to even without libm (exact for every f32).
#[inline(always)]
fn round_even(x: f32) -> f32 {
    // 2^23: adding and subtracting it rounds to an integer in the current (nearest-even) mode.
    const BIG: f32 = 8_388_608.0;
    if x.is_nan() || x.abs() >= BIG {
        return x;
    }
    let r = if x >= 0.0 {
        (x + BIG) - BIG
    } else {
        (x - BIG) + BIG
    };
    // Keep the sign of zero like the hardware rounding does.
    if r == 0.0 {
        0.0f32.copysign(x)
    } else {
        r
    }
}

#[inline(always)]
fn floor(x: f32) -> f32 {
    let r = round_even(x);
    if r > x {
        r - 1.0
    } else {
        r
    }
}

// SAFETY: plain Rust arithmetic, valid on every CPU; the pointer contract is the trait's.
unsafe impl Simd for Scalar {
    type V = V;
    const W: usize = W;

    #[inline(always)]
    unsafe fn splat(x: f32) -> V {
        [x; W]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> V {
        // SAFETY: the caller guarantees W readable f32 at p (trait contract).
        unsafe { std::ptr::read_unaligned(p as *const V) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: V) {
        // SAFETY: the caller guarantees W writable f32 at p (trait contract).
        unsafe { std::ptr::write_unaligned(p as *mut V, v) }
    }
    #[inline(always)]
    unsafe fn add(a: V, b: V) -> V {
        zip(a, b, |x, y| x + y)
    }
    #[inline(always)]
    unsafe fn sub(a: V, b: V) -> V {
        zip(a, b, |x, y| x - y)
    }
    #[inline(always)]
    unsafe fn mul(a: V, b: V) -> V {
        zip(a, b, |x, y| x * y)
    }
    #[inline(always)]
    unsafe fn div(a: V, b: V) -> V {
        zip(a, b, |x, y| x / y)
    }
    #[inline(always)]
    unsafe fn fma(a: V, b: V, c: V) -> V {
        let mut r = [0.0; W];
        for i in 0..W {
            r[i] = a[i] * b[i] + c[i];
        }
        r
    }
    #[inline(always)]
    unsafe fn max(a: V, b: V) -> V {
        zip(a, b, |x, y| if x > y { x } else { y })
    }
    #[inline(always)]
    unsafe fn min(a: V, b: V) -> V {
        zip(a, b, |x, y| if x < y { x } else { y })
    }
    #[inline(always)]
    unsafe fn abs(a: V) -> V {
        map(a, f32::abs)
    }
    #[inline(always)]
    unsafe fn floor(a: V) -> V {
        map(a, floor)
    }
    #[inline(always)]
    unsafe fn pow2i(n: V) -> V {
        map(n, |n| {
            f32::from_bits(((n as i32).wrapping_add(127) as u32) << 23)
        })
    }
    #[inline(always)]
    unsafe fn pow2i_biased(biased: V) -> V {
        map(biased, |b| {
            f32::from_bits(((b.to_bits() as i32).wrapping_add(super::POW2I_BIAS) as u32) << 23)
        })
    }
    #[inline(always)]
    unsafe fn gt_mask(a: V, b: V) -> u32 {
        let mut mask = 0;
        for i in 0..W {
            if a[i] > b[i] {
                mask |= 1 << i;
            }
        }
        mask
    }
    #[inline(always)]
    unsafe fn select_lt(a: V, b: V, t: V, f: V) -> V {
        let mut r = [0.0; W];
        for i in 0..W {
            r[i] = if a[i] < b[i] { t[i] } else { f[i] };
        }
        r
    }
    #[inline(always)]
    unsafe fn select_nan(x: V, t: V, f: V) -> V {
        let mut r = [0.0; W];
        for i in 0..W {
            r[i] = if x[i].is_nan() { t[i] } else { f[i] };
        }
        r
    }
    #[inline(always)]
    unsafe fn prefetch(_p: *const u8) {}
    #[inline(always)]
    unsafe fn widen_f16(src: *const u16, dst: *mut f32, n: usize) {
        for i in 0..n {
            // SAFETY: the caller guarantees n readable u16 at src and n writable f32 at dst.
            unsafe { *dst.add(i) = half::f16::from_bits(*src.add(i)).to_f32() };
        }
    }
}

impl super::Arch for Scalar {
    const QK_KEYS: usize = 4;
    const ROW_VECTORS: usize = 2;
    const PV_CHANNELS: usize = 4;
    const TASK_ROWS: usize = 256;
    const TILE_KEYS: usize = 64;
}
