#!/usr/bin/env bash
# Stages into .gpucpu/ (git-ignored) what measures fa-cpu against PyTorch's CPU SDPA on the GPU
# machine's CPU (an AVX-512 Xeon: the machine issue 5's targets were written for): the release
# `fa`, the fa-cpu test binaries, scripts/cpu_peer.py, cpu_ab.py and cpu_bwd_ab.py, the FMA peak
# probe, the read probe `readbw`, fa-cpu's bench_decode example and the session script. Then,
# with the device tool: run `bash .gpucpu/cpu-peer-session.sh` carrying
# [".gpucpu"] (env: ROUNDS, ITERS, DTYPES, CPUS, BACKWARD=1, DECODE=1; results in
# $OUT/peer[-backward|-decode]-<dtype>.md/.json).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qsx '/.gpucpu/' "$exclude" || echo '/.gpucpu/' >> "$exclude"
rm -rf .gpucpu && mkdir -p .gpucpu/tests
cargo build --release -p fa-cli
strip -o .gpucpu/fa "${CARGO_TARGET_DIR:-target}/release/fa"
cargo test --release --no-run -p fa-cpu --message-format=json 2>/dev/null | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        shutil.copy2(m["executable"], ".gpucpu/tests/" + m["target"]["name"] + "-" + m["target"]["kind"][0])'
# Stripped: unstripped they pass the device tool's 64 MiB carry limit.
strip .gpucpu/tests/*
gcc -O2 -mavx512f -o .gpucpu/fma_peak scripts/fma_peak.c
gcc -O2 -mavx512f -pthread -o .gpucpu/readbw scripts/readbw.c
cargo build --release -p fa-cpu --example bench_decode
strip -o .gpucpu/bench_decode "${CARGO_TARGET_DIR:-target}/release/examples/bench_decode"
cp scripts/cpu_peer.py scripts/cpu_ab.py scripts/cpu_bwd_ab.py scripts/cpu-peer-session.sh .gpucpu/
git rev-parse --short HEAD > .gpucpu/REVISION
git diff --quiet -- crates || echo "+uncommitted" >> .gpucpu/REVISION
du -sh .gpucpu
