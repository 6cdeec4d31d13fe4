"""PyTorch tensors, on the CPU (where torch is installed) and on CUDA (where a GPU is), against
torch's SDPA computed in float64 with an explicit bottom-right mask: dtypes, BSHD and BHSD
(strided views, no copy), GQA, causal, decode, varlen (prefix sums on the host and on the
device), PyTorch's current stream (a side stream, ordering and no host synchronisation), and
errors. Skips say loudly when torch or a GPU is missing."""

import zlib

import numpy as np
import pytest

from reference import visible

from torch_common import BOUND, DEVICES, HAS_CUDA, dtypes_for, needs_cuda, torch  # noqa: E402

F = torch.nn.functional

import flash_attention_rs as fa  # noqa: E402


def sdpa_f64(q, k, v, causal=False, window=(-1, -1), scale=None):
    """BSHD tensors -> BSHD float64 output of SDPA on float64 copies (bottom-right mask)."""
    qh, kh, vh = (x.transpose(1, 2).to(torch.float64) for x in (q, k, v))
    mask = torch.from_numpy(visible(q.shape[1], k.shape[1], causal, window)).to(q.device)
    group = q.shape[2] // k.shape[2]
    kh = kh.repeat_interleave(group, dim=1)
    vh = vh.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def lse_f64(q, k, causal=False, window=(-1, -1), scale=None):
    """BSHD q, k -> float64 log-sum-exp (batch, heads_q, seqlen_q) of the masked scores."""
    qh, kh = (x.transpose(1, 2).to(torch.float64) for x in (q, k))
    kh = kh.repeat_interleave(q.shape[2] // k.shape[2], dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = qh @ kh.transpose(-1, -2) * scale
    mask = torch.from_numpy(visible(q.shape[1], k.shape[1], causal, window)).to(q.device)
    return torch.logsumexp(s.masked_fill(~mask, float("-inf")), dim=-1)


def normwise(got, ref):
    got = got.to(torch.float64)
    return (torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref)).item()


def check(got, ref, device, dtype, what=""):
    assert torch.isfinite(got).all(), f"non-finite output {what}"
    err = normwise(got, ref)
    bound = BOUND[(device, dtype)]
    assert err <= bound, f"normwise error {err:.3e} > {bound:.0e} {what}"
    return err


def randn(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


SHAPES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim
    (2, 65, 65, 8, 2, 64),
    (1, 1, 257, 4, 1, 128),  # decode: one query against a cache
    (3, 77, 200, 6, 3, 96),
    (1, 128, 128, 2, 2, 128),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_sdpa_f64(device, shape, layout, causal):
    b, sq, sk, hq, hk, d = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, layout, causal)).encode()))
    for dtype in dtypes_for(device):
        if layout == "bshd":
            q, k, v = randn((b, sq, hq, d), dtype, device, gen), randn((b, sk, hk, d), dtype, device, gen), randn((b, sk, hk, d), dtype, device, gen)
        else:  # BHSD storage, passed as BSHD views: strides travel, nothing is copied
            q, k, v = (randn((b, h, s, d), dtype, device, gen).transpose(1, 2) for h, s in ((hq, sq), (hk, sk), (hk, sk)))
        out = torch.full((b, sq, hq, d), float("nan"), dtype=dtype, device=device)
        got, lse = fa.attention(q, k, v, causal=causal, out=out, return_lse=True)
        assert got is out and lse.shape == (b, hq, sq) and lse.dtype == torch.float32
        if device == "cuda":
            torch.cuda.synchronize()
        ref = sdpa_f64(q, k, v, causal=causal)
        check(got, ref, device, dtype, f"{dtype} {layout}")
        # LSE in f32 from the same rounded inputs: only accumulation error remains.
        lse_err = (lse.double() - lse_f64(q, k, causal=causal)).abs().max().item()
        assert lse_err <= 1e-3, f"LSE max abs error {lse_err:.2e} ({dtype} {layout})"
        # Freshly allocated output: q's framework, device and (for BHSD) layout.
        got = fa.attention(q, k, v, causal=causal)
        assert got.device == q.device and got.dtype == dtype and got.stride() == torch.empty_like(q).stride()
        check(got, ref, device, dtype, f"{dtype} {layout} allocated")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cu_where", ["host", "device"])
