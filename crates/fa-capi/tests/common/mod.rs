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
