"""`warm_up()` and its run at import in a process with PyTorch and a GPU: it never initialises
CUDA or loads the driver where the process did not (a child forked afterwards uses CUDA), it
prepares the device whose context is current once PyTorch made it, and a tensor set attached
after it reads what was written. `tensors()` orders its reads after the generation on the
calling thread's current PyTorch stream (asked of PyTorch without making a `torch.cuda.Stream`).

Without `CUDA_IPC_GPU_TESTS=1` every test is skipped; with it, a machine without PyTorch or
without a GPU fails them. Run: `CUDA_IPC_GPU_TESTS=1 pytest python/tests/test_warm_up_gpu.py`."""

import subprocess
import sys
import textwrap

import pytest

if "gpu_agents" not in sys.modules:
    pytest.register_assert_rewrite("gpu_agents")
from gpu_agents import SHM, cuda, pytestmark  # noqa: E402, F401 - fixtures act where imported

SCRIPT = textwrap.dedent(
    """
    import os, pathlib, uuid
    import torch
    def cuda_mapped():
        return "libcuda" in pathlib.Path("/proc/self/maps").read_text()
    before = cuda_mapped()
    import cuda_ipc
    assert not torch.cuda.is_initialized(), "the import initialised CUDA"
    assert cuda_mapped() == before, "the import loaded the driver"
    out = cuda_ipc.warm_up()
    assert out == {"device": None, "torch": True}, out
    assert not torch.cuda.is_initialized()
    # A child forked now may use CUDA: nothing initialised it in the parent.
    pid = os.fork()
    if pid == 0:
        try:
            x = torch.ones(4, device="cuda").sum().item()
            os._exit(0 if x == 4.0 else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    out = cuda_ipc.warm_up()
    assert out == {"device": 0, "torch": True}, out
    assert cuda_ipc.warm_up() == out  # again: the same, nothing left half done
    name = f"pytest-warm-{uuid.uuid4().hex[:10]}"
    w = cuda_ipc.TensorSetWriter(name, {"a": ((3, 5), "bfloat16"), "b": ((7,), "bool")})
    w.publish({"a": torch.full((3, 5), 2.5, dtype=torch.bfloat16, device="cuda"),
               "b": torch.ones(7, dtype=torch.bool, device="cuda")}, timeout=10.0)
    r = cuda_ipc.TensorSetReader(name, device=0)
    h = r.current(timeout=10.0)
    d = h.tensors()
    assert float(d["a"].float().sum()) == 2.5 * 15 and int(d["b"].sum()) == 7
    h.release(); del d; r.close(); w.close(timeout=10.0)
    print("ok")
    """
)


def test_warm_up_initialises_nothing_and_prepares_the_current_device_once_torch_made_it(cuda):
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.strip().endswith("ok")


def test_the_import_after_torch_made_its_context_prepares_it(cuda):
    script = textwrap.dedent(
        """
        import torch
        torch.zeros(1, device="cuda"); torch.cuda.synchronize()
        import cuda_ipc
        print(cuda_ipc.warm_up())
        """
    )
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.strip() == "{'device': 0, 'torch': True}"


def test_tensors_wait_for_the_generation_on_the_current_stream_of_the_caller(cuda):
    import uuid

    import cuda_ipc

    torch = cuda
    name = f"pytest-warm-{uuid.uuid4().hex[:10]}"
    n = 1 << 20
    with cuda_ipc.TensorSetWriter(name, {"a": ((n,), "float32")}) as w:
        r = cuda_ipc.TensorSetReader(name, device=0)
        try:
            for value in (3.0, 5.0):
                with w.begin(timeout=10.0) as u:
                    # The writer's stream is busy for about 0.1 s before it writes: a read not
                    # made to wait for the generation would see the old bytes.
                    torch.cuda._sleep(200_000_000)
                    u.tensors()["a"].fill_(value)
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    h = r.current(timeout=10.0)
                    total = h.tensors()["a"].sum()
                    h.release()
                s.synchronize()
                assert float(total) == value * n
        finally:
            r.close()
