// The parameter block of the sm80 backward kernels (pre-pass, main kernel, post-pass); the
// Rust side's `BwdParams` (src/backward.rs) has the same #[repr(C)] layout.
#ifndef FA_BWD_SM80_PARAMS_CUH
#define FA_BWD_SM80_PARAMS_CUH

#include "common/mask.cuh"
#include "common/ptx.cuh"

struct BwdParams {
    u64 q, k, v, o, d_o, lse;           // inputs (lse: the forward's natural-log LSE)
    u64 dq, dk, dv;                     // gradients, laid out as q, k, v
    u64 dsum, lse2, dq_acc;             // workspace: D and LSE*log2(e) per row, f32 dQ sums
    u64 cu_q, cu_k;                     // varlen prefix sums (0: dense)
    i64 q_bs, q_ss, q_hs;               // element strides: batch, token, head (dq too)
    i64 k_bs, k_ss, k_hs;               // (dk too)
    i64 v_bs, v_ss, v_hs;               // (dv too)
    i64 o_bs, o_ss, o_hs;               // (d_o too)
    i64 lse_bs, lse_hs;                 // row index = b*lse_bs + h*lse_hs + q_start + i
    int seqlen_q, seqlen_k;             // dense lengths (varlen: the totals)
    int group;                          // heads_q / heads_kv
    int head_dim, head_dim_v;
    int win_left, win_right;            // window, -1 = unbounded
    int pad0;
    float pre;                          // scale*log2(e), or scale/cap with softcap
    float softcap_post;                 // cap*log2(e) with softcap, else 0
    float scale;                        // the softmax scale (applied to dK and dQ)
    float pad1;
};

// A sequence's query and key ranges in the packed tensors (dense: the whole tensors). Device
// prefix sums arrive unchecked: clamped to the packed tensors, as the forward does.
static __device__ __forceinline__ void bwd_sequence(const BwdParams& p, int b, int& q_start, int& sq,
                                                    int& k_start, int& sk) {
    q_start = 0;
    k_start = 0;
    sq = p.seqlen_q;
    sk = p.seqlen_k;
    if (p.cu_q != 0) {
        const u32* cq = reinterpret_cast<const u32*>(p.cu_q);
        const u32* ck = reinterpret_cast<const u32*>(p.cu_k);
        const u32 q0 = min(cq[b], (u32)p.seqlen_q), q1 = min(max(cq[b + 1], q0), (u32)p.seqlen_q);
        const u32 k0 = min(ck[b], (u32)p.seqlen_k), k1 = min(max(ck[b + 1], k0), (u32)p.seqlen_k);
        q_start = (int)q0;
        sq = (int)(q1 - q0);
        k_start = (int)k0;
        sk = (int)(k1 - k0);
    }
}

// Two packed 16-bit values to f32 (`lo` from the low half).
template <bool BF16>
static __device__ __forceinline__ void unpack2(u32 x, float& lo, float& hi) {
    if constexpr (BF16) {
        lo = __uint_as_float(x << 16);
        hi = __uint_as_float(x & 0xffff0000u);
    } else {
        asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
            : "=f"(lo), "=f"(hi) : "r"(x));
    }
}

#endif // FA_BWD_SM80_PARAMS_CUH
