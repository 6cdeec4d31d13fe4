#!/usr/bin/env bash
# On the GPU machine (see stage-cpu-peer-gpu-host.sh): fa-cpu's tests, then fa-cpu against
# PyTorch's CPU SDPA on two pinned cores, both timed in the same run by cpu_peer.py.
# BACKWARD=1: the backward pass instead (issue 17's grid: D 64,128; results in
# $OUT/peer-backward-<dtype>.md/.json); DECODE=1: decode over a KV cache instead (issue 15's
# CPU target: batches 1,4, caches 4k-64k, 32/8 heads, D 128; PAGE_SIZE=0 padded, 16 paged on
# our side only; results in $OUT/peer-decode-<dtype>.md/.json; first the read probe `readbw`
# (READBW=0 skips it) and, with PF_SWEEP=1, the prefetch sweep; PREFETCH=<schedule> runs our
# side with `fa --prefetch <schedule>`); FA_ARGS adds flags to every `fa` call of our side (e.g.
# FA_ARGS="--simd avx512f"); TESTS=0 skips the test binaries.
set -u
out="${OUT:-/tmp/cpu-peer-out}"; mkdir -p "$out"
cd "$(dirname "$0")"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|L1d|L2|L3"
grep -o -w -E "avx512f|amx_bf16" /proc/cpuinfo | sort | uniq -c
echo "code revision: $(cat REVISION)"
if [ "${TESTS:-1}" = 1 ]; then
    for t in tests/*; do echo "== $t"; "$t" 2>&1 | grep -E "test result|FAILED|panicked"; done
fi
# Two CPUs on distinct cores: the first two, unless running them together halves their FMA rate
# (then they are one core's hyperthreads, and CPU 8 replaces CPU 1).
one=$(taskset -c 0 ./fma_peak | tail -1 | awk '{print $1}')
pair=$( (taskset -c 0 ./fma_peak | tail -1 & taskset -c 1 ./fma_peak | tail -1; wait) | awk '{s += $1} END {print s}')
echo "FMA peak: one thread $one GFLOP/s, CPUs 0+1 together $pair GFLOP/s"
cpus=0,1
if awk -v a="$pair" -v b="$one" 'BEGIN {exit !(a < 1.6 * b)}'; then cpus=0,8; fi
cpus="${CPUS:-$cpus}"; echo "pinned to CPUs $cpus"
python3 -c 'import torch; print("torch", torch.__version__, torch.backends.cpu.get_cpu_capability())'
dtypes="${DTYPES:-f32}"
fa_args="${FA_ARGS:-}"
# fa-cpu no longer reads FA_CPU_DECODE_PREFETCH: an old command line that sets it gets the flag.
if [ -n "${FA_CPU_DECODE_PREFETCH:-}" ] && [ -z "${PREFETCH:-}" ]; then
    echo "note: FA_CPU_DECODE_PREFETCH is passed on as PREFETCH (fa --prefetch)"
    PREFETCH="$FA_CPU_DECODE_PREFETCH"
fi
if [ "${BACKWARD:-0}" = 1 ]; then
    PYTHONUNBUFFERED=1 taskset -c "$cpus" python3 cpu_peer.py --ours fa --fa ./fa --threads 2 \
        --fa-args "$fa_args" --backward --head-dims "${HEAD_DIMS:-64,128}" \
        --rounds "${ROUNDS:-5}" --iters "${ITERS:-3}" --dtypes "$dtypes" \
        --json-out "$out/peer-backward-${dtypes//,/-}.json" 2>&1 | tee "$out/peer-backward-${dtypes//,/-}.md"
    exit 0
fi
if [ "${DECODE:-0}" = 1 ]; then
    # The read ceiling of these cores: plain and software-prefetched read loops, copies at the
    # old and new probe sizes (scripts/readbw.c).
    if [ -x ./readbw ] && [ "${READBW:-1}" = 1 ]; then
        taskset -c "$cpus" ./readbw 2 1024 3 16 2>&1 | tee "$out/readbw.txt"
    fi
    # PF_SWEEP=1: the streaming loop's prefetch schedules alternated per round on a few shapes
    # (examples/bench_decode --pf), then the best (geometric mean of per-round decode/copy
    # ratios) is PREFETCH (`fa --prefetch`) for the peer runs below.
    if [ -x ./bench_decode ] && [ "${PF_SWEEP:-0}" = 1 ]; then
        modes="${PF_MODES:-phase,off,ahead:4,ahead:16,phase+ahead:8}"
        for s in "bf16 1 4096 0" "bf16 1 65536 0" "f32 4 16384 0" "bf16 1 16384 16"; do
            set -- $s
            taskset -c "$cpus" ./bench_decode --dtype "$1" --batch "$2" --cache "$3" --page "$4" \
                --heads 32 --heads-kv 8 --head-dim 128 --threads 2 --rounds "${PF_ROUNDS:-5}" \
                --copy-mib 1024 --pf "$modes"
        done 2>&1 | tee "$out/pf-sweep.txt"
        # The small cache (bf16 B1 4k: 16 MiB) with fewer, larger splits than the rule's 32.
        for n in 32 16 8; do
            taskset -c "$cpus" ./bench_decode --dtype bf16 --batch 1 --cache 4096 --heads 32 \
                --heads-kv 8 --head-dim 128 --threads 2 --rounds "${PF_ROUNDS:-5}" --copy-mib 1024 \
                --splits "$n"
        done 2>&1 | tee "$out/split-sweep.txt"
        best=$(python3 - "$out/pf-sweep.txt" <<'PY'
import math, re, sys
score = {}
for line in open(sys.argv[1]):
    m = re.search(r"prefetch (\S+): .* ratio ([0-9.]+)", line)
    if m:
        score.setdefault(m.group(1), []).append(math.log(float(m.group(2))))
name = max(score, key=lambda k: sum(score[k]) / len(score[k]))
m = re.fullmatch(r"(Phase|Off|Ahead|PhaseAhead)(?:\((\d+)\))?", name)
kind, n = m.group(1), m.group(2)
print({"Phase": "phase", "Off": "off", "Ahead": f"ahead:{n}", "PhaseAhead": f"phase+ahead:{n}"}[kind])
PY
)
        echo "prefetch schedule for the peer runs: ${best:-default}"
        [ -n "$best" ] && PREFETCH="$best" && echo "$best" > "$out/pf-best.txt"
    fi
    decode_args="$fa_args${PREFETCH:+ --prefetch $PREFETCH}"
    PYTHONUNBUFFERED=1 taskset -c "$cpus" python3 cpu_peer.py --ours fa --fa ./fa --threads 2 \
        --fa-args "$decode_args" --decode --batches "${BATCHES:-1,4}" --cache-lens "${CACHE_LENS:-4096,16384,65536}" \
        --page-size "${PAGE_SIZE:-0}" \
        --rounds "${ROUNDS:-5}" --iters "${ITERS:-7}" --dtypes "$dtypes" \
        --json-out "$out/peer-decode-${dtypes//,/-}.json" 2>&1 | tee "$out/peer-decode-${dtypes//,/-}.md"
    exit 0
fi
PYTHONUNBUFFERED=1 taskset -c "$cpus" python3 cpu_peer.py --ours fa --fa ./fa --threads 2 \
    --fa-args "$fa_args" --rounds "${ROUNDS:-5}" --iters "${ITERS:-5}" --dtypes "$dtypes" \
    --json-out "$out/peer-${dtypes//,/-}.json" 2>&1 | tee "$out/peer-${dtypes//,/-}.md"
