"""Processes ("agents") for the GPU tests that drive other processes: spawned, driven by commands
over a pipe, every wait bounded. Not a test module: the test modules import it
(test_tensorset_holders_gpu.py, test_tensorset_models_gpu.py).

A test module using it defines:

- `_AgentState`, the state of one process, and `_COMMANDS`, its commands by name: functions
  `(state, *args) -> payload`, among them "close_all" (run on "quit" and when the process leaves);
- `Agent`, a subclass of `gpu_agents.Agent` with its `wait_ready`, and `Agents`, a subclass of
  `gpu_agents.Agents` whose `commands` is the module's `__name__` and `agent` its `Agent`.

Processes are started with multiprocessing's spawn context (never forked): a child imports this
module and then the test module by name (`_agent_main`), both found on the sys.path the child
inherits from the parent. So run the test modules with pytest's default import mode (which puts
this folder on sys.path), or as scripts.

The fixtures (`cuda`, `agent_pool`, `agents`) and `pytestmark` take effect in a test module that
imports them into its namespace (`from gpu_agents import cuda, agent_pool, agents, pytestmark`).
"""

import ctypes
import importlib
import multiprocessing as mp
import os
import pathlib
import signal
import time
import traceback

import pytest

GPU_TESTS = os.environ.get("CUDA_IPC_GPU_TESTS") == "1"

pytestmark = pytest.mark.skipif(
    not GPU_TESTS, reason="needs a CUDA GPU: set CUDA_IPC_GPU_TESTS=1"
)

try:  # With CUDA_IPC_GPU_TESTS=1 a missing PyTorch fails the tests (the `cuda` fixture).
    import torch
except ImportError:  # pragma: no cover - only where the tests are skipped or must fail
    torch = None

SHM = pathlib.Path("/dev/shm")
ANSWER = 30.0  # seconds: the bound of every wait on a process, a hold or an update
START = 90.0  # seconds for a process to import PyTorch and make its CUDA context
IDLE = 300.0  # a process left without a command this long leaves by itself


# --------------------------------------------------------------------------------------------
# The process
# --------------------------------------------------------------------------------------------


def _die_with_parent():
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _agent_main(conn, commands_module, init_cuda=True):
    """A process running the commands of module `commands_module` (its `_COMMANDS`, on its
    `_AgentState`): answers (seq, command, *args) with (seq, "ok", payload) or (seq, "err",
    [class names of the exception's MRO], message, traceback)."""
    module = importlib.import_module(commands_module)
    commands = module._COMMANDS
    close_all = commands["close_all"]
    _die_with_parent()
    if init_cuda:
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    st = module._AgentState()
    conn.send(("ready", os.getpid()))
    while True:
        if not conn.poll(IDLE):
            break
        try:
            msg = conn.recv()
        except EOFError:
            break
        seq, op, args = msg[0], msg[1], msg[2:]
        if op == "quit":
            try:
                close_all(st)
            finally:
                conn.send((seq, "ok", None))
            break
        try:
            payload = commands[op](st, *args)
            conn.send((seq, "ok", payload))
        except BaseException as e:  # noqa: BLE001 - every error goes back to the test
            conn.send((seq, "err", [c.__name__ for c in type(e).__mro__], str(e),
                       traceback.format_exc()))
    close_all(st)


# --------------------------------------------------------------------------------------------
# The test's side
# --------------------------------------------------------------------------------------------


class AgentError(Exception):
    def __init__(self, mro, message, tb):
        super().__init__(f"{mro[0]}: {message}\n{tb}")
        self.mro, self.message, self.tb = mro, message, tb

    def is_a(self, cls_name):
        return cls_name in self.mro


