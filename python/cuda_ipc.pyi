"""Zero-copy GPU frames between processes: the cuda-ipc channel (a Rust extension).

A ``Producer`` owns a pool of exportable device buffers and publishes frames; each ``Consumer``
process attaches by channel name and receives them as ``Frame`` objects, views of the producer's
buffers that export through DLPack (``torch.from_dlpack(frame)``) and ``__cuda_array_interface__``.
Blocking calls release the GIL and are interrupted by Ctrl-C (``KeyboardInterrupt``) within 50 ms
(a constructor that replaces a creation abandoned under its name less than 2 s ago, after it),
and by ``close()`` of their object from another thread within 50 ms (``Consumer``: ``Detached``;
``Producer``: ``ChannelClosed``; ``TensorSetWriter``, ``TensorSetReader``: ``TensorSetClosed``).

At the interpreter's exit every ``Producer`` and ``TensorSetWriter`` still open and not in use
by a thread is closed (in ``multiprocessing``'s exit, after it joined its children, where it is
loaded), waiting up to 5 s in all for other processes' consumers and readers; this process's own
holds are forced.

Durations (``timeout``, ``spin``) are seconds from 0 to 1e9; ``timeout=None`` waits forever.
Anything else (negative, NaN, infinite, larger) raises ``InvalidArgument`` naming the argument.
Text arguments (names, ``memory``, ``mode``, ``wait``, ``delivery``, ``quota``, ``scope``, tensor
and dtype names) take a ``str``; one with a lone surrogate (``os.fsdecode`` of bytes that are not
UTF-8) raises ``InvalidArgument`` naming the argument, never ``UnicodeEncodeError``.

A host channel (``Producer(name, n, memory="host")``) needs no GPU or CUDA driver: its pool is
shared host memory, written with ``WriteFrame.write`` and read with ``Frame.bytes``/``Frame.read``
(copies). Its frames have no ``ptr``, ``stream`` or tensor export: those raise ``NotSupported``.
"""

import builtins
from types import TracebackType
from typing import Any, Callable, Coroutine, Dict, Iterator, List, Literal, Optional, Tuple, Type, Union, final

__all__ = [
    "CudaIpcError",
    "ChannelNotFound",
    "ChannelExists",
    "BadSegment",
    "InvalidToken",
    "NotSupported",
    "FdNotOffered",
    "FdPassingError",
    "NoConsumerSlot",
    "ProducerGone",
    "ChannelClosed",
    "Detached",
    "Superseded",
    "AtomicsUnavailable",
    "CudaUnavailable",
    "CudaError",
    "QuotaError",
    "TensorSetNotFound",
    "WriterGone",
    "TensorSetClosed",
    "LayoutMismatch",
    "ContentMismatch",
    "NotHoldable",
    "NoHolderSlot",
    "NoServer",
    "Timeout",
    "InvalidArgument",
    "OsError",
    "OverQuota",
    "Producer",
    "WriteFrame",
    "Consumer",
    "Frame",
    "TensorSetWriter",
    "TensorUpdate",
    "CopyPlan",
    "TensorSetReader",
    "TensorHold",
    "TensorSetHolder",
    "Posted",
    "PostedFrame",
    "set_quota",
    "remove_quota",
    "cleanup",
    "CleanupResult",
    "torch_mem_pool",
    "arena_locate",
    "arena_stats",
    "warm_up",
    "META_BYTES",
    "__version__",
]

__version__: str
META_BYTES: int
"""The most metadata bytes a frame carries (256)."""

Wait = Literal["block", "spin", "spin_then_block"]

StreamLike = Union[int, Any]
"""A CUDA stream of the channel's device: an ``int`` (a raw ``CUstream``; ``0``/``1`` the legacy
default stream, ``2`` the per-thread one), a ``torch.cuda.Stream`` (its ``cuda_stream``), a
``cupy.cuda.Stream`` (its ``ptr``), or an object with ``__cuda_stream__``. It must stay valid
until the frame it orders is published or released (PyTorch's pooled streams and the default
streams always are)."""

BytesLike = Union[bytes, bytearray, memoryview, Any]
"""Bytes as every call that takes some reads them (``WriteFrame.write`` and ``publish``'s
metadata, ``TensorUpdate.write`` and ``commit``'s content, a reader's ``expect_layout`` and
``expect_content``): ``bytes``, or any object exporting a buffer (``bytearray``, ``memoryview``,
``array.array``, a NumPy array), its bytes copied once. What exports no buffer (a ``str``, an
``int``) raises ``TypeError``; a buffer of Python objects (format ``O``, a NumPy array of
``dtype=object``), ``InvalidArgument``."""

class CudaIpcError(Exception):
    """Base class of every error raised by cuda_ipc; the message is the Rust error's text."""

class ChannelNotFound(CudaIpcError):
    """No channel of this name exists (start its producer first)."""

class ChannelExists(CudaIpcError):
    """A live producer already serves this name, or another process is creating it."""

class BadSegment(CudaIpcError):
    """The segment under the channel's name is foreign, of another layout version, truncated,
    corrupted, of another owner, not fully created, or not a segment at all."""

class InvalidToken(CudaIpcError):
    """A token's bytes could not be decoded."""

class NotSupported(CudaIpcError):
    """This machine, device or memory cannot do what was asked; also an object used in a child made
    by ``fork()`` that its parent made before the fork (open the child's own)."""

class FdNotOffered(CudaIpcError):
    """The producer does not offer the file descriptor asked for."""

class FdPassingError(CudaIpcError):
    """Fetching a VMM or memory-pool channel's file descriptors failed."""

class NoConsumerSlot(CudaIpcError):
    """Every consumer slot of the channel is taken (a tensor set's readers: every one of the
    writer's ``max_readers`` slots; a dead reader's slot is freed within about 1 s)."""

class ProducerGone(CudaIpcError):
    """The channel's producer died (noticed within about 20 ms)."""

class ChannelClosed(CudaIpcError):
    """The producer closed the channel and every published frame was received; or, from a
    ``Producer``, it was closed (also from another thread while ``acquire`` waited)."""

class Detached(CudaIpcError):
    """This consumer's slot was taken back, or it was closed (also from another thread while
    ``recv`` waited)."""

class Superseded(CudaIpcError):
    """The channel was removed and made again while this handle used it: attach again."""

class Timeout(CudaIpcError, TimeoutError):
    """A bounded wait ran out."""

class InvalidArgument(CudaIpcError, ValueError):
    """An argument is out of range: a bad channel name, an unknown option, too much metadata."""

class OsError(CudaIpcError, OSError):
    """A system call failed; the message names the call."""

class AtomicsUnavailable(CudaIpcError):
    """Raised by the pure-Python consumer only; kept so code that catches it still runs."""

class CudaUnavailable(CudaIpcError):
    """The CUDA driver could not be loaded, or no visible device has the pool's UUID."""

class CudaError(CudaIpcError):
    """A CUDA driver call failed; the message names the call and the error."""

