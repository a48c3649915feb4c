#!/usr/bin/env python3
"""Tests of bench/report.py on made-up results (no GPU needed): the targets are computed from the
records the suite and the baselines write, missing inputs give "not measured" rather than a crash,
and every output file is written. Run: python3 bench/test_report.py"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import report  # noqa: E402


def dist(key: common.Key, metric: str, p50_us: float, p99_us: float) -> list:
    out = []
    for stat, v in [("p50", p50_us), ("p99", p99_us), ("max", p99_us * 2)]:
        out.append(key.rec(metric, stat, v, "us", 1000))
    return out


def suite_records() -> list:
    r = []
    for w, fl, bf, ch in [("spin-then-block", 17.0, 16.0, 19.0), ("spin", 2.0, 1.0, 3.0), ("block", 17.0, 12.0, 18.0)]:
        r += dist(common.Key("handoff", "floor", f"{w}.idle", ""), "ready", fl, fl * 4)
        r += dist(common.Key("handoff", "bare_floor", f"{w}.idle", ""), "ready", bf, bf * 4)
        r += dist(common.Key("handoff", "channel", f"{w}.idle", ""), "ready", ch, ch * 4)
        r += dist(common.Key("handoff", "channel", f"{w}.idle", ""), "kernel_start", ch + 5, ch * 5)
    r += dist(common.Key("handoff", "floor", "spin-then-block.spinning", ""), "ready", 2.0, 5.0)
    r += dist(common.Key("handoff", "bare_floor", "spin-then-block.spinning", ""), "ready", 1.2, 2.0)
    r += dist(common.Key("handoff", "channel", "spin-then-block.spinning", ""), "ready", 2.4, 6.0)
    k = common.Key("throughput", "channel", "c1.spin-then-block", "")
    r += [k.rec("frames_per_s", "value", 6000, "frames/s", 8000), k.rec("mismatches", "value", 0, "words", 8000),
          k.rec("gb_per_s", "value", 199, "GB/s", 8000)]
    k = common.Key("throughput", "channel", "c4.spin-then-block", "")
    r += [k.rec("frames_per_s", "value", 5000, "frames/s", 8000), k.rec("mismatches", "value", 0, "words", 8000)]
    for s, cost, d2d in [("1MiB", 3.0, 5.0), ("33MB", 3.1, 20.0), ("256MiB", 3.2, 150.0)]:
        r += dist(common.Key("zerocopy", "channel", s, ""), "consumer_cost", cost, cost * 2)
        r += dist(common.Key("zerocopy", "channel", s, ""), "ready", 2.0, 4.0)
        r += dist(common.Key("limits", "d2d_copy", s, ""), "copy_time", d2d, d2d * 1.1)
    r += dist(common.Key("import", "cuda_ipc", "legacy", ""), "cached_import", 0.3, 0.5)
    r += dist(common.Key("import", "cuda_ipc", "legacy", ""), "first_import", 150.0, 400.0)
    r += dist(common.Key("registry", "registry", "existing-name", ""), "publish", 0.4, 0.6)
    r += dist(common.Key("limits", "futex_pingpong", "cross-process", ""), "round_trip", 10.0, 30.0)
    return r


def torch_records() -> list:
    r = dist(common.Key("handoff", "torch_queue", "idle", ""), "ready", 500.0, 850.0)
    for c, fps in [(1, 3350.0), (4, 1200.0)]:
        k = common.Key("throughput", "torch_queue", f"c{c}", "")
        r += [k.rec("frames_per_s", "value", fps, "frames/s", 3000)]
    return r


def write(d: str, name: str, records: list, extra: dict | None = None) -> None:
    doc = {"suite": name, "records": records, "errors": [], "env": {"gpu_name": "Test GPU"}}
    doc.update(extra or {})
    with open(os.path.join(d, f"{name}.json"), "w") as f:
        json.dump(doc, f)


def run_report(d: str) -> int:
    """report.main with its console output kept out of the test's."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return report.main(["--out", d])


def by_name(tg: list) -> dict:
    return {t["name"]: t for t in tg}


def test_targets_from_full_results() -> None:
    with tempfile.TemporaryDirectory() as d:
        write(d, "bench_suite", suite_records(), {"date_utc": "2026-01-01T00:00:00Z", "commit": "abc"})
        write(d, "torch_queue", torch_records())
        assert run_report(d) == 0
        with open(os.path.join(d, "results.json")) as f:
            res = json.load(f)
        t = by_name(res["targets"])
        assert abs(t["handoff_vs_floor_p50[spin]"]["value"] - 1.5) < 1e-9
        assert t["handoff_vs_floor_p50[spin]"]["pass"] is False
        assert t["handoff_vs_floor_p50[block]"]["pass"] is True
        # The bare floor: the same ratio against the raw-calls-only hand-off.
        assert abs(t["handoff_vs_bare_floor_p50[spin]"]["value"] - 3.0) < 1e-9
        assert t["handoff_vs_bare_floor_p50[spin]"]["pass"] is False
        assert abs(t["handoff_vs_bare_floor_p50[spin-then-block]"]["value"] - 19 / 16) < 1e-9
        assert t["handoff_vs_bare_floor_p50[spin-then-block]"]["pass"] is True
        assert t["handoff_vs_bare_floor_p50[block]"]["inputs"]["bare_floor_p99_us"] == 48.0
        assert abs(t["handoff_vs_bare_floor_p50[spin-then-block, consumer still spinning]"]["value"] - 2.4 / 1.2) < 1e-9
        assert abs(t["default_p50_vs_pytorch_queue"]["value"] - 500 / 19) < 1e-9
        assert t["default_p50_vs_pytorch_queue"]["pass"] is False
        assert t["default_p99_under_20us"]["pass"] is False  # 76 us
        assert abs(t["throughput_vs_pytorch_queue[c1]"]["value"] - 6000 / 3350) < 1e-9
        assert abs(t["zero_copy_consumer_cost_flat"]["value"] - 3.2 / 3.0) < 1e-9
        assert t["zero_copy_consumer_cost_flat"]["pass"] is True
        assert t["cached_import_under_1us"]["pass"] is True
        assert t["zero_mismatches"]["pass"] is True
        # The missing baselines are errors of the run, not crashes.
        assert any(e["source"] == "host_staging" for e in res["errors"])
        for f in ["results.csv", "targets.csv", "benchmarks.md"]:
            assert os.path.getsize(os.path.join(d, f)) > 0, f
        md = open(os.path.join(d, "benchmarks.md")).read()
        assert "| torch_queue | its own | 500 | 850 |" in md, md
        assert "| bare_floor | spin | 1.0 | 4.0 |" in md, md
        assert "| bare_floor | spin-then-block (consumer still spinning) | 1.2 | 2.0 |" in md, md


def test_missing_inputs_are_not_measured() -> None:
    with tempfile.TemporaryDirectory() as d:
        write(d, "bench_suite", [])
        assert run_report(d) == 0
        with open(os.path.join(d, "results.json")) as f:
            res = json.load(f)
        assert all(t["pass"] is None for t in res["targets"] if t["name"] != "zero_mismatches")
    with tempfile.TemporaryDirectory() as d:
        assert run_report(d) == 2  # no Rust suite result at all


if __name__ == "__main__":
    failed = 0
    tests = [v for k, v in sorted(globals().items()) if k.startswith("test_")]
    for t in tests:
        try:
            t()
            print(f"ok {t.__name__}")
        except Exception as e:  # report every test, then fail
            failed += 1
            print(f"FAILED {t.__name__}: {type(e).__name__}: {e}")
    print(f"{len(tests) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
