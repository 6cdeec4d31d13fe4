//! Every SIMD kernel against its scalar twin over size sweeps, and the exponentials against
//! f64. The kernels are called on slices through small [`SimdTask`] wrappers and the same
//! [`dispatch`] as the forward pass.

use super::micro::{pv_micro, qk_micro};
use super::pack::{pack_group, transpose_region};
use super::softmax::{all_keep, exp2_slice, softcap_slice};
use super::Tiling;
use crate::arch::{Arch, SimdLevel};
use crate::dispatch::{dispatch, Isa, SimdTask};
use crate::Exp2Impl;
use fa_reference::Rng;
use softmax_core::rescale::Decision;
use softmax_core::{RescalePolicy, RescaleStats};

const SIZES: [usize; 9] = [0, 1, 7, 31, 33, 64, 127, 128, 257];

/// One architecture under test: its sizes, and its kernels on slices.
struct ArchUnderTest {
    name: &'static str,
    lanes: usize,
    row_vectors: usize,
    qk_keys: usize,
    pv_channels: usize,
    isa: Isa,
}

impl ArchUnderTest {
    /// The architecture of `level`, if this CPU has it.
    fn new(level: SimdLevel, name: &'static str) -> Option<Self> {
        let isa = Isa::new(level)?;
        let tiling = Tiling::for_level(level);
        Some(ArchUnderTest {
            name,
            lanes: tiling.lanes,
            row_vectors: tiling.row_vectors,
            qk_keys: tiling.qk_keys,
            pv_channels: tiling.pv_channels,
            isa,
        })
    }

    /// `Sᵀ = K·Qᵀ` over a whole tile (`nk` a multiple of the micro-kernel's keys, `rows` a
    /// multiple of its rows).
    fn qk(&self, qt: &[f32], k: &[f32], d: usize, rows: usize, nk: usize, st: &mut [f32]) {
        dispatch(
            self.isa,
            Qk {
                qt,
                k,
                d,
                rows,
                nk,
                st,
            },
        )
    }

    /// `Oᵀ = Oᵀ·corr + Vᵀ·Pᵀ` over a whole tile.
    #[allow(clippy::too_many_arguments)]
    fn pv(
        &self,
        pt: &[f32],
        v: &[f32],
        dv: usize,
        rows: usize,
        nk: usize,
        ot: &mut [f32],
        corr: Option<&[f32]>,
    ) {
        dispatch(
            self.isa,
            Pv {
                pt,
                v,
                dv,
                rows,
                nk,
                ot,
                corr,
            },
        )
    }

    /// `exp2` over a slice (length a multiple of W).
    fn exp2(&self, x: &mut [f32], imp: Exp2Impl) {
        dispatch(self.isa, Exp2 { x, imp })
    }

    /// `post·tanh` over a slice (length a multiple of W).
    fn softcap(&self, x: &mut [f32], post: f32) {
        dispatch(self.isa, Softcap { x, post })
    }

    /// Widens f16 bit patterns.
    fn widen_f16(&self, src: &[u16], dst: &mut [f32]) {
        dispatch(self.isa, WidenF16 { src, dst })
    }

    /// `dst[c·dst_stride + r] = src[r·src_stride + c]` for `r < rows`, `c < cols`.
    fn transpose(
        &self,
        src: &[f32],
        src_stride: usize,
        rows: usize,
        cols: usize,
        dst: &mut [f32],
        dst_stride: usize,
    ) {
        dispatch(
            self.isa,
            Transpose {
                src,
                src_stride,
                rows,
                cols,
                dst,
                dst_stride,
            },
        )
    }

    /// Packs `QK` key rows (`keys`, `[QK][d]`) into the QKᵀ kernel's `[d][QK]` group.
    fn pack_group(&self, keys: &[f32], d: usize, group: &mut [f32]) {
        dispatch(self.isa, PackGroup { keys, d, group })
    }

    /// [`all_keep`] on one vector of references and block maxima.
    fn all_keep(
        &self,
        policy: &RescalePolicy<f32>,
        current: &[f32],
        block_max: &[f32],
    ) -> Option<u32> {
        dispatch(
            self.isa,
            AllKeep {
                policy,
                current,
                block_max,
            },
        )
    }
}