class QuotaError(CudaIpcError):
    """A shared memory budget (``quota=``) cannot serve the producer: none is set, its ledger is
    full, it is another user's to change, or another user planted a file under its ledger's name
    (the message names the file's owner and how root removes it)."""

class OverQuota(QuotaError, ValueError):
    """The pool would take a budget past its limit: the shared one of ``quota=`` (the message
    names each holder, its pid and bytes, and for a killed holder of host memory the /dev/shm
    segment that still holds it, which ``cuda-ipc gc`` removes) or the producer's own
    ``quota_bytes``."""

class TensorSetNotFound(ChannelNotFound):
    """No tensor set of this name exists (start its writer first)."""

class WriterGone(ProducerGone):
    """The tensor set's writer died: the generation held stays readable, no new one comes."""

class TensorSetClosed(ChannelClosed):
    """The tensor set was closed: by its writer, or this object was closed by its own
    ``close()`` (a ``TensorSetWriter``, ``TensorSetReader`` or ``TensorSetHolder``; also from
    another thread while a call waited). The message says which: ``tensor set "x" was closed by
    its writer``, ``this reader of tensor set "x" is closed (...)``."""

class LayoutMismatch(CudaIpcError):
    """The tensor set's layout fingerprint is not the one expected (another checkpoint or model)."""

class ContentMismatch(CudaIpcError):
    """A generation's content fingerprint is not the one expected (``expect_content``), or its
    bytes are not the ones its writer fingerprinted (``TensorHold.verify_content()``)."""

    generation: int
    committed: bytes
    """What the writer committed (32 bytes; all zeros: none)."""
    expected: Optional[bytes]
    """The reader's ``expect_content``, when that refused the generation."""
    computed: Optional[bytes]
    """The fingerprint of the bytes, when ``verify_content()`` refused them."""

class NotHoldable(NotSupported):
    """The tensor set cannot be held by forwarding its file descriptors (``TensorSetHolder``,
    ``serve=True``): a host, pool or legacy set, one whose writer made no holders segment, or one
    of too many allocations."""

class NoHolderSlot(CudaIpcError):
    """Every holder slot of the tensor set serves a live process."""

class NoServer(WriterGone):
    """No process could hand over the tensor set's file descriptors: its writer is dead and no
    live holder answered; the message names each server tried and what it said."""

def set_quota(budget_bytes: int, *, scope: str = "user", device: Optional[int] = None) -> None:
    """Sets the shared budget (bytes) that producers and tensor set writers made with
    ``quota=scope`` reserve their memory from (a producer its pool, ``buffers × buffer_bytes``; a
    writer its buffers, each tensor's bytes rounded up to its alignment, times 2 when buffered),
    for host memory (``device=None``, the default: the budget of ``memory="host"`` producers and
    writers, not GPU 0's) or CUDA device ``device``; as ``cuda-ipc quota set``.
    ``scope``: ``"user"`` or ``"group:NAME"`` (a group of this process, or a gid). ``2**64 - 1``
    means no limit (what is reserved is still counted). Raises ``QuotaError`` for another user's
    ledger, ``InvalidArgument`` for a bad scope or group."""

def remove_quota(*, scope: str = "user", device: Optional[int] = None) -> bool:
    """Removes that budget (``device=None``, the default: the host-memory one); returns whether
    there was one. Reservations held are forgotten with
    it: their holders keep their memory, and a budget set again counts only what is reserved
    after it."""

class CleanupResult(List[Dict[str, Any]]):
    """What ``cleanup()`` returns: a ``list`` of the leftovers found (``dry_run``) or removed,
    each a dict (``kind``, ``object``, ``pid``, ``uid``, ``what``), and in ``skipped`` a list of
    the objects of other users it passed over, each a dict (``name``, ``owner``, ``what``,
    ``dead``, ``pid``), as ``cuda-ipc gc --json``'s ``skipped`` and ``quota_skipped`` together:
    never judged nor removed, theirs to clean."""

    skipped: List[Dict[str, Any]]
    """Other users' objects passed over, sorted by name: ``name`` (in /dev/shm), ``owner`` (its
    uid), ``what`` (``"registry"``, ``"channel segment"``, ``"host pool"``, ``"tensor set
    part"``, ``"quota ledger"``, ``"liveness file"``, ``"fd server socket"``, ``"bridge status
    file"``), ``dead`` (whether its listing found it a dead process's leftover: a liveness file,
    fd server socket or bridge status file; ``False`` for a segment, which is not judged) and
    ``pid`` (the dead process a liveness file or fd server socket names, or ``None``). Files of
    other users' killed processes are here for a user other than root (root removes them)."""

def warm_up() -> Dict[str, Any]:
    """Makes this process's one-time costs of a first tensor-set attach now (0.25–0.3 ms on an
    H100 host with PyTorch 2.11, the first attach's otherwise), where the process has made them
    possible already: this extension's first driver calls (loading the library, ``cuInit``, the
    first use of each function) where CUDA is initialised and a context is current on this thread
    with its device's primary context active (and a first thread's start, the dearest in a process); PyTorch's first calls of the views a dict is made of
    (``from_dlpack`` of this extension's capsule, ``as_strided``, ``unbind``, ``narrow``,
    ``view``, on 1 KiB of host memory) where ``torch`` is imported, and
    ``torch.cuda.current_stream`` of that device where ``torch.cuda.is_initialized()``.

    Never loads the CUDA driver, initialises CUDA, makes a context or imports PyTorch (a process
    that forks after it keeps its children free to use CUDA; a ``torch`` loaded lazily, or being
    imported by another thread, is left alone). The driver's part is skipped where the driver's
    soname, ``libcuda.so.1``, is not in the process yet (the library this extension loads first,
    as PyTorch does). Raises nothing but
    ``KeyboardInterrupt``, ``SystemExit`` and other errors that are no ``Exception``: a step that
    fails is left to the first real use, which reports it. Importing ``cuda_ipc`` runs it once,
    unless the environment variable ``CUDA_IPC_WARM_UP`` is ``0``, ``false``, ``no`` or ``off``; call it again after making the CUDA
    context when ``cuda_ipc`` was imported before. Returns ``{"device": the prepared device's
    ordinal or None, "torch": whether PyTorch's calls were made}``. Takes 0.3–1 ms the first time,
    tens of µs later (the small dict is built again)."""

