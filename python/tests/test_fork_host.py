"""A process forked from one that uses cuda_ipc (``os.fork``, ``multiprocessing``'s ``fork`` start
method) inherits copies of its writers, readers, holds, producers and consumers. In the child,
calls on them raise ``NotSupported`` (those that only describe the copy answer, those that let go
do nothing), none waits for a lock a thread of the parent held at the fork, and its exit (which
collects them) changes nothing of the parent's: the set and the channel keep their names, the
reader its hold, the consumer its slot.

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


# Every public method and property of every class a host channel or host tensor set hands out,
# called in the child on the parent's objects: those that act on what the parent holds (or hand
# out its addresses, streams or bytes) raise NotSupported; those that describe the copy answer;
# close, release, abandon and the `with` blocks' ends do nothing. A method this table does not
# know fails the test, so a new one is classed here too. Then the child drops every copy and
# collects, and the parent finds everything as it was: its open update and write frame still
# its to commit and publish, its hold and its received frame still held, its consumer attached.
EVERY = textwrap.dedent(
    """
    import asyncio, gc, os, sys, cuda_ipc
    name = sys.argv[1]
    tx = cuda_ipc.Producer(name, 64, buffers=2, memory="host")
    rx = cuda_ipc.Consumer(name)
    first = tx.acquire(timeout=5)
    first.write(b"one")
    first.publish(b"one")
    fr = rx.recv(timeout=5)
    wf = tx.acquire(timeout=5)
    wf.write(b"PARENT")
    w = cuda_ipc.TensorSetWriter(
        name, {"w": ((4,), "uint8")}, memory="host", mode="buffered", buffers=2
    )
    with w.begin(timeout=5) as u0:
        u0.write("w", b"GEN1")
    r = cuda_ipc.TensorSetReader(name)
    h = r.current()
    u = w.begin(timeout=5)
    u.write("w", b"GEN2")

    def awaited(make):
        # A new coroutine at every call, made and awaited in the child.
        return lambda: asyncio.run(make())

    REFUSED_CALLS = {
        "Producer": (tx, {
            "acquire": lambda: tx.acquire(timeout=0.01),
            "acquire_async": awaited(lambda: tx.acquire_async(timeout=0.01)),
            "try_acquire": lambda: tx.try_acquire(),
            "stats": lambda: tx.stats(),
        }),
        "WriteFrame": (wf, {
            "ptr": lambda: wf.ptr,
            "stream": lambda: wf.stream,
            "write": lambda: wf.write(b"CHILD"),
            "read": lambda: wf.read(),
            "publish_after": lambda: wf.publish_after(0),
            "publish": lambda: wf.publish(b"child"),
            "as_tensor": lambda: wf.as_tensor(),
            "as_cupy": lambda: wf.as_cupy(),
            "__cuda_array_interface__": lambda: wf.__cuda_array_interface__,
            "__dlpack__": lambda: wf.__dlpack__(),
            "__dlpack_device__": lambda: wf.__dlpack_device__(),
        }),
        "Consumer": (rx, {
            "recv": lambda: rx.recv(timeout=0.01),
            "recv_async": awaited(lambda: rx.recv_async(timeout=0.01)),
            "_claim": lambda: rx._claim(0),
            "try_recv": lambda: rx.try_recv(),
            "post": lambda: rx.post(),
            "stats": lambda: rx.stats(),
            "stream": lambda: rx.stream,
            "is_host": lambda: rx.is_host,
            "__next__": lambda: next(rx),
        }),
        "Frame": (fr, {
            "ptr": lambda: fr.ptr,
            "stream": lambda: fr.stream,
            "read": lambda: fr.read(),
            "bytes": lambda: fr.bytes(),
            "__bytes__": lambda: bytes(fr),
            "held": lambda: fr.held,
            "ready_on": lambda: fr.ready_on(0),
            "as_tensor": lambda: fr.as_tensor(),
            "as_cupy": lambda: fr.as_cupy(),
            "__cuda_array_interface__": lambda: fr.__cuda_array_interface__,
            "__dlpack__": lambda: fr.__dlpack__(),
            "__dlpack_device__": lambda: fr.__dlpack_device__(),
        }),
        "TensorSetWriter": (w, {
            "begin": lambda: w.begin(timeout=0.01),
            "publish": lambda: w.publish({"w": b"x"}, timeout=0.01),
            "copy_plan": lambda: w.copy_plan({}),
            "wait_readers": lambda: w.wait_readers(timeout=0.01),
            "synchronize": lambda: w.synchronize(),
        }),
        "TensorUpdate": (u, {
            "tensors": lambda: u.tensors(),
            "copy_from": lambda: u.copy_from({}),
            "copy_from_previous": lambda: u.copy_from_previous(),
            "write": lambda: u.write("w", b"CHLD"),
            "fingerprint": lambda: u.fingerprint(),
            "tensor_digests": lambda: u.tensor_digests(),
            "commit": lambda: u.commit(),
            "abort": lambda: u.abort(),
            "__exit__": lambda: u.__exit__(None, None, None),
        }),
        "TensorSetReader": (r, {
            "current": lambda: r.current(),
            "wait_newer": lambda: r.wait_newer(1, timeout=0.01),
            "wait_newer_async": awaited(lambda: r.wait_newer_async(1, timeout=0.01)),
            "imports": lambda: r.imports,
            "read_only": lambda: r.read_only,
            "layout_fingerprint": lambda: r.layout_fingerprint,
            "names": lambda: r.names,
            "incarnation": lambda: r.incarnation,
            "writerless": lambda: r.writerless,
            "writer_alive": lambda: r.writer_alive,
            "open_timings": lambda: r.open_timings(),
            "switch_stable": lambda: r.switch_stable(h),
            "stable_tensors": lambda: r.stable_tensors(),
            "stable_generation": lambda: r.stable_generation,
            "release_stable": lambda: r.release_stable(),
        }),
        "TensorHold": (h, {
            "whole": lambda: h.whole,
            "tensors": lambda: h.tensors(),
            "read": lambda: h.read("w"),
            "tensor_digests": lambda: h.tensor_digests(),
            "fingerprint": lambda: h.fingerprint(),
            "verify_content": lambda: h.verify_content(),
            "held": lambda: h.held,
        }),
    }
    # What describes the copy (made when the parent made the object), and its answer.
    ANSWERS = {
        "Producer": {"name": name, "memory": "host", "__repr__": None},
        "WriteFrame": {"index": wf.index, "nbytes": 64, "is_host": True},
        "Consumer": {"name": name, "__repr__": None},
        "Frame": {"seq": 1, "index": fr.index, "metadata": b"one", "nbytes": 64,
                  "is_host": True, "__repr__": None},
        "TensorSetWriter": {"name": name, "names": ["w"], "nbytes": w.nbytes,
                            "layout_fingerprint": w.layout_fingerprint, "generation": 1,
                            "__repr__": None},
        "TensorUpdate": {"generation": 2, "buffer": u.buffer, "__repr__": None},
        "TensorSetReader": {"name": name, "__repr__": None},
        "TensorHold": {"generation": 1, "buffer": h.buffer, "content": h.content,
                       "__repr__": None},
    }
    # What lets go (close, release, abandon, the end of a `with` block): nothing, quietly.
    QUIET = {
        "Producer": {"close": lambda: tx.close(timeout=0.01),
                     "__exit__": lambda: tx.__exit__(None, None, None),
                     "__enter__": lambda: tx.__enter__()},
        "WriteFrame": {"abandon": lambda: wf.abandon(),
                       "__exit__": lambda: wf.__exit__(None, None, None),
                       "__enter__": lambda: wf.__enter__()},
        "Consumer": {"close": lambda: rx.close(),
                     "__exit__": lambda: rx.__exit__(None, None, None),
                     "__enter__": lambda: rx.__enter__(), "__iter__": lambda: iter(rx)},
        "Frame": {"release": lambda: fr.release(),
                  "__exit__": lambda: fr.__exit__(None, None, None),
                  "__enter__": lambda: fr.__enter__()},
        "TensorSetWriter": {"close": lambda: w.close(timeout=0.01),
                            "__exit__": lambda: w.__exit__(None, None, None),
                            "__enter__": lambda: w.__enter__()},
        "TensorUpdate": {"__enter__": lambda: u.__enter__()},
        "TensorSetReader": {"close": lambda: r.close(),
                            "__exit__": lambda: r.__exit__(None, None, None),
                            "__enter__": lambda: r.__enter__()},
        "TensorHold": {"release": lambda: h.release(),
                       "__exit__": lambda: h.__exit__(None, None, None),
                       "__enter__": lambda: h.__enter__()},
    }
    # What makes a new object of the child's own (called where it needs no GPU).
    OWN = {
        "Consumer": {"attach": lambda: cuda_ipc.Consumer.attach(name)},
        # Needs a GPU and PyTorch; a writer over the child's own tensors either way.
        "TensorSetWriter": {"over_tensors": None},
    }
    DUNDERS = {"__next__", "__bytes__", "__cuda_array_interface__", "__dlpack__",
               "__dlpack_device__", "__enter__", "__exit__", "__iter__", "__repr__"}

    pid = os.fork()
    if pid == 0:
        wrong = []
        for cls, (obj, calls) in REFUSED_CALLS.items():
            known = set(calls) | set(ANSWERS[cls]) | set(QUIET[cls]) | set(OWN.get(cls, {}))
            public = {a for a in dir(type(obj)) if not a.startswith("_")}
            public |= {a for a in DUNDERS if a in type(obj).__dict__}
            if type(obj).__name__ != cls:
                wrong.append(cls + ": the object is a " + type(obj).__name__)
            for a in sorted(public - known):
                wrong.append(cls + "." + a + ": a call this test does not know")
            wrong += refused([(cls + "." + a, c) for a, c in calls.items()])
            for a, want in ANSWERS[cls].items():
                try:
                    got = repr(obj) if a == "__repr__" else getattr(obj, a)
                    if want is not None and got != want:
                        wrong.append(cls + "." + a + ": " + repr(got) + ", not " + repr(want))
                except Exception as e:
                    wrong.append(cls + "." + a + ": " + type(e).__name__ + ": " + str(e))
            for a, call in QUIET[cls].items():
                try:
                    got = call()
                    if a == "close" and cls == "Producer":
                        if got != {"forced_holds": 0, "consumers_behind": 0}:
                            wrong.append(cls + ".close: " + repr(got))
                    elif a in ("__enter__", "__iter__"):
                        if got is not obj:
                            wrong.append(cls + "." + a + ": " + repr(got))
                    elif got not in (None, False):
                        wrong.append(cls + "." + a + ": " + repr(got))
                except Exception as e:
                    wrong.append(cls + "." + a + ": " + type(e).__name__ + ": " + str(e))
            for a, make in OWN.get(cls, {}).items():
                try:
                    if make is not None:
                        with make() as mine:
                            if type(mine).__name__ != cls:
                                wrong.append(cls + "." + a + ": " + repr(mine))
                except Exception as e:
                    wrong.append(cls + "." + a + ": " + type(e).__name__ + ": " + str(e))
            # Letting go did nothing: the copy still refuses (not "released", not "closed").
            wrong += refused([(cls + "." + a + " after letting go", c)
                              for a, c in calls.items() if a not in ("__exit__", "abort")])
        # The child's own objects on the parent's channel and set work.
        own = cuda_ipc.TensorSetReader(name)
        got = own.current()
        if got is None or got.generation != 1 or got.read("w") != b"GEN1":
            wrong.append("the child's own reader: " + repr(got))
        del got, own
        # Its copies collected now, not at the exit.
        del tx, rx, fr, wf, w, u, r, h, first, u0, REFUSED_CALLS, QUIET, ANSWERS
        gc.collect()
        if wrong:
            print("child:", wrong, flush=True)
        sys.exit(1 if wrong else 0)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    for prefix in ("ch", "ts"):
        assert os.path.exists("/dev/shm/cuda-ipc." + prefix + "." + name), prefix
    # The parent's consumer kept its slot, its frame and hold are held, its update and write
    # frame are its own to finish.
    assert fr.held and fr.bytes()[:3] == b"one"
    assert wf.read(0, 6) == b"PARENT"
    assert wf.publish(b"two") == 2
    assert tx.stats()["consumers"][0]["in_flight"] == 1, tx.stats()
    fr.release()
    assert rx.recv(timeout=5).bytes()[:6] == b"PARENT"
    assert h.held and h.read("w") == b"GEN1"
    assert u.commit() == 2
    try:
        w.begin(timeout=0.2)
        raise AssertionError("begin took the buffer the parent's hold holds")
    except cuda_ipc.Timeout:
        pass
    h.release()
    assert r.wait_newer(1, timeout=5).read("w") == b"GEN2"
    w.close()
    tx.close()
    print("ok", flush=True)
    """
)

# Threads of the parent inside calls that hold an object's own lock without the GIL (a large
# copy into a write frame, the fingerprints of a hold and of an open update over large host
# tensors) at the fork: in the child that lock stays taken for good (its thread does not run
# there), so its calls must refuse without taking it, and its collection at the child's exit must
# not wait for it either.
LOCKS = textwrap.dedent(
    """
    import gc, os, signal, sys, threading, time, cuda_ipc
    name = sys.argv[1]
    BIG = 64 << 20
    tx = cuda_ipc.Producer(name, BIG, buffers=1, memory="host")
    rx = cuda_ipc.Consumer(name)
    f = tx.acquire(timeout=5)
    w = cuda_ipc.TensorSetWriter(
        name, {"w": ((BIG,), "uint8")}, memory="host", mode="buffered", buffers=2
    )
    with w.begin(timeout=5) as u0:
        u0.write("w", b"GEN1")
    r = cuda_ipc.TensorSetReader(name)
    h = r.current()
    u = w.begin(timeout=5)
    stop = threading.Event()
    data = bytes(BIG)
    def loop(call):
        def run():
            while not stop.is_set():
                call()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t
    threads = [loop(lambda: f.write(data)), loop(h.fingerprint), loop(u.fingerprint)]
    time.sleep(0.5)  # each inside its call, holding its lock most of the time
    pid = os.fork()
    if pid == 0:
        started = time.monotonic()
        wrong = refused([
            ("frame write", lambda: f.write(b"CHILD")),
            ("frame read", lambda: f.read(0, 4)),
            ("frame publish", lambda: f.publish()),
            ("hold read", lambda: h.read("w")),
            ("hold held", lambda: h.held),
            ("hold fingerprint", lambda: h.fingerprint()),
            ("update write", lambda: u.write("w", b"CHLD")),
            ("update abort", lambda: u.abort()),
            ("update commit", lambda: u.commit()),
            ("writer synchronize", lambda: w.synchronize()),
        ])
        # What describes the copy answers without the update's cell (which a thread holds).
        if (u.generation, w.generation) != (2, 1):
            wrong.append("update generation: " + repr((u.generation, w.generation)))
        for let_go in (f.abandon, h.release, lambda: f.__exit__(None, None, None)):
            let_go()
        repr(u), repr(h)
        if time.monotonic() - started > 2:
            wrong.append("the calls waited")
        if wrong:
            print("child:", wrong, flush=True)
        del f, h, u
        gc.collect()
        # The rest (the producer, consumer, writer, reader) at the interpreter's exit.
        sys.exit(1 if wrong else 0)
    deadline = time.monotonic() + 10
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the child hung on a lock its parent's thread held")
        time.sleep(0.05)
    assert status == 0, status
    stop.set()
    for t in threads:
        t.join(10)
    f.write(b"DONE")
    assert f.publish(b"done") == 1
    assert rx.recv(timeout=5).bytes()[:4] == b"DONE"
    u.write("w", b"GEN2")
    assert u.commit() == 2
    assert h.held
    h.release()
    assert r.wait_newer(1, timeout=5).read("w")[:4] == b"GEN2"
    w.close()
    tx.close()
    print("ok", flush=True)
    """
)

# A `multiprocessing` worker started by the fork start method (the default on Linux before
# Python 3.14; PyTorch's DataLoader workers): it ends with `os._exit` after running the
# finalizers `multiprocessing` registered, which the module registers its exit closes with once
# `multiprocessing` is loaded. The worker's calls refuse and its end closes nothing of the
# parent's.
MP = textwrap.dedent(
    """
    import multiprocessing, os, sys, cuda_ipc
    name = sys.argv[1]
    tx = cuda_ipc.Producer(name, 64, buffers=2, memory="host")
    rx = cuda_ipc.Consumer(name)
    f = tx.acquire(timeout=5)
    f.write(b"one")
    f.publish(b"one")
    held = rx.recv(timeout=5)
    w = cuda_ipc.TensorSetWriter(name, {"w": ((4,), "uint8")}, memory="host")
    with w.begin(timeout=5) as u:
        u.write("w", b"GEN1")
    r = cuda_ipc.TensorSetReader(name)
    h = r.current()

    def worker(q):
        q.put(refused([
            ("recv", lambda: rx.recv(timeout=0.01)),
            ("acquire", lambda: tx.acquire(timeout=0.01)),
            ("frame read", lambda: held.read()),
            ("begin", lambda: w.begin(timeout=0.01)),
            ("current", lambda: r.current()),
            ("hold read", lambda: h.read("w")),
        ]))

    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=worker, args=(q,))
    p.start()
    wrong = q.get(timeout=30)
    p.join(30)
    assert not wrong, wrong
    assert p.exitcode == 0, p.exitcode
    for prefix in ("ch", "ts"):
        assert os.path.exists("/dev/shm/cuda-ipc." + prefix + "." + name), prefix
    assert tx.stats()["consumers"][0]["in_flight"] == 1, tx.stats()
    assert held.bytes()[:3] == b"one" and h.read("w") == b"GEN1"
    f = tx.acquire(timeout=5)
    f.publish(b"two")
    held.release()
    assert rx.recv(timeout=5).metadata == b"two"
    h.release()
    with w.begin(timeout=5) as u:
        u.write("w", b"GEN2")
    assert r.wait_newer(1, timeout=5).read("w") == b"GEN2"
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


def test_every_call_of_a_forked_childs_copies_refuses_or_describes_the_copy():
    run(EVERY)


def test_a_forked_child_waits_for_no_object_lock_its_parents_threads_held_without_the_gil():
    run(LOCKS)


def test_a_multiprocessing_fork_worker_neither_uses_nor_closes_its_parents_objects():
    run(MP)
