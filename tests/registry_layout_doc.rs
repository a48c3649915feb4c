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
    let me = cuda_ipc::identity::ProcessIdentity::current().unwrap();
    let script = format!(
        "{code}\nm, h = read_registry_header({name:?})\nr = read_slot(m, h['participants'], {slot})\n\
         print(h['slots'], h['participants'], r['name'], r['kind'], r['seq'], r['pid'], r['token'].decode(), r['metadata'].decode())\n\
         o = r['owner']; c = h['creator']\n\
         print(o['pid_ns'], o['start_time'], o['boot_id'], c['pid'], c['pid_ns'], c['start_time'], h['generation'])\n\
         print(o['uid'], c['uid'])\n\
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
    let uid = rustix::process::geteuid().as_raw();
    let boot: String = me.boot_id.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        text,
        format!(
            "4 3 frames 7 {seq} {} opaque-token meta!\n{} {} {boot} {} {} {} {}\n{uid} {uid}\nTrue\n",
            me.pid,
            me.pid_ns,
            me.start_time,
            me.pid,
            me.pid_ns,
            me.start_time,
            reg.generation()
        )
    );
    assert_ne!(reg.generation(), 0);
}

/// The Python reader refuses what it must not read: a FIFO (without blocking), another layout
/// version.
#[test]
fn python_reader_in_the_layout_doc_refuses_a_fifo_without_blocking() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("python3 not found; skipped");
        return;
    }
    let doc = include_str!("../docs/registry-layout.md");
    let start = doc.find("```python\n").expect("python block") + "```python\n".len();
    let code = &doc[start..start + doc[start..].find("```").expect("end of block")];
    let name = unique("pydoc-fifo");
    let path = std::ffi::CString::new(format!("/dev/shm/{name}")).unwrap();
    // SAFETY: `path` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let _u = Unlink(name.clone());
    let script = format!(
        "{code}\ntry:\n    read_registry_header({name:?})\nexcept ValueError as e:\n    print('refused:', e)\n"
    );
    let mut child = Command::new("timeout")
        .args(["10", "python3", "-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let st = child.wait().unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut text).unwrap();
    assert!(st.success(), "{st}: {text}");
    assert!(
        text.contains("refused:") && text.contains("not a regular file"),
        "{text}"
    );
}
