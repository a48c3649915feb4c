"""The content fingerprint kernel's time over the Llama shape (15 GiB) and 20,000 x 64 KiB,
against one copy of the same bytes, in the same process: medians of 7."""
import json, statistics, sys, time
import torch, cuda_ipc
sys.path.insert(0, "bench")
from tensorset_attach import SHAPES

def med(f, n=7):
    r = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter(); f(); torch.cuda.synchronize()
        r.append((time.perf_counter() - t) * 1e3)
    return statistics.median(r)

def one(label, shapes):
    specs = {n: (s, torch.bfloat16) for n, s in shapes}
    w = cuda_ipc.TensorSetWriter(f"fpb-{label}", specs, device=0, memory="vmm")
    try:
        with w.begin() as u:
            fp = med(lambda: u.fingerprint())
            u.abort()
        total = sum(torch.Size(s).numel() * 2 for _, s in shapes)
        a = torch.empty(total, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
        cp = med(lambda: b.copy_(a))
        return {"shape": label, "bytes": total, "fingerprint_ms": fp, "copy_ms": cp,
                "fingerprint_over_copy": fp / cp}
    finally:
        w.close(timeout=10.0)

if __name__ == "__main__":
    out = [one("llama", SHAPES["llama"]()), one("small", [(f"s{i}", (32, 1024)) for i in range(20000)])]
    print(json.dumps(out))
