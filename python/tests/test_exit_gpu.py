"""The interpreter's exit with a hold of the process's own still out, on GPU sets and channels.

A writer (a producer) kept in module globals is collected at the exit before the reader (the
consumer) whose hold it would wait for; no thread of the process releases that hold any more, so
the collected writer waits for other processes' holds only (`close_at_exit`): the exit takes well
under the 5 s a drop waits for holds, nothing of the set (the channel) is left in /dev/shm, and the
process ends with status 0. On a GPU set the close also skips the own reader's release words,
which its stream never writes. The host forms are test_exit_host.py's.

Without `CUDA_IPC_GPU_TESTS=1` every test is skipped; with it, a machine without PyTorch or
without a GPU fails them. Run: `CUDA_IPC_GPU_TESTS=1 pytest python/tests/test_exit_gpu.py`."""

import subprocess
import sys
import textwrap
import time
import uuid

import pytest

if "gpu_agents" not in sys.modules:
    pytest.register_assert_rewrite("gpu_agents")
from gpu_agents import SHM, cuda, pytestmark  # noqa: E402, F401 - fixtures act where imported

OWN_HOLD = {
    "set": """
        import torch
        w = cuda_ipc.TensorSetWriter(name, {"a": ((1 << 20,), "float32")})
        w.publish({"a": torch.ones(1 << 20, device="cuda")}, timeout=10.0)
        r = cuda_ipc.TensorSetReader(name)
        h = r.current(timeout=10.0)
        total = float(h.tensors()["a"].sum())
        assert total == float(1 << 20), total
    """,
    "channel": """
        import torch
        tx = cuda_ipc.Producer(name, 1 << 20)
        rx = cuda_ipc.Consumer(name)
        f = tx.acquire(timeout=10.0)
        torch.from_dlpack(f).fill_(7)
        f.publish()
        fr = rx.recv(timeout=10.0)
        assert int(torch.from_dlpack(fr)[0]) == 7
    """,
}


@pytest.mark.parametrize("kind", sorted(OWN_HOLD))
def test_a_gpu_writer_collected_at_exit_does_not_wait_for_its_own_processs_hold(cuda, kind):
    name = f"pytest-exitgpu-{uuid.uuid4().hex[:12]}"
    src = "import sys, cuda_ipc\nname = sys.argv[1]\n" + textwrap.dedent(OWN_HOLD[kind])
    src += 'print("main returns", flush=True)\n'
    child = subprocess.Popen(
        [sys.executable, "-c", src, name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = child.stdout.readline()
        assert "main returns" in line, (line, child.stderr.read())
        t0 = time.monotonic()
        assert child.wait(timeout=60) == 0, child.stderr.read()
        took = time.monotonic() - t0
    finally:
        if child.poll() is None:
            child.kill()
    left = list(SHM.glob(f"cuda-ipc.*{name}*"))
    for p in left:
        p.unlink(missing_ok=True)
    assert took < 4.0, f"the exit took {took:.2f} s"
    assert not left, left
