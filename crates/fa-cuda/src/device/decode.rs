//! KV-cache (decode) calls on the device, besides the one launch path they share with the
//! dense forward (`Device::run` in device.rs, from a [`crate::ForwardPlan`]): the copies the
//! owned paths make of a problem's host tables, the caller-memory entry with device tables
//! and workspace ([`Device::forward_cache_on_stream`]) and its workspace-size companion, and
//! the in-place append of new K/V tokens.

use super::{launch, raw_view, CudaElement, Device, DeviceBuffer, ForwardStats};
use crate::error::CudaError;
use crate::kernels::decode::{block_walk, cache_params, cache_shape, AppendVariant};
use crate::params::{supports, ForwardOptions, Params};
use crate::plan::{set_workspace, ForwardPlan, ForwardTensors, ROW_ALIGN};
use crate::raw::{check_cache_tables, check_len, check_ptr, CacheTables, RawOut, RawTensor};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, SyncOnDrop};
use softmax_core::{DType, KvCache, Problem, ProblemError, Qkv, Sequences, Tensor};
use std::sync::Arc;

/// The problem's host cache tables as the kernels read them (int32): `seqused_k`, and the
/// used part of the block table of a paged cache (empty for a padded one).
fn host_tables(problem: &Problem) -> (Vec<i32>, Vec<i32>) {
    match problem.kv_cache() {
        KvCache::None => (Vec::new(), Vec::new()),
        // Validated: every length is at most the capacity, which `supports` keeps below 2^30.
        KvCache::Padded { seqused_k } => (seqused_k.iter().map(|&x| x as i32).collect(), vec![]),
        KvCache::Paged {
            seqused_k,
            block_table,
            blocks_per_seq,
            ..
        } => (
            seqused_k.iter().map(|&x| x as i32).collect(),
            block_table[..problem.batch() * blocks_per_seq].to_vec(),
        ),
    }
}

/// Copies a host-varlen problem's prefix sums to the device on `stream` (`None`: the problem
/// has none on the host).
#[allow(clippy::type_complexity)]
pub(super) fn upload_cu_seqlens(
    problem: &Problem,
    stream: &Arc<CudaStream>,
) -> Result<Option<(CudaSlice<u32>, CudaSlice<u32>)>, CudaError> {
    let Sequences::Varlen {
        cu_seqlens_q,
        cu_seqlens_k,
    } = problem.sequences()
    else {
        return Ok(None);
    };
    let up = |x: &[u32]| {
        stream
            .clone_htod(x)
            .map_err(|e| CudaError::driver("cuMemcpyHtoD", e))
    };
    Ok(Some((up(cu_seqlens_q)?, up(cu_seqlens_k)?)))
}

/// What an owned run copies and allocates on its stream (freed in stream order, after the
/// kernels): a packed problem's host prefix sums, a KV-cache problem's host tables (and the
/// block walk where the plan reads by one), the plan's workspace.
pub(super) struct OwnedInputs {
    cu_seqlens: Option<(CudaSlice<u32>, CudaSlice<u32>)>,
    seqused_k: Option<CudaSlice<i32>>,
    block_table: Option<CudaSlice<i32>>,
    block_walk: Option<CudaSlice<i32>>,
    workspace: Option<CudaSlice<f32>>,
}

impl OwnedInputs {
    /// Copies and allocates what `plan`'s run on `problem` needs on `stream`.
    pub(super) fn upload(
        problem: &Problem,
        plan: &ForwardPlan,
        stream: &Arc<CudaStream>,
    ) -> Result<OwnedInputs, CudaError> {
        let up = |x: &[i32]| {
            stream
                .clone_htod(x)
                .map_err(|e| CudaError::driver("cuMemcpyHtoD", e))
        };
        let cu_seqlens = upload_cu_seqlens(problem, stream)?;
        let (mut seqused_k, mut block_table, mut walk) = (None, None, None);
        if problem.has_kv_cache() {
            let (used, table) = host_tables(problem);
            seqused_k = Some(up(&used)?);
            if !table.is_empty() {
                block_table = Some(up(&table)?);
            }
            if plan.decode().is_some_and(|d| d.block_walk) {
                walk = Some(up(&block_walk(problem)?)?);
            }
        }
        let workspace = match plan.workspace_bytes() {
            0 => None,
            bytes => Some(
                stream
                    .alloc_zeros::<f32>(bytes.div_ceil(4))
                    .map_err(|e| CudaError::driver("cuMemAlloc", e))?,
            ),
        };
        Ok(OwnedInputs {
            cu_seqlens,
            seqused_k,
            block_table,
            block_walk: walk,
            workspace,
        })
    }

