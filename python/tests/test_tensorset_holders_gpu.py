"""Tensor-set holders, writerless readers and stable addresses, on a GPU.

Run (one GPU, PyTorch with CUDA; about 45 s, most of it starting processes):

    CUDA_IPC_GPU_TESTS=1 python3 -m pytest -q -rs python/tests/test_tensorset_holders_gpu.py

Without `CUDA_IPC_GPU_TESTS=1` every test is skipped; with it, a machine without PyTorch or
without a GPU fails them (never skips). Writers, holders and readers are separate processes
started with multiprocessing's spawn context (never forked; they import gpu_agents.py and this
module by name, so run it with pytest's default import mode, or as a script: `python3 THIS_FILE`).
Every wait on them is bounded (`ANSWER` seconds), a process that does not answer is killed, every
set has a unique name, and what killed processes leave in /dev/shm is removed by
`cuda_ipc.cleanup()` (the rules of `cuda-ipc gc`), then checked gone.

Generation g of every set holds, in each tensor, bytes computed on the GPU from g and the
tensor's name (`expected_bytes`): every check below compares bytes on the GPU, bit for bit.

What is checked, each from the documented API (python/README.md, docs/guide.md, cuda_ipc.pyi,
and the examples they name: python/examples/engine_restart.py and stable_graph.py):

- `TensorSetHolder` and writerless reads (double-buffered VMM set): a writer process publishes
  three generations; a holder process (no CUDA context) holds the set: `status` "serving", one fd
  per allocation (`allocations`: one per buffer), `bytes`, `source_pid`. The writer is killed with
  SIGKILL; the holder still serves. A fresh reader process opens the set writerless
  (`writerless`, `read_only`, `imports`: one per allocation per buffer; a second open in the same
  process imports nothing), reads the last generation bit for bit (`whole`), and `wait_newer` for
  a newer one raises `WriterGone` at once; `switch_stable` on a writerless reader is refused
  (`InvalidArgument`, the hold released). A bounded `holder.wait` with nothing changed returns
  "serving"; a new writer of another layout taking the name makes it "replaced" (or "closed", as
  the example allows). A closed holder: `allocations`, `bytes`, `source_pid` raise
  `TensorSetClosed` naming it, `status` and `wait()` say "released" (not "closed", the writer's
  close), a second `close()` does nothing.
- `TensorSetReader(serve=True)` (in-place VMM set): a reader that serves the fds keeps its held
  generation readable after the writer's SIGKILL and gets `WriterGone` from `wait_newer`; a
  fresh reader opens the set writerless from it and reads the last generation bit for bit; once
  the serving process has ended, an open in a process that never mapped the set raises
  `NoServer` (a `WriterGone`).
- Stable addresses, in both writer modes (`buffered`, `in_place`): `stable_tensors()` gives the
  same tensor objects at the same addresses before the first switch and after every one;
  `switch_stable(wait_newer(...))` reports the generation, `stable_generation` follows, and one
  CUDA graph (torch.cuda.CUDAGraph, captured once over the stable tensors: a copy of every
  tensor's bytes and an int64 sum) replays the bytes of each generation switched to. Buffered:
  until the switch the graph still reads the generation switched to before (a new generation in
  the other buffer changes nothing there), and every later switch remaps. In place: the writer's
  update waits for `release_stable()` (a bounded publish runs out), and no switch remaps.
  Refusals that change nothing: another reader's hold (`InvalidArgument`, the hold left held and
  readable), a reader without `stable_addresses` (`InvalidArgument`, its hold released), a
  released hold (`InvalidArgument`); `release_stable()` then `True`, again `False`.
- A holder of a live set follows its writer's `close()` ("closed"), and a set gone raises
  `TensorSetNotFound`; pool and legacy sets cannot be held (`NotHoldable`, a `NotSupported`, for
  both `TensorSetHolder` and `serve=True`) nor opened with `stable_addresses` (`NotSupported`),
  and a plain reader still reads them afterwards.

Where the docs say nothing about a case, the test asserts what a user would expect and says so in
a comment marked "Docs silent".
"""

import gc
import os
import signal
import sys
import time
import uuid

import pytest

import cuda_ipc

# Its asserts (the `cuda` fixture's) explained by pytest as this module's are (not where it was
# imported before pytest started: a run as a script).
if "gpu_agents" not in sys.modules:
    pytest.register_assert_rewrite("gpu_agents")
import gpu_agents  # noqa: E402
from gpu_agents import (  # noqa: E402, F401 - fixtures and pytestmark act where imported
    ANSWER,
    SHM,
    START,
    agent_pool,
    agents,
    close_all,
    cuda,
    pytestmark,
    remove_leftovers,
    torch,
)

