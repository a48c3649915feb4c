#!/usr/bin/env python3
"""PyTorch producer -> PyTorch consumers through the cuda_ipc extension: the same frames, the same
check and the same phases as torch_queue.py (the torch.multiprocessing queue baseline), so the two
stand side by side.

The producer process owns the channel (a pool of 4 buffers of one 4K RGBA frame each, 33,177,600
bytes); it fills frame i with frame i's value through DLPack (``WriteFrame.as_tensor``, a kernel on
PyTorch's current stream), waits for its stream (as the baseline does), takes t0 and publishes it
with (i, t0) as metadata. A consumer's ``recv`` returns the frame (ready = now - t0: the tensor can
be made), it views the frame as an int32 tensor (DLPack, zero-copy), counts the words that differ
from the value (a kernel), synchronises its stream and releases the frame. In the idle phase each
consumer also acknowledges through a multiprocessing queue after the release, so the producer
waits for every consumer and a gap before the next frame, as the baseline does; the saturated
phase has no acknowledgement: the channel's back-pressure (every-frame delivery) paces the
producer.

Writes OUT/torch_channel.json in the records format of the other baselines (bench/common.py).

    python3 bench/torch_channel.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import os
import queue
import struct
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NAME = "torch_channel"


def consumer_proc(channel, phases, ack, res, c, ppid):
    """phases: [(name, warmup, frames, acked)]; results go to res per phase."""
    common.die_with_parent()
    try:
        import torch
        import cuda_ipc

        torch.cuda.init()
        bad = torch.zeros((), dtype=torch.int64, device="cuda")
        stream = torch.cuda.current_stream()
        with cuda_ipc.Consumer(channel, delivery="every") as rx:
            res.put(("ready", c, None))
            for name, warmup, frames, acked in phases:
                lat, take, release = [], [], []
                received = out_of_order = 0
                expect = None
                t_done = None
                for _ in range(warmup + frames):
                    a = common.now_ns()
                    f = rx.recv(timeout=common.STEP_S)
                    t_ready = common.now_ns()
                    i, t0 = struct.unpack_from("<Qq", f.metadata)
                    if expect is not None and i != expect:
                        out_of_order += 1
                    expect = i + 1
                    t = f.as_tensor(dtype=torch.int32)
                    bad += (t != common.seed(i)).sum()
                    del t
                    r = common.now_ns()
                    stream.synchronize()
                    f.release()
                    t_done = common.now_ns()
                    if acked:
                        ack.put(c)
                    if received >= warmup:
                        lat.append(t_ready - t0)
                        take.append(t_ready - a)
                        release.append(t_done - r)
                    received += 1
                mism = int(bad.item())
                bad.zero_()
                res.put(("phase", c, {
                    "phase": name, "lat_ns": lat, "take_ns": take, "release_ns": release,
                    "received": received, "out_of_order": out_of_order, "mismatches": mism,
                    "t_done_ns": t_done,
                }))
    except Exception:
        res.put(("error", c, traceback.format_exc()))


def expect(res, procs, kind, n, timeout_s=180.0):
    import time

    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        try:
            msg = res.get(timeout=0.5)
        except queue.Empty:
            if any(not p.is_alive() for p in procs):
                raise RuntimeError(f"a consumer process died while waiting for {kind!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind!r} from the consumers within {timeout_s} s")
            continue
        if msg[0] == "error":
            raise RuntimeError(f"consumer {msg[1]} failed:\n{msg[2]}")
        if msg[0] == kind:
            got.append(msg[2])
    return got


def run_session(mp, torch, cuda_ipc, consumers, phases, gap_us):
    import time

    channel = f"bench-tc-{os.getpid()}-{consumers}"
    tx = cuda_ipc.Producer(channel, common.FRAME_BYTES, buffers=common.RING, max_consumers=8)
    ack, res = mp.Queue(), mp.Queue()
    procs = [mp.Process(target=consumer_proc, args=(channel, phases, ack, res, c, os.getpid()),
                        daemon=True) for c in range(consumers)]
    out = {}
    try:
        for p in procs:
            p.start()
        expect(res, procs, "ready", consumers)
        stream = torch.cuda.current_stream()
        i = 0
        for name, warmup, frames, acked in phases:
            publish_ns = []
            t_start = common.now_ns()
            for k in range(warmup + frames):
                if k == warmup:
                    t_start = common.now_ns()
                f = tx.acquire(timeout=common.STEP_S)
                f.as_tensor(dtype=torch.int32).fill_(common.seed(i))
                stream.synchronize()
                if acked and gap_us:
                    time.sleep(gap_us / 1e6)
                t0 = common.now_ns()
                f.publish(struct.pack("<Qq", i, t0))
                if k >= warmup:
                    publish_ns.append(common.now_ns() - t0)
                i += 1
                if acked:
                    for _ in range(consumers):
                        ack.get(timeout=common.STEP_S)
            results = expect(res, procs, "phase", consumers, common.STEP_S * 4)
            out[name] = {"consumers": results, "publish_ns": publish_ns, "t_start_ns": t_start}
    finally:
        tx.close(timeout=10)
        for p in procs:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p)
    p.add_argument("--idle-frames", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--gap-us", type=int, default=1000)
    a = p.parse_args(argv)
    idle = a.idle_frames or (100 if a.quick else 1000)
    frames = a.frames or (300 if a.quick else 3000)
    warm = 20 if a.quick else 100
    env = {}
    try:
        import torch
        import torch.multiprocessing as tmp
        import cuda_ipc
    except ImportError as e:
        return common.fail(a.out, NAME, f"PyTorch or cuda_ipc is not installed: {e}", env)
    if not torch.cuda.is_available():
        return common.fail(a.out, NAME, "torch.cuda.is_available() is False", env)
    env = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "gpu_name": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}
    mp = tmp.get_context("spawn")
    records, info, errors = [], {}, []
    for consumers in ((1,) if a.quick else (1, 4)):
        phases = ([("idle", warm, idle, True)] if consumers == 1 else []) + [("saturated", warm, frames, False)]
        try:
            out = run_session(mp, torch, cuda_ipc, consumers, phases, a.gap_us)
            if "idle" in out:
                key = common.Key("handoff", NAME, "idle", f"frames={idle} warmup={warm} gap_us={a.gap_us}")
                recs, mism, ooo = common.phase_records(key, out["idle"], idle, False)
                records += recs
                if mism or ooo:
                    errors.append({"case": "idle", "error": f"{mism} mismatched words, {ooo} out of order"})
            params = f"consumers={consumers} frames={frames} warmup={warm}"
            sat = "saturated" if consumers == 1 else f"saturated-c{consumers}"
            recs, mism, ooo = common.phase_records(
                common.Key("throughput", NAME, f"c{consumers}", params), out["saturated"], frames, True,
                lat_key=common.Key("handoff", NAME, sat, params))
            records += recs
            if mism or ooo:
                errors.append({"case": f"c{consumers}", "error": f"{mism} mismatched words, {ooo} out of order"})
            info[f"c{consumers}"] = {"mismatched_words": mism, "out_of_order": ooo}
        except Exception as e:
            errors.append({"case": f"c{consumers}", "error": f"{type(e).__name__}: {e}"})
            print(f"{NAME}: c{consumers}: {e}", file=sys.stderr)
    path = common.write_result(a.out, NAME, records, info, errors, env)
    print(f"{NAME}: {len(records)} records, {len(errors)} errors -> {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
