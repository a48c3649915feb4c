"""Memory of other libraries given to the writers, readers that consume through other libraries,
models of real shapes, and threads of one reader process, on a GPU.

Run (one GPU, PyTorch with CUDA; CuPy and JAX where installed; about a minute):

    CUDA_IPC_GPU_TESTS=1 python3 -m pytest -q -rs python/tests/test_foreign_memory_gpu.py

Without `CUDA_IPC_GPU_TESTS=1` every test is skipped; with it, a machine without PyTorch or
without a GPU fails them (never skips). The tests of CuPy and JAX are skipped where that library
does not import (`pytest.importorskip`); JAX is told not to take the GPU's memory ahead
(`XLA_PYTHON_CLIENT_PREALLOCATE=false`, set before it is imported) and to keep 64-bit integers.
Readers are separate processes started with multiprocessing's spawn context (never forked; they
import gpu_agents.py and this module by name, so run it with pytest's default import mode, or as
a script: `python3 THIS_FILE`). Every wait on them is bounded (`ANSWER` seconds), a reader that
does not answer is killed, and every set and channel has a unique name (pid, a counter, random
digits).

Generation contents are computed on the GPU from a number and the tensor's name (`pattern`), the
same in every process; every check compares bytes (digests of the raw bytes) or values on the GPU.

What is checked, each from the documented API (python/README.md, docs/guide.md, cuda_ipc.pyi):

- Memory of other libraries given to every writer entry that takes tensors: the specs of
  `TensorSetWriter(name, tensors)`, `publish`, `begin().copy_from`, `copy_plan` (published, then
  its sources written in place and published again) and `over_tensors`, with sources of each
  kind: PyTorch's caching allocator; a side stream that is still writing them (`publish` under it
  as PyTorch's current stream, `begin(stream=...)`); pinned and plain host tensors; tensors whose
  storage was freed; the extension's `torch_mem_pool`; CuPy arrays (as they are, through
  `torch.from_dlpack`, from CuPy's stream-ordered pool, written on a CuPy stream given as
  `stream=`, in managed memory, and pinned host memory seen as a CUDA tensor); JAX arrays (as they
  are, and through `torch.from_dlpack`). Each either lands and a reader in another process sees
  the exact bytes, or is refused with the documented error class (a cuda_ipc error, naming a
  tensor where one tensor is at fault) and the reader still sees the last generation whole: never
  another exception, never other bytes. `KINDS` says which, and why.
- A host channel's `WriteFrame.write` given NumPy, PyTorch, CuPy and JAX objects: their logical
  bytes, or `TypeError` with the buffer left as it was; a GPU frame's `write`/`read` refused.
- Readers through other libraries: `cupy.from_dlpack` (on a CuPy stream of its own, with
  `tensors(stream=that stream)` or after `tensors()`) and `jax.dlpack.from_dlpack` on a reader's
  `hold.tensors()` of in-place generations the writer's stream is still writing; frames written
  through PyTorch on a side stream, `as_cupy` on a CuPy stream, a CuPy pool's array or a JAX
  array, and read through `cupy.from_dlpack`, `as_cupy`, `__cuda_array_interface__` and
  `jax.dlpack.from_dlpack`.
- A GPT-2-small-shaped decoder (token and position embeddings of 50257 and 1024 x 768, four
  `TransformerEncoderLayer(768, 12)` blocks, a tied head) in bf16, published by `over_tensors`
  from `torch_mem_pool` and by copy: a reader's `load_state_dict(assign=True)` model gives the
  writer's logits bit for bit. 3,000 small tensors of every documented dtype (fp8 kinds, bool,
  complex, unsigned, 0-d, empty) through `publish` and a `CopyPlan`, every one checked; dtypes
  outside the documented list refused (`NotSupported`).
- Eight threads of one reader process taking, reading and releasing the same set (by
  `wait_newer` and by `current`, releases by `release()`, `with` and collection) while the writer
  publishes 30 generations, in place and double-buffered: every tensor a thread saw is its hold's
  generation's, never a mix.

Where the docs say nothing about a case, the test asserts what a user would expect and says so in
a comment marked "Docs silent".
"""

import contextlib
import gc
import hashlib
import itertools
import os
import sys
import threading
import time
import uuid

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX is imported anywhere

import pytest  # noqa: E402

import cuda_ipc  # noqa: E402

# Its asserts (the `cuda` fixture's) explained by pytest as this module's are (not where it was
# imported before pytest started: a run as a script).
if "gpu_agents" not in sys.modules:
    pytest.register_assert_rewrite("gpu_agents")
import gpu_agents  # noqa: E402
from gpu_agents import (  # noqa: E402, F401 - fixtures and pytestmark act where imported
    ANSWER,
    START,
    agent_pool,
    agents,
    close_all,
    cuda,
    pytestmark,
    remove_leftovers,
    torch,
)

SLEEP_MS = 40  # how long a stream is kept busy before the write a copy must be ordered after
FRAME_BYTES = 4 << 20

# The tensors of the foreign-memory sets: name -> (shape, dtype name), as `TensorSpecs` takes;
# dtypes that CuPy, JAX and NumPy all have. Distinct names, so that an error naming one is seen.
FOREIGN = {
    "foreign.w_f32": ((129, 67), "float32"),
    "foreign.h_f16": ((4099,), "float16"),
    "foreign.q_u8": ((3, 5, 77), "uint8"),
    "foreign.i8": ((1000,), "int8"),
    "foreign.ids_i64": ((513,), "int64"),
    "foreign.scalar": ((), "float32"),
    "foreign.empty": ((0, 5), "float32"),
}

# The set read through CuPy and JAX (bfloat16 too: JAX has it; CuPy reads its bits as int16).
READ = {
    "read.w_f32": ((300, 129), "float32"),
    "read.h_f16": ((4097,), "float16"),
    "read.bf16": ((64, 33), "bfloat16"),
    "read.ids_i64": ((257,), "int64"),
    "read.q_u8": ((3, 5, 77), "uint8"),
    "read.i8": ((999,), "int8"),
    "read.scalar": ((), "float32"),
}

# The set the reader threads share: about 2 MB a generation.
THREADED = {
    "t.a_bf16": ((512, 1024), "bfloat16"),
    "t.b_f32": ((1024, 257), "float32"),
    "t.c_i64": ((3, 1000), "int64"),
    "t.d_u8": ((4099,), "uint8"),
}

GPT2 = dict(vocab=50257, d=768, heads=12, layers=4, max_len=1024)
GPT2_BATCH, GPT2_SEQ = 2, 64


# --------------------------------------------------------------------------------------------
# Contents: the same in every process, computed on the GPU.
# --------------------------------------------------------------------------------------------


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def pattern(specs, key, gen, device="cuda"):
    """Content `gen` of tensor `key` of `specs`: integers 0..250, exact in every dtype used here
    ((v - 125) / 4 for floating dtypes), every element different from the same element of every
    other content below 251 (7919 * d mod 251 = 138 * d mod 251 is not 0 for 0 < d < 251)."""
    shape, dt = specs[key]
    dtype = getattr(torch, dt)
    idx = torch.arange(numel(shape), device=device, dtype=torch.int64)
    v = (idx * 131 + (idx >> 9) * 17 + gen * 7919 + list(specs).index(key) * 104729) % 251
    if dtype.is_floating_point:
        out = ((v - 125).to(torch.float32) / 4).to(dtype)
    elif dtype == torch.int64:
        out = v + (gen << 40) - (5 << 33)  # the high bytes too
    elif dtype == torch.int8:
        out = (v - 125).to(dtype)
    else:
        out = v.to(dtype)
    return out.reshape(shape)


def contents(specs, gen, device="cuda"):
    return {k: pattern(specs, k, gen, device) for k in specs}