/// See [`ArchUnderTest::qk`].
struct Qk<'a> {
    qt: &'a [f32],
    k: &'a [f32],
    d: usize,
    rows: usize,
    nk: usize,
    st: &'a mut [f32],
}

impl SimdTask for Qk<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        let Qk {
            qt,
            k,
            d,
            rows,
            nk,
            st,
        } = self;
        assert!(qt.len() >= d * rows && k.len() >= nk * d && st.len() >= nk * rows);
        assert!(rows.is_multiple_of(NR * A::W) && nk.is_multiple_of(QK));
        // Pack K ([nk][d] row-major) into groups of QK keys laid out [c][QK].
        let mut kp = vec![0.0f32; nk * d];
        for j in 0..nk {
            for c in 0..d {
                kp[(j / QK) * d * QK + c * QK + j % QK] = k[j * d + c];
            }
        }
        for rv0 in (0..rows).step_by(NR * A::W) {
            for j in (0..nk).step_by(QK) {
                // SAFETY: bounds asserted above; A available (caller).
                unsafe {
                    qk_micro::<A, QK, NR>(
                        qt.as_ptr().add(rv0),
                        rows,
                        kp[j * d..].as_ptr(),
                        d,
                        st.as_mut_ptr().add(j * rows + rv0),
                        rows,
                    )
                }
            }
        }
    }
}

/// See [`ArchUnderTest::pv`].
struct Pv<'a> {
    pt: &'a [f32],
    v: &'a [f32],
    dv: usize,
    rows: usize,
    nk: usize,
    ot: &'a mut [f32],
    corr: Option<&'a [f32]>,
}

impl SimdTask for Pv<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        let Pv {
            pt,
            v,
            dv,
            rows,
            nk,
            ot,
            corr,
        } = self;
        assert!(pt.len() >= nk * rows && v.len() >= nk * dv && ot.len() >= dv * rows);
        assert!(rows.is_multiple_of(NR * A::W) && dv.is_multiple_of(PV));
        for rv0 in (0..rows).step_by(NR * A::W) {
            let c = corr.map_or(std::ptr::null(), |c| c[rv0..].as_ptr());
            for c0 in (0..dv).step_by(PV) {
                // SAFETY: bounds asserted above; A available (caller).
                unsafe {
                    pv_micro::<A, PV, NR>(
                        pt.as_ptr().add(rv0),
                        rows,
                        v.as_ptr().add(c0),
                        dv,
                        nk,
                        ot.as_mut_ptr().add(c0 * rows + rv0),
                        rows,
                        c,
                    )
                }
            }
        }
    }
}

/// See [`ArchUnderTest::exp2`].
struct Exp2<'a> {
    x: &'a mut [f32],
    imp: Exp2Impl,
}

impl SimdTask for Exp2<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        assert!(self.x.len().is_multiple_of(A::W));
        // SAFETY: length asserted; A available (caller).
        unsafe { exp2_slice::<A>(self.x.as_mut_ptr(), self.x.len(), self.imp) }
    }
}

/// [`Simd::exp2_softmax`], or with `cubic` [`Simd::exp2_cubic_softmax`], over a slice (length
/// a multiple of W).
struct Exp2SoftmaxArg<'a> {
    x: &'a mut [f32],
    cubic: bool,
}

impl SimdTask for Exp2SoftmaxArg<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        assert!(self.x.len().is_multiple_of(A::W));
        for chunk in self.x.chunks_exact_mut(A::W) {
            // SAFETY: chunk holds W floats; A available (caller).
            unsafe {
                let x = A::load(chunk.as_ptr());
                let y = if self.cubic {
                    A::exp2_cubic_softmax(x)
                } else {
                    A::exp2_softmax(x)
                };
                A::store(chunk.as_mut_ptr(), y)
            };
        }
    }
}

/// See [`ArchUnderTest::softcap`].
struct Softcap<'a> {
    x: &'a mut [f32],
    post: f32,
}

impl SimdTask for Softcap<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        assert!(self.x.len().is_multiple_of(A::W));
        // SAFETY: length asserted; A available (caller).
        unsafe { softcap_slice::<A>(self.x.as_mut_ptr(), self.x.len(), self.post) }
    }
}

