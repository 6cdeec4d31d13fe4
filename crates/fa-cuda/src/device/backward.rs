//! The backward pass on a device: the run of a [`BackwardPlan`] on caller memory and stream,
//! and the owned-buffer and host conveniences over it.

use super::decode::upload_cu_seqlens;
use super::{launch as launch_kernel, raw_view, CudaElement, Device, DeviceBuffer};
use crate::backward::{plan_backward, BackwardOptions, BackwardPlan};
use crate::compile::KernelOrigin;
use crate::error::CudaError;
use crate::kernels::bwd_sm80::{BwdLaunch, BwdPrepVariant, PREP_THREADS};
use crate::params::Params;
use crate::raw::{check_cu_seqlens, check_len, check_ptr, CuSeqlens, RawTensor};
use cudarc::driver::{CudaStream, DevicePtr, LaunchConfig};
use softmax_core::{DType, Grads, Problem, ProblemError, Qkv, Tensor};
use std::sync::Arc;

/// The tensors of a backward call on caller memory: the forward's inputs, output and LSE,
/// `∂L/∂O`, the gradients (laid out as Q, K and V; written) and, for a packed problem, its
/// prefix sums on the device.
#[derive(Clone, Copy, Debug)]
pub struct BackwardTensors<T> {
    /// Q, K and V.
    pub qkv: Qkv<RawTensor<T>>,
    /// The forward's output (the problem's O layout).
    pub o: RawTensor<T>,
    /// `∂L/∂O` (the problem's O layout).
    pub d_o: RawTensor<T>,
    /// The forward's natural-log LSE (`None` is an error: the backward needs it).
    pub lse: Option<RawTensor<f32>>,
    /// dQ, dK and dV (written).
    pub grads: Grads<RawTensor<T>>,
    /// Device prefix sums (int32, `batch + 1` each): required for a packed problem, absent
    /// otherwise.
    pub cu_seqlens: Option<CuSeqlens>,
}

/// The forward's tensors a backward call reads besides Q, K and V.
#[derive(Clone, Copy, Debug)]
pub struct BackwardInputs<O, L> {
    /// The forward's output.
    pub o: O,
    /// `∂L/∂O`, laid out as O.
    pub d_o: O,
    /// The forward's natural-log LSE.
    pub lse: L,
}

/// What a backward call did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BackwardStats {
    /// The launch (variant, grids, shared memory).
    pub launch: Option<BwdLaunch>,
    /// Where the main kernel came from (compiled by this call, the disk cache, or already
    /// loaded); `None` when it did not run.
    pub kernel_source: Option<KernelOrigin>,
    /// Registers per thread of the main kernel (ptxas' report).
    pub registers: Option<u32>,
    /// Time of the three kernels from CUDA events, when [`BackwardOptions::time_kernel`] was
    /// set.
    pub kernel_ms: Option<f32>,
}

/// Checks a call's tensors, prefix sums and workspace against the plan; returns the kernel
/// parameters with every address filled in. Touches nothing.
fn check_tensors<T: CudaElement>(
    plan: &BackwardPlan,
    t: &BackwardTensors<T>,
    workspace: &RawTensor<u8>,
) -> Result<Params, CudaError> {
    if plan.dtype() != T::DTYPE {
        return Err(ProblemError::Unsupported {
            what: "the tensors' dtype is not the one the backward plan was made for",
        }
        .into());
    }
    let lens = plan.buffer_lens();
    let lse = t.lse.ok_or(ProblemError::Unsupported {
        what: "the backward needs the forward's LSE",
    })?;
    let sized: [(Tensor, &RawTensor<T>, usize); 8] = [
        (Tensor::Q, &t.qkv.q, lens.q),
        (Tensor::K, &t.qkv.k, lens.k),
        (Tensor::V, &t.qkv.v, lens.v),
        (Tensor::O, &t.o, lens.o),
        (Tensor::O, &t.d_o, lens.o),
        (Tensor::Q, &t.grads.dq, lens.q),
        (Tensor::K, &t.grads.dk, lens.k),
        (Tensor::V, &t.grads.dv, lens.v),
    ];
    for (tensor, x, needed) in sized {
        check_len(tensor, x, needed)?;
        check_ptr(tensor, x, 16)?;
    }
    check_len(Tensor::Lse, &lse, plan.lse_len())?;
    check_ptr(Tensor::Lse, &lse, 4)?;
    let (cu_q, cu_k) = match (plan.is_varlen(), &t.cu_seqlens) {
        (true, Some(cu)) => check_cu_seqlens(plan.batch(), cu)?,
        (true, None) => {
            return Err(ProblemError::Unsupported {
                what: "a packed backward needs its prefix sums on the device",
            }
            .into())
        }
        (false, Some(_)) => {
            return Err(ProblemError::Unsupported {
                what: "device prefix sums go with a packed problem only",
            }
            .into())
        }
        (false, None) => (0, 0),
    };
    let req = plan.workspace();
    let base = req.check(workspace)?;
    let at = |name: &str| req.at(base, name);
    Ok(Params {
        q: t.qkv.q.ptr(),
        k: t.qkv.k.ptr(),
        v: t.qkv.v.ptr(),
        o: t.o.ptr(),
        d_o: t.d_o.ptr(),
        lse: lse.ptr(),
        dq: t.grads.dq.ptr(),
        dk: t.grads.dk.ptr(),
        dv: t.grads.dv.ptr(),
        dsum: at("d"),
        lse2: at("lse_log2"),
        dq_acc: at("dq_accum"),
        cu_q,
        cu_k,
        ..plan.params
    })
}

