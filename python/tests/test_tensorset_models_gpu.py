"""Tensor sets of PyTorch models with the awkward parts real state_dicts have, on a GPU.

Run (one GPU, PyTorch with CUDA; about a minute):

    CUDA_IPC_GPU_TESTS=1 python3 -m pytest -q -rs python/tests/test_tensorset_models_gpu.py

Without `CUDA_IPC_GPU_TESTS=1` every test is skipped; with it, a machine without PyTorch or
without a GPU fails them (never skips). Readers are separate processes started with
multiprocessing's spawn context (never forked; they import gpu_agents.py and this module by
name, so run it with pytest's default import mode, or as a script: `python3 THIS_FILE`). Every
wait on them is bounded (`ANSWER` seconds), a reader that does not answer is killed, and every
set has a unique name.

What is checked, each from the documented API (python/README.md, docs/guide.md, cuda_ipc.pyi):

- A small decoder-shaped model (embedding tied to the output head, LayerNorm and Linear blocks, a
  persistent int64 buffer, a bool buffer, a 0-d int64 counter, a non-persistent buffer) built in
  `torch_mem_pool()` and published by `TensorSetWriter.over_tensors` with no copy (PyTorch's and
  the arena's counters unchanged, the device's free memory too), read by two reader processes
  through `hold.tensors()` and `load_state_dict(d, assign=True)` into a model made on the meta
  device: the readers' outputs equal the writer's bit for bit, tied keys share one address, and
  loading took no device memory.
- The copy path (`TensorSetWriter(name, state_dict)` + `publish`): tied entries, transposed and
  sliced views, views of one fused tensor, bf16, fp16, fp8 (e4m3fn, e5m2), int8, uint8, bool,
  int64, 0-d and 0-element tensors, each read back byte for byte in another process.
- New generations: `optimizer.step()` in place on the pool model inside `begin()`, and buffered
  generations of copies; every generation a reader takes is exactly one of the writer's (never a
  mix), and the readers' outputs follow.
- Refusals that change nothing: a CPU tensor or a tensor outside the pool for `over_tensors`, a
  CPU tensor, another dtype, shape or size, or an unknown name for `publish`/`copy_from`; a reader
  expecting another layout (`LayoutMismatch`, no reader slot kept); a reader's optimizer writing
  into the read-only weights (its own context faults; the writer and another reader go on).

Where the docs say nothing about a case, the test asserts what a user would expect and says so in
a comment marked "Docs silent".
"""

import hashlib
import os
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
    START,
    AgentError,
    agent_pool,
    agents,
    close_all,
    cuda,
    pytestmark,
    remove_leftovers,
    torch,
)

# The model of the zero-copy and update tests: about 84 MB of float32 weights.
CFG = dict(vocab=16384, d=512, heads=8, layers=4, ff=2048, max_len=64)
# A small one where the size does not matter.
SMALL = dict(vocab=1000, d=64, heads=4, layers=2, ff=256, max_len=32)
BATCH, SEQ = 2, 24


# --------------------------------------------------------------------------------------------
# The model: what a decoder-only language model's state_dict looks like.
# --------------------------------------------------------------------------------------------

if torch is not None:
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        """Pre-norm attention (causal, written out: no kernel chosen at run time) and an MLP."""

        def __init__(self, d, heads, ff):
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.up = nn.Linear(d, ff)
            self.down = nn.Linear(ff, d)

        def forward(self, h):
            b, t, d = h.shape
            q, k, v = self.qkv(self.ln1(h)).split(d, dim=-1)
            q, k, v = (x.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for x in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
            causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
            att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            h = h + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
            return h + self.down(F.gelu(self.up(self.ln2(h))))

    class TinyLM(nn.Module):
        """Embedding tied to the output head (`lm_head.weight is embed.weight`: both keys are in
        the state_dict, one storage), persistent buffers of int64 (`position_ids`), bool
        (`feature_mask`) and a 0-d int64 counter (`num_updates`, as BatchNorm's
        `num_batches_tracked`), and a non-persistent `inv_freq` (as rotary embeddings' `inv_freq`):
        not in the state_dict, so a reader makes it itself (`init_non_persistent`)."""

        def __init__(self, vocab, d, heads, layers, ff, max_len):
            super().__init__()
            self.d = d
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.lm_head.weight = self.embed.weight
            self.register_buffer("position_ids", torch.arange(max_len))
            self.register_buffer("feature_mask", torch.arange(d) % 7 != 3)
            self.register_buffer("num_updates", torch.zeros((), dtype=torch.int64))
            self.register_buffer("inv_freq", self.make_inv_freq(d), persistent=False)

        @staticmethod
        def make_inv_freq(d, device=None):
            return 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))

        def init_non_persistent(self, device):
            self.inv_freq = self.make_inv_freq(self.d, device)

        def forward(self, ids):
            t = ids.shape[1]
            ang = self.position_ids[:t].to(torch.float32)[:, None] * self.inv_freq[None, :]
            h = self.embed(ids) + torch.cat([ang.sin(), ang.cos()], dim=-1)
            h = h * self.feature_mask
            for blk in self.blocks:
                h = blk(h)
            return self.lm_head(self.ln_f(h))


def fixed_ids(cfg):
    """The input every process feeds its model (int64 token ids on the GPU)."""
    n = BATCH * SEQ
    return (torch.arange(n, device="cuda").reshape(BATCH, SEQ) * 7919 + 11) % cfg["vocab"]


