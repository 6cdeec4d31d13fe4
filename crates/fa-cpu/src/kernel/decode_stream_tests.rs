//! The streaming decode kernels ([`dots`], [`pv_rows`]) on every SIMD level against the scalar
//! twin and f64, over odd head dims, every row block (1–4 rows), every key step (1, 2, 4 keys)
//! and the three element types; and the bf16 pair load against the scalar widening.

use super::decode_stream::{dots, natural_row, padded, pv_rows, reg_pos};
use crate::arch::{Arch, SimdLevel};
use crate::dispatch::{dispatch, Isa, SimdTask};
use crate::element::Element;
use fa_reference::Rng;

const DIMS: [usize; 10] = [1, 7, 15, 16, 31, 33, 64, 100, 128, 257];

/// The levels this CPU has, scalar first.
fn levels() -> Vec<(Isa, &'static str)> {
    [
        (SimdLevel::Scalar, "scalar"),
        (SimdLevel::Avx2Fma, "avx2"),
        (SimdLevel::Avx512f, "avx512"),
    ]
    .into_iter()
    .filter_map(|(l, n)| Isa::new(l).map(|i| (i, n)))
    .collect()
}

/// The lanes of a level.
fn lanes(isa: Isa) -> usize {
    super::Tiling::for_level(isa.level()).lanes
}

/// `rows` natural-order rows of `n` floats → register order for element type `T`, padded.
fn to_reg<T: Element>(rows: &[f32], n: usize, w: usize) -> Vec<f32> {
    let (pad, chunk) = (padded(n, w), 2 * w);
    let count = rows.len() / n.max(1);
    let mut out = vec![0.0f32; count * pad];
    for r in 0..count {
        for e in 0..n {
            out[r * pad + e / chunk * chunk + reg_pos::<T>(w, e % chunk)] = rows[r * n + e];
        }
    }
    out
}

/// Register-order rows back to natural order.
fn from_reg<T: Element>(rows: &[f32], n: usize, w: usize) -> Vec<f32> {
    let (pad, chunk) = (padded(n, w), 2 * w);
    let count = rows.len() / pad;
    let mut out = vec![0.0f32; count * n];
    for r in 0..count {
        for e in 0..n {
            out[r * n + e] = rows[r * pad + e / chunk * chunk + reg_pos::<T>(w, e % chunk)];
        }
    }
    out
}

/// [`dots`] on slices: `out[g][u] = q_g · k_u` (q in register order).
struct Dots<'a, T> {
    q: &'a [f32],
    k: &'a [Vec<T>],
    d: usize,
    out: &'a mut [f32],
}

impl<T: Element> SimdTask for Dots<'_, T> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        let Dots { q, k, d, out } = self;
        let pad = padded(d, A::W);
        let (rows, keys) = (q.len() / pad, k.len());
        assert!(out.len() >= rows * keys && k.iter().all(|r| r.len() == d));
        let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
        // SAFETY: q holds `rows` padded rows, out rows × keys floats (asserted); A available.
        unsafe {
            match (rows, keys) {
                (4, 2) => dots::<A, T, 4, 2>(qp, pad, [&k[0], &k[1]], d, op, keys),
                (3, 2) => dots::<A, T, 3, 2>(qp, pad, [&k[0], &k[1]], d, op, keys),
                (2, 2) => dots::<A, T, 2, 2>(qp, pad, [&k[0], &k[1]], d, op, keys),
                (1, 2) => dots::<A, T, 1, 2>(qp, pad, [&k[0], &k[1]], d, op, keys),
                (4, 1) => dots::<A, T, 4, 1>(qp, pad, [&k[0]], d, op, keys),
                (3, 1) => dots::<A, T, 3, 1>(qp, pad, [&k[0]], d, op, keys),
                (2, 1) => dots::<A, T, 2, 1>(qp, pad, [&k[0]], d, op, keys),
                (1, 1) => dots::<A, T, 1, 1>(qp, pad, [&k[0]], d, op, keys),
                other => panic!("no dots instance for {other:?}"),
            }
        }
    }
}

/// [`pv_rows`] on slices: `o_g += Σ_u p[g][u]·v_u` (o in register order).
struct Pv<'a, T> {
    p: &'a [f32],
    v: &'a [Vec<T>],
    dv: usize,
    o: &'a mut [f32],
}

