//! From C descriptors to a validated problem and checked buffers. Everything a C caller
//! passes is read once here: structs through [`read_struct`], host prefix sums through
//! [`read_prefix_sums`], host tensors through [`slice_ref`]/[`slice_mut`] after
//! [`host_span`] has checked null, alignment and overflow; the lengths come from the
//! validated problem (the caller gives none).

use crate::error::Failure;
use crate::types::*;
use core::ops::Range;
use softmax_core::{DType, KvCache, ProblemDesc, Sequences, Strides, Tensor};

/// Reads a `T` the caller points at, refusing null and misaligned pointers.
///
/// # Safety
/// A non-null, aligned `ptr` must point to a readable, initialised `T`.
pub(crate) unsafe fn read_struct<T: Copy>(ptr: *const T, name: &str) -> Result<T, Failure> {
    if ptr.is_null() {
        return Err(Failure::invalid(format!("{name} is a null pointer")));
    }
    if !ptr.is_aligned() {
        return Err(Failure::invalid(format!("{name} is misaligned")));
    }
    // SAFETY: non-null and aligned (checked), readable and initialised (the caller's contract).
    Ok(unsafe { ptr.read() })
}

/// A descriptor that begins with `size: u32` and `version: u32` (the caller's
/// `sizeof` and `FA_API_VERSION`), read by [`read_versioned`].
///
/// # Safety
/// The implementor is `#[repr(C)]`, its first two fields are those `u32`s, and every other
/// field is valid for any bytes (plain integers and raw pointers).
pub(crate) unsafe trait Versioned: Copy + Default {
    /// The struct's name in messages (`options`, `cache`).
    const NAME: &'static str;
    /// The C type's name in messages.
    const C_NAME: &'static str;
    /// The API version that introduced the struct.
    const SINCE: u32;
    /// The smallest size a caller may pass: the layout of [`Versioned::SINCE`].
    const MIN_SIZE: usize;
    /// Sets the size field (to this library's size once read).
    fn set_size(&mut self, size: u32);
    /// The version field.
    fn version(&self) -> u32;
}

// SAFETY: repr(C), `size` then `version` first, the rest plain integers and raw pointers.
unsafe impl Versioned for FaOptions {
    const NAME: &'static str = "options";
    const C_NAME: &'static str = "FaOptions";
    const SINCE: u32 = 1;
    const MIN_SIZE: usize = core::mem::offset_of!(FaOptions, version) + 4;
    fn set_size(&mut self, size: u32) {
        self.size = size;
    }
    fn version(&self) -> u32 {
        self.version
    }
}

// SAFETY: repr(C), `size` then `version` first, the rest plain integers and raw pointers.
unsafe impl Versioned for FaKvCache {
    const NAME: &'static str = "cache";
    const C_NAME: &'static str = "FaKvCache";
    const SINCE: u32 = 2;
    // Every field of version 2 is required.
    const MIN_SIZE: usize = core::mem::offset_of!(FaKvCache, num_splits) + 4;
    fn set_size(&mut self, size: u32) {
        self.size = size;
    }
    fn version(&self) -> u32 {
        self.version
    }
}

/// Reads a size-versioned descriptor: any older, smaller layout (down to
/// [`Versioned::MIN_SIZE`]) is read as far as it goes, the fields past it keep their
/// defaults; a larger size or a newer version is `FA_ERR_VERSION`.
///
/// # Safety
/// A non-null, aligned `ptr` must point to at least `ptr->size` readable bytes (at least
/// the `size` field itself).
pub(crate) unsafe fn read_versioned<T: Versioned>(ptr: *const T) -> Result<T, Failure> {
    let (name, c_name) = (T::NAME, T::C_NAME);
    if ptr.is_null() {
        return Err(Failure::invalid(format!("{name} is a null pointer")));
    }
    if !ptr.is_aligned() {
        return Err(Failure::invalid(format!("{name} is misaligned")));
    }
    // SAFETY: aligned and non-null; the leading `size` field is readable (the caller's
    // contract, and `Versioned`'s layout).
    let size = unsafe { ptr.cast::<u32>().read() } as usize;
    let ours = core::mem::size_of::<T>();
    if size < T::MIN_SIZE {
        return Err(Failure::invalid(format!(
            "{name}.size is {size}: too small for a {c_name} (set it to sizeof({c_name}))"
        )));
    }
    if size > ours {
        return Err(Failure {
            code: FA_ERR_VERSION,
            message: format!(
                "{name}.size is {size} bytes but this library (API version {FA_API_VERSION}) \
                 knows {ours}: a newer header than the library"
            ),
        });
    }
    let mut value = T::default();
    // SAFETY: `size` bytes are readable (the caller's contract) and fit in `value` (checked);
    // every field is valid for any bytes (`Versioned`'s contract).
    unsafe {
        core::ptr::copy_nonoverlapping(ptr.cast::<u8>(), (&mut value as *mut T).cast::<u8>(), size);
    }
    let version = value.version();
    if version < T::SINCE || version > FA_API_VERSION {
        return Err(Failure {
            code: FA_ERR_VERSION,
            message: format!(
                "{name}.version is {version} but this library implements API versions {} to \
                 {FA_API_VERSION} of {c_name}",
                T::SINCE
            ),
        });
    }
    value.set_size(ours as u32);
    Ok(value)
}

