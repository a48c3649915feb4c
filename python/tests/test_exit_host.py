"""The interpreter's exit while daemon threads are inside the module's blocking calls, no GPU.

CPython before 3.14 ends a thread that comes back from a call made without the GIL after
finalization began (`pthread_exit`, a forced unwind through the module's frames; PyO3 parks the
thread for good in the first of them). The module must let that unwind through: a wheel that
carried its own unwinder in place of the system's `libgcc_s.so.1` crashed the process with
SIGSEGV at exit, in every run of the loops below (python/build.rs says why). Each case runs a
fresh interpreter whose main thread returns while 4 daemon threads wait or loop in one kind of
call; the process must end with status 0 and no fatal error, 3 times in a row.
Run: `pip install ./python && pytest python/tests/test_exit_host.py`."""

import pathlib
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

SHM = pathlib.Path("/dev/shm")

# The objects each child makes and the call its daemon threads are in when the main thread returns.
SETUP = {
    "set": """
        w = cuda_ipc.TensorSetWriter(name, {"a": ((256,), "float32")}, memory="host")
        with w.begin(timeout=5.0):
            pass
        r = cuda_ipc.TensorSetReader(name)
    """,
    "channel": """
        tx = cuda_ipc.Producer(name, 64, buffers=1, memory="host")
        rx = cuda_ipc.Consumer(name)
    """,
}
CALLS = {
    # Loops that come back into the interpreter thousands of times a second.
    "current_and_release": ("set", "while True:\n    r.current(timeout=1.0).release()"),
    "wait_newer_timing_out": ("set", "while True:\n    r.wait_newer(1, timeout=0.001)"),
    "recv_timing_out": ("channel", "while True:\n    rx.recv(timeout=0.001)"),
    # Waits that are still waiting at the exit.
    "wait_newer": ("set", "r.wait_newer(1, timeout=30.0)"),
    "recv": ("channel", "rx.recv(timeout=30.0)"),
}

CHILD = """
import sys, threading, time
import cuda_ipc
name = sys.argv[1]
{setup}
def body():
    try:
{call}
    except Exception as e:  # a documented error ends the thread; the exit is what is tested
        print("thread ended:", type(e).__name__, e, flush=True)
for _ in range(4):
    threading.Thread(target=body, daemon=True).start()
time.sleep(0.3)
print("main returns", flush=True)
"""


@pytest.fixture
def name():
    """A fresh name, and the pids of the children that used it: the daemon threads' objects are
    never closed (their interpreter ended under them), so what they leave (the set's or channel's
    segments, each child's liveness file) is a dead process's, which `cuda-ipc gc` would remove;
    removed here."""
    n = f"pytest-exit-{uuid.uuid4().hex[:12]}"
    pids = []
    yield n, pids
    for p in SHM.glob(f"cuda-ipc.*{n}*"):
        p.unlink(missing_ok=True)
    for pid in pids:
        for p in SHM.glob(f"cuda-ipc.live.*.{pid}.*"):
            p.unlink(missing_ok=True)


@pytest.mark.parametrize("case", sorted(CALLS))
def test_the_interpreter_exits_cleanly_with_daemon_threads_inside_blocking_calls(name, case):
    name, pids = name
    kind, call = CALLS[case]
    src = CHILD.format(
        setup=textwrap.dedent(SETUP[kind]),
        call=textwrap.indent(call, " " * 8),
    )
    for run in range(3):
        child = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-c", src, f"{name}-{run}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        pids.append(child.pid)
        try:
            out, err = child.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
            pytest.fail(f"run {run}: the child did not exit within 60 s: {out} {err}")
        assert child.returncode == 0, (run, child.returncode, out, err)
        assert "main returns" in out, (run, out, err)
        assert "Fatal Python error" not in err, (run, err)


# A writer (a producer) whose own process still holds a generation (a frame) when the
# interpreter exits, kept in module globals that finalization collects writer first.
OWN_HOLD = {
    "set": SETUP["set"].rstrip(" ") + "        h = r.current(timeout=5.0)\n",
    "channel": """
        tx = cuda_ipc.Producer(name, 64, buffers=2, memory="host")
        rx = cuda_ipc.Consumer(name)
        f = tx.acquire(timeout=5.0)
        f.write(b"x" * 64)
        f.publish()
        fr = rx.recv(timeout=5.0)
    """,
}


def exit_seconds(child: subprocess.Popen) -> float:
    """Seconds from the child's "main returns" line to its exit (status 0 asserted)."""
    line = child.stdout.readline()
    assert "main returns" in line, (line, child.stderr.read())
    t0 = time.monotonic()
    assert child.wait(timeout=60) == 0, child.stderr.read()
    return time.monotonic() - t0


