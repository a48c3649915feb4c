//! GPU tests of tensor sets, each with separate processes: VMM, pool and legacy sets read by two
//! reader processes that check every generation on the GPU, a read-only mapping that faults only
//! the reader that stores into it, readers and writers killed mid-update, one driver import per
//! allocation per open, a reader that makes its stream only when it needs one, and a set of 2^64
//! bytes or more refused before any budget. They need a CUDA GPU and fail without one; `cargo test`
//! lists them as ignored.

mod common;

use common::{Peer, ctx, parent_lines, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::channel::MemoryKind;
use cuda_ipc::driver::{DeviceMemory, Stream};
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::tensorset::{
    DType, GenerationMode, ReaderOptions, TensorSetError, TensorSetOptions, TensorSetReader,
    TensorSetWriter, TensorSpec,
};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
const SET: &str = "CUDA_IPC_TEST_SET";
const GENERATIONS: u64 = 200;

fn set_env() -> String {
    std::env::var(SET).unwrap()
}

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("embed", DType::F32, &[1024, 256]),
        TensorSpec::new("layer.0.w", DType::BF16, &[512, 512]),
        TensorSpec::new("layer.0.b", DType::F32, &[512]),
        TensorSpec::new("head", DType::F8_E4M3FN, &[4096, 64]),
    ]
}

/// The pattern seed of tensor `t` in generation `g`.
fn seed(g: u64, t: usize) -> u32 {
    (g as u32).wrapping_mul(16).wrapping_add(t as u32)
}

/// Writes generation `w.generation() + 1` on the writer's stream and commits it.
fn write_gen(w: &mut TensorSetWriter, k: &Kernels) -> u64 {
    write_gen_after(w, k, 0)
}

/// [`write_gen`], its stream kept busy `spin_ns` of GPU time before the writes (the commit comes
/// while the stream still spins).
fn write_gen_after(w: &mut TensorSetWriter, k: &Kernels, spin_ns: u64) -> u64 {
    let n = w.layout().len();
    let u = w.begin(Some(T)).expect("begin");
    let g = u.generation();
    if spin_ns > 0 {
        k.spin(spin_ns, u.stream().unwrap()).unwrap();
    }
    for t in 0..n {
        k.fill_pattern(
            &u.device_tensor(t).unwrap(),
            seed(g, t),
            u.stream().unwrap(),
        )
        .unwrap();
    }
    assert_eq!(u.commit().unwrap(), g);
    g
}

fn kind_of(s: &str) -> MemoryKind {
    match s {
        "pool" => MemoryKind::Pool,
        "legacy" => MemoryKind::Legacy,
        _ => MemoryKind::Vmm,
    }
}

