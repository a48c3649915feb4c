#!/usr/bin/env python3
"""Checks and runs the code blocks of README.md, python/README.md and docs/guide.md that need
no GPU.

A block is marked to run with the word `cpu` after its language in the fence's info string:

    ```rust cpu        a complete Rust program (`fn main`), built against this crate and run
    ```python cpu      a complete Python script, run with python3 (the wheel must be installed)
    ```sh cpu          shell lines, run with bash -e

GitHub and crates.io colour such a block by its first word and show nothing of the rest;
rustdoc reads `cpu` as an unknown attribute and keeps the block a Rust doctest.

Every block, marked or not, is also checked for what makes it paste:
  * Rust: no rustdoc hidden lines (`# ...`), and either a complete program (`fn main`) or marked
    as a fragment (`rust,ignore`); `text` blocks are not Rust;
  * Python: it compiles, and every name it reads is defined in it, imported, or a builtin;
  * shell: `bash -n` accepts it.

Rust blocks run as the examples of a scratch package under target/readme-blocks/, which depends on
the crate by path (the workspace's Cargo.lock is copied there, so the same dependency versions are
built). Python and shell blocks run in a temporary directory, each with a timeout. Exits 1 when a
check or a run fails, listing each failure with its file and line.

Usage: python3 scripts/readme-blocks.py [--list] [--no-run] [FILE.md ...]
"""

from __future__ import annotations

