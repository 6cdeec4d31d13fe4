// The warp-level steps of one K/V tile on mma.sync m16n8k16 fragments, shared by the sm80
// forward and the decode kernel: S = Q K^T from swizzled shared memory, the scores (scale or
// softcap, and the [lo, hi) key mask), the online softmax's block step (softmax-core's
// RowState::begin_block with the threshold rule, then the exponentials and the row sums), P
// kept in registers as the A operand, and O += P V. A warp owns kM m-tiles of 16 rows; its
// S holds kN n-tiles of 8 keys; O holds kD n-tiles of 8 columns. Fragment element e of a
// thread (lane = 4 g + tig) sits at row g + 8 (e >> 1) and column 2 tig + (e & 1).
//
// Shared-memory operands are 16-bit rows of kRowBytes (a multiple of 128) in the 128-byte
// XOR swizzle; the callers pass each lane's ldmatrix addresses for the first 16-byte chunks of
// the four k-steps of a swizzle period (q_addr, k_addr, v_addr) and the tile's byte offset.
// Template parameters are named kX: the kernels define their tile sizes as macros (MT, NT...).
#ifndef FA_COMMON_TILE_CUH
#define FA_COMMON_TILE_CUH

#include "common/mask.cuh"
#include "common/ptx.cuh"
#include "common/softmax.cuh"

// S = Q K^T over kKQ k-steps of 16 (in groups of four: one swizzle period). kUnroll: how
// many groups are unrolled (1 keeps the group loop rolled).
template <int kM, int kN, int kKQ, int kUnroll, bool kBf16, int kRowBytes>
static __device__ __forceinline__ void tile_qk(float (&s)[kM][kN][4], const u32 (&q_addr)[4],
                                               const u32 (&k_addr)[4], const u32 k_offset) {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
        for (int j = 0; j < kN; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][j][e] = 0.0f;
#pragma unroll kUnroll
    for (int kg = 0; kg < kKQ / 4; ++kg)
#pragma unroll
        for (int kj = 0; kj < 4; ++kj) {
            u32 a[kM][4];
#pragma unroll
            for (int mt = 0; mt < kM; ++mt)
                ldsm_x4(q_addr[kj] + mt * 16 * kRowBytes + kg * 128, a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
#pragma unroll
            for (int np = 0; np < kN / 2; ++np) {
                u32 b0, b1, b2, b3;
                ldsm_x4(k_addr[kj] + k_offset + np * 16 * kRowBytes + kg * 128, b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < kM; ++mt) {
                    mma16816<kBf16>(s[mt][2 * np], a[mt], b0, b1);
                    mma16816<kBf16>(s[mt][2 * np + 1], a[mt], b2, b3);
                }
            }
        }
}

// The scores of a warp's kN n-tiles of 8 keys, n-tile j holding keys col0[j] .. col0[j] + 7.
// kGeneral: x = t(s * pre) (softcap, or a non-positive scale) before the max; otherwise
// pre > 0 and the scale folds into the exponent later. kMasked: keys outside each row's
// [lo, hi) become -inf (the key tail, causal and window bounds); a tile known to lie inside
// every valid row's bounds skips the selects.
template <int kM, int kN, bool kGeneral, bool kMasked>
static __device__ __forceinline__ void tile_scores_at(float (&s)[kM][kN][4], const int (&col0)[kN], const int tig,
                                                      const int (&row_lo)[kM][2], const int (&row_hi)[kM][2],
                                                      const float pre, const float softcap_post) {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
        for (int j = 0; j < kN; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[mt][j][e];
                if constexpr (kGeneral) {
                    x = softcap_post != 0.0f ? tanh_f(x * pre) * softcap_post : x * pre;
                }
                if constexpr (kMasked) {
                    const int col = col0[j] + 2 * tig + (e & 1);
                    const int hh = e >> 1;
                    x = MASK_SCORE(x, col, row_lo[mt][hh], row_hi[mt][hh]);
                }
                s[mt][j][e] = x;
            }
}

// The scores of keys n0 .. n0 + 8 kN - 1 (consecutive keys: see tile_scores_at).
template <int kM, int kN, bool kGeneral, bool kMasked>
static __device__ __forceinline__ void tile_scores(float (&s)[kM][kN][4], const int n0, const int tig,
                                                   const int (&row_lo)[kM][2], const int (&row_hi)[kM][2],
                                                   const float pre, const float softcap_post) {
    int col0[kN];
#pragma unroll
    for (int j = 0; j < kN; ++j) col0[j] = n0 + 8 * j;
    tile_scores_at<kM, kN, kGeneral, kMasked>(s, col0, tig, row_lo, row_hi, pre, softcap_post);
}

// The online softmax's block step (RowState::begin_block with the threshold policy; tau = 0
// is `Always`): each row's block max (four interleaved partial maxima: short dependency
// chains), the rescale vote, and the rows' sums and accumulators rescaled where they move.
template <int kM, int kN, int kD, bool kGeneral>
static __device__ __forceinline__ void tile_rescale(const float (&s)[kM][kN][4], float (&row_m)[kM][2],
                                                    float (&row_l)[kM][2], float (&acc)[kM][kD][4],
                                                    const float pre, const float tau) {
    float corr[kM][2];
    bool any_rescale = false;
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float part[4];
#pragma unroll
            for (int j = kN; j < 4; ++j) part[j] = NEG_INF;
#pragma unroll
            for (int j = 0; j < kN; ++j) {
                const float pair = fmaxf(s[mt][j][2 * hh], s[mt][j][2 * hh + 1]);
                part[j & 3] = j < 4 ? pair : fmaxf(part[j & 3], pair);
            }
            float bm = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
            bm = quad_max(bm);
            if constexpr (!kGeneral) bm *= pre; // pre > 0: -inf stays -inf
            const float m = row_m[mt][hh];
            float c;
            const bool move = rescale_vote(bm, m, tau, c);
            row_m[mt][hh] = move ? bm : m;
            row_l[mt][hh] *= c;
            any_rescale |= move;
            corr[mt][hh] = c;
        }
    if (warp_any(any_rescale)) {
#pragma unroll
        for (int mt = 0; mt < kM; ++mt)
#pragma unroll
            for (int d = 0; d < kD; ++d) {
                acc[mt][d][0] *= corr[mt][0];
                acc[mt][d][1] *= corr[mt][0];
                acc[mt][d][2] *= corr[mt][1];
                acc[mt][d][3] *= corr[mt][1];
            }
    }
}

