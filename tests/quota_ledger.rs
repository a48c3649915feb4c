//! The quota ledger across processes: two producers racing for the last bytes (exactly one wins,
//! the other's `OverQuota` names the winner), a holder killed with SIGKILL (its bytes come back
//! within 1 s), a holder killed while it held the ledger lock half-way through an entry (the next
//! locker repairs it), and hostile segments under a ledger's name (garbage, foreign, truncated,
//! another version, a FIFO, another user's) and a group ledger cut short under its users'
//! mappings: each a clear error, nothing removed. The children are
//! this test binary re-executed (tests/common).

mod common;

use common::{Peer, parent_lines, role, tell};
use cuda_ipc::channel::{ChannelOptions, Producer};
use cuda_ipc::cleanup::{self, Scope};
use cuda_ipc::driver::Uuid;
use cuda_ipc::quota::{QuotaError, QuotaLedger, QuotaScope, UNLIMITED};
use cuda_ipc::raw::quota_test_hooks::{QuotaTestPoint, set_test_hook};
use cuda_ipc::{Error, ShmError};
use std::ffi::CString;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

const DEVICE: &str = "CUDA_IPC_TEST_QUOTA_DEVICE";
const T: Duration = Duration::from_secs(20);

/// A device UUID of this process and call, so parallel tests never share a ledger.
fn device() -> Uuid {
    static N: AtomicU32 = AtomicU32::new(0);
    let mut d = [0u8; 16];
    d[..4].copy_from_slice(b"test");
    d[4..8].copy_from_slice(&std::process::id().to_le_bytes());
    d[8..12].copy_from_slice(&N.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    Uuid(d)
}

fn path(name: &str) -> String {
    format!("/dev/shm/{name}")
}

/// Removes a ledger's name when dropped.
struct Gone(String);
impl Drop for Gone {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(path(&self.0));
    }
}

fn child_device() -> Uuid {
    std::env::var(DEVICE).unwrap().parse().unwrap()
}

/// The host-memory ledger (all-zero UUID) is shared by every host channel of this user: the one
/// test that uses it skips when a real budget is set there.
#[test]
fn two_producers_racing_for_the_last_bytes_exactly_one_wins() {
    const TEST: &str = "two_producers_racing_for_the_last_bytes_exactly_one_wins";
    if role().as_deref() == Some("racer") {
        let name = std::env::var("CUDA_IPC_TEST_QUOTA_CHANNEL").unwrap();
        let opts = ChannelOptions::new(100)
            .buffers(4)
            .quota(QuotaScope::user());
        tell("ready");
        let _go = parent_lines().next();
        match Producer::create_host(&name, &opts) {
            Ok(p) => {
                tell("won");
                // Hold the pool (and its bytes) until the parent has seen both answers.
                let _ = parent_lines().next();
                drop(p);
            }
            Err(Error::Quota(QuotaError::OverQuota { used, holders, .. })) => {
                let pids: Vec<u32> = holders.iter().map(|h| h.pid).collect();
                tell(format!("over {used} {pids:?}"));
                let _ = parent_lines().next();
            }
            Err(e) => tell(format!("error {e}")),
        }
        return;
    }
    let host = Uuid([0; 16]);
    let ledger_name = QuotaScope::user().segment_name(host);
    if std::fs::metadata(path(&ledger_name)).is_ok() {
        println!("skipped: a host-memory budget is set for this user ({ledger_name}); left alone");
        return;
    }
    let _g = Gone(ledger_name);
    // Room for one pool of 4 × 100 bytes, not two.
    let ledger = QuotaLedger::set_budget(QuotaScope::user(), host, 600).unwrap();
    for round in 0..8 {
        let names = [0, 1].map(|i| format!("quota-race-{}-{round}-{i}", std::process::id()));
        let mut peers: Vec<Peer> = names
            .iter()
            .map(|n| Peer::spawn(TEST, "racer", &[("CUDA_IPC_TEST_QUOTA_CHANNEL", n)]))
            .collect();
        for p in &mut peers {
            p.expect("ready", T);
        }
        for p in &mut peers {
            p.send("go");
        }
        let answers: Vec<String> = peers.iter_mut().map(|p| p.recv(T)).collect();
        let winners: Vec<usize> = (0..2).filter(|i| answers[*i] == "won").collect();
        assert_eq!(winners.len(), 1, "round {round}: {answers:?}");
        let w = winners[0];
        let winner_pid = peers[w].child.id();
        assert_eq!(
            answers[1 - w],
            format!("over 400 [{winner_pid}]"),
            "round {round}: the loser's error names the winner and its 400 bytes"
        );
        let s = ledger.snapshot().unwrap();
        assert_eq!(s.used, 400, "round {round}");
        assert_eq!(s.holders[0].identity.pid, winner_pid);
        for p in &mut peers {
            p.send("done");
        }
        for p in peers {
            p.finish(T);
        }
        // The winner closed its producer: the bytes are back.
        assert_eq!(ledger.snapshot().unwrap().used, 0, "round {round}");
    }
}

#[test]
fn a_killed_holders_bytes_come_back_within_a_second() {
    const TEST: &str = "a_killed_holders_bytes_come_back_within_a_second";
    if role().as_deref() == Some("holder") {
        let l = QuotaLedger::open(QuotaScope::user(), child_device()).unwrap();
        let _r = l.reserve(1000).unwrap();
        tell("held");
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
    let d = device();
    let ledger = QuotaLedger::set_budget(QuotaScope::user(), d, 1000).unwrap();
    let _g = Gone(ledger.name().to_string());
    let mut peer = Peer::spawn(TEST, "holder", &[(DEVICE, &d.to_string())]);
    peer.expect("held", T);
    let pid = peer.child.id();
    match ledger.reserve(1) {
        Err(Error::Quota(QuotaError::OverQuota { holders, used, .. })) => {
            assert_eq!(used, 1000);
            assert_eq!(holders[0].pid, pid);
        }
        other => panic!("a full budget must refuse: {other:?}"),
    }
    peer.child.kill().unwrap();
    let killed = Instant::now();
    let r = loop {
        match ledger.reserve(1000) {
            Ok(r) => break r,
            Err(Error::Quota(QuotaError::OverQuota { .. })) if killed.elapsed() < T => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("{e}"),
        }
    };
    let took = killed.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "bytes came back after {took:?}"
    );
    let _ = peer.child.wait();
    let s = ledger.snapshot().unwrap();
    assert_eq!((s.used, s.holders.len()), (1000, 1));
    assert_eq!(s.holders[0].identity.pid, std::process::id());
    drop(r);
    assert_eq!(ledger.snapshot().unwrap().used, 0);
}

