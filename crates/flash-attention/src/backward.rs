//! The backward pass over dtype-erased host tensors: [`Backend::backward`] and
//! [`Backend::time_backward`] on the CPU (fa-cpu) and on CUDA (fa-cuda's plan → workspace →
//! run path through `Device::backward_host`).

use crate::backend::{Backend, BackendKind, DTypes, Error, Options};
use crate::tensor::{TensorMut, TensorRef};
use softmax_core::{DType, Grads, Problem, ProblemError, Qkv};

/// What the backward reads besides Q, K and V: the forward's O and LSE and `∂L/∂O`, as
/// dtype-erased views.
pub use fa_cpu::DynBackwardInputs as BackwardInputs;

/// What a backward call reported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BackwardStats {
    /// CPU: (query tile, key tile) pairs computed, per query head (0 on CUDA).
    pub tiles_computed: u64,
    /// CPU: (query tile, key tile) pairs the mask skipped (0 on CUDA).
    pub tiles_skipped: u64,
}

/// The CPU rejects this combination of dtypes for the backward.
const CPU_BACKWARD_DTYPES: ProblemError = fa_cpu::BACKWARD_DTYPES;

/// The CUDA backward's dtypes.
const CUDA_BACKWARD_DTYPES: ProblemError = ProblemError::Unsupported {
    what:
        "fa-cuda's backward takes bf16 or f16 tensors, all of one dtype (inputs, O, dO, gradients)",
};

/// CUDA runs no attention sinks yet.
const CUDA_SINKS: ProblemError = ProblemError::Unsupported {
    what: "the CUDA backend does not run attention sinks yet (use the CPU backend)",
};

impl Backend {
    /// Gradients of a loss with respect to Q, K and V, given `∂L/∂O` and the forward's O and
    /// LSE: exact, recomputing the probabilities (no N×N storage). Everything is checked
    /// before anything is written.
    ///
    /// CPU: deterministic (bitwise identical for any thread count); Q, K and V share a dtype
    /// `T` (f32, bf16, f16); O and dO share one (`T` or f32); the three gradients share one
    /// (`T` or f32), laid out as Q, K and V. Of `opts`, `threads` and `cpu_simd` apply (a level
    /// this CPU lacks is an error, as in the forward).
    ///
    /// CUDA: every tensor bf16, or every tensor f16; the tensors are copied to the device
    /// and the gradients back (fa-cuda's `Device::backward_host`: plan, workspace, run). dK
    /// and dV are deterministic; dQ is summed with f32 atomics, so its last bits may differ
    /// from run to run. No field of `opts` applies.
    pub fn backward(
        &self,
        problem: &Problem,
        qkv: Qkv<TensorRef<'_>>,
        inputs: BackwardInputs<'_>,
        grads: Grads<TensorMut<'_>>,
        opts: &Options,
    ) -> Result<BackwardStats, Error> {
        self.check_backward(problem, &qkv, &inputs, &grads)?;
        match self.cuda_device() {
            Some(d) => cuda_backward(d, problem, qkv, inputs, grads),
            None => cpu_backward(problem, qkv, inputs, grads, opts),
        }
    }

