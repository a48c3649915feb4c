"""Where a fresh ready reader's first dict goes: variants warmed before the clock."""
import json, os, sys, time, statistics, multiprocessing as mp
sys.path.insert(0, "bench")
from tensorset_attach import llama_shapes

VARIANTS = ["nowarm", "warm", "warm_second_set", "nowarm_second_set"]

def child(name, small, hostname, variant, conn):
    os.environ["CUDA_MODULE_LOADING"] = "LAZY"
    if variant.startswith("nowarm"):
        os.environ["CUDA_IPC_WARM_UP"] = "0"
    import torch
    torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    t = time.perf_counter(); import cuda_ipc; imp = (time.perf_counter() - t) * 1e3
    keep = []
    T = time.perf_counter
    t = T()
    if variant in ("torch_cpu",):
        x = torch.empty(64)
        y = torch.from_dlpack(x.__dlpack__()); torch.as_strided(y, (2, 2), (2, 1), 0); torch.unbind(torch.as_strided(y, (2, 2), (2, 1), 0))
    if variant in ("torch_cuda", "torch_cuda_host"):
        torch.cuda.current_stream(0)
        x = torch.empty(64, device="cuda")
        y = torch.from_dlpack(x.__dlpack__(stream=-1)); torch.as_strided(y, (2, 2), (2, 1), 0); torch.unbind(torch.as_strided(y, (2, 2), (2, 1), 0))
    if variant in ("host_set", "torch_cuda_host"):
        r = cuda_ipc.TensorSetReader(hostname); h = r.current(timeout=10); d = h.tensors(); keep += [r, h, d]
    if variant.endswith("second_set"):
        r = cuda_ipc.TensorSetReader(small, device=0); h = r.current(timeout=10); d = h.tensors(); keep += [r, h, d]
    warm_ms = (T() - t) * 1e3
    conn.send("ready")
    conn.recv()
    t0 = T(); r = cuda_ipc.TensorSetReader(name, device=0); t1 = T()
    h = r.current(timeout=60); t2 = T(); d = h.tensors(); t3 = T()
    conn.send({"variant": variant, "import_ms": imp, "warm_ms": warm_ms, "open_ms": (t1-t0)*1e3,
               "hold_ms": (t2-t1)*1e3, "tensors_ms": (t3-t2)*1e3, "dict_ms": (t3-t0)*1e3,
               "timings": r.open_timings()})
    conn.recv()

if __name__ == "__main__":
    import torch, cuda_ipc
    out_path = sys.argv[1]
    per = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    shapes = llama_shapes()
    specs = {n: (s, torch.bfloat16) for n, s in shapes}
    name, small, hostname = f"tsp-{os.getpid()}", f"tsp-{os.getpid()}-s", f"tsp-{os.getpid()}-h"
    w = cuda_ipc.TensorSetWriter(name, specs, device=0, memory="vmm", mode="in_place")
    ws = cuda_ipc.TensorSetWriter(small, {"a": ((64, 64), torch.bfloat16)}, device=0, memory="vmm", mode="in_place")
    wh = cuda_ipc.TensorSetWriter(hostname, {"a": ((64, 64), torch.bfloat16)}, device=-1, memory="host", mode="in_place") if False else None
    try:
        wh = cuda_ipc.TensorSetWriter(hostname, {"a": ((64, 64), "bfloat16")}, memory="host")
    except Exception as e:
        print("host writer:", e, file=sys.stderr)
    for x in (w, ws) + ((wh,) if wh else ()):
        with x.begin(timeout=30):
            pass
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    res = []
    for b in range(per):
        batch = []
        for v in VARIANTS:
            a, c = ctx.Pipe()
            p = ctx.Process(target=child, args=(name, small, hostname, v, c), daemon=True); p.start()
            batch.append((p, a))
        for p, a in batch:
            assert a.poll(120); assert a.recv() == "ready"
        # rotate the order within the batch
        order = batch[b % len(batch):] + batch[:b % len(batch)]
        for p, a in order:
            a.send("go"); assert a.poll(120); res.append(a.recv())
        for p, a in batch:
            a.send("exit"); p.join(30)
        print("batch", b, file=sys.stderr, flush=True)
    summary = {}
    for v in VARIANTS:
        rs = [r for r in res if r["variant"] == v]
        summary[v] = {k: round(statistics.median(r[k] for r in rs), 3) for k in ("import_ms", "warm_ms", "open_ms", "hold_ms", "tensors_ms", "dict_ms")}
        summary[v]["n"] = len(rs)
    print(json.dumps(summary, indent=1))
    json.dump({"summary": summary, "all": res}, open(out_path, "w"))
    for x in (w, ws, wh):
        if x: x.close(timeout=10)