impl<T: Element> SimdTask for Pv<'_, T> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        let Pv { p, v, dv, o } = self;
        let pad = padded(dv, A::W);
        let (rows, keys) = (o.len() / pad, v.len());
        assert!(p.len() >= rows * keys && v.iter().all(|r| r.len() == dv));
        let (pp, op) = (p.as_ptr(), o.as_mut_ptr());
        // SAFETY: p holds rows × keys, o `rows` padded rows (asserted); A available.
        unsafe {
            match (rows, keys) {
                (4, 4) => {
                    pv_rows::<A, T, 4, 4>(pp, keys, [&v[0], &v[1], &v[2], &v[3]], dv, op, pad)
                }
                (3, 4) => {
                    pv_rows::<A, T, 3, 4>(pp, keys, [&v[0], &v[1], &v[2], &v[3]], dv, op, pad)
                }
                (2, 4) => {
                    pv_rows::<A, T, 2, 4>(pp, keys, [&v[0], &v[1], &v[2], &v[3]], dv, op, pad)
                }
                (1, 4) => {
                    pv_rows::<A, T, 1, 4>(pp, keys, [&v[0], &v[1], &v[2], &v[3]], dv, op, pad)
                }
                (4, 1) => pv_rows::<A, T, 4, 1>(pp, keys, [&v[0]], dv, op, pad),
                (3, 1) => pv_rows::<A, T, 3, 1>(pp, keys, [&v[0]], dv, op, pad),
                (2, 1) => pv_rows::<A, T, 2, 1>(pp, keys, [&v[0]], dv, op, pad),
                (1, 1) => pv_rows::<A, T, 1, 1>(pp, keys, [&v[0]], dv, op, pad),
                other => panic!("no pv_rows instance for {other:?}"),
            }
        }
    }
}

fn draw(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal() as f32).collect()
}

/// Runs both kernels for element type `T` on every level and shape, against f64 (of the
/// widened inputs) and, for the SIMD levels, against the scalar twin.
fn kernels_match<T: Element>(seed: u64) {
    let mut rng = Rng::new(seed);
    for &d in &DIMS {
        for rows in 1..=4usize {
            for keys in [1usize, 2, 4] {
                let q = draw(&mut rng, rows * d);
                let kv: Vec<Vec<T>> = (0..keys)
                    .map(|_| draw(&mut rng, d).into_iter().map(T::from_f32).collect())
                    .collect();
                let p: Vec<f32> = (0..rows * keys).map(|_| rng.uniform() as f32).collect();
                let o0 = draw(&mut rng, rows * d);
                // f64 references on the widened inputs.
                let dot_want: Vec<f64> = (0..rows * keys)
                    .map(|i| {
                        let (g, u) = (i / keys, i % keys);
                        (0..d)
                            .map(|c| q[g * d + c] as f64 * kv[u][c].to_f32() as f64)
                            .sum()
                    })
                    .collect();
                let pv_want: Vec<f64> = (0..rows * d)
                    .map(|i| {
                        let (g, c) = (i / d, i % d);
                        o0[i] as f64
                            + (0..keys)
                                .map(|u| p[g * keys + u] as f64 * kv[u][c].to_f32() as f64)
                                .sum::<f64>()
                    })
                    .collect();
                let mut twin: Option<(Vec<f32>, Vec<f32>)> = None;
                for (isa, name) in levels() {
                    let w = lanes(isa);
                    if keys != 4 {
                        let qr = to_reg::<T>(&q, d, w);
                        let mut out = vec![f32::NAN; rows * keys];
                        dispatch(
                            isa,
                            Dots {
                                q: &qr,
                                k: &kv,
                                d,
                                out: &mut out,
                            },
                        );
                        let scale = (d as f64).sqrt() * 1e-6;
                        for (i, (&got, &want)) in out.iter().zip(&dot_want).enumerate() {
                            assert!(
                                (got as f64 - want).abs() <= scale * (1.0 + want.abs()),
                                "{name} {} dots d={d} rows={rows} keys={keys} [{i}]: {got} vs {want}",
                                T::NAME
                            );
                        }
                        if let Some((twin_dots, _)) = &twin {
                            for (&a, &b) in out.iter().zip(twin_dots) {
                                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()) * d as f32);
                            }
                        } else {
                            twin = Some((out, Vec::new()));
                        }
                    }
                    if keys != 2 {
                        let mut or = to_reg::<T>(&o0, d, w);
                        // Padding lanes hold garbage the kernel must carry, never spread.
                        let pad = padded(d, w);
                        for r in 0..rows {
                            for e in d..pad {
                                or[r * pad
                                    + e / (2 * w) * (2 * w)
                                    + reg_pos::<T>(w, e % (2 * w))] = 7.0;
                            }
                        }
                        dispatch(
                            isa,
                            Pv {
                                p: &p,
                                v: &kv,
                                dv: d,
                                o: &mut or,
                            },
                        );
                        let got = from_reg::<T>(&or, d, w);
                        for (i, (&g, &want)) in got.iter().zip(&pv_want).enumerate() {
                            assert!(
                                (g as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                                "{name} {} pv d={d} rows={rows} keys={keys} [{i}]: {g} vs {want}",
                                T::NAME
                            );
                        }
                        match &mut twin {
                            Some((_, twin_pv)) if !twin_pv.is_empty() => {
                                for (&a, &b) in got.iter().zip(twin_pv.iter()) {
                                    assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()));
                                }
                            }
                            Some((_, twin_pv)) => *twin_pv = got,
                            None => twin = Some((Vec::new(), got)),
                        }
                    }
                }
            }
        }
    }
}

