#!/usr/bin/env python3
"""Tensor sets from Python on the GPU: attach, new generations, updates (docs/benchmarks.md).

    python3 bench/tensorset_attach.py [--shape llama|moe|quick] [--runs 3] [--children 5]
        [--module-loading lazy|eager|lazy,eager] [--out F]

One writer (this process) publishes a tensor set of the issue's shapes (`llama`: the 291 bf16
tensors of Llama-3-8B, 15.0 GiB; `moe`: 4,608 x 1 MiB bf16; `quick`: a small set for a smoke run)
in VMM memory, and measures, per run:

- first attach: a fresh process (spawned; CUDA context made, torch imported and then `cuda_ipc`,
  whose import runs `cuda_ipc.warm_up()`, before the clock starts: the import's time is
  `import_ms`, and `CUDA_IPC_WARM_UP=0` leaves the warm-up to the attach; the run's `--children` readers get ready side by side, then attach one after another,
  each staying alive until the last has attached, so that no exit runs beside an attach) opens the set (`open`), holds the current generation and builds its `dict[str, Tensor]`
  (`dict`: `type(d) is dict`, every value a constructed tensor), then reads one element of every
  tensor and synchronises (`usable`, the same read as the PyTorch baseline's); the driver imports
  the attach made; apart, the hold (`hold_ms`), the dict's PyTorch calls (`tensors_ms`) and the
  open's phases as the reader timed them (`open_timings_us`, `TensorSetReader.open_timings()`);
- PyTorch alone, the same read in a fresh ready process over as many tensors of its own memory
  (`torch_first_read_ms`, then `torch_read_again_ms`): what of "usable" is PyTorch's first
  kernel launch in a process (its CUDA modules load lazily by default), not the set's;
- with `--module-loading`, the first attaches and PyTorch's read in readers whose CUDA modules
  load lazily (the default, `CUDA_MODULE_LOADING=LAZY`) and/or eagerly (`EAGER`: loaded when the
  context is made, before the clock; `ready_ms` says what the context and the first allocation
  cost the process before it);
- a new generation in a process that keeps its mappings: from the reader's wake-up to its dict,
  and from the writer's commit to the reader's wake-up (the hand-off);
- the channel's hand-off at the same wait strategy, publish to a waiting consumer's wake-up, in
  the same run (the bound for a generation's);
- an update: a full new generation copied from a same-GPU source and committed with two readers
  attached, both modes (in place, double-buffered), against a device-to-device copy of the same
  bytes (`torch.Tensor.copy_`), in the same run.

Prints one JSON document (medians over runs, every run's figures); `--out` writes it to a file.
Each run's figures also go to stderr as it ends (and to `--out`.partial).
Every wait is bounded; children die with this process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import common

STEP_S = 120.0  # the longest any single wait may take


def llama_shapes():
    """(name, shape) of Llama-3-8B's 291 tensors, all bf16 (15.0 GiB)."""
    h, kv, ff, vocab = 4096, 1024, 14336, 128256
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(32):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (ff, h)),
            (p + "mlp.up_proj.weight", (ff, h)),
            (p + "mlp.down_proj.weight", (h, ff)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def moe_shapes():
    """4,608 experts' tensors of 1 MiB each (bf16 512 x 1024)."""
    return [(f"experts.{i // 3}.w{i % 3}", (512, 1024)) for i in range(4608)]


def quick_shapes():
    return [(f"t{i}", (64, 1024 + i)) for i in range(40)]


SHAPES = {"llama": llama_shapes, "moe": moe_shapes, "quick": quick_shapes}


def read_all(torch, d: dict):
    """One read of every tensor and a synchronise: the baseline's "usable"."""
    vals = torch.stack([t.reshape(-1)[0] for t in d.values()])
    torch.cuda.synchronize()
    return vals


def ready_torch(loading: str):
    """Imports torch and makes the CUDA context with a first allocation (`loading`: how the
    process's CUDA modules load, set before the driver starts); (torch, ms the context took)."""
    os.environ["CUDA_MODULE_LOADING"] = loading.upper()
    t = time.perf_counter()
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context exists before the clock starts
    torch.cuda.synchronize()
    return torch, (time.perf_counter() - t) * 1e3


def torch_read_child(conn, n: int, loading: str) -> None:
    """PyTorch alone: the baseline's read over `n` tensors of its own memory, the first in a
    fresh ready process and again."""
    common.die_with_parent()
    try:
        torch, ready_ms = ready_torch(loading)
        d = {f"t{i}": torch.empty((64, 64), dtype=torch.bfloat16, device="cuda") for i in range(n)}
        torch.cuda.synchronize()
        conn.send(("ready", None))
        if not conn.poll(STEP_S):
            return
        conn.recv()
        t0 = time.perf_counter()
        read_all(torch, d)
        t1 = time.perf_counter()
        read_all(torch, d)
        t2 = time.perf_counter()
        conn.send(("read", {"ready_ms": ready_ms, "first_ms": (t1 - t0) * 1e3,
                            "again_ms": (t2 - t1) * 1e3}))
        if conn.poll(STEP_S):  # alive until the batch is done, as the readers
            conn.recv()
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def reader_child(name: str, conn, mode: str, loading: str = "lazy") -> None:
    """A fresh reader process: makes its context, then (timed) attaches and builds its dict."""
    common.die_with_parent()
    try:
        torch, ready_ms = ready_torch(loading)
        t = time.perf_counter()
        import cuda_ipc  # its warm-up runs here (cuda_ipc.warm_up), before the clock

        import_ms = (time.perf_counter() - t) * 1e3
        conn.send(("ready", None))
        if not conn.poll(STEP_S):
            return
        conn.recv()
        t0 = time.perf_counter()
        r = cuda_ipc.TensorSetReader(name, device=0)
        t1 = time.perf_counter()
        h = r.current(timeout=STEP_S)
        t_held = time.perf_counter()
        d = h.tensors()
        t2 = time.perf_counter()
        ok = type(d) is dict and all(type(v) is torch.Tensor for v in d.values())
        read_all(torch, d)
        t3 = time.perf_counter()
        read_all(torch, d)  # again, PyTorch's kernels loaded: what of "usable" is their first use
        t4 = time.perf_counter()
        first = {
            "open_ms": (t1 - t0) * 1e3,
            "dict_ms": (t2 - t0) * 1e3,
            "hold_ms": (t_held - t1) * 1e3,
            "tensors_ms": (t2 - t_held) * 1e3,
            "usable_ms": (t3 - t0) * 1e3,
            "read_again_ms": (t4 - t3) * 1e3,
            "imports": r.imports,
            "ready_ms": ready_ms,
            "import_ms": import_ms,
            "tensors": len(d),
            "dict_ok": ok,
            "read_only": r.read_only,
            "open_timings_us": r.open_timings(),
        }
        g = h.generation
        h.release()
        del d
        if mode == "first":
            conn.send(("first", first))
            # Alive (and its context with it) until the parent has timed every first attach of
            # the batch: no process's exit runs beside another's attach.
            if conn.poll(STEP_S):
                conn.recv()
            return
        # Warm: wait for each new generation, build its dict; report the times.
        conn.send(("first", first))
        warm = []
        while True:
            if not conn.poll(STEP_S):
                break
            msg = conn.recv()
            if msg == "stop":
                break
            h = r.wait_newer(g, timeout=STEP_S)
            tw = time.monotonic_ns()
            d = h.tensors()
            td = time.monotonic_ns()
            g = h.generation
            warm.append({"woke_ns": tw, "dict_us": (td - tw) / 1e3, "generation": g})
            h.release()
            del d
            conn.send(("warm", warm[-1]))
        conn.send(("done", None))
    except Exception as e:  # reported to the parent, which fails the run
        conn.send(("error", f"{type(e).__name__}: {e}"))


def channel_child(name: str, conn) -> None:
    """The channel's hand-off at the same wait strategy, for comparison: a consumer waiting in
    `recv` reports when it woke."""
    common.die_with_parent()
    try:
        import torch

        torch.zeros(1, device="cuda")
        import cuda_ipc

        with cuda_ipc.Consumer(name, delivery="latest") as rx:
            conn.send(("ready", None))
            while True:
                if not conn.poll(STEP_S):
                    return
                if conn.recv() == "stop":
                    return
                f = rx.recv(timeout=STEP_S)
                woke = time.monotonic_ns()
                f.release()
                conn.send(("woke", woke))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def channel_handoff(cuda_ipc, ctx, name: str, n: int) -> float:
    """Median µs from a channel publish to its waiting consumer's wake-up (wait spin_then_block)."""
    tx = cuda_ipc.Producer(name, 4096, buffers=2)
    a, b = ctx.Pipe()
    p = ctx.Process(target=channel_child, args=(name, b), daemon=True)
    p.start()
    try:
        expect(a, "ready")
        out = []
        for _ in range(n):
            a.send("next")
            time.sleep(0.05)  # the consumer is asleep in its wait
            f = tx.acquire(timeout=STEP_S)
            f.publish(b"")
            t = time.monotonic_ns()
            out.append((expect(a, "woke") - t) / 1e3)
        a.send("stop")
        p.join(STEP_S)
        return statistics.median(out)
    finally:
        tx.close()


def spawn_reader(ctx, name: str, mode: str, loading: str = "lazy"):
    a, b = ctx.Pipe()
    p = ctx.Process(target=reader_child, args=(name, b, mode, loading), daemon=True)
    p.start()
    return p, a


def expect(conn, what: str):
    if not conn.poll(STEP_S):
        raise TimeoutError(f"no {what} from a reader within {STEP_S} s")
    tag, val = conn.recv()
    if tag == "error":
        raise RuntimeError(f"reader failed: {val}")
    if tag != what:
        raise RuntimeError(f"reader sent {tag}, expected {what}")
    return val


def one_run(torch, cuda_ipc, shapes, args, run: int) -> dict:
    ctx = mp.get_context("spawn")
    specs = {n: (s, torch.bfloat16) for n, s in shapes}
    name = f"tsb-{os.getpid()}-{run}"
    total = sum(torch.Size(s).numel() * 2 for _, s in shapes)
    out = {"bytes": total, "tensors": len(shapes)}
    w = cuda_ipc.TensorSetWriter(name, specs, device=0, memory="vmm", mode="in_place")
    try:
        with w.begin(timeout=STEP_S) as u:
            for i, t in enumerate(u.tensors().values()):
                t.fill_(float(i % 7))
        torch.cuda.synchronize()
        # First attaches, one fresh process after another, per way of loading CUDA modules;
        # PyTorch's read of its own memory in as many fresh processes.
        for loading in args.module_loading:
            firsts, reads = [], []
            # The batch's readers start together and get ready (torch imported, context made)
            # side by side; then each attaches in turn, the others idle, none exiting meanwhile.
            batch = [spawn_reader(ctx, name, "first", loading) for _ in range(args.children)]
            for _, c in batch:
                expect(c, "ready")
            for _, c in batch:
                c.send("go")
                firsts.append(expect(c, "first"))
            for p, c in batch:
                c.send("exit")
                p.join(STEP_S)
            batch = []
            for _ in range(args.children):
                a, b = ctx.Pipe()
                p = ctx.Process(target=torch_read_child, args=(b, len(shapes), loading), daemon=True)
                p.start()
                batch.append((p, a))
            for _, a in batch:
                expect(a, "ready")
            for _, a in batch:
                a.send("go")
                reads.append(expect(a, "read"))
            for p, a in batch:
                a.send("exit")
                p.join(STEP_S)
            key = "first" if loading == args.module_loading[0] else f"first_{loading}"
            out[key] = firsts
            out[f"torch_read_{loading}"] = reads
        # Warm readers: two, each waiting for new generations.
        readers = [spawn_reader(ctx, name, "warm") for _ in range(2)]
        for _, c in readers:
            expect(c, "ready")
            c.send("go")
            expect(c, "first")
        warm, handoff = [], []
        for _ in range(args.generations):
            for _, c in readers:
                c.send("next")
            time.sleep(0.05)  # the readers are asleep in their wait
            with w.begin(timeout=STEP_S) as u:
                pass
            t_commit = time.monotonic_ns()
            for _, c in readers:
                r = expect(c, "warm")
                warm.append(r["dict_us"])
                handoff.append((r["woke_ns"] - t_commit) / 1e3)
        for p, c in readers:
            c.send("stop")
            p.join(STEP_S)
        out["warm_dict_us"] = statistics.median(warm)
        out["commit_to_wake_us"] = statistics.median(handoff)
        out["channel_handoff_us"] = channel_handoff(cuda_ipc, ctx, f"{name}-ch", args.generations)
    finally:
        w.close(timeout=10.0)
    # Updates: a full generation from a same-GPU source, both modes, against a D2D copy.
    out["update"] = {}
    src = torch.empty(total, dtype=torch.uint8, device="cuda")
    src.fill_(3)
    dst = torch.empty_like(src)
    # The source of every tensor: views of one flat same-GPU buffer of the same bytes.
    views, off = {}, 0
    for n, s in shapes:
        k = torch.Size(s).numel() * 2
        views[n] = src[off:off + k].view(torch.bfloat16).view(s)
        off += k
    for mode in ("in_place", "buffered"):
        wn = f"{name}-{mode}"
        w = cuda_ipc.TensorSetWriter(wn, specs, device=0, memory="vmm", mode=mode)
        try:
            with w.begin(timeout=STEP_S):
                pass
            readers = [cuda_ipc.TensorSetReader(wn, device=0) for _ in range(2)]
            times, copies = [], []
            for _ in range(args.updates):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with w.begin(timeout=STEP_S) as u:
                    u.copy_from(views)
                w.synchronize()
                times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                dst.copy_(src)
                torch.cuda.synchronize()
                copies.append(time.perf_counter() - t0)
            del readers
            tm, cm = statistics.median(times), statistics.median(copies)
            out["update"][mode] = {
                "update_ms": tm * 1e3,
                "copy_ms": cm * 1e3,
                "update_gbps": total / tm / 1e9,
                "copy_gbps": total / cm / 1e9,
                "ratio": cm / tm,
            }
        finally:
            w.close(timeout=10.0)
    del src, dst
    torch.cuda.empty_cache()
    return out


def med(runs, f):
    return statistics.median(f(r) for r in runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="quick")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--children", type=int, default=5, help="first attaches per run")
    ap.add_argument("--generations", type=int, default=20, help="new generations per run")
    ap.add_argument("--updates", type=int, default=5, help="updates per mode and run")
    ap.add_argument("--module-loading", default="lazy",
                    help="how the readers' CUDA modules load: lazy, eager or lazy,eager")
    ap.add_argument("--out")
    args = ap.parse_args()
    args.module_loading = args.module_loading.split(",")
    if not args.module_loading or any(m not in ("lazy", "eager") for m in args.module_loading):
        ap.error("--module-loading takes lazy, eager or both, comma-separated")
    import torch
    import cuda_ipc

    shapes = SHAPES[args.shape]()
    runs = []
    for i in range(args.runs):
        runs.append(one_run(torch, cuda_ipc, shapes, args, i))
        # Each run as it ends (a bounded call that stops early keeps the runs it finished).
        print(f"run {i}: " + json.dumps(runs[-1]), file=sys.stderr, flush=True)
        if args.out:
            with open(args.out + ".partial", "w") as f:
                json.dump({"runs": runs}, f, indent=1)
    def firsts_of(key):
        fs = [f for r in runs for f in r[key]]
        return {
            "first_open_ms": statistics.median(f["open_ms"] for f in fs),
            "first_dict_ms": statistics.median(f["dict_ms"] for f in fs),
            "first_hold_ms": statistics.median(f["hold_ms"] for f in fs),
            "first_tensors_ms": statistics.median(f["tensors_ms"] for f in fs),
            "first_usable_ms": statistics.median(f["usable_ms"] for f in fs),
            "first_read_again_ms": statistics.median(f["read_again_ms"] for f in fs),
            "first_ready_ms": statistics.median(f["ready_ms"] for f in fs),
            "imports": sorted({f["imports"] for f in fs}),
            "dict_ok": all(f["dict_ok"] for f in fs),
            "read_only": all(f["read_only"] for f in fs),
        }

    def torch_reads(loading):
        rs = [x for r in runs for x in r[f"torch_read_{loading}"]]
        return {
            "torch_first_read_ms": statistics.median(x["first_ms"] for x in rs),
            "torch_read_again_ms": statistics.median(x["again_ms"] for x in rs),
        }

    lead = args.module_loading[0]
    summary = {
        "shape": args.shape,
        "tensors": runs[0]["tensors"],
        "bytes": runs[0]["bytes"],
        "module_loading": lead,
        **firsts_of("first"),
        **torch_reads(lead),
        "warm_dict_us": med(runs, lambda r: r["warm_dict_us"]),
        "commit_to_wake_us": med(runs, lambda r: r["commit_to_wake_us"]),
        "channel_handoff_us": med(runs, lambda r: r["channel_handoff_us"]),
        "update": {
            m: {
                k: med(runs, lambda r, m=m, k=k: r["update"][m][k])
                for k in ("update_ms", "copy_ms", "update_gbps", "copy_gbps", "ratio")
            }
            for m in ("in_place", "buffered")
        },
    }
    for loading in args.module_loading[1:]:
        summary[loading] = {**firsts_of(f"first_{loading}"), **torch_reads(loading)}
    doc = {"summary": summary, "runs": runs}
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
