//! A small, versioned C ABI over `flash-attention`: exact attention forward on host memory
//! (`fa_forward_cpu`, the SIMD CPU kernel) and on caller-owned CUDA memory queued on the
//! caller's stream (`fa_forward_cuda`, no synchronisation), with the log-sum-exp out; and the
//! same against a KV cache (decode: `FaKvCache`, padded or paged, per-sequence used lengths)
//! with `fa_forward_cache_cpu` (host tables, every entry checked) and `fa_forward_cache_cuda`
//! (device tables never read by the host: planned by capacity, clamped by the kernels; the
//! split workspace from the caller, sized by `fa_forward_cache_cuda_workspace_bytes`, or
//! allocated on the stream); new tokens go into a cache in place with `fa_append_kv_cpu` /
//! `fa_append_kv_cuda` (API version 3); a paged cache's block walk (`FaKvCache::block_walk`,
//! the order `fa_forward_cache_cuda` reads the blocks in) is built on the host by
//! `fa_block_walk` (API version 4); the gradients of a host forward come from
//! `fa_backward_cpu` (API version 6), and of a device forward from `fa_backward_cuda` on the
//! caller's memory and stream, its workspace sized by `fa_backward_cuda_workspace_bytes`
//! (API version 7).
//!
//! The header is `include/flash_attention_rs.h`, generated from this crate by cbindgen (the
//! test `header_is_current` fails when it is stale; `FA_CAPI_BLESS=1 cargo test -p fa-capi`
//! rewrites it). The library builds as `libflash_attention_rs.{a,so}`.
//!
//! Rules at the boundary:
//! - every function returns an `FA_*` code (`FA_OK` = 0) and leaves a message for
//!   `fa_last_error_message()` (thread-local, valid until the next call on that thread);
//! - no panic crosses into C: each body runs under `catch_unwind` (`FA_ERR_PANIC`);
//! - enums are plain integers, checked when read; sizes are signed and checked; the elements
//!   each tensor spans are computed from the validated problem and its strides (overflow is
//!   an error), then null, misaligned, overflowing and overlapping buffers are refused
//!   before anything is written or queued;
//! - `FaOptions` and `FaKvCache` start with their size and the API version: older layouts
//!   are read as far as they go, newer ones refused (`FA_ERR_VERSION`); a new capability is
//!   a new field at the end or a new descriptor and function (API version 2 added the KV
//!   cache, 3 the append entries, 4 the cache's block walk and its builder), never a changed
//!   layout.
//!
//! `unsafe` lives in small named functions (`convert::read_struct`, `slice_ref`, …), each
//! with the contract it relies on; the entry points' own contracts are in their docs.
//!
//! # Example
//! The CPU forward called through the ABI from Rust (a C caller does the same through the
//! header): contiguous BSHD f32, 2 queries over 3 keys, causal (bottom-right), with the LSE.
//! ```
//! use core::ffi::c_void;
//! use flash_attention_rs::*;
//!
//! let problem = FaProblem { causal: 1, ..FaProblem::dense(1, 2, 3, 1, 1, 4) };
//! let bshd = |data: *mut f32, seqlen: i64| FaTensor {
//!     data: data.cast::<c_void>(),
//!     dtype: FA_DTYPE_F32,
//!     stride_batch: seqlen * 4,
//!     stride_seq: 4,
//!     stride_head: 4,
//! };
//! let mut q = [0.5f32; 2 * 4];
//! let mut k = [1.0f32; 3 * 4];
//! let mut v: Vec<f32> = (0..3 * 4).map(|i| i as f32).collect();
//! let mut o = [0.0f32; 2 * 4];
//! let mut lse = [0.0f32; 2];
//! let (tq, tk) = (bshd(q.as_mut_ptr(), 2), bshd(k.as_mut_ptr(), 3));
//! let (tv, to) = (bshd(v.as_mut_ptr(), 3), bshd(o.as_mut_ptr(), 2));
//! let opts = fa_options_default();
//! // SAFETY: each descriptor points to a live buffer holding what the problem and its
//! // strides reach; `lse` holds batch · heads_q · seqlen_q floats.
//! let rc = unsafe { fa_forward_cpu(&problem, &tq, &tk, &tv, &to, lse.as_mut_ptr(), &opts) };
//! assert_eq!(rc, FA_OK, "{:?}", unsafe { core::ffi::CStr::from_ptr(fa_last_error_message()) });
//! // Every key scores the same (0.5 · 4 / sqrt(4) = 1), so each row averages the V rows it
//! // sees: query 0 keys 0..=1, query 1 keys 0..=2.
//! for j in 0..4 {
//!     assert!((o[j] - (j as f32 + 2.0)).abs() < 1e-4);
//!     assert!((o[4 + j] - (j as f32 + 4.0)).abs() < 1e-4);
//! }
//! assert!((lse[0] - (1.0 + 2f32.ln())).abs() < 1e-3);
//! assert!((lse[1] - (1.0 + 3f32.ln())).abs() < 1e-3);
//! ```

mod convert;
mod cpu;
mod cuda;
mod error;
mod types;
mod walk;

pub use cpu::{fa_append_kv_cpu, fa_backward_cpu, fa_forward_cache_cpu, fa_forward_cpu};
pub use cuda::{
    fa_append_kv_cuda, fa_backward_cuda, fa_backward_cuda_workspace_bytes, fa_cuda_device_create,
    fa_cuda_device_create_from_context, fa_cuda_device_destroy, fa_forward_cache_cuda,
    fa_forward_cache_cuda_workspace_bytes, fa_forward_cuda,
};
pub use types::*;
pub use walk::fa_block_walk;

use core::ffi::c_char;

/// The library's version (`MAJOR.MINOR.PATCH`), a static NUL-terminated string.
#[no_mangle]
pub extern "C" fn fa_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The C API version this library implements (`FA_API_VERSION` of its header).
#[no_mangle]
pub extern "C" fn fa_api_version() -> u32 {
    FA_API_VERSION
}

/// Options with every default, `size` and `version` filled in (as `FA_OPTIONS_INIT`).
#[no_mangle]
pub extern "C" fn fa_options_default() -> FaOptions {
    FaOptions::default()
}

/// The message of the last failed call on this thread (empty after a success), NUL-terminated
/// and never null; valid until the next call into this library on this thread.
#[no_mangle]
pub extern "C" fn fa_last_error_message() -> *const c_char {
    error::last_error_ptr()
}
