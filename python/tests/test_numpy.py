"""The NumPy / CPU path against the float64 oracle: dtypes, odd shapes, GQA, masks, softcap,
scale, LSE, strided (BHSD, sliced) views, varlen, caller outputs; and bad inputs, which must
raise the right exception with the library's message and leave outputs untouched."""

import zlib

import numpy as np
import pytest

import flash_attention_rs as fa
from reference import BF16, BOUNDS, attention_f64, normwise_error, varlen_f64

DTYPES = [np.dtype(np.float32), np.dtype(np.float16)] + ([BF16] if BF16 is not None else [])


def test_bfloat16_is_available_for_these_tests():
    # A missing ml_dtypes would silently drop every bf16 case below: say it loudly instead.
    if BF16 is None:
        pytest.skip("ml_dtypes is not installed: NumPy bfloat16 cases are NOT run")


def randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def check(got, ref, dtype, what=""):
    err = normwise_error(got, ref)
    bound = BOUNDS[np.dtype(dtype).name]
    assert np.all(np.isfinite(np.asarray(got, dtype=np.float64))), f"non-finite output {what}"
    assert err <= bound, f"normwise error {err:.3e} > {bound:.0e} {what}"
    return err


SHAPES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim
    (1, 1, 1, 1, 1, 8),
    (2, 17, 33, 4, 2, 40),
    (1, 33, 17, 6, 1, 64),
    (3, 64, 64, 2, 2, 128),
    (1, 5, 129, 8, 4, 72),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_f64_reference(dtype, shape, causal):
    b, sq, sk, hq, hk, d = shape
    rng = np.random.default_rng(zlib.crc32(repr((dtype.name, shape, causal)).encode()))
    q, k, v = randn(rng, (b, sq, hq, d), dtype), randn(rng, (b, sk, hk, d), dtype), randn(rng, (b, sk, hk, d), dtype)
    out = np.full((b, sq, hq, d), np.nan, dtype=dtype)  # poisoned: every element must be written
    got, lse = fa.attention(q, k, v, causal=causal, return_lse=True, out=out)
    assert got is out
    ref, ref_lse = attention_f64(q, k, v, causal=causal)
    check(got, ref, dtype)
    # LSE: absolute error (it is a log); rows with no visible key are -inf in both.
    assert lse.shape == (b, hq, sq) and lse.dtype == np.float32
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert np.all(lse[~finite] == -np.inf)
    lse_bound = 1e-5 if dtype == np.float32 else 2e-2
    assert np.max(np.abs(lse[finite] - ref_lse[finite]), initial=0.0) <= lse_bound


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_window_softcap_scale(dtype):
    rng = np.random.default_rng(7)
    q, k, v = randn(rng, (2, 23, 4, 32), dtype), randn(rng, (2, 31, 2, 32), dtype), randn(rng, (2, 31, 2, 32), dtype)
    for kw in [
        dict(window=(5, 3)),
        dict(window=(4, -1), causal=True),
        dict(softcap=2.5),
        dict(scale=0.37),
        dict(scale=-0.2, softcap=1.5, causal=True),
    ]:
        got = fa.attention(q, k, v, **kw)
        ref, _ = attention_f64(q, k, v, **kw)
        check(got, ref, dtype, str(kw))


