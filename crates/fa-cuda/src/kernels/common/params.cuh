// The one parameter block of the attention kernels: the forward families (sm80's flash_fwd,
// sm90's flash_fwd), the decode family (flash_decode, flash_decode_combine, append_kv) and the
// sm80 backward (flash_bwd_dot_do_o, flash_bwd, flash_bwd_convert_dq) all take
// `const AttnParams p` by value. Each kernel reads the fields of its pass; the others are
// zero. The Rust side's `Params` (src/params.rs) has the same #[repr(C)] layout (its size and
// field offsets are asserted there, the size here).
#ifndef FA_COMMON_PARAMS_CUH
#define FA_COMMON_PARAMS_CUH

#include "common/ptx.cuh"

struct AttnParams {
    u64 q, k, v, o, lse;          // device pointers (lse may be 0)
    u64 cu_q, cu_k;               // forward, varlen: int32 prefix sums [batch + 1], or 0
    u64 seqused_k;                // decode: int32 [batch], keys used per sequence
    u64 block_table;              // decode: int32 [batch, blocks_per_seq] (paged), or 0
    u64 block_walk;               // decode: int32 [batch, 2, blocks_per_seq] (paged, address-order walk), or 0
    u64 o_part, ml_part;          // decode: f32 workspace [splits, batch, heads_q, seqlen_q, head_dim_v] and [.., 2] (m, l)
    u64 k_new, v_new;             // append_kv: the new tokens
    u64 d_o;                      // backward: dO, laid out as o
    u64 dq, dk, dv;               // backward: the gradients, laid out as q, k, v
    u64 dsum, lse2, dq_acc;       // backward workspace: D and LSE*log2(e) per row, f32 dQ sums
    i64 q_bs, q_ss, q_hs;         // element strides: batch, token, head (the backward: dq, dk, dv, d_o too)
    i64 k_bs, k_ss, k_hs;         // paged: k_bs steps over blocks, k_ss over a block's rows
    i64 v_bs, v_ss, v_hs;
    i64 o_bs, o_ss, o_hs;
    i64 kn_bs, kn_ss, kn_hs;      // append_kv: strides of the new K
    i64 vn_bs, vn_ss, vn_hs;      // append_kv: strides of the new V
    i64 lse_bs, lse_hs;           // LSE index = b*lse_bs + h*lse_hs + (q_start +) i
    int seqlen_q, seqlen_k;       // forward: dense lengths (varlen: the totals); decode: queries per sequence
    int capacity;                 // decode: keys a sequence can hold (padded seqlen_k, or blocks_per_seq*block_size)
    int group;                    // heads_q / heads_kv
    int head_dim, head_dim_v;
    int win_left, win_right;      // window, -1 = unbounded (decode: bottom-right against seqused_k)
    int rows;                     // decode: group * seqlen_q, rows of one KV head's tile
    int num_m_blocks;
    int num_splits;               // decode: key splits
    int block_size;               // decode, paged: keys per block; 0: padded cache
    int blocks_per_seq, num_blocks;
    int batch, heads_q;           // decode
    int seqlen_new;               // append_kv: new tokens per sequence
    float pre;                    // scale*log2(e), or scale/cap with softcap
    float softcap_post;           // cap*log2(e) with softcap
    float tau;                    // rescale threshold (log2 units); 0 = always
    float scale;                  // backward: the softmax scale (applied to dK and dQ)
    float pad_;
};

static_assert(sizeof(AttnParams) == 416, "AttnParams layout");

#endif // FA_COMMON_PARAMS_CUH
