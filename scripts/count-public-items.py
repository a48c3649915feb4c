#!/usr/bin/env python3
"""Counts the public items of the cuda-ipc crate reachable from its root, each once, from its
rustdoc HTML (stable rustdoc, no nightly).

What counts, each item once:
- every public module below the crate root (a module page, `*/index.html`);
- every item rustdoc lists in `all.html`: structs, enums, unions, traits, functions, constants,
  statics, type aliases, macros. An item re-exported at several paths (`cuda_ipc::ShmError` and
  `cuda_ipc::raw::shm::ShmError`) has a page at each; it is counted once, at the first path in
  `all.html`'s order, known by the source location its page links to;
- on each such item's page, before the trait implementations: its inherent methods, associated
  constants and types, a trait's own methods (required and provided), a struct's public fields
  and an enum's variants.

What does not count: fields of enum variants (part of their variant), trait implementations
(`Clone`, `Display`, `From`, ...), blanket and auto-trait implementations, and `#[doc(hidden)]`
items (stable rustdoc does not document them: unstable internals belong under `raw`, where they
are documented and counted).

Prints the total, the total outside `raw` (the API the crate keeps stable), the count per
top-level module and per kind of item.

    cargo doc --no-deps -p cuda-ipc && python3 scripts/count-public-items.py [target/doc/cuda_ipc]
"""

import collections
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "target/doc/cuda_ipc"


def top(href):
    """The top-level module of a page's path (`(root)` for the crate root)."""
    return href.split("/")[0] if "/" in href else "(root)"


per = collections.Counter()
kinds = collections.Counter()

# Modules: every module page below the crate root.
for dirpath, _, files in os.walk(root):
    rel = os.path.relpath(dirpath, root)
    if rel != "." and "index.html" in files:
        per[top(rel + "/index.html")] += 1
        kinds["module"] += 1

allhtml = open(os.path.join(root, "all.html")).read()
seen = set()
for href in re.findall(r'<li><a href="([^"]+)">', allhtml):
    page = open(os.path.join(root, href)).read()
    src = re.search(r'<a class="src" href="([^"]+)"', page)
    key = src.group(1).rsplit("src/", 1)[-1] if src else href
    if key in seen:
        continue  # the same item re-exported at another path
    seen.add(key)
    mod = top(href)
    per[mod] += 1
    kinds[os.path.basename(href).split(".")[0]] += 1
    # Members: inherent ones only, so cut the page where trait implementations begin.
    cut = re.search(
        r'id="(trait-implementations|synthetic-implementations|blanket-implementations)"', page
    )
    body = page[: cut.start()] if cut else page
    for m in re.findall(
        r'id="(method|tymethod|associatedconstant|associatedtype|structfield|variant)\.([^"]+)"',
        body,
    ):
        kind, name = m
        if kind == "variant" and "." in name:
            continue  # a field of a variant (`variant.Name.field.x`): part of the variant
        per[mod] += 1
        kinds[kind] += 1

total = sum(per.values())
print(f"public items: {total} ({total - per['raw']} outside raw)")
for mod, n in sorted(per.items(), key=lambda kv: (-kv[1], kv[0])):
    print(f"  {mod:14s} {n}")
print("by kind:")
for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])):
    print(f"  {kind:18s} {n}")
