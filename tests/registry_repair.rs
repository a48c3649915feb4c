//! The torn window of a repair, raced by processes: a writer killed half-way through a record, a
//! repairer stopped (and then killed) at each step of its repair, and readers copying the slot in
//! loops all along. Every token carries its own checksum, so a reader that were ever handed the
//! half-written record would notice. The children are this test binary re-executed, stopped at the
//! library's test points (`cuda_ipc::raw::registry_test_hooks::set_test_hook`).

mod common;

use common::{Peer, Unlink, role, tell, unique};
use cuda_ipc::raw::registry_test_hooks::{TestPoint, set_test_hook};
use cuda_ipc::registry::{Registry, RegistryOptions, inspect};
use std::time::{Duration, Instant};

const TEST: &str =
    "no_reader_sees_a_torn_record_while_writers_and_repairers_die_at_the_worst_points";
const REG: &str = "CUDA_IPC_TEST_REPAIR_REGISTRY";
const STOP: &str = "CUDA_IPC_TEST_REPAIR_STOP";

fn opts() -> RegistryOptions {
    RegistryOptions::new()
        .capacity(4)
        .participants(16)
        .lock_timeout(Duration::from_millis(50))
}

/// A full-size token (256 bytes) whose last four bytes are the CRC-32 of the others; every byte
/// depends on `v`, so any mix of two versions fails the check.
fn checked_token(v: u64) -> Vec<u8> {
    let mut t: Vec<u8> = (0..252u64)
        .map(|i| {
            (v.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .rotate_left(i as u32 % 64)
                ^ i) as u8
        })
        .collect();
    let c = crc32fast::hash(&t);
    t.extend_from_slice(&c.to_le_bytes());
    t
}

fn token_ok(t: &[u8]) -> bool {
    t.len() == 256 && crc32fast::hash(&t[..252]).to_le_bytes() == t[252..]
}

/// The test hook in a child: at the point named by `STOP`, tell the parent and wait to be killed.
fn stop_here(p: TestPoint) {
    let want = std::env::var(STOP).unwrap_or_default();
    if format!("{p:?}") == want {
        tell(format!("paused at {p:?}"));
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
}

fn child(role: &str) {
    let name = std::env::var(REG).unwrap();
    let reg = Registry::open(&name, &opts()).unwrap();
    match role {
        "writer" => {
            set_test_hook(stop_here);
            reg.publish("r", 2, &checked_token(2), b"").unwrap();
            panic!("the writer was to stop half-way");
        }
        "repairer" => {
            set_test_hook(stop_here);
            // The read finds the write left open by the dead writer and repairs it.
            let _ = reg.get("r");
            let _ = reg.list();
            panic!("the repairer was to stop");
        }
        "reader" | "watcher" => {
            let repairs = role == "reader";
            let until = Instant::now() + Duration::from_millis(1500);
            let (mut reads, mut torn, mut none, mut errors) = (0u64, 0u64, 0u64, 0u64);
            let mut check = |t: &[u8]| {
                reads += 1;
                if !token_ok(t) {
                    torn += 1;
                    eprintln!("torn token: {t:?}");
                }
            };
            while Instant::now() < until {
                // Inspection copies under the seqlock and never repairs; `get` and `list` repair
                // what a dead writer or repairer left.
                match inspect::inspect(&name) {
                    Ok(s) => s.records.iter().for_each(|r| check(&r.record.token)),
                    Err(_) => errors += 1,
                }
                if !repairs {
                    continue;
                }
                match reg.get("r") {
                    Ok(Some(r)) => check(&r.token),
                    Ok(None) => none += 1,
                    Err(_) => errors += 1,
                }
                if let Ok(all) = reg.list() {
                    all.iter().for_each(|r| check(&r.token));
                }
            }
            tell(format!(
                "done reads={reads} torn={torn} none={none} errors={errors}"
            ));
        }
        other => panic!("unknown role {other}"),
    }
}

fn value(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

fn kill(mut p: Peer) {
    let _ = p.child.kill();
    let _ = p.child.wait();
}

#[test]
fn no_reader_sees_a_torn_record_while_writers_and_repairers_die_at_the_worst_points() {
    if let Some(r) = role() {
        return child(&r);
    }
    let t = Duration::from_secs(20);
    for stop in [
        "RepairAdopted",
        "RepairHalfCleared",
        "RepairCleared",
        "RepairClosed",
    ] {
        let name = unique("repair");
        let _u = Unlink(name.clone());
        let reg = Registry::create(&name, &opts()).unwrap();
        reg.publish("r", 1, &checked_token(1), b"").unwrap();
        // Readers that never repair (inspection) run through everything.
        let watcher = Peer::spawn(TEST, "watcher", &[(REG, &name)]);
        // A writer stopped half-way through its record, then killed.
        let mut w = Peer::spawn(TEST, "writer", &[(REG, &name), (STOP, "WriteHalfStored")]);
        w.expect("paused at WriteHalfStored", t);
        kill(w);
        // A repairer stopped at `stop`: the slot is mid-repair, its lock held by a live process.
        let mut rep = Peer::spawn(TEST, "repairer", &[(REG, &name), (STOP, stop)]);
        rep.expect(&format!("paused at {stop}"), t);
        let readers: Vec<Peer> = (0..2)
            .map(|_| Peer::spawn(TEST, "reader", &[(REG, &name)]))
            .collect();
        std::thread::sleep(Duration::from_millis(400));
        // The repairer dies there; the readers (or we) take its lock over and finish.
        kill(rep);
        std::thread::sleep(Duration::from_millis(300));
        let seq = reg.publish("r", 3, &checked_token(3), b"").unwrap();
        let got = reg.get("r").unwrap().unwrap();
        assert_eq!((got.seq, got.token), (seq, checked_token(3)));
        for mut p in readers.into_iter().chain([watcher]) {
            let line = p.expect("done", t);
            assert_eq!(value(&line, "torn"), 0, "{stop}: {line}");
            assert!(value(&line, "reads") > 0, "{stop}: {line}");
            p.finish(t);
        }
        let rep = reg.reclaim_dead().unwrap();
        assert_eq!(rep.kept_unknown, 0, "{rep:?}");
        assert!(reg.list().unwrap().iter().all(|r| token_ok(&r.token)));
    }
}
