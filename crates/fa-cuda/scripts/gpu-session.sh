#!/usr/bin/env bash
# One device call: GPU tests, PyTorch SDPA peers and `fa bench --backend cuda --peers`, all in
# the same session. Run on the GPU machine from the repository root after staging .gpu/ (with
# crates/fa-cuda/scripts/stage-gpu.sh):   bash .gpu/gpu-session.sh [fa bench args, e.g. --head-dim 128 --seqlen 8192 --tiles default,128x64x4x2]
# Logs go to $OUT (tests.log, peers.json, bench.log) when OUT is set.
set -uo pipefail
out="${OUT:-/tmp/fa-cuda-out}"; mkdir -p "$out"
# libnvrtc: the CUDA toolkit's, or the nvidia-cuda-nvrtc wheel inside the Python environment.
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 \
         $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; echo "nvrtc: $d"; break; fi
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
git_rev=$(cat .gpu/REVISION 2>/dev/null || echo unknown); echo "code revision: $git_rev"
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    .gpu/run-tests 2>&1 | tee "$out/tests.log" | grep -E "^(test |running|==)|test result|panicked|rel_l2" | grep -v " ok$" | tail -n 60
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    grep -E "test result" "$out/tests.log"
fi
if [ "${SKIP_PEERS:-0}" != 1 ]; then
    PYTHONUNBUFFERED=1 python3 .gpu/peers/torch_sdpa.py --json "$out/peers.json" > "$out/peers.log" 2>&1 || echo "peers failed: $(tail -3 "$out/peers.log")"
fi
.gpu/bin/fa bench --backend cuda --peers "$out/peers.json" "$@" 2>&1 | tee "$out/bench.log" | sed -n '/^summary/,$p'
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
exit $rc
