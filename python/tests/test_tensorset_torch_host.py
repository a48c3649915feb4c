"""Tensor sets in host memory as PyTorch CPU tensors (no GPU): the reader's and the update's
dicts (the same construction as a GPU set's: one DLPack base, runs of equal tensors by one
`as_strided` and `unbind`), and `copy_from` of many tensors, non-contiguous and of mixed dtypes.
Skipped where PyTorch is not installed."""

import pathlib
import uuid

import pytest

import cuda_ipc

torch = pytest.importorskip("torch")

SHM = pathlib.Path("/dev/shm")
ANSWER = 10.0


@pytest.fixture
def name():
    n = f"pytest-tst-{uuid.uuid4().hex[:12]}"
    yield n
    for prefix in ("cuda-ipc.ts.", "cuda-ipc.tg.", "cuda-ipc.td."):
        p = SHM / f"{prefix}{n}"
        if p.exists() or p.is_symlink():
            p.unlink()


def layered(layers=6, h=16, kv=8, ff=24):
    """A transformer-shaped set: per layer q, k, v, o, gate, up, down, two norms (k and v of one
    shape back to back, as gate and up: interleaved runs), plus embeddings and a final norm."""
    out = {"embed": ((40, h), "bfloat16")}
    for i in range(layers):
        p = f"l{i}."
        out.update({
            p + "q": ((h, h), "bfloat16"), p + "k": ((kv, h), "bfloat16"),
            p + "v": ((kv, h), "bfloat16"), p + "o": ((h, h), "bfloat16"),
            p + "gate": ((ff, h), "bfloat16"), p + "up": ((ff, h), "bfloat16"),
            p + "down": ((h, ff), "bfloat16"), p + "norm1": ((h,), "float32"),
            p + "norm2": ((h,), "float32"),
        })
    out["norm"] = ((h,), "float32")
    out["head"] = ((40, h), "bfloat16")
    out["ids"] = ((3,), "int64")
    return out


def pattern(specs, seed):
    """A distinct value in every element of every tensor."""
    out = {}
    for k, (n, (shape, dt)) in enumerate(specs.items()):
        numel = 1
        for s in shape:
            numel *= s
        v = (torch.arange(numel, dtype=torch.float64) + 1000 * k + seed) % 251
        out[n] = v.to(getattr(torch, dt)).reshape(shape)
    return out


def test_a_readers_dict_holds_every_tensor_at_its_place_and_is_reused(name):
    specs = layered()
    w = cuda_ipc.TensorSetWriter(name, specs, memory="host", mode="buffered", buffers=2)
    r = cuda_ipc.TensorSetReader(name)
    try:
        want = pattern(specs, 1)
        assert w.publish(want, timeout=ANSWER) == 1
        with r.current() as h:
            d = h.tensors()
            assert type(d) is dict and list(d) == list(specs)
            for n, (shape, dt) in specs.items():
                t = d[n]
                assert type(t) is torch.Tensor and t.device.type == "cpu"
                assert t.shape == shape and t.dtype == getattr(torch, dt)
                assert t.is_contiguous()
                assert torch.equal(t, want[n]), n
                assert bytes(t.view(torch.uint8).reshape(-1).tolist()) == h.read(n), n
            ptrs = {n: t.data_ptr() for n, t in d.items()}
        # Generation 2 lies in the other buffer, generation 3 in the first again: the same
        # tensors as generation 1's, in a new dict.
        w.publish(pattern(specs, 2), timeout=ANSWER)
        with r.current() as h:
            d2 = h.tensors()
            assert h.buffer == 1 and all(d2[n].data_ptr() != ptrs[n] for n in specs)
        want3 = pattern(specs, 3)
        w.publish(want3, timeout=ANSWER)
        with r.current() as h:
            d3 = h.tensors()
            assert d3 is not d and all(d3[n] is d[n] for n in specs)
            assert all(torch.equal(d3[n], want3[n]) for n in specs)
    finally:
        r.close()
        w.close()


