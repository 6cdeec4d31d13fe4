// FlashAttention-2 style backward kernel for sm_80 and newer (mma.sync.m16n8k16 with f32
// accumulation, ldmatrix, cp.async), written from the paper's algorithm on the forward's
// helpers (common/*.cuh). One CTA per (key block, KV head, sequence): it keeps its K and V tile
// in shared memory and its dK, dV accumulators in registers, and walks every query block of
// every query head of its GQA group that sees one of its keys:
//
//   S^T  = K Q^T                      (keys x queries: the key-major form, so that P^T and
//   P^T  = exp2(S^T*pre - LSE2)        dS^T stay in registers as the A operand of dV and dK)
//   dV  += P^T dO
//   dP^T = V dO^T
//   dS^T = P^T * (dP^T - D)           (times 1 - tanh^2 under a softcap)
//   dK  += dS^T Q                      (scaled once at the end)
//   dQ  += dS K                        (dS^T through shared memory; f32 atomics into the
//                                       workspace's accumulator, scaled by the post-pass)
//
// D and LSE2 = LSE*log2(e) come from the pre-pass (bwd_sm80/prep.cu); a row that saw no key
// has LSE2 = +inf, so its P and dS are 0. dK and dV are summed over the group's query heads
// inside the CTA in a fixed order (deterministic); dQ's atomics are not (the order of the key
// blocks' additions varies between runs).
//
// Defines:
//   HDP         head dim the tiles are laid out for (64, 128 or 256; smaller head dims are
//               zero-padded)
//   BLOCK_N     keys per CTA (16 per key warp)      BLOCK_M  queries per step (multiple of 64)
//   WARPS       warps per CTA = (BLOCK_N / 16) * DSPLIT
//   DSPLIT      the warps of one 16-key slab split dK/dV's columns in DSPLIT parts (each
//               recomputes the slab's S^T and dP^T): 2 at hdim 256, where the whole rows'
//               accumulators do not fit the registers
//   MIN_BLOCKS  CTAs per SM for __launch_bounds__
//   SUBS        the step's queries are processed in SUBS parts of BLOCK_M / SUBS (S^T, P^T,
//               dP^T and dS^T of one part live at a time: fewer registers beside dK and dV)
//   STAGES      1: one Q/dO buffer (the next block's load overlaps dQ's product); 2: double
//               buffered (the load overlaps the whole step)
//   QK_UNROLL   1: unroll every k-step of S^T and dP^T (more registers); 0: one swizzle period
//   RED_V2      1: dQ's f32 additions as 2-element vector reductions on sm_90 (half the
//               instructions); scalar atomics elsewhere
//   DQ_COLS     columns of one dQ item (64, or 32: fewer registers for its accumulator)
//   IS_BF16     1: bf16, 0: fp16
//   SOFTCAP     1: scores cap*tanh(s*scale/cap) and their derivative
//
// Masks: softmax-core's `Mask` (bottom-right aligned window, -1 unbounded) through
// common/mask.cuh's KEY_LO / KEY_HI, query blocks outside the key block's reach skipped.

#if !defined(HDP) || !defined(BLOCK_M) || !defined(BLOCK_N) || !defined(WARPS) || !defined(DSPLIT) || \
    !defined(MIN_BLOCKS) || !defined(STAGES) || !defined(IS_BF16) || !defined(SOFTCAP) || !defined(SUBS) || \
    !defined(QK_UNROLL) || !defined(RED_V2) || !defined(DQ_COLS)
#error "bwd_sm80/flash_bwd.cu needs HDP, BLOCK_M, BLOCK_N, WARPS, DSPLIT, SUBS, MIN_BLOCKS, STAGES, IS_BF16, SOFTCAP, QK_UNROLL, RED_V2, DQ_COLS"
#endif

#include "common/tile.cuh"
#include "bwd_sm80/params.cuh"

#ifdef FA_COMPILE_CHECK_NONCE
__device__ const int fa_compile_check_nonce = FA_COMPILE_CHECK_NONCE;
#endif

