#!/usr/bin/env python3
"""Baseline: sharing a set of tensors (a model's weights) with PyTorch's torch.multiprocessing, the
way weight-sync and weight-cache programs do today; the figures a tensor-set attach is compared
with (docs/benchmarks.md, issue "tensor sets").

Sets (bf16, filled on the GPU by the sender, tensor k holding the value k % 61 + 1):
- llama: Llama-3-8B's 291 tensors (embed 128256x4096; 32 layers of q 4096x4096, k and v
  1024x4096, o 4096x4096, gate and up 14336x4096, down 4096x14336, two norms of 4096; final norm;
  lm_head 128256x4096), 15.0 GiB;
- moe: 4,608 tensors of 1 MiB (512x1024; 48 layers x 32 experts x 3), 4.5 GiB.
--quick shrinks both (llama: 2 layers, dims / 8; moe: 96 tensors of 64 KiB) for a smoke run.

Modes:
- per_tensor: the dict of tensors itself is sent (every storage shared with its own IPC handle, as
  `torch.multiprocessing` does for each tensor);
- packed: one bucket (one uint8 tensor holding every tensor at a 256-byte-aligned offset) and the
  list of (name, dtype, shape, offset) are sent; the receiver slices the bucket and views each
  slice (`bucket[o:o+n].view(dtype).view(shape)`).

The sender pickles the payload with torch's ForkingPickler (what a torch.multiprocessing queue
sends) and sends the bytes over a pipe; the receiver, having received the bytes, times:
- dict: unpickling (the rebuild of every tensor: IPC handle opens, storages, tensors) and, packed,
  the slicing, to a `dict` whose every value is a constructed `torch.Tensor` (checked);
- usable: dict plus one read of every tensor (its first element, gathered with `torch.stack`) and
  a `torch.cuda.synchronize()`; the values read are checked afterwards (untimed);
- release: dropping every reference (dict, payload, values) and a `torch.cuda.synchronize()`, with
  no `gc.collect()`.
Phases: warm (one receiver process attaching repeatedly: one warm-up attach, then --reps attaches,
the median of those) and first (a fresh receiver process that is ready: torch imported, context
made with a first allocation, then the first attach it makes). Each of --runs runs (default 3) has
its own warm receiver and fresh receivers; the result is the median over runs of each run's
figure. Every wait is bounded (STEP_S for a reply, 600 s for an idle receiver); receivers die with
the sender (PR_SET_PDEATHSIG).

Writes OUT/tensorset_baseline.json (the records' shape of the other baselines; every run's figures
under info). Needs PyTorch with CUDA; imported lazily so --help works without it.

    python3 bench/tensorset_baseline.py --out DIR [--quick] [--runs 3] [--reps 4] [--sets llama,moe]
        [--module-loading lazy|eager]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NAME = "tensorset_baseline"
ALIGN = 256
IDLE_S = 600.0  # the longest a receiver waits for its next command
MODES = ("per_tensor", "packed")


def value_of(k: int) -> int:
    """The value tensor k of a set holds (exact in bf16)."""
    return k % 61 + 1


def llama_shapes(quick: bool) -> list:
    """(name, shape) of Llama-3-8B's 291 tensors; --quick: 2 layers, every dimension / 8."""
    d = 8 if quick else 1
    h, kv, ff, vocab = 4096 // d, 1024 // d, 14336 // d, 128256 // d
    layers = 2 if quick else 32
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
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


def moe_shapes(quick: bool) -> list:
    """(name, shape) of 4,608 expert tensors of 1 MiB; --quick: 96 of 64 KiB."""
    layers, experts, shape = (4, 8, (128, 256)) if quick else (48, 32, (512, 1024))
    return [
        (f"layers.{layer}.experts.{e}.w{j}", shape)
        for layer in range(layers)
        for e in range(experts)
        for j in (1, 2, 3)
    ]


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def layout(shapes: list) -> tuple:
    """[(name, shape, offset, nbytes)] at 256-byte-aligned offsets of bf16 tensors, total bytes."""
    off, out = 0, []
    for name, shape in shapes:
        off = (off + ALIGN - 1) // ALIGN * ALIGN
        n = 2 * numel(shape)
        out.append((name, tuple(shape), off, n))
        off += n
    return out, off


