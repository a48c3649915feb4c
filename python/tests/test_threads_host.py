"""Host-memory tensor sets and channels from many threads of one process, with hostile timing, no
GPU: 12 threads sharing one `TensorSetReader` while a writer thread publishes as fast as it can
(no torn generation, every hold let go); a reader closed under threads that wait and read; a
writer closed while another thread waits in `begin`, loops over updates, or has an update open,
or while reader threads keep taking holds (no hold granted from the close's start);
several threads receiving from one `Consumer` and publishing through one `Producer` (each frame
taken once, with its bytes); `close()` waking every thread blocked on a consumer or a producer;
awaitable waits cancelled while another thread closes their object; and blocking waits that leave
other Python threads running.

Every wait is bounded, every thread joined with a timeout, and a watchdog (`faulthandler`) dumps
every thread's stack and ends the run should a test hang anyway. Ordinary errors of a closed
object are the documented ones: a closed reader's calls raise `TensorSetClosed` (`this reader of
tensor set ... is closed`), as a closed set's do (`... was closed by its writer`), a closed
consumer's `Detached`, a closed producer's `ChannelClosed`. Run: `pip install ./python && pytest python/tests/test_threads_host.py`."""

import _thread
import asyncio
import faulthandler
import gc
import pathlib
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

import cuda_ipc

