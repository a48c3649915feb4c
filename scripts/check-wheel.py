#!/usr/bin/env python3
"""Checks a built wheel of the Python extension before it is published: fails unless `auditwheel
show` finds it consistent with a manylinux tag of glibc 2.28 or older (so it installs on every
distribution of the manylinux_2_28 family: RHEL/Alma/Rocky 8, Debian 10, Ubuntu 18.10 and newer),
unless the wheel's own file name carries that tag, unless both licence files are in its
.dist-info, and unless the extension module takes its unwinder (`_Unwind_*`) from the system's
`libgcc_s.so.1` rather than carrying its own (python/build.rs says why: a module linked by zig
with its own unwinder crashes the interpreter's exit). `auditwheel` must be installed (`.ci/run`
pins it; its `pyelftools` reads the module).

    python3 scripts/check-wheel.py target/wheels/cuda_ipc-0.1.0-cp39-abi3-manylinux_2_28_x86_64.whl
"""

import io
import re
import subprocess
import sys
import zipfile

from elftools.elf.elffile import ELFFile

# The newest glibc a published wheel may need (manylinux_2_28: glibc 2.28).
MAX_GLIBC_MINOR = 28
LICENCES = ("LICENSE-MIT", "LICENSE-APACHE")


def check(wheel: str) -> list:
    bad = []
    out = subprocess.run([sys.executable, "-m", "auditwheel", "show", wheel],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return [f"auditwheel show failed ({out.returncode}): {out.stderr.strip()}"]
    # auditwheel wraps its text at 80 columns: join the lines before matching.
    text = " ".join(out.stdout.split())
    m = re.search(r'following platform tag: "manylinux_(\d+)_(\d+)_(\w+)"', text)
    if not m:
        return [f"auditwheel show names no manylinux tag: {text}"]
    major, minor = int(m.group(1)), int(m.group(2))
    if (major, minor) > (2, MAX_GLIBC_MINOR):
        bad.append(f"the wheel needs glibc {major}.{minor} (auditwheel: manylinux_{major}_{minor}); "
                   f"at most 2.{MAX_GLIBC_MINOR} is allowed: build with "
                   f"`maturin build --zig --compatibility manylinux_2_{MAX_GLIBC_MINOR}`")
    named = re.search(r"-manylinux_(\d+)_(\d+)_\w+\.whl$", wheel)
    if not named or (int(named.group(1)), int(named.group(2))) > (2, MAX_GLIBC_MINOR):
        bad.append(f"the file name carries no manylinux tag of glibc 2.{MAX_GLIBC_MINOR} or older")
    names = zipfile.ZipFile(wheel).namelist()
    for lic in LICENCES:
        if not any(re.fullmatch(rf"[^/]+\.dist-info/licenses/{lic}", n) for n in names):
            bad.append(f"{lic} is not in the wheel's .dist-info/licenses")
    bad += unwinder(wheel, names)
    print(f"{wheel}: auditwheel tag manylinux_{major}_{minor}_{m.group(3)}, "
          f"{len(names)} files")
    return bad


def unwinder(wheel: str, names: list) -> list:
    """Each extension module must need `libgcc_s.so.1` and import `_Unwind_RaiseException` from
    it (undefined in its dynamic symbols), not define an unwinder of its own."""
    bad = []
    modules = [n for n in names if n.endswith(".so")]
    if not modules:
        return ["the wheel holds no extension module (.so)"]
    for n in modules:
        elf = ELFFile(io.BytesIO(zipfile.ZipFile(wheel).read(n)))
        dynamic = elf.get_section_by_name(".dynamic")
        needed = [t.needed for t in dynamic.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
        dynsym = elf.get_section_by_name(".dynsym")
        raise_ = [s for s in dynsym.iter_symbols() if s.name == "_Unwind_RaiseException"]
        imported = bool(raise_) and all(s["st_shndx"] == "SHN_UNDEF" for s in raise_)
        if "libgcc_s.so.1" not in needed or not imported:
            bad.append(f"{n} does not take its unwinder from libgcc_s.so.1 (needs {needed}; "
                       f"_Unwind_RaiseException {'imported' if imported else 'not imported'}): "
                       "build it with python/build.rs in place, on a machine whose C compiler "
                       "finds libgcc_s.so.1")
    return bad


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    bad = [f"{w}: {b}" for w in sys.argv[1:] for b in check(w)]
    for b in bad:
        print(f"check-wheel: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
