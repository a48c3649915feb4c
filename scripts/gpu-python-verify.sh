#!/usr/bin/env bash
# The Python extension on a GPU machine, every frame checked (docs/gpu-verification.md records the
# results). Needs the extension importable (`pip install ./python`, or PYTHONPATH at an unpacked
# wheel), PyTorch and CuPy (JAX is used when installed, and reported missing when not), and the
# examples python_producer and rust_consumer (target/gpu-bundle/examples, else target/release).
#
#   scripts/gpu-python-verify.sh [FRAMES]        # default 1000 frames per case
#
# Cases: a PyTorch producer -> the Rust consumer; the Rust producer -> PyTorch, CuPy and JAX
# consumers (DLPack, zero-copy checked); PyTorch -> PyTorch in both delivery policies and every
# memory kind, on streams of their own with no host synchronisation (and the unordered control,
# which must see mismatches); kill -9 of a Python producer -> ProducerGone within 1 s; a model built
# in cuda_ipc.torch_mem_pool() (every tensor in the VMM arena, outputs equal to PyTorch's own).
# Each case is bounded by `timeout`; the exit status is the number of failed cases.
set -uo pipefail
cd "$(dirname "$0")/.."
frames=${1:-1000}
py=${PYTHON:-python3}
log=${GPU_LOG_DIR:-/tmp}/gpu-log.txt
bins=""
for d in target/gpu-bundle/examples target/release/examples; do
  if [ -x "$d/rust_consumer" ] && [ -x "$d/python_producer" ]; then bins=$d; break; fi
done
[ -n "$bins" ] || { echo "no python_producer/rust_consumer binaries: build the examples (cargo build --release -p cuda-ipc-examples --examples)" >&2; exit 2; }
failed=0
say() { echo "$*" | tee -a "$log"; }
run() { # NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  say "-- $name"
  if timeout "$t" "$@" 2>&1 | tee -a "$log" | tail -n 4; then say "   $name: ok"; else say "   $name: FAILED"; failed=$((failed + 1)); fi
}
pair() { # NAME TIMEOUT PRODUCER_CMD -- CONSUMER_CMD : both must exit 0
  local name=$1 t=$2; shift 2
  local prod=() cons=()
  while [ "$1" != "--" ]; do prod+=("$1"); shift; done; shift; cons=("$@")
  say "-- $name"
  timeout "$t" "${prod[@]}" > "/tmp/$name.prod" 2>&1 & local pp=$!
  timeout "$t" "${cons[@]}" > "/tmp/$name.cons" 2>&1; local rc=$?
  wait $pp; local prc=$?
  tail -n 3 "/tmp/$name.prod" | tee -a "$log"; tail -n 3 "/tmp/$name.cons" | tee -a "$log"
  if [ $rc -eq 0 ] && [ $prc -eq 0 ]; then say "   $name: ok"; else say "   $name: FAILED (producer $prc, consumer $rc)"; failed=$((failed + 1)); fi
}

say "== $(date -u +%FT%TZ) python extension on the GPU: $frames frames per case"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | tee -a "$log"
"$py" -c 'import sys, torch, cupy, cuda_ipc; print("python", sys.version.split()[0], "torch", torch.__version__, "cupy", cupy.__version__, "cuda_ipc", cuda_ipc.__version__)' 2>&1 | tee -a "$log"
if "$py" -c 'import jax' 2>/dev/null; then have_jax=1; else have_jax=0; say "jax: not installed here ($("$py" -c 'import jax' 2>&1 | tail -n 1))"; fi

for mem in auto vmm pool; do
  pair "torch-to-rust-$mem" 180 "$py" python/examples/torch_producer.py "t2r-$mem-$$" --frames "$frames" --memory "$mem" --sleep-cycles 1000000 -- \
    "$bins/rust_consumer" --channel "t2r-$mem-$$" --frames "$frames"
done
vias="torch cupy"; [ $have_jax = 1 ] && vias="$vias jax"
for via in $vias; do
  pair "rust-to-$via" 180 "$bins/python_producer" --channel "r2p-$via-$$" --frames "$frames" -- \
    "$py" python/examples/torch_consumer.py "r2p-$via-$$" --via "$via" --frames "$frames"
done
for mem in legacy vmm pool; do
  run "torch-pair-every-$mem" 240 "$py" python/examples/extension_torch_pair.py --memory "$mem" --frames "$frames"
done
run "torch-pair-latest" 240 "$py" python/examples/extension_torch_pair.py --delivery latest --frames "$frames"
run "torch-pair-unordered-control" 240 "$py" python/examples/extension_torch_pair.py --unordered --frames 200
for mem in legacy vmm; do
  run "kill-python-producer-$mem" 180 "$py" python/examples/extension_kill.py --memory "$mem" --rounds 3
done
run "torch-mem-pool" 180 "$py" python/examples/torch_mem_pool.py
say "== python extension on the GPU: $failed case(s) failed"
exit $failed
