//! The C-visible data: constants (API version, error codes, dtypes, sequence kinds) and the
//! `#[repr(C)]` descriptors. Plain integers stand for C enums, so that no value a C caller
//! writes can be an invalid Rust enum: every field is checked when it is read.

use core::ffi::c_void;

/// The version of this C API. It grows when a descriptor or the options gain fields, or a
/// descriptor or entry point is added; a caller passes the version it was compiled against in
/// [`FaOptions::version`] (and [`FaKvCache::version`]). Version 1: the forward entries;
/// version 2 adds [`FaKvCache`] and the KV-cache entries (`fa_forward_cache_cpu`,
/// `fa_forward_cache_cuda`, `fa_forward_cache_cuda_workspace_bytes`); version 3 adds the
/// in-place appends `fa_append_kv_cpu` and `fa_append_kv_cuda` (no descriptor changed);
/// version 4 adds [`FaKvCache::block_walk`] (a trailing field: a version-2/3 `FaKvCache`,
/// of the smaller size, reads as one without a walk) and its host builder `fa_block_walk`;
/// version 5 adds [`FA_EXP2_AUTO`], the options' new default; version 6 adds the CPU
/// backward `fa_backward_cpu` (no descriptor changed); version 7 adds the CUDA backward
/// `fa_backward_cuda` and its workspace size `fa_backward_cuda_workspace_bytes` (no
/// descriptor changed); version 8 adds attention sinks, [`FaOptions::sinks`] and
/// [`FaOptions::d_sinks`] (trailing fields: older options read as ones without sinks).
/// A library accepts descriptors of every version up to its own.
pub const FA_API_VERSION: u32 = 8;

/// Success.
pub const FA_OK: i32 = 0;
/// A null pointer, a bad enum value, a negative or overflowing size, a buffer that does not
/// match the problem, a misaligned pointer, an output that overlaps an input, or a problem
/// that fails validation.
pub const FA_ERR_INVALID_ARGUMENT: i32 = 1;
/// A valid problem that this backend cannot run (dtype combination, head dimension, …).
pub const FA_ERR_UNSUPPORTED: i32 = 2;
/// The CUDA driver or NVRTC failed while running.
pub const FA_ERR_CUDA: i32 = 3;
/// No usable CUDA device: no driver, no NVRTC, or no device with that ordinal.
pub const FA_ERR_NO_DEVICE: i32 = 4;
/// The library panicked (a bug); the panic was caught and the outputs may be partly written.
pub const FA_ERR_PANIC: i32 = 5;
/// An options struct of a size or version this library does not know (newer than it).
pub const FA_ERR_VERSION: i32 = 6;

/// 32-bit floats.
pub const FA_DTYPE_F32: u32 = 0;
/// bfloat16, stored as its 16 bits (`uint16_t` in C).
pub const FA_DTYPE_BF16: u32 = 1;
/// IEEE half, stored as its 16 bits (`uint16_t` in C).
pub const FA_DTYPE_F16: u32 = 2;

/// `batch` sequences of `seqlen_q` queries and `seqlen_k` keys (BSHD tensors).
pub const FA_SEQLENS_FIXED: u32 = 0;
/// Packed sequences, prefix sums in host memory (`cu_seqlens_q/k`, `batch + 1` entries).
pub const FA_SEQLENS_VARLEN_HOST: u32 = 1;
/// Packed sequences, prefix sums in device memory (CUDA only): the caller also gives
/// `total_q`, `total_k`, `max_seqlen_q`, `max_seqlen_k`.
pub const FA_SEQLENS_VARLEN_DEVICE: u32 = 2;

/// Exact software exp2 on the CPU (what zeroed options ask for).
pub const FA_EXP2_EXACT: u32 = 0;
/// FlashAttention-4's cubic exp2 on the CPU.
pub const FA_EXP2_CUBIC: u32 = 1;
/// The library's choice, the default (`FA_OPTIONS_INIT`, `fa_options_default`): the cubic in
/// the AMX forward (bf16/f16 inputs on Intel AMX tiles), whose `P·V` takes the probabilities
/// rounded to bf16, the exact exp2 everywhere else. Since API version 5.
pub const FA_EXP2_AUTO: u32 = 2;