def cleanup(*, dry_run: bool = False) -> CleanupResult:
    """Finds what dead processes left in /dev/shm (registry and channel leftovers, host pools,
    quota reservations and abandoned ledger creations, liveness files, fd server sockets, bridge
    status files) and, unless ``dry_run``, removes it, each checked again right before it goes;
    the same rule set as ``cuda-ipc gc [--dry-run]``. Returns a ``CleanupResult``, a ``list`` of
    the leftovers found (``dry_run``) or removed, each a dict: ``kind`` (``"channel"``,
    ``"channel_consumer"``, ``"host_pool"``, ``"registry_record"``, ``"quota_creation"``,
    ``"liveness_file"``, ...), ``object`` (registry, channel, ledger or file name), ``pid`` and
    ``uid`` of the dead owner (or ``None``), ``what`` (the line ``cuda-ipc gc`` prints); its
    ``skipped`` lists the objects of other users passed over (``name``, ``owner``, ``what``,
    ``dead``, ``pid``), which are never in the list itself. Nothing of a live process or of
    another user is touched. What cannot be read or removed (a foreign file under our names, one
    open to other users) is left as it is, in neither list (``cuda-ipc gc`` names each as a
    problem). Raises ``OSError`` when /dev/shm cannot be listed."""

def torch_mem_pool(device: int = 0, *, chunk_bytes: Optional[int] = None) -> Any:
    """A ``torch.cuda.MemPool`` whose memory comes from this extension's VMM arena on CUDA device
    ``device``: ``torch.cuda.memory.CUDAPluggableAllocator`` over the C functions
    ``cuda_ipc_torch_malloc`` and ``cuda_ipc_torch_free`` that the extension's shared object
    exports. Tensors allocated under ``torch.cuda.use_mem_pool(pool)`` live in fd-exportable
    chunks (``chunk_bytes``, default 1 GiB, or a request's size when larger; fixed by the first
    call for a device, and kept for the life of the process), so a tensor set publishes a model's
    ``state_dict()`` with no copy. ``use_mem_pool`` routes only the calling thread's allocations
    to the pool: build the model in that thread. A failed allocation prints one line on stderr and
    PyTorch raises its ``OutOfMemoryError``. Raises ``CudaUnavailable`` without a CUDA driver or
    that device, ``InvalidArgument`` for a chunk size other than the arena's, ``ImportError``
    without PyTorch."""

def arena_locate(ptr: int, nbytes: int = 1) -> Tuple[int, int]:
    """``(chunk, offset)`` of device memory ``ptr`` (``nbytes`` long) in the arena of its device:
    the chunk's index among the arena's chunks and the byte offset in it (for a writer that
    publishes tensors of a ``torch_mem_pool`` without a copy). Raises ``InvalidArgument`` when no
    arena holds the range (the tensor was allocated elsewhere: publish it with a copy)."""

def arena_stats(device: int = 0) -> Dict[str, int]:
    """What device ``device``'s arena holds: ``chunks``, ``reserved_bytes``, ``in_use_bytes``,
    ``allocations``, ``chunk_bytes`` (zeros before its first allocation). Raises
    ``CudaUnavailable`` without a CUDA driver or that device."""

class ConsumerStats(Dict[str, int]):
    """``index``, ``pid``, ``received``, ``dropped``, ``in_flight``, ``lag``."""

ChannelStats = Dict[str, Union[int, List[Dict[str, int]]]]
"""``published``, ``head``, ``forced_releases`` and ``consumers`` (a list of ConsumerStats)."""

@final
class Producer:
    """The producing end of channel ``name``: a pool of ``buffers`` buffers of ``buffer_bytes``
    bytes on CUDA device ``device`` (its primary context), or of shared host memory.

    ``memory``: ``"auto"`` (VMM where the device exports it as a file descriptor, else legacy IPC;
    legacy for ``group_access``), ``"legacy"``, ``"vmm"``,
    ``"pool"``, or ``"host"``: a POSIX shared-memory pool beside the control segment, made without
    loading the CUDA driver (``device`` is not used), for machines without a GPU and for CPU data;
    consumers attach to it as to any channel. ``wait``: how ``acquire`` waits (``spin`` seconds
    of spinning first for ``"spin_then_block"``, 0 to 1e9). ``quota_bytes`` bounds the pool; ``quota`` (``"user"`` or
    ``"group:NAME"``) reserves it from that shared budget (``set_quota``), raising ``OverQuota``
    past it and ``QuotaError`` when none is set. ``group_access`` gives the segment
    mode 0660. Raises ``CudaUnavailable`` without a driver, ``ChannelExists`` when a live producer
    serves ``name``, ``InvalidArgument`` for a bad name or option.
    """

    def __new__(
        cls,
        name: str,
        buffer_bytes: int,
        *,
        buffers: int = 4,
        max_consumers: int = 8,
        quota_bytes: Optional[int] = None,
        quota: Optional[str] = None,
        wait: Wait = "spin_then_block",
        spin: float = 50e-6,
        memory: Literal["auto", "legacy", "vmm", "pool", "host"] = "auto",
        group_access: bool = False,
        device: int = 0,
        stream: Optional[StreamLike] = None,
        ring: bool = False,
    ) -> Producer:
        """``stream``: every write frame's publish is also ordered after the work enqueued on it
        (``WriteFrame.publish_after``); ``InvalidArgument`` on a host channel. ``ring``: hand
        buffers out in ring order (frame ``s`` in buffer ``(s - 1) % buffers``), which
        ``Consumer.post`` needs."""
    @property
    def name(self) -> str: ...
    @property
    def memory(self) -> Literal["legacy", "vmm", "pool", "host"]:
        """The kind of memory of the pool (``"auto"`` resolved)."""
    def acquire(self, timeout: Optional[float] = None) -> WriteFrame:
        """A free buffer to write, waiting up to ``timeout`` seconds (0 to 1e9; ``None``:
        forever). Raises ``Timeout``; ``ChannelClosed`` once closed, also by ``close()`` from
        another thread while this waits (within 50 ms); ``InvalidArgument`` while another
        WriteFrame is outstanding or for a bad ``timeout``. On a pool of one buffer that consumers
        hold, its frame is reserved from the call on (no consumer takes it while this waits) and
        given back when the wait ends without a buffer."""
    def acquire_async(self, timeout: Optional[float] = None) -> Coroutine[Any, Any, WriteFrame]:
        """``acquire`` as a coroutine: awaited, it waits on a thread of the extension's own
        executor (without the GIL; a thread for every wait pending) while the loop runs other
        tasks. Cancelling the awaiting task stops that thread within 50 ms (a buffer taken in
        that instant goes back unpublished at once).
        Raises as ``acquire``; ``RuntimeError`` when awaited outside a running event loop."""
    def try_acquire(self) -> Optional[WriteFrame]:
        """A free buffer if one is free now, else ``None``. ``ChannelClosed`` once closed."""
    def stats(self) -> ChannelStats:
        """The channel's counters (not while a WriteFrame is outstanding; ``ChannelClosed`` once
        closed)."""
    def close(self, timeout: Optional[float] = 5.0) -> Dict[str, int]:
        """Closes the channel (no frame is published after it; consumers get ``ChannelClosed`` once
        they received what was published) and waits up to ``timeout`` seconds (0 to 1e9; ``None``:
        without bound, as every ``timeout=None``) until every ``delivery="every"`` consumer has
        *received* every published frame and no consumer holds one (a ``"latest"`` consumer is
        waited for only while it holds a frame); then forces the holds left and frees the pool.
        Returns ``{"forced_holds": n, "consumers_behind": m}``: ``n`` holds released by force at the
        deadline, ``m`` every-frame consumers that had not received every frame by then (either
        nonzero: the whole timeout was waited). The wait runs in 50 ms slices without the GIL:
        Ctrl-C raises ``KeyboardInterrupt`` within one, leaving the channel closed to new frames but
        its pool not yet freed (call ``close()`` again to finish). Safe from any thread: an
        ``acquire`` blocked in another thread raises ``ChannelClosed`` and this waits for it to end
        (one 50 ms slice) before closing. While a WriteFrame is outstanding it returns at once (both
        counts 0) and the channel closes when that frame is published (which then raises
        ``ChannelClosed``) or abandoned. A second ``close()`` while another thread's close frees the
        channel returns once that one has (within its own ``timeout``; both counts 0)."""
    def __enter__(self) -> Producer: ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None: ...

