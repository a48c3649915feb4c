//! Two users on one machine: a channel or a tensor set of one is never opened, replaced,
//! inspected or removed by the other, root included, and each gets an error naming the owner; a
//! process of another user is judged alive or dead correctly through its liveness file. The second
//! user is made here with `useradd` and runs a copy of this test binary it can read and execute.
//! Needs root (CI runs as root); where that is impossible the test prints why and skips.

mod common;

use common::{Peer, parent_lines, role, tell};
use cuda_ipc::Error;
use cuda_ipc::channel::Delivery;
use cuda_ipc::channel::{inspect, reclaim};
use cuda_ipc::identity::{Liveness, ProcessIdentity};
use cuda_ipc::raw::channel::testing::{ControlConsumer, ControlProducer};
use cuda_ipc::raw::shm::ShmError;
use cuda_ipc::raw::tensorset::testing::HeldSetFixture;
use cuda_ipc::tensorset::{
    self, DType, HolderRole, ReaderOptions, TensorSetOptions, TensorSetReader, TensorSetWriter,
    TensorSpec,
};
use cuda_ipc::token::TOKEN_LEN;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, Instant};

const ANSWER: Duration = Duration::from_secs(20);
const USER: &str = "cuda-ipc-test";
const CHANNEL: &str = "CUDA_IPC_TEST_CHANNEL";

/// Held while this process copies a binary or starts a child: a child forked while another
/// thread still has the copy open for writing would keep it open until its own `exec`, and the
/// copy's `exec` would then fail with `ETXTBSY`.
static FORK: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn fork_lock() -> std::sync::MutexGuard<'static, ()> {
    FORK.lock().unwrap_or_else(|p| p.into_inner())
}

fn tokens() -> Vec<[u8; TOKEN_LEN]> {
    vec![[0u8; TOKEN_LEN]; 2]
}

/// The test user's (uid, gid), made with `useradd` when missing; `None` (with the reason printed)
/// when this process is not root or the user cannot be made.
fn test_user() -> Option<(u32, u32)> {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root to make a second user");
        return None;
    }
    let _fork = fork_lock();
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
        // Two tests may race to make it; the loser finds it made.
        if !matches!(made, Ok(s) if s.success()) && id("-u").is_none() {
            println!("skipped: useradd {USER} failed: {made:?}");
            return None;
        }
    }
    Some((id("-u")?, id("-g")?))
}

/// A copy of this test binary that the test user can read and execute (the build folder may not
/// be reachable for other users), in a folder of its own that is removed on drop.
struct BinaryForOthers(std::path::PathBuf);

