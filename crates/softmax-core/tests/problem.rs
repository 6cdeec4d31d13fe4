//! Validation of the problem description: every kind of bad input gets its typed error, and
//! valid descriptions resolve offsets consistently.

use softmax_core::{
    BufferLens, Mask, Out, ProblemDesc, ProblemError, Qkv, Sequences, Strides, Tensor, MAX_HEAD_DIM,
};

fn ok_desc() -> ProblemDesc<'static> {
    ProblemDesc::new(2, 5, 7, 4, 2, 16)
}

#[test]
fn valid_problem_resolves_defaults() {
    let p = ok_desc().validate(MAX_HEAD_DIM).unwrap();
    assert_eq!(p.softmax_scale(), 0.25);
    assert_eq!(p.group_size(), 2);
    assert_eq!(p.kv_head(3), 1);
    let lens = p.min_buffer_lens();
    assert_eq!(lens.q, 2 * 5 * 4 * 16);
    assert_eq!(lens.k, 2 * 7 * 2 * 16);
    assert_eq!(lens.lse, Some(2 * 4 * 5));
    assert_eq!(p.q_offset(1, 2, 3), 5 * 64 + 2 * 64 + 3 * 16);
    assert_eq!(p.lse_offset(1, 3, 2), (4 + 3) * 5 + 2);
    assert!(p.check_buffers(lens).is_ok());
}

#[test]
fn every_bad_input_has_its_error() {
    let cases: Vec<(ProblemDesc, ProblemError)> = vec![
        (
            ProblemDesc::new(0, 5, 7, 4, 2, 16),
            ProblemError::ZeroDim { what: "batch" },
        ),
        (
            ProblemDesc::new(1, 5, 7, 0, 2, 16),
            ProblemError::ZeroDim { what: "heads_q" },
        ),
        (
            ProblemDesc::new(1, 5, 7, 4, 0, 16),
            ProblemError::ZeroDim { what: "heads_kv" },
        ),
        (
            ProblemDesc::new(1, 5, 7, 6, 4, 16),
            ProblemError::GqaRatio {
                heads_q: 6,
                heads_kv: 4,
            },
        ),
        (
            ProblemDesc::new(1, 5, 7, 4, 2, 0),
            ProblemError::HeadDimOutOfRange {
                what: "head_dim",
                head_dim: 0,
                max: 256,
            },
        ),
        (
            ProblemDesc::new(1, 5, 7, 4, 2, 257),
            ProblemError::HeadDimOutOfRange {
                what: "head_dim",
                head_dim: 257,
                max: 256,
            },
        ),
        (
            ok_desc().head_dim_v(300),
            ProblemError::HeadDimOutOfRange {
                what: "head_dim_v",
                head_dim: 300,
                max: 256,
            },
        ),
        (
            ok_desc().scale(f32::NAN),
            ProblemError::NonFiniteScale { scale: f32::NAN },
        ),
        (
            ok_desc().scale(f32::INFINITY),
            ProblemError::NonFiniteScale {
                scale: f32::INFINITY,
            },
        ),
        (
            ok_desc().softcap(0.0),
            ProblemError::BadSoftcap { softcap: 0.0 },
        ),
        (
            ok_desc().softcap(-3.0),
            ProblemError::BadSoftcap { softcap: -3.0 },
        ),
        (
            ok_desc().scale(1e38),
            ProblemError::ScaleOutOfRange {
                scale: 1e38,
                max: softmax_core::MAX_SOFTMAX_SCALE,
            },
        ),
        (
            ok_desc().scale(1.0).softcap(1e-39),
            ProblemError::SoftcapOutOfRange {
                softcap: 1e-39,
                min: 1.0 / softmax_core::MAX_SCALE_OVER_SOFTCAP,
                max: softmax_core::MAX_SOFTCAP,
            },
        ),
        (
            ok_desc().scale(1.0).softcap(1e30),
            ProblemError::SoftcapOutOfRange {
                softcap: 1e30,
                min: 1.0 / softmax_core::MAX_SCALE_OVER_SOFTCAP,
                max: softmax_core::MAX_SOFTCAP,
            },
        ),
        (
            ok_desc().strides(
                Tensor::O,
                Strides {
                    batch: 5 * 64,
                    seq: 64,
                    head: 8,
                },
            ),
            ProblemError::StrideTooSmall {
                tensor: Tensor::O,
                what: "head stride",
                stride: 8,
                min: 16,
            },
        ),
    ];
    for (desc, want) in cases {
        let got = desc.validate(MAX_HEAD_DIM).unwrap_err();
        // NaN ≠ NaN: compare the Debug text, which is what a user reads anyway.
        assert_eq!(format!("{got:?}"), format!("{want:?}"));
        assert!(!got.to_string().is_empty());
    }
    // A backend with a smaller limit reports its own maximum.
    assert_eq!(
        ok_desc().validate(8).unwrap_err(),
        ProblemError::HeadDimOutOfRange {
            what: "head_dim",
            head_dim: 16,
            max: 8
        }
    );
}

