#!/usr/bin/env python3
"""Python call overhead on the CPU path (issue 14): the same decode-sized call through
`flash_attention_rs.attention` (NumPy arrays, the C ABI underneath) and through the Rust
library (`fa bench --json`, which times `flash_attention::Backend::forward` in-process).

Default shape: 1 query, 4k keys, 8 heads, head dim 128, f32, no mask. The machine's speed
drifts, so the two sides alternate round by round (order flipped every round) and the figure
is the median over rounds of python_time / rust_time (<= 1.2 is the issue's target). Both sides
use every CPU the process may use (the Python API has no thread option; `fa` gets --threads
with that count).

    python3 scripts/py_overhead.py --fa target/release/fa [--rounds 7] [--iters 200]
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import numpy as np

import flash_attention_rs as fa


def rust_ms(args, threads):
    cmd = [args.fa, "bench", "--backend", "cpu", "--batch", "1", "--seqlen", str(args.queries),
           "--seqlen-k", str(args.keys), "--heads", str(args.heads), "--head-dim",
           str(args.head_dim), "--dtype", "f32", "--threads", str(threads), "--iters",
           str(args.iters), "--warmup", str(args.warmup), "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rec = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return rec["time_ms_median"]


def python_ms(args, q, k, v, out):
    for _ in range(args.warmup):
        fa.attention(q, k, v, out=out)
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        fa.attention(q, k, v, out=out)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fa", default="target/release/fa")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--queries", type=int, default=1)
    p.add_argument("--keys", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    threads = len(os.sched_getaffinity(0))
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, args.queries, args.heads, args.head_dim), dtype=np.float32)
    k = rng.standard_normal((1, args.keys, args.heads, args.head_dim), dtype=np.float32)
    v = rng.standard_normal((1, args.keys, args.heads, args.head_dim), dtype=np.float32)
    out = np.empty_like(q)
    ratios, py_all, rs_all = [], [], []
    for rnd in range(args.rounds):
        if rnd % 2 == 0:
            py = python_ms(args, q, k, v, out)
            rs = rust_ms(args, threads)
        else:
            rs = rust_ms(args, threads)
            py = python_ms(args, q, k, v, out)
        ratios.append(py / rs)
        py_all.append(py)
        rs_all.append(rs)
        print(f"round {rnd + 1}: python {py:.4f} ms, rust {rs:.4f} ms, ratio {py / rs:.3f}",
              flush=True)
    print(f"# q [1,{args.queries},{args.heads},{args.head_dim}] k/v [1,{args.keys},"
          f"{args.heads},{args.head_dim}] f32, {threads} threads, {args.rounds} rounds x "
          f"{args.iters} calls: python median {statistics.median(py_all):.4f} ms, rust median "
          f"{statistics.median(rs_all):.4f} ms, median ratio python/rust "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
