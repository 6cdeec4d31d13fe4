#!/usr/bin/env python3
"""The backward of two fa-cpu configurations and PyTorch's CPU SDPA backward, same shapes, same
run, alternating (issue 18's "backward on AMX": the AMX kernel against the widening AVX-512
path and against PyTorch).

Side A: `fa bench --backward --json` as is (plus --args-a); side B: the same binary with the
flags of --args-b (default `--simd avx512f`: the dispatch stays off AMX, so bf16 and f16 inputs
widen to f32 and run the AVX-512 backward) and the environment assignments of --env-b (default
none; fa-cpu reads no environment variable, so these only serve experiment builds); the peer: SDPA's autograd backward, timed exactly as
cpu_peer.py --backward times it. Every round runs the three sides on every shape, the order
rotating each round, so slow phases of a shared machine hit all sides alike. Reported per
shape: each side's backward GFLOP/s (from its median over rounds) and the medians over rounds of
the per-round ratios B time / A time and PyTorch time / A time (> 1: A is faster).

    /tmp/pykv-testvenv/bin/python scripts/cpu_bwd_ab.py --fa target/release/fa --threads 2 \
        --rounds 4 --seqlens 1024,2048 --head-dims 64,128 --masks none,causal --dtype bf16
"""
import argparse
import os
import shlex
import statistics
import sys

from cpu_peer import add_shape_args, backward_flops, run_json, run_peer_backward


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fa", default="target/release/fa")
    p.add_argument("--args-a", default="",
                   help="more `fa` flags for side A only (one shell-quoted string)")
    p.add_argument("--args-b", default="--simd avx512f",
                   help="more `fa` flags for side B only (one shell-quoted string)")
    p.add_argument("--env-b", default="",
                   help="comma-separated NAME=VALUE set for side B only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=("f32", "bf16", "f16"))
    add_shape_args(p)
    a = p.parse_args()

    import torch
    torch.set_num_threads(a.threads)
    env_b = dict(kv.split("=", 1) for kv in a.env_b.split(",") if kv)
    shapes = [(n, d, m == "causal") for n in map(int, a.seqlens.split(","))
              for d in map(int, a.head_dims.split(",")) for m in a.masks.split(",")]

    def fa(n, d, causal, env, extra):
        cmd = [a.fa, "bench", "--json", "--backward", "--backend", "cpu",
               "--threads", str(a.threads), "--batch", "1", "--heads", str(a.heads),
               "--seqlen", str(n), "--head-dim", str(d), "--dtype", a.dtype,
               "--iters", str(a.iters), "--warmup", str(a.warmup)]
        if causal:
            cmd.append("--causal")
        cmd += shlex.split(extra)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return run_json(cmd)["backward_ms_median"]
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    sides = {
        "A": lambda s: fa(*s, {}, a.args_a),
        "B": lambda s: fa(*s, env_b, a.args_b),
        "torch": lambda s: run_peer_backward(torch, a.dtype, 1, a.heads, *s, a.iters,
                                             a.warmup)[0],
    }
    names = list(sides)
    res = {s: {nm: [] for nm in names} for s in shapes}
    for rnd in range(a.rounds):
        for s in shapes:
            k = rnd % len(names)
            for nm in names[k:] + names[:k]:
                res[s][nm].append(sides[nm](s))
        print(f"# round {rnd + 1}/{a.rounds} done", file=sys.stderr, flush=True)

    side_b = " ".join(x for x in (a.args_b, a.env_b) if x) or "as is"
    print(f"# threads={a.threads}, rounds={a.rounds}, iters={a.iters}, dtype={a.dtype}, "
          f"heads={a.heads}, A: {a.args_a or 'as is'}, B: {side_b}, torch {torch.__version__} "
          f"(cpu capability {torch.backends.cpu.get_cpu_capability()})")
    print("| N | D | causal | A bwd GFLOP/s | B bwd GFLOP/s | PyTorch bwd GFLOP/s | "
          "**B time / A time** (min–max) | **PyTorch time / A time** (min–max) |")
    print("|---|---|---|---|---|---|---|---|")
    vs_b, vs_t = [], []
    for s in shapes:
        f = backward_flops(1, a.heads, *s)
        g = {nm: f / statistics.median(res[s][nm]) / 1e6 for nm in names}
        rb = [b / x for b, x in zip(res[s]["B"], res[s]["A"])]
        rt = [t / x for t, x in zip(res[s]["torch"], res[s]["A"])]
        vs_b.append(statistics.median(rb))
        vs_t.append(statistics.median(rt))
        print(f"| {s[0]} | {s[1]} | {'yes' if s[2] else 'no'} | {g['A']:.1f} | {g['B']:.1f} | "
              f"{g['torch']:.1f} | **{vs_b[-1]:.2f}** ({min(rb):.2f}–{max(rb):.2f}) | "
              f"**{vs_t[-1]:.2f}** ({min(rt):.2f}–{max(rt):.2f}) |")
    print(f"# A against B: worst {min(vs_b):.2f}, median {statistics.median(vs_b):.2f}; "
          f"A against PyTorch: worst {min(vs_t):.2f}, median {statistics.median(vs_t):.2f}")


if __name__ == "__main__":
    main()