#[test]
fn varlen_errors() {
    let q = [0u32, 3, 5];
    let k_short = [0u32, 4];
    let k_bad_start = [1u32, 4, 6];
    let k_decreasing = [0u32, 4, 2];
    let cases: Vec<(&[u32], &[u32], ProblemError)> = vec![
        (
            &q,
            &k_short,
            ProblemError::CuSeqlensLength { len_q: 3, len_k: 2 },
        ),
        (
            &q[..1],
            &k_short[..1],
            ProblemError::CuSeqlensLength { len_q: 1, len_k: 1 },
        ),
        (
            &q,
            &k_bad_start,
            ProblemError::CuSeqlensNotMonotone {
                tensor: Tensor::K,
                index: 0,
            },
        ),
        (
            &q,
            &k_decreasing,
            ProblemError::CuSeqlensNotMonotone {
                tensor: Tensor::K,
                index: 2,
            },
        ),
    ];
    for (cu_q, cu_k, want) in cases {
        let desc = ProblemDesc::varlen(cu_q, cu_k, 2, 1, 8);
        assert_eq!(desc.validate(MAX_HEAD_DIM).unwrap_err(), want);
    }
    // A valid pack, with an empty sequence and a length-1 one.
    let cu_q = [0u32, 3, 3, 4];
    let cu_k = [0u32, 5, 7, 8];
    let p = ProblemDesc::varlen(&cu_q, &cu_k, 2, 1, 8)
        .validate(MAX_HEAD_DIM)
        .unwrap();
    assert_eq!(p.batch(), 3);
    assert_eq!((p.max_seqlen_q(), p.max_seqlen_k()), (3, 5));
    let s = p.seq(2);
    assert_eq!((s.q_start, s.seqlen_q, s.k_start, s.seqlen_k), (3, 1, 7, 1));
    assert_eq!(p.q_offset(2, 0, 1), 3 * 16 + 8);
    assert_eq!(p.lse_offset(2, 1, 0), 4 + 3);
    assert_eq!(p.lse_len(), 8);
}

#[test]
fn buffer_lengths_are_checked() {
    let p = ok_desc().validate(MAX_HEAD_DIM).unwrap();
    let good = p.min_buffer_lens();
    let short = |tensor| {
        let mut lens = good;
        match tensor {
            Tensor::Q => lens.q -= 1,
            Tensor::K => lens.k -= 1,
            Tensor::V => lens.v -= 1,
            Tensor::O => lens.o -= 1,
            Tensor::Lse => lens.lse = Some(good.lse.unwrap() - 1),
            other => unreachable!("{other} has no buffer length"),
        }
        lens
    };
    for tensor in [Tensor::Q, Tensor::K, Tensor::V, Tensor::O, Tensor::Lse] {
        match p.check_buffers(short(tensor)) {
            Err(ProblemError::BufferTooSmall { tensor: t, .. }) => assert_eq!(t, tensor),
            other => panic!("{tensor}: {other:?}"),
        }
    }
    let no_lse = BufferLens { lse: None, ..good };
    assert!(p.check_buffers(no_lse).is_ok());
    // The same lengths read off slices.
    let (q, k, v) = (vec![0u8; good.q], vec![0u8; good.k], vec![0u8; good.v]);
    let (o, lse) = (vec![0.0f32; good.o], vec![0.0f32; good.lse.unwrap()]);
    let qkv = Qkv::new(&q[..], &k[..], &v[..]);
    assert_eq!(BufferLens::of(&qkv, &Out::with_lse(&o[..], &lse[..])), good);
    assert_eq!(BufferLens::of(&qkv, &Out::<_, &[f32]>::new(&o[..])), no_lse);
}

