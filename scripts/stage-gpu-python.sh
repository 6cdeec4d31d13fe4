#!/usr/bin/env bash
# Stages into .gpu-python/ (git-ignored) what scripts/gpu-python-check.sh needs on the GPU
# machine: the abi3 wheel of the Python package (maturin, dev profile, stripped; tagged
# manylinux_2_34: it needs glibc >= 2.34, the device image has 2.39) and the check script.
# Then, with the device tool, one call carrying [".gpu-python"]:
#     bash .gpu-python/gpu-python-check.sh        (logs under $OUT: pytest.log, env.txt)
# maturin: taken from PATH, else installed once into /tmp/fa-maturin-venv (PyPI).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
# .gpu-python/ is in .gitignore (it travels to the device only when carried).
maturin=$(command -v maturin || true)
if [ -z "$maturin" ]; then
    [ -x /tmp/fa-maturin-venv/bin/maturin ] || {
        python3 -m venv /tmp/fa-maturin-venv
        /tmp/fa-maturin-venv/bin/python -m pip install --quiet "maturin>=1.5,<2"
    }
    maturin=/tmp/fa-maturin-venv/bin/maturin
fi
rm -rf .gpu-python && mkdir -p .gpu-python
(cd python && "$maturin" build --compatibility manylinux_2_34 --strip -o "$root/.gpu-python")
cp scripts/gpu-python-check.sh .gpu-python/
git rev-parse --short HEAD > .gpu-python/REVISION
git diff --quiet -- crates python || echo "+uncommitted" >> .gpu-python/REVISION
ls -la .gpu-python && du -sh .gpu-python
