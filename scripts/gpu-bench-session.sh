#!/usr/bin/env bash
# One device call: fa-cuda's staged tests (GPU tests included), the PyTorch SDPA peers and
# `fa bench --backend cuda --peers` on the FlashAttention paper shapes, in the same call.
# Stage with scripts/gpu-pack fa-cuda; logs under $OUT (tests.log, peers.json, bench.log).
set -uo pipefail
out="${OUT:-/tmp/fa-bench-out}"; mkdir -p "$out"
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 \
         $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; break; fi
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
rc=0
export FA_CUDA_CACHE_DIR=/tmp/fa-test-cache
for t in .gpu/tests/*; do
    echo "== $t"
    "$t" --include-ignored --test-threads=1 --nocapture >> "$out/tests.log" 2>&1 || rc=1
done
grep -E "^test |test result|panicked|rel_l2" "$out/tests.log" | grep -v " ok$" | tail -n 40
PYTHONUNBUFFERED=1 python3 .gpu/peers/torch_sdpa.py --json "$out/peers.json" > "$out/peers.log" 2>&1 \
    || echo "peers failed: $(tail -3 "$out/peers.log")"
.gpu/bin/fa bench --backend cuda --peers "$out/peers.json" > "$out/bench.log" 2>&1 || rc=1
cat "$out/bench.log"
exit $rc
