//! The metrics endpoint's HTTP server: hyper's HTTP/1.1 server on a tokio runtime of one thread
//! (`current_thread`), a task per connection, whatever the number of clients.
//!
//! - At most [`Limits::max_connections`] connections at once (a [`Semaphore`] of that many
//!   permits, one held by each connection's task); one more is answered
//!   `503 Service Unavailable` with `Retry-After` and closed at once, without reading it and
//!   without waiting (one non-blocking write, see [`refuse`]).
//! - A connection has [`Limits::read_timeout`] from its accept to the end of its request's header
//!   (a peek for its first byte under a timeout, then hyper's `header_read_timeout` with what is
//!   left: see [`connection`]), and
//!   [`Limits::write_timeout`] from the first byte of its response being written to the last
//!   byte taken by the kernel ([`WriteDeadline`]); past either it is closed. A header longer than
//!   [`Limits::max_request_bytes`] is answered `431` and closed (hyper's `max_header_size`).
//! - One request per connection: keep-alive is off and every response says `Connection: close`;
//!   pipelined requests after the first are never answered, so one connection never queues work.
//! - Each connection is a task of the one runtime thread that yields whenever its socket would
//!   block: a client that pipelines requests and never reads gets one response and is closed, one
//!   that never reads a long response is closed at its write deadline, and an idle one costs a file
//!   descriptor and a small task (hyper's state and buffers come with its first byte), never a
//!   thread.
//!
//! The handler (a scrape: a look at `/dev/shm` and NVML, milliseconds) runs on tokio's blocking
//! pool, capped at one thread: a slow NVML never stops the runtime thread, so accepts, `503`s and
//! deadlines keep their time meanwhile, while scrapes still run one at a time (NVML and the
//! registries are never asked in parallel) and the process has two threads at most.

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONNECTION, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::io::{self, ErrorKind, Write};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// The bounds of the endpoint (the defaults are [`Limits::DEFAULT`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once; one more is answered 503 and closed at once.
    pub max_connections: usize,
    /// From a connection's accept to the end of its request's header; past it, closed.
    pub read_timeout: Duration,
    /// From the first byte of a response written to its last byte taken by the kernel; past it,
    /// closed.
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

/// How long accepting pauses after `accept` failed for want of descriptors or memory (`EMFILE`,
/// `ENFILE`, `ENOBUFS`, `ENOMEM`): the listener stays readable, and retrying at once would spin.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// hyper's smallest `max_buf_size` (it panics below it): the read buffer of a connection never
/// grows past this or [`Limits::max_request_bytes`], whichever is larger.
const MIN_BUF: usize = 8 << 10;

/// A request as the handler sees it.
#[derive(Debug, PartialEq, Eq)]
pub struct Request<'a> {
    /// `GET`, `HEAD`, ... as the client sent it.
    pub method: &'a str,
    /// The request target's path, without its query (`/metrics`).
    pub path: &'a str,
}

/// A response: status code, `Content-Type` and body. `HEAD` requests get the header alone (hyper
/// leaves the body out and keeps its `Content-Length`).
#[derive(Debug)]
pub struct Response {
    /// The status code (200, 404, ...); one that is not a valid code is sent as 500.
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

    /// The response as hyper sends it, with `Connection: close` (and `Allow` on a 405).
    fn into_hyper(self) -> hyper::Response<Full<Bytes>> {
        let mut r = hyper::Response::new(Full::new(Bytes::from(self.body)));
        *r.status_mut() =
            StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static(self.content_type));
        h.insert(CONNECTION, HeaderValue::from_static("close"));
        if r.status() == StatusCode::METHOD_NOT_ALLOWED {
            r.headers_mut()
                .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        }
        r
    }
}

/// A TCP stream whose writes have a deadline: [`Limits::write_timeout`] from the first write
/// (the response's first byte: with one request per connection, nothing is written before it).
/// Past it, every write, flush and shutdown fails with `TimedOut`, and hyper drops the
/// connection; one pending at the deadline is woken by the timer to fail. Reads have no deadline
/// of their own here: hyper's `header_read_timeout` bounds the one read that matters.
#[derive(Debug)]
struct WriteDeadline {
    stream: TcpStream,
    timeout: Duration,
    /// Armed at the first write.
    deadline: Option<Pin<Box<Sleep>>>,
}