@final
class WriteFrame:
    """A buffer being written: enqueue the write on ``stream`` (a host frame: ``write`` its bytes),
    then ``publish``. Leaving a ``with`` block (or collection) without publishing gives it back
    unpublished. On a host frame ``ptr``, ``stream``, ``__cuda_array_interface__``,
    ``__dlpack__`` and ``__dlpack_device__`` raise ``NotSupported``."""

    @property
    def index(self) -> int: ...
    @property
    def ptr(self) -> int:
        """Device address of the buffer (``NotSupported`` on a host frame)."""
    @property
    def nbytes(self) -> int: ...
    @property
    def stream(self) -> int:
        """The producer's stream (a raw ``CUstream``; ``NotSupported`` on a host frame)."""
    @property
    def is_host(self) -> bool:
        """Whether the buffer is shared host memory (``memory="host"``)."""
    def write(self, data: BytesLike, offset: int = 0) -> int:
        """Copies ``data`` (bytes, or any object exporting a buffer) into the host buffer at byte
        ``offset``; returns the bytes written. ``InvalidArgument`` past the end or once
        published, and for a buffer of Python objects (format ``O``, a NumPy array of
        ``dtype=object``: its bytes are pointers), ``TypeError`` for what is not bytes-like,
        ``NotSupported`` on a GPU frame."""
    def read(self, offset: int = 0, n: Optional[int] = None) -> bytes:
        """A copy of ``n`` bytes of the host buffer from ``offset`` (``None``: to the end)."""
    def publish_after(self, stream: StreamLike) -> None:
        """Orders the publish after the work enqueued on ``stream`` by the time ``publish`` is
        called (write there, then publish). ``__dlpack__(stream=s)`` (``torch.from_dlpack``,
        ``as_tensor``) notes ``s`` the same way. ``NotSupported`` on a host channel."""
    def as_tensor(self, shape: Optional[Union[int, Tuple[int, ...]]] = None, dtype: Any = None) -> Any:
        """The buffer as a PyTorch tensor (zero-copy, DLPack on PyTorch's current stream, which
        the publish is then ordered after): ``dtype`` (default ``torch.uint8``) and ``shape``
        (default: the whole buffer, one-dimensional) over the first ``prod(shape) * itemsize``
        bytes. ``InvalidArgument`` when they need more bytes than the buffer has."""
    def as_cupy(self, shape: Optional[Union[int, Tuple[int, ...]]] = None, dtype: Any = None) -> Any:
        """The buffer as a CuPy array, as ``as_tensor`` (CuPy's current stream)."""
    def publish(self, metadata: Optional[BytesLike] = None) -> int:
        """Publishes with ``metadata`` (at most META_BYTES; ``bytes`` or any buffer, as
        ``TensorUpdate.commit``'s ``content``; default ``None``: none); returns the sequence
        number. A refused argument (``InvalidArgument`` past META_BYTES or for a buffer of Python
        objects, ``TypeError`` for a ``str``) changes nothing: the frame stays open to publish
        again or abandon. Once the producer was closed, raises ``ChannelClosed`` and gives the
        buffer back unpublished."""
    def abandon(self) -> None: ...
    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]: ...
    def __dlpack__(
        self,
        *,
        stream: Optional[Any] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """A DLPack capsule viewing the buffer (1-D uint8); valid until publish or abandon."""
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    def __enter__(self) -> WriteFrame: ...
    def __exit__(self, *args: Any) -> None: ...

@final
class Consumer:
    """The consuming end of channel ``name``, attached on the device that holds its pool.

    ``delivery``: ``"every"`` (every frame in order; the producer waits for this consumer) or
    ``"latest"`` (the newest only; skipped frames counted as dropped). Raises ``ChannelNotFound``,
    ``BadSegment``, ``NoConsumerSlot``, ``ProducerGone``, ``InvalidArgument``, ``CudaUnavailable``.
    Iterating yields frames until the channel closes.
    """

    def __new__(
        cls,
        name: str,
        *,
        delivery: Literal["every", "latest"] = "every",
        wait: Wait = "spin_then_block",
        spin: float = 50e-6,
        group_access: bool = False,
        stream: Optional[StreamLike] = None,
    ) -> Consumer:
        """``stream``: every frame received is made ready on it and its release ordered after it
        (``Frame.ready_on``); ``InvalidArgument`` on a host channel."""
    @classmethod
    def attach(
        cls,
        name: str,
        *,
        delivery: Literal["every", "latest"] = "every",
        wait: Wait = "spin_then_block",
        spin: float = 50e-6,
        group_access: bool = False,
        stream: Optional[StreamLike] = None,
    ) -> Consumer:
        """The same as ``Consumer(name, ...)``."""
    @property
    def name(self) -> str: ...
    @property
    def is_host(self) -> bool:
        """Whether the channel's pool is shared host memory (``memory="host"``)."""
    @property
    def stream(self) -> int:
        """The consumer's stream (a raw ``CUstream``): frames are ready on it. ``NotSupported``
        on a host channel."""
    def recv(self, timeout: Optional[float] = None) -> Frame:
        """The next frame, waiting up to ``timeout`` seconds (0 to 1e9; ``None``: forever).
        Raises ``Timeout``, ``ChannelClosed``, ``ProducerGone``, ``Detached``, ``Superseded``;
        ``KeyboardInterrupt`` on Ctrl-C, with no frame taken; ``InvalidArgument`` for a bad
        ``timeout``. ``close()`` from another thread makes it raise ``Detached`` within 50 ms; a
        closed consumer never returns a frame (a ``recv`` racing ``close`` returns only a frame it
        took before the close)."""
    def recv_async(self, timeout: Optional[float] = None) -> Coroutine[Any, Any, Frame]:
        """``recv`` as a coroutine: awaited, it waits on a thread of the extension's own
        executor (without the GIL; a thread for every wait pending) while the loop runs other
        tasks. Cancelling the awaiting task
        (``asyncio.wait_for``, ``Task.cancel``) stops that thread within 50 ms; a frame taken in
        that instant is kept, in order, for this consumer's next receive. Raises as ``recv``; ``RuntimeError`` when awaited outside
        a running event loop."""
    def post(self, work: Optional[Callable[[Posted], Any]] = None) -> Posted:
        """Posts the receive of the next frame ahead of its publication (GPU channels made with
        ``ring=True``, every-frame delivery): this consumer's stream waits on the GPU for the
        frame (``cuStreamWaitValue32``); ``work(posted)`` enqueues what reads it on
        ``posted.stream`` from ``posted.ptr``; the release follows on the stream. Returns at
        once; ``Posted.wait`` takes the frame on the host later, in order. ``InvalidArgument`` on
        a host channel, a channel not in ring order, a latest-only consumer, or more than 2**20
        frames ahead; what ``work`` raised; ``CudaError``; ``Detached`` once closed."""
    def try_recv(self) -> Optional[Frame]:
        """The next frame if one is ready now, else ``None``; ``Detached`` once closed."""
    def stats(self) -> ChannelStats: ...
    def close(self) -> None:
        """Detaches (once frames and DLPack tensors still alive are gone). Safe from any thread: a
        ``recv`` (or iteration) blocked in another thread raises ``Detached`` within 50 ms; this
        never waits for it. Frames received before stay valid until released."""
    def __iter__(self) -> Iterator[Frame]: ...
    def __next__(self) -> Frame: ...
    def __enter__(self) -> Consumer: ...
    def __exit__(self, *args: Any) -> None: ...

@final
class Posted:
    """A receive posted ahead (``Consumer.post``): the consumer's stream waits on the GPU for frame
    ``seq``, which will be in buffer ``index`` at ``ptr``. Dropping it without waiting leaves the
    frame to the next ``wait`` or ``recv``."""

    @property
    def seq(self) -> int: ...
    @property
    def index(self) -> int:
        """``(seq - 1) % buffers``."""
    @property
    def ptr(self) -> int:
        """Device address of the buffer that will hold the frame."""
    @property
    def nbytes(self) -> int: ...
    @property
    def stream(self) -> int:
        """The consumer's stream (a raw ``CUstream``), where work that reads the frame goes."""
    @property
    def gate_ptr(self) -> int:
        """Device address of the gate words, which tell work whether the frame came."""
    def wait(self, timeout: Optional[float] = None) -> PostedFrame:
        """Takes the frame on the host once published, waiting up to ``timeout`` seconds
        (``None``: forever). Raises ``Timeout`` (it can be waited for again), ``ProducerGone``,
        ``ChannelClosed``, ``Detached``; ``InvalidArgument`` when ``recv`` took it first or it
        was waited for already."""
    def wait_async(self, timeout: Optional[float] = None) -> Coroutine[Any, Any, PostedFrame]:
        """``wait`` as a coroutine (on a thread of the extension's own executor; cancellation stops the
        wait within 50 ms and leaves the frame to a later wait, even one that came in those
        50 ms)."""

@final
class PostedFrame:
    """A posted frame taken on the host (``Posted.wait``)."""

    @property
    def seq(self) -> int: ...
    @property
    def index(self) -> int: ...
    @property
    def metadata(self) -> bytes: ...

@final
class Frame:
    """A received frame, ready on ``stream``. ``release()``, a ``with`` block or collection ends
    this object's hold; DLPack tensors made from it keep the frame held until they are freed.

    A host frame (``is_host``) is read by copy: ``bytes()``, ``bytes(frame)``, ``read(offset, n)``,
    while it is held; there is no buffer protocol (the producer rewrites the memory once the frame
    is released, and a view could outlive that). Its ``ptr``, ``stream``,
    ``__cuda_array_interface__``, ``__dlpack__`` and ``__dlpack_device__`` raise ``NotSupported``."""

    @property
    def seq(self) -> int: ...
    @property
    def index(self) -> int: ...
    @property
    def metadata(self) -> builtins.bytes: ...
    @property
    def ptr(self) -> int:
        """Device address of the buffer in this process (``NotSupported`` on a host frame)."""
    @property
    def nbytes(self) -> int: ...
    @property
    def stream(self) -> int:
        """The consumer's stream the frame is ready on (``NotSupported`` on a host frame)."""
    @property
    def is_host(self) -> bool:
        """Whether the buffer is shared host memory (``memory="host"``)."""
    @property
    def held(self) -> bool: ...
    def release(self) -> None:
        """Ends this object's hold, ordered after the work enqueued by now on every stream named
        by ``ready_on`` or the consumer's ``stream``; a second call does nothing."""
    def ready_on(self, stream: StreamLike) -> None:
        """Makes ``stream`` wait on the GPU for this frame and orders the release after the work
        enqueued there by the time of ``release()``. ``NotSupported`` on a host channel."""
    def as_tensor(self, shape: Optional[Union[int, Tuple[int, ...]]] = None, dtype: Any = None) -> Any:
        """The buffer as a PyTorch tensor (zero-copy, DLPack on PyTorch's current stream; the
        tensor holds the frame until freed, and the release is ordered after that stream):
        ``dtype`` (default ``torch.uint8``) and ``shape`` (default: the whole buffer) over the
        first ``prod(shape) * itemsize`` bytes. ``InvalidArgument`` when they need more bytes
        than the buffer has; ``ImportError`` without PyTorch."""
    def as_cupy(self, shape: Optional[Union[int, Tuple[int, ...]]] = None, dtype: Any = None) -> Any:
        """The buffer as a CuPy array, as ``as_tensor`` (CuPy's current stream)."""
    def read(self, offset: int = 0, n: Optional[int] = None) -> builtins.bytes:
        """A copy of ``n`` bytes of the host buffer from ``offset`` (``None``: to the end).
        ``InvalidArgument`` past the end or once released; ``NotSupported`` on a GPU frame."""
    def bytes(self) -> builtins.bytes:
        """A copy of the whole host buffer (the same as ``read()`` and ``bytes(frame)``)."""
    def __bytes__(self) -> builtins.bytes: ...
    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        """Version 3, 1-D uint8, with ``stream``; the view does not hold the frame."""
    def __dlpack__(
        self,
        *,
        stream: Optional[Any] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """A DLPack capsule (1-D uint8) that holds the frame until the tensor is freed;
        ``stream`` is made to wait for the frame on the GPU, and when the tensor is freed the
        release is ordered after the work enqueued on ``stream`` by then (``-1``: no ordering
        either way). ``stream`` must outlive the tensor."""
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    def __enter__(self) -> Frame: ...
    def __exit__(self, *args: Any) -> None: ...

TensorSpecs = Dict[str, Any]
"""Name -> ``torch.Tensor`` (its shape and dtype are taken) or name -> ``(shape, dtype)`` with a
``torch.dtype`` or its name (``"bfloat16"``, ``"float8_e4m3fn"``)."""

@final
class TensorSetWriter:
    """The writing end of tensor set ``name``: one allocation per buffer on device ``device``
    (``memory``: ``"vmm"`` default, ``"auto"``, ``"pool"``, ``"legacy"``, ``"host"``), ``mode``
    ``"in_place"`` (one buffer) or ``"buffered"`` (``buffers`` of them, 2 to 16; default 2).
    ``buffers`` is for ``"buffered"`` only: given with ``"in_place"`` it is an
    ``InvalidArgument``. Nothing is published before the first commit. Raises ``ChannelExists``
    when a live writer has the name, ``InvalidArgument`` for bad specs (a dimension that is not
    an int, or a ``bool``; ``NotSupported`` for a PyTorch dtype a set cannot hold, such as
    ``torch.quint8``), ``OverQuota``, ``CudaError``."""

    def __new__(
        cls,
        name: str,
        tensors: TensorSpecs,
        *,
        device: int = 0,
        memory: str = "vmm",
        mode: str = "in_place",
        buffers: Optional[int] = None,
        max_readers: int = 64,
        quota: Optional[str] = None,
    ) -> TensorSetWriter: ...
    @staticmethod
    def over_tensors(
        name: str, tensors: Dict[str, Any], *, device: int = 0, max_readers: int = 64
    ) -> "TensorSetWriter":
        """Publishes tensors living in ``torch_mem_pool`` memory without a copy (in place;
        generation 1 committed at once; ``torch.cuda.memory_allocated()`` does not move). Each
        tensor keeps its strides and place: tied keys stay at one address for readers, a
        transposed view stays a view; tensors with no elements need no memory and are taken.
        The pool's memory is VMM, so readers map it read-only. ``InvalidArgument`` for a value
        that is not a tensor, a tensor with bytes allocated elsewhere (a CPU tensor, PyTorch's own
        allocator) or on another device, and a dict with no bytes in the pool."""
    def begin(self, timeout: Optional[float] = None, *, stream: StreamLike = None) -> "TensorUpdate":
        """The next generation's buffer, waiting while readers hold it (in place, no new hold is
        taken meanwhile, across the 50 ms slices it waits in: readers asking wait for the commit; a
        timeout, ``KeyboardInterrupt`` or ``close()`` gives the generation back; buffered, the
        oldest buffer no reader holds, never the newest generation's, which readers keep taking);
        a context manager that commits at the end of the block (aborts on an exception). ``TensorSetClosed`` once the
        writer is closed, also by ``close()`` from another thread while this waits (within 50 ms)
        or while the update is open (the update's calls and the block's end raise it then:
        nothing was published). A host set has no stream: ``stream`` other than ``None`` raises
        ``InvalidArgument`` before a buffer is taken. One ``begin()`` may be open or waiting at a
        time: another ``begin()`` or ``publish()`` meanwhile, from any thread, raises
        ``InvalidArgument`` at once, without waiting (try again after its commit or abort)."""
    def publish(
        self,
        tensors: Union[Dict[str, Any], "CopyPlan"],
        timeout: Optional[float] = None,
        *,
        stream: StreamLike = None,
        fingerprint: bool = False,
    ) -> int:
        """``begin``, ``copy_from(tensors)``, commit (``fingerprint=True``: with the fingerprint
        of the bytes); the generation. ``tensors`` may be a ``CopyPlan`` of this writer.
        ``timeout``, the kind of ``tensors`` (a dict or a ``CopyPlan`` of this writer), PyTorch's
        import, the names and that every value is a tensor are checked before a buffer is taken,
        so such a refusal changes nothing; a source refused by the copy itself (dtype, shape,
        device) aborts the update (an in-place set's generation is gone then)."""
    def copy_plan(self, tensors: Dict[str, Any]) -> "CopyPlan":
        """GPU sets: the sources of later updates read once (contiguous CUDA tensors of the
        set's device; the driver checks their memory at the plan's first update);
        ``copy_from(plan)`` then reads only their ``data_ptr()``s, 320 at a time, each chunk
        copied once its pointers are read, and refuses the update (open and uncommitted) if any
        moved since, before that source's chunk is copied. The plan keeps the tensors and their storages alive. Make it from the
        parameters themselves (``model.state_dict(keep_vars=True)``): ``state_dict()``'s detached
        aliases keep a parameter's old storage when it gets a new one."""
    @property
    def generation(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def layout_fingerprint(self) -> bytes:
        """32 bytes: SHA-256 over the tensors' names, dtypes, shapes, strides, allocation
        indices and byte offsets, in the set's order (not the memory kind, the mode or
        ``max_readers``); give it to readers' ``expect_layout``."""
    @property
    def names(self) -> List[str]:
        """The tensors' names in the set's order (the order of ``tensors()``' keys)."""
    @property
    def nbytes(self) -> int:
        """Bytes of one buffer: every tensor, with its alignment."""
    def synchronize(self) -> None:
        """Waits on the host (without the GIL) until the writer's stream drained: its copies
        and ready words (at once for a host set). ``TensorSetClosed`` once closed;
        ``InvalidArgument`` while an update of a GPU set is open."""
    def wait_readers(self, timeout: Optional[float] = None) -> bool:
        """Waits up to ``timeout`` seconds (``None``: no bound) until every reader has taken the
        newest generation (each reader attached when it was committed has held it, or a later
        one; readers that open the set later start at it); returns whether they all have. Call
        it before ``close()`` so that readers waiting in ``wait_newer`` get the last generation
        (the close takes every generation from readers as it begins). A dead reader holds
        nothing up; a live one that never asks keeps the wait until ``timeout``. Waits without
        the GIL in 50 ms slices. ``TensorSetClosed`` once closed; ``InvalidArgument`` while an
        update is open or another thread waits in ``begin()``."""
    def close(self, timeout: Optional[float] = 5.0) -> None:
        """Closes the set. From its start no hold is granted: readers' ``current()``,
        ``wait_newer()`` and ``wait_newer_async()`` raise ``TensorSetClosed``, also in readers that
        ask again and again (a generation a reader took before, whose awaited wait was cancelled,
        still goes to that reader's next call: that hold was taken before); then it waits up to
        ``timeout`` seconds (default 5, 0 to 1e9; ``None``: without bound, as every
        ``timeout=None``) only for the holds taken before, returning as soon as they end (holds left
        at the timeout are forced); an open update is aborted. The wait runs in 50 ms slices without
        the GIL: Ctrl-C raises ``KeyboardInterrupt`` within one, leaving the set closed (names gone,
        ``begin`` refused) but its memory not yet freed (call ``close()`` again to finish). Safe
        from any thread: a ``begin`` waiting in another thread raises ``TensorSetClosed`` within 50
        ms and this waits for it to end first. Closing twice does nothing, but a second ``close()``
        while another thread's close frees the set returns once that one has (within its own
        ``timeout``); ``begin``, ``publish`` and ``synchronize`` raise ``TensorSetClosed`` after
        it."""
    def __enter__(self) -> "TensorSetWriter": ...
    def __exit__(self, *args: Any) -> None: ...

@final
class CopyPlan:
    """A GPU tensor set's update sources read and checked once (``TensorSetWriter.copy_plan``)."""
    def __len__(self) -> int:
        """The number of source tensors."""
    @property
    def ranges(self) -> int:
        """The number of copies an update makes (back-to-back sources merged)."""

@final
class TensorUpdate:
    """A generation being written (from ``TensorSetWriter.begin``). Once committed or aborted
    (also by the writer's ``close()``), ``generation`` and ``buffer`` still answer, as a released
    ``TensorHold``'s do; every other call raises (``InvalidArgument``, or ``TensorSetClosed`` once
    the writer closed it), but ``abort()``, which does nothing."""

    @property
    def generation(self) -> int:
        """The generation this update publishes (what ``commit()`` returns); after the commit,
        the generation it published; after an abort, the one it would have published (the
        writer's next update takes that number)."""
    @property
    def buffer(self) -> int:
        """The buffer being written (after the update's end, the buffer it wrote)."""
    def tensors(self) -> Dict[str, Any]:
        """Writable ``torch.Tensor`` views of this buffer (CPU tensors for a host set). Needs
        PyTorch: without it ``ImportError`` (a host set is written with ``write(name, data)``)."""
    def copy_from(self, tensors: Union[Dict[str, Any], "CopyPlan"]) -> None:
        """Copies CUDA tensors (CPU tensors for a host set) into the set's tensors of the same
        names, each of the set's dtype and shape (``InvalidArgument`` otherwise, as
        ``load_state_dict`` refuses a size mismatch; ``InvalidArgument`` naming a key the set
        lacks), on the writer's stream; read and copied in chunks (64 tensors first, up to
        512). Many small sources on the set's device are copied by one kernel launch per 160 (one
        ``cuMemcpyDtoDAsync`` each costs about 5 µs of GPU time); a CPU tensor given to a GPU set
        is refused before anything of its chunk is copied, and so are a tensor of another device
        and one whose storage was freed (``data_ptr()`` 0); memory the driver does not know as
        readable memory of the set's device is refused before the copy kernel reads it. A
        ``CopyPlan`` of this writer copies its sources without reading them again."""
    def copy_from_previous(self) -> None: ...
    def write(self, name: str, data: BytesLike) -> None:
        """Host sets: writes ``data`` (bytes, or any object exporting a buffer) over the first
        ``len(data)`` bytes of tensor ``name``, as they are, never converted: plain bytes
        (``bytes``, ``bytearray``, ``memoryview(a).cast("B")``) into a tensor of any dtype, any
        other buffer only when its items are of the tensor's element size (an ``int32`` array
        into a ``float32`` tensor is copied bit for bit). ``InvalidArgument`` for items of
        another size (a ``float64`` array into a ``float32`` tensor: convert it first) and for a
        buffer of Python objects (a NumPy array of ``dtype=object``)."""
    def fingerprint(self) -> bytes:
        """The content fingerprint of the update's bytes as its work so far leaves them (32
        bytes): commit with it (``commit(content=fp)``) and give it to readers
        (``expect_content``)."""
    def tensor_digests(self) -> List[bytes]:
        """The content digest of each tensor as the work so far leaves it (16 bytes each)."""
    def commit(self, content: Optional[BytesLike] = None, fingerprint: bool = False) -> int:
        """Publishes the generation; ``fingerprint=True`` commits the fingerprint of its bytes,
        computed where they lie (a kernel on a GPU set), which readers check with
        ``TensorHold.verify_content()``; ``content``: a 32-byte fingerprint of your own
        (``bytes`` or any buffer, as ``WriteFrame.publish``'s metadata)."""
    def abort(self) -> None:
        """Gives the buffer back uncommitted; in place, no generation is readable until the next
        commit (its bytes may be half-written)."""
    def __enter__(self) -> "TensorUpdate": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]] = None,
        _exc: Optional[BaseException] = None,
        _tb: Optional[TracebackType] = None,
    ) -> bool: ...

