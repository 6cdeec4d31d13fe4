"""KV-cache decode with PyTorch tensors (``seqused_k=``, ``block_table=``): on the CPU (where
torch is installed) with host tables, and on CUDA (where a GPU is) with int32 device tables
that the library never reads back, against a float64 computation over each sequence's used
keys: padded and paged caches (shuffled tables, block sizes 1 to 256), lengths 0, 1 and odd,
several queries with causal, GQA 8:1 and MQA, forced splits; device lengths past the capacity
clamped; bad tables and devices refused; a paged cache's block walk (``block_walk()`` from
torch host tables, passed to CUDA calls, refused on the CPU). Skips say loudly when torch or a
GPU is missing."""

import zlib

import numpy as np
import pytest

from reference import cache_f64, normwise_error

from torch_common import BOUND, DEVICES, HAS_CUDA, dtypes_for, needs_cuda, torch  # noqa: E402

import flash_attention_rs as fa  # noqa: E402


def randn(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def host64(x):
    return x.detach().to("cpu", torch.float64).numpy()


def make_cache(gen, used, heads_kv, head_dim, dtype, device, block_size=None):
    """Padded ``(batch, max(used) + 3, H, D)`` or paged ``(num_blocks, block_size, H, D)``
    with a shuffled int32 table (unused entries -1) on ``device``."""
    batch = len(used)
    if block_size is None:
        shape = (batch, max(used) + 3, heads_kv, head_dim)
        return randn(shape, dtype, device, gen), randn(shape, dtype, device, gen), None
    blocks = [-(-u // block_size) for u in used]
    num_blocks = sum(blocks) + 3
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.full((batch, max(blocks) + 1), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks):
        table[b, :n] = order[at : at + n]
        at += n
    shape = (num_blocks, block_size, heads_kv, head_dim)
    return randn(shape, dtype, device, gen), randn(shape, dtype, device, gen), table.to(device)


def reference(q, k, v, used, table, **kw):
    t = None if table is None else table.cpu().numpy()
    out, lse = cache_f64(host64(q), host64(k), host64(v), list(used), t, **kw)
    return out, lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [None, 1, 16, 64, 256], ids=lambda b: "padded" if b is None else f"paged{b}")
@pytest.mark.parametrize("heads", [(8, 1), (16, 2), (4, 4)], ids=["mqa", "gqa8", "mha"])
def test_cache_matches_f64(device, block_size, heads):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((device, block_size, heads)).encode()))
    heads_q, heads_kv = heads
    used = [0, 1, 301, 77, 600]
    for dtype in dtypes_for(device):
        k, v, table = make_cache(gen, used, heads_kv, 128, dtype, device, block_size)
        seqused = torch.tensor(used, dtype=torch.int32, device=device)
        for seqlen_q, causal in ((1, False), (3, True)):
            q = randn((len(used), seqlen_q, heads_q, 128), dtype, device, gen)
            out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
            got, lse = fa.attention(q, k, v, seqused_k=seqused, block_table=table, causal=causal, out=out, return_lse=True)
            assert got is out
            if device == "cuda":
                torch.cuda.synchronize()
            ref, ref_lse = reference(q, k, v, used, table, causal=causal)
            assert torch.isfinite(got).all()
            err = normwise_error(host64(got), ref)
            assert err <= BOUND[(device, dtype)], f"{dtype} sq={seqlen_q}: normwise error {err:.3e}"
            lse = lse.cpu().numpy()
            finite = np.isfinite(ref_lse)
            np.testing.assert_array_equal(np.isfinite(lse), finite)
            assert np.max(np.abs(lse[finite] - ref_lse[finite]), initial=0.0) <= 1e-2
            for splits in (1, 7):
                again = fa.attention(q, k, v, seqused_k=seqused, block_table=table, causal=causal, num_splits=splits)
                err = normwise_error(host64(again), ref)
                assert err <= BOUND[(device, dtype)], f"{dtype} num_splits={splits}: {err:.3e}"


