//! The AMX kernel: its bf16 conversion on every level against `half`, f16's exact split into
//! two bf16 over every f16, the whole forward on emulated tiles against the f64 reference over
//! odd shapes with bf16 and f16 inputs (every level, so the packing and the driver are checked
//! on any CPU), and — on CPUs with AMX — the hardware tiles against the emulation,
//! instruction by instruction and call by call.
//!
//! The hardware tests are `#[ignore]`d (`--include-ignored` on an AMX machine: Intel Sapphire
//! Rapids or later); run there they FAIL when AMX is missing or not granted, never pass
//! silently.

use super::amx_task::{bf16_bits, split_bf16};
use crate::arch::amx::{self, EmuTiles, Tiles};
use crate::arch::SimdLevel;
use crate::dispatch::{dispatch, Isa, SimdTask};
use crate::forward::{forward_on, AmxTiles};
use crate::{ForwardOptions, Workspace};
use fa_reference::{attention_f64, compare, poison, Case, ErrorReport, Rng, Rounding};
use half::{bf16, f16};
use softmax_core::{Mask, Out, Qkv};

/// Every level this CPU runs, `Amx` excluded (the emulation runs on the SIMD levels).
fn simd_levels() -> Vec<Isa> {
    [SimdLevel::Scalar, SimdLevel::Avx2Fma, SimdLevel::Avx512f]
        .into_iter()
        .filter_map(Isa::new)
        .collect()
}

/// `Simd::bf16_pairs` over a slice (`n` a multiple of `W`).
struct Pairs<'a> {
    lo: &'a [f32],
    hi: &'a [f32],
    out: &'a mut [u32],
}

impl SimdTask for Pairs<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: crate::arch::Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        for i in (0..self.out.len()).step_by(A::W) {
            // SAFETY: the slices hold a multiple of W elements; A available (dispatch).
            unsafe {
                A::bf16_pairs(
                    self.lo.as_ptr().add(i),
                    self.hi.as_ptr().add(i),
                    self.out.as_mut_ptr().add(i),
                )
            };
        }
    }
}

pub fn bf16_pairs_round_like_half_on_every_level() {
    let mut rng = Rng::new(181);
    let specials = [
        0.0f32,
        -0.0,
        1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7fff_ffff), // NaN, all payload bits
        f32::from_bits(0xffff_ffff),
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::from_bits(1),           // smallest subnormal
        f32::from_bits(0x3f80_8000), // a tie: rounds to even (down)
        f32::from_bits(0x3f81_8000), // a tie: rounds to even (up)
        f32::from_bits(0x7f7f_8000), // rounds up to infinity
        f32::from_bits(0x3f80_8001), // just above a tie
    ];
    let n = 16 * 64;
    let mut lo: Vec<f32> = (0..n)
        .map(|i| {
            let x = rng.normal() as f32 * 10f32.powi((i % 9) as i32 - 4);
            f32::from_bits(x.to_bits() ^ (rng.next_u64() as u32 & 0xffff))
        })
        .collect();
    let hi: Vec<f32> = lo.iter().rev().map(|x| -x * 0.37).collect();
    lo[..specials.len()].copy_from_slice(&specials);
    let want: Vec<u32> = lo
        .iter()
        .zip(&hi)
        .map(|(&l, &h)| {
            bf16::from_f32(l).to_bits() as u32 | (bf16::from_f32(h).to_bits() as u32) << 16
        })
        .collect();
    for isa in simd_levels() {
        let mut out = vec![0xdead_beefu32; n];
        dispatch(
            isa,
            Pairs {
                lo: &lo,
                hi: &hi,
                out: &mut out,
            },
        );
        for i in 0..n {
            let (g, w) = (out[i], want[i]);
            let nan = |b: u16| bf16::from_bits(b).is_nan();
            let same = |g: u16, w: u16| g == w || (nan(g) && nan(w));
            assert!(
                same(g as u16, w as u16) && same((g >> 16) as u16, (w >> 16) as u16),
                "{isa:?} element {i}: {:#x}/{:#x} -> {g:#010x}, want {w:#010x}",
                lo[i].to_bits(),
                hi[i].to_bits()
            );
        }
    }
}

