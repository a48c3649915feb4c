//! The remote lane (feature `remote`) between processes of this machine over loopback TCP
//! (`UCX_TLS=tcp,self,cuda_copy`; the lane binds UCX to `lo`, the control connection's interface), with host-memory channels: the real `Producer`, the
//! two bridges over NIXL, and the ordinary `Consumer` on the far channel. Every frame's bytes are
//! checked; both delivery policies; kill -9 of the near producer, of either bridge and of a far
//! consumer, with the outcomes the lane promises (far consumers see `ProducerGone` within 1 s, the
//! near producer is never wedged, restarted bridges resume without restarting the producer).
//!
//! Needs NIXL's C API library (`libnixl_capi.so`) on the loader's path: `.ci/run` installs it
//! (`pip install --no-deps nixl-cu13`) and sets `LD_LIBRARY_PATH`. Without it these tests fail.
#![cfg(feature = "remote")]

mod common;

use common::{Peer, parent_lines, role, tell};
use cuda_ipc::Error;
use cuda_ipc::channel::{
    ChannelOptions, Consumer, ConsumerOptions, Delivery, Frame, Producer, inspect, reclaim,
};
use cuda_ipc::remote::report::UcxLog;
use cuda_ipc::remote::wire::{self, Msg, Secret, Session};
use cuda_ipc::remote::{nixl, recv, send};
use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

const ANSWER: Duration = Duration::from_secs(30);
const BYTES: usize = 16 * 1024;
const SECRET: &str = "lane test secret";

