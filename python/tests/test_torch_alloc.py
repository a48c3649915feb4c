"""PyTorch's pluggable allocator of the `cuda_ipc` extension without a GPU: the C functions are
exported by the extension's shared object and safe to call (null, a line on stderr, no crash), and
the Python helpers raise clear errors. The GPU side (a model built in `torch_mem_pool()`) runs on a
GPU machine (python/examples and the tensor-set tests). Run: `pip install ./python && pytest
python/tests`."""

import ctypes
import subprocess
import sys

import pytest

import cuda_ipc

from test_extension import cuda_present


def extension_path() -> str:
    """The extension module's own file (the shared object), as `torch_mem_pool` passes it."""
    mod = getattr(cuda_ipc, "cuda_ipc", cuda_ipc)
    path = mod.__file__
    assert path.endswith(".so"), path
    return path


def allocator():
    lib = ctypes.CDLL(extension_path())
    malloc = lib.cuda_ipc_torch_malloc
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free = lib.cuda_ipc_torch_free
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return malloc, free


def test_the_helpers_exist():
    for f in ("torch_mem_pool", "arena_locate", "arena_stats"):
        assert callable(getattr(cuda_ipc, f))


def test_the_shared_object_exports_the_allocator_functions():
    malloc, free = allocator()
    # Size 0 and a null free do nothing, with or without a driver.
    assert malloc(0, 0, None) is None
    free(None, 0, 0, None)


def test_an_address_outside_every_arena_is_an_invalid_argument():
    with pytest.raises(cuda_ipc.InvalidArgument, match="not in a cuda_ipc arena"):
        cuda_ipc.arena_locate(0x1234_5000, 64)


@pytest.mark.skipif(cuda_present(), reason="a CUDA driver is installed here")
def test_without_a_driver_the_helpers_raise_cuda_unavailable():
    with pytest.raises(cuda_ipc.CudaUnavailable, match="CUDA driver not found"):
        cuda_ipc.arena_stats()
    with pytest.raises(cuda_ipc.CudaUnavailable, match="CUDA driver not found"):
        cuda_ipc.torch_mem_pool(0)
    with pytest.raises(cuda_ipc.InvalidArgument, match="chunk_bytes"):
        cuda_ipc.torch_mem_pool(0, chunk_bytes=0)


@pytest.mark.skipif(cuda_present(), reason="a CUDA driver is installed here")
def test_without_a_driver_malloc_returns_null_and_free_of_garbage_logs_a_line():
    # In a child, so its stderr is ours to read.
    code = (
        "import sys; sys.path[:0] = %r\n"
        "from test_torch_alloc import allocator\n"
        "m, f = allocator()\n"
        "assert m(1 << 20, 0, None) is None\n"
        "assert m(-5, 0, None) is None\n"
        "f(0xdead0000, 4096, 0, None)\n"
        "f(0xdead0000, 4096, -3, None)\n"
        "print('survived')\n"
    ) % (sys.path,)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        cwd=__import__("os").path.dirname(__file__),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "survived"
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("cuda_ipc torch allocator:")]
    assert len(lines) == 4, r.stderr
    assert "cuda_ipc_torch_malloc(1048576 bytes, device 0) failed" in lines[0]
    assert "CUDA driver not found" in lines[0]
    assert "size -5" in lines[1]
    assert "cuda_ipc_torch_free(0xdead0000, 4096 bytes, device 0) failed" in lines[2]
    assert "has no arena" in lines[3]