/// A random tile of bf16 pairs (or f32), with some denormals, zeros and large values.
fn random_tile(rng: &mut Rng, f32_tile: bool) -> Vec<u32> {
    (0..256)
        .map(|i| {
            if f32_tile {
                return (rng.normal() as f32 * 4.0).to_bits();
            }
            let mut half = || -> u32 {
                match rng.below(40) {
                    0 => 0,
                    1 => rng.next_u64() as u32 & 0x007f, // bf16 denormal
                    2 => (rng.next_u64() as u32 & 0x007f) | 0x8000, // negative denormal
                    _ => bf16::from_f32(rng.normal() as f32 * 2f32.powi((i % 7) - 3)).to_bits()
                        as u32,
                }
            };
            half() | half() << 16
        })
        .collect()
}

/// One `C += A·B` on tiles `M`, through memory.
fn tile_dot<M: Tiles>(t: &mut M, a: &[u32], b: &[u32], c: &[u32]) -> Vec<u32> {
    let mut out = vec![0u32; 256];
    // SAFETY: each buffer holds 16 rows of 64 bytes at stride 64.
    unsafe {
        t.load::<1>(c.as_ptr() as *const u8, 64);
        t.load::<4>(a.as_ptr() as *const u8, 64);
        t.load::<6>(b.as_ptr() as *const u8, 64);
        t.dot::<1, 4, 6>();
        t.store::<1>(out.as_mut_ptr() as *mut u8, 64);
    }
    out
}

pub fn emulated_dot_is_the_dot_product_in_f32() {
    // The emulation against a plain f64 sum on values whose products and sums are exact in
    // f32 (small integers): the pair layout and the operand roles are right.
    let mut rng = Rng::new(5);
    let small = |rng: &mut Rng| bf16::from_f32(rng.below(9) as f32 - 4.0).to_bits() as u32;
    let a: Vec<u32> = (0..256)
        .map(|_| small(&mut rng) | small(&mut rng) << 16)
        .collect();
    let b: Vec<u32> = (0..256)
        .map(|_| small(&mut rng) | small(&mut rng) << 16)
        .collect();
    let c: Vec<u32> = (0..256).map(|i| (i as f32).to_bits()).collect();
    let got = tile_dot(&mut EmuTiles::new(), &a, &b, &c);
    let half = |w: u32, h: usize| bf16::from_bits((w >> (16 * h)) as u16).to_f64();
    for m in 0..16 {
        for n in 0..16 {
            let mut want = (m * 16 + n) as f64;
            for k in 0..16 {
                for h in 0..2 {
                    want += half(a[m * 16 + k], h) * half(b[k * 16 + n], h);
                }
            }
            assert_eq!(f32::from_bits(got[m * 16 + n]) as f64, want, "({m}, {n})");
        }
    }
}

pub fn bf16_bits_round_like_half() {
    // The packing's scalar rounding (f16's split) against `half` on special values and a
    // random sweep of bit patterns (NaNs compared as NaN).
    let mut rng = Rng::new(11);
    let specials = [
        0.0f32,
        -0.0,
        1.0,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-40,
        f32::INFINITY,
    ];
    let randoms = (0..200_000).map(|_| f32::from_bits(rng.next_u64() as u32));
    for x in specials
        .into_iter()
        .chain(specials.map(|x| -x))
        .chain(randoms)
    {
        let (got, want) = (bf16_bits(x) as u16, bf16::from_f32(x));
        if want.is_nan() {
            assert!(bf16::from_bits(got).is_nan(), "{x:e} ({:#x})", x.to_bits());
        } else {
            assert_eq!(got, want.to_bits(), "{x:e} ({:#x})", x.to_bits());
        }
    }
}

