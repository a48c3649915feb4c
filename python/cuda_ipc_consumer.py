"""Attach to a cuda-ipc channel as a consumer from Python and hand each frame to PyTorch or CuPy
without copying.

A pure-Python twin of the Rust ``cuda_ipc::channel::Consumer``: it maps the channel's control
segment ``/dev/shm/cuda-ipc.ch.NAME`` (channel layout version 3, token layout version 2), claims a
consumer slot under this process's identity (pid, start time, boot id, pid namespace; like every
process of cuda-ipc it holds a liveness lock on ``/dev/shm/cuda-ipc.live.*``, which tells other
processes in any pid namespace whether it runs), takes frames with the same hold protocol and
memory orderings as the Rust consumer, and does the GPU side through the CUDA driver API
(``libcuda.so.1``, loaded with ctypes): it imports the pool (legacy IPC memory with
``cuIpcOpenMemHandle_v2``; VMM allocations and memory-pool allocations through POSIX fds fetched
from the producer's fd server over a Unix socket, ``fetch_fds``), registers the segment's ready
page (``cuMemHostRegister_v2``), makes its stream wait for each frame on the buffer's ready word,
which the producer's stream writes after its work
(``cuStreamWaitValue32_v2``), and records its own IPC release event before it gives a frame back
(``cuEventRecord``). When the producer dies it marks published frames ready itself, so its stream
never waits for a write that will never finish (the frames may then hold partial data). No compiled
code; it needs ``libatomic.so.1`` for atomic operations on shared memory, and nothing else outside
the standard library. PyTorch and CuPy are imported only when a frame is turned into a tensor or
array.

    from cuda_ipc_consumer import Consumer, ChannelClosed
    import torch

    with Consumer.attach("frames") as rx:          # every frame, PyTorch's current stream
        while True:
            try:
                frame = rx.recv(timeout=10.0)
            except ChannelClosed:
                break
            with frame:                            # released (stream-ordered) at the end
                t = frame.as_tensor((2160, 3840, 4), torch.uint8)
                ...                                # enqueue work on the current stream

Layout, protocol and orderings: docs/ARCHITECTURE.md ("Channel protocol") and
``src/channel/control.rs`` of the cuda-ipc repository; usage: python/README.md.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import errno
import fcntl
import importlib
import os
import platform
import stat
import struct
import sys
import threading
import time
import warnings
import weakref
import zlib
from typing import Callable, NamedTuple, Optional, TypeVar

__all__ = [
    "Consumer",
    "Frame",
    "Token",
    "ProcessIdentity",
    "CudaIpcError",
    "ChannelNotFound",
    "BadSegment",
    "NoConsumerSlot",
    "ProducerGone",
    "ChannelClosed",
    "Detached",
    "Superseded",
    "Timeout",
    "InvalidToken",
    "NotSupported",
    "FdNotOffered",
    "FdPassingError",
    "fetch_fds",
    "AtomicsUnavailable",
    "CudaUnavailable",
    "CudaError",
    "LAYOUT_VERSION",
    "TOKEN_VERSION",
]

# ---------------------------------------------------------------------------------------- errors


class CudaIpcError(Exception):
    """Base class of every error this module raises."""


class ChannelNotFound(CudaIpcError):
    """No channel of this name exists (no producer created it, or it was closed)."""


class BadSegment(CudaIpcError):
    """The control segment is foreign, of another layout version, truncated, corrupted, owned by
    another user, not fully created (sparse), or not a segment at all (a FIFO, directory, socket,
    device or symbolic link under its name)."""


class NoConsumerSlot(CudaIpcError):
    """Every consumer slot of the channel is taken."""


class ProducerGone(CudaIpcError):
    """The producer process died: its liveness lock is free or its liveness file gone (in any pid
    namespace), or, in this pid namespace without a liveness file, its pid names no process of its
    start time."""

    def __init__(self, pid: int, who: Optional[str] = None):
        super().__init__(f"the producer ({who or f'pid {pid}'}) is gone")
        self.pid = pid


class ChannelClosed(CudaIpcError):
    """The producer closed the channel and every frame it published was delivered."""


class Superseded(CudaIpcError):
    """The channel's name now stands for another segment than the one this consumer attached to (it
    was removed and made again, e.g. by a restarted producer): attach again."""

    def __init__(self, channel: str):
        super().__init__(
            f'channel "{channel}" was superseded: its segment was removed and made again; attach again'
        )
        self.channel = channel


class Detached(CudaIpcError):
    """This consumer's slot was taken back (the producer judged it dead, or it was closed)."""


class Timeout(CudaIpcError, TimeoutError):
    """A bounded wait ran out."""


class InvalidToken(CudaIpcError):
    """A 144-byte token in the segment is garbage, corrupted, or of another layout version."""


class NotSupported(CudaIpcError):
    """A feature the device or the platform lacks (IPC events, VMM), or an fd exporter that
    refuses this process (another user) or speaks another protocol version."""


class FdNotOffered(CudaIpcError):
    """The exporter runs but does not offer this fd export id (withdrawn or never made), or serves
    no fds at all."""

    def __init__(self, pid: int, export_id: int, reason: str):
        super().__init__(f"process {pid} does not offer fd export {export_id}: {reason}")
        self.pid = pid
        self.export_id = export_id


class FdPassingError(CudaIpcError):
    """Fetching fds from the exporter's fd server failed: a system call failed or the reply was
    malformed."""


class AtomicsUnavailable(CudaIpcError):
    """``libatomic.so.1`` could not be loaded: Python has no atomic operations on shared memory of
    its own, so the channel cannot be used without it."""


class CudaUnavailable(CudaIpcError):
    """The CUDA driver library (``libcuda.so.1``) could not be loaded, or no device matches."""


class CudaError(CudaIpcError):
    """A CUDA driver call failed; ``call`` names it, ``code`` is the ``CUresult``."""

    def __init__(self, call: str, code: int, name: str, text: str):
        super().__init__(f"{call} failed: {name} ({text})")
        self.call = call
        self.code = code
        self.name = name


# ---------------------------------------------------------------------------------------- layout

#: Channel layout version this module reads (``VERSION`` in src/channel/control.rs).
LAYOUT_VERSION = 3
#: Token layout version this module reads and writes (``TOKEN_VERSION`` in src/token.rs).
TOKEN_VERSION = 2

_MAGIC = int.from_bytes(b"CIPCCHAN", "little")
_STAMP_READY = 0x52454459
_MAX_BUFFERS = 16
_MAX_CONSUMERS = 64
META_BYTES = 256
_WRITING = (1 << 64) - 1
_U64 = (1 << 64) - 1
_SEGMENT_PREFIX = "cuda-ipc.ch."
_MAX_SEGMENT_NAME = 200
_LIVENESS_EVERY = 0.020  # seconds, as LIVENESS_EVERY in control.rs
_STAMP_WAIT = 2.0  # seconds an opener waits for the creator's READY stamp
_SUPERSEDED_EVERY = 0.5  # seconds between looks at the channel's name in a wait (control.rs)

# Header (136 bytes)
_H_MAGIC, _H_VERSION, _H_STAMP, _H_BUFFERS, _H_CONSUMERS = 0, 8, 12, 16, 20
_H_BUFFER_BYTES, _H_SEGMENT_BYTES, _H_PRODUCER_PID, _H_PRODUCER_STATE = 24, 32, 40, 44
_H_PRODUCER_START, _H_PRODUCER_BOOT, _H_HEAD = 48, 56, 72
_H_PUBLISH_FUTEX, _H_RELEASE_FUTEX, _H_PUBLISHED, _H_FORCED = 80, 84, 88, 96
_H_PRODUCER_PID_NS, _H_GENERATION = 104, 112  # then a u32 of padding at 108; 2 reserved u64
_HEADER_BYTES = 136
# BufferSlot (576 bytes)
_B_SEQ, _B_HOLD, _B_USED, _B_META_LEN, _B_META, _B_TOKENS = 0, 8, 16, 24, 32, 288
_TOKEN_LEN = 144
_BUFFER_SLOT_BYTES = _B_TOKENS + 2 * _TOKEN_LEN
# ConsumerSlot (2376 bytes)
_C_STATE, _C_POLICY, _C_GENERATION, _C_PID, _C_PID_NS, _C_START, _C_BOOT = 0, 4, 8, 16, 20, 24, 32
_C_CURSOR, _C_RECEIVED, _C_DROPPED, _C_TOKENS = 48, 56, 64, 72
_CONSUMER_SLOT_BYTES = _C_TOKENS + _MAX_BUFFERS * _TOKEN_LEN
assert _BUFFER_SLOT_BYTES == 576 and _CONSUMER_SLOT_BYTES == 2376
# Ready page (``READY_PAGE`` in control.rs): at the next 4096-byte boundary after the consumer
# slots, one u32 per buffer: the low 32 bits of the seq of the last frame whose write in that buffer
# finished on the producer's stream (``cuStreamWriteValue32``). It ends the segment.
_READY_PAGE = 4096
_U32 = (1 << 32) - 1

# Consumer slot states, policies, producer state.
_FREE, _CLAIMING, _ACTIVE = 0, 1, 2
_EVERY, _LATEST = 0, 1
_CLOSED = 1

# C11 memory orders, as libatomic takes them.
_RELAXED, _CONSUME, _ACQUIRE, _RELEASE, _ACQ_REL, _SEQ_CST = 0, 1, 2, 3, 4, 5


_T = TypeVar("_T")