impl BinaryForOthers {
    fn new(tag: &str) -> BinaryForOthers {
        let _fork = fork_lock();
        let dir =
            std::env::temp_dir().join(format!("cuda-ipc-two-users-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let exe = dir.join("test-binary");
        std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        BinaryForOthers(dir)
    }
    fn exe(&self) -> std::path::PathBuf {
        self.0.join("test-binary")
    }
}

impl Drop for BinaryForOthers {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `test` of this binary as the test user with `role`.
fn spawn_as(
    bin: &BinaryForOthers,
    uid: u32,
    gid: u32,
    test: &str,
    role: &str,
    channel: &str,
) -> Peer {
    let mut cmd = Command::new(bin.exe());
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(common::ROLE, role)
        .env(CHANNEL, channel)
        .current_dir("/")
        .uid(uid)
        .gid(gid); // std clears root's supplementary groups when it drops to `uid`
    spawn_copy(cmd)
}

/// Starts `cmd`, a copy of this binary ([`BinaryForOthers`]), under the fork lock. `exec` of a
/// file just written can still fail with `ETXTBSY` for a moment (seen on a loaded CI machine with
/// every fork of this process under the lock); it is tried again, for up to 2 s.
fn spawn_copy(mut cmd: Command) -> Peer {
    let t = std::time::Instant::now();
    loop {
        let started = {
            let _fork = fork_lock();
            Peer::try_from_command(cmd)
        };
        match started {
            Ok(p) => return p,
            Err(f)
                if f.1.raw_os_error() == Some(libc::ETXTBSY)
                    && t.elapsed() < std::time::Duration::from_secs(2) =>
            {
                cmd = f.0;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(f) => panic!("spawning {:?}: {}", f.0, f.1),
        }
    }
}

fn run_role(role: &str) {
    let channel = std::env::var(CHANNEL).unwrap();
    match role {
        "producer" => {
            let p = ControlProducer::create(&channel, 4096, 2, &tokens()).unwrap();
            let me = ProcessIdentity::current().unwrap();
            tell(format!(
                "ready {} {} {}",
                me.pid,
                me.start_time,
                me.liveness_name()
            ));
            for line in parent_lines() {
                if line == "quit" {
                    break;
                }
            }
            p.close();
            p.unlink();
        }
        "intruder" => {
            // Everything another user may try on a channel that is not theirs.
            let a = ControlConsumer::attach(&channel, Delivery::EveryFrame)
                .map(|_| ())
                .unwrap_err();
            tell(format!("attach {a:?}"));
            let c = ControlProducer::create(&channel, 4096, 2, &tokens())
                .map(|_| ())
                .unwrap_err();
            tell(format!("create {c:?}"));
            let r = reclaim::remove_stale(&channel).map(|_| ()).unwrap_err();
            tell(format!("remove {r:?}"));
        }
        "forger" => {
            // Another user makes a file under a dead process's liveness name and holds the same
            // write lock a live process holds on its own.
            let path = format!("/dev/shm/{}", std::env::var(FORGE).unwrap());
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)
                .unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
            assert!(write_lock(&f), "the forger's lock was refused");
            tell("locked");
            for line in parent_lines() {
                if line == "quit" {
                    break;
                }
            }
            drop(f);
            let _ = std::fs::remove_file(&path);
        }
        "ns-reader" => {
            // A reader in a pid namespace of its own: /proc cannot answer for the producer, so the
            // liveness lock (and the uid recorded beside the identity) decides.
            let w: Vec<u64> = std::env::var(FORGE)
                .unwrap()
                .split(' ')
                .map(|x| x.parse().unwrap())
                .collect();
            let their = ProcessIdentity {
                pid: w[0] as u32,
                start_time: w[1],
                pid_ns: w[2] as u32,
                ..ProcessIdentity::current().unwrap()
            };
            assert!(!their.in_own_pid_namespace());
            tell(format!("as-recorded {:?}", their.liveness_as(w[3] as u32)));
            tell(format!("any-owner {:?}", their.liveness()));
            let c = ControlConsumer::attach(&channel, Delivery::EveryFrame).unwrap();
            let snap = inspect::inspect(&channel).unwrap();
            tell(format!("inspect {:?}", snap.producer_liveness));
            let r = c.take(Some(Duration::from_secs(5))).map(|_| ());
            tell(format!("take {r:?}"));
        }
        "set-writer" => {
            let w = TensorSetWriter::create_host(&channel, &set_specs(), &TensorSetOptions::new())
                .unwrap();
            tell("ready");
            for line in parent_lines() {
                if line == "quit" {
                    break;
                }
            }
            w.close(Duration::from_secs(5)).unwrap();
        }
        "set-intruder" => {
            // Everything another user may try on a tensor set that is not theirs.
            let o = TensorSetReader::open_host(&channel, &ReaderOptions::new())
                .map(|_| ())
                .unwrap_err();
            tell(format!("open {o:?}"));
            let c = TensorSetWriter::create_host(&channel, &set_specs(), &TensorSetOptions::new())
                .map(|_| ())
                .unwrap_err();
            tell(format!("create {c:?}"));
            let r = tensorset::reclaim::remove_stale(&channel)
                .map(|_| ())
                .unwrap_err();
            tell(format!("remove {r:?}"));
            let i = tensorset::inspect::inspect(&channel)
                .map(|_| ())
                .unwrap_err();
            tell(format!("inspect {i:?}"));
        }
        "th-claimer" => {
            // Another user's try at a slot of root's holders segment, directly and as a holder.
            let o = HeldSetFixture::open(&channel).map(|_| ()).unwrap_err();
            tell(format!("open {o:?}"));
            let h = tensorset::Holder::open(&channel).map(|_| ()).unwrap_err();
            tell(format!("holder {h:?}"));
        }
        "th-planter" => {
            // Another user's holders segment under the name of root's set, with a slot of its
            // own; left behind when the process ends (as a crash would leave it).
            let f = HeldSetFixture::create_holders(&channel, 1).unwrap();
            f.claim(HolderRole::Holder).unwrap();
            tell("planted");
            for line in parent_lines() {
                if line == "quit" {
                    break;
                }
            }
            std::mem::forget(f);
        }
        // Takes its identity (its first use of the crate) once told to, and says how it went.
        "first-use" => {
            let _ = parent_lines().next();
            match ProcessIdentity::current() {
                Ok(_) => tell("ok"),
                Err(e) => tell(format!("error {e}")),
            }
        }
        "live" => {
            // A process of the other user with its liveness file; killed by the parent.
            let me = ProcessIdentity::current().unwrap();
            tell(format!("ready {} {}", me.pid, me.start_time));
            for line in parent_lines() {
                if line == "quit" {
                    break;
                }
            }
        }
        _ => panic!("unknown role {role}"),
    }
}

fn set_specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("w", DType::BF16, &[64, 32]),
        TensorSpec::new("b", DType::F32, &[32]),
    ]
}

/// Environment variable naming what the forger forges (a liveness file name) or the identity the
/// namespace reader judges (`pid start_time pid_ns uid`).
const FORGE: &str = "CUDA_IPC_TEST_FORGE";

/// Takes an open-file-description write lock on byte 0 of `f`, as a live process holds its
/// liveness file; `false` when it is refused.
fn write_lock(f: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: `flock` is a plain C struct of integers; all-zero is a valid value.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = libc::F_WRLCK as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_len = 1;
    // SAFETY: `f` is open; `l` is a valid flock that outlives the call.
    unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &l) == 0 }
}

