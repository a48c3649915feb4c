//! Host-memory channels (`MemoryKind::Host`) with the real `Producer` and `Consumer`, in separate
//! processes, on machines without a GPU: every frame's bytes checked (a pattern derived from its
//! sequence number), both delivery policies, a killed producer and a killed consumer, close with
//! frames in flight, a consumer in another pid namespace, and hostile files under the pool's name.
//! Nothing here loads the CUDA driver (checked).

mod common;

use common::{Peer, parent_lines, role, tell};
use cuda_ipc::Error;
use cuda_ipc::channel::{
    ChannelError, ChannelOptions, Consumer, ConsumerOptions, Delivery, MemoryKind, Producer,
    inspect, reclaim,
};
use cuda_ipc::raw::channel::layout;
use cuda_ipc::raw::shm::ShmError;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::process::Command;
use std::time::{Duration, Instant};

const ANSWER: Duration = Duration::from_secs(20);
const CHANNEL: &str = "CUDA_IPC_TEST_CHANNEL";
const BYTES: usize = 10_000;

fn channel_name(tag: &str) -> String {
    format!("host-{tag}-{}", std::process::id())
}

fn pool_path(ch: &str) -> String {
    format!("/dev/shm/{}", inspect::pool_segment_name(ch))
}

fn control_path(ch: &str) -> String {
    format!("/dev/shm/{}", inspect::segment_name(ch))
}