pub fn stream_kernels_match_scalar_twin_and_f64_f32() {
    kernels_match::<f32>(1511);
}

pub fn stream_kernels_match_scalar_twin_and_f64_bf16() {
    kernels_match::<half::bf16>(1512);
}

pub fn stream_kernels_match_scalar_twin_and_f64_f16() {
    kernels_match::<half::f16>(1513);
}

/// [`crate::arch::Simd::load_bf16_pair`] and [`crate::arch::Simd::load_f16`] against the scalar widening.
struct Loads<'a> {
    src: &'a [u16],
    even: &'a mut [f32],
    odd: &'a mut [f32],
    f16: &'a mut [f32],
}

impl SimdTask for Loads<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        assert!(self.src.len() >= 2 * A::W && self.even.len() >= A::W);
        assert!(self.odd.len() >= A::W && self.f16.len() >= A::W);
        // SAFETY: 2·W readable u16, W writable floats in each output (asserted); A available.
        unsafe {
            let (e, o) = A::load_bf16_pair(self.src.as_ptr());
            A::store(self.even.as_mut_ptr(), e);
            A::store(self.odd.as_mut_ptr(), o);
            A::store(self.f16.as_mut_ptr(), A::load_f16(self.src.as_ptr()));
        }
    }
}

pub fn pair_loads_widen_exactly() {
    let mut rng = Rng::new(1514);
    for (isa, name) in levels() {
        let w = lanes(isa);
        for _ in 0..200 {
            let src: Vec<u16> = (0..2 * w).map(|_| rng.below(1 << 16) as u16).collect();
            let (mut even, mut odd, mut f16) = (vec![0.0; w], vec![0.0; w], vec![0.0; w]);
            dispatch(
                isa,
                Loads {
                    src: &src,
                    even: &mut even,
                    odd: &mut odd,
                    f16: &mut f16,
                },
            );
            for i in 0..w {
                let bf = |x: u16| half::bf16::from_bits(x).to_f32();
                let same =
                    |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
                assert!(same(even[i], bf(src[2 * i])), "{name} even {i}");
                assert!(same(odd[i], bf(src[2 * i + 1])), "{name} odd {i}");
                assert!(
                    same(f16[i], half::f16::from_bits(src[i]).to_f32()),
                    "{name} f16 {i}"
                );
            }
        }
    }
}

/// [`crate::arch::Simd::hsum`], [`crate::arch::Simd::hmax`] and
/// [`crate::arch::Simd::hsum8`] against plain folds.
struct Horizontal<'a> {
    x: &'a [f32],
    out: &'a mut [f32; 2],
    eight: &'a mut [f32; 8],
}

impl SimdTask for Horizontal<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        assert!(self.x.len() >= 8 * A::W);
        // SAFETY: 8·W readable floats (asserted); A available.
        unsafe {
            let v = A::load(self.x.as_ptr());
            self.out[0] = A::hsum(v);
            self.out[1] = A::hmax(v);
            let mut vs = [v; 8];
            for (i, x) in vs.iter_mut().enumerate() {
                *x = A::load(self.x.as_ptr().add(i * A::W));
            }
            *self.eight = A::hsum8(vs);
        }
    }
}

pub fn horizontal_sum_and_max() {
    let mut rng = Rng::new(1515);
    for (isa, name) in levels() {
        let w = lanes(isa);
        for _ in 0..200 {
            let mut x = draw(&mut rng, 8 * w);
            if rng.below(4) == 0 {
                x[rng.below(w)] = f32::NEG_INFINITY;
            }
            let (mut out, mut eight) = ([0.0f32; 2], [0.0f32; 8]);
            dispatch(
                isa,
                Horizontal {
                    x: &x,
                    out: &mut out,
                    eight: &mut eight,
                },
            );
            for (i, &got) in eight.iter().enumerate() {
                let want: f64 = x[i * w..(i + 1) * w].iter().map(|&v| v as f64).sum();
                assert!(
                    (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()) || want.is_infinite(),
                    "{name} hsum8 [{i}]: {got} vs {want}"
                );
            }
            let sum: f64 = x[..w].iter().map(|&v| v as f64).sum();
            let max = x[..w].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert!(
                (out[0] as f64 - sum).abs() <= 1e-5 * (1.0 + sum.abs()) || sum.is_infinite(),
                "{name} hsum"
            );
            assert_eq!(out[1], max, "{name} hmax");
        }
    }
}

/// [`crate::arch::Simd::transpose_w4`] on one level: `W` rows of 4 floats, `src_stride`
/// apart, into 4 rows of `W`, `dst_stride` apart.
struct Strip<'a> {
    src: &'a [f32],
    src_stride: usize,
    dst: &'a mut [f32],
    dst_stride: usize,
}

