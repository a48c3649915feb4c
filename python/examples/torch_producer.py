"""A PyTorch producer (the ``cuda_ipc`` extension) for the ``rust_consumer`` example and for
``torch_consumer.py``: creates channel CHANNEL with a pool of 4 buffers of width x height x 4
bytes, waits for ``--consumers`` consumers, then publishes ``--frames`` frames. Each frame is
written zero-copy through DLPack (``WriteFrame.as_tensor``) with the pattern of the
``fill_pattern`` kernel (seed: the frame index), on a PyTorch stream of its own that is not the
channel's; with ``--sleep-cycles`` that stream first spins on the GPU, so the write is still running
when ``publish`` returns. Nothing synchronises on the host: the publish is ordered after PyTorch's
stream by the DLPack export (``publish_after``), which is what this checks end to end.

    python3 python/examples/torch_producer.py CHANNEL [--frames 1000] [--consumers 1]
        [--width 1920] [--height 1080] [--memory auto|legacy|vmm|pool] [--sleep-cycles 0]

Metadata: frame index, width, height, publish time (ns, CLOCK_MONOTONIC), little-endian u64.
"""

import argparse
import os
import struct
import sys
import time

import torch

import cuda_ipc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_consumer import TorchPattern  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("channel")
    p.add_argument("--frames", type=int, default=1000)
    p.add_argument("--consumers", type=int, default=1)
    p.add_argument("--width", type=int, default=1920)
    p.add_argument("--height", type=int, default=1080)
    p.add_argument("--memory", default="auto")
    p.add_argument("--sleep-cycles", type=int, default=0, help="GPU spin before each write")
    p.add_argument("--attach-timeout", type=float, default=60.0)
    a = p.parse_args()
    nbytes = a.width * a.height * 4
    words = nbytes // 4
    with cuda_ipc.Producer(a.channel, nbytes, buffers=4, memory=a.memory) as tx:
        pat = TorchPattern(torch.device("cuda", 0), words)
        pat.self_test()
        side = torch.cuda.Stream()
        print(f"torch producer (pid {os.getpid()}): channel {a.channel}, {a.frames} frames of "
              f"{nbytes} bytes, {tx.memory} memory; waiting for {a.consumers} consumer(s)", flush=True)
        deadline = time.monotonic() + a.attach_timeout
        while len(tx.stats()["consumers"]) < a.consumers:
            if time.monotonic() > deadline:
                print("torch producer: FAIL no consumer attached", flush=True)
                return 1
            time.sleep(0.01)
        t0 = time.monotonic()
        for i in range(a.frames):
            w = tx.acquire(timeout=30)
            with torch.cuda.stream(side):
                if a.sleep_cycles:
                    torch.cuda._sleep(a.sleep_cycles)
                x = pat.expected(i & 0xFFFFFFFF)
                x = torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)
                t = w.as_tensor((words,), torch.int32)  # notes `side` for the publish
                if t.data_ptr() != w.ptr:
                    print("torch producer: FAIL the tensor is a copy", flush=True)
                    return 1
                t.copy_(x)
                del t, x
            meta = struct.pack("<4Q", i, a.width, a.height, time.clock_gettime_ns(time.CLOCK_MONOTONIC))
            w.publish(meta)
        secs = time.monotonic() - t0
        print(f"torch producer: OK published {a.frames} frames in {secs:.2f} s "
              f"({a.frames / secs:.0f}/s)", flush=True)
        report = tx.close(timeout=30)
        if report["forced_holds"]:
            print(f"torch producer: FAIL {report['forced_holds']} holds forced at close", flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
