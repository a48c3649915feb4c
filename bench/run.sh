#!/usr/bin/env bash
# The one command that runs the whole benchmark on a GPU machine, from the repository root:
#
#   bash bench/run.sh [--quick] [--out DIR] [--bin PATH]
#
# 1. the Rust suite (bench/suite, binary bench_suite: hand-off, throughput, zero copy, import,
#    registry, the floor, the bare floor and limits), 2. the Python baselines (PyTorch queue, host staging, CuPy IPC per frame),
# 3. bench/report.py, which merges them and writes results.json, results.csv, targets.csv,
#    benchmarks.png and benchmarks.md into the output directory.
#
# Every step has a time bound (`timeout`); a step that fails or overruns leaves its partial result
# and the next step still runs. Worst case about 7.7 minutes (quick: about 2.5); a normal full run
# takes about 3. Output directory: --out, default bench-results/UTC-DATE[-quick]. The suite binary:
# --bin, else target/gpu-bundle/examples/bench_suite (made by the GPU bundle script), else
# target/release/examples/bench_suite (`cargo build --release -p cuda-ipc-bench --example
# bench_suite`).
# The commit recorded: $CUDA_IPC_GIT_COMMIT, else `git rev-parse HEAD`, else what the binary knows.
set -uo pipefail
cd "$(dirname "$0")/.."

quick=""
out=""
bin=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick="--quick"; shift ;;
    --out) out=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "bench/run.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$bin" ]; then
  for b in target/gpu-bundle/examples/bench_suite target/release/examples/bench_suite; do
    [ -x "$b" ] && { bin=$b; break; }
  done
fi
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
  echo "bench/run.sh: no bench_suite binary; build it (cargo build --release -p cuda-ipc-bench --example bench_suite)" \
       "or the GPU bundle, or pass --bin" >&2
  exit 2
fi
out=${out:-bench-results/$(date -u +%Y%m%dT%H%M%SZ)${quick:+-quick}}
mkdir -p "$out/logs" || exit 2
py=${PYTHON:-python3}
commit=${CUDA_IPC_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || true)}

# Time bounds in seconds: (rust budget, rust kill, torch, staging, cupy, report).
if [ -n "$quick" ]; then
  b=(45 60 45 30 30 30)
else
  b=(190 230 90 60 50 30)
fi

status=0
: > "$out/logs/steps.tsv"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $(date -u +%T) $name (at most ${limit} s): $*"
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$out/logs/$name.log"
  local rc=${PIPESTATUS[0]}
  local dt=$((SECONDS - t0))
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "== $name overran its ${limit} s and was stopped"
  echo "== $name: exit status $rc after ${dt} s"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$dt" >> "$out/logs/steps.tsv"
  [ "$rc" = 0 ] || status=1
}

{ echo "== $(date -u +%FT%TZ) bench/run.sh ${quick:-full} -> $out"
  nvidia-smi --query-gpu=name,driver_version,uuid --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
} | tee "$out/logs/header.txt"

step bench_suite "${b[1]}" "$bin" --out "$out" --budget "${b[0]}" $quick ${commit:+--commit "$commit"}
step torch_queue "${b[2]}" "$py" bench/torch_queue.py --out "$out" $quick
step host_staging "${b[3]}" "$py" bench/host_staging.py --out "$out" $quick
step cupy_ipc "${b[4]}" "$py" bench/cupy_ipc.py --out "$out" $quick
step report "${b[5]}" "$py" bench/report.py --out "$out"

# The files the report wrote (no benchmarks.png without matplotlib, nothing when the report failed).
made=""
for f in results.json results.csv targets.csv benchmarks.png benchmarks.md; do
  [ -e "$out/$f" ] && made="$made $f"
done
echo "== results in $out:${made:- (no report files)} (logs/ has each step's output)"
exit $status