SHM = pathlib.Path("/dev/shm")
# The longest any single step waits: a thread's end, a close, a generation.
ANSWER = 10.0
# A test that takes longer than this hangs: every thread's stack is printed and the run ends.
HANG = 120.0
# Bytes of each of the set's two tensors, and of a channel's frame.
NBYTES = 4096
SPECS = {"a": ((NBYTES // 4,), "float32"), "b": ((NBYTES // 8,), "int64")}


@pytest.fixture(autouse=True)
def watchdog():
    """A hang fails the run (every thread's stack on stderr) instead of blocking CI."""
    faulthandler.dump_traceback_later(HANG, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def name():
    """A fresh name; whatever segments of it a failed test left behind are removed afterwards."""
    n = f"pytest-threads-{uuid.uuid4().hex[:12]}"
    yield n
    gc.collect()
    for p in SHM.glob(f"cuda-ipc.*.{n}*"):
        p.unlink(missing_ok=True)


def pattern(gen: int) -> bytes:
    """Generation `gen`'s bytes of each tensor: its number in every 8-byte word, so a tensor of
    another generation, half of two generations, or a stale tail are told apart."""
    return gen.to_bytes(8, "little") * (NBYTES // 8)


def write(u) -> int:
    """Writes the update's generation's pattern into both tensors, one after the other (a reader
    whose hold does not keep the writer out would see `a` and `b` of two generations)."""
    g = u.generation
    u.write("a", pattern(g))
    u.write("b", pattern(g))
    return g


def publish_until(w, stop, timeout=0.2):
    """Publishes generations in place as fast as holds allow until `stop` is set; a `begin` that
    times out while a reader holds the buffer tries again."""
    while not stop.is_set():
        try:
            with w.begin(timeout=timeout) as u:
                write(u)
        except cuda_ipc.Timeout:
            pass


def check(h) -> None:
    g = h.generation
    a, b = h.read("a"), h.read("b")
    assert a == pattern(g) and b == pattern(g), f"generation {g} torn: a={a[:8].hex()} b={b[:8].hex()}"


def run(target, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def join(threads, timeout=ANSWER) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still running after {timeout} s: {alive}"


def gil_busy(seconds: float) -> None:
    """Runs Python code on this thread for `seconds`, so that a thread coming back from a wait
    without the GIL waits for it (up to the switch interval) before its next step."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1


def blocked(call):
    """Runs `call` in a thread; returns (thread, outcome): what it returned or raised, and when."""
    outcome = {}

    def body():
        try:
            outcome["value"] = call()
        except BaseException as e:  # noqa: BLE001 - the test looks at what it is
            outcome["error"] = e
        outcome["at"] = time.monotonic()

    return run(body), outcome


def assert_no_hold_left(w, r, buffered: bool) -> None:
    """No generation of `r` is held any more (by any thread, guard or collected object). In place,
    `begin` waits for every holder: it must go through at once. Buffered with 2 buffers: holding
    the newest generation here, `begin` must get the other buffer, twice in a row (once for each
    buffer), which it cannot while a leftover hold keeps that one."""
    gc.collect()
    if not buffered:
        with w.begin(timeout=2.0) as u:
            write(u)
        return
    for _ in range(2):
        newest = r.current()
        assert newest is not None
        with w.begin(timeout=2.0) as u:
            assert u.buffer != newest.buffer
            write(u)
        newest.release()


MODES = [
    pytest.param({}, id="in_place"),
    pytest.param({"mode": "buffered", "buffers": 2}, id="buffered"),
]


@pytest.mark.parametrize("mode", MODES)
def test_twelve_threads_share_one_reader_while_a_writer_publishes_as_fast_as_it_can(name, mode):
    """Each reader thread takes generations by `current()`, `wait_newer(seen)` or
    `wait_newer(seen - 1)` (one it may hold already), checks both tensors, sometimes holds on
    across a sleep (without the GIL) and checks again, and lets go by `release()`, a `with`
    block, `del`, or by handing the hold to a releasing thread. No generation is ever torn, no
    error but a bounded wait's `Timeout` comes, every thread makes progress, and afterwards no
    hold is left."""
    buffered = bool(mode)
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", **mode)
    r = cuda_ipc.TensorSetReader(name)
    stop = threading.Event()
    errors, reads, published = [], [0] * 12, [0]
    handed = queue.Queue()

    def writer():
        try:
            while not stop.is_set():
                try:
                    with w.begin(timeout=0.5) as u:
                        published[0] = write(u)
                except cuda_ipc.Timeout:
                    pass
        except BaseException as e:  # noqa: BLE001
            errors.append(("writer", repr(e)))

    def releaser():
        while True:
            h = handed.get(timeout=ANSWER)
            if h is None:
                return
            check(h)
            h.release()

    def reader(i):
        rnd = random.Random(i)
        seen = 0
        try:
            while not stop.is_set():
                how = rnd.randrange(3)
                try:
                    if how == 0:
                        h = r.current(timeout=0.2)
                        if h is None:
                            continue
                    elif how == 1:
                        h = r.wait_newer(seen, timeout=0.2)
                    else:
                        h = r.wait_newer(max(0, seen - 1), timeout=0.2)
                except cuda_ipc.Timeout:
                    continue
                check(h)
                assert h.held and h.whole is True
                seen = max(seen, h.generation)
                if rnd.random() < 0.05:
                    time.sleep(0.002)  # the GIL is free: the writer and the others run
                    check(h)
                end = rnd.randrange(4)
                if end == 0:
                    h.release()
                    assert not h.held
                elif end == 1:
                    with h:
                        check(h)
                elif end == 2:
                    del h
                else:
                    handed.put(h)
                    del h
                reads[i] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append((i, repr(e)))

    threads = [run(reader, i) for i in range(12)] + [run(writer)]
    rel = run(releaser)
    time.sleep(2.0)
    stop.set()
    join(threads)
    handed.put(None)
    join([rel])
    assert not errors, errors[:5]
    assert published[0] > 20, f"the writer published only {published[0]} generations"
    assert min(reads) > 0, f"a reader thread took nothing: {reads}"
    assert_no_hold_left(w, r, buffered)
    r.close()
    w.close()
    assert not list(SHM.glob(f"cuda-ipc.*.{name}"))


def test_reader_threads_that_hold_without_pause_do_not_starve_an_in_place_writer(name):
    """4 threads of one reader hold the in-place set's generation in turns that overlap (each holds
    5 ms, with no gap between one thread's holds), as request threads of a serving engine do: some
    hold is always there. From `begin()`'s call on no new hold is taken, so each of 10 updates
    gets the buffer within 2 s (before, `begin` waited for a moment with no hold, which never came),
    and every hold reads one whole generation."""
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    with w.begin(timeout=ANSWER) as u:
        write(u)
    r = cuda_ipc.TensorSetReader(name)
    stop = threading.Event()
    errors, holds = [], [0] * 4

    def reader(i):
        time.sleep(0.00125 * i)
        try:
            while not stop.is_set():
                h = r.current(timeout=0.5)
                if h is None:
                    continue
                with h:
                    check(h)
                    time.sleep(0.005)
                    check(h)
                holds[i] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append((i, repr(e)))

    threads = [run(reader, i) for i in range(4)]
    try:
        time.sleep(0.1)
        for _ in range(10):
            t = time.monotonic()
            with w.begin(timeout=ANSWER) as u:
                g = write(u)
            took = time.monotonic() - t
            assert took < 2.0, f"generation {g} waited {took:.1f} s for readers that hold on"
            time.sleep(0.02)
    finally:
        stop.set()
        join(threads)
    assert not errors, errors[:5]
    assert min(holds) > 0, holds
    assert_no_hold_left(w, r, False)
    r.close()
    w.close()


def test_no_reader_takes_the_generation_while_begin_waits_across_its_slices(name):
    """`begin` waits in 50 ms slices (between which it checks for signals and `close()`), and a
    hold there may outlast many of them: the generation it reserved at its call stays reserved
    across them, so no reader takes it until the update is committed or given up. Here one reader
    holds for 300 ms while another waits for the generation, and this thread keeps the GIL busy
    (which `begin` takes between its slices): the waiting reader never gets it (before, each slice
    gave the generation back at its end, and the waiting reader took it while `begin` waited for
    the GIL: readers whose holds outlast a slice could starve `begin`). Once the hold ends, `begin` gets the buffer at once; a
    `begin` that times out gives the generation back."""
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    with w.begin(timeout=ANSWER) as u:
        write(u)
    holder, asker = cuda_ipc.TensorSetReader(name), cuda_ipc.TensorSetReader(name)
    h = holder.current()
    assert h is not None and h.generation == 1
    began = {}

    def writer():
        t = time.monotonic()
        try:
            with w.begin(timeout=ANSWER) as u:
                began["generation"] = write(u)
        except BaseException as e:  # noqa: BLE001
            began["error"] = repr(e)
        began["took"] = time.monotonic() - t

    thread = run(writer)
    time.sleep(0.02)
    taken = []
    stop = threading.Event()

    def ask():
        while not stop.is_set():
            g = asker.current(timeout=0.1)
            if g is not None:
                taken.append(g.generation)
                g.release()

    asking = run(ask)
    gil_busy(0.3)
    stop.set()
    join([asking])
    released = time.monotonic()
    h.release()
    join([thread])
    assert not taken, f"generation taken {len(taken)} times while begin waited: {taken[:5]}"
    assert began.get("generation") == 2, began
    assert time.monotonic() - released < 1.0
    g = asker.current()
    assert g is not None and g.generation == 2
    check(g)
    # A begin that times out against a hold gives the generation back.
    with pytest.raises(cuda_ipc.Timeout):
        w.begin(timeout=0.2)
    g2 = holder.current()
    assert g2 is not None and g2.generation == 2
    g.release()
    g2.release()
    assert_no_hold_left(w, holder, False)
    holder.close()
    asker.close()
    w.close()


def test_a_begin_interrupted_or_closed_while_it_reserves_gives_the_generation_back(name):
    """Ctrl-C (`KeyboardInterrupt`, seen between two slices) during an in-place `begin` that
    reserved the generation against a hold gives it back: another reader takes it at once, and
    the next `begin` gets the buffer once the hold ends. `close()` from another thread during such
    a `begin` ends it with `TensorSetClosed`; the holder's bytes stay readable."""
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    with w.begin(timeout=ANSWER) as u:
        write(u)
    holder, asker = cuda_ipc.TensorSetReader(name), cuda_ipc.TensorSetReader(name)
    h = holder.current()
    assert h is not None
    # Python leaves SIGINT alone when it starts with SIGINT ignored (a child of a background job),
    # and `interrupt_main` then does nothing: the default handler, for this test.
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.2, _thread.interrupt_main)
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            w.begin(timeout=ANSWER)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, old)
    g = asker.current()
    assert g is not None and g.generation == 1, "not given back after KeyboardInterrupt"
    check(g)
    g.release()
    h.release()
    with w.begin(timeout=2.0) as u:
        assert write(u) == 2
    h = holder.current()
    assert h is not None and h.generation == 2
    got = blocked(lambda: w.begin(timeout=ANSWER))
    time.sleep(0.2)
    assert got[0].is_alive()
    closing = time.monotonic()
    w.close(timeout=0.5)
    join([got[0]])
    assert isinstance(got[1].get("error"), cuda_ipc.TensorSetClosed), got[1]
    assert got[1]["at"] - closing < 1.0
    check(h)
    h.release()
    holder.close()
    asker.close()


def test_no_consumer_takes_a_one_buffer_pools_frame_while_acquire_waits_across_its_slices(name):
    """`Producer.acquire` waits in 50 ms slices too: on a pool of one buffer that a consumer holds,
    the frame it reserved at its call stays reserved across them, so another consumer waiting for
    it never takes it while this thread keeps the GIL busy (before, it took it at a slice's end,
    while `acquire` waited for the GIL to start the next); once the hold ends
    the acquire gets the buffer at once. An `acquire` that times out gives the frame back."""
    tx = cuda_ipc.Producer(name, NBYTES, buffers=1, memory="host")
    holder = cuda_ipc.Consumer(name, delivery="latest")
    asker = cuda_ipc.Consumer(name, delivery="latest")
    with tx.acquire(timeout=ANSWER) as f:
        f.write(pattern(1))
        f.publish()
    h = holder.recv(timeout=ANSWER)
    got = blocked(lambda: tx.acquire(timeout=ANSWER))
    time.sleep(0.02)
    taken = []
    stop = threading.Event()

    def ask():
        while not stop.is_set():
            try:
                g = asker.recv(timeout=0.1)
            except cuda_ipc.Timeout:
                continue
            taken.append(g.seq)
            g.release()

    asking = run(ask)
    gil_busy(0.3)
    stop.set()
    join([asking])
    released = time.monotonic()
    h.release()
    join([got[0]])
    assert not taken, f"frame taken {len(taken)} times while acquire waited: {taken[:5]}"
    assert "value" in got[1], got[1]
    assert got[1]["at"] - released < 1.0
    with got[1]["value"] as f:
        f.write(pattern(2))
        f.publish()
    h = holder.recv(timeout=ANSWER)
    with pytest.raises(cuda_ipc.Timeout):
        tx.acquire(timeout=0.2)
    g = asker.try_recv()
    assert g is not None and g.seq == 2, "the frame was not given back"
    g.release()
    h.release()
    holder.close()
    asker.close()
    tx.close(timeout=ANSWER)


@pytest.mark.parametrize("mode", MODES)
def test_closing_the_reader_under_waiting_and_reading_threads_raises_only_documented_errors(
    name, mode
):
    """Rounds of 8 threads waiting, reading and releasing on one reader while a writer thread
    publishes; the reader is closed at a random moment. Each thread then gets the closed reader's
    `TensorSetClosed` naming the reader, not the writer (or a bounded wait's `Timeout`) and ends;
    a hold taken before the close still reads its own generation after it, and once released no
    hold is left."""
    buffered = bool(mode)
    rnd = random.Random(7)
    for _ in range(6):
        w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", **mode)
        with w.begin(timeout=ANSWER) as u:
            write(u)
        r = cuda_ipc.TensorSetReader(name)
        closed = threading.Event()
        errors, kept = [], []

        def reader(i):
            seen = 0
            while True:
                try:
                    if i % 2:
                        h = r.wait_newer(seen, timeout=0.3)
                    else:
                        h = r.current(timeout=0.3)
                    if h is None:
                        continue
                    seen = h.generation
                    check(h)
                    if i == 0 and not kept:
                        kept.append(h)  # held across the close
                        continue
                    time.sleep(0.001)
                    check(h)
                    h.release()
                except cuda_ipc.Timeout:
                    if closed.is_set():
                        return
                except cuda_ipc.TensorSetClosed as e:
                    if "this reader of tensor set" not in str(e) or not closed.is_set():
                        errors.append((i, repr(e)))
                    return
                except BaseException as e:  # noqa: BLE001
                    errors.append((i, repr(e)))
                    return

        stop = threading.Event()

        def writer():
            publish_until(w, stop)  # in place: a reader thread holds `kept` until the end

        threads = [run(reader, i) for i in range(8)]
        wt = run(writer)
        time.sleep(rnd.uniform(0.05, 0.4))
        closed.set()
        r.close()
        join(threads)
        assert not errors, errors
        with pytest.raises(cuda_ipc.TensorSetClosed, match="this reader of tensor set .* is closed"):
            r.current()
        for h in kept:
            check(h)  # the reader's mappings live as long as its holds
            h.release()
        kept.clear()
        stop.set()
        join([wt])
        # The closed reader's slot is freed with its last hold: a new reader takes over.
        r2 = cuda_ipc.TensorSetReader(name)
        assert_no_hold_left(w, r2, buffered)
        r2.close()
        w.close()


@pytest.mark.parametrize("mode", MODES)
def test_closing_the_writer_wakes_a_begin_waiting_in_another_thread(name, mode):
    """Every buffer held by a reader: `begin(timeout=None)` waits in a thread. `close()` from this
    thread makes it raise `TensorSetClosed` within about a slice (50 ms), waits for it, then closes
    the set; `begin` and `synchronize` raise `TensorSetClosed` afterwards, readers
    learn it, and closing again does nothing. (`close()` used to raise `InvalidArgument: an update
    of this tensor set is being committed` and leave the `begin` waiting for its timeout: without
    one, forever.)"""
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", **mode)
    r = cuda_ipc.TensorSetReader(name)
    holds = []
    for _ in range(2 if mode else 1):
        with w.begin(timeout=ANSWER) as u:
            write(u)
        holds.append(r.current())
    t, outcome = blocked(lambda: w.begin(timeout=None))
    time.sleep(0.3)
    assert t.is_alive(), outcome
    closing = time.monotonic()
    w.close(timeout=0.2)  # waits up to 0.2 s for the holds, then frees the memory
    join([t])
    assert isinstance(outcome.get("error"), cuda_ipc.TensorSetClosed), outcome
    assert outcome["at"] - closing < 1.0, f"begin woke {outcome['at'] - closing:.3f} s after close()"
    assert not (SHM / f"cuda-ipc.ts.{name}").exists()
    with pytest.raises(cuda_ipc.TensorSetClosed):
        w.begin(timeout=0)
    with pytest.raises(cuda_ipc.TensorSetClosed):
        w.synchronize()
    w.close()
    with pytest.raises(cuda_ipc.TensorSetClosed):
        r.wait_newer(holds[-1].generation, timeout=ANSWER)
    for h in holds:
        check(h)
        h.release()
    r.close()


@pytest.mark.parametrize("mode", MODES)
def test_close_grants_no_hold_from_its_start_and_waits_only_for_the_holds_before_it(name, mode):
    """Reader threads take holds of 20 ms that overlap, so that some hold is nearly always there:
    two by `current()`, one by `wait_newer(0)`, one by an awaited `wait_newer_async(0)`. Then
    `close(timeout=3)`: from its start no hold is granted (none to a take begun once the set's
    names were gone), every thread ends at `TensorSetClosed`, and the close returns once the holds
    taken before it end, far below its timeout. (Before, `current()` and `wait_newer(0)` kept
    returning the newest generation while `close()` waited, and the close ran its whole 3 s and
    then forced about 300 holds: on a GPU set, memory freed under the readers.)"""
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", **mode)
    for _ in range(2):
        with w.begin(timeout=ANSWER) as u:
            write(u)
    r = cuda_ipc.TensorSetReader(name)
    manifest = SHM / f"cuda-ipc.ts.{name}"
    hows = ["current", "current", "wait_newer", "wait_newer_async"]
    seen = [{"holds": 0, "after_close": 0, "end": None} for _ in hows]

    def take(how):
        if how == "current":
            return r.current()
        if how == "wait_newer":
            return r.wait_newer(0, timeout=0.05)
        return asyncio.run(r.wait_newer_async(0, timeout=0.05))

    def reader(i):
        time.sleep(0.005 * i)
        mine = seen[i]
        try:
            deadline = time.monotonic() + ANSWER
            while time.monotonic() < deadline:
                closing = not manifest.exists()
                try:
                    h = take(hows[i])
                except cuda_ipc.Timeout:
                    continue
                if h is None:
                    time.sleep(0.001)
                    continue
                with h:
                    mine["holds"] += 1
                    mine["after_close"] += closing
                    check(h)
                    time.sleep(0.02)
                    check(h)
            mine["end"] = "still taking"
        except cuda_ipc.TensorSetClosed:
            mine["end"] = "closed"
        except BaseException as e:  # noqa: BLE001 - the test looks at what it is
            mine["end"] = repr(e)

    threads = [run(reader, i) for i in range(len(hows))]
    time.sleep(0.2)
    t = time.monotonic()
    w.close(timeout=3.0)
    took = time.monotonic() - t
    join(threads)
    for how, s in zip(hows, seen):
        assert s["end"] == "closed", (how, s)
        assert s["holds"] > 0, (how, s)
        assert s["after_close"] == 0, f"{how}: {s['after_close']} holds granted after close began"
    assert took < 1.5, f"close took {took:.2f} s (timeout 3 s) against holds of 20 ms"
    with pytest.raises(cuda_ipc.TensorSetClosed):
        r.current()
    with pytest.raises(cuda_ipc.TensorSetClosed):
        r.wait_newer(0, timeout=0.05)
    r.close()


def test_closing_the_writer_from_a_signal_handler_inside_its_begin_does_not_deadlock(name):
    """The close runs on the thread of the waiting `begin` (a SIGALRM handler): it cannot wait
    for that `begin`, which ends with `TensorSetClosed` at its next slice and closes the set."""
    import signal

    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    with w.begin(timeout=ANSWER) as u:
        write(u)
    r = cuda_ipc.TensorSetReader(name)
    h = r.current()  # in place: the next begin waits for it
    before = signal.signal(signal.SIGALRM, lambda *_: w.close(timeout=0.1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t0 = time.monotonic()
        with pytest.raises(cuda_ipc.TensorSetClosed):
            w.begin(timeout=ANSWER)
        assert time.monotonic() - t0 < 2.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    assert not (SHM / f"cuda-ipc.ts.{name}").exists()
    check(h)
    h.release()
    r.close()


def test_closing_the_writer_aborts_an_update_another_thread_has_open(name):
    """A writer thread has an update open; this thread closes the writer. The update is aborted,
    and the writer thread's next calls on it (`write`, `fingerprint`, `commit`) raise
    `TensorSetClosed`, and so does the end of its `with` block, which published nothing. (The
    calls raised `InvalidArgument: this update was committed or aborted`, and the block ended
    without an error, as if it had committed.)"""
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    opened, closed = threading.Event(), threading.Event()
    seen = []

    def writer():
        with w.begin(timeout=ANSWER) as u:
            opened.set()
            assert closed.wait(ANSWER)
            for call in (lambda: u.write("a", pattern(1)), u.fingerprint, u.commit):
                try:
                    call()
                except cuda_ipc.CudaIpcError as e:
                    seen.append(type(e))

    t, outcome = blocked(writer)
    assert opened.wait(ANSWER)
    w.close()
    closed.set()
    join([t])
    assert seen == [cuda_ipc.TensorSetClosed] * 3, seen
    assert isinstance(outcome.get("error"), cuda_ipc.TensorSetClosed), outcome
    assert not (SHM / f"cuda-ipc.ts.{name}").exists()


@pytest.mark.parametrize("mode", MODES)
def test_closing_the_writer_under_a_writer_thread_and_waiting_readers_ends_them_all(name, mode):
    """Rounds of a writer thread looping over `begin`/write/commit and `synchronize()`, 6 reader
    threads in `wait_newer`, and a `close()` from this thread at a random moment: `close()` never
    raises, and every thread ends (within 10 s) at `TensorSetClosed`, having read only whole
    generations."""
    rnd = random.Random(11)
    for _ in range(12):
        w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", **mode)
        r = cuda_ipc.TensorSetReader(name)
        ends, errors = [], []

        def reader():
            seen = 0
            try:
                while True:
                    with r.wait_newer(seen, timeout=ANSWER) as h:
                        check(h)
                        seen = h.generation
            except cuda_ipc.TensorSetClosed:
                ends.append("reader")
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))

        def writer():
            try:
                while True:
                    with w.begin(timeout=ANSWER) as u:
                        write(u)
                    w.synchronize()
            except cuda_ipc.TensorSetClosed:
                ends.append("writer")
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))

        threads = [run(reader) for _ in range(6)] + [run(writer)]
        time.sleep(rnd.uniform(0.0, 0.15))
        w.close(timeout=2.0)
        join(threads)
        assert not errors, errors
        assert sorted(ends) == ["reader"] * 6 + ["writer"], ends
        r.close()


def test_receives_and_publishes_from_several_threads_of_one_consumer_and_one_producer(name):
    """4 threads publish through one `Producer` (one `WriteFrame` at a time: the others' `acquire`
    raises `InvalidArgument` and they try again) and 4 threads receive from one every-frame
    `Consumer` (`recv`, `try_recv`, iteration). Every frame published is received exactly once,
    with its own bytes. (Receives from two threads at once took the same frame twice, and the
    first release let the producer rewrite the buffer under the other's reads: the consumer's
    cursor and hold bit were updated by plain loads and stores; `cuda_ipc::channel::Consumer` now
    takes one frame at a time.)"""
    per = 600
    tx = cuda_ipc.Producer(name, NBYTES, buffers=4, memory="host")
    rx = cuda_ipc.Consumer(name)
    got, errors, lock = [], [], threading.Lock()
    busy = [0]

    def producer(p):
        n = 0
        try:
            while n < per:
                try:
                    f = tx.acquire(timeout=ANSWER)
                except cuda_ipc.InvalidArgument:
                    busy[0] += 1  # another thread's WriteFrame is outstanding
                    time.sleep(0)
                    continue
                tag = (p << 32) | n
                f.write(pattern(tag))
                f.publish(tag.to_bytes(8, "little"))
                n += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(("producer", repr(e)))

    def take(f):
        with f:
            tag = int.from_bytes(f.metadata, "little")
            assert f.bytes() == pattern(tag), f"frame {f.seq} torn"
            with lock:
                got.append((f.seq, tag))

    def consumer(c):
        try:
            if c == 0:
                for f in rx:  # until the channel closes
                    take(f)
                return
            while True:
                try:
                    f = rx.try_recv() if c == 1 else rx.recv(timeout=0.2)
                except cuda_ipc.Timeout:
                    continue
                except cuda_ipc.ChannelClosed:
                    return
                if f is None:
                    time.sleep(0)
                    continue
                take(f)
        except BaseException as e:  # noqa: BLE001
            errors.append((c, repr(e)))

    consumers = [run(consumer, c) for c in range(4)]
    producers = [run(producer, p) for p in range(4)]
    join(producers, 30.0)
    tx.close(timeout=ANSWER)
    join(consumers)
    assert not errors, errors[:5]
    seqs = sorted(s for s, _ in got)
    assert seqs == list(range(1, 4 * per + 1)), f"{len(seqs)} receives of {len(set(seqs))} frames"
    assert sorted(t for _, t in got) == sorted((p << 32) | n for p in range(4) for n in range(per))
    rx.close()


def test_close_from_another_thread_wakes_every_thread_blocked_on_a_consumer_or_producer(name):
    """6 threads blocked in `recv()` (two iterating) on one consumer wake with `Detached` within
    1 s of `close()`; a thread blocked in `acquire()` on a full pool, while others find the
    producer in use, wakes with `ChannelClosed` within 1 s of the producer's `close()`."""
    tx = cuda_ipc.Producer(name, 64, buffers=1, memory="host")
    rx = cuda_ipc.Consumer(name)
    outcomes = []
    for k in range(6):
        call = rx.recv if k < 4 else (lambda: next(iter(rx)))
        outcomes.append(blocked(call))
    time.sleep(0.2)
    assert all(t.is_alive() for t, _ in outcomes)
    closing = time.monotonic()
    rx.close()
    join([t for t, _ in outcomes])
    for _, o in outcomes:
        assert isinstance(o.get("error"), cuda_ipc.Detached), o
        assert o["at"] - closing < 1.0, o["at"] - closing

    held = cuda_ipc.Consumer(name)  # every frame: the one buffer stays in use until received
    with tx.acquire(timeout=ANSWER) as f:
        f.publish()
    acquiring = blocked(lambda: tx.acquire(timeout=None))
    time.sleep(0.2)
    others = [blocked(lambda: tx.acquire(timeout=0.5)) for _ in range(3)]
    join([t for t, _ in others])
    for _, o in others:
        assert isinstance(o.get("error"), cuda_ipc.InvalidArgument), o
    assert acquiring[0].is_alive(), acquiring[1]
    closing = time.monotonic()
    tx.close(timeout=0.5)
    join([acquiring[0]])
    assert isinstance(acquiring[1].get("error"), cuda_ipc.ChannelClosed), acquiring[1]
    assert acquiring[1]["at"] - closing < 1.0
    held.close()


def test_cancelled_awaitable_waits_and_a_close_from_another_thread_end_cleanly(name):
    """Rounds of 4 `wait_newer_async` and 4 `recv_async` awaited at once; a thread closes the
    reader and the consumer while half of the tasks are cancelled. Each task ends cancelled or with
    its object's closed error (the reader's `TensorSetClosed` naming it, the consumer's
    `Detached`), `asyncio.run` (which joins the executor's threads) returns within
    2 s, and no generation stays held."""
    rnd = random.Random(5)
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    tx = cuda_ipc.Producer(name + "-ch", 64, buffers=2, memory="host")
    try:
        for _ in range(6):
            r = cuda_ipc.TensorSetReader(name)
            rx = cuda_ipc.Consumer(name + "-ch")

            async def main():
                tasks = [asyncio.ensure_future(r.wait_newer_async(10**9)) for _ in range(4)]
                tasks += [asyncio.ensure_future(rx.recv_async()) for _ in range(4)]
                await asyncio.sleep(rnd.uniform(0.0, 0.1))
                closer = threading.Thread(target=lambda: (r.close(), rx.close()))
                closer.start()
                await asyncio.sleep(rnd.uniform(0.0, 0.06))
                for t in tasks[::2]:
                    t.cancel()
                done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), ANSWER)
                closer.join(ANSWER)
                return done

            t0 = time.monotonic()
            done = asyncio.run(main())
            assert time.monotonic() - t0 < 2.0
            for k, x in enumerate(done):
                closed_error = cuda_ipc.TensorSetClosed if k < 4 else cuda_ipc.Detached
                assert isinstance(x, (asyncio.CancelledError, closed_error)), (k, x)
                if isinstance(x, cuda_ipc.TensorSetClosed):
                    assert "this reader of tensor set" in str(x), (k, x)
        assert_no_hold_left(w, None, False)
    finally:
        tx.close()
        w.close()