#[test]
fn strided_views_and_overflow() {
    // Q as a view with padding between heads and tokens: valid, larger extent.
    let strides = Strides {
        batch: 1000,
        seq: 100,
        head: 20,
    };
    let p = ok_desc()
        .strides(Tensor::Q, strides)
        .validate(MAX_HEAD_DIM)
        .unwrap();
    assert_eq!(p.min_buffer_lens().q, 1000 + 4 * 100 + 3 * 20 + 16);
    assert_eq!(p.q_offset(1, 2, 3), 1000 + 200 + 60);
    // Inputs may broadcast (stride 0 over heads reads one head for all): allowed.
    let broadcast = Strides {
        batch: 112,
        seq: 16,
        head: 0,
    };
    assert!(ok_desc()
        .strides(Tensor::K, broadcast)
        .validate(MAX_HEAD_DIM)
        .is_ok());
    // Absurd strides overflow instead of wrapping.
    let huge = Strides {
        batch: usize::MAX - 10,
        seq: 1,
        head: 1,
    };
    assert_eq!(
        ok_desc()
            .strides(Tensor::V, huge)
            .validate(MAX_HEAD_DIM)
            .unwrap_err(),
        ProblemError::Overflow
    );
}

#[test]
fn builder_composes_causal_and_window() {
    let d = ok_desc().window(Some(3), None).causal();
    assert_eq!(
        d.mask,
        Mask {
            left: Some(3),
            right: Some(0)
        }
    );
    let d = ok_desc().causal().window(Some(3), Some(9));
    assert_eq!(
        d.mask,
        Mask {
            left: Some(3),
            right: Some(0)
        }
    );
    assert!(matches!(d.sequences, Sequences::Fixed { batch: 2, .. }));
}

#[test]
fn padded_cache_uses_each_sequences_length() {
    let used = [5u32, 0, 9];
    let desc = ProblemDesc::new(3, 2, 9, 4, 2, 16)
        .padded_cache(&used)
        .causal();
    let p = desc.validate(256).expect("valid");
    assert!(p.has_kv_cache());
    assert_eq!(p.max_seqlen_k(), 9);
    assert_eq!(p.seq(0).seqlen_k, 5);
    assert_eq!(p.seq(1).seqlen_k, 0);
    // Rows of the padded cache: sequence b starts at b · capacity · heads_kv · head_dim.
    assert_eq!(p.k_offset(2, 3, 1), 2 * 9 * 2 * 16 + 3 * 2 * 16 + 16);
    assert_eq!(p.min_buffer_lens().k, 3 * 9 * 2 * 16);

    let over = [5u32, 10, 0];
    assert!(matches!(
        ProblemDesc::new(3, 2, 9, 4, 2, 16)
            .padded_cache(&over)
            .validate(256),
        Err(ProblemError::CacheOverrun {
            batch: 1,
            used: 10,
            capacity: 9
        })
    ));
    assert!(matches!(
        ProblemDesc::new(3, 2, 9, 4, 2, 16)
            .padded_cache(&used[..2])
            .validate(256),
        Err(ProblemError::CacheTableLength {
            tensor: Tensor::SequsedK,
            needed: 3,
            len: 2
        })
    ));
    let cu = [0u32, 2];
    assert!(matches!(
        ProblemDesc::varlen(&cu, &cu, 2, 2, 16)
            .padded_cache(&used[..1])
            .validate(256),
        Err(ProblemError::Unsupported { .. })
    ));
}

