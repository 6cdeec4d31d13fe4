//! `fa_block_walk` (API version 4) called as C would: random shuffled tables of several block
//! sizes with used lengths 0, 1, partial and full, against an expectation computed here
//! (sort each sequence's used blocks by physical index, with their logical indices); bad
//! inputs refused with `walk_out` untouched; and `FaKvCache::block_walk` on the host entries:
//! refused by `fa_forward_cache_cpu` and for padded caches, not read by the appends, and a
//! version-2/3-sized descriptor still accepted.

mod common;

use common::*;
use core::ffi::c_void;
use core::ptr::{null, null_mut};
use fa_reference::{attention_f64, compare, CacheLayout, DecodeCase, Rng, Rounding};
use flash_attention_rs::*;

const POISON: i32 = 0x5eed_5eed;

/// Calls `fa_block_walk` on host slices into `out` (its whole length).
fn build(
    used: &[i32],
    table: &[i32],
    batch: i64,
    blocks_per_seq: i64,
    block_size: i64,
    num_blocks: i64,
    out: &mut [i32],
) -> i32 {
    // SAFETY: live slices of the stated lengths (the tests make sizes wrong only in ways the
    // library must refuse before reading past them).
    unsafe {
        fa_block_walk(
            used.as_ptr(),
            table.as_ptr(),
            batch,
            blocks_per_seq,
            block_size,
            num_blocks,
            out.as_mut_ptr(),
            out.len(),
        )
    }
}

/// The walk as its definition states it, written independently of the library: per
/// sequence, the `(physical, logical)` pairs of its used blocks sorted (by physical index,
/// then logical: a block named twice keeps both places), physical indices in the first plane,
/// logical in the second, zeros after.
fn expected(used: &[i32], table: &[i32], bps: usize, block_size: usize) -> Vec<i32> {
    let mut walk = vec![0i32; used.len() * 2 * bps];
    for (b, &u) in used.iter().enumerate() {
        let blocks = (u as usize).div_ceil(block_size);
        let mut pairs: Vec<(i32, i32)> = (0..blocks)
            .map(|l| (table[b * bps + l], l as i32))
            .collect();
        pairs.sort();
        for (j, (phys, logical)) in pairs.into_iter().enumerate() {
            walk[b * 2 * bps + j] = phys;
            walk[b * 2 * bps + bps + j] = logical;
        }
    }
    walk
}

/// A random paged cache's tables: lengths 0, 1, a partial last block and full blocks among
/// them (and the capacity exactly), each sequence's used blocks drawn from a shuffled pool
/// (some sequences share blocks, as prefix caching does), unused entries −1 or noise.
fn random_tables(
    rng: &mut Rng,
    batch: usize,
    bps: usize,
    block_size: usize,
) -> (Vec<i32>, Vec<i32>, usize) {
    let capacity = bps * block_size;
    let used: Vec<i32> = (0..batch)
        .map(|b| match b % 6 {
            0 => 0,
            1 => 1,
            2 => capacity as i32,
            3 => (block_size * (1 + rng.below(bps))) as i32,
            _ => rng.below(capacity + 1) as i32,
        })
        .collect();
    let num_blocks = batch * bps / 2 + 3;
    let mut pool: Vec<i32> = (0..num_blocks as i32).collect();
    let mut table = vec![-1i32; batch * bps];
    for (b, &u) in used.iter().enumerate() {
        for i in (1..pool.len()).rev() {
            pool.swap(i, rng.below(i + 1));
        }
        let blocks = (u as usize).div_ceil(block_size);
        for slot in 0..bps {
            table[b * bps + slot] = if slot < blocks {
                pool[slot % pool.len()]
            } else if rng.below(2) == 0 {
                -1
            } else {
                (num_blocks + rng.below(1000)) as i32 // never read
            };
        }
    }
    (used, table, num_blocks)
}

