#!/usr/bin/env bash
# Compiles kernels/*.cu to kernels/*.ptx (compute_75, PTX ISA 8.0: loaded by any CUDA 12 or newer
# driver) without a CUDA toolkit: NVRTC of CUDA 12.0 from NVIDIA's wheel on PyPI
# (`nvidia-cuda-nvrtc-cu12`), unpacked into a cache folder (CUDA_IPC_NVRTC_DIR, default
# ~/.cache/cuda-ipc-nvrtc), about 60 MB, driven by scripts/nvrtc-ptx.py. `--check` compiles to
# temporary files and fails when a checked-in PTX differs.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${CUDA_IPC_NVRTC_DIR:-$HOME/.cache/cuda-ipc-nvrtc}
lib="$dir/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
if [ ! -f "$lib" ] || [ ! -f "$dir/nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.12.0" ]; then
  mkdir -p "$dir/wheels"
  python3 -m pip download --quiet --no-deps -d "$dir/wheels" "nvidia-cuda-nvrtc-cu12==12.0.140"
  for w in "$dir"/wheels/*.whl; do python3 -m zipfile -e "$w" "$dir/"; done
fi
status=0
for cu in kernels/*.cu; do
  ptx=${cu%.cu}.ptx
  if [ "${1:-}" = --check ]; then
    out=$(mktemp --suffix=.ptx)
    python3 scripts/nvrtc-ptx.py "$lib" "$cu" "$out"
    if ! diff -q "$out" "$ptx" >/dev/null 2>&1; then
      echo "$ptx is not what $cu compiles to: run scripts/build-ptx.sh" >&2
      status=1
    fi
    rm -f "$out"
  else
    python3 scripts/nvrtc-ptx.py "$lib" "$cu" "$ptx"
  fi
done
exit $status
