//! GPU tests of VMM and memory-pool sharing through file descriptors, each with separate processes.
//! They need a CUDA GPU and fail without one; `cargo test` lists them as ignored.

mod common;

use common::{Peer, ctx, parent_lines, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, MemoryKind, Producer};
use cuda_ipc::driver::{DeviceMemory, Stream};
use cuda_ipc::ipc::{ImportedBuffer, IpcEvent, MemPool, VmmBuffer, cache_stats};
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::registry::{Registry, RegistryOptions};
use cuda_ipc::token::Token;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

/// Open file descriptors of this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Open file descriptors once they settle at or below `target` (a child's pipes close on a reader
/// thread shortly after it exits), waiting at most 2 s.
fn settled_fds(target: usize) -> usize {
    let t = Instant::now();
    loop {
        let n = open_fds();
        if n <= target || t.elapsed() > Duration::from_secs(2) {
            return n;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap()
}

const ROUNDS: u32 = 200;

/// The importer's side of [`two_process`]: imports the buffer and event named in the registry,
/// checks every round's pattern after waiting on the event, then imports once more to show a full
/// import/drop cycle leaves no file descriptor and no mapping behind.
fn importer() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let s = Stream::new(&ctx).unwrap();
    let bad = zeroed_counter(&ctx);
    let reg = Registry::open(&env("CUDA_IPC_TEST_REGISTRY"), &RegistryOptions::new()).unwrap();
    let tok = Token::from_bytes(&reg.get("buf").unwrap().unwrap().token).unwrap();
    let ev_tok = Token::from_bytes(&reg.get("evt").unwrap().unwrap().token).unwrap();
    let ev = IpcEvent::open(&ev_tok).unwrap();
    let fds_start = open_fds();
    {
        let buf = ImportedBuffer::open(&tok).unwrap();
        assert_eq!(buf.len() as u64, tok.len);
        assert!(!buf.is_local());
        tell("ready");
        let mut lines = parent_lines();
        for i in 0..ROUNDS {
            assert_eq!(lines.next().unwrap(), format!("go {i}"));
            s.wait_event(&ev).unwrap();
            k.check_pattern(&buf, i, &bad, &s).unwrap();
            s.synchronize().unwrap();
            tell("ok");
        }
    }
    let fds_mid = open_fds();
    {
        let again = ImportedBuffer::open(&tok).unwrap();
        k.check_pattern(&again, ROUNDS - 1, &bad, &s).unwrap();
        s.synchronize().unwrap();
    }
    let fds_end = open_fds();
    let st = cache_stats();
    tell(format!(
        "done {} {fds_start} {fds_mid} {fds_end} {} {}",
        read_u64(&bad),
        st.driver_opens,
        st.live_mappings
    ));
}

/// Exports `buf` (with `token`) through a registry to a child process and hands it 200 patterns,
/// each written after a 50 µs spin so the write is still in flight when the child's stream waits.
fn two_process(test: &str, buf: &dyn DeviceMemory, token: Token, s: &Stream, k: &Kernels) {
    let ctx = buf.context().clone();
    let name = common::unique("vmm");
    let reg = Registry::create(&name, &RegistryOptions::new()).unwrap();
    let _unlink = common::Unlink(name.clone());
    let ev = IpcEvent::new(&ctx).unwrap();
    reg.publish("buf", 3, &token.to_bytes(), b"").unwrap();
    reg.publish("evt", 2, &ev.export().unwrap().to_bytes(), b"")
        .unwrap();
    let mut c = Peer::spawn(test, "importer", &[("CUDA_IPC_TEST_REGISTRY", &name)]);
    c.expect("ready", T);
    for i in 0..ROUNDS {
        k.spin(50_000, s).unwrap();
        k.fill_pattern(buf, i, s).unwrap();
        ev.record(s).unwrap();
        c.send(&format!("go {i}"));
        c.expect("ok", T);
    }
    let done = c.expect("done", T);
    c.finish(T);
    println!(
        "{test}: importer reports (mismatches, fds at start, after drop, after a second import, driver opens, live mappings) = {done}"
    );
    let v: Vec<u64> = done.split(' ').map(|x| x.parse().unwrap()).collect();
    assert_eq!(v[0], 0, "the importer saw a stale or partial pattern");
    assert_eq!(
        v[2], v[3],
        "a second import/drop cycle leaked file descriptors"
    );
    assert!(v[2] <= v[1], "the import leaked file descriptors");
    assert_eq!(v[4], 2, "one driver import per cycle");
    assert_eq!(v[5], 0, "mappings left open");
}

const VMM_TWO: &str = "a_vmm_buffer_crosses_processes_through_the_registry";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_vmm_buffer_crosses_processes_through_the_registry() {
    if role().as_deref() == Some("importer") {
        return importer();
    }
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let s = Stream::new(&ctx).unwrap();
    let (free0, _) = ctx.memory_info().unwrap();
    // Two full rounds (allocate, export, hand to a child, free): the second must end with exactly
    // the descriptors the first ended with (the first may open the driver's and the fd server's own).
    let mut fds = Vec::new();
    for _ in 0..2 {
        {
            // Not a multiple of the granularity: rounded up; the token says the asked length.
            let buf = VmmBuffer::new(&ctx, (3 << 20) + 4096).unwrap();
            assert!(buf.allocation_size() >= buf.len());
            let g = cuda_ipc::ipc::vmm_granularity(&ctx.device()).unwrap();
            assert_eq!(buf.allocation_size() % g, 0);
            let tok = buf.export().unwrap();
            assert_eq!(tok.len, (3 << 20) + 4096);
            // A self-import is served by the local allocation.
            assert!(ImportedBuffer::open(&tok).unwrap().is_local());
            two_process(VMM_TWO, &buf, tok, &s, &k);
        }
        s.synchronize().unwrap();
        fds.push(settled_fds(fds.last().copied().unwrap_or(0)));
    }
    let (free1, _) = ctx.memory_info().unwrap();
    let diff = free0 as i64 - free1 as i64;
    println!(
        "exporter: open fds after each round {fds:?}; device memory in use differs by {diff} bytes"
    );
    assert_eq!(fds[0], fds[1], "the exporter leaked file descriptors");
    assert!(diff.abs() <= 2 << 20);
}

const POOL_TWO: &str = "a_pool_allocation_crosses_processes_through_the_registry";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_pool_allocation_crosses_processes_through_the_registry() {
    if role().as_deref() == Some("importer") {
        return importer();
    }
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let s = Stream::new(&ctx).unwrap();
    let mut fds = Vec::new();
    for _ in 0..2 {
        {
            let pool = MemPool::exportable(&ctx).unwrap();
            let buf = pool.alloc(5 << 20, &s).unwrap();
            let tok = buf.export().unwrap();
            assert_eq!(tok.len, 5 << 20);
            assert!(ImportedBuffer::open(&tok).unwrap().is_local());
            two_process(POOL_TWO, &buf, tok, &s, &k);
        }
        fds.push(settled_fds(fds.last().copied().unwrap_or(0)));
    }
    println!("exporter: open fds after each round {fds:?}");
    assert_eq!(fds[0], fds[1], "the exporter leaked file descriptors");
}

const OUTLIVES: &str = "a_vmm_import_stays_valid_after_its_exporter_is_killed";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_vmm_import_stays_valid_after_its_exporter_is_killed() {
    const BYTES: usize = 64 << 20;
    if role().as_deref() == Some("exporter") {
        let ctx = ctx();
        let k = Kernels::load(&ctx).unwrap();
        let s = Stream::new(&ctx).unwrap();
        let buf = VmmBuffer::new(&ctx, BYTES).unwrap();
        k.fill_pattern(&buf, 7, &s).unwrap();
        s.synchronize().unwrap();
        tell(format!("token {}", buf.export().unwrap().to_hex()));
        std::thread::sleep(T);
        return;
    }
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let s = Stream::new(&ctx).unwrap();
    let bad = zeroed_counter(&ctx);
    s.synchronize().unwrap();
    let (free0, _) = ctx.memory_info().unwrap();
    let mut p = Peer::spawn(OUTLIVES, "exporter", &[]);
    let tok = Token::from_hex(&p.expect("token", T)).unwrap();
    {
        let buf = ImportedBuffer::open(&tok).unwrap();
        k.check_pattern(&buf, 7, &bad, &s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(read_u64(&bad), 0, "pattern wrong before the kill");
        p.child.kill().unwrap();
        p.child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        // Still the exporter's data, and still writable: the import holds its own reference.
        k.check_pattern(&buf, 7, &bad, &s).unwrap();
        k.fill_pattern(&buf, 8, &s).unwrap();
        k.check_pattern(&buf, 8, &bad, &s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(
            read_u64(&bad),
            0,
            "the import lost its data when the exporter died"
        );
    }
    s.synchronize().unwrap();
    let st = cache_stats();
    assert_eq!(st.live_mappings, 0);
    let (free1, _) = ctx.memory_info().unwrap();
    let diff = free0 as i64 - free1 as i64;
    println!(
        "exporter killed: the import read and wrote valid data after the kill; device memory in use after release differs by {diff} bytes"
    );
    assert!(diff.abs() <= 4 << 20, "{diff} bytes not returned");
}

/// A channel whose pool is of `kind` delivers 2,000 frames of 8 MiB, every word checked.
fn channel_delivers_every_frame(test: &str, kind: MemoryKind) {
    const FRAMES: u64 = 2000;
    if role().as_deref() == Some("consumer") {
        let rx = Consumer::attach(&env("CUDA_IPC_TEST_CHANNEL"), &ConsumerOptions::new()).unwrap();
        let k = Kernels::load(rx.context().unwrap()).unwrap();
        let bad = zeroed_counter(rx.context().unwrap());
        tell("ready");
        let mut n = 0u64;
        loop {
            let f = match rx.recv_timeout(T) {
                Ok(f) => f,
                Err(Error::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
                Err(e) => panic!("{e}"),
            };
            let seed = u64::from_le_bytes(f.metadata()[..8].try_into().unwrap());
            k.check_pattern(f.buffer().unwrap(), seed as u32, &bad, f.stream().unwrap())
                .unwrap();
            n += 1;
        }
        rx.stream().unwrap().synchronize().unwrap();
        tell(format!("done {n} {}", read_u64(&bad)));
        return;
    }
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let name = format!("{kind:?}ch-{}", std::process::id());
    let opts = ChannelOptions::new(8 << 20).memory(kind);
    let mut tx = Producer::create(&ctx, &name, &opts).unwrap();
    assert_eq!(tx.memory_kind(), kind);
    let mut c = Peer::spawn(test, "consumer", &[("CUDA_IPC_TEST_CHANNEL", &name)]);
    c.expect("ready", T);
    let t = Instant::now();
    for i in 0..FRAMES {
        let f = tx.acquire(Some(T)).unwrap();
        assert_eq!(f.buffer().unwrap().kind(), kind);
        k.fill_pattern(f.buffer().unwrap(), i as u32, f.stream().unwrap())
            .unwrap();
        f.publish(&i.to_le_bytes()).unwrap();
    }
    tx.close(T).unwrap();
    let done = c.expect("done", T);
    c.finish(T);
    println!(
        "{kind:?} channel: {FRAMES} frames of 8 MiB in {:?}; consumer (received, mismatched words) = {done}",
        t.elapsed()
    );
    assert_eq!(done, format!("{FRAMES} 0"));
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_vmm_channel_delivers_every_frame_intact() {
    channel_delivers_every_frame("a_vmm_channel_delivers_every_frame_intact", MemoryKind::Vmm);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_memory_pool_channel_delivers_every_frame_intact() {
    channel_delivers_every_frame(
        "a_memory_pool_channel_delivers_every_frame_intact",
        MemoryKind::Pool,
    );
}

const HOLD_KILL: &str =
    "a_consumer_holding_a_vmm_frame_reads_valid_data_after_the_producer_is_killed";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_consumer_holding_a_vmm_frame_reads_valid_data_after_the_producer_is_killed() {
    if role().as_deref() == Some("producer") {
        let ctx = ctx();
        let k = Kernels::load(&ctx).unwrap();
        let opts = ChannelOptions::new(16 << 20).memory(MemoryKind::Vmm);
        let mut tx = Producer::create(&ctx, &env("CUDA_IPC_TEST_CHANNEL"), &opts).unwrap();
        tell("ready");
        let mut lines = parent_lines();
        assert_eq!(lines.next().as_deref(), Some("go"));
        let f = tx.acquire(Some(T)).unwrap();
        k.fill_pattern(f.buffer().unwrap(), 5, f.stream().unwrap())
            .unwrap();
        f.publish(&[]).unwrap();
        tx.stream().unwrap().synchronize().unwrap();
        tell("published");
        std::thread::sleep(T);
        return;
    }
    let ctx = ctx();
    ctx.synchronize().unwrap();
    let (free0, _) = ctx.memory_info().unwrap();
    let name = format!("vmmkill-{}", std::process::id());
    let mut p = Peer::spawn(HOLD_KILL, "producer", &[("CUDA_IPC_TEST_CHANNEL", &name)]);
    p.expect("ready", T);
    {
        let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
        let k = Kernels::load(rx.context().unwrap()).unwrap();
        let bad = zeroed_counter(rx.context().unwrap());
        p.send("go");
        p.expect("published", T);
        let f = rx.recv_timeout(T).unwrap();
        k.check_pattern(f.buffer().unwrap(), 5, &bad, f.stream().unwrap())
            .unwrap();
        f.stream().unwrap().synchronize().unwrap();
        assert_eq!(read_u64(&bad), 0);
        p.child.kill().unwrap();
        p.child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        for _ in 0..10 {
            k.check_pattern(f.buffer().unwrap(), 5, &bad, f.stream().unwrap())
                .unwrap();
        }
        f.stream().unwrap().synchronize().unwrap();
        assert_eq!(
            read_u64(&bad),
            0,
            "the held frame changed after the producer died"
        );
        drop(f);
        let e = rx.recv_timeout(Duration::from_secs(5)).unwrap_err();
        println!("after the kill: held frame intact (10 checks), released; next recv: {e}");
        assert!(
            matches!(
                e,
                Error::Channel(cuda_ipc::channel::ChannelError::ProducerGone { .. })
            ),
            "{e}"
        );
    }
    ctx.synchronize().unwrap();
    assert_eq!(cache_stats().live_mappings, 0);
    let _ = std::fs::remove_file(format!("/dev/shm/cuda-ipc.ch.{name}"));
    let (free1, _) = ctx.memory_info().unwrap();
    let diff = free0 as i64 - free1 as i64;
    println!("device memory in use after release differs by {diff} bytes");
    assert!(diff.abs() <= 4 << 20, "{diff} bytes not returned");
}

/// `VmmBuffer::export_fd` and `ImportedBuffer::from_vmm_fd`, for users with a transport of their own:
/// the import (a second mapping of the same memory) sees what the buffer holds, the descriptor stays
/// the caller's, and a descriptor that is not a CUDA allocation is refused with a clear error.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_vmm_fd_from_your_own_transport_imports_and_stays_yours() {
    use std::os::fd::AsFd;
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let s = Stream::new(&ctx).unwrap();
    let bad = zeroed_counter(&ctx);
    let buf = VmmBuffer::new(&ctx, 4 << 20).unwrap();
    k.fill_pattern(&buf, 11, &s).unwrap();
    s.synchronize().unwrap();
    let fd = buf.export_fd().unwrap();
    let fds_before = open_fds();
    {
        let imp = ImportedBuffer::from_vmm_fd(&ctx, fd.as_fd(), buf.allocation_size()).unwrap();
        assert_ne!(imp.device_ptr(), buf.device_ptr(), "a second mapping");
        k.check_pattern(&imp, 11, &bad, &s).unwrap();
        s.synchronize().unwrap();
    }
    assert_eq!(read_u64(&bad), 0);
    assert_eq!(
        open_fds(),
        fds_before,
        "the import closed or leaked a descriptor"
    );
    // The descriptor is still ours and still valid: import it again.
    let again = ImportedBuffer::from_vmm_fd(&ctx, fd.as_fd(), buf.allocation_size()).unwrap();
    drop(again);
    drop(fd);
    // Not a CUDA allocation: refused, nothing leaked.
    let file = std::fs::File::open("/dev/null").unwrap();
    let e = ImportedBuffer::from_vmm_fd(&ctx, file.as_fd(), 1 << 20).unwrap_err();
    println!("from_vmm_fd: 0 mismatches through a second mapping; /dev/null refused with `{e}`");
    assert!(
        e.to_string().contains("cuMemImportFromShareableHandle"),
        "{e}"
    );
}
