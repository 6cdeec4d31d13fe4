#!/usr/bin/env python3
"""fa-cpu against PyTorch's CPU SDPA, same shapes, same threads, same run.

PyTorch side: torch.nn.functional.scaled_dot_product_attention on CPU tensors (its
flash-attention CPU kernel for f32 and bf16), torch.set_num_threads(threads).
Our side: `fa bench --json` (or, with --ours example, the fa-cpu example
`bench_forward`, which prints the same JSON line).

These 2-core machines drift by 2-3x over minutes, so the two sides are timed alternately,
shape by shape, for several rounds (the order flips every round), and the reported figure
is the median over rounds of the per-round ratio peer_time / our_time (> 1: we are faster).

--backward: the backward pass instead (issue 17): ours `fa bench --backward --json`, the peer
SDPA's autograd backward (`o.backward(dO)` after a timed forward), both per iteration, so the
figures are the backward's median and the forward + backward total's median (FLOPs: backward
2.5 x forward).

--decode: decode over a KV cache instead (issue 15's CPU target): one new query token per
sequence, 32 query / 8 KV heads, head dim 128, --batches 1,4 x --cache-lens 4096,16384,65536.
Ours `fa bench --decode --json` on each shape (--page-size 0: a padded cache, else paged); the
peer SDPA with enable_gqa=True (no mask: the new token sees every key) over a dense padded
cache, q [B, Hq, 1, D], K/V contiguous [B, Hkv, L, D], whatever --page-size says (SDPA has no
paged cache). Both sides copy a 1 GiB buffer (the same for every shape) before each timed
call, so neither reads the cache from the last-level cache, and each reports its own copy
bandwidth (read + write); ours also times a plain read of it (the read probe). Reported per
shape: the median over rounds of peer_time / our_time, our K/V GB/s and our fractions of copy
and of the read probe (from our JSON), the peer's GB/s on the same byte count
(K + V read once per KV head) and its fraction of its own copy; the header names the SDPA
backend PyTorch picks for those inputs (torch._fused_sdp_choice: flash_attention on CPU).

Setup:  python3 -m venv /work/venv-peer
        /work/venv-peer/bin/pip install -r scripts/requirements-cpu-peer.txt
        cargo build --release -p fa-cli        (or -p fa-cpu --example bench_forward)
Run:    /work/venv-peer/bin/python scripts/cpu_peer.py --threads 2 --rounds 5
        /work/venv-peer/bin/python scripts/cpu_peer.py --ours fa --threads 2 --decode --rounds 5 \
            --iters 7 --dtypes f32,bf16
On the GPU machine's Xeon: scripts/cpu-peer-session.sh (BACKWARD=1, DECODE=1).
"""

import argparse
import json
import os
import platform
import statistics
import shlex
import subprocess
import sys
import time

DTYPES = ("f32", "bf16", "f16")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def flops(b, h, n, d, causal):
    f = 4.0 * b * h * n * n * d
    return f / 2 if causal else f


def backward_flops(b, h, n, d, causal):
    """softmax_core::flops::backward: 2.5 x the forward's (five products against two)."""
    return 2.5 * flops(b, h, n, d, causal)


def ours_command(args, dtype, b, h, n, d, causal):
    if args.ours == "fa":
        cmd = [args.fa, "bench", "--json", "--backend", "cpu", "--threads", str(args.threads),
               "--batch", str(b), "--heads", str(h), "--seqlen", str(n), "--head-dim", str(d),
               "--dtype", dtype, "--iters", str(args.iters), "--warmup", str(args.warmup)]
        if args.backward:
            cmd.append("--backward")
        cmd += shlex.split(args.fa_args)
    else:
        cmd = [args.example, "--threads", str(args.threads), "--batch", str(b), "--heads", str(h),
               "--seqlen", str(n), "--head-dim", str(d), "--dtype", dtype,
               "--reps", str(args.iters), "--warmup", str(args.warmup)]
    if causal:
        cmd.append("--causal")
    return cmd


def run_ours(args, dtype, b, h, n, d, causal):
    return run_json(ours_command(args, dtype, b, h, n, d, causal))


def run_json(cmd):
    """Runs our side and returns the first JSON line it prints (one shape per call)."""
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        sys.exit(f"our side failed: {' '.join(cmd)}\n{res.stderr}")
    for line in res.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    sys.exit(f"our side printed no JSON: {' '.join(cmd)}\n{res.stdout}")


