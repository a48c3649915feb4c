//! `gc`'s side of a tensor set's holders segment (`cuda-ipc.th.NAME`), without a GPU: a FIFO, a
//! directory or a symbolic link under the name is a problem naming it, never removed or followed;
//! the slots dead servers left in a live set's holders segment are listed and freed, a live
//! server's never. The openers' side (holders, writerless readers, the writer) is tested in
//! `src/tensorset/holders/hostile.rs`.

mod common;

use cuda_ipc::cleanup::{self, LeftoverKind, Scope};
use cuda_ipc::identity::{Liveness, ProcessIdentity};
use cuda_ipc::raw::tensorset::testing::HeldSetFixture;
use cuda_ipc::tensorset::reclaim::{dead_holders, release_dead_holders, remove_stale};
use cuda_ipc::tensorset::{HOLDERS_PREFIX, HolderRole};
use std::ffi::CString;
use std::time::{Duration, Instant};

fn name(tag: &str) -> String {
    format!("th-gc-{tag}-{}", std::process::id())
}

fn path(set: &str) -> String {
    format!("/dev/shm/{HOLDERS_PREFIX}{set}")
}

/// Removes whatever is at the set's holders path when dropped.
struct Planted(String);
impl Drop for Planted {
    fn drop(&mut self) {
        let p = path(&self.0);
        let _ = std::fs::remove_dir(&p);
        let _ = std::fs::remove_file(&p);
    }
}

fn scope(set: &str) -> Scope {
    Scope::only(Vec::new(), Vec::new()).with_tensor_sets(vec![set.to_string()])
}

/// A running child (`sleep`) and its identity (start time from `/proc/PID/stat`, field 22).
fn live_process() -> (std::process::Child, ProcessIdentity) {
    let c = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", c.id())).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let start_time = after.split(' ').nth(19).unwrap().parse().unwrap();
    let id = ProcessIdentity {
        pid: c.id(),
        start_time,
        ..ProcessIdentity::current().unwrap()
    };
    (c, id)
}

#[test]
fn gc_reports_a_fifo_a_directory_or_a_link_under_a_holders_name_and_keeps_it() {
    for kind in ["FIFO", "directory", "symbolic link"] {
        let set = name(&kind.replace(' ', "-"));
        let _g = Planted(set.clone());
        let p = path(&set);
        match kind {
            "FIFO" => {
                let c = CString::new(p.clone()).unwrap();
                // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            }
            "directory" => std::fs::create_dir(&p).unwrap(),
            _ => std::os::unix::fs::symlink("/dev/null", &p).unwrap(),
        }
        let t = Instant::now();
        let errors = [
            remove_stale(&set).map(|_| ()).unwrap_err(),
            dead_holders(&set).map(|_| ()).unwrap_err(),
            release_dead_holders(&set).map(|_| ()).unwrap_err(),
        ];
        for e in &errors {
            assert!(e.to_string().contains(kind), "{kind}: {e}");
        }
        let scan = cleanup::scan(&scope(&set)).unwrap();
        assert!(scan.leftovers.is_empty(), "{kind}: {:?}", scan.leftovers);
        assert!(
            scan.problems
                .iter()
                .any(|p| p.subject.contains(&set) && p.error.to_string().contains(kind)),
            "{kind}: {:?}",
            scan.problems
        );
        let r = cleanup::remove(&scan.leftovers);
        assert!(r.removed.is_empty());
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        let m = std::fs::symlink_metadata(&p).unwrap();
        assert!(
            !m.file_type().is_file(),
            "{kind}: still there and untouched"
        );
    }
}

#[test]
fn gc_frees_the_slots_of_dead_servers_and_never_a_live_ones() {
    let set = name("slots");
    let _g = Planted(set.clone());
    let f = HeldSetFixture::create(&set, 2).unwrap();
    let me = rustix::process::geteuid().as_raw();
    let live = f.claim(HolderRole::Holder).unwrap();
    // Two servers that run while they claim, then are killed (a claim takes a dead server's slot).
    let (mut a, a_id) = live_process();
    let (mut b, b_id) = live_process();
    assert_eq!(a_id.liveness_as(me), Liveness::Alive);
    let dead_holder = f.claim_for(HolderRole::Holder, a_id, me).unwrap();
    let dead_reader = f.claim_for(HolderRole::Reader, b_id, me).unwrap();
    for c in [&mut a, &mut b] {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    assert_eq!(a_id.liveness_as(me), Liveness::Dead);
    let listed = dead_holders(&set).unwrap();
    let mut slots: Vec<usize> = listed.iter().map(|s| s.slot).collect();
    slots.sort();
    assert_eq!(slots, vec![dead_holder, dead_reader]);
    // The scan lists exactly those (the set's writer, this process, runs: no part goes).
    let scan = cleanup::scan(&scope(&set)).unwrap();
    let kinds: Vec<LeftoverKind> = scan.leftovers.iter().map(|l| l.kind).collect();
    assert_eq!(
        kinds,
        vec![LeftoverKind::TensorSetHolder; 2],
        "{:?}",
        scan.leftovers
    );
    for l in &scan.leftovers {
        let text = l.to_string();
        assert!(
            text.contains(&format!("tensorset {set}: holder slot")) && text.contains("of dead"),
            "{text}"
        );
    }
    let r = cleanup::remove(&scan.leftovers);
    assert_eq!(r.removed.len(), 2, "{:?}", r.removed);
    assert!(r.kept.is_empty() && r.problems.is_empty());
    let left = f.holders();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0].slot, live);
    assert_eq!(left[0].liveness, Liveness::Alive);
    // Nothing more to free; a freed slot is claimed again.
    assert!(release_dead_holders(&set).unwrap().is_empty());
    assert!(cleanup::scan(&scope(&set)).unwrap().leftovers.is_empty());
    let again = f.claim(HolderRole::Holder).unwrap();
    assert!(again == dead_holder || again == dead_reader, "{again}");
    f.unlink();
}

