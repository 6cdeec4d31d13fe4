//! Per-tensor and per-block quantisation of Q, K, V: scales recomputed independently from
//! the definition, the scale layout, round-trip error bounds, strided and packed problems,
//! special values and bad input.

use fa_fp8::scale::{
    amax, quantize, scale_from_amax, Granularity, Operand, ScaleLayout, ScaleOptions,
};
use fa_fp8::{Fp8Error, Fp8Format};
use fa_reference::{poison, Case, Rng, Rounding};

fn opts(granularity: Granularity, power_of_two: bool) -> ScaleOptions {
    ScaleOptions {
        format: Fp8Format::E4m3,
        granularity,
        power_of_two,
    }
}

/// The elements of one operand as (b, h, token, offset) rows, walked from the problem
/// description independently of the library's geometry helper.
fn rows(case: &Case, operand: Operand) -> Vec<(usize, usize, usize, usize)> {
    let desc = case.desc();
    let p = desc.validate(256).unwrap();
    let mut out = Vec::new();
    for b in 0..p.batch() {
        let s = p.seq(b);
        let (heads, len) = match operand {
            Operand::Q => (p.heads_q(), s.seqlen_q),
            _ => (p.heads_kv(), s.seqlen_k),
        };
        for h in 0..heads {
            for t in 0..len {
                let off = match operand {
                    Operand::Q => p.q_offset(b, t, h),
                    Operand::K => p.k_offset(b, t, h),
                    Operand::V => p.v_offset(b, t, h),
                };
                out.push((b, h, t, off));
            }
        }
    }
    out
}

fn check_case(case: &Case, granularity: Granularity, power_of_two: bool) {
    let desc = case.desc();
    let problem = desc.validate(256).unwrap();
    for (operand, data, dim) in [
        (Operand::Q, &case.q, case.head_dim),
        (Operand::K, &case.k, case.head_dim),
        (Operand::V, &case.v, case.head_dim_v),
    ] {
        let o = opts(granularity, power_of_two);
        let qt = quantize(&problem, operand, data, &o).unwrap();
        let rows = rows(case, operand);
        // Independent per-group amax.
        let group = |b: usize, h: usize, t: usize| -> (usize, usize, usize) {
            match granularity {
                Granularity::PerTensor => (0, 0, 0),
                Granularity::PerBlock { rows } => (b, h, t / rows),
            }
        };
        let mut groups = std::collections::HashMap::new();
        for &(b, h, t, off) in &rows {
            let a = data[off..off + dim]
                .iter()
                .fold(0.0f32, |m, x| m.max(x.abs()));
            let e = groups.entry(group(b, h, t)).or_insert(0.0f32);
            *e = e.max(a);
        }
        match (granularity, qt.layout) {
            (Granularity::PerTensor, ScaleLayout::PerTensor) => assert_eq!(qt.scales.len(), 1),
            (
                Granularity::PerBlock { rows: r },
                ScaleLayout::PerBlock {
                    batch,
                    heads,
                    blocks,
                    rows,
                },
            ) => {
                assert_eq!(rows, r);
                assert_eq!(batch, problem.batch());
                let max_seq = match operand {
                    Operand::Q => problem.max_seqlen_q(),
                    _ => problem.max_seqlen_k(),
                };
                assert_eq!(blocks, max_seq.div_ceil(r));
                assert_eq!(qt.scales.len(), batch * heads * blocks);
            }
            other => panic!("layout {other:?}"),
        }
        let mut deq = vec![0.0f32; data.len()];
        poison(&mut deq);
        qt.dequantize_into(&problem, &mut deq).unwrap();
        let mut touched = vec![false; data.len()];
        for &(b, h, t, off) in &rows {
            let a = groups[&group(b, h, t)];
            let s = qt.scale(b, h, t);
            // Scale from its definition.
            let exact = a / 448.0;
            if power_of_two {
                assert!(s >= exact && s < 2.0 * exact, "pow2 scale {s} for amax {a}");
                assert_eq!(s.to_bits() & 0x007f_ffff, 0);
            } else {
                assert_eq!(s, exact);
            }
            assert_eq!(
                qt.scales[qt.layout.index(b, h, t)],
                s,
                "layout index of ({b},{h},{t})"
            );
            for c in 0..dim {
                let x = data[off + c];
                let y = deq[off + c];
                touched[off + c] = true;
                // Normal range: relative error ≤ 2^-4; subnormal: absolute ≤ scale·2^-10.
                let bound = x.abs() / 16.0 + s / 1024.0;
                assert!((x - y).abs() <= bound * 1.0001, "{x} -> {y} (scale {s})");
                assert_eq!(y, Fp8Format::E4m3.decode(qt.codes[off + c]) * s);
            }
        }
        // Padding between rows is not part of the tensor: never written.
        for (i, &t) in touched.iter().enumerate() {
            if !t {
                assert!(
                    deq[i].is_nan(),
                    "element {i} outside the tensor was written"
                );
                assert_eq!(qt.codes[i], 0);
            }
        }
    }
}

