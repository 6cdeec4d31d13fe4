//! Shared helpers of the fa-capi tests: descriptors for contiguous BSHD buffers.

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

/// A dense problem, no mask, default scale.
pub fn dense(batch: i64, sq: i64, sk: i64, hq: i64, hkv: i64, d: i64) -> FaProblem {
    FaProblem {
        batch,
        seqlen_q: sq,
        seqlen_k: sk,
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
        head_dim_v: 0,
        seqlens: FA_SEQLENS_FIXED,
        causal: 0,
        cu_seqlens_q: core::ptr::null(),
        cu_seqlens_k: core::ptr::null(),
        total_q: 0,
        total_k: 0,
        max_seqlen_q: 0,
        max_seqlen_k: 0,
        window_left: -1,
        window_right: -1,
        softmax_scale: 0.0,
        softcap: 0.0,
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
    let mut problem = dense(
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
