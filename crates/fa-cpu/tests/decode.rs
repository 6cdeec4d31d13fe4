//! Decode over KV caches (split-KV): padded and paged caches against the f64 oracle (block
//! sizes 1 to 256, odd and empty lengths, GQA and MQA, 1–4 queries, masks, softcap, every
//! dtype, KV heads cut into runs), forced split counts against the unsplit call, bitwise
//! identity for any thread count, and typed errors with untouched outputs.

mod common;

use common::{convert, levels};
use fa_cpu::{forward, Element, ForwardOptions, ForwardStats, SimdLevel};
use fa_reference::{
    attention_f64, compare, poison, CacheLayout, DecodeCase, ErrorReport, Rng, Rounding,
};
use softmax_core::{Mask, Out, ProblemDesc, ProblemError, Qkv, MAX_HEAD_DIM};

const F32_BOUND: f64 = 1e-5;
const HALF_BOUND: f64 = 1e-2;
const LSE_BOUND: f64 = 1e-4;

/// Output, LSE and stats of one run.
struct Run<O> {
    out: Vec<O>,
    lse: Vec<f32>,
    stats: ForwardStats,
}

/// Runs the case through `fa_cpu::forward` (outputs poisoned first).
fn run<T: Element, O: Element + fa_reference::Element>(
    case: &DecodeCase,
    opts: &ForwardOptions,
) -> Run<O> {
    let problem = case.desc().validate(MAX_HEAD_DIM).expect("valid case");
    let lens = problem.min_buffer_lens();
    let mut out = vec![O::from_f32(0.0); lens.o];
    poison(&mut out);
    let mut lse = vec![f32::NAN; problem.lse_len()];
    let (q, k, v) = (
        convert::<T>(&case.q),
        convert::<T>(&case.k),
        convert::<T>(&case.v),
    );
    let stats = forward(
        &problem,
        Qkv::new(&q[..], &k[..], &v[..]),
        Out::with_lse(&mut out[..], &mut lse[..]),
        opts,
    )
    .expect("forward");
    Run { out, lse, stats }
}

/// Runs and compares with the oracle on the same (possibly rounded) inputs.
fn check<T: Element, O: Element + fa_reference::Element>(
    case: &DecodeCase,
    opts: &ForwardOptions,
) -> ErrorReport {
    let problem = case.desc().validate(MAX_HEAD_DIM).expect("valid case");
    let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
    let r = run::<T, O>(case, opts);
    compare(&problem, &r.out, Some(&r.lse), &oracle)
}

fn opts(level: SimdLevel, splits: Option<usize>) -> ForwardOptions<'static> {
    ForwardOptions {
        simd: level,
        kv_splits: splits,
        ..ForwardOptions::default()
    }
}

/// Random lengths: odd ones, 0 and 1 among them.
fn lengths(rng: &mut Rng, batch: usize, longest: usize) -> Vec<u32> {
    (0..batch)
        .map(|b| match b % 4 {
            0 => rng.below(longest + 1) as u32,
            1 => 1,
            2 => (longest - rng.below(longest / 2 + 1)) as u32 | 1,
            _ => 0,
        })
        .collect()
}

