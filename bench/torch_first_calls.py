"""What PyTorch's calls for a reader's first dict cost in a fresh process, with CUDA modules loaded
lazily (PyTorch's default, `CUDA_MODULE_LOADING=LAZY`) and eagerly: the calls `TensorHold.tensors()`
makes (`torch.cuda.current_stream`, `torch.from_dlpack` of a capsule, `narrow`, `view(dtype)`,
`as_strided`, `unbind`) and a dict of 291 keys, each timed at its first use in the process and
again. Three fresh processes of each kind, medians in µs. Needs a GPU and PyTorch; no cuda-ipc.

    python3 bench/torch_first_calls.py      # writes $OUT/torch_first_calls.json (default /tmp)
"""
import json, os, sys, time, multiprocessing as mp

def child(loading, conn):
    os.environ["CUDA_MODULE_LOADING"] = loading.upper()
    import torch
    torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    base = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    base2 = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    out = {}
    def rnd(tag, b):
        T = time.perf_counter
        t = T(); s = torch.cuda.current_stream(0).cuda_stream; out[tag+"current_stream"] = (T()-t)*1e6
        cap = b.__dlpack__(stream=-1)
        t = T(); x = torch.from_dlpack(cap); out[tag+"from_dlpack"] = (T()-t)*1e6
        t = T(); n = torch.narrow(x, 0, 0, x.numel()); out[tag+"narrow"] = (T()-t)*1e6
        t = T(); v = n.view(torch.bfloat16); out[tag+"view_dtype"] = (T()-t)*1e6
        t = T(); a = torch.as_strided(v, (4096, 4096), (4096, 1), 0); out[tag+"as_strided1"] = (T()-t)*1e6
        t = T()
        for i in range(290):
            torch.as_strided(v, (64, 64), (64, 1), i * 4096)
        out[tag+"as_strided290"] = (T()-t)*1e6
        t = T(); st = torch.as_strided(v, (32, 64, 64), (4096, 64, 1), 0); u = torch.unbind(st); out[tag+"unbind32"] = (T()-t)*1e6
        t = T(); d = {f"k{i}": a for i in range(291)}; d2 = dict(d); out[tag+"dict"] = (T()-t)*1e6
    rnd("1st_", base)
    rnd("2nd_", base2)
    conn.send(out)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    res = {}
    for loading in ("lazy", "eager", "lazy", "eager", "lazy", "eager"):
        a, b = ctx.Pipe()
        p = ctx.Process(target=child, args=(loading, b)); p.start()
        if a.poll(60):
            res.setdefault(loading, []).append(a.recv())
        p.join(30)
    summ = {}
    for l, runs in res.items():
        for k in runs[0]:
            vals = sorted(r[k] for r in runs)
            summ.setdefault(k, {})[l] = round(vals[len(vals)//2], 1)
    for k, v in summ.items():
        print(f"{k:24s} {v}")
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "torch_first_calls.json"), "w"))
