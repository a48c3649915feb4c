//! `cuda-ipc gc` (and `ls`, `watch` where they meet the same segments) against real registries and
//! channels made here: what a dead child left is removed, never what a live process holds, in
//! any pid namespace; corrupt segments, FIFOs, links and other users' registries are kept and
//! reported. Child processes as in `cli` (`cli_support`).

mod cli_support;
mod common;

use cli_support::*;
use common::{cuda_ipc, write_segment};
use cuda_ipc::channel::Delivery;
use cuda_ipc::identity::ProcessIdentity;
use cuda_ipc::raw::channel::testing::{ControlConsumer, ControlProducer};
use cuda_ipc::raw::shm::{Segment, SegmentOptions};
use cuda_ipc::registry::inspect as registry_inspect;
use cuda_ipc::registry::{Registry, RegistryOptions};
use std::process::Command;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// `gc` without a NAME removes every leftover of this user, those another test planted and is
/// about to look at included: the tests that run it hold this for writing ([`alone`]), every
/// other test that leaves something for `gc` for reading ([`beside_others`]).
static WHOLE_GC: RwLock<()> = RwLock::new(());

fn alone() -> RwLockWriteGuard<'static, ()> {
    WHOLE_GC.write().unwrap_or_else(|p| p.into_inner())
}

fn beside_others() -> RwLockReadGuard<'static, ()> {
    WHOLE_GC.read().unwrap_or_else(|p| p.into_inner())
}

/// The child side of the two-process tests ([`cli_support::child_role`]).
#[test]
fn child() {
    cli_support::child_role();
}

