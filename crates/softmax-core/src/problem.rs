//! The attention problem: shapes, strides, variable-length batches, GQA, scale, softcap, mask,
//! and its validation into typed errors.
//!
//! A caller fills a [`ProblemDesc`]; [`ProblemDesc::validate`] checks it and returns a
//! [`Problem`], which answers every indexing question a backend asks (element offsets of a
//! token's head, sequence ranges, the KV head of a query head, LSE positions) so that no
//! backend re-derives layout rules.

use crate::error::{ProblemError, Tensor};
use crate::mask::Mask;
use crate::score::ScoreTransform;

/// The largest head dimension any backend supports.
pub const MAX_HEAD_DIM: usize = 256;

/// The largest `|softmax_scale|` accepted (2³²). Kernels fold `scale·log2 e` into Q in f32; past
/// this a score `scale·q·k` overflows for ordinary inputs and the softmax turns NaN (the exact
/// answer is then the argmax's one-hot row, which f32 cannot compute in general). Within it, a
/// score stays finite while `|q·k| ≤ 2⁹⁴`.
pub const MAX_SOFTMAX_SCALE: f32 = 4_294_967_296.0;

/// The largest `|softmax_scale| / softcap` accepted (2³²): with a softcap the kernels fold
/// `scale/cap` into Q, which must stay finite (a subnormal cap such as 1e-39 made it overflow).
/// So the smallest softcap accepted is `|scale| / 2³²`.
pub const MAX_SCALE_OVER_SOFTCAP: f32 = 4_294_967_296.0;

/// The largest softcap accepted (2⁶⁴): the factor `cap·log2 e` after `tanh` must stay finite.
pub const MAX_SOFTCAP: f32 = 18_446_744_073_709_551_616.0;

/// One side of a FlashAttention-style `window_size`: `-1` is unbounded (`None`), `n ≥ 0` is
/// `n` keys; any other negative value is [`ProblemError::BadWindow`]. `side` names it in the
/// error (`"left"` or `"right"`).
pub fn window_side(side: &'static str, value: i64) -> Result<Option<usize>, ProblemError> {
    match value {
        -1 => Ok(None),
        // A window wider than the address space is as good as unbounded on any target.
        v if v >= 0 => Ok(Some(usize::try_from(v).unwrap_or(usize::MAX))),
        v => Err(ProblemError::BadWindow { side, value: v }),
    }
}

/// FlashAttention's `causal` and `window_size = (left, right)` as a [`Mask`], checked: each
/// side is `-1` (unbounded) or `≥ 0` ([`window_side`]); causal intersects the window. The
/// one conversion the C ABI, the `fa` command and the Python module share.
pub fn mask_from_flash(
    causal: bool,
    window_left: i64,
    window_right: i64,
) -> Result<Mask, ProblemError> {
    let left = window_side("left", window_left)?;
    let right = window_side("right", window_right)?;
    // A window's right bound is never negative, so the intersection with causal is the
    // diagonal.
    let right = if causal { Some(0) } else { right };
    Ok(Mask { left, right })
}

/// A softcap as the flat interfaces (C ABI, `fa --softcap`, Python `softcap=`) give it:
/// `0` means no softcap (FlashAttention's convention); a negative, NaN or infinite value is
/// [`ProblemError::BadSoftcap`]. The range against the scale is [`ProblemDesc::validate`]'s.
pub fn softcap_from_flash(softcap: f32) -> Result<Option<f32>, ProblemError> {
    if softcap == 0.0 {
        Ok(None)
    } else if softcap.is_finite() && softcap > 0.0 {
        Ok(Some(softcap))
    } else {
        Err(ProblemError::BadSoftcap { softcap })
    }
}

/// A softmax scale given explicitly (`fa --scale`, Python `scale=`): finite
/// ([`ProblemError::NonFiniteScale`]) and non-zero ([`ProblemError::ZeroScale`]); its
/// magnitude is checked by [`ProblemDesc::validate`]. The C ABI reads 0 as "not set" instead.
pub fn explicit_scale(scale: f32) -> Result<f32, ProblemError> {
    if !scale.is_finite() {
        Err(ProblemError::NonFiniteScale { scale })
    } else if scale == 0.0 {
        Err(ProblemError::ZeroScale)
    } else {
        Ok(scale)
    }
}

/// A thread count given explicitly (`fa --threads`): at least 1
/// ([`ProblemError::BadThreads`] for 0 or a negative count) and at most `max`
/// ([`ProblemError::TooManyThreads`]).
pub fn thread_count(threads: i64, max: usize) -> Result<usize, ProblemError> {
    if threads < 1 {
        return Err(ProblemError::BadThreads { threads });
    }
    match usize::try_from(threads) {
        Ok(n) if n <= max => Ok(n),
        _ => Err(ProblemError::TooManyThreads {
            threads: usize::try_from(threads).unwrap_or(usize::MAX),
            max,
        }),
    }
}

