#!/usr/bin/env bash
# The remote lane (feature `remote`) on one GPU machine: two processes, device memory at both ends,
# every frame checked on the GPU, the transport UCX reported, and the benchmark against the bare
# NIXL WRITE + notification loop and the local channel (docs/gpu-verification.md records it).
#
# Here, on the build machine, from the project root (the GPU machine has no Rust and no network):
#   GPU_BUNDLE_TGZ=1 "$BUNDLE_SH" --features remote   # the release bundle with the lane:
#                                                       # target/gpu-bundle.tgz (BUNDLE_SH: the
#                                                       # bundle script of the GPU machine's notes)
#   scripts/gpu-remote-verify.sh pack                   # target/nixl-libs.tgz (about 11 MB)
# Carry target/gpu-bundle.tgz, target/nixl-libs.tgz and this script (scripts/), then there:
#   tar xzf target/gpu-bundle.tgz -C target && tar xzf target/nixl-libs.tgz -C target &&
#   bash scripts/gpu-remote-verify.sh run [RUNS]
#
# `pack` takes from the installed nixl-cu13 wheel only what the lane loads: libnixl_capi.so and the
# NIXL libraries it needs, the UCX backend plugin, UCX's libraries and its transport modules
# (cuda, cma, ib, ...), each with what it needs from the wheel; compressed, keeping the wheel's
# folder layout (the libraries find each other through their $ORIGIN run paths).
#
# `run`, each case bounded by `timeout` (the exit status counts the failed cases):
#   1. network path: UCX_TLS=tcp,cuda_copy, 1,000 4K frames (3840x2160x4 bytes), every frame checked;
#   2. default path (UCX's own choice), 10,000 4K frames, every frame checked;
#   3. a VMM near pool (UCX's registration of another memory kind), 1,000 4K frames, and the
#      bridges as threads of the producer's and the far consumer's processes (`--in-process`);
#   4. benchmark, RUNS times (default 3), default path: the lane and the raw NIXL loop flat out
#      (5,000 frames, the first 100 left out of the figures: they set up what later ones reuse)
#      (frames/s) and paced at one frame per 2 ms (hand-off p50 without queueing), and the local
#      channel (05_pipeline, one consumer) for scale; the medians and the targets
#      (lane >= 90 % of raw frames/s, lane p50 <= raw p50 + 10 us) at the end;
#   5. with MPS (when nvidia-cuda-mps-control is there): the default case (1,000 frames) and the
#      benchmark again. Without MPS the GPU time-slices between the lane's processes (producer,
#      sending bridge, far consumer each run GPU work), where the raw loop's GPU work is one
#      process's.
# CASES=0 skips 1-3 (and the MPS case of 5). UCX_PROTO_INFO=y is set; what UCX printed about its protocol choices for the WRITEs is shown.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-run}

if [ "$what" = pack ]; then
  py=${PYTHON:-python3}
  site=$("$py" -c 'import importlib.util, os; s = importlib.util.find_spec("nixl_cu13"); print(os.path.realpath(os.path.join(os.path.dirname(s.origin), "..")))') ||
    { echo "nixl-cu13 is not installed: pip install --no-deps nixl-cu13==1.5.1" >&2; exit 2; }
  list=$("$py" - "$site" <<'PY'
import os, re, subprocess, sys
site = sys.argv[1]
meson, libs = ".nixl_cu13.mesonpy.libs", "nixl_cu13.libs"
dirs = [os.path.join(site, meson), os.path.join(site, libs)]
def needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)
roots = [os.path.join(site, meson, "libnixl_capi.so"),
         os.path.join(site, meson, "plugins", "libplugin_UCX.so")]
ucx_modules = os.path.join(site, libs, "ucx")
roots += [os.path.join(ucx_modules, f) for f in sorted(os.listdir(ucx_modules))
          if ".so" in f and "perftest" not in f]
seen, todo = set(), list(roots)
while todo:
    p = todo.pop()
    if p in seen or not os.path.exists(p):
        continue
    seen.add(p)
    for n in needed(p):
        for d in dirs:
            c = os.path.join(d, n)
            if os.path.exists(c):
                todo.append(c)
                break
for p in sorted(seen):
    print(os.path.relpath(p, site))