def _ready_offset(buffers: int, consumers: int) -> int:
    """Offset of the ready page: the end of the consumer slots rounded up to 4096 bytes."""
    end = _HEADER_BYTES + buffers * _BUFFER_SLOT_BYTES + consumers * _CONSUMER_SLOT_BYTES
    return -(-end // _READY_PAGE) * _READY_PAGE


def _layout_len(buffers: int, consumers: int) -> int:
    return _ready_offset(buffers, consumers) + _READY_PAGE


def _seq_ahead(want: int, cur: int) -> bool:
    """Whether the 32-bit ready value ``want`` is after ``cur`` in wrap-around order
    (``(int32)(want - cur) > 0``, the order ``CU_STREAM_WAIT_VALUE_GEQ`` compares in)."""
    return 0 < ((want - cur) & _U32) < 0x80000000


# ---------------------------------------------------------------------------------------- atomics


class _Atomics:
    """Sequentially consistent / acquire / release atomics on raw addresses, from libatomic.

    The functions are the ones GCC and Clang call for ``__atomic_*`` builtins they do not inline;
    on x86-64 and AArch64 they are lock-free for aligned 4- and 8-byte words, so they interoperate
    with Rust's ``AtomicU32``/``AtomicU64`` in another process. Loaded through ``ctypes.PyDLL`` (the
    calls never block, so the GIL is kept: cheaper than releasing it).
    """

    _instance: Optional["_Atomics"] = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> "_Atomics":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        candidates = [p for p in (ctypes.util.find_library("atomic"), "libatomic.so.1") if p]
        lib = None
        errors = []
        for path in candidates:
            try:
                lib = ctypes.PyDLL(path)
                break
            except OSError as e:
                errors.append(f"{path}: {e}")
        if lib is None:
            raise AtomicsUnavailable(
                "libatomic.so.1 not found (" + "; ".join(errors) + "): the channel's shared memory "
                "needs atomic operations that Python lacks; install it (Debian/Ubuntu: "
                "apt-get install libatomic1, Fedora/RHEL: dnf install libatomic)"
            )
        u64, u32, vp, ci = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int

        def f(name, res, *args):
            try:
                fn = getattr(lib, name)
            except AttributeError as e:
                raise AtomicsUnavailable(f"libatomic lacks {name}: {e}") from None
            fn.restype = res
            fn.argtypes = list(args)
            return fn

        self.load64 = f("__atomic_load_8", u64, vp, ci)
        self.load32 = f("__atomic_load_4", u32, vp, ci)
        self.store64 = f("__atomic_store_8", None, vp, u64, ci)
        self.store32 = f("__atomic_store_4", None, vp, u32, ci)
        self.fetch_or64 = f("__atomic_fetch_or_8", u64, vp, u64, ci)
        self.fetch_and64 = f("__atomic_fetch_and_8", u64, vp, u64, ci)
        self.fetch_add64 = f("__atomic_fetch_add_8", u64, vp, u64, ci)
        self.fetch_add32 = f("__atomic_fetch_add_4", u32, vp, u32, ci)
        self._cas32 = f("__atomic_compare_exchange_4", ctypes.c_bool, vp, vp, u32, ci, ci)

    def cas32(self, addr: int, expected: int, desired: int, success: int, failure: int) -> bool:
        """Compare-and-swap of the 32-bit word at ``addr``; True when it held ``expected``."""
        return self.compare_exchange32(addr, expected, desired, success, failure)[0]

    def compare_exchange32(
        self, addr: int, expected: int, desired: int, success: int, failure: int
    ) -> tuple:
        """Compare-and-swap of the 32-bit word at ``addr`` (strong): (True, ``expected``) when it
        held ``expected`` and now holds ``desired``, else (False, the value it held)."""
        exp = ctypes.c_uint32(expected)
        ok = bool(self._cas32(addr, ctypes.addressof(exp), desired, success, failure))
        return ok, exp.value


# ---------------------------------------------------------------------------------------- futex

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared: no FUTEX_PRIVATE_FLAG


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futex:
    """Shared ``FUTEX_WAIT``/``FUTEX_WAKE`` through ``syscall(2)`` (the kernel keys a shared futex
    on the page, so a waker in another process finds the sleeper)."""

    _instance: Optional["_Futex"] = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> "_Futex":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        machine = platform.machine().lower()
        if not sys.platform.startswith("linux") or machine not in _SYS_FUTEX:
            raise NotSupported(f"futex on {sys.platform}/{machine}: only Linux x86-64 and AArch64")
        self._nr = _SYS_FUTEX[machine]
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long

    def wait(self, addr: int, expected: int, timeout_s: float) -> None:
        """Sleeps while the word at ``addr`` holds ``expected``, at most ``timeout_s`` seconds.
        Every outcome (woken, changed, timed out, interrupted) returns: callers re-check."""
        t = max(0.0, timeout_s)
        ts = _Timespec(int(t), int((t - int(t)) * 1e9))
        r = self._syscall(
            ctypes.c_long(self._nr),
            ctypes.c_void_p(addr),
            ctypes.c_long(_FUTEX_WAIT),
            ctypes.c_long(expected),
            ctypes.byref(ts),
            ctypes.c_void_p(0),
            ctypes.c_long(0),
        )
        if r == -1:
            e = ctypes.get_errno()
            if e not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
                time.sleep(min(t, 0.001))  # as futex::wait: never spin on a failing call

    def wake(self, addr: int, n: int = 0x7FFFFFFF) -> None:
        """Wakes up to ``n`` sleepers on the word at ``addr``."""
        self._syscall(
            ctypes.c_long(self._nr),
            ctypes.c_void_p(addr),
            ctypes.c_long(_FUTEX_WAKE),
            ctypes.c_long(n),
            ctypes.c_void_p(0),
            ctypes.c_void_p(0),
            ctypes.c_long(0),
        )


# ---------------------------------------------------------------------------------------- identity

# Liveness across pid namespaces (src/identity.rs, module docs). Containers of one pod share
# /dev/shm but not pid numbers, so every process of cuda-ipc creates the liveness file
# /dev/shm/cuda-ipc.live.<pid ns>.<pid>.<start time> (mode 0644, empty) and holds an
# open-file-description write lock (F_OFD_SETLK, byte 0, length 1) on it for as long as it runs.
# The kernel drops the lock when the process exits or is killed; any process that sees the file
# asks with F_OFD_GETLK whether it is still held.
_LIVE_DIR = "/dev/shm"
_LIVE_PREFIX = "cuda-ipc.live."
# The Linux numbers (asm-generic/fcntl.h, the same on x86-64 and AArch64), for Pythons before 3.9.
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
# struct flock on 64-bit Linux: short l_type, short l_whence, (4 pad), off_t l_start, off_t l_len,
# pid_t l_pid, (4 pad): 32 bytes (checked against the C layout on x86-64 and AArch64).
_FLOCK = struct.Struct("=hhxxxxqqixxxx")
assert _FLOCK.size == 32
# What the lock of a liveness file says (LockState in identity.rs).
_HELD, _FREE_LOCK, _MISSING, _UNREADABLE = "held", "free", "missing", "unreadable"


class ProcessIdentity(NamedTuple):
    """Who a process is: pid (as ``getpid()`` counts it in its own pid namespace), start time
    (clock ticks since boot, field 22 of ``/proc/self/stat``, the same in every namespace), the
    kernel's boot id (16 bytes) and the pid namespace (inode number of ``/proc/self/ns/pid``; 0
    unknown), as ``cuda_ipc::identity::ProcessIdentity``."""

    pid: int
    start_time: int
    boot_id: bytes
    pid_ns: int = 0

    @staticmethod
    def current() -> "ProcessIdentity":
        """This process's identity, cached; the first call in a process (and in each child made
        by ``fork()``) also creates and locks its liveness file, which it holds until it exits
        (removed at a normal exit). Raises ``OSError`` when ``/proc`` cannot be read, or when the
        liveness file cannot be made and locked (``/dev/shm`` missing or full, or a file of that
        name that is not a regular file of this user)."""
        return _current_identity()

    def liveness(self) -> Optional[bool]:
        """True: running; False: gone; None: could not be told (callers treat it as alive). As
        ``ProcessIdentity::liveness``: another boot, or pid 0, is gone; then the liveness lock
        decides (held: running, free: gone); without a liveness file, ``/proc`` decides if it
        counts pids in this identity's namespace (same start time and not a zombie: running),
        else gone; a file that cannot be opened or tested leaves ``/proc`` to decide in the same
        namespace, else None. A few system calls: for slow paths only."""
        try:
            if _boot_id() != self.boot_id:
                return False
        except OSError:
            return None
        if self.pid == 0 or self.pid > 0x7FFFFFFF:
            return False
        state = _probe_lock(self.liveness_path())
        if state == _HELD:
            return True
        if state == _FREE_LOCK:
            return False
        if self.in_own_pid_namespace() and _proc_is_own_namespace():
            return self._proc_liveness()
        return False if state == _MISSING else None

    def _proc_liveness(self) -> Optional[bool]:
        try:
            got = _stat_of(self.pid)
        except OSError:
            return None
        return got is not None and got[1] == self.start_time and got[0] not in ("Z", "X")

    def in_own_pid_namespace(self) -> bool:
        """Whether this identity's pid is counted in the caller's pid namespace (so ``/proc/PID``
        and ``SO_PEERCRED`` pids mean this process); False when either namespace is unknown."""
        return self.pid_ns != 0 and self.pid_ns == _own_pid_ns()

    def liveness_path(self) -> str:
        """``/dev/shm/cuda-ipc.live.<pid ns>.<pid>.<start time>``."""
        return f"{_LIVE_DIR}/{_LIVE_PREFIX}{self.pid_ns}.{self.pid}.{self.start_time}"

    def describe(self) -> str:
        """``pid N``, or ``pid N in pid namespace M`` for another namespace (as Rust's Display)."""
        if self.pid_ns and self.pid_ns != _own_pid_ns():
            return f"pid {self.pid} in pid namespace {self.pid_ns}"
        return f"pid {self.pid}"


def _parse_stat(text: str) -> Optional[tuple]:
    """(state letter, start time) of a ``/proc/PID/stat`` line. The command name (field 2) may hold
    spaces and parentheses: fields are counted after the last ')'."""
    at = text.rfind(")")
    if at < 0:
        return None
    fields = text[at + 1 :].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _stat_of(pid) -> Optional[tuple]:
    """(state, start time) of ``/proc/PID/stat`` (``pid`` may be ``"self"``), None when there is no
    such process. Raises ``OSError`` for other failures."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return _parse_stat(text)


def _own_pid_ns() -> int:
    """The inode number of this process's pid namespace; 0 when it cannot be read (or does not fit
    the 32 bits every layout stores)."""
    try:
        ino = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
    return ino if 0 < ino <= _U32 else 0


_PROC_OWN: Optional[tuple] = None  # (pid, answer) of _proc_is_own_namespace


def _proc_is_own_namespace() -> bool:
    """Whether ``/proc`` counts pids as this process's namespace does (its ``self`` entry has the
    pid ``getpid()`` returns): not so after ``unshare --pid`` without ``--mount-proc``."""
    global _PROC_OWN
    pid = os.getpid()
    if _PROC_OWN is None or _PROC_OWN[0] != pid:
        try:
            with open("/proc/self/stat", encoding="ascii", errors="replace") as f:
                first = f.read().split(None, 1)[0]
            ok = first == str(pid)
        except (OSError, IndexError):
            ok = False
        _PROC_OWN = (pid, ok)
    return _PROC_OWN[1]


def _lock_request(kind: int) -> bytes:
    # l_pid must be 0 for open-file-description locks.
    return _FLOCK.pack(kind, os.SEEK_SET, 0, 1, 0)


def _probe_lock(path: str) -> str:
    """What the liveness file ``path`` says: opened read-only, never through a symbolic link, never
    blocking (a FIFO planted under the name), then ``F_OFD_GETLK``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return _MISSING
    except OSError:
        return _UNREADABLE
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return _UNREADABLE
        # Asked as a read lock: only a write lock conflicts with it, and only the file's owner (or
        # root) can take one, since the file is 0644. A read lock another user takes on the file
        # after its process died must not make that process look alive.
        got = fcntl.fcntl(fd, _F_OFD_GETLK, _lock_request(fcntl.F_RDLCK))
        return _HELD if _FLOCK.unpack(got)[0] == fcntl.F_WRLCK else _FREE_LOCK
    except OSError:
        return _UNREADABLE
    finally:
        os.close(fd)


class _Me:
    """This process's identity and the descriptor holding its liveness lock (-1: none)."""

    lock = threading.Lock()
    identity: Optional[ProcessIdentity] = None
    fd = -1
    owner = 0  # the pid that made the file: only it removes the file at exit
    path: Optional[str] = None
    hooks = False
    keeper_pid = 0  # the pid whose keeper thread runs (threads do not survive fork)
    exiting = False  # set at exit before the file is removed: the keeper makes no file after it


#: Seconds between two looks of the keeper thread (``KEEPER_EVERY`` in identity.rs).
_KEEPER_EVERY = 0.25


def _start_keeper(pid: int) -> None:
    """Starts (once per process) a daemon thread that makes and locks this process's liveness
    file again when someone removed or replaced it, as the keeper thread of identity.rs does.
    Caller holds ``_Me.lock``."""
    if _Me.keeper_pid == pid:
        return
    _Me.keeper_pid = pid

    def keep() -> None:
        while True:
            time.sleep(_KEEPER_EVERY)
            if os.getpid() != pid:
                return
            with _Me.lock:
                me, fd = _Me.identity, _Me.fd
                if _Me.exiting:
                    return
                if me is None or fd < 0:
                    continue
                path = me.liveness_path()
                try:
                    a, b = os.fstat(fd), os.lstat(path)
                    if (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev):
                        continue
                except OSError:
                    pass
                try:
                    _hold_liveness_lock(me)
                except OSError:
                    pass  # the next look tries again

    threading.Thread(target=keep, name="cuda-ipc-liveness", daemon=True).start()


def _current_identity() -> ProcessIdentity:
    pid = os.getpid()
    with _Me.lock:
        me = _Me.identity
        if me is not None and me.pid == pid and _Me.fd >= 0:
            return me
        got = _stat_of("self")
        if got is None:
            raise OSError(errno.ENOENT, "/proc/self/stat has no start time")
        me = ProcessIdentity(pid, got[1], _boot_id(), _own_pid_ns())
        _hold_liveness_lock(me)
        _Me.identity = me
        return me


def _hold_liveness_lock(me: ProcessIdentity) -> None:
    """Creates (or, after an ``exec`` that kept pid and start time, reuses) this process's liveness
    file and takes its lock, as ``hold_liveness_lock`` in identity.rs. Caller holds ``_Me.lock``."""
    path = me.liveness_path()
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        raise OSError(e.errno, f"open {path} (this process's liveness file): {e.strerror}") from None
    try:
        st = os.fstat(fd)
        # Ours and a plain file: another user could have made one under our name.
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(
                errno.EEXIST,
                f"open {path}: the liveness file exists and is not a regular file of uid "
                f"{os.geteuid()} (owner uid {st.st_uid})",
            )
        try:
            # Readable by everyone, so processes of other users can test the lock.
            os.fchmod(fd, 0o644)
        except OSError:
            pass
        try:
            fcntl.fcntl(fd, _F_OFD_SETLK, _lock_request(fcntl.F_WRLCK))
        except OSError as e:
            raise OSError(e.errno, f"fcntl(F_OFD_SETLK) {path}: {e.strerror}") from None
        # The name must still stand for the file we locked (nobody removed it in between).
        now = os.lstat(path)
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            raise OSError(
                errno.ESTALE, f"lstat {path}: the liveness file was replaced while it was being locked"
            )
    except BaseException:
        os.close(fd)
        raise
    old, _Me.fd = _Me.fd, fd  # kept open for the life of the process: it holds the lock
    if old >= 0 and old != fd:
        try:
            os.close(old)
        except OSError:
            pass
    _Me.owner, _Me.path = me.pid, path
    _start_keeper(me.pid)
    if not _Me.hooks:
        _Me.hooks = True
        atexit.register(_remove_liveness_file_at_exit)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_fork_in_child)


def _after_fork_in_child() -> None:
    """In a child made by ``fork()``: close the inherited lock descriptor, so the lock dies with the
    parent, not with the last of its children (the parent's open file description and lock stay).
    The child takes an identity and a liveness file of its own the first time it asks."""
    _Me.lock = threading.Lock()  # another thread of the parent may have held it at the fork
    fd, _Me.fd, _Me.identity, _Me.keeper_pid = _Me.fd, -1, None, 0
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def _remove_liveness_file_at_exit() -> None:
    """At a normal exit, in the process that made it: remove the liveness file (a killed process
    leaves its file with a free lock: it reads as gone, and ``cuda-ipc gc`` removes it)."""
    if os.getpid() != _Me.owner or _Me.path is None:
        return
    with _Me.lock:  # the keeper checks ``exiting`` under the same lock before it makes a file
        _Me.exiting = True
        try:
            os.unlink(_Me.path)
        except OSError:
            pass


_BOOT_ID: Optional[bytes] = None


def _boot_id() -> bytes:
    global _BOOT_ID
    if _BOOT_ID is None:
        path = "/proc/sys/kernel/random/boot_id"
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
        raw = text.replace("-", "")
        try:
            b = bytes.fromhex(raw)
        except ValueError:
            b = b""
        if len(b) != 16:
            raise OSError(errno.EINVAL, f"{path}: not a UUID: {text!r}")
        _BOOT_ID = b
    return _BOOT_ID


# ---------------------------------------------------------------------------------------- tokens