#define THREADS (WARPS * 32)
#define KW (BLOCK_N / 16)       // 16-key slabs (one per key warp)
#define DCOLS (HDP / DSPLIT)    // dK/dV columns per warp
#define NQS (BLOCK_M / 8 / SUBS) // 8-query n-tiles of S^T per part
#define KQ (HDP / 16)           // k-steps of S^T and dP^T
#define KPS (BLOCK_M / 16 / SUBS) // k-steps (queries) of dV and dK per part
#define DT (DCOLS / 8)          // 8-column n-tiles of dK/dV per warp
#define CHUNKS (HDP / 8)        // 16-byte chunks per smem row
#define ROW_BYTES (HDP * 2)
#define DS_ROW_BYTES (BLOCK_M * 2)
#define ELEM_BF16 (IS_BF16 != 0)
#define QK_GROUPS (QK_UNROLL ? KQ / 4 : 1)

#if (DQ_COLS != 64 && DQ_COLS != 32) || WARPS != KW * DSPLIT || (BLOCK_M % 64) != 0 || (BLOCK_M % (16 * SUBS)) != 0 || (HDP % 64) != 0 || (DCOLS % 64) != 0 || (BLOCK_N % 16) != 0
#error "bad backward tile configuration"
#endif
#if ((BLOCK_N * CHUNKS) % THREADS) != 0 || ((BLOCK_M * CHUNKS) % THREADS) != 0 || BLOCK_M > THREADS
#error "backward tile loads must divide evenly among threads"
#endif

// Byte offsets inside the dynamic shared memory: K, V (BLOCK_N rows), STAGES x Q and dO
// (BLOCK_M rows), dS^T (BLOCK_N x BLOCK_M), STAGES x LSE2 and D (BLOCK_M floats).
#define SK_OFF 0
#define SV_OFF (SK_OFF + BLOCK_N * ROW_BYTES)
#define SQ_OFF (SV_OFF + BLOCK_N * ROW_BYTES)
#define SDO_OFF (SQ_OFF + STAGES * BLOCK_M * ROW_BYTES)
#define SDS_OFF (SDO_OFF + STAGES * BLOCK_M * ROW_BYTES)
#define SL_OFF (SDS_OFF + BLOCK_N * DS_ROW_BYTES)
#define SD_OFF (SL_OFF + STAGES * BLOCK_M * 4)

// Element offset of (row, 16-byte chunk) in a swizzled HDP-column tile (the forward's swizzle).
static __device__ __forceinline__ int swz(int row, int chunk) {
    return row * HDP + ((chunk ^ (row & 7)) << 3);
}

// Copies ROWS rows of a tile (HDP columns; columns >= dim and rows >= rows_valid zero-filled)
// into swizzled smem with cp.async (the forward's load_tile).
template <int ROWS>
static __device__ __forceinline__ void load_tile(u16* s, const u16* g, i64 row_stride, int rows_valid, int dim, int tid) {
    const u32 base = smem_u32(s);
#if (THREADS % CHUNKS) == 0
    const int c = tid % CHUNKS, row0 = tid / CHUNKS;
    const bool col_ok = c * 8 < dim;
    const u16* src0 = g + row0 * row_stride + (col_ok ? c * 8 : 0);
    const i64 step = (i64)(THREADS / CHUNKS) * row_stride;
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
        const int row = row0 + i * (THREADS / CHUNKS);
        const bool row_ok = row < rows_valid;
        cp_async16(base + (u32)swz(row, c) * 2u, row_ok ? src0 + i * step : g, col_ok && row_ok);
    }
#else
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
        const int id = tid + i * THREADS;
        const int row = id / CHUNKS, c = id % CHUNKS;
        const bool ok = row < rows_valid && c * 8 < dim;
        const u16* src = ok ? g + row * row_stride + c * 8 : g;
        cp_async16(base + (u32)swz(row, c) * 2u, src, ok);
    }
#endif
}

