#!/usr/bin/env bash
# The floor benchmarks, several runs in a row on a GPU machine, then the medians of their medians
# against the targets (docs/benchmarks.md, "Hand-off at the floor"):
#
#   scripts/bench-floor.sh OUT_DIR [RUNS] [--full]
#
# Each run: the Rust suite's hand-off (with the bare floor), posted-receive (with its raw floor),
# zero-copy, throughput and limits groups, PyTorch's queue, then bench/report.py; quick scale unless
# --full. bench/floor_summary.py then prints and writes OUT_DIR/summary.{json,md}. The suite binary:
# target/gpu-bundle/examples/bench_suite, else target/release/examples/bench_suite. Every step is
# bounded by `timeout`; a failed step leaves the others running.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/bench-floor.sh OUT_DIR [RUNS] [--full]}
runs=${2:-3}
scale="--quick"
[ "${3:-}" = "--full" ] && scale=""
py=${PYTHON:-python3}
bin=""
for b in target/gpu-bundle/examples/bench_suite target/release/examples/bench_suite; do
  [ -x "$b" ] && { bin=$b; break; }
done
[ -n "$bin" ] || { echo "no bench_suite binary (build the GPU bundle or the bench example)" >&2; exit 2; }
mkdir -p "$out"
dirs=()
for r in $(seq 1 "$runs"); do
  d="$out/run$r"; mkdir -p "$d"; dirs+=("$d")
  echo "== run $r -> $d"
  timeout -k 5 200 "$bin" --out "$d" --only env,limits,handoff,posted,zerocopy,throughput $scale > "$d/suite.log" 2>&1 \
    || echo "   the suite failed (status $?; $d/suite.log)"
  timeout -k 5 90 "$py" bench/torch_queue.py --out "$d" $scale > "$d/torch.log" 2>&1 \
    || echo "   the PyTorch queue failed (status $?; $d/torch.log)"
  timeout -k 5 30 "$py" bench/report.py --out "$d" > "$d/report.log" 2>&1 \
    || echo "   the report failed (status $?; $d/report.log)"
done
"$py" bench/floor_summary.py --out "$out" "${dirs[@]}"
