#!/usr/bin/env python3
"""Baseline: staging frames through host shared memory (device -> host -> device).

A ring of 4 frame slots lives in POSIX shared memory (multiprocessing.shared_memory). The producer
fills its GPU frame idx with frame i's value (a kernel) and waits for it; then, from t0, copies it to
host slot idx (device -> host) and puts (i, idx, t0) on the queue. The consumer copies slot idx into
its own GPU buffer (host -> device) and synchronises: ready = now - t0 (the frame is on its GPU). It
checks every word (a kernel), synchronises and acknowledges.

Two variants: `pageable` (the shared memory as it is) and `pinned` (the shared memory registered
with cudaHostRegister in both processes, so the copies are DMA transfers). Writes
OUT/host_staging.json. Needs PyTorch with CUDA; imported lazily so --help works without it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NAME = "host_staging"


def host_register(torch, buf) -> None:
    """cudaHostRegister of a whole shared-memory buffer (portable, so every context may use it)."""
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    err = torch.cuda.cudart().cudaHostRegister(ptr, len(buf), 1)  # cudaHostRegisterPortable
    code = getattr(err, "value", err)
    if int(code) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")


class StagingHandler(common.TorchCheck):
    def __init__(self, cfg):
        self.cfg = cfg

    def start(self):
        import torch
        from multiprocessing import shared_memory
        self.torch = torch
        torch.cuda.init()
        self.shm = shared_memory.SharedMemory(name=self.cfg["shm"])
        if self.cfg["pinned"]:
            host_register(torch, self.shm.buf)
        host = torch.frombuffer(self.shm.buf, dtype=torch.int32)
        n = common.FRAME_BYTES // 4
        self.slots = [host[k * n:(k + 1) * n] for k in range(common.RING)]
        self.dev = [torch.empty(n, dtype=torch.int32, device="cuda") for _ in range(common.RING)]
        self.bad = torch.zeros((), dtype=torch.int64, device="cuda")

    def take(self, i, idx, payload):
        d = self.dev[idx]
        d.copy_(self.slots[idx], non_blocking=self.cfg["pinned"])
        self.torch.cuda.current_stream().synchronize()
        return d



def consumer_proc(q, ack, res, c, ppid, cfg):
    common.consumer_loop(q, ack, res, c, ppid, StagingHandler(cfg))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p)
    p.add_argument("--frames", type=int, default=None, help="frames per saturated phase (default 300, quick 30)")
    p.add_argument("--idle-frames", type=int, default=None, help="frames of each idle phase (default 200, quick 20)")
    p.add_argument("--gap-us", type=int, default=1000, help="gap before each idle-phase frame (default 1000)")
    p.add_argument("--variants", default=None, help="pageable, pinned or both (default both; quick: pageable)")
    a = p.parse_args(argv)
    frames = a.frames or (30 if a.quick else 300)
    idle = a.idle_frames or (20 if a.quick else 200)
    warm = 5 if a.quick else 20
    env = {}
    try:
        import torch
        import torch.multiprocessing as tmp
        from multiprocessing import shared_memory
    except ImportError as e:
        return common.fail(a.out, NAME, f"PyTorch is not installed: {e}", env)
    if not torch.cuda.is_available():
        return common.fail(a.out, NAME, "torch.cuda.is_available() is False", env)
    env = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "gpu_name": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}
    mp = tmp.get_context("spawn")
    records, info, errors = [], {}, []
    n = common.FRAME_BYTES // 4
    gpu = [torch.empty(n, dtype=torch.int32, device="cuda") for _ in range(common.RING)]
    stream = torch.cuda.current_stream()
    variants = a.variants or ("pageable" if a.quick else "pageable,pinned")
    for variant in [v.strip() for v in variants.split(",") if v.strip()]:
        pinned = variant == "pinned"
        impl = f"{NAME}_{variant}"
        shm, s, registered = None, None, False
        try:
            shm = shared_memory.SharedMemory(create=True, size=common.FRAME_BYTES * common.RING)
            if pinned:
                host_register(torch, shm.buf)
                registered = True
            host = torch.frombuffer(shm.buf, dtype=torch.int32)
            slots = [host[k * n:(k + 1) * n] for k in range(common.RING)]

            def prepare(i, idx):
                gpu[idx].fill_(common.seed(i))
                stream.synchronize()

            def publish(i, idx, slots=slots):
                slots[idx].copy_(gpu[idx])  # device -> host; returns once the bytes are in the slot
                if pinned:
                    stream.synchronize()
                return None

            s = common.Session(mp, consumer_proc, 1, {"shm": shm.name, "pinned": pinned})
            out = s.run_phase("idle", idle, warm, a.gap_us, True, prepare, publish)
            key = common.Key("handoff", impl, "idle", f"frames={idle} warmup={warm} gap_us={a.gap_us}")
            recs, m1, o1 = common.phase_records(key, out, idle, False)
            records += recs
            out = s.run_phase("saturated", frames, warm, 0, False, prepare, publish)
            params = f"consumers=1 frames={frames} warmup={warm}"
            recs, m2, o2 = common.phase_records(common.Key("throughput", impl, "c1", params), out, frames, True,
                                                lat_key=common.Key("handoff", impl, "saturated", params))
            records += recs
            info[variant] = {"mismatched_words": m1 + m2, "out_of_order": o1 + o2}
            if m1 + m2 or o1 + o2:
                errors.append({"case": variant, "error": f"{m1 + m2} mismatched words, {o1 + o2} out of order"})
        except Exception as e:
            errors.append({"case": variant, "error": f"{type(e).__name__}: {e}"})
            print(f"{NAME}: {variant}: {e}", file=sys.stderr)
        finally:
            if s is not None:
                s.close()
            if shm is not None:
                if registered:
                    try:
                        torch.cuda.cudart().cudaHostUnregister(ctypes.addressof(ctypes.c_char.from_buffer(shm.buf)))
                    except Exception:
                        pass
                # Views onto the buffer must go before it can be closed.
                host = slots = None
                try:
                    shm.close()
                except BufferError:
                    pass
                shm.unlink()
    path = common.write_result(a.out, NAME, records, info, errors, env)
    print(f"{NAME}: {len(records)} records, {len(errors)} errors -> {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