/// Element strides of a `[batch, seqlen, heads, head_dim]` tensor; `head_dim` is contiguous.
/// For variable-length (packed) tensors `batch` is ignored and `seq` steps over tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Strides {
    /// Elements between batch entries.
    pub batch: usize,
    /// Elements between consecutive tokens.
    pub seq: usize,
    /// Elements between consecutive heads.
    pub head: usize,
}

impl Strides {
    /// Strides of a densely packed BSHD tensor.
    /// Absurd sizes saturate instead of overflowing; validation then reports
    /// [`ProblemError::Overflow`] for the tensor's extent.
    pub const fn contiguous(seqlen: usize, heads: usize, head_dim: usize) -> Strides {
        let seq = heads.saturating_mul(head_dim);
        Strides {
            batch: seqlen.saturating_mul(seq),
            seq,
            head: head_dim,
        }
    }
}

/// How queries and keys are grouped into sequences.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sequences<'a> {
    /// `batch` sequences, each of `seqlen_q` queries and `seqlen_k` keys.
    Fixed {
        /// Number of sequences.
        batch: usize,
        /// Queries per sequence.
        seqlen_q: usize,
        /// Keys (and values) per sequence.
        seqlen_k: usize,
    },
    /// Packed sequences of different lengths: sequence `b` holds tokens
    /// `cu_seqlens[b]..cu_seqlens[b + 1]` of the packed `[total_tokens, heads, head_dim]`
    /// tensor (prefix sums, length `batch + 1`, starting at 0).
    Varlen {
        /// Prefix sums of query lengths.
        cu_seqlens_q: &'a [u32],
        /// Prefix sums of key lengths.
        cu_seqlens_k: &'a [u32],
    },
    /// Packed sequences whose prefix sums live in device memory (an embedding runtime's
    /// `cu_seqlens`): the host knows only the sizes below, so [`Problem::seq`] cannot answer
    /// per sequence ([`Problem::try_seq`] is `None`). The tensors are packed exactly as for
    /// [`Sequences::Varlen`]. Only device backends take it; a backend that needs the prefix
    /// sums on the host rejects it through [`Problem::require_host_seqlens`].
    VarlenDevice {
        /// Number of sequences (the device arrays hold `batch + 1` prefix sums).
        batch: usize,
        /// Query tokens over all sequences (the last query prefix sum).
        total_q: usize,
        /// Key tokens over all sequences (the last key prefix sum).
        total_k: usize,
        /// The longest query sequence (sizes the launch: longer ones are not computed).
        max_seqlen_q: usize,
        /// The longest key sequence.
        max_seqlen_k: usize,
    },
}

/// Where the keys and values of each sequence live: in K/V tensors that hold exactly the
/// sequences' keys, or in a KV cache (decode), padded or paged.
///
/// A cache needs [`Sequences::Fixed`]: its `seqlen_k` is then the padded cache's capacity per
/// sequence (and is ignored by a paged one). Causal and window masks align bottom-right
/// against each sequence's used length: query `i` of `seqlen_q` sees keys
/// `j ≤ i + seqused_k[b] − seqlen_q`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCache<'a> {
    /// K and V hold exactly the keys of [`ProblemDesc::sequences`].
    #[default]
    None,
    /// K/V are `[batch, seqlen_k, heads_kv, head_dim]`; sequence `b` uses its first
    /// `seqused_k[b]` keys.
    Padded {
        /// Keys used per sequence (`cache_seqlens`), `batch` entries.
        seqused_k: &'a [u32],
    },
    /// K/V are `[num_blocks, block_size, heads_kv, head_dim]` (the strides' `batch` steps over
    /// blocks, `seq` over the rows of a block); key `t` of sequence `b` is row
    /// `t % block_size` of block `block_table[b · blocks_per_seq + t / block_size]`.
    Paged {
        /// Keys used per sequence, `batch` entries.
        seqused_k: &'a [u32],
        /// Row-major `[batch, blocks_per_seq]` block indices; entries past a sequence's used
        /// blocks are not read.
        block_table: &'a [i32],
        /// Columns of the block table.
        blocks_per_seq: usize,
        /// Keys per block.
        block_size: usize,
        /// Blocks in the K/V tensors.
        num_blocks: usize,
    },
}

impl KvCache<'_> {
    /// Keys used by sequence `b` (`None` without a cache).
    #[inline]
    fn used(&self, b: usize) -> Option<usize> {
        match *self {
            KvCache::None => None,
            KvCache::Padded { seqused_k } | KvCache::Paged { seqused_k, .. } => {
                Some(seqused_k[b] as usize)
            }
        }
    }
}

