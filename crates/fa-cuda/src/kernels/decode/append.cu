// Appends new K/V tokens to a KV cache in place: token j of sequence b goes to position
// seqused_k[b] + j, in a padded cache (row seqused_k[b] + j of sequence b) or a paged one
// (through the block table). The host has checked capacity and block indices (typed errors,
// cache untouched); here positions and table entries are clamped to the cache anyway, so that
// unchecked device values cannot write outside it. Grid (seqlen_new, batch); the threads copy
// 16-byte chunks of every KV head's row. No defines.

#include "common/params.cuh"

#ifdef FA_COMPILE_CHECK_NONCE
__device__ const int fa_compile_check_nonce = FA_COMPILE_CHECK_NONCE;
#endif

extern "C" __global__ void __launch_bounds__(128) append_kv(const AttnParams p) {
    const int j = blockIdx.x, b = blockIdx.y;
    const int used = reinterpret_cast<const int*>(p.seqused_k)[b];
    const int t = used + j;
    if (used < 0 || t >= p.capacity) return;
    i64 k_row, v_row;
    if (p.block_size > 0) {
        const int slot = t / p.block_size, in_block = t - slot * p.block_size;
        const int blk = reinterpret_cast<const int*>(p.block_table)[(i64)b * p.blocks_per_seq + slot];
        if (blk < 0 || blk >= p.num_blocks) return;
        k_row = (i64)blk * p.k_bs + (i64)in_block * p.k_ss;
        v_row = (i64)blk * p.v_bs + (i64)in_block * p.v_ss;
    } else {
        k_row = (i64)b * p.k_bs + (i64)t * p.k_ss;
        v_row = (i64)b * p.v_bs + (i64)t * p.v_ss;
    }
    u16* k = reinterpret_cast<u16*>(p.k) + k_row;
    u16* v = reinterpret_cast<u16*>(p.v) + v_row;
    const u16* kn = reinterpret_cast<const u16*>(p.k_new) + (i64)b * p.kn_bs + (i64)j * p.kn_ss;
    const u16* vn = reinterpret_cast<const u16*>(p.v_new) + (i64)b * p.vn_bs + (i64)j * p.vn_ss;
    const int heads_kv = p.heads_q / p.group;
    const int k_chunks = p.head_dim / 8, v_chunks = p.head_dim_v / 8;
    for (int id = threadIdx.x; id < heads_kv * k_chunks; id += blockDim.x) {
        const int h = id / k_chunks, c = id % k_chunks;
        *reinterpret_cast<u32x4*>(k + h * p.k_hs + c * 8) = *reinterpret_cast<const u32x4*>(kn + h * p.kn_hs + c * 8);
    }
    for (int id = threadIdx.x; id < heads_kv * v_chunks; id += blockDim.x) {
        const int h = id / v_chunks, c = id % v_chunks;
        *reinterpret_cast<u32x4*>(v + h * p.v_hs + c * 8) = *reinterpret_cast<const u32x4*>(vn + h * p.vn_hs + c * 8);
    }
}
