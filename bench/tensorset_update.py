#!/usr/bin/env python3
"""A tensor set's update from Python on the GPU, by where its sources lie (docs/benchmarks.md).

    python3 bench/tensorset_update.py [--shape llama|moe|small|quick] [--runs 3] [--updates 5]
        [--out F]

One writer per mode (in place, double-buffered) publishes full new generations of the issue's
shapes (`llama`: Llama-3-8B's 291 bf16 tensors, 15.0 GiB; `moe`: 4,608 x 1 MiB; `small`: 20,000
x 64 KiB, 1.2 GiB) with two readers attached (`TensorSetReader`s in this process, each holding
its mappings), each from two kinds of source on the same GPU:

- `flat`: views of one flat buffer, in the set's order (runs of them are one copy);
- `scattered`: each tensor its own allocation of PyTorch's caching allocator, as a model's
  parameters are (the copies go through the copy kernel, 160 small ranges per launch);
- `plan`: the scattered sources through a `CopyPlan` made once (`TensorSetWriter.copy_plan`:
  only their `data_ptr()`s are read again per update);
- `flat_plan`: the flat sources through a `CopyPlan`.

Per update: `begin`, `copy_from`, `commit`, and a wait for the writer's stream (apart:
`*_copy_from_ms`, the host's time in `copy_from`, reading the sources and enqueuing the copies;
`get_device_pass_ms`, one of the bulk property reads `copy_from` makes, over the sources). Baselines in the
same loop, over the same bytes: one device-to-device copy (`torch.Tensor.copy_` of one flat buffer,
the issue's bound: an update is to reach 80 % of its speed) and PyTorch's own many-tensor copy of
the scattered sources (`torch._foreach_copy_` into views of one buffer). Medians of `--updates`
per run, the median of the runs; ratios are the copy's time over the update's. After the timed
updates, one more of each kind with its sources set to a value of its own, each generation
checked on the GPU by a reader (`mismatches_by_source`: elements that differ, every 64th tensor;
the exit status is 1 unless all are 0).

Prints one JSON document; `--out` writes it to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from tensorset_attach import SHAPES

STEP_S = 120.0


def small_shapes():
    """20,000 tensors of 64 KiB (bf16 32 x 1024): optimizer-state-sized pieces."""
    return [(f"s{i}", (32, 1024)) for i in range(20000)]


def timed(torch, f) -> float:
    """Milliseconds `f` takes, from a synchronised device to its work's end."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def one_run(torch, cuda_ipc, shapes, args, run: int) -> dict:
    specs = {n: (s, torch.bfloat16) for n, s in shapes}
    total = sum(torch.Size(s).numel() * 2 for _, s in shapes)
    # The flat buffer's bytes, as bf16 values 3.0 (the scattered sources' value too).
    flat_values = torch.full((total // 2,), 3, dtype=torch.bfloat16, device="cuda")
    src = flat_values.view(torch.uint8)
    dst = torch.empty_like(src)
    flat, off = {}, 0
    for n, s in shapes:
        k = torch.Size(s).numel() * 2
        flat[n] = src[off:off + k].view(torch.bfloat16).view(s)
        off += k
    scattered = {n: torch.full(s, 3, dtype=torch.bfloat16, device="cuda") for n, s in shapes}
    targets, off = [], 0
    for n, s in shapes:
        k = torch.Size(s).numel() * 2
        targets.append(dst[off:off + k].view(torch.bfloat16).view(s))
        off += k
    sources = list(scattered.values())
    out = {"bytes": total, "tensors": len(shapes)}
    for mode in ("in_place", "buffered"):
        name = f"tsu-{os.getpid()}-{run}-{mode}"
        w = cuda_ipc.TensorSetWriter(name, specs, device=0, memory="vmm", mode=mode)
        try:
            with w.begin(timeout=STEP_S):
                pass
            readers = [cuda_ipc.TensorSetReader(name, device=0) for _ in range(2)]

            def update(views, host_ms):
                with w.begin(timeout=STEP_S) as u:
                    t = time.perf_counter()
                    u.copy_from(views)
                    host_ms.append((time.perf_counter() - t) * 1e3)
                w.synchronize()

            plan = w.copy_plan(scattered)
            flat_plan = w.copy_plan(flat)
            times = {"flat": [], "scattered": [], "plan": [], "flat_plan": [], "copy": [],
                     "foreach": [], "flat_copy_from": [], "scattered_copy_from": [],
                     "plan_copy_from": [], "flat_plan_copy_from": [], "get_device_pass": []}
            values = list(scattered.values())
            for _ in range(args.updates):
                times["flat"].append(timed(torch, lambda: update(flat, times["flat_copy_from"])))
                times["scattered"].append(
                    timed(torch, lambda: update(scattered, times["scattered_copy_from"])))
                times["plan"].append(timed(torch, lambda: update(plan, times["plan_copy_from"])))
                times["flat_plan"].append(
                    timed(torch, lambda: update(flat_plan, times["flat_plan_copy_from"])))
                t = time.perf_counter()
                list(map(torch.Tensor.get_device, values))
                times["get_device_pass"].append((time.perf_counter() - t) * 1e3)
                times["copy"].append(timed(torch, lambda: dst.copy_(src)))
                times["foreach"].append(timed(torch, lambda: torch._foreach_copy_(targets, sources)))
            # One more update of each kind, its sources set to a value of its own first, each
            # generation checked on the GPU by a reader (every 64th tensor, all its elements).
            checks = {}
            for kind, value, views, fill in (
                    ("flat", 5, flat, lambda v: flat_values.fill_(v)),
                    ("scattered", 6, scattered, lambda v: [t.fill_(v) for t in sources]),
                    ("plan", 7, plan, lambda v: [t.fill_(v) for t in sources]),
                    ("flat_plan", 8, flat_plan, lambda v: flat_values.fill_(v))):
                fill(value)
                update(views, [])
                with readers[0].current(timeout=STEP_S) as h:
                    d = h.tensors()
                    checks[kind] = sum(int((d[n] != value).sum())
                                       for n, _ in shapes[:: max(1, len(shapes) // 64)])
                del d
            bad = sum(checks.values())
            del plan, flat_plan
            for r in readers:
                r.close()
            med = {k: statistics.median(v) for k, v in times.items()}
            out[mode] = {
                **{f"{k}_ms": v for k, v in med.items()},
                "flat_ratio": med["copy"] / med["flat"],
                "scattered_ratio": med["copy"] / med["scattered"],
                "plan_ratio": med["copy"] / med["plan"],
                "flat_plan_ratio": med["copy"] / med["flat_plan"],
                "foreach_ratio": med["copy"] / med["foreach"],
                "mismatches": bad,
                "mismatches_by_source": checks,
            }
        finally:
            w.close(timeout=10.0)
    del flat_values, values, src, dst, flat, scattered, targets, sources
    torch.cuda.empty_cache()
    return out


def main() -> int:
    shapes_of = {**SHAPES, "small": small_shapes}
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(shapes_of), default="quick")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--updates", type=int, default=5, help="updates per source, mode and run")
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch
    import cuda_ipc

    shapes = shapes_of[args.shape]()
    runs = [one_run(torch, cuda_ipc, shapes, args, i) for i in range(args.runs)]
    keys = [k for k in runs[0]["in_place"] if not k.startswith("mismatches")]
    summary = {
        "shape": args.shape,
        "tensors": runs[0]["tensors"],
        "bytes": runs[0]["bytes"],
        **{
            m: {
                **{k: statistics.median(r[m][k] for r in runs) for k in keys},
                "mismatches": sum(r[m]["mismatches"] for r in runs),
            }
            for m in ("in_place", "buffered")
        },
    }
    text = json.dumps({"summary": summary, "runs": runs}, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if all(summary[m]["mismatches"] == 0 for m in ("in_place", "buffered")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