#[test]
fn paged_cache_reads_through_the_block_table() {
    // Two sequences, 3 blocks of 4 keys each per sequence at most, 7 blocks in the cache.
    let used = [6u32, 9];
    let table = [4i32, 0, -1, 6, 2, 5];
    let desc = ProblemDesc::new(2, 1, 0, 8, 2, 32).paged_cache(&used, &table, 3, 4, 7);
    let p = desc.validate(256).expect("valid");
    assert_eq!(p.seq(1).seqlen_k, 9);
    assert_eq!(p.max_seqlen_k(), 9);
    // K is [7 blocks, 4 rows, 2 heads, 32]: key 5 of sequence 0 is row 1 of block 0.
    let row = 2 * 32;
    assert_eq!(p.k_offset(0, 5, 1), row + 32);
    assert_eq!(p.k_offset(0, 2, 0), 4 * 4 * row + 2 * row);
    assert_eq!(p.v_offset(1, 8, 0), 5 * 4 * row);
    assert_eq!(p.min_buffer_lens().k, 7 * 4 * row);
    // A used block outside the cache, a table too short, a used length past the table.
    let bad = [4i32, 0, -1, 6, 7, 5];
    assert!(matches!(
        ProblemDesc::new(2, 1, 0, 8, 2, 32)
            .paged_cache(&used, &bad, 3, 4, 7)
            .validate(256),
        Err(ProblemError::BlockIndex {
            batch: 1,
            slot: 1,
            block: 7,
            num_blocks: 7
        })
    ));
    assert!(matches!(
        ProblemDesc::new(2, 1, 0, 8, 2, 32)
            .paged_cache(&used, &table[..5], 3, 4, 7)
            .validate(256),
        Err(ProblemError::CacheTableLength {
            tensor: Tensor::BlockTable,
            needed: 6,
            len: 5
        })
    ));
    let long = [6u32, 13];
    assert!(matches!(
        ProblemDesc::new(2, 1, 0, 8, 2, 32)
            .paged_cache(&long, &table, 3, 4, 7)
            .validate(256),
        Err(ProblemError::CacheOverrun {
            batch: 1,
            used: 13,
            capacity: 12
        })
    ));
    assert!(matches!(
        ProblemDesc::new(2, 1, 0, 8, 2, 32)
            .paged_cache(&used, &table, 3, 0, 7)
            .validate(256),
        Err(ProblemError::ZeroDim { what: "block_size" })
    ));
}

#[test]
fn one_rescale_rule_for_every_p_type() {
    use softmax_core::{DType, RescalePolicy};
    let t = |tau: f32| RescalePolicy::Threshold(tau);
    // f32 and bf16 P: up to MAX_RESCALE_THRESHOLD; f16 P: below log2(65504) ≈ 15.9999.
    assert!(t(64.0).check(DType::F32.max_finite(), 0.0).is_ok());
    assert!(t(64.5).check(DType::F32.max_finite(), 0.0).is_err());
    assert!(t(64.0).check(DType::Bf16.max_finite(), 0.0).is_ok());
    assert!(t(15.0).check(DType::F16.max_finite(), 0.0).is_ok());
    assert!(t(16.0).check(DType::F16.max_finite(), 0.0).is_err());
    assert!(t(-1.0).check(DType::F32.max_finite(), 0.0).is_err());
    assert!(t(f32::NAN).check(DType::F32.max_finite(), 0.0).is_err());
    // FP8 e4m3 with FlashAttention-3's offset of 8: only `Always` fits (8 < log2 448 ≈ 8.81).
    assert!(RescalePolicy::<f32>::Always.check(448.0, 8.0).is_ok());
    assert!(matches!(
        t(1.0).check(448.0, 8.0),
        Err(ProblemError::RescaleThreshold { tau, offset_log2, .. }) if tau == 1.0 && offset_log2 == 8.0
    ));
}

