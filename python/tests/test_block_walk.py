"""``block_walk()`` (a paged cache's block walk, built on the host for ``attention(...,
block_walk=)`` on CUDA) against a pure-Python walk (each sequence's used blocks sorted by
physical index, with their logical indices): random shuffled tables of several block sizes,
lengths 0, 1, partial and full, blocks shared between sequences, unused entries -1 or noise;
tables as lists, NumPy arrays of other integer dtypes and views; bad tables raise
``ValueError``; and ``attention(..., block_walk=)`` refuses a walk where it does not belong
(host tensors, a padded cache) before anything is written."""

import zlib

import numpy as np
import pytest

import flash_attention_rs as fa


def expected_walk(used, table, block_size):
    """The walk by its definition: per sequence, the ``(physical, logical)`` pairs of its used
    blocks sorted, physical indices in plane 0 and logical ones in plane 1, zeros after."""
    table = np.asarray(table)
    batch, max_blocks = table.shape
    walk = np.zeros((batch, 2, max_blocks), dtype=np.int32)
    for b, u in enumerate(used):
        blocks = -(-int(u) // block_size)
        pairs = sorted((int(table[b, j]), j) for j in range(blocks))
        for j, (phys, logical) in enumerate(pairs):
            walk[b, 0, j] = phys
            walk[b, 1, j] = logical
    return walk


def random_tables(rng, batch, max_blocks, block_size):
    """Lengths 0, 1, a whole table, whole blocks and anything; each sequence's blocks drawn
    from a shuffled pool (so sequences share blocks, as prefix caching does); unused entries
    -1 or out-of-range noise (never read). Returns ``(used, table, num_blocks)``."""
    capacity = max_blocks * block_size
    choices = [0, 1, capacity, block_size * int(rng.integers(1, max_blocks + 1))]
    used = [choices[(b + batch) % 4] if b < 4 else int(rng.integers(0, capacity + 1)) for b in range(batch)]
    num_blocks = batch * max_blocks // 2 + 3
    table = np.empty((batch, max_blocks), dtype=np.int32)
    for b, u in enumerate(used):
        blocks = -(-u // block_size)
        pool = rng.permutation(num_blocks)
        table[b, :blocks] = pool[:blocks]
        noise = rng.integers(num_blocks, num_blocks + 1000, max_blocks - blocks)
        table[b, blocks:] = np.where(rng.integers(0, 2, max_blocks - blocks) == 0, -1, noise)
    return used, table, num_blocks


@pytest.mark.parametrize("block_size", [1, 5, 8, 16, 64, 256])
@pytest.mark.parametrize("batch,max_blocks", [(1, 1), (6, 3), (13, 9), (5, 40)])
def test_random_tables_walk_as_their_definition(block_size, batch, max_blocks):
    rng = np.random.default_rng(zlib.crc32(repr((block_size, batch, max_blocks)).encode()))
    used, table, num_blocks = random_tables(rng, batch, max_blocks, block_size)
    walk = fa.block_walk(np.array(used, np.int32), table, block_size, num_blocks)
    assert isinstance(walk, np.ndarray) and walk.dtype == np.int32
    assert walk.shape == (batch, 2, max_blocks) and walk.flags.c_contiguous
    np.testing.assert_array_equal(walk, expected_walk(used, table, block_size))


def test_a_block_named_twice_and_the_planes():
    # Sequence 0 uses blocks 4, 4, 1 (a block named twice keeps both places); sequence 1 one
    # key in block 0; sequence 2 nothing.
    used = [9, 1, 0]
    table = [[4, 4, 1], [0, -1, -1], [-1, 7, 7]]
    walk = fa.block_walk(used, table, 4, 5)
    np.testing.assert_array_equal(walk[0], [[1, 4, 4], [2, 0, 1]])
    np.testing.assert_array_equal(walk[1], [[0, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(walk[2], np.zeros((2, 3)))


def test_tables_as_lists_other_int_dtypes_and_views():
    rng = np.random.default_rng(7)
    used, table, num_blocks = random_tables(rng, 6, 5, 16)
    want = expected_walk(used, table, 16)
    wide = np.zeros((6, 10), np.int64)
    wide[:, ::2] = table
    for u, t in [
        (used, table.tolist()),
        (np.array(used, np.int64), table.astype(np.int64)),
        (np.array(used, np.uint16), table.astype(np.int16)),
        (np.array(used, np.int32), wide[:, ::2]),  # a strided view, made dense
    ]:
        np.testing.assert_array_equal(fa.block_walk(u, t, np.int64(16), num_blocks), want)
    # A table without columns: an empty walk per sequence.
    assert fa.block_walk([0, 0], np.zeros((2, 0), np.int32), 16, 0).shape == (2, 2, 0)


def test_bad_tables_raise():
    used = [5, 0, 9]
    table = np.array([[3, 1, -1], [9, 9, 9], [0, 4, 2]], np.int32)
    assert fa.block_walk(used, table, 4, 5).shape == (3, 2, 3)

    def refused(words, used=used, table=table, block_size=4, num_blocks=5, exc=ValueError):
        with pytest.raises(exc, match=words):
            fa.block_walk(used, table, block_size, num_blocks)

    # A length past the capacity (3 blocks of 4) or negative; a table too short for a length.
    refused("uses 13 keys but the KV cache holds 12", used=[5, 0, 13])
    refused(r"seqused_k\[1\] is -1", used=[5, -1, 9])
    refused("the KV cache holds 8", table=table[:, :2])
    # A used block index outside the pool, negative; a pool smaller than the table names.
    bad = table.copy()
    bad[2, 2] = 5
    refused(r"block_table\[2\]\[2\] = 5 is outside the cache's 5 blocks", table=bad)
    bad[2, 2] = -1
    refused("is outside the cache's", table=bad)
    refused("is outside the cache's 4 blocks", num_blocks=4)
    # Sizes, shapes and dtypes.
    refused("block_size is 0", block_size=0)
    refused("block_size is -2", block_size=-2)
    refused("num_blocks is -1", num_blocks=-1)
    refused("batch is 0", used=[], table=np.zeros((0, 3), np.int32))
    refused(r"seqused_k has shape \(2\): expected \(3\)", used=[5, 0])
    refused("expected 2 dimensions", table=table[0])
    refused("has dtype float", table=table.astype(np.float32))
    refused("values outside int32", used=[5, 0, 2**40])
    refused(r"block_size is 4.0 \(float\): expected an integer", block_size=4.0, exc=TypeError)


def test_attention_refuses_a_walk_where_it_does_not_belong():
    # Host tensors: the CPU reads the table in order and takes no walk; a padded cache has
    # no blocks to walk. Refused before anything is written (the append of k_new included).
    rng = np.random.default_rng(9)
    used = [5, 0, 9]
    k = rng.standard_normal((8, 4, 2, 8)).astype(np.float32)
    v = rng.standard_normal((8, 4, 2, 8)).astype(np.float32)
    table = np.array([[3, 1, -1], [-1, -1, -1], [0, 4, 2]], np.int32)
    q = rng.standard_normal((3, 1, 4, 8)).astype(np.float32)
    walk = fa.block_walk(used, table, 4, 8)
    k_new = rng.standard_normal((3, 1, 2, 8)).astype(np.float32)
    before = k.copy(), v.copy()
    out = np.full(q.shape, 7.0, np.float32)
    with pytest.raises(ValueError, match="block_walk is for CUDA tensors"):
        fa.attention(q, k, v, seqused_k=used, block_table=table, block_walk=walk, out=out)
    with pytest.raises(ValueError, match="block_walk is for CUDA tensors"):
        fa.attention(q, k, v, seqused_k=used, block_table=table, block_walk=walk, k_new=k_new, v_new=k_new, out=out)
    with pytest.raises(ValueError, match="a padded cache has no blocks to walk"):
        fa.attention(q, k[:3], v[:3], seqused_k=used, block_walk=walk, out=out)
    assert np.all(out == 7.0), "output written on error"
    assert np.array_equal(k, before[0]) and np.array_equal(v, before[1]), "cache written on error"
    # Without the walk the same call runs.
    fa.attention(q, k, v, seqused_k=used, block_table=table, out=out)
    assert np.all(np.isfinite(out)) and not np.all(out == 7.0)
