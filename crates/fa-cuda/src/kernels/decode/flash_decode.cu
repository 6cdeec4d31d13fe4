// Split-KV decode kernel (flash-decoding) for sm_80 and newer: a few queries per sequence
// against a KV cache, padded (`seqused_k`) or paged (int32 block table). mma.sync.m16n8k16,
// ldmatrix and multi-stage cp.async from common/*.cuh, the tile steps from common/tile.cuh
// (shared with the sm80 forward); compiled by NVRTC with these defines:
//
//   HDP         head dim the tiles are laid out for (64, 128 or 256; the real head dims may be
//               smaller: missing columns are zero-filled)
//   MT          16-row m-tiles per CTA: the CTA's rows are the query heads of one KV group
//               times the queries of the sequence (GQA packing, head-major: row = g*seqlen_q + i)
//   WN          keys per warp per tile (16 or 32); a tile is WARPS*WN keys
//   WARPS       warps per CTA; all of them share the CTA's rows and split each tile's keys
//   STAGES      K/V tiles in flight (cp.async groups)
//   IS_BF16     1: bf16, 0: fp16
//   GENERAL_SCORES 1: scores transformed before the max (softcap or a non-positive scale)
//
// Grid: x = m_block * num_splits + split, y = KV head, z = sequence. A split takes a contiguous
// range of the sequence's key tiles (those its rows can see); every warp keeps its own online
// softmax over its keys of each tile, and at the end the warps' partial rows are merged with
// softmax-core's merge (common/merge.cuh). With one split the CTA writes O and the LSE; with
// more it writes its unnormalised accumulator and (m, l) per row to the f32 workspace, and
// flash_decode_combine (decode/combine.cu) merges the splits.
//
// A paged cache of blocks that a tile's threads read whole (8 keys or more at head dim 128:
// dealt out within a tile, or holding whole tiles) may come with a block walk (`p.block_walk`, built on the host by `block_walk` in kernels/decode.rs):
// per sequence, its used blocks in ascending physical order, each with its logical index. The
// kernel then streams the blocks in that order (walk position w = the key's place in the walk)
// and masks each key by its logical position: a split reads one ascending run of addresses
// instead of blocks scattered over the pool, which runs at in-order speed (scattered 16-key
// blocks read 3-5 % slower on an H200; docs/history/gpu-notes.md, 2026-12-02). Attention does
// not depend on the order of its keys; only the rounding of the sums changes.
//
// Every device-side length and table entry is clamped to the tensors the host checked, so
// unchecked device values (caller-memory path) cannot make the kernel read or write outside
// them.

#if !defined(HDP) || !defined(MT) || !defined(WN) || !defined(WARPS) || !defined(STAGES) || \
    !defined(IS_BF16) || !defined(GENERAL_SCORES)
#error "decode/flash_decode.cu needs HDP, MT, WN, WARPS, STAGES, IS_BF16, GENERAL_SCORES"
#endif

#include "common/merge.cuh"
#include "common/tile.cuh"
#include "common/params.cuh"

#define THREADS (WARPS * 32)
#define BLOCK_M (16 * MT)            // rows per CTA
#define BLOCK_N (WARPS * WN)         // keys per tile
#define NT (WN / 8)                  // 8-key n-tiles of one warp's S
#define DT (HDP / 8)                 // 8-column n-tiles of O
#define KQ (HDP / 16)                // k-steps of S = Q K^T
#define KP (WN / 16)                 // k-steps of O += P V
#define CHUNKS (HDP / 8)             // 16-byte chunks per smem row
#define ROW_BYTES (HDP * 2)
#define TPR (THREADS / BLOCK_M)      // threads per row in the final merge
#define CPT (HDP / TPR)              // columns per thread in the final merge
#define LOAD_ITERS (BLOCK_N * CHUNKS / THREADS) // K/V rows per thread per tile
// floor(log2(LOAD_ITERS)), used only where LOAD_ITERS is a power of two
#define LOAD_ITERS_LOG2 (LOAD_ITERS >= 256 ? 8 : LOAD_ITERS >= 128 ? 7 : LOAD_ITERS >= 64 ? 6 : LOAD_ITERS >= 32 ? 5 : \
                         LOAD_ITERS >= 16 ? 4 : LOAD_ITERS >= 8 ? 3 : LOAD_ITERS >= 4 ? 2 : LOAD_ITERS >= 2 ? 1 : 0)