/// The test hook in a child: at the half-written entry, tell the parent and wait to be killed
/// (holding the ledger lock).
fn stop_half_way(p: QuotaTestPoint) {
    if p == QuotaTestPoint::EntryHalfWritten {
        tell("half-way");
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
}

#[test]
fn a_holder_killed_half_way_through_an_entry_under_the_lock_is_repaired_by_the_next_locker() {
    const TEST: &str =
        "a_holder_killed_half_way_through_an_entry_under_the_lock_is_repaired_by_the_next_locker";
    if role().as_deref() == Some("half") {
        let l = QuotaLedger::open(QuotaScope::user(), child_device()).unwrap();
        set_test_hook(stop_half_way);
        let _ = l.reserve(700);
        panic!("the holder was to stop half-way");
    }
    let d = device();
    let ledger = QuotaLedger::set_budget(QuotaScope::user(), d, 1000).unwrap();
    let _g = Gone(ledger.name().to_string());
    let mut peer = Peer::spawn(TEST, "half", &[(DEVICE, &d.to_string())]);
    peer.expect("half-way", T);
    // It holds the lock: a reserve now waits for it (and would time out after 2 s).
    peer.child.kill().unwrap();
    let killed = Instant::now();
    // The kernel released the lock with the process; the entry it left WRITING is freed, so the
    // whole budget is there.
    let r = ledger.reserve(1000).unwrap();
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(1), "took {took:?}");
    let _ = peer.child.wait();
    let s = ledger.snapshot().unwrap();
    assert_eq!((s.used, s.holders.len()), (1000, 1));
    drop(r);
}

#[test]
fn a_producer_past_the_budget_is_refused_before_it_allocates_and_quota_bytes_is_its_own_cap() {
    // The self cap: judged alone, no ledger needed.
    let opts = ChannelOptions::new(100).buffers(4).quota_bytes(300);
    let e = Producer::create_host(&format!("quota-cap-{}", std::process::id()), &opts).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Channel(cuda_ipc::channel::ChannelError::PoolOverCap { quota: 300, .. })
        ),
        "{e:?}"
    );
    // A pool of 2^64 bytes or more is refused as such, before any budget is asked (it read as a
    // reservation of u64::MAX bytes, over quota).
    let huge = ChannelOptions::new(1 << 62)
        .buffers(4)
        .quota(QuotaScope::user());
    let e =
        Producer::create_host(&format!("quota-huge-{}", std::process::id()), &huge).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("2^64 bytes or more")),
        "{e:?}"
    );
    // So is a host pool no segment can hold (past isize::MAX bytes), and a tensor set of 2^64
    // bytes or more, or one whose data segment no segment can hold: each before any ledger is
    // asked (this scope has none, which was said first).
    let nobody = QuotaScope::Group(3_000_000_000 + std::process::id());
    let past = ChannelOptions::new(1 << 61).buffers(4).quota(nobody);
    let e =
        Producer::create_host(&format!("quota-past-{}", std::process::id()), &past).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("the most a segment can hold")),
        "{e:?}"
    );
    {
        use cuda_ipc::tensorset::{
            DType, GenerationMode, TensorSetOptions, TensorSetWriter, TensorSpec,
        };
        let opts = TensorSetOptions::new()
            .mode(GenerationMode::Buffered(4))
            .quota(nobody);
        for (n, why) in [
            (
                1i64 << 62,
                "a set of 4 buffers of 4611686018427387904 bytes is 2^64 bytes or more",
            ),
            (1 << 61, "the most a segment can hold"),
        ] {
            let specs = [TensorSpec::new("w", DType::U8, &[n])];
            let set = format!("quota-huge-set-{}", std::process::id());
            let e = TensorSetWriter::create_host(&set, &specs, &opts).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains(why)),
                "{n}: {e:?}"
            );
        }
    }
    // A ledger on a device without one: no budget was set, said plainly.
    let d = device();
    let e = QuotaLedger::open(QuotaScope::user(), d).unwrap_err();
    assert!(matches!(e, Error::Shm(ShmError::NotFound { .. })), "{e:?}");
    // A producer asking a budget nobody set is refused, naming the ledger and what to do.
    let scope = QuotaScope::Group(3_000_000_000 + std::process::id());
    let opts = ChannelOptions::new(100).buffers(4).quota(scope);
    let e =
        Producer::create_host(&format!("quota-none-{}", std::process::id()), &opts).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Quota(cuda_ipc::quota::QuotaError::NoBudget { .. })
        ),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(text.contains("cuda-ipc quota set"), "{text}");
    assert!(
        text.contains(&scope.segment_name(cuda_ipc::driver::Uuid([0; 16]))),
        "{text}"
    );
}

/// Writes `bytes` (then zeros up to `len`) to a new file under the ledger name, mode 0600.
fn plant(name: &str, bytes: &[u8], len: usize) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path(name))
        .unwrap();
    let mut all = bytes.to_vec();
    all.resize(len.max(bytes.len()), 0);
    f.write_all(&all).unwrap();
}

const LEDGER_LEN: usize = 4096 + 256 * 128;

