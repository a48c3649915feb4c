//! `gc` and the quota ledgers: a killed holder's reservation is listed by `gc --dry-run` (which
//! changes nothing) and freed by `gc`; the ledger and the live reservations stay. A ledger whose
//! creation was abandoned half-way (empty, or never stamped by a dead creator, 2 s old) is removed,
//! exit status 0; a young one, a live creator's and another user's are kept. `gc NAME` of a
//! ledger's segment name does the same for that ledger alone. A test binary of its
//! own: every `ls`, `watch` and `metrics` also frees dead holders, so no other test may look at
//! the ledgers meanwhile; its tests take turns (`gc` without a NAME looks at every ledger).

mod common;
use common::cuda_ipc;
use cuda_ipc::driver::Uuid;
use cuda_ipc::identity::ProcessIdentity;
use cuda_ipc::quota::{QuotaLedger, QuotaScope};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

/// Held by each test while it runs `gc` without a NAME, which looks at (and removes from) every
/// ledger: one test's `gc` would otherwise take what another planted before it looks.
static GC: Mutex<()> = Mutex::new(());

fn gc_turn() -> std::sync::MutexGuard<'static, ()> {
    GC.lock().unwrap_or_else(|p| p.into_inner())
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn fake_device(tag: u8) -> Uuid {
    let mut d = [0u8; 16];
    d[0] = 0xfe;
    d[1] = tag;
    d[12..].copy_from_slice(&std::process::id().to_le_bytes());
    Uuid(d)
}

/// Removes a ledger's name when dropped.
struct Gone(String);
impl Drop for Gone {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("/dev/shm/{}", self.0));
    }
}

const HOLDER_ROLE: &str = "CUDA_IPC_MON_TEST_HOLDER";