// A paged cache's block-table entries, one per key of a tile, in a shared-memory ring of
// TAB_RING tiles: they are copied (cp.async) STAGES-1 tiles before the K/V copies that use
// them, so the table's latency overlaps the pipeline instead of stalling each tile's copies.
#define TAB_RING (2 * STAGES)
// A walk position past a sequence's used blocks: a logical key no row sees (capacities stay
// below 2^30).
#define WALK_PAST (1 << 30)

#if (HDP % 64) != 0 || (WN % 16) != 0 || (THREADS % BLOCK_M) != 0 || (CPT % 8) != 0 || STAGES < 2
#error "bad decode tile configuration"
#endif
#if (THREADS % CHUNKS) != 0 || ((BLOCK_N * CHUNKS) % THREADS) != 0
#error "K/V tile loads must divide evenly among threads"
#endif

#ifdef FA_COMPILE_CHECK_NONCE
__device__ const int fa_compile_check_nonce = FA_COMPILE_CHECK_NONCE;
#endif

#define ELEM_BF16 (IS_BF16 != 0)

// Waits until at most N cp.async groups of this thread are pending.
template <int N>
static __device__ __forceinline__ void cp_async_wait_pending() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

static __device__ __forceinline__ int swz(int row, int chunk) {
    return row * HDP + ((chunk ^ (row & 7)) << 3);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) flash_decode(const AttnParams p) {
    extern __shared__ __attribute__((aligned(128))) unsigned char smem_raw[];
    u16* sQ = reinterpret_cast<u16*>(smem_raw);
    u16* sK = sQ + BLOCK_M * HDP;
    u16* sV = sK + STAGES * BLOCK_N * HDP;
    int* sTab = reinterpret_cast<int*>(sV + STAGES * BLOCK_N * HDP); // [TAB_RING][BLOCK_N]
    int* sLog = sTab + TAB_RING * BLOCK_N; // walk: the logical block of each key, same ring

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // The combine (a programmatic dependent launch on sm_90+) may be scheduled now: it waits
    // for this grid's completion itself, so only its launch latency overlaps this kernel.
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tig = lane & 3;
    const int split = (int)blockIdx.x % p.num_splits;
    const int m_block = (int)blockIdx.x / p.num_splits;
    const int hk = blockIdx.y, b = blockIdx.z;
    const int sq = p.seqlen_q;
    const int m0 = m_block * BLOCK_M;
    if (m0 >= p.rows) return;
    const int rows_here = min(BLOCK_M, p.rows - m0);

    const bool paged = p.block_size > 0;
    // Q rows: row r is query i of query head hk*group + r / seqlen_q (zero-filled past the rows).
    {
        const u16* gq = reinterpret_cast<const u16*>(p.q) + b * p.q_bs;
        const u32 base = smem_u32(sQ);
        for (int id = tid; id < BLOCK_M * CHUNKS; id += THREADS) {
            const int row = id / CHUNKS, c = id % CHUNKS;
            const int r = m0 + row;
            const bool ok = row < rows_here && c * 8 < p.head_dim;
            const int h = hk * p.group + r / sq;
            const u16* src = ok ? gq + (i64)(r % sq) * p.q_ss + (i64)h * p.q_hs + c * 8 : gq;
            cp_async16(base + (u32)swz(row, c) * 2u, src, ok);
        }
    }

    // The K/V rows of a tile this thread loads: rows row0 + it*(THREADS/CHUNKS), one 16-byte
    // chunk column each.
    const u16* gk = reinterpret_cast<const u16*>(p.k) + (i64)hk * p.k_hs;
    const u16* gv = reinterpret_cast<const u16*>(p.v) + (i64)hk * p.v_hs;
    constexpr int ROW_STEP = THREADS / CHUNKS;
    const int c_ld = tid % CHUNKS, row0 = tid / CHUNKS;
    const bool k_col = c_ld * 8 < p.head_dim, v_col = c_ld * 8 < p.head_dim_v;
    const u16* gk_seq = gk + (paged ? 0 : (i64)b * p.k_bs) + c_ld * 8;
    const u16* gv_seq = gv + (paged ? 0 : (i64)b * p.v_bs) + c_ld * 8;
    const i64 k_step = (i64)ROW_STEP * p.k_ss, v_step = (i64)ROW_STEP * p.v_ss;
    // Row `row` of a tile in the stage at k_base / v_base from the K/V rows at kp / vp, or zeros
    // (`ok` false: a key past the used length or the capacity; columns past the head dims).
    auto copy_kv_row = [&](const u32 k_base, const u32 v_base, const int row, const bool ok, const u16* kp,
                           const u16* vp) {
        const u32 dst = (u32)swz(row, c_ld) * 2u;
        cp_async16(k_base + dst, ok && k_col ? kp : gk, ok && k_col);
        cp_async16(v_base + dst, ok && v_col ? vp : gv, ok && v_col);
    };
    // This thread's rows of a tile at a constant step (row0 + it * ROW_STEP, logical keys key0 +
    // it * ROW_STEP, zero-filled from `bound` on) into the stage at k_base / v_base, from the K/V
    // rows at kp / vp stepped by k_step / v_step: a padded cache's tiles and a paged tile inside
    // one block.
    auto stepped_rows = [&](const u32 k_base, const u32 v_base, const int key0, const int bound, const u16* kp,
                            const u16* vp) {
#pragma unroll
        for (int it = 0; it < LOAD_ITERS; ++it) {
            copy_kv_row(k_base, v_base, row0 + it * ROW_STEP, key0 + it * ROW_STEP < bound, kp, vp);
            kp += k_step;
            vp += v_step;
        }
    };
    // Tile t of a padded cache into stage `stage`, keys from `bound` on zero-filled: one 64-bit
    // address per tile, a constant row step.
    auto padded_tile = [&](const int t, const int stage, const int bound) {
        const int key0 = t * BLOCK_N + row0;
        stepped_rows(smem_u32(sK + stage * BLOCK_N * HDP), smem_u32(sV + stage * BLOCK_N * HDP), key0, bound,
                     gk_seq + (i64)key0 * p.k_ss, gv_seq + (i64)key0 * p.v_ss);
    };
    // Early issue: split 0 of a padded cache without a left window starts at tile 0 whatever the
    // sequence's length, so its first STAGES-1 tiles go out before the `seqused_k` read, bounded
    // by the capacity (that read is one DRAM round trip before any K/V address otherwise, the
    // short-cache floor of docs/history/gpu-notes.md, 2026-12-01 and 2026-12-06). Rows at and
    // past the used length are zeroed in shared memory once it is known (a short sequence
    // only). Same groups as the prologue below.
    const bool early = !paged && p.win_left < 0 && split == 0;
    if (early) {
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st) {
            padded_tile(st, st, p.capacity);
            cp_async_commit();
        }
    }

    // Keys this sequence uses, clamped to the cache's capacity.
    const int seqused = reinterpret_cast<const int*>(p.seqused_k)[b];
    const int sk = min(max(seqused, 0), p.capacity);
    const int diag = sk - sq;
    // A power-of-two block size (the usual 16-256) finds a key's row in its block with a mask
    // instead of an integer division per row and chunk.
    const bool block_pow2 = paged && (p.block_size & (p.block_size - 1)) == 0;
    const int block_mask = p.block_size - 1, block_shift = __ffs(p.block_size) - 1;
    // Paged blocks that divide the tile and hold LOAD_ITERS keys or more (see load_kv).
    // (LOAD_ITERS is a power of two in every tuned variant; a tuning override where it is not,
    // e.g. 2 warps of 48 keys, reads such blocks per row.)
    const bool tile_blocks = (LOAD_ITERS & (LOAD_ITERS - 1)) == 0 && block_pow2 && BLOCK_N % p.block_size == 0 &&
                             p.block_size >= LOAD_ITERS;
    // The block walk, for blocks read whole (dealt out within a tile, or holding whole
    // tiles) of at least one 8-key n-tile (the host passes it only then and without a left
    // window; anything else reads the table in order).
    const bool walking = p.block_walk != 0 && (tile_blocks || (block_pow2 && p.block_size % BLOCK_N == 0)) &&
                         p.block_size >= 8;
    // Walk positions at and past `walked` lie beyond the sequence's used blocks.
    const int walked = walking ? ((sk + block_mask) >> block_shift) << block_shift : sk;
