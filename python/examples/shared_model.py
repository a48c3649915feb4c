#!/usr/bin/env python3
"""N inference processes sharing one copy of a model's weights on one GPU.

    python3 python/examples/shared_model.py [--readers 4] [--width 4096] [--layers 8]

This process builds a model, publishes its weights as a tensor set (copied in once, on a stream),
and starts N reader processes. Each maps the set read-only (one driver import per buffer, whatever
the number of tensors), builds the same model around the shared tensors with
`load_state_dict(held.tensors(), assign=True)` and runs a forward pass; its output must equal this
process's, and its own device memory for weights stays 0 (`torch.cuda.memory_allocated()` counts
only its activations). Exit status 0 when every reader matched.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import signal
import sys

STEP_S = 60.0


def die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def make_model(torch, width: int, layers: int, device: str):
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods).to(device=device, dtype=torch.bfloat16)


def reader(name: str, width: int, layers: int, conn) -> None:
    die_with_parent()
    try:
        import torch
        import cuda_ipc

        torch.zeros(1, device="cuda")
        before = torch.cuda.memory_allocated()
        r = cuda_ipc.TensorSetReader(name, device=0)
        with torch.device("meta"):
            model = make_model(torch, width, layers, "meta")
        with r.current(timeout=STEP_S) as held:
            model.load_state_dict(held.tensors(), assign=True)
            weights_here = torch.cuda.memory_allocated() - before
            x = torch.ones(8, width, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                y = model(x).float().cpu().tolist()  # by value, not a shared fd
            conn.send(("out", y, weights_here, r.imports, r.read_only, held.generation))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    import torch
    import cuda_ipc

    torch.manual_seed(0)
    model = make_model(torch, args.width, args.layers, "cuda")
    sd = model.state_dict()
    name = f"shared-model-{os.getpid()}"
    w = cuda_ipc.TensorSetWriter(name, sd, device=0)
    g = w.publish(sd, timeout=STEP_S)
    x = torch.ones(8, args.width, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x).float().cpu()
    ctx = mp.get_context("spawn")
    procs = []
    for _ in range(args.readers):
        a, b = ctx.Pipe()
        p = ctx.Process(target=reader, args=(name, args.width, args.layers, b), daemon=True)
        p.start()
        procs.append((p, a))
    bad = 0
    for i, (p, c) in enumerate(procs):
        if not c.poll(STEP_S):
            print(f"reader {i}: no answer in {STEP_S} s")
            bad += 1
            continue
        m = c.recv()
        if m[0] == "error":
            print(f"reader {i}: {m[1]}")
            bad += 1
            continue
        _, y, weights_here, imports, ro, gen = m
        same = torch.equal(torch.tensor(y), want)
        bad += 0 if same and gen == g else 1
        print(f"reader {i}: generation {gen}, output equal {same}, weight bytes allocated "
              f"{weights_here}, driver imports {imports}, read-only {ro}")
        p.join(STEP_S)
    w.close(timeout=10.0)
    print(f"{args.readers} readers, {len(sd)} tensors: {bad} mismatched")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
