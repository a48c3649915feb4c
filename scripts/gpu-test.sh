#!/usr/bin/env bash
# Runs the GPU tests (the ones `cargo test` lists as ignored) on a machine with a CUDA GPU and a Rust
# toolchain. Without a GPU they fail; they never pass quietly.
#   scripts/gpu-test.sh            # every test, ignored GPU tests included
#   scripts/gpu-test.sh ipc_gpu    # one test binary
# On a GPU machine without a Rust toolchain, build the test executables elsewhere
# (`cargo test --release --no-run`), copy them over and run each with `--include-ignored --test-threads=1`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then
  cargo test --release --test "$1" -- --include-ignored --test-threads=1
else
  cargo test --release -- --include-ignored --test-threads=1
fi