/// Byte `k` of near frame `seq`.
fn pattern(seq: u64, k: usize) -> u8 {
    (seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ (k as u8).wrapping_mul(31)
}

/// Checks a far frame: its metadata is the near sequence number, its bytes that frame's pattern.
/// Returns the near sequence number.
fn check(f: &Frame<'_>) -> u64 {
    let meta: [u8; 8] = f.metadata().try_into().expect("8 bytes of metadata");
    let seq = u64::from_le_bytes(meta);
    let bytes = f.to_vec().unwrap();
    assert_eq!(bytes.len(), BYTES);
    for (k, b) in bytes.iter().enumerate() {
        assert_eq!(*b, pattern(seq, k), "near frame {seq} byte {k}");
    }
    seq
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"))
}

fn secret() -> Secret {
    Secret::new(SECRET.as_bytes().to_vec()).unwrap()
}

/// Fast timeouts so that the tests see the promised bounds.
fn lane() -> cuda_ipc::remote::LaneOptions {
    cuda_ipc::remote::LaneOptions::default()
}

/// The child side of every test: the role names what to do.
#[test]
fn child() {
    let Some(r) = role() else { return };
    match r.as_str() {
        // The near producer: `FRAMES` frames after "go" then close, or (FRAMES=0) one frame per
        // millisecond until killed.
        "producer" => {
            let ch = env("NEAR");
            let frames: u64 = env("FRAMES").parse().unwrap();
            let mut tx = Producer::create_host(&ch, &ChannelOptions::new(BYTES).buffers(4))
                .expect("near channel");
            tell("ready");
            let mut lines = parent_lines();
            assert_eq!(lines.next().as_deref(), Some("go"));
            let mut seq = 0u64;
            while frames == 0 || seq < frames {
                seq += 1;
                let mut w = tx.acquire(Some(ANSWER)).expect("acquire");
                let bytes: Vec<u8> = (0..w.len()).map(|k| pattern(seq, k)).collect();
                w.write_at(0, &bytes).unwrap();
                assert_eq!(w.publish(&seq.to_le_bytes()).unwrap(), seq);
                if frames == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            if let Ok(ms) = std::env::var("LINGER_MS") {
                // Closing withdraws frames latest-only consumers (the bridge) have not taken.
                std::thread::sleep(Duration::from_millis(ms.parse().unwrap()));
            }
            let report = tx.close(ANSWER).unwrap();
            tell(format!("closed {report:?}"));
        }
        "recv" => {
            let port = std::env::var("PORT").unwrap_or_else(|_| "0".into());
            let listener = TcpListener::bind(format!("127.0.0.1:{port}")).unwrap();
            tell(format!("port {}", listener.local_addr().unwrap().port()));
            let mut opts = recv::RecvOptions::new(&env("FAR"), secret());
            opts.lane = lane();
            let mut frames = 0;
            match recv::serve(&opts, &listener, &AtomicBool::new(false), &mut frames) {
                Ok(recv::Ended::Closed(r)) => {
                    r.unwrap();
                    tell(format!("closed {frames}"));
                }
                Ok(recv::Ended::Lost { producer, reason }) => {
                    tell(format!("lost {reason}"));
                    // Ends without dropping the far producer: far consumers see it gone.
                    let _keep = producer;
                    std::process::exit(3);
                }
                Ok(other) => panic!("{other:?}"),
                Err(e) => panic!("recv bridge: {e}"),
            }
        }
        "send" => {
            let mut opts = send::SendOptions::new(
                &env("NEAR"),
                &env("ADDR"),
                Secret::new(env("SECRET").into_bytes()).unwrap(),
            );
            opts.lane = lane();
            if std::env::var("DELIVERY").as_deref() == Ok("latest") {
                opts.delivery = Delivery::LatestOnly;
            }
            loop {
                let mut totals = send::Totals::default();
                match send::serve(&opts, &AtomicBool::new(false), &mut totals) {
                    Ok(send::Ended::Closed) => {
                        let t = totals.transport.expect("UCX's transport report");
                        tell(format!(
                            "closed {} {} {}",
                            totals.frames,
                            t.summary(),
                            t.path.word()
                        ));
                        return;
                    }
                    Ok(send::Ended::ProducerGone) => {
                        tell("gone");
                        return;
                    }
                    Ok(other) => panic!("{other:?}"),
                    Err(e) => {
                        tell(format!("error {e}"));
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        }
        // A far consumer that receives one frame and holds it until killed.
        "hold" => {
            let rx = attach(&env("FAR"), Delivery::EveryFrame);
            let f = rx.recv_timeout(ANSWER).unwrap();
            check(&f);
            tell("holding");
            for _ in parent_lines() {}
            std::thread::sleep(ANSWER);
        }
        other => panic!("unknown role {other}"),
    }
}

fn attach(ch: &str, d: Delivery) -> Consumer {
    let start = Instant::now();
    loop {
        match Consumer::attach(ch, &ConsumerOptions::new().delivery(d)) {
            Ok(c) => return c,
            Err(e) if start.elapsed() > ANSWER => panic!("attach {ch}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn ucx_env() -> Vec<(String, String)> {
    // What `cuda-ipc bridge` gives itself: UCX bound to the loopback interface of the control
    // connection's address, its protocol choices logged for the transport report (in a private
    // folder made for it, removed by `Reap`).
    let log = UcxLog::create().unwrap();
    let mut v: Vec<(String, String)> =
        cuda_ipc::remote::environment("127.0.0.1".parse().unwrap(), Some(&log))
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string_lossy().into_owned()))
            .collect();
    LOGS.with_borrow_mut(|v| v.push(log));
    // cuda_copy too: NIXL refuses a list without a CUDA transport where GPUs are present (it is
    // not loaded, and not needed, where none is).
    v.push(("UCX_TLS".into(), "tcp,self,cuda_copy".into()));
    v
}

thread_local! {
    /// The children this test thread started, for [`Reap`].
    static SPAWNED: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The UCX log files of those children, for [`Reap`].
    static LOGS: std::cell::RefCell<Vec<UcxLog>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Ends a test's children (kill -9, those still running this test binary) and removes what dead
/// producers left under its channel names, whether the test passed or panicked.
struct Reap(Vec<String>);

impl Drop for Reap {
    fn drop(&mut self) {
        let exe = std::env::current_exe().unwrap();
        for pid in SPAWNED.take() {
            let ours = std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|e| e == exe);
            let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map_or(true, |s| s.contains(") Z "));
            if ours && !zombie {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
        std::thread::sleep(Duration::from_millis(100));
        drop(LOGS.take());
        for ch in &self.0 {
            let _ = reclaim::remove_stale(ch);
            let _ = reclaim::remove_stale_host_pool(ch);
            // A killed bridge's status file (this test's channel names only).
            let _ = std::fs::remove_file(cuda_ipc::remote::report::status_path(ch));
        }
    }
}

fn spawn(role: &str, vars: &[(&str, String)]) -> Peer {
    let mut all: Vec<(String, String)> = ucx_env();
    all.extend(vars.iter().map(|(k, v)| (k.to_string(), v.clone())));
    let refs: Vec<(&str, &str)> = all.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let p = Peer::spawn("child", role, &refs);
    SPAWNED.with_borrow_mut(|v| v.push(p.child.id()));
    p
}

/// A near producer, both bridges, and the far channel attached to: everything a test needs.
struct Lane {
    _reap: Reap,
    near: String,
    far: String,
    port: u16,
    producer: Peer,
    recv: Peer,
    send: Peer,
}

fn names(tag: &str) -> (String, String) {
    (
        format!("lane-near-{tag}-{}", std::process::id()),
        format!("lane-far-{tag}-{}", std::process::id()),
    )
}

fn start_recv(far: &str, port: u16) -> (Peer, u16) {
    let mut recv = spawn("recv", &[("FAR", far.into()), ("PORT", port.to_string())]);
    let port: u16 = recv.expect("port", ANSWER).parse().unwrap();
    (recv, port)
}

fn start_send(near: &str, port: u16) -> Peer {
    start_send_with(near, port, "every")
}

fn start_send_with(near: &str, port: u16, delivery: &str) -> Peer {
    spawn(
        "send",
        &[
            ("NEAR", near.into()),
            ("ADDR", format!("127.0.0.1:{port}")),
            ("SECRET", SECRET.into()),
            ("DELIVERY", delivery.into()),
        ],
    )
}

fn wait_for_channel(ch: &str) {
    let start = Instant::now();
    while inspect::inspect(ch).map_or(true, |s| {
        s.producer_liveness != cuda_ipc::identity::Liveness::Alive
    }) {
        assert!(start.elapsed() < ANSWER, "channel {ch} did not appear");
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Lane {
    fn start(tag: &str, frames: u64) -> Lane {
        Lane::start_with(tag, frames, "every")
    }

    fn start_with(tag: &str, frames: u64, delivery: &str) -> Lane {
        let linger = if delivery == "latest" { "1500" } else { "0" };
        nixl::probe().expect("NIXL (libnixl_capi.so) must be on LD_LIBRARY_PATH for these tests");
        let (near, far) = names(tag);
        let reap = Reap(vec![near.clone(), far.clone()]);
        let (recv, port) = start_recv(&far, 0);
        let mut producer = spawn(
            "producer",
            &[
                ("NEAR", near.clone()),
                ("FRAMES", frames.to_string()),
                ("LINGER_MS", linger.into()),
            ],
        );
        producer.expect("ready", ANSWER);
        let send = start_send_with(&near, port, delivery);
        wait_for_channel(&far);
        Lane {
            _reap: reap,
            near,
            far,
            port,
            producer,
            recv,
            send,
        }
    }
}

fn kill9(p: &Peer) {
    let st = Command::new("kill")
        .args(["-9", &p.child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

/// Waits for `p` to exit and returns its exit code.
fn exit_code(p: &mut Peer) -> Option<i32> {
    let start = Instant::now();
    loop {
        if let Some(st) = p.child.try_wait().unwrap() {
            return st.code();
        }
        assert!(start.elapsed() < ANSWER, "child did not exit");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Receives until `ProducerGone`, checking frames; returns how long after `since` it came.
fn until_gone(rx: &Consumer, since: Instant) -> Duration {
    loop {
        match rx.recv_timeout(ANSWER) {
            Ok(f) => {
                check(&f);
            }
            Err(Error::Channel(cuda_ipc::channel::ChannelError::ProducerGone { .. })) => {
                return since.elapsed();
            }
            Err(e) => panic!("expected ProducerGone, got {e}"),
        }
    }
}

/// The near channel's published count advances within 1 s: nothing wedges the near producer.
fn near_advances(near: &str) {
    let before = inspect::inspect(near).unwrap().published;
    let start = Instant::now();
    while inspect::inspect(near).unwrap().published <= before + 5 {
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "the near producer is stuck at {before} frames"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Checks a sending bridge's `closed FRAMES TRANSPORTS@DEVICES PATH` line: `frames` frames over
/// host memory, the loopback interface and TCP, with UCX's CUDA transports (`cuda_copy`,
/// `cuda_ipc`, on device `cuda`) named beside them only where a GPU is present (UCX loads them
/// there whatever the memory).
fn assert_transport(said: &str, frames: &str) {
    let words: Vec<&str> = said.split(' ').collect();
    assert_eq!(words.len(), 3, "{said}");
    assert_eq!(words[0], frames, "{said}");
    assert_eq!(words[2], "host", "host memory at both ends: {said}");
    let (transports, devices) = words[1].split_once('@').expect(said);
    let transports: Vec<&str> = transports.split(',').collect();
    let devices: Vec<&str> = devices.split(',').collect();
    assert!(transports.contains(&"tcp"), "{said}");
    assert!(devices.contains(&"lo"), "{said}");
    for t in &transports {
        assert!(["tcp", "cuda_copy", "cuda_ipc"].contains(t), "{said}");
    }
    for d in &devices {
        assert!(["lo", "cuda"].contains(d), "{said}");
    }
}

fn receive(rx: &Consumer, n: usize) -> u64 {
    let mut last = 0;
    for _ in 0..n {
        let f = rx.recv_timeout(ANSWER).unwrap();
        let s = check(&f);
        assert!(s > last);
        last = s;
    }
    last
}

#[test]
fn ten_thousand_frames_cross_the_lane_every_frame_in_order_with_checked_bytes() {
    let mut l = Lane::start("every", 10_000);
    let rx = attach(&l.far, Delivery::EveryFrame);
    l.producer.send("go");
    let mut n = 0u64;
    loop {
        match rx.recv_timeout(ANSWER) {
            Ok(f) => {
                let s = check(&f);
                n += 1;
                assert_eq!(s, n, "every frame, in order");
            }
            Err(Error::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
            Err(e) => panic!("far consumer: {e}"),
        }
    }
    assert_eq!(n, 10_000);
    drop(rx);
    l.producer.expect("closed", ANSWER);
    // Data went over TCP on the loopback interface (the lane bound UCX to the control
    // connection's interface), as UCX itself reported it; where a GPU is present UCX names its
    // CUDA transports beside it (`cuda_copy,tcp@cuda,lo`). The frames were checked either way.
    let said = l.send.expect("closed", ANSWER);
    assert_transport(&said, "10000");
    assert_eq!(l.recv.expect("closed", ANSWER), "10000");
    for p in [&mut l.producer, &mut l.send, &mut l.recv] {
        assert_eq!(exit_code(p), Some(0));
    }
}

#[test]
fn a_latest_only_far_consumer_drops_frames_and_sees_the_last_one() {
    let mut l = Lane::start("latest", 10_000);
    let rx = attach(&l.far, Delivery::LatestOnly);
    l.producer.send("go");
    let (mut n, mut last) = (0u64, 0u64);
    loop {
        match rx.recv_timeout(ANSWER) {
            Ok(f) => {
                let s = check(&f);
                assert!(s > last, "{s} after {last}");
                last = s;
                n += 1;
                drop(f);
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(Error::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
            Err(e) => panic!("far consumer: {e}"),
        }
    }
    assert_eq!(last, 10_000, "the newest frame is delivered");
    assert!(
        n < 10_000,
        "a slow latest-only consumer drops frames (got all {n})"
    );
    let dropped = rx.stats().consumers.iter().map(|c| c.dropped).sum::<u64>();
    println!("latest-only: {n} received, {dropped} dropped");
    drop(rx);
    l.producer.expect("closed", ANSWER);
    l.send.expect("closed", ANSWER);
    l.recv.expect("closed", ANSWER);
    for p in [&mut l.producer, &mut l.send, &mut l.recv] {
        assert_eq!(exit_code(p), Some(0));
    }
}

#[test]
fn a_latest_only_sending_bridge_drops_near_frames_and_never_holds_the_producer_back() {
    let mut l = Lane::start_with("send-latest", 10_000, "latest");
    let rx = attach(&l.far, Delivery::EveryFrame);
    l.producer.send("go");
    let (mut n, mut last) = (0u64, 0u64);
    loop {
        match rx.recv_timeout(ANSWER) {
            Ok(f) => {
                let s = check(&f);
                assert!(s > last, "{s} after {last}");
                last = s;
                n += 1;
                drop(f);
                std::thread::sleep(Duration::from_micros(500));
            }
            Err(Error::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
            Err(e) => panic!("far consumer: {e}"),
        }
    }
    // The near producer published all 10,000 without waiting for the lane; the lane carried the
    // newest whenever it could, whole and in order, and the last one.
    assert!(
        n < 10_000,
        "a latest-only bridge drops near frames (carried all {n})"
    );
    assert_eq!(last, 10_000, "the newest near frame is carried");
    println!("latest-only sending bridge: {n} of 10000 carried");
    drop(rx);
    l.producer.expect("closed", ANSWER);
    l.send.expect("closed", ANSWER);
    l.recv.expect("closed", ANSWER);
    for p in [&mut l.producer, &mut l.send, &mut l.recv] {
        assert_eq!(exit_code(p), Some(0));
    }
}

#[test]
fn a_killed_near_producer_gives_far_consumers_producer_gone_within_a_second() {
    let mut l = Lane::start("kill-producer", 0);
    let rx = attach(&l.far, Delivery::EveryFrame);
    l.producer.send("go");
    receive(&rx, 100);
    let t = Instant::now();
    kill9(&l.producer);
    let after = until_gone(&rx, t);
    println!("near producer killed: far ProducerGone after {after:?}");
    assert!(after < Duration::from_secs(1), "{after:?}");
    assert_eq!(l.send.expect("gone", ANSWER), "");
    assert_eq!(exit_code(&mut l.recv), Some(3));
    assert_eq!(exit_code(&mut l.send), Some(0));
}

#[test]
fn a_killed_sending_bridge_gives_producer_gone_and_restarted_bridges_resume() {
    let mut l = Lane::start("kill-send", 0);
    let rx = attach(&l.far, Delivery::EveryFrame);
    l.producer.send("go");
    let before = receive(&rx, 100);
    let t = Instant::now();
    kill9(&l.send);
    let after = until_gone(&rx, t);
    println!("sending bridge killed: far ProducerGone after {after:?}");
    assert!(after < Duration::from_secs(1), "{after:?}");
    assert_eq!(exit_code(&mut l.recv), Some(3));
    drop(rx);
    // The near producer reclaims the dead bridge's holds and goes on.
    near_advances(&l.near);
    // Both bridges again; the producer is the same process.
    let (recv2, port) = start_recv(&l.far, 0);
    let send2 = start_send(&l.near, port);
    wait_for_channel(&l.far);
    let rx = attach(&l.far, Delivery::EveryFrame);
    let resumed = receive(&rx, 100);
    assert!(
        resumed > before + 100,
        "near frames go on: {resumed} after {before}"
    );
    assert!(
        l.producer.child.try_wait().unwrap().is_none(),
        "the producer was not restarted"
    );
    for p in [&l.producer, &send2, &recv2] {
        kill9(p);
    }
    drop(rx);
    let _ = l.port;
}

#[test]
fn a_killed_receiving_bridge_gives_producer_gone_and_the_near_side_goes_on() {
    let mut l = Lane::start("kill-recv", 0);
    let rx = attach(&l.far, Delivery::EveryFrame);
    l.producer.send("go");
    let before = receive(&rx, 100);
    let t = Instant::now();
    kill9(&l.recv);
    let after = until_gone(&rx, t);
    println!("receiving bridge killed: far ProducerGone after {after:?}");
    assert!(after < Duration::from_secs(1), "{after:?}");
    drop(rx);
    // The sending bridge detached: the near producer is not held back.
    near_advances(&l.near);
    // A receiving bridge on the same address: the sending bridge (never restarted) resumes.
    let (recv2, _) = start_recv(&l.far, l.port);
    wait_for_channel(&l.far);
    let rx = attach(&l.far, Delivery::EveryFrame);
    let resumed = receive(&rx, 100);
    assert!(resumed > before + 100, "{resumed} after {before}");
    assert!(l.send.child.try_wait().unwrap().is_none());
    for p in [&l.producer, &l.send, &recv2] {
        kill9(p);
    }
}

#[test]
fn a_killed_far_consumer_frees_the_lane_within_a_second() {
    let mut l = Lane::start("kill-consumer", 0);
    let rx = attach(&l.far, Delivery::EveryFrame);
    let mut holder = spawn("hold", &[("FAR", l.far.clone())]);
    l.producer.send("go");
    holder.expect("holding", ANSWER);
    // The holder's every-frame slot and held buffer stall the lane end to end (back-pressure)...
    let stalled_at = receive(&rx, 3);
    let t = Instant::now();
    kill9(&holder);
    // ...until it dies: the far producer reclaims its holds and frames flow again.
    let f = loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(f) => {
                let s = check(&f);
                if s > stalled_at + 10 {
                    break s;
                }
            }
            Err(Error::Timeout { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        assert!(t.elapsed() < Duration::from_secs(2), "still stalled");
    };
    println!(
        "far consumer killed: frames flow again after {:?} (near frame {f})",
        t.elapsed()
    );
    assert!(t.elapsed() < Duration::from_secs(1));
    drop(rx);
    near_advances(&l.near);
    let _ = exit_code(&mut holder);
}

#[test]
fn a_peer_without_the_secret_is_refused_and_logged_not_served() {
    nixl::probe().expect("NIXL must be on LD_LIBRARY_PATH");
    let (near, far) = names("secret");
    let _reap = Reap(vec![near.clone(), far.clone()]);
    let (mut recv, port) = start_recv(&far, 0);
    let mut producer = spawn(
        "producer",
        &[("NEAR", near.clone()), ("FRAMES", "0".into())],
    );
    producer.expect("ready", ANSWER);
    let mut bad = spawn(
        "send",
        &[
            ("NEAR", near.clone()),
            ("ADDR", format!("127.0.0.1:{port}")),
            ("SECRET", "not the secret".into()),
        ],
    );
    let e = bad.expect("error", ANSWER);
    assert!(e.contains("wrong secret"), "{e}");
    assert!(!e.contains(SECRET));
    assert!(
        inspect::inspect(&far).is_err(),
        "no far channel for a refused peer"
    );
    kill9(&bad);
    // The right secret is then served.
    let good = start_send(&near, port);
    wait_for_channel(&far);
    for p in [&producer, &good, &recv] {
        kill9(p);
    }
    let _ = exit_code(&mut recv);
}

#[test]
fn a_second_sender_while_a_session_runs_is_refused_at_once_and_the_lane_goes_on() {
    let mut l = Lane::start("busy", 0);
    let rx = attach(&l.far, Delivery::EveryFrame);
    l.producer.send("go");
    let before = receive(&rx, 20);
    let opts = send::SendOptions::new(&l.near, &format!("127.0.0.1:{}", l.port), secret());
    let t = Instant::now();
    let e = send::serve(&opts, &AtomicBool::new(false), &mut send::Totals::default()).unwrap_err();
    let took = t.elapsed();
    assert!(
        matches!(&e, Error::Remote(cuda_ipc::remote::RemoteError::Busy(r)) if r.contains("busy")),
        "{e}"
    );
    assert!(took < Duration::from_secs(1), "refused after {took:?}");
    // The running session was not disturbed.
    assert!(receive(&rx, 20) > before);
    drop(rx);
    for p in [&l.producer, &l.send, &l.recv] {
        kill9(p);
    }
}

/// A receiving bridge alone (no sender yet), for the tests of its door.
fn lone_recv(tag: &str) -> (Reap, String, String, Peer, u16) {
    nixl::probe().expect("NIXL must be on LD_LIBRARY_PATH");
    let (near, far) = names(tag);
    let reap = Reap(vec![near.clone(), far.clone()]);
    let (recv, port) = start_recv(&far, 0);
    (reap, near, far, recv, port)
}

fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// Runs the sending side of the handshake on a fresh connection, whole within 5 s.
fn handshake(port: u16) -> (TcpStream, Session) {
    let mut s = connect(port);
    let session = wire::handshake_send(&mut s, &secret(), Instant::now() + Duration::from_secs(5))
        .expect("the handshake");
    (s, session)
}

/// Waits (at most `limit`) until the peer closes `s`; returns how long that took.
fn closed_within(s: &mut TcpStream, limit: Duration) -> Duration {
    let start = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return start.elapsed(),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return start.elapsed(), // reset: closed too
        }
        assert!(start.elapsed() < limit, "still open after {limit:?}");
    }
}

#[test]
fn trickling_and_silent_peers_never_delay_a_real_sender_and_are_cut_at_the_deadline() {
    let (_reap, _near, _far, recv, port) = lone_recv("door");
    // A peer announcing a 60-byte hello and sending one byte every 300 ms: with a timeout per read
    // it would hold the door for 18 s; a silent one; and 100 more silent ones.
    let mut trickler = connect(port);
    trickler.write_all(&60u32.to_le_bytes()).unwrap();
    let mut writer = trickler.try_clone().unwrap();
    let dripping = std::thread::spawn(move || {
        for _ in 0..60 {
            if writer.write_all(&[0x11]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    let mut silent: Vec<TcpStream> = (0..101).map(|_| connect(port)).collect();
    std::thread::sleep(Duration::from_millis(200));
    // A real sender is answered meanwhile: its handshake completes at once.
    let t = Instant::now();
    let (_s, _session) = handshake(port);
    let took = t.elapsed();
    println!("handshake with 102 peers stalling: {took:?}");
    assert!(took < Duration::from_secs(1), "{took:?}");
    // The trickler and the silent ones are cut at the handshake's deadline (5 s by default), the
    // trickler's bytes notwithstanding.
    let cut = closed_within(&mut trickler, Duration::from_secs(15));
    println!("trickling peer cut after {cut:?} more");
    assert!(cut < Duration::from_secs(9), "{cut:?}");
    closed_within(&mut silent[0], Duration::from_secs(15));
    dripping.join().unwrap();
    kill9(&recv);
}

/// Forwards one connection from a listener of its own to the bridge at `port`, recording what the
/// client sent; returns the proxy's port and the recording, complete once the client closed.
fn recording_proxy(port: u16) -> (u16, std::thread::JoinHandle<Vec<u8>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap().port();
    let t = std::thread::spawn(move || {
        let (mut client, _) = l.accept().unwrap();
        let mut bridge = connect(port);
        let mut from_bridge = bridge.try_clone().unwrap();
        let mut to_client = client.try_clone().unwrap();
        let back = std::thread::spawn(move || {
            let _ = std::io::copy(&mut from_bridge, &mut to_client);
        });
        let mut sent = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match client.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    sent.extend_from_slice(&buf[..n]);
                    if bridge.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = bridge.shutdown(std::net::Shutdown::Both);
        let _ = back.join();
        sent
    });
    (at, t)
}

#[test]
fn a_recorded_session_replayed_is_refused() {
    let (_reap, _near, far, recv, port) = lone_recv("replay");
    // A sender's session, recorded on its way: the handshake, then its channel (of 0 buffers, so
    // the bridge refuses it and stays free).
    let (via, recording) = recording_proxy(port);
    let (mut s, mut session) = handshake(via);
    let channel = Msg::Channel {
        buffers: 0,
        buffer_bytes: 4096,
        kind: 0,
        agent: "recorded".into(),
    };
    session.send(&mut s, &channel).unwrap();
    let m = session
        .recv(&mut s, Duration::from_secs(10), "the refusal")
        .unwrap();
    assert!(
        matches!(&m, Msg::Refused { reason } if reason.contains("buffers")),
        "{m:?}"
    );
    drop(s);
    let sent = recording.join().unwrap();
    assert!(sent.len() > 100, "recorded {} bytes", sent.len());
    // Played again, byte for byte: the bridge's challenge is new, so the recorded proof fails.
    let mut replay = connect(port);
    replay.write_all(&sent).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let first = wire::recv_handshake(&mut replay, deadline, "the challenge").unwrap();
    assert!(matches!(first, Msg::Challenge { .. }), "{first:?}");
    match wire::recv_handshake(&mut replay, deadline, "the verdict").unwrap() {
        Msg::Refused { reason } => assert!(reason.contains("wrong secret"), "{reason}"),
        m => panic!("a replayed session was answered with {m:?}"),
    }
    assert!(
        inspect::inspect(&far).is_err(),
        "no far channel for a replay"
    );
    // The bridge still serves a real sender's handshake.
    handshake(port);
    kill9(&recv);
}

#[test]
fn a_bad_geometry_or_kind_from_a_peer_with_the_secret_is_refused_and_the_next_sender_served() {
    let (_reap, near, far, recv, port) = lone_recv("geometry");
    for (buffers, buffer_bytes, kind, says) in [
        (0, 4096, 0, "0 buffers"),
        (u32::MAX, 4096, 0, "4294967295 buffers"),
        (4, 1u64 << 63, 0, "9223372036854775808 bytes"),
        (4, 0, 0, "buffers of 0 bytes"),
        (4, 4096, 255, "memory kind 255"),
    ] {
        let (mut s, mut session) = handshake(port);
        let m = Msg::Channel {
            buffers,
            buffer_bytes,
            kind,
            agent: "bad".into(),
        };
        session.send(&mut s, &m).unwrap();
        match session.recv(&mut s, Duration::from_secs(10), "the refusal") {
            Ok(Msg::Refused { reason }) => {
                assert!(
                    reason.contains(says) && reason.contains("allowed"),
                    "{reason}"
                );
            }
            other => panic!("{m:?} was answered with {other:?}"),
        }
        assert!(inspect::inspect(&far).is_err(), "no far channel for {m:?}");
    }
    // The bridge goes on: a good sender is served, frames checked.
    let mut producer = spawn(
        "producer",
        &[("NEAR", near.clone()), ("FRAMES", "0".into())],
    );
    producer.expect("ready", ANSWER);
    let send = start_send(&near, port);
    wait_for_channel(&far);
    let rx = attach(&far, Delivery::EveryFrame);
    producer.send("go");
    receive(&rx, 20);
    drop(rx);
    for p in [&producer, &send, &recv] {
        kill9(p);
    }
}
