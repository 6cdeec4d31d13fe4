//! The backward's tile product ([`gemm`]) on every SIMD level against the scalar twin and an
//! f64 product, over odd sizes (whole-pass twins over odd problem sizes: `tests/backward.rs`).

use super::backward_gemm::{gemm, gemm_wide, Dest, Operands, Span, WideOperands};
use super::backward_task::bwd_tile;
use crate::arch::{Arch, SimdLevel};
use crate::dispatch::{dispatch, Isa, SimdTask};
use fa_reference::Rng;

/// `C (+)= Σ_k B[k][m]·X[k][n]` on slices, through the same dispatch as the pass.
struct Gemm<'a> {
    b: &'a [f32],
    b_stride: usize,
    x: &'a [f32],
    x_stride: usize,
    nk: usize,
    /// Rows and columns asked for, rounded up here to the architecture's blocks.
    rows: usize,
    cols: usize,
    c: &'a mut [f32],
    c_stride: usize,
    accumulate: bool,
    /// Per block of rows (its first row, the block's height): its [`Span`], if any.
    span_of: Option<&'a dyn Fn(usize, usize) -> Span>,
}

impl SimdTask for Gemm<'_> {
    /// The rows and columns actually computed.
    type Output = (usize, usize);
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(
        self,
    ) -> (usize, usize) {
        let rows = self.rows.div_ceil(PV) * PV;
        let cols = self.cols.div_ceil(A::W) * A::W;
        assert!(rows <= self.b_stride && cols <= self.x_stride && cols <= self.c_stride);
        assert!(self.b.len() >= self.nk * self.b_stride && self.x.len() >= self.nk * self.x_stride);
        assert!(self.c.len() >= rows * self.c_stride);
        let spans: Option<Vec<Span>> = self
            .span_of
            .map(|f| (0..rows).step_by(PV).map(|m0| f(m0, PV)).collect());
        // SAFETY: bounds asserted above; A available (caller).
        unsafe {
            gemm::<A, PV, NR>(
                Operands {
                    b: self.b.as_ptr(),
                    b_stride: self.b_stride,
                    x: self.x.as_ptr(),
                    x_stride: self.x_stride,
                },
                self.nk,
                rows,
                cols,
                Dest {
                    c: self.c.as_mut_ptr(),
                    c_stride: self.c_stride,
                    accumulate: self.accumulate,
                },
                spans.as_deref(),
            )
        };
        (rows, cols)
    }
}

fn draw(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal() as f32).collect()
}

