//! The module graph of docs/ARCHITECTURE.md ("Module graph"), enforced: every `crate::X` path in
//! `src/**/*.rs` (code, not comments) names a layer that `X`'s table entry allows, the table has no
//! circle, and within a layer no two files name each other (directly or around a longer circle).
//!
//! A layer's `mod.rs` and its files are one unit toward each other (a file may use what its parent
//! declares, the parent re-exports its files); the circle check is between sibling files. A name
//! re-exported by the parent (`super::MemPool`, `crate::ipc::ImportedBuffer`) counts as the file
//! that defines it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Layers, each with the layers it may import. Every module may also use `error` (the crate's
/// error type and `Result`) and `sync` (the atomics); `error` is outside the stack and names each
/// layer's error type (see `ERROR_NAMES`). Order: lowest first.
const LAYERS: &[(&str, &[&str])] = &[
    ("sync", &[]),
    ("ffi", &[]),
    ("identity", &[]),
    ("shm", &[]),
    ("driver", &["ffi", "identity"]),
    ("probe", &["driver", "ffi", "shm"]),
    ("kernels", &["driver", "ffi"]),
    ("token", &["driver", "identity"]),
    ("ipc", &["driver", "ffi", "identity", "probe", "token"]),
    ("registry", &["identity", "shm"]),
    // The device is named by `driver::Uuid`, the type only: no CUDA call.
    ("quota", &["driver", "identity", "shm"]),
    (
        "channel",
        &[
            "driver", "ffi", "identity", "ipc", "probe", "quota", "shm", "token",
        ],
    ),
    ("cudarc_interop", &["driver", "ffi", "ipc"]),
    // The remote lane (feature `remote`): the channel's public API, and NIXL beside it.
    ("remote", &["channel", "driver", "identity"]),
    // Re-exports only: the internals it opens to tools and tests.
    ("raw", &["kernels", "registry", "shm"]),
    // What dead processes left, by each layer's own rule: above every layer it cleans.
    (
        "cleanup",
        &["channel", "identity", "ipc", "quota", "registry", "shm"],
    ),
];

/// What `error.rs` may name outside itself: each layer's error type (a variant payload) and the
/// device UUID of `Error::DeviceNotFound`.
const ERROR_NAMES: &[&str] = &[
    "ffi::CudaError",
    "ipc::NotExportable",
    "ipc::NotImportable",
    "shm::ShmError",
    "registry::RegistryError",
    "channel::ChannelError",
    "quota::QuotaError",
    "remote::RemoteError",
    "driver::Uuid",
];

/// Sibling circles known and being removed; each entry is (layer, file, file). None is left: an
/// entry added here must say which change removes it.
const KNOWN_SIBLING_CIRCLES: &[(&str, &str, &str)] = &[];

/// Names `lib.rs` re-exports at the crate root, and the module they come from.
const ROOT_NAMES: &[(&str, &str)] = &[
    ("Error", "error"),
    ("Result", "error"),
    ("CudaError", "error"),
    ("OsError", "error"),
];

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
            code: code_only(&std::fs::read_to_string(f).unwrap()),
        })
        .collect()
}

/// The layer a `crate::` path lands in (`crate::Error` → `error`).
fn layer_of(path: &[String]) -> String {
    let first = path[0].as_str();
    ROOT_NAMES
        .iter()
        .find(|(n, _)| *n == first)
        .map_or(first, |(_, m)| *m)
        .to_string()
}

#[test]
fn the_layer_table_has_no_circle_and_names_only_lower_layers() {
    for (i, (layer, deps)) in LAYERS.iter().enumerate() {
        for d in *deps {
            let j = LAYERS.iter().position(|(l, _)| l == d);
            assert!(
                j.is_some_and(|j| j < i),
                "{layer} may import {d}, which is not a lower layer of the table"
            );
        }
    }
}

#[test]
fn no_module_imports_from_a_layer_above_it() {
    let allowed: BTreeMap<&str, &[&str]> = LAYERS.iter().copied().collect();
    let mut wrong = Vec::new();
    for s in sources() {
        let Some(me) = s.module.first() else {
            continue; // lib.rs declares the modules
        };
        for p in paths_after(&s.code, "crate::") {
            let to = layer_of(&p);
            if to == *me || to == "error" || to == "sync" {
                continue;
            }
            let ok = if me == "error" {
                let name = format!("{}::{}", p[0], p.get(1).map_or("", |x| x.as_str()));
                ERROR_NAMES.contains(&name.as_str())
            } else {
                allowed
                    .get(me.as_str())
                    .unwrap_or_else(|| panic!("module {me} is missing from LAYERS"))
                    .contains(&to.as_str())
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
    assert!(
        wrong.is_empty(),
        "imports the layer table does not allow (docs/ARCHITECTURE.md, Module graph):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_two_files_of_a_layer_import_each_other() {
    let all = sources();
    // Per layer directory: the files, and the parent's re-exports (name → file).
    let mut files: BTreeMap<Vec<String>, BTreeSet<String>> = BTreeMap::new();
    let mut names: BTreeMap<Vec<String>, BTreeMap<String, String>> = BTreeMap::new();
    for s in &all {
        if let Some((last, parent)) = s.module.split_last() {
            files
                .entry(parent.to_vec())
                .or_default()
                .insert(last.clone());
        }
    }
    for s in &all {
        if files.contains_key(&s.module) {
            names.insert(s.module.clone(), reexports(&s.code));
        }
    }
    // Edges between sibling files.
    let mut edges: BTreeMap<(Vec<String>, String), BTreeSet<String>> = BTreeMap::new();
    for s in &all {
        let Some((me, parent)) = s.module.split_last() else {
            continue;
        };
        if parent.is_empty() {
            continue; // the layers themselves: checked against LAYERS above
        }
        let siblings = &files[parent];
        let resolve = |first: &str| -> Option<String> {
            if siblings.contains(first) {
                return Some(first.to_string());
            }
            names.get(parent)?.get(first).cloned()
        };
        let mut targets = BTreeSet::new();
        for p in paths_after(&s.code, "super::") {
            if let Some(t) = resolve(&p[0]) {
                targets.insert(t);
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
        edges.insert((parent.to_vec(), me.clone()), targets);
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
                    circles.push((parent.join("::"), c));
                } else if !trail.contains(next) && next > start {
                    let mut t = trail.clone();
                    t.push(next.clone());
                    stack.push((next.clone(), t));
                }
            }
        }
    }
    circles.retain(|(layer, c)| {
        !KNOWN_SIBLING_CIRCLES.iter().any(|(l, a, b)| {
            l == layer && c.len() == 3 && c.contains(&a.to_string()) && c.contains(&b.to_string())
        })
    });
    let text: Vec<String> = circles
        .iter()
        .map(|(l, c)| format!("{l}: {}", c.join(" -> ")))
        .collect();
    assert!(
        text.is_empty(),
        "files of one layer that import each other:\n{}",
        text.join("\n")
    );
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
    assert_eq!(layer_of(&p[2]), "error");
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
