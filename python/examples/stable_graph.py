#!/usr/bin/env python3
"""A CUDA graph captured once over a tensor set's stable addresses reads every new generation.
Needs a GPU.

    python3 python/examples/stable_graph.py [--mode buffered|in_place] [--generations 20]

A writer process (multiprocessing spawn) publishes generation g with every element of every
tensor equal to g. This process opens the set with `stable_addresses=True`, switches the first
generation there (`switch_stable`), captures a graph over `stable_tensors()` that sums them, and
then for each new generation switches it in and replays the graph: the sum must be g times the
element count, `stable_tensors()` must return the same tensor objects at the same addresses, and
`stable_generation` must follow. In place, the writer waits for `release_stable()` before each
update. Prints the median switch time and `OK`; exits non-zero otherwise. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import signal
import statistics
import sys

STEP_S = 30.0
SHAPES = {"a": (256, 256), "b": (1024,), "c": (64, 32)}


def writer(name: str, mode: str, generations: int, conn) -> None:
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    try:
        import torch
        import cuda_ipc

        specs = {n: (s, "float32") for n, s in SHAPES.items()}
        with cuda_ipc.TensorSetWriter(name, specs, memory="vmm", mode=mode, buffers=2) as w:
            for g in range(1, generations + 1):
                with w.begin(timeout=STEP_S) as u:
                    for t in u.tensors().values():
                        t.fill_(float(u.generation))
                    gen = u.generation
                conn.send(("published", gen))
                if not conn.poll(STEP_S):
                    return
                conn.recv()  # the reader switched to it
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"writer: {type(e).__name__}: {e}"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="buffered", choices=["buffered", "in_place"])
    ap.add_argument("--generations", type=int, default=20)
    a = ap.parse_args()
    import torch
    import cuda_ipc

    name = f"stable-graph-{os.getpid()}"
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=writer, args=(name, a.mode, a.generations, there), daemon=True)
    p.start()

    def published() -> int:
        if not here.poll(STEP_S):
            raise SystemExit(f"FAIL: no generation in {STEP_S:.0f} s")
        msg = here.recv()
        if msg[0] == "error":
            raise SystemExit(f"FAIL: {msg[1]}")
        return msg[1]

    try:
        gen = published()
        r = cuda_ipc.TensorSetReader(name, device=0, stable_addresses=True)
        first = r.stable_tensors()  # before any switch: addresses reserved, nothing mapped
        ptrs = {n: t.data_ptr() for n, t in first.items()}
        elements = sum(t.numel() for t in first.values())
        switches, ok = [], True
        info = r.switch_stable(r.wait_newer(0, timeout=STEP_S))
        assert info["generation"] == gen == r.stable_generation, (info, gen)
        torch.cuda.synchronize()

        def step():
            return sum(t.sum() for t in first.values())

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()  # warm-up before the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        while True:
            graph.replay()
            got = out.item()
            again = r.stable_tensors()
            same = all(again[n] is first[n] and again[n].data_ptr() == ptrs[n] for n in first)
            good = got == float(gen) * elements and same and r.stable_generation == gen
            ok = ok and good
            if not good:
                print(f"generation {gen}: sum {got}, expected {float(gen) * elements}, same "
                      f"tensors {same}, stable_generation {r.stable_generation}", flush=True)
            if gen == a.generations:
                break
            if a.mode == "in_place":
                r.release_stable()  # the writer waits for it
            here.send("switched")
            gen = published()
            info = r.switch_stable(r.wait_newer(gen - 1, timeout=STEP_S))
            switches.append(info["micros"])
            ok = ok and info["generation"] == gen
        med = statistics.median(switches) if switches else 0
        print(f"{a.mode}: {a.generations} generations through one graph, median switch {med} us, "
              f"remapped last: {info['remapped']}", flush=True)
        ok = r.release_stable() and r.stable_generation is None and ok
        del graph, out, first, again
        r.close()
        here.send("done")
        p.join(STEP_S)
        ok = ok and p.exitcode == 0
        print("OK" if ok else "FAIL", flush=True)
        return 0 if ok else 1
    finally:
        if p.is_alive():
            p.kill()
            p.join(STEP_S)


if __name__ == "__main__":
    sys.exit(main())
