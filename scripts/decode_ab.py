#!/usr/bin/env python3
"""A/B of fa-cpu decode builds (and PyTorch's CPU SDPA) on the same decode shapes, interleaved.

Each entry of --variants is a `bench_decode` example binary (fa-cpu/examples/bench_decode.rs;
build one per variant and copy it away). Every round runs every variant on every shape (one
`bench_decode --rounds N` process each, the order rotating from round to round), and, with
--torch, PyTorch's SDPA over a dense padded cache [B, Hkv, L, D] (enable_gqa=True) in this
process, each timed call after a copy of --copy-mib MiB that evicts the cache (as bench_decode
does). Prints per shape and variant the median time over rounds, the K/V GB/s, the ratio
PyTorch time / variant time and the paired ratio (time of the first variant / this one).

    taskset -c 0,1 python3 scripts/decode_ab.py --variants /tmp/base,/tmp/new --torch \
        --shapes bf16:1:4096:0,bf16:1:4096:16 --heads 64 --heads-kv 8 --rounds 5
"""
import argparse
import re
import statistics
import subprocess
import time


def run_variant(binary, shape, a):
    dt, b, n, page = shape
    cmd = [binary, "--dtype", dt, "--batch", str(b), "--cache", str(n), "--page", str(page),
           "--heads", str(a.heads), "--heads-kv", str(a.heads_kv), "--head-dim", str(a.head_dim),
           "--threads", str(a.threads), "--rounds", str(a.inner), "--copy-mib", str(a.copy_mib)]
    if a.splits:
        cmd += ["--splits", str(a.splits)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    m = re.search(r"splits (\d+) .*: ([0-9.]+) ms", out)
    return float(m.group(2)), int(m.group(1))


class Peer:
    def __init__(self, torch, a):
        self.torch, self.a, self.inputs = torch, a, {}
        n = max(a.copy_mib, 1) << 20
        self.src = torch.ones(n, dtype=torch.uint8)
        self.dst = torch.zeros_like(self.src)

    def run(self, shape):
        torch, a = self.torch, self.a
        dt, b, n, _ = shape
        key = (dt, b, n)
        if key not in self.inputs:
            tdt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dt]
            g = torch.Generator().manual_seed(1)
            q = torch.randn(b, a.heads, 1, a.head_dim, generator=g).to(tdt)
            k, v = (torch.randn(b, a.heads_kv, n, a.head_dim, generator=g).to(tdt) for _ in range(2))
            self.inputs[key] = (q, k, v)
        q, k, v = self.inputs[key]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        times = []
        with torch.no_grad():
            sdpa(q, k, v, enable_gqa=True)
            for _ in range(a.inner):
                self.dst.copy_(self.src)
                t = time.perf_counter()
                sdpa(q, k, v, enable_gqa=True)
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", required=True, help="comma-separated bench_decode binaries")
    p.add_argument("--shapes", required=True, help="dtype:batch:cache:page,... (page 0: padded)")
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--splits", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--inner", type=int, default=3, help="timed calls per process (median)")
    p.add_argument("--copy-mib", type=int, default=256, help="evicting copy before each call (0: none)")
    p.add_argument("--torch", action="store_true", help="PyTorch SDPA as the peer")
    a = p.parse_args()
    variants = a.variants.split(",")
    shapes = []
    for s in a.shapes.split(","):
        dt, b, n, page = s.split(":")
        shapes.append((dt, int(b), int(n), int(page)))
    peer = None
    if a.torch:
        import torch
        torch.set_num_threads(a.threads)
        peer = Peer(torch, a)
    names = variants + (["torch"] if peer else [])
    t = {(s, v): [] for s in shapes for v in names}
    splits = {}
    for r in range(a.rounds):
        for s in shapes:
            order = names[r % len(names):] + names[:r % len(names)]
            for v in order:
                if v == "torch":
                    t[(s, v)].append(peer.run(s))
                else:
                    ms, sp = run_variant(v, s, a)
                    t[(s, v)].append(ms)
                    splits[(s, v)] = sp
    print(f"# {a.heads} query / {a.heads_kv} KV heads, D {a.head_dim}, {a.threads} threads, "
          f"{a.rounds} rounds x {a.inner} calls, copy {a.copy_mib} MiB before each call")
    print("| shape | variant | splits | median ms | K/V GB/s | paired time ratio first/this (min-max) "
          "| PyTorch time / this | padded time / this |")
    print("|---|---|---|---|---|---|---|---|")
    for s in shapes:
        dt, b, n, page = s
        kv = 2 * b * n * a.heads_kv * a.head_dim * {"f32": 4, "bf16": 2, "f16": 2}[dt]
        for v in names:
            ms = statistics.median(t[(s, v)])
            pr = [x / y for x, y in zip(t[(s, names[0])], t[(s, v)])]
            vs_torch = ""
            if peer and v != "torch":
                vs_torch = f"{statistics.median([x / y for x, y in zip(t[(s, 'torch')], t[(s, v)])]):.2f}"
            pad = (dt, b, n, 0)
            vs_pad = ""
            if page != 0 and (pad, v) in t:
                vs_pad = f"{statistics.median([x / y for x, y in zip(t[(pad, v)], t[(s, v)])]):.3f}"
            print(f"| {dt} B{b} {n} {'pad' if page == 0 else 'page ' + str(page)} | {v} | "
                  f"{splits.get((s, v), '-')} | {ms:.3f} | {kv / ms / 1e6:.2f} | "
                  f"{statistics.median(pr):.3f} ({min(pr):.2f}-{max(pr):.2f}) | {vs_torch} | {vs_pad} |")


if __name__ == "__main__":
    main()
