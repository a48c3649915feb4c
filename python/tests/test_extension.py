"""The `cuda_ipc` extension without a GPU: import, the exception hierarchy, argument checks, and
the errors of attaching to missing, badly named or garbage channels (all found before any CUDA
call). Run: `pip install ./python && pytest python/tests`."""

import os
import pathlib
import stat
import uuid

import pytest

import cuda_ipc

HERE = pathlib.Path(__file__).resolve().parent
SHM = pathlib.Path("/dev/shm")


def cuda_present() -> bool:
    """True when the CUDA driver library can be loaded (then the no-driver tests are skipped)."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.fixture
def name():
    """A fresh channel name; its segment is removed afterwards."""
    n = f"pytest-{uuid.uuid4().hex[:12]}"
    yield n
    p = SHM / f"cuda-ipc.ch.{n}"
    if p.is_dir() and not p.is_symlink():
        p.rmdir()
    elif p.exists() or p.is_symlink():
        p.unlink()


def test_the_module_imports_with_its_classes():
    for cls in ("Producer", "Consumer", "Frame", "WriteFrame"):
        assert isinstance(getattr(cuda_ipc, cls), type)
    assert cuda_ipc.META_BYTES == 256
    assert cuda_ipc.__version__


ERRORS = [
    "ChannelNotFound", "ChannelExists", "BadSegment", "InvalidToken", "NotSupported",
    "FdNotOffered", "FdPassingError", "NoConsumerSlot", "ProducerGone", "ChannelClosed",
    "Detached", "Superseded", "Timeout", "AtomicsUnavailable", "CudaUnavailable", "CudaError",
    "InvalidArgument", "OsError",
]


@pytest.mark.parametrize("cls", ERRORS)
def test_every_error_is_a_cuda_ipc_error(cls):
    assert issubclass(getattr(cuda_ipc, cls), cuda_ipc.CudaIpcError)
    assert issubclass(cuda_ipc.CudaIpcError, Exception)


def test_timeout_invalid_argument_and_os_error_are_also_builtin_errors():
    assert issubclass(cuda_ipc.Timeout, TimeoutError)
    assert issubclass(cuda_ipc.InvalidArgument, ValueError)
    assert issubclass(cuda_ipc.OsError, OSError)


@pytest.mark.skipif(cuda_present(), reason="a CUDA driver is installed here")
def test_a_gpu_producer_without_a_driver_raises_cuda_unavailable(name):
    with pytest.raises(cuda_ipc.CudaUnavailable, match="CUDA driver not found"):
        cuda_ipc.Producer(name, 1 << 20)
    assert not (SHM / f"cuda-ipc.ch.{name}").exists()


@pytest.mark.parametrize("bad", ["bad/name", "", "x" * 300, "sp ace", "../up"])
def test_bad_channel_names_raise_invalid_argument(bad):
    with pytest.raises(cuda_ipc.InvalidArgument, match="name"):
        cuda_ipc.Consumer(bad)


def test_attaching_to_a_missing_channel_raises_channel_not_found(name):
    with pytest.raises(cuda_ipc.ChannelNotFound) as e:
        cuda_ipc.Consumer.attach(name)
    assert str(e.value) == f'no channel named "{name}" (start its producer first)'


def garbage(path: pathlib.Path, data: bytes):
    path.write_bytes(data)
    path.chmod(0o600)


@pytest.mark.parametrize(
    "what, make, message",
    [
        ("foreign bytes", lambda p: garbage(p, b"x" * 8192), "not a cuda-ipc channel"),
        ("an empty file", lambda p: garbage(p, b""), "empty"),
        ("a short file", lambda p: garbage(p, b"\0" * 16), None),
        ("a directory", lambda p: p.mkdir(mode=0o700), "directory"),
        ("a FIFO", lambda p: os.mkfifo(p, 0o600), "FIFO"),
        ("a symbolic link", lambda p: p.symlink_to("/dev/null"), "symbolic link"),
        (
            "a file others may write",
            lambda p: (garbage(p, b"x" * 8192), p.chmod(0o666)),
            "mode 0o666, open to other users",
        ),
        (
            "a file others may read",
            lambda p: (garbage(p, b"x" * 8192), p.chmod(0o604)),
            "mode 0o604, open to other users",
        ),
    ],
)
def test_garbage_under_a_channel_name_raises_bad_segment(name, what, make, message):
    path = SHM / f"cuda-ipc.ch.{name}"
    make(path)
    with pytest.raises(cuda_ipc.BadSegment, match=message) as e:
        cuda_ipc.Consumer(name)
    # What stands there, not the caller's argument: a link was "invalid argument: ...".
    assert "invalid argument" not in str(e.value), str(e.value)
    # Refused, never removed or changed.
    assert path.exists() or path.is_symlink(), what
    if stat.S_ISREG(path.lstat().st_mode) and path.stat().st_size == 8192:
        assert path.read_bytes() == b"x" * 8192
    if what.startswith("a file others may"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o007, "its mode left as it was"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"delivery": "sometimes"}, "delivery"),
        ({"wait": "nap"}, "wait"),
        ({"wait": "spin_then_block", "spin": -1.0}, "spin"),
    ],
)
def test_bad_consumer_options_raise_invalid_argument(name, kwargs, message):
    with pytest.raises(cuda_ipc.InvalidArgument, match=message):
        cuda_ipc.Consumer(name, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"memory": "paper"}, "memory"), ({"wait": "nap"}, "wait")],
)
def test_bad_producer_options_raise_invalid_argument(name, kwargs, message):
    with pytest.raises(cuda_ipc.InvalidArgument, match=message):
        cuda_ipc.Producer(name, 1024, **kwargs)


def test_options_are_keyword_only(name):
    with pytest.raises(TypeError):
        cuda_ipc.Consumer(name, "latest")
    with pytest.raises(TypeError):
        cuda_ipc.Producer(name, 1024, 4)


def test_the_stubs_name_what_the_module_has():
    stub = (HERE.parent / "cuda_ipc.pyi").read_text()
    public = [n for n in dir(cuda_ipc) if not n.startswith("_") and n != "cuda_ipc"]
    missing = [
        n
        for n in public
        if f"class {n}" not in stub and f"{n}:" not in stub and f"def {n}(" not in stub
    ]
    assert missing == []



def test_warm_up_without_a_driver_in_the_process_prepares_no_device():
    maps = pathlib.Path("/proc/self/maps").read_text()
    out = cuda_ipc.warm_up()
    assert set(out) == {"device", "torch"}
    if "libcuda" not in maps:
        assert out["device"] is None
    torch = __import__("sys").modules.get("torch")
    assert out["torch"] == (torch is not None and hasattr(torch, "Tensor"))
    # Nothing it did loaded the driver.
    assert ("libcuda" in pathlib.Path("/proc/self/maps").read_text()) == ("libcuda" in maps)


WARM_PROBE = r"""
import json, sys, types
seen = []
class Torch(types.ModuleType):
    def __getattr__(self, n):
        seen.append(n)
        raise AttributeError(n)
