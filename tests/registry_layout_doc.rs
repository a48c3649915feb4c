//! The Python reader in docs/registry-layout.md reads a registry this crate wrote (skipped when no
//! `python3` is installed).

mod common;

use common::{Unlink, unique};
use cuda_ipc::registry::{Registry, RegistryOptions};
use std::process::Command;

#[test]
fn python_reader_in_the_layout_doc_reads_a_registry_written_here() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("python3 not found; skipped");
        return;
    }
    let doc = include_str!("../docs/registry-layout.md");
    let start = doc.find("```python\n").expect("python block") + "```python\n".len();
    let code = &doc[start..start + doc[start..].find("```").expect("end of block")];
    let name = unique("pydoc");
    let _u = Unlink(name.clone());
    let reg = Registry::create(&name, &RegistryOptions::new().capacity(4).participants(3)).unwrap();
    let seq = reg.publish("frames", 7, b"opaque-token", b"meta!").unwrap();
    let slot = reg.get("frames").unwrap().unwrap().slot;
    let script = format!(
        "{code}\nm, h = read_registry_header({name:?})\nr = read_slot(m, h['participants'], {slot})\n\
         print(h['slots'], h['participants'], r['name'], r['kind'], r['seq'], r['pid'], r['token'].decode(), r['metadata'].decode())\n\
         print(all(read_slot(m, h['participants'], i) is None for i in range(4) if i != {slot}))\n"
    );
    let out = Command::new("python3")
        .arg("-c")
        .arg(&script)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        text,
        format!(
            "4 3 frames 7 {seq} {} opaque-token meta!\nTrue\n",
            std::process::id()
        )
    );
}
