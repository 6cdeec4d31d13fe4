// Hopper (sm_90a) forward kernels: both matrix products on wgmma.
//   S = Q K^T   wgmma m64n{BLOCK_N}k16, A = Q and B = K from shared memory (K-major operands,
//               128-byte swizzle, matrix descriptors);
//   O += P V    wgmma m64n{HDP}k16, A = P from registers (the S accumulator converted in place:
//               the accumulator and A-operand layouts of a 16-row slab coincide), B = V from
//               shared memory through a transposed (MN-major) descriptor.
// One consumer warpgroup (128 threads) per 64 query rows, two per CTA (BLOCK_M = 128).
// Two pipelines, chosen by WS:
//   WS = 0  every thread loads with cp.async into double-buffered K/V tiles; one barrier per
//           tile (step 1 of issue 13);
//   WS = 1  warp specialization: warpgroup 0 is the producer (one thread issues TMA loads of
//           Q, K and V from host-encoded tensor maps, completing on mbarriers; setmaxnreg
//           lowers its registers), warpgroups 1-2 consume (setmaxnreg raises theirs); K/V
//           stages are freed through "empty" mbarriers, so the two consumers run
//           independently (no CTA barrier in the loop). Dense (non-varlen) problems only:
//           TMA bounds are per tensor, not per packed sequence.
// Compiled by NVRTC for sm_90a only, with:
//
//   HDP         head dim the tiles are laid out for (64, 128 or 256; smaller real head dims,
//               passed at run time, are zero-filled)
//   BLOCK_N     keys per K/V tile (multiple of 64)
//   IS_BF16     1: bf16, 0: fp16
//   WS          0 or 1 (above)
//   OVERLAP     1 (WS only): intra-warpgroup overlap — tile i's QK^T and softmax run while
//               tile i-1's PV is in flight (FlashAttention-3's two-stage consumer); K and V
//               stages are freed separately
//
// Numerics are the sm80 family's, from common/*.cuh (softmax-core's rules): scores in the scaled
// log2 domain (scale > 0 folded into the exponent's FMA; the plan sends softcap and scale <= 0
// to sm80), threshold rescale with tau, an all-masked row keeps its reference at -inf and uses
// offset 0, a row that saw no key yields 0 and LSE -inf. The mask is softmax-core's `Mask`
// (bottom-right aligned window); full tiles run a copy of the tile body without mask code.
//
// Shared-memory tiles use the wgmma canonical 128-byte swizzle (also what TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B): a tile of ROWS rows x HDP columns is HDP/64 column blocks of
// ROWS x 128 bytes; in a block, row r lives at r*128 and its 16-byte chunk c at
// ((c ^ (r & 7)) * 16). Tile bases are 1024-byte aligned, so the hardware's address-bit
// swizzle (bits 4-6 ^= bits 7-9) sees the same pattern.

#if !defined(HDP) || !defined(BLOCK_N) || !defined(IS_BF16) || !defined(WS) || !defined(OVERLAP)
#error "sm90/flash_fwd.cu needs HDP, BLOCK_N, IS_BF16, WS, OVERLAP"
#endif
#if OVERLAP && !WS
#error "OVERLAP needs WS"
#endif

#include "common/epilogue.cuh"
#include "common/params.cuh"
#include "sm90/wgmma.cuh"

#define CONSUMERS 2                       // consumer warpgroups
#define BLOCK_M (CONSUMERS * 64)
#define THREADS ((CONSUMERS + WS) * 128)  // WS: one producer warpgroup more
#define NT (BLOCK_N / 8)   // 8-key n-tiles of S per thread row
#define DT (HDP / 8)       // 8-column n-tiles of O
#define KQ (HDP / 16)      // k-steps of S = Q K^T
#define KP (BLOCK_N / 16)  // k-steps of O += P V
#define CHUNKS (HDP / 8)   // 16-byte chunks per row
#define ROW_BYTES (HDP * 2)
#define ELEM_BF16 (IS_BF16 != 0)
#define Q_BYTES (BLOCK_M * ROW_BYTES)
#define KV_BYTES (BLOCK_N * ROW_BYTES)

#if (HDP % 64) != 0 || (BLOCK_N % 64) != 0 || BLOCK_N > 256 || HDP > 256
#error "bad tile configuration"
#endif
#if ((BLOCK_N * CHUNKS) % (CONSUMERS * 128)) != 0 || ((BLOCK_M * CHUNKS) % (CONSUMERS * 128)) != 0
#error "tile loads must divide evenly among threads"
#endif

