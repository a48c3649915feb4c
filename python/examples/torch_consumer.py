"""A Python consumer of the `python_producer` example: receives every frame as a PyTorch tensor
(or a CuPy array with ``--via cupy``), zero-copy, and checks every 32-bit word against the pattern
the producer's ``fill_pattern`` kernel wrote, on the GPU. Only the mismatch count (one integer)
comes back to the host, once, at the end. Prints frames/s and the hand-off latency (publish ->
frame ready here), and exits non-zero on any mismatch, a frame out of order, or a frame missing.

    python3 python/examples/torch_consumer.py CHANNEL [--frames N] [--via torch|cupy]
    python3 python/examples/torch_consumer.py --print-pattern SEED... --at INDEX...

Frame metadata (little-endian u64): frame index (the pattern's seed), width, height, publish time
(ns, CLOCK_MONOTONIC). Each frame is width x height x 4 bytes.
"""

import argparse
import os
import struct
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuda_ipc_consumer as cic  # noqa: E402

M32 = 0xFFFFFFFF


def pattern(seed: int, i: int) -> int:
    """The host reference of the kernels' pattern (cuda_ipc::kernels::pattern): the 32-bit word at
    index ``i`` of a buffer tagged ``seed``."""
    x = ((seed * 2654435761) & M32) ^ (i & M32) ^ (((i >> 32) * 0x9E3779B9) & M32)
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    return (x + i) & M32


class TorchCheck:
    """Counts words that differ from the pattern, on the GPU, in int64 (PyTorch has few uint32
    operations); products are split so that no intermediate exceeds 2**48."""

    def __init__(self, device, words: int):
        import torch

        self.torch = torch
        i = torch.arange(words, dtype=torch.int64, device=device)
        self.lo = i & M32
        self.hi = ((i >> 32) * 0x9E3779B9) & M32
        self.bad = torch.zeros((), dtype=torch.int64, device=device)
        self.words = words

    def mul32(self, x, k):
        return (x * (k & 0xFFFF) + (((x * (k >> 16)) & 0xFFFF) << 16)) & M32

    def expected(self, seed: int):
        x = self.lo ^ ((seed * 2654435761) & M32) ^ self.hi
        x = x ^ (x >> 16)
        x = self.mul32(x, 0x85EBCA6B)
        x = x ^ (x >> 13)
        return (x + self.lo) & M32

    def self_test(self) -> None:
        at = [0, 1, 2, 12345, self.words - 1]
        for seed in (0, 1, 0xDEADBEEF):
            got = self.expected(seed)[at].tolist()
            want = [pattern(seed, i) for i in at]
            if got != want:
                raise SystemExit(f"the GPU pattern {got} differs from the reference {want}")

    def check(self, frame, seed: int) -> None:
        t = frame.as_tensor((self.words,), self.torch.int32)
        self.bad += ((t.to(self.torch.int64) & M32) != self.expected(seed)).sum()

    def mismatches(self) -> int:
        return int(self.bad.item())


class CupyCheck:
    """The same check in CuPy, in uint32 (wrapping arithmetic)."""

    def __init__(self, ordinal: int, words: int):
        import cupy

        self.cp = cupy
        with cupy.cuda.Device(ordinal):
            i = cupy.arange(words, dtype=cupy.uint64)
            self.lo = (i & M32).astype(cupy.uint32)
            self.hi = (((i >> 32) * 0x9E3779B9) & M32).astype(cupy.uint32)
            self.bad = cupy.zeros((), dtype=cupy.int64)
        self.ordinal = ordinal
        self.words = words

    def expected(self, seed: int):
        cp = self.cp
        x = self.lo ^ cp.uint32((seed * 2654435761) & M32) ^ self.hi
        x = x ^ (x >> cp.uint32(16))
        x = x * cp.uint32(0x85EBCA6B)
        x = x ^ (x >> cp.uint32(13))
        return x + self.lo

    def self_test(self) -> None:
        at = [0, 1, 2, 12345, self.words - 1]
        with self.cp.cuda.Device(self.ordinal):
            for seed in (0, 1, 0xDEADBEEF):
                got = [int(v) for v in self.expected(seed)[at].get()]
                want = [pattern(seed, i) for i in at]
                if got != want:
                    raise SystemExit(f"the GPU pattern {got} differs from the reference {want}")

    def check(self, frame, seed: int) -> None:
        with self.cp.cuda.Device(self.ordinal):
            a = frame.as_cupy((self.words,), self.cp.uint32)
            self.bad += self.cp.count_nonzero(a != self.expected(seed))

    def mismatches(self) -> int:
        with self.cp.cuda.Device(self.ordinal):
            return int(self.bad.get())


