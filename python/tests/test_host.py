"""Host-memory channels (`memory="host"`) from Python, no GPU: a channel between this process and
a child Python process (started with `sys.executable`, never forked), every frame's bytes checked
under both delivery policies, metadata and stats; a producer killed with SIGKILL; SIGINT to a
child blocked in `recv()`; and the GPU-only accessors refusing a host frame. Every wait is bounded.
Run: `pip install ./python && pytest python/tests`."""

import json
import os
import pathlib
import select
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
# The longest any single step waits: a child's answer, a frame, a close.
ANSWER = 10.0


@pytest.fixture
def name():
    """A fresh channel name; both its segments are removed afterwards if anything left them."""
    n = f"pytest-host-{uuid.uuid4().hex[:12]}"
    yield n
    for prefix in ("cuda-ipc.ch.", "cuda-ipc.hp."):
        p = SHM / f"{prefix}{n}"
        if p.exists() or p.is_symlink():
            p.unlink()


def payload(seq: int, nbytes: int) -> bytes:
    """The bytes of frame `seq`: its number in every 8-byte word, each word's last byte its index
    (so a frame of another seq, a shifted frame or a stale tail are all told apart)."""
    words = nbytes // 8 + 1
    b = b"".join(((seq << 8) | (k & 0xFF)).to_bytes(8, "little") for k in range(words))
    return b[:nbytes]


def metadata(seq: int) -> bytes:
    return f"frame {seq}".encode() + bytes([seq & 0xFF, 0, 255])


