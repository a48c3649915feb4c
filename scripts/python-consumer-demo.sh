#!/usr/bin/env bash
# A Rust producer and a Python consumer on one GPU: the `python_producer` example fills every frame
# with a kernel; python/examples/torch_consumer.py receives each one zero-copy, first as a PyTorch
# tensor, then (second run) as a CuPy array, and checks every word on the GPU. Fails when either
# side fails.
#
#   scripts/python-consumer-demo.sh [FRAMES]        # default 2000 frames of 3840x2160x4 bytes
#   VIA="torch" scripts/python-consumer-demo.sh     # only the PyTorch run
#   MEMORY=vmm scripts/python-consumer-demo.sh      # pool of VMM memory (auto|legacy|vmm|pool;
#                                                   # default auto), passed as --memory
#
# The producer binary is taken from target/gpu-bundle/examples (a bundle built elsewhere), else
# target/release/examples, else built with cargo. Output is also appended to
# $GPU_LOG_DIR/gpu-log.txt (default /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
frames=${1:-2000}
via_list=${VIA:-"torch cupy"}
memory=${MEMORY:-auto}
case "$memory" in
  auto|legacy|vmm|pool) ;;
  *) echo "MEMORY must be auto, legacy, vmm or pool, not '$memory'" >&2; exit 2 ;;
esac
py=${PYTHON:-python3}
log=${GPU_LOG_DIR:-/tmp}/gpu-log.txt

bin=""
for b in target/gpu-bundle/examples/python_producer target/release/examples/python_producer; do
  if [ -x "$b" ]; then bin=$b; break; fi
done
if [ -z "$bin" ]; then
  cargo build --release -p cuda-ipc-examples --example python_producer || exit 1
  bin=target/release/examples/python_producer
fi

{ echo "== $(date -u +%FT%TZ) python consumer demo: $frames frames, via $via_list, memory $memory"
  nvidia-smi --query-gpu=name,driver_version,uuid --format=csv,noheader 2>/dev/null
  "$py" -c 'import sys; print("python", sys.version.split()[0])'
} | tee -a "$log"

rc=0
for via in $via_list; do
  name="pydemo-$$-$via"
  "$bin" --channel "$name" --frames "$frames" --consumers 1 --memory "$memory" > >(tee -a "$log") 2>&1 &
  producer=$!
  "$py" python/examples/torch_consumer.py "$name" --via "$via" --frames "$frames" > >(tee -a "$log") 2>&1 &
  consumer=$!
  wait "$producer"; rp=$?
  # A producer that failed leaves the consumer waiting for a channel that will not come.
  if [ "$rp" != 0 ]; then kill "$consumer" 2>/dev/null; fi
  wait "$consumer"; rcons=$?
  echo "== $via: producer exit $rp, python consumer exit $rcons" | tee -a "$log"
  if [ "$rp" != 0 ] || [ "$rcons" != 0 ]; then rc=1; fi
done
echo "== python consumer demo exit status $rc" | tee -a "$log"
exit $rc