/// Everything that describes an attention call, before validation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProblemDesc<'a> {
    /// Sequence grouping and lengths.
    pub sequences: Sequences<'a>,
    /// Query heads.
    pub heads_q: usize,
    /// Key/value heads (`heads_q` must be a multiple: MHA, GQA, MQA).
    pub heads_kv: usize,
    /// Head dimension of Q and K.
    pub head_dim: usize,
    /// Head dimension of V and O (usually `head_dim`).
    pub head_dim_v: usize,
    /// Multiplier of `q·k`; `None` means `1/sqrt(head_dim)`. Finite, `|scale| ≤`
    /// [`MAX_SOFTMAX_SCALE`].
    pub softmax_scale: Option<f32>,
    /// `cap·tanh(s/cap)` on the scaled score `s`, when set; within
    /// `|scale| / `[`MAX_SCALE_OVER_SOFTCAP`]`..=`[`MAX_SOFTCAP`].
    pub softcap: Option<f32>,
    /// Causal and/or sliding-window mask.
    pub mask: Mask,
    /// Where K and V live (a KV cache for decode); default: exactly the sequences' keys.
    pub kv_cache: KvCache<'a>,
    /// Strides of Q (`None`: contiguous).
    pub q_strides: Option<Strides>,
    /// Strides of K (`None`: contiguous).
    pub k_strides: Option<Strides>,
    /// Strides of V (`None`: contiguous).
    pub v_strides: Option<Strides>,
    /// Strides of O (`None`: contiguous).
    pub o_strides: Option<Strides>,
    /// Learnable attention sinks (gpt-oss): one natural-log logit per query head, `heads_q`
    /// finite entries, that joins every row's softmax denominator with no value (see
    /// [`Problem::sinks`]); `None`: no sink.
    pub sinks: Option<&'a [f32]>,
}

impl<'a> ProblemDesc<'a> {
    /// A dense problem: `batch` sequences, contiguous BSHD tensors, default scale, no mask.
    pub fn new(
        batch: usize,
        seqlen_q: usize,
        seqlen_k: usize,
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
    ) -> Self {
        ProblemDesc {
            sequences: Sequences::Fixed {
                batch,
                seqlen_q,
                seqlen_k,
            },
            heads_q,
            heads_kv,
            head_dim,
            head_dim_v: head_dim,
            softmax_scale: None,
            softcap: None,
            mask: Mask::NONE,
            kv_cache: KvCache::None,
            q_strides: None,
            k_strides: None,
            v_strides: None,
            o_strides: None,
            sinks: None,
        }
    }

    /// A packed variable-length problem with contiguous `[total_tokens, heads, head_dim]`
    /// tensors.
    pub fn varlen(
        cu_seqlens_q: &'a [u32],
        cu_seqlens_k: &'a [u32],
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
    ) -> Self {
        ProblemDesc {
            sequences: Sequences::Varlen {
                cu_seqlens_q,
                cu_seqlens_k,
            },
            ..ProblemDesc::new(1, 0, 0, heads_q, heads_kv, head_dim)
        }
    }

    /// Sets how queries and keys are grouped (e.g. [`Sequences::VarlenDevice`]), keeping heads,
    /// dims, mask and strides.
    pub fn with_sequences(mut self, sequences: Sequences<'a>) -> Self {
        self.sequences = sequences;
        self
    }

    /// Sets the causal (bottom-right aligned) mask, intersected with any window.
    pub fn causal(mut self) -> Self {
        // Right bounds are never negative: intersecting with causal leaves the diagonal.
        self.mask.right = Some(0);
        self
    }