#[test]
fn random_tables_walk_as_their_definition() {
    let mut rng = Rng::new(4242);
    for block_size in [1usize, 5, 8, 16, 64, 256] {
        for (batch, bps) in [(1, 1), (6, 3), (13, 9), (4, 40)] {
            let (used, table, num_blocks) = random_tables(&mut rng, batch, bps, block_size);
            let want = expected(&used, &table, bps, block_size);
            // Poisoned, and longer than the walk: the tail must stay as it was.
            let mut out = vec![POISON; want.len() + 5];
            let code = build(
                &used,
                &table,
                batch as i64,
                bps as i64,
                block_size as i64,
                num_blocks as i64,
                &mut out,
            );
            assert_eq!(code, FA_OK, "{}", last_error());
            assert_eq!(
                out[..want.len()],
                want[..],
                "block size {block_size} batch {batch} bps {bps} used {used:?}"
            );
            assert!(out[want.len()..].iter().all(|&x| x == POISON));
            // And what fa-cuda's own builder makes of the same problem.
            let used_u: Vec<u32> = used.iter().map(|&u| u as u32).collect();
            let problem = softmax_core::ProblemDesc::new(batch, 1, 0, 2, 1, 8)
                .paged_cache(&used_u, &table, bps, block_size, num_blocks)
                .validate(256)
                .expect("valid tables");
            assert_eq!(fa_cuda::block_walk(&problem).expect("paged"), want);
        }
    }
}

#[test]
fn the_decode_cases_tables_walk_too() {
    // fa-reference's decode cases (one permutation of the pool, −1 past the used blocks).
    let mut rng = Rng::new(43);
    let used = [0u32, 1, 77, 300, 129, 64];
    for block_size in [16, 64] {
        let layout = DecodeCase::paged_layout(&used, block_size);
        let case = DecodeCase::new(&mut rng, &used, 1, 2, 1, 8, layout, Rounding::F32);
        let CacheLayout::Paged {
            blocks_per_seq,
            num_blocks,
            ..
        } = case.layout
        else {
            unreachable!()
        };
        let used_i: Vec<i32> = used.iter().map(|&u| u as i32).collect();
        let mut out = vec![POISON; used.len() * 2 * blocks_per_seq];
        let code = build(
            &used_i,
            &case.block_table,
            used.len() as i64,
            blocks_per_seq as i64,
            block_size as i64,
            num_blocks as i64,
            &mut out,
        );
        assert_eq!(code, FA_OK, "{}", last_error());
        assert_eq!(
            out,
            expected(&used_i, &case.block_table, blocks_per_seq, block_size)
        );
    }
}

