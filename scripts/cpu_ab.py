#!/usr/bin/env python3
"""A/B of several fa-cpu builds (and PyTorch's CPU SDPA) on the same shapes, interleaved.

Each argument of --variants is a `bench_forward` example binary (build one per variant, e.g.
with a tile size changed, and copy it away). Every round times every variant and PyTorch on
every shape, the order rotating each round, so slow phases of a shared machine hit all sides
alike. Prints, per shape and variant, the median over rounds of PyTorch time / variant time
(GFLOP/s from the variant's median time in brackets), and per variant the paired ratio against
the first variant.

    python3 scripts/cpu_ab.py --variants /tmp/base,/tmp/try --rounds 4 --threads 2

--fa: the variants are `fa` binaries (`fa bench`, timed as cpu_peer.py --ours fa times it), so
a wrapper script that adds options (e.g. `exec fa "$@" --exp2 cubic`) is a variant too.

--backward: the backward pass instead; the variants are then `fa` binaries (`fa bench
--backward`), PyTorch is SDPA's autograd backward, both timed as cpu_peer.py --backward times
them (the backward's median), GFLOP/s with the backward's FLOP count.
"""
import argparse
import json
import os
import statistics
import sys

from cpu_peer import add_shape_args, backward_flops, flops, run_ours, run_peer, run_peer_backward


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", required=True, help="comma-separated bench_forward binaries")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    add_shape_args(p)
    p.add_argument("--json-out")
    p.add_argument("--dtype", choices=("f32", "bf16", "f16"), default="f32",
                   help="input dtype of the forward (both sides); the backward is f32 only")
    p.add_argument("--fa", action="store_true",
                   help="the variants are `fa` binaries (`fa bench`), not bench_forward")
    p.add_argument("--backward", action="store_true",
                   help="the backward pass: variants are `fa` binaries (`fa bench --backward`)")
    a = p.parse_args()

    import torch
    torch.set_num_threads(a.threads)
    paths = a.variants.split(",")
    names = [os.path.basename(v) for v in paths] + ["torch"]
    shapes = [(n, d, m == "causal") for n in map(int, a.seqlens.split(","))
              for d in map(int, a.head_dims.split(",")) for m in a.masks.split(",")]

    def reps(n):
        return 5 if n <= 2048 else 3

    # The two sides are timed exactly as cpu_peer.py times them (its `bench_forward` mode).
    def ours(path, n, d, causal):
        if a.backward or a.fa:
            side = argparse.Namespace(ours="fa", fa=path, threads=a.threads, iters=reps(n),
                                      warmup=1, backward=a.backward)
        else:
            side = argparse.Namespace(ours="example", example=path, threads=a.threads,
                                      iters=reps(n), warmup=1, backward=False)
        if a.backward:
            return run_ours(side, "f32", 1, a.heads, n, d, causal)["backward_ms_median"]
        return run_ours(side, a.dtype, 1, a.heads, n, d, causal)["time_ms_median"]

    def peer(n, d, causal):
        if a.backward:
            return run_peer_backward(torch, "f32", 1, a.heads, n, d, causal, reps(n), 1)[0]
        return run_peer(torch, a.dtype, 1, a.heads, n, d, causal, reps(n), 1)[0]

    def work(n, d, causal):
        return (backward_flops if a.backward else flops)(1, a.heads, n, d, causal)

    res = {s: {nm: [] for nm in names} for s in shapes}
    for rnd in range(a.rounds):
        for s in shapes:
            k = rnd % len(names)
            for nm in names[k:] + names[:k]:
                t = peer(*s) if nm == "torch" else ours(paths[names.index(nm)], *s)
                res[s][nm].append(t)
        print(f"# round {rnd + 1}/{a.rounds} done", file=sys.stderr, flush=True)

    print("| N | D | causal | " + " | ".join(names[:-1]) + " | torch GFLOP/s |")
    print("|---|---|---|" + "---|" * len(names))
    vs_torch = {nm: [] for nm in names[:-1]}
    vs_first = {nm: [] for nm in names[:-1]}
    for s in shapes:
        cells = []
        for nm in names[:-1]:
            r = statistics.median(t / o for t, o in zip(res[s]["torch"], res[s][nm]))
            vs_torch[nm].append(r)
            vs_first[nm].append(statistics.median(
                f / o for f, o in zip(res[s][names[0]], res[s][nm])))
            cells.append(f"{r:.2f} ({work(*s) / statistics.median(res[s][nm]) / 1e6:.0f})")
        torch_gflops = work(*s) / statistics.median(res[s]["torch"]) / 1e6
        print(f"| {s[0]} | {s[1]} | {'yes' if s[2] else 'no'} | " + " | ".join(cells)
              + f" | {torch_gflops:.0f} |")
    for nm in names[:-1]:
        print(f"# {nm}: against torch worst {min(vs_torch[nm]):.2f}, median "
              f"{statistics.median(vs_torch[nm]):.2f}; against {names[0]} (paired, geometric "
              f"mean) {statistics.geometric_mean(vs_first[nm]):.3f}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({str(s): v for s, v in res.items()}, f, indent=1)


if __name__ == "__main__":
    main()
