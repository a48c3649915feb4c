"""A consumer process driven line by line over stdin, for the Rust test tests/python_consumer.rs.

It uses cuda_ipc_consumer as any program would, in its protocol-only mode (``cuda=False``: the
same code path without the CUDA calls) unless ``gpu`` is given, and answers each command with one
line starting ``@@ ``:

    attach NAME every|latest [gpu] -> @@ attached SLOT PID
    recv TIMEOUT_S                -> @@ frame SEQ INDEX METAHEX | @@ timeout SECONDS
    try_recv                      -> @@ frame ... | @@ none
    release SEQ                   -> @@ released SEQ
    check N TIMEOUT_S             -> receives N frames, checks each one's metadata against
                                     expected_metadata(seq) and that seq goes up by one, releases
                                     each, then: @@ checked N LAST_SEQ
    until_closed TIMEOUT_S        -> receives until the channel closes, checking each frame's
                                     metadata and that seq goes up, releasing each, then:
                                     @@ received COUNT LAST_SEQ
    stats                         -> @@ stats RECEIVED DROPPED IN_FLIGHT LAG
    drain TIMEOUT_S               -> polls the stream of the last frame received (cuStreamQuery)
                                     until it is idle: @@ drained SECONDS | @@ wedged (gpu only)
    ready                         -> @@ ready WORD0 WORD1 ... (each buffer's ready word, as this
                                     module reads it from the segment's ready page)
    verify N TIMEOUT_S            -> (gpu) receives N frames, checks every 32-bit word of each
                                     on the GPU against the kernels' pattern, seeded by the first
                                     u64 of the metadata (PyTorch, else CuPy), and that seq goes
                                     up by one: @@ verified COUNT MISMATCHED_WORDS KIND
    fetch PID START TIMEOUT_S ID...
                                  -> fetches fds of exporter (PID, START, this boot) by export id
                                     (cuda_ipc_consumer.fetch_fds), reads each one's content from
                                     offset 0 and closes it: @@ fetched CONTENT... ("self" as
                                     PID: this process)
    fetch_ns PID START NS TIMEOUT_S ID...
                                  -> the same for an exporter of pid namespace NS
    serve N                       -> serves N memfds (contents "py-memfd-K", export ids K + 1) on
                                     this process's fd server socket, as the Rust exporter does
                                     (the socket file at cuda_ipc_consumer._fd_socket_path, mode
                                     0600): @@ serving PID START NS
    nfds                          -> @@ nfds N (entries of /proc/self/fd)
    whoami                        -> @@ me PID START_TIME PID_NS (this process's identity, as
                                     its liveness file and consumer slot name it)
    close                         -> @@ detached
    exit                          -> the process exits 0
Any exception becomes ``@@ error CLASS MESSAGE`` (``@@ gone PID`` for ProducerGone, ``@@ closed``
for ChannelClosed), and the process goes on reading commands.
"""

import atexit
import ctypes
import os
import struct
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuda_ipc_consumer as cic  # noqa: E402


def expected_metadata(seq: int) -> bytes:
    """The metadata the Rust test publishes with frame ``seq``: 0 to 256 bytes."""
    n = (seq * 37) % 257
    return bytes((seq * 13 + k) & 0xFF for k in range(n))


def say(*words) -> None:
    print("@@", *words, flush=True)


def stream_idle_within(rx, stream: int, timeout: float):
    """Seconds until ``stream`` had no work left, or None if it still had after ``timeout``."""
    d = rx._gpu.d
    t0 = time.monotonic()
    with rx._gpu.bound():
        while time.monotonic() - t0 < timeout:
            rc = d.lib.cuStreamQuery(ctypes.c_void_p(stream))
            if rc == 0:
                return time.monotonic() - t0
            if rc != 600:  # CUDA_ERROR_NOT_READY
                d.check("cuStreamQuery", rc)
            time.sleep(0.005)
    return None


