#!/usr/bin/env python3
"""Soak of a tensor set from Python: a writer updates every tensor of a set each generation, two
reader processes check every generation they take on the GPU, and one of them is killed (SIGKILL)
and restarted every `--kill-every` updates.

    python3 python/examples/tensorset_soak.py [--updates 200] [--kill-every 20] [--mode in_place]

Each generation g fills every tensor with the value g (bf16 holds integers up to 256 exactly, so
the value is g mod 251). A reader holds each new generation, checks on its GPU that every element
of every tensor equals the generation's value (one reduction per tensor run, no host copies of the
data), releases it and reports. The writer waits for both readers' reports of a generation (or for
the restarted reader to attach) before the next update, so every generation is checked by every
live reader. At every restart the writer samples the device's free memory (`cuMemGetInfo` through
`torch.cuda.mem_get_info`), its own open file descriptors and its own allocated bytes: after the
first restart they must not change, to the byte. No `gc.collect()` is called anywhere. Exit status
0 when every check passed.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time

STEP_S = 30.0


def die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def shapes():
    out = []
    for layer in range(8):
        out += [(f"l{layer}.w", (1024, 1024)), (f"l{layer}.up", (4096, 1024)), (f"l{layer}.n", (1024,))]
    return out


def value(g: int) -> float:
    return float(g % 251)


def reader(name: str, conn) -> None:
    die_with_parent()
    try:
        import torch
        import cuda_ipc

        torch.zeros(1, device="cuda")
        r = cuda_ipc.TensorSetReader(name)
        conn.send(("ready", r.imports))
        seen = 0
        while True:
            h = r.wait_newer(seen, timeout=STEP_S)
            with h:
                d = h.tensors()
                want = value(h.generation)
                bad = sum(int((t != want).sum().item()) for t in d.values())
                seen = h.generation
            conn.send(("gen", seen, bad))
    except Exception as e:  # the writer closing ends the loop too
        conn.send(("end", f"{type(e).__name__}: {e}"))


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=200)
    ap.add_argument("--kill-every", type=int, default=20)
    ap.add_argument("--mode", choices=["in_place", "buffered"], default="in_place")
    args = ap.parse_args()
    import torch
    import cuda_ipc

    torch.zeros(1, device="cuda")
    name = f"soak-{os.getpid()}"
    specs = {n: (s, torch.bfloat16) for n, s in shapes()}
    w = cuda_ipc.TensorSetWriter(name, specs, mode=args.mode)
    with w.begin(timeout=STEP_S) as u:
        for t in u.tensors().values():
            t.fill_(value(u.generation))
    ctx = mp.get_context("spawn")

    def start():
        a, b = ctx.Pipe()
        p = ctx.Process(target=reader, args=(name, b), daemon=True)
        p.start()
        return p, a

    def recv(c, what):
        if not c.poll(STEP_S):
            raise TimeoutError(f"a reader said nothing for {STEP_S} s ({what})")
        return c.recv()

    readers = [start(), start()]
    for _, c in readers:
        assert recv(c, "ready")[0] == "ready"
    for _, c in readers:  # generation 1
        m = recv(c, "generation 1")
        assert m[0] == "gen", m
    bad, checked, samples, restarts = 0, 0, [], 0
    t0 = time.perf_counter()
    for k in range(args.updates):
        if k and k % args.kill_every == 0:
            p, c = readers[0]
            os.kill(p.pid, signal.SIGKILL)
            p.join(STEP_S)
            torch.cuda.synchronize()
            samples.append((torch.cuda.mem_get_info()[0], fds(), torch.cuda.memory_allocated()))
            readers[0] = start()
            restarts += 1
            m = recv(readers[0][1], "restart")
            assert m[0] == "ready", m
            m = recv(readers[0][1], "restart's first generation")  # the current one
            assert m[0] == "gen", m
            bad += m[2]
        with w.begin(timeout=STEP_S) as u:
            for t in u.tensors().values():
                t.fill_(value(u.generation))
        g = w.generation
        for _, c in readers:
            m = recv(c, f"generation {g}")
            if m[0] != "gen" or m[1] != g:
                print(f"update {k}: a reader answered {m}, expected generation {g}")
                bad += 1
                continue
            bad += m[2]
            checked += 1
    dt = time.perf_counter() - t0
    w.close(timeout=10.0)
    for p, c in readers:
        p.join(STEP_S)
    flat = len(set(samples[1:])) <= 1
    print(f"{args.updates} updates ({args.mode}), {checked} generations checked by readers, "
          f"{restarts} reader restarts, {bad} mismatched elements, {dt / args.updates * 1e3:.2f} ms "
          f"per update")
    print("samples (free device bytes, writer fds, writer allocated bytes) at each restart:")
    for s in samples:
        print("  ", s)
    print(f"flat after the first restart: {flat}")
    return 0 if bad == 0 and flat else 1


if __name__ == "__main__":
    sys.exit(main())