import argparse
import builtins
import os
import re
import shutil
import subprocess
import sys
import symtable
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILES = ["README.md", "python/README.md", "docs/guide.md"]
SCRATCH = ROOT / "target" / "readme-blocks"
RUN_TIMEOUT_S = 120
BUILD_TIMEOUT_S = 1800
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
RUST_WORDS = {"rust", "rs"}
PYTHON_WORDS = {"python", "py", "python3"}
SHELL_WORDS = {"sh", "bash", "shell", "console"}
# Rustdoc attributes that make a block Rust without naming it (a bare fence is Rust to rustdoc).
RUSTDOC_ATTRS = {"ignore", "no_run", "should_panic", "compile_fail", "edition2015",
                 "edition2018", "edition2021", "edition2024", "test_harness", "standalone_crate"}


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    words: list[str]
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def lang(self) -> str:
        if not self.words:
            return "rust"  # rustdoc compiles an unmarked block as Rust
        first = self.words[0]
        if first in RUST_WORDS or first in RUSTDOC_ATTRS:
            return "rust"
        if first in PYTHON_WORDS:
            return "python"
        if first in SHELL_WORDS:
            return "sh"
        return first

    @property
    def cpu(self) -> bool:
        return "cpu" in self.words[1:]


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, their common indentation removed."""
    out: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        words = [w for w in re.split(r"[,\s]+", m.group("info").strip()) if w]
        start, body = i + 1, []
        i += 1
        while i < len(lines):
            close = FENCE.match(lines[i])
            if close and close.group("fence").startswith(fence) and not close.group("info").strip():
                break
            text = lines[i]
            body.append(text[indent:] if text[:indent].strip() == "" else text.lstrip())
            i += 1
        else:
            raise SystemExit(f"{path.relative_to(ROOT)}:{start}: a code block is never closed")
        out.append(Block(path, start, words, "\n".join(body) + "\n"))
        i += 1
    return out


def hidden_lines(code: str) -> list[int]:
    """Lines rustdoc would hide (`# x` or a lone `#`), 1-based within the block."""
    found = []
    for n, text in enumerate(code.splitlines(), 1):
        t = text.strip()
        if t == "#" or (t.startswith("# ") and not t.startswith("#[") and not t.startswith("#!")):
            found.append(n)
    return found


def undefined_names(code: str, filename: str) -> list[str]:
    """Names a Python script reads that it never defines or imports and that are not builtins."""
    table = symtable.symtable(code, filename, "exec")
    defined = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    known = defined | set(dir(builtins)) | {"__file__", "__name__"}
    missing: set[str] = set()

    def walk(t: symtable.SymbolTable) -> None:
        for s in t.get_symbols():
            name = s.get_name()
            if t.get_type() == "module":
                if s.is_referenced() and not s.is_assigned() and not s.is_imported() \
                        and name not in known:
                    missing.add(name)
            elif s.is_global() and s.is_referenced() and name not in known:
                missing.add(name)
        for child in t.get_children():
            walk(child)

    walk(table)
    return sorted(missing)


def check(block: Block) -> list[str]:
    """The paste checks of one block; each problem as a line."""
    problems = []
    if block.lang == "rust":
        hidden = hidden_lines(block.code)
        if hidden:
            problems.append(f"{block.where}: rustdoc hidden lines (# ...) at block lines {hidden}: "
                            "write a complete program instead")
        if "fn main" not in block.code and "ignore" not in block.words:
            problems.append(f"{block.where}: a Rust block that is not a complete program "
                            "(`fn main`): complete it or mark it ```rust,ignore")
        if block.cpu and ("ignore" in block.words or "no_run" in block.words):
            problems.append(f"{block.where}: marked cpu and also ignore/no_run")
    elif block.lang == "python":
        try:
            compile(block.code, block.where, "exec")
            missing = undefined_names(block.code, block.where)
            if missing:
                problems.append(f"{block.where}: not a complete script, it never defines "
                                f"{', '.join(missing)}")
        except SyntaxError as e:
            problems.append(f"{block.where}: Python syntax error: {e}")
    elif block.lang == "sh":
        r = subprocess.run(["bash", "-n"], input=block.code, text=True, capture_output=True)
        if r.returncode != 0:
            problems.append(f"{block.where}: bash -n: {r.stderr.strip()}")
    elif block.cpu:
        problems.append(f"{block.where}: marked cpu, but `{block.lang}` blocks cannot be run")
    return problems


def run_rust(blocks: list[Block]) -> list[str]:
    """Builds the Rust blocks as examples of a scratch package and runs each one."""
    if not blocks:
        return []
    examples = SCRATCH / "examples"
    if examples.exists():
        shutil.rmtree(examples)
    examples.mkdir(parents=True)
    names = []
    for n, block in enumerate(blocks):
        stem = re.sub(r"[^a-z0-9]+", "_", block.path.relative_to(ROOT).as_posix().lower())
        name = f"{stem}_line{block.line}"
        (examples / f"{name}.rs").write_text(f"// {block.where}\n{block.code}", encoding="utf-8")
        names.append(name)
    (SCRATCH / "Cargo.toml").write_text(
        "[package]\n"
        'name = "readme-blocks"\nversion = "0.0.0"\nedition = "2024"\npublish = false\n\n'
        "[dependencies]\n"
        f'cuda-ipc = {{ path = "{ROOT.as_posix()}" }}\n\n'
        "# Not a member of the repository's workspace.\n[workspace]\n",
        encoding="utf-8",
    )
    (SCRATCH / "src").mkdir(exist_ok=True)
    (SCRATCH / "src" / "lib.rs").write_text("", encoding="utf-8")
    shutil.copyfile(ROOT / "Cargo.lock", SCRATCH / "Cargo.lock")
    env = dict(os.environ, CARGO_TARGET_DIR=str(ROOT / "target"))
    print(f"building {len(blocks)} Rust block(s) in {SCRATCH.relative_to(ROOT)}", flush=True)
    try:
        build = subprocess.run(
            ["cargo", "build", "--quiet", "--examples"], cwd=SCRATCH, env=env,
            timeout=BUILD_TIMEOUT_S, text=True, capture_output=True)
    except subprocess.TimeoutExpired:
        return [f"Rust blocks: cargo build ran past {BUILD_TIMEOUT_S} s"]
    if build.returncode != 0:
        return [f"Rust blocks: cargo build failed:\n{build.stderr[-6000:]}"]
    failures = []
    for block, name in zip(blocks, names):
        binary = ROOT / "target" / "debug" / "examples" / name
        failures += run_one(block, [str(binary)])
    return failures


def run_one(block: Block, argv: list[str]) -> list[str]:
    """Runs one block's command in a fresh temporary directory; its failure as a line, if any."""
    with tempfile.TemporaryDirectory(prefix="readme-block-") as tmp:
        try:
            r = subprocess.run(argv, cwd=tmp, timeout=RUN_TIMEOUT_S, text=True,
                               capture_output=True, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return [f"{block.where}: ran past {RUN_TIMEOUT_S} s"]
    if r.returncode != 0:
        return [f"{block.where}: exit status {r.returncode}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"]
    print(f"ok   {block.where} ({block.lang})", flush=True)
    return []


def run_script(block: Block, interpreter: list[str], suffix: str) -> list[str]:
    with tempfile.NamedTemporaryFile("w", suffix=suffix, delete=False, encoding="utf-8") as f:
        f.write(block.code)
        script = f.name
    try:
        return run_one(block, interpreter + [script])
    finally:
        os.unlink(script)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("files", nargs="*", default=DEFAULT_FILES)
    ap.add_argument("--list", action="store_true", help="list the blocks and what is done to each")
    ap.add_argument("--no-run", action="store_true", help="only the paste checks, run nothing")
    args = ap.parse_args()

    blocks = [b for f in args.files for b in blocks_of(ROOT / f)]
    if args.list:
        for b in blocks:
            print(f"{b.where:28} {b.lang:8} {'run' if b.cpu else 'check'}  {' '.join(b.words)}")
        return 0
    failures = [p for b in blocks for p in check(b)]
    runnable = [b for b in blocks if b.cpu]
    if not runnable:
        failures.append("no block is marked cpu: nothing would be run")
    if not args.no_run and not failures:
        failures += run_rust([b for b in runnable if b.lang == "rust"])
        python = shutil.which("python3") or sys.executable
        for b in runnable:
            if b.lang == "python":
                failures += run_script(b, [python], ".py")
            elif b.lang == "sh":
                failures += run_script(b, ["bash", "-e"], ".sh")
    checked = len(blocks)
    if failures:
        print(f"\n{len(failures)} problem(s) in {checked} block(s):", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        return 1
    ran = 0 if args.no_run else len(runnable)
    print(f"{checked} block(s) checked, {ran} run: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