def raw(t):
    """The tensor's elements as bytes on its device (contiguous, row-major, 0-d as one element)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def digest(t):
    return hashlib.sha256(raw(t).cpu().numpy().tobytes()).hexdigest()


def describe(d):
    """What a process sees of each tensor of a dict: dtype, shape, device, digest of its bytes."""
    return {
        k: {"dtype": str(t.dtype), "shape": tuple(t.shape), "device": str(t.device),
            "digest": digest(t)}
        for k, t in d.items()
    }


def mismatches(seen, want):
    """Keys whose dtype, shape, device or bytes differ between two `describe`s (keys of one only
    included)."""
    bad = sorted(set(seen) ^ set(want))
    for k in sorted(set(seen) & set(want)):
        s, w = seen[k], want[k]
        if (s["dtype"], tuple(s["shape"])) != (w["dtype"], tuple(w["shape"])):
            bad.append(f"{k} ({s['dtype']} {tuple(s['shape'])}, "
                       f"not {w['dtype']} {tuple(w['shape'])})")
        elif not s["device"].startswith("cuda"):
            bad.append(f"{k} (on {s['device']})")
        elif s["digest"] != w["digest"]:
            bad.append(f"{k} (other bytes)")
    return bad


def gpu_sleep(ms=SLEEP_MS):
    """Keeps PyTorch's current stream busy for about `ms` ms (a kernel that spins), so that work
    enqueued after it, and not ordered after it, would find its results unwritten."""
    spin = getattr(torch.cuda, "_sleep", None)
    if spin is not None:
        spin(int(ms * 2_000_000))  # cycles, at about 2 GHz


# --------------------------------------------------------------------------------------------
# Other libraries, imported on first need (in the test's process and in the readers').
# --------------------------------------------------------------------------------------------


def import_cupy():
    cupy = pytest.importorskip("cupy")
    cupy.cuda.Device(0).use()
    return cupy


def import_jax():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)  # int64 tensors stay int64
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        # The docs' JAX examples (python/examples/torch_consumer.py) read frames on JAX's GPU.
        pytest.skip("JAX has no GPU backend here")
    return jax, gpus[0]


_streams = {}


def cupy_stream(cupy):
    """One non-blocking CuPy stream per process, kept alive for its life ("keep a
    cupy.cuda.Stream you made alive as long as its tensors")."""
    if "cupy" not in _streams:
        _streams["cupy"] = cupy.cuda.Stream(non_blocking=True)
    return _streams["cupy"]


def torch_side_stream():
    if "torch" not in _streams:
        _streams["torch"] = torch.cuda.Stream()
    return _streams["torch"]


def sleep_on_cupy_stream(cupy, cs, ms=SLEEP_MS):
    with torch.cuda.stream(torch.cuda.ExternalStream(cs.ptr)):
        gpu_sleep(ms)


def cupy_view(t):
    """A tensor CuPy can take through DLPack: bfloat16, which CuPy lacks, as its int16 bits."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


# --------------------------------------------------------------------------------------------
# The model of real shape: GPT-2 small's widths, four blocks.
# --------------------------------------------------------------------------------------------

if torch is not None:
    nn = torch.nn

    class GPT2ish(nn.Module):
        """Token and position embeddings, pre-norm `TransformerEncoderLayer` blocks with a causal
        mask (a decoder-only stack), a final LayerNorm and an output head tied to the token
        embedding (`lm_head.weight is wte.weight`: two keys of the state_dict, one storage)."""

        def __init__(self, vocab, d, heads, layers, max_len, device=None, dtype=None):
            super().__init__()
            kw = dict(device=device, dtype=dtype)
            self.wte = nn.Embedding(vocab, d, **kw)
            self.wpe = nn.Embedding(max_len, d, **kw)
            self.h = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True,
                    norm_first=True, **kw)
                for _ in range(layers)
            )
            self.ln_f = nn.LayerNorm(d, **kw)
            self.lm_head = nn.Linear(d, vocab, bias=False, **kw)
            self.lm_head.weight = self.wte.weight

        def forward(self, ids):
            t = ids.shape[1]
            pos = torch.arange(t, device=ids.device)
            h = self.wte(ids) + self.wpe(pos)[None]
            mask = torch.full((t, t), float("-inf"), device=ids.device, dtype=h.dtype).triu(1)
            for blk in self.h:
                h = blk(h, src_mask=mask, is_causal=True)
            return self.lm_head(self.ln_f(h))


def gpt2_ids(cfg, device="cuda"):
    """The input every process feeds the model (int64 token ids)."""
    n = GPT2_BATCH * GPT2_SEQ
    return (torch.arange(n, device=device).reshape(GPT2_BATCH, GPT2_SEQ) * 7919 + 11) % cfg["vocab"]


def logits_report(out):
    """The logits' digest, and enough to say by how much two outputs differ."""
    return {
        "digest": digest(out),
        "shape": tuple(out.shape),
        "dtype": str(out.dtype),
        "last_row": out[0, -1].float().cpu().tolist(),
        "sum": float(out.double().sum().item()),
    }


# --------------------------------------------------------------------------------------------
# Many small tensors of every documented dtype.
# --------------------------------------------------------------------------------------------

SMALL_COUNT = 3000
SMALL_SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (17, 3), (1, 1, 1), (64,), (5, 7, 3),
                (33,), (2, 2, 2, 2), (1000,), (0, 0)]