#[test]
fn dense_strided_and_packed_problems() {
    let mut rng = Rng::fresh();
    let cases = [
        Case::dense(&mut rng, 2, 37, 53, 4, 2, 32),
        Case::dense(&mut rng, 1, 5, 300, 1, 1, 128).padded(&mut rng, 3, Rounding::F32),
        Case::varlen(&mut rng, &[3, 70, 0, 19], &[65, 1, 9, 130], 2, 1, 64),
    ];
    for case in &cases {
        for granularity in [
            Granularity::PerTensor,
            Granularity::PerBlock { rows: 16 },
            Granularity::PerBlock { rows: 128 },
            Granularity::PerBlock { rows: 1 },
        ] {
            for power_of_two in [false, true] {
                check_case(case, granularity, power_of_two);
            }
        }
    }
}

#[test]
fn per_block_scales_follow_local_ranges() {
    // A block with a large outlier gets a large scale; its neighbours keep small ones.
    let mut rng = Rng::new(3);
    let mut case = Case::dense(&mut rng, 1, 256, 256, 1, 1, 64);
    case.q[130 * 64 + 5] = 300.0;
    let p = case.desc();
    let problem = p.validate(256).unwrap();
    let qt = quantize(
        &problem,
        Operand::Q,
        &case.q,
        &opts(Granularity::PerBlock { rows: 64 }, false),
    )
    .unwrap();
    assert_eq!(qt.scales.len(), 4);
    assert_eq!(qt.scales[2], 300.0 / 448.0);
    for i in [0, 1, 3] {
        assert!(qt.scales[i] < 10.0 / 448.0, "block {i}: {}", qt.scales[i]);
    }
}

#[test]
fn special_values_and_zero_groups() {
    assert_eq!(scale_from_amax(0.0, Fp8Format::E4m3, false), 1.0);
    assert_eq!(scale_from_amax(448.0, Fp8Format::E4m3, true), 1.0);
    assert_eq!(scale_from_amax(449.0, Fp8Format::E4m3, true), 2.0);
    assert_eq!(scale_from_amax(57344.0, Fp8Format::E5m2, false), 1.0);
    assert!(scale_from_amax(1e-40, Fp8Format::E4m3, false) >= f32::MIN_POSITIVE);
    assert_eq!(amax(&[1.0, f32::NAN, -3.0, f32::INFINITY]), 3.0);

    let mut rng = Rng::new(5);
    let mut case = Case::dense(&mut rng, 1, 8, 8, 1, 1, 16);
    case.v.iter_mut().for_each(|x| *x = 0.0);
    case.v[3] = f32::NAN;
    case.v[4] = f32::NEG_INFINITY;
    case.v[5] = 2.0;
    let p = case.desc();
    let problem = p.validate(256).unwrap();
    let qt = quantize(
        &problem,
        Operand::V,
        &case.v,
        &opts(Granularity::PerTensor, false),
    )
    .unwrap();
    let mut deq = vec![0.0f32; case.v.len()];
    qt.dequantize_into(&problem, &mut deq).unwrap();
    assert!(deq[3].is_nan());
    assert_eq!(deq[4], -2.0, "−∞ saturates to −max·scale");
    assert_eq!(deq[5], 2.0);
    assert_eq!(deq[6], 0.0);
}

#[test]
fn bad_input_is_a_typed_error() {
    let mut rng = Rng::new(9);
    let case = Case::dense(&mut rng, 1, 8, 8, 1, 1, 16);
    let p = case.desc();
    let problem = p.validate(256).unwrap();
    let short = &case.q[..case.q.len() - 1];
    assert!(matches!(
        quantize(
            &problem,
            Operand::Q,
            short,
            &opts(Granularity::PerTensor, false)
        ),
        Err(Fp8Error::Problem(_))
    ));
    assert_eq!(
        quantize(
            &problem,
            Operand::K,
            &case.k,
            &opts(Granularity::PerBlock { rows: 0 }, false)
        ),
        Err(Fp8Error::ZeroBlock)
    );
    let qt = quantize(
        &problem,
        Operand::Q,
        &case.q,
        &opts(Granularity::PerTensor, false),
    )
    .unwrap();
    let mut out = vec![7.0f32; 10];
    assert!(qt.dequantize_into(&problem, &mut out).is_err());
    assert!(out.iter().all(|&x| x == 7.0));
}

#[test]
fn transposed_codes_are_token_contiguous() {
    let mut rng = Rng::new(12);
    let case = Case::varlen(&mut rng, &[3, 10], &[7, 20], 2, 2, 8);
    let p = case.desc();
    let problem = p.validate(256).unwrap();
    let qt = quantize(
        &problem,
        Operand::V,
        &case.v,
        &opts(Granularity::PerBlock { rows: 4 }, false),
    )
    .unwrap();
    let t = qt.transposed(&problem, 16).unwrap();
    let padded = 32; // max seqlen_k 20 padded to 16s
    assert_eq!(t.len(), 2 * 2 * 8 * padded);
    for b in 0..2 {
        let s = problem.seq(b);
        for h in 0..2 {
            for c in 0..8 {
                for j in 0..padded {
                    let got = t[((b * 2 + h) * 8 + c) * padded + j];
                    let want = if j < s.seqlen_k {
                        qt.codes[problem.v_offset(b, j, h) + c]
                    } else {
                        0
                    };
                    assert_eq!(got, want, "b{b} h{h} c{c} j{j}");
                }
            }
        }
    }
    assert_eq!(qt.transposed(&problem, 0), Err(Fp8Error::ZeroBlock));
}