#[test]
fn hostile_segments_under_a_ledger_name_are_clear_errors_and_are_kept() {
    let scope = QuotaScope::user();
    let check = |what: &str, bytes: &[u8], len: usize, ok: &dyn Fn(&Error) -> bool| {
        let d = device();
        let name = scope.segment_name(d);
        let _g = Gone(name.clone());
        plant(&name, bytes, len);
        let t = Instant::now();
        for (who, e) in [
            // First, while the file is young: an unstamped one is replaced only once it is 2 s
            // old (a_creation_abandoned_before_its_stamp_is_replaced...), and each open below
            // waits 1 s for its stamp.
            (
                "set_budget",
                QuotaLedger::set_budget(scope, d, 5).unwrap_err(),
            ),
            ("open", QuotaLedger::open(scope, d).unwrap_err()),
            ("open_named", QuotaLedger::open_named(&name).unwrap_err()),
        ] {
            assert!(ok(&e), "{what}, {who}: {e:?}");
            assert!(!e.to_string().is_empty());
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{what}: bounded waits"
        );
        assert!(std::fs::metadata(path(&name)).is_ok(), "{what}: kept");
    };
    let bad = |e: &Error| matches!(e, Error::Quota(QuotaError::BadSegment { .. }));
    // Random bytes of the full length: another program's file.
    let garbage: Vec<u8> = (0..LEDGER_LEN as u32).map(|i| (i * 7 + 3) as u8).collect();
    check("garbage", &garbage, LEDGER_LEN, &bad);
    // Another layout of this crate (a channel's magic) with a stamp-like word.
    let mut foreign = b"CIPCCHAN".to_vec();
    foreign.extend_from_slice(&1u32.to_le_bytes());
    foreign.extend_from_slice(&0x5155_4f54u32.to_le_bytes());
    check("foreign", &foreign, LEDGER_LEN, &bad);
    // Our magic, another version, stamped.
    let mut other = b"CIPCQUOT".to_vec();
    other.extend_from_slice(&9u32.to_le_bytes());
    other.extend_from_slice(&0x5155_4f54u32.to_le_bytes());
    check("version", &other, LEDGER_LEN, &|e| {
        matches!(
            e,
            Error::Quota(QuotaError::VersionMismatch {
                found: 9,
                supported: 2,
                ..
            })
        )
    });
    // A ledger of layout version 1 (64-byte entries: 20,480 bytes), as an older build left it:
    // refused by its version, not its length, with what to do.
    let mut v1 = b"CIPCQUOT".to_vec();
    v1.extend_from_slice(&1u32.to_le_bytes());
    v1.extend_from_slice(&0x5155_4f54u32.to_le_bytes());
    check("version 1", &v1, 4096 + 256 * 64, &|e| {
        matches!(
            e,
            Error::Quota(QuotaError::VersionMismatch {
                found: 1,
                supported: 2,
                ..
            })
        ) && e.to_string().contains("cuda-ipc quota remove")
    });
    // This version cut short of its entries (the header page whole): too small.
    let mut short = b"CIPCQUOT".to_vec();
    short.extend_from_slice(&2u32.to_le_bytes());
    short.extend_from_slice(&0x5155_4f54u32.to_le_bytes());
    check("cut short", &short, 8192, &|e| {
        matches!(e, Error::Shm(ShmError::TooSmall { len: 8192, .. }))
    });
    // Our magic and version, stamped, but the entry count garbled.
    let mut garbled = b"CIPCQUOT".to_vec();
    garbled.extend_from_slice(&2u32.to_le_bytes());
    garbled.extend_from_slice(&0x5155_4f54u32.to_le_bytes());
    garbled.resize(80, 0);
    garbled.extend_from_slice(&7u32.to_le_bytes());
    check("entries", &garbled, LEDGER_LEN, &bad);
    // A stamp word that is neither 0 nor the stamp: garbled, refused at once (not awaited).
    let mut stamp = b"CIPCQUOT".to_vec();
    stamp.extend_from_slice(&2u32.to_le_bytes());
    stamp.extend_from_slice(&0xdead_beefu32.to_le_bytes());
    let t = Instant::now();
    check("garbled stamp", &stamp, LEDGER_LEN, &|e| {
        bad(e) && e.to_string().contains("0xdeadbeef")
    });
    assert!(t.elapsed() < Duration::from_millis(900), "not awaited");
    // Never stamped: a creation that never finished.
    check("unstamped", b"CIPCQUOT\x02\0\0\0", LEDGER_LEN, &bad);
    // Truncated: a real header on a short file.
    check("truncated", &other, 100, &|e| {
        matches!(e, Error::Shm(ShmError::TooSmall { .. }))
    });

    // A FIFO under the name: refused at once without blocking, never removed.
    let d = device();
    let name = scope.segment_name(d);
    let _g = Gone(name.clone());
    let c = CString::new(path(&name)).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for e in [
        QuotaLedger::open(scope, d).unwrap_err(),
        QuotaLedger::set_budget(scope, d, 5).unwrap_err(),
    ] {
        assert!(
            matches!(e, Error::Shm(ShmError::NotASegment { .. })),
            "{e:?}"
        );
    }
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::symlink_metadata(path(&name))
            .unwrap()
            .file_type()
            .is_fifo(),
        "the FIFO is kept"
    );
}

/// A group ledger cut short under the mappings of its users (`ftruncate`, which any member of
/// the group may do: the file is 0660): every call that reads or writes its entries says so
/// (`Shrunk`) instead of touching a page past the new end (`SIGBUS`), reservations held across
/// the cut are released or dropped without a fault, and `gc`'s scan looks at it without one.
#[test]
fn a_group_ledger_cut_short_under_the_mapping_is_an_error_never_a_fault() {
    let egid = rustix::process::getegid().as_raw();
    let scope = QuotaScope::group(&egid.to_string()).unwrap();
    let shrunk = |e: &Error| matches!(e, Error::Shm(ShmError::Shrunk { .. }));
    // Cut into the entries, to the header page only, and to nothing.
    for cut in [2 * 4096, 4096, 0] {
        let d = device();
        let ledger = QuotaLedger::set_budget(scope, d, 1 << 20).unwrap();
        let name = ledger.name().to_string();
        let _g = Gone(name.clone());
        let released = ledger.reserve(100).unwrap();
        let dropped = ledger.reserve(200).unwrap();
        let other = QuotaLedger::open_named(&name).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(path(&name))
            .unwrap()
            .set_len(cut)
            .unwrap();
        for (what, e) in [
            ("reserve", other.reserve(1).unwrap_err()),
            ("snapshot", other.snapshot().unwrap_err()),
            ("dead_holders", other.dead_holders(true).unwrap_err()),
            ("release", released.release().unwrap_err()),
        ] {
            assert!(shrunk(&e), "cut to {cut}: {what}: {e:?}");
        }
        // Its return fails: logged, nothing touched.
        drop(dropped);
        assert!(QuotaLedger::open_named(&name).is_err(), "cut to {cut}");
        // `gc`'s look: a problem (too small to be a ledger) or, empty and young, a creation that
        // may be under way.
        let scan = cuda_ipc::cleanup::scan(
            &cuda_ipc::cleanup::Scope::only(vec![], vec![]).with_quota_ledgers(vec![name.clone()]),
        )
        .unwrap();
        assert!(
            scan.problems.iter().any(|p| p.subject.contains(&name))
                || scan.kept.iter().any(|k| k.contains(&name)),
            "cut to {cut}: {scan:?}"
        );
    }
}

