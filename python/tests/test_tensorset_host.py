"""Tensor sets in shared host memory (`memory="host"`) from Python, no GPU: a writer here and a
reader in a child Python process (started with `sys.executable`, never forked) reading every
generation's bytes; the layout fingerprint refused; the writer killed (the reader keeps the
generation it holds and learns `WriterGone`); a missing set; a name the set lacks; every call of
a closed reader raising `TensorSetClosed` (a closed holder's are checked by the Rust unit test in
python/src/holder.rs: a holder is opened only on a VMM set, which needs a GPU).
Every wait is bounded. Run: `pip install ./python && pytest python/tests`."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

import cuda_ipc

SHM = pathlib.Path("/dev/shm")
ANSWER = 10.0
SPECS = {"w": ((4, 8), "float32"), "b": ((8,), "bfloat16"), "ids": (3, "int64")}


@pytest.fixture
def name():
    n = f"pytest-ts-{uuid.uuid4().hex[:12]}"
    yield n
    for prefix in ("cuda-ipc.ts.", "cuda-ipc.tg.", "cuda-ipc.td."):
        p = SHM / f"{prefix}{n}"
        if p.exists() or p.is_symlink():
            p.unlink()


def data(gen: int, tensor: str, n: int) -> bytes:
    seed = (gen * 131 + len(tensor) * 7) & 0xFF
    return bytes((seed + k) & 0xFF for k in range(n))


SIZES = {"w": 4 * 8 * 4, "b": 8 * 2, "ids": 3 * 8}

READER = """
import sys, cuda_ipc
name, n = sys.argv[1], int(sys.argv[2])
r = cuda_ipc.TensorSetReader(name)
print("open", r.imports, r.read_only, list(r.names), flush=True)
seen = 0
for _ in range(n):
    h = r.wait_newer(seen, timeout=10.0)
    with h:
        seen = h.generation
        parts = [h.read(t).hex() for t in ("w", "b", "ids")]
    print("gen", seen, *parts, flush=True)
"""


def child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def line(p: subprocess.Popen) -> str:
    import select

    r, _, _ = select.select([p.stdout], [], [], ANSWER)
    if not r:
        p.kill()
        raise AssertionError(f"child said nothing in {ANSWER} s: {p.stderr.read()}")
    s = p.stdout.readline()
    if not s:
        raise AssertionError(f"child ended: {p.wait()} {p.stderr.read()}")
    return s.split()


def write_gen(w, gen_hint):
    with w.begin(timeout=ANSWER) as u:
        g = u.generation
        for t, n in SIZES.items():
            u.write(t, data(g, t, n))
    return g


def test_a_reader_in_another_process_reads_every_generation(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    assert w.generation == 0 and list(w.names) == ["w", "b", "ids"]
    assert len(w.layout_fingerprint) == 32
    p = child(READER, name, "20")
    try:
        first = line(p)
        assert first[:3] == ["open", "0", "False"]
        for _ in range(20):
            g = write_gen(w, None)
            got = line(p)
            assert got[0] == "gen" and int(got[1]) == g
            for t, hexed in zip(("w", "b", "ids"), got[2:]):
                assert bytes.fromhex(hexed) == data(g, t, SIZES[t])
        assert p.wait(ANSWER) == 0
    finally:
        if p.poll() is None:
            p.kill()
        w.close()
    assert not (SHM / f"cuda-ipc.ts.{name}").exists()


def test_current_returns_the_same_generation_again_and_none_before_the_first(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", mode="buffered", buffers=2)
    r = cuda_ipc.TensorSetReader(name)
    assert r.current() is None
    g = write_gen(w, None)
    with r.current() as a:
        assert a.generation == g and a.read("ids") == data(g, "ids", 24)
        assert a.whole is True  # a host set's generation is whole once published
    with r.current() as b:
        assert b.generation == g
    g2 = write_gen(w, None)
    h = r.wait_newer(g, timeout=ANSWER)
    assert h.generation == g2
    h.release()
    assert not h.held
    r.close()
    w.close()


def test_a_replaced_writers_set_has_another_incarnation(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    first = r.incarnation
    assert isinstance(first, int) and first != 0
    assert cuda_ipc.TensorSetReader(name).incarnation == first
    r.close()
    w.close()
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    assert r.incarnation not in (0, first)
    r.close()
    w.close()


def test_a_reader_expecting_another_layout_is_refused(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    other = cuda_ipc.TensorSetWriter(name + "-x", {"w": ((4, 9), "float32")}, memory="host")
    try:
        r = cuda_ipc.TensorSetReader(name, expect_layout=bytes(w.layout_fingerprint))
        r.close()
        with pytest.raises(cuda_ipc.LayoutMismatch):
            cuda_ipc.TensorSetReader(name, expect_layout=bytes(other.layout_fingerprint))
        with pytest.raises(cuda_ipc.InvalidArgument):
            cuda_ipc.TensorSetReader(name, expect_layout=b"short")
    finally:
        other.close()
        w.close()


def test_a_missing_set_and_bad_specs_raise_typed_errors(name):
    with pytest.raises(cuda_ipc.TensorSetNotFound):
        cuda_ipc.TensorSetReader(name)
    with pytest.raises(cuda_ipc.InvalidArgument):
        cuda_ipc.TensorSetWriter(name, {"w": ((4,), "no-such-dtype")}, memory="host")
    with pytest.raises(cuda_ipc.InvalidArgument):
        cuda_ipc.TensorSetWriter(name, {"w": 5}, memory="host")
    with pytest.raises(cuda_ipc.InvalidArgument):
        cuda_ipc.TensorSetWriter(name, SPECS, memory="host", mode="sideways")


def test_host_sets_refuse_gpu_only_calls(name):
    """A host set's tensors come as CPU tensors (test_tensorset_torch_host.py); reading a
    tensor's bytes that is not in the set is refused, and so is a stream (a host set has none to
    order), before anything is taken."""
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    try:
        g = write_gen(w, None)
        for call in (lambda: w.begin(stream=5), lambda: w.publish({}, stream=0)):
            with pytest.raises(cuda_ipc.InvalidArgument, match="no streams"):
                call()
        assert w.generation == g
        r = cuda_ipc.TensorSetReader(name)
        with r.current() as h:
            with pytest.raises(cuda_ipc.InvalidArgument):
                h.read("nope")
            with pytest.raises(cuda_ipc.InvalidArgument, match="no streams"):
                h.tensors(stream=5)
        r.close()
        write_gen(w, None)
    finally:
        w.close()


def test_an_update_aborted_by_an_exception_publishes_nothing(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    try:
        with pytest.raises(RuntimeError):
            with w.begin(timeout=ANSWER) as u:
                u.write("ids", b"\0" * 24)
                raise RuntimeError("boom")
        assert w.generation == 0
        with pytest.raises(cuda_ipc.InvalidArgument):
            u.commit()
        assert write_gen(w, None) == 1
    finally:
        w.close()


WRITER = """
import sys, time, cuda_ipc
name = sys.argv[1]
w = cuda_ipc.TensorSetWriter(name, {"ids": (3, "int64")}, memory="host")
with w.begin(timeout=10.0) as u:
    u.write("ids", bytes(range(24)))