// Kernel parameters: the shared block (common/params.cuh).

// A CUtensorMap (opaque, 128 bytes), encoded on the host by cuTensorMapEncodeTiled.
struct alignas(64) TensorMap { u64 opaque[16]; };

#ifdef FA_COMPILE_CHECK_NONCE
__device__ const int fa_compile_check_nonce = FA_COMPILE_CHECK_NONCE;
#endif

// Byte offset of (row, 16-byte chunk) in a swizzled tile of ROWS rows.
template <int ROWS>
static __device__ __forceinline__ u32 sw128(int row, int chunk) {
    return (u32)((chunk >> 3) * (ROWS * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// A wgmma shared-memory matrix descriptor with the 128-byte swizzle: start address, leading
// byte offset (K-major: unused, 1 by convention; MN-major: the stride between 64-column
// blocks) and stride byte offset (between 8-row groups), all in 16-byte units.
static __device__ __forceinline__ u64 sw128_desc(u32 addr, u32 lbo_bytes, u32 sbo_bytes) {
    u64 d = (u64)((addr & 0x3FFFF) >> 4);
    d |= (u64)((lbo_bytes >> 4) & 0x3FFF) << 16;
    d |= (u64)((sbo_bytes >> 4) & 0x3FFF) << 32;
    d |= (u64)1 << 62;
    return d;
}


// The state of one consumer thread: its two rows' bounds, reference maxima, partial sums and
// its part of the 64 x HDP output accumulator.
struct RowsState {
    float acc[HDP / 2];
    float row_m[2], row_l[2];
    int row_lo[2], row_hi[2];
};

// The tile body in pieces, so that a pipeline can overlap one tile's softmax with the matrix
// products of its neighbours. Accumulator registers that a wgmma reads or writes stay pinned
// (wgmma_pin) from before the issue to after the wait: the compiler sees the asm statements
// as synchronous and would otherwise reuse or move them while the tensor cores work.

// Issues S = Q K^T (64 x BLOCK_N per warpgroup) as one wgmma group; no wait.
static __device__ __forceinline__ void qk_issue(float* s, const u32 q_base, const u32 k_base) {
#pragma unroll
    for (int e = 0; e < BLOCK_N / 2; ++e) wgmma_pin(s[e]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KQ; ++kk) {
        const u64 da = sw128_desc(q_base + (kk >> 2) * (BLOCK_M * 128) + (kk & 3) * 32, 16, 1024);
        const u64 db = sw128_desc(k_base + (kk >> 2) * (BLOCK_N * 128) + (kk & 3) * 32, 16, 1024);
        wgmma_ss<BLOCK_N, ELEM_BF16>(s, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
}

// Issues O += P V (64 x HDP per warpgroup) as one wgmma group; no wait. PIN: pin the operands
// first; not while another wgmma group is in flight (a pin may become a register move, which
// ptxas counts as defining a wgmma input inside an open stage and serialises: C7513).
template <bool PIN = true>
static __device__ __forceinline__ void pv_issue(float* acc, u32 (*pa)[4], const u32 v_base) {
    if constexpr (PIN) {
#pragma unroll
        for (int e = 0; e < HDP / 2; ++e) wgmma_pin(acc[e]);
#pragma unroll
        for (int kp = 0; kp < KP; ++kp)
#pragma unroll
            for (int e = 0; e < 4; ++e) wgmma_pin(pa[kp][e]);
    }
    wgmma_fence();
#pragma unroll
    for (int kp = 0; kp < KP; ++kp) {
        const u64 db = sw128_desc(v_base + kp * 16 * 128, BLOCK_N * 128, 1024);
        wgmma_rs<HDP, ELEM_BF16>(acc, pa[kp], db, 1);
    }
    wgmma_commit();
}

// After a wait: keeps the accumulator (and the P operand it read) alive up to here; before a
// stage: makes every write to them happen before it.
static __device__ __forceinline__ void pv_done(float* acc, u32 (*pa)[4]) {
#pragma unroll
    for (int e = 0; e < HDP / 2; ++e) wgmma_pin(acc[e]);
#pragma unroll
    for (int kp = 0; kp < KP; ++kp)
#pragma unroll
        for (int e = 0; e < 4; ++e) wgmma_pin(pa[kp][e]);
}

// The softmax of a finished S tile, in place: mask (MASKED), the online-softmax step
// (RowState::begin_block with the threshold policy: row_m, row_l), then P = exp2(x - offset)
// over S. Returns whether any row of the warp moved its reference; `corr` holds the factors
// the accumulator must take (after any PV still reading it is done). P reaches the wgmma A
// registers only in pack_p: with OVERLAP that happens after the in-flight PV is waited for,
// because ptxas serialises every wgmma of the kernel when an RS-wgmma's A registers are
// written while a wgmma group is open (C7513).
template <bool MASKED>
static __device__ __forceinline__ bool softmax_tile(RowsState& st, float* s, float* corr, const int n0, const int tig,
                                                    const float pre, const float tau) {
    if constexpr (MASKED) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n0 + j * 8 + 2 * tig + (e & 1);
                const int hh = e >> 1;
                s[4 * j + e] = MASK_SCORE(s[4 * j + e], col, st.row_lo[hh], st.row_hi[hh]);
            }
    }
    bool any_rescale = false;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float part[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) part[j] = NEG_INF;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const float pair = fmaxf(s[4 * j + 2 * hh], s[4 * j + 2 * hh + 1]);
            part[j & 3] = fmaxf(part[j & 3], pair);
        }
        float bm = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
        bm = quad_max(bm);
        bm *= pre; // pre > 0: -inf stays -inf
        const float m = st.row_m[hh];
        float c;
        const bool move = rescale_vote(bm, m, tau, c);
        st.row_m[hh] = move ? bm : m;
        st.row_l[hh] *= c;
        any_rescale |= move;
        corr[hh] = c;
    }
    const float off0 = exp_offset(st.row_m[0]);
    const float off1 = exp_offset(st.row_m[1]);
    float sum0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sum1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[4 * j + e] = ex2(fmaf(s[4 * j + e], pre, -(e < 2 ? off0 : off1)));
        sum0[j & 3] += s[4 * j] + s[4 * j + 1];
        sum1[j & 3] += s[4 * j + 2] + s[4 * j + 3];
    }
    st.row_l[0] += (sum0[0] + sum0[1]) + (sum0[2] + sum0[3]);
    st.row_l[1] += (sum1[0] + sum1[1]) + (sum1[2] + sum1[3]);
    return warp_any(any_rescale);
}

