//! GPU tests of the import caches under threads: eight threads of one process import the same
//! token at the same moment, fifty rounds in a row, for every kind (legacy, VMM, pool, IPC event).
//! The exporter is a child process (this test binary re-executed). Each round must cost exactly one
//! driver open, give every thread the same pointer (or event), read the exporter's data correctly,
//! and close once after the last thread dropped; the device's free memory is back to its baseline
//! after the exporter exited.
//!
//! They need a CUDA GPU and fail without one; `cargo test` lists them as ignored. Run them with
//! `scripts/gpu-test.sh ipc_threads_gpu` or the GPU bundle (`run.sh tests ipc_threads`).

mod common;

use common::{Peer, ctx, parent_lines, role, tell};
use cuda_ipc::driver::{DeviceBuffer, DeviceMemory, Stream};
use cuda_ipc::ipc::{CacheStats, ImportedBuffer, IpcEvent, MemPool, VmmBuffer, cache_stats};
use cuda_ipc::raw::kernels::{Kernels, pattern};
use cuda_ipc::token::Token;
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const THREADS: usize = 8;
const ROUNDS: usize = 50;
/// Size of the exported buffer: large enough that a leaked import shows in `cuMemGetInfo`.
const BYTES: usize = 64 << 20;
/// Largest change of the device's free memory accepted as "back to baseline".
const SLACK: i64 = 8 << 20;
/// The child's role variable: which kind to export.
const KIND: &str = "IPC_THREADS_KIND";

/// The cache counters are process-wide: the tests of this file run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// The pattern seed of a kind's buffer.
fn seed(kind: &str) -> u32 {
    match kind {
        "legacy" => 0x1E6A,
        "vmm" => 0x0F0F,
        "pool" => 0x9001,
        _ => 0,
    }
}

/// The exporter child: allocates 64 MiB of `kind`, fills it with its pattern, sends the token and
/// keeps everything until told to exit.
fn exporter(kind: &str) {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let s = Stream::new(&ctx).unwrap();
    #[allow(dead_code)] // held until the parent says exit
    enum Held {
        Legacy(DeviceBuffer),
        Vmm(VmmBuffer),
        Pool(MemPool, cuda_ipc::ipc::PoolBuffer),
        Event(IpcEvent),
    }
    let held = match kind {
        "legacy" => {
            let b = DeviceBuffer::new(&ctx, BYTES).unwrap();
            k.fill_pattern(&b, seed(kind), &s).unwrap();
            Held::Legacy(b)
        }
        "vmm" => {
            let b = VmmBuffer::new(&ctx, BYTES).unwrap();
            k.fill_pattern(&b, seed(kind), &s).unwrap();
            Held::Vmm(b)
        }
        "pool" => {
            let p = MemPool::exportable(&ctx).unwrap();
            let b = p.alloc(BYTES, &s).unwrap();
            k.fill_pattern(&b, seed(kind), &s).unwrap();
            Held::Pool(p, b)
        }
        "event" => {
            let e = IpcEvent::new(&ctx).unwrap();
            e.record(&s).unwrap();
            Held::Event(e)
        }
        other => panic!("unknown kind {other}"),
    };
    s.synchronize().unwrap();
    let token = match &held {
        Held::Legacy(b) => b.export(),
        Held::Vmm(b) => b.export(),
        Held::Pool(_, b) => b.export(),
        Held::Event(e) => e.export(),
    }
    .unwrap();
    tell(format!("token {}", token.to_hex()));
    for line in parent_lines() {
        if line == "exit" {
            break;
        }
    }
    drop(held);
    tell("bye");
}

/// What one round's threads saw: the device pointer (or raw event) each got, and the failures they
/// met (workers never panic: a panic would leave the others waiting at a barrier).
#[derive(Default)]
struct Round {
    got: Mutex<Vec<u64>>,
    failures: Mutex<Vec<String>>,
}

/// What a worker holds during a round.
#[allow(dead_code)] // held for its drop at the end of the round
enum Held {
    Buffer(ImportedBuffer),
    Event(IpcEvent),
}

