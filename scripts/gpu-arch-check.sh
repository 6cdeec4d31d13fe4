#!/usr/bin/env bash
# One device call after scripts/gpu-pack fa-cuda fa-cpu flash-attention: the staged tests
# (GPU tests included, fa-cpu on the host's AVX-512), then the disk cubin cache seen from three
# processes: a cold `fa demo --backend cuda` (compiles), a second one (must load from disk), and
# a third after every cache file had one byte flipped (must rebuild, not trust it); then
# `fa warmup`. Logs under $OUT.
set -uo pipefail
out="${OUT:-/tmp/fa-arch-out}"; mkdir -p "$out"
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 \
         $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; break; fi
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
rc=0
export FA_CUDA_CACHE_DIR=/tmp/fa-test-cache
for t in .gpu/tests/*; do
    echo "== $t"
    "$t" --include-ignored --test-threads=1 > "$out/$(basename "$t").log" 2>&1 || rc=1
    grep -E "test result|FAILED|panicked" "$out/$(basename "$t").log" | head -5
done
export FA_CUDA_CACHE_DIR=/tmp/fa-demo-cache; rm -rf "$FA_CUDA_CACHE_DIR"
for run in cold warm; do
    echo "== fa demo --backend cuda ($run cache)"
    .gpu/bin/fa demo --backend cuda 2>&1 | tee "$out/demo-$run.log" | grep -E "kernel|time|check" || rc=1
done
python3 - "$FA_CUDA_CACHE_DIR" <<'PY'
import os, sys
for root, _, files in os.walk(sys.argv[1]):
    for f in files:
        p = os.path.join(root, f); b = bytearray(open(p, "rb").read())
        b[len(b) // 2] ^= 0xFF; open(p, "wb").write(bytes(b)); print("flipped a byte of", p)
PY
echo "== fa demo --backend cuda (corrupt cache)"
.gpu/bin/fa demo --backend cuda 2>&1 | tee "$out/demo-corrupt.log" | grep -E "kernel|check" || rc=1
echo "== fa warmup"; time .gpu/bin/fa warmup 2>&1 | tee "$out/warmup.log"
exit $rc
