"""The transformers hook (flash_attention_rs.transformers.attention_forward) with a stand-in
module object, on NumPy arrays (no torch needed) and, where torch is installed, on torch CPU
tensors: BHSD in, BSHD out, GQA, causal prefill, decode against a cache, sliding windows,
and refusals of what it cannot do."""

import types

import numpy as np
import pytest

from flash_attention_rs import transformers as hook
from reference import attention_f64, normwise_error

try:
    import torch
except ImportError:  # pragma: no cover - depends on the environment
    torch = None


def module(is_causal=True, training=False):
    return types.SimpleNamespace(is_causal=is_causal, training=training)


def bhsd(rng, b, h, s, d):
    return rng.standard_normal((b, h, s, d)).astype(np.float32)


def reference(q, k, v, **kw):
    ref, _ = attention_f64(*(x.swapaxes(1, 2) for x in (q, k, v)), **kw)
    return ref


def frameworks():
    out = ["numpy"]
    if torch is not None:
        out.append("torch")
    return out


def convert(fw, *xs):
    return xs if fw == "numpy" else tuple(torch.from_numpy(x) for x in xs)


def to_numpy(x):
    return x.numpy() if torch is not None and isinstance(x, torch.Tensor) else x


def test_torch_cases_run_where_torch_is_installed():
    if torch is None:
        pytest.skip("torch is not installed: the hook is tested on NumPy arrays only here")


@pytest.mark.parametrize("fw", frameworks())
def test_prefill_gqa_causal(fw):
    rng = np.random.default_rng(1)
    q, k, v = bhsd(rng, 2, 8, 13, 32), bhsd(rng, 2, 2, 13, 32), bhsd(rng, 2, 2, 13, 32)
    out, weights = hook.attention_forward(module(), *convert(fw, q, k, v), None, scaling=0.2)
    assert weights is None
    out = to_numpy(out)
    assert out.shape == (2, 13, 8, 32) and out.flags.c_contiguous
    assert normwise_error(out, reference(q, k, v, causal=True, scale=0.2)) <= 1e-5
    # A non-causal module (an encoder): full attention.
    out, _ = hook.attention_forward(module(is_causal=False), *convert(fw, q, k, v), None)
    assert normwise_error(to_numpy(out), reference(q, k, v)) <= 1e-5
    # is_causal in the keyword arguments wins over the module's.
    out, _ = hook.attention_forward(module(is_causal=True), *convert(fw, q, k, v), None, is_causal=False)
    assert normwise_error(to_numpy(out), reference(q, k, v)) <= 1e-5


@pytest.mark.parametrize("fw", frameworks())
def test_decode_one_query_against_a_cache(fw):
    rng = np.random.default_rng(2)
    q, k, v = bhsd(rng, 1, 4, 1, 64), bhsd(rng, 1, 1, 37, 64), bhsd(rng, 1, 1, 37, 64)
    out, _ = hook.attention_forward(module(), *convert(fw, q, k, v), None)
    # Bottom-right causal: the one new query sees the whole cache.
    assert normwise_error(to_numpy(out), reference(q, k, v)) <= 1e-5
    # A few new queries at the end of a longer cache (chunked prefill / speculative decode).
    q3 = bhsd(rng, 1, 4, 3, 64)
    out, _ = hook.attention_forward(module(), *convert(fw, q3, k, v), None)
    assert normwise_error(to_numpy(out), reference(q3, k, v, causal=True)) <= 1e-5


@pytest.mark.parametrize("fw", frameworks())
def test_sliding_window_and_softcap(fw):
    rng = np.random.default_rng(3)
    q, k, v = bhsd(rng, 1, 2, 20, 16), bhsd(rng, 1, 2, 20, 16), bhsd(rng, 1, 2, 20, 16)
    out, _ = hook.attention_forward(module(), *convert(fw, q, k, v), None, sliding_window=4, softcap=3.0)
    # transformers' window of 4: query i sees keys i-3..i.
    ref = reference(q, k, v, causal=True, window=(3, -1), softcap=3.0)
    assert normwise_error(to_numpy(out), ref) <= 1e-5