def test_varlen(device, cu_where):
    if device == "cpu" and cu_where == "device":
        pytest.skip("device prefix sums are a CUDA feature")
    gen = torch.Generator().manual_seed(5)
    lens_q, lens_k = [3, 64, 1, 100], [5, 64, 90, 100]
    cu_q = torch.tensor([0] + list(np.cumsum(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(lens_k)), dtype=torch.int32)
    if cu_where == "device":
        cu_q, cu_k = cu_q.to(device), cu_k.to(device)
    for dtype in dtypes_for(device):
        q = randn((int(sum(lens_q)), 8, 64), dtype, device, gen)
        k = randn((int(sum(lens_k)), 4, 64), dtype, device, gen)
        v = randn((int(sum(lens_k)), 4, 64), dtype, device, gen)
        for causal in (False, True):
            got = fa.attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
            parts = []
            for i in range(len(lens_q)):
                qs = slice(sum(lens_q[:i]), sum(lens_q[: i + 1]))
                ks = slice(sum(lens_k[:i]), sum(lens_k[: i + 1]))
                parts.append(sdpa_f64(q[None, qs], k[None, ks], v[None, ks], causal=causal)[0])
            check(got, torch.cat(parts), device, dtype, f"varlen {dtype} causal={causal} cu on {cu_where}")


@pytest.mark.parametrize("device", DEVICES)
def test_errors(device):
    gen = torch.Generator().manual_seed(0)
    q = randn((1, 8, 4, 64), torch.bfloat16, device, gen)
    with pytest.raises(ValueError, match="last dimension"):
        fa.attention(q[..., ::2], q[..., ::2], q[..., ::2])
    with pytest.raises(ValueError, match="dtype float64"):
        fa.attention(q.double(), q.double(), q.double())
    with pytest.raises(TypeError, match="must all be NumPy arrays or all torch tensors"):
        fa.attention(q, q.cpu().float().numpy(), q)
    leaf = q.detach().requires_grad_(True)
    out = fa.attention(leaf, q, q)  # the backward on either device (test_autograd.py checks it)
    assert out.requires_grad
    with torch.no_grad():
        assert not fa.attention(leaf, q, q).requires_grad  # fine without autograd
    if device == "cuda":
        with pytest.raises(ValueError, match="bf16 or f16"):
            fa.attention(q.float(), q.float(), q.float())
        with pytest.raises(ValueError, match="multiples of 8"):
            x = randn((1, 8, 4, 60), torch.bfloat16, device, gen)
            fa.attention(x, x, x)
        with pytest.raises(ValueError, match="different places"):
            fa.attention(q, q.cpu(), q)
        with pytest.raises(ValueError, match="backend='cpu'"):
            fa.attention(q, q, q, backend="cpu")
        with pytest.raises(ValueError, match="max_seqlen"):
            cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
            fa.attention(q[0], q[0], q[0], cu_seqlens_q=cu, cu_seqlens_k=cu)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_sized_tensors_as_numpy_arrays(device):
    # The same outcomes as test_arguments.py's NumPy cases: an empty torch tensor has
    # contiguous strides, an empty NumPy array zero ones; both reach the library alike.
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16
    kv = randn((2, 13, 2, 64), dtype, device, gen)
    out, lse = fa.attention(randn((2, 0, 4, 64), dtype, device, gen), kv, kv, causal=True, return_lse=True)
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0) and out.device.type == device
    q = randn((2, 9, 4, 64), dtype, device, gen)
    empty = randn((2, 0, 2, 64), dtype, device, gen)
    out = torch.full_like(q, float("nan"))
    got, lse = fa.attention(q, empty, empty, out=out, return_lse=True)
    assert got is out
    assert torch.equal(out, torch.zeros_like(q))
    assert torch.equal(lse, torch.full((2, 4, 9), float("-inf"), device=device))
    with pytest.raises(ValueError, match=r"^batch must be at least 1$"):
        nothing = randn((0, 9, 4, 64), dtype, device, gen)
        fa.attention(nothing, nothing, nothing)


