#!/usr/bin/env bash
# Stages fa-cuda's release test binaries, the `fa` command (its `fa bench --backend cuda` is the
# benchmark), the peer scripts and gpu-session.sh into .gpu/ (the layout scripts/gpu-pack makes,
# but building only these crates).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
grep -qsx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/tests .gpu/bin .gpu/peers
cargo test --release --no-run -p fa-cuda --message-format=json 2>/dev/null | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        name = m["target"]["name"] + "-" + m["target"]["kind"][0]
        shutil.copy2(m["executable"], ".gpu/tests/" + name); print("staged test", name)'
cargo build --release -p fa-cli --bin fa
cp "${CARGO_TARGET_DIR:-target}/release/fa" .gpu/bin/
cp scripts/torch_sdpa.py scripts/torch_sdpa_decode.py .gpu/peers/
cp crates/fa-cuda/scripts/gpu-session.sh .gpu/
git rev-parse --short HEAD > .gpu/REVISION
git diff --quiet -- crates/fa-cuda crates/flash-attention crates/fa-cli || echo "+uncommitted" >> .gpu/REVISION
cat > .gpu/run-tests <<'RUN'
#!/usr/bin/env bash
cd "$(dirname "$0")/.." || exit 2
rc=0
for t in .gpu/tests/*; do echo "== $t"; "$t" --include-ignored --test-threads=1 --nocapture || rc=1; done
exit $rc
RUN
chmod +x .gpu/run-tests
du -sh .gpu
