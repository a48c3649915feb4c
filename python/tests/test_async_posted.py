"""Awaitable waits (`Consumer.recv_async`, `Producer.acquire_async`, `Posted.wait_async`) and
receives posted ahead (`Consumer.post`, `Posted`, `PostedFrame`).

On CPU (host-memory channels): frames from a producer in another process awaited while a ticker
task keeps running; a cancelled wait stops its thread (the loop closes at once) and loses no
frame; a cancelled `acquire_async` gives the producer back; `post` refuses a host channel; a
ring-order host channel hands buffers out in ring order. The GPU tests (posted receives) run when
`CUDA_IPC_GPU_TESTS=1` and fail, not pass, without a GPU. Every wait is bounded.
Run: `pip install ./python && pytest python/tests`."""

import asyncio
import os
import pathlib
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

import cuda_ipc

SHM = pathlib.Path("/dev/shm")
# The longest any single step waits.
ANSWER = 10.0
GPU = pytest.mark.skipif(
    os.environ.get("CUDA_IPC_GPU_TESTS") != "1", reason="needs a CUDA GPU: set CUDA_IPC_GPU_TESTS=1"
)


@pytest.fixture
def name():
    """A fresh channel name; both its segments are removed afterwards if anything left them."""
    n = f"pytest-aio-{uuid.uuid4().hex[:12]}"
    yield n
    for prefix in ("cuda-ipc.ch.", "cuda-ipc.hp."):
        p = SHM / f"{prefix}{n}"
        if p.exists() or p.is_symlink():
            p.unlink()


def payload(seq: int, nbytes: int) -> bytes:
    return bytes((seq * 31 + k) & 0xFF for k in range(nbytes))


# argv: name, frames, nbytes. Creates a host channel, waits for one consumer, then publishes
# `frames` frames 5 ms apart and closes (waiting for the consumer's holds).
PRODUCER = """
import sys, time
import cuda_ipc
name, frames, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def payload(seq, nbytes):
    return bytes((seq * 31 + k) & 0xFF for k in range(nbytes))
with cuda_ipc.Producer(name, nbytes, buffers=4, memory="host") as tx:
    print("created", flush=True)
    deadline = time.monotonic() + 10
    while not tx.stats()["consumers"] and time.monotonic() < deadline:
        time.sleep(0.005)
    for seq in range(1, frames + 1):
        time.sleep(0.005)
        with tx.acquire(timeout=10) as w:
            w.write(payload(seq, nbytes))
            w.publish(seq.to_bytes(8, "little"))
    tx.close(timeout=10)
"""


def test_recv_async_takes_every_frame_of_another_process_while_the_loop_runs(name):
    frames, nbytes = 40, 4096
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PRODUCER), name, str(frames), str(nbytes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert child.stdout.readline().split() == [b"created"], child.stderr.read()

        async def main():
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.002)
                    ticks += 1

            t = asyncio.create_task(ticker())
            rx = cuda_ipc.Consumer(name)
            seqs = []
            try:
                while True:
                    try:
                        f = await rx.recv_async(timeout=ANSWER)
                    except cuda_ipc.ChannelClosed:
                        break
                    with f:
                        assert f.bytes() == payload(f.seq, nbytes), f"frame {f.seq}"
                        assert int.from_bytes(f.metadata, "little") == f.seq
                        seqs.append(f.seq)
            finally:
                t.cancel()
                rx.close()
            return seqs, ticks

        seqs, ticks = asyncio.run(main())
        assert seqs == list(range(1, frames + 1))
        # 40 frames 5 ms apart: at least 200 ms of waiting, during which the ticker ran.
        assert ticks >= 20, ticks
        assert child.wait(ANSWER) == 0, child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(ANSWER)