/// Whether some open file description holds a write lock on byte 0 of the file at `path`.
fn write_locked(path: &str) -> bool {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: as in `write_lock`.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = libc::F_RDLCK as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_len = 1;
    // SAFETY: `f` is open; the kernel overwrites `l` in place.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_GETLK, &mut l) };
    assert_eq!(r, 0);
    l.l_type == libc::F_WRLCK as libc::c_short
}

#[test]
fn a_lock_another_user_takes_under_a_dead_producers_liveness_name_keeps_nothing_alive() {
    if let Some(r) = role() {
        return run_role(&r);
    }
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let test = "a_lock_another_user_takes_under_a_dead_producers_liveness_name_keeps_nothing_alive";
    let channel = format!("two-users-forged-{}", std::process::id());
    // Our producer (this user), in a process of its own, and a consumer here.
    let mut p = common::Peer::spawn(test, "producer", &[(CHANNEL, &channel)]);
    let ready = p.expect("ready", ANSWER);
    let w: Vec<&str> = ready.split_whitespace().collect();
    let their = ProcessIdentity {
        pid: w[0].parse().unwrap(),
        start_time: w[1].parse().unwrap(),
        ..ProcessIdentity::current().unwrap()
    };
    let c = ControlConsumer::attach(&channel, Delivery::EveryFrame).unwrap();
    let ours = rustix::process::geteuid().as_raw();
    assert_eq!(their.liveness_as(ours), Liveness::Alive);
    // Killed: its lock is free, and its file goes as `gc` removes it.
    let _ = p.child.kill();
    let _ = p.child.wait();
    assert!(cuda_ipc::raw::identity::remove_liveness_file_if_free(&their).unwrap());
    // The other user takes the name and locks it.
    let bin = BinaryForOthers::new(&channel);
    let mut f = {
        let mut cmd = Command::new(bin.exe());
        cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(common::ROLE, "forger")
            .env(FORGE, their.liveness_name())
            .env(CHANNEL, &channel)
            .current_dir("/")
            .uid(uid)
            .gid(gid);
        spawn_copy(cmd)
    };
    f.expect("locked", ANSWER);
    let path = their.liveness_path();
    assert_eq!(std::fs::metadata(&path).unwrap().uid(), uid);
    assert!(write_locked(&path), "the forged lock is held");

    // Here (the producer's own pid namespace) /proc decides: the pid is gone.
    assert_eq!(their.liveness_as(ours), Liveness::Dead);
    assert_eq!(their.liveness(), Liveness::Dead);
    // From another pid namespace /proc cannot answer; the forged file is not of the recorded uid.
    match common::unshare_works(&["--pid", "--fork", "--mount-proc"]) {
        Err(why) => println!("the other pid namespace's part skipped: {why}"),
        Ok(()) => {
            let who = format!("{} {} {} {ours}", their.pid, their.start_time, their.pid_ns);
            let mut r = Peer::spawn_under(
                &["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"],
                test,
                "ns-reader",
                &[(CHANNEL, &channel), (FORGE, &who)],
            );
            assert_eq!(r.expect("as-recorded", ANSWER), "Dead");
            // Without the recorded uid, the forged lock still counts (the weaker rule of
            // `liveness()`, for identities that carry no uid): the forgery is real.
            assert_eq!(r.expect("any-owner", ANSWER), "Alive");
            assert_eq!(r.expect("inspect", ANSWER), "Dead");
            let t = r.expect("take", ANSWER);
            assert!(t.contains("ProducerGone"), "{t}");
            r.finish(ANSWER);
        }
    }
    // Our consumer is told the producer is gone; gc would remove the channel; a restart may
    // replace it.
    let t = Instant::now();
    let e = c
        .take(Some(Duration::from_secs(5)))
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(e, Error::Channel(cuda_ipc::channel::ChannelError::ProducerGone { pid }) if pid == their.pid),
        "{e:?}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "answered in {:?}",
        t.elapsed()
    );
    assert_eq!(
        inspect::inspect(&channel).unwrap().producer_liveness,
        Liveness::Dead
    );
    let restarted = ControlProducer::create(&channel, 4096, 2, &tokens()).unwrap();
    restarted.close();
    restarted.unlink();
    f.send("quit");
    f.finish(ANSWER);
    assert!(std::fs::symlink_metadata(&path).is_err());
}

#[test]
fn another_user_can_neither_open_nor_replace_nor_remove_roots_channel() {
    if let Some(r) = role() {
        return run_role(&r);
    }
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let channel = format!("two-users-root-{}", std::process::id());
    let p = ControlProducer::create(&channel, 4096, 2, &tokens()).unwrap();
    let bin = BinaryForOthers::new(&channel);
    let mut b = spawn_as(
        &bin,
        uid,
        gid,
        "another_user_can_neither_open_nor_replace_nor_remove_roots_channel",
        "intruder",
        &channel,
    );
    for verb in ["attach", "create", "remove"] {
        let e = b.expect(verb, ANSWER);
        assert!(
            e.contains("WrongOwner")
                && e.contains("owner: 0")
                && e.contains(&format!("ours: {uid}")),
            "{verb}: {e}"
        );
    }
    b.finish(ANSWER);
    // Still ours and intact.
    let s = inspect::inspect(&channel).unwrap();
    assert_eq!(s.producer.pid, std::process::id());
    p.close();
    p.unlink();
}