impl WriteDeadline {
    fn new(stream: TcpStream, timeout: Duration) -> WriteDeadline {
        WriteDeadline {
            stream,
            timeout,
            deadline: None,
        }
    }

    /// `op` on the stream within the write deadline; `arm`: the deadline starts now if it has
    /// not yet (writes of bytes arm it; hyper flushes on every turn of a connection, from its
    /// start, so a flush or a shutdown before any write must not).
    fn within<T>(
        &mut self,
        cx: &mut Context<'_>,
        arm: bool,
        op: impl FnOnce(Pin<&mut TcpStream>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        let timeout = self.timeout;
        if arm && self.deadline.is_none() {
            self.deadline = Some(Box::pin(tokio::time::sleep(timeout)));
        }
        let Some(deadline) = self.deadline.as_mut() else {
            return op(Pin::new(&mut self.stream), cx);
        };
        let late = || {
            Poll::Ready(Err(io::Error::new(
                ErrorKind::TimedOut,
                format!("the client took more than {timeout:?} to take the response"),
            )))
        };
        // A client that reads slowly but steadily makes every write ready: the clock is asked
        // before each, not only when one waits.
        if deadline.deadline() <= Instant::now() {
            return late();
        }
        match op(Pin::new(&mut self.stream), cx) {
            Poll::Pending => {
                // Registers this task with the timer, so a write that never becomes ready is
                // failed at the deadline.
                if deadline.as_mut().poll(cx).is_ready() {
                    late()
                } else {
                    Poll::Pending
                }
            }
            done => done,
        }
    }
}

impl AsyncRead for WriteDeadline {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteDeadline {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .within(cx, !buf.is_empty(), |s, cx| s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .within(cx, bufs.iter().any(|b| !b.is_empty()), |s, cx| {
                s.poll_write_vectored(cx, bufs)
            })
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().within(cx, false, |s, cx| s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut()
            .within(cx, false, |s, cx| s.poll_shutdown(cx))
    }
}

/// Answers a connection past the bound with 503 and closes it, without reading it and without
/// waiting: one non-blocking write of a response far smaller than any socket buffer (a partial
/// or failed write closes it all the same). Written here, not by hyper: a hyper connection would
/// read the request, which is what the bound keeps from happening.
fn refuse(stream: TcpStream, limits: &Limits) {
    let body = format!(
        "busy: {} connections are open, the most this endpoint serves at once; try again\n",
        limits.max_connections
    );
    let wire = format!(
        "HTTP/1.1 503 Service Unavailable\r\n{CONTENT_TYPE}: text/plain; charset=utf-8\r\n\
         content-length: {}\r\n{CONNECTION}: close\r\n{RETRY_AFTER}: 1\r\n\r\n{body}",
        body.len()
    );
    // `into_std` keeps the socket non-blocking, and takes it off the runtime's poller.
    if let Ok(mut s) = stream.into_std() {
        let _ = s.write(wire.as_bytes());
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
}

/// Serves HTTP on `listener` with `handle` until `stop` completes, within `limits`.
///
/// `handle` runs on a blocking thread of the runtime (one at most, so one request at a time).
///
/// # Errors
/// Only what makes serving impossible: the tokio runtime cannot be built (`io::Error` from the
/// OS: no threads, no epoll) or the listener cannot be made non-blocking or registered with it. A
/// failed `accept` closes nothing and pauses accepting for 100 ms; a connection's failure (its
/// deadline, a reset, a malformed request) ends that connection alone; neither is an error here.
pub fn serve<H>(
    listener: std::net::TcpListener,
    limits: Limits,
    handle: H,
    stop: impl Future<Output = ()>,
) -> io::Result<()>
where
    H: Fn(&Request<'_>) -> Response + Send + Sync + 'static,
{
    listener.set_nonblocking(true)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .max_blocking_threads(1)
        .thread_name("cuda-ipc-scrape")
        .build()?;
    rt.block_on(async move {
        let listener = TcpListener::from_std(listener)?;
        let handle = Arc::new(handle);
        let permits = Arc::new(Semaphore::new(limits.max_connections));
        let mut stop = pin!(stop);
        loop {
            let accepted = poll_fn(|cx| {
                if stop.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(None);
                }
                listener.poll_accept(cx).map(Some)
            })
            .await;
            let stream = match accepted {
                None => return Ok(()),
                Some(Ok((stream, _))) => stream,
                Some(Err(e))
                    if e.kind() == ErrorKind::Interrupted
                        || e.kind() == ErrorKind::ConnectionAborted =>
                {
                    continue;
                }
                Some(Err(e)) => {
                    tracing::warn!(
                        "metrics endpoint: accept failed ({e}); accepting again in {ACCEPT_PAUSE:?}"
                    );
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                    continue;
                }
            };
            let Ok(permit) = permits.clone().try_acquire_owned() else {
                refuse(stream, &limits);
                continue;
            };
            tokio::spawn(connection(stream, permit, limits, handle.clone()));
        }
    })
}

/// Serves one connection, holding `permit` until it is closed.
///
/// The connection is handed to hyper only once its first bytes have come, within the read
/// deadline: an idle connection is then this task, a timer entry and the socket's registration
/// (a few hundred bytes), not hyper's state and its 8 KiB read buffer, so a thousand idle clients
/// cost little and leave nothing behind (`a_thousand_idle_connections_...` in
/// `cli/tests/metrics_endpoint.rs`). hyper gets what is left of the read deadline for the rest of
/// the header.
async fn connection<H>(
    stream: TcpStream,
    permit: OwnedSemaphorePermit,
    limits: Limits,
    handle: Arc<H>,
) where
    H: Fn(&Request<'_>) -> Response + Send + Sync + 'static,
{
    let accepted = Instant::now();
    // A peek, not `readable()`: a fresh socket may be reported ready before anything came, and
    // a peek that would block clears that and waits.
    if !matches!(
        tokio::time::timeout(limits.read_timeout, stream.peek(&mut [0u8; 1])).await,
        Ok(Ok(1..))
    ) {
        // Nothing sent within the read deadline, the client left (0 bytes), or the socket
        // failed: closed unanswered.
        return;
    }
    let left = limits.read_timeout.saturating_sub(accepted.elapsed());
    let service = service_fn(move |req: hyper::Request<Incoming>| {
        let handle = handle.clone();
        async move { Ok::<_, Infallible>(answer(handle, &req).await.into_hyper()) }
    });
    // Boxed: the task stays small while it waits above; hyper's state is made only now.
    let conn = Box::pin(
        http1::Builder::new()
            .timer(TokioTimer::new())
            // hyper reads a zero timeout as none: at least a millisecond.
            .header_read_timeout(left.max(Duration::from_millis(1)))
            .keep_alive(false)
            .max_buf_size(limits.max_request_bytes.max(MIN_BUF))
            .max_header_size(limits.max_request_bytes)
            .serve_connection(
                TokioIo::new(WriteDeadline::new(stream, limits.write_timeout)),
                service,
            ),
    );
    if let Err(e) = conn.await {
        tracing::debug!("metrics endpoint: connection closed: {e}");
    }
    // The slot is free again once the connection is closed.
    drop(permit);
}

/// `handle`'s answer to `req`, taken on the blocking thread; a handler that panicked is
/// answered 500.
async fn answer<H>(handle: Arc<H>, req: &hyper::Request<Incoming>) -> Response
where
    H: Fn(&Request<'_>) -> Response + Send + Sync + 'static,
{
    let method: Method = req.method().clone();
    let path = req.uri().path().to_string();
    let r = tokio::task::spawn_blocking(move || {
        handle(&Request {
            method: method.as_str(),
            path: &path,
        })
    })
    .await;
    r.unwrap_or_else(|e| Response::text(500, format!("the request's handler failed: {e}\n")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::SocketAddr;
    use std::time::Instant;

    /// A server on a free loopback port with `limits`, answering `/big` with `big` bytes and
    /// anything else with `ok`; stopped (and joined) when dropped.
    struct TestServer {
        addr: SocketAddr,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl TestServer {
        fn start(limits: Limits, big: usize) -> TestServer {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let thread = std::thread::spawn(move || {
                serve(
                    listener,
                    limits,
                    move |r| match r.path {
                        "/big" => Response {
                            status: 200,
                            content_type: "application/octet-stream",
                            body: vec![b'x'; big],
                        },
                        "/panic" => panic!("a handler that fails"),
                        "/slow" => {
                            std::thread::sleep(Duration::from_secs(3));
                            Response::text(200, "slow\n")
                        }
                        p => Response::text(200, format!("ok {} {p}\n", r.method)),
                    },
                    async {
                        let _ = stopped.await;
                    },
                )
                .unwrap();
            });
            TestServer {
                addr,
                stop: Some(stop),
                thread: Some(thread),
            }
        }

        /// `request` on a new connection: the whole answer, and how long it took.
        fn send(&self, request: &[u8]) -> (String, Duration) {
            let t = Instant::now();
            let mut s = std::net::TcpStream::connect(self.addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.write_all(request).unwrap();
            let mut all = Vec::new();
            let _ = s.read_to_end(&mut all);
            (String::from_utf8_lossy(&all).into_owned(), t.elapsed())
        }

        /// One GET of `path` on a new connection: the whole answer, and how long it took.
        fn get(&self, path: &str) -> (String, Duration) {
            self.send(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        }
    }

    impl Drop for TestServer {
        fn drop(&mut self) {
            drop(self.stop.take());
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

    /// The value of `name` in the header of `all` (case-insensitive name).
    fn header<'a>(all: &'a str, name: &str) -> Option<&'a str> {
        let head = all.split("\r\n\r\n").next()?;
        head.lines().skip(1).find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    #[test]
    fn each_request_gets_one_response_with_its_length_and_the_connection_closes() {
        let srv = TestServer::start(limits(4, 2000, 2000), 10);
        let (all, _) = srv.get("/a?b");
        assert!(all.starts_with("HTTP/1.1 200 OK\r\n"), "{all}");
        assert_eq!(header(&all, "content-length"), Some("10"), "{all}");
        assert_eq!(header(&all, "connection"), Some("close"), "{all}");
        assert!(all.ends_with("\r\n\r\nok GET /a\n"), "{all}");
        // HEAD: the header alone, with the body's length.
        let (all, _) = srv.send(b"HEAD /big HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(all.starts_with("HTTP/1.1 200 OK\r\n"), "{all}");
        assert_eq!(header(&all, "content-length"), Some("10"), "{all}");
        assert!(all.ends_with("\r\n\r\n"), "{all}");
        // An HTTP/1.0 client gets its answer and the close too.
        let (all, _) = srv.send(b"GET /old HTTP/1.0\r\n\r\n");
        assert!(all.ends_with("ok GET /old\n"), "{all}");
    }

    #[test]
    fn garbage_an_endless_header_and_a_failing_handler_get_an_error_status_and_a_close() {
        let srv = TestServer::start(limits(4, 2000, 2000), 10);
        let (all, _) = srv.send(b"hello\r\n\r\n");
        assert!(all.starts_with("HTTP/1.1 400 "), "{all}");
        let (all, _) = srv.send(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n");
        assert!(all.starts_with("HTTP/1.1 400 "), "{all}");
        // Longer than the 1024 bytes of header allowed, and no end in sight.
        let mut endless = b"GET / HTTP/1.1\r\nX: ".to_vec();
        endless.extend_from_slice(&[b'a'; 2000]);
        let (all, _) = srv.send(&endless);
        assert!(all.starts_with("HTTP/1.1 431 "), "{all}");
        let (all, _) = srv.get("/panic");
        assert!(all.starts_with("HTTP/1.1 500 "), "{all}");
        // And the server still answers.
        let (all, _) = srv.get("/after");
        assert!(all.ends_with("ok GET /after\n"), "{all}");
    }

    #[test]
    fn a_client_that_never_reads_a_long_response_is_dropped_at_the_write_deadline_and_others_are_answered_meanwhile()
     {
        // 64 MiB: more than the loopback socket buffers of both ends take.
        let srv = TestServer::start(limits(8, 5000, 1500), 64 << 20);
        let mut stuck = std::net::TcpStream::connect(srv.addr).unwrap();
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
        let mut pipe = std::net::TcpStream::connect(srv.addr).unwrap();
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
    }

    #[test]
    fn connections_past_the_bound_are_answered_503_at_once_and_idle_ones_leave_at_the_read_deadline()
     {
        let srv = TestServer::start(limits(3, 1500, 1000), 10);
        let idle: Vec<std::net::TcpStream> = (0..3)
            .map(|_| std::net::TcpStream::connect(srv.addr).unwrap())
            .collect();
        // Accepted in order: the fourth finds the bound taken.
        std::thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        let mut s = std::net::TcpStream::connect(srv.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut all = Vec::new();
        let _ = s.read_to_end(&mut all);
        let all = String::from_utf8_lossy(&all);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert!(
            all.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{all}"
        );
        assert_eq!(header(&all, "retry-after"), Some("1"), "{all}");
        assert_eq!(header(&all, "connection"), Some("close"), "{all}");
        assert!(all.contains("3 connections"), "{all}");
        let body = all.split("\r\n\r\n").nth(1).unwrap_or("");
        assert_eq!(
            header(&all, "content-length"),
            Some(body.len().to_string().as_str()),
            "{all}"
        );
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

    #[test]
    fn a_client_that_sends_its_header_slowly_is_closed_at_the_read_deadline_even_while_sending() {
        let srv = TestServer::start(limits(4, 1000, 1000), 10);
        let mut s = std::net::TcpStream::connect(srv.addr).unwrap();
        s.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Padding: ")
            .unwrap();
        let t = Instant::now();
        // A byte every 50 ms, for 20 s if the server let it: the header never ends, and never
        // reaches its 1024-byte bound. The writes fail once the server has closed (the first
        // one after the close draws a reset, the next fails).
        let closed = (0..400).any(|_| {
            std::thread::sleep(Duration::from_millis(50));
            s.write_all(b"a").is_err()
        });
        assert!(closed, "still open after {:?}", t.elapsed());
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[test]
    fn a_slow_handler_keeps_neither_the_bound_nor_the_read_deadline_waiting_and_its_answer_is_not_timed_from_the_connect()
     {
        let srv = TestServer::start(limits(2, 1000, 1000), 10);
        // The handler sleeps 3 s on its thread; the runtime's thread is free meanwhile. Its
        // answer comes after both deadlines (1 s) counted from the connect: the write deadline
        // counts from the answer's first byte, and the read deadline ended with the header.
        let slow = std::thread::spawn({
            let addr = srv.addr;
            move || {
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                s.write_all(b"GET /slow HTTP/1.1\r\n\r\n").unwrap();
                let mut all = String::new();
                let _ = s.read_to_string(&mut all);
                all
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        let idle = std::net::TcpStream::connect(srv.addr).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        // Both slots taken: the third is refused at once, not after the slow one.
        let (all, took) = srv.get("/x");
        assert!(all.starts_with("HTTP/1.1 503 "), "{all}");
        assert!(took < Duration::from_secs(1), "refused in {took:?}");
        // The idle one is closed at its read deadline (1 s), while the handler still sleeps.
        let t = Instant::now();
        let mut idle = idle;
        idle.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut b = Vec::new();
        assert!(
            matches!(idle.read_to_end(&mut b), Ok(0)),
            "closed, said nothing"
        );
        assert!(
            t.elapsed() < Duration::from_millis(2000),
            "{:?}",
            t.elapsed()
        );
        let all = slow.join().unwrap();
        assert!(all.ends_with("slow\n"), "{all:?}");
    }
}