const EVERY: &str = "vmm_pool_and_legacy_sets_two_readers_check_every_generation_on_the_gpu";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn vmm_pool_and_legacy_sets_two_readers_check_every_generation_on_the_gpu() {
    if role().as_deref() == Some("reader") {
        let c = ctx();
        let k = Kernels::load(&c).unwrap();
        let bad = zeroed_counter(&c);
        let r = TensorSetReader::open(&c, &set_env(), &ReaderOptions::new()).unwrap();
        let n = r.layout().len();
        tell(format!("opened {} {}", r.imports(), r.is_read_only()));
        let (mut seen, mut last) = (0u64, 0u64);
        loop {
            let h = match r.wait_newer(last, Some(T)) {
                Ok(h) => h,
                Err(Error::TensorSet(TensorSetError::Closed(_))) => break,
                Err(e) => panic!("{e}"),
            };
            let s = h.stream().unwrap();
            for t in 0..n {
                k.check_pattern(
                    &h.device_tensor(t).unwrap(),
                    seed(h.generation(), t),
                    &bad,
                    s,
                )
                .unwrap();
            }
            last = h.generation();
            seen += 1;
        }
        r.stream().unwrap().synchronize().unwrap();
        tell(format!("done {seen} {last} {}", read_u64(&bad)));
        return;
    }
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    for kind in ["vmm", "pool", "legacy"] {
        for mode in [GenerationMode::InPlace, GenerationMode::Buffered(2)] {
            let name = format!(
                "tsgpu-{kind}-{}-{}",
                mode != GenerationMode::InPlace,
                std::process::id()
            );
            let opts = TensorSetOptions::new().memory(kind_of(kind)).mode(mode);
            let mut w = TensorSetWriter::create(&c, &name, &specs(), &opts).unwrap();
            let b = if mode == GenerationMode::InPlace {
                1
            } else {
                2
            };
            let mut readers: Vec<Peer> = (0..2)
                .map(|_| Peer::spawn(EVERY, "reader", &[(SET, &name)]))
                .collect();
            for p in &mut readers {
                let opened = p.expect("opened", T);
                assert_eq!(
                    opened,
                    format!("{b} {}", kind == "vmm"),
                    "{kind}: imports, read-only"
                );
            }
            for _ in 0..GENERATIONS {
                write_gen(&mut w, &k);
            }
            std::thread::sleep(Duration::from_millis(300));
            w.close(T).unwrap();
            for mut p in readers {
                let done = p.expect("done", T);
                let v: Vec<u64> = done.split(' ').map(|x| x.parse().unwrap()).collect();
                assert_eq!(v[1], GENERATIONS, "{kind}: the last generation seen");
                assert_eq!(
                    v[2], 0,
                    "{kind} {mode:?}: a reader saw a half-written generation"
                );
                if mode == GenerationMode::InPlace {
                    assert!(v[0] >= 1);
                }
                p.finish(T);
            }
        }
    }
}

const FAULT: &str = "a_store_into_a_read_only_mapping_faults_only_that_reader";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_store_into_a_read_only_mapping_faults_only_that_reader() {
    match role().as_deref() {
        Some("vandal") => {
            let c = ctx();
            let k = Kernels::load(&c).unwrap();
            let r = TensorSetReader::open(&c, &set_env(), &ReaderOptions::new()).unwrap();
            assert!(r.is_read_only());
            let h = r.current().unwrap().expect("generation 1");
            let s = h.stream().unwrap();
            let launched = k.fill_pattern(&h.device_tensor(0).unwrap(), 7, s);
            let synced = s.synchronize();
            let faulted = launched.is_err() || synced.is_err();
            tell(format!("faulted {faulted}"));
            // The context is broken now: leave without tearing anything down (the writer's
            // watchdog frees this reader's slot and hold once it is gone).
            std::process::exit(0);
        }
        Some("reader") => {
            let c = ctx();
            let k = Kernels::load(&c).unwrap();
            let bad = zeroed_counter(&c);
            let r = TensorSetReader::open(&c, &set_env(), &ReaderOptions::new()).unwrap();
            tell("opened");
            let mut last = 0;
            for line in parent_lines() {
                let want: u64 = line.parse().unwrap();
                while last < want {
                    let h = r.wait_newer(last, Some(T)).unwrap();
                    for t in 0..r.layout().len() {
                        k.check_pattern(
                            &h.device_tensor(t).unwrap(),
                            seed(h.generation(), t),
                            &bad,
                            h.stream().unwrap(),
                        )
                        .unwrap();
                    }
                    last = h.generation();
                }
                r.stream().unwrap().synchronize().unwrap();
                tell(format!("checked {last} {}", read_u64(&bad)));
            }
            return;
        }
        _ => {}
    }
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    let name = format!("tsfault-{}", std::process::id());
    let mut w = TensorSetWriter::create(&c, &name, &specs(), &TensorSetOptions::new()).unwrap();
    write_gen(&mut w, &k);
    let mut good = Peer::spawn(FAULT, "reader", &[(SET, &name)]);
    good.expect("opened", T);
    good.send("1");
    assert_eq!(good.expect("checked", T), "1 0");
    let mut vandal = Peer::spawn(FAULT, "vandal", &[(SET, &name)]);
    assert_eq!(vandal.expect("faulted", T), "true");
    let _ = vandal.child.wait();
    // The writer and the other reader go on: in place, the vandal's hold is freed once it is gone.
    for _ in 0..5 {
        write_gen(&mut w, &k);
    }
    w.stream().unwrap().synchronize().unwrap();
    good.send("6");
    assert_eq!(good.expect("checked", T), "6 0");
    w.close(T).unwrap();
    good.finish(T);
}

