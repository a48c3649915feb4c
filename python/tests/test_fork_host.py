"""A process forked from one that uses cuda_ipc (``os.fork``, ``multiprocessing``'s ``fork`` start
method) inherits copies of its writers, readers, holds, producers and consumers. In the child,
calls on them raise ``NotSupported``, and its exit (which collects them) changes nothing of the
parent's: the set and the channel keep their names, the reader its hold, the consumer its slot.

Each case runs in a fresh interpreter (``sys.executable``), whose child ends by a normal
``SystemExit``, so that the interpreter's own finalization collects the inherited objects, as a
user's child would. Run: ``pip install ./python && pytest python/tests``."""

import os
import subprocess
import sys
import textwrap
import uuid

ANSWER = 60.0

# Prepended to every script: the cases of `cases` that do not raise NotSupported saying the object
# was made before the fork, as lines of what went wrong.
REFUSED = textwrap.dedent(
    """
    import cuda_ipc

    def refused(cases):
        wrong = []
        for what, call in cases:
            try:
                call()
                wrong.append(what + ": no error")
            except cuda_ipc.NotSupported as e:
                if "forked" not in str(e):
                    wrong.append(what + ": " + str(e))
            except Exception as e:
                wrong.append(what + ": " + type(e).__name__ + ": " + str(e))
        return wrong
    """
)

TENSOR_SET = textwrap.dedent(
    """
    import os, sys, time, cuda_ipc
    name = sys.argv[1]
    w = cuda_ipc.TensorSetWriter(name, {"w": ((4,), "float32")}, memory="host")
    with w.begin(timeout=5) as u:
        u.write("w", bytes(range(16)))
    r = cuda_ipc.TensorSetReader(name)
    h = r.current()
    assert h.generation == 1
    pid = os.fork()
    if pid == 0:
        wrong = []
        wrong += refused([
            ("current", lambda: r.current()),
            ("wait_newer", lambda: r.wait_newer(1, timeout=0.01)),
            ("begin", lambda: w.begin(timeout=0.01)),
            ("hold read", lambda: h.read("w")),
            ("hold fingerprint", lambda: h.fingerprint()),
            ("hold tensor_digests", lambda: h.tensor_digests()),
            ("hold verify_content", lambda: h.verify_content()),
        ])
        own = cuda_ipc.TensorSetReader(name)
        if own.current().generation != 1:
            wrong.append("the child's own reader")
        if wrong:
            print("child:", wrong, flush=True)
        # A normal exit: the interpreter collects w, r, h and own.
        raise SystemExit(1 if wrong else 0)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    # The parent's set stands, its reader still holds generation 1 (an in-place begin waits).
    assert os.path.exists("/dev/shm/cuda-ipc.ts." + name), "the child removed the set"
    try:
        w.begin(timeout=0.2)
        raise AssertionError("begin took the buffer a hold of the parent's reader holds")
    except cuda_ipc.Timeout:
        pass
    h.release()
    with w.begin(timeout=5) as u:
        u.write("w", bytes(16))
    assert r.wait_newer(1, timeout=5).generation == 2
    w.close()
    print("ok", flush=True)
    """
)

CHANNEL = textwrap.dedent(
    """
    import os, sys, time, cuda_ipc
    name = sys.argv[1]
    tx = cuda_ipc.Producer(name, 4096, buffers=2, memory="host")
    rx = cuda_ipc.Consumer(name)
    f = tx.acquire(timeout=5)
    f.write(b"one")
    f.publish()
    held = rx.recv(timeout=5)
    pid = os.fork()
    if pid == 0:
        wrong = []
        wrong += refused([
            ("recv", lambda: rx.recv(timeout=0.01)),
            ("acquire", lambda: tx.acquire(timeout=0.01)),
        ])
        if wrong:
            print("child:", wrong, flush=True)
        raise SystemExit(1 if wrong else 0)
    started = time.monotonic()
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    assert time.monotonic() - started < 3, "the child's exit waited for the parent's holds"
    assert os.path.exists("/dev/shm/cuda-ipc.ch." + name), "the child removed the channel"
    # The parent's consumer keeps its slot and its hold: one buffer is free, not two.
    f = tx.acquire(timeout=5)
    f.write(b"two")
    f.publish(b"two")
    try:
        tx.acquire(timeout=0.2)
        raise AssertionError("acquire took the buffer the parent's consumer holds")
    except cuda_ipc.Timeout:
        pass
    held.release()
    assert rx.recv(timeout=5).metadata == b"two"
    tx.close()
    print("ok", flush=True)
    """
)