@needs_cuda
def test_cuda_lengths_past_the_capacity_are_clamped():
    # Device tables are never read by the host: a length past the padded capacity is clamped
    # by the kernel to the capacity (no fault, no read outside the cache).
    gen = torch.Generator().manual_seed(4)
    k, v, _ = make_cache(gen, [50, 50], 2, 64, torch.bfloat16, "cuda")
    capacity = k.shape[1]
    q = randn((2, 1, 8, 64), torch.bfloat16, "cuda", gen)
    clamped = fa.attention(q, k, v, seqused_k=torch.tensor([capacity + 1000, 7], dtype=torch.int32, device="cuda"))
    exact = fa.attention(q, k, v, seqused_k=torch.tensor([capacity, 7], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(clamped, exact)


@needs_cuda
def test_cuda_tables_must_be_int32_on_the_same_device():
    gen = torch.Generator().manual_seed(6)
    k, v, table = make_cache(gen, [5, 9], 2, 64, torch.bfloat16, "cuda", 16)
    q = randn((2, 1, 4, 64), torch.bfloat16, "cuda", gen)
    used = torch.tensor([5, 9], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="same device"):
        fa.attention(q, k, v, seqused_k=used.cpu(), block_table=table)
    with pytest.raises(ValueError, match="same device"):
        fa.attention(q, k, v, seqused_k=[5, 9], block_table=table)
    with pytest.raises(ValueError, match="must be torch.int32"):
        fa.attention(q, k, v, seqused_k=used.long(), block_table=table)
    with pytest.raises(ValueError, match="must be torch.int32"):
        fa.attention(q, k, v, seqused_k=used, block_table=table.long())
    with pytest.raises(ValueError, match=r"block_table has shape \(1, "):
        fa.attention(q, k, v, seqused_k=used, block_table=table[:1])


def test_cpu_tensors_and_host_tables():
    gen = torch.Generator().manual_seed(8)
    used = [33, 0, 1]
    k, v, table = make_cache(gen, used, 1, 32, torch.float32, "cpu", 8)
    q = randn((3, 2, 4, 32), torch.float32, "cpu", gen)
    ref, _ = reference(q, k, v, used, table, causal=True)
    for u in (used, torch.tensor(used), torch.tensor(used, dtype=torch.int32)):
        got = fa.attention(q, k, v, seqused_k=u, block_table=table, causal=True)
        assert normwise_error(host64(got), ref) <= 1e-5
    bad = table.clone()
    bad[0, 0] = 10_000
    out = torch.full(q.shape, 7.0)
    with pytest.raises(ValueError, match="outside the cache"):
        fa.attention(q, k, v, seqused_k=used, block_table=bad, out=out)
    assert torch.all(out == 7.0)
    if HAS_CUDA:
        with pytest.raises(ValueError, match="host memory"):
            fa.attention(q, k, v, seqused_k=torch.tensor(used, dtype=torch.int32, device="cuda"), block_table=table)


@needs_cuda
def test_cuda_cache_tables_stay_on_the_device_and_the_stream():
    # The tables (and the cache) are written on a side stream behind a long GPU spin, and the
    # call is made on that stream: a host read of seqused_k/block_table would either block
    # (synchronisation) or see the poison, and a kernel on another stream would read it too.
    # Forced splits make the library allocate its workspace on the stream as well.
    gen = torch.Generator().manual_seed(10)
    used = [700, 1, 0, 333]
    k_src, v_src, table_src = make_cache(gen, used, 2, 128, torch.bfloat16, "cuda", 16)
    q = randn((4, 2, 16, 128), torch.bfloat16, "cuda", gen)
    used_src = torch.tensor(used, dtype=torch.int32, device="cuda")
    ref, _ = reference(q, k_src, v_src, used, table_src, causal=True)
    # Warm-up on the default stream (compiles/loads the kernels outside the timed part).
    first = fa.attention(q, k_src, v_src, seqused_k=used_src, block_table=table_src, causal=True, num_splits=4)
    k, v = torch.randn_like(k_src), torch.randn_like(v_src)
    seqused = torch.zeros_like(used_src)
    table = torch.full_like(table_src, -1)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time on the side stream
        for dst, x in ((k, k_src), (v, v_src), (seqused, used_src), (table, table_src)):
            dst.copy_(x)
        out = fa.attention(q, k, v, seqused_k=seqused, block_table=table, causal=True, num_splits=4)
        returned_before_done = not side.query()
    side.synchronize()
    assert returned_before_done, "the call waited for the GPU (host synchronisation)"
    err = normwise_error(host64(out), ref)
    assert err <= BOUND[("cuda", torch.bfloat16)], f"side stream: normwise error {err:.3e}"
    torch.cuda.synchronize()
    assert torch.equal(out, first), "same inputs, same plan: bitwise equal results"


def put_tokens(cache, new, used, table):
    """The cache with token ``i`` of sequence ``b`` of ``new`` at position ``used[b] + i``,
    written by Python (padded, or paged through ``table``): what an append must leave."""
    out = cache.clone()
    for b, u in enumerate(used):
        for i in range(new.shape[1]):
            t = u + i
            if table is None:
                out[b, t] = new[b, i]
            else:
                bs = cache.shape[1]
                out[int(table[b, t // bs]), t % bs] = new[b, i]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [None, 1, 16, 256], ids=lambda b: "padded" if b is None else f"paged{b}")
def test_append_in_place_then_attend_matches_f64(device, block_size):
    # append_kv writes each sequence's new tokens at its position, in place and nowhere else;
    # attention(..., k_new=, v_new=) (FlashAttention's flash_attn_with_kvcache) appends the
    # same way, then attends over the lengths plus the new tokens.
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("append", device, block_size)).encode()))
    used, n_new = [0, 1, 37, 300], 3
    for dtype in dtypes_for(device):
        # The cache (and a paged table) holds room for the new tokens; seqused_k = used.
        k0, v0, table = make_cache(gen, [u + n_new for u in used], 2, 64, dtype, device, block_size)
        seqused = torch.tensor(used, dtype=torch.int32, device=device)
        k_new = randn((len(used), n_new, 2, 64), dtype, device, gen)
        v_new = randn((len(used), n_new, 2, 64), dtype, device, gen)
        t = None if table is None else table.cpu()
        k_want = put_tokens(k0.cpu(), k_new.cpu(), used, t)
        v_want = put_tokens(v0.cpu(), v_new.cpu(), used, t)

        k, v = k0.clone(), v0.clone()
        assert fa.append_kv(k, v, k_new, v_new, seqused, block_table=table) is None
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(k.cpu(), k_want) and torch.equal(v.cpu(), v_want), f"{dtype}: append"
        assert torch.equal(seqused.cpu(), torch.tensor(used, dtype=torch.int32)), "lengths unchanged"

        k, v = k0.clone(), v0.clone()
        q = randn((len(used), n_new, 8, 64), dtype, device, gen)
        got = fa.attention(q, k, v, seqused_k=seqused, block_table=table, causal=True, k_new=k_new, v_new=v_new)
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(k.cpu(), k_want) and torch.equal(v.cpu(), v_want), f"{dtype}: k_new/v_new"
        ref, _ = reference(q, k_want, v_want, [u + n_new for u in used], t, causal=True)
        err = normwise_error(host64(got), ref)
        assert err <= BOUND[(device, dtype)], f"{dtype}: normwise error {err:.3e}"


def test_append_refusals_leave_the_cache_untouched():
    gen = torch.Generator().manual_seed(12)
    used = [5, 9]
    k, v, table = make_cache(gen, [u + 2 for u in used], 2, 32, torch.float32, "cpu", 4)
    k_new = randn((2, 2, 2, 32), torch.float32, "cpu", gen)
    v_new = randn((2, 2, 2, 32), torch.float32, "cpu", gen)
    k_before, v_before = k.clone(), v.clone()
    bad = table.clone()
    bad[1, 2] = 10_000  # the block of sequence 1's first new position (9 // 4)
    with pytest.raises(ValueError, match="outside the cache"):
        fa.append_kv(k, v, k_new, v_new, used, block_table=bad)
    with pytest.raises(ValueError):  # no room: the table covers 11 keys, not 11 + 2
        fa.append_kv(k, v, k_new, v_new, [5, 11], block_table=table)
    with pytest.raises(ValueError, match="share one dtype"):
        fa.append_kv(k, v, k_new.to(torch.bfloat16), v_new.to(torch.bfloat16), used, block_table=table)
    with pytest.raises(ValueError, match="both k_new and v_new"):
        fa.attention(k_new, k, v, seqused_k=used, block_table=table, k_new=k_new)
    with pytest.raises(ValueError, match="need seqused_k"):
        fa.attention(k_new, k, v, k_new=k_new, v_new=v_new)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


def expected_walk(used, table, block_size):
    """A paged cache's block walk by its definition: per sequence its used blocks' (physical,
    logical) pairs sorted, physical indices in plane 0, logical in plane 1, zeros after."""
    table = np.asarray(table)
    walk = np.zeros((table.shape[0], 2, table.shape[1]), dtype=np.int32)
    for b, u in enumerate(used):
        pairs = sorted((int(table[b, j]), j) for j in range(-(-int(u) // block_size)))
        for j, (phys, logical) in enumerate(pairs):
            walk[b, :, j] = (phys, logical)
    return walk


def test_block_walk_from_torch_host_tables():
    # block_walk takes CPU tensors; CUDA tables are refused (the walk is built on the host),
    # and the CPU path of attention takes no walk.
    gen = torch.Generator().manual_seed(14)
    used = [33, 0, 1, 64]
    k, v, table = make_cache(gen, used, 1, 32, torch.float32, "cpu", 8)
    walk = fa.block_walk(torch.tensor(used), table, k.shape[1], k.shape[0])
    np.testing.assert_array_equal(walk, expected_walk(used, table.numpy(), 8))
    q = randn((4, 1, 2, 32), torch.float32, "cpu", gen)
    out = torch.full(q.shape, 7.0)
    with pytest.raises(ValueError, match="block_walk is for CUDA tensors"):
        fa.attention(q, k, v, seqused_k=used, block_table=table, block_walk=torch.from_numpy(walk), out=out)
    assert torch.all(out == 7.0)
    if HAS_CUDA:
        with pytest.raises(ValueError, match="builds the walk on the host"):
            fa.block_walk(torch.tensor(used, dtype=torch.int32, device="cuda"), table, 8, k.shape[0])


@needs_cuda
@pytest.mark.parametrize("block_size", [5, 8, 16, 64, 256])
def test_cuda_block_walk_matches_table_order_and_f64(block_size):
    # A walk from block_walk(), uploaded once, gives the table-order call's result to
    # rounding (both against float64, bf16 bound); a wrong walk (every used block moved to
    # its neighbour in the pool) gives wrong rows where the plan walks (blocks of 8 keys or
    # more), so the walk does reach the kernel. Then a decode step: append with k_new/v_new
    # and the walk of the lengths after it.
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("walk", block_size)).encode()))
    after = [1, 2, 302, 78, 601, 1024]  # the lengths after a one-token append
    before = [u - 1 for u in after]
    k0, v0, table = make_cache(gen, after, 2, 128, torch.bfloat16, "cuda", block_size)
    num_blocks = k0.shape[0]
    q = randn((len(after), 1, 16, 128), torch.bfloat16, "cuda", gen)
    bound = BOUND[("cuda", torch.bfloat16)]
    used = torch.tensor(after, dtype=torch.int32, device="cuda")
    walk = torch.from_numpy(fa.block_walk(after, table.cpu(), block_size, num_blocks)).cuda()
    np.testing.assert_array_equal(walk.cpu().numpy(), expected_walk(after, table.cpu().numpy(), block_size))
    ref, _ = reference(q, k0, v0, after, table, causal=True)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    got = fa.attention(q, k0, v0, seqused_k=used, block_table=table, block_walk=walk, causal=True, out=out)
    ordered = fa.attention(q, k0, v0, seqused_k=used, block_table=table, causal=True)
    torch.cuda.synchronize()
    assert got is out
    assert normwise_error(host64(got), ref) <= bound, "walked"
    assert normwise_error(host64(ordered), ref) <= bound, "table order"
    wrong_table = torch.where(table >= 0, (table + 1) % num_blocks, table)
    wrong = torch.from_numpy(fa.block_walk(after, wrong_table.cpu(), block_size, num_blocks)).cuda()
    bad = fa.attention(q, k0, v0, seqused_k=used, block_table=table, block_walk=wrong, causal=True)
    err = normwise_error(host64(bad), ref)
    if block_size >= 8:
        assert err > 0.1, f"a wrong walk gave the right answer ({err:.2e}): the walk was not read"
    else:
        assert err <= bound, "blocks of 5 are read per row: the plan reads no walk"

    # A decode step: the new token appended, then attention over the lengths after it with
    # the walk of those lengths.
    k_new = randn((len(after), 1, 2, 128), torch.bfloat16, "cuda", gen)
    v_new = randn((len(after), 1, 2, 128), torch.bfloat16, "cuda", gen)
    t = table.cpu()
    k_want = put_tokens(k0.cpu(), k_new.cpu(), before, t)
    v_want = put_tokens(v0.cpu(), v_new.cpu(), before, t)
    k, v = k0.clone(), v0.clone()
    seqused = torch.tensor(before, dtype=torch.int32, device="cuda")
    got = fa.attention(q, k, v, seqused_k=seqused, block_table=table, block_walk=walk, k_new=k_new, v_new=v_new, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(k.cpu(), k_want) and torch.equal(v.cpu(), v_want), "the append"
    ref, _ = reference(q, k_want, v_want, after, t, causal=True)
    assert normwise_error(host64(got), ref) <= bound, "append then walked"

    # Bad walks: shape, dtype, device, a padded cache; nothing is written.
    k, v = k0.clone(), v0.clone()
    for bad_walk, words in [
        (walk[:, :, :-1], "block_walk has shape"),
        (walk.long(), "must be torch.int32"),
        (walk.cpu(), "same device"),
    ]:
        with pytest.raises(ValueError, match=words):
            fa.attention(q, k, v, seqused_k=seqused, block_table=table, block_walk=bad_walk, k_new=k_new, v_new=v_new)
    with pytest.raises(ValueError, match="a padded cache has no blocks to walk"):
        fa.attention(q, k[: len(after)], v[: len(after)], seqused_k=used, block_walk=walk)
    torch.cuda.synchronize()
    assert torch.equal(k, k0) and torch.equal(v, v0), "cache written on error"
