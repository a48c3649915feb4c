//! The metrics endpoint's HTTP server: one thread, non-blocking sockets and `poll(2)`, whatever
//! the number of clients.
//!
//! - At most [`Limits::max_connections`] connections at once; one more is answered
//!   `503 Service Unavailable` and closed at once, without reading it.
//! - A connection has [`Limits::read_timeout`] from its accept to the end of its request's header,
//!   and [`Limits::write_timeout`] from its response being ready to the response's last byte taken
//!   by the kernel; past either it is closed. A header longer than [`Limits::max_request_bytes`]
//!   is answered `431` and closed.
//! - One request per connection: every response says `Connection: close`, and after it the server
//!   shuts its side down and reads (and drops) what the client still sends for at most
//!   [`LINGER`], so the client reads the response before the close (a close with unread input
//!   would reset the connection). Pipelined requests after the first are never answered.
//! - One round of the loop reads or writes each ready connection at most once, so no client is
//!   served twice while another waits: a client that pipelines requests and never reads gets one
//!   response and is closed, one that never reads a long response is closed at its write
//!   deadline, and an idle one costs a file descriptor and a few bytes, never a thread.
//!
//! The handler runs on the loop's thread (a scrape is a look at `/dev/shm` and NVML, milliseconds):
//! while it runs nobody else is served, as with one worker, and nothing is shared between threads.

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// The bounds of the endpoint (the defaults are [`Limits::DEFAULT`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once; one more is answered 503 and closed at once.
    pub max_connections: usize,
    /// From a connection's accept to the end of its request's header; past it, closed.
    pub read_timeout: Duration,
    /// From a response being ready to its last byte taken by the kernel; past it, closed.
    pub write_timeout: Duration,
    /// The longest request header, in bytes; a longer one is answered 431 and closed.
    pub max_request_bytes: usize,
}

impl Limits {
    /// 256 connections, 5 s to send a request, 10 s to take a response, 8 KiB of header.
    pub const DEFAULT: Limits = Limits {
        max_connections: 256,
        read_timeout: Duration::from_secs(5),
        write_timeout: Duration::from_secs(10),
        max_request_bytes: 8 << 10,
    };
}

/// How long, after its response, a connection's input is read and dropped while the client
/// closes its side.
pub const LINGER: Duration = Duration::from_secs(1);

/// The longest the loop sleeps in `poll`, so that `stop` is asked at least this often.
const TICK: Duration = Duration::from_millis(250);

/// Connections accepted in one round at most, so that a flood of connects does not starve the
/// connections already open.
const ACCEPTS_PER_ROUND: usize = 64;

/// How long accepting pauses after `accept` failed for want of descriptors or memory (`EMFILE`,
/// `ENFILE`, `ENOBUFS`, `ENOMEM`): the listener stays readable, and retrying at once would spin.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// A request as the handler sees it.
#[derive(Debug, PartialEq, Eq)]
pub struct Request<'a> {
    /// `GET`, `HEAD`, ... as the client sent it.
    pub method: &'a str,
    /// The request target without its query (`/metrics`).
    pub path: &'a str,
}

/// A response: status code, `Content-Type` and body. `HEAD` requests get the header alone.
#[derive(Debug)]
pub struct Response {
    /// The status code (200, 404, ...).
    pub status: u16,
    /// The `Content-Type` header's value.
    pub content_type: &'static str,
    /// The body.
    pub body: Vec<u8>,
}

impl Response {
    /// A `text/plain` response.
    pub fn text(status: u16, body: impl Into<String>) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into().into_bytes(),
        }
    }

    /// The bytes on the wire: status line, headers, and (unless `head_only`) the body.
    fn to_wire(&self, head_only: bool) -> Vec<u8> {
        let mut v = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n{}\r\n",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.len(),
            if self.status == 503 {
                "Retry-After: 1\r\n"
            } else {
                ""
            }
        )
        .into_bytes();
        if !head_only {
            v.extend_from_slice(&self.body);
        }
        v
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// Where a connection is.
#[derive(Debug)]
enum Phase {
    /// Reading the request's header.
    Reading,
    /// Writing the response; `written` bytes of it are out.
    Writing { out: Vec<u8>, written: usize },
    /// Response out, our side shut: reading and dropping until the client closes.
    Lingering,
}

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    input: Vec<u8>,
    phase: Phase,
    /// When this phase's time is up.
    deadline: Instant,
}

/// What one step on a connection left.
enum Step {
    Keep,
    Close,
}

/// Where the request's header ends (the index after its blank line), if it has.
fn header_end(buf: &[u8]) -> Option<usize> {
    (0..buf.len()).find_map(|i| {
        if buf[i..].starts_with(b"\r\n\r\n") {
            Some(i + 4)
        } else if buf[i..].starts_with(b"\n\n") {
            Some(i + 2)
        } else {
            None
        }
    })
}