def test_rows_without_keys_give_zero_and_minus_inf():
    rng = np.random.default_rng(3)
    q, k, v = randn(rng, (1, 9, 2, 16), np.float32), randn(rng, (1, 4, 2, 16), np.float32), randn(rng, (1, 4, 2, 16), np.float32)
    out, lse = fa.attention(q, k, v, causal=True, return_lse=True)
    # Bottom-right: query i sees keys j <= i + 4 - 9, so the first five rows see none.
    assert np.all(out[:, :5] == 0.0)
    assert np.all(lse[:, :, :5] == -np.inf)
    ref, _ = attention_f64(q, k, v, causal=True)
    check(out, ref, np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_bhsd_and_sliced_views_need_no_copy(dtype):
    rng = np.random.default_rng(11)
    # BHSD storage, passed as its BSHD view (strides travel).
    qh, kh, vh = randn(rng, (2, 4, 19, 48), dtype), randn(rng, (2, 2, 21, 48), dtype), randn(rng, (2, 2, 21, 48), dtype)
    q, k, v = (x.swapaxes(1, 2) for x in (qh, kh, vh))
    assert not q.flags.c_contiguous
    got = fa.attention(q, k, v, causal=True)
    ref, _ = attention_f64(q, k, v, causal=True)
    check(got, ref, dtype, "bhsd")
    # The output takes q's layout (BHSD storage too).
    assert got.strides == q.strides
    # A packed QKV buffer (batch, seq, 3, heads, dim): views with a gap between tokens.
    qkv = randn(rng, (2, 13, 3, 4, 32), dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    got = fa.attention(q, k, v)
    ref, _ = attention_f64(q, k, v)
    check(got, ref, dtype, "packed qkv")
    # Every other head of a wider tensor.
    wide = randn(rng, (1, 9, 8, 16), dtype)
    got = fa.attention(wide[:, :, ::2], wide[:, :, 1::4], wide[:, :, 1::4])
    ref, _ = attention_f64(wide[:, :, ::2], wide[:, :, 1::4], wide[:, :, 1::4])
    check(got, ref, dtype, "strided heads")


def test_f32_output_of_low_precision_inputs_and_head_dim_v():
    rng = np.random.default_rng(5)
    q, k, v = randn(rng, (2, 7, 2, 16), np.float16), randn(rng, (2, 9, 1, 16), np.float16), randn(rng, (2, 9, 1, 24), np.float16)
    out = np.full((2, 7, 2, 24), np.nan, dtype=np.float32)
    got = fa.attention(q, k, v, out=out)
    assert got is out
    ref, _ = attention_f64(q, k, v)
    # f32 output: only the f16 inputs' rounding of P·V remains.
    check(got, ref, np.float16)
    got = fa.attention(q, k, v)
    assert got.shape == (2, 7, 2, 24) and got.dtype == np.float16
    check(got, ref, np.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_matches_per_sequence_reference(dtype, causal):
    rng = np.random.default_rng(13)
    lens_q, lens_k = [3, 17, 1, 40], [5, 17, 9, 33]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)])  # int64: converted
    q, k, v = randn(rng, (cu_q[-1], 4, 64), dtype), randn(rng, (cu_k[-1], 2, 64), dtype), randn(rng, (cu_k[-1], 2, 64), dtype)
    out = np.full(q.shape, np.nan, dtype=dtype)
    got, lse = fa.attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=list(cu_k), return_lse=True, out=out)
    ref, ref_lse = varlen_f64(q, k, v, cu_q, cu_k, causal=causal)
    check(got, ref, dtype)
    assert lse.shape == (4, cu_q[-1])
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert np.max(np.abs(lse[finite] - ref_lse[finite])) <= (1e-5 if dtype == np.float32 else 2e-2)


# ---------------------------------------------------------------------------------------------
# Bad inputs: the right exception, the library's words, outputs untouched.

def qkv32(rng=None, b=1, sq=5, sk=6, hq=4, hk=2, d=16):
    rng = rng or np.random.default_rng(0)
    return randn(rng, (b, sq, hq, d), np.float32), randn(rng, (b, sk, hk, d), np.float32), randn(rng, (b, sk, hk, d), np.float32)


def raises(exc, match, fn):
    with pytest.raises(exc, match=match) as info:
        fn()
    return str(info.value)


def test_wrong_rank():
    q, k, v = qkv32()
    raises(ValueError, r"q has shape \(5, 4, 16\): expected 4 dimensions", lambda: fa.attention(q[0], k, v))
    raises(ValueError, r"expected 3 dimensions \(total_tokens", lambda: fa.attention(q, k, v, cu_seqlens_q=[0, 5], cu_seqlens_k=[0, 6]))


