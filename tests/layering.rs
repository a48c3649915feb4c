//! The module graph of docs/ARCHITECTURE.md ("Module graph"), enforced, with the document as the
//! one copy of it: the rank table there (which layer may import which) is read by this test, and so
//! is the list of what each file imports from other layers, and what `error.rs` may name.
//!
//! Checked: the table names every layer of `lib.rs` and lets each import only layers of a lower
//! rank; every `crate::X` path in `src/**/*.rs` (code, not comments) names a layer that `X`'s row
//! allows; the per-file list says exactly which other layers each file names (so an import added
//! without its line fails, and a line can only be added within the table); and within a layer no
//! two files name each other (directly or around a longer circle), counting the files of a nested
//! folder (`ipc/foreign/kind.rs`) toward their folder (`ipc::foreign`).
//!
//! A layer's `mod.rs` and its files are one unit toward each other (a file may use what its parent
//! declares, the parent re-exports its files); the circle check is between sibling files. A name
//! re-exported by the parent (`super::MemPool`, `crate::ipc::ImportedBuffer`) counts as the file
//! that defines it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// docs/ARCHITECTURE.md.
fn architecture() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/ARCHITECTURE.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The text of a section: from the line `## {title}` to the next `## `.
fn section<'a>(doc: &'a str, title: &str) -> &'a str {
    let head = format!("## {title}\n");
    let at = doc
        .find(&head)
        .unwrap_or_else(|| panic!("docs/ARCHITECTURE.md has no section \"## {title}\""));
    let body = &doc[at + head.len()..];
    &body[..body.find("\n## ").unwrap_or(body.len())]
}

/// The names in backticks of a piece of text: "`a`, `b` (c)" → ["a", "b"].
fn ticked(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// A text with its parenthesised asides removed: "`a` (the `X` type), `b`" → "`a` , `b`".
fn without_asides(text: &str) -> String {
    let mut out = String::new();
    let mut depth = 0u32;
    for c in text.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out
}

/// One row of the rank table per layer: (rank, layer, the layers it may import).
type Layers = Vec<(u32, String, Vec<String>)>;

/// Parses the rank table of the "Module graph" section: `| rank | modules | may import |`. The
/// modules are the names in backticks of the second cell (asides in parentheses left out); the
/// third cell is either one list for every module of the row, or `; `-separated parts that each
/// start with `` `module`: ``. In both, asides in parentheses are left out and only names of
/// layers in the table count ("nothing", `nixl-sys`, `Uuid` are prose).
fn parse_layers(section: &str) -> Layers {
    let rows: Vec<Vec<&str>> = section
        .lines()
        .filter(|l| l.starts_with('|'))
        .map(|l| {
            l.trim()
                .trim_matches('|')
                .split('|')
                .map(str::trim)
                .collect()
        })
        .filter(|cells: &Vec<&str>| cells.len() == 3 && cells[0].parse::<u32>().is_ok())
        .collect();
    let mut named: Vec<(u32, Vec<String>, String)> = Vec::new();
    for cells in &rows {
        let rank = cells[0].parse().unwrap();
        named.push((
            rank,
            ticked(&without_asides(cells[1])),
            without_asides(cells[2]),
        ));
    }
    let all: BTreeSet<String> = named.iter().flat_map(|(_, m, _)| m.clone()).collect();
    let mut out = Vec::new();
    for (rank, modules, may) in named {
        let mut per: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let parts: Vec<&str> = may.split(';').collect();
        let prefixed = |p: &str| {
            let p = p.trim();
            let name = p.strip_prefix('`')?.split_once("`:")?.0.to_string();
            modules.contains(&name).then_some(name)
        };
        if parts.iter().any(|p| prefixed(p).is_some()) {
            for p in parts {
                let Some(m) = prefixed(p) else {
                    continue;
                };
                let rest = p.trim().split_once("`:").unwrap().1;
                per.insert(m, ticked(rest));
            }
        } else {
            for m in &modules {
                per.insert(m.clone(), ticked(&may));
            }
        }
        for m in modules {
            let mut deps: Vec<String> = per.remove(&m).unwrap_or_default();
            deps.retain(|d| all.contains(d));
            out.push((rank, m, deps));
        }
    }
    out
}

/// The rank table of docs/ARCHITECTURE.md.
fn layers() -> Layers {
    parse_layers(section(&architecture(), "Module graph"))
}

/// What `error.rs` may name outside itself: each layer's error type (a variant payload) and the
/// device UUID of `Error::DeviceNotFound`; read from the paragraph of docs/ARCHITECTURE.md that
/// starts with "`error` is outside the ranks" (its `layer::Type` names in backticks).
fn error_names() -> Vec<String> {
    let doc = architecture();
    let graph = section(&doc, "Module graph");
    let at = graph.find("`error` is outside the ranks").expect(
        "the Module graph section says what `error` names (\"`error` is outside the ranks\")",
    );
    let para = &graph[at..];
    let para = &para[..para.find("\n\n").unwrap_or(para.len())];
    ticked(para)
        .into_iter()
        .filter(|n| {
            n.split_once("::").is_some_and(|(l, t)| {
                !l.is_empty()
                    && l.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
                    && t.starts_with(|c: char| c.is_ascii_uppercase())
                    && t.bytes().all(|b| b.is_ascii_alphanumeric())
            })
        })
        .collect()
}

/// The per-file list of docs/ARCHITECTURE.md ("What each module imports"): file → the other
/// layers it names (before `; within:`).
fn import_list() -> BTreeMap<String, BTreeSet<String>> {
    let doc = architecture();
    let graph = section(&doc, "Module graph");
    let at = graph
        .find("What each module imports")
        .expect("the Module graph section lists what each module imports");
    let rest = &graph[at..];
    let open = rest.find("```text\n").expect("the list is a ```text block") + 8;
    let block = &rest[open..open + rest[open..].find("```").unwrap()];
    block
        .lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(file, deps)| {
            let outside = deps.split("; within:").next().unwrap_or("");
            let set = if outside.trim() == "nothing of the crate" {
                BTreeSet::new()
            } else {
                outside
                    .split(',')
                    .map(|d| d.trim().to_string())
                    .filter(|d| !d.is_empty() && !d.starts_with("within:"))
                    .collect()
            };
            (file.trim().to_string(), set)
        })
        .collect()
}

