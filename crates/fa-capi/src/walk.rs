//! `fa_block_walk`: a paged KV cache's block walk built on the host (API version 4), for
//! [`FaKvCache::block_walk`]. Pure host code: no device, no driver.

use crate::convert::*;
use crate::error::{guard, Failure};
use softmax_core::ProblemDesc;

/// Builds the block walk of a paged KV cache into `walk` (host memory): the order in which
/// `fa_forward_cache_cuda` reads the cache's blocks when `FaKvCache::block_walk` points to a
/// device copy of it. Per sequence `b`, its used blocks (those holding its first
/// `seqused_k[b]` keys) sorted by physical block index: `walk[(b · 2 + 0) · blocks_per_seq + j]`
/// is the `j`-th smallest physical block and `walk[(b · 2 + 1) · blocks_per_seq + j]` its
/// logical index (its column in the block table); entries past the used blocks are 0. The
/// walk is int32 `[batch, 2, blocks_per_seq]`: `2 · batch · blocks_per_seq` values, written
/// at the start of `walk` (which holds `walk_len` int32s; any past those are not touched).
///
/// The arguments are those of the cache (`FaKvCache`'s `seqused_k`, `block_table`,
/// `blocks_per_seq`, `block_size`, `num_blocks`, with `batch` the problem's), here in host
/// memory, and are checked as `fa_forward_cache_cpu` checks a cache's tables, before anything
/// is written: a negative length or one past the capacity (`blocks_per_seq · block_size`), a
/// used block index outside `0..num_blocks`, a block size below 1, a batch below 1, negative
/// sizes, null or misaligned arrays (an empty one may be null), a `walk_len` below
/// `2 · batch · blocks_per_seq`, and a `walk` that overlaps the tables are
/// `FA_ERR_INVALID_ARGUMENT` with `walk` untouched. Table entries past a sequence's used
/// blocks are not read (`-1` is fine there).
///
/// The walk depends only on the lengths and the table: build it once per decode step (after
/// the step's append, from the lengths the attention calls read), copy it to the device, and
/// pass it to every layer's call.
///
/// # Safety
/// `seqused_k` must point to `batch` readable int32s, `block_table` to
/// `batch · blocks_per_seq`, `walk` to `walk_len` writable int32s (each may be null only
/// when it holds none); nothing else may access them during the call.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fa_block_walk(
    seqused_k: *const i32,
    block_table: *const i32,
    batch: i64,
    blocks_per_seq: i64,
    block_size: i64,
    num_blocks: i64,
    walk: *mut i32,
    walk_len: usize,
) -> i32 {
    guard(|| {
        let batch = size(batch, "batch")?;
        let blocks_per_seq = size(blocks_per_seq, "blocks_per_seq")?;
        let block_size = size(block_size, "block_size")?;
        let num_blocks = size(num_blocks, "num_blocks")?;
        if batch == 0 {
            return Err(Failure::invalid(
                "batch is 0: a cache has at least one sequence",
            ));
        }
        if block_size == 0 {
            return Err(Failure::invalid(
                "block_size is 0: a paged cache has at least one key per block",
            ));
        }
        let entries = batch
            .checked_mul(blocks_per_seq)
            .ok_or_else(|| Failure::invalid("batch · blocks_per_seq overflows"))?;
        let needed = entries
            .checked_mul(2)
            .ok_or_else(|| Failure::invalid("2 · batch · blocks_per_seq overflows"))?;
        if walk_len < needed {
            return Err(Failure::invalid(format!(
                "walk_len is {walk_len} but the walk of {batch} sequences of {blocks_per_seq} \
                 blocks is [batch, 2, blocks_per_seq] = {needed} int32s"
            )));
        }
        let spans = [
            (
                "seqused_k",
                host_span("seqused_k", seqused_k as usize, batch, 4)?,
                false,
            ),
            (
                "block_table",
                host_span("block_table", block_table as usize, entries, 4)?,
                false,
            ),
            ("walk", host_span("walk", walk as usize, needed, 4)?, true),
        ];
        check_disjoint(&spans)?;
        // SAFETY: the arrays follow this function's contract (null, alignment and overflow
        // checked again inside).
        let used = unsafe { read_prefix_sums(seqused_k, batch, "seqused_k") }?;
        // SAFETY: as above.
        let table = unsafe { read_host_i32s(block_table, entries, "block_table") }?;
        // The cache call's validation of the tables, on the smallest problem that has them:
        // one query of one head of one channel per sequence.
        let problem = ProblemDesc::new(batch, 1, 0, 1, 1, 1)
            .paged_cache(&used, &table, blocks_per_seq, block_size, num_blocks)
            .validate(softmax_core::MAX_HEAD_DIM)?;
        if needed == 0 {
            // No block per sequence: nothing to write (and fa-cuda's builder steps over
            // sequences in chunks of 2 · blocks_per_seq, which must not be 0).
            return Ok(());
        }
        let built = fa_cuda::block_walk(&problem)?;
        debug_assert_eq!(built.len(), needed);
        // SAFETY: `walk` passed host_span for `needed` int32s, overlaps no input
        // (check_disjoint), and is writable (the contract).
        unsafe { slice_mut::<i32>(walk as usize, needed) }.copy_from_slice(&built);
        Ok(())
    })
}