const KILLED: &str = "readers_and_writers_killed_mid_update";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn readers_and_writers_killed_mid_update() {
    match role().as_deref() {
        Some("slow-reader") => {
            let c = ctx();
            let k = Kernels::load(&c).unwrap();
            let r = TensorSetReader::open(&c, &set_env(), &ReaderOptions::new()).unwrap();
            let h = r.current().unwrap().expect("generation 1");
            k.spin(10_000_000_000, h.stream().unwrap()).unwrap(); // 10 s of GPU work while holding
            tell("holding");
            std::thread::sleep(T);
            return;
        }
        Some("writer") => {
            let c = ctx();
            let k = Kernels::load(&c).unwrap();
            let opts = TensorSetOptions::new().mode(GenerationMode::Buffered(2));
            let mut w = TensorSetWriter::create(&c, &set_env(), &specs(), &opts).unwrap();
            write_gen(&mut w, &k);
            w.stream().unwrap().synchronize().unwrap();
            tell("published 1");
            let _ = parent_lines().next();
            // Mid-update: generation 2 begun, a long kernel on the writer's stream, never committed.
            let u = w.begin(Some(T)).unwrap();
            k.spin(10_000_000_000, u.stream().unwrap()).unwrap();
            tell("updating");
            std::thread::sleep(T);
            return;
        }
        _ => {}
    }
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    // A reader killed while its kernel reads generation 1: the writer's next update proceeds.
    let name = format!("tskillr-{}", std::process::id());
    let mut w = TensorSetWriter::create(&c, &name, &specs(), &TensorSetOptions::new()).unwrap();
    write_gen(&mut w, &k);
    let mut p = Peer::spawn(KILLED, "slow-reader", &[(SET, &name)]);
    p.expect("holding", T);
    assert!(matches!(
        w.begin(Some(Duration::from_millis(100))),
        Err(Error::Timeout { .. })
    ));
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    let t = Instant::now();
    let g = write_gen(&mut w, &k);
    assert_eq!(g, 2);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    let d = common::drains_within(w.stream().unwrap(), Duration::from_secs(5));
    assert!(
        d.is_some(),
        "the writer's stream waits for a dead reader's release word"
    );
    w.close(T).unwrap();
    // A writer killed mid-update (buffered: generation 2 begun in the other buffer): the reader
    // keeps generation 1 and its bytes, and its wait ends with WriterGone.
    let name = format!("tskillw-{}", std::process::id());
    let mut p = Peer::spawn(KILLED, "writer", &[(SET, &name)]);
    p.expect("published", T);
    let r = TensorSetReader::open(&c, &name, &ReaderOptions::new()).unwrap();
    let bad = zeroed_counter(&c);
    let h = r.current().unwrap().expect("generation 1");
    p.send("go");
    p.expect("updating", T);
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    let t = Instant::now();
    match r.wait_newer(1, Some(T)) {
        Err(Error::TensorSet(TensorSetError::WriterGone { .. })) => {}
        other => panic!("expected WriterGone, got {other:?}"),
    }
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    for t in 0..r.layout().len() {
        k.check_pattern(
            &h.device_tensor(t).unwrap(),
            seed(1, t),
            &bad,
            h.stream().unwrap(),
        )
        .unwrap();
    }
    r.stream().unwrap().synchronize().unwrap();
    assert_eq!(read_u64(&bad), 0, "generation 1 changed under its reader");
    drop(h);
}

