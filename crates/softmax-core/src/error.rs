//! Typed errors of problem validation.

use core::fmt;

/// Which tensor of an attention call an error is about (passes to come add theirs: the
/// backward's `dO` and gradients, a decode call's cache tables).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Tensor {
    /// Queries.
    Q,
    /// Keys.
    K,
    /// Values.
    V,
    /// Output.
    O,
    /// Log-sum-exp of each row (natural log).
    Lse,
    /// Keys used per sequence of a KV cache (`seqused_k`).
    SequsedK,
    /// The block table of a paged KV cache.
    BlockTable,
    /// A paged KV cache's block walk (the order a backend reads its blocks in).
    BlockWalk,
    /// The query prefix sums of a packed batch (`cu_seqlens_q`).
    CuSeqlensQ,
    /// The key prefix sums of a packed batch (`cu_seqlens_k`).
    CuSeqlensK,
    /// New keys appended to a KV cache.
    KNew,
    /// New values appended to a KV cache.
    VNew,
    /// The per-query-head logits of learnable attention sinks.
    Sinks,
    /// The gradient of the attention sinks' logits.
    DSinks,
}

impl fmt::Display for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tensor::Q => "q",
            Tensor::K => "k",
            Tensor::V => "v",
            Tensor::O => "output",
            Tensor::Lse => "lse",
            Tensor::SequsedK => "seqused_k",
            Tensor::BlockTable => "block_table",
            Tensor::BlockWalk => "block_walk",
            Tensor::CuSeqlensQ => "cu_seqlens_q",
            Tensor::CuSeqlensK => "cu_seqlens_k",
            Tensor::KNew => "k_new",
            Tensor::VNew => "v_new",
            Tensor::Sinks => "sinks",
            Tensor::DSinks => "d_sinks",
        })
    }
}

