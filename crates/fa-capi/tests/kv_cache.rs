//! `fa_forward_cache_cpu` called as C would: padded and paged caches (shuffled block tables,
//! used lengths 0, 1 and odd, several queries per sequence with causal, GQA and MQA, forced
//! split counts, f32 and bf16) against the f64 reference; `fa_append_kv_cpu` (new tokens in
//! place, then the cache call over the new lengths); bad caches refused with their code and
//! message and the outputs untouched; the CUDA entries' host-side refusals.

mod common;

use common::*;
use core::ffi::c_void;
use core::ptr::{null, null_mut};
use fa_reference::{attention_f64, compare, CacheLayout, DecodeCase, ErrorReport, Rng, Rounding};
use flash_attention_rs::*;
use half::bf16;
use softmax_core::MAX_HEAD_DIM;

const SENTINEL: f32 = 7.0;
const F32_BOUND: f64 = 1e-5;
const BF16_BOUND: f64 = 1e-2;
const LSE_BOUND: f64 = 1e-4;

/// The C descriptors of a decode case: problem, cache, Q/K/V/O tensors (pointing at the
/// given buffers), all contiguous.
fn descriptors(
    case: &DecodeCase,
    dtype: u32,
    buffers: [*mut c_void; 4],
) -> (FaProblem, FaKvCache, [FaTensor; 4]) {
    let (problem, cache, rows) = cache_descriptors(
        case,
        case.seqused_k.as_ptr().cast(),
        case.block_table.as_ptr(),
    );
    (problem, cache, cache_tensors(case, dtype, buffers, rows))
}

/// Calls `fa_forward_cache_cpu` with the descriptors (after `edit`).
fn call(
    problem: &FaProblem,
    cache: &FaKvCache,
    t: &[FaTensor; 4],
    lse: &mut [f32],
    opts: &FaOptions,
) -> i32 {
    // SAFETY: every pointer is a live local or a buffer of the case of the right size (the
    // tests make them bad only in ways the library must refuse).
    unsafe {
        fa_forward_cache_cpu(
            problem,
            cache,
            &t[0],
            &t[1],
            &t[2],
            &t[3],
            lse.as_mut_ptr(),
            opts,
        )
    }
}

/// Runs an f32 case through the C entry (outputs poisoned with NaN) and compares with the
/// f64 oracle on the same inputs.
fn check_f32(case: &DecodeCase, splits: u32) -> ErrorReport {
    let problem = case.desc().validate(MAX_HEAD_DIM).expect("valid case");
    let mut o = vec![f32::NAN; problem.min_buffer_lens().o];
    let mut lse = vec![f32::NAN; problem.lse_len()];
    let ptr = |x: &Vec<f32>| x.as_ptr() as *mut c_void;
    let (p, mut cache, t) = descriptors(
        case,
        FA_DTYPE_F32,
        [
            ptr(&case.q),
            ptr(&case.k),
            ptr(&case.v),
            o.as_mut_ptr().cast(),
        ],
    );
    cache.num_splits = splits;
    let code = call(&p, &cache, &t, &mut lse, &fa_options_default());
    assert_eq!(code, FA_OK, "{}", last_error());
    let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
    compare(&problem, &o, Some(&lse), &oracle)
}