#[test]
fn another_users_ledger_is_refused_and_its_budget_is_not_ours_to_change() {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root to give a file to another uid");
        return;
    }
    let d = device();
    let ledger = QuotaLedger::set_budget(QuotaScope::user(), d, 10).unwrap();
    let name = ledger.name().to_string();
    let _g = Gone(name.clone());
    drop(ledger);
    let other = 54321u32;
    rustix::fs::chown(
        path(&name).as_str(),
        Some(rustix::process::Uid::from_raw(other)),
        None,
    )
    .unwrap();
    for e in [
        QuotaLedger::open(QuotaScope::user(), d).unwrap_err(),
        QuotaLedger::open_named(&name).unwrap_err(),
    ] {
        // Under this user's name, another uid's file is one planted there: said so.
        assert!(
            matches!(e, Error::Quota(QuotaError::Planted { owner, .. }) if owner == other),
            "{e:?}"
        );
    }
    assert_eq!(std::fs::metadata(path(&name)).unwrap().uid(), other);
}

#[test]
fn a_creation_abandoned_before_its_stamp_is_replaced_by_the_next_budget_but_a_live_ones_is_not() {
    let scope = QuotaScope::user();
    let d = device();
    let name = scope.segment_name(d);
    let _g = Gone(name.clone());
    // Our magic and version, the creator's identity words zero (a creator killed before it wrote
    // them would leave the magic 0; one killed after them, its dead identity), no stamp.
    let mut half = b"CIPCQUOT".to_vec();
    half.extend_from_slice(&1u32.to_le_bytes());
    plant(&name, &half, LEDGER_LEN);
    // Young: a creator may still be at work, so it is opened (and found unstamped), not replaced.
    let e = QuotaLedger::set_budget(scope, d, 100).unwrap_err();
    assert!(
        matches!(e, Error::Quota(QuotaError::BadSegment { .. })),
        "{e:?}"
    );
    let before = std::fs::metadata(path(&name)).unwrap().ino();
    // Past the 2 s a live creator needs at most, with no live creator: replaced.
    std::thread::sleep(Duration::from_millis(3100));
    let l = QuotaLedger::set_budget(scope, d, 100).unwrap();
    assert_ne!(std::fs::metadata(path(&name)).unwrap().ino(), before);
    assert_eq!(l.snapshot().unwrap().budget, Some(100));
    // A ready ledger is never replaced: setting the budget again keeps the segment.
    let now = std::fs::metadata(path(&name)).unwrap().ino();
    QuotaLedger::set_budget(scope, d, 50).unwrap();
    assert_eq!(std::fs::metadata(path(&name)).unwrap().ino(), now);
    assert_eq!(l.snapshot().unwrap().budget, Some(50));
}

/// The identity of a process that ran and was killed (a `sleep` child of this test), its start
/// time read from `/proc/PID/stat` (field 22) while it ran.
fn dead_process() -> cuda_ipc::identity::ProcessIdentity {
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap();
    // Fields after the command name, which ends at the last ')': state is field 3, start time 22.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let start: u64 = after.split(' ').nth(19).unwrap().parse().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let dead = cuda_ipc::identity::ProcessIdentity {
        pid: child.id(),
        start_time: start,
        ..cuda_ipc::identity::ProcessIdentity::current().unwrap()
    };
    assert!(!dead.is_alive());
    dead
}

/// What a `set_budget` killed after its magic and creator but before its stamp leaves: the whole
/// ledger, every page written, never stamped, naming `creator`.
fn unstamped(name: &str, creator: cuda_ipc::identity::ProcessIdentity) {
    let mut b = b"CIPCQUOT".to_vec();
    b.extend_from_slice(&2u32.to_le_bytes()); // version
    b.extend_from_slice(&0u32.to_le_bytes()); // no stamp
    b.extend_from_slice(&7u64.to_le_bytes()); // generation
    for w in creator.to_words() {
        b.extend_from_slice(&w.to_le_bytes());
    }
    plant(name, &b, LEDGER_LEN);
}

