//! GPU tests of the IPC layer, two processes each where the issue asks for it. They need a CUDA GPU
//! and fail without one; `cargo test` lists them as ignored. Run them with `scripts/gpu-test.sh` or the
//! GPU bundle (`run.sh tests ipc_`).

mod common;

use common::{Peer, ctx, parent_lines, read_u64, role, tell, zeroed_counter};
use cuda_ipc::driver::{DeviceBuffer, DeviceMemory, Stream};
use cuda_ipc::ipc::{ImportedBuffer, IpcEvent, cache_stats};
use cuda_ipc::raw::kernels::{Kernels, pattern};
use cuda_ipc::token::{Token, TokenKind};
use cuda_ipc::{Error, identity::ProcessIdentity};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

const HANDOFF: &str = "handoff_is_correct_over_1000_iterations_with_writes_in_flight";

/// A fills a 16 MiB buffer after a 2 ms spin and records its event; B makes its stream wait on the
/// event and checks every element, then records its own event that A's next write waits on. B also
/// counts how often A's event was still pending when B's wait was enqueued. Finally B writes a reply
/// that A verifies.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn handoff_is_correct_over_1000_iterations_with_writes_in_flight() {
    const N: u32 = 1000;
    const BYTES: usize = 16 << 20;
    if role().as_deref() == Some("consumer") {
        let ctx = ctx();
        let k = Kernels::load(&ctx).unwrap();
        let s = Stream::new(&ctx).unwrap();
        let mut lines = parent_lines();
        let buf = ImportedBuffer::open(&Token::from_hex(&lines.next().unwrap()).unwrap()).unwrap();
        let a_done = IpcEvent::open(&Token::from_hex(&lines.next().unwrap()).unwrap()).unwrap();
        assert!(a_done.is_imported());
        let b_done = IpcEvent::new(&ctx).unwrap();
        tell(format!("event {}", b_done.export().unwrap().to_hex()));
        let counter = zeroed_counter(&ctx);
        let mut in_flight = 0u32;
        for i in 0..N {
            let seed: u32 = lines.next().unwrap().parse().unwrap();
            assert_eq!(seed, i);
            if !a_done.is_complete().unwrap() {
                in_flight += 1;
            }
            s.wait_event(&a_done).unwrap();
            k.check_pattern(&buf, seed, &counter, &s).unwrap();
            b_done.record(&s).unwrap();
            tell(format!("checked {i}"));
        }
        s.synchronize().unwrap();
        let bad = read_u64(&counter);
        // The reply: B writes pattern(0xB0B) and A verifies it.
        assert_eq!(lines.next().unwrap(), "reply");
        k.fill_pattern(&buf, 0xB0B, &s).unwrap();
        s.synchronize().unwrap();
        tell(format!("done {bad} {in_flight}"));
        return;
    }
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let s = Stream::new(&ctx).unwrap();
    let buf = DeviceBuffer::new(&ctx, BYTES).unwrap();
    let a_done = IpcEvent::new(&ctx).unwrap();
    let mut b = Peer::spawn(HANDOFF, "consumer", &[]);
    b.send(&buf.export().unwrap().to_hex());
    b.send(&a_done.export().unwrap().to_hex());
    let b_done = IpcEvent::open(&Token::from_hex(&b.expect("event", T)).unwrap()).unwrap();
    for i in 0..N {
        // The next write waits for B's check of the previous frame (stream-ordered release).
        s.wait_event(&b_done).unwrap();
        k.spin(2_000_000, &s).unwrap();
        k.fill_pattern(&buf, i, &s).unwrap();
        a_done.record(&s).unwrap();
        b.send(&i.to_string());
        assert_eq!(b.expect("checked", T), i.to_string());
    }
    b.send("reply");
    let done = b.expect("done", T);
    let mut it = done.split(' ').map(|x| x.parse::<u64>().unwrap());
    let (bad, in_flight) = (it.next().unwrap(), it.next().unwrap());
    b.finish(T);
    let counter = zeroed_counter(&ctx);
    k.check_pattern(&buf, 0xB0B, &counter, &s).unwrap();
    s.synchronize().unwrap();
    let reply_bad = read_u64(&counter);
    println!(
        "handoff: {N} iterations of {BYTES} bytes, mismatched words {bad}, A's write in flight at B's wait in {in_flight}/{N}, reply mismatches {reply_bad}"
    );
    assert_eq!(bad, 0, "B read words A had not written");
    assert_eq!(reply_bad, 0, "A did not see B's reply");
    assert!(
        in_flight as f64 >= 0.99 * N as f64,
        "A's writes were in flight in only {in_flight} of {N} iterations"
    );
}