print("published", w.generation, flush=True)
time.sleep(60)
"""


def test_a_killed_writer_leaves_the_held_generation_and_raises_writer_gone(name):
    p = child(WRITER, name)
    try:
        assert line(p) == ["published", "1"]
        r = cuda_ipc.TensorSetReader(name)
        h = r.current(timeout=ANSWER)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(ANSWER)
        assert h.read("ids") == bytes(range(24))
        t0 = time.monotonic()
        with pytest.raises(cuda_ipc.WriterGone):
            r.wait_newer(1, timeout=ANSWER)
        assert time.monotonic() - t0 < 3.0
        assert isinstance(cuda_ipc.WriterGone("x"), cuda_ipc.ProducerGone)
        h.release()
        r.close()
    finally:
        if p.poll() is None:
            p.kill()
        cuda_ipc.cleanup(dry_run=False)


def test_writer_alive_tells_a_reader_polling_current_that_its_writer_died_or_was_replaced(name):
    # `current()` keeps returning the last generation published after the writer is gone (its
    # memory stays mapped); `writer_alive` is how a reader that only polls it learns of that.
    p = child(WRITER, name)
    try:
        assert line(p) == ["published", "1"]
        r = cuda_ipc.TensorSetReader(name)
        assert r.writer_alive
        os.kill(p.pid, signal.SIGKILL)
        p.wait(ANSWER)
        assert not r.writer_alive
        with r.current() as h:
            assert h.generation == 1 and h.read("ids") == bytes(range(24))
        # A new writer under the name is another writer: this reader's stays gone, a reader
        # opened now reads the new one.
        w = cuda_ipc.TensorSetWriter(name, {"ids": (3, "int64")}, memory="host")
        try:
            with w.begin(timeout=ANSWER) as u:
                u.write("ids", bytes(24))
            assert not r.writer_alive
            with r.current() as h:
                assert h.read("ids") == bytes(range(24))
            r2 = cuda_ipc.TensorSetReader(name)
            assert r2.writer_alive
            with r2.current() as h:
                assert h.read("ids") == bytes(24)
            w.close()
            assert not r2.writer_alive  # closed: gone too
            r2.close()
        finally:
            w.close()
        r.close()
        with pytest.raises(cuda_ipc.TensorSetClosed):
            r.writer_alive  # noqa: B018 (a closed reader says so)
    finally:
        if p.poll() is None:
            p.kill()
        cuda_ipc.cleanup(dry_run=False)


def test_a_sets_bytes_are_counted_in_a_shared_budget(name):
    """A private group scope (root: a gid nobody uses), as test_host.py's quota test does."""
    gid = 3_900_000_000 + (os.getpid() + 7) % 100_000 if os.geteuid() == 0 else os.getegid()
    ledger = SHM / f"cuda-ipc.quota.g{gid}.{'0' * 32}"
    if ledger.exists() and os.geteuid() != 0:
        pytest.skip(f"group {gid} already has a host-memory budget ({ledger})")
    scope = f"group:{gid}"
    cuda_ipc.set_quota(1000, scope=scope)  # one set of SPECS (768 bytes a buffer), not two
    try:
        first = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", quota=scope)
        with pytest.raises(cuda_ipc.OverQuota):
            cuda_ipc.TensorSetWriter(name + "-2", SPECS, memory="host", quota=scope)
        assert not (SHM / f"cuda-ipc.ts.{name}-2").exists()
        first.close()
        cuda_ipc.TensorSetWriter(name + "-2", SPECS, memory="host", quota=scope).close()
        # A set no memory can hold is refused as such, before the budget is asked: 4 buffers of
        # 2**62 bytes are 2**64 bytes (they read as a reservation of 2**64 - 1 bytes, over
        # quota), 4 of 2**61 bytes pass the most a data segment holds (isize::MAX).
        for n, why in ((2**62, "2\\^64 bytes or more"), (2**61, "the most a segment can hold")):
            huge = {"w": ((n,), "uint8")}
            with pytest.raises(cuda_ipc.InvalidArgument, match=why):
                cuda_ipc.TensorSetWriter(
                    name + "-3", huge, memory="host", mode="buffered", buffers=4, quota=scope
                )
        assert not (SHM / f"cuda-ipc.ts.{name}-3").exists()
    finally:
        assert cuda_ipc.remove_quota(scope=scope)


def test_wait_newer_async_leaves_the_event_loop_free(name):
    import asyncio

    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        t = asyncio.create_task(ticker())
        waiting = asyncio.ensure_future(r.wait_newer_async(0, 5.0))
        await asyncio.sleep(0.1)  # the loop runs while the reader waits
        assert not waiting.done() and ticks >= 5
        g = write_gen(w, None)
        h = await asyncio.wait_for(waiting, 5.0)
        t.cancel()
        return g, h

    try:
        g, h = asyncio.run(main())
        assert h.generation == g and h.read("ids") == data(g, "ids", 24)
        h.release()
    finally:
        r.close()
        w.close()


def test_a_cancelled_wait_newer_async_stops_its_thread(name):
    import asyncio

    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)

    async def main():
        # No timeout: only the cancellation ends the wait; a coroutine never awaited starts none.
        r.wait_newer_async(0).close()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r.wait_newer_async(0), 0.1)

    try:
        t0 = time.monotonic()
        # `asyncio.run` joins the executor's threads: it returns once the wait stopped.
        asyncio.run(main())
        assert time.monotonic() - t0 < 2.0
    finally:
        r.close()
        w.close()


def park_a_cancelled_take(w, r) -> int:
    """Publishes a generation while an awaited `wait_newer_async` waits for it and cancels the
    task only after the wait (in its thread) took it, before the task could resume: the loop's
    thread sleeps in between. Returns that generation, which the reader keeps (parked)."""
    import asyncio

    async def main():
        t = asyncio.ensure_future(r.wait_newer_async(w.generation, timeout=ANSWER))
        await asyncio.sleep(0.05)  # the task's wait runs in the executor's thread
        g = write_gen(w, None)
        time.sleep(0.3)  # the loop's thread: the wait takes `g`, the task is not resumed
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        return g

    g = asyncio.run(main())
    # The take counted: the writer is told the reader has it.
    assert w.wait_readers(ANSWER)
    return g


@pytest.mark.parametrize("how", ["wait_newer", "wait_newer_async", "current"])
def test_a_generation_a_cancelled_wait_newer_async_took_goes_to_the_next_take(name, how):
    """The shutdown pattern `publish(final); wait_readers(); close()` against a reader whose
    awaited wait was cancelled after it took `final`: the reader's next take (blocking, awaited or
    `current()`) still returns `final`, once the writer's close began (it waits for that hold),
    with its bytes; the one after it learns `TensorSetClosed`, and the close returns once the hold
    is released."""
    import asyncio

    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    closer = None
    try:
        g = park_a_cancelled_take(w, r)
        closer = threading.Thread(target=w.close, args=(ANSWER,))
        closer.start()
        deadline = time.monotonic() + ANSWER
        while (SHM / f"cuda-ipc.ts.{name}").exists():  # the close has begun
            assert time.monotonic() < deadline, "the close never began"
            time.sleep(0.001)
        if how == "wait_newer":
            h = r.wait_newer(0, timeout=ANSWER)
        elif how == "wait_newer_async":
            h = asyncio.run(asyncio.wait_for(r.wait_newer_async(0, timeout=ANSWER), ANSWER))
        else:
            h = r.current()
        with h:
            assert h.generation == g
            assert h.read("ids") == data(g, "ids", SIZES["ids"])
        t0 = time.monotonic()
        closer.join(ANSWER)
        assert time.monotonic() - t0 < ANSWER / 2 and not closer.is_alive()
        with pytest.raises(cuda_ipc.TensorSetClosed):
            r.wait_newer(g, timeout=ANSWER)
    finally:
        if closer is not None:
            closer.join(ANSWER)
        r.close()
        w.close()