pub fn f16_splits_exactly_into_two_bf16() {
    // Every f16: hi is the value rounded to bf16, hi + lo is the value exactly, lo is a bf16
    // (its low 16 bits are zero in f32, checked by the round trip); infinities and NaN go
    // whole into hi.
    for bits in 0..=u16::MAX {
        let x = f16::from_bits(bits).to_f32();
        let (hi, lo) = split_bf16(x);
        let (h, l) = (bf16::from_bits(hi as u16), bf16::from_bits(lo as u16));
        assert!(hi <= 0xffff && lo <= 0xffff, "{bits:#x}");
        if x.is_nan() {
            assert!(h.is_nan() && lo == 0, "{bits:#x}");
            continue;
        }
        assert_eq!(h, bf16::from_f32(x), "{bits:#x}");
        if x.is_infinite() {
            assert_eq!(lo, 0, "{bits:#x}");
        } else {
            assert_eq!(h.to_f32() + l.to_f32(), x, "{bits:#x}: {h} + {l}");
            assert_eq!(l.to_f32(), x - h.to_f32(), "{bits:#x}");
        }
    }
}

/// Shapes for the forward sweeps (inputs rounded as asked): odd lengths, head dims not
/// multiples of 32, GQA, masks, softcap, varlen, padded strides.
fn cases(rng: &mut Rng, rounding: Rounding) -> Vec<(String, Case)> {
    let mut out = Vec::new();
    for &(sq, sk, hq, hkv, d) in &[
        (1, 1, 1, 1, 8),
        (17, 33, 2, 1, 40),
        (33, 100, 3, 3, 64),
        (100, 70, 4, 2, 80),
        (130, 257, 2, 1, 128),
        (64, 64, 1, 1, 256),
        (257, 129, 8, 1, 96),
        // Several whole key tiles and a partial one (`amx_keys_for`), head dim > 128.
        (40, 1100, 2, 1, 160),
    ] {
        let base = Case::dense(rng, 1, sq, sk, hq, hkv, d).round(rounding);
        out.push((format!("{sq}x{sk} h{hq}/{hkv} d{d}"), base.clone()));
        out.push((
            format!("{sq}x{sk} h{hq}/{hkv} d{d} causal"),
            base.clone().causal(),
        ));
        out.push((
            format!("{sq}x{sk} h{hq}/{hkv} d{d} window"),
            base.clone().with_mask(Mask::from_flash_args(false, 20, 5)),
        ));
        out.push((
            format!("{sq}x{sk} h{hq}/{hkv} d{d} softcap"),
            base.with_softcap(3.0).with_scale(0.5),
        ));
    }
    let mut dv = Case::dense(rng, 2, 70, 90, 4, 2, 48);
    dv.head_dim_v = 72;
    dv.fill(rng, rounding);
    out.push(("dv 72 != d 48, batch 2".into(), dv.causal()));
    let varlen = Case::varlen(rng, &[5, 64, 100], &[9, 64, 33], 4, 2, 64).round(rounding);
    out.push(("varlen".into(), varlen.causal()));
    let padded = Case::dense(rng, 2, 50, 77, 2, 1, 72).padded(rng, 3, rounding);
    out.push(("padded strides".into(), padded));
    out
}

/// The 16-bit input types of the AMX forward.
const HALVES: [Rounding; 2] = [Rounding::Bf16, Rounding::F16];

/// Output (f32) and LSE of the case through `forward_on` with its inputs in `half`'s type
/// (bf16 or f16: the case's values must be representable); outputs poisoned.
fn run_half(
    case: &Case,
    half: Rounding,
    opts: &ForwardOptions,
    tiles: AmxTiles,
) -> (Vec<f32>, Vec<f32>) {
    match half {
        Rounding::Bf16 => run_as(case, opts, tiles, bf16::from_f32),
        Rounding::F16 => run_as(case, opts, tiles, f16::from_f32),
        Rounding::F32 => panic!("the AMX forward takes bf16 or f16"),
    }
}

