"""`TensorUpdate.copy_from` of many separate CUDA tensors into a GPU tensor set, on a GPU
(`CUDA_IPC_GPU_TESTS=1`; they fail, not pass, without one): every source lands whatever its size,
dtype and alignment (small ones go through the copy kernel, 160 per launch, large ones through
`cuMemcpyDtoDAsync`), non-contiguous sources are made contiguous first, a CPU tensor is refused
before anything of its chunk is copied, and the update's own tensors copied onto themselves stay
as they are; sources of neighbouring allocations merged into one range land too; a source whose
storage was freed is refused (the driver checks every source the kernel reads) and the context
lives on; a `CopyPlan` copies its sources at every update and refuses one that moved (a
parameter's `.data` replaced included), another writer's plan, a non-contiguous source and a host
set."""

import os
import uuid

import pytest

import cuda_ipc

pytestmark = pytest.mark.skipif(
    os.environ.get("CUDA_IPC_GPU_TESTS") != "1", reason="needs a CUDA GPU: set CUDA_IPC_GPU_TESTS=1"
)

torch = pytest.importorskip("torch")

ANSWER = 30.0


@pytest.fixture
def name():
    return f"tscopy-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def specs():
    """700 tensors: bytes around the kernel's 16-byte word and 4 KiB per block, of four dtypes,
    and three past the direct copy's 8 MiB."""
    out = {}
    dtypes = ["uint8", "bfloat16", "float32", "float16"]
    for i in range(697):
        n = [1 + i % 5, 15 + i % 3, 16 * (1 + i), 32768 + i, 4096 + 13 * i, 1000 + i, 3][i % 7]
        out[f"p{i}"] = ((n,), dtypes[i % 4])
    out["big0"] = (((4 << 20) + 3,), "bfloat16")
    out["big1"] = ((9 << 20,), "uint8")
    out["big2"] = ((1024, 2049), "float32")
    return out


