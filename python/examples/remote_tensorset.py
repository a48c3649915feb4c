#!/usr/bin/env python3
"""The trainer -> far engines shape across hosts: a trainer publishes its weights as a tensor set,
`cuda-ipc bridge send --tensorset` mirrors each new generation over NVIDIA NIXL to
`cuda-ipc bridge recv --tensorset` on the engines' host, and the engines read the far set with
the ordinary `cuda_ipc.TensorSetReader`.

    python3 python/examples/remote_tensorset.py [--generations 20] [--engines 2] \
        [--changed-only] [--cuda-ipc PATH]

Here both hosts are this machine (the bridges talk over loopback TCP; host-memory sets, no GPU
needed); across hosts, run the `recv` command on the engines' host with `--listen ADDR:PORT` and
the `send` command beside the trainer with `--connect ADDR:PORT`, the same secret file (mode
0600) on both. Every tensor of generation g is filled from g, so an engine that saw a mix of two
generations would fail its check. Exit status 0 when every engine checked every generation it
took, byte for byte. Needs the `cuda-ipc` command built with the `remote` feature and NIXL's
libraries on LD_LIBRARY_PATH (see the README's remote lane section).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import cuda_ipc

LAYERS = 6
SPECS = {}
for _l in range(LAYERS):
    SPECS[f"layers.{_l}.w"] = ((256, 128), "bfloat16")
    SPECS[f"layers.{_l}.b"] = ((128,), "float32")
SIZES = {n: (s[0] * s[1] * 2 if len(s) == 2 else s[0] * 4) for n, (s, _) in SPECS.items()}


def fill(g: int, name: str, n: int, changed: bool) -> bytes:
    """Tensor `name` in generation g: every byte (g * 7 + layer) & 255; with changed-only, layer
    g % LAYERS changes in generation g and the others keep their last value."""
    layer = int(name.split(".")[1])
    v = g
    if changed and g > 1:
        v = next((x for x in range(g, 1, -1) if x % LAYERS == layer), 1)
    return bytes([(v * 7 + layer) & 0xFF]) * n


ENGINE = """
import sys, time, cuda_ipc
far, changed, layers = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
sizes = eval(sys.argv[4])
def fill(g, name, n):
    layer = int(name.split(".")[1])
    v = g
    if changed and g > 1:
        v = next((x for x in range(g, 1, -1) if x % layers == layer), 1)
    return bytes([(v * 7 + layer) & 0xFF]) * n
def open_far(within):
    # The far set, once the receiving bridge has made it; None after `within` seconds.
    deadline = time.time() + within
    while True:
        try:
            return cuda_ipc.TensorSetReader(far)
        except (cuda_ipc.TensorSetNotFound, cuda_ipc.WriterGone, cuda_ipc.NoServer):
            if time.time() > deadline:
                return None
            time.sleep(0.05)
r = open_far(60)
assert r is not None, "no far set within 60 s"
seen, checked = 0, 0
while True:
    try:
        h = r.wait_newer(seen, timeout=60.0)
    except cuda_ipc.TensorSetClosed:  # the trainer closed its set: done
        break
    except cuda_ipc.WriterGone:
        # The receiving bridge died (what this engine held stayed whole): a restarted one makes
        # the set again, numbering its generations anew.
        r.close()
        r = open_far(10)
        if r is None:
            break
        seen = 0
        continue
    with h:
        seen = h.generation
        g = int(h.read("gen")[0]) | int(h.read("gen")[1]) << 8
        for name, n in sizes.items():
            if h.read(name) != fill(g, name, n):
                print(f"MIX or bad bytes in far generation {seen} (near {g}), tensor {name}", flush=True)
                sys.exit(1)
        checked += 1
print(f"engine checked {checked} generations, every byte", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generations", type=int, default=20)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--changed-only", action="store_true")
    ap.add_argument("--cuda-ipc", default="cuda-ipc", help="the cuda-ipc command (feature remote)")
    a = ap.parse_args()
    specs = dict(SPECS)
    specs["gen"] = ((2,), "uint8")
    near = f"example-trainer-{os.getpid()}"
    far = f"example-engines-{os.getpid()}"
    listen = f"127.0.0.1:{free_port()}"
    env = dict(os.environ)
    env.setdefault("UCX_TLS", "tcp,self,cuda_copy")
    with tempfile.TemporaryDirectory() as d:
        secret = os.path.join(d, "secret")
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32).hex().encode())
        os.close(fd)
        w = cuda_ipc.TensorSetWriter(near, specs, memory="host", mode="buffered", buffers=2)
        recv = subprocess.Popen(
            [a.cuda_ipc, "bridge", "recv", "--tensorset", far, "--listen", listen,
             "--secret-file", secret], env=env)
        send_args = [a.cuda_ipc, "bridge", "send", "--tensorset", near, "--connect", listen,
                     "--secret-file", secret]
        if a.changed_only:
            send_args.append("--changed-only")
        send = subprocess.Popen(send_args, env=env)
        engines = [
            subprocess.Popen([sys.executable, "-c", textwrap.dedent(ENGINE), far,
                              "1" if a.changed_only else "0", str(LAYERS), repr(SIZES)])
            for _ in range(a.engines)
        ]
        # The far set exists once the bridges met: the trainer's steps start then.
        deadline = time.time() + 60
        while not os.path.exists(f"/dev/shm/cuda-ipc.ts.{far}"):
            if time.time() > deadline:
                raise SystemExit("the bridges did not meet")
            time.sleep(0.05)
        for g in range(1, a.generations + 1):
            with w.begin(timeout=60.0) as u:
                for name, n in SIZES.items():
                    u.write(name, fill(g, name, n, a.changed_only))
                u.write("gen", bytes([g & 0xFF, g >> 8]))
            time.sleep(0.05)
        time.sleep(1.0)
        w.close()  # the sending bridge tells the receiving one, which closes the far set
        ok = all(e.wait(60) == 0 for e in engines)
        ok = send.wait(60) == 0 and ok
        ok = recv.wait(60) == 0 and ok
    print("trainer:", a.generations, "generations;", "every engine checked its bytes" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
