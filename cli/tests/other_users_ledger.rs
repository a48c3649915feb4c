//! Another user's quota ledger: root sets a budget (a ledger segment of root's, mode 0600), and a
//! second user's `ls`, `gc` and `quota show` skip it with a note saying whose it is, and exit 0,
//! as they leave root's channels out. The second user is made here with `useradd` and runs a copy
//! of the `cuda-ipc` binary it can read and execute. Needs root (CI runs as root); without it the
//! test prints why and skips. Root's tensor set beside it is left out the same way.

mod common;
use common::bin;
use cuda_ipc::driver::Uuid;
use cuda_ipc::quota::{QuotaLedger, QuotaScope};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Output};

const USER: &str = "cuda-ipc-test";

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The test user's (uid, gid), made with `useradd` when missing; `None` (with the reason printed)
/// when this process is not root or the user cannot be made.
fn test_user() -> Option<(u32, u32)> {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root to make a second user");
        return None;
    }
    let id = |flag: &str| -> Option<u32> {
        let o = Command::new("id").args([flag, USER]).output().ok()?;
        String::from_utf8_lossy(&o.stdout).trim().parse().ok()
    };
    if id("-u").is_none() {
        let made = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/bin/false",
                USER,
            ])
            .status();
        // Another test binary may have made it meanwhile.
        if !matches!(made, Ok(s) if s.success()) && id("-u").is_none() {
            println!("skipped: useradd {USER} failed: {made:?}");
            return None;
        }
    }
    Some((id("-u")?, id("-g")?))
}

/// A copy of `cuda-ipc` the test user can execute (the build folder may not be reachable for
/// other users), in a folder of its own removed on drop.
struct BinaryForOthers(std::path::PathBuf);

impl BinaryForOthers {
    fn new() -> BinaryForOthers {
        let dir = std::env::temp_dir().join(format!("cuda-ipc-ledger-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let exe = dir.join("cuda-ipc");
        std::fs::copy(bin(), &exe).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        BinaryForOthers(dir)
    }
}

impl Drop for BinaryForOthers {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Removes a ledger's name when dropped.
struct Gone(String);
impl Drop for Gone {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("/dev/shm/{}", self.0));
    }
}

#[test]
fn another_users_ls_gc_and_quota_show_skip_roots_ledger_with_a_note_and_exit_0() {
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let mut d = [0u8; 16];
    d[0] = 0xfe;
    d[1] = 0x51;
    d[12..].copy_from_slice(&std::process::id().to_le_bytes());
    let ledger = QuotaLedger::set_budget(QuotaScope::user(), Uuid(d), 1 << 20).unwrap();
    let _g = Gone(ledger.name().to_string());
    // A tensor set of root's too: left out of the second user's listing as root's channels are,
    // never a "cannot read" that fails `ls` (the set's segments are root's, mode 0600).
    let set = format!("other-users-set-{}", std::process::id());
    let w = cuda_ipc::tensorset::TensorSetWriter::create_host(
        &set,
        &[cuda_ipc::tensorset::TensorSpec::new(
            "w",
            cuda_ipc::tensorset::DType::U8,
            &[16],
        )],
        &cuda_ipc::tensorset::TensorSetOptions::new(),
    )
    .unwrap();
    let exe = BinaryForOthers::new();
    let note = format!(
        "quota ledger {}: skipped: it is uid 0 (root)'s, and this is uid {uid} ({USER})",
        ledger.name()
    );
    for args in [
        &["ls"][..],
        &["gc", "--dry-run"],
        &["gc"],
        &["quota", "show"],
    ] {
        let o = Command::new(exe.0.join("cuda-ipc"))
            .args(args)
            .current_dir("/")
            .uid(uid)
            .gid(gid) // std clears root's supplementary groups when it drops to `uid`
            .output()
            .unwrap();
        let t = text(&o);
        assert_eq!(o.status.code(), Some(0), "cuda-ipc {args:?}:\n{t}");
        assert!(t.contains(&note), "cuda-ipc {args:?}:\n{t}");
        assert!(!t.contains("cannot read"), "cuda-ipc {args:?}:\n{t}");
    }
    // JSON says the same, under its own key.
    let o = Command::new(exe.0.join("cuda-ipc"))
        .args(["quota", "show", "--json"])
        .current_dir("/")
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let skipped = v["skipped"].as_array().unwrap();
    assert!(
        skipped
            .iter()
            .any(|s| s["name"] == ledger.name() && s["owner"] == 0),
        "{v}"
    );
    assert_eq!(v["errors"].as_array().map(Vec::len), Some(0), "{v}");
    // Root's ledger is untouched, and so is its set.
    assert_eq!(ledger.snapshot().unwrap().budget, Some(1 << 20));
    w.close(std::time::Duration::from_secs(1)).unwrap();
}
