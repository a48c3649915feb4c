#!/usr/bin/env python3
"""Baseline: a raw CUDA IPC handle opened for every frame, without a cache (CuPy).

The producer allocates a ring of 4 frames with cudaMalloc (cupy.cuda.Memory, not the pool, so each
frame is its own allocation) and takes each one's cudaIpcMemHandle once. It fills frame idx with
frame i's value (a kernel), waits for it, takes t0 and puts (i, idx, t0, handle) on the queue. The
consumer opens the handle (cudaIpcOpenMemHandle: ready = now - t0), checks every word (a kernel),
synchronises, closes the handle (cudaIpcCloseMemHandle) and acknowledges. This is what a consumer
pays per frame when it does not keep its mappings.

Writes OUT/cupy_ipc.json. Needs CuPy; imported lazily so --help works without it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NAME = "cupy_ipc_per_frame"


class IpcHandler:
    def __init__(self, cfg):
        self.cfg = cfg

    def start(self):
        import cupy
        self.cp = cupy
        cupy.cuda.Device(0).use()
        self.bad = cupy.zeros((), dtype=cupy.int64)
        self.n = common.FRAME_BYTES // 4

    def take(self, i, idx, handle):
        cp = self.cp
        ptr = cp.cuda.runtime.ipcOpenMemHandle(handle)  # flags: cudaIpcMemLazyEnablePeerAccess
        mem = cp.cuda.UnownedMemory(ptr, common.FRAME_BYTES, None, 0)
        a = cp.ndarray((self.n,), dtype=cp.int32, memptr=cp.cuda.MemoryPointer(mem, 0))
        return (ptr, a)

    def check(self, frame, i):
        self.bad += self.cp.count_nonzero(frame[1] != common.seed(i))

    def done(self, frame, idx):
        self.cp.cuda.get_current_stream().synchronize()
        self.cp.cuda.runtime.ipcCloseMemHandle(frame[0])

    def mismatches(self):
        n = int(self.bad.get())
        self.bad.fill(0)
        return n


def consumer_proc(q, ack, res, c, ppid, cfg):
    common.consumer_loop(q, ack, res, c, ppid, IpcHandler(cfg))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p)
    p.add_argument("--frames", type=int, default=None, help="frames of the saturated phase (default 1000, quick 100)")
    p.add_argument("--idle-frames", type=int, default=None, help="frames of the idle phase (default 300, quick 30)")
    p.add_argument("--gap-us", type=int, default=1000, help="gap before each idle-phase frame (default 1000)")
    a = p.parse_args(argv)
    frames = a.frames or (100 if a.quick else 1000)
    idle = a.idle_frames or (30 if a.quick else 300)
    warm = 10 if a.quick else 50
    env = {}
    try:
        import multiprocessing
        import cupy
    except ImportError as e:
        return common.fail(a.out, NAME, f"CuPy is not installed: {e}", env)
    try:
        props = cupy.cuda.runtime.getDeviceProperties(0)
        env = {"cupy": cupy.__version__, "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
               "gpu_name": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
               "python": sys.version.split()[0]}
    except Exception as e:
        return common.fail(a.out, NAME, f"no CUDA device for CuPy: {e}", env)
    mp = multiprocessing.get_context("spawn")
    records, info, errors = [], {}, []
    n = common.FRAME_BYTES // 4
    mems = [cupy.cuda.Memory(common.FRAME_BYTES) for _ in range(common.RING)]
    arrs = [cupy.ndarray((n,), dtype=cupy.int32, memptr=cupy.cuda.MemoryPointer(m, 0)) for m in mems]
    handles = [cupy.cuda.runtime.ipcGetMemHandle(m.ptr) for m in mems]
    stream = cupy.cuda.get_current_stream()

    def prepare(i, idx):
        arrs[idx].fill(common.seed(i))
        stream.synchronize()

    def publish(i, idx):
        return handles[idx]

    s = None
    try:
        s = common.Session(mp, consumer_proc, 1, {})
        out = s.run_phase("idle", idle, warm, a.gap_us, True, prepare, publish)
        key = common.Key("handoff", NAME, "idle", f"frames={idle} warmup={warm} gap_us={a.gap_us}")
        recs, m1, o1 = common.phase_records(key, out, idle, False)
        records += recs
        out = s.run_phase("saturated", frames, warm, 0, False, prepare, publish)
        params = f"consumers=1 frames={frames} warmup={warm}"
        recs, m2, o2 = common.phase_records(common.Key("throughput", NAME, "c1", params), out, frames, True,
                                            lat_key=common.Key("handoff", NAME, "saturated", params))
        records += recs
        info["c1"] = {"mismatched_words": m1 + m2, "out_of_order": o1 + o2}
        if m1 + m2 or o1 + o2:
            errors.append({"case": "c1", "error": f"{m1 + m2} mismatched words, {o1 + o2} out of order"})
    except Exception as e:
        errors.append({"case": "c1", "error": f"{type(e).__name__}: {e}"})
        print(f"{NAME}: {e}", file=sys.stderr)
    finally:
        if s is not None:
            s.close()
    path = common.write_result(a.out, NAME, records, info, errors, env)
    print(f"{NAME}: {len(records)} records, {len(errors)} errors -> {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
