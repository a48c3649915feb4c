#!/usr/bin/env bash
# Checks the monitoring and the quota on a machine with a CUDA GPU (docs/gpu-verification.md):
#   1. NVML's figures (through `cuda-ipc metrics`) beside nvidia-smi's for the same moment, with a
#      producer of this crate holding device memory, and its pid matched to that participant;
#   2. the quota refusing a second producer that would exceed the device's budget, naming the
#      first and its bytes; the first killed with SIGKILL, the second's retry getting the bytes;
#   3. `cuda-ipc watch`'s live view during 05_pipeline, captured with tmux (when tmux is there).
#
#   scripts/gpu-monitor-verify.sh            # builds what it needs (release), then runs
#   OUT=/some/dir scripts/gpu-monitor-verify.sh   # also writes the transcript and the capture there
#
# Without a Rust toolchain on the GPU machine: build elsewhere with
#   cargo build --release -p cuda-ipc-cli -p cuda-ipc-examples --example 09_quota --example 05_pipeline
# copy target/release/cuda-ipc and target/release/examples/{09_quota,05_pipeline} over, and set
# CUDA_IPC_BIN, QUOTA_EXAMPLE and PIPELINE_EXAMPLE to them.
# Exits non-zero when a check fails. Leaves no budget behind: one this script set is removed, and a
# budget that was already set for the GPU is refused at the start rather than changed.
set -euo pipefail
cd "$(dirname "$0")/.."

CLI=${CUDA_IPC_BIN:-target/release/cuda-ipc}
QUOTA=${QUOTA_EXAMPLE:-target/release/examples/09_quota}
PIPELINE=${PIPELINE_EXAMPLE:-target/release/examples/05_pipeline}
OUT=${OUT:-}
if [ ! -x "$CLI" ] || [ ! -x "$QUOTA" ] || [ ! -x "$PIPELINE" ]; then
  cargo build --release -p cuda-ipc-cli -p cuda-ipc-examples --example 09_quota --example 05_pipeline
fi
command -v nvidia-smi >/dev/null || { echo "FAIL nvidia-smi not found: run this on the GPU machine"; exit 1; }

failed=0
log() { if [ -n "$OUT" ]; then mkdir -p "$OUT"; tee -a "$OUT/gpu-monitor-verify.txt"; else cat; fi; }
# Not in a pipeline (a pipeline's functions run in a subshell, which would lose `failed`).
pass() { echo "PASS $*" | log; }
fail() { echo "FAIL $*" | log; failed=1; }
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  if [ -n "${SET_BUDGET:-}" ]; then "$CLI" quota remove --device "$UUID" >/dev/null 2>&1 || true; fi
  # The killed producers' channel segments.
  "$CLI" gc >/dev/null 2>&1 || true
}
trap cleanup EXIT

# A plain HTTP GET over loopback, with curl or Python.
fetch() {
  if command -v curl >/dev/null; then curl -fsS "$1"
  else python3 -c 'import sys,urllib.request;sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' "$1"
  fi
}

UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -n1 | tr -d ' ')
echo "GPU 0: $UUID" | log
if "$CLI" quota show --json | grep -q "\"$UUID\""; then
  echo "FAIL a budget is already set for $UUID; remove it first (cuda-ipc quota remove --device $UUID) or run elsewhere" | log
  exit 1
fi

# --- 1. NVML beside nvidia-smi --------------------------------------------------------------------
POOL=$((256 << 20))    # bytes per buffer; 2 buffers = 512 MiB
# The example reserves from the device's budget: none yet, so an unlimited one (removed at the end).
"$CLI" quota set --device "$UUID" --bytes unlimited | log
SET_BUDGET=1
"$QUOTA" --buffers 2 --bytes $POOL --hold 60 --name verify-holder > /tmp/cuda-ipc-verify-holder.txt 2>&1 &
pids+=($!)
HOLDER=$!
for _ in $(seq 100); do grep -q created /tmp/cuda-ipc-verify-holder.txt && break; sleep 0.1; done
grep -q created /tmp/cuda-ipc-verify-holder.txt || { cat /tmp/cuda-ipc-verify-holder.txt; fail "the holder producer did not start"; exit 1; }

"$CLI" metrics --listen 127.0.0.1:0 > /tmp/cuda-ipc-verify-metrics.txt 2>&1 &
pids+=($!)
for _ in $(seq 100); do grep -q serving /tmp/cuda-ipc-verify-metrics.txt && break; sleep 0.1; done
URL=$(sed -n 's/^serving OpenMetrics on //p' /tmp/cuda-ipc-verify-metrics.txt)
[ -n "$URL" ] || { cat /tmp/cuda-ipc-verify-metrics.txt; fail "cuda-ipc metrics did not start"; exit 1; }