impl SimdTask for Strip<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        assert!(self.src.len() >= (A::W - 1) * self.src_stride + 4);
        assert!(self.dst.len() >= 3 * self.dst_stride + A::W);
        // SAFETY: W rows of 4 floats at src and 4 rows of W at dst (asserted), disjoint
        // slices; A available.
        unsafe {
            A::transpose_w4(
                self.src.as_ptr(),
                self.src_stride,
                self.dst.as_mut_ptr(),
                self.dst_stride,
            )
        };
    }
}

/// The narrow transpose of the AMX `Q·Kᵀ`'s C tile on every level against its definition
/// (the scalar twin is the trait's default): exact, over odd strides and offsets, and nothing
/// outside the 4 destination rows written.
pub fn strip_transpose_matches_the_definition() {
    let mut rng = Rng::new(1516);
    for (isa, name) in levels() {
        let w = lanes(isa);
        for (src_stride, dst_stride) in [(4, w), (16, 16), (5, w + 3), (17, 2 * w + 1)] {
            let src = draw(&mut rng, (w - 1) * src_stride + 4 + 3);
            let from = rng.below(4);
            let poison = -1234.5f32;
            let mut dst = vec![poison; 3 * dst_stride + w + 5];
            dispatch(
                isa,
                Strip {
                    src: &src[from..],
                    src_stride,
                    dst: &mut dst[1..],
                    dst_stride,
                },
            );
            for (i, &got) in dst.iter().enumerate() {
                let (c, r) = (
                    (i.wrapping_sub(1)) / dst_stride,
                    (i.wrapping_sub(1)) % dst_stride,
                );
                let want = if i >= 1 && c < 4 && r < w {
                    src[from + r * src_stride + c]
                } else {
                    poison
                };
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{name} strides {src_stride}/{dst_stride}, dst[{i}]"
                );
            }
        }
    }
}

/// Output (f32) and LSE of a bf16 decode case through `forward_on` on `tiles`; outputs
/// poisoned first.
fn run_decode_bf16<O: Element>(
    case: &fa_reference::DecodeCase,
    opts: &crate::ForwardOptions,
    tiles: crate::forward::AmxTiles,
) -> (Vec<f32>, Vec<f32>) {
    run_decode_bf16_qk::<O>(case, opts, tiles, None)
}

/// [`run_decode_bf16`] with the SIMD `Q·Kᵀ` chosen (`None`: the CPU's default).
fn run_decode_bf16_qk<O: Element>(
    case: &fa_reference::DecodeCase,
    opts: &crate::ForwardOptions,
    tiles: crate::forward::AmxTiles,
    qk: Option<super::decode_stream::QkDots>,
) -> (Vec<f32>, Vec<f32>) {
    let problem = case.desc().validate(256).expect("valid case");
    let lens = problem.min_buffer_lens();
    let mut out = vec![O::from_f32(f32::NAN); lens.o];
    let mut lse = vec![f32::NAN; problem.lse_len()];
    let conv = |x: &[f32]| {
        x.iter()
            .map(|&v| half::bf16::from_f32(v))
            .collect::<Vec<_>>()
    };
    let (q, k, v) = (conv(&case.q), conv(&case.k), conv(&case.v));
    crate::forward::forward_on_with(
        &problem,
        softmax_core::Qkv::new(&q[..], &k[..], &v[..]),
        softmax_core::Out::with_lse(&mut out[..], &mut lse[..]),
        opts,
        &mut crate::Workspace::new(),
        tiles,
        qk,
    )
    .expect("forward");
    (out.iter().map(|x| x.to_f32()).collect(), lse)
}

/// Random bf16 decode cases the AMX `Q·Kᵀ` takes (≤ 16 rows per KV head): odd head dims
/// (a partial last chunk; more than four chunks, so B tiles reloaded per chunk), padded and
/// paged caches with block sizes 1, 3, 16, 64 and 256 (K rows gathered, or loaded in place
/// one stride apart), lengths 0 and 1, masks, softcap.
fn amx_decode_cases(rng: &mut Rng) -> Vec<(String, fa_reference::DecodeCase)> {
    use fa_reference::{CacheLayout, DecodeCase, Rounding};
    use softmax_core::Mask;
    let mut out = Vec::new();
    for (i, &(group, heads_kv, sq)) in [
        (4, 2, 1),
        (8, 1, 2),
        (1, 3, 4),
        (16, 1, 1),
        (4, 8, 1),
        (3, 2, 2),
    ]
    .iter()
    .enumerate()
    {
        for block in [0, 1, 3, 16, 64, 256] {
            let d = [8, 33, 64, 100, 128, 160, 256][rng.below(7)];
            let used: Vec<u32> = vec![
                rng.below(300) as u32 + 40,
                1,
                0,
                (rng.below(200) as u32) | 1,
            ];
            let layout = if block == 0 {
                CacheLayout::Padded { capacity: 341 }
            } else {
                DecodeCase::paged_layout(&used, block)
            };
            let case = DecodeCase::new(
                rng,
                &used,
                sq,
                group * heads_kv,
                heads_kv,
                d,
                layout,
                Rounding::Bf16,
            );
            let case = match (i + block) % 4 {
                0 => case.causal(),
                1 => case.with_mask(Mask {
                    left: Some(70),
                    right: Some(0),
                }),
                2 => case.with_softcap(5.0),
                _ => case,
            };
            out.push((
                format!("group {group} heads_kv {heads_kv} sq {sq} block {block} d {d}"),
                case,
            ));
        }
    }
    out
}