/// See [`ArchUnderTest::widen_f16`].
struct WidenF16<'a> {
    src: &'a [u16],
    dst: &'a mut [f32],
}

impl SimdTask for WidenF16<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        let n = self.src.len().min(self.dst.len());
        // SAFETY: n elements on both sides; A available (caller).
        unsafe { A::widen_f16(self.src.as_ptr(), self.dst.as_mut_ptr(), n) }
    }
}

/// See [`ArchUnderTest::transpose`].
struct Transpose<'a> {
    src: &'a [f32],
    src_stride: usize,
    rows: usize,
    cols: usize,
    dst: &'a mut [f32],
    dst_stride: usize,
}

impl SimdTask for Transpose<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        let Transpose {
            src,
            src_stride,
            rows,
            cols,
            dst,
            dst_stride,
        } = self;
        assert!(
            rows == 0
                || cols == 0
                || (src.len() >= (rows - 1) * src_stride + cols
                    && dst.len() >= (cols - 1) * dst_stride + rows)
        );
        assert!(src_stride >= cols && dst_stride >= rows);
        // SAFETY: bounds asserted above; the slices do not overlap (two borrows); A
        // available (caller).
        unsafe {
            transpose_region::<A>(
                src.as_ptr(),
                src_stride,
                rows,
                cols,
                dst.as_mut_ptr(),
                dst_stride,
            )
        }
    }
}

/// See [`ArchUnderTest::pack_group`].
struct PackGroup<'a> {
    keys: &'a [f32],
    d: usize,
    group: &'a mut [f32],
}

impl SimdTask for PackGroup<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) {
        let PackGroup { keys, d, group } = self;
        assert!(keys.len() >= QK * d && group.len() >= d * QK);
        // SAFETY: bounds asserted above; two borrows do not overlap; A available (caller).
        unsafe { pack_group::<A, QK>(keys.as_ptr(), d, group.as_mut_ptr()) }
    }
}

/// See [`ArchUnderTest::all_keep`].
struct AllKeep<'a> {
    policy: &'a RescalePolicy<f32>,
    current: &'a [f32],
    block_max: &'a [f32],
}

impl SimdTask for AllKeep<'_> {
    type Output = Option<u32>;
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) -> Option<u32> {
        assert!(self.current.len() >= A::W && self.block_max.len() >= A::W);
        // SAFETY: W floats on both sides (asserted); A available (caller).
        unsafe {
            all_keep::<A>(
                self.policy,
                A::load(self.current.as_ptr()),
                A::load(self.block_max.as_ptr()),
            )
        }
    }
}

fn scalar() -> ArchUnderTest {
    ArchUnderTest::new(SimdLevel::Scalar, "scalar").expect("the scalar path always runs")
}

/// The SIMD architectures this CPU can run (each is compared with the scalar twin).
fn simd_archs() -> Vec<ArchUnderTest> {
    let v: Vec<ArchUnderTest> = [
        ArchUnderTest::new(SimdLevel::Avx2Fma, "avx2"),
        ArchUnderTest::new(SimdLevel::Avx512f, "avx512"),
    ]
    .into_iter()
    .flatten()
    .collect();
    if v.is_empty() {
        eprintln!("no SIMD level on this CPU: only the scalar kernels are tested");
    }
    v
}

/// The SIMD architectures this CPU can run, then the scalar path (for properties every one of
/// them must have on its own).
fn all_archs() -> Vec<ArchUnderTest> {
    let mut v = simd_archs();
    v.push(scalar());
    v
}

fn draw(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal() as f32).collect()
}

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m).max(1) * m
}

/// Largest `|a − b| / (1 + |b|)`.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f32::max)
}