fn run_as<T: crate::Element>(
    case: &Case,
    opts: &ForwardOptions,
    tiles: AmxTiles,
    from_f32: fn(f32) -> T,
) -> (Vec<f32>, Vec<f32>) {
    let problem = case.desc().validate(256).expect("valid case");
    let lens = problem.min_buffer_lens();
    let mut out = vec![0.0f32; lens.o];
    poison(&mut out);
    let mut lse = vec![f32::NAN; problem.lse_len()];
    let conv = |x: &[f32]| x.iter().map(|&v| from_f32(v)).collect::<Vec<_>>();
    let (q, k, v) = (conv(&case.q), conv(&case.k), conv(&case.v));
    forward_on(
        &problem,
        Qkv::new(&q[..], &k[..], &v[..]),
        Out::with_lse(&mut out[..], &mut lse[..]),
        opts,
        &mut Workspace::new(),
        tiles,
    )
    .expect("forward");
    (out, lse)
}

fn report(case: &Case, out: &[f32], lse: Option<&[f32]>) -> ErrorReport {
    let problem = case.desc().validate(256).expect("valid case");
    let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
    compare(&problem, out, lse, &oracle)
}

/// Normwise bound of the AMX path against the f64 reference on the same bf16 or f16 inputs:
/// P's rounding to bf16 (2⁻⁹ relative per probability) gives ~1–3e-3 measured; the bf16/f16
/// contract is 1e-2. (f16 inputs are split exactly, so they see only P's rounding too.)
const AMX_BOUND: f64 = 5e-3;
/// The LSE does not see P's rounding (scores and sums stay f32).
const LSE_BOUND: f64 = 1e-4;

pub fn emulated_amx_forward_matches_the_reference_on_every_level() {
    let mut rng = Rng::fresh();
    for half in HALVES {
        let cases = cases(&mut rng, half);
        for isa in simd_levels() {
            for threads in [Some(1), Some(3)] {
                let opts = ForwardOptions {
                    simd: isa.level(),
                    threads,
                    ..ForwardOptions::default()
                };
                for (what, case) in &cases {
                    let (out, lse) = run_half(case, half, &opts, AmxTiles::Emulated);
                    let rep = report(case, &out, Some(&lse));
                    assert!(
                        rep.within(AMX_BOUND, LSE_BOUND),
                        "{half:?} {what} on {isa:?} (emulated AMX): {rep:?}"
                    );
                }
            }
        }
    }
}

pub fn emulated_amx_differs_from_the_simd_path_only_by_p_rounding() {
    // The same call without AMX keeps P in f32 (within 1e-5 of the reference): the AMX
    // result must be near it but not equal (P is rounded), so the AMX kernel really ran.
    let mut rng = Rng::fresh();
    for half in HALVES {
        for (what, case) in cases(&mut rng, half).iter().skip(4) {
            for isa in simd_levels() {
                let opts = ForwardOptions {
                    simd: isa.level(),
                    ..ForwardOptions::default()
                };
                let (amx_out, _) = run_half(case, half, &opts, AmxTiles::Emulated);
                let (simd_out, _) = run_half(case, half, &opts, AmxTiles::Hardware);
                let rep = report(case, &simd_out, None);
                assert!(rep.rel_l2 <= 1e-5, "{half:?} {what}: SIMD path {rep:?}");
                let diff = amx_out
                    .iter()
                    .zip(&simd_out)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert!(diff > 0, "{what} on {isa:?}: the AMX kernel did not run");
            }
        }
    }
}