    /// Seconds per call of `iters` timed backward calls after `warmup` untimed ones. CPU: wall
    /// clock, the gradients written by every call. CUDA: the tensors are uploaded once and
    /// each run's kernels are timed with CUDA events (no transfers; the gradients stay on the
    /// device and `grads` is not written).
    #[allow(clippy::too_many_arguments)]
    pub fn time_backward(
        &self,
        problem: &Problem,
        qkv: Qkv<TensorRef<'_>>,
        inputs: BackwardInputs<'_>,
        mut grads: Grads<TensorMut<'_>>,
        opts: &Options,
        warmup: usize,
        iters: usize,
    ) -> Result<Vec<f64>, Error> {
        self.check_backward(problem, &qkv, &inputs, &grads)?;
        if let Some(d) = self.cuda_device() {
            return cuda_time_backward(d, problem, qkv, inputs, &grads, warmup, iters);
        }
        let calls = warmup.checked_add(iters).ok_or(ProblemError::Overflow)?;
        let mut times = Vec::new();
        times
            .try_reserve_exact(iters)
            .map_err(|_| ProblemError::OutOfMemory {
                what: "the timing list",
                bytes: iters.saturating_mul(std::mem::size_of::<f64>()),
            })?;
        for i in 0..calls {
            let call = Grads::new(
                grads.dq.reborrow(),
                grads.dk.reborrow(),
                grads.dv.reborrow(),
            );
            let start = std::time::Instant::now();
            cpu_backward(problem, qkv, inputs, call, opts)?;
            if i >= warmup {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        Ok(times)
    }

    /// The gradient of the attention sinks' logits (`heads_q` entries, f32), for a problem
    /// with sinks ([`softmax_core::ProblemDesc::sinks`]): `d_sinks[h] = −Σ_i exp(s_h −
    /// LSE_i)·D_i` over the rows of head `h`, `D_i = rowsum(dO_i ∘ O_i)`. Call it beside
    /// [`Backend::backward`] (whose dQ, dK, dV take the sink into account through the
    /// forward's LSE); it reads only O, dO and the LSE. Deterministic, summed in a fixed
    /// order (fa-cpu's [`fa_cpu::backward_sinks`]). Errors, before `d_sinks` is written:
    /// CUDA (`Unsupported`), a problem without sinks, O and dO of different or unsupported
    /// dtypes, short buffers.
    pub fn backward_sinks(
        &self,
        problem: &Problem,
        inputs: BackwardInputs<'_>,
        d_sinks: &mut [f32],
    ) -> Result<(), Error> {
        if self.kind() == BackendKind::Cuda {
            return Err(CUDA_SINKS.into());
        }
        fa_cpu::backward_sinks_dyn(problem, inputs, d_sinks)?;
        Ok(())
    }

    /// The checks of a backward call that come before any work: the backend, the dtypes
    /// (the forward's rules for Q/K/V and O, plus dO and the gradients).
    fn check_backward(
        &self,
        problem: &Problem,
        qkv: &Qkv<TensorRef<'_>>,
        inputs: &BackwardInputs<'_>,
        grads: &Grads<TensorMut<'_>>,
    ) -> Result<(), Error> {
        let input = qkv.q.dtype();
        let (out, grad) = (inputs.o.dtype(), grads.dq.dtype());
        let same_inputs = qkv.k.dtype() == input && qkv.v.dtype() == input;
        let same_grads = grads.dk.dtype() == grad && grads.dv.dtype() == grad;
        if self.kind() == BackendKind::Cuda {
            let half = matches!(input, DType::Bf16 | DType::F16);
            let all_one = out == input && inputs.d_o.dtype() == input && grad == input;
            if !(half && same_inputs && same_grads && all_one) {
                return Err(CUDA_BACKWARD_DTYPES.into());
            }
            self.check(problem, DTypes { input, output: out })?;
            fa_cuda::supports_backward(problem, input)?;
            return Ok(());
        }
        let ok_out = inputs.d_o.dtype() == out && (out == input || out == DType::F32);
        let ok_grads = same_grads && (grad == input || grad == DType::F32);
        if !(same_inputs && ok_out && ok_grads) {
            return Err(CPU_BACKWARD_DTYPES.into());
        }
        self.check(problem, DTypes { input, output: out })?;
        Ok(())
    }
}

/// The fa-cuda call for the tensors' dtype (checked by [`Backend::check_backward`]): plan,
/// workspace and run through `Device::backward_host`.
fn cuda_backward(
    d: &fa_cuda::Device,
    problem: &Problem,
    qkv: Qkv<TensorRef<'_>>,
    inputs: BackwardInputs<'_>,
    grads: Grads<TensorMut<'_>>,
) -> Result<BackwardStats, Error> {
    let opts = fa_cuda::BackwardOptions::default();
    let lse = inputs.lse;
    match (qkv.q, qkv.k, qkv.v, inputs.o, inputs.d_o) {
        (
            TensorRef::Bf16(q),
            TensorRef::Bf16(k),
            TensorRef::Bf16(v),
            TensorRef::Bf16(o),
            TensorRef::Bf16(d_o),
        ) => match grads {
            Grads {
                dq: TensorMut::Bf16(dq),
                dk: TensorMut::Bf16(dk),
                dv: TensorMut::Bf16(dv),
            } => d.backward_host(
                problem,
                Qkv::new(q, k, v),
                fa_cuda::BackwardInputs { o, d_o, lse },
                Grads::new(dq, dk, dv),
                &opts,
            )?,
            _ => return Err(CUDA_BACKWARD_DTYPES.into()),
        },
        (
            TensorRef::F16(q),
            TensorRef::F16(k),
            TensorRef::F16(v),
            TensorRef::F16(o),
            TensorRef::F16(d_o),
        ) => match grads {
            Grads {
                dq: TensorMut::F16(dq),
                dk: TensorMut::F16(dk),
                dv: TensorMut::F16(dv),
            } => d.backward_host(
                problem,
                Qkv::new(q, k, v),
                fa_cuda::BackwardInputs { o, d_o, lse },
                Grads::new(dq, dk, dv),
                &opts,
            )?,
            _ => return Err(CUDA_BACKWARD_DTYPES.into()),
        },
        _ => return Err(CUDA_BACKWARD_DTYPES.into()),
    };
    Ok(BackwardStats::default())
}

/// [`Backend::time_backward`] on CUDA: uploads once, then times each run's kernels with CUDA
/// events (seconds per run). `grads` only sizes the device gradients.
fn cuda_time_backward(
    d: &fa_cuda::Device,
    problem: &Problem,
    qkv: Qkv<TensorRef<'_>>,
    inputs: BackwardInputs<'_>,
    grads: &Grads<TensorMut<'_>>,
    warmup: usize,
    iters: usize,
) -> Result<Vec<f64>, Error> {
    use softmax_core::Extent;
    let opts = fa_cuda::BackwardOptions::default();
    let lse = d.upload(inputs.lse)?;
    macro_rules! timed {
        ($t:ty, $q:expr, $k:expr, $v:expr, $o:expr, $d_o:expr) => {{
            let (q, k, v) = (d.upload($q)?, d.upload($k)?, d.upload($v)?);
            let (o, d_o) = (d.upload($o)?, d.upload($d_o)?);
            let mut dq = d.alloc_zeroed::<$t>(grads.dq.elems())?;
            let mut dk = d.alloc_zeroed::<$t>(grads.dk.elems())?;
            let mut dv = d.alloc_zeroed::<$t>(grads.dv.elems())?;
            d.time_backward(
                problem,
                Qkv::new(&q, &k, &v),
                fa_cuda::BackwardInputs {
                    o: &o,
                    d_o: &d_o,
                    lse: &lse,
                },
                Grads::new(&mut dq, &mut dk, &mut dv),
                &opts,
                warmup,
                iters,
            )?
        }};
    }
    let ms = match (qkv.q, qkv.k, qkv.v, inputs.o, inputs.d_o) {
        (
            TensorRef::Bf16(q),
            TensorRef::Bf16(k),
            TensorRef::Bf16(v),
            TensorRef::Bf16(o),
            TensorRef::Bf16(d_o),
        ) => timed!(half::bf16, q, k, v, o, d_o),
        (
            TensorRef::F16(q),
            TensorRef::F16(k),
            TensorRef::F16(v),
            TensorRef::F16(o),
            TensorRef::F16(d_o),
        ) => timed!(half::f16, q, k, v, o, d_o),
        _ => return Err(CUDA_BACKWARD_DTYPES.into()),
    };
    Ok(ms.into_iter().map(|t| f64::from(t) / 1e3).collect())
}

/// The fa-cpu call for the tensors' dtypes (checked by [`Backend::check_backward`]).
fn cpu_backward(
    problem: &Problem,
    qkv: Qkv<TensorRef<'_>>,
    inputs: BackwardInputs<'_>,
    grads: Grads<TensorMut<'_>>,
    opts: &Options,
) -> Result<BackwardStats, Error> {
    let bopts = fa_cpu::BackwardOptions {
        threads: opts.threads,
        simd: opts.cpu_simd,
    };
    let stats = fa_cpu::backward_dyn(problem, qkv, inputs, grads, &bopts, None)?;
    Ok(BackwardStats {
        tiles_computed: stats.tiles_computed,
        tiles_skipped: stats.tiles_skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendChoice;
    use softmax_core::{Out, ProblemDesc};

    fn draw(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 * 0.731 + seed as f32 * 1.37).sin() * 1.3)
            .collect()
    }

    #[test]
    fn cpu_backward_matches_fa_cpu_bitwise_and_checks_before_writing() {
        let p = ProblemDesc::new(1, 37, 41, 4, 2, 24)
            .causal()
            .validate(256)
            .expect("valid");
        let lens = p.min_buffer_lens();
        let (q, k, v) = (draw(lens.q, 1), draw(lens.k, 2), draw(lens.v, 3));
        let d_o = draw(lens.o, 4);
        let mut o = vec![0.0f32; lens.o];
        let mut lse = vec![0.0f32; p.lse_len()];
        fa_cpu::forward(
            &p,
            Qkv::new(&q[..], &k[..], &v[..]),
            Out::with_lse(&mut o[..], &mut lse[..]),
            &fa_cpu::ForwardOptions::default(),
        )
        .expect("forward");
        let nan = f32::NAN;
        let mut direct = Grads::new(vec![nan; lens.q], vec![nan; lens.k], vec![nan; lens.v]);
        fa_cpu::backward(
            &p,
            Qkv::new(&q[..], &k[..], &v[..]),
            fa_cpu::BackwardInputs {
                o: &o,
                d_o: &d_o,
                lse: &lse,
            },
            Grads::new(&mut direct.dq[..], &mut direct.dk[..], &mut direct.dv[..]),
            &fa_cpu::BackwardOptions::default(),
        )
        .expect("backward");
        let b = Backend::open(BackendChoice::Cpu).expect("cpu");
        let qkv = Qkv::new(
            TensorRef::from(&q),
            TensorRef::from(&k),
            TensorRef::from(&v),
        );
        let inputs = BackwardInputs {
            o: TensorRef::from(&o),
            d_o: TensorRef::from(&d_o),
            lse: &lse,
        };
        let mut g = Grads::new(vec![nan; lens.q], vec![nan; lens.k], vec![nan; lens.v]);
        let stats = b
            .backward(
                &p,
                qkv,
                inputs,
                Grads::new(
                    TensorMut::from(&mut g.dq),
                    TensorMut::from(&mut g.dk),
                    TensorMut::from(&mut g.dv),
                ),
                &Options::default(),
            )
            .expect("backward");
        assert!(stats.tiles_computed > 0);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&g.dq), bits(&direct.dq));
        assert_eq!(bits(&g.dk), bits(&direct.dk));
        assert_eq!(bits(&g.dv), bits(&direct.dv));
        let times = b
            .time_backward(
                &p,
                qkv,
                inputs,
                Grads::new(
                    TensorMut::from(&mut g.dq),
                    TensorMut::from(&mut g.dk),
                    TensorMut::from(&mut g.dv),
                ),
                &Options::default(),
                1,
                2,
            )
            .expect("timed");
        assert_eq!(times.len(), 2);
        assert_eq!(bits(&g.dq), bits(&direct.dq));

        // Mixed gradient dtypes: a typed error, nothing written.
        let mut h = vec![half::bf16::from_f32(7.0); lens.k];
        let mut poisoned = Grads::new(vec![7.0f32; lens.q], Vec::new(), vec![7.0f32; lens.v]);
        let e = b
            .backward(
                &p,
                qkv,
                inputs,
                Grads::new(
                    TensorMut::from(&mut poisoned.dq),
                    TensorMut::from(&mut h),
                    TensorMut::from(&mut poisoned.dv),
                ),
                &Options::default(),
            )
            .unwrap_err();
        assert!(
            matches!(e, Error::Problem(ProblemError::Unsupported { .. })),
            "{e:?}"
        );
        assert!(poisoned.dq.iter().chain(&poisoned.dv).all(|&x| x == 7.0));
        assert!(h.iter().all(|x| x.to_f32() == 7.0));
        // A short dQ: BufferTooSmall, nothing written.
        let e = b
            .backward(
                &p,
                qkv,
                inputs,
                Grads::new(
                    TensorMut::from(&mut poisoned.dq[..lens.q - 1]),
                    TensorMut::from(&mut g.dk),
                    TensorMut::from(&mut poisoned.dv),
                ),
                &Options::default(),
            )
            .unwrap_err();
        assert!(
            matches!(e, Error::Problem(ProblemError::BufferTooSmall { .. })),
            "{e:?}"
        );
        assert!(poisoned.dq.iter().chain(&poisoned.dv).all(|&x| x == 7.0));
    }