/// The options a caller passed (null: the defaults), as [`read_versioned`] reads them.
///
/// # Safety
/// As [`read_versioned`].
pub(crate) unsafe fn read_options(ptr: *const FaOptions) -> Result<FaOptions, Failure> {
    if ptr.is_null() {
        return Ok(FaOptions::default());
    }
    // SAFETY: forwarded.
    unsafe { read_versioned(ptr) }
}

/// The options' attention sinks ([`FaOptions::sinks`]) as a host slice of `heads_q` f32s, or
/// `None` when null; null (for `heads_q > 0`), misaligned and overflowing pointers are
/// refused. Their values are softmax-core's to check (validation: finite).
///
/// # Safety
/// A non-null `opts.sinks` must point to `p.heads_q` readable f32s that nobody writes during
/// the call.
pub(crate) unsafe fn read_sinks<'a>(
    opts: &FaOptions,
    p: &FaProblem,
) -> Result<Option<&'a [f32]>, Failure> {
    if opts.sinks.is_null() {
        return Ok(None);
    }
    let heads = size(p.heads_q, "problem.heads_q")?;
    host_span("options.sinks", opts.sinks as usize, heads, 4)?;
    // SAFETY: the span passed for `heads` f32s; the memory is the caller's promise.
    Ok(Some(unsafe {
        slice_ref::<f32>(opts.sinks as usize, heads)
    }))
}

/// Refuses attention sinks on an entry that runs none (the CUDA entries for now): set
/// `sinks` is `FA_ERR_UNSUPPORTED`, set `d_sinks` (a backward output) invalid.
pub(crate) fn refuse_sinks(opts: &FaOptions, entry: &str) -> Result<(), Failure> {
    if !opts.d_sinks.is_null() {
        return Err(Failure::invalid(format!(
            "options.d_sinks is set but {entry} writes no sink gradient (fa_backward_cpu does)"
        )));
    }
    if !opts.sinks.is_null() {
        return Err(Failure::unsupported(format!(
            "options.sinks is set but {entry} runs no attention sinks yet (the CPU entries do)"
        )));
    }
    Ok(())
}

/// A size field: negative values are errors (and anything past `usize`).
pub(crate) fn size(value: i64, what: &str) -> Result<usize, Failure> {
    usize::try_from(value).map_err(|_| Failure::invalid(format!("{what} is {value}: negative")))
}

/// The dtype of a tensor.
pub(crate) fn dtype(t: &FaTensor, name: &str) -> Result<DType, Failure> {
    match t.dtype {
        FA_DTYPE_F32 => Ok(DType::F32),
        FA_DTYPE_BF16 => Ok(DType::Bf16),
        FA_DTYPE_F16 => Ok(DType::F16),
        other => Err(Failure::invalid(format!(
            "{name}.dtype is {other}: not an FA_DTYPE_* value"
        ))),
    }
}

/// A tensor's strides as sizes (negative ones refused).
pub(crate) fn strides(t: &FaTensor, name: &str) -> Result<Strides, Failure> {
    Ok(Strides {
        batch: size(t.stride_batch, &format!("{name}.stride_batch"))?,
        seq: size(t.stride_seq, &format!("{name}.stride_seq"))?,
        head: size(t.stride_head, &format!("{name}.stride_head"))?,
    })
}

/// Where the prefix sums of a problem live, as read from the descriptor.
pub(crate) enum Seqlens {
    /// `FA_SEQLENS_FIXED`.
    Fixed,
    /// Host prefix sums, copied out of the caller's arrays.
    Host { q: Vec<u32>, k: Vec<u32> },
    /// Device prefix sums: addresses only (never read on the host).
    Device { q: u64, k: u64, entries: usize },
}