/// The method and target of a request's first line (`GET /metrics?x HTTP/1.1`), the target
/// without its query; `None` when the line is not an HTTP request line.
fn request_line(header: &[u8]) -> Option<(&str, &str)> {
    let line = header.split(|&b| b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
    let mut parts = line.split(' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some()
        || method.is_empty()
        || !method.bytes().all(|b| b.is_ascii_uppercase())
        || !version.starts_with("HTTP/1.")
    {
        return None;
    }
    Some((method, target.split('?').next().unwrap_or("")))
}

impl Conn {
    /// One read of the request; when its header is complete, the response is made and the
    /// connection turns to writing it.
    fn read_request(
        &mut self,
        limits: &Limits,
        handle: &mut impl FnMut(&Request) -> Response,
    ) -> Step {
        let mut buf = [0u8; 4096];
        let n = match self.stream.read(&mut buf) {
            Ok(0) => return Step::Close,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                return Step::Keep;
            }
            Err(_) => return Step::Close,
        };
        self.input.extend_from_slice(&buf[..n]);
        let (resp, head_only) = match header_end(&self.input) {
            Some(end) => match request_line(&self.input[..end]) {
                Some((method, path)) => (handle(&Request { method, path }), method == "HEAD"),
                None => (Response::text(400, "not an HTTP request\n"), false),
            },
            None if self.input.len() > limits.max_request_bytes => (
                Response::text(
                    431,
                    format!(
                        "request header longer than {} bytes\n",
                        limits.max_request_bytes
                    ),
                ),
                false,
            ),
            None => return Step::Keep,
        };
        self.input = Vec::new();
        self.phase = Phase::Writing {
            out: resp.to_wire(head_only),
            written: 0,
        };
        self.deadline = Instant::now() + limits.write_timeout;
        // Written in the next round, when `poll` says the socket takes more (it usually does
        // at once: one more round, not a wait).
        Step::Keep
    }

    /// One write of the response; when it is all out, our side is shut and the connection
    /// lingers.
    fn write_response(&mut self) -> Step {
        let Phase::Writing { out, written } = &mut self.phase else {
            return Step::Keep;
        };
        match self.stream.write(&out[*written..]) {
            Ok(n) => *written += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                return Step::Keep;
            }
            Err(_) => return Step::Close,
        }
        if *written < out.len() {
            return Step::Keep;
        }
        if self.stream.shutdown(Shutdown::Write).is_err() {
            return Step::Close;
        }
        self.phase = Phase::Lingering;
        self.deadline = Instant::now() + LINGER;
        Step::Keep
    }

    /// One read of what the client still sends after its response, dropped.
    fn linger(&mut self) -> Step {
        let mut buf = [0u8; 4096];
        match self.stream.read(&mut buf) {
            Ok(0) => Step::Close,
            Ok(_) => Step::Keep,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                Step::Keep
            }
            Err(_) => Step::Close,
        }
    }
}

/// Answers a connection past the bound with 503 and closes it, without reading it and without
/// waiting: one non-blocking write of a response far smaller than any socket buffer.
fn refuse(mut stream: TcpStream, limits: &Limits) {
    let resp = Response::text(
        503,
        format!(
            "busy: {} connections are open, the most this endpoint serves at once; try again\n",
            limits.max_connections
        ),
    );
    if stream.set_nonblocking(true).is_ok() {
        let _ = stream.write(&resp.to_wire(false));
        let _ = stream.shutdown(Shutdown::Write);
    }
}