_TOKEN_MAGIC = int.from_bytes(b"CIPT", "little")
_KIND_MEMORY, _KIND_EVENT, _KIND_VMM, _KIND_POOL = 1, 2, 3, 4
_KIND_NAMES = {1: "legacy memory", 2: "legacy event", 3: "VMM memory", 4: "pool memory"}
# magic, version, kind, handle, offset, len, device, pid, fd export id, start time, boot id,
# pid namespace; then the CRC-32 (IEEE) of bytes 0..140 at 140 (token layout version 2).
_TOKEN_HEAD = struct.Struct("<IHH64sQQ16sIIQ16sI")
assert _TOKEN_HEAD.size == 140


class Token(NamedTuple):
    """A decoded 144-byte token (src/token.rs): what was exported, where, and by whom."""

    kind: int
    handle: bytes
    offset: int
    len: int
    device: bytes
    exporter: ProcessIdentity
    export_id: int = 0

    @staticmethod
    def from_bytes(b: bytes) -> "Token":
        """Decodes and validates a token; raises ``InvalidToken`` for a wrong length, magic,
        version (both named), checksum (CRC-32 IEEE of bytes 0..140), kind, an fd export id
        missing from a VMM or pool token (or set on another kind), or an overflowing range."""
        if len(b) != _TOKEN_LEN:
            raise InvalidToken(f"expected {_TOKEN_LEN} bytes, got {len(b)}")
        magic, version, kind, handle, offset, length, device, pid, eid, start, boot, pid_ns = (
            _TOKEN_HEAD.unpack_from(b)
        )
        if magic != _TOKEN_MAGIC:
            raise InvalidToken(f"bad magic {magic:#010x} (not a cuda-ipc token)")
        if version != TOKEN_VERSION:
            newer = " (written by a newer cuda-ipc)" if version > TOKEN_VERSION else ""
            raise InvalidToken(
                f"token layout version {version}, this module reads version {TOKEN_VERSION}{newer}"
            )
        (crc,) = struct.unpack_from("<I", b, _TOKEN_HEAD.size)
        computed = zlib.crc32(b[: _TOKEN_HEAD.size]) & 0xFFFFFFFF
        if crc != computed:
            raise InvalidToken(
                f"checksum mismatch (stored {crc:#010x}, computed {computed:#010x}): corrupted"
            )
        if kind not in _KIND_NAMES:
            raise InvalidToken(f"unknown kind {kind}")
        if (kind in (_KIND_VMM, _KIND_POOL)) != (eid != 0):
            raise InvalidToken(f"fd export id {eid} does not fit a {_KIND_NAMES[kind]} token")
        if offset + length > _U64:
            raise InvalidToken("offset + len overflows")
        exporter = ProcessIdentity(pid, start, boot, pid_ns)
        return Token(kind, handle, offset, length, device, exporter, eid)

    def to_bytes(self) -> bytes:
        """Encodes the token with its checksum."""
        e = self.exporter
        head = _TOKEN_HEAD.pack(
            _TOKEN_MAGIC, TOKEN_VERSION, self.kind, self.handle, self.offset, self.len,
            self.device, e.pid, self.export_id, e.start_time, e.boot_id, e.pid_ns,
        )
        return head + struct.pack("<I", zlib.crc32(head) & 0xFFFFFFFF)


def _uuid_text(u: bytes) -> str:
    h = u.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# ---------------------------------------------------------------------------------------- fd passing

# The client side of the exporter's fd server (src/ipc/fdpass.rs, docs/ARCHITECTURE.md "IPC layer:
# fd passing"): VMM and memory-pool exports travel as POSIX fds over the exporter's Unix socket
# (SOCK_SEQPACKET; its path: _fd_socket_path). Request: ``CIFQ``, version u16, count u16
# (1..=1024), ids u32; reply messages: ``CIFR``, version u16, request status u16, count u32, then
# (id u32, status u32) per id, the ok ones' fds attached in order (SCM_RIGHTS, at most 253 each).
_FD_REQUEST_MAGIC = b"CIFQ"
_FD_REPLY_MAGIC = b"CIFR"
_FD_PROTOCOL_VERSION = 1
_FD_REQUEST_HEADER = struct.Struct("<4sHH")
_FD_REPLY_HEADER = struct.Struct("<4sHHI")
_FD_REPLY_ENTRY = struct.Struct("<II")
_FD_MAX_IDS = 1024
_FD_MAX_PER_MESSAGE = 253
_FD_MAX_REPLY = _FD_REPLY_HEADER.size + _FD_REPLY_ENTRY.size * _FD_MAX_PER_MESSAGE
_FD_REQUEST_OK, _FD_REQUEST_REFUSED, _FD_REQUEST_MALFORMED, _FD_REQUEST_VERSION = 0, 1, 2, 3
_FD_ENTRY_OK = 0
#: Seconds an import waits for the exporter's fd server in all (``FETCH_TIMEOUT`` in ipc/vmm.rs).
FD_FETCH_TIMEOUT = 5.0


def _fd_socket_path(exporter: ProcessIdentity) -> str:
    """The path of ``exporter``'s fd server socket (mode 0600, made by the exporter):
    ``/dev/shm/cuda-ipc.fd.<pid ns>.<pid>.<start time>``, as in src/ipc/fdpass.rs. A file in the
    shared /dev/shm, not an abstract name: containers that share /dev/shm but not a network
    namespace reach it too."""
    return f"/dev/shm/cuda-ipc.fd.{exporter.pid_ns}.{exporter.pid}.{exporter.start_time}"


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symbolic link"),
        (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return kind
    return "special file"


def _exporter_gone(exporter: ProcessIdentity) -> bool:
    # A zombie reads as gone too: it released its liveness lock when its files were closed, and
    # /proc shows it as Z where /proc decides.
    return exporter.liveness() is False


def _close_fds(fds: list) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def fetch_fds(exporter: ProcessIdentity, ids, timeout: float = FD_FETCH_TIMEOUT) -> list:
    """Fetches the fds that ``exporter`` offers under export ``ids`` (``fdpass::FdExport`` ids,
    byte 108 of a VMM or pool token) from its fd server, in one round trip per 1024 ids; returns
    them (ints) in the order of ``ids``. Waits at most ``timeout`` seconds in all.

    The caller owns the fds (close-on-exec): each is a reference of this process's own to the
    exporter's open file, valid after the exporter withdraws it or exits; close them with
    ``os.close`` when done (``cuMemImportFromShareableHandle`` does not take them). All or nothing:
    on an error no fd received is left open. An empty ``ids`` returns ``[]`` without contacting
    the exporter.

    The exporter's socket is the file ``_fd_socket_path(exporter)``; the exporter may run in
    another pid namespace (its identity's ``pid_ns``) if it shares /dev/shm and this user.

    Raises ``ProducerGone`` when the exporter no longer runs (``ProcessIdentity.liveness``: its
    liveness lock free, or, without a liveness file, no such process of its start time, or a
    zombie), checked before connecting and when the connection breaks; ``FdNotOffered`` when it
    runs but does not offer an id (withdrawn or never made; or it serves no fds at all: no socket);
    ``NotSupported`` when it refuses this process (another user) or speaks another protocol
    version, or something else holds its socket name (a FIFO or file, checked with ``lstat``
    before connecting; a socket of another process or user); ``Timeout``; ``FdPassingError`` for
    a malformed reply or a failed system call."""
    ids = [int(i) for i in ids]
    for i in ids:
        if not 0 <= i <= _U32:
            raise ValueError(f"export id {i} is not a u32")
    if not ids:
        return []
    deadline = time.monotonic() + max(0.0, float(timeout))
    if _exporter_gone(exporter):
        raise ProducerGone(exporter.pid)
    out: list = []
    try:
        for at in range(0, len(ids), _FD_MAX_IDS):
            out.extend(_fetch_fds_once(exporter, ids[at : at + _FD_MAX_IDS], deadline, timeout))
    except BaseException:
        _close_fds(out)
        raise
    return out


def _fetch_fds_once(exporter: ProcessIdentity, ids: list, deadline: float, timeout: float) -> list:
    import socket

    not_served = "the process serves no fds (it has exported none)"

    def gone_or(err: BaseException) -> BaseException:
        return ProducerGone(exporter.pid) if _exporter_gone(exporter) else err

    # Where the exporter listens. lstat first: connect() follows symbolic links, and a FIFO or a
    # regular file planted under the name gets a clear error here, never a hang.
    path = _fd_socket_path(exporter)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise gone_or(FdPassingError(f"lstat {path}: {e.strerror}")) from None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise NotSupported(
                f"fd passing: {path} is a {_file_kind(st.st_mode)}, not the fd server socket of "
                f"{exporter.describe()} (something else holds its name; remove it)"
            )
        address, target, file_uid = path, path, st.st_uid
    else:
        raise gone_or(FdNotOffered(exporter.pid, ids[0], not_served))

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"the exporter's fd server ({target}) did not answer within {timeout} s")
        return left

    def malformed(why: str) -> FdPassingError:
        return FdPassingError(f"{target}: malformed fd-server reply: {why}")

    out: list = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        # Connect, bounded: a Unix-socket connect waits for room in the backlog.
        while True:
            sock.settimeout(remaining())
            try:
                sock.connect(address)
                break
            except InterruptedError:
                continue
            except (ConnectionRefusedError, FileNotFoundError):
                # No listener (a killed exporter's socket file), or the file went away.
                raise gone_or(FdNotOffered(exporter.pid, ids[0], not_served)) from None
            except (BlockingIOError, socket.timeout):
                if _exporter_gone(exporter):
                    raise ProducerGone(exporter.pid) from None
                remaining()
                time.sleep(0.001)
            except OSError as e:
                raise gone_or(FdPassingError(f"connect {target}: {e}")) from None

        # Who listens there? The listener's credentials (pid, uid, gid), taken at listen(). A pid
        # means the exporter only when it counts pids in our namespace; across namespaces the
        # listener must be our user (or root) and own the socket file.
        cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        server_pid, server_uid, _gid = struct.unpack("3i", cred)
        euid = os.geteuid()
        if exporter.in_own_pid_namespace():
            if server_pid != exporter.pid:
                raise NotSupported(
                    f"fd passing: the socket {target} of pid {exporter.pid} is held by pid "
                    f"{server_pid} (another process squats on the exporter's socket name; find it "
                    "with `ss -xlp`)"
                )
        elif (server_uid not in (euid, 0) and euid != 0) or file_uid != server_uid:
            raise NotSupported(
                f"fd passing: the socket {target} of {exporter.describe()} is held by uid "
                f"{server_uid} and its file owned by uid {file_uid}; this process runs as uid {euid} "
                "(another user squats on the exporter's socket name, or the producer and the "
                "consumer run as different users)"
            )

        request = _FD_REQUEST_HEADER.pack(
            _FD_REQUEST_MAGIC, _FD_PROTOCOL_VERSION, len(ids)
        ) + struct.pack(f"<{len(ids)}I", *ids)
        while True:
            sock.settimeout(remaining())
            try:
                n = sock.send(request, socket.MSG_NOSIGNAL)
            except InterruptedError:
                continue
            except socket.timeout:
                continue  # remaining() raises Timeout once time is up
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered without reading (a refusal): its reply is queued
            except OSError as e:
                raise gone_or(FdPassingError(f"send to {target}: {e}")) from None
            if n != len(request):
                raise FdPassingError(f"send to {target}: {n} of {len(request)} bytes sent")
            break

        answered = 0
        reset_seen = False
        ancillary = socket.CMSG_SPACE(_FD_MAX_PER_MESSAGE * 4)
        while answered < len(ids):
            sock.settimeout(min(remaining(), _LIVENESS_EVERY * 10))
            try:
                data, anc, flags, _addr = sock.recvmsg(
                    _FD_MAX_REPLY + 1, ancillary, socket.MSG_CMSG_CLOEXEC
                )
            except InterruptedError:
                continue
            except socket.timeout:
                if _exporter_gone(exporter):
                    raise ProducerGone(exporter.pid) from None
                continue
            except ConnectionResetError:
                # A server that refuses closes without reading the request; the kernel reports a
                # reset once before the reply it queued.
                if reset_seen:
                    raise gone_or(FdPassingError(f"recvmsg from {target}: connection reset")) from None
                reset_seen = True
                continue
            except OSError as e:
                raise gone_or(FdPassingError(f"recvmsg from {target}: {e}")) from None
            # Take ownership of whatever fds arrived before anything else, so every exit closes
            # them.
            fds = []
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    whole = len(payload) - len(payload) % 4
                    fds.extend(struct.unpack(f"{whole // 4}i", payload[:whole]))
            out.extend(fds)
            if not data:
                raise gone_or(
                    FdPassingError(
                        f"recvmsg from {target}: the exporter closed the connection before "
                        "answering every id"
                    )
                )
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise malformed("truncated message")
            if len(data) < 6:
                raise malformed(f"a reply of {len(data)} bytes is too short")
            magic, version = struct.unpack_from("<4sH", data)
            if magic != _FD_REPLY_MAGIC:
                raise malformed(f"bad reply magic {magic!r}")
            if version != _FD_PROTOCOL_VERSION:
                status = _FD_REQUEST_VERSION
                entries = []
            else:
                if len(data) < _FD_REPLY_HEADER.size:
                    raise malformed(f"a reply of {len(data)} bytes is too short")
                _m, _v, status, count = _FD_REPLY_HEADER.unpack_from(data)
                need = _FD_REPLY_HEADER.size + _FD_REPLY_ENTRY.size * count
                if count > _FD_MAX_PER_MESSAGE or len(data) != need:
                    raise malformed(f"a reply of {len(data)} bytes claims {count} entries")
                entries = [
                    _FD_REPLY_ENTRY.unpack_from(data, _FD_REPLY_HEADER.size + _FD_REPLY_ENTRY.size * k)
                    for k in range(count)
                ]
            if status == _FD_REQUEST_REFUSED:
                raise NotSupported(
                    f"fd passing: process {exporter.pid} (uid {server_uid}) serves its fds only to "
                    f"its own user and root, and this process runs as uid {os.geteuid()}: run the "
                    "producer and the consumer as the same user"
                )
            if status == _FD_REQUEST_VERSION or (
                status == _FD_REQUEST_OK and version != _FD_PROTOCOL_VERSION
            ):
                raise NotSupported(
                    f"fd passing: the exporter speaks fd-passing protocol version {version}, this "
                    f"module {_FD_PROTOCOL_VERSION}: use matching cuda-ipc versions"
                )
            if status != _FD_REQUEST_OK:
                raise malformed(f"the server answered status {status}")
            expected = ids[answered : answered + len(entries)]
            if not entries or [e[0] for e in entries] != expected:
                raise malformed("the entries do not match the ids asked for")
            for eid, st in entries:
                if st != _FD_ENTRY_OK:
                    raise FdNotOffered(exporter.pid, eid, "withdrawn, or never exported")
            if len(fds) != len(entries):
                raise malformed(f"{len(fds)} fds attached for {len(entries)} ids")
            answered += len(entries)
        return out
    except BaseException:
        _close_fds(out)
        raise
    finally:
        sock.close()