@pytest.mark.parametrize("kind", sorted(OWN_HOLD))
def test_an_exit_does_not_wait_for_the_processs_own_holds(name, kind):
    """Collected at the exit, the writer (the producer) waits for no hold of its own process,
    whose threads release nothing any more: the exit does not take the 5 s a drop waits for
    holds, and the set (the channel) is gone from /dev/shm, its segments unlinked."""
    name, pids = name
    src = "import sys, cuda_ipc\nname = sys.argv[1]\n" + textwrap.dedent(OWN_HOLD[kind])
    src += 'print("main returns", flush=True)\n'
    child = subprocess.Popen(
        [sys.executable, "-c", src, name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pids.append(child.pid)
    took = exit_seconds(child)
    assert took < 4.0, f"the exit took {took:.2f} s"
    assert not list(SHM.glob(f"cuda-ipc.*{name}*")), list(SHM.glob(f"cuda-ipc.*{name}*"))


def writers_waiting_to_exit(names, pids) -> subprocess.Popen:
    """A child with a host set of each of `names` (tensor "a": `bytes(range(256)) * 4`), ready;
    its main thread returns once a line comes on its stdin."""
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, cuda_ipc
            ws = []
            for n in sys.argv[1:]:
                w = cuda_ipc.TensorSetWriter(n, {"a": ((256,), "float32")}, memory="host")
                with w.begin(timeout=5.0) as u:
                    u.write("a", bytes(range(256)) * 4)
                ws.append(w)
            print("ready", flush=True)
            sys.stdin.readline()
            print("main returns", flush=True)
        """), *names],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    pids.append(writer.pid)
    assert writer.stdout.readline().strip() == "ready", writer.stderr.read()
    return writer


def test_an_exit_still_waits_for_another_processs_hold(name):
    """Another process's hold is waited for at the exit (up to 5 s): its reader keeps reading
    the generation it holds until it releases it, and the writer's exit ends after that."""
    name, pids = name
    writer = writers_waiting_to_exit([name], pids)
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, time, cuda_ipc
            r = cuda_ipc.TensorSetReader(sys.argv[1])
            with r.current(timeout=5.0) as h:
                print("held", flush=True)
                time.sleep(1.5)
                assert h.read("a") == bytes(range(256)) * 4
            r.close()
            print("released", flush=True)
        """), name],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    pids.append(reader.pid)
    assert reader.stdout.readline().strip() == "held", reader.stderr.read()
    writer.stdin.write("\n")
    writer.stdin.flush()
    took = exit_seconds(writer)
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0 and "released" in out, (out, err)
    assert 0.8 < took < 4.5, f"the writer's exit took {took:.2f} s"


def test_an_exit_with_a_daemon_thread_alive_closes_the_writers_and_producers_left_open(name):
    """While any daemon thread runs at the exit (one in `time.sleep` is enough), CPython does not
    collect module globals: their writers and producers were never closed, and their segments
    stayed in /dev/shm for `cuda-ipc gc`. The module's `atexit` hook closes every writer and
    producer still open and idle; a reader's and a consumer's hold of this process does not keep
    it waiting."""
    name, pids = name
    src = textwrap.dedent("""
        import sys, threading, time, cuda_ipc
        name = sys.argv[1]
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        w = cuda_ipc.TensorSetWriter(name + "-set", {"a": ((256,), "float32")}, memory="host")
        with w.begin(timeout=5.0):
            pass
        r = cuda_ipc.TensorSetReader(name + "-set")
        h = r.current(timeout=5.0)
        tx = cuda_ipc.Producer(name + "-ch", 64, buffers=2, memory="host")
        rx = cuda_ipc.Consumer(name + "-ch")
        f = tx.acquire(timeout=5.0)
        f.publish()
        fr = rx.recv(timeout=5.0)
        idle = cuda_ipc.Producer(name + "-idle", 64, memory="host")
        print("main returns", flush=True)
    """)
    child = subprocess.Popen(
        [sys.executable, "-c", src, name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pids.append(child.pid)
    took = exit_seconds(child)
    assert took < 4.0, f"the exit took {took:.2f} s"
    left = sorted(p.name for p in SHM.glob(f"cuda-ipc.*{name}*"))
    assert not left, left


def test_the_exit_waits_for_other_processes_holds_once_not_once_per_object(name):
    """Three writers, each with a generation another process holds and never releases: the exit
    waits up to 5 s for them all together (it waited 5 s per writer, one after another)."""
    name, pids = name
    names = [f"{name}-{i}" for i in range(3)]
    writer = writers_waiting_to_exit(names, pids)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, time, cuda_ipc
            rs = [cuda_ipc.TensorSetReader(n) for n in sys.argv[1:]]
            hs = [r.current(timeout=5.0) for r in rs]
            print("held", flush=True)
            time.sleep(60)
        """), *names],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    pids.append(holder.pid)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        writer.stdin.write("\n")
        writer.stdin.flush()
        took = exit_seconds(writer)
    finally:
        holder.kill()
        holder.wait()
    assert 4.0 < took < 8.0, f"the exit took {took:.2f} s"