def attach(channel: str, timeout: float) -> "cic.Consumer":
    deadline = time.monotonic() + timeout
    while True:
        try:
            return cic.Consumer.attach(channel, delivery="every")
        except cic.ChannelNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("channel", nargs="?")
    p.add_argument("--frames", type=int, default=0, help="frames expected (0: any number)")
    p.add_argument("--via", choices=("torch", "cupy"), default="torch")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each frame")
    p.add_argument("--attach-timeout", type=float, default=60.0, help="seconds to wait for the channel")
    p.add_argument("--print-pattern", type=int, nargs="*", metavar="SEED")
    p.add_argument("--at", type=int, nargs="*", default=[], metavar="INDEX")
    a = p.parse_args()
    if a.print_pattern is not None:
        print(" ".join(str(pattern(s, i)) for s in a.print_pattern for i in a.at))
        return 0
    if not a.channel:
        p.error("a channel name is needed")

    if a.via == "torch":
        import torch  # before attaching: frames are then ready on PyTorch's current stream
    else:
        import cupy  # noqa: F401  (frames ready on CuPy's current stream)

    rx = attach(a.channel, a.attach_timeout)
    with rx:
        words = rx.buffer_bytes // 4
        if a.via == "torch":
            checker = TorchCheck(torch.device("cuda", rx.device_ordinal), words)
        else:
            checker = CupyCheck(rx.device_ordinal, words)
        checker.self_test()
        print(
            f"python consumer (pid {os.getpid()}, {a.via}): attached to {a.channel} as consumer "
            f"{rx.slot}, {rx.buffers} buffers of {rx.buffer_bytes} bytes, device {rx.device_ordinal}",
            flush=True,
        )
        received = 0
        out_of_order = 0
        bad_shape = 0
        last = None
        lat = []
        start = None
        while True:
            try:
                frame = rx.recv(timeout=a.timeout)
            except cic.ChannelClosed:
                break
            ready = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            start = start or time.monotonic()
            with frame:
                index, w, h, stamp = struct.unpack_from("<4Q", frame.metadata)
                lat.append(max(0, ready - stamp))
                if w * h * 4 != frame.nbytes:
                    bad_shape += 1
                if index != frame.seq - 1 or (last is not None and frame.seq != last + 1):
                    out_of_order += 1
                last = frame.seq
                checker.check(frame, index & M32)  # enqueued on the frame's stream; released after it
            received += 1
        bad = checker.mismatches()  # synchronises: every check has run
        secs = max(time.monotonic() - (start or time.monotonic()), 1e-9)
        stats = [c for c in rx.stats()["consumers"] if c["index"] == rx.slot]
    lat.sort()

    def pct(q):
        return lat[int((len(lat) - 1) * q)] / 1e3 if lat else 0.0

    missing = a.frames - received if a.frames else 0
    ok = bad == 0 and out_of_order == 0 and bad_shape == 0 and received > 0 and missing == 0
    print(
        f"python consumer: {'OK' if ok else 'FAIL'} received {received} frames "
        f"({received / secs:.0f}/s, {received * words * 4 / secs / 1e9:.1f} GB/s), missing {missing}, "
        f"mismatched words {bad}, out of order {out_of_order}, bad shape {bad_shape}; hand-off "
        f"publish->ready p50 {pct(0.5):.1f} us, p99 {pct(0.99):.1f} us, max {pct(1.0):.1f} us; "
        f"stats {stats}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except cic.CudaIpcError as e:
        print(f"python consumer: FAIL {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
