"""The code before this change, MoE shape (4,608 x 1 MiB bf16): copy_from of scattered sources
(each tensor its own allocation) and of flat views, timed, errors reported."""
import json, sys, time, statistics
import torch, cuda_ipc
def main():
    shapes = [(f"experts.{i // 3}.w{i % 3}", (512, 1024)) for i in range(4608)]
    specs = {n: (s, torch.bfloat16) for n, s in shapes}
    total = 4608 << 20
    src = torch.full((total,), 3, dtype=torch.uint8, device="cuda")
    flat, off = {}, 0
    for n, s in shapes:
        flat[n] = src[off:off + (1 << 20)].view(torch.bfloat16).view(s); off += 1 << 20
    scattered = {n: torch.full(s, 3, dtype=torch.bfloat16, device="cuda") for n, s in shapes}
    w = cuda_ipc.TensorSetWriter(f"old-{time.time_ns()}", specs, device=0, memory="vmm")
    out = {}
    try:
        for kind, views in (("flat", flat), ("scattered", scattered)):
            ts = []
            for _ in range(5):
                torch.cuda.synchronize(); t = time.perf_counter()
                try:
                    with w.begin(timeout=60) as u:
                        u.copy_from(views)
                    w.synchronize()
                except Exception as e:
                    out[kind + "_error"] = f"{type(e).__name__}: {e}"
                    break
                ts.append((time.perf_counter() - t) * 1e3)
            if ts: out[kind + "_ms"] = statistics.median(ts)
    finally:
        w.close(timeout=10)
    print(json.dumps(out)); json.dump(out, open(sys.argv[1], "w"))
if __name__ == "__main__":
    main()