def test_a_parked_generation_is_let_go_by_a_take_past_it_by_current_and_by_close(name):
    """A generation parked by a cancelled awaited wait keeps its buffer held (an in-place `begin`
    waits) until the reader lets it go: `wait_newer(than)` with `than` at or past it releases it
    (and waits for a newer one), `current()` returns a newer one published meanwhile and releases
    it, `close()` releases it."""
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", mode="buffered", buffers=3)
    r = cuda_ipc.TensorSetReader(name)
    try:
        g = park_a_cancelled_take(w, r)
        # A take asking past it: released, and the take times out (nothing newer yet).
        with pytest.raises(cuda_ipc.Timeout):
            r.wait_newer(g, timeout=0.1)
        g2 = park_a_cancelled_take(w, r)
        g3 = write_gen(w, None)
        with r.current() as h:
            assert (h.generation, g2) == (g3, g3 - 1)
        g4 = park_a_cancelled_take(w, r)
        assert g4 == g3 + 1
    finally:
        r.close()
    # Nothing of the reader is held now: an in-place writer's `begin` would have waited for a
    # parked hold; here the buffered writer cycles through every buffer at once.
    for _ in range(3):
        write_gen(w, None)
    w.close()


PARKED_IN_A_FORKED_CHILD = """
import asyncio, os, sys, time, cuda_ipc
name = sys.argv[1]
w = cuda_ipc.TensorSetWriter(name, {"w": ((4,), "float32")}, memory="host")
r = cuda_ipc.TensorSetReader(name)

async def main():
    t = asyncio.ensure_future(r.wait_newer_async(0, timeout=10))
    await asyncio.sleep(0.05)
    with w.begin(timeout=5) as u:
        u.write("w", bytes(range(16)))
    time.sleep(0.3)
    t.cancel()
    try:
        await t
    except asyncio.CancelledError:
        return
    raise SystemExit("the task was not cancelled")

asyncio.run(main())
pid = os.fork()
if pid == 0:
    wrong = []
    for what, call in [("current", r.current), ("wait_newer", lambda: r.wait_newer(0, 0.01))]:
        try:
            call()
            wrong.append(what)
        except cuda_ipc.NotSupported:
            pass
    r.close()  # a forked child's copy: the parent's parked generation stays
    del r
    os._exit(1 if wrong else 0)
_, status = os.waitpid(pid, 0)
assert status == 0, status
h = r.wait_newer(0, timeout=5)
assert h.generation == 1 and h.read("w") == bytes(range(16)), h
h.release()
r.close()
with w.begin(timeout=5) as u:  # in place: nothing of the reader is held any more
    pass
w.close()
print("ok", flush=True)
"""


def test_a_forked_child_leaves_the_parents_parked_generation_alone(name):
    p = child(PARKED_IN_A_FORKED_CHILD, name)
    try:
        out, err = p.communicate(timeout=ANSWER * 2)
    finally:
        p.kill()
    assert p.returncode == 0 and out.split() == ["ok"], (p.returncode, out, err)


