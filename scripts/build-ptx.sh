#!/usr/bin/env bash
# Compiles kernels/*.cu to kernels/*.ptx (compute_75) without a CUDA toolkit: NVIDIA's
# CUDA 13.0 compiler wheels from PyPI (nvcc, its C runtime headers, NVVM, the runtime's headers),
# unpacked into a cache folder (CUDA_IPC_NVCC_DIR, default ~/.cache/cuda-ipc-nvcc), about 80 MB.
# `--check` compiles to temporary files and fails when a checked-in PTX differs.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${CUDA_IPC_NVCC_DIR:-$HOME/.cache/cuda-ipc-nvcc}
nvcc="$dir/nvidia/cu13/bin/nvcc"
if [ ! -x "$nvcc" ] || [ ! -x "$dir/nvidia/cu13/nvvm/bin/cicc" ]; then
  mkdir -p "$dir/wheels"
  python3 -m pip download --quiet --no-deps -d "$dir/wheels" \
    "nvidia-cuda-nvcc==13.0.88" "nvidia-cuda-crt==13.0.88" "nvidia-nvvm==13.0.88" \
    "nvidia-cuda-runtime==13.0.96"
  for w in "$dir"/wheels/*.whl; do python3 -m zipfile -e "$w" "$dir/"; done
  chmod +x "$dir"/nvidia/cu13/bin/* "$dir"/nvidia/cu13/nvvm/bin/* 2>/dev/null || true
fi
status=0
for cu in kernels/*.cu; do
  ptx=${cu%.cu}.ptx
  if [ "${1:-}" = --check ]; then
    out=$(mktemp --suffix=.ptx)
    "$nvcc" -ptx -arch=compute_75 "$cu" -o "$out"
    if ! diff -q "$out" "$ptx" >/dev/null 2>&1; then
      echo "$ptx is not what $cu compiles to: run scripts/build-ptx.sh" >&2
      status=1
    fi
    rm -f "$out"
  else
    "$nvcc" -ptx -arch=compute_75 "$cu" -o "$ptx"
  fi
done
exit $status