#[test]
fn padded_and_paged_caches_match_the_oracle_f32() {
    let mut rng = Rng::new(1501);
    for level in levels() {
        for block_size in [1, 3, 16, 64, 256] {
            // (16, 1) with up to 4 queries: more rows per KV head than the streaming
            // kernel takes, so the tiled forward's split path runs.
            for (group, heads_kv) in [(1, 2), (4, 2), (8, 1), (16, 1)] {
                let sq = 1 + rng.below(4);
                let used = lengths(&mut rng, 5, 300);
                let layouts = [
                    CacheLayout::Padded { capacity: 301 },
                    DecodeCase::paged_layout(&used, block_size),
                ];
                for layout in layouts {
                    let d = [8, 33, 64, 128][rng.below(4)];
                    let case = DecodeCase::new(
                        &mut rng,
                        &used,
                        sq,
                        group * heads_kv,
                        heads_kv,
                        d,
                        layout,
                        Rounding::F32,
                    );
                    let case = if rng.below(2) == 0 {
                        case.causal()
                    } else {
                        case
                    };
                    for splits in [None, Some(1), Some(3), Some(1000)] {
                        let rep = check::<f32, f32>(&case, &opts(level, splits));
                        assert!(
                            rep.within(F32_BOUND, LSE_BOUND),
                            "{level:?} {layout:?} group {group} sq {sq} d {d} \
                             splits {splits:?} used {used:?}: {rep:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn masks_softcap_and_half_dtypes_match_the_oracle() {
    let mut rng = Rng::new(1502);
    for level in levels() {
        for (rounding, bound) in [
            (Rounding::F32, F32_BOUND),
            (Rounding::Bf16, HALF_BOUND),
            (Rounding::F16, HALF_BOUND),
        ] {
            for mask in [
                Mask::NONE,
                Mask::CAUSAL,
                Mask {
                    left: Some(70),
                    right: Some(0),
                },
                Mask {
                    left: Some(5),
                    right: Some(2),
                },
            ] {
                let used = lengths(&mut rng, 4, 500);
                let layout = DecodeCase::paged_layout(&used, 16);
                let case = DecodeCase::new(&mut rng, &used, 3, 16, 2, 64, layout, rounding)
                    .with_mask(mask);
                let case = if rng.below(2) == 0 {
                    case.with_softcap(5.0)
                } else {
                    case
                };
                for splits in [None, Some(2), Some(7)] {
                    let o = opts(level, splits);
                    let rep = match rounding {
                        Rounding::F32 => check::<f32, f32>(&case, &o),
                        Rounding::Bf16 => check::<half::bf16, half::bf16>(&case, &o),
                        Rounding::F16 => check::<half::f16, half::f16>(&case, &o),
                    };
                    assert!(
                        rep.within(bound, if bound > F32_BOUND { 1e-2 } else { LSE_BOUND }),
                        "{level:?} {rounding:?} {mask:?} splits {splits:?}: {rep:?}"
                    );
                    if rounding != Rounding::F32 {
                        // 16-bit inputs, f32 output: only the accumulation's rounding remains.
                        let rep = match rounding {
                            Rounding::Bf16 => check::<half::bf16, f32>(&case, &o),
                            _ => check::<half::f16, f32>(&case, &o),
                        };
                        assert!(
                            rep.within(F32_BOUND, LSE_BOUND),
                            "{rounding:?}->f32: {rep:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn forced_splits_agree_with_the_unsplit_call() {
    let mut rng = Rng::new(1503);
    let used = [1000u32, 1, 777, 0, 2049];
    let layout = DecodeCase::paged_layout(&used, 64);
    let case = DecodeCase::new(&mut rng, &used, 2, 32, 8, 128, layout, Rounding::F32).causal();
    for level in levels() {
        let whole = run::<f32, f32>(&case, &opts(level, Some(1)));
        assert_eq!(whole.stats.kv_splits, 1);
        for splits in [2, 3, 8, 64] {
            let split = run::<f32, f32>(&case, &opts(level, Some(splits)));
            assert!(split.stats.kv_splits > 1);
            let diff = whole
                .out
                .iter()
                .zip(&split.out)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(diff < 1e-5, "{level:?} splits {splits}: max diff {diff}");
            for (a, b) in whole.lse.iter().zip(&split.lse) {
                assert!(
                    a == b || (a - b).abs() < 1e-5,
                    "{level:?} splits {splits}: lse {a} vs {b}"
                );
            }
        }
    }
}

/// Items over runs of KV heads: where a sequence's Q and O rows pass what one item holds
/// (fa-cpu's `ITEM_QO_BYTES`, 128 KiB), the plan cuts its KV heads into runs, each with its
/// own splits and combine. 32 rows per KV head (group 16, 2 queries) at head dim 160 are
/// 40 KiB of rows per head: runs of 3, 3 and 2 of the 8 heads.
#[test]
fn runs_of_kv_heads_match_the_oracle() {
    let mut rng = Rng::new(1510);
    let used = lengths(&mut rng, 3, 300);
    for level in levels() {
        let layouts = [
            CacheLayout::Padded { capacity: 301 },
            DecodeCase::paged_layout(&used, 16),
        ];
        for layout in layouts {
            let case =
                DecodeCase::new(&mut rng, &used, 2, 128, 8, 160, layout, Rounding::Bf16).causal();
            for splits in [None, Some(1), Some(3)] {
                let o = opts(level, splits);
                let rep = check::<half::bf16, half::bf16>(&case, &o);
                assert!(
                    rep.within(HALF_BOUND, 1e-2),
                    "{level:?} {layout:?} splits {splits:?} used {used:?}: {rep:?}"
                );
                let rep = check::<half::bf16, f32>(&case, &o);
                assert!(
                    rep.within(F32_BOUND, LSE_BOUND),
                    "{level:?} {layout:?} splits {splits:?} used {used:?} (f32 out): {rep:?}"
                );
            }
        }
    }
}

#[test]
fn bitwise_identical_for_any_thread_count() {
    let mut rng = Rng::new(1504);
    // Long enough that the automatic rule splits it (2 MiB of K+V per split at least).
    let used = [20000u32, 17, 9000];
    for layout in [
        CacheLayout::Padded { capacity: 20001 },
        DecodeCase::paged_layout(&used, 16),
    ] {
        let case = DecodeCase::new(&mut rng, &used, 1, 8, 2, 64, layout, Rounding::Bf16);
        for splits in [None, Some(5)] {
            let base = ForwardOptions {
                kv_splits: splits,
                threads: Some(1),
                ..ForwardOptions::default()
            };
            let one = run::<half::bf16, f32>(&case, &base);
            // The automatic rule splits this long cache (few tasks).
            assert!(one.stats.kv_splits > 1, "{:?}", one.stats);
            for threads in [Some(2), Some(3), Some(7), None] {
                let other = run::<half::bf16, f32>(&case, &ForwardOptions { threads, ..base });
                let same = one
                    .out
                    .iter()
                    .zip(&other.out)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
                    && one
                        .lse
                        .iter()
                        .zip(&other.lse)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{layout:?} splits {splits:?} threads {threads:?}");
                assert_eq!(one.stats, other.stats);
            }
        }
    }
}

/// The prefetch schedule is a timing knob: every schedule gives bitwise the same results
/// (bf16 and f32 caches, padded and paged, the tiles' path where this CPU has AMX), and the
/// names parse (out-of-range distances and unknown names do not). A hand-built `Ahead(n)`
/// with `n` past a tile (or 0) runs too, as `Ahead(64)` (or no fixed-distance stream).
#[test]
fn every_prefetch_schedule_gives_the_same_bits() {
    use fa_cpu::{DecodeOptions, DecodePrefetch};
    let names = [
        "off",
        "phase",
        "next",
        "ahead:4",
        "phase+ahead:16",
        "ahead:64",
    ];
    let mut modes: Vec<DecodePrefetch> = names
        .iter()
        .map(|n| DecodePrefetch::parse(n).unwrap_or_else(|| panic!("{n}")))
        .collect();
    assert_eq!(modes[2], DecodePrefetch::Next);
    assert_eq!(modes[4], DecodePrefetch::PhaseAhead(16));
    assert_eq!(DecodePrefetch::default(), DecodePrefetch::Phase);
    assert_eq!(DecodeOptions::default().prefetch, DecodePrefetch::Phase);
    for bad in [
        "",
        "Phase",
        "ahead:0",
        "ahead:65",
        "ahead:x",
        "phase+ahead:",
        " off",
    ] {
        assert_eq!(DecodePrefetch::parse(bad), None, "{bad:?}");
    }
    modes.extend([
        DecodePrefetch::Ahead(0),
        DecodePrefetch::PhaseAhead(1 << 20),
    ]);
    let mut rng = Rng::new(1505);
    let used = [700u32, 33, 257];
    for layout in [
        CacheLayout::Padded { capacity: 701 },
        DecodeCase::paged_layout(&used, 16),
    ] {
        let case = DecodeCase::new(&mut rng, &used, 1, 8, 2, 128, layout, Rounding::Bf16);
        let bits = |prefetch: DecodePrefetch| {
            let opts = ForwardOptions {
                kv_splits: Some(3),
                threads: Some(1),
                decode: DecodeOptions {
                    prefetch,
                    ..DecodeOptions::default()
                },
                ..ForwardOptions::default()
            };
            let bf = run::<half::bf16, f32>(&case, &opts);
            let f = run::<f32, f32>(&case, &opts);
            [bf.out, bf.lse, f.out, f.lse]
                .iter()
                .flatten()
                .map(|x| x.to_bits())
                .collect::<Vec<u32>>()
        };
        let first = bits(modes[0]);
        for &mode in &modes[1..] {
            assert!(bits(mode) == first, "{layout:?}: {mode:?} differs from off");
        }
    }
}

#[test]
fn split_path_on_a_problem_without_cache_matches_the_oracle() {
    let mut rng = Rng::new(1505);
    let case = fa_reference::Case::dense(&mut rng, 2, 3, 700, 8, 2, 64).causal();
    let problem = case.desc().validate(MAX_HEAD_DIM).expect("valid");
    let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
    for splits in [2, 5] {
        let r = common::run::<f32, f32>(&case, &opts(SimdLevel::Auto, Some(splits)));
        assert!(r.stats.kv_splits > 1);
        let rep = compare(&problem, &r.out, Some(&r.lse), &oracle);
        assert!(rep.within(F32_BOUND, LSE_BOUND), "{rep:?}");
    }
}

/// Runs a bad cache call and checks the error and that O and the LSE are untouched.
fn expect_error(
    desc: &ProblemDesc,
    case: &DecodeCase,
    opts: &ForwardOptions,
    want: impl Fn(&ProblemError) -> bool,
) {
    let sentinel = 12345.0f32;
    let out_len = case.batch * case.seqlen_q * case.heads_q * case.head_dim;
    let mut out = vec![sentinel; out_len];
    let mut lse = vec![sentinel; case.batch * case.heads_q * case.seqlen_q];
    let err = desc
        .validate(MAX_HEAD_DIM)
        .and_then(|problem| {
            forward(
                &problem,
                Qkv::new(&case.q[..], &case.k[..], &case.v[..]),
                Out::with_lse(&mut out[..], &mut lse[..]),
                opts,
            )
        })
        .expect_err("bad input must be rejected");
    assert!(want(&err), "unexpected error {err:?} ({err})");
    assert!(
        out.iter().all(|&x| x == sentinel),
        "output touched on {err}"
    );
    assert!(lse.iter().all(|&x| x == sentinel), "lse touched on {err}");
}

#[test]
fn bad_caches_are_typed_errors_and_leave_outputs_untouched() {
    let mut rng = Rng::new(1506);
    let used = [5u32, 9];
    // 2 sequences × 3 blocks of 4 keys at most, 7 blocks in the cache.
    let layout = CacheLayout::Paged {
        block_size: 4,
        blocks_per_seq: 3,
        num_blocks: 7,
    };
    let case = DecodeCase::new(&mut rng, &used, 1, 4, 2, 8, layout, Rounding::F32);
    let ok = opts(SimdLevel::Auto, None);
    // A used block outside the cache.
    let mut bad = case.block_table.clone();
    bad[3] = 7;
    let desc = ProblemDesc::new(2, 1, 0, 4, 2, 8).paged_cache(&used, &bad, 3, 4, 7);
    expect_error(&desc, &case, &ok, |e| {
        matches!(
            e,
            ProblemError::BlockIndex {
                batch: 1,
                slot: 0,
                block: 7,
                ..
            }
        )
    });
    bad[3] = -1;
    let desc = ProblemDesc::new(2, 1, 0, 4, 2, 8).paged_cache(&used, &bad, 3, 4, 7);
    expect_error(&desc, &case, &ok, |e| {
        matches!(e, ProblemError::BlockIndex { block: -1, .. })
    });
    // A used length past the table (3 blocks of 4 keys hold 12).
    let long = [5u32, 13];
    let desc = ProblemDesc::new(2, 1, 0, 4, 2, 8).paged_cache(&long, &case.block_table, 3, 4, 7);
    expect_error(&desc, &case, &ok, |e| {
        matches!(
            e,
            ProblemError::CacheOverrun {
                batch: 1,
                used: 13,
                capacity: 12
            }
        )
    });
    // A table too short for batch × blocks_per_seq.
    let desc =
        ProblemDesc::new(2, 1, 0, 4, 2, 8).paged_cache(&used, &case.block_table[..5], 3, 4, 7);
    expect_error(&desc, &case, &ok, |e| {
        matches!(e, ProblemError::CacheTableLength { .. })
    });
    // Lengths for the wrong batch.
    let desc =
        ProblemDesc::new(2, 1, 0, 4, 2, 8).paged_cache(&used[..1], &case.block_table, 3, 4, 7);
    expect_error(&desc, &case, &ok, |e| {
        matches!(e, ProblemError::CacheTableLength { .. })
    });
    // A padded cache too small for its lengths.
    let desc = ProblemDesc::new(2, 1, 8, 4, 2, 8).padded_cache(&used);
    expect_error(&desc, &case, &ok, |e| {
        matches!(e, ProblemError::CacheOverrun { .. })
    });
    // A K/V buffer shorter than the blocks it claims.
    let short = DecodeCase {
        k: case.k[..case.k.len() - 1].to_vec(),
        ..case.clone()
    };
    expect_error(&case.desc(), &short, &ok, |e| {
        matches!(e, ProblemError::BufferTooSmall { .. })
    });
    // Zero splits.
    expect_error(&case.desc(), &case, &opts(SimdLevel::Auto, Some(0)), |e| {
        matches!(e, ProblemError::ZeroDim { what: "kv_splits" })
    });
}

#[test]
fn nan_in_a_cache_row_reaches_only_the_rows_that_see_it() {
    // A NaN in a key sequence 1 uses poisons sequence 1's rows only; a NaN in an unused row
    // of the cache (past seqused_k) or an unused block is never read.
    let mut rng = Rng::new(1507);
    let used = [40u32, 40];
    let layout = DecodeCase::paged_layout(&used, 16);
    let mut case = DecodeCase::new(&mut rng, &used, 1, 2, 1, 16, layout, Rounding::F32);
    let (ko, _) = case.cache_row(1, 7, 0);
    case.k[ko] = f32::NAN;
    // Row 41 of sequence 0 lies in its third block, past its used length.
    let (unused, _) = case.cache_row(0, 41, 0);
    case.k[unused] = f32::NAN;
    case.v[unused] = f32::NAN;
    for splits in [None, Some(3)] {
        let r = run::<f32, f32>(&case, &opts(SimdLevel::Auto, splits));
        let per_seq = 2 * 16;
        assert!(r.out[..per_seq].iter().all(|x| x.is_finite()), "{splits:?}");
        assert!(r.out[per_seq..].iter().all(|x| x.is_nan()), "{splits:?}");
    }
}

#[test]
fn append_writes_new_tokens_at_each_position_and_nothing_else() {
    let mut rng = Rng::new(1508);
    for block_size in [1, 3, 16] {
        let used = [5u32, 0, 16, 31];
        let new = 3;
        let after: Vec<u32> = used.iter().map(|&u| u + new as u32).collect();
        for layout in [
            CacheLayout::Padded { capacity: 40 },
            DecodeCase::paged_layout(&after, block_size),
        ] {
            // The table covers the lengths after the append; `case` starts at `used`.
            let full = DecodeCase::new(&mut rng, &after, 2, 8, 2, 24, layout, Rounding::Bf16);
            let case = DecodeCase {
                seqused_k: used.to_vec(),
                ..full.clone()
            };
            let before_k: Vec<half::bf16> = convert(&case.k);
            let before_v: Vec<half::bf16> = convert(&case.v);
            let (mut k, mut v) = (before_k.clone(), before_v.clone());
            let d = case.head_dim;
            let k_new: Vec<half::bf16> = convert(
                &(0..4 * new * 2 * d)
                    .map(|_| rng.normal() as f32)
                    .collect::<Vec<_>>(),
            );
            let v_new: Vec<half::bf16> = convert(
                &(0..4 * new * 2 * d)
                    .map(|_| rng.normal() as f32)
                    .collect::<Vec<_>>(),
            );
            let desc = case.desc();
            let append = softmax_core::AppendDesc::new(desc.kv_cache, 40, new, 2, d)
                .validate()
                .expect("valid append");
            fa_cpu::append_kv(&append, &k_new, &v_new, &mut k, &mut v).expect("append");
            // Every new row where the layout's definition puts it, every other element as
            // it was.
            let mut expect_k = before_k.clone();
            let mut expect_v = before_v.clone();
            for (b, &start) in used.iter().enumerate() {
                for i in 0..new {
                    for h in 0..2 {
                        let (at, _) = full.cache_row(b, start as usize + i, h);
                        let src = ((b * new + i) * 2 + h) * d;
                        expect_k[at..at + d].copy_from_slice(&k_new[src..src + d]);
                        expect_v[at..at + d].copy_from_slice(&v_new[src..src + d]);
                    }
                }
            }
            assert!(k == expect_k && v == expect_v, "{layout:?}");
            // The attention over the grown cache against the oracle.
            let grown = DecodeCase {
                k: k.iter().map(|x| x.to_f32()).collect(),
                v: v.iter().map(|x| x.to_f32()).collect(),
                ..full.causal()
            };
            let rep = check::<half::bf16, f32>(&grown, &opts(SimdLevel::Auto, None));
            assert!(rep.within(F32_BOUND, LSE_BOUND), "{layout:?}: {rep:?}");
        }
    }
}

#[test]
fn bad_appends_are_typed_errors_and_leave_the_cache_untouched() {
    use softmax_core::{AppendDesc, KvCache};
    let mut rng = Rng::new(1509);
    let used = [5u32, 9];
    let layout = CacheLayout::Paged {
        block_size: 4,
        blocks_per_seq: 3,
        num_blocks: 7,
    };
    let case = DecodeCase::new(&mut rng, &used, 1, 4, 2, 8, layout, Rounding::F32);
    let (k_new, v_new) = (vec![1.0f32; 2 * 2 * 2 * 8], vec![2.0f32; 2 * 2 * 2 * 8]);
    let try_append = |desc: AppendDesc, k_new: &[f32]| {
        let (mut k, mut v) = (case.k.clone(), case.v.clone());
        let err = desc
            .validate()
            .and_then(|a| fa_cpu::append_kv(&a, k_new, &v_new, &mut k, &mut v))
            .expect_err("bad append must be rejected");
        assert!(k == case.k && v == case.v, "cache touched on {err}");
        err
    };
    let paged = |table: &'static [i32], used: &'static [u32]| KvCache::Paged {
        seqused_k: used,
        block_table: table,
        blocks_per_seq: 3,
        block_size: 4,
        num_blocks: 7,
    };
    let table: &'static [i32] = Box::leak(case.block_table.clone().into_boxed_slice());
    // Cache full: sequence 1 holds 9 of 12 keys, 4 more do not fit (sequence 0's 4 + 4 keys
    // stay within its two blocks).
    let err = try_append(AppendDesc::new(paged(table, &[4, 9]), 0, 4, 2, 8), &k_new);
    assert!(
        matches!(
            err,
            ProblemError::CacheOverrun {
                batch: 1,
                used: 13,
                capacity: 12
            }
        ),
        "{err:?}"
    );
    // The block the new tokens need is out of range (sequence 0's third block, slot 2).
    let mut bad = case.block_table.clone();
    bad[2] = 99;
    let bad: &'static [i32] = Box::leak(bad.into_boxed_slice());
    let err = try_append(AppendDesc::new(paged(bad, &[5, 9]), 0, 4, 2, 8), &k_new);
    assert!(
        matches!(
            err,
            ProblemError::BlockIndex {
                batch: 0,
                slot: 2,
                block: 99,
                ..
            }
        ),
        "{err:?}"
    );
    // A table too short.
    let err = try_append(
        AppendDesc::new(paged(&table[..4], &[5, 9]), 0, 1, 2, 8),
        &k_new,
    );
    assert!(
        matches!(err, ProblemError::CacheTableLength { .. }),
        "{err:?}"
    );
    // New tokens shorter than the append says.
    let err = try_append(
        AppendDesc::new(paged(table, &[5, 9]), 0, 2, 2, 8),
        &k_new[..10],
    );
    assert!(
        matches!(
            err,
            ProblemError::BufferTooSmall {
                tensor: softmax_core::Tensor::KNew,
                ..
            }
        ),
        "{err:?}"
    );
    // A padded cache full at its capacity, and no cache at all.
    let err = try_append(
        AppendDesc::new(KvCache::Padded { seqused_k: &[5, 9] }, 10, 2, 2, 8),
        &k_new,
    );
    assert!(
        matches!(
            err,
            ProblemError::CacheOverrun {
                batch: 1,
                used: 11,
                capacity: 10
            }
        ),
        "{err:?}"
    );
    let err = try_append(AppendDesc::new(KvCache::None, 10, 2, 2, 8), &k_new);
    assert!(
        matches!(
            err,
            ProblemError::ZeroDim { what: "batch" } | ProblemError::Unsupported { .. }
        ),
        "{err:?}"
    );
}

mod proptests {
    use super::*;
    use proptest::prelude::{any, prop_assert, proptest, ProptestConfig};

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Random caches (padded or paged with any block size 1..=300), lengths 0..700,
        /// 1–4 queries, GQA 1..=8, masks, softcap, split counts, every SIMD level, f32 and
        /// bf16: within the bounds of the f64 oracle.
        #[test]
        fn random_decode_matches_the_oracle(
            seed in any::<u64>(),
            lens in proptest::collection::vec(0u32..700, 1..4),
            sq in 1usize..5,
            heads_kv in 1usize..3,
            group in 1usize..9,
            head_dim in 1usize..140,
            block_size in 0usize..300,
            mask_kind in 0u8..4,
            softcap in proptest::option::of(1.0f32..50.0),
            splits in proptest::option::of(1usize..20),
            bf in any::<bool>(),
        ) {
            let mut rng = Rng::new(seed);
            let layout = if block_size == 0 {
                CacheLayout::Padded {
                    capacity: lens.iter().copied().max().unwrap_or(0) as usize + 1,
                }
            } else {
                DecodeCase::paged_layout(&lens, block_size)
            };
            let rounding = if bf { Rounding::Bf16 } else { Rounding::F32 };
            let case = DecodeCase::new(
                &mut rng, &lens, sq, group * heads_kv, heads_kv, head_dim, layout, rounding,
            );
            let case = case.with_mask(match mask_kind {
                0 => Mask::NONE,
                1 => Mask::CAUSAL,
                2 => Mask { left: Some(37), right: Some(0) },
                _ => Mask { left: Some(3), right: Some(1) },
            });
            let case = match softcap {
                Some(c) => case.with_softcap(c),
                None => case,
            };
            for level in levels() {
                let o = opts(level, splits);
                let rep = if bf {
                    check::<half::bf16, f32>(&case, &o)
                } else {
                    check::<f32, f32>(&case, &o)
                };
                prop_assert!(
                    rep.within(F32_BOUND, LSE_BOUND),
                    "{level:?} {layout:?} sq {sq} group {group} d {head_dim} splits {splits:?}: {rep:?}"
                );
            }
        }
    }
}

/// The environment variable that marks the child run of
/// [`environment_variables_change_nothing`].
const ENV_CHILD: &str = "FA_CPU_TEST_ENV_CHILD";

/// No library behaviour is read from the environment: this test runs itself again in a child
/// process with every variable fa-cpu once read set to its non-default value
/// (`FA_CPU_AMX=0`, `FA_CPU_DECODE_AMX_PV=0`, `FA_CPU_DECODE_DPBF16=1`,
/// `FA_CPU_DECODE_PREFETCH=off`), and the child's detected level and default-option decode
/// bits (bf16 cache, bf16 and f32 outputs, a shape the AMX `Q·Kᵀ` and `P·V` take; f32 cache)
/// must be the parent's. With the variables read, an AVX512-BF16 CPU changed the bf16 bits
/// (`vdpbf16ps`), an AMX CPU the level and the bf16 output's bits.
#[test]
fn environment_variables_change_nothing() {
    let mut rng = Rng::new(4949);
    let used = [300u32, 1, 97];
    let case = DecodeCase::new(
        &mut rng,
        &used,
        1,
        8,
        2,
        96,
        CacheLayout::Padded { capacity: 301 },
        Rounding::Bf16,
    );
    let opts = ForwardOptions {
        threads: Some(1),
        ..ForwardOptions::default()
    };
    let half = run::<half::bf16, half::bf16>(&case, &opts);
    let bf = run::<half::bf16, f32>(&case, &opts);
    let f = run::<f32, f32>(&case, &opts);
    // FNV-1a over every output and LSE bit.
    let mut digest = 0xcbf2_9ce4_8422_2325u64;
    let words = half.out.iter().map(|x| u32::from(x.to_bits()));
    let words = words.chain(
        [&half.lse, &bf.out, &bf.lse, &f.out, &f.lse]
            .into_iter()
            .flatten()
            .map(|x| x.to_bits()),
    );
    for w in words {
        for byte in w.to_le_bytes() {
            digest = (digest ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    let line = format!("env-digest {digest:016x} level {}", fa_cpu::simd_level());
    if std::env::var_os(ENV_CHILD).is_some() {
        println!("{line}");
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let child = std::process::Command::new(exe)
        .args([
            "--exact",
            "environment_variables_change_nothing",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ENV_CHILD, "1")
        .env("FA_CPU_AMX", "0")
        .env("FA_CPU_DECODE_AMX_PV", "0")
        .env("FA_CPU_DECODE_DPBF16", "1")
        .env("FA_CPU_DECODE_PREFETCH", "off")
        .output()
        .expect("the child run starts");
    let stdout = String::from_utf8_lossy(&child.stdout);
    assert!(child.status.success(), "child failed: {stdout}");
    // The test harness may print the test's name on the same line first.
    let got = stdout
        .lines()
        .find_map(|l| l.find("env-digest ").map(|at| &l[at..]))
        .unwrap_or_else(|| panic!("no digest in the child's output: {stdout}"));
    assert_eq!(got, line, "the environment changed the level or the bits");
}

/// Plan → workspace → run: one plan of a decode step runs every "layer" (fresh Q, K and V of
/// the step's sizes) and gives the bits `forward` gives; a workspace reserved for the plan
/// does not grow while the layers run; each variant (streaming decode, split-KV over the
/// tiles, whole sequences) reports its work. Tensors of other dtypes or lengths than the
/// plan's are typed errors with the output untouched; the plan refuses what `forward` does.
#[test]
fn one_plan_runs_every_layer_of_a_decode_step() {
    use fa_cpu::{plan_forward, run_forward, Workspace};
    use softmax_core::DType;
    let mut rng = Rng::new(1510);
    let used = [700u32, 1, 333];
    // (query heads, KV heads, splits): few rows per KV head stream; sixteen query heads per
    // KV head with four queries take the tiled split path.
    for (heads_q, heads_kv, seqlen_q, variant) in [(8, 2, 1, "stream"), (16, 1, 4, "split-kv")] {
        let layout = DecodeCase::paged_layout(&used, 16);
        let case = DecodeCase::new(
            &mut rng,
            &used,
            seqlen_q,
            heads_q,
            heads_kv,
            64,
            layout,
            Rounding::Bf16,
        );
        let problem = case.desc().validate(MAX_HEAD_DIM).expect("valid case");
        let opts = ForwardOptions {
            threads: Some(2),
            kv_splits: Some(3),
            ..ForwardOptions::default()
        };
        let plan = plan_forward(&problem, DType::Bf16, DType::F32, &opts).expect("plan");
        assert!(plan.variant().starts_with(variant), "{plan:?}");
        assert_eq!(plan.kv_splits(), 3, "{plan:?}");
        let req = plan.workspace();
        assert!(req.bytes_per_worker > 0 && req.partial_bytes > 0, "{req:?}");
        let mut ws = Workspace::new();
        ws.reserve(&plan).expect("reserve");
        let reserved = ws.scratch_bytes();
        let lens = problem.min_buffer_lens();
        for layer in 0..3 {
            let draw = |rng: &mut Rng, n: usize| -> Vec<half::bf16> {
                (0..n)
                    .map(|_| half::bf16::from_f32(rng.normal() as f32))
                    .collect()
            };
            let (q, k, v) = (
                draw(&mut rng, lens.q),
                draw(&mut rng, lens.k),
                draw(&mut rng, lens.v),
            );
            let qkv = Qkv::new(&q[..], &k[..], &v[..]);
            let mut out = vec![0.0f32; lens.o];
            poison(&mut out);
            let mut lse = vec![f32::NAN; problem.lse_len()];
            let stats =
                run_forward(&plan, qkv, Out::with_lse(&mut out, &mut lse), &mut ws).expect("run");
            assert_eq!(
                ws.scratch_bytes(),
                reserved,
                "layer {layer}: the workspace grew"
            );
            let (mut want, mut want_lse) = (vec![0.0f32; lens.o], vec![0.0f32; problem.lse_len()]);
            let want_stats = forward(
                &problem,
                qkv,
                Out::with_lse(&mut want, &mut want_lse),
                &opts,
            )
            .expect("forward");
            assert_eq!(stats, want_stats);
            assert!(
                out.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
                    && lse
                        .iter()
                        .zip(&want_lse)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{variant} layer {layer}: the planned run differs from forward"
            );
            // Other dtypes or lengths than the plan's: typed errors, O untouched.
            let before = out.clone();
            let mut o16 = vec![half::bf16::from_f32(7.0); lens.o];
            let e = run_forward(&plan, qkv, Out::new(&mut o16[..]), &mut ws).unwrap_err();
            assert!(matches!(e, ProblemError::Unsupported { .. }), "{e:?}");
            assert!(o16.iter().all(|x| x.to_f32() == 7.0));
            let short = Qkv::new(&q[..lens.q - 1], &k[..], &v[..]);
            assert!(run_forward(&plan, short, Out::new(&mut out[..]), &mut ws).is_err());
            assert!(out
                .iter()
                .zip(&before)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
    // Without a cache or splits: whole sequences.
    let problem = ProblemDesc::new(2, 37, 50, 4, 2, 32)
        .causal()
        .validate(MAX_HEAD_DIM)
        .expect("valid");
    let opts = ForwardOptions {
        simd: SimdLevel::Avx2Fma,
        ..ForwardOptions::default()
    };
    if let Ok(plan) = plan_forward(&problem, DType::F32, DType::F32, &opts) {
        assert_eq!((plan.variant(), plan.kv_splits()), ("tiles", 1), "{plan:?}");
        assert!(plan.work_items() > 0 && plan.workspace().partial_bytes == 0);
    }
    // The plan refuses what the call would.
    let bad = [
        (DType::Bf16, DType::F16, ForwardOptions::default()),
        (
            DType::F32,
            DType::F32,
            ForwardOptions {
                threads: Some(0),
                ..ForwardOptions::default()
            },
        ),
        (
            DType::F32,
            DType::F32,
            ForwardOptions {
                kv_splits: Some(0),
                ..ForwardOptions::default()
            },
        ),
    ];
    for (inputs, output, opts) in bad {
        let e = plan_forward(&problem, inputs, output, &opts).unwrap_err();
        assert!(
            matches!(
                e,
                ProblemError::Unsupported { .. } | ProblemError::ZeroDim { .. }
            ),
            "{inputs:?} {output:?}: {e:?}"
        );
    }
}
