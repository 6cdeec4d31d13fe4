//! From C descriptors to a validated problem and checked buffers. Everything a C caller
//! passes is read once here: structs through [`read_struct`], host prefix sums through
//! [`read_prefix_sums`], host tensors through [`slice_ref`]/[`slice_mut`] after
//! [`host_span`] has checked null, alignment and overflow; the lengths come from the
//! validated problem (the caller gives none).

use crate::error::Failure;
use crate::types::*;
use core::ops::Range;
use softmax_core::{DType, Mask, ProblemDesc, Sequences, Strides, Tensor};

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

/// The options a caller passed (null: the defaults): any older, smaller layout is read as
/// far as it goes; a larger size or a newer version is `FA_ERR_VERSION`.
///
/// # Safety
/// A non-null, aligned `ptr` must point to at least `ptr->size` readable bytes (at least
/// the `size` field itself).
pub(crate) unsafe fn read_options(ptr: *const FaOptions) -> Result<FaOptions, Failure> {
    let mut opts = FaOptions::default();
    if ptr.is_null() {
        return Ok(opts);
    }
    if !ptr.is_aligned() {
        return Err(Failure::invalid("options is misaligned"));
    }
    // SAFETY: aligned and non-null; the `size` field is readable (the caller's contract).
    let size = unsafe { core::ptr::addr_of!((*ptr).size).read() } as usize;
    let ours = core::mem::size_of::<FaOptions>();
    let version_end = core::mem::offset_of!(FaOptions, version) + 4;
    if size < version_end {
        return Err(Failure::invalid(format!(
            "options.size is {size}: too small for size and version (set it to sizeof(FaOptions))"
        )));
    }
    if size > ours {
        return Err(Failure {
            code: FA_ERR_VERSION,
            message: format!(
                "options.size is {size} bytes but this library (API version {FA_API_VERSION}) \
                 knows {ours}: a newer header than the library"
            ),
        });
    }
    // SAFETY: `size` bytes are readable (the caller's contract) and fit in `opts` (checked);
    // every field is a plain integer, so any bytes are a valid value.
    unsafe {
        core::ptr::copy_nonoverlapping(
            ptr.cast::<u8>(),
            (&mut opts as *mut FaOptions).cast::<u8>(),
            size,
        );
    }
    if opts.version == 0 || opts.version > FA_API_VERSION {
        return Err(Failure {
            code: FA_ERR_VERSION,
            message: format!(
                "options.version is {} but this library implements API version {FA_API_VERSION}",
                opts.version
            ),
        });
    }
    opts.size = ours as u32;
    Ok(opts)
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

fn strides(t: &FaTensor, name: &str) -> Result<Strides, Failure> {
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

/// Reads `entries` int32 prefix sums at `ptr` (host memory) into `u32`s, refusing null,
/// misaligned and negative values.
///
/// # Safety
/// A non-null, aligned `ptr` must point to `entries` readable `i32`s.
unsafe fn read_prefix_sums(
    ptr: *const i32,
    entries: usize,
    name: &str,
) -> Result<Vec<u32>, Failure> {
    host_span(name, ptr as usize, entries, 4)?;
    let mut out = Vec::new();
    out.try_reserve_exact(entries)
        .map_err(|_| Failure::invalid(format!("{name}: {entries} entries do not fit in memory")))?;
    // SAFETY: non-null, aligned and not wrapping (host_span), `entries` readable (contract).
    let values = unsafe { slice_ref::<i32>(ptr as usize, entries) };
    for (i, &x) in values.iter().enumerate() {
        out.push(
            u32::try_from(x)
                .map_err(|_| Failure::invalid(format!("{name}[{i}] is {x}: negative")))?,
        );
    }
    Ok(out)
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
    desc.mask = Mask::from_flash_args(p.causal != 0, p.window_left, p.window_right);
    desc.softmax_scale = (p.softmax_scale != 0.0).then_some(p.softmax_scale);
    desc.softcap = (p.softcap != 0.0).then_some(p.softcap);
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

/// Refuses shapes whose contiguous strides (tokens × heads × head dim) overflow `usize`.
/// `ProblemDesc::validate` computes them even when explicit strides are given, with plain
/// multiplication (a panic in debug builds), so the boundary checks them first.
fn check_dense_sizes(desc: &ProblemDesc) -> Result<(), Failure> {
    let (seq_q, seq_k) = match desc.sequences {
        Sequences::Fixed {
            seqlen_q, seqlen_k, ..
        } => (seqlen_q, seqlen_k),
        Sequences::Varlen {
            cu_seqlens_q,
            cu_seqlens_k,
        } => {
            let last = |cu: &[u32]| cu.iter().copied().max().unwrap_or(0) as usize;
            (last(cu_seqlens_q), last(cu_seqlens_k))
        }
        Sequences::VarlenDevice {
            total_q, total_k, ..
        } => (total_q, total_k),
    };
    let dim = desc.head_dim.max(desc.head_dim_v);
    for (seq, heads) in [(seq_q, desc.heads_q), (seq_k, desc.heads_kv)] {
        seq.checked_mul(heads)
            .and_then(|x| x.checked_mul(dim))
            .ok_or_else(|| Failure::from(softmax_core::ProblemError::Overflow))?;
    }
    Ok(())
}

/// The byte range `len` elements of `elem_size` bytes at `addr` span, checked: `None` when
/// empty (any address, null included); an error for null, misaligned (to the element size),
/// or a range past `isize::MAX` bytes or the end of the address space.
pub(crate) fn host_span(
    name: &str,
    addr: usize,
    len: usize,
    elem_size: usize,
) -> Result<Option<Range<usize>>, Failure> {
    if len == 0 {
        return Ok(None);
    }
    if addr == 0 {
        return Err(Failure::invalid(format!("{name} is a null pointer")));
    }
    if !addr.is_multiple_of(elem_size) {
        return Err(Failure::invalid(format!(
            "{name} is misaligned: {addr:#x} is not a multiple of {elem_size}"
        )));
    }
    let end = len
        .checked_mul(elem_size)
        .filter(|&bytes| bytes <= isize::MAX as usize)
        .and_then(|bytes| addr.checked_add(bytes))
        .ok_or_else(|| {
            Failure::invalid(format!("{name}: {len} elements overflow the address space"))
        })?;
    Ok(Some(addr..end))
}

/// Refuses an output whose bytes overlap another buffer of the call (a shared and a mutable
/// view of the same memory).
pub(crate) fn check_disjoint(spans: &[(&str, Option<Range<usize>>, bool)]) -> Result<(), Failure> {
    for (i, (a, ra, a_out)) in spans.iter().enumerate() {
        for (b, rb, b_out) in &spans[i + 1..] {
            if let (Some(ra), Some(rb)) = (ra, rb) {
                if (*a_out || *b_out) && ra.start < rb.end && rb.start < ra.end {
                    return Err(Failure::invalid(format!("{a} and {b} overlap")));
                }
            }
        }
    }
    Ok(())
}

/// A shared slice of `len` elements at `addr` (empty when `len` is 0).
///
/// # Safety
/// Unless `len` is 0, `addr` must have passed [`host_span`] for `T` and point to `len`
/// initialised `T`s that nothing writes while the slice lives.
pub(crate) unsafe fn slice_ref<'a, T>(addr: usize, len: usize) -> &'a [T] {
    if len == 0 {
        return &[];
    }
    // SAFETY: non-null, aligned, within isize::MAX bytes (host_span); readable (contract).
    unsafe { core::slice::from_raw_parts(addr as *const T, len) }
}

/// A mutable slice of `len` elements at `addr` (empty when `len` is 0).
///
/// # Safety
/// As [`slice_ref`], and the memory must be writable and not overlap any other slice alive
/// at the same time ([`check_disjoint`]).
pub(crate) unsafe fn slice_mut<'a, T>(addr: usize, len: usize) -> &'a mut [T] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: non-null, aligned, within isize::MAX bytes (host_span); writable and not
    // aliased (contract).
    unsafe { core::slice::from_raw_parts_mut(addr as *mut T, len) }
}

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
        assert_eq!((got.threads, got.exp2), (3, FA_EXP2_EXACT));
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
