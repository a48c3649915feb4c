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
t = Torch("torch")
t.Tensor = type("Tensor", (), {})  # in its dict: read without a lookup
sys.modules["torch"] = t
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
    # A `torch` whose lookups fail: nothing raised, its part not made.
    assert r["out"] == {"device": None, "torch": False}
    assert "from_dlpack" in r["after"]
    assert ("from_dlpack" in r["at_import"]) == (env is None)


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


FAKE_TORCH = r"""
import sys, types
calls = []
def fake(tag, reenter=False):
    t = types.ModuleType("torch")
    class Tensor:
        unbind = narrow = view = contiguous = data_ptr = is_contiguous = None
        get_device = untyped_storage = None
    t.Tensor = Tensor
    def from_dlpack(capsule):
        calls.append(tag)
        raise RuntimeError(tag)
    t.from_dlpack = from_dlpack
    t.as_strided = lambda *a: None
    t._C = types.SimpleNamespace(DisableTorchFunction=object)
    t.cuda = types.SimpleNamespace(is_initialized=lambda: False, current_stream=lambda d: None)
    if reenter:
        def __getattr__(name):
            import cuda_ipc
            calls.append(("reentered", cuda_ipc.warm_up()["torch"]))
            raise AttributeError(name)
        t.__getattr__ = __getattr__
    return t
"""


def run_py(script, env=None, timeout=60):
    import subprocess
    import sys

    e = dict(os.environ)
    e.pop("CUDA_IPC_WARM_UP", None)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", script], env=e, capture_output=True, text=True, timeout=timeout
    )


def test_a_torch_put_in_place_of_another_is_the_one_asked_afterwards():
    p = run_py(
        FAKE_TORCH
        + r"""
import cuda_ipc
sys.modules["torch"] = fake("first")
assert cuda_ipc.warm_up()["torch"] is False  # its from_dlpack raised: left to a real use
sys.modules["torch"] = fake("second")
cuda_ipc.warm_up()
print(calls)
"""
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "['first', 'second']"


def test_a_torch_whose_lookups_call_back_into_warm_up_neither_hangs_nor_raises():
    p = run_py(
        FAKE_TORCH
        + r"""
import cuda_ipc
sys.modules["torch"] = fake("outer", reenter=True)
print(cuda_ipc.warm_up()["torch"], calls)
""",
        timeout=30,
    )
    assert p.returncode == 0, p.stderr
    # The inner call found the outer one making PyTorch's table and gave up on its own part.
    assert "('reentered', False)" in p.stdout


def test_keyboard_interrupt_and_system_exit_in_torchs_calls_reach_the_caller():
    p = run_py(
        FAKE_TORCH
        + r"""
import cuda_ipc
t = fake("x")
def stop(capsule):
    raise SystemExit(7)
t.from_dlpack = stop
sys.modules["torch"] = t
cuda_ipc.warm_up()
print("not reached")
"""
    )
    assert p.returncode == 7, (p.returncode, p.stdout, p.stderr)
    assert "not reached" not in p.stdout


LAZY_TORCH = r"""
import importlib.util, os, sys, tempfile, time
d = tempfile.mkdtemp()
os.makedirs(os.path.join(d, "torch"))
with open(os.path.join(d, "torch", "__init__.py"), "w") as f:
    f.write("import sys\nsys.modules['__main__'].LOADED = True\nclass Tensor: pass\n")
sys.path.insert(0, d)
LOADED = False
spec = importlib.util.find_spec("torch")
loader = importlib.util.LazyLoader(spec.loader)
spec.loader = loader
module = importlib.util.module_from_spec(spec)
sys.modules["torch"] = module
loader.exec_module(module)
import cuda_ipc
out = cuda_ipc.warm_up()
print(LOADED, out["torch"])
"""


def test_a_lazily_loaded_torch_is_not_loaded_by_the_import_or_warm_up():
    p = run_py(LAZY_TORCH)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False False"


@pytest.mark.parametrize("value", ["false", " OFF ", "No"])
def test_the_warm_up_at_import_is_turned_off_by_the_usual_words(value):
    import json

    p = run_py(WARM_PROBE, env={"CUDA_IPC_WARM_UP": value})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["at_import"] == []