def test_wait_newer_async_cancelled_while_a_writer_thread_publishes_leaves_no_hold(name):
    """300 `wait_newer_async(0)` tasks, each cancelled a random moment (0 to 2 ms) after it
    started, while a writer thread publishes in place as fast as it can: a task that finished
    first gives its hold (released here); one cancelled in the slice that took a generation
    leaves it parked on the reader, for the next task's wait. Afterwards, once `current()` took
    (and released) what the last cancelled task may have parked, no generation is held: the
    in-place `begin` goes through at once."""
    rnd = random.Random(3)
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    stop = threading.Event()

    def writer():
        publish_until(w, stop)

    async def main():
        taken = 0
        for _ in range(300):
            task = asyncio.ensure_future(r.wait_newer_async(0, timeout=ANSWER))
            await asyncio.sleep(rnd.uniform(0.0, 0.002))
            task.cancel()
            try:
                h = await task
            except asyncio.CancelledError:
                continue
            check(h)
            h.release()
            taken += 1
        return taken

    wt = run(writer)
    try:
        t0 = time.monotonic()
        taken = asyncio.run(main())
        assert time.monotonic() - t0 < 20.0
    finally:
        stop.set()
        join([wt])
    assert 0 <= taken <= 300  # how many finished first depends on the machine's load
    gc.collect()
    newest = r.current(timeout=ANSWER)
    assert newest is not None
    check(newest)
    newest.release()
    assert_no_hold_left(w, r, False)
    r.close()
    w.close()


