//! KV-cache (decode) calls on the device: the split-KV decode kernel and its combine step,
//! the workspace-size companion, and the in-place append of new K/V tokens. A KV-cache
//! problem reaches here from every forward entry (`Device::launch_raw` routes it), so the
//! owned-buffer layer, `forward_host`, `time_forward` and `forward_on_stream` all take it.

use super::{raw_view, CudaElement, Device, DeviceBuffer, ForwardStats};
use crate::compile::{compile_cached, KernelOrigin};
use crate::error::CudaError;
use crate::kernels::decode::{
    block_walk, cache_params, cache_shape, decode_params, plan_decode, AppendVariant,
    CombineVariant, DecodeParams, DecodePlan,
};
use crate::kernels::{DeviceProps, KernelVariant};
use crate::params::{supports, ForwardOptions};
use crate::raw::{check_cache_tables, check_ptr, CacheTables, RawCall, RawOut, RawTensor};
use cudarc::driver::sys::{self, CUfunction_attribute};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use softmax_core::{BufferLens, DType, KvCache, Problem, ProblemError, Qkv, Tensor};
use std::sync::Arc;

/// Base alignment of the 16-byte row loads and stores (strides are multiples of 8 elements).
const ROW_ALIGN: u64 = 16;

/// The host-side checks of a decode call, touching nothing: buffer lengths, this backend's
/// limits, the τ rule, then the plan (`None`: nothing to compute).
pub(super) fn check_decode(
    problem: &Problem,
    lens: BufferLens,
    dtype: DType,
    opts: &ForwardOptions,
    props: &DeviceProps,
) -> Result<Option<DecodePlan>, ProblemError> {
    problem.check_buffers(lens)?;
    supports(problem, dtype)?;
    // P is stored as a 16-bit operand of the inputs' dtype and reaches 2^tau.
    opts.rescale.check(dtype.max_finite(), 0.0)?;
    plan_decode(problem, dtype, opts.into(), props)
}

/// Rejects a null or misaligned workspace and one shorter than `needed` bytes.
fn check_workspace(ws: Option<RawTensor<f32>>, needed: usize) -> Result<u64, CudaError> {
    if needed == 0 {
        return Ok(0);
    }
    let ws = ws.ok_or(CudaError::WorkspaceTooSmall { needed, len: 0 })?;
    let len = ws.len().saturating_mul(4);
    if len < needed {
        return Err(CudaError::WorkspaceTooSmall { needed, len });
    }
    if ws.ptr() == 0 || ws.ptr() % ROW_ALIGN != 0 {
        return Err(CudaError::BadWorkspace { ptr: ws.ptr() });
    }
    ws.ptr()
        .checked_add(len as u64)
        .ok_or(ProblemError::Overflow)?;
    Ok(ws.ptr())
}

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

/// Device copies of the host tables, allocated on `stream` (freed in stream order).
struct UploadedTables {
    seqused_k: CudaSlice<i32>,
    block_table: Option<CudaSlice<i32>>,
    block_walk: Option<CudaSlice<i32>>,
}

impl Device {
    /// Bytes of workspace a KV-cache problem needs on this device for its key splits (0: one
    /// split, or nothing to compute) with these options: the scratch-size companion of
    /// [`Device::forward_cache_on_stream`]. The plan is deterministic, so the same problem,
    /// dtype and options always need the same size.
    pub fn decode_workspace_bytes(
        &self,
        problem: &Problem,
        dtype: DType,
        opts: &ForwardOptions,
    ) -> Result<usize, CudaError> {
        supports(problem, dtype)?;
        let plan = plan_decode(problem, dtype, opts.into(), &self.props)?;
        Ok(plan.map_or(0, |p| p.workspace_bytes))
    }