/// Transposed-tile products computed in f64 from the panel-major layout the twins use
/// (one panel when `rows` equals the micro-kernel's width; here rows are a single panel
/// stride, so the layout is plain `[c][rows]`).
pub fn qk_matches_scalar_twin_and_f64() {
    let mut rng = Rng::new(21);
    let s = scalar();
    for a in simd_archs() {
        for &d in &SIZES[1..] {
            for &keys in &[1usize, 7, 33, 66] {
                // The twin wrappers take `rows` as the row stride: one panel per call.
                let rows = a.lanes * a.row_vectors;
                let nk = round_up(keys, a.qk_keys.max(s.qk_keys) * 2);
                let qt = draw(&mut rng, d * rows);
                let k = draw(&mut rng, nk * d);
                let mut got = vec![f32::NAN; nk * rows];
                let mut want = vec![f32::NAN; nk * rows];
                a.qk(&qt, &k, d, rows, nk, &mut got);
                let srows = s.lanes * s.row_vectors;
                // The scalar twin's panel is narrower: run it panel by panel of its width.
                for p0 in (0..rows).step_by(srows) {
                    let qp: Vec<f32> = (0..d)
                        .flat_map(|c| qt[c * rows + p0..c * rows + p0 + srows].to_vec())
                        .collect();
                    let mut sp = vec![f32::NAN; nk * srows];
                    s.qk(&qp, &k, d, srows, nk, &mut sp);
                    for j in 0..nk {
                        want[j * rows + p0..j * rows + p0 + srows]
                            .copy_from_slice(&sp[j * srows..(j + 1) * srows]);
                    }
                }
                let exact: Vec<f32> = (0..nk * rows)
                    .map(|i| {
                        let (j, r) = (i / rows, i % rows);
                        (0..d)
                            .map(|c| k[j * d + c] as f64 * qt[c * rows + r] as f64)
                            .sum::<f64>() as f32
                    })
                    .collect();
                let bound = 1e-5 * (d as f32).sqrt();
                assert!(max_diff(&got, &want) < bound, "{} qk d={d} nk={nk}", a.name);
                assert!(max_diff(&got, &exact) < bound, "{} qk f64 d={d}", a.name);
            }
        }
    }
}

pub fn pv_matches_scalar_twin_and_f64() {
    let mut rng = Rng::new(22);
    let s = scalar();
    for a in simd_archs() {
        for &dv in &SIZES[1..] {
            for &nk in &SIZES {
                for with_corr in [false, true] {
                    let rows = a.lanes * a.row_vectors;
                    let srows = s.lanes * s.row_vectors;
                    let dvp = round_up(dv, a.pv_channels * s.pv_channels);
                    let pt = draw(&mut rng, nk.max(1) * rows);
                    let v = draw(&mut rng, nk.max(1) * dvp);
                    let ot0 = draw(&mut rng, dvp * rows);
                    let corr: Vec<f32> = (0..rows).map(|i| 0.5 + (i % 3) as f32 * 0.25).collect();
                    let c = with_corr.then_some(&corr[..]);
                    let mut got = ot0.clone();
                    a.pv(&pt, &v, dvp, rows, nk, &mut got, c);
                    let mut want = ot0.clone();
                    for p0 in (0..rows).step_by(srows) {
                        let pp: Vec<f32> = (0..nk)
                            .flat_map(|j| pt[j * rows + p0..j * rows + p0 + srows].to_vec())
                            .collect();
                        let mut op: Vec<f32> = (0..dvp)
                            .flat_map(|ch| ot0[ch * rows + p0..ch * rows + p0 + srows].to_vec())
                            .collect();
                        let cp = c.map(|c| &c[p0..p0 + srows]);
                        s.pv(&pp, &v, dvp, srows, nk, &mut op, cp);
                        for ch in 0..dvp {
                            want[ch * rows + p0..ch * rows + p0 + srows]
                                .copy_from_slice(&op[ch * srows..(ch + 1) * srows]);
                        }
                    }
                    let exact: Vec<f32> = (0..dvp * rows)
                        .map(|i| {
                            let (ch, r) = (i / rows, i % rows);
                            let scale = c.map_or(1.0, |c| c[r] as f64);
                            (ot0[i] as f64 * scale
                                + (0..nk)
                                    .map(|j| v[j * dvp + ch] as f64 * pt[j * rows + r] as f64)
                                    .sum::<f64>()) as f32
                        })
                        .collect();
                    let bound = 1e-5 * (nk as f32 + 1.0).sqrt();
                    assert!(
                        max_diff(&got, &want) < bound,
                        "{} pv dv={dv} nk={nk}",
                        a.name
                    );
                    assert!(
                        max_diff(&got, &exact) < bound,
                        "{} pv f64 dv={dv} nk={nk}",
                        a.name
                    );
                }
            }
        }
    }
}