/// Byte `k` of frame `seq`.
fn pattern(seq: u64, k: usize) -> u8 {
    (seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ (k as u8).wrapping_mul(31)
}

fn write_frame(tx: &mut Producer) -> u64 {
    // Only this producer publishes: the next sequence number is head + 1.
    let seq = tx.stats().head + 1;
    let mut w = tx.acquire(Some(ANSWER)).expect("acquire");
    let bytes: Vec<u8> = (0..w.len()).map(|k| pattern(seq, k)).collect();
    w.write_at(0, &bytes).unwrap();
    assert_eq!(w.publish(&seq.to_le_bytes()).unwrap(), seq);
    seq
}

fn check_frame(f: &cuda_ipc::channel::Frame<'_>) {
    assert!(f.is_host());
    assert_eq!(f.metadata(), f.seq().to_le_bytes());
    let bytes = f.to_vec().unwrap();
    assert_eq!(bytes.len(), BYTES);
    for (k, b) in bytes.iter().enumerate() {
        assert_eq!(*b, pattern(f.seq(), k), "frame {} byte {k}", f.seq());
    }
}

fn kill9(pid: u32) {
    let st = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

fn opts() -> ChannelOptions {
    ChannelOptions::new(BYTES).buffers(3)
}

/// The child side of every test: the role names what to do.
#[test]
fn child() {
    let Some(r) = role() else { return };
    let ch = std::env::var(CHANNEL).unwrap();
    match r.as_str() {
        "every" | "latest" => {
            let d = if r == "every" {
                Delivery::EveryFrame
            } else {
                Delivery::LatestOnly
            };
            let rx = Consumer::attach(&ch, &ConsumerOptions::new().delivery(d)).unwrap();
            assert!(rx.is_host());
            tell("attached");
            let (mut n, mut last) = (0u64, 0u64);
            loop {
                match rx.recv_timeout(ANSWER) {
                    Ok(f) => {
                        check_frame(&f);
                        assert!(f.seq() > last, "{} after {last}", f.seq());
                        if d == Delivery::EveryFrame {
                            assert_eq!(f.seq(), last + 1);
                        }
                        last = f.seq();
                        n += 1;
                    }
                    Err(Error::Channel(ChannelError::Closed)) => break,
                    Err(e) => panic!("recv: {e}"),
                }
            }
            tell(format!("ok {n} {last}"));
        }
        "hold" => {
            let rx = Consumer::attach(&ch, &ConsumerOptions::new()).unwrap();
            tell("attached");
            let f = rx.recv_timeout(ANSWER).unwrap();
            check_frame(&f);
            tell(format!("holding {}", f.seq()));
            let mut lines = parent_lines();
            // "go": read the frame again after the producer closed, drop it, expect closed.
            if lines.next().as_deref() == Some("go") {
                check_frame(&f);
                drop(f);
                match rx.recv_timeout(ANSWER) {
                    Err(Error::Channel(ChannelError::Closed)) => tell("closed"),
                    other => panic!("expected ChannelClosed, got {other:?}"),
                }
            } else {
                std::thread::sleep(Duration::from_secs(600));
            }
        }
        "release" => {
            // Holds its first frame until told to let go, then waits for the close.
            let rx = Consumer::attach(&ch, &ConsumerOptions::new()).unwrap();
            tell("attached");
            let f = rx.recv_timeout(ANSWER).unwrap();
            check_frame(&f);
            tell(format!("holding {}", f.seq()));
            assert_eq!(parent_lines().next().as_deref(), Some("release"));
            drop(f);
            tell("released");
            match rx.recv_timeout(ANSWER) {
                Err(Error::Channel(ChannelError::Closed)) => tell("closed"),
                other => panic!("expected ChannelClosed, got {other:?}"),
            }
        }
        "producer" => {
            let mut tx = Producer::create_host(&ch, &opts()).unwrap();
            tell("created");
            for line in parent_lines() {
                if line == "publish" {
                    tell(format!("published {}", write_frame(&mut tx)));
                }
            }
            std::thread::sleep(Duration::from_secs(600));
        }
        other => panic!("unknown role {other}"),
    }
}

fn spawn(role: &str, ch: &str, wrapper: &[&str]) -> Peer {
    Peer::spawn_under(wrapper, "child", role, &[(CHANNEL, ch)])
}

fn every_frame_in_another_process(wrapper: &[&str], tag: &str) {
    let ch = channel_name(tag);
    let mut tx = Producer::create_host(&ch, &opts()).unwrap();
    assert_eq!(tx.memory_kind(), MemoryKind::Host);
    let mut peer = spawn("every", &ch, wrapper);
    peer.expect("attached", ANSWER);
    for _ in 0..300 {
        write_frame(&mut tx);
    }
    let report = tx.close(ANSWER).unwrap();
    assert_eq!(report.forced_holds, 0);
    assert_eq!(peer.expect("ok", ANSWER), "300 300");
    peer.finish(ANSWER);
    assert!(std::fs::symlink_metadata(pool_path(&ch)).is_err());
    assert!(std::fs::symlink_metadata(control_path(&ch)).is_err());
}

#[test]
fn an_every_frame_consumer_in_another_process_gets_every_frame_with_its_bytes() {
    if role().is_some() {
        return;
    }
    every_frame_in_another_process(&[], "every");
}

#[test]
fn a_consumer_in_another_pid_namespace_gets_every_frame() {
    if role().is_some() {
        return;
    }
    if let Err(why) = common::unshare_works(&["--pid", "--fork", "--mount-proc"]) {
        println!("skipped: {why}");
        return;
    }
    every_frame_in_another_process(
        &["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"],
        "pidns",
    );
}

#[test]
fn a_latest_only_consumer_gets_increasing_frames_and_never_holds_the_producer_back() {
    if role().is_some() {
        return;
    }
    let ch = channel_name("latest");
    let mut tx = Producer::create_host(&ch, &opts()).unwrap();
    let mut peer = spawn("latest", &ch, &[]);
    peer.expect("attached", ANSWER);
    for _ in 0..500 {
        write_frame(&mut tx);
    }
    // Give the consumer time to see the last frame before it is withdrawn by close.
    std::thread::sleep(Duration::from_millis(200));
    tx.close(ANSWER).unwrap();
    let got = peer.expect("ok", ANSWER);
    let mut it = got.split(' ').map(|v| v.parse::<u64>().unwrap());
    let (n, last) = (it.next().unwrap(), it.next().unwrap());
    assert!((1..=500).contains(&n) && last == 500, "{got}");
    peer.finish(ANSWER);
}

#[test]
fn a_killed_producer_gives_producer_gone_within_1_s_and_gc_removes_both_segments() {
    if role().is_some() {
        return;
    }
    let ch = channel_name("killed-producer");
    let mut peer = Peer::spawn("child", "producer", &[(CHANNEL, &ch)]);
    peer.expect("created", ANSWER);
    let rx = Consumer::attach(&ch, &ConsumerOptions::new().delivery(Delivery::LatestOnly)).unwrap();
    peer.send("publish");
    assert_eq!(peer.expect("published", ANSWER), "1");
    {
        let f = rx.recv_timeout(ANSWER).unwrap();
        assert_eq!(f.seq(), 1);
        check_frame(&f);
    }
    assert!(reclaim::remove_stale(&ch).unwrap().is_none(), "alive");
    kill9(peer.child.id());
    let _ = peer.child.wait();
    let t = Instant::now();
    match rx.recv_timeout(ANSWER) {
        Err(Error::Channel(ChannelError::ProducerGone { .. })) => {}
        other => panic!("expected ProducerGone, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    drop(rx);
    assert!(reclaim::remove_stale(&ch).unwrap().is_some());
    assert!(std::fs::symlink_metadata(control_path(&ch)).is_err());
    assert!(std::fs::symlink_metadata(pool_path(&ch)).is_err());
}

#[test]
fn a_dead_producers_pool_alone_is_listed_and_removed_and_a_restart_replaces_it() {
    if role().is_some() {
        return;
    }
    let ch = channel_name("orphan-pool");
    let mut peer = Peer::spawn("child", "producer", &[(CHANNEL, &ch)]);
    peer.expect("created", ANSWER);
    assert!(
        !inspect::stale_host_pools()
            .unwrap()
            .iter()
            .any(|(c, _)| *c == ch)
    );
    kill9(peer.child.id());
    let _ = peer.child.wait();
    // A restart replaces both segments of the dead producer.
    let tx = Producer::create_host(&ch, &opts()).unwrap();
    drop(tx);
    assert!(std::fs::symlink_metadata(pool_path(&ch)).is_err());
    // Killed again, and only the control segment removed: the pool is listed and removed alone.
    let mut peer = Peer::spawn("child", "producer", &[(CHANNEL, &ch)]);
    peer.expect("created", ANSWER);
    kill9(peer.child.id());
    let _ = peer.child.wait();
    cuda_ipc::raw::shm::Segment::unlink(&inspect::segment_name(&ch)).unwrap();
    let stale = inspect::stale_host_pools().unwrap();
    assert!(
        stale
            .iter()
            .any(|(c, why)| *c == ch && why.contains("dead")),
        "{stale:?}"
    );
    assert!(reclaim::remove_stale_host_pool(&ch).unwrap().is_some());
    assert!(std::fs::symlink_metadata(pool_path(&ch)).is_err());
}

#[test]
fn a_killed_consumers_hold_is_reclaimed() {
    if role().is_some() {
        return;
    }
    let ch = channel_name("killed-consumer");
    let mut tx = Producer::create_host(&ch, &ChannelOptions::new(BYTES).buffers(1)).unwrap();
    let mut peer = spawn("hold", &ch, &[]);
    peer.expect("attached", ANSWER);
    write_frame(&mut tx);
    assert_eq!(peer.expect("holding", ANSWER), "1");
    assert!(
        tx.try_acquire().unwrap().is_none(),
        "the only buffer is held"
    );
    kill9(peer.child.id());
    let _ = peer.child.wait();
    let t = Instant::now();
    write_frame(&mut tx);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(tx.stats().forced_releases >= 1);
    assert!(tx.stats().consumers.is_empty());
    tx.close(ANSWER).unwrap();
}

#[test]
fn close_with_a_frame_in_flight_forces_the_hold_and_the_consumer_sees_closed() {
    if role().is_some() {
        return;
    }
    let ch = channel_name("close");
    let mut tx = Producer::create_host(&ch, &opts()).unwrap();
    let mut peer = spawn("hold", &ch, &[]);
    peer.expect("attached", ANSWER);
    write_frame(&mut tx);
    write_frame(&mut tx);
    assert_eq!(peer.expect("holding", ANSWER), "1");
    let report = tx.close(Duration::from_millis(300)).unwrap();
    assert_eq!(report.forced_holds, 1);
    assert!(std::fs::symlink_metadata(pool_path(&ch)).is_err());
    // The consumer's mapping stays valid after the names are gone.
    peer.send("go");
    peer.expect("closed", ANSWER);
    peer.finish(ANSWER);
}

#[test]
fn close_at_exit_waits_for_another_processs_hold_and_forces_its_own_at_once() {
    if role().is_some() {
        return;
    }
    close_at_exit_beside_a_peer(&[], "atexit");
}

#[test]
fn close_at_exit_waits_for_the_hold_of_a_peer_in_another_pid_namespace() {
    // The peer is pid 1 of its namespace: told from this process by the slot's whole identity
    // (pid namespace, start time, boot id), not the pid alone.
    if role().is_some() {
        return;
    }
    if let Err(why) = common::unshare_works(&["--pid", "--fork", "--mount-proc"]) {
        println!("skipped: {why}");
        return;
    }
    close_at_exit_beside_a_peer(
        &["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"],
        "atexit-pidns",
    );
}

/// A process that is exiting (a binding's interpreter finalizing) releases nothing more:
/// `close_at_exit` does not wait for the hold of a consumer of its own, which `close` would wait
/// for to its timeout, but still waits for another process's consumer (run under `wrapper`).
fn close_at_exit_beside_a_peer(wrapper: &[&str], tag: &str) {
    let ch = channel_name(tag);
    let mut tx = Producer::create_host(&ch, &opts()).unwrap();
    let own = Consumer::attach(&ch, &ConsumerOptions::new()).unwrap();
    let mut peer = spawn("release", &ch, wrapper);
    peer.expect("attached", ANSWER);
    let seq = write_frame(&mut tx);
    let held = own.recv_timeout(ANSWER).unwrap();
    assert_eq!(peer.expect("holding", ANSWER), seq.to_string());
    let started = Instant::now();
    let report = std::thread::scope(|s| {
        let closing = s.spawn(move || tx.close_at_exit(ANSWER));
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !closing.is_finished(),
            "the close did not wait for the other process's hold"
        );
        peer.send("release");
        peer.expect("released", ANSWER);
        closing.join().unwrap().unwrap()
    });
    let took = started.elapsed();
    assert!(
        took < ANSWER / 2,
        "the close waited {took:?}: for its own consumer's hold"
    );
    assert_eq!(
        report.forced_holds, 1,
        "the own consumer's hold is forced, the peer's was let go"
    );
    assert_eq!(report.consumers_behind, 0);
    peer.expect("closed", ANSWER);
    peer.finish(ANSWER);
    drop(held);
    drop(own);
    assert!(std::fs::symlink_metadata(pool_path(&ch)).is_err());
    assert!(std::fs::symlink_metadata(control_path(&ch)).is_err());
}

#[test]
fn receives_from_several_threads_of_one_consumer_take_each_frame_once() {
    // One consumer shared by 4 threads (`recv_timeout` and `try_recv` through `&Consumer`):
    // every frame reaches exactly one of them, with its bytes, whatever the interleaving. Each
    // take moves the consumer's cursor and sets its one hold bit of the buffer: two takes of one
    // consumer at once took the same frame twice, and the first release freed the buffer under
    // the other's reads.
    if role().is_some() {
        return;
    }
    const FRAMES: u64 = 3_000;
    let ch = channel_name("threads");
    let mut tx = Producer::create_host(&ch, &ChannelOptions::new(BYTES).buffers(4)).unwrap();
    let rx = Consumer::attach(&ch, &ConsumerOptions::new()).unwrap();
    let taken = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..4 {
            let (rx, taken) = (&rx, &taken);
            s.spawn(move || {
                loop {
                    let got = if t == 0 {
                        rx.try_recv()
                    } else {
                        rx.recv_timeout(Duration::from_millis(200)).map(Some)
                    };
                    match got {
                        Ok(Some(f)) => {
                            check_frame(&f);
                            taken.lock().unwrap().push(f.seq());
                        }
                        Ok(None) | Err(Error::Timeout { .. }) => std::thread::yield_now(),
                        Err(Error::Channel(ChannelError::Closed)) => return,
                        Err(e) => panic!("receive: {e}"),
                    }
                }
            });
        }
        for _ in 0..FRAMES {
            write_frame(&mut tx);
        }
        tx.close(ANSWER).unwrap();
    });
    let mut taken = taken.into_inner().unwrap();
    let all = taken.len();
    taken.sort_unstable();
    taken.dedup();
    assert_eq!(all, taken.len(), "a frame was received twice");
    assert_eq!(taken, (1..=FRAMES).collect::<Vec<_>>());
}

#[test]
fn a_host_channel_never_loads_the_cuda_driver_checks_ranges_and_refuses_gpu_accessors() {
    if role().is_some() {
        return;
    }
    let ch = channel_name("no-driver");
    no_driver_body(&ch, Producer::create_host(&ch, &opts()).unwrap());
}

fn no_driver_body(ch: &str, mut tx: Producer) {
    let rx = Consumer::attach(ch, &ConsumerOptions::new()).unwrap();
    {
        let mut w = tx.acquire(None).unwrap();
        assert!(matches!(
            w.write_at(BYTES - 1, b"ab"),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            w.write_at(usize::MAX, b"a"),
            Err(Error::InvalidArgument(_))
        ));
        w.write_at(BYTES - 2, b"ab").unwrap();
        // The GPU accessors of a host frame are errors, never panics, and load no driver.
        assert!(w.is_host() && w.view().is_host());
        assert!(matches!(w.buffer(), Err(Error::InvalidArgument(_))));
        assert!(matches!(w.stream(), Err(Error::InvalidArgument(_))));
        assert!(matches!(w.view().device(), Err(Error::InvalidArgument(_))));
        // SAFETY: the pointer is valid for len() bytes while the frame lives; nobody else writes.
        unsafe { w.as_mut_ptr().unwrap().write(7) };
        w.publish(b"").unwrap();
    }
    let f = rx.recv_timeout(ANSWER).unwrap();
    let mut two = [0u8; 2];
    f.read_at(BYTES - 2, &mut two).unwrap();
    assert_eq!(&two, b"ab");
    // SAFETY: valid for len() bytes while the frame lives; the producer does not write it now.
    assert_eq!(unsafe { f.as_ptr().unwrap().read() }, 7);
    assert_eq!(
        f.view().host_ptr().unwrap().cast_const(),
        f.as_ptr().unwrap()
    );
    assert!(matches!(f.buffer(), Err(Error::InvalidArgument(_))));
    assert!(matches!(f.stream(), Err(Error::InvalidArgument(_))));
    // So are the ends' own: a host channel has no stream and no context.
    assert!(matches!(tx.stream(), Err(Error::InvalidArgument(_))));
    assert!(matches!(tx.context(), Err(Error::InvalidArgument(_))));
    assert!(matches!(rx.stream(), Err(Error::InvalidArgument(_))));
    assert!(matches!(rx.context(), Err(Error::InvalidArgument(_))));
    assert!(f.read_at(BYTES, &mut two).is_err());
    assert_eq!(f.len(), BYTES);
    drop(f);
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    assert!(!maps.contains("libcuda"), "the driver was loaded");
    drop(rx);
    tx.close(ANSWER).unwrap();
}

fn root() -> bool {
    rustix::process::geteuid().is_root()
}

fn mkfifo(p: &str) {
    let c = std::ffi::CString::new(p).unwrap();
    // SAFETY: a valid C string; mkfifo only reads it.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {p}");
}

/// Removes both names when dropped, whatever is there.
struct Planted(String);
impl Drop for Planted {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(pool_path(&self.0));
        let _ = std::fs::remove_file(control_path(&self.0));
    }
}