# ----------------------------------------------------------------------------- receiver

def receiver(conn, ppid: int) -> None:
    """A receiver process: makes its context, says ready, then attaches each payload it gets."""
    common.die_with_parent()
    import torch
    import torch.multiprocessing  # noqa: F401 (registers PyTorch's reductions with ForkingPickler)
    import pickle

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    conn.send(("ready", os.getpid()))
    while True:
        if not conn.poll(IDLE_S) or os.getppid() != ppid:
            return
        msg = conn.recv()
        if msg[0] == "stop":
            return
        _, mode = msg
        if not conn.poll(common.STEP_S):
            return
        buf = conn.recv_bytes()
        t0 = time.perf_counter()
        obj = pickle.loads(buf)
        if mode == "packed":
            bucket, meta = obj
            d = {}
            for name, dtype, shape, off, n in meta:
                d[name] = bucket[off:off + n].view(dtype).view(shape)
        else:
            d = obj
        t1 = time.perf_counter()
        vals = torch.stack([t.reshape(-1)[0] for t in d.values()])
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        ok_dict = type(d) is dict and all(type(t) is torch.Tensor for t in d.values())
        got = vals.float().tolist()
        mismatches = sum(1 for k, v in enumerate(got) if v != value_of(k))
        n_tensors = len(d)
        t3 = time.perf_counter()
        del d, obj, vals
        if mode == "packed":
            del bucket, meta
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        conn.send({
            "dict_ms": (t1 - t0) * 1e3,
            "usable_ms": (t2 - t0) * 1e3,
            "release_ms": (t4 - t3) * 1e3,
            "tensors": n_tensors,
            "is_dict_of_tensors": ok_dict,
            "mismatches": mismatches,
        })


# ----------------------------------------------------------------------------- sender

class Receiver:
    """The sender's end of one receiver process; every wait bounded."""

    def __init__(self, mp):
        self.conn, child = mp.Pipe(duplex=True)
        self.proc = mp.Process(target=receiver, args=(child, os.getpid()), daemon=True)
        self.proc.start()
        child.close()

    def ready(self) -> None:
        if not self.conn.poll(120.0):
            raise TimeoutError("a receiver was not ready within 120 s")
        msg = self.conn.recv()
        if msg[0] != "ready":
            raise RuntimeError(f"unexpected first message {msg!r}")

    def attach(self, mode: str, payload_bytes: bytes) -> dict:
        self.conn.send(("attach", mode))
        self.conn.send_bytes(payload_bytes)
        if not self.conn.poll(common.STEP_S):
            raise TimeoutError(f"no reply within {common.STEP_S} s")
        r = self.conn.recv()
        if r["mismatches"] or not r["is_dict_of_tensors"]:
            raise RuntimeError(f"the receiver read wrong values or built no dict: {r}")
        return r

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)


