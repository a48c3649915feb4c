//! GPU tests of tensor sets that outlive their writer, each with separate processes: a `Holder`
//! (or a reader opened with `serve(true)`) keeps a VMM set's fds after its writer is killed; a new
//! reader attaches from it within 1 s, reads the last whole generation and checks every byte on
//! the GPU; once the last holder is gone a new attach fails clearly, the device memory comes back
//! and `gc`'s removal takes the files. They need a CUDA GPU and fail without one; `cargo test`
//! lists them as ignored.

mod common;

use common::{Peer, ctx, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
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
/// How much device memory may differ from its level before the set was made: the driver's own
/// bookkeeping and its granularity (2 MiB on current GPUs) make it fuzzy below that.
const SLACK: usize = 2 << 20;

fn env(k: &str) -> String {
    std::env::var(k).unwrap()
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
            let mode = if env(MODE) == "1" {
                GenerationMode::Buffered(2)
            } else {
                GenerationMode::InPlace
            };
            let opts = TensorSetOptions::new().mode(mode);
            let mut w = TensorSetWriter::create(&c, &name, &specs(), &opts).unwrap();
            let gens: u64 = env(GENS).parse().unwrap();
            let n = w.layout().len();
            for _ in 0..gens {
                let u = w.begin(Some(T)).unwrap();
                let g = u.generation();
                for t in 0..n {
                    let d = u.device_tensor(t).unwrap();
                    k.fill_pattern(&d, seed(g, t), u.stream().unwrap()).unwrap();
                }
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
        other => panic!("unknown role {other}"),
    }
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
