#!/usr/bin/env python3
"""The weight-sync shape: a trainer updates a PyTorch model in place every step and two
engine-shaped processes read it zero-copy, each step's forward output checked against the
trainer's.

    python3 python/examples/weight_sync.py [--steps 200] [--engines 2] [--width 2048] [--layers 8]

The trainer builds its model under `torch.cuda.use_mem_pool(cuda_ipc.torch_mem_pool())`, so the
weights live in exportable memory, and publishes its `state_dict()` as a tensor set with no copy
(`TensorSetWriter.over_tensors`; the device memory in use does not change). Each step runs the
"optimizer" between `begin()` and the commit (in place: the update waits for the engines to release
the generation they hold, on the GPU). Engines hold each new generation, build the model around its
tensors with `load_state_dict(d, assign=True)` (once: the tensors keep their addresses for every
generation) and run a forward pass on a fixed input; the trainer compares their outputs with its
own. Exit status 0 when every output of every step matched.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time

STEP_S = 60.0


def die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def make_model(torch, width: int, layers: int, device: str):
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width, bias=True), torch.nn.GELU()]
    return torch.nn.Sequential(*mods).to(device=device, dtype=torch.bfloat16)


def fixed_input(torch, width: int):
    g = torch.Generator(device="cuda").manual_seed(7)
    return torch.randn(16, width, device="cuda", dtype=torch.bfloat16, generator=g)


def engine(name: str, width: int, layers: int, conn) -> None:
    die_with_parent()
    try:
        import torch
        import cuda_ipc

        torch.zeros(1, device="cuda")
        reader = cuda_ipc.TensorSetReader(name, device=0)
        with torch.device("meta"):
            model = make_model(torch, width, layers, "meta")
        x = fixed_input(torch, width)
        seen, loaded = 0, False
        conn.send(("ready", reader.imports, reader.read_only))
        while True:
            try:
                held = reader.wait_newer(seen, timeout=STEP_S)
            except cuda_ipc.CudaIpcError as e:  # the trainer closed the set or died
                conn.send(("end", f"{type(e).__name__}: {e}"))
                return
            with held:
                if not loaded:
                    model.load_state_dict(held.tensors(), assign=True)
                    loaded = True
                with torch.no_grad():
                    y = model(x)
                out = y.float().cpu().tolist()  # by value: a CPU tensor would travel as a shared fd
                seen = held.generation
            conn.send(("out", seen, out))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    import torch
    import cuda_ipc

    torch.zeros(1, device="cuda")
    pool = cuda_ipc.torch_mem_pool(0)
    with torch.cuda.use_mem_pool(pool):
        model = make_model(torch, args.width, args.layers, "cuda")
    torch.cuda.synchronize()
    used_before = torch.cuda.mem_get_info()[0]
    name = f"weight-sync-{os.getpid()}"
    writer = cuda_ipc.TensorSetWriter.over_tensors(name, model.state_dict(), device=0)
    torch.cuda.synchronize()
    copied = used_before - torch.cuda.mem_get_info()[0]
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"published {len(model.state_dict())} tensors, {nbytes} bytes, generation "
          f"{writer.generation}; device memory taken by publishing: {copied} bytes")
    ctx = mp.get_context("spawn")
    engines = []
    for _ in range(args.engines):
        a, b = ctx.Pipe()
        p = ctx.Process(target=engine, args=(name, args.width, args.layers, b), daemon=True)
        p.start()
        engines.append((p, a))

    def recv(c):
        if not c.poll(STEP_S):
            raise TimeoutError(f"an engine said nothing for {STEP_S} s")
        m = c.recv()
        if m[0] == "error":
            raise RuntimeError(f"engine failed: {m[1]}")
        return m

    for _, c in engines:
        _, imports, ro = recv(c)
        print(f"engine attached: {imports} driver imports, read-only {ro}")
    x = fixed_input(torch, args.width)
    bad, worst = 0, 0.0

    def check(step, g):
        nonlocal bad, worst
        with torch.no_grad():
            want = model(x).float().cpu()
        for _, c in engines:
            m = recv(c)
            if m[0] != "out" or m[1] != g:
                print(f"step {step}: engine answered {m[:2]}, expected generation {g}")
                bad += 1
                continue
            diff = (torch.tensor(m[2]) - want).abs().max().item()
            worst = max(worst, diff)
            if diff != 0.0:
                bad += 1

    check(-1, writer.generation)  # each engine's first output: generation 1, as published
    t0 = time.perf_counter()
    for step in range(args.steps):
        with writer.begin(timeout=STEP_S):  # waits (on the GPU) for the engines' releases
            with torch.no_grad():
                for p in model.parameters():  # a deterministic "optimizer step", in place
                    p.mul_(0.999).add_(0.001 * ((step % 5) - 2))
        check(step, writer.generation)
    dt = time.perf_counter() - t0
    writer.close(timeout=10.0)
    for p, c in engines:
        if c.poll(STEP_S):
            c.recv()
        p.join(STEP_S)
    print(f"{args.steps} steps, {args.engines} engines, {dt / args.steps * 1e3:.2f} ms per step; "
          f"mismatched outputs: {bad}, largest difference {worst}")
    # Publishing allocates no device memory for the weights (the generation channel's words are
    # host memory); allow the driver's own small allocations (a stream, an event).
    return 0 if bad == 0 and copied < (4 << 20) else 1


if __name__ == "__main__":
    sys.exit(main())