#[test]
fn gc_removes_a_dead_childs_registry_entries_but_never_a_live_ones() {
    let _gc = beside_others();
    let name = unique("gc-reg");
    let _u = Unlink(name.clone());
    let reg = Registry::create(&name, &RegistryOptions::new().capacity(8)).unwrap();
    reg.publish("mine", 1, b"", b"").unwrap();
    // The living child joins first: `Registry::open` frees dead participants' entries on the way
    // in, so a child joining after the orphan died would leave gc no entry to remove.
    let live = ChildRole::start("registry-live", &name);
    ChildRole::start("registry-orphan", &name).wait();

    // ls flags the leftovers (exit 1) and names the dead owner.
    let o = cuda_ipc(&["ls", &name]);
    let t = text(&o);
    assert_eq!(code(&o), 1, "{t}");
    let orphan = t.lines().find(|l| l.contains("orphan")).expect(&t);
    assert!(orphan.contains("dead"), "{orphan}");
    assert!(
        t.lines()
            .find(|l| l.contains("keeper"))
            .expect(&t)
            .contains("alive")
    );
    assert!(t.contains("cuda-ipc gc"), "{t}");
    let snap = registry_inspect::inspect(&name).unwrap();
    assert_eq!(snap.records.len(), 3);
    assert_eq!(snap.participants.len(), 3);

    // A dry run says what would go and changes nothing.
    let o = cuda_ipc(&["gc", &name, "--dry-run"]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(
        t.contains(&format!("would remove registry {name}: record \"orphan\"")),
        "{t}"
    );
    assert!(t.contains("participant entry"), "{t}");
    assert!(!t.contains("keeper") && !t.contains("\"mine\""), "{t}");
    assert_eq!(registry_inspect::inspect(&name).unwrap(), snap);

    // gc removes the dead child's record and entry, nothing of the living.
    let o = cuda_ipc(&["gc", &name]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(
        t.contains(&format!("removed registry {name}: record \"orphan\"")),
        "{t}"
    );
    assert!(
        t.contains("removed registry") && t.contains("participant entry"),
        "{t}"
    );
    let after = registry_inspect::inspect(&name).unwrap();
    let mut names: Vec<_> = after
        .records
        .iter()
        .map(|r| r.record.name.clone())
        .collect();
    names.sort();
    assert_eq!(names, ["keeper", "mine"]);
    assert_eq!(after.participants.len(), 2, "{after:?}");
    assert!(after.participants.iter().all(|p| !p.dead));
    assert_eq!(code(&cuda_ipc(&["ls", &name])), 0);
    let o = cuda_ipc(&["gc", &name]);
    assert!(text(&o).contains("nothing to remove"), "{}", text(&o));

    // Once killed, the other child's record goes too; ours stays.
    live.kill();
    let o = cuda_ipc(&["gc", &name]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(t.contains("record \"keeper\""), "{t}");
    let after = registry_inspect::inspect(&name).unwrap();
    assert_eq!(after.records.len(), 1);
    assert_eq!(after.records[0].record.name, "mine");
    assert_eq!(after.participants.len(), 1);
    drop(reg);
}

#[test]
fn gc_says_it_removed_a_dead_host_producers_pool_with_its_channel() {
    let _gc = beside_others();
    let dead = unique("gc-host-dead");
    let _u1 = Unlink(format!("cuda-ipc.ch.{dead}"));
    let _u2 = Unlink(format!("cuda-ipc.hp.{dead}"));
    ChildRole::start("host-channel-orphan", &dead).wait();
    let pool = format!("/dev/shm/cuda-ipc.hp.{dead}");
    assert!(std::path::Path::new(&pool).exists());
    let o = cuda_ipc(&["gc", &dead, "--dry-run"]);
    let t = text(&o);
    assert!(t.contains(&format!("would remove channel {dead}")), "{t}");
    assert!(std::path::Path::new(&pool).exists(), "dry run removed it");
    let o = cuda_ipc(&["gc", &dead]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(t.contains(&format!("removed channel {dead}")), "{t}");
    assert!(
        t.contains(&format!(
            "removed host pool {pool} of channel {dead}: its producer"
        )),
        "{t}"
    );
    assert!(!std::path::Path::new(&pool).exists());
}

#[test]
fn gc_removes_a_dead_producers_channel_but_not_a_live_one() {
    let _gc = beside_others();
    let dead = unique("gc-chan-dead");
    let _u1 = Unlink(format!("cuda-ipc.ch.{dead}"));
    let live = unique("gc-chan-live");
    let _u2 = Unlink(format!("cuda-ipc.ch.{live}"));
    ChildRole::start("channel-orphan", &dead).wait();
    let tx = ControlProducer::create(&live, 4096, 2, &[token(1)]).unwrap();

    let o = cuda_ipc(&["ls", &dead]);
    let t = text(&o);
    assert_eq!(code(&o), 1, "{t}");
    assert!(t.contains("dead, open, head 1"), "{t}");
    assert!(t.contains("the producer is dead"), "{t}");

    let o = cuda_ipc(&["gc", &dead, "--dry-run"]);
    assert_eq!(code(&o), 0);
    assert!(
        text(&o).contains(&format!("would remove channel {dead}")),
        "{}",
        text(&o)
    );
    assert!(
        cuda_ipc::channel::inspect::inspect(&dead).is_ok(),
        "dry run removed it"
    );

    let o = cuda_ipc(&["gc", &dead]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(
        t.contains(&format!(
            "removed channel {dead}: segment /dev/shm/cuda-ipc.ch.{dead}"
        )),
        "{t}"
    );
    assert!(
        !cuda_ipc::channel::inspect::list_channels()
            .unwrap()
            .contains(&dead)
    );
    assert_eq!(code(&cuda_ipc(&["ls", &dead])), 1, "gone: not found");

    let o = cuda_ipc(&["gc", &live]);
    assert_eq!(code(&o), 0);
    assert!(text(&o).contains("nothing to remove"), "{}", text(&o));
    assert!(
        cuda_ipc::channel::inspect::inspect(&live).is_ok(),
        "a live producer's channel was removed"
    );
    tx.unlink();
}

#[test]
fn gc_frees_a_dead_consumers_slot_and_holds_on_a_live_producers_channel() {
    let _gc = beside_others();
    let name = unique("gc-consumer");
    let _u = Unlink(format!("cuda-ipc.ch.{name}"));
    let tx = ControlProducer::create(&name, 4096, 4, &[token(1), token(3)]).unwrap();
    let live = ControlConsumer::attach(&name, Delivery::LatestOnly).unwrap();
    let child = ChildRole::start("channel-consumer-orphan", &name);
    let (i, _) = tx.try_acquire().unwrap();
    tx.publish(i, b"").unwrap();
    child.wait();
    // The dead consumer holds frame 1's buffer.
    let v = json(&cuda_ipc(&["ls", &name, "--json"]));
    let cons = v["channels"][0]["consumers"].as_array().unwrap().clone();
    assert_eq!(cons.len(), 2);
    let dead = cons
        .iter()
        .find(|c| c["process"] == "dead")
        .expect("dead consumer listed");
    assert_eq!(dead["holds"], serde_json::json!([i]));
    assert_eq!(v["channels"][0]["leftovers"], true);
    let o = cuda_ipc(&["ls", &name]);
    assert_eq!(code(&o), 1, "{}", text(&o));
    assert!(
        text(&o).contains("dead consumers are attached"),
        "{}",
        text(&o)
    );

    let o = cuda_ipc(&["gc", &name, "--dry-run"]);
    let t = text(&o);
    assert!(
        t.contains(&format!("would remove channel {name}: consumer slot")),
        "{t}"
    );
    assert_eq!(inspect_consumers(&name), 2, "dry run changed the channel");

    let o = cuda_ipc(&["gc", &name]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(
        t.contains(&format!(
            "removed channel {name}: consumer slot {}",
            dead["index"]
        )),
        "{t}"
    );
    assert!(t.contains(&format!("holds on buffers [{i}]")), "{t}");
    let s = cuda_ipc::channel::inspect::inspect(&name).unwrap();
    assert_eq!(s.consumers.len(), 1, "the live consumer stays");
    assert_eq!(s.consumers[0].index, live.slot());
    assert_eq!(s.forced_releases, 1);
    assert!(s.buffers.iter().all(|b| b.hold_mask == 0));
    assert_eq!(code(&cuda_ipc(&["ls", &name])), 0);
    drop(live);
    tx.unlink();
}

#[test]
fn a_corrupt_channel_segment_is_reported_and_never_removed() {
    let _gc = beside_others();
    let name = unique("corrupt");
    let seg_name = format!("cuda-ipc.ch.{name}");
    let _u = Unlink(seg_name.clone());
    drop(Segment::create(&seg_name, 100, &SegmentOptions::new()).unwrap());
    let o = cuda_ipc(&["ls", &name]);
    let t = text(&o);
    assert_eq!(code(&o), 1, "{t}");
    assert!(t.contains(&format!("channel {name}: cannot read")), "{t}");
    let v = json(&cuda_ipc(&["ls", &name, "--json"]));
    assert!(
        v["errors"][0]["error"]
            .as_str()
            .unwrap()
            .contains("smaller than"),
        "{v}"
    );
    let o = cuda_ipc(&["gc", &name]);
    assert_eq!(code(&o), 1, "{}", text(&o));
    assert!(
        Segment::open(&seg_name).is_ok(),
        "gc removed a segment it could not read"
    );
}

#[test]
fn ls_watch_and_gc_never_hang_on_fifos_directories_links_or_sparse_files_and_keep_them() {
    let _gc = alone();
    let base = unique("hostile");
    let fifo = format!("cuda-ipc.ch.{base}-fifo");
    let dir = format!("cuda-ipc.ch.{base}-dir");
    let link = format!("cuda-ipc.ch.{base}-link");
    let sparse = format!("cuda-ipc.ch.{base}-sparse");
    let reg_fifo = format!("{base}-registry-fifo");
    let reg_sparse = format!("{base}-registry-sparse");
    let planted: Vec<Planted> = [&fifo, &dir, &link, &sparse, &reg_fifo, &reg_sparse]
        .iter()
        .map(|n| Planted(n.to_string()))
        .collect();
    let path = |n: &str| format!("/dev/shm/{n}");
    for f in [&fifo, &reg_fifo] {
        let st = Command::new("mkfifo").arg(path(f)).status().unwrap();
        assert!(st.success());
    }
    std::fs::create_dir(path(&dir)).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", path(&link)).unwrap();
    for f in [&sparse, &reg_sparse] {
        write_segment(f, b"").set_len(1 << 20).unwrap();
    }
    let planted_at = Instant::now();
    // Named, each is reported for what it is (before any `gc`: see the end).
    let o = cuda_ipc_bounded(&["ls", &path(&fifo)], false);
    assert!(text(&o).contains("FIFO"), "{}", text(&o));
    let o = cuda_ipc_bounded(&["ls", &path(&dir)], false);
    assert!(text(&o).contains("directory"), "{}", text(&o));
    let o = cuda_ipc_bounded(&["ls", &path(&sparse)], false);
    assert!(text(&o).contains("is sparse"), "{}", text(&o));
    // Every command, over everything and over each name.
    let mut runs: Vec<Vec<String>> = vec![
        vec!["ls".into()],
        vec!["ls".into(), "--json".into()],
        vec!["watch".into(), "--count".into(), "1".into()],
        vec!["gc".into(), "--dry-run".into()],
        vec!["gc".into()],
    ];
    for n in [&fifo, &dir, &link, &sparse, &reg_fifo, &reg_sparse] {
        for n in [n.to_string(), path(n)] {
            runs.push(vec!["ls".into(), n.clone()]);
            runs.push(vec!["gc".into(), n]);
        }
    }
    let mut gc_said = String::new();
    for args in &runs {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = cuda_ipc_bounded(&a, false);
        if a[0] == "gc" {
            gc_said.push_str(&text(&o));
        }
        // Not a crash: an exit status of ours (0, 1), never a signal.
        assert!(
            matches!(o.status.code(), Some(0 | 1)),
            "{a:?}: {:?}\n{}",
            o.status,
            text(&o)
        );
    }
    // And all of it is still there, but for what the rule of abandoned creations lets `gc` take:
    // a sparse segment of this user, its sizing lock free, at least 2 s old is a creation
    // abandoned before its pages were reserved (`gc` said so). Whether the commands above took
    // that long depends on the machine.
    for p in &planted {
        if std::fs::symlink_metadata(path(&p.0)).is_ok() {
            continue;
        }
        assert!(
            (p.0 == sparse || p.0 == reg_sparse)
                && planted_at.elapsed() >= Duration::from_secs(2)
                && gc_said.contains("abandoned"),
            "{} was removed ({:?} after planting); gc said:\n{gc_said}",
            p.0,
            planted_at.elapsed()
        );
    }
}

#[test]
fn gc_in_any_pid_namespace_keeps_a_live_producers_channel_there_and_removes_it_once_killed() {
    let _gc = alone();
    if !unshare_works() {
        return;
    }
    let name = unique("gc-ns");
    let _u = Unlink(format!("cuda-ipc.ch.{name}"));
    // The producer runs in a pid namespace of its own (a container of the same pod).
    let started = Instant::now();
    let mut producer = ChildRole::start_under(
        &["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"],
        "channel-live",
        &name,
    );
    let snap = cuda_ipc::channel::inspect::inspect(&name).unwrap();
    assert_ne!(snap.producer.pid_ns, cuda_ipc::identity::own_pid_ns());
    // From here, and from a third namespace: alive, nothing removed.
    for other in [false, true] {
        let o = cuda_ipc_bounded(&["ls", &name], other);
        assert!(text(&o).contains("alive"), "{}", text(&o));
        let o = cuda_ipc_bounded(&["gc", &name], other);
        assert_eq!(code(&o), 0, "{}", text(&o));
        assert!(text(&o).contains("nothing to remove"), "{}", text(&o));
        assert!(cuda_ipc::channel::inspect::inspect(&name).is_ok());
    }
    // Killed (the namespace's init, which takes the producer with it): gc from another namespace
    // removes the segment, and a later gc the killed process's liveness file.
    let wrapper = producer.0.id();
    let init: u32 = std::fs::read_to_string(format!("/proc/{wrapper}/task/{wrapper}/children"))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        Command::new("kill")
            .args(["-9", &init.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let _ = producer.0.wait();
    let o = cuda_ipc_bounded(&["gc", &name], true);
    assert!(
        text(&o).contains(&format!("removed channel {name}")),
        "{}",
        text(&o)
    );
    let live_file = format!("/dev/shm/{}", snap.producer.liveness_name());
    assert!(
        std::fs::symlink_metadata(&live_file).is_ok(),
        "left by the kill"
    );
    // Liveness files younger than 5 s are never taken for stale.
    if let Some(rest) = Duration::from_millis(5200).checked_sub(started.elapsed()) {
        std::thread::sleep(rest);
    }
    // The fd server socket the kill left (unless a `gc` of a test running beside this one took it
    // already: it has no age guard, its process being known dead).
    let socket = cuda_ipc::ipc::fdpass::socket_path(&snap.producer);
    let socket_left = std::fs::symlink_metadata(&socket).is_ok();
    let o = cuda_ipc_bounded(&["gc"], false);
    assert!(
        text(&o).contains(&format!("removed liveness file {live_file}")),
        "{}",
        text(&o)
    );
    assert!(
        !socket_left || text(&o).contains(&format!("removed fd server socket {socket}")),
        "{}",
        text(&o)
    );
    assert!(std::fs::symlink_metadata(&live_file).is_err(), "removed");
    assert!(std::fs::symlink_metadata(&socket).is_err(), "removed");
}

#[test]
fn gc_removes_a_channel_creation_abandoned_half_way_once_it_is_two_seconds_old() {
    let _gc = beside_others();
    let name = unique("abandoned");
    let seg = format!("cuda-ipc.ch.{name}");
    let _u = Unlink(seg.clone());
    // What a producer killed between `ftruncate` and `fallocate` leaves: sized, no page backed.
    write_segment(&seg, b"").set_len(1 << 20).unwrap();
    // Young: maybe a producer creating it right now. Kept, with why: no problem.
    let o = cuda_ipc_bounded(&["gc", &name], false);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(
        text(&o).contains(&format!(
            "kept channel {name}: a creation under way: empty or sparse"
        )),
        "{}",
        text(&o)
    );
    assert!(std::fs::symlink_metadata(format!("/dev/shm/{seg}")).is_ok());
    std::thread::sleep(Duration::from_millis(2100));
    let o = cuda_ipc_bounded(&["gc", &name, "--dry-run"], false);
    assert!(
        text(&o).contains(&format!(
            "would remove channel {name}: segment /dev/shm/{seg}: a creation abandoned"
        )),
        "{}",
        text(&o)
    );
    assert!(
        std::fs::symlink_metadata(format!("/dev/shm/{seg}")).is_ok(),
        "dry run"
    );
    let o = cuda_ipc_bounded(&["gc", &name], false);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(
        text(&o).contains(&format!("removed channel {name}: segment /dev/shm/{seg}")),
        "{}",
        text(&o)
    );
    assert!(std::fs::symlink_metadata(format!("/dev/shm/{seg}")).is_err());
}

/// A segment open to other users (any of the mode bits 0o007) under a registry's, a channel's or
/// a tensor set's name, though its bytes are those of a creation of ours abandoned half-way (zeros,
/// older than 2 s): the library never makes one, so anyone may have written it. `ls NAME` and
/// `gc NAME` report it as a problem (exit status 1) naming its mode, and `gc` leaves it as it is.
#[test]
fn gc_reports_a_segment_open_to_other_users_as_a_problem_and_leaves_it() {
    use std::os::unix::fs::PermissionsExt as _;
    let _gc = beside_others();
    let [reg, ch, ts] = ["open-reg", "open-ch", "open-ts"].map(unique);
    let cases = [
        ("registry", &reg, reg.clone(), 0o666),
        ("channel", &ch, format!("cuda-ipc.ch.{ch}"), 0o644),
        ("tensorset", &ts, format!("cuda-ipc.ts.{ts}"), 0o604),
    ];
    let _u = cases.clone().map(|(_, _, seg, _)| Unlink(seg));
    for (_, _, seg, mode) in &cases {
        write_segment(seg, &[0u8; 16384]);
        let p = format!("/dev/shm/{seg}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(*mode)).unwrap();
    }
    // Past any creation's grace (2 s, in whole seconds of `st_ctime`).
    std::thread::sleep(Duration::from_millis(3100));
    for (kind, n, seg, mode) in &cases {
        let open = format!("/{seg} has mode {mode:#o}, open to other users");
        for args in [&["ls", n.as_str()][..], &["gc", n, "--dry-run"], &["gc", n]] {
            let o = cuda_ipc_bounded(args, false);
            assert_eq!(code(&o), 1, "{kind}: {args:?}: {}", text(&o));
            assert!(text(&o).contains(&open), "{kind}: {args:?}: {}", text(&o));
            let t = text(&o);
            assert!(
                !t.contains("would remove") && !t.contains("removed"),
                "{kind}: {args:?}: {t}"
            );
        }
        let m = std::fs::metadata(format!("/dev/shm/{seg}")).unwrap();
        assert_eq!(
            (m.len(), m.permissions().mode() & 0o777),
            (16384, *mode),
            "{kind}: left as it was"
        );
    }
}

/// Plants under the control segment name `seg` what a producer killed between sizing the segment
/// and stamping it leaves: `len` bytes of zeros, every page written, with `creator` recorded as
/// the producer (its pid, start time, boot id, pid namespace and uid) where one is given.
fn plant_unstamped_control(seg: &str, len: usize, creator: Option<ProcessIdentity>) {
    use cuda_ipc::raw::channel::layout::header;
    let mut b = vec![0u8; len];
    if let Some(c) = creator {
        let mut put = |at: usize, bytes: &[u8]| b[at..at + bytes.len()].copy_from_slice(bytes);
        put(header::PRODUCER_PID, &c.pid.to_le_bytes());
        put(header::PRODUCER_START_TIME, &c.start_time.to_le_bytes());
        put(header::PRODUCER_BOOT_ID, &c.boot_id);
        put(header::PRODUCER_PID_NS, &c.pid_ns.to_le_bytes());
        put(
            header::PRODUCER_UID,
            &rustix::process::geteuid().as_raw().to_le_bytes(),
        );
    }
    write_segment(seg, &b);
}

/// A process of this pid namespace and boot that ran and is gone (a `true` child, reaped), with
/// a start time no process has: dead, whoever gets its pid next.
fn dead_identity() -> ProcessIdentity {
    let mut child = Command::new("true").spawn().unwrap();
    child.wait().unwrap();
    let dead = ProcessIdentity {
        pid: child.id(),
        start_time: 1,
        ..ProcessIdentity::current().unwrap()
    };
    assert_eq!(dead.liveness(), cuda_ipc::identity::Liveness::Dead);
    dead
}

/// A channel in use (a consumer attached, a frame published) whose init stamp was zeroed and whose
/// producer words were overwritten with a dead process's is no creation abandoned half-way: `gc`
/// reports it as a segment whose header was overwritten, exits 1, and keeps it, where it used to
/// remove it under its users (`--dry-run` said it would).
#[test]
fn gc_reports_a_channel_in_use_whose_stamp_and_producer_were_overwritten_and_keeps_it() {
    use cuda_ipc::raw::channel::layout::header;
    use std::os::unix::fs::FileExt;
    let _gc = beside_others();
    let name = unique("in-use");
    let seg_name = format!("cuda-ipc.ch.{name}");
    let _u = Unlink(seg_name.clone());
    let tokens = [[0u8; cuda_ipc::token::TOKEN_LEN]];
    let tx = ControlProducer::create(&name, 4096, 1, &tokens).unwrap();
    let rx = ControlConsumer::attach(&name, Delivery::EveryFrame).unwrap();
    let (i, _) = tx.try_acquire().unwrap();
    tx.publish(i, b"").unwrap();
    let dead = dead_identity();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/dev/shm/{seg_name}"))
        .unwrap();
    for (at, bytes) in [
        (header::STAMP, &[0u8; 4][..]),
        (header::PRODUCER_PID, &dead.pid.to_le_bytes()[..]),
        (
            header::PRODUCER_START_TIME,
            &dead.start_time.to_le_bytes()[..],
        ),
    ] {
        f.write_all_at(bytes, at as u64).unwrap();
    }
    for args in [&["gc", &name, "--dry-run"][..], &["gc", &name][..]] {
        let o = cuda_ipc(args);
        let t = text(&o);
        assert_eq!(code(&o), 1, "{args:?}: {t}");
        assert!(
            t.contains(&format!("channel {name}: cannot read"))
                && t.contains("in use whose header was overwritten")
                && t.contains("left as it is"),
            "{args:?}: {t}"
        );
        assert!(
            !t.contains("would remove") && !t.contains("removed"),
            "{args:?}: {t}"
        );
    }
    assert!(
        Segment::stat(&seg_name).is_ok(),
        "gc removed a channel in use"
    );
    drop(rx);
    tx.unlink();
}

/// A channel control segment without its stamp whose creator is dead, or that records none and is
/// older than 2 s (a producer killed between sizing it and writing its header, or any such file of
/// zeros of this user's), is a creation abandoned half-way: `ls`, `watch` and `gc NAME` tell it at
/// once, and `gc` removes it, instead of waiting 2 s for a stamp nobody will write at each look.
/// One that records no creator and is younger is still waited for while it is: its producer may
/// be about to record itself.
#[test]
fn ls_watch_and_gc_tell_an_abandoned_channel_creation_at_once_and_wait_for_a_young_one() {
    let _gc = beside_others();
    let [old, dead, young] = ["zeros-old", "zeros-dead", "zeros-young"].map(unique);
    let seg = |n: &str| format!("cuda-ipc.ch.{n}");
    let _u = [&old, &dead, &young].map(|n| Unlink(seg(n)));
    let len = cuda_ipc::raw::channel::layout::segment_len(1, 1);
    plant_unstamped_control(&seg(&old), len, None);
    // `st_ctime` counts whole seconds: more than 2 s by its count.
    std::thread::sleep(Duration::from_millis(3100));
    // Young, but its recorded producer is dead: it never stamps.
    plant_unstamped_control(&seg(&dead), len, Some(dead_identity()));
    for n in [&old, &dead] {
        let at_once = |args: &[&str]| {
            let t = Instant::now();
            let o = cuda_ipc_bounded(args, false);
            let took = t.elapsed();
            assert!(
                took < Duration::from_millis(1500),
                "{args:?} took {took:?}: {}",
                text(&o)
            );
            o
        };
        let o = at_once(&["ls", n]);
        assert_eq!(code(&o), 1, "{}", text(&o));
        assert!(
            text(&o).contains(&format!(
                "channel {n}: cannot read: bad channel segment: {} is a creation abandoned half-way",
                seg(n)
            )),
            "{}",
            text(&o)
        );
        let v = json(&at_once(&["ls", n, "--json"]));
        let e = v["errors"][0]["error"].as_str().unwrap();
        assert!(e.contains("abandoned half-way"), "{v}");
        let o = at_once(&["watch", n, "--count", "1", "--plain"]);
        assert!(text(&o).contains("abandoned half-way"), "{}", text(&o));
        let o = at_once(&["gc", n, "--dry-run"]);
        assert_eq!(code(&o), 0, "{}", text(&o));
        assert!(
            text(&o).contains(&format!(
                "would remove channel {n}: segment /dev/shm/{}: a creation abandoned",
                seg(n)
            )),
            "{}",
            text(&o)
        );
        let o = at_once(&["gc", n]);
        assert_eq!(code(&o), 0, "{}", text(&o));
        assert!(
            text(&o).contains(&format!("removed channel {n}: segment /dev/shm/{}", seg(n))),
            "{}",
            text(&o)
        );
        assert!(std::fs::symlink_metadata(format!("/dev/shm/{}", seg(n))).is_err());
    }
    // Young and no producer recorded: waited for while a producer may still record itself (until
    // it is 2 s old by `st_ctime`'s whole seconds: more than 1 s from now), then said to be
    // abandoned (or unfinished, should the 2 s wait end first).
    plant_unstamped_control(&seg(&young), len, None);
    let t = Instant::now();
    let o = cuda_ipc_bounded(&["ls", &young], false);
    assert!(
        t.elapsed() >= Duration::from_millis(900) && t.elapsed() < Duration::from_millis(2500),
        "{:?}: {}",
        t.elapsed(),
        text(&o)
    );
    assert!(
        text(&o).contains("abandoned half-way") || text(&o).contains("never finished"),
        "{}",
        text(&o)
    );
}

/// Waits until the next whole second has begun: a file made then stays younger than the grace
/// (2 s, counted in whole seconds of `st_ctime`) for almost 2 s, and no older than 2 s by that
/// count for almost 3 s.
fn at_a_second_start() -> Instant {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    std::thread::sleep(Duration::from_nanos(
        1_000_000_000 - u64::from(now.subsec_nanos()) + 20_000_000,
    ));
    Instant::now()
}

/// Plants under the registry name `name` what a registry creator leaves between writing its header
/// and stamping it: the header's magic, layout version and `creator` (with this user's uid), no
/// init stamp, every page written. Offsets: docs/registry-layout.md.
fn plant_unstamped_registry(name: &str, creator: ProcessIdentity) {
    use cuda_ipc::raw::registry_layout::{LAYOUT_VERSION, MAGIC, total_size};
    let (magic, version, creator_uid, creator_words) = (0, 8, 84, 96);
    let mut b = vec![0u8; total_size(8, 8)];
    let mut put = |at: usize, bytes: &[u8]| b[at..at + bytes.len()].copy_from_slice(bytes);
    put(magic, &MAGIC.to_le_bytes());
    put(version, &LAYOUT_VERSION.to_le_bytes());
    put(
        creator_uid,
        &rustix::process::geteuid().as_raw().to_le_bytes(),
    );
    for (i, w) in creator.to_words().iter().enumerate() {
        put(creator_words + 8 * i, &w.to_le_bytes());
    }
    write_segment(name, &b);
}

/// A registry or channel whose creation may still be finished (its creator runs, or it is younger
/// than 2 s) is kept by `gc NAME`, with a line saying why, and exit status 0, as a quota ledger's
/// creation is: a `gc` beside a process creating a registry or a channel does not fail. Nothing
/// of it is removed; once abandoned (older, no creator recorded) `gc` removes the channel's (its
/// name is cuda-ipc's own), never the registry's empty file (a registry's name is anyone's:
/// nothing in it shows a cuda-ipc creation made it).
#[test]
fn gc_keeps_a_registry_or_channel_creation_that_may_still_finish_and_exits_0() {
    let _gc = beside_others();
    let [reg_live, reg_empty, ch_live, ch_sparse, ch_zeros] = [
        "make-reg-live",
        "make-reg-empty",
        "make-ch-live",
        "make-ch-sparse",
        "make-ch-zeros",
    ]
    .map(unique);
    let ch = |n: &str| format!("cuda-ipc.ch.{n}");
    let _u = [
        reg_live.clone(),
        reg_empty.clone(),
        ch(&ch_live),
        ch(&ch_sparse),
        ch(&ch_zeros),
    ]
    .map(Unlink);
    let exists = |seg: &str| std::fs::symlink_metadata(format!("/dev/shm/{seg}")).is_ok();
    let me = ProcessIdentity::current().unwrap();
    let len = cuda_ipc::raw::channel::layout::segment_len(1, 1);
    // Being finished by a creator that runs (this process), at any age.
    plant_unstamped_registry(&reg_live, me);
    plant_unstamped_control(&ch(&ch_live), len, Some(me));
    let kept = |kind: &str, n: &str, seg: &str, why: &str| {
        let o = cuda_ipc_bounded(&["gc", n], false);
        assert_eq!(code(&o), 0, "{kind} {n}: {}", text(&o));
        assert!(
            text(&o).contains(&format!("kept {kind} {n}: {why}")),
            "{kind} {n}: {}",
            text(&o)
        );
        assert!(!text(&o).contains("removed"), "{}", text(&o));
        assert!(exists(seg), "{kind} {n} was removed");
    };
    let runs = format!("a creation under way: not stamped yet, by {me}, which runs");
    kept("registry", &reg_live, &reg_live, &runs);
    kept("channel", &ch_live, &ch(&ch_live), &runs);
    // The same in the JSON form: kept, no problem.
    let v = json(&cuda_ipc_bounded(
        &["gc", &ch_live, "--dry-run", "--json"],
        false,
    ));
    assert_eq!(v["problems"], serde_json::json!([]), "{v:#}");
    assert_eq!(v["leftovers"], serde_json::json!([]), "{v:#}");
    assert_eq!(
        v["kept"],
        serde_json::json!([{
            "what": format!("channel {ch_live}: {runs}"),
            "why": null,
            "leftover": null,
        }]),
        "{v:#}"
    );

    // Young, without a creator recorded: an empty registry file (its creator before
    // `ftruncate`), a sparse channel segment (before `fallocate`), and a channel segment of zeros
    // (before its producer recorded itself; `gc` waits for its stamp while it may still come, as
    // every look does).
    let unsized_young = "a creation under way: empty or sparse, younger than 2 s";
    let planted = at_a_second_start();
    write_segment(&reg_empty, b"");
    let o = cuda_ipc_bounded(&["gc", &reg_empty], false);
    if planted.elapsed() < Duration::from_millis(1900) {
        assert_eq!(code(&o), 0, "{}", text(&o));
        assert!(
            text(&o).contains(&format!("kept registry {reg_empty}: {unsized_young}")),
            "{}",
            text(&o)
        );
        assert!(exists(&reg_empty));
    }
    let planted = at_a_second_start();
    write_segment(&ch(&ch_sparse), b"")
        .set_len(len as u64)
        .unwrap();
    let o = cuda_ipc_bounded(&["gc", &ch_sparse], false);
    if planted.elapsed() < Duration::from_millis(1900) {
        assert_eq!(code(&o), 0, "{}", text(&o));
        assert!(
            text(&o).contains(&format!("kept channel {ch_sparse}: {unsized_young}")),
            "{}",
            text(&o)
        );
        assert!(exists(&ch(&ch_sparse)));
    }
    // Waited for until it is 2 s old by `st_ctime`'s whole seconds (the stamp may come until
    // then), then abandoned, as an empty one of that age: removed, no problem.
    let planted = at_a_second_start();
    plant_unstamped_control(&ch(&ch_zeros), len, None);
    let o = cuda_ipc_bounded(&["gc", &ch_zeros], false);
    let took = planted.elapsed();
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_millis(2900),
        "{took:?}: {}",
        text(&o)
    );
    assert!(
        text(&o).contains(&format!(
            "removed channel {ch_zeros}: segment /dev/shm/{}: a creation abandoned",
            ch(&ch_zeros)
        )),
        "{}",
        text(&o)
    );
    assert!(!exists(&ch(&ch_zeros)));

    // Older, nobody recorded: the channel's is abandoned, removed; the registry's empty file is
    // no registry (no magic), a problem, left as it is. The live creator's stay.
    std::thread::sleep(Duration::from_millis(3100));
    let o = cuda_ipc_bounded(&["gc", &ch_sparse], false);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(text(&o).contains("removed"), "{ch_sparse}: {}", text(&o));
    assert!(!exists(&ch(&ch_sparse)), "{ch_sparse}");
    let o = cuda_ipc_bounded(&["gc", &reg_empty], false);
    assert_eq!(code(&o), 1, "{}", text(&o));
    assert!(
        text(&o).contains(&format!(
            "registry {reg_empty}: cannot read: shared-memory segment /{reg_empty} is not a \
             cuda-ipc registry: no magic (empty); left as it is"
        )),
        "{}",
        text(&o)
    );
    assert!(!text(&o).contains("removed"), "{}", text(&o));
    assert!(exists(&reg_empty), "{reg_empty}");
    kept("registry", &reg_live, &reg_live, &runs);
    kept("channel", &ch_live, &ch(&ch_live), &runs);
}

/// A file of another program under a name `gc NAME` takes for a registry's (a registry's segment
/// name is its own name, any name), without the registry magic, older than the 2 s grace: a
/// `multiprocessing.shared_memory` segment (0600, sized with `ftruncate`: sparse, its first 128
/// bytes zero, data at offset 200000, its owner running) and a file of zeros, every page written.
/// Nothing in either shows that a cuda-ipc creation made it, so neither is removed, by `gc NAME`,
/// `gc /dev/shm/NAME` (each a problem, exit status 1, saying what it is) or `gc` (which finds
/// registries by their magic); `ls NAME` says the same. A registry creation that records its
/// creator, now dead (the magic, no stamp), is still removed by `gc NAME`.
#[test]
fn gc_never_removes_another_programs_file_without_the_registry_magic_named_or_not() {
    use std::os::unix::fs::FileExt as _;
    let _gc = alone();
    let [psm, zeros, dead] = ["psm_demo", "app2", "reg-abandoned"].map(unique);
    let _u = [&psm, &zeros, &dead].map(|n| Unlink(n.clone()));
    let path = |n: &str| format!("/dev/shm/{n}");
    let data = b"the live data of another program";
    // Held open by its owner (this test) throughout, as the live program holds its segment.
    let psm_file = write_segment(&psm, b"");
    psm_file.set_len(1 << 20).unwrap();
    psm_file.write_all_at(data, 200_000).unwrap();
    let _zeros_file = write_segment(&zeros, &vec![0u8; 1 << 16]);
    plant_unstamped_registry(&dead, dead_identity());
    // `st_ctime` counts whole seconds: more than 2 s by its count (it cannot be set back).
    std::thread::sleep(Duration::from_millis(3100));
    let intact = |n: &str| {
        let m = std::fs::metadata(path(n)).unwrap_or_else(|e| panic!("{n} was removed: {e}"));
        if n == psm {
            assert_eq!(m.len(), 1 << 20);
            let mut b = vec![0u8; data.len()];
            std::fs::File::open(path(n))
                .unwrap()
                .read_exact_at(&mut b, 200_000)
                .unwrap();
            assert_eq!(&b[..], &data[..], "{n}: its data changed");
        } else {
            assert_eq!(m.len(), 1 << 16);
        }
    };
    for (n, what) in [(&psm, "sparse"), (&zeros, "zero where the magic goes")] {
        let said = format!(
            "registry {n}: cannot read: shared-memory segment /{n} is not a cuda-ipc registry: \
             no magic ({what}); left as it is (remove it if no program uses it)"
        );
        let p = path(n);
        for args in [
            vec!["gc", n.as_str()],
            vec!["gc", &p],
            vec!["gc", "--dry-run", n.as_str()],
            vec!["ls", n.as_str()],
            vec!["ls", &p],
        ] {
            let o = cuda_ipc_bounded(&args, false);
            assert_eq!(code(&o), 1, "{args:?}: {}", text(&o));
            assert!(text(&o).contains(&said), "{args:?}: {}", text(&o));
            for removal in ["removed ", "would remove "] {
                assert!(!text(&o).contains(removal), "{args:?}: {}", text(&o));
            }
            assert!(
                !text(&o).contains("not initialised"),
                "{args:?}: {}",
                text(&o)
            );
            intact(n);
        }
        let v = json(&cuda_ipc_bounded(&["gc", &path(n), "--json"], false));
        assert_eq!(v["removed"], serde_json::json!([]), "{v:#}");
        assert_eq!(v["leftovers"], serde_json::json!([]), "{v:#}");
        assert_eq!(
            v["problems"],
            serde_json::json!([{
                "subject": format!("registry {n}"),
                "doing": "cannot read",
                "error": said.split_once(": cannot read: ").unwrap().1,
            }]),
            "{v:#}"
        );
        intact(n);
    }
    // A registry creation that records its dead creator is a leftover, named.
    let o = cuda_ipc_bounded(&["gc", &dead], false);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(
        text(&o).contains(&format!(
            "removed registry {dead}: segment /dev/shm/{dead}: a creation abandoned by its dead \
             creator"
        )),
        "{}",
        text(&o)
    );
    assert!(std::fs::symlink_metadata(path(&dead)).is_err());
    // Without a NAME: not even looked at (no magic), as before.
    for args in [["gc", "--dry-run"], ["gc", "--json"]] {
        let o = cuda_ipc_bounded(&args, false);
        for n in [&psm, &zeros] {
            assert!(!text(&o).contains(n.as_str()), "{args:?}: {}", text(&o));
        }
    }
    let o = cuda_ipc_bounded(&["gc"], false);
    for n in [&psm, &zeros] {
        assert!(!text(&o).contains(n.as_str()), "gc: {}", text(&o));
        intact(n);
    }
    drop(psm_file);
}

#[test]
fn ls_and_gc_leave_registries_of_other_users_out_instead_of_failing_on_them() {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root to give a registry to another uid");
        return;
    }
    let name = unique("theirs");
    let _u = Unlink(name.clone());
    drop(Registry::create(&name, &RegistryOptions::new().capacity(4)).unwrap());
    let path = format!("/dev/shm/{name}");
    let st = Command::new("chown")
        .args(["54321", &path])
        .status()
        .unwrap();
    assert!(st.success());
    assert!(!registry_inspect::list_registries().unwrap().contains(&name));
    for args in [&["ls"][..], &["gc", "--dry-run"][..]] {
        let o = cuda_ipc_bounded(args, false);
        assert!(!text(&o).contains(&name), "{args:?}: {}", text(&o));
    }
    // Named, it says whose it is.
    let o = cuda_ipc_bounded(&["ls", &name], false);
    assert_eq!(code(&o), 1);
    assert!(text(&o).contains("owned by uid 54321"), "{}", text(&o));
}

/// A channel and a tensor set made and closed normally, over and over, while `ls`, `watch` and
/// `gc` (each form, with and without the NAME) read them: one closed between the listing and the
/// reading is gone, not a problem. No line about either says `cannot read`, names a channel or a
/// producer for the set, or calls its generation not known; a command given the NAME exits 0, or 1
/// only because the name was not there when it looked.
#[test]
fn ls_watch_and_gc_take_an_object_closed_while_they_read_it_for_gone_not_a_problem() {
    use cuda_ipc::channel::{ChannelOptions, Producer};
    use cuda_ipc::tensorset::{DType, TensorSetOptions, TensorSetWriter, TensorSpec};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    // Plain `gc` runs here: nothing else of this binary may plant meanwhile.
    let _gc = alone();
    let ch = unique("closing-ch");
    let ts = unique("closing-ts");
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (ch, ts, stop) = (ch.clone(), ts.clone(), stop.clone());
        std::thread::spawn(move || {
            let spec = [TensorSpec::new("w", DType::U8, &[8])];
            let mut rounds = 0u64;
            // Relaxed: a flag alone.
            while !stop.load(Ordering::Relaxed) {
                drop(Producer::create_host(&ch, &ChannelOptions::new(4096).buffers(2)).unwrap());
                drop(TensorSetWriter::create_host(&ts, &spec, &TensorSetOptions::new()).unwrap());
                rounds += 1;
            }
            rounds
        })
    };
    let named: Vec<Vec<&str>> = [&ch, &ts]
        .iter()
        .flat_map(|n| {
            [
                vec!["ls", n.as_str()],
                vec!["ls", "--json", n.as_str()],
                vec!["watch", "--plain", "--count", "1", n.as_str()],
                vec!["gc", "--dry-run", n.as_str()],
                vec!["gc", n.as_str()],
            ]
        })
        .collect();
    let whole: Vec<Vec<&str>> = vec![
        vec!["ls"],
        vec!["ls", "--json"],
        vec!["gc", "--dry-run"],
        vec!["gc", "--json"],
        vec!["gc"],
    ];
    let bad = [
        "cannot",
        "problem",
        "start its producer",
        "no channel named",
        "not known",
        "channel_problem\": \"",
    ];
    let mut wrong = Vec::new();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(6) && wrong.len() < 5 {
        for args in named.iter().chain(&whole) {
            let o = cuda_ipc(args);
            let out = text(&o);
            let mine = |l: &&str| l.contains(ch.as_str()) || l.contains(ts.as_str());
            let not_there = "no registry, channel or tensor set named";
            for l in out.lines().filter(mine) {
                if bad.iter().any(|b| l.contains(b)) && !l.contains(not_there) {
                    wrong.push(format!("{args:?}: {l}"));
                }
            }
            if named.contains(args) && !(code(&o) == 0 || code(&o) == 1 && out.contains(not_there))
            {
                wrong.push(format!("{args:?}: exit status {}: {out}", code(&o)));
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = churn.join().unwrap();
    assert!(rounds > 0);
    assert!(wrong.is_empty(), "{rounds} rounds:\n{}", wrong.join("\n"));
}

/// A killed process's liveness file younger than 5 s is kept by `gc` (its lock is free, but a
/// process starting up has a free lock too, for the microseconds between making and locking its
/// file: docs/decisions.md), and said: a `kept` line in the text form and a `kept` entry in the
/// JSON form, instead of a silent `nothing to remove`.
#[test]
fn gc_says_it_keeps_a_killed_processs_liveness_file_younger_than_five_seconds() {
    let _gc = alone();
    let name = unique("young-live");
    let _u = Unlink(format!("cuda-ipc.ch.{name}"));
    let child = ChildRole::start("channel-live", &name);
    let pid = child.0.id();
    child.kill();
    let made = Instant::now();
    let of_child = format!("of pid {pid}");
    let o = cuda_ipc(&["gc", "--dry-run"]);
    let t = text(&o);
    let dry = cuda_ipc(&["gc", "--json"]);
    let young = made.elapsed() < Duration::from_secs(4);
    // The file, gone or not: this test's child is dead.
    for e in std::fs::read_dir("/dev/shm").unwrap().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with("cuda-ipc.live.") && n.contains(&format!(".{pid}.")) {
            let _ = std::fs::remove_file(e.path());
        }
    }
    if !young {
        println!("skipped: the machine took more than 4 s; the file may have come of age");
        return;
    }
    assert_eq!(code(&o), 0, "{t}");
    let line = t
        .lines()
        .find(|l| l.starts_with("kept liveness file") && l.contains(&of_child))
        .unwrap_or_else(|| panic!("no kept line for the child's liveness file:\n{t}"));
    assert!(line.contains("younger than 5 s"), "{line}");
    let j = json(&dry);
    assert_eq!(code(&dry), 0, "{j}");
    let kept = j["kept"].as_array().unwrap();
    assert!(
        kept.iter().any(|k| {
            let what = k["what"].as_str().unwrap_or("");
            what.starts_with("liveness file") && what.contains(&of_child)
        }),
        "{j}"
    );
}

/// Every kind of a tensor set's part standing without its manifest (generation channel `.tg.`,
/// host data `.td.`, holders `.th.`), empty as a creator killed before sizing it leaves it, is
/// judged by one rule: young, `ls` says `gc` keeps it for now and `gc` keeps it with no problem
/// (exit status 0 from both); once 2 s old, both say it is a creation abandoned half-way, and
/// `gc` removes it. An empty generation channel or holders segment was "cannot judge" (`gc`:
/// "cannot read", exit status 1) where an empty host data segment was kept.
#[test]
fn every_empty_part_of_a_set_without_its_manifest_is_judged_by_its_age_in_ls_and_gc() {
    let _gc = beside_others();
    let parts = [
        ("cuda-ipc.tg.", "generation channel"),
        ("cuda-ipc.td.", "host data"),
        ("cuda-ipc.th.", "holders"),
    ];
    let sets: Vec<String> = (0..parts.len())
        .map(|k| unique(&format!("ts-empty-part{k}")))
        .collect();
    let segs: Vec<String> = parts
        .iter()
        .zip(&sets)
        .map(|((prefix, _), set)| format!("{prefix}{set}"))
        .collect();
    let _u: Vec<Unlink> = segs.iter().map(|s| Unlink(s.clone())).collect();
    let planted = at_a_second_start();
    for s in &segs {
        write_segment(s, &[]);
    }
    let young: Vec<_> = sets
        .iter()
        .map(|set| {
            (
                cuda_ipc(&["ls", "--json", set]),
                cuda_ipc(&["gc", "--json", set]),
            )
        })
        .collect();
    if planted.elapsed() < Duration::from_millis(1800) {
        for ((set, (_, word)), (ls, gc)) in sets.iter().zip(&parts).zip(&young) {
            let (l, g) = (json(ls), json(gc));
            assert_eq!(code(ls), 0, "{word}: {l}");
            let part = &l["sets_without_manifest"][0]["parts"][0];
            assert_eq!(part["part"], *word, "{l}");
            assert_eq!(
                (&part["gc"], &part["young"]),
                (&"keeps".into(), &true.into()),
                "a young empty {word} part of {set}: {l}"
            );
            assert_eq!(code(gc), 0, "a young empty {word} part of {set}: {g}");
            assert_eq!(g["problems"], serde_json::json!([]), "{word}: {g}");
            assert_eq!(g["removed"], serde_json::json!([]), "{word}: {g}");
            // Kept with a line saying why, as a registry's or channel's creation under way.
            let kept = g["kept"].as_array().unwrap();
            assert!(
                kept.iter().any(|k| k["what"]
                    .as_str()
                    .is_some_and(|w| w.contains(set.as_str()) && w.contains("younger than 2 s"))),
                "a young empty {word} part of {set} kept without a line: {g}"
            );
        }
    } else {
        println!("young checks skipped: the machine took more than 1.8 s");
    }
    std::thread::sleep(Duration::from_millis(3100).saturating_sub(planted.elapsed()));
    for ((set, seg), (_, word)) in sets.iter().zip(&segs).zip(&parts) {
        let ls = cuda_ipc(&["ls", "--json", set]);
        let l = json(&ls);
        assert_eq!(code(&ls), 1, "{l}");
        let part = &l["sets_without_manifest"][0]["parts"][0];
        assert_eq!(
            (&part["part"], &part["gc"], &part["young"]),
            (&(*word).into(), &"removes".into(), &false.into()),
            "an old empty {word} part of {set}: {l}"
        );
        let why = part["why"].as_str().unwrap();
        assert_eq!(why, "a creation abandoned before its pages were reserved");
        let gc = cuda_ipc(&["gc", set]);
        let t = text(&gc);
        assert_eq!(code(&gc), 0, "{t}");
        assert!(
            t.contains(&format!(
                "removed tensorset {set}: {word} /dev/shm/{seg} (0 bytes): {why}"
            )),
            "{t}"
        );
        assert!(
            std::fs::symlink_metadata(format!("/dev/shm/{seg}")).is_err(),
            "{seg} left"
        );
    }
}

/// Parts of a tensor set standing without its manifest (a writer killed half-way, or a set being
/// made): `ls` names them as parts of a set without one, each with what `gc` does with it, the
/// same in text and JSON; a young one is kept "for now" (the judgement depends on its age, and
/// `ls` says so), a creation abandoned is removed (exit status 1, as for other leftovers), and
/// `gc --dry-run` agrees. Never `cannot read: no tensor set named`.
#[test]
fn ls_describes_a_tensor_sets_parts_without_its_manifest_as_gc_judges_them() {
    let _gc = beside_others();
    let young = unique("ts-parts-young");
    let old = unique("ts-parts-old");
    let td = format!("cuda-ipc.td.{young}");
    let th = format!("cuda-ipc.th.{old}");
    let _u = [Unlink(td.clone()), Unlink(th.clone())];
    // A holders segment sized, with no header: a creation abandoned (no creator recorded) once
    // it is 2 s old, whatever its age here (its header says nothing of a creator that runs).
    write_segment(&th, &vec![0u8; 64 << 10]);
    // An empty host data segment: a creator may be sizing it, for 2 s.
    let planted = at_a_second_start();
    write_segment(&td, &[]);

    let o = cuda_ipc(&["ls", &young]);
    let j = json(&cuda_ipc(&["ls", "--json", &young]));
    let in_time = planted.elapsed() < Duration::from_millis(1800);
    let t = text(&o);
    assert!(!t.contains("cannot read"), "{t}");
    assert!(
        t.contains(&format!("tensorset {young}: no manifest")),
        "{t}"
    );
    let set = &j["sets_without_manifest"][0];
    assert_eq!(set["name"], young.as_str(), "{j}");
    let part = &set["parts"][0];
    assert_eq!(part["part"], "host data", "{j}");
    assert_eq!(part["segment"], td.as_str(), "{j}");
    if in_time {
        assert_eq!(code(&o), 0, "{t}");
        assert!(
            t.contains(&format!("host data /dev/shm/{td} (0 B, "))
                && t.contains("`cuda-ipc gc` keeps it for now: younger than 2 s"),
            "{t}"
        );
        assert_eq!(
            (&part["gc"], &part["young"]),
            (&"keeps".into(), &true.into()),
            "{j}"
        );
        assert!(
            part["why"]
                .as_str()
                .unwrap()
                .starts_with("younger than 2 s"),
            "{j}"
        );
    }

    let o = cuda_ipc(&["ls", &old]);
    let t = text(&o);
    let j = json(&cuda_ipc(&["ls", "--json", &old]));
    assert_eq!(code(&o), 1, "{t}");
    let part = &j["sets_without_manifest"][0]["parts"][0];
    let why = part["why"].as_str().unwrap();
    assert_eq!(
        (&part["part"], &part["gc"]),
        (&"holders".into(), &"removes".into()),
        "{j}"
    );
    assert!(
        t.contains(&format!("holders /dev/shm/{th} (64.0 KiB, "))
            && t.contains(&format!("`cuda-ipc gc` removes it: {why}")),
        "{t}"
    );
    let d = text(&cuda_ipc(&["gc", "--dry-run", &old]));
    assert!(
        d.contains(&format!(
            "would remove tensorset {old}: holders /dev/shm/{th}"
        )) && d.contains(why),
        "{d}"
    );
}

/// Whatever stands under one of our names and blocks a creation there is shown by `ls` (without a
/// NAME and of its NAME) and reported by `gc` (without a NAME and of its NAME), and never removed
/// unless it is ours and abandoned: a host pool name without its channel's control segment that
/// holds no pool (foreign bytes, a FIFO, a symbolic link, a directory) is a problem of both, a
/// young empty or sparse one a creation `gc` keeps with a line saying why (exit status 0); a FIFO,
/// link or directory under a tensor set's part or a channel's control segment name is a problem
/// of `ls` and `gc` without a NAME too, not only of their NAME. They were invisible: `ls` said
/// there was nothing, `ls NAME` that nothing had that name, and `gc` that it had nothing to
/// remove, while the producer or writer they blocked failed.
#[test]
fn whatever_blocks_a_creation_under_our_names_is_shown_by_ls_and_reported_by_gc() {
    let _gc = alone();
    let base = unique("blocker");
    let path = |seg: &str| format!("/dev/shm/{seg}");
    enum What {
        Garbage,
        Fifo,
        Link,
        Dir,
        Empty,
        Sparse,
    }
    // (the segment name, the NAME `ls` and `gc` take, what stands there, the words they say)
    let cases: Vec<(String, String, What, &str)> = vec![
        ("hp", "garbage", What::Garbage, "not a cuda-ipc host pool"),
        ("hp", "fifo", What::Fifo, "is a FIFO"),
        ("hp", "link", What::Link, "symbolic link"),
        ("hp", "dir", What::Dir, "is a directory"),
        ("hp", "empty", What::Empty, "a creation under way"),
        ("hp", "sparse", What::Sparse, "a creation under way"),
        ("tg", "tg-fifo", What::Fifo, "is a FIFO"),
        ("td", "td-link", What::Link, "symbolic link"),
        ("th", "th-dir", What::Dir, "is a directory"),
        ("ts", "ts-fifo", What::Fifo, "is a FIFO"),
        ("ch", "ch-fifo", What::Fifo, "is a FIFO"),
        ("ch", "ch-dir", What::Dir, "is a directory"),
    ]
    .into_iter()
    .map(|(prefix, tag, what, words)| {
        let name = format!("{base}-{tag}");
        (format!("cuda-ipc.{prefix}.{name}"), name, what, words)
    })
    .collect();
    let _planted: Vec<Planted> = cases.iter().map(|c| Planted(c.0.clone())).collect();
    let planted = at_a_second_start();
    for (seg, _, what, _) in &cases {
        match what {
            What::Garbage => drop(write_segment(seg, &[0xa5; 8192])),
            What::Fifo => assert!(
                Command::new("mkfifo")
                    .args(["-m", "600", &path(seg)])
                    .status()
                    .unwrap()
                    .success()
            ),
            What::Link => std::os::unix::fs::symlink("/nonexistent", path(seg)).unwrap(),
            What::Dir => std::fs::create_dir(path(seg)).unwrap(),
            What::Empty => drop(write_segment(seg, &[])),
            What::Sparse => write_segment(seg, &[]).set_len(8192).unwrap(),
        }
    }
    let young = |what: &What| matches!(what, What::Empty | What::Sparse);
    // Without a NAME: every one shown, and every one but the young reported as a problem.
    let ls = cuda_ipc_bounded(&["ls"], false);
    let dry = cuda_ipc_bounded(&["gc", "--dry-run"], false);
    let gc = cuda_ipc_bounded(&["gc"], false);
    let in_time = planted.elapsed() < Duration::from_millis(1800);
    for (run, o) in [("ls", &ls), ("gc --dry-run", &dry), ("gc", &gc)] {
        let t = text(o);
        assert_eq!(code(o), 1, "{run}: {t}");
        for (seg, _, what, words) in &cases {
            if young(what) && !in_time {
                continue;
            }
            assert!(
                t.lines()
                    .any(|l| l.contains(seg.as_str()) && l.contains(words)),
                "{run} says nothing of {seg} ({words}):\n{t}"
            );
        }
    }
    // Of each NAME: shown and reported, the young kept with exit status 0.
    for (seg, name, what, words) in &cases {
        for args in [["ls", name.as_str()], ["gc", name.as_str()]] {
            let o = cuda_ipc_bounded(&args, false);
            let t = text(&o);
            if young(what) && planted.elapsed() >= Duration::from_millis(1800) {
                continue;
            }
            assert!(
                t.contains(seg.as_str()) && t.contains(words),
                "{args:?}: {t}"
            );
            assert!(
                !t.contains("no registry, channel or tensor set"),
                "{args:?}: {t}"
            );
            assert_eq!(code(&o), if young(what) { 0 } else { 1 }, "{args:?}: {t}");
        }
    }
    // None was removed, but what the rule of abandoned creations lets `gc` take once 2 s old.
    for (seg, _, what, _) in &cases {
        let there = std::fs::symlink_metadata(path(seg)).is_ok();
        assert!(
            there || (young(what) && planted.elapsed() >= Duration::from_secs(2)),
            "{seg} was removed"
        );
    }
}

/// The path of a channel's or tensor set's part given as NAME (`/dev/shm/cuda-ipc.ts.X`) names
/// that channel or set, never a registry of that name: `gc cuda-ipc.ts.X` printed "registry
/// cuda-ipc.ts.X: cannot read: ... not a cuda-ipc registry" (exit status 1), and `ls` the same
/// beside the set. A process's own file (a liveness file) given as NAME is refused saying what it
/// is. (An own name is never read for a prefix: `cli_names`.)
#[test]
fn a_parts_path_names_its_channel_or_set_and_a_process_file_is_refused_clearly() {
    use cuda_ipc::channel::{ChannelOptions, Producer};
    use cuda_ipc::tensorset::{DType, TensorSetOptions, TensorSetWriter, TensorSpec};
    let _gc = beside_others();
    let ch = unique("part-names-ch");
    let ts = unique("part-names-ts");
    let _tx = Producer::create_host(&ch, &ChannelOptions::new(4096).buffers(2)).unwrap();
    let _w = TensorSetWriter::create_host(
        &ts,
        &[TensorSpec::new("w", DType::F32, &[4])],
        &TensorSetOptions::new(),
    )
    .unwrap();
    let names = [
        (
            format!("/dev/shm/cuda-ipc.ch.{ch}"),
            format!("channel {ch}:"),
        ),
        (
            format!("/dev/shm/cuda-ipc.hp.{ch}"),
            format!("channel {ch}:"),
        ),
        (
            format!("/dev/shm/cuda-ipc.ts.{ts}"),
            format!("tensorset {ts}:"),
        ),
        (
            format!("/dev/shm/cuda-ipc.tg.{ts}"),
            format!("tensorset {ts}:"),
        ),
        (
            format!("/dev/shm/cuda-ipc.td.{ts}"),
            format!("tensorset {ts}:"),
        ),
    ];
    for (n, shown) in &names {
        let gc = cuda_ipc_bounded(&["gc", "--dry-run", n], false);
        let ls = cuda_ipc_bounded(&["ls", n], false);
        for (what, o) in [("gc", &gc), ("ls", &ls)] {
            let t = text(o);
            assert_eq!(code(o), 0, "{what} {n}: {t}");
            assert!(!t.contains("registry"), "{what} {n}: {t}");
        }
        assert!(
            text(&ls).starts_with(shown.as_str()),
            "ls {n}: {}",
            text(&ls)
        );
        assert_eq!(text(&gc).trim(), "nothing to remove", "gc {n}");
    }
    let me = ProcessIdentity::current().unwrap();
    for args in [["gc", &me.liveness_name()], ["ls", &me.liveness_name()]] {
        let o = cuda_ipc_bounded(&args, false);
        assert_eq!(code(&o), 1, "{args:?}: {}", text(&o));
        assert!(
            text(&o)
                .contains("is a process's liveness file, not a registry, channel or tensor set"),
            "{args:?}: {}",
            text(&o)
        );
    }
}