#[test]
fn hostile_files_under_the_pools_name_are_typed_errors_and_left_alone() {
    if role().is_some() {
        return;
    }
    // A FIFO in the way of a creation: refused, left there, no control segment made.
    let ch = channel_name("fifo");
    let _g = Planted(ch.clone());
    mkfifo(&pool_path(&ch));
    let e = Producer::create_host(&ch, &opts()).unwrap_err();
    assert!(
        matches!(e, Error::Shm(ShmError::NotASegment { kind: "FIFO", .. })),
        "{e:?}"
    );
    assert!(
        std::fs::symlink_metadata(pool_path(&ch))
            .unwrap()
            .file_type()
            .is_fifo()
    );
    assert!(std::fs::symlink_metadata(control_path(&ch)).is_err());

    // A live producer: a second creation is AlreadyExists and changes nothing.
    let ch = channel_name("live");
    let _g2 = Planted(ch.clone());
    let tx = Producer::create_host(&ch, &opts()).unwrap();
    let ino = std::fs::metadata(pool_path(&ch)).unwrap().ino();
    let e = Producer::create_host(&ch, &opts()).unwrap_err();
    assert!(
        matches!(e, Error::Channel(ChannelError::AlreadyExists { .. })),
        "{e:?}"
    );
    assert_eq!(std::fs::metadata(pool_path(&ch)).unwrap().ino(), ino);

    // Under the live channel's pool name, for a consumer: a FIFO, a sparse file, nothing.
    let attach = || Consumer::attach(&ch, &ConsumerOptions::new()).unwrap_err();
    std::fs::remove_file(pool_path(&ch)).unwrap();
    mkfifo(&pool_path(&ch));
    let e = attach();
    assert!(
        matches!(e, Error::Shm(ShmError::NotASegment { .. })),
        "{e:?}"
    );
    std::fs::remove_file(pool_path(&ch)).unwrap();
    let f = common::plant(pool_path(&ch), &[]);
    f.set_len(4096 + 3 * 12288).unwrap();
    let e = attach();
    assert!(matches!(e, Error::Shm(ShmError::Sparse { .. })), "{e:?}");
    std::fs::remove_file(pool_path(&ch)).unwrap();
    let e = attach();
    assert!(
        matches!(e, Error::Channel(ChannelError::BadSegment(_))),
        "{e:?}"
    );
    drop(f);
    drop(tx);

    if !root() {
        println!("skipped the other-user cases: needs root to give a file to another uid");
        return;
    }
    // Another user's file in the way of a creation, and under a live channel's pool.
    let ch = channel_name("other");
    let _g3 = Planted(ch.clone());
    let other = 54321u32;
    common::plant(pool_path(&ch), &[0u8; 8192]);
    rustix::fs::chown(
        pool_path(&ch).as_str(),
        Some(rustix::process::Uid::from_raw(other)),
        None,
    )
    .unwrap();
    let e = Producer::create_host(&ch, &opts()).unwrap_err();
    assert!(
        matches!(e, Error::Shm(ShmError::WrongOwner { owner, .. }) if owner == other),
        "{e:?}"
    );
    assert_eq!(std::fs::metadata(pool_path(&ch)).unwrap().uid(), other);
    assert!(reclaim::remove_stale_host_pool(&ch).is_err());
    assert_eq!(std::fs::metadata(pool_path(&ch)).unwrap().uid(), other);
    std::fs::remove_file(pool_path(&ch)).unwrap();
    let tx = Producer::create_host(&ch, &opts()).unwrap();
    rustix::fs::chown(
        pool_path(&ch).as_str(),
        Some(rustix::process::Uid::from_raw(other)),
        None,
    )
    .unwrap();
    let e = Consumer::attach(&ch, &ConsumerOptions::new()).unwrap_err();
    assert!(
        matches!(e, Error::Shm(ShmError::WrongOwner { owner, .. }) if owner == other),
        "{e:?}"
    );
    drop(tx);
}

