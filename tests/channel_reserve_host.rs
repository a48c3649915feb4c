//! The producer's reservation of a pool of one buffer (layout version 7), on host memory without a
//! GPU, with the real producer, consumers, tensor-set writer and readers, some in other
//! processes: a writer or producer killed while it reserves, a reader or consumer killed while
//! its hold keeps a reservation waiting, `try_acquire` against holds (no reservation outlives
//! it), every-frame consumers that have not received the frame (never reserved away from them),
//! threads of several readers taking while a writer begins, drops and commits, what inspection
//! shows mid-reservation, and a segment of layout version 6 refused.

mod common;

use common::{Peer, parent_lines, role, tell};
use cuda_ipc::Error;
use cuda_ipc::channel::inspect::BufferState;
use cuda_ipc::channel::{
    ChannelError, ChannelOptions, Consumer, ConsumerOptions, Delivery, Producer, inspect,
};
use cuda_ipc::cleanup::{self, LeftoverKind, Scope};
use cuda_ipc::tensorset::{
    self, DType, GenerationMode, ReaderOptions, TensorSetError, TensorSetOptions, TensorSetReader,
    TensorSetWriter, TensorSpec,
};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const ANSWER: Duration = Duration::from_secs(20);
const NAME: &str = "CUDA_IPC_TEST_NAME";
const BYTES: usize = 4096;

fn unique(tag: &str) -> String {
    format!("resv-{tag}-{}", std::process::id())
}

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("a", DType::F32, &[300]),
        TensorSpec::new("b", DType::U8, &[777]),
    ]
}

fn in_place() -> TensorSetOptions {
    TensorSetOptions::new().mode(GenerationMode::InPlace)
}