def open_fds() -> int:
    """Entries of /proc/self/fd, less the one listing it."""
    return len(os.listdir("/proc/self/fd")) - 1


def fd_content(fd: int) -> str:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0).decode()


def fetch(cmd) -> list:
    """``fetch PID START TIMEOUT ID...`` or ``fetch_ns PID START NS TIMEOUT ID...``."""
    ns = cic._own_pid_ns()
    if cmd[0] == "fetch_ns":
        ns = int(cmd[3])
        cmd = cmd[:3] + cmd[4:]
    if cmd[1] == "self":
        exporter = cic.ProcessIdentity.current()
    else:
        exporter = cic.ProcessIdentity(int(cmd[1]), int(cmd[2]), cic._boot_id(), ns)
    fds = cic.fetch_fds(exporter, [int(i) for i in cmd[4:]], timeout=float(cmd[3]))
    try:
        return [fd_content(fd) for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)


def serve_fds(n: int) -> cic.ProcessIdentity:
    """A test stand-in for the Rust exporter's fd server (src/ipc/fdpass.rs), so the client's
    filesystem-socket path is tested end to end: the socket at ``_fd_socket_path`` (mode 0600),
    one request per connection, ids 1..=N answered with their memfds (SCM_RIGHTS), others with an
    error status. No uid check: the tests run as one user."""
    import array
    import socket
    import threading

    me = cic.ProcessIdentity.current()
    path = cic._fd_socket_path(me)
    fds = {}
    for k in range(n):
        fd = os.memfd_create(f"py-memfd-{k}", os.MFD_CLOEXEC)
        os.pwrite(fd, f"py-memfd-{k}".encode(), 0)
        fds[k + 1] = fd
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        srv.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    srv.listen(16)

    def serve() -> None:
        while True:
            conn, _ = srv.accept()
            with conn:
                data = conn.recv(8 + 4 * cic._FD_MAX_IDS)
                magic, version, count = cic._FD_REQUEST_HEADER.unpack_from(data)
                ids = struct.unpack_from(f"<{count}I", data, cic._FD_REQUEST_HEADER.size)
                entries = [(i, 0 if i in fds else 1) for i in ids]
                reply = cic._FD_REPLY_HEADER.pack(cic._FD_REPLY_MAGIC, 1, 0, len(entries))
                reply += b"".join(cic._FD_REPLY_ENTRY.pack(*e) for e in entries)
                ok = array.array("i", [fds[i] for i in ids if i in fds])
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, ok.tobytes())] if ok else []
                conn.sendmsg([reply], anc)

    threading.Thread(target=serve, daemon=True).start()
    atexit.register(lambda: os.unlink(path))
    return me


