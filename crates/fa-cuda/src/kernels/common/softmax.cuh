// Online-softmax steps shared by the kernel families; they mirror softmax-core's `RowState`
// (`begin_block`, `add_sum`, `finish`): scores in the scaled log2 domain, threshold rescale with
// tau (0: always), an all-masked row keeps its reference at -inf and uses offset 0.
#ifndef FA_COMMON_SOFTMAX_CUH
#define FA_COMMON_SOFTMAX_CUH

#include "common/mask.cuh"

static __device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
static __device__ __forceinline__ float lg2(float x) {
    float y;
    asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// tanh through exp2: tanh(y) = 1 - 2 / (2^(2 y log2 e) + 1); exact limits at +-inf.
static __device__ __forceinline__ float tanh_f(float y) {
    const float e = ex2(y * 2.8853900817779268f);
    return 1.0f - 2.0f / (e + 1.0f);
}

// Max over the four lanes of a quad (the lanes holding one row of an mma fragment).
static __device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, shfl_xor(x, 1));
    x = fmaxf(x, shfl_xor(x, 2));
    return x;
}
// Sum over the four lanes of a quad.
static __device__ __forceinline__ float quad_sum(float x) {
    x += shfl_xor(x, 1);
    x += shfl_xor(x, 2);
    return x;
}

// RowState::begin_block with the threshold policy: whether the row moves its reference from m
// to the block max bm (log2 domain), and the factor the row's sum and accumulator take (1 when
// it stays). Without short-circuits and with the exponent computed either way: a branch here
// would split the softmax into blocks that ptxas schedules separately.
static __device__ __forceinline__ bool rescale_vote(float bm, float m, float tau, float& corr) {
    const bool move = (bm > m) & ((m == NEG_INF) | (bm - m > tau));
    // exp2(-inf - bm) = 0 when m = -inf: the (empty) accumulator is zeroed.
    const float c_move = ex2(m - bm);
    corr = move ? c_move : 1.0f;
    return move;
}

// The exponent offset of a row with reference m: an all-masked row (m = -inf) uses 0.
static __device__ __forceinline__ float exp_offset(float m) {
    return m == NEG_INF ? 0.0f : m;
}

#endif // FA_COMMON_SOFTMAX_CUH