/// A consumer that looks while its producer is still sizing the control segment (between
/// `shm_open` and the end of `fallocate`: the file is sparse meanwhile) waits for the creation
/// instead of failing with `Sparse`, however long the sizing takes. Planted: a sparse file under the
/// control segment's name with its sizing lock held, as a creator holds it
/// (`raw::shm::SIZING_LOCK_OFFSET`), replaced 200 ms later by the real channel: four times the
/// 50 ms an opener gives a young file without the lock.
#[test]
fn an_attach_during_the_control_segment_s_creation_waits_instead_of_failing_as_sparse() {
    if role().is_some() {
        return;
    }
    let ch = channel_name("mid-creation");
    let path = control_path(&ch);
    let planted = {
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .unwrap();
        f.set_len(16384).unwrap(); // sized, no page reserved: what a creator has before fallocate
        common::hold_sizing_lock(&f);
        f
    };
    let maker = {
        let (ch, path) = (ch.clone(), path.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            std::fs::remove_file(&path).unwrap();
            drop(planted);
            let mut tx = Producer::create_host(&ch, &opts()).unwrap();
            write_frame(&mut tx);
            std::thread::sleep(Duration::from_millis(500));
            drop(tx);
        })
    };
    let started = Instant::now();
    let rx = loop {
        match Consumer::attach(&ch, &ConsumerOptions::new()) {
            Ok(rx) => break rx,
            // The planted file went away before the channel came: not there yet.
            Err(Error::Channel(ChannelError::NotFound(_))) => {
                std::thread::sleep(Duration::from_millis(1))
            }
            Err(e) => panic!("attach during the creation failed: {e}"),
        }
        assert!(started.elapsed() < ANSWER, "no channel within {ANSWER:?}");
    };
    drop(rx);
    maker.join().unwrap();
}