@final
class TensorSetReader:
    """The reading end of tensor set ``name``: every allocation mapped once (read-only for VMM
    with ``read_only=True``). Raises ``TensorSetNotFound``, ``LayoutMismatch`` (``expect_layout``),
    ``BadSegment``, ``WriterGone``, ``NoServer`` (writer dead, no live holder), ``NoConsumerSlot``,
    ``FdPassingError``, ``CudaError``. Opened after the writer's death, a held VMM set is read
    writerless (``writerless``). ``serve=True`` (VMM sets, else ``NotHoldable``; ``NoHolderSlot``):
    serve the set's fds to later readers as a ``TensorSetHolder`` does. ``stable_addresses=True``
    (VMM sets, else ``NotSupported``): addresses kept for the reader's life (``switch_stable``).
    After ``close()`` every call but ``name`` and ``close`` raises ``TensorSetClosed`` naming this
    reader (a wait in another thread within 50 ms); holds taken before stay readable. ``device``
    (default: the device that holds the set) is not used for a host set, which opens without a
    GPU whatever it says."""

    def __new__(
        cls,
        name: str,
        *,
        device: Optional[int] = None,
        expect_layout: Optional[BytesLike] = None,
        read_only: bool = True,
        wait: Wait = "spin_then_block",
        spin: float = ...,  # 50e-6 seconds
        serve: bool = False,
        stable_addresses: bool = False,
        expect_content: Optional[BytesLike] = None,
    ) -> TensorSetReader: ...
    def current(self, timeout: Optional[float] = ...) -> Optional["TensorHold"]:
        """The newest generation (even one taken before); waits up to ``timeout`` seconds for a
        first (default 0: returns at once; checked whether or not a generation is there). ``TensorSetClosed`` once this reader is closed (also
        from another thread while this waits) or the writer closed the set. In place, while the
        writer's ``begin()`` waits, the generation is reserved: ``None`` (or a wait for the commit),
        also for a reader that holds it already, whose hold that ``begin()`` waits for. A
        generation a cancelled ``wait_newer_async`` kept counts: the newer of it and the one
        published now is returned, the other released (see ``wait_newer_async``). After the
        writer's death the last generation published is still returned (its memory stays
        mapped); ``writer_alive`` says whether a newer one can come."""
    def wait_newer(self, than: int, timeout: Optional[float] = None) -> "TensorHold":
        """Waits for a generation newer than ``than`` and holds it. Raises ``Timeout``,
        ``WriterGone``, ``TensorSetClosed`` (the writer closed the set, or this reader is closed,
        also by ``close()`` from another thread while this waits: within 50 ms). A generation a
        cancelled ``wait_newer_async`` kept that is newer than ``than`` is returned first, at once
        (see ``wait_newer_async``)."""
    async def wait_newer_async(self, than: int, timeout: Optional[float] = None) -> "TensorHold":
        """``wait_newer`` as a coroutine: the wait runs on a thread of the extension's own executor;
        cancelling the task stops it within 50 ms. A generation the wait took in the instant its
        task was cancelled (or that the cancelled task never resumed to return) is not released
        but kept, held, on this reader for its next call: ``wait_newer(than)`` or
        ``wait_newer_async(than)`` returns it at once when it is newer than ``than`` (oldest
        first) and releases it when not; ``current()`` returns the newer of it and the generation
        published now, releasing the other. So ``publish(final); wait_readers(); close()`` still
        delivers ``final`` to a reader that retries after a cancelled wait. A kept generation
        older than one this reader already returned is released, never returned (no caller sees
        g + 1 and then g). The reader's awaited waits return generations in the order they took
        them (while one waits for its task to resume, the others wait for it; a blocking
        ``wait_newer`` in another thread does not). ``close()`` releases what is kept."""
    @property
    def name(self) -> str: ...
    @property
    def imports(self) -> int:
        """Driver imports this open made: one per allocation per buffer for a first open in the
        process, 0 for allocations this process had imported already."""
    @property
    def read_only(self) -> bool: ...
    @property
    def layout_fingerprint(self) -> bytes: ...
    @property
    def names(self) -> List[str]: ...
    @property
    def incarnation(self) -> int:
        """Which creation of the set this reader maps (64 random bits, nonzero): a replaced
        writer's set has another, and its generations start from 1 again."""
    @property
    def writerless(self) -> bool:
        """Opened after the writer's death: reads the last whole generation, no newer comes."""
    @property
    def writer_alive(self) -> bool:
        """Whether this reader's writer is alive, asked now: ``False`` once it closed the set or
        died (a writer made again under the name is another: open the set again to read it), and
        for a writerless reader. ``current()`` goes on returning the last generation published
        after the writer is gone; a reader that only polls ``current()`` learns here that no
        newer one comes."""
    def open_timings(self) -> Dict[str, float]:
        """Microseconds per phase of the open: ``manifest``, ``tables``, ``fingerprint``,
        ``fd_fetch`` (of it ``fd_peer``, ``fd_connect``, ``fd_reply``), ``map``, ``join``,
        ``join_gpu``, ``join_wait``, ``spawn``, ``finish``, ``total``."""
    def switch_stable(self, hold: "TensorHold") -> Dict[str, Any]:
        """Maps ``hold``'s generation at the stable addresses and consumes ``hold`` (the reader
        keeps it held until the next switch or ``release_stable``); may wait for the whole
        context (``cuCtxSynchronize``). Returns ``{"generation": int, "remapped": bool,
        "micros": int, "remap_micros": int}``. Raises ``TensorSetClosed`` (a closed reader) and
        ``InvalidArgument`` for another reader's hold, leaving ``hold`` as it was; then
        ``InvalidArgument`` (no ``stable_addresses``, a released hold, a writerless reader),
        ``CudaError``, releasing ``hold``."""
    def stable_tensors(self) -> Dict[str, Any]:
        """A new ``dict[str, torch.Tensor]`` over the stable addresses: the same tensor objects
        for the reader's life (CUDA graphs captured over them stay valid across switches)."""
    @property
    def stable_generation(self) -> Optional[int]:
        """The generation at the stable addresses; ``None`` before the first switch."""
    def release_stable(self) -> bool:
        """Lets the stable generation go (``cuCtxSynchronize`` first); ``False`` if none was."""
    def close(self) -> None:
        """Leaves the set once no hold and no tensor of it is left; afterwards its calls raise
        ``TensorSetClosed``. Generations kept for the next call (a cancelled
        ``wait_newer_async``'s) are released. Closing twice does nothing."""
    def __enter__(self) -> "TensorSetReader": ...
    def __exit__(self, *args: Any) -> None: ...