/// bf16 inputs, f32 output: `Q·Kᵀ` on AMX tiles keeps the f32 decode bound (bf16 × bf16
/// products are exact in f32, the sums f32), so the same bounds as the SIMD path: 1e-5
/// normwise on O, 1e-4 on the LSE, against the f64 oracle on the same inputs.
const AMX_DECODE_BOUND: f64 = 1e-5;
/// bf16 output: `P·V` on tiles too at 16 lanes and ≤ 8 rows per KV head
/// (`decode_stream::amx_pv_applies`, unless `DecodeOptions::amx_pv` is off), P rounded to bf16 (relative 2⁻⁹ per probability, the row sums f32) and O rounded to bf16:
/// the bf16 contract's normwise bound, 1e-2 (DESIGN.md; expect ~3e-3); the LSE keeps 1e-4.
const AMX_PV_DECODE_BOUND: f64 = 1e-2;
/// See [`AMX_DECODE_BOUND`].
const AMX_DECODE_LSE_BOUND: f64 = 1e-4;

/// The checks of one run: the oracle bound, and (so the test cannot pass without the tiles)
/// a difference in rounding from the SIMD path's output on the same level.
fn check_amx_decode<O: Element>(
    what: &str,
    case: &fa_reference::DecodeCase,
    opts: &crate::ForwardOptions,
    tiles: crate::forward::AmxTiles,
    simd: &[f32],
) -> bool {
    let problem = case.desc().validate(256).expect("valid case");
    let oracle = fa_reference::attention_f64(&problem, &case.q, &case.k, &case.v);
    let (out, lse) = run_decode_bf16::<O>(case, opts, tiles);
    let rep = fa_reference::compare(&problem, &out, Some(&lse), &oracle);
    let bound = if O::KIND == crate::element::sealed::Kind::F32 {
        AMX_DECODE_BOUND
    } else {
        AMX_PV_DECODE_BOUND
    };
    assert!(
        rep.within(bound, AMX_DECODE_LSE_BOUND),
        "{what} {tiles:?} {:?} splits {:?}: {rep:?}",
        opts.simd,
        opts.kv_splits
    );
    out.iter()
        .zip(simd)
        .any(|(a, b)| a.to_bits() != b.to_bits())
}

pub fn emulated_amx_decode_matches_the_oracle_on_every_level() {
    use crate::forward::AmxTiles;
    let mut rng = Rng::fresh();
    let cases = amx_decode_cases(&mut rng);
    for (isa, _) in levels() {
        let (mut differs, mut differs_half) = (0, 0);
        for (what, case) in &cases {
            for splits in [None, Some(3)] {
                let opts = crate::ForwardOptions {
                    simd: isa.level(),
                    kv_splits: splits,
                    ..crate::ForwardOptions::default()
                };
                // The SIMD path on the same level (no tiles): Avx512f stands for Amx here.
                let (simd, _) = run_decode_bf16::<f32>(case, &opts, AmxTiles::Hardware);
                differs += usize::from(check_amx_decode::<f32>(
                    what,
                    case,
                    &opts,
                    AmxTiles::Emulated,
                    &simd,
                ));
                // bf16 output: the AMX P·V too at 16 lanes.
                let (simd, _) = run_decode_bf16::<half::bf16>(case, &opts, AmxTiles::Hardware);
                differs_half += usize::from(check_amx_decode::<half::bf16>(
                    what,
                    case,
                    &opts,
                    AmxTiles::Emulated,
                    &simd,
                ));
            }
        }
        assert!(
            differs > cases.len(),
            "{isa:?}: the emulated AMX Q·Kᵀ changed no output in {differs} runs: did it run?"
        );
        // Output rounding to bf16 hides most of the Q·Kᵀ's differences: checked where the
        // P·V runs on the tiles too.
        let pv = super::decode_stream::amx_pv_applies(softmax_core::DType::Bf16, lanes(isa), true);
        assert!(
            !pv || differs_half > cases.len(),
            "{isa:?}: the emulated AMX path (bf16 out) changed no output in {differs_half} runs"
        );
    }
}