const OVER: &str = "a_set_over_given_vmm_allocations_is_read_in_place_with_one_import_each";

/// Zero-copy publishing of live memory: two VMM allocations of the writer's (say, chunks of an
/// arena a model was built in) published in place; a reader in another process imports each once,
/// read-only, and checks the tensors the writer filled before and after an update.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_set_over_given_vmm_allocations_is_read_in_place_with_one_import_each() {
    if role().as_deref() == Some("reader") {
        let c = ctx();
        let k = Kernels::load(&c).unwrap();
        let bad = zeroed_counter(&c);
        let r = TensorSetReader::open(&c, &set_env(), &ReaderOptions::new()).unwrap();
        tell(format!("opened {} {}", r.imports(), r.is_read_only()));
        let mut last = 0;
        for line in parent_lines() {
            let want: u64 = line.parse().unwrap();
            let h = r.wait_newer(last, Some(T)).unwrap();
            assert_eq!(h.generation(), want);
            for t in 0..r.layout().len() {
                k.check_pattern(
                    &h.device_tensor(t).unwrap(),
                    seed(want, t),
                    &bad,
                    h.stream().unwrap(),
                )
                .unwrap();
            }
            last = want;
            drop(h);
            r.stream().unwrap().synchronize().unwrap();
            tell(format!("checked {last} {}", read_u64(&bad)));
        }
        return;
    }
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    let g = cuda_ipc::ipc::vmm_granularity(&c.device()).unwrap();
    let a0 = cuda_ipc::ipc::VmmBuffer::new(&c, 2 * g).unwrap();
    let a1 = cuda_ipc::ipc::VmmBuffer::new(&c, g).unwrap();
    let tensors = vec![
        (TensorSpec::new("w0", DType::F32, &[1024]), 0, 0),
        (TensorSpec::new("w1", DType::BF16, &[64, 64]), 0, g as u64),
        (TensorSpec::new("w2", DType::F32, &[256]), 1, 512),
    ];
    let name = format!("tsover-{}", std::process::id());
    let mut w = TensorSetWriter::create_over(
        &c,
        &name,
        &tensors,
        vec![a0.clone(), a1.clone()],
        &TensorSetOptions::new(),
    )
    .unwrap();
    assert_eq!(w.layout().allocations().len(), 2);
    // The tensors lie in the given memory itself: no copy.
    for (t, (_, a, off)) in tensors.iter().enumerate() {
        let base = if *a == 0 { &a0 } else { &a1 };
        assert_eq!(w.device_ptr(0, t).unwrap(), base.device_ptr() + off);
    }
    let mut p = Peer::spawn(OVER, "reader", &[(SET, &name)]);
    assert_eq!(
        p.expect("opened", T),
        "2 true",
        "one import per allocation, read-only"
    );
    for _ in 0..3 {
        let g = write_gen(&mut w, &k);
        p.send(&g.to_string());
        assert_eq!(p.expect("checked", T), format!("{g} 0"));
    }
    w.close(T).unwrap();
    p.finish(T);
}

const MANY: &str = "a_set_of_many_allocations_is_imported_with_one_fd_fetch_each";

