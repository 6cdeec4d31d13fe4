// FlashAttention-2 style forward kernel for sm_80 and newer (mma.sync.m16n8k16, ldmatrix,
// cp.async). No toolkit header is included: the PTX helpers, the mask, the online-softmax steps
// and the row epilogue come from common/*.cuh, which NVRTC receives through its header list
// (kernels/sm80.rs). Compiled by NVRTC with these defines:
//
//   HDP         head dim the tiles are laid out for (64, 128 or 256; the real head dims,
//               passed at run time, may be smaller: missing columns are zero-filled)
//   BLOCK_M     query rows per CTA          BLOCK_N   keys per K/V tile
//   WARPS       warps per CTA; each owns BLOCK_M / WARPS contiguous query rows
//   MIN_BLOCKS  CTAs per SM for __launch_bounds__ (sets the register cap)
//   STAGES      1: one K and one V buffer (FA2's overlap: V loads under QK^T, the next K under
//               PV; two barriers per tile); 2: double-buffered K and V (one barrier per tile)
//   IS_BF16     1: bf16 inputs/outputs, 0: fp16
//   GENERAL_SCORES 1: scores are transformed before the max (softcap cap*tanh(s/cap), or a
//               non-positive scale); 0: scale > 0, folded into the exponent's FMA
//   MASKED      1: apply the mask (causal, window, key tail) element by element on every tile;
//               0: no mask code at all, for problems where the host has checked that every
//               key tile is full for every query (no window, seqlen_k a multiple of BLOCK_N):
//               FlashAttention-2's "even MN, not causal" kernel. With 4 warps two copies of
//               the tile body (masked and not) in one kernel spill, so the choice is per
//               launch; where they fit, SPLIT_TILES runs both (below).
//
// Softmax bookkeeping mirrors softmax-core (`RowState::begin_block`, `add_sum`, `finish`):
// scores in the scaled log2 domain, threshold rescale with tau, an all-masked row keeps the
// reference at -inf and uses offset 0, a row that saw no key yields 0 and LSE -inf.
// The mask is softmax-core's `Mask` (bottom-right aligned window (left, right), -1 unbounded),
// with tiles classified full / partial / empty exactly as `Mask::classify_tile` does.

#if !defined(HDP) || !defined(BLOCK_M) || !defined(BLOCK_N) || !defined(WARPS) || \
    !defined(MIN_BLOCKS) || !defined(IS_BF16) || !defined(GENERAL_SCORES) || !defined(STAGES) || \
    !defined(MASKED)
#error "sm80/flash_fwd.cu needs HDP, BLOCK_M, BLOCK_N, WARPS, MIN_BLOCKS, STAGES, IS_BF16, GENERAL_SCORES, MASKED"
#endif

// Choices that follow from the variant (measured on the H200; docs/history/gpu-notes.md,
// 2026-11-30):
// with 8 warps (1 CTA per SM) full unrolling of QK^T, FA2's barrier order and a branch-free
// next-K load pay; with 4 warps (2 CTAs per SM) they cost (and spill in the mask-free variants).
#define QK_UNROLL_ALL (WARPS == 8) // unroll every k-step of S = QK^T (more registers)
#define EARLY_KLOAD (WARPS == 8)   // barrier and next-K load right after QK^T (before the softmax): +5 % with 8 warps (hdim 256), -3.5 % with 4 (hdim 128)
#define KLOAD_ALWAYS (WARPS == 8)  // issue the next K load unconditionally (zero-fill only after the last tile); +6 % with 8 warps (hdim 256), -4 % with 4 (hdim 128), spills at hdim 64
// Masked variants: full tiles run a copy of the body without mask code, partial tiles
// (diagonal, window edges, key tail) a copy with it. Two copies fit the registers with 8 warps
// (16 rows each) up to hdim 128; with 4 warps of 32 rows, or at hdim 256, they spill.
#define SPLIT_TILES (MASKED && WARPS == 8 && HDP <= 128)

#include "common/epilogue.cuh"
#include "common/params.cuh"
#include "common/tile.cuh"