#[test]
fn root_never_replaces_or_removes_another_users_live_channel_and_sees_its_liveness() {
    if let Some(r) = role() {
        return run_role(&r);
    }
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let channel = format!("two-users-theirs-{}", std::process::id());
    let path = format!("/dev/shm/{}", inspect::segment_name(&channel));
    let bin = BinaryForOthers::new(&channel);
    let mut b = spawn_as(
        &bin,
        uid,
        gid,
        "root_never_replaces_or_removes_another_users_live_channel_and_sees_its_liveness",
        "producer",
        &channel,
    );
    let ready = b.expect("ready", ANSWER);
    let w: Vec<&str> = ready.split_whitespace().collect();
    let their = ProcessIdentity {
        pid: w[0].parse().unwrap(),
        start_time: w[1].parse().unwrap(),
        ..ProcessIdentity::current().unwrap()
    };
    assert_eq!(their.liveness_name(), w[2]);
    assert_eq!(std::fs::metadata(&path).unwrap().uid(), uid);

    // Root creating a channel of that name: refused, naming the owner; nothing unlinked.
    let e = ControlProducer::create(&channel, 4096, 2, &tokens())
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(&e, Error::Shm(ShmError::WrongOwner { owner, .. }) if *owner == uid),
        "{e:?}"
    );
    // Inspection and gc's removal refuse it too (only one's own channels are trusted).
    for e in [
        inspect::inspect(&channel).map(|_| ()).unwrap_err(),
        reclaim::remove_stale(&channel).map(|_| ()).unwrap_err(),
    ] {
        assert!(
            matches!(&e, Error::Shm(ShmError::WrongOwner { owner, .. }) if *owner == uid),
            "{e:?}"
        );
    }
    assert_eq!(std::fs::metadata(&path).unwrap().uid(), uid, "still there");
    // Their process is alive by its lock (the liveness file is readable by all), then dead when
    // killed; only then may their channel be replaced, and by them alone.
    assert_eq!(their.liveness(), Liveness::Alive);
    let _ = b.child.kill();
    let _ = b.child.wait();
    let t = Instant::now();
    while their.liveness() != Liveness::Dead {
        assert!(t.elapsed() < Duration::from_secs(1), "still alive");
        std::thread::sleep(Duration::from_millis(5));
    }
    let e = ControlProducer::create(&channel, 4096, 2, &tokens())
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(&e, Error::Shm(ShmError::WrongOwner { .. })),
        "a dead user's channel is still theirs: {e:?}"
    );
    assert!(matches!(
        ControlConsumer::attach(&channel, Delivery::EveryFrame),
        Err(Error::Shm(ShmError::WrongOwner { .. }))
    ));
    // Clean up what the killed process left (as root, by hand: this is the test's own debris).
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(format!("/dev/shm/{}", their.liveness_name()));
}

#[test]
fn another_user_can_neither_read_nor_replace_nor_remove_roots_tensor_set() {
    if let Some(r) = role() {
        return run_role(&r);
    }
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let set = format!("two-users-set-{}", std::process::id());
    let mut w = TensorSetWriter::create_host(&set, &set_specs(), &TensorSetOptions::new()).unwrap();
    let mut u = w.begin(Some(ANSWER)).unwrap();
    u.write_at(0, &[7u8; 64]).unwrap();
    assert_eq!(u.commit().unwrap(), 1);
    let bin = BinaryForOthers::new(&set);
    let mut b = spawn_as(
        &bin,
        uid,
        gid,
        "another_user_can_neither_read_nor_replace_nor_remove_roots_tensor_set",
        "set-intruder",
        &set,
    );
    for verb in ["open", "create", "remove", "inspect"] {
        let e = b.expect(verb, ANSWER);
        assert!(
            e.contains("WrongOwner")
                && e.contains("owner: 0")
                && e.contains(&format!("ours: {uid}")),
            "{verb}: {e}"
        );
    }
    b.finish(ANSWER);
    // Still ours, whole, and readable by us.
    let r = TensorSetReader::open_host(&set, &ReaderOptions::new()).unwrap();
    let h = r.current().unwrap().expect("generation 1");
    assert_eq!(h.generation(), 1);
    drop(h);
    drop(r);
    w.close(ANSWER).unwrap();
}

