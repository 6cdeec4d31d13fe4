//! Caller-owned device memory: raw device addresses with lengths ([`RawTensor`]), and the
//! checks that run on the host before a call on them queues anything (null, alignment,
//! lengths against the problem, address overflow).

use crate::error::CudaError;
use core::marker::PhantomData;
use softmax_core::{Extent, KvCache, Out, Problem, ProblemError, Tensor};

/// A tensor in device memory that the caller owns: a device address and a length in elements
/// of `T`. It does not own, free or track the memory; [`crate::Device::forward_on_stream`]
/// checks it against the problem before it queues anything.
pub struct RawTensor<T> {
    ptr: u64,
    len: usize,
    _element: PhantomData<fn() -> T>,
}

// Manual impls: a raw tensor is an address and a length whatever `T` is.
impl<T> Clone for RawTensor<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for RawTensor<T> {}
impl<T> PartialEq for RawTensor<T> {
    fn eq(&self, other: &Self) -> bool {
        (self.ptr, self.len) == (other.ptr, other.len)
    }
}
impl<T> Eq for RawTensor<T> {}
impl<T> core::fmt::Debug for RawTensor<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "RawTensor({:#x}, {} elements)", self.ptr, self.len)
    }
}

impl<T> RawTensor<T> {
    /// Wraps `len` elements of `T` at device address `ptr` (a `CUdeviceptr`, e.g. PyTorch's
    /// `tensor.data_ptr()`).
    ///
    /// # Safety
    /// Unless `len` is 0, `ptr..ptr + len·size_of::<T>()` must be device memory usable from
    /// the [`crate::Device`]'s context (allocated in it, or mapped into it), holding values
    /// of `T`, and must stay allocated, and not be written by other work (for inputs) or
    /// touched at all by other work (for outputs), until the stream the call is queued on has
    /// passed the kernel. Prefix sums (`RawTensor<i32>` in [`CuSeqlens`]) must moreover be
    /// valid: `batch + 1` non-decreasing values from 0 to `total_q`/`total_k`, no sequence
    /// longer than `max_seqlen_q`/`max_seqlen_k` (the kernel clamps bad values to the packed
    /// tensors, so they cannot make it read or write outside them, but the results of such
    /// sequences are meaningless and query rows past `max_seqlen_q` are not written).
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Self {
        RawTensor {
            ptr,
            len,
            _element: PhantomData,
        }
    }
    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Elements of `T`.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T> Extent for RawTensor<T> {
    fn elems(&self) -> usize {
        self.len
    }
}

/// Device-resident varlen prefix sums (int32, `batch + 1` entries each, PyTorch's
/// `cu_seqlens_q`/`cu_seqlens_k`), for a problem described by
/// [`softmax_core::Sequences::VarlenDevice`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CuSeqlens {
    /// Query prefix sums.
    pub q: RawTensor<i32>,
    /// Key prefix sums.
    pub k: RawTensor<i32>,
}

/// Device-resident KV-cache tables (int32, PyTorch's `cache_seqlens` and `block_table`) for
/// [`crate::Device::forward_cache_on_stream`] and [`crate::Device::append_kv_on_stream`]: the
/// problem's host copies (validated by `softmax-core`) describe them, the kernels read these.
/// Their values must equal the host copies ([`RawTensor::from_raw`]'s contract); the kernels
/// clamp lengths to the cache's capacity and block indices to its blocks, so wrong values
/// give wrong results but no access outside the tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheTables {
    /// Keys used per sequence, `batch` entries.
    pub seqused_k: RawTensor<i32>,
    /// Row-major `[batch, blocks_per_seq]` block indices: required for a paged cache, absent
    /// for a padded one.
    pub block_table: Option<RawTensor<i32>>,
    /// A paged cache's block walk, `[batch, 2, blocks_per_seq]` as
    /// [`crate::kernels::decode::block_walk`] builds it from the same host tables (once per
    /// decode step, for every layer's call): the decode kernel then reads each sequence's
    /// blocks in address order where its plan allows ([`crate::DecodePlan::block_walk`]), and
    /// in table order without it. Optional; only with a paged cache; the append ignores it.
    pub block_walk: Option<RawTensor<i32>>,
}

/// Checks device cache tables against the problem's cache (lengths, null, 4-byte alignment,
/// a table and optionally a walk exactly when the cache is paged); returns their addresses
/// (seqused_k, table, walk; 0: none).
pub(crate) fn check_cache_tables(
    problem: &Problem,
    tables: &CacheTables,
) -> Result<(u64, u64, u64), CudaError> {
    let blocks_per_seq = match problem.kv_cache() {
        KvCache::None => {
            return Err(ProblemError::Unsupported {
                what: "device cache tables go with a KV-cache problem",
            }
            .into())
        }
        KvCache::Padded { .. } => None,
        KvCache::Paged { blocks_per_seq, .. } => Some(blocks_per_seq),
    };
    check_table_lens(problem.batch(), blocks_per_seq, tables)
}