@final
class TensorHold:
    """A held generation: released by ``release()``, the end of a ``with`` block, or collection.
    It keeps its reader's mappings: readable after the reader's ``close()`` until released."""

    @property
    def generation(self) -> int: ...
    @property
    def buffer(self) -> int: ...
    @property
    def content(self) -> bytes: ...
    @property
    def whole(self) -> Optional[bool]:
        """``True`` once the writer's stream finished this generation; ``None`` while it works on
        it; ``False`` when the writer died first (the bytes may be partial)."""
    @property
    def held(self) -> bool: ...
    def tensors(self, *, stream: StreamLike = None) -> Dict[str, Any]:
        """A new ``dict[str, torch.Tensor]`` of views of the mapped memory (CPU tensors for a host
        set, not read-only: treat them as read-only; a ``stream`` other than ``None`` raises
        ``InvalidArgument`` there). Needs PyTorch: without it ``ImportError`` (a host set's bytes
        are read with ``read(name)``). A tensor that starts at a byte offset that is not a
        multiple of its element size (a set laid out over given allocations) raises
        ``NotSupported`` naming it."""
    def read(self, name: str) -> bytes:
        """Host sets: a copy of tensor ``name``'s bytes."""
    def tensor_digests(self) -> List[bytes]:
        """The content digest of each tensor (16 bytes each, in the set's order)."""
    def fingerprint(self) -> bytes:
        """The content fingerprint of this generation's bytes (32 bytes), computed here."""
    def verify_content(self) -> None:
        """Raises ``ContentMismatch`` unless the bytes have the fingerprint the writer
        committed."""
    def release(self) -> None: ...
    def __enter__(self) -> "TensorHold": ...
    def __exit__(self, *args: Any) -> None: ...