/// Used lengths with 0, 1 and odd ones among them.
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
fn padded_and_paged_caches_match_the_reference() {
    let mut rng = Rng::new(1515);
    for block_size in [1, 5, 16, 64] {
        for (group, heads_kv) in [(1, 2), (4, 2), (8, 1)] {
            let used = lengths(&mut rng, 6, 200);
            for layout in [
                CacheLayout::Padded { capacity: 203 },
                DecodeCase::paged_layout(&used, block_size),
            ] {
                for (sq, causal) in [(1, false), (3, true), (4, false)] {
                    let d = [16, 40, 64][rng.below(3)];
                    let mut case = DecodeCase::new(
                        &mut rng,
                        &used,
                        sq,
                        group * heads_kv,
                        heads_kv,
                        d,
                        layout,
                        Rounding::F32,
                    );
                    if causal {
                        case = case.causal();
                    }
                    for splits in [0, 1, 3] {
                        let rep = check_f32(&case, splits);
                        assert!(
                            rep.within(F32_BOUND, LSE_BOUND),
                            "{layout:?} group {group} sq {sq} causal {causal} d {d} \
                             splits {splits} used {used:?}: {rep:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn the_block_table_is_followed_not_the_block_order() {
    // The case's table is a shuffled permutation; check that the entry really reads through
    // it: the same cache with two used blocks swapped in the table gives the other answer.
    let mut rng = Rng::new(77);
    let used = [40u32, 33];
    let case = DecodeCase::new(
        &mut rng,
        &used,
        2,
        4,
        2,
        32,
        DecodeCase::paged_layout(&used, 8),
        Rounding::F32,
    );
    assert!(check_f32(&case, 0).within(F32_BOUND, LSE_BOUND));
    let mut swapped = case.clone();
    let CacheLayout::Paged { blocks_per_seq, .. } = case.layout else {
        unreachable!()
    };
    swapped.block_table.swap(0, blocks_per_seq + 1);
    let problem = case.desc().validate(MAX_HEAD_DIM).expect("valid");
    let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
    let mut o = vec![f32::NAN; problem.min_buffer_lens().o];
    let mut lse = vec![f32::NAN; problem.lse_len()];
    let ptr = |x: &Vec<f32>| x.as_ptr() as *mut c_void;
    let (p, c, t) = descriptors(
        &swapped,
        FA_DTYPE_F32,
        [
            ptr(&case.q),
            ptr(&case.k),
            ptr(&case.v),
            o.as_mut_ptr().cast(),
        ],
    );
    assert_eq!(call(&p, &c, &t, &mut lse, &fa_options_default()), FA_OK);
    let rep = compare(&problem, &o, Some(&lse), &oracle);
    assert!(
        rep.rel_l2 > 1e-2,
        "a swapped table changed nothing: {rep:?}"
    );
}

#[test]
fn bf16_caches_match_the_reference() {
    let mut rng = Rng::new(1516);
    let used = lengths(&mut rng, 5, 150);
    for layout in [
        CacheLayout::Padded { capacity: 151 },
        DecodeCase::paged_layout(&used, 16),
    ] {
        let case = DecodeCase::new(&mut rng, &used, 2, 8, 2, 64, layout, Rounding::Bf16).causal();
        let problem = case.desc().validate(MAX_HEAD_DIM).expect("valid case");
        let to = |x: &[f32]| -> Vec<bf16> { x.iter().map(|&v| bf16::from_f32(v)).collect() };
        let (q, k, v) = (to(&case.q), to(&case.k), to(&case.v));
        let mut o = vec![bf16::NAN; problem.min_buffer_lens().o];
        let mut lse = vec![f32::NAN; problem.lse_len()];
        let ptr = |x: &Vec<bf16>| x.as_ptr() as *mut c_void;
        let (p, c, t) = descriptors(
            &case,
            FA_DTYPE_BF16,
            [ptr(&q), ptr(&k), ptr(&v), o.as_mut_ptr().cast()],
        );
        assert_eq!(
            call(&p, &c, &t, &mut lse, &fa_options_default()),
            FA_OK,
            "{}",
            last_error()
        );
        let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
        let rep = compare(&problem, &o, Some(&lse), &oracle);
        assert!(rep.within(BF16_BOUND, 1e-2), "{layout:?}: {rep:?}");
    }
}

/// A small paged f32 case, its sentinel-filled outputs, and a way to run it edited.
struct Bad {
    case: DecodeCase,
    o: Vec<f32>,
    lse: Vec<f32>,
}

impl Bad {
    fn new(paged: bool) -> Bad {
        let mut rng = Rng::new(9);
        let used = [5u32, 0, 9];
        let layout = if paged {
            DecodeCase::paged_layout(&used, 4)
        } else {
            CacheLayout::Padded { capacity: 10 }
        };
        let case = DecodeCase::new(&mut rng, &used, 2, 4, 2, 8, layout, Rounding::F32);
        Bad {
            o: vec![SENTINEL; 3 * 2 * 4 * 8],
            lse: vec![SENTINEL; 3 * 4 * 2],
            case,
        }
    }

    fn run(&mut self, edit: impl FnOnce(&mut FaProblem, &mut FaKvCache, &mut FaOptions)) -> i32 {
        let ptr = |x: &Vec<f32>| x.as_ptr() as *mut c_void;
        let (mut p, mut c, t) = descriptors(
            &self.case,
            FA_DTYPE_F32,
            [
                ptr(&self.case.q),
                ptr(&self.case.k),
                ptr(&self.case.v),
                self.o.as_mut_ptr().cast(),
            ],
        );
        let mut opts = fa_options_default();
        edit(&mut p, &mut c, &mut opts);
        call(&p, &c, &t, &mut self.lse, &opts)
    }

    fn untouched(&self) -> bool {
        self.o.iter().chain(&self.lse).all(|&x| x == SENTINEL)
    }
}

/// Asserts a refusal of an edited call: its code, a message containing `words`, outputs
/// untouched.
#[track_caller]
fn refused(
    paged: bool,
    code: i32,
    words: &str,
    edit: impl FnOnce(&mut FaProblem, &mut FaKvCache, &mut FaOptions),
) {
    let mut bad = Bad::new(paged);
    let got = bad.run(edit);
    assert_refused(got, code, words, bad.untouched());
}

#[test]
fn the_bad_input_cases_run_when_unedited() {
    for paged in [false, true] {
        let mut bad = Bad::new(paged);
        assert_eq!(bad.run(|_, _, _| {}), FA_OK, "{}", last_error());
        assert!(bad.o.iter().all(|x| x.is_finite() && *x != SENTINEL));
    }
}

#[test]
fn bad_tables_are_refused_with_outputs_untouched() {
    let used_past = [5i32, 0, 11];
    let negative = [5i32, -1, 9];
    // Padded: a length past the capacity, a negative length, a null table.
    refused(
        false,
        FA_ERR_INVALID_ARGUMENT,
        "KV cache holds",
        |_, c, _| c.seqused_k = used_past.as_ptr(),
    );
    refused(
        false,
        FA_ERR_INVALID_ARGUMENT,
        "seqused_k[1] is -1",
        |_, c, _| c.seqused_k = negative.as_ptr(),
    );
    refused(
        false,
        FA_ERR_INVALID_ARGUMENT,
        "seqused_k is a null",
        |_, c, _| c.seqused_k = null(),
    );
    refused(false, FA_ERR_INVALID_ARGUMENT, "misaligned", |_, c, _| {
        c.seqused_k = (used_past.as_ptr() as usize + 1) as *const i32
    });
    // A padded cache with paged fields set.
    refused(
        false,
        FA_ERR_INVALID_ARGUMENT,
        "block_table is null",
        |_, c, _| c.block_size = 16,
    );
    // Paged: a used block index out of range, negative, a table too short for a length.
    let bad = Bad::new(true);
    let CacheLayout::Paged {
        blocks_per_seq,
        num_blocks,
        ..
    } = bad.case.layout
    else {
        unreachable!()
    };
    let mut table = bad.case.block_table.clone();
    table[2 * blocks_per_seq + 1] = num_blocks as i32;
    refused(
        true,
        FA_ERR_INVALID_ARGUMENT,
        "is outside the cache's",
        |_, c, _| c.block_table = table.as_ptr(),
    );
    let mut table = bad.case.block_table.clone();
    table[0] = -3;
    refused(
        true,
        FA_ERR_INVALID_ARGUMENT,
        "is outside the cache's",
        |_, c, _| c.block_table = table.as_ptr(),
    );
    // Sequence 2 uses 9 keys = 3 blocks of 4: two columns are too few.
    refused(
        true,
        FA_ERR_INVALID_ARGUMENT,
        "KV cache holds",
        |_, c, _| c.blocks_per_seq = 2,
    );
    refused(
        true,
        FA_ERR_INVALID_ARGUMENT,
        "block_size is 0",
        |_, c, _| c.block_size = 0,
    );
    refused(
        true,
        FA_ERR_INVALID_ARGUMENT,
        "num_blocks is -1",
        |_, c, _| c.num_blocks = -1,
    );
    // Fewer blocks than the table names.
    refused(
        true,
        FA_ERR_INVALID_ARGUMENT,
        "is outside the cache's",
        |_, c, _| c.num_blocks = 2,
    );
}

#[test]
fn bad_descriptors_are_refused_with_outputs_untouched() {
    // Versioned like FaOptions: a newer layout or version, a too-small size, version 1.
    refused(true, FA_ERR_VERSION, "newer header", |_, c, _| c.size += 8);
    refused(true, FA_ERR_INVALID_ARGUMENT, "too small", |_, c, _| {
        c.size = 8
    });
    refused(true, FA_ERR_VERSION, "cache.version is 1", |_, c, _| {
        c.version = 1
    });
    refused(true, FA_ERR_VERSION, "cache.version", |_, c, _| {
        c.version = FA_API_VERSION + 1
    });
    // A cache takes a fixed-length batch.
    refused(
        false,
        FA_ERR_INVALID_ARGUMENT,
        "FA_SEQLENS_FIXED",
        |p, _, _| p.seqlens = FA_SEQLENS_VARLEN_HOST,
    );
    // A shape the tables do not fit: more sequences than seqused_k holds cannot be detected
    // in C, but a negative batch can.
    refused(false, FA_ERR_INVALID_ARGUMENT, "negative", |p, _, _| {
        p.batch = -1
    });
    let mut bad = Bad::new(false);
    // SAFETY: a null cache is refused before anything is read.
    let code = unsafe {
        let t = [bshd(null_mut(), FA_DTYPE_F32, 1, 1, 8); 4];
        let p = FaProblem::dense(1, 1, 1, 1, 1, 8);
        fa_forward_cache_cpu(&p, null(), &t[0], &t[1], &t[2], &t[3], null_mut(), null())
    };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("cache is a null"), "{}", last_error());
    assert!(bad.untouched());
    assert_eq!(bad.run(|_, _, _| {}), FA_OK);
}

#[test]
fn cuda_cache_entries_refuse_bad_handles() {
    let p = FaProblem::dense(1, 1, 4, 2, 2, 64);
    let t = bshd(16 as *mut c_void, FA_DTYPE_BF16, 4, 2, 64);
    let cache = FaKvCache::default();
    // SAFETY: a null device is refused before anything else is read.
    let code = unsafe {
        fa_forward_cache_cuda(
            null(),
            &p,
            &cache,
            &t,
            &t,
            &t,
            &t,
            null_mut(),
            null_mut(),
            0,
            null_mut(),
            null(),
        )
    };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("device"), "{}", last_error());
    let mut bytes = 0usize;
    // SAFETY: as above.
    let code = unsafe {
        fa_forward_cache_cuda_workspace_bytes(
            null(),
            &p,
            &cache,
            &t,
            &t,
            &t,
            &t,
            null(),
            &mut bytes,
        )
    };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
}

/// The descriptors of an append of the f32 tokens `k_new`, `v_new` (`new` per sequence) to the
/// host caches `k`, `v` of `case` (`rows` per sequence or block).
fn host_append(
    case: &DecodeCase,
    [k_new, v_new]: [&[f32]; 2],
    [k, v]: [&mut [f32]; 2],
    new: usize,
    rows: usize,
) -> [FaTensor; 4] {
    let ptr = |x: &[f32]| x.as_ptr() as *mut c_void;
    let (k, v) = (k.as_mut_ptr().cast(), v.as_mut_ptr().cast());
    append_tensors(
        case,
        FA_DTYPE_F32,
        [ptr(k_new), ptr(v_new), k, v],
        new,
        rows,
    )
}

/// Calls `fa_append_kv_cpu`.
fn append(p: &FaProblem, cache: &FaKvCache, t: &[FaTensor; 4]) -> i32 {
    // SAFETY: every pointer is a live local or a buffer of the case of the right size (the
    // tests make them bad only in ways the library must refuse).
    unsafe { fa_append_kv_cpu(p, cache, &t[0], &t[1], &t[2], &t[3]) }
}

#[test]
fn append_in_place_then_the_cache_call_matches_the_reference() {
    let mut rng = Rng::new(1516);
    let new = 3;
    for block_size in [0, 1, 7, 16] {
        let (hq, hk, d) = (8, 2, 40);
        // The case's lengths count the new tokens; the append starts at `used − new`.
        let after = [new as u32, 4, 99, 203, 17];
        let before: Vec<u32> = after.iter().map(|&u| u - new as u32).collect();
        let layout = match block_size {
            0 => CacheLayout::Padded { capacity: 210 },
            bs => DecodeCase::paged_layout(&after, bs),
        };
        let mut case =
            DecodeCase::new(&mut rng, &after, new, hq, hk, d, layout, Rounding::F32).causal();
        let k_new: Vec<f32> = (0..5 * new * hk * d).map(|_| rng.normal() as f32).collect();
        let v_new: Vec<f32> = (0..5 * new * hk * d).map(|_| rng.normal() as f32).collect();
        let (k_want, v_want) = appended(&case, new, &k_new, &v_new);
        let (mut k, mut v) = (case.k.clone(), case.v.clone());
        let (p, cache, rows) =
            cache_descriptors(&case, before.as_ptr().cast(), case.block_table.as_ptr());
        let t = host_append(&case, [&k_new, &v_new], [&mut k, &mut v], new, rows);
        assert_eq!(append(&p, &cache, &t), FA_OK, "{}", last_error());
        assert!(
            k == k_want && v == v_want,
            "block size {block_size}: the append"
        );
        // The cache call over the new lengths sees the new tokens.
        (case.k, case.v) = (k, v);
        let report = check_f32(&case, 0);
        assert!(
            report.within(F32_BOUND, LSE_BOUND),
            "block size {block_size}: {report:?}"
        );
    }
}

#[test]
fn append_refusals_leave_the_cache_untouched() {
    let mut rng = Rng::new(1517);
    let after = [5u32, 9];
    let case = DecodeCase::new(
        &mut rng,
        &after,
        2,
        4,
        2,
        16,
        DecodeCase::paged_layout(&after, 4),
        Rounding::F32,
    );
    let new: Vec<f32> = (0..2 * 2 * 2 * 16).map(|_| rng.normal() as f32).collect();
    let (mut k, mut v) = (case.k.clone(), case.v.clone());
    let before = [3i32, 7];
    let (p, cache, rows) = cache_descriptors(&case, before.as_ptr(), case.block_table.as_ptr());
    let t = host_append(&case, [&new, &new], [&mut k, &mut v], 2, rows);
    // No room: sequence 1 would end at 17 keys; its table row holds 4 blocks of 4.
    let long = [3i32, 15];
    let c = FaKvCache {
        seqused_k: long.as_ptr(),
        ..cache
    };
    assert_eq!(append(&p, &c, &t), FA_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("holds 16"), "{}", last_error());
    // A block index outside the cache at a new position.
    let mut table = case.block_table.clone();
    table[1] = 10_000;
    let c = FaKvCache {
        block_table: table.as_ptr(),
        ..cache
    };
    assert_eq!(append(&p, &c, &t), FA_ERR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("outside the cache"),
        "{}",
        last_error()
    );
    // The new tokens overlap the cache.
    let mut bad = t;
    bad[0].data = t[2].data;
    assert_eq!(append(&p, &cache, &bad), FA_ERR_INVALID_ARGUMENT);
    // Mixed dtypes.
    let mut bad = t;
    bad[1].dtype = FA_DTYPE_BF16;
    assert_eq!(append(&p, &cache, &bad), FA_ERR_UNSUPPORTED);
    assert!(
        k == case.k && v == case.v,
        "a refused append wrote the cache"
    );
    // And the same call, valid, does write.
    assert_eq!(append(&p, &cache, &t), FA_OK, "{}", last_error());
    assert!(k != case.k);
}