#[test]
fn close_waits_for_every_frame_consumers_to_receive_and_counts_those_behind() {
    let ch = channel_name("behind");
    let mut tx = Producer::create_host(&ch, &opts()).unwrap();
    let every = Consumer::attach(&ch, &ConsumerOptions::new()).unwrap();
    let latest =
        Consumer::attach(&ch, &ConsumerOptions::new().delivery(Delivery::LatestOnly)).unwrap();
    write_frame(&mut tx);
    // Not received by either: the every-frame consumer keeps the wait going, the latest-only one
    // does not; the wait can be asked again and again.
    let start = Instant::now();
    assert!(!tx.wait_closing(Duration::from_millis(100)));
    assert!(!tx.wait_closing(Duration::ZERO));
    assert!(start.elapsed() >= Duration::from_millis(100));
    let r = tx.close(Duration::from_millis(50)).unwrap();
    assert_eq!((r.forced_holds, r.consumers_behind), (0, 1));
    drop((every, latest));

    let ch = channel_name("received");
    let mut tx = Producer::create_host(&ch, &opts()).unwrap();
    let every = Consumer::attach(&ch, &ConsumerOptions::new()).unwrap();
    write_frame(&mut tx);
    let f = every.recv_timeout(ANSWER).unwrap();
    // Received but held: still waiting, now for the hold.
    assert!(!tx.wait_closing(Duration::from_millis(20)));
    drop(f);
    assert!(tx.wait_closing(ANSWER));
    let r = tx.close(ANSWER).unwrap();
    assert_eq!((r.forced_holds, r.consumers_behind), (0, 0));
}

