//! Appending new key/value tokens to a KV cache in place (decode): the description
//! ([`AppendDesc`]), its validation into an [`Append`], and the offsets a backend copies
//! between.
//!
//! Token `i` of sequence `b`'s new keys goes to position `seqused_k[b] + i` of that sequence's
//! cache (padded: row `seqused_k[b] + i` of `[batch, seqlen_k, heads_kv, head_dim]`; paged:
//! row `(seqused_k[b] + i) % block_size` of block `block_table[b, (seqused_k[b] + i) /
//! block_size]`). The lengths are not changed here: the caller adds `seqlen_new` to
//! `seqused_k` and describes the attention call with the new lengths.

use crate::error::{ProblemError, Tensor};
use crate::problem::{check_no_overlap, extent, KvCache, Strides, MAX_HEAD_DIM};

/// An append of `seqlen_new` tokens per sequence to a KV cache, before validation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AppendDesc<'a> {
    /// The cache: `Padded` or `Paged`, with the current lengths (`seqused_k`, the positions
    /// the new tokens start at). `KvCache::None` is an error.
    pub cache: KvCache<'a>,
    /// Sequences (`seqused_k.len()`).
    pub batch: usize,
    /// Capacity per sequence of a padded cache (its `seqlen_k`; ignored when paged).
    pub seqlen_k: usize,
    /// New tokens per sequence.
    pub seqlen_new: usize,
    /// Key/value heads.
    pub heads_kv: usize,
    /// Head dimension of K.
    pub head_dim: usize,
    /// Head dimension of V.
    pub head_dim_v: usize,
    /// Strides of the K cache (`None`: contiguous; paged: `batch` steps over blocks).
    pub k_cache_strides: Option<Strides>,
    /// Strides of the V cache.
    pub v_cache_strides: Option<Strides>,
    /// Strides of the new keys `[batch, seqlen_new, heads_kv, head_dim]`.
    pub k_new_strides: Option<Strides>,
    /// Strides of the new values.
    pub v_new_strides: Option<Strides>,
}

impl<'a> AppendDesc<'a> {
    /// An append of `seqlen_new` tokens per sequence to `cache` (contiguous tensors,
    /// `head_dim_v = head_dim`); `seqlen_k` is a padded cache's capacity per sequence.
    pub fn new(
        cache: KvCache<'a>,
        seqlen_k: usize,
        seqlen_new: usize,
        heads_kv: usize,
        head_dim: usize,
    ) -> Self {
        let batch = match cache {
            KvCache::None => 0,
            KvCache::Padded { seqused_k } | KvCache::Paged { seqused_k, .. } => seqused_k.len(),
        };
        AppendDesc {
            cache,
            batch,
            seqlen_k,
            seqlen_new,
            heads_kv,
            head_dim,
            head_dim_v: head_dim,
            k_cache_strides: None,
            v_cache_strides: None,
            k_new_strides: None,
            v_new_strides: None,
        }
    }

    /// Checks the append: shapes, that every sequence keeps room for its new tokens (else
    /// [`ProblemError::CacheOverrun`] with `used` the length after the append), the block
    /// table (length, every entry up to the new length inside the cache), extents, and that
    /// the cache's strides never map two elements to one address (it is written).
    pub fn validate(&self) -> Result<Append<'a>, ProblemError> {
        if self.batch == 0 {
            return Err(ProblemError::ZeroDim { what: "batch" });
        }
        if self.heads_kv == 0 {
            return Err(ProblemError::ZeroDim { what: "heads_kv" });
        }
        for (what, d) in [("head_dim", self.head_dim), ("head_dim_v", self.head_dim_v)] {
            if d == 0 || d > MAX_HEAD_DIM {
                return Err(ProblemError::HeadDimOutOfRange {
                    what,
                    head_dim: d,
                    max: MAX_HEAD_DIM,
                });
            }
        }
        let seqused_k = match self.cache {
            KvCache::None => {
                return Err(ProblemError::Unsupported {
                    what: "an append needs a KV cache (padded or paged)",
                })
            }
            KvCache::Padded { seqused_k } | KvCache::Paged { seqused_k, .. } => seqused_k,
        };
        if seqused_k.len() != self.batch {
            return Err(ProblemError::CacheTableLength {
                tensor: Tensor::SequsedK,
                needed: self.batch,
                len: seqused_k.len(),
            });
        }
        let (capacity, outer, rows) = match self.cache {
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
                let needed = self
                    .batch
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
                (capacity, num_blocks, block_size)
            }
            _ => (self.seqlen_k, self.batch, self.seqlen_k),
        };
        for (b, &used) in seqused_k.iter().enumerate() {
            let end = (used as usize)
                .checked_add(self.seqlen_new)
                .ok_or(ProblemError::Overflow)?;
            if end > capacity {
                return Err(ProblemError::CacheOverrun {
                    batch: b,
                    used: end,
                    capacity,
                });
            }
            if let KvCache::Paged {
                block_table,
                blocks_per_seq,
                block_size,
                num_blocks,
                ..
            } = self.cache
            {
                let row = &block_table[b * blocks_per_seq..(b + 1) * blocks_per_seq];
                for (slot, &block) in row[..end.div_ceil(block_size)].iter().enumerate() {
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
        let (d, dv, h) = (self.head_dim, self.head_dim_v, self.heads_kv);
        let k_cache = self
            .k_cache_strides
            .unwrap_or(Strides::contiguous(rows, h, d));
        let v_cache = self
            .v_cache_strides
            .unwrap_or(Strides::contiguous(rows, h, dv));
        let k_new = self
            .k_new_strides
            .unwrap_or(Strides::contiguous(self.seqlen_new, h, d));
        let v_new = self
            .v_new_strides
            .unwrap_or(Strides::contiguous(self.seqlen_new, h, dv));
        let extents = [
            extent(outer, rows, h, d, &k_cache)?,
            extent(outer, rows, h, dv, &v_cache)?,
            extent(self.batch, self.seqlen_new, h, d, &k_new)?,
            extent(self.batch, self.seqlen_new, h, dv, &v_new)?,
        ];
        check_no_overlap(Tensor::K, outer, rows, h, d, &k_cache)?;
        check_no_overlap(Tensor::V, outer, rows, h, dv, &v_cache)?;
        Ok(Append {
            cache: self.cache,
            seqused_k,
            batch: self.batch,
            seqlen_new: self.seqlen_new,
            heads_kv: h,
            head_dim: d,
            head_dim_v: dv,
            strides: [k_cache, v_cache, k_new, v_new],
            extents,
        })
    }
}

/// Buffer lengths (elements) of an append, for [`Append::check_buffers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendLens {
    /// The K cache.
    pub k_cache: usize,
    /// The V cache.
    pub v_cache: usize,
    /// The new keys.
    pub k_new: usize,
    /// The new values.
    pub v_new: usize,
}