#define LO_OF(i) KEY_LO((i), diag, p.win_left)
#define HI_OF(i) KEY_HI((i), diag, p.win_right, sk)

    // The queries of this CTA's rows: one query range when the rows lie within one head,
    // every query otherwise (a bound on the keys they see, not a mask).
    const int r_first = m0, r_last = m0 + rows_here - 1;
    int i_min = 0, i_max = sq - 1;
    if (r_first / sq == r_last / sq) {
        i_min = r_first % sq;
        i_max = r_last % sq;
    }
    // A walk streams every used block, whole (blocks larger than a tile may put the partial
    // one anywhere in the walk): the keys a row does not see are masked one by one.
    const int union_lo = walking ? 0 : LO_OF(i_min), union_hi = walking ? walked : HI_OF(i_max);
    int t_begin = 0, t_end = 0;
    if (union_hi > union_lo) {
        const int tiles_lo = union_lo / BLOCK_N, tiles_hi = (union_hi + BLOCK_N - 1) / BLOCK_N;
        const int per_split = (tiles_hi - tiles_lo + p.num_splits - 1) / p.num_splits;
        t_begin = min(tiles_lo + split * per_split, tiles_hi);
        t_end = min(t_begin + per_split, tiles_hi);
    }
    const int n_tiles = t_end - t_begin;

    // Per fragment row: its visible keys [lo, hi) (padding rows see [0, sk): never stored).
    int row_lo[MT][2], row_hi[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = m0 + mt * 16 + g + 8 * hh;
            const int i = r % sq;
            row_lo[mt][hh] = r < p.rows ? LO_OF(i) : 0;
            row_hi[mt][hh] = r < p.rows ? HI_OF(i) : sk;
        }


    // The physical block of walk step j is the walk's plane 0, its logical index plane 1.
    const int* table = walking ? reinterpret_cast<const int*>(p.block_walk) + (i64)b * 2 * p.blocks_per_seq
                               : reinterpret_cast<const int*>(p.block_table) + (i64)b * p.blocks_per_seq;
    // A paged cache's block-table entries of tile t into its ring slot: the entry of key
    // n0 + j at j (read only for used keys: entries past them are unchecked, zero-filled here),
    // and with a walk the logical block of walk position n0 + j.
    auto load_table = [&](const int t) {
        if (tid < BLOCK_N) {
            const int key = t * BLOCK_N + tid;
            const bool ok = key < walked;
            const int entry = ok ? (block_pow2 ? key >> block_shift : key / p.block_size) : 0;
            const int slot = (t % TAB_RING) * BLOCK_N + tid;
            cp_async4(smem_u32(sTab + slot), table + entry, ok);
            if (walking) cp_async4(smem_u32(sLog + slot), table + p.blocks_per_seq + entry, ok);
        }
    };
    // One K/V tile into stage `stage`: row t of the tile is key n0 + t, zero-filled at and past
    // the used length (and in the columns past the head dims). Each thread copies one 16-byte
    // chunk column of the rows row0 + it * ROW_STEP. A padded cache computes one 64-bit address
    // per tile and steps it by a constant per row (the per-row 64-bit index products were
    // half of the kernel's instructions under ncu on the H200); a paged cache addresses each
    // key through its block (the ring's entry, clamped to the cache).
    auto load_kv = [&](const int t, const int stage) {
        const int n0 = t * BLOCK_N;
        const u32 k_base = smem_u32(sK + stage * BLOCK_N * HDP);
        const u32 v_base = smem_u32(sV + stage * BLOCK_N * HDP);
        // Row `row` of the tile, logical key `key`, from the K and V rows at kp and vp.
        auto copy_row = [&](const int row, const int key, const u16* kp, const u16* vp) {
            copy_kv_row(k_base, v_base, row, key < sk, kp, vp);
        };
        if (!paged) {
            padded_tile(t, stage, sk);
            return;
        }
        const int* tab = sTab + (t % TAB_RING) * BLOCK_N;
        if (block_pow2 && p.block_size % BLOCK_N == 0) {
            // The tile lies inside one block (tiles start at multiples of BLOCK_N): one table
            // entry, then the padded cache's row step.
            const int bb = min(max(tab[0], 0), p.num_blocks - 1);
            const i64 in0 = (n0 & block_mask) + row0;
            // In a walk, the block's logical start.
            int key0 = n0 + row0;
            if (walking) {
                const int lb = min(max(sLog[(t % TAB_RING) * BLOCK_N], 0), p.blocks_per_seq - 1);
                key0 = n0 < walked ? (lb << block_shift) + (int)in0 : WALK_PAST;
            }
            stepped_rows(k_base, v_base, key0, sk, gk_seq + (i64)bb * p.k_bs + in0 * p.k_ss,
                         gv_seq + (i64)bb * p.v_bs + in0 * p.v_ss);
            return;
        }
        if (tile_blocks) {
            // Blocks that divide the tile, of LOAD_ITERS keys or more (8-32 at head dim 128):
            // the tile's blocks are dealt out whole, gpb = block_size / LOAD_ITERS row groups
            // (row0) per block, so this thread's rows all lie in one block — rows in_first,
            // in_first + gpb, ... of the tile's block starting at row j_first: one table entry
            // per tile, then a constant row step as in a padded cache. The same rows and
            // chunks as the padded order, dealt out differently.
            const int gpb_shift = block_shift - LOAD_ITERS_LOG2;
            const int in_first = row0 & ((1 << gpb_shift) - 1);
            const int j_first = (row0 >> gpb_shift) << block_shift;
            const int bb = min(max(tab[j_first], 0), p.num_blocks - 1);
            const u16* kp = gk_seq + (i64)bb * (int)p.k_bs + in_first * (int)p.k_ss;
            const u16* vp = gv_seq + (i64)bb * (int)p.v_bs + in_first * (int)p.v_ss;
            const int k_run = (int)p.k_ss << gpb_shift, v_run = (int)p.v_ss << gpb_shift;
            // The logical key of this thread's first row: in a walk, its block's logical start.
            int key0 = n0 + j_first + in_first;
            if (walking) {
                const int lb = min(max(sLog[(t % TAB_RING) * BLOCK_N + j_first], 0), p.blocks_per_seq - 1);
                key0 = n0 + j_first < walked ? (lb << block_shift) + in_first : WALK_PAST;
            }
#pragma unroll
            for (int it = 0; it < LOAD_ITERS; ++it) {
                copy_row(j_first + in_first + (it << gpb_shift), key0 + (it << gpb_shift), kp, vp);
                kp += k_run;
                vp += v_run;
            }
            return;
        }
        // Smaller or odd blocks: one table entry per row. A block's offset is a 64-bit product
        // of a 32-bit stride (a cache may pass 2^31 elements in all), the row's offset inside
        // its block a 32-bit one (the plan refuses blocks spanning 2^31 elements).
        auto paged_row = [&](const int it, const int in_block) {
            const int bb = min(max(tab[row0 + it * ROW_STEP], 0), p.num_blocks - 1);
            copy_row(row0 + it * ROW_STEP, n0 + row0 + it * ROW_STEP, gk_seq + (i64)bb * (int)p.k_bs + in_block * (int)p.k_ss,
                     gv_seq + (i64)bb * (int)p.v_bs + in_block * (int)p.v_ss);
        };
        if (block_pow2) {
#pragma unroll
            for (int it = 0; it < LOAD_ITERS; ++it) paged_row(it, (n0 + row0 + it * ROW_STEP) & block_mask);
        } else {
#pragma unroll
            for (int it = 0; it < LOAD_ITERS; ++it) paged_row(it, (n0 + row0 + it * ROW_STEP) % p.block_size);
        }
    };

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

    // ldmatrix addresses (sm80/flash_fwd.cu's scheme): the warp's keys start at row warp*WN of
    // a tile, a multiple of 16, so the swizzle's low row bits stay those of the lane.
    u32 q_addr[4], k_addr[4], v_addr[4];
    {
        const u32 sQa = smem_u32(sQ), sKa = smem_u32(sK), sVa = smem_u32(sV);
        const int yq = (lane >> 4) ^ (lane & 7);
        const int yk = ((lane >> 3) & 1) ^ (lane & 7);
        const int yv = (lane >> 4) ^ (lane & 7);
        const int q_row = lane & 15;
        const int k_row = warp * WN + (lane & 7) + ((lane >> 4) << 3);
        const int v_row = warp * WN + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            q_addr[j] = sQa + q_row * ROW_BYTES + (((2 * j) ^ yq) << 4);
            k_addr[j] = sKa + k_row * ROW_BYTES + (((2 * j) ^ yk) << 4);
            v_addr[j] = sVa + v_row * ROW_BYTES + (((2 * j) ^ yv) << 4);
        }
    }

    // One tile in stage `stage`: this warp's WN keys.
    auto tile = [&](const int t, const int stage) {
        const u32 buf_bytes = (u32)(stage * BLOCK_N * ROW_BYTES);
        const int n0 = t * BLOCK_N + warp * WN;
        float s[MT][NT][4];
        tile_qk<MT, NT, KQ, KQ / 4, ELEM_BF16, ROW_BYTES>(s, q_addr, k_addr, buf_bytes);
        // Scores and mask (the key tail, causal and window bounds are all in [lo, hi)), each
        // 8-key n-tile at its logical keys (in a walk: its block's logical start).
        int col0[NT];
#pragma unroll
        for (int j = 0; j < NT; ++j) col0[j] = n0 + 8 * j;
        if (walking) {
            const int* lg = sLog + (t % TAB_RING) * BLOCK_N + warp * WN;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int lb = min(max(lg[8 * j], 0), p.blocks_per_seq - 1);
                col0[j] = col0[j] < walked ? (lb << block_shift) + (col0[j] & block_mask) : WALK_PAST;
            }
        }
        tile_scores_at<MT, NT, GENERAL_SCORES != 0, true>(s, col0, tig, row_lo, row_hi, p.pre, p.softcap_post);
        // Online softmax of the warp's rows (RowState::begin_block, threshold policy).
        tile_rescale<MT, NT, DT, GENERAL_SCORES != 0>(s, row_m, row_l, acc, p.pre, p.tau);
        u32 pa[MT][KP][4];
        tile_exp<MT, NT, KP, ELEM_BF16, GENERAL_SCORES != 0>(s, row_m, row_l, pa, p.pre);
        // O += P V over this warp's keys.
        tile_pv<MT, KP, DT, ELEM_BF16, ROW_BYTES>(acc, pa, v_addr, buf_bytes);
    };

    // Pipeline: Q and the first STAGES-1 tiles in flight, then one new tile per tile consumed.
    // Every step commits a group (possibly empty) so that the wait count stays uniform. A paged
    // cache first copies the table entries of the first 2*STAGES-2 tiles (one group, waited
    // for), then each step's group also carries the entries of the tile STAGES-1 further on:
    // with that extra leading group, the wait at step `it` completes the groups through the
    // one holding tile it's K/V and the entries of tile it+STAGES-1, which that step loads.
    if (paged) {
        for (int st = 0; st < 2 * STAGES - 2 && st < n_tiles; ++st) load_table(t_begin + st);
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
    }
    if (early) {
        // The early tiles hold the capacity's keys: zero the rows at and past the used length.
        if (sk < (STAGES - 1) * BLOCK_N) {
            cp_async_wait_all();
#pragma unroll
            for (int st = 0; st < STAGES - 1; ++st)
#pragma unroll
                for (int it = 0; it < LOAD_ITERS; ++it) {
                    const int row = row0 + it * ROW_STEP;
                    if (st * BLOCK_N + row >= sk) {
                        const int at = st * BLOCK_N * HDP + swz(row, c_ld);
                        *reinterpret_cast<u32x4*>(sK + at) = u32x4{0u, 0u, 0u, 0u};
                        *reinterpret_cast<u32x4*>(sV + at) = u32x4{0u, 0u, 0u, 0u};
                    }
                }
        }
    } else {
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st) {
            if (st < n_tiles) load_kv(t_begin + st, st);
            cp_async_commit();
        }
    }
    for (int it = 0; it < n_tiles; ++it) {
        cp_async_wait_pending<STAGES - 2>();
        __syncthreads(); // tile `it` (and Q) visible; every warp is done with tile it-1's stage
        const int ahead = it + STAGES - 1;
        if (ahead < n_tiles) load_kv(t_begin + ahead, ahead % STAGES);
        if (paged && ahead + STAGES - 1 < n_tiles) load_table(t_begin + ahead + STAGES - 1);
        cp_async_commit();
        tile(t_begin + it, it % STAGES);
    }

    // Merge the warps' partial rows (softmax-core's merge), through shared memory.
    cp_async_wait_all();
    __syncthreads(); // every warp is done with sQ/sK/sV: they become the merge buffers
    float* sM = reinterpret_cast<float*>(smem_raw);          // [WARPS][BLOCK_M] reference max
    float* sL = sM + WARPS * BLOCK_M;                        // [WARPS][BLOCK_M] sum
    float* sAcc = sL + WARPS * BLOCK_M;                      // [WARPS][BLOCK_M][HDP]
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = mt * 16 + g + 8 * hh;
            const float l = quad_sum(row_l[mt][hh]);
            if (tig == 0) {
                sM[warp * BLOCK_M + row] = row_m[mt][hh];
                sL[warp * BLOCK_M + row] = l;
            }
            float* dst = sAcc + (warp * BLOCK_M + row) * HDP + 2 * tig;