#define THREADS (WARPS * 32)
#define KV_ALL_ROWS (!MASKED) // every K/V tile is whole: no per-row checks in its loads
#define MT (BLOCK_M / (16 * WARPS)) // 16-row m-tiles per warp
#define NT (BLOCK_N / 8)            // 8-key n-tiles of S
#define DT (HDP / 8)                // 8-column n-tiles of O
#define KQ (HDP / 16)               // k-steps of S = Q K^T
#define KP (BLOCK_N / 16)           // k-steps of O += P V
#define CHUNKS (HDP / 8)            // 16-byte chunks per smem row
#define ROW_BYTES (HDP * 2)         // bytes per smem row

#if (BLOCK_M % (16 * WARPS)) != 0 || (HDP % 64) != 0 || (BLOCK_N % 16) != 0
#error "bad tile configuration"
#endif
#if ((BLOCK_N * CHUNKS) % THREADS) != 0 || ((BLOCK_M * CHUNKS) % THREADS) != 0
#error "tile loads must divide evenly among threads"
#endif

// Kernel parameters: the shared block (common/params.cuh).

#ifdef FA_COMPILE_CHECK_NONCE
// Set only by the CI compile check: a unique symbol makes the PTX unique, so that no compile
// cache can skip ptxas (and its resource report).
__device__ const int fa_compile_check_nonce = FA_COMPILE_CHECK_NONCE;
#endif

#define ELEM_BF16 (IS_BF16 != 0)

// Element offset of (row, 16-byte chunk) in a swizzled smem tile: the chunk index is XORed with
// the row's low 3 bits, so the 8 rows one ldmatrix phase reads hit 8 different bank groups.
static __device__ __forceinline__ int swz(int row, int chunk) {
    return row * HDP + ((chunk ^ (row & 7)) << 3);
}

