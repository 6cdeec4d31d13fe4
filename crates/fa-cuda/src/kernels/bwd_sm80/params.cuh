// What the sm80 backward kernels (pre-pass, main kernel, post-pass) share besides their
// parameter block, which is every kernel's `AttnParams` (common/params.cuh).
#ifndef FA_BWD_SM80_PARAMS_CUH
#define FA_BWD_SM80_PARAMS_CUH

#include "common/mask.cuh"
#include "common/params.cuh"
#include "common/ptx.cuh"


// A sequence's query and key ranges in the packed tensors (dense: the whole tensors). Device
// prefix sums arrive unchecked: clamped to the packed tensors, as the forward does.
static __device__ __forceinline__ void bwd_sequence(const AttnParams& p, int b, int& q_start, int& sq,
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
