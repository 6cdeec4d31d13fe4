#!/usr/bin/env bash
# One device call: fa-cuda's GPU suite (forward families + the decode family), fa-capi's CUDA
# test, then the decode bench and PyTorch SDPA's decode peers in the same call.
# Stage with: scripts/gpu-pack fa-cuda fa-capi (it puts scripts/torch_sdpa_decode.py in
# .gpu/peers), plus the decode_bench example in .gpu/bin. Logs under $OUT.
set -uo pipefail
out="${OUT:-/tmp/fa-decode-out}"; mkdir -p "$out"
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 \
         $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; break; fi
done
export FA_CUDA_CACHE_DIR=/tmp/fa-test-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
start=$SECONDS
# TESTS: the test binaries to run (default: all of fa-cuda's and fa-capi's CUDA test).
# Tests that need this machine's source tree (the C example, the header check) stay on the CPU machine.
for t in ${TESTS:-gpu_decode-test gpu-test cuda-test fa_cuda-lib disk_cache-test}; do
    [ -x ".gpu/tests/$t" ] || { echo "== $t MISSING"; continue; }
    timeout "${TEST_LIMIT:-90}" ".gpu/tests/$t" --include-ignored --test-threads=4 --nocapture > "$out/$t.log" 2>&1
    echo "== $t rc=$? ($((SECONDS - start)) s)"
    grep -E "^test |test result|panicked" "$out/$t.log" | grep -v " ok$" | tail -15
done
timeout "${DECODE_LIMIT:-60}" .gpu/bin/decode_bench ${DECODE_ARGS:---batches 1,16 --caches 4096,16384,131072 --splits plan --iters 30} \
    > "$out/decode_bench.json" 2> "$out/decode_bench.err"
echo "== decode_bench rc=$? ($((SECONDS - start)) s)"; tail -c 3000 "$out/decode_bench.json"; tail -3 "$out/decode_bench.err"
PYTHONUNBUFFERED=1 timeout "${PEER_LIMIT:-90}" python3 .gpu/peers/torch_sdpa_decode.py ${PEER_ARGS:---batches 1,16 --caches 4096,16384,131072 --iters 30} --json "$out/sdpa_decode.json" > "$out/sdpa_decode.log" 2>&1
echo "== sdpa decode rc=$? ($((SECONDS - start)) s)"; tail -25 "$out/sdpa_decode.log"