/// Inputs for the exponentials: a sweep over the whole interesting range plus specials.
fn exp2_inputs(n: usize, lanes: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n)
        .map(|i| -140.0 + 280.0 * (i as f32 / n.max(1) as f32))
        .collect();
    x.extend([
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        0.5,
        -0.5,
        127.4,
        127.6,
        -126.4,
        -126.6,
        8.0,
        -1e-9,
    ]);
    let len = round_up(x.len(), lanes * 2);
    x.resize(len, 1.0);
    x
}

pub fn exp2_exact_accuracy_and_specials_every_arch() {
    for a in all_archs() {
        let x = exp2_inputs(200_003, a.lanes);
        let mut y = x.clone();
        a.exp2(&mut y, Exp2Impl::Exact);
        let mut worst = 0.0f64;
        for (&xi, &yi) in x.iter().zip(&y) {
            let exact = (xi as f64).exp2();
            if xi.is_nan() {
                assert!(yi.is_nan(), "{}: exp2(NaN) = {yi}", a.name);
            } else if xi >= 127.5 {
                assert_eq!(yi, f32::INFINITY, "{}: exp2({xi})", a.name);
            } else if xi < -126.5 {
                assert_eq!(yi, 0.0, "{}: exp2({xi})", a.name);
            } else if exact >= f32::MIN_POSITIVE as f64 {
                worst = worst.max(((yi as f64 - exact) / exact).abs());
            } else {
                assert!((yi as f64 - exact).abs() < 2.0 * f32::MIN_POSITIVE as f64);
            }
        }
        assert!(
            worst < 3e-7,
            "{}: exp2 max relative error {worst:e}",
            a.name
        );
    }
}

/// Checks the softmax exp2 (`cubic`: [`Simd::exp2_cubic_softmax`], else
/// [`Simd::exp2_softmax`]) bit for bit against the slice exp2 of the same polynomial on every
/// arch, over the exact test's sweep, ties and specials up to 127 (those above are outside the
/// contract), the values of `grid`, the `specials`, and 20 000 random softmax arguments in
/// `(8 − span, 8]`.
fn assert_softmax_exp2_bits(
    cubic: bool,
    seed: u64,
    grid: impl Iterator<Item = f32> + Clone,
    specials: &[f32],
    span: f64,
) {
    let (imp, name) = if cubic {
        (Exp2Impl::Cubic, "exp2_cubic_softmax")
    } else {
        (Exp2Impl::Exact, "exp2_softmax")
    };
    let mut rng = Rng::new(seed);
    for a in all_archs() {
        let mut x: Vec<f32> = exp2_inputs(50_001, a.lanes)
            .into_iter()
            .filter(|&v| v <= 127.0 || v.is_nan())
            .collect();
        x.extend(grid.clone());
        x.extend_from_slice(specials);
        x.extend((0..20_000).map(|_| (-span * rng.uniform()) as f32 + 8.0));
        x.resize(round_up(x.len(), a.lanes), -3.25);
        let mut want = x.clone();
        a.exp2(&mut want, imp);
        let mut got = x.clone();
        dispatch(a.isa, Exp2SoftmaxArg { x: &mut got, cubic });
        for ((&xi, &w), &g) in x.iter().zip(&want).zip(&got) {
            assert!(
                w.to_bits() == g.to_bits() || (w.is_nan() && g.is_nan()),
                "{}: {name}({xi:e}) = {g:e}, {imp:?} exp2 {w:e}",
                a.name
            );
        }
    }
}

pub fn exp2_softmax_is_exp2_exact_bit_for_bit_up_to_127_every_arch() {
    let specials = [
        -126.5,
        -127.5,
        -126.5 - 1e-5,
        -126.5 + 1e-5,
        127.0,
        64.0,
        -149.5,
    ];
    // Every half-integer from −140 to 64 (the ties of the exact polynomial's rounding split).
    let grid = (-280..=128).map(|k| k as f32 / 2.0);
    assert_softmax_exp2_bits(false, 0x5ca1ef, grid, &specials, 130.0);
}

