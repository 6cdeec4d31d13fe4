#!/usr/bin/env python3
"""Peer baseline on the GPU machine: PyTorch SDPA backends (flash = FlashAttention-2, cudnn, efficient).

    python3 scripts/torch_sdpa.py [--hdims 64,128,256] [--seqlens 512,1024,2048,4096,8192,16384]
                          [--causal both|yes|no] [--backward] [--json OUT.json]

Shapes follow the FlashAttention papers: batch * seqlen = 16384 tokens, hidden 2048 (heads = 2048 // hdim),
bf16, layout (batch, heads, seqlen, hdim) as SDPA takes it. Forward FLOPs = 4 * B * H * N^2 * D, halved when
causal; backward counted as 2.5x forward. Timing: triton.testing.do_bench, median over ~100 ms after warm-up.
Prints one JSON line per shape (TFLOP/s per backend) and writes them all to --json if given:
the file `fa bench --backend cuda --peers` reads (with --backward: also the *_bwd_tflops that
`fa bench --backward --backend cuda --peers` reads). scripts/gpu-pack stages it into .gpu/peers/.
"""
import argparse, json, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from triton.testing import do_bench

ap = argparse.ArgumentParser()
ap.add_argument("--hdims", default="64,128,256")
ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
ap.add_argument("--backward", action="store_true")
ap.add_argument("--json")
a = ap.parse_args()
print(torch.__version__, torch.cuda.get_device_name(), file=sys.stderr)
backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
causals = {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]
rows = []
for d in map(int, a.hdims.split(",")):
    for n in map(int, a.seqlens.split(",")):
        for causal in causals:
            b, h = max(1, 16384 // n), 2048 // d
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=a.backward)
                       for _ in range(3))
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            row = {"hdim": d, "seqlen": n, "batch": b, "heads": h, "causal": causal}
            for name, be in backends.items():
                try:
                    with sdpa_kernel(be):
                        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        row[f"{name}_fwd_tflops"] = round(flops / do_bench(fwd, warmup=25, rep=100, return_mode="median") / 1e9, 1)
                        if a.backward:
                            o = fwd(); g = torch.randn_like(o)
                            bwd = lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True)
                            row[f"{name}_bwd_tflops"] = round(2.5 * flops / do_bench(bwd, warmup=25, rep=100, return_mode="median") / 1e9, 1)
                except RuntimeError as e:
                    row[f"{name}_error"] = str(e).splitlines()[0][:120]
            rows.append(row)
            print(json.dumps(row), flush=True)
if a.json:
    json.dump(rows, open(a.json, "w"), indent=1)
