#!/usr/bin/env python3
"""Tests of the tensor-set baseline (bench/tensorset_baseline.py) without a GPU: the issue's shapes
and their layout, and a clear error result where PyTorch or CUDA is missing.
Run: python3 bench/test_tensorset_baseline.py"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tensorset_baseline as tb  # noqa: E402


def test_the_llama_shape_is_291_bf16_tensors_of_15_gib():
    s = tb.llama_shapes(False)
    assert len(s) == 291, len(s)
    assert len({n for n, _ in s}) == 291
    lay, total = tb.layout(s)
    assert 14.9 < total / 2**30 < 15.1, total / 2**30
    assert total == 16_060_522_496  # the same as bench/floor/tensorset_floor.rs's llama_bytes()
    assert all(off % 256 == 0 for _, _, off, _ in lay)
    assert s[0][1] == (128256, 4096) and s[-1][1] == (128256, 4096)
    assert sum(2 * tb.numel(sh) for _, sh in s) <= total


def test_the_moe_shape_is_4608_tensors_of_1_mib():
    s = tb.moe_shapes(False)
    assert len(s) == 4608
    assert all(2 * tb.numel(sh) == 1 << 20 for _, sh in s)
    _, total = tb.layout(s)
    assert total == 4608 << 20


def test_quick_shapes_are_small():
    for f in (tb.llama_shapes, tb.moe_shapes):
        _, total = tb.layout(f(True))
        assert total < 512 << 20, total


def test_values_are_exact_in_bf16():
    # Small integers up to 256 are exact in bf16 (8 bits of mantissa).
    assert all(1 <= tb.value_of(k) <= 61 for k in range(5000))


def test_without_torch_or_cuda_it_writes_an_error_result():
    try:
        import torch
        if torch.cuda.is_available():
            return  # a GPU machine: the real run is the test
    except ImportError:
        pass
    with tempfile.TemporaryDirectory() as d:
        assert tb.main(["--out", d, "--quick"]) == 1
        doc = json.load(open(os.path.join(d, "tensorset_baseline.json")))
        assert doc["records"] == [] and doc["errors"], doc


if __name__ == "__main__":
    failed = 0
    tests = [v for k, v in sorted(globals().items()) if k.startswith("test_")]
    for t in tests:
        try:
            t()
            print(f"ok {t.__name__}")
        except Exception as e:
            failed += 1
            print(f"FAILED {t.__name__}: {type(e).__name__}: {e}")
    print(f"{len(tests) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
