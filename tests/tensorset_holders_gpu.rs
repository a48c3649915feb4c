//! GPU tests of tensor sets that outlive their writer, each with separate processes: a `Holder`
//! (or a reader opened with `serve(true)`) keeps a VMM set's fds after its writer is killed; a new
//! reader attaches from it within 1 s, reads the last whole generation and checks every byte on
//! the GPU; once the last holder is gone a new attach fails clearly, the device memory comes back
//! and `gc`'s removal takes the files. A writer restarted under the name of such a held set
//! resumes on its memory (nothing allocated, the last whole generation published again within 1 s
//! of its process start) and goes on, with readers of the new incarnation checking every
//! generation and a writerless reader of the old one delaying its first in-place write. They need
//! a CUDA GPU and fail without one; `cargo test` lists them as ignored.

mod common;

use common::{Peer, ctx, parent_lines, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::driver::DeviceBuffer;
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::raw::shm::Segment;
use cuda_ipc::tensorset::inspect::inspect;
use cuda_ipc::tensorset::reclaim::{Part, remove_stale};
use cuda_ipc::tensorset::{
    DType, GenerationMode, Holder, HolderRole, ReaderOptions, TensorSetError, TensorSetOptions,
    TensorSetReader, TensorSetWriter, TensorSpec,
};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
const SET: &str = "CUDA_IPC_TEST_SET";
const GENS: &str = "CUDA_IPC_TEST_GENERATIONS";
const MODE: &str = "CUDA_IPC_TEST_BUFFERED";
/// Generations a resumed writer publishes after the resumed one, and its readers check.
const MORE: &str = "CUDA_IPC_TEST_MORE";
/// How long a writerless reader keeps its guard once told to (ms).
const HOLD_MS: u64 = 500;
/// How much device memory may differ from its level before the set was made: the driver's own
/// bookkeeping and its granularity (2 MiB on current GPUs) make it fuzzy below that.
const SLACK: usize = 2 << 20;

fn env(k: &str) -> String {
    std::env::var(k).unwrap()
}

fn mode() -> GenerationMode {
    if env(MODE) == "1" {
        GenerationMode::Buffered(2)
    } else {
        GenerationMode::InPlace
    }
}

/// Fills every tensor of `u` with generation `g`'s pattern (on the update's stream).
fn fill(k: &Kernels, u: &cuda_ipc::tensorset::Update<'_>, n: usize) {
    let g = u.generation();
    for t in 0..n {
        let d = u.device_tensor(t).unwrap();
        k.fill_pattern(&d, seed(g, t), u.stream().unwrap()).unwrap();
    }
}

/// Checks every byte of the generation `h` holds against its pattern, adding mismatches to `bad`;
/// returns once the check ran.
fn check(k: &Kernels, r: &TensorSetReader, h: &cuda_ipc::tensorset::Held<'_>, bad: &DeviceBuffer) {
    for t in 0..r.layout().len() {
        let d = h.device_tensor(t).unwrap();
        k.check_pattern(&d, seed(h.generation(), t), bad, h.stream().unwrap())
            .unwrap();
    }
    h.stream().unwrap().synchronize().unwrap();
}

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("embed", DType::F32, &[4096, 1024]),
        TensorSpec::new("layer.0.w", DType::BF16, &[2048, 2048]),
        TensorSpec::new("layer.0.b", DType::F32, &[2048]),
        TensorSpec::new("head", DType::F8_E4M3FN, &[8192, 512]),
    ]
}

/// The pattern seed of tensor `t` in generation `g`.
fn seed(g: u64, t: usize) -> u32 {
    (g as u32).wrapping_mul(16).wrapping_add(t as u32)
}

