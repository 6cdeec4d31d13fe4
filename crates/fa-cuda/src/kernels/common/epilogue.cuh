// The end of a forward row (RowState::finish): 1/l that normalises the output and the natural-log
// LSE; a row that saw no key gives 0 and -inf, a NaN sum propagates. (Writing O stays with each
// family: it follows the family's shared-memory layout.)
#ifndef FA_COMMON_EPILOGUE_CUH
#define FA_COMMON_EPILOGUE_CUH

#include "common/softmax.cuh"

#define LN2 0.6931471805599453f

// `l` is this lane's partial sum of the row (summed over the quad here), `m` the row's reference
// in the log2 domain.
static __device__ __forceinline__ void finish_row(float l, float m, float& inv, float& lse) {
    l = quad_sum(l);
    if (l > 0.0f) {
        inv = 1.0f / l;
        lse = (m + lg2(l)) * LN2;
    } else if (l == l) {
        inv = 0.0f;
        lse = NEG_INF;
    } else {
        inv = l; // NaN propagates
        lse = l;
    }
}

#endif // FA_COMMON_EPILOGUE_CUH
