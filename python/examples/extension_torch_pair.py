"""A PyTorch producer process and a PyTorch consumer process through the cuda_ipc extension and
DLPack, every frame checked; needs a GPU.

    python3 python/examples/extension_torch_pair.py [--memory auto|legacy|vmm|pool]
        [--delivery every|latest] [--frames 500] [--unordered] [--sleep-cycles 2000000]

Both sides work on PyTorch streams of their own (not the channel's) and never synchronise on the
host: the producer spins its stream on the GPU (``torch.cuda._sleep``) before filling a frame, so
the fill is still running when ``publish`` returns; the consumer spins its stream before checking
every byte, so the check is still running when it releases the frame. Only the stream ordering of
the extension (the DLPack export names PyTorch's current stream: the publish is ordered after it,
the frame is made ready on it, the release is ordered after it) keeps the check right.
``--unordered`` is the control: the consumer takes the capsule with ``stream=-1`` (no ordering)
and must see mismatches, which shows the check can fail.

Prints ``consumer frames=N mismatched_bytes=B zero_copy=True|False ...`` and exits non-zero when
ordered frames mismatch, any frame is a copy, or the control sees no mismatch.
"""

import argparse
import os
import subprocess
import sys
import time

import torch

import cuda_ipc

NBYTES = 4 << 20


def producer(a, name):
    with cuda_ipc.Producer(name, NBYTES, buffers=4, memory=a.memory) as p:
        print(f"ready {p.memory}", flush=True)
        deadline = time.monotonic() + 60
        while len(p.stats()["consumers"]) < 1:
            assert time.monotonic() < deadline, "no consumer attached"
            time.sleep(0.01)
        side = torch.cuda.Stream()
        t0 = time.monotonic()
        for i in range(a.frames):
            f = p.acquire(timeout=30)
            with torch.cuda.stream(side):
                torch.cuda._sleep(a.sleep_cycles)
                t = f.as_tensor()
                assert t.data_ptr() == f.ptr, "zero-copy"
                t.fill_(i % 251)
                del t
            f.publish(metadata=bytes([i % 251]) + i.to_bytes(4, "little"))
        dt = time.monotonic() - t0
        print(f"producer frames={a.frames} frames_per_s={a.frames / dt:.0f}", flush=True)
        p.close(timeout=30)


def consumer(a, name):
    bad = n = copies = out_of_order = 0
    last = -1
    side = torch.cuda.Stream()
    bad_t = torch.zeros((), dtype=torch.int64, device="cuda")
    deadline = time.monotonic() + 60
    while True:
        try:
            rx = cuda_ipc.Consumer(name, delivery=a.delivery)
            break
        except cuda_ipc.ChannelNotFound:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    with rx:
        for f in rx:
            want = f.metadata[0]
            idx = int.from_bytes(f.metadata[1:5], "little")
            if (a.delivery == "every" and idx != last + 1) or idx <= last:
                out_of_order += 1
            last = idx
            with torch.cuda.stream(side):
                if a.unordered:
                    t = torch.utils.dlpack.from_dlpack(f.__dlpack__(stream=-1))
                else:
                    t = f.as_tensor()
                copies += t.data_ptr() != f.ptr
                torch.cuda._sleep(a.sleep_cycles)
                bad_t += (t != want).sum()
                del t
            f.release()
            n += 1
        side.synchronize()
        bad = int(bad_t.item())
        st = rx.stats()
    mine = [c for c in st["consumers"]]
    print(f"consumer frames={n} last={last} mismatched_bytes={bad} zero_copy={copies == 0} "
          f"out_of_order={out_of_order} delivery={a.delivery} unordered={a.unordered} "
          f"stats={mine}", flush=True)
    ok = copies == 0 and n > 0 and out_of_order == 0 and last == a.frames - 1
    ok = ok and ((bad > 0) if a.unordered else (bad == 0))
    if a.delivery == "every":
        ok = ok and n == a.frames
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", nargs="?", choices=("producer", "consumer"))
    p.add_argument("name", nargs="?")
    p.add_argument("--memory", default="auto")
    p.add_argument("--delivery", choices=("every", "latest"), default="every")
    p.add_argument("--frames", type=int, default=500)
    p.add_argument("--sleep-cycles", type=int, default=2_000_000)
    p.add_argument("--unordered", action="store_true")
    a = p.parse_args()
    if a.role == "producer":
        producer(a, a.name)
        return 0
    if a.role == "consumer":
        return consumer(a, a.name)
    name = f"pyx-{os.getpid()}"
    args = ["--memory", a.memory, "--delivery", a.delivery, "--frames", str(a.frames),
            "--sleep-cycles", str(a.sleep_cycles)] + (["--unordered"] if a.unordered else [])
    prod = subprocess.Popen([sys.executable, __file__, "producer", name] + args,
                            stdout=subprocess.PIPE, text=True)
    first = prod.stdout.readline().strip()
    assert first.startswith("ready"), first
    c = subprocess.run([sys.executable, __file__, "consumer", name] + args, capture_output=True,
                       text=True, timeout=240)
    out, _ = prod.communicate(timeout=120)
    print(f"pair memory={first.split()[-1]} delivery={a.delivery} unordered={a.unordered}:",
          out.strip(), "|", c.stdout.strip(), c.stderr.strip()[-1500:], "| rc", prod.returncode,
          c.returncode, flush=True)
    return 0 if prod.returncode == 0 and c.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
