//! Registry latencies beside their raw baselines, measured in the same run:
//! - `get` and the seqlock read beside a plain atomic load;
//! - `publish` of an existing name;
//! - a cross-process round trip through `publish` → `wait_for` beside a raw shared-futex ping-pong.
//!
//! `cargo bench -p cuda-ipc-bench --bench registry`. The peer processes are this binary re-executed
//! with `CUDA_IPC_BENCH_ROLE` set.

use cuda_ipc::raw::shm::{self, Segment, SegmentOptions, SeqLock};
use cuda_ipc::registry::{Registry, RegistryOptions};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

const ROLE: &str = "CUDA_IPC_BENCH_ROLE";
const SEG: &str = "CUDA_IPC_BENCH_SEGMENT";

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        let name = std::env::var(SEG).expect("segment name");
        match role.as_str() {
            "futex" => futex_peer(&name),
            "registry" => registry_peer(&name),
            other => panic!("unknown role {other}"),
        }
        return;
    }
    divan::main();
    for n in [futex_name(), registry_name()] {
        let _ = Segment::unlink(&n);
    }
}

fn futex_name() -> String {
    format!("cuda-ipc-bench-futex-{}", std::process::id())
}

fn registry_name() -> String {
    format!("cuda-ipc-bench-reg-{}", std::process::id())
}

fn parent_gone(original: Option<rustix::process::Pid>) -> bool {
    rustix::process::getppid() != original
}

fn spawn_peer(role: &str, name: &str) -> Child {
    Command::new(std::env::current_exe().expect("bench binary"))
        .env(ROLE, role)
        .env(SEG, name)
        .spawn()
        .expect("spawn peer")
}

/// The peer side of the raw ping-pong: turns every odd value into the next even one.
fn futex_peer(name: &str) {
    let parent = rustix::process::getppid();
    let seg = Segment::open(name).expect("open");
    // SAFETY: the segment is at least 4 bytes, page-aligned, and the word is only accessed atomically.
    let word = unsafe { &*(seg.as_ptr() as *const AtomicU32) };
    loop {
        // Acquire: pairs with the parent's Release store of the odd value.
        let w = word.load(Ordering::Acquire);
        if w % 2 == 1 {
            // Release: pairs with the parent's Acquire load.
            word.store(w.wrapping_add(1), Ordering::Release);
            shm::futex::wake(word, 1);
        } else if shm::futex::wait(word, w, Duration::from_secs(1)) == shm::WaitResult::TimedOut
            && parent_gone(parent)
        {
            return;
        }
    }
}

/// The peer side of the registry round trip: answers every "ping" with a "pong".
fn registry_peer(name: &str) {
    let parent = rustix::process::getppid();
    let reg = Registry::open(name, &RegistryOptions::new()).expect("open registry");
    let mut last = 0;
    loop {
        match reg.wait_for("ping", last, Duration::from_secs(1)) {
            Ok(r) => {
                last = r.seq;
                reg.publish("pong", 0, &r.token, b"").expect("publish");
            }
            Err(_) if parent_gone(parent) => return,
            Err(_) => {}
        }
    }
}

struct FutexPeer {
    seg: Segment,
    _child: Child,
}

fn futex_peer_handle() -> &'static Mutex<FutexPeer> {
    static P: OnceLock<Mutex<FutexPeer>> = OnceLock::new();
    P.get_or_init(|| {
        let name = futex_name();
        let seg = Segment::create(&name, 4096, &SegmentOptions::new()).expect("segment");
        let child = spawn_peer("futex", &name);
        Mutex::new(FutexPeer { seg, _child: child })
    })
}

struct RegistryPeer {
    reg: Registry,
    last_pong: u64,
    _child: Child,
}

fn registry_peer_handle() -> &'static Mutex<RegistryPeer> {
    static P: OnceLock<Mutex<RegistryPeer>> = OnceLock::new();
    P.get_or_init(|| {
        let name = registry_name();
        let reg = Registry::create(&name, &RegistryOptions::new()).expect("registry");
        let child = spawn_peer("registry", &name);
        Mutex::new(RegistryPeer {
            reg,
            last_pong: 0,
            _child: child,
        })
    })
}