pub fn hardware_amx_decode_matches_the_oracle() {
    use crate::forward::AmxTiles;
    assert!(
        crate::arch::amx::available() && SimdLevel::Amx.is_available(),
        "this test needs AMX-BF16 with Linux's tile-data permission"
    );
    let mut rng = Rng::fresh();
    let cases = amx_decode_cases(&mut rng);
    let (mut differs, mut pv_differs) = (0, 0);
    for (what, case) in &cases {
        for threads in [Some(1), Some(2)] {
            let simd = crate::ForwardOptions {
                simd: SimdLevel::Avx512f,
                threads,
                kv_splits: Some(2),
                ..crate::ForwardOptions::default()
            };
            let amx = crate::ForwardOptions {
                simd: SimdLevel::Amx,
                ..simd
            };
            let (simd_out, _) = run_decode_bf16::<f32>(case, &simd, AmxTiles::Hardware);
            differs += usize::from(check_amx_decode::<f32>(
                what,
                case,
                &amx,
                AmxTiles::Hardware,
                &simd_out,
            ));
            // bf16 output (the AMX P·V too, by default).
            let (simd_out, _) = run_decode_bf16::<half::bf16>(case, &simd, AmxTiles::Hardware);
            differs += usize::from(check_amx_decode::<half::bf16>(
                what,
                case,
                &amx,
                AmxTiles::Hardware,
                &simd_out,
            ));
            // `amx_pv: false`: the tiles' Q·Kᵀ, the SIMD P·V in f32; still within the bound,
            // and not the default's output (P is not rounded to bf16).
            let f32_pv = crate::ForwardOptions {
                decode: crate::DecodeOptions {
                    amx_pv: false,
                    ..crate::DecodeOptions::default()
                },
                ..amx
            };
            let (pv_on, _) = run_decode_bf16::<half::bf16>(case, &amx, AmxTiles::Hardware);
            pv_differs += usize::from(check_amx_decode::<half::bf16>(
                what,
                case,
                &f32_pv,
                AmxTiles::Hardware,
                &pv_on,
            ));
        }
    }
    assert!(
        differs > cases.len(),
        "the AMX Q·Kᵀ changed no output: did it run?"
    );
    assert!(
        pv_differs > cases.len() / 2,
        "amx_pv: false changed no bf16 output in {pv_differs} runs: did the option reach the loop?"
    );
}

/// [`crate::DecodeOptions::amx_pv`] on the emulated tiles, every level: off, the bf16 outputs
/// keep the bf16 bound against the oracle and, at 16 lanes (where the AMX `P·V` runs by
/// default), differ from the default's in many runs (P no longer rounded to bf16); at 8 lanes
/// and for f32 outputs (no AMX `P·V` either way) they are the default's bit for bit.
pub fn emulated_amx_pv_option_keeps_p_v_in_f32() {
    use crate::forward::AmxTiles;
    let mut rng = Rng::fresh();
    let cases = amx_decode_cases(&mut rng);
    for (isa, name) in levels() {
        let pv_by_default =
            super::decode_stream::amx_pv_applies(softmax_core::DType::Bf16, lanes(isa), true);
        let mut differs = 0;
        for (what, case) in &cases {
            for splits in [None, Some(3)] {
                let on = crate::ForwardOptions {
                    simd: isa.level(),
                    kv_splits: splits,
                    ..crate::ForwardOptions::default()
                };
                let off = crate::ForwardOptions {
                    decode: crate::DecodeOptions {
                        amx_pv: false,
                        ..on.decode
                    },
                    ..on
                };
                let (pv_on, _) = run_decode_bf16::<half::bf16>(case, &on, AmxTiles::Emulated);
                let changed =
                    check_amx_decode::<half::bf16>(what, case, &off, AmxTiles::Emulated, &pv_on);
                assert!(
                    pv_by_default || !changed,
                    "{what} {name}: amx_pv changed a bf16 output where no AMX P·V runs"
                );
                differs += usize::from(changed);
                let (f32_on, _) = run_decode_bf16::<f32>(case, &on, AmxTiles::Emulated);
                let (f32_off, _) = run_decode_bf16::<f32>(case, &off, AmxTiles::Emulated);
                assert!(
                    f32_on
                        .iter()
                        .zip(&f32_off)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what} {name}: amx_pv changed an f32 output"
                );
            }
        }
        assert!(
            !pv_by_default || differs > cases.len(),
            "{name}: amx_pv: false changed no bf16 output in {differs} runs: did it reach the loop?"
        );
    }
}