/// Names `lib.rs` re-exports at the crate root, and the module they come from (`pub use
/// error::{Error, Result}` → `Error` → `error`), read from `lib.rs` itself.
fn root_names() -> BTreeMap<String, String> {
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs");
    reexports(&code_only(&std::fs::read_to_string(lib).unwrap()))
}

/// The layers `lib.rs` declares (`mod x;`, `pub mod x;`, `pub(crate) mod x;`).
fn declared_layers() -> BTreeSet<String> {
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs");
    let code = code_only(&std::fs::read_to_string(lib).unwrap());
    code.split(';')
        .filter_map(|s| {
            let s = s.trim();
            let s = s.rsplit(']').next().unwrap_or(s).trim();
            let s = s
                .strip_prefix("pub(crate) ")
                .or_else(|| s.strip_prefix("pub "))
                .unwrap_or(s);
            s.strip_prefix("mod ").map(|m| m.trim().to_string())
        })
        .collect()
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a source file: `src/ipc/vmm.rs` → `["ipc", "vmm"]`, `src/ipc/mod.rs` →
/// `["ipc"]`, `src/lib.rs` → `[]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|l| l == "mod" || l == "lib") {
        parts.pop();
    }
    parts
}

/// The code of a file with comments (line, doc and block) and the contents of string and char
/// literals removed, so that only real paths remain.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == b'r' && matches!(b.get(i + 1), Some(b'#') | Some(b'"')) && !ident(b, i) {
            // A raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push('r');
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&b'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{1F600}') or a lifetime ('a): skip only the literal.
            let close = if b.get(i + 1) == Some(&b'\\') {
                // The escaped character is at i + 2 (`'\''`, `'\\'`): the closing quote follows.
                b.get(i + 3..)
                    .and_then(|rest| rest.iter().position(|&x| x == b'\''))
                    .map(|p| i + 3 + p)
            } else if b.get(i + 2) == Some(&b'\'') {
                Some(i + 2)
            } else {
                None
            };
            match close {
                Some(end) => {
                    out.push_str("' '");
                    i = end + 1;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            out.push(c as char);
            i += 1;
        }
    }
    out
}