/// [`check_cache_tables`] from the cache's counts: `batch` sequences, and `Some(blocks per
/// sequence)` for a paged cache (`None`: padded).
pub(crate) fn check_table_lens(
    batch: usize,
    blocks_per_seq: Option<usize>,
    tables: &CacheTables,
) -> Result<(u64, u64, u64), CudaError> {
    let needed_used = batch;
    let needed_table = match blocks_per_seq {
        None => None,
        Some(blocks_per_seq) => Some(
            batch
                .checked_mul(blocks_per_seq)
                .ok_or(ProblemError::Overflow)?,
        ),
    };
    let mut checked = vec![(Tensor::SequsedK, &tables.seqused_k, needed_used)];
    match (needed_table, &tables.block_walk) {
        (Some(needed), Some(w)) => checked.push((
            Tensor::BlockWalk,
            w,
            needed.checked_mul(2).ok_or(ProblemError::Overflow)?,
        )),
        (_, None) => {}
        (None, Some(_)) => {
            return Err(ProblemError::Unsupported {
                what: "a padded cache takes no block walk",
            }
            .into())
        }
    }
    match (needed_table, &tables.block_table) {
        (Some(needed), Some(t)) => checked.push((Tensor::BlockTable, t, needed)),
        (None, None) => {}
        (Some(_), None) => {
            return Err(ProblemError::Unsupported {
                what: "a paged cache needs its block table on the device",
            }
            .into())
        }
        (None, Some(_)) => {
            return Err(ProblemError::Unsupported {
                what: "a padded cache takes no block table",
            }
            .into())
        }
    }
    for (tensor, t, needed) in checked {
        check_len(tensor, t, needed)?;
        // An empty table (no block per sequence) is never read.
        check_ptr(tensor, t, 4)?;
    }
    Ok((
        tables.seqused_k.ptr,
        tables.block_table.map_or(0, |t| t.ptr),
        tables.block_walk.map_or(0, |t| t.ptr),
    ))
}

/// The output bundle of a call on caller memory: O and, optionally, the f32 LSE.
pub type RawOut<T> = Out<RawTensor<T>, RawTensor<f32>>;

/// Rejects a tensor shorter than `needed` elements ([`ProblemError::BufferTooSmall`]).
pub(crate) fn check_len<T>(
    tensor: Tensor,
    t: &RawTensor<T>,
    needed: usize,
) -> Result<(), CudaError> {
    if t.len < needed {
        return Err(ProblemError::BufferTooSmall {
            tensor,
            needed,
            len: t.len,
        }
        .into());
    }
    Ok(())
}

/// Checks device prefix sums for `batch` sequences (`batch + 1` int32 entries each, 4-byte
/// aligned); returns their addresses (query, key).
pub(crate) fn check_cu_seqlens(batch: usize, cu: &CuSeqlens) -> Result<(u64, u64), CudaError> {
    for (tensor, x) in [(Tensor::CuSeqlensQ, &cu.q), (Tensor::CuSeqlensK, &cu.k)] {
        check_len(tensor, x, batch + 1)?;
        check_ptr(tensor, x, 4)?;
    }
    Ok((cu.q.ptr, cu.k.ptr))
}