def test_a_holds_tensors_outlive_its_readers_close_and_keep_nothing_in_the_closed_reader(name):
    """A hold taken before its reader's `close()` gives its tensors after it, while the closed
    reader's own calls raise `TensorSetClosed`. The dict built then is not kept in the closed
    reader (its tensors would keep the reader's mappings, and its slot, as long as the reader
    object lives): once the dict and the hold are let go, the set's one reader slot is free again
    while the closed reader object still exists."""
    import gc

    specs = layered(layers=2)
    w = cuda_ipc.TensorSetWriter(name, specs, memory="host", mode="buffered", buffers=2, max_readers=1)
    r = cuda_ipc.TensorSetReader(name)
    try:
        want = pattern(specs, 5)
        w.publish(want, timeout=ANSWER)
        h = r.current()
        r.close()
        with pytest.raises(cuda_ipc.NoConsumerSlot):
            cuda_ipc.TensorSetReader(name)  # the hold keeps the closed reader's slot
        d = h.tensors()
        assert list(d) == list(specs) and all(torch.equal(d[n], want[n]) for n in specs)
        with pytest.raises(cuda_ipc.TensorSetClosed, match="this reader of tensor set"):
            r.stable_tensors()
        del d
        h.release()
        gc.collect()
        again = cuda_ipc.TensorSetReader(name)  # `r` still exists, closed
        with again.current() as g:
            assert all(torch.equal(t, want[n]) for n, t in g.tensors().items())
        again.close()
    finally:
        r.close()
        w.close()


