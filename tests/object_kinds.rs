//! The rooms of each kind of shared object (docs/ARCHITECTURE.md, "Object kinds"), kept: every
//! kind listed there is one of the library's `cleanup::ObjectKind::ALL` (and the other way round),
//! with leftover kinds that the scan and the removal know, an `inspect` module, a row in
//! `cuda-ipc ls`, and lines in what `cuda-ipc gc` prints. A kind added without its rooms fails here.

use cuda_ipc::cleanup::ObjectKind;
use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The kinds docs/ARCHITECTURE.md lists: the `- \`NAME\`:` lines of its "Object kinds" section.
fn documented_kinds() -> Vec<String> {
    let doc = read("docs/ARCHITECTURE.md");
    let at = doc
        .find("\n## Object kinds\n")
        .expect("docs/ARCHITECTURE.md has an \"Object kinds\" section");
    let section = &doc[at + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    section
        .lines()
        .filter_map(|l| l.strip_prefix("- `"))
        .filter_map(|l| l.split_once("`:").map(|(n, _)| n.to_string()))
        .collect()
}

#[test]
fn the_documented_object_kinds_are_the_librarys() {
    let doc = documented_kinds();
    assert!(!doc.is_empty(), "no kinds found in the Object kinds list");
    let lib: Vec<String> = ObjectKind::ALL
        .iter()
        .map(|k| k.name().to_string())
        .collect();
    assert_eq!(
        doc, lib,
        "docs/ARCHITECTURE.md's Object kinds and cleanup::ObjectKind::ALL differ"
    );
}

#[test]
fn every_object_kind_has_its_cleanup_inspect_ls_and_gc_rooms() {
    // The cleanup's files: the module and its scan, removal and holders' parts.
    let cleanup = ["mod", "scan", "remove", "holders"]
        .map(|f| read(&format!("src/cleanup/{f}.rs")))
        .concat();
    let ls = read("cli/src/ls.rs");
    let gc = read("cli/src/gc.rs");
    // `gc` prints the library's scan and removal, nothing of its own.
    assert!(
        gc.contains("cleanup::scan(") && gc.contains("cleanup::remove("),
        "cli/src/gc.rs must print over cuda_ipc::cleanup's scan and remove"
    );
    for name in documented_kinds() {
        let kind = ObjectKind::ALL
            .iter()
            .copied()
            .find(|k| k.name() == name)
            .unwrap_or_else(|| panic!("{name}: not in cleanup::ObjectKind::ALL"));
        // Scan and cleanup: its leftover kinds, each mapped back to it.
        assert!(
            !kind.leftover_kinds().is_empty(),
            "{name}: no leftover kinds in the cleanup"
        );
        for l in kind.leftover_kinds() {
            assert_eq!(l.object_kind(), Some(kind), "{name}: {l:?}");
        }
        // The scan names it in the lines `gc` prints (`KIND NAME: ...`).
        assert!(
            cleanup.contains(&format!("\"{name} {{")),
            "{name}: src/cleanup/ prints no `{name} NAME: ...` leftover"
        );
        // Inspect: a read-only snapshot module.
        assert!(
            root().join(format!("src/{name}/inspect.rs")).is_file(),
            "{name}: no src/{name}/inspect.rs"
        );
        // ls: a row of its own.
        assert!(
            ls.contains(&format!("\"{name} {{}}")),
            "{name}: cli/src/ls.rs prints no `{name} NAME` row"
        );
    }
}