# Docs silent on how a Python writer learns that a generation is recorded whole for holders
# (docs/ARCHITECTURE.md: a recorder thread of the writer stores it once the generation's GPU work
# completed); python/examples/engine_restart.py waits 0.5 s after `synchronize()`. So does this,
# twice as long.
SETTLE = 1.0
HELD_WAIT = 1.0  # seconds a bounded in-place update is given while the stable generation is held
WRITER_GONE = 3.0  # "at once" (writerless) and "within about 1 s" (a reader of the dead writer)
GENS = 4  # generations the stable-address tests switch through

# The sets' tensors, about 1 MB a buffer: name -> (shape, dtype name), as `TensorSpecs` takes.
SPECS = {
    "embed.weight": ((512, 384), "bfloat16"),
    "block.0.w": ((384, 384), "float32"),
    "block.0.b": ((384,), "float32"),
    "ids": ((1000,), "int64"),
    "quant": ((77, 13), "uint8"),
}
KEYS = list(SPECS)


# --------------------------------------------------------------------------------------------
# Generation g's bytes: the same in every process, computed on the GPU.
# --------------------------------------------------------------------------------------------


def nbytes_of(key):
    shape, dt = SPECS[key]
    n = torch.empty((), dtype=getattr(torch, dt)).element_size()
    for s in shape:
        n *= s
    return n


def expected_bytes(key, gen):
    """Generation `gen`'s bytes of tensor `key` (uint8 on the GPU). Every byte differs from the
    same byte of every other generation below 251 (7919 * d mod 251 = 138 * d mod 251 is not 0
    for 0 < d < 251)."""
    idx = torch.arange(nbytes_of(key), device="cuda", dtype=torch.int64)
    v = idx * 131 + (idx >> 9) * 17 + gen * 7919 + KEYS.index(key) * 104729
    return (v % 251).to(torch.uint8)


def sources(gen):
    """Generation `gen` as a state dict of CUDA tensors of the set's shapes and dtypes (each the
    pattern's bytes reinterpreted: NaN patterns included, so only a bitwise copy keeps them)."""
    out = {}
    for k, (shape, dt) in SPECS.items():
        out[k] = expected_bytes(k, gen).view(getattr(torch, dt)).reshape(shape)
    return out


def raw(t):
    """The tensor's elements as bytes on its device (contiguous, row-major)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def check_dict(d, gen):
    """The keys of `d` that are not generation `gen`'s tensors, bit for bit (checked on the GPU)."""
    bad = sorted(set(d) ^ set(SPECS))
    for k, (shape, dt) in SPECS.items():
        t = d.get(k)
        if t is None:
            continue
        if tuple(t.shape) != tuple(shape) or t.dtype != getattr(torch, dt) or not t.is_cuda:
            bad.append(f"{k}: {t.dtype} {tuple(t.shape)} on {t.device}")
        elif not torch.equal(raw(t), expected_bytes(k, gen)):
            bad.append(k)
    return bad