/// A set over 15 VMM allocations (as a model built in chunks of an arena): a reader in another
/// process fetches the 15 fds together (one round trip to the writer) and imports each once,
/// read-only; a second read-only reader in that process imports and fetches nothing; a read-write
/// reader beside them imports the 15 again (another cache key), and every reader checks every
/// tensor on the GPU.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_set_of_many_allocations_is_imported_with_one_fd_fetch_each() {
    if role().as_deref() == Some("reader") {
        let c = ctx();
        let k = Kernels::load(&c).unwrap();
        let bad = zeroed_counter(&c);
        let check = |r: &TensorSetReader| {
            let h = r.current().unwrap().expect("generation 1");
            for t in 0..r.layout().len() {
                k.check_pattern(
                    &h.device_tensor(t).unwrap(),
                    seed(1, t),
                    &bad,
                    h.stream().unwrap(),
                )
                .unwrap();
            }
            drop(h);
            r.stream().unwrap().synchronize().unwrap();
        };
        let fetches = || cuda_ipc::ipc::cache_stats().fd_fetches;
        let f0 = fetches();
        let r1 = TensorSetReader::open(&c, &set_env(), &ReaderOptions::new()).unwrap();
        let f1 = fetches();
        let r2 = TensorSetReader::open(&c, &set_env(), &ReaderOptions::new()).unwrap();
        let f2 = fetches();
        let rw = ReaderOptions::new().read_only(false);
        let r3 = TensorSetReader::open(&c, &set_env(), &rw).unwrap();
        let f3 = fetches();
        for r in [&r1, &r2, &r3] {
            check(r);
        }
        let p = r1.open_timings();
        assert!(
            p.fd_fetch > Duration::ZERO && p.map > Duration::ZERO,
            "{p:?}"
        );
        // `open` with a context: the tensor tables and the fingerprint are done by the join
        // thread (timed there), so the opening thread's manifest time does not hold them.
        assert!(
            p.tables > Duration::ZERO && p.fingerprint > Duration::ZERO,
            "{p:?}"
        );
        tell(format!(
            "opened {} {} {} {} {} {} {} {}",
            r1.imports(),
            f1 - f0,
            r2.imports(),
            f2 - f1,
            r3.imports(),
            f3 - f2,
            u8::from(r1.is_read_only()) + u8::from(r2.is_read_only()),
            read_u64(&bad)
        ));
        return;
    }
    const ALLOCATIONS: usize = 15;
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    let g = cuda_ipc::ipc::vmm_granularity(&c.device()).unwrap();
    let chunks: Vec<_> = (0..ALLOCATIONS)
        .map(|_| cuda_ipc::ipc::VmmBuffer::new(&c, g).unwrap())
        .collect();
    // Two tensors per allocation, the second at an offset within it.
    let tensors: Vec<_> = (0..2 * ALLOCATIONS)
        .map(|i| {
            let spec = TensorSpec::new(format!("chunk.{}.w{}", i / 2, i % 2), DType::F32, &[256]);
            (spec, (i / 2) as u32, (i % 2) as u64 * 4096)
        })
        .collect();
    let name = format!("tsmany-{}", std::process::id());
    let mut w = TensorSetWriter::create_over(&c, &name, &tensors, chunks, &TensorSetOptions::new())
        .unwrap();
    assert_eq!(write_gen(&mut w, &k), 1);
    w.stream().unwrap().synchronize().unwrap();
    let mut p = Peer::spawn(MANY, "reader", &[(SET, &name)]);
    assert_eq!(
        p.expect("opened", T),
        "15 15 0 0 15 15 2 0",
        "imports and fd fetches of the first read-only, the second read-only and the \
         read-write reader, the read-only count, mismatches"
    );
    p.finish(T);
    w.close(T).unwrap();
}

