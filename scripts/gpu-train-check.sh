#!/usr/bin/env bash
# On the GPU machine, in one device call (staged by scripts/stage-gpu-train.sh into
# .gpu-train/, carried as ".gpu-train"): the CUDA backward at its edges (issue 51).
#   1. fa-capi's GPU tests of fa_backward_cuda (the `cuda_backward` test binary, python-ci
#      profile: gradients against the f64 reference on a caller stream, bf16/f16, dense and
#      packed with host and device prefix sums, caller and library workspaces; bad calls);
#   2. the abi3 wheel installed into /tmp/site-train (no network, no deps: the image has torch,
#      numpy, pytest, transformers), then the CUDA subset of the autograd tests (`-k cuda`:
#      gradients vs float64 eager on CUDA bf16/f16 with GQA, causal, window, softcap, varlen;
#      a side stream; the native refusals; the tiny-Llama bf16 training step vs SDPA) and
#      test_torch.py's test_errors[cuda].
# Each step has its own time limit (55 s, then two pytest runs of 70 s and 65 s) so that the
# whole stays under 200 s; kernels compiled by one step are reused by the next (one
# FA_CUDA_CACHE_DIR). Logs under $OUT: env.txt, capi.log, pytest-a.log, pytest-b.log,
# summary.txt.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-/tmp/fa-train-out}"; mkdir -p "$out"
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 \
         $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; break; fi
done
export FA_CUDA_CACHE_DIR=/tmp/fa-train-cache PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
t0=$(date +%s)
{
    echo "revision: $(cat "$here/REVISION" 2>/dev/null)"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
} > "$out/env.txt" 2>&1
timeout 55 "$here/cuda_backward" --include-ignored --nocapture > "$out/capi.log" 2>&1
capi=$?
echo "capi rc=$capi ($(( $(date +%s) - t0 )) s)" | tee "$out/summary.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-train "$here"/flash_attention_rs-*.whl >> "$out/env.txt" 2>&1 \
    || { echo "wheel install failed" | tee -a "$out/summary.txt"; exit 1; }
export PYTHONPATH=/tmp/site-train${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import flash_attention_rs as fa, torch; print("flash_attention_rs", fa.version(), fa.__file__, "torch", torch.__version__, torch.cuda.get_device_name(0))' >> "$out/env.txt" 2>&1
cd "$here/tests"
# Two pytest runs, so that a slow first-compile of kernels in one cannot starve the other:
# A) the training step, the native refusals, the side stream, test_errors[cuda];
# B) the gradient cases (dense and varlen).
timeout 70 python3 -m pytest -p no:cacheprovider -rs -v -s --durations=8 \
    -k "cuda and (llama or native or stream or test_errors)" \
    test_autograd.py "test_torch.py::test_errors" > "$out/pytest-a.log" 2>&1
pa=$?
echo "pytest A rc=$pa ($(( $(date +%s) - t0 )) s)" | tee -a "$out/summary.txt"
timeout 65 python3 -m pytest -p no:cacheprovider -rs -v -s --durations=8 \
    -k "cuda_gradients or cuda_varlen" test_autograd.py > "$out/pytest-b.log" 2>&1
pb=$?
echo "pytest B rc=$pb ($(( $(date +%s) - t0 )) s)" | tee -a "$out/summary.txt"
for f in capi pytest-a pytest-b; do
    echo "== $f: $(grep -E "test result|=+ .*(passed|failed|skipped|error)" "$out/$f.log" | tail -n 1)"
done | tee -a "$out/summary.txt"
[ "$capi" = 0 ] && [ "$pa" = 0 ] && [ "$pb" = 0 ]