def sources(sp, seed):
    """A source per tensor, each its own allocation; every fourth a view at an odd element
    offset of a larger tensor (2- or 1-byte aligned), every ninth non-contiguous."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for i, (n, (shape, dt)) in enumerate(sp.items()):
        dtype = getattr(torch, dt)
        numel = 1
        for s in shape:
            numel *= s
        if dtype == torch.uint8:
            base = torch.randint(0, 256, (numel + 3,), generator=g, device="cuda", dtype=dtype)
        else:
            base = torch.randn(numel + 3, generator=g, device="cuda").to(dtype)
        if i % 9 == 0 and len(shape) == 1 and numel > 1:
            wide = torch.empty((numel, 2), dtype=dtype, device="cuda")
            wide[:, 0] = base[:numel]
            t = wide[:, 0]
            assert not t.is_contiguous()
        elif i % 4 == 0:
            t = base[1:1 + numel].view(shape)
        else:
            t = base[:numel].view(shape).clone()
        out[n] = t
    return out


def copy_and_compare(w, src):
    """One update of `w` from `src`, every tensor compared with its source on the GPU."""
    with w.begin(timeout=ANSWER) as u:
        u.copy_from(src)
        got = u.tensors()
        torch.cuda.synchronize()
        for n, t in src.items():
            assert torch.equal(got[n], t), n


def test_many_scattered_sources_land_byte_for_byte(name):
    sp = specs()
    w = cuda_ipc.TensorSetWriter(name, sp, device=0, memory="vmm", mode="in_place")
    try:
        for seed in (1, 2):
            src = sources(sp, seed)
            with w.begin(timeout=ANSWER) as u:
                u.copy_from(src)
                got = u.tensors()
                torch.cuda.synchronize()
                for n, t in src.items():
                    assert torch.equal(got[n].view(torch.uint8), t.contiguous().view(torch.uint8)), n
    finally:
        w.close()


def test_sources_of_neighbouring_allocations_merged_into_one_range_land(name):
    # 1 MiB tensors of PyTorch's small pool: two per 2 MiB segment, segments often neighbours in
    # the address space, so runs of sources back to back (in the set's order) span allocations;
    # merged past 8 MiB, the driver refuses such a range as one copy.
    sp = {f"e{i}": ((512, 1024), "bfloat16") for i in range(96)}
    w = cuda_ipc.TensorSetWriter(name, sp, device=0, memory="vmm", mode="in_place")
    try:
        src = {n: torch.full((512, 1024), float(i % 13), dtype=torch.bfloat16, device="cuda")
               for i, n in enumerate(sp)}
        copy_and_compare(w, src)
    finally:
        w.close()


def test_a_source_whose_storage_was_freed_is_refused_and_the_context_lives_on(name):
    # FSDP frees a parameter's memory by resizing its storage to 0: the tensor keeps its shape
    # and nbytes, its data_ptr() becomes 0. Alone (one range: the driver's copy, refused, then
    # the kernel's check) and among small ones (the kernel's check first).
    sp = {f"t{i}": ((4096,), "float32") for i in range(8)}
    sp["big"] = (((1 << 20),), "float32")
    w = cuda_ipc.TensorSetWriter(name, sp, device=0, memory="vmm", mode="in_place")
    try:
        gone = torch.empty(1 << 20, device="cuda")
        gone.untyped_storage().resize_(0)
        small_gone = torch.empty(4096, device="cuda")
        small_gone.untyped_storage().resize_(0)
        for src, bad in (({"big": gone}, "big"),
                         ({**{f"t{i}": torch.ones(4096, device="cuda") for i in range(8)},
                           "t3": small_gone}, "t3")):
            with w.begin(timeout=ANSWER) as u:
                with pytest.raises(cuda_ipc.InvalidArgument, match=f"{bad}.*has no memory"):
                    u.copy_from(src)
                u.abort()
        # The context is whole: a good update lands.
        good = {f"t{i}": torch.full((4096,), float(i), device="cuda") for i in range(8)}
        w.publish(good, timeout=ANSWER)
        with w.begin(timeout=ANSWER) as u:
            got = u.tensors()
            torch.cuda.synchronize()
            assert all(torch.equal(got[n], t) for n, t in good.items())
            u.abort()
    finally:
        w.close()


def test_sources_in_vmm_memory_are_checked_granule_by_granule_and_land(name):
    # The extension's PyTorch pool maps VMM chunks: the driver's range for such an address is
    # the whole reservation, so the check asks per mapping granule; every source must pass.
    sp = {f"v{i}": ((1000 + 37 * i,), "float32") for i in range(300)}
    w = cuda_ipc.TensorSetWriter(name, sp, device=0, memory="vmm", mode="in_place")
    try:
        pool = cuda_ipc.torch_mem_pool(0)
        with torch.cuda.use_mem_pool(pool):
            src = {n: torch.full(s, float(i), device="cuda") for i, (n, (s, _)) in enumerate(sp.items())}
        for t in src.values():
            cuda_ipc.arena_locate(t.data_ptr(), t.nbytes)  # raises unless in the VMM arena
        copy_and_compare(w, src)
    finally:
        w.close()


def test_a_cpu_source_is_refused_before_its_chunk_is_copied(name):
    sp = {f"t{i}": ((64,), "float32") for i in range(20)}
    w = cuda_ipc.TensorSetWriter(name, sp, device=0, memory="vmm", mode="in_place")
    try:
        with w.begin(timeout=ANSWER) as u:
            for t in u.tensors().values():
                t.fill_(7.0)
            src = {n: torch.zeros(64, device="cuda") for n in sp}
            src["t13"] = torch.zeros(64)
            with pytest.raises(cuda_ipc.InvalidArgument, match="t13.*not a CUDA tensor"):
                u.copy_from(src)
            torch.cuda.synchronize()
            assert all(bool((t == 7.0).all()) for t in u.tensors().values())
            u.abort()
    finally:
        w.close()


def test_the_updates_own_tensors_copied_onto_themselves_stay(name):
    sp = {f"t{i}": ((1000 + i,), "bfloat16") for i in range(50)}
    w = cuda_ipc.TensorSetWriter(name, sp, device=0, memory="vmm", mode="in_place")
    try:
        with w.begin(timeout=ANSWER) as u:
            own = u.tensors()
            for i, t in enumerate(own.values()):
                t.fill_(float(i))
            u.copy_from(own)
            torch.cuda.synchronize()
            for i, t in enumerate(u.tensors().values()):
                assert bool((t == float(i)).all())
    finally:
        w.close()


def test_a_copy_plan_copies_its_sources_at_every_update_and_refuses_moved_ones(name):
    sp = specs()
    w = cuda_ipc.TensorSetWriter(name, sp, device=0, memory="vmm", mode="buffered")
    other = cuda_ipc.TensorSetWriter(name + "-o", sp, device=0, memory="vmm", mode="in_place")
    try:
        src = {n: t.contiguous() for n, t in sources(sp, 3).items()}
        plan = w.copy_plan(src)
        assert len(plan) == len(sp) and 0 < plan.ranges <= len(sp)
        for step in range(3):
            # The trainer's in-place step: same storage, new values.
            for t in src.values():
                t.add_(1)
            g = w.publish(plan, timeout=ANSWER)
            with w.begin(timeout=ANSWER) as u:
                u.copy_from_previous()
                got = u.tensors()
                torch.cuda.synchronize()
                for n, t in src.items():
                    assert torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), (step, n)
                u.abort()
            assert g == w.generation
        # A source given a new storage: refused before anything is copied; the plan keeps the
        # old storage alive, so its address cannot come back for the new one.
        src["p5"].set_(torch.zeros_like(src["p5"]))
        with pytest.raises(cuda_ipc.InvalidArgument, match="p5.*moved"):
            w.publish(plan, timeout=ANSWER)
        # A source of the plan's last chunk (320 sources a chunk) moved: the update is refused
        # after the earlier chunks' copies were enqueued, and nothing is published.
        late = w.copy_plan(src)
        g0 = w.generation
        src["p690"].set_(torch.zeros_like(src["p690"]))
        with pytest.raises(cuda_ipc.InvalidArgument, match="p690.*moved"):
            w.publish(late, timeout=ANSWER)
        assert w.generation == g0
        # A plan whose source's storage is freed afterwards: refused, named.
        fplan = w.copy_plan(src)
        src["p7"].untyped_storage().resize_(0)
        with pytest.raises(cuda_ipc.InvalidArgument, match="p7.*has no memory"):
            w.publish(fplan, timeout=ANSWER)
        del src["p7"]  # copy_from takes any subset of the set's names
        # The parameters themselves (keep_vars=True): `p.data = ...` is seen.
        m = torch.nn.Linear(64, 32).cuda()
        ws = cuda_ipc.TensorSetWriter(name + "-m", m.state_dict(), device=0, memory="vmm")
        try:
            mplan = ws.copy_plan(m.state_dict(keep_vars=True))
            ws.publish(mplan, timeout=ANSWER)
            m.weight.data = torch.zeros_like(m.weight)
            with pytest.raises(cuda_ipc.InvalidArgument, match="weight.*moved"):
                ws.publish(mplan, timeout=ANSWER)
        finally:
            ws.close()
        # A new plan takes it.
        w.publish(w.copy_plan(src), timeout=ANSWER)
        # Another writer's plan, a non-contiguous source, a host set: refused.
        with other.begin(timeout=ANSWER) as u:
            with pytest.raises(cuda_ipc.InvalidArgument, match="another tensor set writer"):
                u.copy_from(plan)
            u.abort()
        wide = torch.zeros((16, 2), dtype=torch.bfloat16, device="cuda")  # p1: 16 bf16
        with pytest.raises(cuda_ipc.InvalidArgument, match="p1.*not contiguous"):
            other.copy_plan({"p1": wide[:, 0]})
        host = cuda_ipc.TensorSetWriter(name + "-h", {"a": ((4,), "float32")}, memory="host")
        try:
            with pytest.raises(cuda_ipc.InvalidArgument, match="GPU tensor sets"):
                host.copy_plan({"a": torch.zeros(4)})
        finally:
            host.close()
    finally:
        other.close()
        w.close()