pub fn exp2_cubic_softmax_is_exp2_cubic_bit_for_bit_up_to_127_every_arch() {
    let specials = [
        -126.0,
        -126.0 - 1e-5,
        -127.0,
        -125.0,
        -151.0,
        127.0,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    // Every quarter from −160 to 64: floor's steps, and the zero scale at −127.
    let grid = (-640..=256).map(|k| k as f32 / 4.0);
    assert_softmax_exp2_bits(true, 0xc0b1c, grid, &specials, 170.0);
}

pub fn exp2_cubic_matches_softmax_core() {
    for a in all_archs() {
        let x = exp2_inputs(100_001, a.lanes);
        let mut y = x.clone();
        a.exp2(&mut y, Exp2Impl::Cubic);
        for (&xi, &yi) in x.iter().zip(&y) {
            let want = softmax_core::exp2_cubic(xi);
            if xi.is_nan() {
                assert!(yi.is_nan());
            } else if (-125.0..127.0).contains(&xi) {
                // Same polynomial; FMA may round differently in the last place.
                assert!(
                    ((yi - want) / want).abs() < 1e-6,
                    "{}: cubic({xi}) = {yi}, softmax-core {want}",
                    a.name
                );
            } else if xi < -127.0 {
                assert_eq!(yi, 0.0);
            } else if xi >= 128.0 {
                assert_eq!(yi, f32::INFINITY);
            }
        }
    }
}

pub fn softcap_tanh_matches_f64() {
    for a in all_archs() {
        let mut x: Vec<f32> = (0..4096).map(|i| (i as f32 - 2048.0) / 100.0).collect();
        x.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1e-7]);
        x.resize(round_up(x.len(), a.lanes), 0.25);
        let mut y = x.clone();
        a.softcap(&mut y, 3.0);
        for (&xi, &yi) in x.iter().zip(&y) {
            if xi.is_nan() {
                assert!(yi.is_nan());
                continue;
            }
            let want = 3.0 * (xi as f64).tanh();
            assert!(
                (yi as f64 - want).abs() < 3.0 * 1e-6,
                "{}: 3·tanh({xi}) = {yi}, want {want}",
                a.name
            );
        }
    }
}

pub fn widen_f16_matches_half() {
    for a in all_archs() {
        for &n in &SIZES {
            let src: Vec<u16> = (0..n).map(|i| (i as u16).wrapping_mul(40_503)).collect();
            let mut dst = vec![f32::NAN; n];
            a.widen_f16(&src, &mut dst);
            for (&h, &f) in src.iter().zip(&dst) {
                let want = half::f16::from_bits(h).to_f32();
                assert!(want.to_bits() == f.to_bits() || (want.is_nan() && f.is_nan()));
            }
        }
        // Every f16 bit pattern once.
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let mut dst = vec![0.0f32; all.len()];
        a.widen_f16(&all, &mut dst);
        for (&h, &f) in all.iter().zip(&dst) {
            let want = half::f16::from_bits(h).to_f32();
            assert!(
                want.to_bits() == f.to_bits() || (want.is_nan() && f.is_nan()),
                "{h:#x}"
            );
        }
    }
}

pub fn detection_is_cached_and_consistent() {
    let level = crate::arch::detected();
    assert_eq!(level, crate::arch::detected());
    assert!(level.is_available());
    assert_eq!(crate::simd_level(), level.name());
}

pub fn transpose_is_exact_and_touches_nothing_else() {
    let mut rng = Rng::new(77);
    for arch in &all_archs() {
        for &rows in &SIZES {
            for &cols in &SIZES {
                let (src_stride, dst_stride) = (cols + 3, rows + 5);
                let src = draw(&mut rng, rows.max(1) * src_stride);
                let mut dst = vec![f32::NAN; cols.max(1) * dst_stride];
                arch.transpose(&src, src_stride, rows, cols, &mut dst, dst_stride);
                for c in 0..cols.max(1) {
                    for r in 0..dst_stride {
                        let got = dst[c * dst_stride + r];
                        if r < rows && c < cols {
                            assert_eq!(
                                got.to_bits(),
                                src[r * src_stride + c].to_bits(),
                                "{} rows={rows} cols={cols} r={r} c={c}",
                                arch.name
                            );
                        } else {
                            assert!(got.is_nan(), "{} wrote outside the block", arch.name);
                        }
                    }
                }
            }
        }
    }
}