    /// Sets a sliding window: `left` keys before and `right` keys after the aligned diagonal
    /// (`None`: unbounded), intersected with causality if set.
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        let causal = self.mask.is_causal();
        self.mask = Mask { left, right };
        if causal {
            self = self.causal();
        }
        self
    }

    /// Sets the mask and softcap from FlashAttention-style flat arguments, checked:
    /// [`mask_from_flash`] and [`softcap_from_flash`] (`softcap` 0: none).
    pub fn with_flash_args(
        mut self,
        causal: bool,
        window_left: i64,
        window_right: i64,
        softcap: f32,
    ) -> Result<Self, ProblemError> {
        self.mask = mask_from_flash(causal, window_left, window_right)?;
        self.softcap = softcap_from_flash(softcap)?;
        Ok(self)
    }

    /// Sets the mask directly.
    pub fn with_mask(mut self, mask: Mask) -> Self {
        self.mask = mask;
        self
    }

    /// Sets the softmax scale.
    pub fn scale(mut self, softmax_scale: f32) -> Self {
        self.softmax_scale = Some(softmax_scale);
        self
    }

    /// Sets the softcap.
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    /// Sets a different head dimension for V and O.
    pub fn head_dim_v(mut self, head_dim_v: usize) -> Self {
        self.head_dim_v = head_dim_v;
        self
    }

    /// Sets learnable attention sinks: one natural-log logit per query head (see
    /// [`ProblemDesc::sinks`]).
    pub fn with_sinks(mut self, sinks: &'a [f32]) -> Self {
        self.sinks = Some(sinks);
        self
    }

    /// Reads K/V from a padded cache (see [`KvCache::Padded`]).
    pub fn padded_cache(mut self, seqused_k: &'a [u32]) -> Self {
        self.kv_cache = KvCache::Padded { seqused_k };
        self
    }

    /// Reads K/V from a paged cache (see [`KvCache::Paged`]).
    pub fn paged_cache(
        mut self,
        seqused_k: &'a [u32],
        block_table: &'a [i32],
        blocks_per_seq: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Self {
        self.kv_cache = KvCache::Paged {
            seqused_k,
            block_table,
            blocks_per_seq,
            block_size,
            num_blocks,
        };
        self
    }

    /// Sets explicit strides for one of Q, K, V, O (other tensors are ignored).
    pub fn strides(mut self, tensor: Tensor, strides: Strides) -> Self {
        match tensor {
            Tensor::Q => self.q_strides = Some(strides),
            Tensor::K => self.k_strides = Some(strides),
            Tensor::V => self.v_strides = Some(strides),
            Tensor::O => self.o_strides = Some(strides),
            _ => {}
        }
        self
    }

    /// Validates the description against a backend's largest head dimension
    /// (at most [`MAX_HEAD_DIM`]).
    pub fn validate(&self, max_head_dim: usize) -> Result<Problem<'a>, ProblemError> {
        let max_head_dim = max_head_dim.min(MAX_HEAD_DIM);
        if self.heads_q == 0 {
            return Err(ProblemError::ZeroDim { what: "heads_q" });
        }
        if self.heads_kv == 0 {
            return Err(ProblemError::ZeroDim { what: "heads_kv" });
        }
        for (what, d) in [("head_dim", self.head_dim), ("head_dim_v", self.head_dim_v)] {
            if d == 0 || d > max_head_dim {
                return Err(ProblemError::HeadDimOutOfRange {
                    what,
                    head_dim: d,
                    max: max_head_dim,
                });
            }
        }
        if self.heads_q % self.heads_kv != 0 {
            return Err(ProblemError::GqaRatio {
                heads_q: self.heads_q,
                heads_kv: self.heads_kv,
            });
        }
        if let Some(sinks) = self.sinks {
            if sinks.len() != self.heads_q {
                return Err(ProblemError::SinksLength {
                    needed: self.heads_q,
                    len: sinks.len(),
                });
            }
            if let Some((head, &value)) = sinks.iter().enumerate().find(|(_, s)| !s.is_finite()) {
                return Err(ProblemError::NonFiniteSink { head, value });
            }
        }
        let softmax_scale = match self.softmax_scale {
            Some(s) if !s.is_finite() => return Err(ProblemError::NonFiniteScale { scale: s }),
            Some(s) if libm::fabsf(s) > MAX_SOFTMAX_SCALE => {
                return Err(ProblemError::ScaleOutOfRange {
                    scale: s,
                    max: MAX_SOFTMAX_SCALE,
                })
            }
            Some(s) => s,
            None => 1.0 / libm::sqrtf(self.head_dim as f32),
        };
        if let Some(cap) = self.softcap {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(ProblemError::BadSoftcap { softcap: cap });
            }
            // Compared in f64 so that neither bound rounds across the f32 edge.
            let min = libm::fabs(softmax_scale as f64) / MAX_SCALE_OVER_SOFTCAP as f64;
            if (cap as f64) < min || cap > MAX_SOFTCAP {
                return Err(ProblemError::SoftcapOutOfRange {
                    softcap: cap,
                    min: min as f32,
                    max: MAX_SOFTCAP,
                });
            }
        }
        let (batch, total_q, total_k, max_seqlen_q, max_seqlen_k) = match self.sequences {
            Sequences::Fixed {
                batch,
                seqlen_q,
                seqlen_k,
            } => {
                if batch == 0 {
                    return Err(ProblemError::ZeroDim { what: "batch" });
                }
                (batch, seqlen_q, seqlen_k, seqlen_q, seqlen_k)
            }
            Sequences::Varlen {
                cu_seqlens_q,
                cu_seqlens_k,
            } => {
                if cu_seqlens_q.len() != cu_seqlens_k.len() || cu_seqlens_q.len() < 2 {
                    return Err(ProblemError::CuSeqlensLength {
                        len_q: cu_seqlens_q.len(),
                        len_k: cu_seqlens_k.len(),
                    });
                }
                let max_q = check_prefix_sums(cu_seqlens_q, Tensor::Q)?;
                let max_k = check_prefix_sums(cu_seqlens_k, Tensor::K)?;
                let last = cu_seqlens_q.len() - 1;
                (
                    last,
                    cu_seqlens_q[last] as usize,
                    cu_seqlens_k[last] as usize,
                    max_q,
                    max_k,
                )
            }
            Sequences::VarlenDevice {
                batch,
                total_q,
                total_k,
                max_seqlen_q,
                max_seqlen_k,
            } => {
                if batch == 0 {
                    return Err(ProblemError::ZeroDim { what: "batch" });
                }
                for (tensor, max_seqlen, total) in [
                    (Tensor::Q, max_seqlen_q, total_q),
                    (Tensor::K, max_seqlen_k, total_k),
                ] {
                    if max_seqlen > total {
                        return Err(ProblemError::SeqlenExceedsTotal {
                            tensor,
                            max_seqlen,
                            total,
                        });
                    }
                }
                (batch, total_q, total_k, max_seqlen_q, max_seqlen_k)
            }
        };
        let varlen = !matches!(self.sequences, Sequences::Fixed { .. });
        let (total_k, max_seqlen_k, k_rows) = check_cache(&self.kv_cache, varlen, batch, total_k)?
            .unwrap_or((total_k, max_seqlen_k, None));
        // For packed tensors the batch dimension is 1 and the token dimension is the total.
        let (outer, seq_q, seq_k) = if varlen {
            (1, total_q, total_k)
        } else {
            (batch, total_q, total_k)
        };
        // A paged cache's K/V are `num_blocks` blocks of `block_size` rows.
        let (outer_k, seq_k) = k_rows.unwrap_or((outer, seq_k));
        let q = self
            .q_strides
            .unwrap_or(Strides::contiguous(seq_q, self.heads_q, self.head_dim));
        let k = self
            .k_strides
            .unwrap_or(Strides::contiguous(seq_k, self.heads_kv, self.head_dim));
        let v =
            self.v_strides
                .unwrap_or(Strides::contiguous(seq_k, self.heads_kv, self.head_dim_v));
        let o = self
            .o_strides
            .unwrap_or(Strides::contiguous(seq_q, self.heads_q, self.head_dim_v));
        let extents = [
            extent(outer, seq_q, self.heads_q, self.head_dim, &q)?,
            extent(outer_k, seq_k, self.heads_kv, self.head_dim, &k)?,
            extent(outer_k, seq_k, self.heads_kv, self.head_dim_v, &v)?,
            extent(outer, seq_q, self.heads_q, self.head_dim_v, &o)?,
        ];
        // Inputs may alias themselves (broadcast views are fine to read); the output may not.
        check_no_overlap(Tensor::O, outer, seq_q, self.heads_q, self.head_dim_v, &o)?;
        Ok(Problem {
            sequences: self.sequences,
            batch,
            total_q,
            total_k,
            max_seqlen_q,
            max_seqlen_k,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            head_dim: self.head_dim,
            head_dim_v: self.head_dim_v,
            softmax_scale,
            softcap: self.softcap,
            mask: self.mask,
            kv_cache: self.kv_cache,
            sinks: self.sinks,
            q,
            k,
            v,
            o,
            extents,
        })
    }
}