@pytest.mark.parametrize("fw", frameworks())
def test_masks_that_say_nothing_more_are_accepted(fw):
    rng = np.random.default_rng(4)
    q, k, v = bhsd(rng, 2, 2, 6, 16), bhsd(rng, 2, 2, 6, 16), bhsd(rng, 2, 2, 6, 16)
    ref = reference(q, k, v, causal=True)
    causal_bool = np.tril(np.ones((6, 6), dtype=bool))[None, None].repeat(2, axis=0)
    additive = np.where(causal_bool, 0.0, np.finfo(np.float32).min).astype(np.float32)
    padding_free = np.ones((2, 6), dtype=np.int64)
    for mask in (causal_bool, additive, padding_free):
        (m,) = convert(fw, mask)
        out, _ = hook.attention_forward(module(), *convert(fw, q, k, v), m)
        assert normwise_error(to_numpy(out), ref) <= 1e-5


@pytest.mark.parametrize("fw", frameworks())
def test_padding_and_custom_masks_are_refused(fw):
    rng = np.random.default_rng(5)
    q, k, v = bhsd(rng, 2, 2, 6, 16), bhsd(rng, 2, 2, 6, 16), bhsd(rng, 2, 2, 6, 16)
    padded = np.ones((2, 6), dtype=np.int64)
    padded[1, :2] = 0  # left padding in the second sequence
    custom = np.ones((2, 1, 6, 6), dtype=bool)  # full attention where the module is causal
    for mask in (padded, custom):
        (m,) = convert(fw, mask)
        with pytest.raises(ValueError, match="padding or a custom pattern"):
            hook.attention_forward(module(), *convert(fw, q, k, v), m)
    with pytest.raises(ValueError, match="dropout"):
        hook.attention_forward(module(training=True), *convert(fw, q, k, v), None, dropout=0.1)
    # Dropout outside training is ignored, as transformers' own backends do.
    hook.attention_forward(module(training=False), *convert(fw, q, k, v), None, dropout=0.1)


@pytest.mark.parametrize("fw", frameworks())
def test_packed_sequences_from_cu_seq_lens(fw):
    rng = np.random.default_rng(6)
    cu = np.array([0, 5, 17, 20], dtype=np.int32)
    q, k, v = bhsd(rng, 1, 4, 20, 16), bhsd(rng, 1, 2, 20, 16), bhsd(rng, 1, 2, 20, 16)
    q_, k_, v_, cu_ = convert(fw, q, k, v, cu)
    out, _ = hook.attention_forward(
        module(), q_, k_, v_, None, cu_seq_lens_q=cu_, cu_seq_lens_k=cu_, max_length_q=12, max_length_k=12
    )
    out = to_numpy(out)
    assert out.shape == (1, 20, 4, 16)
    for a, b in zip(cu[:-1], cu[1:]):
        ref = reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True)
        assert normwise_error(out[:, a:b], ref) <= 1e-5
    # The same packing told only by restarting position_ids: refused, not silently mixed.
    positions = np.concatenate([np.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]
    (p_,) = convert(fw, positions)
    with pytest.raises(ValueError, match="position_ids restart"):
        hook.attention_forward(module(), q_, k_, v_, None, position_ids=p_)
    (p_,) = convert(fw, np.arange(20)[None])
    out, _ = hook.attention_forward(module(), q_, k_, v_, None, position_ids=p_)
    assert normwise_error(to_numpy(out), reference(q, k, v, causal=True)) <= 1e-5


def test_register_needs_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            hook.register()
        pytest.skip("transformers is not installed: register() is tested where it is (test_transformers_model.py)")
    assert hook.register() == "fa_rs"
    from transformers import AttentionInterface

    assert AttentionInterface()["fa_rs"] is hook.attention_forward
    with pytest.raises(ValueError, match="containing 'flash'"):
        hook.register("flash_rs")