#[test]
fn root_never_reads_replaces_or_removes_another_users_tensor_set() {
    if let Some(r) = role() {
        return run_role(&r);
    }
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let set = format!("two-users-their-set-{}", std::process::id());
    let bin = BinaryForOthers::new(&set);
    let mut b = spawn_as(
        &bin,
        uid,
        gid,
        "root_never_reads_replaces_or_removes_another_users_tensor_set",
        "set-writer",
        &set,
    );
    b.expect("ready", ANSWER);
    let manifest = format!("/dev/shm/{}{set}", tensorset::MANIFEST_PREFIX);
    assert_eq!(std::fs::metadata(&manifest).unwrap().uid(), uid);
    let owned_by_them =
        |e: &Error| matches!(e, Error::Shm(ShmError::WrongOwner { owner, .. }) if *owner == uid);
    let e = TensorSetReader::open_host(&set, &ReaderOptions::new())
        .map(|_| ())
        .unwrap_err();
    assert!(owned_by_them(&e), "open: {e:?}");
    let e = TensorSetWriter::create_host(&set, &set_specs(), &TensorSetOptions::new())
        .map(|_| ())
        .unwrap_err();
    assert!(owned_by_them(&e), "create: {e:?}");
    let e = tensorset::reclaim::remove_stale(&set)
        .map(|_| ())
        .unwrap_err();
    assert!(owned_by_them(&e), "remove: {e:?}");
    for prefix in [
        tensorset::MANIFEST_PREFIX,
        tensorset::GENERATION_PREFIX,
        tensorset::DATA_PREFIX,
    ] {
        let p = format!("/dev/shm/{prefix}{set}");
        assert_eq!(
            std::fs::metadata(&p).unwrap().uid(),
            uid,
            "{p} still theirs"
        );
    }
    b.send("quit");
    b.finish(ANSWER);
    for prefix in [
        tensorset::MANIFEST_PREFIX,
        tensorset::GENERATION_PREFIX,
        tensorset::DATA_PREFIX,
    ] {
        assert!(
            std::fs::metadata(format!("/dev/shm/{prefix}{set}")).is_err(),
            "their close removed {prefix}"
        );
    }
}

#[test]
fn another_user_can_neither_claim_a_slot_of_roots_holders_segment_nor_plant_one_root_trusts() {
    if let Some(r) = role() {
        return run_role(&r);
    }
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let test =
        "another_user_can_neither_claim_a_slot_of_roots_holders_segment_nor_plant_one_root_trusts";
    let set = format!("two-users-held-{}", std::process::id());
    let holders = format!("/dev/shm/{}{set}", tensorset::HOLDERS_PREFIX);
    let manifest = format!("/dev/shm/{}{set}", tensorset::MANIFEST_PREFIX);
    let f = HeldSetFixture::create(&set, 1).unwrap();
    let mine = f.claim(HolderRole::Holder).unwrap();
    let bin = BinaryForOthers::new(&set);
    let wrong_owner = |e: &str, owner: u32, ours: u32| {
        e.contains("WrongOwner")
            && e.contains(&format!("owner: {owner}"))
            && e.contains(&format!("ours: {ours}"))
    };
    // Their claim: refused by the owner check, directly and as a holder (the manifest first).
    let mut c = spawn_as(&bin, uid, gid, test, "th-claimer", &set);
    for verb in ["open", "holder"] {
        let e = c.expect(verb, ANSWER);
        assert!(wrong_owner(&e, 0, uid), "{verb}: {e}");
    }
    c.finish(ANSWER);
    let slots = f.holders();
    assert_eq!(slots.len(), 1, "{slots:?}");
    assert_eq!((slots[0].slot, slots[0].uid), (mine, 0));
    // Root's holders segment gone (its own, removed here), theirs planted under the name.
    std::fs::remove_file(&holders).unwrap();
    let mut p = spawn_as(&bin, uid, gid, test, "th-planter", &set);
    p.expect("planted", ANSWER);
    assert_eq!(std::fs::metadata(&holders).unwrap().uid(), uid);
    let theirs =
        |e: &Error| matches!(e, Error::Shm(ShmError::WrongOwner { owner, .. }) if *owner == uid);
    // A root holder, a root writer making the set's holders segment, root's tools: refused.
    let e = tensorset::Holder::open(&set).map(|_| ()).unwrap_err();
    assert!(theirs(&e), "holder: {e:?}");
    let e = HeldSetFixture::create_holders(&set, 1)
        .map(|_| ())
        .unwrap_err();
    assert!(theirs(&e), "writer's create: {e:?}");
    let e = HeldSetFixture::open(&set).map(|_| ()).unwrap_err();
    assert!(theirs(&e), "open: {e:?}");
    // Their process ends, its segment left: root's gc neither frees its slot nor removes it.
    p.send("quit");
    p.finish(ANSWER);
    for e in [
        tensorset::reclaim::remove_stale(&set)
            .map(|_| ())
            .unwrap_err(),
        tensorset::reclaim::release_dead_holders(&set)
            .map(|_| ())
            .unwrap_err(),
        HeldSetFixture::create_holders(&set, 1)
            .map(|_| ())
            .unwrap_err(),
    ] {
        assert!(theirs(&e), "{e:?}");
    }
    let scope =
        cuda_ipc::cleanup::Scope::only(Vec::new(), Vec::new()).with_tensor_sets(vec![set.clone()]);
    let scan = cuda_ipc::cleanup::scan(&scope).unwrap();
    assert!(scan.leftovers.is_empty(), "{:?}", scan.leftovers);
    assert!(
        scan.problems.iter().any(|p| theirs(&p.error)),
        "{:?}",
        scan.problems
    );
    // Root's set, with their file in it: a problem, and their part said as passed over, as a
    // scan of everything says it.
    let planted = format!("{}{set}", tensorset::HOLDERS_PREFIX);
    assert!(
        scan.skipped
            .iter()
            .any(|s| s.name == planted && s.uid == uid && s.what == "tensor set part"),
        "{:?}",
        scan.skipped
    );
    assert!(
        cuda_ipc::cleanup::remove(&scan.leftovers)
            .removed
            .is_empty()
    );
    assert_eq!(
        std::fs::metadata(&holders).unwrap().uid(),
        uid,
        "still theirs"
    );
    assert_eq!(
        std::fs::metadata(&manifest).unwrap().uid(),
        0,
        "root's manifest stays"
    );
    // The test's own debris, by hand.
    f.unlink();
    let _ = std::fs::remove_file(&holders);
}