def error_info(e):
    return {"mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}


# --------------------------------------------------------------------------------------------
# Processes ("agents", gpu_agents.py): one kind of process plays every part: writer, holder or
# reader, by the commands it is sent (`_COMMANDS`).
# --------------------------------------------------------------------------------------------



class _AgentState:
    def __init__(self):
        self.writer = None
        self.readers = {}
        self.holds = {}  # holds kept across commands, by reader key
        self.holders = {}
        self.stable = {}  # the first dict of `stable_tensors()`, by reader key
        self.graphs = {}  # (graph, outputs, sum output), by reader key


def _sync_if_cuda():
    if torch.cuda.is_initialized():  # a holder process never makes a context
        torch.cuda.synchronize()


def _take(r, than, timeout):
    if than is None:
        return r.current(timeout=timeout)
    return r.wait_newer(than, timeout=timeout)


# Writer --------------------------------------------------------------------------------------


def _cmd_w_create(st, name, kwargs):
    w = cuda_ipc.TensorSetWriter(name, SPECS, **kwargs)
    st.writer = w
    return {"pid": os.getpid(), "nbytes": w.nbytes, "names": list(w.names), "generation": w.generation}


def _cmd_w_publish(st, gens, timeout):
    """Publishes generation g's pattern for each g of `gens` (the numbers the writer is expected
    to give them), waits for the writer's stream, then SETTLE seconds."""
    w = st.writer
    got, kept = [], []
    for g in gens:
        src = sources(g)
        kept.append(src)  # alive until the copies are done
        got.append(w.publish(src, timeout=timeout))
    w.synchronize()
    torch.cuda.synchronize()
    time.sleep(SETTLE)
    return {"gens": got, "generation": w.generation}


# Holder --------------------------------------------------------------------------------------


def _cmd_h_open(st, key, name):
    h = cuda_ipc.TensorSetHolder(name)
    st.holders[key] = h
    return {
        "name": h.name,
        "allocations": h.allocations,
        "bytes": h.bytes,
        "source_pid": h.source_pid,
        "status": h.status,
    }


def _cmd_h_status(st, key):
    return st.holders[key].status


def _cmd_h_wait(st, key, timeout):
    h = st.holders[key]
    t0 = time.monotonic()
    seen = h.wait(timeout=timeout)
    return seen, time.monotonic() - t0, h.status


def _cmd_h_close(st, key):
    """Closes the holder (twice), then what each call of the closed holder gives."""
    h = st.holders.pop(key)
    h.close()
    h.close()  # "Closing twice does nothing."
    res = {}
    for what, call in (
        ("allocations", lambda: h.allocations),
        ("bytes", lambda: h.bytes),
        ("source_pid", lambda: h.source_pid),
        ("name", lambda: h.name),
        ("status", lambda: h.status),
        ("wait", lambda: h.wait(timeout=ANSWER / 3)),
    ):
        t0 = time.monotonic()
        try:
            res[what] = {"value": call()}
        except Exception as e:  # noqa: BLE001 - reported to the test
            res[what] = {"error": error_info(e)}
        res[what]["seconds"] = time.monotonic() - t0
    return res


# Reader --------------------------------------------------------------------------------------


def _cmd_open(st, key, name, kwargs):
    old = st.readers.pop(key, None)
    if old is not None:
        old.close()
    r = cuda_ipc.TensorSetReader(name, **kwargs)
    st.readers[key] = r
    return {
        "read_only": r.read_only,
        "names": list(r.names),
        "imports": r.imports,
        "writerless": r.writerless,
        "stable_generation": r.stable_generation,
    }


def _cmd_close(st, key):
    h = st.holds.pop(key, None)
    if h is not None:
        h.release()
    st.graphs.pop(key, None)
    st.stable.pop(key, None)
    gc.collect()
    _sync_if_cuda()
    r = st.readers.pop(key, None)
    if r is not None:
        r.close()


def _cmd_close_all(st):
    for key in list(st.readers):
        _cmd_close(st, key)
    for h in st.holds.values():
        h.release()
    st.holds.clear()
    for key in list(st.holders):
        st.holders.pop(key).close()
    if st.writer is not None:
        w, st.writer = st.writer, None
        w.close(timeout=10.0)


def _cmd_check(st, key, than, timeout, keep=False):
    """Takes a generation (`than` None: `current`) and checks its bytes; `keep`: the hold stays
    (until `close`)."""
    h = _take(st.readers[key], than, timeout)
    if h is None:
        return None
    try:
        bad = check_dict(h.tensors(), h.generation)
        torch.cuda.synchronize()
        res = {"gen": h.generation, "whole": h.whole, "bad": bad}
    except BaseException:
        h.release()
        raise
    if keep:
        old = st.holds.pop(key, None)
        if old is not None:
            old.release()
        st.holds[key] = h
    else:
        h.release()
    return res


def _cmd_check_held(st, key):
    """The kept hold's bytes checked again."""
    h = st.holds[key]
    bad = check_dict(h.tensors(), h.generation)
    torch.cuda.synchronize()
    return {"gen": h.generation, "whole": h.whole, "held": h.held, "bad": bad}


def _cmd_wait_newer(st, key, than, timeout):
    with st.readers[key].wait_newer(than, timeout=timeout) as h:
        return h.generation


# Stable addresses ----------------------------------------------------------------------------


def _stable_view(st, key):
    """Whether `stable_tensors()` gives the first dict's tensor objects again, and its addresses."""
    first = st.stable[key]
    again = st.readers[key].stable_tensors()
    same = set(again) == set(first) and all(again[k] is first[k] for k in first)
    return same, {k: t.data_ptr() for k, t in again.items()}


def _cmd_stable_open(st, key, name):
    info = _cmd_open(st, key, name, {"stable_addresses": True})
    # Before any switch: the addresses are reserved, nothing is mapped (never read here).
    st.stable[key] = st.readers[key].stable_tensors()
    same, ptrs = _stable_view(st, key)
    info.update(keys=list(st.stable[key]), ptrs=ptrs, same=same)
    return info


def _cmd_stable_switch(st, key, than, timeout):
    r = st.readers[key]
    h = r.wait_newer(than, timeout=timeout)
    hold_gen = h.generation
    info = r.switch_stable(h)
    same, ptrs = _stable_view(st, key)
    return {
        "hold_gen": hold_gen,
        "info_keys": sorted(info),
        "generation": info["generation"],
        "remapped": info["remapped"],
        "stable_generation": r.stable_generation,
        "same": same,
        "ptrs": ptrs,
    }


def _cmd_stable_capture(st, key):
    """One CUDA graph over the stable tensors (as python/examples/stable_graph.py: a warm-up on a
    side stream, then the capture): every tensor's bytes copied into outputs made before the
    capture, and the int64 sum of `ids`. Replayed once at once."""
    tens = st.stable[key]
    outs = {k: torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device="cuda")
            for k, t in tens.items()}

    def step():
        for k, t in tens.items():
            outs[k].copy_(t.reshape(-1).view(torch.uint8))
        return tens["ids"].sum()

    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up before the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total = step()
    st.graphs[key] = (graph, outs, total)
    return _cmd_stable_replay(st, key, st.readers[key].stable_generation)