#[test]
fn gcs_rule_removes_an_abandoned_ledger_creation_and_never_a_young_live_ready_or_foreign_one() {
    use cuda_ipc::quota::{abandoned, remove_abandoned};
    let scope = QuotaScope::user();
    let name = || scope.segment_name(device());
    let (empty, sparse, blank, dead, live) = (name(), name(), name(), name(), name());
    let (young, young_empty, fifo) = (name(), name(), name());
    let _g = [
        &empty,
        &sparse,
        &blank,
        &dead,
        &live,
        &young,
        &young_empty,
        &fifo,
    ]
    .map(|n| Gone(n.clone()));
    let creator = dead_process();
    // Killed before `ftruncate`; between `ftruncate` and `fallocate`; after `fallocate`, before
    // the magic; after the creator's identity, before the stamp; a live creator's.
    plant(&empty, b"", 0);
    std::fs::File::options()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path(&sparse))
        .unwrap()
        .set_len(LEDGER_LEN as u64)
        .unwrap();
    plant(&blank, b"", LEDGER_LEN);
    unstamped(&dead, creator);
    unstamped(
        &live,
        cuda_ipc::identity::ProcessIdentity::current().unwrap(),
    );
    let c = CString::new(path(&fifo)).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    // Young: a creator may be at work. Not abandoned, nothing removed.
    for n in [&empty, &sparse, &blank, &dead, &live] {
        assert_eq!(abandoned(n).unwrap(), None, "{n}");
        assert_eq!(remove_abandoned(n).unwrap(), None, "{n}");
        assert!(std::fs::metadata(path(n)).is_ok(), "{n}");
    }
    std::thread::sleep(Duration::from_millis(2200));
    unstamped(&young, creator);
    plant(&young_empty, b"", 0);
    let ready = QuotaLedger::set_budget(scope, device(), 10).unwrap();
    let _r = Gone(ready.name().to_string());

    let reserved = "a creation abandoned before its pages were reserved";
    for (n, why) in [
        (&empty, reserved),
        (&sparse, reserved),
        (&blank, "a creation abandoned before its header was written"),
        (
            &dead,
            "a creation abandoned by its dead creator before its init stamp",
        ),
    ] {
        assert_eq!(abandoned(n).unwrap(), Some(why), "{n}");
        assert_eq!(remove_abandoned(n).unwrap(), Some(why), "{n}");
        assert!(std::fs::symlink_metadata(path(n)).is_err(), "{n}: removed");
        // Nothing there: nothing to do.
        assert_eq!(remove_abandoned(n).unwrap(), None, "{n}");
    }
    // A live creator's, the young ones, a ready ledger: kept, no error.
    for n in [&live, &young, &young_empty, &ready.name().to_string()] {
        assert_eq!(abandoned(n).unwrap(), None, "{n}");
        assert_eq!(remove_abandoned(n).unwrap(), None, "{n}");
        assert!(std::fs::metadata(path(n)).is_ok(), "{n}");
    }
    assert_eq!(ready.snapshot().unwrap().budget, Some(10));
    // A FIFO under a ledger's name: refused without blocking, never removed.
    for r in [abandoned(&fifo), remove_abandoned(&fifo)] {
        let e = r.unwrap_err();
        assert!(
            matches!(e, Error::Shm(ShmError::NotASegment { .. })),
            "{e:?}"
        );
    }
    assert!(std::fs::symlink_metadata(path(&fifo)).is_ok());
    // Only a ledger's name is judged by the ledger's rule.
    assert!(matches!(
        remove_abandoned("cuda-ipc-not-a-ledger"),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn another_users_abandoned_ledger_creation_is_never_removed() {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root to give a file to another uid");
        return;
    }
    use cuda_ipc::quota::{abandoned, remove_abandoned};
    let scope = QuotaScope::user();
    let (empty, dead) = (scope.segment_name(device()), scope.segment_name(device()));
    let _g = (Gone(empty.clone()), Gone(dead.clone()));
    plant(&empty, b"", 0);
    unstamped(&dead, dead_process());
    for n in [&empty, &dead] {
        rustix::fs::chown(
            path(n).as_str(),
            Some(rustix::process::Uid::from_raw(65534)),
            None,
        )
        .unwrap();
    }
    std::thread::sleep(Duration::from_millis(2200));
    for n in [&empty, &dead] {
        for r in [abandoned(n), remove_abandoned(n)] {
            let e = r.unwrap_err();
            assert!(
                matches!(e, Error::Shm(ShmError::WrongOwner { owner: 65534, .. })),
                "{n}: {e:?}"
            );
        }
        assert_eq!(std::fs::metadata(path(n)).unwrap().uid(), 65534, "{n}");
    }
}

/// A ledger, or a ledger's creation abandoned half-way, whose mode opens it to other users (any of
/// the bits 0o007): the library never makes one, so anyone may have written it. Every opener
/// refuses it (`InsecureMode`, naming the mode), a `set_budget` does not replace it and `gc`'s
/// rule does not remove it, however old.
#[test]
fn a_ledger_open_to_other_users_is_refused_by_every_opener_and_never_replaced_or_removed() {
    use cuda_ipc::quota::{abandoned, remove_abandoned};
    use std::os::unix::fs::PermissionsExt;
    let scope = QuotaScope::user();
    let ready = device();
    let ledger = QuotaLedger::set_budget(scope, ready, 10).unwrap();
    let ready_name = ledger.name().to_string();
    let _r = Gone(ready_name.clone());
    drop(ledger);
    let (empty, dead) = (device(), device());
    let names = [scope.segment_name(empty), scope.segment_name(dead)];
    let _g = names.clone().map(Gone);
    plant(&names[0], b"", 0);
    unstamped(&names[1], dead_process());
    let modes = [(&ready_name, 0o644), (&names[0], 0o666), (&names[1], 0o604)];
    for (n, mode) in modes {
        std::fs::set_permissions(path(n), std::fs::Permissions::from_mode(mode)).unwrap();
    }
    // Past any creation's grace (2 s, in whole seconds of `st_ctime`).
    std::thread::sleep(Duration::from_millis(3100));
    for ((n, mode), d) in modes.into_iter().zip([ready, empty, dead]) {
        let t = Instant::now();
        for (who, e) in [
            ("open", QuotaLedger::open(scope, d).map(|_| ()).unwrap_err()),
            (
                "open_named",
                QuotaLedger::open_named(n).map(|_| ()).unwrap_err(),
            ),
            (
                "set_budget",
                QuotaLedger::set_budget(scope, d, 5)
                    .map(|_| ())
                    .unwrap_err(),
            ),
            ("abandoned", abandoned(n).map(|_| ()).unwrap_err()),
            (
                "remove_abandoned",
                remove_abandoned(n).map(|_| ()).unwrap_err(),
            ),
        ] {
            assert!(
                matches!(e, Error::Shm(ShmError::InsecureMode { mode: m, .. }) if m == mode),
                "{n} {mode:o}, {who}: {e:?}"
            );
            assert!(e.to_string().contains("open to other users"), "{who}: {e}");
        }
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "{n}: {:?}",
            t.elapsed()
        );
        let m = std::fs::metadata(path(n)).unwrap();
        assert_eq!(m.mode() & 0o777, mode, "{n}: left as it was");
    }
}