    /// Sets the copies' addresses in `params`; the guards record their use on `stream` when
    /// dropped after the launches.
    pub(super) fn fill<'a>(
        &'a self,
        plan: &ForwardPlan,
        params: &mut Params,
        stream: &'a CudaStream,
    ) -> Vec<SyncOnDrop<'a>> {
        let mut guards = Vec::new();
        let mut ptr = |slice: Option<&'a CudaSlice<i32>>| {
            slice.map_or(0, |s| {
                let (p, g) = s.device_ptr(stream);
                guards.push(g);
                p
            })
        };
        params.seqused_k = ptr(self.seqused_k.as_ref());
        params.block_table = ptr(self.block_table.as_ref());
        params.block_walk = ptr(self.block_walk.as_ref());
        if let Some((q, k)) = &self.cu_seqlens {
            let (pq, gq) = q.device_ptr(stream);
            let (pk, gk) = k.device_ptr(stream);
            params.cu_q = pq;
            params.cu_k = pk;
            guards.push(gq);
            guards.push(gk);
        }
        if let Some(ws) = &self.workspace {
            let (p, g) = ws.device_ptr(stream);
            set_workspace(plan, params, p);
            guards.push(g);
        }
        guards
    }
}

impl Device {
    /// Bytes of workspace a KV-cache problem needs on this device for its key splits (0: one
    /// split, or nothing to compute) with these options: the scratch-size companion of
    /// [`Device::forward_cache_on_stream`], [`ForwardPlan::workspace_bytes`] of
    /// [`Device::plan_forward`]'s plan. The plan is deterministic, so the same problem, dtype
    /// and options always need the same size; plan once and keep the plan to run it
    /// ([`Device::run_on_stream`]) instead of planning again per call.
    pub fn decode_workspace_bytes(
        &self,
        problem: &Problem,
        dtype: DType,
        opts: &ForwardOptions,
    ) -> Result<usize, CudaError> {
        if !problem.has_kv_cache() {
            return Err(ProblemError::Unsupported {
                what: "the decode kernels read a KV cache",
            }
            .into());
        }
        Ok(self.plan_forward(problem, dtype, opts)?.workspace_bytes())
    }