    /// Sinks through the facade: the forward and `backward_sinks` are fa-cpu's bit for bit;
    /// a problem with sinks is refused by CUDA's capabilities.
    #[test]
    fn sinks_reach_the_cpu_and_cuda_refuses_them() {
        let sinks = [0.5f32, -1.25, 2.0, 0.0];
        let p = ProblemDesc::new(1, 9, 11, 4, 2, 16)
            .causal()
            .with_sinks(&sinks)
            .validate(256)
            .expect("valid");
        let lens = p.min_buffer_lens();
        let (q, k, v) = (draw(lens.q, 1), draw(lens.k, 2), draw(lens.v, 3));
        let d_o = draw(lens.o, 4);
        let mut o = vec![0.0f32; lens.o];
        let mut lse = vec![0.0f32; p.lse_len()];
        let b = Backend::open(BackendChoice::Cpu).expect("cpu");
        assert!(b.capabilities().sinks);
        b.forward(
            &p,
            Qkv::new(
                TensorRef::from(&q),
                TensorRef::from(&k),
                TensorRef::from(&v),
            ),
            Out::with_lse(TensorMut::from(&mut o), &mut lse[..]),
            &Options::default(),
        )
        .expect("forward");
        let mut direct_o = vec![0.0f32; lens.o];
        let mut direct_lse = vec![0.0f32; p.lse_len()];
        fa_cpu::forward(
            &p,
            Qkv::new(&q[..], &k[..], &v[..]),
            Out::with_lse(&mut direct_o[..], &mut direct_lse[..]),
            &fa_cpu::ForwardOptions::default(),
        )
        .expect("forward");
        assert_eq!(o, direct_o);
        assert_eq!(lse, direct_lse);
        let mut d_sinks = [f32::NAN; 4];
        let inputs = BackwardInputs {
            o: TensorRef::from(&o),
            d_o: TensorRef::from(&d_o),
            lse: &lse,
        };
        b.backward_sinks(&p, inputs, &mut d_sinks).expect("d sinks");
        let mut want = [f32::NAN; 4];
        fa_cpu::backward_sinks(
            &p,
            fa_cpu::BackwardInputs {
                o: &o,
                d_o: &d_o,
                lse: &lse,
            },
            &mut want,
        )
        .expect("d sinks");
        assert_eq!(d_sinks.map(f32::to_bits), want.map(f32::to_bits));
        assert!(d_sinks.iter().all(|x| x.is_finite()));
        assert!(!crate::backend::BackendKind::Cuda.capabilities().sinks);
        let e = crate::backend::check_kind_for_tests(
            crate::backend::BackendKind::Cuda,
            &p,
            DTypes {
                input: DType::Bf16,
                output: DType::Bf16,
            },
        )
        .unwrap_err();
        assert!(matches!(e, ProblemError::Unsupported { what } if what.contains("sinks")));
    }