def meta_model(cfg):
    """The reader's model: made on the meta device (no memory), weights assigned from the set."""
    with torch.device("meta"):
        return TinyLM(**cfg)


def pool_model(pool, cfg, seed):
    """The writer's model, every parameter and buffer allocated in the extension's pool."""
    torch.manual_seed(seed)
    with torch.cuda.use_mem_pool(pool), torch.device("cuda"):
        model = TinyLM(**cfg)
    assert model.lm_head.weight is model.embed.weight
    return model


# --------------------------------------------------------------------------------------------
# Bytes and digests: exact comparisons of any dtype (fp8 and bool included; NaN patterns too).
# --------------------------------------------------------------------------------------------


def raw(t):
    """The tensor's elements as bytes on its device (contiguous, row-major, 0-d as one element)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def digest(t):
    return hashlib.sha256(raw(t).cpu().numpy().tobytes()).hexdigest()


def digests(d):
    return {k: digest(t) for k, t in d.items()}


def out_bytes(t):
    t = t.detach().to(torch.float32).contiguous()
    return t.cpu().numpy().tobytes(), tuple(t.shape)


def from_bytes(b, shape):
    return torch.frombuffer(bytearray(b), dtype=torch.float32).reshape(shape).cuda()


def describe(d):
    """What a reader sees of each tensor of a dict."""
    return {
        k: {
            "dtype": str(t.dtype),
            "shape": tuple(t.shape),
            "stride": tuple(t.stride()),
            "contiguous": t.is_contiguous(),
            "device": str(t.device),
            "ptr": t.data_ptr(),
            "digest": digest(t),
        }
        for k, t in d.items()
    }


def gpu_done(stream, timeout):
    """Whether the work enqueued on `stream` by now finishes within `timeout` seconds: polled,
    never a blocking synchronize (a stream left waiting on the GPU must not hang the test)."""
    ev = torch.cuda.Event()
    ev.record(stream)
    deadline = time.monotonic() + timeout
    while not ev.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# --------------------------------------------------------------------------------------------
# Reader processes ("agents", gpu_agents.py): spawned once, driven by commands over a pipe
# (`_COMMANDS`), every wait bounded.
# --------------------------------------------------------------------------------------------



class _AgentState:
    def __init__(self):
        self.readers = {}


def _take(r, than, timeout):
    if than is None:
        return r.current(timeout=timeout)
    return r.wait_newer(than, timeout=timeout)


def _cmd_open(st, key, name, kwargs):
    old = st.readers.pop(key, None)
    if old is not None:
        old.close()
    r = cuda_ipc.TensorSetReader(name, **kwargs)
    st.readers[key] = r
    return {
        "read_only": r.read_only,
        "names": list(r.names),
        "layout_fingerprint": r.layout_fingerprint,
        "imports": r.imports,
        "writerless": r.writerless,
    }


def _cmd_close(st, key):
    r = st.readers.pop(key, None)
    if r is not None:
        r.close()


def _cmd_close_all(st):
    for key in list(st.readers):
        _cmd_close(st, key)


def _cmd_take(st, key, than, timeout):
    """The tensors of the generation taken (`than` None: `current`), described inside the hold."""
    h = _take(st.readers[key], than, timeout)
    if h is None:
        return None
    with h:
        d = h.tensors()
        desc = describe(d)  # digests copy to the host: the hold's stream ordering is exercised
        torch.cuda.synchronize()
        return {"gen": h.generation, "whole": h.whole, "keys": list(d), "tensors": desc}


def _model_view(h, cfg):
    """`load_state_dict(h.tensors(), assign=True)` into a meta-made model, its forward output on
    the fixed input, and what the load cost."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    d = h.tensors()
    model = meta_model(cfg)
    model.load_state_dict(d, assign=True)  # strict: every persistent key, nothing else
    loaded = torch.cuda.memory_allocated() - before
    sd = model.state_dict()
    assigned = all(sd[k].data_ptr() == t.data_ptr() for k, t in d.items())
    model.init_non_persistent("cuda")
    with torch.inference_mode():
        out = model(fixed_ids(cfg))
    ob, shape = out_bytes(out)
    desc = describe(d)
    torch.cuda.synchronize()
    return {
        "gen": h.generation,
        "whole": h.whole,
        "keys": list(d),
        "tensors": desc,
        "load_device_bytes": loaded,
        "assigned_in_place": assigned,
        "tied_same_ptr": d["embed.weight"].data_ptr() == d["lm_head.weight"].data_ptr(),
        "num_updates": int(d["num_updates"].item()),
        "meta_left": [k for k, t in model.state_dict().items() if t.is_meta],
        "out": ob,
        "out_shape": shape,
    }


def _cmd_model(st, key, cfg, than, timeout):
    r = st.readers[key]
    h = _take(r, than, timeout)
    if h is None:
        return None
    with h:
        res = _model_view(h, cfg)
    res.update(read_only=r.read_only, imports=r.imports)
    return res


def _cmd_follow(st, key, cfg, last, timeout):
    """Takes every newer generation (`wait_newer`) until generation `last`: each described (and,
    with a `cfg`, run through the model) inside its hold."""
    r = st.readers[key]
    seen, out = 0, []
    while seen < last:
        with r.wait_newer(seen, timeout=timeout) as h:
            if cfg is None:
                d = h.tensors()
                res = {"gen": h.generation, "tensors": describe(d)}
                torch.cuda.synchronize()
                res["whole"] = h.whole
            else:
                res = _model_view(h, cfg)
            seen = h.generation
        out.append(res)
    return out


