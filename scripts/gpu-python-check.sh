#!/usr/bin/env bash
# On the GPU machine, in one device call (staged by scripts/stage-gpu-python.sh, carried as
# .gpu-python): installs the staged abi3 wheel into /tmp/site (no network, no deps: the image
# has torch, numpy, ml_dtypes, pytest, transformers) and runs python/tests: the torch CUDA
# tests (bf16/f16, BSHD and BHSD strides, GQA, decode, varlen with host and device prefix sums,
# causal, a side stream as PyTorch's current stream, errors, a timing line), the transformers
# model test (tiny Llama, fa_rs vs sdpa, prefill + greedy decode, CPU f32 and CUDA bf16),
# and the NumPy / torch CPU tests. Logs under $OUT: env.txt, pytest.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/fa-python-out}"; mkdir -p "$out"
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 \
         $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; break; fi
done
export FA_CUDA_CACHE_DIR=/tmp/fa-python-cache PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu-python/flash_attention_rs-*.whl || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
{
    echo "revision: $(cat .gpu-python/REVISION 2>/dev/null)"
    ldd --version | head -n 1
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 - <<'PY'
import sys, numpy
import flash_attention_rs as fa
print("python", sys.version.split()[0], "numpy", numpy.__version__)
print("flash_attention_rs", fa.version(), "from", fa.__file__)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except ImportError as e:
    print("torch: not importable:", e)
try:
    import transformers
    print("transformers", transformers.__version__)
except ImportError as e:
    print("transformers: not importable:", e)
try:
    import ml_dtypes
    print("ml_dtypes", ml_dtypes.__version__)
except ImportError:
    print("ml_dtypes: missing (NumPy bf16 cases skip)")
PY
} 2>&1 | tee "$out/env.txt"
timeout 540 python3 -m pytest -p no:cacheprovider -rs -v -s python/tests 2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
grep -E "passed|failed|error" "$out/pytest.log" | tail -n 3
exit "$rc"