# ---------------------------------------------------------------------------------------- segment

_libc = None


def _libc_mm():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = lib
    return _libc


_PROT_RW = 0x1 | 0x2
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value


def _validate_channel_name(name: str) -> str:
    seg = _SEGMENT_PREFIX + name
    ok = all(c.isascii() and (c.isalnum() or c in "._-") for c in name)
    if not name or not ok or len(seg) > _MAX_SEGMENT_NAME:
        raise ValueError(
            f"bad channel name {name!r}: 1 to {_MAX_SEGMENT_NAME - len(_SEGMENT_PREFIX)} "
            "characters of [A-Za-z0-9._-]"
        )
    return seg


def _is_sparse(fd: int, st: os.stat_result) -> bool:
    """Whether pages of the file are not backed by memory (a ``truncate -s`` file, or a creator that
    died between ``ftruncate`` and ``fallocate``): fewer backed bytes (``st_blocks`` x 512) than its
    4096-byte pages need, with ``SEEK_HOLE`` (where supported) finding a hole before the end.

    ``SEEK_HOLE`` alone is not enough: recent kernels report the fallocated but never written
    pages of a tmpfs file (every channel segment, as created) as holes, though they are backed and
    cannot raise SIGBUS; ``st_blocks`` counts them."""
    if st.st_size == 0:
        return False
    if st.st_blocks * 512 >= -(-st.st_size // 4096) * 4096:
        return False
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE) < st.st_size
    except (OSError, AttributeError):
        return True


class _Control:
    """The mapped control segment and the consumer side of the protocol (src/channel/control.rs).

    Every word another process writes is read and written through libatomic with the ordering the
    Rust code uses; each ordering names what it pairs with, as in control.rs."""

    def __init__(self, channel: str):
        self.a = _Atomics.get()
        self.futex = _Futex.get()
        seg = _validate_channel_name(channel)
        self.name = seg
        self.channel = channel
        path = "/dev/shm/" + seg
        self.path = path
        try:
            # O_NOFOLLOW, as shm_open: a symbolic link planted in /dev/shm is never followed.
            # O_NONBLOCK: a FIFO planted under the name never blocks the open.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ChannelNotFound(f"no channel named {channel!r} (start its producer first)") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise BadSegment(f"{path} is a symbolic link; a segment is never opened through one") from None
            if e.errno in (errno.EISDIR, errno.ENXIO):  # ENXIO: a socket cannot be opened
                kind = "directory" if e.errno == errno.EISDIR else "socket"
                raise BadSegment(f"{path} is a {kind}, not a shared-memory segment") from None
            raise BadSegment(f"{path} cannot be opened: {e.strerror}") from None
        self.addr = 0
        self.len = 0
        try:
            # Checked before anything is mapped or read (Segment::open_with_min_len).
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadSegment(
                    f"{path} is a {_file_kind(st.st_mode)}, not a shared-memory segment"
                )
            if st.st_uid != os.geteuid():
                raise BadSegment(
                    f"{seg} belongs to uid {st.st_uid}, not to this process's uid {os.geteuid()}"
                )
            if st.st_size < _HEADER_BYTES:
                raise BadSegment(
                    f"{seg} holds {st.st_size} bytes, less than a {_HEADER_BYTES}-byte header: "
                    "truncated or not a channel"
                )
            # Never map a sparse file: touching a hole in a full /dev/shm raises SIGBUS.
            if _is_sparse(fd, st):
                raise BadSegment(
                    f"{seg} is sparse: {st.st_blocks * 512} of its {st.st_size} bytes are backed "
                    "by memory; it was not fully created"
                )
            libc = _libc_mm()
            addr = libc.mmap(None, st.st_size, _PROT_RW, _MAP_SHARED, fd, 0)
            if addr is None or addr == _MAP_FAILED:
                e = ctypes.get_errno()
                raise OSError(e, f"mmap {path}: {os.strerror(e)}")
            self.addr, self.len = addr, st.st_size
            # What the name stood for when mapped, for check_superseded.
            self.inode = (st.st_dev, st.st_ino)
        finally:
            os.close(fd)  # the mapping stays valid without the descriptor
        try:
            self._validate(seg)
        except BaseException:
            self.unmap()
            raise

    def check_superseded(self) -> None:
        """Raises ``Superseded`` when the channel's name now stands for another segment than the
        one mapped (removed and made again): one ``lstat``, for the slow path of a wait only. A
        name that is gone (nothing replaced it) or cannot be looked at is not superseded."""
        try:
            now = os.lstat(self.path)
        except OSError:
            return
        if (now.st_dev, now.st_ino) != self.inode:
            raise Superseded(self.channel)

    def _validate(self, seg: str) -> None:
        a, base = self.a, self.addr
        deadline = time.monotonic() + _STAMP_WAIT
        # Acquire: pairs with the Release store of the stamp in Control::create.
        while a.load32(base + _H_STAMP, _ACQUIRE) != _STAMP_READY:
            # A segment being created reads zero until its creator stores the magic (one atomic
            # store): any other value is a foreign segment, refused without waiting.
            magic = a.load64(base + _H_MAGIC, _RELAXED)
            if magic not in (0, _MAGIC):
                raise BadSegment(f"{seg} is not a cuda-ipc channel (magic {magic:#018x})")
            if time.monotonic() > deadline:
                raise BadSegment(f"{seg} was never finished by its creator (no init stamp after 2 s)")
            time.sleep(0.001)
        magic = a.load64(base + _H_MAGIC, _RELAXED)
        if magic != _MAGIC:
            raise BadSegment(f"{seg} is not a cuda-ipc channel (magic {magic:#018x})")
        v = a.load32(base + _H_VERSION, _RELAXED)
        if v != LAYOUT_VERSION:
            raise BadSegment(
                f"{seg} has channel layout version {v}; this module reads version {LAYOUT_VERSION} "
                f"(a producer of another cuda-ipc version: stop it, or remove /dev/shm/{seg} if it "
                "is gone)"
            )
        self.buffers = a.load32(base + _H_BUFFERS, _RELAXED)
        self.consumers = a.load32(base + _H_CONSUMERS, _RELAXED)
        if not (1 <= self.buffers <= _MAX_BUFFERS and 1 <= self.consumers <= _MAX_CONSUMERS):
            raise BadSegment(
                f"{seg} claims {self.buffers} buffers and {self.consumers} consumers: corrupted"
            )
        need = _layout_len(self.buffers, self.consumers)
        if self.len < need or a.load64(base + _H_SEGMENT_BYTES, _RELAXED) != need:
            raise BadSegment(
                f"{seg} holds {self.len} bytes but its header needs {need}: truncated or corrupted"
            )
        self.buffer_bytes = a.load64(base + _H_BUFFER_BYTES, _RELAXED)
        # Page aligned: mmap returns a page-aligned address and the offset is a multiple of 4096.
        self.ready = base + _ready_offset(self.buffers, self.consumers)

    def unmap(self) -> None:
        if self.addr:
            _libc_mm().munmap(self.addr, self.len)
            self.addr = 0

    # -- addresses
    def _b(self, i: int) -> int:
        return self.addr + _HEADER_BYTES + i * _BUFFER_SLOT_BYTES

    def _c(self, c: int) -> int:
        return (
            self.addr + _HEADER_BYTES + self.buffers * _BUFFER_SLOT_BYTES + c * _CONSUMER_SLOT_BYTES
        )

    # -- reads
    def buffer_tokens(self, i: int) -> tuple:
        """(memory token, producer event token) bytes of buffer ``i``; immutable after the stamp,
        which ``_validate`` Acquire-loaded."""
        t = self._b(i) + _B_TOKENS
        return ctypes.string_at(t, _TOKEN_LEN), ctypes.string_at(t + _TOKEN_LEN, _TOKEN_LEN)

    def producer(self) -> ProcessIdentity:
        a, h = self.a, self.addr
        boot = struct.pack(
            "<QQ", a.load64(h + _H_PRODUCER_BOOT, _RELAXED), a.load64(h + _H_PRODUCER_BOOT + 8, _RELAXED)
        )
        return ProcessIdentity(
            a.load32(h + _H_PRODUCER_PID, _RELAXED),
            a.load64(h + _H_PRODUCER_START, _RELAXED),
            boot,
            a.load32(h + _H_PRODUCER_PID_NS, _RELAXED),
        )

    def head(self) -> int:
        # Acquire: pairs with the Release store of head in publish.
        return self.a.load64(self.addr + _H_HEAD, _ACQUIRE)

    def is_closed(self) -> bool:
        # Acquire: pairs with the Release store in close.
        return self.a.load32(self.addr + _H_PRODUCER_STATE, _ACQUIRE) == _CLOSED

    def producer_gone(self) -> None:
        p = self.producer()
        if p.liveness() is False:
            raise ProducerGone(p.pid, p.describe())

    # -- ready page
    def ready_page(self) -> tuple:
        """(address in this mapping, length in bytes) of the ready page, page aligned."""
        return self.ready, _READY_PAGE

    def _ready_word(self, i: int) -> int:
        if not 0 <= i < self.buffers:
            raise IndexError(f"buffer {i} of {self.buffers}")
        return self.ready + 4 * i

    def ready_value(self, i: int) -> int:
        """Buffer ``i``'s ready word as it is now."""
        # Acquire: pairs with force_ready's CAS in other consumers (the producer's GPU write is
        # not a CPU atomic; it shows up eventually).
        return self.a.load32(self._ready_word(i), _ACQUIRE)

    def force_ready(self) -> int:
        """As Control::force_ready: marks every published frame ready, as if its producer's write
        had finished, so that streams waiting for a write that will never finish (the producer
        died) drain. Raises a word to the low 32 bits of its buffer's ``seq`` only when that is
        ahead in wrap-around order: never lowers what a live producer set. Buffers empty (seq 0)
        or being written (WRITING) are left alone. Returns the words raised."""
        a = self.a
        raised = 0
        for i in range(self.buffers):
            # Acquire: pairs with the Release store of seq in publish, which the producer makes
            # after enqueuing the ready word's write.
            seq = a.load64(self._b(i) + _B_SEQ, _ACQUIRE)
            if seq == 0 or seq == _WRITING:
                continue
            want = seq & _U32
            w = self._ready_word(i)
            cur = a.load32(w, _RELAXED)
            while _seq_ahead(want, cur):
                # AcqRel: other consumers of a dead producer raise the same words; a failed CAS
                # re-reads the word and re-checks the order.
                ok, cur = a.compare_exchange32(w, cur, want, _ACQ_REL, _RELAXED)
                if ok:
                    raised += 1
                    break
        return raised

    def _bump(self, off: int) -> None:
        # Release: pairs with the Acquire load of the word before a futex wait.
        self.a.fetch_add32(self.addr + off, 1, _RELEASE)
        self.futex.wake(self.addr + off)

    def wait_until(
        self,
        off: int,
        spin_s: float,
        timeout: Optional[float],
        ready: Callable[[], Optional[_T]],
        gone: Callable[[], None],
    ) -> Optional[_T]:
        """As Control::wait_until: re-checks ``ready`` after each futex wake-up, calls ``gone``
        every 20 ms, returns None at the timeout (seconds; None waits forever)."""
        word = self.addr + off
        start = last_check = time.monotonic()
        while True:
            # Acquire: pairs with the Release bump; read before the condition, so a change made
            # after the check shows as a changed word to FUTEX_WAIT.
            seen = self.a.load32(word, _ACQUIRE)
            v = ready()
            if v is not None:
                return v
            now = time.monotonic()
            waited = now - start
            if timeout is not None and waited >= timeout:
                return None
            if now - last_check >= _LIVENESS_EVERY:
                gone()
                last_check = now
            if waited < spin_s:
                continue
            slice_s = _LIVENESS_EVERY
            if timeout is not None:
                slice_s = min(slice_s, timeout - waited)
            self.futex.wait(word, seen, slice_s)

    # -- consumer slots
    def reclaim_dead_consumers(self) -> int:
        """Frees the slots (and holds) of consumers whose process died; returns holds forced."""
        a = self.a
        forced = 0
        for c in range(self.consumers):
            s = self._c(c)
            st = a.load32(s + _C_STATE, _ACQUIRE)
            if st == _FREE:
                continue
            boot = struct.pack(
                "<QQ", a.load64(s + _C_BOOT, _RELAXED), a.load64(s + _C_BOOT + 8, _RELAXED)
            )
            ident = ProcessIdentity(
                a.load32(s + _C_PID, _RELAXED),
                a.load64(s + _C_START, _RELAXED),
                boot,
                a.load32(s + _C_PID_NS, _RELAXED),
            )
            if ident.liveness() is not False:
                continue
            forced += self.free_consumer_slot(c, st)
        if forced:
            a.fetch_add64(self.addr + _H_FORCED, forced, _RELAXED)
        return forced

    def free_consumer_slot(self, c: int, expected_state: int) -> int:
        a = self.a
        bit = 1 << c
        forced = 0
        for i in range(self.buffers):
            b = self._b(i)
            # AcqRel: pairs with the consumer's hold/release on the same word.
            if a.fetch_and64(b + _B_HOLD, ~bit & _U64, _ACQ_REL) & bit:
                forced += 1
            a.fetch_and64(b + _B_USED, ~bit & _U64, _ACQ_REL)
        # Release (AcqRel): pairs with attach's CAS when the slot is claimed again.
        a.cas32(self._c(c) + _C_STATE, expected_state, _FREE, _ACQ_REL, _RELAXED)
        self._bump(_H_RELEASE_FUTEX)
        return forced

    def attach(self, policy: int, release_tokens: list, me: ProcessIdentity) -> int:
        """Claims a consumer slot; ``release_tokens[i]`` is this consumer's event token for buffer
        ``i``. Starts at the current head."""
        if len(release_tokens) != self.buffers:
            raise ValueError(f"{len(release_tokens)} release tokens for {self.buffers} buffers")
        self.reclaim_dead_consumers()
        a = self.a
        boot0, boot1 = struct.unpack("<QQ", me.boot_id)
        for c in range(self.consumers):
            s = self._c(c)
            # Acquire on success: pairs with the Release that freed the slot.
            if not a.cas32(s + _C_STATE, _FREE, _CLAIMING, _ACQUIRE, _RELAXED):
                continue
            a.fetch_add64(s + _C_GENERATION, 1, _RELAXED)
            a.store32(s + _C_PID, me.pid, _RELAXED)
            a.store64(s + _C_START, me.start_time, _RELAXED)
            a.store64(s + _C_BOOT, boot0, _RELAXED)
            a.store64(s + _C_BOOT + 8, boot1, _RELAXED)
            a.store32(s + _C_PID_NS, me.pid_ns, _RELAXED)
            a.store32(s + _C_POLICY, policy, _RELAXED)
            a.store64(s + _C_RECEIVED, 0, _RELAXED)
            a.store64(s + _C_DROPPED, 0, _RELAXED)
            for i, t in enumerate(release_tokens):
                # This process owns the slot (CLAIMING); the producer reads the tokens only when
                # ACTIVE, with a generation re-check.
                ctypes.memmove(s + _C_TOKENS + i * _TOKEN_LEN, t, _TOKEN_LEN)
            a.store64(s + _C_CURSOR, self.head(), _RELAXED)
            # Release: pairs with the producer's Acquire of state; all of the above is visible.
            a.store32(s + _C_STATE, _ACTIVE, _RELEASE)
            return c
        raise NoConsumerSlot(f"all {self.consumers} consumer slots of the channel are taken")

    def try_take(self, c: int) -> Optional[tuple]:
        """The next frame for consumer ``c`` by its policy, held: (index, seq, metadata) or None."""
        a = self.a
        s = self._c(c)
        if a.load32(s + _C_STATE, _ACQUIRE) != _ACTIVE:
            raise Detached("this consumer was detached from the channel")
        latest = a.load32(s + _C_POLICY, _RELAXED) == _LATEST
        bit = 1 << c
        while True:
            head = self.head()
            cursor = a.load64(s + _C_CURSOR, _RELAXED)
            if head <= cursor:
                return None
            want = head if latest else cursor + 1
            found = None
            oldest = None
            for i in range(self.buffers):
                # Acquire: pairs with the Release store of seq in publish (metadata visible).
                seq = a.load64(self._b(i) + _B_SEQ, _ACQUIRE)
                if seq == want:
                    found = i
                if seq != _WRITING and seq > cursor and (oldest is None or seq < oldest[0]):
                    oldest = (seq, i)
            if found is not None:
                seq, i = want, found
            elif oldest is not None and not latest:
                seq, i = oldest
            else:
                return None
            b = self._b(i)
            # SeqCst: the consumer half of the Dekker pair with the producer's try_acquire.
            a.fetch_or64(b + _B_HOLD, bit, _SEQ_CST)
            if a.load64(b + _B_SEQ, _SEQ_CST) != seq:
                # The producer took it meanwhile: undo and look again.
                a.fetch_and64(b + _B_HOLD, ~bit & _U64, _SEQ_CST)
                self._bump(_H_RELEASE_FUTEX)
                continue
            # AcqRel: pairs with the producer's swap of used_mask in try_acquire / take_used.
            a.fetch_or64(b + _B_USED, bit, _ACQ_REL)
            n = min(a.load32(b + _B_META_LEN, _RELAXED), META_BYTES)
            words = [a.load64(b + _B_META + 8 * k, _RELAXED) for k in range((n + 7) // 8)]
            meta = struct.pack(f"<{len(words)}Q", *words)[:n]
            a.fetch_add64(s + _C_DROPPED, seq - cursor - 1, _RELAXED)
            a.fetch_add64(s + _C_RECEIVED, 1, _RELAXED)
            # Release: pairs with the producer's Acquire of cursors in min_lossless_cursor.
            a.store64(s + _C_CURSOR, seq, _RELEASE)
            self._bump(_H_RELEASE_FUTEX)
            return i, seq, meta

    def take_or_closed(self, c: int) -> Optional[tuple]:
        """As Control::take_or_closed: ``try_take``, or ``ChannelClosed`` when nothing is left and
        the producer closed. Seeing the channel closed after an empty ``try_take`` is not enough
        (the producer may have published and closed in between); seeing ``closed`` (Acquire, after
        the last publish) makes every publish visible, so one more look is conclusive."""
        got = self.try_take(c)
        if got is not None or not self.is_closed():
            return got
        got = self.try_take(c)
        if got is None:
            raise ChannelClosed("the producer closed the channel and every frame was received")
        return got

    def take(self, c: int, spin_s: float, timeout: Optional[float]) -> Optional[tuple]:
        next_look = [time.monotonic() + _SUPERSEDED_EVERY]

        def gone() -> None:
            # Every 20 ms the producer's liveness; every 500 ms whether the name was superseded.
            self.producer_gone()
            now = time.monotonic()
            if now >= next_look[0]:
                next_look[0] = now + _SUPERSEDED_EVERY
                self.check_superseded()

        return self.wait_until(
            _H_PUBLISH_FUTEX, spin_s, timeout, lambda: self.take_or_closed(c), gone
        )

    def release(self, c: int, i: int) -> None:
        # SeqCst: after the release event was recorded; pairs with the producer's SeqCst read of
        # hold_mask in try_acquire.
        self.a.fetch_and64(self._b(i) + _B_HOLD, ~(1 << c) & _U64, _SEQ_CST)
        self._bump(_H_RELEASE_FUTEX)

    def detach(self, c: int) -> None:
        self.free_consumer_slot(c, _ACTIVE)

    def stats(self) -> dict:
        """Counters of the channel, as ChannelStats (a dict)."""
        a, h = self.a, self.addr
        head = self.head()
        consumers = []
        for c in range(self.consumers):
            s = self._c(c)
            if a.load32(s + _C_STATE, _ACQUIRE) != _ACTIVE:
                continue
            bit = 1 << c
            consumers.append(
                {
                    "index": c,
                    "pid": a.load32(s + _C_PID, _RELAXED),
                    "received": a.load64(s + _C_RECEIVED, _RELAXED),
                    "dropped": a.load64(s + _C_DROPPED, _RELAXED),
                    "in_flight": sum(
                        1
                        for i in range(self.buffers)
                        if a.load64(self._b(i) + _B_HOLD, _RELAXED) & bit
                    ),
                    "lag": max(0, head - a.load64(s + _C_CURSOR, _RELAXED)),
                }
            )
        return {
            "published": a.load64(h + _H_PUBLISHED, _RELAXED),
            "head": head,
            "forced_releases": a.load64(h + _H_FORCED, _RELAXED),
            "consumers": consumers,
        }


# ---------------------------------------------------------------------------------------- CUDA


class _IpcHandle(ctypes.Structure):
    # CUipcMemHandle / CUipcEventHandle: 64 opaque bytes, passed by value.
    _fields_ = [("reserved", ctypes.c_char * 64)]

    @staticmethod
    def of(b: bytes) -> "_IpcHandle":
        h = _IpcHandle()
        ctypes.memmove(ctypes.addressof(h), b, 64)
        return h


class _CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * 16)]