/// One tensor: where its elements are, their type, and its strides in elements.
///
/// Dense tensors are `[batch, seqlen, heads, head_dim]`, packed (varlen) ones
/// `[total_tokens, heads, head_dim]` (then `stride_batch` is ignored); `head_dim` is always
/// contiguous. A contiguous BSHD tensor has `stride_head = head_dim`,
/// `stride_seq = heads * head_dim`, `stride_batch = seqlen * heads * head_dim`. The library
/// computes how many elements the tensor spans from the problem and these strides; the
/// memory must hold them.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FaTensor {
    /// First element: host memory for `fa_forward_cpu`, a device address for
    /// `fa_forward_cuda`. May be null only when the tensor spans no element.
    pub data: *mut c_void,
    /// `FA_DTYPE_*`.
    pub dtype: u32,
    /// Elements between batch entries.
    pub stride_batch: i64,
    /// Elements between consecutive tokens.
    pub stride_seq: i64,
    /// Elements between consecutive heads.
    pub stride_head: i64,
}

/// The attention problem: shapes, sequences, mask, scale and softcap.
///
/// Sizes are signed so that a negative value from C is an error rather than a huge size.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FaProblem {
    /// Number of sequences (for varlen: the prefix sums hold `batch + 1` entries).
    pub batch: i64,
    /// Queries per sequence (`FA_SEQLENS_FIXED` only).
    pub seqlen_q: i64,
    /// Keys per sequence (`FA_SEQLENS_FIXED` only).
    pub seqlen_k: i64,
    /// Query heads.
    pub heads_q: i64,
    /// Key/value heads; `heads_q` must be a multiple (GQA/MQA).
    pub heads_kv: i64,
    /// Head dimension of Q and K.
    pub head_dim: i64,
    /// Head dimension of V and O; 0 means `head_dim`.
    pub head_dim_v: i64,
    /// `FA_SEQLENS_*`.
    pub seqlens: u32,
    /// Non-zero: causal mask (bottom-right aligned), intersected with the window.
    pub causal: u32,
    /// Query prefix sums (`batch + 1` int32 values from 0), host or device memory per
    /// `seqlens`; ignored for `FA_SEQLENS_FIXED`.
    pub cu_seqlens_q: *const i32,
    /// Key prefix sums, as `cu_seqlens_q`.
    pub cu_seqlens_k: *const i32,
    /// Query tokens in all (`FA_SEQLENS_VARLEN_DEVICE` only: the last query prefix sum).
    pub total_q: i64,
    /// Key tokens in all (`FA_SEQLENS_VARLEN_DEVICE` only).
    pub total_k: i64,
    /// The longest query sequence (`FA_SEQLENS_VARLEN_DEVICE` only).
    pub max_seqlen_q: i64,
    /// The longest key sequence (`FA_SEQLENS_VARLEN_DEVICE` only).
    pub max_seqlen_k: i64,
    /// Keys before the diagonal a query sees; -1: unbounded (any other negative value is
    /// refused).
    pub window_left: i64,
    /// Keys after the diagonal a query sees; -1: unbounded (any other negative value is
    /// refused).
    pub window_right: i64,
    /// Multiplier of `q·k`; 0 means `1/sqrt(head_dim)`.
    pub softmax_scale: f32,
    /// `cap·tanh(s/cap)` on the scaled scores when positive; 0 means none (negative, NaN or
    /// infinite values are refused).
    pub softcap: f32,
}