def test_mismatched_heads_batch_and_dims():
    q, k, v = qkv32(hq=3, hk=2)
    raises(ValueError, r"heads_q = 3 is not a multiple of heads_kv = 2", lambda: fa.attention(q, k, v))
    q, k, v = qkv32()
    raises(ValueError, r"k .* and v .* differ", lambda: fa.attention(q, k, v[:, :, :1]))
    raises(ValueError, r"q has batch 1 but k has batch 2", lambda: fa.attention(q, np.concatenate([k, k]), np.concatenate([v, v])))
    raises(ValueError, r"head_dim 16 but k has head_dim 8", lambda: fa.attention(q, k[..., :8].copy(), v))


def test_non_contiguous_last_dim():
    rng = np.random.default_rng(1)
    q = randn(rng, (1, 5, 4, 32), np.float32)[..., ::2]
    _, k, v = qkv32()
    raises(ValueError, r"last dimension \(head_dim\) must be contiguous", lambda: fa.attention(q, k, v))
    # A broadcast head_dim (stride 0) would let the library read past the array.
    flat = np.broadcast_to(randn(rng, (1, 5, 4, 1), np.float32), (1, 5, 4, 16))
    raises(ValueError, r"last dimension \(head_dim\) must be contiguous", lambda: fa.attention(flat, k, v))
    raises(ValueError, r"negative strides", lambda: fa.attention(q[:, ::-1, :, :].copy()[:, ::-1], k, v))


def test_wrong_dtypes():
    q, k, v = qkv32()
    raises(ValueError, r"q has dtype float64", lambda: fa.attention(q.astype(np.float64), k, v))
    raises(ValueError, r"k has dtype int32", lambda: fa.attention(q, k.astype(np.int32), v))
    # Mixed input dtypes: the library's rule.
    raises(ValueError, r"share one dtype", lambda: fa.attention(q, k.astype(np.float16), v))
    raises(TypeError, r"NumPy array or a torch.Tensor", lambda: fa.attention(q.tolist(), k, v))


def test_cuda_without_a_gpu_is_a_runtime_error_with_the_librarys_message():
    q, k, v = qkv32()
    try:
        fa.cuda_device(0)
    except RuntimeError as e:
        message = str(e)
        assert message, "the library's message"
        got = raises(RuntimeError, None, lambda: fa.attention(q, k, v, backend="cuda"))
        assert got == message
        print(f"backend='cuda' here: RuntimeError({got!r})")
    else:
        # A GPU is usable: host arrays are still refused for the CUDA backend.
        raises(ValueError, r"needs CUDA tensors", lambda: fa.attention(q, k, v, backend="cuda"))
    raises(ValueError, r"backend is 'gpu'", lambda: fa.attention(q, k, v, backend="gpu"))


def test_errors_leave_the_output_untouched():
    q, k, v = qkv32()
    out = np.full(q.shape, 7.0, dtype=np.float32)
    raises(ValueError, r"softcap|cap", lambda: fa.attention(q, k, v, softcap=-1.0, out=out))
    raises(ValueError, r"scale", lambda: fa.attention(q, k, v, scale=float("nan"), out=out))
    raises(ValueError, r"scale=0.0", lambda: fa.attention(q, k, v, scale=0.0, out=out))
    raises(ValueError, r"out has dims", lambda: fa.attention(q, k, v, out=np.zeros((1, 5, 4, 8), np.float32)))
    assert np.all(out == 7.0)


def test_bad_outputs():
    q, k, v = qkv32()
    raises(ValueError, r"overlap", lambda: fa.attention(q, k, v, out=q))
    ro = np.zeros(q.shape, np.float32)
    ro.flags.writeable = False
    raises(ValueError, r"read-only", lambda: fa.attention(q, k, v, out=ro))
    # An output whose elements alias each other (a broadcast view).
    alias = np.broadcast_to(np.zeros((1, 1, 4, 16), np.float32), q.shape)
    raises(ValueError, r"read-only|stride", lambda: fa.attention(q, k, v, out=alias))