def run_peer(torch, dtype, b, h, n, d, causal, iters, warmup):
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    gen = torch.Generator().manual_seed(1)
    # SDPA takes [batch, heads, seq, dim]; inputs drawn in BSHD like ours, then viewed.
    q, k, v = (torch.randn(b, n, h, d, generator=gen).to(tdt).transpose(1, 2)
               for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    times = []
    with torch.no_grad():
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            sdpa(q, k, v, is_causal=causal)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt * 1e3)
    return statistics.median(times), min(times)


def run_peer_backward(torch, dtype, b, h, n, d, causal, iters, warmup):
    """SDPA forward then its autograd backward, each timed, per iteration: (median backward ms,
    fastest backward ms, median forward + backward ms)."""
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, n, h, d, generator=gen).to(tdt).transpose(1, 2).requires_grad_()
               for _ in range(3))
    d_o = torch.randn(b, n, h, d, generator=gen).to(tdt).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    bwd, total = [], []
    for i in range(warmup + iters):
        q.grad = k.grad = v.grad = None
        t0 = time.perf_counter()
        o = sdpa(q, k, v, is_causal=causal)
        t1 = time.perf_counter()
        o.backward(d_o)
        t2 = time.perf_counter()
        if i >= warmup:
            bwd.append((t2 - t1) * 1e3)
            total.append((t2 - t0) * 1e3)
    return statistics.median(bwd), min(bwd), statistics.median(total)


