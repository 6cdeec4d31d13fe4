"""PyTorch autograd for :func:`flash_attention_rs.attention` (imported only once torch is).

Two ``torch.library`` custom operators carry the calls, so that autograd and ``torch.compile``
see one opaque operation each (no graph break, fake implementations for tracing):

- ``flash_attention_rs::attention`` ``(q, k, v, ...) -> (out, lse)``: the forward, on the CPU
  or on CUDA (the same Rust calls as :func:`attention` without autograd), returning the
  log-sum-exp the backward reads;
- ``flash_attention_rs::attention_backward`` ``(d_out, q, k, v, out, lse, ...) -> (dq, dk,
  dv)``: the Rust backward (exact, recomputing the probabilities from the LSE; GQA's dK/dV
  summed over each group), called directly through pyo3 (``_native.backward``): on the CPU
  the SIMD kernel (deterministic), on CUDA fa-cuda's backward on the tensors' device memory,
  queued on ``torch.cuda.current_stream()`` (bfloat16/float16; dQ is summed with f32 atomics,
  so it may differ from run to run by rounding).

The forward's autograd formula (``register_autograd`` with ``setup_context``) saves q, k, v,
out and the LSE; the LSE output carries no gradient (it is marked non-differentiable).
Outputs and gradients are contiguous, in the inputs' dtype (float32, bfloat16, float16).
"""

from __future__ import annotations

import threading
from typing import Optional, Tuple

import torch

from . import _native

#: Set while an operator's implementation calls :func:`attention` itself (not routed again).
_inside = threading.local()

HAS_CUSTOM_OP = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_autograd")


def inside():
    """Whether this thread is inside an operator's implementation."""
    return getattr(_inside, "active", False)


def compiling():
    """Whether ``torch.compile`` (dynamo) is tracing this call."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def needs_grad(q, k, v):
    """Whether autograd records this call: grad mode on and an input that requires grad."""
    # A NumPy array among the inputs has no requires_grad (the plain path refuses the mix).
    return torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in (q, k, v))


def _eager(q, k, v, causal, window_left, window_right, softcap, scale, cu_q, cu_k, max_q, max_k):
    """The forward through :func:`attention`'s ordinary path: contiguous ``out`` and LSE."""
    from . import attention

    out = torch.empty(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=q.dtype, device=q.device)
    _inside.active = True
    try:
        return attention(
            q,
            k,
            v,
            causal=causal,
            window=(window_left, window_right),
            softcap=softcap,
            scale=scale,
            return_lse=True,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            out=out,
        )
    finally:
        _inside.active = False


def _lse_shape(q, varlen):
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _describe(x):
    return (x.data_ptr(), tuple(x.shape), tuple(x.stride()), str(x.dtype)[len("torch.") :])


def _backward_native(d_out, q, k, v, out, lse, causal, window_left, window_right, softcap, scale, cu_q, cu_k):
    """dq, dk, dv from the Rust backward (CPU tensors; CUDA tensors on the current stream)."""
    q, k, v, out, lse = (x.contiguous() for x in (q, k, v, out, lse))
    # dO in O's layout and dtype (autograd may hand a broadcast or strided gradient).
    d_out = d_out.to(out.dtype).contiguous()
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    kwargs = dict(causal=causal, window=(window_left, window_right), softcap=softcap, scale=scale)
    if cu_q is not None:
        # Host prefix sums (a CUDA tensor is read back: the plan needs the lengths on the host).
        kwargs["cu_seqlens"] = (cu_q.tolist(), cu_k.tolist())
    if q.device.type == "cuda":
        from . import cuda_device

        ordinal = q.device.index if q.device.index is not None else torch.cuda.current_device()
        kwargs["device"] = cuda_device(ordinal)
        kwargs["stream"] = torch.cuda.current_stream(q.device).cuda_stream
    _native.backward(*(_describe(x) for x in (q, k, v, out, lse, d_out, dq, dk, dv)), **kwargs)
    return dq, dk, dv


