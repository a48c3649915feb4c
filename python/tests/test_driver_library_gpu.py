"""Which driver library the extension calls, on a machine with a GPU: where a toolkit's stub
`libcuda.so` (every call answers `CUDA_ERROR_STUB_LIBRARY`, 34) comes first on the library search
path, the extension still loads the driver by its soname `libcuda.so.1`, as PyTorch does, and a
tensor set written and read in that process carries its bytes.

The stub is built here with `cc` (a C compiler is needed; without one the test fails and says
so). Without `CUDA_IPC_GPU_TESTS=1` every test is skipped; with it, a machine without PyTorch or
without a GPU fails them. Run: `CUDA_IPC_GPU_TESTS=1 pytest python/tests/test_driver_library_gpu.py`."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

if "gpu_agents" not in sys.modules:
    pytest.register_assert_rewrite("gpu_agents")
from gpu_agents import SHM, cuda, pytestmark  # noqa: E402, F401 - fixtures act where imported

# The stub answers 34 to the calls a first use makes, as a toolkit's stub library does.
STUB_C = textwrap.dedent(
    """
    int cuInit(unsigned int flags) { (void)flags; return 34; }
    int cuDriverGetVersion(int *v) { (void)v; return 34; }
    int cuDeviceGet(int *d, int o) { (void)d; (void)o; return 34; }
    int cuDeviceGetCount(int *n) { (void)n; return 34; }
    int cuCtxGetCurrent(void **c) { (void)c; return 34; }
    int cuDevicePrimaryCtxRetain(void **c, int d) { (void)c; (void)d; return 34; }
    """
)

SCRIPT = textwrap.dedent(
    """
    import os, sys, uuid
    import torch
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    import cuda_ipc
    name = f"pytest-stub-{uuid.uuid4().hex[:10]}"
    w = cuda_ipc.TensorSetWriter(name, {"a": ((1024,), "float32")})
    w.publish({"a": torch.full((1024,), 1.5, device="cuda")}, timeout=10.0)
    r = cuda_ipc.TensorSetReader(name, device=0)
    h = r.current(timeout=10.0)
    total = float(h.tensors()["a"].sum())
    h.release(); r.close(); w.close(timeout=10.0)
    assert total == 1.5 * 1024, total
    maps = {l.split()[-1] for l in open("/proc/self/maps") if "libcuda" in l}
    stub_dir = sys.argv[1]
    assert not any(m.startswith(stub_dir) for m in maps), f"the stub was mapped: {sorted(maps)}"
    print("ok", sorted(maps))
    """
)


def test_a_stub_libcuda_first_on_the_search_path_is_not_the_driver_called(cuda, tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler (cc or gcc) is needed to build the stub driver library"
    src = tmp_path / "stub.c"
    src.write_text(STUB_C)
    stub = tmp_path / "libcuda.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(stub), str(src)], check=True, timeout=60
    )
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{tmp_path}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.strip().startswith("ok"), p.stdout
