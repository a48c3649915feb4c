"""A Python consumer (the ``cuda_ipc`` extension) of the ``python_producer`` example and of
``torch_producer.py``: receives every frame zero-copy through DLPack as a PyTorch tensor (or a CuPy
or JAX array with ``--via cupy|jax``), checks that the array's data pointer is the frame's, and
checks every 32-bit word against the pattern of the ``fill_pattern`` kernel on the GPU. Only the
mismatch count comes back to the host, once, at the end. Prints frames/s and the hand-off latency
(publish -> frame received here), and exits non-zero on any mismatch, copy, frame out of order or
frame missing.

    python3 python/examples/torch_consumer.py CHANNEL [--frames N] [--via torch|cupy|jax]
        [--delivery every|latest]
    python3 python/examples/torch_consumer.py CHANNEL --cost [--cost-via capsule|torch]
    python3 python/examples/torch_consumer.py --print-pattern SEED... --at INDEX...

``--cost`` measures what receiving costs per frame instead (``bench/consumer_cost.py``): each
``try_recv`` that returns a frame, the DLPack export (``--cost-via capsule``: ``__dlpack__`` alone;
``torch``: ``torch.from_dlpack``, the tensor made and freed) and the release, timed together;
polls that find nothing are not counted. Prints ``cost_ns p50=... p90=... mean=...``.

Frame metadata (little-endian u64): frame index (the pattern's seed), width, height, publish time
(ns, CLOCK_MONOTONIC). Each frame is width x height x 4 bytes.
"""

import argparse
import os
import struct
import sys
import time

import cuda_ipc

M32 = 0xFFFFFFFF


def pattern(seed: int, i: int) -> int:
    """The host reference of the kernels' pattern (cuda_ipc::kernels::pattern): the 32-bit word at
    index ``i`` of a buffer tagged ``seed``."""
    x = ((seed * 2654435761) & M32) ^ (i & M32) ^ (((i >> 32) * 0x9E3779B9) & M32)
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    return (x + i) & M32


class TorchPattern:
    """The pattern on the GPU in PyTorch, in int64 (PyTorch has few uint32 operations); products
    are split so that no intermediate exceeds 2**48."""

    def __init__(self, device, words: int):
        import torch

        self.torch = torch
        i = torch.arange(words, dtype=torch.int64, device=device)
        self.lo = i & M32
        self.hi = ((i >> 32) * 0x9E3779B9) & M32
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
        at = [0, 1, 2, 12345 % self.words, self.words - 1]
        for seed in (0, 1, 0xDEADBEEF):
            got = self.expected(seed)[at].tolist()
            want = [pattern(seed, i) for i in at]
            if got != want:
                raise SystemExit(f"the GPU pattern {got} differs from the reference {want}")


class TorchCheck(TorchPattern):
    def __init__(self, device, words: int):
        super().__init__(device, words)
        self.bad = self.torch.zeros((), dtype=self.torch.int64, device=device)
        self.copies = 0

    def check(self, frame, seed: int) -> None:
        t = frame.as_tensor((self.words,), self.torch.int32)  # DLPack on the current stream
        self.copies += t.data_ptr() != frame.ptr
        self.bad += ((t.to(self.torch.int64) & M32) != self.expected(seed)).sum()
        del t  # the capsule's hold goes; the release is ordered after the current stream

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
        self.copies = 0

    def expected(self, seed: int):
        cp = self.cp
        x = self.lo ^ cp.uint32((seed * 2654435761) & M32) ^ self.hi
        x = x ^ (x >> cp.uint32(16))
        x = x * cp.uint32(0x85EBCA6B)
        x = x ^ (x >> cp.uint32(13))
        return x + self.lo

    def self_test(self) -> None:
        at = [0, 1, 2, 12345 % self.words, self.words - 1]
        with self.cp.cuda.Device(self.ordinal):
            for seed in (0, 1, 0xDEADBEEF):
                got = [int(v) for v in self.expected(seed)[at].get()]
                want = [pattern(seed, i) for i in at]
                if got != want:
                    raise SystemExit(f"the GPU pattern {got} differs from the reference {want}")

    def check(self, frame, seed: int) -> None:
        with self.cp.cuda.Device(self.ordinal):
            a = frame.as_cupy((self.words,), self.cp.uint32)
            self.copies += a.data.ptr != frame.ptr
            self.bad += self.cp.count_nonzero(a != self.expected(seed))
            del a

    def mismatches(self) -> int:
        with self.cp.cuda.Device(self.ordinal):
            return int(self.bad.get())


class JaxCheck:
    """The same check in JAX (uint32). JAX assumes arrays are immutable: the array made from a
    frame is used, and finished (``block_until_ready``), before the frame is released, since the
    producer writes the buffer again afterwards."""

    def __init__(self, ordinal: int, words: int):
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp = jax, jnp
        self.dev = [d for d in jax.devices("gpu") if d.id == ordinal][0]
        i = jax.device_put(jnp.arange(words, dtype=jnp.uint32), self.dev)
        self.lo = i  # words < 2**32: the high half is zero
        self.words = words
        self.bad = 0
        self.copies = 0

        def count(a, lo, seed):
            x = lo ^ (seed * jnp.uint32(2654435761))
            x = x ^ (x >> 16)
            x = x * jnp.uint32(0x85EBCA6B)
            x = x ^ (x >> 13)
            return jnp.count_nonzero(a != x + lo)

        self.count = jax.jit(count)

    def self_test(self) -> None:
        pass  # the pattern is checked against every frame; a wrong formula fails every word

    def check(self, frame, seed: int) -> None:
        a = self.jax.dlpack.from_dlpack(frame)  # uint8, the whole buffer
        self.copies += a.unsafe_buffer_pointer() != frame.ptr
        a = self.jax.lax.bitcast_convert_type(a[: self.words * 4].reshape(self.words, 4), self.jnp.uint32)
        n = self.count(a, self.lo, self.jnp.uint32(seed))
        self.bad += int(n.block_until_ready())
        del a

    def mismatches(self) -> int:
        return self.bad