def _cmd_stable_replay(st, key, gen):
    """Replays the graph (its outputs zeroed first) and checks what it read against generation
    `gen`; the stable tensors read eagerly too."""
    graph, outs, total = st.graphs[key]
    for o in outs.values():
        o.zero_()
    total.zero_()
    graph.replay()
    torch.cuda.synchronize()
    bad = [k for k in KEYS if not torch.equal(outs[k], expected_bytes(k, gen))]
    want_sum = int(expected_bytes("ids", gen).view(torch.int64).sum().item())
    eager_bad = check_dict(st.stable[key], gen)
    torch.cuda.synchronize()
    return {
        "gen": gen,
        "stable_generation": st.readers[key].stable_generation,
        "bad": bad,
        "sum_ok": int(total.item()) == want_sum,
        "eager_bad": eager_bad,
    }


def _cmd_stable_release(st, key):
    r = st.readers[key]
    released = r.release_stable()
    return {"released": released, "stable_generation": r.stable_generation}


def _cmd_stable_refused(st, key, timeout):
    """`switch_stable` of this reader's own hold where it must be refused (a reader without
    `stable_addresses`, a writerless reader): the error and what became of the hold."""
    r = st.readers[key]
    h = r.current(timeout=timeout)
    res = {"gen": h.generation, "error": None}
    try:
        res["info"] = r.switch_stable(h)
    except Exception as e:  # noqa: BLE001 - reported to the test
        res["error"] = error_info(e)
    res["held_after"] = h.held
    res["stable_generation"] = r.stable_generation
    if h.held:
        h.release()
    return res


def _cmd_stable_misuse(st, key, other, timeout):
    """Refused switches of stable reader `key`: another reader's (`other`) hold, then a released
    hold of its own."""
    r, o = st.readers[key], st.readers[other]
    before = r.stable_generation
    res = {"before": before}
    h = o.current(timeout=timeout)
    try:
        r.switch_stable(h)
        res["other"] = None
    except Exception as e:  # noqa: BLE001
        res["other"] = error_info(e)
    res["other_held_after"] = h.held
    res["other_bad_after"] = check_dict(h.tensors(), h.generation) if h.held else ["not held"]
    res["other_gen"] = h.generation
    torch.cuda.synchronize()
    if h.held:
        h.release()
    res["after_other"] = r.stable_generation
    h2 = r.current(timeout=timeout)
    h2.release()
    try:
        r.switch_stable(h2)
        res["released"] = None
    except Exception as e:  # noqa: BLE001
        res["released"] = error_info(e)
    res["after_released"] = r.stable_generation
    return res


def _cmd_ping(st):
    return os.getpid()


_COMMANDS = {
    "w_create": _cmd_w_create,
    "w_publish": _cmd_w_publish,
    "h_open": _cmd_h_open,
    "h_status": _cmd_h_status,
    "h_wait": _cmd_h_wait,
    "h_close": _cmd_h_close,
    "open": _cmd_open,
    "close": _cmd_close,
    "close_all": _cmd_close_all,
    "check": _cmd_check,
    "check_held": _cmd_check_held,
    "wait_newer": _cmd_wait_newer,
    "stable_open": _cmd_stable_open,
    "stable_switch": _cmd_stable_switch,
    "stable_capture": _cmd_stable_capture,
    "stable_replay": _cmd_stable_replay,
    "stable_release": _cmd_stable_release,
    "stable_refused": _cmd_stable_refused,
    "stable_misuse": _cmd_stable_misuse,
    "ping": _cmd_ping,
}


