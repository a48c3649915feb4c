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
use cuda_ipc::remote::wire::Secret;
use cuda_ipc::remote::{nixl, recv, send};
use std::net::TcpListener;
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

fn ucx_env(tag: &str) -> Vec<(String, String)> {
    let log = std::env::temp_dir().join(format!(
        "cuda-ipc-lane-test-{tag}-{}.ucx.log",
        std::process::id()
    ));
    LOGS.with_borrow_mut(|v| v.push(log.clone()));
    // What `cuda-ipc bridge` gives itself: UCX bound to the loopback interface of the control
    // connection's address, its protocol choices logged for the transport report.
    let mut v: Vec<(String, String)> =
        cuda_ipc::remote::environment("127.0.0.1".parse().unwrap(), Some(&log))
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string_lossy().into_owned()))
            .collect();
    // cuda_copy too: NIXL refuses a list without a CUDA transport where GPUs are present (it is
    // not loaded, and not needed, where none is).
    v.push(("UCX_TLS".into(), "tcp,self,cuda_copy".into()));
    v
}

thread_local! {
    /// The children this test thread started, for [`Reap`].
    static SPAWNED: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The UCX log files of those children, for [`Reap`].
    static LOGS: std::cell::RefCell<Vec<std::path::PathBuf>> = const { std::cell::RefCell::new(Vec::new()) };
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
        for log in LOGS.take() {
            let _ = std::fs::remove_file(log);
        }
        for ch in &self.0 {
            let _ = reclaim::remove_stale(ch);
            let _ = reclaim::remove_stale_host_pool(ch);
            // A killed bridge's status file (this test's channel names only).
            let _ = std::fs::remove_file(cuda_ipc::remote::report::status_path(ch));
        }
    }
}

fn spawn(role: &str, tag: &str, vars: &[(&str, String)]) -> Peer {
    let mut all: Vec<(String, String)> = ucx_env(&format!("{tag}-{role}"));
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

fn start_recv(tag: &str, far: &str, port: u16) -> (Peer, u16) {
    let mut recv = spawn(
        "recv",
        tag,
        &[("FAR", far.into()), ("PORT", port.to_string())],
    );
    let port: u16 = recv.expect("port", ANSWER).parse().unwrap();
    (recv, port)
}

fn start_send(tag: &str, near: &str, port: u16) -> Peer {
    start_send_with(tag, near, port, "every")
}

fn start_send_with(tag: &str, near: &str, port: u16, delivery: &str) -> Peer {
    spawn(
        "send",
        tag,
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
        let (recv, port) = start_recv(tag, &far, 0);
        let mut producer = spawn(
            "producer",
            tag,
            &[
                ("NEAR", near.clone()),
                ("FRAMES", frames.to_string()),
                ("LINGER_MS", linger.into()),
            ],
        );
        producer.expect("ready", ANSWER);
        let send = start_send_with(tag, &near, port, delivery);
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
            Err(Error::ProducerGone { .. }) => return since.elapsed(),
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
            Err(Error::ChannelClosed) => break,
            Err(e) => panic!("far consumer: {e}"),
        }
    }
    assert_eq!(n, 10_000);
    drop(rx);
    l.producer.expect("closed", ANSWER);
    // Data went over TCP on the loopback interface alone (the lane bound UCX to the control
    // connection's interface), as UCX itself reported it.
    assert_eq!(l.send.expect("closed", ANSWER), "10000 tcp@lo host");
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
            Err(Error::ChannelClosed) => break,
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
            Err(Error::ChannelClosed) => break,
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
    let (recv2, port) = start_recv("kill-send-2", &l.far, 0);
    let send2 = start_send("kill-send-2", &l.near, port);
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
    let (recv2, _) = start_recv("kill-recv-2", &l.far, l.port);
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
    let mut holder = spawn("hold", "kill-consumer", &[("FAR", l.far.clone())]);
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
    let (mut recv, port) = start_recv("secret", &far, 0);
    let mut producer = spawn(
        "producer",
        "secret",
        &[("NEAR", near.clone()), ("FRAMES", "0".into())],
    );
    producer.expect("ready", ANSWER);
    let mut bad = spawn(
        "send",
        "secret-bad",
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
    let good = start_send("secret", &near, port);
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
        matches!(&e, Error::Remote(cuda_ipc::remote::RemoteError::Refused(r)) if r.contains("busy")),
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