@pytest.mark.parametrize("mode", MODES)
def test_cancelled_wait_newer_async_loses_no_generation_a_writer_waited_for(name, mode):
    """A writer thread publishes 300 generations, each followed by `wait_readers()`, and closes
    the set after the last (`publish(final); wait_readers(); close()`, the documented shutdown).
    Four tasks share one reader: each awaits `wait_newer_async(seen)` in a task of its own, which
    it cancels at a random moment (0 to 3 ms) half of the time, and retries until the set is
    closed; the generations are noted in the order the reader hands them out. A generation that a cancelled wait took after `wait_readers()` counted it (the
    cancellation landing between the take and the coroutine's resumption) is parked on the reader
    and returned by the next wait: every generation is seen, the final one too, none after a
    newer one, and every `wait_readers()` returned True."""
    n, k = 300, 4
    rnd = random.Random(11)
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host", **mode)
    r = cuda_ipc.TensorSetReader(name)
    wrote = {"waited": 0, "error": None}

    def writer():
        try:
            for _ in range(n):
                with w.begin(timeout=ANSWER) as u:
                    write(u)
                assert w.wait_readers(ANSWER), f"generation {w.generation} never taken"
                wrote["waited"] += 1
        except BaseException as e:  # noqa: BLE001 - looked at by the test
            wrote["error"] = e
        finally:
            w.close(2.0)

    async def main():
        seen, order, cancels = 0, [], 0
        closed = False

        async def take(than):
            # The order the reader hands generations out in: noted in the step that returns
            # the wait's hold (a task's own `await t` may come later than another task's).
            h = await r.wait_newer_async(than, timeout=ANSWER)
            order.append(h.generation)
            return h

        async def reader():
            nonlocal seen, cancels, closed
            while not closed:
                t = asyncio.ensure_future(take(seen))
                await asyncio.sleep(rnd.choice([0, 0.0001, 0.001, 0.003]))
                if rnd.random() < 0.5 and not t.done():
                    t.cancel()
                    cancels += 1
                try:
                    h = await t
                except asyncio.CancelledError:
                    continue
                except cuda_ipc.TensorSetClosed:
                    closed = True
                    return
                with h:
                    check(h)
                    seen = max(seen, h.generation)

        await asyncio.wait_for(asyncio.gather(*[reader() for _ in range(k)]), 60.0)
        return order, cancels

    wt = run(writer)
    try:
        order, cancels = asyncio.run(main())
    finally:
        join([wt], 60.0)
    assert wrote["error"] is None, wrote["error"]
    assert wrote["waited"] == n
    missed = sorted(set(range(1, n + 1)) - set(order))
    assert not missed, f"{len(missed)} generations missed of {n} ({cancels} cancels): {missed[:10]}"
    back = [(a, b) for a, b in zip(order, order[1:]) if b < a]
    assert not back, f"generations seen out of order: {back[:10]}"
    assert order[-1] == n
    assert cancels > 0
    r.close()


