"""PyTorch's pluggable allocator of the cuda_ipc extension on a GPU: a model built under
``torch.cuda.use_mem_pool(cuda_ipc.torch_mem_pool())`` lives in the extension's VMM arena, every
parameter is found there (``arena_locate``) in a few chunks, its forward output equals the same
model's built in PyTorch's default allocator, and only the calling thread's allocations go to the
pool. Needs a GPU.

    python3 python/examples/torch_mem_pool.py [--hidden 4096] [--layers 8] [--chunk-mib 256]

Prints ``params=N bytes=B chunks=C reserved=R in_use=U other_thread_in_arena=False max_diff=0.0``
and exits non-zero when a check fails.
"""

import argparse
import sys
import threading

import torch

import cuda_ipc


def build(hidden: int, layers: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        *[torch.nn.Linear(hidden, hidden, dtype=torch.bfloat16) for _ in range(layers)]
    ).cuda()


def in_arena(t: torch.Tensor) -> bool:
    try:
        cuda_ipc.arena_locate(t.data_ptr(), max(t.nbytes, 1))
        return True
    except cuda_ipc.InvalidArgument:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--chunk-mib", type=int, default=256)
    a = p.parse_args()
    before = cuda_ipc.arena_stats(0)
    pool = cuda_ipc.torch_mem_pool(0, chunk_bytes=a.chunk_mib << 20)
    other = {}

    def other_thread():
        other["t"] = torch.ones(1 << 20, device="cuda")

    with torch.cuda.use_mem_pool(pool):
        model = build(a.hidden, a.layers, 0)
        th = threading.Thread(target=other_thread)
        th.start()
        th.join(60)
    reference = build(a.hidden, a.layers, 0)
    torch.cuda.synchronize()

    failures = []
    params = list(model.state_dict().values())
    missing = [i for i, t in enumerate(params) if not in_arena(t)]
    if missing:
        failures.append(f"{len(missing)} of {len(params)} tensors are not in the arena")
    if any(in_arena(t) for t in reference.state_dict().values()):
        failures.append("a tensor of the default allocator was found in the arena")
    other_in = in_arena(other["t"])
    if other_in:
        failures.append("another thread's allocation went to the pool")
    chunks = {cuda_ipc.arena_locate(t.data_ptr(), 1)[0] for t in params}
    s = cuda_ipc.arena_stats(0)
    nbytes = sum(t.nbytes for t in params)
    if s["in_use_bytes"] < nbytes or s["reserved_bytes"] < s["in_use_bytes"]:
        failures.append(f"arena stats do not add up: {s} for {nbytes} bytes")
    if before["chunks"] != 0 or s["chunks"] > nbytes // (a.chunk_mib << 20) + 2 or len(chunks) > s["chunks"]:
        failures.append(f"{s['chunks']} chunks ({len(chunks)} used) for {nbytes} bytes")

    x = torch.randn(16, a.hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        diff = (model(x).float() - reference(x).float()).abs().max().item()
    if diff != 0.0:
        failures.append(f"forward outputs differ by {diff}")

    # Freed memory goes back to the arena (not to the driver): chunks stay.
    del model
    torch.cuda.synchronize()
    pool_chunks = s["chunks"]
    del pool
    torch.cuda.empty_cache()
    after = cuda_ipc.arena_stats(0)
    if after["chunks"] != pool_chunks:
        failures.append(f"chunks changed after empty_cache: {after}")

    print(f"params={len(params)} bytes={nbytes} chunks={s['chunks']} reserved={s['reserved_bytes']} "
          f"in_use={s['in_use_bytes']} in_use_after_free={after['in_use_bytes']} "
          f"other_thread_in_arena={other_in} max_diff={diff}")
    for f in failures:
        print("FAILED:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