/// A scan that names another user's channel and tensor set (live, then their producer killed)
/// passes them over as a scan of everything does: the same `Scan::skipped` entries, never
/// inspected, no problem, no leftover, nothing removed. Before, each named object was a problem
/// (`WrongOwner`) while the scan of everything skipped it.
#[test]
fn a_scan_naming_another_users_channel_and_tensor_set_passes_them_over_as_a_scan_of_everything() {
    use cuda_ipc::cleanup::{self, Scope};
    if let Some(r) = role() {
        return run_role(&r);
    }
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let test = "a_scan_naming_another_users_channel_and_tensor_set_passes_them_over_as_a_scan_of_everything";
    let channel = format!("two-users-named-ch-{}", std::process::id());
    let set = format!("two-users-named-ts-{}", std::process::id());
    let bin = BinaryForOthers::new(&channel);
    let mut p = spawn_as(&bin, uid, gid, test, "producer", &channel);
    let ready = p.expect("ready", ANSWER);
    let liveness = ready.split_whitespace().nth(2).unwrap().to_string();
    let mut w = spawn_as(&bin, uid, gid, test, "set-writer", &set);
    w.expect("ready", ANSWER);
    let segment = inspect::segment_name(&channel);
    let parts: Vec<String> = [
        tensorset::MANIFEST_PREFIX,
        tensorset::GENERATION_PREFIX,
        tensorset::DATA_PREFIX,
        tensorset::HOLDERS_PREFIX,
    ]
    .iter()
    .map(|p| format!("{p}{set}"))
    .filter(|n| std::fs::metadata(format!("/dev/shm/{n}")).is_ok())
    .collect();
    assert!(
        parts.len() >= 3,
        "a host set's manifest, generation channel, data: {parts:?}"
    );
    let mut names: Vec<&String> = parts.iter().chain([&segment]).collect();
    names.sort();
    let scope = Scope::only(Vec::new(), vec![channel.clone()]).with_tensor_sets(vec![set.clone()]);
    let check = |when: &str| {
        let scan = cleanup::scan(&scope).unwrap();
        assert!(scan.problems.is_empty(), "{when}: {:?}", scan.problems);
        assert!(scan.leftovers.is_empty(), "{when}: {:?}", scan.leftovers);
        assert!(scan.kept.is_empty(), "{when}: {:?}", scan.kept);
        let everything: Vec<_> = cleanup::others(&Scope::everything())
            .unwrap()
            .into_iter()
            .filter(|s| names.contains(&&s.name))
            .collect();
        assert_eq!(
            scan.skipped, everything,
            "{when}: the entries of a scan of everything"
        );
        let got: Vec<&String> = scan.skipped.iter().map(|s| &s.name).collect();
        assert_eq!(got, names, "{when}");
        for s in &scan.skipped {
            assert_eq!(
                (s.uid, s.dead, s.owner),
                (uid, false, None),
                "{when}: {s:?}"
            );
            let what = if s.name == segment {
                "channel segment"
            } else {
                "tensor set part"
            };
            assert_eq!(s.what, what, "{when}: {s:?}");
        }
        assert!(cleanup::remove(&scan.leftovers).removed.is_empty());
    };
    check("live");
    // Their producer killed: their channel is a dead producer's, still theirs to clean.
    let _ = p.child.kill();
    let _ = p.child.wait();
    check("their producer dead");
    for n in &names {
        let m = std::fs::metadata(format!("/dev/shm/{n}")).unwrap();
        assert_eq!(m.uid(), uid, "{n} still theirs");
    }
    w.send("quit");
    w.finish(ANSWER);
    // The test's own debris, by hand.
    let _ = std::fs::remove_file(format!("/dev/shm/{segment}"));
    let _ = std::fs::remove_file(format!("/dev/shm/{liveness}"));
}