// P (in S's registers) as the A operand of O += P V.
static __device__ __forceinline__ void pack_p(const float* s, u32 (*pa)[4]) {
#pragma unroll
    for (int kp = 0; kp < KP; ++kp) {
        pa[kp][0] = pack2<ELEM_BF16>(s[8 * kp + 0], s[8 * kp + 1]);
        pa[kp][1] = pack2<ELEM_BF16>(s[8 * kp + 2], s[8 * kp + 3]);
        pa[kp][2] = pack2<ELEM_BF16>(s[8 * kp + 4], s[8 * kp + 5]);
        pa[kp][3] = pack2<ELEM_BF16>(s[8 * kp + 6], s[8 * kp + 7]);
    }
}

// The accumulator takes the rows' correction factors (a warp-uniform skip when none moved).
static __device__ __forceinline__ void rescale_acc(RowsState& st, const bool any, const float* corr) {
    if (any) {
#pragma unroll
        for (int d = 0; d < DT; ++d) {
            st.acc[4 * d + 0] *= corr[0];
            st.acc[4 * d + 1] *= corr[0];
            st.acc[4 * d + 2] *= corr[1];
            st.acc[4 * d + 3] *= corr[1];
        }
    }
}

// One K/V tile for one consumer warpgroup, in order: S = Q K^T, softmax, rescale,
// `before_pv()` (WS: wait for V), O += P V.
template <bool MASKED, typename BeforePv>
static __device__ __forceinline__ void consume_tile(RowsState& st, const u32 q_base, const u32 k_base, const u32 v_base,
                                                    const int n0, const int tig, const float pre, const float tau,
                                                    BeforePv before_pv) {
    float s[BLOCK_N / 2];
    qk_issue(s, q_base, k_base);
    wgmma_wait<0>();
#pragma unroll
    for (int e = 0; e < BLOCK_N / 2; ++e) wgmma_pin(s[e]);
    u32 pa[KP][4];
    float corr[2];
    const bool any = softmax_tile<MASKED>(st, s, corr, n0, tig, pre, tau);
    pack_p(s, pa);
    rescale_acc(st, any, corr);
    before_pv();
    pv_issue(st.acc, pa, v_base);
    wgmma_wait<0>();
    pv_done(st.acc, pa);
}

