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

/// Held by each test: each plants objects that another's `gc` or `ls` of everything would meet
/// (counted in its lines, or a problem that changes its exit status).
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ALONE.lock().unwrap_or_else(|p| p.into_inner())
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
    let _alone = alone();
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

/// Runs the copy of `cuda-ipc` in `exe` as the test user.
fn as_user(exe: &BinaryForOthers, (uid, gid): (u32, u32), args: &[&str]) -> Output {
    Command::new(exe.0.join("cuda-ipc"))
        .args(args)
        .current_dir("/")
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap()
}

/// The entry of `skipped` (a `gc --json` or `ls --json` document's) for `name`.
fn skipped_entry<'a>(v: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    v["skipped"].as_array()?.iter().find(|s| s["name"] == name)
}

/// What `gc` passes over of other users is said, whoever runs it, root included: root's `gc`
/// (which leaves another user's segments, never opened: here of uid 65534, which no other test
/// runs as) and a second user's (which leaves root's segments and the liveness file of a dead
/// process of root's) each print a line per uid naming whose and what, and list each object under
/// `skipped` in `--json`; `ls` says the same of what `gc` would skip. Notes, never problems (exit
/// status 0); nothing is touched. Before, both passed over them in silence.
#[test]
fn gc_and_ls_say_what_of_other_users_gc_passes_over_as_root_and_as_another_user() {
    let _alone = alone();
    use cuda_ipc::raw::registry_layout::MAGIC;
    use std::os::unix::fs::OpenOptionsExt;
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let tag = std::process::id();
    const OTHER: u32 = 65534;
    // Another user's segments under this crate's names (a creation abandoned half-way, were they
    // root's: removed by root's `gc`), and a registry of that user's.
    let theirs = [
        (format!("cuda-ipc.ch.others-{tag}"), "channel segment"),
        (format!("cuda-ipc.hp.others-{tag}"), "host pool"),
        (format!("cuda-ipc.ts.others-{tag}"), "tensor set part"),
        (format!("cuda-ipc.td.others-{tag}"), "tensor set part"),
        (format!("others-registry-{tag}"), "registry"),
    ];
    let mut _g: Vec<Gone> = Vec::new();
    for (name, what) in &theirs {
        _g.push(Gone(name.clone()));
        let mut bytes = vec![0u8; 8192];
        if *what == "registry" {
            bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
        }
        drop(common::write_segment(name, &bytes));
        std::os::unix::fs::chown(format!("/dev/shm/{name}"), Some(OTHER), Some(OTHER)).unwrap();
    }
    // Root's: a channel segment, and the liveness file of a process of root's that is dead (a
    // child that ran and ended), with its lock free.
    let mine = format!("cuda-ipc.ch.roots-{tag}");
    _g.push(Gone(mine.clone()));
    drop(common::write_segment(&mine, &[0u8; 8192]));
    let mut child = Command::new("true").spawn().unwrap();
    let dead_pid = child.id();
    child.wait().unwrap();
    let me = cuda_ipc::identity::ProcessIdentity::current().unwrap();
    let live = format!("cuda-ipc.live.{}.{dead_pid}.1", me.pid_ns);
    _g.push(Gone(live.clone()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(format!("/dev/shm/{live}"))
        .unwrap();
    std::fs::set_permissions(
        format!("/dev/shm/{live}"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();

    // Root: the other user's objects are skipped, each listed, and a line for that uid.
    let whose = format!("of uid {OTHER}");
    for args in [&["gc", "--dry-run"][..], &["ls"]] {
        let o = Command::new(bin()).args(args).output().unwrap();
        let t = text(&o);
        let lead = if args[0] == "gc" {
            "skipped "
        } else {
            "`cuda-ipc gc` skips "
        };
        let line = t
            .lines()
            .find(|l| l.starts_with(lead) && l.contains(&whose))
            .unwrap_or_else(|| panic!("cuda-ipc {args:?}: no line for uid {OTHER}:\n{t}"));
        for what in [
            "1 registry",
            "channel segment",
            "host pool",
            "tensor set parts",
        ] {
            assert!(line.contains(what), "{what}: {line}");
        }
        assert!(line.contains("another user's, left as they are"), "{line}");
        if args[0] == "gc" {
            assert_eq!(o.status.code(), Some(0), "cuda-ipc {args:?}:\n{t}");
        }
    }
    for args in [&["gc", "--dry-run", "--json"][..], &["ls", "--json"]] {
        let o = Command::new(bin()).args(args).output().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("cuda-ipc {args:?}: {e}: {}", text(&o)));
        for (name, what) in &theirs {
            let s = skipped_entry(&v, name).unwrap_or_else(|| panic!("{name}: {v}"));
            assert_eq!(
                (&s["owner"], &s["what"], &s["dead"], &s["pid"]),
                (
                    &OTHER.into(),
                    &(*what).into(),
                    &false.into(),
                    &serde_json::Value::Null
                ),
                "{s}"
            );
        }
        assert!(skipped_entry(&v, &mine).is_none(), "root's own: {v}");
        if args[0] == "gc" {
            assert_eq!(o.status.code(), Some(0), "{v}");
            assert!(
                !v["problems"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p.to_string().contains("others-")),
                "{v}"
            );
        }
    }

    // The second user: root's channel segment and the dead process's liveness file (once older
    // than the 5 s a starting process's free lock is given) are skipped and said.
    std::thread::sleep(std::time::Duration::from_millis(5500));
    let exe = BinaryForOthers::new();
    let o = as_user(&exe, (uid, gid), &["gc", "--dry-run"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    let line = t
        .lines()
        .find(|l| l.starts_with("skipped ") && l.contains("of uid 0 (root): "))
        .unwrap_or_else(|| panic!("no line for root:\n{t}"));
    assert!(line.contains("channel segment"), "{line}");
    assert!(line.contains("liveness file"), "{line}");
    assert!(line.contains("of a dead process") || line.contains("of dead processes"));
    for args in [&["gc", "--dry-run", "--json"][..], &["ls", "--json"]] {
        let o = as_user(&exe, (uid, gid), args);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("cuda-ipc {args:?}: {e}: {}", text(&o)));
        assert_eq!(o.status.code(), Some(0), "cuda-ipc {args:?}: {v}");
        let s = skipped_entry(&v, &mine).unwrap_or_else(|| panic!("{mine}: {v}"));
        assert_eq!((&s["owner"], &s["dead"]), (&0.into(), &false.into()), "{s}");
        let s = skipped_entry(&v, &live).unwrap_or_else(|| panic!("{live}: {v}"));
        assert_eq!(
            (&s["owner"], &s["what"], &s["dead"], &s["pid"]),
            (
                &0.into(),
                &"liveness file".into(),
                &true.into(),
                &dead_pid.into()
            ),
            "{s}"
        );
    }
    let o = as_user(&exe, (uid, gid), &["ls"]);
    let t = text(&o);
    assert!(
        t.lines()
            .any(|l| l.starts_with("`cuda-ipc gc` skips ") && l.contains("of uid 0 (root): ")),
        "{t}"
    );
    // Nothing was touched.
    for name in theirs.iter().map(|(n, _)| n).chain([&mine, &live]) {
        assert!(
            std::fs::symlink_metadata(format!("/dev/shm/{name}")).is_ok(),
            "{name} removed"
        );
    }
}

/// `gc NAME` of another user's object passes it over as `gc` without a NAME does: the same
/// `skipped` entries (a line per uid in the text form; another user's quota ledger its own line
/// and `quota_skipped`), no problem, exit status 0, in each form (`--dry-run`, the real run,
/// `--json`), nothing touched. Root's `gc` of objects of uid 65534 (a channel's control segment
/// and host pool, a tensor set's parts, a registry, a quota ledger), and the second user's `gc` of
/// a channel of root's. Before, each was a problem (`cannot read`, exit status 1) while a `gc` of
/// everything skipped them. A set of root's with a part of theirs beside root's parts is still a
/// problem (their part is listed as skipped too): not another user's object, but root's with
/// another user's file in it.
#[test]
fn gc_of_another_users_object_by_name_passes_it_over_as_gc_of_everything_does() {
    let _alone = alone();
    use cuda_ipc::raw::registry_layout::MAGIC;
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let tag = std::process::id();
    const OTHER: u32 = 65534;
    let (ch, ts, reg) = (
        format!("named-theirs-ch-{tag}"),
        format!("named-theirs-ts-{tag}"),
        format!("named-theirs-reg-{tag}"),
    );
    let ledger = format!("cuda-ipc.quota.u{OTHER}.fe52{tag:028x}");
    // (NAME given to `gc`, its segments of uid 65534 with what each is in `skipped`).
    let named: [(&str, Vec<(String, &str)>); 4] = [
        (
            &ch,
            vec![
                (format!("cuda-ipc.ch.{ch}"), "channel segment"),
                (format!("cuda-ipc.hp.{ch}"), "host pool"),
            ],
        ),
        (
            &ts,
            vec![
                (format!("cuda-ipc.ts.{ts}"), "tensor set part"),
                (format!("cuda-ipc.tg.{ts}"), "tensor set part"),
                (format!("cuda-ipc.td.{ts}"), "tensor set part"),
            ],
        ),
        (&reg, vec![(reg.clone(), "registry")]),
        (&ledger, vec![(ledger.clone(), "quota ledger")]),
    ];
    let mut _g: Vec<Gone> = Vec::new();
    for (_, segments) in &named {
        for (name, what) in segments {
            _g.push(Gone(name.clone()));
            let mut bytes = vec![0u8; 8192];
            if *what == "registry" {
                bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
            }
            drop(common::write_segment(name, &bytes));
            std::os::unix::fs::chown(format!("/dev/shm/{name}"), Some(OTHER), Some(OTHER)).unwrap();
        }
    }
    assert_eq!(
        cuda_ipc::tensorset::GENERATION_PREFIX,
        "cuda-ipc.tg.",
        "the planted set's parts"
    );
    // What `gc` without a NAME says of them: the entries a `gc NAME` must give.
    let o = Command::new(bin())
        .args(["gc", "--dry-run", "--json"])
        .output()
        .unwrap();
    let everything: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let whose = format!("of uid {OTHER}");
    for (n, segments) in &named {
        for args in [&["gc", n, "--dry-run"][..], &["gc", n]] {
            let o = Command::new(bin()).args(args).output().unwrap();
            let t = text(&o);
            assert_eq!(o.status.code(), Some(0), "cuda-ipc {args:?}:\n{t}");
            assert!(!t.contains("cannot read"), "cuda-ipc {args:?}:\n{t}");
            if *n == ledger {
                assert!(
                    t.contains(&format!(
                        "quota ledger {ledger}: skipped: it is uid {OTHER}"
                    )),
                    "cuda-ipc {args:?}:\n{t}"
                );
            } else {
                let line = t
                    .lines()
                    .find(|l| l.starts_with("skipped ") && l.contains(&whose))
                    .unwrap_or_else(|| panic!("cuda-ipc {args:?}: no line for uid {OTHER}:\n{t}"));
                let k = segments.len();
                assert!(
                    line.contains(&format!(
                        "skipped {k} object{} {whose}",
                        if k == 1 { "" } else { "s" }
                    )) && line.contains(segments[0].1),
                    "{line}"
                );
                assert!(line.contains("another user's, left as they are"), "{line}");
            }
        }
        for args in [&["gc", n, "--dry-run", "--json"][..], &["gc", n, "--json"]] {
            let o = Command::new(bin()).args(args).output().unwrap();
            let v: serde_json::Value = serde_json::from_slice(&o.stdout)
                .unwrap_or_else(|e| panic!("cuda-ipc {args:?}: {e}: {}", text(&o)));
            assert_eq!(o.status.code(), Some(0), "cuda-ipc {args:?}: {v}");
            assert_eq!(
                v["problems"],
                serde_json::json!([]),
                "cuda-ipc {args:?}: {v}"
            );
            assert_eq!(
                v["leftovers"],
                serde_json::json!([]),
                "cuda-ipc {args:?}: {v}"
            );
            if *n == ledger {
                assert_eq!(v["skipped"], serde_json::json!([]), "{v}");
                let q = v["quota_skipped"].as_array().unwrap();
                assert!(
                    q.len() == 1 && q[0]["name"] == ledger.as_str() && q[0]["owner"] == OTHER,
                    "{v}"
                );
                continue;
            }
            let entries: Vec<&serde_json::Value> = segments
                .iter()
                .map(|(name, _)| {
                    skipped_entry(&everything, name)
                        .unwrap_or_else(|| panic!("gc without a NAME: {name}: {everything}"))
                })
                .collect();
            let got: Vec<&serde_json::Value> = v["skipped"].as_array().unwrap().iter().collect();
            let mut want = entries.clone();
            want.sort_by_key(|e| e["name"].as_str().unwrap().to_string());
            assert_eq!(
                got, want,
                "cuda-ipc {args:?}: the entries of gc without a NAME"
            );
            for (e, (_, what)) in entries.iter().zip(segments) {
                assert_eq!((&e["owner"], &e["what"]), (&OTHER.into(), &(*what).into()));
            }
        }
    }
    // A set of root's (its manifest) with a part of theirs beside it: root's set, with another
    // user's file in it, is a problem, and their part is listed as skipped, as without a NAME.
    let mixed = format!("named-mixed-ts-{tag}");
    let (root_part, their_part) = (
        format!("cuda-ipc.ts.{mixed}"),
        format!("cuda-ipc.tg.{mixed}"),
    );
    _g.push(Gone(root_part.clone()));
    _g.push(Gone(their_part.clone()));
    drop(common::write_segment(&root_part, &[0u8; 8192]));
    drop(common::write_segment(&their_part, &[0u8; 8192]));
    std::os::unix::fs::chown(format!("/dev/shm/{their_part}"), Some(OTHER), Some(OTHER)).unwrap();
    let o = Command::new(bin())
        .args(["gc", &mixed, "--dry-run", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(o.status.code(), Some(1), "{v}");
    assert!(
        v["problems"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["error"].as_str().unwrap().contains(&their_part)),
        "{v}"
    );
    assert!(skipped_entry(&v, &their_part).is_some(), "{v}");
    assert!(skipped_entry(&v, &root_part).is_none(), "{v}");

    // The second user's `gc` of a channel of root's: the same, of uid 0.
    let mine = format!("named-roots-ch-{tag}");
    let seg = format!("cuda-ipc.ch.{mine}");
    _g.push(Gone(seg.clone()));
    drop(common::write_segment(&seg, &[0u8; 8192]));
    let exe = BinaryForOthers::new();
    for args in [&["gc", &mine, "--dry-run"][..], &["gc", &mine]] {
        let o = as_user(&exe, (uid, gid), args);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(0), "cuda-ipc {args:?}:\n{t}");
        assert!(
            t.lines()
                .any(|l| l.starts_with("skipped 1 object of uid 0 (root): 1 channel segment")),
            "cuda-ipc {args:?}:\n{t}"
        );
    }
    let o = as_user(&exe, (uid, gid), &["gc", &mine, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(o.status.code(), Some(0), "{v}");
    let s = skipped_entry(&v, &seg).unwrap_or_else(|| panic!("{seg}: {v}"));
    assert_eq!(
        (&s["owner"], &s["what"]),
        (&0.into(), &"channel segment".into())
    );

    // Nothing was touched.
    for (_, segments) in &named {
        for (name, _) in segments {
            let m = std::fs::metadata(format!("/dev/shm/{name}"))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(std::os::unix::fs::MetadataExt::uid(&m), OTHER, "{name}");
        }
    }
    for name in [&root_part, &their_part, &seg] {
        assert!(
            std::fs::metadata(format!("/dev/shm/{name}")).is_ok(),
            "{name}"
        );
    }
}

/// A member of a group whose budget another user set (here root, for the test user's group) may
/// read it but not change or remove it: `quota set` and `quota remove` exit 1 naming the ledger's
/// owner and what may be done, not the segment layer's "owned by uid 0" (which `quota set` said
/// before); the budget stays as it was.
#[test]
fn a_member_changing_another_users_group_budget_is_told_whose_it_is_and_changes_nothing() {
    let _alone = alone();
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let mut d = [0u8; 16];
    d[0] = 0xfe;
    d[1] = 0x52;
    d[12..].copy_from_slice(&std::process::id().to_le_bytes());
    let device = Uuid(d);
    let ledger = QuotaLedger::set_budget(QuotaScope::Group(gid), device, 1 << 20).unwrap();
    let _g = Gone(ledger.name().to_string());
    let exe = BinaryForOthers::new();
    let dev = device.to_string();
    let group = gid.to_string();
    for args in [
        &[
            "quota", "set", "--device", &dev, "--bytes", "2MiB", "--group", &group,
        ][..],
        &["quota", "remove", "--device", &dev, "--group", &group],
    ] {
        let o = as_user(&exe, (uid, gid), args);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "cuda-ipc {args:?}:\n{t}");
        assert!(
            t.contains(&format!(
                "only uid 0 (the ledger's owner) may change the budget of {}; this is uid {uid}",
                ledger.name()
            )),
            "cuda-ipc {args:?}:\n{t}"
        );
        assert!(!t.contains("is owned by uid"), "cuda-ipc {args:?}:\n{t}");
    }
    // Read as a member may: shown, unchanged.
    let o = as_user(&exe, (uid, gid), &["quota", "show"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(t.contains(ledger.name()) && t.contains("1.0 MiB"), "{t}");
    assert_eq!(ledger.snapshot().unwrap().budget, Some(1 << 20));
}