def test_recv_async_timeout_raises_timeout(name):
    with cuda_ipc.Producer(name, 64, memory="host"):
        rx = cuda_ipc.Consumer(name)

        async def main():
            t0 = time.monotonic()
            with pytest.raises(cuda_ipc.Timeout):
                await rx.recv_async(timeout=0.05)
            return time.monotonic() - t0

        assert 0.04 <= asyncio.run(main()) < ANSWER
        rx.close()


def test_a_cancelled_recv_async_stops_its_thread_and_loses_no_frame(name):
    with cuda_ipc.Producer(name, 64, memory="host") as tx:
        rx = cuda_ipc.Consumer(name)

        async def main():
            # No timeout: only the cancellation ends this wait.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(rx.recv_async(), 0.1)
            task = asyncio.create_task(rx.recv_async())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        t0 = time.monotonic()
        # `asyncio.run` ends by joining the executor's threads: it returns only once both waits
        # stopped.
        asyncio.run(main())
        assert time.monotonic() - t0 < 2.0
        assert rx.stats()["consumers"][0]["in_flight"] == 0
        with tx.acquire(timeout=ANSWER) as w:
            w.write(b"one")
            assert w.publish(b"m1") == 1
        f = rx.recv(timeout=ANSWER)
        assert (f.seq, f.metadata, f.read(0, 3)) == (1, b"m1", b"one")
        f.release()
        rx.close()


def test_recv_async_cancelled_while_frames_arrive_loses_none_and_keeps_their_order(name):
    """A producer publishes 400 frames about 1 ms apart (every-frame delivery) while the consumer
    receives with `asyncio.wait_for(rx.recv_async(), t)` for t of 0.2 to 3 ms, so that most
    receives are cancelled, many of them while their thread is still in its last slice and takes a
    frame; every third attempt is a plain `recv` or `try_recv` instead. Every frame arrives exactly
    once, in order, with its bytes: a frame a cancelled receive took waits for the next receive
    (before, it was released unseen and lost)."""
    import random
    import threading

    frames = 400
    tx = cuda_ipc.Producer(name, 64, buffers=8, memory="host")
    rx = cuda_ipc.Consumer(name)
    stop = threading.Event()

    def produce():
        for seq in range(1, frames + 1):
            if stop.is_set():
                return
            with tx.acquire(timeout=ANSWER) as w:
                w.write(payload(seq, 64))
                w.publish(seq.to_bytes(8, "little"))
            time.sleep(0.001)

    got = []

    def keep(f):
        with f:
            seq = int.from_bytes(f.metadata, "little")
            assert f.read(0, 64) == payload(seq, 64), seq
            got.append(seq)

    async def main():
        rnd = random.Random(7)
        deadline = time.monotonic() + 30
        k = 0
        while len(got) < frames and time.monotonic() < deadline:
            k += 1
            if k % 3 == 0:
                try:
                    f = rx.recv(timeout=0.002) if k % 2 else rx.try_recv()
                except cuda_ipc.Timeout:
                    continue
                if f is not None:
                    keep(f)
                continue
            try:
                keep(await asyncio.wait_for(rx.recv_async(timeout=ANSWER), rnd.uniform(2e-4, 3e-3)))
            except (asyncio.TimeoutError, cuda_ipc.Timeout):
                pass

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    try:
        asyncio.run(main())
    finally:
        stop.set()
        t.join(ANSWER)
    assert got == list(range(1, frames + 1)), (len(got), got[:20])
    assert rx.stats()["consumers"][0]["in_flight"] == 0
    rx.close()
    tx.close(timeout=ANSWER)