class _CUmemLocation(ctypes.Structure):
    # CUmemLocation (CUDA 12 and 13): CUmemLocationType type; int id (a union of int-sized
    # members from CUDA 13.2 on; the same 8 bytes).
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemAccessDesc(ctypes.Structure):
    # CUmemAccessDesc: CUmemLocation location; CUmemAccess_flags flags.
    _fields_ = [("location", _CUmemLocation), ("flags", ctypes.c_int)]


class _CUmemPoolPtrExportData(ctypes.Structure):
    # CUmemPoolPtrExportData: 64 opaque bytes (cuMemPoolExportPointer's output).
    _fields_ = [("reserved", ctypes.c_char * 64)]

    @staticmethod
    def of(b: bytes) -> "_CUmemPoolPtrExportData":
        d = _CUmemPoolPtrExportData()
        ctypes.memmove(ctypes.addressof(d), b, 64)
        return d


_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CU_EVENT_DISABLE_TIMING = 2
_CU_EVENT_INTERPROCESS = 4
_CU_STREAM_NON_BLOCKING = 1
_CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED = 125
_CU_MEMHOSTREGISTER_PORTABLE = 1
_CU_MEMHOSTREGISTER_DEVICEMAP = 2
_CU_STREAM_WAIT_VALUE_GEQ = 0
_CUDA_ERROR_NOT_READY = 600
_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class _Driver:
    """The CUDA driver API through ctypes (``libcuda.so.1``), initialised once per process."""

    _instance: Optional["_Driver"] = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> "_Driver":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        lib = None
        errors = []
        for name in ("libcuda.so.1", "libcuda.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError as e:
                errors.append(f"{name}: {e}")
        if lib is None:
            raise CudaUnavailable(
                "CUDA driver not found (" + "; ".join(errors) + "): install the NVIDIA driver, or "
                "attach with cuda=False for the protocol only"
            )
        self.lib = lib
        P, c_int, c_uint, vp, u64 = (
            ctypes.POINTER, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint64,
        )

        def f(name, *args, fallback=None, optional=False):
            try:
                fn = getattr(lib, name)
            except AttributeError:
                if optional:
                    return None
                if fallback is None:
                    raise CudaUnavailable(f"the CUDA driver lacks {name} (too old?)") from None
                fn = getattr(lib, fallback)
            fn.restype = c_int
            fn.argtypes = list(args)
            return fn

        self.cuGetErrorName = f("cuGetErrorName", c_int, P(ctypes.c_char_p))
        self.cuGetErrorString = f("cuGetErrorString", c_int, P(ctypes.c_char_p))
        self.cuInit = f("cuInit", c_uint)
        self.cuDriverGetVersion = f("cuDriverGetVersion", P(c_int))
        self.cuDeviceGetCount = f("cuDeviceGetCount", P(c_int))
        self.cuDeviceGet = f("cuDeviceGet", P(c_int), c_int)
        self.cuDeviceGetUuid = f("cuDeviceGetUuid_v2", P(_CUuuid), c_int, fallback="cuDeviceGetUuid")
        self.cuDeviceGetAttribute = f("cuDeviceGetAttribute", P(c_int), c_int, c_int)
        self.cuDevicePrimaryCtxRetain = f("cuDevicePrimaryCtxRetain", P(vp), c_int)
        self.cuDevicePrimaryCtxRelease = f("cuDevicePrimaryCtxRelease_v2", c_int)
        self.cuCtxPushCurrent = f("cuCtxPushCurrent_v2", vp)
        self.cuCtxPopCurrent = f("cuCtxPopCurrent_v2", P(vp))
        self.cuIpcOpenMemHandle = f("cuIpcOpenMemHandle_v2", P(u64), _IpcHandle, c_uint)
        self.cuIpcCloseMemHandle = f("cuIpcCloseMemHandle", u64)
        self.cuMemGetAddressRange = f("cuMemGetAddressRange_v2", P(u64), P(ctypes.c_size_t), u64)
        self.cuIpcGetEventHandle = f("cuIpcGetEventHandle", P(_IpcHandle), vp)
        self.cuEventCreate = f("cuEventCreate", P(vp), c_uint)
        self.cuEventDestroy = f("cuEventDestroy_v2", vp)
        self.cuEventRecord = f("cuEventRecord", vp, vp)
        self.cuEventQuery = f("cuEventQuery", vp)
        self.cuMemHostRegister = f("cuMemHostRegister_v2", vp, ctypes.c_size_t, c_uint)
        self.cuMemHostGetDevicePointer = f("cuMemHostGetDevicePointer_v2", P(u64), vp, c_uint)
        self.cuMemHostUnregister = f("cuMemHostUnregister", vp)
        self.cuStreamWaitValue32 = f("cuStreamWaitValue32_v2", vp, u64, ctypes.c_uint32, c_uint)
        self.cuStreamCreate = f("cuStreamCreate", P(vp), c_uint)
        self.cuStreamDestroy = f("cuStreamDestroy_v2", vp)
        self.cuStreamSynchronize = f("cuStreamSynchronize", vp)
        # VMM and memory-pool imports (CUDA 11.2+); looked up here, required only when a channel
        # uses them (``require``).
        sz, ull = ctypes.c_size_t, ctypes.c_ulonglong
        acc = P(_CUmemAccessDesc)
        for name, args in (
            ("cuMemImportFromShareableHandle", (P(u64), vp, c_int)),
            ("cuMemAddressReserve", (P(u64), sz, sz, u64, ull)),
            ("cuMemMap", (u64, sz, sz, u64, ull)),
            ("cuMemSetAccess", (u64, sz, acc, sz)),
            ("cuMemUnmap", (u64, sz)),
            ("cuMemAddressFree", (u64, sz)),
            ("cuMemRelease", (u64,)),
            ("cuMemPoolImportFromShareableHandle", (P(vp), vp, c_int, ull)),
            ("cuMemPoolSetAccess", (vp, acc, sz)),
            ("cuMemPoolImportPointer", (P(u64), vp, P(_CUmemPoolPtrExportData))),
            ("cuMemPoolDestroy", (vp,)),
        ):
            setattr(self, name, f(name, *args, optional=True))
        self.cuMemFree = f("cuMemFree_v2", u64, optional=True)
        self.check("cuInit", self.cuInit(0))
        # (context, handle bytes) -> [base, size, references]: one mapping per allocation and
        # context, as the Rust import cache (a second cuIpcOpenMemHandle of one handle fails).
        self.mappings: dict = {}
        self.mappings_lock = threading.Lock()

    def require(self, what: str, *names: str) -> None:
        """Raises ``CudaUnavailable`` when the driver lacks one of the entry points ``names``."""
        missing = [n for n in names if getattr(self, n, None) is None]
        if missing:
            raise CudaUnavailable(
                f"{what} needs {', '.join(missing)}, which this CUDA driver lacks (too old?)"
            )

    def check(self, call: str, rc: int) -> None:
        if rc == 0:
            return
        name = ctypes.c_char_p()
        text = ctypes.c_char_p()
        n = name.value.decode() if self.cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value else f"CUresult {rc}"
        t = text.value.decode() if self.cuGetErrorString(rc, ctypes.byref(text)) == 0 and text.value else "unknown error"
        raise CudaError(call, rc, n, t)

    def device_by_uuid(self, uuid: bytes) -> int:
        """Ordinal of the visible device with this UUID (``cuDeviceGetUuid_v2``)."""
        n = ctypes.c_int()
        self.check("cuDeviceGetCount", self.cuDeviceGetCount(ctypes.byref(n)))
        seen = []
        for k in range(n.value):
            d = ctypes.c_int()
            self.check("cuDeviceGet", self.cuDeviceGet(ctypes.byref(d), k))
            u = _CUuuid()
            self.check("cuDeviceGetUuid_v2", self.cuDeviceGetUuid(ctypes.byref(u), d.value))
            raw = ctypes.string_at(ctypes.addressof(u), 16)
            if raw == uuid:
                return d.value
            seen.append(_uuid_text(raw))
        raise CudaUnavailable(
            f"the channel's pool is on {_uuid_text(uuid)}, which this process cannot see "
            f"(visible: {', '.join(seen) or 'none'}; check CUDA_VISIBLE_DEVICES)"
        )

    def open_mapping(self, ctx: int, handle: bytes) -> tuple:
        with self.mappings_lock:
            m = self.mappings.get((ctx, handle))
            if m is not None:
                m[2] += 1
                return m[0], m[1]
            base = ctypes.c_uint64()
            self.check(
                "cuIpcOpenMemHandle_v2",
                self.cuIpcOpenMemHandle(
                    ctypes.byref(base), _IpcHandle.of(handle), _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
                ),
            )
            start, size = ctypes.c_uint64(), ctypes.c_size_t()
            rc = self.cuMemGetAddressRange(ctypes.byref(start), ctypes.byref(size), base.value)
            if rc != 0:
                self.cuIpcCloseMemHandle(base.value)
                self.check("cuMemGetAddressRange_v2", rc)
            self.mappings[(ctx, handle)] = [base.value, size.value, 1]
            return base.value, size.value

    def close_mapping(self, ctx: int, handle: bytes) -> None:
        with self.mappings_lock:
            m = self.mappings.get((ctx, handle))
            if m is None:
                return
            m[2] -= 1
            if m[2] == 0:
                del self.mappings[(ctx, handle)]
                self.check("cuIpcCloseMemHandle", self.cuIpcCloseMemHandle(m[0]))


class _Bound:
    """Makes a context current on this thread for a block (``cuCtxPushCurrent_v2`` /
    ``cuCtxPopCurrent_v2``), leaving the thread's context as it was: PyTorch's and CuPy's current
    device are not changed."""

    __slots__ = ("d", "ctx")

    def __init__(self, d: _Driver, ctx: int):
        self.d, self.ctx = d, ctx

    def __enter__(self):
        self.d.check("cuCtxPushCurrent_v2", self.d.cuCtxPushCurrent(self.ctx))

    def __exit__(self, *exc):
        out = ctypes.c_void_p()
        self.d.cuCtxPopCurrent(ctypes.byref(out))
        return False


class _Gpu:
    """The GPU side of one consumer: the pool imported, the control segment's ready page
    registered, this consumer's release events created and exported, in the primary context of
    the pool's device."""

    #: Streams remembered (with an event recorded after their last ready wait) before completed
    #: ones are forgotten.
    _WAITED_STREAMS = 16

    def __init__(self, control: _Control, me: ProcessIdentity):
        self.d = d = _Driver.get()
        self.control = control
        self.ctx = None
        self.mapped = []  # handle bytes of each legacy import, for close
        self.vmm = []  # (address, size, allocation handle) of each VMM import, for close
        self.vmm_by_export: dict = {}  # (exporter, export id) -> (address, size)
        self.pool_ptrs = []  # each pointer imported from a pool, for close
        self.pools: dict = {}  # (exporter, export id) -> imported CUmemoryPool, for close
        self.buffers = []  # device pointer of each buffer
        self.release_events = []
        self.recorded = set()  # buffer indices whose release event was recorded
        # stream -> event recorded after the last ready wait enqueued there: close waits for them
        # before unregistering the ready page (the stream may be another library's, or gone).
        self.waited: dict = {}
        self.ready_host = None  # the registered ready page (host address), once registered
        self.ready_dev = 0  # its device address (cuMemHostGetDevicePointer_v2)
        self.own_stream = None
        self.uuid = _buffer_tokens(control, 0)[0].device
        self.ordinal = d.device_by_uuid(self.uuid)
        v = ctypes.c_int()
        d.check(
            "cuDeviceGetAttribute",
            d.cuDeviceGetAttribute(
                ctypes.byref(v), _CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED, self.ordinal
            ),
        )
        if not v.value:
            raise NotSupported(f"device {_uuid_text(self.uuid)} has no IPC events")
        ctx = ctypes.c_void_p()
        d.check("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.ordinal))
        self.ctx = ctx.value
        self.release_tokens = []
        fds: dict = {}
        try:
            # Streams wait on the ready words, not on a producer event.
            mems = [_buffer_tokens(control, i)[0] for i in range(control.buffers)]
            # The fds of VMM allocations and pools, in one request per exporter.
            fds = _fetch_token_fds(mems)
            with self.bound():
                for i, mem in enumerate(mems):
                    if mem.kind == _KIND_VMM:
                        base, size = self._import_vmm(i, mem, fds)
                    elif mem.kind == _KIND_POOL:
                        base, size = self._import_pool(i, mem, fds)
                    else:
                        base, size = d.open_mapping(self.ctx, mem.handle)
                        self.mapped.append(mem.handle)
                    if mem.offset + mem.len > size:
                        raise InvalidToken(
                            f"buffer {i}: range {mem.offset}+{mem.len} lies outside the "
                            f"{size}-byte allocation the handle names"
                        )
                    if mem.len != control.buffer_bytes:
                        raise BadSegment(
                            f"buffer {i} holds {mem.len} bytes, the header says {control.buffer_bytes}"
                        )
                    self.buffers.append(base + mem.offset)
                    re = ctypes.c_void_p()
                    d.check(
                        "cuEventCreate",
                        d.cuEventCreate(
                            ctypes.byref(re), _CU_EVENT_INTERPROCESS | _CU_EVENT_DISABLE_TIMING
                        ),
                    )
                    self.release_events.append(re.value)
                    h = _IpcHandle()
                    d.check("cuIpcGetEventHandle", d.cuIpcGetEventHandle(ctypes.byref(h), re.value))
                    handle = ctypes.string_at(ctypes.addressof(h), 64)
                    self.release_tokens.append(
                        Token(_KIND_EVENT, handle, 0, 0, self.uuid, me).to_bytes()
                    )
                # The ready page lies in the control segment's mapping, which stays mapped until
                # close() has unregistered it (Consumer.close unmaps last).
                page, length = control.ready_page()
                d.check(
                    "cuMemHostRegister_v2",
                    d.cuMemHostRegister(
                        page, length, _CU_MEMHOSTREGISTER_PORTABLE | _CU_MEMHOSTREGISTER_DEVICEMAP
                    ),
                )
                self.ready_host = page
                dptr = ctypes.c_uint64()
                d.check(
                    "cuMemHostGetDevicePointer_v2",
                    d.cuMemHostGetDevicePointer(ctypes.byref(dptr), page, 0),
                )
                self.ready_dev = dptr.value
        except BaseException:
            self.close()
            raise
        finally:
            _close_fds(list(fds.values()))  # those not used (each import closes its own)

    def _import_vmm(self, i: int, mem: "Token", fds: dict) -> tuple:
        """Maps the VMM allocation ``mem`` names (once per allocation), as ipc/vmm.rs does:
        ``cuMemImportFromShareableHandle`` of its fd (closed right after, on success and on
        failure), ``cuMemAddressReserve``, ``cuMemMap``, ``cuMemSetAccess`` (read/write for this
        device). Returns (address, size in bytes). Context bound by the caller."""
        d = self.d
        key = (mem.exporter, mem.export_id)
        got = self.vmm_by_export.get(key)
        if got is not None:
            return got
        d.require(
            "importing VMM memory", "cuMemImportFromShareableHandle", "cuMemAddressReserve",
            "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease",
        )
        size = struct.unpack_from("<Q", mem.handle, 8)[0]
        if size == 0 or size > _U64 >> 1:
            raise InvalidToken(f"buffer {i}: VMM allocation size {size}")
        fd = fds.pop(key)
        h = ctypes.c_uint64()
        try:
            rc = d.cuMemImportFromShareableHandle(
                ctypes.byref(h), ctypes.c_void_p(fd), _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            )
        finally:
            os.close(fd)  # the driver does not take ownership of a POSIX fd handle
        d.check("cuMemImportFromShareableHandle", rc)
        ptr = ctypes.c_uint64()
        rc = d.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0)
        if rc:
            d.cuMemRelease(h.value)
            d.check("cuMemAddressReserve", rc)
        rc = d.cuMemMap(ptr.value, size, 0, h.value, 0)
        if rc:
            d.cuMemAddressFree(ptr.value, size)
            d.cuMemRelease(h.value)
            d.check("cuMemMap", rc)
        desc = _CUmemAccessDesc(
            _CUmemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal),
            _CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        )
        rc = d.cuMemSetAccess(ptr.value, size, ctypes.byref(desc), 1)
        if rc:
            d.cuMemUnmap(ptr.value, size)
            d.cuMemAddressFree(ptr.value, size)
            d.cuMemRelease(h.value)
            d.check("cuMemSetAccess", rc)
        self.vmm.append((ptr.value, size, h.value))
        self.vmm_by_export[key] = (ptr.value, size)
        return ptr.value, size

    def _import_pool(self, i: int, mem: "Token", fds: dict) -> tuple:
        """Imports the pool ``mem`` names (once per pool: ``cuMemPoolImportFromShareableHandle`` of
        its fd, closed right after; ``cuMemPoolSetAccess`` only when the pool is on another
        device) and the pointer (``cuMemPoolImportPointer`` of the token's 64 export bytes), as
        ipc/vmm.rs does. Returns (address, size in bytes). Context bound by the caller."""
        d = self.d
        d.require(
            "importing memory-pool memory", "cuMemPoolImportFromShareableHandle",
            "cuMemPoolSetAccess", "cuMemPoolImportPointer", "cuMemPoolDestroy", "cuMemFree",
        )
        if mem.offset != 0:
            raise InvalidToken(f"buffer {i}: a pool token names a whole allocation; offset {mem.offset}")
        if mem.len == 0:
            raise InvalidToken(f"buffer {i}: pool allocation size 0")
        key = (mem.exporter, mem.export_id)
        pool = self.pools.get(key)
        if pool is None:
            fd = fds.pop(key)
            p = ctypes.c_void_p()
            try:
                rc = d.cuMemPoolImportFromShareableHandle(
                    ctypes.byref(p), ctypes.c_void_p(fd), _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
                )
            finally:
                os.close(fd)  # the driver does not take ownership of a POSIX fd handle
            d.check("cuMemPoolImportFromShareableHandle", rc)
            pool = self.pools[key] = p.value
            if mem.device != self.uuid:
                desc = _CUmemAccessDesc(
                    _CUmemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal),
                    _CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                )
                d.check("cuMemPoolSetAccess", d.cuMemPoolSetAccess(pool, ctypes.byref(desc), 1))
        data = _CUmemPoolPtrExportData.of(mem.handle)
        ptr = ctypes.c_uint64()
        d.check(
            "cuMemPoolImportPointer",
            d.cuMemPoolImportPointer(ctypes.byref(ptr), ctypes.c_void_p(pool), ctypes.byref(data)),
        )
        self.pool_ptrs.append(ptr.value)
        return ptr.value, mem.len

    def bound(self) -> _Bound:
        return _Bound(self.d, self.ctx)

    def stream_for_own(self) -> int:
        if self.own_stream is None:
            s = ctypes.c_void_p()
            with self.bound():
                self.d.check("cuStreamCreate", self.d.cuStreamCreate(ctypes.byref(s), _CU_STREAM_NON_BLOCKING))
            self.own_stream = s.value or 0
        return self.own_stream

    def wait_ready(self, i: int, seq: int, stream: int) -> None:
        """Makes ``stream`` wait until buffer ``i``'s ready word is at or after ``seq``'s low 32
        bits in wrap-around order (``cuStreamWaitValue32_v2``, ``CU_STREAM_WAIT_VALUE_GEQ``), then
        records this consumer's event for that stream, so that close can wait for the wait."""
        d = self.d
        with self.bound():
            d.check(
                "cuStreamWaitValue32_v2",
                d.cuStreamWaitValue32(
                    stream, self.ready_dev + 4 * i, seq & _U32, _CU_STREAM_WAIT_VALUE_GEQ
                ),
            )
            ev = self.waited.get(stream)
            if ev is None:
                if len(self.waited) >= self._WAITED_STREAMS:
                    self._forget_finished_waits()
                e = ctypes.c_void_p()
                d.check("cuEventCreate", d.cuEventCreate(ctypes.byref(e), _CU_EVENT_DISABLE_TIMING))
                ev = self.waited[stream] = e.value
            d.check("cuEventRecord", d.cuEventRecord(ev, stream))

    def _forget_finished_waits(self) -> None:
        # Context bound by the caller.
        for s, ev in list(self.waited.items()):
            if self.d.cuEventQuery(ev) == 0:
                del self.waited[s]
                self.d.cuEventDestroy(ev)

    def record_release(self, i: int, stream: int) -> None:
        """Records buffer ``i``'s release event on ``stream``; on failure synchronises the stream
        instead (the producer must not overwrite the buffer under our kernels)."""
        with self.bound():
            rc = self.d.cuEventRecord(self.release_events[i], stream)
            if rc == 0:
                self.recorded.add(i)
                return
            try:
                self.d.check("cuEventRecord", rc)
            except CudaError as e:
                warnings.warn(f"recording the release event failed ({e}); synchronising instead")
            self.d.check("cuStreamSynchronize", self.d.cuStreamSynchronize(stream))

    def finish(self) -> None:
        """Waits on the host until every release event recorded and every ready wait enqueued has
        completed: the work that read the pool is done before the slot is freed (a freed slot's
        events are no longer waited on), and no stream still reads the ready page when close()
        unregisters it. Polls (``cuEventQuery``) rather than blocking in ``cuEventSynchronize``:
        every 20 ms it checks the producer, and if it died marks its frames ready (force_ready),
        since a stream waiting for the dead producer's write would never drain."""
        d = self.d
        events = [self.release_events[i] for i in sorted(self.recorded)]
        events += list(self.waited.values())
        with self.bound():
            for ev in events:
                pause = 50e-6
                last_check = time.monotonic()
                while True:
                    rc = d.cuEventQuery(ev)
                    if rc == 0:
                        break
                    if rc != _CUDA_ERROR_NOT_READY:
                        d.check("cuEventQuery", rc)
                    now = time.monotonic()
                    if now - last_check >= _LIVENESS_EVERY:
                        last_check = now
                        if self.control.producer().liveness() is False:
                            self.control.force_ready()
                    time.sleep(pause)
                    pause = min(pause * 2, 0.001)

    def close(self) -> None:
        """Destroys the events, unregisters the ready page (``cuMemHostUnregister``; callers wait
        for the streams first, see ``finish``), closes the imports (legacy: ``cuIpcCloseMemHandle``;
        VMM: ``cuMemUnmap``, ``cuMemAddressFree``, ``cuMemRelease``; pools: ``cuMemFree_v2`` of each
        pointer, then ``cuMemPoolDestroy``) and the own stream, and only then releases the primary
        context. Idempotent."""
        d = self.d
        if self.ctx is None:
            return
        problems = []
        with self.bound():
            for e in self.release_events + list(self.waited.values()):
                rc = d.cuEventDestroy(e)
                if rc:
                    problems.append(f"cuEventDestroy_v2: CUresult {rc}")
            self.release_events, self.waited = [], {}
            if self.ready_host is not None:
                rc = d.cuMemHostUnregister(self.ready_host)
                if rc:
                    problems.append(f"cuMemHostUnregister: CUresult {rc}")
                self.ready_host, self.ready_dev = None, 0
            for h in self.mapped:
                try:
                    d.close_mapping(self.ctx, h)
                except CudaError as e:
                    problems.append(str(e))
            self.mapped = []
            # VMM: unmap, free the address range, release the handle (VmmMap's drop in vmm.rs).
            for ptr, size, h in self.vmm:
                for call, rc in (
                    ("cuMemUnmap", d.cuMemUnmap(ptr, size)),
                    ("cuMemAddressFree", d.cuMemAddressFree(ptr, size)),
                    ("cuMemRelease", d.cuMemRelease(h)),
                ):
                    if rc:
                        problems.append(f"{call}: CUresult {rc}")
            self.vmm, self.vmm_by_export = [], {}
            # Pools: every imported pointer freed before its pool is destroyed.
            for ptr in self.pool_ptrs:
                rc = d.cuMemFree(ptr)
                if rc:
                    problems.append(f"cuMemFree_v2: CUresult {rc}")
            self.pool_ptrs = []
            for pool in self.pools.values():
                rc = d.cuMemPoolDestroy(ctypes.c_void_p(pool))
                if rc:
                    problems.append(f"cuMemPoolDestroy: CUresult {rc}")
            self.pools = {}
            if self.own_stream:
                rc = d.cuStreamDestroy(self.own_stream)
                if rc:
                    problems.append(f"cuStreamDestroy_v2: CUresult {rc}")
                self.own_stream = None
        d.cuDevicePrimaryCtxRelease(self.ordinal)
        self.ctx = None
        if problems:
            warnings.warn("closing the consumer's CUDA resources: " + "; ".join(problems))