def counts_while(call) -> int:
    """How often a pure-Python counter thread counts while `call` runs in this thread."""
    n, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            n[0] += 1

    t = run(count)
    try:
        call()
    finally:
        stop.set()
        join([t])
    return n[0]


def test_blocking_waits_leave_other_python_threads_running(name):
    """While a call of this thread waits (0.3 s, then `Timeout`), a counter thread keeps counting
    at least a fifth as fast as while this thread sleeps: the waits release the GIL (a wait that
    held it would leave the counter at nearly nothing)."""
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    tx = cuda_ipc.Producer(name + "-ch", 64, buffers=1, memory="host")
    rx = cuda_ipc.Consumer(name + "-ch")
    try:

        def timing_out(call):
            def body():
                with pytest.raises(cuda_ipc.Timeout):
                    call()

            return body

        baseline = counts_while(lambda: time.sleep(0.3))
        waits = {
            "wait_newer": timing_out(lambda: r.wait_newer(0, timeout=0.3)),
            "current": lambda: r.current(timeout=0.3),
            "recv": timing_out(lambda: rx.recv(timeout=0.3)),
        }
        for what, call in waits.items():
            n = counts_while(call)
            assert n > baseline / 5, f"{what}: {n} counts against {baseline} while sleeping"
        with w.begin(timeout=ANSWER) as u:
            write(u)
        with r.current():  # in place: begin waits for this hold
            n = counts_while(timing_out(lambda: w.begin(timeout=0.3)))
            assert n > baseline / 5, f"begin: {n} counts against {baseline} while sleeping"
        with tx.acquire(timeout=ANSWER) as f:
            f.publish()  # the one buffer, until the consumer receives it
        n = counts_while(timing_out(lambda: tx.acquire(timeout=0.3)))
        assert n > baseline / 5, f"acquire: {n} counts against {baseline} while sleeping"
    finally:
        rx.close()
        tx.close()
        r.close()
        w.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("kind", ["writer", "producer"])