/// Whether the byte before `i` continues an identifier (so `r` at `i` is not a raw-string prefix).
fn ident(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// Every path that starts with `prefix` (`crate::` or `super::`), as its segments:
/// `crate::ipc::MemPool::new` → `["ipc", "MemPool", "new"]`. A `{` group (`use crate::{a, b}` or
/// `use crate::ipc::{A, B}`) gives one path per member.
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let b = code.as_bytes();
    let mut from = 0;
    while let Some(p) = code[from..].find(prefix) {
        let at = from + p;
        from = at + prefix.len();
        if ident(b, at) || (at >= 2 && &code[at - 2..at] == "::") {
            continue; // `foo_crate::` or `super::super::` seen from its second half
        }
        let mut segs = Vec::new();
        let mut j = from;
        loop {
            let start = j;
            while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'_') {
                j += 1;
            }
            if start == j {
                if b.get(j) == Some(&b'{') {
                    let end = code[j..].find('}').map_or(b.len(), |e| j + e);
                    for member in code[j + 1..end].split(',') {
                        let first = member.trim().split("::").next().unwrap_or("").trim();
                        if !first.is_empty() && first != "self" {
                            let mut s = segs.clone();
                            s.push(first.to_string());
                            out.push(s);
                        }
                    }
                    segs.clear();
                }
                break;
            }
            segs.push(code[start..j].to_string());
            if code[j..].starts_with("::") {
                j += 2;
            } else {
                break;
            }
        }
        if !segs.is_empty() {
            out.push(segs);
        }
    }
    out
}

/// `pub use child::{A, B}` / `pub(crate) use child::A` lines of a parent module: name → child.
fn reexports(code: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for stmt in code.split(';') {
        let s = stmt.trim();
        let Some(rest) = s
            .strip_prefix("pub use ")
            .or_else(|| s.strip_prefix("pub(crate) use "))
        else {
            continue;
        };
        let rest = rest.trim();
        let Some((child, names)) = rest.split_once("::") else {
            continue;
        };
        let names = names.trim().trim_start_matches('{').trim_end_matches('}');
        for n in names.split(',') {
            let n = n.trim();
            let n = n.rsplit(" as ").next().unwrap_or(n).trim();
            let n = n.rsplit("::").next().unwrap_or(n).trim();
            if !n.is_empty() {
                out.insert(n.to_string(), child.trim().to_string());
            }
        }
    }
    out
}

struct Source {
    module: Vec<String>,
    /// A `mod.rs` (or `lib.rs`): it declares and re-exports its folder's files.
    is_mod: bool,
    code: String,
}

fn sources() -> Vec<Source> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    files.sort();
    files
        .iter()
        .map(|f| Source {
            module: module_of(&src, f),
            is_mod: f.file_stem().is_some_and(|s| s == "mod" || s == "lib"),
            code: code_only(&std::fs::read_to_string(f).unwrap()),
        })
        .collect()
}

/// A source made from text, for the tests of the checks themselves.
fn source(module: &str, code: &str) -> Source {
    Source {
        module: module.split("::").map(str::to_string).collect(),
        is_mod: false,
        code: code_only(code),
    }
}

/// The layer a `crate::` path lands in (`crate::Error` → `error`, by `lib.rs`'s re-exports).
fn layer_of(path: &[String], root: &BTreeMap<String, String>) -> String {
    root.get(&path[0]).unwrap_or(&path[0]).clone()
}

/// Where the rank table is wrong: a layer of `lib.rs` missing from it (`error` aside), or a layer
/// it lets import one of the same or a higher rank, or one it does not have.
fn table_faults(layers: &Layers, declared: &BTreeSet<String>) -> Vec<String> {
    let rank: BTreeMap<&str, u32> = layers.iter().map(|(r, m, _)| (m.as_str(), *r)).collect();
    let mut out = Vec::new();
    for m in declared {
        if m != "error" && !rank.contains_key(m.as_str()) {
            out.push(format!("{m} is declared in lib.rs but has no row"));
        }
    }
    for (r, m, deps) in layers {
        for d in deps {
            if rank.get(d.as_str()).is_none_or(|dr| dr >= r) {
                out.push(format!(
                    "{m} (rank {r}) may import {d}, which is not of a lower rank"
                ));
            }
        }
    }
    out
}