def _cmd_fault(st, key, cfg, timeout):
    """An optimizer over the reader's model: the backward only reads the weights, the step writes
    them (the docs: it faults this reader's context)."""
    r = st.readers[key]
    res = {"read_only": r.read_only}
    h = r.current(timeout=timeout)
    res["gen"] = h.generation
    try:
        d = h.tensors()
        model = meta_model(cfg)
        model.load_state_dict(d, assign=True)
        model.init_non_persistent("cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        loss = model(fixed_ids(cfg)).float().square().mean()
        loss.backward()
        torch.cuda.synchronize()
        res["backward"] = "ok"
        try:
            opt.step()
            torch.cuda.synchronize()
            res["step"] = "no error"
        except Exception as e:  # noqa: BLE001 - reported to the test
            res["step"] = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        res["before_step"] = f"{type(e).__name__}: {e}"
    try:
        h.release()
        res["release"] = "ok"
    except Exception as e:  # noqa: BLE001 - a release in a broken context
        res["release"] = f"{type(e).__name__}: {e}"
    return res


def _cmd_die(st):
    """As a crashed or killed process: nothing closed, no answer."""
    os._exit(0)

def _cmd_ping(st):
    return os.getpid()


_COMMANDS = {
    "open": _cmd_open,
    "close": _cmd_close,
    "close_all": _cmd_close_all,
    "take": _cmd_take,
    "model": _cmd_model,
    "follow": _cmd_follow,
    "fault": _cmd_fault,
    "die": _cmd_die,
    "ping": _cmd_ping,
}


class Agent(gpu_agents.Agent):
    """A reader process and its pipe."""

    WHO = "reader process"
    WHERE = "the reader process"

    def wait_ready(self, timeout=START):
        if not self.conn.poll(timeout):
            self.kill()
            raise AssertionError(f"a reader process did not start within {timeout} s")
        msg = self.conn.recv()
        assert msg[0] == "ready", msg
        self.pid = msg[1]

    def die(self):
        """Ends the process as a crash would (nothing closed), and waits for it."""
        if self.alive():
            try:
                self.send("die")
            except (OSError, BrokenPipeError):
                pass
            self.proc.join(10.0)
        self.kill()


class Agents(gpu_agents.Agents):
    """Reader processes shared by the tests of this module; a dead or stuck one is replaced."""

    commands = __name__
    agent = Agent

    def get(self, n):
        self.live = [a for a in self.live if a.alive()]
        new = [self.start() for _ in range(n - len(self.live))]  # started together
        for a in new:
            a.wait_ready()
        self.live += new
        return self.live[:n]

    def fresh(self):
        """A reader process of its own (for one that will break); ended at the test's end."""
        a = self.start()
        self.extra.append(a)
        a.wait_ready()
        return a


# --------------------------------------------------------------------------------------------
# Fixtures (`cuda`, `agent_pool`, `agents`: gpu_agents.py)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool(cuda):
    # One MemPool for the module: the arena's chunk size is fixed by the first call anyway.
    return cuda_ipc.torch_mem_pool(0)


@pytest.fixture
def names():
    """Unique set names; whatever a failed test left in /dev/shm under them is removed after."""
    tag = uuid.uuid4().hex[:10]
    made = []

    def make(what):
        n = f"pytest-tsm-{tag}-{what}"
        made.append(n)
        return n

    yield make
    remove_leftovers(made)


def unique_bytes(sd):
    seen = {}
    for t in sd.values():
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    return sum(seen.values())


def assert_same_tensors(seen, want, what, strides=None):
    """A reader's description of its dict against the writer's tensors: same keys, dtypes,
    shapes, bytes, on the GPU; contiguous (a set made with a copy lays its tensors out
    contiguously), or with the strides of `strides`' tensors (an over_tensors set keeps them)."""
    assert set(seen) == set(want), f"{what}: keys differ: {set(seen) ^ set(want)}"
    bad = []
    for k, t in want.items():
        s = seen[k]
        if s["dtype"] != str(t.dtype) or s["shape"] != tuple(t.shape):
            bad.append(f"{k}: {s['dtype']} {s['shape']} != {t.dtype} {tuple(t.shape)}")
        elif not s["device"].startswith("cuda"):
            bad.append(f"{k}: on {s['device']}")
        elif strides is None and not s["contiguous"]:
            bad.append(f"{k}: stride {s['stride']}, not contiguous")
        elif strides is not None and s["stride"] != tuple(strides[k].stride()):
            bad.append(f"{k}: stride {s['stride']}, the writer's {tuple(strides[k].stride())}")
        elif s["digest"] != digest(t):
            bad.append(f"{k}: other bytes")
    assert not bad, f"{what}: " + "; ".join(bad)


# --------------------------------------------------------------------------------------------
# 1. A model built in the pool, published with no copy, read by two processes.
# --------------------------------------------------------------------------------------------


def test_a_pool_model_is_published_without_a_copy_and_two_readers_run_it(cuda, pool, agents, names):
    ags = agents.get(2)  # started before the memory is measured (their contexts take memory)
    name = names("lm")
    model = pool_model(pool, CFG, seed=0).eval()
    sd = model.state_dict()
    # The awkward parts are there: both tied keys (one storage), the buffers, no inv_freq.
    assert sd["embed.weight"].data_ptr() == sd["lm_head.weight"].data_ptr()
    assert sd["position_ids"].dtype == torch.int64 and sd["feature_mask"].dtype == torch.bool
    assert sd["num_updates"].dim() == 0 and "inv_freq" not in sd
    # Every tensor in the extension's arena (`arena_locate` raises otherwise): the chunks.
    chunks = {cuda_ipc.arena_locate(t.data_ptr(), max(t.nbytes, 1))[0] for t in sd.values()}
    ids = fixed_ids(CFG)
    with torch.inference_mode():
        want = model(ids)
    torch.cuda.synchronize()
    model_bytes = unique_bytes(sd)
    alloc0, arena0, free0 = torch.cuda.memory_allocated(), cuda_ipc.arena_stats(0), torch.cuda.mem_get_info()[0]

    w = cuda_ipc.TensorSetWriter.over_tensors(name, sd)
    try:
        torch.cuda.synchronize()
        alloc1, arena1, free1 = torch.cuda.memory_allocated(), cuda_ipc.arena_stats(0), torch.cuda.mem_get_info()[0]
        # No copy: PyTorch allocated nothing, the arena is as it was, and the device did not
        # lose the model's size. (Docs silent: no "bytes copied" figure is reported anywhere;
        # these three counters are what a user can read. The writer's own small device
        # allocations, if any, are not documented: half the model's size is the bound here.)
        assert alloc1 == alloc0
        for k in ("chunks", "reserved_bytes", "in_use_bytes", "allocations"):
            assert arena1[k] == arena0[k], (k, arena0, arena1)
        assert free0 - free1 < model_bytes // 2, (free0 - free1, model_bytes)
        assert w.generation == 1  # "generation 1 committed at once"
        assert set(w.names) == set(sd)
        fp = w.layout_fingerprint

        for i, a in enumerate(ags):
            info = a.call("open", "lm", name, {"expect_layout": fp})
            assert info["layout_fingerprint"] == fp and set(info["names"]) == set(sd)
        seqs = [a.send("model", "lm", CFG, None, ANSWER) for a in ags]
        results = [a.result(s, 2 * ANSWER) for a, s in zip(ags, seqs)]
        for i, res in enumerate(results):
            who = f"reader {i}"
            assert res is not None, f"{who}: no generation"
            assert res["gen"] == 1 and res["whole"] is True, who
            # pool memory is VMM: mapped read-only ("Readers of VMM sets map them read-only").
            assert res["read_only"] is True, who
            # "each allocation imported once per process": one import per arena chunk used.
            assert res["imports"] == len(chunks), (who, res["imports"], chunks)
            assert_same_tensors(res["tensors"], sd, who)
            # Tied keys: one memory. Docs silent on aliases, but "without a copy" means each key
            # views the writer's memory of that key, and both keys are one storage there.
            assert res["tied_same_ptr"], who
            # `load_state_dict(d, assign=True)`: the parameters are the set's tensors, the load
            # took no device memory, nothing was left on the meta device.
            assert res["assigned_in_place"] and res["load_device_bytes"] == 0, who
            assert res["meta_left"] == [], who
            assert res["num_updates"] == 0, who
            got = from_bytes(res["out"], res["out_shape"])
            assert torch.equal(got, want.float()), (
                f"{who}: output differs by {(got - want.float()).abs().max().item()}")
    finally:
        close_all(ags, w)


def test_over_tensors_takes_0d_and_empty_tensors_of_the_pool(cuda, pool, agents, names):
    # Docs silent on 0-d and 0-element tensors for `over_tensors`. Real state_dicts have both
    # (BatchNorm's num_batches_tracked; a rank-0 adapter, an empty bias). PyTorch allocates
    # nothing for 0 bytes (data_ptr() is 0, in no arena), so "InvalidArgument for a tensor
    # allocated elsewhere" might be read to cover it; a user expects such a tensor to be taken.
    (a,) = agents.get(1)
    with torch.cuda.use_mem_pool(pool), torch.device("cuda"):
        w0 = torch.randn(64, 64)
        scalar = {"w": w0, "scale": torch.tensor(0.25), "count": torch.tensor(7, dtype=torch.int64)}
        empty = {"w": w0.clone(), "lora_A": torch.empty(0, 64), "bias": torch.empty(0, dtype=torch.bfloat16)}
    problems, writers = [], []
    try:
        for what, sd in (("0-d", scalar), ("empty", empty)):
            n = names(f"ot-{what}")
            try:
                writers.append(cuda_ipc.TensorSetWriter.over_tensors(n, sd))
            except Exception as e:  # noqa: BLE001 - collected: one case must not hide the other
                problems.append(f"over_tensors with {what} tensors raised {type(e).__name__}: {e}")
                continue
            try:
                a.call("open", what, n, {})
                res = a.call("take", what, None, ANSWER)
                assert res is not None and res["gen"] == 1, what
                assert_same_tensors(res["tensors"], sd, what)
            except (AssertionError, AgentError) as e:
                problems.append(f"{what}: {e}")
        assert not problems, "\n".join(problems)
    finally:
        close_all([a], *writers)


def test_a_strided_view_of_an_over_tensors_set_is_updated_in_place_never_by_copy_from(
    cuda, pool, agents, names
):
    # Documented (`TensorUpdate.copy_from`): a tensor of the set that is a strided view (a
    # transposed parameter of an over_tensors set) is refused, since a copy of contiguous bytes
    # would scramble it; the same memory through its contiguous key, or in place, lands.
    (a,) = agents.get(1)
    with torch.cuda.use_mem_pool(pool), torch.device("cuda"):
        w0 = torch.randn(48, 80)
        sd = {"w": w0, "w_t": w0.t(), "w_row": w0[3]}
    n = names("ot-strided")
    w = cuda_ipc.TensorSetWriter.over_tensors(n, sd)
    try:
        a.call("open", "st", n, {})
        res = a.call("take", "st", None, ANSWER)
        assert res is not None and res["gen"] == 1
        assert_same_tensors(res["tensors"], sd, "over_tensors with views", strides=sd)
        before = w0.clone()
        with w.begin(timeout=ANSWER) as u:
            with pytest.raises(cuda_ipc.InvalidArgument, match="strided view"):
                u.copy_from({"w_t": torch.zeros(80, 48, device="cuda")})
            assert torch.equal(u.tensors()["w"], before), "a refused copy changed the set"
            new = torch.randn(48, 80, device="cuda")
            u.copy_from({"w": new})
            u.tensors()["w_t"].mul_(2)  # in place, through the set's own strided view
        want = {"w": new * 2, "w_t": (new * 2).t(), "w_row": (new * 2)[3]}
        res = a.call("take", "st", 1, ANSWER)
        assert res is not None and res["gen"] == 2
        assert_same_tensors(res["tensors"], want, "generation 2 of the views", strides=sd)
    finally:
        close_all([a], w)


# --------------------------------------------------------------------------------------------
# 2. The copy path: a state_dict of every awkward kind, read back byte for byte elsewhere.
# --------------------------------------------------------------------------------------------


def copy_sources():
    """State dicts of CUDA tensors in PyTorch's own allocator, by the risk they carry: `core`
    (what the docs name), then one set each for the cases the docs do not name."""
    g = torch.Generator().manual_seed(7)

    def rn(*shape):
        return torch.randn(*shape, generator=g)

    emb = rn(1000, 64).to(torch.bfloat16).cuda()
    qkv = rn(3 * 64, 64).cuda()  # a fused weight exported as three contiguous views
    o = rn(96, 64).cuda()
    wide = rn(40, 50).to(torch.bfloat16).cuda()
    core = {
        "embed.weight": emb,
        "attn.q.weight": qkv[:64],
        "attn.k.weight": qkv[64:128],
        "attn.v.weight": qkv[128:],
        "attn.o.weight_t": o.t(),  # transposed: not contiguous
        "attn.slice": wide[3:, 7:],  # sliced: not contiguous, storage offset
        "mlp.w_fp16": rn(33, 17).half().cuda(),
        # "a torch.dtype or its name ("bfloat16", "float8_e4m3fn")" (cuda_ipc.pyi, TensorSpecs)
        "mlp.w_fp8_e4m3fn": (rn(128, 64) * 8).to(torch.float8_e4m3fn).cuda(),
        "quant.int8": torch.randint(-128, 128, (77, 13), generator=g, dtype=torch.int8).cuda(),
        "quant.uint8": torch.randint(0, 256, (3, 5, 7), generator=g, dtype=torch.uint8).cuda(),
        "mask.bool": (torch.rand(5, 7, 3, generator=g) > 0.5).cuda(),
        "ids.int64": torch.randint(-(2 ** 40), 2 ** 40, (129,), generator=g, dtype=torch.int64).cuda(),
        "norm.weight": rn(64).cuda(),
        "lm_head.weight": emb,  # tied: the same tensor under two keys
    }
    assert not core["attn.o.weight_t"].is_contiguous() and not core["attn.slice"].is_contiguous()
    return {
        "core": core,
        # Docs silent on 0-d tensors in a set.
        "0-d": {
            "scale": torch.tensor(0.125).cuda(),
            "step": torch.tensor(123456789012, dtype=torch.int64).cuda(),
            "flag": torch.tensor(True).cuda(),
            "w": rn(8, 8).cuda(),
        },
        # Docs silent on 0-element tensors; copy_from refuses a source "whose storage was freed
        # (data_ptr() 0)", and an empty CUDA tensor's data_ptr() is 0 too.
        "empty": {
            "lora_A": torch.empty(0, 64, device="cuda"),
            "bias": torch.empty(0, dtype=torch.bfloat16, device="cuda"),
            "w": rn(16).cuda(),
        },
        # Docs name float8_e4m3fn only; float8_e5m2 is the other fp8 of checkpoints.
        "fp8_e5m2": {
            "w_fp8_e5m2": (rn(64, 32) * 8).to(torch.float8_e5m2).cuda(),
            "w": rn(4).cuda(),
        },
    }


def test_the_copy_path_lands_every_awkward_tensor_byte_for_byte_in_another_process(cuda, agents, names):
    (a,) = agents.get(1)
    problems, writers, published = [], [], {}
    try:
        for what, sd in copy_sources().items():
            n = names(f"cp-{what.replace('_', '-')}")
            try:
                # "Or with a copy, from any tensors and any allocator": specs from the tensors.
                w = cuda_ipc.TensorSetWriter(n, sd, mode="buffered")
                writers.append(w)
                g = w.publish(sd, timeout=ANSWER)
                assert g == 1 == w.generation, (g, w.generation)
                assert set(w.names) == set(sd)
                published[what] = (n, sd)
            except Exception as e:  # noqa: BLE001 - collected: one case must not hide another
                problems.append(f"{what}: writing raised {type(e).__name__}: {e}")
        for what, (n, sd) in published.items():
            try:
                info = a.call("open", what, n, {})
                assert set(info["names"]) == set(sd)
                res = a.call("take", what, None, ANSWER)
                assert res is not None and res["gen"] == 1 and res["whole"] is True, what
                assert_same_tensors(res["tensors"], sd, what)
                if what == "core":
                    t = res["tensors"]
                    # Tied keys of the copy path: equal values. Docs silent on whether the set
                    # keeps one copy or two ("the set holds its own memory", one per spec).
                    assert t["embed.weight"]["digest"] == t["lm_head.weight"]["digest"]
                    # The transposed source lands as its transpose, contiguous.
                    assert t["attn.o.weight_t"]["shape"] == (64, 96)
            except (AssertionError, AgentError) as e:
                problems.append(f"{what}: {e}")
        assert not problems, "\n".join(problems)
    finally:
        close_all([a], *writers)


# --------------------------------------------------------------------------------------------
# 3. New generations: never a mix, and the readers follow.
# --------------------------------------------------------------------------------------------

STEPS = 4


def test_optimizer_steps_in_place_reach_both_readers_whole(cuda, pool, agents, names):
    ags = agents.get(2)
    name = names("steps")
    model = pool_model(pool, CFG, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = fixed_ids(CFG)
    sd = model.state_dict()  # detached aliases of the parameters: they follow the steps

    def snapshot():
        with torch.inference_mode():
            out = model(ids).float()
        torch.cuda.synchronize()
        return digests(sd), out

    w = cuda_ipc.TensorSetWriter.over_tensors(name, sd)
    try:
        expect = {w.generation: snapshot()}
        for a in ags:
            a.call("open", "s", name, {"expect_layout": w.layout_fingerprint})
        last = 1 + STEPS
        seqs = [a.send("follow", "s", CFG, last, ANSWER) for a in ags]
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            model(ids).float().logsumexp(dim=-1).mean().backward()  # reads the weights only
            with w.begin(timeout=ANSWER):  # waits for the readers' holds; commits at block end
                opt.step()  # writes the published tensors in place
                model.num_updates.add_(1)
            g = w.generation
            assert g == step + 2
            expect[g] = snapshot()
            # The step changed the weights (else "never a mix" below would prove nothing).
            assert expect[g][0]["embed.weight"] != expect[g - 1][0]["embed.weight"]
            assert expect[g][0]["blocks.0.qkv.weight"] != expect[g - 1][0]["blocks.0.qkv.weight"]
        for i, (a, s) in enumerate(zip(ags, seqs)):
            reports = a.result(s, 2 * ANSWER)
            gens = [r["gen"] for r in reports]
            assert gens == sorted(set(gens)) and gens[-1] == last, (i, gens)
            ptrs = None
            for r in reports:
                g = r["gen"]
                want_dig, want_out = expect[g]
                got_dig = {k: v["digest"] for k, v in r["tensors"].items()}
                mixed = sorted(k for k in want_dig if got_dig.get(k) != want_dig[k])
                assert not mixed, f"reader {i}, generation {g}: not the writer's bytes: {mixed}"
                assert r["num_updates"] == g - 1 and r["whole"] is True, (i, g)
                assert r["tied_same_ptr"] and r["assigned_in_place"], (i, g)
                got = from_bytes(r["out"], r["out_shape"])
                assert torch.equal(got, want_out), f"reader {i}, generation {g}: output differs"
                # In place: one buffer, so the same addresses in every generation ("built once
                # per buffer and handed out again for every generation that buffer holds").
                p = {k: v["ptr"] for k, v in r["tensors"].items()}
                assert ptrs is None or p == ptrs, (i, g)
                ptrs = p
    finally:
        close_all(ags, w)


def test_buffered_generations_of_copies_are_never_mixed(cuda, agents, names):
    ags = agents.get(2)
    name = names("buf")
    specs = {f"layers.{i}.w": ((1024, 1024), "bfloat16") for i in range(8)}
    specs.update({f"layers.{i}.norm": ((1024,), "float32") for i in range(8)})
    gens = 8
    cg = torch.Generator(device="cuda").manual_seed(3)

    def sources():
        return {n: torch.randn(s, generator=cg, device="cuda").to(getattr(torch, dt))
                for n, (s, dt) in specs.items()}

    w = cuda_ipc.TensorSetWriter(name, specs, mode="buffered", buffers=2)
    kept = []  # every source stays alive until the end, whichever stream copies it
    try:
        src = sources()
        kept.append(src)
        expect = {w.publish(src, timeout=ANSWER): digests(src)}
        for a in ags:
            a.call("open", "b", name, {})
        seqs = [a.send("follow", "b", None, gens, ANSWER) for a in ags]
        for _ in range(gens - 1):
            src = sources()
            kept.append(src)
            want = digests(src)
            expect[w.publish(src, timeout=ANSWER)] = want
        assert sorted(expect) == list(range(1, gens + 1))
        for i, (a, s) in enumerate(zip(ags, seqs)):
            reports = a.result(s, 2 * ANSWER)
            assert reports[-1]["gen"] == gens, i
            for r in reports:
                got = {k: v["digest"] for k, v in r["tensors"].items()}
                mixed = sorted(k for k in specs if got[k] != expect[r["gen"]][k])
                assert not mixed, f"reader {i}, generation {r['gen']}: not the writer's bytes: {mixed}"
                assert r["whole"] is True
    finally:
        close_all(ags, w)


# --------------------------------------------------------------------------------------------
# 4. Refusals that leave nothing half-done.
# --------------------------------------------------------------------------------------------


def test_refused_sources_leave_the_set_as_it_was(cuda, pool, agents, names):
    (a,) = agents.get(1)
    writers = []
    try:
        # over_tensors: a CPU tensor, and a CUDA tensor of PyTorch's own allocator, among pool
        # tensors: "InvalidArgument for a tensor allocated elsewhere". The name stays free.
        model = pool_model(pool, SMALL, seed=2)
        sd = model.state_dict()
        n0 = names("ot")
        keys = list(sd)
        for stray in (torch.zeros(4), torch.zeros(4, device="cuda")):
            bad = {}
            for i, k in enumerate(keys):
                if i == len(keys) // 2:
                    bad["stray"] = stray
                bad[k] = sd[k]
            with pytest.raises(cuda_ipc.InvalidArgument):
                cuda_ipc.TensorSetWriter.over_tensors(n0, bad)
        assert a.error_of("open", "ot", n0, {}).is_a("TensorSetNotFound")
        w0 = cuda_ipc.TensorSetWriter.over_tensors(n0, sd)  # no ChannelExists: nothing left
        writers.append(w0)
        a.call("open", "ot", n0, {})
        res = a.call("take", "ot", None, ANSWER)
        assert res["gen"] == 1
        assert_same_tensors(res["tensors"], sd, "over_tensors after two refusals")

        # The copy path, double-buffered: refused publishes and copy_froms commit nothing, and
        # the readers keep the last generation whole ("In double-buffered mode an abort leaves
        # the last generation readable").
        src1 = {k: v.detach().clone() for k, v in sd.items()}  # PyTorch's own allocator
        src2 = {k: (v + 1 if v.is_floating_point() else v.clone()) for k, v in src1.items()}
        n1 = names("cp")
        w1 = cuda_ipc.TensorSetWriter(n1, src1, mode="buffered")
        writers.append(w1)
        g1 = w1.publish(src1, timeout=ANSWER)
        a.call("open", "cp", n1, {})
        up = "blocks.0.up.weight"
        bads = {
            # Documented: "a CPU tensor given to a GPU set is refused before anything of its
            # chunk is copied".
            "a CPU tensor": {**src1, up: src1[up].cpu()},
            # Documented: each source of the set's dtype and shape (as load_state_dict refuses a
            # size mismatch), NoSuchTensor (an InvalidArgument) for a name the set lacks, and
            # nothing of the refused source's chunk copied: never a reinterpreting copy.
            "another dtype of the same bytes": {**src1, "ln_f.weight": src1["ln_f.weight"].view(torch.int32)},
            "another shape of the same elements": {**src1, up: src1[up].reshape(SMALL["d"], SMALL["ff"])},
            "fewer elements": {**src1, "position_ids": src1["position_ids"][:-1]},
            "a name the set lacks": {**src1, "no.such.tensor": torch.zeros(4, device="cuda")},
        }
        for what, bad in bads.items():
            with pytest.raises(cuda_ipc.InvalidArgument):
                w1.publish(bad, timeout=ANSWER)
            assert w1.generation == g1, what
            with w1.begin(timeout=ANSWER) as u:
                u.copy_from_previous()
                before = digests(u.tensors())
                with pytest.raises(cuda_ipc.InvalidArgument):
                    u.copy_from(bad)
                # Documented: nothing of the refused source's chunk is copied (one chunk: every
                # source here).
                assert digests(u.tensors()) == before, f"{what}: the update's bytes changed"
                u.abort()
            assert w1.generation == g1, what
        res = a.call("take", "cp", None, 0.0)
        assert res is not None and res["gen"] == g1
        assert_same_tensors(res["tensors"], src1, "buffered set after the refusals")
        g2 = w1.publish(src2, timeout=ANSWER)
        res = a.call("take", "cp", g1, ANSWER)
        assert res["gen"] == g2
        assert_same_tensors(res["tensors"], src2, "buffered set, next generation")

        # In place: a refused publish. Documented: "An in-place update that is aborted (...)
        # leaves no readable generation". Docs silent on whether a publish refused before any
        # copy counts as one: either no generation, or the last one whole; never a mix.
        n2 = names("ip")
        w2 = cuda_ipc.TensorSetWriter(n2, src1)
        writers.append(w2)
        g1 = w2.publish(src1, timeout=ANSWER)
        a.call("open", "ip", n2, {})
        with pytest.raises(cuda_ipc.InvalidArgument):
            w2.publish(bads["a CPU tensor"], timeout=ANSWER)
        assert w2.generation == g1
        res = a.call("take", "ip", None, 0.0)
        if res is not None:
            assert res["gen"] == g1
            assert_same_tensors(res["tensors"], src1, "in-place set after a refused publish")
        g2 = w2.publish(src2, timeout=ANSWER)
        res = a.call("take", "ip", g1, ANSWER)
        assert res["gen"] == g2
        assert_same_tensors(res["tensors"], src2, "in-place set, next generation")
    finally:
        close_all([a], *writers)


def specs_of(sd, dtype=None):
    """`name -> (shape, torch.dtype)` of a state_dict (floating tensors as `dtype` if given)."""
    out = {}
    for k, t in sd.items():
        dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        out[k] = (tuple(t.shape), dt)
    return out


def test_a_reader_expecting_another_layout_is_refused_and_keeps_no_slot(cuda, agents, names):
    a0, a1 = agents.get(2)
    torch.manual_seed(4)
    with torch.device("cuda"):
        model = TinyLM(**SMALL)
    sd = model.state_dict()
    name = names("lay")
    w = cuda_ipc.TensorSetWriter(name, sd, max_readers=2)
    others = []
    try:
        g = w.publish(sd, timeout=ANSWER)
        fp = w.layout_fingerprint
        # Layouts of other checkpoints: the same names and shapes in bf16; one block more.
        deeper = meta_model(dict(SMALL, layers=SMALL["layers"] + 1)).state_dict()
        for what, specs in (("bf16", specs_of(sd, torch.bfloat16)), ("deeper", specs_of(deeper))):
            o = cuda_ipc.TensorSetWriter(names(f"lay-{what}"), specs)
            others.append(o)
        fps = [o.layout_fingerprint for o in others]
        # Docs silent on what the fingerprint covers; a user expects the same model's layout
        # to give the same fingerprint under another name (so a reader can be given it ahead),
        # and another dtype or depth another one.
        same = cuda_ipc.TensorSetWriter(names("lay-same"), specs_of(sd))
        others.append(same)
        assert same.layout_fingerprint == fp
        assert len({fp, *fps}) == 3
        for o in others:
            o.close(timeout=10.0)
        others = []
        # Refused, typed, as often as asked: no reader slot is kept by a refused open.
        for wrong in fps + fps:
            e = a0.error_of("open", "x", name, {"expect_layout": wrong})
            assert e.is_a("LayoutMismatch"), e
        i0 = a0.call("open", "r0", name, {"expect_layout": fp})
        i1 = a1.call("open", "r1", name, {"expect_layout": fp})
        assert i0["layout_fingerprint"] == i1["layout_fingerprint"] == fp
        # max_readers=2 is enforced (so the two opens above prove no slot leaked). Docs: the
        # reader "Raises ... NoConsumerSlot"; that it is this error for max_readers is assumed.
        assert a0.error_of("open", "r2", name, {}).is_a("NoConsumerSlot")
        res = a1.call("take", "r1", None, ANSWER)
        assert res["gen"] == g
        assert_same_tensors(res["tensors"], sd, "after refused opens")
    finally:
        close_all([a0, a1], w, *others)


FAULTED_WAIT = 10.0


def test_a_readers_optimizer_faults_only_that_reader(cuda, pool, agents, names):
    # Documented: "an in-place operation on a reader's tensor (t.add_(1), an optimizer built over
    # the reader's model) faults that reader's CUDA context (an illegal-address error; the
    # process must be restarted), while the writer and the other readers go on."
    (b,) = agents.get(1)
    a = agents.fresh()  # the one that breaks
    name = names("fault")
    model = pool_model(pool, SMALL, seed=5)
    sd = model.state_dict()
    ids = fixed_ids(SMALL)
    with torch.inference_mode():
        want1 = model(ids).float()
    before = {k: v.clone() for k, v in sd.items()}
    torch.cuda.synchronize()
    w = cuda_ipc.TensorSetWriter.over_tensors(name, sd)
    try:
        a.call("open", "m", name, {})
        b.call("open", "m", name, {})
        fa = a.call("fault", "m", SMALL, ANSWER)
        assert fa["read_only"] is True and fa["gen"] == 1, fa
        assert fa.get("backward") == "ok", fa
        assert "illegal" in fa.get("step", "").lower(), fa
        assert a.call("ping") == a.pid  # alive, as the docs imply ("must be restarted")
        # The writer's weights are as they were: the store did not land.
        torch.cuda.synchronize()
        changed = [k for k in sd if not torch.equal(sd[k], before[k])]
        assert not changed, f"the faulting reader changed the writer's weights: {changed}"
        # Another reader goes on: a fresh take, the writer's output.
        rb = b.call("model", "m", SMALL, None, ANSWER)
        assert rb["gen"] == 1 and torch.equal(from_bytes(rb["out"], rb["out_shape"]), want1)

        # The writer goes on while the faulted reader lives. Docs silent on whether a hold
        # released from a broken context lets an in-place `begin()` through (and whether the
        # update's stream, which waits on the GPU for the readers' kernels, is let go), so every
        # wait here is bounded and polled, and the update runs on a stream of its own.
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model(ids).float().logsumexp(dim=-1).mean().backward()
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        alive_problem = None
        updated = False
        try:
            with torch.cuda.stream(side):
                with w.begin(timeout=FAULTED_WAIT):
                    opt.step()
            updated = True
            if not gpu_done(side, FAULTED_WAIT):
                alive_problem = "the update's stream still waited on the GPU for the faulted reader"
        except cuda_ipc.Timeout as e:
            alive_problem = f"begin() timed out while the faulted reader lived: {e}"
        # The faulted process restarted, as the docs say it must: "A reader killed while holding
        # a generation is let go within about 1 s."
        a.die()
        if not updated:
            with torch.cuda.stream(side):
                with w.begin(timeout=ANSWER):
                    opt.step()
        assert gpu_done(side, ANSWER), "the writer's stream never finished its update"
        torch.cuda.current_stream().wait_stream(side)
        g2 = w.generation
        assert g2 == 2
        with torch.inference_mode():
            want2 = model(ids).float()
        assert not torch.equal(want2, want1)
        rb = b.call("model", "m", SMALL, 1, ANSWER)
        assert rb["gen"] == g2
        assert torch.equal(from_bytes(rb["out"], rb["out_shape"]), want2)
        assert_same_tensors(rb["tensors"], sd, "the other reader after the fault")
        assert alive_problem is None, alive_problem
    finally:
        a.kill()
        close_all([b], w)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-rs"]))