// Copies `ROWS` rows of a tile (each HDP columns; columns >= dim and rows >= rows_valid are
// zero-filled) from global memory into swizzled smem with cp.async. ALL_ROWS: the caller
// guarantees rows_valid >= ROWS (no per-row check, no address select).
template <int ROWS, bool ALL_ROWS = false>
static __device__ __forceinline__ void load_tile(u16* s, const u16* g, i64 row_stride, int rows_valid, int dim, int tid) {
    const u32 base = smem_u32(s);
#if (THREADS % CHUNKS) == 0
    // Each thread keeps its chunk column; rows advance by THREADS / CHUNKS per step. A
    // zero-filled chunk reads nothing (src-size 0); its address is kept inside the tile (column
    // 0 of its row, or the tile's first element) so that no select is needed on valid rows.
    const int c = tid % CHUNKS, row0 = tid / CHUNKS;
    const bool col_ok = c * 8 < dim;
    const u16* src0 = g + row0 * row_stride + (col_ok ? c * 8 : 0);
    const i64 step = (i64)(THREADS / CHUNKS) * row_stride;
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
        const int row = row0 + i * (THREADS / CHUNKS);
        const bool row_ok = ALL_ROWS || row < rows_valid;
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

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) flash_fwd(const AttnParams p) {
    extern __shared__ __attribute__((aligned(128))) unsigned char smem_raw[];
    u16* sQ = reinterpret_cast<u16*>(smem_raw);
    u16* sK = sQ + BLOCK_M * HDP;
    u16* sV = sK + STAGES * BLOCK_N * HDP;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tig = lane & 3;
    const int b = blockIdx.z, h = blockIdx.y;
    // Heaviest query blocks first (causal): reverse order.
    const int m_block = p.num_m_blocks - 1 - (int)blockIdx.x;

    int q_start = 0, k_start = 0, sq = p.seqlen_q, sk = p.seqlen_k;
    if (p.cu_q != 0) {
        const u32* cq = reinterpret_cast<const u32*>(p.cu_q);
        const u32* ck = reinterpret_cast<const u32*>(p.cu_k);
        // Device prefix sums arrive unchecked: clamped to the packed tensors (p.seqlen_q/k
        // hold total_q/k), bad ones cannot reach outside them; valid ones are unchanged.
        const u32 q0 = min(cq[b], (u32)p.seqlen_q), q1 = min(max(cq[b + 1], q0), (u32)p.seqlen_q);
        const u32 k0 = min(ck[b], (u32)p.seqlen_k), k1 = min(max(ck[b + 1], k0), (u32)p.seqlen_k);
        q_start = (int)q0;
        sq = (int)(q1 - q0);
        k_start = (int)k0;
        sk = (int)(k1 - k0);
    }
    const int m0 = m_block * BLOCK_M;
    if (m0 >= sq) return;
    const int rows_valid = min(BLOCK_M, sq - m0);
    const int hk = h / p.group;

    const u16* gq = reinterpret_cast<const u16*>(p.q) + b * p.q_bs + (i64)(q_start + m0) * p.q_ss + h * p.q_hs;
    const u16* gk = reinterpret_cast<const u16*>(p.k) + b * p.k_bs + (i64)k_start * p.k_ss + hk * p.k_hs;
    const u16* gv = reinterpret_cast<const u16*>(p.v) + b * p.v_bs + (i64)k_start * p.v_ss + hk * p.v_hs;
    u16* go = reinterpret_cast<u16*>(p.o) + b * p.o_bs + (i64)(q_start + m0) * p.o_ss + h * p.o_hs;

    // Visible keys of query i: [lo(i), hi(i)), both non-decreasing in i (softmax-core's Mask).
    const int diag = sk - sq;
#define LO_OF(i) KEY_LO((i), diag, p.win_left)
#define HI_OF(i) KEY_HI((i), diag, p.win_right, sk)
    const int first = m0, last = m0 + rows_valid - 1;
    const int union_lo = LO_OF(first), union_hi = HI_OF(last);
    int t_begin = 0, t_end = 0;
    if (union_hi > union_lo) {
        t_begin = union_lo / BLOCK_N;
        t_end = (union_hi + BLOCK_N - 1) / BLOCK_N;
    }

    const int warp_row0 = warp * MT * 16;
    int row_lo[MT][2], row_hi[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = m0 + warp_row0 + mt * 16 + g + 8 * hh;
            row_lo[mt][hh] = LO_OF(i);
            row_hi[mt][hh] = HI_OF(i);
        }

    load_tile<BLOCK_M>(sQ, gq, p.q_ss, rows_valid, p.head_dim, tid);

    float acc[MT][DT][4];
    float row_m[MT][2], row_l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int d = 0; d < DT; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][d][e] = 0.0f;
        row_m[mt][0] = row_m[mt][1] = NEG_INF;
        row_l[mt][0] = row_l[mt][1] = 0.0f;
    }

    // ldmatrix addresses. Within a 16-row slab every lane's row has the same low 3 bits
    // (lane & 7), so the swizzled chunk (2*step + c) ^ (lane & 7) = 8*(step >> 2) +
    // ((2*(step & 3)) ^ y) with a per-lane y: four base addresses per operand, the rest is an
    // immediate offset (keeps the unrolled loops from holding one address register per load).
    u32 q_addr[4], k_addr[4], v_addr[4];
    {
        const u32 sQa = smem_u32(sQ), sKa = smem_u32(sK), sVa = smem_u32(sV);
        const int yq = (lane >> 4) ^ (lane & 7);          // Q: row lane&15, chunk half lane>>4
        const int yk = ((lane >> 3) & 1) ^ (lane & 7);    // K: row (lane&7)+8*(lane>>4), chunk half (lane>>3)&1
        const int yv = (lane >> 4) ^ (lane & 7);          // V: row (lane&7)+8*((lane>>3)&1), chunk half lane>>4
        const int q_row = warp_row0 + (lane & 15);
        const int k_row = (lane & 7) + ((lane >> 4) << 3);
        const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            q_addr[j] = sQa + q_row * ROW_BYTES + (((2 * j) ^ yq) << 4);
            k_addr[j] = sKa + k_row * ROW_BYTES + (((2 * j) ^ yk) << 4);
            v_addr[j] = sVa + v_row * ROW_BYTES + (((2 * j) ^ yv) << 4);
        }
    }

    // Between the two matrix products (single buffers): wait for this tile's V, make sure every
    // warp is done reading K, and issue the next K tile. Double buffering needs none of it.
    auto wait_v_and_issue_next_k = [&](const int t_next) {
#if STAGES == 1
        cp_async_wait_all();
        __syncthreads(); // V tile visible; everyone is done reading this K tile
#endif
#if STAGES == 2
        (void)t_next; // the next tiles were issued at the top of this one
#elif KLOAD_ALWAYS
        // After the last tile no row is valid: zero-fill only, nothing read from global memory
        // (with whole tiles, KV_ALL_ROWS, the first tile is read again instead; never used).
        const bool more = t_next >= 0;
        const int n1 = t_next * BLOCK_N;
        load_tile<BLOCK_N, KV_ALL_ROWS>(sK, more ? gk + (i64)n1 * p.k_ss : gk, p.k_ss, more ? sk - n1 : 0,
                                        p.head_dim, tid);
        cp_async_commit();
#else
        if (t_next >= 0) {
            const int n1 = t_next * BLOCK_N;
            load_tile<BLOCK_N, KV_ALL_ROWS>(sK, gk + (i64)n1 * p.k_ss, p.k_ss, sk - n1, p.head_dim, tid);
            cp_async_commit();
        }
#endif
    };

    // One K/V tile; `t_next` is the tile after it (-1: none). `masked_tag` (MaskedTile or
    // FullTile) says at compile time whether the mask is applied element by element.
    auto tile = [&](const int t, const int t_next, const u32 buf_bytes, auto masked_tag) {
        constexpr bool masked = decltype(masked_tag)::value;
        const int n0 = t * BLOCK_N;

        // S = Q K^T for this warp's rows (the k-step groups unrolled with 8 warps only).
        float s[MT][NT][4];
        tile_qk<MT, NT, KQ, QK_UNROLL_ALL ? KQ / 4 : 1, ELEM_BF16, ROW_BYTES>(s, q_addr, k_addr, buf_bytes);

#if EARLY_KLOAD
        // FlashAttention-2's order: before the softmax, so the load has the softmax and PV.
        wait_v_and_issue_next_k(t_next);
#endif
        // Scores. GENERAL_SCORES: x = t(s*pre) (softcap or a non-positive scale) first.
        // Otherwise pre > 0, so the max of the raw dot products times pre is the max of the
        // log2 scores, and the scale folds into the exponent's FMA. Without SPLIT_TILES full
        // tiles take the masked path too: every column lies inside every valid row's bounds,
        // so the selects change nothing there (rows past seqlen_q are never stored).
        tile_scores<MT, NT, GENERAL_SCORES != 0, masked>(s, n0, tig, row_lo, row_hi, p.pre, p.softcap_post);
        // Online softmax (RowState::begin_block with the threshold policy; tau = 0 is `Always`).
        tile_rescale<MT, NT, DT, GENERAL_SCORES != 0>(s, row_m, row_l, acc, p.pre, p.tau);
        // P = exp2(x - offset), kept in registers as the A operand of the second mma.
        u32 pa[MT][KP][4];
        tile_exp<MT, NT, KP, ELEM_BF16, GENERAL_SCORES != 0>(s, row_m, row_l, pa, p.pre);

#if !EARLY_KLOAD
        wait_v_and_issue_next_k(t_next);
#endif

        // O += P V
        tile_pv<MT, KP, DT, ELEM_BF16, ROW_BYTES>(acc, pa, v_addr, buf_bytes);
    };

    // Tile order. With SPLIT_TILES the full tiles [full_begin, full_end) come first, then the
    // partial ones before and after them, each group with its own copy of the body; the order
    // changes the result only by rounding (the online softmax merges blocks in any order).