def small_dtypes():
    """Every dtype python/README.md lists ("float32/16/64, bfloat16, the five float8 kinds, ...
    int8/16/32/64, uint8/16/32/64, bool, complex64/128"), those this PyTorch has."""
    names = ["float32", "float16", "float64", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz",
             "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "int8", "int16", "int32", "int64",
             "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128"]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def small_state_dict(seed, device="cuda"):
    """SMALL_COUNT tensors: every dtype in every shape of SMALL_SHAPES (0-d and empty ones
    included), their bytes random (NaN and subnormal patterns of every float kind included, so
    only a bitwise copy keeps them; bool 0 or 1). A third are views into one shared buffer (each
    contiguous, none overlapping), the rest allocations of their own."""
    dtypes = small_dtypes()
    layout, off = [], 0
    for i in range(SMALL_COUNT):
        dt = dtypes[i % len(dtypes)]
        shape = SMALL_SHAPES[(i // len(dtypes)) % len(SMALL_SHAPES)]
        nb = numel(shape) * torch.empty((), dtype=dt).element_size()
        layout.append((f"layer{i // 40}.p{i}.{str(dt)[6:]}", dt, shape, off, nb))
        off += (nb + 15) // 16 * 16
    g = torch.Generator(device=device).manual_seed(seed)
    base = torch.randint(0, 256, (max(off, 1),), generator=g, dtype=torch.uint8, device=device)
    for _, dt, _, o, nb in layout:
        if dt == torch.bool:
            base[o:o + nb] &= 1
    out = {}
    for i, (name, dt, shape, o, nb) in enumerate(layout):
        t = base[o:o + nb].view(dt).reshape(shape)
        out[name] = t if i % 3 == 0 else t.clone()
    return out


def concat_digests(d):
    """Each tensor's digest, from one copy of all their bytes to the host."""
    raws = [raw(t) for t in d.values()]
    host = torch.cat(raws).cpu().numpy().tobytes() if raws else b""
    out, at = {}, 0
    for (k, t), r in zip(d.items(), raws):
        n = r.numel()
        out[k] = {"dtype": str(t.dtype), "shape": tuple(t.shape), "device": str(t.device),
                  "digest": hashlib.sha256(host[at:at + n]).hexdigest()}
        at += n
    return out


# --------------------------------------------------------------------------------------------
# Reader processes ("agents", gpu_agents.py): spawned once, driven by commands over a pipe
# (`_COMMANDS`), every wait bounded.
# --------------------------------------------------------------------------------------------


class _AgentState:
    def __init__(self):
        self.readers = {}
        self.consumer = None


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
    return {"names": list(r.names), "layout_fingerprint": r.layout_fingerprint,
            "read_only": r.read_only}


def _cmd_close(st, key):
    r = st.readers.pop(key, None)
    if r is not None:
        r.close()


def _cmd_close_all(st):
    if st.consumer is not None:
        c, st.consumer = st.consumer, None
        c.close()
    gc.collect()
    for key in list(st.readers):
        _cmd_close(st, key)


def _cmd_digests(st, key, than, timeout):
    """The generation taken (`than` None: `current`), each tensor described inside the hold."""
    h = _take(st.readers[key], than, timeout)
    if h is None:
        return None
    with h:
        d = h.tensors()
        res = {"gen": h.generation, "whole": h.whole, "tensors": describe(d)}
        torch.cuda.synchronize()
    return res


def _cmd_small(st, key, than, timeout):
    """As `digests`, for thousands of tensors: their bytes copied to the host at once."""
    h = _take(st.readers[key], than, timeout)
    if h is None:
        return None
    with h:
        d = h.tensors()
        res = {"gen": h.generation, "whole": h.whole, "tensors": concat_digests(d)}
        torch.cuda.synchronize()
    return res


def _cmd_gpt2(st, key, cfg, than, timeout):
    """The model made on the meta device, its weights assigned from the set
    (`load_state_dict(h.tensors(), assign=True)`), run on the fixed input inside the hold."""
    h = _take(st.readers[key], than, timeout)
    if h is None:
        return None
    with h:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        d = h.tensors()
        model = GPT2ish(**cfg, device="meta", dtype=torch.bfloat16)
        model.load_state_dict(d, assign=True)  # strict: every key, nothing else
        loaded = torch.cuda.memory_allocated() - before
        model.eval()
        sd = model.state_dict()
        res = {
            "gen": h.generation,
            "whole": h.whole,
            "tensors": describe(d),
            "assigned": all(sd[k].data_ptr() == t.data_ptr() for k, t in d.items()),
            "meta_left": [k for k, t in sd.items() if t.is_meta],
            "load_device_bytes": loaded,
            "tied_same_ptr": d["wte.weight"].data_ptr() == d["lm_head.weight"].data_ptr(),
            # Kept to explain a difference of outputs: kernels may be chosen by alignment.
            "align": {k: t.data_ptr() % 256 for k, t in d.items() if t.numel()},
        }
        with torch.inference_mode():
            out = model(gpt2_ids(cfg))
        res["logits"] = logits_report(out)
        torch.cuda.synchronize()
    return res


def _read_cupy(h, cs, cupy, after_torch):
    """Every tensor of the hold read by CuPy on its own stream `cs`, compared there with the
    generation's content: through `tensors(stream=cs)`, or (`after_torch`) `tensors()` on
    PyTorch's current stream, which DLPack then orders `cs` after."""
    d = h.tensors() if after_torch else h.tensors(stream=cs)
    bad, ptrs = [], {}
    with cs:
        for k, t in d.items():
            a = cupy.from_dlpack(cupy_view(t))
            e = cupy.from_dlpack(cupy_view(pattern(READ, k, h.generation)))
            ptrs[k] = (a.data.ptr, t.data_ptr())
            if a.shape != tuple(t.shape) or a.dtype != e.dtype or not bool(cupy.array_equal(a, e)):
                bad.append(k)
            del a, e
        cs.synchronize()
    return {"bad": bad, "copied": sorted(k for k, (p, q) in ptrs.items() if p != q)}


def _read_jax(h, jax):
    """Every tensor of the hold read by JAX through DLPack, compared on JAX's GPU with the
    generation's content; every array finished and dropped before the release (the docs' JAX note:
    "finish with it (block_until_ready()) and drop it ... before the release")."""
    jnp = jax.numpy
    d = h.tensors()
    bad = []
    for k, t in d.items():
        a = jax.dlpack.from_dlpack(t)
        e = jax.dlpack.from_dlpack(pattern(READ, k, h.generation))
        same = bool(jnp.array_equal(a, e))
        if tuple(a.shape) != tuple(t.shape) or str(a.dtype) != str(t.dtype)[6:] or not same:
            bad.append(k)
        a.block_until_ready()
        del a, e
    return {"bad": bad}


def _cmd_foreign_read(st, key, than, timeout, lib, first):
    """Waits for a generation newer than `than` (the writer's stream may still be writing it) and
    reads it through `lib`, by each way, starting with way `first`."""
    if lib == "cupy":
        cupy = import_cupy()
        cs = cupy_stream(cupy)
        ways = {"cupy, tensors(stream=cs)": lambda h: _read_cupy(h, cs, cupy, False),
                "cupy after tensors()": lambda h: _read_cupy(h, cs, cupy, True)}
    else:
        jax, _ = import_jax()
        ways = {"jax.dlpack.from_dlpack": lambda h: _read_jax(h, jax)}
    order = list(ways)
    order = order[first % len(order):] + order[:first % len(order)]
    h = st.readers[key].wait_newer(than, timeout=timeout)
    res = {"gen": h.generation, "whole_at_take": h.whole, "ways": {}}
    try:
        for way in order:
            try:
                res["ways"][way] = ways[way](h)
            except Exception as e:  # noqa: BLE001 - reported to the test
                res["ways"][way] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        gc.collect()
        h.release()
    return res


def frame_pattern(i, device="cuda"):
    """Frame `i`'s bytes (uint8, the whole buffer)."""
    idx = torch.arange(FRAME_BYTES, device=device, dtype=torch.int64)
    return ((idx * 131 + (idx >> 9) * 17 + i * 7919) % 251).to(torch.uint8)


def _cmd_frames_attach(st, name):
    st.consumer = cuda_ipc.Consumer(name, delivery="every")
    return os.getpid()


def _cmd_frames_read(st, lib, count, timeout):
    """Receives `count` frames and reads frame i through `lib`, by way i % (number of ways),
    comparing with frame i's bytes on the GPU; each array dropped before the frame's release."""
    rx = st.consumer
    out = []
    if lib == "cupy":
        cupy = import_cupy()
        cs = cupy_stream(cupy)
        n = len(("from_dlpack", "as_cupy", "cuda_array_interface"))
    else:
        jax, _ = import_jax()
        n = 1
    for i in range(count):
        frame = rx.recv(timeout=timeout)
        rec = {"seq": frame.seq, "metadata": frame.metadata, "way": None, "ok": False,
               "error": None}
        try:
            want = frame_pattern(int(frame.metadata.decode()))
            if lib == "cupy":
                rec["way"] = ("from_dlpack", "as_cupy", "cuda_array_interface")[i % n]
                with cs:
                    if rec["way"] == "from_dlpack":
                        a = cupy.from_dlpack(frame)
                    elif rec["way"] == "as_cupy":
                        a = frame.as_cupy((FRAME_BYTES // 4,), cupy.float32).view(cupy.uint8)
                    else:
                        # The view does not hold the frame; the Frame object does, until release.
                        a = cupy.asarray(frame)
                    e = cupy.from_dlpack(want)
                    rec["ok"] = a.shape == (FRAME_BYTES,) and bool(cupy.array_equal(a, e))
                    del a, e
                    cs.synchronize()
            else:
                rec["way"] = "jax.dlpack.from_dlpack"
                a = jax.dlpack.from_dlpack(frame)
                e = jax.dlpack.from_dlpack(want)
                rec["ok"] = tuple(a.shape) == (FRAME_BYTES,) and bool(jax.numpy.array_equal(a, e))
                a.block_until_ready()
                del a, e
        except Exception as ex:  # noqa: BLE001 - reported to the test
            rec["error"] = f"{type(ex).__name__}: {ex}"
        finally:
            gc.collect()
            frame.release()
        out.append(rec)
    return out


def _cmd_threads(st, name, n, last, timeout, pause):
    """`n` threads share one reader of set `name` and take generations until they have seen
    generation `last`: even threads by `wait_newer`, odd ones by `current` (the newest, again and
    again, `pause` seconds apart); half of them with `tensors(stream=s)`, half under
    `torch.cuda.stream(s)`, each thread a stream of its own. Every tensor is compared on the GPU,
    inside the hold, with its generation's content. Holds are released in turn by `release()`, a
    `with` block, and collection."""
    r = cuda_ipc.TensorSetReader(name)
    st.readers["threads"] = r
    keys = list(THREADED)
    reports = [None] * n
    start = threading.Barrier(n + 1)

    def check(h, s, pass_stream):
        g = h.generation
        if pass_stream:
            d = h.tensors(stream=s)
        else:
            with torch.cuda.stream(s):
                d = h.tensors()
        with torch.cuda.stream(s):
            bad = [k for k in keys if not torch.equal(d[k], pattern(THREADED, k, g))]
        del d
        return g, bad

    def run(i):
        rep = {"takes": 0, "gens": [], "bad": [], "backwards": [], "none": 0, "error": None}
        reports[i] = rep
        s = torch.cuda.Stream()
        by_current, pass_stream = i % 2 == 1, (i // 2) % 2 == 0
        seen, prev = 0, 0
        deadline = time.monotonic() + timeout
        try:
            start.wait(timeout)
            while seen < last:
                if time.monotonic() > deadline:
                    rep["error"] = f"generation {last} not seen within {timeout} s (last {seen})"
                    break
                if by_current:
                    h = r.current(timeout=timeout)
                else:
                    h = r.wait_newer(seen, timeout=timeout)
                if h is None:
                    rep["none"] += 1  # in place there is always one once committed (no aborts here)
                    continue
                how = (i + rep["takes"]) % 3
                if how == 0:
                    g, bad = check(h, s, pass_stream)
                    h.release()
                elif how == 1:
                    with h:
                        g, bad = check(h, s, pass_stream)
                else:
                    g, bad = check(h, s, pass_stream)
                    del h  # collected: released
                rep["takes"] += 1
                if g < prev:
                    rep["backwards"].append((prev, g))
                if bad:
                    rep["bad"].append((g, bad))
                if not rep["gens"] or rep["gens"][-1] != g:
                    rep["gens"].append(g)
                prev, seen = g, max(seen, g)
                if by_current and pause:
                    time.sleep(pause)
        except Exception as e:  # noqa: BLE001 - reported to the test
            rep["error"] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    start.wait(timeout)
    return_by = time.monotonic() + timeout + 5.0
    for t in threads:
        t.join(max(0.0, return_by - time.monotonic()))
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    torch.cuda.synchronize()
    return {"reports": reports, "stuck": stuck}


def _cmd_ping(st):
    return os.getpid()


_COMMANDS = {
    "open": _cmd_open,
    "close": _cmd_close,
    "close_all": _cmd_close_all,
    "digests": _cmd_digests,
    "small": _cmd_small,
    "gpt2": _cmd_gpt2,
    "foreign_read": _cmd_foreign_read,
    "frames_attach": _cmd_frames_attach,
    "frames_read": _cmd_frames_read,
    "threads": _cmd_threads,
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


# --------------------------------------------------------------------------------------------
# Fixtures (`cuda`, `agent_pool`, `agents`: gpu_agents.py)
# --------------------------------------------------------------------------------------------

_COUNTER = itertools.count()


@pytest.fixture(scope="module")
def pool(cuda):
    # One MemPool for the module: the arena's chunk size is fixed by the first call anyway.
    return cuda_ipc.torch_mem_pool(0)


@pytest.fixture
def names():
    """Unique set and channel names (pid, a counter, random digits); whatever a failed test left
    in /dev/shm under them is removed after."""
    tag = f"{os.getpid()}-{next(_COUNTER)}-{uuid.uuid4().hex[:6]}"
    made = []

    def make(what):
        n = f"pytest-tsf-{tag}-{what}"
        made.append(n)
        return n

    yield make
    remove_leftovers(made)


# --------------------------------------------------------------------------------------------
# 1. Memory of other libraries given to every writer entry.
# --------------------------------------------------------------------------------------------

EXACT = "exact"  # taken: a reader sees exactly the source's bytes
EITHER = "either"  # docs silent: taken with the exact bytes, or refused by a cuda_ipc error
INVALID = ("refused", cuda_ipc.InvalidArgument)  # documented refusal


class Sources:
    """One kind's sources of one content: `values` (the dict given to the writer), the `stream`
    they were written on (entries in `on_current` run with it as PyTorch's current stream, the
    others are given it as `stream=`), `refill(c)` writing content c into the same memory, on the
    same stream (None where the memory may not be written: a JAX array's), and what must stay
    alive (`keep`)."""

    def __init__(self, values, stream=None, on_current=(), refill=None, keep=()):
        self.values = values
        self.stream = stream
        self.on_current = on_current
        self.refill = refill
        self.keep = list(keep)


class Libs:
    """What the source makers need: the pool, streams, CuPy and JAX (imported on demand)."""

    def __init__(self, pool, lib):
        self.pool = pool
        self.cupy = import_cupy() if lib == "cupy" else None
        self.jax, self.jax_gpu = import_jax() if lib == "jax" else (None, None)
        self.async_pool = None


def _host(t):
    return t.cpu().numpy()


def _torch_refill(vals):
    def refill(c):
        for k, t in vals.items():
            t.copy_(pattern(FOREIGN, k, c))
    return refill


def make_torch_caching(c, libs):
    vals = contents(FOREIGN, c)
    return Sources(vals, refill=_torch_refill(vals))


def make_torch_side_stream(c, libs):
    # Written on a side stream that is still busy when the entry is called: the entry must be
    # ordered after it ("An update runs on PyTorch's current stream (or begin(stream=...))").
    s = torch_side_stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gpu_sleep()
        vals = contents(FOREIGN, c)

    def refill(c2):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            gpu_sleep()
            for k, t in vals.items():
                t.copy_(pattern(FOREIGN, k, c2))

    return Sources(vals, stream=s, on_current=("publish", "copy_plan"), refill=refill)


def make_torch_pinned(c, libs):
    vals = {k: t.cpu().pin_memory() for k, t in contents(FOREIGN, c).items()}
    assert all(t.is_pinned() for t in vals.values() if t.numel())
    return Sources(vals)


def make_torch_cpu(c, libs):
    return Sources({k: t.cpu() for k, t in contents(FOREIGN, c).items()})


def make_torch_freed(c, libs):
    # FSDP frees a parameter's memory this way: the tensor keeps its shape, data_ptr() becomes 0.
    vals = contents(FOREIGN, c)
    for t in vals.values():
        if t.numel():
            t.untyped_storage().resize_(0)
    return Sources(vals)


def make_torch_pool(c, libs):
    with torch.cuda.use_mem_pool(libs.pool):
        vals = contents(FOREIGN, c)
    for t in vals.values():
        if t.numel():
            cuda_ipc.arena_locate(t.data_ptr(), t.nbytes)  # raises unless in the arena
    return Sources(vals, refill=_torch_refill(vals))


def _cupy_arrays(c, cupy):
    arrs = {k: cupy.asarray(_host(t)) for k, t in contents(FOREIGN, c).items()}
    cupy.cuda.Device().synchronize()
    return arrs


def make_cupy_raw(c, libs):
    cupy = libs.cupy
    arrs = _cupy_arrays(c, cupy)

    def refill(c2):
        for k, a in arrs.items():
            a[...] = cupy.asarray(_host(pattern(FOREIGN, k, c2)))
        cupy.cuda.Device().synchronize()

    return Sources(arrs, refill=refill)


def make_cupy_dlpack(c, libs):
    arrs = _cupy_arrays(c, libs.cupy)
    vals = {k: torch.from_dlpack(a) for k, a in arrs.items()}
    return Sources(vals, refill=_torch_refill(vals), keep=arrs.values())


def make_cupy_async_pool(c, libs):
    cupy = libs.cupy
    if libs.async_pool is None:
        libs.async_pool = cupy.cuda.MemoryAsyncPool()
    with cupy.cuda.using_allocator(libs.async_pool.malloc):
        arrs = _cupy_arrays(c, cupy)
    vals = {k: torch.from_dlpack(a) for k, a in arrs.items()}
    return Sources(vals, refill=_torch_refill(vals), keep=arrs.values())


def make_cupy_stream(c, libs):
    # Written on a CuPy stream of its own that is still busy; PyTorch's view is made outside it
    # (so DLPack orders nothing after it): only `stream=cs` orders the entry after the write.
    cupy = libs.cupy
    cs = cupy_stream(cupy)
    srcs = _cupy_arrays(c, cupy)
    arrs = {k: cupy.empty(a.shape, a.dtype) for k, a in srcs.items()}
    cupy.cuda.Device().synchronize()
    sleep_on_cupy_stream(cupy, cs)
    with cs:
        for k, a in arrs.items():
            a[...] = srcs[k]
    vals = {k: torch.from_dlpack(a) for k, a in arrs.items()}
    keep = [srcs, arrs]

    def refill(c2):
        new = _cupy_arrays(c2, cupy)
        keep.append(new)
        sleep_on_cupy_stream(cupy, cs)
        with cs:
            for k, a in arrs.items():
                a[...] = new[k]

    return Sources(vals, stream=cs, refill=refill, keep=keep)


def _zero_copy_torch(arrs, what):
    """PyTorch tensors over CuPy arrays through `__cuda_array_interface__` (DLPack would call
    managed memory `kDLCUDAManaged`), checked to be views, not copies."""
    vals = {}
    for k, a in arrs.items():
        try:
            t = torch.as_tensor(a, device="cuda")
        except Exception as e:  # noqa: BLE001 - a limit of PyTorch or CuPy, not of cuda_ipc
            pytest.skip(f"PyTorch cannot view {what} ({type(e).__name__}: {e})")
        if a.size and t.data_ptr() != a.data.ptr:
            pytest.skip(f"PyTorch copied {what} instead of viewing it")
        vals[k] = t
    return vals


def make_cupy_managed(c, libs):
    cupy = libs.cupy
    with cupy.cuda.using_allocator(cupy.cuda.malloc_managed):
        arrs = _cupy_arrays(c, cupy)
    vals = _zero_copy_torch(arrs, "CuPy's managed memory")
    return Sources(vals, refill=_torch_refill(vals), keep=arrs.values())


def make_cupy_host_mapped(c, libs):
    # Pinned host memory, which the GPU reaches through unified addressing, as a CUDA tensor.
    import numpy

    cupy = libs.cupy
    arrs, keep = {}, []
    for k, t in contents(FOREIGN, c).items():
        host = _host(t)
        nb = max(host.nbytes, 1)
        pinned = cupy.cuda.alloc_pinned_memory(nb)
        numpy.frombuffer(pinned, dtype=numpy.uint8, count=host.nbytes)[:] = (
            host.reshape(-1).view(numpy.uint8))
        mem = cupy.cuda.UnownedMemory(pinned.ptr, nb, pinned, 0)
        arrs[k] = cupy.ndarray(host.shape, host.dtype, cupy.cuda.MemoryPointer(mem, 0))
        keep.append(pinned)
    vals = _zero_copy_torch(arrs, "pinned host memory as a CUDA array")
    return Sources(vals, refill=_torch_refill(vals), keep=keep + list(arrs.values()))


def _jax_arrays(c, libs):
    arrs = {k: libs.jax.device_put(_host(t), libs.jax_gpu) for k, t in contents(FOREIGN, c).items()}
    for a in arrs.values():
        a.block_until_ready()
    return arrs


def make_jax_raw(c, libs):
    return Sources(_jax_arrays(c, libs))


def make_jax_dlpack(c, libs):
    arrs = _jax_arrays(c, libs)
    vals = {k: torch.from_dlpack(a) for k, a in arrs.items()}
    # No refill: JAX assumes its arrays never change (the docs' JAX note).
    return Sources(vals, keep=arrs.values())


# Per kind: its library, its maker, and what each entry is expected to do with its sources.
# - specs: `TensorSetWriter(name, tensors)` "takes each tensor's name, shape and dtype"
#   (TensorSpecs: "Name -> torch.Tensor ... or name -> (shape, dtype)"; "InvalidArgument for bad
#   specs"). Taken means the layout of the same (shape, dtype) specs.
# - publish, copy_from, copy_plan: "Or with a copy, from any tensors and any allocator"; "a CPU
#   tensor given to a GPU set is refused ..., and so are a tensor of another device and one whose
#   storage was freed (data_ptr() 0)"; plans take "contiguous CUDA tensors of the set's device".
# - over_tensors: "InvalidArgument for a value that is not a tensor, a tensor with bytes allocated
#   elsewhere (a CPU tensor, PyTorch's own allocator) or on another device".
KINDS = {
    "torch-caching": dict(lib=None, make=make_torch_caching, specs=EXACT, publish=EXACT,
                          copy_from=EXACT, copy_plan=EXACT, over_tensors=INVALID),
    "torch-side-stream": dict(lib=None, make=make_torch_side_stream, specs=EXACT, publish=EXACT,
                              copy_from=EXACT, copy_plan=EXACT, over_tensors=INVALID),
    # Host tensors: the specs take shape and dtype only; a GPU set refuses them as sources.
    "torch-pinned": dict(lib=None, make=make_torch_pinned, specs=EXACT, publish=INVALID,
                         copy_from=INVALID, copy_plan=INVALID, over_tensors=INVALID),
    "torch-cpu": dict(lib=None, make=make_torch_cpu, specs=EXACT, publish=INVALID,
                      copy_from=INVALID, copy_plan=INVALID, over_tensors=INVALID),
    # Docs silent on specs from a freed tensor (its shape and dtype are there, its bytes not).
    # A plan's sources: "the driver checks their memory at the plan's first update", so the plan
    # may be made and its publish refused; either counts as the plan refused.
    "torch-freed": dict(lib=None, make=make_torch_freed, specs=EITHER, publish=INVALID,
                        copy_from=INVALID, copy_plan=INVALID, over_tensors=INVALID),
    # The extension's own pool: every entry takes it (the positive control of over_tensors).
    "torch-mem-pool": dict(lib=None, make=make_torch_pool, specs=EXACT, publish=EXACT,
                           copy_from=EXACT, copy_plan=EXACT, over_tensors=EXACT),
    # A CuPy array as it is. Docs ambiguous: "from any tensors" (python/README.md, "Or with a
    # copy") against "Copies CUDA tensors" and TensorSpecs' "torch.Tensor" (cuda_ipc.pyi); the
    # publish docstring checks "that every value is a tensor" without naming the error class.
    "cupy-array": dict(lib="cupy", make=make_cupy_raw, specs=EITHER, publish=EITHER,
                       copy_from=EITHER, copy_plan=EITHER, over_tensors=INVALID),
    # CuPy's memory seen by PyTorch (`torch.from_dlpack`): "any allocator".
    "cupy-dlpack": dict(lib="cupy", make=make_cupy_dlpack, specs=EXACT, publish=EXACT,
                        copy_from=EXACT, copy_plan=EXACT, over_tensors=INVALID),
    # cudaMallocAsync memory (CuPy's MemoryAsyncPool): readable device memory of the device.
    "cupy-async-pool": dict(lib="cupy", make=make_cupy_async_pool, specs=EXACT, publish=EXACT,
                            copy_from=EXACT, copy_plan=EXACT, over_tensors=INVALID),
    # A cupy.cuda.Stream as `stream=`: StreamLike names it.
    "cupy-stream": dict(lib="cupy", make=make_cupy_stream, specs=EXACT, publish=EXACT,
                        copy_from=EXACT, copy_plan=EXACT, over_tensors=INVALID),
    # Docs silent on managed memory and on pinned host memory mapped for the GPU: "any allocator"
    # against "memory the driver does not know as readable memory of the set's device is refused".
    "cupy-managed": dict(lib="cupy", make=make_cupy_managed, specs=EXACT, publish=EITHER,
                         copy_from=EITHER, copy_plan=EITHER, over_tensors=INVALID),
    "cupy-host-mapped": dict(lib="cupy", make=make_cupy_host_mapped, specs=EXACT, publish=EITHER,
                             copy_from=EITHER, copy_plan=EITHER, over_tensors=INVALID),
    # A JAX array as it is: as a CuPy array's.
    "jax-array": dict(lib="jax", make=make_jax_raw, specs=EITHER, publish=EITHER,
                      copy_from=EITHER, copy_plan=EITHER, over_tensors=INVALID),
    # JAX's memory (XLA's allocator, the primary context) seen by PyTorch.
    "jax-dlpack": dict(lib="jax", make=make_jax_dlpack, specs=EXACT, publish=EXACT,
                       copy_from=EXACT, copy_plan=EXACT, over_tensors=INVALID),
}


def _entry_stream(src, entry):
    """How an entry is given the sources' stream: as PyTorch's current stream, or as `stream=`."""
    if src.stream is None:
        return contextlib.nullcontext(), {}
    if entry in src.on_current:
        return torch.cuda.stream(src.stream), {}
    return contextlib.nullcontext(), {"stream": src.stream}


def _attempt(call):
    """("ok", value), ("refused", a cuda_ipc error) or ("crash", any other exception)."""
    try:
        return ("ok", call())
    except cuda_ipc.CudaIpcError as e:
        return ("refused", e)
    except Exception as e:  # noqa: BLE001 - judged by the test: never expected
        return ("crash", e)


class Judge:
    """Collects what differs from the expectations of `KINDS`, so that one entry's failure does
    not hide another's."""

    def __init__(self, kind):
        self.kind = kind
        self.problems = []

    def add(self, msg):
        self.problems.append(f"{self.kind}: {msg}")

    def outcome(self, entry, want, outcome, keys, named=True):
        """Whether the entry took the sources (so their bytes must be what a reader sees). A
        refusal must name one of `keys` where `named`."""
        status, value = outcome
        if status == "crash":
            self.add(f"{entry}: raised {type(value).__name__}, not a cuda_ipc error: {value}")
            return False
        if status == "refused":
            if want == EXACT:
                self.add(f"{entry}: refused ({type(value).__name__}: {value}); the docs say taken")
            elif isinstance(want, tuple) and not isinstance(value, want[1]):
                self.add(f"{entry}: raised {type(value).__name__}, the docs say "
                         f"{want[1].__name__}: {value}")
            # Docs silent on the words; a user with hundreds of tensors needs the one refused.
            if named and not any(k in str(value) for k in keys):
                self.add(f"{entry}: the error names no tensor: {type(value).__name__}: {value}")
            return False
        if isinstance(want, tuple):
            self.add(f"{entry}: taken; the docs say {want[1].__name__}")
        return True


@pytest.mark.parametrize("kind", list(KINDS))
def test_memory_of_other_libraries_given_to_every_writer_entry(cuda, pool, agents, names, kind):
    spec = KINDS[kind]
    libs = Libs(pool, spec["lib"])
    (a,) = agents.get(1)
    make = spec["make"]
    judge = Judge(kind)
    keys = list(FOREIGN)
    expect = {}  # content number -> what a reader must see

    def want(c):
        if c not in expect:
            expect[c] = describe(contents(FOREIGN, c))
        return expect[c]

    counter = itertools.count(1)
    kept = []  # every source stays alive until the end, whichever stream copies it
    writers = []
    name = names(kind)
    ref = cuda_ipc.TensorSetWriter(names(f"{kind}-ref"), FOREIGN, mode="buffered")
    ref_fp = ref.layout_fingerprint
    ref.close(timeout=10.0)
    try:
        # The specs. Buffered, so that a refused update leaves the last generation readable ("In
        # double-buffered mode an abort leaves the last generation readable").
        src = make(next(counter), libs)
        kept.append(src)
        got = _attempt(lambda: cuda_ipc.TensorSetWriter(name, src.values, mode="buffered"))
        if judge.outcome("specs", spec["specs"], got, keys):
            w = got[1]
            if w.layout_fingerprint != ref_fp or set(w.names) != set(FOREIGN):
                judge.add(f"specs: taken with another layout: {w.names}")
        else:
            w = cuda_ipc.TensorSetWriter(name, FOREIGN, mode="buffered")
        writers.append(w)

        # A first generation from PyTorch's own memory.
        c = next(counter)
        published = {w.publish(contents(FOREIGN, c), timeout=ANSWER): c}
        a.call("open", "f", name, {})
        first = a.call("digests", "f", None, ANSWER)
        assert first is not None and first["gen"] == w.generation, first
        assert not mismatches(first["tensors"], want(c)), mismatches(first["tensors"], want(c))

        def read_back(entry, took, c):
            """What a reader sees after the entry: content c in a new generation if it took the
            sources, else the last generation as it was."""
            last = max(published)
            if took:
                g = w.generation
                if g <= last:
                    judge.add(f"{entry}: taken, yet the writer's generation is {g}, "
                              f"not past {last}")
                    return
                published[g] = c
                res = a.call("digests", "f", last, ANSWER)
            else:
                if w.generation != last:
                    judge.add(f"{entry}: refused, yet the writer's generation is {w.generation}")
                res = a.call("digests", "f", None, ANSWER)
            if res is None:
                judge.add(f"{entry}: the reader found no generation")
                return
            c_seen = published.get(res["gen"])
            if c_seen is None or res["gen"] != max(published):
                judge.add(f"{entry}: the reader took generation {res['gen']}, not {max(published)}")
                return
            bad = mismatches(res["tensors"], want(c_seen))
            if bad:
                judge.add(f"{entry}: generation {res['gen']} is not the "
                          f"{'sources' if took else 'last generation'}' bytes: {bad}")

        # publish
        c = next(counter)
        src = make(c, libs)
        kept.append(src)

        def publish():
            ctx, kw = _entry_stream(src, "publish")
            with ctx:
                return w.publish(src.values, timeout=ANSWER, **kw)

        took = judge.outcome("publish", spec["publish"], _attempt(publish), keys)
        read_back("publish", took, c)

        # begin().copy_from
        c = next(counter)
        src = make(c, libs)
        kept.append(src)

        def copy_from():
            ctx, kw = _entry_stream(src, "copy_from")
            with ctx:
                with w.begin(timeout=ANSWER, **kw) as u:  # an exception aborts the update
                    u.copy_from(src.values)
            return w.generation

        took = judge.outcome("copy_from", spec["copy_from"], _attempt(copy_from), keys)
        read_back("copy_from", took, c)

        # copy_plan, published; then its sources rewritten in place and published again.
        c = next(counter)
        src = make(c, libs)
        kept.append(src)
        plan = []

        def plan_publish():
            if not plan:
                plan.append(w.copy_plan(src.values))
            ctx, kw = _entry_stream(src, "copy_plan")
            with ctx:
                return w.publish(plan[0], timeout=ANSWER, **kw)

        took = judge.outcome("copy_plan", spec["copy_plan"], _attempt(plan_publish), keys)
        read_back("copy_plan", took, c)
        if took and src.refill is not None:
            c = next(counter)
            src.refill(c)
            took = judge.outcome("copy_plan again", spec["copy_plan"], _attempt(plan_publish), keys)
            read_back("copy_plan again", took, c)

        # over_tensors, under a name of its own.
        c = next(counter)
        src = make(c, libs)
        kept.append(src)
        n2 = names(f"{kind}-ot")
        got = _attempt(lambda: cuda_ipc.TensorSetWriter.over_tensors(n2, src.values))
        # Not asked to name a tensor: "a dict with no bytes in the pool" is refused as a whole.
        if judge.outcome("over_tensors", spec["over_tensors"], got, keys, named=False):
            writers.append(got[1])
            torch.cuda.synchronize()
            a.call("open", "ot", n2, {})
            res = a.call("digests", "ot", None, ANSWER)
            if res is None or res["gen"] != 1:
                judge.add(f"over_tensors: the reader took {res and res['gen']}, not generation 1")
            elif mismatches(res["tensors"], want(c)):
                judge.add("over_tensors: not the tensors' bytes: "
                          f"{mismatches(res['tensors'], want(c))}")
        else:
            # A refusal leaves nothing under the name.
            try:
                a.call("open", "ot", n2, {})
                judge.add("over_tensors: refused, yet a set is there under its name")
            except gpu_agents.AgentError as e:
                if not e.is_a("TensorSetNotFound"):
                    judge.add(f"over_tensors: refused; opening its name raised {e.mro[0]}: "
                              f"{e.message}")
        assert not judge.problems, "\n".join(judge.problems)
    finally:
        close_all([a], *writers)
        torch.cuda.synchronize()
        del kept


# --------------------------------------------------------------------------------------------
# 1b. A host frame's write given other libraries' objects; a GPU frame's write refused.
# --------------------------------------------------------------------------------------------


def test_a_host_frames_write_takes_the_bytes_of_other_libraries_objects_or_refuses(cuda, names):
    # Documented: "write(data, offset=0) copies data in (returns the bytes written)"; "bytes, or any
    # object exporting a buffer"; "TypeError for what is not bytes-like". Docs silent on what a
    # refused write leaves: a user expects the buffer as it was. Docs silent on a strided buffer
    # (a NumPy slice with a step): its logical bytes in C order, as bytes(memoryview(x)) gives,
    # or a refusal; never the memory between its elements.
    import numpy

    slot = 1024
    cases = [
        ("numpy uint8", (numpy.arange(300) * 7 % 256).astype(numpy.uint8), False),
        ("numpy float32", numpy.linspace(-3, 3, 200, dtype=numpy.float32), False),
        ("numpy strided", numpy.arange(200, dtype=numpy.int32)[::3], True),
        ("numpy view of pinned PyTorch memory",
         (torch.arange(256, dtype=torch.int16) * 3).pin_memory().numpy(), False),
        ("torch cpu tensor", torch.arange(64, dtype=torch.int32), True),
        ("torch cuda tensor", torch.arange(64, dtype=torch.int32, device="cuda"), True),
    ]
    try:
        cupy = import_cupy()
        cases.append(("cupy array", cupy.arange(64, dtype=cupy.int32), True))
    except pytest.skip.Exception:
        pass
    try:
        jax, gpu = import_jax()
        arr = jax.device_put(numpy.arange(64, dtype=numpy.int32), gpu)
        cases.append(("jax gpu array", arr, True))
    except pytest.skip.Exception:
        pass

    def logical(obj):
        if isinstance(obj, numpy.ndarray):
            return obj.tobytes()
        if isinstance(obj, torch.Tensor):
            return obj.cpu().numpy().tobytes()
        return numpy.asarray(obj.get() if hasattr(obj, "get") else obj).tobytes()

    name = names("host-write")
    nbytes = slot * (len(cases) + 1)
    base = bytes((i * 7 + 3) % 256 for i in range(nbytes))
    problems, expect = [], bytearray(base)
    with cuda_ipc.Producer(name, nbytes, buffers=2, memory="host") as tx:
        with cuda_ipc.Consumer(name) as rx:
            with tx.acquire(timeout=ANSWER) as w:
                assert w.write(base) == nbytes
                for i, (what, obj, may_refuse) in enumerate(cases):
                    off = slot * (i + 1)
                    want = logical(obj)
                    assert len(want) <= slot
                    try:
                        n = w.write(obj, offset=off)
                    except (TypeError, BufferError, cuda_ipc.CudaIpcError) as e:
                        # BufferError: Python's own error for an export that fails (docs silent).
                        if not may_refuse:
                            problems.append(f"{what}: refused ({type(e).__name__}: {e})")
                        continue
                    except Exception as e:  # noqa: BLE001
                        problems.append(f"{what}: raised {type(e).__name__}: {e}")
                        continue
                    if n != len(want):
                        problems.append(f"{what}: write returned {n}, its bytes are {len(want)}")
                    expect[off:off + len(want)] = want
                w.publish(b"foreign")
            with rx.recv(timeout=ANSWER) as frame:
                got = frame.bytes()
    for i, (what, _, _) in enumerate(cases):
        off = slot * (i + 1)
        if got[off:off + slot] != bytes(expect[off:off + slot]):
            problems.append(f"{what}: the buffer holds other bytes than written (or than before "
                            "a refused write)")
    assert got[:slot] == base[:slot]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------
# 2. Readers through CuPy and JAX: sets' tensors and frames.
# --------------------------------------------------------------------------------------------

READ_GENS = 4


@pytest.mark.parametrize("lib", ["cupy", "jax"])
def test_a_sets_tensors_read_through_another_library_are_the_writers(cuda, agents, names, lib):
    # Documented: "CuPy and JAX take the tensors through DLPack"; "tensors() makes PyTorch's
    # current stream (or tensors(stream=...)) wait on the GPU for the generation". Each generation
    # is published with the writer's stream kept busy first, so the reader takes it (its commit
    # is on the host) while its bytes are still being written: only the GPU-side waits make the
    # reads right.
    # The docs' JAX note is about frames ("An array made from a frame is a view of a buffer the
    # producer writes again once the frame is released: finish with it ... and drop it ... before
    # the release"); for a set's tensors they say only that JAX takes them through DLPack, not
    # that a JAX array stays right across an in-place generation. So every JAX array here is made,
    # checked, finished and dropped inside its hold, and each in-place generation is read through
    # new arrays; nothing is asserted of an array kept past its hold.
    if lib == "cupy":
        import_cupy()
    else:
        import_jax()
    (a,) = agents.get(1)
    name = names(f"read-{lib}")
    w = cuda_ipc.TensorSetWriter(name, READ)  # in place: every generation in the same memory
    s = torch.cuda.Stream()
    kept = []
    try:
        a.call("open", "r", name, {})
        for g in range(1, READ_GENS + 1):
            seq = a.send("foreign_read", "r", g - 1, ANSWER, lib, g)
            src = contents(READ, g)
            kept.append(src)
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                gpu_sleep(2 * SLEEP_MS)
                assert w.publish(src, timeout=ANSWER) == g
            res = a.result(seq, 2 * ANSWER)
            assert res["gen"] == g, res
            assert res["ways"], res
            for way, r in res["ways"].items():
                assert "error" not in r, f"generation {g}, {way}: {r['error']}"
                assert r["bad"] == [], f"generation {g}, {way}: not the writer's values: {r['bad']}"
    finally:
        close_all([a], w)
        torch.cuda.synchronize()


FRAMES = 9


@pytest.mark.parametrize("lib", ["cupy", "jax"])
def test_frames_written_and_read_through_another_library_hold_the_producers_bytes(
    cuda, agents, names, lib
):
    # Documented: "as_tensor(shape, dtype) (PyTorch) and as_cupy(shape, dtype) (CuPy)" on Frame and
    # WriteFrame; DLPack "what torch.from_dlpack, cupy.from_dlpack, jax.dlpack.from_dlpack ...
    # use"; "__cuda_array_interface__ ...: the view does not hold the frame"; work on "PyTorch's or
    # CuPy's current stream, JAX's" is ordered both ways. A GPU frame's write and read raise
    # NotSupported ("so do ... write/read/bytes on a GPU frame").
    if lib == "cupy":
        cupy = import_cupy()
        cs = cupy_stream(cupy)
        async_pool = cupy.cuda.MemoryAsyncPool()
    else:
        jax, gpu = import_jax()
    (a,) = agents.get(1)
    name = names(f"frames-{lib}")
    side = torch_side_stream()
    kept = []
    tx = cuda_ipc.Producer(name, FRAME_BYTES, buffers=4)
    closed = False
    try:
        a.call("frames_attach", name)
        deadline = time.monotonic() + ANSWER
        while not tx.stats()["consumers"]:
            assert time.monotonic() < deadline, "the consumer never attached"
            time.sleep(0.01)
        seq = a.send("frames_read", lib, FRAMES, ANSWER)
        for i in range(FRAMES):
            exp = frame_pattern(i)
            kept.append(exp)
            with tx.acquire(timeout=ANSWER) as w:
                if i == 0:
                    with pytest.raises(cuda_ipc.NotSupported):
                        w.write(b"abc")
                    with pytest.raises(cuda_ipc.NotSupported):
                        w.read()
                    # Docs silent on which check comes first for an object that is not
                    # bytes-like given to a GPU frame: TypeError or NotSupported, nothing written.
                    foreign = (cupy.arange(4, dtype=cupy.int32) if lib == "cupy"
                               else jax.device_put(numpy_arange(4), gpu))
                    with pytest.raises((cuda_ipc.NotSupported, TypeError)):
                        w.write(foreign)
                way = i % 3
                if way == 0:
                    # PyTorch on a side stream still busy: as_tensor orders the publish after it.
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        gpu_sleep()
                        w.as_tensor().copy_(exp)
                elif lib == "cupy" and way == 1:
                    # as_cupy on a CuPy stream still busy ("as as_tensor (CuPy's current stream)").
                    sleep_on_cupy_stream(cupy, cs)
                    with cs:
                        w.as_cupy((FRAME_BYTES // 4,), cupy.float32).view(cupy.uint8)[...] = (
                            cupy.from_dlpack(exp))
                elif lib == "cupy":
                    # A CuPy array of the stream-ordered pool written through cupy.from_dlpack(w).
                    with cupy.cuda.using_allocator(async_pool.malloc), cs:
                        src = cupy.from_dlpack(exp).copy()
                        kept.append(src)
                        sleep_on_cupy_stream(cupy, cs)
                        cupy.from_dlpack(w)[...] = src
                else:
                    # A JAX array's bytes, through PyTorch's views of both.
                    src = jax.device_put(exp.cpu().numpy(), gpu)
                    src.block_until_ready()
                    kept.append(src)
                    gpu_sleep()
                    torch.from_dlpack(w).copy_(torch.from_dlpack(src))
                w.publish(str(i).encode())
        got = a.result(seq, 2 * ANSWER)
        assert [r["metadata"] for r in got] == [str(i).encode() for i in range(FRAMES)], got
        bad = [r for r in got if r["error"] or not r["ok"]]
        assert not bad, f"frames not read as written: {bad}"
        a.call("close_all")
        res, closed = tx.close(timeout=10.0), True
        # Every array was dropped and every frame released before the consumer closed.
        assert res == {"forced_holds": 0, "consumers_behind": 0}, res
    finally:
        close_all([a])
        if not closed:
            tx.close(timeout=10.0)
        torch.cuda.synchronize()


def numpy_arange(n):
    import numpy

    return numpy.arange(n, dtype=numpy.int32)


# --------------------------------------------------------------------------------------------
# 3. Models of real shapes.
# --------------------------------------------------------------------------------------------


def test_a_gpt2_small_shaped_bf16_model_runs_bit_for_bit_in_a_reader_by_both_writers(
    cuda, pool, agents, names
):
    # Documented: over_tensors publishes a pool model "without a copy" ("torch.cuda.
    # memory_allocated() does not move"), a copy set "takes each tensor's name, shape and dtype",
    # tied keys: one address under over_tensors, "tensors of their own, each copied" by copy;
    # "load_state_dict(g.tensors(), assign=True) makes the model's parameters the set's tensors".
    # Docs silent on whether the reader's output equals the writer's bit for bit: the same
    # weights, input and kernels on the same GPU, so a user expects it; `align` says how each
    # weight is aligned in the reader, should kernels chosen by alignment differ.
    (a,) = agents.get(1)
    cfg = GPT2
    torch.manual_seed(0)
    with torch.cuda.use_mem_pool(pool):
        pm = GPT2ish(**cfg, device="cuda", dtype=torch.bfloat16).eval()
    torch.manual_seed(0)
    cm = GPT2ish(**cfg, device="cuda", dtype=torch.bfloat16).eval()
    psd, csd = pm.state_dict(), cm.state_dict()
    assert psd["wte.weight"].data_ptr() == psd["lm_head.weight"].data_ptr()
    assert len(psd) == 5 + 12 * cfg["layers"], sorted(psd)
    ids = gpt2_ids(cfg)
    with torch.inference_mode():
        want = {"ot": logits_report(pm(ids)), "copy": logits_report(cm(ids))}
    torch.cuda.synchronize()
    alloc0 = torch.cuda.memory_allocated()
    wp = cuda_ipc.TensorSetWriter.over_tensors(names("gpt2-ot"), psd)
    writers = [wp]
    try:
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == alloc0, "over_tensors allocated PyTorch memory"
        wc = cuda_ipc.TensorSetWriter(names("gpt2-copy"), csd)
        writers.append(wc)
        assert wc.publish(csd, timeout=ANSWER) == 1
        wc.synchronize()  # the copies done: the reader's hold is `whole`
        for key, w, sd in (("ot", wp, psd), ("copy", wc, csd)):
            info = a.call("open", key, w.name, {"expect_layout": w.layout_fingerprint})
            assert set(info["names"]) == set(sd), key
            res = a.call("gpt2", key, cfg, None, ANSWER, timeout=2 * ANSWER)
            assert res is not None and res["gen"] == 1, (key, res and res["gen"])
            assert res["whole"] is True, key
            bad = mismatches(res["tensors"], describe(sd))
            assert not bad, f"{key}: the reader's weights are not the writer's: {bad}"
            assert res["assigned"] and res["meta_left"] == [], key
            assert res["load_device_bytes"] == 0, (key, res["load_device_bytes"])
            assert res["tied_same_ptr"] is (key == "ot"), key
            got, exp = res["logits"], want[key]
            if got["digest"] != exp["digest"]:
                diff = max(abs(x - y) for x, y in zip(got["last_row"], exp["last_row"]))
                misaligned = {k: v for k, v in res["align"].items() if v % 16}
                pytest.fail(
                    f"{key}: the reader's logits differ from the writer's (last row: max |diff| "
                    f"{diff}; sums {got['sum']} and {exp['sum']}; weights aligned to less than 16 "
                    f"bytes in the reader: {misaligned})")
            assert (got["shape"], got["dtype"]) == (exp["shape"], exp["dtype"])
    finally:
        close_all([a], *writers)


def test_three_thousand_small_tensors_of_every_dtype_land_through_publish_and_a_plan(
    cuda, agents, names
):
    # Documented dtypes (python/README.md, "State dicts as they are"): every one lands bit for bit
    # (random bytes: NaN payloads, subnormals, every fp8 pattern), 0-d and empty included ("0-d
    # tensors and tensors with no elements are taken by both writers"). Then the same tensors
    # written in place and published through a CopyPlan ("reads only the sources' data_ptr()s
    # again, 320 at a time"). Dtypes outside the list: "NotSupported for the rest".
    (a,) = agents.get(1)
    sd = small_state_dict(seed=1)
    assert len(sd) == SMALL_COUNT
    name = names("small")
    w = cuda_ipc.TensorSetWriter(name, sd)
    others = []
    try:
        assert set(w.names) == set(sd)
        assert w.publish(sd, timeout=ANSWER) == 1
        torch.cuda.synchronize()
        want1 = concat_digests(sd)
        a.call("open", "s", name, {})
        res = a.call("small", "s", None, ANSWER, timeout=2 * ANSWER)
        assert res is not None and res["gen"] == 1, res and res["gen"]
        bad = mismatches(res["tensors"], want1)
        assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:10]}"

        plan = w.copy_plan(sd)
        assert len(plan) == SMALL_COUNT
        new = small_state_dict(seed=2)
        for k, t in sd.items():
            raw(t).copy_(raw(new[k]))  # in place: the plan's sources keep their memory
        want2 = concat_digests(new)
        assert want2 != want1
        assert w.publish(plan, timeout=ANSWER) == 2
        res = a.call("small", "s", 1, ANSWER, timeout=2 * ANSWER)
        assert res is not None and res["gen"] == 2, res and res["gen"]
        bad = mismatches(res["tensors"], want2)
        assert not bad, f"through the plan, {len(bad)} tensors differ, e.g. {bad[:10]}"

        # Outside the list: quantized dtypes have no DLPack code. As a torch.dtype and as its name.
        for spec in (((4,), torch.quint8), ((4,), "quint8")):
            with pytest.raises(cuda_ipc.NotSupported):
                others.append(cuda_ipc.TensorSetWriter(names("small-q"), {"q": spec}))
    finally:
        close_all([a], w, *others)


# --------------------------------------------------------------------------------------------
# 4. Threads of one reader process while the writer publishes.
# --------------------------------------------------------------------------------------------

THREADS = 8
THREAD_GENS = 30


@pytest.mark.parametrize("mode", ["in_place", "buffered"])
def test_threads_of_one_reader_see_whole_generations_while_the_writer_publishes(
    cuda, agents, names, mode
):
    # Documented: "A TensorSetReader serves any number of threads (each TensorHold is a hold of its
    # own ...)"; "New generations switch atomically: a reader holds one generation while it works
    # and never sees a half-written one". In place, "begin() waits until no reader holds the
    # generation": docs ambiguous on whether readers that take `current()` back to back can keep
    # the writer out ("readers asking meanwhile wait for the commit" reads as "while begin()
    # waits" or as "while the update is written"; docs/ARCHITECTURE.md: begin "waits while any
    # reader holds the generation"). So in place the `current` threads pause 10 ms between takes;
    # double-buffered they take back to back ("readers of the newest generation never wait for
    # the writer", nor it for them).
    (a,) = agents.get(1)
    name = names(f"threads-{mode.replace('_', '-')}")
    w = cuda_ipc.TensorSetWriter(name, THREADED, mode=mode)
    kept = []
    try:
        src = contents(THREADED, 1)
        kept.append(src)
        assert w.publish(src, timeout=ANSWER) == 1
        pause = 0.01 if mode == "in_place" else 0.0
        seq = a.send("threads", name, THREADS, THREAD_GENS, ANSWER, pause)
        time.sleep(0.2)  # the threads have begun taking generation 1
        for g in range(2, THREAD_GENS + 1):
            src = contents(THREADED, g)
            kept.append(src)
            assert w.publish(src, timeout=ANSWER) == g, g
        res = a.result(seq, 2 * ANSWER)
        assert res["stuck"] == [], f"threads that never ended: {res['stuck']}"
        for i, rep in enumerate(res["reports"]):
            who = f"thread {i} ({'current' if i % 2 else 'wait_newer'})"
            assert rep is not None, who
            assert rep["error"] is None, f"{who}: {rep['error']}"
            assert rep["bad"] == [], f"{who}: tensors not of their hold's generation: {rep['bad']}"
            assert rep["backwards"] == [], f"{who}: went back: {rep['backwards']}"
            assert rep["gens"] and rep["gens"][-1] == THREAD_GENS, (who, rep["gens"])
            if i % 2 == 0:
                # wait_newer: each generation taken is newer than the last.
                assert rep["gens"] == sorted(set(rep["gens"])), (who, rep["gens"])
    finally:
        close_all([a], w)
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-rs"]))
