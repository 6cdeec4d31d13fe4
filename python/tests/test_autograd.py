"""Autograd through ``flash_attention_rs.attention`` on the CPU and on CUDA: gradients (the
Rust CPU backward and fa-cuda's backward, called through pyo3) against PyTorch's own float64
eager softmax attention on fresh random inputs (odd shapes, GQA/MQA, causal, windows,
softcap, scale, varlen; float32, bfloat16 and float16 on the CPU, bfloat16 and float16 on
CUDA), a finite-difference check, ``torch.compile(fullgraph=True)`` forward + backward with
no graph break, the refusals (KV caches, ``out=``), the CUDA backward on a side stream, and a
tiny Llama training step through the transformers hook against SDPA (CPU float32; CUDA
bfloat16). Skips loudly without torch; the CUDA tests skip without a GPU.

Tolerances (normwise, ||got - ref||_F / ||ref||_F): float32 1e-5 for out and every gradient
(measured ~4e-7); bfloat16 / float16 inputs 3e-2 (the gradients are rounded to the input
dtype, and the reference sees the same rounded inputs), on the CPU and on CUDA. The CUDA
bfloat16 training step: every parameter's gradient, measured against a float32 SDPA run of
the same model, is within 2x SDPA bfloat16's own error + 1e-2 (and under 0.1), the loss
within 2e-2 of SDPA bfloat16's.
"""

import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: autograd tests NOT run")

import flash_attention_rs as fa  # noqa: E402
from flash_attention_rs import _native  # noqa: E402

HAS_OPS = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_autograd")
pytestmark = pytest.mark.skipif(
    not HAS_OPS, reason=f"torch {torch.__version__} has no torch.library.custom_op: autograd NOT tested"
)

BOUND = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-2}


def reference(q, k, v, causal=False, window=(-1, -1), softcap=None, scale=None):
    """PyTorch float64 eager attention on BSHD tensors (autograd-able): bottom-right aligned
    causal/window masks, softcap on the scaled scores, GQA by head groups."""
    qd, kd, vd = (x.transpose(1, 2) for x in (q, k, v))  # BHSD
    group = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    scale = qd.shape[-1] ** -0.5 if scale is None else scale
    s = qd @ kd.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = s.shape[-2:]
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    left, right = window
    if causal:
        right = 0
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row that sees no key: 0
    return (p @ vd).transpose(1, 2)


def relative(a, b):
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den else (a - b).norm().item()


def leaves(gen, shapes, dtype):
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in shapes]


def grads_of(fn, inputs, d_out):
    out = fn(*inputs)
    out.backward(d_out)
    return out.detach(), [x.grad.detach().clone() for x in inputs]


def check_against_reference(q, k, v, d_out, dtype, label, **kw):
    out, (dq, dk, dv) = grads_of(lambda a, b, c: fa.attention(a, b, c, **kw), (q, k, v), d_out)
    assert out.dtype == dtype and dq.dtype == dtype and dk.dtype == dtype and dv.dtype == dtype
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    ref_in = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref_out, ref_grads = grads_of(lambda a, b, c: reference(a, b, c, **kw), ref_in, d_out.double())
    bound = BOUND[dtype]
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref_out, *ref_grads)):
        err = relative(got, want)
        assert err <= bound, f"{label}: {name} normwise error {err:.2e} > {bound:.0e}"


CASES = [
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, options)
    (2, 37, 41, 4, 2, 24, 24, dict(causal=True)),  # GQA, causal, odd lengths
    (1, 1, 1, 1, 1, 8, 8, {}),
    (2, 19, 19, 6, 1, 40, 40, dict()),  # MQA
    (1, 50, 33, 2, 2, 16, 16, dict(causal=True)),  # more queries than keys: empty rows
    (1, 45, 45, 4, 2, 32, 32, dict(window=(7, 3))),
    (2, 23, 29, 4, 4, 20, 20, dict(causal=True, window=(5, -1), softcap=3.0)),
    (1, 31, 31, 2, 1, 64, 64, dict(softcap=1.5, scale=0.3)),
    (1, 17, 21, 4, 2, 12, 28, dict(causal=True)),  # head_dim_v != head_dim
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gradients_match_float64_eager(case, dtype):
    b, sq, sk, hq, hkv, d, dv, kw = CASES[case]
    gen = torch.Generator().manual_seed(1000 + case)
    q, k, v = leaves(gen, [(b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv)], dtype)
    d_out = torch.randn((b, sq, hq, dv), generator=gen).to(dtype)
    check_against_reference(q, k, v, d_out, dtype, f"case {case} {dtype} {kw}", **kw)