MP_WORKER = """
import multiprocessing, sys
import cuda_ipc

KEEP = []


def work(name):
    # Left open in a module global: the worker ends with os._exit, which runs no atexit hook.
    w = cuda_ipc.TensorSetWriter(name + "-set", {"a": ((16,), "float32")}, memory="host")
    with w.begin(timeout=5.0):
        pass
    KEEP.append(w)
    KEEP.append(cuda_ipc.Producer(name + "-ch", 64, memory="host"))


if __name__ == "__main__":
    for method in ("fork", "forkserver", "spawn"):
        p = multiprocessing.get_context(method).Process(target=work, args=(sys.argv[1] + method,))
        p.start()
        p.join(30)
        assert p.exitcode == 0, (method, p.exitcode)
    print("done", flush=True)
"""


def test_multiprocessing_workers_close_what_they_leave_open(name, tmp_path):
    """A `multiprocessing` worker started by fork or forkserver ends with `os._exit`, which runs
    no `atexit` hook: the module registers its exit close with `multiprocessing`'s finalizers
    too, which such a worker runs (its segments stayed in /dev/shm before)."""
    name, pids = name
    script = tmp_path / "mp_worker.py"
    script.write_text(MP_WORKER)
    child = subprocess.run(
        [sys.executable, str(script), name], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0 and "done" in child.stdout, (child.stdout, child.stderr)
    left = sorted(p.name for p in SHM.glob(f"cuda-ipc.*{name}*"))
    assert not left, left


MP_PARENT = """
import multiprocessing, sys, time
import cuda_ipc


def read_later(name, out):
    # Still reading when its parent's main thread returns: `multiprocessing` joins it at the
    # parent's exit, and the set must stay open until then.
    r = cuda_ipc.TensorSetReader(name)
    time.sleep(1.0)
    with r.current(timeout=5.0) as h:
        ok = h.read("a") == bytes(range(64))
    r.close()
    with open(out, "w") as f:
        f.write("ok" if ok else "bad bytes")


if __name__ == "__main__":
    name, out = sys.argv[1], sys.argv[2]
    w = cuda_ipc.TensorSetWriter(name, {"a": ((64,), "uint8")}, memory="host")
    with w.begin(timeout=5.0) as u:
        u.write("a", bytes(range(64)))
    p = multiprocessing.get_context("spawn").Process(target=read_later, args=(name, out))
    p.start()
    print("main returns", flush=True)
"""


def test_a_writer_stays_open_for_multiprocessing_children_joined_at_the_exit(name, tmp_path):
    """`multiprocessing` joins the children it started at the parent's exit (its exit hook,
    which runs after the module's when imported first): the writer is closed after that join,
    not before, so a child still reading gets its generation."""
    name, pids = name
    script = tmp_path / "mp_parent.py"
    script.write_text(MP_PARENT)
    out = tmp_path / "child.txt"
    child = subprocess.Popen(
        [sys.executable, str(script), name, str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    pids.append(child.pid)
    exit_seconds(child)
    assert out.read_text() == "ok", out.read_text()
    left = sorted(p.name for p in SHM.glob(f"cuda-ipc.*{name}*"))
    assert not left, left


MP_THREADS = """
import multiprocessing, sys, threading, time
import cuda_ipc


def worker(name, out):
    # The target returns while a non-daemon thread still updates its writer, and that thread
    # makes a producer after it: `multiprocessing` runs its finalizers before it joins the
    # child's threads, and the close at exit must wait for them.
    w = cuda_ipc.TensorSetWriter(name + "-set", {"a": ((64,), "uint8")}, memory="host")
    with w.begin(timeout=5.0) as u:
        u.write("a", bytes(64))

    def loop():
        try:
            for i in range(1, 10):
                time.sleep(0.05)
                with w.begin(timeout=5.0) as u:
                    u.write("a", bytes([i]) * 64)
            cuda_ipc.Producer(name + "-ch", 64, memory="host")  # left open
            res = "ok"
        except Exception as e:
            res = repr(e)
        with open(out, "a") as f:
            f.write(res + "\\n")

    threading.Thread(target=loop).start()


if __name__ == "__main__":
    name, out = sys.argv[1], sys.argv[2]
    for method in ("spawn", "fork", "forkserver"):
        p = multiprocessing.get_context(method).Process(target=worker, args=(name + method, out))
        p.start()
        p.join(30)
        assert p.exitcode == 0, (method, p.exitcode)
    print("done", flush=True)
"""


def test_a_multiprocessing_childs_threads_finish_before_its_exit_close(name, tmp_path):
    """A `multiprocessing` child runs its finalizers, where the close at exit is registered,
    as soon as its target returns, before it joins its non-daemon threads: the close joins them
    first, so a thread still updating the child's writer finishes (it got `TensorSetClosed`),
    and what it made meanwhile is closed too (left in /dev/shm before)."""
    name, pids = name
    script = tmp_path / "mp_threads.py"
    script.write_text(MP_THREADS)
    out = tmp_path / "threads.txt"
    child = subprocess.run(
        [sys.executable, str(script), name, str(out)], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0 and "done" in child.stdout, (child.stdout, child.stderr)
    assert out.read_text().split() == ["ok", "ok", "ok"], out.read_text()
    left = sorted(p.name for p in SHM.glob(f"cuda-ipc.*{name}*"))
    assert not left, left
