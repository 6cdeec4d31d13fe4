"""A transformers attention backend: ``register()`` then ``attn_implementation="flash_rs"``.

``register()`` adds :func:`attention_forward` to transformers' ``AttentionInterface`` (and
FlashAttention-2's mask function to ``AttentionMaskInterface`` under the same name, so that
models pass no mask when there is no padding). The function takes what transformers gives an
attention backend: BHSD ``(batch, heads, seqlen, head_dim)`` query/key/value, the module (for
``is_causal``), the mask, ``scaling``, ``dropout``, ``sliding_window`` and ``softcap``, and
returns ``(attn_output, None)`` with ``attn_output`` BSHD ``(batch, seqlen_q, heads, head_dim)``.

Handled: GQA/MQA (fewer key/value heads), causal prefill, decode against a KV cache (causal
is bottom-right aligned: the new queries sit at the end of the keys), sliding windows, softcap.
Refused with ``ValueError``: masks other than "no mask" or the plain causal / sliding-window
pattern (padding masks, custom masks), and dropout while training.
"""

from __future__ import annotations

import sys

import numpy as np

from . import attention

__all__ = ["register", "attention_forward", "NAME"]

#: The ``attn_implementation`` name that :func:`register` uses by default.
NAME = "flash_rs"


def register(name=NAME):
    """Registers :func:`attention_forward` with transformers as ``name``; returns ``name``."""
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
        raise ValueError("flash_rs does not implement attention dropout (dropout > 0 while training)")
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    causal = bool(causal)
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if sliding_window is not None:
        # transformers' sliding window of w: query i sees keys i - w < j (<= i when causal).
        window = (sliding_window - 1, -1 if causal else sliding_window - 1)
    else:
        window = (-1, -1)
    if attention_mask is not None and not _mask_matches(
        attention_mask, seqlen_q, seqlen_k, causal, window
    ):
        raise ValueError(
            "flash_rs handles causal, sliding-window and full attention only: this attention "
            "mask has padding or a custom pattern (use batches without padding, or another "
            "attn_implementation)"
        )
    q, k, v = (x.swapaxes(1, 2) for x in (query, key, value))
    batch, _, heads_q, _ = q.shape
    out_shape = (batch, seqlen_q, heads_q, value.shape[-1])
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(query, torch.Tensor):
        out = torch.empty(out_shape, dtype=query.dtype, device=query.device)
    else:
        out = np.empty(out_shape, dtype=query.dtype)
    attention(
        q,
        k,
        v,
        causal=causal,
        window=window,
        softcap=softcap or None,
        scale=scaling,
        out=out,
    )
    return out, None
