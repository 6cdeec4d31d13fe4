"""The tests' oracle: naive attention in float64 NumPy (full score matrices: tests only), with
the library's conventions (DESIGN.md): bottom-right aligned causal and windows, softcap on
the scaled scores, GQA by head groups, a row that sees no key gives 0 and LSE -inf."""

import numpy as np

try:  # NumPy has no bfloat16; ml_dtypes adds it (optional).
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    BF16 = None

#: Normwise error bounds per input dtype (||o - ref||_F / ||ref||_F).
BOUNDS = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 2e-2}


def visible(seqlen_q, seqlen_k, causal=False, window=(-1, -1)):
    """Boolean (seqlen_q, seqlen_k): query i sees key j (bottom-right aligned)."""
    left, right = window
    if causal:
        right = 0
    i = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    j = np.arange(seqlen_k)[None, :]
    ok = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    return ok


def attention_f64(q, k, v, causal=False, window=(-1, -1), softcap=None, scale=None, sinks=None):
    """BSHD inputs (any float dtype) -> (out (B, Sq, Hq, Dv) float64, lse (B, Hq, Sq)).
    ``sinks`` (Hq,): one more score per row, of no value (attention sinks)."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    mask = visible(seqlen_q, seqlen_k, causal, window)
    s = np.where(mask, s, -np.inf)
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64)[None, :, None, None]
        s = np.concatenate([s, np.broadcast_to(sink, s.shape[:-1] + (1,))], axis=-1)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)  # initial: no key at all (seqlen_k 0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, p / l, 0.0)
        lse = np.where(l[..., 0] > 0, np.log(l[..., 0]) + m_safe[..., 0], -np.inf)
    if sinks is not None:
        p = p[..., :-1]  # the sink's probability carries no value
    out = np.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def varlen_f64(q, k, v, cu_q, cu_k, **kw):
    """Packed (total, heads, dim) inputs -> (out (total_q, Hq, Dv), lse (Hq, total_q))."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = attention_f64(q[None, qs], k[None, ks], v[None, ks], **kw)
        outs.append(o[0])
        lses.append(l[0])
    return np.concatenate(outs, axis=0), np.concatenate(lses, axis=1)


def normwise_error(got, ref):
    got = np.asarray(got).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return np.linalg.norm(got - ref) / (denom if denom > 0 else 1.0)


def gather_cache(k, seqused_k, block_table=None):
    """Each sequence's first ``seqused_k[b]`` keys of a padded ``(batch, capacity, H, D)`` or
    paged ``(num_blocks, block_size, H, D)`` cache, in order: a list of ``(used, H, D)``
    arrays. Reads nothing else (a paged cache only through the table's used entries)."""
    k = np.asarray(k)
    out = []
    for b, used in enumerate(int(x) for x in seqused_k):
        if block_table is None:
            out.append(k[b, :used])
        else:
            bs = k.shape[1]
            rows = [k[int(block_table[b][t // bs]), t % bs] for t in range(used)]
            out.append(np.stack(rows) if rows else k[:0, 0])
    return out


def cache_f64(q, k, v, seqused_k, block_table=None, **kw):
    """Attention of ``q`` (B, Sq, Hq, D) against a KV cache (see ``gather_cache``), masks
    bottom-right against each used length -> (out (B, Sq, Hq, Dv), lse (B, Hq, Sq))."""
    q = np.asarray(q)
    ks = gather_cache(k, seqused_k, block_table)
    vs = gather_cache(v, seqused_k, block_table)
    batch, seqlen_q, heads_q, _ = q.shape
    out = np.zeros((batch, seqlen_q, heads_q, np.asarray(v).shape[-1]))
    lse = np.full((batch, heads_q, seqlen_q), -np.inf)
    for b in range(batch):
        if len(ks[b]) == 0:
            if kw.get("sinks") is not None:  # no key but a sink: zeros and the sink
                lse[b] = np.asarray(kw["sinks"], dtype=np.float64)[:, None]
            continue  # no key: zeros and -inf
        o, l = attention_f64(q[b : b + 1], ks[b][None], vs[b][None], **kw)
        out[b], lse[b] = o[0], l[0]
    return out, lse