    /// Decode attention on caller memory and the caller's stream, with the cache tables and
    /// the split workspace also in caller memory: no host copy, no allocation, no host
    /// synchronisation. `problem` is a KV-cache problem (padded or paged) whose host tables
    /// describe `tables` (see [`CacheTables`]); `workspace` holds at least
    /// [`Device::decode_workspace_bytes`] bytes (16-byte aligned; `None` only when that is 0)
    /// and must not be used by other work until the stream has passed the call. Everything is
    /// checked before anything is queued, as in [`Device::forward_on_stream`]. Plans the call
    /// and runs the plan ([`Device::run_on_stream`], which a caller that keeps the plan uses
    /// directly).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_cache_on_stream<T: CudaElement>(
        &self,
        problem: &Problem,
        tables: CacheTables,
        workspace: Option<RawTensor<f32>>,
        qkv: Qkv<RawTensor<T>>,
        out: RawOut<T>,
        stream: &Arc<CudaStream>,
        opts: &ForwardOptions,
    ) -> Result<ForwardStats, CudaError> {
        if !problem.has_kv_cache() {
            return Err(ProblemError::Unsupported {
                what: "forward_cache_on_stream takes a KV-cache problem",
            }
            .into());
        }
        let plan = self.plan_forward(problem, T::DTYPE, opts)?;
        let tensors = ForwardTensors {
            qkv,
            out,
            cu_seqlens: None,
            tables: Some(tables),
        };
        // SAFETY: the same memory seen as bytes (f32 elements are 4 bytes each; a length that
        // would overflow is clamped and then fails the size check).
        let workspace = unsafe {
            match workspace {
                Some(w) => RawTensor::from_raw(w.ptr(), w.len().saturating_mul(4)),
                None => RawTensor::from_raw(0, 0),
            }
        };
        self.run_on_stream(&plan, tensors, workspace, stream)
    }

    /// Appends `seqlen_new` new tokens per sequence to a KV cache in device buffers, in place,
    /// and waits: token `j` of sequence `b` (`k_new`/`v_new`, dense
    /// `[batch, seqlen_new, heads_kv, head_dim]`) goes to position `seqused_k[b] + j` of the
    /// cache that `problem` describes (its `seqused_k` are the lengths before the append;
    /// advancing them is the caller's). Errors before anything is written: a sequence that
    /// would pass its capacity ([`ProblemError::CacheOverrun`]), a block-table entry out of
    /// range for a new position ([`ProblemError::BlockIndex`]), short buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn append_kv<T: CudaElement>(
        &self,
        problem: &Problem,
        seqlen_new: usize,
        k_new: &DeviceBuffer<T>,
        v_new: &DeviceBuffer<T>,
        k_cache: &mut DeviceBuffer<T>,
        v_cache: &mut DeviceBuffer<T>,
    ) -> Result<(), CudaError> {
        for b in [k_new, v_new, &*k_cache, &*v_cache] {
            self.owns(b)?;
        }
        let stream = &self.stream;
        let (kn, _g1) = raw_view(k_new, stream);
        let (vn, _g2) = raw_view(v_new, stream);
        let (kc, _g3) = raw_view(&*k_cache, stream);
        let (vc, _g4) = raw_view(&*v_cache, stream);
        self.append_raw(problem, seqlen_new, None, [kn, vn, kc, vc], stream)?;
        self.synchronize()
    }

    /// [`Device::append_kv`] on caller memory and the caller's stream, without waiting: the
    /// new tokens `k_new`/`v_new` (dense `[batch, seqlen_new, heads_kv, head_dim]`) are
    /// written into `k_cache`/`v_cache`. `tables`: the cache tables on the device (`None`: the
    /// problem's host tables are copied on `stream`). Checked on the host as
    /// [`Device::append_kv`] is, before anything is queued.
    #[allow(clippy::too_many_arguments)]
    pub fn append_kv_on_stream<T: CudaElement>(
        &self,
        problem: &Problem,
        seqlen_new: usize,
        tables: Option<CacheTables>,
        k_new: RawTensor<T>,
        v_new: RawTensor<T>,
        k_cache: RawTensor<T>,
        v_cache: RawTensor<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<(), CudaError> {
        self.append_raw(
            problem,
            seqlen_new,
            tables,
            [k_new, v_new, k_cache, v_cache],
            stream,
        )
    }

    /// The append path: host checks, then one launch on `stream`.
    fn append_raw<T: CudaElement>(
        &self,
        problem: &Problem,
        seqlen_new: usize,
        tables: Option<CacheTables>,
        [k_new, v_new, k_cache, v_cache]: [RawTensor<T>; 4],
        stream: &Arc<CudaStream>,
    ) -> Result<(), CudaError> {
        if **stream.context() != *self.ctx {
            return Err(CudaError::ForeignStream);
        }
        check_append(problem, seqlen_new, T::DTYPE)?;
        let lens = problem.min_buffer_lens();
        let heads_kv = problem.heads_kv();
        let new_k_len = problem.batch() * seqlen_new * heads_kv * problem.head_dim();
        let new_v_len = problem.batch() * seqlen_new * heads_kv * problem.head_dim_v();
        for (tensor, t, needed) in [
            (Tensor::K, &k_new, new_k_len),
            (Tensor::V, &v_new, new_v_len),
            (Tensor::K, &k_cache, lens.k),
            (Tensor::V, &v_cache, lens.v),
        ] {
            check_len(tensor, t, needed)?;
            check_ptr(tensor, t, ROW_ALIGN)?;
        }
        let device_tables = match &tables {
            // The append writes by the table; a walk is only checked.
            Some(t) => {
                check_cache_tables(problem, t).map(|(used, table, _)| Some((used, table)))?
            }
            None => None,
        };
        if seqlen_new == 0 {
            return Ok(());
        }
        let uploaded = match device_tables {
            Some(_) => None,
            None => {
                let (used, table) = host_tables(problem);
                let up = |x: &[i32]| {
                    stream
                        .clone_htod(x)
                        .map_err(|e| CudaError::driver("cuMemcpyHtoD", e))
                };
                Some((
                    up(&used)?,
                    if table.is_empty() {
                        None
                    } else {
                        Some(up(&table)?)
                    },
                ))
            }
        };
        let used_guard = uploaded.as_ref().map(|u| u.0.device_ptr(stream));
        let table_guard = uploaded
            .as_ref()
            .and_then(|u| u.1.as_ref())
            .map(|t| t.device_ptr(stream));
        let (used_ptr, table_ptr) = device_tables.unwrap_or((
            used_guard.as_ref().map_or(0, |g| g.0),
            table_guard.as_ref().map_or(0, |g| g.0),
        ));
        let dense = |dim: usize| {
            let seq = (heads_kv * dim) as i64;
            [seq * seqlen_new as i64, seq, dim as i64]
        };
        let params = Params {
            k: k_cache.ptr(),
            v: v_cache.ptr(),
            seqused_k: used_ptr,
            block_table: table_ptr,
            seqlen_new: seqlen_new as i32,
            k_new: k_new.ptr(),
            v_new: v_new.ptr(),
            kn_strides: dense(problem.head_dim()),
            vn_strides: dense(problem.head_dim_v()),
            ..cache_params(problem)
        };
        let (func, _, _) = self.function(&AppendVariant, 0)?;
        let cfg = LaunchConfig {
            grid_dim: (seqlen_new as u32, problem.batch() as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `params` matches `AttnParams`; the cache, the new tokens and the tables
        // were checked on the host (lengths, null, alignment; capacity and block indices of
        // every new position); the kernel clamps device-side lengths and block indices to the
        // cache. The memory stays valid until `stream` passes the kernel (caller memory by
        // `RawTensor::from_raw`'s contract, owned buffers because `append_kv` waits, uploaded
        // tables because they are freed in stream order).
        unsafe { launch(&func, cfg, stream, &params, &[], false) }?;
        drop((used_guard, table_guard));
        drop(uploaded);
        self.ctx
            .check_err()
            .map_err(|e| CudaError::driver("deferred driver call", e))
    }
}

/// The host checks of an append: a KV-cache problem this backend supports, and for every
/// sequence room for `seqlen_new` more tokens and valid blocks for each new position.
pub(crate) fn check_append(
    problem: &Problem,
    seqlen_new: usize,
    dtype: DType,
) -> Result<(), ProblemError> {
    supports(problem, dtype)?;
    let seqused_k = match problem.kv_cache() {
        KvCache::None => {
            return Err(ProblemError::Unsupported {
                what: "append_kv needs a KV-cache problem",
            })
        }
        KvCache::Padded { seqused_k } | KvCache::Paged { seqused_k, .. } => seqused_k,
    };
    if seqlen_new >= 1 << 30 {
        return Err(ProblemError::Unsupported {
            what: "append_kv takes fewer than 2^30 new tokens",
        });
    }
    let (capacity, block_size, blocks_per_seq, num_blocks) = cache_shape(problem);
    for (b, &used) in seqused_k.iter().enumerate() {
        let end = used as usize + seqlen_new;
        if end > capacity {
            return Err(ProblemError::CacheOverrun {
                batch: b,
                used: end,
                capacity,
            });
        }
        if let KvCache::Paged { block_table, .. } = problem.kv_cache() {
            if seqlen_new == 0 {
                continue;
            }
            let row = &block_table[b * blocks_per_seq..(b + 1) * blocks_per_seq];
            let first = used as usize / block_size;
            for (slot, &block) in row
                .iter()
                .enumerate()
                .take(end.div_ceil(block_size))
                .skip(first)
            {
                if block < 0 || block as usize >= num_blocks {
                    return Err(ProblemError::BlockIndex {
                        batch: b,
                        slot,
                        block: block as i64,
                        num_blocks,
                    });
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use softmax_core::ProblemDesc;

    #[test]
    fn append_checks_capacity_and_blocks() {
        let used = [3u32, 0];
        let padded = ProblemDesc::new(2, 1, 8, 4, 2, 64)
            .padded_cache(&used)
            .validate(256)
            .unwrap();
        assert!(check_append(&padded, 5, DType::Bf16).is_ok());
        assert_eq!(
            check_append(&padded, 6, DType::Bf16),
            Err(ProblemError::CacheOverrun {
                batch: 0,
                used: 9,
                capacity: 8
            })
        );
        // Block size 4, 3 blocks per sequence; sequence 1's second block is out of range.
        let table = [0i32, 1, 2, 3, 99, -1];
        let paged = ProblemDesc::new(2, 1, 0, 4, 2, 64)
            .paged_cache(&used, &table, 3, 4, 6)
            .validate(256)
            .unwrap();
        // Sequence 0 writes positions 3..7 (blocks 0, 1), sequence 1 positions 0..4 (block 0).
        assert!(check_append(&paged, 4, DType::F16).is_ok());
        assert_eq!(
            check_append(&paged, 5, DType::F16),
            Err(ProblemError::BlockIndex {
                batch: 1,
                slot: 1,
                block: 99,
                num_blocks: 6
            })
        );
        assert!(matches!(
            check_append(&paged, 10, DType::F16),
            Err(ProblemError::CacheOverrun { batch: 0, .. })
        ));
        assert!(check_append(&paged, 0, DType::F16).is_ok());
        let dense = ProblemDesc::new(1, 1, 8, 4, 2, 64).validate(256).unwrap();
        assert!(check_append(&dense, 1, DType::Bf16).is_err());
        assert!(check_append(&padded, 1, DType::F32).is_err());
    }

    #[test]
    fn host_tables_are_the_used_part() {
        let used = [5u32, 1];
        let table = [3i32, 2, 1, 0, 7, 7];
        let p = ProblemDesc::new(2, 1, 0, 4, 2, 64)
            .paged_cache(&used, &table[..4], 2, 4, 4)
            .validate(256)
            .unwrap();
        assert_eq!(host_tables(&p), (vec![5, 1], vec![3, 2, 1, 0]));
    }
}
