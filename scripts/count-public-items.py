#!/usr/bin/env python3
"""Counts the public items of the cuda-ipc crate from its rustdoc HTML (stable rustdoc, no nightly):
every item in `all.html` (modules' structs, enums, traits, functions, constants, type aliases,
macros) plus, on each type's page, its inherent methods, associated constants, public fields and
enum variants (trait implementations not counted). Prints the total and the count per top-level
module.

    cargo doc --no-deps -p cuda-ipc && python3 scripts/count-public-items.py [target/doc/cuda_ipc]
"""

import collections
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "target/doc/cuda_ipc"
allhtml = open(os.path.join(root, "all.html")).read()
items = re.findall(r'<li><a href="([^"]+)">', allhtml)
per = collections.Counter()
for href in items:
    mod = href.split("/")[0] if "/" in href else "(root)"
    per[mod] += 1
    page = open(os.path.join(root, href)).read()
    # Inherent members only: cut the page where trait implementations begin.
    cut = re.search(r'id="(trait-implementations|synthetic-implementations|blanket-implementations)"', page)
    body = page[: cut.start()] if cut else page
    members = re.findall(r'id="(method|associatedconstant|structfield|variant|tymethod)\.[^"]+"', body)
    per[mod] += len(members)
print(f"public items: {sum(per.values())}")
for mod, n in sorted(per.items(), key=lambda kv: -kv[1]):
    print(f"  {mod:12s} {n}")
