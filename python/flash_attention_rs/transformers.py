"""A transformers attention backend: ``register()`` then ``attn_implementation="fa_rs"``.

``register()`` adds :func:`attention_forward` to transformers' ``AttentionInterface`` (and
FlashAttention-2's mask function to ``AttentionMaskInterface`` under the same name, so that
models pass no mask when there is no padding). The function takes what transformers gives an
attention backend: BHSD ``(batch, heads, seqlen, head_dim)`` query/key/value, the module (for
``is_causal``), the mask, ``scaling``, ``dropout``, ``sliding_window`` and ``softcap``, and
returns ``(attn_output, None)`` with ``attn_output`` BSHD ``(batch, seqlen_q, heads, head_dim)``.

Handled: GQA/MQA (fewer key/value heads), causal prefill, decode against a KV cache (causal
is bottom-right aligned: the new queries sit at the end of the keys), sliding windows, softcap.
Packed sequences given as ``cu_seq_lens_q``/``cu_seq_lens_k`` (what transformers passes
FlashAttention-style backends) run as one varlen call. Refused with ``ValueError``: masks
other than "no mask" or the plain causal / sliding-window pattern (padding masks, custom
masks), rows of packed sequences told only by restarting ``position_ids``, and dropout while
training. Training works on the CPU and on CUDA: with inputs that require grad the call goes
through ``attention``'s autograd operator (gradients from the Rust backward: fa-cpu's, or
fa-cuda's on the current stream).
"""

from __future__ import annotations

import numbers
import operator
import sys

import numpy as np

from . import attention

__all__ = ["register", "attention_forward", "NAME"]

#: The ``attn_implementation`` name that :func:`register` uses by default. Not "flash_rs":
#: transformers (5.x) takes every implementation name containing "flash" for FlashAttention
#: itself (it tries to import flash_attn kernels for it and changes masking and generation).
NAME = "fa_rs"


def register(name=NAME):
    """Registers :func:`attention_forward` with transformers as ``name``; returns ``name``.

    A name containing "flash" is refused (``ValueError``): transformers would treat it as its
    own FlashAttention integration and fail to load kernels for it.
    """
    if "flash" in name:
        raise ValueError(
            f"attn_implementation name {name!r}: transformers treats names containing 'flash' "
            f"as FlashAttention itself; use another, e.g. {NAME!r}"
        )
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention_forward)
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import flash_attention_mask
    except ImportError:  # older transformers: models build their own masks, checked below
        pass
    else:
        AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def _expected_visible(seqlen_q, seqlen_k, causal, window):
    """Boolean ``(seqlen_q, seqlen_k)``: which keys each query sees (bottom-right aligned)."""
    left, right = window
    i = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    j = np.arange(seqlen_k)[None, :]
    visible = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if causal:
        right = 0
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    return visible


def _mask_matches(mask, seqlen_q, seqlen_k, causal, window):
    """Whether ``mask`` asks for nothing beyond ``causal``/``window``: all visible (2-D
    ``(batch, seqlen_k)`` padding masks), or the same pattern (4-D boolean or additive)."""
    torch = sys.modules.get("torch")
    is_torch = torch is not None and isinstance(mask, torch.Tensor)
    if is_torch and mask.dtype != torch.bool:
        visible = mask == 0 if mask.dim() == 4 else mask != 0
    elif not is_torch and np.asarray(mask).dtype != bool:
        m = np.asarray(mask)
        visible = m == 0 if m.ndim == 4 else m != 0
    else:
        visible = mask if is_torch else np.asarray(mask)
    if visible.ndim == 2:
        return bool(visible.all())
    if visible.ndim != 4 or tuple(visible.shape[-2:]) != (seqlen_q, seqlen_k):
        return False
    expected = _expected_visible(seqlen_q, seqlen_k, causal, window)
    if is_torch:
        expected = torch.from_numpy(expected).to(visible.device)
        return bool((visible == expected).all())
    return bool((visible == expected).all())


def attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """transformers' attention-function signature over :func:`flash_attention_rs.attention`.

    ``query`` ``(batch, heads_q, seqlen_q, head_dim)``, ``key``/``value`` ``(batch, heads_kv,
    seqlen_k, head_dim)`` (any strides with a contiguous last dimension); returns
    ``(attn_output, None)``, ``attn_output`` contiguous ``(batch, seqlen_q, heads_q, head_dim)``.
    """
    if dropout and getattr(module, "training", False):
        raise ValueError("fa_rs (flash_attention_rs) does not implement attention dropout (dropout > 0 while training)")
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    causal = bool(causal)
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if sliding_window is not None:
        # transformers' sliding window of w: query i sees keys i - w < j (<= i when causal).
        # w = 0 would give side -1, which reads as unbounded: refused, as a float w is.
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
            raise TypeError(f"sliding_window is {sliding_window!r}: expected an integer >= 1 or None")
        if sliding_window < 1:
            raise ValueError(f"sliding_window is {sliding_window}: expected an integer >= 1 or None")
        window = (sliding_window - 1, -1 if causal else sliding_window - 1)
    else:
        window = (-1, -1)
    torch = sys.modules.get("torch")
    is_torch = torch is not None and isinstance(query, torch.Tensor)
    common = dict(causal=causal, window=window, softcap=softcap or None, scale=scaling)

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        # Packed sequences (what transformers hands FlashAttention-style backends): one row of
        # (1, heads, total_tokens, head_dim) with prefix sums.
        if cu_q is None or cu_k is None or query.shape[0] != 1:
            raise ValueError("packed sequences need cu_seq_lens_q, cu_seq_lens_k and batch 1")
        q, k, v = (x[0].swapaxes(0, 1) for x in (query, key, value))
        out = None if _autograd(query, key, value) else _empty(query, (q.shape[0], q.shape[1], value.shape[-1]), is_torch)
        out = attention(
            q,
            k,
            v,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=_maybe_int(kwargs.get("max_length_q")),
            max_seqlen_k=_maybe_int(kwargs.get("max_length_k")),
            out=out,
            **common,
        )
        return out[None], None

    if attention_mask is not None and not _mask_matches(
        attention_mask, seqlen_q, seqlen_k, causal, window
    ):
        raise ValueError(
            "fa_rs (flash_attention_rs) handles causal, sliding-window and full attention only: this attention "
            "mask has padding or a custom pattern (use batches without padding, or another "
            "attn_implementation)"
        )
    if _restarts(kwargs.get("position_ids"), seqlen_q):
        raise ValueError(
            "fa_rs (flash_attention_rs): position_ids restart inside a row (packed sequences); pass "
            "cu_seq_lens_q/cu_seq_lens_k, or unpack the batch"
        )
    q, k, v = (x.swapaxes(1, 2) for x in (query, key, value))
    batch, _, heads_q, _ = q.shape
    if _autograd(query, key, value):
        # Training (or torch.compile): a new, contiguous output inside the autograd graph.
        return attention(q, k, v, **common), None
    out = _empty(query, (batch, seqlen_q, heads_q, value.shape[-1]), is_torch)
    attention(q, k, v, out=out, **common)
    return out, None


def _autograd(*xs):
    """Whether this call goes through the autograd operator: torch tensors, and grad recorded
    for one of them or torch.compile tracing (``out=`` is then not used: the operator returns
    a new contiguous tensor)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(xs[0], torch.Tensor):
        return False
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        return True
    return _compiling(torch)


def _empty(like, shape, is_torch):
    """A dense output of ``shape`` in ``like``'s framework, dtype and device."""
    if is_torch:
        return sys.modules["torch"].empty(shape, dtype=like.dtype, device=like.device)
    return np.empty(shape, dtype=like.dtype)


def _maybe_int(x):
    # operator.index: an integer (or 0-d integer tensor) only, never a truncated float.
    return None if x is None else operator.index(x)


def _restarts(position_ids, seqlen_q):
    """Whether ``position_ids`` (batch, seqlen) go anywhere but up by one: several sequences
    packed into one row, which a causal mask over the row would let see each other."""
    # Only plain (batch, seqlen) positions: multimodal rotary positions (3, batch, seqlen)
    # legitimately repeat.
    if position_ids is None or seqlen_q <= 1 or tuple(position_ids.shape[1:]) != (seqlen_q,):
        return False
    steps = position_ids[..., 1:] - position_ids[..., :-1]
    restarts = (steps != 1).any()
    torch = sys.modules.get("torch")
    if _compiling(torch) and hasattr(torch, "_assert_async"):
        # Inside a torch.compile trace, reading the answer on the host would break the graph:
        # the check runs when the graph does (a RuntimeError with this message).
        torch._assert_async(
            torch.logical_not(restarts),
            "fa_rs (flash_attention_rs): position_ids restart inside a row (packed sequences); "
            "pass cu_seq_lens_q/cu_seq_lens_k, or unpack the batch",
        )
        return False
    return bool(restarts)


def _compiling(torch):
    """Whether torch.compile (dynamo) is tracing this call."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())