def test_torch_scalars_as_options():
    # One-number tensors are numbers (softcap, scale, window sides); bool tensors are not.
    gen = torch.Generator().manual_seed(6)
    q, k, v = (randn((1, 9, 2, 32), torch.float32, "cpu", gen) for _ in range(3))
    got = fa.attention(q, k, v, scale=torch.tensor(0.3), window=(torch.tensor(2), -1))
    check(got, sdpa_f64(q, k, v, window=(2, -1), scale=0.3), "cpu", torch.float32, "tensor options")
    with pytest.raises(TypeError, match=r"softcap is tensor\(True\) \(Tensor\): expected a real number or None"):
        fa.attention(q, k, v, softcap=torch.tensor(True))
    with pytest.raises(TypeError, match=r"a side of window is tensor\(True\): expected an integer, not a bool"):
        fa.attention(q, k, v, window=(torch.tensor(True), -1))
    with pytest.raises(TypeError, match=r"a side of window is tensor\(2\.5000\) \(Tensor\): expected an integer"):
        fa.attention(q, k, v, window=(torch.tensor(2.5), -1))


@needs_cuda
def test_device_prefix_sums_of_floats_are_type_errors():
    # The int32 conversion on the device used to truncate them (3.5 -> 3) silently.
    gen = torch.Generator().manual_seed(4)
    q = randn((8, 4, 64), torch.bfloat16, "cuda", gen)
    good = torch.tensor([0, 3, 8], dtype=torch.int32, device="cuda")
    for bad in (good.float() + 0.5, good.bool()):
        with pytest.raises(TypeError, match=r"cu_seqlens_q has dtype torch\.(float32|bool): expected integers"):
            fa.attention(q, q, q, cu_seqlens_q=bad, cu_seqlens_k=good, max_seqlen_q=5, max_seqlen_k=5)
    # int64 prefix sums are integers: taken.
    got = fa.attention(q, q, q, cu_seqlens_q=good.long(), cu_seqlens_k=good, max_seqlen_q=5, max_seqlen_k=5)
    parts = [sdpa_f64(q[None, a:b], q[None, a:b], q[None, a:b])[0] for a, b in ((0, 3), (3, 8))]
    check(got, torch.cat(parts), "cuda", torch.bfloat16, "int64 device prefix sums")


@needs_cuda
def test_runs_on_the_current_stream_without_waiting():
    gen = torch.Generator().manual_seed(9)
    b, s, h, d = 2, 512, 8, 128
    src = [randn((b, s, h, d), torch.bfloat16, "cuda", gen) for _ in range(3)]
    ref = sdpa_f64(*src, causal=True)
    # On the default stream first: compiles/loads the kernel, so that the timed part below
    # does no host work long enough to outlast the GPU's spin.
    out2 = fa.attention(*src, causal=True)
    # Inputs poisoned with other values, overwritten on a side stream behind a long spin:
    # a kernel on any other stream would read the poison.
    q, k, v = (torch.randn_like(x) for x in src)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time on the side stream
        for dst, x in zip((q, k, v), src):
            dst.copy_(x)
        out = fa.attention(q, k, v, causal=True)
        returned_before_done = not side.query()
    side.synchronize()
    assert returned_before_done, "the call waited for the GPU (host synchronisation)"
    check(out, ref, "cuda", torch.bfloat16, "side stream")
    # The default stream's result, for comparison.
    torch.cuda.synchronize()
    assert torch.equal(out, out2), "same inputs, same kernel: bitwise equal results"


@needs_cuda
def test_timing_is_reported():
    # Per-call time of the Python path at hdim 128, 8k (issue 14 compares it with the Rust
    # benchmark's time for the same shape: `fa bench` on the device).
    gen = torch.Generator().manual_seed(1)
    b, s, h, d = 1, 8192, 16, 128
    q, k, v = (randn((b, s, h, d), torch.bfloat16, "cuda", gen) for _ in range(3))
    out = torch.empty_like(q)
    for _ in range(3):
        fa.attention(q, k, v, causal=True, out=out)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = 20
    start.record()
    for _ in range(iters):
        fa.attention(q, k, v, causal=True, out=out)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    flops = 4 * b * h * s * s * d / 2  # causal: half the score matrix
    print(f"\nPython CUDA path, bf16 causal b={b} s={s} h={h} d={d}: {ms:.3f} ms/call, {flops / ms / 1e9:.1f} TFLOP/s")
    assert ms > 0