/// Why an attention problem was rejected. Backends return it before touching any output.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum ProblemError {
    /// A dimension that must be at least one is zero (`what` names it).
    ZeroDim {
        /// The dimension's name.
        what: &'static str,
    },
    /// `head_dim` (or `head_dim_v`) outside `1..=max`.
    HeadDimOutOfRange {
        /// The dimension's name (`head_dim` or `head_dim_v`).
        what: &'static str,
        /// The value given.
        head_dim: usize,
        /// The largest supported.
        max: usize,
    },
    /// `heads_q` is not a multiple of `heads_kv` (grouped-query attention needs it).
    GqaRatio {
        /// Query heads.
        heads_q: usize,
        /// Key/value heads.
        heads_kv: usize,
    },
    /// The softmax scale is NaN or infinite.
    NonFiniteScale {
        /// The value given.
        scale: f32,
    },
    /// The softcap is NaN, infinite, zero or negative.
    BadSoftcap {
        /// The value given.
        softcap: f32,
    },
    /// An explicitly given softmax scale is zero (every key would weigh the same; the flat
    /// interfaces read 0 as "not set", so it cannot mean a scale there either).
    ZeroScale,
    /// A side of a FlashAttention-style window is negative but not `-1` (unbounded).
    BadWindow {
        /// `"left"` or `"right"`.
        side: &'static str,
        /// The value given.
        value: i64,
    },
    /// An explicitly given thread count is zero or negative.
    BadThreads {
        /// The value given.
        threads: i64,
    },
    /// `|softmax_scale|` exceeds [`crate::MAX_SOFTMAX_SCALE`]: the scaled scores would overflow
    /// f32 (NaN where the exact answer is finite).
    ScaleOutOfRange {
        /// The value given.
        scale: f32,
        /// The largest magnitude accepted.
        max: f32,
    },
    /// The softcap is outside `min..=max`: below `min = |scale| / `
    /// [`crate::MAX_SCALE_OVER_SOFTCAP`] the factor `scale/cap` folded into Q overflows f32,
    /// above `max =` [`crate::MAX_SOFTCAP`] `cap·log2 e` does.
    SoftcapOutOfRange {
        /// The value given.
        softcap: f32,
        /// The smallest softcap accepted with this scale.
        min: f32,
        /// The largest softcap accepted.
        max: f32,
    },
    /// `cu_seqlens_q` and `cu_seqlens_k` differ in length, or are shorter than two entries.
    CuSeqlensLength {
        /// Entries of `cu_seqlens_q`.
        len_q: usize,
        /// Entries of `cu_seqlens_k`.
        len_k: usize,
    },
    /// A `cu_seqlens` array does not start at zero or decreases somewhere.
    CuSeqlensNotMonotone {
        /// The tensor whose prefix sums are wrong (Q or K).
        tensor: Tensor,
        /// The first index where it goes wrong.
        index: usize,
    },
    /// A stride makes rows of a tensor overlap (each head's `head_dim` elements are contiguous).
    StrideTooSmall {
        /// The tensor.
        tensor: Tensor,
        /// The stride's name.
        what: &'static str,
        /// The stride given.
        stride: usize,
        /// The smallest stride that avoids overlap.
        min: usize,
    },
    /// A buffer is shorter than its shape and strides need.
    BufferTooSmall {
        /// The tensor.
        tensor: Tensor,
        /// Elements needed.
        needed: usize,
        /// Elements given.
        len: usize,
    },
    /// Index arithmetic overflowed `usize` (absurd shapes or strides).
    Overflow,
    /// A rescale threshold breaks [`crate::RescalePolicy::check`]'s rule.
    RescaleThreshold {
        /// The threshold given (0 for `Always`).
        tau: f32,
        /// log2 of the scale the P operand is multiplied by before it is stored.
        offset_log2: f32,
        /// log2 of the largest finite value of the type P is stored in.
        p_max_log2: f32,
    },
    /// An array of a KV cache (`seqused_k`, the block table) has the wrong length.
    CacheTableLength {
        /// The array.
        tensor: Tensor,
        /// Entries needed.
        needed: usize,
        /// Entries given.
        len: usize,
    },
    /// A sequence of a KV cache uses more keys than the cache holds for it.
    CacheOverrun {
        /// The sequence.
        batch: usize,
        /// Keys it uses (`seqused_k[batch]`).
        used: usize,
        /// Keys the cache has room for (padded: `seqlen_k`; paged: blocks per sequence ×
        /// block size).
        capacity: usize,
    },
    /// A block table entry names a block outside the paged cache.
    BlockIndex {
        /// The sequence.
        batch: usize,
        /// The entry's position in the sequence's row of the table.
        slot: usize,
        /// The block index found.
        block: i64,
        /// Blocks in the cache.
        num_blocks: usize,
    },
    /// A packed batch described by its sizes ([`crate::Sequences::VarlenDevice`]) claims a
    /// longest sequence longer than all its tokens together.
    SeqlenExceedsTotal {
        /// Q or K.
        tensor: Tensor,
        /// The longest sequence given.
        max_seqlen: usize,
        /// Tokens over all sequences.
        total: usize,
    },
    /// More worker threads asked for than a backend accepts.
    TooManyThreads {
        /// The count asked for.
        threads: usize,
        /// The largest accepted.
        max: usize,
    },
    /// A backend could not allocate memory of its own (scratch, task list): reported instead
    /// of aborting the process.
    OutOfMemory {
        /// What the memory was for.
        what: &'static str,
        /// Bytes asked for.
        bytes: usize,
    },
    /// The attention sinks do not hold one logit per query head.
    SinksLength {
        /// Entries needed (`heads_q`).
        needed: usize,
        /// Entries given.
        len: usize,
    },
    /// An attention sink's logit is NaN or infinite.
    NonFiniteSink {
        /// The query head.
        head: usize,
        /// The value given.
        value: f32,
    },
    /// The backend does not support this (dtype, head dim, architecture, feature).
    Unsupported {
        /// What is not supported.
        what: &'static str,
    },
}