def test_acquire_async_waits_for_a_release_and_a_cancelled_one_gives_the_producer_back(name):
    with cuda_ipc.Producer(name, 64, buffers=2, memory="host") as tx:
        rx = cuda_ipc.Consumer(name)
        for seq in (1, 2):
            with tx.acquire(timeout=ANSWER) as w:
                w.publish(bytes([seq]))

        async def main():
            # Both buffers wait for the every-frame consumer: the acquire waits.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(tx.acquire_async(), 0.1)
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.002)
                    ticks += 1

            t = asyncio.create_task(ticker())
            waiting = asyncio.create_task(tx.acquire_async(timeout=ANSWER))
            await asyncio.sleep(0.1)
            assert not waiting.done()
            f = await rx.recv_async(timeout=ANSWER)
            assert f.seq == 1
            f.release()
            w = await waiting
            t.cancel()
            return w, ticks

        w, ticks = asyncio.run(main())
        assert ticks >= 20, ticks
        assert w.publish(b"3") == 3
        # The cancelled acquire gave the producer back: acquiring again works (the buffer of
        # frame 2 is released by the receive below).
        assert rx.recv(timeout=ANSWER).seq == 2
        with tx.acquire(timeout=ANSWER) as w:
            assert w.publish(b"4") == 4
        rx.close()
    assert not (SHM / f"cuda-ipc.ch.{name}").exists()


def test_many_pending_receives_do_not_keep_a_producer_in_the_same_loop_from_starting(name):
    # As many pending receives as the loop's default executor has threads, and more: the
    # producer's acquire, awaited in the same loop, still starts and publishes to all of them
    # (on the default executor it never started, its own timeout included: a deadlock).
    n = min(32, (os.cpu_count() or 1) + 4) + 4
    with cuda_ipc.Producer(name, 64, buffers=2, max_consumers=n, memory="host") as tx:
        rxs = [cuda_ipc.Consumer(name) for _ in range(n)]

        async def main():
            waits = [asyncio.ensure_future(rx.recv_async(timeout=ANSWER)) for rx in rxs]
            await asyncio.sleep(0.2)
            w = await asyncio.wait_for(tx.acquire_async(timeout=1.0), 5.0)
            w.publish(b"x")
            got = await asyncio.wait_for(asyncio.gather(*waits), ANSWER)
            return [(f.seq, f.metadata) for f in got]

        assert asyncio.run(main()) == [(1, b"x")] * n
        for rx in rxs:
            rx.close()
    assert not (SHM / f"cuda-ipc.ch.{name}").exists()


def test_an_acquire_awaited_right_after_a_cancelled_one_finds_the_producer_free(name):
    # A pool of one buffer a consumer holds: each round an acquire_async is cancelled, the
    # consumer lets the buffer go at about that moment, and an acquire_async awaited at once
    # gets the buffer (the cancelled one's, had it taken it, went back at once: no
    # "a WriteFrame of it is outstanding").
    with cuda_ipc.Producer(name, 64, buffers=1, memory="host") as tx:
        rx = cuda_ipc.Consumer(name)

        async def main():
            for r in range(30):
                w = await tx.acquire_async(timeout=ANSWER)
                w.publish(bytes([r]))
                f = await rx.recv_async(timeout=ANSWER)
                waiting = asyncio.ensure_future(tx.acquire_async(timeout=ANSWER))
                await asyncio.sleep(0.001 * (r % 7))
                if r % 2:
                    f.release()
                    waiting.cancel()
                else:
                    waiting.cancel()
                    f.release()
                try:
                    w = await waiting
                    w.abandon()  # it won the race: it had the buffer before the cancellation
                except asyncio.CancelledError:
                    pass
                w = await asyncio.wait_for(tx.acquire_async(timeout=ANSWER), ANSWER)
                w.abandon()

        asyncio.run(main())
        rx.close()
    assert not (SHM / f"cuda-ipc.ch.{name}").exists()