#[test]
fn bad_inputs_leave_the_walk_untouched() {
    // Three sequences of up to 3 blocks of 4 keys; 5 blocks in the pool.
    let used = [5i32, 0, 9];
    // Sequence 0 names block 3 twice (both places are walked).
    let table = [3, 3, -1, 9, 9, 9, 0, 4, 2];
    let (batch, bps, bs, nb) = (3i64, 3i64, 4i64, 5i64);
    let mut ok = vec![POISON; 18];
    assert_eq!(
        build(&used, &table, batch, bps, bs, nb, &mut ok),
        FA_OK,
        "{}",
        last_error()
    );
    assert_eq!(ok, expected(&used, &table, 3, 4));
    let refused = |code: i32, words: &str, out: &[i32]| {
        assert_refused(
            code,
            FA_ERR_INVALID_ARGUMENT,
            words,
            out.iter().all(|&x| x == POISON),
        );
    };
    let mut out = vec![POISON; 18];
    // A length past the capacity (3 blocks of 4), a negative length.
    let code = build(&[5, 0, 13], &table, batch, bps, bs, nb, &mut out);
    refused(code, "uses 13 keys but the KV cache holds 12", &out);
    let code = build(&[5, -1, 9], &table, batch, bps, bs, nb, &mut out);
    refused(code, "seqused_k[1] is -1", &out);
    // A used block index out of range, negative; a pool too small for the table.
    let mut bad = table;
    bad[8] = 5;
    let code = build(&used, &bad, batch, bps, bs, nb, &mut out);
    refused(
        code,
        "block_table[2][2] = 5 is outside the cache's 5 blocks",
        &out,
    );
    bad[8] = -2;
    let code = build(&used, &bad, batch, bps, bs, nb, &mut out);
    refused(code, "is outside the cache's", &out);
    let code = build(&used, &table, batch, bps, bs, 4, &mut out);
    refused(code, "is outside the cache's 4 blocks", &out);
    // A table too short for a length: two columns hold 8 keys, sequence 2 uses 9.
    let code = build(&used, &table, batch, 2, bs, nb, &mut out);
    refused(code, "the KV cache holds 8", &out);
    // Sizes: negative, zero block size and batch, a walk too short.
    let code = build(&used, &table, -1, bps, bs, nb, &mut out);
    refused(code, "batch is -1", &out);
    let code = build(&used, &table, batch, -3, bs, nb, &mut out);
    refused(code, "blocks_per_seq is -3", &out);
    let code = build(&used, &table, batch, bps, 0, nb, &mut out);
    refused(code, "block_size is 0", &out);
    let code = build(&used, &table, batch, bps, bs, -1, &mut out);
    refused(code, "num_blocks is -1", &out);
    let code = build(&used, &table, 0, bps, bs, nb, &mut out);
    refused(code, "batch is 0", &out);
    let code = build(&used, &table, batch, bps, bs, nb, &mut out[..17]);
    refused(code, "walk_len is 17", &out);
    let code = build(&used, &table, batch, i64::MAX, bs, nb, &mut out);
    refused(code, "overflows", &out);
    // Null and misaligned arrays.
    // SAFETY: each bad pointer is refused before anything is read or written.
    unsafe {
        let code = fa_block_walk(
            null(),
            table.as_ptr(),
            batch,
            bps,
            bs,
            nb,
            out.as_mut_ptr(),
            18,
        );
        refused(code, "seqused_k is a null pointer", &out);
        let code = fa_block_walk(
            used.as_ptr(),
            null(),
            batch,
            bps,
            bs,
            nb,
            out.as_mut_ptr(),
            18,
        );
        refused(code, "block_table is a null pointer", &out);
        let code = fa_block_walk(
            used.as_ptr(),
            table.as_ptr(),
            batch,
            bps,
            bs,
            nb,
            null_mut(),
            18,
        );
        assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
        assert!(
            last_error().contains("walk is a null pointer"),
            "{}",
            last_error()
        );
        let odd = (used.as_ptr() as usize + 2) as *const i32;
        let code = fa_block_walk(
            odd,
            table.as_ptr(),
            batch,
            bps,
            bs,
            nb,
            out.as_mut_ptr(),
            18,
        );
        refused(code, "seqused_k is misaligned", &out);
    }
    // A walk over its own tables.
    let mut both = vec![0i32; 3 + 9 + 18];
    both[..3].copy_from_slice(&used);
    both[3..12].copy_from_slice(&table);
    let snapshot = both.clone();
    let base = both.as_mut_ptr();
    // SAFETY: three ranges of one live buffer; the overlap is refused before anything is
    // read or written.
    let code = unsafe { fa_block_walk(base, base.add(3), batch, bps, bs, nb, base.add(10), 18) };
    assert_refused(
        code,
        FA_ERR_INVALID_ARGUMENT,
        "block_table and walk overlap",
        both == snapshot,
    );
    // An empty table (no block per sequence) may be null, and so may the empty walk.
    // SAFETY: nothing is read from or written to the null arrays of no element.
    let code = unsafe { fa_block_walk([0, 0].as_ptr(), null(), 2, 0, 16, 0, null_mut(), 0) };
    assert_eq!(code, FA_OK, "{}", last_error());
}

// ----- FaKvCache::block_walk on the host entries -----

/// A small paged (or padded) f32 decode case, run through `fa_forward_cache_cpu` after `edit`
/// with sentinel-filled outputs; returns the code, whether the outputs were left untouched,
/// and the output's report against the f64 reference.
fn run_cpu(
    paged: bool,
    edit: impl FnOnce(&mut FaKvCache),
) -> (i32, bool, fa_reference::ErrorReport) {
    let mut rng = Rng::new(9);
    let used = [5u32, 0, 17];
    let layout = if paged {
        DecodeCase::paged_layout(&used, 4)
    } else {
        CacheLayout::Padded { capacity: 18 }
    };
    let case = DecodeCase::new(&mut rng, &used, 2, 4, 2, 8, layout, Rounding::F32);
    let problem = case.desc().validate(256).expect("valid");
    let mut o = vec![7.0f32; problem.min_buffer_lens().o];
    let mut lse = vec![7.0f32; problem.lse_len()];
    let ptr = |x: &Vec<f32>| x.as_ptr() as *mut c_void;
    let (p, mut cache, rows) = cache_descriptors(
        &case,
        case.seqused_k.as_ptr().cast(),
        case.block_table.as_ptr(),
    );
    let t = cache_tensors(
        &case,
        FA_DTYPE_F32,
        [
            ptr(&case.q),
            ptr(&case.k),
            ptr(&case.v),
            o.as_mut_ptr().cast(),
        ],
        rows,
    );
    edit(&mut cache);
    // SAFETY: every pointer is a live local or a buffer of the case of the right size; a
    // walk past the descriptor's size is never read, one inside it is refused unread.
    let code = unsafe {
        fa_forward_cache_cpu(
            &p,
            &cache,
            &t[0],
            &t[1],
            &t[2],
            &t[3],
            lse.as_mut_ptr(),
            null(),
        )
    };
    let untouched = o.iter().chain(&lse).all(|&x| x == 7.0);
    let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
    (code, untouched, compare(&problem, &o, Some(&lse), &oracle))
}