def _watchdog(control: "_Control", stop: threading.Event) -> None:
    """Checks the producer every 20 ms until ``stop`` is set; once it is dead, marks its frames
    ready (``force_ready``) and ends."""
    while not stop.wait(0.02):
        try:
            if control.producer().liveness() is False:
                control.force_ready()
                return
        except Exception:  # the consumer is closing; never raise from this thread
            return


def _fetch_token_fds(mems: list) -> dict:
    """The fds that the VMM and pool tokens among ``mems`` need, fetched from their exporters
    (``fetch_fds``, one request per exporter): (exporter, export id) -> fd, owned by the caller."""
    wanted: dict = {}
    for mem in mems:
        if mem.kind in (_KIND_VMM, _KIND_POOL):
            ids = wanted.setdefault(mem.exporter, [])
            if mem.export_id not in ids:
                ids.append(mem.export_id)
    out: dict = {}
    try:
        for exporter, ids in wanted.items():
            for eid, fd in zip(ids, fetch_fds(exporter, ids)):
                out[(exporter, eid)] = fd
    except BaseException:
        _close_fds(list(out.values()))
        raise
    return out


def _buffer_tokens(control: _Control, i: int) -> tuple:
    """The decoded memory token of buffer ``i``, kind checked (legacy, VMM or pool memory), and
    ``None``: since layout version 2 the second token area is zero (readiness travels through the
    ready page)."""
    mem_b, _ev_b = control.buffer_tokens(i)
    try:
        mem = Token.from_bytes(mem_b)
    except InvalidToken as e:
        raise InvalidToken(f"buffer {i}: {e}") from None
    if mem.kind not in (_KIND_MEMORY, _KIND_VMM, _KIND_POOL):
        raise InvalidToken(f"buffer {i}: expected a memory token, got {_KIND_NAMES[mem.kind]}")
    return mem, None


