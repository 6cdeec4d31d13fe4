//! The call contract: typed errors with untouched outputs for every kind of bad input,
//! bitwise identical results for any thread count and workspace reuse, the probability hook,
//! NaN propagation, statistics.

mod common;

use common::{levels, run};
use fa_cpu::{
    forward, forward_with_workspace, scratch_bytes_per_thread, ForwardOptions, SimdLevel, Workspace,
};
use fa_reference::{attention_f64, compare, Case, Rng};
use softmax_core::{
    Out, ProblemDesc, ProblemError, Qkv, RescalePolicy, Strides, Tensor, MAX_HEAD_DIM,
};

/// Buffer lengths of Q, K, V, O and the LSE.
type Lens = (usize, usize, usize, usize, Option<usize>);

/// Runs `forward` on a bad call and checks the error and that O and the LSE are untouched.
fn expect_error(
    desc: &ProblemDesc,
    lens: Lens,
    opts: &ForwardOptions,
    want: impl Fn(&ProblemError) -> bool,
) {
    let mut rng = Rng::new(5);
    let mut draw = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normal() as f32).collect() };
    let (q, k, v) = (draw(lens.0), draw(lens.1), draw(lens.2));
    let sentinel = 12345.0f32;
    let mut out = vec![sentinel; lens.3];
    let mut lse = lens.4.map(|n| vec![sentinel; n]);
    // Validation at the edge, then the backend's own checks: either may reject.
    let err = desc
        .validate(MAX_HEAD_DIM)
        .and_then(|problem| {
            let qkv = Qkv::new(&q[..], &k[..], &v[..]);
            let out = Out {
                o: &mut out[..],
                lse: lse.as_deref_mut(),
            };
            forward(&problem, qkv, out, opts)
        })
        .expect_err("bad input must be rejected");
    assert!(want(&err), "unexpected error {err:?} ({err})");
    assert!(
        out.iter().all(|&x| x == sentinel),
        "output touched on {err}"
    );
    if let Some(lse) = lse {
        assert!(lse.iter().all(|&x| x == sentinel), "lse touched on {err}");
    }
}