/// f16 cases whose scores are large (scale 1, Q and K drawn with standard deviation 1.5 and
/// rounded to f16: |s| up to ~100), where the inputs' rounding to bf16 would show; the AMX
/// kernels' exact f16 split is for them. `heads` query heads share one KV head. Named by shape.
pub(super) fn large_score_f16_cases(rng: &mut Rng, heads: usize) -> Vec<(String, Case)> {
    [
        (40, 300, 64, false),
        (70, 70, 128, true),
        (33, 90, 200, false),
    ]
    .into_iter()
    .map(|(sq, sk, d, causal)| {
        let mut case = Case::dense(rng, 1, sq, sk, heads, 1, d).with_scale(1.0);
        case.fill(rng, Rounding::F32);
        for x in case.q.iter_mut().chain(&mut case.k) {
            *x = f16::from_f32(*x * 1.5).to_f32();
        }
        let case = if causal { case.causal() } else { case }.round(Rounding::F16);
        (format!("{sq}x{sk} d{d}"), case)
    })
    .collect()
}

pub fn emulated_amx_keeps_f16_scores_exact() {
    // Large scores (scale 1, |s| up to ~100) make the LSE sensitive to every input's
    // rounding: f16 inputs merely rounded to bf16 would move it by ~1e-1, which is what the
    // exact split into two bf16 is for. The LSE never sees P's rounding, so it must match the
    // f64 reference on the f16 inputs to f32 accuracy: a few f32 roundings of LSEs of ~50
    // over sums of up to 3·256 products (1.4e-4 seen on the scalar emulation, whose tiles
    // sum sequentially), and the dropped lo·lo products (≤ 2⁻¹⁶ of each term). The last
    // assertion shows the check can fail: the reference on the same inputs rounded to bf16 is
    // far outside it.
    let mut rng = Rng::fresh();
    let lse_bound = 1e-3;
    for (what, case) in large_score_f16_cases(&mut rng, 2) {
        for isa in simd_levels() {
            let opts = ForwardOptions {
                simd: isa.level(),
                ..ForwardOptions::default()
            };
            let (out, lse) = run_half(&case, Rounding::F16, &opts, AmxTiles::Emulated);
            let rep = report(&case, &out, Some(&lse));
            assert!(
                rep.within(AMX_BOUND, lse_bound),
                "{what} on {isa:?}: {rep:?}"
            );
        }
        let rounded = case.clone().round(Rounding::Bf16);
        let problem = case.desc().validate(256).expect("valid case");
        let exact = attention_f64(&problem, &case.q, &case.k, &case.v);
        let coarse = attention_f64(&problem, &rounded.q, &rounded.k, &rounded.v);
        let moved = exact
            .lse
            .iter()
            .zip(&coarse.lse)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f64, f64::max);
        eprintln!("{what}: bf16 rounding moves the LSE by {moved:e}");
        assert!(
            moved > 10.0 * lse_bound,
            "{what}: bf16 rounding moved the LSE by only {moved:e}"
        );
    }
}

/// Panics unless AMX is there: the hardware tests fail, never pass, without it.
fn require_amx() {
    assert!(
        amx::available(),
        "this test needs AMX-BF16 with Linux's tile-data permission (Intel Sapphire Rapids or \
         later); run it with --include-ignored only there"
    );
    assert!(SimdLevel::Amx.is_available());
}