/// [`crate::DecodeOptions::bf16_dots`] on every level: where the level is AVX-512 and the CPU
/// has AVX512-BF16 it takes exactly the `vdpbf16ps` products (bit for bit those forced
/// through `QkDots::Bf16Pairs { native: true }`), which change outputs against the default's
/// widened `Q·Kᵀ` and keep the f32 bound; elsewhere it is ignored (the default's bits). The
/// default is the widened `Q·Kᵀ` (`QkDots::F32`) bit for bit.
pub fn bf16_dots_option_takes_the_pair_products() {
    use super::decode_stream::QkDots;
    use crate::forward::AmxTiles;
    let native_here = crate::arch::has_avx512_bf16();
    if !native_here {
        eprintln!(
            "NOTE: this CPU has no AVX512-BF16: bf16_dots is only checked to change nothing here"
        );
    }
    let mut rng = Rng::fresh();
    let cases = amx_decode_cases(&mut rng);
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    for (isa, name) in levels() {
        let native = native_here && isa.level() == SimdLevel::Avx512f;
        let mut differs = 0;
        for (what, case) in &cases {
            for splits in [None, Some(3)] {
                let default = crate::ForwardOptions {
                    simd: isa.level(),
                    kv_splits: splits,
                    ..crate::ForwardOptions::default()
                };
                let dots = crate::ForwardOptions {
                    decode: crate::DecodeOptions {
                        bf16_dots: true,
                        ..default.decode
                    },
                    ..default
                };
                let hw = AmxTiles::Hardware;
                let (def_out, def_lse) = run_decode_bf16_qk::<f32>(case, &default, hw, None);
                let (f32_out, f32_lse) =
                    run_decode_bf16_qk::<f32>(case, &default, hw, Some(QkDots::F32));
                assert!(
                    bits(&def_out) == bits(&f32_out) && bits(&def_lse) == bits(&f32_lse),
                    "{what} {name}: the default is not the widened Q·Kᵀ"
                );
                let (out, lse) = run_decode_bf16_qk::<f32>(case, &dots, hw, None);
                let forced = Some(QkDots::Bf16Pairs { native: true });
                let (want, want_lse) = run_decode_bf16_qk::<f32>(case, &default, hw, forced);
                assert!(
                    bits(&out) == bits(&want) && bits(&lse) == bits(&want_lse),
                    "{what} {name}: bf16_dots is not the forced vdpbf16ps path"
                );
                let problem = case.desc().validate(256).expect("valid case");
                let oracle = fa_reference::attention_f64(&problem, &case.q, &case.k, &case.v);
                let rep = fa_reference::compare(&problem, &out, Some(&lse), &oracle);
                assert!(
                    rep.within(AMX_DECODE_BOUND, AMX_DECODE_LSE_BOUND),
                    "{what} {name} splits {splits:?}: {rep:?}"
                );
                let changed = bits(&out) != bits(&def_out);
                assert!(
                    native || !changed,
                    "{what} {name}: bf16_dots changed an output without vdpbf16ps"
                );
                differs += usize::from(changed);
            }
        }
        assert!(
            !native || differs > cases.len(),
            "{name}: bf16_dots changed no output in {differs} runs: did it reach the loop?"
        );
    }
}

/// The decode's bf16 pair products (`QkDots::Bf16Pairs`, [`crate::arch::Simd::dot_bf16_pairs`]):
/// emulated on every level, and with `vdpbf16ps` at AVX-512 where the CPU has AVX512-BF16,
/// against the oracle on the AMX cases (odd head dims, padded and paged caches, masks,
/// softcap, lengths 0 and 1, forced splits); each must also change some output against the
/// widened `Q·Kᵀ` on the same level, so the test cannot pass without the path running.
pub fn bf16_pair_dots_match_the_oracle() {
    use super::decode_stream::QkDots;
    use crate::forward::AmxTiles;
    let native_here = crate::arch::has_avx512_bf16();
    if !native_here {
        eprintln!(
            "NOTE: this CPU has no AVX512-BF16: the vdpbf16ps Q·Kᵀ is NOT run here, only its \
             emulation"
        );
    }
    let mut rng = Rng::fresh();
    let cases = amx_decode_cases(&mut rng);
    for (isa, name) in levels() {
        // The AMX level would take the tiles instead of the SIMD products.
        if isa.level() == SimdLevel::Amx {
            continue;
        }
        let mut natives = vec![false];
        if native_here && isa.level() == SimdLevel::Avx512f {
            natives.push(true);
        }
        for native in natives {
            let mut differs = 0;
            for (what, case) in &cases {
                for splits in [None, Some(3)] {
                    let opts = crate::ForwardOptions {
                        simd: isa.level(),
                        kv_splits: splits,
                        ..crate::ForwardOptions::default()
                    };
                    let hw = AmxTiles::Hardware;
                    let (widened, _) =
                        run_decode_bf16_qk::<f32>(case, &opts, hw, Some(QkDots::F32));
                    let pairs = Some(QkDots::Bf16Pairs { native });
                    let (out, lse) = run_decode_bf16_qk::<f32>(case, &opts, hw, pairs);
                    let problem = case.desc().validate(256).expect("valid case");
                    let oracle = fa_reference::attention_f64(&problem, &case.q, &case.k, &case.v);
                    let rep = fa_reference::compare(&problem, &out, Some(&lse), &oracle);
                    assert!(
                        rep.within(AMX_DECODE_BOUND, AMX_DECODE_LSE_BOUND),
                        "{what} {name} native {native} splits {splits:?}: {rep:?}"
                    );
                    differs += usize::from(
                        out.iter()
                            .zip(&widened)
                            .any(|(a, b)| a.to_bits() != b.to_bits()),
                    );
                }
            }
            assert!(
                differs > cases.len(),
                "{name} native {native}: the pair products changed no output in {differs} \
                 runs: did they run?"
            );
        }
    }
}