/// Byte `k` of tensor `t` in generation `g` (or of frame `g`, tensor 0).
fn pattern(g: u64, t: usize, k: usize) -> u8 {
    (g.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ (k as u8).wrapping_mul(31) ^ (t as u8 * 7)
}

fn write_gen(w: &mut TensorSetWriter) -> u64 {
    let g = w.generation() + 1;
    let sizes: Vec<u64> = w.layout().tensors().iter().map(|t| t.bytes).collect();
    let mut u = w.begin(Some(ANSWER)).expect("begin");
    for (t, n) in sizes.iter().enumerate() {
        let bytes: Vec<u8> = (0..*n as usize).map(|k| pattern(g, t, k)).collect();
        u.write_tensor(t, &bytes).unwrap();
    }
    assert_eq!(u.commit().unwrap(), g);
    g
}

fn check_gen(held: &tensorset::Held<'_>) {
    let g = held.generation();
    for t in 0..2 {
        let bytes = held.read_tensor(t).unwrap();
        for (k, b) in bytes.iter().enumerate() {
            assert_eq!(*b, pattern(g, t, k), "generation {g} tensor {t} byte {k}");
        }
    }
}

fn write_frame(tx: &mut Producer) -> u64 {
    let seq = tx.stats().head + 1;
    let mut w = tx.acquire(Some(ANSWER)).expect("acquire");
    let bytes: Vec<u8> = (0..w.len()).map(|k| pattern(seq, 0, k)).collect();
    w.write_at(0, &bytes).unwrap();
    assert_eq!(w.publish(&seq.to_le_bytes()).unwrap(), seq);
    seq
}

fn check_frame(f: &cuda_ipc::channel::Frame<'_>) {
    assert_eq!(f.metadata(), f.seq().to_le_bytes());
    let bytes = f.to_vec().unwrap();
    for (k, b) in bytes.iter().enumerate() {
        assert_eq!(*b, pattern(f.seq(), 0, k), "frame {} byte {k}", f.seq());
    }
}

fn kill9(pid: u32) {
    let st = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

/// Buffer 0's state and hold mask in the set's generation channel.
fn set_buffer(name: &str) -> (BufferState, u64) {
    let c = tensorset::inspect::inspect(name)
        .unwrap()
        .channel
        .expect("the generation channel");
    (c.buffers[0].state, c.buffers[0].hold_mask)
}

/// Polls `what` every millisecond until it holds, up to `ANSWER`.
fn until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < ANSWER, "never: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The child side of every test: the role names what to do.
#[test]
fn child() {
    let Some(r) = role() else { return };
    let name = std::env::var(NAME).unwrap();
    match r.as_str() {
        // An in-place set's writer: generation 1, then on "begin" a begin that waits for good.
        "writer" => {
            let mut w = TensorSetWriter::create_host(&name, &specs(), &in_place()).unwrap();
            tell(format!("published {}", write_gen(&mut w)));
            for line in parent_lines() {
                if line == "begin" {
                    tell("beginning");
                    let u = w.begin(None).unwrap();
                    tell(format!("begun {}", u.generation()));
                    std::thread::sleep(Duration::from_secs(600));
                }
            }
        }
        // A set's reader holding the current generation until killed.
        "set-hold" => {
            let rx = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
            let h = rx.current().unwrap().expect("a generation");
            check_gen(&h);
            tell(format!("holding {}", h.generation()));
            std::thread::sleep(Duration::from_secs(600));
        }
        // A one-buffer channel's producer: frame 1, then on "acquire" an acquire for good.
        "producer" => {
            let mut tx =
                Producer::create_host(&name, &ChannelOptions::new(BYTES).buffers(1)).unwrap();
            tell("created");
            for line in parent_lines() {
                match line.as_str() {
                    "publish" => tell(format!("published {}", write_frame(&mut tx))),
                    "acquire" => {
                        tell("acquiring");
                        let _w = tx.acquire(None).unwrap();
                        tell("acquired");
                        std::thread::sleep(Duration::from_secs(600));
                    }
                    _ => {}
                }
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn spawn(role: &str, name: &str) -> Peer {
    Peer::spawn("child", role, &[(NAME, name)])
}

#[test]
fn a_writer_killed_while_it_reserves_leaves_held_bytes_writer_gone_and_gc() {
    if role().is_some() {
        return;
    }
    let name = unique("wkill");
    let mut p = spawn("writer", &name);
    assert_eq!(p.expect("published", ANSWER), "1");
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let h = r.current().unwrap().expect("generation 1");
    p.send("begin");
    p.expect("beginning", ANSWER);
    // Reserved: WRITING with the reader's hold there; no new take.
    until("the buffer reserved", || {
        set_buffer(&name).0 == BufferState::Writing
    });
    assert_ne!(set_buffer(&name).1, 0, "the hold is kept");
    assert!(
        r.current().unwrap().is_none(),
        "a take during a reservation"
    );
    kill9(p.child.id());
    let _ = p.child.wait();
    // The held generation's bytes are as they were.
    check_gen(&h);
    let t = Instant::now();
    match r.wait_newer(1, Some(ANSWER)) {
        Err(Error::TensorSet(TensorSetError::WriterGone { name: n, .. })) => assert_eq!(n, name),
        other => panic!("expected WriterGone, got {other:?}"),
    }
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    match r.current() {
        Err(Error::TensorSet(TensorSetError::WriterGone { .. })) | Ok(None) => {}
        other => panic!("current after the writer died reserving: {other:?}"),
    }
    check_gen(&h);
    drop(h);
    drop(r);
    let scope = Scope::only(vec![], vec![]).with_tensor_sets(vec![name.clone()]);
    let scan = cleanup::scan(&scope).unwrap();
    let kinds: Vec<_> = scan.leftovers.iter().map(|l| l.kind).collect();
    assert_eq!(
        kinds,
        vec![LeftoverKind::TensorSet; 3],
        "{:?}",
        scan.leftovers
    );
    let removal = cleanup::remove(&scan.leftovers);
    assert_eq!(removal.removed.len(), 3, "{removal:?}");
    assert!(cleanup::scan(&scope).unwrap().leftovers.is_empty());
    // A new writer makes the set again under the name.
    let mut w = TensorSetWriter::create_host(&name, &specs(), &in_place()).unwrap();
    assert_eq!(write_gen(&mut w), 1);
    w.close(ANSWER).unwrap();
}

#[test]
fn a_producer_killed_while_it_reserves_gives_producer_gone_to_both_policies() {
    if role().is_some() {
        return;
    }
    let ch = unique("pkill");
    let mut p = spawn("producer", &ch);
    p.expect("created", ANSWER);
    let latest =
        Consumer::attach(&ch, &ConsumerOptions::new().delivery(Delivery::LatestOnly)).unwrap();
    let every =
        Consumer::attach(&ch, &ConsumerOptions::new().delivery(Delivery::EveryFrame)).unwrap();
    p.send("publish");
    assert_eq!(p.expect("published", ANSWER), "1");
    let f = latest.recv_timeout(ANSWER).unwrap();
    // The every-frame consumer has not received frame 1: the acquire waits without reserving.
    p.send("acquire");
    p.expect("acquiring", ANSWER);
    std::thread::sleep(Duration::from_millis(200));
    let snap = inspect::inspect(&ch).unwrap();
    assert_eq!(
        snap.buffers[0].state,
        BufferState::Frame(1),
        "reserved from an every-frame consumer that has not received it"
    );
    let g = every.recv_timeout(ANSWER).unwrap();
    assert_eq!(g.seq(), 1);
    check_frame(&g);
    drop(g);
    // Now only the latest-only consumer's hold is there: reserved.
    until("the buffer reserved", || {
        inspect::inspect(&ch).unwrap().buffers[0].state == BufferState::Writing
    });
    kill9(p.child.id());
    let _ = p.child.wait();
    check_frame(&f);
    for rx in [&latest, &every] {
        let t = Instant::now();
        match rx.recv_timeout(ANSWER) {
            Err(Error::Channel(ChannelError::ProducerGone { .. })) => {}
            other => panic!("expected ProducerGone, got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }
    drop(f);
    drop((latest, every));
    assert!(
        cuda_ipc::channel::reclaim::remove_stale(&ch)
            .unwrap()
            .is_some()
    );
}

#[test]
fn a_reader_killed_while_its_hold_keeps_a_reservation_waiting_is_freed_within_a_second() {
    if role().is_some() {
        return;
    }
    let name = unique("rkill");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &in_place()).unwrap();
    write_gen(&mut w);
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let mut p = spawn("set-hold", &name);
    assert_eq!(p.expect("holding", ANSWER), "1");
    let pid = p.child.id();
    std::thread::scope(|s| {
        let killer = s.spawn(|| {
            until("the buffer reserved", || {
                set_buffer(&name).0 == BufferState::Writing
            });
            // No take while reserved.
            assert!(r.current().unwrap().is_none());
            kill9(pid);
            Instant::now()
        });
        let u = w.begin(Some(ANSWER)).expect("begin after the reader died");
        let killed = killer.join().unwrap();
        assert!(
            killed.elapsed() < Duration::from_millis(1500),
            "{:?}",
            killed.elapsed()
        );
        assert_eq!(u.commit().unwrap(), 2);
    });
    let _ = p.child.wait();
    let h = r.current().unwrap().expect("generation 2");
    assert_eq!(h.generation(), 2);
    drop(h);
    assert_eq!(set_buffer(&name), (BufferState::Frame(2), 0));
    drop(r);
    w.close(ANSWER).unwrap();
}

#[test]
fn try_acquire_against_a_hold_leaves_no_reservation_and_starves_no_consumer() {
    if role().is_some() {
        return;
    }
    let ch = unique("try");
    let mut tx = Producer::create_host(&ch, &ChannelOptions::new(BYTES).buffers(1)).unwrap();
    let opts = ConsumerOptions::new().delivery(Delivery::LatestOnly);
    let a = Consumer::attach(&ch, &opts).unwrap();
    let b = Consumer::attach(&ch, &opts).unwrap();
    write_frame(&mut tx);
    let f = a.recv_timeout(ANSWER).unwrap();
    let stop = AtomicBool::new(false);
    let taken = AtomicU64::new(0);
    std::thread::scope(|s| {
        // b takes frame 1 while the producer tries in a loop: never turned away for good.
        s.spawn(|| {
            let g = b
                .recv_timeout(ANSWER)
                .expect("b's take while the producer tries");
            check_frame(&g);
            taken.store(g.seq(), Ordering::SeqCst);
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        for _ in 0..20_000 {
            assert!(tx.try_acquire().unwrap().is_none());
            let snap = inspect::inspect(&ch).unwrap();
            assert_eq!(
                snap.buffers[0].state,
                BufferState::Frame(1),
                "a reservation outlived try_acquire"
            );
            if taken.load(Ordering::SeqCst) != 0 {
                break;
            }
        }
        assert_eq!(taken.load(Ordering::SeqCst), 1, "b never took frame 1");
        stop.store(true, Ordering::SeqCst);
    });
    check_frame(&f);
    drop(f);
    let t = Instant::now();
    assert_eq!(write_frame(&mut tx), 2);
    assert!(t.elapsed() < Duration::from_secs(1));
    assert_eq!(tx.stats().consumers.len(), 2);
    let g = b.recv_timeout(ANSWER).unwrap();
    assert_eq!(g.seq(), 2);
    drop(g);
    let snap = inspect::inspect(&ch).unwrap();
    assert_eq!(snap.buffers[0].hold_mask, 0);
    drop((a, b));
    tx.close(ANSWER).unwrap();
}

#[test]
fn an_every_frame_consumer_behind_is_never_reserved_away_from() {
    if role().is_some() {
        return;
    }
    for ring in [false, true] {
        let ch = unique(if ring { "every-ring" } else { "every" });
        let mut tx =
            Producer::create_host(&ch, &ChannelOptions::new(BYTES).buffers(1).ring(ring)).unwrap();
        let latest =
            Consumer::attach(&ch, &ConsumerOptions::new().delivery(Delivery::LatestOnly)).unwrap();
        let every =
            Consumer::attach(&ch, &ConsumerOptions::new().delivery(Delivery::EveryFrame)).unwrap();
        for round in 1..=20u64 {
            assert_eq!(write_frame(&mut tx), round);
            let f = latest.recv_timeout(ANSWER).unwrap();
            assert_eq!(f.seq(), round);
            // Every-frame behind, a latest-only hold: the acquire waits, the frame stays.
            match tx.acquire(Some(Duration::from_millis(20))) {
                Err(Error::Timeout { .. }) => {}
                Err(e) => panic!("acquire: {e}"),
                Ok(_) => panic!(
                    "acquired frame {round}'s buffer before the every-frame consumer took it"
                ),
            }
            assert_eq!(
                inspect::inspect(&ch).unwrap().buffers[0].state,
                BufferState::Frame(round)
            );
            std::thread::scope(|s| {
                let got = s.spawn(|| {
                    let g = every.recv_timeout(ANSWER).expect("the every-frame take");
                    check_frame(&g);
                    g.seq()
                });
                // The producer waits meanwhile: the latest-only hold ends a little later.
                let w = s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(5));
                    drop(f);
                });
                assert_eq!(got.join().unwrap(), round);
                w.join().unwrap();
            });
        }
        drop((latest, every));
        tx.close(ANSWER).unwrap();
    }
}

#[test]
fn threads_of_readers_take_while_a_writer_begins_drops_and_commits() {
    if role().is_some() {
        return;
    }
    let name = unique("hammer");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &in_place()).unwrap();
    write_gen(&mut w);
    let readers: Vec<TensorSetReader> = (0..3)
        .map(|_| TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap())
        .collect();
    let stop = AtomicBool::new(false);
    /// Stops the reading threads however the writer's loop ends.
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        let stopping = Stop(&stop);
        let threads: Vec<_> = (0..9)
            .map(|k| {
                let (r, stop) = (&readers[k % 3], &stop);
                s.spawn(move || {
                    let (mut holds, mut newest) = (0u64, 0u64);
                    let mut guards = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let got = if k % 2 == 0 {
                            r.current()
                        } else {
                            r.wait_newer(newest, Some(Duration::from_millis(20)))
                                .map(Some)
                        };
                        let h = match got {
                            Ok(Some(h)) => h,
                            Ok(None) | Err(Error::Timeout { .. }) => {
                                // Nothing now (a writer reserved it, or dropped an update):
                                // the guards kept go, or the writer would wait for them.
                                guards.clear();
                                continue;
                            }
                            Err(e) => panic!("take: {e}"),
                        };
                        assert!(h.generation() >= newest, "went back a generation");
                        newest = h.generation();
                        check_gen(&h);
                        // Some threads keep two guards of a generation at once (one bit); never
                        // while waiting for a newer one, which in place would wait for itself.
                        if k % 6 == 0 && guards.len() < 2 {
                            guards.push(h);
                        } else {
                            std::thread::sleep(Duration::from_micros(200 * (k as u64 % 4)));
                            check_gen(&h);
                            drop(h);
                            for g in guards.drain(..) {
                                check_gen(&g);
                            }
                        }
                        holds += 1;
                    }
                    drop(guards);
                    holds
                })
            })
            .collect();
        for round in 0..300 {
            match round % 3 {
                0 => {
                    write_gen(&mut w);
                }
                1 => {
                    // Begun and dropped unpublished.
                    drop(w.begin(Some(ANSWER)).expect("begin"));
                }
                _ => {
                    // A begin that may time out against holds (given back).
                    if let Ok(u) = w.begin(Some(Duration::from_micros(300))) {
                        drop(u);
                    }
                }
            }
        }
        write_gen(&mut w);
        std::thread::sleep(Duration::from_millis(50));
        drop(stopping);
        for t in threads {
            assert!(t.join().unwrap() > 0);
        }
    });
    let snap = tensorset::inspect::inspect(&name).unwrap();
    assert_eq!(snap.holds, 0, "{snap:?}");
    assert_eq!(set_buffer(&name), (BufferState::Frame(w.generation()), 0));
    let h = readers[0].current().unwrap().expect("the last generation");
    assert_eq!(h.generation(), w.generation());
    check_gen(&h);
    drop(h);
    drop(readers);
    w.close(ANSWER).unwrap();
}

#[test]
fn no_reader_takes_the_generation_while_begin_waits_in_slices() {
    if role().is_some() {
        return;
    }
    let name = unique("slices");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &in_place()).unwrap();
    write_gen(&mut w);
    let holder = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let asker = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let h = holder.current().unwrap().expect("generation 1");
    let done = AtomicBool::new(false);
    let taken = AtomicU64::new(0);
    std::thread::scope(|s| {
        // Another thread asks for the generation as fast as it can while `begin` waits in
        // slices: never given it (before, every slice that timed out gave it back).
        let asking = s.spawn(|| {
            until("the first slice's reservation", || {
                set_buffer(&name).0 == BufferState::Writing
            });
            while !done.load(Ordering::SeqCst) {
                if let Some(g) = asker.current().unwrap() {
                    check_gen(&g);
                    taken.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        let releasing = s.spawn(|| {
            std::thread::sleep(Duration::from_millis(400));
            let t = Instant::now();
            drop(h);
            t
        });
        let t = Instant::now();
        let mut slices = 0;
        let got = loop {
            slices += 1;
            match w.begin_slice(Some(Duration::from_millis(50))) {
                Ok(u) => break u,
                Err(Error::Timeout { .. }) if t.elapsed() < ANSWER => {}
                Err(e) => panic!("begin_slice: {e}"),
            }
        };
        done.store(true, Ordering::SeqCst);
        asking.join().unwrap();
        let released = releasing.join().unwrap();
        assert!(slices > 4, "{slices} slices");
        assert_eq!(
            taken.load(Ordering::SeqCst),
            0,
            "the generation was taken while begin waited in slices"
        );
        assert!(
            released.elapsed() < Duration::from_millis(500),
            "{:?}",
            released.elapsed()
        );
        let g = got.generation();
        drop(got);
        assert_eq!(g, 2);
    });
    // Dropped unpublished: generation 1 is gone until the next commit.
    assert_eq!(write_gen(&mut w), 2);
    // A slice that timed out, given back: the generation is takeable again.
    let h = holder.current().unwrap().expect("generation 2");
    assert!(matches!(
        w.begin_slice(Some(Duration::from_millis(50))),
        Err(Error::Timeout { .. })
    ));
    assert_eq!(set_buffer(&name).0, BufferState::Writing, "left reserved");
    assert!(asker.current().unwrap().is_none());
    w.give_back_reservation();
    assert_eq!(set_buffer(&name).0, BufferState::Frame(2));
    let g = asker.current().unwrap().expect("given back");
    assert_eq!(g.generation(), 2);
    check_gen(&g);
    // `begin` after a slice that timed out goes on with the reservation, and gives it back when
    // it times out in turn.
    assert!(w.begin_slice(Some(Duration::from_millis(20))).is_err());
    assert!(matches!(
        w.begin(Some(Duration::from_millis(50))),
        Err(Error::Timeout { .. })
    ));
    assert_eq!(set_buffer(&name).0, BufferState::Frame(2));
    drop((h, g));
    assert_eq!(write_gen(&mut w), 3);
    drop((holder, asker));
    w.close(ANSWER).unwrap();
}

#[test]
fn acquire_slice_keeps_a_one_buffer_pool_reserved_until_given_back() {
    if role().is_some() {
        return;
    }
    let ch = unique("acq-slice");
    let mut tx = Producer::create_host(&ch, &ChannelOptions::new(BYTES).buffers(1)).unwrap();
    let opts = ConsumerOptions::new().delivery(Delivery::LatestOnly);
    let a = Consumer::attach(&ch, &opts).unwrap();
    let b = Consumer::attach(&ch, &opts).unwrap();
    write_frame(&mut tx);
    let f = a.recv_timeout(ANSWER).unwrap();
    for _ in 0..3 {
        assert!(matches!(
            tx.acquire_slice(Some(Duration::from_millis(20))),
            Err(Error::Timeout { .. })
        ));
        assert_eq!(
            inspect::inspect(&ch).unwrap().buffers[0].state,
            BufferState::Writing
        );
        assert!(b.try_recv().unwrap().is_none(), "taken while reserved");
    }
    tx.give_back_reservation();
    let g = b.try_recv().unwrap().expect("given back");
    assert_eq!(g.seq(), 1);
    check_frame(&g);
    // try_acquire after a slice: gives it back when it finds none.
    assert!(tx.acquire_slice(Some(Duration::from_millis(20))).is_err());
    drop(g);
    assert!(tx.try_acquire().unwrap().is_none());
    assert_eq!(
        inspect::inspect(&ch).unwrap().buffers[0].state,
        BufferState::Frame(1)
    );
    assert!(tx.acquire_slice(Some(Duration::from_millis(20))).is_err());
    drop(f);
    // The next slice completes the claim.
    let mut w = tx.acquire_slice(Some(ANSWER)).unwrap();
    let bytes: Vec<u8> = (0..w.len()).map(|k| pattern(2, 0, k)).collect();
    w.write_at(0, &bytes).unwrap();
    assert_eq!(w.publish(&2u64.to_le_bytes()).unwrap(), 2);
    let g = b.recv_timeout(ANSWER).unwrap();
    assert_eq!(g.seq(), 2);
    check_frame(&g);
    drop(g);
    drop((a, b));
    tx.close(ANSWER).unwrap();
}

#[test]
fn a_segment_of_layout_version_6_is_refused_with_both_versions_named() {
    if role().is_some() {
        return;
    }
    // A consumer of version 6 would clear a hold bit its other hold still needs when backing off
    // from a reservation: segments of the two versions never meet.
    let ch = unique("v7");
    let old = unique("v6");
    let tx = Producer::create_host(&ch, &ChannelOptions::new(BYTES).buffers(1)).unwrap();
    let mut bytes = std::fs::read(format!("/dev/shm/{}", inspect::segment_name(&ch))).unwrap();
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 7);
    bytes[8..12].copy_from_slice(&6u32.to_le_bytes());
    let _g = common::Unlink(inspect::segment_name(&old));
    common::plant(format!("/dev/shm/{}", inspect::segment_name(&old)), &bytes);
    let expect = |e: Error| match e {
        Error::Channel(ChannelError::VersionMismatch {
            channel,
            found,
            supported,
        }) => {
            assert_eq!((channel.as_str(), found, supported), (old.as_str(), 6, 7));
            let text = Error::Channel(ChannelError::VersionMismatch {
                channel,
                found,
                supported,
            })
            .to_string();
            assert!(text.contains('6') && text.contains('7'), "{text}");
        }
        other => panic!("expected VersionMismatch, got {other:?}"),
    };
    expect(Consumer::attach(&old, &ConsumerOptions::new()).unwrap_err());
    expect(inspect::inspect(&old).unwrap_err());
    // Not replaced by a producer of this version while its recorded producer (this process) runs.
    assert!(Producer::create_host(&old, &ChannelOptions::new(BYTES).buffers(1)).is_err());
    drop(tx);
}

#[test]
fn a_reader_holding_the_generation_gets_none_for_it_again_while_begin_reserves() {
    if role().is_some() {
        return;
    }
    // Its own guard keeps the reservation waiting, and a second take of the same generation by
    // the same reader is turned away as any other: it waits for the commit, which waits for the
    // guard. Asking again while holding, in place, blocks until `begin` gives up or the guard goes.
    let name = unique("again");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &in_place()).unwrap();
    write_gen(&mut w);
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let h = r.current().unwrap().expect("generation 1");
    let again = r.current().unwrap().expect("taken again before any begin");
    assert_eq!(again.generation(), 1);
    drop(again);
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let u = w.begin(Some(ANSWER)).expect("begin once the guard goes");
            u.commit().unwrap()
        });
        until("the buffer reserved", || {
            set_buffer(&name).0 == BufferState::Writing
        });
        assert!(r.current().unwrap().is_none());
        match r.wait_newer(0, Some(Duration::from_millis(200))) {
            Err(Error::Timeout { .. }) => {}
            other => panic!("a take again while reserved: {other:?}"),
        }
        check_gen(&h);
        drop(h);
        assert_eq!(writer.join().unwrap(), 2);
    });
    assert_eq!(set_buffer(&name), (BufferState::Frame(2), 0));
    drop(r);
    w.close(ANSWER).unwrap();
}