if HAS_CUSTOM_OP:

    @torch.library.custom_op("flash_attention_rs::attention", mutates_args=())
    def attention_op(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        window_left: int,
        window_right: int,
        softcap: Optional[float],
        scale: Optional[float],
        cu_seqlens_q: Optional[torch.Tensor],
        cu_seqlens_k: Optional[torch.Tensor],
        max_seqlen_q: Optional[int],
        max_seqlen_k: Optional[int],
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Exact attention forward: ``(out, lse)``, both contiguous (see the module doc)."""
        return _eager(
            q, k, v, causal, window_left, window_right, softcap, scale,
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        )

    @attention_op.register_fake
    def _(q, k, v, causal, window_left, window_right, softcap, scale, cu_seqlens_q, cu_seqlens_k,
          max_seqlen_q, max_seqlen_k):
        out = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
        lse = q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)
        return out, lse

    @torch.library.custom_op("flash_attention_rs::attention_backward", mutates_args=())
    def attention_backward_op(
        d_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        window_left: int,
        window_right: int,
        softcap: Optional[float],
        scale: Optional[float],
        cu_seqlens_q: Optional[torch.Tensor],
        cu_seqlens_k: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Exact attention backward: ``(dq, dk, dv)``, contiguous, in the inputs' dtype."""
        return _backward_native(
            d_out, q, k, v, out, lse, causal, window_left, window_right, softcap, scale,
            cu_seqlens_q, cu_seqlens_k,
        )

    @attention_backward_op.register_fake
    def _(d_out, q, k, v, out, lse, causal, window_left, window_right, softcap, scale,
          cu_seqlens_q, cu_seqlens_k):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def _setup_context(ctx, inputs, output):
        q, k, v, causal, window_left, window_right, softcap, scale, cu_q, cu_k, _, _ = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.options = (causal, window_left, window_right, softcap, scale)
        ctx.mark_non_differentiable(lse)

    def _backward(ctx, d_out, _d_lse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = attention_backward_op(d_out, q, k, v, out, lse, *ctx.options, cu_q, cu_k)
        return (dq, dk, dv) + (None,) * 9

    attention_op.register_autograd(_backward, setup_context=_setup_context)


def _int32_host(cu, name):
    """Host prefix sums as a CPU int32 tensor (a CUDA tensor stays where it is)."""
    if isinstance(cu, torch.Tensor):
        if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
            raise TypeError(f"{name} has dtype {cu.dtype}: expected integers (int32)")
        return cu if cu.device.type != "cpu" else cu.to(torch.int32)
    from . import _host_prefix_sums

    return torch.tensor(_host_prefix_sums(cu, name), dtype=torch.int32)


def attention(q, k, v, causal, window, softcap, scale, return_lse, backend, cu_q, cu_k, max_q, max_k):
    """:func:`flash_attention_rs.attention` through the operators (autograd or tracing)."""
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        raise TypeError("q, k and v must all be NumPy arrays or all torch tensors")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v are in different places: {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q is on device {q.device}: only cpu and cuda are supported")
    if backend == "cpu" and q.device.type != "cpu":
        raise ValueError(f"backend='cpu' needs tensors in host memory; these are on {q.device}")
    if backend == "cuda" and q.device.type != "cuda":
        raise ValueError("backend='cuda' needs CUDA tensors; these are in host memory")
    grad = needs_grad(q, k, v)
    if grad and not HAS_CUSTOM_OP:
        raise ValueError(
            f"flash_attention_rs needs torch.library.custom_op (torch >= 2.4) for autograd; this "
            f"is torch {torch.__version__}: call it under torch.no_grad() for inference"
        )
    if cu_q is not None:
        cu_q, cu_k = _int32_host(cu_q, "cu_seqlens_q"), _int32_host(cu_k, "cu_seqlens_k")
    out, lse = attention_op(
        q, k, v, causal, window[0], window[1], softcap, scale, cu_q, cu_k, max_q, max_k
    )
    return (out, lse) if return_lse else out