/// Checks a KV cache against the batch. Returns, for a cache, the keys per sequence the K/V
/// tensors hold (`total_k`), the longest used length, and for a paged cache the
/// `(num_blocks, block_size)` shape of K/V's leading dimensions.
#[allow(clippy::type_complexity)]
fn check_cache(
    cache: &KvCache,
    varlen: bool,
    batch: usize,
    seqlen_k: usize,
) -> Result<Option<(usize, usize, Option<(usize, usize)>)>, ProblemError> {
    let seqused_k = match *cache {
        KvCache::None => return Ok(None),
        KvCache::Padded { seqused_k } | KvCache::Paged { seqused_k, .. } => seqused_k,
    };
    if varlen {
        return Err(ProblemError::Unsupported {
            what: "a KV cache takes a fixed-length batch of queries (Sequences::Fixed)",
        });
    }
    if seqused_k.len() != batch {
        return Err(ProblemError::CacheTableLength {
            tensor: Tensor::SequsedK,
            needed: batch,
            len: seqused_k.len(),
        });
    }
    let (capacity, rows) = match *cache {
        KvCache::Paged {
            block_table,
            blocks_per_seq,
            block_size,
            num_blocks,
            ..
        } => {
            if block_size == 0 {
                return Err(ProblemError::ZeroDim { what: "block_size" });
            }
            let needed = batch
                .checked_mul(blocks_per_seq)
                .ok_or(ProblemError::Overflow)?;
            if block_table.len() < needed {
                return Err(ProblemError::CacheTableLength {
                    tensor: Tensor::BlockTable,
                    needed,
                    len: block_table.len(),
                });
            }
            let capacity = blocks_per_seq
                .checked_mul(block_size)
                .ok_or(ProblemError::Overflow)?;
            (capacity, Some((num_blocks, block_size)))
        }
        _ => (seqlen_k, None),
    };
    let mut longest = 0usize;
    for (b, &used) in seqused_k.iter().enumerate() {
        let used = used as usize;
        if used > capacity {
            return Err(ProblemError::CacheOverrun {
                batch: b,
                used,
                capacity,
            });
        }
        longest = longest.max(used);
        if let KvCache::Paged {
            block_table,
            blocks_per_seq,
            block_size,
            num_blocks,
            ..
        } = *cache
        {
            let row = &block_table[b * blocks_per_seq..(b + 1) * blocks_per_seq];
            for (slot, &block) in row[..used.div_ceil(block_size)].iter().enumerate() {
                if block < 0 || block as usize >= num_blocks {
                    return Err(ProblemError::BlockIndex {
                        batch: b,
                        slot,
                        block: block as i64,
                        num_blocks,
                    });
                }
            }
        }
    }
    Ok(Some((capacity, longest, rows)))
}

