#!/usr/bin/env python3
"""Decode peer on the GPU: PyTorch SDPA (flash, cuDNN, efficient and math backends) with a few
query tokens per sequence against a KV cache, GQA through `enable_gqa=True` (K/V are not
repeated), the same shapes `fa bench --decode` times (default: Llama-3 70B's layer, 64 query /
8 KV heads, head dim 128, bf16, batch 1 and 16, caches 4k-128k).

K/V memory layouts (`--kv-layouts`): `bshd` stores the cache as FlashAttention's KV cache
`[batch, cache, heads_kv, head_dim]` and hands SDPA the transposed view (rows with layout
`padded`, the same memory as decode_bench's `padded`); `bhsd` stores it head-major
`[batch, heads_kv, cache, head_dim]`, each head's keys contiguous (rows `padded_bhsd`, as
decode_bench's `padded_bhsd`). SDPA has no paged cache, so its figure for a paged shape is the
`bshd` one (the paged rows repeat it with `"paged_as": "padded"`).
Several queries per sequence are causal bottom-right against the cache (decode with speculative
tokens); SDPA's `is_causal` aligns top-left, so they go as an explicit boolean mask (which rules
out the flash backend, as it does in PyTorch itself).

Prints progress to stderr and one JSON document to stdout: the measured device-copy bandwidth
(read + write, the ceiling the issue's "fraction of copy bandwidth" divides by) and one row per
shape with each backend's median time (us), its K/V read bandwidth (GB/s), or its error, and
the best backend. `--json FILE` also writes the document to FILE.

Usage: python3 scripts/torch_sdpa_decode.py [--batches 1,16] [--caches 4096,16384,65536,131072]
       [--heads-q 64] [--heads-kv 8] [--hdim 128] [--queries 1] [--page-sizes 16,256]
       [--dtype bf16|fp16] [--iters 50] [--max-gib 40] [--flush read|write|none] [--json FILE]

Each timed call follows a flush on the same stream (the GPU stays busy while the host queues
the call, so the host's launch overhead is not timed): `read` (default) sums a 512 MiB buffer,
leaving the L2 full of clean lines, as the previous layer's reads do in a decode step; `write`
zeroes it, leaving up to the L2's size of dirty lines whose write-back then shares DRAM with
the timed call (the method of the first decode tables, 2026-12-01 in docs/history/gpu-notes.md);
`none` times back-to-back calls.
decode_bench's `--flush read|copy|none` does the same on our side.
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = (
    ("flash", SDPBackend.FLASH_ATTENTION),
    ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ("math", SDPBackend.MATH),
)


def ints(s):
    return [int(x) for x in s.split(",") if x]


_FLUSH = None


def median_seconds(fn, iters, warmup=5, flush="read"):
    """Median of `iters` CUDA-event timings of fn (after `warmup` untimed calls). With `flush`
    "read" or "write", each timed call follows a 512 MiB sum or write on the same stream: the
    L2 cache (50 MiB on an H200) holds none of the inputs, and the GPU is still busy with the
    flush while the host queues the start event and fn's launches, so the host's launch
    overhead is not timed (decode_bench does the same)."""
    global _FLUSH
    if flush != "none" and _FLUSH is None:
        _FLUSH = torch.empty(512 * 1024**2, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        if flush == "read":
            _FLUSH.sum()
        elif flush == "write":
            _FLUSH.zero_()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2] / 1e3


def copy_bandwidth(iters):
    """Device-to-device copy of 2 GiB, bytes read + written per second (GB/s)."""
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = median_seconds(lambda: y.copy_(x), iters, flush="none")
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2 * 1024**3 / t / 1e9


def bottom_right_mask(queries, cache, device):
    """Query i (of `queries`) sees keys j <= i + cache - queries (True = attend)."""
    i = torch.arange(queries, device=device)[:, None]
    j = torch.arange(cache, device=device)[None, :]
    return j <= i + (cache - queries)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=ints, default=[1, 16])
    ap.add_argument("--caches", type=ints, default=[4096, 16384, 65536, 131072])
    ap.add_argument("--heads-q", type=int, default=64)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--queries", type=int, default=1)
    ap.add_argument("--page-sizes", type=ints, default=[16, 256])
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--max-gib", type=float, default=40.0, help="skip caches larger than this")
    ap.add_argument("--kv-layouts", default="bshd,bhsd", help="bshd and/or bhsd (see the module doc)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--flush", choices=["read", "write", "none"], default="read",
                    help="the L2 flush before each timed call (see the module doc)")
    ap.add_argument("--no-flush", action="store_true", help="the same as --flush none")
    args = ap.parse_args()
    if args.no_flush:
        args.flush = "none"

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    copy_gbs = copy_bandwidth(20)
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write)", file=sys.stderr)
    hq, hk, d, sq = args.heads_q, args.heads_kv, args.hdim, args.queries
    rows = []
    for batch in args.batches:
        for cache in args.caches:
            kv_bytes = 2 * batch * cache * hk * d * 2
            if kv_bytes > args.max_gib * 1024**3:
                print(f"skip batch {batch} cache {cache}: {kv_bytes / 1024**3:.0f} GiB", file=sys.stderr)
                continue
            q = torch.randn(batch, hq, sq, d, device="cuda", dtype=dtype)
            mask = bottom_right_mask(sq, cache, "cuda") if sq > 1 else None
            for kv_layout in args.kv_layouts.split(","):
                if kv_layout == "bshd":
                    # FlashAttention's cache layout; SDPA gets the [batch, heads_kv, cache, d] view.
                    k = torch.randn(batch, cache, hk, d, device="cuda", dtype=dtype).transpose(1, 2)
                    v = torch.randn(batch, cache, hk, d, device="cuda", dtype=dtype).transpose(1, 2)
                    layout = "padded"
                elif kv_layout == "bhsd":
                    k = torch.randn(batch, hk, cache, d, device="cuda", dtype=dtype)
                    v = torch.randn(batch, hk, cache, d, device="cuda", dtype=dtype)
                    layout = "padded_bhsd"
                else:
                    raise SystemExit(f"--kv-layouts: bshd or bhsd, not {kv_layout}")
                row = dict(
                    batch=batch, cache=cache, queries=sq, heads_q=hq, heads_kv=hk, hdim=d,
                    dtype=args.dtype, layout=layout, kv_gb=round(kv_bytes / 1e9, 4),
                    copy_gbs=round(copy_gbs, 0),
                )
                for name, backend in BACKENDS:
                    try:
                        with sdpa_kernel([backend]):
                            t = median_seconds(
                                lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                                args.iters,
                                flush=args.flush,
                            )
                        row[name + "_us"] = round(t * 1e6, 1)
                        row[name + "_gbs"] = round(kv_bytes / t / 1e9, 0)
                    except Exception as ex:  # a backend that refuses the shape says why
                        row[name + "_us"] = None
                        row[name + "_err"] = str(ex).splitlines()[0][:120] if str(ex) else type(ex).__name__
                timed = [(row[n + "_us"], n) for n, _ in BACKENDS if row.get(n + "_us")]
                best = min(timed, default=None)
                row["best_backend"] = best[1] if best else None
                row["best_us"] = best[0] if best else None
                row["best_frac_of_copy"] = round(kv_bytes / (best[0] / 1e6) / 1e9 / copy_gbs, 3) if best else None
                rows.append(row)
                if kv_layout == "bshd":
                    for page in args.page_sizes:
                        rows.append(dict(row, layout=f"paged{page}", page_size=page, paged_as="padded"))
                print(
                    f"batch {batch} cache {cache} {layout}: "
                    + " ".join(f"{n} {row[n + '_us']}" for n, _ in BACKENDS)
                    + f" us; best {row['best_backend']} ({row['best_frac_of_copy']} of copy)",
                    file=sys.stderr,
                )
                del k, v
            del q, mask
            torch.cuda.empty_cache()
    doc = dict(
        peer="torch_sdpa_decode",
        torch=torch.__version__,
        device=torch.cuda.get_device_name(),
        copy_gbs=round(copy_gbs, 0),
        flush=args.flush,
        rows=rows,
    )
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
