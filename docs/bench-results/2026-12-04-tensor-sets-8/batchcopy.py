"""Exploration: many scattered same-GPU copies, one call each vs cuMemcpyBatchAsync vs torch._foreach_copy_ vs one copy."""
import ctypes, time, statistics, sys, json
import torch

def main():
    cu = ctypes.CDLL("libcuda.so.1")
    pfn = ctypes.c_void_p()
    st = ctypes.c_int()
    r = cu.cuGetProcAddress_v2(b"cuMemcpyBatchAsync", ctypes.byref(pfn), 12080, ctypes.c_uint64(0), ctypes.byref(st))
    print("getproc", r, st.value, pfn.value)
    batch = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)(pfn.value)
    r = cu.cuGetProcAddress_v2(b"cuMemcpyDtoDAsync", ctypes.byref(pfn), 12080, ctypes.c_uint64(0), ctypes.byref(st))
    d2d = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)(pfn.value)
    class Loc(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
    class Attr(ctypes.Structure):
        _fields_ = [("order", ctypes.c_int), ("src", Loc), ("dst", Loc), ("flags", ctypes.c_uint)]
    out = {}
    s = torch.cuda.Stream()
    for shape, n, nbytes in (("moe", 4608, 1 << 20), ("llama_like", 291, 55 << 20), ("small", 20000, 64 << 10)):
        srcs = [torch.full((nbytes,), i % 251, dtype=torch.uint8, device="cuda") for i in range(n)]
        # interleave junk allocations so nothing is back to back
        total = n * nbytes
        dst = torch.empty(total, dtype=torch.uint8, device="cuda")
        big = torch.empty(total, dtype=torch.uint8, device="cuda")
        dptr = [dst.data_ptr() + i * nbytes for i in range(n)]
        sptr = [t.data_ptr() for t in srcs]
        D = (ctypes.c_uint64 * n)(*dptr); S = (ctypes.c_uint64 * n)(*sptr); Z = (ctypes.c_size_t * n)(*([nbytes] * n))
        a = Attr(); a.order = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        a.src.type = 1; a.src.id = 0; a.dst.type = 1; a.dst.id = 0  # CU_MEM_LOCATION_TYPE_DEVICE
        idx = (ctypes.c_size_t * 1)(0); fail = ctypes.c_size_t(0)
        res = {"loop": [], "batch": [], "foreach": [], "one": []}
        dviews = [dst[i * nbytes:(i + 1) * nbytes] for i in range(n)]
        for rep in range(5):
            for k in res:
                dst.zero_(); torch.cuda.synchronize()
                t = time.perf_counter()
                with torch.cuda.stream(s):
                    if k == "loop":
                        h = s.cuda_stream
                        for i in range(n):
                            d2d(dptr[i], sptr[i], nbytes, h)
                    elif k == "batch":
                        rr = batch(D, S, Z, n, ctypes.byref(a), idx, 1, ctypes.byref(fail), s.cuda_stream)
                        if rr: print("batch err", rr, fail.value); 
                    elif k == "foreach":
                        torch._foreach_copy_(dviews, srcs)
                    else:
                        big.copy_(dst)
                s.synchronize()
                res[k].append((time.perf_counter() - t) * 1e3)
                if k != "one":
                    ok = all(int(dst[i * nbytes + 7]) == i % 251 for i in range(0, n, max(1, n // 50)))
                    if not ok: print("MISMATCH", shape, k)
        out[shape] = {k: round(statistics.median(v), 3) for k, v in res.items()}
        print(shape, out[shape], flush=True)
        del srcs, dst, big, dviews
        torch.cuda.empty_cache()
    json.dump(out, open(sys.argv[1], "w"), indent=1)

if __name__ == "__main__":
    main()