/// Reads `entries` int32 values at `ptr` (host memory) into `u32`s, refusing null,
/// misaligned and negative values.
///
/// # Safety
/// A non-null, aligned `ptr` must point to `entries` readable `i32`s.
pub(crate) unsafe fn read_prefix_sums(
    ptr: *const i32,
    entries: usize,
    name: &str,
) -> Result<Vec<u32>, Failure> {
    // SAFETY: forwarded.
    let values = unsafe { read_host_i32s(ptr, entries, name) }?;
    values
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            u32::try_from(x).map_err(|_| Failure::invalid(format!("{name}[{i}] is {x}: negative")))
        })
        .collect()
}

/// Copies `entries` int32 values at `ptr` (host memory), refusing null (unless empty),
/// misaligned and overflowing arrays.
///
/// # Safety
/// A non-null, aligned `ptr` must point to `entries` readable `i32`s.
pub(crate) unsafe fn read_host_i32s(
    ptr: *const i32,
    entries: usize,
    name: &str,
) -> Result<Vec<i32>, Failure> {
    host_span(name, ptr as usize, entries, 4)?;
    let mut out = Vec::new();
    out.try_reserve_exact(entries)
        .map_err(|_| Failure::invalid(format!("{name}: {entries} entries do not fit in memory")))?;
    // SAFETY: non-null, aligned and not wrapping (host_span), `entries` readable (contract).
    out.extend_from_slice(unsafe { slice_ref::<i32>(ptr as usize, entries) });
    Ok(out)
}

/// The geometry of a KV cache as the caller stated it: `Some((blocks_per_seq, block_size,
/// num_blocks))` for a paged cache (block table set), `None` for a padded one, whose paged
/// fields must be 0 and whose block walk null. Refuses a cache on anything but a
/// fixed-length batch.
pub(crate) fn cache_geometry(
    p: &FaProblem,
    cache: &FaKvCache,
) -> Result<Option<(usize, usize, usize)>, Failure> {
    if p.seqlens != FA_SEQLENS_FIXED {
        return Err(Failure::invalid(format!(
            "problem.seqlens is {}: a KV cache takes a fixed-length batch (FA_SEQLENS_FIXED) of \
             seqlen_q new queries per sequence",
            p.seqlens
        )));
    }
    if cache.block_table.is_null() {
        for (value, name) in [
            (cache.blocks_per_seq, "blocks_per_seq"),
            (cache.block_size, "block_size"),
            (cache.num_blocks, "num_blocks"),
        ] {
            if value != 0 {
                return Err(Failure::invalid(format!(
                    "cache.{name} is {value} but cache.block_table is null (a padded cache): \
                     set the block table for a paged cache, or 0 here"
                )));
            }
        }
        if !cache.block_walk.is_null() {
            return Err(Failure::invalid(
                "cache.block_walk is set but cache.block_table is null (a padded cache has no \
                 blocks to walk): pass a null walk",
            ));
        }
        return Ok(None);
    }
    let block_size = size(cache.block_size, "cache.block_size")?;
    if block_size == 0 {
        return Err(Failure::invalid(
            "cache.block_size is 0: a paged cache has at least one key per block",
        ));
    }
    Ok(Some((
        size(cache.blocks_per_seq, "cache.blocks_per_seq")?,
        block_size,
        size(cache.num_blocks, "cache.num_blocks")?,
    )))
}

/// A KV cache's host tables, copied out of the caller's arrays (`fa_forward_cache_cpu`).
pub(crate) struct HostCache {
    /// Keys used per sequence.
    pub seqused_k: Vec<u32>,
    /// The block table and `(blocks_per_seq, block_size, num_blocks)` of a paged cache.
    pub paged: Option<(Vec<i32>, usize, usize, usize)>,
}

