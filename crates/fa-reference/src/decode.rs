//! Random decode problems over a KV cache, padded or paged, for the tests of every backend.

use crate::{Case, Rng, Rounding};
use softmax_core::{Mask, ProblemDesc};

/// The layout of a random cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheLayout {
    /// `[batch, capacity, heads_kv, head_dim]`.
    Padded {
        /// Keys each sequence can hold.
        capacity: usize,
    },
    /// `[num_blocks, block_size, heads_kv, head_dim]` through a shuffled block table.
    Paged {
        /// Keys per block.
        block_size: usize,
        /// Columns of the block table.
        blocks_per_seq: usize,
        /// Blocks in the cache (at least what the used lengths need; spare blocks hold noise).
        num_blocks: usize,
    },
}

/// A random decode problem that owns its cache, lengths and block table.
#[derive(Clone, Debug)]
pub struct DecodeCase {
    /// Sequences.
    pub batch: usize,
    /// New queries per sequence.
    pub seqlen_q: usize,
    /// Query heads.
    pub heads_q: usize,
    /// KV heads.
    pub heads_kv: usize,
    /// Head dim (Q, K, V alike).
    pub head_dim: usize,
    /// The cache layout.
    pub layout: CacheLayout,
    /// Keys used per sequence.
    pub seqused_k: Vec<u32>,
    /// Row-major `[batch, blocks_per_seq]` (empty for a padded cache); unused entries are −1.
    pub block_table: Vec<i32>,
    /// Mask (aligned bottom-right against each sequence's used length).
    pub mask: Mask,
    /// Softcap.
    pub softcap: Option<f32>,
    /// Attention sink logits, one per query head (`None`: no sinks).
    pub sinks: Option<Vec<f32>>,
    /// Queries `[batch, seqlen_q, heads_q, head_dim]`.
    pub q: Vec<f32>,
    /// The K cache.
    pub k: Vec<f32>,
    /// The V cache.
    pub v: Vec<f32>,
}