/// A validated append: the offsets to copy between.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Append<'a> {
    cache: KvCache<'a>,
    seqused_k: &'a [u32],
    batch: usize,
    seqlen_new: usize,
    heads_kv: usize,
    head_dim: usize,
    head_dim_v: usize,
    /// K cache, V cache, new K, new V.
    strides: [Strides; 4],
    extents: [usize; 4],
}

impl Append<'_> {
    /// Sequences.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// New tokens per sequence.
    pub fn seqlen_new(&self) -> usize {
        self.seqlen_new
    }
    /// Key/value heads.
    pub fn heads_kv(&self) -> usize {
        self.heads_kv
    }
    /// Head dim of K.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Head dim of V.
    pub fn head_dim_v(&self) -> usize {
        self.head_dim_v
    }

    /// The smallest buffer lengths that work.
    pub fn min_buffer_lens(&self) -> AppendLens {
        let [k_cache, v_cache, k_new, v_new] = self.extents;
        AppendLens {
            k_cache,
            v_cache,
            k_new,
            v_new,
        }
    }

    /// Checks that the buffers are long enough.
    pub fn check_buffers(&self, lens: AppendLens) -> Result<(), ProblemError> {
        let need = self.min_buffer_lens();
        for (tensor, len, needed) in [
            (Tensor::K, lens.k_cache, need.k_cache),
            (Tensor::V, lens.v_cache, need.v_cache),
            (Tensor::KNew, lens.k_new, need.k_new),
            (Tensor::VNew, lens.v_new, need.v_new),
        ] {
            if len < needed {
                return Err(ProblemError::BufferTooSmall {
                    tensor,
                    needed,
                    len,
                });
            }
        }
        Ok(())
    }

    /// The cache position (key index) new token `i` of sequence `b` goes to.
    pub fn position(&self, b: usize, i: usize) -> usize {
        self.seqused_k[b] as usize + i
    }

    /// Offset in the K cache (`v = false`) or V cache (`v = true`) of new token `i` of
    /// sequence `b`, KV head `h`.
    #[inline]
    pub fn cache_offset(&self, v: bool, b: usize, i: usize, h: usize) -> usize {
        let s = &self.strides[usize::from(v)];
        let j = self.position(b, i);
        match self.cache {
            KvCache::Paged {
                block_table,
                blocks_per_seq,
                block_size,
                ..
            } => {
                // Validated: the entry is a block of the cache up to the new length.
                let block = block_table[b * blocks_per_seq + j / block_size] as usize;
                block * s.batch + (j % block_size) * s.seq + h * s.head
            }
            _ => b * s.batch + j * s.seq + h * s.head,
        }
    }

    /// Offset in the new keys (`v = false`) or values (`v = true`) of token `i` of sequence
    /// `b`, KV head `h`.
    #[inline]
    pub fn new_offset(&self, v: bool, b: usize, i: usize, h: usize) -> usize {
        let s = &self.strides[2 + usize::from(v)];
        b * s.batch + i * s.seq + h * s.head
    }
}
