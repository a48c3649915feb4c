"""kill -9 of a Python producer: the Python consumer gets ``ProducerGone`` within 1 s. Needs a GPU.

    python3 python/examples/extension_kill.py [--memory auto|legacy|vmm|pool] [--rounds 3]

Each round starts a PyTorch producer process that publishes frames as fast as it can (every one
filled through DLPack), receives 100 of them here (checked), then sends the producer SIGKILL and
times how long the next ``recv`` takes to raise ``ProducerGone``. Prints one line per round and
exits non-zero when any round took 1 s or more, raised something else, or saw a bad frame.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

import cuda_ipc

NBYTES = 1 << 20


def producer(name, memory):
    import torch

    with cuda_ipc.Producer(name, NBYTES, buffers=4, memory=memory) as p:
        print("ready", flush=True)
        i = 0
        while True:
            f = p.acquire(timeout=60)
            f.as_tensor().fill_(i % 251)
            f.publish(bytes([i % 251]))
            i += 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--producer", metavar="NAME")
    a = ap.parse_args()
    if a.producer:
        producer(a.producer, a.memory)
        return 0
    import torch

    worst = 0.0
    ok = True
    for r in range(a.rounds):
        name = f"pykill-{os.getpid()}-{r}"
        child = subprocess.Popen([sys.executable, __file__, "--producer", name, "--memory", a.memory],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        bad = 0
        with cuda_ipc.Consumer(name) as rx:
            for _ in range(100):
                with rx.recv(timeout=30) as f:
                    bad += int((f.as_tensor() != f.metadata[0]).sum().item())
            child.send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
            child.wait(timeout=10)
            outcome = None
            try:
                while True:  # frames already published may still come
                    rx.recv(timeout=5).release()
            except cuda_ipc.ProducerGone as e:
                outcome = f"ProducerGone ({e})"
            except Exception as e:  # noqa: BLE001
                outcome = f"{type(e).__name__}: {e}"
                ok = False
            dt = time.monotonic() - t_kill
        worst = max(worst, dt)
        ok = ok and bad == 0 and dt < 1.0
        print(f"round {r} memory={a.memory}: bad_bytes={bad}, after SIGKILL {dt * 1e3:.0f} ms: {outcome}",
              flush=True)
    print(f"kill test memory={a.memory}: {'OK' if ok else 'FAIL'} worst {worst * 1e3:.0f} ms", flush=True)
    del torch
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
