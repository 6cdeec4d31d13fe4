#!/usr/bin/env bash
# Stages into <dest> (default: .gpu-train/ of the repository root; git-ignored) what
# scripts/gpu-train-check.sh needs on the GPU machine: the abi3 wheel (maturin, python-ci
# profile, stripped, manylinux_2_34), fa-capi's `cuda_backward` GPU test binary (python-ci
# profile), python/tests, and the check script as run.sh. Then, with the device tool, one call
# carrying [".gpu-train"]:   bash .gpu-train/run.sh        (logs under $OUT)
# maturin: taken from PATH, else /tmp/fa-maturin-venv (see stage-gpu-python.sh).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
dest="$(realpath -m "${1:-$root/.gpu-train}")"
maturin=$(command -v maturin || echo /tmp/fa-maturin-venv/bin/maturin)
rm -rf "$dest" && mkdir -p "$dest"
(cd python && "$maturin" build --profile python-ci --compatibility manylinux_2_34 --strip -o "$dest")
bin=$(cargo test --profile python-ci -p fa-capi --test cuda_backward --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda_backward" and m.get("executable"):
        print(m["executable"])')
cp "$bin" "$dest/cuda_backward"
cp -r python/tests "$dest/tests"
find "$dest/tests" -name __pycache__ -prune -exec rm -rf {} +
cp scripts/gpu-train-check.sh "$dest/run.sh"
git rev-parse --short HEAD > "$dest/REVISION"
git diff --quiet -- crates python || echo "+uncommitted" >> "$dest/REVISION"
ls -la "$dest" && du -sh "$dest"