def test_strided_bhsd_views_and_a_partial_requires_grad():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn((2, 4, 13, 16), generator=gen).requires_grad_(True)  # BHSD leaves
    k = torch.randn((2, 2, 15, 16), generator=gen)  # no grad
    v = torch.randn((2, 2, 15, 16), generator=gen).requires_grad_(True)
    out = fa.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    d_out = torch.randn(out.shape, generator=gen)
    # A non-contiguous gradient reaches the backward too.
    (out * d_out.transpose(1, 2).contiguous().transpose(1, 2)).sum().backward()
    qd, vd = (x.detach().double().requires_grad_(True) for x in (q, v))
    ref = reference(qd.transpose(1, 2), k.double().transpose(1, 2), vd.transpose(1, 2), causal=True)
    (ref * d_out.double()).sum().backward()
    assert k.grad is None
    assert relative(q.grad, qd.grad) < 1e-5 and relative(v.grad, vd.grad) < 1e-5


def test_varlen_gradients():
    gen = torch.Generator().manual_seed(11)
    lens_q, lens_k = [5, 1, 12], [7, 4, 12]
    hq, hkv, d = 4, 2, 16
    q, k, v = leaves(gen, [(sum(lens_q), hq, d), (sum(lens_k), hkv, d), (sum(lens_k), hkv, d)], torch.float32)
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = [0] + list(np.cumsum(lens_k).tolist())  # a list works as well
    d_out = torch.randn((sum(lens_q), hq, d), generator=gen)
    out = fa.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    out.backward(d_out)
    ref_in = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    parts = []
    for i in range(len(lens_q)):
        qs = slice(sum(lens_q[:i]), sum(lens_q[: i + 1]))
        ks = slice(sum(lens_k[:i]), sum(lens_k[: i + 1]))
        parts.append(reference(ref_in[0][None, qs], ref_in[1][None, ks], ref_in[2][None, ks], causal=True)[0])
    ref = torch.cat(parts)
    ref.backward(d_out.double())
    assert relative(out, ref) < 1e-5
    for got, want in zip((q.grad, k.grad, v.grad), ref_in):
        assert relative(got, want.grad) < 1e-5


def test_return_lse_has_no_gradient_and_matches_forward():
    gen = torch.Generator().manual_seed(3)
    q, k, v = leaves(gen, [(1, 9, 2, 8), (1, 9, 2, 8), (1, 9, 2, 8)], torch.float32)
    out, lse = fa.attention(q, k, v, causal=True, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    with torch.no_grad():
        out_nograd, lse_nograd = fa.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out.detach(), out_nograd) and torch.equal(lse, lse_nograd)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_finite_differences_float32():
    # The library takes no float64, so gradcheck runs in float32 with a step and tolerances
    # fitted to float32 (central differences of the exact function).
    gen = torch.Generator().manual_seed(5)
    q, k, v = leaves(gen, [(1, 5, 2, 8), (1, 6, 1, 8), (1, 6, 1, 8)], torch.float32)
    fn = lambda a, b, c: fa.attention(a, b, c, causal=True, softcap=2.0)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not a double precision" inputs
        assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-2, atol=2e-3, rtol=2e-2)


def test_deterministic_gradients():
    gen = torch.Generator().manual_seed(9)
    q, k, v = leaves(gen, [(2, 33, 4, 32), (2, 40, 2, 32), (2, 40, 2, 32)], torch.bfloat16)
    runs = []
    for _ in range(3):
        for x in (q, k, v):
            x.grad = None
        fa.attention(q, k, v, causal=True).float().square().sum().backward()
        runs.append([x.grad.clone() for x in (q, k, v)])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