const SUBRANGE: &str = "sub_range_export_lands_at_the_right_offset";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn sub_range_export_lands_at_the_right_offset() {
    const TOTAL: usize = 1 << 20;
    const OFF: usize = 256 << 10;
    const LEN: usize = 64 << 10;
    if role().as_deref() == Some("writer") {
        let ctx = ctx();
        let k = Kernels::load(&ctx).unwrap();
        let s = Stream::new(&ctx).unwrap();
        let tok = Token::from_hex(&parent_lines().next().unwrap()).unwrap();
        let part = ImportedBuffer::open(&tok).unwrap();
        assert_eq!(part.len(), LEN);
        assert_eq!(part.device_ptr() - part.allocation_base(), OFF as u64);
        k.fill_pattern(&part, 7, &s).unwrap();
        s.synchronize().unwrap();
        tell("written");
        return;
    }
    let ctx = ctx();
    let buf = DeviceBuffer::new(&ctx, TOTAL).unwrap();
    buf.copy_from_host(0, &vec![0xAA; TOTAL]).unwrap();
    let tok = buf.export_range(OFF, LEN).unwrap();
    assert_eq!((tok.offset, tok.len), (OFF as u64, LEN as u64));
    assert!(
        buf.export_range(TOTAL - 4, 8).is_err(),
        "a range past the end must be refused"
    );
    let mut b = Peer::spawn(SUBRANGE, "writer", &[]);
    b.send(&tok.to_hex());
    b.expect("written", T);
    b.finish(T);
    let mut host = vec![0u8; TOTAL];
    buf.copy_to_host(0, &mut host).unwrap();
    assert!(
        host[..OFF].iter().all(|&x| x == 0xAA),
        "bytes before the range changed"
    );
    assert!(
        host[OFF + LEN..].iter().all(|&x| x == 0xAA),
        "bytes after the range changed"
    );
    for (i, w) in host[OFF..OFF + LEN].chunks(4).enumerate() {
        assert_eq!(
            u32::from_le_bytes(w.try_into().unwrap()),
            pattern(7, i as u64),
            "word {i}"
        );
    }
}

