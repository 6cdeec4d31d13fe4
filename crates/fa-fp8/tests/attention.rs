//! FP8 attention against the f64 reference: the pipeline composed by hand from the public
//! pieces (rotation, quantisation, dequantisation, P rounding) must match fa-fp8's forward,
//! FP8 error on N(0,1) data stays within a stated bound, and bad input is rejected untouched.

use fa_fp8::attention::{check_p_range, forward_fp8, prepare, Fp8Options, Fp8Scaling};
use fa_fp8::scale::Operand;
use fa_fp8::{Fp8Error, Fp8Format};
use fa_reference::{attention_f64, compare, poison, Case, Rng};
use softmax_core::{Mask, Out, Qkv, RescalePolicy};

fn variants() -> Vec<Fp8Options> {
    let mut out = Vec::new();
    for scaling in [
        Fp8Scaling::PerTensor,
        Fp8Scaling::PerBlock {
            block_q: 16,
            block_k: 32,
        },
    ] {
        for hadamard_seed in [None, Some(77)] {
            for power_of_two_scales in [false, true] {
                out.push(Fp8Options {
                    scaling,
                    hadamard_seed,
                    power_of_two_scales,
                    quantize_p: false,
                    ..Fp8Options::default()
                });
            }
        }
    }
    out
}

/// The dequantised operands, rebuilt from the public `prepare` output (codes × scales),
/// independently of the forward's own dequantisation.
fn dequantised(case: &Case, opts: &Fp8Options) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let desc = case.desc();
    let problem = desc.validate(256).unwrap();
    let ops = prepare(&desc, Qkv::new(&case.q[..], &case.k[..], &case.v[..]), opts).unwrap();
    let rebuild = |t: &fa_fp8::scale::Quantized, data_len: usize| -> Vec<f32> {
        let mut out = vec![0.0f32; data_len];
        for b in 0..problem.batch() {
            let s = problem.seq(b);
            let (heads, len, dim) = match t.operand {
                Operand::Q => (problem.heads_q(), s.seqlen_q, problem.head_dim()),
                Operand::K => (problem.heads_kv(), s.seqlen_k, problem.head_dim()),
                Operand::V => (problem.heads_kv(), s.seqlen_k, problem.head_dim_v()),
            };
            for h in 0..heads {
                for i in 0..len {
                    let off = match t.operand {
                        Operand::Q => problem.q_offset(b, i, h),
                        Operand::K => problem.k_offset(b, i, h),
                        Operand::V => problem.v_offset(b, i, h),
                    };
                    for c in 0..dim {
                        out[off + c] = t.format.decode(t.codes[off + c]) * t.scale(b, h, i);
                    }
                }
            }
        }
        out
    };
    (
        rebuild(&ops.q, case.q.len()),
        rebuild(&ops.k, case.k.len()),
        rebuild(&ops.v, case.v.len()),
    )
}

fn cases(rng: &mut Rng) -> Vec<Case> {
    vec![
        Case::dense(rng, 2, 33, 70, 4, 2, 64),
        Case::dense(rng, 1, 17, 45, 2, 2, 128).causal(),
        Case::varlen(rng, &[5, 40, 1], &[60, 40, 3], 2, 1, 32).with_mask(Mask {
            left: Some(9),
            right: Some(4),
        }),
        Case::dense(rng, 1, 8, 130, 1, 1, 16).with_softcap(20.0),
    ]
}

#[test]
fn without_p_rounding_the_output_is_exact_attention_of_the_dequantised_operands() {
    let mut rng = Rng::fresh();
    for case in cases(&mut rng) {
        for opts in variants() {
            let (q, k, v) = dequantised(&case, &opts);
            let desc = case.desc();
            let problem = desc.validate(256).unwrap();
            let oracle = attention_f64(&problem, &q, &k, &v);
            let mut out = vec![0.0f32; problem.min_buffer_lens().o];
            let mut lse = vec![0.0f32; problem.lse_len()];
            poison(&mut out);
            poison(&mut lse);
            forward_fp8(
                &desc,
                Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
                Out {
                    o: &mut out,
                    lse: Some(&mut lse),
                },
                &opts,
            )
            .unwrap();
            let report = compare(&problem, &out, Some(&lse), &oracle);
            // The f32 contract of fa-cpu (1e-5) on the operands the FP8 kernel sees.
            assert!(report.within(1e-5, 1e-4), "{opts:?}: {report:?}");
        }
    }
}

#[test]
fn p_rounding_error_is_bounded_and_present() {
    let mut rng = Rng::fresh();
    for case in cases(&mut rng) {
        let opts = Fp8Options {
            scaling: Fp8Scaling::PerBlock {
                block_q: 16,
                block_k: 16,
            },
            ..Fp8Options::default()
        };
        let (q, k, v) = dequantised(&case, &opts);
        let desc = case.desc();
        let problem = desc.validate(256).unwrap();
        let oracle = attention_f64(&problem, &q, &k, &v);
        let mut out = vec![0.0f32; problem.min_buffer_lens().o];
        poison(&mut out);
        forward_fp8(
            &desc,
            Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
            Out::new(&mut out),
            &opts,
        )
        .unwrap();
        let report = compare(&problem, &out, None, &oracle);
        // Each P entry moves by at most 2^-4 relative (e4m3 normal range with the 2^8
        // offset; entries below 2^-14 by at most 2^-18 absolute), the row sum is exact
        // (unquantised): |ΔO| ≤ 2^-4·Σp|v|/ℓ + 2^-18·Σ|v|/ℓ ≤ (2^-4 + n·2^-18)·max|v|.
        for b in 0..problem.batch() {
            let s = problem.seq(b);
            for h in 0..problem.heads_q() {
                for i in 0..s.seqlen_q {
                    let o = problem.o_offset(b, i, h);
                    let vmax = case.v.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64 * 1.07;
                    let bound = (1.0 / 16.0 + s.seqlen_k as f64 / 262144.0) * vmax + 1e-5;
                    for c in 0..problem.head_dim_v() {
                        let d = (out[o + c] as f64 - oracle.out[o + c]).abs();
                        assert!(d <= bound, "row {i}: {d} > {bound}");
                    }
                }
            }
        }
        assert!(report.rel_l2 > 1e-6, "P rounding did nothing: {report:?}");
        assert!(report.rel_l2 < 0.05, "{report:?}");
    }
}

