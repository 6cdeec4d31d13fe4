"""KV-cache decode on the NumPy / CPU path (``seqused_k=``, ``block_table=``) against a float64
computation that reads only each sequence's first ``seqused_k`` keys: padded and paged caches,
shuffled block tables, used lengths 0, 1 and odd, several queries per sequence with causal,
GQA and MQA, forced split counts, every dtype; and bad tables and shapes, which must raise
``ValueError`` with a clear message and leave the output untouched."""

import zlib

import numpy as np
import pytest

import flash_attention_rs as fa
from reference import BF16, BOUNDS, cache_f64, normwise_error

DTYPES = [np.dtype(np.float32), np.dtype(np.float16)] + ([BF16] if BF16 is not None else [])


def randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def make_cache(rng, used, heads_kv, head_dim, dtype, block_size=None, capacity=None):
    """A random cache for these used lengths: padded ``(batch, capacity, H, D)``, or paged
    ``(num_blocks, block_size, H, D)`` with a shuffled table (unused entries -1, spare
    blocks of noise). Returns ``(k, v, block_table or None)``."""
    batch = len(used)
    if block_size is None:
        capacity = capacity or max(used) + 3
        shape = (batch, capacity, heads_kv, head_dim)
        return randn(rng, shape, dtype), randn(rng, shape, dtype), None
    blocks = [-(-u // block_size) for u in used]
    max_blocks = max(blocks) + 1
    num_blocks = sum(blocks) + 3
    order = rng.permutation(num_blocks)
    table = np.full((batch, max_blocks), -1, dtype=np.int32)
    at = 0
    for b, n in enumerate(blocks):
        table[b, :n] = order[at : at + n]
        at += n
    shape = (num_blocks, block_size, heads_kv, head_dim)
    return randn(rng, shape, dtype), randn(rng, shape, dtype), table


def check_lse(lse, ref_lse, bound):
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert np.all(lse[~finite] == -np.inf)
    assert np.max(np.abs(lse[finite] - ref_lse[finite]), initial=0.0) <= bound


LAYOUTS = [None, 1, 7, 16, 64]  # None: padded; else the paged block size
GROUPS = [(4, 4), (8, 2), (4, 1)]  # (heads_q, heads_kv): MHA, GQA 4:1, MQA


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("block_size", LAYOUTS, ids=lambda b: "padded" if b is None else f"paged{b}")
@pytest.mark.parametrize("heads", GROUPS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("seqlen_q,causal", [(1, False), (3, True), (4, False)], ids=["decode", "spec3-causal", "spec4"])
def test_cache_matches_f64(dtype, block_size, heads, seqlen_q, causal):
    rng = np.random.default_rng(zlib.crc32(repr((dtype.name, block_size, heads, seqlen_q, causal)).encode()))
    heads_q, heads_kv = heads
    d = 40 if block_size == 7 else 64
    used = [0, 1, 2 * int(rng.integers(20, 90)) + 1, int(rng.integers(0, 200)), 2]
    k, v, table = make_cache(rng, used, heads_kv, d, dtype, block_size)
    q = randn(rng, (len(used), seqlen_q, heads_q, d), dtype)
    out = np.full(q.shape, np.nan, dtype=dtype)  # poisoned: every element must be written
    got, lse = fa.attention(q, k, v, seqused_k=np.array(used, np.int32), block_table=table, causal=causal, return_lse=True, out=out)
    assert got is out and lse.shape == (len(used), heads_q, seqlen_q)
    ref, ref_lse = cache_f64(q, k, v, used, table, causal=causal)
    assert np.all(np.isfinite(got.astype(np.float64)))
    err = normwise_error(got, ref)
    assert err <= BOUNDS[dtype.name], f"normwise error {err:.3e}"
    check_lse(lse, ref_lse, 1e-5 if dtype == np.float32 else 2e-2)
    # Sequence 0 uses no key: zeros and -inf.
    assert np.all(got[0].astype(np.float64) == 0.0) and np.all(lse[0] == -np.inf)


@pytest.mark.parametrize("block_size", [None, 16], ids=["padded", "paged16"])
def test_forced_splits_agree_with_one_split(block_size):
    rng = np.random.default_rng(11)
    used = [300, 0, 1, 257]
    k, v, table = make_cache(rng, used, 2, 64, np.float32, block_size)
    q = randn(rng, (4, 2, 8, 64), np.float32)
    one = fa.attention(q, k, v, seqused_k=used, block_table=table, causal=True, num_splits=1)
    ref, _ = cache_f64(q, k, v, used, table, causal=True)
    assert normwise_error(one, ref) <= 1e-5
    for splits in (2, 5, 1000):
        got = fa.attention(q, k, v, seqused_k=used, block_table=table, causal=True, num_splits=splits)
        np.testing.assert_allclose(got, one, rtol=1e-5, atol=1e-6, err_msg=f"num_splits={splits}")


def test_the_block_table_is_followed():
    # Swapping two used entries of the table changes the answer (so it is really read).
    rng = np.random.default_rng(3)
    used = [40, 33]
    k, v, table = make_cache(rng, used, 2, 32, np.float32, 8)
    q = randn(rng, (2, 1, 4, 32), np.float32)
    good = fa.attention(q, k, v, seqused_k=used, block_table=table)
    ref, _ = cache_f64(q, k, v, used, table)
    assert normwise_error(good, ref) <= 1e-5
    swapped = table.copy()
    swapped[0, 0], swapped[1, 1] = table[1, 1], table[0, 0]
    other = fa.attention(q, k, v, seqused_k=used, block_table=swapped)
    assert normwise_error(other, ref) > 1e-2
    ref2, _ = cache_f64(q, k, v, used, swapped)
    assert normwise_error(other, ref2) <= 1e-5


def test_tables_as_lists_and_other_int_dtypes():
    rng = np.random.default_rng(5)
    used = [5, 0, 9]
    k, v, table = make_cache(rng, used, 1, 16, np.float32, 4)
    q = randn(rng, (3, 2, 2, 16), np.float32)
    ref, _ = cache_f64(q, k, v, used, table, causal=True)
    for u, t in [(used, table.tolist()), (np.array(used, np.int64), table.astype(np.int64)), (np.array(used, np.uint8), table)]:
        got = fa.attention(q, k, v, seqused_k=u, block_table=t, causal=True)
        assert normwise_error(got, ref) <= 1e-5
    # A non-contiguous table view is made dense first.
    wide = np.zeros((3, 2 * table.shape[1]), np.int32)
    wide[:, ::2] = table
    got = fa.attention(q, k, v, seqused_k=used, block_table=wide[:, ::2], causal=True)
    assert normwise_error(got, ref) <= 1e-5


def test_window_softcap_and_bhsd_cache_views():
    rng = np.random.default_rng(8)
    used = [17, 60, 1]
    # A BHSD padded cache passed as its BSHD view: strides travel.
    kb = randn(rng, (3, 2, 64, 32), np.float32)
    vb = randn(rng, (3, 2, 64, 32), np.float32)
    k, v = kb.swapaxes(1, 2), vb.swapaxes(1, 2)
    q = randn(rng, (3, 2, 4, 32), np.float32)
    for kw in [dict(window=(8, 0)), dict(softcap=2.0, causal=True), dict(scale=0.3)]:
        got = fa.attention(q, k, v, seqused_k=used, **kw)
        ref, _ = cache_f64(q, k, v, used, **kw)
        assert normwise_error(got, ref) <= 1e-5, kw


def bad_case(paged=True):
    rng = np.random.default_rng(9)
    used = [5, 0, 9]
    k, v, table = make_cache(rng, used, 2, 8, np.float32, 4 if paged else None, capacity=10)
    q = randn(rng, (3, 2, 4, 8), np.float32)
    return q, k, v, np.array(used, np.int32), table


def refused(words, paged=True, exc=ValueError, edit=lambda c: c, **kw):
    q, k, v, used, table = edit(bad_case(paged))
    out = np.full(q.shape[:-1] + (v.shape[-1],), 7.0, np.float32)
    args = dict(seqused_k=used, block_table=table, out=out)
    args.update(kw)
    with pytest.raises(exc, match=words):
        fa.attention(q, k, v, **args)
    assert np.all(out == 7.0), "output written on error"


def test_bad_tables_raise_and_leave_out_untouched():
    q, k, v, used, table = bad_case()
    num_blocks = k.shape[0]
    # Block index out of range, negative in a used slot; fewer blocks than the table names.
    t = table.copy()
    t[2, 1] = num_blocks
    refused("outside the cache", block_table=t)
    t = table.copy()
    t[0, 0] = -2
    refused("outside the cache", block_table=t)
    refused("outside the cache", edit=lambda c: (c[0], c[1][:2], c[2][:2], c[3], c[4]))
    # A used length past the table (too short) or past the padded capacity.
    refused("KV cache holds", seqused_k=[5, 0, 4 * table.shape[1] + 1])
    refused("KV cache holds", block_table=np.ascontiguousarray(table[:, :2]))
    refused("KV cache holds", paged=False, seqused_k=[5, 0, 11])
    refused("negative", seqused_k=[5, -1, 9])


def test_bad_shapes_and_dtypes_raise():
    refused("seqused_k has dtype float", seqused_k=np.array([5.0, 0, 9]))
    refused("seqused_k has dtype bool", seqused_k=np.array([True, False, True]))
    refused(r"seqused_k has shape \(4\)", seqused_k=[5, 0, 9, 1])
    refused(r"block_table has shape \(3, 4, 1\): expected 2 dimensions", edit=lambda c: (*c[:4], c[4][..., None]))
    refused(r"block_table has shape \(2, ", edit=lambda c: (*c[:4], c[4][:2]))
    refused("values outside int32", seqused_k=np.array([5, 0, 2**40]))
    refused("block_table needs seqused_k", seqused_k=None)
    refused("num_splits is 0", num_splits=0)
    refused("no cu_seqlens", cu_seqlens_q=[0, 2], cu_seqlens_k=[0, 2])
    # q must be (batch, seqlen_q, heads_q, head_dim); a padded cache's batch must be q's.
    refused("with seqused_k", edit=lambda c: (c[0][0], *c[1:]))
    refused("q has batch 3 but k has batch 2", paged=False, edit=lambda c: (c[0], c[1][:2], c[2][:2], c[3], None))
    refused("differ in batch, seqlen or heads", edit=lambda c: (c[0], c[1], c[2][:, :3], c[3], c[4]))
    with pytest.raises(ValueError, match="num_splits applies"):
        q, k, v, _, _ = bad_case(False)
        fa.attention(q, k, v, num_splits=2)


def test_seqused_k_of_the_right_length_only():
    # batch 1: a scalar-like table of one entry, and lengths 0 and 1 alone.
    rng = np.random.default_rng(12)
    for used in ([0], [1], [33]):
        k, v, table = make_cache(rng, used, 1, 8, np.float32, 16)
        q = randn(rng, (1, 3, 2, 8), np.float32)
        got, lse = fa.attention(q, k, v, seqused_k=used, block_table=table, causal=True, return_lse=True)
        ref, ref_lse = cache_f64(q, k, v, used, table, causal=True)
        assert normwise_error(got, ref) <= 1e-5
        check_lse(lse, ref_lse, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("block_size", [None, 1, 7, 64], ids=lambda b: "padded" if b is None else f"paged{b}")
def test_append_kv_in_place_then_attention_with_k_new(dtype, block_size):
    # append_kv puts token i of sequence b at position used[b] + i (padded, or paged through
    # the table) and writes nothing else; attention(..., k_new=, v_new=) does the same, then
    # attends over used + seqlen_new keys, against the f64 reference over the expected cache.
    rng = np.random.default_rng(zlib.crc32(repr(("append", dtype.name, block_size)).encode()))
    used, n_new = [0, 1, 13, 70], 2
    k0, v0, table = make_cache(rng, [u + n_new for u in used], 2, 24, dtype, block_size)
    k_new, v_new = randn(rng, (4, n_new, 2, 24), dtype), randn(rng, (4, n_new, 2, 24), dtype)
    k_want, v_want = k0.copy(), v0.copy()
    for b, u in enumerate(used):
        for i in range(n_new):
            t = u + i
            at = (b, t) if table is None else (table[b, t // block_size], t % block_size)
            k_want[at], v_want[at] = k_new[b, i], v_new[b, i]
    k, v = k0.copy(), v0.copy()
    fa.append_kv(k, v, k_new, v_new, np.array(used, dtype=np.int32), block_table=table)
    assert k.tobytes() == k_want.tobytes() and v.tobytes() == v_want.tobytes()
    k, v = k0.copy(), v0.copy()
    q = randn(rng, (4, n_new, 8, 24), dtype)
    got = fa.attention(q, k, v, seqused_k=used, block_table=table, causal=True, k_new=k_new, v_new=v_new)
    assert k.tobytes() == k_want.tobytes() and v.tobytes() == v_want.tobytes()
    ref, _ = cache_f64(q.astype(np.float64), k_want.astype(np.float64), v_want.astype(np.float64),
                       [u + n_new for u in used], table, causal=True)
    err = normwise_error(got.astype(np.float64), ref)
    assert err <= BOUNDS[dtype.name], f"normwise error {err:.3e}"


def test_append_kv_without_room_raises_and_leaves_the_cache():
    rng = np.random.default_rng(3)
    k, v, _ = make_cache(rng, [4, 4], 1, 8, np.float32, capacity=5)
    before = k.copy(), v.copy()
    new = randn(rng, (2, 2, 1, 8), np.float32)
    with pytest.raises(ValueError, match="the KV cache holds"):
        fa.append_kv(k, v, new, new, [3, 4])
    assert np.array_equal(k, before[0]) and np.array_equal(v, before[1])
    frozen = k.copy()
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        fa.append_kv(frozen, v, new, new, [0, 0])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("block_size", [None, 16], ids=["padded", "paged16"])
def test_sinks_over_a_cache(dtype, block_size):
    """Attention sinks through the C ABI's cache entry (``options.sinks``): against the
    float64 oracle, with forced splits (the sink joins once, after the merge), and a sequence
    with no key (zeros, LSE = the sink)."""
    rng = np.random.default_rng(zlib.crc32(repr(("sinks", dtype.name, block_size)).encode()))
    used = [0, 1, 77, 300]
    k, v, table = make_cache(rng, used, 2, 32, dtype, block_size)
    q = randn(rng, (4, 2, 8, 32), dtype)
    sinks = (rng.standard_normal(8) * 2.0).astype(np.float32)
    ref, ref_lse = cache_f64(q, k, v, used, table, causal=True, sinks=sinks)
    for splits in (None, 3):
        got, lse = fa.attention(q, k, v, seqused_k=used, block_table=table, causal=True,
                                num_splits=splits, sinks=sinks, return_lse=True)
        err = normwise_error(got, ref)
        assert err <= BOUNDS[dtype.name], f"normwise error {err:.3e} (splits {splits})"
        check_lse(lse, ref_lse, 1e-5 if dtype == np.float32 else 2e-2)
        assert np.all(got[0].astype(np.float64) == 0.0)
        np.testing.assert_allclose(lse[0], np.broadcast_to(sinks[:, None], (8, 2)), atol=1e-6)