pub fn hardware_tiles_match_the_emulation_to_f32_rounding() {
    // Measured on a Sapphire Rapids-class Xeon: the hardware's sums are not the ISA
    // reference's sequential order bit for bit (about half the elements differ in the last
    // bits, and neither a pairwise nor a one-rounding order matches all of them either), so
    // the twin check is a rounding-level bound: |hw − emu| ≤ 2⁻²⁰·(|c| + Σ|a·b|), a few
    // f32 roundings of the terms' magnitude. A wrong operand, layout or tile shows up as an
    // error of the order of the terms themselves.
    require_amx();
    let mut rng = Rng::fresh();
    let half = |w: u32, h: usize| f32::from_bits((w >> (16 * h)) << 16).abs() as f64;
    let mut differ = 0;
    for round in 0..200 {
        let (a, b) = (random_tile(&mut rng, false), random_tile(&mut rng, false));
        let c = random_tile(&mut rng, true);
        let mut hw = amx::HwTiles::configure().expect("AMX configured");
        let got = tile_dot(&mut hw, &a, &b, &c);
        drop(hw);
        let want = tile_dot(&mut EmuTiles::new(), &a, &b, &c);
        for m in 0..16 {
            for n in 0..16 {
                let i = m * 16 + n;
                let mut size = f32::from_bits(c[i]).abs() as f64;
                for k in 0..16 {
                    for h in 0..2 {
                        size += half(a[m * 16 + k], h) * half(b[k * 16 + n], h);
                    }
                }
                let (g, w) = (
                    f32::from_bits(got[i]) as f64,
                    f32::from_bits(want[i]) as f64,
                );
                differ += usize::from(got[i] != want[i]);
                assert!(
                    (g - w).abs() <= size * 2f64.powi(-20),
                    "round {round}, ({m}, {n}): hardware {g} emulation {w}, terms {size}"
                );
            }
        }
    }
    eprintln!(
        "hardware vs emulation: {differ} of {} elements differ in rounding",
        200 * 256
    );
}

pub fn hardware_amx_forward_matches_the_emulation_and_the_reference() {
    require_amx();
    let mut rng = Rng::fresh();
    let mut worst = 0.0f64;
    for threads in [Some(1), Some(2), None] {
        for (half, (what, case)) in HALVES
            .into_iter()
            .flat_map(|h| cases(&mut rng, h).into_iter().map(move |c| (h, c)))
        {
            let hw = ForwardOptions {
                simd: SimdLevel::Amx,
                threads,
                ..ForwardOptions::default()
            };
            let emu = ForwardOptions {
                simd: SimdLevel::Avx512f,
                ..hw
            };
            let (out, lse) = run_half(&case, half, &hw, AmxTiles::Hardware);
            let rep = report(&case, &out, Some(&lse));
            assert!(
                rep.within(AMX_BOUND, LSE_BOUND),
                "{half:?} {what} (hardware AMX): {rep:?}"
            );
            // The emulated tiles under the same AVX-512 softmax: the same up to the products'
            // f32 rounding and the P values whose bf16 rounding that flips. A flip moves one P
            // by one bf16 ulp (at most 2^-7 of it), so O moves by at most 2^-7 of Σ|p·v| / l:
            // 2^-7 normwise (cancellation aside; fresh random cases of few keys per row reached
            // 2.6e-4, past the 2e-4 this bound was before). The f64 reference check above is
            // the accuracy contract.
            let (eout, else_) = run_half(&case, half, &emu, AmxTiles::Emulated);
            let rel = |x: &[f32], y: &[f32]| {
                let (mut num, mut den) = (0.0f64, 0.0f64);
                // Equal non-finite values (LSE −∞ of rows that see no key, the poison left in
                // O's padding) are skipped: the reference check covers them.
                let skip = |a: &f32, b: &f32| !a.is_finite() && a.to_bits() == b.to_bits();
                for (a, b) in x.iter().zip(y).filter(|(a, b)| !skip(a, b)) {
                    num += (*a as f64 - *b as f64).powi(2);
                    den += (*b as f64).powi(2);
                }
                (num / den.max(f64::MIN_POSITIVE)).sqrt()
            };
            let (ro, rl) = (rel(&out, &eout), rel(&lse, &else_));
            assert!(
                ro <= 2f64.powi(-7) && rl <= 1e-6,
                "{half:?} {what}: hardware vs emulated O {ro:e}, LSE {rl:e}"
            );
            worst = worst.max(ro);
        }
    }
    eprintln!("hardware vs emulated forward: worst normwise difference {worst:e}");
}