#[test]
fn close_against_consumers_that_take_without_pause_ends_once_each_took_what_was_published() {
    // Four consumers (two every-frame, two latest-only), each in a thread that receives without
    // pause and holds every frame 20 ms: some hold is nearly always there. A channel's close lets
    // consumers receive what was published before `Closed`, and a frame is taken once per
    // consumer (its cursor moves past it), so the holds granted during the close are bounded by
    // the frames not yet received, never renewed: the close returns once those end, far below
    // its timeout, forcing nothing. (A tensor set's generation channel, whose readers take the
    // newest frame again and again, withdraws its frames at the close's start instead:
    // tests/tensorset_host.rs.)
    if role().is_some() {
        return;
    }
    let ch = channel_name("closetaking");
    let mut tx = Producer::create_host(&ch, &opts()).unwrap();
    let consumers: Vec<Consumer> = [
        Delivery::EveryFrame,
        Delivery::EveryFrame,
        Delivery::LatestOnly,
        Delivery::LatestOnly,
    ]
    .into_iter()
    .map(|d| Consumer::attach(&ch, &ConsumerOptions::new().delivery(d)).unwrap())
    .collect();
    let timeout = Duration::from_secs(6);
    let last = 12;
    let (took, report, seen) = std::thread::scope(|s| {
        let threads: Vec<_> = consumers
            .iter()
            .map(|rx| {
                s.spawn(move || {
                    let mut seqs = Vec::new();
                    let start = Instant::now();
                    while start.elapsed() < ANSWER {
                        match rx.recv_timeout(Duration::from_millis(200)) {
                            Ok(f) => {
                                check_frame(&f);
                                seqs.push(f.seq());
                                std::thread::sleep(Duration::from_millis(20));
                                check_frame(&f);
                            }
                            Err(Error::Timeout { .. }) => {}
                            Err(Error::Channel(ChannelError::Closed)) => return (seqs, true),
                            Err(e) => panic!("receive: {e}"),
                        }
                    }
                    (seqs, false)
                })
            })
            .collect();
        for _ in 0..last {
            write_frame(&mut tx);
            std::thread::sleep(Duration::from_millis(5));
        }
        let t = Instant::now();
        let report = tx.close(timeout).unwrap();
        let took = t.elapsed();
        let seen: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        (took, report, seen)
    });
    assert_eq!((report.forced_holds, report.consumers_behind), (0, 0));
    assert!(
        took < Duration::from_secs(2),
        "close took {took:?} (timeout {timeout:?}) against holds of 20 ms"
    );
    for (k, (seqs, closed)) in seen.iter().enumerate() {
        assert!(closed, "consumer {k} did not end with Closed");
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "consumer {k} took a frame twice: {seqs:?}"
        );
        if k < 2 {
            assert_eq!(*seqs, (1..=last).collect::<Vec<_>>(), "consumer {k}");
        } else {
            assert_eq!(seqs.last(), Some(&last), "consumer {k}: {seqs:?}");
        }
    }
}