#[test]
fn every_bad_input_is_a_typed_error_and_leaves_outputs_untouched() {
    let ok = ProblemDesc::new(2, 5, 7, 4, 2, 8);
    let n = |s: usize, h: usize, d: usize| 2 * s * h * d;
    let good = (
        n(5, 4, 8),
        n(7, 2, 8),
        n(7, 2, 8),
        n(5, 4, 8),
        Some(2 * 4 * 5),
    );
    let opts = ForwardOptions::default();
    // Shape errors.
    expect_error(&ProblemDesc::new(2, 5, 7, 0, 2, 8), good, &opts, |e| {
        matches!(e, ProblemError::ZeroDim { what: "heads_q" })
    });
    expect_error(&ProblemDesc::new(2, 5, 7, 4, 0, 8), good, &opts, |e| {
        matches!(e, ProblemError::ZeroDim { what: "heads_kv" })
    });
    expect_error(&ProblemDesc::new(0, 5, 7, 4, 2, 8), good, &opts, |e| {
        matches!(e, ProblemError::ZeroDim { what: "batch" })
    });
    expect_error(&ProblemDesc::new(2, 5, 7, 4, 3, 8), good, &opts, |e| {
        matches!(e, ProblemError::GqaRatio { .. })
    });
    for d in [0, 257] {
        expect_error(&ProblemDesc::new(2, 5, 7, 4, 2, d), good, &opts, |e| {
            matches!(e, ProblemError::HeadDimOutOfRange { .. })
        });
    }
    expect_error(&ok.head_dim_v(300), good, &opts, |e| {
        matches!(e, ProblemError::HeadDimOutOfRange { .. })
    });
    expect_error(&ok.scale(f32::NAN), good, &opts, |e| {
        matches!(e, ProblemError::NonFiniteScale { .. })
    });
    expect_error(&ok.scale(f32::INFINITY), good, &opts, |e| {
        matches!(e, ProblemError::NonFiniteScale { .. })
    });
    for cap in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        expect_error(&ok.softcap(cap), good, &opts, |e| {
            matches!(e, ProblemError::BadSoftcap { .. })
        });
    }
    // Buffers too small, one tensor at a time.
    let cases: [(Lens, Tensor); 5] = [
        ((good.0 - 1, good.1, good.2, good.3, good.4), Tensor::Q),
        ((good.0, good.1 - 1, good.2, good.3, good.4), Tensor::K),
        ((good.0, good.1, good.2 - 1, good.3, good.4), Tensor::V),
        ((good.0, good.1, good.2, good.3 - 1, good.4), Tensor::O),
        ((good.0, good.1, good.2, good.3, Some(39)), Tensor::Lse),
    ];
    for (lens, tensor) in cases {
        expect_error(
            &ok,
            lens,
            &opts,
            |e| matches!(e, ProblemError::BufferTooSmall { tensor: t, .. } if *t == tensor),
        );
    }
    // Overlapping output strides.
    let overlapping = ok.strides(
        Tensor::O,
        Strides {
            batch: 160,
            seq: 32,
            head: 4,
        },
    );
    expect_error(&overlapping, good, &opts, |e| {
        matches!(e, ProblemError::StrideTooSmall { .. })
    });
    // Varlen prefix sums.
    let cu_a = [0u32, 3, 2];
    let cu_b = [0u32, 3, 5];
    expect_error(
        &ProblemDesc::varlen(&cu_a, &cu_b, 4, 2, 8),
        good,
        &opts,
        |e| matches!(e, ProblemError::CuSeqlensNotMonotone { .. }),
    );
    let cu_c = [1u32, 3, 5];
    expect_error(
        &ProblemDesc::varlen(&cu_c, &cu_b, 4, 2, 8),
        good,
        &opts,
        |e| matches!(e, ProblemError::CuSeqlensNotMonotone { .. }),
    );
    let cu_d = [0u32, 3];
    expect_error(
        &ProblemDesc::varlen(&cu_d, &cu_b, 4, 2, 8),
        good,
        &opts,
        |e| matches!(e, ProblemError::CuSeqlensLength { .. }),
    );
    // Options.
    let zero_threads = ForwardOptions {
        threads: Some(0),
        ..ForwardOptions::default()
    };
    expect_error(&ok, good, &zero_threads, |e| {
        matches!(e, ProblemError::ZeroDim { what: "threads" })
    });
    // Issue 16: `threads: Some(5000)` started a pool of 4999 threads and took minutes on a
    // small problem; above MAX_THREADS it is refused before any thread starts.
    for n in [fa_cpu::MAX_THREADS + 1, 5000, usize::MAX] {
        let many_threads = ForwardOptions {
            threads: Some(n),
            ..ForwardOptions::default()
        };
        expect_error(&ok, good, &many_threads, |e| {
            *e == ProblemError::TooManyThreads {
                threads: n,
                max: fa_cpu::MAX_THREADS,
            }
        });
    }
    for tau in [f32::NAN, -1.0, f32::INFINITY, 1000.0] {
        let bad_tau = ForwardOptions {
            rescale: RescalePolicy::Threshold(tau),
            ..ForwardOptions::default()
        };
        expect_error(&ok, good, &bad_tau, |e| {
            matches!(e, ProblemError::RescaleThreshold { .. })
        });
    }
    for level in [SimdLevel::Avx2Fma, SimdLevel::Avx512f] {
        if !level.is_available() {
            let unavailable = ForwardOptions {
                simd: level,
                ..ForwardOptions::default()
            };
            expect_error(&ok, good, &unavailable, |e| {
                matches!(e, ProblemError::Unsupported { .. })
            });
        }
    }
}

#[test]
fn results_are_bitwise_identical_for_any_thread_count() {
    let mut rng = Rng::new(31);
    let cases = [
        Case::dense(&mut rng, 2, 300, 333, 4, 2, 64).causal(),
        Case::varlen(&mut rng, &[17, 0, 250, 1], &[40, 3, 260, 9], 6, 2, 40),
        Case::dense(&mut rng, 1, 513, 513, 8, 1, 128),
    ];
    for case in &cases {
        let problem = case.desc().validate(256).unwrap();
        let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
        for level in levels() {
            let base = ForwardOptions {
                simd: level,
                threads: Some(1),
                ..ForwardOptions::default()
            };
            let reference = run::<f32, f32>(case, &base);
            let mut ws = Workspace::new();
            for threads in [Some(2), Some(3), Some(4), Some(1), None] {
                let opts = ForwardOptions { threads, ..base };
                let lens = problem.min_buffer_lens();
                let mut out = vec![f32::NAN; lens.o];
                let mut lse = vec![f32::NAN; problem.lse_len()];
                // The same workspace across thread counts and calls.
                let stats = forward_with_workspace(
                    &problem,
                    Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
                    Out::with_lse(&mut out[..], &mut lse[..]),
                    &opts,
                    &mut ws,
                )
                .unwrap();
                let same =
                    |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                // Padding between rows is never written: compare through the oracle's
                // comparison (exact zero difference) and the LSE bitwise.
                let a = compare(&problem, &out, Some(&lse), &oracle);
                let b = compare(&problem, &reference.out, Some(&reference.lse), &oracle);
                assert_eq!(
                    a.rel_l2.to_bits(),
                    b.rel_l2.to_bits(),
                    "{level:?} {threads:?}"
                );
                assert!(
                    same(&lse, &reference.lse),
                    "{level:?} {threads:?}: LSE differs"
                );
                for bb in 0..problem.batch() {
                    for h in 0..problem.heads_q() {
                        for i in 0..problem.seq(bb).seqlen_q {
                            let o = problem.o_offset(bb, i, h);
                            let dv = problem.head_dim_v();
                            assert!(same(&out[o..o + dv], &reference.out[o..o + dv]));
                        }
                    }
                }
                assert_eq!(stats, reference.stats, "{level:?} {threads:?}");
            }
            assert!(ws.scratch_bytes() > 0);
        }
    }
    assert!(scratch_bytes_per_thread(128, 128, SimdLevel::Auto) < 2 << 20);
}