    /// `Options::cpu_simd` reaches the backward: at every level this CPU has, the facade's
    /// gradients are fa-cpu's at that level bit for bit (bf16 inputs, so `Amx` runs the AMX
    /// backward and `Avx512f` the widening one); a level it lacks is the typed error, with
    /// the gradients untouched (the facade once ran `Auto` whatever was asked).
    #[test]
    fn cpu_simd_reaches_the_backward() {
        use fa_cpu::SimdLevel;
        let p = ProblemDesc::new(1, 40, 40, 2, 2, 32)
            .causal()
            .validate(256)
            .expect("valid");
        let lens = p.min_buffer_lens();
        let bf = |n: usize, seed: u32| -> Vec<half::bf16> {
            draw(n, seed)
                .into_iter()
                .map(half::bf16::from_f32)
                .collect()
        };
        let (q, k, v, d_o) = (bf(lens.q, 5), bf(lens.k, 6), bf(lens.v, 7), bf(lens.o, 8));
        let mut o = vec![half::bf16::ZERO; lens.o];
        let mut lse = vec![0.0f32; p.lse_len()];
        fa_cpu::forward(
            &p,
            Qkv::new(&q[..], &k[..], &v[..]),
            Out::with_lse(&mut o[..], &mut lse[..]),
            &fa_cpu::ForwardOptions::default(),
        )
        .expect("forward");
        let b = Backend::open(BackendChoice::Cpu).expect("cpu");
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let (mut ran, mut refused) = (0, 0);
        for level in [
            SimdLevel::Scalar,
            SimdLevel::Avx2Fma,
            SimdLevel::Avx512f,
            SimdLevel::Amx,
        ] {
            let nan = f32::NAN;
            let mut g = Grads::new(vec![nan; lens.q], vec![nan; lens.k], vec![nan; lens.v]);
            let got = b.backward(
                &p,
                Qkv::new(
                    TensorRef::from(&q),
                    TensorRef::from(&k),
                    TensorRef::from(&v),
                ),
                BackwardInputs {
                    o: TensorRef::from(&o),
                    d_o: TensorRef::from(&d_o),
                    lse: &lse,
                },
                Grads::new(
                    TensorMut::from(&mut g.dq),
                    TensorMut::from(&mut g.dk),
                    TensorMut::from(&mut g.dv),
                ),
                &Options {
                    cpu_simd: level,
                    ..Options::default()
                },
            );
            if !level.is_available() {
                let e = got.unwrap_err();
                assert!(
                    matches!(e, Error::Problem(ProblemError::Unsupported { .. })),
                    "{level:?}: {e:?}"
                );
                assert!(g.dq.iter().chain(&g.dk).chain(&g.dv).all(|x| x.is_nan()));
                refused += 1;
                continue;
            }
            got.expect("backward");
            let mut want = Grads::new(vec![nan; lens.q], vec![nan; lens.k], vec![nan; lens.v]);
            fa_cpu::backward(
                &p,
                Qkv::new(&q[..], &k[..], &v[..]),
                fa_cpu::BackwardInputs {
                    o: &o[..],
                    d_o: &d_o[..],
                    lse: &lse,
                },
                Grads::new(&mut want.dq[..], &mut want.dk[..], &mut want.dv[..]),
                &fa_cpu::BackwardOptions {
                    simd: level,
                    ..Default::default()
                },
            )
            .expect("backward");
            assert_eq!(bits(&g.dq), bits(&want.dq), "{level:?}");
            assert_eq!(bits(&g.dk), bits(&want.dk), "{level:?}");
            assert_eq!(bits(&g.dv), bits(&want.dv), "{level:?}");
            ran += 1;
        }
        assert!(ran >= 1 && ran + refused == 4);
    }
}