impl HostCache {
    /// Reads the cache's host tables: `batch` lengths (negative ones refused) and, for a
    /// paged cache, `batch · blocks_per_seq` block indices (checked by `validate`).
    ///
    /// # Safety
    /// Non-null, aligned `cache.seqused_k` and `cache.block_table` must point to that many
    /// readable `int32_t`s.
    pub unsafe fn read(p: &FaProblem, cache: &FaKvCache) -> Result<HostCache, Failure> {
        let geometry = cache_geometry(p, cache)?;
        let batch = size(p.batch, "problem.batch")?;
        if cache.seqused_k.is_null() {
            return Err(Failure::invalid("cache.seqused_k is a null pointer"));
        }
        // SAFETY: forwarded from this function's contract.
        let seqused_k = unsafe { read_prefix_sums(cache.seqused_k, batch, "cache.seqused_k") }?;
        let paged = match geometry {
            None => None,
            Some((blocks_per_seq, block_size, num_blocks)) => {
                let entries = batch
                    .checked_mul(blocks_per_seq)
                    .ok_or_else(|| Failure::invalid("batch · cache.blocks_per_seq overflows"))?;
                // SAFETY: forwarded from this function's contract.
                let table =
                    unsafe { read_host_i32s(cache.block_table, entries, "cache.block_table") }?;
                Some((table, blocks_per_seq, block_size, num_blocks))
            }
        };
        Ok(HostCache { seqused_k, paged })
    }

    /// The host side of a cache whose tables live on the device and are never read here
    /// (`fa_forward_cache_cuda`): the problem is described by capacity — every sequence
    /// using all its keys (`seqlen_k` when padded, `blocks_per_seq · block_size` when paged,
    /// 0 without blocks), every table entry block 0 — so the plan covers any device lengths,
    /// and the kernels clamp the device values to these bounds.
    pub fn by_capacity(p: &FaProblem, cache: &FaKvCache) -> Result<HostCache, Failure> {
        let geometry = cache_geometry(p, cache)?;
        let batch = size(p.batch, "problem.batch")?;
        let capacity = match geometry {
            None => size(p.seqlen_k, "problem.seqlen_k")?,
            Some((_, _, 0)) => 0,
            Some((blocks_per_seq, block_size, _)) => blocks_per_seq
                .checked_mul(block_size)
                .ok_or_else(|| Failure::invalid("cache.blocks_per_seq · block_size overflows"))?,
        };
        let capacity = u32::try_from(capacity).map_err(|_| {
            Failure::unsupported(format!(
                "a cache of {capacity} keys per sequence: more than 32-bit lengths address"
            ))
        })?;
        let mut seqused_k = Vec::new();
        seqused_k.try_reserve_exact(batch).map_err(|_| {
            Failure::invalid(format!("problem.batch {batch} does not fit in memory"))
        })?;
        seqused_k.resize(batch, capacity);
        let paged = match geometry {
            None => None,
            Some((blocks_per_seq, block_size, num_blocks)) => {
                let entries = batch
                    .checked_mul(blocks_per_seq)
                    .ok_or_else(|| Failure::invalid("batch · cache.blocks_per_seq overflows"))?;
                let mut table = Vec::new();
                table.try_reserve_exact(entries).map_err(|_| {
                    Failure::invalid(format!(
                        "a block table of {entries} entries does not fit in memory"
                    ))
                })?;
                table.resize(entries, 0);
                Some((table, blocks_per_seq, block_size, num_blocks))
            }
        };
        Ok(HostCache { seqused_k, paged })
    }

    /// The cache these tables describe.
    pub fn kv_cache(&self) -> KvCache<'_> {
        match &self.paged {
            None => KvCache::Padded {
                seqused_k: &self.seqused_k,
            },
            Some((table, blocks_per_seq, block_size, num_blocks)) => KvCache::Paged {
                seqused_k: &self.seqused_k,
                block_table: table,
                blocks_per_seq: *blocks_per_seq,
                block_size: *block_size,
                num_blocks: *num_blocks,
            },
        }
    }

    /// `desc` reading K/V from this cache.
    pub fn apply<'a>(&'a self, mut desc: ProblemDesc<'a>) -> Result<ProblemDesc<'a>, Failure> {
        if let Some((_, _, block_size, _)) = &self.paged {
            check_block_rows(&desc, *block_size)?;
        }
        desc.kv_cache = self.kv_cache();
        Ok(desc)
    }
}

/// Refuses a paged block whose contiguous size (rows × KV heads × head dim) overflows
/// `usize` (as [`check_dense_sizes`] does for dense tensors, before `validate` computes it).
pub(crate) fn check_block_rows(desc: &ProblemDesc, block_size: usize) -> Result<(), Failure> {
    block_size
        .checked_mul(desc.heads_kv)
        .and_then(|x| x.checked_mul(desc.head_dim.max(desc.head_dim_v)))
        .map(|_| ())
        .ok_or_else(|| Failure::from(softmax_core::ProblemError::Overflow))
}