// The finished rows (RowState::finish: 1/l and LSE; a row that saw no key gives 0 and -inf)
// into the swizzled staging tile `stage` (this warpgroup's rows of the Q tile) and the LSE.
static __device__ __forceinline__ void finish_rows(RowsState& st, unsigned char* stage, const int row0, const int tig,
                                                   const int rows_valid, float* lse_row0) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float inv, lse;
        finish_row(st.row_l[hh], st.row_m[hh], inv, lse);
        const int row = row0 + 8 * hh;
#pragma unroll
        for (int d = 0; d < DT; ++d) {
            const u32 v = pack2<ELEM_BF16>(st.acc[4 * d + 2 * hh] * inv, st.acc[4 * d + 2 * hh + 1] * inv);
            *reinterpret_cast<u32*>(stage + sw128<BLOCK_M>(row, d) + 4 * tig) = v;
        }
        if (lse_row0 != 0 && tig == 0 && row < rows_valid) lse_row0[row] = lse;
    }
}

// Staged rows [row_begin, row_begin + ROWS) to global memory, 16 bytes per thread and step.
template <int ROWS, int NTHREADS>
static __device__ __forceinline__ void store_rows(const unsigned char* stage, u16* go, const i64 o_ss, const int row_begin,
                                                  const int rows_valid, const int head_dim_v, const int t) {
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / NTHREADS; ++i) {
        const int id = t + i * NTHREADS;
        const int row = row_begin + id / CHUNKS, c = id % CHUNKS;
        if (row < rows_valid && c * 8 < head_dim_v)
            *reinterpret_cast<u32x4*>(go + row * o_ss + c * 8) =
                *reinterpret_cast<const u32x4*>(stage + sw128<BLOCK_M>(row, c));
    }
}