#[test]
fn the_cpu_cache_call_refuses_a_walk() {
    // A walk is never dereferenced on the host: any non-null address is refused.
    let walk = [0i32; 64];
    for paged in [true, false] {
        let (code, untouched, _) = run_cpu(paged, |c| c.block_walk = walk.as_ptr());
        let words = if paged {
            "fa_forward_cache_cpu reads no block walk"
        } else {
            "a padded cache has no blocks to walk"
        };
        assert_refused(code, FA_ERR_INVALID_ARGUMENT, words, untouched);
        let (code, _, report) = run_cpu(paged, |_| {});
        assert_eq!(code, FA_OK, "{}", last_error());
        assert!(report.within(1e-5, 1e-4), "{report:?}");
    }
}

#[test]
fn caches_of_api_versions_2_and_3_are_still_accepted() {
    // A header of version 2 or 3 knows no `block_walk`: its FaKvCache ends before it, and
    // whatever lies past `size` (here a dangling address) is never read.
    let old_size = core::mem::offset_of!(FaKvCache, block_walk) as u32;
    assert_eq!(
        old_size as usize + core::mem::size_of::<*const i32>(),
        core::mem::size_of::<FaKvCache>()
    );
    for version in [2, 3] {
        for paged in [true, false] {
            let (code, _, report) = run_cpu(paged, |c| {
                c.size = old_size;
                c.version = version;
                c.block_walk = core::ptr::dangling();
            });
            assert_eq!(code, FA_OK, "version {version}: {}", last_error());
            assert!(report.within(1e-5, 1e-4), "version {version}: {report:?}");
        }
    }
    // Version 4's full size reads the walk (and the CPU call refuses it).
    let (code, untouched, _) = run_cpu(true, |c| {
        c.version = 4;
        c.block_walk = core::ptr::dangling();
    });
    assert_refused(code, FA_ERR_INVALID_ARGUMENT, "block_walk", untouched);
    // Later versions keep reading version 4's descriptors as above.
    const { assert!(FA_API_VERSION >= 4) };
    assert_eq!(fa_api_version(), FA_API_VERSION);
}

#[test]
fn the_appends_do_not_read_a_paged_caches_walk() {
    let mut rng = Rng::new(1518);
    let after = [5u32, 9];
    let new = 2;
    for paged in [true, false] {
        let layout = if paged {
            DecodeCase::paged_layout(&after, 4)
        } else {
            CacheLayout::Padded { capacity: 12 }
        };
        let case = DecodeCase::new(&mut rng, &after, new, 4, 2, 16, layout, Rounding::F32);
        let tokens: Vec<f32> = (0..2 * new * 2 * 16).map(|_| rng.normal() as f32).collect();
        let (k_want, v_want) = appended(&case, new, &tokens, &tokens);
        let (mut k, mut v) = (case.k.clone(), case.v.clone());
        let before = [3i32, 7];
        let (p, mut cache, rows) =
            cache_descriptors(&case, before.as_ptr(), case.block_table.as_ptr());
        // A walk address that would fault if it were read.
        cache.block_walk = core::ptr::dangling();
        let ptr = |x: &[f32]| x.as_ptr() as *mut c_void;
        let t = append_tensors(
            &case,
            FA_DTYPE_F32,
            [
                ptr(&tokens),
                ptr(&tokens),
                k.as_mut_ptr().cast(),
                v.as_mut_ptr().cast(),
            ],
            new,
            rows,
        );
        // SAFETY: live buffers of the case's sizes; the walk is not read (or refused).
        let code = unsafe { fa_append_kv_cpu(&p, &cache, &t[0], &t[1], &t[2], &t[3]) };
        if paged {
            assert_eq!(code, FA_OK, "{}", last_error());
            assert!(k == k_want && v == v_want, "the append");
        } else {
            assert_refused(
                code,
                FA_ERR_INVALID_ARGUMENT,
                "a padded cache has no blocks to walk",
                k == case.k && v == case.v,
            );
        }
    }
}