/// Another user's FIFO, directory or symbolic link under one of our names (a channel's control
/// segment, a host pool, a tensor set's part) blocks that object's creation as their segment
/// would: a scan, of everything or naming the object, passes it over into `Scan::skipped` by what
/// it is (never a problem, never removed), so `gc` and `ls` say it is there. Before, only their
/// regular files were listed, and these went unmentioned.
#[test]
fn another_users_fifo_directory_or_link_under_our_names_is_passed_over_by_what_it_is() {
    use cuda_ipc::cleanup::{self, Scope};
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let base = format!("two-users-blocker-{}", std::process::id());
    let planted = [
        (
            format!("cuda-ipc.ch.{base}-ch"),
            "FIFO",
            format!("{base}-ch"),
        ),
        (
            format!("cuda-ipc.hp.{base}-hp"),
            "directory",
            format!("{base}-hp"),
        ),
        (
            format!("cuda-ipc.tg.{base}-ts"),
            "symbolic link",
            format!("{base}-ts"),
        ),
    ];
    let path = |n: &str| format!("/dev/shm/{n}");
    for (n, what, _) in &planted {
        match *what {
            "FIFO" => {
                let c = std::ffi::CString::new(path(n)).unwrap();
                // SAFETY: `c` is a valid NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            }
            "directory" => std::fs::create_dir(path(n)).unwrap(),
            _ => std::os::unix::fs::symlink("/nonexistent", path(n)).unwrap(),
        }
        std::os::unix::fs::lchown(path(n), Some(uid), Some(gid)).unwrap();
    }
    let names: Vec<&str> = planted.iter().map(|p| p.0.as_str()).collect();
    let everything = cleanup::scan(&Scope::everything()).unwrap();
    let named = cleanup::scan(
        &Scope::only(Vec::new(), vec![planted[0].2.clone(), planted[1].2.clone()])
            .with_tensor_sets(vec![planted[2].2.clone()]),
    )
    .unwrap();
    for (when, scan) in [("everything", &everything), ("named", &named)] {
        for (n, what, _) in &planted {
            let s = scan.skipped.iter().find(|s| &s.name == n);
            assert!(
                s.is_some_and(|s| s.uid == uid && s.what == *what && !s.dead),
                "{when}: {n}: {s:?} in {:?}",
                scan.skipped
            );
        }
        assert!(
            !scan
                .problems
                .iter()
                .any(|p| names.iter().any(|n| p.error.to_string().contains(n))),
            "{when}: {:?}",
            scan.problems
        );
    }
    for n in &names {
        assert!(std::fs::symlink_metadata(path(n)).is_ok(), "{n} removed");
        let _ = std::fs::remove_dir(path(n));
        let _ = std::fs::remove_file(path(n));
    }
}

/// Another user's file (here root's, mode 0600) or symbolic link under the liveness file name of
/// a process about to use the crate makes its identity fail with an error naming what stands there
/// and whose it is: the open of another user's file is `EACCES`, which said only "Permission
/// denied", as does the open of a link another user planted where the kernel's
/// `protected_symlinks` is on. Nothing is followed or removed (docs/guide.md, "Known limits").
#[test]
fn another_users_file_under_a_starting_processs_liveness_name_is_named_in_its_error() {
    if let Some(r) = role() {
        return run_role(&r);
    }
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let test = "another_users_file_under_a_starting_processs_liveness_name_is_named_in_its_error";
    let bin = BinaryForOthers::new("first-use");
    for (kind, words) in [
        ("file", "a file of uid 0 (this process runs as uid"),
        ("link", "a symbolic link of uid 0 (this process runs as uid"),
    ] {
        let mut p = spawn_as(&bin, uid, gid, test, "first-use", "unused");
        let pid = p.child.id();
        let t = Instant::now();
        let start_time = loop {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let field = stat
                .rfind(')')
                .and_then(|at| stat[at + 1..].split_ascii_whitespace().nth(19))
                .and_then(|s| s.parse::<u64>().ok());
            if let Some(s) = field {
                break s;
            }
            assert!(t.elapsed() < ANSWER);
        };
        let path = ProcessIdentity {
            pid,
            start_time,
            ..ProcessIdentity::current().unwrap()
        }
        .liveness_path();
        match kind {
            "file" => {
                use std::os::unix::fs::OpenOptionsExt;
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)
                    .unwrap();
            }
            _ => std::os::unix::fs::symlink("/nonexistent", &path).unwrap(),
        }
        p.send("go");
        let said = p.expect("error", ANSWER);
        p.finish(ANSWER);
        let m = std::fs::symlink_metadata(&path).map(|m| m.uid());
        let _ = std::fs::remove_file(&path);
        assert_eq!(m.ok(), Some(0), "{kind}: not left as it was");
        assert!(
            said.contains(&format!(
                "{words} {uid}) holds this process's liveness file name"
            )),
            "{kind}: {said}"
        );
    }
}

/// The start time (`/proc/PID/stat` field 22) of the running process `pid`.
fn start_time_of(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 1..];
    after.split_whitespace().nth(19).unwrap().parse().unwrap()
}

