//! Shared helpers of the fa-capi tests: descriptors of contiguous BSHD buffers and of decode
//! cases (cache, forward and append), the last error message, a refusal check.

#![allow(dead_code)]

use core::ffi::c_void;
use flash_attention_rs::*;

/// A contiguous BSHD descriptor (`seqlen` tokens per batch entry).
pub fn bshd(
    data: *mut c_void,
    dtype: u32,
    seqlen: usize,
    heads: usize,
    head_dim: usize,
) -> FaTensor {
    FaTensor {
        data,
        dtype,
        stride_batch: (seqlen * heads * head_dim) as i64,
        stride_seq: (heads * head_dim) as i64,
        stride_head: head_dim as i64,
    }
}

/// This thread's last error message.
pub fn last_error() -> String {
    // SAFETY: the library returns a NUL-terminated string, valid until the next call.
    unsafe { std::ffi::CStr::from_ptr(fa_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// The problem and cache descriptors of a decode case, its tables at `seqused_k` and
/// `block_table` (host arrays for the CPU entries, device copies for CUDA; the table is only
/// used for a paged layout), and the rows of one K/V sequence or block (the `seqlen` of the
/// K/V descriptors).
pub fn cache_descriptors(
    case: &fa_reference::DecodeCase,
    seqused_k: *const i32,
    block_table: *const i32,
) -> (FaProblem, FaKvCache, usize) {
    let mut problem = FaProblem::dense(
        case.batch as i64,
        case.seqlen_q as i64,
        0,
        case.heads_q as i64,
        case.heads_kv as i64,
        case.head_dim as i64,
    );
    problem.causal = u32::from(case.mask.right == Some(0));
    let mut cache = FaKvCache {
        seqused_k,
        ..FaKvCache::default()
    };
    let rows = match case.layout {
        fa_reference::CacheLayout::Padded { capacity } => {
            problem.seqlen_k = capacity as i64;
            capacity
        }
        fa_reference::CacheLayout::Paged {
            block_size,
            blocks_per_seq,
            num_blocks,
        } => {
            cache.block_table = block_table;
            cache.blocks_per_seq = blocks_per_seq as i64;
            cache.block_size = block_size as i64;
            cache.num_blocks = num_blocks as i64;
            // Ignored for a paged cache: a value that would be wrong if it were read.
            problem.seqlen_k = 12345;
            block_size
        }
    };
    (problem, cache, rows)
}

/// A decode case's K and V caches with `new` tokens per sequence written by the test itself at
/// positions `seqused_k[b] − new ..` (the case's lengths count them), from `k_new`/`v_new`
/// `[batch, new, heads_kv, head_dim]`: what an append at lengths `seqused_k − new` must leave.
pub fn appended(
    case: &fa_reference::DecodeCase,
    new: usize,
    k_new: &[f32],
    v_new: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let (mut k, mut v) = (case.k.clone(), case.v.clone());
    let d = case.head_dim;
    for b in 0..case.batch {
        let start = case.seqused_k[b] as usize - new;
        for i in 0..new {
            for h in 0..case.heads_kv {
                let (at, _) = case.cache_row(b, start + i, h);
                let src = ((b * new + i) * case.heads_kv + h) * d;
                k[at..at + d].copy_from_slice(&k_new[src..src + d]);
                v[at..at + d].copy_from_slice(&v_new[src..src + d]);
            }
        }
    }
    (k, v)
}

/// The Q, K, V and O descriptors of a decode case (contiguous) over the given buffers: K and V
/// of `rows` per sequence or block (what [`cache_descriptors`] returns).
pub fn cache_tensors(
    case: &fa_reference::DecodeCase,
    dtype: u32,
    [q, k, v, o]: [*mut c_void; 4],
    rows: usize,
) -> [FaTensor; 4] {
    let (sq, hq, hk, d) = (case.seqlen_q, case.heads_q, case.heads_kv, case.head_dim);
    [
        bshd(q, dtype, sq, hq, d),
        bshd(k, dtype, rows, hk, d),
        bshd(v, dtype, rows, hk, d),
        bshd(o, dtype, sq, hq, d),
    ]
}

/// The descriptors of an append to a decode case's cache (contiguous), in the entries' order:
/// the new K and V tokens (`new` per sequence), then the K and V caches (`rows` per sequence or
/// block, as [`cache_descriptors`] returns).
pub fn append_tensors(
    case: &fa_reference::DecodeCase,
    dtype: u32,
    [k_new, v_new, k, v]: [*mut c_void; 4],
    new: usize,
    rows: usize,
) -> [FaTensor; 4] {
    let (hk, d) = (case.heads_kv, case.head_dim);
    [
        bshd(k_new, dtype, new, hk, d),
        bshd(v_new, dtype, new, hk, d),
        bshd(k, dtype, rows, hk, d),
        bshd(v, dtype, rows, hk, d),
    ]
}

/// Asserts a refused call: its code `got` is `code`, the message contains `words`, and the
/// outputs were left `untouched`.
#[track_caller]
pub fn assert_refused(got: i32, code: i32, words: &str, untouched: bool) {
    let message = last_error();
    assert_eq!(got, code, "message: {message}");
    assert!(message.contains(words), "{message:?} lacks {words:?}");
    assert!(untouched, "outputs written on error ({message})");
}