/// Checks prefix sums (start at 0, never decrease); returns the longest sequence.
fn check_prefix_sums(cu: &[u32], tensor: Tensor) -> Result<usize, ProblemError> {
    if cu[0] != 0 {
        return Err(ProblemError::CuSeqlensNotMonotone { tensor, index: 0 });
    }
    let mut longest = 0usize;
    for (index, pair) in cu.windows(2).enumerate() {
        if pair[1] < pair[0] {
            return Err(ProblemError::CuSeqlensNotMonotone {
                tensor,
                index: index + 1,
            });
        }
        longest = longest.max((pair[1] - pair[0]) as usize);
    }
    Ok(longest)
}

/// Elements a tensor spans: the last element's offset plus one (0 if it is empty).
pub(crate) fn extent(
    outer: usize,
    seq: usize,
    heads: usize,
    dim: usize,
    s: &Strides,
) -> Result<usize, ProblemError> {
    if outer == 0 || seq == 0 || heads == 0 || dim == 0 {
        return Ok(0);
    }
    let terms = [
        (outer - 1).checked_mul(s.batch),
        (seq - 1).checked_mul(s.seq),
        (heads - 1).checked_mul(s.head),
        Some(dim),
    ];
    terms
        .iter()
        .try_fold(0usize, |acc, t| t.and_then(|t| acc.checked_add(t)))
        .ok_or(ProblemError::Overflow)
}

/// Rejects strides of a written tensor under which two elements share an address: sorted by
/// stride, each dimension's stride must be at least the span of all smaller ones.
pub(crate) fn check_no_overlap(
    tensor: Tensor,
    outer: usize,
    seq: usize,
    heads: usize,
    dim: usize,
    s: &Strides,
) -> Result<(), ProblemError> {
    let mut dims = [
        ("batch stride", outer, s.batch),
        ("seq stride", seq, s.seq),
        ("head stride", heads, s.head),
    ];
    // An empty tensor has no two elements to share an address (a zero-length sequence makes
    // the contiguous batch stride 0).
    if outer == 0 || seq == 0 || heads == 0 || dim == 0 {
        return Ok(());
    }
    dims.sort_unstable_by_key(|d| d.2);
    let mut span = dim;
    for (what, count, stride) in dims {
        if count <= 1 {
            continue;
        }
        if stride < span {
            return Err(ProblemError::StrideTooSmall {
                tensor,
                what,
                stride,
                min: span,
            });
        }
        span = (count - 1)
            .checked_mul(stride)
            .and_then(|x| x.checked_add(span))
            .ok_or(ProblemError::Overflow)?;
    }
    Ok(())
}

/// One sequence of a validated problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    /// Index of the first query token in the (packed) token dimension.
    pub q_start: usize,
    /// Queries in the sequence.
    pub seqlen_q: usize,
    /// Index of the first key token.
    pub k_start: usize,
    /// Keys in the sequence.
    pub seqlen_k: usize,
}

/// Lengths of the buffers a backend was handed, in elements, for [`Problem::check_buffers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferLens {
    /// Elements of Q.
    pub q: usize,
    /// Elements of K.
    pub k: usize,
    /// Elements of V.
    pub v: usize,
    /// Elements of O.
    pub o: usize,
    /// Elements of the LSE buffer, if one is requested.
    pub lse: Option<usize>,
}

/// A validated problem. All offsets are in elements.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Problem<'a> {
    sequences: Sequences<'a>,
    batch: usize,
    total_q: usize,
    total_k: usize,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    head_dim_v: usize,
    softmax_scale: f32,
    softcap: Option<f32>,
    mask: Mask,
    kv_cache: KvCache<'a>,
    sinks: Option<&'a [f32]>,
    q: Strides,
    k: Strides,
    v: Strides,
    o: Strides,
    extents: [usize; 4],
}