impl FaProblem {
    /// A fixed-length batch (`FA_SEQLENS_FIXED`) of these sizes with every other field unset:
    /// `head_dim_v` = `head_dim`, no causal mask, no window, the default scale, no softcap.
    /// For Rust callers of the ABI; set the fields that differ with struct update syntax.
    pub fn dense(
        batch: i64,
        seqlen_q: i64,
        seqlen_k: i64,
        heads_q: i64,
        heads_kv: i64,
        head_dim: i64,
    ) -> FaProblem {
        FaProblem {
            batch,
            seqlen_q,
            seqlen_k,
            heads_q,
            heads_kv,
            head_dim,
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
}

/// Options of a call beyond the problem. It begins with its own size and the API version so
/// that it can grow: a library accepts the options of any older header (fields it reads past
/// `size` keep their defaults) and refuses a larger size or a newer version with
/// `FA_ERR_VERSION`. Initialise it with `FA_OPTIONS_INIT` or `fa_options_default`; a null
/// options pointer means the defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaOptions {
    /// `sizeof(FaOptions)` as the caller compiled it.
    pub size: u32,
    /// `FA_API_VERSION` as the caller compiled it.
    pub version: u32,
    /// CPU threads in all, the caller included; 0: one per core; more than the machine has is
    /// refused. Ignored on CUDA.
    pub threads: u32,
    /// `FA_EXP2_*` of the CPU kernel. Ignored on CUDA.
    pub exp2: u32,
    /// Learnable attention sinks (API version 8): `heads_q` finite f32 logits in host memory,
    /// one per query head, each joining every row of its head in the softmax denominator with
    /// no value (gpt-oss); the LSE includes it, and a row that sees no key gets O = 0 and
    /// LSE = its sink. Null: no sinks. The CPU entries take it (`fa_forward_cpu`,
    /// `fa_forward_cache_cpu`, `fa_backward_cpu`: pass the forward's sinks); the CUDA
    /// entries answer `FA_ERR_UNSUPPORTED` for now.
    pub sinks: *const f32,
    /// `fa_backward_cpu` only (API version 8): where `∂L/∂sinks` goes, `heads_q` f32s
    /// (`−Σ_i exp(s_h − lse_i)·rowsum(dO_i ∘ O_i)` over the rows of head `h`), or null. Needs
    /// `sinks`; the forward entries refuse it set.
    pub d_sinks: *mut f32,
}

impl Default for FaOptions {
    fn default() -> Self {
        FaOptions {
            size: core::mem::size_of::<FaOptions>() as u32,
            version: FA_API_VERSION,
            threads: 0,
            exp2: FA_EXP2_AUTO,
            sinks: core::ptr::null(),
            d_sinks: core::ptr::null_mut(),
        }
    }
}

/// A KV cache (decode) that K and V are read from, for `fa_forward_cache_cpu` and
/// `fa_forward_cache_cuda` (API version 2; version 4 added `block_walk`). Like
/// [`FaOptions`] it begins with its own size and the API version, so that it can grow the
/// same way: initialise it with `FA_KV_CACHE_INIT` and set the fields.
///
/// With it the problem describes a fixed-length batch (`FA_SEQLENS_FIXED`): `batch`
/// sequences of `seqlen_q` new queries each (1 for plain decode, a few for speculative
/// decoding), Q and O dense `[batch, seqlen_q, heads, head_dim]` as in `fa_forward_cpu`.
/// Sequence `b` attends to its first `seqused_k[b]` cached keys, and the causal and window
/// masks align bottom-right against that length: query `i` sees keys
/// `j <= i + seqused_k[b] - seqlen_q`. K and V are either
/// - **padded** (`block_table` null): `[batch, capacity, heads_kv, head_dim]` with
///   `capacity = problem.seqlen_k` (the K/V tensors' `stride_batch` steps over sequences), or
/// - **paged** (`block_table` set): `[num_blocks, block_size, heads_kv, head_dim]` (the K/V
///   tensors' `stride_batch` steps over blocks, `stride_seq` over the rows of a block; the
///   problem's `seqlen_k` is ignored); key `t` of sequence `b` is row `t % block_size` of block
///   `block_table[b * blocks_per_seq + t / block_size]`, and entries past a sequence's used
///   blocks are never read.
///
/// On the CPU both tables are host memory, read and checked before anything is written: a
/// negative or over-capacity length, a block index outside `0..num_blocks`, a table too short
/// for a length are `FA_ERR_INVALID_ARGUMENT`. On CUDA they are device memory and are never
/// read by the host (see `fa_forward_cache_cuda`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaKvCache {
    /// `sizeof(FaKvCache)` as the caller compiled it.
    pub size: u32,
    /// `FA_API_VERSION` as the caller compiled it (at least 2).
    pub version: u32,
    /// Keys used per sequence (`cache_seqlens`): `batch` int32 values, host memory for the
    /// CPU, device memory for CUDA. Required.
    pub seqused_k: *const i32,
    /// Row-major `[batch, blocks_per_seq]` int32 block indices (host memory for the CPU,
    /// device memory for CUDA); null: a padded cache.
    pub block_table: *const i32,
    /// Columns of the block table (paged only; 0 for a padded cache).
    pub blocks_per_seq: i64,
    /// Keys per block, at least 1 (paged only; 0 for a padded cache).
    pub block_size: i64,
    /// Blocks the K/V tensors hold (paged only; 0 for a padded cache).
    pub num_blocks: i64,
    /// Key splits to force (split-KV, merged by their log-sum-exp); 0: the backend's choice
    /// from the problem and the machine. Results agree with one split to rounding.
    pub num_splits: u32,
    /// A paged cache's block walk (API version 4; null: none, which is also what a version-2
    /// or 3 descriptor, of the smaller size, reads as): int32 `[batch, 2, blocks_per_seq]` as
    /// `fa_block_walk` builds it on the host from this cache's `seqused_k` and block table,
    /// copied to **device** memory, for `fa_forward_cache_cuda`. The decode kernel then reads
    /// each sequence's used blocks in ascending physical order where its plan allows (blocks
    /// of at least 8 keys read whole, no left window: 1–3 % faster on scattered pages), in
    /// the table's order elsewhere and without a walk; the result is the same attention up
    /// to rounding. The walk depends only on the tables, so a runtime builds it once per
    /// decode step and passes it to every layer's call. It must describe the lengths and
    /// table the kernel reads (after any append of the step): a stale walk gives wrong
    /// results, never an access outside the cache (its entries are clamped like the table's).
    ///
    /// Where it is read, and where not:
    /// - a padded cache (`block_table` null) has no blocks to walk: a non-null walk is
    ///   `FA_ERR_INVALID_ARGUMENT` on every entry point;
    /// - `fa_forward_cache_cpu` refuses a non-null walk (`FA_ERR_INVALID_ARGUMENT`) rather
    ///   than ignore it: the CPU kernel reads the block table in order and has no use for a
    ///   walk, and the CPU's tables are host memory while a walk is a device array, so a
    ///   walk there is a descriptor meant for the CUDA call; refusing it says so at once
    ///   instead of letting the caller believe the walk was used;
    /// - the appends (`fa_append_kv_cpu`, `fa_append_kv_cuda`) never read it (they write at
    ///   positions, in no order), so one descriptor serves a step's append and its attention
    ///   call; `fa_forward_cache_cuda_workspace_bytes` neither (a walk changes no size).
    pub block_walk: *const i32,
}

impl Default for FaKvCache {
    fn default() -> Self {
        FaKvCache {
            size: core::mem::size_of::<FaKvCache>() as u32,
            version: FA_API_VERSION,
            seqused_k: core::ptr::null(),
            block_table: core::ptr::null(),
            blocks_per_seq: 0,
            block_size: 0,
            num_blocks: 0,
            num_splits: 0,
            block_walk: core::ptr::null(),
        }
    }
}

/// An opened CUDA device (opaque to C): created by `fa_cuda_device_create` or
/// `fa_cuda_device_create_from_context`, freed by `fa_cuda_device_destroy`.
pub struct FaCudaDevice {
    pub(crate) device: fa_cuda::Device,
}

impl FaCudaDevice {
    /// The fa-cuda device behind the handle, for Rust callers that hold a handle and call
    /// fa-cuda directly (the Python module's CUDA backward). Not part of the C ABI.
    pub fn device(&self) -> &fa_cuda::Device {
        &self.device
    }
}
