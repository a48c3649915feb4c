"""`cuda_ipc.cleanup`: what dead processes left, by the library's one rule set (`cuda-ipc gc`).
A child Python process (started with `sys.executable`, never forked) creates a host-memory
channel and is killed with SIGKILL; the dry run lists its channel and host pool and removes
nothing, the real run removes exactly those and reports them; a live producer's channel is never
listed. Run: `pip install ./python && pytest python/tests`."""

import pathlib
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest

import cuda_ipc

SHM = pathlib.Path("/dev/shm")
ANSWER = 10.0

CHILD = textwrap.dedent(
    """
    import sys, time, cuda_ipc
    p = cuda_ipc.Producer(sys.argv[1], 4096, buffers=2, memory="host")
    print("created", flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def names():
    """Two fresh channel names; their segments are removed afterwards if anything left them."""
    ns = [f"pytest-cleanup-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    yield ns
    for n in ns:
        for prefix in ("cuda-ipc.ch.", "cuda-ipc.hp."):
            (SHM / f"{prefix}{n}").unlink(missing_ok=True)


def ours(found, channel):
    """The leftovers of `found` that belong to `channel`, as (kind, object) pairs."""
    return sorted((l["kind"], l["object"]) for l in found if l["object"] == channel)


def test_cleanup_dry_run_lists_a_killed_producers_channel_and_the_real_run_removes_it(names):
    dead, live = names
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, dead], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "created"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=ANSWER)
    keep = cuda_ipc.Producer(live, 4096, buffers=2, memory="host")
    expected = [("channel", dead), ("host_pool", dead)]

    listed = cuda_ipc.cleanup(dry_run=True)
    assert ours(listed, dead) == expected
    assert ours(listed, live) == [], "a live producer's channel is never a leftover"
    assert (SHM / f"cuda-ipc.ch.{dead}").exists(), "the dry run removed nothing"
    assert (SHM / f"cuda-ipc.hp.{dead}").exists()
    for l in listed:
        assert set(l) == {"kind", "object", "pid", "uid", "what"}
    channel = next(l for l in listed if l["object"] == dead and l["kind"] == "channel")
    assert channel["pid"] == child.pid
    assert "dead producer" in channel["what"]

    removed = cuda_ipc.cleanup()
    assert ours(removed, dead) == expected
    assert not (SHM / f"cuda-ipc.ch.{dead}").exists()
    assert not (SHM / f"cuda-ipc.hp.{dead}").exists()
    assert ours(removed, live) == []
    assert (SHM / f"cuda-ipc.ch.{live}").exists(), "the live one stays"
    assert ours(cuda_ipc.cleanup(dry_run=True), dead) == [], "nothing left to list"
    keep.close()