/// A file another user planted under this user's ledger name (the names are predictable): every
/// opener and `set_budget` refuse it with `QuotaError::Planted`, which names the owner and what
/// to do, before reading a byte (a producer's reservation opens the ledger with `open`), and the
/// file is never removed.
#[test]
fn a_file_planted_under_this_users_ledger_name_is_named_as_planted_and_never_removed() {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root to give a file to another uid");
        return;
    }
    let scope = QuotaScope::user();
    let d = device();
    let name = scope.segment_name(d);
    let _g = Gone(name.clone());
    plant(&name, b"", 20_480);
    rustix::fs::chown(
        path(&name).as_str(),
        Some(rustix::process::Uid::from_raw(65534)),
        None,
    )
    .unwrap();
    let planted = |e: &Error| {
        matches!(e, Error::Quota(QuotaError::Planted { uid, owner: 65534, .. }) if *uid == 0)
            && e.to_string().contains("planted")
            && e.to_string().contains(&format!("rm /dev/shm/{name}"))
    };
    for (what, e) in [
        ("open", QuotaLedger::open(scope, d).err()),
        ("open_named", QuotaLedger::open_named(&name).err()),
        (
            "set_budget",
            QuotaLedger::set_budget(scope, d, 1 << 20).err(),
        ),
    ] {
        let e = e.unwrap_or_else(|| panic!("{what}: opened a planted ledger"));
        assert!(planted(&e), "{what}: {e}");
    }
    let st = std::fs::metadata(path(&name)).unwrap();
    assert_eq!(
        (st.uid(), st.len()),
        (65534, 20_480),
        "the planted file is left as it was"
    );
}

/// A killed holder of host memory: a host channel's pool and a host tensor set's data segment stay
/// in /dev/shm after their process is killed, so their reservations stay counted (named in
/// `OverQuota` and in the snapshot as dead with the segment that holds them), unlike GPU memory,
/// which the driver frees with its process. A producer started again under the same channel name
/// is not refused for the memory it replaces, and its replacement frees the dead entry; `gc`
/// (scan and remove of the set and the ledger) removes the set's segments, then frees its entry.
/// (A group ledger of this process's group: the user's host ledger is the racing test's.)
#[test]
fn a_killed_host_holders_bytes_stay_counted_while_its_memory_is_in_dev_shm() {
    use cuda_ipc::tensorset::{DType, TensorSetOptions, TensorSetWriter, TensorSpec};
    const TEST: &str = "a_killed_host_holders_bytes_stay_counted_while_its_memory_is_in_dev_shm";
    let scope = QuotaScope::Group(rustix::process::getegid().as_raw());
    let host = Uuid([0; 16]);
    let opts = ChannelOptions::new(100).buffers(4).quota(scope);
    let specs = [TensorSpec::new("w", DType::U8, &[100])];
    if role().as_deref() == Some("host-holder") {
        let ch = std::env::var("CUDA_IPC_TEST_QUOTA_CHANNEL").unwrap();
        let _tx = Producer::create_host(&ch, &opts).unwrap();
        let _w = TensorSetWriter::create_host(&ch, &specs, &TensorSetOptions::new().quota(scope))
            .unwrap();
        tell("held");
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
    let ledger_name = scope.segment_name(host);
    if std::fs::metadata(path(&ledger_name)).is_ok() {
        println!("skipped: a host-memory budget is set for this group ({ledger_name}); left alone");
        return;
    }
    let _g = Gone(ledger_name.clone());
    let ledger = QuotaLedger::set_budget(scope, host, UNLIMITED).unwrap();
    let ch = format!("quota-host-dead-{}", std::process::id());
    let pool = format!("cuda-ipc.hp.{ch}");
    let data = format!("cuda-ipc.td.{ch}");
    let _segs = [
        Gone(pool.clone()),
        Gone(data.clone()),
        Gone(format!("cuda-ipc.ch.{ch}")),
        Gone(format!("cuda-ipc.ts.{ch}")),
        Gone(format!("cuda-ipc.tg.{ch}")),
        Gone(format!("cuda-ipc.th.{ch}")),
    ];
    let mut peer = Peer::spawn(TEST, "host-holder", &[("CUDA_IPC_TEST_QUOTA_CHANNEL", &ch)]);
    peer.expect("held", T);
    let pid = peer.child.id();
    let before = ledger.snapshot().unwrap();
    assert_eq!(before.holders.len(), 2, "{before:?}");
    let set_bytes = before.used - 400;
    // Room for what the dead process holds and 100 bytes more: a second pool of 400 fits only
    // where the dead one's is not counted.
    QuotaLedger::set_budget(scope, host, before.used + 100).unwrap();
    peer.child.kill().unwrap();
    let _ = peer.child.wait();

    // Killed: both segments are still in /dev/shm, so both entries stay, named as dead.
    let s = ledger.snapshot().unwrap();
    assert_eq!((s.used, s.reclaimed), (before.used, 0), "{s:?}");
    let mut left: Vec<_> = s.holders.iter().map(|h| h.left_in.clone()).collect();
    left.sort();
    assert_eq!(left, [Some(pool.clone()), Some(data.clone())]);
    assert!(
        s.holders
            .iter()
            .all(|h| h.identity.pid == pid && h.liveness == cuda_ipc::identity::Liveness::Dead)
    );
    match ledger.reserve(101) {
        Err(e @ Error::Quota(QuotaError::OverQuota { .. })) => {
            let text = e.to_string();
            assert!(
                text.contains(&format!("dead; its memory stays in /dev/shm/{pool}")),
                "{text}"
            );
            assert!(text.contains(&format!("/dev/shm/{data}")), "{text}");
        }
        other => panic!("the dead holder's host memory must stay counted: {other:?}"),
    }
    // Its memory is counted in `dead_holders` too, and not freed there while it stands.
    let dead = ledger.dead_holders(true).unwrap();
    assert_eq!(dead.len(), 2);
    assert_eq!(ledger.snapshot().unwrap().used, before.used);

    // Started again under the same name but too big even without the dead pool (600 bytes where
    // 500 are left once it is not counted): refused, the message saying what it did not count,
    // and the dead pool left where it is.
    match Producer::create_host(&ch, &ChannelOptions::new(100).buffers(6).quota(scope)) {
        Err(e @ Error::Quota(QuotaError::OverQuota { .. })) => {
            let text = e.to_string();
            let Error::Quota(QuotaError::OverQuota {
                used,
                replaced,
                holders,
                ..
            }) = e
            else {
                unreachable!()
            };
            assert_eq!(used, set_bytes, "{text}");
            assert_eq!(holders.len(), 1, "{text}");
            assert_eq!(replaced.len(), 1, "{text}");
            assert_eq!((replaced[0].pid, replaced[0].bytes), (pid, 400), "{text}");
            assert_eq!(replaced[0].left_in.as_deref(), Some(pool.as_str()));
            assert!(
                text.contains(&format!(
                    "not counted, since this reservation's segment replaces it: 400 bytes of \
                     dead pid {pid} in /dev/shm/{pool}"
                )),
                "{text}"
            );
        }
        other => panic!("a restart too big even so must be refused: {other:?}"),
    }
    assert!(std::fs::metadata(path(&pool)).is_ok());
    assert_eq!(ledger.snapshot().unwrap().used, before.used);

    // The producer started again under the same name replaces the dead pool: not refused for it.
    let tx = Producer::create_host(&ch, &opts).unwrap();
    let s = ledger.snapshot().unwrap();
    assert_eq!((s.used, s.reclaimed), (400 + set_bytes, 1), "{s:?}");
    let dead: Vec<_> = s.holders.iter().filter(|h| h.identity.pid == pid).collect();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].left_in.as_deref(), Some(data.as_str()));
    assert!(
        s.holders
            .iter()
            .any(|h| h.identity.pid == std::process::id() && h.left_in.is_none())
    );

    // gc of the ledger alone removes no segment: the dead holder whose data segment stands is
    // kept, with why (a dry run says what the run does), not listed as a reservation to free.
    let only = cleanup::scan(
        &Scope::only(Vec::new(), Vec::new()).with_quota_ledgers(vec![ledger_name.clone()]),
    )
    .unwrap();
    assert!(
        !only
            .leftovers
            .iter()
            .any(|l| l.kind == cleanup::LeftoverKind::QuotaHolder),
        "{:?}",
        only.leftovers
    );
    assert!(
        only.kept
            .iter()
            .any(|k| k.contains(&format!("/dev/shm/{data}, which this gc does not remove"))),
        "{:?}",
        only.kept
    );
    assert!(cleanup::remove(&only.leftovers).removed.is_empty());
    assert_eq!(ledger.snapshot().unwrap().used, 400 + set_bytes);

    // gc of the set and the ledger: the set's segments go first, then its entry.
    let scan = cleanup::scan(
        &Scope::only(Vec::new(), Vec::new())
            .with_tensor_sets(vec![ch.clone()])
            .with_quota_ledgers(vec![ledger_name.clone()]),
    )
    .unwrap();
    assert!(
        scan.leftovers
            .iter()
            .any(|l| l.kind == cleanup::LeftoverKind::QuotaHolder),
        "{:?}",
        scan.leftovers
    );
    let removal = cleanup::remove(&scan.leftovers);
    assert!(removal.problems.is_empty(), "{:?}", removal.problems);
    assert!(
        removal
            .removed
            .iter()
            .any(|l| l.kind == cleanup::LeftoverKind::QuotaHolder),
        "{removal:?}"
    );
    assert!(
        std::fs::symlink_metadata(path(&data)).is_err(),
        "{data} is gone"
    );
    let s = ledger.snapshot().unwrap();
    assert_eq!((s.used, s.holders.len()), (400, 1), "{s:?}");
    drop(tx);
    assert_eq!(ledger.snapshot().unwrap().used, 0);
}