#[test]
fn device_prefix_sums_are_sizes_only() {
    let sizes = Sequences::VarlenDevice {
        batch: 3,
        total_q: 40,
        total_k: 50,
        max_seqlen_q: 20,
        max_seqlen_k: 30,
    };
    let desc = ProblemDesc::new(1, 0, 0, 4, 2, 16)
        .with_sequences(sizes)
        .causal();
    let p = desc.validate(256).expect("valid");
    assert!(p.is_varlen());
    assert!(!p.has_host_seqlens());
    assert_eq!(p.sequences(), sizes);
    assert_eq!((p.batch(), p.total_q(), p.total_k()), (3, 40, 50));
    assert_eq!((p.max_seqlen_q(), p.max_seqlen_k()), (20, 30));
    // Packed tensors and the packed LSE, exactly as for host prefix sums.
    let lens = p.min_buffer_lens();
    assert_eq!(
        (lens.q, lens.k, lens.o),
        (40 * 4 * 16, 50 * 2 * 16, 40 * 4 * 16)
    );
    assert_eq!(lens.lse, Some(4 * 40));
    // The host does not know the ranges: no span, and host backends refuse.
    assert_eq!(p.try_seq(1), None);
    assert_eq!(p.seq(2).seqlen_q, 0);
    assert_eq!(p.q_offset(2, 0, 1), 16);
    assert!(matches!(
        p.require_host_seqlens(),
        Err(ProblemError::Unsupported { .. })
    ));
    let host = ProblemDesc::varlen(&[0, 3], &[0, 4], 2, 2, 16)
        .validate(256)
        .unwrap();
    assert_eq!(host.require_host_seqlens(), Ok(()));
    assert_eq!(host.try_seq(0).map(|s| s.seqlen_k), Some(4));

    let with = |s| {
        ProblemDesc::new(1, 0, 0, 4, 2, 16)
            .with_sequences(s)
            .validate(256)
    };
    assert!(matches!(
        with(Sequences::VarlenDevice {
            batch: 0,
            total_q: 1,
            total_k: 1,
            max_seqlen_q: 1,
            max_seqlen_k: 1,
        }),
        Err(ProblemError::ZeroDim { what: "batch" })
    ));
    assert!(matches!(
        with(Sequences::VarlenDevice {
            batch: 2,
            total_q: 10,
            total_k: 5,
            max_seqlen_q: 10,
            max_seqlen_k: 6,
        }),
        Err(ProblemError::SeqlenExceedsTotal {
            tensor: Tensor::K,
            max_seqlen: 6,
            total: 5
        })
    ));
    // A KV cache takes a fixed-length batch.
    let used = [1u32, 1];
    assert!(matches!(
        ProblemDesc::new(2, 1, 4, 4, 2, 16)
            .padded_cache(&used)
            .with_sequences(Sequences::VarlenDevice {
                batch: 2,
                total_q: 2,
                total_k: 8,
                max_seqlen_q: 1,
                max_seqlen_k: 4,
            })
            .validate(256),
        Err(ProblemError::Unsupported { .. })
    ));
}

#[test]
fn absurd_sizes_are_an_overflow_error_not_a_panic() {
    let huge = 1usize << 62;
    assert!(matches!(
        ProblemDesc::new(64, huge, huge, 8, 8, 128).validate(MAX_HEAD_DIM),
        Err(ProblemError::Overflow)
    ));
}