/// Reads the problem's prefix sums: host arrays are copied, device ones (allowed only when
/// `device_ok`) kept as addresses.
///
/// # Safety
/// For `FA_SEQLENS_VARLEN_HOST`, non-null aligned `cu_seqlens_q/k` must each point to
/// `batch + 1` readable `int32_t`s.
pub(crate) unsafe fn read_seqlens(p: &FaProblem, device_ok: bool) -> Result<Seqlens, Failure> {
    let entries = || {
        size(p.batch, "problem.batch")?
            .checked_add(1)
            .ok_or_else(|| Failure::invalid("problem.batch overflows"))
    };
    match p.seqlens {
        FA_SEQLENS_FIXED => Ok(Seqlens::Fixed),
        FA_SEQLENS_VARLEN_HOST => {
            let n = entries()?;
            // SAFETY: forwarded from this function's contract.
            let q = unsafe { read_prefix_sums(p.cu_seqlens_q, n, "problem.cu_seqlens_q") }?;
            // SAFETY: as above.
            let k = unsafe { read_prefix_sums(p.cu_seqlens_k, n, "problem.cu_seqlens_k") }?;
            Ok(Seqlens::Host { q, k })
        }
        FA_SEQLENS_VARLEN_DEVICE if device_ok => Ok(Seqlens::Device {
            q: p.cu_seqlens_q as usize as u64,
            k: p.cu_seqlens_k as usize as u64,
            entries: entries()?,
        }),
        FA_SEQLENS_VARLEN_DEVICE => Err(Failure::unsupported(
            "FA_SEQLENS_VARLEN_DEVICE needs fa_forward_cuda: the CPU reads prefix sums from host memory",
        )),
        other => Err(Failure::invalid(format!(
            "problem.seqlens is {other}: not an FA_SEQLENS_* value"
        ))),
    }
}

/// The problem description of a call (not yet validated): shapes, sequences, mask, scale,
/// softcap, and the strides of Q, K, V, O.
pub(crate) fn describe<'a>(
    p: &FaProblem,
    seqlens: &'a Seqlens,
    tensors: [&FaTensor; 4],
) -> Result<ProblemDesc<'a>, Failure> {
    let head_dim = size(p.head_dim, "problem.head_dim")?;
    let mut desc = ProblemDesc::new(
        1,
        0,
        0,
        size(p.heads_q, "problem.heads_q")?,
        size(p.heads_kv, "problem.heads_kv")?,
        head_dim,
    );
    desc.sequences = match seqlens {
        Seqlens::Fixed => Sequences::Fixed {
            batch: size(p.batch, "problem.batch")?,
            seqlen_q: size(p.seqlen_q, "problem.seqlen_q")?,
            seqlen_k: size(p.seqlen_k, "problem.seqlen_k")?,
        },
        Seqlens::Host { q, k } => Sequences::Varlen {
            cu_seqlens_q: q,
            cu_seqlens_k: k,
        },
        Seqlens::Device { .. } => Sequences::VarlenDevice {
            batch: size(p.batch, "problem.batch")?,
            total_q: size(p.total_q, "problem.total_q")?,
            total_k: size(p.total_k, "problem.total_k")?,
            max_seqlen_q: size(p.max_seqlen_q, "problem.max_seqlen_q")?,
            max_seqlen_k: size(p.max_seqlen_k, "problem.max_seqlen_k")?,
        },
    };
    desc.head_dim_v = match p.head_dim_v {
        0 => head_dim,
        d => size(d, "problem.head_dim_v")?,
    };
    check_dense_sizes(&desc)?;
    // softmax-core's conversions, shared with `fa` and the Python module: a window side is
    // -1 or ≥ 0, softcap 0 is none and a negative or non-finite one is refused.
    desc = desc.with_flash_args(p.causal != 0, p.window_left, p.window_right, p.softcap)?;
    desc.softmax_scale = (p.softmax_scale != 0.0).then_some(p.softmax_scale);
    for (tensor, t, name) in [
        (Tensor::Q, tensors[0], "q"),
        (Tensor::K, tensors[1], "k"),
        (Tensor::V, tensors[2], "v"),
        (Tensor::O, tensors[3], "o"),
    ] {
        desc = desc.strides(tensor, strides(t, name)?);
    }
    Ok(desc)
}

/// Refuses shapes whose contiguous strides overflow `usize` (before `validate` computes
/// them): the facade's [`flash_attention::host::check_sizes`], shared with the Python module.
fn check_dense_sizes(desc: &ProblemDesc) -> Result<(), Failure> {
    Ok(flash_attention::host::check_sizes(desc)?)
}