#[test]
fn a_host_pool_too_large_for_a_segment_is_refused_before_any_system_call() {
    if role().is_some() {
        return;
    }
    // Buffer sizes that round up past `usize::MAX`, and pools past `isize::MAX` bytes, whether
    // the product wraps or not.
    for (buffers, bytes) in [
        (4, usize::MAX),
        (1, usize::MAX - 1),
        (1, isize::MAX as usize),
        (4, usize::MAX / 2),
        (16, 1 << 60),
        (2, 1 << 62),
    ] {
        let ch = channel_name(&format!("huge-{buffers}-{bytes}"));
        // A pool of 2^64 bytes or more is said to be so (by the options' check, first).
        let limit = if (buffers as u64).checked_mul(bytes as u64).is_none() {
            "is 2^64 bytes or more"
        } else {
            "the most a segment can hold"
        };
        match Producer::create_host(&ch, &ChannelOptions::new(bytes).buffers(buffers)) {
            Err(Error::InvalidArgument(why)) => assert!(
                why.contains(&format!("{buffers} buffers of {bytes} bytes")) && why.contains(limit),
                "{why}"
            ),
            other => panic!("{buffers} × {bytes}: {:?}", other.map(|_| ())),
        }
        assert!(std::fs::symlink_metadata(pool_path(&ch)).is_err(), "{ch}");
        assert!(
            std::fs::symlink_metadata(control_path(&ch)).is_err(),
            "{ch}"
        );
    }
}