sys.modules["torch"] = Torch("torch")
import cuda_ipc
at_import = list(seen)
out = cuda_ipc.warm_up()
print(json.dumps({"at_import": at_import, "out": out, "after": seen}))
"""


@pytest.mark.parametrize("env", [None, "0"])
def test_the_import_warms_up_unless_told_not_to_and_a_broken_torch_raises_nothing(env):
    import json
    import subprocess
    import sys

    e = dict(os.environ)
    e.pop("CUDA_IPC_WARM_UP", None)
    if env is not None:
        e["CUDA_IPC_WARM_UP"] = env
    p = subprocess.run(
        [sys.executable, "-c", WARM_PROBE], env=e, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    # A `torch` without `Tensor` (being imported, or not PyTorch) is left alone: no calls made.
    assert r["out"] == {"device": None, "torch": False}
    assert r["after"].count("Tensor") >= 1
    assert ("Tensor" in r["at_import"]) == (env is None)


BROKEN_TORCH = r"""
import sys, types
t = types.ModuleType("torch")
class Tensor: pass
t.Tensor = Tensor
def boom(*a, **k): raise RuntimeError("broken torch")
t.from_dlpack = t.as_strided = boom
sys.modules["torch"] = t
import cuda_ipc
out = cuda_ipc.warm_up()
assert out == {"device": None, "torch": False}, out
print("ok")
"""


def test_a_torch_whose_calls_fail_leaves_the_import_and_warm_up_without_an_error():
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-c", BROKEN_TORCH], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"
