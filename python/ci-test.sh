#!/usr/bin/env bash
# The Python package's CI step (called by .ci/run; runs the same by hand): builds the abi3
# wheel with maturin (the workspace's unoptimised `python-ci` profile), installs it in a fresh
# venv with NumPy, ml_dtypes and pytest, and runs python/tests. Without a GPU or torch the CUDA and torch tests skip, and
# pytest's summary (-rs) names each skip and why.
#
# Env: FA_PY_BUILD_VENV (where maturin lives; default .ci-cache/py-build-venv, re-used),
#      FA_PY_WHEEL_DIR (default target/wheels-ci),
#      FA_PY_TORCH=1 also installs torch and transformers from PyPI into the test venv, so the
#      torch CPU tests and the tiny-Llama transformers test run too (measured here: 2 min 11 s,
#      5.6 GB installed: PyPI's Linux torch is the CUDA build with its nvidia-* libraries).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
build_venv="${FA_PY_BUILD_VENV:-$root/.ci-cache/py-build-venv}"
wheels="${FA_PY_WHEEL_DIR:-$root/target/wheels-ci}"

if [ ! -x "$build_venv/bin/maturin" ]; then
    python3 -m venv "$build_venv"
    "$build_venv/bin/python" -m pip install --quiet "maturin>=1.5,<2"
fi
"$build_venv/bin/maturin" --version

rm -rf "$wheels"
# manylinux_2_34: the glibc symbols Rust's std uses here (checked by maturin's audit).
(cd python && "$build_venv/bin/maturin" build --profile python-ci --compatibility manylinux_2_34 --strip -o "$wheels")

test_venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$test_venv")"' EXIT
python3 -m venv "$test_venv"
extra=()
[ "${FA_PY_TORCH:-0}" = 1 ] && extra=(torch transformers)
"$test_venv/bin/python" -m pip install --quiet numpy pytest ml_dtypes "${extra[@]}" "$wheels"/flash_attention_rs-*.whl
"$test_venv/bin/python" -c 'import flash_attention_rs as fa, sys; print("flash_attention_rs", fa.version(), "from", fa.__file__, "on Python", sys.version.split()[0])'
if ! "$test_venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "NOTE: torch is not installed (PyPI's Linux torch is the CUDA build: 539 MB plus its nvidia-*"
    echo "      libraries, 5.6 GB installed; the CPU-only index is not reachable): the torch and"
    echo "      transformers tests are SKIPPED here. FA_PY_TORCH=1 installs them; the GPU machine"
    echo "      runs them with CUDA (scripts/gpu-python-check.sh)."
fi
cd python/tests
"$test_venv/bin/python" -m pytest -rs -q -p no:cacheprovider