# ---------------------------------------------------------------------------------------- API

_DELIVERY = {"every": _EVERY, "latest": _LATEST}

# dtype name -> (CUDA array interface typestr, item size in bytes)
_TYPESTR = {
    "bool": "|b1", "uint8": "|u1", "int8": "|i1", "uint16": "<u2", "int16": "<i2",
    "uint32": "<u4", "int32": "<i4", "uint64": "<u8", "int64": "<i8",
    "float16": "<f2", "float32": "<f4", "float64": "<f8",
    "complex64": "<c8", "complex128": "<c16",
}
_TYPESTR_NAMES = {v: k for k, v in _TYPESTR.items()}
# dtypes the array interface cannot name, read as an integer of the same size and then viewed.
_VIEW_AS = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def _dtype_name(dtype) -> str:
    """A dtype name from a torch dtype, a NumPy/CuPy dtype or type, or a string."""
    if dtype is None:
        return "uint8"
    s = getattr(dtype, "str", None)  # numpy dtype: '<u4'
    if isinstance(s, str) and s.replace("=", "<") in _TYPESTR_NAMES:
        return _TYPESTR_NAMES[s.replace("=", "<")]
    name = getattr(dtype, "__name__", None) or str(dtype)
    name = name.replace("torch.", "")  # str(torch.int32) == "torch.int32"
    if name in _TYPESTR or name in _VIEW_AS:
        return name
    if name in _TYPESTR_NAMES:
        return _TYPESTR_NAMES[name]
    raise TypeError(f"unsupported dtype {dtype!r}")


class _CudaArray:
    """A CUDA array interface (v3) view of part of a frame; keeps the frame alive while a tensor or
    array made from it lives."""

    def __init__(self, frame: "Frame", ptr: int, shape: tuple, typestr: str, stream: Optional[int]):
        self._frame = frame
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": stream,
        }