def test_bad_prefix_sums():
    rng = np.random.default_rng(2)
    q, k, v = randn(rng, (10, 2, 16), np.float32), randn(rng, (12, 2, 16), np.float32), randn(rng, (12, 2, 16), np.float32)
    raises(ValueError, r"both cu_seqlens_q and cu_seqlens_k", lambda: fa.attention(q, k, v, cu_seqlens_q=[0, 10]))
    raises(ValueError, r"cu_seqlens_q ends at 9 but q holds 10", lambda: fa.attention(q, k, v, cu_seqlens_q=[0, 9], cu_seqlens_k=[0, 12]))
    raises(ValueError, r"2 entries but cu_seqlens_k has 3", lambda: fa.attention(q, k, v, cu_seqlens_q=[0, 10], cu_seqlens_k=[0, 6, 12]))
    # Decreasing prefix sums: the library's validation.
    raises(ValueError, r"cu_seqlens", lambda: fa.attention(q, k, v, cu_seqlens_q=[0, 7, 3, 10], cu_seqlens_k=[0, 4, 8, 12]))
    raises(TypeError, r"integer", lambda: fa.attention(q, k, v, cu_seqlens_q=[0.0, 10.0], cu_seqlens_k=[0, 12]))


def test_the_cpu_call_releases_the_gil_and_is_reentrant():
    import threading
    import time

    rng = np.random.default_rng(9)
    shape = (1, 512, 8, 128)
    q, k, v = (randn(rng, shape, np.float32) for _ in range(3))
    ticks = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    try:
        time.sleep(0.05)
        before = ticks[0]
        start = time.perf_counter()
        out = fa.attention(q, k, v, causal=True)
        seconds = time.perf_counter() - start
        during = ticks[0] - before
    finally:
        stop.set()
        counter.join()
    # Holding the GIL for the whole call would leave the counter (nearly) still.
    print(f"call {seconds * 1e3:.1f} ms, counter advanced {during} times meanwhile")
    assert during > 1000, f"the counter advanced only {during} times in {seconds:.3f} s"
    ref, _ = attention_f64(q, k, v, causal=True)
    check(out, ref, np.float32)

    # Two threads calling at once both get correct results.
    small = [randn(rng, (2, 64, 4, 64), np.float32) for _ in range(3)]
    ref, _ = attention_f64(*small, causal=True)
    results = [None, None]

    def work(i):
        results[i] = fa.attention(*small, causal=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        check(r, ref, np.float32)


def _sinks(rng, heads):
    return (rng.standard_normal(heads) * 2.0).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_sinks_match_the_f64_reference(dtype):
    rng = np.random.default_rng(53)
    q, k, v = randn(rng, (2, 19, 6, 24), dtype), randn(rng, (2, 11, 2, 24), dtype), randn(rng, (2, 11, 2, 24), dtype)
    sinks = _sinks(rng, 6)
    for kw in [dict(), dict(causal=True), dict(window=(3, 1), softcap=2.0, scale=0.3)]:
        got, lse = fa.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
        ref, ref_lse = attention_f64(q, k, v, sinks=sinks, **kw)
        check(got, ref, dtype, str(kw))
        # With sinks every row's LSE is finite: rows without keys get their head's sink.
        assert np.all(np.isfinite(lse))
        bound = 1e-5 if dtype == np.float32 else 2e-2
        assert np.max(np.abs(lse - ref_lse)) <= bound, kw
    # Rows without keys (causal, more queries than keys): zero output, LSE = the sink.
    out, lse = fa.attention(q, k, v, sinks=list(sinks), causal=True, return_lse=True)
    assert np.all(np.asarray(out[:, :8], dtype=np.float32) == 0.0)
    np.testing.assert_allclose(lse[:, :, :8], np.broadcast_to(sinks[None, :, None], (2, 6, 8)), atol=1e-6)


def test_sinks_varlen_and_bad_sinks():
    rng = np.random.default_rng(54)
    cu_q, cu_k = [0, 5, 5, 17], [0, 7, 12, 12]
    q, k, v = randn(rng, (17, 4, 16), np.float32), randn(rng, (12, 2, 16), np.float32), randn(rng, (12, 2, 16), np.float32)
    sinks = _sinks(rng, 4)
    got, lse = fa.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=sinks, causal=True, return_lse=True)
    ref, ref_lse = varlen_f64(q, k, v, cu_q, cu_k, causal=True, sinks=sinks)
    check(got, ref, np.float32)
    assert np.max(np.abs(lse - ref_lse)) <= 1e-5
    out = np.full((17, 4, 16), 7.0, dtype=np.float32)
    for bad, message in [
        (np.zeros(3, np.float32), "sinks has shape"),
        (np.array([0.0, np.nan, 0.0, 0.0], np.float32), "sinks[1]"),
        (np.array([0.0, 0.0, np.inf, 0.0], np.float32), "sinks[2]"),
        (np.zeros((2, 2), np.float32), "sinks has shape"),
    ]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            fa.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=bad, out=out)
        assert np.all(out == 7.0)


