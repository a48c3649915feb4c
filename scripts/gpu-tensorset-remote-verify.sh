#!/usr/bin/env bash
# Tensor sets across hosts (issue 27) on one GPU machine: the GPU tests of the tensor-set bridges
# (device sets, UCX's own choice and forced TCP, every byte checked on the GPU, a kill mid
# generation) and the benchmark against raw NIXL of the same bytes (docs/benchmarks.md, "Tensor
# sets across hosts"; docs/gpu-verification.md records the results).
#
# Here, on the build machine, from the project root:
#   cargo test --release --features remote --test remote_tensorset_gpu --no-run
#   cargo build --release --features remote -p cuda-ipc-bench --example tensorset_remote
#   scripts/gpu-remote-verify.sh pack          # target/nixl-libs.tgz (NIXL's and UCX's libraries)
# Carry the test binary (target/release/deps/remote_tensorset_gpu-*), the benchmark
# (target/release/examples/tensorset_remote), target/nixl-libs.tgz and this script, then there:
#   tar xzf target/nixl-libs.tgz -C target && bash scripts/gpu-tensorset-remote-verify.sh [RUNS]
# Each step is bounded by `timeout`; the exit status counts the failed ones.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
libs=target/nixl-libs/.nixl_cu13.mesonpy.libs
[ -f "$libs/libnixl_capi.so" ] || { echo "no $libs: tar xzf target/nixl-libs.tgz -C target" >&2; exit 2; }
export LD_LIBRARY_PATH="$PWD/$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_PLUGIN_DIR="$PWD/$libs/plugins"
log=${GPU_LOG_DIR:-/tmp}/gpu-log.txt
failed=0
say() { echo "$*" | tee -a "$log"; }
{ echo "== tensor sets across hosts $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee -a "$log"
t=$(ls -t target/release/deps/remote_tensorset_gpu-* 2>/dev/null | grep -v '\.d$' | head -n 1)
if [ -n "$t" ]; then
  say "-- $t"
  timeout 1800 "$t" --include-ignored --test-threads=1 2>&1 | grep -E '^test |test result|panicked|UCX transport' | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed=$((failed + 1))
else
  say "-- no remote_tensorset_gpu test binary"; failed=$((failed + 1))
fi
b=target/release/examples/tensorset_remote
if [ -x "$b" ]; then
  # One transport per step, so that a bound cut short loses one row; the benchmark prints its
  # progress on stderr. The changed tensors told by the writer, then found by the sending bridge's
  # content digests (a kernel over the near set).
  for args in "--tls default" "--tls tcp" "--tls default --digests" "--tls tcp --digests"; do
    say "-- $b --runs $runs $args"
    timeout 1200 "$b" --runs "$runs" $args 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || failed=$((failed + 1))
  done
else
  say "-- no $b"; failed=$((failed + 1))
fi
say "== tensor sets across hosts: $failed failed"
exit $failed