/// Every `crate::` path of `sources` that the table does not allow, as `file -> crate::path`.
fn arrows_up(
    layers: &Layers,
    errors: &[String],
    root: &BTreeMap<String, String>,
    sources: &[Source],
) -> Vec<String> {
    let allowed: BTreeMap<&str, &Vec<String>> =
        layers.iter().map(|(_, m, d)| (m.as_str(), d)).collect();
    let mut wrong = Vec::new();
    for s in sources {
        let Some(me) = s.module.first() else {
            continue; // lib.rs declares the modules
        };
        for p in paths_after(&s.code, "crate::") {
            let to = layer_of(&p, root);
            if to == *me || to == "error" || to == "sync" {
                continue;
            }
            let ok = if me == "error" {
                // The layer and the type, whichever file of the layer defines it.
                let name = format!("{}::{}", p[0], p.last().map_or("", |x| x.as_str()));
                errors.contains(&name)
            } else {
                allowed
                    .get(me.as_str())
                    .is_some_and(|deps| deps.contains(&to))
            };
            if !ok {
                wrong.push(format!(
                    "{} -> crate::{}",
                    s.module.join("::"),
                    p.join("::")
                ));
            }
        }
    }
    wrong.sort();
    wrong.dedup();
    wrong
}

/// The other layers each file names (`crate::` paths outside its own layer, `error` and `sync`
/// included): every file but a `mod.rs` that names none.
fn outside_imports(
    sources: &[Source],
    root: &BTreeMap<String, String>,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for s in sources {
        let Some(me) = s.module.first() else {
            continue;
        };
        let set: BTreeSet<String> = paths_after(&s.code, "crate::")
            .iter()
            .map(|p| layer_of(p, root))
            .filter(|l| l != me)
            .collect();
        if !set.is_empty() || !s.is_mod {
            out.insert(s.module.join("::"), set);
        }
    }
    out
}

/// Every circle among the files of one folder, as `folder: a -> b -> a`. A file of a nested folder
/// counts, toward the folders above, as that folder (`ipc::foreign::kind` naming `crate::ipc::pool`
/// is an arrow `foreign -> pool` in `ipc`).
fn sibling_circles(all: &[Source]) -> Vec<String> {
    // Per folder: its files (and sub-folders), and the parent's re-exports (name → file).
    let mut files: BTreeMap<Vec<String>, BTreeSet<String>> = BTreeMap::new();
    let mut names: BTreeMap<Vec<String>, BTreeMap<String, String>> = BTreeMap::new();
    for s in all {
        for k in 0..s.module.len() {
            files
                .entry(s.module[..k].to_vec())
                .or_default()
                .insert(s.module[k].clone());
        }
    }
    for s in all {
        if files.contains_key(&s.module) {
            names.insert(s.module.clone(), reexports(&s.code));
        }
    }
    // Edges between the files of one folder.
    let mut edges: BTreeMap<(Vec<String>, String), BTreeSet<String>> = BTreeMap::new();
    for s in all {
        // Level 1 and up: the layers themselves are checked against the table.
        for k in 1..s.module.len() {
            let parent = &s.module[..k];
            let me = &s.module[k];
            let siblings = &files[parent];
            let resolve = |first: &str| -> Option<String> {
                if siblings.contains(first) {
                    return Some(first.to_string());
                }
                names.get(parent)?.get(first).cloned()
            };
            let mut targets = BTreeSet::new();
            if k + 1 == s.module.len() {
                for p in paths_after(&s.code, "super::") {
                    if let Some(t) = resolve(&p[0]) {
                        targets.insert(t);
                    }
                }
            }
            for p in paths_after(&s.code, "crate::") {
                if p.len() > parent.len()
                    && p[..parent.len()] == parent[..]
                    && let Some(t) = resolve(&p[parent.len()])
                {
                    targets.insert(t);
                }
            }
            targets.remove(me);
            edges
                .entry((parent.to_vec(), me.clone()))
                .or_default()
                .extend(targets);
        }
    }
    // Every circle among siblings, found by a depth-first search from each file.
    let mut circles = Vec::new();
    for (parent, start) in edges.keys() {
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        while let Some((at, trail)) = stack.pop() {
            for next in edges
                .get(&(parent.clone(), at.clone()))
                .into_iter()
                .flatten()
            {
                if next == start {
                    let mut c = trail.clone();
                    c.push(next.clone());
                    circles.push(format!("{}: {}", parent.join("::"), c.join(" -> ")));
                } else if !trail.contains(next) && next > start {
                    let mut t = trail.clone();
                    t.push(next.clone());
                    stack.push((next.clone(), t));
                }
            }
        }
    }
    circles
}