def test_collecting_a_writer_or_producer_lets_other_threads_release_their_holds(name, kind):
    # Collected while a hold of this process is out, the writer (producer) waits up to 5 s for
    # it before freeing the memory: without the GIL, so the thread that holds it runs and lets
    # go, and the collection ends soon after (it held the GIL and always waited 5 s before).
    if kind == "writer":
        owner = cuda_ipc.TensorSetWriter(name, {"a": ((8,), "uint8")}, memory="host", mode="buffered")
        with owner.begin(timeout=ANSWER) as u:
            u.write("a", b"B" * 8)
        del u  # it shares the writer's state: the writer goes with its last reference
        other = cuda_ipc.TensorSetReader(name)
        hold = other.current()
        assert hold is not None
    else:
        owner = cuda_ipc.Producer(name, 64, memory="host")
        other = cuda_ipc.Consumer(name)
        f = owner.acquire(timeout=ANSWER)
        f.write(b"x")
        f.publish()
        del f
        hold = other.recv(timeout=ANSWER)
    ticks = []

    def release_soon():
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.2:
            ticks.append(1)
            time.sleep(0.01)
        hold.release()

    t = run(release_soon)
    t0 = time.monotonic()
    del owner
    gc.collect()
    took = time.monotonic() - t0
    join([t])
    other.close()
    assert took < 3.0, f"collecting the {kind} took {took:.2f} s: its wait held the GIL"
    assert len(ticks) >= 5, f"the other thread ran {len(ticks)} times during the collection"


