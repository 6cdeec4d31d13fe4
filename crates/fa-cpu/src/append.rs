//! Appending new key/value tokens to a KV cache in place.

use crate::Element;
use softmax_core::{Append, AppendLens, ProblemError};

/// Writes the new keys and values of every sequence into the cache at its position
/// (`seqused_k[b]` onwards; see [`softmax_core::AppendDesc`]), padded or paged, without
/// copying the cache. The lengths are not changed: add `seqlen_new` to `seqused_k` for the
/// attention call that follows.
///
/// `append` was validated by the caller ([`softmax_core::AppendDesc::validate`]: room in
/// every sequence, block table entries inside the cache, non-overlapping cache strides);
/// this call checks the buffer lengths before anything is written, so on error the cache is
/// untouched.
///
/// # Example
/// ```
/// use softmax_core::{AppendDesc, KvCache};
///
/// // Two sequences holding 3 and 0 keys of a padded cache with room for 4, 1 KV head, dim 2.
/// let used = [3u32, 0];
/// let append = AppendDesc::new(KvCache::Padded { seqused_k: &used }, 4, 1, 1, 2).validate()?;
/// let (mut k_cache, mut v_cache) = (vec![0.0f32; 2 * 4 * 2], vec![0.0f32; 2 * 4 * 2]);
/// let (k_new, v_new) = ([1.0f32, 2.0, 3.0, 4.0], [5.0f32, 6.0, 7.0, 8.0]);
/// fa_cpu::append_kv(&append, &k_new, &v_new, &mut k_cache, &mut v_cache)?;
/// assert_eq!(&k_cache[3 * 2..4 * 2], &[1.0, 2.0]); // sequence 0, position 3
/// assert_eq!(&v_cache[4 * 2..5 * 2], &[7.0, 8.0]); // sequence 1, position 0
/// # Ok::<(), softmax_core::ProblemError>(())
/// ```
pub fn append_kv<T: Element>(
    append: &Append,
    k_new: &[T],
    v_new: &[T],
    k_cache: &mut [T],
    v_cache: &mut [T],
) -> Result<(), ProblemError> {
    append.check_buffers(AppendLens {
        k_cache: k_cache.len(),
        v_cache: v_cache.len(),
        k_new: k_new.len(),
        v_new: v_new.len(),
    })?;
    let (d, dv) = (append.head_dim(), append.head_dim_v());
    for b in 0..append.batch() {
        for i in 0..append.seqlen_new() {
            for h in 0..append.heads_kv() {
                let (src, dst) = (
                    append.new_offset(false, b, i, h),
                    append.cache_offset(false, b, i, h),
                );
                k_cache[dst..dst + d].copy_from_slice(&k_new[src..src + d]);
                let (src, dst) = (
                    append.new_offset(true, b, i, h),
                    append.cache_offset(true, b, i, h),
                );
                v_cache[dst..dst + dv].copy_from_slice(&v_new[src..src + dv]);
            }
        }
    }
    Ok(())
}
