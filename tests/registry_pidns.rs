//! Publisher and reader in different pid namespaces sharing `/dev/shm`, as containers of one pod
//! are: one child is this test binary re-executed under `unshare --pid --fork --mount-proc`, where
//! it is pid 1 and every pid number of the other side means another process (or none). Neither
//! side's `reclaim_dead` may remove anything of a live process of the other, and each side's
//! removes what a `kill -9`ed process of the other left. Skipped (with the reason) where
//! `unshare` is missing or not permitted.

mod common;

use common::{Peer, Unlink, parent_lines, role, tell, unique};
use cuda_ipc::identity::{Liveness, ProcessIdentity};
use cuda_ipc::raw::registry_test_hooks::{TestPoint, set_test_hook};
use cuda_ipc::registry::{Registry, RegistryOptions};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const TEST: &str = "reclaim_across_pid_namespaces_removes_only_what_dead_processes_left";
const REG: &str = "CUDA_IPC_TEST_PIDNS_REGISTRY";
const REC: &str = "CUDA_IPC_TEST_PIDNS_RECORD";
const T: Duration = Duration::from_secs(20);

fn opts() -> RegistryOptions {
    RegistryOptions::new()
        .capacity(16)
        .participants(8)
        .lock_timeout(Duration::from_millis(300))
}

static ARMED: AtomicBool = AtomicBool::new(false);