impl Device {
    /// [`plan_backward`] for this device's properties.
    pub fn plan_backward(
        &self,
        problem: &Problem,
        dtype: DType,
        opts: &BackwardOptions,
    ) -> Result<BackwardPlan, CudaError> {
        Ok(plan_backward(problem, dtype, opts, &self.props)?)
    }

    /// Runs a planned backward on memory the caller owns, queued on the caller's `stream`
    /// without waiting: the pre-pass, the main kernel and the dQ post-pass. `workspace` holds
    /// at least [`BackwardPlan::workspace_bytes`] bytes at an address aligned to the plan's
    /// [`crate::WorkspaceReq::align`] (its contents need not be initialised; the caller keeps
    /// it for this call alone until the stream has passed it). Everything is checked before
    /// anything is queued (gradients untouched on error): the dtype and device against the
    /// plan, every length (dO and O against O's extent, the gradients against Q's, K's and
    /// V's), null and misaligned addresses (16 bytes; the LSE and prefix sums 4), the
    /// workspace. The tensors are valid as [`RawTensor::from_raw`] requires.
    pub fn backward_on_stream<T: CudaElement>(
        &self,
        plan: &BackwardPlan,
        tensors: BackwardTensors<T>,
        workspace: RawTensor<u8>,
        stream: &Arc<CudaStream>,
    ) -> Result<BackwardStats, CudaError> {
        self.backward_run(plan, tensors, workspace, stream, false)
    }

