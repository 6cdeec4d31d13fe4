// The parameter block of the decode family's kernels (flash_decode, flash_decode_combine,
// append_kv); the Rust side's `DecodeParams` (kernels/decode.rs) has the same #[repr(C)] layout.
#ifndef FA_DECODE_PARAMS_CUH
#define FA_DECODE_PARAMS_CUH

#include "common/ptx.cuh"

struct DecodeParams {
    u64 q, k, v, o, lse;          // device pointers (lse may be 0)
    u64 seqused_k;                // int32 [batch]: keys used per sequence
    u64 block_table;              // int32 [batch, blocks_per_seq] (paged), or 0
    u64 o_part, ml_part;          // f32 workspace: [splits, batch, heads_q, seqlen_q, head_dim_v] and [.., 2] (m, l)
    i64 q_bs, q_ss, q_hs;         // element strides: batch, token, head
    i64 k_bs, k_ss, k_hs;         // paged: k_bs steps over blocks, k_ss over a block's rows
    i64 v_bs, v_ss, v_hs;
    i64 o_bs, o_ss, o_hs;
    i64 lse_bs, lse_hs;           // LSE index = b*lse_bs + h*lse_hs + i
    int seqlen_q;                 // queries per sequence
    int capacity;                 // keys a sequence can hold (padded seqlen_k, or blocks_per_seq*block_size)
    int group;                    // heads_q / heads_kv
    int head_dim, head_dim_v;
    int win_left, win_right;      // window, -1 = unbounded (bottom-right against seqused_k)
    int rows;                     // group * seqlen_q: rows of one KV head's tile
    int num_m_blocks, num_splits;
    int block_size;               // paged: keys per block; 0: padded cache
    int blocks_per_seq, num_blocks;
    int batch, heads_q;
    float pre;                    // scale*log2(e), or scale/cap with softcap
    float softcap_post;           // cap*log2(e) with softcap
    float tau;                    // rescale threshold (log2 units); 0 = always
    int seqlen_new;               // append_kv: new tokens per sequence
    int pad_;
    u64 k_new, v_new;             // append_kv: the new tokens
    i64 kn_bs, kn_ss, kn_hs;      // append_kv: strides of the new K
    i64 vn_bs, vn_ss, vn_hs;      // append_kv: strides of the new V
    u64 block_walk;               // int32 [batch, 2, blocks_per_seq] (paged, address-order walk), or 0
};

// The size the Rust side asserts too (kernels/decode.rs, with its field offsets).
static_assert(sizeof(DecodeParams) == 336, "DecodeParams layout");

#endif // FA_DECODE_PARAMS_CUH
