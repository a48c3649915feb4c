#!/usr/bin/env bash
# The tensor-set comparisons of docs/benchmarks.md ("Tensor sets: the floor and PyTorch's
# baselines") on a GPU machine, from the repository root:
#
#   scripts/bench-tensorset.sh OUT_DIR [--quick]
#
# 1. the driver's attach floor (bench/floor/tensorset_floor.rs, binary tensorset_floor; >= 20 fresh
#    processes each): the Llama-8B shape as one allocation, the same split in 1 GiB allocations (what
#    a model in cuda_ipc.torch_mem_pool's arena makes), two buffers (double-buffered mode), and the
#    MoE shape's bytes; beside the first, the crate's own Rust attach of the same set
#    (`tensorset_floor --crate`: TensorSetReader::open + current() in fresh processes,
#    crate-llama/tensorset_attach_rust.json); 2. PyTorch's torch.multiprocessing baselines of the same shapes
#    (bench/tensorset_baseline.py, 3 runs); 3. updates from flat, scattered and planned sources
#    against one copy and torch._foreach_copy_ (bench/tensorset_update.py, MoE, 20,000 x 64 KiB and
#    Llama shapes, 3 runs each; "Tensor sets: updates from many separate sources"). The binary: target/gpu-bundle/examples/tensorset_floor,
#    else target/release/examples/tensorset_floor (`cargo build --release -p cuda-ipc-bench
#    --example tensorset_floor`). Every step is bounded by `timeout`; a failed step leaves the others
#    running; the exit status is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/bench-tensorset.sh OUT_DIR [--quick]}
quick=""
[ "${2:-}" = "--quick" ] && quick="--quick"
py=${PYTHON:-python3}
bin=""
for b in target/gpu-bundle/examples/tensorset_floor target/release/examples/tensorset_floor; do
  [ -x "$b" ] && { bin=$b; break; }
done
[ -n "$bin" ] || { echo "no tensorset_floor binary (cargo build --release -p cuda-ipc-bench --example tensorset_floor)" >&2; exit 2; }
mkdir -p "$out"
failed=0
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $(date -u +%T) $name (at most ${limit} s)"
  if timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1; then
    tail -n 3 "$out/$name.log"
  else
    echo "   $name failed (status $?; $out/$name.log)"; failed=$((failed + 1))
  fi
}
moe=$((4608 << 20))
step floor-llama 300 "$bin" $quick --out "$out/floor-llama"
step crate-llama 300 "$bin" $quick --crate --out "$out/crate-llama"
step floor-llama-1gib 300 "$bin" $quick --chunk-bytes $((1 << 30)) --out "$out/floor-llama-1gib"
step floor-llama-2buf 300 "$bin" $quick --allocations 2 --out "$out/floor-llama-2buf"
if [ -z "$quick" ]; then
  step floor-moe 300 "$bin" --bytes $moe --out "$out/floor-moe"
fi
step pytorch-baseline 900 "$py" bench/tensorset_baseline.py --out "$out" $quick
if [ -n "$quick" ]; then
  step update-quick 120 "$py" bench/tensorset_update.py --shape quick --runs 1 --out "$out/update-quick.json"
else
  for s in moe small llama; do
    step "update-$s" 300 "$py" bench/tensorset_update.py --shape "$s" --out "$out/update-$s.json"
  done
fi
echo "== tensor-set benchmarks: $failed step(s) failed; results in $out"
exit $failed