#[test]
fn gc_frees_a_killed_holders_reservation_and_keeps_the_ledger_and_the_live_ones() {
    const TEST: &str =
        "gc_frees_a_killed_holders_reservation_and_keeps_the_ledger_and_the_live_ones";
    let dev = fake_device(4);
    if let Ok(d) = std::env::var(HOLDER_ROLE) {
        let l = QuotaLedger::open(QuotaScope::user(), d.parse().unwrap()).unwrap();
        let _r = l.reserve(700).unwrap();
        // Straight to stdout (the test harness captures `println!`), on a line of its own (the
        // harness may have written `test NAME ... ` before it).
        let mut o = std::io::stdout().lock();
        writeln!(o, "\nheld").unwrap();
        o.flush().unwrap();
        drop(o);
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
    let _turn = gc_turn();
    let ledger = QuotaLedger::set_budget(QuotaScope::user(), dev, 1000).unwrap();
    let _g = Gone(ledger.name().to_string());
    let mine = ledger.reserve(100).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(HOLDER_ROLE, dev.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let held = BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        .any(|l| l == "held");
    assert!(held, "the holder did not reserve");
    let pid = child.id();
    child.kill().unwrap();
    child.wait().unwrap();
    let o = cuda_ipc(&["gc", "--dry-run"]);
    let t = text(&o);
    let line = format!(
        "would remove the reservation of 700 bytes of dead pid {pid} in quota ledger {}",
        ledger.name()
    );
    assert!(t.contains(&line), "{t}");
    // The dry run changed nothing (read without reclaiming).
    assert_eq!(ledger.dead_holders(false).unwrap().len(), 1);
    let o = cuda_ipc(&["gc"]);
    let t = text(&o);
    assert!(
        t.contains(&format!(
            "removed the reservation of 700 bytes of dead pid {pid} in quota ledger {}",
            ledger.name()
        )),
        "{t}"
    );
    let s = ledger.snapshot().unwrap();
    assert_eq!((s.used, s.holders.len(), s.reclaimed), (100, 1, 0));
    assert!(std::fs::metadata(format!("/dev/shm/{}", ledger.name())).is_ok());
    drop(mine);
}

/// Bytes of a ledger segment (a header page, then 256 entries of 64 bytes).
const LEDGER_LEN: usize = 4096 + 256 * 64;

/// The name of uid 65534's ledger of fake device `tag`: another user's (a file of uid 65534 under
/// this user's ledger name would be one planted there, a problem: the last test).
fn theirs_name(tag: u8) -> String {
    QuotaScope::User(65534).segment_name(fake_device(tag))
}

/// Plants a ledger creation of `creator` under `name` and gives it to uid 65534 (as root, when
/// this runs as root); returns whether it did (else it says why it left it out).
fn plant_another_users(name: &str, creator: ProcessIdentity) -> bool {
    if !rustix::process::geteuid().is_root() {
        println!("another user's ledger left out: needs root to give a file to another uid");
        return false;
    }
    plant(name, Some(creator));
    let st = Command::new("chown")
        .args(["65534", &format!("/dev/shm/{name}")])
        .status()
        .unwrap();
    assert!(st.success());
    true
}

/// Plants under `name` (mode 0600) what a `quota set` killed half-way leaves: with `creator`, the
/// whole ledger, every page written, with its magic, version and creator's identity words, never
/// stamped; without, an empty file (killed before `ftruncate`).
fn plant(name: &str, creator: Option<ProcessIdentity>) {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(format!("/dev/shm/{name}"))
        .unwrap();
    let Some(c) = creator else { return };
    let mut b = b"CIPCQUOT".to_vec();
    b.extend_from_slice(&1u32.to_le_bytes()); // layout version
    b.extend_from_slice(&0u32.to_le_bytes()); // no init stamp
    b.extend_from_slice(&7u64.to_le_bytes()); // creation generation
    for w in c.to_words() {
        b.extend_from_slice(&w.to_le_bytes());
    }
    b.resize(LEDGER_LEN, 0);
    f.write_all(&b).unwrap();
}

/// The identity of a process that ran and was killed (a `sleep` child of this test), its start
/// time read from `/proc/PID/stat` (field 22) while it ran.
fn dead_process() -> ProcessIdentity {
    let mut child = Command::new("sleep").arg("30").spawn().unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap();
    // The fields after the command name, which ends at the last ')', start with field 3.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let start: u64 = after.split(' ').nth(19).unwrap().parse().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let dead = ProcessIdentity {
        pid: child.id(),
        start_time: start,
        ..ProcessIdentity::current().unwrap()
    };
    assert!(!dead.is_alive());
    dead
}

/// Waits until the next whole second has begun: a file made then stays younger than the grace
/// (2 s, counted in whole seconds of `st_ctime`) for almost 2 s.
fn at_a_second_start() -> Instant {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap();
    std::thread::sleep(Duration::from_nanos(
        1_000_000_000 - u64::from(now.subsec_nanos()) + 20_000_000,
    ));
    Instant::now()
}

#[test]
fn gc_removes_an_abandoned_quota_ledger_creation_and_keeps_a_young_live_or_other_users_one() {
    let _turn = gc_turn();
    let name = |tag: u8| QuotaScope::user().segment_name(fake_device(tag));
    let [empty, dead, live, _, young, young_empty] = [0x10, 0x11, 0x12, 0x13, 0x14, 0x15].map(name);
    let theirs = theirs_name(0x13);
    let _g = [&empty, &dead, &live, &theirs, &young, &young_empty].map(|n| Gone(n.clone()));
    let exists = |n: &str| std::fs::symlink_metadata(format!("/dev/shm/{n}")).is_ok();
    let creator = dead_process();
    plant(&empty, None);
    plant(&dead, Some(creator));
    plant(&live, Some(ProcessIdentity::current().unwrap()));
    let root = plant_another_users(&theirs, creator);
    // Past the grace (2 s, in whole seconds of `st_ctime`); then two young ones.
    std::thread::sleep(Duration::from_millis(2200));
    // `ls` cannot read them, and says which `gc` removes.
    let t = text(&cuda_ipc(&["ls"]));
    for (n, removes) in [(&empty, true), (&dead, true), (&live, false)] {
        let line = t
            .lines()
            .find(|l| l.starts_with(&format!("quota ledger {n}: cannot read: ")))
            .unwrap_or_else(|| panic!("{n}: {t}"));
        assert_eq!(
            line.ends_with("`cuda-ipc gc` removes it)"),
            removes,
            "{line}"
        );
    }
    let planted = at_a_second_start();
    plant(&young, Some(creator));
    plant(&young_empty, None);

    let o = cuda_ipc(&["gc", "--dry-run", "--json"]);
    let young_yet = planted.elapsed() < Duration::from_millis(1900);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    let mine = |o: &str| {
        [&empty, &dead, &live, &theirs, &young, &young_empty]
            .iter()
            .any(|n| n.as_str() == o)
    };
    let listed: Vec<&serde_json::Value> = v["leftovers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| mine(l["object"].as_str().unwrap()))
        .collect();
    let kinds: Vec<(&str, &str)> = listed
        .iter()
        .map(|l| (l["kind"].as_str().unwrap(), l["object"].as_str().unwrap()))
        .collect();
    // The young ones come of age only if the run took almost 2 s (a slow machine).
    let late = |n: &str| !young_yet && (n == young || n == young_empty);
    assert!(
        kinds.len() >= 2
            && kinds[..2]
                == [
                    ("quota_creation", empty.as_str()),
                    ("quota_creation", dead.as_str())
                ]
            && kinds[2..]
                .iter()
                .all(|&(k, n)| k == "quota_creation" && late(n)),
        "{listed:#?}"
    );
    assert_eq!(listed[0]["pid"], serde_json::Value::Null);
    assert_eq!(listed[1]["pid"], creator.pid);
    assert_eq!(listed[1]["uid"], rustix::process::geteuid().as_raw());
    assert_eq!(
        listed[1]["what"],
        format!(
            "quota ledger {dead}: segment /dev/shm/{dead}: a creation abandoned by its dead \
             creator before its init stamp"
        )
    );
    assert!(v["problems"].as_array().unwrap().is_empty(), "{v:#}");
    let kept: Vec<&str> = v["kept"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["what"].as_str().unwrap())
        .collect();
    let kept_line = |n: &str| {
        kept.iter()
            .find(|k| k.starts_with(&format!("quota ledger {n}: ")))
            .copied()
    };
    let l = kept_line(&live).expect("a live creator's creation is kept");
    assert!(
        l.contains(&format!(
            "not stamped yet, by pid {}, which runs",
            std::process::id()
        )),
        "{l}"
    );
    if young_yet {
        for n in [&young, &young_empty] {
            let l = kept_line(n).expect("a young creation is kept");
            assert!(l.contains("a creation under way"), "{l}");
        }
    }
    if root {
        let skipped = v["quota_skipped"].as_array().unwrap();
        assert!(
            skipped
                .iter()
                .any(|s| s["name"] == theirs.as_str() && s["owner"] == 65534),
            "{v:#}"
        );
    }
    assert!(
        [&empty, &dead].iter().all(|n| exists(n)),
        "the dry run removed nothing"
    );

    let o = cuda_ipc(&["gc"]);
    let t = text(&o);
    let young_yet = planted.elapsed() < Duration::from_millis(1900);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(
        t.contains(&format!(
            "removed quota ledger {empty}: segment /dev/shm/{empty}: a creation abandoned before \
             its pages were reserved"
        )),
        "{t}"
    );
    assert!(
        t.contains(&format!(
            "removed quota ledger {dead}: segment /dev/shm/{dead}: a creation abandoned by its \
             dead creator before its init stamp"
        )),
        "{t}"
    );
    assert!(
        t.contains(&format!(
            "kept quota ledger {live}: a creation under way: not stamped yet"
        )),
        "{t}"
    );
    assert!(!exists(&empty) && !exists(&dead), "{t}");
    assert!(exists(&live), "{t}");
    if young_yet {
        assert!(exists(&young) && exists(&young_empty), "{t}");
    }
    if root {
        assert!(
            t.contains(&format!("quota ledger {theirs}: skipped: it is uid 65534")),
            "{t}"
        );
        assert!(
            !t.contains(&format!("removed quota ledger {theirs}")),
            "{t}"
        );
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(format!("/dev/shm/{theirs}")).unwrap();
        assert_eq!(m.uid(), 65534, "another user's is never removed");
    }
}

/// `gc NAME` takes a quota ledger's segment name as it takes a registry's or a channel's: that
/// ledger alone, by the rules of `gc` without a NAME. A killed holder's reservation is freed (the
/// ledger and the live reservation stay); this user's creation abandoned half-way is removed; a
/// live creator's is kept, with why; another user's is skipped, never touched; no other ledger is
/// looked at.
#[test]
fn gc_of_a_quota_ledgers_name_cleans_that_ledger_by_the_same_rules() {
    const HOLDER_TEST: &str =
        "gc_frees_a_killed_holders_reservation_and_keeps_the_ledger_and_the_live_ones";
    if std::env::var(HOLDER_ROLE).is_ok() {
        return;
    }
    let _turn = gc_turn();
    let name = |tag: u8| QuotaScope::user().segment_name(fake_device(tag));
    let [empty, dead, live, _, bystander] = [0x20, 0x21, 0x22, 0x23, 0x24].map(name);
    let theirs = theirs_name(0x23);
    let _g = [&empty, &dead, &live, &theirs, &bystander].map(|n| Gone(n.clone()));
    let exists = |n: &str| std::fs::symlink_metadata(format!("/dev/shm/{n}")).is_ok();
    // A ready ledger with this process's reservation and a killed holder's (a child running the
    // holder role of the test above).
    let dev = fake_device(0x25);
    let ledger = QuotaLedger::set_budget(QuotaScope::user(), dev, 1000).unwrap();
    let _l = Gone(ledger.name().to_string());
    let mine = ledger.reserve(100).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([HOLDER_TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(HOLDER_ROLE, dev.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let held = BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .any(|l| l == "held");
    assert!(held, "the holder did not reserve");
    let pid = child.id();
    child.kill().unwrap();
    child.wait().unwrap();
    // Creations: abandoned (empty; never stamped by a dead creator), a live creator's, and one
    // abandoned beside them that no NAME names.
    plant(&empty, None);
    plant(&dead, Some(dead_process()));
    plant(&live, Some(ProcessIdentity::current().unwrap()));
    plant(&bystander, None);
    let root = plant_another_users(&theirs, dead_process());
    // Past the grace (2 s, in whole seconds of `st_ctime`).
    std::thread::sleep(Duration::from_millis(2200));

    let holder = format!(
        "the reservation of 700 bytes of dead pid {pid} in quota ledger {}",
        ledger.name()
    );
    let o = cuda_ipc(&["gc", ledger.name(), "--dry-run"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("would remove {holder}")),
        "{}",
        text(&o)
    );
    assert_eq!(ledger.dead_holders(false).unwrap().len(), 1, "a dry run");
    let o = cuda_ipc(&["gc", ledger.name()]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("removed {holder}")),
        "{}",
        text(&o)
    );
    let s = ledger.snapshot().unwrap();
    assert_eq!((s.used, s.holders.len()), (100, 1));
    assert!(exists(ledger.name()), "a ready ledger stays");

    for (n, why) in [
        (
            &empty,
            "a creation abandoned before its pages were reserved",
        ),
        (
            &dead,
            "a creation abandoned by its dead creator before its init stamp",
        ),
    ] {
        let o = cuda_ipc(&["gc", n, "--dry-run", "--json"]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
        assert_eq!(v["leftovers"].as_array().unwrap().len(), 1, "{v:#}");
        assert_eq!(v["leftovers"][0]["kind"], "quota_creation", "{v:#}");
        assert_eq!(v["leftovers"][0]["object"], n.as_str(), "{v:#}");
        let o = cuda_ipc(&["gc", n]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        assert!(
            text(&o).contains(&format!(
                "removed quota ledger {n}: segment /dev/shm/{n}: {why}"
            )),
            "{}",
            text(&o)
        );
        assert!(!exists(n), "{n}");
    }
    assert!(exists(&bystander), "a ledger no NAME named was looked at");

    let o = cuda_ipc(&["gc", &live]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains(&format!(
            "kept quota ledger {live}: a creation under way: not stamped yet, by pid {}",
            std::process::id()
        )),
        "{}",
        text(&o)
    );
    assert!(exists(&live));
    if root {
        let o = cuda_ipc(&["gc", &theirs]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        assert!(
            text(&o).contains(&format!("quota ledger {theirs}: skipped: it is uid 65534")),
            "{}",
            text(&o)
        );
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(format!("/dev/shm/{theirs}")).unwrap();
        assert_eq!(m.uid(), 65534, "another user's is never removed");
    }
    drop(mine);
}

#[test]
fn ls_of_a_ledgers_name_shows_that_ledger_alone() {
    let a = QuotaLedger::set_budget(QuotaScope::user(), fake_device(7), 4096).unwrap();
    let _ga = Gone(a.name().to_string());
    let b = QuotaLedger::set_budget(QuotaScope::user(), fake_device(8), 8192).unwrap();
    let _gb = Gone(b.name().to_string());
    let _r = a.reserve(1000).unwrap();
    let o = cuda_ipc(&["ls", a.name()]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(t.contains(&format!("(ledger {}", a.name())), "{t}");
    assert!(t.contains("1000 B of 4.0 KiB used"), "{t}");
    assert!(!t.contains(b.name()), "another ledger shown: {t}");
    assert!(!t.contains("registry"), "read as a registry: {t}");
    let o = cuda_ipc(&["ls", a.name(), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<&str> = v["quotas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, [a.name()]);
    assert_eq!(v["errors"].as_array().unwrap().len(), 0, "{v}");
}

/// A file another user planted under this user's ledger name (root's here: the test gives it to
/// uid 65534): `quota show`, `ls` and `gc` name it as planted, with what to do, exit status 1 (a
/// problem, not another user's budget to skip), and leave it where it is.
#[test]
fn a_file_planted_under_this_users_ledger_name_is_a_problem_that_says_so_and_stays() {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root to give a file to another uid");
        return;
    }
    let _turn = gc_turn();
    let name = QuotaScope::user().segment_name(fake_device(9));
    let path = format!("/dev/shm/{name}");
    let _g = Gone(name.clone());
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .unwrap();
    f.write_all(&[0u8; 20_480]).unwrap();
    drop(f);
    rustix::fs::chown(
        path.as_str(),
        Some(rustix::process::Uid::from_raw(65534)),
        None,
    )
    .unwrap();
    for args in [
        &["quota", "show"][..],
        &["ls"][..],
        &["gc"][..],
        &["gc", name.as_str()][..],
    ] {
        let o = cuda_ipc(args);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {t}");
        assert!(
            t.contains(&name) && t.contains("planted") && t.contains("uid 65534"),
            "{args:?}: {t}"
        );
    }
    let st = std::fs::metadata(&path).unwrap();
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&st),
        65534,
        "left as it was"
    );
}
