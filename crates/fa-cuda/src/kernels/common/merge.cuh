// softmax-core's merge (`RowState::merge`, `merge_into`) on the device: two partial rows over
// disjoint key sets, each a reference max `m` (log2 domain), a sum `l` of exp2(x - m) and an
// unnormalised accumulator, combine exactly. Split-KV decode merges its splits with this (the
// combine kernel) and the warps of one decode CTA merge their key slices with it too.
#ifndef FA_COMMON_MERGE_CUH
#define FA_COMMON_MERGE_CUH

#include "common/softmax.cuh"

// Merges (m_b, l_b) into (m, l); fa and fb are the factors the accumulators take:
// acc = acc * fa + acc_b * fb. Both rows empty (max -inf): the result stays empty and the
// factors are 1 (empty accumulators are zero), as in RowState::merge.
static __device__ __forceinline__ void merge_state(float& m, float& l, float m_b, float l_b, float& fa, float& fb) {
    const float mx = fmaxf(m, m_b);
    if (mx == NEG_INF) {
        m = NEG_INF;
        l = 0.0f;
        fa = 1.0f;
        fb = 1.0f;
        return;
    }
    fa = ex2(m - mx);
    fb = ex2(m_b - mx);
    l = l * fa + l_b * fb;
    m = mx;
}

// RowState::finish of a merged row (its sum already complete): 1/l and the natural-log LSE; a
// row that saw no key gives 0 and -inf, a NaN sum propagates (as common/epilogue.cuh's
// finish_row, without its quad sum).
static __device__ __forceinline__ void finish_state(float m, float l, float& inv, float& lse) {
    if (l > 0.0f) {
        inv = 1.0f / l;
        lse = (m + lg2(l)) * 0.6931471805599453f;
    } else if (l == l) {
        inv = 0.0f;
        lse = NEG_INF;
    } else {
        inv = l;
        lse = l;
    }
}

struct alignas(16) f32x4 { float x, y, z, w; };

#endif // FA_COMMON_MERGE_CUH
