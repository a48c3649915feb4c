#!/usr/bin/env python3
"""Compiles one CUDA C file to PTX with NVRTC (scripts/build-ptx.sh calls it).

    python3 scripts/nvrtc-ptx.py LIBNVRTC SOURCE.cu OUT.ptx

LIBNVRTC is the path of `libnvrtc.so.12` (NVIDIA's `nvidia-cuda-nvrtc-cu12` wheel). The program is
named after the source's file name alone, so the PTX does not depend on where the tree lies. The
architecture is compute_75; NVRTC of CUDA 12.0 writes PTX ISA 8.0, which every CUDA 12 or newer
driver loads. Exits 1 with NVRTC's log when the source does not compile.
"""

import ctypes
import os
import sys


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    lib = ctypes.CDLL(sys.argv[1])
    source, out = sys.argv[2], sys.argv[3]
    prog_t, size_p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)
    for fn, args in (
        ("nvrtcCreateProgram", [ctypes.POINTER(prog_t), ctypes.c_char_p, ctypes.c_char_p,
                                ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]),
        ("nvrtcCompileProgram", [prog_t, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]),
        ("nvrtcGetProgramLogSize", [prog_t, size_p]),
        ("nvrtcGetProgramLog", [prog_t, ctypes.c_char_p]),
        ("nvrtcGetPTXSize", [prog_t, size_p]),
        ("nvrtcGetPTX", [prog_t, ctypes.c_char_p]),
        ("nvrtcDestroyProgram", [ctypes.POINTER(prog_t)]),
    ):
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = ctypes.c_int

    def call(fn, *args):
        status = getattr(lib, fn)(*args)
        if status != 0:
            raise RuntimeError(f"{fn} failed for {source} (NVRTC status {status})")

    with open(source, "rb") as f:
        text = f.read()
    prog = prog_t()
    name = os.path.basename(source).encode()
    call("nvrtcCreateProgram", ctypes.byref(prog), text, name, 0, None, None)
    try:
        opts = [b"--gpu-architecture=compute_75"]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        call("nvrtcGetProgramLogSize", prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        call("nvrtcGetProgramLog", prog, log)
        if status != 0:
            text = log.value.decode(errors="replace")
            print(f"{source} does not compile (NVRTC status {status}):\n{text}", file=sys.stderr)
            return 1
        call("nvrtcGetPTXSize", prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        call("nvrtcGetPTX", prog, ptx)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    with open(out, "wb") as f:
        f.write(ptx.value)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