const DEFERRED: &str = "a_reader_makes_its_stream_only_when_a_generation_needs_it";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_reader_makes_its_stream_only_when_a_generation_needs_it() {
    if role().as_deref() == Some("reader") {
        let c = ctx();
        let k = Kernels::load(&c).unwrap();
        let bad = zeroed_counter(&c);
        let mine = Stream::new(&c).unwrap();
        let r = TensorSetReader::open(&c, &set_env(), &ReaderOptions::new()).unwrap();
        let n = r.layout().len();
        let mut lines = parent_lines();
        tell(format!("opened {}", r.has_stream()));
        {
            // Generation 1 was finished before the open: held without a stream, read on a stream
            // of this test's own, released from the host.
            let h = r.current().unwrap().expect("generation 1");
            assert_eq!(h.generation(), 1);
            h.ready_on(&mine).unwrap();
            for t in 0..n {
                k.check_pattern(&h.device_tensor(t).unwrap(), seed(1, t), &bad, &mine)
                    .unwrap();
            }
            mine.synchronize().unwrap();
            tell(format!("held {} {}", h.generation(), r.has_stream()));
            assert_eq!(lines.next().as_deref(), Some("release"));
        }
        tell(format!("released {}", r.has_stream()));
        // Generation 2 is committed while the writer's stream still spins before writing it:
        // taken before its work is done, the hold makes the stream and waits there.
        let h = r.wait_newer(1, Some(T)).unwrap();
        assert_eq!(h.generation(), 2);
        let made = r.has_stream();
        let s = h.stream().unwrap();
        for t in 0..n {
            k.check_pattern(&h.device_tensor(t).unwrap(), seed(2, t), &bad, s)
                .unwrap();
        }
        drop(h);
        // Generation 3, read on the test's stream again, now ordered through the reader's.
        let h = r.wait_newer(2, Some(T)).unwrap();
        h.ready_on(&mine).unwrap();
        for t in 0..n {
            k.check_pattern(&h.device_tensor(t).unwrap(), seed(3, t), &bad, &mine)
                .unwrap();
        }
        h.release_after(&mine).unwrap();
        drop(h);
        mine.synchronize().unwrap();
        r.stream().unwrap().synchronize().unwrap();
        tell(format!("done {made} {}", read_u64(&bad)));
        return;
    }
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    let name = format!("tsdefer-{}", std::process::id());
    let mut w = TensorSetWriter::create(&c, &name, &specs(), &TensorSetOptions::new()).unwrap();
    write_gen(&mut w, &k);
    w.stream().unwrap().synchronize().unwrap();
    let mut p = Peer::spawn(DEFERRED, "reader", &[(SET, &name)]);
    assert_eq!(p.expect("opened", T), "false", "the open made no stream");
    assert_eq!(
        p.expect("held", T),
        "1 false",
        "a finished generation is held without a stream"
    );
    p.send("release");
    assert_eq!(p.expect("released", T), "false");
    // The reader released generation 1 from the host: the in-place update proceeds (its
    // `begin` waits for that release).
    assert_eq!(write_gen_after(&mut w, &k, 300_000_000), 2);
    assert_eq!(write_gen(&mut w, &k), 3);
    assert_eq!(
        p.expect("done", T),
        "true 0",
        "a generation taken before its work was done made the stream; every check passed"
    );
    w.close(T).unwrap();
    p.finish(T);
}

/// A VMM set of 2^64 bytes or more (buffers × bytes per buffer) is refused as such before any
/// quota ledger is asked or anything is allocated (it read as a reservation of `u64::MAX` bytes),
/// and so is each of its generation modes; the host form runs in CI (`tests/quota_ledger.rs`).
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_vmm_set_of_2_pow_64_bytes_or_more_is_refused_before_any_budget() {
    use cuda_ipc::quota::QuotaScope;
    let c = ctx();
    // A group nobody set a budget for: a refusal by the ledger would name the missing ledger.
    let nobody = QuotaScope::Group(3_000_000_000 + std::process::id());
    let specs = [TensorSpec::new("w", DType::U8, &[1i64 << 62])];
    for (buffers, mode) in [
        (4, GenerationMode::Buffered(4)),
        (8, GenerationMode::Buffered(8)),
    ] {
        let opts = TensorSetOptions::new()
            .memory(MemoryKind::Vmm)
            .mode(mode)
            .quota(nobody);
        let name = format!("tshuge-{buffers}-{}", std::process::id());
        let e = TensorSetWriter::create(&c, &name, &specs, &opts).unwrap_err();
        let want = format!("a set of {buffers} buffers of 4611686018427387904 bytes is 2^64");
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains(&want)),
            "{buffers} buffers: {e:?}"
        );
        // Nothing of it stays behind: the name is free for a set that fits.
        let small = [TensorSpec::new("w", DType::U8, &[4096])];
        let w = TensorSetWriter::create(&c, &name, &small, &TensorSetOptions::new()).unwrap();
        w.close(T).unwrap();
    }
}