/// The byte range `len` elements of `elem_size` bytes at `addr` span, checked: the facade's
/// [`flash_attention::host::span`] (`None` when empty; null, misaligned and overflowing
/// ranges refused), shared with the Python module.
pub(crate) fn host_span(
    name: &str,
    addr: usize,
    len: usize,
    elem_size: usize,
) -> Result<Option<Range<usize>>, Failure> {
    Ok(flash_attention::host::span(name, addr, len, elem_size)?)
}

/// Refuses an output whose bytes overlap another buffer of the call: the facade's
/// [`flash_attention::host::check_disjoint`].
pub(crate) fn check_disjoint(spans: &[(&str, Option<Range<usize>>, bool)]) -> Result<(), Failure> {
    Ok(flash_attention::host::check_disjoint(spans)?)
}

pub(crate) use flash_attention::host::{slice_mut, slice_ref};

#[cfg(test)]
mod tests {
    use super::*;

    /// `read_options` on a live, aligned local: every size is checked before reading past it.
    fn read(opts: &FaOptions) -> Result<FaOptions, Failure> {
        // SAFETY: a live, aligned FaOptions of `size_of::<FaOptions>()` bytes.
        unsafe { read_options(opts) }
    }

    #[test]
    fn options_of_older_and_newer_sizes() {
        // SAFETY: null means the defaults; nothing is read.
        let defaults = unsafe { read_options(core::ptr::null()) };
        assert_eq!(defaults, Ok(FaOptions::default()));
        let mut old = FaOptions {
            size: 12,
            threads: 3,
            exp2: 9, // past `size`: not read
            ..FaOptions::default()
        };
        let got = read(&old).expect("older size accepted");
        assert_eq!((got.threads, got.exp2), (3, FA_EXP2_AUTO));
        old.size = 64;
        assert_eq!(read(&old).unwrap_err().code, FA_ERR_VERSION);
        old.size = 4;
        assert_eq!(read(&old).unwrap_err().code, FA_ERR_INVALID_ARGUMENT);
        let newer = FaOptions {
            version: FA_API_VERSION + 1,
            ..FaOptions::default()
        };
        assert_eq!(read(&newer).unwrap_err().code, FA_ERR_VERSION);
    }

    #[test]
    fn caches_of_versions_2_and_3_read_without_a_walk() {
        // The layouts of versions 2 and 3 end where `block_walk` begins (num_splits and the
        // padding after it): a walk past `size` is never read.
        let walk = core::mem::offset_of!(FaKvCache, block_walk);
        assert_eq!(walk, core::mem::size_of::<FaKvCache>() - 8);
        for version in [2, 3] {
            let old = FaKvCache {
                size: walk as u32,
                version,
                num_splits: 5,
                block_walk: core::ptr::dangling(),
                ..FaKvCache::default()
            };
            // SAFETY: a live, aligned FaKvCache of at least `old.size` bytes.
            let got = unsafe { read_versioned(&old) }.expect("an older size is accepted");
            assert_eq!(got.num_splits, 5);
            assert!(got.block_walk.is_null(), "a field past size was read");
            assert_eq!(got.size as usize, core::mem::size_of::<FaKvCache>());
        }
        let current = FaKvCache {
            block_walk: core::ptr::dangling(),
            ..FaKvCache::default()
        };
        // SAFETY: as above.
        let got = unsafe { read_versioned(&current) }.expect("the current layout");
        assert_eq!(got.block_walk, core::ptr::dangling());
    }

    #[test]
    fn spans_refuse_null_misaligned_and_wrapping() {
        assert_eq!(host_span("q", 0, 0, 4), Ok(None));
        assert!(host_span("q", 0, 1, 4).is_err());
        assert!(host_span("q", 0x1002, 1, 4).is_err());
        assert!(host_span("q", usize::MAX - 3, 2, 4).is_err());
        assert!(host_span("q", 0x1000, usize::MAX / 2, 4).is_err());
        assert_eq!(host_span("q", 0x1000, 4, 4), Ok(Some(0x1000..0x1010)));
        let ok = check_disjoint(&[
            ("q", Some(0..16), false),
            ("k", Some(8..24), false),
            ("o", Some(24..40), true),
        ]);
        assert_eq!(ok, Ok(()));
        let bad = check_disjoint(&[("q", Some(0..16), false), ("o", Some(15..40), true)]);
        assert!(bad.unwrap_err().message.contains("q and o overlap"));
    }
}