{
  echo "== the same moment: cuda-ipc metrics (NVML) and nvidia-smi"
  date -u +%FT%T.%3NZ
  fetch "$URL" > /tmp/cuda-ipc-verify-scrape.txt & a=$!
  nvidia-smi --query-gpu=utilization.gpu,memory.used,memory.total --format=csv > /tmp/cuda-ipc-verify-smi-gpu.txt & b=$!
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv > /tmp/cuda-ipc-verify-smi-apps.txt & c=$!
  wait $a $b $c
  echo "-- cuda-ipc (NVML):"
  grep -E '^cuda_ipc_(nvml_available|gpu_)' /tmp/cuda-ipc-verify-scrape.txt
  echo "-- nvidia-smi --query-gpu=utilization.gpu,memory.used,memory.total --format=csv:"
  cat /tmp/cuda-ipc-verify-smi-gpu.txt
  echo "-- nvidia-smi --query-compute-apps=pid,used_memory --format=csv:"
  cat /tmp/cuda-ipc-verify-smi-apps.txt
  echo "-- cuda-ipc doctor (NVML, quota, MPS lines):"
  "$CLI" doctor | grep -E '^(ok|warn|info|FAIL) +(NVML|quota|MPS)' || true
} | log
if grep -q '^cuda_ipc_nvml_available 1' /tmp/cuda-ipc-verify-scrape.txt; then pass "NVML answered"; else fail "NVML did not answer"; fi
# Memory used by GPU 0 in MiB, both ways (NVML bytes → MiB); they should agree within a few MiB.
nvml_mib=$(awk -F' ' '/^cuda_ipc_gpu_memory_used_bytes\{gpu="0"/ {printf "%d", $2/1048576}' /tmp/cuda-ipc-verify-scrape.txt)
smi_mib=$(sed -n 2p /tmp/cuda-ipc-verify-smi-gpu.txt | awk -F', ' '{print $2}' | tr -dc 0-9)
echo "memory used, GPU 0: NVML ${nvml_mib:-?} MiB, nvidia-smi ${smi_mib:-?} MiB" | log
if [ -n "$nvml_mib" ] && [ -n "$smi_mib" ] && [ $(( nvml_mib > smi_mib ? nvml_mib - smi_mib : smi_mib - nvml_mib )) -le 64 ]; then
  pass "memory used agrees within 64 MiB"
else
  fail "memory used differs"
fi
if grep -E "^cuda_ipc_gpu_process_memory_bytes\{gpu=\"0\",pid=\"$HOLDER\",participant=\"producer of verify-holder\"\}" /tmp/cuda-ipc-verify-scrape.txt | log; then
  pass "the holder (pid $HOLDER) is matched to its participant"
else
  fail "the holder (pid $HOLDER) is not matched to 'producer of verify-holder'"
fi
if grep -q "^$HOLDER," /tmp/cuda-ipc-verify-smi-apps.txt; then pass "nvidia-smi lists the holder too"; else fail "nvidia-smi does not list pid $HOLDER"; fi
kill -9 "$HOLDER" 2>/dev/null || true
wait "$HOLDER" 2>/dev/null || true

# --- 2. The quota refusing a second producer ---------------------------------------------------------
# A budget for one pool (512 MiB) and a half: the second pool does not fit.
"$CLI" quota set --device "$UUID" --bytes 768MiB | log
"$QUOTA" --buffers 2 --bytes $POOL --hold 60 --name verify-first > /tmp/cuda-ipc-verify-first.txt 2>&1 &
pids+=($!)
FIRST=$!
for _ in $(seq 100); do grep -q created /tmp/cuda-ipc-verify-first.txt && break; sleep 0.1; done
cat /tmp/cuda-ipc-verify-first.txt | log
"$CLI" quota show | log
set +e
"$QUOTA" --buffers 2 --bytes $POOL --hold 0 --name verify-second > /tmp/cuda-ipc-verify-second.txt 2>&1
rc=$?
set -e
cat /tmp/cuda-ipc-verify-second.txt | log
if [ $rc -eq 3 ] && grep -qi "over quota on $UUID" /tmp/cuda-ipc-verify-second.txt \
   && grep -q "pid $FIRST (" /tmp/cuda-ipc-verify-second.txt; then
  pass "the second producer is refused (OverQuota names pid $FIRST and its bytes)"
else
  fail "the second producer was not refused as expected (status $rc)"
fi
kill -9 "$FIRST"
t0=$(date +%s%N)
ok=0
for _ in $(seq 50); do
  if "$QUOTA" --buffers 2 --bytes $POOL --hold 0 --name verify-third > /tmp/cuda-ipc-verify-third.txt 2>&1; then ok=1; break; fi
  sleep 0.02
done
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
cat /tmp/cuda-ipc-verify-third.txt | log
if [ $ok -eq 1 ]; then pass "after kill -9 of the first, a producer got the bytes ${ms} ms later"; else fail "the killed producer's bytes did not come back"; fi
"$CLI" quota remove --device "$UUID" | log
SET_BUDGET=

# --- 3. watch during 05_pipeline -------------------------------------------------------------------
if command -v tmux >/dev/null; then
  "$PIPELINE" --frames 200000 > /tmp/cuda-ipc-verify-pipeline.txt 2>&1 &
  pids+=($!)
  sleep 3
  tmux new-session -d -s cuda-ipc-verify -x 160 -y 48 "$CLI watch --interval 500"
  sleep 4
  cap=${OUT:-/tmp}/watch-during-pipeline.txt
  tmux capture-pane -p -t cuda-ipc-verify > "$cap"
  tmux kill-session -t cuda-ipc-verify || true
  echo "== cuda-ipc watch during 05_pipeline (tmux capture, $cap):" | log
  cat "$cap" | log
  if grep -q "frames/s" "$cap" && grep -q "GPUs (NVML)" "$cap"; then pass "watch shows the pipeline and the GPU"; else fail "watch capture lacks its panes"; fi
else
  echo "skip watch capture: tmux is not installed (apt-get install tmux)" | log
fi

if [ $failed -eq 0 ]; then echo "all checks passed" | log; else echo "some checks FAILED" | log; fi
exit $failed