    /// [`Device::backward_on_stream`], optionally timing the kernels with CUDA events (which
    /// waits for them).
    fn backward_run<T: CudaElement>(
        &self,
        plan: &BackwardPlan,
        tensors: BackwardTensors<T>,
        workspace: RawTensor<u8>,
        stream: &Arc<CudaStream>,
        time: bool,
    ) -> Result<BackwardStats, CudaError> {
        if **stream.context() != *self.ctx {
            return Err(CudaError::ForeignStream);
        }
        if *plan.props() != self.props {
            return Err(ProblemError::Unsupported {
                what: "the backward plan was made for another device",
            }
            .into());
        }
        let params = check_tensors(plan, &tensors, &workspace)?;
        let launch = *plan.launch();
        let dtype = plan.dtype();
        let (main, origin, registers) = self.function(&launch.variant, launch.smem_bytes)?;
        let pre = self.function(&BwdPrepVariant { dtype, post: false }, 0)?.0;
        let post = self.function(&BwdPrepVariant { dtype, post: true }, 0)?.0;
        let launch_one = |f: &cudarc::driver::CudaFunction, cfg: LaunchConfig| {
            // SAFETY: `params` matches the kernels' `AttnParams` layout; every address in it
            // was checked by `check_tensors` (non-null, aligned, long enough for the plan's
            // problem, whose extents bound the kernels' reads and writes; the workspace at
            // least the plan's size, which its parts' offsets stay inside) and is device
            // memory of this context valid until `stream` passes the kernels, by
            // `RawTensor::from_raw`'s contract (owned buffers: their callers wait for the
            // stream).
            unsafe { launch_kernel(f, cfg, stream, &params, &[], false) }
        };
        let timed = self.timed(stream, 1, time, || {
            if let Some(grid) = launch.prep_grid {
                launch_one(
                    &pre,
                    LaunchConfig {
                        grid_dim: grid,
                        block_dim: (PREP_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    },
                )?;
            }
            if let Some(grid) = launch.grid {
                launch_one(
                    &main,
                    LaunchConfig {
                        grid_dim: grid,
                        block_dim: (launch.block, 1, 1),
                        shared_mem_bytes: launch.smem_bytes,
                    },
                )?;
            }
            if let Some(grid) = launch.prep_grid {
                launch_one(
                    &post,
                    LaunchConfig {
                        grid_dim: grid,
                        block_dim: (PREP_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    },
                )?;
            }
            Ok(())
        })?;
        let kernel_ms = timed.first().and_then(|t| t.1);
        self.ctx
            .check_err()
            .map_err(|e| CudaError::driver("deferred driver call", e))?;
        Ok(BackwardStats {
            launch: Some(launch),
            kernel_source: Some(origin),
            registers: Some(registers),
            kernel_ms,
        })
    }

    /// The backward on device buffers of this context, on the device's default stream:
    /// plans, allocates the workspace (and copies a packed problem's host prefix sums), runs
    /// [`Device::backward_on_stream`]'s path `repeat` times and waits. Bad input returns an
    /// error before anything is queued.
    #[allow(clippy::too_many_arguments)]
    fn backward_owned<T: CudaElement>(
        &self,
        problem: &Problem,
        qkv: Qkv<&DeviceBuffer<T>>,
        inputs: BackwardInputs<&DeviceBuffer<T>, &DeviceBuffer<f32>>,
        grads: Grads<&mut DeviceBuffer<T>>,
        opts: &BackwardOptions,
        repeat: usize,
    ) -> Result<Vec<BackwardStats>, CudaError> {
        let plan = self.plan_backward(problem, T::DTYPE, opts)?;
        for b in [
            qkv.q, qkv.k, qkv.v, inputs.o, inputs.d_o, &*grads.dq, &*grads.dk, &*grads.dv,
        ] {
            self.owns(b)?;
        }
        self.owns(inputs.lse)?;
        let stream = &self.stream;
        let cu = match problem.sequences() {
            softmax_core::Sequences::Varlen { .. } => upload_cu_seqlens(problem, stream)?,
            softmax_core::Sequences::VarlenDevice { .. } => {
                return Err(ProblemError::Unsupported {
                    what: "device prefix sums go through backward_on_stream",
                }
                .into())
            }
            _ => None,
        };
        let cu_views = cu.as_ref().map(|(q, k)| {
            let (qp, qg) = q.device_ptr(stream);
            let (kp, kg) = k.device_ptr(stream);
            // SAFETY: both are live allocations of this context holding `batch + 1` u32
            // values (i32's layout), kept until the stream has passed the kernels below.
            let views = unsafe {
                CuSeqlens {
                    q: RawTensor::from_raw(qp, q.len()),
                    k: RawTensor::from_raw(kp, k.len()),
                }
            };
            (views, qg, kg)
        });
        // The workspace: f32 elements covering its bytes (cudarc's allocations are 256-byte
        // aligned).
        let ws_elems = plan.workspace_bytes().div_ceil(4).max(1);
        let ws = self.alloc_zeroed::<f32>(ws_elems)?;
        let (ws_view, _gw) = raw_view(&ws, stream);
        // SAFETY: the same allocation, seen as bytes (4 per f32 element).
        let ws_bytes = unsafe { RawTensor::<u8>::from_raw(ws_view.ptr(), ws_view.len() * 4) };
        let (q, _gq) = raw_view(qkv.q, stream);
        let (k, _gk) = raw_view(qkv.k, stream);
        let (v, _gv) = raw_view(qkv.v, stream);
        let (o, _go) = raw_view(inputs.o, stream);
        let (d_o, _gdo) = raw_view(inputs.d_o, stream);
        let (lse, _gl) = raw_view(inputs.lse, stream);
        let (dq, _gdq) = raw_view(&*grads.dq, stream);
        let (dk, _gdk) = raw_view(&*grads.dk, stream);
        let (dv, _gdv) = raw_view(&*grads.dv, stream);
        let tensors = BackwardTensors {
            qkv: Qkv::new(q, k, v),
            o,
            d_o,
            lse: Some(lse),
            grads: Grads::new(dq, dk, dv),
            cu_seqlens: cu_views.as_ref().map(|c| c.0),
        };
        let mut all = Vec::with_capacity(repeat);
        for _ in 0..repeat {
            all.push(self.backward_run(&plan, tensors, ws_bytes, stream, opts.time_kernel)?);
        }
        drop(cu_views);
        self.synchronize()?;
        Ok(all)
    }

    /// The backward on device buffers: `grads` (dQ, dK, dV, laid out as Q, K and V) receive
    /// the gradients of a loss given `∂L/∂O` (`inputs.d_o`), the forward's O and its LSE, for
    /// the validated `problem` (dense with strides, or packed with host prefix sums). Every
    /// tensor has the dtype `T`. Plans ([`Device::plan_backward`]), allocates the workspace
    /// and runs [`Device::backward_on_stream`]'s path on the default stream, then waits. Bad
    /// input returns an error before anything is queued (gradients untouched). dQ is summed
    /// with f32 atomics: not bitwise deterministic from run to run (dK and dV are).
    pub fn backward<T: CudaElement>(
        &self,
        problem: &Problem,
        qkv: Qkv<&DeviceBuffer<T>>,
        inputs: BackwardInputs<&DeviceBuffer<T>, &DeviceBuffer<f32>>,
        grads: Grads<&mut DeviceBuffer<T>>,
        opts: &BackwardOptions,
    ) -> Result<BackwardStats, CudaError> {
        let stats = self.backward_owned(problem, qkv, inputs, grads, opts, 1)?;
        Ok(stats.into_iter().next().unwrap_or_default())
    }

    /// Times `iters` backward runs (after `warmup` untimed ones) with CUDA events around each
    /// run's three kernels; returns their times in milliseconds. Same arguments as
    /// [`Device::backward`].
    #[allow(clippy::too_many_arguments)]
    pub fn time_backward<T: CudaElement>(
        &self,
        problem: &Problem,
        qkv: Qkv<&DeviceBuffer<T>>,
        inputs: BackwardInputs<&DeviceBuffer<T>, &DeviceBuffer<f32>>,
        grads: Grads<&mut DeviceBuffer<T>>,
        opts: &BackwardOptions,
        warmup: usize,
        iters: usize,
    ) -> Result<Vec<f32>, CudaError> {
        let untimed = BackwardOptions {
            time_kernel: false,
            ..*opts
        };
        let Grads { dq, dk, dv } = grads;
        self.backward_owned(
            problem,
            qkv,
            inputs,
            Grads::new(&mut *dq, &mut *dk, &mut *dv),
            &untimed,
            warmup,
        )?;
        let timed = BackwardOptions {
            time_kernel: true,
            ..*opts
        };
        let stats =
            self.backward_owned(problem, qkv, inputs, Grads::new(dq, dk, dv), &timed, iters)?;
        Ok(stats.iter().filter_map(|s| s.kernel_ms).collect())
    }

    /// Host convenience: plans and checks every length first (nothing is copied on error,
    /// gradients untouched), uploads the tensors, runs [`Device::backward`] and copies the
    /// gradients back.
    pub fn backward_host<T: CudaElement>(
        &self,
        problem: &Problem,
        qkv: Qkv<&[T]>,
        inputs: BackwardInputs<&[T], &[f32]>,
        grads: Grads<&mut [T]>,
        opts: &BackwardOptions,
    ) -> Result<BackwardStats, CudaError> {
        let plan = self.plan_backward(problem, T::DTYPE, opts)?;
        let lens = plan.buffer_lens();
        let sized: [(Tensor, usize, usize); 8] = [
            (Tensor::Q, qkv.q.len(), lens.q),
            (Tensor::K, qkv.k.len(), lens.k),
            (Tensor::V, qkv.v.len(), lens.v),
            (Tensor::O, inputs.o.len(), lens.o),
            (Tensor::O, inputs.d_o.len(), lens.o),
            (Tensor::Q, grads.dq.len(), lens.q),
            (Tensor::K, grads.dk.len(), lens.k),
            (Tensor::V, grads.dv.len(), lens.v),
        ];
        for (tensor, len, needed) in sized {
            if len < needed {
                return Err(ProblemError::BufferTooSmall {
                    tensor,
                    needed,
                    len,
                }
                .into());
            }
        }
        if inputs.lse.len() < plan.lse_len() {
            return Err(ProblemError::BufferTooSmall {
                tensor: Tensor::Lse,
                needed: plan.lse_len(),
                len: inputs.lse.len(),
            }
            .into());
        }
        let (q, k, v) = (
            self.upload(qkv.q)?,
            self.upload(qkv.k)?,
            self.upload(qkv.v)?,
        );
        let (o, d_o, lse) = (
            self.upload(inputs.o)?,
            self.upload(inputs.d_o)?,
            self.upload(inputs.lse)?,
        );
        // The gradients' current contents go up too: elements between the tensor's own
        // (padding of strided layouts) come back unchanged.
        let Grads { dq, dk, dv } = grads;
        let (mut gq, mut gk, mut gv) = (self.upload(&*dq)?, self.upload(&*dk)?, self.upload(&*dv)?);
        let stats = self.backward(
            problem,
            Qkv::new(&q, &k, &v),
            BackwardInputs {
                o: &o,
                d_o: &d_o,
                lse: &lse,
            },
            Grads::new(&mut gq, &mut gk, &mut gv),
            opts,
        )?;
        self.download(&gq, dq)?;
        self.download(&gk, dk)?;
        self.download(&gv, dv)?;
        Ok(stats)
    }
}