/// Stops a "hold" publish half-way, holding the table and slot locks, until the process is killed.
fn stop_half_way(p: TestPoint) {
    if p == TestPoint::WriteHalfStored && ARMED.load(Ordering::SeqCst) {
        tell("paused");
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
}

fn report(r: &cuda_ipc::registry::ReclaimReport) -> String {
    format!(
        "records={} half_written={} participants={} kept_unknown={}",
        r.records, r.half_written, r.participants, r.kept_unknown
    )
}

/// A peer (in either namespace): publishes its record, then obeys the parent's lines.
fn peer() {
    let reg = Registry::open(&std::env::var(REG).unwrap(), &opts()).unwrap();
    let rec = std::env::var(REC).unwrap();
    reg.publish(&rec, 1, b"token", b"").unwrap();
    set_test_hook(stop_half_way);
    let me = ProcessIdentity::current().unwrap();
    tell(format!("ready pid={} pid_ns={}", me.pid, me.pid_ns));
    for line in parent_lines() {
        match line.as_str() {
            "reclaim" => match reg.reclaim_dead() {
                Ok(r) => tell(format!("reclaimed {}", report(&r))),
                Err(e) => tell(format!("reclaimed error {e}")),
            },
            "names" => {
                let mut n: Vec<String> = reg.list().unwrap().into_iter().map(|r| r.name).collect();
                n.sort();
                tell(format!("names {}", n.join(",")));
            }
            "hold" => {
                ARMED.store(true, Ordering::SeqCst);
                reg.publish(&format!("{rec}-half"), 1, &[7; 256], &[7; 128])
                    .unwrap();
                panic!("the publish was to stop half-way");
            }
            other => panic!("unknown command {other}"),
        }
    }
}

fn value(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

fn counts(line: &str) -> [u64; 4] {
    assert!(!line.contains("error"), "{line}");
    ["records", "half_written", "participants", "kept_unknown"].map(|k| value(line, k))
}

fn ask_reclaim(p: &mut Peer) -> [u64; 4] {
    p.send("reclaim");
    counts(&p.expect("reclaimed", T))
}

fn spawn_peer(name: &str, rec: &str, in_new_namespace: bool) -> Peer {
    let exe = std::env::current_exe().unwrap();
    let args = [TEST, "--exact", "--nocapture", "--test-threads=1"];
    let mut cmd = if in_new_namespace {
        let mut c = Command::new("unshare");
        c.args(["--pid", "--fork", "--mount-proc"])
            .arg(&exe)
            .args(args);
        c
    } else {
        let mut c = Command::new(&exe);
        c.args(args);
        c
    };
    cmd.env(common::ROLE, "peer").env(REG, name).env(REC, rec);
    Peer::from_command(cmd)
}

/// The process `unshare --fork` started (pid 1 of the new namespace), by its host pid.
fn namespace_init(unshare: u32) -> u32 {
    let t = Instant::now();
    loop {
        let path = format!("/proc/{unshare}/task/{unshare}/children");
        if let Ok(s) = std::fs::read_to_string(&path)
            && let Some(pid) = s.split_whitespace().next().and_then(|p| p.parse().ok())
        {
            return pid;
        }
        assert!(t.elapsed() < T, "no child of unshare ({path})");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn kill9(pid: u32) {
    // SAFETY: kill has no memory-safety preconditions; `pid` is a child of this test.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
}

fn reap(mut p: Peer) {
    let t = Instant::now();
    while p.child.try_wait().unwrap().is_none() {
        assert!(t.elapsed() < T, "peer did not exit after SIGKILL");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn unshare_works() -> Result<(), String> {
    match Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .output()
    {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "unshare --pid --fork --mount-proc failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("unshare not runnable: {e}")),
    }
}

#[test]
fn reclaim_across_pid_namespaces_removes_only_what_dead_processes_left() {
    if let Some(r) = role() {
        assert_eq!(r, "peer");
        return peer();
    }
    if let Err(why) = unshare_works() {
        eprintln!("skipped: {why}");
        return;
    }
    let name = unique("pidns");
    let _u = Unlink(name.clone());
    let reg = Registry::create(&name, &opts()).unwrap();
    reg.publish("host", 1, b"token", b"").unwrap();
    let me = ProcessIdentity::current().unwrap();

    let mut ns = spawn_peer(&name, "ns", true);
    let ready = ns.expect("ready", T);
    assert_eq!(value(&ready, "pid"), 1, "{ready}");
    assert_ne!(value(&ready, "pid_ns"), u64::from(me.pid_ns), "{ready}");
    let ns_host_pid = namespace_init(ns.child.id());
    let mut host = spawn_peer(&name, "h", false);
    host.expect("ready", T);

    // Everyone alive: nothing goes, from either side, whatever /proc says about pid 1.
    assert_eq!(reg.reclaim_dead().unwrap(), Default::default());
    assert_eq!(ask_reclaim(&mut ns), [0; 4]);
    let ns_rec = reg.get("ns").unwrap().unwrap();
    assert_eq!(ns_rec.owner.pid, 1);
    assert_eq!(ns_rec.owner_liveness(), Liveness::Alive);
    assert_eq!(reg.participants().len(), 3);

    // The host peer stops half-way through a new record, holding the table and a slot lock: a
    // live writer, from both sides.
    host.send("hold");
    host.expect("paused", T);
    assert_eq!(reg.reclaim_dead().unwrap(), Default::default());
    assert_eq!(ask_reclaim(&mut ns), [0; 4]);

    // Killed: the namespace side removes its record, its half-written record and its entry.
    kill9(host.child.id());
    reap(host);
    assert_eq!(ask_reclaim(&mut ns), [1, 1, 1, 0]);
    assert!(reg.get("h").unwrap().is_none());
    ns.send("names");
    assert_eq!(ns.expect("names", T), "host,ns");

    // And the other way: the namespace peer stops half-way, is alive, then is killed.
    ns.send("hold");
    ns.expect("paused", T);
    assert_eq!(reg.reclaim_dead().unwrap(), Default::default());
    kill9(ns_host_pid);
    reap(ns);
    let rep = reg.reclaim_dead().unwrap();
    assert_eq!(
        [
            rep.records,
            rep.half_written,
            rep.participants,
            rep.kept_unknown
        ],
        [1, 1, 1, 0],
        "{rep:?}"
    );
    let names: Vec<String> = reg.list().unwrap().into_iter().map(|r| r.name).collect();
    assert_eq!(names, ["host"]);
    assert_eq!(reg.participants(), vec![me]);
    // The locks the dead peers held do not block anyone.
    let t = Instant::now();
    reg.publish("after", 1, b"", b"").unwrap();
    assert!(t.elapsed() < Duration::from_secs(2));
}