pub fn gemm_matches_the_scalar_twin_and_f64_over_odd_sizes() {
    let mut rng = Rng::new(0xb4c);
    let levels: Vec<Isa> = [SimdLevel::Avx512f, SimdLevel::Avx2Fma, SimdLevel::Scalar]
        .into_iter()
        .filter_map(Isa::new)
        .collect();
    let scalar = Isa::new(SimdLevel::Scalar).expect("scalar always runs");
    let mut checked = 0;
    for nk in [0usize, 1, 7, 33, 64, 72, 129] {
        for (rows, cols) in [
            (1usize, 1usize),
            (5, 9),
            (8, 16),
            (24, 48),
            (64, 72),
            (72, 136),
        ] {
            for accumulate in [false, true] {
                // Strides wider than any level's rounding, so every level computes in place.
                let (b_stride, x_stride, c_stride) = (80, 160, 168);
                let b = draw(&mut rng, nk.max(1) * b_stride);
                let x = draw(&mut rng, nk.max(1) * x_stride);
                let c0 = draw(&mut rng, 80 * c_stride);
                let mut twin = c0.clone();
                let _ = dispatch(
                    scalar,
                    Gemm {
                        b: &b,
                        b_stride,
                        x: &x,
                        x_stride,
                        nk,
                        rows,
                        cols,
                        c: &mut twin,
                        c_stride,
                        accumulate,
                        span_of: None,
                    },
                );
                for &isa in &levels {
                    let mut c = c0.clone();
                    let (rc, cc) = dispatch(
                        isa,
                        Gemm {
                            b: &b,
                            b_stride,
                            x: &x,
                            x_stride,
                            nk,
                            rows,
                            cols,
                            c: &mut c,
                            c_stride,
                            accumulate,
                            span_of: None,
                        },
                    );
                    for m in 0..80 {
                        for n in 0..c_stride {
                            let at = m * c_stride + n;
                            if m >= rc || n >= cc {
                                assert_eq!(c[at].to_bits(), c0[at].to_bits(), "touched outside");
                                continue;
                            }
                            let mut exact = if accumulate { c0[at] as f64 } else { 0.0 };
                            let mut mag = exact.abs();
                            for k in 0..nk {
                                let t = b[k * b_stride + m] as f64 * x[k * x_stride + n] as f64;
                                exact += t;
                                mag += t.abs();
                            }
                            let bound = 1e-6 * (1.0 + mag) * (nk as f64 + 1.0).sqrt();
                            let what = format!(
                                "{:?} nk={nk} {rows}x{cols} acc={accumulate} ({m},{n})",
                                isa.level()
                            );
                            assert!((c[at] as f64 - exact).abs() <= bound, "{what}: vs f64");
                            if m < rows && n < cols {
                                assert!(
                                    (c[at] as f64 - twin[at] as f64).abs() <= 2.0 * bound,
                                    "{what}: vs scalar twin"
                                );
                            }
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 10_000);
}

/// Spans skip exact zeros only: where row `m`'s terms outside its contraction range are zeros
/// of `B`, every level's product with spans (the union over each block's rows) is bitwise its
/// product without them on the columns the row may see, and a block with no term is untouched.
pub fn spans_skip_exact_zeros_bitwise() {
    let mut rng = Rng::new(0x5b4);
    let levels: Vec<Isa> = [SimdLevel::Avx512f, SimdLevel::Avx2Fma, SimdLevel::Scalar]
        .into_iter()
        .filter_map(Isa::new)
        .collect();
    let (nk, rows, cols) = (64usize, 72usize, 96usize);
    let (b_stride, x_stride, c_stride) = (80, 112, 112);
    // Row m sees terms and columns [lo(m), hi(m)): a causal-like staircase, empty rows first.
    let lo = |m: usize| (m / 2).saturating_sub(20);
    let hi = |m: usize| if m < 9 { lo(m) } else { (m + 5).min(nk) };
    let union = |m0: usize, mr: usize| {
        let (a, b) = (m0..(m0 + mr).min(rows))
            .filter(|&m| lo(m) < hi(m))
            .fold((usize::MAX, 0), |(a, b), m| (a.min(lo(m)), b.max(hi(m))));
        if a < b {
            (a, b)
        } else {
            (0, 0)
        }
    };
    let k_span = |m0: usize, mr: usize| Span {
        k: union(m0, mr),
        n: (0, usize::MAX),
    };
    let n_span = |m0: usize, mr: usize| Span {
        k: (0, usize::MAX),
        n: union(m0, mr),
    };
    let mut b = draw(&mut rng, nk * b_stride);
    for k in 0..nk {
        for m in 0..rows {
            if k < lo(m) || k >= hi(m) {
                b[k * b_stride + m] = 0.0;
            }
        }
    }
    let x = draw(&mut rng, nk * x_stride);
    let c0 = draw(&mut rng, 80 * c_stride);
    for &isa in &levels {
        for (accumulate, by_k) in [(true, true), (false, false)] {
            let run = |span_of: Option<&dyn Fn(usize, usize) -> Span>| {
                let mut c = c0.clone();
                dispatch(
                    isa,
                    Gemm {
                        b: &b,
                        b_stride,
                        x: &x,
                        x_stride,
                        nk,
                        rows,
                        cols,
                        c: &mut c,
                        c_stride,
                        accumulate,
                        span_of,
                    },
                );
                c
            };
            let full = run(None);
            let got = if by_k {
                run(Some(&k_span))
            } else {
                run(Some(&n_span))
            };
            for m in 0..rows {
                for n in 0..cols {
                    let at = m * c_stride + n;
                    let what = format!("{:?} acc={accumulate} ({m},{n})", isa.level());
                    if by_k && lo(m) >= hi(m) && union(m - m % 2, 2) == (0, 0) {
                        assert_eq!(got[at].to_bits(), c0[at].to_bits(), "{what}: touched");
                    } else if by_k || (lo(m)..hi(m)).contains(&n) {
                        assert_eq!(got[at].to_bits(), full[at].to_bits(), "{what}");
                    }
                }
            }
        }
    }
}

pub fn tiles_are_whole_blocks_of_every_architecture() {
    assert_eq!(bwd_tile(8, 16), 64);
    assert_eq!(bwd_tile(6, 8), 96);
    assert_eq!(bwd_tile(4, 8), 64);
    for (mr, w) in [(8, 16), (6, 8), (4, 8), (3, 4)] {
        let t = bwd_tile(mr, w);
        assert!(
            t >= 64 && t.is_multiple_of(mr) && t.is_multiple_of(w),
            "{mr} {w}"
        );
    }
}

/// The whole backward with other register blockings (AVX-512's `MR = 8, NR = 3`, and a narrow
/// `MR = 2, NR = 1`) on the scalar architecture: the per-element sums run in the same order
/// whatever the blocking (the tile edge and roundings are the same here), so the gradients must
/// be bitwise those of the scalar path. This covers the blocking logic of the AVX-512 path
/// (live-vector tails of 3-vector panels) on machines without AVX-512.
pub fn other_blockings_give_bitwise_the_scalar_gradients() {
    use super::backward_task::{backward_tasks, run_task, BwdCtx, BwdLens, BwdScratch};
    use super::SharedOut;
    use crate::arch::scalar::Scalar;
    use crate::{backward, forward, BackwardInputs, BackwardOptions, ForwardOptions};
    use fa_reference::Case;
    use softmax_core::{Grads, Out, Qkv};

    let mut rng = Rng::new(0xb10c);
    let cases = [
        Case::dense(&mut rng, 1, 70, 131, 4, 2, 40).causal(),
        Case::dense(&mut rng, 2, 65, 64, 2, 1, 72).with_softcap(4.0),
        Case::dense(&mut rng, 1, 129, 129, 3, 3, 20).causal(),
    ];
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    for case in &cases {
        let p = case.desc().validate(256).expect("valid");
        let lens = p.min_buffer_lens();
        let (q, k, v) = (&case.q[..], &case.k[..], &case.v[..]);
        let d_o = draw(&mut rng, lens.o);
        let mut o = vec![0.0f32; lens.o];
        let mut lse = vec![0.0f32; p.lse_len()];
        forward(
            &p,
            Qkv::new(q, k, v),
            Out::with_lse(&mut o[..], &mut lse[..]),
            &ForwardOptions::default(),
        )
        .expect("forward");
        let nan = f32::NAN;
        let mut want = Grads::new(vec![nan; lens.q], vec![nan; lens.k], vec![nan; lens.v]);
        let opts = BackwardOptions {
            threads: Some(1),
            simd: SimdLevel::Scalar,
        };
        let inputs = BackwardInputs {
            o: &o,
            d_o: &d_o,
            lse: &lse,
        };
        backward(
            &p,
            Qkv::new(q, k, v),
            inputs,
            Grads::new(&mut want.dq[..], &mut want.dk[..], &mut want.dv[..]),
            &opts,
        )
        .expect("backward");

        /// Runs every task with blocking `MR × NR` on the scalar architecture.
        fn with_blocking<const NR: usize, const MR: usize>(
            p: &softmax_core::Problem,
            (q, k, v): (&[f32], &[f32], &[f32]),
            inputs: BackwardInputs<'_, f32>,
            grads: &mut Grads<Vec<f32>>,
        ) {
            let ctx = BwdCtx {
                problem: p,
                q,
                k,
                v,
                o: inputs.o,
                d_o: inputs.d_o,
                lse: inputs.lse,
                dq: SharedOut::new(&mut grads.dq),
                dk: SharedOut::new(&mut grads.dk),
                dv: SharedOut::new(&mut grads.dv),
            };
            let mut s = BwdScratch::default();
            s.try_ensure(&BwdLens::new(p, SimdLevel::Scalar))
                .expect("scratch");
            for task in &backward_tasks(p) {
                // SAFETY: the scalar architecture needs no CPU feature; the scratch is sized
                // for the problem with the scalar tile, which these blockings share (64).
                unsafe { run_task::<Scalar, NR, MR, f32, f32, f32>(&ctx, task, &mut s) };
            }
        }
        assert_eq!(bwd_tile(8, 8), bwd_tile(4, 8));
        assert_eq!(bwd_tile(2, 8), bwd_tile(4, 8));
        let mut got = Grads::new(vec![nan; lens.q], vec![nan; lens.k], vec![nan; lens.v]);
        with_blocking::<3, 8>(&p, (q, k, v), inputs, &mut got);
        assert_eq!(bits(&got.dq), bits(&want.dq), "8x3 dQ");
        assert_eq!(bits(&got.dk), bits(&want.dk), "8x3 dK");
        assert_eq!(bits(&got.dv), bits(&want.dv), "8x3 dV");
        let mut got = Grads::new(vec![nan; lens.q], vec![nan; lens.k], vec![nan; lens.v]);
        with_blocking::<1, 2>(&p, (q, k, v), inputs, &mut got);
        assert_eq!(bits(&got.dq), bits(&want.dq), "2x1 dQ");
        assert_eq!(bits(&got.dk), bits(&want.dk), "2x1 dK");
        assert_eq!(bits(&got.dv), bits(&want.dv), "2x1 dV");
        assert!(got.dq.iter().all(|x| x.is_finite()), "every dQ written");
    }
}

/// [`gemm_wide`] on every level against [`gemm`] at that level: bitwise the same `C` (the same
/// chains of multiply-adds), with `B` read as `[k][m]` and as its transpose `[m][k]`, over the
/// row counts of every block height (6, 4, 2 tails) and column counts of 1–5 vectors.
pub fn gemm_wide_is_gemm_bitwise() {
    /// gemm and gemm_wide (both orientations) on one level.
    struct Both<'a> {
        b: &'a [f32],
        bt: &'a [f32],
        x: &'a [f32],
        nk: usize,
        rows: usize,
        cols: usize,
        c0: &'a [f32],
        accumulate: bool,
    }
    const BS: usize = 80;
    const XS: usize = 96;
    const CS: usize = 96;
    impl SimdTask for Both<'_> {
        type Output = Option<(Vec<f32>, Vec<f32>, Vec<f32>)>;
        #[inline(always)]
        unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(
            self,
        ) -> Self::Output {
            let cols = self.cols * A::W;
            if !self.rows.is_multiple_of(PV) || cols > CS {
                return None;
            }
            let (mut c1, mut c2, mut c3) = (self.c0.to_vec(), self.c0.to_vec(), self.c0.to_vec());
            let ops = Operands {
                b: self.b.as_ptr(),
                b_stride: BS,
                x: self.x.as_ptr(),
                x_stride: XS,
            };
            // SAFETY: B holds nk × BS (and its transpose rows × BS), X nk × XS, C 80 × CS;
            // rows ≤ 72 < BS, cols ≤ CS; A available (caller).
            unsafe {
                let dest = |c: &mut Vec<f32>| Dest {
                    c: c.as_mut_ptr(),
                    c_stride: CS,
                    accumulate: self.accumulate,
                };
                gemm::<A, PV, NR>(ops, self.nk, self.rows, cols, dest(&mut c1), None);
                gemm_wide::<A>(ops.into(), self.nk, self.rows, cols, dest(&mut c2));
                gemm_wide::<A>(
                    WideOperands {
                        b: self.bt.as_ptr(),
                        b_k: 1,
                        b_m: BS,
                        x: self.x.as_ptr(),
                        x_stride: XS,
                    },
                    self.nk,
                    self.rows,
                    cols,
                    dest(&mut c3),
                );
            }
            Some((c1, c2, c3))
        }
    }
    let mut rng = Rng::new(0x31de);
    let mut checked = 0;
    for isa in [SimdLevel::Avx512f, SimdLevel::Avx2Fma, SimdLevel::Scalar]
        .into_iter()
        .filter_map(Isa::new)
    {
        for nk in [1usize, 7, 64, 72] {
            for rows in [8usize, 16, 24, 48, 64, 72] {
                for cols in 1..=5 {
                    for accumulate in [false, true] {
                        let b = draw(&mut rng, nk * BS);
                        let mut bt = vec![0.0f32; 72 * BS];
                        for k in 0..nk {
                            for m in 0..rows {
                                bt[m * BS + k] = b[k * BS + m];
                            }
                        }
                        let x = draw(&mut rng, nk * XS);
                        let c0 = draw(&mut rng, 80 * CS);
                        let both = Both {
                            b: &b,
                            bt: &bt,
                            x: &x,
                            nk,
                            rows,
                            cols,
                            c0: &c0,
                            accumulate,
                        };
                        if let Some((c1, c2, c3)) = dispatch(isa, both) {
                            let bits =
                                |c: &[f32]| c.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                            let what = format!(
                                "{:?} nk={nk} {rows}x{cols}v acc={accumulate}",
                                isa.level()
                            );
                            assert!(bits(&c1) == bits(&c2), "{what}: [k][m]");
                            assert!(bits(&c1) == bits(&c3), "{what}: [m][k]");
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(checked >= 200, "{checked}");
}