#[test]
fn the_layer_table_names_every_layer_and_lets_each_import_only_lower_ranks() {
    let layers = layers();
    assert!(
        layers.len() >= 10,
        "docs/ARCHITECTURE.md's rank table gave only {layers:?}"
    );
    let faults = table_faults(&layers, &declared_layers());
    assert!(
        faults.is_empty(),
        "the rank table of docs/ARCHITECTURE.md (Module graph):\n{}",
        faults.join("\n")
    );
}

#[test]
fn no_module_imports_from_a_layer_above_it() {
    let wrong = arrows_up(&layers(), &error_names(), &root_names(), &sources());
    assert!(
        wrong.is_empty(),
        "imports the layer table does not allow (docs/ARCHITECTURE.md, Module graph):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_import_list_says_which_layers_each_file_names() {
    let code = outside_imports(&sources(), &root_names());
    let doc = import_list();
    let line = |f: &str, s: &BTreeSet<String>| {
        let v: Vec<&str> = s.iter().map(String::as_str).collect();
        format!("{f}: {}", v.join(", "))
    };
    let mut wrong = Vec::new();
    for (f, s) in &code {
        match doc.get(f) {
            Some(d) if d == s => {}
            Some(d) => wrong.push(format!("code  {}\n  doc   {}", line(f, s), line(f, d))),
            None => wrong.push(format!("no line for {}", line(f, s))),
        }
    }
    for f in doc.keys() {
        if !code.contains_key(f) {
            wrong.push(format!(
                "a line for {f}, which is no file of src/ that names a layer"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/ARCHITECTURE.md's list of what each module imports differs from the code (the part \
         before `; within:`):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_two_files_of_a_layer_import_each_other() {
    let circles = sibling_circles(&sources());
    assert!(
        circles.is_empty(),
        "files of one layer that import each other:\n{}",
        circles.join("\n")
    );
}

#[test]
fn a_new_arrow_up_or_circle_fails_the_checks() {
    let layers = parse_layers(
        "| rank | modules | may import |\n| --- | --- | --- |\n\
         | 0 | `sync` | nothing |\n\
         | 1 | `shm`, `identity` | nothing of the crate (no CUDA in `shm`) |\n\
         | 2 | `registry`, `quota` | `registry`: `shm` (segments); `quota`: `shm`, `identity` |\n",
    );
    assert_eq!(
        layers,
        vec![
            (0, "sync".to_string(), vec![]),
            (1, "shm".to_string(), vec![]),
            (1, "identity".to_string(), vec![]),
            (2, "registry".to_string(), vec!["shm".to_string()]),
            (
                2,
                "quota".to_string(),
                vec!["shm".to_string(), "identity".to_string()]
            ),
        ]
    );
    let declared: BTreeSet<String> = ["sync", "shm", "identity", "registry", "quota", "error"]
        .map(String::from)
        .into();
    assert!(table_faults(&layers, &declared).is_empty());
    // A row that lets a layer import one of its own rank, and a layer without a row.
    let mut bad = layers.clone();
    bad[3].2.push("quota".to_string());
    let mut more = declared.clone();
    more.insert("channel".to_string());
    assert_eq!(table_faults(&bad, &more).len(), 2);
    // An arrow up (shm naming the registry), one the row does not allow (registry naming
    // identity), and the allowed ones.
    let root = BTreeMap::from([("Error".to_string(), "error".to_string())]);
    let srcs = [
        source(
            "shm::segment",
            "use crate::registry::Registry; use crate::Error;",
        ),
        source(
            "registry::slot",
            "use crate::shm::Segment; use crate::identity::X;",
        ),
        source(
            "quota::ledger",
            "use crate::{shm, identity}; use crate::sync::Ordering;",
        ),
    ];
    assert_eq!(
        arrows_up(&layers, &[], &root, &srcs),
        vec![
            "registry::slot -> crate::identity::X".to_string(),
            "shm::segment -> crate::registry::Registry".to_string(),
        ]
    );
    assert_eq!(
        outside_imports(&srcs, &root)["quota::ledger"],
        ["identity", "shm", "sync"].map(String::from).into()
    );
    // A circle between two files of a layer, one through a nested folder, and a clean pair.
    let circles = sibling_circles(&[
        source("ipc::pool", "use super::cache::lock;"),
        source("ipc::cache", "use crate::ipc::pool::X;"),
        source("ipc::foreign::kind", "use crate::ipc::vmm::Y;"),
        source("ipc::vmm", "use super::foreign::Z;"),
        source("ipc::event", "use super::handle::H;"),
        source("ipc::handle", ""),
    ]);
    assert_eq!(
        circles,
        vec![
            "ipc: cache -> pool -> cache".to_string(),
            "ipc: foreign -> vmm -> foreign".to_string(),
        ]
    );
}

#[test]
fn the_document_gives_the_table_the_error_names_and_the_list() {
    let layers = layers();
    let row = |m: &str| layers.iter().find(|(_, n, _)| n == m).cloned();
    let (_, _, channel) = row("channel").expect("a row for channel");
    assert!(channel.contains(&"ipc".to_string()) && channel.contains(&"quota".to_string()));
    let (_, _, shm) = row("shm").expect("a row for shm");
    assert!(shm.is_empty(), "{shm:?}");
    let errors = error_names();
    assert!(errors.contains(&"shm::ShmError".to_string()), "{errors:?}");
    assert!(errors.contains(&"driver::Uuid".to_string()), "{errors:?}");
    assert!(import_list().contains_key("identity::lock"));
    assert_eq!(root_names()["Error"], "error");
}

#[test]
fn the_scanner_sees_paths_and_skips_comments_and_strings() {
    let code = code_only(
        "use crate::ipc::{MemPool, vmm::X};\n// crate::channel::Y\nlet s = \"crate::registry\";\n\
         let c = '\\''; let q = '\\\\'; let d = '\"'; let t = crate::Error::Os; /* crate::probe */ let l: &'static str = r#\"crate::x\"#;",
    );
    let p = paths_after(&code, "crate::");
    assert_eq!(
        p,
        vec![
            vec!["ipc".to_string(), "MemPool".to_string()],
            vec!["ipc".to_string(), "vmm".to_string()],
            vec!["Error".to_string(), "Os".to_string()],
        ]
    );
    assert_eq!(layer_of(&p[2], &root_names()), "error");
    let r = reexports("pub use cache::{CacheStats, cache_stats};\npub use memory::ImportedBuffer;");
    assert_eq!(r["CacheStats"], "cache");
    assert_eq!(r["ImportedBuffer"], "memory");
}

/// The command line's modules (`cli/src/*.rs`, `main.rs` the root that declares them) and the
/// modules each names through `crate::`.
fn cli_edges() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("cli/src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    let modules: BTreeSet<String> = files
        .iter()
        .filter_map(|f| module_of(&src, f).first().cloned())
        .filter(|m| m != "main")
        .collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let Some(me) = module_of(&src, f).first().cloned() else {
            continue;
        };
        if me == "main" {
            continue; // the root: declares every module, `Outcome` and the output macros
        }
        let code = code_only(&std::fs::read_to_string(f).unwrap());
        let to = edges.entry(me.clone()).or_default();
        for p in paths_after(&code, "crate::") {
            if modules.contains(&p[0]) && p[0] != me {
                to.insert(p[0].clone());
            }
        }
    }
    edges
}

/// Every circle of `edges`, each as the modules around it.
fn circles_of(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for start in edges.keys() {
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        while let Some((at, trail)) = stack.pop() {
            for next in edges.get(&at).into_iter().flatten() {
                if next == start {
                    let mut c = trail.clone();
                    c.push(next.clone());
                    out.push(c);
                } else if !trail.contains(next) && next > start {
                    let mut t = trail.clone();
                    t.push(next.clone());
                    stack.push((next.clone(), t));
                }
            }
        }
    }
    out
}

#[test]
fn no_two_modules_of_the_command_line_import_each_other() {
    let edges = cli_edges();
    assert!(
        edges.contains_key("gc") && edges.contains_key("ls"),
        "the command line's modules were not found: {:?}",
        edges.keys()
    );
    let text: Vec<String> = circles_of(&edges).iter().map(|c| c.join(" -> ")).collect();
    assert!(
        text.is_empty(),
        "modules of cli/src that import each other (shared pieces belong in a module of their \
         own, as `listing` and `text` are):\n{}",
        text.join("\n")
    );
}

#[test]
fn the_circle_check_finds_a_circle_of_three() {
    let mut e: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        e.entry(a.into()).or_default().insert(b.into());
    }
    assert_eq!(circles_of(&e), vec![vec!["a", "b", "c", "a"]]);
}