def _compile_available():
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    return None


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_forward_and_backward(backend):
    why = _compile_available()
    if why:
        pytest.skip(why)
    if backend == "inductor" and not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("inductor needs a C++ compiler on the CPU: none found")
    import torch._dynamo

    torch._dynamo.reset()

    def step(q, k, v):
        out = fa.attention(q, k, v, causal=True, window=(9, -1), softcap=4.0)
        return (out.float() * out.float()).sum()

    gen = torch.Generator().manual_seed(21)
    q, k, v = leaves(gen, [(2, 21, 4, 16), (2, 21, 2, 16), (2, 21, 2, 16)], torch.float32)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    loss = compiled(q, k, v)
    loss.backward()
    got = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    eager = step(q, k, v)
    eager.backward()
    assert torch.equal(loss, eager)
    # The same Rust calls (the op is opaque to the compiler): the same bits.
    assert all(torch.equal(a, x.grad) for a, x in zip(got, (q, k, v)))
    explained = torch._dynamo.explain(step)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_torch_compile_as_the_first_call_of_a_fresh_process(tmp_path):
    # flash_attention_rs imported before torch, and the first call inside a compiled
    # function: the operators are registered on that first call (inside the trace).
    why = _compile_available()
    if why:
        pytest.skip(why)
    script = tmp_path / "first.py"
    script.write_text(
        "import flash_attention_rs as fa\n"
        "import torch\n"
        "q = torch.randn(1, 9, 2, 8, requires_grad=True)\n"
        "f = torch.compile(lambda x: fa.attention(x, x.detach(), x.detach(), causal=True).sum(),"
        " fullgraph=True, backend='aot_eager')\n"
        "f(q).backward()\n"
        "assert torch.isfinite(q.grad).all()\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


def test_refusals_with_grad():
    gen = torch.Generator().manual_seed(0)
    q, k, v = leaves(gen, [(1, 4, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8)], torch.float32)
    with pytest.raises(ValueError, match="no backward through a KV cache"):
        fa.attention(q, k, v, seqused_k=torch.tensor([6], dtype=torch.int32))
    with pytest.raises(ValueError, match="out= writes into a tensor outside the autograd graph"):
        fa.attention(q, k, v, out=torch.empty(1, 4, 2, 8))
    with pytest.raises(ValueError, match="last dimension"):
        fa.attention(q[..., ::2], k[..., ::2], v[..., ::2])
    with pytest.raises(ValueError, match="dtype float64"):
        fa.attention(q.double(), k.double(), v.double())
    with pytest.raises(TypeError, match="must all be NumPy arrays or all torch tensors"):
        fa.attention(q, k.detach().numpy(), v)
    with torch.no_grad():  # inference: the plain path, out= allowed
        out = torch.empty(1, 4, 2, 8)
        assert fa.attention(q, k, v, out=out) is out


def _desc(x):
    return (x.data_ptr(), tuple(x.shape), tuple(x.stride()), str(x.dtype)[len("torch.") :])


def test_native_backward_checks_before_writing():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(s, generator=gen) for s in [(1, 7, 2, 8), (1, 9, 1, 8), (1, 9, 1, 8)])
    out, lse = fa.attention(q, k, v, return_lse=True)
    d_out = torch.randn(out.shape, generator=gen)
    fresh = lambda: [torch.full(x.shape, 7.0) for x in (q, k, v)]  # noqa: E731

    def call(*, grads=None, lse_=lse, d_out_=d_out, **kw):
        dq, dk, dv = grads if grads is not None else fresh()
        _native.backward(*(_desc(x) for x in (q, k, v, out, lse_, d_out_, dq, dk, dv)), **kw)
        return dq, dk, dv

    dq, dk, dv = call()
    assert torch.isfinite(dq).all() and not (dq == 7.0).all()
    bad = [
        (dict(lse_=lse.double()), ValueError, "lse must be float32"),
        (dict(lse_=lse[:, :, :-1]), ValueError, "lse must be float32 of shape"),
        (dict(d_out_=d_out.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "laid out as out"),
        (dict(d_out_=d_out[:, :-1]), ValueError, "d_out has dims"),
        (dict(window=(-2, 0)), ValueError, "window"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(scale=0.0), ValueError, "scale=0.0"),
    ]
    for kw, error, match in bad:
        grads = fresh()
        with pytest.raises(error, match=match):
            call(grads=grads, **kw)
        assert all((g == 7.0).all() for g in grads), kw
    # Overlapping gradients: the facade's overlap check (the C ABI's), nothing written.
    shared = torch.full((2,) + tuple(k.shape), 7.0)
    grads = [torch.full(q.shape, 7.0), shared[0], shared[0]]
    with pytest.raises(ValueError, match="dk and dv overlap"):
        call(grads=grads)
    assert (grads[0] == 7.0).all() and (shared == 7.0).all()
    # A gradient in another dtype than its input's (bf16 grads of f32 inputs): the backend's
    # dtype rule, nothing written.
    grads = [torch.full(x.shape, 7.0, dtype=torch.bfloat16) for x in (q, k, v)]
    with pytest.raises(ValueError, match="gradients in that dtype or f32"):
        call(grads=grads)
    assert all((g == 7.0).all() for g in grads)


CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU: the CUDA backward is NOT tested here")


def cuda_leaves(gen, shapes, dtype):
    return [torch.randn(s, generator=gen).to(dtype).cuda().requires_grad_(True) for s in shapes]


def check_cuda_against_reference(q, k, v, d_out, dtype, label, **kw):
    """fa-cuda's forward + backward on CUDA against the float64 eager reference on the CPU
    (the same rounded inputs); normwise bound BOUND[dtype] (3e-2 for bfloat16/float16)."""
    out, (dq, dk, dv) = grads_of(lambda a, b, c: fa.attention(a, b, c, **kw), (q, k, v), d_out)
    for x, like in ((out, q), (dq, q), (dk, k), (dv, v)):
        assert x.dtype == dtype and x.device == like.device
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    ref_in = [x.detach().cpu().double().requires_grad_(True) for x in (q, k, v)]
    ref_out, ref_grads = grads_of(lambda a, b, c: reference(a, b, c, **kw), ref_in, d_out.cpu().double())
    bound = BOUND[dtype]
    errors = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref_out, *ref_grads)):
        errors[name] = err = relative(got.cpu(), want)
        assert err <= bound, f"{label}: {name} normwise error {err:.2e} > {bound:.0e}"
    print(f"{label}: " + " ".join(f"{n} {e:.1e}" for n, e in errors.items()))


