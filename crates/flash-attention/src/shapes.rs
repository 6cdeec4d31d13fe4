//! Benchmark shapes: the FlashAttention papers' sweep, the bytes a shape moves and its FLOP
//! count (softmax-core's one formula, [`softmax_core::flops::forward`]).

use softmax_core::{DType, ProblemDesc};

/// Tokens per tensor in the papers' sweep: `batch · seqlen = 16384`.
pub const PAPER_TOKENS: usize = 16384;
/// Hidden size of the papers' sweep: `heads · head_dim = 2048`.
pub const PAPER_HIDDEN: usize = 2048;
/// Sequence lengths of the papers' sweep.
pub const PAPER_SEQLENS: [usize; 6] = [512, 1024, 2048, 4096, 8192, 16384];
/// Head dimensions of the papers' sweep.
pub const PAPER_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// One dense benchmark shape (BSHD, contiguous).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct BenchShape {
    /// Sequences.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub heads_kv: usize,
    /// Queries per sequence.
    pub seqlen_q: usize,
    /// Keys per sequence.
    pub seqlen_k: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Causal (bottom-right aligned) mask.
    pub causal: bool,
}

impl BenchShape {
    /// The papers' shape of one sequence length and head dimension: `batch =
    /// 16384 / seqlen` (at least 1), `heads = 2048 / head_dim`, self-attention.
    pub fn paper(seqlen: usize, head_dim: usize, causal: bool) -> BenchShape {
        let heads = PAPER_HIDDEN / head_dim.max(1);
        BenchShape {
            batch: (PAPER_TOKENS / seqlen.max(1)).max(1),
            heads,
            heads_kv: heads,
            seqlen_q: seqlen,
            seqlen_k: seqlen,
            head_dim,
            causal,
        }
    }

    /// Forward FLOPs: `4·B·H·Nq·Nk·D`, halved when causal with `Nq = Nk`.
    pub fn flops(&self) -> f64 {
        softmax_core::flops::forward(
            self.batch,
            self.heads,
            self.seqlen_q,
            self.seqlen_k,
            self.head_dim,
            self.causal,
        )
    }

    /// FLOPs of one backward pass ([`softmax_core::flops::backward`]: 2.5 × the forward's).
    pub fn backward_flops(&self) -> f64 {
        softmax_core::flops::backward(
            self.batch,
            self.heads,
            self.seqlen_q,
            self.seqlen_k,
            self.head_dim,
            self.causal,
        )
    }

    /// Bytes a backward call reads and writes: [`BenchShape::io_bytes`] (Q, K, V, O, LSE)
    /// plus dO and the gradients dQ, dK, dV, all in `dtype`.
    pub fn backward_io_bytes(&self, dtype: DType) -> u64 {
        let (b, d) = (self.batch as u64, self.head_dim as u64);
        let q_like = 2 * b * self.seqlen_q as u64 * self.heads as u64 * d;
        let k_v = 2 * b * self.seqlen_k as u64 * self.heads_kv as u64 * d;
        self.io_bytes(dtype) + (q_like + k_v) * dtype.size() as u64
    }

    /// Bytes of Q, K, V and O in `dtype` plus the f32 LSE.
    pub fn io_bytes(&self, dtype: DType) -> u64 {
        let (b, d) = (self.batch as u64, self.head_dim as u64);
        let q_o = 2 * b * self.seqlen_q as u64 * self.heads as u64 * d;
        let k_v = 2 * b * self.seqlen_k as u64 * self.heads_kv as u64 * d;
        let lse = 4 * b * self.heads as u64 * self.seqlen_q as u64;
        (q_o + k_v) * dtype.size() as u64 + lse
    }

    /// The problem description (validate it before a call).
    pub fn desc(&self) -> ProblemDesc<'static> {
        let d = ProblemDesc::new(
            self.batch,
            self.seqlen_q,
            self.seqlen_k,
            self.heads,
            self.heads_kv,
            self.head_dim,
        );
        if self.causal {
            d.causal()
        } else {
            d
        }
    }
}

/// The FlashAttention papers' shapes: batch·seqlen = 16k tokens, hidden 2048 (heads =
/// 2048/head_dim), seqlen 512…16k, head_dim 64/128/256, non-causal and causal (36 shapes,
/// head dim outermost, then the mask, then the sequence length).
pub fn paper_shapes() -> Vec<BenchShape> {
    let mut shapes = Vec::new();
    for head_dim in PAPER_HEAD_DIMS {
        for causal in [false, true] {
            for seqlen in PAPER_SEQLENS {
                shapes.push(BenchShape::paper(seqlen, head_dim, causal));
            }
        }
    }
    shapes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_and_paper_shapes() {
        let s = BenchShape {
            batch: 2,
            heads: 3,
            heads_kv: 1,
            seqlen_q: 5,
            seqlen_k: 7,
            head_dim: 11,
            causal: true,
        };
        // seqlen_q ≠ seqlen_k: no halving.
        assert_eq!(s.flops(), 4.0 * 2.0 * 3.0 * 5.0 * 7.0 * 11.0);
        let sq = BenchShape { seqlen_k: 5, ..s };
        assert_eq!(sq.flops(), 2.0 * 2.0 * 3.0 * 5.0 * 5.0 * 11.0);
        assert_eq!(
            s.io_bytes(DType::Bf16),
            (2 * 2 * 5 * 3 * 11 + 2 * 2 * 7 * 11) * 2 + 4 * 2 * 3 * 5
        );
        let shapes = paper_shapes();
        assert_eq!(shapes.len(), 36);
        for s in shapes {
            assert_eq!(s.batch * s.seqlen_q, 16384);
            assert_eq!(s.heads * s.head_dim, 2048);
        }
    }

    #[test]
    fn paper_shape_of_one_point() {
        let s = BenchShape::paper(8192, 128, true);
        assert_eq!((s.batch, s.heads, s.heads_kv), (2, 16, 16));
        assert_eq!(
            s.desc().mask,
            softmax_core::Mask::from_flash_args(true, -1, -1)
        );
    }
}