def build(torch, shapes: list, mode: str):
    """The sender's tensors of a set in a mode, filled; returns what to pickle and the bytes."""
    lay, total = layout(shapes)
    if mode == "per_tensor":
        d = {}
        for k, (name, shape, _, _) in enumerate(lay):
            d[name] = torch.empty(shape, dtype=torch.bfloat16, device="cuda").fill_(value_of(k))
        payload = d
    else:
        bucket = torch.empty(total, dtype=torch.uint8, device="cuda")
        meta = []
        for k, (name, shape, off, n) in enumerate(lay):
            bucket[off:off + n].view(torch.bfloat16).fill_(value_of(k))
            meta.append((name, torch.bfloat16, shape, off, n))
        payload = (bucket, meta)
    torch.cuda.synchronize()
    return payload, total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p)
    p.add_argument("--runs", type=int, default=3, help="runs, each with fresh receivers (default 3)")
    p.add_argument("--reps", type=int, default=None, help="warm attaches per run after one warm-up (default 4, quick 2)")
    p.add_argument("--sets", default="llama,moe", help="comma-separated: llama, moe (default both)")
    p.add_argument("--module-loading", choices=("lazy", "eager"), default="lazy",
                   help="how the receivers' CUDA modules load (CUDA_MODULE_LOADING; default lazy)")
    a = p.parse_args(argv)
    reps = a.reps or (2 if a.quick else 4)
    sets = [s for s in a.sets.split(",") if s]
    if any(s not in ("llama", "moe") for s in sets) or a.runs < 1 or reps < 1:
        p.error("--sets takes llama and moe; --runs and --reps at least 1")
    env = {}
    try:
        import torch
        import torch.multiprocessing as tmp
        import torch.multiprocessing  # noqa: F401 (registers PyTorch's reductions)
        from multiprocessing.reduction import ForkingPickler
    except ImportError as e:
        return common.fail(a.out, NAME, f"PyTorch is not installed: {e}", env)
    if not torch.cuda.is_available():
        return common.fail(a.out, NAME, "torch.cuda.is_available() is False", env)
    env = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "gpu_name": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}
    mp = tmp.get_context("spawn")
    shapes = {"llama": llama_shapes(a.quick), "moe": moe_shapes(a.quick)}
    payloads = {}
    for s in sets:
        for m in MODES:
            payloads[(s, m)] = build(torch, shapes[s], m)
    cases = [(s, m) for s in sets for m in MODES]
    # The receivers inherit it at their spawn; this process's driver started already.
    os.environ["CUDA_MODULE_LOADING"] = a.module_loading.upper()
    # per (set, mode, phase): a list of per-run figures (dict of metric -> ms)
    per_run = {(s, m, ph): [] for s, m in cases for ph in ("warm", "first")}
    errors = []

    def send(s, m):
        return bytes(ForkingPickler.dumps(payloads[(s, m)][0]))

    for run in range(a.runs):
        receivers = []
        try:
            warm = Receiver(mp)
            receivers.append(warm)
            fresh = {}
            for c in cases:
                fresh[c] = Receiver(mp)
                receivers.append(fresh[c])
            for r in receivers:
                r.ready()
            for s, m in cases:
                try:
                    warm.attach(m, send(s, m))  # warm-up
                    got = [warm.attach(m, send(s, m)) for _ in range(reps)]
                    per_run[(s, m, "warm")].append(
                        {k: statistics.median(g[k] for g in got) for k in ("dict_ms", "usable_ms", "release_ms")}
                        | {"tensors": got[0]["tensors"]})
                    first = fresh[(s, m)].attach(m, send(s, m))
                    per_run[(s, m, "first")].append(first)
                except Exception as e:  # one case failing leaves the others running
                    errors.append({"case": f"{s}/{m}", "run": run, "error": f"{type(e).__name__}: {e}"})
                torch.cuda.ipc_collect()
        except Exception as e:
            errors.append({"case": "run", "run": run, "error": f"{type(e).__name__}: {e}"})
        finally:
            for r in receivers:
                r.stop()
        torch.cuda.ipc_collect()
        print(f"{NAME}: run {run + 1}/{a.runs} done", file=sys.stderr)

    records, info = [], {"runs": a.runs, "reps": reps, "quick": a.quick,
                         "module_loading": a.module_loading, "per_run": {}}
    for (s, m, ph), runs in per_run.items():
        if not runs:
            continue
        total = payloads[(s, m)][1]
        key = common.Key("tensorset_attach", "pytorch_mp", f"{s}/{m}/{ph}",
                         f"tensors={runs[0]['tensors']},bytes={total},runs={len(runs)},reps={reps if ph == 'warm' else 1}")
        for metric in ("dict_ms", "usable_ms", "release_ms"):
            records.append(key.rec(metric.removesuffix("_ms"), "median_of_runs",
                                   statistics.median(r[metric] for r in runs), "ms", len(runs)))
        info["per_run"][f"{s}/{m}/{ph}"] = runs
        print(f"{s:6} {m:10} {ph:5}: dict {statistics.median(r['dict_ms'] for r in runs):8.2f} ms, "
              f"usable {statistics.median(r['usable_ms'] for r in runs):8.2f} ms, "
              f"release {statistics.median(r['release_ms'] for r in runs):8.2f} ms "
              f"({runs[0]['tensors']} tensors, {total / 2**30:.2f} GiB, {len(runs)} runs)")
    path = common.write_result(a.out, NAME, records, info, errors, env)
    print(f"{NAME}: wrote {path}" + (f" with {len(errors)} errors" if errors else ""), file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
