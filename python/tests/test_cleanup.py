"""`cuda_ipc.cleanup`: what dead processes left, by the library's one rule set (`cuda-ipc gc`).
A child Python process (started with `sys.executable`, never forked) creates a host-memory
channel and is killed with SIGKILL; the dry run lists its channel and host pool and removes
nothing, the real run removes exactly those and reports them; a live producer's channel is never
listed. Another user's channel and quota ledger (as root: the user made with `useradd`, as
tests/two_users.rs makes it, and a child process that becomes that user before it makes them) are
in the result's `skipped`, never among its leftovers, and left as they are. Run: `pip install
./python && pytest python/tests`."""

import os
import pathlib
import pwd
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


USER = "cuda-ipc-test"

# Started as root (the interpreter and the installed package may sit where other users cannot
# reach), it becomes the test user for good (groups, gid, then uid) before it makes anything:
# from there on a process of that user only, as a child started under its uid is.
OTHER_CHILD = textwrap.dedent(
    """
    import os, sys, time, cuda_ipc
    uid, gid = int(sys.argv[2]), int(sys.argv[3])
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    cuda_ipc.set_quota(1 << 20)  # this user's host-memory ledger
    p = cuda_ipc.Producer(sys.argv[1], 4096, buffers=2, memory="host")
    print("created", flush=True)
    time.sleep(60)
    """
)


def other_user():
    """The test user's (uid, gid), made with `useradd` when missing, as tests/two_users.rs makes
    it. Skipped only where this process is not root; as root, a user that cannot be made fails."""
    if os.geteuid() != 0:
        pytest.skip("needs root: to make a second user with useradd and run a process as it")
    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/bin/false", USER],
            capture_output=True,
            text=True,
        )
        try:
            pw = pwd.getpwnam(USER)  # another test may have made it meanwhile
        except KeyError:
            pytest.fail(f"useradd {USER} failed: {made.returncode} {made.stderr.strip()}")
    return pw.pw_uid, pw.pw_gid


def test_cleanup_lists_another_users_channel_and_ledger_in_skipped_and_leaves_them(names):
    uid, gid = other_user()
    name = names[0]
    theirs = {
        f"cuda-ipc.ch.{name}": "channel segment",
        f"cuda-ipc.hp.{name}": "host pool",
        f"cuda-ipc.quota.u{uid}.{'0' * 32}": "quota ledger",
    }
    ledger = next(n for n, what in theirs.items() if what == "quota ledger")
    ledger_was_there = (SHM / ledger).exists()
    child = subprocess.Popen(
        [sys.executable, "-c", OTHER_CHILD, name, str(uid), str(gid)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        try:
            line = child.stdout.readline().strip()
        finally:
            # Killed: its channel is a dead producer's, which this user's cleanup would remove.
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=ANSWER)
        assert line == "created", f"the child as uid {uid}: {child.stderr.read()}"
        for n in theirs:
            assert (SHM / n).stat().st_uid == uid, n
        expected = [
            {"name": n, "owner": uid, "what": what, "dead": False, "pid": None}
            for n, what in sorted(theirs.items())
        ]
        for dry_run in (True, False):
            found = cuda_ipc.cleanup(dry_run=dry_run)
            # The list itself as before: leftovers only, in their shape; nothing of theirs.
            assert isinstance(found, list) and type(found) is cuda_ipc.CleanupResult
            assert list(found) == found
            for l in found:
                assert set(l) == {"kind", "object", "pid", "uid", "what"}, l
            assert ours(found, name) == [], f"dry_run={dry_run}: another user's is no leftover"
            assert not any(l["object"] in theirs for l in found), found
            # What of theirs it passed over, in `gc --json`'s words, sorted by name.
            skipped = found.skipped
            for s in skipped:
                assert set(s) == {"name", "owner", "what", "dead", "pid"}, s
            assert [s["name"] for s in skipped] == sorted(s["name"] for s in skipped)
            assert [s for s in skipped if s["name"] in theirs] == expected, skipped
            for n in theirs:
                assert (SHM / n).stat().st_uid == uid, f"dry_run={dry_run}: {n} left as it was"
    finally:
        # The test's own debris, by hand (theirs: no cleanup() of ours removes it).
        for n in theirs:
            if n != ledger or not ledger_was_there:
                (SHM / n).unlink(missing_ok=True)
        for f in SHM.glob(f"cuda-ipc.live.*.{child.pid}.*"):
            f.unlink(missing_ok=True)