/// [`crate::arch::Simd::dot_bf16_pairs`] on random bf16 pairs (normal values) against f64:
/// the emulation within two f32 roundings of the exact sum, on every level; `vdpbf16ps`
/// (where the CPU has AVX512-BF16) within the same bound.
struct PairDots<'a> {
    a: &'a [u16],
    b: &'a [u16],
    acc: &'a [f32],
    out: &'a mut [f32],
    native: bool,
}

impl SimdTask for PairDots<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        assert!(self.a.len() >= 2 * A::W && self.b.len() >= 2 * A::W && self.out.len() >= A::W);
        // SAFETY: 2·W u16 (= W floats) readable at a and b, W floats at acc, W writable at out
        // (asserted); A available; native only in the AVX512-BF16 trampoline (the caller).
        unsafe {
            let (a, b) = (
                A::load(self.a.as_ptr() as *const f32),
                A::load(self.b.as_ptr() as *const f32),
            );
            let acc = A::load(self.acc.as_ptr());
            let r = if self.native {
                A::dot_bf16_pairs::<true>(acc, a, b)
            } else {
                A::dot_bf16_pairs::<false>(acc, a, b)
            };
            A::store(self.out.as_mut_ptr(), r);
        }
    }
}

pub fn bf16_pair_dots_are_two_roundings_from_exact() {
    let mut rng = Rng::new(1531);
    let native_here = crate::arch::has_avx512_bf16();
    let bf = |x: f32| half::bf16::from_f32(x).to_bits();
    for (isa, name) in levels() {
        let w = lanes(isa);
        let mut natives = vec![false];
        if native_here && matches!(isa.level(), SimdLevel::Avx512f | SimdLevel::Amx) {
            natives.push(true);
        }
        for native in natives {
            for _ in 0..300 {
                let a: Vec<u16> = (0..2 * w).map(|_| bf(draw(&mut rng, 1)[0] * 4.0)).collect();
                let b: Vec<u16> = (0..2 * w).map(|_| bf(draw(&mut rng, 1)[0] * 4.0)).collect();
                let acc = draw(&mut rng, w);
                let mut out = vec![f32::NAN; w];
                let task = PairDots {
                    a: &a,
                    b: &b,
                    acc: &acc,
                    out: &mut out,
                    native,
                };
                if native {
                    crate::dispatch::dispatch_bf16(isa, task);
                } else {
                    dispatch(isa, task);
                }
                let f = |x: u16| f64::from(half::bf16::from_bits(x).to_f32());
                for i in 0..w {
                    let (p0, p1) = (f(a[2 * i]) * f(b[2 * i]), f(a[2 * i + 1]) * f(b[2 * i + 1]));
                    let exact = f64::from(acc[i]) + p0 + p1;
                    // Two roundings, each within half an ulp of its partial sum.
                    let scale = f64::from(acc[i]).abs() + p0.abs() + p1.abs();
                    let bound = 2.0 * scale * f64::from(f32::EPSILON);
                    assert!(
                        (f64::from(out[i]) - exact).abs() <= bound,
                        "{name} native {native} lane {i}: {} against {exact}",
                        out[i]
                    );
                }
            }
        }
    }
}

/// `natural_row` (the write-out's register order → natural order) against the layout, for
/// each level's lane count, odd lengths (partial last chunks) included.
pub fn natural_row_undoes_register_order() {
    fn check<T: Element>(rng: &mut Rng) {
        for w in [1usize, 4, 8, 16] {
            for n in [1usize, 7, 16, 31, 32, 33, 64, 100, 128, 257] {
                let row = draw(rng, n);
                let reg = to_reg::<T>(&row, n, w);
                let mut got = vec![f32::NAN; n];
                natural_row::<T>(&reg, w, &mut got);
                assert_eq!(got, row, "{} w={w} n={n}", T::NAME);
            }
        }
    }
    let mut rng = Rng::new(1521);
    check::<f32>(&mut rng);
    check::<half::bf16>(&mut rng);
    check::<half::f16>(&mut rng);
}
