//! The metrics endpoint under clients that misbehave: one that pipelines requests and never reads,
//! a thousand idle connections, and connections past the bound. The `cuda-ipc metrics` process
//! itself is measured (`/proc/PID/task`, `VmRSS`).

mod common;
use common::bin;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `cuda-ipc metrics` on a free loopback port, killed when dropped.
struct Endpoint {
    child: Child,
    addr: String,
}

impl Endpoint {
    fn start(extra: &[&str]) -> Endpoint {
        let mut child = Command::new(bin())
            .args(["metrics", "--listen", "127.0.0.1:0"])
            .args(extra)
            // A name no channel has: every scrape stays small and the same.
            .arg("cuda-ipc-endpoint-test-no-such-channel")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut first = String::new();
        // The reader is kept by the child's handle: dropping it would close the pipe.
        let mut out = BufReader::new(child.stdout.take().unwrap());
        out.read_line(&mut first).unwrap();
        let addr = first
            .trim()
            .strip_prefix("serving OpenMetrics on http://")
            .and_then(|a| a.strip_suffix("/metrics"))
            .unwrap_or_else(|| panic!("first line: {first:?}"))
            .to_string();
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = out.read_to_end(&mut sink);
        });
        Endpoint { child, addr }
    }

    /// One scrape on a new connection: (status code, how long it took).
    fn scrape(&self) -> (u16, Duration) {
        let t = Instant::now();
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut all = Vec::new();
        let _ = s.read_to_end(&mut all);
        let all = String::from_utf8_lossy(&all);
        let code = all
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        if code == 200 {
            assert!(all.ends_with("# EOF\n"), "a whole OpenMetrics text: {all}");
        }
        (code, t.elapsed())
    }

    /// (threads, resident bytes) of the endpoint's process.
    fn usage(&self) -> (usize, u64) {
        let pid = self.child.id();
        let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .count();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS in /proc/PID/status");
        (threads, kib << 10)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Raises this process's soft limit on open files to at least `n` (within the hard limit).
fn allow_files(n: u64) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut l = getrlimit(Resource::Nofile);
    if l.current.is_some_and(|c| c < n) {
        l.current = Some(l.maximum.map_or(n, |m| m.min(n)));
        setrlimit(Resource::Nofile, l).unwrap();
    }
}

#[test]
fn a_pipelining_client_that_never_reads_does_not_keep_other_scrapes_waiting() {
    let e = Endpoint::start(&[]);
    let mut pipe = TcpStream::connect(&e.addr).unwrap();
    let writer = std::thread::spawn(move || {
        let req = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(20_000);
        // Until the endpoint closes it (a reset or a broken pipe): never read.
        let _ = pipe.write_all(&req);
        pipe
    });
    std::thread::sleep(Duration::from_millis(100));
    for _ in 0..20 {
        let (code, took) = e.scrape();
        assert_eq!(code, 200);
        assert!(
            took < Duration::from_secs(1),
            "a scrape took {took:?} beside the pipelining client"
        );
    }
    // The pipelining client got one response at most, and its connection was closed.
    let mut pipe = writer.join().unwrap();
    pipe.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut got = Vec::new();
    let _ = pipe.read_to_end(&mut got);
    let got = String::from_utf8_lossy(&got);
    assert!(got.matches("HTTP/1.1 ").count() <= 1, "{got}");
}

#[test]
fn a_thousand_idle_connections_take_no_thread_and_their_memory_is_back_within_5_s_of_leaving() {
    allow_files(4096);
    // Room for all of them, and a read deadline past the test: they stay until they leave.
    let e = Endpoint::start(&["--max-connections", "1100", "--read-timeout-ms", "60000"]);
    for _ in 0..3 {
        assert_eq!(e.scrape().0, 200);
    }
    let (threads0, rss0) = e.usage();
    let idle: Vec<TcpStream> = (0..1000)
        .map(|_| TcpStream::connect(&e.addr).unwrap())
        .collect();
    // All accepted (the bound is above them): a scrape is still answered at once.
    std::thread::sleep(Duration::from_millis(500));
    let (code, took) = e.scrape();
    assert_eq!(code, 200);
    assert!(took < Duration::from_secs(1), "{took:?}");
    let (threads, _) = e.usage();
    assert!(
        threads <= threads0,
        "{threads} threads with 1000 idle connections, {threads0} before"
    );
    drop(idle);
    let t = Instant::now();
    // A generous margin: allocator slack, not a per-connection cost (1000 connections would
    // show as megabytes).
    const MARGIN: u64 = 4 << 20;
    let (threads, rss) = loop {
        let (threads, rss) = e.usage();
        if (threads <= threads0 && rss <= rss0 + MARGIN) || t.elapsed() > Duration::from_secs(5) {
            break (threads, rss);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(threads <= threads0, "{threads} threads, {threads0} before");
    assert!(
        rss <= rss0 + MARGIN,
        "resident {rss} bytes 5 s after the clients left, {rss0} before"
    );
    assert_eq!(e.scrape().0, 200);
}

#[test]
fn connections_past_the_bound_are_answered_503_at_once_and_served_again_when_room_is_made() {
    let e = Endpoint::start(&["--max-connections", "4", "--read-timeout-ms", "60000"]);
    let idle: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(&e.addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..3 {
        let t = Instant::now();
        let mut s = TcpStream::connect(&e.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut all = Vec::new();
        let r = s.read_to_end(&mut all);
        let took = t.elapsed();
        let all = String::from_utf8_lossy(&all);
        // Answered 503 (or, where the close overtook it, closed) at once.
        assert!(
            all.starts_with("HTTP/1.1 503 Service Unavailable\r\n") || r.is_err() || all.is_empty(),
            "{all}"
        );
        assert!(all.is_empty() || all.contains("4 connections"), "{all}");
        assert!(took < Duration::from_secs(1), "{took:?}");
    }
    drop(idle);
    let t = Instant::now();
    loop {
        let (code, _) = e.scrape();
        if code == 200 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "still {code} after the idle ones left"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