const DOUBLE: &str = "double_import_returns_one_mapping_and_closes_once";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn double_import_returns_one_mapping_and_closes_once() {
    if role().as_deref() == Some("importer") {
        let ctx = ctx();
        let mut lines = parent_lines();
        let whole = Token::from_hex(&lines.next().unwrap()).unwrap();
        let part = Token::from_hex(&lines.next().unwrap()).unwrap();
        let s0 = cache_stats();
        let a = ImportedBuffer::open_in(&ctx, &whole).unwrap();
        let t_first = std::time::Instant::now();
        let b = ImportedBuffer::open_in(&ctx, &whole).unwrap();
        let cached_ns = t_first.elapsed().as_nanos();
        let c = ImportedBuffer::open_in(&ctx, &part).unwrap();
        let s1 = cache_stats();
        assert_eq!(a.device_ptr(), b.device_ptr());
        assert_eq!(c.device_ptr(), a.device_ptr() + 4096);
        assert_eq!(
            s1.driver_opens - s0.driver_opens,
            1,
            "one driver open for three imports"
        );
        assert_eq!(s1.hits - s0.hits, 2);
        drop(a);
        drop(c);
        assert_eq!(
            cache_stats().driver_closes,
            s0.driver_closes,
            "closed while still imported"
        );
        // Still readable through the remaining import.
        let mut w = [0u8; 4];
        b.copy_to_host(0, &mut w).unwrap();
        assert_eq!(u32::from_le_bytes(w), 0x1234_5678);
        drop(b);
        let s2 = cache_stats();
        assert_eq!(s2.driver_closes - s0.driver_closes, 1, "exactly one close");
        assert_eq!(s2.live_mappings, 0);
        // Importing again after the close opens a fresh mapping.
        let again = ImportedBuffer::open_in(&ctx, &whole).unwrap();
        assert_eq!(cache_stats().driver_opens - s0.driver_opens, 2);
        drop(again);
        tell(format!("ok {cached_ns}"));
        return;
    }
    let ctx = ctx();
    let buf = DeviceBuffer::new(&ctx, 1 << 20).unwrap();
    buf.copy_from_host(0, &0x1234_5678u32.to_le_bytes())
        .unwrap();
    let mut b = Peer::spawn(DOUBLE, "importer", &[]);
    b.send(&buf.export().unwrap().to_hex());
    b.send(&buf.export_range(4096, 4096).unwrap().to_hex());
    let ns = b.expect("ok", T);
    println!("second (cached) import took {ns} ns");
    b.finish(T);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn self_import_returns_the_local_allocation() {
    let ctx = ctx();
    let buf = DeviceBuffer::new(&ctx, 4096).unwrap();
    let tok = buf.export().unwrap();
    assert_eq!(tok.exporter, ProcessIdentity::current().unwrap());
    let imp = ImportedBuffer::open(&tok).unwrap();
    assert!(imp.is_local());
    assert_eq!(imp.device_ptr(), buf.device_ptr());
    imp.copy_from_host(0, &[1, 2, 3, 4]).unwrap();
    let mut back = [0u8; 4];
    buf.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, [1, 2, 3, 4]);
    // The raw handle route too.
    let imp2 = buf.ipc_handle().unwrap().open(&ctx).unwrap();
    assert_eq!(imp2.device_ptr(), buf.device_ptr());
    // The import keeps the allocation alive after the buffer is dropped.
    drop(buf);
    imp.copy_from_host(0, &[5, 6, 7, 8]).unwrap();
    // Events too.
    let ev = IpcEvent::new(&ctx).unwrap();
    let ev2 = IpcEvent::open(&ev.export().unwrap()).unwrap();
    assert!(!ev2.is_imported());
    assert_eq!(ev2.as_raw(), ev.as_raw());
    let s = Stream::new(&ctx).unwrap();
    ev2.record(&s).unwrap();
    ev.synchronize().unwrap();
    assert!(ev.is_complete().unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn garbage_handles_give_errors() {
    let ctx = ctx();
    let me = ProcessIdentity::current().unwrap();
    let other = ProcessIdentity { pid: 1, ..me };
    for fill in [0u8, 0xFF, 0x5A] {
        for kind in [TokenKind::LegacyMemory, TokenKind::LegacyEvent] {
            let tok = Token {
                kind,
                handle: [fill; 64],
                offset: 0,
                len: if kind == TokenKind::LegacyMemory {
                    64
                } else {
                    0
                },
                device: ctx.device().uuid(),
                exporter: other,
                export_id: 0,
            };
            let e = if kind == TokenKind::LegacyMemory {
                ImportedBuffer::open_in(&ctx, &tok).map(|_| ()).unwrap_err()
            } else {
                IpcEvent::open_in(&ctx, &tok).map(|_| ()).unwrap_err()
            };
            println!("garbage {kind:?} handle of {fill:#04x}: {e}");
            assert!(matches!(e, Error::Cuda(_)), "{e}");
        }
    }
    // A kind mismatch is refused before the driver sees it.
    let buf = DeviceBuffer::new(&ctx, 4096).unwrap();
    let mut tok = buf.export().unwrap();
    tok.kind = TokenKind::LegacyEvent;
    assert!(matches!(
        ImportedBuffer::open_in(&ctx, &tok),
        Err(Error::InvalidToken(_))
    ));
    // A range past the allocation is refused after opening, and nothing leaks.
    let mut tok = buf.export().unwrap();
    tok.len = 1 << 30;
    assert!(matches!(
        ImportedBuffer::open_in(&ctx, &tok),
        Err(Error::InvalidToken(_))
    ));
    // An unknown device UUID.
    let mut tok = buf.export().unwrap();
    tok.device.0[0] ^= 0xFF;
    assert!(matches!(
        ImportedBuffer::open(&tok),
        Err(Error::DeviceNotFound(_))
    ));
}

const BASELINE: &str = "device_memory_returns_to_baseline_after_the_importer_drops_everything";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn device_memory_returns_to_baseline_after_the_importer_drops_everything() {
    const BYTES: usize = 256 << 20;
    if role().as_deref() == Some("importer") {
        let ctx = ctx();
        let k = Kernels::load(&ctx).unwrap();
        let s = Stream::new(&ctx).unwrap();
        let mut lines = parent_lines();
        let tok = Token::from_hex(&lines.next().unwrap()).unwrap();
        let (free0, _) = ctx.memory_info().unwrap();
        {
            let buf = ImportedBuffer::open(&tok).unwrap();
            let ev = IpcEvent::new(&ctx).unwrap();
            let counter = zeroed_counter(&ctx);
            k.check_pattern(&buf, 3, &counter, &s).unwrap();
            ev.record(&s).unwrap();
            s.synchronize().unwrap();
            assert_eq!(read_u64(&counter), 0);
        }
        let (free1, _) = ctx.memory_info().unwrap();
        assert_eq!(cache_stats().live_mappings, 0);
        tell(format!("dropped {}", free0 as i64 - free1 as i64));
        assert_eq!(lines.next().as_deref(), Some("exit"));
        return;
    }
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let s = Stream::new(&ctx).unwrap();
    s.synchronize().unwrap();
    let (base, _) = ctx.memory_info().unwrap();
    {
        let buf = DeviceBuffer::new(&ctx, BYTES).unwrap();
        k.fill_pattern(&buf, 3, &s).unwrap();
        s.synchronize().unwrap();
        let mut b = Peer::spawn(BASELINE, "importer", &[]);
        b.send(&buf.export().unwrap().to_hex());
        let diff: i64 = b.expect("dropped", T).parse().unwrap();
        println!(
            "importer: device memory in use after dropping everything differs by {diff} bytes"
        );
        assert!(
            diff.abs() <= 2 << 20,
            "importer kept {diff} bytes after dropping everything"
        );
        b.send("exit");
        b.finish(T);
    }
    let (after, _) = ctx.memory_info().unwrap();
    let diff = base as i64 - after as i64;
    println!(
        "exporter: device memory in use after the importer exited and the buffer dropped differs by {diff} bytes"
    );
    assert!(diff.abs() <= 2 << 20, "{diff} bytes not returned");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn gpu_tests_fail_without_a_gpu_rather_than_pass() {
    // The guard every GPU test relies on: without a driver, `ctx()` panics with a clear message.
    let r = std::panic::catch_unwind(ctx);
    assert!(
        r.is_ok(),
        "no usable CUDA GPU here: GPU tests must fail, not pass"
    );
}