CUDA_CASES = [
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, options)
    (2, 37, 41, 4, 2, 64, 64, dict(causal=True)),  # GQA, causal, odd lengths
    (2, 130, 97, 6, 1, 128, 128, dict()),  # MQA, several key blocks
    (1, 50, 33, 2, 2, 32, 32, dict(causal=True)),  # more queries than keys: empty rows
    (1, 145, 145, 4, 2, 64, 64, dict(window=(17, 3))),
    (2, 73, 89, 4, 4, 96, 96, dict(causal=True, window=(25, -1), softcap=3.0)),
    (1, 64, 64, 2, 1, 256, 256, dict(softcap=1.5, scale=0.3)),
    (1, 17, 21, 4, 2, 64, 128, dict(causal=True)),  # head_dim_v != head_dim
]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", range(len(CUDA_CASES)))
def test_cuda_gradients_match_float64_eager(case, dtype):
    b, sq, sk, hq, hkv, d, dv, kw = CUDA_CASES[case]
    gen = torch.Generator().manual_seed(2000 + case)
    q, k, v = cuda_leaves(gen, [(b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv)], dtype)
    d_out = torch.randn((b, sq, hq, dv), generator=gen).to(dtype).cuda()
    check_cuda_against_reference(q, k, v, d_out, dtype, f"cuda case {case} {dtype} {kw}", **kw)