HolderStatus = Literal["serving", "closed", "replaced", "damaged", "released"]

@final
class TensorSetHolder:
    """Keeps VMM tensor set ``name`` attachable after its writer dies: holds and serves a file
    descriptor of every allocation (no CUDA context; the fds pin ``bytes`` of device memory until
    ``close()``). Raises ``TensorSetNotFound``, ``NotHoldable``, ``NoServer``, ``NoHolderSlot``,
    ``BadSegment``, ``OsError``. After ``close()``, ``allocations``, ``bytes`` and ``source_pid``
    raise ``TensorSetClosed`` naming this holder; ``status`` and ``wait`` say ``"released"`` (not
    ``"closed"``, which says the writer closed the set)."""

    def __new__(cls, name: str) -> TensorSetHolder: ...
    @property
    def name(self) -> str: ...
    @property
    def allocations(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def source_pid(self) -> int: ...
    @property
    def status(self) -> HolderStatus:
        """``"serving"``, ``"closed"`` (by its writer), ``"replaced"`` (another set under the
        name), ``"damaged"`` (its holders segment was cut short under it) or ``"released"``
        (this holder's own ``close()``)."""
    def wait(self, timeout: Optional[float] = None) -> HolderStatus:
        """Waits (at most ``timeout`` seconds; ``None``: no bound) until ``status`` is not
        ``"serving"``; returns the status last seen (``"released"`` at once after ``close()``,
        also from another thread)."""
    def close(self) -> None:
        """Lets go of the slot and the fds. Closing twice does nothing."""
    def __enter__(self) -> "TensorSetHolder": ...
    def __exit__(self, *args: Any) -> None: ...