#[test]
fn the_calling_thread_is_one_of_the_workers() {
    // `threads: Some(n)` means n threads in all, the caller included: one thread runs every
    // task on the caller, and n threads never use more than n distinct threads.
    let mut rng = Rng::new(11);
    let case = Case::dense(&mut rng, 1, 700, 700, 8, 8, 64);
    let caller = std::thread::current().id();
    for threads in [1, 2, 3] {
        let seen = std::sync::Mutex::new(std::collections::HashSet::new());
        let hook = |_: &mut [f32]| {
            seen.lock().unwrap().insert(std::thread::current().id());
        };
        let opts = ForwardOptions {
            threads: Some(threads),
            probability_hook: Some(&hook),
            ..ForwardOptions::default()
        };
        run::<f32, f32>(&case, &opts);
        let seen = seen.into_inner().unwrap();
        assert!(
            !seen.is_empty() && seen.len() <= threads,
            "{threads}: {seen:?}"
        );
        if threads == 1 {
            assert_eq!(seen.into_iter().collect::<Vec<_>>(), [caller]);
        }
    }
}

#[test]
fn probability_hook_sees_every_tile_and_its_changes_reach_the_output() {
    let mut rng = Rng::new(32);
    let case = Case::dense(&mut rng, 1, 200, 300, 4, 2, 32).causal();
    for level in levels() {
        let plain = run::<f32, f32>(
            &case,
            &ForwardOptions {
                simd: level,
                ..ForwardOptions::default()
            },
        );
        // Doubling every probability after the row sums are taken doubles the output exactly.
        let seen = std::sync::atomic::AtomicU64::new(0);
        let double = |p: &mut [f32]| {
            seen.fetch_add(p.len() as u64, std::sync::atomic::Ordering::Relaxed);
            assert!(p.iter().all(|x| x.is_finite() && *x >= 0.0));
            p.iter_mut().for_each(|x| *x *= 2.0);
        };
        let hooked = run::<f32, f32>(
            &case,
            &ForwardOptions {
                simd: level,
                probability_hook: Some(&double),
                ..ForwardOptions::default()
            },
        );
        for (a, b) in plain.out.iter().zip(&hooked.out) {
            assert_eq!((2.0 * a).to_bits(), b.to_bits());
        }
        assert_eq!(plain.lse, hooked.lse);
        // Every computed tile is handed over: at least the visible (query, key) pairs.
        let visible: u64 = (0..200u64).map(|i| i + 101).sum::<u64>() * 4;
        assert!(seen.load(std::sync::atomic::Ordering::Relaxed) >= visible);
    }
}

#[test]
fn causal_tiles_are_skipped_and_rescales_counted() {
    let mut rng = Rng::new(33);
    // Head dim 96: both masks get the same key tiles (unmasked head dims up to 64 get larger
    // ones), so the tile counts add up to the same total.
    let case = Case::dense(&mut rng, 1, 1000, 1000, 1, 1, 96).causal();
    let full = Case {
        mask: softmax_core::Mask::NONE,
        ..case.clone()
    };
    let opts = ForwardOptions::default();
    let c = run::<f32, f32>(&case, &opts).stats;
    let f = run::<f32, f32>(&full, &opts).stats;
    assert_eq!(f.tiles_skipped, 0);
    assert!(c.tiles_skipped > 0 && c.tiles_computed < f.tiles_computed);
    assert_eq!(
        c.tiles_computed + c.tiles_skipped,
        f.tiles_computed + f.tiles_skipped
    );
    assert!(f.rescale.blocks > 0);
    let always = run::<f32, f32>(
        &full,
        &ForwardOptions {
            rescale: RescalePolicy::Always,
            ..opts
        },
    )
    .stats;
    assert_eq!(always.rescale.skipped, 0);
    assert!(always.rescale.rescales >= f.rescale.rescales);
}