# Threads of the parent blocked inside calls (a receive, an in-place begin waiting for a hold)
# hold the binding's locks at the fork; the child's calls must not wait for them: they raise at
# once, and leaving the `with` blocks (close) is a no-op for the child's copies.
THREADS = textwrap.dedent(
    """
    import os, sys, threading, time, cuda_ipc
    name = sys.argv[1]
    with cuda_ipc.Producer(name, 64, buffers=1, memory="host") as tx, \\
            cuda_ipc.Consumer(name) as rx, \\
            cuda_ipc.TensorSetWriter(name, {"w": ((4,), "float32")}, memory="host") as w:
        with w.begin(timeout=5) as u:
            u.write("w", bytes(16))
        r = cuda_ipc.TensorSetReader(name)
        h = r.current()
        got, began = [], []
        t1 = threading.Thread(target=lambda: got.append(rx.recv(timeout=10)), daemon=True)
        t2 = threading.Thread(target=lambda: began.append(w.begin(timeout=10)), daemon=True)
        t1.start(); t2.start()
        time.sleep(0.3)  # both inside their waits
        pid = os.fork()
        if pid == 0:
            wrong = []
            started = time.monotonic()
            wrong += refused([
                ("recv", lambda: rx.recv(timeout=0.01)),
                ("try_recv", lambda: rx.try_recv()),
                ("begin", lambda: w.begin(timeout=0.01)),
                ("acquire", lambda: tx.acquire(timeout=0.01)),
                ("current", lambda: r.current()),
            ])
            if time.monotonic() - started > 2:
                wrong.append("the calls waited")
            if wrong:
                print("child:", wrong, flush=True)
            # Leaves the `with` blocks (closes that do nothing here), then the interpreter's end.
            sys.exit(1 if wrong else 0)
        started = time.monotonic()
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
        assert time.monotonic() - started < 3, "the child's exit waited"
        # The parent's blocked calls complete as they would have.
        f = tx.acquire(timeout=5)
        f.write(b"x")
        f.publish()
        t1.join(10)
        assert got and got[0].seq == 1, got
        got[0].release()
        h.release()
        t2.join(10)
        assert began, "the parent's begin did not get its buffer"
        began[0].commit()
        assert r.wait_newer(1, timeout=5).generation == 2
        r.close()
    print("ok", flush=True)
    """
)

# An update and a write frame open at the fork: the child writes nothing through them, and the
# parent publishes its own bytes.
OPEN = textwrap.dedent(
    """
    import os, sys, cuda_ipc
    name = sys.argv[1]
    w = cuda_ipc.TensorSetWriter(name, {"w": ((4,), "uint8")}, memory="host", mode="buffered")
    with w.begin(timeout=5) as u:
        u.write("w", b"GEN1")
    r = cuda_ipc.TensorSetReader(name)
    p = cuda_ipc.Producer(name, 4, buffers=1, memory="host")
    c = cuda_ipc.Consumer(name)
    u = w.begin(timeout=5)
    u.write("w", b"PPPP")
    f = p.acquire(timeout=5)
    f.write(b"PPPP")
    pid = os.fork()
    if pid == 0:
        wrong = []
        wrong += refused([
            ("update write", lambda: u.write("w", b"CHLD")),
            ("copy_from_previous", lambda: u.copy_from_previous()),
            ("frame write", lambda: f.write(b"CHLD")),
            ("frame read", lambda: f.read()),
            ("hold read", lambda: r.current()),
            ("update fingerprint", lambda: u.fingerprint()),
            ("update tensor_digests", lambda: u.tensor_digests()),
            ("update abort", lambda: u.abort()),
        ])
        if wrong:
            print("child:", wrong, flush=True)
        os._exit(1 if wrong else 0)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    u.commit()
    f.publish()
    assert r.current().read("w") == b"PPPP"
    assert c.recv(timeout=5).bytes() == b"PPPP"
    print("ok", flush=True)
    """
)


def run(script):
    name = f"pytest-fork-{uuid.uuid4().hex[:12]}"
    try:
        p = subprocess.run(
            [sys.executable, "-c", REFUSED + script, name],
            capture_output=True,
            text=True,
            timeout=ANSWER,
        )
    finally:
        for prefix in ("ts", "tg", "td", "th", "ch", "hp"):
            try:
                os.unlink(f"/dev/shm/cuda-ipc.{prefix}.{name}")
            except FileNotFoundError:
                pass
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), (p.stdout, p.stderr)


def test_a_forked_child_neither_uses_nor_removes_its_parents_tensor_set():
    run(TENSOR_SET)


def test_a_forked_child_neither_uses_nor_removes_its_parents_channel():
    run(CHANNEL)


def test_a_forked_child_waits_for_no_lock_its_parents_threads_held():
    run(THREADS)


def test_a_forked_child_writes_nothing_through_its_parents_open_update_or_frame():
    run(OPEN)