def test_sinks_gradient_through_the_native_backward():
    """``_native.backward(..., sinks=, d_sinks=)``: d sinks against central differences of the
    float64 oracle (GQA, causal with rows that see no key), and dq/dk/dv against those of the
    oracle too (one element each)."""
    from flash_attention_rs import _native

    rng = np.random.default_rng(55)
    b, sq, sk, hq, hk, d = 1, 9, 6, 4, 2, 8
    q, k, v = randn(rng, (b, sq, hq, d), np.float32), randn(rng, (b, sk, hk, d), np.float32), randn(rng, (b, sk, hk, d), np.float32)
    sinks = _sinks(rng, hq)
    d_o = randn(rng, (b, sq, hq, d), np.float32)
    out, lse = fa.attention(q, k, v, sinks=sinks, causal=True, return_lse=True)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    d_sinks = np.full(hq, np.nan, dtype=np.float32)
    desc = lambda x: fa._describe(x, "x")[0]
    _native.backward(*(desc(x) for x in (q, k, v, out, lse, d_o, dq, dk, dv)), causal=True,
                     sinks=desc(sinks), d_sinks=desc(d_sinks))

    def loss(q=q, k=k, v=v, sinks=sinks):
        o, _ = attention_f64(q, k, v, causal=True, sinks=sinks)
        return float(np.sum(o * d_o.astype(np.float64)))

    h = 1e-6
    for i in range(hq):
        up, down = sinks.astype(np.float64), sinks.astype(np.float64)
        up[i] += h
        down[i] -= h
        fd = (loss(sinks=up) - loss(sinks=down)) / (2 * h)
        assert abs(d_sinks[i] - fd) <= 1e-4 * (1 + abs(fd)), (i, d_sinks[i], fd)
    for grad, x, name, at in [(dq, q, "q", (0, 7, 1, 3)), (dk, k, "k", (0, 4, 1, 3)), (dv, v, "v", (0, 4, 1, 3))]:
        up, down = x.astype(np.float64), x.astype(np.float64)
        up[at] += h
        down[at] -= h
        fd = (loss(**{name: up}) - loss(**{name: down})) / (2 * h)
        assert abs(grad[at] - fd) <= 1e-4 * (1 + abs(fd)), (name, grad[at], fd)
    # d_sinks without sinks: refused, nothing written.
    d_sinks[:] = 7.0
    with pytest.raises(ValueError, match="no attention sinks"):
        _native.backward(*(desc(x) for x in (q, k, v, out, lse, d_o, dq, dk, dv)), causal=True,
                         d_sinks=desc(d_sinks))
    assert np.all(d_sinks == 7.0)