#[test]
fn nan_and_inf_inputs_propagate_like_the_reference() {
    let mut rng = Rng::new(34);
    let mut case = Case::dense(&mut rng, 1, 40, 50, 2, 1, 16);
    case.q[3] = f32::NAN; // query 0 of head 0
    case.v[16 * 7 + 2] = f32::INFINITY; // key 7, channel 2
    let problem = case.desc().validate(256).unwrap();
    let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
    for level in levels() {
        let r = run::<f32, f32>(
            &case,
            &ForwardOptions {
                simd: level,
                ..ForwardOptions::default()
            },
        );
        for (i, (&x, &want)) in r.out.iter().zip(&oracle.out).enumerate() {
            assert_eq!(x.is_nan(), want.is_nan(), "element {i}: {x} vs {want}");
            if want.is_infinite() {
                assert_eq!(x as f64, want, "element {i}");
            }
        }
    }
}

/// `scratch_bytes_per_thread` is an upper bound of what one worker really allocates: a fresh
/// workspace, one thread, problems long enough to fill the largest row block, every head-dim
/// fast path and odd ones, with and without a mask and the probability hook.
#[test]
fn scratch_companion_bounds_what_a_worker_allocates() {
    let mut rng = Rng::new(41);
    let hook = |_: &mut [f32]| {};
    for level in levels() {
        for (d, dv) in [
            (64, 64),
            (128, 128),
            (256, 256),
            (40, 72),
            (200, 136),
            (1, 3),
        ] {
            for causal in [false, true] {
                for with_hook in [false, true] {
                    let mut desc = ProblemDesc::new(1, 2100, 300, 2, 1, d).head_dim_v(dv);
                    if causal {
                        desc = desc.causal();
                    }
                    let problem = desc.validate(256).expect("valid");
                    let lens = problem.min_buffer_lens();
                    let mut draw =
                        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normal() as f32).collect() };
                    let (q, k, v) = (draw(lens.q), draw(lens.k), draw(lens.v));
                    let mut out = vec![0.0f32; lens.o];
                    let opts = ForwardOptions {
                        threads: Some(1),
                        simd: level,
                        probability_hook: if with_hook { Some(&hook) } else { None },
                        ..ForwardOptions::default()
                    };
                    let mut ws = Workspace::new();
                    let qkv = Qkv::new(&q[..], &k[..], &v[..]);
                    forward_with_workspace(&problem, qkv, Out::new(&mut out[..]), &opts, &mut ws)
                        .expect("forward");
                    let bound = scratch_bytes_per_thread(d, dv, level);
                    assert!(
                        ws.scratch_bytes() <= bound,
                        "{level:?} d={d} dv={dv} causal={causal} hook={with_hook}: {} > {bound}",
                        ws.scratch_bytes()
                    );
                    assert!(ws.scratch_bytes() > 0);
                }
            }
        }
    }
}

/// No library behaviour is read from the environment (issue 49): no source file of the
/// library calls `std::env::var`/`var_os`/`vars` (the options carry every choice; see
/// `tests/decode.rs`'s `environment_variables_change_nothing` for the run-time check). The
/// scan covers `src/` recursively, except the white-box test modules (`*_tests.rs`, compiled
/// only under the `internal-tests` feature), and fails if it finds too few sources.
#[test]
fn the_library_reads_no_environment_variable() {
    fn scan(dir: &std::path::Path, files: &mut usize, hits: &mut Vec<String>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{dir:?}: {e}"));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                scan(&path, files, hits);
            } else if path.extension().is_some_and(|e| e == "rs")
                && !path.to_string_lossy().ends_with("_tests.rs")
            {
                *files += 1;
                let text = std::fs::read_to_string(&path).expect("a source file");
                for (i, line) in text.lines().enumerate() {
                    let code = line.split("//").next().unwrap_or("");
                    if ["env::var", "env::vars", "var_os("]
                        .iter()
                        .any(|p| code.contains(p))
                    {
                        hits.push(format!("{}:{}: {}", path.display(), i + 1, line.trim()));
                    }
                }
            }
        }
    }
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (mut files, mut hits) = (0, Vec::new());
    scan(&src, &mut files, &mut hits);
    assert!(files > 20, "only {files} source files under {src:?}");
    assert!(hits.is_empty(), "environment reads:\n{}", hits.join("\n"));
}