#[test]
fn fp8_error_on_normal_data_against_the_true_reference() {
    let mut rng = Rng::fresh();
    let case = Case::dense(&mut rng, 1, 256, 512, 2, 2, 128);
    let desc = case.desc();
    let problem = desc.validate(256).unwrap();
    let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
    let mut errors = Vec::new();
    for scaling in [
        Fp8Scaling::PerTensor,
        Fp8Scaling::PerBlock {
            block_q: 64,
            block_k: 64,
        },
    ] {
        for hadamard_seed in [None, Some(1)] {
            let opts = Fp8Options {
                scaling,
                hadamard_seed,
                ..Fp8Options::default()
            };
            let mut out = vec![0.0f32; problem.min_buffer_lens().o];
            poison(&mut out);
            forward_fp8(
                &desc,
                Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
                Out::new(&mut out),
                &opts,
            )
            .unwrap();
            let r = compare(&problem, &out, None, &oracle);
            // Measured ≈ 3e-2 normwise (e4m3 keeps 3 mantissa bits: 2^-4 relative rounding).
            assert!(
                r.rel_l2 < 0.08 && r.rel_l2 > 1e-3,
                "{scaling:?} {hadamard_seed:?}: {r:?}"
            );
            errors.push(r.rel_l2);
        }
    }
    eprintln!("FP8 rel L2 on N(0,1), 256x512x128: {errors:?}");
}

#[test]
fn bad_input_leaves_outputs_untouched() {
    let mut rng = Rng::new(4);
    let case = Case::dense(&mut rng, 1, 8, 8, 1, 1, 96);
    let desc = case.desc();
    let mut out = vec![7.0f32; 8 * 96];
    // 96 is not a power of two: no Hadamard.
    let err = forward_fp8(
        &desc,
        Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
        Out::new(&mut out),
        &Fp8Options::default(),
    );
    assert_eq!(err, Err(Fp8Error::HadamardDim { dim: 96 }));
    // Short output buffer.
    let opts = Fp8Options {
        hadamard_seed: None,
        ..Fp8Options::default()
    };
    let mut short = vec![7.0f32; 8 * 96 - 1];
    assert!(matches!(
        forward_fp8(
            &desc,
            Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
            Out::new(&mut short),
            &opts
        ),
        Err(Fp8Error::Problem(_))
    ));
    // A threshold that lets P·256 overflow e4m3.
    let loose = Fp8Options {
        rescale: RescalePolicy::Threshold(8.0),
        ..opts
    };
    assert!(matches!(
        forward_fp8(
            &desc,
            Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
            Out::new(&mut out),
            &loose
        ),
        Err(Fp8Error::PRange { .. })
    ));
    let zero_block = Fp8Options {
        scaling: Fp8Scaling::PerBlock {
            block_q: 0,
            block_k: 4,
        },
        ..opts
    };
    assert_eq!(
        forward_fp8(
            &desc,
            Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
            Out::new(&mut out),
            &zero_block
        ),
        Err(Fp8Error::ZeroBlock)
    );
    assert!(out.iter().all(|&x| x == 7.0));
    assert!(short.iter().all(|&x| x == 7.0));
}

#[test]
fn p_range_rule() {
    assert!(check_p_range(&RescalePolicy::Always, 8.0).is_ok());
    assert!(check_p_range(&RescalePolicy::Threshold(0.5), 8.0).is_ok());
    assert!(check_p_range(&RescalePolicy::Threshold(0.9), 8.0).is_err());
    assert!(check_p_range(&RescalePolicy::Always, 9.0).is_err());
    assert!(check_p_range(&RescalePolicy::Threshold(f32::NAN), 8.0).is_err());
    assert!((Fp8Format::E4m3.log2_max() - 8.807).abs() < 1e-3);
}

#[test]
fn a_small_threshold_gives_the_same_answer_as_always() {
    let mut rng = Rng::fresh();
    let case = Case::dense(&mut rng, 1, 40, 300, 1, 1, 64);
    let desc = case.desc();
    let mut a = vec![0.0f32; 40 * 64];
    let mut b = a.clone();
    let opts = Fp8Options::default();
    forward_fp8(
        &desc,
        Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
        Out::new(&mut a),
        &opts,
    )
    .unwrap();
    let t = Fp8Options {
        rescale: RescalePolicy::Threshold(0.5),
        ..opts
    };
    forward_fp8(
        &desc,
        Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
        Out::new(&mut b),
        &t,
    )
    .unwrap();
    // Different reference maxima round P differently: same answer within FP8 noise.
    let num: f32 = a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f32 = a.iter().map(|x| x * x).sum();
    assert!((num / den).sqrt() < 0.05);
}
