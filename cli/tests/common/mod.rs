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