class Agent:
    """A process and its pipe; it runs the commands of module `commands`. A subclass gives
    `wait_ready`, and how messages name the process: `WHO` (followed by its pid) and `WHERE` (a
    format string of `pid`)."""

    WHO = "process"
    WHERE = "process {pid}"

    def __init__(self, ctx, commands, init_cuda=True):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_agent_main, args=(child, commands, init_cuda), daemon=True)
        self.proc.start()
        child.close()
        self.seq = 0
        self.pending = set()
        self.pid = None

    def wait_ready(self, timeout=START):
        raise NotImplementedError

    def alive(self):
        return self.proc.is_alive()

    def send(self, *cmd):
        self.seq += 1
        self.conn.send((self.seq,) + cmd)
        self.pending.add(self.seq)
        return self.seq

    def result(self, seq, timeout=ANSWER):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                ready = left > 0 and self.conn.poll(left)
                msg = self.conn.recv() if ready else None
            except (EOFError, OSError):
                msg, ready = None, False
            if msg is None:
                code = self.proc.exitcode
                self.kill()
                raise AssertionError(
                    f"{self.WHO} {self.pid}: no answer to request {seq} within {timeout} s "
                    f"(exit code {code})")
            self.pending.discard(msg[0])
            if msg[0] == seq:
                break
        if msg[1] == "ok":
            return msg[2]
        raise AgentError(*msg[2:])

    def call(self, *cmd, timeout=ANSWER):
        return self.result(self.send(*cmd), timeout)

    def error_of(self, *cmd, timeout=ANSWER):
        """The error a command raised in the process (AssertionError if it did not)."""
        try:
            got = self.call(*cmd, timeout=timeout)
        except AgentError as e:
            return e
        where = self.WHERE.format(pid=self.pid)
        raise AssertionError(f"{cmd[0]} {cmd[1:]!r} succeeded in {where}: {got!r}")

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10.0)

    def quit(self):
        """Closes what the process has open, lets it end, and waits for it."""
        if self.alive():
            try:
                self.call("quit", timeout=ANSWER)
            except (AssertionError, AgentError, OSError):
                pass
            self.proc.join(10.0)
        self.kill()


class Agents:
    """Processes shared by the tests of a module (`live`: a dead or stuck one is replaced), and
    processes of one test (`extra`), ended at its end. A subclass names the module of the commands
    (`commands`), its `Agent` class (`agent`), and how tests get processes."""

    commands = None
    agent = Agent

    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.live = []
        self.extra = []

    def start(self, init_cuda=True):
        """A process started (not waited for)."""
        return self.agent(self.ctx, self.commands, init_cuda)

    def tidy(self):
        """After each test: its own processes killed, the shared ones' objects closed (one still
        busy with a command killed)."""
        for a in self.extra:
            a.kill()
        self.extra = []
        for a in self.live:
            if not a.alive():
                continue
            if a.pending:
                a.kill()
                continue
            try:
                a.call("close_all", timeout=ANSWER)
            except (AssertionError, AgentError):
                a.kill()

    def shutdown(self):
        for a in self.live + self.extra:
            a.quit()


def close_all(ags, *writers):
    """The processes' objects first (in the processes), then the writers of this process (closing
    twice does nothing)."""
    for a in ags:
        if a.alive() and not a.pending:
            try:
                a.call("close_all")
            except (AssertionError, AgentError):
                a.kill()
    for w in writers:
        if w is not None:
            w.close(timeout=10.0)


def remove_leftovers(set_names):
    """Whatever is still in /dev/shm under the sets' names, removed."""
    for n in set_names:
        for p in SHM.glob(f"cuda-ipc.*.{n}"):
            if p.name.startswith("cuda-ipc.") and p.name.endswith("." + n) and not p.is_dir():
                try:
                    p.unlink()
                except OSError:
                    pass


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda():
    assert torch is not None, "CUDA_IPC_GPU_TESTS=1 but PyTorch is not installed"
    assert torch.cuda.is_available(), "CUDA_IPC_GPU_TESTS=1 but PyTorch sees no GPU"
    torch.zeros(1, device="cuda")
    return torch


@pytest.fixture(scope="module")
def agent_pool(cuda, request):
    """The test module's `Agents`, shut down after its tests."""
    p = request.module.Agents()
    yield p
    p.shutdown()


@pytest.fixture
def agents(agent_pool):
    yield agent_pool
    agent_pool.tidy()