class Agent(gpu_agents.Agent):
    def wait_ready(self, timeout=START):
        try:
            msg = self.conn.recv() if self.conn.poll(timeout) else None
        except (EOFError, OSError):
            msg = None
        if msg is None:
            code = self.proc.exitcode
            self.kill()
            raise AssertionError(f"a process did not start within {timeout} s (exit code {code})")
        assert msg[0] == "ready", msg
        self.pid = msg[1]

    def sigkill(self):
        """SIGKILL, as a crash: nothing closed. Waits for the process; returns its pid."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10.0)
        assert not self.proc.is_alive(), f"process {self.pid} outlived SIGKILL"
        assert self.proc.exitcode == -signal.SIGKILL, self.proc.exitcode
        return self.proc.pid


class Agents(gpu_agents.Agents):
    """Reader processes shared by the tests of this module (a dead or stuck one is replaced), and
    processes of one test (writers to kill, holders), ended at its end."""

    commands = __name__
    agent = Agent

    def get(self, n, fresh=()):
        """`n` shared processes and one fresh process per item of `fresh` (whether it makes a
        CUDA context at start: a holder needs none), all started together."""
        self.live = [a for a in self.live if a.alive()]
        new = [self.start() for _ in range(n - len(self.live))]
        own = [self.start(init_cuda=c) for c in fresh]
        self.live += new
        self.extra += own
        for a in new + own:
            a.wait_ready()
        return self.live[:n], own


# --------------------------------------------------------------------------------------------
# Fixtures (`cuda`, `agent_pool`, `agents`: gpu_agents.py)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def names():
    """Unique set names. After the test (and after `agents`' tidying: the tests take `names`
    first), what dead processes left is removed by `cuda_ipc.cleanup()`; whatever a failed test
    still left under these names is removed too."""
    tag = uuid.uuid4().hex[:10]
    made = []

    def make(what):
        n = f"pytest-tsh-{tag}-{what}"
        made.append(n)
        return n

    yield make
    try:
        cuda_ipc.cleanup()
    except OSError:
        pass
    remove_leftovers(made)


def assert_cleaned(set_names, pids):
    """`cuda_ipc.cleanup()` (the documented cleaner, `cuda-ipc gc`'s rules) removes what the ended
    processes `pids` left; afterwards nothing under the sets' names is in /dev/shm and a dry run
    lists nothing of them or of those processes."""
    removed = cuda_ipc.cleanup()
    left = sorted(p.name for n in set_names for p in SHM.glob(f"cuda-ipc.*.{n}"))
    assert not left, f"left in /dev/shm after cleanup(): {left} (removed: {removed})"
    listed = [x for x in cuda_ipc.cleanup(dry_run=True)
              if x["pid"] in pids or any(n in str(x["object"]) for n in set_names)]
    assert not listed, f"leftovers still listed after cleanup(): {listed}"
    return removed


def assert_closed_holder(res, name):
    """What `_cmd_h_close` saw of a closed holder: "After close(), allocations, bytes and
    source_pid raise TensorSetClosed naming this holder; status and wait say "released" (not
    "closed", which says the writer closed the set)."""
    for what in ("allocations", "bytes", "source_pid"):
        err = res[what].get("error")
        assert err is not None, f"{what} of a closed holder gave {res[what]}"
        assert "TensorSetClosed" in err["mro"], (what, err)
        assert "InvalidArgument" not in err["mro"], (what, err)
        # Docs silent on the message's words: "naming this holder" read as the set's name and
        # the word holder (a reader's is `this reader of tensor set "x" is closed (...)`).
        assert name in err["message"] and "holder" in err["message"].lower(), (what, err)
    assert res["status"].get("value") == "released", res["status"]
    assert res["wait"].get("value") == "released", res["wait"]
    # `wait` "waits ... until status is not serving": a closed holder's at once.
    assert res["wait"]["seconds"] < 2.0, res["wait"]
    # Docs silent on `name` after close (a closed reader's `name` still answers): expected to.
    assert res["name"].get("value") == name, res["name"]


# --------------------------------------------------------------------------------------------
# 1. A holder keeps a killed writer's set; a fresh reader reads it writerless.
# --------------------------------------------------------------------------------------------


def test_a_holder_keeps_a_killed_writers_set_for_a_writerless_reader(cuda, names, agents):
    name = names("held")
    _, (w, h, r) = agents.get(0, fresh=(True, False, True))  # writer, holder (no context), reader
    buffers, last = 2, 3
    info = w.call("w_create", name, {"memory": "vmm", "mode": "buffered", "buffers": buffers})
    assert set(info["names"]) == set(SPECS), info
    pub = w.call("w_publish", [1, 2, 3], ANSWER, timeout=2 * ANSWER)
    assert pub["gens"] == [1, 2, last] and pub["generation"] == last, pub

    hi = h.call("h_open", "h", name)
    assert hi["name"] == name and hi["status"] == "serving", hi
    # "one allocation per buffer" (TensorSetWriter), "a file descriptor of every allocation"
    # (TensorSetHolder).
    assert hi["allocations"] == buffers, hi
    # Docs silent on `bytes` beyond "the fds pin bytes of device memory" (docs/ARCHITECTURE.md:
    # "B x bytes per buffer"); allocations may be rounded up to the driver's granularity.
    assert hi["bytes"] >= buffers * info["nbytes"], (hi, info)
    # Docs silent on `source_pid`: read as the process the fds were fetched from, here the writer
    # (the only process serving them).
    assert hi["source_pid"] == w.pid, (hi, w.pid)

    dead = w.sigkill()
    # "Keeps VMM tensor set name attachable after its writer dies": still serving.
    assert h.call("h_status", "h") == "serving"

    # A fresh reader process (its CUDA context made before): writerless, from the holder.
    ri = r.call("open", "r", name, {})
    assert ri["writerless"] is True, ri
    assert ri["read_only"] is True, ri  # "Readers of VMM sets map them read-only"
    # "one per allocation per buffer for a first open in the process".
    assert ri["imports"] == buffers, ri
    assert set(ri["names"]) == set(SPECS), ri
    res = r.call("check", "r", None, ANSWER)
    assert res is not None and res["gen"] == last, res  # "reads the last whole generation"
    assert res["bad"] == [], f"writerless generation {last}: not the writer's bytes: {res['bad']}"
    # Docs silent on `whole` of a writerless reader's hold: the generation it reads is the last
    # *whole* one, so a user expects True (not False, "the writer died first").
    assert res["whole"] is True, res
    # "wait_newer for a newer one raises WriterGone at once".
    t0 = time.monotonic()
    e = r.error_of("wait_newer", "r", last, ANSWER)
    took = time.monotonic() - t0
    assert e.is_a("WriterGone"), e
    assert took < WRITER_GONE, f"WriterGone after {took:.2f} s, not at once"
    res = r.call("check", "r", None, 0.0)  # still there, at once
    assert res is not None and res["gen"] == last and res["bad"] == [], res
    # "0 for allocations this process had imported already" (the first reader still open).
    r2 = r.call("open", "r2", name, {})
    assert r2["writerless"] is True and r2["imports"] == 0, r2
    # switch_stable: "InvalidArgument (no stable_addresses, a released hold, a writerless
    # reader) ..., releasing hold" (so a writerless reader opens with stable_addresses).
    rs = r.call("open", "s", name, {"stable_addresses": True})
    assert rs["writerless"] is True and rs["stable_generation"] is None, rs
    sr = r.call("stable_refused", "s", ANSWER)
    assert sr["gen"] == last, sr
    assert sr["error"] is not None and "InvalidArgument" in sr["error"]["mro"], sr
    assert sr["held_after"] is False and sr["stable_generation"] is None, sr
    r.call("close_all")

    # A bounded wait with nothing changed returns the status last seen.
    seen, secs, status = h.call("h_wait", "h", 0.5)
    assert seen == "serving" and status == "serving", (seen, status)
    assert secs >= 0.4, f"wait(0.5) returned after {secs:.3f} s with nothing changed"

    # The trainer restarts with another layout: a new set under the name ("replaced"). The
    # example (python/examples/engine_restart.py) also takes "closed", seen by a holder that
    # looked between the old set's removal and the new one's creation.
    nw = cuda_ipc.TensorSetWriter(name, {"x": ((1,), "float32")}, memory="vmm")
    try:
        seen, secs, status = h.call("h_wait", "h", ANSWER, timeout=2 * ANSWER)
        assert seen in ("replaced", "closed"), (seen, secs)
        assert status in ("replaced", "closed"), status
    finally:
        nw.close(timeout=10.0)

    assert_closed_holder(h.call("h_close", "h"), name)
    h.quit()
    r.quit()
    assert_cleaned([name], [dead, h.pid, r.pid])


# --------------------------------------------------------------------------------------------
# 2. A reader that serves the fds (serve=True) keeps an in-place set; then no server is left.
# --------------------------------------------------------------------------------------------


def test_a_serving_reader_keeps_a_killed_writers_in_place_set_until_it_ends(cuda, names, agents):
    name = names("served")
    (r, probe), (w, s) = agents.get(2, fresh=(True, True))
    last = 3
    w.call("w_create", name, {"memory": "vmm"})  # mode "in_place", the default: one buffer
    pub = w.call("w_publish", [1, 2, 3], ANSWER, timeout=2 * ANSWER)
    assert pub["gens"] == [1, 2, last], pub

    si = s.call("open", "s", name, {"serve": True})
    assert si["writerless"] is False, si
    res = s.call("check", "s", None, ANSWER, True)  # the hold is kept across the kill
    assert res is not None and res["gen"] == last and res["bad"] == [], res
    assert res["whole"] is True, res  # "True once the writer's stream finished this generation"

    dead = w.sigkill()
    # "A dead writer: readers keep the generation they hold (VMM memory stays valid) and
    # wait_newer raises WriterGone (a ProducerGone) within about 1 s".
    t0 = time.monotonic()
    e = s.error_of("wait_newer", "s", last, ANSWER)
    took = time.monotonic() - t0
    assert e.is_a("WriterGone") and e.is_a("ProducerGone"), e
    assert took < WRITER_GONE, f"WriterGone after {took:.2f} s"
    held = s.call("check_held", "s")
    assert held["held"] and held["gen"] == last and held["bad"] == [], held
    assert held["whole"] is True, held

    # A reader opened after the death imports from the serving reader: writerless.
    ri = r.call("open", "w", name, {})
    assert ri["writerless"] is True and ri["read_only"] is True, ri
    assert ri["imports"] == 1, ri  # in place: one buffer, one allocation
    res = r.call("check", "w", None, ANSWER)
    assert res is not None and res["gen"] == last, res
    assert res["bad"] == [], f"writerless generation {last}: not the writer's bytes: {res['bad']}"
    assert res["whole"] is True, res  # Docs silent, as in the holder's test
    t0 = time.monotonic()
    e = r.error_of("wait_newer", "w", last, ANSWER)
    took = time.monotonic() - t0
    assert e.is_a("WriterGone"), e
    assert took < WRITER_GONE, f"WriterGone after {took:.2f} s, not at once"
    r.call("close", "w")

    # The serving process ends ("serve the set's fds to later readers ... while it lives"): with
    # the writer dead and no live holder, an open raises NoServer (a WriterGone). Docs silent on
    # whether a process that mapped the set before could open it again from what it imported,
    # so the open is made in a process that never mapped it.
    s.quit()
    e = probe.error_of("open", "n", name, {})
    assert e.is_a("NoServer") and e.is_a("WriterGone"), e

    assert_cleaned([name], [dead, s.pid])


# --------------------------------------------------------------------------------------------
# 3. Stable addresses: one CUDA graph reads every generation switched to.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["buffered", "in_place"])
def test_a_cuda_graph_over_stable_tensors_reads_each_generation_switched_to(cuda, names, agents, mode):
    name = names(f"stable-{mode.replace('_', '-')}")
    (a,), _ = agents.get(1)
    kw = {"memory": "vmm", "mode": mode}
    if mode == "buffered":
        kw["buffers"] = 2
    w = cuda_ipc.TensorSetWriter(name, SPECS, **kw)
    kept = []  # every source stays alive until the end, whichever stream copies it
    try:
        src = sources(1)
        kept.append(src)
        assert w.publish(src, timeout=ANSWER) == 1
        o = a.call("stable_open", "s", name)
        assert o["stable_generation"] is None and o["writerless"] is False, o
        assert set(o["keys"]) == set(SPECS) and o["same"], o
        ptrs = o["ptrs"]
        assert all(p != 0 for p in ptrs.values()), ptrs

        sw = a.call("stable_switch", "s", 0, ANSWER)
        # Returns {"generation", "remapped", "micros", "remap_micros"}.
        assert {"generation", "micros", "remap_micros", "remapped"} <= set(sw["info_keys"]), sw
        assert sw["hold_gen"] == sw["generation"] == sw["stable_generation"] == 1, sw
        assert sw["same"] and sw["ptrs"] == ptrs, "stable_tensors() changed at the first switch"
        rep = a.call("stable_capture", "s")
        assert rep["stable_generation"] == 1, rep
        assert rep["bad"] == [] and rep["sum_ok"], f"the graph read other bytes: {rep}"
        assert rep["eager_bad"] == [], rep

        # Refusals that change nothing.
        a.call("open", "p", name, {})  # a reader without stable_addresses
        mis = a.call("stable_misuse", "s", "p", ANSWER)
        # "InvalidArgument for another reader's hold, leaving hold as it was".
        assert mis["other"] is not None and "InvalidArgument" in mis["other"]["mro"], mis
        assert mis["other_held_after"] is True and mis["other_bad_after"] == [], mis
        assert mis["other_gen"] == 1 and mis["after_other"] == 1, mis
        # "then InvalidArgument (... a released hold ...)". Docs silent on the stable
        # generation after such a refusal: unchanged, as after the other refusals.
        assert mis["released"] is not None and "InvalidArgument" in mis["released"]["mro"], mis
        assert mis["after_released"] == 1, mis
        # "then InvalidArgument (no stable_addresses, ...), releasing hold".
        nr = a.call("stable_refused", "p", ANSWER)
        assert nr["error"] is not None and "InvalidArgument" in nr["error"]["mro"], nr
        assert nr["held_after"] is False, nr
        a.call("close", "p")
        rep = a.call("stable_replay", "s", 1)
        assert rep["bad"] == [] and rep["sum_ok"] and rep["eager_bad"] == [], (
            f"after the refused switches: {rep}")

        for g in range(2, GENS + 1):
            src = sources(g)
            kept.append(src)
            if mode == "in_place":
                if g == 2:
                    # "In-place sets: the stable addresses are the buffer's own, and the writer
                    # waits for release_stable()". Docs silent on the error of a bounded wait
                    # that runs out in `begin`: Timeout ("A bounded wait ran out").
                    with pytest.raises(cuda_ipc.Timeout):
                        w.publish(src, timeout=HELD_WAIT)
                    assert w.generation == 1
                rel = a.call("stable_release", "s")
                assert rel == {"released": True, "stable_generation": None}, rel
            assert w.publish(src, timeout=ANSWER) == g
            if mode == "buffered":
                # The reader keeps its stable generation held until the next switch: the new
                # generation went to the other buffer, and the graph still reads g - 1.
                rep = a.call("stable_replay", "s", g - 1)
                assert rep["stable_generation"] == g - 1, rep
                assert rep["bad"] == [] and rep["sum_ok"] and rep["eager_bad"] == [], (
                    f"generation {g} published, not switched to: {rep}")
            sw = a.call("stable_switch", "s", g - 1, ANSWER)
            assert sw["hold_gen"] == sw["generation"] == sw["stable_generation"] == g, sw
            assert sw["same"] and sw["ptrs"] == ptrs, f"stable_tensors() changed at generation {g}"
            # Docs silent on what `remapped` means; read as "the range was mapped again":
            # buffered, every switch after the first goes to the other buffer; in place "a
            # switch maps nothing" (docs/benchmarks.md, "Tensor sets: stable addresses").
            assert sw["remapped"] is (mode == "buffered"), sw
            rep = a.call("stable_replay", "s", g)
            assert rep["stable_generation"] == g, rep
            assert rep["bad"] == [] and rep["sum_ok"], f"generation {g}: the graph read {rep}"
            assert rep["eager_bad"] == [], rep

        rel = a.call("stable_release", "s")
        assert rel == {"released": True, "stable_generation": None}, rel
        rel = a.call("stable_release", "s")  # "False if none was"
        assert rel == {"released": False, "stable_generation": None}, rel
        if mode == "in_place":  # released: the writer goes on
            assert w.publish(sources(GENS + 1), timeout=ANSWER) == GENS + 1
    finally:
        close_all([a], w)
    assert_cleaned([name], [])


# --------------------------------------------------------------------------------------------
# 4. A holder follows its writer's close; what cannot be held is refused.
# --------------------------------------------------------------------------------------------


def test_a_holder_follows_its_writers_close_and_pool_and_legacy_sets_are_refused(cuda, names, agents):
    (a,), (h,) = agents.get(1, fresh=(False,))  # a reader; a holder (no CUDA context)
    name = names("live")
    w = cuda_ipc.TensorSetWriter(name, SPECS, memory="vmm")
    writers = [w]
    others = []
    try:
        assert w.publish(sources(1), timeout=ANSWER) == 1
        w.synchronize()
        hi = h.call("h_open", "h", name)
        assert hi["status"] == "serving" and hi["allocations"] == 1, hi  # in place: one buffer
        assert hi["bytes"] >= w.nbytes, (hi, w.nbytes)  # Docs silent, as in the first test
        assert hi["source_pid"] == os.getpid(), hi  # Docs silent, as in the first test
        w.close(timeout=10.0)
        # "closed" (the writer closed the set); wait returns once status is not "serving".
        seen, secs, status = h.call("h_wait", "h", ANSWER, timeout=2 * ANSWER)
        assert seen == "closed" and status == "closed", (seen, status, secs)
        assert_closed_holder(h.call("h_close", "h"), name)
        # The set is gone: "Raises TensorSetNotFound".
        e = h.error_of("h_open", "again", name)
        assert e.is_a("TensorSetNotFound"), e

        # "pool and legacy sets cannot be held either" (NotHoldable, also a NotSupported), for a
        # holder and a serving reader alike; stable addresses: "VMM sets, else NotSupported".
        for mem in ("pool", "legacy"):
            n = names(mem)
            others.append(n)
            wm = cuda_ipc.TensorSetWriter(n, SPECS, memory=mem)
            writers.append(wm)
            assert wm.publish(sources(1), timeout=ANSWER) == 1
            e = h.error_of("h_open", mem, n)
            assert e.is_a("NotHoldable") and e.is_a("NotSupported"), (mem, e)
            e = a.error_of("open", "x", n, {"serve": True})
            assert e.is_a("NotHoldable"), (mem, e)
            e = a.error_of("open", "x", n, {"stable_addresses": True})
            assert e.is_a("NotSupported"), (mem, e)
            # Nothing was left half-done: a plain reader opens and reads generation 1.
            a.call("open", mem, n, {})
            res = a.call("check", mem, None, ANSWER)
            assert res is not None and res["gen"] == 1 and res["bad"] == [], (mem, res)
            a.call("close", mem)
    finally:
        close_all([a], *writers)
    h.quit()
    assert_cleaned([name, *others], [h.pid])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-rs"]))