def interleave(args, shapes, sides):
    """The round loop of every pass: `sides` maps "ours" and "peer" to a function of the shape
    returning a dict of measurements; each round runs both sides on each shape in turn, ours
    first on even rounds and the peer first on odd ones, and yields (round, shape, the merged
    dicts)."""
    for rnd in range(args.rounds):
        order = ("ours", "peer") if rnd % 2 == 0 else ("peer", "ours")
        for s in shapes:
            got = {}
            for side in order:
                got.update(sides[side](s))
            yield rnd, s, got
        print(f"# round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)


def write_json(args, log):
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(log, f, indent=1)


def main_backward(args, torch, shapes):
    """--backward: alternate rounds of `fa bench --backward` and SDPA's backward."""
    results = {s: {"ratio": [], "ratio_min": [], "ratio_total": [], "ours": [], "peer": [],
                   "ours_total": [], "peer_total": [], "alloc": None, "io": None} for s in shapes}

    def ours(s):
        rec = run_ours(args, *s)
        results[s]["alloc"] = rec.get("backward_alloc_bytes")
        results[s]["io"] = rec.get("io_bytes")
        return {"ours": rec["backward_ms_median"], "ours_min": rec["backward_ms_min"],
                "ours_total": rec["total_ms_median"]}

    def peer(s):
        m, mn, tot = run_peer_backward(torch, *s, args.iters, args.warmup)
        return {"peer": m, "peer_min": mn, "peer_total": tot}

    log = []
    for rnd, s, got in interleave(args, shapes, {"ours": ours, "peer": peer}):
        dt, b, h, n, d, c = s
        r = results[s]
        for key in ("ours", "peer", "ours_total", "peer_total"):
            r[key].append(got[key])
        r["ratio"].append(got["peer"] / got["ours"])
        r["ratio_min"].append(got["peer_min"] / got["ours_min"])
        r["ratio_total"].append(got["peer_total"] / got["ours_total"])
        log.append({"round": rnd, "dtype": dt, "batch": b, "heads": h, "seqlen": n,
                    "head_dim": d, "causal": c, "pass": "backward",
                    "ours_bwd_ms": got["ours"], "peer_bwd_ms": got["peer"],
                    "ours_bwd_min_ms": got["ours_min"], "peer_bwd_min_ms": got["peer_min"],
                    "ours_total_ms": got["ours_total"], "peer_total_ms": got["peer_total"]})

    print("| dtype | N | D | causal | ours bwd GFLOP/s | PyTorch bwd GFLOP/s | **backward: median ratio (PyTorch time / ours)** | min–max ratio | ratio of fastest calls | fwd+bwd: ours ms | PyTorch ms | **fwd+bwd median ratio** | our backward's allocation |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in shapes:
        dt, b, h, n, d, c = s
        r = results[s]
        f = backward_flops(b, h, n, d, c)
        ours = f / statistics.median(r["ours"]) / 1e6
        peer = f / statistics.median(r["peer"]) / 1e6
        alloc = r["alloc"]
        alloc = "-" if alloc is None else f"{alloc / 2**20:.1f} MiB (io {r['io'] / 2**20:.0f} MiB)"
        print(f"| {dt} | {n} | {d} | {'yes' if c else 'no'} | {ours:.1f} | {peer:.1f} | "
              f"**{statistics.median(r['ratio']):.2f}** | {min(r['ratio']):.2f}–{max(r['ratio']):.2f} | "
              f"{statistics.median(r['ratio_min']):.2f} | {statistics.median(r['ours_total']):.1f} | "
              f"{statistics.median(r['peer_total']):.1f} | **{statistics.median(r['ratio_total']):.2f}** | {alloc} |")
    for dt in sorted({s[0] for s in shapes}):
        ratios = [statistics.median(results[s]["ratio"]) for s in shapes if s[0] == dt]
        totals = [statistics.median(results[s]["ratio_total"]) for s in shapes if s[0] == dt]
        print(f"# {dt} backward: worst shape ratio {min(ratios):.2f}, median over shapes "
              f"{statistics.median(ratios):.2f}; forward+backward: worst {min(totals):.2f}, "
              f"median {statistics.median(totals):.2f}")
    write_json(args, log)


def decode_kv_bytes(dtype, b, cache, hkv, d):
    """decode_bench::DecodeShape::kv_bytes: K and V read once per KV head."""
    return 2 * b * cache * hkv * d * {"f32": 4, "bf16": 2, "f16": 2}[dtype]


def decode_command(args, dtype, b, cache, hq, hkv, d, page):
    return [args.fa, "bench", "--decode", "--json", "--backend", "cpu",
            "--threads", str(args.threads), "--batch", str(b), "--cache-len", str(cache),
            "--heads", str(hq), "--heads-kv", str(hkv), "--head-dim", str(d),
            "--page-size", str(page), "--dtype", dtype,
            "--iters", str(args.iters), "--warmup", str(args.warmup)] + shlex.split(args.fa_args)


class DecodePeer:
    """SDPA over a dense padded cache: q [B, Hq, 1, D], K/V contiguous [B, Hkv, L, D] (its own
    layout; SDPA has no paged cache), GQA through enable_gqa=True, no mask (the one new token
    sees every key). Like `fa bench --decode`, every timed call follows a copy between two
    1 GiB buffers (torch's copy_, same threads), so that neither side finds
    the cache in the last-level cache, and that copy gives the peer's own copy bandwidth."""

    def __init__(self, torch):
        self.torch = torch
        self.inputs = {}  # per shape: the cache is drawn once, not every round
        self.kernels = {}
        self.copy_src = self.copy_dst = None  # shared by all shapes, sliced to each one's size

    def setup(self, dtype, b, cache, hq, hkv, d):
        key = (dtype, b, cache, hq, hkv, d)
        if key not in self.inputs:
            torch = self.torch
            tdt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
            gen = torch.Generator().manual_seed(1)
            q = torch.randn(b, hq, 1, d, generator=gen).to(tdt)
            k, v = (torch.randn(b, hkv, cache, d, generator=gen).to(tdt) for _ in range(2))
            nbytes = 1 << 30  # fixed, as `fa bench --decode`'s probes (PROBE_BYTES)
            if self.copy_src is None or self.copy_src.numel() < nbytes:
                self.copy_src = torch.ones(nbytes, dtype=torch.uint8)
                self.copy_dst = torch.zeros_like(self.copy_src)
            self.inputs[key] = (q, k, v, nbytes)
        q, k, v, nbytes = self.inputs[key]
        return q, k, v, self.copy_src[:nbytes], self.copy_dst[:nbytes]

    def kernel(self, dtype, b, cache, hq, hkv, d):
        """The SDPA backend PyTorch picks for this shape (torch._fused_sdp_choice)."""
        key = (dtype, b, cache, hq, hkv, d)
        if key not in self.kernels:
            q, k, v, _, _ = self.setup(*key)
            try:
                from torch.nn.attention import SDPBackend
                choice = self.torch._fused_sdp_choice(q, k, v, enable_gqa=True)
                self.kernels[key] = SDPBackend(choice).name.lower()
            except (AttributeError, ImportError, TypeError, ValueError) as e:
                self.kernels[key] = f"unknown ({type(e).__name__})"
        return self.kernels[key]

    def run(self, dtype, b, cache, hq, hkv, d, iters, warmup):
        """(median ms, fastest ms, median over calls of its copy's GB/s (read + write))."""
        q, k, v, src, dst = self.setup(dtype, b, cache, hq, hkv, d)
        sdpa = self.torch.nn.functional.scaled_dot_product_attention
        times, copies = [], []
        with self.torch.no_grad():
            for i in range(warmup + iters):
                t0 = time.perf_counter()
                dst.copy_(src)
                t1 = time.perf_counter()
                sdpa(q, k, v, enable_gqa=True)
                t2 = time.perf_counter()
                if i >= warmup:
                    copies.append(2 * src.numel() / (t1 - t0) / 1e9)
                    times.append((t2 - t1) * 1e3)
        return statistics.median(times), min(times), statistics.median(copies)


def main_decode(args, torch, dtypes):
    """--decode: alternate rounds of `fa bench --decode` and SDPA over a dense cache."""
    heads = args.heads or 32
    hkv = args.heads_kv or max(heads // 4, 1)
    d = args.decode_head_dim
    shapes = [(dt, b, L, heads, hkv, d, page) for dt in dtypes
              for b in (int(x) for x in args.batches.split(","))
              for L in (int(x) for x in args.cache_lens.split(","))
              for page in (int(x) for x in args.page_size.split(","))]
    peer_side = DecodePeer(torch)
    print(f"# decode: {heads} query / {hkv} KV heads, head dim {d}, one new token; ours "
          f"`fa bench --decode` (page size 0: padded cache, else paged), the peer SDPA with "
          f"enable_gqa=True over a dense padded [B, Hkv, L, D] cache whatever the page size "
          f"(SDPA has no paged cache); GB/s: K+V bytes read once per KV head over the median "
          f"time; both sides copy a 1 GiB buffer before each timed call (copy GB/s: read + "
          f"write, each side its own; ours also reads it: the read probe)", flush=True)
    for dt in dtypes:
        kernels = sorted({peer_side.kernel(*s[:6]) for s in shapes if s[0] == dt})
        print(f"# {dt}: SDPA backend {', '.join(kernels)}", flush=True)
    results = {s: {k: [] for k in ("ratio", "ratio_min", "ours", "peer", "ours_gbps",
                                   "ours_frac", "ours_copy", "peer_copy", "peer_frac",
                                   "ours_read", "ours_frac_read")}
               for s in shapes}

    def ours(s):
        rec = run_json(decode_command(args, *s))
        return {"ours": rec["time_ms_median"], "ours_min": rec["time_ms_min"],
                "ours_gbps": rec["kv_gbps"], "ours_copy": rec["copy_gbps"],
                "ours_frac": rec["fraction_of_copy"], "splits": rec.get("kv_splits"),
                "ours_read": rec.get("read_gbps") or float("nan"),
                "ours_frac_read": rec.get("fraction_of_read") or float("nan")}

    def peer(s):
        m, mn, copy = peer_side.run(*s[:6], args.iters, args.warmup)
        return {"peer": m, "peer_min": mn, "peer_copy": copy}

    log = []
    for rnd, s, got in interleave(args, shapes, {"ours": ours, "peer": peer}):
        dt, b, L, hq, hk, hd, page = s
        r = results[s]
        kv = decode_kv_bytes(dt, b, L, hk, hd)
        got["peer_gbps"] = kv / (got["peer"] * 1e-3) / 1e9
        got["peer_frac"] = got["peer_gbps"] / got["peer_copy"]
        for key in ("ours", "peer", "ours_gbps", "ours_frac", "ours_copy", "peer_copy",
                    "peer_frac", "ours_read", "ours_frac_read"):
            r[key].append(got[key])
        r["splits"] = got["splits"]
        r["ratio"].append(got["peer"] / got["ours"])
        r["ratio_min"].append(got["peer_min"] / got["ours_min"])
        log.append({"round": rnd, "dtype": dt, "batch": b, "cache_len": L, "heads": hq,
                    "heads_kv": hk, "head_dim": hd, "page_size": page, "pass": "decode",
                    "peer_cache": "padded", "peer_kernel": peer_side.kernel(*s[:6]),
                    "kv_bytes": kv, "ours_ms": got["ours"], "peer_ms": got["peer"],
                    "ours_min_ms": got["ours_min"], "peer_min_ms": got["peer_min"],
                    "ours_kv_gbps": got["ours_gbps"], "peer_kv_gbps": got["peer_gbps"],
                    "ours_copy_gbps": got["ours_copy"], "peer_copy_gbps": got["peer_copy"],
                    "ours_fraction_of_copy": got["ours_frac"],
                    "peer_fraction_of_copy": got["peer_frac"], "kv_splits": got["splits"],
                    "ours_read_gbps": got["ours_read"],
                    "ours_fraction_of_read": got["ours_frac_read"]})

    med = statistics.median
    print("| dtype | batch | cache | page (ours) | K+V MiB | ours GB/s | **ours: fraction of copy** "
          "| PyTorch GB/s (padded) | PyTorch: fraction of its copy | **median ratio (PyTorch time / ours)** "
          "| min–max ratio | ratio of fastest calls | copy GB/s ours / PyTorch | our splits "
          "| our read probe GB/s | **ours: fraction of read** |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in shapes:
        dt, b, L, hq, hk, hd, page = s
        r = results[s]
        kv = decode_kv_bytes(dt, b, L, hk, hd)
        print(f"| {dt} | {b} | {L} | {page or 'padded'} | {kv / 2**20:.0f} | "
              f"{med(r['ours_gbps']):.1f} | **{med(r['ours_frac']):.2f}** | "
              f"{kv / (med(r['peer']) * 1e-3) / 1e9:.1f} | {med(r['peer_frac']):.2f} | "
              f"**{med(r['ratio']):.2f}** | {min(r['ratio']):.2f}–{max(r['ratio']):.2f} | "
              f"{med(r['ratio_min']):.2f} | {med(r['ours_copy']):.1f} / {med(r['peer_copy']):.1f} | "
              f"{r['splits']} | {med(r['ours_read']):.1f} | **{med(r['ours_frac_read']):.2f}** |")
    for dt in dtypes:
        ratios = [med(results[s]["ratio"]) for s in shapes if s[0] == dt]
        fracs = [med(results[s]["ours_frac"]) for s in shapes if s[0] == dt]
        reads = [med(results[s]["ours_frac_read"]) for s in shapes if s[0] == dt]
        print(f"# {dt} decode: ratio worst {min(ratios):.2f}, median over shapes "
              f"{med(ratios):.2f} (target >= 1.5); fraction of copy worst {min(fracs):.2f}, "
              f"median {med(fracs):.2f} (target >= 0.70); fraction of the read probe worst "
              f"{min(reads):.2f}, median {med(reads):.2f}")
    write_json(args, log)


def add_shape_args(p, heads=8):
    """The shape flags (defaults: issue 5's grid), shared with cpu_ab.py."""
    p.add_argument("--heads", type=int, default=heads,
                   help=f"query heads (default {heads or '8; 32 with --decode'})")
    p.add_argument("--seqlens", default="1024,2048,4096")
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--masks", default="none,causal")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3, help="timed runs per side per round (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    add_shape_args(p, heads=None)
    p.add_argument("--decode", action="store_true",
                   help="decode over a KV cache instead (issue 15): ours `fa bench --decode`, "
                        "the peer SDPA over a dense padded cache; needs --ours fa")
    p.add_argument("--batches", default="1,4", help="decode: sequences")
    p.add_argument("--cache-lens", default="4096,16384,65536", help="decode: keys per sequence")
    p.add_argument("--heads-kv", type=int, default=None, help="decode: KV heads (default heads/4)")
    p.add_argument("--decode-head-dim", type=int, default=128, help="decode: head dimension")
    p.add_argument("--page-size", default="0",
                   help="decode: our cache's keys per block, 0 = padded (comma list sweeps; "
                        "the peer is always padded)")
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--ours", choices=("fa", "example"), default=None,
                   help="our side: `fa bench --json` or the fa-cpu example (default: fa if built)")
    p.add_argument("--fa", default="target/release/fa")
    p.add_argument("--fa-args", default="",
                   help="more flags for every `fa` call of our side, e.g. '--prefetch next' "
                        "or '--simd avx512f' (one shell-quoted string)")
    p.add_argument("--example", default="target/release/examples/bench_forward")
    p.add_argument("--json-out", default=None, help="also write every measurement here")
    p.add_argument("--backward", action="store_true",
                   help="time the backward (and forward + backward) against SDPA's autograd "
                        "backward; needs --ours fa")
    args = p.parse_args()
    if args.ours is None:
        args.ours = "fa" if os.path.exists(args.fa) else "example"
    if args.heads is None and not args.decode:
        args.heads = 8

    import torch
    torch.set_num_threads(args.threads)
    seqlens = [int(x) for x in args.seqlens.split(",")]
    dims = [int(x) for x in args.head_dims.split(",")]
    masks = [m == "causal" for m in args.masks.split(",")]
    dtypes = [x for x in args.dtypes.split(",") if x in DTYPES]
    shapes = [(dt, args.batch, args.heads, n, d, c) for dt in dtypes for n in seqlens
              for d in dims for c in masks]

    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu_model()}, "
          f"{os.cpu_count()} CPUs, threads={args.threads}, torch {torch.__version__} "
          f"(cpu capability {torch.backends.cpu.get_cpu_capability()}), ours={args.ours}, "
          f"rounds={args.rounds}, iters={args.iters}"
          f"{', pass=backward' if args.backward else ''}{', pass=decode' if args.decode else ''}"
          f"{', fa args: ' + args.fa_args if args.fa_args else ''}",
          flush=True)
    if args.decode:
        if args.ours != "fa":
            sys.exit("--decode needs --ours fa (the fa binary's bench --decode)")
        main_decode(args, torch, dtypes)
        return
    if args.backward:
        if args.ours != "fa":
            sys.exit("--backward needs --ours fa (the fa binary's bench --backward)")
        main_backward(args, torch, shapes)
        return
    results = {s: {"ratio": [], "ratio_min": [], "ours": [], "peer": [], "ours_min": [],
                   "peer_min": [], "simd": None} for s in shapes}
    def ours(s):
        rec = run_ours(args, *s)
        results[s]["simd"] = rec.get("simd")
        results[s]["rss"] = rec.get("peak_rss_bytes")
        return {"ours": rec["time_ms_median"],
                "ours_min": rec.get("time_ms_min", rec["time_ms_median"])}

    def peer(s):
        m, mn = run_peer(torch, *s, args.iters, args.warmup)
        return {"peer": m, "peer_min": mn}

    log = []
    for rnd, s, got in interleave(args, shapes, {"ours": ours, "peer": peer}):
        dt, b, h, n, d, c = s
        r = results[s]
        for key in ("ours", "peer", "ours_min", "peer_min"):
            r[key].append(got[key])
        r["ratio"].append(got["peer"] / got["ours"])
        r["ratio_min"].append(got["peer_min"] / got["ours_min"])
        log.append({"round": rnd, "dtype": dt, "batch": b, "heads": h, "seqlen": n,
                    "head_dim": d, "causal": c, "ours_ms": got["ours"], "peer_ms": got["peer"],
                    "ours_min_ms": got["ours_min"], "peer_min_ms": got["peer_min"]})

    # Two estimators, both from the same interleaved calls: the median over rounds of the
    # per-round ratio of median times (the headline), and the same with each side's fastest
    # call of the round (interference from other guests only ever slows a call down, so the
    # fastest calls are the least disturbed view of both sides).
    print("| dtype | N | D | causal | ours GFLOP/s | PyTorch GFLOP/s | median ratio (PyTorch time / ours) | min–max ratio | ratio of fastest calls |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in shapes:
        dt, b, h, n, d, c = s
        r = results[s]
        f = flops(b, h, n, d, c)
        ours = f / statistics.median(r["ours"]) / 1e6
        peer = f / statistics.median(r["peer"]) / 1e6
        print(f"| {dt} | {n} | {d} | {'yes' if c else 'no'} | {ours:.1f} | {peer:.1f} | "
              f"**{statistics.median(r['ratio']):.2f}** | {min(r['ratio']):.2f}–{max(r['ratio']):.2f} | "
              f"{statistics.median(r['ratio_min']):.2f} |")
    for dt in dtypes:
        ratios = [statistics.median(results[s]["ratio"]) for s in shapes if s[0] == dt]
        fastest = [statistics.median(results[s]["ratio_min"]) for s in shapes if s[0] == dt]
        print(f"# {dt}: worst shape ratio {min(ratios):.2f}, median over shapes "
              f"{statistics.median(ratios):.2f} (fastest calls: worst {min(fastest):.2f}, "
              f"median {statistics.median(fastest):.2f})")
    write_json(args, log)


if __name__ == "__main__":
    main()
