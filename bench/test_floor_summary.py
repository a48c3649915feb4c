#!/usr/bin/env python3
"""Tests of bench/floor_summary.py on results written here (no GPU)."""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import floor_summary  # noqa: E402


def write(d: str, targets: list):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "results.json"), "w") as f:
        json.dump({"targets": targets}, f)


def t(name, value, op="<=", threshold=1.25, **inputs):
    return {"name": name, "description": name, "value": value, "op": op, "threshold": threshold,
            "unit": "x", "pass": None, "inputs": inputs}


def test_the_median_of_the_runs_decides_and_missing_runs_are_shown():
    with tempfile.TemporaryDirectory() as tmp:
        runs = [os.path.join(tmp, f"run{i}") for i in range(3)]
        write(runs[0], [t("posted_vs_bare_posted_p50", 1.1, posted_p50_us=10.0)])
        write(runs[1], [t("posted_vs_bare_posted_p50", 1.4, posted_p50_us=14.0)])
        write(runs[2], [t("posted_vs_bare_posted_p50", 1.2, posted_p50_us=12.0),
                        t("zero_mismatches", 0, op="==", threshold=0)])
        rows = {r["name"]: r for r in floor_summary.summarize(runs)}
        p = rows["posted_vs_bare_posted_p50"]
        assert p["values"] == [1.1, 1.4, 1.2] and p["median"] == 1.2 and p["pass"] is True
        assert p["median_inputs"] == {"posted_p50_us": 12.0}
        z = rows["zero_mismatches"]
        assert z["values"] == [None, None, 0] and z["median"] == 0 and z["pass"] is True
        md = floor_summary.markdown(list(rows.values()))
        assert "— / — / 0" in md and "| yes |" in md


def test_a_missed_target_and_an_unreadable_run():
    with tempfile.TemporaryDirectory() as tmp:
        good = os.path.join(tmp, "a")
        write(good, [t("throughput_vs_pytorch_queue[c1]", 4.5, op=">=", threshold=10.0)])
        bad = os.path.join(tmp, "b")
        os.makedirs(bad)
        with open(os.path.join(bad, "results.json"), "w") as f:
            f.write("{not json")
        rows = floor_summary.summarize([good, bad])
        assert rows[0]["values"] == [4.5, None] and rows[0]["pass"] is False
        assert "**no**" in floor_summary.markdown(rows)


if __name__ == "__main__":
    fails = 0
    tests = [v for k, v in sorted(globals().items()) if k.startswith("test_")]
    for f in tests:
        try:
            f()
            print("ok", f.__name__)
        except AssertionError as e:
            fails += 1
            print("FAIL", f.__name__, e)
    print(f"{len(tests) - fails} passed, {fails} failed")
    sys.exit(1 if fails else 0)
