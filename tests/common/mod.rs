//! Helpers shared by the registry tests: unique segment names, cleanup, child processes.
#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// The environment variable naming a child's role; absent in the parent.
pub const ROLE: &str = "CUDA_IPC_TEST_ROLE";
/// The environment variable carrying the registry name to a child.
pub const REG: &str = "CUDA_IPC_TEST_REGISTRY";

/// A segment name unique to this process and call.
pub fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "cuda-ipc-test-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Unlinks the segment when dropped (ignoring "not found").
pub struct Unlink(pub String);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = cuda_ipc::shm::Segment::unlink(&self.0);
    }
}

/// The role of this process when it was started as a child, if it was.
pub fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// Re-executes this test binary running only `test` (exact name) as a child with `role`.
pub fn spawn_child(test: &str, role: &str, registry: &str, env: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(REG, registry)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child")
}

/// Waits for a child and returns its stdout; panics when it failed.
pub fn finish(child: Child) -> String {
    let out = child.wait_with_output().expect("wait child");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child failed: {:?}\n{text}",
        out.status
    );
    text
}

/// The value after `key=` in a child's output.
pub fn value(out: &str, key: &str) -> u64 {
    let pat = format!("{key}=");
    out.split_whitespace()
        .find_map(|w| w.strip_prefix(&pat))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in child output:\n{out}"))
}