def test_awaitables_are_coroutines_that_wait_only_once_awaited(name):
    with cuda_ipc.Producer(name, 64, memory="host") as tx:
        rx = cuda_ipc.Consumer(name)
        # Made and never awaited: nothing waits (no thread holds the consumer or the producer).
        for c in (rx.recv_async(), tx.acquire_async()):
            assert asyncio.iscoroutine(c)
            c.close()
        with tx.acquire(timeout=ANSWER) as w:
            w.abandon()
        # Awaited outside a running loop.
        c = rx.recv_async(timeout=0.01)
        with pytest.raises(RuntimeError):
            c.send(None)
        c.close()

        async def main():
            # `create_task` takes them, and `asyncio.run` cancels a task left pending at its end.
            asyncio.create_task(rx.recv_async())
            await asyncio.sleep(0.05)

        t0 = time.monotonic()
        asyncio.run(main())
        assert time.monotonic() - t0 < 2.0
        rx.close()


def test_post_on_a_host_channel_raises_invalid_argument_and_calls_no_work(name):
    called = []
    with cuda_ipc.Producer(name, 64, memory="host", ring=True):
        rx = cuda_ipc.Consumer(name)
        with pytest.raises(cuda_ipc.InvalidArgument, match="no stream to post"):
            rx.post(called.append)
        assert called == []
        rx.close()
        with pytest.raises(cuda_ipc.Detached):
            rx.post()


def test_a_ring_order_host_channel_puts_frame_s_in_buffer_s_minus_1_mod_buffers(name):
    buffers = 3
    with cuda_ipc.Producer(name, 64, buffers=buffers, memory="host", ring=True) as tx:
        rx = cuda_ipc.Consumer(name)
        for seq in range(1, 3 * buffers + 1):
            with tx.acquire(timeout=ANSWER) as w:
                assert w.index == (seq - 1) % buffers
                w.publish(b"")
            f = rx.recv(timeout=ANSWER)
            assert (f.seq, f.index) == (seq, (seq - 1) % buffers)
            f.release()
        rx.close()


@GPU
def test_posted_receives_take_gpu_frames_in_order_with_their_metadata(name):
    buffers, nbytes = 3, 1 << 16
    with cuda_ipc.Producer(name, nbytes, buffers=buffers, ring=True) as tx:
        rx = cuda_ipc.Consumer(name)
        seen = []
        posted = [rx.post(seen.append) for _ in range(buffers)]
        # `work` got the object `post` returned, before the receive was posted.
        assert seen == posted
        for k, p in enumerate(posted, start=1):
            assert (p.seq, p.index) == (k, (k - 1) % buffers)
            assert p.ptr and p.stream and p.gate_ptr and p.nbytes >= nbytes
        for seq in range(1, buffers + 1):
            with tx.acquire(timeout=ANSWER) as w:
                w.publish(f"m{seq}".encode())
        for k, p in enumerate(posted, start=1):
            f = p.wait(timeout=ANSWER)
            assert (f.seq, f.index, f.metadata) == (k, (k - 1) % buffers, f"m{k}".encode())
        with pytest.raises(cuda_ipc.InvalidArgument):
            posted[0].wait(timeout=0)

        async def main(k):
            p = rx.post()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(p.wait_async(), 0.1)
            # Published before the loop runs again: the cancelled wait's thread, still in its
            # last slice, may take it; it must be left to the next wait all the same.
            with tx.acquire(timeout=ANSWER) as w:
                w.publish(f"late{k}".encode())
            return await p.wait_async(timeout=ANSWER)

        for k in range(4):
            f = asyncio.run(main(k))
            assert (f.seq, f.metadata) == (buffers + 1 + k, f"late{k}".encode())
        rx.close()


@GPU
def test_post_refuses_a_channel_not_in_ring_order_and_passes_on_what_work_raised(name):
    with cuda_ipc.Producer(name, 4096) as tx:
        rx = cuda_ipc.Consumer(name)
        with pytest.raises(cuda_ipc.InvalidArgument, match="ring order"):
            rx.post()
        rx.close()
        tx.close()
    with cuda_ipc.Producer(name, 4096, ring=True):
        rx = cuda_ipc.Consumer(name)

        def work(p):
            raise KeyError(p.seq)

        with pytest.raises(KeyError):
            rx.post(work)
        rx.close()