    /// Decode attention on caller memory and the caller's stream, with the cache tables and
    /// the split workspace also in caller memory: no host copy, no allocation, no host
    /// synchronisation. `problem` is a KV-cache problem (padded or paged) whose host tables
    /// describe `tables` (see [`CacheTables`]); `workspace` holds at least
    /// [`Device::decode_workspace_bytes`] bytes (16-byte aligned; `None` only when that is 0)
    /// and must not be used by other work until the stream has passed the call. Everything is
    /// checked before anything is queued, as in [`Device::forward_on_stream`].
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
        let call = RawCall {
            qkv,
            out,
            cu_seqlens: None,
        };
        let stats =
            self.launch_decode(problem, call, Some((tables, workspace)), stream, opts, 1)?;
        Ok(stats.into_iter().next().unwrap_or_default())
    }

    /// The decode launch path. `caller`: the device tables and workspace of
    /// [`Device::forward_cache_on_stream`]; `None`: the problem's host tables are copied and
    /// the workspace allocated on `stream`, both freed in stream order after the kernels.
    /// Queues `repeat` launches (decode, then combine when split); waits only when timing.
    pub(super) fn launch_decode<T: CudaElement>(
        &self,
        problem: &Problem,
        call: RawCall<T>,
        caller: Option<(CacheTables, Option<RawTensor<f32>>)>,
        stream: &Arc<CudaStream>,
        opts: &ForwardOptions,
        repeat: usize,
    ) -> Result<Vec<ForwardStats>, CudaError> {
        if **stream.context() != *self.ctx {
            return Err(CudaError::ForeignStream);
        }
        if call.cu_seqlens.is_some() {
            return Err(ProblemError::Unsupported {
                what: "device prefix sums go with Sequences::VarlenDevice only",
            }
            .into());
        }
        let lens = BufferLens::of(&call.qkv, &call.out);
        let plan = check_decode(problem, lens, T::DTYPE, opts, &self.props)?;
        let Qkv { q, k, v } = &call.qkv;
        for (tensor, t) in [
            (Tensor::Q, q),
            (Tensor::K, k),
            (Tensor::V, v),
            (Tensor::O, &call.out.o),
        ] {
            check_ptr(tensor, t, ROW_ALIGN)?;
        }
        if let Some(lse) = &call.out.lse {
            check_ptr(Tensor::Lse, lse, 4)?;
        }
        let caller_ptrs = match &caller {
            Some((tables, ws)) => {
                let (used, table, walk) = check_cache_tables(problem, tables)?;
                let ws = check_workspace(*ws, plan.map_or(0, |p| p.workspace_bytes))?;
                Some((used, table, walk, ws))
            }
            None => None,
        };
        let Some(mut plan) = plan else {
            return Ok(vec![ForwardStats::default(); repeat]);
        };
        // The block walk: the caller's, or built from the host tables here; the stats say
        // whether the launch walked.
        let host_walk = match (caller_ptrs, plan.block_walk) {
            (None, true) => Some(block_walk(problem)?),
            _ => None,
        };
        plan.block_walk &= host_walk.is_some() || caller_ptrs.is_some_and(|c| c.2 != 0);

        // Host tables and workspace: allocated on the launch stream, so that dropping them at
        // the end of this function frees them in stream order, after the kernels.
        let uploaded = match caller_ptrs {
            Some(_) => None,
            None => {
                let (used, table) = host_tables(problem);
                let up = |x: &[i32]| {
                    stream
                        .clone_htod(x)
                        .map_err(|e| CudaError::driver("cuMemcpyHtoD", e))
                };
                Some(UploadedTables {
                    seqused_k: up(&used)?,
                    block_table: if table.is_empty() {
                        None
                    } else {
                        Some(up(&table)?)
                    },
                    block_walk: host_walk.as_deref().map(up).transpose()?,
                })
            }
        };
        let scratch: Option<CudaSlice<f32>> = match (caller_ptrs, plan.workspace_bytes) {
            (None, bytes) if bytes > 0 => Some(
                stream
                    .alloc_zeros::<f32>(bytes / 4)
                    .map_err(|e| CudaError::driver("cuMemAlloc", e))?,
            ),
            _ => None,
        };
        let used_guard = uploaded.as_ref().map(|u| u.seqused_k.device_ptr(stream));
        let table_guard = uploaded
            .as_ref()
            .and_then(|u| u.block_table.as_ref())
            .map(|t| t.device_ptr(stream));
        let walk_guard = uploaded
            .as_ref()
            .and_then(|u| u.block_walk.as_ref())
            .map(|t| t.device_ptr(stream));
        let scratch_guard = scratch.as_ref().map(|s| s.device_ptr(stream));
        let (used_ptr, table_ptr, walk_ptr, ws_ptr) = match caller_ptrs {
            Some(ptrs) => ptrs,
            None => (
                used_guard.as_ref().map_or(0, |g| g.0),
                table_guard.as_ref().map_or(0, |g| g.0),
                walk_guard.as_ref().map_or(0, |g| g.0),
                scratch_guard.as_ref().map_or(0, |g| g.0),
            ),
        };

        let (mut params, ml_offset) = decode_params(problem, &plan, opts.rescale);
        params.q = q.ptr();
        params.k = k.ptr();
        params.v = v.ptr();
        params.o = call.out.o.ptr();
        params.lse = call.out.lse.map_or(0, |l| l.ptr());
        params.seqused_k = used_ptr;
        params.block_table = table_ptr;
        params.block_walk = if plan.block_walk { walk_ptr } else { 0 };
        params.o_part = ws_ptr;
        params.ml_part = if ws_ptr == 0 {
            0
        } else {
            ws_ptr + (ml_offset * 4) as u64
        };
        let stats = self.enqueue_decode(&plan, &params, T::DTYPE, stream, opts.time_kernel, repeat);
        drop((used_guard, table_guard, walk_guard, scratch_guard));
        drop((uploaded, scratch));
        let stats = stats?;
        self.ctx
            .check_err()
            .map_err(|e| CudaError::driver("deferred driver call", e))?;
        Ok(stats)
    }

    /// Queues `repeat` decode launches (and their combines) of a checked call.
    fn enqueue_decode(
        &self,
        plan: &DecodePlan,
        params: &DecodeParams,
        dtype: DType,
        stream: &Arc<CudaStream>,
        time: bool,
        repeat: usize,
    ) -> Result<Vec<ForwardStats>, CudaError> {
        let (decode, origin, registers) = self.named_function(&plan.variant, plan.smem_bytes)?;
        let combine = if plan.num_splits > 1 {
            Some(self.named_function(&CombineVariant { dtype }, 0)?.0)
        } else {
            None
        };
        let compile_ms = match origin {
            KernelOrigin::Compiled { ms } => Some(ms),
            _ => None,
        };
        let decode_cfg = LaunchConfig {
            grid_dim: plan.grid,
            block_dim: (plan.block, 1, 1),
            shared_mem_bytes: plan.smem_bytes,
        };
        let combine_cfg = LaunchConfig {
            grid_dim: (plan.combine_blocks, 1, 1),
            block_dim: (CombineVariant::WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.repeat_timed(stream, repeat, time, || {
            let mut builder = stream.launch_builder(&decode);
            builder.arg(params);
            // SAFETY: `params` matches the kernel's `DecodeParams` layout; every pointer in
            // it was checked on the host (non-null, aligned, long enough for the problem's
            // extents, the cache tables and the workspace) and is device memory of this
            // context that stays valid until `stream` passes the kernels: caller memory by
            // `RawTensor::from_raw`'s contract, owned buffers because their callers wait for
            // the stream, uploaded tables and scratch because they are freed in stream order.
            // Device-side lengths and block indices are clamped by the kernel.
            unsafe { builder.launch(decode_cfg) }
                .map_err(|e| CudaError::driver("cuLaunchKernel", e))?;
            if let Some(combine) = &combine {
                if self.props.major >= 9 {
                    // SAFETY: as above; the combine waits (`griddepcontrol.wait`) for the
                    // decode kernel to complete and its writes to be visible before it reads
                    // the workspace, then writes O and the LSE.
                    unsafe { launch_dependent(combine, combine_cfg, stream, params) }
                        .map_err(|e| CudaError::driver("cuLaunchKernelEx", e))?;
                } else {
                    let mut builder = stream.launch_builder(combine);
                    builder.arg(params);
                    // SAFETY: as above; the combine reads the workspace the decode kernel
                    // wrote (ordered after it on the same stream) and writes O and the LSE.
                    unsafe { builder.launch(combine_cfg) }
                        .map_err(|e| CudaError::driver("cuLaunchKernel", e))?;
                }
            }
            Ok(ForwardStats {
                launch: None,
                compile_ms,
                kernel_source: Some(origin),
                registers: Some(registers),
                kernel_ms: None,
                decode: Some(*plan),
            })
        })
    }

    /// The compiled and loaded function of a variant of any family (once per process and
    /// context), with `smem_bytes` of dynamic shared memory allowed.
    pub(super) fn named_function<V: KernelVariant + Clone + Send + Sync + 'static>(
        &self,
        variant: &V,
        smem_bytes: u32,
    ) -> Result<(CudaFunction, KernelOrigin, u32), CudaError> {
        let mut functions = self.named_functions.lock().map_err(|_| CudaError::Driver {
            what: "kernel table",
            error: "poisoned lock".into(),
        })?;
        let key = (variant.family().name, variant.name());
        if let Some((f, regs)) = functions.get(&key) {
            return Ok((f.clone(), KernelOrigin::ProcessCache, *regs));
        }
        let (compiled, origin) = compile_cached(variant, &self.arch)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin.clone()))
            .map_err(|e| CudaError::driver("cuModuleLoadData", e))?;
        let f = module
            .load_function(variant.entry())
            .map_err(|e| CudaError::driver("cuModuleGetFunction", e))?;
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem_bytes as i32,
        )
        .map_err(|e| CudaError::driver("cuFuncSetAttribute", e))?;
        let regs = compiled.usage.registers;
        functions.insert(key, (f.clone(), regs));
        Ok((f, origin, regs))
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
            if t.len() < needed {
                return Err(ProblemError::BufferTooSmall {
                    tensor,
                    needed,
                    len: t.len(),
                }
                .into());
            }
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
        let params = DecodeParams {
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
        let (func, _, _) = self.named_function(&AppendVariant, 0)?;
        let cfg = LaunchConfig {
            grid_dim: (seqlen_new as u32, problem.batch() as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = stream.launch_builder(&func);
        builder.arg(&params);
        // SAFETY: `params` matches `DecodeParams`; the cache, the new tokens and the tables
        // were checked on the host (lengths, null, alignment; capacity and block indices of
        // every new position); the kernel clamps device-side lengths and block indices to the
        // cache. The memory stays valid until `stream` passes the kernel (caller memory by
        // `RawTensor::from_raw`'s contract, owned buffers because `append_kv` waits, uploaded
        // tables because they are freed in stream order).
        unsafe { builder.launch(cfg) }.map_err(|e| CudaError::driver("cuLaunchKernel", e))?;
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

/// Launches `func` with one by-value parameter block on `stream` as a programmatic dependent
/// launch (sm_90+): its CTAs may be scheduled while the previous kernel on the stream still
/// runs (that kernel lets them, `griddepcontrol.launch_dependents`), which hides the second
/// launch's latency. Only for kernels that execute `griddepcontrol.wait` before reading
/// anything the previous kernel wrote.
///
/// # Safety
/// As for any kernel launch: `P` is the kernel's parameter layout and every pointer in it is
/// valid device memory for what the kernel accesses, until the stream passes the kernel; and
/// the kernel waits as described above.
unsafe fn launch_dependent<P>(
    func: &CudaFunction,
    cfg: LaunchConfig,
    stream: &CudaStream,
    params: &P,
) -> Result<(), cudarc::driver::DriverError> {
    stream.context().bind_to_thread()?;
    // SAFETY: a plain C struct of integers and a union of plain values: all-zero is valid.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // The driver copies the parameter block out of `args` during the call.
    let mut args = [params as *const P as *mut std::ffi::c_void];
    // SAFETY: `config` and `args` outlive the call; the caller upholds the launch contract.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
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
    fn workspace_is_checked() {
        let at = |ptr: u64, len: usize| {
            // SAFETY: only the host-side check sees it.
            Some(unsafe { RawTensor::<f32>::from_raw(ptr, len) })
        };
        assert_eq!(check_workspace(None, 0), Ok(0));
        assert_eq!(
            check_workspace(None, 64),
            Err(CudaError::WorkspaceTooSmall { needed: 64, len: 0 })
        );
        assert_eq!(
            check_workspace(at(0x1000, 15), 64),
            Err(CudaError::WorkspaceTooSmall {
                needed: 64,
                len: 60
            })
        );
        assert_eq!(
            check_workspace(at(0x1008, 16), 64),
            Err(CudaError::BadWorkspace { ptr: 0x1008 })
        );
        assert_eq!(check_workspace(at(0x1000, 16), 64), Ok(0x1000));
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
