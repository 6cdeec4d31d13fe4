// The combine step of split-KV decode: merges the splits' partial rows (unnormalised f32
// accumulators and (m, l) in the workspace that flash_decode wrote) with softmax-core's merge
// (common/merge.cuh), in split order, then finishes each row (RowState::finish) and writes O in
// the input dtype and the LSE. One warp per row; lane j owns columns 8j..8j+7 (head_dim_v is a
// multiple of 8, at most 256). Defines: IS_BF16.

#if !defined(IS_BF16)
#error "decode/combine.cu needs IS_BF16"
#endif

#include "common/merge.cuh"
#include "common/params.cuh"

#define WARPS 4

#ifdef FA_COMPILE_CHECK_NONCE
__device__ const int fa_compile_check_nonce = FA_COMPILE_CHECK_NONCE;
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32) flash_decode_combine(const AttnParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // Launched as a programmatic dependent of flash_decode on sm_90+: wait until it has
    // completed and its workspace writes are visible (a no-op after an ordinary launch).
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
    const int lane = threadIdx.x & 31;
    const i64 rows = (i64)p.batch * p.heads_q * p.seqlen_q;
    const i64 r = (i64)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int i = (int)(r % p.seqlen_q);
    const int h = (int)((r / p.seqlen_q) % p.heads_q);
    const int b = (int)(r / ((i64)p.seqlen_q * p.heads_q));
    const int col = lane * 8;
    const bool active = col < p.head_dim_v;

    const float* ml = reinterpret_cast<const float*>(p.ml_part);
    const float* part = reinterpret_cast<const float*>(p.o_part);
    float m = NEG_INF, l = 0.0f;
    float o[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) o[c] = 0.0f;
    // Splits in groups of GROUP: all loads of a group first (independent of the merges, so
    // their latencies overlap), then the merges in split order. Each group costs one memory
    // latency; at batch 1 the plan takes ~33 splits, so 16 per group leaves 3 rounds (4: 9).
    constexpr int GROUP = 16;
    for (int s0 = 0; s0 < p.num_splits; s0 += GROUP) {
        float gm[GROUP], gl[GROUP];
        f32x4 gx[GROUP][2];
#pragma unroll
        for (int j = 0; j < GROUP; ++j) {
            const bool here = s0 + j < p.num_splits;
            const i64 prow = (i64)(here ? s0 + j : s0) * rows + r;
            gm[j] = here ? ml[prow * 2] : NEG_INF;
            gl[j] = here ? ml[prow * 2 + 1] : 0.0f;
            if (active) {
                const f32x4* src = reinterpret_cast<const f32x4*>(part + prow * p.head_dim_v + col);
                gx[j][0] = src[0];
                gx[j][1] = src[1];
            } else {
                gx[j][0] = gx[j][1] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};
            }
        }
#pragma unroll
        for (int j = 0; j < GROUP; ++j) {
            if (s0 + j >= p.num_splits) break;
            float fa, fb;
            merge_state(m, l, gm[j], gl[j], fa, fb);
            const f32x4 x0 = gx[j][0], x1 = gx[j][1];
            o[0] = o[0] * fa + x0.x * fb;
            o[1] = o[1] * fa + x0.y * fb;
            o[2] = o[2] * fa + x0.z * fb;
            o[3] = o[3] * fa + x0.w * fb;
            o[4] = o[4] * fa + x1.x * fb;
            o[5] = o[5] * fa + x1.y * fb;
            o[6] = o[6] * fa + x1.z * fb;
            o[7] = o[7] * fa + x1.w * fb;
        }
    }
    float inv, lse;
    finish_state(m, l, inv, lse);
    if (active) {
        u16* go = reinterpret_cast<u16*>(p.o) + b * p.o_bs + (i64)i * p.o_ss + (i64)h * p.o_hs + col;
        u32x4 v;
        v.x = pack2<IS_BF16 != 0>(o[0] * inv, o[1] * inv);
        v.y = pack2<IS_BF16 != 0>(o[2] * inv, o[3] * inv);
        v.z = pack2<IS_BF16 != 0>(o[4] * inv, o[5] * inv);
        v.w = pack2<IS_BF16 != 0>(o[6] * inv, o[7] * inv);
        *reinterpret_cast<u32x4*>(go) = v;
    }
    if (p.lse != 0 && lane == 0) reinterpret_cast<float*>(p.lse)[b * p.lse_bs + h * p.lse_hs + i] = lse;
}
