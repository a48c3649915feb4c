#!/usr/bin/env python3
"""Baseline: PyTorch's torch.multiprocessing queue of CUDA tensors, the way users share frames.

The producer pre-allocates a ring of 4 CUDA tensors of one 4K RGBA frame each (int32 view, 33,177,600
bytes), fills tensor idx with frame i's value (a kernel), waits for its stream (torch does not make the
consumer wait for the producer's work on a storage it has already opened, so without this the check
could race the fill), takes t0 and puts (i, idx, t0, tensor) on each consumer's queue. A consumer
gets it (ready = now - t0: the tensor is usable), counts the words that differ from the value (a
kernel), synchronises its stream and acknowledges idx so the producer may refill the tensor.

Writes OUT/torch_queue.json: the idle hand-off latency (1 consumer) and saturated throughput with 1 and
4 consumers. Needs PyTorch with CUDA; imported lazily so --help works without it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NAME = "torch_queue"


class TorchHandler(common.TorchCheck):
    """Consumer side: the tensor arrives through the queue; check it, synchronise, let it go."""

    def __init__(self, cfg):
        self.cfg = cfg

    def start(self):
        import torch
        self.torch = torch
        torch.cuda.init()
        self.bad = torch.zeros((), dtype=torch.int64, device="cuda")

    def take(self, i, idx, payload):
        return payload  # rebuilding the tensor (the storage cache, the IPC open) happened in get()



def consumer_proc(q, ack, res, c, ppid, cfg):
    common.consumer_loop(q, ack, res, c, ppid, TorchHandler(cfg))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p)
    p.add_argument("--idle-frames", type=int, default=None, help="frames of the idle phase (default 1000, quick 100)")
    p.add_argument("--frames", type=int, default=None, help="frames of each saturated phase (default 3000, quick 300)")
    p.add_argument("--gap-us", type=int, default=1000, help="gap before each idle-phase frame (default 1000)")
    a = p.parse_args(argv)
    idle = a.idle_frames or (100 if a.quick else 1000)
    frames = a.frames or (300 if a.quick else 3000)
    warm = 20 if a.quick else 100
    env = {}
    try:
        import torch
        import torch.multiprocessing as tmp
    except ImportError as e:
        return common.fail(a.out, NAME, f"PyTorch is not installed: {e}", env)
    if not torch.cuda.is_available():
        return common.fail(a.out, NAME, "torch.cuda.is_available() is False", env)
    env = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "gpu_name": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}
    mp = tmp.get_context("spawn")
    records, info, errors = [], {}, []
    ring = [torch.empty(common.FRAME_BYTES // 4, dtype=torch.int32, device="cuda") for _ in range(common.RING)]
    stream = torch.cuda.current_stream()

    def prepare(i, idx):
        ring[idx].fill_(common.seed(i))
        stream.synchronize()

    def publish(i, idx):
        return ring[idx]

    for consumers in ((1,) if a.quick else (1, 4)):
        s = None
        try:
            s = common.Session(mp, consumer_proc, consumers, {})
            if consumers == 1:
                out = s.run_phase("idle", idle, warm, a.gap_us, True, prepare, publish)
                key = common.Key("handoff", NAME, "idle", f"frames={idle} warmup={warm} gap_us={a.gap_us}")
                recs, mism, ooo = common.phase_records(key, out, idle, False)
                records += recs
                if mism or ooo:
                    errors.append({"case": "idle", "error": f"{mism} mismatched words, {ooo} out of order"})
            out = s.run_phase("saturated", frames, warm, 0, False, prepare, publish)
            params = f"consumers={consumers} frames={frames} warmup={warm}"
            # The saturated latency is a hand-off record, as in the Rust suite.
            sat = "saturated" if consumers == 1 else f"saturated-c{consumers}"
            recs, mism, ooo = common.phase_records(
                common.Key("throughput", NAME, f"c{consumers}", params), out, frames, True,
                lat_key=common.Key("handoff", NAME, sat, params))
            records += recs
            if mism or ooo:
                errors.append({"case": f"c{consumers}", "error": f"{mism} mismatched words, {ooo} out of order"})
            info[f"c{consumers}"] = {"mismatched_words": mism, "out_of_order": ooo}
        except Exception as e:  # one session failing leaves the others' numbers
            errors.append({"case": f"c{consumers}", "error": f"{type(e).__name__}: {e}"})
            print(f"{NAME}: c{consumers}: {e}", file=sys.stderr)
        finally:
            if s is not None:
                s.close()
    path = common.write_result(a.out, NAME, records, info, errors, env)
    print(f"{NAME}: {len(records)} records, {len(errors)} errors -> {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