PY
) || exit 2
  tmp=$(mktemp -d)
  mkdir -p "$tmp/nixl-libs"
  (cd "$site" && echo "$list" | tar cf - -T -) | tar xf - -C "$tmp/nixl-libs"
  find "$tmp/nixl-libs" -type f -name '*.so*' -exec strip --strip-unneeded {} + 2>/dev/null || true
  mkdir -p target
  tar czf target/nixl-libs.tgz -C "$tmp" nixl-libs && rm -rf "$tmp"
  echo "$list" | sed 's/^/  /'
  du -sh target/nixl-libs.tgz | sed 's/^/packed: /'
  exit 0
fi
[ "$what" = run ] || { echo "usage: scripts/gpu-remote-verify.sh pack | run [RUNS]" >&2; exit 2; }

runs=${2:-3}
log=${GPU_LOG_DIR:-/tmp}/gpu-log.txt
libs=target/nixl-libs/.nixl_cu13.mesonpy.libs
[ -f "$libs/libnixl_capi.so" ] || { echo "no $libs: tar xzf target/nixl-libs.tgz -C target" >&2; exit 2; }
export LD_LIBRARY_PATH="$PWD/$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_PLUGIN_DIR="$PWD/$libs/plugins"
export UCX_PROTO_INFO=y
bins=""
for d in target/gpu-bundle/examples target/release/examples; do
  if [ -x "$d/remote_pipeline" ]; then bins=$d; break; fi
