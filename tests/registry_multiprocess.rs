//! The registry shared by separate processes (this test binary re-executed as children): many
//! writers and readers on the same names, writers killed mid-write, readers killed mid-wait.

mod common;

use common::{REG, Unlink, finish, role, spawn_child, unique, value};
use cuda_ipc::raw::shm::{self, Segment, SegmentOptions};
use cuda_ipc::registry::{Record, Registry, RegistryOptions};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const NAMES: [&str; 4] = [
    "cam/0",
    "cam/1",
    "tensor",
    "a-much-longer-record-name-for-the-slot-bytes",
];

fn opts() -> RegistryOptions {
    RegistryOptions::new()
        .capacity(16)
        .participants(32)
        .lock_timeout(Duration::from_secs(5))
}

fn env_u64(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The record a writer publishes for value `v`: every byte derives from `v` and the writer id, so a
/// reader can check a record it got is whole.
fn make(v: u64, writer: u32) -> (Vec<u8>, Vec<u8>) {
    let tlen = 1 + (v % 256) as usize;
    let token: Vec<u8> = (0..tlen)
        .map(|i| (v as u8).wrapping_mul(31).wrapping_add(i as u8) ^ writer as u8)
        .collect();
    let mut meta = Vec::with_capacity(128);
    meta.extend_from_slice(&v.to_le_bytes());
    meta.extend_from_slice(&writer.to_le_bytes());
    meta.extend_from_slice(&(tlen as u16).to_le_bytes());
    meta.resize(14 + (v % 100) as usize, (v >> 3) as u8);
    (token, meta)
}

/// Whether a record read back is one that a writer made whole.
fn whole(r: &Record) -> bool {
    if r.metadata.len() < 14 || !NAMES.contains(&r.name.as_str()) {
        return false;
    }
    let v = u64::from_le_bytes(r.metadata[..8].try_into().unwrap());
    let writer = u32::from_le_bytes(r.metadata[8..12].try_into().unwrap());
    let (token, meta) = make(v, writer);
    writer == r.kind && token == r.token && meta == r.metadata
}

fn writer_child(reg: &Registry, id: u32, until: Instant) {
    let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (u64::from(id) * 0x1234_5678_9abc);
    let mut last: HashMap<&str, u64> = HashMap::new();
    let mut writes = 0u64;
    let mut v = u64::from(id) << 40;
    while Instant::now() < until {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let name = NAMES[(rng % 4) as usize];
        v += 1;
        let (token, meta) = make(v, id);
        let seq = reg.publish(name, id, &token, &meta).unwrap();
        if let Some(prev) = last.insert(name, seq) {
            assert!(seq > prev, "{name}: sequence {seq} after {prev}");
        }
        writes += 1;
    }
    println!("writes={writes}");
}

fn reader_child(reg: &Registry, mode: u64, until: Instant) {
    let mut seen: HashMap<String, u64> = HashMap::new();
    let (mut reads, mut torn, mut backwards) = (0u64, 0u64, 0u64);
    let mut check = |r: &Record| {
        reads += 1;
        if !whole(r) {
            torn += 1;
            eprintln!("torn record: {r:?}");
        }
        if let Some(prev) = seen.insert(r.name.clone(), r.seq)
            && r.seq < prev
        {
            backwards += 1;
        }
    };
    let mut k = 0usize;
    while Instant::now() < until {
        k += 1;
        match mode {
            0 => {
                if let Some(r) = reg.get(NAMES[k % 4]).unwrap() {
                    check(&r);
                }
            }
            1 => reg.list().unwrap().iter().for_each(&mut check),
            _ => {
                let name = NAMES[k % 4];
                let after = reg.get(name).unwrap().map_or(0, |r| r.seq);
                if let Ok(r) = reg.wait_for(name, after, Duration::from_millis(200)) {
                    assert!(r.seq > after);
                    check(&r);
                }
            }
        }
    }
    println!("reads={reads} torn={torn} backwards={backwards}");
}

fn child_main(role: &str) {
    let name = std::env::var(REG).unwrap();
    let reg = Registry::open(&name, &opts()).unwrap();
    let until = Instant::now() + Duration::from_millis(env_u64("RUN_MS", 1000));
    let id = env_u64("ID", 0) as u32;
    match role {
        "writer" => writer_child(&reg, id, until),
        "reader" => reader_child(&reg, env_u64("MODE", 0), until),
        "waiter" => {
            let r = reg.wait_for("evt", 0, Duration::from_secs(8)).unwrap();
            println!("seq={}", r.seq);
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn many_writers_and_readers_in_separate_processes_never_see_a_torn_record() {
    if let Some(r) = role() {
        return child_main(&r);
    }
    let name = unique("hammer");
    let _u = Unlink(name.clone());
    let reg = Registry::create(&name, &opts()).unwrap();
    let ms = env_u64("CUDA_IPC_HAMMER_MS", 2500).to_string();
    let test = "many_writers_and_readers_in_separate_processes_never_see_a_torn_record";
    let mut writers = Vec::new();
    for id in 1..=3u32 {
        writers.push(spawn_child(
            test,
            "writer",
            &name,
            &[("ID", id.to_string()), ("RUN_MS", ms.clone())],
        ));
    }
    let mut readers = Vec::new();
    for mode in 0..3u32 {
        readers.push(spawn_child(
            test,
            "reader",
            &name,
            &[("MODE", mode.to_string()), ("RUN_MS", ms.clone())],
        ));
    }
    let writes: u64 = writers
        .into_iter()
        .map(|c| value(&finish(c), "writes"))
        .sum();
    let mut reads = 0;
    for c in readers {
        let out = finish(c);
        assert_eq!(value(&out, "torn"), 0, "{out}");
        assert_eq!(value(&out, "backwards"), 0, "{out}");
        reads += value(&out, "reads");
    }
    eprintln!("{writes} writes, {reads} checked reads, 0 torn");
    assert!(writes > 100 && reads > 100, "writes={writes} reads={reads}");
    // One slot per name, every record whole.
    let all = reg.list().unwrap();
    assert_eq!(all.len(), NAMES.len());
    assert!(all.iter().all(whole));
}

#[test]
fn writer_killed_mid_write_leaves_the_registry_usable_for_the_others() {
    if let Some(r) = role() {
        return child_main(&r);
    }
    let name = unique("kill");
    let _u = Unlink(name.clone());
    let reg = Registry::create(&name, &opts()).unwrap();
    let test = "writer_killed_mid_write_leaves_the_registry_usable_for_the_others";
    // A reader process checks every record for the whole test.
    let reader = spawn_child(
        test,
        "reader",
        &name,
        &[("MODE", "1".into()), ("RUN_MS", "3000".into())],
    );
    let mut last_seq = 0;
    for round in 0..8u64 {
        let mut w = spawn_child(
            test,
            "writer",
            &name,
            &[("ID", (round + 1).to_string()), ("RUN_MS", "10000".into())],
        );
        // Let it start publishing, then kill -9 it at an arbitrary point.
        std::thread::sleep(Duration::from_millis(120 + (round * 37) % 60));
        w.kill().unwrap();
        w.wait().unwrap();
        // The others go on: reads are whole, and publishing to every name works promptly.
        for r in reg.list().unwrap() {
            assert!(whole(&r), "{r:?}");
        }
        let t = Instant::now();
        for n in NAMES {
            let (token, meta) = make(round, 99);
            let s = reg.publish(n, 99, &token, &meta).unwrap();
            assert!(s > last_seq);
            last_seq = s;
        }
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }
    reg.reclaim_dead().unwrap();
    // Only this process and the reader are left: no killed writer. (The reader runs 3 s; on a
    // loaded machine the eight rounds take longer, and it may have ended and left already.)
    let me = cuda_ipc::identity::ProcessIdentity::current().unwrap();
    let left: Vec<u32> = reg.participants().iter().map(|p| p.pid).collect();
    assert!(left.contains(&me.pid), "{left:?}");
    assert!(
        left.iter().all(|&p| p == me.pid || p == reader.id()),
        "a killed writer is still a participant: {left:?} (reader {})",
        reader.id()
    );
    let out = finish(reader);
    assert_eq!(value(&out, "torn"), 0, "{out}");
    assert!(value(&out, "reads") > 0);
}

#[test]
fn reader_killed_mid_wait_does_not_disturb_other_waiters() {
    if let Some(r) = role() {
        return child_main(&r);
    }
    let name = unique("waitkill");
    let _u = Unlink(name.clone());
    let reg = Registry::create(&name, &opts()).unwrap();
    let test = "reader_killed_mid_wait_does_not_disturb_other_waiters";
    let mut a = spawn_child(test, "waiter", &name, &[]);
    let b = spawn_child(test, "waiter", &name, &[]);
    let t = Instant::now();
    while reg.participants().len() < 3 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "waiters did not attach"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100)); // both asleep in the futex by now
    a.kill().unwrap();
    a.wait().unwrap();
    let seq = reg.publish("evt", 1, b"go", b"").unwrap();
    let out = finish(b);
    assert_eq!(value(&out, "seq"), seq);
    assert_eq!(reg.participants().len(), 1);
}

#[test]
fn shared_futex_wakes_a_waiter_in_another_process() {
    if let Some(r) = role() {
        assert_eq!(r, "futex");
        let seg = Segment::open(&std::env::var(REG).unwrap()).unwrap();
        // SAFETY: the segment is at least 4096 bytes and page-aligned; the word is only accessed
        // atomically, by both processes.
        let word = unsafe { &*(seg.as_ptr() as *const std::sync::atomic::AtomicU32) };
        word.store(1, std::sync::atomic::Ordering::Release); // "ready"
        shm::futex::wake_all(word);
        let t = Instant::now();
        // One long wait: if the wake did not cross processes this would time out after 8 s.
        while word.load(std::sync::atomic::Ordering::Acquire) == 1
            && t.elapsed() < Duration::from_secs(8)
        {
            shm::futex::wait(word, 1, Duration::from_secs(8));
        }
        println!("waited_ms={}", t.elapsed().as_millis());
        return;
    }
    let name = unique("futex");
    let _u = Unlink(name.clone());
    let seg = Segment::create(&name, 4096, &SegmentOptions::new()).unwrap();
    // SAFETY: as in the child.
    let word = unsafe { &*(seg.as_ptr() as *const std::sync::atomic::AtomicU32) };
    let child = spawn_child(
        "shared_futex_wakes_a_waiter_in_another_process",
        "futex",
        &name,
        &[],
    );
    while word.load(std::sync::atomic::Ordering::Acquire) != 1 {
        shm::futex::wait(word, 0, Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(100));
    word.store(2, std::sync::atomic::Ordering::Release);
    shm::futex::wake_all(word);
    let out = finish(child);
    assert!(value(&out, "waited_ms") < 4000, "{out}");
}

#[test]
fn lock_held_by_a_killed_but_unreaped_writer_is_taken_over() {
    if let Some(r) = role() {
        return child_main(&r);
    }
    let name = unique("zombie");
    let _u = Unlink(name.clone());
    let reg = Registry::create(&name, &opts()).unwrap();
    let test = "lock_held_by_a_killed_but_unreaped_writer_is_taken_over";
    let mut w = spawn_child(
        test,
        "writer",
        &name,
        &[("ID", "1".into()), ("RUN_MS", "10000".into())],
    );
    std::thread::sleep(Duration::from_millis(150));
    // SIGKILL without reaping: the writer stays a zombie while we keep using the registry.
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&w),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let t = Instant::now();
    for n in NAMES {
        let (token, meta) = make(1, 99);
        reg.publish(n, 99, &token, &meta).unwrap();
    }
    assert!(reg.list().unwrap().iter().all(whole));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    w.wait().unwrap();
}

/// `Registry::open` frees dead participants' entries on the way in, as its docs say, even when
/// free entries are left: the snapshot no longer shows a killed process's entry.
#[test]
fn open_frees_the_entries_of_dead_participants_on_the_way_in() {
    if let Some(r) = role() {
        return child_main(&r);
    }
    let name = unique("openfree");
    let _u = Unlink(name.clone());
    let reg = Registry::create(&name, &opts()).unwrap();
    let test = "open_frees_the_entries_of_dead_participants_on_the_way_in";
    let mut a = spawn_child(test, "waiter", &name, &[]);
    let t = Instant::now();
    while reg.participants().len() < 2 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the child did not attach"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = a.id();
    a.kill().unwrap();
    a.wait().unwrap();
    let entries = || {
        cuda_ipc::registry::inspect::inspect(&name)
            .unwrap()
            .participants
            .iter()
            .filter(|p| p.identity.pid == pid)
            .count()
    };
    assert_eq!(entries(), 1, "the killed child's entry is still there");
    let _joined = Registry::open(&name, &opts()).unwrap();
    assert_eq!(entries(), 0, "open left the dead participant's entry");
    assert_eq!(
        reg.participants().len(),
        1,
        "this process alone (its two handles count once)"
    );
}