@needs_cuda
@pytest.mark.parametrize("where", ["host", "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_varlen_gradients(dtype, where):
    gen = torch.Generator().manual_seed(12)
    lens_q, lens_k = [5, 1, 70, 33], [9, 3, 70, 50]
    hq, hkv, d = 4, 2, 64
    shapes = [(sum(lens_q), hq, d), (sum(lens_k), hkv, d), (sum(lens_k), hkv, d)]
    q, k, v = cuda_leaves(gen, shapes, dtype)
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    if where == "cuda":
        cu_q, cu_k = cu_q.cuda(), cu_k.cuda()
    d_out = torch.randn((sum(lens_q), hq, d), generator=gen).to(dtype).cuda()
    longest = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k)) if where == "cuda" else {}
    out = fa.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, **longest)
    out.backward(d_out)
    ref_in = [x.detach().cpu().double().requires_grad_(True) for x in (q, k, v)]
    parts = []
    for i in range(len(lens_q)):
        qs = slice(sum(lens_q[:i]), sum(lens_q[: i + 1]))
        ks = slice(sum(lens_k[:i]), sum(lens_k[: i + 1]))
        parts.append(reference(ref_in[0][None, qs], ref_in[1][None, ks], ref_in[2][None, ks], causal=True)[0])
    ref = torch.cat(parts)
    ref.backward(d_out.cpu().double())
    assert relative(out.cpu(), ref) < BOUND[dtype]
    for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref_in):
        assert got.dtype == dtype and got.is_cuda
        err = relative(got.cpu(), want.grad)
        assert err < BOUND[dtype], f"varlen {where} {dtype}: {name} normwise error {err:.2e}"


@needs_cuda
def test_cuda_backward_runs_on_the_current_stream():
    gen = torch.Generator().manual_seed(13)
    q, k, v = cuda_leaves(gen, [(2, 200, 4, 64), (2, 220, 2, 64), (2, 220, 2, 64)], torch.bfloat16)
    d_out = torch.randn((2, 200, 4, 64), generator=gen).to(torch.bfloat16).cuda()
    out = fa.attention(q, k, v, causal=True)
    out.backward(d_out)
    want = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fa.attention(q, k, v, causal=True)
        out.backward(d_out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # dK and dV are summed in a fixed order (the same bits); dQ with f32 atomics (rounding).
    assert torch.equal(k.grad, want[1]) and torch.equal(v.grad, want[2])
    assert relative(q.grad.float(), want[0].float()) < 1e-2


@needs_cuda
def test_native_cuda_backward_checks_before_writing():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(s, generator=gen).to(torch.bfloat16).cuda() for s in [(1, 7, 2, 64), (1, 9, 1, 64), (1, 9, 1, 64)])
    out, lse = fa.attention(q, k, v, return_lse=True)
    d_out = torch.randn(out.shape, generator=gen).to(torch.bfloat16).cuda()
    device = fa.cuda_device(0)
    stream = torch.cuda.current_stream().cuda_stream
    fresh = lambda dtype=torch.bfloat16: [torch.full(x.shape, 7.0, dtype=dtype, device="cuda") for x in (q, k, v)]  # noqa: E731

    def call(*, grads=None, lse_=lse, d_out_=d_out, **kw):
        dq, dk, dv = grads if grads is not None else fresh()
        _native.backward(*(_desc(x) for x in (q, k, v, out, lse_, d_out_, dq, dk, dv)), device=device, stream=stream, **kw)
        torch.cuda.synchronize()
        return dq, dk, dv

    dq, dk, dv = call()
    assert torch.isfinite(dq).all() and not (dq == 7.0).all()
    bad = [
        (dict(lse_=lse.double()), "lse must be float32"),
        (dict(d_out_=d_out.transpose(1, 2).contiguous().transpose(1, 2)), "laid out as out"),
        (dict(d_out_=d_out.half()), "one dtype"),
        (dict(grads=fresh(torch.float16)), "one dtype"),
        (dict(window=(-2, 0)), "window"),
        (dict(softcap=-1.0), "softcap"),
    ]
    for kw, match in bad:
        grads = kw.pop("grads", None) or fresh()
        with pytest.raises(ValueError, match=match):
            call(grads=grads, **kw)
        assert all((g == 7.0).all() for g in grads), kw
    # float32 tensors: the CUDA backward takes bfloat16/float16 only.
    q32, k32, v32, o32, d32 = (x.float() for x in (q, k, v, out, d_out))
    grads = fresh(torch.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        _native.backward(*(_desc(x) for x in (q32, k32, v32, o32, lse, d32, *grads)), device=device, stream=stream)
    assert all((g == 7.0).all() for g in grads)


transformers = None
try:
    import transformers
except ImportError:  # pragma: no cover - depends on the environment
    pass


@pytest.mark.skipif(transformers is None, reason="transformers is not installed: the training step is NOT run")
def test_tiny_llama_training_step_matches_sdpa():
    from flash_attention_rs import transformers as hook

    name = hook.register()
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )

    def model(impl):
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM._from_config(config, attn_implementation=impl)
        assert m.config._attn_implementation == impl
        return m.to(torch.float32).train()

    ours, peer = model(name), model("sdpa")
    peer.load_state_dict(ours.state_dict())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 29), generator=gen)
    losses = []
    for m in (ours, peer):
        loss = m(input_ids=ids, labels=ids).loss  # causal LM: causal mask, no padding
        loss.backward()
        losses.append(loss.detach())
    assert abs(losses[0].item() - losses[1].item()) < 1e-5, losses
    worst = 0.0
    for (n, a), (_, b) in zip(ours.named_parameters(), peer.named_parameters()):
        assert a.grad is not None, n
        err = relative(a.grad, b.grad)
        worst = max(worst, err)
        assert err < 1e-4, f"{n}: gradient normwise error {err:.2e} vs sdpa"
    # One optimizer step from the same gradients gives the same weights (to rounding).
    for m in (ours, peer):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    for (n, a), (_, b) in zip(ours.named_parameters(), peer.named_parameters()):
        assert relative(a.detach(), b.detach()) < 1e-5, n


