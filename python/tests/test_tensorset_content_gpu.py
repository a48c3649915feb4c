"""Content fingerprints of GPU tensor sets from Python, on a GPU (`CUDA_IPC_GPU_TESTS=1`; they
fail, not pass, without one): the digests the kernel computes over a device set equal the host
twin's over a host set of the same bytes (odd sizes, unaligned ends), a fingerprinted
`publish` is verified by a reader in another process, and a generation committed with a false
fingerprint is refused there with its generation named. Every wait is bounded."""

import json
import os
import pathlib
import subprocess
import sys
import uuid

import pytest

import cuda_ipc

pytestmark = pytest.mark.skipif(
    os.environ.get("CUDA_IPC_GPU_TESTS") != "1", reason="needs a CUDA GPU: set CUDA_IPC_GPU_TESTS=1"
)

SHM = pathlib.Path("/dev/shm")
ANSWER = 30.0

# Sizes around the kernel's 16-byte word and 1 MiB item: a tensor of 3 bytes, one ending one
# byte past an item, one of several items with an odd tail, bf16 and fp16 of odd shapes.
SPECS = {
    "tiny": ((3,), "uint8"),
    "item_plus_one": (((1 << 20) + 1,), "uint8"),
    "several_items": ((5 * (1 << 20) + 13,), "uint8"),
    "w_bf16": ((1023, 7), "bfloat16"),
    "w_fp16": ((257, 4099), "float16"),
    "norm": ((4096,), "float32"),
}

READER = r"""
import json, sys
import cuda_ipc
dev, host = sys.argv[1], sys.argv[2]
out = {}
for key, name in (("dev", dev), ("host", host)):
    r = cuda_ipc.TensorSetReader(name)
    with r.current(timeout=30.0) as g:
        g.verify_content()
        out[key] = {"gen": g.generation, "digests": [d.hex() for d in g.tensor_digests()],
                    "fp": g.fingerprint().hex(), "whole": g.whole}
    if key == "dev":
        # The writer's next generation carries a fingerprint that is not its bytes'.
        print(json.dumps(out), flush=True)
        sys.stdin.readline()
        with r.wait_newer(out["dev"]["gen"], timeout=30.0) as g:
            try:
                g.verify_content()
                out["false"] = "accepted"
            except cuda_ipc.ContentMismatch as e:
                out["false"] = {"gen": e.generation, "committed": e.committed.hex(),
                                "computed": e.computed.hex(), "held": g.generation}
    r.close()
print(json.dumps(out), flush=True)
"""


@pytest.fixture
def names():
    tag = uuid.uuid4().hex[:12]
    ns = (f"pytest-tsc-dev-{tag}", f"pytest-tsc-host-{tag}")
    yield ns
    for n in ns:
        for prefix in ("cuda-ipc.ts.", "cuda-ipc.tg.", "cuda-ipc.td."):
            p = SHM / f"{prefix}{n}"
            if p.exists() or p.is_symlink():
                p.unlink()


def pattern(torch, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, (shape, dt) in SPECS.items():
        numel = 1
        for s in shape:
            numel *= s
        raw = torch.randint(0, 256, (numel * torch.empty((), dtype=getattr(torch, dt)).element_size(),),
                            dtype=torch.uint8, generator=g)
        out[n] = raw.view(getattr(torch, dt)).reshape(shape)
    return out


@pytest.mark.parametrize("memory", ["vmm", "pool", "legacy"])
def test_kernel_digests_equal_the_host_twins_and_a_false_fingerprint_is_refused_elsewhere(
    memory, names
):
    torch = pytest.importorskip("torch")
    assert torch.cuda.is_available(), "CUDA_IPC_GPU_TESTS=1 but PyTorch sees no GPU"
    dev_name, host_name = names
    want = pattern(torch, 1)
    dev = cuda_ipc.TensorSetWriter(dev_name, SPECS, memory=memory)
    host = cuda_ipc.TensorSetWriter(host_name, SPECS, memory="host")
    child = None
    try:
        g = dev.publish({n: t.cuda() for n, t in want.items()}, timeout=ANSWER, fingerprint=True)
        host.publish(want, timeout=ANSWER, fingerprint=True)
        child = subprocess.Popen(
            [sys.executable, "-c", READER, dev_name, host_name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        first = json.loads(child.stdout.readline() or "null") if child.stdout else None
        assert first is not None, child.stderr.read() if child.stderr else ""
        assert first["dev"]["gen"] == g
        # Asked after the child's stream waited for it and synchronised: the writer's stream
        # had written its ready word.
        assert first["dev"]["whole"] is True
        # In place: the next begin waits for the child's hold of generation 1 to be released,
        # which it is once the child printed.
        with dev.begin(timeout=ANSWER) as u:
            u.copy_from({n: t.cuda() for n, t in pattern(torch, 2).items()})
            false = b"\x07" * 32
            g2 = u.commit(content=false)
        child.stdin.write("\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=ANSWER)
        assert child.returncode == 0, err
        res = json.loads(out.strip().splitlines()[-1])
        # The kernel's digest of every tensor is the host twin's of the same bytes.
        assert res["dev"]["digests"] == res["host"]["digests"]
        assert res["host"]["whole"] is True
        assert len(set(res["dev"]["digests"])) == len(SPECS)
        assert res["false"] != "accepted"
        assert res["false"]["gen"] == g2 == res["false"]["held"]
        assert res["false"]["committed"] == false.hex()
        assert res["false"]["computed"] != false.hex()
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait(timeout=ANSWER)
        dev.close()
        host.close()