def owner_with_a_hold(name, kind):
    """A host set's writer (`kind` "writer") or a host channel's producer with one generation
    (frame) out, held by a reader (consumer) of this process: (owner, reader, hold, create), where
    `create()` makes the object again under the name."""
    if kind == "writer":
        owner = cuda_ipc.TensorSetWriter(name, {"a": ((8,), "uint8")}, memory="host")
        with owner.begin(timeout=ANSWER) as u:
            u.write("a", b"B" * 8)
        other = cuda_ipc.TensorSetReader(name)

        def create():
            return cuda_ipc.TensorSetWriter(name, {"a": ((8,), "uint8")}, memory="host")

        return owner, other, other.current(), create
    owner = cuda_ipc.Producer(name, 64, memory="host")
    other = cuda_ipc.Consumer(name)
    f = owner.acquire(timeout=ANSWER)
    f.write(b"x")
    f.publish()

    def create():
        return cuda_ipc.Producer(name, 64, memory="host")

    return owner, other, other.recv(timeout=ANSWER), create


@pytest.mark.parametrize("kind", ["writer", "producer"])
def test_a_second_close_returns_only_once_the_first_has_freed_the_name(name, kind):
    # The first close waits for a hold another thread lets go of after 0.5 s; a second close
    # from a third thread meanwhile returned at once before, while the name was still taken,
    # so a re-create after it failed (`ChannelExists`). It now returns once the first close has
    # finished, and the name can be created again right after it.
    owner, other, hold, create = owner_with_a_hold(name, kind)

    first_done = threading.Event()
    errors = []

    def first():
        try:
            owner.close(ANSWER)
        except Exception as e:  # reported below
            errors.append(e)
        first_done.set()

    def release_later():
        time.sleep(0.5)
        hold.release()

    threads = [run(first), run(release_later)]
    time.sleep(0.1)  # the first close is waiting for the hold
    assert not first_done.is_set()
    owner.close(ANSWER)
    again = create()  # at once: the name is free when the second close returns
    again.close()
    assert first_done.wait(ANSWER)
    join(threads)
    other.close()
    assert not errors, errors