@pytest.mark.skipif(transformers is None, reason="transformers is not installed: the compiled training step is NOT run")
def test_tiny_llama_training_step_compiles_without_graph_breaks():
    why = _compile_available()
    if why:
        pytest.skip(why)
    import torch._dynamo
    from flash_attention_rs import transformers as hook

    name = hook.register()
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=name).train()
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(4))

    def step(ids):
        return model(input_ids=ids, labels=ids).loss

    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(ids)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    torch._dynamo.reset()
    loss = torch.compile(step, backend="aot_eager", fullgraph=True)(ids)
    loss.backward()
    compiled = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    eager = step(ids)
    eager.backward()
    assert abs(loss.item() - eager.item()) < 1e-6
    for n, p in model.named_parameters():
        assert relative(compiled[n], p.grad) < 1e-5, n


@needs_cuda
@pytest.mark.skipif(transformers is None, reason="transformers is not installed: the CUDA training step is NOT run")
def test_tiny_llama_cuda_bf16_training_step_matches_sdpa():
    from flash_attention_rs import transformers as hook

    name = hook.register()
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )

    def model(impl, dtype):
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM._from_config(config, attn_implementation=impl)
        return m.to(device="cuda", dtype=dtype).train()

    ours, peer, truth = model(name, torch.bfloat16), model("sdpa", torch.bfloat16), model("sdpa", torch.float32)
    peer.load_state_dict(ours.state_dict())
    truth.load_state_dict({n: p.float() for n, p in ours.state_dict().items()})
    ids = torch.randint(0, 256, (2, 157), generator=torch.Generator().manual_seed(1)).cuda()
    losses = []
    for m in (ours, peer, truth):
        loss = m(input_ids=ids, labels=ids).loss  # causal LM: causal mask, no padding
        loss.backward()
        losses.append(loss.detach().float().item())
    assert abs(losses[0] - losses[1]) < 2e-2, losses
    worst = (0.0, 0.0, "")
    for (n, a), (_, b), (_, t) in zip(ours.named_parameters(), peer.named_parameters(), truth.named_parameters()):
        assert a.grad is not None, n
        ours_err, peer_err = relative(a.grad.float(), t.grad), relative(b.grad.float(), t.grad)
        assert ours_err <= 2 * peer_err + 1e-2 and ours_err < 0.1, (
            f"{n}: gradient normwise error vs float32 {ours_err:.2e} (sdpa bf16: {peer_err:.2e})"
        )
        worst = max(worst, (ours_err, peer_err, n))
    print(f"cuda bf16 training step: losses {losses}; worst gradient error vs f32 {worst}")
