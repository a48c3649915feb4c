"""A host-memory channel between two Python processes, no GPU or PyTorch needed: this process is
the producer and starts itself again as the consumer; every frame's bytes are checked.

    python3 host_pipeline.py [--frames 2000] [--bytes 1048576] [--buffers 4]

Prints the producer's and the consumer's frames/s and `OK` (exit status 0), or what went wrong
(exit status 1). Each frame is its number (8 bytes, also its metadata) and one of 16 bodies, made
with NumPy when it is installed, else as plain bytes. The consumer copies every frame out
(`Frame.bytes()`) and compares all of it.
"""

import argparse
import os
import subprocess
import sys
import time

import cuda_ipc

try:
    import numpy as np
except ImportError:  # plain bytes then
    np = None

# The longest one step waits (a frame, the consumer's start, its end).
TIMEOUT = 30.0


# Frame bodies repeat every PATTERNS frames, so both sides make them once, before the clock starts.
PATTERNS = 16


def body(k: int, nbytes: int) -> bytes:
    """Body `k` (0 to PATTERNS - 1) of an `nbytes`-byte frame: what follows its 8-byte number."""
    n = nbytes - 8
    if np is not None:
        return ((np.arange(n, dtype=np.uint32) * 7 + k * 13) & 0xFF).astype(np.uint8).tobytes()
    unit = bytes((j * 7 + k * 13) & 0xFF for j in range(256))
    return (unit * (n // 256 + 1))[:n]


def consume(name: str, frames: int, nbytes: int) -> int:
    """The consumer: receives every frame until the channel closes and checks it."""
    with cuda_ipc.Consumer(name, delivery="every") as rx:
        print("attached", flush=True)
        bodies = [body(k, nbytes) for k in range(PATTERNS)]
        got, t0 = 0, None
        while True:
            try:
                f = rx.recv(timeout=TIMEOUT)
            except cuda_ipc.ChannelClosed:
                break
            with f:
                if t0 is None:
                    t0 = time.perf_counter()
                data = f.bytes()
                head = f.seq.to_bytes(8, "little")
                ok = f.metadata == head and data[:8] == head
                if not ok or data[8:] != bodies[f.seq % PATTERNS]:
                    print(f"consumer: frame {f.seq} has wrong bytes", file=sys.stderr)
                    return 1
                got += 1
        dt = time.perf_counter() - (t0 or time.perf_counter())
    if got != frames:
        print(f"consumer: got {got} frames of {frames}", file=sys.stderr)
        return 1
    rate = f"{(got - 1) / dt:.0f}" if dt > 0 and got > 1 else "-"
    print(f"consumer: {got} frames checked, {rate} frames/s", flush=True)
    return 0


def produce(name: str, frames: int, nbytes: int, buffers: int) -> int:
    """The producer: starts the consumer, publishes `frames` frames, closes and waits for it."""
    with cuda_ipc.Producer(name, nbytes, buffers=buffers, memory="host") as tx:
        child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--consume", name,
             "--frames", str(frames), "--bytes", str(nbytes)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            if child.stdout.readline().strip() != "attached":
                print("producer: the consumer did not start", file=sys.stderr)
                return 1
            bodies = [body(k, nbytes) for k in range(PATTERNS)]
            t0 = time.perf_counter()
            for seq in range(1, frames + 1):
                head = seq.to_bytes(8, "little")
                with tx.acquire(timeout=TIMEOUT) as w:
                    w.write(head)
                    w.write(bodies[seq % PATTERNS], offset=8)
                    w.publish(head)
            dt = time.perf_counter() - t0
            print(f"producer: {frames} frames of {nbytes} bytes, {frames / dt:.0f} frames/s")
            tx.close(timeout=TIMEOUT)
            for line in child.stdout:
                print(line, end="")
            status = child.wait(TIMEOUT)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    if status != 0:
        print(f"producer: the consumer exited with status {status}", file=sys.stderr)
        return 1
    print("OK")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--bytes", type=int, default=1 << 20)
    ap.add_argument("--buffers", type=int, default=4)
    ap.add_argument("--consume", metavar="NAME", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.bytes < 8 or a.frames < 1:
        ap.error("--bytes must be at least 8 and --frames at least 1")
    if a.consume:
        return consume(a.consume, a.frames, a.bytes)
    return produce(f"host-pipeline-{os.getpid()}", a.frames, a.bytes, a.buffers)


if __name__ == "__main__":
    sys.exit(main())