/// The flat (C ABI, `fa`, Python) arguments are converted by one checked function each:
/// window sides are -1 (unbounded) or ≥ 0, softcap 0 is none, an explicit scale is finite and
/// non-zero, an explicit thread count is at least 1. Fails before these helpers existed (the
/// C ABI read a window side of -5 as unbounded).
#[test]
fn flat_arguments_share_one_checked_conversion() {
    use softmax_core::{
        explicit_scale, mask_from_flash, softcap_from_flash, thread_count, window_side,
    };
    assert_eq!(mask_from_flash(false, -1, -1), Ok(Mask::NONE));
    assert_eq!(mask_from_flash(true, -1, -1), Ok(Mask::CAUSAL));
    assert_eq!(
        mask_from_flash(false, 100, 0),
        Ok(Mask {
            left: Some(100),
            right: Some(0)
        })
    );
    assert_eq!(
        mask_from_flash(true, 3, 7),
        Ok(Mask {
            left: Some(3),
            right: Some(0)
        })
    );
    assert_eq!(
        mask_from_flash(false, -5, 0),
        Err(ProblemError::BadWindow {
            side: "left",
            value: -5
        })
    );
    assert_eq!(
        mask_from_flash(true, 4, i64::MIN),
        Err(ProblemError::BadWindow {
            side: "right",
            value: i64::MIN
        })
    );
    let msg = mask_from_flash(false, -5, 0).unwrap_err().to_string();
    assert!(
        msg.contains("-5") && msg.contains("-1 for unbounded"),
        "{msg}"
    );
    assert_eq!(window_side("left", 0), Ok(Some(0)));

    assert_eq!(softcap_from_flash(0.0), Ok(None));
    assert_eq!(softcap_from_flash(-0.0), Ok(None));
    assert_eq!(softcap_from_flash(30.0), Ok(Some(30.0)));
    for bad in [-3.0, f32::INFINITY, f32::NEG_INFINITY] {
        assert_eq!(
            softcap_from_flash(bad),
            Err(ProblemError::BadSoftcap { softcap: bad })
        );
    }
    assert!(matches!(
        softcap_from_flash(f32::NAN),
        Err(ProblemError::BadSoftcap { .. })
    ));

    assert_eq!(explicit_scale(-1.0), Ok(-1.0));
    assert_eq!(explicit_scale(0.0), Err(ProblemError::ZeroScale));
    assert!(matches!(
        explicit_scale(f32::NAN),
        Err(ProblemError::NonFiniteScale { .. })
    ));

    assert_eq!(thread_count(3, 4), Ok(3));
    assert_eq!(
        thread_count(0, 4),
        Err(ProblemError::BadThreads { threads: 0 })
    );
    assert_eq!(
        thread_count(-1, 4),
        Err(ProblemError::BadThreads { threads: -1 })
    );
    assert_eq!(
        thread_count(5, 4),
        Err(ProblemError::TooManyThreads { threads: 5, max: 4 })
    );

    // Through the description: the same conversions, then validation.
    let p = ok_desc()
        .with_flash_args(true, 2, -1, 0.0)
        .unwrap()
        .validate(MAX_HEAD_DIM)
        .unwrap();
    assert_eq!(
        (p.mask(), p.softcap()),
        (
            Mask {
                left: Some(2),
                right: Some(0)
            },
            None
        )
    );
    assert_eq!(
        ok_desc().with_flash_args(false, -1, -2, 0.0),
        Err(ProblemError::BadWindow {
            side: "right",
            value: -2
        })
    );
}

/// An empty problem (no queries) validates: its output has no elements that could overlap.
/// Fails on the old validation with "output: batch stride = 0 makes elements overlap".
#[test]
fn empty_query_sequences_validate() {
    for (b, sq, sk) in [(2, 0, 7), (3, 0, 0), (1, 0, 5)] {
        let p = ProblemDesc::new(b, sq, sk, 4, 2, 16)
            .validate(MAX_HEAD_DIM)
            .unwrap_or_else(|e| panic!("b{b} sq{sq} sk{sk}: {e}"));
        assert_eq!(p.min_buffer_lens().o, 0);
        assert_eq!(p.lse_len(), 0);
    }
}

#[test]
fn sinks_are_validated() {
    let sinks = [0.5f32, -1.0, 2.0, 0.0];
    let p = ok_desc().with_sinks(&sinks).validate(MAX_HEAD_DIM).unwrap();
    assert_eq!(p.sinks(), Some(&sinks[..]));
    assert_eq!(p.sink_log2::<f64>(1), Some(-softmax_core::LOG2_E));
    assert_eq!(p.sink_log2::<f32>(4), None);
    assert_eq!(ok_desc().validate(MAX_HEAD_DIM).unwrap().sinks(), None);
    let short = [0.0f32; 3];
    assert_eq!(
        ok_desc().with_sinks(&short).validate(MAX_HEAD_DIM),
        Err(ProblemError::SinksLength { needed: 4, len: 3 })
    );
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let s = [0.0f32, 0.0, bad, 0.0];
        match ok_desc().with_sinks(&s).validate(MAX_HEAD_DIM) {
            Err(ProblemError::NonFiniteSink { head: 2, value }) => {
                assert!(value.is_nan() == bad.is_nan())
            }
            other => panic!("{other:?}"),
        }
    }
}
