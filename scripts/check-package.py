#!/usr/bin/env python3
"""Checks what `cargo publish` would upload for the crates published from this repository: the
library (`cuda-ipc`) and the command line (`cuda-ipc-cli`). Fails when a file the crate needs is
missing from its package (sources, the PTX `kernels` embeds, the README and crate doc the library
includes, the licences), when something that belongs to the repository only is in it (benchmarks
and their results, images, the Python extension, fuzz/, examples, scripts, the tests that read
the repository beyond the package), or when a compressed package is larger than the limit below.
Packages without verifying (the dry run of `cargo publish` in `.ci/run` builds them).

    python3 scripts/check-package.py
"""

import re
import subprocess
import sys

# The most a compressed .crate may weigh (crates.io takes 10 MiB; ours are well under 1 MiB).
MAX_CRATE_BYTES = 1 << 20

NEEDED = {
    "cuda-ipc": ["Cargo.toml", "README.md", "LICENSE-MIT", "LICENSE-APACHE", "src/lib.rs",
                 "docs/crate-doc.md", "kernels/kernels.ptx", "kernels/fingerprint.ptx",
                 "tests/common/mod.rs"],
    "cuda-ipc-cli": ["Cargo.toml", "README.md", "LICENSE-MIT", "LICENSE-APACHE", "src/main.rs"],
}
FORBIDDEN = re.compile(
    r"^(bench|benches|python|fuzz|examples|scripts|target|cli|\.ci)/"
    r"|^docs/(bench-results/|benchmarks\.md$|gpu-verification\.md$)|\.(png|whl|so)$"
    r"|^tests/(layering|object_kinds|remote_wire_fuzz)\.rs$")


def cargo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["cargo", *args], check=True, capture_output=True, text=True)


def main() -> int:
    bad = []
    for crate, needed in NEEDED.items():
        files = cargo("package", "--list", "--locked", "-p", crate).stdout.split()
        for f in needed:
            if f not in files:
                bad.append(f"{crate}: {f} is not in the package")
        for f in files:
            if FORBIDDEN.search(f):
                bad.append(f"{crate}: {f} is in the package")
        print(f"{crate}: {len(files)} files")
    # `cargo package` reports each package's size: "Packaged N files, X (Y compressed)"; the
    # .crate files land in target/package.
    err = cargo("package", "--no-verify", "--locked", *[a for c in NEEDED for a in ("-p", c)]).stderr
    for crate in NEEDED:
        path = f"target/package/{crate}-{version(crate)}.crate"
        size = len(open(path, "rb").read())
        print(f"{crate}: {path}, {size} bytes compressed")
        if size > MAX_CRATE_BYTES:
            bad.append(f"{crate}: the package weighs {size} bytes, more than {MAX_CRATE_BYTES}")
    if "Packaged" not in err:
        bad.append(f"cargo package said no size: {err}")
    for b in bad:
        print(f"check-package: {b}", file=sys.stderr)
    return 1 if bad else 0


def version(crate: str) -> str:
    out = cargo("pkgid", "--locked", "-p", crate).stdout.strip()
    return out.rsplit("@", 1)[-1].rsplit("#", 1)[-1]


if __name__ == "__main__":
    sys.exit(main())
