//! Every driver call of the sources goes through the crate's own loader (`src/ffi/sys.rs`), never
//! through cudarc's (`cudarc::driver::sys::culib`, which tries `libcuda.so` before the soname
//! `libcuda.so.1` and so loads a toolkit's stub library where one is on the search path).
//!
//! `ffi::sys` re-exports cudarc's bindings with a glob and defines the functions the crate calls
//! beside them (a local item shadows a glob import): a `sys::cuXxx` that the loader does not
//! define compiles, and silently reaches cudarc's loader. So this test reads the sources of the
//! library (`src/`), the Python extension (`python/src/`) and the command line (`cli/`) for every
//! `sys::cu…` path, and checks that each names a function of the loader's `driver_functions!`
//! list; and that nothing outside the loader names cudarc's bindings or its loader. Not checked:
//! `src/cudarc_interop.rs`'s use of cudarc's safe API (its calls use cudarc's loader, as its
//! module doc says), the benchmarks and the examples, which call cudarc on purpose.
//!
//! Runs without a GPU. Reads beyond this package (`python/`, `cli/`), so the published crate
//! leaves it out (Cargo.toml's `include`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The workspace root (this package's folder).
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, recursively, in a stable order; fails when there is none (a
/// folder moved would otherwise make the test pass on nothing).
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, &mut out);
    out.sort();
    assert!(!out.is_empty(), "no .rs file under {}", dir.display());
    out
}

/// `text` without its `//` comments (doc comments included), line by line.
fn code_of(text: &str) -> String {
    text.lines()
        .map(|l| l.find("//").map_or(l, |at| &l[..at]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The driver functions a piece of code names as `sys::cuXxx` (a call or a function value): `cu`
/// followed by an upper-case letter, which no type or constant of the bindings starts with.
fn driver_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("sys::cu") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "sys::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `foosys::cu…`: another path
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name[2..].starts_with(|c: char| c.is_ascii_uppercase()) {
            out.push(name);
        }
    }
    out
}

/// The functions the loader defines: the `fn cuXxx(` lines of its `driver_functions!` list.
fn loader_functions() -> BTreeSet<String> {
    let path = root().join("src/ffi/sys.rs");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let code = code_of(&text);
    let start = code
        .find("driver_functions! {")
        .unwrap_or_else(|| panic!("{} has no `driver_functions! {{` list", path.display()));
    let list = &code[start..];
    let list = &list[..list.find("\n}").expect("the list's closing brace")];
    let names: BTreeSet<String> = list
        .lines()
        .filter_map(|l| l.trim().strip_prefix("fn "))
        .map(|l| l[..l.find('(').expect("fn name(")].to_string())
        .collect();
    assert!(
        names.contains("cuInit") && names.contains("cuCtxGetCurrent"),
        "the list read from {} lacks cuInit or cuCtxGetCurrent: {names:?}",
        path.display()
    );
    names
}

/// The source folders whose driver calls must go through the loader.
const SOURCES: &[&str] = &["src", "python/src", "cli"];

#[test]
fn the_scanner_finds_calls_and_function_values_but_not_comments_or_types() {
    let code = code_of(
        "let a = unsafe { sys::cuInit(0) }; // sys::cuNotThis(\n\
         let b = sys::cuMemFree_v2;\n\
         let c: sys::CUresult = sys::CUresult::CUDA_SUCCESS;\n\
         unsafe { crate::ffi::sys::cuStreamQuery\n(s) };\n\
         let d = cudasys::cuOther(1);",
    );
    assert_eq!(
        driver_paths(&code),
        ["cuInit", "cuMemFree_v2", "cuStreamQuery"]
    );
}

#[test]
fn every_driver_call_of_the_sources_is_one_the_loader_defines() {
    let defined = loader_functions();
    let mut called = BTreeSet::new();
    let mut strays = Vec::new();
    for dir in SOURCES {
        for file in rust_files(&root().join(dir)) {
            let text = std::fs::read_to_string(&file).unwrap();
            for name in driver_paths(&code_of(&text)) {
                if !defined.contains(&name) {
                    let rel = file.strip_prefix(root()).unwrap_or(&file);
                    strays.push(format!("{}: sys::{name}", rel.display()));
                }
                called.insert(name);
            }
        }
    }
    assert!(
        strays.is_empty(),
        "these driver calls are not defined by the loader (src/ffi/sys.rs's `driver_functions!`), \
         so they reach cudarc's loader through the glob re-export; add each there with cudarc's \
         signature:\n{}",
        strays.join("\n")
    );
    // The scan found the crate's calls (about 85 functions), not nothing.
    assert!(
        called.len() >= 50,
        "only {} driver calls found",
        called.len()
    );
}

#[test]
fn nothing_outside_the_loader_names_cudarcs_bindings_or_its_loader() {
    let loader = root().join("src/ffi/sys.rs");
    let mut found = Vec::new();
    for dir in SOURCES {
        for file in rust_files(&root().join(dir)) {
            if file == loader {
                continue;
            }
            let code = code_of(&std::fs::read_to_string(&file).unwrap());
            // `cudarc::driver::{...}` groups count too: a `sys` or `result` inside one.
            let grouped = code.split("cudarc::driver::{").skip(1).any(|g| {
                let group = &g[..g.find('}').unwrap_or(g.len())];
                group
                    .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .any(|w| w == "sys" || w == "result")
            });
            for needle in [
                "cudarc::driver::sys",
                "cudarc::driver::result",
                "culib",
                "is_culib_present",
            ] {
                if code.contains(needle) {
                    found.push(format!("{}: {needle}", file.display()));
                }
            }
            if grouped {
                found.push(format!(
                    "{}: cudarc::driver::{{sys or result}}",
                    file.display()
                ));
            }
        }
    }
    assert!(
        found.is_empty(),
        "driver calls must go through crate::ffi::sys (the crate's loader, libcuda.so.1 \
         first), not cudarc's bindings or loader:\n{}",
        found.join("\n")
    );
}