class Frame:
    """A received frame: ``nbytes`` bytes at device address ``ptr`` (in this process), ready on
    ``stream`` (which waits on the buffer's ready word). Release it (``release()``, a ``with``
    block, or by dropping the last reference) after enqueuing the work that reads it: the release is
    stream-ordered after that work.

    ``seq``: sequence number (1, 2, ... per channel); ``index``: buffer index in the pool;
    ``metadata``: the producer's bytes (at most 256); ``stream``: the raw ``CUstream`` (int)."""

    def __init__(self, consumer: "Consumer", index: int, seq: int, metadata: bytes, stream: Optional[int]):
        self._consumer = consumer
        self.index = index
        self.seq = seq
        self.metadata = metadata
        self.stream = stream
        self._released = False

    @property
    def nbytes(self) -> int:
        """Bytes in the frame's buffer."""
        return self._consumer.buffer_bytes

    @property
    def ptr(self) -> Optional[int]:
        """Device address of the buffer in this process (None in protocol-only mode)."""
        g = self._consumer._gpu
        return None if g is None else g.buffers[self.index]

    @property
    def released(self) -> bool:
        return self._released

    def _view(self, shape, name: str, offset: int, stream: Optional[int]) -> _CudaArray:
        if self._released:
            raise ValueError(f"frame {self.seq} was released")
        if self.ptr is None:
            raise NotSupported("a protocol-only consumer (cuda=False) has no device memory")
        typestr = _TYPESTR[name]
        item = int(typestr[2:])
        avail = self.nbytes - offset
        if offset < 0 or offset % item or avail < 0:
            raise ValueError(f"offset {offset} must be a multiple of {item} within {self.nbytes} bytes")
        if shape is None:
            shape = (avail // item,)
        elif isinstance(shape, int):
            shape = (shape,)
        count = 1
        for n in shape:
            if int(n) < 0:
                raise ValueError(f"negative dimension in {shape}")
            count *= int(n)
        if count * item > avail:
            raise ValueError(
                f"shape {tuple(shape)} of {name} needs {count * item} bytes; the frame has {avail} "
                f"from offset {offset}"
            )
        return _CudaArray(self, self.ptr + offset, tuple(int(n) for n in shape), typestr, stream)

    def as_tensor(self, shape=None, dtype=None, offset: int = 0):
        """The frame as a PyTorch CUDA tensor, zero-copy (``torch.as_tensor`` over the CUDA array
        interface). ``shape``: a tuple (default: 1-D over the whole buffer); ``dtype``: a torch
        dtype or name (default ``torch.uint8``); ``offset`` in bytes. The data is ready on
        ``frame.stream``: by default that is PyTorch's current stream at ``recv`` time, so work
        enqueued on the current stream is ordered after the producer's write. The tensor must not
        be used after the frame is released. Raises ``ValueError`` when the shape does not fit."""
        torch = importlib.import_module("torch")
        name = _dtype_name(dtype)
        base = _VIEW_AS.get(name, name)
        arr = self._view(shape, base, offset, _cai_stream(self.stream))
        t = torch.as_tensor(arr, device=torch.device("cuda", self._consumer.device_ordinal))
        if base != name:
            t = t.view(getattr(torch, name))
        return t

    def as_cupy(self, shape=None, dtype=None, offset: int = 0):
        """The frame as a CuPy array, zero-copy (``cupy.asarray`` over the CUDA array interface);
        arguments as ``as_tensor`` (dtype: a NumPy/CuPy dtype or name). When ``frame.stream`` is
        not CuPy's current stream, the array interface names it and CuPy synchronises on it."""
        cupy = importlib.import_module("cupy")
        name = _dtype_name(dtype)
        if name in _VIEW_AS:
            raise TypeError(f"CuPy has no {name}")
        with cupy.cuda.Device(self._consumer.device_ordinal):
            current = cupy.cuda.get_current_stream().ptr
            stream = None if current == self.stream else _cai_stream(self.stream)
            return cupy.asarray(self._view(shape, name, offset, stream))

    def release(self, stream: Optional[int] = None) -> None:
        """Gives the frame back: records this consumer's release event for the buffer on
        ``stream`` (default ``frame.stream``; pass the raw ``CUstream`` of another stream if the
        reading work ran there), then clears the hold and wakes the producer. Idempotent."""
        if self._released:
            return
        self._released = True
        c = self._consumer
        c._frame_released(self, self.stream if stream is None else int(stream))

    def __enter__(self) -> "Frame":
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False

    def __del__(self):
        try:
            self.release()
        except Exception:  # never raise from a finaliser (e.g. at interpreter exit)
            pass

    def __repr__(self) -> str:
        return f"Frame(seq={self.seq}, index={self.index}, nbytes={self.nbytes}, metadata={len(self.metadata)} bytes)"


def _cai_stream(stream: Optional[int]) -> Optional[int]:
    # The array interface forbids 0; 1 names the legacy default stream.
    if stream is None:
        return None
    return 1 if stream == 0 else stream


class Consumer:
    """The consuming end of a channel, like ``cuda_ipc::channel::Consumer``. Make one with
    ``Consumer.attach``; close it with ``close()``, a ``with`` block, or by dropping it."""

    def __init__(self, *_a, **_k):
        raise TypeError("use Consumer.attach(name, ...)")

    @classmethod
    def attach(
        cls,
        name: str,
        delivery: str = "every",
        stream=None,
        cuda: bool = True,
        spin: float = 0.0,
    ) -> "Consumer":
        """Attaches to channel ``name`` (segment ``/dev/shm/cuda-ipc.ch.NAME``) and receives frames
        published from now on.

        ``delivery``: ``"every"`` (every frame in order; the producer waits for this consumer) or
        ``"latest"`` (only the newest; skipped frames are counted as dropped).
        ``stream``: where frames are made ready and releases recorded: None picks, at each ``recv``,
        PyTorch's current stream when torch is imported, else CuPy's current stream when cupy is
        imported, else a stream of the consumer's own; or a raw ``CUstream`` (int), or an object
        with ``.cuda_stream`` (torch) or ``.ptr`` (CuPy), or ``"own"``.
        ``cuda``: False attaches for the protocol only (no CUDA calls: frames carry no memory, the
        release tokens name no event); for tools and tests.
        ``spin``: seconds to poll before sleeping on the futex in ``recv`` (default 0).

        Before claiming the slot it takes this process's identity (``ProcessIdentity.current``),
        which creates and locks its liveness file: that is how the producer, in any pid
        namespace, tells whether this consumer still runs.

        Raises ``ValueError`` for a bad name or delivery; ``ChannelNotFound``; ``BadSegment``
        (also for a sparse segment, or a symbolic link, directory, FIFO, socket or device under
        the name: never mapped, never blocking); ``OSError`` when the liveness file cannot be made;
        ``InvalidToken``; ``NoConsumerSlot``; ``ProducerGone`` when the producer is dead (also
        when it dies while its VMM or pool fds are fetched); ``FdNotOffered``, ``NotSupported``,
        ``Timeout`` or ``FdPassingError`` from fetching those fds (``fetch_fds``);
        ``AtomicsUnavailable``; ``CudaUnavailable`` or ``CudaError`` from the imports and the
        ready page's registration (``cuIpcOpenMemHandle_v2``, ``cuMemImportFromShareableHandle``,
        ``cuMemMap``, ``cuMemPoolImportPointer``, ``cuEventCreate``, ``cuMemHostRegister_v2``...).
        """
        if delivery not in _DELIVERY:
            raise ValueError(f"unknown delivery {delivery!r} (every|latest)")
        self = object.__new__(cls)
        self._closed = True
        self._gpu = None
        self._control = None
        # Re-entrant: a frame's finaliser may run (and release) while this thread holds the lock.
        self._lock = threading.RLock()
        # One taker at a time: the slot's cursor is advanced by a load and a store.
        self._recv_lock = threading.Lock()
        # buffer index -> (seq, stream, weak reference to the Frame) of each frame held now
        self._held: dict = {}
        self._spin = float(spin)
        self._stream = _resolve_stream_arg(stream)
        control = _Control(name)
        self._control = control
        try:
            control.producer_gone()
            me = ProcessIdentity.current()
            if cuda:
                self._gpu = _Gpu(control, me)
                tokens = self._gpu.release_tokens
            else:
                tokens = []
                for i in range(control.buffers):
                    mem, _ = _buffer_tokens(control, i)
                    tokens.append(Token(_KIND_EVENT, bytes(64), 0, 0, mem.device, me).to_bytes())
            self._slot = control.attach(_DELIVERY[delivery], tokens, me)
        except BaseException:
            if self._gpu is not None:
                self._gpu.close()
                self._gpu = None
            control.unmap()
            raise
        self._closed = False
        self.name = name
        self.delivery = delivery
        # As the Rust consumer's watchdog: marks a dead producer's frames ready within about 20 ms,
        # so a stream waiting for them drains even if this process never calls recv again (say,
        # it is blocked synchronising that stream). Stopped and joined before the unmap in close.
        self._watch_stop = threading.Event()
        self._watch = threading.Thread(
            target=_watchdog, args=(control, self._watch_stop), name="cuda-ipc-watchdog", daemon=True
        )
        self._watch.start()
        return self

    # -- properties
    @property
    def slot(self) -> int:
        """This consumer's slot index in the segment."""
        return self._slot

    @property
    def buffers(self) -> int:
        """Buffers in the pool."""
        return self._control.buffers

    @property
    def buffer_bytes(self) -> int:
        """Bytes per buffer."""
        return self._control.buffer_bytes

    @property
    def device_ordinal(self) -> Optional[int]:
        """Ordinal (in this process) of the device holding the pool; None without CUDA."""
        return None if self._gpu is None else self._gpu.ordinal

    @property
    def producer(self) -> ProcessIdentity:
        """The producer's identity as the segment records it."""
        return self._control.producer()

    def stats(self) -> dict:
        """Counters: ``published``, ``head``, ``forced_releases``, and per consumer ``index``,
        ``pid``, ``received``, ``dropped``, ``in_flight``, ``lag``."""
        self._check_open()
        return self._control.stats()

    # -- receiving
    def recv(self, timeout: Optional[float] = None) -> Frame:
        """Waits up to ``timeout`` seconds (None: forever) for the next frame by the delivery
        policy, holds it, and makes the frame's stream wait until the buffer's ready word shows
        the producer's write finished (``cuStreamWaitValue32_v2``; no host synchronisation).

        Raises ``Timeout``; ``ProducerGone`` within about 20 ms of the producer dying, after
        marking the frames it published ready (so streams waiting on them drain; their data may
        be partial); ``ChannelClosed`` once the producer closed and every frame was received;
        ``Superseded`` when the channel's name was removed and made again while waiting (looked
        at every 500 ms of a wait, never per frame: attach again); ``Detached``; ``CudaError``
        from the stream wait (the hold is released first)."""
        self._check_open()
        with self._recv_lock:
            try:
                got = self._control.take(self._slot, self._spin, timeout)
            except ProducerGone:
                self._control.force_ready()
                raise
        if got is None:
            raise Timeout(f"no frame within {timeout} s")
        return self._deliver(*got)

    def try_recv(self) -> Optional[Frame]:
        """The next frame if one is ready now, else None. Raises as ``recv`` except ``Timeout``."""
        self._check_open()
        with self._recv_lock:
            got = self._control.take_or_closed(self._slot)
        if got is None:
            try:
                self._control.producer_gone()
            except ProducerGone:
                self._control.force_ready()
                raise
            return None
        return self._deliver(*got)

    def __iter__(self):
        """Frames until the channel closes (``ChannelClosed`` ends the iteration)."""
        while True:
            try:
                yield self.recv()
            except ChannelClosed:
                return

    def _current_stream(self) -> Optional[int]:
        g = self._gpu
        if g is None:
            return None
        if isinstance(self._stream, int):
            return self._stream
        if self._stream is None:
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available():
                return int(torch.cuda.current_stream(g.ordinal).cuda_stream)
            cupy = sys.modules.get("cupy")
            if cupy is not None:
                with cupy.cuda.Device(g.ordinal):
                    return int(cupy.cuda.get_current_stream().ptr)
        return g.stream_for_own()

    def _deliver(self, i: int, seq: int, meta: bytes) -> Frame:
        try:
            stream = self._current_stream()
        except BaseException:
            self._control.release(self._slot, i)
            raise
        frame = Frame(self, i, seq, meta, stream)
        with self._lock:
            self._held[i] = (seq, stream, weakref.ref(frame))
        if self._gpu is not None:
            try:
                self._gpu.wait_ready(i, seq, stream)
            except BaseException:
                frame.release()
                raise
        return frame

    def _frame_released(self, frame: Frame, stream: Optional[int]) -> None:
        with self._lock:
            held = self._held.get(frame.index)
            if self._closed or held is None or held[0] != frame.seq:
                return  # closed meanwhile: the slot and its holds are gone
            del self._held[frame.index]
        try:
            if self._gpu is not None:
                self._gpu.record_release(frame.index, stream)
        finally:
            self._control.release(self._slot, frame.index)

    # -- closing
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the consumer is closed")

    def close(self) -> None:
        """Detaches: if the producer is dead, marks the frames it published ready (as ``recv``
        does on ``ProducerGone``); records release events for frames still held (tensors made
        from them must not be used afterwards); waits on the host until every release event
        recorded and every ready wait enqueued has completed (the producer no longer waits on this
        consumer's events once the slot is free, and the ready page must not be read after it is
        unregistered), marking frames ready if the producer dies meanwhile; frees the slot and its
        holds; then unregisters the ready page (``cuMemHostUnregister``), closes the imports
        (``cuIpcCloseMemHandle``; VMM: ``cuMemUnmap``, ``cuMemAddressFree``, ``cuMemRelease``;
        pools: ``cuMemFree_v2`` of each pointer, then ``cuMemPoolDestroy``) and events
        (``cuEventDestroy_v2``), releases the primary context and unmaps the segment.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            held = list(self._held.items())
            self._held.clear()
            self._closed = True
        g = self._gpu
        try:
            if self._control.producer().liveness() is False:
                self._control.force_ready()
            for i, (_seq, stream, ref) in held:
                f = ref()
                if f is not None:
                    f._released = True
                if g is not None:
                    g.record_release(i, stream)
            if g is not None:
                g.finish()
        except CudaError as e:
            warnings.warn(f"waiting for this consumer's last reads failed: {e}")
        finally:
            self._control.detach(self._slot)
            watch = getattr(self, "_watch", None)
            if watch is not None:
                self._watch_stop.set()
                if watch is not threading.current_thread():
                    watch.join()
            try:
                if g is not None:
                    g.close()
            finally:
                self._gpu = None
                self._control.unmap()

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def __del__(self):
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # never raise from a finaliser (e.g. at interpreter exit)
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"slot {self._slot}"
        return f"Consumer({getattr(self, 'name', '?')!r}, {state})"


def _resolve_stream_arg(stream):
    if stream is None or stream == "own":
        return stream
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"bad stream handle {stream}")
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    raise TypeError(
        f"stream must be None, 'own', a raw CUstream (int), or a torch/CuPy stream, not {stream!r}"
    )


def _main(argv: list) -> int:
    """``python3 cuda_ipc_consumer.py CHANNEL [--frames N] [--latest] [--no-cuda]``: receives
    frames and prints their sequence numbers and metadata (hex) until the channel closes."""
    import argparse

    p = argparse.ArgumentParser(description=_main.__doc__)
    p.add_argument("channel")
    p.add_argument("--frames", type=int, default=0, help="stop after N frames (0: until closed)")
    p.add_argument("--latest", action="store_true", help="latest-only delivery")
    p.add_argument("--no-cuda", action="store_true", help="protocol only, no CUDA calls")
    p.add_argument("--timeout", type=float, default=None, help="seconds to wait for each frame")
    a = p.parse_args(argv)
    n = 0
    with Consumer.attach(
        a.channel, delivery="latest" if a.latest else "every", cuda=not a.no_cuda
    ) as rx:
        print(f"attached to {a.channel} as consumer {rx.slot}: {rx.buffers} buffers of {rx.buffer_bytes} bytes")
        while a.frames == 0 or n < a.frames:
            try:
                f = rx.recv(a.timeout)
            except ChannelClosed:
                break
            with f:
                print(f"frame {f.seq} buffer {f.index} metadata {f.metadata.hex()}", flush=True)
            n += 1
        print(f"received {n} frames; stats {rx.stats()}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(_main(sys.argv[1:]))
    except (CudaIpcError, ValueError, OSError) as e:  # ValueError: a bad channel name
        print(f"cuda_ipc_consumer: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