#if WS
// Named barrier over `count` threads (id 0 is __syncthreads').
static __device__ __forceinline__ void named_barrier(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// mbarrier and TMA helpers (WS only).
static __device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
static __device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
static __device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n.reg .pred P1;\nLAB_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// A 4-D tile (column, row, head, batch) of a tensor map into shared memory, completing on `bar`.
static __device__ __forceinline__ void tma_load(u32 dst, const TensorMap& map, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
                 ::"r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// One K or V tile: HDP/64 boxes of 64 columns x rows.
template <int ROWS>
static __device__ __forceinline__ void tma_tile(u32 dst, const TensorMap& map, u32 bar, int row, int head, int batch) {
#pragma unroll
    for (int cb = 0; cb < HDP / 64; ++cb) tma_load(dst + cb * ROWS * 128, map, bar, cb * 64, row, head, batch);
}
#define KERNEL_ARGS const AttnParams p, const __grid_constant__ TensorMap tm_q, const __grid_constant__ TensorMap tm_k, \
                    const __grid_constant__ TensorMap tm_v
#else
#define KERNEL_ARGS const AttnParams p
static __device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Copies ROWS rows (HDP columns; columns >= dim and rows >= rows_valid zero-filled) into a
// swizzled tile with cp.async. Every thread keeps one chunk column (THREADS % CHUNKS == 0), so
// its rows share their low 3 bits and the swizzled offset advances by a constant.
template <int ROWS>
static __device__ __forceinline__ void load_tile(u32 dst, const u16* g, i64 row_stride, int rows_valid, int dim, int tid) {
    const int c = tid % CHUNKS, row0 = tid / CHUNKS;
    const bool col_ok = c * 8 < dim;
    const u16* src0 = g + row0 * row_stride + (col_ok ? c * 8 : 0);
    const i64 step = (i64)(THREADS / CHUNKS) * row_stride;
    const u32 base = dst + sw128<ROWS>(row0, c);
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
        const int row = row0 + i * (THREADS / CHUNKS);
        const bool ok = col_ok && row < rows_valid;
        cp_async16(base + (u32)(i * (THREADS / CHUNKS) * 128), ok ? src0 + i * step : g, ok);
    }
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1) flash_fwd_sm90(KERNEL_ARGS) {
    extern __shared__ __attribute__((aligned(1024))) unsigned char smem_raw[];
    // Descriptors, TMA's swizzle and ours need 1024-byte aligned tiles: align by hand (the plan
    // asks for 1 KiB more than the tiles and barriers).
    const u32 raw0 = smem_u32(smem_raw);
    const u32 smem0 = (raw0 + 1023u) & ~1023u;
    const u32 sQ = smem0;
    const u32 sK = sQ + Q_BYTES;
    const u32 sV = sK + 2 * KV_BYTES;
    unsigned char* sQ_ptr = smem_raw + (sQ - raw0);

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid >> 7, warp_in_wg = (tid >> 5) & 3;
    const int g = lane >> 2, tig = lane & 3;
    const int b = blockIdx.z, h = blockIdx.y;
    const int m_block = p.num_m_blocks - 1 - (int)blockIdx.x; // heaviest first (causal)

    int q_start = 0, k_start = 0, sq = p.seqlen_q, sk = p.seqlen_k;
#if WS
    (void)q_start; // dense only: TMA coordinates are (token, head, batch)
    (void)k_start;
#else
    if (p.cu_q != 0) {
        const u32* cq = reinterpret_cast<const u32*>(p.cu_q);
        const u32* ck = reinterpret_cast<const u32*>(p.cu_k);
        // Device prefix sums arrive unchecked: clamped to the packed tensors.
        const u32 q0 = min(cq[b], (u32)p.seqlen_q), q1 = min(max(cq[b + 1], q0), (u32)p.seqlen_q);
        const u32 k0 = min(ck[b], (u32)p.seqlen_k), k1 = min(max(ck[b + 1], k0), (u32)p.seqlen_k);
        q_start = (int)q0;
        sq = (int)(q1 - q0);
        k_start = (int)k0;
        sk = (int)(k1 - k0);
    }
#endif
    const int m0 = m_block * BLOCK_M;
    if (m0 >= sq) return;
    const int rows_valid = min(BLOCK_M, sq - m0);
    const int hk = h / p.group;

    u16* go = reinterpret_cast<u16*>(p.o) + b * p.o_bs + (i64)(q_start + m0) * p.o_ss + h * p.o_hs;
    float* lse_out = reinterpret_cast<float*>(p.lse);
    float* lse_row0 = lse_out != 0 ? lse_out + b * p.lse_bs + h * p.lse_hs + q_start + m0 : (float*)0;

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
    // Full tiles first (no mask code), then the partial ones (as the sm80 family's SPLIT_TILES).
    const int full_lo = LO_OF(last), full_hi = HI_OF(first);
    const int full_begin = min(max((full_lo + BLOCK_N - 1) / BLOCK_N, t_begin), t_end);
    const int full_end = max(min(full_hi / BLOCK_N, t_end), full_begin);
    const int n_full = full_end - full_begin, n_before = full_begin - t_begin;
    const int n_tiles = t_end - t_begin;
    auto tile_at = [&](const int i) {
        if (i >= n_tiles) return -1;
        if (i < n_full) return full_begin + i;
        const int j = i - n_full;
        return j < n_before ? t_begin + j : full_end + (j - n_before);
    };

    // The consumer's rows (wgmma accumulator layout: warp w of the warpgroup holds rows
    // 16w..16w+15, lane l rows l/4 and l/4 + 8).
    auto init_rows = [&](RowsState& st, const int row0) {
#pragma unroll
        for (int i = 0; i < HDP / 2; ++i) st.acc[i] = 0.0f;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            st.row_m[hh] = NEG_INF;
            st.row_l[hh] = 0.0f;
            st.row_lo[hh] = LO_OF(m0 + row0 + 8 * hh);
            st.row_hi[hh] = HI_OF(m0 + row0 + 8 * hh);
        }
    };

#if WS
    // Barriers after the tiles: Q full, K full x2, V full x2, K empty x2, V empty x2 (K and V
    // stages are freed separately: with OVERLAP a K tile is done long before its V tile).
    const u32 bars = sV + 2 * KV_BYTES;
    const u32 bar_q = bars, bar_k = bars + 8, bar_v = bars + 24, bar_k_empty = bars + 40, bar_v_empty = bars + 56;
    if (tid == 0) {
        mbar_init(bar_q, 1);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            mbar_init(bar_k + 8 * s, 1);
            mbar_init(bar_v + 8 * s, 1);
            mbar_init(bar_k_empty + 8 * s, CONSUMERS * 128);
            mbar_init(bar_v_empty + 8 * s, CONSUMERS * 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        // Producer: one thread issues every load; the warpgroup gives its registers away.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == 0 && n_tiles > 0) {
            mbar_expect_tx(bar_q, Q_BYTES);
            tma_tile<BLOCK_M>(sQ, tm_q, bar_q, m0, h, b);
            for (int i = 0; i < n_tiles; ++i) {
                const int stage = i & 1;
                const u32 parity = ((i >> 1) - 1) & 1;
                const int n0 = tile_at(i) * BLOCK_N;
                if (i >= 2) mbar_wait(bar_k_empty + 8 * stage, parity);
                mbar_expect_tx(bar_k + 8 * stage, KV_BYTES);
                tma_tile<BLOCK_N>(sK + stage * KV_BYTES, tm_k, bar_k + 8 * stage, n0, hk, b);
                if (i >= 2) mbar_wait(bar_v_empty + 8 * stage, parity);
                mbar_expect_tx(bar_v + 8 * stage, KV_BYTES);
                tma_tile<BLOCK_N>(sV + stage * KV_BYTES, tm_v, bar_v + 8 * stage, n0, hk, b);
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        const int cw = wg - 1; // consumer index
        const int row0 = cw * 64 + warp_in_wg * 16 + g;
        RowsState st;
        init_rows(st, row0);
        const u32 q_base = sQ + cw * 64 * 128;
        if (n_tiles > 0) mbar_wait(bar_q, 0);
#if OVERLAP
        // Intra-warpgroup overlap (FlashAttention-3's two-stage consumer): tile i's QK^T and
        // tile i-1's PV are in flight together, and tile i's softmax runs while PV works; the
        // accumulator takes tile i's correction only after that PV is done.
        float s[BLOCK_N / 2];
        u32 pa[KP][4];
        float corr[2];
        if (n_tiles > 0) {
            mbar_wait(bar_k, 0);
            qk_issue(s, q_base, sK);
            wgmma_wait<0>();
#pragma unroll
            for (int e = 0; e < BLOCK_N / 2; ++e) wgmma_pin(s[e]);
            mbar_arrive(bar_k_empty);
            // The accumulator is zero: tile 0's correction changes nothing.
            if (n_full > 0)
                softmax_tile<false>(st, s, corr, tile_at(0) * BLOCK_N, tig, p.pre, p.tau);
            else
                softmax_tile<true>(st, s, corr, tile_at(0) * BLOCK_N, tig, p.pre, p.tau);
            pack_p(s, pa);
        }
        auto run = [&](const int i, auto masked_tag) {
            constexpr bool masked = decltype(masked_tag)::value;
            const int stage = i & 1, prev = stage ^ 1;
            const u32 parity = (i >> 1) & 1, prev_parity = ((i - 1) >> 1) & 1;
            // The last iteration's rescale and P copy are done before this stage starts:
            // otherwise ptxas may sink them between the wgmmas and serialise them (C7513).
            pv_done(st.acc, pa);
            mbar_wait(bar_k + 8 * stage, parity);
            qk_issue(s, q_base, sK + stage * KV_BYTES);
            mbar_wait(bar_v + 8 * prev, prev_parity);
            pv_issue<false>(st.acc, pa, sV + prev * KV_BYTES);
            wgmma_wait<1>(); // S of tile i (committed first) is done; PV of tile i-1 may run on
#pragma unroll
            for (int e = 0; e < BLOCK_N / 2; ++e) wgmma_pin(s[e]);
            mbar_arrive(bar_k_empty + 8 * stage);
            float corr_next[2];
            const bool any = softmax_tile<masked>(st, s, corr_next, tile_at(i) * BLOCK_N, tig, p.pre, p.tau);
            wgmma_wait<0>();
            pv_done(st.acc, pa);
            mbar_arrive(bar_v_empty + 8 * prev);
            rescale_acc(st, any, corr_next);
            pack_p(s, pa); // tile i's P, now that tile i-1's PV no longer reads these registers
        };
        for (int i = 1; i < n_full; ++i) run(i, FullTile{});
        for (int i = max(n_full, 1); i < n_tiles; ++i) run(i, MaskedTile{});
        if (n_tiles > 0) {
            const int last_stage = (n_tiles - 1) & 1;
            mbar_wait(bar_v + 8 * last_stage, ((n_tiles - 1) >> 1) & 1);
            pv_issue(st.acc, pa, sV + last_stage * KV_BYTES);
            wgmma_wait<0>();
            pv_done(st.acc, pa);
            mbar_arrive(bar_v_empty + 8 * last_stage);
        }
#else
        auto run = [&](const int i, auto masked_tag) {
            constexpr bool masked = decltype(masked_tag)::value;
            const int stage = i & 1;
            const u32 parity = (i >> 1) & 1;
            mbar_wait(bar_k + 8 * stage, parity);
            consume_tile<masked>(st, q_base, sK + stage * KV_BYTES, sV + stage * KV_BYTES, tile_at(i) * BLOCK_N, tig, p.pre,
                                 p.tau, [&]() { mbar_wait(bar_v + 8 * stage, parity); });
            mbar_arrive(bar_k_empty + 8 * stage);
            mbar_arrive(bar_v_empty + 8 * stage);
        };
        for (int i = 0; i < n_full; ++i) run(i, FullTile{});
        for (int i = n_full; i < n_tiles; ++i) run(i, MaskedTile{});
#endif
        // This warpgroup's Q rows become its output staging rows: every warp of it must be
        // done reading them (wgmma) before any writes.
        named_barrier(1 + cw, 128);
        finish_rows(st, sQ_ptr, row0, tig, rows_valid, lse_row0);
        named_barrier(1 + cw, 128);
        store_rows<64, 128>(sQ_ptr, go, p.o_ss, cw * 64, rows_valid, p.head_dim_v, tid & 127);
    }
#else
    const u16* gq = reinterpret_cast<const u16*>(p.q) + b * p.q_bs + (i64)(q_start + m0) * p.q_ss + h * p.q_hs;
    const u16* gk = reinterpret_cast<const u16*>(p.k) + b * p.k_bs + (i64)k_start * p.k_ss + hk * p.k_hs;
    const u16* gv = reinterpret_cast<const u16*>(p.v) + b * p.v_bs + (i64)k_start * p.v_ss + hk * p.v_hs;
    const int row0 = wg * 64 + warp_in_wg * 16 + g;
    RowsState st;
    init_rows(st, row0);
    const u32 q_base = sQ + wg * 64 * 128;

    load_tile<BLOCK_M>(sQ, gq, p.q_ss, rows_valid, p.head_dim, tid);
    if (n_tiles > 0) {
        const int n0 = tile_at(0) * BLOCK_N;
        load_tile<BLOCK_N>(sK, gk + (i64)n0 * p.k_ss, p.k_ss, sk - n0, p.head_dim, tid);
        load_tile<BLOCK_N>(sV, gv + (i64)n0 * p.v_ss, p.v_ss, sk - n0, p.head_dim_v, tid);
    }
    cp_async_commit();

    auto step = [&](const int i, auto masked_tag) {
        constexpr bool masked = decltype(masked_tag)::value;
        const int t_next = tile_at(i + 1);
        const int buf = i & 1;
        cp_async_wait_all();
        fence_proxy_async(); // cp.async wrote through the generic proxy; wgmma reads through the async one
        __syncthreads();     // tile i visible to all; everyone is done with the other buffer
        if (t_next >= 0) {
            const int n1 = t_next * BLOCK_N;
            const u32 off = (u32)((buf ^ 1) * KV_BYTES);
            load_tile<BLOCK_N>(sK + off, gk + (i64)n1 * p.k_ss, p.k_ss, sk - n1, p.head_dim, tid);
            load_tile<BLOCK_N>(sV + off, gv + (i64)n1 * p.v_ss, p.v_ss, sk - n1, p.head_dim_v, tid);
            cp_async_commit();
        }
        consume_tile<masked>(st, q_base, sK + buf * KV_BYTES, sV + buf * KV_BYTES, tile_at(i) * BLOCK_N, tig, p.pre, p.tau,
                             []() {});
    };
    for (int i = 0; i < n_full; ++i) step(i, FullTile{});
    for (int i = n_full; i < n_tiles; ++i) step(i, MaskedTile{});

    cp_async_wait_all();
    __syncthreads(); // every warpgroup is done with sQ/sK/sV: sQ becomes the output staging tile
    finish_rows(st, sQ_ptr, row0, tig, rows_valid, lse_row0);
    __syncthreads();
    store_rows<BLOCK_M, THREADS>(sQ_ptr, go, p.o_ss, 0, rows_valid, p.head_dim_v, tid);
#endif
#undef LO_OF
#undef HI_OF
}