def test_an_updates_tensors_are_writable_views_of_its_buffer(name):
    specs = layered(layers=2)
    w = cuda_ipc.TensorSetWriter(name, specs, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    try:
        want = pattern(specs, 7)
        with w.begin(timeout=ANSWER) as u:
            d = u.tensors()
            assert type(d) is dict and list(d) == list(specs)
            for n, t in d.items():
                t.copy_(want[n])
        with r.current() as h:
            got = h.tensors()
            assert all(torch.equal(got[n], want[n]) for n in specs)
    finally:
        r.close()
        w.close()


def test_copy_from_many_tensors_of_mixed_dtypes_and_non_contiguous_sources(name):
    specs = {f"e{i}": ((4, 6), ("bfloat16", "float32", "int8")[i % 3]) for i in range(3000)}
    w = cuda_ipc.TensorSetWriter(name, specs, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    try:
        want = pattern(specs, 5)
        # Every third source a transposed view (not contiguous), the rest views of one buffer.
        src = {}
        for i, (n, t) in enumerate(want.items()):
            src[n] = t.t().contiguous().t() if i % 3 == 1 else t
        assert not src["e1"].is_contiguous()
        u = w.begin(timeout=ANSWER)
        u.copy_from(src)
        u.commit()
        with r.current() as h:
            d = h.tensors()
            bad = [n for n in specs if not torch.equal(d[n], want[n])]
            assert bad == []
        # A subset, from one flat buffer's views (copied back to back as one run).
        flat = torch.arange(24 * 10, dtype=torch.float32)
        sub = {f"e{i}": flat[24 * k: 24 * (k + 1)].view(4, 6) for k, i in enumerate(range(1, 30, 3))}
        w.publish(sub, timeout=ANSWER)
        with r.current() as h:
            d = h.tensors()
            assert all(torch.equal(d[n], sub[n]) for n in sub)
            assert torch.equal(d["e0"], want["e0"])  # in place: untouched tensors keep their bytes
    finally:
        r.close()
        w.close()


def test_copy_from_refuses_wrong_names_dtypes_sizes_devices_and_non_tensors(name):
    specs = {"a": ((4, 6), "bfloat16"), "b": ((8,), "float32")}
    w = cuda_ipc.TensorSetWriter(name, specs, memory="host")
    try:
        cases = [
            ({"zz": torch.zeros(8)}, cuda_ipc.InvalidArgument, "zz"),
            ({"b": torch.zeros(8, dtype=torch.float64)}, cuda_ipc.InvalidArgument,
             "dtype float64, the set holds float32"),
            ({"b": torch.zeros(9)}, cuda_ipc.InvalidArgument, r"shape \[9\] given"),
            # Fewer bytes, or the same bytes in another shape: refused as load_state_dict
            # refuses a size mismatch, never copied as bytes.
            ({"b": torch.ones(4)}, cuda_ipc.InvalidArgument, r"shape \[4\] given, the set's tensor has shape \[8\]"),
            ({"a": torch.zeros(6, 4, dtype=torch.bfloat16)}, cuda_ipc.InvalidArgument, r"shape \[6, 4\]"),
            ({"b": torch.zeros(8, device="meta")}, cuda_ipc.InvalidArgument, "not on the CPU"),
            ({"b": [0.0] * 8}, cuda_ipc.InvalidArgument, "not a torch.Tensor"),
            ({1: torch.zeros(8)}, cuda_ipc.InvalidArgument, "1"),
        ]
        for src, exc, text in cases:
            with w.begin(timeout=ANSWER) as u:
                with pytest.raises(exc, match=text):
                    u.copy_from(src)
                u.abort()
        # Nothing of the refused copies was published; a right one is.
        assert w.publish({"b": torch.ones(8)}, timeout=ANSWER) == 1
    finally:
        w.close()


def test_copy_from_runs_no_torch_function_of_a_subclass_or_a_mode(name):
    """`copy_from` reads its sources' properties with `__torch_function__` off: no code of the
    caller's runs between the copies of two chunks (code that could free a source whose copy is
    enqueued). A tensor subclass's override and an active `TorchFunctionMode` are not called,
    and the bytes land; an object that is not a tensor is refused before any of its attributes is
    read; a key is looked up by its text alone (no `__hash__` or `__eq__` of a `str` subclass,
    none of another object's)."""
    calls = []

    class Loud(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(("subclass", getattr(func, "__name__", func)))
            return super().__torch_function__(func, types, args, kwargs or {})

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(("mode", getattr(func, "__name__", func)))
            return func(*args, **(kwargs or {}))

    class NotATensor:
        @property
        def dtype(self):
            calls.append(("dtype read", None))
            return torch.float32

    class Name(str):
        def __hash__(self):
            calls.append(("hash", None))
            return str.__hash__(self)

        def __eq__(self, other):
            calls.append(("eq", None))
            return str.__eq__(self, other)

    class Key:
        def __hash__(self):
            calls.append(("key hash", None))
            return 1

        def __repr__(self):
            calls.append(("key repr", None))
            return "Key()"

    specs = {f"e{i}": ((6,), "float32") for i in range(700)}
    w = cuda_ipc.TensorSetWriter(name, specs, memory="host")
    r = cuda_ipc.TensorSetReader(name)
    try:
        want = {n: torch.arange(6, dtype=torch.float32) + i for i, n in enumerate(specs)}
        # Every other source a subclass instance, every seventh not contiguous; 700 sources make
        # several chunks.
        src = {}
        for i, (n, t) in enumerate(want.items()):
            s = t.as_subclass(Loud) if i % 2 else t.clone()
            if i % 7 == 3:
                s = torch.stack([s, s], dim=1)[:, 0]
            src[n] = s
        calls.clear()
        with Mode():
            w.publish(src, timeout=ANSWER)
            assert calls == []
        with r.current() as h:
            d = h.tensors()
            assert [n for n in specs if not torch.equal(d[n], want[n])] == []
        # (Building these dicts hashes their keys: done before the count starts.)
        not_a_tensor, odd_key = {"e5": NotATensor()}, {Key(): torch.zeros(6)}
        named = {Name("e3"): torch.full((6,), 9.0)}
        calls.clear()
        with w.begin(timeout=ANSWER) as u:
            with pytest.raises(cuda_ipc.InvalidArgument, match="e5.*a NotATensor is not a torch"):
                u.copy_from(not_a_tensor)
            with pytest.raises(cuda_ipc.InvalidArgument, match="a key of type Key"):
                u.copy_from(odd_key)
            u.abort()
        # Keys of a str subclass are looked up by their text alone.
        w.publish(named, timeout=ANSWER)
        with r.current() as h:
            assert torch.equal(h.tensors()["e3"], torch.full((6,), 9.0))
        assert calls == []
    finally:
        r.close()
        w.close()
