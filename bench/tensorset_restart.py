#!/usr/bin/env python3
"""An engine's weights back after its writer died, from a holder, against a load from disk.

    python3 bench/tensorset_restart.py [--shape llama|quick] [--runs 3] [--cli PATH] [--out F]

Per run: a writer process publishes a VMM tensor set of the shape (`llama`: Llama-3-8B's 291
bf16 tensors, 15.0 GiB; `quick`: a small set), each tensor filled with its own value; `cuda-ipc
hold NAME` (the command-line tool at `--cli`) holds it; the writer is SIGKILLed; then

- **attach**: a fresh engine process (torch imported, CUDA context made before the clock starts)
  opens the set (writerless: from the holder), takes the generation, builds its `dict` and reads
  one element of every tensor (checked against the value it was filled with) and synchronises:
  "weights back"; also the time from the kill to that point, process start and imports included;
- **disk**: a fresh process of the same kind loads the same tensors from a safetensors file on
  local disk straight to the GPU (`safetensors.torch.load_file(..., device="cuda")`; `torch.load`
  of a `torch.save` file where safetensors is not installed) and does the same read. The file is
  written once, before the runs; whether the page cache could be dropped before each load is
  reported (`page_cache`: "dropped" needs root, else "warm").

Prints one JSON document (medians over runs and every run's figures); `--out` writes it to a file.
Every wait is bounded; children die with this process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import common
from tensorset_attach import SHAPES, read_all

STEP_S = 120.0


def fill_value(i: int) -> float:
    """The value tensor i holds (exact in bf16)."""
    return float((i % 61) - 30)


def writer_child(name: str, shape: str, conn) -> None:
    """Publishes the set, says ready, then waits to be killed."""
    common.die_with_parent()
    try:
        import torch

        import cuda_ipc

        shapes = SHAPES[shape]()
        specs = {n: (s, torch.bfloat16) for n, s in shapes}
        w = cuda_ipc.TensorSetWriter(name, specs, device=0, memory="vmm", mode="in_place")
        with w.begin(timeout=STEP_S) as u:
            for i, t in enumerate(u.tensors().values()):
                t.fill_(fill_value(i))
        torch.cuda.synchronize()
        conn.send(("ready", os.getpid()))
        time.sleep(3600)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def engine_child(how: str, shape: str, name: str, path: str, conn) -> None:
    """A fresh engine: context first, then (timed) its weights back, read and checked."""
    common.die_with_parent()
    try:
        import torch

        torch.cuda.init()
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        import cuda_ipc

        conn.send(("ready", None))
        if not conn.poll(STEP_S):
            return
        conn.recv()
        t0 = time.perf_counter()
        extra = {}
        if how == "attach":
            r = cuda_ipc.TensorSetReader(name, device=0)
            h = r.current(timeout=STEP_S)
            d = h.tensors()
            extra = {
                "imports": r.imports,
                "writerless": bool(getattr(r, "writerless", False)),
                "read_only": r.read_only,
            }
        else:
            try:
                from safetensors.torch import load_file

                d = load_file(path, device="cuda")
            except ImportError:
                d = torch.load(path, map_location="cuda")
        vals = read_all(torch, d)
        t1 = time.perf_counter()
        t1_mono = time.monotonic_ns()
        index = {n: i for i, (n, _) in enumerate(SHAPES[shape]())}
        want = torch.tensor(
            [fill_value(index[n]) for n in d], dtype=torch.bfloat16, device="cuda"
        )
        mismatches = int((vals != want).sum().item())
        conn.send(
            (
                "done",
                {"ms": (t1 - t0) * 1e3, "mono_ns": t1_mono, "mismatches": mismatches, **extra},
            )
        )
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def expect(conn, what: str):
    if not conn.poll(STEP_S):
        raise TimeoutError(f"no {what} within {STEP_S} s")
    tag, val = conn.recv()
    if tag == "error":
        raise RuntimeError(val)
    if tag != what:
        raise RuntimeError(f"expected {what}, got {tag}: {val}")
    return val


def engine(ctx, how: str, shape: str, name: str, path: str) -> dict:
    a, b = ctx.Pipe()
    p = ctx.Process(target=engine_child, args=(how, shape, name, path, b), daemon=True)
    p.start()
    expect(a, "ready")
    a.send("go")
    out = expect(a, "done")
    p.join(STEP_S)
    return out


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def save_reference(shape: str, path: str) -> str:
    """The same tensors in a file on local disk; returns the format written."""
    import torch

    d = {
        n: torch.full(s, fill_value(i), dtype=torch.bfloat16, device="cuda")
        for i, (n, s) in enumerate(SHAPES[shape]())
    }
    try:
        from safetensors.torch import save_file

        save_file(d, path)
        fmt = "safetensors"
    except ImportError:
        torch.save(d, path)
        fmt = "torch.save"
    del d
    torch.cuda.empty_cache()
    return fmt


def one_run(ctx, args, path: str, run: int) -> dict:
    name = f"tsr-{os.getpid()}-{run}"
    a, b = ctx.Pipe()
    w = ctx.Process(target=writer_child, args=(name, args.shape, b), daemon=True)
    w.start()
    wpid = expect(a, "ready")
    hold = subprocess.Popen(
        [args.cli, "hold", name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        line = hold.stdout.readline().strip()
        if hold.poll() is not None:
            raise RuntimeError(f"cuda-ipc hold ended: {line}")
        os.kill(wpid, signal.SIGKILL)
        killed = time.monotonic_ns()
        w.join(STEP_S)
        att = engine(ctx, "attach", args.shape, name, path)
        att["kill_to_back_ms"] = (att.pop("mono_ns") - killed) / 1e6
        cache = "dropped" if drop_page_cache() else "warm"
        disk = engine(ctx, "disk", args.shape, name, path)
        disk.pop("mono_ns")
        return {"holder_said": line, "attach": att, "disk": disk, "page_cache": cache}
    finally:
        hold.send_signal(signal.SIGTERM)
        try:
            hold.wait(timeout=10)
        except subprocess.TimeoutExpired:
            hold.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=["llama", "quick"], default="quick")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cli", default="cuda-ipc", help="the cuda-ipc command-line tool")
    ap.add_argument("--dir", default=None, help="where the file on local disk goes")
    ap.add_argument("--out")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "weights.safetensors")
        fmt = save_reference(args.shape, path)
        runs = [one_run(ctx, args, path, r) for r in range(args.runs)]
        size = os.path.getsize(path)
    # What the killed writers and the let-go holders left: their sets' files.
    subprocess.run([args.cli, "gc"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    doc = {
        "shape": args.shape,
        "file_format": fmt,
        "file_bytes": size,
        "summary": {
            "attach_ms": med(lambda r: r["attach"]["ms"]),
            "kill_to_back_ms": med(lambda r: r["attach"]["kill_to_back_ms"]),
            "disk_ms": med(lambda r: r["disk"]["ms"]),
            "mismatches": sum(r["attach"]["mismatches"] + r["disk"]["mismatches"] for r in runs),
            "writerless": all(r["attach"].get("writerless") for r in runs),
            "page_cache": sorted({r["page_cache"] for r in runs}),
        },
        "runs": runs,
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if doc["summary"]["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