/// Polls until the set's holders segment records generation `g` as whole.
fn wait_whole(name: &str, g: u64) {
    let start = Instant::now();
    while inspect(name).unwrap().whole_generation != Some(g) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "generation {g} never recorded whole"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The child roles shared by both tests.
fn child(role: &str) {
    let name = env(SET);
    match role {
        "writer" => {
            let c = ctx();
            let k = Kernels::load(&c).unwrap();
            let opts = TensorSetOptions::new().mode(mode());
            let mut w = TensorSetWriter::create(&c, &name, &specs(), &opts).unwrap();
            let gens: u64 = env(GENS).parse().unwrap();
            let n = w.layout().len();
            for _ in 0..gens {
                let u = w.begin(Some(T)).unwrap();
                fill(&k, &u, n);
                u.commit().unwrap();
            }
            w.stream().unwrap().synchronize().unwrap();
            wait_whole(&name, gens);
            tell(format!("published {gens}"));
            std::thread::sleep(T); // killed here
        }
        "holder" => {
            let h = Holder::open(&name).unwrap();
            tell(format!("holding {} {}", h.allocations(), h.bytes()));
            std::thread::sleep(T); // killed here
        }
        "serving-reader" => {
            let c = ctx();
            let k = Kernels::load(&c).unwrap();
            let bad = zeroed_counter(&c);
            let r = TensorSetReader::open(&c, &name, &ReaderOptions::new().serve(true)).unwrap();
            let h = r.current().unwrap().expect("a generation");
            for t in 0..r.layout().len() {
                let d = h.device_tensor(t).unwrap();
                k.check_pattern(&d, seed(h.generation(), t), &bad, h.stream().unwrap())
                    .unwrap();
            }
            r.stream().unwrap().synchronize().unwrap();
            tell(format!("serving {} {}", h.generation(), read_u64(&bad)));
            drop(h);
            std::thread::sleep(T); // killed here
        }
        "late-reader" => {
            let c = ctx();
            let k = Kernels::load(&c).unwrap();
            let bad = zeroed_counter(&c);
            let t0 = Instant::now();
            let r = match TensorSetReader::open(&c, &name, &ReaderOptions::new()) {
                Ok(r) => r,
                Err(e) => {
                    tell(format!("refused {e}"));
                    return;
                }
            };
            let open_ms = t0.elapsed().as_millis();
            let h = r.current().unwrap().expect("the last whole generation");
            for t in 0..r.layout().len() {
                let d = h.device_tensor(t).unwrap();
                k.check_pattern(&d, seed(h.generation(), t), &bad, h.stream().unwrap())
                    .unwrap();
            }
            r.stream().unwrap().synchronize().unwrap();
            let t1 = Instant::now();
            let gone = matches!(
                r.wait_newer(h.generation(), Some(T)),
                Err(Error::TensorSet(TensorSetError::WriterGone { .. }))
            );
            let wait_ms = t1.elapsed().as_millis();
            tell(format!(
                "checked {} {} {} {gone} {open_ms} {wait_ms}",
                h.generation(),
                read_u64(&bad),
                r.is_writerless(),
            ));
        }
        "resumer" => resumer(&name),
        "reader" => {
            let c = ctx();
            let k = Kernels::load(&c).unwrap();
            let bad = zeroed_counter(&c);
            let r = TensorSetReader::open(&c, &name, &ReaderOptions::new()).unwrap();
            let h = r.current().unwrap().expect("the resumed generation");
            check(&k, &r, &h, &bad);
            let mut last = h.generation();
            tell(format!(
                "checked {last} {} {}",
                read_u64(&bad),
                r.is_writerless()
            ));
            drop(h);
            let more: u64 = env(MORE).parse().unwrap();
            for _ in 0..more {
                let h = r.wait_newer(last, Some(T)).unwrap();
                check(&k, &r, &h, &bad);
                last = h.generation();
                tell(format!(
                    "checked {last} {} {}",
                    read_u64(&bad),
                    r.is_writerless()
                ));
            }
        }
        "writerless" => {
            let c = ctx();
            let k = Kernels::load(&c).unwrap();
            let bad = zeroed_counter(&c);
            let r = TensorSetReader::open(&c, &name, &ReaderOptions::new()).unwrap();
            let h = r.current().unwrap().expect("the last whole generation");
            let g = h.generation();
            tell(format!("holding {g} {}", r.is_writerless()));
            parent_lines().next().expect("go");
            let t0 = Instant::now();
            check(&k, &r, &h, &bad);
            std::thread::sleep(Duration::from_millis(HOLD_MS).saturating_sub(t0.elapsed()));
            let held_ms = t0.elapsed().as_millis();
            drop(h);
            tell(format!("dropped {} {held_ms}", read_u64(&bad)));
            let why = match r.wait_newer(g, Some(T)) {
                Err(Error::TensorSet(TensorSetError::WriterGone { why, .. })) => why,
                Err(e) => format!("other error {e}"),
                Ok(h) => format!("generation {}", h.generation()),
            };
            tell(format!("newer {why}"));
        }
        other => panic!("unknown role {other}"),
    }
}

/// A writer created under the name of a held set whose writer was killed: reports (the clock
/// taken before its context) whether it resumed, what it allocated, how long `create` took from
/// its start, the device memory `create` took and its first generation; checks that a reader in
/// its own process reads that generation; then per parent line publishes one more generation
/// (the time `begin` waited reported), and closes at the last line.
fn resumer(name: &str) {
    let t0 = Instant::now();
    let c = ctx();
    // The context's own lazy setup (its first stream) is not the set's: done before the reading.
    let warm = cuda_ipc::driver::Stream::new(&c).unwrap();
    warm.synchronize().unwrap();
    let free_a = c.memory_info().unwrap().0;
    let opts = TensorSetOptions::new().mode(mode());
    let mut w = TensorSetWriter::create(&c, name, &specs(), &opts).unwrap();
    let create_ms = t0.elapsed().as_millis();
    let free_b = c.memory_info().unwrap().0;
    let k = Kernels::load(&c).unwrap();
    let bad = zeroed_counter(&c);
    tell(format!(
        "resumed {} {} {create_ms} {} {}",
        w.resumed(),
        w.allocated_bytes(),
        free_a as i64 - free_b as i64,
        w.generation()
    ));
    // A reader in the writer's own process: its tokens name this process, its memory is an
    // import this process serves.
    let own = TensorSetReader::open(&c, name, &ReaderOptions::new()).unwrap();
    let h = own.current().unwrap().expect("the resumed generation");
    check(&k, &own, &h, &bad);
    tell(format!("own-reader {} {}", h.generation(), read_u64(&bad)));
    drop(h);
    drop(own);
    let n = w.layout().len();
    let more: u64 = env(MORE).parse().unwrap();
    let mut lines = parent_lines();
    for _ in 0..more {
        lines.next().expect("next");
        let t = Instant::now();
        let u = w.begin(Some(T)).unwrap();
        let begin_ms = t.elapsed().as_millis();
        fill(&k, &u, n);
        let g = u.commit().unwrap();
        tell(format!("committed {g} {begin_ms}"));
    }
    lines.next().expect("close");
    w.close(T).unwrap();
    tell("closed");
}

/// Free device memory, once it has settled within `SLACK` of `want` (the driver frees a dead
/// process's memory shortly after it is reaped), or after 10 s.
fn settled_free(c: &std::sync::Arc<cuda_ipc::driver::Context>, want: usize) -> usize {
    let start = Instant::now();
    loop {
        let free = c.memory_info().unwrap().0;
        if free.abs_diff(want) <= SLACK || start.elapsed() > Duration::from_secs(10) {
            return free;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kills the writer, attaches a late reader (must be writerless at generation `g`, every byte
/// right, `wait_newer` WriterGone at once, the open within 1 s), kills `survivor`, checks that a
/// new attach is refused clearly, that the device memory came back and that `gc` removes the set.
fn after_the_writer(
    test: &str,
    name: &str,
    mut writer: Peer,
    mut survivor: Peer,
    g: u64,
    free0: usize,
) {
    let c = ctx();
    writer.child.kill().unwrap();
    writer.child.wait().unwrap();
    let killed = Instant::now();
    let snap = inspect(name).unwrap();
    assert!(snap.live_holders() >= 1, "{:?}", snap.holders);
    let mut late = Peer::spawn(test, "late-reader", &[(SET, name)]);
    let line = late.expect("checked", T);
    let since_kill = killed.elapsed();
    let v: Vec<&str> = line.split(' ').collect();
    assert_eq!(v[0], g.to_string(), "the last whole generation");
    assert_eq!(v[1], "0", "bytes of the last whole generation differ");
    assert_eq!(v[2], "true", "the late reader is writerless");
    assert_eq!(v[3], "true", "wait_newer says WriterGone");
    let open_ms: u128 = v[4].parse().unwrap();
    let wait_ms: u128 = v[5].parse().unwrap();
    assert!(open_ms <= 1000, "the open took {open_ms} ms");
    assert!(wait_ms <= 100, "wait_newer took {wait_ms} ms");
    eprintln!(
        "late reader: open {open_ms} ms; kill to checked {since_kill:?} (process start, CUDA \
         init and the GPU check included)"
    );
    late.finish(T);
    survivor.child.kill().unwrap();
    survivor.child.wait().unwrap();
    let mut refused = Peer::spawn(test, "late-reader", &[(SET, name)]);
    let e = refused.expect("refused", T);
    assert!(e.contains("no process serves"), "{e}");
    refused.finish(T);
    let free = settled_free(&c, free0);
    assert!(
        free.abs_diff(free0) <= SLACK,
        "device memory free {free} vs {free0} before the set"
    );
    let removed = remove_stale(name).unwrap();
    for p in [Part::Manifest, Part::Generation, Part::Holders] {
        assert!(removed.contains(&p), "{p:?} not removed: {removed:?}");
        assert!(Segment::stat(&p.segment_name(name)).is_err(), "{p:?} left");
    }
}

const HELD: &str = "a_holder_keeps_a_set_attachable_after_its_writer_is_killed";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_holder_keeps_a_set_attachable_after_its_writer_is_killed() {
    if let Some(r) = role() {
        return child(&r);
    }
    let c = ctx();
    let _k = Kernels::load(&c).unwrap();
    c.synchronize().unwrap();
    let free0 = c.memory_info().unwrap().0;
    let name = format!("tsheld-{}", std::process::id());
    let mut w = Peer::spawn(HELD, "writer", &[(SET, &name), (GENS, "1"), (MODE, "0")]);
    assert_eq!(w.expect("published", T), "1");
    let mut h = Peer::spawn(HELD, "holder", &[(SET, &name)]);
    let holding = h.expect("holding", T);
    let snap = inspect(&name).unwrap();
    assert_eq!(holding, format!("1 {}", snap.bytes));
    let roles: Vec<HolderRole> = snap.holders.iter().map(|x| x.role).collect();
    assert!(roles.contains(&HolderRole::Writer) && roles.contains(&HolderRole::Holder));
    after_the_writer(HELD, &name, w, h, 1, free0);
}

const SERVED: &str = "a_serving_reader_keeps_a_buffered_set_attachable_after_its_writer_is_killed";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_serving_reader_keeps_a_buffered_set_attachable_after_its_writer_is_killed() {
    if let Some(r) = role() {
        return child(&r);
    }
    let c = ctx();
    let _k = Kernels::load(&c).unwrap();
    c.synchronize().unwrap();
    let free0 = c.memory_info().unwrap().0;
    let name = format!("tsserved-{}", std::process::id());
    let mut w = Peer::spawn(SERVED, "writer", &[(SET, &name), (GENS, "3"), (MODE, "1")]);
    assert_eq!(w.expect("published", T), "3");
    let mut r = Peer::spawn(SERVED, "serving-reader", &[(SET, &name)]);
    assert_eq!(r.expect("serving", T), "3 0");
    let snap = inspect(&name).unwrap();
    assert!(
        snap.holders.iter().any(|x| x.role == HolderRole::Reader),
        "{:?}",
        snap.holders
    );
    after_the_writer(SERVED, &name, w, r, 3, free0);
}

/// Starts a writer that publishes `gens` generations (`buffered`: B = 2) and a `Holder`, then
/// kills the writer; returns the holder.
fn held_and_killed(test: &str, name: &str, gens: &str, buffered: &str) -> Peer {
    let mut w = Peer::spawn(
        test,
        "writer",
        &[(SET, name), (GENS, gens), (MODE, buffered)],
    );
    assert_eq!(w.expect("published", T), gens);
    let mut h = Peer::spawn(test, "holder", &[(SET, name)]);
    h.expect("holding", T);
    w.child.kill().unwrap();
    w.child.wait().unwrap();
    h
}

/// Reads the resumer's first two lines: it resumed at generation `g` with nothing allocated
/// (`allocated_bytes` 0, device memory within `SLACK`), `create` returned within 1 s of its
/// start, and a reader in its own process checked generation `g` with no mismatch.
fn resumed(rw: &mut Peer, g: u64) {
    let line = rw.expect("resumed", T);
    let v: Vec<&str> = line.split(' ').collect();
    assert_eq!(v[0], "true", "the writer resumed: {line}");
    assert_eq!(v[1], "0", "bytes allocated by the resumed writer");
    let create_ms: u128 = v[2].parse().unwrap();
    let took: i64 = v[3].parse().unwrap();
    assert!(
        took.unsigned_abs() as usize <= SLACK,
        "create took {took} bytes of device memory"
    );
    assert_eq!(v[4], g.to_string(), "the resumed generation");
    eprintln!(
        "resume: process start (before the context) to create's return {create_ms} ms; device          memory taken by create {took} bytes"
    );
    assert!(create_ms <= 1000, "start to resumed took {create_ms} ms");
    assert_eq!(rw.expect("own-reader", T), format!("{g} 0"));
}

/// Kills the holder once the resumed writer closed: the set's files are gone (or `gc` removes
/// them) and the device memory came back.
fn all_gone(mut holder: Peer, name: &str, free0: usize) {
    let c = ctx();
    holder.child.kill().unwrap();
    holder.child.wait().unwrap();
    let _ = remove_stale(name);
    for p in [Part::Manifest, Part::Generation, Part::Holders] {
        assert!(Segment::stat(&p.segment_name(name)).is_err(), "{p:?} left");
    }
    let free = settled_free(&c, free0);
    assert!(
        free.abs_diff(free0) <= SLACK,
        "device memory free {free} vs {free0} before the set"
    );
}

/// Free device memory before a test's set, with the kernels loaded.
fn free_before() -> usize {
    let c = ctx();
    let _k = Kernels::load(&c).unwrap();
    c.synchronize().unwrap();
    c.memory_info().unwrap().0
}

const RESUMED: &str = "a_writer_restarted_under_a_held_sets_name_resumes_on_its_memory";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_writer_restarted_under_a_held_sets_name_resumes_on_its_memory() {
    if let Some(r) = role() {
        return child(&r);
    }
    let free0 = free_before();
    let name = format!("tsresumed-{}", std::process::id());
    let h = held_and_killed(RESUMED, &name, "1", "0");
    let mut rw = Peer::spawn(
        RESUMED,
        "resumer",
        &[(SET, &name), (MODE, "0"), (MORE, "1")],
    );
    resumed(&mut rw, 1);
    let mut r = Peer::spawn(RESUMED, "reader", &[(SET, &name), (MORE, "1")]);
    assert_eq!(
        r.expect("checked", T),
        "1 0 false",
        "generation, mismatches, writerless"
    );
    rw.send("next");
    assert!(rw.expect("committed", T).starts_with("2 "));
    assert_eq!(r.expect("checked", T), "2 0 false");
    r.finish(T);
    rw.send("close");
    rw.expect("closed", T);
    rw.finish(T);
    all_gone(h, &name, free0);
}

const WAITED: &str =
    "a_resumed_writer_waits_for_a_writerless_readers_guard_before_writing_in_place";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_resumed_writer_waits_for_a_writerless_readers_guard_before_writing_in_place() {
    if let Some(r) = role() {
        return child(&r);
    }
    let free0 = free_before();
    let name = format!("tswaited-{}", std::process::id());
    let h = held_and_killed(WAITED, &name, "1", "0");
    let mut wl = Peer::spawn(WAITED, "writerless", &[(SET, &name)]);
    assert_eq!(wl.expect("holding", T), "1 true", "generation, writerless");
    let mut rw = Peer::spawn(WAITED, "resumer", &[(SET, &name), (MODE, "0"), (MORE, "1")]);
    resumed(&mut rw, 1);
    // The reader keeps its guard HOLD_MS from now; the writer's begin starts meanwhile.
    wl.send("go");
    rw.send("next");
    let line = rw.expect("committed", T);
    let (g, begin_ms) = line.split_once(' ').unwrap();
    assert_eq!(g, "2");
    let begin_ms: u64 = begin_ms.parse().unwrap();
    let dropped = wl.expect("dropped", T);
    let (bad, held_ms) = dropped.split_once(' ').unwrap();
    assert_eq!(
        bad, "0",
        "bytes changed under the writerless reader's guard"
    );
    eprintln!("begin waited {begin_ms} ms for a guard held {held_ms} ms");
    assert!(
        begin_ms >= 300,
        "begin returned after {begin_ms} ms, under the reader's guard"
    );
    let why = wl.expect("newer", T);
    assert!(why.contains("resumed"), "wait_newer said: {why}");
    wl.finish(T);
    rw.send("close");
    rw.expect("closed", T);
    rw.finish(T);
    all_gone(h, &name, free0);
}

const FOLLOWED: &str = "a_resumed_buffered_set_goes_on_for_20_generations_under_two_readers";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_resumed_buffered_set_goes_on_for_20_generations_under_two_readers() {
    if let Some(r) = role() {
        return child(&r);
    }
    const MORE_GENS: u64 = 20;
    let free0 = free_before();
    let name = format!("tsfollowed-{}", std::process::id());
    let h = held_and_killed(FOLLOWED, &name, "3", "1");
    let more = MORE_GENS.to_string();
    let mut rw = Peer::spawn(
        FOLLOWED,
        "resumer",
        &[(SET, &name), (MODE, "1"), (MORE, &more)],
    );
    resumed(&mut rw, 3);
    let mut readers: Vec<Peer> = (0..2)
        .map(|_| Peer::spawn(FOLLOWED, "reader", &[(SET, &name), (MORE, &more)]))
        .collect();
    for r in &mut readers {
        assert_eq!(r.expect("checked", T), "3 0 false");
    }
    for g in 4..4 + MORE_GENS {
        rw.send("next");
        assert!(rw.expect("committed", T).starts_with(&format!("{g} ")));
        for r in &mut readers {
            assert_eq!(r.expect("checked", T), format!("{g} 0 false"));
        }
    }
    for r in readers {
        r.finish(T);
    }
    rw.send("close");
    rw.expect("closed", T);
    rw.finish(T);
    all_gone(h, &name, free0);
}

const NS: &str = "holders_in_other_pid_namespaces_serve_in_turn_until_the_last_is_killed";

/// Spawns `role` as pid 1 of a pid namespace of its own (a container's main process).
fn spawn_pid1(role: &str, name: &str) -> Peer {
    let wrapper = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"];
    Peer::spawn_under(&wrapper, NS, role, &[(SET, name)])
}

/// Asserts a late reader's line: writerless at generation `g`, every byte right.
fn late_checked(line: &str, g: u64) {
    let v: Vec<&str> = line.split(' ').collect();
    assert_eq!(v[0], g.to_string(), "the last whole generation: {line}");
    assert_eq!(
        v[1], "0",
        "bytes of the last whole generation differ: {line}"
    );
    assert_eq!(v[2], "true", "the late reader is writerless: {line}");
}

#[test]
#[ignore = "needs a CUDA GPU and root (scripts/gpu-test.sh)"]
fn holders_in_other_pid_namespaces_serve_in_turn_until_the_last_is_killed() {
    if let Some(r) = role() {
        return child(&r);
    }
    let c = ctx();
    let _k = Kernels::load(&c).unwrap();
    c.synchronize().unwrap();
    let free0 = c.memory_info().unwrap().0;
    let name = format!("tsns-{}", std::process::id());
    let mut w = Peer::spawn(NS, "writer", &[(SET, &name), (GENS, "2"), (MODE, "0")]);
    assert_eq!(w.expect("published", T), "2");
    // Two holders, each pid 1 of its own pid namespace, and one in this namespace.
    let mut holders: Vec<Peer> = vec![spawn_pid1("holder", &name), spawn_pid1("holder", &name)];
    holders.push(Peer::spawn(NS, "holder", &[(SET, &name)]));
    for h in &mut holders {
        h.expect("holding", T);
    }
    // `live_holders` counts holders only, never the writer.
    assert_eq!(
        inspect(&name).unwrap().live_holders(),
        3,
        "three holders beside the writer"
    );
    w.child.kill().unwrap();
    w.child.wait().unwrap();
    // Killed one after another: after each, a reader that is pid 1 of its own namespace attaches
    // from one of those left and checks every byte; after the last, an attach is refused.
    let n = holders.len();
    for (i, mut h) in holders.into_iter().enumerate() {
        let mut late = spawn_pid1("late-reader", &name);
        late_checked(&late.expect("checked", T), 2);
        late.finish(T);
        assert_eq!(
            inspect(&name).unwrap().live_holders(),
            n - i,
            "holders left"
        );
        h.child.kill().unwrap();
        h.child.wait().unwrap();
    }
    let mut refused = spawn_pid1("late-reader", &name);
    let e = refused.expect("refused", T);
    assert!(e.contains("no process serves"), "{e}");
    refused.finish(T);
    let free = settled_free(&c, free0);
    assert!(
        free.abs_diff(free0) <= SLACK,
        "device memory free {free} vs {free0} before the set"
    );
    let removed = remove_stale(&name).unwrap();
    for p in [Part::Manifest, Part::Generation, Part::Holders] {
        assert!(removed.contains(&p), "{p:?} not removed: {removed:?}");
    }
}
