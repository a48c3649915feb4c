#!/usr/bin/env python3
"""Checks the declared minimum Rust version (`rust-version` in each workspace member's Cargo.toml)
against what the locked dependencies declare: fails when a package that a member depends on (its
normal and build dependencies, transitively, as `Cargo.lock` resolves them) needs a newer Rust
than the member says it builds with. Dependencies are resolved with every feature on
(`--all-features`), so optional ones (the `remote` lane's `nixl-sys`) are held to it too. The crate's own code is held to its `rust-version` by clippy's
`incompatible_msrv` lint (standard-library items newer than the declared version), which `.ci/run`
runs with `-D warnings`; language features newer than the declared version fail to compile there.

    python3 scripts/check-msrv.py
"""

import json
import subprocess
import sys


def ver(v: str) -> tuple:
    return tuple(int(x) for x in (v.split(".") + ["0", "0"])[:3])


meta = json.loads(subprocess.run(
    ["cargo", "metadata", "--format-version", "1", "--locked", "--all-features"],
    check=True, capture_output=True, text=True).stdout)
pkgs = {p["id"]: p for p in meta["packages"]}
nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
bad = []
for member in meta["workspace_members"]:
    declared = pkgs[member].get("rust_version")
    if not declared:
        bad.append(f"{pkgs[member]['name']}: no rust-version declared")
        continue
    seen, todo = set(), [member]
    while todo:
        pid = todo.pop()
        for dep in nodes[pid]["deps"]:
            kinds = {k.get("kind") for k in dep["dep_kinds"]}
            if pid == member and kinds <= {"dev"}:
                continue  # a member's dev-dependencies build its tests, not the crate
            if kinds <= {"dev"}:
                continue
            if dep["pkg"] not in seen:
                seen.add(dep["pkg"])
                todo.append(dep["pkg"])
    for pid in seen:
        need = pkgs[pid].get("rust_version")
        if need and ver(need) > ver(declared):
            bad.append(f"{pkgs[member]['name']} declares rust-version {declared}, but "
                       f"{pkgs[pid]['name']} {pkgs[pid]['version']} needs {need}")
    print(f"{pkgs[member]['name']}: rust-version {declared}, {len(seen)} dependencies checked")
for b in bad:
    print(f"check-msrv: {b}", file=sys.stderr)
sys.exit(1 if bad else 0)
