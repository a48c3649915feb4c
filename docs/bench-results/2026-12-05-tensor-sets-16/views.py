"""Warm-process cost of building Llama's 291 views over one bf16 base, by route (µs, median of 7)."""
import json, statistics, sys, time
sys.path.insert(0, "bench")
import torch
from tensorset_attach import llama_shapes
shapes = llama_shapes()
sizes = [torch.Size(s).numel() for _, s in shapes]
offs, at = [], 0
for n in sizes:
    offs.append(at); at += (n + 127) // 128 * 128
base = torch.empty(at, dtype=torch.bfloat16, device="cuda")
torch.cuda.synchronize()
layer0 = 1
per_layer = 9
step = offs[1 + per_layer] - offs[1]
def r1():
    return [torch.as_strided(base, s, torch.empty(s, device="meta").stride(), o) for (_, s), o in zip(shapes, offs)]
strides = [torch.empty(s, device="meta").stride() for _, s in shapes]
def r1b():
    return [torch.as_strided(base, s, st, o) for (_, s), st, o in zip(shapes, strides, offs)]
def runs(unbind):
    out = [torch.as_strided(base, shapes[0][1], strides[0], offs[0])]
    for k in range(per_layer):
        i = 1 + k
        s = shapes[i][1]
        st = torch.as_strided(base, (32,) + tuple(s), (step,) + tuple(strides[i]), offs[i])
        out += list(unbind(st))
    for i in (len(shapes) - 2, len(shapes) - 1):
        out.append(torch.as_strided(base, shapes[i][1], strides[i], offs[i]))
    return out
def r2(): return runs(torch.unbind)
def r3(): return runs(lambda t: t.unbind())
def r4():
    with torch.no_grad(): return runs(torch.unbind)
def r5():
    with torch.inference_mode(): return runs(torch.unbind)
def r6(): return [base[o:o + n].view(s) for (_, s), o, n in zip(shapes, offs, sizes)]
def r7():
    st = base.untyped_storage()
    out = []
    for (_, s), sd, o in zip(shapes, strides, offs):
        t = torch.empty(0, dtype=torch.bfloat16, device="cuda"); t.set_(st, o, s, sd); out.append(t)
    return out
def r8():
    d = {}
    for i, t in enumerate(runs(torch.unbind)):
        d[shapes[i][0]] = t
    return dict(d)
res = {}
t = time.perf_counter(); x = r2(); res["first_runs_unbind"] = round((time.perf_counter() - t) * 1e6, 1); del x
t = time.perf_counter(); x = r2(); res["second_runs_unbind"] = round((time.perf_counter() - t) * 1e6, 1); del x
for name, f in [("per_tensor_as_strided", r1b), ("runs_unbind", r2), ("runs_unbind_method", r3), ("runs_no_grad", r4),
                ("runs_inference_mode", r5), ("slice_view", r6), ("set_", r7), ("runs+dict", r8)]:
    f()
    ts = []
    for _ in range(7):
        t = time.perf_counter(); x = f(); ts.append((time.perf_counter() - t) * 1e6); del x
    res[name] = round(statistics.median(ts), 1)
t = time.perf_counter(); torch.cuda.current_stream(0); res["current_stream_us"] = round((time.perf_counter() - t) * 1e6, 1)
print(json.dumps(res))