def attach(channel: str, timeout: float, delivery: str) -> "cuda_ipc.Consumer":
    deadline = time.monotonic() + timeout
    while True:
        try:
            return cuda_ipc.Consumer(channel, delivery=delivery)
        except cuda_ipc.ChannelNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def cost(rx, via: str) -> int:
    """Per-frame cost of a successful try_recv, the DLPack export and the release, in ns."""
    torch = None
    if via == "torch":
        import torch
    ns = []
    while True:
        t = time.perf_counter_ns()
        try:
            f = rx.try_recv()
        except cuda_ipc.ChannelClosed:
            break
        if f is None:
            continue
        if torch is not None:
            x = torch.from_dlpack(f)
            del x
        else:
            c = f.__dlpack__(stream=None)
            del c
        f.release()
        ns.append(time.perf_counter_ns() - t)
    if not ns:
        print("python consumer: FAIL no frame received", flush=True)
        return 1
    mean = sum(ns) / len(ns)
    ns.sort()
    at = lambda q: ns[int((len(ns) - 1) * q)]  # noqa: E731
    print(f"python consumer: OK frames={len(ns)} via={via} cost_ns p50={at(0.5)} p90={at(0.9)} "
          f"mean={mean:.0f}", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("channel", nargs="?")
    p.add_argument("--frames", type=int, default=0, help="frames expected (0: any number)")
    p.add_argument("--via", choices=("torch", "cupy", "jax"), default="torch")
    p.add_argument("--delivery", choices=("every", "latest"), default="every")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each frame")
    p.add_argument("--attach-timeout", type=float, default=60.0, help="seconds to wait for the channel")
    p.add_argument("--cost", action="store_true")
    p.add_argument("--cost-via", choices=("capsule", "torch"), default="torch")
    p.add_argument("--print-pattern", type=int, nargs="*", metavar="SEED")
    p.add_argument("--at", type=int, nargs="*", default=[], metavar="INDEX")
    a = p.parse_args()
    if a.print_pattern is not None:
        print(" ".join(str(pattern(s, i)) for s in a.print_pattern for i in a.at))
        return 0
    if not a.channel:
        p.error("a channel name is needed")
    if a.via == "torch" or (a.cost and a.cost_via == "torch"):
        import torch  # noqa: F401
    elif a.via == "cupy":
        import cupy  # noqa: F401
    else:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # not 75% of the GPU
        import jax  # noqa: F401

    with attach(a.channel, a.attach_timeout, a.delivery) as rx:
        print(f"python consumer (pid {os.getpid()}, {a.via}): attached to {a.channel}", flush=True)
        if a.cost:
            return cost(rx, a.cost_via)
        checker = None
        received = out_of_order = bad_shape = 0
        last = None
        lat = []
        start = None
        while True:
            try:
                frame = rx.recv(timeout=a.timeout)
            except cuda_ipc.ChannelClosed:
                break
            ready = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            start = start or time.monotonic()
            with frame:
                index, w, h, stamp = struct.unpack_from("<4Q", frame.metadata)
                lat.append(max(0, ready - stamp))
                if checker is None:
                    words = frame.nbytes // 4
                    ordinal = frame.__dlpack_device__()[1]
                    if a.via == "torch":
                        checker = TorchCheck(torch.device("cuda", ordinal), words)
                    elif a.via == "cupy":
                        checker = CupyCheck(ordinal, words)
                    else:
                        checker = JaxCheck(ordinal, words)
                    checker.self_test()
                if w * h * 4 != frame.nbytes:
                    bad_shape += 1
                if last is not None and (index != last + 1 if a.delivery == "every" else index <= last):
                    out_of_order += 1
                last = index
                checker.check(frame, index & M32)
            received += 1
        bad = checker.mismatches() if checker else 0
        copies = checker.copies if checker else 0
        secs = max(time.monotonic() - (start or time.monotonic()), 1e-9)
        stats = rx.stats()
    lat.sort()

    def pct(q):
        return lat[int((len(lat) - 1) * q)] / 1e3 if lat else 0.0

    missing = max(a.frames - received, 0) if a.frames and a.delivery == "every" else 0
    ok = bad == 0 and copies == 0 and out_of_order == 0 and bad_shape == 0 and received > 0 and missing == 0
    print(
        f"python consumer: {'OK' if ok else 'FAIL'} via={a.via} delivery={a.delivery} frames={received} "
        f"({received / secs:.0f}/s) missing={missing} mismatched_words={bad} copies={copies} "
        f"out_of_order={out_of_order} bad_shape={bad_shape} last_index={last}; hand-off "
        f"publish->received p50 {pct(0.5):.1f} us, p99 {pct(0.99):.1f} us; "
        f"published {stats['published']}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except cuda_ipc.CudaIpcError as e:
        print(f"python consumer: FAIL {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
