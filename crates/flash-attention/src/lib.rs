//! Exact attention behind one API: pick a backend (the SIMD CPU kernel of `fa-cpu` or the
//! CUDA kernels of `fa-cuda`), ask what it can run, and call it on host tensors whose dtype is
//! known only at run time. This is the one Rust entry point that the command line (`fa`),
//! the C ABI and the Python package sit on.
//!
//! - [`Backend`]: [`Backend::open`] / [`Backend::open_for`] a [`BackendChoice`] (`Auto` takes
//!   CUDA when a device opens and takes the call's dtypes, else the CPU), then
//!   [`Backend::capabilities`], [`Backend::check`] (can it run this problem, answered before
//!   any work), [`Backend::forward`] and [`Backend::time_forward`];
//! - [`TensorRef`] / [`TensorMut`]: dtype-erased views of f32, bf16 and f16 host slices;
//! - [`host`]: foreign host memory (raw addresses, as the C ABI and the Python module hold
//!   them) checked into those views, and [`host::backward`], a whole CPU backward call on
//!   such addresses;
//! - attention sinks (gpt-oss: one logit per query head in every row's denominator) travel in
//!   the problem ([`ProblemDesc::sinks`]); the CPU runs them in every forward and gives their
//!   gradient through [`Backend::backward_sinks`] beside [`Backend::backward`]; CUDA answers
//!   `Unsupported` for now ([`Capabilities::sinks`]);
//! - [`shapes`]: benchmark shapes (the FlashAttention papers' sweep), their bytes and FLOPs.
//!
//! Problems are described and validated with `softmax-core` ([`ProblemDesc`] →
//! [`Problem`]); buffers travel in its bundles [`Qkv`] and [`Out`]. Errors are values
//! ([`Error`]), never panics.
//!
//! # Example
//! ```
//! use flash_attention::{Backend, BackendChoice, DTypes, Options, Out, ProblemDesc, Qkv};
//! use flash_attention::{DType, TensorMut, TensorRef};
//!
//! // 1 sequence, 4 queries, 6 keys, 2 query heads over 1 KV head (GQA), head dim 8, causal.
//! let problem = ProblemDesc::new(1, 4, 6, 2, 1, 8).causal().validate(256)?;
//! let q: Vec<f32> = (0..4 * 2 * 8).map(|i| (i as f32 * 0.3).sin()).collect();
//! let k: Vec<f32> = (0..6 * 8).map(|i| (i as f32 * 0.7).cos()).collect();
//! let v: Vec<f32> = (0..6 * 8).map(|i| i as f32 * 0.01).collect();
//! let mut o = vec![0.0f32; 4 * 2 * 8];
//! let mut lse = vec![0.0f32; 2 * 4];
//!
//! // f32 inputs: `Auto` runs them on the CPU (the CUDA kernels take bf16/f16).
//! let backend = Backend::open_for(BackendChoice::Auto, DTypes::same(DType::F32))?;
//! assert_eq!(backend.name(), "cpu");
//! backend.check(&problem, DTypes::same(DType::F32))?;
//! let qkv = Qkv::new(TensorRef::from(&q), TensorRef::from(&k), TensorRef::from(&v));
//! let out = Out::with_lse(TensorMut::from(&mut o), &mut lse[..]);
//! let stats = backend.forward(&problem, qkv, out, &Options::default())?;
//! assert!(stats.tiles_computed.is_some());
//! assert!(o.iter().chain(&lse).all(|x| x.is_finite()));
//! # Ok::<(), flash_attention::Error>(())
//! ```

pub mod backend;
pub mod backward;
pub mod host;
pub mod shapes;
pub mod tensor;