WRITE_FRAME_SHARED = """
import sys, threading, time, cuda_ipc
N = 1 << 20
tx = cuda_ipc.Producer(sys.argv[1], N, memory="host", buffers=2)
wf = tx.acquire(timeout=5.0)
stop = threading.Event()
errors = []

def filler():
    try:
        while not stop.is_set():
            wf.write(b"\\x05" * (N // 2), offset=N // 2)  # over 64 KiB: copied without the GIL
            wf.read(N // 2, N // 2)
    except Exception as e:
        errors.append(e)

threads = [threading.Thread(target=filler, daemon=True) for _ in range(2)]
for t in threads:
    t.start()
t0 = time.monotonic()
n = 0
while time.monotonic() - t0 < 1.5:
    wf.write(b"head", 0)
    assert wf.read(0, 4) == b"head"
    n += 1
stop.set()
for t in threads:
    t.join(10.0)
assert not any(t.is_alive() for t in threads) and not errors, errors
assert wf.read(N // 2, 4) == b"\\x05" * 4
wf.publish()
tx.close()
print("ok", n, flush=True)
"""


def test_threads_sharing_one_write_frame_with_large_copies_never_deadlock(name):
    # A copy of 64 KiB or more into or out of a WriteFrame runs without the GIL. It took the
    # frame's lock with the GIL first, so another thread's call on that frame (holding the GIL,
    # waiting for the lock) and the copy (holding the lock, waiting for the GIL back) froze the
    # whole interpreter. Run in a child, so a deadlock fails the test instead of hanging it.
    child = subprocess.run(
        [sys.executable, "-c", WRITE_FRAME_SHARED, name],
        capture_output=True, text=True, timeout=60,
    )
    assert child.returncode == 0 and child.stdout.startswith("ok"), (child.stdout, child.stderr)


@pytest.mark.parametrize("kind", ["writer", "producer"])
def test_a_close_waiting_for_another_finishes_the_object_when_that_one_is_interrupted(name, kind):
    # The main thread's close waits for a hold; a second close from another thread waits for
    # it. Ctrl-C ends the first (the object is left closed, not freed): the second returned at
    # that moment with the name still taken. It now finishes the close itself, returning once
    # the hold ended and the object is freed, so the name can be created right after it.
    owner, other, hold, create = owner_with_a_hold(name, kind)

    released = threading.Event()
    outcome = []

    def waiter():
        time.sleep(0.1)
        try:
            owner.close(ANSWER)
            outcome.append(released.is_set())
        except Exception as e:  # reported below
            outcome.append(e)

    def interrupt_then_release():
        time.sleep(0.3)
        _thread.interrupt_main()
        time.sleep(0.5)
        released.set()
        hold.release()

    # Three waiting closes: the first to see the object back finishes it, the others wait for
    # that one (they returned at the interrupt before).
    # Python leaves SIGINT alone when it starts with SIGINT ignored (a child of a background job),
    # and `interrupt_main` then does nothing: the default handler, for this test.
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threads = [run(waiter) for _ in range(3)] + [run(interrupt_then_release)]
        with pytest.raises(KeyboardInterrupt):
            owner.close(ANSWER)
            time.sleep(ANSWER)  # the interrupt comes in the close, or here at the latest
    finally:
        signal.signal(signal.SIGINT, old)
    join(threads)
    other.close()
    assert outcome == [True, True, True], outcome
    create().close()


@pytest.mark.parametrize("kind", ["writer", "producer"])
def test_a_close_from_a_signal_handler_inside_the_threads_own_close_returns_at_once(name, kind):
    # The handler's close finds the object taken by the close it interrupted, which cannot go on
    # before the handler returns: it returns at once (it waited out its whole timeout before).
    owner, other, hold, create = owner_with_a_hold(name, kind)
    took = []

    def handler(signum, frame):
        t0 = time.monotonic()
        owner.close(ANSWER)
        took.append(time.monotonic() - t0)

    def signal_then_release():
        time.sleep(0.3)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        time.sleep(0.5)
        hold.release()

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        t = run(signal_then_release)
        t0 = time.monotonic()
        owner.close(ANSWER)
        total = time.monotonic() - t0
        join([t])
    finally:
        signal.signal(signal.SIGUSR1, previous)
    other.close()
    assert len(took) == 1 and took[0] < ANSWER / 4, took
    assert total < ANSWER / 2, total
    create().close()
