//! What the command line's test binaries share.
#![allow(dead_code)] // Each test binary uses a part of it.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The `cuda-ipc` binary: the one Cargo built for these tests; elsewhere (a copied bundle) the
/// `cuda-ipc` beside this test binary's folder, or `CUDA_IPC_BIN`.
pub fn bin() -> PathBuf {
    if let Some(p) = std::env::var_os("CUDA_IPC_BIN") {
        return p.into();
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_cuda-ipc"));
    if built.exists() {
        return built;
    }
    let exe = std::env::current_exe().unwrap();
    let beside = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("cuda-ipc"));
    match beside {
        Some(p) if p.exists() => p,
        _ => panic!(
            "the cuda-ipc binary is neither at {} nor beside this test's folder; set CUDA_IPC_BIN",
            built.display()
        ),
    }
}

/// Runs `cuda-ipc ARGS` to its end.
pub fn cuda_ipc(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .output()
        .expect("run cuda-ipc")
}

/// Writes `bytes` to a new file `/dev/shm/NAME` of this user and mode 0600, as the library makes
/// its segments: what stands for one of ours (a creation abandoned half-way, foreign bytes under
/// our name), not a file open to other users, which every opener refuses, and `gc` reports and
/// keeps, for its mode alone. Made with the mode rather than changed after: a `chmod` moves
/// `st_ctime`, which the 2 s age rules read. Returned open for writing: `set_len` on it makes it
/// sparse, as `truncate -s` does.
pub fn write_segment(name: &str, bytes: &[u8]) -> std::fs::File {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(format!("/dev/shm/{name}"))
        .unwrap_or_else(|e| panic!("/dev/shm/{name}: {e}"));
    f.write_all(bytes).unwrap();
    f
}
