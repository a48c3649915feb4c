//! Links the extension module against the system's `libgcc_s.so.1` on Linux (glibc), so that the
//! unwinder that runs this module's landing pads is the one glibc uses.
//!
//! Why: a Python thread that returns from a blocking call (`recv`, `wait_newer`, `current`, ...)
//! after the interpreter began to finalize is ended by CPython < 3.14 with `pthread_exit`, a forced
//! unwind that glibc drives through `libgcc_s.so.1`. PyO3 stops it in the module's first frame
//! (a guard whose drop parks the thread for good). That frame's personality routine must read the
//! unwind context with the same unwinder that made it. A wheel linked by zig (`maturin build
//! --zig`, how the manylinux wheel is made) otherwise carries LLVM's libunwind inside the module in
//! place of `-lgcc_s`: its accessors read libgcc's context as their own, and the process crashed
//! with SIGSEGV at exit whenever a daemon thread was inside such a call
//! (`python/tests/test_exit_host.py`). Naming the shared library on the link line makes the
//! module import the `_Unwind_*` symbols from it (allowed by every manylinux policy) before any
//! static unwinder is looked at. A native build links `-lgcc_s` already; the argument changes
//! nothing there.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for var in ["CC", "TARGET_CC"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    if os != "linux" || env != "gnu" {
        return;
    }
    match libgcc_s() {
        Some(path) => println!("cargo:rustc-link-arg-cdylib={}", path.display()),
        None => println!(
            "cargo:warning=libgcc_s.so.1 not found (`cc -print-file-name=libgcc_s.so.1`): a wheel \
             linked by zig then carries its own unwinder, and Python threads inside a blocking \
             call crash the process at interpreter exit"
        ),
    }
}

/// The C compiler's `libgcc_s.so.1` for the target, where it names an existing file: the
/// compiler of `CC_<target>` or `TARGET_CC` (`CC` too when the target is the host), else `cc` when
/// building for the host. A zig wrapper (`maturin --zig`) ships no `libgcc_s`: skipped. A cross
/// build with no such compiler gets `None` (the host's library would not link).
fn libgcc_s() -> Option<PathBuf> {
    let target = std::env::var("TARGET").unwrap_or_default();
    let native = target == std::env::var("HOST").unwrap_or_default();
    let mut names = vec![
        format!("CC_{target}"),
        format!("CC_{}", target.replace('-', "_")),
        "TARGET_CC".to_string(),
    ];
    if native {
        names.push("CC".to_string());
    }
    let given = names
        .iter()
        .filter_map(|n| std::env::var(n).ok())
        .find(|c| !c.trim().is_empty() && !c.contains("zig"));
    let cc = match given {
        Some(c) => c,
        None if native => "cc".to_string(),
        None => return None,
    };
    // `CC` may carry a launcher and flags ("ccache gcc", "gcc -m64").
    let mut words = cc.split_whitespace();
    let program = words.next()?;
    let out = Command::new(program)
        .args(words)
        .arg("-print-file-name=libgcc_s.so.1")
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    (path.is_absolute() && path.is_file()).then(|| path.canonicalize().unwrap_or(path))
}