def test_close_aborts_an_open_update_and_a_holds_generation_outlives_its_release(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    g = write_gen(w, None)
    r = cuda_ipc.TensorSetReader(name)
    with r.current() as h:
        pass
    assert h.generation == g and not h.held  # readable after the release
    u = w.begin(timeout=ANSWER)
    w.close()  # aborts the open update, then closes
    with pytest.raises(cuda_ipc.TensorSetClosed):  # the update's calls say why it is gone
        u.commit()
    w.close()  # twice: nothing
    assert not (SHM / f"cuda-ipc.ts.{name}").exists()
    with pytest.raises((cuda_ipc.TensorSetClosed, cuda_ipc.Timeout)):
        r.wait_newer(g, timeout=1.0)
    r.close()


def test_shapes_too_large_or_not_ints_and_names_not_str_are_invalid_arguments_naming_the_type(name):
    # As every argument the library takes: InvalidArgument (a ValueError), naming the tensor and
    # the type given.
    for shape in ((2**63, 4), 2**64, (4, -(2**70))):
        with pytest.raises(cuda_ipc.InvalidArgument, match='tensor "w".*64 bits'):
            cuda_ipc.TensorSetWriter(name, {"w": (shape, "float32")}, memory="host")
    for shape, got in ((("4", 4), "str"), ((4.5,), "float"), ((None,), "NoneType"), (4.0, "float"),
                       ("44", "str"), (None, "NoneType"), (b"\x04", "bytes")):
        with pytest.raises(cuda_ipc.InvalidArgument, match=f'tensor "w".*got {got}'):
            cuda_ipc.TensorSetWriter(name, {"w": (shape, "float32")}, memory="host")
    for key, got in ((1, "int"), (b"w", "bytes"), (None, "NoneType")):
        with pytest.raises(cuda_ipc.InvalidArgument, match=f"tensor names must be str, got {got}"):
            cuda_ipc.TensorSetWriter(name, {key: ((4,), "float32")}, memory="host")
    with pytest.raises(cuda_ipc.InvalidArgument, match="not UTF-8"):
        cuda_ipc.TensorSetWriter(name, {"a\udc80": ((4,), "float32")}, memory="host")
    # A spec that is neither a tensor nor a pair; a pair may be any sequence of two.
    for spec in ("float32", 4, ((4,), "float32", 1), None):
        with pytest.raises(cuda_ipc.InvalidArgument, match=r'tensor "w": give a torch.Tensor or a \(shape, dtype\) pair'):
            cuda_ipc.TensorSetWriter(name, {"w": spec}, memory="host")
    assert not (SHM / f"cuda-ipc.ts.{name}").exists()
    w = cuda_ipc.TensorSetWriter(name, {"w": [[4], "float32"]}, memory="host")
    w.close()
    # Counts say their own range.
    for kwargs, want in ((dict(max_readers=0), "max_readers must be an int from 1 to 64, got 0"),
                         (dict(mode="buffered", buffers=17), "buffers must be an int from 2 to 16, got 17")):
        with pytest.raises(cuda_ipc.InvalidArgument, match=want):
            cuda_ipc.TensorSetWriter(name, SPECS, memory="host", **kwargs)
    with pytest.raises(cuda_ipc.InvalidArgument, match="buffers must be an int from 1 to 16, got 0"):
        cuda_ipc.Producer(name, 64, memory="host", buffers=0)


def test_a_dimensions_own_exception_goes_up_and_a_dict_changed_meanwhile_changes_nothing(name):
    # What a dimension's `__index__` raises is the caller's: it goes up as it was (it was made an
    # InvalidArgument, a KeyboardInterrupt included).
    class Raises:
        def __init__(self, e):
            self.e = e

        def __index__(self):
            raise self.e

    for e in (KeyboardInterrupt(), RuntimeError("mine")):
        with pytest.raises(type(e)):
            cuda_ipc.TensorSetWriter(name, {"w": ((Raises(e),), "uint8")}, memory="host")
    # A dimension (or a dtype's `__str__`) that changes the dict while it is read: the specs are
    # the items the dict had when it was given (this raised a Rust panic, "dictionary changed
    # size during iteration").
    specs = {}

    class Grows:
        def __index__(self):
            specs.clear()
            specs.update({f"x{i}": ((1,), "uint8") for i in range(10)})
            return 4

    class Dtype:
        def __str__(self):
            specs.pop("b", None)
            return "uint8"

    specs["a"] = ((Grows(),), "uint8")
    specs["b"] = ((2,), Dtype())
    w = cuda_ipc.TensorSetWriter(name, specs, memory="host")
    try:
        assert w.names == ["a", "b"]
    finally:
        w.close()


def test_a_bool_dimension_is_an_invalid_argument_as_for_every_integer_argument(name):
    # `True` is an int to Python (1): it was taken as a dimension of 1.
    for shape in ((True,), (4, False), True, [2, True]):
        with pytest.raises(cuda_ipc.InvalidArgument, match="got a bool"):
            cuda_ipc.TensorSetWriter(name, {"w": (shape, "float32")}, memory="host")
    assert not (SHM / f"cuda-ipc.ts.{name}").exists()


def test_buffers_is_refused_with_mode_in_place_and_defaults_to_two_when_buffered(name):
    # An in-place set has one buffer: `buffers` given with it meant nothing and was ignored.
    for n in (5, 2, 1):
        with pytest.raises(cuda_ipc.InvalidArgument, match='buffers=%d with mode="in_place"' % n):
            cuda_ipc.TensorSetWriter(name, SPECS, memory="host", mode="in_place", buffers=n)
    assert not (SHM / f"cuda-ipc.ts.{name}").exists()
    # Not given (or None), the defaults work as before.
    for kwargs in ({}, dict(mode="in_place"), dict(buffers=None), dict(mode="buffered"), dict(mode="buffered", buffers=3)):
        w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", **kwargs)
        try:
            assert write_gen(w, 1) == 1
        finally:
            w.close()


def test_buffers_out_of_range_says_the_range_a_buffered_set_takes(name):
    # A buffered set takes 2 to 16 buffers; its refusals said "from 1 to 16", though 1 was refused
    # too (with another message), and an in-place set given buffers=0 or -1 was told that range
    # instead of that it takes no count at all.
    for n, got in ((0, "0"), (1, "1"), (17, "17"), (-1, "-1"), (2**200, "an int beyond 128 bits"), (True, r"a bool \(True\)")):
        with pytest.raises(cuda_ipc.InvalidArgument, match="buffers must be an int from 2 to 16, got " + got):
            cuda_ipc.TensorSetWriter(name, SPECS, memory="host", mode="buffered", buffers=n)
    for n, got in ((0, "0"), (-1, "-1"), (99, "99"), (2**200, "an int beyond 128 bits"), (False, r"a bool \(False\)")):
        with pytest.raises(cuda_ipc.InvalidArgument, match=r'buffers=%s with mode="in_place", which has one buffer' % got):
            cuda_ipc.TensorSetWriter(name, SPECS, memory="host", mode="in_place", buffers=n)
    assert not (SHM / f"cuda-ipc.ts.{name}").exists()
    for n in (2, 16):
        w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", mode="buffered", buffers=n)
        try:
            assert write_gen(w, 1) == 1
        finally:
            w.close()


def test_write_refuses_python_objects_and_items_of_another_size_but_copies_plain_bytes(name):
    import array
    import ctypes

    w = cuda_ipc.TensorSetWriter(name, {"w": ((4,), "float32"), "ids": ((2,), "int64")}, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    try:
        with w.begin(timeout=ANSWER) as u:
            # A buffer of Python objects (format "O", as a NumPy array of dtype=object): its
            # bytes are pointers into this process.
            objects = (ctypes.py_object * 2)(object(), object())
            assert memoryview(objects).format.endswith("O")
            for t in ("w", "ids"):  # "ids": the pointers' size is the element's, still refused
                with pytest.raises(cuda_ipc.InvalidArgument, match="Python objects"):
                    u.write(t, objects)
            # Items of another size than the tensor's elements: float64 into float32.
            doubles = array.array("d", [1.0, 2.0])
            with pytest.raises(cuda_ipc.InvalidArgument, match="items of 8 bytes.*convert"):
                u.write("w", doubles)
            # The same size is copied bit for bit; plain bytes into anything.
            floats = array.array("f", [1.0, 2.0, 3.0, 4.0])
            u.write("w", floats)
            u.write("ids", memoryview(doubles).cast("B"))
        with r.current() as h:
            assert h.read("w") == floats.tobytes()
            assert h.read("ids") == doubles.tobytes()
    finally:
        r.close()
        w.close()


def test_holder_exceptions_are_importable_and_typed():
    assert issubclass(cuda_ipc.NotHoldable, cuda_ipc.NotSupported)
    assert issubclass(cuda_ipc.NoHolderSlot, cuda_ipc.CudaIpcError)
    # A reader that finds the writer dead and no holder still sees a WriterGone.
    assert issubclass(cuda_ipc.NoServer, cuda_ipc.WriterGone)
    for cls in (cuda_ipc.NotHoldable, cuda_ipc.NoHolderSlot, cuda_ipc.NoServer):
        assert issubclass(cls, cuda_ipc.CudaIpcError)
        assert cls.__module__ == "cuda_ipc" and cls.__doc__


def test_a_host_set_cannot_be_held_nor_served(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    try:
        with pytest.raises(cuda_ipc.NotHoldable, match="host set"):
            cuda_ipc.TensorSetHolder(name)
        with pytest.raises(cuda_ipc.NotHoldable, match="host set"):
            cuda_ipc.TensorSetReader(name, serve=True)
        # Neither left a reader slot or anything else behind: a plain reader opens and reads.
        g = write_gen(w, None)
        with cuda_ipc.TensorSetReader(name) as r, r.current() as h:
            assert h.generation == g and h.read("ids") == data(g, "ids", SIZES["ids"])
    finally:
        w.close()
    with pytest.raises(cuda_ipc.TensorSetNotFound):
        cuda_ipc.TensorSetHolder(name)


def test_stable_addresses_on_a_host_set_are_refused(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    try:
        with pytest.raises(cuda_ipc.NotSupported, match="stable addresses need a VMM set"):
            cuda_ipc.TensorSetReader(name, stable_addresses=True)
        r = cuda_ipc.TensorSetReader(name)
        assert r.stable_generation is None and r.writerless is False
        with pytest.raises(cuda_ipc.InvalidArgument, match="stable_addresses"):
            r.stable_tensors()
        with pytest.raises(cuda_ipc.InvalidArgument, match="stable_addresses"):
            r.release_stable()
        g = write_gen(w, None)
        h = r.current()
        assert h.generation == g and h.held
        with pytest.raises(cuda_ipc.InvalidArgument, match="stable_addresses"):
            r.switch_stable(h)
        # The hold was consumed (released on the error): not usable as a hold any more.
        assert not h.held and h.generation == g
        with pytest.raises(cuda_ipc.InvalidArgument, match="released"):
            r.switch_stable(h)
        with pytest.raises(TypeError):
            r.switch_stable("not a hold")
        # The writer is not blocked by the consumed hold: an in-place update goes through.
        assert write_gen(w, None) == g + 1
        r.close()
    finally:
        w.close()


def test_open_timings_name_every_phase_in_microseconds(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    try:
        with cuda_ipc.TensorSetReader(name) as r:
            t = r.open_timings()
            keys = ["manifest", "tables", "fingerprint", "fd_fetch", "map", "join", "join_gpu",
                    "join_wait", "fd_peer", "fd_connect", "fd_reply", "spawn", "finish", "total"]
            assert list(t) == keys
            assert all(isinstance(v, float) and v >= 0.0 for v in t.values())
            # A host set: nothing fetched, no GPU objects, no join thread; the phases run one
            # after the other.
            assert t["fd_fetch"] == 0.0 and t["join_gpu"] == 0.0 and t["spawn"] == 0.0
            assert t["fd_peer"] == t["fd_connect"] == t["fd_reply"] == 0.0
            assert 0.0 < t["finish"] <= t["total"]
            assert t["manifest"] > 0.0 and t["total"] > 0.0
            # A host set's tables are decoded on the opening thread: part of the manifest's time.
            assert 0.0 < t["tables"] <= t["manifest"]
            assert t["total"] >= t["manifest"] + t["map"] + t["join"] - 1.0
            assert t["total"] < 10e6  # under 10 s: the unit is microseconds, not nanoseconds
            assert r.open_timings() == t  # measured once, at open
    finally:
        w.close()


def test_a_fingerprinted_commit_is_verified_and_a_false_one_refused(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", mode="buffered", buffers=2)
    r = cuda_ipc.TensorSetReader(name)
    try:
        u = w.begin(timeout=ANSWER)
        for t, n in SIZES.items():
            u.write(t, data(1, t, n))
        with pytest.raises(cuda_ipc.InvalidArgument):
            u.commit(content=bytes(32), fingerprint=True)
        before = u.fingerprint()
        assert len(u.tensor_digests()) == 3
        g1 = u.commit(fingerprint=True)
        with r.current() as h:
            assert h.generation == g1
            h.verify_content()
            fp = h.fingerprint()
            assert len(fp) == 32 and h.content == fp == before
            d1 = h.tensor_digests()
            assert [len(d) for d in d1] == [16, 16, 16]
        # One tensor changed, and a fingerprint that is not the bytes'.
        u = w.begin(timeout=ANSWER)
        for t, n in SIZES.items():
            u.write(t, data(1 if t != "b" else 2, t, n))
        u.commit(content=b"\x07" * 32)
        with r.wait_newer(g1, timeout=ANSWER) as h:
            with pytest.raises(cuda_ipc.ContentMismatch) as e:
                h.verify_content()
            assert e.value.generation == h.generation
            assert e.value.committed == b"\x07" * 32 and e.value.expected is None
            assert e.value.computed == h.fingerprint()
            d2 = h.tensor_digests()
            assert [a != b for a, b in zip(d1, d2)] == [False, True, False]
        # A reader demanding generation 1's weights refuses the newest generation.
        strict = cuda_ipc.TensorSetReader(name, expect_content=bytearray(fp))
        with pytest.raises(cuda_ipc.ContentMismatch) as e:
            strict.current()
        assert e.value.generation == g1 + 1 and e.value.expected == fp
        assert e.value.committed == b"\x07" * 32 and e.value.computed is None
        strict.close()
        with pytest.raises(cuda_ipc.InvalidArgument):
            cuda_ipc.TensorSetReader(name, expect_content=b"short")
    finally:
        r.close()
        w.close()


def closed_reader_calls(r, hold):
    """Every call of a `TensorSetReader` but `name` and `close`, each as it would be made."""
    import asyncio

    return {
        "current": [lambda: r.current(), lambda: r.current(timeout=None)],
        "wait_newer": [lambda: r.wait_newer(0, timeout=ANSWER), lambda: r.wait_newer(10**9)],
        "wait_newer_async": [lambda: asyncio.run(r.wait_newer_async(10**9))],
        "imports": [lambda: r.imports],
        "read_only": [lambda: r.read_only],
        "layout_fingerprint": [lambda: r.layout_fingerprint],
        "names": [lambda: r.names],
        "incarnation": [lambda: r.incarnation],
        "writerless": [lambda: r.writerless],
        "writer_alive": [lambda: r.writer_alive],
        "open_timings": [lambda: r.open_timings()],
        "switch_stable": [lambda: r.switch_stable(hold)],
        "stable_tensors": [lambda: r.stable_tensors()],
        "stable_generation": [lambda: r.stable_generation],
        "release_stable": [lambda: r.release_stable()],
    }


def public(cls):
    return {a for a in dir(cls) if not a.startswith("_")}


def test_every_call_of_a_closed_reader_raises_tensor_set_closed_naming_the_reader(name):
    """After `close()` every call of a reader but `name` and `close` raises `TensorSetClosed`
    (what the writer's close raises, so a loop stopping at it stops for either), its message
    naming this reader, not the writer (whose set is still published): the waits without a
    bound, the awaitable, the getters and the stable-address calls alike. `close()` twice does
    nothing. A hold taken before the close stays readable until released; the closed reader
    does not switch it (nor does another reader: not its hold), and it stays held."""
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", mode="buffered", buffers=2)
    r = cuda_ipc.TensorSetReader(name)
    other = cuda_ipc.TensorSetReader(name)
    try:
        u = w.begin(timeout=ANSWER)
        for t, n in SIZES.items():
            u.write(t, data(1, t, n))
        g = u.commit(fingerprint=True)
        h = r.current()
        r.close()
        r.close()  # twice: nothing
        calls = closed_reader_calls(r, h)
        assert public(cuda_ipc.TensorSetReader) == set(calls) | {"name", "close"}
        for what, ways in calls.items():
            for call in ways:
                with pytest.raises(cuda_ipc.TensorSetClosed) as e:
                    call()
                assert str(e.value) == (
                    f'this reader of tensor set "{name}" is closed '
                    "(by its own close(), not by the writer)"
                ), what
                assert not isinstance(e.value, cuda_ipc.InvalidArgument), what
        assert r.name == name and repr(r) == f'TensorSetReader("{name}")'
        with r:  # `with` over a closed reader closes it again: nothing
            pass
        # The hold outlives its reader's close, and the closed reader did not consume it.
        assert h.held and h.generation == g and h.whole is True
        assert h.read("ids") == data(1, "ids", SIZES["ids"])
        h.verify_content()
        assert h.fingerprint() == h.content and len(h.tensor_digests()) == 3
        with pytest.raises(cuda_ipc.InvalidArgument, match="not another reader's"):
            other.switch_stable(h)
        assert h.held
        h.release()
        # The writer was not closed: an open reader goes on reading.
        with other.current() as o:
            assert o.generation == g
        assert w.generation == g and write_gen(w, None) == g + 1
    finally:
        other.close()
        w.close()


def test_a_wait_of_a_reader_closed_from_another_thread_raises_tensor_set_closed(name):
    """`wait_newer` and `current(timeout=None)` waiting without a bound in other threads raise
    `TensorSetClosed` naming the reader within 1 s of its `close()` from this thread."""
    import threading

    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    outcomes = [{}, {}]

    def wait(call, out):
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001
            out["error"], out["at"] = e, time.monotonic()

    threads = [
        threading.Thread(target=wait, args=(lambda: r.wait_newer(0), outcomes[0])),
        threading.Thread(target=wait, args=(lambda: r.current(timeout=None), outcomes[1])),
    ]
    try:
        for t in threads:
            t.start()
        time.sleep(0.2)
        assert all(t.is_alive() for t in threads), outcomes
        closing = time.monotonic()
        r.close()
        for t in threads:
            t.join(ANSWER)
        assert not any(t.is_alive() for t in threads)
        for o in outcomes:
            assert isinstance(o.get("error"), cuda_ipc.TensorSetClosed), o
            assert "this reader of tensor set" in str(o["error"]), o
            assert o["at"] - closing < 1.0, o["at"] - closing
    finally:
        r.close()
        w.close()


# ---------------------------------------------------------------- argument checks

BAD_SECONDS = [-1, -1e300, float("nan"), float("inf"), 1e9 + 1, 2**64, True]


@pytest.mark.parametrize("value", BAD_SECONDS, ids=lambda v: repr(v)[:12])
def test_current_checks_its_timeout_also_when_a_generation_is_there(name, value):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    try:
        for _ in range(2):  # before the first generation, and with one
            with pytest.raises(cuda_ipc.InvalidArgument, match="^invalid argument: timeout must be a number of seconds"):
                r.current(timeout=value)
            write_gen(w, 1)
    finally:
        r.close()
        w.close()


# Integer arguments out of their range: `InvalidArgument` naming the argument and the range.
BAD_INTS = [
    ("max_readers", dict(max_readers=-1)),
    ("max_readers", dict(max_readers=2**64)),
    ("buffers", dict(mode="buffered", buffers=-1)),
    ("device", dict(device=-1)),
    ("device", dict(device=2**40)),
]


@pytest.mark.parametrize("arg, kwargs", BAD_INTS, ids=[f"{a}{i}" for i, (a, _) in enumerate(BAD_INTS)])
def test_out_of_range_ints_raise_invalid_argument_naming_the_argument(name, arg, kwargs):
    with pytest.raises(cuda_ipc.InvalidArgument, match=f"^invalid argument: {arg} must be an int from -?[0-9]+ to [0-9]+, got "):
        cuda_ipc.TensorSetWriter(name, SPECS, **{"memory": "host", **kwargs})
    assert not (SHM / f"cuda-ipc.ts.{name}").exists()


def test_wait_newer_and_reader_device_out_of_range_raise_invalid_argument(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    try:
        for than in (-1, 2**64):
            with pytest.raises(cuda_ipc.InvalidArgument, match="^invalid argument: than must be an int from 0 to "):
                r.wait_newer(than, timeout=0.1)
            with pytest.raises(cuda_ipc.InvalidArgument, match="^invalid argument: than must be an int from 0 to "):
                r.wait_newer_async(than, timeout=0.1)
        with pytest.raises(cuda_ipc.InvalidArgument, match="^invalid argument: device must be an int from 0 to "):
            cuda_ipc.TensorSetReader(name, device=-1)
    finally:
        r.close()
        w.close()


@pytest.mark.parametrize(
    "shape",
    [(2**61,), (2**60, 2), (2**31, 2**30)],  # 2**63 bytes of float32: past isize::MAX, no overflow
)
def test_a_tensor_past_what_an_allocation_holds_is_an_invalid_argument_naming_it(name, shape):
    with pytest.raises(cuda_ipc.InvalidArgument, match="tensor .*\"w\".*9223372036854775808 bytes"):
        cuda_ipc.TensorSetWriter(name, {"w": (shape, "float32")}, memory="host")
    # Each one fits, the set does not.
    half = {"a": ((2**60,), "float32"), "b": ((2**60,), "float32")}
    with pytest.raises(cuda_ipc.InvalidArgument, match="the set's size passes"):
        cuda_ipc.TensorSetWriter(name, half, memory="host")
    assert not (SHM / f"cuda-ipc.ts.{name}").exists()


def test_a_refused_publish_keeps_the_generation_of_an_in_place_set(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    try:
        g = write_gen(w, 1)
        for bad in ([1, 2], "w", None):
            with pytest.raises(cuda_ipc.InvalidArgument, match="publish takes a dict"):
                w.publish(bad)
        with pytest.raises(cuda_ipc.InvalidArgument, match="timeout"):
            w.publish({}, timeout=-1)
        with r.current() as h:
            assert h.generation == g
            assert h.read("w") == data(g, "w", SIZES["w"])
        assert w.generation == g
        assert write_gen(w, 2) == g + 1  # the writer is free
    finally:
        r.close()
        w.close()


def test_a_refused_commit_keeps_the_update_open(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    try:
        u = w.begin(timeout=ANSWER)
        for t, n in SIZES.items():
            u.write(t, data(1, t, n))
        for bad in (dict(content=b"short"), dict(content=bytes(32), fingerprint=True)):
            with pytest.raises(cuda_ipc.InvalidArgument):
                u.commit(**bad)
        with pytest.raises(TypeError):
            u.commit(content=5)
        assert u.commit() == 1
    finally:
        w.close()


def test_an_unverifiable_generation_names_the_python_call_that_fingerprints(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    try:
        write_gen(w, 1)  # committed without a fingerprint
        with r.current() as h:
            with pytest.raises(cuda_ipc.ContentMismatch) as e:
                h.verify_content()
        text = str(e.value)
        assert "commit(fingerprint=True)" in text and "commit_fingerprinted" not in text, text
    finally:
        r.close()
        w.close()


def test_tensors_publish_and_copy_from_of_a_host_set_without_pytorch_raise_a_clear_import_error(name):
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("PyTorch is installed (test_tensorset_torch_host.py covers tensors())")
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    try:
        write_gen(w, 1)
        with r.current() as h:
            with pytest.raises(ImportError, match="needs PyTorch.*TensorHold.read\\(name\\)"):
                h.tensors()
            assert h.read("ids") == data(1, "ids", SIZES["ids"])
        with w.begin(timeout=ANSWER) as u:
            with pytest.raises(ImportError, match="needs PyTorch.*TensorUpdate.write"):
                u.tensors()
            # The calls that read torch.Tensor sources say the same (they raised a bare
            # ModuleNotFoundError), and change nothing.
            with pytest.raises(ImportError, match="copy_from.*needs PyTorch.*TensorUpdate.write"):
                u.copy_from({"w": object()})
            u.abort()
        with pytest.raises(ImportError, match="publish.*needs PyTorch.*TensorUpdate.write"):
            w.publish({})
        assert w.generation == 1
    finally:
        r.close()
        w.close()


# ---------------------------------------------------------------- Ctrl-C during close()

def test_ctrl_c_interrupts_a_writer_close_waiting_for_a_hold_and_close_can_finish(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    g = write_gen(w, 1)
    h = r.current()  # held: close() waits for it
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    try:
        start = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            w.close(timeout=30)
        took = time.monotonic() - start
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
    assert took < 0.3 + 2.0, f"KeyboardInterrupt {took:.3f} s into close()"
    # Interrupted: closed (its names gone, no update), the memory still there for the hold.
    with pytest.raises(cuda_ipc.TensorSetClosed):
        w.begin(timeout=0)
    with pytest.raises(cuda_ipc.TensorSetNotFound):
        cuda_ipc.TensorSetReader(name)
    assert h.read("w") == data(g, "w", SIZES["w"])
    h.release()
    start = time.monotonic()
    w.close(timeout=ANSWER)  # finishes, at once now that nothing is held
    assert time.monotonic() - start < ANSWER / 2
    w.close()
    r.close()


def test_wait_readers_lets_a_waiting_reader_take_the_last_generation_before_the_close(name):
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    write_gen(w, 1)
    r = cuda_ipc.TensorSetReader(name)
    assert w.wait_readers(0) is True, "a reader opened after the commit starts at it"
    write_gen(w, 2)
    t = time.monotonic()
    assert w.wait_readers(0.1) is False, "the reader has not taken generation 2"
    assert time.monotonic() - t >= 0.1
    # A reader waiting for a newer generation when the writer commits its last and closes: with
    # wait_readers first, it gets that generation rather than TensorSetClosed.
    got = []
    waiting = threading.Thread(target=lambda: got.append(r.wait_newer(2, timeout=10)))
    waiting.start()
    time.sleep(0.05)
    write_gen(w, 3)
    assert w.wait_readers(10) is True
    waiting.join(10)
    assert got and got[0].generation == 3, got
    got[0].release()
    w.close()
    with pytest.raises(cuda_ipc.TensorSetClosed):
        w.wait_readers(0)
    with pytest.raises(cuda_ipc.InvalidArgument):
        cuda_ipc.TensorSetWriter(name + "-x", SPECS, memory="host").wait_readers(-1)
    r.close()


def test_close_while_another_thread_waits_in_begin_grants_no_hold_from_its_start(name):
    # Buffered, both buffers held: a second thread waits in begin() with the writer. A close()
    # from a third thread takes every generation from readers at once, not only once that begin
    # gives the writer back (up to a 50 ms slice later), and returns once the earlier holds end.
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", mode="buffered", buffers=2)
    write_gen(w, 1)
    r = cuda_ipc.TensorSetReader(name)
    first = r.current()
    write_gen(w, 2)
    second = r.current()
    errors = []

    def begin():
        try:
            w.begin(timeout=10)
        except cuda_ipc.TensorSetClosed:
            pass
        except Exception as e:
            errors.append(e)

    waiting = threading.Thread(target=begin)
    waiting.start()
    time.sleep(0.2)
    closed_at, done = [], []

    def close():
        closed_at.append(time.monotonic())
        w.close(timeout=5)
        done.append(time.monotonic())

    closing = threading.Thread(target=close)
    closing.start()
    late = []
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        asked = time.monotonic()
        try:
            h = r.current()
        except cuda_ipc.TensorSetClosed:
            continue
        if h is None:
            continue
        if closed_at and asked > closed_at[0] + 0.005:
            late.append(h)
        else:
            h.release()  # taken before the close began: the close waits for it, so let it go
    assert late == [], f"{len(late)} holds granted after close() began"
    first.release()
    second.release()
    closing.join(10)
    waiting.join(10)
    assert not errors, errors
    assert done and done[0] - closed_at[0] < 2.0, "close() waited for holds granted after it began"
    r.close()


def test_a_reader_given_a_device_opens_a_host_set_as_its_writer_did(name):
    # The writer takes `device` (its default 0) with memory="host" and never uses it; a reader
    # given one opens the host set too, also where no CUDA device or driver is there.
    w = cuda_ipc.TensorSetWriter(name, {"a": ((4,), "uint8")}, memory="host", device=0)
    with w.begin(timeout=ANSWER) as u:
        u.write("a", b"abcd")
    del u
    r = cuda_ipc.TensorSetReader(name, device=0)
    try:
        with r.current() as h:
            assert h.read("a") == b"abcd"
    finally:
        r.close()
        w.close()


# ---------------------------------------------------------------- close(timeout=None); an
# update's generation after its end; bytes-like arguments; counts of one byte


def test_close_with_timeout_none_waits_without_bound_on_a_producer_and_a_writer(name):
    """`close(timeout=None)` waits without a bound, as every `timeout=None` does, on both classes
    whose close takes a timeout: a producer's and a writer's close each wait for a hold released
    5.5 s later (past the default 5 s), force nothing and return once it is released. A value out
    of range (a bool included) is still an `InvalidArgument` that closes nothing."""
    tx = cuda_ipc.Producer(name, 64, buffers=2, memory="host")
    rx = cuda_ipc.Consumer(name)
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    try:
        for close in (tx.close, w.close):
            for bad in (-1, float("nan"), True, 1e10):
                with pytest.raises(cuda_ipc.InvalidArgument, match=r"\(None waits forever\)"):
                    close(bad)
            with pytest.raises(TypeError):  # not a number: as every timeout's
                close("5")
        with tx.acquire(timeout=ANSWER) as f:
            f.publish(b"held")
        frame = rx.recv(timeout=ANSWER)
        g = write_gen(w, None)
        hold = r.current()
        assert frame.held and hold.held and hold.generation == g

        def release():
            frame.release()
            hold.release()

        got = {}

        def closing(what, call):
            def run():
                got[what] = (call(), time.monotonic())

            return threading.Thread(target=run, daemon=True)

        threads = [
            closing("producer", lambda: tx.close(None)),
            closing("writer", lambda: w.close(timeout=None)),
        ]
        releaser = threading.Timer(5.5, release)
        start = time.monotonic()
        releaser.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(ANSWER * 2)
        releaser.join()
        assert got["producer"][0] == {"forced_holds": 0, "consumers_behind": 0}, got
        assert got["writer"][0] is None, got
        for what, (_, at) in got.items():
            assert at - start >= 5.4, f"{what}'s close(None) returned {at - start:.2f} s in"
        assert not (SHM / f"cuda-ipc.ts.{name}").exists()
        assert not (SHM / f"cuda-ipc.ch.{name}").exists()
        # Closed: again with None does nothing, at once.
        assert tx.close(None) == {"forced_holds": 0, "consumers_behind": 0}
        w.close(None)
    finally:
        rx.close()
        r.close()
        tx.close(0)
        w.close(0)
        for prefix in ("cuda-ipc.ch.", "cuda-ipc.hp."):
            p = SHM / f"{prefix}{name}"
            if p.exists():
                p.unlink()


def ended_update_calls(u):
    """Every public member of a `TensorUpdate` but `generation`, `buffer` and `abort`, each as it
    would be made: what acts on the update's buffer."""
    return {
        "tensors": lambda: u.tensors(),
        "copy_from": lambda: u.copy_from({}),
        "copy_from_previous": lambda: u.copy_from_previous(),
        "write": lambda: u.write("ids", b"x"),
        "fingerprint": lambda: u.fingerprint(),
        "tensor_digests": lambda: u.tensor_digests(),
        "commit": lambda: u.commit(),
    }


def test_an_ended_updates_generation_and_buffer_stay_readable_and_its_other_calls_raise(name):
    """As a released hold's `generation`, a committed or aborted update's `generation` and
    `buffer` answer: the generation it published (what `commit()` returned), or, aborted, the one
    it would have published, which the writer's next update takes; and the buffer it wrote. Every
    other call raises, `InvalidArgument` once committed or aborted and `TensorSetClosed` once the
    writer's `close()` aborted it; `abort()` again does nothing. Every public member of
    `TensorUpdate` is classed here, so a new one is too."""
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", mode="buffered", buffers=2)

    def ended(u, generation, buffer, error):
        calls = ended_update_calls(u)
        assert public(cuda_ipc.TensorUpdate) == set(calls) | {"generation", "buffer", "abort"}
        for what, call in calls.items():
            with pytest.raises(error) as e:
                call()
            assert not isinstance(e.value, cuda_ipc.NotSupported), what
            if error is cuda_ipc.InvalidArgument:
                assert "committed or aborted" in str(e.value), (what, e.value)
        u.abort()  # nothing: ended already
        assert (u.generation, u.buffer) == (generation, buffer)
        assert repr(u) == "TensorUpdate(finished)"

    try:
        # Committed by the end of a `with` block.
        with w.begin(timeout=ANSWER) as u:
            g, b = u.generation, u.buffer
            u.write("ids", data(g, "ids", SIZES["ids"]))
        assert g == 1 == w.generation
        ended(u, 1, b, cuda_ipc.InvalidArgument)
        # By commit(): the generation it returned.
        u = w.begin(timeout=ANSWER)
        b = u.buffer
        assert u.commit() == 2
        ended(u, 2, b, cuda_ipc.InvalidArgument)
        # Aborted: the generation it would have published, which the next update takes.
        u = w.begin(timeout=ANSWER)
        b = u.buffer
        assert u.generation == 3
        u.abort()
        ended(u, 3, b, cuda_ipc.InvalidArgument)
        nxt = w.begin(timeout=ANSWER)
        assert nxt.generation == 3 and w.generation == 2
        # Aborted by the writer's close().
        b = nxt.buffer
        w.close()
        ended(nxt, 3, b, cuda_ipc.TensorSetClosed)
    finally:
        w.close()


def test_bytes_like_fingerprints_are_taken_alike_and_one_byte_is_said_so(name):
    """A reader's `expect_layout` takes what its `expect_content` and `commit(content=...)` take:
    `bytes` or any buffer; a str is the same `TypeError` for each, a wrong length the same
    `InvalidArgument`, which counts one byte in the singular."""
    import array

    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    try:
        fp = w.layout_fingerprint
        for kind in (bytes, bytearray, lambda b: memoryview(b"x" + b)[1:], lambda b: array.array("I", b)):
            r = cuda_ipc.TensorSetReader(name, expect_layout=kind(fp))
            r.close()
        u = w.begin(timeout=ANSWER)
        for arg, call in (
            ("expect_layout", lambda v: cuda_ipc.TensorSetReader(name, expect_layout=v)),
            ("expect_content", lambda v: cuda_ipc.TensorSetReader(name, expect_content=v)),
            ("content", lambda v: u.commit(content=v)),
        ):
            for bad in ("x" * 32, 5):
                with pytest.raises(TypeError):
                    call(bad)
            with pytest.raises(cuda_ipc.InvalidArgument) as e:
                call(bytearray(1))
            assert str(e.value) == f"invalid argument: {arg} is 1 byte; a fingerprint has 32"
            with pytest.raises(cuda_ipc.InvalidArgument) as e:
                call(memoryview(bytes(33)))
            assert str(e.value) == f"invalid argument: {arg} is 33 bytes; a fingerprint has 32"
        assert u.commit(content=array.array("B", bytes(range(32)))) == 1
    finally:
        w.close()


def test_a_write_past_a_one_byte_tensor_counts_one_byte_in_the_singular(name):
    """Counts of one are said in the singular: a write of 2 bytes into a tensor of 1 byte, items
    of 1 byte given to a float32 tensor and items of 2 bytes to a 1-byte dtype, a writer of one
    tensor."""
    import array

    w = cuda_ipc.TensorSetWriter(name, {"one": ((1,), "uint8"), "f": ((2,), "float32")}, memory="host")
    try:
        u = w.begin(timeout=ANSWER)
        with pytest.raises(cuda_ipc.InvalidArgument) as e:
            u.write("one", b"xy")
        assert str(e.value) == 'invalid argument: 2 bytes into tensor "one" of 1 byte'
        with pytest.raises(cuda_ipc.InvalidArgument) as e:
            u.write("f", array.array("b", b"abcd"))  # signed chars: items, not plain bytes
        assert 'has elements of 4 bytes (' in str(e.value), e.value
        assert 'data has items of 1 byte (format "b")' in str(e.value), e.value
        with pytest.raises(cuda_ipc.InvalidArgument) as e:
            u.write("one", array.array("h", [1]))
        assert "has elements of 1 byte (" in str(e.value), e.value
        assert "data has items of 2 bytes" in str(e.value), e.value
        u.write("one", b"z")
        assert u.commit() == 1
        assert repr(w).startswith(f'TensorSetWriter("{name}", 2 tensors, '), repr(w)
    finally:
        w.close()
    one = cuda_ipc.TensorSetWriter(name, {"one": ((1,), "uint8")}, memory="host")
    try:
        per = "1 byte" if one.nbytes == 1 else f"{one.nbytes} bytes"
        assert repr(one) == f'TensorSetWriter("{name}", 1 tensor, {per} per buffer, generation 0)'
    finally:
        one.close()


# A `str` with a lone surrogate (what `os.fsdecode` makes of bytes that are no UTF-8) has no
# UTF-8 spelling: every text argument of the API says so as `InvalidArgument` naming the argument,
# never Python's `UnicodeEncodeError`, and makes nothing.
LONE = "a\udcff"


def _in_update(n, call):
    w = cuda_ipc.TensorSetWriter(n, SPECS, memory="host")
    try:
        with w.begin(timeout=ANSWER) as u:
            call(u)
    finally:
        w.close()


def _in_hold(n, call):
    w = cuda_ipc.TensorSetWriter(n, SPECS, memory="host")
    try:
        write_gen(w, 1)
        r = cuda_ipc.TensorSetReader(n)
        try:
            with r.current() as h:
                call(h)
        finally:
            r.close()
    finally:
        w.close()


TEXT_ARGS = [
    ("TensorSetWriter", "name", lambda n: cuda_ipc.TensorSetWriter(LONE, SPECS, memory="host")),
    ("TensorSetWriter", "memory", lambda n: cuda_ipc.TensorSetWriter(n, SPECS, memory=LONE)),
    ("TensorSetWriter", "mode", lambda n: cuda_ipc.TensorSetWriter(n, SPECS, memory="host", mode=LONE)),
    ("TensorSetWriter", "quota", lambda n: cuda_ipc.TensorSetWriter(n, SPECS, memory="host", quota=LONE)),
    ("TensorSetWriter", "dtype", lambda n: cuda_ipc.TensorSetWriter(n, {"w": ((4,), LONE)}, memory="host")),
    ("TensorSetWriter", "tensor name", lambda n: cuda_ipc.TensorSetWriter(n, {LONE: ((4,), "uint8")}, memory="host")),
    ("over_tensors", "name", lambda n: cuda_ipc.TensorSetWriter.over_tensors(LONE, {})),
    ("TensorSetReader", "name", lambda n: cuda_ipc.TensorSetReader(LONE)),
    ("TensorSetReader", "wait", lambda n: cuda_ipc.TensorSetReader(n, wait=LONE)),
    ("TensorSetHolder", "name", lambda n: cuda_ipc.TensorSetHolder(LONE)),
    ("TensorUpdate.write", "name", lambda n: _in_update(n, lambda u: u.write(LONE, b""))),
    ("TensorHold.read", "name", lambda n: _in_hold(n, lambda h: h.read(LONE))),
    ("Producer", "name", lambda n: cuda_ipc.Producer(LONE, 64, memory="host")),
    ("Producer", "memory", lambda n: cuda_ipc.Producer(n, 64, memory=LONE)),
    ("Producer", "wait", lambda n: cuda_ipc.Producer(n, 64, memory="host", wait=LONE)),
    ("Producer", "quota", lambda n: cuda_ipc.Producer(n, 64, memory="host", quota=LONE)),
    ("Consumer", "name", lambda n: cuda_ipc.Consumer(LONE)),
    ("Consumer", "delivery", lambda n: cuda_ipc.Consumer(n, delivery=LONE)),
    ("Consumer", "wait", lambda n: cuda_ipc.Consumer(n, wait=LONE)),
    ("Consumer.attach", "name", lambda n: cuda_ipc.Consumer.attach(LONE)),
    ("set_quota", "scope", lambda n: cuda_ipc.set_quota(1 << 20, scope=LONE)),
    ("set_quota", "scope", lambda n: cuda_ipc.set_quota(1 << 20, scope="group:" + LONE)),
    ("remove_quota", "scope", lambda n: cuda_ipc.remove_quota(scope=LONE)),
]


@pytest.mark.parametrize("call, arg, f", TEXT_ARGS, ids=[f"{c}-{a}-{i}" for i, (c, a, _) in enumerate(TEXT_ARGS)])
def test_a_lone_surrogate_in_any_text_argument_is_an_invalid_argument_naming_it(name, call, arg, f):
    with pytest.raises(cuda_ipc.InvalidArgument) as e:
        f(name)
    assert re.fullmatch(rf"invalid argument: {arg} '.*\\udcff': not UTF-8 \(a lone surrogate\)", str(e.value)), e.value
    assert not any(p.name.endswith(name) for p in SHM.iterdir() if not p.name.startswith("cuda-ipc.live"))
    # Another type than `str` is still the conversion's `TypeError`.
    if call in ("TensorSetReader", "Consumer", "TensorSetHolder") and arg == "name":
        with pytest.raises(TypeError, match="is not an instance of 'str'"):
            getattr(cuda_ipc, call)(b"x")