impl<'a> Problem<'a> {
    /// Checks that the buffers are long enough for the shapes and strides (and the LSE buffer
    /// for `heads_q · total_q` entries).
    pub fn check_buffers(&self, lens: BufferLens) -> Result<(), ProblemError> {
        let named = [
            (Tensor::Q, lens.q, self.extents[0]),
            (Tensor::K, lens.k, self.extents[1]),
            (Tensor::V, lens.v, self.extents[2]),
            (Tensor::O, lens.o, self.extents[3]),
        ];
        for (tensor, len, needed) in named {
            if len < needed {
                return Err(ProblemError::BufferTooSmall {
                    tensor,
                    needed,
                    len,
                });
            }
        }
        if let Some(len) = lens.lse {
            let needed = self.lse_len();
            if len < needed {
                return Err(ProblemError::BufferTooSmall {
                    tensor: Tensor::Lse,
                    needed,
                    len,
                });
            }
        }
        Ok(())
    }

    /// Elements each tensor spans (Q, K, V, O): the smallest buffer lengths that work.
    pub fn min_buffer_lens(&self) -> BufferLens {
        BufferLens {
            q: self.extents[0],
            k: self.extents[1],
            v: self.extents[2],
            o: self.extents[3],
            lse: Some(self.lse_len()),
        }
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Whether sequences are packed with `cu_seqlens` (on the host or on the device).
    pub fn is_varlen(&self) -> bool {
        !matches!(self.sequences, Sequences::Fixed { .. })
    }
    /// How queries and keys are grouped into sequences.
    pub fn sequences(&self) -> Sequences<'a> {
        self.sequences
    }
    /// Whether the host knows every sequence's range: false only for
    /// [`Sequences::VarlenDevice`], whose prefix sums live in device memory.
    pub fn has_host_seqlens(&self) -> bool {
        !matches!(self.sequences, Sequences::VarlenDevice { .. })
    }
    /// `Unsupported` when the prefix sums are on the device ([`Sequences::VarlenDevice`]): the
    /// check every backend that walks sequences on the host makes first.
    pub fn require_host_seqlens(&self) -> Result<(), ProblemError> {
        if self.has_host_seqlens() {
            Ok(())
        } else {
            Err(ProblemError::Unsupported {
                what: "cu_seqlens in device memory (Sequences::VarlenDevice) need a device backend",
            })
        }
    }
    /// Query tokens over all sequences (per batch entry for dense problems).
    pub fn total_q(&self) -> usize {
        self.total_q
    }
    /// Key tokens over all sequences (per batch entry for dense problems).
    pub fn total_k(&self) -> usize {
        self.total_k
    }
    /// Longest query sequence.
    pub fn max_seqlen_q(&self) -> usize {
        self.max_seqlen_q
    }
    /// Longest key sequence.
    pub fn max_seqlen_k(&self) -> usize {
        self.max_seqlen_k
    }
    /// Query heads.
    pub fn heads_q(&self) -> usize {
        self.heads_q
    }
    /// Key/value heads.
    pub fn heads_kv(&self) -> usize {
        self.heads_kv
    }
    /// Query heads sharing one KV head.
    pub fn group_size(&self) -> usize {
        self.heads_q / self.heads_kv
    }
    /// The KV head that query head `head_q` reads.
    pub fn kv_head(&self, head_q: usize) -> usize {
        head_q / self.group_size()
    }
    /// Head dimension of Q and K.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Head dimension of V and O.
    pub fn head_dim_v(&self) -> usize {
        self.head_dim_v
    }
    /// The resolved softmax scale.
    pub fn softmax_scale(&self) -> f32 {
        self.softmax_scale
    }
    /// The softcap, if any.
    pub fn softcap(&self) -> Option<f32> {
        self.softcap
    }
    /// The mask.
    pub fn mask(&self) -> Mask {
        self.mask
    }
    /// Where K and V live (a KV cache, or exactly the sequences' keys).
    pub fn kv_cache(&self) -> KvCache<'a> {
        self.kv_cache
    }
    /// Whether K and V are read from a KV cache (padded or paged).
    pub fn has_kv_cache(&self) -> bool {
        self.kv_cache != KvCache::None
    }
    /// The learnable attention sinks, when set: one finite natural-log logit `s_h` per query
    /// head (validated), joining every row's softmax denominator with no value:
    /// `O_i = Σ_j exp(x_ij − m)·V_j / (exp(s_h − m) + Σ_j exp(x_ij − m))`, `x` the scaled,
    /// softcapped, masked scores (the sink itself is neither scaled nor softcapped). The LSE
    /// includes the sink; a row that sees no key gets O = 0 and LSE = `s_h`. Backends fold it
    /// in with [`crate::RowState::finish_with_sink`] and differentiate it with
    /// [`crate::sink_grad_term`].
    pub fn sinks(&self) -> Option<&'a [f32]> {
        self.sinks
    }
    /// Query head `head_q`'s sink logit in the log2 domain of the row states
    /// (`s_h·log2 e`, rounded to `T`), for [`crate::RowState::finish_with_sink`]; `None`
    /// without sinks (or for a head out of range).
    #[inline]
    pub fn sink_log2<T: num_traits::Float>(&self, head_q: usize) -> Option<T> {
        let s = *self.sinks?.get(head_q)?;
        T::from(s as f64 * crate::score::LOG2_E)
    }
    /// Strides of Q, K, V and O.
    pub fn strides(&self) -> [Strides; 4] {
        [self.q, self.k, self.v, self.o]
    }
    /// The score transform (scale, softcap, log2 domain) in precision `T`.
    pub fn score_transform<T: num_traits::Float>(&self) -> ScoreTransform<T> {
        ScoreTransform::new(self.softmax_scale as f64, self.softcap.map(|c| c as f64))
    }

    /// Token ranges of sequence `b` (`b < batch`), or `None` when the prefix sums are on the
    /// device ([`Sequences::VarlenDevice`]).
    pub fn try_seq(&self, b: usize) -> Option<SeqSpan> {
        self.has_host_seqlens().then(|| self.seq(b))
    }

    /// Token ranges of sequence `b` (`b < batch`). With a KV cache, `seqlen_k` is the
    /// sequence's used length. For [`Sequences::VarlenDevice`] the host does not know the
    /// ranges: an empty span (check [`Problem::has_host_seqlens`] or use [`Problem::try_seq`]).
    pub fn seq(&self, b: usize) -> SeqSpan {
        match self.sequences {
            Sequences::VarlenDevice { .. } => SeqSpan {
                q_start: 0,
                seqlen_q: 0,
                k_start: 0,
                seqlen_k: 0,
            },
            Sequences::Fixed {
                seqlen_q, seqlen_k, ..
            } => SeqSpan {
                q_start: 0,
                seqlen_q,
                k_start: 0,
                seqlen_k: self.kv_cache.used(b).unwrap_or(seqlen_k),
            },
            Sequences::Varlen {
                cu_seqlens_q,
                cu_seqlens_k,
            } => SeqSpan {
                q_start: cu_seqlens_q[b] as usize,
                seqlen_q: (cu_seqlens_q[b + 1] - cu_seqlens_q[b]) as usize,
                k_start: cu_seqlens_k[b] as usize,
                seqlen_k: (cu_seqlens_k[b + 1] - cu_seqlens_k[b]) as usize,
            },
        }
    }

    #[inline]
    fn offset(&self, s: &Strides, b: usize, token: usize, head: usize) -> usize {
        // Packed tensors have no batch dimension: `token` is already global there.
        let batch_part = if self.is_varlen() { 0 } else { b * s.batch };
        batch_part + token * s.seq + head * s.head
    }

    /// Offset of Q's row for sequence `b`, query `i` (within the sequence), head `h`.
    #[inline]
    pub fn q_offset(&self, b: usize, i: usize, h: usize) -> usize {
        self.offset(&self.q, b, self.seq(b).q_start + i, h)
    }
    /// Offset of K's row for sequence `b`, key `j`, KV head `h_kv`.
    #[inline]
    pub fn k_offset(&self, b: usize, j: usize, h_kv: usize) -> usize {
        self.kv_offset(&self.k, b, j, h_kv)
    }
    /// Offset of V's row for sequence `b`, key `j`, KV head `h_kv`.
    #[inline]
    pub fn v_offset(&self, b: usize, j: usize, h_kv: usize) -> usize {
        self.kv_offset(&self.v, b, j, h_kv)
    }

    #[inline]
    fn kv_offset(&self, s: &Strides, b: usize, j: usize, h_kv: usize) -> usize {
        if let KvCache::Paged {
            block_table,
            blocks_per_seq,
            block_size,
            ..
        } = self.kv_cache
        {
            // Validated: the entry is a block of the cache for every used key.
            let block = block_table[b * blocks_per_seq + j / block_size] as usize;
            return block * s.batch + (j % block_size) * s.seq + h_kv * s.head;
        }
        self.offset(s, b, self.seq(b).k_start + j, h_kv)
    }
    /// Offset of O's row for sequence `b`, query `i`, head `h`.
    #[inline]
    pub fn o_offset(&self, b: usize, i: usize, h: usize) -> usize {
        self.offset(&self.o, b, self.seq(b).q_start + i, h)
    }

    /// Entries of the LSE buffer: `[batch, heads_q, seqlen_q]` dense, `[heads_q, total_q]`
    /// packed (FlashAttention's layouts).
    pub fn lse_len(&self) -> usize {
        // total_q first: an empty problem validates whatever its batch and heads, whose
        // product alone may not fit; with total_q > 0 validation bounded the whole product.
        if self.is_varlen() {
            self.total_q * self.heads_q
        } else {
            self.total_q * self.heads_q * self.batch
        }
    }
    /// Index into the LSE buffer for sequence `b`, head `h`, query `i`.
    #[inline]
    pub fn lse_offset(&self, b: usize, h: usize, i: usize) -> usize {
        if self.is_varlen() {
            h * self.total_q + self.seq(b).q_start + i
        } else {
            (b * self.heads_q + h) * self.total_q + i
        }
    }
}