// P = exp2(x - offset) (four interleaved partial row sums added to row_l), packed into the A
// operand of O += P V: kKP k-steps of 16 keys (kN = 2 kKP).
template <int kM, int kN, int kKP, bool kBf16, bool kGeneral>
static __device__ __forceinline__ void tile_exp(float (&s)[kM][kN][4], const float (&row_m)[kM][2],
                                                float (&row_l)[kM][2], u32 (&pa)[kM][kKP][4], const float pre) {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) {
        const float off0 = exp_offset(row_m[mt][0]);
        const float off1 = exp_offset(row_m[mt][1]);
        float sum0[4], sum1[4];
#pragma unroll
        for (int j = kN; j < 4; ++j) sum0[j] = sum1[j] = 0.0f;
#pragma unroll
        for (int j = 0; j < kN; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float off = e < 2 ? off0 : off1;
                if constexpr (kGeneral) {
                    s[mt][j][e] = ex2(s[mt][j][e] - off);
                } else {
                    s[mt][j][e] = ex2(fmaf(s[mt][j][e], pre, -off));
                }
            }
            const float pair0 = s[mt][j][0] + s[mt][j][1], pair1 = s[mt][j][2] + s[mt][j][3];
            sum0[j & 3] = j < 4 ? pair0 : sum0[j & 3] + pair0;
            sum1[j & 3] = j < 4 ? pair1 : sum1[j & 3] + pair1;
        }
        sum0[0] = (sum0[0] + sum0[1]) + (sum0[2] + sum0[3]);
        sum1[0] = (sum1[0] + sum1[1]) + (sum1[2] + sum1[3]);
        row_l[mt][0] += sum0[0];
        row_l[mt][1] += sum1[0];
#pragma unroll
        for (int kp = 0; kp < kKP; ++kp) {
            pa[mt][kp][0] = pack2<kBf16>(s[mt][2 * kp][0], s[mt][2 * kp][1]);
            pa[mt][kp][1] = pack2<kBf16>(s[mt][2 * kp][2], s[mt][2 * kp][3]);
            pa[mt][kp][2] = pack2<kBf16>(s[mt][2 * kp + 1][0], s[mt][2 * kp + 1][1]);
            pa[mt][kp][3] = pack2<kBf16>(s[mt][2 * kp + 1][2], s[mt][2 * kp + 1][3]);
        }
    }
}

// O += P V over the tile's kKP k-steps of 16 keys (V rows by transposing ldmatrix).
template <int kM, int kKP, int kD, bool kBf16, int kRowBytes>
static __device__ __forceinline__ void tile_pv(float (&acc)[kM][kD][4], const u32 (&pa)[kM][kKP][4],
                                               const u32 (&v_addr)[4], const u32 v_offset) {
#pragma unroll
    for (int kp = 0; kp < kKP; ++kp) {
#pragma unroll
        for (int dp = 0; dp < kD / 2; ++dp) {
            u32 b0, b1, b2, b3;
            ldsm_x4_trans(v_addr[dp & 3] + v_offset + kp * 16 * kRowBytes + (dp >> 2) * 128, b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < kM; ++mt) {
                mma16816<kBf16>(acc[mt][2 * dp], pa[mt][kp], b0, b1);
                mma16816<kBf16>(acc[mt][2 * dp + 1], pa[mt][kp], b2, b3);
            }
        }
    }
}

#endif // FA_COMMON_TILE_CUH