#pragma unroll
            for (int d = 0; d < DT; ++d) {
                dst[d * 8] = acc[mt][d][2 * hh];
                dst[d * 8 + 1] = acc[mt][d][2 * hh + 1];
            }
        }
    __syncthreads();

    const int row = tid / TPR, col0 = (tid % TPR) * CPT;
    float m = NEG_INF, l = 0.0f;
    float o[CPT];
#pragma unroll
    for (int c = 0; c < CPT; ++c) o[c] = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        float fa, fb;
        merge_state(m, l, sM[w * BLOCK_M + row], sL[w * BLOCK_M + row], fa, fb);
        const float* src = sAcc + (w * BLOCK_M + row) * HDP + col0;
#pragma unroll
        for (int c = 0; c < CPT; ++c) o[c] = o[c] * fa + src[c] * fb;
    }
    if (row >= rows_here) return;
    const int r = m0 + row;
    const int i = r % sq, h = hk * p.group + r / sq;
    if (p.num_splits == 1) {
        float inv, lse;
        finish_state(m, l, inv, lse);
        u16* go = reinterpret_cast<u16*>(p.o) + b * p.o_bs + (i64)i * p.o_ss + (i64)h * p.o_hs;
#pragma unroll
        for (int c = 0; c < CPT; c += 8) {
            if (col0 + c < p.head_dim_v) {
                u32x4 v;
                v.x = pack2<ELEM_BF16>(o[c] * inv, o[c + 1] * inv);
                v.y = pack2<ELEM_BF16>(o[c + 2] * inv, o[c + 3] * inv);
                v.z = pack2<ELEM_BF16>(o[c + 4] * inv, o[c + 5] * inv);
                v.w = pack2<ELEM_BF16>(o[c + 6] * inv, o[c + 7] * inv);
                *reinterpret_cast<u32x4*>(go + col0 + c) = v;
            }
        }
        if (p.lse != 0 && col0 == 0) reinterpret_cast<float*>(p.lse)[b * p.lse_bs + h * p.lse_hs + i] = lse;
    } else {
        // Partial row `((split * batch + b) * heads_q + h) * seqlen_q + i` of the workspace.
        const i64 prow = (((i64)split * p.batch + b) * p.heads_q + h) * sq + i;
        float* part = reinterpret_cast<float*>(p.o_part) + prow * p.head_dim_v;
#pragma unroll
        for (int c = 0; c < CPT; c += 4) {
            if (col0 + c < p.head_dim_v) {
                *reinterpret_cast<f32x4*>(part + col0 + c) = f32x4{o[c], o[c + 1], o[c + 2], o[c + 3]};
            }
        }
        if (col0 == 0) {
            float* ml = reinterpret_cast<float*>(p.ml_part) + prow * 2;
            ml[0] = m;
            ml[1] = l;
        }
    }
#undef LO_OF
#undef HI_OF
}
