#!/usr/bin/env python3
"""Side by side: PyTorch -> PyTorch through the cuda_ipc extension (torch_channel.py) against the
torch.multiprocessing queue (torch_queue.py), over several runs made in one session.

    python3 bench/compare_torch.py RUN_DIR...     # each holding torch_channel.json and torch_queue.json

Prints, for the idle hand-off p50/p99 (us) and the saturated frames/s with 1 and 4 consumers, each
run's figures, the median over runs and the ratio of the medians (channel / queue); writes the
table as JSON to stdout's last line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

METRICS = [
    ("idle hand-off p50 (us)", "handoff.{}.idle.ready.p50"),
    ("idle hand-off p99 (us)", "handoff.{}.idle.ready.p99"),
    ("frames/s, 1 consumer", "throughput.{}.c1.frames_per_s.value"),
    ("frames/s, 4 consumers", "throughput.{}.c4.frames_per_s.value"),
    ("mismatched words, 1 consumer", "throughput.{}.c1.mismatches.value"),
]


def load(d: str, name: str) -> dict:
    try:
        with open(os.path.join(d, f"{name}.json")) as f:
            doc = json.load(f)
    except OSError:
        return {}
    return {r["id"]: r["value"] for r in doc.get("records", [])}


def main(dirs: list) -> int:
    if not dirs:
        print(__doc__, file=sys.stderr)
        return 2
    runs = [(load(d, "torch_channel"), load(d, "torch_queue")) for d in dirs]
    table = {}
    for label, pat in METRICS:
        ch = [r[0].get(pat.format("torch_channel")) for r in runs]
        qu = [r[1].get(pat.format("torch_queue")) for r in runs]
        chv = [v for v in ch if v is not None]
        quv = [v for v in qu if v is not None]
        mc = statistics.median(chv) if chv else None
        mq = statistics.median(quv) if quv else None
        ratio = mc / mq if mc is not None and mq else None
        table[label] = {"channel": ch, "queue": qu, "median_channel": mc, "median_queue": mq,
                        "ratio": ratio}
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"{label:30s} channel {' '.join(fmt(v) for v in ch):24s} median {fmt(mc):>9s} | "
              f"queue {' '.join(fmt(v) for v in qu):24s} median {fmt(mq):>9s} | ratio "
              f"{'-' if ratio is None else f'{ratio:.3f}'}")
    print(json.dumps(table))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