/// Rejects a null address (unless the tensor is empty), a misaligned one, and a range that
/// wraps the address space.
pub(crate) fn check_ptr<T>(tensor: Tensor, t: &RawTensor<T>, align: u64) -> Result<(), CudaError> {
    if t.len == 0 {
        return Ok(());
    }
    if t.ptr == 0 {
        return Err(CudaError::NullPointer { tensor });
    }
    if t.ptr % align != 0 {
        return Err(CudaError::Misaligned {
            tensor,
            ptr: t.ptr,
            align,
        });
    }
    (t.len as u64)
        .checked_mul(core::mem::size_of::<T>() as u64)
        .and_then(|bytes| t.ptr.checked_add(bytes))
        .ok_or(ProblemError::Overflow)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::DeviceProps;
    use crate::params::{ForwardOptions, Params};
    use crate::plan::{check_run, plan_forward, ForwardTensors, Source};
    use half::bf16;
    use softmax_core::{DType, ProblemDesc, Qkv, Sequences};

    /// A raw tensor at a made-up address: these checks never dereference it.
    fn at<T>(ptr: u64, len: usize) -> RawTensor<T> {
        // SAFETY: only the host-side checks see it; nothing is launched.
        unsafe { RawTensor::from_raw(ptr, len) }
    }

    /// Q, K, V, O, LSE of exactly the needed lengths, 256-byte aligned and far apart.
    fn call_for(problem: &Problem) -> ForwardTensors<bf16> {
        let lens = problem.min_buffer_lens();
        ForwardTensors {
            qkv: Qkv::new(
                at(0x10_0000, lens.q),
                at(0x20_0000, lens.k),
                at(0x30_0000, lens.v),
            ),
            out: Out::with_lse(at(0x40_0000, lens.o), at(0x50_0000, problem.lse_len())),
            cu_seqlens: None,
            tables: None,
        }
    }

    /// The plan of `problem`, then the run's check of `call` against it.
    fn check(problem: &Problem, call: &ForwardTensors<bf16>) -> Result<Params, CudaError> {
        let props = DeviceProps::h200();
        let plan = plan_forward(problem, DType::Bf16, &ForwardOptions::default(), &props)?;
        // SAFETY: an empty workspace; never dereferenced.
        let ws = Source::Caller(unsafe { RawTensor::from_raw(0, 0) });
        check_run(&plan, call, &ws, &props)
    }

    #[test]
    fn good_pointers_pass_through() {
        let problem = ProblemDesc::new(2, 33, 40, 4, 2, 64).validate(256).unwrap();
        let ptrs = check(&problem, &call_for(&problem)).expect("valid");
        assert_eq!(
            (ptrs.q, ptrs.o, ptrs.lse, ptrs.cu_q),
            (0x10_0000, 0x40_0000, 0x50_0000, 0)
        );
    }

    #[test]
    fn null_misaligned_short_and_wrapping_pointers_get_typed_errors() {
        let problem = ProblemDesc::new(2, 33, 40, 4, 2, 64).validate(256).unwrap();
        let mut call = call_for(&problem);
        call.qkv.k = at(0, call.qkv.k.len());
        assert_eq!(
            check(&problem, &call),
            Err(CudaError::NullPointer { tensor: Tensor::K })
        );
        let mut call = call_for(&problem);
        call.out.o = at(0x40_0008, call.out.o.len());
        assert_eq!(
            check(&problem, &call),
            Err(CudaError::Misaligned {
                tensor: Tensor::O,
                ptr: 0x40_0008,
                align: 16
            })
        );
        let mut call = call_for(&problem);
        call.out.lse = Some(at(0x50_0002, problem.lse_len()));
        assert!(matches!(
            check(&problem, &call),
            Err(CudaError::Misaligned {
                tensor: Tensor::Lse,
                align: 4,
                ..
            })
        ));
        let mut call = call_for(&problem);
        call.qkv.v = at(0x30_0000, call.qkv.v.len() - 1);
        assert!(matches!(
            check(&problem, &call),
            Err(CudaError::Problem(ProblemError::BufferTooSmall {
                tensor: Tensor::V,
                ..
            }))
        ));
        let mut call = call_for(&problem);
        call.qkv.q = at(u64::MAX - 15, call.qkv.q.len());
        assert_eq!(
            check(&problem, &call),
            Err(CudaError::Problem(ProblemError::Overflow))
        );
        // An empty tensor may be null (PyTorch's empty tensors): nothing reads it.
        let empty = ProblemDesc::new(1, 0, 5, 2, 2, 64).validate(256).unwrap();
        let mut call = call_for(&empty);
        call.qkv.q = at(0, 0);
        call.out = Out::new(at(0, 0));
        assert!(check(&empty, &call).is_ok());
    }

    #[test]
    fn device_prefix_sums_are_checked_and_required() {
        let sizes = Sequences::VarlenDevice {
            batch: 3,
            total_q: 40,
            total_k: 50,
            max_seqlen_q: 20,
            max_seqlen_k: 30,
        };
        let problem = ProblemDesc::new(1, 0, 0, 4, 2, 64)
            .with_sequences(sizes)
            .validate(256)
            .unwrap();
        let mut call = call_for(&problem);
        assert!(matches!(
            check(&problem, &call),
            Err(CudaError::Problem(ProblemError::Unsupported { .. }))
        ));
        call.cu_seqlens = Some(CuSeqlens {
            q: at(0x60_0000, 4),
            k: at(0x60_0100, 3),
        });
        assert_eq!(
            check(&problem, &call),
            Err(CudaError::Problem(ProblemError::BufferTooSmall {
                tensor: Tensor::CuSeqlensK,
                needed: 4,
                len: 3
            }))
        );
        call.cu_seqlens = Some(CuSeqlens {
            q: at(0x60_0002, 4),
            k: at(0x60_0100, 4),
        });
        assert!(matches!(
            check(&problem, &call),
            Err(CudaError::Misaligned {
                tensor: Tensor::CuSeqlensQ,
                ..
            })
        ));
        call.cu_seqlens = Some(CuSeqlens {
            q: at(0, 4),
            k: at(0x60_0100, 4),
        });
        assert_eq!(
            check(&problem, &call),
            Err(CudaError::NullPointer {
                tensor: Tensor::CuSeqlensQ
            })
        );
        call.cu_seqlens = Some(CuSeqlens {
            q: at(0x60_0000, 4),
            k: at(0x60_0100, 4),
        });
        let ptrs = check(&problem, &call).expect("valid");
        assert_eq!((ptrs.cu_q, ptrs.cu_k), (0x60_0000, 0x60_0100));
        // Device prefix sums with a problem that does not take them.
        let dense = ProblemDesc::new(2, 33, 40, 4, 2, 64).validate(256).unwrap();
        let mut call = call_for(&dense);
        call.cu_seqlens = Some(CuSeqlens {
            q: at(0x60_0000, 4),
            k: at(0x60_0100, 4),
        });
        assert!(matches!(
            check(&dense, &call),
            Err(CudaError::Problem(ProblemError::Unsupported { .. }))
        ));
    }

    #[test]
    fn device_cache_tables_are_checked() {
        let used = [5u32, 9];
        let table = [0i32, 1, 2, 3, 4, 5];
        let padded = ProblemDesc::new(2, 1, 16, 4, 2, 64)
            .padded_cache(&used)
            .validate(256)
            .unwrap();
        let paged = ProblemDesc::new(2, 1, 0, 4, 2, 64)
            .paged_cache(&used, &table, 3, 4, 6)
            .validate(256)
            .unwrap();
        let tables = |used: RawTensor<i32>, table: Option<RawTensor<i32>>| CacheTables {
            seqused_k: used,
            block_table: table,
            block_walk: None,
        };
        let good_used = at(0x70_0000, 2);
        let good_table = at(0x71_0000, 6);
        assert_eq!(
            check_cache_tables(&padded, &tables(good_used, None)),
            Ok((0x70_0000, 0, 0))
        );
        assert_eq!(
            check_cache_tables(&paged, &tables(good_used, Some(good_table))),
            Ok((0x70_0000, 0x71_0000, 0))
        );
        // A block walk: [batch, 2, blocks_per_seq] with a paged cache only.
        let walked = |walk: RawTensor<i32>| CacheTables {
            block_walk: Some(walk),
            ..tables(good_used, Some(good_table))
        };
        assert_eq!(
            check_cache_tables(&paged, &walked(at(0x72_0000, 12))),
            Ok((0x70_0000, 0x71_0000, 0x72_0000))
        );
        assert_eq!(
            check_cache_tables(&paged, &walked(at(0x72_0000, 11))),
            Err(CudaError::Problem(ProblemError::BufferTooSmall {
                tensor: Tensor::BlockWalk,
                needed: 12,
                len: 11
            }))
        );
        assert!(check_cache_tables(
            &padded,
            &CacheTables {
                block_walk: Some(at(0x72_0000, 12)),
                ..tables(good_used, None)
            }
        )
        .is_err());
        // A padded cache takes no table, a paged one needs it.
        assert!(check_cache_tables(&padded, &tables(good_used, Some(good_table))).is_err());
        assert!(check_cache_tables(&paged, &tables(good_used, None)).is_err());
        // Short, null, misaligned.
        assert_eq!(
            check_cache_tables(&paged, &tables(at(0x70_0000, 1), Some(good_table))),
            Err(CudaError::Problem(ProblemError::BufferTooSmall {
                tensor: Tensor::SequsedK,
                needed: 2,
                len: 1
            }))
        );
        assert_eq!(
            check_cache_tables(&paged, &tables(good_used, Some(at(0x71_0000, 5)))),
            Err(CudaError::Problem(ProblemError::BufferTooSmall {
                tensor: Tensor::BlockTable,
                needed: 6,
                len: 5
            }))
        );
        assert_eq!(
            check_cache_tables(&padded, &tables(at(0, 2), None)),
            Err(CudaError::NullPointer {
                tensor: Tensor::SequsedK
            })
        );
        assert!(matches!(
            check_cache_tables(&paged, &tables(good_used, Some(at(0x71_0002, 6)))),
            Err(CudaError::Misaligned {
                tensor: Tensor::BlockTable,
                ..
            })
        ));
        // Tables without a cache.
        let dense = ProblemDesc::new(2, 1, 16, 4, 2, 64).validate(256).unwrap();
        assert!(check_cache_tables(&dense, &tables(good_used, None)).is_err());
    }
}