/// A consumer attaching while the producer closes (its control segment opened, its pool
/// unlinked since) is told the channel closed, not that its pool is damaged.
#[test]
fn an_attach_that_finds_the_pool_of_a_closed_channel_gone_says_closed() {
    let name = format!("attach-closing-{}", std::process::id());
    let p = Producer::create_host(&name, &ChannelOptions::new(64)).unwrap();
    // As the close leaves it midway: the channel marked closed, its pool unlinked, its control
    // segment still there.
    let control = format!("/dev/shm/cuda-ipc.ch.{name}");
    let pool = format!("/dev/shm/cuda-ipc.hp.{name}");
    assert!(std::path::Path::new(&control).exists(), "{control}");
    let mut kept = std::fs::read(&control).unwrap();
    drop(p);
    let state = layout::header::PRODUCER_STATE;
    kept[state..state + 4].copy_from_slice(&layout::ProducerState::Closed.to_wire().to_ne_bytes());
    std::fs::write(&control, &kept).unwrap();
    std::fs::set_permissions(
        &control,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    assert!(!std::path::Path::new(&pool).exists());
    match Consumer::attach(&name, &ConsumerOptions::new()) {
        Err(Error::Channel(ChannelError::Closed)) => {}
        Err(e) => panic!("attach with the closed channel's pool gone: {e:?}"),
        Ok(_) => panic!("attached to a closed channel without its pool"),
    }
    std::fs::remove_file(&control).unwrap();
}
