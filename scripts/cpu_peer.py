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

Setup:  python3 -m venv /work/venv-peer
        /work/venv-peer/bin/pip install -r scripts/requirements-cpu-peer.txt
        cargo build --release -p fa-cli        (or -p fa-cpu --example bench_forward)
Run:    /work/venv-peer/bin/python scripts/cpu_peer.py --threads 2 --rounds 5
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

DTYPES = ("f32", "bf16")


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
    else:
        cmd = [args.example, "--threads", str(args.threads), "--batch", str(b), "--heads", str(h),
               "--seqlen", str(n), "--head-dim", str(d), "--dtype", dtype,
               "--reps", str(args.iters), "--warmup", str(args.warmup)]
    if causal:
        cmd.append("--causal")
    return cmd


def run_ours(args, dtype, b, h, n, d, causal):
    cmd = ours_command(args, dtype, b, h, n, d, causal)
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        sys.exit(f"our side failed: {' '.join(cmd)}\n{res.stderr}")
    for line in res.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    sys.exit(f"our side printed no JSON: {' '.join(cmd)}\n{res.stdout}")


def run_peer(torch, dtype, b, h, n, d, causal, iters, warmup):
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
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
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
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


def main_backward(args, torch, shapes):
    """--backward: alternate rounds of `fa bench --backward` and SDPA's backward."""
    results = {s: {"ratio": [], "ratio_min": [], "ratio_total": [], "ours": [], "peer": [],
                   "ours_total": [], "peer_total": [], "alloc": None, "io": None} for s in shapes}
    log = []
    for rnd in range(args.rounds):
        for s in shapes:
            dt, b, h, n, d, c = s
            order = ("ours", "peer") if rnd % 2 == 0 else ("peer", "ours")
            got = {}
            for side in order:
                if side == "ours":
                    rec = run_ours(args, dt, b, h, n, d, c)
                    got["ours"] = rec["backward_ms_median"]
                    got["ours_min"] = rec["backward_ms_min"]
                    got["ours_total"] = rec["total_ms_median"]
                    results[s]["alloc"] = rec.get("backward_alloc_bytes")
                    results[s]["io"] = rec.get("io_bytes")
                else:
                    got["peer"], got["peer_min"], got["peer_total"] = run_peer_backward(
                        torch, dt, b, h, n, d, c, args.iters, args.warmup)
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
        print(f"# round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)

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
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(log, f, indent=1)


def add_shape_args(p):
    """The shape flags (defaults: issue 5's grid), shared with cpu_ab.py."""
    p.add_argument("--heads", type=int, default=8)
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
    add_shape_args(p)
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--ours", choices=("fa", "example"), default=None,
                   help="our side: `fa bench --json` or the fa-cpu example (default: fa if built)")
    p.add_argument("--fa", default="target/release/fa")
    p.add_argument("--example", default="target/release/examples/bench_forward")
    p.add_argument("--json-out", default=None, help="also write every measurement here")
    p.add_argument("--backward", action="store_true",
                   help="time the backward (and forward + backward) against SDPA's autograd "
                        "backward; needs --ours fa")
    args = p.parse_args()
    if args.ours is None:
        args.ours = "fa" if os.path.exists(args.fa) else "example"

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
          f"{', pass=backward' if args.backward else ''}", flush=True)
    if args.backward:
        if args.ours != "fa":
            sys.exit("--backward needs --ours fa (the fa binary's bench --backward)")
        main_backward(args, torch, shapes)
        return
    results = {s: {"ratio": [], "ratio_min": [], "ours": [], "peer": [], "ours_min": [],
                   "peer_min": [], "simd": None} for s in shapes}
    log = []
    for rnd in range(args.rounds):
        for s in shapes:
            dt, b, h, n, d, c = s
            order = ("ours", "peer") if rnd % 2 == 0 else ("peer", "ours")
            got = {}
            for side in order:
                if side == "ours":
                    rec = run_ours(args, dt, b, h, n, d, c)
                    got["ours"] = rec["time_ms_median"]
                    got["ours_min"] = rec.get("time_ms_min", rec["time_ms_median"])
                    results[s]["simd"] = rec.get("simd")
                    results[s]["rss"] = rec.get("peak_rss_bytes")
                else:
                    got["peer"], got["peer_min"] = run_peer(torch, dt, b, h, n, d, c, args.iters,
                                                            args.warmup)
            r = results[s]
            for key in ("ours", "peer", "ours_min", "peer_min"):
                r[key].append(got[key])
            r["ratio"].append(got["peer"] / got["ours"])
            r["ratio_min"].append(got["peer_min"] / got["ours_min"])
            log.append({"round": rnd, "dtype": dt, "batch": b, "heads": h, "seqlen": n,
                        "head_dim": d, "causal": c, "ours_ms": got["ours"], "peer_ms": got["peer"],
                        "ours_min_ms": got["ours_min"], "peer_min_ms": got["peer_min"]})
        print(f"# round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)

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
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(log, f, indent=1)


if __name__ == "__main__":
    main()