/// One worker's import of `token` in round `r`: the value's address, or why it failed.
fn import(
    ctx: &Arc<cuda_ipc::driver::Context>,
    token: &Token,
    kind: &str,
    (t, r): (usize, usize),
) -> Result<(Held, u64), String> {
    let at = format!("thread {t}, round {r}");
    if kind == "event" {
        let ev = IpcEvent::open_in(ctx, token).map_err(|e| format!("{at}: {e}"))?;
        if !ev.is_imported() {
            return Err(format!("{at}: the event is not an import"));
        }
        match ev.is_complete() {
            Ok(true) => {}
            other => return Err(format!("{at}: the recorded event reads {other:?}")),
        }
        let raw = ev.as_raw() as usize as u64;
        Ok((Held::Event(ev), raw))
    } else {
        let buf = ImportedBuffer::open_in(ctx, token).map_err(|e| format!("{at}: {e}"))?;
        if buf.is_local() {
            return Err(format!("{at}: a self-import"));
        }
        let bad = mismatches(&buf, kind, t, r).map_err(|e| format!("{at}: {e}"))?;
        if bad != 0 {
            return Err(format!(
                "{at}: {bad} words differ from the exporter's pattern"
            ));
        }
        let ptr = buf.device_ptr();
        Ok((Held::Buffer(buf), ptr))
    }
}

/// Counter differences between two snapshots.
fn delta(a: &CacheStats, b: &CacheStats) -> CacheStats {
    CacheStats {
        driver_opens: b.driver_opens - a.driver_opens,
        hits: b.hits - a.hits,
        waits: b.waits - a.waits,
        self_imports: b.self_imports - a.self_imports,
        driver_closes: b.driver_closes - a.driver_closes,
        live_mappings: b.live_mappings,
        pool_imports: b.pool_imports - a.pool_imports,
        pool_releases: b.pool_releases - a.pool_releases,
        event_opens: b.event_opens - a.event_opens,
        event_hits: b.event_hits - a.event_hits,
        event_closes: b.event_closes - a.event_closes,
        fd_fetches: b.fd_fetches - a.fd_fetches,
    }
}

/// Reads 4 KiB at a thread- and round-specific place of `buf` and counts the words that differ
/// from the exporter's pattern.
fn mismatches(
    buf: &ImportedBuffer,
    kind: &str,
    thread: usize,
    round: usize,
) -> cuda_ipc::Result<usize> {
    let words = BYTES / 4;
    let start = ((thread * 7919 + round * 104_729) * 1024) % (words - 1024);
    let mut bytes = vec![0u8; 4096];
    buf.copy_to_host(start * 4, &mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .enumerate()
        .filter(|(j, w)| {
            u32::from_le_bytes([w[0], w[1], w[2], w[3]]) != pattern(seed(kind), (start + j) as u64)
        })
        .count())
}