/// `gc` keeps a set's parts only while a live server serves it from the holders segment its
/// manifest names (`is_held`): a live holder in a holders segment of another creation, or beside
/// a host set's manifest (which names none), keeps nothing (a dead host writer's set was kept
/// for good, silently, by any live slot under its holders name). Without a manifest a live holder
/// counts, unless this user's host data segment stands under the name (a host set has no
/// holders). A holders segment without its stamp serves nobody, and is not waited for.
#[test]
fn only_the_holders_segment_its_manifest_names_keeps_a_set() {
    use cuda_ipc::tensorset::reclaim::is_held;
    use cuda_ipc::tensorset::{DType, TensorSetOptions, TensorSetWriter, TensorSpec};
    let set = name("named");
    let _g = Planted(set.clone());
    let data = format!("/dev/shm/{}{set}", cuda_ipc::tensorset::DATA_PREFIX);
    let f = HeldSetFixture::create(&set, 1).unwrap();
    assert!(!is_held(&set), "no holder yet");
    f.claim(HolderRole::Holder).unwrap();
    assert!(
        is_held(&set),
        "a live holder in the segment the manifest names"
    );
    // Made again: another creation than the manifest names.
    std::fs::remove_file(path(&set)).unwrap();
    let g = HeldSetFixture::create_holders(&set, 1).unwrap();
    g.claim(HolderRole::Holder).unwrap();
    assert!(
        !is_held(&set),
        "a holders segment the manifest does not name"
    );
    // No manifest (gone, being made): a live holder counts, but not beside host data.
    f.unlink();
    assert!(is_held(&set), "no manifest");
    common::plant(&data, &[0u8; 4096]);
    assert!(!is_held(&set), "a host set's data segment");
    std::fs::remove_file(&data).unwrap();
    // A host set's manifest names no holders segment.
    let specs = [TensorSpec::new("w", DType::F32, &[4])];
    let w = TensorSetWriter::create_host(&set, &specs, &TensorSetOptions::new()).unwrap();
    assert!(!is_held(&set), "beside a host set");
    drop(w);
    g.unlink();
    // Never stamped (mode 0600, as a creation of ours: not refused for its mode): nobody serves
    // from it, and nothing waits for it.
    common::plant(path(&set), &[0u8; 16384]);
    let t = Instant::now();
    assert!(!is_held(&set));
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
}