/// Serves HTTP on `listener` with `handle` until `stop` says so (asked at least every 250 ms).
///
/// # Errors
/// Only what makes serving impossible: the listener cannot be made non-blocking, or `poll` fails
/// (a failed `accept`, read or write closes that connection, or pauses accepting for 100 ms when
/// descriptors run out, and is no error).
pub fn serve(
    listener: &TcpListener,
    limits: Limits,
    mut handle: impl FnMut(&Request) -> Response,
    mut stop: impl FnMut() -> bool,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let mut conns: Vec<Conn> = Vec::new();
    let mut accept_paused_until: Option<Instant> = None;
    while !stop() {
        let now = Instant::now();
        conns.retain(|c| c.deadline > now);
        if accept_paused_until.is_some_and(|t| t <= now) {
            accept_paused_until = None;
        }
        let accepting = accept_paused_until.is_none();
        let wake = conns
            .iter()
            .map(|c| c.deadline)
            .chain(accept_paused_until)
            .min()
            .map_or(TICK, |d| d.saturating_duration_since(now).min(TICK));
        let ready: Vec<PollFlags> = {
            let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(conns.len() + 1);
            fds.push(PollFd::new(
                listener,
                if accepting {
                    PollFlags::IN
                } else {
                    PollFlags::empty()
                },
            ));
            for c in &conns {
                let ev = match c.phase {
                    Phase::Writing { .. } => PollFlags::OUT,
                    Phase::Reading | Phase::Lingering => PollFlags::IN,
                };
                fds.push(PollFd::new(&c.stream, ev));
            }
            let timeout = Timespec {
                tv_sec: wake.as_secs() as i64,
                tv_nsec: i64::from(wake.subsec_nanos()),
            };
            match poll(&mut fds, Some(&timeout)) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            fds.iter().map(|f| f.revents()).collect()
        };
        // The open connections first, then the new ones: `ready[k + 1]` is `conns[k]`'s.
        let mut k = 0;
        conns.retain_mut(|c| {
            let ev = ready[k + 1];
            k += 1;
            if ev.is_empty() {
                return true;
            }
            let step = match c.phase {
                Phase::Reading => c.read_request(&limits, &mut handle),
                Phase::Writing { .. } => c.write_response(),
                Phase::Lingering => c.linger(),
            };
            matches!(step, Step::Keep)
        });
        if accepting && !ready[0].is_empty() {
            for _ in 0..ACCEPTS_PER_ROUND {
                match listener.accept() {
                    Ok((stream, _)) => {
                        if conns.len() >= limits.max_connections {
                            refuse(stream, &limits);
                        } else if stream.set_nonblocking(true).is_ok() {
                            conns.push(Conn {
                                stream,
                                input: Vec::new(),
                                phase: Phase::Reading,
                                deadline: Instant::now() + limits.read_timeout,
                            });
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e)
                        if e.kind() == ErrorKind::Interrupted
                            || e.kind() == ErrorKind::ConnectionAborted =>
                    {
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(
                            "metrics endpoint: accept failed ({e}); accepting again in {ACCEPT_PAUSE:?}"
                        );
                        accept_paused_until = Some(Instant::now() + ACCEPT_PAUSE);
                        break;
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A server on a free loopback port with `limits`, answering `/big` with `big` bytes and
    /// anything else with `ok`; stopped (and joined) when dropped.
    struct TestServer {
        addr: std::net::SocketAddr,
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl TestServer {
        fn start(limits: Limits, big: usize) -> TestServer {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let s = stop.clone();
            let thread = std::thread::spawn(move || {
                serve(
                    &listener,
                    limits,
                    |r| match r.path {
                        "/big" => Response {
                            status: 200,
                            content_type: "application/octet-stream",
                            body: vec![b'x'; big],
                        },
                        p => Response::text(200, format!("ok {} {p}\n", r.method)),
                    },
                    // Relaxed: a flag alone, no data published with it.
                    || s.load(Ordering::Relaxed),
                )
                .unwrap();
            });
            TestServer {
                addr,
                stop,
                thread: Some(thread),
            }
        }

        /// One GET of `path` on a new connection: the whole answer, and how long it took.
        fn get(&self, path: &str) -> (String, Duration) {
            let t = Instant::now();
            let mut s = TcpStream::connect(self.addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut all = String::new();
            s.read_to_string(&mut all).unwrap();
            (all, t.elapsed())
        }
    }

    impl Drop for TestServer {
        fn drop(&mut self) {
            // Relaxed: see `start`.
            self.stop.store(true, Ordering::Relaxed);
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    fn limits(max: usize, read_ms: u64, write_ms: u64) -> Limits {
        Limits {
            max_connections: max,
            read_timeout: Duration::from_millis(read_ms),
            write_timeout: Duration::from_millis(write_ms),
            max_request_bytes: 1024,
        }
    }

    #[test]
    fn request_lines_are_read_and_anything_else_is_refused() {
        assert_eq!(
            header_end(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET"),
            Some(27)
        );
        assert_eq!(header_end(b"GET / HTTP/1.0\n\n"), Some(16));
        assert_eq!(header_end(b"GET / HTTP/1.1\r\nHost: x\r\n"), None);
        assert_eq!(
            request_line(b"GET /metrics?x=1 HTTP/1.1\r\n\r\n"),
            Some(("GET", "/metrics"))
        );
        assert_eq!(request_line(b"HEAD / HTTP/1.0\n\n"), Some(("HEAD", "/")));
        assert_eq!(request_line(b"\x16\x03\x01 TLS hello\r\n\r\n"), None);
        assert_eq!(request_line(b"GET /\r\n\r\n"), None);
        assert_eq!(request_line(b"GET / HTTP/1.1 x\r\n\r\n"), None);
        assert_eq!(request_line(b"get / HTTP/1.1\r\n\r\n"), None);
    }

    #[test]
    fn each_request_gets_one_response_with_its_length_and_the_connection_closes() {
        let srv = TestServer::start(limits(4, 2000, 2000), 10);
        let (all, _) = srv.get("/a?b");
        assert!(all.starts_with("HTTP/1.1 200 OK\r\n"), "{all}");
        assert!(all.contains("\r\nContent-Length: 10\r\n"), "{all}");
        assert!(all.contains("\r\nConnection: close\r\n"), "{all}");
        assert!(all.ends_with("\r\n\r\nok GET /a\n"), "{all}");
        // HEAD: the header alone, with the body's length.
        let mut s = TcpStream::connect(srv.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"HEAD /big HTTP/1.1\r\n\r\n").unwrap();
        let mut all = String::new();
        s.read_to_string(&mut all).unwrap();
        assert!(all.contains("Content-Length: 10\r\n"), "{all}");
        assert!(all.ends_with("\r\n\r\n"), "{all}");
        // Garbage and an endless header.
        let mut s = TcpStream::connect(srv.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"hello\r\n\r\n").unwrap();
        let mut all = String::new();
        s.read_to_string(&mut all).unwrap();
        assert!(all.starts_with("HTTP/1.1 400 "), "{all}");
        let mut s = TcpStream::connect(srv.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&[b'a'; 2000]).unwrap();
        let mut all = String::new();
        s.read_to_string(&mut all).unwrap();
        assert!(all.starts_with("HTTP/1.1 431 "), "{all}");
    }

    #[test]
    fn a_client_that_never_reads_a_long_response_is_dropped_at_the_write_deadline_and_others_are_answered_meanwhile()
     {
        // 64 MiB: more than the loopback socket buffers of both ends take.
        let srv = TestServer::start(limits(8, 5000, 1500), 64 << 20);
        let mut stuck = TcpStream::connect(srv.addr).unwrap();
        stuck.write_all(b"GET /big HTTP/1.1\r\n\r\n").unwrap();
        let t = Instant::now();
        // Meanwhile: each answered within a second.
        while t.elapsed() < Duration::from_millis(1000) {
            let (all, took) = srv.get("/small");
            assert!(all.ends_with("ok GET /small\n"), "{all}");
            assert!(took < Duration::from_secs(1), "answered in {took:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
        // The stuck client, reading now, finds its response cut short by the close (a reset or
        // an end far before 64 MiB).
        std::thread::sleep(Duration::from_millis(1500));
        stuck
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut got = 0usize;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match stuck.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
        assert!(got < 64 << 20, "the whole response came: {got} bytes");
    }

    #[test]
    fn a_pipelining_client_that_never_reads_gets_one_response_and_does_not_stop_the_others() {
        let srv = TestServer::start(limits(8, 5000, 5000), 10);
        let mut pipe = TcpStream::connect(srv.addr).unwrap();
        let addr = srv.addr;
        // 20,000 requests in one stream, never reading; writes until the server closes it.
        let writer = std::thread::spawn(move || {
            let req = b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n".repeat(20_000);
            let _ = pipe.write_all(&req);
            pipe
        });
        for _ in 0..10 {
            let (all, took) = srv.get("/other");
            assert!(all.ends_with("ok GET /other\n"), "{all}");
            assert!(took < Duration::from_secs(1), "answered in {took:?}");
        }
        let mut pipe = writer.join().unwrap();
        pipe.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut all = Vec::new();
        let _ = pipe.read_to_end(&mut all);
        let all = String::from_utf8_lossy(&all);
        assert!(
            all.matches("HTTP/1.1 ").count() <= 1,
            "more than one response: {all}"
        );
        let _ = addr;
    }

    #[test]
    fn connections_past_the_bound_are_answered_503_at_once_and_idle_ones_leave_at_the_read_deadline()
     {
        let srv = TestServer::start(limits(3, 1500, 1000), 10);
        let idle: Vec<TcpStream> = (0..3)
            .map(|_| TcpStream::connect(srv.addr).unwrap())
            .collect();
        // Accepted in order: the fourth finds the bound taken.
        std::thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        let mut s = TcpStream::connect(srv.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut all = Vec::new();
        let _ = s.read_to_end(&mut all);
        let all = String::from_utf8_lossy(&all);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert!(all.starts_with("HTTP/1.1 503 "), "{all}");
        assert!(all.contains("3 connections"), "{all}");
        // The idle ones are closed at their read deadline, and the slots serve again.
        std::thread::sleep(Duration::from_millis(1600));
        let (all, _) = srv.get("/after");
        assert!(all.ends_with("ok GET /after\n"), "{all}");
        for mut c in idle {
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut b = Vec::new();
            assert!(
                matches!(c.read_to_end(&mut b), Ok(0)),
                "closed, said nothing"
            );
        }
    }
}
