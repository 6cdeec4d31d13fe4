//! [`LibmFloat`]: the float trait of this crate's generic rules, whose transcendental functions
//! are always the `libm` crate's, so a result does not depend on what else a build contains.
//!
//! `num_traits::Float::exp2`, `log2` and `tanh` are not one implementation: num-traits
//! forwards them to `std` (the platform's C math library, through LLVM intrinsics) when its
//! `std` feature is on and to the `libm` crate otherwise, and Cargo turns that feature on for
//! every crate of a build as soon as one crate in it asks for it, whatever this crate's own
//! features say: proptest does, a dev-dependency of softmax-core, fa-cpu and fa-fp8, so a
//! `fa` built together with their tests (`cargo test` over the workspace) got the platform's
//! functions and one from `cargo build -p fa-cli` the `libm` crate's; an application would get
//! either depending on its other dependencies. The two differ in the last bit on some inputs
//! (glibc's `log2f` and libm's on about 2 % of the f32 values in `[1, 2²⁴)`), enough to move
//! the LSE by up to 2 ulp in 128 of 16384 rows (bf16, head dim 256, 2048 tokens, 8 heads) and
//! the backward's gradients with it. The rules here call these methods instead, which are the
//! `libm` crate's in every build.

use num_traits::Float;

/// `num_traits::Float` plus `exp2`, `log2` and `tanh` fixed to the `libm` crate (pure Rust,
/// the same bits on every platform and in every build, whatever features Cargo unifies).
///
/// Every rule of this crate that needs one of them (the online softmax's correction, merge
/// and LSE, the rescale check, the softcap) takes `T: LibmFloat`; implemented for `f32` and
/// `f64`.
pub trait LibmFloat: Float {
    /// `2^self` (`libm::exp2f` / `libm::exp2`).
    fn libm_exp2(self) -> Self;
    /// `log2(self)` (`libm::log2f` / `libm::log2`).
    fn libm_log2(self) -> Self;
    /// `tanh(self)` (`libm::tanhf` / `libm::tanh`).
    fn libm_tanh(self) -> Self;
}

/// `impl LibmFloat for $float` with the `libm` crate's three functions of that width.
macro_rules! libm_float {
    ($float:ty, $exp2:path, $log2:path, $tanh:path) => {
        impl LibmFloat for $float {
            #[inline]
            fn libm_exp2(self) -> $float {
                $exp2(self)
            }
            #[inline]
            fn libm_log2(self) -> $float {
                $log2(self)
            }
            #[inline]
            fn libm_tanh(self) -> $float {
                $tanh(self)
            }
        }
    };
}

libm_float!(f32, libm::exp2f, libm::log2f, libm::tanhf);
libm_float!(f64, libm::exp2, libm::log2, libm::tanh);

#[cfg(test)]
mod tests {
    //! Under `cargo test` num-traits has its `std` feature (proptest, a dev-dependency, asks
    //! for it), so `Float::exp2`/`log2` are the platform's here: these tests fail if a rule
    //! goes back to them (glibc's `log2f` differs from libm's on ~2 % of these sums).
    use crate::{merge_into, RescalePolicy, RescaleStats, RowState, ScoreTransform};

    /// A fixed stream of `n` values in `[lo, hi)` (an LCG; no zeros, odd spacing).
    fn values(n: usize, seed: u64, lo: f64, hi: f64) -> impl Iterator<Item = f64> {
        let mut s = seed;
        (0..n).map(move |_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            lo + (hi - lo) * ((s >> 11) as f64 / (1u64 << 53) as f64)
        })
    }

    #[test]
    fn lse_and_corrections_are_libm_bit_for_bit_f32() {
        let ln2 = core::f64::consts::LN_2 as f32;
        let maxima = values(20_000, 1, -60.0, 60.0);
        let sums = values(20_000, 2, 1.0, 3.0e6);
        let policy = RescalePolicy::Always;
        for (m, l) in maxima.zip(sums) {
            let (m, l) = (m as f32, l as f32);
            let state = RowState { max: m, sum: l };
            let lse = state.finish().lse;
            let want = (m + libm::log2f(l)) * ln2;
            assert_eq!(lse.to_bits(), want.to_bits(), "LSE of m {m} ℓ {l}");

            // A block whose maximum is above the reference moves it: the correction and the
            // rescaled sum use libm's exp2.
            let block_max = m + (l.fract() * 9.0 + 0.01);
            let mut moved = state;
            let step = moved.begin_block(block_max, &policy, &mut RescaleStats::default());
            let corr = libm::exp2f(m - block_max);
            assert_eq!(
                step.correction.to_bits(),
                corr.to_bits(),
                "correction {m} → {block_max}"
            );
            assert_eq!(moved.sum.to_bits(), (l * corr).to_bits());

            // The merge's factors.
            let other = RowState {
                max: block_max,
                sum: 1.5f32,
            };
            let (merged, fa, fb) = state.merge(other);
            assert_eq!(
                (fa.to_bits(), fb.to_bits()),
                (corr.to_bits(), 1.0f32.to_bits())
            );
            assert_eq!(merged.sum.to_bits(), (l * corr + 1.5).to_bits());
            let (mut a, mut acc) = (state, [2.0f32]);
            merge_into(&mut a, &mut acc, &other, &[3.0]);
            assert_eq!(acc[0].to_bits(), (2.0 * corr + 3.0f32).to_bits());
        }
    }

    #[test]
    fn lse_and_corrections_are_libm_bit_for_bit_f64() {
        let ln2 = core::f64::consts::LN_2;
        let policy = RescalePolicy::Always;
        for (m, l) in values(5_000, 3, -60.0, 60.0).zip(values(5_000, 4, 1.0, 3.0e6)) {
            let state = RowState { max: m, sum: l };
            let want = (m + libm::log2(l)) * ln2;
            assert_eq!(state.finish().lse.to_bits(), want.to_bits());
            let mut moved = state;
            let step = moved.begin_block(m + 1.25, &policy, &mut RescaleStats::default());
            assert_eq!(step.correction.to_bits(), libm::exp2(-1.25f64).to_bits());
        }
    }

    #[test]
    fn softcap_tanh_and_threshold_check_are_libm() {
        let t = ScoreTransform::<f32>::new(0.125, Some(30.0));
        let (pre, post) = (t.pre_factor(), t.softcap_post_factor().unwrap());
        for dot in values(20_000, 5, -400.0, 400.0) {
            let dot = dot as f32;
            let want = libm::tanhf(dot * pre) * post;
            assert_eq!(t.apply(dot).to_bits(), want.to_bits(), "softcap of {dot}");
        }
        // fits: τ + offset < log2(max) with libm's log2 (e4m3: 8 + 0.8 < log2 448 ≈ 8.807).
        let p = RescalePolicy::Threshold(8.0f32);
        assert_eq!(p.fits(0.8, 448.0), 8.8 < libm::log2f(448.0));
        assert!(!p.fits(0.81, 448.0));
    }
}