/// Baseline: one cross-process round trip through a bare shared futex word.
#[divan::bench]
fn cross_process_raw_futex_ping_pong(b: divan::Bencher) {
    let peer = futex_peer_handle().lock().unwrap();
    // SAFETY: as in `futex_peer`.
    let word = unsafe { &*(peer.seg.as_ptr() as *const AtomicU32) };
    b.bench_local(|| {
        // Relaxed: only this process writes odd values; the peer's even answer is loaded with Acquire.
        let v = word.load(Ordering::Relaxed) | 1;
        let v = if word.load(Ordering::Relaxed) % 2 == 1 {
            v.wrapping_add(2)
        } else {
            v
        };
        // Release: pairs with the peer's Acquire load.
        word.store(v, Ordering::Release);
        shm::futex::wake(word, 1);
        loop {
            // Acquire: pairs with the peer's Release store.
            let w = word.load(Ordering::Acquire);
            if w == v.wrapping_add(1) {
                break;
            }
            shm::futex::wait(word, w, Duration::from_secs(5));
        }
    });
}

/// One cross-process round trip through the registry: publish "ping", the peer's `wait_for` wakes
/// and publishes "pong", our `wait_for` wakes.
#[divan::bench]
fn cross_process_publish_wake_round_trip(b: divan::Bencher) {
    let mut peer = registry_peer_handle().lock().unwrap();
    b.bench_local(|| {
        peer.reg.publish("ping", 0, b"x", b"").unwrap();
        let r = peer
            .reg
            .wait_for("pong", peer.last_pong, Duration::from_secs(5))
            .unwrap();
        peer.last_pong = r.seq;
    });
}

fn local_registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(|| {
        let name = format!("cuda-ipc-bench-local-{}", std::process::id());
        let reg = Registry::create(&name, &RegistryOptions::new()).expect("registry");
        let _ = Segment::unlink(&name);
        for i in 0..16 {
            reg.publish(&format!("name-{i}"), 1, &[7; 64], &[1; 32])
                .unwrap();
        }
        reg
    })
}

/// `publish` of an existing name (64-byte token, 32 bytes of metadata), no waiters.
#[divan::bench]
fn publish_existing_name() {
    local_registry()
        .publish("name-3", 1, divan::black_box(&[7; 64]), &[1; 32])
        .unwrap();
}

/// `get` of an existing name.
#[divan::bench]
fn get_existing_name() -> Option<u64> {
    local_registry()
        .get(divan::black_box("name-3"))
        .unwrap()
        .map(|r| r.seq)
}

/// Baseline: one plain atomic load.
#[divan::bench]
fn plain_atomic_load(b: divan::Bencher) {
    let w = AtomicU64::new(5);
    // Relaxed: a baseline, nothing to pair with.
    b.bench_local(|| divan::black_box(&w).load(Ordering::Relaxed));
}

/// A seqlock read of one slot's payload (70 words), uncontended.
#[divan::bench]
fn seqlock_read_70_words(b: divan::Bencher) {
    let seq = AtomicU64::new(0);
    let words: Vec<AtomicU64> = (0..70).map(AtomicU64::new).collect();
    let lock = SeqLock::new(&seq, &words);
    let mut out = [0u64; 70];
    b.bench_local(|| divan::black_box(lock.read(&mut out, 8).unwrap()));
}

/// A seqlock read of one word, uncontended: the cost of the protocol itself.
#[divan::bench]
fn seqlock_read_1_word(b: divan::Bencher) {
    let seq = AtomicU64::new(0);
    let words = [AtomicU64::new(1)];
    let lock = SeqLock::new(&seq, &words);
    let mut out = [0u64; 1];
    b.bench_local(|| divan::black_box(lock.read(&mut out, 8).unwrap()));
}
