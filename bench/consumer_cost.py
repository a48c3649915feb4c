#!/usr/bin/env python3
"""The Python consumer's per-frame cost against the Rust consumer's, in the same run.

Each run starts the Rust ``python_producer`` example (small frames, so the producer keeps the pool
full) three times, once for each consumer:

- ``rust``: the ``rust_consumer`` example with ``--cost``: a successful ``try_recv`` and the frame's
  drop (the release);
- ``python-capsule``: ``python/examples/torch_consumer.py --cost --cost-via capsule``: a successful
  ``try_recv``, ``frame.__dlpack__()`` (the capsule, with the stream ordering it does) and
  ``release()``;
- ``python-torch``: the same with ``torch.from_dlpack(frame)`` (the tensor made and freed).

Polls that find nothing are not counted, so the figures are what a frame costs the consumer's
thread, not the wait for the producer. Three runs (``--runs``); the medians of the runs' p50s and
the target ``python <= 2 x rust + 5 us`` are printed and written to OUT/consumer_cost.json.

    python3 bench/consumer_cost.py --out DIR [--runs 3] [--frames 20000] [--bin DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_case(bins: str, case: str, frames: int, run: int) -> dict:
    name = f"cost-{os.getpid()}-{run}-{case}"
    prod = subprocess.Popen(
        [os.path.join(bins, "python_producer"), "--channel", name, "--frames", str(frames),
         "--width", "128", "--height", "128", "--attach-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if case == "rust":
        cmd = [os.path.join(bins, "rust_consumer"), "--channel", name, "--cost"]
    else:
        via = case.split("-", 1)[1]
        cmd = [sys.executable, os.path.join(ROOT, "python/examples/torch_consumer.py"), name,
               "--cost", "--cost-via", via]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        pout, _ = prod.communicate(timeout=60)
    finally:
        if prod.poll() is None:
            prod.kill()
    text = out.stdout + out.stderr
    m = re.search(r"frames=(\d+).*cost_ns p50=(\d+) p90=(\d+) mean=(\d+)", text)
    if out.returncode != 0 or not m or prod.returncode != 0:
        raise RuntimeError(f"{case} run {run} failed (rc {out.returncode}, producer {prod.returncode}):"
                           f"\n{text[-2000:]}\n{pout[-1000:]}")
    return {"case": case, "run": run, "frames": int(m[1]), "p50_ns": int(m[2]), "p90_ns": int(m[3]),
            "mean_ns": int(m[4])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--frames", type=int, default=20000)
    p.add_argument("--bin", default=None, help="folder of the examples (default: the GPU bundle's)")
    a = p.parse_args()
    bins = a.bin or next((d for d in (os.path.join(ROOT, "target/gpu-bundle/examples"),
                                      os.path.join(ROOT, "target/release/examples"))
                          if os.path.exists(os.path.join(d, "rust_consumer"))), None)
    if bins is None:
        print("consumer_cost: no rust_consumer binary (build the examples or pass --bin)", file=sys.stderr)
        return 1
    cases = ("rust", "python-capsule", "python-torch")
    rows = []
    for run in range(a.runs):  # interleaved, so drift hits every case alike
        for case in cases:
            r = run_case(bins, case, a.frames, run)
            rows.append(r)
            print(f"run {run} {case}: {r}", flush=True)
    med = {c: statistics.median(r["p50_ns"] for r in rows if r["case"] == c) for c in cases}
    mean = {c: statistics.median(r["mean_ns"] for r in rows if r["case"] == c) for c in cases}
    target = 2 * med["rust"] + 5000
    summary = {
        "median_p50_ns": med, "median_mean_ns": mean, "target_ns": target,
        "ratio_capsule_to_rust": med["python-capsule"] / med["rust"],
        "ratio_torch_to_rust": med["python-torch"] / med["rust"],
        "capsule_meets_target": med["python-capsule"] <= target,
        "torch_meets_target": med["python-torch"] <= target,
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "consumer_cost.json"), "w") as f:
        json.dump({"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": rows,
                   "summary": summary}, f, indent=1)
    print("consumer per-frame cost, median of run p50s (ns):", flush=True)
    for c in cases:
        print(f"  {c:15s} p50 {med[c]:8.0f}  mean {mean[c]:8.0f}  x{med[c] / med['rust']:.2f} of rust")
    print(f"  target 2 x rust + 5 us = {target:.0f} ns: capsule "
          f"{'met' if summary['capsule_meets_target'] else 'MISSED'}, torch.from_dlpack "
          f"{'met' if summary['torch_meets_target'] else 'MISSED'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
