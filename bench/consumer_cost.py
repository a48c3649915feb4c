#!/usr/bin/env python3
"""The Python consumer's per-frame cost against the Rust consumer's, in the same run.

Each run starts the Rust ``python_producer`` example (small frames, so the producer keeps the pool
full) three times, once for each consumer:

- ``rust``: the ``rust_consumer`` example with ``--cost``: a successful ``try_recv`` and the frame's
  drop (the release);
- ``python-capsule``: ``python/examples/torch_consumer.py --cost --cost-via capsule``: a successful
  ``try_recv``, ``frame.__dlpack__()`` (the capsule, with the stream ordering it does) and
  ``release()``;
- ``python-torch``: the same with ``torch.from_dlpack(frame)`` (the tensor made and freed);
- ``torch-alone``: PyTorch's own share of that, no channel: ``torch.from_dlpack`` of a PyTorch
  CUDA tensor (its ``__dlpack__``, the tensor made and freed), timed the same way.

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


TORCH_ALONE = """
import sys, time, torch
x = torch.empty(128 * 128 * 4, dtype=torch.uint8, device="cuda")
ns = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter_ns()
    y = torch.from_dlpack(x)
    del y
    ns.append(time.perf_counter_ns() - t)
mean = sum(ns) / len(ns)
ns.sort()
print(f"frames={len(ns)} cost_ns p50={ns[len(ns) // 2]} p90={ns[int(len(ns) * 0.9)]} mean={mean:.0f}")
"""


def run_case(bins: str, case: str, frames: int, run: int) -> dict:
    if case == "torch-alone":
        out = subprocess.run([sys.executable, "-c", TORCH_ALONE, str(frames)], capture_output=True,
                             text=True, timeout=120)
        m = re.search(r"frames=(\d+).*cost_ns p50=(\d+) p90=(\d+) mean=(\d+)", out.stdout)
        if out.returncode != 0 or not m:
            raise RuntimeError(f"torch-alone failed: {out.stdout[-1000:]}{out.stderr[-2000:]}")
        return {"case": case, "run": run, "frames": int(m[1]), "p50_ns": int(m[2]),
                "p90_ns": int(m[3]), "mean_ns": int(m[4])}
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
    cases = ("rust", "python-capsule", "python-torch", "torch-alone")
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
        "torch_minus_torch_alone_ns": med["python-torch"] - med["torch-alone"],
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
          f"{'met' if summary['torch_meets_target'] else 'MISSED'}; python-torch less PyTorch's own "
          f"from_dlpack = {summary['torch_minus_torch_alone_ns']:.0f} ns", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
