#!/usr/bin/env python3
"""The medians of several runs' results (bench/report.py's results.json in each run directory)
against the floor targets: each target's value per run, the median of those values, and whether
the median meets the target. Writes OUT/summary.json and OUT/summary.md and prints the table.

    python3 bench/floor_summary.py --out OUT RUN_DIR...
"""
import argparse
import json
import os
import statistics
import sys

# The targets the floor issue names, in table order (bench/report.py defines them).
FLOOR_TARGETS = [
    "handoff_vs_bare_floor_p50[spin]",
    "handoff_vs_bare_floor_p50[spin-then-block, consumer still spinning]",
    "handoff_vs_bare_floor_p50[spin-then-block]",
    "handoff_vs_bare_floor_p50[block]",
    "handoff_vs_bare_floor_p99[spin]",
    "handoff_vs_bare_floor_p99[spin-then-block]",
    "handoff_vs_bare_floor_p99[block]",
    "posted_vs_bare_posted_p50",
    "posted_p50_under_10us",
    "posted_vs_pytorch_queue",
    "throughput_vs_pytorch_queue[c1]",
    "throughput_vs_pytorch_queue[c1, posted]",
    "throughput_bytes_vs_d2d_copy",
    "zero_copy_consumer_cost_flat",
    "zero_mismatches",
]


def load(run: str) -> dict:
    path = os.path.join(run, "results.json")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        print(f"floor_summary: {path}: {e}", file=sys.stderr)
        return {}
    return {t["name"]: t for t in d.get("targets", [])}


def meets(value, op: str, threshold: float):
    if value is None:
        return None
    return {"<=": value <= threshold, ">=": value >= threshold, "<": value < threshold,
            "==": value == threshold}[op]


def summarize(runs: list) -> list:
    per_run = [load(r) for r in runs]
    rows = []
    for name in FLOOR_TARGETS:
        ts = [p.get(name) for p in per_run]
        known = [t for t in ts if t is not None]
        if not known:
            continue
        vals = [t["value"] for t in known if t.get("value") is not None]
        med = statistics.median(vals) if vals else None
        t0 = known[0]
        inputs = {}
        for k in t0.get("inputs", {}):
            xs = [t["inputs"].get(k) for t in known if isinstance(t.get("inputs", {}).get(k), (int, float))]
            inputs[k] = statistics.median(xs) if xs else None
        rows.append({"name": name, "description": t0.get("description"), "op": t0["op"],
                     "threshold": t0["threshold"], "unit": t0.get("unit"),
                     "values": [t.get("value") if t else None for t in ts], "median": med,
                     "pass": meets(med, t0["op"], t0["threshold"]), "median_inputs": inputs})
    return rows


def fmt(x):
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


def markdown(rows: list) -> str:
    out = ["| target | runs | median | target | met | median inputs |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        met = {True: "yes", False: "**no**", None: "—"}[r["pass"]]
        ins = ", ".join(f"{k} {fmt(v)}" for k, v in r["median_inputs"].items())
        out.append(f"| `{r['name']}` | {' / '.join(fmt(v) for v in r['values'])} | {fmt(r['median'])} | "
                   f"{r['op']} {fmt(r['threshold'])} {r['unit']} | {met} | {ins} |")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("runs", nargs="+")
    a = p.parse_args()
    rows = summarize(a.runs)
    md = markdown(rows)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump({"runs": a.runs, "targets": rows}, f, indent=1)
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
