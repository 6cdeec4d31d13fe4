// The pre-pass and post-pass of the sm80 backward (one warp per (query row, head); grid
// (ceil(max_seqlen_q / 64), heads_q, batch), 256 threads, each warp 8 rows):
//
//   flash_bwd_dot_do_o   D = rowsum(dO * O) in f32, LSE2 = LSE * log2(e) (+inf for a row that
//                        saw no key, LSE -inf, so that every P of it is exp2(-inf) = 0), and the
//                        row's f32 dQ accumulator zeroed;
//   flash_bwd_convert_dq dQ = scale * accumulator, rounded to the inputs' dtype, laid out as Q.
//
// Defines: IS_BF16 (1: bf16, 0: fp16).
#ifndef IS_BF16
#error "bwd_sm80/prep.cu needs IS_BF16"
#endif

#include "bwd_sm80/params.cuh"

#ifdef FA_COMPILE_CHECK_NONCE
__device__ const int fa_compile_check_nonce = FA_COMPILE_CHECK_NONCE;
#endif

#define ROWS_PER_CTA 64
#define ROWS_PER_WARP 8
#define LOG2E_F 1.4426950408889634f

struct alignas(16) f32x4 { float x, y, z, w; };

extern "C" __global__ void __launch_bounds__(256) flash_bwd_dot_do_o(const AttnParams p) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.y, b = blockIdx.z;
    int q_start, sq, k_start, sk;
    bwd_sequence(p, b, q_start, sq, k_start, sk);
    const u16* o = reinterpret_cast<const u16*>(p.o);
    const u16* d_o = reinterpret_cast<const u16*>(p.d_o);
    const float* lse = reinterpret_cast<const float*>(p.lse);
    float* dsum = reinterpret_cast<float*>(p.dsum);
    float* lse2 = reinterpret_cast<float*>(p.lse2);
    float* acc = reinterpret_cast<float*>(p.dq_acc);
#pragma unroll 1
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int i = blockIdx.x * ROWS_PER_CTA + warp * ROWS_PER_WARP + r;
        if (i >= sq) break;
        const i64 off = b * p.o_bs + (i64)(q_start + i) * p.o_ss + h * p.o_hs;
        float sum = 0.0f;
        for (int c = lane; c * 8 < p.head_dim_v; c += 32) {
            const u32x4 x = *reinterpret_cast<const u32x4*>(o + off + c * 8);
            const u32x4 y = *reinterpret_cast<const u32x4*>(d_o + off + c * 8);
            const u32 xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x0, x1, y0, y1;
                unpack2<IS_BF16 != 0>(xs[e], x0, x1);
                unpack2<IS_BF16 != 0>(ys[e], y0, y1);
                sum = fmaf(x0, y0, sum);
                sum = fmaf(x1, y1, sum);
            }
        }
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) sum += shfl_xor(sum, m);
        const i64 row = b * p.lse_bs + h * p.lse_hs + q_start + i;
        if (lane == 0) {
            const float l = lse[row];
            dsum[row] = sum;
            lse2[row] = l == NEG_INF ? -NEG_INF : l * LOG2E_F;
        }
        f32x4* a = reinterpret_cast<f32x4*>(acc + row * p.head_dim);
        for (int c = lane; c * 4 < p.head_dim; c += 32) a[c] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};
    }
}

extern "C" __global__ void __launch_bounds__(256) flash_bwd_convert_dq(const AttnParams p) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.y, b = blockIdx.z;
    int q_start, sq, k_start, sk;
    bwd_sequence(p, b, q_start, sq, k_start, sk);
    const float* acc = reinterpret_cast<const float*>(p.dq_acc);
    u16* dq = reinterpret_cast<u16*>(p.dq);
#pragma unroll 1
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int i = blockIdx.x * ROWS_PER_CTA + warp * ROWS_PER_WARP + r;
        if (i >= sq) break;
        const i64 row = b * p.lse_bs + h * p.lse_hs + q_start + i;
        const f32x4* a = reinterpret_cast<const f32x4*>(acc + row * p.head_dim);
        u16* dst = dq + b * p.q_bs + (i64)(q_start + i) * p.q_ss + h * p.q_hs;
        for (int c = lane; c * 8 < p.head_dim; c += 32) {
            const f32x4 lo = a[2 * c], hi = a[2 * c + 1];
            u32x4 out;
            out.x = pack2<IS_BF16 != 0>(lo.x * p.scale, lo.y * p.scale);
            out.y = pack2<IS_BF16 != 0>(lo.z * p.scale, lo.w * p.scale);
            out.z = pack2<IS_BF16 != 0>(hi.x * p.scale, hi.y * p.scale);
            out.w = pack2<IS_BF16 != 0>(hi.z * p.scale, hi.w * p.scale);
            *reinterpret_cast<u32x4*>(dst + c * 8) = out;
        }
    }
}