def verify(rx, n: int, timeout: float) -> tuple:
    """Checks ``n`` frames on the GPU (see the module docstring): (count, mismatched words)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    import torch_consumer as tc

    words = rx.buffer_bytes // 4
    try:
        import torch

        checker = tc.TorchCheck(torch.device("cuda", rx.device_ordinal), words)
    except ImportError:
        checker = tc.CupyCheck(rx.device_ordinal, words)
    checker.self_test()
    count, last = 0, None
    for _ in range(n):
        with rx.recv(timeout=timeout) as f:
            if last is not None and f.seq != last + 1:
                raise AssertionError(f"frame {f.seq} after {last}")
            if f.ptr is None or f.nbytes != rx.buffer_bytes:
                raise AssertionError(f"frame {f.seq}: ptr {f.ptr}, {f.nbytes} bytes")
            seed = int.from_bytes(f.metadata[:8], "little")
            checker.check(f, seed & 0xFFFFFFFF)  # on the frame's stream, released after it
            last = f.seq
            count += 1
    return count, checker.mismatches()


def main() -> int:
    # Take this process's identity (and its liveness lock, one fd held for the life of the
    # process) first, as any consumer does at attach: fd counts compare like with like.
    cic.ProcessIdentity.current()
    rx = None
    frames = {}
    last_stream = None
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        try:
            op = cmd[0]
            if op == "attach":
                gpu = cmd[3:] == ["gpu"]
                rx = cic.Consumer.attach(cmd[1], delivery=cmd[2], cuda=gpu)
                say("attached", rx.slot, os.getpid())
            elif op == "recv":
                t0 = time.monotonic()
                try:
                    f = rx.recv(timeout=float(cmd[1]))
                except cic.Timeout:
                    say("timeout", f"{time.monotonic() - t0:.3f}")
                    continue
                frames[f.seq] = f
                last_stream = f.stream
                say("frame", f.seq, f.index, f.metadata.hex() or "-")
            elif op == "try_recv":
                f = rx.try_recv()
                if f is None:
                    say("none")
                else:
                    frames[f.seq] = f
                    say("frame", f.seq, f.index, f.metadata.hex() or "-")
            elif op == "release":
                frames.pop(int(cmd[1])).release()
                say("released", cmd[1])
            elif op == "check":
                n, timeout = int(cmd[1]), float(cmd[2])
                last = None
                for _ in range(n):
                    with rx.recv(timeout=timeout) as f:
                        if last is not None and f.seq != last + 1:
                            raise AssertionError(f"frame {f.seq} after {last}")
                        if f.metadata != expected_metadata(f.seq):
                            raise AssertionError(
                                f"frame {f.seq}: metadata {f.metadata.hex()} != "
                                f"{expected_metadata(f.seq).hex()}"
                            )
                        if f.ptr is not None or f.nbytes != rx.buffer_bytes:
                            raise AssertionError(f"frame {f.seq}: ptr {f.ptr}, {f.nbytes} bytes")
                        last = f.seq
                say("checked", n, last)
            elif op == "until_closed":
                timeout = float(cmd[1])
                count, last = 0, 0
                while True:
                    try:
                        f = rx.recv(timeout=timeout)
                    except cic.ChannelClosed:
                        break
                    with f:
                        if f.seq <= last or f.metadata != expected_metadata(f.seq):
                            raise AssertionError(
                                f"frame {f.seq} after {last}, metadata {f.metadata.hex()}"
                            )
                        last = f.seq
                        count += 1
                say("received", count, last)
            elif op == "stats":
                me = [c for c in rx.stats()["consumers"] if c["index"] == rx.slot][0]
                say("stats", me["received"], me["dropped"], me["in_flight"], me["lag"])
            elif op == "drain":
                took = stream_idle_within(rx, last_stream, float(cmd[1]))
                if took is None:
                    say("wedged")
                else:
                    say("drained", f"{took:.3f}")
            elif op == "ready":
                # Introspection for the test: where the module finds the ready page.
                say("ready", *(rx._control.ready_value(i) for i in range(rx.buffers)))
            elif op == "verify":
                count, bad = verify(rx, int(cmd[1]), float(cmd[2]))
                kinds = {cic._buffer_tokens(rx._control, i)[0].kind for i in range(rx.buffers)}
                say("verified", count, bad, ",".join(cic._KIND_NAMES[k].split()[0] for k in sorted(kinds)))
            elif op in ("fetch", "fetch_ns"):
                say("fetched", *fetch(cmd))
            elif op == "serve":
                me = serve_fds(int(cmd[1]))
                say("serving", me.pid, me.start_time, me.pid_ns)
            elif op == "nfds":
                say("nfds", open_fds())
            elif op == "whoami":
                me = cic.ProcessIdentity.current()
                say("me", me.pid, me.start_time, me.pid_ns)
            elif op == "close":
                rx.close()
                say("detached")
            elif op == "exit":
                return 0
            else:
                say("error", "BadCommand", line.strip())
        except cic.ProducerGone as e:
            say("gone", e.pid)
        except cic.ChannelClosed:
            say("closed")
        except Exception as e:  # reported to the test, which decides
            say("error", type(e).__name__, str(e).replace("\n", " "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