/// The parent's side for one kind: 8 threads × 50 rounds of a simultaneous import of one token.
fn threads_import_one_token(test: &str, kind: &str) {
    if let Some(r) = role() {
        assert_eq!(r, "exporter");
        return exporter(&std::env::var(KIND).unwrap());
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = ctx();
    ctx.synchronize().unwrap();
    let (free_before, _) = ctx.memory_info().unwrap();
    let mut child = Peer::spawn(test, "exporter", &[(KIND, kind)]);
    let token = Token::from_hex(&child.expect("token", T)).unwrap();
    let is_event = kind == "event";

    // Nine parties: the eight importers and this thread, which checks the counters between steps.
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    let round = Arc::new(Round::default());
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (barrier, round, ctx, kind) = (
                barrier.clone(),
                round.clone(),
                ctx.clone(),
                kind.to_string(),
            );
            std::thread::spawn(move || {
                for r in 0..ROUNDS {
                    barrier.wait(); // A: go, all at once
                    let held = match import(&ctx, &token, &kind, (t, r)) {
                        Ok((held, addr)) => {
                            round.got.lock().unwrap().push(addr);
                            Some(held)
                        }
                        Err(e) => {
                            round.failures.lock().unwrap().push(e);
                            None
                        }
                    };
                    barrier.wait(); // B: all imported
                    barrier.wait(); // C: counters checked
                    drop(held);
                    barrier.wait(); // D: all dropped
                }
            })
        })
        .collect();

    let mut waited = 0;
    for r in 0..ROUNDS {
        let s0 = cache_stats();
        barrier.wait(); // A
        barrier.wait(); // B
        let s1 = cache_stats();
        let d = delta(&s0, &s1);
        let failures = std::mem::take(&mut *round.failures.lock().unwrap());
        assert!(failures.is_empty(), "round {r}: {failures:#?}");
        let got = std::mem::take(&mut *round.got.lock().unwrap());
        assert_eq!(got.len(), THREADS);
        assert_eq!(d.self_imports, 0, "round {r}: {d:?}");
        assert!(
            got.iter().all(|p| *p == got[0]),
            "round {r}: threads got different {}: {got:x?}",
            if is_event { "events" } else { "pointers" }
        );
        if is_event {
            assert_eq!(
                d.event_opens, 1,
                "round {r}: one cuIpcOpenEventHandle: {d:?}"
            );
            assert_eq!(d.event_hits, THREADS as u64 - 1, "round {r}: {d:?}");
            assert_eq!(d.event_closes, 0, "round {r}: closed while in use: {d:?}");
        } else {
            assert_eq!(d.driver_opens, 1, "round {r}: one driver open: {d:?}");
            assert_eq!(d.hits, THREADS as u64 - 1, "round {r}: {d:?}");
            assert_eq!(d.driver_closes, 0, "round {r}: closed while in use: {d:?}");
            assert_eq!(s1.live_mappings, 1, "round {r}: one mapping: {d:?}");
            match kind {
                "vmm" => assert_eq!(d.fd_fetches, 1, "round {r}: one fd fetch: {d:?}"),
                "pool" => {
                    assert_eq!(d.pool_imports, 1, "round {r}: one pool import: {d:?}");
                    assert_eq!(d.fd_fetches, 1, "round {r}: one fd fetch: {d:?}");
                }
                _ => assert_eq!(d.fd_fetches, 0, "round {r}: {d:?}"),
            }
        }
        waited += d.waits;
        barrier.wait(); // C
        barrier.wait(); // D
        let d = delta(&s0, &cache_stats());
        if is_event {
            assert_eq!(d.event_closes, 1, "round {r}: one event destroy: {d:?}");
        } else {
            assert_eq!(d.driver_closes, 1, "round {r}: one close: {d:?}");
            assert_eq!(d.live_mappings, 0, "round {r}: mapping left open: {d:?}");
            if kind == "pool" {
                assert_eq!(d.pool_releases, 1, "round {r}: pool destroyed once: {d:?}");
            }
        }
    }
    for w in workers {
        w.join().unwrap();
    }
    println!(
        "{kind}: {THREADS} threads x {ROUNDS} rounds: one open and one close per round, data read \
         correctly; {waited} imports waited for another thread's open"
    );

    child.send("exit");
    child.expect("bye", T);
    child.finish(T);
    ctx.synchronize().unwrap();
    let (free_after, _) = ctx.memory_info().unwrap();
    let diff = free_before as i64 - free_after as i64;
    println!("{kind}: device memory in use after everything was dropped differs by {diff} bytes");
    assert!(
        diff.abs() <= SLACK,
        "{kind}: {diff} bytes of device memory not returned"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn eight_threads_importing_one_legacy_token_share_one_mapping_per_round() {
    threads_import_one_token(
        "eight_threads_importing_one_legacy_token_share_one_mapping_per_round",
        "legacy",
    );
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn eight_threads_importing_one_vmm_token_share_one_mapping_per_round() {
    threads_import_one_token(
        "eight_threads_importing_one_vmm_token_share_one_mapping_per_round",
        "vmm",
    );
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn eight_threads_importing_one_pool_token_share_one_mapping_per_round() {
    threads_import_one_token(
        "eight_threads_importing_one_pool_token_share_one_mapping_per_round",
        "pool",
    );
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn eight_threads_opening_one_ipc_event_share_one_event_per_round() {
    threads_import_one_token(
        "eight_threads_opening_one_ipc_event_share_one_event_per_round",
        "event",
    );
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn gpu_thread_tests_fail_without_a_gpu_rather_than_pass() {
    // Every test above starts with `ctx()`, which panics without a usable GPU.
    let r = std::panic::catch_unwind(ctx);
    assert!(
        r.is_ok(),
        "no usable CUDA GPU here: GPU tests must fail, not pass"
    );
}