// dst[0] += a, dst[1] += b in global memory (8-byte aligned), without a return value: one
// vector reduction on sm_90 where RED_V2 asks for it, two scalar ones otherwise.
static __device__ __forceinline__ void red_add2(float* dst, float a, float b) {
#if RED_V2 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}

// The C fragment of a warp's 16 x (8 kN) product as the A operand (kN / 2 k-steps of 16) of
// the next one, rounded to the 16-bit dtype (the forward's P packing).
template <int kN>
static __device__ __forceinline__ void pack_a(const float (&x)[1][kN][4], u32 (&a)[1][kN / 2][4]) {
#pragma unroll
    for (int kp = 0; kp < kN / 2; ++kp) {
        a[0][kp][0] = pack2<ELEM_BF16>(x[0][2 * kp][0], x[0][2 * kp][1]);
        a[0][kp][1] = pack2<ELEM_BF16>(x[0][2 * kp][2], x[0][2 * kp][3]);
        a[0][kp][2] = pack2<ELEM_BF16>(x[0][2 * kp + 1][0], x[0][2 * kp + 1][1]);
        a[0][kp][3] = pack2<ELEM_BF16>(x[0][2 * kp + 1][2], x[0][2 * kp + 1][3]);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) flash_bwd(const AttnParams p) {
    extern __shared__ __attribute__((aligned(128))) unsigned char smem_raw[];
    u16* sK = reinterpret_cast<u16*>(smem_raw + SK_OFF);
    u16* sV = reinterpret_cast<u16*>(smem_raw + SV_OFF);
    u16* sQ = reinterpret_cast<u16*>(smem_raw + SQ_OFF);
    u16* sdO = reinterpret_cast<u16*>(smem_raw + SDO_OFF);
    u16* sdS = reinterpret_cast<u16*>(smem_raw + SDS_OFF);
    float* sL = reinterpret_cast<float*>(smem_raw + SL_OFF);
    float* sD = reinterpret_cast<float*>(smem_raw + SD_OFF);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tig = lane & 3;
    const int kw = warp % KW, dh = warp / KW;
    const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;

    int q_start, sq, k_start, sk;
    bwd_sequence(p, b, q_start, sq, k_start, sk);
    const int n0 = n_block * BLOCK_N;
    if (n0 >= sk) return;
    const int keys_valid = min(BLOCK_N, sk - n0);
    const int diag = sk - sq;
#define LO_OF(i) KEY_LO((i), diag, p.win_left)
#define HI_OF(i) KEY_HI((i), diag, p.win_right, sk)

    // The queries that see a key of [n0, n0 + BLOCK_N): hi(i) > n0 and lo(i) < n0 + BLOCK_N
    // (both bounds non-decreasing in i).
    int i_begin = 0, i_end = sq;
    if (p.win_right >= 0) i_begin = max(0, n0 - diag - p.win_right);
    if (p.win_left >= 0) i_end = min(sq, n0 + BLOCK_N - diag + p.win_left);
    const int mb_begin = i_begin / BLOCK_M;
    const int n_mb = i_end > i_begin ? (i_end + BLOCK_M - 1) / BLOCK_M - mb_begin : 0;
    const int total = n_mb * p.group;

    const u16* gk = reinterpret_cast<const u16*>(p.k) + b * p.k_bs + (i64)(k_start + n0) * p.k_ss + hk * p.k_hs;
    const u16* gv = reinterpret_cast<const u16*>(p.v) + b * p.v_bs + (i64)(k_start + n0) * p.v_ss + hk * p.v_hs;
    load_tile<BLOCK_N>(sK, gk, p.k_ss, keys_valid, p.head_dim, tid);
    load_tile<BLOCK_N>(sV, gv, p.v_ss, keys_valid, p.head_dim_v, tid);

    const float* lse2 = reinterpret_cast<const float*>(p.lse2);
    const float* dsum = reinterpret_cast<const float*>(p.dsum);
    // Step `it` (query head it / n_mb of the group, query block mb_begin + it % n_mb) into
    // buffer `stage`: Q, dO, LSE2 and D (rows past the sequence zero-filled).
    auto load_step = [&](const int it, const int stage) {
        const int h = hk * p.group + it / n_mb;
        const int m0 = (mb_begin + it % n_mb) * BLOCK_M;
        const int rows = min(BLOCK_M, sq - m0);
        const u16* gq = reinterpret_cast<const u16*>(p.q) + b * p.q_bs + (i64)(q_start + m0) * p.q_ss + h * p.q_hs;
        const u16* gdo = reinterpret_cast<const u16*>(p.d_o) + b * p.o_bs + (i64)(q_start + m0) * p.o_ss + h * p.o_hs;
        load_tile<BLOCK_M>(sQ + stage * BLOCK_M * HDP, gq, p.q_ss, rows, p.head_dim, tid);
        load_tile<BLOCK_M>(sdO + stage * BLOCK_M * HDP, gdo, p.o_ss, rows, p.head_dim_v, tid);
        if (tid < BLOCK_M) {
            const i64 row = b * p.lse_bs + h * p.lse_hs + q_start + m0 + tid;
            const bool ok = tid < rows;
            cp_async4(smem_u32(sL + stage * BLOCK_M + tid), ok ? lse2 + row : lse2, ok);
            cp_async4(smem_u32(sD + stage * BLOCK_M + tid), ok ? dsum + row : dsum, ok);
        }
    };
    if (total > 0) load_step(0, 0);
    cp_async_commit();

    // ldmatrix addresses (see the forward): A operands of K and V rows (this warp's 16 keys),
    // B operands of Q and dO rows as n (non-transposed) and of Q, dO and K rows as k
    // (transposed). Each set is one per-lane base plus compile-time offsets.
    u32 a_k[4], b_q[4], t_q[4];
    {
        const u32 base = smem_u32(smem_raw);
        const int ya = (lane >> 4) ^ (lane & 7);
        const int yb = ((lane >> 3) & 1) ^ (lane & 7);
        const int yt = (lane >> 4) ^ (lane & 7);
        const int a_row = kw * 16 + (lane & 15);
        const int b_row = (lane & 7) + ((lane >> 4) << 3);
        const int t_row = (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            a_k[j] = base + SK_OFF + a_row * ROW_BYTES + (((2 * j) ^ ya) << 4);
            b_q[j] = base + SQ_OFF + b_row * ROW_BYTES + (((2 * j) ^ yb) << 4);
            t_q[j] = base + SQ_OFF + t_row * ROW_BYTES + (((2 * j) ^ yt) << 4);
        }
    }
    u32 a_v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) a_v[j] = a_k[j] + (SV_OFF - SK_OFF);
    // dS^T rows for dQ's A operand (transposed): lane's storage row within a 16-key step.
    const u32 ds_lane = smem_u32(smem_raw) + SDS_OFF + ((lane & 7) + 8 * (lane >> 4)) * DS_ROW_BYTES;

    float dk_acc[1][DT][4], dv_acc[1][DT][4];
#pragma unroll
    for (int d = 0; d < DT; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[0][d][e] = dv_acc[0][d][e] = 0.0f;

    const int key0 = n0 + kw * 16 + g; // this thread's keys: key0 and key0 + 8
    float* dq_acc = reinterpret_cast<float*>(p.dq_acc);

#pragma unroll 1
    for (int it = 0; it < total; ++it) {
        const int stage = STAGES == 2 ? (it & 1) : 0;
        const int h = hk * p.group + it / n_mb;
        const int m0 = (mb_begin + it % n_mb) * BLOCK_M;
        cp_async_wait_all();
        __syncthreads(); // this step's tiles visible; everyone is done with the other buffer and dS
#if STAGES == 2
        if (it + 1 < total) load_step(it + 1, stage ^ 1);
        cp_async_commit();
#endif
        const u32 qoff = (u32)(stage * BLOCK_M * ROW_BYTES);
        const float* l2 = sL + stage * BLOCK_M;
        const float* dd = sD + stage * BLOCK_M;

        // A tile whose keys all lie inside every query's [lo, hi) (and inside both sequences)
        // needs no mask.
        const bool full = m0 + BLOCK_M <= sq && n0 + BLOCK_N <= sk && LO_OF(m0 + BLOCK_M - 1) <= n0 &&
                          HI_OF(m0) >= n0 + BLOCK_N;
        // The step's queries in SUBS parts of BLOCK_M / SUBS (fewer live registers).
#pragma unroll 1
        for (int sub = 0; sub < SUBS; ++sub) {
            const u32 sub_off = qoff + (u32)(sub * (BLOCK_M / SUBS) * ROW_BYTES);
            const int c0 = sub * (BLOCK_M / SUBS);

            // S^T = K Q^T: this warp's 16 keys x BLOCK_M / SUBS queries.
            float s[1][NQS][4];
            tile_qk<1, NQS, KQ, QK_GROUPS, ELEM_BF16, ROW_BYTES>(s, a_k, b_q, sub_off);

            // P^T = exp2(x - LSE2), x the log2-domain score; 0 outside the mask.
#pragma unroll
            for (int j = 0; j < NQS; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int c = c0 + 8 * j + 2 * tig + (e & 1);
#if SOFTCAP
                    const float x = tanh_f(s[0][j][e] * p.pre) * p.softcap_post;
                    float pv = ex2(x - l2[c]);
#else
                    float pv = ex2(fmaf(s[0][j][e], p.pre, -l2[c]));
#endif
                    if (!full) {
                        const int i = m0 + c, key = key0 + 8 * (e >> 1);
                        const bool vis = i < sq && key < sk && key >= LO_OF(i) && key < HI_OF(i);
                        pv = vis ? pv : 0.0f;
                    }
                    s[0][j][e] = pv;
                }

            // dV += P^T dO (this warp's DCOLS columns).
            {
                u32 pa[1][KPS][4];
                pack_a<NQS>(s, pa);
                tile_pv<1, KPS, DT, ELEM_BF16, ROW_BYTES>(dv_acc, pa, t_q,
                                                          (u32)(SDO_OFF - SQ_OFF) + sub_off + dh * DCOLS * 2);
            }

            // dP^T = V dO^T.
            float dp[1][NQS][4];
            tile_qk<1, NQS, KQ, QK_GROUPS, ELEM_BF16, ROW_BYTES>(dp, a_v, b_q, (u32)(SDO_OFF - SQ_OFF) + sub_off);

            // dS^T = P^T (dP^T - D), times the softcap's derivative 1 - tanh^2 (tanh recovered
            // from P: x = log2(P) + LSE2; P = 0 gives dS = 0).
#pragma unroll
            for (int j = 0; j < NQS; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int c = c0 + 8 * j + 2 * tig + (e & 1);
                    const float pv = s[0][j][e];
                    float ds = pv * (dp[0][j][e] - dd[c]);
#if SOFTCAP
                    const float t = (lg2(pv) + l2[c]) / p.softcap_post;
                    ds = pv > 0.0f ? ds * (1.0f - t * t) : (pv == pv ? 0.0f : pv);
#endif
                    dp[0][j][e] = ds;
                }
            u32 dsa[1][KPS][4];
            pack_a<NQS>(dp, dsa);

            // dK += dS^T Q (scaled at the end).
            tile_pv<1, KPS, DT, ELEM_BF16, ROW_BYTES>(dk_acc, dsa, t_q, sub_off + dh * DCOLS * 2);

            // dS^T to shared memory ([key][query], 128-byte XOR swizzle), once per key slab.
            if (dh == 0) {
#pragma unroll
                for (int kp = 0; kp < KPS; ++kp)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int j = sub * NQS + 2 * kp + half;
#pragma unroll
                        for (int hh = 0; hh < 2; ++hh) {
                            const int r = kw * 16 + g + 8 * hh;
                            u32* dst = reinterpret_cast<u32*>(sdS + r * BLOCK_M + ((j ^ (r & 7)) << 3) + 2 * tig);
                            *dst = dsa[0][kp][2 * half + hh];
                        }
                    }
            }
        }
        __syncthreads(); // dS^T visible; everyone is done with this step's Q and dO
#if STAGES == 1
        if (it + 1 < total) load_step(it + 1, 0);
        cp_async_commit();
#endif

        // dQ += dS K: items of 16 query rows x DQ_COLS columns, dealt round-robin to the
        // warps, added to the f32 accumulator with atomics.
#pragma unroll 1
        for (int item = warp; item < (BLOCK_M / 16) * (HDP / DQ_COLS); item += WARPS) {
            const int mt = item % (BLOCK_M / 16), cg = item / (BLOCK_M / 16);
            if (cg * DQ_COLS >= p.head_dim) continue;
            float acc[DQ_COLS / 8][4];
#pragma unroll
            for (int n = 0; n < DQ_COLS / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
            const u32 ds_addr = ds_lane + (((2 * mt + ((lane >> 3) & 1)) ^ (lane & 7)) << 4);
            // K's transposed-operand addresses of this item's columns (16-column pairs).
            u32 kb[DQ_COLS / 16];
#pragma unroll
            for (int dp2 = 0; dp2 < DQ_COLS / 16; ++dp2) {
#if DQ_COLS == 64
                kb[dp2] = t_q[dp2] + (u32)(SK_OFF - SQ_OFF) + cg * 128;
#else
                kb[dp2] = ((cg & 1) ? t_q[2 + dp2] : t_q[dp2]) + (u32)(SK_OFF - SQ_OFF) + (cg >> 1) * 128;
#endif
            }
#pragma unroll
            for (int ks = 0; ks < BLOCK_N / 16; ++ks) {
                u32 a[4];
                ldsm_x4_trans(ds_addr + ks * 16 * DS_ROW_BYTES, a[0], a[1], a[2], a[3]);
#pragma unroll
                for (int dp2 = 0; dp2 < DQ_COLS / 16; ++dp2) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4_trans(kb[dp2] + ks * 16 * ROW_BYTES, b0, b1, b2, b3);
                    mma16816<ELEM_BF16>(acc[2 * dp2], a, b0, b1);
                    mma16816<ELEM_BF16>(acc[2 * dp2 + 1], a, b2, b3);
                }
            }
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int i = m0 + mt * 16 + g + 8 * hh;
                if (i >= sq) continue;
                float* dst = dq_acc + (b * p.lse_bs + h * p.lse_hs + q_start + i) * p.head_dim + cg * DQ_COLS + 2 * tig;
#pragma unroll
                for (int n = 0; n < DQ_COLS / 8; ++n) {
                    if (cg * DQ_COLS + 8 * n < p.head_dim) red_add2(dst + 8 * n, acc[n][2 * hh], acc[n][2 * hh + 1]);
                }
            }
        }
    }
    cp_async_wait_all();

    // dK (scaled) and dV of this warp's keys and columns, straight from the fragments.
    u16* dk = reinterpret_cast<u16*>(p.dk) + b * p.k_bs + (i64)k_start * p.k_ss + hk * p.k_hs;
    u16* dv = reinterpret_cast<u16*>(p.dv) + b * p.v_bs + (i64)k_start * p.v_ss + hk * p.v_hs;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int key = key0 + 8 * hh;
        if (key >= sk) continue;
#pragma unroll
        for (int d = 0; d < DT; ++d) {
            const int col = dh * DCOLS + 8 * d + 2 * tig;
            if (col < p.head_dim)
                *reinterpret_cast<u32*>(dk + (i64)key * p.k_ss + col) =
                    pack2<ELEM_BF16>(dk_acc[0][d][2 * hh] * p.scale, dk_acc[0][d][2 * hh + 1] * p.scale);
            if (col < p.head_dim_v)
                *reinterpret_cast<u32*>(dv + (i64)key * p.v_ss + col) =
                    pack2<ELEM_BF16>(dv_acc[0][d][2 * hh], dv_acc[0][d][2 * hh + 1]);
        }
    }
#undef LO_OF
#undef HI_OF
}
