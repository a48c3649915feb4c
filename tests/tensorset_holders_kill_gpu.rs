//! A VMM tensor set's writer killed while two reader processes read every tensor on the GPU in a
//! loop: the readers (each serving the set's fds, beside a `Holder` process) keep checking every
//! byte of the generation they hold, at least `AFTER_KILL` more passes each without an error or a
//! mismatch; a writer restarted under the name resumes on the same memory and publishes one more
//! generation, which both readers switch to and check; at the end no segment of the set is left
//! and the device memory came back. A writer killed after committing a generation its stream had
//! not finished: that generation is never held as whole. Needs a CUDA GPU and fails without one; `cargo test` lists it
//! as ignored.

mod common;

use common::{Peer, ctx, parent_lines, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::driver::DeviceBuffer;
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::raw::shm::Segment;
use cuda_ipc::tensorset::inspect::inspect;
use cuda_ipc::tensorset::reclaim::{Part, remove_stale};
use cuda_ipc::tensorset::{
    DType, GenerationMode, Holder, ReaderOptions, TensorSetError, TensorSetOptions,
    TensorSetReader, TensorSetWriter, TensorSpec,
};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
const SET: &str = "CUDA_IPC_TEST_SET";
/// Passes each reader makes over every tensor after it was told the writer was killed.
const AFTER_KILL: u64 = 200;
/// Generations the first writer publishes while the readers loop (one per parent line).
const BEFORE_KILL: u64 = 3;
/// How much device memory may differ from its level before the set was made (the driver's own
/// bookkeeping and its 2 MiB granularity).
const SLACK: usize = 2 << 20;
const TEST: &str = "writer_killed_while_two_readers_run_kernels_in_a_loop";

/// 64 tensors of 4 MiB each: 256 MiB a buffer.
fn specs() -> Vec<TensorSpec> {
    (0..64)
        .map(|i| match i % 4 {
            0 => TensorSpec::new(format!("layer.{i}.w"), DType::F32, &[1024, 1024]),
            1 => TensorSpec::new(format!("layer.{i}.w"), DType::BF16, &[2048, 1024]),
            2 => TensorSpec::new(format!("layer.{i}.w"), DType::U8, &[4096, 1024]),
            _ => TensorSpec::new(format!("layer.{i}.w"), DType::F32, &[4096, 256]),
        })
        .collect()
}

/// The pattern seed of tensor `t` in generation `g`.
fn seed(g: u64, t: usize) -> u32 {
    (g as u32).wrapping_mul(131).wrapping_add(t as u32)
}

fn opts() -> TensorSetOptions {
    TensorSetOptions::new().mode(GenerationMode::Buffered(2))
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

/// Fills every tensor of a new generation with its pattern, commits it and waits until its GPU work
/// completed (and, with `whole`, until it is recorded whole); returns its number.
fn publish(w: &mut TensorSetWriter, k: &Kernels, name: &str, whole: bool) -> u64 {
    let n = w.layout().len();
    let u = w.begin(Some(T)).unwrap();
    let g = u.generation();
    for t in 0..n {
        let d = u.device_tensor(t).unwrap();
        k.fill_pattern(&d, seed(g, t), u.stream().unwrap()).unwrap();
    }
    assert_eq!(u.commit().unwrap(), g);
    w.stream().unwrap().synchronize().unwrap();
    if whole {
        wait_whole(name, g);
    }
    g
}

/// One pass of a reader: holds the newest generation (`newer_than`: waits for one newer than
/// that, up to `T`), checks every byte of every tensor on the GPU (mismatches added to `bad`)
/// and returns its number.
fn one_pass(
    k: &Kernels,
    r: &TensorSetReader,
    bad: &DeviceBuffer,
    newer_than: Option<u64>,
) -> Result<Option<u64>, Error> {
    let h = match newer_than {
        None => match r.current()? {
            Some(h) => h,
            None => return Ok(None),
        },
        Some(g) => r.wait_newer(g, Some(Duration::from_secs(2)))?,
    };
    let s = h.stream().unwrap();
    for t in 0..r.layout().len() {
        let d = h.device_tensor(t).unwrap();
        k.check_pattern(&d, seed(h.generation(), t), bad, s)
            .unwrap();
    }
    s.synchronize().unwrap();
    Ok(Some(h.generation()))
}

/// Whether `e` says the reader's writer is gone or was replaced: reopen.
fn reopen_on(e: &Error) -> bool {
    matches!(
        e,
        Error::TensorSet(TensorSetError::WriterGone { .. } | TensorSetError::Closed(_))
    )
}

/// The next line from the parent, if one came.
fn poll(rx: &Receiver<String>) -> Option<String> {
    match rx.try_recv() {
        Ok(l) => Some(l),
        Err(TryRecvError::Empty) => None,
        Err(TryRecvError::Disconnected) => panic!("the parent went away"),
    }
}

/// A reader that loops over every tensor until told the writer was killed, makes `AFTER_KILL`
/// more passes, then (told the resumed writer's first generation `gw`) follows the set until it
/// checked a generation after `gw`.
fn reader(name: &str) {
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    let bad = zeroed_counter(&c);
    let ro = ReaderOptions::new().serve(true);
    let open = || TensorSetReader::open(&c, name, &ro).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in parent_lines() {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut r = open();
    let (mut passes, mut reopens, mut last) = (0u64, 0u64, 0u64);
    let mut told_ready = false;
    let mut killed_at: Option<u64> = None;
    loop {
        match one_pass(&k, &r, &bad, None) {
            Ok(Some(g)) => {
                assert!(g >= last, "generation {g} after {last}");
                last = g;
                passes += 1;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) if reopen_on(&e) => {
                // A reader opened before the writer's death may be told so; it reopens on what
                // the set's holders serve (the old reader dropped only after the new one opened).
                r = open();
                reopens += 1;
            }
            Err(e) => panic!("pass {passes}: {e}"),
        }
        if !told_ready && passes > 0 {
            tell(format!("ready {last}"));
            told_ready = true;
        }
        if let Some(l) = poll(&rx) {
            assert_eq!(l, "killed");
            killed_at = Some(passes);
        }
        if killed_at.is_some_and(|at| passes >= at + AFTER_KILL) {
            break;
        }
    }
    let after = passes - killed_at.unwrap_or(passes);
    tell(format!(
        "survived {after} {} {last} {reopens} {}",
        read_u64(&bad),
        r.is_writerless()
    ));
    let gw: u64 = loop {
        if let Some(l) = poll(&rx) {
            break l.strip_prefix("resumed ").unwrap().parse().unwrap();
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    // Follow the set: the old incarnation says its writer is gone, the new one publishes gw
    // again, then gw + 1.
    let start = Instant::now();
    let mut seen = 0;
    loop {
        assert!(start.elapsed() < T, "no generation after {gw} came");
        match one_pass(&k, &r, &bad, Some(seen)) {
            Ok(Some(g)) if g > gw => {
                tell(format!("switched {g} {}", read_u64(&bad)));
                break;
            }
            Ok(Some(g)) => seen = g,
            Ok(None) => {}
            Err(Error::Timeout { .. }) => {}
            Err(e) if reopen_on(&e) => {
                std::thread::sleep(Duration::from_millis(10));
                r = open();
                seen = 0;
            }
            Err(e) => panic!("after the resume: {e}"),
        }
    }
}

fn child(role: &str) {
    let name = std::env::var(SET).unwrap();
    match role {
        "writer" => {
            let c = ctx();
            let k = Kernels::load(&c).unwrap();
            let mut w = TensorSetWriter::create(&c, &name, &specs(), &opts()).unwrap();
            tell(format!("published {}", publish(&mut w, &k, &name, true)));
            for _ in parent_lines() {
                tell(format!("published {}", publish(&mut w, &k, &name, true)));
            }
            std::thread::sleep(T); // killed before
        }
        "holder" => {
            let h = Holder::open(&name).unwrap();
            tell(format!("holding {}", h.allocations()));
            std::thread::sleep(T * 3); // killed here
        }
        "reader" => reader(&name),
        "resumer" => {
            let c = ctx();
            let k = Kernels::load(&c).unwrap();
            let mut w = TensorSetWriter::create(&c, &name, &specs(), &opts()).unwrap();
            tell(format!(
                "resumed {} {} {}",
                w.resumed(),
                w.allocated_bytes(),
                w.generation()
            ));
            let mut lines = parent_lines();
            lines.next().expect("next");
            tell(format!("committed {}", publish(&mut w, &k, &name, false)));
            lines.next().expect("close");
            w.close(T).unwrap();
            tell("closed");
        }
        "cut-writer" => {
            let c = ctx();
            let k = Kernels::load(&c).unwrap();
            let mut w = TensorSetWriter::create(&c, &name, &specs(), &opts()).unwrap();
            tell(format!("published {}", publish(&mut w, &k, &name, true)));
            parent_lines().next().expect("go");
            // Generation 2: the stream is held by a long kernel before the fills, so the
            // generation is committed with none of its bytes written when the writer is killed.
            let n = w.layout().len();
            let u = w.begin(Some(T)).unwrap();
            let g = u.generation();
            k.spin(CUT_SPIN_NS, u.stream().unwrap()).unwrap();
            for t in 0..n {
                let d = u.device_tensor(t).unwrap();
                k.fill_pattern(&d, seed(g, t), u.stream().unwrap()).unwrap();
            }
            assert_eq!(u.commit().unwrap(), g);
            tell(format!("committed {g}"));
            std::thread::sleep(T); // killed before
        }
        other => panic!("unknown role {other}"),
    }
}

/// How long the killed writer's stream is held before its last generation's fills (ns).
const CUT_SPIN_NS: u64 = 30_000_000_000;
const CUT_TEST: &str = "a_generation_whose_writer_died_before_its_stream_finished_is_never_whole";

/// Checks every tensor of `h` against generation `g`'s pattern on the reader's stream; the
/// mismatches.
fn mismatches(k: &Kernels, r: &TensorSetReader, h: &cuda_ipc::tensorset::Held<'_>, g: u64) -> u64 {
    let c = r.context().unwrap();
    let bad = zeroed_counter(c);
    let s = h.stream().unwrap();
    for t in 0..r.layout().len() {
        k.check_pattern(&h.device_tensor(t).unwrap(), seed(g, t), &bad, s)
            .unwrap();
    }
    s.synchronize().unwrap();
    read_u64(&bad)
}

/// A writer killed after committing generation 2 while its stream had not yet written it: the
/// reader's hold taken before the kill says `whole() == None`, then `Some(false)`; no take hands
/// generation 2 out after the death (`WriterGone`, saying the bytes may be partial), also while
/// the earlier guard still holds its buffer; reopened, the set serves generation 1, whole and
/// checked on the GPU.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_generation_whose_writer_died_before_its_stream_finished_is_never_whole() {
    if let Some(r) = role() {
        return child(&r);
    }
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    let name = format!("tscut-{}", std::process::id());
    let env = [(SET, name.as_str())];
    let mut w = Peer::spawn(CUT_TEST, "cut-writer", &env);
    assert_eq!(w.expect("published", T), "1");
    let ro = ReaderOptions::new().serve(true);
    let r = TensorSetReader::open(&c, &name, &ro).unwrap();
    {
        let h = r.current().unwrap().expect("generation 1");
        assert_eq!(h.generation(), 1);
        assert_eq!(h.whole(), Some(true));
        assert_eq!(mismatches(&k, &r, &h, 1), 0);
    }
    w.send("go");
    assert_eq!(w.expect("committed", T), "2");
    let h2 = r.current().unwrap().expect("generation 2");
    assert_eq!(h2.generation(), 2);
    assert_eq!(h2.whole(), None, "the writer's stream is still held");
    w.child.kill().unwrap();
    w.child.wait().unwrap();
    // The reader's watchdog closes the generation channel's gate within about 1 s.
    let start = Instant::now();
    let why = loop {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "no error after the kill"
        );
        match r.current() {
            Ok(Some(h)) => {
                // Taken before the gate closed (whether it reads `None` still races the close).
                assert_eq!(h.generation(), 2);
                drop(h);
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(None) => panic!("no generation at all"),
            Err(Error::TensorSet(TensorSetError::WriterGone { why, .. })) => break why,
            Err(e) => panic!("{e}"),
        }
    };
    assert!(why.contains("partial"), "{why}");
    assert_eq!(h2.whole(), Some(false));
    drop(h2);
    assert!(matches!(
        r.current(),
        Err(Error::TensorSet(TensorSetError::WriterGone { .. }))
    ));
    assert!(matches!(
        r.wait_newer(2, Some(Duration::from_secs(2))),
        Err(Error::TensorSet(TensorSetError::WriterGone { .. }))
    ));
    // Reopened (the first reader serves the fds): the last whole generation, 1, checked.
    let r2 = TensorSetReader::open(&c, &name, &ReaderOptions::new()).unwrap();
    assert!(r2.is_writerless());
    let h = r2.current().unwrap().expect("the last whole generation");
    assert_eq!(h.generation(), 1);
    assert_eq!(h.whole(), Some(true));
    assert_eq!(mismatches(&k, &r2, &h, 1), 0);
    drop(h);
    drop(r2);
    drop(r);
    let _ = remove_stale(&name);
    for p in Part::ALL {
        assert!(Segment::stat(&p.segment_name(&name)).is_err(), "{p:?} left");
    }
}

/// Free device memory, once it has settled within `SLACK` of `want`, or after 10 s.
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

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn writer_killed_while_two_readers_run_kernels_in_a_loop() {
    if let Some(r) = role() {
        return child(&r);
    }
    let c = ctx();
    let _k = Kernels::load(&c).unwrap();
    c.synchronize().unwrap();
    let free0 = c.memory_info().unwrap().0;
    let name = format!("tskill-{}", std::process::id());
    let env = [(SET, name.as_str())];
    let mut w = Peer::spawn(TEST, "writer", &env);
    assert_eq!(w.expect("published", T), "1");
    let mut holder = Peer::spawn(TEST, "holder", &env);
    holder.expect("holding", T);
    let mut readers: Vec<Peer> = (0..2).map(|_| Peer::spawn(TEST, "reader", &env)).collect();
    for r in &mut readers {
        r.expect("ready", T);
    }
    // More generations while the readers loop, then the kill (every one of them whole).
    let mut g = 1;
    for _ in 1..BEFORE_KILL {
        w.send("next");
        g = w.expect("published", T).parse().unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    w.child.kill().unwrap();
    w.child.wait().unwrap();
    for r in &mut readers {
        r.send("killed");
    }
    for r in &mut readers {
        let line = r.expect("survived", T);
        let v: Vec<&str> = line.split(' ').collect();
        let after: u64 = v[0].parse().unwrap();
        assert!(after >= AFTER_KILL, "{line}");
        assert_eq!(v[1], "0", "mismatches before the resume: {line}");
        assert_eq!(v[2], g.to_string(), "the generation read last: {line}");
        eprintln!(
            "reader after the kill: {after} passes, {} reopens, writerless {}",
            v[3], v[4]
        );
    }
    let snap = inspect(&name).unwrap();
    assert!(snap.live_holders() >= 1, "{:?}", snap.holders);
    assert_eq!(snap.whole_generation, Some(g));
    // A writer restarted under the name resumes on the same memory.
    let mut rw = Peer::spawn(TEST, "resumer", &env);
    let line = rw.expect("resumed", T);
    let v: Vec<&str> = line.split(' ').collect();
    assert_eq!(v[0], "true", "the writer resumed: {line}");
    assert_eq!(v[1], "0", "bytes allocated by the resumed writer: {line}");
    assert_eq!(v[2], g.to_string(), "the resumed generation: {line}");
    for r in &mut readers {
        r.send(&format!("resumed {g}"));
    }
    rw.send("next");
    assert_eq!(rw.expect("committed", T), (g + 1).to_string());
    for r in &mut readers {
        assert_eq!(r.expect("switched", T), format!("{} 0", g + 1));
    }
    for r in readers {
        r.finish(T);
    }
    rw.send("close");
    rw.expect("closed", T);
    rw.finish(T);
    holder.child.kill().unwrap();
    holder.child.wait().unwrap();
    let _ = remove_stale(&name);
    for p in Part::ALL {
        assert!(Segment::stat(&p.segment_name(&name)).is_err(), "{p:?} left");
    }
    let free = settled_free(&c, free0);
    assert!(
        free.abs_diff(free0) <= SLACK,
        "device memory free {free} vs {free0} before the set"
    );
}