impl DecodeCase {
    /// A random cache: N(0,1) entries rounded as asked, every block of a paged cache in a
    /// shuffled order (so that neighbouring keys live in unrelated blocks).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rng: &mut Rng,
        seqused_k: &[u32],
        seqlen_q: usize,
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
        layout: CacheLayout,
        rounding: Rounding,
    ) -> DecodeCase {
        let batch = seqused_k.len();
        let block_table = match layout {
            CacheLayout::Padded { .. } => Vec::new(),
            CacheLayout::Paged {
                block_size,
                blocks_per_seq,
                num_blocks,
            } => {
                let mut free: Vec<i32> = (0..num_blocks as i32).collect();
                for i in (1..free.len()).rev() {
                    free.swap(i, rng.below(i + 1));
                }
                let mut table = vec![-1i32; batch * blocks_per_seq];
                for (b, &used) in seqused_k.iter().enumerate() {
                    for slot in 0..(used as usize).div_ceil(block_size) {
                        table[b * blocks_per_seq + slot] =
                            free.pop().expect("num_blocks covers the used lengths");
                    }
                }
                table
            }
        };
        let (outer, rows) = match layout {
            CacheLayout::Padded { capacity } => (batch, capacity),
            CacheLayout::Paged {
                block_size,
                num_blocks,
                ..
            } => (num_blocks, block_size),
        };
        let mut draw = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| rounding.apply(rng.normal() as f32))
                .collect()
        };
        let q = draw(batch * seqlen_q * heads_q * head_dim);
        let k = draw(outer * rows * heads_kv * head_dim);
        let v = draw(outer * rows * heads_kv * head_dim);
        DecodeCase {
            batch,
            seqlen_q,
            heads_q,
            heads_kv,
            head_dim,
            layout,
            seqused_k: seqused_k.to_vec(),
            block_table,
            mask: Mask::NONE,
            softcap: None,
            sinks: None,
            q,
            k,
            v,
        }
    }

    /// The smallest paged layout for these lengths, with a few spare blocks.
    pub fn paged_layout(seqused_k: &[u32], block_size: usize) -> CacheLayout {
        let longest = seqused_k.iter().copied().max().unwrap_or(0) as usize;
        let blocks_per_seq = longest.div_ceil(block_size).max(1) + 1;
        let used: usize = seqused_k
            .iter()
            .map(|&u| (u as usize).div_ceil(block_size))
            .sum();
        CacheLayout::Paged {
            block_size,
            blocks_per_seq,
            num_blocks: used + 3,
        }
    }

    /// Makes the mask causal (bottom-right against the used lengths).
    pub fn causal(mut self) -> DecodeCase {
        self.mask.right = Some(0);
        self
    }

    /// Sets the mask.
    pub fn with_mask(mut self, mask: Mask) -> DecodeCase {
        self.mask = mask;
        self
    }

    /// Sets the softcap.
    pub fn with_softcap(mut self, cap: f32) -> DecodeCase {
        self.softcap = Some(cap);
        self
    }

    /// Draws attention sinks, one per query head ([`crate::random_sinks`]).
    pub fn with_random_sinks(mut self, rng: &mut Rng) -> DecodeCase {
        self.sinks = Some(crate::random_sinks(rng, self.heads_q));
        self
    }

    /// Sets the attention sinks (one logit per query head).
    pub fn with_sinks(mut self, sinks: Vec<f32>) -> DecodeCase {
        self.sinks = Some(sinks);
        self
    }

    /// The problem description (borrows the lengths and the table).
    pub fn desc(&self) -> ProblemDesc<'_> {
        let capacity = match self.layout {
            CacheLayout::Padded { capacity } => capacity,
            CacheLayout::Paged { .. } => 0,
        };
        let mut desc = ProblemDesc::new(
            self.batch,
            self.seqlen_q,
            capacity,
            self.heads_q,
            self.heads_kv,
            self.head_dim,
        )
        .with_mask(self.mask);
        desc.softcap = self.softcap;
        desc.sinks = self.sinks.as_deref();
        match self.layout {
            CacheLayout::Padded { .. } => desc.padded_cache(&self.seqused_k),
            CacheLayout::Paged {
                block_size,
                blocks_per_seq,
                num_blocks,
            } => desc.paged_cache(
                &self.seqused_k,
                &self.block_table,
                blocks_per_seq,
                block_size,
                num_blocks,
            ),
        }
    }

    /// The same attention as a packed variable-length problem without a cache: each
    /// sequence's used keys gathered in order (an independent check of the cache addressing).
    pub fn gathered(&self) -> Case {
        let problem = match self.desc().validate(softmax_core::MAX_HEAD_DIM) {
            Ok(p) => p,
            Err(e) => panic!("invalid decode case: {e}"),
        };
        let qs = vec![self.seqlen_q as u32; self.batch];
        let mut rng = Rng::new(0);
        let mut case = Case::varlen(
            &mut rng,
            &qs,
            &self.seqused_k,
            self.heads_q,
            self.heads_kv,
            self.head_dim,
        )
        .with_mask(self.mask);
        case.softcap = self.softcap;
        case.sinks = self.sinks.clone();
        let d = self.head_dim;
        case.q.copy_from_slice(&self.q);
        let mut at = 0;
        for b in 0..self.batch {
            for j in 0..self.seqused_k[b] as usize {
                for h in 0..self.heads_kv {
                    let (ko, vo) = (problem.k_offset(b, j, h), problem.v_offset(b, j, h));
                    // Written by hand rather than through the offsets under test.
                    let (ko2, vo2) = self.cache_row(b, j, h);
                    assert_eq!((ko, vo), (ko2, vo2), "cache addressing");
                    case.k[at..at + d].copy_from_slice(&self.k[ko2..ko2 + d]);
                    case.v[at..at + d].copy_from_slice(&self.v[vo2..vo2 + d]);
                    at += d;
                }
            }
        }
        case
    }

    /// The element offset of key `j`, KV head `h` of sequence `b` in the K (and V) cache,
    /// from the layout's definition.
    pub fn cache_row(&self, b: usize, j: usize, h: usize) -> (usize, usize) {
        let row = self.heads_kv * self.head_dim;
        let at = match self.layout {
            CacheLayout::Padded { capacity } => (b * capacity + j) * row,
            CacheLayout::Paged {
                block_size,
                blocks_per_seq,
                ..
            } => {
                let block = self.block_table[b * blocks_per_seq + j / block_size] as usize;
                (block * block_size + j % block_size) * row
            }
        } + h * self.head_dim;
        (at, at)
    }
}