const SEG: &str = "CUDA_IPC_TEST_QUOTA_SEGMENT";

/// In a child: reserves 1000 bytes for the segment `$CUDA_IPC_TEST_QUOTA_SEGMENT`, makes it
/// without recording it, tells `made` and waits to be killed.
fn hold_unrecorded_segment_until_killed() -> ! {
    use cuda_ipc::raw::shm::{Segment, SegmentOptions};
    let l = QuotaLedger::open(QuotaScope::user(), child_device()).unwrap();
    let seg = std::env::var(SEG).unwrap();
    let r = l.reserve_for(1000, Some(&seg)).unwrap();
    let made = Segment::create(&seg, 4096, &SegmentOptions::new()).unwrap();
    tell("made");
    std::mem::forget((r, made));
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

/// A holder killed after its reserve named its segment but before it recorded it (the segment
/// made, or not yet): judged by the name alone. Its entry stays while a file of that name stands
/// that no entry recorded; a successor's segment of that name, recorded, is not the dead one's.
#[test]
fn a_holder_killed_before_it_recorded_its_segment_is_judged_by_the_segments_name() {
    use cuda_ipc::raw::shm::{Segment, SegmentOptions};
    const TEST: &str =
        "a_holder_killed_before_it_recorded_its_segment_is_judged_by_the_segments_name";
    const SEG: &str = "CUDA_IPC_TEST_QUOTA_SEGMENT";
    if role().as_deref() == Some("pending") {
        hold_unrecorded_segment_until_killed();
    }
    let d = device();
    let ledger = QuotaLedger::set_budget(QuotaScope::user(), d, UNLIMITED).unwrap();
    let _g = Gone(ledger.name().to_string());
    let seg = format!("quota-pending-{}", std::process::id());
    let _s = Gone(seg.clone());
    let mut peer = Peer::spawn(TEST, "pending", &[(DEVICE, &d.to_string()), (SEG, &seg)]);
    peer.expect("made", T);
    peer.child.kill().unwrap();
    let _ = peer.child.wait();
    // Its segment stands, recorded by no entry: the dead holder keeps its entry.
    let s = ledger.snapshot().unwrap();
    assert_eq!((s.used, s.reclaimed), (1000, 0), "{s:?}");
    assert_eq!(s.holders[0].left_in.as_deref(), Some(seg.as_str()));
    // A successor under that name reserves while the dead one's file stands (kept, not counted
    // against it), then makes the name again and records its segment: the file standing is the
    // successor's, so the dead entry goes.
    let r = ledger.reserve_for(500, Some(&seg)).unwrap();
    assert_eq!(ledger.snapshot().unwrap().used, 1500);
    std::fs::remove_file(path(&seg)).unwrap();
    let mine = Segment::create(&seg, 4096, &SegmentOptions::new()).unwrap();
    assert_eq!(
        ledger.snapshot().unwrap().used,
        1500,
        "not recorded yet: judged by the name"
    );
    r.record_memory(&mine).unwrap();
    let s = ledger.snapshot().unwrap();
    assert_eq!((s.used, s.reclaimed, s.holders.len()), (500, 1, 1), "{s:?}");
    assert_eq!(s.holders[0].identity.pid, std::process::id());
    drop(r);
    assert_eq!(ledger.snapshot().unwrap().used, 0);
}

/// `QuotaLedger::remove_of` (`cuda-ipc quota remove`, Python's `remove_quota`) removes a ledger
/// this build cannot open because an older build made it (layout version 1), which nothing else
/// can; a garbage file under the name is refused and kept, and nothing under it is no error.
#[test]
fn remove_of_removes_a_ledger_of_another_layout_version_and_keeps_a_foreign_file() {
    let scope = QuotaScope::user();
    let d = device();
    let name = scope.segment_name(d);
    let _g = Gone(name.clone());
    assert!(!QuotaLedger::remove_of(scope, d).unwrap(), "nothing there");
    let mut v1 = b"CIPCQUOT".to_vec();
    v1.extend_from_slice(&1u32.to_le_bytes());
    v1.extend_from_slice(&0x5155_4f54u32.to_le_bytes());
    plant(&name, &v1, 4096 + 256 * 64);
    assert!(matches!(
        QuotaLedger::open(scope, d).unwrap_err(),
        Error::Quota(QuotaError::VersionMismatch { found: 1, .. })
    ));
    assert!(QuotaLedger::remove_of(scope, d).unwrap());
    assert!(std::fs::symlink_metadata(path(&name)).is_err(), "removed");
    // Another program's file under the name: refused by what it is, kept.
    plant(&name, &[0x5a; 4096 + 256 * 128], 0);
    let e = QuotaLedger::remove_of(scope, d).unwrap_err();
    assert!(
        matches!(e, Error::Quota(QuotaError::BadSegment { .. })),
        "{e:?}"
    );
    assert!(std::fs::metadata(path(&name)).is_ok(), "kept");
    // A ledger of this version: removed as `remove` does.
    std::fs::remove_file(path(&name)).unwrap();
    QuotaLedger::set_budget(scope, d, 10).unwrap();
    assert!(QuotaLedger::remove_of(scope, d).unwrap());
    assert!(std::fs::symlink_metadata(path(&name)).is_err());
}

/// A ledger whose every entry is held, one by a dead holder whose segment stands: a plain reserve
/// is refused with `Full`, and a restart under that segment's name takes the dead one's entry.
#[test]
fn a_restart_under_a_dead_holders_segment_name_takes_its_entry_in_a_full_ledger() {
    const TEST: &str =
        "a_restart_under_a_dead_holders_segment_name_takes_its_entry_in_a_full_ledger";
    if role().as_deref() == Some("pending") {
        hold_unrecorded_segment_until_killed();
    }
    let d = device();
    let ledger = QuotaLedger::set_budget(QuotaScope::user(), d, UNLIMITED).unwrap();
    let _g = Gone(ledger.name().to_string());
    let seg = format!("quota-full-{}", std::process::id());
    let _s = Gone(seg.clone());
    let mut peer = Peer::spawn(TEST, "pending", &[(DEVICE, &d.to_string()), (SEG, &seg)]);
    peer.expect("made", T);
    peer.child.kill().unwrap();
    let _ = peer.child.wait();
    let mine: Vec<_> = (0..255).map(|_| ledger.reserve(1).unwrap()).collect();
    let e = ledger.reserve(1).unwrap_err();
    assert!(
        matches!(e, Error::Quota(QuotaError::Full { .. })) && e.to_string().contains("gc"),
        "{e}"
    );
    let again = ledger.reserve_for(7, Some(&seg)).unwrap();
    let s = ledger.snapshot().unwrap();
    assert_eq!((s.used, s.holders.len()), (255 + 7, 256), "{s:?}");
    assert!(
        s.holders
            .iter()
            .all(|h| h.identity.pid == std::process::id())
    );
    drop((mine, again));
    assert_eq!(ledger.snapshot().unwrap().used, 0);
}

/// A holder of host memory in another pid namespace (pid 1 there), killed: read dead by its
/// liveness file, its entry kept while its recorded segment stands, freed once that is removed.
#[test]
fn a_killed_host_holder_in_another_pid_namespace_stays_counted_while_its_segment_stands() {
    use cuda_ipc::raw::shm::{Segment, SegmentOptions};
    const TEST: &str =
        "a_killed_host_holder_in_another_pid_namespace_stays_counted_while_its_segment_stands";
    if role().as_deref() == Some("recorded") {
        let l = QuotaLedger::open(QuotaScope::user(), child_device()).unwrap();
        let seg = std::env::var(SEG).unwrap();
        let r = l.reserve_for(1000, Some(&seg)).unwrap();
        let made = Segment::create(&seg, 4096, &SegmentOptions::new()).unwrap();
        r.record_memory(&made).unwrap();
        tell(format!("made {}", std::process::id()));
        std::mem::forget((r, made));
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
    if let Err(why) = common::unshare_works(&["--pid", "--fork", "--mount-proc"]) {
        println!("skipped: {why}");
        return;
    }
    let d = device();
    let ledger = QuotaLedger::set_budget(QuotaScope::user(), d, UNLIMITED).unwrap();
    let _g = Gone(ledger.name().to_string());
    let seg = format!("quota-pidns-{}", std::process::id());
    let _s = Gone(seg.clone());
    let mut peer = Peer::spawn_under(
        &["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"],
        TEST,
        "recorded",
        &[(DEVICE, &d.to_string()), (SEG, &seg)],
    );
    peer.expect("made 1", T);
    peer.child.kill().unwrap();
    let _ = peer.child.wait();
    // The holder dies with the namespace's end (`--kill-child`): wait for its liveness to say so.
    let killed = Instant::now();
    let s = loop {
        let s = ledger.snapshot().unwrap();
        if s.holders[0].liveness == cuda_ipc::identity::Liveness::Dead || killed.elapsed() > T {
            break s;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(s.holders.len(), 1, "{s:?}");
    assert_eq!(s.holders[0].identity.pid, 1, "pid 1 in its own namespace");
    assert_eq!(
        s.holders[0].liveness,
        cuda_ipc::identity::Liveness::Dead,
        "{s:?}"
    );
    assert_eq!((s.used, s.reclaimed), (1000, 0), "{s:?}");
    assert_eq!(s.holders[0].left_in.as_deref(), Some(seg.as_str()));
    std::fs::remove_file(path(&seg)).unwrap();
    let s = ledger.snapshot().unwrap();
    assert_eq!((s.used, s.reclaimed, s.holders.len()), (0, 1, 0), "{s:?}");
}