pub fn pack_group_is_exact_for_every_head_dim() {
    let mut rng = Rng::new(78);
    for arch in &all_archs() {
        let mr = arch.qk_keys;
        for d in (1..=40).chain([63, 64, 65, 127, 128, 129, 255, 256]) {
            let keys = draw(&mut rng, mr * d);
            let mut group = vec![f32::NAN; d * mr + 7];
            arch.pack_group(&keys, d, &mut group);
            for c in 0..d {
                for j in 0..mr {
                    assert_eq!(
                        group[c * mr + j].to_bits(),
                        keys[j * d + c].to_bits(),
                        "{} d={d} c={c} j={j}",
                        arch.name
                    );
                }
            }
            assert!(
                group[d * mr..].iter().all(|x| x.is_nan()),
                "{} wrote past the group",
                arch.name
            );
        }
    }
}

/// The vector "every lane keeps" test agrees with `RescalePolicy::decide` lane by lane:
/// same verdict, same skipped count, on references and maxima that sit on every boundary
/// (equal, exactly τ apart, NaN, ±∞, first block).
pub fn all_keep_agrees_with_decide() {
    let mut rng = Rng::new(79);
    let policies = [
        RescalePolicy::Always,
        RescalePolicy::Threshold(0.0),
        RescalePolicy::Threshold(8.0),
    ];
    for arch in &all_archs() {
        let w = arch.lanes;
        for policy in &policies {
            let tau = match policy {
                RescalePolicy::Threshold(t) => *t,
                RescalePolicy::Always => 0.0,
            };
            let mut agreed_keep = 0;
            for trial in 0..4000 {
                let mut current = vec![0.0f32; w];
                let mut block_max = vec![0.0f32; w];
                for l in 0..w {
                    let c = (rng.normal() * 4.0) as f32;
                    current[l] = if trial % 97 == 0 && l == 0 {
                        f32::NEG_INFINITY
                    } else {
                        c
                    };
                    // Mostly small steps (the common, all-keep case), some on the boundaries.
                    block_max[l] = match rng.below(10) {
                        0 => c + tau,
                        1 => c,
                        2 if trial % 5 == 0 => f32::NAN,
                        3 if trial % 7 == 0 => f32::INFINITY,
                        4 if trial % 3 == 0 => f32::NEG_INFINITY,
                        5 if trial % 11 == 0 => c + tau + 1.0,
                        // Below the reference in even trials (all keep under `Always`), either
                        // side of it, within τ, in odd ones.
                        _ if trial % 2 == 0 => c - (rng.normal().abs() as f32),
                        _ => c + (rng.normal() as f32) * tau.max(0.5) * 0.3,
                    };
                }
                let mut stats = RescaleStats::default();
                let all = (0..w)
                    .all(|l| policy.decide(current[l], block_max[l], &mut stats) == Decision::Keep);
                let got = arch.all_keep(policy, &current, &block_max);
                // A row without a reference (−∞) always goes to the per-row rule: its offset is
                // 0, not its reference.
                if current.contains(&f32::NEG_INFINITY) {
                    assert_eq!(
                        got, None,
                        "{} {policy:?} {current:?} {block_max:?}",
                        arch.name
                    );
                } else if all {
                    assert_eq!(
                        got,
                        Some(stats.skipped as u32),
                        "{} {policy:?} {current:?} {block_max:?}",
                        arch.name
                    );
                    agreed_keep += 1;
                } else {
                    assert_eq!(
                        got, None,
                        "{} {policy:?} {current:?} {block_max:?}",
                        arch.name
                    );
                }
            }
            assert!(
                agreed_keep > 100,
                "{} {policy:?}: the keep case was hardly exercised",
                arch.name
            );
        }
    }
}