impl fmt::Display for ProblemError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ProblemError::ZeroDim { what } => write!(f, "{what} must be at least 1"),
            ProblemError::HeadDimOutOfRange {
                what,
                head_dim,
                max,
            } => {
                write!(
                    f,
                    "{what} = {head_dim} is out of range: supported 1..={max}"
                )
            }
            ProblemError::GqaRatio { heads_q, heads_kv } => write!(
                f,
                "heads_q = {heads_q} is not a multiple of heads_kv = {heads_kv} (GQA/MQA need it)"
            ),
            ProblemError::NonFiniteScale { scale } => {
                write!(f, "softmax_scale = {scale} is not finite")
            }
            ProblemError::BadSoftcap { softcap } => {
                write!(f, "softcap = {softcap} must be finite and positive")
            }
            ProblemError::ZeroScale => f.write_str(
                "softmax_scale = 0 is not accepted (every key would weigh the same); leave it \
                 unset for 1/sqrt(head_dim)",
            ),
            ProblemError::BadWindow { side, value } => write!(
                f,
                "window {side} = {value}: use -1 for unbounded or a number of keys ≥ 0"
            ),
            ProblemError::BadThreads { threads } => {
                write!(f, "threads = {threads}: a thread count is at least 1")
            }
            ProblemError::ScaleOutOfRange { scale, max } => write!(
                f,
                "softmax_scale = {scale:e} is out of range: |scale| ≤ {max:e} (larger scores overflow f32)"
            ),
            ProblemError::SoftcapOutOfRange { softcap, min, max } => write!(
                f,
                "softcap = {softcap:e} is out of range: {min:e}..={max:e} with this softmax_scale \
                 (outside it scale/cap or cap·log2 e overflows f32)"
            ),
            ProblemError::CuSeqlensLength { len_q, len_k } => write!(
                f,
                "cu_seqlens_q has {len_q} entries and cu_seqlens_k {len_k}: both need batch + 1 ≥ 2"
            ),
            ProblemError::CuSeqlensNotMonotone { tensor, index } => write!(
                f,
                "cu_seqlens of {tensor} must start at 0 and never decrease (wrong at index {index})"
            ),
            ProblemError::StrideTooSmall {
                tensor,
                what,
                stride,
                min,
            } => write!(
                f,
                "{tensor}: {what} = {stride} makes elements overlap (at least {min} needed)"
            ),
            ProblemError::BufferTooSmall {
                tensor,
                needed,
                len,
            } => write!(
                f,
                "{tensor}: buffer holds {len} elements, the shape and strides need {needed}"
            ),
            ProblemError::Overflow => f.write_str("shape or strides overflow the index range"),
            ProblemError::RescaleThreshold {
                tau,
                offset_log2,
                p_max_log2,
            } => write!(
                f,
                "rescale threshold τ = {tau} must be finite, in 0..={}, and τ + {offset_log2} \
                 below {p_max_log2:.3} (log2 of the largest value of P's storage type)",
                crate::rescale::MAX_RESCALE_THRESHOLD
            ),
            ProblemError::CacheTableLength {
                tensor,
                needed,
                len,
            } => write!(f, "{tensor} has {len} entries, the problem needs {needed}"),
            ProblemError::CacheOverrun {
                batch,
                used,
                capacity,
            } => write!(
                f,
                "sequence {batch} uses {used} keys but the KV cache holds {capacity} for it"
            ),
            ProblemError::BlockIndex {
                batch,
                slot,
                block,
                num_blocks,
            } => write!(
                f,
                "block_table[{batch}][{slot}] = {block} is outside the cache's {num_blocks} blocks"
            ),
            ProblemError::SeqlenExceedsTotal {
                tensor,
                max_seqlen,
                total,
            } => write!(
                f,
                "{tensor}: max_seqlen = {max_seqlen} exceeds the {total} tokens of the whole batch"
            ),
            ProblemError::TooManyThreads { threads, max } => {
                write!(f, "threads = {threads} is too many: at most {max}")
            }
            ProblemError::OutOfMemory { what, bytes } => {
                write!(f, "out of memory: could not allocate {bytes} bytes for {what}")
            }
            ProblemError::SinksLength { needed, len } => write!(
                f,
                "sinks has {len} entries, the problem needs one per query head ({needed})"
            ),
            ProblemError::NonFiniteSink { head, value } => {
                write!(f, "sinks[{head}] = {value} is not finite")
            }
            ProblemError::Unsupported { what } => write!(f, "unsupported: {what}"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for ProblemError {}