#if SPLIT_TILES
    const int full_lo = LO_OF(last), full_hi = HI_OF(first);
    const int full_begin = min(max((full_lo + BLOCK_N - 1) / BLOCK_N, t_begin), t_end);
    const int full_end = max(min(full_hi / BLOCK_N, t_end), full_begin);
    const int n_full = full_end - full_begin, n_before = full_begin - t_begin;
    auto tile_at = [&](const int i) {
        if (i >= t_end - t_begin) return -1;
        if (i < n_full) return full_begin + i;
        const int j = i - n_full;
        return j < n_before ? t_begin + j : full_end + (j - n_before);
    };
#else
    auto tile_at = [&](const int i) { return i < t_end - t_begin ? t_begin + i : -1; };
#endif

    if (t_begin < t_end) {
        const int n0 = tile_at(0) * BLOCK_N;
        load_tile<BLOCK_N, KV_ALL_ROWS>(sK, gk + (i64)n0 * p.k_ss, p.k_ss, sk - n0, p.head_dim, tid);
#if STAGES == 2
        load_tile<BLOCK_N, KV_ALL_ROWS>(sV, gv + (i64)n0 * p.v_ss, p.v_ss, sk - n0, p.head_dim_v, tid);
#endif
    }
    cp_async_commit();

    auto step = [&](const int i, auto masked_tag) {
        const int t = tile_at(i), t_next = tile_at(i + 1);
        const int n0 = t * BLOCK_N;
        cp_async_wait_all();
#if STAGES == 2
        __syncthreads(); // tile t visible to all; everyone is done with the last tile's buffers
        const int buf = i & 1;
        if (t_next >= 0) {
            const int nb = buf ^ 1, n1 = t_next * BLOCK_N;
            load_tile<BLOCK_N, KV_ALL_ROWS>(sK + nb * BLOCK_N * HDP, gk + (i64)n1 * p.k_ss, p.k_ss, sk - n1, p.head_dim, tid);
            load_tile<BLOCK_N, KV_ALL_ROWS>(sV + nb * BLOCK_N * HDP, gv + (i64)n1 * p.v_ss, p.v_ss, sk - n1, p.head_dim_v, tid);
            cp_async_commit();
        }
        tile(t, t_next, (u32)(buf * BLOCK_N * ROW_BYTES), masked_tag);
#else
        __syncthreads(); // K tile (and Q) visible to all; everyone is done with the last V tile
        load_tile<BLOCK_N, KV_ALL_ROWS>(sV, gv + (i64)n0 * p.v_ss, p.v_ss, sk - n0, p.head_dim_v, tid);
        cp_async_commit();
        tile(t, t_next, 0u, masked_tag);
#endif
    };