done
[ -n "$bins" ] || { echo "no remote_pipeline: build the bundle with --features remote" >&2; exit 2; }
ex=$bins/remote_pipeline
out=${GPU_LOG_DIR:-/tmp}/remote-verify
mkdir -p "$out"
failed=0
say() { echo "$*" | tee -a "$log"; }
{ echo "== remote lane $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,driver_version,uuid --format=csv,noheader; } | tee -a "$log"

case_run() { # NAME TIMEOUT ARGS... ; output kept in $out/NAME.txt
  local name=$1 t=$2; shift 2
  say "-- $name: $*"
  if timeout "$t" "$@" > "$out/$name.txt" 2>&1 && grep -q '^OK' "$out/$name.txt"; then
    grep -E 'consumer: |producer: |send bridge: (Closed|Producer)|raw ' "$out/$name.txt" | tee -a "$log"
    say "   $name: ok"
  else
    tail -n 20 "$out/$name.txt" | tee -a "$log"
    say "   $name: FAILED"; failed=$((failed + 1))
  fi
  # What UCX itself printed for the lane's WRITEs (the send bridge passes the lines on).
  grep -E 'UCX: |HOST-STAGED' "$out/$name.txt" | sort -u | head -n 12 | tee -a "$log"
}

if [ "${CASES:-1}" != 0 ]; then
  UCX_TLS=tcp,cuda_copy case_run network-4k 1200 "$ex" --memory device --4k --frames 1000
  case_run default-4k 1200 "$ex" --memory device --4k --frames 10000
  case_run vmm-4k 600 "$ex" --memory device --pool vmm --4k --frames 1000
  case_run inproc-4k 600 "$ex" --memory device --4k --frames 1000 --in-process
fi

# Benchmark: frames/s flat out, and hand-off p50 paced (one frame per 2 ms). LABEL names the
# GPU's sharing: `time-sliced` (the default: each process's context runs in turn) or `mps`.
grab() { grep -oE "$2" "$1" 2>/dev/null | head -n 1 | grep -oE '[0-9]+(\.[0-9]+)?' | tail -n 1; }
bench() { # LABEL
  local label=$1 tsv=$out/bench-$1.tsv
  : > "$tsv"
  for r in $(seq 1 "$runs"); do
    local p=$out/$label d="--memory device --4k"
    # The lane as verified (the far consumer checks every frame on the GPU), then like for like
    # with the raw loop (the far consumer takes and releases each frame untouched, as the raw
    # target leaves its buffer), with the bridges as processes and in-process.
    timeout 600 "$ex" $d --frames 5000 > "$p-lane-$r.txt" 2>&1 || failed=$((failed + 1))
    timeout 600 "$ex" $d --frames 5000 --no-check > "$p-bare-$r.txt" 2>&1 || failed=$((failed + 1))
    timeout 600 "$ex" $d --frames 5000 --no-check --in-process > "$p-inproc-$r.txt" 2>&1 || failed=$((failed + 1))
    timeout 600 "$ex" $d --frames 5000 --raw > "$p-raw-$r.txt" 2>&1 || failed=$((failed + 1))
    timeout 600 "$ex" $d --frames 500 --pace-us 2000 --no-check > "$p-bare-paced-$r.txt" 2>&1 || failed=$((failed + 1))
    timeout 600 "$ex" $d --frames 500 --pace-us 2000 --no-check --in-process > "$p-inproc-paced-$r.txt" 2>&1 || failed=$((failed + 1))
    timeout 600 "$ex" $d --frames 500 --pace-us 2000 --raw > "$p-raw-paced-$r.txt" 2>&1 || failed=$((failed + 1))
    if [ -x "$bins/05_pipeline" ]; then
      timeout 600 "$bins/05_pipeline" --frames 1000 --consumers 1 > "$p-local-$r.txt" 2>&1 || failed=$((failed + 1))
    fi
    local fps='received [0-9]+ frames \([0-9.]+ frames/s' p50='p50 [0-9.]+ us'
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' \
      "$(grab "$p-lane-$r.txt" "$fps")" "$(grab "$p-bare-$r.txt" "$fps")" \
      "$(grab "$p-inproc-$r.txt" "$fps")" \
      "$(grab "$p-raw-$r.txt" 'notifications of [0-9]+ \([0-9.]+ frames/s')" \
      "$(grab "$p-bare-paced-$r.txt" "$p50")" "$(grab "$p-inproc-paced-$r.txt" "$p50")" \
      "$(grab "$p-raw-paced-$r.txt" "$p50")" \
      "$(grab "$p-local-$r.txt" 'received [0-9]+ frames \([0-9.]+/s')" \
      "$(grab "$p-local-$r.txt" "$p50")" >> "$tsv"
  done
  say "-- benchmark, GPU $label (4K device frames, default path; $runs runs): checked_fps lane_fps inproc_fps raw_fps lane_p50_us inproc_p50_us raw_p50_us local_fps local_p50_us"
  tee -a "$log" < "$tsv"
  python3 - "$tsv" "$label" <<'PY' | tee -a "$log"
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
def med(i):
    v = [float(r[i]) for r in rows if len(r) > i and r[i]]
    return statistics.median(v) if v else float("nan")
chk, lane, ip, raw, lp, ipp, rp, loc, locp = (med(i) for i in range(9))
g = sys.argv[2]
print(f"medians ({g}), raw NIXL loop {raw:.0f} frames/s, paced p50 {rp:.1f} us:")
print(f"  lane, bridge processes: {lane:.0f} frames/s ({lane / raw * 100:.0f} % of raw; target >= 90 %), "
      f"p50 {lp:.1f} us ({lp - rp:+.1f} us; target <= +10 us)")
print(f"  lane, bridges in-process: {ip:.0f} frames/s ({ip / raw * 100:.0f} % of raw), p50 {ipp:.1f} us ({ipp - rp:+.1f} us)")
print(f"  lane with every far frame checked on the GPU: {chk:.0f} frames/s ({chk / raw * 100:.0f} % of raw)")
print(f"  local channel (05_pipeline, 1 consumer): {loc:.0f} frames/s, p50 {locp:.1f} us")
met = lambda f, p: f >= 0.9 * raw and p <= rp + 10
print(f"targets ({g}): bridge processes " + ("met" if met(lane, lp) else "NOT met")
      + ", bridges in-process " + ("met" if met(ip, ipp) else "NOT met"))
PY
}
bench time-sliced

# The same under MPS (one server runs every client's work side by side: the processes of a lane
# on one GPU no longer take turns), with the default case again, every frame checked.
if command -v nvidia-cuda-mps-control > /dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/cuda-ipc-mps-pipe}
  export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/cuda-ipc-mps-log}
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    sleep 1
    [ "${CASES:-1}" != 0 ] && case_run mps-default-4k 600 "$ex" --memory device --4k --frames 1000
    bench mps
    echo quit | nvidia-cuda-mps-control
    sleep 1
  else
    say "-- MPS: the control daemon did not start; no MPS benchmark"
  fi
else
  say "-- MPS: nvidia-cuda-mps-control not found; no MPS benchmark"
fi
say "== remote lane verification: $failed failed"
exit $failed