pub use backend::{
    append_kv, warmup, Backend, BackendChoice, BackendKind, Capabilities, CpuDecodeOptions,
    CpuDecodePrefetch, CpuSimd, DTypes, Error, Exp2, ForwardStats, Options, OutputDTypes,
};
pub use backward::{BackwardInputs, BackwardStats};
pub use fa_cuda::{KernelFamilyChoice, KernelOrigin, PrecompileReport, Sm90Pipeline, Tiles};
pub use softmax_core::{
    Append, AppendDesc, DType, Grads, KvCache, Out, Problem, ProblemDesc, ProblemError, Qkv,
    RescalePolicy,
};
pub use tensor::{TensorMut, TensorRef};

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn problem(head_dim: usize) -> Problem<'static> {
        ProblemDesc::new(1, 16, 16, 2, 2, head_dim)
            .validate(256)
            .expect("valid")
    }

    #[test]
    fn cpu_takes_every_dtype_and_f32_output() {
        let cpu = BackendKind::Cpu.capabilities();
        for d in DType::ALL {
            assert!(cpu.takes(DTypes::same(d)), "{d}");
            assert!(cpu.takes(DTypes {
                input: d,
                output: DType::F32
            }));
        }
        assert!(!cpu.takes(DTypes {
            input: DType::F32,
            output: DType::Bf16
        }));
        let b = Backend::cpu();
        for d in DType::ALL {
            assert_eq!(b.check(&problem(60), DTypes::same(d)), Ok(()));
        }
    }

    #[test]
    fn cuda_rejects_f32_and_head_dim_60_with_clear_errors() {
        let caps = BackendKind::Cuda.capabilities();
        assert!(!caps.takes(DTypes::same(DType::F32)));
        assert!(caps.takes(DTypes::same(DType::Bf16)));
        assert!(!caps.takes(DTypes {
            input: DType::Bf16,
            output: DType::F32
        }));
        let unsupported = |r: Result<(), ProblemError>| match r {
            Err(ProblemError::Unsupported { what }) => what,
            other => panic!("expected Unsupported, got {other:?}"),
        };
        let what = unsupported(backend::check_kind_for_tests(
            BackendKind::Cuda,
            &problem(64),
            DTypes::same(DType::F32),
        ));
        assert!(what.contains("bf16 or f16"), "{what}");
        let what = unsupported(backend::check_kind_for_tests(
            BackendKind::Cuda,
            &problem(60),
            DTypes::same(DType::Bf16),
        ));
        assert!(what.contains("multiples of 8"), "{what}");
        assert_eq!(
            backend::check_kind_for_tests(
                BackendKind::Cuda,
                &problem(64),
                DTypes::same(DType::F16)
            ),
            Ok(())
        );
        let cache = [16u32];
        let cached = ProblemDesc::new(1, 1, 16, 2, 2, 64)
            .padded_cache(&cache)
            .validate(256)
            .expect("valid");
        // Both backends read KV caches (split-KV decode).
        for kind in [BackendKind::Cpu, BackendKind::Cuda] {
            assert!(kind.capabilities().kv_cache);
            assert_eq!(
                backend::check_kind_for_tests(kind, &cached, DTypes::same(DType::Bf16)),
                Ok(())
            );
        }
    }

    #[test]
    fn cpu_decode_over_a_paged_cache_and_append_match_fa_cpu() {
        // 2 sequences, 1 query each, 4 query / 2 KV heads, dim 8, blocks of 4 keys.
        let used = [6u32, 3];
        let table = [2i32, 0, -1, 1, 3, -1];
        let (blocks, block_size, row) = (4, 4, 2 * 8);
        let cache_len = blocks * block_size * row;
        let mut k: Vec<f32> = (0..cache_len).map(|i| (i as f32 * 0.13).sin()).collect();
        let mut v: Vec<f32> = (0..cache_len).map(|i| (i as f32 * 0.07).cos()).collect();
        // Append one token to each sequence, then attend over the grown cache.
        let append = softmax_core::AppendDesc::new(
            softmax_core::KvCache::Paged {
                seqused_k: &used,
                block_table: &table,
                blocks_per_seq: 3,
                block_size,
                num_blocks: blocks,
            },
            0,
            1,
            2,
            8,
        )
        .validate()
        .expect("valid");
        let k_new: Vec<f32> = (0..2 * row).map(|i| i as f32).collect();
        let v_new: Vec<f32> = (0..2 * row).map(|i| -(i as f32)).collect();
        let bf: Vec<bf16> = k_new.iter().map(|&x| bf16::from_f32(x)).collect();
        let e = crate::append_kv(
            &append,
            TensorRef::from(&bf),
            TensorRef::from(&v_new),
            TensorMut::from(&mut k),
            TensorMut::from(&mut v),
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::Problem(ProblemError::Unsupported { .. })),
            "{e:?}"
        );
        let before = k.clone();
        crate::append_kv(
            &append,
            TensorRef::from(&k_new),
            TensorRef::from(&v_new),
            TensorMut::from(&mut k),
            TensorMut::from(&mut v),
        )
        .expect("append");
        // Sequence 0's token 6 is row 2 of its second block (block 0).
        assert_eq!(&k[2 * row..3 * row], &k_new[..row]);
        assert_eq!(
            k.iter().zip(&before).filter(|(a, b)| a != b).count(),
            2 * row
        );
        let grown = [7u32, 4];
        let p = ProblemDesc::new(2, 1, 0, 4, 2, 8)
            .causal()
            .paged_cache(&grown, &table, 3, block_size, blocks)
            .validate(256)
            .expect("valid");
        let q: Vec<f32> = (0..2 * 4 * 8).map(|i| (i as f32 * 0.29).cos()).collect();
        let mut direct = vec![0.0f32; 2 * 4 * 8];
        let fopts = fa_cpu::ForwardOptions {
            kv_splits: Some(2),
            ..Default::default()
        };
        fa_cpu::forward(
            &p,
            Qkv::new(&q[..], &k[..], &v[..]),
            Out::new(&mut direct[..]),
            &fopts,
        )
        .expect("runs");
        let mut o = vec![f32::NAN; 2 * 4 * 8];
        let stats = Backend::cpu()
            .forward(
                &p,
                Qkv::new(
                    TensorRef::from(&q),
                    TensorRef::from(&k),
                    TensorRef::from(&v),
                ),
                Out::new(TensorMut::from(&mut o)),
                &Options {
                    kv_splits: Some(2),
                    ..Options::default()
                },
            )
            .expect("runs");
        assert_eq!(o, direct);
        // At most one split per key tile: 7 keys are one tile, so the call ran unsplit.
        assert_eq!(stats.kv_splits, Some(1));
    }

    /// `Options::cpu_decode` reaches fa-cpu's decode loop: for each setting (the default,
    /// `vdpbf16ps` products at AVX-512, f32 `P·V`, another prefetch schedule) the facade's
    /// bf16 decode output is fa-cpu's under the same `DecodeOptions` bit for bit; where the CPU
    /// lets a setting change the path (AVX512-BF16, or AMX tiles) fa-cpu's output differs
    /// from the default's, so a facade that dropped the options fails the equality.
    #[test]
    fn cpu_decode_options_reach_the_decode_loop() {
        let used = [200u32, 77];
        let p = ProblemDesc::new(2, 1, 256, 8, 2, 64)
            .padded_cache(&used)
            .validate(256)
            .expect("valid");
        let lens = p.min_buffer_lens();
        let draw = |n: usize, s: f32| -> Vec<bf16> {
            (0..n)
                .map(|i| bf16::from_f32((i as f32 * 0.377 + s).sin() * 2.0))
                .collect()
        };
        let (q, k, v) = (draw(lens.q, 0.1), draw(lens.k, 0.2), draw(lens.v, 0.3));
        let avx512 = CpuSimd::Avx512f.is_available();
        let simd = if avx512 {
            CpuSimd::Avx512f
        } else {
            CpuSimd::Auto
        };
        let d = CpuDecodeOptions::default();
        let settings = [
            (CpuSimd::Auto, d),
            (
                simd,
                CpuDecodeOptions {
                    bf16_dots: true,
                    ..d
                },
            ),
            (simd, d),
            (CpuSimd::Auto, CpuDecodeOptions { amx_pv: false, ..d }),
            (
                CpuSimd::Auto,
                CpuDecodeOptions {
                    prefetch: CpuDecodePrefetch::Next,
                    ..d
                },
            ),
        ];
        // One call of each setting through fa-cpu and through the facade, output in `$t`;
        // their bits (as u32), equal.
        macro_rules! outputs {
            ($t:ty) => {{
                let mut outs = Vec::new();
                for (level, decode) in settings {
                    let nan = <$t as fa_cpu::Element>::from_f32(f32::NAN);
                    let mut direct = vec![nan; lens.o];
                    fa_cpu::forward(
                        &p,
                        Qkv::new(&q[..], &k[..], &v[..]),
                        Out::new(&mut direct[..]),
                        &fa_cpu::ForwardOptions {
                            simd: level,
                            decode,
                            ..Default::default()
                        },
                    )
                    .expect("runs");
                    let mut o = vec![nan; lens.o];
                    Backend::cpu()
                        .forward(
                            &p,
                            Qkv::new(
                                TensorRef::from(&q),
                                TensorRef::from(&k),
                                TensorRef::from(&v),
                            ),
                            Out::new(TensorMut::from(&mut o)),
                            &Options {
                                cpu_simd: level,
                                cpu_decode: decode,
                                ..Options::default()
                            },
                        )
                        .expect("runs");
                    let bits = |x: &[$t]| {
                        x.iter()
                            .map(|v| fa_cpu::Element::to_f32(*v).to_bits())
                            .collect::<Vec<u32>>()
                    };
                    assert_eq!(bits(&o), bits(&direct), "{level:?} {decode:?}");
                    outs.push(bits(&o));
                }
                outs
            }};
        }
        let (wide, narrow) = (outputs!(f32), outputs!(bf16));
        // The prefetch schedule never changes results.
        assert_eq!(wide[4], wide[0]);
        assert_eq!(narrow[4], narrow[0]);
        // vdpbf16ps (f32 output: its rounding shows), the AMX P·V (bf16 output only).
        let changed = usize::from(wide[1] != wide[2]) + usize::from(narrow[3] != narrow[0]);
        if changed == 0 {
            eprintln!(
                "NOTE: neither vdpbf16ps nor AMX tiles here: no decode option changes this \
                 CPU's path, checked only for equality with fa-cpu"
            );
        }
    }

    #[test]
    fn auto_falls_back_to_the_cpu_without_a_gpu() {
        // f32 never goes to CUDA under Auto, with or without a GPU.
        let b = Backend::open_for(BackendChoice::Auto, DTypes::same(DType::F32)).expect("cpu");
        assert_eq!(b.kind(), BackendKind::Cpu);
        if !fa_cuda::driver_available() {
            let b = Backend::open(BackendChoice::Auto).expect("cpu");
            assert_eq!(b.kind(), BackendKind::Cpu);
            assert_eq!(b.default_dtype(), DType::F32);
            let e = Backend::open(BackendChoice::Cuda).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Unavailable {
                        backend: BackendKind::Cuda,
                        ..
                    }
                ),
                "{e:?}"
            );
            assert!(e.to_string().starts_with("CUDA is not usable here"), "{e}");
        }
        assert_eq!(BackendChoice::from_name("cuda"), Some(BackendChoice::Cuda));
        assert_eq!(BackendChoice::from_name("gpu"), None);
    }

    #[test]
    fn forward_checks_dtypes_and_lengths_before_writing() {
        let p = problem(8);
        let n = 16 * 2 * 8;
        let q = vec![bf16::from_f32(0.5); n];
        let k = vec![0.25f32; n];
        let mut o = vec![bf16::from_f32(7.0); n];
        let b = Backend::cpu();
        let mixed = Qkv::new(
            TensorRef::from(&q),
            TensorRef::from(&k),
            TensorRef::from(&q),
        );
        let e = b
            .forward(
                &p,
                mixed,
                Out::new(TensorMut::from(&mut o)),
                &Options::default(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("share one dtype"), "{e}");
        let short = Qkv::new(
            TensorRef::from(&q[..n - 1]),
            TensorRef::from(&q),
            TensorRef::from(&q),
        );
        let e = b
            .forward(
                &p,
                short,
                Out::new(TensorMut::from(&mut o)),
                &Options::default(),
            )
            .unwrap_err();
        assert!(
            matches!(e, Error::Problem(ProblemError::BufferTooSmall { .. })),
            "{e:?}"
        );
        assert!(o.iter().all(|x| x.to_f32() == 7.0), "untouched on error");
    }

    #[test]
    fn cpu_forward_and_timing_match_fa_cpu_bitwise() {
        let p = problem(8);
        let n = 16 * 2 * 8;
        let x: Vec<bf16> = (0..n)
            .map(|i| bf16::from_f32((i as f32 * 0.37).sin()))
            .collect();
        let mut direct = vec![0.0f32; n];
        let mut direct_lse = vec![0.0f32; 2 * 16];
        fa_cpu::forward(
            &p,
            Qkv::new(&x[..], &x[..], &x[..]),
            Out::with_lse(&mut direct[..], &mut direct_lse[..]),
            &fa_cpu::ForwardOptions::default(),
        )
        .expect("runs");
        let b = Backend::cpu();
        let qkv = Qkv::new(
            TensorRef::from(&x),
            TensorRef::from(&x),
            TensorRef::from(&x),
        );
        let mut o = vec![0.0f32; n];
        let mut lse = vec![0.0f32; 2 * 16];
        b.forward(
            &p,
            qkv,
            Out::with_lse(TensorMut::from(&mut o), &mut lse[..]),
            &Options::default(),
        )
        .expect("runs");
        assert_eq!(o, direct);
        assert_eq!(lse, direct_lse);
        let mut o2 = vec![0.0f32; n];
        let times = b
            .time_forward(
                &p,
                qkv,
                Out::new(TensorMut::from(&mut o2)),
                &Options::default(),
                1,
                2,
            )
            .expect("runs");
        assert_eq!(times.len(), 2);
        assert_eq!(o2, direct);
    }

    /// Issue 16: a huge `iters` aborted the process ("capacity overflow" / "memory allocation
    /// failed"), and a huge thread count started thousands of threads; both are typed errors.
    #[test]
    fn absurd_iteration_and_thread_counts_are_typed_errors() {
        let p = problem(8);
        let n = 16 * 2 * 8;
        let x = vec![0.5f32; n];
        let qkv = Qkv::new(
            TensorRef::from(&x),
            TensorRef::from(&x),
            TensorRef::from(&x),
        );
        let mut o = vec![7.0f32; n];
        let b = Backend::cpu();
        let e = b
            .time_forward(
                &p,
                qkv,
                Out::new(TensorMut::from(&mut o)),
                &Options::default(),
                0,
                usize::MAX / 2,
            )
            .unwrap_err();
        assert!(
            matches!(e, Error::Problem(ProblemError::OutOfMemory { .. })),
            "{e:?}"
        );
        let e = b
            .time_forward(
                &p,
                qkv,
                Out::new(TensorMut::from(&mut o)),
                &Options::default(),
                usize::MAX,
                1,
            )
            .unwrap_err();
        assert!(matches!(e, Error::Problem(ProblemError::Overflow)), "{e:?}");
        let many = Options {
            threads: Some(5000),
            ..Options::default()
        };
        let e = b
            .forward(&p, qkv, Out::new(TensorMut::from(&mut o)), &many)
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Problem(ProblemError::TooManyThreads { threads: 5000, .. })
            ),
            "{e:?}"
        );
        assert!(o.iter().all(|&x| x == 7.0), "untouched on error");
    }
}