#if SPLIT_TILES
    for (int i = 0; i < n_full; ++i) step(i, FullTile{});
    for (int i = n_full; i < t_end - t_begin; ++i) step(i, MaskedTile{});
#elif MASKED
    for (int i = 0; i < t_end - t_begin; ++i) step(i, MaskedTile{});
#else
    for (int i = 0; i < t_end - t_begin; ++i) step(i, FullTile{});
#endif

    // Finish (RowState::finish): 1/l and LSE; a row that saw no key gives 0 and -inf.
    cp_async_wait_all();
    __syncthreads(); // all warps are done with sQ/sK/sV: sQ becomes the output staging tile
    float* lse_out = reinterpret_cast<float*>(p.lse);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float inv, lse;
            finish_row(row_l[mt][hh], row_m[mt][hh], inv, lse);
            const int row = warp_row0 + mt * 16 + g + 8 * hh;
#pragma unroll
            for (int d = 0; d < DT; ++d) {
                const u32 v = pack2<ELEM_BF16>(acc[mt][d][2 * hh] * inv, acc[mt][d][2 * hh + 1] * inv);
                *reinterpret_cast<u32*>(sQ + swz(row, d) + 2 * tig) = v;
            }
            if (lse_out != 0 && tig == 0 && row < rows_valid)
                lse_out[b * p.lse_bs + h * p.lse_hs + q_start + m0 + row] = lse;
        }
    __syncthreads();
    // The staged tile to global memory, 16 bytes per thread and step. Kept here rather than
    // behind a shared helper: as a function taking the stride and the swizzle it changes the
    // generated code (a spill in the 4-warp hdim-64 kernels).
#pragma unroll
    for (int i = 0; i < BLOCK_M * CHUNKS / THREADS; ++i) {
        const int id = tid + i * THREADS;
        const int row = id / CHUNKS, c = id % CHUNKS;
        if (row < rows_valid && c * 8 < p.head_dim_v)
            *reinterpret_cast<u32x4*>(go + row * p.o_ss + c * 8) = *reinterpret_cast<const u32x4*>(sQ + swz(row, c));
    }
#undef LO_OF
#undef HI_OF
}
