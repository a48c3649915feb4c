#!/usr/bin/env python3
"""An engine restarted after its trainer died: weights kept on the GPU by a holder. Needs a GPU.

    python3 python/examples/engine_restart.py [--width 1024] [--layers 4] [--seed 7] [--generations 3]

Four processes (started with multiprocessing's spawn, never forked):
1. a writer (the trainer) publishes a small model's weights as a VMM tensor set, `--generations`
   times (buffered, 2 buffers; generation g holds the model made from seed `--seed + g`);
2. a holder (`cuda_ipc.TensorSetHolder`, no CUDA context) fetches and serves the set's file
   descriptors;
3. the writer is killed with SIGKILL;
4. a fresh engine (torch imported, its CUDA context made) opens the set: writerless, its memory
   imported from the holder. It checks the last generation's weights bit for bit against a
   reference built on the CPU from the same seed, checks that no newer generation is promised
   (`WriterGone` at once), and reports the attach time.

Then this process replaces the dead set with a new writer under the same name (the holder sees
`"replaced"`, or `"closed"` if it looked between the old names' removal and the new ones, and
lets go) and closes it, which removes the set's segments. Prints the attach time
in ms and `OK`; exits non-zero on any mismatch, error or bound run out.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time

STEP_S = 60.0  # the bound of every wait of a step


def die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def make_weights(torch, width: int, layers: int, seed: int):
    """The model's state dict on the CPU, in bfloat16: the same bytes in every process."""
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods).to(dtype=torch.bfloat16)
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def writer(name: str, width: int, layers: int, seed: int, generations: int, conn) -> None:
    die_with_parent()
    try:
        import torch
        import cuda_ipc

        specs = make_weights(torch, width, layers, seed)
        w = cuda_ipc.TensorSetWriter(name, specs, memory="vmm", mode="buffered", buffers=2)
        g = 0
        for k in range(1, generations + 1):
            sd = {n: t.cuda() for n, t in make_weights(torch, width, layers, seed + k).items()}
            g = w.publish(sd, timeout=STEP_S)
        w.synchronize()
        # The holders segment records a generation whole once its GPU work is seen complete (a
        # thread of the writer, just after the synchronize above): give it that moment.
        time.sleep(0.5)
        conn.send(("published", g, w.nbytes))
        time.sleep(STEP_S * 10)  # until killed
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"writer: {type(e).__name__}: {e}"))


def holder(name: str, conn) -> None:
    die_with_parent()
    try:
        import cuda_ipc

        with cuda_ipc.TensorSetHolder(name) as h:
            conn.send(("holding", h.allocations, h.bytes, h.source_pid, h.status))
            # Until the set is replaced or closed (or a bound runs out).
            conn.send(("status", h.wait(timeout=STEP_S * 5)))
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"holder: {type(e).__name__}: {e}"))


def engine(name: str, width: int, layers: int, seed: int, generation: int, conn) -> None:
    die_with_parent()
    try:
        import torch
        import cuda_ipc

        torch.zeros(1, device="cuda")  # the context exists before the clock starts
        t0 = time.perf_counter()
        r = cuda_ipc.TensorSetReader(name, device=0)
        attach_ms = (time.perf_counter() - t0) * 1e3
        timings = r.open_timings()
        with r.current(timeout=STEP_S) as h:
            got_gen = h.generation
            tensors = h.tensors()
            ref = make_weights(torch, width, layers, seed + generation)
            bad = []
            for n, t in ref.items():
                mine = tensors[n].cpu()
                if mine.shape != t.shape or mine.dtype != t.dtype or not torch.equal(
                    mine.view(torch.uint8), t.view(torch.uint8)
                ):
                    bad.append(n)
        try:
            r.wait_newer(got_gen, timeout=5.0)
            newer = "a newer generation came"
        except cuda_ipc.WriterGone:
            newer = "WriterGone"
        conn.send(("engine", r.writerless, got_gen, bad, len(ref), attach_ms, timings, newer))
        r.close()
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"engine: {type(e).__name__}: {e}"))


def recv(conn, what: str):
    if not conn.poll(STEP_S):
        raise SystemExit(f"FAIL: no word from the {what} in {STEP_S:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise SystemExit(f"FAIL: {msg[1]}")
    return msg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--generations", type=int, default=3)
    a = ap.parse_args()
    import cuda_ipc

    name = f"engine-restart-{os.getpid()}"
    ctx = mp.get_context("spawn")
    procs = []

    def start(target, *args):
        here, there = ctx.Pipe()
        p = ctx.Process(target=target, args=(*args, there), daemon=True)
        p.start()
        procs.append(p)
        return p, here

    try:
        w, wc = start(writer, name, a.width, a.layers, a.seed, a.generations)
        _, gen, nbytes = recv(wc, "writer")
        print(f"writer pid {w.pid}: generation {gen} published, {nbytes} bytes per buffer", flush=True)

        h, hc = start(holder, name)
        _, allocations, held_bytes, source, status = recv(hc, "holder")
        print(f"holder pid {h.pid}: {allocations} fds, {held_bytes} bytes, from pid {source}, {status}",
              flush=True)

        os.kill(w.pid, signal.SIGKILL)
        w.join(STEP_S)
        if w.is_alive():
            raise SystemExit("FAIL: the writer outlived SIGKILL")
        print(f"writer killed (exit {w.exitcode})", flush=True)

        e, ec = start(engine, name, a.width, a.layers, a.seed, gen)
        _, writerless, got_gen, bad, n, attach_ms, timings, newer = recv(ec, "engine")
        e.join(STEP_S)
        phases = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in timings.items())
        print(f"engine pid {e.pid}: writerless={writerless}, generation {got_gen}, "
              f"{n - len(bad)}/{n} tensors equal, after it: {newer}", flush=True)
        print(f"attach {attach_ms:.2f} ms (ms per phase: {phases})", flush=True)

        ok = writerless and got_gen == gen and not bad and newer == "WriterGone" and e.exitcode == 0
        if bad:
            print(f"mismatched tensors: {bad[:8]}", flush=True)

        # The trainer restarts: a new set under the name replaces the dead one; the holder lets go.
        try:
            with cuda_ipc.TensorSetWriter(name, {"x": ((1,), "float32")}, memory="vmm"):
                _, status = recv(hc, "holder")
                print(f"holder after a new writer took the name: {status}", flush=True)
                # "closed" when the holder looked while the old names were gone, the new ones
                # not yet made.
                ok = ok and status in ("replaced", "closed")
        except cuda_ipc.CudaIpcError as err:
            print(f"replacing the set failed: {type(err).__name__}: {err}", flush=True)
            ok = False
        h.join(STEP_S)
        print("OK" if ok else "FAIL", flush=True)
        return 0 if ok else 1
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(STEP_S)


if __name__ == "__main__":
    sys.exit(main())