class Child:
    """A child Python process running `code`, spoken to by lines on stdin and stdout, with every
    read bounded."""

    def __init__(self, code: str, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(PRELUDE) + textwrap.dedent(code), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.buf = b""

    def line(self, timeout: float = ANSWER) -> str:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError(f"no answer from the child in {timeout} s{self.stderr()}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"the child exited ({self.proc.wait(ANSWER)}){self.stderr()}")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def expect(self, word: str, timeout: float = ANSWER) -> str:
        got = self.line(timeout)
        head, _, rest = got.partition(" ")
        assert head == word, f"expected {word!r}, got {got!r}{self.stderr()}"
        return rest

    def send(self, line: str):
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return ""
        return "\n--- child stderr ---\n" + self.proc.stderr.read().decode(errors="replace")

    def finish(self, timeout: float = ANSWER) -> int:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        return self.proc.wait(timeout)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(ANSWER)


@pytest.fixture
def children():
    """Children started by a test; killed at its end if still running."""
    started = []
    yield lambda code, *args: started.append(Child(code, *args)) or started[-1]
    for c in started:
        c.kill()


# Shared by every child: the payload, and `tell` (one flushed line to the parent).
PRELUDE = f"""
import json, sys, time
import cuda_ipc

def payload(seq, nbytes):
    words = nbytes // 8 + 1
    b = b"".join(((seq << 8) | (k & 0xFF)).to_bytes(8, "little") for k in range(words))
    return b[:nbytes]

def metadata(seq):
    return f"frame {{seq}}".encode() + bytes([seq & 0xFF, 0, 255])

def tell(*words):
    print(*words, flush=True)

ANSWER = {ANSWER}
"""

# argv: name, frames, nbytes, buffers. Creates the channel, waits for "go", publishes `frames`
# frames (the first half in one write, the second half at an offset), then on "close" closes and
# reports the producer's stats as they were before the close.
PRODUCER = """
name, frames, nbytes, buffers = sys.argv[1], *map(int, sys.argv[2:5])
tx = cuda_ipc.Producer(name, nbytes, buffers=buffers, max_consumers=2, memory="host")
assert tx.memory == "host", tx.memory
tell("created")
assert sys.stdin.readline().strip() == "go"
for seq in range(1, frames + 1):
    with tx.acquire(timeout=ANSWER) as w:
        assert w.is_host and w.nbytes == nbytes
        data = payload(seq, nbytes)
        half = nbytes // 2
        assert w.write(data[:half]) == half
        assert w.write(bytearray(data[half:]), offset=half) == nbytes - half
        assert w.read() == data
        assert w.publish(metadata(seq)) == seq
tell("published", frames)
line = sys.stdin.readline().strip()
if line == "close":
    stats = tx.stats()
    report = tx.close(timeout=ANSWER)
    tell("closed", json.dumps({"stats": stats, "report": report}))
elif line == "idle":
    tell("idle")
    time.sleep(600)
"""


def run_channel(name, children, delivery, frames, nbytes, buffers):
    """A host producer child publishes `frames` frames to a consumer here, which iterates until
    the channel closes; returns the seqs received, the consumer's stats after the close, and the
    child's report. The iteration waits without a timeout: a watchdog kills the child after 60 s,
    which ends it with ProducerGone."""
    peer = children(PRODUCER, name, str(frames), str(nbytes), str(buffers))
    peer.expect("created")
    rx = cuda_ipc.Consumer(name, delivery=delivery)
    assert rx.is_host
    watchdog = threading.Timer(60, peer.kill)
    watchdog.start()
    try:
        peer.send("go")
        seqs = []
        for frame in rx:
            with frame:
                assert frame.is_host and frame.nbytes == nbytes
                assert frame.metadata == metadata(frame.seq)
                assert frame.bytes() == payload(frame.seq, nbytes), f"frame {frame.seq}"
                assert bytes(frame) == payload(frame.seq, nbytes)
                assert frame.read(8, 16) == payload(frame.seq, nbytes)[8:24]
                seqs.append(frame.seq)
            assert not frame.held
            if frame.seq == frames:
                # The last frame (under both policies: "latest" always delivers the newest).
                peer.expect("published")
                peer.send("close")
    finally:
        watchdog.cancel()
    # Iteration ended at ChannelClosed; receiving again says so.
    with pytest.raises(cuda_ipc.ChannelClosed):
        rx.recv(timeout=ANSWER)
    stats = rx.stats()
    report = json.loads(peer.expect("closed"))
    assert peer.finish() == 0, peer.stderr()
    rx.close()
    return seqs, stats, report


def test_every_frame_of_a_host_channel_reaches_a_consumer_in_this_process_with_its_bytes(
    name, children
):
    frames, nbytes = 200, 10_000
    seqs, stats, report = run_channel(name, children, "every", frames, nbytes, 3)
    assert seqs == list(range(1, frames + 1))
    assert stats["published"] == frames
    [me] = [c for c in stats["consumers"] if c["pid"] == os.getpid()]
    assert (me["received"], me["dropped"], me["in_flight"]) == (frames, 0, 0)
    assert report["stats"]["published"] == frames
    assert [c["pid"] for c in report["stats"]["consumers"]] == [os.getpid()]
    assert report["report"] == {"forced_holds": 0, "consumers_behind": 0}
    # A closing producer removes both of its segments.
    assert not (SHM / f"cuda-ipc.ch.{name}").exists()
    assert not (SHM / f"cuda-ipc.hp.{name}").exists()


def test_a_latest_only_consumer_gets_increasing_frames_ending_with_the_last(name, children):
    frames, nbytes = 500, 100_000  # large enough that copies run without the GIL
    seqs, stats, report = run_channel(name, children, "latest", frames, nbytes, 2)
    assert seqs == sorted(set(seqs)) and 1 <= len(seqs) <= frames
    assert seqs[-1] == frames
    [me] = stats["consumers"]
    assert me["received"] == len(seqs)
    assert me["received"] + me["dropped"] <= frames
    assert report["stats"]["published"] == frames


# argv: name, max_consumers. Attaches and reports, waits for a frame without a timeout (SIGINT
# expected), then receives one frame to show nothing was taken, closes, and idles until stdin ends.
INTERRUPTED = """
import signal
# Python leaves SIGINT alone when it starts with SIGINT ignored, as a child of a background job
# of a non-interactive shell does: KeyboardInterrupt is asked for here, whatever the parent had.
signal.signal(signal.SIGINT, signal.default_int_handler)
name = sys.argv[1]
rx = cuda_ipc.Consumer(name)
tell("attached")
try:
    rx.recv()
    tell("unexpected frame")
except KeyboardInterrupt:
    tell("interrupted", time.monotonic())
f = rx.recv(timeout=ANSWER)
tell("frame", f.seq, f.bytes() == payload(f.seq, f.nbytes))
f.release()
rx.close()
tell("closed")
sys.stdin.read()
"""


def test_ctrl_c_interrupts_a_blocked_recv_promptly_and_the_slot_is_released(name, children):
    tx = cuda_ipc.Producer(name, 4096, buffers=2, max_consumers=2, memory="host")
    peer = children(INTERRUPTED, name)
    peer.expect("attached")
    # Both slots: the child's and one here; a third is refused.
    extra = cuda_ipc.Consumer(name)
    with pytest.raises(cuda_ipc.NoConsumerSlot):
        cuda_ipc.Consumer(name)
    extra.close()
    time.sleep(0.3)  # well inside recv()
    sent = time.monotonic()
    peer.proc.send_signal(signal.SIGINT)
    at = float(peer.expect("interrupted"))
    # Both clocks are CLOCK_MONOTONIC, shared by the processes of a machine.
    assert at - sent < 0.2, f"KeyboardInterrupt {at - sent:.3f} s after SIGINT"
    with tx.acquire(timeout=ANSWER) as w:
        w.write(payload(1, 4096))
        w.publish(b"after")
    assert peer.expect("frame") == "1 True"
    peer.expect("closed")
    # The child still runs; its slot was given back by close(), not reclaimed from a dead process.
    assert peer.proc.poll() is None
    assert tx.stats()["consumers"] == []
    both = [cuda_ipc.Consumer(name), cuda_ipc.Consumer(name)]
    assert len(tx.stats()["consumers"]) == 2
    for c in both:
        c.close()
    assert peer.finish() == 0, peer.stderr()
    tx.close()


def test_a_killed_producer_gives_producer_gone_within_1_s(name, children):
    peer = children(PRODUCER, name, "3", "512", "2")
    peer.expect("created")
    rx = cuda_ipc.Consumer(name, delivery="latest")
    peer.send("go")
    peer.expect("published")
    f = rx.recv(timeout=ANSWER)
    assert f.seq == 3 and f.bytes() == payload(3, 512)
    f.release()
    peer.send("idle")
    peer.expect("idle")
    killed = []

    def kill():
        killed.append(time.monotonic())
        os.kill(peer.proc.pid, signal.SIGKILL)

    timer = threading.Timer(0.3, kill)
    timer.start()
    try:
        with pytest.raises(cuda_ipc.ProducerGone):
            rx.recv(timeout=ANSWER)  # blocked when the kill comes
    finally:
        timer.join()
    took = time.monotonic() - killed[0]
    assert took < 1.0, f"ProducerGone {took:.3f} s after SIGKILL"
    rx.close()


def test_a_host_frame_refuses_every_gpu_accessor_with_not_supported(name):
    with cuda_ipc.Producer(name, 64, buffers=2, memory="host", device=7) as tx:
        assert tx.memory == "host" and "host" in repr(tx)
        rx = cuda_ipc.Consumer(name)
        assert rx.is_host
        with pytest.raises(cuda_ipc.NotSupported, match="no stream"):
            rx.stream
        w = tx.acquire(timeout=ANSWER)
        assert w.is_host and w.nbytes == 64
        for what in ("ptr", "stream", "__cuda_array_interface__"):
            with pytest.raises(cuda_ipc.NotSupported, match="host-memory frame"):
                getattr(w, what)
        with pytest.raises(cuda_ipc.NotSupported):
            w.__dlpack__()
        with pytest.raises(cuda_ipc.NotSupported):
            w.__dlpack_device__()
        # Copies are bounded by the buffer; only bytes-like data is taken.
        with pytest.raises(cuda_ipc.InvalidArgument, match="pass the end"):
            w.write(b"x" * 65)
        with pytest.raises(cuda_ipc.InvalidArgument, match="pass the end"):
            w.write(b"x", offset=64)
        with pytest.raises(cuda_ipc.InvalidArgument, match="pass the end"):
            w.read(60, 5)
        for bad in ("text", 5, None):
            with pytest.raises(TypeError):
                w.write(bad)
        assert w.write(memoryview(b"abcd")[1:3], offset=10) == 2
        assert w.read(10, 2) == b"bc"
        assert w.publish(b"m") == 1
        with pytest.raises(cuda_ipc.InvalidArgument, match="already published"):
            w.write(b"late")
        with pytest.raises(cuda_ipc.InvalidArgument, match="already published"):
            w.read()
        f = rx.recv(timeout=ANSWER)
        assert f.is_host and f.read(10, 2) == b"bc" and len(f.bytes()) == 64
        assert f.read(64) == b"" and f.read(0, 0) == b""
        for what in ("ptr", "stream", "__cuda_array_interface__"):
            with pytest.raises(cuda_ipc.NotSupported, match="host-memory frame"):
                getattr(f, what)
        with pytest.raises(cuda_ipc.NotSupported):
            f.__dlpack__()
        with pytest.raises(cuda_ipc.NotSupported):
            f.__dlpack_device__()
        with pytest.raises(cuda_ipc.InvalidArgument, match="pass the end"):
            f.read(1, 64)
        f.release()
        with pytest.raises(cuda_ipc.InvalidArgument, match="released"):
            f.bytes()
        # Still NotSupported once released: the kind is the first thing checked.
        with pytest.raises(cuda_ipc.NotSupported):
            f.__dlpack__()
        rx.close()
    assert not (SHM / f"cuda-ipc.hp.{name}").exists()


def test_host_producer_options_are_checked_without_a_driver(name):
    with pytest.raises(cuda_ipc.InvalidArgument, match="buffers"):
        cuda_ipc.Producer(name, 64, buffers=0, memory="host")
    with pytest.raises(cuda_ipc.InvalidArgument):
        cuda_ipc.Producer(name, 0, memory="host")
    with pytest.raises(cuda_ipc.InvalidArgument, match="name"):
        cuda_ipc.Producer("bad/name", 64, memory="host")
    with pytest.raises(cuda_ipc.InvalidArgument, match="metadata"):
        with cuda_ipc.Producer(name, 64, memory="host") as tx:
            with tx.acquire(timeout=ANSWER) as w:
                w.publish(b"x" * (cuda_ipc.META_BYTES + 1))
    with cuda_ipc.Producer(name, 64, memory="host"):
        with pytest.raises(cuda_ipc.ChannelExists):
            cuda_ipc.Producer(name, 64, memory="host")


def test_stream_options_and_tensor_helpers_are_refused_on_a_host_channel(name):
    class TorchLikeStream:
        cuda_stream = 12345

    class CupyLikeStream:
        ptr = 12345

    for s in (7, TorchLikeStream(), CupyLikeStream()):
        with pytest.raises(cuda_ipc.InvalidArgument, match="no streams to order"):
            cuda_ipc.Producer(name, 64, memory="host", stream=s)
    for bad in ("default", 1.5, object()):
        with pytest.raises((cuda_ipc.InvalidArgument, TypeError)):
            cuda_ipc.Producer(name, 64, memory="host", stream=bad)
    with cuda_ipc.Producer(name, 64, buffers=2, memory="host") as tx:
        with pytest.raises(cuda_ipc.InvalidArgument, match="no streams to order"):
            cuda_ipc.Consumer(name, stream=TorchLikeStream())
        with pytest.raises(cuda_ipc.InvalidArgument, match="stream must be"):
            cuda_ipc.Consumer(name, stream="current")
        # A negative or too large int is named as what it is, not as "got int".
        for n in (-1, 2**64):
            with pytest.raises(cuda_ipc.InvalidArgument, match=r"stream -?\d+ is not a CUstream"):
                cuda_ipc.Consumer(name, stream=n)
        rx = cuda_ipc.Consumer(name, stream=None)
        w = tx.acquire(timeout=ANSWER)
        for call in (lambda: w.publish_after(3), w.as_tensor, w.as_cupy):
            with pytest.raises(cuda_ipc.NotSupported, match="host-memory frame"):
                call()
        w.publish(b"")
        f = rx.recv(timeout=ANSWER)
        for call in (lambda: f.ready_on(3), f.as_tensor, lambda: f.as_cupy((4,), "uint8")):
            with pytest.raises(cuda_ipc.NotSupported, match="host-memory frame"):
                call()
        f.release()
        f.release()  # a second release does nothing
        assert not f.held
        rx.close()


def quota_scope():
    """A group budget of its own for the test: as root a gid nobody uses, else our own group
    (skipped, visibly, when that group already has a host budget, which the test must not
    change)."""
    if os.geteuid() == 0:
        gid = 3_900_000_000 + os.getpid() % 100_000
    else:
        gid = os.getegid()
    ledger = SHM / f"cuda-ipc.quota.g{gid}.{'0' * 32}"
    if ledger.exists() and os.geteuid() != 0:
        pytest.skip(f"group {gid} already has a host-memory budget ({ledger})")
    return f"group:{gid}", ledger


def test_a_host_budget_is_shared_refuses_past_it_naming_the_holder_and_comes_back(name):
    scope, ledger = quota_scope()
    # No budget set: said plainly, with what to do.
    with pytest.raises(cuda_ipc.QuotaError, match="cuda-ipc quota set"):
        cuda_ipc.Producer(name, 1024, buffers=4, memory="host", quota=scope)
    cuda_ipc.set_quota(6000, scope=scope)
    try:
        assert ledger.exists()
        first = cuda_ipc.Producer(name, 1024, buffers=4, memory="host", quota=scope)
        # 4096 of 6000 bytes held: another 4096 would pass the budget.
        with pytest.raises(cuda_ipc.OverQuota, match=f"pid {os.getpid()}") as e:
            cuda_ipc.Producer(name + "-2", 1024, buffers=4, memory="host", quota=scope)
        assert isinstance(e.value, cuda_ipc.QuotaError)
        assert isinstance(e.value, ValueError)
        assert not (SHM / f"cuda-ipc.ch.{name}-2").exists()
        first.close()
        # The bytes came back with the close.
        cuda_ipc.Producer(name + "-2", 1024, buffers=4, memory="host", quota=scope).close()
        # The producer's own cap is an OverQuota too (and still a ValueError).
        with pytest.raises(cuda_ipc.OverQuota):
            cuda_ipc.Producer(name, 1024, buffers=4, memory="host", quota_bytes=100)
        with pytest.raises(cuda_ipc.InvalidArgument, match="scope"):
            cuda_ipc.Producer(name, 1024, memory="host", quota="everyone")
        # A pool no segment can hold is refused as such, before the budget is asked (4 buffers
        # of 2**61 bytes read as a reservation of 2**63 bytes, over quota).
        with pytest.raises(cuda_ipc.InvalidArgument, match="the most a segment can hold"):
            cuda_ipc.Producer(name + "-3", 2**61, buffers=4, memory="host", quota=scope)
    finally:
        assert cuda_ipc.remove_quota(scope=scope)
    assert not ledger.exists()
    assert not cuda_ipc.remove_quota(scope=scope)


def test_a_killed_host_producers_bytes_stay_counted_while_its_pool_is_in_dev_shm(name):
    """Host memory does not go with its process: a producer killed with SIGKILL leaves its pool
    in /dev/shm, so its reservation stays, named as dead with the segment in `OverQuota`; a
    producer started again under its name is not refused for the pool it replaces."""
    scope, ledger = quota_scope()
    cuda_ipc.set_quota(6000, scope=scope)
    child = None
    try:
        code = textwrap.dedent(f"""
            import sys, time, cuda_ipc
            p = cuda_ipc.Producer({name!r}, 1024, buffers=4, memory="host", quota={scope!r})
            print("held", flush=True)
            time.sleep(60)
        """)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "held"
        child.kill()
        child.wait(timeout=20)
        pool = f"cuda-ipc.hp.{name}"
        assert (SHM / pool).exists()
        with pytest.raises(cuda_ipc.OverQuota, match=f"dead; its memory stays in /dev/shm/{pool}"):
            cuda_ipc.Producer(name + "-2", 1024, buffers=4, memory="host", quota=scope)
        # Started again under the dead one's name: its pool replaces the dead one's.
        again = cuda_ipc.Producer(name, 1024, buffers=4, memory="host", quota=scope)
        # The dead entry went with its pool: 4096 of 6000 held, by this process alone.
        with pytest.raises(cuda_ipc.OverQuota, match=f"pid {os.getpid()}") as e:
            cuda_ipc.Producer(name + "-2", 1024, buffers=4, memory="host", quota=scope)
        assert f"pid {child.pid}" not in str(e.value)
        again.close()
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        assert cuda_ipc.remove_quota(scope=scope)


def test_a_file_planted_under_this_users_ledger_name_is_named_and_left(name):
    """Ledger names are predictable: another user can make a file under this user's before it
    does. Asking for that budget (a producer's `quota="user"`, `set_quota`) raises `QuotaError`
    naming the file's owner as a planter and what to do; the file is left as it is."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another uid")
    ledger = SHM / f"cuda-ipc.quota.u0.{'0' * 32}"
    if ledger.exists() or ledger.is_symlink():
        pytest.skip(f"this user has a host-memory budget ({ledger}), which the test must not touch")
    ledger.write_bytes(bytes(20480))
    try:
        os.chown(ledger, 65534, -1)
        for call in (
            lambda: cuda_ipc.Producer(name, 1024, buffers=2, memory="host", quota="user"),
            lambda: cuda_ipc.set_quota(1 << 20),
        ):
            with pytest.raises(cuda_ipc.QuotaError, match="planted") as e:
                call()
            assert "uid 65534" in str(e.value) and f"rm {ledger}" in str(e.value), e.value
        assert not (SHM / f"cuda-ipc.ch.{name}").exists()
        assert ledger.stat().st_uid == 65534 and ledger.stat().st_size == 20480
    finally:
        ledger.unlink()


# ---------------------------------------------------------------- durations and close() from
# another thread

# Out of range for every duration argument (seconds from 0 to 1e9): huge, infinite, NaN,
# negative, an int too large for a float, and just past the bound.
BAD_SECONDS = [1e300, float("inf"), float("-inf"), float("nan"), -1.0, -1e-9, 10**400, 1e9 + 1]


@pytest.mark.parametrize("value", BAD_SECONDS, ids=lambda v: repr(v)[:12])
def test_out_of_range_durations_raise_invalid_argument_naming_the_argument(name, value):
    spin = "spin must be a number of seconds from 0 to 1e9"
    for make in (
        lambda: cuda_ipc.Producer(name, 64, memory="host", spin=value),
        lambda: cuda_ipc.Producer(name, 64, memory="host", wait="block", spin=value),
        lambda: cuda_ipc.Consumer(name, spin=value),
        lambda: cuda_ipc.Consumer.attach(name, wait="spin", spin=value),
    ):
        with pytest.raises(cuda_ipc.InvalidArgument, match=spin):
            make()
    assert not (SHM / f"cuda-ipc.ch.{name}").exists()
    timeout = r"timeout must be a number of seconds from 0 to 1e9 \(None waits forever\)"
    with cuda_ipc.Producer(name, 64, buffers=1, memory="host") as tx:
        rx = cuda_ipc.Consumer(name)
        with pytest.raises(cuda_ipc.InvalidArgument, match=timeout):
            tx.acquire(timeout=value)
        with pytest.raises(cuda_ipc.InvalidArgument, match=timeout):
            rx.recv(timeout=value)
        with pytest.raises(cuda_ipc.InvalidArgument, match="timeout must be a number of seconds"):
            tx.close(timeout=value)
        # Nothing was lost to the refused calls: the channel still carries a frame.
        with tx.acquire(timeout=ANSWER) as w:
            w.write(b"still open")
            w.publish(b"m")
        with rx.recv(timeout=ANSWER) as f:
            assert f.read(0, 10) == b"still open"
        rx.close()


def test_a_bool_is_no_duration_and_huge_values_print_in_exponent_form(name):
    with cuda_ipc.Producer(name, 64, buffers=1, memory="host") as tx:
        rx = cuda_ipc.Consumer(name)
        for flag in (True, False):
            with pytest.raises(cuda_ipc.InvalidArgument, match=f"got a bool \\({flag}\\)"):
                rx.recv(timeout=flag)
            with pytest.raises(cuda_ipc.InvalidArgument, match="timeout must be"):
                tx.acquire(timeout=flag)
            with pytest.raises(cuda_ipc.InvalidArgument, match="spin must be"):
                cuda_ipc.Consumer(name, spin=flag)
        with pytest.raises(cuda_ipc.InvalidArgument) as e:
            rx.recv(timeout=-1e300)
        assert str(e.value).endswith("got -1e300"), str(e.value)
        with pytest.raises(cuda_ipc.InvalidArgument) as e:
            rx.recv(timeout=1e9 + 1)
        assert str(e.value).endswith("got 1000000001"), str(e.value)
        # A tiny negative value in exponent form, not hundreds of zeros.
        with pytest.raises(cuda_ipc.InvalidArgument) as e:
            rx.recv(timeout=-1e-300)
        assert str(e.value).endswith("got -1e-300"), str(e.value)
        with pytest.raises(cuda_ipc.InvalidArgument) as e:
            rx.recv(timeout=-0.5)
        assert str(e.value).endswith("got -0.5"), str(e.value)
        rx.close()


def test_durations_at_the_ends_of_the_range_and_none_are_accepted(name):
    with cuda_ipc.Producer(name, 64, buffers=1, memory="host", wait="block", spin=1e9) as tx:
        rx = cuda_ipc.Consumer(name, spin=0)
        with pytest.raises(cuda_ipc.Timeout):
            rx.recv(timeout=0)
        w = tx.acquire(timeout=1e9)  # a buffer is free: at once
        w.publish(b"")
        assert rx.recv(timeout=1e9).seq == 1  # a frame is there: at once
        for bad in ("1", object()):
            with pytest.raises(TypeError):
                rx.recv(timeout=bad)
        rx.close()


def blocked(call):
    """Runs `call` in a thread; returns (thread, outcome), outcome filled with what it returned or
    raised and when (time.monotonic())."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as e:  # noqa: BLE001 - the test looks at what it is
            outcome["error"] = e
        outcome["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, outcome


def test_close_from_another_thread_wakes_a_blocked_recv_within_1_s_with_detached(name):
    with cuda_ipc.Producer(name, 64, buffers=2, memory="host") as tx:
        for wait in ("block", "spin_then_block"):
            for how in ("recv", "iterate"):
                rx = cuda_ipc.Consumer(name, wait=wait)
                call = rx.recv if how == "recv" else lambda: next(iter(rx))
                t, outcome = blocked(call)
                time.sleep(0.2)  # well inside the wait
                assert t.is_alive(), outcome
                closing = time.monotonic()
                rx.close()
                assert time.monotonic() - closing < 1.0, "close() waited for the blocked recv"
                t.join(ANSWER)
                assert not t.is_alive(), "recv() still blocked after close()"
                assert isinstance(outcome.get("error"), cuda_ipc.Detached), outcome
                took = outcome["at"] - closing
                assert took < 1.0, f"{how} woke {took:.3f} s after close()"
                # The slot is given back once the woken call let go of the consumer.
                assert tx.stats()["consumers"] == []
                with pytest.raises(cuda_ipc.Detached):
                    rx.recv(timeout=0)
                with pytest.raises(cuda_ipc.Detached):
                    rx.try_recv()


def test_close_from_another_thread_wakes_an_acquire_blocked_on_a_full_pool(name):
    tx = cuda_ipc.Producer(name, 64, buffers=1, memory="host")
    rx = cuda_ipc.Consumer(name)  # every frame: the one buffer stays in use until received
    with tx.acquire(timeout=ANSWER) as w:
        w.publish(b"unread")
    t, outcome = blocked(tx.acquire)  # no timeout: waits for the buffer forever
    time.sleep(0.2)
    assert t.is_alive(), outcome
    closing = time.monotonic()
    report = tx.close(timeout=0)
    closed_in = time.monotonic() - closing
    t.join(ANSWER)
    assert not t.is_alive(), "acquire() still blocked after close()"
    assert isinstance(outcome.get("error"), cuda_ipc.ChannelClosed), outcome
    assert outcome["at"] - closing < 1.0
    # close() waited for the acquire to give the producer back, then closed the channel itself.
    assert closed_in < 1.0 + ANSWER / 10, f"close() took {closed_in:.3f} s"
    # The one every-frame consumer had not received the frame: closed at once (timeout 0),
    # nothing held, the consumer left behind.
    assert report == {"forced_holds": 0, "consumers_behind": 1}
    assert not (SHM / f"cuda-ipc.ch.{name}").exists()
    assert not (SHM / f"cuda-ipc.hp.{name}").exists()
    for call in (tx.acquire, tx.try_acquire, tx.stats):
        with pytest.raises(cuda_ipc.ChannelClosed):
            call()
    assert tx.close() == {"forced_holds": 0, "consumers_behind": 0}  # again: nothing to do
    rx.close()


def test_close_from_a_signal_handler_inside_acquire_does_not_deadlock(name):
    tx = cuda_ipc.Producer(name, 64, buffers=1, memory="host")
    rx = cuda_ipc.Consumer(name)
    with tx.acquire(timeout=ANSWER) as w:
        w.publish(b"")
    reports = []
    old = signal.signal(signal.SIGALRM, lambda *_: reports.append(tx.close(timeout=0)))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        start = time.monotonic()
        with pytest.raises(cuda_ipc.ChannelClosed):
            tx.acquire(timeout=ANSWER)  # the handler runs in here, on this thread
        assert time.monotonic() - start < 1.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert reports == [{"forced_holds": 0, "consumers_behind": 0}]
    # The acquire closed the channel as it ended.
    assert not (SHM / f"cuda-ipc.ch.{name}").exists()
    rx.close()


def test_an_outstanding_write_frame_closes_the_channel_when_it_ends(name):
    tx = cuda_ipc.Producer(name, 64, buffers=2, memory="host")
    w = tx.acquire(timeout=ANSWER)
    # At once: the frame has the producer.
    assert tx.close(timeout=0) == {"forced_holds": 0, "consumers_behind": 0}
    assert (SHM / f"cuda-ipc.ch.{name}").exists()
    with pytest.raises(cuda_ipc.ChannelClosed):
        w.publish(b"too late")
    assert not (SHM / f"cuda-ipc.ch.{name}").exists()
    with pytest.raises(cuda_ipc.ChannelClosed):
        tx.acquire(timeout=0)


def test_a_closed_consumer_never_returns_a_frame(name):
    """300 races of recv() in a thread against close(): a frame published after close() returned
    is never returned (the recv raises Detached); one published while close() runs is returned
    whole or not at all."""
    with cuda_ipc.Producer(name, 64, buffers=2, max_consumers=2, memory="host") as tx:
        seq = 0
        returned = 0
        for i in range(300):
            rx = cuda_ipc.Consumer(name, delivery="latest", wait="block")
            t, outcome = blocked(lambda: rx.recv(timeout=ANSWER))
            time.sleep((i % 7) * 0.0003)  # vary where in recv() the close lands
            seq += 1
            data = payload(seq, 64)

            def publish():
                with tx.acquire(timeout=ANSWER) as w:
                    w.write(data)
                    w.publish(metadata(seq))

            strict = i % 2 == 0
            if strict:
                rx.close()
                publish()
            else:
                p, _ = blocked(publish)
                rx.close()
                p.join(ANSWER)
            t.join(ANSWER)
            assert not t.is_alive(), f"race {i}: recv() still blocked after close()"
            if "value" in outcome:
                assert not strict, f"race {i}: a frame published after close() was returned"
                f = outcome["value"]
                assert f.bytes() == data and f.metadata == metadata(seq)
                f.release()
                returned += 1
            else:
                assert isinstance(outcome["error"], cuda_ipc.Detached), (i, outcome)
            with pytest.raises(cuda_ipc.Detached):
                rx.recv(timeout=0)
            del outcome, t
            assert tx.stats()["consumers"] == [], f"race {i}: the slot was not given back"


# ---------------------------------------------------------------- refused calls change nothing;
# integer arguments

def test_a_refused_publish_keeps_the_frame_open_to_publish_again(name):
    """A publish refused for its argument (metadata over 256 bytes, metadata that is not bytes)
    changes nothing: the frame is still open, and publishing it again delivers it."""
    with cuda_ipc.Producer(name, 64, buffers=2, memory="host") as tx:
        rx = cuda_ipc.Consumer(name)
        w = tx.acquire(timeout=ANSWER)
        w.write(b"payload")
        with pytest.raises(cuda_ipc.InvalidArgument, match="257 bytes; at most 256"):
            w.publish(b"x" * 257)
        with pytest.raises(TypeError):
            w.publish("str")
        assert w.read(0, 7) == b"payload"
        assert w.publish(b"x" * 256) == 1
        with rx.recv(timeout=ANSWER) as f:
            assert (f.seq, f.metadata, f.read(0, 7)) == (1, b"x" * 256, b"payload")
        rx.close()


def test_publish_takes_metadata_as_commit_takes_content_any_buffer_refused_alike(name):
    """`WriteFrame.publish`'s metadata is read as `TensorUpdate.commit`'s content: `bytes` or any
    object exporting a buffer (`bytearray`, a `memoryview` slice, an `array` of 4-byte items:
    their bytes as they are), `None` or nothing for none; what exports no buffer (a str, an int)
    is the same `TypeError` for both, and a refused metadata (also past 256 bytes, given as a
    `bytearray`, counted in bytes) keeps the frame open."""
    import array

    kinds = (bytes, bytearray, lambda b: memoryview(b"<" + b + b">")[1:-1], lambda b: array.array("I", b))
    with cuda_ipc.Producer(name, 64, buffers=2, memory="host") as tx:
        rx = cuda_ipc.Consumer(name)
        for kind in kinds:
            with tx.acquire(timeout=ANSWER) as w:
                w.publish(kind(b"meta"))
            with rx.recv(timeout=ANSWER) as f:
                assert f.metadata == b"meta", kind
        for publish in (lambda w: w.publish(), lambda w: w.publish(None), lambda w: w.publish(metadata=None)):
            with tx.acquire(timeout=ANSWER) as w:
                publish(w)
            with rx.recv(timeout=ANSWER) as f:
                assert f.metadata == b""
        w = tx.acquire(timeout=ANSWER)
        w.write(b"kept")
        refused = []
        for bad in ("text", 5):
            with pytest.raises(TypeError) as e:
                w.publish(bad)
            refused.append(type(e.value))
        with pytest.raises(cuda_ipc.InvalidArgument, match=r"metadata is 257 bytes; at most 256"):
            w.publish(bytearray(257))
        seq = w.publish(memoryview(b"late"))
        with rx.recv(timeout=ANSWER) as f:
            assert (f.seq, f.metadata, f.read(0, 4)) == (seq, b"late", b"kept")
            assert repr(f).endswith("metadata=4 bytes, host)"), repr(f)
        with tx.acquire(timeout=ANSWER) as w:
            w.publish(bytearray(b"1"))
        with rx.recv(timeout=ANSWER) as f:
            assert repr(f).endswith("metadata=1 byte, host)"), repr(f)
        rx.close()
    # The same kinds, and the same refusals, for a commit's content.
    ts = cuda_ipc.TensorSetWriter(name, {"a": ((4,), "uint8")}, memory="host")
    try:
        for kind in kinds:
            u = ts.begin(timeout=ANSWER)
            u.commit(content=kind(bytes(range(32))))
        u = ts.begin(timeout=ANSWER)
        for bad, was in zip(("text", 5), refused):
            with pytest.raises(TypeError) as e:
                u.commit(content=bad)
            assert type(e.value) is was
        u.abort()
    finally:
        ts.close()


def test_a_range_of_one_byte_past_a_frames_end_is_said_in_the_singular(name):
    with cuda_ipc.Producer(name, 64, buffers=1, memory="host") as tx:
        w = tx.acquire(timeout=ANSWER)
        with pytest.raises(cuda_ipc.InvalidArgument) as e:
            w.write(b"x", offset=64)
        assert str(e.value) == (
            "invalid argument: 1 byte at offset 64 would pass the end of a 64-byte buffer"
        )
        with pytest.raises(cuda_ipc.InvalidArgument) as e:
            w.read(63, 2)
        assert str(e.value) == (
            "invalid argument: 2 bytes at offset 63 would pass the end of a 64-byte buffer"
        )
        w.abandon()


# Integer arguments out of their range: each an `InvalidArgument` naming the argument and the
# range (never the `OverflowError` of the conversion), and nothing made.
BAD_INTS = [
    ("buffer_bytes", lambda n: cuda_ipc.Producer(n, -1, memory="host")),
    ("buffer_bytes", lambda n: cuda_ipc.Producer(n, 2**64, memory="host")),
    ("buffers", lambda n: cuda_ipc.Producer(n, 64, buffers=-1, memory="host")),
    ("buffers", lambda n: cuda_ipc.Producer(n, 64, buffers=2**70, memory="host")),
    ("buffers", lambda n: cuda_ipc.Producer(n, 64, buffers=True, memory="host")),
    ("max_consumers", lambda n: cuda_ipc.Producer(n, 64, max_consumers=-3, memory="host")),
    ("quota_bytes", lambda n: cuda_ipc.Producer(n, 64, quota_bytes=-1, memory="host")),
    ("device", lambda n: cuda_ipc.Producer(n, 64, device=-1, memory="host")),
    ("device", lambda n: cuda_ipc.Producer(n, 64, device=2**31, memory="host")),
    ("budget_bytes", lambda n: cuda_ipc.set_quota(-1)),
    ("budget_bytes", lambda n: cuda_ipc.set_quota(-(10**400))),
    ("device", lambda n: cuda_ipc.set_quota(1, device=-1)),
    ("device", lambda n: cuda_ipc.remove_quota(device=2**64)),
]


@pytest.mark.parametrize("arg, call", BAD_INTS, ids=[f"{a}{i}" for i, (a, _) in enumerate(BAD_INTS)])
def test_out_of_range_ints_raise_invalid_argument_naming_the_argument_and_range(name, arg, call):
    with pytest.raises(cuda_ipc.InvalidArgument, match=f"^invalid argument: {arg} must be an int from -?[0-9]+ to [0-9]+, got "):
        call(name)
    assert not (SHM / f"cuda-ipc.ch.{name}").exists()


def test_out_of_range_offsets_of_frames_raise_invalid_argument(name):
    with cuda_ipc.Producer(name, 64, buffers=2, memory="host") as tx:
        rx = cuda_ipc.Consumer(name)
        w = tx.acquire(timeout=ANSWER)
        for arg, call in (
            ("offset", lambda: w.write(b"x", offset=-1)),
            ("offset", lambda: w.write(b"x", offset=2**64)),
            ("offset", lambda: w.read(-1, 1)),
            ("n", lambda: w.read(0, -1)),
        ):
            with pytest.raises(cuda_ipc.InvalidArgument, match=f"^invalid argument: {arg} must be an int from 0 to "):
                call()
        w.publish(b"")
        with rx.recv(timeout=ANSWER) as f:
            for arg, call in (("offset", lambda: f.read(-1, 1)), ("n", lambda: f.read(0, 2**64))):
                with pytest.raises(cuda_ipc.InvalidArgument, match=f"^invalid argument: {arg} must be an int from 0"):
                    call()
            assert len(f.read(0, 1)) == 1
        rx.close()


# ---------------------------------------------------------------- close(): what it waits for,
# and Ctrl-C during it

def test_close_waits_for_an_every_frame_consumer_to_receive_and_reports_those_behind(name):
    tx = cuda_ipc.Producer(name, 64, buffers=2, memory="host")
    rx = cuda_ipc.Consumer(name)
    latest = cuda_ipc.Consumer(name, delivery="latest")
    with tx.acquire(timeout=ANSWER) as w:
        w.publish(b"")
    start = time.monotonic()
    # Neither consumer received the frame; the latest-only one is not waited for.
    assert tx.close(timeout=0.3) == {"forced_holds": 0, "consumers_behind": 1}
    assert time.monotonic() - start >= 0.25
    rx.close()
    latest.close()
    # Received (and released): close returns at once, nobody behind.
    tx = cuda_ipc.Producer(name, 64, buffers=2, memory="host")
    rx = cuda_ipc.Consumer(name)
    with tx.acquire(timeout=ANSWER) as w:
        w.publish(b"")
    rx.recv(timeout=ANSWER).release()
    start = time.monotonic()
    assert tx.close(timeout=ANSWER) == {"forced_holds": 0, "consumers_behind": 0}
    assert time.monotonic() - start < ANSWER / 2
    rx.close()


def interrupted_after(delay, call):
    """Runs `call` with SIGINT sent to this process `delay` s in (default handler: the main thread
    raises KeyboardInterrupt); returns how long `call` ran before it raised KeyboardInterrupt."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    try:
        start = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            call()
        return time.monotonic() - start
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)


def test_ctrl_c_interrupts_a_producer_close_waiting_for_a_hold_and_close_can_finish(name):
    tx = cuda_ipc.Producer(name, 64, buffers=2, memory="host")
    rx = cuda_ipc.Consumer(name)
    with tx.acquire(timeout=ANSWER) as w:
        w.write(b"held")
        w.publish(b"")
    f = rx.recv(timeout=ANSWER)  # held: close() waits for it
    took = interrupted_after(0.3, lambda: tx.close(timeout=30))
    assert took < 0.3 + 2.0, f"KeyboardInterrupt {took:.3f} s into close()"
    # Interrupted: closed to new frames, the pool not freed yet.
    with pytest.raises(cuda_ipc.ChannelClosed):
        tx.acquire(timeout=0)
    assert (SHM / f"cuda-ipc.ch.{name}").exists()
    assert f.read(0, 4) == b"held"
    f.release()
    with pytest.raises(cuda_ipc.ChannelClosed):
        rx.recv(timeout=ANSWER)
    # close() again finishes, at once now that nothing is held.
    start = time.monotonic()
    assert tx.close(timeout=ANSWER) == {"forced_holds": 0, "consumers_behind": 0}
    assert time.monotonic() - start < ANSWER / 2
    assert not (SHM / f"cuda-ipc.ch.{name}").exists()
    assert not (SHM / f"cuda-ipc.hp.{name}").exists()
    assert tx.close() == {"forced_holds": 0, "consumers_behind": 0}
    rx.close()