#[test]
fn root_cleans_another_users_killed_processs_liveness_file_but_nothing_else_under_such_a_name() {
    use cuda_ipc::cleanup::{self, LeftoverKind, Scope};
    use cuda_ipc::identity::{self, LivenessFile};
    if let Some(r) = role() {
        return run_role(&r);
    }
    let Some((uid, gid)) = test_user() else {
        return;
    };
    let test = "root_cleans_another_users_killed_processs_liveness_file_but_nothing_else_under_such_a_name";
    let me = ProcessIdentity::current().unwrap();
    // A genuine liveness file of the other user's killed process.
    let bin = BinaryForOthers::new("live-files");
    let mut p = spawn_as(&bin, uid, gid, test, "live", "unused");
    let ready = p.expect("ready", ANSWER);
    let w: Vec<&str> = ready.split_whitespace().collect();
    let killed = ProcessIdentity {
        pid: w[0].parse().unwrap(),
        start_time: w[1].parse().unwrap(),
        ..me
    };
    let _ = p.child.kill();
    let _ = p.child.wait();
    assert_eq!(
        std::fs::metadata(killed.liveness_path()).unwrap().uid(),
        uid
    );
    // Dead pids, for names another user plants under: exited children of ours.
    let dead_pid = || {
        let mut c = Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        pid
    };
    let named = |pid: u32, start_time: u64| ProcessIdentity {
        pid,
        start_time,
        ..me
    };
    let precious = named(dead_pid(), 1);
    let wrong_mode = named(dead_pid(), 2);
    let linked = named(dead_pid(), 3);
    // A process that runs (in our pid namespace, with its start time) and holds no lock on a file
    // planted under its name: alive, not dead.
    let mut running = Command::new("sleep").arg("30").spawn().unwrap();
    let alive = named(running.id(), start_time_of(running.id()));
    let plant = |path: &str, bytes: &[u8], mode: u32| {
        std::fs::write(path, bytes).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
    };
    plant(&precious.liveness_path(), b"my precious data", 0o644);
    plant(&wrong_mode.liveness_path(), b"", 0o600);
    plant(&alive.liveness_path(), b"", 0o644);
    let target = format!("/dev/shm/two-users-precious-{}", std::process::id());
    plant(&target, b"my precious data", 0o644);
    std::os::unix::fs::symlink(&target, linked.liveness_path()).unwrap();
    std::os::unix::fs::lchown(linked.liveness_path(), Some(uid), Some(gid)).unwrap();
    // Old enough for `gc`.
    std::thread::sleep(identity::LIVENESS_FILE_GRACE + Duration::from_millis(500));

    let stale: Vec<String> = identity::stale_liveness_files()
        .unwrap()
        .into_iter()
        .map(|f| f.name)
        .collect();
    assert!(stale.contains(&killed.liveness_name()), "{stale:?}");
    for id in [&precious, &wrong_mode, &linked, &alive] {
        assert!(!stale.contains(&id.liveness_name()), "{stale:?}");
    }
    let foreign = identity::not_liveness_files().unwrap();
    for (id, what) in [
        (&precious, "a file of 16 bytes"),
        (&wrong_mode, "a file of mode 0600"),
        (&linked, "a symbolic link"),
    ] {
        assert!(
            foreign
                .iter()
                .any(|f| f.name == id.liveness_name() && f.uid == uid && f.what == what),
            "{foreign:?}"
        );
    }
    assert!(
        !foreign.iter().any(|f| f.name == alive.liveness_name()),
        "{foreign:?}"
    );
    // Removal named directly (a mistaken or forged listing) refuses each.
    for id in [&precious, &wrong_mode, &linked, &alive] {
        let f = LivenessFile {
            name: id.liveness_name(),
            identity: *id,
            uid,
        };
        assert!(!identity::remove_stale_liveness_file(&f).unwrap());
        assert!(std::fs::symlink_metadata(id.liveness_path()).is_ok());
    }
    // `gc`'s scan names the planted ones as problems, not leftovers; its removal takes the
    // genuine one only.
    let scan = cleanup::scan(&Scope::everything()).unwrap();
    let ours: Vec<_> = scan
        .leftovers
        .iter()
        .filter(|l| l.kind == LeftoverKind::LivenessFile)
        .filter(|l| {
            [&killed, &precious, &wrong_mode, &linked, &alive]
                .iter()
                .any(|id| l.object == id.liveness_name())
        })
        .cloned()
        .collect();
    assert_eq!(ours.len(), 1, "{ours:?}");
    assert_eq!(ours[0].object, killed.liveness_name());
    for id in [&precious, &wrong_mode, &linked] {
        assert!(
            scan.problems
                .iter()
                .any(|p| p.subject.contains(&id.liveness_name())),
            "{:?}",
            scan.problems
        );
    }
    let removal = cleanup::remove(&ours);
    assert_eq!(removal.removed.len(), 1, "{removal:?}");
    assert!(std::fs::symlink_metadata(killed.liveness_path()).is_err());
    assert_eq!(
        std::fs::read(precious.liveness_path()).unwrap(),
        b"my precious data"
    );
    assert_eq!(std::fs::read(&target).unwrap(), b"my precious data");
    for id in [&wrong_mode, &linked, &alive] {
        assert!(std::fs::symlink_metadata(id.liveness_path()).is_ok());
    }
    let _ = running.kill();
    let _ = running.wait();
    for id in [&precious, &wrong_mode, &linked, &alive] {
        let _ = std::fs::remove_file(id.liveness_path());
    }
    let _ = std::fs::remove_file(&target);
}
