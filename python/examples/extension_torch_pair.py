# A PyTorch producer process and a PyTorch consumer process through the cuda_ipc extension and
# DLPack (zero-copy: the tensor's data pointer is the frame's), every frame checked; needs a GPU.
# MEM=legacy|vmm|pool python3 extension_torch_pair.py
import os, subprocess, sys, time
import torch
import cuda_ipc

N = 500
NBYTES = 4 << 20

def producer(name):
    with cuda_ipc.Producer(name, NBYTES, buffers=4, memory=os.environ.get("MEM", "auto")) as p:
        print("ready", flush=True)
        t0 = time.monotonic()
        while not os.path.exists(f"/tmp/{name}.attached"):
            assert time.monotonic() - t0 < 60, "no consumer attached"
            time.sleep(0.01)
        t0 = time.monotonic()
        for i in range(N):
            f = p.acquire(timeout=10)
            t = torch.from_dlpack(f)
            assert t.data_ptr() == f.ptr, "zero-copy"
            t.fill_(i % 251)
            torch.cuda.current_stream().synchronize()
            del t
            f.publish(metadata=bytes([i % 251]))
        dt = time.monotonic() - t0
        print(f"producer frames={N} frames_per_s={N/dt:.0f}", flush=True)
        p.close(timeout=10)

def consumer(name):
    bad = 0; n = 0; zero_copy = True
    with cuda_ipc.Consumer.attach(name) as rx:
        open(f"/tmp/{name}.attached", "w").close()
        for f in rx:
            t = torch.from_dlpack(f)
            zero_copy &= t.data_ptr() == f.ptr
            want = f.metadata[0]
            bad += int((t != want).sum().item())
            del t
            f.release()
            n += 1
    print(f"consumer frames={n} mismatched_bytes={bad} zero_copy={zero_copy}", flush=True)

if __name__ == "__main__":
    if len(sys.argv) > 2:
        (producer if sys.argv[1] == "producer" else consumer)(sys.argv[2])
        sys.exit(0)
    name = f"pyx-{os.getpid()}"
    p = subprocess.Popen([sys.executable, __file__, "producer", name], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    c = subprocess.run([sys.executable, __file__, "consumer", name], capture_output=True, text=True, timeout=120)
    out, _ = p.communicate(timeout=60)
    print(os.environ.get("MEM"), out.strip(), "|", c.stdout.strip(), c.stderr.strip()[-1500:], "| rc", p.returncode, c.returncode)
